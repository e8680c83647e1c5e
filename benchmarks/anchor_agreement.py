"""How far greedy decoding on quantized prompt KV follows full-precision decoding (an upper bound on what the
speculative mode can accept), per anchor grouping, with the real model in transformers (no vLLM, no transfer).

For each summary prompt (``lynx_connector.lab.data.build_summary_prompt``): compute the KV of all prompt tokens but the
last, quantize-dequantize every layer's K and V with the 4-bit anchor of a grouping (the torch twin,
``kernels/groupquant_ref``), then decode greedily from the last prompt token and report the first position where
the tokens differ from decoding on the exact KV (``--tokens`` when they never do).

    .venv/bin/python benchmarks/anchor_agreement.py --prompts 12 --tokens 64

``--reference full`` compares with decoding on lynx full's prompt KV (the default grouping's anchor + residual)
instead of the exact KV: what D verifies the anchor's tokens against, so what speculation can accept.

``--margins``: for the Lynx default grouping only, the calibration of the speculative mode's confidence gate
(``speculative_min_margin``): the anchor's top-two logit margin at each position, the margin where the first
difference occurs, and per threshold what the gate would hold and verification accept over ``--tokens``
positions (the policy of ``lynx_connector.speculative``: P's full-precision first token is released when D's first
anchor token equals it, and nothing is held when it does not; then tokens are held up to the first one whose
margin is below the threshold).

    .venv/bin/python benchmarks/anchor_agreement.py --prompts 16 --margins
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from lynx_connector.lab.data import first_difference

LYNX_DEFAULT = "lynx default (LYNX_DEFAULTS)"
THRESHOLDS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0)


def gate_outcome(div: int, margins: list[float], tau: float, cap: int) -> tuple[int, int]:
    """(held, accepted) for one prompt under the speculative mode's policy (see the module docstring):
    ``div`` is the first position where the anchor's greedy tokens differ from full precision's."""
    if div == 0:
        return 0, 0  # D's first token is not P's: nothing is held
    held = next((i for i in range(1, len(margins)) if margins[i] < tau), len(margins)) - 1  # position 0 is P's
    held = min(held, cap)
    return held, min(held, div - 1)


def margin_on(logits: torch.Tensor, ids: tuple[int, int]) -> float:
    """``logits[ids[0]] - logits[ids[1]]``: a position's margin measured on given token ids."""
    return float(logits[ids[0]] - logits[ids[1]])


