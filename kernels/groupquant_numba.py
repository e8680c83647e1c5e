"""Numba CPU kernels of the Lynx group quantizer: an optional fast path, bit-exact with ``groupquant_ref``.

Why: on CPU the torch twin makes ~15 eager passes plus layout copies (gather to token-major, scatter back), which
holds encode/decode to a few percent of memcpy. These kernels read and write vLLM's paged cache directly (the
``KVLayout.tile_addr`` formula, tabulated per block row and per dim), keep one (token group, head) of values in a
small buffer and run the whole quantizer over it in one go. They run on the calling thread (no numba threads), so
a caller's thread CPU clock sees all of their work.

Bit-exactness with the torch twin (the format's definition, and the oracle in tests/kernels):
* the same fp32 operations in the same order (numba without fastmath: no FMA contraction, no reassociation;
  every constant is float32 so nothing is promoted to float64);
* fp16/bf16 conversions are integer bit manipulation (round to nearest even); the fp16 metadata steps one ulp
  after the RNE cast exactly like ``fp16_meta``;
* where the twin's answer depends on its reduction order (a group whose min or max is a zero and that holds both
  +0.0 and -0.0), on non-finite input and on values beyond the fp16 metadata range, a kernel returns
  ``FALLBACK`` and the caller runs the torch twin, which then produces the answer (or raises).

Value storage ``kind``: 0 fp32 (uint32 bits), 1 bf16 (uint16 bits), 2 fp16 (uint16 bits).
"""

from __future__ import annotations

import numpy as np
from numba import njit

OK = 0
FALLBACK = 1

_F16_MAX = np.float32(65504.0)
_HALF_RANGE = np.float32(32752.0)
_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)
_P5 = np.float32(0.5)
_P0625 = np.float32(0.0625)
_P03125 = np.float32(0.03125)
_C32 = np.float32(32.0)
_C2 = np.float32(2.0)
_C15 = np.float32(15.0)
_CM8 = np.float32(-8.0)
_C7 = np.float32(7.0)
_C8 = np.float32(8.0)


@njit(cache=True, error_model="numpy", inline="always")
def f32_to_f16_bits(u):
    """fp32 bits -> fp16 bits, round to nearest even (overflow gives inf, like a cast)."""
    sign = (u >> 16) & 0x8000
    a = u & 0x7FFFFFFF
    if a >= 0x477FF000:  # >= 65520 rounds to inf
        return sign | 0x7C00
    if a >= 0x38800000:  # normal fp16
        m = a - 0x38000000
        m = m + 0x0FFF + ((m >> 13) & 1)
        return sign | (m >> 13)
    if a < 0x33000000:  # < 2^-25 rounds to zero (2^-25 itself ties to the even zero)
        return sign
    e = a >> 23
    mant = (a & 0x7FFFFF) | 0x800000
    shift = 126 - e
    q = mant >> shift
    rem = mant & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    if rem > half or (rem == half and (q & 1) == 1):
        q += 1
    return sign | q


@njit(cache=True, error_model="numpy", inline="always")
def f16_bits_to_f32_bits(h):
    """fp16 bits -> fp32 bits (exact)."""
    sign = (h & 0x8000) << 16
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0:
        if m == 0:
            return sign
        e = 1
        while (m & 0x400) == 0:
            m <<= 1
            e -= 1
        return sign | ((e + 112) << 23) | ((m & 0x3FF) << 13)
    if e == 31:
        return sign | 0x7F800000 | (m << 13)
    return sign | ((e + 112) << 23) | (m << 13)


@njit(cache=True, error_model="numpy", inline="always")
def _load_bits(src, i, kind):
    v = np.int64(src[i])
    if kind == 0:
        return v
    if kind == 1:
        return (v & 0xFFFF) << 16
    return f16_bits_to_f32_bits(v & 0xFFFF)


@njit(cache=True, error_model="numpy", inline="always")
def _store_bits(dst, i, u, kind):
    if kind == 0:
        dst[i] = u
    elif kind == 1:
        dst[i] = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    else:
        dst[i] = f32_to_f16_bits(u)


