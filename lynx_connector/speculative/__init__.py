"""Speculative decode-on-anchor: D decodes on the anchor plane while the residual is in flight, then verifies.

``scheduler.LynxSpecScheduler`` (the vLLM scheduler class for ``lynx:speculative``), ``proposer.NullProposer``
(drafts come from the scheduler, not a draft model), ``confidence`` (the greedy-margin gate), ``state`` (per-request
phases) and ``messages`` (what the connector halves exchange about speculation).
"""
