"""InnerQ fused dequant-GEMV in Triton, on tensor cores: groups run along the reduction dim L.

    y[b, h, t, m] = sum_l x[b, h, t, l] * x_scale[h_kv, l] * (s[m, g] * u[m, l] + zeff[m, g]),  h_kv = h // (H_q/H_kv)
                  = sum_g  s[m, g] * dot(u_g, x_g)  +  zeff[m, g] * sum(x_g)

Grid: (cdiv(M, BLOCK_M), B * H_kv, splits). A program owns BLOCK_M code rows of one KV head and serves every query
row that reads them: the H_q/H_kv heads of its group times the T query rows, flattened to Q = ratio * T and padded
to the power of two QP >= 8 (masked): the N side of the MMA. It walks its share of L in chunks of BK values (BK
divides the group size G, so a chunk is inside one group), and per chunk:

- unpacks the [BLOCK_M, BK] codes to exact 16-bit integers, two per 32-bit operation (unpack_pairs; signed
  u - 2^(b-1) for sym, so the zero term vanishes), in registers of the thread that holds the rows;
- multiplies them with the [BK, QP] activations on tensor cores (tl.dot, fp32 accumulation): activations that
  arrive as fp16 / bf16 are one dot in that type; fp32 activations (and any x_scale) are split exactly into three
  bf16 parts, three dots (_common.split_dot). Products are exact, sums fp32: the reference's arithmetic up to the
  summation order;
- applies the group's fp16 scale once to the chunk's [BLOCK_M, QP] dot, plus zeff times the chunk's x-sums
  (asym / hybrid): two FMAs per output per chunk.

The reduction of the chunk stays inside the MMA (no cross-lane shuffles in the loop but the x-sums of asym / hybrid).
The main loop takes VALS values (VALS / BK chunks, unrolled) per iteration at up to 16 query rows, the split's last
chunks one by one. Tiles: BLOCK_M, VALS, num_warps and num_stages are autotuned (_CONFIGS, pruned to the tiles that
fit M and the query rows) per (bits, mode, L bucket, M bucket, query rows); BK = the largest of 128 / 64 / 32 that
divides G. When B * H_kv * cdiv(M, BLOCK_M) is too few programs to fill the GPU (the value GEMV: M = head_dim,
L = tokens), L is split across `splits` programs that write fp32 partials [splits, B, H_q, T, M], summed afterwards in
a fixed order (deterministic); the split does not depend on the tuned config.
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
    next_pow2,
    num_splits,
    pair_perm,
    query_t_chunk,
    split_dot,
    unpack_pairs,
)

_MODES = {"sym": 0, "asym": 1, "hybrid": 2}

# Autotune configs (BLOCK_M code rows per program, VALS values of L per loop iteration, num_warps, num_stages), in order
# of preference: _prune keeps those that fit the launch (M, query rows) and the first kept is the default (the only
# one under TRITON_INTERPRET=1, where tuning would only multiply test time). What decides the loop's cost is the rows
# per thread: with two or more whole rows a thread decodes its rows' words in registers (two values per operation)
# and writes the MMA operand with 16-byte stores, and the activations' split and the MMA round trips are shared by
# more rows (bench/triton_budget.py, sm_90, 4 query rows, 3-bit keys: 64 x 4 warps, one row a thread, 37.7
# instructions/byte decoding one value per operation, 46.5 with pairs; 256 x 4: 13.2). 256 x 4 (wgmma) serves the
# long-M key GEMV; 128 x 2 and 64 x 1 (mma.sync) the value GEMV at head_dim 128 / 64, where a 256-row tile would be
# half masked (128 x 1 is 2 instructions/byte leaner still, but spills in 26 of the compiled variants); 64 x 4 (the
# previous default) is the tile whose accumulator fits at 32+ query rows, and gives the autotuner 4x the programs of
# 256 x 4 where a GPU is latency-bound rather than issue-bound.
_CONFIGS = [
    triton.Config({"BLOCK_M": 256, "VALS": 64}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_M": 128, "VALS": 64}, num_warps=2, num_stages=3),
    triton.Config({"BLOCK_M": 64, "VALS": 32}, num_warps=1, num_stages=3),
    triton.Config({"BLOCK_M": 64, "VALS": 128}, num_warps=4, num_stages=3),
]
# fp32 accumulator registers a thread may hold (BLOCK_M x QP / threads): more spills at 32+ query rows
_MAX_ACC_REGS = 32
_SPLIT_BLOCK_M = 64  # the tile the split of L is planned with (independent of the config the autotuner picks)


@triton.jit
def _chunk(acc, l0, x_ptr, x_row, q_ok, xs_ptr, xs_row, kv, c_rows, m_ok, scales_ptr, s_row, zeros_ptr, z_row,
           BITS: tl.constexpr, GROUP: tl.constexpr, MODE: tl.constexpr, HAS_XS: tl.constexpr, BK: tl.constexpr,
           DOT16: tl.constexpr, XPARTS: tl.constexpr, EMU: tl.constexpr):  # fmt: skip
    """acc + the chunk of BK values of L from l0 on (inside one group): the loop body of _gemv_inner_q_kernel."""
    BLOCK_M: tl.constexpr = acc.shape[0]
    QP: tl.constexpr = acc.shape[1]
    l = l0 + kv
    xv = tl.load(x_ptr + x_row[None, :] + l[:, None], mask=q_ok[None, :], other=0.0).to(tl.float32)  # [BK, QP]
    if HAS_XS:
        xv *= tl.load(xs_ptr + xs_row + l)[:, None]

    # [BLOCK_M, BK] exact 16-bit codes; sym: signed, sum_l (s u_l - s 2^(b-1)) x_l = s * dot(u - 2^(b-1), x)
    OFF: tl.constexpr = 1 << (BITS - 1)
    c_off: tl.constexpr = OFF if MODE == 0 else 0
    ua = unpack_pairs(c_rows, (l0 // 32) * BITS, m_ok, BK // 32 * BITS, c_off, BITS, BK, DOT16, EMU)
    d = split_dot(ua, xv, tl.zeros((BLOCK_M, QP), dtype=tl.float32), XPARTS, DOT16, EMU)  # [BLOCK_M, QP]

    g = l0 // GROUP
    scale_bits = tl.load(scales_ptr + s_row + g, mask=m_ok, other=0)  # [BLOCK_M]
    if MODE == 0:
        zero = scale_bits  # unused by sym
    else:
        zero = tl.load(zeros_ptr + z_row + g, mask=m_ok, other=0.0)
    s, zeff = group_affine(scale_bits, zero, BITS, MODE)
    if MODE == 0:
        acc += s[:, None] * d
    else:
        xsum = tl.sum(xv, axis=0)  # [QP]
        acc += s[:, None] * d + zeff[:, None] * xsum[None, :]
    return acc


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
    BLOCK_M: tl.constexpr,
    VALS: tl.constexpr,  # values of L per main-loop iteration: NCH = VALS / BK chunks (one at QP > 16)
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    b, h_kv, h_q, t, q_ok = gqa_query_rows(pid_bh, H_kv, Q, T, 0, QP)
    x_row = b * sx_b + h_q * sx_h + t * sx_t  # [QP] int64

    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < M
    m64 = m.to(tl.int64)
    c_rows = codes_ptr + (b * sc_b + h_kv * sc_h + m64 * sc_m)  # [BLOCK_M] pointers
    s_row = b * ss_b + h_kv * ss_h + m64 * ss_m
    z_row = b * sz_b + h_kv * sz_h + m64 * sz_m

    kv = pair_perm(tl.arange(0, BK), BITS)  # the value each position of the unpacked tile holds
    acc = tl.zeros((BLOCK_M, QP), dtype=tl.float32)
    l_lo = pid_s * per_split
    l_hi = tl.minimum(l_lo + per_split, L)
    # at 32+ query rows the accumulator is large and the loop's work already shared by many rows: one chunk (four
    # spilled 32 B at 64 rows x 128 x 8 warps, tests/test_triton_compile.py)
    NCH: tl.constexpr = VALS // BK if VALS > BK and QP <= 16 else 1
    l_mid = l_lo + (l_hi - l_lo) // (BK * NCH) * (BK * NCH)
    xs_row = h_kv * sxs_h
    # NCH chunks (one group each) per iteration: the loop's own work (addresses, bounds, the pipeline's waits) once
    # per VALS values instead of per group (bench/triton_budget.py, default config: 43.4 -> 37.7 instructions/byte
    # at 3 bits, 31.2 -> 25.8 at 2, 17.7 -> 16.1 at 4); the split's last < NCH chunks one by one
    for l00 in range(l_lo, l_mid, BK * NCH):
        for j in tl.static_range(NCH):
            acc = _chunk(acc, l00 + j * BK, x_ptr, x_row, q_ok, xs_ptr, xs_row, kv, c_rows, m_ok, scales_ptr, s_row,
                         zeros_ptr, z_row, BITS, GROUP, MODE, HAS_XS, BK, DOT16, XPARTS, EMU)  # fmt: skip
    for l0 in range(l_mid, l_hi, BK):
        acc = _chunk(acc, l0, x_ptr, x_row, q_ok, xs_ptr, xs_row, kv, c_rows, m_ok, scales_ptr, s_row, zeros_ptr,
                     z_row, BITS, GROUP, MODE, HAS_XS, BK, DOT16, XPARTS, EMU)  # fmt: skip

    y_row = pid_s.to(tl.int64) * sy_s + b * sy_b + h_q * sy_h + t * sy_t
    tl.store(y_ptr + y_row[None, :] + m64[:, None], acc, mask=m_ok[:, None] & q_ok[None, :])


def _prune(configs, named_args, **kwargs):
    """The configs that fit the launch, in _CONFIGS' order: BLOCK_M at most M_BUCKET (a larger tile is mostly masked
    rows) and at most _MAX_ACC_REGS accumulator registers per thread; at least the last config (the smallest tile).
    Under TRITON_INTERPRET=1 only the first: one config, no timing."""
    m_bucket = named_args.get("M_BUCKET", kwargs.get("M_BUCKET", 64))
    qp = kwargs.get("QP", named_args.get("QP", 8))
    keep = [
        c
        for c in configs
        if c.kwargs["BLOCK_M"] <= m_bucket and c.kwargs["BLOCK_M"] * qp <= _MAX_ACC_REGS * 32 * c.num_warps
    ] or configs[-1:]
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
    dot16, xparts = dot_operands(x4.dtype, x_scale is not None)

    y = torch.empty((splits, B, H_q, T, M), dtype=torch.float32, device=x.device)
    z = zeros if zeros is not None else scales  # sym never reads it
    xs = x_scale if x_scale is not None else y  # placeholder pointer, never read
    with device_ctx(x):
        _gemv_inner_q_tuned[lambda meta: (triton.cdiv(M, meta["BLOCK_M"]), B * H_kv, splits)](
            x4, codes, scales.view(torch.int16), z, xs, y,
            H_kv, M, T, Q, L, per_split, bucket(L), bucket(M, 64),
            *x4.stride()[:3], *codes.stride()[:3], *scales.stride()[:3], *z.stride()[:3],
            xs.stride(0), *y.stride()[:4],
            BITS=bits, GROUP=group_size, MODE=_MODES[mode], HAS_XS=x_scale is not None,
            QP=qp, BK=bk, DOT16=dot16, XPARTS=xparts, EMU=EMULATE_DOT,
        )  # fmt: skip
    y = y[0] if splits == 1 else y.sum(0)  # fixed-order sum: deterministic
    return y if has_t else y.squeeze(2)