@njit(cache=True, error_model="numpy", inline="always")
def _load_row(src, kind, base, off_d, d_contig, ybits, r):
    """One (token, head) row of values as fp32 bits into ybits[r]."""
    if kind == 0 and d_contig:
        for d in range(ybits.shape[1]):
            ybits[r, d] = src[base + d]
    elif kind == 0:
        for d in range(ybits.shape[1]):
            ybits[r, d] = src[base + off_d[d]]
    else:
        for d in range(ybits.shape[1]):
            ybits[r, d] = _load_bits(src, base + off_d[d], kind)


@njit(cache=True, error_model="numpy")
def _meta(gmin, gmax, levels, mnv, sv, safe, span, mn_out, s_out, m0):
    """fp16 (min, scale) of n groups exactly as ``quantize_ref`` + ``fp16_meta`` compute them; fp32 copies in
    mnv/sv/safe; bits to mn_out/s_out[m0:m0+n]."""
    lv = np.float32(levels)
    gmin_u, mnv_u, sv_u, span_u = gmin.view(np.uint32), mnv.view(np.uint32), sv.view(np.uint32), span.view(np.uint32)
    for j in range(gmin.shape[0]):
        hb = f32_to_f16_bits(np.int64(gmin_u[j]))
        mnv_u[j] = f16_bits_to_f32_bits(hb)
        if mnv[j] > gmin[j]:  # one fp16 ulp down, as round_down_fp16
            if mnv[j] > _ZERO:
                hb -= 1
            elif mnv[j] == _ZERO:
                hb = 0x8001
            else:
                hb += 1
            mnv_u[j] = f16_bits_to_f32_bits(hb)
        mn_out[m0 + j] = hb
        span[j] = (gmax[j] - mnv[j]) / lv
        sb = f32_to_f16_bits(np.int64(span_u[j]))
        sv_u[j] = f16_bits_to_f32_bits(sb)
        if sv[j] < span[j]:  # one fp16 ulp up, as round_up_fp16
            sb += 1
            sv_u[j] = f16_bits_to_f32_bits(sb)
        s_out[m0 + j] = sb
        safe[j] = sv[j] if sv[j] > _ZERO else _ONE


@njit(cache=True, error_model="numpy")
def _bad_group(gmin, gmax, acc, levels) -> bool:
    """True when the twin must decide: non-finite values (acc = sum of x - x is NaN), or the fp16 range check."""
    lv = np.float32(levels)
    for j in range(gmin.shape[0]):
        if acc[j] != _ZERO:
            return True
        if gmin[j] < -_F16_MAX or gmax[j] > _F16_MAX or (gmax[j] - gmin[j]) / lv > _HALF_RANGE:
            return True
    return False


@njit(cache=True, error_model="numpy")
def _mixed_zero(vals, target) -> bool:
    """True when ``target`` is zero and ``vals`` holds it as both +0.0 and -0.0."""
    if target != _ZERO:
        return False
    bits = vals.view(np.uint32) if vals.flags.c_contiguous else vals.copy().view(np.uint32)
    pos = neg = False
    for i in range(bits.shape[0]):
        if bits[i] == 0:
            pos = True
        elif bits[i] == 0x80000000:
            neg = True
    return pos and neg


@njit(cache=True, error_model="numpy", inline="always")
def _quant_row(y, row, mnv, sv, safe, levels, acode, rcode, residual):
    """Codes of one row, as ``quantize_ref``: floor via integer truncation (x >= mn makes the anchor argument
    non-negative; the residual argument is within [-9, 9], so truncate-and-correct is an exact floor)."""
    lv = np.int32(levels)
    for d in range(y.shape[1]):
        x = y[row, d]
        ai = np.int32((x - mnv[d]) / safe[d] + _P5)
        ai = lv if ai > lv else ai
        acode[d] = np.uint8(ai)
    if residual:
        for d in range(y.shape[1]):
            x = y[row, d]
            e = x - (mnv[d] + sv[d] * np.float32(acode[d]))
            z = e / (safe[d] * _P0625)
            ri = np.int32(z)
            ri = ri - 1 if np.float32(ri) > z else ri
            ri = -8 if ri < -8 else ri
            ri = 7 if ri > 7 else ri
            rcode[d] = np.uint8(ri + 8)


