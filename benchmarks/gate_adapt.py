"""Would a per-request (adaptive) confidence gate hold more tokens than the fixed threshold, at the same
acceptance? Issue 17.4, offline: reads the per-prompt margins that ``anchor_agreement.py --margins --dump``
writes (the real model, the Lynx default anchor) and replays the speculative mode's policy
(``lynx_connector.speculative``: P's first token is released when D's first anchor token equals it; then tokens
are held until the gate stops one) under each gate below. Parameters are chosen on one half of the prompts
(even index) and scored on the other (odd), so a gate cannot win by fitting these prompts.

Gates (``stop(i)``: the token at position ``i >= 1`` is not held, and the anchor phase ends):
- ``fixed tau``: margin < tau (what D runs: ``speculative_min_margin``).
- ``running q``: margin < max(lo, q x the median margin this request has held so far): a request whose text is
  fluent stops at a dip that would pass a fixed threshold; one whose margins are all modest keeps going.
- ``budget s, B``: the sum over held positions of exp(-margin / s) (a smooth estimate of the chance that each one
  flipped) exceeds B: several near-threshold tokens in a row stop the phase, one alone does not.
- ``first error k``: margin < k x |the anchor's margin error at position 0| (clamped to [lo, hi]); that error is
  measurable per request only if P sends its first token's margin and runner-up id (a protocol change): scored
  to see whether the signal is worth that.

    .venv/bin/python benchmarks/anchor_agreement.py --prompts 32 --margins --dump /tmp/margins.json
    .venv/bin/python benchmarks/gate_adapt.py /tmp/margins.json --out benchmarks/results/gate_adapt.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
from collections.abc import Callable, Sequence

Stop = Callable[[int, Sequence[float], dict], bool]


def outcome(div: int, margins: Sequence[float], stop: Stop, cap: int, row: dict) -> tuple[int, int]:
    """(held, accepted) of one prompt: the policy of ``anchor_agreement.gate_outcome`` with any stop rule."""
    if div == 0:
        return 0, 0
    held = 0
    for i in range(1, min(len(margins), cap + 1)):
        if stop(i, margins, row):
            break
        held += 1
    return held, min(held, div - 1)


def fixed(tau: float) -> Stop:
    return lambda i, m, row: m[i] < tau


def running(q: float, lo: float) -> Stop:
    def stop(i: int, m: Sequence[float], row: dict) -> bool:
        seen = m[1:i]
        return m[i] < lo or (bool(seen) and m[i] < q * statistics.median(seen))
    return stop


def budget(s: float, b: float) -> Stop:
    return lambda i, m, row: sum(math.exp(-x / s) for x in m[1:i + 1]) > b


def first_error(k: float, lo: float, hi: float) -> Stop:
    def stop(i: int, m: Sequence[float], row: dict) -> bool:
        err = row["anchor_error"]
        tau = min(hi, max(lo, k * abs(err[0]))) if err else hi
        return m[i] < tau
    return stop


GRIDS: dict[str, list[tuple[str, Stop]]] = {
    "fixed": [(f"tau {t}", fixed(t)) for t in (0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75)],
    "running": [(f"q {q}, lo {lo}", running(q, lo)) for q, lo in itertools.product(
        (0.05, 0.1, 0.15, 0.2, 0.3), (0.0, 0.05, 0.1, 0.2, 0.3))],
    "budget": [(f"s {s}, B {b}", budget(s, b)) for s, b in itertools.product(
        (0.05, 0.1, 0.2, 0.3), (0.1, 0.2, 0.3, 0.5, 0.75, 1.0))],
    "first error": [(f"k {k}, lo {lo}, hi {hi}", first_error(k, lo, hi)) for k, lo, hi in itertools.product(
        (1.0, 2.0, 4.0, 8.0), (0.0, 0.1, 0.2), (0.3, 0.5, 1.0))],
}


def score(rows: Sequence[dict], stop: Stop, cap: int) -> dict:
    held, acc = zip(*(outcome(r["first_difference"], r["anchor_margins"], stop, cap, r) for r in rows), strict=True)
    return {"held": sum(held), "accepted": sum(acc), "acceptance": sum(acc) / max(1, sum(held)),
            "accepted_per_prompt": statistics.mean(acc), "wasted_per_prompt": (sum(held) - sum(acc)) / len(rows)}


def best(rows: Sequence[dict], grid: list[tuple[str, Stop]], cap: int, floor: float) -> tuple[str, Stop, dict]:
    """The setting with the most accepted tokens among those at or above ``floor`` acceptance (else the most
    accurate one)."""
    scored = [(name, stop, score(rows, stop, cap)) for name, stop in grid]
    ok = [x for x in scored if x[2]["acceptance"] >= floor]
    if ok:
        return max(ok, key=lambda x: (x[2]["accepted"], -x[2]["held"]))
    return max(scored, key=lambda x: x[2]["acceptance"])


def correlation(rows: Sequence[dict]) -> float | None:
    """Spearman correlation between |the anchor's margin error at position 0| and its mean |error| over the later
    positions before the first difference: does the first position tell a request's anchor noise?"""
    pairs = [(abs(r["anchor_error"][0]), statistics.mean(abs(x) for x in r["anchor_error"][1:]))
             for r in rows if len(r["anchor_error"]) >= 3]
    if len(pairs) < 4:
        return None

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        out = [0.0] * len(v)
        for r, i in enumerate(order):
            out[i] = float(r)
        return out

    a, b = ranks([p[0] for p in pairs]), ranks([p[1] for p in pairs])
    ma, mb = statistics.mean(a), statistics.mean(b)
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b, strict=True))
    return cov / math.sqrt(sum((x - ma) ** 2 for x in a) * sum((y - mb) ** 2 for y in b))


