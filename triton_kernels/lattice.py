"""Lattice (HIGGS-style) format in Triton: the Walsh-Hadamard transform, quantize / dequantize and both GEMVs.

docs/FORMATS.md ("Lattice") is the spec and kvkernels/reference/lattice.py the formula-for-formula reference. Per
group of G channels (G a power of two, 32..1024), with H_n = H / sqrt(G) the orthonormal Sylvester Hadamard matrix
and s the optional +-1 signs:

    y = H_n (s * x),   r = ||x|| / sqrt(G)  (stored fp16: r16),   c_j = argmax_c (2 <y_j / r, g_c> - ||g_c||^2)
    x_hat = s * H_n (r16 * grid[c])
    keys:    scores[q, n] = sum_g r16[n, g] * <q'_g, grid[c_{n, g}]>,   q'_g = H_n (s * q_g)
    values:  out[q]       = s * H_n (sum_n p[q, n] r16[n, g] grid[c_{n, g}])   (per group g)

The transform runs in registers as log2(G) butterfly stages: a [rows, G] tile is viewed as [rows, G / 2h, 2, h],
the pair axis split off (tl.split) into a, b and joined back as (a + b, a - b). These are the reference's adds in
the reference's order, so fwht, quantize and dequantize are bit-identical to it (quantize up to argmax near-ties,
whose scores round differently). Not a tl.dot with a +-1 matrix built on the fly ((-1)^popcount(i & j)): that is
G multiply-adds per value instead of log2(G) adds, its [G, G] operand reaches 1M entries at G = 1024 (so large
groups would need a second method anyway), fp32 tl.dot runs in TF32 unless told otherwise, and any other summation
order would make quantize's codes differ from the reference's at more near-ties.

Codes are the grid row indices, IDX_BITS = log2(n) bits each, packed per 32-value block of 32 / d indices into
`bits` = IDX_BITS / d words (FORMATS.md's table; 6-bit indices in FLUTE's 16-per-3-words layout).

GEMVs: one program per (batch, KV head, split of the N tokens) serves every query row of that KV head (H_q / H_kv
heads x T positions, flattened to Q and padded to the power of two QP), so each token's codes are read once. The
keys kernel rotates its query rows once (in registers, [QP, D]) and writes scores for its own tokens; the values
kernel accumulates p * r16 * grid[c] in the rotated domain over its tokens, applies the inverse transform to its
partial sum (linear, so transforming each split's partial and summing equals transforming the sum) and writes fp32
partials [splits, B, H_q, T, D], summed afterwards in a fixed order. head_dim need not be a power of two (G | D):
the tile holds next_pow2(D / G) groups, the missing ones masked.
"""

import torch
import triton
import triton.language as tl

from ._common import (
    INTERPRETED,
    PRODUCT_BUDGET,
    QUANT_TILE,
    check_device,
    collapse_rows,
    device_ctx,
    gqa_query_rows,
    next_pow2,
    num_splits,
    query_t_chunk,
    unit_last,
)
from .quantize import _row_offsets

# Elements of a GEMV's per-program query tile [QP, next_pow2(D)] (rotated query rows, or the values' accumulator),
# live across the whole token loop: 4096 fp32 is 32 registers per thread at num_warps=4. Longer q_len is split
# into launches of fewer rows (the codes are then read once per launch).
ROW_TILE = 4096
# Largest token chunk per GEMV loop iteration (the product tile [QP, BLOCK_N, D] is the binding limit).
MAX_BLOCK_N = 64


# ---------------------------------------------------------------------------------------------------------
# Device helpers


@triton.jit
def _hadamard(x, ROWS: tl.constexpr, GROUP: tl.constexpr, LOG_G: tl.constexpr, INV_SQRT_G: tl.constexpr):
    """H_n x for every row of x [ROWS, GROUP] (fp32): log2(G) butterfly stages, then one multiply by fp32(1/sqrt G).

    Stage h = 2^s maps each pair (a, b) = (x[i], x[i + h]), i % 2h < h, to (a + b, a - b): the row viewed as
    [G / 2h, 2, h] has a and b on the pair axis, which tl.split takes apart once it is moved last.
    """
    for s in tl.static_range(LOG_G):
        x = tl.reshape(x, (ROWS, GROUP >> (s + 1), 2, 1 << s))
        a, b = tl.split(tl.permute(x, (0, 1, 3, 2)))  # [ROWS, G / 2h, h] each
        x = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
    return tl.reshape(x, (ROWS, GROUP)) * INV_SQRT_G


@triton.jit
def _signs_row(signs_ptr, GROUP: tl.constexpr):
    """The signs s as an fp32 row [1, GROUP], to multiply a [rows, GROUP] tile."""
    return tl.load(signs_ptr + tl.arange(0, GROUP)).to(tl.float32)[None, :]


