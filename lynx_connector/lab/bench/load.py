"""``lynx bench load``: does a real 1P1D deployment serve every request under load, and is it idle afterwards?

Phases, each followed by a check that P, D and the proxy are back at idle:

* **burst** (closed loop): N requests sent at once (``--bursts 32,64``), each waited for;
* **soak** (open loop): requests arriving at a fixed rate (``--rate``, per second) for ``--duration`` seconds,
  whatever the deployment's state, so a slowdown shows as queueing, not as a lower offered load.

Requests mix transfer modes (``--modes``, round-robin) and prompt lengths (``--words``: essay excerpts of
uniformly drawn length); each streams ``--max-tokens`` tokens through ``lynx proxy``. Recorded per request:
status, error, TTFT and end-to-end latency (at the client). Sampled once a second: P's and D's vLLM gauges
(running, waiting, KV cache usage), the process-tree memory of each server, each worker's transport counters
(``status_dir`` files: staging bytes and requests, pulls in flight, requests waiting for staging) and the
proxy's admission state (requests in flight and queued). Output: JSON, a Markdown table and a PNG of latency
and queue depth over time (``--out``); progress on stderr while it runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lynx_connector.lab.bench.e2e.measure import write
from lynx_connector.lab.bench.e2e.plan import quantile
from lynx_connector.logger import init_logger
from lynx_connector.transport.status import writer_alive

logger = init_logger(__name__)

DEFAULT_MODES = ("full", "speculative", "int8", "bf16")
GAUGES = {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
          "kv_usage": "vllm:kv_cache_usage_perc"}
IDLE_TIMEOUT_S = 90.0


# ---- what the servers say -------------------------------------------------------------------------------------
def scrape_gauges(base_url: str) -> dict[str, float]:
    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=5) as resp:
            text = resp.read().decode("utf-8", "replace")
    except OSError:
        return {}
    out = dict.fromkeys(GAUGES, 0.0)
    for line in text.splitlines():
        for key, name in GAUGES.items():
            if line.startswith(name + "{") or line.startswith(name + " "):
                try:
                    out[key] += float(line.rsplit(" ", 1)[1])
                except ValueError:
                    pass
    return out


def tree_rss_mb(pid: int) -> float:
    """Resident memory of a server's process group (API server, engine core, worker), MB."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[2]) != pid:  # process group id
                continue
            with open(f"/proc/{entry}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            continue
    return total / 1e6


def read_status(status_dir: Path) -> dict[str, float]:
    """Sum of the workers' transport counters (status files) by side: P = sources, D = sinks. Files left by a
    worker that no longer runs (a P killed and restarted leaves its last one) are skipped."""
    out = {"p_staged_requests": 0.0, "p_staging_mb": 0.0, "p_save_waiting": 0.0, "d_pulls_live": 0.0,
           "d_staging_regions": 0.0, "d_recv_waiting": 0.0, "d_resent": 0.0, "d_reconnects": 0.0}
    for path in status_dir.glob("*.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not writer_alive(data):
            continue
        if "source" in data:  # a worker's source file (its sink file carries the same worker counters)
            src = data["source"]
            out["p_save_waiting"] += data.get("save_waiting", 0)
            out["p_staged_requests"] += src["requests_live"]
            out["p_staging_mb"] += src["bytes_allocated"] / 1e6
        if "sink" in data:
            sink = data["sink"]
            out["d_pulls_live"] += sink["pulls_live"]
            out["d_staging_regions"] += sink["regions_live"]
            out["d_resent"] += sink.get("resent", 0)
            out["d_reconnects"] += sink.get("reconnects", 0)
            out["d_recv_waiting"] += data.get("recv_waiting", 0)
    return out


def read_proxy(url: str) -> dict[str, float]:
    try:
        with urllib.request.urlopen(url + "/lynx/stats", timeout=5) as resp:
            st = json.load(resp)
    except (OSError, ValueError):
        return {}
    return {"proxy_queued": st["decode"]["queued"] + st["prefill"]["queued"],
            "proxy_inflight": sum(st["decode"]["inflight"].values())}


class Sampler:
    """Samples every second until stopped; ``snapshot()`` is one sample now."""

    def __init__(self, dep: Any, status_dir: Path, t0: float) -> None:
        self.dep, self.status_dir, self.t0 = dep, status_dir, t0
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load-sampler", daemon=True)

    def snapshot(self) -> dict[str, Any]:
        s: dict[str, Any] = {"t": round(time.monotonic() - self.t0, 2)}
        for side, server in (("p", self.dep.prefill), ("d", self.dep.decode)):
            for k, v in scrape_gauges(server.url).items():
                s[f"{side}_{k}"] = v
            if server.proc is not None:
                s[f"{side}_rss_mb"] = round(tree_rss_mb(server.proc.pid), 1)
        s.update(read_status(self.status_dir))
        s.update(read_proxy(self.dep.url))
        return s

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self.samples.append(self.snapshot())

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(5)


IDLE_KEYS = ("p_running", "p_waiting", "d_running", "d_waiting", "p_staged_requests", "p_save_waiting",
             "d_pulls_live", "d_staging_regions", "d_recv_waiting", "proxy_queued", "proxy_inflight")


def wait_idle(sampler: Sampler, timeout: float = IDLE_TIMEOUT_S) -> dict[str, Any]:
    """The first sample with every queue and counter at zero (or the last one after ``timeout``)."""
    end = time.monotonic() + timeout
    while True:
        snap = sampler.snapshot()
        # a reading that failed (P, D or the proxy unreachable) is not idle: every key must be there and zero
        snap["idle"] = all(k in snap and not snap[k] for k in IDLE_KEYS)
        if snap["idle"] or time.monotonic() > end:
            return snap
        time.sleep(1.0)


# ---- requests ---------------------------------------------------------------------------------------------------
def make_prompts(n: int, words_range: tuple[int, int], seed: int) -> list[str]:
    from lynx_connector.lab.data import load_essays

    words = load_essays().split()
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randint(*words_range)
        start = rng.randint(0, len(words) - k - 1)
        out.append("Summarize the following text.\n\n" + " ".join(words[start:start + k]) + "\n\nSummary:")
    return out


def one_request(url: str, model: str, prompt: str, mode: str, max_tokens: int, t0: float, phase: str,
                timeout: float) -> dict[str, Any]:
    from lynx_connector.lab.client import stream_completion

    start = time.monotonic() - t0
    res = stream_completion(url, model, prompt, max_tokens=max_tokens, kv_transfer_params={"lynx_mode": mode},
                            timeout=timeout, extra={"ignore_eos": True})
    ok = res.error is None and len(res.token_times) == max_tokens
    return {"phase": phase, "mode": mode, "words": len(prompt.split()), "start_s": round(start, 3),
            "ok": ok, "error": res.error if not ok else None, "ttft_s": res.ttft, "e2e_s": round(res.total_s, 3),
            "tokens": len(res.token_times)}


def run_burst(url: str, model: str, prompts: list[str], modes: list[str], args: argparse.Namespace, t0: float,
              label: str) -> list[dict[str, Any]]:
    done: list[dict[str, Any]] = []
    with ThreadPoolExecutor(len(prompts)) as pool:
        futs = [pool.submit(one_request, url, model, p, modes[i % len(modes)], args.max_tokens, t0, label,
                            args.request_timeout) for i, p in enumerate(prompts)]
        for f in futs:
            done.append(f.result())
            if len(done) % 8 == 0 or len(done) == len(futs):
                write(f"[load] {label}: {len(done)}/{len(futs)} answered, "
                      f"{sum(not r['ok'] for r in done)} failed")
    return done


def run_soak(url: str, model: str, prompts: list[str], modes: list[str], args: argparse.Namespace,
             t0: float) -> list[dict[str, Any]]:
    futs = []
    interval = 1.0 / args.rate
    begin = time.monotonic()
    with ThreadPoolExecutor(max(4, int(args.rate * args.request_timeout) + 1)) as pool:
        i = 0
        while time.monotonic() - begin < args.duration:
            due = begin + i * interval
            time.sleep(max(0.0, due - time.monotonic()))
            futs.append(pool.submit(one_request, url, model, prompts[i % len(prompts)], modes[i % len(modes)],
                                    args.max_tokens, t0, "soak", args.request_timeout))
            i += 1
            if i % 30 == 0:
                finished = [f.result() for f in futs if f.done()]
                write(f"[load] soak: {i} sent in {time.monotonic() - begin:.0f}/{args.duration:.0f}s, "
                      f"{len(finished)} answered, {sum(not r['ok'] for r in finished)} failed")
        return [f.result() for f in futs]


# ---- summary ----------------------------------------------------------------------------------------------------
def summarize(phase: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    ttft = [r["ttft_s"] for r in rows if r["ok"] and r["ttft_s"] is not None]
    e2e = [r["e2e_s"] for r in rows if r["ok"]]
    return {"phase": phase, "requests": len(rows), "answered": sum(r["ok"] for r in rows),
            "success_rate": sum(r["ok"] for r in rows) / len(rows) if rows else None,
            "ttft_p50_s": quantile(ttft, 0.5), "ttft_p99_s": quantile(ttft, 0.99),
            "e2e_p50_s": quantile(e2e, 0.5), "e2e_p99_s": quantile(e2e, 0.99),
            "e2e_max_s": max(e2e) if e2e else None,
            "errors": sorted({(r["error"] or "")[:160] for r in rows if not r["ok"]})}


def markdown(result: dict[str, Any]) -> str:
    lines = ["| phase | requests | answered | success | TTFT p50 / p99 s | e2e p50 / p99 / max s | idle after |",
             "| --- | --- | --- | --- | --- | --- | --- |"]

    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    for s in result["phases"]:
        idle = result["idle_after"][s["phase"]]
        pct = 100 * (s["success_rate"] or 0)  # never shown as 100% with a request unanswered
        rate = f"{pct:.1f}%" if s["answered"] == s["requests"] or pct < 99.9 else f"{math.floor(pct * 1000) / 1000:.3f}%"
        lines.append(f"| {s['phase']} | {s['requests']} | {s['answered']} | {rate} | "
                     f"{f(s['ttft_p50_s'])} / {f(s['ttft_p99_s'])} | {f(s['e2e_p50_s'])} / {f(s['e2e_p99_s'])} / "
                     f"{f(s['e2e_max_s'])} | {'yes' if idle['idle'] else 'NO: ' + str(idle)} |")
    cfg = result["config"]
    lines += ["", f"Deployment: `{cfg['kv_transfer_config']}`, proxy `{' '.join(cfg['proxy_args'])}`, "
              f"modes {', '.join(cfg['modes'])}, {cfg['words'][0]}-{cfg['words'][1]} words, "
              f"{cfg['max_tokens']} tokens each."]
    last = result["samples"][-1] if result["samples"] else {}
    lines.append(f"Side channel over the whole run: D re-sent {last.get('d_resent', 0):.0f} unanswered messages and "
                 f"reconnected {last.get('d_reconnects', 0):.0f} times.")
    mem = result.get("memory_mb", {})
    if mem:
        lines.append(f"Server memory (process trees, MB): P {mem.get('p_first')} -> {mem.get('p_last')}, "
                     f"D {mem.get('d_first')} -> {mem.get('d_last')} (first and last sample).")
    if result.get("server_exited"):
        lines.append(f"**A server exited; the phases after it were not run:** "
                     f"{result['server_exited'].splitlines()[0]}")
    for s in result["phases"]:
        for e in s["errors"]:
            lines.append(f"- {s['phase']} error: `{e}`")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for phase in sorted({r["phase"] for r in result["requests"]}):
        rows = [r for r in result["requests"] if r["phase"] == phase]
        ok = [r for r in rows if r["ok"]]
        ax1.scatter([r["start_s"] + r["e2e_s"] for r in ok], [r["e2e_s"] for r in ok], s=8, label=f"{phase} e2e")
        ax1.scatter([r["start_s"] + (r["ttft_s"] or 0) for r in ok], [r["ttft_s"] for r in ok], s=8, marker="x",
                    label=f"{phase} TTFT")
        bad = [r for r in rows if not r["ok"]]
        if bad:
            ax1.scatter([r["start_s"] + r["e2e_s"] for r in bad], [r["e2e_s"] for r in bad], s=30, c="red",
                        marker="v", label=f"{phase} failed")
    ax1.set_ylabel("latency at the client (s)")
    ax1.legend(fontsize=7, ncol=3)
    ts = [s["t"] for s in result["samples"]]
    for key, label in (("proxy_queued", "queued in the proxy"), ("d_waiting", "D waiting (vLLM)"),
                       ("d_running", "D running"), ("p_staged_requests", "P staged requests"),
                       ("d_pulls_live", "D pulls in flight")):
        ax2.plot(ts, [s.get(key, 0) for s in result["samples"]], label=label)
    ax2.set_xlabel("time since the first request (s)")
    ax2.set_ylabel("requests")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- the run ----------------------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    from lynx_connector.lab.bench.common import environment_info, record_environment, write_json
    from lynx_connector.lab.launch import Deployment
    from lynx_connector.lab.models import model_dir

    model = args.model or str(model_dir())
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    lo, hi = (int(x) for x in args.words.split("-"))
    bursts = [int(x) for x in args.bursts.split(",") if x.strip()] if args.bursts else []
    env0 = environment_info()
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="lynx-load-"))
    status_dir = log_dir / "status"
    extra = {"status_dir": str(status_dir), "allowed_modes": "all"}  # the lossy modes of --modes too
    if args.staging_mb:
        extra["staging_mb"] = args.staging_mb
    kv_cfg = json.dumps({"kv_connector": "lynx:speculative", "kv_load_failure_policy": "fail",
                         "kv_connector_extra_config": extra})
    proxy_args = ["--max-inflight", str(args.max_inflight)]
    serve = ["--max-num-seqs", str(args.max_num_seqs)]
    write(f"[load] starting P and D ({kv_cfg}); logs in {log_dir}")
    requests: list[dict[str, Any]] = []
    phases: list[dict[str, Any]] = []
    idle_after: dict[str, Any] = {}
    exited: str | None = None  # a server that died: the phases after it are not run
    with Deployment(model, log_dir, kv_transfer_config=kv_cfg, max_model_len=args.max_model_len,
                    extra_serve_args=serve, proxy_args=proxy_args) as dep:
        warm = make_prompts(len(modes), (lo, lo), seed=1)
        for i, m in enumerate(modes):  # first-call costs (codec set-up) out of the measurement
            one_request(dep.url, model, warm[i], m, 4, time.monotonic(), "warmup", args.request_timeout)
        t0 = time.monotonic()
        with Sampler(dep, status_dir, t0) as sampler:
            for n in bursts:
                label = f"burst{n}"
                write(f"[load] {label}: {n} requests at once")
                rows = run_burst(dep.url, model, make_prompts(n, (lo, hi), seed=n), modes, args, t0, label)
                requests += rows
                phases.append(summarize(label, rows))
                idle_after[label] = wait_idle(sampler)
                write(f"[load] {label}: {phases[-1]['answered']}/{n} answered; idle after: {idle_after[label]['idle']}")
                if (exited := server_exited(dep, label)) is not None:
                    break
            if args.duration > 0 and exited is None:
                write(f"[load] soak: {args.rate:g} requests/s for {args.duration:g}s")
                rows = run_soak(dep.url, model, make_prompts(64, (lo, hi), seed=7), modes, args, t0)
                requests += rows
                phases.append(summarize("soak", rows))
                idle_after["soak"] = wait_idle(sampler)
                write(f"[load] soak: {phases[-1]['answered']}/{len(rows)} answered; "
                      f"idle after: {idle_after['soak']['idle']}")
                exited = server_exited(dep, "soak")
            samples = sampler.samples
    mem: dict[str, Any] = {}
    for side in ("p", "d"):
        vals = [s[f"{side}_rss_mb"] for s in samples if s.get(f"{side}_rss_mb")]
        if vals:
            mem.update({f"{side}_first": vals[0], f"{side}_last": vals[-1], f"{side}_max": max(vals)})
    result: dict[str, Any] = {
        "bench": "load",
        "config": {"kv_transfer_config": kv_cfg, "proxy_args": proxy_args, "serve_args": serve, "modes": modes,
                   "words": [lo, hi], "max_tokens": args.max_tokens, "bursts": bursts, "rate": args.rate,
                   "duration_s": args.duration, "request_timeout_s": args.request_timeout},
        "phases": phases, "idle_after": idle_after, "memory_mb": mem, "samples": samples, "requests": requests,
        "server_exited": exited,
    }
    record_environment(result, env0)
    table = markdown(result)
    sys.stdout.write(table)
    if args.out:
        out = Path(args.out)
        write_json(out, result)
        out.with_suffix(".md").write_text(table)
        png = plot(result, out.with_suffix(".png"))
        write(f"[load] wrote {out}, {out.with_suffix('.md')}" + (f", {png}" if png else ""))
    return result


def exit_status(result: dict[str, Any]) -> int:
    """0 when every request was answered and no server exited (what ``lynx bench load`` exits with)."""
    ok = not result.get("server_exited") and all(s["answered"] == s["requests"] for s in result["phases"])
    return 0 if ok else 1


def server_exited(dep: Any, phase: str) -> str | None:
    """What ``Deployment.raise_if_exited`` says of a server that exited by the end of ``phase`` (its code and log
    tail), else None: the load bench's question is whether the pair survives, so a death ends the run."""
    from lynx_connector.lab.launch import StartupFailed

    try:
        dep.raise_if_exited(f"by the end of {phase}")
    except StartupFailed as exc:
        write(f"[load] {exc}")
        return str(exc)
    return None


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("load", help="bursts and a soak through a real 1P1D deployment: every request "
                              "answered, everything idle after", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bursts", default="32,64", help="comma-separated burst sizes (closed loop)")
    p.add_argument("--rate", type=float, default=0.3, help="soak arrival rate, requests per second")
    p.add_argument("--duration", type=float, default=600.0, help="soak length in seconds (0 = no soak)")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES), help="transfer modes, used round-robin")
    p.add_argument("--words", default="100-600", help="prompt length range in words (essay excerpts)")
    p.add_argument("--max-tokens", type=int, default=24, help="tokens generated per request (EOS ignored)")
    p.add_argument("--max-inflight", type=int, default=8, help="lynx proxy --max-inflight (per server)")
    p.add_argument("--max-num-seqs", type=int, default=8, help="P's and D's vLLM --max-num-seqs")
    p.add_argument("--staging-mb", type=int, default=None, help="P's and D's staging pool (default: the "
                   "connector's)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--request-timeout", type=float, default=600.0, help="client-side limit per request (s)")
    p.add_argument("--model", default=None)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--out", default=None, help="write JSON here (plus .md and .png beside it)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lynx_connector.lab.bench.load")
    sub = parser.add_subparsers(dest="bench", required=True)
    add_parser(sub)
    return exit_status(run(parser.parse_args(["load", *(argv if argv is not None else sys.argv[1:])])))


if __name__ == "__main__":
    sys.exit(main())
