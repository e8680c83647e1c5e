"""Serializable messages shared by the scheduler half and the worker half, and the ``kv_transfer_params``
contract between a prefill instance (P), the proxy and a decode instance (D).

Nothing here holds live objects: scheduler->worker metadata crosses process boundaries (pickled by vLLM's
executor) and kv_transfer_params cross the network through the proxy, so they are validated before use.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from lynx_connector.auto import AUTO_KEY, AUTO_REASONS
from lynx_connector.compat import staged_dtype_names
from lynx_connector.concurrent import CONCURRENT, FLOW_KEY, LYNX_PARAMS_VERSION
from lynx_connector.fanout import CHILD_KEYS, CHILDREN_KEY, MAX_CHILDREN, child_of
from lynx_connector.modes import AUTO_MODE, MODE_NAMES, is_mode

#: Length of a transfer id and of a capability token (16 random bytes, hex; protocol v2).
TICKET_HEX_LEN = 32


def mint_ticket() -> tuple[str, str]:
    """A new (transfer_id, token) for a request P serves: 16 random bytes each, hex."""
    return secrets.token_hex(16), secrets.token_hex(16)


def is_ticket_part(value: object) -> bool:
    return (isinstance(value, str) and len(value) == TICKET_HEX_LEN
            and all(c in "0123456789abcdef" for c in value))


@dataclass
class SaveSpec:
    """P: encode this request's prompt KV (``num_tokens`` tokens in ``block_ids``) into staging now."""

    req_id: str
    block_ids: list[int]
    num_tokens: int
    mode: str
    #: The request's transfer id and capability token (minted by P's scheduler half, sent to D in
    #: kv_transfer_params); D must present both to query or free the staging.
    transfer_id: str = ""
    token: str = ""
    #: Why ``auto`` chose ``mode`` (lynx_connector.auto.AUTO_REASONS); "" = asked for. Named to D in Regions.
    auto_reason: str = ""


@dataclass
class RecvSpec:
    """D: pull the planes of ``remote_req_id`` from P and write tokens [0, num_tokens) into ``block_ids``.

    ``skip_blocks`` leading blocks are local prefix-cache hits: they already hold this prefix and are shared
    with other requests, so they must not be written.
    """

    req_id: str
    block_ids: list[int]
    num_tokens: int
    skip_blocks: int
    remote_host: str
    #: P's side-channel port of each tensor-parallel rank (``lynx_ports``, never empty).
    remote_ports: tuple[int, ...]
    remote_req_id: str
    remote_engine_id: str
    mode: str
    #: P's transfer id and capability token of the request (``lynx_transfer_id`` / ``lynx_token``).
    transfer_id: str = ""
    token: str = ""
    #: P's KV cache dtype (``lynx_kv_dtype``: the dtype the planes were staged from); "" = D's own.
    kv_dtype: str = ""
    #: Concurrent flow: P may not have the request yet; D waits for it (``concurrent_wait_s``).
    concurrent: bool = False
    #: Auto in the concurrent flow: P chooses the mode as it prefills and names it in its Regions; until then
    #: ``mode`` is what D would serve a Lynx choice as (speculative when it can, else full).
    auto: bool = False

    def port_for_rank(self, tp_rank: int, tp_size: int) -> int:
        """The side-channel port of P's worker that holds this D worker's shard of the KV (worker ``tp_rank`` of
        ``tp_size``). P and D must run the same tensor-parallel size: another one is refused here, before any
        connection (P's handshake refused it too, but named the key or the layout, after four attempts)."""
        if len(self.remote_ports) != tp_size or not 0 <= tp_rank < tp_size:
            raise ValueError(f"P runs tensor-parallel size {len(self.remote_ports)}, this decode instance {tp_size} "
                             "(P's size is the number of side-channel ports it advertises): P and D must run the "
                             "same tensor-parallel size")
        return self.remote_ports[tp_rank]


