"""GPU codec check (run by benchmarks/gpu/kernel_check.sh on the lent GPU machine, and by run.sh).

1. Throughput: every codec's encode (P: paged KV -> planes) and decode (D: planes -> paged KV; Lynx: anchor,
   then merge of the residual) on a CUDA paged cache in vLLM's FlashAttention layout, timed with CUDA events
   (best of --repeats), in GB/s of the request's source KV bytes, next to a device-to-device copy of the same
   bytes and a paged gather (index_select) of them.
2. Bit-exactness: for every codec with Triton kernels (lynx, int4, int4_kivi), the Triton path and the torch
   twin on the same CUDA tensors must give identical planes and identical decoded caches.

Shapes default to the paper's model (Qwen3-32B: 64 layers, 8 KV heads, head size 128, bf16) at 16K tokens.
The KV is synthetic but shaped like real KV: Gaussian with a few large-magnitude key channels (the outliers
that make per-token 4-bit keys hard). Writes JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch

from lynx_connector.codec import KVLayout, decode_anchor, encode, get_codec, merge_residual
from lynx_connector.lab.bench import common

CODECS = ("lynx", "int4", "int4_kivi", "int8", "fp8", "bf16")
TRITON_CODECS = ("lynx", "int4", "int4_kivi")
DEVICE = "cuda"  # --smoke-cpu switches to "cpu" (torch path, wall clock): checks the script, not the GPU


def make_cache(args: argparse.Namespace, layer: int) -> tuple[torch.Tensor, KVLayout, torch.Tensor]:
    dtype = getattr(torch, args.dtype)
    layout = KVLayout.flash(args.kv_heads, args.block_size, args.head_size, dtype)
    need = -(-args.tokens // args.block_size)
    num_blocks = 2 * need + 1
    gen = torch.Generator(device="cpu").manual_seed(layer)
    block_ids = torch.randperm(num_blocks, generator=gen)[:need].to(DEVICE)
    kv = torch.zeros(num_blocks, args.kv_heads, args.block_size, 2 * args.head_size, dtype=dtype, device=DEVICE)
    g = torch.Generator(device=DEVICE).manual_seed(1000 + layer)
    k = torch.randn(args.tokens, args.kv_heads, args.head_size, device=DEVICE, generator=g)
    k[:, :, : args.head_size // 16] *= 8.0  # outlier key channels
    v = torch.randn(args.tokens, args.kv_heads, args.head_size, device=DEVICE, generator=g)
    layout.scatter(kv, block_ids, args.tokens, k.to(dtype), v.to(dtype))
    return kv, layout, block_ids


def cuda_missing() -> bool:
    """True, said on stderr, when torch sees no CUDA device (the GPU scripts then exit with status 2)."""
    if torch.cuda.is_available():
        return False
    sys.stderr.write("no CUDA device: this script needs an NVIDIA GPU\n")
    return True


def cuda_best(fn: Any, repeats: int) -> float:
    if DEVICE == "cpu":
        return common.best_time(fn, repeats=repeats)
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def bench(args: argparse.Namespace) -> dict[str, Any]:
    caches = [make_cache(args, i) for i in range(args.layers)]
    t, h, d = args.tokens, args.kv_heads, args.head_size
    dtype = getattr(torch, args.dtype)
    kv_bytes = 2 * t * h * d * dtype.itemsize * args.layers
    srcs = [torch.empty(2 * t * h * d * dtype.itemsize, dtype=torch.uint8, device=DEVICE) for _ in caches]
    dsts = [torch.empty_like(s) for s in srcs]

    def copy_all() -> None:
        for s, dst in zip(srcs, dsts, strict=True):
            dst.copy_(s)

    def gather_all() -> None:
        for kv, lay, ids in caches:
            lay.gather(kv, ids, t)

    result: dict[str, Any] = {"bench": "gpu_codec", "tokens": t, "layers": args.layers, "kv_heads": h,
                              "head_size": d, "dtype": args.dtype, "block_size": args.block_size,
                              "kv_bytes": kv_bytes,
                              "device": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu (smoke)",
                              "copy_gbps": common.gbps(kv_bytes, cuda_best(copy_all, args.repeats)),
                              "gather_gbps": common.gbps(kv_bytes, cuda_best(gather_all, args.repeats)),
                              "rows": [], "exact": []}
    for name in args.codecs.split(","):
        row = bench_codec(name, caches, t, h, d, dtype, kv_bytes, args.repeats)
        row["encode_vs_copy"] = row["encode_gbps"] / result["copy_gbps"]
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        if name in TRITON_CODECS:
            a_nb, r_nb = get_codec(name).plane_nbytes(t, h, d, dtype)
            result["exact"].append(exactness(get_codec(name), caches, t, a_nb, r_nb))
            print(json.dumps(result["exact"][-1]), flush=True)
    return result


def bench_codec(name: str, caches: list, t: int, h: int, d: int, dtype: torch.dtype, kv_bytes: int,
                repeats: int) -> dict[str, Any]:
    codec = get_codec(name)
    a_nb, r_nb = codec.plane_nbytes(t, h, d, dtype)
    anchors = [torch.zeros(a_nb, dtype=torch.uint8, device=DEVICE) for _ in caches]
    residuals = [torch.zeros(r_nb, dtype=torch.uint8, device=DEVICE) if r_nb else None for _ in caches]
    outs = [torch.zeros_like(kv) for kv, _, _ in caches]
    impl = "triton" if name in TRITON_CODECS and DEVICE == "cuda" else "torch"

    def enc() -> None:
        for (kv, lay, ids), a, r in zip(caches, anchors, residuals, strict=True):
            encode(codec, kv, ids, lay, t, a, r, impl=impl)

    def dec_anchor() -> None:
        for (_, lay, ids), a, o in zip(caches, anchors, outs, strict=True):
            decode_anchor(codec, a, o, ids, lay, t, impl=impl)

    def dec_full() -> None:
        for (_, lay, ids), a, r, o in zip(caches, anchors, residuals, outs, strict=True):
            merge_residual(codec, a, r, o, ids, lay, t, impl=impl)

    row: dict[str, Any] = {"codec": name, "impl": impl, "bits_per_value": 8 * (a_nb + r_nb) / (2 * t * h * d),
                           "anchor_bits_per_value": 8 * a_nb / (2 * t * h * d)}
    row["encode_gbps"] = common.gbps(kv_bytes, cuda_best(enc, repeats))
    row["decode_anchor_gbps"] = common.gbps(kv_bytes, cuda_best(dec_anchor, repeats))
    if r_nb:
        row["merge_residual_gbps"] = common.gbps(kv_bytes, cuda_best(dec_full, repeats))
    return row


def exactness(codec: Any, caches: list, t: int, a_nb: int, r_nb: int) -> dict[str, Any]:
    """Triton vs torch twin on the same CUDA tensors: planes and decoded caches must be identical. Both decodes
    start from the torch twin's planes, so a decode difference is the decode kernel's, not the encoder's."""
    kv, lay, ids = caches[0]
    impls = ("triton", "torch") if DEVICE == "cuda" else ("torch", "torch")  # --smoke-cpu: the script's logic
    planes, decoded = [], []
    for impl in impls:
        a = torch.zeros(a_nb, dtype=torch.uint8, device=DEVICE)
        r = torch.zeros(r_nb, dtype=torch.uint8, device=DEVICE) if r_nb else None
        encode(codec, kv, ids, lay, t, a, r, impl=impl)
        planes.append((a, r))
    a, r = planes[1]
    for impl in impls:
        o_anchor, o_full = torch.zeros_like(kv), torch.zeros_like(kv)
        decode_anchor(codec, a, o_anchor, ids, lay, t, impl=impl)
        if r is not None:
            merge_residual(codec, a, r, o_full, ids, lay, t, impl=impl)
        decoded.append((o_anchor, o_full))
    return {"codec": codec.name, "impls": list(impls),
            "anchor_plane_equal": bool(torch.equal(planes[0][0], planes[1][0])),
            "residual_plane_equal": None if r is None else bool(torch.equal(planes[0][1], planes[1][1])),
            "decode_anchor_equal": bool(torch.equal(decoded[0][0], decoded[1][0])),
            "merge_residual_equal": None if r is None else bool(torch.equal(decoded[0][1], decoded[1][1]))}


