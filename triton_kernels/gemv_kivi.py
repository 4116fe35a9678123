"""KIVI-layout fused dequant-GEMV in Triton, on tensor cores: reduction over rows R, asym groups along the columns C.

    y[b, h, t, c] = sum_r x[b, h, t, r] * fp16(s[r, g] * u[r, c] + z[r, g]),   g = c // G,  h_kv = h // (H_q/H_kv)

The arithmetic of the CUDA gemv_kivi (docs/FORMATS.md, "GEMV arithmetic"): the scale and zero vary along the
reduction, so each code is dequantized to fp16 in registers (one packed fma.rn.f16x2 per two values: the one rounding
of the contract; 1 bit selects between the group's two dequantized values instead), and the tile [BLOCK_R rows,
BLOCK_C columns] meets the activations on tensor cores with the columns as the MMA's M and the query rows as its N.
fp16 activations enter as they are; fp32 / bf16 ones are scaled per query row and chunk by a power of two so the
chunk's largest |x| lies in [2^14, 2^15), split into fp16 hi + lo (two dots), and the chunk's fp32 sum is scaled back
(exact). Accumulation is fp32.

A thread holds whole rows of the tile (the default: 128 rows on 4 warps, 128 columns): it loads a row's code words
once, decodes and dequantizes them two values per operation and writes the MMA operand with wide stores; the query
rows' split and the MMA round trips are paid once per chunk for all 128 columns.

Grid: (cdiv(C / 32, NCB), B * H_kv, splits). A program owns NCB 32-column blocks (BLOCK_C = 32 NCB columns) of one KV
head and serves all H_q/H_kv query heads times T query rows (flattened to Q, padded to the power of two QP >= 8,
masked: the N side of the MMA). It walks its share of R in chunks of BLOCK_R rows: whole chunks without predicates,
the last partial one with them. BLOCK_R, num_warps and num_stages are autotuned (_CONFIGS) per (bits, R bucket, query
rows). R is the long dim of the value GEMV (R = tokens, C = head_dim), so when B * H_kv * cdiv(C / 32, NCB) programs
are too few, R is split across `splits` programs writing fp32 partials [splits, B, H_q, T, C], summed afterwards in a
fixed order (deterministic; the split is planned with _SPLIT_BLOCK_R rows whatever config the autotuner picks).
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

# Autotune configs (BLOCK_R rows per iteration = the MMA's K, num_warps, num_stages). 128 rows x 4 warps is the
# default and the only config under TRITON_INTERPRET=1: one whole row of codes per thread (bench/README.md, "Triton
# roofline"). 64 and 32 rows give more programs and pipeline stages where a GPU is latency-bound; 16 rows (the MMA's
# smallest K) is the only one tried at 64 query rows (q_len 16 x GQA 4), where the [BLOCK_C, 64] accumulator and
# the [BLOCK_R, 64] activation parts leave no room for more.
_CONFIGS = [
    triton.Config({"BLOCK_R": 128}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_R": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_R": 32}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_R": 16}, num_warps=4, num_stages=3),
]
_SPLIT_BLOCK_R = 128  # rows the split of R is planned in (a multiple of every config's BLOCK_R)


@triton.jit
def _dequant_fp16(u, s, z, EMU: tl.constexpr):
    """fp16(s * u + z), rounded once: one packed fma.rn.f16x2 per two values (u exact fp16 integers, s / z the fp16
    scale and zero broadcast to u's shape). EMU (the interpreter): fp32 then fp16. s * u is exact in fp32 (an 11-bit
    times a 4-bit significand), and so is adding z unless the terms are over 2^9 apart in magnitude; then the smaller
    is far under half an fp16 ulp of the larger and both roundings agree, but for exact fp16 ties (|z| < 2^-24 |su|)."""
    if EMU:
        r = (u.to(tl.float32) * s.to(tl.float32) + z.to(tl.float32)).to(tl.float16).to(tl.float32)
    else:
        r = tl.inline_asm_elementwise(
            "fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r", [u, s, z], dtype=tl.float16, is_pure=True, pack=2
        )
    return r


@triton.jit
def _dequant_1bit(w, s, z):
    """1-bit codes w (int32 [R, NCB], one word per 32-column block) -> fp16(s u + z) [R, 32 NCB] in pair_perm order.

    A 1-bit value has two dequantized values, fp16(s * 0 + z) and fp16(s * 1 + z) (computed per group; NaN / inf
    scales propagate as in the FMA), so each pair of values is a select between the two: a shift, a byte permute
    and a LOP3 per two values, no arithmetic. s, z: fp16 [R, NCB], the scale and zero of each word's group."""
    R: tl.constexpr = w.shape[0]
    NCB: tl.constexpr = w.shape[1]
    sf = s.to(tl.float32)
    zf = z.to(tl.float32)
    # fp32 sums of two fp16 values round to the same fp16 as one fp16 rounding (exact unless the smaller is below
    # 2^-13 of the larger, far under half an fp16 ulp)
    lo16 = (sf * 0.0 + zf).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi16 = (sf + zf).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    p = select_pairs_1bit(w, lo16 | (lo16 << 16), hi16 | (hi16 << 16))  # [R, NCB, 2 x4]
    return halves(p, R, NCB * 32).to(tl.float16, bitcast=True)


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
    XPARTS: tl.constexpr,  # 1: x is fp16, one dot; 2: x (fp32 / bf16) scaled and split into fp16 hi + lo
    EVEN_C: tl.constexpr,  # n_cblocks % NCB == 0: every program's column blocks exist
    EMU: tl.constexpr,  # interpreter: dots on fp32-widened operands
    BLOCK_R: tl.constexpr,
):
    pid_c = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    b, h_kv, h_q, t, q_ok = gqa_query_rows(pid_bh, H_kv, Q, T, 0, QP)
    BLOCK_C: tl.constexpr = NCB * 32

    cb = pid_c * NCB + tl.arange(0, NCB)
    cb_ok = cb < n_cblocks
    g = (cb * 32) // GROUP  # [NCB] group of each column block
    word0 = pid_c * (BLOCK_C // 32 * BITS)
    n_words = (n_cblocks - pid_c * NCB) * BITS  # words of the row from word0 on (the rest read as 0)

    # pointers of the split's first chunk of rows, advanced by a chunk per iteration
    r_lo = pid_s * rows_per_split
    r_hi = tl.minimum(r_lo + rows_per_split, R)
    r = r_lo + tl.arange(0, BLOCK_R)
    r64 = r.to(tl.int64)
    c_rows = codes_ptr + b * sc_b + h_kv * sc_h + r64 * sc_r  # [BLOCK_R]
    s_ptrs = scales_ptr + b * ss_b + h_kv * ss_h + r64[:, None] * ss_r + g[None, :]  # [BLOCK_R, NCB]
    z_ptrs = zeros_ptr + b * sz_b + h_kv * sz_h + r64[:, None] * sz_r + g[None, :]
    x_ptrs = x_ptr + (b * sx_b + h_q * sx_h + t * sx_t)[None, :] + r64[:, None]  # [BLOCK_R, QP]

    acc = tl.zeros((BLOCK_C, QP), dtype=tl.float32)
    # whole chunks without row predicates (and, when every program's columns exist, without any); the last, partial
    # chunk of the split with them
    r_full = r_lo + (r_hi - r_lo) // BLOCK_R * BLOCK_R
    for _ in range(r_lo, r_full, BLOCK_R):
        acc = _kivi_chunk(acc, c_rows, s_ptrs, z_ptrs, x_ptrs, r, r_hi, cb_ok, q_ok, word0, n_words,
                          BITS, XPARTS, EMU, False, EVEN_C)  # fmt: skip
        c_rows += BLOCK_R * sc_r
        s_ptrs += BLOCK_R * ss_r
        z_ptrs += BLOCK_R * sz_r
        x_ptrs += BLOCK_R
        r += BLOCK_R
    if r_full < r_hi:
        acc = _kivi_chunk(acc, c_rows, s_ptrs, z_ptrs, x_ptrs, r, r_hi, cb_ok, q_ok, word0, n_words,
                          BITS, XPARTS, EMU, True, False)  # fmt: skip

    i = pair_perm(tl.arange(0, BLOCK_C), BITS)  # the column (within the program's block) each accumulator row holds
    y_row = pid_s.to(tl.int64) * sy_s + b * sy_b + h_q * sy_h + t * sy_t
    col = pid_c * BLOCK_C + i
    mask = (col < n_cblocks * 32)[:, None] & q_ok[None, :]
    tl.store(y_ptr + y_row[None, :] + col[:, None], acc, mask=mask)


@triton.jit
def _kivi_chunk(acc, c_rows, s_ptrs, z_ptrs, x_ptrs, r, r_hi, cb_ok, q_ok, word0, n_words,
                BITS: tl.constexpr, XPARTS: tl.constexpr, EMU: tl.constexpr, ROW_MASK: tl.constexpr,
                EVEN_C: tl.constexpr):  # fmt: skip
    """acc [BLOCK_C, QP] + the chunk's rows: acc[c, q] += sum_r fp16(s u + z)[r, c] * x[r, q] (module docstring).

    ROW_MASK: rows r >= r_hi read as 0 (the split's last, partial chunk); EVEN_C: every column block of the program
    exists. Without either, no load is predicated but the query rows' (q_ok, when Q < QP)."""
    BLOCK_R: tl.constexpr = c_rows.shape[0]
    NCB: tl.constexpr = s_ptrs.shape[1]
    BLOCK_C: tl.constexpr = NCB * 32
    if ROW_MASK or not EVEN_C:
        r_ok = r < r_hi
        w_mask = r_ok[:, None] & cb_ok[None, :]
        s = tl.load(s_ptrs, mask=w_mask, other=0.0)  # [BLOCK_R, NCB]
        z = tl.load(z_ptrs, mask=w_mask, other=0.0)
        xv = tl.load(x_ptrs, mask=r_ok[:, None] & q_ok[None, :], other=0.0)
    else:
        r_ok = None  # the codes' loads go unpredicated
        s = tl.load(s_ptrs)
        z = tl.load(z_ptrs)
        xv = tl.load(x_ptrs, mask=q_ok[None, :], other=0.0)

    # the codes dequantized to fp16, columns in pair_perm order within each 32-column block (a 32-column block lies
    # in one group: G is a multiple of 32, so the order within it does not matter); a masked-off row or column block
    # reads as codes 0, and its scale and zero as 0
    if BITS == 1 and not EMU:
        deq = _dequant_1bit(load_words(c_rows, word0, r_ok, n_words, NCB), s, z)
    else:
        shape: tl.constexpr = (BLOCK_R, NCB, 32)
        u = tl.reshape(unpack_pairs(c_rows, word0, r_ok, n_words, 0, BITS, BLOCK_C, 0, EMU), shape)
        deq = _dequant_fp16(u, tl.broadcast_to(s[:, :, None], shape), tl.broadcast_to(z[:, :, None], shape), EMU)
    a = tl.trans(tl.reshape(deq, (BLOCK_R, BLOCK_C)))  # [BLOCK_C, BLOCK_R]: the MMA's M is the columns

    # fp16 activations enter as they are; fp32 / bf16 ones scaled per query row and chunk by a power of two and split
    # into fp16 hi + lo (split_dot)
    acc = split_dot(a, xv, acc, XPARTS, 0, EMU)
    return acc


def _prune(configs, named_args, **kwargs):
    """64 query rows take the 16-row chunk alone; 32 query rows, and 3 bits (no KIVI preset; its decode holds three
    words per block: 32 B of spills under triton 3.6 at fp16 activations), leave out the 128-row chunk (the
    accumulator and the activation parts grow with the query rows); otherwise every config but the 16-row one."""
    qp = kwargs.get("QP", named_args.get("QP", 8))
    bits = kwargs.get("BITS", named_args.get("BITS", 2))
    if qp >= 64:
        keep = [c for c in configs if c.kwargs["BLOCK_R"] == 16]
    else:
        big_ok = qp < 32 and bits != 3
        keep = [c for c in configs if c.kwargs["BLOCK_R"] != 16 and (big_ok or c.kwargs["BLOCK_R"] < 128)]
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
    ncb = min(4, next_pow2(n_cblocks))
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
            BITS=bits, GROUP=group_size, QP=qp, NCB=ncb, XPARTS=1 if x.dtype == torch.float16 else 2,
            EVEN_C=n_cblocks % ncb == 0, EMU=EMULATE_DOT,
        )  # fmt: skip
    y = y[0] if splits == 1 else y.sum(0)  # fixed-order sum: deterministic
    return y if has_t else y.squeeze(2)
