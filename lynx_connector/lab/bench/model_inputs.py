"""The measured constants of ``lynx bench model``, read from the other benches' result files on this machine.

- ``codec.json`` (``lynx bench codec``): every codec's encode/decode throughput and the residual merge, as a
  fraction of memcpy of the same bytes measured in the same run (the model applies the fraction to the GPU's
  copy rate: a codec kernel is memory-bound on both).
- ``transfer.json`` (``lynx bench transfer``): at the paced rates whose achieved/paced check passed (the others
  were bound by this machine's memory, not the transport), the worst achieved/paced ratio (capped at 1: the
  results before the virtual link clock of 12-04 came from a token bucket whose first chunk rode on credit), the anchor's share of the link while a residual also streams
  (int4's seconds per byte over Lynx's time-to-anchor per anchor byte: the two move nearly the same bytes), the
  descriptors per plane, and the side-channel round trip (pull() to the first chunk posted).
- ``e2e_gate.json`` / ``e2e.json`` (``lynx bench e2e``): speculative acceptance (accepted / speculated, pooled
  over the files' speculative rows at concurrency 1) and the tokens D held per request under its confidence
  gate.
- Bytes per layer per mode: the codec registry (``TransferMode.plane_nbytes``), at the workload's shape.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from lynx_connector.lab.bench.common import REPO_ROOT
from lynx_connector.lab.bench.ttft_model import (
    Acceptance,
    Assumptions,
    Constants,
    ModeCost,
    Workload,
    mode_cost,
)
from lynx_connector.modes import TransferMode

#: The benchmarks' results folder: the checkout's, or, from an installed wheel (no checkout: it must neither read
#: nor write inside site-packages), the working directory's.
RESULTS = (REPO_ROOT or Path()) / "benchmarks" / "results"
ACCEPTANCE_FILES = ("e2e_gate.json", "e2e.json")


class MissingResultError(FileNotFoundError):
    """A measured input file is absent or lacks what the model needs; the message says which and how to make it."""


def _load(path: Path, bench: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise MissingResultError(f"{path} not found: run `lynx bench {bench} --out {path}` first") from None
    except json.JSONDecodeError as e:
        raise MissingResultError(f"{path} is not valid JSON ({e})") from None
    if data.get("bench") != bench:
        raise MissingResultError(f"{path} is not a `lynx bench {bench}` result (bench={data.get('bench')!r})")
    return data


def read_codec(path: Path) -> dict[str, Any]:
    """Per codec row (encode, decode) / memcpy, and merge / memcpy."""
    data = _load(path, "codec")
    memcpy = float(data["memcpy_gbps"])
    frac = {r["codec"]: (r["encode_gbps"] / memcpy, r["decode_gbps"] / memcpy) for r in data["rows"]}
    merge = [r["merge_gbps"] / memcpy for r in data["rows"] if "merge_gbps" in r]
    if not merge:
        raise MissingResultError(f"{path} has no residual merge measurement (merge_gbps)")
    return {"file": str(path), "codec_frac": frac, "merge_frac": merge[0], "memcpy_gbps": memcpy,
            "model": data.get("model"), "tokens": data.get("tokens"), "cache_dtype": data.get("cache_dtype"),
            "timestamp": data.get("timestamp")}


def read_transfer(path: Path) -> dict[str, Any]:
    """Achieved/paced ratio, anchor share, descriptors per plane and control round trip."""
    data = _load(path, "transfer")
    rows = data["rows"]
    passed = sorted({float(c["row"].split("@")[1]) for c in data.get("checks", [])
                     if c["metric"].startswith("achieved / paced") and c["pass"]})
    if not passed:
        raise MissingResultError(f"{path}: no paced rate passed its achieved/paced check")
    paced = [r for r in rows if r.get("link_gbps") in passed]
    ratios = [r["rate_frac"] for r in paced if r.get("rate_frac")]
    shares = []
    for rate in passed:
        by = {r["scheme"]: r for r in paced if r["link_gbps"] == rate}
        lynx, int4 = by.get("lynx"), by.get("int4")
        if lynx and int4 and lynx.get("t_anchor_s"):
            shares.append((int4["t_full_s"] / int4["bytes"]) / (lynx["t_anchor_s"] / lynx["anchor_bytes"]))
    if not shares:
        raise MissingResultError(f"{path}: no lynx and int4 rows at a passing rate (anchor share)")
    per_region = {r["descriptors"] / (2 if r.get("residual_bytes") else 1) for r in rows}
    control = statistics.median(r["t_full_s"] - r["t_data_s"] for r in paced)
    return {"file": str(path), "rates_used_gbps": passed, "transport_ratio_worst": min(ratios),
            "transport_ratio": min(1.0, min(ratios)), "anchor_share": min(1.0, statistics.median(shares)),
            "anchor_share_samples": shares, "descriptors_per_region": int(max(per_region)),
            "control_s": control, "timestamp": data.get("timestamp")}


def read_acceptance(results_dir: Path) -> dict[str, Any]:
    """Pooled accepted / speculated over the speculative rows at concurrency 1 of the e2e files present, and
    the mean tokens held per request (D's confidence gate stops holding on a low margin)."""
    speculated = accepted = requests = 0
    used = []
    for name in ACCEPTANCE_FILES:
        path = results_dir / name
        if not path.exists():
            continue
        data = _load(path, "e2e")
        rows = [r for r in data["rows"] if r.get("mode") == "speculative" and r.get("concurrency") == 1
                and r.get("speculated")]
        if not rows:
            continue
        used.append(str(path))
        speculated += sum(r["speculated"] for r in rows)
        accepted += sum(r["accepted"] for r in rows)
        requests += sum(r["n"] for r in rows)
    if not speculated:
        raise MissingResultError(f"no speculative rows in {', '.join(ACCEPTANCE_FILES)} under {results_dir}: run "
                                 "`lynx bench e2e` first, or give --acceptance")
    return {"files": used, "speculated": speculated, "accepted": accepted, "requests": requests,
            "acceptance": accepted / speculated, "held_per_request": speculated / requests}


def read_constants(results_dir: Path, acceptance: float | None = None,
                   held_cap: float | None = None) -> tuple[Constants, dict[str, Any]]:
    """Everything measured, as :class:`Constants`, and the raw record for the JSON. ``acceptance``/``held_cap``
    given: they replace the measured acceptance model (``held_cap`` <= 0: no cap but the configuration's)."""
    from lynx_connector.config import LynxConfig

    codec = read_codec(results_dir / "codec.json")
    transfer = read_transfer(results_dir / "transfer.json")
    record: dict[str, Any] = {"codec": codec, "transfer": transfer}
    if acceptance is None:
        measured = read_acceptance(results_dir)
        record["acceptance"] = measured
        acc = Acceptance(measured["acceptance"], measured["held_per_request"] if held_cap is None else
                         (held_cap if held_cap > 0 else None),
                         f"measured: {measured['accepted']}/{measured['speculated']} held tokens accepted over "
                         f"{measured['requests']} requests, {measured['held_per_request']:.2f} held per request "
                         f"(SmolLM2-135M, D's confidence gate) in {', '.join(Path(f).name for f in measured['files'])}")
    else:
        cap = held_cap if held_cap is not None and held_cap > 0 else None
        acc = Acceptance(acceptance, cap, f"given: acceptance {acceptance}, held cap {cap}")
        record["acceptance"] = {"given": True, "acceptance": acceptance, "held_cap": cap}
    constants = Constants(codec_frac=codec["codec_frac"], merge_frac=codec["merge_frac"],
                          transport_ratio=transfer["transport_ratio"], anchor_share=transfer["anchor_share"],
                          descriptors_per_region=transfer["descriptors_per_region"],
                          control_s=transfer["control_s"], acceptance=acc,
                          max_speculative_tokens=LynxConfig.max_speculative_tokens)
    return constants, record


def source_layer_bytes(w: Workload) -> int:
    """One layer's K+V in the cache dtype."""
    import torch

    return 2 * w.tokens * w.kv_heads * w.head_dim * getattr(torch, w.cache_dtype).itemsize


def mode_costs(modes: list[TransferMode], w: Workload, c: Constants, a: Assumptions) -> dict[str, ModeCost]:
    """Every mode's per-layer bytes (codec registry) and codec times at workload ``w``."""
    import torch

    dtype = getattr(torch, w.cache_dtype)
    src = source_layer_bytes(w)
    return {m.name: mode_cost(m, m.plane_nbytes(w.tokens, w.kv_heads, w.head_dim, dtype), src, c, a)
            for m in modes}
