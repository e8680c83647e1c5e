"""Markdown tables and PNG plots from the JSON that ``lynx bench e2e`` and ``lynx bench accuracy`` write.

Everything here reads only the JSON, so results can be re-rendered anywhere::

    python -m lynx_connector.lab.bench.report benchmarks/results/e2e.json benchmarks/results/accuracy.json

writes ``<name>.md`` and ``<name>_*.png`` beside each JSON (matplotlib, Agg backend).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from lynx_connector.lab.bench.common import format_table
from lynx_connector.logger import init_logger
from lynx_connector.modes import MODES, comparison_order

logger = init_logger(__name__)

MODE_ORDER = comparison_order()
MODE_LABEL = {m.name: m.label + (" (fp32 cache: 32 b/v)" if m.lossless else "") for m in MODES}


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float | None, float | None]:
    """Wilson score interval of a binomial proportion (95% by default); (None, None) for n == 0."""
    if n <= 0:
        return None, None
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def _s(x: Any, nd: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def _md_table(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    lines += ["| " + " | ".join(_s(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def environment_md(result: dict[str, Any]) -> str:
    hw = result.get("hardware", {})
    v = result.get("versions", {})
    git = result.get("git", {})
    return (f"Hardware: {hw.get('cpu')} ({hw.get('usable_cores')} usable cores of {hw.get('cpu_count')}, "
            f"{hw.get('mem_total_gib')} GiB), accelerator: {hw.get('accelerator') or 'none'}; load average "
            f"{'at the start ' + str(hw['loadavg_start']) + ', ' if hw.get('loadavg_start') else ''}at the end "
            f"{hw.get('loadavg')} (shared machine). Versions: vllm {v.get('vllm')}, torch {v.get('torch')}, "
            f"nixl {v.get('nixl')}, lynx-connector {v.get('lynx-connector')}; git {str(git.get('commit'))[:10]}"
            f"{' (dirty)' if git.get('dirty') else ''}; {result.get('timestamp')}; wall {result.get('wall_s', 0):.0f} s.\n")


def _mode_key(mode: str) -> int:
    return MODE_ORDER.index(mode) if mode in MODE_ORDER else len(MODE_ORDER)


# ---- e2e ------------------------------------------------------------------------------------------------------
TASK_LABEL = {"summary": "detailed summaries of Paul Graham essays (long natural answers)",
              "needle": "needle questions in Paul Graham essays (short answers, then EOS-ignored filler)"}


def e2e_markdown(result: dict[str, Any]) -> str:
    cfg = result.get("config", {})
    out = [f"## lynx bench e2e{' (quick)' if result.get('quick') else ''}\n",
           f"Model {result.get('model')} (fp32 cache, CPU), real 1P1D through the proxy, {cfg.get('max_tokens')} "
           f"greedy tokens per request (EOS ignored), prompts: "
           f"{TASK_LABEL.get(cfg.get('task', 'needle'), cfg.get('task'))}. {result.get('bf16_note', '')}. Speculative mode: "
           f"{'available' if result.get('speculative', {}).get('available') else 'NOT AVAILABLE'} "
           f"({result.get('speculative', {}).get('note')})."
           + (f" {cfg['batches']} rounds per cell, the mode order rotated by one between rounds; each row covers "
              "all of them." if cfg.get("batches", 1) > 1 else "") + "\n",
           environment_md(result), "\n### Link rates\n"]
    dep_rows = []
    for d in result.get("deployments", []):
        pre = ", ".join(f"{n}: {s:.2f}" for n, s in sorted(d["prefill_s"].items(), key=lambda kv: int(kv[0])))
        dep_rows.append([d["label"], f"{d['link_gbps']:.4g}" if d["link_gbps"] is not None else "unpaced",
                         d.get("target_ratio"), d.get("bf16_transfer_over_prefill"),
                         d.get("passthrough_transfer_over_prefill"), pre, d.get("loadavg")])
    out.append(_md_table(["deployment", "link Gbit/s", "target BF16/prefill", "measured BF16 (16-bit)/prefill",
                          "bf16-mode passthrough/prefill", "prefill s (tokens: s)", "load avg"], dep_rows))
    out.append("\n### Latency per mode (medians and p90 over requests; times in seconds, at the client)\n")
    headers = ["link", "conc", "tokens", "mode", "flow", "n", "TTFT med", "TTFT p90", "TT32T med", "TT32T p90",
               "TT64T med", "TT64T p90", "MB wire", "MB measured", "ideal TTFT", "TTFT/ideal", "limit TTFT",
               "TTFT/limit", "accept", "held/req", "gate stops", "1st on anchor", "=full", "needle"]
    rows = sorted(result.get("rows", []), key=lambda r: (_dep_index(result, r["rate_label"]), r["concurrency"],
                                                          r["nominal_tokens"], _mode_key(r["mode"]),
                                                          r.get("flow") or ""))
    auto = any("chosen" in r for r in rows)
    if auto:
        headers.insert(5, "auto chose (reasons)")
    table = []
    for r in rows:
        cells = [r["rate_label"], r["concurrency"], r["prompt_tokens"], MODE_LABEL.get(r["mode"], r["mode"]),
                 _flow_cell(r),
                 f"{r['n']}{' (' + str(r['errors']) + ' err)' if r['errors'] else ''}",
                 r["ttft_s_median"], r["ttft_s_p90"], r["tt32_s_median"], r["tt32_s_p90"], r["tt64_s_median"],
                 r["tt64_s_p90"], None if r.get("wire_bytes") is None else r["wire_bytes"] / 1e6,
                 None if r.get("wire_bytes_measured") is None else r["wire_bytes_measured"] / 1e6,
                 r["ideal_ttft_s"], r["ttft_vs_ideal"], r.get("limit_ttft_s"), r.get("ttft_vs_limit"),
                 None if r.get("acceptance") is None else f"{r['acceptance']:.1%}",
                 None if r.get("speculated") is None else r["speculated"] / r["n"],
                 None if r.get("stopped_low_margin") is None
                 else f"{r['stopped_low_margin']}+{r.get('first_token_mismatch') or 0}",
                 None if r.get("first_token_on_anchor") is None else f"{r['first_token_on_anchor']}/{r['n']}",
                 None if r.get("output_equal_full") is None else f"{r['output_equal_full']:.0%}",
                 None if r.get("needle_accuracy") is None else f"{r['needle_accuracy']:.0%}"]
        if auto:
            cells.insert(5, _chosen_cell(r))
        table.append(cells)
    out.append(_md_table(headers, table))
    out.append("\nideal TTFT: " + result.get("ideal_model", "") + ". limit TTFT: " + result.get("limit_model", "n/a")
               + ". `=full`: share of requests whose text equals "
               "the full mode's for the same prompt. `needle`: share of answers containing the needle number. `1st on anchor`: "
               "speculative requests whose first token (P's full-precision token, confirmed by D's first anchor-phase "
               "token) was released when the anchor landed. `held/req`: tokens decoded on the anchor and held per "
               "request; `gate stops`: requests whose anchor phase the confidence gate stopped on a low margin + "
               "those whose first anchor token was not P's.\n")
    if auto:
        out.append("`auto chose`: the modes P picked for the auto requests of the row (P's counter "
                   "vllm:lynx_auto_choices over the cell; each request's own choice, from P's log, is in the JSON's "
                   "requests), with the reasons; the row's MB wire, ideal and limit TTFT use each request's chosen "
                   "mode. `flow`: the proxy's flow, and the flow it really used when that differs (the proxy sends "
                   "a P's first request the sequential way, to learn its side channel).\n")
    checks = result.get("checks", [])
    if checks:
        out.append("\n### Targets (issues 5, 6, 15: concurrency 1; issue 16: per cell at concurrency > 1)\n")
        out.append(_md_table(["regime", "metric", "value", "target", "verdict"],
                             [[c["regime"], c["metric"], _check_value(c), f"{c['op']} {c['target']}",
                               _verdict(c)] for c in checks]))
        if any("floor" in c for c in checks):
            out.append("`floor` (speculative TT32T targets): full TTFT / int8 TT32T, the least the ratio can be "
                       "while outputs stay exact (the 32nd token waits for the residual and a verification step, "
                       "as full's first token waits for the same bytes), whatever the anchor and the gate; "
                       "`needs`: tokens each request must hold on the anchor and have accepted to meet the target "
                       "with the residual landing then (one decode step per other token), against those it had.\n")
    return "\n".join(out)


def _verdict(c: dict[str, Any]) -> str:
    """A check's verdict cell; for a speculative TT32T target, what exactness allows in its cell."""
    if c.get("note"):
        return c["note"]
    text = "n/a" if c["pass"] is None else ("PASS" if c["pass"] else "FAIL")
    if "floor" not in c:
        return text
    if c["floor"] > c["target"]:
        return f"{text} (floor {c['floor']:.2f}: unreachable while exact)"
    had = c.get("accepted_per_request")
    needs = c.get("needs_accepted")
    detail = f"floor {c['floor']:.2f}" + ("" if needs is None else f"; needs {needs} accepted/request")
    return f"{text} ({detail}" + ("" if had is None else f", had {had:.1f}") + ")"


