"""Launch-shape sweep of the Lynx Triton kernels on a GPU (run by benchmarks/gpu/kernel_check.sh).

For warps per program x token rows per program (token-grouped parts; channel-grouped parts take their group's
tokens), times encode, decode_anchor and merge_residual of the default Lynx codec at the paper's KV shape
(8 KV heads x 128, bf16, FlashAttention layout, 16K tokens) over --layers layers, in GB/s of source KV bytes
(best of --repeats, CUDA events), beside a device copy of the same bytes. Writes JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch
from gpu_codec import cuda_best as best  # this folder's script (run as a script: its folder is on sys.path)
from gpu_codec import cuda_missing
from lynx_connector.kernels import lynx_triton

from lynx_connector.codec import KVLayout, get_codec, plane_nbytes
from lynx_connector.codec.triton_path import decode_triton, encode_triton


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--warps", default="1,2,4,8")
    p.add_argument("--rows", default="16,32,64,128")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if cuda_missing():
        return 2
    t, h, d, bs, dtype = args.tokens, 8, 128, 16, torch.bfloat16
    layout = KVLayout.flash(h, bs, d, dtype)
    codec = get_codec("lynx")
    need = -(-t // bs)
    caches = []
    for _ in range(args.layers):
        kv = torch.randn(2 * need + 1, h, bs, 2 * d, device="cuda", dtype=dtype)
        kv[..., : d // 16] *= 8.0  # outlier key channels
        ids = torch.randperm(2 * need + 1, device="cuda")[:need]
        caches.append((kv, ids))
    na, nr = plane_nbytes(codec, layout, t)
    planes = [(torch.zeros(na, dtype=torch.uint8, device="cuda"), torch.zeros(nr, dtype=torch.uint8, device="cuda"))
              for _ in caches]
    outs = [torch.zeros_like(kv) for kv, _ in caches]
    src_bytes = 2 * t * h * d * dtype.itemsize * args.layers
    flat = [kv.view(-1) for kv, _ in caches]
    copy_dst = [torch.empty(2 * t * h * d, dtype=dtype, device="cuda") for _ in caches]
    copy_s = best(lambda: [dst.copy_(f[: dst.numel()]) for dst, f in zip(copy_dst, flat, strict=True)], args.repeats)
    result: dict[str, Any] = {"bench": "gpu_tune", "device": torch.cuda.get_device_name(0), "tokens": t,
                              "layers": args.layers, "codec": repr(codec), "src_bytes": src_bytes,
                              "copy_gbps": src_bytes / copy_s / 1e9, "rows": []}
    print(f"copy {result['copy_gbps']:.0f} GB/s", flush=True)
    for warps in (int(x) for x in args.warps.split(",")):
        for rows in (int(x) for x in args.rows.split(",")):
            lynx_triton.NUM_WARPS = warps

            def enc(rows: int = rows) -> None:
                for (kv, ids), (a, r) in zip(caches, planes, strict=True):
                    encode_triton(codec, kv, ids, layout, t, a, r, "tune", block_rows=rows)

            def dec(res: bool, rows: int = rows) -> None:
                for (_, ids), (a, r), o in zip(caches, planes, outs, strict=True):
                    decode_triton(codec, a, r if res else None, o, ids, layout, t, block_rows=rows)

            row = {"num_warps": warps, "block_rows": rows,
                   "encode_gbps": src_bytes / best(enc, args.repeats) / 1e9,
                   "decode_anchor_gbps": src_bytes / best(lambda: dec(False), args.repeats) / 1e9,
                   "merge_residual_gbps": src_bytes / best(lambda: dec(True), args.repeats) / 1e9}
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
    lynx_triton.NUM_WARPS = 4
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
