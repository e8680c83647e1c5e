"""Measuring through a running deployment: D's Prometheus counters, one streamed request, P's prefill time,
every (concurrency, mode) cell of one link rate, the row that summarizes a cell, output equality against the
full mode, and whether D really speculates."""

from __future__ import annotations

import hashlib
import itertools
import secrets
import statistics
import sys
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lynx_connector.lab.bench.e2e import choices
from lynx_connector.lab.bench.e2e.plan import ModelShape, Plan, quantile, ttft_floors, wire_bytes
from lynx_connector.logger import init_logger
from lynx_connector.modes import AUTO_MODE, get_mode

logger = init_logger(__name__)

# ---- D's Prometheus counters --------------------------------------------------------------------------------
_COUNTERS = {
    "anchor_bytes": ("vllm:lynx_transfer_bytes_total", 'stream="anchor"'),
    "residual_bytes": ("vllm:lynx_transfer_bytes_total", 'stream="residual"'),
    "lynx_drafted": ("vllm:lynx_speculative_tokens_total", 'outcome="drafted"'),
    "lynx_accepted": ("vllm:lynx_speculative_tokens_total", 'outcome="accepted"'),
    "lynx_early": ("vllm:lynx_speculative_tokens_total", 'outcome="released_on_anchor"'),
    "lynx_stop_low_margin": ("vllm:lynx_speculation_stops_total", 'reason="low_margin"'),
    "lynx_stop_mismatch": ("vllm:lynx_speculation_stops_total", 'reason="first_token_mismatch"'),
    "vllm_drafted": ("vllm:spec_decode_num_draft_tokens_total", ""),
    # the cost of integrity and authentication (issue 14): P's counters are scraped from P (see `security_keys`)
    **{f"sec_{side}_{what}": ("vllm:lynx_security_seconds_total", f'side="{side}",what="{what}"')
       for side in ("p", "d") for what in ("checksum", "mac")},
    "vllm_accepted": ("vllm:spec_decode_num_accepted_tokens_total", ""),
}


def scrape_counters(base_url: str) -> dict[str, float] | None:
    """The counters above from a server's /metrics (missing ones are 0); None when /metrics cannot be read."""
    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=10) as resp:
            text = resp.read().decode("utf-8", "replace")
    except OSError as exc:
        logger.warning("cannot read %s/metrics: %s", base_url, exc)
        return None
    out = dict.fromkeys(_COUNTERS, 0.0)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        for key, (name, label) in _COUNTERS.items():
            if line.startswith(name) and (not label or label in line):
                try:
                    out[key] += float(line.rsplit(" ", 1)[1])
                except ValueError:
                    pass
    return out


def counter_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float]:
    """What the counters moved by; empty when either read failed (not the run's totals, nor negative values)."""
    if before is None or after is None:
        return {}
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in _COUNTERS}


def merge_p_delta(delta: dict[str, float], p_delta: dict[str, float]) -> dict[str, float]:
    """D's counter deltas with P's own security seconds (P's checksums and MACs, scraped from P); empty when D's
    could not be read."""
    return {**delta, **{k: v for k, v in p_delta.items() if k.startswith("sec_p_")}} if delta else {}


# ---- running requests ----------------------------------------------------------------------------------------
def write(line: str = "") -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def fmt(x: float | None, nd: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{nd}f}"


REQUEST_TIMEOUT_S = 300.0  # a silent server fails the request instead of hanging the benchmark


#: The bench's X-Request-Id of each request (the proxy forwards it to P and D: P's log names it).
_RUN_TOKEN = secrets.token_hex(4)
_SEQ = itertools.count()


def next_request_id() -> str:
    return f"lynxbench-{_RUN_TOKEN}-{next(_SEQ):05d}"


