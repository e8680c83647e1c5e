"""``lynx bench order``: D's transfer ranking (``transport/ranking.py``) compared on a simulated clock.

The real `TransferScheduler` runs against a NIXL stand-in whose READs complete at once, so the only clock is the
scheduler's emulated link (``link_gbps``, ``pacing.VirtualLink``) driven by a simulated time: what is measured is the ranking, not this
machine. Requests arrive (all at once, or Poisson at a given link load), each with its mode's real plane sizes
(the modes table's ``wire_nbytes`` for the lab model: 30 layers, 3 KV heads of 64, an fp32 cache, the e2e
bench's servers), and the time each request's output is unblocked is recorded: a speculative request's first
token when its anchor lands and its held tokens when its residual lands, any other request when its last
plane lands. Deterministic (seeded); seconds, not minutes.

    lynx bench order --out benchmarks/results/order.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from dataclasses import dataclass
from typing import Any

from lynx_connector.modes import get_mode
from lynx_connector.transport.config import TransportConfig
from lynx_connector.transport.events import ANCHOR, RESIDUAL, TransferEvent
from lynx_connector.transport.ranking import ORDERS
from lynx_connector.transport.scheduler import StreamJob, TransferScheduler

LAYERS, HEADS, HEAD_SIZE = 30, 3, 64
LINK_GBPS = 2.0


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class _InstantNixl:
    """READs that complete when posted: the emulated link is the only clock."""

    def post_read(self, peer: str, local_addr: int, remote_addr: int, nbytes: int) -> tuple[Any, str]:
        return object(), "DONE"

    def check(self, handle: Any) -> str:
        return "DONE"

    def release(self, handle: Any) -> None:
        pass


@dataclass
class SimRequest:
    name: str
    mode: str
    tokens: int
    arrival: float


def planes(mode: str, tokens: int) -> tuple[int, int]:
    import torch

    a, r = get_mode(mode).plane_nbytes(tokens, HEADS, HEAD_SIZE, torch.float32)
    return a * LAYERS, r * LAYERS


def simulate(reqs: list[SimRequest], order: str, link_gbps: float = LINK_GBPS, max_wait_s: float = 5.0
             ) -> dict[str, dict[str, float]]:
    """Per request: seconds from arrival to each of its streams landing."""
    clock = _Clock()
    landed: dict[str, dict[str, float]] = {r.name: {} for r in reqs}
    cfg = TransportConfig(link_gbps=link_gbps, order=order, max_wait_s=max_wait_s)

    def on_event(ev: TransferEvent) -> None:
        assert ev.ok, ev
        landed[ev.req_id][ev.stream] = clock.t

    sched = TransferScheduler(_InstantNixl(), cfg, on_event, clock=clock)
    todo = sorted(reqs, key=lambda r: r.arrival)
    i = 0
    while i < len(todo) or not sched.idle:
        while i < len(todo) and todo[i].arrival <= clock.t:
            r = todo[i]
            a, res = planes(r.mode, r.tokens)
            row = get_mode(r.mode)
            sched.submit(StreamJob(r.name, ANCHOR, "P", 0, 0, a, clock.t, order=row.pull_order))
            if res:
                sched.submit(StreamJob(r.name, RESIDUAL, "P", 0, 0, res, clock.t, order=row.pull_order))
            i += 1
        wait = sched.step()
        nxt = todo[i].arrival if i < len(todo) else None
        if wait is None:
            if nxt is None:
                break
            clock.t = nxt
        else:
            clock.t = min(clock.t + wait, nxt) if nxt is not None else clock.t + wait
    arrival = {r.name: r.arrival for r in reqs}
    return {name: {s: t - arrival[name] for s, t in streams.items()} for name, streams in landed.items()}


def outcomes(reqs: list[SimRequest], times: dict[str, dict[str, float]]) -> dict[str, list[float]]:
    """``first`` (time to the first output: a speculative anchor, any other request's last plane) and
    ``verified`` (every plane landed) of each request, by mode."""
    out: dict[str, list[float]] = {}
    for r in reqs:
        t = times[r.name]
        row = get_mode(r.mode)
        first = t[ANCHOR] if row.late_residual else max(t.values())
        out.setdefault(f"{r.mode} first", []).append(first)
        if row.late_residual:
            out.setdefault(f"{r.mode} verified", []).append(t[RESIDUAL])
    return out


def scenarios(seed: int) -> dict[str, list[SimRequest]]:
    rng = random.Random(seed)
    out: dict[str, list[SimRequest]] = {}
    for conc in (4, 8):
        out[f"{conc} full"] = [SimRequest(f"f{i}", "full", 1024, 0.0) for i in range(conc)]
        out[f"{conc} speculative"] = [SimRequest(f"s{i}", "speculative", 1024, 0.0) for i in range(conc)]
        out[f"{conc} int8"] = [SimRequest(f"i{i}", "int8", 1024, 0.0) for i in range(conc)]
        out[f"{conc} mixed"] = [SimRequest(f"m{i}", ("speculative", "full", "bf16", "int8")[i % 4], 1024, 0.0)
                                for i in range(conc)]
    # Poisson arrivals of mixed modes and prompt lengths, at 80% of the link's capacity on average
    modes = ("speculative", "full", "bf16")
    reqs, t = [], 0.0
    sizes = [(m, rng.choice((256, 512, 1024, 2048))) for m in (rng.choice(modes) for _ in range(60))]
    mean_bytes = statistics.mean(sum(planes(m, n)) for m, n in sizes)
    rate = 0.8 * LINK_GBPS * 1e9 / 8 / mean_bytes  # requests per second
    for i, (m, n) in enumerate(sizes):
        t += rng.expovariate(rate)
        reqs.append(SimRequest(f"p{i}", m, n, t))
    out["poisson 0.8 mixed"] = reqs
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from lynx_connector.lab.bench.common import environment_info, format_table, write_json

    rows: list[dict[str, Any]] = []
    for name, reqs in scenarios(args.seed).items():
        for order in ORDERS:
            times = simulate(reqs, order, max_wait_s=args.max_wait_s)
            for metric, values in sorted(outcomes(reqs, times).items()):
                rows.append({"scenario": name, "order": order, "metric": metric, "n": len(values),
                             "mean_s": statistics.mean(values), "max_s": max(values)})
    result = {"bench": "order", "link_gbps": LINK_GBPS, "max_wait_s": args.max_wait_s, "seed": args.seed,
              "command": "lynx bench order" + (f" --out {args.out}" if args.out else ""),
              "env": environment_info(), "rows": rows}
    table = _markdown(rows)
    sys.stdout.write(format_table(["scenario", "metric", *(f"{o} mean/max s" for o in ORDERS)],
                                  [[s, m, *c] for s, m, c in _cells(rows)]))
    if args.out:
        write_json(args.out, result)
        with open(args.out.removesuffix(".json") + ".md", "w") as fh:
            fh.write(table)
    return result


def _cells(rows: list[dict[str, Any]]) -> list[tuple[str, str, list[str]]]:
    by = {(r["scenario"], r["metric"], r["order"]): r for r in rows}
    keys = list(dict.fromkeys((r["scenario"], r["metric"]) for r in rows))
    return [(s, m, [f"{by[s, m, o]['mean_s']:.3f} / {by[s, m, o]['max_s']:.3f}" for o in ORDERS]) for s, m in keys]


def _markdown(rows: list[dict[str, Any]]) -> str:
    head = ["scenario", "metric", *(f"`{o}` mean / max s" for o in ORDERS)]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    lines += [f"| {s} | {m} | " + " | ".join(c) + " |" for s, m, c in _cells(rows)]
    return (f"Transfer order on a simulated {LINK_GBPS:g} Gbit/s link (seconds from a request's arrival until its "
            "output is unblocked; `lynx bench order`)\n\n" + "\n".join(lines) + "\n")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("order", help="D's transfer ranking across requests, on a simulated clock")
    p.add_argument("--out", default=None, help="write JSON (and .md beside it) here")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-wait-s", type=float, default=TransportConfig().max_wait_s)
