"""Fused dequant-GEMV ops, reference implementation: literally dequantize, then matmul in fp32.

Readable on purpose; it is the spec the CUDA and Triton kernels are held to, and the CPU backend.
Shapes (docs/FORMATS.md): B batch, H_q query heads, H_kv KV heads (H_q % H_kv == 0), T query rows per head
(q_len, optional), L / R reduction length, M / C output length, G group size.
"""

import torch

from .quant import dequantize_groups


def _as_4d(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    # x: [B, H_q, L] or [B, H_q, T, L]  ->  [B, H_q, T, L], and whether T was given
    return (x, True) if x.dim() == 4 else (x.unsqueeze(2), False)


def _by_kv_head(xf: torch.Tensor, h_kv: int) -> torch.Tensor:
    # xf: [B, H_q, T, L] -> [B, H_kv, (H_q / H_kv) * T, L]: query head h reads KV head h // (H_q / H_kv), so the rows
    # of the query heads of one KV head stack into one matrix and one matmul per KV head serves them all (a
    # broadcast over a query-head dim instead would make torch.matmul copy the weights per query head: 7x slower
    # at the demo's decode shapes on CPU)
    B, H_q, T, L = xf.shape
    return xf.reshape(B, h_kv, (H_q // h_kv) * T, L)


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
    """y[b, h, t, m] = sum_l x[b, h, t, l] * x_scale[h_kv, l] * deq(codes)[b, h_kv, m, l]  (fp32)."""
    x4, has_t = _as_4d(x)
    xf = x4.to(torch.float32)  # [B, H_q, T, L]
    B, H_q, T, _ = xf.shape
    H_kv = codes.shape[1]
    xg = _by_kv_head(xf, H_kv)  # [B, H_kv, gq * T, L]
    if x_scale is not None:
        xg = xg * x_scale.to(torch.float32)[None, :, None, :]  # x_scale: [H_kv, L]
    w = dequantize_groups(codes, scales, zeros, bits, group_size, mode)  # [B, H_kv, M, L]
    # explicit M, not -1: reshape cannot infer a dim of an empty tensor (B, H_q or T == 0)
    y = (xg @ w.transpose(-1, -2)).reshape(B, H_q, T, codes.shape[2])  # [B, H_q, T, M]
    return y if has_t else y.squeeze(2)


def gemv_kivi(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bits: int,
    group_size: int,
) -> torch.Tensor:
    """y[b, h, t, c] = sum_r x[b, h, t, r] * deq(codes)[b, h_kv, r, c]  (fp32), asym groups along c."""
    x4, has_t = _as_4d(x)
    B, H_q, T, _ = x4.shape
    xg = _by_kv_head(x4.to(torch.float32), codes.shape[1])  # [B, H_kv, gq * T, R]
    w = dequantize_groups(codes, scales, zeros, bits, group_size, "asym")  # [B, H_kv, R, C]
    y = (xg @ w).reshape(B, H_q, T, w.shape[-1])  # [B, H_q, T, C]; explicit C as in gemv_inner_q
    return y if has_t else y.squeeze(2)
