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
   (requests of a concurrent batch prefilled one after another on P, the link serving them in order; with
   ``--batches`` each round on its own), and measured/ideal, so every overhead is visible.
5. Each result carries its target checks (``targets.evaluate_targets``): the concurrency-1 targets of the
   earlier issues and, per cell at concurrency above 1, issue 16's (full and speculative against int8, auto
   against the best fixed mode); a speculative TT32T check also says what exact outputs allow in its cell
   (``targets.exact_floor``: full TTFT / int8 TT32T, and the accepted tokens per request the target needs).

"bf16" is the passthrough of the cache dtype: the CPU servers keep an fp32 cache, so it moves 32 bits/value,
twice the 16-bit BF16 bytes that define the regimes.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lynx_connector.concurrent import FLOWS
from lynx_connector.lab.bench import common
from lynx_connector.lab.bench.e2e.deploy import restart_decode, speculative_serve_args, start_deployment
from lynx_connector.lab.bench.e2e.measure import (
    Progress,
    concurrently,
    detect_speculative,
    equality_by_row,
    mark_output_equality,
    measure_prefills,
    one_request,
    run_rate,
    write,
)
from lynx_connector.lab.bench.e2e.plan import (
    CACHE_DTYPES,
    DEFAULT_CONC_LENGTH,
    DEFAULT_CONC_RATIOS,
    DEFAULT_LENGTHS,
    DEFAULT_RATIOS,
    DEFAULT_REPEATS,
    MAX_MODEL_LEN,
    MODES,
    QUICK_LENGTH,
    QUICK_LINK_GBPS,
    TASKS,
    Plan,
    build_prompts,
    choose_rates,
    model_shape,
    ref_bf16_bytes,
    wire_bytes,
)
from lynx_connector.lab.bench.e2e.targets import TARGETS, evaluate_targets
from lynx_connector.logger import init_logger
from lynx_connector.modes import AUTO_MODE, MODE_NAMES, is_requestable

logger = init_logger(__name__)


def _ints(text: str | None) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()] if text else []


