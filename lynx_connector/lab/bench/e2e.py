"""``lynx bench e2e``: real 1P1D serving (P, D and the proxy as ``lynx serve`` processes, the real model, real
essays), every transfer mode on one P/D pair (each request names its mode), the P->D link paced by D.

1. A calibration deployment with an unpaced link measures the prefill time of the reference prompt on P (a
   request sent to P alone); ``--unpaced-runs`` also runs every mode there.
2. Link rates are chosen so that a 16-bit BF16 transfer of the reference prompt (the paper's BF16) takes
   ``--ratios`` (0.5, 2, 10) times that prefill: the compute-dominated, balanced and transfer-dominated
   regimes. Each rate is a restart of D (the rate is start-up configuration of D's transport).
3. Per rate: concurrency 1 (repeated prompts) and, at ``--conc-ratios`` (default: the balanced regime),
   concurrency 4 (4 different prompts at once, so the anchor-first priority across requests is exercised),
   every mode, 64 greedy tokens. Task ``summary`` (default): "write a detailed summary" of essay text, whose
   natural answers run past 64 tokens (EOS is still ignored so every request yields 64); ``needle``: needle
   questions, whose ~15-token answers are followed by EOS-ignored filler (speculation acceptance there
   measures the filler). Client-side times (through the proxy): TTFT, TT32T, TT64T; D's Prometheus counters
   give the bytes that crossed the link and the speculated/accepted tokens.
4. Per row the ideal TTFT = measured prefill + bytes needed before the first released token / link rate
   (requests of a concurrent batch prefilled one after another on P, the link serving them in order), and
   measured/ideal, so every overhead is visible.

"bf16" is the passthrough of the cache dtype: the CPU servers keep an fp32 cache, so it moves 32 bits/value,
twice the 16-bit BF16 bytes that define the regimes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lynx_connector.lab.bench import common
from lynx_connector.logger import init_logger

logger = init_logger(__name__)

MODES = ("bf16", "fp8", "int8", "int4", "anchor", "full", "speculative")
TWO_STREAM = ("anchor", "full", "speculative")
DEFAULT_RATIOS = (0.5, 2.0, 10.0)
DEFAULT_LENGTHS = (1024,)
DEFAULT_REPEATS = 2
DEFAULT_CONC_LENGTH = 1024
#: Concurrency > 1 runs at these ratios by default (the balanced regime: at 10x a batch of 4 fp32
#: passthrough transfers alone would take ~5 minutes and the default run must stay under 30).
DEFAULT_CONC_RATIOS = (2.0,)
QUICK_LENGTH = 512
#: The regimes are defined by the bytes of a 16-bit BF16 transfer (the paper's BF16), whatever the cache
#: dtype: on CPU the cache is fp32, so the "bf16" mode (passthrough) moves twice those bytes.
REF_BYTES_PER_VALUE = 2
QUICK_LINK_GBPS = 0.25
MAX_MODEL_LEN = 4096
TARGETS = {
    "spec_ttft_vs_int8": 1.43,  # int8 TTFT / speculative TTFT in the transfer-dominated regime
    "spec_ttft_vs_int4": 1.15,  # speculative TTFT / int4 TTFT at most
    "compute_regime_lynx_vs_int8": 1.05,  # lynx (full, speculative) TTFT / int8 TTFT at most at ratio 0.5
    "spec_ttft_vs_full": 1.43,  # full TTFT / speculative TTFT in the transfer-dominated regime (issue 5)
    "spec_acceptance": 0.85,  # accepted / speculated tokens there (issue 5)
}


@dataclass(frozen=True)
class ModelShape:
    layers: int
    kv_heads: int
    head_dim: int


def model_shape(model: str) -> ModelShape:
    """Layers, KV heads and head size of ``model`` (a local folder or a cached Hugging Face name)."""
    local = Path(model) / "config.json"
    if local.exists():
        cfg = json.loads(local.read_text())
    else:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(model).to_dict()
    cfg = cfg.get("text_config", cfg)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return ModelShape(cfg["num_hidden_layers"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
                      head_dim)


CACHE_DTYPES = ("float32", "bfloat16", "float16")


def wire_bytes(mode: str, num_tokens: int, shape: ModelShape, cache_dtype: str = "float32") -> tuple[int, int]:
    """``(bytes needed before the first client-visible token, bytes on the wire)`` for one request.

    anchor: the residual is never pulled. speculative (greedy): the first token is P's, released when D's
    first token on the anchor agrees with it, so it needs the anchor plane only; the later ones wait for the
    residual (verification)."""
    import torch

    from lynx_connector.codec import get_codec

    codec = get_codec("lynx" if mode in TWO_STREAM else mode)
    a, r = codec.plane_nbytes(num_tokens, shape.kv_heads, shape.head_dim, getattr(torch, cache_dtype))
    a, r = a * shape.layers, r * shape.layers
    if mode == "anchor":
        return a, a
    if mode == "speculative":
        return a, a + r
    return a + r, a + r


def quantile(values: list[float], q: float) -> float | None:
    """Linear-interpolated quantile (q in [0, 1]); None for no values."""
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    pos = q * (len(vals) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def ideal_ttfts(prefill_s: float, first_bytes: list[int], link_gbps: float | None) -> list[float]:
    """Ideal TTFT of each request of a batch sent at once: P prefills them one after another, the link carries
    each request's needed bytes in order as soon as its prefill is done (unpaced link: transfer time 0)."""
    out = []
    link_free = 0.0
    for k, nbytes in enumerate(first_bytes):
        ready = (k + 1) * prefill_s
        xfer = 0.0 if not link_gbps else nbytes * 8 / (link_gbps * 1e9)
        done = max(ready, link_free) + xfer
        link_free = done
        out.append(done)
    return out


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
    "vllm_accepted": ("vllm:spec_decode_num_accepted_tokens_total", ""),
}