def splits(rows: Sequence[dict], n: int, floor: float, cap: int) -> list[dict]:
    """Each gate chosen on a random half and scored on the other, ``n`` times (seeds 0..n-1): the mean held-out
    accepted tokens per prompt, the worst held-out acceptance and the share of halvings that kept ``floor``."""
    import random

    out = []
    for gate, grid in [("fixed tau 0.4 (D's default, not tuned)", [("tau 0.4", fixed(0.4))]), *GRIDS.items()]:
        acc, rate = [], []
        for seed in range(n):
            idx = list(range(len(rows)))
            random.Random(seed).shuffle(idx)
            half = len(idx) // 2
            _, stop, _ = best([rows[i] for i in idx[:half]], grid, cap, floor)
            t = score([rows[i] for i in idx[half:]], stop, cap)
            acc.append(t["accepted_per_prompt"])
            rate.append(t["acceptance"])
        out.append({"gate": gate, "floor": floor, "accepted_per_prompt": statistics.mean(acc),
                    "worst_acceptance": min(rate), "kept_floor": sum(r >= floor for r in rate) / n})
    return out


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dump", help="anchor_agreement.py --margins --dump output")
    ap.add_argument("--cap", type=int, default=64, help="max held tokens (max_speculative_tokens)")
    ap.add_argument("--floors", default="0.85,0.95,1.0", help="acceptance floors to choose each gate's setting at")
    ap.add_argument("--splits", type=int, default=8, help="random halvings for the robustness table")
    ap.add_argument("--out", default=None, help="write the table as JSON here (and .md beside it)")
    args = ap.parse_args(argv)
    with open(args.dump) as f:
        data = json.load(f)
    rows = data["prompts"]
    train, test = rows[0::2], rows[1::2]
    divs = [r["first_difference"] for r in rows]
    oracle = statistics.mean(max(0, min(d - 1, args.cap)) for d in divs)
    lines = [f"{len(rows)} prompts ({len(train)} to choose, {len(test)} to score), {data['tokens']} tokens; first "
             f"difference mean {statistics.mean(divs):.1f}, median {statistics.median(divs):.1f}; an oracle gate "
             f"accepts {oracle:.1f} per prompt",
             f"|anchor margin error| at position 0 vs later (Spearman): {_fmt(correlation(rows))}", "",
             "| acceptance floor | gate | setting (chosen on the even prompts) | accepted/prompt (odd) | acceptance "
             "(odd) | wasted/prompt (odd) | accepted/prompt (all) | acceptance (all) |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    table = []
    for floor in (float(x) for x in args.floors.split(",")):
        for gate, grid in GRIDS.items():
            name, stop, _ = best(train, grid, args.cap, floor)
            t, a = score(test, stop, args.cap), score(rows, stop, args.cap)
            table.append({"floor": floor, "gate": gate, "setting": name, "test": t, "all": a})
            lines.append(f"| {floor:.2f} | {gate} | {name} | {t['accepted_per_prompt']:.1f} | {t['acceptance']:.2f} | "
                         f"{t['wasted_per_prompt']:.1f} | {a['accepted_per_prompt']:.1f} | {a['acceptance']:.2f} |")
    robust = splits(rows, args.splits, 0.85, args.cap) if args.splits > 0 else []
    if robust:
        lines += ["", f"{args.splits} random halvings (chosen on one half at acceptance >= 0.85, scored on the other):",
                  "", "| gate | accepted/prompt (mean) | worst acceptance | halvings that kept 0.85 |",
                  "| --- | ---: | ---: | ---: |"]
        lines += [f"| {r['gate']} | {r['accepted_per_prompt']:.1f} | {r['worst_acceptance']:.2f} | "
                  f"{r['kept_floor']:.2f} |" for r in robust]
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    if args.out:
        with open(args.out, "w") as f:
            source = f"{args.dump}: anchor_agreement.py --margins --dump, {len(rows)} prompts, {data['tokens']} tokens"
            json.dump({"source": source, "cap": args.cap, "prompts": len(rows), "oracle_accepted": oracle,
                       "correlation_first_error": correlation(rows), "table": table, "splits": robust}, f, indent=1)
        with open(args.out.rsplit(".", 1)[0] + ".md", "w") as f:
            f.write("## Adaptive confidence gate, offline (benchmarks/gate_adapt.py)\n\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
