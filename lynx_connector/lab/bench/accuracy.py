"""``lynx bench accuracy``: what each transfer mode does to the answers of the real model on real text.

A prefill engine (P) and a decode engine (D) run the real LynxConnector in two processes (vLLM offline engines
on one CPU core each) and the KV crosses between them over real NIXL (unpaced: the link rate does not change
what arrives). For every mode:

* needle-in-a-haystack over Paul Graham essays at several context lengths and depths: P prefills the prompt, D
  decodes greedily on the transferred KV; correct when the needle's number is in the answer (Wilson 95% CI);
* greedy agreement with the bf16 mode on the same prompts: identical generations, and the share of tokens
  matched before the first divergence;
* perplexity windows: consecutive essay windows split into a context C and a continuation X. P prefills C
  only; D gets C + X with ``prompt_logprobs`` and loads C's KV from P (checked: D reports len(C) cached tokens),
  so every scored token of X attends to the transferred, quantized KV of C. vLLM computes prompt logprobs only
  for the tokens it computes itself, i.e. X[1:] (X[0]'s logit would come from C's last position). vLLM skips
  external KV for prompt-logprob requests unless ``skip_reading_prefix_cache=False`` is set on the request,
  which this benchmark does (that is why it uses offline engines: the HTTP API does not expose it).
  Reported: perplexity, and the paired per-window NLL difference to bf16 with a t 95% CI.

``bf16`` is the passthrough of the cache dtype: the engines keep an fp32 cache, so it moves 32 bits/value.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from typing import Any

from lynx_connector import presets
from lynx_connector.lab.bench import common
from lynx_connector.lab.bench.report import wilson
from lynx_connector.lab.engine import EngineProcess
from lynx_connector.logger import init_logger
from lynx_connector.modes import MODE_NAMES, comparison_order, get_mode

logger = init_logger(__name__)

MODES = comparison_order()  # every transfer mode (the modes table)
ROUND = 2  # requests per P -> D round (2 fp32 prompts of 2k tokens fit P's staging)
SPEC_K = 16  # D's verification slots per pass in the speculative mode
ENGINE_START_TIMEOUT_S = 600.0
ENGINE_TIMEOUT_S = 1800.0  # per generate() call
# two-sided 95% t quantiles by degrees of freedom (normal beyond 30)
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
        20: 2.086, 25: 2.060, 30: 2.042, 40: 2.021, 50: 2.009, 60: 2.000, 80: 1.990, 100: 1.984, 120: 1.980}


def t95(df: int) -> float:
    if df <= 0:
        return float("nan")
    if df in _T95:
        return _T95[df]
    # between the table's entries: the next smaller df's (slightly wider: never an interval too narrow); beyond
    # 120, t(120)
    return _T95[max(k for k in _T95 if k <= df)]


def mean_ci(values: list[float]) -> tuple[float | None, tuple[float | None, float | None]]:
    """Mean and t 95% interval (None bounds for fewer than 2 values)."""
    if not values:
        return None, (None, None)
    m = statistics.fmean(values)
    if len(values) < 2:
        return m, (None, None)
    half = t95(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return m, (m - half, m + half)


# ---- engines in child processes -------------------------------------------------------------------------------
def kv_config(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    # the bench compares every mode on one P/D pair: it allows them all (a deployment's default is
    # lossless + lynx full/speculative only: allowed_modes in docs/OPERATIONS.md)
    cfg = {"mode": "full", "staging_mb": 384, "timeout_s": 60, "lease_s": 300, "allowed_modes": "all"}
    cfg.update(extra or {})
    return {"kv_connector": "LynxConnector", "kv_connector_module_path": "lynx_connector.connector",
            "kv_role": "kv_both", "kv_connector_extra_config": cfg}


def start_engine(model: str, cpu: str | None, **overrides: Any) -> EngineProcess:
    """One offline vLLM engine with LynxConnector (``kv_config()``) in a spawned process: the shared harness
    (``lynx_connector.lab.engine``) with this benchmark's batch size and its patient timeouts (a 2k-token fp32
    prefill on one busy core)."""
    return EngineProcess(model, kv_config(), cpu=cpu, start_timeout=ENGINE_START_TIMEOUT_S,
                         timeout=ENGINE_TIMEOUT_S, max_num_seqs=16, **overrides)


def speculative_overrides() -> tuple[dict[str, Any] | None, str]:
    """Engine arguments that turn D's speculative mode on (``presets.speculative_engine_args(SPEC_K)``: the
    Lynx scheduler and the null proposer that switches vLLM's verification on), when this checkout has
    ``lynx_connector.speculative``."""
    try:
        import lynx_connector.speculative.proposer  # noqa: F401
        import lynx_connector.speculative.scheduler  # noqa: F401
    except ImportError as exc:
        return None, f"lynx_connector.speculative is not usable here ({exc})"
    return (presets.speculative_engine_args(SPEC_K),
            f"D runs {presets.SPEC_SCHEDULER} with {SPEC_K} verification slots per pass")


# ---- the benchmark --------------------------------------------------------------------------------------------
def bits_per_value(mode: str, num_tokens: int = 1024, heads: int = 3, head_dim: int = 64) -> float:
    """Wire bits per value D pulls in ``mode`` (the modes table), fp32 cache."""
    import torch

    return get_mode(mode).bits_per_value(num_tokens, heads, head_dim, torch.float32)


def run_mode(p: EngineProcess, d: EngineProcess, mode: str, needles: list[Any], windows: list[tuple[list[int], list[int]]],
             gen_tokens: int) -> dict[str, Any]:
    from lynx_connector.lab.data import needle_found

    t0 = time.perf_counter()
    contexts = [c for c, _ in windows]
    # P -> D in small rounds: P's staging holds a request's planes until D has pulled them, and a round of
    # fp32 (bf16-mode) prompts must fit it.
    jobs: list[tuple[str, int]] = [("needle", i) for i in range(len(needles))] + [("window", i)
                                                                                   for i in range(len(windows))]
    gen: list[dict[str, Any]] = [{} for _ in needles]
    scored: list[list[float]] = [[] for _ in windows]
    cached: list[int] = [0 for _ in windows]
    for k in range(0, len(jobs), ROUND):
        batch = jobs[k:k + ROUND]
        p_prompts = [needles[i].token_ids if kind == "needle" else contexts[i] for kind, i in batch]
        pre = p.generate(p_prompts, [{"do_remote_decode": True, "lynx_mode": mode}] * len(batch), max_tokens=1)
        params = [o["kv_transfer_params"] for o in pre]
        if not all(pp and pp.get("do_remote_prefill") for pp in params):
            raise RuntimeError(f"P returned no transfer parameters for mode {mode}: {params}")
        # vLLM would make D report P's own prefix-cache hits as its cached tokens
        params = [{key: v for key, v in pp.items() if key != "remote_prefill_cached_tokens"} for pp in params]
        for (kind, i), pp in zip(batch, params, strict=True):
            if kind == "needle":
                gen[i] = d.generate([needles[i].token_ids], [pp], max_tokens=gen_tokens)[0]
                if gen[i]["finish_reason"] == "error":
                    raise RuntimeError(f"mode {mode}: D failed needle prompt {i} (KV load failure?)")
            else:
                c, x = windows[i]
                out = d.generate([c + x], [pp], score_from=[len(c) + 1], max_tokens=1, prompt_logprobs=0,
                                 skip_reading_prefix_cache=False, detokenize=False)[0]
                scored[i] = out["scored_logprobs"]
                cached[i] = out["num_cached_tokens"]
    needle_gen = [{"seed": n.seed, "context_tokens": n.context_tokens, "depth": n.depth,
                   "prompt_tokens": len(n.token_ids), "answer": n.answer, "text": g["text"],
                   "token_ids": g["token_ids"], "correct": needle_found(n.answer, g["text"]),
                   "num_cached_tokens": g["num_cached_tokens"]} for n, g in zip(needles, gen, strict=True)]
    return {"needles": needle_gen, "scored_logprobs": scored, "context_cached_tokens": cached,
            "seconds": time.perf_counter() - t0}


def summarize(mode: str, raw: dict[str, Any], ref: dict[str, Any] | None) -> dict[str, Any]:
    nd = raw["needles"]
    correct = sum(g["correct"] for g in nd)
    out: dict[str, Any] = {"available": True, "bits_per_value": bits_per_value(mode), "seconds": raw["seconds"],
                           "needle": {"n": len(nd), "correct": correct,
                                      "accuracy": correct / len(nd) if nd else None,
                                      "ci95": wilson(correct, len(nd))}}
    by_len: dict[int, list[bool]] = {}
    for g in nd:
        by_len.setdefault(g["context_tokens"], []).append(g["correct"])
    out["needle"]["by_length"] = {str(k): sum(v) / len(v) for k, v in sorted(by_len.items())}
    equal, agree = 0, []
    if ref is not None:
        for g, r in zip(nd, ref["needles"], strict=True):
            equal += g["token_ids"] == r["token_ids"]
            same = 0
            for a, b in zip(g["token_ids"], r["token_ids"], strict=False):
                if a != b:
                    break
                same += 1
            agree.append(same / max(len(r["token_ids"]), 1))
    out["greedy"] = {"n": len(nd) if ref else 0, "equal": equal, "ci95": wilson(equal, len(nd)) if ref else None,
                     "token_agreement": statistics.fmean(agree) if agree else None}
    scored = raw["scored_logprobs"]
    if scored:
        nll = [-lp for w in scored for lp in w]
        out["perplexity"] = {"ppl": math.exp(statistics.fmean(nll)), "tokens": len(nll), "windows": len(scored),
                             "mean_nll": statistics.fmean(nll),
                             "context_tokens_not_computed_by_d": raw.get("context_cached_tokens")}
        if ref is not None and ref["scored_logprobs"]:
            diffs = [statistics.fmean(-a for a in w) - statistics.fmean(-b for b in rw)
                     for w, rw in zip(scored, ref["scored_logprobs"], strict=True)]
            m, ci = mean_ci(diffs)
            out["perplexity"].update(delta_nll_vs_bf16=m, delta_nll_ci95=list(ci))
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from lynx_connector.lab.data import build_needle_prompt, perplexity_windows
    from lynx_connector.lab.models import prepare

    t_start = time.perf_counter()
    env = common.environment_info()  # at the start: the code (git revision) and versions that ran
    quick = bool(args.quick)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise SystemExit(f"unknown modes {unknown}; choose from {', '.join(MODE_NAMES)}")
    if "bf16" in modes:  # the reference goes first
        modes.remove("bf16")
        modes.insert(0, "bf16")
    if "speculative" in modes:  # last: it needs a D of its own
        modes.remove("speculative")
        modes.append("speculative")
    lengths = [int(x) for x in (args.lengths or ("1024" if quick else "1024,2048")).split(",")]
    depths = [float(x) for x in (args.depths or ("0.5" if quick else "0.1,0.3,0.5,0.7,0.9")).split(",")]
    n_windows = args.windows if args.windows is not None else (1 if quick else 8)
    window = args.window_tokens or 1024
    cont = args.continuation_tokens or 128
    model = str(prepare())
    tok = AutoTokenizer.from_pretrained(model)
    needles = [build_needle_prompt(tok, n, depth=dp, seed=7 + 31 * i + j)
               for i, n in enumerate(lengths) for j, dp in enumerate(depths)]
    windows = [(w[:-cont], w[-cont:]) for w in perplexity_windows(tok, window, n_windows)] if n_windows else []
    _write(f"lynx bench accuracy: {len(needles)} needle prompts ({lengths} tokens x depths {depths}), "
           f"{len(windows)} perplexity windows ({window - cont} context + {cont} scored tokens), modes "
           f"{', '.join(modes)}; starting P and D engines")
    spec_kw, spec_note = speculative_overrides() if "speculative" in modes else (None, "not requested")
    started: list[EngineProcess] = []
    raw: dict[str, dict[str, Any]] = {}
    results: dict[str, Any] = {}
    try:
        t0 = time.perf_counter()
        p = start_engine(model, cpu="0")
        started.append(p)
        d_cpu = "1" if (os.cpu_count() or 1) > 1 else "0"
        d = start_engine(model, cpu=d_cpu)
        started.append(d)
        _write(f"engines ready after {time.perf_counter() - t0:.0f} s")
        for i, mode in enumerate(modes):
            if mode == "speculative":
                if spec_kw is None:
                    results[mode] = {"available": False, "note": spec_note}
                    _write(f"[{i + 1}/{len(modes)}] speculative: NOT AVAILABLE ({spec_note})")
                    continue
                # A D of its own (the Lynx scheduler + verification machinery); perplexity is teacher-forced
                # scoring of the prompt, where nothing is speculated, so only needles and greedy agreement.
                d.close()
                started.remove(d)
                d = start_engine(model, cpu=d_cpu, **spec_kw)
                started.append(d)
                raw[mode] = run_mode(p, d, mode, needles, [], args.gen_tokens)
            else:
                raw[mode] = run_mode(p, d, mode, needles, windows, args.gen_tokens)
            results[mode] = summarize(mode, raw[mode], raw.get("bf16") if mode != "bf16" else None)
            if mode == "speculative":
                results[mode]["perplexity_note"] = "not measured: prompt scoring is teacher-forced (no speculation)"
            r = results[mode]
            ppl = (r.get("perplexity") or {}).get("ppl")
            _write(f"[{i + 1}/{len(modes)}] {mode:<11} needle {r['needle']['correct']}/{r['needle']['n']}, "
                   f"greedy = bf16 {r['greedy']['equal']}/{r['greedy']['n']}, ppl "
                   f"{'n/a' if ppl is None else f'{ppl:.3f}'} ({r['seconds']:.0f} s)")
    finally:
        for e in reversed(started):
            e.close()
    if "bf16" in results:  # bf16 vs itself: by definition
        results["bf16"]["greedy"] = {"n": results["bf16"]["needle"]["n"], "equal": results["bf16"]["needle"]["n"],
                                     "ci95": None, "token_agreement": 1.0}
    result: dict[str, Any] = {
        "bench": "accuracy", "quick": quick, "model": os.path.basename(model), "cache_dtype": "float32",
        "bf16_note": "bf16 mode = passthrough of the cache dtype: fp32 here, 32 bits/value",
        "method": "P and D offline engines (one CPU core each), KV over NIXL unpaced; perplexity scored on D over "
                  "the transferred context KV (prompt_logprobs, skip_reading_prefix_cache=False).",
        "config": {"modes": modes, "lengths": lengths, "depths": depths, "windows": len(windows),
                   "window_tokens": window, "continuation_tokens": cont, "gen_tokens": args.gen_tokens,
                   "temperature": 0.0},
        "speculative": {"available": spec_kw is not None, "note": spec_note},
        "modes": results,
        "generations": {m: raw[m]["needles"] for m in raw},
    }
    result["wall_s"] = time.perf_counter() - t_start
    common.record_environment(result, env)
    from lynx_connector.lab.bench import report

    sys.stdout.write("\n" + report.accuracy_markdown(result))
    if args.out:
        common.write_json(args.out, result)
        report.write_outputs(args.out, result)
        logger.info("wrote %s", args.out)
    return result


def _write(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("accuracy", help="needles, perplexity and greedy agreement per transfer mode",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="CI size (< 3 minutes)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated modes (bf16 is the reference)")
    p.add_argument("--lengths", default=None, help="needle context lengths (default 1024,2048)")
    p.add_argument("--depths", default=None, help="needle depths (default 0.1,0.3,0.5,0.7,0.9)")
    p.add_argument("--windows", type=int, default=None, help="perplexity windows (default 8; 0 = none)")
    p.add_argument("--window-tokens", type=int, default=None, help="tokens per window, context + continuation")
    p.add_argument("--continuation-tokens", type=int, default=None, help="scored tokens at the end of a window")
    p.add_argument("--gen-tokens", type=int, default=24, help="greedy tokens per needle prompt")
    p.add_argument("--out", default=None, help="write JSON here (plus .md and a PNG plot beside it)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lynx_connector.lab.bench.accuracy")
    sub = parser.add_subparsers(dest="bench", required=True)
    add_parser(sub)
    run(parser.parse_args(["accuracy", *(argv if argv is not None else sys.argv[1:])]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
