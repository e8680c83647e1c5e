"""The issue's latency targets and how a result is judged against them (also re-judged from stored results)."""

from __future__ import annotations

import math
import statistics
from typing import Any

from lynx_connector.lab.bench.e2e.plan import ModelShape, ttft_floors, wire_bytes
from lynx_connector.modes import AUTO_MODE

TARGETS = {
    "spec_ttft_vs_int8": 1.43,  # int8 TTFT / speculative TTFT in the transfer-dominated regime
    "spec_ttft_vs_int4": 1.15,  # speculative TTFT / int4 TTFT at most
    "compute_regime_lynx_vs_int8": 1.05,  # lynx (full, speculative) TTFT / int8 TTFT at most at ratio 0.5
    "spec_ttft_vs_full": 1.43,  # full TTFT / speculative TTFT in the transfer-dominated regime (issue 5)
    "spec_acceptance": 0.85,  # accepted / speculated tokens there (issue 5)
    # issue 15 (pipelined transfer), concurrency 1
    "pipelined_spec_vs_limit": 1.15,  # balanced regime: pipelined speculative TTFT / its limit at most
    "seq_int8_vs_pipelined_spec": 2.0,  # transfer-dominated: sequential int8 TTFT / pipelined speculative TTFT
    "pipelined_spec_vs_int4": 1.05,  # transfer-dominated: pipelined speculative / pipelined int4 TTFT at most
    "pipelined_spec_vs_prefill": 1.05,  # compute-dominated: pipelined speculative TTFT / prefill at most
    # issue 14: checksums + MACs (P and D, per request) / pipelined TTFT at most, in the 2x and 10x regimes
    "security_vs_ttft": 0.03,
    # issue 16: auto TTFT / the best of these fixed modes' TTFT at most, in each regime (same cell otherwise)
    "auto_vs_best_fixed": 1.05,
    # issue 16, concurrency 4 and 8 in the link-dominated regimes (2x, 10x), per cell
    "conc_full_vs_int8": 1.0,  # full TTFT / int8 TTFT at most
    "conc_spec_tt32_vs_int8": 0.9,  # speculative TT32T / int8 TT32T at most
    "conc4_int8_vs_ideal": 1.15,  # int8 TTFT / its ideal TTFT at concurrency 4
}
#: The regimes issue 16's concurrency targets are judged in: 16-bit BF16 transfer at least this x prefill.
CONC_MIN_RATIO = 2.0
#: Regimes by their ratio (BF16 transfer time / prefill), whatever else the run measured: at least this is
#: transfer-dominated (the 10x targets), below 1 compute-dominated (the 0.5x targets), between them balanced
#: (the 2x targets).
TRANSFER_DOMINATED = 5.0
#: The fixed modes auto is judged against (issue 16).
AUTO_RIVALS = ("bf16", "int8", "full", "speculative")
#: The flow the earlier issues' targets are judged on: what ``lynx proxy`` runs by default (rows of results
#: written before flows existed are sequential).
DEFAULT_FLOW = "pipelined"


