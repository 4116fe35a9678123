"""KIVI-layout fused dequant-GEMV in Triton, on tensor cores: reduction over rows R, asym groups along the columns C.

    y[b, h, t, c] = sum_r x[b, h, t, r] * (s[r, g] * u[r, c] + z[r, g]),   g = c // G,  h_kv = h // (H_q/H_kv)
                  = sum_r (x[r] * s[r, g]) * u[r, c]  +  sum_r x[r] * z[r, g]

The scale varies along the reduction, so it goes onto the activations: xs[g, r, q] = x[q, r] * s[r, g] (fp32, once per
row and 32-column block), split exactly into three bf16 parts (_common.split_dot), and the codes are exact bf16
integers: a batched tensor-core dot [NCB, 32 columns, BLOCK_R] x [NCB, BLOCK_R, QP] per part, fp32 accumulation.
The zero term sum_r x z is accumulated elementwise in fp32 ([NCB, BLOCK_R, QP], no reduction in the loop) and
reduced once after it.

Grid: (cdiv(C / 32, NCB), B * H_kv, splits). A program owns NCB 32-column blocks (BLOCK_C = 32 NCB columns) of one KV
head and serves all H_q/H_kv query heads times T query rows (flattened to Q, padded to the power of two QP >= 8,
masked: the N side of the MMA). It walks its share of R in chunks of BLOCK_R rows. BLOCK_R, num_warps and
num_stages are autotuned (_CONFIGS) per (bits, R bucket, query rows). R is the long dim of the value GEMV
(R = tokens, C = head_dim), so when B * H_kv * cdiv(C / 32, NCB) programs are too few, R is split across `splits`
programs writing fp32 partials [splits, B, H_q, T, C], summed afterwards in a fixed order (deterministic; the split
is planned with _SPLIT_BLOCK_R rows whatever config the autotuner picks).
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
    gqa_query_rows,
    next_pow2,
    num_splits,
    pair_perm,
    query_t_chunk,
    split_dot,
    unpack_pairs,
)

# Autotune configs (BLOCK_R rows per iteration = the MMA's K, num_warps, num_stages): 64 rows x 4 warps is the
# default and the only config under TRITON_INTERPRET=1; 32 rows halves the per-iteration registers (more programs
# resident), 128 rows x 8 warps halves the loop overhead per byte on long reductions. 16 rows (the MMA's smallest K)
# is the only one tried at 64 query rows (q_len 16 x GQA 4): there every other config spills under triton 3.6, the
# GPU machines' version (24-536 B of local memory; tests/triton_aot/compile_check.py run with triton 3.6).
_CONFIGS = [
    triton.Config({"BLOCK_R": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_R": 32}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_R": 128}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_R": 16}, num_warps=4, num_stages=3),
]
_SPLIT_BLOCK_R = 128  # rows the split of R is planned in (a multiple of every config's BLOCK_R)


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
    rows_per_split,  # multiple of every config's BLOCK_R
    R,
    R_BUCKET,  # autotune key only: bucket(R)
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
    QP: tl.constexpr,  # max(8, next_pow2(Q)): the MMA's N
    NCB: tl.constexpr,  # 32-column blocks per program
    EMU: tl.constexpr,  # interpreter: dots on fp32-widened operands
    BLOCK_R: tl.constexpr,
):
    pid_c = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    b, h_kv, h_q, t, q_ok = gqa_query_rows(pid_bh, H_kv, Q, T, 0, QP)
    x_row = b * sx_b + h_q * sx_h + t * sx_t  # [QP] int64
    BLOCK_C: tl.constexpr = NCB * 32

    cb = pid_c * NCB + tl.arange(0, NCB)
    cb_ok = cb < n_cblocks
    g = (cb * 32) // GROUP  # [NCB] group of each column block
    c_base = codes_ptr + b * sc_b + h_kv * sc_h
    s_base = b * ss_b + h_kv * ss_h
    z_base = b * sz_b + h_kv * sz_h
    word0 = pid_c * (BLOCK_C // 32 * BITS)

    acc = tl.zeros((NCB, 32, QP), dtype=tl.float32)
    # the zero term: accumulated elementwise and reduced once after the loop while that tile is small (<= 32 fp32
    # per thread at 4 warps), else reduced over the chunk's rows in the loop (many query rows)
    ZELEM: tl.constexpr = NCB * BLOCK_R * QP <= 4096
    if ZELEM:
        zacc = tl.zeros((NCB, BLOCK_R, QP), dtype=tl.float32)
    else:
        zacc = tl.zeros((NCB, QP), dtype=tl.float32)
    r_lo = pid_s * rows_per_split
    r_hi = tl.minimum(r_lo + rows_per_split, R)
    for r0 in range(r_lo, r_hi, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_ok = r < r_hi
        r64 = r.to(tl.int64)
        xv = tl.load(x_ptr + x_row[None, :] + r64[:, None], mask=r_ok[:, None] & q_ok[None, :], other=0.0)
        xv = xv.to(tl.float32)  # [BLOCK_R, QP]

        w_mask = r_ok[:, None] & cb_ok[None, :]
        s = tl.load(scales_ptr + s_base + r64[:, None] * ss_r + g[None, :], mask=w_mask, other=0.0).to(tl.float32)
        z = tl.load(zeros_ptr + z_base + r64[:, None] * sz_r + g[None, :], mask=w_mask, other=0.0).to(tl.float32)
        s = tl.trans(s)  # [NCB, BLOCK_R]
        z = tl.trans(z)

        # codes of the program's columns (a masked-off row or column block reads as 0: its scale is 0 too)
        # codes of the program's columns, exact bf16, columns in pair_perm order within each 32-column block (a
        # masked-off row or column block reads as 0; its scale is 0 too)
        u = unpack_pairs(c_base + r64 * sc_r, word0, r_ok, (n_cblocks - pid_c * NCB) * BITS, 0, BITS, BLOCK_C, 1, EMU)
        ua = tl.permute(tl.reshape(u, (BLOCK_R, NCB, 32)), (1, 2, 0))  # [NCB, 32, BLOCK_R]

        xs = s[:, :, None] * xv[None, :, :]  # [NCB, BLOCK_R, QP]: x * s, one product per row and column block
        acc = split_dot(ua, xs, acc, 3, 1, EMU)
        if ZELEM:
            zacc += z[:, :, None] * xv[None, :, :]
        else:
            zacc += tl.sum(z[:, :, None] * xv[None, :, :], axis=1)

    if ZELEM:
        zsum = tl.sum(zacc, axis=1)  # [NCB, QP], once per program
    else:
        zsum = zacc
    out = acc + zsum[:, None, :]  # [NCB, 32, QP]
    i = pair_perm(tl.arange(0, 32), BITS)  # the column each row of a block's accumulator holds
    y_row = pid_s.to(tl.int64) * sy_s + b * sy_b + h_q * sy_h + t * sy_t
    col = cb[:, None] * 32 + i[None, :]  # [NCB, 32]
    mask = cb_ok[:, None, None] & (i >= 0)[None, :, None] & q_ok[None, None, :]
    tl.store(y_ptr + y_row[None, None, :] + col[:, :, None], out, mask=mask)


def _prune(configs, named_args, **kwargs):
    """The [BLOCK_R, QP] activations in three parts must fit the registers: at 32 query rows the 128-row chunk spills;
    64 query rows take the 16-row chunk alone (below 64 it only adds a config to try: left out)."""
    qp = kwargs.get("QP", named_args.get("QP", 8))
    if qp >= 64:
        keep = [c for c in configs if c.kwargs["BLOCK_R"] == 16]
    else:
        keep = [c for c in configs if c.kwargs["BLOCK_R"] != 16 and (qp < 32 or c.kwargs["BLOCK_R"] < 128)]
    return keep or configs[:1]


_gemv_kivi_tuned = triton.autotune(
    configs=_CONFIGS[:1] if INTERPRETED else _CONFIGS,
    key=["BITS", "R_BUCKET", "QP"],
    prune_configs_by={"early_config_prune": _prune},
)(_gemv_kivi_kernel)


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
    qp = max(8, next_pow2(Q))
    n_cblocks = C // 32
    ncb = min(4, next_pow2(n_cblocks), max(1, 64 // qp))  # the [NCB, BLOCK_R, QP] activations tile fits registers
    base = triton.cdiv(n_cblocks, ncb) * B * H_kv
    n_iters = triton.cdiv(R, _SPLIT_BLOCK_R)
    splits = num_splits(base, n_iters, x.device)
    rows_per_split = triton.cdiv(n_iters, splits) * _SPLIT_BLOCK_R
    splits = triton.cdiv(R, rows_per_split)

    y = torch.empty((splits, B, H_q, T, C), dtype=torch.float32, device=x.device)
    with device_ctx(x):
        _gemv_kivi_tuned[(triton.cdiv(n_cblocks, ncb), B * H_kv, splits)](
            x4, codes, scales, zeros, y,
            H_kv, T, Q, n_cblocks, rows_per_split, R, bucket(R),
            *x4.stride()[:3], *codes.stride()[:3], *scales.stride()[:3], *zeros.stride()[:3], *y.stride()[:4],
            BITS=bits, GROUP=group_size, QP=qp, NCB=ncb, EMU=EMULATE_DOT,
        )  # fmt: skip
    y = y[0] if splits == 1 else y.sum(0)  # fixed-order sum: deterministic
    return y if has_t else y.squeeze(2)
