"""AQUA-KV reconstruction in Triton: predictor GEMM(s) on tensor cores, the lattice residual dequantized in the
epilogue. kvkernels/reference/aqua.py is the spec:

    out[t, c] = sum_i prev[t, i] W[c, i]  (+ sum_j prev2[t, j] W2[c, j])  + bias[c] + deq(codes, norms)[t, c]

One program owns a tile of BLOCK_T tokens x one lattice group of G output channels (C / G programs across), so the
group's residual is dequantized entirely inside the program: unpack its indices, gather grid points, scale by the
group's fp16 norm, inverse Walsh-Hadamard in registers (the lattice kernels' butterfly), signs. The GEMM runs as
tl.dot over BLOCK_K slices of the input channels, accumulating in fp32; the value predictor's second input (prev2,
W2) is a second loop into the same accumulator, so [k_hat ; v_prev_hat] is never formed, and the GEMM result is
never written out: only prediction + residual is stored.

fp16 / bf16 operands run on tensor cores (fp32 accumulation). fp32 operands use input_precision="ieee" (no TF32),
so they match the fp32 reference to accumulation-order tolerance; that path is for tests, not speed.
"""

import torch
import triton
import triton.language as tl

from ._common import INTERPRETED, check_device, device_ctx, next_pow2, unit_last
from .lattice import _grid_consts, _group_consts, _signs_arg, dequantize_group

# Input channels per tl.dot step; tl.dot needs every dim >= 16.
BLOCK_K = 32
# Tokens per program: tl.dot's M dim (>= 16); 64 keeps the [BLOCK_T, G] fp32 accumulator small at G = 64.
MAX_BLOCK_T = 64


@triton.jit
def _accumulate(
    acc, a_ptr, w_ptr, rows, r_ok, cols, n_in, s_a, s_w,
    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """acc [BLOCK_T, G] += a[rows, :n_in] @ w[cols, :n_in]^T, BLOCK_K input channels per tl.dot."""
    for k0 in range(0, n_in, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < n_in
        a = tl.load(a_ptr + rows[:, None] * s_a + kk[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols[None, :] * s_w + kk[:, None], mask=k_ok[:, None], other=0.0)  # W^T tile [K, G]
        if UPCAST:  # the interpreter's bf16 dot is wrong (numpy has no bf16): exact fp32 products instead
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _aqua_reconstruct_kernel(
    # pointers
    prev_ptr,  # [T, C_in], row stride s_prev
    w_ptr,  # [C, C_in], row stride s_w
    prev2_ptr,  # [T, C_in2] (unused unless HAS_PREV2)
    w2_ptr,  # [C, C_in2]
    bias_ptr,  # fp32 [C], contiguous
    codes_ptr,  # int32 [T, C * WORDS / 32], row stride s_codes
    norms_ptr,  # fp16 [T, C / G], row stride s_norms
    grid_ptr,  # fp32 [n, DIM], contiguous
    signs_ptr,  # int8 [G] (unused unless HAS_SIGNS)
    out_ptr,  # fp32 [T, C], contiguous
    # sizes
    T,
    C,
    C_in,
    C_in2,
    # row strides (last dims contiguous)
    s_prev,
    s_w,
    s_prev2,
    s_w2,
    s_codes,
    s_norms,
    # meta-parameters
    GROUP: tl.constexpr,
    LOG_G: tl.constexpr,
    INV_SQRT_G: tl.constexpr,
    DIM: tl.constexpr,
    IDX_BITS: tl.constexpr,
    HAS_SIGNS: tl.constexpr,
    HAS_PREV2: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    g = tl.program_id(1)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    r_ok = rows < T
    cols = (g * GROUP + tl.arange(0, GROUP)).to(tl.int64)  # C % G == 0: every column exists

    # the prediction: one or two accumulating GEMMs, fp32 accumulator
    acc = tl.zeros((BLOCK_T, GROUP), dtype=tl.float32)
    acc = _accumulate(acc, prev_ptr, w_ptr, rows, r_ok, cols, C_in, s_prev, s_w, BLOCK_K, PRECISION, UPCAST)
    if HAS_PREV2:
        acc = _accumulate(acc, prev2_ptr, w2_ptr, rows, r_ok, cols, C_in2, s_prev2, s_w2, BLOCK_K, PRECISION, UPCAST)
    acc = acc + tl.load(bias_ptr + cols)[None, :]

    # epilogue: this group's residual, s * H_n (r16 * grid[c]), as lattice_dequantize computes it
    x = dequantize_group(
        codes_ptr, norms_ptr, grid_ptr, signs_ptr, rows * s_codes, rows * s_norms, r_ok, g,
        GROUP, LOG_G, INV_SQRT_G, DIM, IDX_BITS, HAS_SIGNS, BLOCK_T,
    )  # fmt: skip
    tl.store(out_ptr + rows[:, None] * C + cols[None, :], acc + x, mask=r_ok[:, None])


def aqua_reconstruct(
    prev: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    codes: torch.Tensor,
    norms: torch.Tensor,
    grid: torch.Tensor,
    group_size: int,
    signs: torch.Tensor | None = None,
    prev2: torch.Tensor | None = None,
    weight2: torch.Tensor | None = None,
) -> torch.Tensor:
    """((prev @ weight^T + prev2 @ weight2^T) + bias) + lattice_dequantize(codes, norms): fp32 [T, C]."""
    check_device("aqua_reconstruct", prev)
    T, C_in = prev.shape
    C = weight.shape[0]
    out = torch.empty((T, C), dtype=torch.float32, device=prev.device)
    if T == 0 or C == 0:
        return out
    prev, weight, codes, norms = (unit_last(t) for t in (prev, weight, codes, norms))
    has2 = prev2 is not None
    prev2, weight2 = (unit_last(prev2), unit_last(weight2)) if has2 else (prev, weight)  # placeholders, never read
    block_t = min(MAX_BLOCK_T, max(16, next_pow2(T)))
    upcast = INTERPRETED and prev.dtype == torch.bfloat16
    precision = "ieee" if prev.dtype == torch.float32 or upcast else "tf32"  # fp16 / bf16 ignore it
    with device_ctx(prev):
        _aqua_reconstruct_kernel[(triton.cdiv(T, block_t), C // group_size)](
            prev, weight, prev2, weight2, bias.contiguous(), codes, norms, grid.contiguous(),
            _signs_arg(signs, grid), out,
            T, C, C_in, prev2.shape[1] if has2 else 0,
            prev.stride(0), weight.stride(0), prev2.stride(0), weight2.stride(0), codes.stride(0), norms.stride(0),
            **_group_consts(group_size), **_grid_consts(grid), HAS_SIGNS=signs is not None, HAS_PREV2=has2,
            PRECISION=precision, UPCAST=upcast, BLOCK_T=block_t, BLOCK_K=BLOCK_K, num_warps=4,
        )  # fmt: skip
    return out