def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from lynx_connector.lab.models import prepare

    t_start = time.perf_counter()
    env = common.environment_info()  # at the start: the code (git revision) and versions that ran
    quick = bool(args.quick)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(m for m in modes if not is_requestable(m))
    if unknown:
        raise SystemExit(f"unknown modes {unknown}; choose from {', '.join(MODE_NAMES)} or {AUTO_MODE}")
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
    flows = tuple(dict.fromkeys(f.strip() for f in args.flow.split(",") if f.strip()))
    if not flows or any(f not in FLOWS for f in flows):
        raise SystemExit(f"--flow takes a comma list of {', '.join(FLOWS)}, got {args.flow!r}")
    explicit = [float(x) for x in args.link_gbps.split(",")] if args.link_gbps else None
    if AUTO_MODE in modes and explicit and len(explicit) > 1:
        # P (which chooses) keeps the KVTransferConfig it started with; only D restarts per rate
        raise SystemExit("auto with several --link-gbps: P would keep the first rate configured for its choices; "
                         "run one rate per invocation, or the calibrated schedule (P then measures the link)")
    needs_spec = "speculative" in modes or AUTO_MODE in modes
    if args.batches < 1:
        raise SystemExit(f"--batches must be >= 1, got {args.batches}")
    if args.token_budget is not None and args.token_budget < 0:
        raise SystemExit(f"--token-budget must be >= 0, got {args.token_budget}")
    plan = Plan(modes, lengths, repeats, conc, conc_length, args.max_tokens, args.cache_dtype, max_len,
                tuple(shlex.split(args.serve_args or "")), p_cpus or None, d_cpus or None, args.spec_min_margin,
                flows, batches=args.batches)
    model = args.model or str(prepare())
    shape = model_shape(model)
    tok = AutoTokenizer.from_pretrained(model)
    all_lengths = sorted(set(lengths + ([conc_length] if max(conc) > 1 else [])))
    prompts = build_prompts(tok, all_lengths, max(repeats, max(conc)), args.task)
    warm_prompt = build_prompts(tok, [128], 1, args.task)[128][0]  # short: cheap on the slowest link
    # P's token budget per step (the servers' --max-num-batched-tokens, before --serve-args, which may override
    # it): the longest prompt of the run, so that each prompt is prefilled in one step (P publishes a request's
    # layers in the step of its last chunk) and concurrent prompts one after another instead of all together at
    # the end of one batched step (OPERATIONS.md "P's token budget under concurrency")
    budget = args.token_budget if args.token_budget is not None else max(
        len(p.token_ids) for ps in prompts.values() for p in ps)
    if budget:
        plan.serve_args = ("--max-num-batched-tokens", str(budget), *plan.serve_args)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="lynx-bench-e2e-"))
    ref_tokens = args.ref_tokens or conc_length
    # Deployments: quick = one at a fixed rate; full = unpaced calibration, then one per chosen rate.
    if explicit:
        schedule: list[tuple[str, float | None, float | None]] = [(f"{g:g} Gbps", g, None) for g in explicit]
    elif quick:
        schedule = [(f"{QUICK_LINK_GBPS:g} Gbps", QUICK_LINK_GBPS, None)]
    else:
        schedule = [("unpaced", None, None)]
    conc_ratios = (list(DEFAULT_CONC_RATIOS) if args.conc_ratios is None else None if args.conc_ratios == "all"
                   else [float(x) for x in args.conc_ratios.split(",")])
    cells_c1 = len(lengths) * len(modes) * len(flows) if 1 in conc else 0
    cells_cn = sum(1 for c in conc if c > 1) * len(modes) * len(flows)
    n_first = len(schedule) if explicit or quick or args.unpaced_runs else 0
    n_paced = 0 if explicit or quick else len(ratios)
    n_paced_conc = n_paced if conc_ratios is None or not n_paced else sum(1 for r in ratios if r in conc_ratios)
    progress = Progress(((cells_c1 + cells_cn) * n_first + cells_c1 * n_paced + cells_cn * n_paced_conc)
                        * args.batches)
    write(f"lynx bench e2e: {Path(model).name} fp32 on CPU; modes {', '.join(modes)}; prompts {lengths} tokens "
           f"x {repeats} at concurrency 1, {conc_length} tokens at concurrency {[c for c in conc if c > 1]}; "
           f"{args.max_tokens} tokens each"
          + (f"; {args.batches} rounds per cell, the mode order rotated" if args.batches > 1 else "")
          + f"; logs in {log_dir}")
    rows: list[dict] = []
    requests: list[dict] = []
    deployments: list[dict] = []
    spec_args, spec_note = speculative_serve_args() if needs_spec else ([], "not requested")
    # auto on P (no speculative scheduler there) may pick speculative when D runs the scheduler
    plan.auto_speculative = bool(spec_args) if AUTO_MODE in modes else None
    spec_available = False
    calib_prefill: float | None = None
    # One deployment: P and the proxy stay up; D (the side that paces the link) restarts for each rate.
    dep, first_startup_s, spec_failed = start_deployment(model, log_dir, schedule[0][1], spec_args, plan)
    if spec_failed:
        spec_note, spec_args = spec_failed, []
        plan.auto_speculative = False if AUTO_MODE in modes else None
    try:
        i = 0
        while i < len(schedule):
            label, gbps, ratio = schedule[i]
            t_dep = time.perf_counter()
            if i > 0:
                write(f"== link {label}: restarting D")
                restart_decode(dep, gbps, log_dir / f"decode{i}.log", plan)
            startup = time.perf_counter() - t_dep if i > 0 else first_startup_s
            # First requests pay one-time costs (allocation, NIXL handshake, each codec's first call on P and D).
            # Through every flow's proxy: the pipelined one learns P's side channel from its first request.
            for m in dict.fromkeys(["full", *modes]):
                for url in dep.flow_urls.values():
                    w = one_request(url, model, warm_prompt, m, 4)
                    if w["error"] or w["tokens"] == 0:
                        raise RuntimeError(f"warm-up request ({m}) failed on link {label}: {w['error']}; D's log "
                                           f"{dep.decode.log_path}:\n{dep.decode.log_tail(8)}")
            # ... and the first concurrent batch pays its own (measured: the first mode run at concurrency 4 lost
            # ~0.9 s per request): one batch of short requests at the highest concurrency of this rate, each flow
            do_runs = gbps is not None or quick or explicit or args.unpaced_runs
            levels = [c for c in conc if c == 1 or conc_ratios is None or ratio is None or ratio in conc_ratios]
            top = max(levels, default=1)
            if top > 1 and do_runs:
                for url in dep.flow_urls.values():
                    batch = concurrently(lambda _, u=url: one_request(u, model, warm_prompt, "full", 4),
                                         list(range(top)), top)
                    if any(w["error"] for w in batch):
                        raise RuntimeError(f"concurrent warm-up failed on link {label}: "
                                           f"{next(w['error'] for w in batch if w['error'])}")
            if i == 0 and needs_spec:
                if spec_args:
                    spec_available, spec_note = detect_speculative(dep, model, prompts[all_lengths[0]][0],
                                                                   dep.decode.log_path)
                write(f"  speculative mode: {'available' if spec_available else 'NOT AVAILABLE'} ({spec_note})")
                if not spec_available and "speculative" in modes:
                    progress.total -= len(flows) * ((len(lengths) if 1 in conc else 0) * (n_first + n_paced) + sum(
                        1 for c in conc if c > 1) * (n_first + n_paced_conc))
            if do_runs:
                got_rows, got_reqs, prefill = run_rate(dep, model, label, gbps, plan, prompts, shape,
                                                       spec_available, progress, levels)
            else:
                got_rows, got_reqs = [], []
                prefill = measure_prefills(dep, model, label, prompts)
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
                write("  chosen link rates: " + ", ".join(f"{g:g} Gbit/s (16-bit BF16 transfer {r:g}x the "
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
        "config": {"modes": modes, "lengths": lengths, "repeats": repeats, "batches": args.batches,
                   "concurrency": conc, "conc_length": conc_length, "max_tokens": args.max_tokens, "ratios": ratios,
                   "ref_tokens": ref_tokens, "explicit_link_gbps": explicit, "conc_ratios": conc_ratios,
                   "task": args.task, "ignore_eos": True,
                   "temperature": 0.0, "max_model_len": max_len, "serve_args": list(plan.serve_args),
                   "spec_min_margin": plan.spec_min_margin, "auto_speculative": plan.auto_speculative,
                   "auto_link": (None if AUTO_MODE not in modes else "measured by P" if schedule[0][1] is None
                                 else f"configured on P: {schedule[0][1]:g} Gbit/s"),
                   "p_cpus": plan.p_cpus, "d_cpus": plan.d_cpus, "flows": list(flows)},
        "speculative": {"available": spec_available, "note": spec_note},
        "calibration_prefill_s": calib_prefill,
        "deployments": deployments, "rows": rows, "requests": requests,
        "ideal_model": "ideal TTFT = measured prefill on P (requests of a batch one after another) + bytes needed "
                       "before the first released token / link rate, the link serving requests in order; each "
                       "round of a cell (--batches) on its own",
        "limit_model": "limit TTFT (pipelined) = max(prefill, bytes needed before the first released token / link "
                       "rate) + one decode step (the cell's median of (TT64T - TT32T) / 32); in a batch, request k's "
                       "bytes may cross the link from the start of its prefill, after the earlier requests' bytes",
        "targets": TARGETS,
    }
    result["checks"] = evaluate_targets(rows)
    result["wall_s"] = time.perf_counter() - t_start
    common.record_environment(result, env)
    from lynx_connector.lab.bench import report

    sys.stdout.write("\n" + report.e2e_markdown(result))
    if args.out:
        common.write_json(args.out, result)
        report.write_outputs(args.out, result)
        logger.info("wrote %s", args.out)
    return result



def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("e2e", help="real 1P1D latency per transfer mode over paced links",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="CI size: one deployment at a fixed rate, "
                   f"{QUICK_LENGTH}-token prompts, concurrency 1 and 2 (< 3 minutes)")
    p.add_argument("--flow", default=",".join(FLOWS),
                   help="comma list of proxy flows to compare side by side (one proxy each in front of the same P "
                        "and D): sequential (P answers, then D: NixlConnector's contract), pipelined (P and D at "
                        "once, layer-wise publish); default both")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated transfer modes, of {', '.join(MODE_NAMES)}, or {AUTO_MODE} (P picks bf16, "
                        "full or speculative per request; its rows name the choices) (default: all but int4_kivi)")
    p.add_argument("--lengths", default=None, help=f"concurrency-1 prompt lengths (default {DEFAULT_LENGTHS})")
    p.add_argument("--repeats", type=int, default=None, help="requests per mode and length at concurrency 1 "
                   f"(default {DEFAULT_REPEATS})")
    p.add_argument("--batches", type=int, default=1, help="rounds per cell: every cell's requests (its concurrent "
                   "batch, or its --repeats requests at concurrency 1) are sent this many times, the mode order "
                   "rotated by one between rounds so that no mode always runs first or after the same neighbour; "
                   "each row covers all rounds (default 1)")
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
    p.add_argument("--token-budget", type=int, default=None, help="the servers' --max-num-batched-tokens (default: "
                   "the longest prompt's tokens: each prompt in one step, concurrent prompts one after another; "
                   "0 = the lab's default, the max model length)")
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
