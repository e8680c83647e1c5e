"""The arithmetic of ``lynx bench model``: TTFT and TT32T of one request per mode and flow, on paper.

Pure functions over three inputs, nothing measured here:

- :class:`Workload`: the model's KV shape and the prompt (the Lynx paper's Qwen3-32B at 16K tokens by default);
- :class:`Constants`: what this machine measured (codec cost relative to memcpy, the transport's achieved/paced
  ratio and anchor share, descriptors per stream, the side-channel round trip, speculative acceptance), read by
  ``model_inputs.py``;
- :class:`Assumptions`: the stated GPU/RDMA numbers (prefill, decode step, device copy rate, link efficiency,
  per-descriptor cost), documented field by field.

One request, one link. P runs the prefill, then (sequential flow) encodes every layer and answers the proxy, D
learns of the request, queries P and pulls every plane at once; or (pipelined flow) P encodes each layer when
its forward is done, D (dispatched at once) pulls each layer's planes as they become ready, anchor before
residual. The link is a fluid server: with anchor and residual bytes both waiting the anchor gets the measured
anchor share of the rate, otherwise one stream gets all of it. D writes (decodes) the planes its mode decodes
on, after everything landed (sequential) or layer by layer as they land (pipelined); the first token follows
one decode step later. Speculative: D decodes on the anchor and holds the tokens; the residual is merged, one
verify pass accepts ``acceptance`` of the held tokens and yields one more; the rest decode one step each.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from lynx_connector.modes import TransferMode

FLOWS: tuple[str, ...] = ("sequential", "pipelined")
_EPS = 1e-12


@dataclass(frozen=True)
class Workload:
    """The KV shape of one request."""

    model: str
    layers: int
    kv_heads: int
    head_dim: int
    tokens: int
    cache_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim", "tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"workload {name} must be >= 1, got {getattr(self, name)}")


#: The Lynx paper's Table 1 setting (docs: /work/shared/reference/paper.md, section 6).
PAPER_WORKLOAD = Workload("Qwen3-32B", layers=64, kv_heads=8, head_dim=128, tokens=16384)


def _a(default: Any, why: str) -> Any:
    return field(default=default, metadata={"why": why})


@dataclass(frozen=True)
class Assumptions:
    """Stated GPU/RDMA numbers: one set for every mode and flow. ``None`` = calibrated (see ``calibrate``)."""

    prefill_s: float | None = _a(None, "P's prefill of the whole prompt, s. None: calibrated jointly with "
                                       "link_efficiency on the paper's single-stream rows (least squares)")
    link_efficiency: float | None = _a(None, "payload rate / nominal link rate (protocol headers, pacing, "
                                             "RDMA or TCP efficiency), 0-1. None: calibrated")
    decode_step_s: float = _a(0.048, "one decode step of the 32B model at 16K context on D, s: the paper's "
                                     "Table 1, (TT32T - TTFT) / 31 = 0.048 for BF16, INT8 and INT4 alike")
    gpu_memcpy_gbps: float = _a(400.0, "device-to-device copy rate, GB/s (an Ascend 910B4-class NPU, ~half "
                                       "of its ~0.8 TB/s HBM); a codec's GPU throughput = this x its measured "
                                       "fraction of memcpy on this machine (codec.json)")
    per_descriptor_s: float = _a(2.4e-6, "CPU cost to post one NIXL descriptor, s (NIXL issue #1514: 46 ms "
                                         "for 18,880 descriptors over LIBFABRIC)")
    verify_steps: float = _a(1.0, "cost of the speculative verify pass over <= 64 held tokens, in decode "
                                  "steps (a memory-bound forward, like one step)")
    encode_on_critical_path: float = _a(1.0, "pipelined flow: share of P's per-layer encode time that lengthens "
                                             "its forward (1 = serialized, conservative; 0 = hidden on a "
                                             "side stream)")

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if v is not None and (not math.isfinite(v) or v < 0):
                raise ValueError(f"assumption {f.name} must be a finite number >= 0, got {v}")
        if self.link_efficiency is not None and not 0 < self.link_efficiency <= 1:
            raise ValueError(f"link_efficiency must be in (0, 1], got {self.link_efficiency}")
        if self.gpu_memcpy_gbps <= 0:
            raise ValueError("gpu_memcpy_gbps must be > 0")

    def explained(self) -> dict[str, dict[str, Any]]:
        """Every assumption with its value and why it has it (the JSON's ``assumptions``)."""
        return {f.name: {"value": getattr(self, f.name), "why": f.metadata["why"]} for f in fields(self)}


@dataclass(frozen=True)
class Acceptance:
    """Speculation on D: the share of held tokens the verify pass accepts, and the most tokens D holds."""

    acceptance: float
    #: Tokens D holds at most before it waits for the residual (the speculation cap, or what the confidence
    #: gate let through on average where that was measured); None = only the cap.
    held_cap: float | None
    source: str

    def __post_init__(self) -> None:
        if not 0 <= self.acceptance <= 1:
            raise ValueError(f"acceptance must be in [0, 1], got {self.acceptance}")


@dataclass(frozen=True)
class Constants:
    """What this machine measured (or the configuration says), as the model uses it."""

    #: Codec bench row -> (encode, decode) throughput as a fraction of memcpy of the same source bytes.
    codec_frac: dict[str, tuple[float, float]]
    #: Lynx residual merge (speculative: decode the anchor first, merge the residual later) / memcpy.
    merge_frac: float
    #: Achieved / paced link rate of the transport (capped at 1).
    transport_ratio: float
    #: Share of the link the anchor gets while residual bytes are also waiting.
    anchor_share: float
    #: Descriptors D posts per plane of one contiguous region (sequential: one region per plane).
    descriptors_per_region: int
    #: Side-channel round trip (D's query to P until the first chunk is posted), s.
    control_s: float
    acceptance: Acceptance
    #: LynxConfig.max_speculative_tokens.
    max_speculative_tokens: int


@dataclass(frozen=True)
class ModeCost:
    """One mode's bytes and per-layer codec times at one workload (pure numbers)."""

    mode: TransferMode
    #: Bytes per layer D pulls in the anchor and residual planes (residual 0 when the mode does not pull it).
    layer_anchor: int
    layer_residual: int
    #: Bytes per layer that must land before the first token may be released.
    layer_first: int
    encode_layer_s: float
    decode_layer_s: float
    merge_layer_s: float


def codec_rows(mode: TransferMode) -> tuple[str, str]:
    """``lynx bench codec`` rows of a mode: (encode row, decode row). P encodes every plane its codec has; D
    decodes the anchor alone (modes that decode on it) or both planes in one pass."""
    if not mode.two_stream:
        return mode.codec, mode.codec
    return f"{mode.codec}_full", f"{mode.codec}_{'anchor' if mode.decodes_on_anchor else 'full'}"


def mode_cost(mode: TransferMode, planes: tuple[int, int], source_layer_bytes: int, c: Constants,
              a: Assumptions) -> ModeCost:
    """``planes``: one layer's (anchor, residual) bytes from the codec registry; ``source_layer_bytes``: one
    layer's K+V in the cache dtype (what the codecs' throughput is measured on)."""
    enc_row, dec_row = codec_rows(mode)
    missing = [r for r in (enc_row, dec_row) if r not in c.codec_frac]
    if missing:
        raise ValueError(f"codec results have no row {missing} for mode {mode.name!r}")
    anchor, residual = planes
    residual = residual if mode.pulls_residual else 0
    rate = a.gpu_memcpy_gbps * 1e9
    enc = source_layer_bytes / (rate * c.codec_frac[enc_row][0])
    dec = source_layer_bytes / (rate * c.codec_frac[dec_row][1])
    merge = source_layer_bytes / (rate * c.merge_frac) if mode.late_residual else 0.0
    first = anchor if mode.first_token_after == "anchor" else anchor + residual
    return ModeCost(mode, anchor, residual, first, enc, dec, merge)


def serve_link(anchor: Sequence[tuple[float, int]], residual: Sequence[tuple[float, int]], rate: float,
               anchor_share: float) -> tuple[list[float], list[float]]:
    """Fluid link of ``rate`` bytes/s serving two FIFO streams of ``(ready_time, bytes)`` items (ready times
    non-decreasing per stream). While both streams have ready bytes the anchor gets ``anchor_share`` of the
    rate and the residual the rest; otherwise the one waiting gets it all. Returns each item's completion time."""
    if rate <= 0 or not 0 < anchor_share <= 1:
        raise ValueError("rate must be > 0 and anchor_share in (0, 1]")
    queues = [list(anchor), list(residual)]
    done: list[list[float]] = [[], []]
    idx = [0, 0]
    rem = [float(q[0][1]) if q else 0.0 for q in queues]
    t = 0.0
    while idx[0] < len(queues[0]) or idx[1] < len(queues[1]):
        active = [s for s in (0, 1) if idx[s] < len(queues[s]) and queues[s][idx[s]][0] <= t + _EPS]
        pending = [queues[s][idx[s]][0] for s in (0, 1) if idx[s] < len(queues[s]) and s not in active]
        if not active:
            t = min(pending)
            continue
        share = {0: anchor_share, 1: 1.0 - anchor_share} if len(active) == 2 else {active[0]: 1.0}
        steps = [rem[s] / (share[s] * rate) if share[s] > 0 else math.inf for s in active]
        dt = min(steps + [p - t for p in pending])
        for s in active:
            rem[s] -= share[s] * rate * dt
        t += dt
        for s in active:
            if rem[s] <= _EPS * max(1.0, rate):
                done[s].append(t)
                idx[s] += 1
                rem[s] = float(queues[s][idx[s]][1]) if idx[s] < len(queues[s]) else 0.0
    return done[0], done[1]


def link_rate(link_gbps: float, a: Assumptions, c: Constants) -> float:
    """Payload bytes/s on a ``link_gbps`` link."""
    if a.link_efficiency is None:
        raise ValueError("link_efficiency is not set (calibrate first)")
    return link_gbps * 1e9 / 8 * a.link_efficiency * c.transport_ratio


def predict(cost: ModeCost, flow: str, link_gbps: float, layers: int, a: Assumptions, c: Constants,
            k: int = 32) -> dict[str, float]:
    """TTFT and TT``k``T of one request, with the times they are built from (seconds)."""
    if flow not in FLOWS:
        raise ValueError(f"unknown flow {flow!r}; expected one of {FLOWS}")
    if a.prefill_s is None:
        raise ValueError("prefill_s is not set (calibrate first)")
    rate = link_rate(link_gbps, a, c)
    m, n = cost.mode, layers
    regions = 2 if cost.layer_residual else 1
    if flow == "sequential":  # P: forward, encode every layer, answer; D: query, post one region per plane
        p_done = a.prefill_s + n * cost.encode_layer_s
        start = p_done + c.control_s + regions * c.descriptors_per_region * a.per_descriptor_s
        ready = [start] * n
    else:  # per layer: forward (slowed by the encode's share), encode on a side stream, notify D, post
        ready, e_prev = [], 0.0
        per_layer_post = regions * c.descriptors_per_region * a.per_descriptor_s
        for i in range(n):
            fwd = (i + 1) * (a.prefill_s / n + a.encode_on_critical_path * cost.encode_layer_s)
            e_prev = max(fwd, e_prev) + cost.encode_layer_s
            ready.append(max(e_prev + c.control_s / 2, c.control_s) + per_layer_post)
        p_done = e_prev
    land_a, land_r = serve_link([(t, cost.layer_anchor) for t in ready],
                                [(t, cost.layer_residual) for t in ready] if cost.layer_residual else [],
                                rate, c.anchor_share if cost.layer_residual else 1.0)
    # the planes D decodes on: the anchor (modes that decode on it), else both
    need = land_a if m.decodes_on_anchor or not cost.layer_residual else [max(x, y) for x, y in
                                                                          zip(land_a, land_r, strict=True)]
    written = _chain(need, cost.decode_layer_s, flow)
    kv = written[-1]
    ttft = kv + a.decode_step_s
    out = {"ttft_s": ttft, "p_done_s": p_done, "anchor_landed_s": land_a[-1],
           "all_landed_s": max(land_a[-1], land_r[-1] if land_r else 0.0), "kv_written_s": kv,
           "limit_ttft_s": max(a.prefill_s, n * cost.layer_first / rate) + a.decode_step_s,
           # one region per plane (sequential) or per layer and plane (pipelined)
           "descriptors": regions * c.descriptors_per_region * (1 if flow == "sequential" else n)}
    if not m.late_residual:
        out[f"tt{k}t_s"] = ttft + (k - 1) * a.decode_step_s
        return out
    # a layer's residual is merged into blocks its anchor was written to
    merged = _chain([max(x, w) for x, w in zip(land_r, written, strict=True)], cost.merge_layer_s, flow)[-1]
    out.update(speculative_ttk(ttft, merged, a, c, k))
    return out


def _chain(land: Sequence[float], per_layer_s: float, flow: str) -> list[float]:
    """When D has processed each layer, one after another: once every layer landed (sequential) or each as
    soon as it landed (pipelined)."""
    out, t = [], max(land) if flow == "sequential" else 0.0
    for x in land:
        t = max(t, x) + per_layer_s
        out.append(t)
    return out


def speculative_ttk(ttft: float, merged: float, a: Assumptions, c: Constants, k: int) -> dict[str, float]:
    """Token ``k``'s release under speculation (expected values). D decodes on the anchor from the first token
    on, one token per step, holding up to the cap; when the residual is merged (and the held tokens decoded) one
    verify pass accepts ``acceptance`` of them and yields one more token; later tokens take one step each."""
    step = a.decode_step_s
    cap = float(c.max_speculative_tokens)
    if c.acceptance.held_cap is not None:
        cap = min(cap, c.acceptance.held_cap)
    held = min(cap, max(0.0, math.floor((merged - ttft) / step + _EPS))) if step > 0 else cap
    verified = max(merged, ttft + held * step) + a.verify_steps * step
    accepted = c.acceptance.acceptance * held
    released = 2.0 + accepted  # the first token, the accepted ones, the verify pass's own
    ttk = verified if released >= k else verified + (k - released) * step
    return {f"tt{k}t_s": ttk, "residual_merged_s": merged, "held_tokens": held, "accepted_tokens": accepted,
            "verified_s": verified}


def calibrate(a: Assumptions, reference: dict[str, float], costs: dict[str, ModeCost], link_gbps: float,
              layers: int, c: Constants) -> tuple[Assumptions, dict[str, Any]]:
    """Fill ``prefill_s`` and/or ``link_efficiency`` (those left None) by least squares on the relative error of
    the sequential TTFT of ``reference`` (mode -> seconds). TTFT is affine in prefill and in 1 / efficiency, so
    this is an exact linear least-squares solve. Returns the completed assumptions and what was done."""
    free = [name for name in ("prefill_s", "link_efficiency") if getattr(a, name) is None]
    if not free:
        return a, {"calibrated": [], "rows": sorted(reference)}
    if len(reference) < len(free):
        raise ValueError(f"calibrating {free} needs at least {len(free)} reference rows, got {len(reference)}")
    # ttft(mode) = base + p * prefill + w * inv_eff, from three evaluations (prefill and 1/eff are additive)
    probe = replace(a, prefill_s=0.0 if a.prefill_s is None else a.prefill_s,
                    link_efficiency=1.0 if a.link_efficiency is None else a.link_efficiency)
    rows = []
    for name, y in reference.items():
        base = predict(costs[name], "sequential", link_gbps, layers, probe, c)["ttft_s"]
        p = 1.0 if a.prefill_s is None else 0.0
        w = 0.0
        if a.link_efficiency is None:
            half = replace(probe, link_efficiency=0.5)
            w = predict(costs[name], "sequential", link_gbps, layers, half, c)["ttft_s"] - base  # wire at eff 1
            base -= w  # base = ttft with the wire time removed (1 / eff multiplies the wire time)
        rows.append((name, y, base, p, w))
    # minimise sum(((base + p*x0 + w*x1) - y) / y)^2 over the free unknowns
    cols = [[r[3] / r[1] for r in rows]] if a.prefill_s is None else []
    if a.link_efficiency is None:
        cols.append([r[4] / r[1] for r in rows])
    rhs = [(r[1] - r[2]) / r[1] for r in rows]
    x = _lstsq(cols, rhs)
    values = dict(zip(free, x, strict=True))
    if "link_efficiency" in values:
        inv = values["link_efficiency"]
        if inv < 1.0 - 1e-9:
            raise ValueError(f"the reference rows imply a link efficiency of {1 / inv:.3f} > 1: no single set "
                             "of assumptions reproduces them")
        values["link_efficiency"] = 1.0 / inv
    if values.get("prefill_s", 0.0) < 0:
        raise ValueError(f"the reference rows imply a negative prefill ({values['prefill_s']:.3f} s)")
    return replace(a, **values), {"calibrated": free, "rows": sorted(reference), "values": values,
                                  "method": "least squares on the relative error of the sequential TTFT"}


def _lstsq(cols: list[list[float]], rhs: list[float]) -> list[float]:
    """Solve min |A x - b| for 1 or 2 columns by the normal equations."""
    if len(cols) == 1:
        (u,) = cols
        den = sum(v * v for v in u)
        if den <= 0:
            raise ValueError("degenerate calibration")
        return [sum(v * b for v, b in zip(u, rhs, strict=True)) / den]
    u, v = cols
    suu, svv, suv = (sum(x * x for x in u), sum(x * x for x in v), sum(x * y for x, y in zip(u, v, strict=True)))
    sub, svb = sum(x * b for x, b in zip(u, rhs, strict=True)), sum(x * b for x, b in zip(v, rhs, strict=True))
    det = suu * svv - suv * suv
    if abs(det) <= 1e-18 * max(1.0, suu * svv):
        raise ValueError("degenerate calibration: the reference rows do not separate prefill from link time")
    return [(sub * svv - svb * suv) / det, (svb * suu - sub * suv) / det]
