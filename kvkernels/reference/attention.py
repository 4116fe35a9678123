"""Fused decode attention over one layer's quantized cache, reference implementation (the spec of the CUDA and
Triton `decode_attention_fused` kernels, and the CPU backend).

A layer cache is, in token order (kvkernels.formats.base):

    keys    sink_keys [S tokens, fp]  | key store   [mk tokens, quantized, key_layout]   | key_tail   [N - S - mk, fp]
    values  sink_values [S, fp]       | value store [mv tokens, quantized, value_layout] | value_tail [N - S - mv, fp]

A store in layout "rows" holds token t as row t, grouped along channels: codes [B, H_kv, m, D*bits/32], scales /
zeros [B, H_kv, m, D/G]. Layout "cols" is transposed, grouped along tokens: codes [B, H_kv, D, m*bits/32], scales /
zeros [B, H_kv, D, m/G] (m a multiple of G). Keys in the store may be normalized: the stored key is K / key_x_scale
(InnerQ's per-channel key norm, [H_kv, D]), so the key of a store token is deq * key_x_scale.

For queries x [B, H_q, T, D] (fp16, bf16 or fp32; query head h reads KV head h // (H_q / H_kv)) and q_scale (the
softmax scale; x' = x.to(fp32) * q_scale, one fp32 multiply):

    out = softmax(x' K^T + mask) V             [B, H_q, T, D], computed in fp32, returned in out_dtype (default fp32;
                                               fp16 / bf16: the fp32 result rounded once, as .to() rounds)

kvkernels.decode_attention passes q itself with q_scale and out_dtype = q.dtype: the op then replaces the two
elementwise kernels before it (q.to(fp32) * scale) and the one after it (.to(q.dtype)), with the same arithmetic.

mask None: causal among the T query rows, which are the last T of the N tokens (row t sees tokens j <= N - T + t).
Otherwise an additive fp32 mask [B or 1, H_q or 1, T, N] replaces it (a bool mask is turned into 0 / finfo.min by
kvkernels.attention before the op: a fully masked row then averages uniformly instead of giving NaN).

Device-side lengths (static caches, CUDA graphs): with lengths, an int64 tensor [5] on x's device holding
(S, mk, lk, mv, lv), the tokens used of sink, key store, key tail, value store and value tail, every window and store
argument is a fixed-capacity buffer of which only the first tokens are read, and no token count is read on the host:
the op's launch depends on shapes only, so a decode step can be captured in a CUDA graph and replayed as the lengths
change. N = S + mk + lk = S + mv + lv; a mask is then [B|1, H_q|1, T, M] with M >= S_cap + min(mk_cap + lk_cap,
mv_cap + lv_cap) (the most tokens the buffers hold), column j holding token j, columns >= N unread. Lengths that
break these rules (over a capacity, keys and values disagreeing, T > N, a "cols" store length not a multiple of G)
cannot be checked without a device sync; the kernels then clamp each length into its buffer (never reading outside
it) and the result is unspecified: every length is clamped into [0, capacity] (a "cols" store's rounded down to a
multiple of G) and N = S + min(mk + lk, mv + lv).

This reference literally dequantizes both stores, concatenates the parts and runs one softmax. The fast kernels
split the tokens into chunks (split_tokens per chunk; 0 lets them plan), compute each chunk's (max, sum, output)
with an online softmax and merge the chunks by log-sum-exp, so they differ from this only in rounding order;
split_tokens does not change the result, and the reference only validates it. One exception: the compiled CUDA op's
KIVI tiles (KIVI's layouts and presets, from 256 store tokens of capacity) round each dequantized key and value of
the tokens they run to fp16, as the composed KIVI GEMVs do (docs/FORMATS.md, "GEMV arithmetic").
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
    lengths: torch.Tensor | None = None,
    q_scale: float = 1.0,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """softmax(x' K^T + mask) V over sink | store | tail of keys and values, x' = x.to(fp32) * q_scale: [B, H_q, T, D]
    in out_dtype (default fp32) (module docstring)."""
    out = _attention_fp32(
        x.to(torch.float32) * q_scale if q_scale != 1.0 else x.to(torch.float32), sink_keys, sink_values, key_codes,
        key_scales, key_zeros, value_codes, value_scales, value_zeros, key_tail, value_tail, key_bits, key_mode,
        key_layout, value_bits, value_mode, value_layout, group_size, key_x_scale, attn_mask, lengths,
    )  # fmt: skip
    return out if out_dtype in (None, torch.float32) else out.to(out_dtype)


def _attention_fp32(
    x, sink_keys, sink_values, key_codes, key_scales, key_zeros, value_codes, value_scales, value_zeros, key_tail,
    value_tail, key_bits, key_mode, key_layout, value_bits, value_mode, value_layout, group_size, key_x_scale,
    attn_mask, lengths,
) -> torch.Tensor:  # fmt: skip
    B, H_q, T, D = x.shape
    H_kv = sink_keys.shape[1]
    k_store = store_tokens(key_codes, key_scales, key_zeros, key_bits, group_size, key_mode, key_layout)
    if key_x_scale is not None:
        k_store = k_store * key_x_scale.to(torch.float32)[None, :, None, :]
    v_store = store_tokens(value_codes, value_scales, value_zeros, value_bits, group_size, value_mode, value_layout)
    if lengths is not None:
        cols = (key_layout == "cols", value_layout == "cols")
        parts = (sink_keys, k_store, key_tail, sink_values, v_store, value_tail)
        return _with_device_lengths(x, parts, cols, group_size, attn_mask, lengths)
    k = torch.cat([sink_keys.float(), k_store, key_tail.float()], dim=2)  # [B, H_kv, N, D]
    v = torch.cat([sink_values.float(), v_store, value_tail.float()], dim=2)
    N = k.shape[2]
    xg = x.to(torch.float32).reshape(B, H_kv, H_q // H_kv, T, D)  # the query heads of one KV head together
    scores = (xg @ k.unsqueeze(2).transpose(-1, -2)).reshape(B, H_q, T, N)
    scores = scores + (causal_mask(T, N, x.device) if attn_mask is None else attn_mask.to(torch.float32))
    p = torch.softmax(scores, dim=-1).reshape(B, H_kv, H_q // H_kv, T, N)
    return (p @ v.unsqueeze(2)).reshape(B, H_q, T, D)


def clamped_lengths(lengths: torch.Tensor, caps: tuple[int, int, int, int, int], key_cols: bool, value_cols: bool,
                    group_size: int) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """(S, mk, lk, mv, lv, N) as 0-d int64 device tensors: each length clamped into [0, its capacity], a "cols" store's
    rounded down to a multiple of G, and N = S + min(mk + lk, mv + lv) (the module docstring's rule for lengths that
    break the contract; valid lengths pass unchanged). No host read."""
    S, mk, lk, mv, lv = (lengths.to(torch.int64)[i].clamp(0, cap) for i, cap in enumerate(caps))
    if key_cols:
        mk = mk - mk % group_size
    if value_cols:
        mv = mv - mv % group_size
    return S, mk, lk, mv, lv, S + torch.minimum(mk + lk, mv + lv)


def _gather_tokens(sink, store, tail, S, m, n_cap: int) -> torch.Tensor:
    # tokens 0 .. n_cap - 1 in token order, gathered from capacity buffers by device-computed indices (clamped, so a
    # position past N reads some buffer row; the caller masks it)
    j = torch.arange(n_cap, device=sink.device)
    s_cap, m_cap = sink.shape[2], store.shape[2]
    idx = torch.where(j < S, j, torch.where(j < S + m, s_cap + j - S, s_cap + m_cap + j - S - m))
    parts = torch.cat([sink.float(), store, tail.float()], dim=2)
    return parts.index_select(2, idx.clamp(0, parts.shape[2] - 1))


def _with_device_lengths(x, parts, cols, group_size, attn_mask, lengths) -> torch.Tensor:
    # the module docstring's device-lengths form, with masks instead of slices: no token count is read on the host.
    # parts: (sink_keys, key store tokens, key_tail, sink_values, value store tokens, value_tail), capacity buffers
    sink_keys, k_store, key_tail, sink_values, v_store, value_tail = parts
    B, H_q, T, D = x.shape
    H_kv = sink_keys.shape[1]
    caps = (sink_keys.shape[2], k_store.shape[2], key_tail.shape[2], v_store.shape[2], value_tail.shape[2])
    S, mk, lk, mv, lv, N = clamped_lengths(lengths, caps, *cols, group_size)
    n_cap = caps[0] + min(caps[1] + caps[2], caps[3] + caps[4])
    k = _gather_tokens(sink_keys, k_store, key_tail, S, mk, n_cap)  # [B, H_kv, n_cap, D]
    v = _gather_tokens(sink_values, v_store, value_tail, S, mv, n_cap)
    j = torch.arange(n_cap, device=x.device)
    v = v.masked_fill((j >= N)[:, None], 0.0)  # unused capacity may hold anything: p 0 times NaN would be NaN
    xg = x.to(torch.float32).reshape(B, H_kv, H_q // H_kv, T, D)
    scores = (xg @ k.unsqueeze(2).transpose(-1, -2)).reshape(B, H_q, T, n_cap)
    if attn_mask is None:
        future = j[None, :] > (N - T + torch.arange(T, device=x.device))[:, None]  # [T, n_cap]
        scores = scores.masked_fill(future, float("-inf"))
    else:
        scores = scores + attn_mask[..., :n_cap].to(torch.float32)
    scores = scores.masked_fill(j >= N, float("-inf"))  # after the mask: NaN + -inf would stay NaN
    p = torch.softmax(scores, dim=-1).reshape(B, H_kv, H_q // H_kv, T, n_cap)
    return (p @ v.unsqueeze(2)).reshape(B, H_q, T, D)
