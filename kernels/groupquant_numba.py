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
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

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


@intrinsic
def _prefetch(typingctx, arr, idx):
    """A hint to fetch the cache line of ``arr[idx]`` into L2 (``llvm.prefetch``: read, locality 2, data)."""
    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        name = "llvm.prefetch.p0" if getattr(i8p, "is_opaque", False) else "llvm.prefetch.p0i8"
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, name)
        ptr = builder.bitcast(builder.gep(ary.data, [args[1]]), i8p)
        builder.call(fn, [ptr, ir.Constant(i32, 0), ir.Constant(i32, 2), ir.Constant(i32, 1)])
        return context.get_dummy_value()
    return types.void(arr, types.intp), codegen


@njit(cache=True, error_model="numpy", inline="always")
def _prefetch_lines(src, pf, k):
    """Issue up to ``k`` prefetches from the queue ``pf`` (element indices of ``src``, one per 64-byte line;
    ``pf[0]`` = next slot, ``pf[1]`` = end). Paced a few per row of work: a burst of thousands would fill the miss
    queue and stall the core instead of overlapping the fetches with the arithmetic."""
    i = pf[0]
    e = min(pf[1], i + k)
    while i < e:
        _prefetch(src, pf[i])
        i += 1
    pf[0] = i


@njit(cache=True, error_model="numpy")
def _queue_lines(pf, src_n, start, n, itemsize):
    """Append the lines of ``[start, start + n)`` (clipped to ``src_n`` elements) to the queue ``pf``."""
    step = max(1, 64 // itemsize)
    j = pf[1]
    for i in range(max(0, start), min(start + n, src_n), step):
        if j < pf.shape[0]:
            pf[j] = i
            j += 1
    pf[1] = j


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


@njit(cache=True, error_model="numpy")
def _enc_group_f32(src, tile_base, base_h, off_t, off_d, t_contig, d_contig, bs, t0, t1, h, num_heads, g, levels,
                   packed, residual, codes, scale_bits, mn_bits, res, w, pf):
    """One (channel group, head) of an fp32 cache: rows t0 <= t < t1 of head ``h`` loaded token-major once; the
    min/max, the fp16 metadata (``_meta_vec``) and the codes are branch-free loops over the head dim (per-dim
    metadata as vectors), so they vectorize; codes as int32 first, packed in a second loop. OK or FALLBACK."""
    yw, gmin, gmax, acc, mnv, sv, safe, span, q, okv, ai, ri = w
    d_n = off_d.shape[0]
    half = d_n // 2
    n = t1 - t0
    lvf = np.float32(levels)
    row_bytes = half if packed else d_n
    u0 = t0 % bs
    if d_contig and off_t[u0 + n - 1] - off_t[u0] == (n - 1) * d_n and u0 + n <= bs:
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
            r0 = ((t0 + r) * num_heads + h) * half
            rv = res[r0:r0 + half]
            for j in range(half):
                rv[j] = np.uint8(ri[2 * j] | (ri[2 * j + 1] << 4))
        else:
            for d in range(d_n):
                a = np.floor((yr[d] - mnv[d]) / safe[d] + _P5)
                ai[d] = np.int32(lvf if a > lvf else a)
        c0 = ((t0 + r) * num_heads + h) * row_bytes
        cv = codes[c0:c0 + row_bytes]
        if packed:
            for j in range(half):
                cv[j] = np.uint8(ai[2 * j] | (ai[2 * j + 1] << 4))
        else:
            for d in range(d_n):
                cv[d] = np.uint8(ai[d])
    return OK


@njit(cache=True, error_model="numpy")
def encode_f32_channel(src, tile_base, s_head, off_t, off_d, t_contig, d_contig, bs, num_tokens, num_heads, g,
                       levels, packed, residual, codes, scale_bits, mn_bits, res):
    """``encode_tensor`` for fp32 caches and channel groups, one (group, head) at a time (``_enc_group_f32``)."""
    w = _enc_scratch(g, off_d.shape[0])
    pf = np.zeros(2, np.int64)  # no prefetch queue
    for t0 in range(0, num_tokens, g):
        t1 = min(num_tokens, t0 + g)
        for h in range(num_heads):
            if _enc_group_f32(src, tile_base, h * s_head, off_t, off_d, t_contig, d_contig, bs, t0, t1, h,
                              num_heads, g, levels, packed, residual, codes, scale_bits, mn_bits, res, w, pf) != OK:
                return FALLBACK
    return OK


@njit(cache=True, error_model="numpy")
def encode_f32_kv(src, bs, num_tokens, num_heads, span, levels, packed, residual, k, v):
    """K and V of an fp32 cache with channel groups in one pass: per ``span`` tokens (a multiple of both group
    sizes) and head, K's groups then V's. Both tensors of a (block, head) share its cache slice in the CPU layouts,
    so the cache is read in (nearly) address order once, instead of twice with gaps (~1.7x faster reads).
    ``k``/``v``: (tile_base, s_head, off_t, off_d, t_contig, d_contig, g, codes, scale_bits, mn_bits, res)."""
    tb_k, sh_k, ot_k, od_k, tc_k, dc_k, g_k, c_k, s_k, m_k, r_k = k
    tb_v, sh_v, ot_v, od_v, tc_v, dc_v, g_v, c_v, s_v, m_v, r_v = v
    w_k = _enc_scratch(g_k, od_k.shape[0])
    w_v = _enc_scratch(g_v, od_v.shape[0])
    # tiles that are one dense span (the CPU layouts): the next (span, head)'s tiles are prefetched, a few lines per
    # row, while this one runs
    sp_k = ot_k.max() + od_k.max() + 1
    sp_v = ot_v.max() + od_v.max() + 1
    dense = sp_k == bs * od_k.shape[0] and sp_v == bs * od_v.shape[0]
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
            for t0 in range(s0, s1, g_k):
                if _enc_group_f32(src, tb_k, h * sh_k, ot_k, od_k, tc_k, dc_k, bs, t0, min(s1, t0 + g_k), h,
                                  num_heads, g_k, levels, packed, residual, c_k, s_k, m_k, r_k, w_k, pf) != OK:
                    return FALLBACK
            for t0 in range(s0, s1, g_v):
                if _enc_group_f32(src, tb_v, h * sh_v, ot_v, od_v, tc_v, dc_v, bs, t0, min(s1, t0 + g_v), h,
                                  num_heads, g_v, levels, packed, residual, c_v, s_v, m_v, r_v, w_v, pf) != OK:
                    return FALLBACK
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
