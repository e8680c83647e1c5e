"""Scheduler half of LynxConnector (runs in the engine-core process).

P (prefill, ``do_remote_decode``): when a request's prompt finishes computing, the step's metadata asks the
worker to encode it into staging (anchor + residual planes) right after the forward; when the request
finishes, its vLLM blocks are freed at once (the planes live in staging, so P's KV cache is never held
hostage by a slow link) and ``kv_transfer_params`` tell D where to pull from.

D (decode, ``do_remote_prefill``): the prompt is loaded asynchronously; the worker reports the request
finished receiving when the planes the mode needs are merged into D's blocks (or failed, then vLLM's
``kv_load_failure_policy`` applies). A request aborted while its KV is in flight keeps its blocks until
the worker confirms the pull is cancelled, so nothing writes into blocks that were given to another request.

Speculative mode (D): the request is reported ready when its anchor is merged and the residual keeps
streaming into the same blocks; ``residual_merged`` / ``residual_failed`` come back through the worker
metadata (counted over the workers: lynx_connector/spec_book.py) and are consumed by :class:`lynx_connector.speculative.scheduler.LynxSpecScheduler` through
:class:`SpeculationPort`, the whole interface between the two (the scheduler enables speculation with it).
Without that scheduler a speculative request is served as ``full`` (decoding on an unverified anchor would
return lossy tokens). Until its residual is merged the request's blocks may
still be written: an abort keeps them until the worker confirms (as above), a preemption cancels the pull in
the same step the blocks are freed (the worker drops it before it could write again).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from lynx_connector.auto import AUTO_KEY, AutoPolicy
from lynx_connector.concurrent import CONCURRENT, FLOW_KEY
from lynx_connector.config import LynxConfig
from lynx_connector.fanout import CHILDREN_KEY, SiblingBook, TooManyChildren
from lynx_connector.logger import init_logger
from lynx_connector.metadata import (
    InvalidTransferParams,
    LynxConnectorMetadata,
    LynxHandshakeMetadata,
    LynxWorkerMeta,
    RecvSpec,
    RemotePrefill,
    SaveSpec,
    mint_ticket,
)
from lynx_connector.modes import AUTO_MODE, get_mode
from lynx_connector.prefill_admission import PrefillAdmission, bad_request
from lynx_connector.prefix_cache import fence_lossy_blocks
from lynx_connector.presets import PREFILL_ONLY_ROLE
from lynx_connector.served_mode import ServedMode
from lynx_connector.signing import (
    EXPIRES_KEY,
    PROMPT_KEY,
    ParamsRefused,
    ParamsSigner,
    RefusalLog,
    check_prompt,
    prompt_digest,
)
from lynx_connector.spec_book import SpecBook
from lynx_connector.stats import LynxStats
from lynx_connector.testing import fault_hooks
from lynx_connector.transport.keys import load_extra_keys, load_side_channel_key

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)


class LynxConnectorScheduler(ServedMode, PrefillAdmission):
    def __init__(self, vllm_config: VllmConfig, engine_id: str, config: LynxConfig):
        self.config = config
        self.engine_id = engine_id
        self.block_size = vllm_config.cache_config.block_size
        self._kv_cache_manager: KVCacheManager | None = None
        # Where P's workers listen (from their handshake metadata), by tensor-parallel rank.
        self._side_channel_host = config.side_channel_host
        self._side_channel_ports: list[int] = []
        self._kv_dtype = ""  # P's KV cache dtype, from its workers' handshake metadata
        self._longest: dict[str, int] = {}  # P: per mode, the longest prompt every worker's staging holds
        # P: requests to encode once their prompt is computed (with their mode); the ones already encoded.
        self._save_tracked: dict[str, Request] = {}
        self._save_mode: dict[str, str] = {}
        self._saved: set[str] = set()
        self._save_aborted: list[str] = []
        # P: each saved request's (transfer_id, token), minted here, handed to the workers and returned to D
        self._save_ticket: dict[str, tuple[str, str]] = {}
        # P: first tokens of finished saved requests, by transfer id, for the workers (next step's metadata)
        self._first_tokens_due: dict[str, int] = {}
        # P, concurrent flow: the tickets the proxy minted (and signed), by request, until the request is saved
        self._given_ticket: dict[str, tuple[str, str]] = {}
        self._arrived: dict[str, float] = {}  # P, concurrent flow: when each request came (wall clock)
        # P: the finished children of each request vLLM fanned out (n > 1), listed in the last one's params
        self._siblings = SiblingBook(keep_s=config.effective_lease_s)
        # D: local prefix-hit tokens seen by get_num_new_matched_tokens; pulls to start; pulls in flight.
        self._local_hits: dict[str, int] = {}
        self._recv_pending: list[RecvSpec] = []
        self._recv_inflight: set[str] = set()
        self._recv_aborted: list[str] = []
        # Speculative mode: enabled by LynxSpecScheduler (SpeculationPort.enable); requests decoding on their
        # anchor until every worker merged the residual (spec_book.py); pulls to cancel (preempted, or failed on
        # another worker).
        self.speculation_enabled = False
        kv_cfg = getattr(vllm_config, "kv_transfer_config", None)
        self._prefill_only = getattr(kv_cfg, "kv_role", None) == PREFILL_ONLY_ROLE  # no speculative scheduler here
        self.spec = SpecBook(getattr(getattr(vllm_config, "parallel_config", None), "world_size", 1) or 1)
        self._recv_cancelled: list[str] = []
        self._faults = fault_hooks(config)  # test-only (lynx_connector.testing)
        self._warned_no_spec = False
        # Signed kv_transfer_params (lynx_connector/signing.py): P signs what it returns, D accepts only what
        # verifies. The deployment key is read here once for this process (the workers read it for the
        # transport); a missing or bad key fails start-up like the workers' (insecure: the empty key signs).
        self._signer = ParamsSigner(load_side_channel_key(insecure=config.insecure_side_channel),
                                    config.signed_params_ttl_s,
                                    extra_keys=load_extra_keys(insecure=config.insecure_side_channel))
        self._refusal_log = RefusalLog()
        # D: params verified by get_num_new_matched_tokens, used by update_state_after_alloc.
        self._verified: dict[str, RemotePrefill] = {}
        # P and D: the error a refused request reports in its response's kv_transfer_params ("lynx_error").
        self._refused: dict[str, dict[str, Any]] = {}
        #: Scheduler-side counters (refused params, auto choices), exported with the workers' (LynxConnector).
        self.stats = LynxStats()
        # auto (lynx_connector/auto.py): P's choices (the reason goes to D signed); D: the choices to report
        self._auto = AutoPolicy(vllm_config, config, self.stats)
        self._auto_reason: dict[str, str] = {}
        self._auto_report: dict[str, dict[str, str]] = {}

    # ---- start-up -------------------------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        self._kv_cache_manager = kv_cache_manager

    def set_handshake(self, metadata: dict[int, Any]) -> None:
        ranks = sorted(metadata)
        metas = [metadata[r] for r in ranks]
        if not all(isinstance(m, LynxHandshakeMetadata) for m in metas):
            raise TypeError(f"LynxConnector expects LynxHandshakeMetadata from its workers, got {metas!r}")
        if not metas:  # kv_role=kv_consumer: the workers serve no side channel (nothing to announce to D)
            return
        for key, what in (("host", "side-channel host"), ("kv_dtype", "KV cache dtype")):  # D is told one for all
            if len({getattr(m, key) for m in metas}) > 1:
                raise ValueError(f"LynxConnector: the tensor-parallel workers of this prefill instance differ in "
                                 f"{what} ({', '.join(repr(getattr(m, key)) for m in metas)}): D is told one for all "
                                 "of them (a P whose workers span hosts is not supported)")
        self._side_channel_host = metas[0].host
        self._side_channel_ports = [m.port for m in metas]
        self._kv_dtype = metas[0].kv_dtype  # announced to D with every request P serves (lynx_kv_dtype)
        self._longest = {}
        for m in metas:
            for mode, n in m.longest_prompt.items():
                self._longest[mode] = min(n, self._longest.get(mode, n))
        logger.info("LynxConnector: side channel of this engine at %s ports %s",
                    self._side_channel_host, self._side_channel_ports)

    # ---- D: loading -----------------------------------------------------------------------------------
    def _remote_prefill(self, request: Request) -> RemotePrefill | None:
        """The request's remote-prefill params once verified (signature, expiry, shape, allowed mode, prompt),
        None when it has none or they are refused: then its prompt is computed locally, the refusal is counted,
        logged (rate-limited) and reported in its response (``lynx_error``), and nothing is pulled."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return None
        req_id = request.request_id
        remote = self._verified.get(req_id)
        if remote is not None:
            return remote
        try:
            self._signer.verify(params)  # before anything else is read
            try:
                remote = RemotePrefill.from_params(params, req_id)  # a child (n > 1): its own entry
            except InvalidTransferParams as exc:
                raise ParamsRefused("malformed", f"unusable kv_transfer_params: {exc}") from None
            if not self.config.mode_allowed(remote.mode):
                allowed = ", ".join(self.config.allowed_modes)
                raise ParamsRefused("mode_not_allowed", f"lynx_mode {remote.mode!r} is not allowed on this decode "
                                                        f"instance (allowed_modes: {allowed})")
            if remote.concurrent and remote.num_tokens == 0:  # the proxy sent "the whole prompt"
                remote = dataclasses.replace(remote, num_tokens=request.num_prompt_tokens)
            check_prompt(params, getattr(request, "prompt_token_ids", None), remote.num_tokens)
        except ParamsRefused as exc:
            _pulled(request)
            self._refused[req_id] = {"message": f"remote-prefill params refused ({exc.reason}): {exc}; the prompt "
                                                "was computed locally", "type": "lynx_params_refused",
                                     "reason": exc.reason}
            self.stats.record_refusal(exc.reason)
            self._refusal_log.warn(req_id, exc)
            if exc.reason == "expired":  # this deployment's params, only late: P frees its staging now, not at its lease
                self._discard_unpulled(request, params, expired=True)
            return None
        self._verified[req_id] = remote
        return remote

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        remote = self._remote_prefill(request)
        if remote is None:
            return 0, False
        self._local_hits[request.request_id] = num_computed_tokens
        count = min(remote.num_tokens, request.num_prompt_tokens) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        if params.get("do_remote_decode"):
            if request.request_id in self._save_tracked or request.request_id in self._refused:
                return  # preempted and scheduled again: its first choice and ticket, or its refusal, stand (its
                # own ticket is not another request's replay; a refusal is counted and logged once)
            mode = self._request_mode(request.request_id, params)
            if mode == AUTO_MODE:
                spec = self.config.auto_speculative
                if spec is None:  # a prefill-only P runs no speculative scheduler: its Ds run the preset's
                    spec = self.speculation_enabled or self._prefill_only
                mode, self._auto_reason[request.request_id] = self._auto.choose(
                    request, self._kv_dtype, spec, fits=lambda m: self._fits(request.num_prompt_tokens, m))
            if mode is not None and not self._fits(request.num_prompt_tokens, mode):
                mode = self._refuse_too_long(request, mode, request.request_id in self._auto_reason)
            if mode is not None and params.get(FLOW_KEY) == CONCURRENT and not self._take_given_ticket(request):
                mode = None
            if mode is not None:
                self._save_tracked[request.request_id] = request
                self._save_mode[request.request_id] = mode
                self._faults.on_pull(request.request_id, params)  # test hooks of P's encode (kv_range)
            return
        remote = self._remote_prefill(request)
        if remote is None:
            return
        self._verified.pop(request.request_id, None)
        # One transfer per request, even if it is preempted and rescheduled later (then it recomputes).
        _pulled(request)
        local_hit = self._local_hits.pop(request.request_id, 0)
        block_ids = list(blocks.get_block_ids()[0]) if num_external_tokens > 0 else []
        num_tokens = local_hit + num_external_tokens if num_external_tokens > 0 else 0
        auto = remote.mode == AUTO_MODE  # concurrent flow: P names its choice in Regions (`_auto_served`)
        mode = self._auto_served(request) if auto else self._decode_mode(request, remote.mode)
        spec = RecvSpec(
            req_id=request.request_id,
            block_ids=block_ids[: -(-num_tokens // self.block_size)] if num_tokens else [],
            num_tokens=num_tokens,
            skip_blocks=local_hit // self.block_size,
            remote_host=remote.host,
            remote_ports=remote.ports,
            remote_req_id=remote.request_id,
            remote_engine_id=remote.engine_id,
            mode=mode,
            transfer_id=remote.transfer_id,
            token=remote.token,
            kv_dtype=remote.kv_dtype,
            concurrent=remote.concurrent,
            auto=auto,
        )
        self._recv_pending.append(spec)
        if remote.auto_reason:  # reported in its final output
            self._auto_report[request.request_id] = {"mode": remote.mode, "reason": remote.auto_reason}
        if num_tokens:
            if not get_mode(mode).prefix_cached:  # lossy KV: never a prefix-cache hit for a later request
                fence_lossy_blocks(request, local_hit, self._kv_cache_manager, self.block_size)
            self._recv_inflight.add(request.request_id)
            if get_mode(mode).late_residual:
                self.spec.start(request.request_id, remote.first_token)
            self._faults.on_pull(request.request_id, params)

    def _discard_unpulled(self, request: Request, params: dict[str, Any], expired: bool = False) -> None:
        """D: a request that ended before its pull was set up (aborted while waiting, e.g. its client left), or
        whose params D refused as ``expired``: an empty load tells the worker to free P's staging now instead of at
        P's lease. Only for params that verify (``expired``: as of their expiry): a client's unsigned ones must
        not make D connect anywhere (P's lease frees what they might name)."""
        try:
            self._signer.verify(params, at=params.get(EXPIRES_KEY) if expired else None)
            remote = RemotePrefill.from_params(params, request.request_id)
        except (ParamsRefused, InvalidTransferParams):
            return
        self._recv_pending.append(RecvSpec(
            req_id=request.request_id, block_ids=[], num_tokens=0, skip_blocks=0, remote_host=remote.host,
            remote_ports=remote.ports, remote_req_id=remote.request_id, remote_engine_id=remote.engine_id,
            mode=remote.mode, transfer_id=remote.transfer_id, token=remote.token))

    # ---- D: speculative mode ----------------------------------------------------------------------------
    def cancel_residual(self, req_id: str) -> bool:
        """A speculating request is preempted (its blocks are freed in this step): cancel its pull silently.
        True when a pull was still pending."""
        if not self.spec.forget(req_id):
            return False
        self._recv_inflight.discard(req_id)
        self._recv_cancelled.append(req_id)
        return True

    # ---- per step -------------------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> LynxConnectorMetadata:
        meta = LynxConnectorMetadata(
            reqs_to_recv=self._recv_pending,
            save_aborted=self._save_aborted,
            recv_aborted=self._recv_aborted,
            recv_cancelled=self._recv_cancelled,
            spec_settled=self.spec.take_settled(),
            test_hooks=self._faults.take_outgoing(),
            first_tokens=self._first_tokens_due,
            idle=not any(scheduler_output.num_scheduled_tokens.values()),
        )
        self._recv_pending, self._save_aborted, self._recv_aborted, self._recv_cancelled = [], [], [], []
        self._first_tokens_due = {}
        # P: a request preempted after its save was asked for (it decodes on P: max_tokens > 1) lost its blocks
        meta.save_preempted = [r for r in (getattr(scheduler_output, "preempted_req_ids", None) or ()) if r in self._saved]
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            req = self._save_tracked.get(req_id)
            if req is None or req_id in self._saved:
                continue
            # num_computed_tokens is advanced after this call: this step computes [computed, computed + n).
            if req.num_computed_tokens + n < req.num_prompt_tokens:
                continue
            assert self._kv_cache_manager is not None, "bind_kv_cache_manager was not called"
            n_blocks = -(-req.num_prompt_tokens // self.block_size)
            block_ids = list(self._kv_cache_manager.get_block_ids(req_id)[0][:n_blocks])
            tid, token = self._save_ticket[req_id] = self._given_ticket.pop(req_id, None) or mint_ticket()
            meta.reqs_to_save.append(SaveSpec(req_id=req_id, block_ids=block_ids, num_tokens=req.num_prompt_tokens,
                                              mode=self._save_mode[req_id], transfer_id=tid, token=token,
                                              auto_reason=self._auto_reason.get(req_id, "")))
            self._saved.add(req_id)
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, LynxWorkerMeta):
            self._auto.observe(meta.p_link)
            for req_id, (mode, reason, chosen) in meta.auto_modes.items():  # D: P named its choice (concurrent)
                if req_id not in self._recv_inflight:
                    continue  # ended meanwhile (aborted): nothing to report, nothing to keep
                # served as D can: P's own choice named too where it differs (its reason explains that choice)
                self._auto_report[req_id] = {"mode": mode, "reason": reason,
                                             **({"chosen": chosen} if chosen != mode else {})}
                if not get_mode(mode).late_residual:
                    self.spec.whole(req_id)  # reported ready only once its KV is whole
            # failed on one worker: the others' pulls are cancelled before the policy frees or reuses the blocks
            self._recv_cancelled.extend(self.spec.observe(meta))
        # after P's choices: a load reported ready in the step that names its mode still takes it (a bf16 choice
        # then is whole, not waiting for a residual that never comes)
        for req_id in connector_output.finished_recving or ():
            self._recv_inflight.discard(req_id)
        for req_id in getattr(connector_output, "failed_recving", None) or ():
            self.spec.forget(req_id)  # failed before the anchor: vLLM's own failure path applies

    # ---- end of a request ---------------------------------------------------------------------------------
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        req_id = request.request_id
        self._local_hits.pop(req_id, None)
        self._verified.pop(req_id, None)
        error = self._refused.pop(req_id, None)
        auto = self._auto_reason.pop(req_id, "")
        self._auto.finished(req_id, request.num_output_tokens > 0)
        report = self._auto_report.pop(req_id, None)
        self.spec.first_token.pop(req_id, None)
        if self.spec.forget(req_id) | (req_id in self._recv_inflight):
            # D: aborted while its KV is in flight (for a speculative request: until its residual is merged).
            # Keep the blocks until the worker has cancelled the pull (it then reports the request in
            # finished_recving and vLLM frees them).
            self._recv_inflight.discard(req_id)
            self._recv_aborted.append(req_id)
            return True, None
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            self._discard_unpulled(request, params)
        self._given_ticket.pop(req_id, None)
        self._arrived.pop(req_id, None)
        if self._save_tracked.pop(req_id, None) is None:
            out = {} if error is None else {"lynx_error": error}
            if report is not None:  # D: what auto chose for this request, in its final output
                out[AUTO_KEY] = report
            return False, out or None
        mode = self._save_mode.pop(req_id, self.config.mode)
        saved = req_id in self._saved
        self._saved.discard(req_id)
        ticket = self._save_ticket.pop(req_id, None)
        finished_ok = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        if not saved:
            if finished_ok:
                logger.warning("Request %s finished before its prompt was encoded; D will compute it", req_id)
            return False, None
        # A saved request keeps its blocks until the worker reports it in finished_sending: it is staged, given
        # up or aborted there (saving.py), so the worker may still wait for staging room with the KV in place.
        if not finished_ok:
            self._save_aborted.append(req_id)
            return True, None
        if ticket and request.num_output_tokens:  # the workers name it to D on the side channel (concurrent flow)
            self._first_tokens_due[ticket[0]] = request.output_token_ids[0]
        if not self._side_channel_ports:
            logger.error("LynxConnector: no side channel registered by the workers; cannot serve request %s",
                         req_id)
            self._save_aborted.append(req_id)
            return True, None
        remote = RemotePrefill(
            engine_id=self.engine_id,
            request_id=req_id,
            host=self._side_channel_host,
            ports=tuple(self._side_channel_ports),
            num_tokens=request.num_prompt_tokens,
            mode=mode,
            transfer_id=ticket[0] if ticket else "",
            token=ticket[1] if ticket else "",
            first_token=request.output_token_ids[0] if request.num_output_tokens else None,
            kv_dtype=self._kv_dtype,
            auto_reason=auto,
        )
        params = remote.to_params()
        ids = getattr(request, "prompt_token_ids", None)
        if ids is not None:
            params[PROMPT_KEY] = prompt_digest(ids[: request.num_prompt_tokens])
        try:
            children = self._siblings.add(req_id, params)  # n > 1: every child's transfer (fanout.py)
            if children is not None:
                params[CHILDREN_KEY] = children  # signed with the rest: D pulls by it
            return True, self._signer.sign(params)
        except (ParamsRefused, TooManyChildren) as exc:  # params D could not carry (a request id over 1024
            # characters, more than MAX_CHILDREN children)
            logger.error("LynxConnector: request %s cannot be served remotely: %s", req_id, exc)
            self._save_aborted.append(req_id)
            return True, {"lynx_error": bad_request(f"remote-prefill params not produced: {exc}", "kv_transfer_params")}


def _pulled(request: Request) -> None:
    """D: the request pulls no more (pulled once, or unusable params). On its own copy of the params: the children
    of a request with ``n > 1`` share one dict when the engine runs in-process (vLLM copies sampling params
    shallowly), and a sibling must still pull its own KV."""
    request.kv_transfer_params = {**(request.kv_transfer_params or {}), "do_remote_prefill": False}

