"""Numba CPU kernels of the Lynx group quantizer, fp32 caches: the vectorizable fast path (channel-group encode with
vectorized fp16 metadata, decode of K and V in one pass in address order), bit-exact with ``groupquant_ref`` like the
generic kernels of :mod:`groupquant_numba`, whose helpers and constants it uses. The one-pass K+V encode is in
:mod:`groupquant_numba_kv`, which re-exports this module's entry points."""

from __future__ import annotations

import numpy as np
from numba import njit

from .groupquant_numba import (  # noqa: F401  (FALLBACK, OK, decode_tensor, encode_tensor: re-exported)
    _C2,
    _C7,
    _C8,
    _C15,
    _C32,
    _CM8,
    _F16_MAX,
    _HALF_RANGE,
    _P03125,
    _P0625,
    _P5,
    _ZERO,
    FALLBACK,
    OK,
    _meta,
    _meta_f32,
    _mixed_zero,
    _prefetch_lines,
    _queue_lines,
    decode_tensor,
    encode_tensor,
)

# ---- fp32 caches, channel groups: a vectorizable encode -----------------------------------------------------------
# Loops below index arrays only with range() variables (from 0) or through slices: an offset index ``a[off + j]``
# may be negative as far as numba knows, and its wraparound fix-up keeps LLVM from vectorizing the loop (~5x).
_U1 = np.uint32(1)


@njit(cache=True, error_model="numpy", inline="always")
def _h2f_normal(hb):
    """fp16 bits of a normal number (uint32) -> fp32 bits."""
    return ((hb & np.uint32(0x8000)) << np.uint32(16)) | (((hb & np.uint32(0x7FFF)) << np.uint32(13))
                                                          + np.uint32(112 << 23))


@njit(cache=True, error_model="numpy", inline="always")
def _f2h_normal(u):
    """fp32 bits (uint32) whose value rounds to a normal fp16 -> fp16 bits, round to nearest even (as
    ``f32_to_f16_bits`` on that range)."""
    m = (u & np.uint32(0x7FFFFFFF)) - np.uint32(0x38000000)
    return ((u >> np.uint32(16)) & np.uint32(0x8000)) | ((m + np.uint32(0x0FFF) + ((m >> np.uint32(13)) & _U1))
                                                          >> np.uint32(13))


@njit(cache=True, error_model="numpy", inline="always")
def _normal_f16(e):
    """True when fp16 exponent bits ``e`` (masked with 0x7C00) belong to a normal number."""
    return (e != np.uint32(0)) & (e != np.uint32(0x7C00))


@njit(cache=True, error_model="numpy")
def _meta_vec(gmin, gmax, levels, mnv, sv, safe, span, okv, mn_out, s_out):
    """``_meta`` over all groups of ``gmin``/``gmax`` into the slices ``mn_out``/``s_out``: a branch-free (vectorizable)
    pass that is exact while the minimum, the span and both stepped fp16 values are normal fp16 numbers; the other
    groups (zero span, tiny minimum, ...) are redone by ``_meta`` itself."""
    lv = np.float32(levels)
    gu, mu, su, spu = gmin.view(np.uint32), mnv.view(np.uint32), sv.view(np.uint32), span.view(np.uint32)
    for j in range(gmin.shape[0]):
        a = gu[j] & np.uint32(0x7FFFFFFF)
        ok = (a >= np.uint32(0x38800000)) & (a < np.uint32(0x477FF000))
        hb = _f2h_normal(gu[j])
        mu[j] = _h2f_normal(hb)
        up = mnv[j] > gmin[j]  # one fp16 ulp down (mnv is not zero here): toward -inf
        neg = (hb & np.uint32(0x8000)) != np.uint32(0)
        hb = hb + (_U1 if up & neg else np.uint32(0)) - (_U1 if up & (not neg) else np.uint32(0))
        ok = ok & _normal_f16(hb & np.uint32(0x7C00))
        mu[j] = _h2f_normal(hb)
        mn_out[j] = hb
        span[j] = (gmax[j] - mnv[j]) / lv
        sa = spu[j]
        ok = ok & (sa >= np.uint32(0x38800000)) & (sa < np.uint32(0x477FF000))
        sb = _f2h_normal(sa)
        su[j] = _h2f_normal(sb)
        sb = sb + (_U1 if sv[j] < span[j] else np.uint32(0))  # one fp16 ulp up
        ok = ok & _normal_f16(sb & np.uint32(0x7C00))
        su[j] = _h2f_normal(sb)
        s_out[j] = sb
        safe[j] = sv[j]
        okv[j] = ok
    for j in range(gmin.shape[0]):
        if not okv[j]:
            _meta(gmin[j:j + 1], gmax[j:j + 1], levels, mnv[j:j + 1], sv[j:j + 1], safe[j:j + 1], span[j:j + 1],
                  mn_out, s_out, j)