@dataclass
class LynxConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per engine step."""

    reqs_to_save: list[SaveSpec] = field(default_factory=list)
    reqs_to_recv: list[RecvSpec] = field(default_factory=list)
    #: P: requests that finished without reaching D (aborted): drop their staging now.
    save_aborted: list[str] = field(default_factory=list)
    #: P: requests preempted in this step after their save was asked for (a P request that goes on decoding):
    #: one still waiting for staging room is given up (its blocks were freed, another request may write them).
    save_preempted: list[str] = field(default_factory=list)
    #: D: requests aborted while their KV was in flight: cancel the pulls, free staging on both sides.
    recv_aborted: list[str] = field(default_factory=list)
    #: D: requests preempted while their residual is still pending (speculative mode): drop their pulls silently,
    #: never write into their old blocks again (those were freed in this step).
    recv_cancelled: list[str] = field(default_factory=list)
    #: D: speculative requests whose residual every worker has merged, or that failed on one (tensor parallel):
    #: the workers forget that their pull ended (``recv_aborted`` can no longer ask for it).
    spec_settled: list[str] = field(default_factory=list)
    #: P: the token sampled after the prompt of each request that finished since the last step, by transfer id:
    #: the worker names it in its side channel's Regions answers (a speculative D of the concurrent flow
    #: releases its first token on it, docs/PROTOCOL.md section 6).
    first_tokens: dict[str, int] = field(default_factory=dict)
    #: No tokens are computed in this step: D's worker may wait (``idle_wait_s``) for a pull to land instead of
    #: returning at once into vLLM's busy loop of empty steps.
    idle: bool = False
    #: Test only: fault hooks of the pulls started in this step (``lynx_connector.testing``; empty in production).
    test_hooks: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass
class LynxWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler, once per step (D, speculative mode): requests whose residual has been merged into
    D's blocks, requests whose anchor was already reported ready but whose residual can no longer arrive
    (the speculative scheduler applies ``kv_load_failure_policy``), and P's first tokens (concurrent flow)."""

    residual_merged: set[str] = field(default_factory=set)
    residual_failed: set[str] = field(default_factory=set)
    #: D, concurrent flow: P's first token of speculative requests, learned from P's side channel since the last
    #: step (by request id); the scheduler half hands it to the speculative scheduler (``SpecBook.first_token``).
    first_tokens: dict[str, int] = field(default_factory=dict)
    #: P, for ``auto`` (lynx_connector/auto.py): (measured link bytes/s or 0, bytes staged that D has not finished
    #: reading, recent Lynx encode seconds per token or 0); None on steps that carry no new measure.
    p_link: tuple[float, int, float] | None = None
    #: D, auto in the concurrent flow, once P named its choice: (the mode the request is served as, P's reason
    #: (lynx_connector.auto.AUTO_REASONS), P's choice), by request id.
    auto_modes: dict[str, tuple[str, str, str]] = field(default_factory=dict)

    #: How many workers' metas merged each request (set by ``aggregate``; one worker's meta counts 1 for each).
    merged_counts: dict[str, int] = field(default_factory=dict)

    def merge_counts(self) -> dict[str, int]:
        return self.merged_counts or dict.fromkeys(self.residual_merged, 1)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, LynxWorkerMeta):
            return self
        # With tensor parallelism each rank merges its shard in its own step: the ranks' merges are counted (the
        # scheduler half sums them over steps, as vLLM counts finished_recving); failed as soon as one rank failed.
        counts = self.merge_counts()
        for req_id, n in other.merge_counts().items():
            counts[req_id] = counts.get(req_id, 0) + n
        # Every rank's P names the same first token (P's scheduler sends it to all its workers): any rank's will do.
        return LynxWorkerMeta(residual_merged=set(counts), merged_counts=counts,
                              residual_failed=self.residual_failed | other.residual_failed,
                              first_tokens={**other.first_tokens, **self.first_tokens},
                              p_link=self.p_link or other.p_link,  # rank 0's first
                              auto_modes={**other.auto_modes, **self.auto_modes})  # P's scheduler chose once


