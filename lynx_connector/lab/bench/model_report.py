"""Markdown tables and the TTFT-vs-link PNG of ``lynx bench model``, from its result dict (JSON) alone::

    python -m lynx_connector.lab.bench.model_report benchmarks/results/model.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from lynx_connector.modes import comparison_order, get_mode

_ORDER = comparison_order()


def _t(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]) + "\n"


def markdown(result: dict[str, Any]) -> str:
    w = result["workload"]
    a = {k: v["value"] for k, v in result["assumptions"].items()}
    cal = result["calibration"]
    cons = result["constants"]
    meas = result["measured"]
    k = result["k"]
    out = [f"## lynx bench model: {w['model']} ({w['layers']} layers x {w['kv_heads']} KV heads x {w['head_dim']}, "
           f"{w['cache_dtype']} cache), {w['tokens']} tokens, one request\n",
           "On paper: measured constants of this machine + stated GPU/RDMA assumptions (JSON `assumptions`, each "
           "with its reason). Sequential = prefill, then transfer (today); pipelined = layer-wise encode and pull "
           "overlapping the prefill, D dispatched at once (issue 15).\n"]
    calibrated = ", ".join(f"{n} = {cal['values'][n]:.4g}" for n in cal.get("calibrated", [])) or "none"
    out.append(f"Assumptions: prefill {a['prefill_s']:.3f} s, link efficiency {a['link_efficiency']:.3f}, decode "
               f"step {a['decode_step_s'] * 1e3:.0f} ms, GPU copy {a['gpu_memcpy_gbps']:.0f} GB/s, "
               f"{a['per_descriptor_s'] * 1e6:.1f} us per descriptor, verify {a['verify_steps']:g} step(s), "
               f"encode on the forward's critical path x{a['encode_on_critical_path']:g}. Calibrated ({cal.get('method', '-')} "
               f"on the paper's {', '.join(cal.get('rows', []))} rows, one set for all modes): {calibrated}.\n")
    acc = cons["acceptance"]
    out.append(f"Measured here: transport achieved/paced {cons['transport_ratio']:.3f} (worst "
               f"{meas['transfer']['transport_ratio_worst']:.3f} at {meas['transfer']['rates_used_gbps']} Gbit/s), "
               f"anchor share of the link beside a residual {cons['anchor_share']:.3f}, "
               f"{cons['descriptors_per_region']} descriptor(s) per plane region, side-channel round trip "
               f"{cons['control_s'] * 1e3:.2f} ms (loopback); codec cost / memcpy from {Path(meas['codec']['file']).name} "
               f"({meas['codec']['model']}, {meas['codec']['cache_dtype']}); speculative acceptance "
               f"{acc['acceptance']:.3f}, held cap {_t(acc['held_cap'])} ({acc['source']}).\n")
    out.append(f"### Check against the paper ({result['paper']['source']}), sequential flow at "
               f"{result['paper']['link_gbps']:g} Gbit/s, tolerance {result['tolerance']:.0%}\n")
    rows = [[get_mode(c["mode"]).label, "TTFT" if c["metric"] == "ttft_s" else f"TT{k}T", _t(c["paper"]),
             _t(c["model"]), f"{c['rel_error']:+.1%}", "PASS" if c["pass"] else "FAIL",
             c["role"] + ("" if c["gate"] else " (not gating)"), c["acceptance"] or "-"]
            for c in result["checks"]]
    out.append(_table(["mode", "metric", "paper s", "model s", "error", "verdict", "role", "acceptance"], rows))
    out.append(f"\nPipelined flow: {result['pipelined']}.\n")
    out.append(f"### Predictions (seconds): TTFT / TT{k}T per flow, and the limit max(prefill, first-token bytes "
               "/ link) + one step\n")
    links = result["links_gbps"]
    flows = result["flows"]
    by = {(r["mode"], r["flow"], r["link_gbps"]): r for r in result["rows"]}
    modes = sorted({r["mode"] for r in result["rows"]}, key=_ORDER.index)
    headers = ["mode", "bits/value"] + [f"{x:g} Gbit/s {f}" for x in links for f in flows] + \
              [f"{x:g} Gbit/s limit" for x in links]
    table = []
    for m in modes:
        first = by[(m, flows[0], links[0])]
        cells = [get_mode(m).label, f"{first['bits_per_value']:.3g}"]
        cells += [f"{_t(by[(m, f, x)]['ttft_s'])} / {_t(by[(m, f, x)][f'tt{k}t_s'])}" for x in links for f in flows]
        cells += [_t(by[(m, flows[0], x)]["limit_ttft_s"]) for x in links]
        table.append(cells)
    out.append(_table(headers, table))
    spec = [r for r in result["rows"] if get_mode(r["mode"]).late_residual]
    if spec:
        out.append("\nSpeculative: tokens held on the anchor / accepted (expected) before the verify pass: " + "; ".join(
            f"{r['flow']} {r['link_gbps']:g} Gbit/s {r['held_tokens']:.1f} / {r['accepted_tokens']:.1f}" for r in spec)
            + ".\n")
    out.append(f"\nCommand: `lynx bench model --out benchmarks/results/model.json` ({result.get('timestamp')}, git "
               f"{str(result.get('git', {}).get('commit'))[:10]}).\n")
    return "\n".join(out)


def plot(result: dict[str, Any], path: Path) -> Path:
    """TTFT vs link rate, one panel per flow (same colour per mode), with the paper's points on the sequential one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    flows = result["flows"]
    fig, axes = plt.subplots(1, len(flows), figsize=(6.5 * len(flows), 5.5), sharey=True, squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    modes = sorted({key.split("/")[0] for key in result["curves"]}, key=_ORDER.index)
    paper = result["paper"]
    for ax, flow in zip(axes[0], flows, strict=True):
        for i, m in enumerate(modes):
            pts = result["curves"].get(f"{m}/{flow}")
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], color=colours[i % len(colours)],
                        label=get_mode(m).label)
        if flow == "sequential":
            for j, (m, ref) in enumerate(paper["rows"].items()):
                if m in modes:
                    ax.plot([paper["link_gbps"]], [ref["ttft_s"]], "o", color=colours[modes.index(m) % len(colours)],
                            markeredgecolor="black", label="paper, Table 1" if j == 0 else None)
        for x in result["links_gbps"]:
            ax.axvline(x, color="grey", lw=0.5, alpha=0.5)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("link rate (Gbit/s, nominal)")
        ax.set_title(f"{flow} flow")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("TTFT (s, predicted)")
    w = result["workload"]
    fig.suptitle(f"lynx bench model: {w['model']}, {w['tokens']} tokens, one request (measured constants + stated "
                 "assumptions)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    for name in argv if argv is not None else sys.argv[1:]:
        path = Path(name)
        result = json.loads(path.read_text())
        path.with_suffix(".md").write_text(markdown(result))
        plot(result, path.with_name(path.stem + "_ttft_vs_link.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
