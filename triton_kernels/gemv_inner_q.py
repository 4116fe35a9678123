"""InnerQ fused dequant-GEMV in Triton: groups run along the reduction dim L.

    y[b, h, t, m] = sum_l x[b, h, t, l] * x_scale[h_kv, l] * (s[m, g] * u[m, l] + zeff[m, g]),  h_kv = h // (H_q/H_kv)
                  = sum_g  s[m, g] * dot(x_g, u_g)  +  zeff[m, g] * sum(x_g)

so codes are never dequantized element by element: each 32-value block contributes one scaled partial dot plus
zeff times the block's x-sum (blocks never straddle a group, since G is a multiple of 32), and the x-sums are
computed once per query row and shared by all M rows of the tile.

Grid: (cdiv(M, BLOCK_M), B * H_kv, splits). A program owns BLOCK_M code rows of one KV head and serves every query
row that reads them: the H_q/H_kv heads of its group times the T query rows, flattened to Q = ratio * T and padded
to the power of two QP (masked). It walks its share of L in chunks of NB blocks (NB * 32 values). When B * H_kv *
cdiv(M, BLOCK_M) is too few programs to fill the GPU (the value GEMV: M = head_dim, L = tokens), L is split across
`splits` programs that write fp32 partials [splits, B, H_q, T, M], summed afterwards in a fixed order.
"""

import torch
import triton
import triton.language as tl

from kvkernels import _validate

from ._common import (
    PRODUCT_BUDGET,
    check_device,
    device_ctx,
    gqa_query_rows,
    group_affine,
    next_pow2,
    num_splits,
    query_t_chunk,
    unpack_blocks,
)

_MODES = {"sym": 0, "asym": 1, "hybrid": 2}


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
    n_blocks,  # L / 32
    blocks_per_split,  # multiple of NB
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
    QP: tl.constexpr,  # next_pow2(Q)
    BLOCK_M: tl.constexpr,
    NB: tl.constexpr,  # 32-value blocks per loop iteration
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    b, h_kv, h_q, t, q_ok = gqa_query_rows(pid_bh, H_kv, Q, T, QP)
    x_row = b * sx_b + h_q * sx_h + t * sx_t  # [QP] int64

    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < M
    m64 = m.to(tl.int64)
    c_row = b * sc_b + h_kv * sc_h + m64 * sc_m  # [BLOCK_M]
    s_row = b * ss_b + h_kv * ss_h + m64 * ss_m
    z_row = b * sz_b + h_kv * sz_h + m64 * sz_m

    i = tl.arange(0, 32)
    acc = tl.zeros((QP, BLOCK_M), dtype=tl.float32)
    blk_lo = pid_s * blocks_per_split
    blk_hi = tl.minimum(blk_lo + blocks_per_split, n_blocks)
    for blk0 in range(blk_lo, blk_hi, NB):
        blk = blk0 + tl.arange(0, NB)
        blk_ok = blk < blk_hi
        l = blk[:, None] * 32 + i[None, :]  # [NB, 32]
        xv = tl.load(
            x_ptr + x_row[:, None, None] + l[None, :, :], mask=q_ok[:, None, None] & blk_ok[None, :, None], other=0.0
        ).to(tl.float32)  # [QP, NB, 32]
        if HAS_XS:
            xv *= tl.load(xs_ptr + h_kv * sxs_h + l, mask=blk_ok[:, None], other=0.0)[None, :, :]
        xsum = tl.sum(xv, axis=2)  # [QP, NB], shared by all BLOCK_M rows

        w_mask = m_ok[:, None] & blk_ok[None, :]
        u = unpack_blocks(codes_ptr + c_row[:, None] + blk[None, :] * BITS, w_mask, BITS).to(tl.float32)
        g = (blk * 32) // GROUP  # [NB] group of each block
        scale_bits = tl.load(scales_ptr + s_row[:, None] + g[None, :], mask=w_mask, other=0)  # [BLOCK_M, NB]
        if MODE == 0:
            zero = scale_bits  # unused by sym
        else:
            zero = tl.load(zeros_ptr + z_row[:, None] + g[None, :], mask=w_mask, other=0.0)
        s, zeff = group_affine(scale_bits, zero, BITS, MODE)

        dots = tl.sum(xv[:, None, :, :] * u[None, :, :, :], axis=3)  # [QP, BLOCK_M, NB]
        acc += tl.sum(dots * s[None, :, :] + zeff[None, :, :] * xsum[:, None, :], axis=2)

    y_row = pid_s.to(tl.int64) * sy_s + b * sy_b + h_q * sy_h + t * sy_t
    tl.store(y_ptr + y_row[:, None] + m64[None, :], acc, mask=q_ok[:, None] & m_ok[None, :])


def _tiles(qp: int, m: int, n_blocks: int) -> tuple[int, int, int]:
    """(BLOCK_M, NB, num_warps): 128-value chunks when the query rows allow, product tile <= PRODUCT_BUDGET."""
    nb = min(4, next_pow2(n_blocks))
    while nb > 1 and qp * nb * 32 * 4 > PRODUCT_BUDGET:  # keep room for at least 4 code rows
        nb //= 2
    block_m = min(64, next_pow2(m), max(1, PRODUCT_BUDGET // (qp * nb * 32)))
    num_warps = 8 if qp * block_m * nb * 32 >= PRODUCT_BUDGET else 4
    return block_m, nb, num_warps


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
    qp = next_pow2(Q)
    n_blocks = L // 32
    block_m, nb, num_warps = _tiles(qp, M, n_blocks)
    base = triton.cdiv(M, block_m) * B * H_kv
    n_iters = triton.cdiv(n_blocks, nb)
    splits = num_splits(base, n_iters, x.device)
    blocks_per_split = triton.cdiv(n_iters, splits) * nb
    splits = triton.cdiv(n_blocks, blocks_per_split)

    y = torch.empty((splits, B, H_q, T, M), dtype=torch.float32, device=x.device)
    z = zeros if zeros is not None else scales  # sym never reads it
    xs = x_scale if x_scale is not None else y  # placeholder pointer, never read
    with device_ctx(x):
        _gemv_inner_q_kernel[(triton.cdiv(M, block_m), B * H_kv, splits)](
            x4, codes, scales.view(torch.int16), z, xs, y,
            H_kv, M, T, Q, n_blocks, blocks_per_split,
            *x4.stride()[:3], *codes.stride()[:3], *scales.stride()[:3], *z.stride()[:3],
            xs.stride(0), *y.stride()[:4],
            BITS=bits, GROUP=group_size, MODE=_MODES[mode], HAS_XS=x_scale is not None,
            QP=qp, BLOCK_M=block_m, NB=nb, num_warps=num_warps,
        )  # fmt: skip
    y = y[0] if splits == 1 else y.sum(0)  # fixed-order sum: deterministic
    return y if has_t else y.squeeze(2)