def evaluate_targets(rows: list[dict]) -> list[dict[str, Any]]:
    """The issue's latency targets, judged on concurrency-1 medians pooled per rate (None = not measurable); each
    row's regime comes from its own ``target_ratio`` (:func:`regime`)."""
    checks: list[dict[str, Any]] = []

    flows = {r.get("flow", "sequential") for r in rows}
    base = DEFAULT_FLOW if DEFAULT_FLOW in flows else "sequential"

    def cells(label: str, mode: str, any_concurrency: bool = False, flow: str | None = None) -> list[dict]:
        return [r for r in rows if r["rate_label"] == label and r["mode"] == mode
                and (any_concurrency or r["concurrency"] == 1) and r.get("flow", "sequential") == (flow or base)]

    def med(label: str, mode: str, key: str, flow: str | None = None) -> float | None:
        vals = [r[key] for r in cells(label, mode, flow=flow) if r[key] is not None]
        return statistics.median(vals) if vals else None

    def pooled(label: str, key: str) -> int:
        return sum(r[key] or 0 for r in cells(label, "speculative"))

    # the transfer-dominated and compute-dominated regimes, by their ratio (not by rank within the run)
    hi, lo = regime_labels(rows, "transfer"), regime_labels(rows, "compute")

    for label in hi:
        spec, i8, i4, full = (med(label, m, "ttft_s_median") for m in ("speculative", "int8", "int4", "full"))
        s32, i832 = med(label, "speculative", "tt32_s_median"), med(label, "int8", "tt32_s_median")
        checks.append(_check(label, "int8 TTFT / speculative TTFT", i8 / spec if spec and i8 else None,
                             ">=", TARGETS["spec_ttft_vs_int8"]))
        checks.append(_check(label, "speculative TTFT / int4 TTFT", spec / i4 if spec and i4 else None,
                             "<=", TARGETS["spec_ttft_vs_int4"]))
        checks.append(_check(label, "speculative TT32T / int8 TT32T", s32 / i832 if s32 and i832 else None,
                             "<", 1.0))
        checks.append(_check(label, "full TTFT / speculative TTFT", full / spec if spec and full else None,
                             ">=", TARGETS["spec_ttft_vs_full"]))
        for k in (32, 64):
            s_k, f_k = med(label, "speculative", f"tt{k}_s_median"), med(label, "full", f"tt{k}_s_median")
            checks.append(_check(label, f"speculative TT{k}T / full TT{k}T", s_k / f_k if s_k and f_k else None,
                                 "<", 1.0))
        held = pooled(label, "speculated")
        checks.append(_check(label, "speculative acceptance (accepted / speculated)",
                             pooled(label, "accepted") / held if held else None, ">=", TARGETS["spec_acceptance"]))
    for label in dict.fromkeys(r["rate_label"] for r in rows):  # exactness holds in every regime
        eq = [r["output_equal_full"] for r in cells(label, "speculative", any_concurrency=True)
              if r.get("output_equal_full") is not None]
        if eq or label in hi:
            checks.append(_check(label, "speculative outputs equal to full (share)", min(eq) if eq else None,
                                 ">=", 1.0))
    for label in lo:
        i8 = med(label, "int8", "ttft_s_median")
        for m in ("full", "speculative"):
            v = med(label, m, "ttft_s_median")
            checks.append(_check(label, f"{m} TTFT / int8 TTFT", v / i8 if v and i8 else None, "<=",
                                 TARGETS["compute_regime_lynx_vs_int8"]))
    if "pipelined" in flows:
        checks += _pipelined_checks(rows, med, cells, hi, lo)
    checks += concurrency_checks(rows)
    checks += auto_checks(rows)
    checks += failure_checks(rows)
    return checks


def regime(ratio: float | None) -> str | None:
    """``transfer``, ``balanced`` or ``compute`` for a cell's ratio (``TRANSFER_DOMINATED``); None unpaced."""
    if ratio is None:
        return None
    return "transfer" if ratio >= TRANSFER_DOMINATED else "compute" if ratio < 1 else "balanced"


def regime_labels(rows: list[dict], which: str) -> list[str]:
    return list(dict.fromkeys(r["rate_label"] for r in rows if regime(r.get("target_ratio")) == which))


def failure_checks(rows: list[dict]) -> list[dict[str, Any]]:
    """A failed request (an error, or no token at all) fails its cell: its medians are of the requests that
    answered, so without this a mode that failed its slowest requests would look faster."""
    return [_check(r["rate_label"], f"{r['mode']} failed requests (conc {r['concurrency']}, "
                                    f"{r.get('flow', 'sequential')} proxy)", r["errors"], "<=", 0)
            for r in rows if r.get("errors")]


def concurrency_checks(rows: list[dict]) -> list[dict[str, Any]]:
    """Issue 16 at concurrency above 1, per cell (regime of ratio >= ``CONC_MIN_RATIO``, concurrency, prompt
    length, flow) where int8 ran: full TTFT / int8 TTFT, speculative TT32T / int8 TT32T and, at concurrency 4,
    int8 TTFT over its ideal TTFT (the issue's measure; in the pipelined flow, where transfer overlaps prefill,
    the row's TTFT/limit is the stricter floor); a ratio needs both of its modes in the cell."""
    out: list[dict[str, Any]] = []
    for i8 in rows:
        if (i8["mode"] != "int8" or i8["concurrency"] <= 1 or i8.get("target_ratio") is None
                or i8["target_ratio"] < CONC_MIN_RATIO):
            continue
        same = _same_cell(rows, i8)
        where = f"conc {i8['concurrency']}, {i8.get('flow', 'sequential')} proxy"
        out.append(_check(i8["rate_label"], f"full TTFT / int8 TTFT ({where})",
                          _over(same.get("full"), i8, "ttft_s_median"), "<=", TARGETS["conc_full_vs_int8"]))
        spec = _check(i8["rate_label"], f"speculative TT32T / int8 TT32T ({where})",
                      _over(same.get("speculative"), i8, "tt32_s_median"), "<=", TARGETS["conc_spec_tt32_vs_int8"])
        spec.update(exact_floor(same.get("full"), same.get("speculative"), i8, TARGETS["conc_spec_tt32_vs_int8"]))
        out.append(spec)
        if i8["concurrency"] == 4:  # the ideal (the table's TTFT/limit is the pipelined flow's own floor)
            out.append(_check(i8["rate_label"], f"int8 TTFT / ideal ({where})", i8.get("ttft_vs_ideal"), "<=",
                              TARGETS["conc4_int8_vs_ideal"]))
    return out