@njit(cache=True, error_model="numpy", inline="always")
def _load_group_f32(src, tile_base, base_h, off_t, off_d, t_contig, d_contig, bs, t0, t1, y):
    """Rows t0 <= t < t1 of one head into y[t - t0, :] (token-major), reading each tile in its own order. Element
    loops over views indexed from 0 (a slice assignment between two float arrays checks for overlap and may copy
    through a temporary; an offset index has the wraparound fix-up): a plain, vectorizable copy."""
    d_n = off_d.shape[0]
    t = t0
    while t < t1:
        b = t // bs
        u0 = t % bs
        n = min(bs - u0, t1 - t)
        base = tile_base[b] + base_h
        yb = y[t - t0:t - t0 + n]
        if t_contig:  # tile [D, BS]: contiguous over tokens
            for d in range(d_n):
                o = base + off_d[d] + u0
                sv = src[o:o + n]
                yc = yb[:, d]
                for u in range(n):
                    yc[u] = sv[u]
        elif d_contig:  # tile [BS, D]
            for u in range(n):
                o = base + off_t[u0 + u]
                sv = src[o:o + d_n]
                yr = yb[u]
                for d in range(d_n):
                    yr[d] = sv[d]
        else:
            for u in range(n):
                o = base + off_t[u0 + u]
                yr = yb[u]
                for d in range(d_n):
                    yr[d] = src[o + off_d[d]]
        t += n


@njit(cache=True, error_model="numpy")
def _enc_scratch(g, d_n):
    """Work buffers of ``_enc_group_f32`` for groups of up to ``g`` tokens."""
    f = np.float32
    return (np.empty((g, d_n), f), np.empty(d_n, f), np.empty(d_n, f), np.empty(d_n, f), np.empty(d_n, f),
            np.empty(d_n, f), np.empty(d_n, f), np.empty(d_n, f), np.empty(d_n, f), np.empty(d_n, np.bool_),
            np.empty(d_n, np.int32), np.empty(d_n, np.int32))


@njit(cache=True, error_model="numpy", inline="always")
def _store_codes(ai, ri, residual, packed, codes, res, row):
    """One row's codes into the planes (``row`` = token * num_heads + head): the residual's nibbles in pairs, the
    anchor's in pairs (4-bit) or a byte each."""
    d_n = ai.shape[0]
    half = d_n // 2
    if residual:
        rv = res[row * half:(row + 1) * half]
        for j in range(half):
            rv[j] = np.uint8(ri[2 * j] | (ri[2 * j + 1] << 4))
    if packed:
        cv = codes[row * half:(row + 1) * half]
        for j in range(half):
            cv[j] = np.uint8(ai[2 * j] | (ai[2 * j + 1] << 4))
    else:
        cv = codes[row * d_n:(row + 1) * d_n]
        for d in range(d_n):
            cv[d] = np.uint8(ai[d])