@njit(cache=True, error_model="numpy", inline="always")
def _put_codes(acode, out, off, packed):
    if packed:
        for j in range(acode.shape[0] // 2):
            out[off + j] = acode[2 * j] | (acode[2 * j + 1] << 4)
    else:
        for d in range(acode.shape[0]):
            out[off + d] = acode[d]


@njit(cache=True, error_model="numpy")
def encode_tensor(src, kind, tile_base, s_head, off_t, off_d, d_contig, bs, num_tokens, num_heads, channel, g,
                  levels, packed, residual, codes, scale_bits, mn_bits, res):
    """Quantize K or V of ``num_tokens`` tokens (block b's tile at ``tile_base[b]``) into the plane views.
    Returns OK, or FALLBACK (nothing is guaranteed about the planes then)."""
    d_n = off_d.shape[0]
    rows = g if channel else 1
    ybits = np.empty((rows, d_n), np.uint32)
    y = ybits.view(np.float32)
    n_meta = d_n if channel else 1
    gmin, gmax, acc = np.empty(n_meta, np.float32), np.empty(n_meta, np.float32), np.empty(n_meta, np.float32)
    mnv, sv, safe, span = (np.empty(n_meta, np.float32), np.empty(n_meta, np.float32),
                           np.empty(n_meta, np.float32), np.empty(n_meta, np.float32))
    mnr, svr, safer = np.empty(d_n, np.float32), np.empty(d_n, np.float32), np.empty(d_n, np.float32)
    acode, rcode = np.zeros(d_n, np.uint8), np.zeros(d_n, np.uint8)
    row_bytes = d_n // 2 if packed else d_n
    for t0 in range(0, num_tokens, rows):
        t1 = min(num_tokens, t0 + rows)
        n = t1 - t0
        for h in range(num_heads):
            for t in range(t0, t1):
                _load_row(src, kind, tile_base[t // bs] + h * s_head + off_t[t % bs], off_d, d_contig, ybits, t - t0)
            if channel:
                for d in range(d_n):
                    gmin[d] = y[0, d]
                    gmax[d] = y[0, d]
                    acc[d] = _ZERO
                for r in range(n):
                    for d in range(d_n):
                        v = y[r, d]
                        gmin[d] = v if v < gmin[d] else gmin[d]
                        gmax[d] = v if v > gmax[d] else gmax[d]
                        acc[d] += v - v
                if _bad_group(gmin, gmax, acc, levels):
                    return FALLBACK
                for d in range(d_n):
                    if (gmin[d] == _ZERO and _mixed_zero(y[:n, d], gmin[d])) or (
                            gmax[d] == _ZERO and _mixed_zero(y[:n, d], gmax[d])):
                        return FALLBACK
                _meta(gmin, gmax, levels, mnv, sv, safe, span, mn_bits, scale_bits, ((t0 // g) * num_heads + h) * d_n)
                for r in range(n):
                    _quant_row(y, r, mnv, sv, safe, levels, acode, rcode, residual)
                    t = t0 + r
                    _put_codes(acode, codes, (t * num_heads + h) * row_bytes, packed)
                    if residual:
                        _put_codes(rcode, res, (t * num_heads + h) * (d_n // 2), True)
            else:
                row = y[0]
                lo = row[0]
                hi = row[0]
                a0 = _ZERO
                for d in range(d_n):
                    v = row[d]
                    lo = v if v < lo else lo
                    hi = v if v > hi else hi
                    a0 += v - v
                gmin[0], gmax[0], acc[0] = lo, hi, a0
                if _bad_group(gmin, gmax, acc, levels) or _mixed_zero(row, lo) or _mixed_zero(row, hi):
                    return FALLBACK
                _meta(gmin, gmax, levels, mnv, sv, safe, span, mn_bits, scale_bits, t0 * num_heads + h)
                mnr[:] = mnv[0]
                svr[:] = sv[0]
                safer[:] = safe[0]
                _quant_row(y, 0, mnr, svr, safer, levels, acode, rcode, residual)
                _put_codes(acode, codes, (t0 * num_heads + h) * row_bytes, packed)
                if residual:
                    _put_codes(rcode, res, (t0 * num_heads + h) * (d_n // 2), True)
    return OK


@njit(cache=True, error_model="numpy")
def _meta_f32(bits):
    """fp16 metadata bits -> fp32: the normal-number formula in a vectorizable pass, then the rare zeros,
    subnormals and non-finite values through the exact scalar conversion."""
    n = bits.shape[0]
    out = np.empty(n, np.uint32)
    for i in range(n):
        h = np.uint32(bits[i])
        out[i] = ((h & np.uint32(0x8000)) << np.uint32(16)) | (((h & np.uint32(0x7FFF)) << np.uint32(13))
                                                               + np.uint32(112 << 23))
    for i in range(n):
        e = np.int64(bits[i]) & 0x7C00
        if e == 0 or e == 0x7C00:
            out[i] = f16_bits_to_f32_bits(np.int64(bits[i]))
    return out.view(np.float32)


@njit(cache=True, error_model="numpy")
def decode_tensor(dst, kind, tile_base, s_head, off_t, off_d, d_contig, bs, num_tokens, num_heads, skip, channel,
                  g, packed, residual, codes, scale_bits, mn_bits, res):
    """Write rows ``skip <= t < num_tokens`` of K or V: anchor values ``mn + s*a``, or with ``residual`` the full
    values ``mn + (s/32)*(32a + 2r - 15)`` (the torch twin's expressions, in its order)."""
    d_n = off_d.shape[0]
    sf, mf = _meta_f32(scale_bits), _meta_f32(mn_bits)
    sr, mr = np.empty(d_n, np.float32), np.empty(d_n, np.float32)
    ybits = np.empty(d_n, np.uint32)
    y = ybits.view(np.float32)
    a = np.empty(d_n, np.float32)
    rr = np.empty(d_n, np.float32)
    row_bytes = d_n // 2 if packed else d_n
    half = d_n // 2
    for t in range(skip, num_tokens):
        for h in range(num_heads):
            if channel:
                m0 = ((t // g) * num_heads + h) * d_n
                for d in range(d_n):
                    sr[d] = sf[m0 + d]
                    mr[d] = mf[m0 + d]
            else:
                sr[:] = sf[t * num_heads + h]
                mr[:] = mf[t * num_heads + h]
            c0 = (t * num_heads + h) * row_bytes
            if packed:
                for j in range(half):
                    c = codes[c0 + j]
                    a[2 * j] = np.float32(c & 15)
                    a[2 * j + 1] = np.float32(c >> 4)
            else:
                for d in range(d_n):
                    a[d] = np.float32(codes[c0 + d])
            if residual:
                r0 = (t * num_heads + h) * half
                for j in range(half):
                    c = res[r0 + j]
                    rr[2 * j] = np.float32(c & 15)
                    rr[2 * j + 1] = np.float32(c >> 4)
                for d in range(d_n):
                    y[d] = mr[d] + (sr[d] * _P03125) * (a[d] * _C32 + rr[d] * _C2 - _C15)
            else:
                for d in range(d_n):
                    y[d] = mr[d] + sr[d] * a[d]
            base = tile_base[t // bs] + h * s_head + off_t[t % bs]
            if kind == 0 and d_contig:
                for d in range(d_n):
                    dst[base + d] = ybits[d]
            else:
                for d in range(d_n):
                    _store_bits(dst, base + off_d[d], np.int64(ybits[d]), kind)
    return OK


# ---- fp32 caches: a fused decode (no row buffers: short loops over them cost more than the arithmetic) -----------
@njit(cache=True, error_model="numpy")
def decode_f32(dst, tile_base, s_head, off_t, off_d, bs, num_tokens, num_heads, skip, channel, g, packed,
               residual, codes, scale_bits, mn_bits, res):
    """``decode_tensor`` for fp32 caches (``dst`` float32): one fused unpack-reconstruct-store loop per row."""
    d_n = off_d.shape[0]
    sf, mf = _meta_f32(scale_bits), _meta_f32(mn_bits)
    half = d_n // 2
    row_bytes = half if packed else d_n
    for t in range(skip, num_tokens):
        for h in range(num_heads):
            base = tile_base[t // bs] + h * s_head + off_t[t % bs]
            m0 = ((t // g) * num_heads + h) * d_n if channel else t * num_heads + h
            step = 1 if channel else 0
            c0 = (t * num_heads + h) * row_bytes
            if not packed:
                for d in range(d_n):
                    m = m0 + d * step
                    dst[base + off_d[d]] = mf[m] + sf[m] * np.float32(codes[c0 + d])
            elif residual:
                r0 = (t * num_heads + h) * half
                for p in range(half):
                    c = codes[c0 + p]
                    rc = res[r0 + p]
                    m = m0 + 2 * p * step
                    dst[base + off_d[2 * p]] = mf[m] + (sf[m] * _P03125) * (
                        np.float32(c & 15) * _C32 + np.float32(rc & 15) * _C2 - _C15)
                    m += step
                    dst[base + off_d[2 * p + 1]] = mf[m] + (sf[m] * _P03125) * (
                        np.float32(c >> 4) * _C32 + np.float32(rc >> 4) * _C2 - _C15)
            else:
                for p in range(half):
                    c = codes[c0 + p]
                    m = m0 + 2 * p * step
                    dst[base + off_d[2 * p]] = mf[m] + sf[m] * np.float32(c & 15)
                    m += step
                    dst[base + off_d[2 * p + 1]] = mf[m] + sf[m] * np.float32(c >> 4)
    return OK


# ---- fp32 caches, channel groups: a vectorizable encode -----------------------------------------------------------
@njit(cache=True, error_model="numpy")
def _load_group_f32(src, tile_base, base_h, off_t, off_d, t_contig, d_contig, bs, t0, t1, y):
    """Rows t0 <= t < t1 of one head into y[t - t0, :] (token-major), reading each tile in its own order."""
    d_n = off_d.shape[0]
    t = t0
    while t < t1:
        b = t // bs
        u0 = t % bs
        u1 = min(bs, u0 + (t1 - t))
        base = tile_base[b] + base_h
        r0 = t - t0 - u0
        if t_contig:  # tile [D, BS]: contiguous over tokens
            for d in range(d_n):
                o = base + off_d[d]
                y[r0 + u0:r0 + u1, d] = src[o + u0:o + u1]
        elif d_contig:  # tile [BS, D]
            for u in range(u0, u1):
                o = base + off_t[u]
                y[r0 + u, :] = src[o:o + d_n]
        else:
            for u in range(u0, u1):
                o = base + off_t[u]
                for d in range(d_n):
                    y[r0 + u, d] = src[o + off_d[d]]
        t += u1 - u0


@njit(cache=True, error_model="numpy", inline="always")
def _quant_vec(yr, mnv, safe, lvf, af):
    """Anchor codes of one row as floats: min(floor((x - mn)/safe + 0.5), levels) (x >= mn: no lower clamp)."""
    for d in range(yr.shape[0]):  # selects, not min(): numba's min() keeps LLVM from vectorizing the loop
        a = np.floor((yr[d] - mnv[d]) / safe[d] + _P5)
        af[d] = lvf if a > lvf else a


@njit(cache=True, error_model="numpy", inline="always")
def _quant_vec_res(yr, mnv, sv, safe, q, lvf, af, rf):
    """Anchor codes and residual codes + 8 of one row as floats, the twin's expressions in its order."""
    for d in range(yr.shape[0]):
        x = yr[d]
        a = np.floor((x - mnv[d]) / safe[d] + _P5)
        a = lvf if a > lvf else a  # selects, not min()/max(): those keep LLVM from vectorizing the loop
        af[d] = a
        z = np.floor((x - (mnv[d] + sv[d] * a)) / q[d])
        z = _CM8 if z < _CM8 else z
        z = _C7 if z > _C7 else z
        rf[d] = z + _C8


@njit(cache=True, error_model="numpy", inline="always")
def _pack_f(cf, out):
    """Float codes (0..15) packed two per byte, low nibble first, into the slice ``out``. (Index a slice from 0:
    an offset index ``out[off + j]`` may be negative as far as numba knows, and its wraparound fix-up keeps the
    loop scalar, ~5x slower.)"""
    for j in range(out.shape[0]):
        out[j] = np.uint8(np.int32(cf[2 * j]) | (np.int32(cf[2 * j + 1]) << 4))


@njit(cache=True, error_model="numpy")
def encode_f32_channel(src, tile_base, s_head, off_t, off_d, t_contig, d_contig, bs, num_tokens, num_heads, g,
                       levels, packed, residual, codes, scale_bits, mn_bits, res):
    """``encode_tensor`` for fp32 caches and channel groups: each (group, head) is loaded token-major once and
    quantized by branch-free loops over the head dim (per-dim metadata as vectors), so they vectorize."""
    d_n = off_d.shape[0]
    half = d_n // 2
    y = np.empty((g, d_n), np.float32)
    gmin, gmax, acc = np.empty(d_n, np.float32), np.empty(d_n, np.float32), np.empty(d_n, np.float32)
    mnv, sv, safe, span = (np.empty(d_n, np.float32), np.empty(d_n, np.float32),
                           np.empty(d_n, np.float32), np.empty(d_n, np.float32))
    q = np.empty(d_n, np.float32)
    af = np.empty(d_n, np.float32)
    rf = np.empty(d_n, np.float32)
    lvf = np.float32(levels)
    row_bytes = half if packed else d_n
    for t0 in range(0, num_tokens, g):
        t1 = min(num_tokens, t0 + g)
        n = t1 - t0
        for h in range(num_heads):
            _load_group_f32(src, tile_base, h * s_head, off_t, off_d, t_contig, d_contig, bs, t0, t1, y)
            for d in range(d_n):
                gmin[d] = y[0, d]
                gmax[d] = y[0, d]
                acc[d] = _ZERO
            for r in range(n):
                for d in range(d_n):
                    v = y[r, d]
                    gmin[d] = v if v < gmin[d] else gmin[d]
                    gmax[d] = v if v > gmax[d] else gmax[d]
                    acc[d] += v - v
            if _bad_group(gmin, gmax, acc, levels):
                return FALLBACK
            for d in range(d_n):
                if (gmin[d] == _ZERO and _mixed_zero(y[:n, d], gmin[d])) or (
                        gmax[d] == _ZERO and _mixed_zero(y[:n, d], gmax[d])):
                    return FALLBACK
            _meta(gmin, gmax, levels, mnv, sv, safe, span, mn_bits, scale_bits, ((t0 // g) * num_heads + h) * d_n)
            for d in range(d_n):
                q[d] = safe[d] * _P0625
            for r in range(n):
                c0 = ((t0 + r) * num_heads + h) * row_bytes
                yr = y[r]
                if residual:
                    _quant_vec_res(yr, mnv, sv, safe, q, lvf, af, rf)
                    r0 = ((t0 + r) * num_heads + h) * half
                    _pack_f(rf, res[r0:r0 + half])
                else:
                    _quant_vec(yr, mnv, safe, lvf, af)
                if packed:
                    _pack_f(af, codes[c0:c0 + half])
                else:
                    for d in range(d_n):
                        codes[c0 + d] = np.uint8(np.int32(af[d]))
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
def decode_f32_rows(dst, tile_base, s_head, off_t, off_d, t_contig, d_contig, bs, num_tokens, num_heads, skip,
                    channel, g, packed, residual, codes, scale_bits, mn_bits, res):
    """``decode_f32`` computed row by row into a block buffer (contiguous, vectorizable loops), then stored in the
    tile's order: a slice per row when the head dim is contiguous, a slice per dim when tokens are."""
    d_n = off_d.shape[0]
    sf, mf = _meta_f32(scale_bits), _meta_f32(mn_bits)
    half = d_n // 2
    row_bytes = half if packed else d_n
    blk = np.empty((bs, d_n), np.float32)
    mr_t, sr_t = np.empty(d_n, np.float32), np.empty(d_n, np.float32)
    t = skip
    while t < num_tokens:
        b = t // bs
        u0 = t % bs
        u1 = min(bs, u0 + (num_tokens - t))
        for h in range(num_heads):
            base = tile_base[b] + h * s_head
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
            if t_contig:
                for d in range(d_n):
                    o = base + off_d[d]
                    dst[o + u0:o + u1] = blk[u0:u1, d]
            elif d_contig:
                for u in range(u0, u1):
                    o = base + off_t[u]
                    dst[o:o + d_n] = blk[u]
            else:
                for u in range(u0, u1):
                    o = base + off_t[u]
                    for d in range(d_n):
                        dst[o + off_d[d]] = blk[u, d]
        t += u1 - u0
    return OK
