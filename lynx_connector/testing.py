"""Test-only fault hooks of the connector, all of them, behind one seam: a ``FaultHooks`` object per half.

Production code gets its object from ``fault_hooks(config)`` and calls only the methods below; without
``LYNX_TEST_HOOKS=1`` and without ``fault_injection`` in the config every method answers "no fault" (the
scheduler half only warns about a request that carries hooks it will not honour).

Two sources of faults:

* ``fault_injection="corrupt_residual"`` (config key, every request): D flips the residual's bits just before the
  merge, after the residual passed its checksum (proves that D's KV is built from the residual it merges).
* per request, ``kv_transfer_params["lynx_test_hooks"]`` (honoured only with ``LYNX_TEST_HOOKS=1``):
  ``{"delay_residual_steps": N}`` merges the residual no earlier than N worker steps after the anchor (makes the
  speculation window deterministic), ``{"corrupt_residual": true}`` flips the residual's bits before the merge
  (after its checksum), ``{"fail_residual": true}`` reports the residual stream as failed when it lands,
  ``{"flip_bit": {"plane": "anchor"|"residual", "layer": L, "byte": B, "bit": b}}`` flips one bit of layer L's
  plane in D's staging right after the READ lands, before the checksum (a corrupted transfer); on P,
  ``{"kv_range": true}`` writes 7e4 (beyond fp16's 65504, the codec's range) into the request's first K value
  of layer 0 in P's real KV cache just before it is encoded (data the codec cannot encode).

Path of a per-request hook: the scheduler half parses it when the pull (D) or the save (P) starts
(``on_pull``), sends it to the
worker in ``LynxConnectorMetadata.test_hooks`` (``take_outgoing``); the worker half tracks it for the life of
the pull (``track`` / ``forget``) and asks at the points where a fault can bite (``residual_error``,
``flip_bit``, ``corrupt``, ``defer_merge`` / ``due_merges``).
"""

from __future__ import annotations

import os
from typing import Any

from lynx_connector.logger import init_logger

logger = init_logger(__name__)

#: Environment switch that enables the per-request test hooks (never set it in production).
TEST_HOOKS_ENV = "LYNX_TEST_HOOKS"
#: kv_transfer_params key of the per-request test hooks.
TEST_HOOKS_PARAM = "lynx_test_hooks"
#: Accepted values of the ``fault_injection`` config key (besides none).
FAULT_INJECTIONS = ("corrupt_residual",)
_HOOK_KEYS = {"delay_residual_steps": int, "corrupt_residual": bool, "fail_residual": bool, "flip_bit": dict,
              "kv_range": bool}
#: The value the ``kv_range`` hook writes: finite in fp32/bf16 caches, beyond the codec's fp16 range.
OUT_OF_RANGE = 7.0e4


def _flip_bit(raw: dict[str, Any]) -> dict[str, Any] | None:
    """A valid ``flip_bit`` hook, or None."""
    ints = [raw.get(k) for k in ("layer", "byte", "bit")]
    if raw.get("plane") not in ("anchor", "residual") or not all(isinstance(v, int) and v >= 0 for v in ints):
        return None
    return {"plane": raw["plane"], "layer": ints[0], "byte": ints[1], "bit": ints[2] % 8}


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
    if "flip_bit" in out:
        flip = _flip_bit(out.pop("flip_bit"))
        if flip is not None:
            out["flip_bit"] = flip
    return out


