"""InnerQ fused dequant-GEMV in Triton, on tensor cores: groups run along the reduction dim L.

    y[b, h, t, m] = sum_l x[b, h, t, l] * x_scale[h_kv, l] * (s[m, g] * u[m, l] + zeff[m, g]),  h_kv = h // (H_q/H_kv)
                  = sum_g  s[m, g] * dot(u_g, x_g)  +  zeff[m, g] * sum(x_g)

Grid: (cdiv(M, M_TILE), B * H_kv, splits). A program owns M_TILE code rows of one KV head and serves every query row
that reads them: the H_q/H_kv heads of its group times the T query rows, flattened to Q = ratio * T and padded to the
power of two QP >= 8 (masked): the N side of the MMA. Its MMA tile has BLOCK_M rows: M_TILE = BLOCK_M where M is
long (the key GEMV: M = tokens); where M is short (the value GEMV: M = head_dim < BLOCK_M) the tile stacks
STACK = BLOCK_M / M_TILE sub-chunks of L of the same M_TILE rows, against STACK x QP activation columns, and the
(row, column) pairs of the same sub-chunk are summed at the end (the MMA does STACK x the products; a thread still
decodes whole rows, which is what the loop's cost depends on: see _CONFIGS). It walks its share of L in chunks of
STACK x BK values (BK divides the group size G, so a sub-chunk is inside one group), and per chunk:

- unpacks the [BLOCK_M, BK] codes to exact 16-bit integers, two per 32-bit operation (unpack_pairs; signed
  u - 2^(b-1) for sym, so the zero term vanishes), in registers of the thread that holds the rows;
- multiplies them with the [BK, STACK x QP] activations on tensor cores (tl.dot, fp32 accumulation): activations that
  arrive as fp16 / bf16 are one dot in that type; fp32 activations (and any x_scale) are split exactly into three
  bf16 parts, three dots (_common.split_dot). Products are exact, sums fp32: the reference's arithmetic up to the
  summation order;
- applies the group's fp16 scale once to the chunk's [BLOCK_M, STACK x QP] dot, plus zeff times the chunk's x-sums
  (asym / hybrid): two FMAs per output per chunk.

The reduction of the chunk stays inside the MMA (no cross-lane shuffles in the loop but the x-sums of asym / hybrid).

1-bit asym / hybrid (DEQ1, _chunk_deq1) take gemv_kivi's arithmetic instead: a code is 0 or 1, so each value is one of
its group's two dequantized values, fp16(s * 0 + zeff) or fp16(s + zeff), picked by a byte-permute select
(select_pairs_1bit) and rounded once to fp16 (docs/FORMATS.md, "GEMV arithmetic"); the scales are then in the operand,
a chunk may span groups, and each iteration is one dot pair over VALS values per tile row with the activations as
fp16 hi + lo (scaled per column and chunk by a power of two), where the exact path pays three bf16 dots and a
scale-and-zero fold per 32-value group (bench/triton_budget.py, sm_90, triton 3.9: keys 18.8 -> 13.8, values 21.4 ->
15.7 instructions/byte). 1-bit sym keeps the exact path (its levels -1 / 0 are not a select of two stored values).
The main loop takes VALS values (VALS / (STACK x BK) chunks, unrolled) per iteration at up to 16 query rows, the split's
last chunks one by one (sub-chunks past the split's end masked). Tiles: BLOCK_M, VALS, num_warps and num_stages are
autotuned (_CONFIGS, pruned to the tiles that fit M and the query rows) per (bits, mode, L bucket, M bucket, query
rows); BK = the largest of 128 / 64 / 32 that divides G. When B * H_kv * cdiv(M, M_TILE) is too few programs to fill the
GPU (the value GEMV: M = head_dim, L = tokens), L is split across `splits` programs that write fp32 partials [splits, B,
H_q, T, M], summed afterwards in a fixed order (deterministic); the split does not depend on the tuned config.
"""

import torch
import triton
import triton.language as tl

from kvkernels import _validate

from ._common import (
    EMULATE_DOT,
    INTERPRETED,
    bucket,
    check_device,
    device_ctx,
    dot_operands,
    gqa_query_rows,
    group_affine,
    halves,
    load_words,
    next_pow2,
    num_splits,
    pair_perm,
    query_t_chunk,
    select_pairs_1bit,
    split_dot,
    unpack_pairs,
)

