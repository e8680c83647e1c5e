"""Triton kernels of the Lynx group quantizer, reading and writing vLLM's paged KV directly.

Twin: ``groupquant_ref`` (same arithmetic, same op order, bit-exact; tests/kernels). Import this module only
where Triton can run: a GPU, or the CPU interpreter with ``TRITON_INTERPRET=1`` set *before* the import.

Addressing: element (t, h, d) of K or V sits at
``blk*sB + h*sH + base + (u//PT)*sT1 + (u%PT)*sT0 + (d//PD)*sD1 + (d%PD)*sD0`` with ``blk = block_ids[t//BS]``
and ``u = t % BS`` (``KVLayout.tile_addr``), which covers CPU vec/amx tiles and FlashAttention alike.
Even and odd dims are handled as two [rows, D/2] halves so pairs pack into one byte without shuffles.
Interpreter pitfalls handled: fp32 division via ``tl.div_rn``; fp32->bf16 rounding done by hand (RNE).
GPU pitfall handled: both kernels launch with ``enable_fp_fusion=FP_FUSION`` (False): see ``FP_FUSION``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Triton may contract ``a * b + c`` into one FMA (its default), which rounds once where the twin (and the
# interpreter) round the product and the sum separately. Off, so that GPU planes and caches equal the twin's by
# construction. On the H200 the contraction did not change a byte in benchmarks/gpu/exact_diag.py's cases
# (benchmarks/results/gpu/exact_diag.json); its effect on speed there was not measured.
FP_FUSION = False
# Warps per program (Triton's default); benchmarks/gpu/tune.py sweeps it with ``block_rows``.
NUM_WARPS = 4


@triton.jit
def _round_down_f16(v):
    h = v.to(tl.float16)
    b = h.to(tl.int16, bitcast=True).to(tl.int32)
    down = tl.where(h > 0, b - 1, tl.where(h == 0, -32767, b + 1))
    b = tl.where(h.to(tl.float32) > v, down, b)
    return b.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _round_up_f16(v):
    h = v.to(tl.float16)
    b = h.to(tl.int16, bitcast=True).to(tl.int32)
    b = tl.where(h.to(tl.float32) < v, b + 1, b)
    return b.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _f32_to_bf16_rne(v):
    b = v.to(tl.uint32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return b.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _offsets(ids_ptr, t, h, d, mask, BS, s_b, s_h, base, PT, s_t1, s_t0, PD, s_d1, s_d0):
    blk = tl.load(ids_ptr + t // BS, mask=mask, other=0).to(tl.int64)
    u = t % BS
    return blk * s_b + h * s_h + base + (u // PT) * s_t1 + (u % PT) * s_t0 + (d // PD) * s_d1 + (d % PD) * s_d0


@triton.jit
def _codes(x, mnf, sf, LEVELS: tl.constexpr):
    safe = tl.where(sf > 0, sf, 1.0)
    a = tl.floor(tl.div_rn(x - mnf, safe) + 0.5)
    a = tl.minimum(tl.maximum(a, 0.0), LEVELS)
    e = x - (mnf + sf * a)
    r = tl.floor(tl.div_rn(e, safe * 0.0625))
    r = tl.minimum(tl.maximum(r, -8.0), 7.0) + 8.0
    return a.to(tl.int32), r.to(tl.int32)


@triton.jit
def _meta(gmin, gmax, LEVELS: tl.constexpr):
    mn16 = _round_down_f16(gmin)
    mnf = mn16.to(tl.float32)
    s16 = _round_up_f16(tl.div_rn(gmax - mnf, LEVELS * 1.0))
    return mn16, s16


@triton.jit
def _nan_if(flag, s16):
    """NaN as the scale of groups holding a NaN (min/max skip NaN), so the metadata check refuses them."""
    return tl.where(flag, float("nan"), s16.to(tl.float32)).to(tl.float16)


@triton.jit
def encode_kernel(
    kv_ptr, ids_ptr, codes_ptr, res_ptr, scale_ptr, mn_ptr,
    T, H, BS: tl.constexpr, s_b, s_h, base, PT: tl.constexpr, s_t1, s_t0, PD: tl.constexpr, s_d1, s_d0,
    D: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr, CHANNEL: tl.constexpr, G: tl.constexpr,
    BLOCK_R: tl.constexpr, LEVELS: tl.constexpr, RES: tl.constexpr,
):
    """Token mode: program = BLOCK_R (token, head) rows. Channel mode: program = (token group, head)."""
    cols = tl.arange(0, HALF_P)  # HALF padded to a power of two (head sizes 80, 96, ...); masked to HALF
    if CHANNEL:
        h = tl.program_id(1)
        t = tl.program_id(0) * G + tl.arange(0, G)
        rmask = t < T
        rows = t * H + h
        hh = h
    else:
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < T * H
        t = rows // H
        hh = rows % H
    m2 = rmask[:, None] & (cols[None, :] < HALF)
    de = 2 * cols[None, :]
    oe = _offsets(ids_ptr, t[:, None], hh if CHANNEL else hh[:, None], de, m2,
                  BS, s_b, s_h, base, PT, s_t1, s_t0, PD, s_d1, s_d0)
    oo = _offsets(ids_ptr, t[:, None], hh if CHANNEL else hh[:, None], de + 1, m2,
                  BS, s_b, s_h, base, PT, s_t1, s_t0, PD, s_d1, s_d0)
    xe = tl.load(kv_ptr + oe, mask=m2, other=0.0).to(tl.float32)
    xo = tl.load(kv_ptr + oo, mask=m2, other=0.0).to(tl.float32)
    inf = float("inf")
    if CHANNEL:
        gmin_e = tl.min(tl.where(m2, xe, inf), axis=0)
        gmin_o = tl.min(tl.where(m2, xo, inf), axis=0)
        gmax_e = tl.max(tl.where(m2, xe, -inf), axis=0)
        gmax_o = tl.max(tl.where(m2, xo, -inf), axis=0)
        mn_e, s_e = _meta(gmin_e, gmax_e, LEVELS)
        mn_o, s_o = _meta(gmin_o, gmax_o, LEVELS)
        s_e = _nan_if(tl.max(tl.where(m2 & (xe != xe), 1, 0), axis=0) > 0, s_e)
        s_o = _nan_if(tl.max(tl.where(m2 & (xo != xo), 1, 0), axis=0) > 0, s_o)
        mbase = (tl.program_id(0) * H + h) * D + 2 * cols
        cmask = cols < HALF
        tl.store(scale_ptr + mbase, s_e, mask=cmask)
        tl.store(scale_ptr + mbase + 1, s_o, mask=cmask)
        tl.store(mn_ptr + mbase, mn_e, mask=cmask)
        tl.store(mn_ptr + mbase + 1, mn_o, mask=cmask)
        ae, re = _codes(xe, mn_e.to(tl.float32)[None, :], s_e.to(tl.float32)[None, :], LEVELS)
        ao, ro = _codes(xo, mn_o.to(tl.float32)[None, :], s_o.to(tl.float32)[None, :], LEVELS)
    else:
        cm = (cols < HALF)[None, :]  # padding columns must not enter a row's range
        gmin = tl.minimum(tl.min(tl.where(cm, xe, inf), axis=1), tl.min(tl.where(cm, xo, inf), axis=1))
        gmax = tl.maximum(tl.max(tl.where(cm, xe, -inf), axis=1), tl.max(tl.where(cm, xo, -inf), axis=1))
        mn16, s16 = _meta(gmin, gmax, LEVELS)
        s16 = _nan_if(tl.max(tl.where(cm & ((xe != xe) | (xo != xo)), 1, 0), axis=1) > 0, s16)
        tl.store(scale_ptr + rows, s16, mask=rmask)
        tl.store(mn_ptr + rows, mn16, mask=rmask)
        mnf = mn16.to(tl.float32)[:, None]
        sf = s16.to(tl.float32)[:, None]
        ae, re = _codes(xe, mnf, sf, LEVELS)
        ao, ro = _codes(xo, mnf, sf, LEVELS)
    ob = rows[:, None].to(tl.int64) * HALF + cols[None, :]
    tl.store(codes_ptr + ob, (ae | (ao << 4)).to(tl.uint8), mask=m2)
    if RES:
        tl.store(res_ptr + ob, (re | (ro << 4)).to(tl.uint8), mask=m2)


@triton.jit
def decode_kernel(
    kv_ptr, ids_ptr, codes_ptr, res_ptr, scale_ptr, mn_ptr,
    T, H, BS: tl.constexpr, s_b, s_h, base, PT: tl.constexpr, s_t1, s_t0, PD: tl.constexpr, s_d1, s_d0,
    D: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr, CHANNEL: tl.constexpr, G: tl.constexpr,
    BLOCK_R: tl.constexpr, RES: tl.constexpr, OUT: tl.constexpr,
):
    """Write anchor (RES=False) or full (RES=True) values of BLOCK_R (token, head) rows into the cache.
    OUT: 0 fp32, 1 bf16 (hand RNE), 2 fp16."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, HALF_P)  # HALF padded to a power of two (head sizes 80, 96, ...); masked to HALF
    rmask = rows < T * H
    m2 = rmask[:, None] & (cols[None, :] < HALF)
    t = rows // H
    h = rows % H
    ib = rows[:, None].to(tl.int64) * HALF + cols[None, :]
    c = tl.load(codes_ptr + ib, mask=m2, other=0).to(tl.int32)
    ae = (c & 15).to(tl.float32)
    ao = (c >> 4).to(tl.float32)
    if CHANNEL:
        mi = ((t[:, None] // G) * H + h[:, None]) * D + 2 * cols[None, :]
        se = tl.load(scale_ptr + mi, mask=m2, other=0.0).to(tl.float32)
        so = tl.load(scale_ptr + mi + 1, mask=m2, other=0.0).to(tl.float32)
        me = tl.load(mn_ptr + mi, mask=m2, other=0.0).to(tl.float32)
        mo = tl.load(mn_ptr + mi + 1, mask=m2, other=0.0).to(tl.float32)
    else:
        se = tl.load(scale_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
        me = tl.load(mn_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
        so = se
        mo = me
    if RES:
        r = tl.load(res_ptr + ib, mask=m2, other=0).to(tl.int32)
        ye = me + (se * 0.03125) * (ae * 32.0 + (r & 15).to(tl.float32) * 2.0 - 15.0)
        yo = mo + (so * 0.03125) * (ao * 32.0 + (r >> 4).to(tl.float32) * 2.0 - 15.0)
    else:
        ye = me + se * ae
        yo = mo + so * ao
    de = 2 * cols[None, :]
    oe = _offsets(ids_ptr, t[:, None], h[:, None], de, m2, BS, s_b, s_h, base, PT, s_t1, s_t0, PD, s_d1, s_d0)
    oo = _offsets(ids_ptr, t[:, None], h[:, None], de + 1, m2, BS, s_b, s_h, base, PT, s_t1, s_t0, PD, s_d1, s_d0)
    if OUT == 1:
        ye = _f32_to_bf16_rne(ye)
        yo = _f32_to_bf16_rne(yo)
    elif OUT == 2:  # the top level may lie just above fp16's largest value: written as that value, not inf
        ye = tl.minimum(tl.maximum(ye, -65504.0), 65504.0).to(tl.float16)
        yo = tl.minimum(tl.maximum(yo, -65504.0), 65504.0).to(tl.float16)
    tl.store(kv_ptr + oe, ye, mask=m2)
    tl.store(kv_ptr + oo, yo, mask=m2)


_OUT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _addr_args(addr) -> tuple[int, ...]:
    return (addr.s_block, addr.s_head, addr.base, addr.pt, addr.s_t1, addr.s_t0, addr.pd, addr.s_d1, addr.s_d0)


def encode_paged(
    kv_layer: torch.Tensor, block_ids: torch.Tensor, addr, num_tokens: int, num_heads: int, block_size: int,
    head_size: int, codes: torch.Tensor, residual: torch.Tensor | None, scale: torch.Tensor, mn: torch.Tensor,
    channel: bool, group_tokens: int, block_rows: int = 64,
) -> None:
    """Quantize K or V (``addr`` selects which) of ``num_tokens`` tokens into packed codes and fp16 meta."""
    t, h = num_tokens, num_heads
    grid = (triton.cdiv(t, group_tokens), h) if channel else (triton.cdiv(t * h, block_rows),)
    encode_kernel[grid](
        kv_layer, block_ids, codes, codes if residual is None else residual, scale, mn,
        t, h, block_size, *_addr_args(addr),
        D=head_size, HALF=head_size // 2, HALF_P=triton.next_power_of_2(head_size // 2), CHANNEL=channel, G=group_tokens,
        BLOCK_R=block_rows, LEVELS=15, RES=residual is not None,
        enable_fp_fusion=FP_FUSION, num_warps=NUM_WARPS,
    )


def decode_paged(
    kv_layer: torch.Tensor, block_ids: torch.Tensor, addr, num_tokens: int, num_heads: int, block_size: int,
    head_size: int, codes: torch.Tensor, residual: torch.Tensor | None, scale: torch.Tensor, mn: torch.Tensor,
    channel: bool, group_tokens: int, block_rows: int = 64,
) -> None:
    """Write anchor (``residual`` None) or full values of ``num_tokens`` tokens into the cache."""
    t, h = num_tokens, num_heads
    decode_kernel[(triton.cdiv(t * h, block_rows),)](
        kv_layer, block_ids, codes, codes if residual is None else residual, scale, mn,
        t, h, block_size, *_addr_args(addr),
        D=head_size, HALF=head_size // 2, HALF_P=triton.next_power_of_2(head_size // 2), CHANNEL=channel, G=group_tokens,
        BLOCK_R=block_rows, RES=residual is not None, OUT=_OUT[kv_layer.dtype],
        enable_fp_fusion=FP_FUSION, num_warps=NUM_WARPS,
    )
