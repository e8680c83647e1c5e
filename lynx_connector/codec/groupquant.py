"""Group-wise asymmetric integer codecs: Lynx 4+4 (two streams) and the INT8 / INT4 / INT4-KIVI baselines.

Plane format (4-bit codes of t*h*d/2 bytes put the fp16 metadata at an odd offset when h*d % 4 == 2 and t is odd:
those views are aligned copies, written back by ``_commit``, so every head size numba accepts works here too):
  anchor   = [K codes | K scale | K min | V codes | V scale | V min]
  residual = [K residual codes | V residual codes]              (Lynx only)
Codes are token-major ``[T, H, D]``; 4-bit codes are packed two per byte along D (low nibble first).
Metadata is fp16 per group (``[T, H]`` for token groups, ``[ceil(T/G), H, D]`` for channel groups), and
travels with the anchor because codes are useless without it.

Groupings per tensor (``k_group`` / ``v_group``): ``token`` (the head_size values of one token and head),
``channel`` (one channel over ``group_tokens`` tokens; groups span block boundaries since a request is
encoded at once; the last group is ragged), ``hadamard`` (token groups after a randomized Hadamard rotation).
Work is done in token chunks so the elementwise chain stays in cache (CPU throughput).
"""

from __future__ import annotations

import torch

from lynx_connector.kernels.errors import NonFiniteKVError
from lynx_connector.kernels.groupquant_ref import dequantize_ref, meta_shape, quantize_ref
from lynx_connector.kernels.pack import pack_nibbles, unpack_nibbles

from .base import Codec, check_plane
from .hadamard import rotate, unrotate

GROUPINGS = ("token", "channel", "hadamard")
#: The largest group (tokens) an option may ask for. A channel group's work (and the twin's padded temporaries)
#: grows with its length, not the prompt's: 2^20 took GiBs to encode one token. 8192 still makes one range per
#: channel of an 8K prompt.
MAX_GROUP_TOKENS = 1 << 13
CHUNK_ELEMS = 1 << 17  # values per chunk on the CPU: keeps the ~15-op elementwise chain in L2
# On a GPU each chunk costs ~20 kernel launches and the range checks' host syncs: CPU-sized chunks made int8 (which
# has no Triton kernel) encode at 0.5 GB/s on an H200 (benchmarks/results/gpu/gpu_codec.md). 16M values (a
# 16K-token request of 8 KV heads x 128 in one chunk) bound the fp32 temporaries to a few hundred MB.
GPU_CHUNK_ELEMS = 1 << 24


def _fp16(part: torch.Tensor) -> torch.Tensor:
    """fp16 view of plane bytes; an aligned copy when they start at an odd byte (see ``_commit``)."""
    return (part if part.storage_offset() % 2 == 0 else part.clone()).view(torch.float16)


def _mode(group: str) -> str:
    return "token" if group == "hadamard" else group