@dataclass
class LynxHandshakeMetadata(KVConnectorHandshakeMetadata):
    """Worker -> scheduler at start-up: where this worker's side channel listens (P role)."""

    host: str
    port: int
    tp_rank: int
    #: The worker's KV cache dtype (``"float32"``...): P tells D in kv_transfer_params (``lynx_kv_dtype``).
    kv_dtype: str = ""
    #: Per transfer mode, the longest prompt one request may have to fit P's staging pool whole (``max_model_len``
    #: when it always fits); P's scheduler half refuses a longer one before staging it. Empty = not known.
    longest_prompt: dict[str, int] = field(default_factory=dict)


class InvalidTransferParams(ValueError):
    """kv_transfer_params that claim a remote prefill but cannot be used; the message says why."""


@dataclass(frozen=True)
class RemotePrefill:
    """D's view of the kv_transfer_params P returned (validated)."""

    engine_id: str
    request_id: str
    host: str
    ports: tuple[int, ...]
    num_tokens: int
    mode: str
    #: P's transfer id and capability token (32 hex chars each): what D presents on P's side channel.
    transfer_id: str
    token: str
    #: The token P sampled after the prompt (full-precision KV), when it sampled one. A speculative D releases
    #: it as soon as the anchor lands (lynx_connector.speculative.scheduler); the other modes ignore it.
    first_token: int | None = None
    #: P's KV cache dtype, the dtype its planes were staged from (lynx_connector/compat.py); "" = not announced
    #: (D assumes its own).
    kv_dtype: str = ""
    #: Concurrent flow (lynx_connector/concurrent.py): the proxy sent the request to P and D at once, so P may
    #: not have it yet; ``num_tokens`` 0 = the whole prompt.
    concurrent: bool = False
    #: Why ``auto`` chose ``mode`` (``lynx_auto``, one of lynx_connector.auto.AUTO_REASONS); "" = not an auto choice.
    auto_reason: str = ""

    def to_params(self) -> dict[str, Any]:
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": self.request_id,
            "remote_host": self.host,
            "remote_port": self.ports[0],
            "lynx_ports": list(self.ports),
            "remote_num_tokens": self.num_tokens,
            "lynx_mode": self.mode,
            "lynx_version": LYNX_PARAMS_VERSION,
            "lynx_transfer_id": self.transfer_id,
            "lynx_token": self.token,
        }
        if self.first_token is not None:
            params["lynx_first_token"] = self.first_token
        if self.kv_dtype:
            params["lynx_kv_dtype"] = self.kv_dtype
        if self.concurrent:
            params[FLOW_KEY] = CONCURRENT
        if self.auto_reason:
            params[AUTO_KEY] = self.auto_reason
        return params

    @classmethod
    def from_params(cls, params: dict[str, Any], req_id: str | None = None) -> RemotePrefill:
        """Validate untrusted params (they came through the proxy); raise InvalidTransferParams. ``req_id``: D's
        request id; a child of a fanned-out request (``n > 1``) pulls its own entry of ``lynx_children``."""
        if CHILDREN_KEY in params:
            params = for_child(params, req_id)

        def need(key: str, typ: type | tuple[type, ...]) -> Any:
            if key not in params:
                raise InvalidTransferParams(f"missing {key!r}")
            val = params[key]
            if not isinstance(val, typ) or isinstance(val, bool) and typ is int:
                raise InvalidTransferParams(f"{key!r} has type {type(val).__name__}")
            return val

        version = params.get("lynx_version")
        if version != LYNX_PARAMS_VERSION:
            raise InvalidTransferParams(
                f"lynx_version {version!r} (this decode instance speaks {LYNX_PARAMS_VERSION}); "
                "were these params produced by a LynxConnector prefill instance of the same version?"
            )
        engine_id = need("remote_engine_id", str)
        request_id = need("remote_request_id", str)
        host = need("remote_host", str)
        ports = params.get("lynx_ports", [need("remote_port", int)])
        if (not isinstance(ports, list) or not ports or len(ports) > 1024
                or not all(isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536 for p in ports)):
            raise InvalidTransferParams(f"lynx_ports must be a non-empty list of TCP ports, got {ports!r}")
        num_tokens = need("remote_num_tokens", int)
        concurrent = params.get(FLOW_KEY) == CONCURRENT  # lynx_connector/concurrent.py
        if FLOW_KEY in params and not concurrent:
            raise InvalidTransferParams(f"{FLOW_KEY} must be {CONCURRENT!r} when present, got {params[FLOW_KEY]!r}")
        if num_tokens < 0 or (num_tokens == 0 and not concurrent):
            raise InvalidTransferParams(f"remote_num_tokens must be > 0, got {num_tokens}")
        mode = need("lynx_mode", str)
        if not is_mode(mode) and not (concurrent and mode == AUTO_MODE):  # auto: P names its choice in Regions
            raise InvalidTransferParams(f"lynx_mode {mode!r} is not one of {', '.join(MODE_NAMES)}"
                                        + (f" (or {AUTO_MODE}, in the concurrent flow)" if concurrent else ""))
        if not (0 < len(host) <= 255 and 0 < len(request_id) <= 1024 and 0 < len(engine_id) <= 256):
            raise InvalidTransferParams("remote_host/remote_request_id/remote_engine_id empty or too long")
        transfer_id, token = params.get("lynx_transfer_id"), params.get("lynx_token")
        for key, val in (("lynx_transfer_id", transfer_id), ("lynx_token", token)):
            if not is_ticket_part(val):
                raise InvalidTransferParams(f"{key} must be {TICKET_HEX_LEN} lower-case hex characters")
        first = params.get("lynx_first_token")
        if first is not None and (not isinstance(first, int) or isinstance(first, bool) or not 0 <= first < 2**31):
            raise InvalidTransferParams(f"lynx_first_token must be a token id, got {first!r}")
        kv_dtype = params.get("lynx_kv_dtype", "")
        if kv_dtype != "" and kv_dtype not in staged_dtype_names():
            raise InvalidTransferParams(f"lynx_kv_dtype must be one of {', '.join(staged_dtype_names())}, "
                                        f"got {kv_dtype!r}")
        auto = params.get(AUTO_KEY, "")
        if auto != "" and auto not in AUTO_REASONS:
            raise InvalidTransferParams(f"{AUTO_KEY} must be one of {', '.join(AUTO_REASONS)}, got {str(auto)[:64]!r}")
        return cls(engine_id=engine_id, request_id=request_id, host=host, ports=tuple(ports),
                   num_tokens=num_tokens, mode=mode, transfer_id=transfer_id, token=token,
                   first_token=first, kv_dtype=kv_dtype, concurrent=concurrent, auto_reason=auto)


