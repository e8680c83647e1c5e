"""Single-stream baselines: ``bf16`` (lossless passthrough of the cache dtype's bytes; the name is the paper's)
and ``fp8`` (e4m3 with an fp16 per (token, head) scale rounded up so ``|x|/scale <= 448``)."""

from __future__ import annotations

import torch

from lynx_connector.kernels.errors import KVRangeError, NonFiniteKVError
from lynx_connector.kernels.fp16_meta import FP16_MAX, round_up_fp16

from .base import Codec, check_plane

E4M3_MAX = 448.0


def _require_finite(x: torch.Tensor, name: str) -> None:
    if not bool(torch.isfinite(x).all()):
        raise NonFiniteKVError(f"{name}: KV contains NaN or inf; refusing to encode")


class PassthroughCodec(Codec):
    """The cache dtype's bytes as they are (K then V, token-major): the unquantized reference. The plane holds P's
    cache dtype (``cache_dtype`` below is the staged dtype); D converts on write when its own cache differs."""

    stages_cache_dtype = True

    def __init__(self, name: str = "bf16") -> None:
        self.name = name

    def plane_nbytes(self, num_tokens: int, num_heads: int, head_size: int, cache_dtype: torch.dtype) -> tuple[int, int]:
        return 2 * num_tokens * num_heads * head_size * cache_dtype.itemsize, 0

    def encode_tokens(self, k, v, anchor_out, residual_out, name):  # type: ignore[override]
        n = k.numel() * k.element_size()
        out = check_plane(anchor_out, 2 * n, "anchor")
        for i, (x, tag) in enumerate(((k, "k"), (v, "v"))):
            _require_finite(x, f"{name}.{tag}")
            out[i * n:(i + 1) * n].view(x.dtype).view(x.shape).copy_(x)

    def decode_tokens(self, anchor, residual, num_tokens, num_heads, head_size, cache_dtype):  # type: ignore[override]
        shape = (num_tokens, num_heads, head_size)
        n = num_tokens * num_heads * head_size * cache_dtype.itemsize
        buf = check_plane(anchor, 2 * n, "anchor")
        return buf[:n].view(cache_dtype).view(shape), buf[n:].view(cache_dtype).view(shape)


class Fp8Codec(Codec):
    """FP8 e4m3 per (token, head) with an fp16 scale. Relative error <= 2^-4 (plus 2^-10*scale near 0)."""

    def __init__(self, name: str = "fp8") -> None:
        self.name = name

    def plane_nbytes(self, num_tokens: int, num_heads: int, head_size: int, cache_dtype: torch.dtype) -> tuple[int, int]:
        return 2 * num_tokens * num_heads * (head_size + 2), 0

    def encode_tokens(self, k, v, anchor_out, residual_out, name):  # type: ignore[override]
        t, h, d = k.shape
        out = check_plane(anchor_out, self.plane_nbytes(t, h, d, k.dtype)[0], "anchor")
        per = t * h * (d + 2)
        for i, (x, tag) in enumerate(((k, "k"), (v, "v"))):
            xf = x.float()
            amax = xf.abs().amax(-1)
            if not bool(torch.isfinite(amax).all()):
                raise NonFiniteKVError(f"{name}.{tag}: KV contains NaN or inf; refusing to encode")
            if bool((amax / E4M3_MAX > FP16_MAX).any()):  # the fp16 scale cannot reach it: refused, not saturated
                raise KVRangeError(f"{name}.{tag}: |KV| up to {float(amax.max()):.4g} exceeds what fp8 with an fp16 "
                                   f"scale holds ({E4M3_MAX * FP16_MAX:.4g})")
            scale = round_up_fp16(amax / E4M3_MAX)
            safe = torch.where(scale > 0, scale.float(), torch.ones_like(amax))
            q = (xf / safe[..., None]).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
            buf = out[i * per:(i + 1) * per]
            buf[:t * h * d].copy_(q.view(torch.uint8).reshape(-1))  # x may be a strided view of one block
            buf[t * h * d:].view(torch.float16).copy_(scale.view(-1))

    def check_metadata(self, anchor, num_tokens, num_heads, head_size, cache_dtype, name):  # type: ignore[override]
        t, h, d = num_tokens, num_heads, head_size
        buf = check_plane(anchor, self.plane_nbytes(t, h, d, cache_dtype)[0], "anchor")
        per = t * h * (d + 2)
        for i, tag in enumerate("kv"):
            if not bool(torch.isfinite(buf[i * per + t * h * d:(i + 1) * per].view(torch.float16)).all()):
                raise NonFiniteKVError(f"{name}.{tag}: anchor plane scale metadata is not finite; refusing to decode")

    def decode_tokens(self, anchor, residual, num_tokens, num_heads, head_size, cache_dtype):  # type: ignore[override]
        t, h, d = num_tokens, num_heads, head_size
        buf = check_plane(anchor, self.plane_nbytes(t, h, d, cache_dtype)[0], "anchor")
        per = t * h * (d + 2)
        out = []
        for i in range(2):
            part = buf[i * per:(i + 1) * per]
            q = part[:t * h * d].view(torch.float8_e4m3fn).view(t, h, d).float()
            scale = part[t * h * d:].view(torch.float16).view(t, h, 1).float()
            out.append(q * scale)
        return out[0], out[1]
