"""Speculative decode-on-anchor: D decodes on the anchor plane while the residual is in flight, then verifies.

``scheduler.LynxSpecScheduler`` (the vLLM scheduler class for ``lynx:speculative``), ``proposer.NullProposer``
(drafts come from the scheduler, not a draft model), ``confidence`` (the greedy-margin gate) and ``state``
(per-request phases). The scheduler talks to the connector's scheduler half only through
``lynx_connector.speculation_port.SpeculationPort``; the connector's base halves import nothing from this package.
"""
