"""``lynx bench model``: TTFT and TT32T per mode and flow at production scale, on paper.

Predicts one request's time to first token and to the 32nd token for every transfer mode (the modes table,
``lynx_connector/modes.py``), sequential (prefill, then transfer: today's flow) and pipelined (layer-wise
encode and pull overlapping the prefill, D dispatched at once: issue 15), at the Lynx paper's setting
(Qwen3-32B, 16K tokens) over 10/25/100/400 Gbit/s links, from

- constants measured on this machine (``model_inputs.py``: codec cost relative to memcpy, the transport's
  achieved/paced ratio and anchor share, descriptors per plane, the side-channel round trip, speculative
  acceptance), and bytes per layer from the codec registry;
- stated GPU/RDMA assumptions (``ttft_model.Assumptions``: every one a flag, with its reason in the JSON).

Prefill and link efficiency, when not given, are calibrated once, for all modes together, on the paper's
single-stream rows (BF16, INT8, INT4) by least squares; Lynx is held out. The check, the sequential TTFT of every
paper row within 15% of the paper's, is computed and stored; the pipelined predictions are made only when it
passes (``--force`` makes them anyway, marked unchecked). Arithmetic in ``ttft_model.py``; no engine runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

from lynx_connector.lab.bench import common
from lynx_connector.lab.bench.model_inputs import (
    RESULTS,
    MissingResultError,
    mode_costs,
    read_constants,
    source_layer_bytes,
)
from lynx_connector.lab.bench.ttft_model import (
    FLOWS,
    PAPER_WORKLOAD,
    Acceptance,
    Assumptions,
    Workload,
    calibrate,
    predict,
)
from lynx_connector.logger import init_logger
from lynx_connector.modes import comparison_order, get_mode

logger = init_logger(__name__)

#: The Lynx paper's Table 1 (MMLU-Pro, Qwen3-32B, 16K context, the ~10 Gbit/s end of its 10-50 Gbit/s range),
#: by the mode that matches each row (the paper's Lynx row releases its first token on the anchor and verifies:
#: ``speculative``). Source: /work/shared/reference/paper.md section 6 (summary of arXiv 2607.01831).
PAPER = {"source": "Lynx paper (arXiv 2607.01831), Table 1: MMLU-Pro, Qwen3-32B, 16K context, ~10 Gbit/s",
         "link_gbps": 10.0,
         "rows": {"bf16": {"ttft_s": 4.4, "tt32t_s": 5.9}, "int8": {"ttft_s": 2.3, "tt32t_s": 3.8},
                  "int4": {"ttft_s": 1.4, "tt32t_s": 2.9}, "speculative": {"ttft_s": 1.6, "tt32t_s": 3.4}},
         # "the model generates on average 21.43 speculative tokens, of which 19.38 tokens are accepted"
         "acceptance": 19.38 / 21.43}
TOLERANCE = 0.15
DEFAULT_LINKS = (10.0, 25.0, 100.0, 400.0)
K = 32


def _floats(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return vals


def _modes(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    for n in names:
        get_mode(n)  # UnknownModeError lists the valid ones
    return names


def _role(calibration_row: bool, metric: str) -> str:
    if metric == "ttft_s":
        return "calibration row" if calibration_row else "held out"
    # the decode step is the paper's (TT32T - TTFT) / 31 of these rows; speculation's head start is not
    return "held out" if not calibration_row else "decode step taken from it"


def _acc_label(acc: Acceptance) -> str:
    cap = "no held cap" if acc.held_cap is None else f"held cap {acc.held_cap:.3g}"
    return f"{'paper' if acc.source == 'paper' else 'this machine'}: {acc.acceptance:.3f}, {cap}"


def check_paper(a: Assumptions, costs: dict[str, Any], w: Workload, c: Any) -> list[dict[str, Any]]:
    """The paper's rows against the sequential prediction at its link rate, TTFT (the gate) and TT32T."""
    checks = []
    calibrated_on = {m for m in PAPER["rows"] if not get_mode(m).two_stream}
    paper_acc = dataclasses.replace(c, acceptance=Acceptance(PAPER["acceptance"], None, "paper"))
    for mode, ref in PAPER["rows"].items():
        for metric, consts in (("ttft_s", c), ("tt32t_s", c), ("tt32t_s", paper_acc)):
            if metric == "tt32t_s" and consts is paper_acc and not get_mode(mode).late_residual:
                continue
            got = predict(costs[mode], "sequential", PAPER["link_gbps"], w.layers, a, consts, K)[metric]
            err = got / ref[metric] - 1.0
            checks.append({"mode": mode, "metric": metric, "paper": ref[metric], "model": got,
                           "rel_error": err, "pass": abs(err) <= TOLERANCE, "gate": metric == "ttft_s",
                           "role": _role(mode in calibrated_on, metric),
                           "acceptance": _acc_label(consts.acceptance) if get_mode(mode).late_residual else None})
    return checks