def markdown(result: dict[str, Any]) -> str:
    """A readable table of one run's JSON."""
    gib = result["kv_bytes"] / 2**30
    lines = [f"## GPU codec kernels: {result['device']}",
             "",
             f"KV of one request: {result['tokens']} tokens x {result['layers']} layers x {result['kv_heads']} KV heads "
             f"x {result['head_size']} ({result['dtype']}, block {result['block_size']}, FlashAttention layout): "
             f"{gib:.2f} GiB. GB/s are source KV bytes per second (best of {result['repeats']}, CUDA events). "
             f"Device-to-device copy of the same bytes: {result['copy_gbps']:.0f} GB/s; paged gather (index_select): "
             f"{result['gather_gbps']:.0f} GB/s.",
             "",
             "| codec | impl | bits/value | anchor bits/value | encode GB/s | encode / copy | decode anchor GB/s "
             "| merge residual GB/s | encode ms / layer |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["rows"]:
        merge = f"{r['merge_residual_gbps']:.0f}" if "merge_residual_gbps" in r else "-"
        per_layer_ms = result["kv_bytes"] / result["layers"] / (r["encode_gbps"] * 1e9) * 1e3
        lines.append(f"| {r['codec']} | {r['impl']} | {r['bits_per_value']:.2f} | {r['anchor_bits_per_value']:.2f} "
                     f"| {r['encode_gbps']:.0f} | {r['encode_vs_copy']:.2f} | {r['decode_anchor_gbps']:.0f} | {merge} "
                     f"| {per_layer_ms:.3f} |")
    lines += ["", "Triton kernels against their torch twins on the same CUDA tensors (bit-identical required):", "",
              "| codec | anchor plane | residual plane | decoded (anchor) | decoded (merged) |",
              "| --- | --- | --- | --- | --- |"]
    for e in result["exact"]:
        cell = {True: "equal", False: "DIFFERENT", None: "-"}
        lines.append(f"| {e['codec']} | {cell[e['anchor_plane_equal']]} | {cell[e['residual_plane_equal']]} "
                     f"| {cell[e['decode_anchor_equal']]} | {cell[e['merge_residual_equal']]} |")
    lines += ["", f"All exact: {result['all_exact']}. Command: `bash benchmarks/gpu/kernel_check.sh` "
              f"({result.get('timestamp', '-')}, source {result.get('source_commit') or '-'}).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--layers", type=int, default=64)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--codecs", default=",".join(CODECS))
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default=None)
    p.add_argument("--smoke-cpu", action="store_true", help="run on the CPU with the torch path (script check)")
    args = p.parse_args(argv)
    global DEVICE
    if args.smoke_cpu:
        DEVICE = "cpu"
    elif cuda_missing():
        return 2
    result = bench(args)
    result["repeats"] = args.repeats
    result.update(common.environment_info())
    # the device machine gets a copy of the tree without .git: the caller names the commit it sent
    result["source_commit"] = os.environ.get("LYNX_SOURCE_COMMIT") or (result["git"] or {}).get("commit")
    ok = all(v in (True, None) for e in result["exact"] for k, v in e.items() if k.endswith("_equal"))
    result["all_exact"] = ok
    if args.out:
        common.write_json(args.out, result)
        with open(args.out.removesuffix(".json") + ".md", "w") as f:
            f.write(markdown(result))
    print(f"copy {result['copy_gbps']:.0f} GB/s, gather {result['gather_gbps']:.0f} GB/s; all exact: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
