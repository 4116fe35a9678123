"""Fused decode attention over one layer's quantized cache, reference implementation (the spec of the CUDA and
Triton `decode_attention_fused` kernels, and the CPU backend).

A layer cache is, in token order (kvkernels.formats.base):

    keys    sink_keys [S tokens, fp]  | key store   [mk tokens, quantized, key_layout]   | key_tail   [N - S - mk, fp]
    values  sink_values [S, fp]       | value store [mv tokens, quantized, value_layout] | value_tail [N - S - mv, fp]

A store in layout "rows" holds token t as row t, grouped along channels: codes [B, H_kv, m, D*bits/32], scales /
zeros [B, H_kv, m, D/G]. Layout "cols" is transposed, grouped along tokens: codes [B, H_kv, D, m*bits/32], scales /
zeros [B, H_kv, D, m/G] (m a multiple of G). Keys in the store may be normalized: the stored key is K / key_x_scale
(InnerQ's per-channel key norm, [H_kv, D]), so the key of a store token is deq * key_x_scale.

For x = q * softmax_scale (fp32 [B, H_q, T, D]; query head h reads KV head h // (H_q / H_kv)):

    out = softmax(x K^T + mask) V              fp32 [B, H_q, T, D]

mask None: causal among the T query rows, which are the last T of the N tokens (row t sees tokens j <= N - T + t).
Otherwise an additive fp32 mask [B or 1, H_q or 1, T, N] replaces it (a bool mask is turned into 0 / finfo.min by
kvkernels.attention before the op: a fully masked row then averages uniformly instead of giving NaN).

This reference literally dequantizes both stores, concatenates the parts and runs one softmax. The fast kernels
split the tokens into chunks (split_tokens per chunk; 0 lets them plan), compute each chunk's (max, sum, output)
with an online softmax and merge the chunks by log-sum-exp, so they differ from this only in rounding order;
split_tokens does not change the result, and the reference only validates it.
"""

import torch

from .quant import dequantize_groups


def store_tokens(codes, scales, zeros, bits: int, group_size: int, mode: str, layout: str) -> torch.Tensor:
    """The tokens of a quantized store, token-major: fp32 [B, H_kv, m, D]."""
    x = dequantize_groups(codes, scales, zeros, bits, group_size, mode)
    return x if layout == "rows" else x.transpose(-1, -2)


def causal_mask(T: int, N: int, device) -> torch.Tensor:
    """Additive fp32 [T, N]: -inf where key j is in the future of query row t (position N - T + t), else 0."""
    rows = torch.arange(N - T, N, device=device)[:, None]
    future = torch.arange(N, device=device)[None, :] > rows
    return torch.zeros(T, N, device=device).masked_fill(future, float("-inf"))


def decode_attention_fused(
    x: torch.Tensor,
    sink_keys: torch.Tensor,
    sink_values: torch.Tensor,
    key_codes: torch.Tensor,
    key_scales: torch.Tensor,
    key_zeros: torch.Tensor | None,
    value_codes: torch.Tensor,
    value_scales: torch.Tensor,
    value_zeros: torch.Tensor | None,
    key_tail: torch.Tensor,
    value_tail: torch.Tensor,
    key_bits: int,
    key_mode: str,
    key_layout: str,
    value_bits: int,
    value_mode: str,
    value_layout: str,
    group_size: int,
    key_x_scale: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    split_tokens: int = 0,
) -> torch.Tensor:
    """softmax(x K^T + mask) V over sink | store | tail of keys and values: fp32 [B, H_q, T, D] (module docstring)."""
    B, H_q, T, D = x.shape
    H_kv = sink_keys.shape[1]
    k_store = store_tokens(key_codes, key_scales, key_zeros, key_bits, group_size, key_mode, key_layout)
    if key_x_scale is not None:
        k_store = k_store * key_x_scale.to(torch.float32)[None, :, None, :]
    v_store = store_tokens(value_codes, value_scales, value_zeros, value_bits, group_size, value_mode, value_layout)
    k = torch.cat([sink_keys.float(), k_store, key_tail.float()], dim=2)  # [B, H_kv, N, D]
    v = torch.cat([sink_values.float(), v_store, value_tail.float()], dim=2)
    N = k.shape[2]
    xg = x.to(torch.float32).reshape(B, H_kv, H_q // H_kv, T, D)  # the query heads of one KV head together
    scores = (xg @ k.unsqueeze(2).transpose(-1, -2)).reshape(B, H_q, T, N)
    scores = scores + (causal_mask(T, N, x.device) if attn_mask is None else attn_mask.to(torch.float32))
    p = torch.softmax(scores, dim=-1).reshape(B, H_kv, H_q // H_kv, T, N)
    return (p @ v.unsqueeze(2)).reshape(B, H_q, T, D)