@triton.jit
def _load_group(x_ptr, n_rows, D1, D2, sx0, sx1, sx2, sxc, GROUP: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """This program's tile of x: group program_id(1) of rows program_id(0) * BLOCK_ROWS + [0, BLOCK_ROWS).
    -> (rows int64 [BLOCK_ROWS], r_ok, col int64 [GROUP], x fp32 [BLOCK_ROWS, GROUP], 0 in rows past n_rows)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    r_ok = rows < n_rows
    col = (tl.program_id(1) * GROUP + tl.arange(0, GROUP)).to(tl.int64)
    x_row = _row_offsets(rows, D1, D2, sx0, sx1, sx2)
    x = tl.load(x_ptr + x_row[:, None] + col[None, :] * sxc, mask=r_ok[:, None], other=0.0).to(tl.float32)
    return rows, r_ok, col, x


@triton.jit
def _unpack_indices(word0_ptrs, mask, IDX_BITS: tl.constexpr, IPB: tl.constexpr):
    """Grid indices of whole 32-value blocks. word0_ptrs: int32 pointers [A, NB] to word 0 of each block
    -> int32 [A, NB, IPB], IPB = 32 / d indices per block.

    Index j sits in word j // (32 // IDX_BITS) at bit IDX_BITS * (j % (32 // IDX_BITS)); for 6-bit indices, j = 15
    is spread over the top two bits of the block's three words (bits 2w, 2w + 1 of the index in word w).
    Each word is loaded once and selected per index.
    """
    IPW: tl.constexpr = 32 // IDX_BITS
    WORDS: tl.constexpr = IPB * IDX_BITS // 32
    j = tl.arange(0, IPB)[None, None, :]
    w0 = tl.load(word0_ptrs, mask=mask, other=0)[:, :, None]
    w1 = tl.load(word0_ptrs + 1, mask=mask, other=0)[:, :, None]
    if WORDS == 2:
        w = tl.where(j < IPW, w0, w1)
    elif WORDS == 3:
        w2 = tl.load(word0_ptrs + 2, mask=mask, other=0)[:, :, None]
        w = tl.where(j < IPW, w0, tl.where(j < 2 * IPW, w1, w2))
    else:
        tl.static_assert(WORDS == 4, "a block of indices is 2, 3 or 4 words")
        w2 = tl.load(word0_ptrs + 2, mask=mask, other=0)[:, :, None]
        w3 = tl.load(word0_ptrs + 3, mask=mask, other=0)[:, :, None]
        w = tl.where(j < IPW, w0, tl.where(j < 2 * IPW, w1, tl.where(j < 3 * IPW, w2, w3)))
    c = (w >> ((j % IPW) * IDX_BITS)) & ((1 << IDX_BITS) - 1)  # arithmetic shift: the mask drops the sign copies
    if IDX_BITS == 6:
        c15 = ((w0 >> 30) & 3) | (((w1 >> 30) & 3) << 2) | (((w2 >> 30) & 3) << 4)
        c = tl.where(j == 15, c15, c)
    return c


@triton.jit
def _pack_word(c, W: tl.constexpr, IDX_BITS: tl.constexpr, IPB: tl.constexpr):
    """Word W of each block from its indices c [A, NB, IPB] (int32) -> [A, NB]; the inverse of _unpack_indices.
    The bit fields are disjoint, so their sum is their OR."""
    IPW: tl.constexpr = 32 // IDX_BITS
    j = tl.arange(0, IPB)[None, None, :]
    field = tl.where(j // IPW == W, c << ((j % IPW) * IDX_BITS), 0)
    if IDX_BITS == 6:  # the 16th index: its bits 2W, 2W + 1 in bits 30-31
        field = tl.where(j == 15, ((c >> (2 * W)) & 3) << 30, field)
    return tl.sum(field, axis=2)


@triton.jit
def _grid_rows(grid_ptr, idx, DIM: tl.constexpr):
    """grid[idx] for int32 indices [A, NB, IPB] -> fp32 [A, NB, IPB, DIM]: a gather from the tiny (<= 4 KiB),
    cache-resident grid. Indices come from IDX_BITS-bit fields, so every one is a valid row."""
    k = tl.arange(0, DIM)[None, None, None, :]
    return tl.load(grid_ptr + idx[:, :, :, None] * DIM + k)


@triton.jit
def _token_chunk(
    codes_ptr,
    norms_ptr,
    grid_ptr,
    c_rows,
    n_rows,
    n_ok,
    NG: tl.constexpr,
    NGP: tl.constexpr,
    GROUP: tl.constexpr,
    DIM: tl.constexpr,
    IDX_BITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """A GEMV's chunk of BLOCK_N tokens, read from their codes. c_rows / n_rows: int64 [BLOCK_N] offsets of each
    token's codes / norms row; n_ok: which tokens exist.
    -> (grid[c] fp32 [1, BLOCK_N, NGP, GROUP] (rotated, unscaled), r16 fp32 [BLOCK_N, NGP]). Padded groups and
    missing tokens get norm 0, so their (finite) grid rows add nothing."""
    IPB: tl.constexpr = 32 // DIM
    WORDS: tl.constexpr = IDX_BITS // DIM
    blk = tl.arange(0, NGP * GROUP // 32)
    blk_ok = blk < NG * GROUP // 32
    grp = tl.arange(0, NGP)
    c_ptrs = codes_ptr + c_rows[:, None] + blk[None, :] * WORDS
    idx = _unpack_indices(c_ptrs, n_ok[:, None] & blk_ok[None, :], IDX_BITS, IPB)  # [BLOCK_N, NGP*G/32, IPB]
    gv = tl.reshape(_grid_rows(grid_ptr, idx, DIM), (1, BLOCK_N, NGP, GROUP))
    r16 = tl.load(norms_ptr + n_rows[:, None] + grp[None, :], mask=n_ok[:, None] & (grp < NG)[None, :], other=0.0)
    return gv, r16.to(tl.float32)


@triton.jit
def _nearest(
    u,
    grid_ptr,
    ROWS: tl.constexpr,
    GROUP: tl.constexpr,
    DIM: tl.constexpr,
    N_GRID: tl.constexpr,
    GRID_CHUNK: tl.constexpr,
):
    """Index of the nearest grid row for each d-vector of u [ROWS, GROUP] -> int32 [ROWS, GROUP / DIM].

    argmax_c (2 <u_j, g_c> - ||g_c||^2), first maximum on ties: tl.argmax keeps the lowest index within a chunk
    of GRID_CHUNK rows and a later chunk replaces the running best only when strictly greater. A NaN score never
    wins (the reference's rule), so a vector whose scores are all NaN (its group holds NaN or Inf) gets index 0.
    """
    V: tl.constexpr = GROUP // DIM
    uv = tl.reshape(u, (ROWS, V, DIM))
    k = tl.arange(0, DIM)
    best = tl.full((ROWS, V), float("-inf"), tl.float32)
    idx = tl.zeros((ROWS, V), tl.int32)
    for c0 in range(0, N_GRID, GRID_CHUNK):
        c = c0 + tl.arange(0, GRID_CHUNK)
        g = tl.load(grid_ptr + c[:, None] * DIM + k[None, :])  # [GRID_CHUNK, DIM]
        gg = tl.sum(g * g, axis=1)
        dot = tl.sum(uv[:, :, None, :] * g[None, None, :, :], axis=3)  # [ROWS, V, GRID_CHUNK]
        score = 2.0 * dot - gg[None, None, :]
        score = tl.where(score == score, score, float("-inf"))  # NaN never wins (tl.argmax's NaN rule varies)
        c_best = tl.max(score, axis=2)
        c_arg = tl.argmax(score, axis=2, tie_break_left=True).to(tl.int32)
        better = c_best > best
        best = tl.where(better, c_best, best)
        idx = tl.where(better, c_arg + c0, idx)
    return idx


# ---------------------------------------------------------------------------------------------------------
# fwht / quantize / dequantize: grid (cdiv(rows, BLOCK_ROWS), C / G), one group of BLOCK_ROWS rows per program


@triton.jit
def _fwht_kernel(
    # pointers
    x_ptr,  # fp16/bf16/fp32 [D0, D1, D2, C], any strides
    signs_ptr,  # int8 [G] (unused unless HAS_SIGNS)
    out_ptr,  # fp32 [n_rows, C], contiguous
    # sizes
    n_rows,
    D1,
    D2,
    C,
    # strides of x's three leading dims and of its last dim
    sx0,
    sx1,
    sx2,
    sxc,
    # meta-parameters
    GROUP: tl.constexpr,
    LOG_G: tl.constexpr,
    INV_SQRT_G: tl.constexpr,
    HAS_SIGNS: tl.constexpr,
    INVERSE: tl.constexpr,  # x = s * H_n y instead of y = H_n (s * x)
    BLOCK_ROWS: tl.constexpr,
):
    rows, r_ok, col, x = _load_group(x_ptr, n_rows, D1, D2, sx0, sx1, sx2, sxc, GROUP, BLOCK_ROWS)
    if HAS_SIGNS:
        s = _signs_row(signs_ptr, GROUP)
    if HAS_SIGNS and not INVERSE:
        x = x * s
    y = _hadamard(x, BLOCK_ROWS, GROUP, LOG_G, INV_SQRT_G)
    if HAS_SIGNS and INVERSE:
        y = y * s
    tl.store(out_ptr + rows[:, None] * C + col[None, :], y, mask=r_ok[:, None])


@triton.jit
def _lattice_quantize_kernel(
    # pointers
    x_ptr,  # fp16/bf16/fp32 [D0, D1, D2, C], any strides
    grid_ptr,  # fp32 [N_GRID, DIM], contiguous
    signs_ptr,  # int8 [G] (unused unless HAS_SIGNS)
    codes_ptr,  # int32 [D0, D1, D2, C * WORDS / 32]
    norms_ptr,  # fp16 [D0, D1, D2, C / G]
    # sizes
    n_rows,
    D1,
    D2,
    # strides of the three leading dims (x also of its last dim; the outputs' last dims are contiguous)
    sx0,
    sx1,
    sx2,
    sxc,
    sc0,
    sc1,
    sc2,
    sn0,
    sn1,
    sn2,
    # meta-parameters
    GROUP: tl.constexpr,
    LOG_G: tl.constexpr,
    INV_SQRT_G: tl.constexpr,
    DIM: tl.constexpr,
    N_GRID: tl.constexpr,
    IDX_BITS: tl.constexpr,
    HAS_SIGNS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    GRID_CHUNK: tl.constexpr,
):
    IPB: tl.constexpr = 32 // DIM  # indices per 32-value block
    WORDS: tl.constexpr = IDX_BITS // DIM  # words per block = bits per value
    NBLK: tl.constexpr = GROUP // 32
    g = tl.program_id(1)
    rows, r_ok, _, x = _load_group(x_ptr, n_rows, D1, D2, sx0, sx1, sx2, sxc, GROUP, BLOCK_ROWS)
    if HAS_SIGNS:
        x = x * _signs_row(signs_ptr, GROUP)

    r = tl.sqrt_rn(tl.sum(x * x, axis=1)) * INV_SQRT_G  # [BLOCK_ROWS]: the RMS, of the unrotated x
    y = _hadamard(x, BLOCK_ROWS, GROUP, LOG_G, INV_SQRT_G)
    r2 = r[:, None]
    # u = y / r with IEEE division (as torch; `/` is approximate on NVIDIA), 0 where r == 0 (FORMATS.md step 3);
    # a NaN r leaves u NaN, so that group's indices are 0 (the NaN policy of ops.lattice_quantize)
    u = tl.where(r2 == 0.0, 0.0, tl.math.div_rn(y, tl.where(r2 == 0.0, 1.0, r2)))
    idx = _nearest(u, grid_ptr, BLOCK_ROWS, GROUP, DIM, N_GRID, GRID_CHUNK)  # [BLOCK_ROWS, GROUP / DIM]

    tl.store(norms_ptr + _row_offsets(rows, D1, D2, sn0, sn1, sn2) + g, r.to(tl.float16), mask=r_ok)
    idx = tl.reshape(idx, (BLOCK_ROWS, NBLK, IPB))
    blk = g * NBLK + tl.arange(0, NBLK)
    c_ptrs = codes_ptr + _row_offsets(rows, D1, D2, sc0, sc1, sc2)[:, None] + blk[None, :] * WORDS
    for w in tl.static_range(WORDS):
        tl.store(c_ptrs + w, _pack_word(idx, w, IDX_BITS, IPB), mask=r_ok[:, None])


@triton.jit
def dequantize_group(
    codes_ptr, norms_ptr, grid_ptr, signs_ptr, c_row, n_row, r_ok, g,
    GROUP: tl.constexpr, LOG_G: tl.constexpr, INV_SQRT_G: tl.constexpr, DIM: tl.constexpr, IDX_BITS: tl.constexpr,
    HAS_SIGNS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
):  # fmt: skip
    """Group g of BLOCK_ROWS rows dequantized, s * H_n (r16 * grid[c]): fp32 [BLOCK_ROWS, GROUP]. c_row / n_row: int64
    offsets of each row's codes / norms; r_ok: which rows exist (the others read as norm 0). Used by
    lattice_dequantize and by aqua_reconstruct's epilogue."""
    IPB: tl.constexpr = 32 // DIM
    WORDS: tl.constexpr = IDX_BITS // DIM
    NBLK: tl.constexpr = GROUP // 32
    blk = g * NBLK + tl.arange(0, NBLK)
    c_ptrs = codes_ptr + c_row[:, None] + blk[None, :] * WORDS
    idx = _unpack_indices(c_ptrs, r_ok[:, None], IDX_BITS, IPB)  # [BLOCK_ROWS, NBLK, IPB]
    r16 = tl.load(norms_ptr + n_row + g, mask=r_ok, other=0.0)
    v = tl.reshape(_grid_rows(grid_ptr, idx, DIM), (BLOCK_ROWS, GROUP)) * r16.to(tl.float32)[:, None]
    x = _hadamard(v, BLOCK_ROWS, GROUP, LOG_G, INV_SQRT_G)
    if HAS_SIGNS:
        x = x * _signs_row(signs_ptr, GROUP)
    return x


@triton.jit
def _lattice_dequantize_kernel(
    # pointers
    codes_ptr,  # int32 [D0, D1, D2, C * WORDS / 32]
    norms_ptr,  # fp16 [D0, D1, D2, C / G]
    grid_ptr,  # fp32 [N_GRID, DIM], contiguous
    signs_ptr,  # int8 [G] (unused unless HAS_SIGNS)
    out_ptr,  # fp32 [n_rows, C], contiguous
    # sizes
    n_rows,
    D1,
    D2,
    C,
    # strides of the three leading dims (last dims contiguous)
    sc0,
    sc1,
    sc2,
    sn0,
    sn1,
    sn2,
    # meta-parameters
    GROUP: tl.constexpr,
    LOG_G: tl.constexpr,
    INV_SQRT_G: tl.constexpr,
    DIM: tl.constexpr,
    IDX_BITS: tl.constexpr,
    HAS_SIGNS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
):
    pid_r = tl.program_id(0)
    g = tl.program_id(1)
    rows = pid_r.to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    r_ok = rows < n_rows
    c_row, n_row = _row_offsets(rows, D1, D2, sc0, sc1, sc2), _row_offsets(rows, D1, D2, sn0, sn1, sn2)
    x = dequantize_group(
        codes_ptr, norms_ptr, grid_ptr, signs_ptr, c_row, n_row, r_ok, g,
        GROUP, LOG_G, INV_SQRT_G, DIM, IDX_BITS, HAS_SIGNS, BLOCK_ROWS,
    )  # fmt: skip
    col = g * GROUP + tl.arange(0, GROUP)
    tl.store(out_ptr + rows[:, None] * C + col[None, :], x, mask=r_ok[:, None])


# ---------------------------------------------------------------------------------------------------------
# GEMVs: grid (B * H_kv, splits), a program owns a range of tokens of one KV head and all its query rows


@triton.jit
def _gemv_lattice_k_kernel(
    # pointers
    q_ptr,  # fp16/bf16/fp32 [B, H_q, T, D]
    codes_ptr,  # int32 [B, H_kv, N, D * WORDS / 32]
    norms_ptr,  # fp16 [B, H_kv, N, D / G]
    grid_ptr,  # fp32 [N_GRID, DIM], contiguous
    signs_ptr,  # int8 [G] (unused unless HAS_SIGNS)
    out_ptr,  # fp32 [B, H_q, T, N]
    # sizes
    H_kv,
    T,
    Q,  # query rows per KV head: (H_q / H_kv) * T
    N,
    tokens_per_split,  # multiple of BLOCK_N
    # strides (elements; the last dim of every tensor is contiguous)
    sq_b,
    sq_h,
    sq_t,
    sc_b,
    sc_h,
    sc_n,
    sn_b,
    sn_h,
    sn_n,
    so_b,
    so_h,
    so_t,
    # meta-parameters
    GROUP: tl.constexpr,
    LOG_G: tl.constexpr,
    INV_SQRT_G: tl.constexpr,
    NG: tl.constexpr,  # groups per head: D / G
    NGP: tl.constexpr,  # next_pow2(NG)
    DIM: tl.constexpr,
    IDX_BITS: tl.constexpr,
    HAS_SIGNS: tl.constexpr,
    QP: tl.constexpr,  # next_pow2(Q)
    BLOCK_N: tl.constexpr,
):
    DP: tl.constexpr = NGP * GROUP
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    b, h_kv, h_q, t, q_ok = gqa_query_rows(pid_bh, H_kv, Q, T, 0, QP)

    # q'_g = H_n (s * q_g), once per program: [QP, NGP, GROUP], padded groups zero
    d = tl.arange(0, DP)
    d_ok = d < NG * GROUP
    q_row = b * sq_b + h_q * sq_h + t * sq_t  # [QP] int64
    qv = tl.load(q_ptr + q_row[:, None] + d[None, :], mask=q_ok[:, None] & d_ok[None, :], other=0.0)
    qg = tl.reshape(qv.to(tl.float32), (QP * NGP, GROUP))
    if HAS_SIGNS:
        qg = qg * _signs_row(signs_ptr, GROUP)
    qr = tl.reshape(_hadamard(qg, QP * NGP, GROUP, LOG_G, INV_SQRT_G), (QP, 1, NGP, GROUP))

    c_base = b * sc_b + h_kv * sc_h
    n_base = b * sn_b + h_kv * sn_h
    o_row = b * so_b + h_q * so_h + t * so_t  # [QP]
    n_lo = pid_s * tokens_per_split
    n_hi = tl.minimum(n_lo + tokens_per_split, N)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < n_hi
        n64 = n.to(tl.int64)
        gv, r16 = _token_chunk(codes_ptr, norms_ptr, grid_ptr, c_base + n64 * sc_n, n_base + n64 * sn_n, n_ok,
                               NG, NGP, GROUP, DIM, IDX_BITS, BLOCK_N)  # fmt: skip
        dots = tl.sum(qr * gv, axis=3)  # [QP, BLOCK_N, NGP]: <q'_g, grid[c]> per group
        scores = tl.sum(dots * r16[None, :, :], axis=2)
        tl.store(out_ptr + o_row[:, None] + n64[None, :], scores, mask=q_ok[:, None] & n_ok[None, :])


@triton.jit
def _gemv_lattice_v_kernel(
    # pointers
    p_ptr,  # fp16/bf16/fp32 [B, H_q, T, N]
    codes_ptr,  # int32 [B, H_kv, N, D * WORDS / 32]
    norms_ptr,  # fp16 [B, H_kv, N, D / G]
    grid_ptr,  # fp32 [N_GRID, DIM], contiguous
    signs_ptr,  # int8 [G] (unused unless HAS_SIGNS)
    y_ptr,  # fp32 [splits, B, H_q, T, D]
    # sizes
    H_kv,
    T,
    Q,  # query rows per KV head: (H_q / H_kv) * T
    N,
    tokens_per_split,  # multiple of BLOCK_N
    # strides (elements; the last dim of every tensor is contiguous)
    sp_b,
    sp_h,
    sp_t,
    sc_b,
    sc_h,
    sc_n,
    sn_b,
    sn_h,
    sn_n,
    sy_s,
    sy_b,
    sy_h,
    sy_t,
    # meta-parameters
    GROUP: tl.constexpr,
    LOG_G: tl.constexpr,
    INV_SQRT_G: tl.constexpr,
    NG: tl.constexpr,  # groups per head: D / G
    NGP: tl.constexpr,  # next_pow2(NG)
    DIM: tl.constexpr,
    IDX_BITS: tl.constexpr,
    HAS_SIGNS: tl.constexpr,
    QP: tl.constexpr,  # next_pow2(Q)
    BLOCK_N: tl.constexpr,
):
    DP: tl.constexpr = NGP * GROUP
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    b, h_kv, h_q, t, q_ok = gqa_query_rows(pid_bh, H_kv, Q, T, 0, QP)
    p_row = b * sp_b + h_q * sp_h + t * sp_t  # [QP] int64

    c_base = b * sc_b + h_kv * sc_h
    n_base = b * sn_b + h_kv * sn_h
    acc = tl.zeros((QP, NGP, GROUP), dtype=tl.float32)  # sum_n p r16 grid[c], rotated domain
    n_lo = pid_s * tokens_per_split
    n_hi = tl.minimum(n_lo + tokens_per_split, N)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < n_hi
        n64 = n.to(tl.int64)
        pv = tl.load(p_ptr + p_row[:, None] + n64[None, :], mask=q_ok[:, None] & n_ok[None, :], other=0.0)
        gv, r16 = _token_chunk(codes_ptr, norms_ptr, grid_ptr, c_base + n64 * sc_n, n_base + n64 * sn_n, n_ok,
                               NG, NGP, GROUP, DIM, IDX_BITS, BLOCK_N)  # fmt: skip
        pr = pv.to(tl.float32)[:, :, None] * r16[None, :, :]  # [QP, BLOCK_N, NGP]: p * r16, hoisted out of G
        acc += tl.sum(pr[:, :, :, None] * gv, axis=1)

    # x = s * H_n acc, per group (padded groups hold zeros)
    out = _hadamard(tl.reshape(acc, (QP * NGP, GROUP)), QP * NGP, GROUP, LOG_G, INV_SQRT_G)
    if HAS_SIGNS:
        out = out * _signs_row(signs_ptr, GROUP)
    d = tl.arange(0, DP)
    y_row = pid_s.to(tl.int64) * sy_s + b * sy_b + h_q * sy_h + t * sy_t
    mask = q_ok[:, None] & (d < NG * GROUP)[None, :]
    tl.store(y_ptr + y_row[:, None] + d[None, :], tl.reshape(out, (QP, DP)), mask=mask)


# ---------------------------------------------------------------------------------------------------------
# Launchers (arguments validated by the op registration: kvkernels/ops.py)


def _group_consts(group_size: int) -> dict:
    # 1/sqrt(G) as fp32 (rsqrt rounded to fp32, FORMATS.md), passed as the exact double of that fp32 value
    inv = float(torch.tensor(float(group_size), dtype=torch.float32).rsqrt())
    return {"GROUP": group_size, "LOG_G": group_size.bit_length() - 1, "INV_SQRT_G": inv}


def _grid_consts(grid: torch.Tensor) -> dict:
    n, d = grid.shape
    return {"DIM": d, "IDX_BITS": n.bit_length() - 1}


def _launch_opts() -> dict:
    # fwht / quantize / dequantize: no FMA contraction (r16 * grid could fuse into the first butterfly), so their
    # fp32 results are the reference's bit for bit; the interpreter ignores it. The GEMVs keep the default (FMA):
    # they match to accumulation-order tolerance anyway.
    return {} if INTERPRETED else {"enable_fp_fusion": False}


def _block_rows(n_rows: int, group_size: int) -> int:
    return min(next_pow2(n_rows), max(1, QUANT_TILE // group_size))


def _signs_arg(signs: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return like if signs is None else signs.contiguous()  # placeholder pointer when absent, never read


def _as_4d(a: torch.Tensor) -> tuple[torch.Tensor, bool]:
    # a GEMV's [B, H_q, L] or [B, H_q, T, L] -> [B, H_q, T, L] (last dim contiguous), and whether T was given
    has_t = a.dim() == 4
    return unit_last(a if has_t else a.unsqueeze(2)), has_t


def _rows(lead: tuple[int, ...], *tensors: torch.Tensor):
    """(tensors, (D0, D1, D2), strides): collapse_rows, after copying the tensors to contiguous memory when their
    leading dims do not merge into three."""
    if collapse_rows(lead, *tensors) is None:
        tensors = tuple(t.contiguous() for t in tensors)
    sizes, strides = collapse_rows(lead, *tensors)
    return tensors, sizes, strides


def fwht(x: torch.Tensor, group_size: int, signs: torch.Tensor | None = None, inverse: bool = False) -> torch.Tensor:
    """y = H_n (s * x) per group of G along the last dim (inverse: x = s * (H_n y)); fp32 [..., C]."""
    check_device("fwht", x)
    lead, C = tuple(x.shape[:-1]), x.shape[-1]
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    n_rows = out.numel() // C if C else 0
    if n_rows == 0:
        return out
    (x,), (_, D1, D2), (sx,) = _rows(lead, x)
    block_rows = _block_rows(n_rows, group_size)
    with device_ctx(x):
        _fwht_kernel[(triton.cdiv(n_rows, block_rows), C // group_size)](
            x, _signs_arg(signs, out), out,
            n_rows, D1, D2, C, *sx, x.stride(-1),
            **_group_consts(group_size), HAS_SIGNS=signs is not None, INVERSE=bool(inverse),
            BLOCK_ROWS=block_rows, num_warps=4, **_launch_opts(),
        )  # fmt: skip
    return out


def lattice_quantize(
    x: torch.Tensor, grid: torch.Tensor, group_size: int, signs: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., C] -> (codes int32 [..., C * bits / 32], norms fp16 [..., C / G]); FORMATS.md steps 1-3."""
    check_device("lattice_quantize", x)
    lead, C = tuple(x.shape[:-1]), x.shape[-1]
    n, dim = grid.shape
    bits = (n.bit_length() - 1) // dim
    codes = torch.empty((*lead, C // 32 * bits), dtype=torch.int32, device=x.device)
    norms = torch.empty((*lead, C // group_size), dtype=torch.float16, device=x.device)
    n_rows = x.numel() // C if C else 0
    if n_rows == 0:
        return codes, norms
    if collapse_rows(lead, x) is None:
        x = x.contiguous()
    (_, D1, D2), (sx, sc, sn) = collapse_rows(lead, x, codes, norms)  # the outputs merge wherever x does
    block_rows = _block_rows(n_rows, group_size)
    grid_chunk = min(n, max(1, PRODUCT_BUDGET // (block_rows * group_size)))
    with device_ctx(x):
        _lattice_quantize_kernel[(triton.cdiv(n_rows, block_rows), C // group_size)](
            x, grid.contiguous(), _signs_arg(signs, grid), codes, norms,
            n_rows, D1, D2, *sx, x.stride(-1), *sc, *sn,
            **_group_consts(group_size), **_grid_consts(grid), N_GRID=n, HAS_SIGNS=signs is not None,
            BLOCK_ROWS=block_rows, GRID_CHUNK=grid_chunk, num_warps=4, **_launch_opts(),
        )  # fmt: skip
    return codes, norms


def lattice_dequantize(
    codes: torch.Tensor, norms: torch.Tensor, grid: torch.Tensor, group_size: int, signs: torch.Tensor | None = None
) -> torch.Tensor:
    """x_hat = s * H_n (r16 * grid[c]) per group: fp32 [..., C]; FORMATS.md step 4."""
    check_device("lattice_dequantize", codes)
    lead = tuple(codes.shape[:-1])
    C = norms.shape[-1] * group_size
    out = torch.empty((*lead, C), dtype=torch.float32, device=codes.device)
    n_rows = out.numel() // C if C else 0
    if n_rows == 0:
        return out
    (codes, norms), (_, D1, D2), (sc, sn) = _rows(lead, unit_last(codes), unit_last(norms))
    block_rows = _block_rows(n_rows, group_size)
    with device_ctx(codes):
        _lattice_dequantize_kernel[(triton.cdiv(n_rows, block_rows), C // group_size)](
            codes, norms, grid.contiguous(), _signs_arg(signs, grid), out,
            n_rows, D1, D2, C, *sc, *sn,
            **_group_consts(group_size), **_grid_consts(grid), HAS_SIGNS=signs is not None,
            BLOCK_ROWS=block_rows, num_warps=4, **_launch_opts(),
        )  # fmt: skip
    return out


def _gemv_tiles(ratio: int, T: int, n_tokens: int, dp: int) -> tuple[int, int, int, int]:
    """(t_chunk, QP, BLOCK_N, num_warps): query positions per launch such that the query tile [QP, dp] stays within
    ROW_TILE (at least one position: all query heads of a KV head share the codes), and the token chunk of the
    product tile [QP, BLOCK_N, dp] within PRODUCT_BUDGET; 8 warps when that tile is full."""
    tc = query_t_chunk(ratio, T)
    while tc > 1 and next_pow2(ratio * tc) * dp > ROW_TILE:
        tc -= 1
    qp = next_pow2(ratio * tc)
    block_n = min(MAX_BLOCK_N, next_pow2(n_tokens), max(1, PRODUCT_BUDGET // (qp * dp)))
    return tc, qp, block_n, 8 if qp * block_n * dp >= PRODUCT_BUDGET else 4


def _gemv_plan(rows4: torch.Tensor, codes: torch.Tensor, grid: torch.Tensor, group_size: int, signs, D: int, N: int):
    """How a GEMV over rows4 [B, H_q, T, .] and codes [B, H_kv, N, .] launches: (t_chunk, splits, tokens_per_split,
    meta), meta the kernel's meta-parameters and num_warps. Tokens are split over programs in whole BLOCK_N chunks."""
    B, H_q, T, _ = rows4.shape
    H_kv = codes.shape[1]
    ng = D // group_size
    tc, qp, block_n, num_warps = _gemv_tiles(H_q // H_kv, T, N, next_pow2(ng) * group_size)
    n_iters = triton.cdiv(N, block_n)
    splits = num_splits(B * H_kv, n_iters, rows4.device)
    tokens_per_split = triton.cdiv(n_iters, splits) * block_n
    meta = dict(
        **_group_consts(group_size), NG=ng, NGP=next_pow2(ng), **_grid_consts(grid),
        HAS_SIGNS=signs is not None, QP=qp, BLOCK_N=block_n, num_warps=num_warps,
    )  # fmt: skip
    return tc, triton.cdiv(N, tokens_per_split), tokens_per_split, meta


def gemv_lattice_k(
    q: torch.Tensor,
    codes: torch.Tensor,
    norms: torch.Tensor,
    grid: torch.Tensor,
    group_size: int,
    signs: torch.Tensor | None = None,
) -> torch.Tensor:
    """scores[b, h, (t,) n] = q[b, h, (t,)] . x_hat[b, h_kv, n], scored on the codes: fp32 [B, H_q, (T,) N]."""
    check_device("gemv_lattice_k", q)
    q4, has_t = _as_4d(q)
    B, H_q, T, D = q4.shape
    _, H_kv, N, _ = codes.shape
    out = torch.empty((B, H_q, T, N), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out if has_t else out.squeeze(2)
    if D == 0:
        return out.zero_() if has_t else out.zero_().squeeze(2)
    codes, norms = unit_last(codes), unit_last(norms)
    ratio = H_q // H_kv
    tc, splits, tokens_per_split, meta = _gemv_plan(q4, codes, grid, group_size, signs, D, N)
    sig = _signs_arg(signs, grid)
    for t0 in range(0, T, tc):  # long q_len: launches of tc positions, each writing its slice of the scores
        qt, ot = q4[:, :, t0 : t0 + tc], out[:, :, t0 : t0 + tc]
        with device_ctx(q):
            _gemv_lattice_k_kernel[(B * H_kv, splits)](
                qt, codes, norms, grid.contiguous(), sig, ot,
                H_kv, qt.shape[2], ratio * qt.shape[2], N, tokens_per_split,
                *qt.stride()[:3], *codes.stride()[:3], *norms.stride()[:3], *ot.stride()[:3], **meta,
            )  # fmt: skip
    return out if has_t else out.squeeze(2)


def gemv_lattice_v(
    p: torch.Tensor,
    codes: torch.Tensor,
    norms: torch.Tensor,
    grid: torch.Tensor,
    group_size: int,
    signs: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[b, h, (t,)] = sum_n p[b, h, (t,) n] x_hat[b, h_kv, n], reduced on the codes: fp32 [B, H_q, (T,) D]."""
    check_device("gemv_lattice_v", p)
    p4, has_t = _as_4d(p)
    B, H_q, T, N = p4.shape
    _, H_kv, _, _ = codes.shape
    D = norms.shape[-1] * group_size
    out_shape = (B, H_q, T, D) if has_t else (B, H_q, D)
    if B * H_q * T * D == 0 or N == 0:
        return torch.zeros(out_shape, dtype=torch.float32, device=p.device)
    codes, norms = unit_last(codes), unit_last(norms)
    ratio = H_q // H_kv
    tc, splits, tokens_per_split, meta = _gemv_plan(p4, codes, grid, group_size, signs, D, N)
    y = torch.empty((splits, B, H_q, T, D), dtype=torch.float32, device=p.device)
    sig = _signs_arg(signs, grid)
    for t0 in range(0, T, tc):  # long q_len: launches of tc positions, each writing its slice of the partials
        pt, yt = p4[:, :, t0 : t0 + tc], y[:, :, :, t0 : t0 + tc]
        with device_ctx(p):
            _gemv_lattice_v_kernel[(B * H_kv, splits)](
                pt, codes, norms, grid.contiguous(), sig, yt,
                H_kv, pt.shape[2], ratio * pt.shape[2], N, tokens_per_split,
                *pt.stride()[:3], *codes.stride()[:3], *norms.stride()[:3], *yt.stride()[:4], **meta,
            )  # fmt: skip
    y = y[0] if splits == 1 else y.sum(0)  # fixed-order sum: deterministic
    return y if has_t else y.squeeze(2)