def scrape_counters(base_url: str) -> dict[str, float]:
    """The counters above from a server's /metrics (missing ones are 0)."""
    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=10) as resp:
            text = resp.read().decode("utf-8", "replace")
    except OSError as exc:
        logger.warning("cannot read %s/metrics: %s", base_url, exc)
        return {}
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


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in _COUNTERS}


# ---- running requests ----------------------------------------------------------------------------------------
def _write(line: str = "") -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


REQUEST_TIMEOUT_S = 300.0  # a silent server fails the request instead of hanging the benchmark


def _one_request(url: str, model: str, prompt: Any, mode: str, max_tokens: int) -> dict[str, Any]:
    from lynx_connector.lab.client import stream_completion
    from lynx_connector.lab.data import needle_found

    res = stream_completion(url, model, prompt.token_ids, max_tokens=max_tokens, timeout=REQUEST_TIMEOUT_S,
                            kv_transfer_params={"lynx_mode": mode}, extra={"ignore_eos": True})
    return {"mode": mode, "prompt_tokens": len(prompt.token_ids), "seed": prompt.seed, "depth": prompt.depth,
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


@dataclass
class Plan:
    modes: list[str]
    lengths: list[int]
    repeats: int
    concurrency: list[int]
    conc_length: int
    max_tokens: int
    cache_dtype: str = "float32"
    max_model_len: int = MAX_MODEL_LEN
    serve_args: tuple[str, ...] = ()
    p_cpus: str | None = None
    d_cpus: str | None = None
    #: D's speculative_min_margin (None: the connector's default).
    spec_min_margin: float | None = None


class Progress:
    def __init__(self, total: int):
        self.total, self.done, self.t0 = total, 0, time.perf_counter()

    def step(self, what: str) -> None:
        self.done += 1
        el = time.perf_counter() - self.t0
        eta = el / self.done * (self.total - self.done)
        _write(f"[{self.done}/{self.total} {el:5.0f}s eta {eta:4.0f}s] {what}")


def run_rate(dep: Any, model: str, label: str, link_gbps: float | None, plan: Plan, prompts: dict[int, list[Any]],
             shape: ModelShape, spec_available: bool, progress: Progress,
             concurrency: list[int] | None = None) -> tuple[list[dict], list[dict], dict]:
    """Every (concurrency, mode) cell on one deployment. Returns (rows, requests, prefill times)."""
    if progress.done == 0:  # the ETA counts request time, not server start-up
        progress.t0 = time.perf_counter()
    prefill = {n: measure_prefill(dep.prefill.url, model, prompts[n][0].token_ids) for n in sorted(prompts)}
    _write(f"  {label}: measured prefill " + ", ".join(f"{n} tok {s:.2f} s" for n, s in prefill.items()))
    rows: list[dict] = []
    requests: list[dict] = []
    for conc in concurrency or plan.concurrency:
        for mode in plan.modes:
            if mode == "speculative" and not spec_available:
                continue
            lengths = plan.lengths if conc == 1 else [plan.conc_length]
            for n in lengths:
                before = scrape_counters(dep.decode.url)
                got: list[dict] = []
                if conc == 1:
                    for pr in prompts[n][: plan.repeats]:
                        got.append(_one_request(dep.url, model, pr, mode, plan.max_tokens))
                else:
                    batch = prompts[n][:conc]
                    with ThreadPoolExecutor(max_workers=conc) as pool:
                        got = list(pool.map(lambda pr, m=mode: _one_request(dep.url, model, pr, m,
                                                                              plan.max_tokens), batch))
                delta = counter_delta(before, scrape_counters(dep.decode.url))
                for r in got:
                    r.update(link_gbps=link_gbps, concurrency=conc, rate_label=label, nominal_tokens=n)
                requests.extend(got)
                row = summarize_cell(got, mode, n, conc, link_gbps, label, prefill[n], shape, delta, plan.cache_dtype)
                rows.append(row)
                progress.step(f"{label} conc {conc} {mode:<11} {n:>5} tok: TTFT {_f(row['ttft_s_median'])} s, "
                              f"TT64T {_f(row['tt64_s_median'])} s, ideal {_f(row['ideal_ttft_s'])} s"
                              + (f", {row['errors']} errors" if row["errors"] else ""))
    return rows, requests, prefill


def _f(x: float | None, nd: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{nd}f}"


def summarize_cell(got: list[dict], mode: str, nominal: int, conc: int, link_gbps: float | None, label: str,
                   prefill_s: float, shape: ModelShape, delta: dict[str, float],
                   cache_dtype: str = "float32") -> dict[str, Any]:
    ok = [r for r in got if r["error"] is None]
    first, total = zip(*(wire_bytes(mode, r["prompt_tokens"], shape, cache_dtype) for r in got), strict=True)
    if conc == 1:  # one request at a time: each on its own
        ideals = [ideal_ttfts(prefill_s, [b], link_gbps)[0] for b in first]
    else:
        ideals = ideal_ttfts(prefill_s, list(first), link_gbps)
    row: dict[str, Any] = {"mode": mode, "rate_label": label, "link_gbps": link_gbps, "concurrency": conc,
                           "prompt_tokens": round(statistics.mean(r["prompt_tokens"] for r in got)),
                           "nominal_tokens": nominal, "n": len(got), "errors": len(got) - len(ok),
                           "prefill_s": prefill_s}
    for key in ("ttft_s", "tt32_s", "tt64_s"):
        vals = [r[key] for r in ok if r[key] is not None]
        row[f"{key}_median"] = quantile(vals, 0.5)
        row[f"{key}_p90"] = quantile(vals, 0.9)
    row["wire_bytes"] = round(statistics.mean(total))
    measured = delta.get("anchor_bytes", 0.0) + delta.get("residual_bytes", 0.0)
    row["wire_bytes_measured"] = round(measured / len(got)) if measured else None
    row["bits_per_value"] = 8 * row["wire_bytes"] / (2 * shape.layers * shape.kv_heads * shape.head_dim
                                                       * row["prompt_tokens"])
    row["ideal_ttft_s"] = quantile(ideals, 0.5)
    row["ttft_vs_ideal"] = (row["ttft_s_median"] / row["ideal_ttft_s"]
                            if row["ttft_s_median"] and row["ideal_ttft_s"] else None)
    drafted = delta.get("lynx_drafted") or delta.get("vllm_drafted") or 0.0
    accepted = delta.get("lynx_accepted") if delta.get("lynx_drafted") else delta.get("vllm_accepted", 0.0)
    row["speculated"] = int(drafted) if mode == "speculative" else None
    row["accepted"] = int(accepted or 0) if mode == "speculative" else None
    row["acceptance"] = (accepted / drafted) if mode == "speculative" and drafted else None
    row["first_token_on_anchor"] = int(delta.get("lynx_early", 0)) if mode == "speculative" else None
    row["stopped_low_margin"] = int(delta.get("lynx_stop_low_margin", 0)) if mode == "speculative" else None
    row["first_token_mismatch"] = int(delta.get("lynx_stop_mismatch", 0)) if mode == "speculative" else None
    found = [r["needle_found"] for r in got if r.get("needle_found") is not None]
    row["needle_accuracy"] = sum(found) / len(found) if found else None
    return row


def rederive_ideals(result: dict[str, Any]) -> None:
    """Recompute each row's ideal TTFT and measured/ideal from the stored measurements (prefill, requests,
    link rate) with the current model, and the target checks; for results written by an older version."""
    shape = ModelShape(**result["model_shape"])
    for row in result["rows"]:
        reqs = [r for r in result["requests"] if r["rate_label"] == row["rate_label"] and r["mode"] == row["mode"]
                and r["concurrency"] == row["concurrency"] and r["nominal_tokens"] == row["nominal_tokens"]]
        first = [wire_bytes(row["mode"], r["prompt_tokens"], shape, result.get("cache_dtype", "float32"))[0]
                 for r in reqs]
        if row["concurrency"] == 1:
            ideals = [ideal_ttfts(row["prefill_s"], [b], row["link_gbps"])[0] for b in first]
        else:
            ideals = ideal_ttfts(row["prefill_s"], first, row["link_gbps"])
        row["ideal_ttft_s"] = quantile(ideals, 0.5)
        row["ttft_vs_ideal"] = (row["ttft_s_median"] / row["ideal_ttft_s"]
                                if row["ttft_s_median"] and row["ideal_ttft_s"] else None)
    result["checks"] = evaluate_targets(result["rows"], result["config"]["ratios"])


def mark_output_equality(requests: list[dict]) -> None:
    """``output_equal_full`` on each request: its text equals the full mode's for the same prompt and cell."""
    full = {(r["rate_label"], r["concurrency"], r["seed"], r["prompt_tokens"]): r["text_sha1"]
            for r in requests if r["mode"] == "full" and r["error"] is None}
    for r in requests:
        ref = full.get((r["rate_label"], r["concurrency"], r["seed"], r["prompt_tokens"]))
        r["output_equal_full"] = None if ref is None or r["error"] else r["text_sha1"] == ref


def equality_by_row(rows: list[dict], requests: list[dict]) -> None:
    for row in rows:
        eq = [r["output_equal_full"] for r in requests
              if r["rate_label"] == row["rate_label"] and r["concurrency"] == row["concurrency"]
              and r["mode"] == row["mode"] and r["nominal_tokens"] == row["nominal_tokens"]
              and r["output_equal_full"] is not None]
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
    res = _one_request(dep.url, model, prompt, "speculative", 16)
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


# ---- deployment: P and proxy once, D restarted per link rate ------------------------------------------------
def speculative_serve_args() -> tuple[list[str], str]:
    """D's extra ``lynx serve`` arguments for the speculative mode (scheduler + null proposer), when the
    checkout has ``lynx_connector.speculative``."""
    try:
        from lynx_connector.speculative.proposer import NULL_PROPOSER
        from lynx_connector.speculative.scheduler import SPEC_SCHEDULER
    except ImportError as exc:
        return [], f"lynx_connector.speculative is not usable here ({exc})"
    k = 64
    return (["--scheduler-cls", SPEC_SCHEDULER, "--speculative-config",
             json.dumps({"method": "custom_class", "model": NULL_PROPOSER, "num_speculative_tokens": k})],
            f"D runs {SPEC_SCHEDULER} with {k} verification slots")


def start_deployment(model: str, log_dir: Path, gbps: float | None, spec_args: list[str], plan: Plan) -> Any:
    """P + D + proxy (D with ``spec_args``); when D cannot start with them, once more without (noted)."""
    from lynx_connector.lab.launch import Deployment

    dep = Deployment(model, log_dir / "rate0", kv_transfer_config=kv_config(gbps, plan.spec_min_margin), max_model_len=plan.max_model_len,
                     extra_serve_args=list(plan.serve_args))
    dep.decode.argv = dep.decode.argv + spec_args
    pin(dep, plan)
    dep.spec_failed = None
    _write(f"== starting P, D and proxy (link {'unpaced' if gbps is None else f'{gbps:g} Gbit/s'}); "
           "a minute or more on a busy 2-core machine")
    t0 = time.perf_counter()
    try:
        dep.__enter__()
    except (RuntimeError, TimeoutError) as exc:
        if not spec_args:
            raise
        tail = dep.decode.log_tail(15)
        logger.warning("D did not start with the speculative scheduler (%s); retrying without it", exc)
        dep = Deployment(model, log_dir / "rate0-nospec", kv_transfer_config=kv_config(gbps, plan.spec_min_margin),
                         max_model_len=plan.max_model_len, extra_serve_args=list(plan.serve_args))
        dep.spec_failed = f"D failed to start with the speculative scheduler: {tail[-300:]}"
        pin(dep, plan)
        dep.__enter__()
    dep.startup_s = time.perf_counter() - t0
    _write(f"  ready after {dep.startup_s:.0f} s")
    return dep


def pin(dep: Any, plan: Plan) -> None:
    """Disjoint cores for P and D (the CPU backend's OpenMP binding), as on separate machines: without it
    both servers bind their threads to every core and starve each other's transfer threads."""
    if plan.p_cpus:
        dep.prefill.env["VLLM_CPU_OMP_THREADS_BIND"] = plan.p_cpus
    if plan.d_cpus:
        dep.decode.env["VLLM_CPU_OMP_THREADS_BIND"] = plan.d_cpus


def restart_decode(dep: Any, model: str, gbps: float | None, spec_args: list[str], log_path: Path, plan: Plan,
                   timeout: float = 600.0) -> None:
    """Stop D and start it again on the same port with a new link rate (P and the proxy keep running)."""
    from lynx_connector.lab.launch import serve_argv

    d = dep.decode
    d.stop()
    d.argv = serve_argv(model, d.port, kv_config(gbps, plan.spec_min_margin), max_model_len=plan.max_model_len,
                        extra=list(plan.serve_args)) + spec_args
    d.log_path = log_path
    d.start()
    deadline = time.monotonic() + timeout
    while not d.healthy():
        if d.proc is not None and d.proc.poll() is not None:
            raise RuntimeError(f"decode server exited during restart; log {log_path}:\n{d.log_tail()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"decode server not healthy after {timeout:.0f} s; log {log_path}")
        time.sleep(1.0)


# ---- the benchmark ---------------------------------------------------------------------------------------------
TASKS = ("summary", "needle")


def build_prompts(tok: Any, lengths: list[int], count: int, task: str = "summary") -> dict[int, list[Any]]:
    from lynx_connector.lab.data import build_needle_prompt, build_summary_prompt

    if task == "summary":  # a different essay per prompt
        return {n: [build_summary_prompt(tok, n, seed=7 * i + n // 1024) for i in range(count)] for n in lengths}
    depths = (0.2, 0.5, 0.8, 0.35, 0.65, 0.1, 0.9, 0.45)
    return {n: [build_needle_prompt(tok, n, depth=depths[i % len(depths)], seed=1000 + 17 * n + i)
                for i in range(count)] for n in lengths}


def kv_config(link_gbps: float | None, spec_min_margin: float | None = None) -> str:
    extra: dict[str, Any] = {"mode": "full", "link_gbps": link_gbps}
    if spec_min_margin is not None:
        extra["speculative_min_margin"] = spec_min_margin
    return json.dumps({"kv_connector": "lynx", "kv_connector_extra_config": extra})


def ref_bf16_bytes(num_tokens: int, shape: ModelShape) -> int:
    """Bytes of a 16-bit BF16 transfer of ``num_tokens`` tokens (K and V, every layer): what defines a regime."""
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * REF_BYTES_PER_VALUE * num_tokens


def choose_rates(prefill_s: float, ref_tokens: int, shape: ModelShape, ratios: list[float]) -> list[float]:
    """Link rates (Gbit/s) at which a 16-bit BF16 transfer of ``ref_tokens`` takes ``ratio x prefill_s``."""
    return [float(f"{ref_bf16_bytes(ref_tokens, shape) * 8 / (ratio * prefill_s) / 1e9:.4g}") for ratio in ratios]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from lynx_connector.lab.models import prepare

    t_start = time.perf_counter()
    env = common.environment_info()  # at the start: the code (git revision) and versions that ran
    quick = bool(args.quick)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise SystemExit(f"unknown modes {unknown}; choose from {', '.join(MODES)}")
    lengths = _ints(args.lengths) or ([QUICK_LENGTH] if quick else list(DEFAULT_LENGTHS))
    conc = _ints(args.concurrency) or ([1, 2] if quick else [1, 4])
    conc_length = args.conc_length or (QUICK_LENGTH if quick else DEFAULT_CONC_LENGTH)
    repeats = args.repeats or (1 if quick else DEFAULT_REPEATS)
    ratios = [float(x) for x in args.ratios.split(",")] if args.ratios else list(DEFAULT_RATIOS)
    max_len = args.max_model_len or MAX_MODEL_LEN
    if max(lengths + [conc_length]) + 128 + args.max_tokens > max_len:
        raise SystemExit(f"prompts plus {args.max_tokens} tokens must fit max_model_len {max_len}")
    ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    p_cpus = args.p_cpus if args.p_cpus is not None else ("0" if ncpu >= 2 else None)
    d_cpus = args.d_cpus if args.d_cpus is not None else ("1" if ncpu >= 2 else None)
    plan = Plan(modes, lengths, repeats, conc, conc_length, args.max_tokens, args.cache_dtype, max_len,
                tuple(shlex.split(args.serve_args or "")), p_cpus or None, d_cpus or None, args.spec_min_margin)
    model = args.model or str(prepare())
    shape = model_shape(model)
    tok = AutoTokenizer.from_pretrained(model)
    all_lengths = sorted(set(lengths + ([conc_length] if max(conc) > 1 else [])))
    prompts = build_prompts(tok, all_lengths, max(repeats, max(conc)), args.task)
    warm_prompt = build_prompts(tok, [128], 1, args.task)[128][0]  # short: cheap on the slowest link
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="lynx-bench-e2e-"))
    ref_tokens = args.ref_tokens or conc_length
    explicit = [float(x) for x in args.link_gbps.split(",")] if args.link_gbps else None
    # Deployments: quick = one at a fixed rate; full = unpaced calibration, then one per chosen rate.
    if explicit:
        schedule: list[tuple[str, float | None, float | None]] = [(f"{g:g} Gbps", g, None) for g in explicit]
    elif quick:
        schedule = [(f"{QUICK_LINK_GBPS:g} Gbps", QUICK_LINK_GBPS, None)]
    else:
        schedule = [("unpaced", None, None)]
    conc_ratios = (list(DEFAULT_CONC_RATIOS) if args.conc_ratios is None else None if args.conc_ratios == "all"
                   else [float(x) for x in args.conc_ratios.split(",")])
    cells_c1 = len(lengths) * len(modes) if 1 in conc else 0
    cells_cn = sum(1 for c in conc if c > 1) * len(modes)
    n_first = len(schedule) if explicit or quick or args.unpaced_runs else 0
    n_paced = 0 if explicit or quick else len(ratios)
    n_paced_conc = n_paced if conc_ratios is None or not n_paced else sum(1 for r in ratios if r in conc_ratios)
    progress = Progress((cells_c1 + cells_cn) * n_first + cells_c1 * n_paced + cells_cn * n_paced_conc)
    _write(f"lynx bench e2e: {Path(model).name} fp32 on CPU; modes {', '.join(modes)}; prompts {lengths} tokens "
           f"x {repeats} at concurrency 1, {conc_length} tokens at concurrency {[c for c in conc if c > 1]}; "
           f"{args.max_tokens} tokens each; logs in {log_dir}")
    rows: list[dict] = []
    requests: list[dict] = []
    deployments: list[dict] = []
    spec_args, spec_note = speculative_serve_args() if "speculative" in modes else ([], "not requested")
    spec_available = False
    calib_prefill: float | None = None
    # One deployment: P and the proxy stay up; D (the side that paces the link) restarts for each rate.
    dep = start_deployment(model, log_dir, schedule[0][1], spec_args, plan)
    if dep.spec_failed:
        spec_note, spec_args = dep.spec_failed, []
    try:
        i = 0
        while i < len(schedule):
            label, gbps, ratio = schedule[i]
            t_dep = time.perf_counter()
            if i > 0:
                _write(f"== link {label}: restarting D")
                restart_decode(dep, model, gbps, spec_args, log_dir / f"decode{i}.log", plan)
            startup = time.perf_counter() - t_dep if i > 0 else dep.startup_s
            # First requests pay one-time costs (allocation, NIXL handshake, each codec's first call on P and D).
            for m in dict.fromkeys(["full", *modes]):
                w = _one_request(dep.url, model, warm_prompt, m, 4)
                if w["error"] or w["tokens"] == 0:
                    raise RuntimeError(f"warm-up request ({m}) failed on link {label}: {w['error']}; D's log "
                                       f"{dep.decode.log_path}:\n{dep.decode.log_tail(8)}")
            if i == 0 and "speculative" in modes:
                if spec_args:
                    spec_available, spec_note = detect_speculative(dep, model, prompts[all_lengths[0]][0],
                                                                   dep.decode.log_path)
                _write(f"  speculative mode: {'available' if spec_available else 'NOT AVAILABLE'} ({spec_note})")
                if not spec_available:
                    progress.total -= (len(lengths) if 1 in conc else 0) * (n_first + n_paced) + sum(
                        1 for c in conc if c > 1) * (n_first + n_paced_conc)
            do_runs = gbps is not None or quick or explicit or args.unpaced_runs
            if do_runs:
                levels = [c for c in conc if c == 1 or conc_ratios is None or ratio is None or ratio in conc_ratios]
                got_rows, got_reqs, prefill = run_rate(dep, model, label, gbps, plan, prompts, shape,
                                                       spec_available, progress, levels)
            else:
                got_rows, got_reqs = [], []
                prefill = {n: measure_prefill(dep.prefill.url, model, prompts[n][0].token_ids)
                           for n in sorted(prompts)}
                _write(f"  {label}: measured prefill " + ", ".join(f"{n} tok {s:.2f} s" for n, s in prefill.items()))
            ref_n = min(prefill, key=lambda k: abs(k - ref_tokens))
            ref_len = len(prompts[ref_n][0].token_ids)
            secs = 8 / (gbps * 1e9) if gbps else 0.0  # on the link, per byte
            bf16_xfer = ref_bf16_bytes(ref_len, shape) * secs
            passthrough_xfer = wire_bytes("bf16", ref_len, shape, plan.cache_dtype)[1] * secs
            for r in got_rows:
                r["target_ratio"] = ratio
            rows += got_rows
            requests += got_reqs
            deployments.append({"label": label, "link_gbps": gbps, "startup_s": startup, "prefill_s": prefill,
                                "target_ratio": ratio, "ref_tokens": ref_n,
                                "bf16_transfer_over_prefill": bf16_xfer / prefill[ref_n],
                                "passthrough_transfer_over_prefill": passthrough_xfer / prefill[ref_n],
                                "decode_log": str(dep.decode.log_path), "loadavg": common.loadavg()})
            if i == 0 and not explicit and not quick:
                calib_prefill = prefill[ref_n]
                rates = choose_rates(calib_prefill, ref_len, shape, ratios)
                schedule += [(f"{g:g} Gbps (BF16 {r:g}x prefill)", g, r) for g, r in zip(rates, ratios, strict=True)]
                _write("  chosen link rates: " + ", ".join(f"{g:g} Gbit/s (16-bit BF16 transfer {r:g}x the "
                       f"{calib_prefill:.2f} s prefill of {ref_n} tokens)" for g, r in zip(rates, ratios,
                                                                                            strict=True)))
            i += 1
    finally:
        dep.stop()
    mark_output_equality(requests)
    equality_by_row(rows, requests)
    result: dict[str, Any] = {
        "bench": "e2e", "quick": quick, "model": Path(model).name, "model_shape": shape.__dict__,
        "cache_dtype": plan.cache_dtype,
        "bf16_note": f"bf16 mode = passthrough of the cache dtype ({plan.cache_dtype}: "
                     f"{8 * (4 if plan.cache_dtype == 'float32' else 2)} bits/value)",
        "config": {"modes": modes, "lengths": lengths, "repeats": repeats, "concurrency": conc,
                   "conc_length": conc_length, "max_tokens": args.max_tokens, "ratios": ratios,
                   "ref_tokens": ref_tokens, "explicit_link_gbps": explicit, "conc_ratios": conc_ratios,
                   "task": args.task, "ignore_eos": True,
                   "temperature": 0.0, "max_model_len": max_len, "serve_args": list(plan.serve_args),
                   "spec_min_margin": plan.spec_min_margin,
                   "p_cpus": plan.p_cpus, "d_cpus": plan.d_cpus},
        "speculative": {"available": spec_available, "note": spec_note},
        "calibration_prefill_s": calib_prefill,
        "deployments": deployments, "rows": rows, "requests": requests,
        "ideal_model": "ideal TTFT = measured prefill on P (requests of a batch one after another) + bytes needed "
                       "before the first released token / link rate, the link serving requests in order",
        "targets": TARGETS,
    }
    result["checks"] = evaluate_targets(rows, ratios)
    result["wall_s"] = time.perf_counter() - t_start
    common.record_environment(result, env)
    from lynx_connector.lab.bench import report

    sys.stdout.write("\n" + report.e2e_markdown(result))
    if args.out:
        common.write_json(args.out, result)
        report.write_outputs(args.out, result)
        logger.info("wrote %s", args.out)
    return result


def _prefill_at(prefill: dict[int, float], ref_tokens: int, prompts: dict[int, list[Any]]) -> float:
    if ref_tokens in prefill:
        return prefill[ref_tokens]
    # scale the closest measured length linearly
    n = min(prefill, key=lambda k: abs(k - ref_tokens))
    return prefill[n] * ref_tokens / n


def _ints(text: str | None) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()] if text else []


def evaluate_targets(rows: list[dict], ratios: list[float]) -> list[dict[str, Any]]:
    """The issue's latency targets, judged on concurrency-1 medians pooled per rate (None = not measurable)."""
    checks: list[dict[str, Any]] = []

    def cells(label: str, mode: str, any_concurrency: bool = False) -> list[dict]:
        return [r for r in rows if r["rate_label"] == label and r["mode"] == mode
                and (any_concurrency or r["concurrency"] == 1)]

    def med(label: str, mode: str, key: str) -> float | None:
        vals = [r[key] for r in cells(label, mode) if r[key] is not None]
        return statistics.median(vals) if vals else None

    def pooled(label: str, key: str) -> int:
        return sum(r[key] or 0 for r in cells(label, "speculative"))

    hi = list(dict.fromkeys(r["rate_label"] for r in rows if ratios and r.get("target_ratio") == max(ratios)))
    lo = list(dict.fromkeys(r["rate_label"] for r in rows if ratios and r.get("target_ratio") == min(ratios)))

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
        eq = [r["output_equal_full"] for r in cells(label, "speculative", any_concurrency=True)
              if r.get("output_equal_full") is not None]
        checks.append(_check(label, "speculative outputs equal to full (share)", min(eq) if eq else None,
                             ">=", 1.0))
    for label in lo:
        i8 = med(label, "int8", "ttft_s_median")
        for m in ("full", "speculative"):
            v = med(label, m, "ttft_s_median")
            checks.append(_check(label, f"{m} TTFT / int8 TTFT", v / i8 if v and i8 else None, "<=",
                                 TARGETS["compute_regime_lynx_vs_int8"]))
    return checks


def _check(label: str, metric: str, value: float | None, op: str, target: float) -> dict[str, Any]:
    ok = None if value is None else (value >= target if op == ">=" else value <= target if op == "<="
                                     else value < target)
    return {"regime": label, "metric": metric, "value": value, "op": op, "target": target, "pass": ok}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("e2e", help="real 1P1D latency per transfer mode over paced links",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="CI size: one deployment at a fixed rate, "
                   f"{QUICK_LENGTH}-token prompts, concurrency 1 and 2 (< 3 minutes)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated modes")
    p.add_argument("--lengths", default=None, help=f"concurrency-1 prompt lengths (default {DEFAULT_LENGTHS})")
    p.add_argument("--repeats", type=int, default=None, help="requests per mode and length at concurrency 1 "
                   f"(default {DEFAULT_REPEATS})")
    p.add_argument("--concurrency", default=None, help="comma-separated concurrency levels (default 1,4)")
    p.add_argument("--conc-length", type=int, default=None, help="prompt length of the concurrent batches")
    p.add_argument("--conc-ratios", default=None, help="run concurrency > 1 only at these ratios (default "
                   f"{','.join(f'{r:g}' for r in DEFAULT_CONC_RATIOS)}; 'all' = at every rate)")
    p.add_argument("--ratios", default=None, help="16-bit BF16 transfer / prefill ratios that choose the link rates "
                   f"(default {','.join(f'{r:g}' for r in DEFAULT_RATIOS)})")
    p.add_argument("--ref-tokens", type=int, default=None, help="prompt length the ratios refer to")
    p.add_argument("--link-gbps", default=None, help="explicit comma-separated link rates (skips calibration)")
    p.add_argument("--unpaced-runs", action="store_true", help="also run every mode on the unpaced link "
                   "(the calibration deployment; by default it only measures the prefill)")
    p.add_argument("--max-tokens", type=int, default=64, help="generated tokens per request (EOS ignored)")
    p.add_argument("--task", default="summary", choices=TASKS, help="prompts: detailed summaries of essays "
                   "(long natural answers, default) or needle questions (short answers)")
    p.add_argument("--log-dir", default=None, help="server logs (default: a temporary folder)")
    p.add_argument("--model", default=None, help="model path (default: the prepared SmolLM2-135M-Instruct)")
    p.add_argument("--serve-args", default=None, help="extra `lynx serve` arguments for P and D, one string; "
                   "later values override the CPU defaults (e.g. '--dtype bfloat16 --gpu-memory-utilization 0.4')")
    p.add_argument("--spec-min-margin", type=float, default=None, help="D's speculative_min_margin, the "
                   "confidence gate of the speculative mode (default: the connector's; 0 = hold every token up to "
                   "the cap)")
    p.add_argument("--max-model-len", type=int, default=None, help=f"servers' max model length ({MAX_MODEL_LEN})")
    p.add_argument("--p-cpus", default=None, help="P's VLLM_CPU_OMP_THREADS_BIND (default 0 on >= 2 cores; "
                   "'' = unpinned)")
    p.add_argument("--d-cpus", default=None, help="D's VLLM_CPU_OMP_THREADS_BIND (default 1 on >= 2 cores)")
    p.add_argument("--cache-dtype", default="float32", choices=CACHE_DTYPES,
                   help="KV cache dtype of the servers (bytes on the wire are computed for it)")
    p.add_argument("--out", default=None, help="write JSON here (plus .md and PNG plots beside it)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lynx_connector.lab.bench.e2e")
    sub = parser.add_subparsers(dest="bench", required=True)
    add_parser(sub)
    run(parser.parse_args(["e2e", *(argv if argv is not None else sys.argv[1:])]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