def for_child(params: dict[str, Any], req_id: str | None) -> dict[str, Any]:
    """The params as D's request ``req_id`` must use them: for child ``i`` of a fanned-out request
    (``lynx_connector.fanout``), P's child ``i``'s transfer (its entry of ``lynx_children``) instead of the
    one at the top level; for any other request the top level. Raise InvalidTransferParams."""
    children = params[CHILDREN_KEY]
    if (not isinstance(children, list) or not 0 < len(children) <= MAX_CHILDREN
            or not all(isinstance(e, dict) and set(e) <= {"child", *CHILD_KEYS} and type(e.get("child")) is int
                       for e in children)):
        raise InvalidTransferParams(f"{CHILDREN_KEY} must be a list of 1 to {MAX_CHILDREN} child entries")
    base = {k: v for k, v in params.items() if k != CHILDREN_KEY}
    parsed = child_of(req_id) if req_id is not None else None
    if parsed is None:
        return base
    index = parsed[0]
    entry = next((e for e in children if e["child"] == index), None)
    if entry is None:
        listed = sorted(e["child"] for e in children)
        raise InvalidTransferParams(f"P's answer carries no KV for child {index} of this request (it lists "
                                    f"children {listed}: a sibling on P was aborted or not staged)")
    out = {k: v for k, v in base.items() if k not in CHILD_KEYS}
    out.update((k, v) for k, v in entry.items() if k != "child")
    return out