def exact_floor(full: dict | None, spec: dict | None, i8: dict, target: float) -> dict[str, Any]:
    """What exact outputs allow the speculative TT32T / int8 TT32T ratio in one cell, from its medians. The 32nd
    token is released no sooner than the residual has landed and one verification step has run: when full mode,
    which waits for the same bytes, releases its first token. So ``floor`` = full TTFT / int8 TT32T bounds the
    ratio from below for any anchor and any gate. When the floor is under ``target``, the residual landing then
    still leaves tokens to decode one step each: ``needs_accepted`` = 31 - (target x int8 TT32T - full TTFT) /
    step tokens must have been held on the anchor and accepted per request (step: the cell's decode step), against
    the ``accepted_per_request`` measured. Empty when full or the speculative row is missing."""
    if not (full and spec and full.get("ttft_s_median") and i8.get("tt32_s_median")):
        return {}
    out: dict[str, Any] = {"floor": full["ttft_s_median"] / i8["tt32_s_median"]}
    step = spec.get("decode_step_s") or i8.get("decode_step_s")
    if spec.get("accepted") is not None and spec.get("n"):
        out["accepted_per_request"] = spec["accepted"] / spec["n"]
    if out["floor"] <= target and step:
        after_first = 31  # the tokens of a TT32T after the first, one decode step each unless held and accepted
        slack = (target * i8["tt32_s_median"] - full["ttft_s_median"]) / step
        out["needs_accepted"] = max(0, math.ceil(after_first - slack))
    return out


def _same_cell(rows: list[dict], row: dict) -> dict[str, dict]:
    """The rows of ``row``'s cell (regime, concurrency, prompt length, flow), by mode."""
    return {r["mode"]: r for r in rows if r["rate_label"] == row["rate_label"]
            and r["concurrency"] == row["concurrency"] and r.get("nominal_tokens") == row.get("nominal_tokens")
            and r.get("flow", "sequential") == row.get("flow", "sequential")}


def _over(row: dict | None, base: dict, key: str) -> float | None:
    """``row[key] / base[key]``; None when the row did not run or either value is missing."""
    return row[key] / base[key] if row and row.get(key) and base.get(key) else None


def auto_checks(rows: list[dict]) -> list[dict[str, Any]]:
    """Issue 16: per cell of an auto row (regime, concurrency, prompt length, flow), auto's median TTFT over the
    best median TTFT of the fixed modes bf16, int8, full and speculative measured in the same cell; a rival not
    in the run is named as "not run", and with none of them the check is "not run" (value None)."""
    out: list[dict[str, Any]] = []
    for a in rows:
        if a["mode"] != AUTO_MODE:
            continue
        same = _same_cell(rows, a)
        timed = {m: r["ttft_s_median"] for m, r in same.items()
                 if m in AUTO_RIVALS and r["ttft_s_median"] is not None}
        missing = [m if m not in same else f"{m} (no request answered)" for m in AUTO_RIVALS if m not in timed]
        best = min(timed, key=lambda m: timed[m]) if timed else None
        what = (f"auto TTFT / best fixed TTFT ({best if best else 'none'}; conc {a['concurrency']}, "
                f"{a.get('flow', 'sequential')} proxy" + (f"; not run: {', '.join(missing)}" if missing else "") + ")")
        value = a["ttft_s_median"] / timed[best] if best and a["ttft_s_median"] else None
        check = _check(a["rate_label"], what, value, "<=", TARGETS["auto_vs_best_fixed"])
        if not timed:
            check["note"] = "not run: none of " + ", ".join(AUTO_RIVALS) + " in this cell"
        out.append(check)
    return out