def _check_value(c: dict[str, Any]) -> Any:
    """A check's value as the table shows it: two decimals, more (up to four) where two would read as the target
    itself although the value differs from it."""
    v = c["value"]
    if not isinstance(v, float) or v == c["target"] or f"{v:.2f}" != f"{float(c['target']):.2f}":
        return v
    return next((f"{v:.{d}f}" for d in (3, 4) if f"{v:.{d}f}" != f"{float(c['target']):.{d}f}"), f"{v:.4f}")


def _flow_cell(r: dict[str, Any]) -> str:
    flow = r.get("flow", "sequential")
    used = r.get("flow_used")
    if used and set(used) != {flow}:
        return f"{flow} (used: " + ", ".join(f"{f} {n}" for f, n in sorted(used.items())) + ")"
    return flow


def _chosen_cell(r: dict[str, Any]) -> str | None:
    if "chosen" not in r:
        return None
    modes = ", ".join(f"{m} {n}" for m, n in sorted(r["chosen"].items(), key=lambda kv: _mode_key(kv[0])))
    reasons = ", ".join(f"{k} {n}" for k, n in sorted(r.get("chosen_reasons", {}).items()))
    src = "" if r.get("chosen_source") == "p_log" else f"; per request: {r.get('chosen_source')}"
    return f"{modes or 'none seen'} ({reasons}{src})"