class GroupQuantCodec(Codec):
    """``bits``-bit asymmetric group quantization; with ``residual`` (4-bit only) the Lynx 4+4 split."""

    def __init__(
        self,
        name: str,
        bits: int = 4,
        residual: bool = False,
        k_group: str = "token",
        v_group: str = "token",
        group_tokens: int = 64,
        k_group_tokens: int | None = None,
        v_group_tokens: int | None = None,
    ) -> None:
        if bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {bits}")
        if residual and bits != 4:
            raise ValueError("the residual plane exists only for the 4+4 split")
        for key, g in (("k_group", k_group), ("v_group", v_group)):
            if g not in GROUPINGS:
                raise ValueError(f"{key}: unknown grouping {g!r}; expected one of {GROUPINGS}")
        for key, val in (("group_tokens", group_tokens), ("k_group_tokens", k_group_tokens),
                         ("v_group_tokens", v_group_tokens)):
            if val is not None and (not isinstance(val, int) or isinstance(val, bool)
                                    or not 1 <= val <= MAX_GROUP_TOKENS):
                raise ValueError(f"{key} must be an integer in [1, {MAX_GROUP_TOKENS}], got {val!r}")
        self.k_tokens = group_tokens if k_group_tokens is None else k_group_tokens
        self.v_tokens = group_tokens if v_group_tokens is None else v_group_tokens
        self.name, self.bits, self.two_stream = name, bits, residual
        self.k_group, self.v_group = k_group, v_group
        self.levels = (1 << bits) - 1

    def __repr__(self) -> str:
        return (f"GroupQuantCodec({self.name}, bits={self.bits}, residual={self.two_stream}, "
                f"k={self.k_group}/{self.k_tokens}, v={self.v_group}/{self.v_tokens})")

    def tokens_of(self, group: str, kind: str) -> int:
        """Tokens per channel group of K (``kind='k'``) or V."""
        return self.k_tokens if kind == "k" else self.v_tokens

    # ---- sizes ----------------------------------------------------------------------------------------
    def _codes_nbytes(self, t: int, h: int, d: int) -> int:
        return t * h * d * self.bits // 8

    def _meta_groups(self, group: str, g: int, t: int, h: int, d: int) -> int:
        return int(torch.Size(meta_shape(t, h, d, _mode(group), g)).numel())

    def _tensor_nbytes(self, group: str, g: int, t: int, h: int, d: int) -> int:
        return self._codes_nbytes(t, h, d) + 4 * self._meta_groups(group, g, t, h, d)

    def check_head_size(self, head_size: int) -> None:
        """Refuse (ValueError) a head size this codec cannot encode: the Hadamard grouping needs a power of two."""
        if "hadamard" in (self.k_group, self.v_group) and (head_size < 1 or head_size & (head_size - 1)):
            raise ValueError(f"codec {self.name}: the hadamard grouping needs a power-of-two head size, got "
                             f"{head_size} (use k_group/v_group token or channel)")

    def plane_nbytes(self, num_tokens: int, num_heads: int, head_size: int, cache_dtype: torch.dtype) -> tuple[int, int]:
        self.check_head_size(head_size)
        t, h, d = num_tokens, num_heads, head_size
        anchor = self._tensor_nbytes(self.k_group, self.k_tokens, t, h, d) + self._tensor_nbytes(
            self.v_group, self.v_tokens, t, h, d)
        return anchor, (2 * t * h * d // 2 if self.two_stream else 0)

    def _chunk_tokens(self, group: str, g: int, h: int, d: int, device: torch.device) -> int:
        c = max(1, (CHUNK_ELEMS if device.type == "cpu" else GPU_CHUNK_ELEMS) // (h * d))
        if _mode(group) == "channel":
            c = max(1, c // g) * g
        return c

    def _split(self, buf: torch.Tensor, group: str, g: int, t: int, h: int, d: int) -> tuple[torch.Tensor, ...]:
        """(codes, scale, min) views of one tensor's part of the anchor plane."""
        nc, ng = self._codes_nbytes(t, h, d), self._meta_groups(group, g, t, h, d)
        return buf[:nc], _fp16(buf[nc:nc + 2 * ng]), _fp16(buf[nc + 2 * ng:nc + 4 * ng])

    def _commit(self, buf: torch.Tensor, group: str, g: int, t: int, h: int, d: int,
                scale: torch.Tensor, mn: torch.Tensor) -> None:
        """Write metadata filled through ``_split``'s views back when they were aligned copies (odd offset)."""
        nc, ng = self._codes_nbytes(t, h, d), self._meta_groups(group, g, t, h, d)
        for lo, meta in ((nc, scale), (nc + 2 * ng, mn)):
            part = buf[lo:lo + 2 * ng]
            if ng and meta.data_ptr() != part.data_ptr():
                part.copy_(meta.view(torch.uint8))

    # ---- encode ---------------------------------------------------------------------------------------
    def _pack(self, codes: torch.Tensor) -> torch.Tensor:
        return pack_nibbles(codes) if self.bits == 4 else codes

    def _encode_one(
        self, x: torch.Tensor, group: str, g: int, abuf: torch.Tensor, rbuf: torch.Tensor | None, name: str
    ) -> None:
        t, h, d = x.shape
        codes_out, scale_out, mn_out = self._split(abuf, group, g, t, h, d)
        mode = _mode(group)
        step = self._chunk_tokens(group, g, h, d, x.device)
        per_tok = h * d * self.bits // 8
        per_group_tok = h if mode == "token" else h * d  # metadata entries per token / per token group
        for t0 in range(0, t, step):
            t1 = min(t, t0 + step)
            xc = rotate(x[t0:t1]) if group == "hadamard" else x[t0:t1]
            q = quantize_ref(xc, mode, g, self.levels, rbuf is not None,
                             name if group != "hadamard" else f"{name} (Hadamard-rotated, up to sqrt({d})x the KV)")
            codes_out[t0 * per_tok:t1 * per_tok].copy_(self._pack(q.codes).view(-1))
            m0 = t0 * per_group_tok if mode == "token" else (t0 // g) * per_group_tok
            scale_out[m0:m0 + q.scale.numel()].copy_(q.scale.view(-1))
            mn_out[m0:m0 + q.mn.numel()].copy_(q.mn.view(-1))
            if rbuf is not None:
                half = h * d // 2
                rbuf[t0 * half:t1 * half].copy_(pack_nibbles(q.residual).view(-1))
        self._commit(abuf, group, g, t, h, d, scale_out, mn_out)

    def encode_tokens(
        self, k: torch.Tensor, v: torch.Tensor, anchor_out: torch.Tensor, residual_out: torch.Tensor | None, name: str
    ) -> None:
        t, h, d = k.shape
        na, nr = self.plane_nbytes(t, h, d, k.dtype)
        anchor = check_plane(anchor_out, na, "anchor")
        residual = check_plane(residual_out, nr, "residual") if self.two_stream else None
        nk = self._tensor_nbytes(self.k_group, self.k_tokens, t, h, d)
        half = t * h * d // 2
        rk, rv = (None, None) if residual is None else (residual[:half], residual[half:])
        self._encode_one(k, self.k_group, self.k_tokens, anchor[:nk], rk, f"{name}.k")
        self._encode_one(v, self.v_group, self.v_tokens, anchor[nk:], rv, f"{name}.v")

    # ---- decode ---------------------------------------------------------------------------------------
    def check_metadata(self, anchor, num_tokens, num_heads, head_size, cache_dtype, name):  # type: ignore[override]
        t, h, d = num_tokens, num_heads, head_size
        anchor = check_plane(anchor, self.plane_nbytes(t, h, d, cache_dtype)[0], "anchor")
        nk = self._tensor_nbytes(self.k_group, self.k_tokens, t, h, d)
        for tag, buf, group, g in (("k", anchor[:nk], self.k_group, self.k_tokens),
                                   ("v", anchor[nk:], self.v_group, self.v_tokens)):
            _, scale, mn = self._split(buf, group, g, t, h, d)
            for what, m in (("scale", scale), ("min", mn)):
                if not bool(torch.isfinite(m).all()):
                    raise NonFiniteKVError(f"{name}.{tag}: anchor plane {what} metadata is not finite; refusing "
                                           f"to decode")

    def _decode_one(
        self, abuf: torch.Tensor, rbuf: torch.Tensor | None, group: str, g: int, t: int, h: int, d: int
    ) -> torch.Tensor:
        codes_b, scale, mn = self._split(abuf, group, g, t, h, d)
        mode = _mode(group)
        mshape = meta_shape(t, h, d, mode, g)
        scale, mn = scale.view(mshape), mn.view(mshape)
        out = torch.empty((t, h, d), dtype=torch.float32, device=abuf.device)
        step = self._chunk_tokens(group, g, h, d, abuf.device)
        per_tok = h * d * self.bits // 8
        for t0 in range(0, t, step):
            t1 = min(t, t0 + step)
            cb = codes_b[t0 * per_tok:t1 * per_tok]
            codes = unpack_nibbles(cb.view(t1 - t0, h, d // 2)) if self.bits == 4 else cb.view(t1 - t0, h, d)
            res = None
            if rbuf is not None:
                res = unpack_nibbles(rbuf[t0 * h * d // 2:t1 * h * d // 2].view(t1 - t0, h, d // 2))
            ms = slice(t0, t1) if mode == "token" else slice(t0 // g, -(-t1 // g))
            y = dequantize_ref(codes, res, scale[ms], mn[ms], mode, g)
            out[t0:t1] = unrotate(y) if group == "hadamard" else y
        return out

    def decode_tokens(
        self,
        anchor: torch.Tensor,
        residual: torch.Tensor | None,
        num_tokens: int,
        num_heads: int,
        head_size: int,
        cache_dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        t, h, d = num_tokens, num_heads, head_size
        na, nr = self.plane_nbytes(t, h, d, cache_dtype)
        anchor = check_plane(anchor, na, "anchor")
        if residual is not None:
            if not self.two_stream:
                raise ValueError(f"codec {self.name} has no residual plane")
            residual = check_plane(residual, nr, "residual")
        nk = self._tensor_nbytes(self.k_group, self.k_tokens, t, h, d)
        half = t * h * d // 2
        rk, rv = (None, None) if residual is None else (residual[:half], residual[half:])
        k = self._decode_one(anchor[:nk], rk, self.k_group, self.k_tokens, t, h, d)
        v = self._decode_one(anchor[nk:], rv, self.v_group, self.v_tokens, t, h, d)
        return k, v
