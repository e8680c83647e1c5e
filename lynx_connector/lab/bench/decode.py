"""``lynx bench decode``: a decode instance's throughput for plain (non-Lynx) requests, plain vLLM against the
Lynx configurations of D (issue 16.4: the speculative scheduler forces synchronous scheduling and the
spec-decode path on the whole instance; target >= 0.98x plain vLLM).

One server per configuration (``lynx serve`` of the real model: ``vllm`` = no KV connector, ``lynx`` = the
connector in its default mode, ``lynx:speculative`` = the connector with the Lynx speculative scheduler and its
null proposer), all up at once, their compute threads on the same cores (``--cpus``, default D's core of the e2e
bench), each with the same KV cache size. By default each server's whole process tree is pinned there too; with
``--server-cpus ''`` only the compute threads are, so the engine core can schedule the next step on another core
while the worker computes, as a GPU host's CPU does: what vLLM's async scheduling (which the speculative
scheduler turns off) needs to gain anything. They are measured in interleaved rounds: each round runs every
(configuration, batch) once, the configurations' order rotated from round to round, so that a change in the
machine's load hits them alike; only the server being measured has work.

A measurement: ``batch`` plain requests (no ``kv_transfer_params``: D computes them itself, as it does any
request that is not a Lynx transfer) sent at once, straight to the server, each a different local prompt of
``--prompt-tokens`` tokens, ``--max-tokens`` greedy tokens with EOS ignored, streamed. Decode throughput = the
sum over the batch's requests of (tokens - 1) / (last token's time - first token's time): tokens per second
once the prompts are computed. Per configuration and batch: the median over rounds; the ratio to ``vllm`` is
the median of the per-round ratios (each round's measurements are next to each other in time).

    lynx bench decode --out benchmarks/results/decode.json
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lynx_connector.lab.bench import common
from lynx_connector.logger import init_logger

logger = init_logger(__name__)

#: configuration name -> the server's --kv-transfer-config (None: plain vLLM, no connector)
CONFIGS: dict[str, str | None] = {"vllm": None, "lynx": "lynx", "lynx:speculative": "lynx:speculative"}
BASELINE = "vllm"
TARGET_RATIO = 0.98
KV_CACHE_BYTES = 1 << 30  # every server the same cache (enough for 8 x (prompt + max tokens))
START_TIMEOUT_S = 600.0


def batch_throughput(token_times: list[list[float]]) -> float | None:
    """Decode tokens/s of a batch: the sum over its requests of (tokens - 1) / (last - first token time);
    None when a request has fewer than two tokens."""
    total = 0.0
    for times in token_times:
        if len(times) < 2 or times[-1] <= times[0]:
            return None
        total += (len(times) - 1) / (times[-1] - times[0])
    return total


def step_times(token_times: list[list[float]]) -> list[float]:
    """Gaps between a request's successive distinct token arrivals (the decode step as the client sees it)."""
    out: list[float] = []
    for times in token_times:
        distinct = sorted(set(times))
        out += [b - a for a, b in zip(distinct, distinct[1:], strict=False)]
    return out


def rotated(names: list[str], round_i: int) -> list[str]:
    k = round_i % len(names)
    return names[k:] + names[:k]


def summarize(measurements: list[dict[str, Any]], configs: list[str], batches: list[int]) -> list[dict[str, Any]]:
    """One row per (configuration, batch): median tokens/s over rounds, median step, and the ratio to the
    baseline (median of per-round ratios)."""
    rows = []
    for b in batches:
        base = {m["round"]: m["tokens_per_s"] for m in measurements
                if m["config"] == BASELINE and m["batch"] == b and m["tokens_per_s"]}
        for c in configs:
            ms = [m for m in measurements if m["config"] == c and m["batch"] == b]
            tps = [m["tokens_per_s"] for m in ms if m["tokens_per_s"]]
            ratios = [m["tokens_per_s"] / base[m["round"]] for m in ms if m["tokens_per_s"] and m["round"] in base]
            steps = [s for m in ms for s in m["step_s"]]
            rows.append({"config": c, "batch": b, "rounds": len(ms), "errors": sum(m["errors"] for m in ms),
                         "tokens_per_s_median": statistics.median(tps) if tps else None,
                         "tokens_per_s_min": min(tps) if tps else None, "tokens_per_s_max": max(tps) if tps else None,
                         "step_ms_median": 1e3 * statistics.median(steps) if steps else None,
                         "ratio_vs_vllm": statistics.median(ratios) if ratios and c != BASELINE else None,
                         "per_round_ratios": ratios if c != BASELINE else None})
    return rows