def one_request(url: str, model: str, prompt: Any, mode: str, max_tokens: int) -> dict[str, Any]:
    from lynx_connector.lab.client import stream_completion
    from lynx_connector.lab.data import needle_found

    rid = next_request_id()
    res = stream_completion(url, model, prompt.token_ids, max_tokens=max_tokens, timeout=REQUEST_TIMEOUT_S,
                            kv_transfer_params={"lynx_mode": mode}, extra={"ignore_eos": True},
                            headers={"X-Request-Id": rid})
    return {"mode": mode, "request_id": rid, "prompt_tokens": len(prompt.token_ids), "seed": prompt.seed,
            "depth": prompt.depth,
            "ttft_s": res.ttft, "tt32_s": res.time_to_token(32), "tt64_s": res.time_to_token(64),
            "tokens": len(res.token_times), "total_s": res.total_s, "error": res.error,
            "needle_found": (None if prompt.answer is None
                             else res.error is None and needle_found(prompt.answer, res.text)),
            "text_sha1": hashlib.sha1(res.text.encode()).hexdigest()[:12]}


def measure_prefill(p_url: str, model: str, token_ids: list[int], repeats: int = 3) -> float:
    """Median time of a 1-token completion sent to P alone (prefill + one sampling step + HTTP)."""
    from lynx_connector.lab.client import stream_completion

    times = []
    for _ in range(repeats):
        res = stream_completion(p_url, model, token_ids, max_tokens=1)
        if res.error is None and res.ttft is not None:
            times.append(res.ttft)
    if not times:
        raise RuntimeError(f"prefill measurement failed on {p_url}")
    return statistics.median(times)


def measure_prefills(dep: Any, model: str, label: str, prompts: dict[int, list[Any]]) -> dict[int, float]:
    """P's prefill time of the first prompt of every length (printed)."""
    prefill = {n: measure_prefill(dep.prefill.url, model, prompts[n][0].token_ids) for n in sorted(prompts)}
    write(f"  {label}: measured prefill " + ", ".join(f"{n} tok {s:.2f} s" for n, s in prefill.items()))
    return prefill


class Progress:
    def __init__(self, total: int):
        self.total, self.done, self.t0 = total, 0, time.perf_counter()

    def step(self, what: str) -> None:
        self.done += 1
        el = time.perf_counter() - self.t0
        eta = el / self.done * (self.total - self.done)
        write(f"[{self.done}/{self.total} {el:5.0f}s eta {eta:4.0f}s] {what}")


def mode_rounds(modes: list[str], batches: int) -> list[list[str]]:
    """The order of the modes in each of ``batches`` rounds: rotated by one per round, so that no mode always runs
    right after a deployment's warm-up or a switch from the same neighbour (``--batches``)."""
    return [modes[b % len(modes):] + modes[:b % len(modes)] for b in range(batches)] if modes else []


def concurrently(fn: Callable[[Any], Any], items: list[Any], workers: int) -> list[Any]:
    """``fn`` over ``items`` on ``workers`` threads, results in order. Interrupted (Ctrl-C), it does not wait for
    the requests in flight (up to their timeout each): the caller stops the servers, which ends them."""
    pool = ThreadPoolExecutor(max_workers=workers)
    try:
        out = list(pool.map(fn, items))
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    return out


def _run_batch(dep: Any, url: str, model: str, mode: str, batch: list[Any], conc: int,
               plan: Plan) -> dict[str, Any]:
    """One batch of a cell: its requests (one after another at concurrency 1, all at once above) and what D's and
    P's counters, the proxy's flow counts and, for ``auto``, P's choices say about it."""
    before, before_p = scrape_counters(dep.decode.url), scrape_counters(dep.prefill.url)
    flows_before = choices.scrape_flows(url)
    auto_before = choices.scrape_auto_choices(dep.prefill.url) if mode == AUTO_MODE else None
    log_at = choices.log_size(dep.prefill.log_path)
    if conc == 1:
        got = [one_request(url, model, pr, mode, plan.max_tokens) for pr in batch]
    else:
        got = concurrently(lambda pr: one_request(url, model, pr, mode, plan.max_tokens), batch, conc)
    out: dict[str, Any] = {
        "got": got,
        "delta": merge_p_delta(counter_delta(before, scrape_counters(dep.decode.url)),
                               counter_delta(before_p, scrape_counters(dep.prefill.url))),
        "flow_used": choices.flow_delta(flows_before, choices.scrape_flows(url))}
    if mode == AUTO_MODE:
        out["auto_delta"], out["auto_source"] = attribute_auto(
            got, dep.prefill.log_path, log_at, auto_before, choices.scrape_auto_choices(dep.prefill.url))
    return out