@njit(cache=True, error_model="numpy")
def _enc_group_f32(src, tile_base, base_h, off_t, off_d, t_contig, d_contig, bs, t0, t1, h, num_heads, g, levels,
                   packed, residual, codes, scale_bits, mn_bits, res, w, pf):
    """One (channel group, head) of an fp32 cache: rows t0 <= t < t1 of head ``h`` loaded token-major once; the
    min/max, the fp16 metadata (``_meta_vec``) and the codes are branch-free loops over the head dim (per-dim
    metadata as vectors), so they vectorize; codes as int32 first, packed in a second loop. OK or FALLBACK."""
    yw, gmin, gmax, acc, mnv, sv, safe, span, q, okv, ai, ri = w
    d_n = off_d.shape[0]
    n = t1 - t0
    lvf = np.float32(levels)
    u0 = t0 % bs
    # the in-block test first: off_t has bs entries, and a group spanning two blocks must not read past them
    if d_contig and u0 + n <= bs and off_t[u0 + n - 1] - off_t[u0] == (n - 1) * d_n:
        # the group's rows are one token-major run of the cache (V tiles [BS, D]): read them in place
        o = tile_base[t0 // bs] + base_h + off_t[u0]
        y = src[o:o + n * d_n].reshape(n, d_n)
    else:
        y = yw  # rows < n in use
        _load_group_f32(src, tile_base, base_h, off_t, off_d, t_contig, d_contig, bs, t0, t1, y)
    for d in range(d_n):
        gmin[d] = y[0, d]
        gmax[d] = y[0, d]
        acc[d] = _ZERO
    n4 = n - n % 4
    for r in range(0, n4, 4):  # four rows per pass over the accumulators (min/max do not depend on the order;
        y0, y1, y2, y3 = y[r], y[r + 1], y[r + 2], y[r + 3]  # a signed-zero tie falls back below)
        for d in range(d_n):
            v0, v1, v2, v3 = y0[d], y1[d], y2[d], y3[d]
            lo = v0 if v0 < v1 else v1
            lo2 = v2 if v2 < v3 else v3
            lo = lo if lo < lo2 else lo2
            hi = v0 if v0 > v1 else v1
            hi2 = v2 if v2 > v3 else v3
            hi = hi if hi > hi2 else hi2
            gmin[d] = lo if lo < gmin[d] else gmin[d]
            gmax[d] = hi if hi > gmax[d] else gmax[d]
            acc[d] += ((v0 - v0) + (v1 - v1)) + ((v2 - v2) + (v3 - v3))  # NaN when any value is not finite
    for r in range(n4, n):
        for d in range(d_n):
            v = y[r, d]
            gmin[d] = v if v < gmin[d] else gmin[d]
            gmax[d] = v if v > gmax[d] else gmax[d]
            acc[d] += v - v
    bad = False
    zero = False
    for d in range(d_n):  # _bad_group without early exits, and whether a min or max is a zero
        bad |= (acc[d] != _ZERO) | (gmin[d] < -_F16_MAX) | (gmax[d] > _F16_MAX) | (
            (gmax[d] - gmin[d]) / lvf > _HALF_RANGE)
        zero |= (gmin[d] == _ZERO) | (gmax[d] == _ZERO)
    if bad:
        return FALLBACK
    if zero:
        for d in range(d_n):
            if (gmin[d] == _ZERO and _mixed_zero(y[:n, d], gmin[d])) or (
                    gmax[d] == _ZERO and _mixed_zero(y[:n, d], gmax[d])):
                return FALLBACK
    m0 = ((t0 // g) * num_heads + h) * d_n
    _meta_vec(gmin, gmax, levels, mnv, sv, safe, span, okv, mn_bits[m0:m0 + d_n], scale_bits[m0:m0 + d_n])
    for d in range(d_n):
        q[d] = safe[d] * _P0625
    for r in range(n):
        _prefetch_lines(src, pf, 4)
        yr = y[r]
        if residual:  # floor((x - mn)/safe + 0.5) capped at levels; floor(e/q) clamped to [-8, 7], + 8
            for d in range(d_n):
                x = yr[d]
                a = np.floor((x - mnv[d]) / safe[d] + _P5)
                a = lvf if a > lvf else a  # selects, not min()/max(): those keep LLVM from vectorizing
                z = np.floor((x - (mnv[d] + sv[d] * a)) / q[d])
                z = _CM8 if z < _CM8 else z
                z = _C7 if z > _C7 else z
                ai[d] = np.int32(a)
                ri[d] = np.int32(z + _C8)
        else:
            for d in range(d_n):
                a = np.floor((yr[d] - mnv[d]) / safe[d] + _P5)
                ai[d] = np.int32(lvf if a > lvf else a)
        _store_codes(ai, ri, residual, packed, codes, res, (t0 + r) * num_heads + h)
    return OK


# ---- fp32 caches: decode by rows into a block buffer, stored in tile order ----------------------------------------
@njit(cache=True, error_model="numpy", inline="always")
def _dec_row(cb, mr, sr, out, packed):
    """Anchor values ``mn + s*a`` of one row (codes ``cb``, per-dim metadata ``mr``/``sr``)."""
    if packed:
        for j in range(cb.shape[0]):
            c = cb[j]
            out[2 * j] = mr[2 * j] + sr[2 * j] * np.float32(c & 15)
            out[2 * j + 1] = mr[2 * j + 1] + sr[2 * j + 1] * np.float32(c >> 4)
    else:
        for d in range(cb.shape[0]):
            out[d] = mr[d] + sr[d] * np.float32(cb[d])


@njit(cache=True, error_model="numpy", inline="always")
def _dec_row_res(cb, rb, mr, sr, out):
    """Full values ``mn + (s/32)*(32a + 2r - 15)`` of one row (packed anchor ``cb``, residual ``rb``)."""
    for j in range(cb.shape[0]):
        c = cb[j]
        rc = rb[j]
        out[2 * j] = mr[2 * j] + (sr[2 * j] * _P03125) * (
            np.float32(c & 15) * _C32 + np.float32(rc & 15) * _C2 - _C15)
        out[2 * j + 1] = mr[2 * j + 1] + (sr[2 * j + 1] * _P03125) * (
            np.float32(c >> 4) * _C32 + np.float32(rc >> 4) * _C2 - _C15)


@njit(cache=True, error_model="numpy")
def _dec_block_f32(dst, base, off_t, off_d, t_contig, d_contig, t, u0, u1, h, num_heads, channel, g, packed,
                   residual, codes, sf, mf, res, blk, mr_t, sr_t):
    """Rows u0 <= u < u1 of one (block, head) tile (token t at row u0): computed row by row into ``blk``
    (contiguous, vectorizable loops), then stored in the tile's order: a slice per row when the head dim is
    contiguous, a slice per dim when tokens are."""
    d_n = off_d.shape[0]
    half = d_n // 2
    row_bytes = half if packed else d_n
    for u in range(u0, u1):
        tt = t + u - u0
        if channel:
            m0 = ((tt // g) * num_heads + h) * d_n
            mr = mf[m0:m0 + d_n]
            sr = sf[m0:m0 + d_n]
        else:
            mr_t[:] = mf[tt * num_heads + h]
            sr_t[:] = sf[tt * num_heads + h]
            mr = mr_t
            sr = sr_t
        c0 = (tt * num_heads + h) * row_bytes
        if residual:
            r0 = (tt * num_heads + h) * half
            _dec_row_res(codes[c0:c0 + half], res[r0:r0 + half], mr, sr, blk[u])
        else:
            _dec_row(codes[c0:c0 + row_bytes], mr, sr, blk[u], packed)
    n = u1 - u0
    bb = blk[u0:u1]
    if t_contig:  # element loops over views indexed from 0, as in _load_group_f32
        for d in range(d_n):
            o = base + off_d[d] + u0
            dv = dst[o:o + n]
            bc = bb[:, d]
            for u in range(n):
                dv[u] = bc[u]
    elif d_contig:
        for u in range(n):
            o = base + off_t[u0 + u]
            dv = dst[o:o + d_n]
            br = bb[u]
            for d in range(d_n):
                dv[d] = br[d]
    else:
        for u in range(n):
            o = base + off_t[u0 + u]
            br = bb[u]
            for d in range(d_n):
                dst[o + off_d[d]] = br[d]


@njit(cache=True, error_model="numpy")
def _split_pairs(m, d_n):
    """Per run of ``d_n`` metadata values: the even dims first, then the odd ones (the nibble order of a code byte)."""
    half = d_n // 2
    out = np.empty_like(m)
    for i0 in range(0, m.shape[0], d_n):
        src = m[i0:i0 + d_n]
        lo = out[i0:i0 + half]
        hi = out[i0 + half:i0 + d_n]
        for j in range(half):
            lo[j] = src[2 * j]
            hi[j] = src[2 * j + 1]
    return out


@njit(cache=True, error_model="numpy")
def _dec_block_f32_pairs(dst, base, off_t, off_d, t_contig, d_contig, t, u0, u1, h, num_heads, g, residual, codes,
                         sfp, mfp, res, blk):
    """``_dec_block_f32`` for channel groups and packed codes, with the metadata from ``_split_pairs``: each row is
    computed as its low nibbles (even dims) into ``blk[u, :D/2]`` and high nibbles (odd dims) into ``blk[u, D/2:]``,
    so every loop is contiguous; the stores put dim d back from column d//2 + (d%2)*D/2. Same expressions, same
    order as ``_dec_row`` / ``_dec_row_res``."""
    d_n = off_d.shape[0]
    half = d_n // 2
    c3 = codes.reshape(-1, num_heads, half)  # [token, head, byte]
    r3 = res.reshape(-1, num_heads, half) if residual else c3
    m3 = mfp.reshape(-1, num_heads, d_n)  # [group, head, dim (pair-split)]
    s3 = sfp.reshape(-1, num_heads, d_n)
    u = u0
    while u < u1:  # runs of rows in one group: their metadata rows are fetched once
        gi = (t + u - u0) // g
        u_end = min(u1, u0 + (gi + 1) * g - t)
        mm, ss = m3[gi, h], s3[gi, h]
        for uu in range(u, u_end):
            cb = c3[t + uu - u0, h]
            br = blk[uu]
            if residual:
                rb = r3[t + uu - u0, h]
                for j in range(half):
                    br[j] = mm[j] + (ss[j] * _P03125) * (
                        np.float32(cb[j] & 15) * _C32 + np.float32(rb[j] & 15) * _C2 - _C15)
                for j in range(half):
                    br[half + j] = mm[half + j] + (ss[half + j] * _P03125) * (
                        np.float32(cb[j] >> 4) * _C32 + np.float32(rb[j] >> 4) * _C2 - _C15)
            else:
                for j in range(half):
                    br[j] = mm[j] + ss[j] * np.float32(cb[j] & 15)
                for j in range(half):
                    br[half + j] = mm[half + j] + ss[half + j] * np.float32(cb[j] >> 4)
        u = u_end
    n = u1 - u0
    bb = blk[u0:u1]
    if t_contig:
        for d in range(d_n):
            o = base + off_d[d] + u0
            dv = dst[o:o + n]
            bc = bb[:, (d >> 1) + (d & 1) * half]
            for u in range(n):
                dv[u] = bc[u]
    elif d_contig:
        for u in range(n):
            o = base + off_t[u0 + u]
            dv = dst[o:o + d_n]
            be, bo = bb[u, :half], bb[u, half:]
            for j in range(half):
                dv[2 * j] = be[j]
                dv[2 * j + 1] = bo[j]
    else:
        for u in range(n):
            o = base + off_t[u0 + u]
            br = bb[u]
            for d in range(d_n):
                dst[o + off_d[d]] = br[(d >> 1) + (d & 1) * half]


@njit(cache=True, error_model="numpy")
def decode_f32_rows(dst, tile_base, s_head, off_t, off_d, t_contig, d_contig, bs, num_tokens, num_heads, skip,
                    channel, g, packed, residual, codes, scale_bits, mn_bits, res):
    """``decode_tensor`` for fp32 caches (``dst`` float32), one (block, head) tile at a time (``_dec_block_f32``)."""
    d_n = off_d.shape[0]
    sf, mf = _meta_f32(scale_bits), _meta_f32(mn_bits)
    blk = np.empty((bs, d_n), np.float32)
    mr_t, sr_t = np.empty(d_n, np.float32), np.empty(d_n, np.float32)
    t = skip
    while t < num_tokens:
        u0 = t % bs
        u1 = min(bs, u0 + (num_tokens - t))
        for h in range(num_heads):
            _dec_block_f32(dst, tile_base[t // bs] + h * s_head, off_t, off_d, t_contig, d_contig, t, u0, u1, h,
                           num_heads, channel, g, packed, residual, codes, sf, mf, res, blk, mr_t, sr_t)
        t += u1 - u0
    return OK


@njit(cache=True, error_model="numpy")
def decode_f32_kv(dst, bs, num_tokens, num_heads, skip, packed, residual, k, v):
    """``decode_f32_rows`` of K and V in one pass: per block and head, K's tile then V's (they share the (block,
    head) slice in the CPU layouts: the cache is written in address order once, not twice with gaps). Channel
    groups with packed codes go through ``_dec_block_f32_pairs``.
    ``k``/``v``: (tile_base, s_head, off_t, off_d, t_contig, d_contig, channel, g, codes, scale_bits, mn_bits, res)."""
    tb_k, sh_k, ot_k, od_k, tc_k, dc_k, ch_k, g_k, c_k, s_k, m_k, r_k = k
    tb_v, sh_v, ot_v, od_v, tc_v, dc_v, ch_v, g_v, c_v, s_v, m_v, r_v = v
    d_n = od_k.shape[0]
    sf_k, mf_k = _meta_f32(s_k), _meta_f32(m_k)
    sf_v, mf_v = _meta_f32(s_v), _meta_f32(m_v)
    pairs_k, pairs_v = packed and ch_k, packed and ch_v
    if pairs_k:
        sf_k, mf_k = _split_pairs(sf_k, d_n), _split_pairs(mf_k, d_n)
    if pairs_v:
        sf_v, mf_v = _split_pairs(sf_v, d_n), _split_pairs(mf_v, d_n)
    blk = np.empty((bs, d_n), np.float32)
    mr_t, sr_t = np.empty(d_n, np.float32), np.empty(d_n, np.float32)
    t = skip
    while t < num_tokens:
        b = t // bs
        u0 = t % bs
        u1 = min(bs, u0 + (num_tokens - t))
        for h in range(num_heads):
            if pairs_k:
                _dec_block_f32_pairs(dst, tb_k[b] + h * sh_k, ot_k, od_k, tc_k, dc_k, t, u0, u1, h, num_heads, g_k,
                                     residual, c_k, sf_k, mf_k, r_k, blk)
            else:
                _dec_block_f32(dst, tb_k[b] + h * sh_k, ot_k, od_k, tc_k, dc_k, t, u0, u1, h, num_heads, ch_k, g_k,
                               packed, residual, c_k, sf_k, mf_k, r_k, blk, mr_t, sr_t)
            if pairs_v:
                _dec_block_f32_pairs(dst, tb_v[b] + h * sh_v, ot_v, od_v, tc_v, dc_v, t, u0, u1, h, num_heads, g_v,
                                     residual, c_v, sf_v, mf_v, r_v, blk)
            else:
                _dec_block_f32(dst, tb_v[b] + h * sh_v, ot_v, od_v, tc_v, dc_v, t, u0, u1, h, num_heads, ch_v, g_v,
                               packed, residual, c_v, sf_v, mf_v, r_v, blk, mr_t, sr_t)
        t += u1 - u0
    return OK
