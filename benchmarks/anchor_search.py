"""Search the Lynx anchor format by what speculation needs (issue 17): greedy agreement with full precision and
dNLL on real text, with the attention-output error under the model's real queries, not only KV vNMSE.

Real model (the prepared SmolLM2-135M-Instruct, fp32, in transformers; no vLLM, no transfer) and real text (Paul
Graham essays). Every candidate is a quantize-dequantize of the prompt KV (post-RoPE K and V, the values vLLM's
cache holds) by :func:`fake_quant`, which is bit-exact with the codec's torch twin
(``kernels/groupquant_ref``) for the groupings the codec has (checked at start-up, see :func:`self_check`).

Per candidate:

* ``bits``: anchor wire bits/value at head_dim 64 and 1024 tokens, metadata included (budget 4.6);
* ``vnmse_k/v`` (anchor) and ``full_vnmse_k/v`` (anchor + residual, target <= 5e-5), pooled over the windows;
* ``attn_err``: ||o - o_exact||^2 / ||o_exact||^2 of every layer's attention output for the continuation's real
  queries (pooled over layers and windows), with the candidate's context KV against the exact one, the rest of the
  layer's inputs equal (a probe in the attention function); ``attn_err_k`` / ``attn_err_v``: only K / only V
  quantized; ``sink_share``: mean attention weight on the first token;
* ``dnll``: mean paired per-window NLL difference to exact KV over the continuation tokens X[1:] (the context C's KV
  quantized, X's own KV exact: what ``lynx bench accuracy`` scores), with a t 95% interval;
* ``first_div``: mean first position (of ``--tokens``) where greedy decoding on the candidate's prompt KV leaves
  decoding on the exact KV (``benchmarks/anchor_agreement.py``'s measure, same summary prompts);
  ``first_div_ref`` (``--reference``): the same against one candidate's tokens, e.g. lynx full's (the progressive
  row with every layer's residual landed), which is what D verifies the anchor's tokens against.

    .venv/bin/python benchmarks/anchor_search.py --prompts 16 --windows 8 --out benchmarks/results/anchor_search.json
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from lynx_connector.lab.data import first_difference

HEAD_DIM, TOKENS_FOR_BITS, BUDGET_BITS, FULL_TARGET = 64, 1024, 4.6, 5e-5
EXACT = "exact"  # the greedy tokens on the exact prompt KV, beside the candidates' (:func:`agreement`)


@dataclass(frozen=True)
class TensorFmt:
    """How one of K / V is quantized: ``group`` token | channel | hadamard (token groups after a randomized
    Hadamard rotation), ``tokens`` per channel group, ``bits`` of the anchor (the residual gets 8 - bits),
    ``fp32_meta`` keeps the group minimum and scale unrounded (diagnosis only: not a wire format)."""

    group: str = "token"
    tokens: int = 64
    bits: int = 4
    fp32_meta: bool = False
    #: symmetric groups: one fp16 scale (absmax / (2^(bits-1) - 1)), no minimum, codes in [-L, L]
    symmetric: bool = False
    #: token groups only: this many channels per head (the largest |x| over the prompt) sent at int8 per channel
    #: instead, the token groups taken over the others
    outliers: int = 0

    def bits_per_value(self, t: int, d: int) -> float:
        groups = t if self.group in ("token", "hadamard") else math.ceil(t / self.tokens) * d
        meta = 16.0 if self.symmetric else 32.0
        o = self.outliers
        return (self.bits * (d - o) + 8 * o) / d + meta * groups / (t * d) + 32.0 * o / (t * d)


@dataclass(frozen=True)
class Fmt:
    """A candidate anchor: K and V formats, and ``sink`` first tokens sent as int8 per token (no residual)."""

    name: str
    k: TensorFmt
    v: TensorFmt
    sink: int = 0
    notes: str = ""
    #: layers whose K and V anchors get ``hi_bits`` instead (mixed precision across layers; ``layers`` in all)
    hi_layers: tuple[int, ...] = ()
    hi_bits: int = 5
    layers: int = 30
    #: layers whose residual has landed too (D's KV part-way through the residual: not a wire format, the state a
    #: re-draft would decode on; they count anchor + residual bits)
    full_layers: tuple[int, ...] = ()

    def at(self, layer: int) -> tuple[TensorFmt, TensorFmt]:
        """The K and V formats of one layer."""
        if layer in self.hi_layers:
            return replace(self.k, bits=self.hi_bits), replace(self.v, bits=self.hi_bits)
        return self.k, self.v

    def bits(self, t: int = TOKENS_FOR_BITS, d: int = HEAD_DIM) -> float:
        s = min(self.sink, t)
        rest = t - s
        per_layer = []
        for i in range(self.layers if self.hi_layers or self.full_layers else 1):
            total = s * d * 2 * (8 + 32.0 / d)
            for f in self.at(i):
                residual = 8 - f.bits if i in self.full_layers else 0
                total += rest * d * (f.bits_per_value(rest, d) + residual) if rest else 0.0
            per_layer.append(total / (2 * t * d))
        return statistics.mean(per_layer)


def _hadamard(d: int) -> torch.Tensor:
    from lynx_connector.codec.hadamard import _rotation

    return _rotation(d)


def fake_quant(x: torch.Tensor, f: TensorFmt, sink: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchor, full) reconstructions of x [T, H, D] fp32 under ``f``: asymmetric, fp16 minimum rounded down and
    scale rounded up (as the codec), anchor code round-to-nearest, residual = midpoint of its (s / 2^rbits) cell."""
    from lynx_connector.kernels.fp16_meta import round_down_fp16, round_up_fp16

    if sink:
        a_s, _ = fake_quant(x[:sink], TensorFmt("token", bits=8))
        a_r, f_r = fake_quant(x[sink:], f) if x.shape[0] > sink else (x[:0], x[:0])
        return torch.cat((a_s, a_r)), torch.cat((a_s, f_r))
    if f.outliers:
        if f.group != "token":
            raise ValueError("outlier channels are a token-group option")
        t, h, d = x.shape
        order = x.abs().amax(0).argsort(-1, descending=True)  # [H, D]
        out_idx, keep_idx = order[:, :f.outliers].sort(-1).values, order[:, f.outliers:].sort(-1).values
        o_x = torch.gather(x, 2, out_idx.expand(t, h, -1))
        o_a, _ = fake_quant(o_x, TensorFmt("channel", tokens=t, bits=8))  # int8: the anchor is the whole value
        k_a, k_f = fake_quant(torch.gather(x, 2, keep_idx.expand(t, h, -1)), TensorFmt(
            "token", bits=f.bits, fp32_meta=f.fp32_meta, symmetric=f.symmetric))
        anchor, full = torch.empty_like(x), torch.empty_like(x)
        for z, kept in ((anchor, k_a), (full, k_f)):
            z.scatter_(2, out_idx.expand(t, h, -1), o_a)
            z.scatter_(2, keep_idx.expand(t, h, -1), kept)
        return anchor, full
    levels, cells = (1 << f.bits) - 1, 1 << (8 - f.bits)
    t = x.shape[0]
    y = x @ _hadamard(x.shape[-1]) if f.group == "hadamard" else x
    if f.group == "channel":
        pad = (-t) % f.tokens
        if pad:
            y = torch.cat((y, y[-1:].expand(pad, *y.shape[1:])), 0)
        g, dim = y.view(-1, f.tokens, *y.shape[1:]), 1
    else:
        g, dim = y, -1
    lo, hi = g.amin(dim, keepdim=True), g.amax(dim, keepdim=True)
    if f.symmetric:  # codes in [-L, L] around 0: the "minimum" is -L scales
        half = (1 << (f.bits - 1)) - 1
        amax = torch.maximum(hi, -lo)
        s = amax / half if f.fp32_meta else round_up_fp16(amax / half).float()
        mn, levels = -half * s, 2 * half
    elif f.fp32_meta:
        mn, s = lo, (hi - lo) / levels
    else:
        mn = round_down_fp16(lo).float()
        s = round_up_fp16((hi - mn) / levels).float()
    safe = torch.where(s > 0, s, torch.ones_like(s))
    a = torch.floor((g - mn) / safe + 0.5).clamp_(0, levels)
    anchor = mn + s * a
    r = torch.floor((g - anchor) / (safe / cells)).clamp_(-cells // 2, cells // 2 - 1)
    full = mn + (s / (2 * cells)) * (a * 2 * cells + r * 2 + 1)
    out = []
    for z in (anchor, full):
        z = z.reshape(-1, *x.shape[1:])[:t] if f.group == "channel" else z
        out.append(z @ _hadamard(x.shape[-1]).T if f.group == "hadamard" else z)
    return out[0], out[1]


def self_check() -> None:
    """fake_quant == the codec's torch twin (anchor and full) for token and channel groups, bit for bit."""
    from lynx_connector.kernels.groupquant_ref import dequantize_ref, quantize_ref

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(300, 3, 64, generator=gen) * torch.linspace(0.1, 8, 64)
    for mode, g in (("token", 1), ("channel", 32), ("channel", 256)):
        p = quantize_ref(x, mode, g, 15, True)
        want_a = dequantize_ref(p.codes, None, p.scale, p.mn, mode, g)
        want_f = dequantize_ref(p.codes, p.residual, p.scale, p.mn, mode, g)
        got_a, got_f = fake_quant(x, TensorFmt(mode, g))
        if not (torch.equal(want_a, got_a) and torch.equal(want_f, got_f)):
            raise AssertionError(f"fake_quant differs from groupquant_ref for {mode}/{g}")


def candidates() -> list[Fmt]:
    T, C, H = (lambda **kw: TensorFmt("token", **kw)), (lambda g, **kw: TensorFmt("channel", g, **kw)), \
        TensorFmt("hadamard")
    return [
        Fmt("lynx today: K ch/256, V ch/32", C(256), C(32), notes="the codec's default"),
        Fmt("int4: K tok, V tok", T(), T()),
        Fmt("int4_kivi: K ch/64, V tok", C(64), T()),
        Fmt("K ch/256, V tok", C(256), T()),
        Fmt("K ch/128, V tok", C(128), T()),
        Fmt("K had, V tok", H, T()),
        Fmt("K had, V had", H, H),
        Fmt("K ch/128, V had", C(128), H),
        Fmt("K ch/256, V ch/32, sink 1", C(256), C(32), sink=1),
        Fmt("K ch/256, V tok, sink 1", C(256), T(), sink=1),
        Fmt("K ch/128, V tok, sink 1", C(128), T(), sink=1),
        Fmt("K ch/64, V tok, sink 1", C(64), T(), sink=1),
        Fmt("K had, V tok, sink 1", H, T(), sink=1),
        Fmt("K ch/128, V had, sink 1", C(128), H, sink=1),
        Fmt("K ch/256, V ch/32, fp32 meta", C(256, fp32_meta=True), C(32, fp32_meta=True),
            notes="diagnosis: metadata unrounded"),
        Fmt("5+3: K ch/256, V tok", C(256, bits=5), T(bits=5), notes="over the budget: the 5+3 reference"),
        Fmt("sym: K ch/64 sym, V tok sym", C(64, symmetric=True), T(symmetric=True)),
        Fmt("sym: K ch/32 sym, V tok sym", C(32, symmetric=True), T(symmetric=True)),
        Fmt("sym: K ch/64, V tok sym", C(64), T(symmetric=True)),
        Fmt("sym: K ch/32 sym, V tok", C(32, symmetric=True), T()),
        Fmt("outlier: K tok + 1 outlier ch int8, V tok", T(outliers=1), T()),
        Fmt("outlier: K tok + 2 outlier ch int8, V tok", T(outliers=2), T()),
        Fmt("mixed: K ch/64, V tok, layers 0-2 at 5 bits", C(64), T(), hi_layers=(0, 1, 2)),
        Fmt("mixed: K ch/64, V tok, layers 27-29 at 5 bits", C(64), T(), hi_layers=(27, 28, 29)),
        Fmt("mixed: K ch/64, V tok, layers 0, 10, 20 at 5 bits", C(64), T(), hi_layers=(0, 10, 20)),
        Fmt("mixed: K ch/64, V tok, layers 13-15 at 5 bits", C(64), T(), hi_layers=(13, 14, 15)),
        *(Fmt(f"progressive: default, residual of layers {lo}-{hi - 1} landed", C(64), T(),
              full_layers=tuple(range(lo, hi)), notes="D's KV part-way through the residual: not a wire format")
          for lo, hi in ((0, 8), (0, 15), (15, 30), (0, 23), (0, 30))),
    ]


# ---- the attention probe --------------------------------------------------------------------------------------
@dataclass
class Probe:
    """Set by the caller around a scored forward: the exact context K/V per layer ([1, H, Tc, D]), and sums."""

    exact: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    sums: dict[str, float] = field(default_factory=dict)
    active: bool = False

    def add(self, key: str, value: float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + value


PROBE = Probe()


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int, scaling: float):
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    tq, tk = q.shape[2], k.shape[2]
    s = (q @ k.transpose(2, 3)) * scaling
    mask = torch.arange(tk)[None, :] > (torch.arange(tq)[:, None] + tk - tq)
    p = s.masked_fill(mask, float("-inf")).softmax(-1)
    return p @ v, p


def probe_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Causal attention (batch 1, no padding); while PROBE is active, also the exact-context references."""
    g = module.num_key_value_groups
    if not PROBE.active and query.shape[2] in (1, key.shape[2]):  # decode step or prefill: SDPA, same math
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, scale=scaling, is_causal=query.shape[2] > 1, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    out, p = _attend(query, key, value, g, scaling)
    if PROBE.active and module.layer_idx in PROBE.exact:
        ke, ve = PROBE.exact[module.layer_idx]
        tc = ke.shape[2]
        k_ex, v_ex = torch.cat((ke, key[:, :, tc:]), 2), torch.cat((ve, value[:, :, tc:]), 2)
        ref, p_ref = _attend(query, k_ex, v_ex, g, scaling)
        only_k, _ = _attend(query, key, v_ex, g, scaling)
        only_v, _ = _attend(query, k_ex, value, g, scaling)
        den = float(ref.double().pow(2).sum())
        for name, o in (("attn_err", out), ("attn_err_k", only_k), ("attn_err_v", only_v)):
            PROBE.add(name, float((o.double() - ref.double()).pow(2).sum()))
        PROBE.add("attn_den", den)
        PROBE.add("sink_share", float(p_ref[..., 0].sum()))
        PROBE.add("queries", float(p_ref[..., 0].numel()))
    return out.transpose(1, 2).contiguous(), None


# ---- measurements ---------------------------------------------------------------------------------------------
def quantize_cache(cache, f: Fmt, stats: dict[str, float] | None = None, row: int = 0) -> None:
    """Replace batch row ``row`` of every layer's K and V by the candidate's anchor (``stats``: error sums)."""
    for i, layer in enumerate(cache.layers):
        for attr, tf in zip(("keys", "values"), f.at(i), strict=True):
            t = getattr(layer, attr)[row]  # [H, T, D]
            x = t.transpose(0, 1).contiguous()
            a, full = fake_quant(x, tf, f.sink)
            if i in f.full_layers:
                a = full
            if stats is not None:
                tag = attr[0]
                x64 = x.double()
                stats[f"n_{tag}"] = stats.get(f"n_{tag}", 0.0) + float(x64.pow(2).sum())
                stats[f"e_{tag}"] = stats.get(f"e_{tag}", 0.0) + float((a.double() - x64).pow(2).sum())
                stats[f"ef_{tag}"] = stats.get(f"ef_{tag}", 0.0) + float((full.double() - x64).pow(2).sum())
            t.copy_(a.transpose(0, 1))


def mean_ci(values: list[float]) -> tuple[float, float]:
    from lynx_connector.lab.bench.accuracy import mean_ci as _mean_ci

    m, (lo, hi) = _mean_ci(values)
    return m, (m - lo if lo is not None else float("nan"))


@torch.no_grad()
def score_windows(model, windows, fmts: list[Fmt], cont: int) -> dict[str, dict]:
    """dNLL, KV vNMSE and attention-output error per candidate over the perplexity windows."""
    per: dict[str, dict] = {f.name: {"stats": {}, "probe": {}, "dnll": []} for f in fmts}
    sink_norms: dict[str, list[float]] = {}
    per["_sink_norms"] = sink_norms
    for w in windows:
        c, x = w[:-cont], w[-cont:]
        base = model(torch.tensor([c]), use_cache=True).past_key_values
        PROBE.exact = {i: (lay.keys.clone(), lay.values.clone()) for i, lay in enumerate(base.layers)}
        for lay in base.layers:  # the first token's K and V norms against the median token's, per layer and head
            for tag, z in (("k", lay.keys[0]), ("v", lay.values[0])):
                n = z.norm(dim=-1)  # [H, T]
                sink_norms.setdefault(tag, []).extend((n[:, 0] / n[:, 1:].median(-1).values).tolist())

        def nll(cache, x=x) -> float:
            lp = model(torch.tensor([x]), past_key_values=cache, use_cache=True).logits[0, :-1].log_softmax(-1)
            return float(-lp.gather(1, torch.tensor(x[1:])[:, None]).mean())

        ref = nll(copy.deepcopy(base))
        for f in fmts:
            cache = copy.deepcopy(base)
            quantize_cache(cache, f, per[f.name]["stats"])
            PROBE.sums, PROBE.active = per[f.name]["probe"], True
            try:
                per[f.name]["dnll"].append(nll(cache) - ref)
            finally:
                PROBE.active = False
    return per


@torch.no_grad()
def agreement(model, prompts, fmts: list[Fmt], tokens: int) -> dict[str, list[list[int]]]:
    """Greedy tokens per candidate and prompt, and the exact KV's (key ``EXACT``). Row 0 of one batch decodes on
    the exact prompt KV, row i + 1 on candidate i's: every candidate is compared with a reference computed in the
    same batched forward (:func:`divergences`)."""
    seqs_by: dict[str, list[list[int]]] = {EXACT: [], **{f.name: [] for f in fmts}}
    b = len(fmts) + 1
    for p in prompts:
        cache = model(torch.tensor([p.token_ids[:-1]]), use_cache=True).past_key_values
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys.repeat(b, 1, 1, 1), layer.values.repeat(b, 1, 1, 1)
        for i, f in enumerate(fmts):
            quantize_cache(cache, f, row=i + 1)
        cur, out = torch.full((b, 1), p.token_ids[-1]), []
        for _ in range(tokens):
            o = model(cur, past_key_values=cache, use_cache=True)
            cache = o.past_key_values
            cur = o.logits[:, -1].argmax(-1, keepdim=True)
            out.append(cur[:, 0].tolist())
        seqs = list(zip(*out, strict=True))
        for name, seq in zip((EXACT, *(f.name for f in fmts)), seqs, strict=True):
            seqs_by[name].append(list(seq))
    return seqs_by


def divergences(seqs: dict[str, list[list[int]]], reference: str = "") -> dict[str, list[int]]:
    """First divergence per candidate and prompt from the reference's tokens: the exact KV's, or (``reference``) a
    candidate's, e.g. lynx full, which is what D verifies the anchor's tokens against."""
    ref = seqs[reference or EXACT]
    return {name: [first_difference(a, r) for a, r in zip(got, ref, strict=True)]
            for name, got in seqs.items() if name != EXACT}


def markdown(result: dict) -> str:
    cfg = result["config"]
    lines = [
        "## Anchor format search (issue 17)", "",
        f"Model {result['model']} (fp32, transformers, CPU); {cfg['windows']} perplexity windows of "
        f"{cfg['window_tokens']} tokens ({cfg['window_tokens'] - cfg['continuation_tokens']} context + "
        f"{cfg['continuation_tokens']} scored); {cfg['prompts']} summary prompts of ~{cfg['context']} essay tokens, "
        f"{cfg['tokens']} greedy tokens. Command: `{result['command']}`; wall {result['wall_s']:.0f} s.", "",
        "| anchor format | bits/value | in budget | vNMSE K | vNMSE V | full vNMSE K | full vNMSE V | attn err | "
        "attn err (K only) | attn err (V only) | dNLL (95% CI) | first divergence mean | median |"
        + (" first divergence from the reference: mean | median |" if cfg.get("reference") else ""),
        "| --- " * (13 + (2 if cfg.get("reference") else 0)) + "|",
    ]
    for r in result["formats"]:
        fd = r.get("first_div") or []
        fr = r.get("first_div_ref") or []
        ref_cells = (f" {statistics.mean(fr):.1f} | {statistics.median(fr):.1f} |" if fr else " - | - |") \
            if cfg.get("reference") else ""
        lines.append(
            f"| {r['name']} | {r['bits']:.3f} | {'yes' if r['in_budget'] else 'no'} | {r['vnmse_k']:.2e} | "
            f"{r['vnmse_v']:.2e} | {r['full_vnmse_k']:.1e} | {r['full_vnmse_v']:.1e} | {r['attn_err']:.2e} | "
            f"{r['attn_err_k']:.2e} | {r['attn_err_v']:.2e} | {r['dnll']:+.4f} (±{r['dnll_ci95']:.4f}) | "
            f"{statistics.mean(fd) if fd else float('nan'):.1f} | {statistics.median(fd) if fd else float('nan'):.1f} |"
            + ref_cells)
    lines += ["", f"Mean attention weight on the first token (exact KV, all layers and heads): "
              f"{result['sink_share']:.3f}. Its norm over the median token's (per layer and head): "
              + ", ".join(f"{tag.upper()} median {r['median']:.2f} (min {r['min']:.2f}, max {r['max']:.2f})"
                          for tag, r in result["sink_norm_ratio"].items()) + ".", "",
              "bits/value: anchor plane at head_dim 64 and 1024 tokens, fp16 metadata included (budget "
              f"{BUDGET_BITS}); vNMSE: ||x - x̂||² / ||x||² pooled over layers and windows (full: anchor + "
              f"residual, target {FULL_TARGET:g}); attn err: the same ratio for the attention outputs of the scored "
              "tokens' real queries (one layer at a time, the rest of its inputs equal); dNLL: paired per-window "
              "NLL difference to exact KV; first divergence: first greedy position (of "
              f"{cfg['tokens']}) that differs from exact KV"
              + (f"; from the reference: the same against greedy decoding on `{cfg['reference']}`'s KV (what D "
                 "verifies the anchor's tokens against when the reference is lynx full)" if cfg.get("reference")
                 else "") + ".", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_utils import AttentionInterface

    from lynx_connector.lab import data
    from lynx_connector.lab.models import prepare

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4, help="summary prompts for greedy agreement (0 = none)")
    ap.add_argument("--context", type=int, default=1024, help="essay tokens per summary prompt")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens compared")
    ap.add_argument("--windows", type=int, default=2, help="perplexity windows")
    ap.add_argument("--window-tokens", type=int, default=1024)
    ap.add_argument("--continuation-tokens", type=int, default=128)
    ap.add_argument("--only", default="", help="comma-separated substrings: run only the formats whose name has one")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reference", default="", help="a substring of one selected candidate's name (e.g. 'layers "
                    "0-29', lynx full): also report each candidate's first divergence from that candidate's tokens")
    ap.add_argument("--out", default=None, help="write JSON here (and the Markdown table beside it)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    torch.set_num_threads(args.threads)
    self_check()
    path = str(prepare())
    tok = AutoTokenizer.from_pretrained(path)
    AttentionInterface.register("lynx_probe", probe_attention)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="lynx_probe").eval()
    fmts = [f for f in candidates() if not args.only or any(s in f.name for s in args.only.split(","))]
    refs = [f.name for f in fmts if args.reference and args.reference in f.name]
    if args.reference and len(refs) != 1:
        ap.error(f"--reference {args.reference!r} must name exactly one selected candidate, got {refs}")
    if args.reference and not args.prompts:
        ap.error("--reference needs greedy prompts (--prompts > 0)")
    windows = data.perplexity_windows(tok, args.window_tokens, args.windows)
    per = score_windows(model, windows, fmts, args.continuation_tokens)
    prompts = [data.build_summary_prompt(tok, args.context, seed=5 * i + 1) for i in range(args.prompts)]
    seqs = agreement(model, prompts, fmts, args.tokens) if prompts else {}
    divs = divergences(seqs) if seqs else {}
    divs_ref = divergences(seqs, refs[0]) if refs else {}
    rows = []
    for f in fmts:
        st, pr = per[f.name]["stats"], per[f.name]["probe"]
        m, half = mean_ci(per[f.name]["dnll"])
        rows.append({"name": f.name, "format": asdict(f), "bits": f.bits(), "in_budget": f.bits() <= BUDGET_BITS,
                     "vnmse_k": st["e_k"] / st["n_k"], "vnmse_v": st["e_v"] / st["n_v"],
                     "full_vnmse_k": st["ef_k"] / st["n_k"], "full_vnmse_v": st["ef_v"] / st["n_v"],
                     **{k: pr[k] / pr["attn_den"] for k in ("attn_err", "attn_err_k", "attn_err_v")},
                     "dnll": m, "dnll_ci95": half, "dnll_windows": per[f.name]["dnll"],
                     "first_div": divs.get(f.name, []),
                     **({"first_div_ref": divs_ref[f.name]} if refs else {})})
        pr0 = pr
    result = {"bench": "anchor_search", "model": Path(path).name, "command": " ".join(["benchmarks/anchor_search.py",
              *(argv if argv is not None else sys.argv[1:])]),
              "config": {"prompts": args.prompts, "context": args.context, "tokens": args.tokens,
                         "windows": args.windows, "window_tokens": args.window_tokens,
                         "continuation_tokens": args.continuation_tokens,
                         **({"reference": refs[0]} if refs else {})},
              "sink_share": pr0["sink_share"] / pr0["queries"],
              "sink_norm_ratio": {tag: {"median": statistics.median(x), "min": min(x), "max": max(x)}
                                  for tag, x in per["_sink_norms"].items()},
              "formats": rows,
              "wall_s": time.perf_counter() - t0}
    md = markdown(result)
    sys.stdout.write(md + "\n")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        Path(args.out).with_suffix(".md").write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
