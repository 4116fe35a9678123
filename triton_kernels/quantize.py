"""Group quantize / dequantize in Triton, formula for formula the reference (kvkernels/reference/quant.py).

Groups are G consecutive values along the last dim, dequantized as x ~= s * u + zeff:

    sym    s = fp16(max|x| / 2^(b-1)),   u = clamp(rint(x / s) + 2^(b-1), 0, 2^b - 1),   zeff = -s * 2^(b-1)
           (constant non-zero group, b >= 2: s = fp16(|c| / 2^(b-2)))
    asym   s = fp16((max - min) / (2^b - 1)), z = fp16(min), u = clamp(rint((x - z) / s), 0, 2^b - 1),  zeff = z
           stored: s' = fp16((1 - 2 eta) s), z' = fp16(z + eta * s * (2^b - 1))
    hybrid asym iff its squared error is strictly lower; asym groups store -s (sign bit, also for s == 0) and z,
           sym groups store zero 0

Bit-exactness: s and z are rounded to fp16 before the codes are computed, divisions are IEEE (div_rn, not the
approximate fp32 division `/` lowers to on NVIDIA), rounding is half-to-even, and FMA contraction is switched off
at launch, so codes, scales and zeros equal the reference's bit for bit. The one exception is hybrid near-ties:
the two squared errors are sums whose order differs from torch's, so a group whose sym and asym errors agree to
fp32 rounding may pick the other mode (both choices are then equally good). NaN in a group poisons only that
group's scale, as in the reference (tl.max/tl.min drop NaN on GPUs, so it is detected explicitly).

Grid: (cdiv(rows, BLOCK_ROWS), L / G); a program quantizes one group of BLOCK_ROWS rows as a tile
[BLOCK_ROWS, NBG, 32] of 32-value blocks (NBG = next_pow2(G / 32), masked), and writes each block's `bits` words.
Leading dims are viewed as three [D0, D1, D2] with per-tensor strides, so narrowed cache views need no copy.
"""

import torch
import triton
import triton.language as tl

from kvkernels import _validate

from ._common import (
    INTERPRETED,
    QUANT_TILE,
    check_device,
    collapse_rows,
    device_ctx,
    group_affine,
    next_pow2,
    round_half_even,
    round_to_half,
    unpack_blocks,
)

_MODES = {"sym": 0, "asym": 1, "hybrid": 2}
# No NaN among these module constants: Triton's JIT compares every constexpr global a kernel read with its current
# value on each launch (`!=`) and raises "has changed since we compiled this kernel" when they differ, which a NaN
# always does. The interpreter makes no such check; the first GPU run lost every Triton quantize test to it.
# tests/triton_aot/compile_check.py makes the check for every kernel its representative launches record.
_INF = tl.constexpr(float("inf"))
_NEG_INF = tl.constexpr(-float("inf"))


