"""Where a pipelined request's time goes: P, D and the proxy's LYNX_TRACE lines (lynx_connector/trace.py), lined
up per request from the moment the proxy sent it to P and D.

Run a bench with the trace on, then read it:

    LYNX_TRACE=/tmp/lynx-trace.jsonl .venv/bin/lynx bench e2e --ratios 0.5 --concurrency 1 --flow pipelined \\
        --modes bf16,int8,full,speculative --out /tmp/e2e_trace.json
    .venv/bin/python benchmarks/timeline.py /tmp/lynx-trace.jsonl --out benchmarks/results/timeline.json

Per mode, the median over its requests of each event's offset (seconds after the proxy's ``start``), in the order
they happen; the table's last columns are the gaps that make up TTFT after P's last layer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

#: (who, event) in the order a pipelined request meets them; the column names of the table.
EVENTS = [
    ("proxy", "start"), ("D", "pull"), ("P", "first_layer_encoded"), ("P", "published"),
    ("D", "all_published_seen"), ("D", "anchor_landed"), ("D", "written_anchor"), ("D", "residual_landed"),
    ("D", "written_full"), ("P", "first_token_announced"), ("proxy", "d_first_bytes"), ("proxy", "p_answered"),
    ("proxy", "gate_open"),
]


def load(path: Path, min_prefill_s: float = 0.0) -> dict[str, dict[str, float]]:
    """Per trace key (transfer id), the first time of each ``who.ev``, with the mode from the proxy's start;
    requests P published sooner than ``min_prefill_s`` after the start (a bench's short warm-up prompts) are left
    out."""
    reqs: dict[str, dict[str, float]] = defaultdict(dict)
    modes: dict[str, str] = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        name = f"{rec['who']}.{rec['ev']}"
        reqs[rec["key"]].setdefault(name, rec["t"])
        if name == "proxy.start":
            modes[rec["key"]] = rec.get("mode", "?")
    out = {}
    for key, evs in reqs.items():
        if "proxy.start" in evs and evs.get("P.published", float("inf")) - evs["proxy.start"] >= min_prefill_s:
            t0 = evs["proxy.start"]
            out[key] = {"mode": modes[key], **{k: v - t0 for k, v in evs.items()}}
    return out


def summarize(reqs: dict[str, dict]) -> dict[str, dict[str, float]]:
    by_mode: dict[str, list[dict]] = defaultdict(list)
    for r in reqs.values():
        by_mode[r["mode"]].append(r)
    table = {}
    for mode, rs in sorted(by_mode.items()):
        row: dict[str, float] = {"n": len(rs)}
        for who, ev in EVENTS:
            vals = [r[f"{who}.{ev}"] for r in rs if f"{who}.{ev}" in r]
            if vals:
                row[f"{who}.{ev}"] = statistics.median(vals)
        table[mode] = row
    return table


def markdown(table: dict[str, dict[str, float]]) -> str:
    cols = [f"{w}.{e}" for w, e in EVENTS if any(f"{w}.{e}" in row for row in table.values())]
    lines = ["| mode | n | " + " | ".join(cols) + " |", "| --- | ---: |" + " ---: |" * len(cols)]
    for mode, row in table.items():
        cells = [f"{row[c]:.3f}" if c in row else "-" for c in cols]
        lines.append(f"| {mode} | {int(row['n'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", type=Path, help="the LYNX_TRACE file")
    ap.add_argument("--min-prefill-s", type=float, default=0.0,
                    help="leave out requests P published sooner than this after the start (warm-ups)")
    ap.add_argument("--out", type=Path, help="write the per-mode medians and every request's events here (JSON)")
    args = ap.parse_args(argv)
    reqs = load(args.trace, args.min_prefill_s)
    if not reqs:
        print(f"no pipelined request in {args.trace} (no proxy 'start' line)", file=sys.stderr)
        return 1
    table = summarize(reqs)
    print(f"seconds after the proxy sent each request to P and D (medians per mode; {len(reqs)} requests)\n")
    print(markdown(table))
    if args.out:
        args.out.write_text(json.dumps({"medians": table, "requests": reqs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
