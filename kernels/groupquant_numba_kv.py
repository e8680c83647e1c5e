"""Numba CPU kernels of the Lynx group quantizer, fp32 caches: K and V of a layer encoded in one pass over the
cache, whatever each tensor's grouping (channel groups through ``_enc_group_f32``, token groups through
``_enc_tokens_f32`` below), bit-exact with ``groupquant_ref``. Re-exports every entry point of
:mod:`groupquant_numba_f32` (and through it the generic kernels), so that ``lynx_connector.codec.numba_path``
drives one module."""

from __future__ import annotations

import numpy as np
from numba import njit

from .groupquant_numba import _queue_lines
from .groupquant_numba_f32 import (  # noqa: F401  (entry points re-exported)
    _C7,
    _C8,
    _CM8,
    _F16_MAX,
    _HALF_RANGE,
    _P0625,
    _P5,
    _ZERO,
    FALLBACK,
    OK,
    _enc_group_f32,
    _enc_scratch,
    _load_group_f32,
    _meta_vec,
    _mixed_zero,
    _prefetch_lines,
    _store_codes,
    decode_f32_kv,
    decode_f32_rows,
    decode_tensor,
    encode_tensor,
)

_W = 8  # lanes of the per-row min/max: independent accumulators that LLVM turns into vector registers


@njit(cache=True, error_model="numpy")
def _tok_scratch(bs, d_n):
    """Work buffers of ``_enc_tokens_f32`` for pieces of up to ``bs`` rows."""
    f = np.float32
    return (np.empty((bs, d_n), f), np.empty(bs, f), np.empty(bs, f), np.empty(bs, f), np.empty(bs, f),
            np.empty(bs, f), np.empty(bs, f), np.empty(bs, np.bool_), np.empty(bs, np.uint16),
            np.empty(bs, np.uint16), np.empty(d_n, np.int32), np.empty(d_n, np.int32), np.empty(_W, f),
            np.empty(_W, f), np.empty(_W, f))


@njit(cache=True, error_model="numpy", inline="always")
def _row_range(yr, lo8, hi8, acc8):
    """(min, max, sum of x - x) of one row: ``_W`` lanes over the head dim, kept in locals (arrays would be
    reloaded every step: they may alias the row), then the lanes. Min and max do not depend on the order except for
    a tie between +0.0 and -0.0, which the caller sends to the twin."""
    d_n = yr.shape[0]
    lo = yr[0]
    hi = yr[0]
    a = _ZERO
    d8 = d_n - d_n % _W if d_n >= 2 * _W else 0
    if d8:
        l0, l1, l2, l3, l4, l5, l6, l7 = yr[0], yr[1], yr[2], yr[3], yr[4], yr[5], yr[6], yr[7]
        h0, h1, h2, h3, h4, h5, h6, h7 = l0, l1, l2, l3, l4, l5, l6, l7
        a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = _ZERO
        for d0 in range(0, d8, _W):
            yv = yr[d0:d0 + _W]
            v0, v1, v2, v3, v4, v5, v6, v7 = yv[0], yv[1], yv[2], yv[3], yv[4], yv[5], yv[6], yv[7]
            l0, l1, l2, l3 = (v0 if v0 < l0 else l0), (v1 if v1 < l1 else l1), (v2 if v2 < l2 else l2), (
                v3 if v3 < l3 else l3)
            l4, l5, l6, l7 = (v4 if v4 < l4 else l4), (v5 if v5 < l5 else l5), (v6 if v6 < l6 else l6), (
                v7 if v7 < l7 else l7)
            h0, h1, h2, h3 = (v0 if v0 > h0 else h0), (v1 if v1 > h1 else h1), (v2 if v2 > h2 else h2), (
                v3 if v3 > h3 else h3)
            h4, h5, h6, h7 = (v4 if v4 > h4 else h4), (v5 if v5 > h5 else h5), (v6 if v6 > h6 else h6), (
                v7 if v7 > h7 else h7)
            a0, a1, a2, a3 = a0 + (v0 - v0), a1 + (v1 - v1), a2 + (v2 - v2), a3 + (v3 - v3)
            a4, a5, a6, a7 = a4 + (v4 - v4), a5 + (v5 - v5), a6 + (v6 - v6), a7 + (v7 - v7)
        for x in (l1, l2, l3, l4, l5, l6, l7):
            l0 = x if x < l0 else l0
        for x in (h1, h2, h3, h4, h5, h6, h7):
            h0 = x if x > h0 else h0
        lo, hi, a = l0, h0, ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))
    tail = yr[d8:]
    for d in range(tail.shape[0]):
        v = tail[d]
        lo = v if v < lo else lo
        hi = v if v > hi else hi
        a += v - v
    return lo, hi, a


