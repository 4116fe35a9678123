"""AQUA-KV reconstruction, reference implementation: the executable spec of aqua_reconstruct and its CPU backend.

AQUA-KV (arXiv 2501.19392; docs/FORMATS.md "AQUA-KV") stores per layer only the residual that a linear predictor
from the layer below cannot guess, quantized by a backbone quantizer (here the lattice format). Reading a block of
T cached tokens of one layer back (C = H_kv * head_dim channels per token, all KV heads of a token concatenated):

    keys    k_hat = k_prev_hat @ Wk^T + bk                          + deq(k_codes, k_norms)
    values  v_hat = k_hat @ Wv_k^T + v_prev_hat @ Wv_v^T + bv        + deq(v_codes, v_norms)

The value predictor of the reference code is one Linear on cat([k_hat, v_prev_hat]) (keys first); its weight
[C, 2C] is split column-wise into Wv_k = W[:, :C] and Wv_v = W[:, C:], so the concatenation is never formed: a
second GEMM accumulates into the first. deq is lattice_dequantize (kvkernels.reference.lattice: per group of G
channels, x_hat = s * H_n (r16 * grid[c])).

Arithmetic (the spec every backend is held to, to fp32 accumulation-order tolerance): the activations and weights
are cast to fp32 (they enter exactly), the GEMMs accumulate in fp32, then

    out = ((prev @ W^T + prev2 @ W2^T) + bias) + deq        (fp32 [T, C], in this order)

NaN policy: no value checks; a NaN/Inf in a row of prev / prev2 or in a group's norm makes that row (or that group's
channels) non-finite, nothing else. A NaN in a weight poisons its output channel for every row.
"""

import torch

from .lattice import lattice_dequantize


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
    """prev @ weight^T (+ prev2 @ weight2^T) + bias + lattice_dequantize(codes, norms): fp32 [T, C].

    prev [T, C_in] and weight [C, C_in] (fp16 / bf16 / fp32, one dtype); bias fp32 [C]; codes int32
    [T, C * bits / 32]; norms fp16 [T, C / G]; prev2 [T, C_in2] and weight2 [C, C_in2] (both or neither).
    """
    acc = prev.to(torch.float32) @ weight.to(torch.float32).T  # [T, C]
    if prev2 is not None:
        acc = acc + prev2.to(torch.float32) @ weight2.to(torch.float32).T
    return (acc + bias.to(torch.float32)) + lattice_dequantize(codes, norms, grid, group_size, signs)
