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
metadata and are consumed by :class:`lynx_connector.speculative.scheduler.LynxSpecScheduler` through
:class:`SpeculationPort`, the whole interface between the two (the scheduler enables speculation with it).
Without that scheduler a speculative request is served as ``full`` (decoding on an unverified anchor would
return lossy tokens). Until its residual is merged the request's blocks may
still be written: an abort keeps them until the worker confirms (as above), a preemption cancels the pull in
the same step the blocks are freed (the worker drops it before it could write again).
"""

from __future__ import annotations

from collections.abc import Set
from typing import TYPE_CHECKING, Any

from lynx_connector.config import LynxConfig
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
from lynx_connector.modes import MODE_NAMES, get_mode, is_mode
from lynx_connector.testing import fault_hooks

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)


class LynxConnectorScheduler:
    def __init__(self, vllm_config: VllmConfig, engine_id: str, config: LynxConfig):
        self.config = config
        self.engine_id = engine_id
        self.block_size = vllm_config.cache_config.block_size
        self._kv_cache_manager: KVCacheManager | None = None
        # Where P's workers listen (from their handshake metadata), by tensor-parallel rank.
        self._side_channel_host = config.side_channel_host
        self._side_channel_ports: list[int] = []
        self._kv_dtype = ""  # P's KV cache dtype, from its workers' handshake metadata
        # P: requests to encode once their prompt is computed (with their mode); the ones already encoded.
        self._save_tracked: dict[str, Request] = {}
        self._save_mode: dict[str, str] = {}
        self._saved: set[str] = set()
        self._save_aborted: list[str] = []
        # P: each saved request's (transfer_id, token), minted here, handed to the workers and returned to D
        self._save_ticket: dict[str, tuple[str, str]] = {}
        # D: local prefix-hit tokens seen by get_num_new_matched_tokens; pulls to start; pulls in flight.
        self._local_hits: dict[str, int] = {}
        self._recv_pending: list[RecvSpec] = []
        self._recv_inflight: set[str] = set()
        self._recv_aborted: list[str] = []
        # Residual-merged signals from the workers (used by the speculative scheduler).
        self.residual_merged: set[str] = set()
        # Speculative mode: enabled by LynxSpecScheduler (SpeculationPort.enable); requests whose residual is
        # still to be merged; residuals that failed after the anchor; pulls to cancel (preempted).
        self.speculation_enabled = False
        self.spec_pending: set[str] = set()
        self.residual_failed: set[str] = set()
        self._recv_cancelled: list[str] = []
        #: The token P sampled after the prompt, for speculative requests (taken by LynxSpecScheduler).
        self.spec_first_token: dict[str, int] = {}
        self._faults = fault_hooks(config)  # test-only (lynx_connector.testing)
        self._warned_no_spec = False

    # ---- start-up -------------------------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        self._kv_cache_manager = kv_cache_manager

    def set_handshake(self, metadata: dict[int, Any]) -> None:
        ranks = sorted(metadata)
        metas = [metadata[r] for r in ranks]
        if not all(isinstance(m, LynxHandshakeMetadata) for m in metas):
            raise TypeError(f"LynxConnector expects LynxHandshakeMetadata from its workers, got {metas!r}")
        self._side_channel_host = metas[0].host
        self._side_channel_ports = [m.port for m in metas]
        self._kv_dtype = metas[0].kv_dtype  # announced to D with every request P serves (lynx_kv_dtype)
        logger.info("LynxConnector: side channel of this engine at %s ports %s",
                    self._side_channel_host, self._side_channel_ports)

    def _request_mode(self, req_id: str, params: dict[str, Any]) -> str:
        """A request may ask for its own transfer mode (``lynx_mode`` in kv_transfer_params), so one P/D pair
        can serve and compare every scheme; otherwise the configured mode applies."""
        mode = params.get("lynx_mode")
        if mode is None:
            return self.config.mode
        if not is_mode(mode):
            logger.warning("Request %s asks for unknown lynx_mode %r (known: %s); using %s",
                           req_id, mode, ", ".join(MODE_NAMES), self.config.mode)
            return self.config.mode
        return mode

    # ---- D: loading -----------------------------------------------------------------------------------
    def _remote_prefill(self, request: Request) -> RemotePrefill | None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return None
        try:
            return RemotePrefill.from_params(params)
        except InvalidTransferParams as exc:
            logger.warning("Request %s: unusable kv_transfer_params (%s); computing its prompt locally",
                           request.request_id, exc)
            params["do_remote_prefill"] = False
            return None

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
            self._save_tracked[request.request_id] = request
            self._save_mode[request.request_id] = self._request_mode(request.request_id, params)
            return
        remote = self._remote_prefill(request)
        if remote is None:
            return
        # One transfer per request, even if it is preempted and rescheduled later (then it recomputes).
        params["do_remote_prefill"] = False
        local_hit = self._local_hits.pop(request.request_id, 0)
        block_ids = list(blocks.get_block_ids()[0]) if num_external_tokens > 0 else []
        num_tokens = local_hit + num_external_tokens if num_external_tokens > 0 else 0
        mode = self._decode_mode(request, remote.mode)
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
        )
        self._recv_pending.append(spec)
        if num_tokens:
            self._recv_inflight.add(request.request_id)
            if get_mode(mode).late_residual:
                self.spec_pending.add(request.request_id)
                if remote.first_token is not None:
                    self.spec_first_token[request.request_id] = remote.first_token
            self._faults.on_pull(request.request_id, params)

    def _decode_mode(self, request: Request, mode: str) -> str:
        """D's mode for a pull: speculation needs the Lynx scheduler, otherwise the request is served as its
        mode's fallback (the modes table: full). Structured-output requests are served as the fallback too (held
        tokens would bypass the grammar)."""
        row = get_mode(mode)
        if not row.needs_spec_scheduler:
            return mode
        fallback = row.fallback
        assert fallback is not None  # the table gives every speculative mode one (tests/test_modes.py)
        req_id = request.request_id
        if request.use_structured_output:
            logger.info("Request %s uses structured output: served as '%s' instead of '%s'", req_id, fallback, mode)
            return fallback
        if self.speculation_enabled:
            return mode
        if not self._warned_no_spec:
            self._warned_no_spec = True
            logger.warning("Request %s asks for lynx_mode %s but this decode instance runs without the "
                           "Lynx speculative scheduler (--scheduler-cls %s with a custom_class speculative "
                           "config; the lynx:speculative preset sets both): serving it and the next ones as "
                           "'%s'", req_id, mode, "lynx_connector.speculative.scheduler.LynxSpecScheduler",
                           fallback)
        return fallback

    # ---- D: speculative mode ----------------------------------------------------------------------------
    def take_residual_merged(self) -> set[str]:
        out, self.residual_merged = self.residual_merged, set()
        return out

    def take_residual_failed(self) -> set[str]:
        out, self.residual_failed = self.residual_failed, set()
        return out

    def cancel_residual(self, req_id: str) -> bool:
        """A speculating request is preempted (its blocks are freed in this step): cancel its pull silently.
        True when a pull was still pending."""
        self.residual_merged.discard(req_id)
        self.residual_failed.discard(req_id)
        if req_id not in self.spec_pending:
            return False
        self.spec_pending.discard(req_id)
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
            test_hooks=self._faults.take_outgoing(),
        )
        self._recv_pending, self._save_aborted, self._recv_aborted, self._recv_cancelled = [], [], [], []
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
            tid, token = self._save_ticket[req_id] = mint_ticket()
            meta.reqs_to_save.append(SaveSpec(req_id=req_id, block_ids=block_ids, num_tokens=req.num_prompt_tokens,
                                              mode=self._save_mode[req_id], transfer_id=tid, token=token))
            self._saved.add(req_id)
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for req_id in connector_output.finished_recving or ():
            self._recv_inflight.discard(req_id)
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, LynxWorkerMeta):
            self.residual_merged |= meta.residual_merged
            self.spec_pending -= meta.residual_merged
            failed = meta.residual_failed & self.spec_pending
            self.residual_failed |= failed
            self.spec_pending -= failed
        for req_id in getattr(connector_output, "failed_recving", None) or ():
            self.spec_pending.discard(req_id)  # failed before the anchor: vLLM's own failure path applies

    # ---- end of a request ---------------------------------------------------------------------------------
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        req_id = request.request_id
        self._local_hits.pop(req_id, None)
        self.residual_merged.discard(req_id)
        self.residual_failed.discard(req_id)
        self.spec_first_token.pop(req_id, None)
        if req_id in self._recv_inflight or req_id in self.spec_pending:
            # D: aborted while its KV is in flight (for a speculative request: until its residual is merged).
            # Keep the blocks until the worker has cancelled the pull (it then reports the request in
            # finished_recving and vLLM frees them).
            self._recv_inflight.discard(req_id)
            self.spec_pending.discard(req_id)
            self._recv_aborted.append(req_id)
            return True, None
        if self._save_tracked.pop(req_id, None) is None:
            return False, None
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
        )
        return True, remote.to_params()


class SpeculationPort:
    """The connector's scheduler half as the speculative scheduler (D, ``LynxSpecScheduler``) sees it: the whole
    interface between the two. Obtained with :func:`speculation_port`; ``enable()`` turns speculative pulls on
    (without it a ``speculative`` request is served as ``full``)."""

    def __init__(self, half: LynxConnectorScheduler) -> None:
        self._half = half

    @property
    def max_speculative_tokens(self) -> int:
        return self._half.config.max_speculative_tokens

    @property
    def speculative_min_margin(self) -> float:
        return self._half.config.speculative_min_margin

    def enable(self) -> None:
        self._half.speculation_enabled = True

    def pending(self) -> Set[str]:
        """Requests pulled in speculative mode whose residual is still to be merged (read-only view)."""
        return self._half.spec_pending

    def take_residual_merged(self) -> set[str]:
        """Requests whose residual was merged since the last call."""
        return self._half.take_residual_merged()

    def take_residual_failed(self) -> set[str]:
        """Requests whose residual failed after their anchor was reported ready, since the last call."""
        return self._half.take_residual_failed()

    def take_first_token(self, req_id: str) -> int | None:
        """The token P sampled after the prompt of ``req_id`` (once; None when P sent none)."""
        return self._half.spec_first_token.pop(req_id, None)

    def cancel_residual(self, req_id: str) -> bool:
        """``req_id`` is preempted (its blocks are freed in this step): cancel its pull silently. True when a pull
        was still pending."""
        return self._half.cancel_residual(req_id)


def speculation_port(connector: Any) -> SpeculationPort | None:
    """The speculation interface of a vLLM scheduler's connector, None unless it is a LynxConnector's."""
    half = getattr(connector, "connector_scheduler", None)
    return SpeculationPort(half) if isinstance(half, LynxConnectorScheduler) else None
