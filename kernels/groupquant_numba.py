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
        h = f32_to_f16_bits(u)
        if (h & 0x7FFF) == 0x7C00 and (u & 0x7FFFFFFF) < 0x7F800000:
            h = (h & 0x8000) | 0x7BFF  # a finite decoded value past fp16's range is its largest value (the twin's)
        dst[i] = h


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
