"""The 1P1D demo (the README's main command): real vLLM prefill and decode servers with the real model on this
CPU, the proxy in front, long-context needle questions over Paul Graham essays, one P/D pair serving every
transfer mode (each request names its mode), the link paced to a rate at which the KV transfer matters.
Prints per mode the answer, TTFT and bytes on the wire, then what Lynx gained. Tears everything down."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lynx_connector.logger import init_logger
from lynx_connector.modes import MODE_NAMES, MODES, get_mode

logger = init_logger(__name__)

#: What the demo compares by default: the 16/8/4-bit baselines against Lynx full and speculative.
DEFAULT_MODES = ("bf16", "int8", "int4", "full", "speculative")
MODE_LABEL = {m.name: m.label + (" (cache dtype, fp32 here)" if m.lossless else "") for m in MODES}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help=f"comma-separated transfer modes, of {', '.join(MODE_NAMES)}")
    p.add_argument("--lengths", default="2000,3500", help="comma-separated context lengths in tokens")
    p.add_argument("--link-gbps", type=float, default=0.05,
                   help="emulated P->D link rate (the transport's pacing); slow enough that the transfer "
                        "matters next to CPU prefill, as a real 10-50 Gbps link does for a GPU prefill")
    p.add_argument("--repeats", type=int, default=1, help="requests per mode and length")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per request")
    p.add_argument("--log-dir", default=None, help="where the server logs go (default: a temporary folder)")
    p.add_argument("--json", dest="json_out", default=None, help="also write the results as JSON here")


def wire_bytes(mode: str, num_tokens: int) -> int:
    """Bytes one request's KV costs on the wire in ``mode`` for the demo model (every layer, both planes)."""
    import torch

    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64 (the modes table: the planes D pulls)
    return 30 * get_mode(mode).wire_nbytes(num_tokens, 3, 64, torch.float32)[1]


def _write(line: str = "") -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from lynx_connector.lab.client import stream_completion
    from lynx_connector.lab.data import build_needle_prompt, needle_found
    from lynx_connector.lab.launch import Deployment
    from lynx_connector.lab.models import prepare

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    model = str(prepare())
    tok = AutoTokenizer.from_pretrained(model)
    prompts = [build_needle_prompt(tok, n, depth=0.4 + 0.2 * i, seed=i + 1) for i, n in enumerate(lengths)]
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="lynx-demo-"))
    # Both servers get the speculative preset (it adds the Lynx scheduler and the null proposer); each
    # request then names its own transfer mode, so one P/D pair serves every scheme of the comparison.
    # (the lossy baselines of the comparison are allowed explicitly: a deployment's default is full precision)
    kv_cfg = json.dumps({"kv_connector": "lynx:speculative",
                         "kv_connector_extra_config": {"link_gbps": args.link_gbps, "allowed_modes": "all"}})
    _write(f"Lynx 1P1D demo: SmolLM2-135M-Instruct (fp32, CPU), link paced to {args.link_gbps} Gbit/s, "
           f"modes {', '.join(modes)}; server logs in {log_dir}")
    _write("Starting prefill, decode and proxy servers (about a minute on 2 cores)...")
    rows: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    with Deployment(model, log_dir, kv_transfer_config=kv_cfg) as dep:
        _write(f"Ready after {time.perf_counter() - t_start:.0f} s: proxy {dep.url}, prefill {dep.prefill.url}, "
               f"decode {dep.decode.url}")
        # Warm-up: the first request of each mode pays one-time costs (each codec's first call on P and D, the
        # NIXL handshake) that are not the transfer's.
        for mode in dict.fromkeys(["full", *modes]):
            stream_completion(dep.url, model, prompts[0].token_ids[:256], max_tokens=2,
                              kv_transfer_params={"lynx_mode": mode})
        _write(f"{'mode':<30} {'context':>7} {'KV on wire':>11} {'TTFT s':>7}  answer")
        for mode in modes:
            for pr in prompts:
                for _ in range(args.repeats):
                    res = stream_completion(dep.url, model, pr.token_ids, max_tokens=args.max_tokens,
                                            kv_transfer_params={"lynx_mode": mode})
                    ok = res.error is None and needle_found(pr.answer, res.text)
                    nbytes = wire_bytes(mode, len(pr.token_ids))
                    rows.append({"mode": mode, "context_tokens": len(pr.token_ids), "wire_bytes": nbytes,
                                 "ttft_s": res.ttft, "total_s": res.total_s, "answer": res.text.strip(),
                                 "expected": pr.answer, "correct": ok, "error": res.error})
                    shown = res.error or repr(res.text.strip()[:40])
                    ttft = f"{res.ttft:7.2f}" if res.ttft is not None else "    n/a"
                    _write(f"{MODE_LABEL.get(mode, mode):<30} {len(pr.token_ids):>7} {nbytes / 1e6:>8.1f} MB "
                           f"{ttft}  {shown} {'(correct)' if ok else '(WRONG: expected ' + pr.answer + ')'}")
    summary = _summarize(rows)
    for line in summary["lines"]:
        _write(line)
    result = {"demo": "1p1d", "link_gbps": args.link_gbps, "rows": rows, "summary": summary["numbers"]}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    return result