def checks(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        if r["config"] == BASELINE:
            continue
        v = r["ratio_vs_vllm"]
        out.append({"config": r["config"], "batch": r["batch"], "metric": f"{r['config']} / vllm decode tokens/s",
                    "value": v, "op": ">=", "target": TARGET_RATIO, "pass": None if v is None else v >= TARGET_RATIO})
    return out


def markdown(result: dict[str, Any]) -> str:
    from lynx_connector.lab.bench import report

    cfg = result["config"]
    out = ["## lynx bench decode\n",
           f"Model {result.get('model')} (fp32, CPU), one `lynx serve` per configuration, compute threads on cores "
           f"{cfg['cpus']}, the servers' processes on {cfg.get('server_cpus', cfg['cpus'])}, "
           f"plain requests straight to the server: {cfg['prompt_tokens']}-token prompts, {cfg['max_tokens']} greedy "
           f"tokens (EOS ignored), {cfg['rounds']} interleaved rounds. Decode tokens/s = sum over the batch of "
           "(tokens - 1) / (last - first token time); ratio = median of the per-round ratios to `vllm`.\n",
           report.environment_md(result),
           "| config | batch | rounds | tokens/s (median) | min | max | step ms (median) | / vllm | per round |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def f(x: Any, nd: int = 2) -> str:
        return "n/a" if x is None else f"{x:.{nd}f}"

    for r in result["rows"]:
        per = "" if not r["per_round_ratios"] else ", ".join(f"{x:.3f}" for x in r["per_round_ratios"])
        out.append(f"| {r['config']} | {r['batch']} | {r['rounds']}{' (' + str(r['errors']) + ' err)' if r['errors'] else ''} "
                   f"| {f(r['tokens_per_s_median'], 1)} | {f(r['tokens_per_s_min'], 1)} | {f(r['tokens_per_s_max'], 1)} "
                   f"| {f(r['step_ms_median'])} | {f(r['ratio_vs_vllm'], 3)} | {per} |")
    out += ["", "### Target (issue 16.4): D's decode throughput >= 0.98x plain vLLM for non-Lynx requests\n",
            "| config | batch | value | target | verdict |", "| --- | --- | --- | --- | --- |"]
    for c in result["checks"]:
        verdict = "n/a" if c["pass"] is None else "PASS" if c["pass"] else "FAIL"
        out.append(f"| {c['config']} | {c['batch']} | {f(c['value'], 3)} | >= {c['target']} | {verdict} |")
    return "\n".join(out) + "\n"


def server_argv(name: str, model: str, port: int, max_model_len: int, extra: list[str] | None = None) -> list[str]:
    """``lynx serve`` of configuration ``name``: the lab's server arguments (as the e2e bench's D), its
    ``--kv-transfer-config`` (none for plain vLLM), the common KV cache size, then ``extra`` (e.g. a GPU's)."""
    from lynx_connector.lab.launch import serve_argv

    argv = serve_argv(model, port, "lynx", max_model_len=max_model_len,
                      extra=["--kv-cache-memory-bytes", str(KV_CACHE_BYTES), *(extra or [])])
    i = argv.index("--kv-transfer-config")
    if CONFIGS[name] is None:
        del argv[i:i + 2]
    else:
        argv[i + 1] = CONFIGS[name]
    return argv


def _start(names: list[str], model: str, log_dir: Path, cpus: str, tree_cpus: str, max_model_len: int,
           extra: list[str]) -> dict[str, Any]:
    import secrets

    from lynx_connector.lab.launch import SERVER_ENV, Server, cpu_set, free_port

    key = secrets.token_hex(32)  # the connector's side channel needs a deployment key (no peer here)
    servers = {}
    for name in names:
        port = free_port()
        argv = server_argv(name, model, port, max_model_len, extra)
        s = Server(name.replace(":", "-"), argv, port, log_dir / f"{name.replace(':', '-')}.log",
                   env={**SERVER_ENV, "VLLM_CPU_OMP_THREADS_BIND": cpus, "LYNX_SIDE_CHANNEL_KEY": key},
                   cpus=cpu_set(tree_cpus) if tree_cpus else None)
        s.start()
        servers[name] = s
    return servers


def _wait_healthy(servers: dict[str, Any], timeout: float) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    pending = dict(servers)
    while pending:
        for name, s in list(pending.items()):
            _raise_if_exited({name: s}, "during start-up")
            try:
                with urllib.request.urlopen(s.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        del pending[name]
            except OSError:
                pass
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"servers {sorted(pending)} not healthy after {timeout:.0f} s")
        time.sleep(1.0)


def _raise_if_exited(servers: dict[str, Any], during: str) -> None:
    """A server whose process exited voids the measurements: its name, code and log tail, not a table of n/a."""
    for name, s in servers.items():
        if s.proc is not None and s.proc.poll() is not None:
            raise RuntimeError(f"server {name} exited with code {s.proc.returncode} {during}; its log "
                               f"{s.log_path}:\n{s.log_tail(15)}")


def _measure(url: str, model: str, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[float]], int]:
    from lynx_connector.lab.client import stream_completion

    def one(ids: list[int]) -> Any:
        return stream_completion(url, model, ids, max_tokens=max_tokens, timeout=300.0, extra={"ignore_eos": True})

    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        res = list(pool.map(one, prompts))
    errors = sum(1 for r in res if r.error or len(r.token_times) < max_tokens)
    for r in res:
        if r.error:
            logger.warning("request failed on %s: %s", url, r.error[:300])
    return [r.token_times for r in res], errors


def run(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    from transformers import AutoTokenizer

    from lynx_connector.lab.data import build_summary_prompt
    from lynx_connector.lab.models import prepare

    env = common.environment_info()
    t0 = time.perf_counter()
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if BASELINE not in configs or any(c not in CONFIGS for c in configs):
        raise SystemExit(f"--configs: a comma list of {', '.join(CONFIGS)} that includes {BASELINE}")
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    if not batches or min(batches) < 1 or max(batches) > 8:
        raise SystemExit("--batches: comma list of batch sizes from 1 to 8 (the servers' --max-num-seqs)")
    model = args.model or str(prepare())
    tok = AutoTokenizer.from_pretrained(model)
    prompts = [build_summary_prompt(tok, args.prompt_tokens, seed=101 + i).token_ids for i in range(max(batches))]
    max_len = args.prompt_tokens + args.max_tokens + 256
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="lynx-bench-decode-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    sys.stdout.write(f"lynx bench decode: {configs} on cores {args.cpus}, batches {batches}, {args.rounds} rounds; "
                     f"logs in {log_dir}\n")
    tree_cpus = args.cpus if args.server_cpus is None else args.server_cpus
    extra = shlex.split(args.serve_args or "")
    servers = _start(configs, model, log_dir, args.cpus, tree_cpus, max_len, extra)
    measurements: list[dict[str, Any]] = []
    try:
        _wait_healthy(servers, START_TIMEOUT_S)
        for s in servers.values():  # first requests pay one-time costs
            _measure(s.url, model, prompts[:max(batches)], 8)
        total, done = args.rounds * len(configs) * len(batches), 0
        for rnd in range(args.rounds):
            for name in rotated(configs, rnd):
                for b in batches:
                    times, errors = _measure(servers[name].url, model, prompts[:b], args.max_tokens)
                    if errors:
                        _raise_if_exited(servers, f"in round {rnd}, {name} batch {b}: no results are written")
                    tps = None if errors else batch_throughput(times)
                    measurements.append({"round": rnd, "config": name, "batch": b, "tokens_per_s": tps,
                                         "step_s": step_times(times), "errors": errors, "loadavg": common.loadavg()})
                    done += 1
                    sys.stdout.write(f"[{done}/{total} {time.perf_counter() - t0:5.0f}s] round {rnd} {name:<17} "
                                     f"batch {b}: {'n/a' if tps is None else f'{tps:.1f}'} tokens/s\n")
                    sys.stdout.flush()
    finally:
        for s in servers.values():
            s.stop()
    rows = summarize(measurements, configs, batches)
    result: dict[str, Any] = {
        "bench": "decode", "model": Path(model).name,
        "config": {"configs": {c: CONFIGS[c] for c in configs}, "batches": batches, "rounds": args.rounds,
                   "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "cpus": args.cpus,
                   "server_cpus": tree_cpus or "unpinned", "serve_args": extra,
                   "kv_cache_bytes": KV_CACHE_BYTES, "ignore_eos": True, "temperature": 0.0},
        "method": __doc__.split("\n\n")[1:4],
        "rows": rows, "measurements": measurements, "checks": [], "logs": str(log_dir)}
    result["checks"] = checks(rows)
    result["wall_s"] = time.perf_counter() - t0
    common.record_environment(result, env)
    md = markdown(result)
    sys.stdout.write("\n" + md)
    if args.out:
        common.write_json(args.out, result)
        Path(args.out).with_suffix(".md").write_text(md)
    return result


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("decode", help="D's decode tokens/s for plain requests: vLLM vs Lynx configurations",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {', '.join(CONFIGS)} "
                   f"(must include {BASELINE}; default all)")
    p.add_argument("--batches", default="1,8", help="comma list of batch sizes, 1..8 (default 1,8)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--prompt-tokens", type=int, default=128, help="prompt length (default 128)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per request (default 128)")
    p.add_argument("--cpus", default="1", help="VLLM_CPU_OMP_THREADS_BIND of every server, and the cores the "
                   "servers are pinned to (default 1: D's core in lynx bench e2e)")
    p.add_argument("--server-cpus", default=None, help="cores of each server's whole process tree (API server, "
                   "engine core, worker); default: --cpus. '' = unpinned: the engine core schedules on another "
                   "core while the worker computes, as a GPU host's CPU does (async scheduling can overlap)")
    p.add_argument("--serve-args", default=None, help="extra lynx serve arguments of every server, after the "
                   "lab's CPU defaults (later values win), e.g. a GPU's \"--dtype bfloat16 --gpu-memory-utilization "
                   "0.2\"")
    p.add_argument("--model", default=None, help="model folder (default: the lab model)")
    p.add_argument("--log-dir", default=None)
    p.add_argument("--out", default=None, help="write JSON here (and .md beside it)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lynx_connector.lab.bench.decode")
    sub = parser.add_subparsers(dest="bench", required=True)
    add_parser(sub)
    run(parser.parse_args(["decode", *(argv if argv is not None else sys.argv[1:])]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
