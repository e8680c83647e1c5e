"""Confidence gate for decode-on-anchor speculation: which tokens are worth holding.

Verification accepts held tokens up to the first one that full-precision decoding would not have chosen, and
everything after that one is decoded on the anchor for nothing. With greedy decoding, a token can differ only
where the anchor's logits leave it a small lead over the runner-up: the anchor's KV error moves the logits by
a small amount, which changes the argmax only when the top two are close. On this project's real model and
text (``benchmarks/anchor_agreement.py --prompts 32 --margins``, the default anchor), 22 of the 26 first
disagreements after the first token came at a margin below 0.4 nats, while the median margin at the positions
before them was 1.67 (14% below 0.4); with the default threshold of 0.4, 97% of the held tokens were accepted.
Adaptive per-request gates did not hold that acceptance better on held-out prompts (``benchmarks/gate_adapt.py``,
benchmarks/README.md "A per-request (adaptive) confidence gate"). The anchor phase stops at the first
token whose margin is below ``speculative_min_margin`` (that token is not held; the request waits for the
residual, and the verification pass then decodes it at full precision). Outputs are unchanged (only held tokens are ever
verified, and greedy verification releases exactly the full-precision tokens); what changes is how many
tokens are decoded on the anchor for nothing.

The margin needs the top two log-probabilities of each anchor-phase step. vLLM computes sample logprobs for
requests that ask for them, so a greedy speculative request that asks for fewer than 2 gets a copy of its
sampling parameters asking for 2 (before it first reaches the worker); the logprobs it did not ask for are
removed from its outputs again (the frontend itself trims the top-k to what was asked). Sampled requests
(temperature > 0) are not gated: their verification is a rejection rule on distributions, not an argmax.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from vllm.sampling_params import SamplingType

from lynx_connector.logger import init_logger

if TYPE_CHECKING:
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

#: Sample logprobs a gated request needs: the chosen token's and the runner-up's.
GATE_LOGPROBS = 2


def token_margin(token_ids: Any, logprobs: Any) -> float:
    """Margin of one sampled position: the sampled token's log-probability minus the best other token's.

    ``token_ids``/``logprobs``: one row of vLLM's sample logprobs (the sampled token first, then the top-k).
    Negative when the sampled token is not the most likely one; +inf when no other token is listed."""
    ids = [int(t) for t in token_ids]
    lps = [float(x) for x in logprobs]
    others = [lp for t, lp in zip(ids[1:], lps[1:], strict=True) if t != ids[0]]
    return lps[0] - max(others) if others else float("inf")


class ConfidenceGate:
    def __init__(self, min_margin: float, max_logprobs: int):
        usable = max_logprobs == -1 or max_logprobs >= GATE_LOGPROBS
        if min_margin > 0 and not usable:
            logger.warning("Lynx speculative_min_margin=%s needs max_logprobs >= %d (got %d): confidence gating "
                           "is off, every anchor-phase token up to the cap is held", min_margin, GATE_LOGPROBS,
                           max_logprobs)
        self.min_margin = min_margin if usable else 0.0
        #: Gated requests -> the sampling parameters their client sent (kept when they asked for enough logprobs).
        self._client: dict[str, Any] = {}
        #: Margin of each gated request's latest anchor-phase token, from the step's model runner output.
        self._margins: dict[str, float] = {}

    @property
    def enabled(self) -> bool:
        return self.min_margin > 0

    def prepare(self, request: Request) -> None:
        """Called before a speculative request first reaches the worker: gate it if it is greedy."""
        sp = request.sampling_params
        if not self.enabled or request.request_id in self._client or sp is None:
            return
        if sp.sampling_type != SamplingType.GREEDY or getattr(sp, "logprob_token_ids", None):
            return
        self._client[request.request_id] = sp
        if sp.logprobs is None or 0 <= sp.logprobs < GATE_LOGPROBS:
            mine = copy.copy(sp)
            mine.logprobs = GATE_LOGPROBS
            request.sampling_params = mine

    def client_params(self, request: Request) -> Any:
        """The sampling parameters the client sent (the scheduler's copy may ask for more logprobs)."""
        return self._client.get(request.request_id, request.sampling_params)

    def gated(self, req_id: str) -> bool:
        return req_id in self._client

    def observe(self, output: ModelRunnerOutput, req_ids: Any) -> None:
        """Record the margin of the token each of ``req_ids`` (anchor-phase requests) sampled this step."""
        lists = output.logprobs
        if lists is None:
            return
        for req_id in req_ids:
            idx = output.req_id_to_index.get(req_id) if req_id in self._client else None
            if idx is None or idx >= len(output.sampled_token_ids) or len(output.sampled_token_ids[idx]) != 1:
                continue
            row = lists.slice_request(idx, 1)
            if len(row.logprob_token_ids):
                self._margins[req_id] = token_margin(row.logprob_token_ids[0], row.logprobs[0])

    def confident(self, req_id: str) -> bool:
        """Whether the token just sampled for ``req_id`` on the anchor may be held (consumes its margin)."""
        margin = self._margins.pop(req_id, None)
        return margin is None or margin >= self.min_margin

    def strip(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        """Remove the sample logprobs a gated request's client did not ask for."""
        if not self._client:
            return
        for eco in outputs.values():
            for out in eco.outputs:
                sp = self._client.get(out.request_id)
                if sp is not None and sp.logprobs is None:
                    out.new_logprobs = None

    def forget(self, requests: dict[str, Request]) -> None:
        """Drop the state of requests that are gone from ``requests`` or finished (after their last output)."""
        for d in (self._client, self._margins):
            for req_id in [r for r in d if r not in requests or requests[r].is_finished()]:
                del d[req_id]
