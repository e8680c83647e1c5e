"""Messages of the speculative mode between the connector's scheduler half and its worker half.

They extend the connector's base messages (``lynx_connector.metadata``) with what speculation needs:

* worker -> scheduler: ``residual_failed`` next to ``residual_merged`` (a request whose anchor was already
  reported ready but whose residual can no longer arrive; the scheduler applies ``kv_load_failure_policy``);
* scheduler -> worker: ``recv_cancelled`` (a preempted request: drop its pull silently, never write into its
  old blocks again) and per-request test hooks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

from lynx_connector.logger import init_logger
from lynx_connector.metadata import LynxConnectorMetadata, LynxWorkerMeta

logger = init_logger(__name__)

#: Environment switch that enables the per-request test hooks below (never set it in production).
TEST_HOOKS_ENV = "LYNX_TEST_HOOKS"
#: kv_transfer_params key of the per-request test hooks (honoured only when ``LYNX_TEST_HOOKS=1``):
#: ``{"delay_residual_steps": N}`` merges the residual no earlier than N worker steps after the anchor (makes
#: the speculation window deterministic), ``{"corrupt_residual": true}`` flips the residual's bits on arrival,
#: ``{"fail_residual": true}`` reports the residual stream as failed when it lands.
TEST_HOOKS_PARAM = "lynx_test_hooks"
_HOOK_KEYS = {"delay_residual_steps": int, "corrupt_residual": bool, "fail_residual": bool}


def test_hooks_enabled() -> bool:
    return os.environ.get(TEST_HOOKS_ENV, "") == "1"


def parse_test_hooks(req_id: str, params: dict[str, Any]) -> dict[str, Any]:
    """Validated test hooks of a request (empty unless enabled by the environment)."""
    raw = params.get(TEST_HOOKS_PARAM)
    if raw is None:
        return {}
    if not test_hooks_enabled():
        logger.warning("Request %s carries %s but %s is not set; ignored", req_id, TEST_HOOKS_PARAM, TEST_HOOKS_ENV)
        return {}
    if not isinstance(raw, dict):
        return {}
    out: dict[str, Any] = {}
    for key, typ in _HOOK_KEYS.items():
        if key in raw and isinstance(raw[key], typ):
            out[key] = raw[key]
    if "delay_residual_steps" in out:
        out["delay_residual_steps"] = max(0, min(int(out["delay_residual_steps"]), 100_000))
    return out


@dataclass
class SpecConnectorMetadata(LynxConnectorMetadata):
    """Scheduler -> worker, once per step (the base fields plus the speculative ones)."""

    #: D: preempted requests whose residual is still pending: cancel silently (their blocks are gone).
    recv_cancelled: list[str] = field(default_factory=list)
    #: D: test hooks of the pulls started in this step (see ``TEST_HOOKS_PARAM``).
    test_hooks: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass
class SpecWorkerMeta(LynxWorkerMeta):
    """Worker -> scheduler: residuals merged (the base field) and residuals that failed after the anchor."""

    residual_failed: set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, LynxWorkerMeta):
            return self
        # Merged only when every tensor-parallel rank merged its shard; failed as soon as one rank failed.
        failed = self.residual_failed | getattr(other, "residual_failed", set())
        return SpecWorkerMeta(residual_merged=(self.residual_merged & other.residual_merged) - failed,
                              residual_failed=failed)
