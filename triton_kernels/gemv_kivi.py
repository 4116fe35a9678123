"""KIVI-layout fused dequant-GEMV in Triton: reduction over rows R, asym groups along the packed columns C.

    y[b, h, t, c] = sum_r x[b, h, t, r] * (s[r, g] * u[r, c] + z[r, g]),   g = c // G,  h_kv = h // (H_q/H_kv)
                  = sum_r (x[r] * s[r, g]) * u[r, c]  +  sum_r x[r] * z[r, g]

The scales are hoisted out of the column loop: x * s is formed once per (row, 32-column block) and the zero term
once per (row, block), so each code costs one multiply-add.

Grid: (cdiv(C / 32, NCB), B * H_kv, splits). A program owns NCB 32-column blocks of one KV head and serves all
H_q/H_kv query heads times T query rows (flattened to Q, padded to the power of two QP, masked). It walks its
share of R in chunks of BLOCK_R rows. R is the long dim here (the value GEMV: R = tokens, C = head_dim), so when
B * H_kv * cdiv(C / 32, NCB) programs are too few, R is split across `splits` programs writing fp32 partials
[splits, B, H_q, T, C], summed afterwards in a fixed order.
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
    next_pow2,
    num_splits,
    query_t_chunk,
    unpack_blocks,
)


@triton.jit
def _gemv_kivi_kernel(
    # pointers
    x_ptr,  # fp16/bf16/fp32 [B, H_q, T, R]
    codes_ptr,  # int32 [B, H_kv, R, C*BITS/32]
    scales_ptr,  # fp16 [B, H_kv, R, C/G]
    zeros_ptr,  # fp16 [B, H_kv, R, C/G]
    y_ptr,  # fp32 [splits, B, H_q, T, C]
    # sizes
    H_kv,
    T,
    Q,  # query rows per KV head: (H_q / H_kv) * T
    n_cblocks,  # C / 32
    rows_per_split,  # multiple of BLOCK_R
    R,
    # strides (elements; the last dim of every tensor is contiguous)
    sx_b,
    sx_h,
    sx_t,
    sc_b,
    sc_h,
    sc_r,
    ss_b,
    ss_h,
    ss_r,
    sz_b,
    sz_h,
    sz_r,
    sy_s,
    sy_b,
    sy_h,
    sy_t,
    # meta-parameters
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    QP: tl.constexpr,  # next_pow2(Q)
    BLOCK_R: tl.constexpr,
    NCB: tl.constexpr,  # 32-column blocks per program
):
    pid_c = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    b, h_kv, h_q, t, q_ok = gqa_query_rows(pid_bh, H_kv, Q, T, QP)
    x_row = b * sx_b + h_q * sx_h + t * sx_t  # [QP] int64

    cb = pid_c * NCB + tl.arange(0, NCB)
    cb_ok = cb < n_cblocks
    g = (cb * 32) // GROUP  # [NCB] group of each column block
    c_base = b * sc_b + h_kv * sc_h
    s_base = b * ss_b + h_kv * ss_h
    z_base = b * sz_b + h_kv * sz_h

    acc = tl.zeros((QP, NCB, 32), dtype=tl.float32)
    zacc = tl.zeros((QP, NCB), dtype=tl.float32)
    r_lo = pid_s * rows_per_split
    r_hi = tl.minimum(r_lo + rows_per_split, R)
    for r0 in range(r_lo, r_hi, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_ok = r < r_hi
        r64 = r.to(tl.int64)
        xv = tl.load(x_ptr + x_row[:, None] + r64[None, :], mask=q_ok[:, None] & r_ok[None, :], other=0.0)
        xv = xv.to(tl.float32)  # [QP, BLOCK_R]

        w_mask = r_ok[:, None] & cb_ok[None, :]
        u = unpack_blocks(codes_ptr + c_base + r64[:, None] * sc_r + cb[None, :] * BITS, w_mask, BITS)
        s = tl.load(scales_ptr + s_base + r64[:, None] * ss_r + g[None, :], mask=w_mask, other=0.0).to(tl.float32)
        z = tl.load(zeros_ptr + z_base + r64[:, None] * sz_r + g[None, :], mask=w_mask, other=0.0).to(tl.float32)

        xs = xv[:, :, None] * s[None, :, :]  # [QP, BLOCK_R, NCB]: x * s, hoisted out of the 32 columns
        acc += tl.sum(xs[:, :, :, None] * u.to(tl.float32)[None, :, :, :], axis=1)  # [QP, NCB, 32]
        zacc += tl.sum(xv[:, :, None] * z[None, :, :], axis=1)  # [QP, NCB]

    i = tl.arange(0, 32)
    y_row = pid_s.to(tl.int64) * sy_s + b * sy_b + h_q * sy_h + t * sy_t
    col = cb[:, None] * 32 + i[None, :]  # [NCB, 32]
    mask = q_ok[:, None, None] & cb_ok[None, :, None] & (i < 32)[None, None, :]
    tl.store(y_ptr + y_row[:, None, None] + col[None, :, :], acc + zacc[:, :, None], mask=mask)


def _tiles(qp: int, r: int, n_cblocks: int) -> tuple[int, int, int]:
    """(BLOCK_R, NCB, num_warps): 128-column tiles when the query rows allow, product tile <= PRODUCT_BUDGET."""
    ncb = min(4, next_pow2(n_cblocks))
    while ncb > 1 and qp * ncb * 32 * 4 > PRODUCT_BUDGET:  # keep room for at least 4 rows per chunk
        ncb //= 2
    block_r = min(64, next_pow2(r), max(1, PRODUCT_BUDGET // (qp * ncb * 32)))
    num_warps = 8 if qp * block_r * ncb * 32 >= PRODUCT_BUDGET else 4
    return block_r, ncb, num_warps


def gemv_kivi(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group_size: int
) -> torch.Tensor:
    """y[b, h, (t,) c] = sum_r x[b, h, (t,) r] * deq(codes[b, h_kv, r, c])  (fp32), asym groups along c."""
    _validate.check_gemv_kivi(x, codes, scales, zeros, bits, group_size)
    check_device("gemv_kivi", x)
    has_t = x.dim() == 4
    x4 = x if has_t else x.unsqueeze(2)
    B, H_q, T, R = x4.shape
    H_kv = codes.shape[1]
    C = codes.shape[-1] // bits * 32
    y_shape = (B, H_q, T, C) if has_t else (B, H_q, C)
    if B * H_q * T * C == 0 or R == 0:
        return torch.zeros(y_shape, dtype=torch.float32, device=x.device)

    tc = query_t_chunk(H_q // H_kv, T)
    if tc < T:  # long q_len: launches of tc rows (see MAX_QUERY_ROWS), concatenated along T
        parts = [gemv_kivi(x4[:, :, t0 : t0 + tc], codes, scales, zeros, bits, group_size) for t0 in range(0, T, tc)]
        return torch.cat(parts, dim=2)

    Q = (H_q // H_kv) * T
    qp = next_pow2(Q)
    n_cblocks = C // 32
    block_r, ncb, num_warps = _tiles(qp, R, n_cblocks)
    base = triton.cdiv(n_cblocks, ncb) * B * H_kv
    n_iters = triton.cdiv(R, block_r)
    splits = num_splits(base, n_iters, x.device)
    rows_per_split = triton.cdiv(n_iters, splits) * block_r
    splits = triton.cdiv(R, rows_per_split)

    y = torch.empty((splits, B, H_q, T, C), dtype=torch.float32, device=x.device)
    with device_ctx(x):
        _gemv_kivi_kernel[(triton.cdiv(n_cblocks, ncb), B * H_kv, splits)](
            x4, codes, scales, zeros, y,
            H_kv, T, Q, n_cblocks, rows_per_split, R,
            *x4.stride()[:3], *codes.stride()[:3], *scales.stride()[:3], *zeros.stride()[:3], *y.stride()[:4],
            BITS=bits, GROUP=group_size, QP=qp, BLOCK_R=block_r, NCB=ncb, num_warps=num_warps,
        )  # fmt: skip
    y = y[0] if splits == 1 else y.sum(0)  # fixed-order sum: deterministic
    return y if has_t else y.squeeze(2)