_MODES = {"sym": 0, "asym": 1, "hybrid": 2}

# Autotune configs (BLOCK_M rows of the MMA tile, VALS values of L per loop iteration, num_warps, num_stages), in
# order of preference: _prune keeps those that fit the launch (M, query rows) and the first kept is the default (the
# only one under TRITON_INTERPRET=1, where tuning would only multiply test time). What decides the loop's cost is the
# rows per thread: with two or more whole rows a thread decodes its rows' words in registers (two values per
# operation) and writes the MMA operand with 16-byte stores, and the activations' split and the MMA round trips are
# shared by more rows (bench/triton_budget.py, sm_90, 4 query rows: 3-bit keys on 64 x 4 warps, one row a thread,
# 37.7 instructions/byte decoding one value per operation, 46.5 with pairs; 256 x 4: 13.2). 256 x 4 (wgmma) serves
# the long-M key GEMV, and stacked (128 rows x 2 sub-chunks of L) the value GEMV at head_dim 128 (3-bit values: 128 x
# 2 unstacked 17.8, stacked 256 x 4 15.4); 128 x 2 and 64 x 1 (mma.sync) the value GEMV at 8 query rows and at
# head_dim 64 (128 x 1 is leaner than 128 x 2 but spills in 26 of the compiled variants); 64 x 4 (the previous
# default) is the tile whose accumulator fits at 32+ query rows, and gives the autotuner 4x the programs of 256 x 4
# where a GPU is latency-bound rather than issue-bound.
_CONFIGS = [
    triton.Config({"BLOCK_M": 256, "VALS": 64}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_M": 128, "VALS": 64}, num_warps=2, num_stages=3),
    triton.Config({"BLOCK_M": 64, "VALS": 32}, num_warps=1, num_stages=3),
    triton.Config({"BLOCK_M": 64, "VALS": 128}, num_warps=4, num_stages=3),
]
# fp32 accumulator registers a thread may hold (BLOCK_M x STACK x QP / threads): more spills at 32+ query rows
_MAX_ACC_REGS = 32
_SPLIT_BLOCK_M = 64  # the tile the split of L is planned with (independent of the config the autotuner picks)


@triton.jit
def _chunk_window(l0, l_hi, x_ptr, x_col, q_ok, col_sub, xs_ptr, xs_row, kv, m_ok, row_sub, SUB: tl.constexpr,
                  HAS_XS: tl.constexpr, STACK: tl.constexpr):  # fmt: skip
    """A chunk's activations and rows, for the STACK sub-chunks of SUB values from l0 on: (xv [SUB, SQ] fp32, times
    x_scale, in kv's value order; row_l0, the first value of each tile row's sub-chunk: l0 itself at STACK 1, else
    [BLOCK_M]; row_ok [BLOCK_M]). STACK 1 reads whole chunks; stacked sub-chunks from l_hi on read as 0."""
    if STACK == 1:  # every column reads the same values of L
        l = l0 + kv
        xv = tl.load(x_ptr + x_col[None, :] + l[:, None], mask=q_ok[None, :], other=0.0).to(tl.float32)
        if HAS_XS:
            xv *= tl.load(xs_ptr + xs_row + l)[:, None]
        row_l0 = l0
        row_ok = m_ok
    else:
        col_l0 = l0 + col_sub * SUB  # [SQ]
        col_ok = q_ok & (col_l0 < l_hi)
        l2 = col_l0[None, :] + kv[:, None]  # [SUB, SQ]
        xv = tl.load(x_ptr + x_col[None, :] + l2, mask=col_ok[None, :], other=0.0).to(tl.float32)
        if HAS_XS:
            xv *= tl.load(xs_ptr + xs_row + l2, mask=col_ok[None, :], other=0.0)
        row_l0 = l0 + row_sub * SUB  # [BLOCK_M]
        row_ok = m_ok & (row_l0 < l_hi)
    return xv, row_l0, row_ok


@triton.jit
def _chunk(acc, l0, l_hi, x_ptr, x_col, q_ok, col_sub, xs_ptr, xs_row, kv, c_rows, m_ok, row_sub, scales_ptr, s_row,
           zeros_ptr, z_row, BITS: tl.constexpr, GROUP: tl.constexpr, MODE: tl.constexpr, HAS_XS: tl.constexpr,
           BK: tl.constexpr, DOT16: tl.constexpr, XPARTS: tl.constexpr, EMU: tl.constexpr,
           STACK: tl.constexpr):  # fmt: skip
    """acc + the chunk of STACK x BK values of L from l0 on: the loop body of _gemv_inner_q_kernel.

    STACK = 1: the tile's rows are BLOCK_M rows of M, the chunk BK values (inside one group). STACK > 1: row i of the
    tile is row i % M_TILE of M over sub-chunk row_sub[i] = i // M_TILE (values l0 + row_sub * BK ..), and column
    j of the activations is query row j % QP over sub-chunk col_sub[j]; the MMA computes every (row, column) pair,
    the caller keeps the pairs whose sub-chunks match. Sub-chunks from l_hi on read as 0."""
    BLOCK_M: tl.constexpr = acc.shape[0]
    SQ: tl.constexpr = acc.shape[1]
    # the chunk is whole at STACK 1 (l_hi is a multiple of BK); every row reads the chunk's group there
    xv, row_l0, row_ok = _chunk_window(l0, l_hi, x_ptr, x_col, q_ok, col_sub, xs_ptr, xs_row, kv, m_ok, row_sub, BK,
                                       HAS_XS, STACK)  # fmt: skip

    # [BLOCK_M, BK] exact 16-bit codes; sym: signed, sum_l (s u_l - s 2^(b-1)) x_l = s * dot(u - 2^(b-1), x)
    OFF: tl.constexpr = 1 << (BITS - 1)
    c_off: tl.constexpr = OFF if MODE == 0 else 0
    ua = unpack_pairs(c_rows, (l0 // 32) * BITS, row_ok, BK // 32 * BITS, c_off, BITS, BK, DOT16, EMU)
    d = split_dot(ua, xv, tl.zeros((BLOCK_M, SQ), dtype=tl.float32), XPARTS, DOT16, EMU)  # [BLOCK_M, SQ]

    g = row_l0 // GROUP
    scale_bits = tl.load(scales_ptr + s_row + g, mask=row_ok, other=0)  # [BLOCK_M]
    if MODE == 0:
        zero = scale_bits  # unused by sym
    else:
        zero = tl.load(zeros_ptr + z_row + g, mask=row_ok, other=0.0)
    s, zeff = group_affine(scale_bits, zero, BITS, MODE)
    if MODE == 0:
        acc += s[:, None] * d
    else:
        xsum = tl.sum(xv, axis=0)  # [SQ]
        acc += s[:, None] * d + zeff[:, None] * xsum[None, :]
    return acc


@triton.jit
def _levels_1bit(scale_bits, zero, MODE: tl.constexpr):
    """The two values a 1-bit code of each group dequantizes to, fp16(s * 0 + zeff) and fp16(s + zeff), each in both
    halves of an int32 (select_pairs_1bit's patterns), from the raw fp16 scale bits (int16) and the fp16 zero.

    In fp16 arithmetic on the device (a byte permute per operand, one HFMA2 and one HADD2): s + zeff rounded once,
    the value the fp32 sum rounds to (exact unless the terms are over 2^12 apart, and then the smaller is under half
    an ulp of the larger); s * 0 + zeff carries a NaN / inf scale into both values as the reference's s u + zeff
    does (past the dot an infinite value may still become NaN where the reference has +-inf: fp32 / bf16 activations
    enter as hi + lo, and inf times a lo part of 0 is NaN; the same holds for s + zeff overflowing fp16, and for
    gemv_kivi). zeff as group_affine: asym the zero; hybrid (1 bit: the sym levels are -s, 0) the zero where the scale's
    sign bit is set, else -|s|."""
    sb = scale_bits.to(tl.int32)  # sign-extended: negative iff the fp16 sign bit is set
    zb = zero.to(tl.int16, bitcast=True).to(tl.int32)
    if MODE == 2:
        s16 = sb & 0x7FFF
        z16 = tl.where(sb < 0, zb, s16 | 0x8000)
    else:
        s16 = sb
        z16 = zb
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 s2, z2, zr;
        prmt.b32 s2, $2, 0, 0x1010;
        prmt.b32 z2, $3, 0, 0x1010;
        mov.b32 zr, 0;
        fma.rn.f16x2 $0, s2, zr, z2;
        add.rn.f16x2 $1, s2, z2;
        }""",
        "=r,=r,r,r",
        [s16, z16],
        dtype=(tl.int32, tl.int32),
        is_pure=True,
        pack=1,
    )


@triton.jit
def _chunk_deq1(acc, l0, l_hi, x_ptr, x_col, q_ok, col_sub, xs_ptr, xs_row, c_base, m_ok, row_sub, scales_ptr, s_row,
                zeros_ptr, z_row, GROUP: tl.constexpr, MODE: tl.constexpr, HAS_XS: tl.constexpr, KV: tl.constexpr,
                XPARTS: tl.constexpr, EMU: tl.constexpr, STACK: tl.constexpr):  # fmt: skip
    """acc + the chunk of STACK x KV values of L from l0 on (sub-chunk s: values l0 + s KV ..), 1-bit asym / hybrid.

    gemv_kivi's arithmetic instead of _chunk's: each value is dequantized to fp16(s u + zeff), rounded once (a code
    selects one of its group's two values: a shift, a byte permute and a LOP3 per two values), so the scales are
    applied before the MMA and a chunk may span groups: one dot pair (fp16 hi + lo of the activations, scaled per
    column by a power of two: split_dot XPARTS 2; fp16 activations without x_scale: one dot) per KV values instead
    of three bf16 dots and a fold per group. Sub-chunks from l_hi on read as 0."""
    BLOCK_M: tl.constexpr = acc.shape[0]
    NW: tl.constexpr = KV // 32
    kv = pair_perm(tl.arange(0, KV), 1)
    xv, row_l0, row_ok = _chunk_window(l0, l_hi, x_ptr, x_col, q_ok, col_sub, xs_ptr, xs_row, kv, m_ok, row_sub, KV,
                                       HAS_XS, STACK)  # fmt: skip
    if STACK == 1:  # the chunk is whole; row_l0 is l0 for every row
        g = ((l0 + 32 * tl.arange(0, NW)) // GROUP)[None, :]  # [1, NW]: the group of each 32-value word
    else:
        g = (row_l0[:, None] + 32 * tl.arange(0, NW)[None, :]) // GROUP  # [BLOCK_M, NW]
    row_words = c_base + row_l0 // 32  # [BLOCK_M] pointers to each row's first word of its sub-chunk

    # each 32-value word's (s, zeff) and the two fp16 values its codes select between (asym / hybrid: a zero each)
    tl.static_assert(MODE == 1 or MODE == 2, "_chunk_deq1 serves 1-bit asym / hybrid")
    scale_bits = tl.load(scales_ptr + s_row[:, None] + g, mask=row_ok[:, None], other=0)
    zero = tl.load(zeros_ptr + z_row[:, None] + g, mask=row_ok[:, None], other=0.0)
    if EMU:  # the interpreter: the same roundings on exact codes in fp32 (select_pairs_1bit is inline PTX)
        s, zeff = group_affine(scale_bits, zero, 1, MODE)  # [BLOCK_M, NW] fp32 (exact fp16 values)
        u = tl.reshape(unpack_pairs(row_words, 0, row_ok, NW, 0, 1, KV, 0, EMU), (BLOCK_M, NW, 32))
        sw = tl.broadcast_to(s[:, :, None], (BLOCK_M, NW, 32))
        zw = tl.broadcast_to(zeff[:, :, None], (BLOCK_M, NW, 32))
        a = tl.reshape((u * sw + zw).to(tl.float16), (BLOCK_M, KV))
    else:
        lo2, hi2 = _levels_1bit(scale_bits, zero, MODE)
        w = load_words(row_words, 0, row_ok, NW, NW)  # [BLOCK_M, NW]; masked rows read as code 0 of scale 0
        a = halves(select_pairs_1bit(w, lo2, hi2), BLOCK_M, KV).to(tl.float16, bitcast=True)
    return split_dot(a, xv, acc, XPARTS, 0, EMU)


@triton.jit
def _gemv_inner_q_kernel(
    # pointers
    x_ptr,  # fp16/bf16/fp32 [B, H_q, T, L]
    codes_ptr,  # int32 [B, H_kv, M, L*BITS/32]
    scales_ptr,  # int16 view of the fp16 scales [B, H_kv, M, L/G]
    zeros_ptr,  # fp16 [B, H_kv, M, L/G] (unused for sym)
    xs_ptr,  # fp32 [H_kv, L] (unused unless HAS_XS)
    y_ptr,  # fp32 [splits, B, H_q, T, M]
    # sizes
    H_kv,
    M,
    T,
    Q,  # query rows per KV head: (H_q / H_kv) * T
    L,
    per_split,  # values of L per split, a multiple of BK
    L_BUCKET,  # autotune key only: bucket(L)
    M_BUCKET,  # autotune key and _prune only: bucket(M, 64) (the key GEMV's M is the context length)
    # strides (elements; the last dim of every tensor is contiguous)
    sx_b,
    sx_h,
    sx_t,
    sc_b,
    sc_h,
    sc_m,
    ss_b,
    ss_h,
    ss_m,
    sz_b,
    sz_h,
    sz_m,
    sxs_h,
    sy_s,
    sy_b,
    sy_h,
    sy_t,
    # meta-parameters
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    MODE: tl.constexpr,  # 0 sym, 1 asym, 2 hybrid
    HAS_XS: tl.constexpr,
    QP: tl.constexpr,  # max(8, next_pow2(Q)): the MMA's N
    BK: tl.constexpr,  # values of L per chunk, divides GROUP
    DOT16: tl.constexpr,  # 0: fp16 operands, 1: bf16
    XPARTS: tl.constexpr,  # 1: x is exactly the 16-bit type, 3: fp32 x as three bf16 parts
    EMU: tl.constexpr,  # interpreter: dots on fp32-widened operands
    DEQ1: tl.constexpr,  # 1-bit asym / hybrid: values dequantized to fp16 before the MMA (_chunk_deq1)
    M_CAP: tl.constexpr,  # min(256, bucket(M, 64)): the rows of M a program needs at most (tile_stack)
    BLOCK_M: tl.constexpr,  # the MMA tile's rows: M_TILE rows of M x STACK sub-chunks of L
    VALS: tl.constexpr,  # values of L per main-loop iteration: NCH = VALS / (STACK BK) chunks (one at QP > 16)
):
    # A short M (the value GEMV: head_dim) fills the tile with STACK sub-chunks of L of the same M_TILE rows, so each
    # thread still decodes whole rows (see _CONFIGS)
    M_TILE: tl.constexpr = BLOCK_M if BLOCK_M <= M_CAP else M_CAP
    STACK: tl.constexpr = BLOCK_M // M_TILE
    SQ: tl.constexpr = STACK * QP
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    b, h_kv, h_q, t, q_ok = gqa_query_rows(pid_bh, H_kv, Q, T, 0, QP)
    x_row = b * sx_b + h_q * sx_h + t * sx_t  # [QP] int64
    # the activations' columns: query row j % QP of sub-chunk j // QP
    col_sub = tl.arange(0, SQ) // QP
    x_col = tl.reshape(tl.broadcast_to(x_row[None, :], (STACK, QP)), (SQ,))
    col_q_ok = tl.reshape(tl.broadcast_to(q_ok[None, :], (STACK, QP)), (SQ,))

    i = tl.arange(0, BLOCK_M)
    row_sub = i // M_TILE
    m = pid_m * M_TILE + i % M_TILE
    m_ok = m < M
    m64 = m.to(tl.int64)
    # [BLOCK_M] pointers to each row's words of its sub-chunk (offset from the chunk's first word)
    c_rows = codes_ptr + (b * sc_b + h_kv * sc_h + m64 * sc_m) + row_sub * (BK // 32 * BITS)
    s_row = b * ss_b + h_kv * ss_h + m64 * ss_m
    z_row = b * sz_b + h_kv * sz_h + m64 * sz_m

    kv = pair_perm(tl.arange(0, BK), BITS)  # the value each position of the unpacked tile holds
    acc = tl.zeros((BLOCK_M, SQ), dtype=tl.float32)
    l_lo = pid_s * per_split
    l_hi = tl.minimum(l_lo + per_split, L)
    CH: tl.constexpr = STACK * BK  # values of L per chunk
    # at 32+ query rows the accumulator is large and the loop's work already shared by many rows: one chunk (four
    # spilled 32 B at 64 rows x 128 x 8 warps, tests/test_triton_compile.py)
    # (DEQ1: every tile row takes VALS values, a stacked tile STACK x VALS: its sub-chunks need not lie in a group)
    if DEQ1:
        NCH: tl.constexpr = VALS // BK if VALS > BK and QP <= 16 else 1
    else:
        NCH: tl.constexpr = VALS // CH if VALS > CH and QP <= 16 else 1
    l_mid = l_lo + (l_hi - l_lo) // (CH * NCH) * (CH * NCH)
    xs_row = h_kv * sxs_h
    # NCH chunks per iteration: the loop's own work (addresses, bounds, the pipeline's waits) once per VALS values
    # instead of per group (bench/triton_budget.py, 64 x 4 x 128 then: 43.4 -> 37.7 instructions/byte at 3 bits, 31.2
    # -> 25.8 at 2, 17.7 -> 16.1 at 4); the split's last < NCH chunks one by one (sub-chunks from l_hi on masked)
    if DEQ1:  # an iteration's NCH chunks as one: each sub-chunk NCH x BK values (groups applied before the MMA)
        c_base = codes_ptr + (b * sc_b + h_kv * sc_h + m64 * sc_m)
        for l00 in range(l_lo, l_mid, CH * NCH):
            acc = _chunk_deq1(acc, l00, l_hi, x_ptr, x_col, col_q_ok, col_sub, xs_ptr, xs_row, c_base, m_ok, row_sub,
                              scales_ptr, s_row, zeros_ptr, z_row, GROUP, MODE, HAS_XS, NCH * BK, XPARTS, EMU,
                              STACK)  # fmt: skip
        for l0 in range(l_mid, l_hi, CH):
            acc = _chunk_deq1(acc, l0, l_hi, x_ptr, x_col, col_q_ok, col_sub, xs_ptr, xs_row, c_base, m_ok, row_sub,
                              scales_ptr, s_row, zeros_ptr, z_row, GROUP, MODE, HAS_XS, BK, XPARTS, EMU,
                              STACK)  # fmt: skip
    else:
        for l00 in range(l_lo, l_mid, CH * NCH):
            for j in tl.static_range(NCH):
                acc = _chunk(acc, l00 + j * CH, l_hi, x_ptr, x_col, col_q_ok, col_sub, xs_ptr, xs_row, kv, c_rows,
                             m_ok, row_sub, scales_ptr, s_row, zeros_ptr, z_row, BITS, GROUP, MODE, HAS_XS, BK, DOT16,
                             XPARTS, EMU, STACK)  # fmt: skip
        for l0 in range(l_mid, l_hi, CH):
            acc = _chunk(acc, l0, l_hi, x_ptr, x_col, col_q_ok, col_sub, xs_ptr, xs_row, kv, c_rows, m_ok, row_sub,
                         scales_ptr, s_row, zeros_ptr, z_row, BITS, GROUP, MODE, HAS_XS, BK, DOT16, XPARTS, EMU,
                         STACK)  # fmt: skip

    y_row = pid_s.to(tl.int64) * sy_s + b * sy_b + h_q * sy_h + t * sy_t
    if STACK == 1:
        tl.store(y_ptr + y_row[None, :] + m64[:, None], acc, mask=m_ok[:, None] & q_ok[None, :])
    else:  # the (row, column) pairs of the same sub-chunk, summed over the sub-chunks: [M_TILE, QP]
        acc = tl.where(row_sub[:, None] == col_sub[None, :], acc, 0.0)
        y = tl.sum(tl.reshape(tl.sum(tl.reshape(acc, (BLOCK_M, STACK, QP)), axis=1), (STACK, M_TILE, QP)), axis=0)
        mo = pid_m * M_TILE + tl.arange(0, M_TILE)
        tl.store(y_ptr + y_row[None, :] + mo.to(tl.int64)[:, None], y, mask=(mo < M)[:, None] & q_ok[None, :])


def tile_stack(block_m: int, m_cap: int) -> int:
    """STACK of a BLOCK_M-row tile for a launch whose M needs at most m_cap rows (the kernel's rule, M_TILE =
    BLOCK_M / STACK): 1 where M fills the tile, else the sub-chunks of L stacked under the same rows."""
    return block_m // min(block_m, m_cap)


def _prune(configs, named_args, **kwargs):
    """The configs that fit the launch, in _CONFIGS' order: at most _MAX_ACC_REGS accumulator registers per thread
    (BLOCK_M x STACK x QP over the threads: a tile stacked for a short M holds STACK x QP columns), and stacked only
    on warpgroup (wgmma) tiles: on a one- or two-warp mma.sync tile stacking measured worse (head_dim 64 values,
    3 sym: 64 x 1 18.4 instructions/byte, 128 x 2 stacked twice 21.7); at least the last config (the smallest tile).
    Under TRITON_INTERPRET=1 only the first: one config, no timing."""
    m_cap = kwargs.get("M_CAP", named_args.get("M_CAP", 256))
    qp = kwargs.get("QP", named_args.get("QP", 8))

    def fits(c):
        rows, warps = c.kwargs["BLOCK_M"], c.num_warps
        stack = tile_stack(rows, m_cap)
        return rows * stack * qp <= _MAX_ACC_REGS * 32 * warps and (stack == 1 or warps % 4 == 0)

    keep = [c for c in configs if fits(c)] or configs[-1:]
    return keep[:1] if INTERPRETED else keep


_gemv_inner_q_tuned = triton.autotune(
    configs=_CONFIGS,
    key=["BITS", "MODE", "L_BUCKET", "M_BUCKET", "QP"],
    prune_configs_by={"early_config_prune": _prune},
)(_gemv_inner_q_kernel)


def block_values(group_size: int) -> int:
    """BK: the largest of 128, 64, 32 dividing the group size (a chunk of L never straddles a group)."""
    return next(bk for bk in (128, 64, 32) if group_size % bk == 0)


def gemv_inner_q(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bits: int,
    group_size: int,
    mode: str,
    x_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """y[b, h, (t,) m] = sum_l x[b, h, (t,) l] * x_scale[h_kv, l] * deq(codes[b, h_kv, m, l])  (fp32)."""
    _validate.check_gemv_inner_q(x, codes, scales, zeros, bits, group_size, mode, x_scale)
    check_device("gemv_inner_q", x)
    has_t = x.dim() == 4
    x4 = x if has_t else x.unsqueeze(2)
    B, H_q, T, L = x4.shape
    _, H_kv, M, _ = codes.shape
    y_shape = (B, H_q, T, M) if has_t else (B, H_q, M)
    if B * H_q * T * M == 0 or L == 0:
        return torch.zeros(y_shape, dtype=torch.float32, device=x.device)

    tc = query_t_chunk(H_q // H_kv, T)
    if tc < T:  # long q_len: launches of tc rows (see MAX_QUERY_ROWS), concatenated along T
        args = (codes, scales, zeros, bits, group_size, mode, x_scale)
        parts = [gemv_inner_q(x4[:, :, t0 : t0 + tc], *args) for t0 in range(0, T, tc)]
        return torch.cat(parts, dim=2)

    Q = (H_q // H_kv) * T
    qp = max(8, next_pow2(Q))
    bk = block_values(group_size)
    n_chunks = L // bk
    splits = num_splits(triton.cdiv(M, _SPLIT_BLOCK_M) * B * H_kv, n_chunks, x.device)
    per_split = triton.cdiv(n_chunks, splits) * bk
    splits = triton.cdiv(L, per_split)
    deq1 = bits == 1 and mode != "sym"
    if deq1:  # fp16 operands (_chunk_deq1): fp16 activations as they are, others as fp16 hi + lo
        dot16, xparts = 0, 1 if x4.dtype == torch.float16 and x_scale is None else 2
    else:
        dot16, xparts = dot_operands(x4.dtype, x_scale is not None)

    y = torch.empty((splits, B, H_q, T, M), dtype=torch.float32, device=x.device)
    z = zeros if zeros is not None else scales  # sym never reads it
    xs = x_scale if x_scale is not None else y  # placeholder pointer, never read
    with device_ctx(x):
        m_bucket = bucket(M, 64)
        m_cap = min(256, m_bucket)

        def grid(meta):
            m_tile = meta["BLOCK_M"] // tile_stack(meta["BLOCK_M"], m_cap)
            return triton.cdiv(M, m_tile), B * H_kv, splits

        _gemv_inner_q_tuned[grid](
            x4, codes, scales.view(torch.int16), z, xs, y,
            H_kv, M, T, Q, L, per_split, bucket(L), m_bucket,
            *x4.stride()[:3], *codes.stride()[:3], *scales.stride()[:3], *z.stride()[:3],
            xs.stride(0), *y.stride()[:4],
            BITS=bits, GROUP=group_size, MODE=_MODES[mode], HAS_XS=x_scale is not None,
            QP=qp, BK=bk, DOT16=dot16, XPARTS=xparts, EMU=EMULATE_DOT, DEQ1=deq1, M_CAP=m_cap,
        )  # fmt: skip
    y = y[0] if splits == 1 else y.sum(0)  # fixed-order sum: deterministic
    return y if has_t else y.squeeze(2)
