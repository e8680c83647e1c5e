"""How far greedy decoding on quantized prompt KV follows full-precision decoding (an upper bound on what the
speculative mode can accept), per anchor grouping, with the real model in transformers (no vLLM, no transfer).

For each summary prompt (``lynx_connector.data.build_summary_prompt``): compute the KV of all prompt tokens but the
last, quantize-dequantize every layer's K and V with the 4-bit anchor of a grouping (the torch twin,
``kernels/groupquant_ref``), then decode greedily from the last prompt token and report the first position where
the tokens differ from decoding on the exact KV (``--tokens`` when they never do).

    .venv/bin/python benchmarks/anchor_agreement.py --prompts 12 --tokens 64
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch


def main(argv: list[str] | None = None) -> int:
    from lynx_connector.kernels.groupquant_ref import dequantize_ref, quantize_ref
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lynx_connector import data
    from lynx_connector.models import prepare

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--context", type=int, default=1024, help="essay tokens per prompt")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens compared")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    path = str(prepare())
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # seeds 5i + 1: distinct essays for up to 49 prompts (5 is prime to the 49 essays)
    prompts = [data.build_summary_prompt(tok, args.context, seed=5 * i + 1) for i in range(args.prompts)]

    def anchor(x: torch.Tensor, mode: str, g: int) -> torch.Tensor:  # x [T, H, D]
        p = quantize_ref(x, mode, g, 15, False)
        return dequantize_ref(p.codes, None, p.scale, p.mn, mode, g)

    @torch.no_grad()
    def greedy(ids: list[int], cfg: tuple | None) -> list[int]:
        cache = model(torch.tensor([ids[:-1]]), use_cache=True).past_key_values
        if cfg is not None:
            for layer in cache.layers:
                for name, (mode, g) in zip(("keys", "values"), cfg, strict=True):
                    t = getattr(layer, name)  # [1, H, T, D]
                    t.copy_(anchor(t[0].transpose(0, 1).contiguous(), mode, g).transpose(0, 1).unsqueeze(0))
        cur, out = torch.tensor([[ids[-1]]]), []
        for _ in range(args.tokens):
            o = model(cur, past_key_values=cache, use_cache=True)
            cache = o.past_key_values
            out.append(int(o.logits[0, -1].argmax()))
            cur = torch.tensor([[out[-1]]])
        return out

    def bits(cfg: tuple) -> float:
        return sum(4 + (32 / g if mode == "channel" else 32 / 64) for mode, g in cfg) / 2  # head_dim 64

    configs = {
        "lynx default: K channel/256, V channel/32": (("channel", 256), ("channel", 32)),
        "K channel/256, V token": (("channel", 256), ("token", 1)),
        "K channel/64, V channel/64": (("channel", 64), ("channel", 64)),
        "K channel/32, V channel/64": (("channel", 32), ("channel", 64)),
        "K token, V token (int4 per token-head)": (("token", 1), ("token", 1)),
    }
    refs = [greedy(p.token_ids, None) for p in prompts]
    sys.stdout.write(f"{'anchor grouping':42s} {'bits/value':>10s}  first divergence (of {args.tokens}) per prompt\n")
    for name, cfg in configs.items():
        divs = []
        for p, ref in zip(prompts, refs, strict=True):
            got = greedy(p.token_ids, cfg)
            divs.append(next((i for i, (a, b) in enumerate(zip(got, ref, strict=True)) if a != b), args.tokens))
        sys.stdout.write(f"{name:42s} {bits(cfg):10.3f}  mean {statistics.mean(divs):5.1f}, median "
                         f"{statistics.median(divs):5.1f}: {divs}\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