def _pipelined_checks(rows: list[dict], med: Any, cells: Any, hi: list[str], lo: list[str]) -> list[dict[str, Any]]:
    """Issue 15's targets: the pipelined flow against its limit, the sequential int8 and the pipelined int4."""
    out: list[dict[str, Any]] = []
    balanced = regime_labels(rows, "balanced")
    p = "pipelined"
    for label in balanced:
        v = med(label, "speculative", "ttft_vs_limit", p)
        out.append(_check(label, "pipelined speculative TTFT / limit", v, "<=", TARGETS["pipelined_spec_vs_limit"]))
    for label in hi:
        spec, i4 = med(label, "speculative", "ttft_s_median", p), med(label, "int4", "ttft_s_median", p)
        i8_seq = med(label, "int8", "ttft_s_median", "sequential")
        out.append(_check(label, "sequential int8 TTFT / pipelined speculative TTFT",
                          i8_seq / spec if spec and i8_seq else None, ">=", TARGETS["seq_int8_vs_pipelined_spec"]))
        out.append(_check(label, "pipelined speculative TTFT / pipelined int4 TTFT", spec / i4 if spec and i4 else None,
                          "<=", TARGETS["pipelined_spec_vs_int4"]))
    for label in lo:
        spec, pre = med(label, "speculative", "ttft_s_median", p), med(label, "speculative", "prefill_s", p)
        out.append(_check(label, "pipelined speculative TTFT / prefill", spec / pre if spec and pre else None, "<=",
                          TARGETS["pipelined_spec_vs_prefill"]))
    for label in dict.fromkeys(r["rate_label"] for r in rows):
        eq = [r["output_equal_full"] for r in cells(label, "speculative", any_concurrency=True, flow=p)
              if r.get("output_equal_full") is not None]
        if eq:
            out.append(_check(label, "pipelined speculative outputs equal to full (share)", min(eq), ">=", 1.0))
    for label in [*balanced, *hi]:  # issue 14: the cost of checksums and MACs, every mode's worst cell
        vals = [r["security_vs_ttft"] for r in rows if r["rate_label"] == label and r.get("flow") == p
                and r.get("security_vs_ttft") is not None]
        out.append(_check(label, "pipelined (checksums + MACs) / TTFT, worst cell", max(vals) if vals else None,
                          "<=", TARGETS["security_vs_ttft"]))
    return out


def _check(label: str, metric: str, value: float | None, op: str, target: float) -> dict[str, Any]:
    ok = None if value is None else (value >= target if op == ">=" else value <= target if op == "<="
                                     else value < target)
    return {"regime": label, "metric": metric, "value": value, "op": op, "target": target, "pass": ok}


def rederive_ideals(result: dict[str, Any]) -> None:
    """Recompute each row's ideal and limit TTFT and measured/ideal, measured/limit from the stored measurements
    (prefill, requests, link rate, rounds, decode step) with the current model, and the target checks; for
    results written by an older version."""
    shape = ModelShape(**result["model_shape"])
    for row in result["rows"]:
        reqs = [r for r in result["requests"] if r["rate_label"] == row["rate_label"] and r["mode"] == row["mode"]
                and r["concurrency"] == row["concurrency"] and r["nominal_tokens"] == row["nominal_tokens"]
                and r.get("flow") == row.get("flow")]
        modes = [r.get("auto_mode") if row["mode"] == AUTO_MODE else row["mode"] for r in reqs]
        known = all(m is not None for m in modes)  # else an auto request whose choice is unknown
        first = ([wire_bytes(m, r["prompt_tokens"], shape, result.get("cache_dtype", "float32"))[0]
                  for m, r in zip(modes, reqs, strict=True)] if known else None)
        floors = ttft_floors(row["ttft_s_median"], row["prefill_s"], first, row["link_gbps"], row["concurrency"],
                             row.get("decode_step_s"), row.get("batches", 1))
        if known and "decode_step_s" not in row:  # written before the limit existed: its ideal only
            floors = {k: floors[k] for k in ("ideal_ttft_s", "ttft_vs_ideal")}
        row.update(floors)
    result["checks"] = evaluate_targets(result["rows"])
