"""What D's idle wait (``idle_wait_s``) does to P's prefill when P and D share a machine, in the pipelined flow.

In the pipelined flow D holds the request from the start and waits for P's layers; vLLM runs an engine step with
nothing to compute in a busy loop meanwhile (each step a round trip through D's engine core and worker, in Python).
With ``idle_wait_s`` > 0, D's worker waits on such a step until a pull lands (at most that long). This runs the same
greedy requests (max_tokens 2: the TTFT of the pair) through one unpinned 1P1D deployment per setting, and P alone,
side by side in one run, and writes JSON and a Markdown table.

    .venv/bin/python benchmarks/idle_wait.py --tokens 800,1600 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def kv_config(idle_wait_s: float) -> str:
    return json.dumps({"kv_connector": "lynx", "kv_connector_extra_config": {
        "idle_wait_s": idle_wait_s, "concurrent_wait_s": 300, "timeout_s": 120}})


def run_setting(model: str, idle_wait_s: float, prompts: dict[int, list[list[int]]], logs: Path) -> dict:
    from lynx_connector.lab.client import stream_completion
    from lynx_connector.lab.launch import Deployment

    rows: dict[str, dict[int, list[float]]] = {"pipelined": {}, "p_alone": {}}
    with Deployment(model, logs / f"idle_{idle_wait_s:g}", kv_transfer_config=kv_config(idle_wait_s),
                    proxy_args=["--flow", "pipelined"]) as dep:
        warm = stream_completion(dep.url, model, prompts[min(prompts)][0][:64], max_tokens=2)  # proxy learns P
        if warm.error:
            raise RuntimeError(f"warm-up failed: {warm.error}")
        for n, items in prompts.items():
            for ids in items:
                for flow, url in (("pipelined", dep.url), ("p_alone", dep.prefill.url)):
                    res = stream_completion(url, model, ids, max_tokens=2, timeout=600,
                                            kv_transfer_params={"lynx_mode": "full"} if flow == "pipelined" else None)
                    if res.error or res.ttft is None:
                        raise RuntimeError(f"{flow} request of {n} tokens failed: {res.error}")
                    rows[flow].setdefault(n, []).append(res.ttft)
                    print(f"idle_wait_s={idle_wait_s:g} {flow:9s} {n:5d} tokens: TTFT {res.ttft:6.2f} s",
                          file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model dir (default: the prepared SmolLM2)")
    ap.add_argument("--tokens", default="800,1600", help="prompt lengths, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--settings", default="0,0.02", help="idle_wait_s values, comma-separated")
    ap.add_argument("--out", default=str(RESULTS / "idle_wait"))
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from lynx_connector.lab.data import build_summary_prompt
    from lynx_connector.lab.models import model_dir

    model = args.model or str(model_dir())
    tok = AutoTokenizer.from_pretrained(model)
    lengths = [int(x) for x in args.tokens.split(",")]
    prompts = {n: [build_summary_prompt(tok, n, seed=31 * i + n).token_ids for i in range(args.repeats)]
               for n in lengths}
    logs = Path(tempfile.mkdtemp(prefix="lynx-idle-wait-"))  # the servers' logs, outside the checkout
    print(f"server logs: {logs}", file=sys.stderr)
    results = {}
    for s in (float(x) for x in args.settings.split(",")):
        results[s] = run_setting(model, s, prompts, logs)
    out = {"what": "TTFT (s) of greedy max_tokens=2 requests, pipelined flow through lynx proxy vs P alone, "
                   "P and D unpinned on one machine", "when": time.strftime("%Y-%m-%d %H:%M"),
           "rows": [{"idle_wait_s": s, "prompt_tokens": n, "flow": flow, "ttft_s": v,
                     "median_s": statistics.median(v)}
                    for s, rows in results.items() for flow, by_n in rows.items() for n, v in by_n.items()]}
    Path(args.out + ".json").write_text(json.dumps(out, indent=1) + "\n")
    lines = ["| prompt tokens | idle_wait_s | P alone TTFT (s) | pipelined TTFT (s) | pipelined / P alone |",
             "|---:|---:|---:|---:|---:|"]
    for s, rows in results.items():
        for n in lengths:
            p, pl = statistics.median(rows["p_alone"][n]), statistics.median(rows["pipelined"][n])
            lines.append(f"| {n} | {s:g} | {p:.2f} | {pl:.2f} | {pl / p:.2f} |")
    table = "\n".join(lines)
    Path(args.out + ".md").write_text(f"# D's idle wait and P's prefill (medians of {args.repeats})\n\n"
                                      f"{out['what']}; {out['when']}.\n\n{table}\n")
    sys.stdout.write(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
