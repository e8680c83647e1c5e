"""LynxSpecScheduler: decode on the anchor, verify when the residual lands (D side, ``--scheduler-cls``).

A vLLM ``Scheduler`` subclass. For a request whose KV arrives in ``speculative`` mode:

1. The connector reports it ready once the 4-bit anchor is in its blocks; it decodes on that KV. Every
   sampled token is *held*: appended to the request (so the next step decodes after it) but returned to
   nobody, and stop conditions are only probed (a probe that fires stops further decoding, it does not
   finish the request). At ``max_speculative_tokens`` held tokens (or after a probed stop) the request
   waits for the residual, hidden from the running queue.
2. When the worker reports the residual merged (worker metadata -> ``update_connector_output``), the next
   ``schedule()`` rewinds the request to its last prompt token (output tokens, block hashes and
   ``num_computed_tokens`` truncated; the MRV1 worker truncates its copy from ``num_output_tokens``) and
   sets the held tokens as ``spec_token_ids``. vLLM then computes ``[last prompt token, held...]`` on the
   refined KV in one forward and its ``RejectionSampler`` accepts the longest agreeing prefix and samples
   the target's token at the first disagreement (greedy: argmax; random: accept w.p. p(x), else sample
   from p without x, which keeps the output distribution exactly p). More held tokens than
   ``num_speculative_tokens`` are verified in several passes (a pass continues only while everything
   agrees). Released tokens go through vLLM's own stop checks, logprobs and outputs: they are those of
   the verification pass.

Confidence gate (greedy requests, ``speculative_min_margin``; ``lynx_connector.speculative.confidence``): a token
sampled on the anchor whose top-two logit margin is below the threshold is not held and the request waits
for the residual, as it does at the cap; the verification pass decodes that position at full precision.

First token: P sampled one token after the prompt at full precision and passes it in ``kv_transfer_params``
(``lynx_first_token``). For a greedy request without logprobs, when D's first token on the anchor equals
P's, it is released at once (it *is* the full-precision token): time to first token becomes that of the
anchor. It is then committed: verification rewinds to the last prompt token, recomputes it and the
committed token on the refined KV and verifies the held tokens after it. When the two differ (or for
sampled requests, whose output distribution must stay exactly the full-precision one, and requests asking
for logprobs, which must come from a full-precision pass) the first token is held and verified like the rest;
when they differ, whatever D would decode after its own first token would be rejected, so the request waits
for the residual at once (``first_token_mismatch``).

Concurrent flow (``lynx proxy --flow pipelined``): D's params come from the proxy before P has sampled anything,
so P's token arrives later, from P's side channel (``Regions.first_token``, docs/PROTOCOL.md section 6), through
the worker metadata, often a step or two after D's first token on the anchor. Until then that first token is
held like any other and decoding on the anchor goes on; when P's token arrives, the first held token is released
then (an output of that step) if it equals P's, with exactly the semantics above (committed; the held tokens
after it stay held), and speculation stops with ``first_token_mismatch`` if it does not. A first token whose
stop probe fired (EOS, ``max_tokens`` 1) is not released early: it is judged by the verification pass, like
a first token that never gets P's (P's token never arrived, or the residual came first).

Needs ``speculative_config = {"method": "custom_class", "model": NULL_PROPOSER, "num_speculative_tokens": K}``
(switches the verification machinery on, forces MRV1 and synchronous scheduling). Prefix caching is
switched off on an instance that runs this scheduler (anchor-precision blocks must never be shared, and the
rewind invalidates block hashes of held tokens). Requests in any other mode are scheduled exactly as by
vLLM's ``Scheduler``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from vllm.sampling_params import SamplingType
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.sched.utils import check_stop
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.request import RequestStatus

from lynx_connector.config import REPORT_KEY
from lynx_connector.logger import init_logger
from lynx_connector.speculation_port import SpeculationPort, speculation_port
from lynx_connector.speculative.confidence import ConfidenceGate
from lynx_connector.speculative.state import Phase, SpecState
from lynx_connector.stats import LynxStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

#: Key of the per-request speculation counters added to the final output's kv_transfer_params: only for requests
#: that ask for them (``REPORT_KEY`` in their kv_transfer_params) or on a D with ``report_speculation``.
SPEC_PARAMS_KEY = "lynx_speculation"


class LynxSpecScheduler(Scheduler):
    def __init__(self, vllm_config: VllmConfig, *args: Any, **kwargs: Any) -> None:
        if vllm_config.cache_config.enable_prefix_caching:
            logger.warning("Lynx speculative scheduler: disabling prefix caching on this instance (blocks decoded "
                           "on an anchor must not be shared, and verification rewinds their block hashes)")
            vllm_config.cache_config.enable_prefix_caching = False
        super().__init__(vllm_config, *args, **kwargs)
        # The connector's scheduler half, through its speculation interface (None without a LynxConnector).
        self._lynx: SpeculationPort | None = speculation_port(self.connector)
        self._k = int(self.num_spec_tokens)
        self._cap = self._lynx.max_speculative_tokens if self._lynx is not None else 0
        self._spec: dict[str, SpecState] = {}
        self._done: dict[str, dict[str, int]] = {}  # finished this step: counters for their final output
        self._report_all = self._lynx is not None and self._lynx.report_speculation
        self._stats = LynxStats()
        self._gate = ConfidenceGate(self._lynx.speculative_min_margin if self._lynx is not None else 0.0,
                                    vllm_config.model_config.max_logprobs)
        enabled = self._lynx is not None and self._k > 0 and self._cap > 0
        if enabled:
            assert self._lynx is not None
            self._lynx.enable()
            logger.info("Lynx speculative scheduler: up to %d tokens decoded on the anchor per request, verified "
                        "in passes of up to %d drafts; greedy requests stop at a logit margin below %s", self._cap,
                        self._k, self._gate.min_margin if self._gate.enabled else "(gate off)")
        else:
            logger.warning("Lynx speculative scheduler without %s: speculative requests are served as 'full'",
                           "a LynxConnector" if self._lynx is None else
                           "a speculative config (num_speculative_tokens > 0)" if self._k <= 0 else
                           "max_speculative_tokens > 0")

    # ---- scheduling ---------------------------------------------------------------------------------------
    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        if self._lynx is not None:
            for req_id in sorted(self._lynx.take_residual_merged()):
                self._on_residual_merged(req_id)
            if self._gate.enabled:  # requests not on the worker yet: ask for the logprobs the gate needs
                for req_id in self._lynx.pending():
                    req = self.requests.get(req_id)
                    if req is not None and req_id not in self._spec:
                        self._gate.prepare(req)
        for st in self._spec.values():  # (re)assert the drafts of pending passes (the proposer's [] clears them)
            if st.phase is Phase.VERIFY and st.scheduled is None:
                req = self.requests.get(st.req_id)
                if req is not None:
                    req.spec_token_ids = list(st.chunk)
        hidden = [r for r in self.running if (st := self._spec.get(r.request_id)) and st.must_wait(self._cap)]
        for r in hidden:
            self._spec[r.request_id].capped_steps += 1
        if not hidden:
            out = super().schedule(*args, **kwargs)
        else:
            # Hidden from this step only; they keep their slot in the running set (admission limit lowered) and
            # their place in its order: vLLM preempts from the back (FCFS), so an older request waiting to verify
            # must not fall behind newer ones.
            ids = {id(r) for r in hidden}
            place = {id(r): i for i, r in enumerate(self.running)}
            self.running = [r for r in self.running if id(r) not in ids]
            self.max_num_active_reqs -= len(hidden)
            try:
                out = super().schedule(*args, **kwargs)
            finally:
                self.max_num_active_reqs += len(hidden)
                self.running = sorted(self.running + hidden, key=lambda r: place.get(id(r), len(place)))
        for req_id in out.num_scheduled_tokens:
            st = self._spec.get(req_id)
            if st is not None and st.phase is Phase.VERIFY:
                st.scheduled = len(out.scheduled_spec_decode_tokens.get(req_id, ()))
        return out

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        # vLLM pads the first decode step of an async-loaded request with K "-1" drafts (to keep full CUDA
        # graphs uniform). They are always rejected: strip them so that step computes one position, and
        # vLLM's acceptance metrics only count real drafts.
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        for req_id, drafts in list(spec_tokens.items()):
            if drafts and all(t == -1 for t in drafts):
                del spec_tokens[req_id]
                scheduler_output.num_scheduled_tokens[req_id] -= len(drafts)
                scheduler_output.total_num_scheduled_tokens -= len(drafts)
        super()._update_after_schedule(scheduler_output)

    def _on_residual_merged(self, req_id: str) -> None:
        st = self._spec.get(req_id)
        req = self.requests.get(req_id)
        if req is None or req.is_finished():
            self._spec.pop(req_id, None)
            return
        if st is None:
            # Merged before any token was decoded on the anchor: decoding simply continues at full precision.
            self._spec[req_id] = st = SpecState(req_id)
            self._finish_speculation(st)
            return
        if st.phase is not Phase.ANCHOR:
            return
        if not st.decoded_on_anchor:
            self._finish_speculation(st)
            return
        if req.status != RequestStatus.RUNNING:  # defensive: anchor-phase requests are running or preempted
            logger.warning("Request %s: residual merged while %s; dropping its held tokens", req_id, req.status)
            self._drop_held(req, st)
            self._spec.pop(req_id, None)
            return
        # Recompute the last prompt token (its KV was computed over the anchor) and any committed token; the
        # held tokens after them are the drafts (none: the pass just decodes the next token at full precision).
        self._truncate_to_prompt(req, keep=st.committed)
        req.num_computed_tokens = req.num_prompt_tokens - 1
        st.phase = Phase.VERIFY
        req.spec_token_ids = list(st.next_chunk(self._k))
        logger.debug("Request %s: residual merged, verifying %d held tokens", req_id, len(st.held))

    # ---- outputs --------------------------------------------------------------------------------------------
    def _update_request_with_output(self, request: Request, new_token_ids: list[int],
                                    is_stale: bool = False) -> tuple[list[int], bool]:
        req_id = request.request_id
        st = self._spec.get(req_id)
        if st is None and self._lynx is not None and req_id in self._lynx.pending():
            self._spec[req_id] = st = self._new_state(request)
        if st is None:
            return super()._update_request_with_output(request, new_token_ids, is_stale)
        if st.phase is Phase.ANCHOR:
            confident = self._gate.confident(req_id)  # the margin of this step's token, consumed either way
            if new_token_ids and not st.committed and not st.held and st.prefill_token is not None:
                if new_token_ids[0] != st.prefill_token:
                    st.stopped = "first_token_mismatch"  # not appended: the request waits, then recomputes it
                    return [], False
                # D's first token on the anchor is P's full-precision token: release it now.
                st.committed = 1
                released, stopped = super()._update_request_with_output(request, new_token_ids[:1], is_stale)
                if stopped or len(new_token_ids) == 1:
                    return released, stopped
                new_token_ids = new_token_ids[1:]  # (cannot happen: no drafts in the anchor phase)
            for tok in new_token_ids:
                if st.must_wait(self._cap):
                    break  # cannot happen (such requests are not scheduled); never hold past the cap
                if not confident:
                    st.stopped = "low_margin"  # not appended: the verification pass decodes this position
                    break
                request.append_output_token_ids(tok)
                st.held.append(tok)
                st.speculated += 1
                status, reason = request.status, request.stop_reason
                st.would_stop = check_stop(request, self.max_model_len)
                request.status, request.stop_reason = status, reason
                if len(st.held) == 1 and not st.committed:
                    st.first_would_stop = st.would_stop
            return [], False
        more = st.verified(list(new_token_ids))
        if more:
            st.next_chunk(self._k)
        else:
            self._finish_speculation(st)
        return super()._update_request_with_output(request, new_token_ids, is_stale)

    def _new_state(self, request: Request) -> SpecState:
        """The state of a request whose first token was just sampled on the anchor: with P's first token when the
        request may release it early (greedy, no logprobs), or waiting for it (concurrent flow: not known yet)."""
        assert self._lynx is not None
        tok = self._lynx.take_first_token(request.request_id)
        sp = self._gate.client_params(request)
        early = sp is not None and sp.sampling_type == SamplingType.GREEDY and sp.logprobs is None
        return SpecState(request.request_id, prefill_token=tok if early else None,
                         awaits_first=early and tok is None)

    def _late_first_tokens(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        """P's first tokens that arrived after D's first token on the anchor (concurrent flow; module docstring):
        release the first held token now when it equals P's, else stop speculating (``first_token_mismatch``)."""
        assert self._lynx is not None
        for st in [s for s in self._spec.values() if s.awaits_first]:
            tok = self._lynx.take_first_token(st.req_id)
            req = self.requests.get(st.req_id)
            if tok is None and req is not None and st.phase is Phase.ANCHOR:
                continue  # not known yet
            st.awaits_first = False
            if tok is None or req is None or req.is_finished() or st.phase is not Phase.ANCHOR or not st.held:
                continue  # verifying already, or its first token was not held (low margin): verification decides
            if st.held[0] != tok:
                st.stopped = st.stopped or "first_token_mismatch"  # what follows D's first token would be rejected
                continue
            if st.first_would_stop:
                continue  # releasing it would finish the request: the verification pass judges it
            st.held.pop(0)
            st.speculated -= 1
            st.committed = 1
            prefill_stats = req.take_prefill_stats()
            if prefill_stats is not None:
                prefill_stats.finalize(self.kv_cache_manager.estimate_cached_tokens(req))
            eco = outputs.setdefault(req.client_index, EngineCoreOutputs())
            eco.outputs.append(EngineCoreOutput(request_id=st.req_id, new_token_ids=[tok], events=req.take_events(),
                                                prefill_stats=prefill_stats, trace_headers=req.trace_headers,
                                                num_nans_in_logits=req.num_nans_in_logits))
            logger.debug("Request %s: P's first token arrived after D's and equals it: released", st.req_id)

    def _finish_speculation(self, st: SpecState) -> None:
        self._spec.pop(st.req_id, None)
        self._record(st)

    def _record(self, st: SpecState) -> None:
        """A request's speculation is over (verified, preempted, its residual failed, or it finished): held tokens
        verification never reached are counted as dropped (none when it completed), then recorded."""
        st.drop_unverified()
        if self.log_stats:  # --disable-log-stats: make_stats never takes them, so none are kept
            self._stats.record_speculation(st.speculated, st.accepted, st.committed, st.stopped, st.dropped)
        req = self.requests.get(st.req_id)
        if self._report_all or (req is not None and (req.kv_transfer_params or {}).get(REPORT_KEY) is True):
            self._done[st.req_id] = st.summary()
        logger.info("Request %s: speculation %s", st.req_id, st.summary())

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> dict[int, EngineCoreOutputs]:
        if self._gate.enabled and self._lynx is not None:  # margins of the tokens sampled on the anchor
            self._gate.observe(model_runner_output, [r for r in self._lynx.pending()
                                                     if r not in self._spec or self._spec[r].phase is Phase.ANCHOR])
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        self._gate.strip(outputs)
        self._gate.forget(self.requests)
        if self._lynx is not None:
            for req_id in sorted(self._lynx.take_residual_failed()):
                self._on_residual_failed(req_id, outputs)
            self._late_first_tokens(outputs)
        if self._done:
            for eco in outputs.values():
                for out in eco.outputs:
                    summary = self._done.get(out.request_id)
                    if summary is not None and out.finish_reason is not None:
                        out.kv_transfer_params = {**(out.kv_transfer_params or {}), SPEC_PARAMS_KEY: summary}
            live = {r for r in self._done if r in self.requests and not self.requests[r].is_finished()}
            self._done = {r: s for r, s in self._done.items() if r in live}
        return outputs

    def _on_residual_failed(self, req_id: str, outputs: dict[int, EngineCoreOutputs]) -> None:
        """The residual of a request decoding on its anchor cannot arrive: kv_load_failure_policy applies."""
        req = self.requests.get(req_id)
        st = self._spec.pop(req_id, None)
        if req is None or req.is_finished():
            return
        if st is not None:
            self._record(st)
        if not self.recompute_kv_load_failures:
            logger.error("Request %s: residual failed after decoding on its anchor; failing it "
                         "(kv_load_failure_policy=fail)", req_id)
            for r in self.finish_requests(req_id, RequestStatus.FINISHED_ERROR):
                eco = outputs.setdefault(r.client_index, EngineCoreOutputs())
                eco.outputs.append(EngineCoreOutput(request_id=req_id, new_token_ids=[],
                                                    finish_reason=r.get_finished_reason(),
                                                    events=r.take_events(), trace_headers=r.trace_headers))
            return
        logger.warning("Request %s: residual failed after decoding on its anchor; recomputing its prompt "
                       "(kv_load_failure_policy=recompute)", req_id)
        if st is not None:
            self._drop_held(req, st)
        if req.status == RequestStatus.RUNNING:
            self.running = [r for r in self.running if r is not req]
            self._preempt_request(req, time.monotonic())
        elif req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            req.num_computed_tokens = 0  # vLLM's failed-load path frees the blocks when it promotes the request
            self.failed_recving_kv_req_ids.add(req_id)
        else:  # promoted, not scheduled yet: release its anchor blocks and queue it for a fresh prefill
            self.kv_holding_waiting.remove_requests([req])
            self.deferred_waiting.discard(req)
            self.kv_cache_manager.free(req)
            req.num_computed_tokens = 0
            self.waiting.prepend_request(req)

    def _truncate_to_prompt(self, req: Request, keep: int = 0) -> None:
        """Forget every output token of a request but the first ``keep`` (released); the others are held."""
        end = req.num_prompt_tokens + keep
        del req._output_token_ids[keep:]
        del req._all_token_ids[end:]
        del req.block_hashes[end // (self.hash_block_size or self.block_size):]

    def _drop_held(self, req: Request, st: SpecState) -> None:
        if st.phase is Phase.ANCHOR and st.held:
            self._truncate_to_prompt(req, keep=st.committed)
        req.spec_token_ids = []

    # ---- preemption, finish, stats --------------------------------------------------------------------------
    def _preempt_request(self, request: Request, timestamp: float, drop_stale_output: bool = False) -> None:
        st = self._spec.pop(request.request_id, None)
        if st is not None:
            # Held tokens are dropped and the request is recomputed from its prompt at full precision (its
            # remote KV is not pulled again); a residual still in flight is cancelled in this very step, before
            # the worker could write into the blocks freed here.
            self._drop_held(request, st)
            st.preempted = True
            self._record(st)
            logger.info("Request %s preempted while speculating (%s held tokens dropped)", request.request_id,
                        st.dropped)
        if self._lynx is not None:
            self._lynx.cancel_residual(request.request_id)
        super()._preempt_request(request, timestamp, drop_stale_output)

    def _free_request(self, request: Request, delay_free_blocks: bool = False) -> Any:
        st = self._spec.pop(request.request_id, None)
        if st is not None:
            self._record(st)
        return super()._free_request(request, delay_free_blocks)

    def make_stats(self, spec_decoding_stats: Any = None, kv_connector_stats: Any = None, *args: Any,
                   **kwargs: Any) -> Any:
        if not self._stats.is_empty() and self.log_stats:
            mine = self._stats.clone_and_reset()
            kv_connector_stats = mine if kv_connector_stats is None else kv_connector_stats.aggregate(mine)
        return super().make_stats(spec_decoding_stats, kv_connector_stats, *args, **kwargs)