def calibrate_gate(prompts: list, refs: list[list[int]], decode, tokens: int, exact=None,
                   dump: str | None = None) -> int:
    """The threshold table; with ``exact`` (the exact decode, returning each position's logits) and ``dump``, also
    a JSON per prompt of what an adaptive gate could use: the anchor's and the exact path's margins, and the
    anchor's error on the exact top-two ids at every position before the first difference (position 0 is the
    first token, which P computes at full precision)."""
    divs, margins, rows = [], [], []
    for p, ref in zip(prompts, refs, strict=True):
        m: list[float] = []
        a_logits: list[torch.Tensor] | None = [] if dump else None
        divs.append(first_difference(decode(p.token_ids, m, a_logits), ref))
        margins.append(m)
        if dump and exact is not None and a_logits is not None:
            e_logits: list[torch.Tensor] = []
            exact(p.token_ids, e_logits)
            top2 = [tuple(int(i) for i in lg.topk(2).indices) for lg in e_logits]
            rows.append({"seed": p.seed, "first_difference": divs[-1], "anchor_margins": m,
                         "exact_margins": [margin_on(lg, t) for lg, t in zip(e_logits, top2, strict=True)],
                         "anchor_error": [margin_on(a, t) - margin_on(e, t) for a, e, t in
                                          zip(a_logits[:divs[-1]], e_logits, top2, strict=False)]})
    if dump:
        with open(dump, "w") as f:
            json.dump({"tokens": tokens, "prompts": rows}, f)
    at_div = [m[d] for d, m in zip(divs, margins, strict=True) if d < tokens]
    before = [x for d, m in zip(divs, margins, strict=True) for x in m[1:d]]
    sys.stdout.write(f"{len(prompts)} prompts, {tokens} tokens; first difference at {divs}\n"
                     f"anchor margin at the first difference: max {max(at_div, default=float('nan')):.3f}, "
                     f"values {[round(x, 3) for x in at_div]}\n"
                     f"margins before it (positions 1..): {len(before)} positions, median "
                     f"{statistics.median(before) if before else float('nan'):.3f}, "
                     f"share below 0.4: {sum(x < 0.4 for x in before) / max(1, len(before)):.2f}\n")
    sys.stdout.write(f"{'threshold':>9s} {'held':>5s} {'accepted':>8s} {'acceptance':>10s} {'accepted/prompt':>15s}\n")
    for tau in THRESHOLDS:
        held, acc = zip(*(gate_outcome(d, m, tau, tokens) for d, m in zip(divs, margins, strict=True)), strict=True)
        sys.stdout.write(f"{tau:9.2f} {sum(held):5d} {sum(acc):8d} {sum(acc) / max(1, sum(held)):10.2f} "
                         f"{statistics.mean(acc):15.1f}\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    from lynx_connector.kernels.groupquant_ref import dequantize_ref, quantize_ref
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lynx_connector.lab import data
    from lynx_connector.lab.models import prepare

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--context", type=int, default=1024, help="essay tokens per prompt")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens compared")
    ap.add_argument("--margins", action="store_true", help="calibrate the confidence gate (Lynx default grouping)")
    ap.add_argument("--dump", default=None, help="with --margins: write per-prompt margins and the anchor's margin "
                    "error to this JSON (input of benchmarks/gate_adapt.py)")
    ap.add_argument("--model", default=None, help="a Hugging Face model directory (default: the prepared SmolLM2)")
    ap.add_argument("--reference", choices=("fp32", "full"), default="fp32",
                    help="what the anchor's tokens are compared with: decoding on the exact (fp32) prompt KV, or on "
                    "lynx full's (anchor + residual of the default grouping), which is what D verifies against")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    path = args.model or str(prepare())
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # seeds 5i + 1: distinct essays for up to 49 prompts (5 is prime to the 49 essays)
    prompts = [data.build_summary_prompt(tok, args.context, seed=5 * i + 1) for i in range(args.prompts)]

    def anchor(x: torch.Tensor, mode: str, g: int, full: bool = False) -> torch.Tensor:  # x [T, H, D]
        p = quantize_ref(x, mode, g, 15, full)
        return dequantize_ref(p.codes, p.residual if full else None, p.scale, p.mn, mode, g)

    @torch.no_grad()
    def greedy(ids: list[int], cfg: tuple | None, margins: list[float] | None = None,
               logits: list[torch.Tensor] | None = None, full: bool = False) -> list[int]:
        cache = model(torch.tensor([ids[:-1]]), use_cache=True).past_key_values
        if cfg is not None:
            for layer in cache.layers:
                for name, (mode, g) in zip(("keys", "values"), cfg, strict=True):
                    t = getattr(layer, name)  # [1, H, T, D]
                    t.copy_(anchor(t[0].transpose(0, 1).contiguous(), mode, g, full).transpose(0, 1).unsqueeze(0))
        cur, out = torch.tensor([[ids[-1]]]), []
        for _ in range(args.tokens):
            o = model(cur, past_key_values=cache, use_cache=True)
            cache = o.past_key_values
            top = o.logits[0, -1].topk(2)
            out.append(int(top.indices[0]))
            if margins is not None:
                margins.append(float(top.values[0] - top.values[1]))
            if logits is not None:
                logits.append(o.logits[0, -1].clone())
            cur = torch.tensor([[out[-1]]])
        return out

    def bits(cfg: tuple) -> float:
        return sum(4 + (32 / g if mode == "channel" else 32 / 64) for mode, g in cfg) / 2  # head_dim 64

    from lynx_connector.codec import LYNX_DEFAULTS as dflt

    configs = {
        LYNX_DEFAULT: tuple((dflt[f"{x}_group"], dflt[f"{x}_group_tokens"] if dflt[f"{x}_group"] == "channel" else 1)
                            for x in "kv"),
        "previous default: K channel/256, V channel/32": (("channel", 256), ("channel", 32)),
        "K channel/64, V token (int4_kivi grouping)": (("channel", 64), ("token", 1)),
        "K channel/256, V token": (("channel", 256), ("token", 1)),
        "K channel/64, V channel/64": (("channel", 64), ("channel", 64)),
        "K channel/32, V channel/64": (("channel", 32), ("channel", 64)),
        "K token, V token (int4 per token-head)": (("token", 1), ("token", 1)),
    }
    # the reference path: exact KV, or lynx full's (the default grouping's anchor + residual)
    ref_cfg = configs[LYNX_DEFAULT] if args.reference == "full" else None
    refs = [greedy(p.token_ids, ref_cfg, full=True) for p in prompts]
    if args.margins:
        return calibrate_gate(prompts, refs, lambda ids, m, lg: greedy(ids, configs[LYNX_DEFAULT], m, lg),
                              args.tokens, exact=lambda ids, lg: greedy(ids, ref_cfg, None, lg, full=True),
                              dump=args.dump)
    sys.stdout.write(f"reference: {'lynx full (default grouping)' if ref_cfg else 'exact (fp32) KV'}\n"
                     f"{'anchor grouping':42s} {'bits/value':>10s}  first divergence (of {args.tokens}) per prompt\n")
    for name, cfg in configs.items():
        divs = []
        for p, ref in zip(prompts, refs, strict=True):
            got = greedy(p.token_ids, cfg)
            divs.append(first_difference(got, ref))
        sys.stdout.write(f"{name:42s} {bits(cfg):10.3f}  mean {statistics.mean(divs):5.1f}, median "
                         f"{statistics.median(divs):5.1f}: {divs}\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
