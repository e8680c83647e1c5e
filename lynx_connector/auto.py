"""``auto`` (issue 16.3): P picks the transfer mode of each request when it is scheduled, among the allowed
full-precision modes only (the lossless passthrough ``bf16``, Lynx ``full``, Lynx ``speculative``: never a
4-bit, fp8, int8 or anchor-only mode), from what is known at that moment.

Rule (:func:`choose`; docs/OPERATIONS.md "Auto mode"). ``R`` is the link rate: ``link_gbps`` when configured,
else measured from the transfers D read whole within ``auto_window_s``: their bytes over the link time D
measured reading them, which each Done carries (D shares each moment among its chunks in flight, so it counts
neither P's forward nor D's waits: docs/PROTOCOL.md section 8); ``Q`` the bytes staged on P that D has not finished
reading; ``T_p`` the estimated prefill time of this prompt (P's recent seconds per prompt token); ``C`` the
estimated Lynx codec time of this prompt (P's recent Lynx encode seconds per token, twice: D decodes too).

* ``speculative`` is a candidate only when the request can release its first token on the anchor (greedy, no
  logprobs, no structured output) and P runs the speculative scheduler (the ``lynx:auto`` preset sets it on P
  and D alike); otherwise its first token would wait for the residual like ``full``'s.
* no rate known (unpaced link, nothing measured yet): ``bf16`` (reason ``no_link_rate``).
* otherwise the estimated time until D may release the first token, smallest wins (ties: the lossless one):
  ``bf16``: ``W + B_bf16 / R``; ``full``: ``W + (B_anchor + B_residual) / R + C``; ``speculative``:
  ``B_anchor / R + C``, where ``W = max(0, Q / R - T_p)`` is the queue still ahead when the prompt is staged
  (D's ranking lets a speculative anchor go before the queued whole requests: transport/ranking.py).
  Reasons: ``fast_link`` (bf16 won), ``slow_link`` (speculative won), ``slow_link_no_speculation`` (full won:
  speculative was no candidate), ``only_choice`` (one allowed candidate).

Pure Python apart from the plane sizes (the codec's ``plane_nbytes``), so the rule is unit-tested directly.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lynx_connector.logger import init_logger
from lynx_connector.modes import get_mode

logger = init_logger(__name__)

__all__ = ["AUTO_KEY", "AUTO_REASONS", "AutoChoice", "AutoEstimator", "AutoPolicy", "AutoRequest", "LinkMeter", "LinkView",
           "choose"]

#: The signed key of P's params that tells D the request's mode was chosen by ``auto`` (its value: the reason);
#: D returns ``{"mode", "reason"}`` under it in the request's final output.
AUTO_KEY = "lynx_auto"
#: The ``reason`` label of ``vllm:lynx_auto_choices``.
AUTO_REASONS: tuple[str, ...] = ("only_choice", "no_link_rate", "fast_link", "slow_link",
                                 "slow_link_no_speculation")


@dataclass(frozen=True)
class LinkView:
    """What P knows about the link when it chooses."""

    bytes_per_s: float | None
    source: str  # "configured", "measured" or "none"
    queued_bytes: int = 0


@dataclass(frozen=True)
class AutoRequest:
    """One request as the rule sees it: per candidate mode, the bytes that must land before D may release the
    first token; whether it may release that token on the anchor; its estimated prefill and codec seconds."""

    first_bytes: Mapping[str, int]
    early_first_token: bool
    prefill_s: float = 0.0
    codec_s: float = 0.0


@dataclass(frozen=True)
class AutoChoice:
    mode: str
    reason: str
    estimates: Mapping[str, float]


def choose(candidates: Sequence[str], link: LinkView, req: AutoRequest, speculation: bool) -> AutoChoice:
    """The rule of the module docstring. ``candidates``: the allowed auto modes (non-empty, table order)."""
    if not candidates:
        raise ValueError("auto has no candidate mode")
    usable = [m for m in candidates
              if not get_mode(m).late_residual or (speculation and req.early_first_token)]
    if not usable:  # only speculative allowed: it stays the choice, its first token waits for the residual
        usable = list(candidates)
    if len(usable) == 1:
        return AutoChoice(usable[0], "only_choice", {})
    rate = link.bytes_per_s
    if rate is None or rate <= 0:
        mode = next((m for m in usable if get_mode(m).lossless), usable[0])  # the passthrough
        return AutoChoice(mode, "no_link_rate", {})
    wait = max(0.0, link.queued_bytes / rate - req.prefill_s)
    est: dict[str, float] = {}
    for m in usable:
        row = get_mode(m)
        t = req.first_bytes[m] / rate + (req.codec_s if row.two_stream else 0.0)
        est[m] = t if row.late_residual else wait + t
    mode = min(usable, key=lambda m: (est[m], not get_mode(m).lossless))
    row = get_mode(mode)
    if row.lossless:
        reason = "fast_link"
    elif row.late_residual:
        reason = "slow_link"
    else:  # full: speculative (never slower on the same link) was no candidate for this request
        reason = "slow_link_no_speculation"
    return AutoChoice(mode, reason, est)


class LinkMeter:
    """P's measured link rate: bytes over link time of the transfers D read whole within ``window_s``, each as
    (when D's Done came, the link seconds D measured, bytes), as ``TransferSource.take_pulled`` reports them. D
    shares its busy time among its transfers, so the link times add up: concurrent transfers are not counted
    twice, and the rate is the one a transfer gets while D reads (from every P it pulls from)."""

    def __init__(self, window_s: float, clock: Any = time.monotonic) -> None:
        self._window_s = window_s
        self._clock = clock
        self._done: deque[tuple[float, float, int]] = deque(maxlen=512)

    def add(self, pulled: Iterable[tuple[float, float, int]]) -> None:
        for end, link_s, nbytes in pulled:
            if link_s > 0.0 and nbytes > 0:
                self._done.append((end, link_s, nbytes))

    def rate(self) -> float | None:
        """Bytes per second of link time, or None without a recent measured transfer."""
        horizon = self._clock() - self._window_s
        recent = [(s, n) for e, s, n in self._done if e >= horizon]
        busy = sum(s for s, _ in recent)
        return sum(n for _, n in recent) / busy if busy > 0 else None


class AutoEstimator:
    """The scheduler half's (P) view of the inputs: the configured or reported link, P's recent prefill seconds
    per prompt token and Lynx codec seconds per token (exponential averages), the model's plane sizes."""

    ALPHA = 0.3

    def __init__(self, link_bytes_per_s: float | None, geometry: tuple[int, int, int], codec: Any,
                 clock: Any = time.monotonic) -> None:
        self._configured = link_bytes_per_s
        self._measured: float | None = None
        self._clock = clock
        self._queued, self._queued_at = 0, clock()
        self._heads, self._head_size, self._layers = geometry
        self._codec = codec  # the Lynx codec with the instance's options (its planes)
        self.prefill_s_per_token = 0.0
        self.codec_s_per_token = 0.0
        self._started: dict[str, tuple[float, int]] = {}

    def observe_link(self, measured_bytes_per_s: float | None, queued_bytes: int, codec_s_per_token: float) -> None:
        """From P's workers (worker metadata): the measured rate, bytes staged and unread, Lynx encode s/token."""
        self._measured = measured_bytes_per_s or None
        self._queued, self._queued_at = max(0, int(queued_bytes)), self._clock()
        if codec_s_per_token > 0:
            self.codec_s_per_token = 2.0 * codec_s_per_token  # D decodes about as long as P encodes

    def link(self) -> LinkView:
        """The link now. The workers report only on P's steps, so an idle P's last report is old: its queue is
        taken to have drained at the link's rate since."""
        rate = self._configured if self._configured is not None else self._measured
        source = "configured" if self._configured is not None else "measured" if rate is not None else "none"
        queued = self._queued
        if rate is not None:
            queued = max(0, int(queued - rate * (self._clock() - self._queued_at)))
        return LinkView(rate, source, queued)

    def started(self, req_id: str, num_tokens: int) -> None:
        self._started[req_id] = (self._clock(), num_tokens)

    def finished(self, req_id: str, prefilled: bool) -> None:
        """A request P scheduled is finished: its prefill seconds per token update the estimate."""
        start = self._started.pop(req_id, None)
        if start is None or not prefilled or start[1] <= 0:
            return
        per = (self._clock() - start[0]) / start[1]
        a = self.ALPHA if self.prefill_s_per_token else 1.0
        self.prefill_s_per_token += a * (per - self.prefill_s_per_token)

    def request(self, candidates: Sequence[str], num_tokens: int, dtype: Any, early: bool) -> AutoRequest:
        first: dict[str, int] = {}
        for m in candidates:
            row = get_mode(m)
            codec = self._codec if row.two_stream else None
            first[m] = self._layers * row.wire_nbytes(num_tokens, self._heads, self._head_size, dtype, codec)[0]
        return AutoRequest(first, early, self.prefill_s_per_token * num_tokens,
                           self.codec_s_per_token * num_tokens)



class AutoPolicy:
    """The scheduler half's (P) use of the rule: inputs gathered from vLLM's request and config and from the
    workers' reports, one choice per request (siblings of a fanned-out request share their parent's: D pulls
    each child's staging with the one mode P's answer names), each choice logged and counted."""

    MAX_PARENTS = 4096

    def __init__(self, vllm_config: Any, config: Any, stats: Any) -> None:
        self._vllm_config, self._config, self._stats = vllm_config, config, stats
        self._est: AutoEstimator | None = None
        self._by_parent: OrderedDict[str, tuple[str, str]] = OrderedDict()

    def estimator(self) -> AutoEstimator:
        if self._est is None:
            from lynx_connector.codec import get_codec
            from lynx_connector.modes import LYNX_CODEC

            mc, pc = self._vllm_config.model_config, self._vllm_config.parallel_config
            gbps = self._config.link_gbps
            self._est = AutoEstimator(None if gbps is None else gbps * 1e9 / 8,
                                      (mc.get_num_kv_heads(pc), mc.get_head_size(), mc.get_num_layers(pc)),
                                      get_codec(LYNX_CODEC, **dict(self._config.codec_options)))
        return self._est

    def observe(self, p_link: tuple[float, int, float] | None) -> None:
        if p_link is not None:
            self.estimator().observe_link(*p_link)

    def choose(self, request: Any, kv_dtype: str, speculation: bool,
               fits: Callable[[str], bool] | None = None) -> tuple[str, str]:
        """(mode, reason) for ``request`` (a vLLM Request asking for auto); ``fits(mode)``: whether its prompt fits
        P's staging in that mode (the modes that do not are no candidates, unless none does)."""
        from lynx_connector.fanout import child_of

        req_id = request.request_id
        child = child_of(req_id)
        if child is not None and child[1] in self._by_parent:
            return self._by_parent[child[1]]
        est = self.estimator()
        sp = getattr(request, "sampling_params", None)
        from vllm.sampling_params import SamplingType

        early = (sp is not None and sp.sampling_type == SamplingType.GREEDY and sp.logprobs is None
                 and not request.use_structured_output)
        n = request.num_prompt_tokens
        candidates = self._config.auto_modes
        if fits is not None:
            candidates = [m for m in candidates if fits(m)] or candidates
        link = est.link()
        req = est.request(candidates, n, _dtype(kv_dtype, self._vllm_config), early)
        choice = choose(candidates, link, req, speculation)
        est.started(req_id, n)
        logger.info("Request %s: auto chose %s (%s): link %s (%s), %d bytes queued, %d prompt tokens, prefill "
                    "~%.3f s, codec ~%.3f s, estimated seconds to the first token %s", req_id, choice.mode,
                    choice.reason, "unknown" if link.bytes_per_s is None else f"{link.bytes_per_s * 8 / 1e9:.3g} Gbit/s",
                    link.source, link.queued_bytes, n, req.prefill_s, req.codec_s,
                    {m: round(t, 4) for m, t in choice.estimates.items()})
        self._stats.record_auto(choice.mode, choice.reason)
        if child is not None:
            self._by_parent[child[1]] = (choice.mode, choice.reason)
            while len(self._by_parent) > self.MAX_PARENTS:
                self._by_parent.popitem(last=False)
        return choice.mode, choice.reason

    def finished(self, req_id: str, prefilled: bool) -> None:
        if self._est is not None:
            self._est.finished(req_id, prefilled)


def _dtype(name: str, vllm_config: Any) -> Any:
    """P's KV cache dtype (its workers' handshake), else the model's."""
    import torch

    dt = getattr(torch, name, None) if name else None
    return dt if isinstance(dt, torch.dtype) else vllm_config.model_config.dtype