def build(args: argparse.Namespace) -> dict[str, Any]:
    """Compute the result dict (no output)."""
    w = Workload(args.model_name, args.layers, args.kv_heads, args.head_dim, args.tokens, args.cache_dtype)
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(Assumptions)
             if getattr(args, f.name) is not None}
    a = Assumptions(**given)
    c, measured = read_constants(Path(args.results_dir), args.acceptance, args.spec_held_cap)
    modes = [get_mode(n) for n in (args.modes or comparison_order())]
    needed = [get_mode(n) for n in PAPER["rows"] if n not in {m.name for m in modes}]
    costs = mode_costs(modes + needed, w, c, a)  # codec times do not depend on the calibrated numbers
    reference = {m: r["ttft_s"] for m, r in PAPER["rows"].items() if not get_mode(m).two_stream}
    a, calibration = calibrate(a, reference, costs, PAPER["link_gbps"], w.layers, c)
    checks = check_paper(a, costs, w, c)
    passed = all(ch["pass"] for ch in checks if ch["gate"])
    flows = FLOWS if passed or args.force else ("sequential",)
    rows = []
    for link in args.links:
        for m in modes:
            cost = costs[m.name]
            for flow in flows:
                p = predict(cost, flow, link, w.layers, a, c, K)
                rows.append({"mode": m.name, "label": m.label, "flow": flow, "link_gbps": link, **p,
                             "first_token_bytes": cost.layer_first * w.layers,
                             "wire_bytes": (cost.layer_anchor + cost.layer_residual) * w.layers,
                             "bits_per_value": 8 * (cost.layer_anchor + cost.layer_residual)
                             / (2 * w.tokens * w.kv_heads * w.head_dim)})
    curve_links = [round(5 * 1.25 ** i, 3) for i in range(30) if 5 * 1.25 ** i <= 800]
    curves = {f"{m.name}/{flow}": [[x, predict(costs[m.name], flow, x, w.layers, a, c, K)["ttft_s"]]
                                   for x in curve_links] for m in modes for flow in flows}
    return {
        "bench": "model",
        "workload": dataclasses.asdict(w),
        "source_layer_bytes": source_layer_bytes(w),
        "paper": PAPER,
        "tolerance": TOLERANCE,
        "assumptions": a.explained(),
        "assumptions_given": sorted(given),
        "calibration": calibration,
        "measured": measured,
        "constants": {"transport_ratio": c.transport_ratio, "anchor_share": c.anchor_share,
                      "descriptors_per_region": c.descriptors_per_region, "control_s": c.control_s,
                      "merge_frac": c.merge_frac, "max_speculative_tokens": c.max_speculative_tokens,
                      "acceptance": dataclasses.asdict(c.acceptance)},
        "codec_gpu": {name: {"encode_layer_s": k.encode_layer_s, "decode_layer_s": k.decode_layer_s,
                             "merge_layer_s": k.merge_layer_s} for name, k in costs.items()},
        "checks": checks,
        "check_passed": passed,
        "pipelined": "predicted" if passed else ("predicted despite the failed check (--force): unchecked"
                                                 if args.force else "not predicted: the paper check failed"),
        "flows": list(flows),
        "links_gbps": list(args.links),
        "k": K,
        "rows": rows,
        "curves": curves,
    }


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``model`` on a ``lynx bench`` subparsers object."""
    p = subparsers.add_parser("model", help="TTFT/TT32T per mode and flow at production scale, on paper "
                              "(measured constants + stated GPU/RDMA assumptions)",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--results-dir", default=str(RESULTS),
                   help="where codec.json, transfer.json and e2e_gate.json/e2e.json are read (default %(default)s)")
    p.add_argument("--out", default=str(RESULTS / "model.json"),
                   help="result JSON; the .md table and _ttft_vs_link.png go beside it (default %(default)s)")
    p.add_argument("--links", type=_floats, default=list(DEFAULT_LINKS),
                   help="link rates to predict, Gbit/s, comma-separated (default 10,25,100,400)")
    p.add_argument("--modes", type=_modes, default=None,
                   help=f"modes, comma-separated (default all: {','.join(comparison_order())})")
    p.add_argument("--model-name", default=PAPER_WORKLOAD.model)
    p.add_argument("--layers", type=int, default=PAPER_WORKLOAD.layers)
    p.add_argument("--kv-heads", type=int, default=PAPER_WORKLOAD.kv_heads)
    p.add_argument("--head-dim", type=int, default=PAPER_WORKLOAD.head_dim)
    p.add_argument("--tokens", type=int, default=PAPER_WORKLOAD.tokens, help="prompt tokens")
    p.add_argument("--cache-dtype", default=PAPER_WORKLOAD.cache_dtype, choices=("bfloat16", "float16", "float32"))
    for f in dataclasses.fields(Assumptions):
        p.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=float, default=None,
                       help=f"{f.metadata['why']} (default {f.default})".replace("%", "%%"))
    p.add_argument("--acceptance", type=float, default=None,
                   help="speculative acceptance (accepted / held tokens); default: measured in e2e_gate.json "
                        "and e2e.json")
    p.add_argument("--spec-held-cap", type=float, default=None,
                   help="most tokens D holds before the residual lands (default: measured held per request with "
                        "--acceptance unset, else only max_speculative_tokens; <= 0: only that)")
    p.add_argument("--force", action="store_true", help="predict the pipelined flow even if the paper check fails")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Compute, print the tables, write the JSON, Markdown and PNG."""
    from lynx_connector.lab.bench import model_report

    t0 = time.perf_counter()
    try:
        result = build(args)
    except (MissingResultError, ValueError) as e:  # a missing input, or assumptions that cannot hold
        raise SystemExit(f"lynx bench model: {e}") from None
    result["wall_s"] = time.perf_counter() - t0
    result.update(common.environment_info())
    md = model_report.markdown(result)
    sys.stdout.write(md)
    sys.stdout.flush()
    out = Path(args.out)
    common.write_json(out, result)
    out.with_suffix(".md").write_text(md)
    png = model_report.plot(result, out.with_name(out.stem + "_ttft_vs_link.png"))
    logger.info("wrote %s, %s and %s", out, out.with_suffix(".md"), png)
    if not result["check_passed"]:
        logger.warning("the paper check failed: %s", "; ".join(
            f"{c['mode']} {c['metric']} {c['rel_error']:+.1%}" for c in result["checks"] if c["gate"] and not c["pass"]))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lynx_connector.lab.bench.model")
    sub = parser.add_subparsers(dest="bench", required=True)
    add_parser(sub)
    return exit_status(run(parser.parse_args(["model", *(argv if argv is not None else sys.argv[1:])])))


def exit_status(result: dict[str, Any]) -> int:
    """0 when the paper check passed (what ``lynx bench model`` exits with)."""
    return 0 if result["check_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