def _sum_counts(counts: list[dict[Any, Any] | None]) -> dict[Any, Any] | None:
    """Per-key sums of several rounds' counts; None when any round could not read them."""
    if any(c is None for c in counts):
        return None
    out: dict[Any, Any] = {}
    for c in counts:
        for k, v in c.items():  # type: ignore[union-attr]
            out[k] = out.get(k, 0) + v
    return out


def _merge_batches(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """A cell's batches as one: requests in order, counter deltas and flow counts summed, P's choices summed (None
    when any batch could not read them) with the weakest attribution source of any batch."""
    got = [r for part in parts for r in part["got"]]
    out: dict[str, Any] = {"got": got, "delta": _sum_counts([part["delta"] for part in parts]),
                           "flow_used": _sum_counts([part["flow_used"] for part in parts])}
    if "auto_source" in parts[0]:
        rank = ("p_log", "p_metrics", "unresolved")
        source = max((part["auto_source"] for part in parts), key=rank.index)
        out["auto"] = {**choices.summarize_choices(got, _sum_counts([part["auto_delta"] for part in parts])),
                       "chosen_source": source}
    return out


def run_rate(dep: Any, model: str, label: str, link_gbps: float | None, plan: Plan, prompts: dict[int, list[Any]],
             shape: ModelShape, spec_available: bool, progress: Progress,
             concurrency: list[int] | None = None) -> tuple[list[dict], list[dict], dict]:
    """Every (concurrency, mode) cell on one deployment, ``plan.batches`` rounds each, the modes in a rotated order
    per round (:func:`mode_rounds`); a cell's row summarizes all its rounds. Returns (rows, requests, prefill
    times)."""
    if progress.done == 0:  # the ETA counts request time, not server start-up
        progress.t0 = time.perf_counter()
    prefill = measure_prefills(dep, model, label, prompts)
    rows: list[dict] = []
    requests: list[dict] = []
    urls = getattr(dep, "flow_urls", None) or {plan.flows[-1]: dep.url}
    modes = [m for m in plan.modes if m != "speculative" or spec_available]
    batches = max(1, plan.batches)
    for conc in plan.concurrency if concurrency is None else concurrency:  # [] = none here (--conc-ratios)
        lengths = plan.lengths if conc == 1 else [plan.conc_length]
        parts: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
        for b, order in enumerate(mode_rounds(modes, batches)):
            for mode in order:
                for n in lengths:
                    for flow in plan.flows:  # side by side: the same cell through each flow's proxy
                        batch = prompts[n][: plan.repeats] if conc == 1 else prompts[n][:conc]
                        part = _run_batch(dep, urls[flow], model, mode, batch, conc, plan)
                        dep.raise_if_exited(f"at link {label}, concurrency {conc}, {mode}: no results are written")
                        parts.setdefault((mode, n, flow), []).append(part)
                        ttfts = [r["ttft_s"] for r in part["got"] if r["error"] is None and r["ttft_s"] is not None]
                        progress.step(f"{label} conc {conc} {mode:<11} {n:>5} tok {flow:<10}"
                                      + (f" batch {b + 1}/{batches}" if batches > 1 else "") + ": TTFT "
                                      + fmt(quantile(ttfts, 0.5)) + " s median")
        for mode in modes:
            for n in lengths:
                for flow in plan.flows:
                    cell = _merge_batches(parts[(mode, n, flow)])
                    got = cell["got"]
                    for r in got:
                        r.update(link_gbps=link_gbps, concurrency=conc, rate_label=label, nominal_tokens=n, flow=flow)
                    requests.extend(got)
                    row = summarize_cell(got, mode, n, conc, link_gbps, label, prefill[n], shape, cell["delta"],
                                         plan.cache_dtype, batches)
                    row.update(flow=flow, flow_used=cell["flow_used"], batches=batches)
                    if "auto" in cell:
                        row.update(cell["auto"])
                    rows.append(row)
                    chose = (" chose " + ", ".join(f"{m} {k}" for m, k in row["chosen"].items())
                             if "auto" in cell else "")
                    write(f"  {label} conc {conc} {mode:<11} {n:>5} tok {flow:<10}: TTFT "
                          f"{fmt(row['ttft_s_median'])} s (limit {fmt(row['limit_ttft_s'])} s), TT64T "
                          f"{fmt(row['tt64_s_median'])} s" + (f", {row['errors']} errors" if row["errors"] else "")
                          + chose)
    return rows, requests, prefill


def attribute_auto(got: list[dict], p_log: Path, log_at: int, before: choices.Choices | None,
                   after: choices.Choices | None) -> tuple[dict[tuple[str, str], int] | None, str]:
    """P's choices over one round of an auto cell (its counter's delta, None when unread) and their attribution to
    the round's requests (sets ``auto_mode`` / ``auto_reason``: P's log, checked against the counter): (delta,
    source). :func:`_merge_batches` turns the rounds into the row's ``chosen``, ``chosen_reasons`` and
    ``chosen_source``."""
    delta = choices.choice_delta(before, after)
    logged = choices.parse_choice_log(choices.read_log(p_log, log_at), [r["request_id"] for r in got])
    return delta, choices.attribute(got, logged, delta)


def request_modes(got: list[dict], mode: str) -> list[str | None]:
    """The transfer mode each request of a cell was served in: the cell's, or for ``auto`` the one P chose
    (None: unknown)."""
    return [r.get("auto_mode") if mode == AUTO_MODE else mode for r in got]


def summarize_cell(got: list[dict], mode: str, nominal: int, conc: int, link_gbps: float | None, label: str,
                   prefill_s: float, shape: ModelShape, delta: dict[str, float],
                   cache_dtype: str = "float32", batches: int = 1) -> dict[str, Any]:
    """One cell's row. An ``auto`` cell's bytes, ideal and limit TTFT are those of the mode P chose for each
    request (``auto_mode`` on the requests, :func:`attribute_auto`); unknown when a request's choice is."""
    # a request that ended without a single token (a clean but empty stream) failed too
    ok = [r for r in got if r["error"] is None and r["ttft_s"] is not None]
    modes = request_modes(got, mode)
    known = all(m is not None for m in modes)
    first, total = ((list(x) for x in zip(*(wire_bytes(m, r["prompt_tokens"], shape, cache_dtype)
                                              for m, r in zip(modes, got, strict=True)), strict=True))
                    if known else ([], []))
    row: dict[str, Any] = {"mode": mode, "rate_label": label, "link_gbps": link_gbps, "concurrency": conc,
                           "prompt_tokens": round(statistics.mean(r["prompt_tokens"] for r in got)),
                           "nominal_tokens": nominal, "n": len(got), "errors": len(got) - len(ok),
                           "prefill_s": prefill_s}
    for key in ("ttft_s", "tt32_s", "tt64_s"):
        vals = [r[key] for r in ok if r[key] is not None]
        row[f"{key}_median"] = quantile(vals, 0.5)
        row[f"{key}_p90"] = quantile(vals, 0.9)
    row["wire_bytes"] = round(statistics.mean(total)) if total else None
    measured = delta.get("anchor_bytes", 0.0) + delta.get("residual_bytes", 0.0)
    row["wire_bytes_measured"] = round(measured / len(got)) if measured else None
    row["bits_per_value"] = (8 * row["wire_bytes"] / (2 * shape.layers * shape.kv_heads * shape.head_dim
                                                        * row["prompt_tokens"]) if total else None)
    # the pipelined limit: max(prefill, needed bytes / link) + one decode step (D's, from this cell's own
    # 32nd..64th tokens)
    steps = [(r["tt64_s"] - r["tt32_s"]) / 32 for r in ok if r["tt64_s"] is not None and r["tt32_s"] is not None]
    row["decode_step_s"] = quantile(steps, 0.5)
    row.update(ttft_floors(row["ttft_s_median"], prefill_s, first if known else None, link_gbps, conc,
                           row["decode_step_s"], batches))
    drafted = delta.get("lynx_drafted") or delta.get("vllm_drafted") or 0.0
    accepted = delta.get("lynx_accepted") if delta.get("lynx_drafted") else delta.get("vllm_accepted", 0.0)
    # speculation figures for the cells that speculate: speculative, and auto when P chose speculative for some;
    # unknown (None) when D's counters could not be read
    spec = bool(delta) and any(m is not None and get_mode(m).needs_spec_scheduler for m in modes)
    row["speculated"] = int(drafted) if spec else None
    row["accepted"] = int(accepted or 0) if spec else None
    row["acceptance"] = (accepted / drafted) if spec and drafted else None
    row["first_token_on_anchor"] = int(delta.get("lynx_early", 0)) if spec else None
    row["stopped_low_margin"] = int(delta.get("lynx_stop_low_margin", 0)) if spec else None
    row["first_token_mismatch"] = int(delta.get("lynx_stop_mismatch", 0)) if spec else None
    # issue 14's cost: checksums (P computes, D verifies) and side-channel MACs, P and D, per request; an upper
    # bound of what they add to TTFT (as if all of it were on the critical path)
    sec = sum(v for k, v in delta.items() if k.startswith("sec_"))
    row["security_s"] = sec / len(got) if got and delta else None
    row["security_vs_ttft"] = (row["security_s"] / row["ttft_s_median"]
                               if row["security_s"] is not None and row["ttft_s_median"] else None)
    found = [r["needle_found"] for r in got if r.get("needle_found") is not None]
    row["needle_accuracy"] = sum(found) / len(found) if found else None
    return row


def mark_output_equality(requests: list[dict]) -> None:
    """``output_equal_full`` on each request: its text equals the full mode's for the same prompt and cell."""
    def key(r: dict) -> tuple:
        return r["rate_label"], r["concurrency"], r["seed"], r["prompt_tokens"], r.get("flow")

    full = {key(r): r["text_sha1"] for r in requests if r["mode"] == "full" and r["error"] is None}
    for r in requests:
        ref = full.get(key(r))
        # a failed request is not an output equal to full's (it counts against the share, not out of it)
        r["output_equal_full"] = None if ref is None else (False if r["error"] else r["text_sha1"] == ref)


def equality_by_row(rows: list[dict], requests: list[dict]) -> None:
    for row in rows:
        eq = [r["output_equal_full"] for r in requests
              if r["rate_label"] == row["rate_label"] and r["concurrency"] == row["concurrency"]
              and r["mode"] == row["mode"] and r["nominal_tokens"] == row["nominal_tokens"]
              and r.get("flow") == row.get("flow") and r["output_equal_full"] is not None]
        row["output_equal_full"] = (sum(eq) / len(eq)) if eq else None


# ---- speculative availability ---------------------------------------------------------------------------------
def detect_speculative(dep: Any, model: str, prompt: Any, log_path: Path) -> tuple[bool, str]:
    """Is D configured to hold and verify anchor-phase tokens? The mode alone proves nothing: without the Lynx
    scheduler a speculative request silently decodes on the anchor. Evidence: D's counters of speculated tokens
    move during a speculative request, or D's log names the Lynx speculative scheduler."""
    import importlib.util

    if importlib.util.find_spec("lynx_connector.speculative") is None:
        return False, "lynx_connector.speculative is not part of this checkout"
    before = scrape_counters(dep.decode.url)
    res = one_request(dep.url, model, prompt, "speculative", 16)
    delta = counter_delta(before, scrape_counters(dep.decode.url))
    if res["error"]:
        return False, f"a speculative request failed: {res['error'][:200]}"
    if delta.get("lynx_drafted", 0) > 0 or delta.get("vllm_drafted", 0) > 0:
        return True, "D counted speculated tokens"
    try:
        log = log_path.read_text(errors="replace")
    except OSError:
        log = ""
    if "lynx_connector.speculative" in log:
        return True, "D runs the Lynx speculative scheduler (from its log)"
    return False, "D is not configured for speculative decoding (no speculated tokens, no Lynx scheduler in its log)"