def _summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def med(mode: str, key: str) -> float | None:
        vals = [r[key] for r in rows if r["mode"] == mode and r[key] is not None and r["error"] is None]
        return statistics.median(vals) if vals else None

    numbers: dict[str, Any] = {}
    lines = ["", "What Lynx gained (median over the requests above):"]
    full = med("full", "ttft_s")
    for mode in sorted({r["mode"] for r in rows}):
        acc = [r["correct"] for r in rows if r["mode"] == mode]
        wire = [r["wire_bytes"] for r in rows if r["mode"] == mode]
        numbers[mode] = {"ttft_s": med(mode, "ttft_s"), "wire_mb": statistics.median(wire) / 1e6,
                         "accuracy": sum(acc) / len(acc)}
    for base in ("bf16", "int8", "int4"):
        b = med(base, "ttft_s")
        if full and b:
            lines.append(f"  lynx full vs {base}: TTFT {full:.2f} s vs {b:.2f} s ({b / full:.2f}x), "
                         f"wire {numbers['full']['wire_mb']:.1f} MB vs {numbers[base]['wire_mb']:.1f} MB, "
                         f"needles found {numbers['full']['accuracy']:.0%} vs {numbers[base]['accuracy']:.0%}")
    spec = med("speculative", "ttft_s")
    if spec and full:
        same = all(r["answer"] == f["answer"] for r in rows if r["mode"] == "speculative"
                   for f in rows if f["mode"] == "full" and f["context_tokens"] == r["context_tokens"])
        lines.append(f"  lynx speculative vs lynx full: TTFT {spec:.2f} s vs {full:.2f} s ({full / spec:.2f}x), "
                     f"answers {'identical' if same else 'DIFFERENT'} (first token: P's, released on the anchor; the rest verified)")
        for base in ("int8", "bf16"):
            b = med(base, "ttft_s")
            if b:
                lines.append(f"  lynx speculative vs {base}: TTFT {spec:.2f} s vs {b:.2f} s ({b / spec:.2f}x)")
    if any(r["error"] for r in rows):
        lines.append(f"  {sum(1 for r in rows if r['error'])} request(s) failed; see the server logs")
    return {"lines": lines, "numbers": numbers}


def main(argv: list[str] | argparse.Namespace | None = None) -> int:
    """Entry point for ``lynx demo`` (which passes parsed arguments) and ``python -m lynx_connector.lab.demo``."""
    if isinstance(argv, argparse.Namespace):
        args = argv
    else:
        p = argparse.ArgumentParser(prog="lynx demo", description=__doc__)
        add_arguments(p)
        args = p.parse_args(argv)
    try:
        result = run(args)
    except KeyboardInterrupt:
        _write("interrupted; servers stopped")
        return 130
    return 1 if any(r["error"] for r in result["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