def _dep_index(result: dict[str, Any], label: str) -> int:
    for i, d in enumerate(result.get("deployments", [])):
        if d["label"] == label:
            return i
    return 99


def plot_e2e(result: dict[str, Any], path: Path) -> Path | None:
    """TTFT and TT64T vs link rate per mode, concurrency 1, one line per mode for the longest prompt length
    (and concurrency 4 when measured)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result.get("rows", []) if r["link_gbps"] and r["ttft_s_median"] is not None]
    if not rows:
        return None
    panels = []
    conc1 = [r for r in rows if r["concurrency"] == 1]
    if conc1:
        n = max(r["nominal_tokens"] for r in conc1)
        panels.append((f"concurrency 1, {n}-token prompts", [r for r in conc1 if r["nominal_tokens"] == n]))
    multi = [r for r in rows if r["concurrency"] > 1]
    if multi:
        c = max(r["concurrency"] for r in multi)
        panels.append((f"concurrency {c}", [r for r in multi if r["concurrency"] == c]))
    fig, axes = plt.subplots(2, len(panels), figsize=(6.5 * len(panels), 8), squeeze=False)
    for col, (title, prs) in enumerate(panels):
        for row_i, key in enumerate(("ttft_s_median", "tt64_s_median")):
            ax = axes[row_i][col]
            for mode in sorted({r["mode"] for r in prs}, key=_mode_key):
                for flow in sorted({r.get("flow", "sequential") for r in prs}, reverse=True):
                    pts = sorted((r["link_gbps"], r[key]) for r in prs if r["mode"] == mode and r[key] is not None
                                 and r.get("flow", "sequential") == flow)
                    if pts:
                        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                                linestyle="-" if flow == "pipelined" else ":",
                                label=f"{MODE_LABEL.get(mode, mode)} ({flow})")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("link rate (Gbit/s, paced)")
            ax.set_ylabel(("TTFT" if row_i == 0 else "time to 64th token") + " (s, median)")
            ax.set_title(title)
            ax.grid(True, which="both", alpha=0.3)
            if row_i == 0 and col == 0:
                ax.legend(fontsize=8)
    fig.suptitle(f"lynx bench e2e: {result.get('model')} on {result.get('hardware', {}).get('cpu')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# ---- accuracy -------------------------------------------------------------------------------------------------
def accuracy_markdown(result: dict[str, Any]) -> str:
    out = [f"## lynx bench accuracy{' (quick)' if result.get('quick') else ''}\n",
           f"Model {result.get('model')} (fp32 cache, CPU), real P and D engines with LynxConnector, KV over "
           f"NIXL. {result.get('bf16_note', '')}. {result.get('method', '')}\n",
           environment_md(result), ""]
    headers = ["mode", "bits/value", "needle", "needle 95% CI", "ppl", "dNLL vs bf16 (95% CI)",
               "greedy = bf16", "= bf16 95% CI", "agree tokens"]
    table = []
    for m in sorted(result.get("modes", {}), key=_mode_key):
        r = result["modes"][m]
        if not r.get("available", True):
            table.append([MODE_LABEL.get(m, m), "-", f"not available: {r.get('note')}"] + ["-"] * 6)
            continue
        nd = r["needle"]
        ag = r["greedy"]
        ppl = r.get("perplexity") or {}
        dnll = ppl.get("delta_nll_vs_bf16")
        ci = ppl.get("delta_nll_ci95")
        table.append([MODE_LABEL.get(m, m), r["bits_per_value"],
                      f"{nd['correct']}/{nd['n']} ({nd['accuracy']:.0%})", _ci(nd.get("ci95")),
                      ppl.get("ppl"), "-" if dnll is None else f"{dnll:+.4f} ({_ci(ci, 4, pct=False)})",
                      f"{ag['equal']}/{ag['n']}", _ci(ag.get("ci95")),
                      None if ag.get("token_agreement") is None else f"{ag['token_agreement']:.1%}"])
    out.append(_md_table(headers, table))
    out.append("\nneedle: the needle number appears in the answer; ppl: perplexity of the continuation windows "
               "scored on D over the transferred context KV; dNLL: mean per-token NLL difference vs bf16 over "
               "the same tokens (paired); greedy = bf16: generations identical to the bf16 mode's; agree "
               "tokens: mean share of the bf16 generation matched before the first divergence.\n")
    return "\n".join(out)


def _ci(ci: Any, nd: int = 0, pct: bool = True) -> str:
    if not ci or ci[0] is None:
        return "-"
    return f"[{ci[0]:.{nd}%}, {ci[1]:.{nd}%}]" if pct else f"[{ci[0]:+.{nd}f}, {ci[1]:+.{nd}f}]"


def plot_accuracy(result: dict[str, Any], path: Path) -> Path | None:
    """Needle accuracy (Wilson 95% CI) and perplexity against bits per value on the wire, one point per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in sorted(result.get("modes", {}), key=_mode_key) if result["modes"][m].get("available", True)]
    if not modes:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for m in modes:
        r = result["modes"][m]
        x = r["bits_per_value"]
        nd = r["needle"]
        lo, hi = nd.get("ci95") or (nd["accuracy"], nd["accuracy"])
        ax1.errorbar([x], [nd["accuracy"]], yerr=[[nd["accuracy"] - lo], [hi - nd["accuracy"]]], fmt="o",
                     capsize=4, label=MODE_LABEL.get(m, m))
        ax1.annotate(m, (x, nd["accuracy"]), textcoords="offset points", xytext=(5, 5), fontsize=8)
        ppl = (r.get("perplexity") or {}).get("ppl")
        if ppl is not None:
            ax2.plot([x], [ppl], "o")
            ax2.annotate(m, (x, ppl), textcoords="offset points", xytext=(5, 5), fontsize=8)
    ax1.set_xlabel("bits per KV value on the wire")
    ax1.set_ylabel("needle-in-a-haystack accuracy (95% Wilson CI)")
    ax1.set_ylim(-0.05, 1.05)
    ax1.grid(True, alpha=0.3)
    ax1.legend(fontsize=7, loc="lower right")
    ax2.set_xlabel("bits per KV value on the wire")
    ax2.set_ylabel("perplexity of continuations (D, transferred context)")
    ax2.grid(True, alpha=0.3)
    fig.suptitle(f"lynx bench accuracy: {result.get('model')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# ---- outputs --------------------------------------------------------------------------------------------------
def write_outputs(json_path: str | Path, result: dict[str, Any] | None = None) -> list[Path]:
    """``<stem>.md`` and ``<stem>_*.png`` beside ``json_path``; returns the files written."""
    json_path = Path(json_path)
    if result is None:
        result = json.loads(json_path.read_text())
    stem = json_path.with_suffix("")
    written: list[Path] = []
    kind = result.get("bench")
    if kind == "e2e":
        md, plots = e2e_markdown(result), [(plot_e2e, "_ttft_vs_link.png")]
    elif kind == "accuracy":
        md, plots = accuracy_markdown(result), [(plot_accuracy, "_vs_bytes.png")]
    else:
        raise ValueError(f"{json_path}: not an e2e or accuracy result (bench={kind!r})")
    md_path = stem.with_suffix(".md")
    md_path.write_text(md)
    written.append(md_path)
    for fn, suffix in plots:
        png = Path(f"{stem}{suffix}")
        try:
            if fn(result, png) is not None:
                written.append(png)
        except Exception:  # a plot must never lose the measured JSON and table
            logger.exception("plot %s failed", png)
    return written


BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def update_readme(readme: str | Path, json_paths: list[str | Path]) -> None:
    """Replace the text between the results markers of ``readme`` with the tables and plots of the results."""
    readme = Path(readme)
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        raise ValueError(f"{readme} has no {BEGIN} ... {END} section")
    parts = []
    for jp in json_paths:
        jp = Path(jp)
        result = json.loads(jp.read_text())
        md = e2e_markdown(result) if result.get("bench") == "e2e" else accuracy_markdown(result)
        rel = jp.parent.relative_to(readme.parent) if jp.parent.is_relative_to(readme.parent) else jp.parent
        pngs = sorted(jp.parent.glob(f"{jp.stem}_*.png"))
        parts.append(md.replace("## lynx bench", "### lynx bench", 1) + "\n"
                     + "".join(f"![{p.stem}]({rel / p.name})\n" for p in pngs))
    new = text[: text.index(BEGIN) + len(BEGIN)] + "\n" + "\n".join(parts) + "\n" + text[text.index(END):]
    readme.write_text(new)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lynx_connector.lab.bench.report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", nargs="+", help="result JSON files of lynx bench e2e / accuracy")
    p.add_argument("--readme", default=None, help="also put the tables and plots into this README's results "
                   "section (between the results markers)")
    args = p.parse_args(argv)
    for path in args.json:
        for out in write_outputs(path):
            sys.stdout.write(f"{out}\n")
    if args.readme:
        update_readme(args.readme, args.json)
    return 0


__all__ = ["wilson", "e2e_markdown", "accuracy_markdown", "plot_e2e", "plot_accuracy", "write_outputs",
           "format_table"]

if __name__ == "__main__":
    sys.exit(main())