@triton.jit
def _row_offsets(rows, D1, D2, s0, s1, s2):
    # rows: int64 [R] flat row index over [D0, D1, D2]  ->  element offsets with the given strides
    return (rows // (D1 * D2)) * s0 + ((rows // D2) % D1) * s1 + (rows % D2) * s2


@triton.jit
def _clamp_code(u, QMAX: tl.constexpr):
    # clamp to [0, QMAX]; NaN (a non-finite group only) -> 0, as quant.cuh clamp_code: conversion stays defined
    return tl.where(u >= 0.0, tl.where(u <= QMAX, u, QMAX), 0.0)


@triton.jit
def _quantize_kernel(
    # pointers
    x_ptr,  # fp16/bf16/fp32 [D0, D1, D2, L], any strides (e.g. a transposed [.., tokens, D] block)
    codes_ptr,  # int32 [D0, D1, D2, L*BITS/32]
    scales_ptr,  # int16 view of fp16 [D0, D1, D2, L/G]
    zeros_ptr,  # fp16 [D0, D1, D2, L/G]
    # sizes
    n_rows,
    D1,
    D2,
    # strides of the three leading dims (x also of its last dim; the outputs' last dims are contiguous)
    sx0,
    sx1,
    sx2,
    sxl,
    sc0,
    sc1,
    sc2,
    ss0,
    ss1,
    ss2,
    sz0,
    sz1,
    sz2,
    # asym calibration (hybrid passes 1, 0: the reference runs the same formula with eta = 0)
    s_mul,  # 1 - 2 eta
    eta,
    # meta-parameters
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    MODE: tl.constexpr,  # 0 sym, 1 asym, 2 hybrid
    BLOCK_ROWS: tl.constexpr,
    NBG: tl.constexpr,  # next_pow2(GROUP // 32)
):
    OFF: tl.constexpr = float(2 ** (BITS - 1))
    INV_OFF: tl.constexpr = 1.0 / (2 ** (BITS - 1))  # exact: a power of two
    QMAX: tl.constexpr = float(2**BITS - 1)
    BPG: tl.constexpr = GROUP // 32
    pid_r = tl.program_id(0)
    g = tl.program_id(1)

    rows = pid_r.to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    r_ok = rows < n_rows
    j = tl.arange(0, NBG)
    blk = g * BPG + j
    blk_ok = j < BPG
    i = tl.arange(0, 32)[None, None, :]
    ok = r_ok[:, None, None] & blk_ok[None, :, None]  # [BLOCK_ROWS, NBG, 1]
    ok3 = ok & (i < 32)  # [BLOCK_ROWS, NBG, 32]

    x_row = _row_offsets(rows, D1, D2, sx0, sx1, sx2)
    l = (blk[None, :, None] * 32 + i).to(tl.int64)  # [1, NBG, 32]; times sxl may pass 2^31 for a transposed x
    xv = tl.load(x_ptr + x_row[:, None, None] + l * sxl, mask=ok3, other=0.0).to(tl.float32)
    has_nan = tl.max(tl.max(tl.where(ok3 & (xv != xv), 1, 0), axis=2), axis=1) > 0  # [BLOCK_ROWS]

    # padding blocks must not win min/max; padding rows keep their zeros (no inf - inf downstream)
    pad = (blk_ok[None, :, None] & (i < 32)) == 0  # [1, NBG, 32]
    mn = tl.min(tl.min(tl.where(pad, _INF, xv), axis=2), axis=1)
    mx = tl.max(tl.max(tl.where(pad, _NEG_INF, xv), axis=2), axis=1)
    mn = tl.where(has_nan, float("nan"), mn)
    mx = tl.where(has_nan, float("nan"), mx)
    if MODE != 1:  # sym
        amax = tl.max(tl.max(tl.abs(xv), axis=2), axis=1)  # masked lanes hold 0, harmless for max|x|
        inv_den = tl.full((BLOCK_ROWS,), INV_OFF, tl.float32)
        if BITS >= 2:  # a constant non-zero group: max|x| / 2^(b-2), exact on a level (FORMATS.md)
            inv_den = tl.where((mn == mx) & (amax > 0), INV_OFF * 2.0, inv_den)
        s_s = round_to_half(tl.where(has_nan, float("nan"), amax) * inv_den)  # times a power of two: exact
        s3 = s_s[:, None, None]
        u_s = tl.where(s3 > 0, round_half_even(tl.math.div_rn(xv, tl.where(s3 > 0, s3, 1.0))) + OFF, OFF)
        u_s = _clamp_code(u_s, QMAX)
    if MODE != 0:  # asym
        s_a = round_to_half(tl.math.div_rn(mx - mn, QMAX))
        z_a = round_to_half(mn)
        sa3 = s_a[:, None, None]
        q_a = tl.math.div_rn(xv - z_a[:, None, None], tl.where(sa3 > 0, sa3, 1.0))
        u_a = tl.where(sa3 > 0, round_half_even(q_a), 0.0)
        u_a = _clamp_code(u_a, QMAX)
        s_st = round_to_half(s_mul * s_a)
        z_st = round_to_half(z_a + eta * s_a * QMAX)

    if MODE == 0:
        u = u_s
        scale_bits = s_s.to(tl.float16).to(tl.int16, bitcast=True)
        zero = tl.zeros((BLOCK_ROWS,), dtype=tl.float32)
    elif MODE == 1:
        u = u_a
        scale_bits = s_st.to(tl.float16).to(tl.int16, bitcast=True)
        zero = z_st
    else:
        d_s = s3 * u_s - s3 * OFF - xv
        err_s = tl.sum(tl.sum(tl.where(ok3, d_s * d_s, 0.0), axis=2), axis=1)
        d_a = s_st[:, None, None] * u_a + z_st[:, None, None] - xv
        err_a = tl.sum(tl.sum(tl.where(ok3, d_a * d_a, 0.0), axis=2), axis=1)
        use_asym = err_a < err_s  # ties: sym
        u = tl.where(use_asym[:, None, None], u_a, u_s)
        # asym flag = fp16 sign bit, set with an integer OR so that s == 0 still becomes -0.0 (negation in
        # Triton is 0 - s, which would give +0.0)
        sb_s = s_s.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
        sb_a = s_st.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) | 0x8000
        scale_bits = tl.where(use_asym, sb_a, sb_s).to(tl.int16)
        zero = tl.where(use_asym, z_st, 0.0)

    s_off = _row_offsets(rows, D1, D2, ss0, ss1, ss2) + g
    tl.store(scales_ptr + s_off, scale_bits, mask=r_ok)
    z_off = _row_offsets(rows, D1, D2, sz0, sz1, sz2) + g
    tl.store(zeros_ptr + z_off, zero.to(tl.float16), mask=r_ok)

    # pack: word w of a block ORs its values' bit fields (disjoint, so a sum is an OR)
    u = u.to(tl.int32)
    PER: tl.constexpr = 32 // BITS
    c_ptrs = codes_ptr + _row_offsets(rows, D1, D2, sc0, sc1, sc2)[:, None] + blk[None, :] * BITS
    w_ok = r_ok[:, None] & blk_ok[None, :]
    for w in tl.static_range(BITS):
        if BITS == 3:
            if w < 2:  # 2-bit plane: values 0-15 in word 0, 16-31 in word 1
                field = tl.where((i // 16) == w, (u & 3) << ((i % 16) * 2), 0)
            else:  # 1-bit plane of the high bits
                field = (u >> 2) << i
        else:
            field = tl.where((i // PER) == w, u << ((i % PER) * BITS), 0)
        tl.store(c_ptrs + w, tl.sum(field, axis=2), mask=w_ok)


@triton.jit
def _dequantize_kernel(
    # pointers
    codes_ptr,  # int32 [D0, D1, D2, L*BITS/32]
    scales_ptr,  # int16 view of fp16 [D0, D1, D2, L/G]
    zeros_ptr,  # fp16 [D0, D1, D2, L/G] (unused for sym)
    out_ptr,  # fp32 [n_rows, L], contiguous
    # sizes
    n_rows,
    D1,
    D2,
    L,
    # strides of the three leading dims
    sc0,
    sc1,
    sc2,
    ss0,
    ss1,
    ss2,
    sz0,
    sz1,
    sz2,
    # meta-parameters
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    MODE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    NBG: tl.constexpr,
):
    BPG: tl.constexpr = GROUP // 32
    pid_r = tl.program_id(0)
    g = tl.program_id(1)
    rows = pid_r.to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    r_ok = rows < n_rows
    j = tl.arange(0, NBG)
    blk = g * BPG + j
    blk_ok = j < BPG
    w_ok = r_ok[:, None] & blk_ok[None, :]

    c_ptrs = codes_ptr + _row_offsets(rows, D1, D2, sc0, sc1, sc2)[:, None] + blk[None, :] * BITS
    u = unpack_blocks(c_ptrs, w_ok, BITS).to(tl.float32)  # [BLOCK_ROWS, NBG, 32]
    scale_bits = tl.load(scales_ptr + _row_offsets(rows, D1, D2, ss0, ss1, ss2) + g, mask=r_ok, other=0)
    if MODE == 0:
        zero = scale_bits  # unused by sym
    else:
        zero = tl.load(zeros_ptr + _row_offsets(rows, D1, D2, sz0, sz1, sz2) + g, mask=r_ok, other=0.0)
    s, zeff = group_affine(scale_bits, zero, BITS, MODE)
    out = s[:, None, None] * u + zeff[:, None, None]
    i = tl.arange(0, 32)[None, None, :]
    o_ptrs = out_ptr + rows[:, None, None] * L + blk[None, :, None] * 32 + i
    tl.store(o_ptrs, out, mask=w_ok[:, :, None] & (i < 32))


def _tiles(n_rows: int, group_size: int) -> tuple[int, int]:
    """(BLOCK_ROWS, NBG) with a tile [BLOCK_ROWS, NBG, 32] of about QUANT_TILE elements."""
    nbg = next_pow2(group_size // 32)
    return min(next_pow2(n_rows), max(1, QUANT_TILE // (nbg * 32))), nbg


def _launch_opts() -> dict:
    # exact fp32 products and sums, as torch computes them (no FMA contraction); the interpreter ignores it
    return {} if INTERPRETED else {"enable_fp_fusion": False}


def quantize_groups_into(x, bits, group_size, mode, eta, codes, scales, zeros) -> None:
    """quantize_groups written into caller buffers (views with any row strides, last dim contiguous)."""
    _validate.check_quantize_into(x, bits, group_size, mode, eta, codes, scales, zeros)
    check_device("quantize_groups_into", x)
    lead, L = tuple(x.shape[:-1]), x.shape[-1]
    n_rows = x.numel() // L if L else 0
    if n_rows == 0 or L == 0:
        return
    rows = collapse_rows(lead, x, codes, scales, zeros)
    if rows is None:  # more than three unmergeable leading dims: contiguous temporaries, then copy
        tmp = quantize_groups(x.contiguous(), bits, group_size, mode, eta)
        for dst, src in zip((codes, scales, zeros), tmp, strict=True):
            dst.copy_(src)
        return
    (_, D1, D2), (sx, sc, ss, sz) = rows
    block_rows, nbg = _tiles(n_rows, group_size)
    eta = float(eta) if mode == "asym" else 0.0
    with device_ctx(x):
        _quantize_kernel[(triton.cdiv(n_rows, block_rows), L // group_size)](
            x, codes, scales.view(torch.int16), zeros,
            n_rows, D1, D2, *sx, x.stride(-1), *sc, *ss, *sz,
            1.0 - 2.0 * eta, eta,  # fp32 scalars rounded from double, as quant.cuh asym_calib
            BITS=bits, GROUP=group_size, MODE=_MODES[mode], BLOCK_ROWS=block_rows, NBG=nbg,
            num_warps=4, **_launch_opts(),
        )  # fmt: skip


def quantize_groups(x: torch.Tensor, bits: int, group_size: int, mode: str, eta: float = 0.0):
    """x [..., L]  ->  (codes int32 [..., L*bits/32], scales fp16 [..., L/G], zeros fp16 [..., L/G])."""
    _validate.check_quantize("quantize_groups", x, bits, group_size, mode, eta)
    check_device("quantize_groups", x)
    lead, L = tuple(x.shape[:-1]), x.shape[-1]
    codes = torch.empty((*lead, L // 32 * bits), dtype=torch.int32, device=x.device)
    scales = torch.empty((*lead, L // group_size), dtype=torch.float16, device=x.device)
    zeros = torch.empty_like(scales)
    if collapse_rows(lead, x) is None:
        x = x.contiguous()
    quantize_groups_into(x, bits, group_size, mode, eta, codes, scales, zeros)
    return codes, scales, zeros


def dequantize_groups(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int, group_size: int, mode: str
) -> torch.Tensor:
    """Inverse of quantize_groups: fp32 [..., L] with x = s * u + zeff per group (see group_affine)."""
    _validate.check_dequantize(codes, scales, zeros, bits, group_size, mode)
    check_device("dequantize_groups", codes)
    lead = tuple(codes.shape[:-1])
    L = codes.shape[-1] // bits * 32
    out = torch.empty((*lead, L), dtype=torch.float32, device=codes.device)
    n_rows = out.numel() // L if L else 0
    if n_rows == 0 or L == 0:
        return out
    z = zeros if zeros is not None else scales  # sym never reads it
    if codes.shape[-1] > 1 and codes.stride(-1) != 1:  # the kernel reads each row's words contiguously
        codes = codes.contiguous()  # (the checks require unit last strides of scales and zeros, not of codes)
    rows = collapse_rows(lead, codes, scales, z)
    if rows is None:
        codes, scales, z = codes.contiguous(), scales.contiguous(), z.contiguous()
        rows = collapse_rows(lead, codes, scales, z)
    (_, D1, D2), (sc, ss, sz) = rows
    block_rows, nbg = _tiles(n_rows, group_size)
    with device_ctx(codes):
        _dequantize_kernel[(triton.cdiv(n_rows, block_rows), L // group_size)](
            codes, scales.view(torch.int16), z, out,
            n_rows, D1, D2, L, *sc, *ss, *sz,
            BITS=bits, GROUP=group_size, MODE=_MODES[mode], BLOCK_ROWS=block_rows, NBG=nbg,
            num_warps=4, **_launch_opts(),
        )  # fmt: skip
    return out