class FaultHooks:
    """One per connector half. ``corrupt_all``: the ``fault_injection="corrupt_residual"`` config."""

    def __init__(self, corrupt_all: bool = False) -> None:
        self.corrupt_all = corrupt_all
        self._outgoing: dict[str, dict[str, Any]] = {}  # scheduler half: hooks of the pulls started this step
        self._hooks: dict[str, dict[str, Any]] = {}  # worker half: hooks of the pulls in flight
        self._deferred: dict[str, int] = {}  # worker half: residual merges held back -> step of their anchor

    # ---- scheduler half ---------------------------------------------------------------------------------
    def on_pull(self, req_id: str, params: dict[str, Any]) -> None:
        """A pull (D) or a save (P) starts for ``req_id``: note the hooks its kv_transfer_params carry (if
        honoured)."""
        hooks = parse_test_hooks(req_id, params)
        if hooks:
            self._outgoing[req_id] = hooks

    def take_outgoing(self) -> dict[str, dict[str, Any]]:
        """The hooks to send to the workers with this step's metadata."""
        out, self._outgoing = self._outgoing, {}
        return out

    # ---- worker half --------------------------------------------------------------------------------------
    def track(self, req_id: str, hooks: dict[str, Any] | None) -> None:
        if hooks:
            self._hooks[req_id] = dict(hooks)

    def forget(self, req_id: str) -> None:
        self._hooks.pop(req_id, None)
        self._deferred.pop(req_id, None)

    def residual_error(self, req_id: str) -> str | None:
        """The error to report instead of a residual that has just landed (``fail_residual``), if any."""
        if self._hooks.get(req_id, {}).get("fail_residual"):
            return "residual stream failed (test hook fail_residual)"
        return None

    def out_of_range_kv(self, req_id: str, kv: Any, layout: Any, block_ids: list[int], num_tokens: int) -> None:
        """P, hook ``kv_range``: put a value beyond the codec's range into the request's first K of this layer
        (``kv``, layer 0) in P's KV cache, just before the encode; the hook is used up."""
        if not self._hooks.pop(req_id, {}).get("kv_range"):
            return
        k, v = layout.gather(kv, block_ids, num_tokens)
        k.view(-1)[0] = OUT_OF_RANGE
        layout.scatter(kv, block_ids, num_tokens, k, v)

    def flip_bit(self, req_id: str, stream: str) -> tuple[int, int, int] | None:
        """``(layer, byte, bit)`` of the bit to flip in the plane ``stream`` that has just landed, if any."""
        flip = self._hooks.get(req_id, {}).get("flip_bit")
        if not flip or flip.get("plane") != stream:
            return None
        return int(flip["layer"]), int(flip["byte"]), int(flip["bit"]) % 8

    def corrupt(self, req_id: str, residual: Any) -> None:
        """Flip the bits of a residual about to be merged (``corrupt_residual``)."""
        if self.corrupt_all or self._hooks.get(req_id, {}).get("corrupt_residual"):
            residual.bitwise_xor_(0x5A)

    def residual_late(self, req_id: str) -> bool:
        """``delay_residual_steps`` (0 included) stands for a residual that lands steps after the anchor: D must
        not wait for it (``residual_grace_s``), whenever it really landed; the delayed merge counts its steps from
        the anchor's write, so an anchor held back by the grace would never be merged."""
        return self._hooks.get(req_id, {}).get("delay_residual_steps") is not None

    def defer_merge(self, req_id: str, anchor_step: int, step: int) -> bool:
        """True when the merge of a landed residual must wait (``delay_residual_steps``); ``due_merges`` hands
        it back in the step it is due."""
        if self._due(req_id, anchor_step, step):
            return False
        self._deferred[req_id] = anchor_step
        return True

    def due_merges(self, step: int) -> list[str]:
        """Requests whose deferred residual merge is due in this worker step."""
        if not self._deferred:
            return []
        due = [r for r, anchor_step in self._deferred.items() if self._due(r, anchor_step, step)]
        for r in due:
            del self._deferred[r]
        return due

    def _due(self, req_id: str, anchor_step: int, step: int) -> bool:
        delay = self._hooks.get(req_id, {}).get("delay_residual_steps")
        return delay is None or (anchor_step >= 0 and step - anchor_step >= delay)


def fault_hooks(config: Any) -> FaultHooks:
    """The fault hooks of a connector half with this ``LynxConfig`` (all "no fault" in production)."""
    return FaultHooks(corrupt_all=config.fault_injection == "corrupt_residual")
