"""``lynx bench transfer``: the two-stream transport between two real processes over real NIXL (loopback).

A `TransferSource` runs in a spawned P process; this process runs `TransferSink`s (one per link rate). Each
request's KV is staged as one contiguous region per stream, sized by the codec for the model shape (default
SmolLM2-135M at 4k tokens: 30 layers, 3 kv heads, head size 64; ``--model llama3-8b``: 32, 8, 128), and
pulled at each paced link rate and unpaced. Measured per scheme: time-to-anchor (Lynx), time-to-full, bytes
and descriptors per request, achieved rate, transport CPU seconds (D's sink thread, P's source thread); plus
8 concurrent Lynx requests (did every anchor complete before any residual?) and a chunk-size sweep showing
how long a new anchor waits behind a residual already being read. Times run from ``pull()`` to the event.
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import sys
import time
from typing import Any

from lynx_connector.lab.bench import common
from lynx_connector.logger import init_logger
from lynx_connector.transport.config import TransportConfig

logger = init_logger(__name__)

MODELS = {"smollm2": (30, 3, 64), "llama3-8b": (32, 8, 128)}  # layers, kv heads, head size
SCHEMES = ("lynx", "int4", "int8", "fp8", "bf16")
DEFAULT_RATES = (10.0, 25.0, 50.0)
MB = 1 << 20
COMPAT = {"bench": "transfer", "version": 1}
BENCH_KEY = secrets.token_bytes(32)  # this run's side-channel key (P and D; the P process gets it in its config)


def plane_sizes(scheme: str, layers: int, tokens: int, heads: int, head_dim: int) -> tuple[int, int]:
    """(anchor, residual) bytes of one request, all layers, bf16 cache: the codec's sizes when available."""
    try:
        import torch

        from lynx_connector.codec import get_codec

        a, r = get_codec(scheme).plane_nbytes(tokens, heads, head_dim, torch.bfloat16)
        return a * layers, r * layers
    except ImportError:  # codec not installed: the formulas of docs (per token-head fp16 scale + zero)
        values = 2 * tokens * heads * head_dim * layers
        token_heads = 2 * tokens * heads * layers
        return {
            "bf16": (2 * values, 0),
            "fp8": (values + 4 * token_heads, 0),
            "int8": (values + 4 * token_heads, 0),
            "int4": (values // 2 + 4 * token_heads, 0),
            "lynx": (values // 2 + values // 64 * 4, values // 2),
        }[scheme]


class _Runner:
    """Drives the P process over its pipe and pulls with a sink."""

    def __init__(self, conn: Any, addr: tuple[str, int]) -> None:
        self.conn, self.addr, self.n = conn, addr, 0

    def call(self, *cmd: Any) -> Any:
        self.conn.send(cmd)
        if not self.conn.poll(120):
            raise TimeoutError(f"source process did not answer {cmd[0]}")
        tag, val = self.conn.recv()
        if tag != "ok":
            raise RuntimeError(val)
        return val

    def pull_many(self, sink: Any, sizes: list[tuple[int, int]], timeout: float = 120.0) -> list[dict[str, Any]]:
        """Stage and pull requests concurrently; returns per request {t_anchor, t_full, ok, order}."""
        names = []
        for a, r in sizes:
            self.n += 1
            names.append((f"q{self.n}", a, r, -(self.n % 200) - 1))
        self.call("stage", names, True)
        tickets = self.call("tickets", [n for n, *_ in names])
        views = {n: sink.pool.alloc_request(n, a, r) for n, a, r, _ in names}
        p0, d0 = self.call("stats")["cpu_s"], sink.cpu_s
        for n, st in views.items():
            sink.pull(n, *self.addr, *tickets[n], st.anchor, st.residual)
        want = sum(1 if r == 0 else 2 for _, _, r, _ in names)
        evs: list[Any] = []
        end = time.monotonic() + timeout
        while len(evs) < want:
            if time.monotonic() > end:
                raise TimeoutError(f"only {len(evs)} of {want} events")
            evs.extend(sink.poll())
            time.sleep(0.0005)
        d_cpu = sink.cpu_s - d0
        p_cpu = self.call("stats")["cpu_s"] - p0
        out = []
        for n, _a, _r, _ in names:
            mine = {e.stream: e for e in evs if e.req_id == n}
            out.append({
                "ok": all(e.ok for e in mine.values()),
                "errors": [e.error for e in mine.values() if not e.ok],
                "t_anchor_s": mine["anchor"].seconds,
                "t_full_s": max(e.seconds for e in mine.values()),
                # data time: from the anchor's first chunk post to the last completion (no query round trip)
                "t_data_s": max(e.seconds for e in mine.values()) - (
                    mine["anchor"].seconds - (mine["anchor"].data_seconds or 0.0)),
                "order": [(e.req_id, e.stream) for e in evs],
                "cpu_d_s": d_cpu, "cpu_p_s": p_cpu,
            })
            sink.pool.free_request(n)
        return out


def _sink(link_gbps: float | None, pool_bytes: int, chunk_bytes: int = 1 * MB) -> Any:
    from lynx_connector.transport.sink import TransferSink

    cfg = TransportConfig(link_gbps=link_gbps, pool_bytes=pool_bytes, chunk_bytes=chunk_bytes,
                          window_bytes=max(4 * MB, chunk_bytes), timeout_s=30.0, key=BENCH_KEY)
    return TransferSink(cfg, COMPAT)


def _rate_rows(run: _Runner, rate: float | None, sizes: dict[str, tuple[int, int]], reps: int,
               pool: int, conc: tuple[int, int]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    sink = _sink(rate, pool)
    try:
        run.pull_many(sink, [(4096, 4096)])  # handshake + warm-up, not measured
        samples: dict[str, list[dict[str, Any]]] = {s: [] for s in SCHEMES}
        for _ in range(reps):  # interleaved, so load spikes on the shared box hit every scheme alike
            for scheme in SCHEMES:
                g = run.pull_many(sink, [sizes[scheme]])[0]
                if not g["ok"]:
                    raise RuntimeError(f"{scheme} transfer failed: {g['errors']}")
                samples[scheme].append(g)
        rows = []
        for scheme in SCHEMES:
            a, r = sizes[scheme]
            got = samples[scheme]
            t_full = statistics.median(g["t_full_s"] for g in got)
            t_data = statistics.median(g["t_data_s"] for g in got)
            achieved = (a + r) * 8 / t_data / 1e9
            rows.append({
                "scheme": scheme, "link_gbps": rate, "bytes": a + r, "anchor_bytes": a, "residual_bytes": r,
                "descriptors": 2 if r else 1,
                "t_anchor_s": statistics.median(g["t_anchor_s"] for g in got) if r else None,
                "t_full_s": t_full, "t_data_s": t_data, "achieved_gbps": achieved,
                "rate_frac": None if rate is None else achieved / rate,
                "cpu_d_s": statistics.median(g["cpu_d_s"] for g in got),
                "cpu_p_s": statistics.median(g["cpu_p_s"] for g in got), "reps": reps,
            })
        got = run.pull_many(sink, [conc] * 8)
        order = got[0]["order"]
        last_anchor = max(i for i, (_, s) in enumerate(order) if s == "anchor")
        first_residual = min(i for i, (_, s) in enumerate(order) if s == "residual")
        concurrent = {
            "link_gbps": rate, "requests": 8, "bytes_each": sum(conc), "ok": all(g["ok"] for g in got),
            "all_anchors_before_any_residual": last_anchor < first_residual,
            "t_last_anchor_s": max(g["t_anchor_s"] for g in got), "t_first_residual_s": min(
                g["t_full_s"] for g in got), "t_all_s": max(g["t_full_s"] for g in got),
        }
        return rows, concurrent
    finally:
        sink.close()


def _chunk_sweep(run: _Runner, residual: int, chunks: list[int], pool: int) -> list[dict[str, Any]]:
    """Unpaced: a 1 MiB anchor pulled while another request's big residual is being read."""
    out = []
    for chunk in chunks:
        sink = _sink(None, pool, chunk_bytes=chunk)
        try:
            run.pull_many(sink, [(4096, 4096)])
            run.n += 2
            x, y = f"q{run.n - 1}", f"q{run.n}"
            run.call("stage", [(x, 64 * 1024, residual, -3), (y, MB, 0, -4)], True)
            tickets = run.call("tickets", [x, y])
            vx, vy = sink.pool.alloc_request(x, 64 * 1024, residual), sink.pool.alloc_request(y, MB, 0)
            sink.pull(x, *run.addr, *tickets[x], vx.anchor, vx.residual)
            evs: list[Any] = []
            while not evs:
                evs += sink.poll()
                time.sleep(0.0002)
            time.sleep(0.002)  # x's residual is being read now
            sink.pull(y, *run.addr, *tickets[y], vy.anchor, None)
            end = time.monotonic() + 60
            while len(evs) < 3 and time.monotonic() < end:
                evs += sink.poll()
                time.sleep(0.0002)
            got = {(e.req_id, e.stream): e for e in evs}
            order = [(e.req_id, e.stream) for e in evs]
            out.append({
                "chunk_bytes": chunk, "residual_bytes": residual,
                "t_new_anchor_s": got[(y, "anchor")].seconds, "t_residual_s": got[(x, "residual")].seconds,
                "anchor_overtook": order.index((y, "anchor")) < order.index((x, "residual")),
                "residual_gbps": residual * 8 / got[(x, "residual")].seconds / 1e9,
            })
            sink.pool.free_request(x)
            sink.pool.free_request(y)
        finally:
            sink.close()
    return out


def evaluate(rows: list[dict[str, Any]], concurrent: list[dict[str, Any]]) -> list[dict[str, Any]]:
    checks = []
    by = {(r["scheme"], r["link_gbps"]): r for r in rows}
    for rate in sorted({r["link_gbps"] for r in rows if r["link_gbps"] is not None}):
        lynx, int4, int8 = by[("lynx", rate)], by[("int4", rate)], by[("int8", rate)]
        checks.append({"row": f"lynx@{rate:g}", "metric": "t_anchor / int4 t_full",
                       "measured": lynx["t_anchor_s"] / int4["t_full_s"], "target": "<= 1.10"})
        checks.append({"row": f"lynx@{rate:g}", "metric": "t_full / int8 t_full",
                       "measured": lynx["t_full_s"] / int8["t_full_s"], "target": "<= 1.05"})
        worst = min((r for r in rows if r["link_gbps"] == rate), key=lambda r: r["rate_frac"])
        checks.append({"row": f"{worst['scheme']}@{rate:g}", "metric": "achieved / paced rate (worst scheme)",
                       "measured": worst["rate_frac"], "target": ">= 0.90"})
    for c in concurrent:
        checks.append({"row": f"8 concurrent @{c['link_gbps']}", "metric": "all anchors before any residual",
                       "measured": float(c["all_anchors_before_any_residual"]), "target": "== 1"})
    for c in checks:
        m, t = c["measured"], c["target"]
        c["pass"] = bool(m <= float(t[3:]) if t.startswith("<=") else m >= float(t[3:]) if t.startswith(">=")
                         else m == float(t[3:]))
    return checks


def format_report(result: dict[str, Any]) -> str:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.1f}"

    rows = [[r["scheme"], "loopback" if r["link_gbps"] is None else f"{r['link_gbps']:g}",
             f"{r['bytes'] / MB:.1f}", r["descriptors"], ms(r["t_anchor_s"]), ms(r["t_full_s"]),
             f"{r['achieved_gbps']:.1f}", "-" if r["rate_frac"] is None else f"{100 * r['rate_frac']:.0f}%",
             ms(r["cpu_d_s"]), ms(r["cpu_p_s"])] for r in result["rows"]]
    out = (f"transfer bench: {result['model']} {result['tokens']} tokens ({result['layers']} layers, "
           f"{result['kv_heads']} kv heads, head {result['head_size']}), bf16 cache, chunk 1 MiB\n")
    out += common.format_table(["scheme", "link Gb/s", "MiB", "desc", "t_anchor ms", "t_full ms", "Gb/s",
                                "of link", "cpu D ms", "cpu P ms"], rows)
    out += "\n8 concurrent lynx requests:\n" + common.format_table(
        ["link Gb/s", "anchors first", "last anchor ms", "first residual ms", "all ms"],
        [["loopback" if c["link_gbps"] is None else f"{c['link_gbps']:g}", c["all_anchors_before_any_residual"],
          ms(c["t_last_anchor_s"]), ms(c["t_first_residual_s"]), ms(c["t_all_s"])] for c in result["concurrent"]])
    out += "\nnew 1 MiB anchor behind a residual being read (unpaced), by chunk size:\n" + common.format_table(
        ["chunk KiB", "residual MiB", "anchor ms", "residual ms", "overtook", "residual Gb/s"],
        [[c["chunk_bytes"] // 1024, c["residual_bytes"] // MB, ms(c["t_new_anchor_s"]), ms(c["t_residual_s"]),
          c["anchor_overtook"], f"{c['residual_gbps']:.1f}"] for c in result["chunk_sweep"]])
    out += f"\nidle transport CPU: D {100 * result['idle_cpu']['d']:.2f}% of a core, P {100 * result['idle_cpu']['p']:.2f}%\n"
    failed = [c for c in result["checks"] if not c["pass"]]
    out += "all targets met\n" if not failed else "missed: " + "; ".join(
        f"{c['row']} {c['metric']} {c['measured']:.3g} (target {c['target']})" for c in failed) + "\n"
    return out


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``transfer`` on a ``lynx bench`` subparsers object (``func`` default = run)."""
    p = subparsers.add_parser("transfer", help="two-stream KV transfer over NIXL between two processes",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="smollm2", help="KV shape (default smollm2)")
    p.add_argument("--tokens", type=int, default=4096, help="request length in tokens (default 4096)")
    p.add_argument("--rates", default=None, help="paced link rates in Gb/s, comma-separated (default 10,25,50)")
    p.add_argument("--reps", type=int, default=None, help="pulls per scheme and rate, median kept (default 5)")
    p.add_argument("--quick", action="store_true", help="2 reps, 2 rates, short sweep (< 1 min)")
    p.add_argument("--out", default=None, help="write the result JSON here")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark, print the table, write ``--out``; return the result dict."""
    from lynx_connector.lab.peer import start_source_process

    t_start = time.perf_counter()
    layers, heads, dim = MODELS[args.model]
    rates = ([float(x) for x in args.rates.split(",") if x.strip()] if args.rates
             else list(DEFAULT_RATES[:2] if args.quick else DEFAULT_RATES))
    reps = args.reps or (2 if args.quick else 5)
    sizes = {s: plane_sizes(s, layers, args.tokens, heads, dim) for s in SCHEMES}
    conc_tokens = args.tokens
    while conc_tokens > 256 and 8 * sum(plane_sizes("lynx", layers, conc_tokens, heads, dim)) > 1 << 30:
        conc_tokens //= 2
    conc = plane_sizes("lynx", layers, conc_tokens, heads, dim)
    biggest = max(max(a + r for a, r in sizes.values()), 8 * sum(conc), 128 * MB)
    pool = int(biggest * 1.2) + 16 * MB
    proc, conn, addr = start_source_process(TransportConfig(pool_bytes=pool, lease_s=600.0, key=BENCH_KEY), COMPAT)
    runner = _Runner(conn, addr)
    try:
        rows, concurrent = [], []
        for rate in [None, *rates]:
            got, c = _rate_rows(runner, rate, sizes, reps, pool, conc)
            rows += got
            concurrent.append(c)
            logger.info("rate %s done at %.1f s", rate, time.perf_counter() - t_start)
        chunks = [256 * 1024, MB, 16 * MB, 128 * MB] if not args.quick else [MB, 128 * MB]
        sweep = _chunk_sweep(runner, 128 * MB, chunks, pool)
        sink = _sink(None, 16 * MB)
        p0, d0 = runner.call("stats")["cpu_s"], sink.cpu_s
        time.sleep(1.0)
        idle = {"d": sink.cpu_s - d0, "p": runner.call("stats")["cpu_s"] - p0}
        sink.close()
    finally:
        if proc.is_alive():
            conn.send(("stop",))
            proc.join(20)
        if proc.is_alive():
            proc.kill()
    result: dict[str, Any] = {
        "bench": "transfer", "rows": rows, "concurrent": concurrent, "chunk_sweep": sweep, "idle_cpu": idle,
        "model": args.model, "tokens": args.tokens, "layers": layers, "kv_heads": heads, "head_size": dim,
        "concurrent_tokens": conc_tokens, "rates_gbps": rates, "reps": reps, "quick": bool(args.quick),
        "settings": {"chunk_bytes": MB, "window_bytes": 4 * MB, "progress_thread": False, "num_workers": 1,
                     "catch_up_s": TransportConfig().catch_up_s, "anchor_holdoff_s": TransportConfig().anchor_holdoff_s},
        "timing": "t_anchor_s/t_full_s: seconds from pull() to the stream's completion event (includes the "
                  "region query round trip); achieved_gbps: bytes over t_data_s (first chunk post to completion)",
    }
    result["checks"] = evaluate(rows, concurrent)
    result["wall_s"] = time.perf_counter() - t_start
    result.update(common.environment_info())
    sys.stdout.write(format_report(result))
    sys.stdout.flush()
    if args.out:
        common.write_json(args.out, result)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lynx_connector.lab.bench.transfer")
    sub = parser.add_subparsers(dest="bench", required=True)
    add_parser(sub)
    run(parser.parse_args(["transfer", *(argv if argv is not None else sys.argv[1:])]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