@njit(cache=True, error_model="numpy")
def _enc_tokens_f32(src, tile_base, base_h, off_t, off_d, t_contig, d_contig, bs, t0, t1, h, num_heads, levels,
                    packed, residual, codes, scale_bits, mn_bits, res, w, pf):
    """Token groups (one group per row) of head ``h``, rows t0 <= t < t1 of an fp32 cache, one block's piece at a
    time: the piece's rows are read in place where they are one token-major run (V tiles [BS, D]), else loaded
    token-major; per-row ranges, the fp16 metadata of all the piece's rows as one vector (``_meta_vec``), then the
    codes, with the per-row metadata as scalars. OK or FALLBACK."""
    yw, lo_v, hi_v, mnv, sv, safe, span, okv, mn16, s16, ai, ri, lo8, hi8, acc8 = w
    d_n = off_d.shape[0]
    lvf = np.float32(levels)
    t = t0
    while t < t1:
        u0 = t % bs
        n = min(bs - u0, t1 - t)
        if d_contig and off_t[u0 + n - 1] - off_t[u0] == (n - 1) * d_n:
            o = tile_base[t // bs] + base_h + off_t[u0]
            y = src[o:o + n * d_n].reshape(n, d_n)
        else:
            y = yw
            _load_group_f32(src, tile_base, base_h, off_t, off_d, t_contig, d_contig, bs, t, t + n, y)
        bad = False
        for r in range(n):
            lo, hi, a = _row_range(y[r], lo8, hi8, acc8)
            lo_v[r] = lo
            hi_v[r] = hi
            bad |= (a != _ZERO) | (lo < -_F16_MAX) | (hi > _F16_MAX) | ((hi - lo) / lvf > _HALF_RANGE)
            if (lo == _ZERO and _mixed_zero(y[r], lo)) or (hi == _ZERO and _mixed_zero(y[r], hi)):
                bad = True
        if bad:
            return FALLBACK
        _meta_vec(lo_v[:n], hi_v[:n], levels, mnv[:n], sv[:n], safe[:n], span[:n], okv[:n], mn16[:n], s16[:n])
        for r in range(n):
            m0 = (t + r) * num_heads + h
            mn_bits[m0] = mn16[r]
            scale_bits[m0] = s16[r]
        for r in range(n):
            _prefetch_lines(src, pf, 4)
            yr = y[r]
            m, s, sf = mnv[r], sv[r], safe[r]
            q = sf * _P0625
            if residual:  # the channel kernel's expressions with this row's metadata as scalars
                for d in range(d_n):
                    x = yr[d]
                    a = np.floor((x - m) / sf + _P5)
                    a = lvf if a > lvf else a
                    z = np.floor((x - (m + s * a)) / q)
                    z = _CM8 if z < _CM8 else z
                    z = _C7 if z > _C7 else z
                    ai[d] = np.int32(a)
                    ri[d] = np.int32(z + _C8)
            else:
                for d in range(d_n):
                    a = np.floor((yr[d] - m) / sf + _P5)
                    ai[d] = np.int32(lvf if a > lvf else a)
            _store_codes(ai, ri, residual, packed, codes, res, (t + r) * num_heads + h)
        t += n
    return OK


@njit(cache=True, error_model="numpy", inline="always")
def _enc_span(src, a, wc, wt, bs, s0, s1, h, num_heads, levels, packed, residual, pf):
    """One tensor's rows s0 <= t < s1 of head ``h``: its channel groups, or its token rows."""
    tb, sh, ot, od, tc, dc, channel, g, c, s, m, r = a
    if not channel:
        return _enc_tokens_f32(src, tb, h * sh, ot, od, tc, dc, bs, s0, s1, h, num_heads, levels, packed, residual,
                               c, s, m, r, wt, pf)
    for t0 in range(s0, s1, g):
        if _enc_group_f32(src, tb, h * sh, ot, od, tc, dc, bs, t0, min(s1, t0 + g), h, num_heads, g, levels,
                          packed, residual, c, s, m, r, wc, pf) != OK:
            return FALLBACK
    return OK


@njit(cache=True, error_model="numpy")
def encode_f32_kv(src, bs, num_tokens, num_heads, span, levels, packed, residual, k, v):
    """K and V of an fp32 cache in one pass: per ``span`` tokens (a multiple of the block size and of every channel
    group size) and head, K's rows then V's. Both tensors of a (block, head) share its cache slice in the CPU
    layouts, so the cache is read in (nearly) address order once, instead of twice with gaps (~1.7x faster reads).
    ``k``/``v``: (tile_base, s_head, off_t, off_d, t_contig, d_contig, channel, g, codes, scale_bits, mn_bits, res)."""
    d_k, d_v = k[3].shape[0], v[3].shape[0]
    wc_k, wc_v = _enc_scratch(k[7] if k[6] else 1, d_k), _enc_scratch(v[7] if v[6] else 1, d_v)
    wt_k, wt_v = _tok_scratch(bs, d_k), _tok_scratch(bs, d_v)
    tb_k, sh_k, ot_k, od_k = k[0], k[1], k[2], k[3]
    tb_v, sh_v, ot_v, od_v = v[0], v[1], v[2], v[3]
    # tiles that are one dense span (the CPU layouts): the next (span, head)'s tiles are prefetched, a few lines per
    # row, while this one runs
    sp_k = ot_k.max() + od_k.max() + 1
    sp_v = ot_v.max() + od_v.max() + 1
    dense = sp_k == bs * d_k and sp_v == bs * d_v
    per_line = max(1, 64 // src.itemsize)
    pf = np.zeros(2 + ((span + bs - 1) // bs + 1) * (sp_k + sp_v + 2 * per_line) // per_line, np.int64)
    for s0 in range(0, num_tokens, span):
        s1 = min(num_tokens, s0 + span)
        for h in range(num_heads):
            n0, nh = (s0, h + 1) if h + 1 < num_heads else (s0 + span, 0)
            pf[0] = pf[1] = 2
            if dense and n0 < num_tokens:
                for b in range(n0 // bs, (min(num_tokens, n0 + span) + bs - 1) // bs):
                    _queue_lines(pf, src.shape[0], tb_k[b] + nh * sh_k, sp_k, src.itemsize)
                    _queue_lines(pf, src.shape[0], tb_v[b] + nh * sh_v, sp_v, src.itemsize)
            if _enc_span(src, k, wc_k, wt_k, bs, s0, s1, h, num_heads, levels, packed, residual, pf) != OK:
                return FALLBACK
            if _enc_span(src, v, wc_v, wt_v, bs, s0, s1, h, num_heads, levels, packed, residual, pf) != OK:
                return FALLBACK
    return OK
