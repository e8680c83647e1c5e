"""Where GPU results differ from the CPU reference, and why (run by benchmarks/gpu/kernel_check.sh).

The reference is the torch twin on the CPU: the Triton interpreter equals it bit for bit (tests/kernels). On the
GPU, for the Triton twin tests' shapes, this compares with that reference, byte by byte: the torch twin on CUDA
tensors, and the Triton kernels compiled with FMA contraction off (what the codec uses) and on (Triton's
default): the anchor plane (codes and fp16 scale/min), the residual plane, and the caches that decode_anchor and
merge_residual write from the reference planes.
Prints one JSON line per case and writes them all with --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch
from gpu_codec import cuda_missing  # this folder's script (run as a script: its folder is on sys.path)
from lynx_connector.kernels import lynx_triton

from lynx_connector.codec import KVLayout, decode_anchor, encode, get_codec, merge_residual, plane_nbytes

H, BS = 2, 32
GPU = "cuda"
CASES = [  # (backend, isa, dtype, head size, K grouping, V grouping), as in tests/kernels/test_triton_twins.py
    ("cpu", "vec", "float32", 64, "channel", "token"),
    ("cpu", "amx", "bfloat16", 64, "channel", "channel"),
    ("flash", None, "bfloat16", 64, "channel", "channel"),
    ("flash", None, "float32", 128, "token", "channel"),
    ("flash", None, "bfloat16", 128, "token", "token"),
    ("flash", None, "float16", 128, "channel", "token"),
]


def _diff(a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
    a, b = a.cpu().contiguous().view(torch.uint8).flatten(), b.cpu().contiguous().view(torch.uint8).flatten()
    where = (a != b).nonzero().flatten()
    return {"bytes": int(a.numel()), "differ": int(where.numel()), "first": where[:4].tolist()}


def run_case(backend: str, isa: str | None, dtype_name: str, d: int, kg: str, vg: str) -> dict[str, Any]:
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(d)
    src = (torch.randn(5, H, BS, 2 * d, generator=gen) * 3).to(dtype)
    src[1, 0, :, :8] = 0.5
    base = torch.randn(src.shape, generator=gen).to(dtype)
    layout = KVLayout.cpu(H, BS, d, dtype, isa=isa) if backend == "cpu" else KVLayout.flash(H, BS, d, dtype)
    codec = get_codec("lynx", k_group=kg, v_group=vg, k_group_tokens=32, v_group_tokens=16)
    t, ids = 2 * BS + 11, [3, 1, 4]
    na, nr = plane_nbytes(codec, layout, t)

    def run(device: str, impl: str, fusion: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        lynx_triton.FP_FUSION = fusion
        s = src.to(device)
        a, r = torch.zeros(na, dtype=torch.uint8, device=device), torch.zeros(nr, dtype=torch.uint8, device=device)
        encode(codec, s, ids, layout, t, a, r, impl=impl)
        # decode the CPU reference planes, so that decode differences are the decoder's own
        ra, rr = ref_planes[0].to(device), ref_planes[1].to(device)
        o_anchor, o_full = base.to(device).clone(), base.to(device).clone()
        decode_anchor(codec, ra, o_anchor, ids, layout, t, impl=impl)
        merge_residual(codec, ra, rr, o_full, ids, layout, t, impl=impl)
        return a, r, o_anchor, o_full

    ref_planes: tuple[torch.Tensor, torch.Tensor] = (torch.zeros(na, dtype=torch.uint8),
                                                     torch.zeros(nr, dtype=torch.uint8))
    encode(codec, src, ids, layout, t, ref_planes[0], ref_planes[1], impl="torch")
    ref = run("cpu", "torch", False)
    out: dict[str, Any] = {"case": [backend, isa, dtype_name, d, kg, vg], "anchor_bytes": na, "residual_bytes": nr}
    for name, (device, impl, fusion) in {"cuda_torch": (GPU, "torch", False),
                                         "triton_fma_off": (GPU, "triton", False),
                                         "triton_fma_on": (GPU, "triton", True)}.items():
        try:
            got = run(device, impl, fusion)
            out[name] = {part: _diff(x, y) for part, x, y in zip(("anchor", "residual", "decoded_anchor",
                                                                   "decoded_merged"), ref, got, strict=True)}
        except Exception as e:  # a diagnostic: record and go on
            out[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
    lynx_triton.FP_FUSION = False
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--smoke-cpu", action="store_true",
                   help="'cuda' runs on the CPU (Triton needs TRITON_INTERPRET=1): checks the script, not the GPU")
    args = p.parse_args(argv)
    global GPU
    if args.smoke_cpu:
        GPU = "cpu"
    elif cuda_missing():
        return 2
    rows = []
    for case in CASES:
        rows.append(run_case(*case))
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"bench": "gpu_exact_diag", "device": torch.cuda.get_device_name(0) if GPU == "cuda" else "cpu",
                       "rows": rows}, f, indent=1)
    ok = all("error" not in r["triton_fma_off"] and all(v["differ"] == 0 for v in r["triton_fma_off"].values())
             for r in rows)
    print(f"Triton (FMA off) equals the CPU reference in every case: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
