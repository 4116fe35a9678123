"""Decode attention over a quantized layer cache (InnerQ paper, Figure 2), built on the fused kvkernels ops.

For queries q [B, H_q, T, D] (the last T tokens of the cache; GQA: query head h reads KV head h // (H_q/H_kv)):

    x      = q * scale                                                        (fp32)
    S      = [ x K_sink^T  |  S_quant  |  x K_tail^T ]                        one score per key token, in order
    S_quant = cache.quantized_key_scores(x)     the format's hook, e.g. InnerQ gemv_inner_q(x, codes of K / norm,
                                                x_scale=norm) = (x * norm) . deq(K / norm) ~ x . K; KIVI gemv_kivi
    P      = softmax(S + causal mask)                                         ONE softmax over all N tokens, fp32
             cache.observe_attention(P)                 the third hook: a no-op unless the format selects tokens
    O      = P[sink] V_sink + cache.quantized_value_output(P[value-store tokens]) + P[value tail] V_tail

The hooks are all attention knows of a format (kvkernels.formats.base.QuantizedLayerCache); it never names
one. The key and value stores cover different token ranges (kvkernels.formats.base), so P is split at
the value-side boundaries, not the key-side ones. The fp16 window products are done in fp32 (the windows are at
most w + G - 1 tokens, so the upcast is negligible next to the quantized GEMVs).

Causal mask for T > 1: query row t sits at position N - T + t and sees key tokens j <= N - T + t. The mask is
applied to the concatenated scores, so it is correct wherever those tokens live (fp16 tail or quantized store).
A caller's attn_mask (padding, trees of speculative drafts) replaces it, again over all N tokens in order.

The same arithmetic in one op: when the cache's attention is exactly this composition (it offers
fused_attention_operands: InnerQ, KIVI, XQuant), ops.decode_attention_fused computes scores, softmax and output in
one split-KV pass with a log-sum-exp merge, and the scores never round-trip through memory. Which path runs:
the `fused_op` argument, else the environment variable KVKERNELS_ATTENTION ("fused", "composed", "auto"); auto (the
default) fuses on CUDA tensors when the stores have InnerQ's layouts (auto_fuses_layouts: the layouts the CUDA op
puts on tensor cores; KIVI's measured faster composed) and composes on CPU, where the op's kernel is the reference
(the same work). Caches
that cannot be fused, and head dims the serving kernel does not take (the CUDA kernel: 64, 128), compose
(use_fused_op).
"""

import os

import torch

from . import ops

ATTENTION_ENV = "KVKERNELS_ATTENTION"
# decode_attention_fused's arguments after x, in its schema's order, as QuantizedLayerCache.fused_attention_operands
# names them (attn_mask, split_tokens, lengths, q_scale, out_dtype follow)
FUSED_OPERANDS = (
    "sink_keys", "sink_values", "key_codes", "key_scales", "key_zeros", "value_codes", "value_scales", "value_zeros",
    "key_tail", "value_tail", "key_bits", "key_mode", "key_layout", "value_bits", "value_mode", "value_layout",
    "group_size", "key_x_scale",
)  # fmt: skip
_POLICIES = ("auto", "fused", "composed")


def _grouped_matmul(x: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    # x [B, H_q, T, L] fp32, kv [B, H_kv, L, M] -> [B, H_q, T, M]; query head h reads kv head h // (H_q / H_kv)
    B, H_q, T, L = x.shape
    H_kv = kv.shape[1]
    y = x.reshape(B, H_kv, (H_q // H_kv) * T, L) @ kv
    return y.reshape(B, H_q, T, kv.shape[-1])


def _causal_mask(T: int, N: int, device) -> torch.Tensor:
    # True where key j is in the future of query row t (position N - T + t)
    rows = torch.arange(N - T, N, device=device)[:, None]
    return torch.arange(N, device=device)[None, :] > rows  # [T, N]


def _check_mask(attn_mask: torch.Tensor, B: int, H_q: int, T: int, N: int) -> None:
    if (
        attn_mask.dim() != 4
        or tuple(attn_mask.shape[-2:]) != (T, N)
        or attn_mask.shape[0] not in (1, B)
        or attn_mask.shape[1] not in (1, H_q)
    ):
        raise ValueError(f"attn_mask must be [B or 1, H_q or 1, T={T}, N={N}], got {list(attn_mask.shape)}")
    if not (attn_mask.dtype == torch.bool or attn_mask.dtype.is_floating_point):
        # an integer 0/1 mask would be added to the scores (as SDPA adds float masks), silently attending to
        # everything; SDPA itself rejects it too
        raise TypeError(f"attn_mask must be bool (True = attend) or a float additive mask, got {attn_mask.dtype}")


def _additive_mask(attn_mask: torch.Tensor | None, B: int, H_q: int, T: int, N: int) -> torch.Tensor | None:
    """The fused op's mask: None stays None (causal), bool -> 0 / finfo.min (as _apply_mask), float -> fp32."""
    if attn_mask is None:
        return None
    _check_mask(attn_mask, B, H_q, T, N)
    if attn_mask.dtype == torch.bool:
        mask = torch.zeros(attn_mask.shape, dtype=torch.float32, device=attn_mask.device).masked_fill(
            ~attn_mask, torch.finfo(torch.float32).min
        )
    else:
        mask = attn_mask.to(torch.float32)
    return mask if mask.stride(-1) == 1 or N == 1 else mask.contiguous()


def _apply_mask(scores: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:
    # scores [B, H_q, T, N] fp32, token order. None: causal among the last T rows; else the caller's mask.
    B, H_q, T, N = scores.shape
    if attn_mask is None:
        return scores.masked_fill(_causal_mask(T, N, scores.device), float("-inf")) if T > 1 else scores
    _check_mask(attn_mask, B, H_q, T, N)
    if attn_mask.dtype == torch.bool:
        # finfo.min rather than -inf: a fully masked row (a padding query) averages instead of giving NaN
        return scores.masked_fill(~attn_mask, torch.finfo(torch.float32).min)
    return scores + attn_mask.to(torch.float32)


def _check_q(q: torch.Tensor, num_kv_heads: int, head_dim: int, batch: int, seq_len: int) -> None:
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a tensor, got {type(q).__name__}")
    if not q.dtype.is_floating_point:  # the result is returned in q's dtype: an int / bool q would truncate it
        raise TypeError(f"q must be floating point (fp16, bf16, fp32), got {str(q.dtype).removeprefix('torch.')}")
    if q.dim() != 4:
        raise ValueError(f"q must be [B, H_q, T, D], got shape {list(q.shape)}")
    B, H_q, T, D = q.shape
    if B != batch or D != head_dim:
        raise ValueError(f"q must be [B={batch}, H_q, T, D={head_dim}], got {list(q.shape)}")
    if H_q % num_kv_heads:
        raise ValueError(f"query heads H_q={H_q} must be a multiple of KV heads H_kv={num_kv_heads}")
    if T < 1:
        raise ValueError("q needs at least one query row (T >= 1)")
    if T > seq_len:
        raise ValueError(f"q has T={T} rows but the cache holds {seq_len} tokens; append the new tokens first")


def auto_fuses_layouts(operands: dict) -> bool:
    """Whether "auto" takes the fused op for these stores' layouts: only InnerQ's (keys "rows", values "cols"), whose
    quantized tokens the CUDA op runs on tensor-core store tiles: innerq_base fused was 1.5x faster than composed in
    every row of the first GPU run (H200, bench/RESULTS.md). KIVI's layouts went through the op's general kernel then
    (~45 instructions per byte) and measured slower than composed (kivi2 at 8k tokens x batch 8 327 vs 156 us, at 32k
    x batch 1 116 vs 98 us); they have tensor-core tiles since (kivi2 8.1 / 9.9 per byte at head_dim 128 with 4 / 8
    query rows by the static model), not yet measured on a GPU, so they stay composed here until a run says otherwise.
    KVKERNELS_ATTENTION=fused (or fused_op=True) fuses KIVI."""
    return operands.get("key_layout") == "rows" and operands.get("value_layout") == "cols"


def use_fused_op(q: torch.Tensor, cache, fused_op: bool | None = None) -> dict | None:
    """The decode_attention_fused operands of cache when decode_attention should take the one-op path, else None.

    fused_op True / False decides (True on a cache that cannot be fused is a ValueError). None reads
    KVKERNELS_ATTENTION: "composed" never fuses, "fused" fuses every cache that can be, "auto" (default) those on
    CUDA with InnerQ's layouts (auto_fuses_layouts). Neither fuses a head_dim the kernel serving q's device does not
    take (ops.fused_attention_takes)."""
    auto = False
    if fused_op is None:
        policy = os.environ.get(ATTENTION_ENV, "auto").strip().lower() or "auto"
        if policy not in _POLICIES:
            raise ValueError(f"{ATTENTION_ENV}={policy!r}: must be one of {_POLICIES}")
        if policy == "composed" or (policy == "auto" and not q.is_cuda):
            return None
        if not ops.fused_attention_takes(q.device, q.shape[-1]):
            return None
        auto = policy == "auto"
    elif not fused_op:
        return None
    operands = cache.fused_attention_operands() if hasattr(cache, "fused_attention_operands") else None
    if auto and operands is not None and not auto_fuses_layouts(operands):
        return None
    if operands is None and fused_op:
        raise ValueError(
            "fused_op=True, but this cache's format attends its own way (its layer cache overrides an attention "
            "hook, or reads its stores with another op); use fused_op=None or False"
        )
    return operands


def decode_attention(
    q: torch.Tensor,
    cache,
    scale: float | None = None,
    attn_mask: torch.Tensor | None = None,
    fused_op: bool | None = None,
) -> torch.Tensor:
    """Attention of q [B, H_q, T, D] over a layer cache of any format; returns [B, H_q, T, D] in q.dtype.

    scale defaults to D**-0.5. The T rows are the last T tokens of the cache. attn_mask None: causal among
    them. Otherwise attn_mask [B or 1, H_q or 1, T, N] over all N cached tokens in token order replaces the
    causal mask, as SDPA's attn_mask does: bool (True = attend; a fully masked row gets a uniform average, not
    NaN) or float (added to the scores). fused_op: True runs ops.decode_attention_fused (ValueError for a cache
    that cannot), False the composition below, None the module docstring's default.
    """
    if not all(hasattr(cache, h) for h in ("quantized_key_scores", "quantized_value_output", "observe_attention")):
        raise TypeError(f"cache must be a kvkernels layer cache (QuantizedLayerCache), got {type(cache).__name__}")
    N = cache.seq_len
    _check_q(q, cache.num_kv_heads, cache.head_dim, cache.batch, N)
    if q.device != cache.device:
        raise ValueError(f"q is on {q.device} but the cache is on {cache.device}")
    B, H_q, T, D = q.shape
    scale = D**-0.5 if scale is None else float(scale)

    operands = use_fused_op(q, cache, fused_op)
    if operands is not None:
        mask = _additive_mask(attn_mask, B, H_q, T, N)
        # the op scales q in fp32 and returns q.dtype: the same arithmetic as q.to(fp32) * scale in, .to(q.dtype) out,
        # without those three elementwise kernels around it. The cache built the operands and q is checked above, so
        # the op's own validation is the only one (ops.unchecked: the wrapper's would repeat it on every step)
        if len(operands) != len(FUSED_OPERANDS):  # a key it does not know would be dropped here (a missing one raises)
            raise ValueError(f"fused_attention_operands() returned {sorted(operands)}, expected {list(FUSED_OPERANDS)}")
        args = [operands[name] for name in FUSED_OPERANDS]
        return ops.unchecked("decode_attention_fused")(q, *args, mask, 0, None, scale, q.dtype)

    x = q.to(torch.float32) * scale  # [B, H_q, T, D]
    scores = torch.cat(
        [
            _grouped_matmul(x, cache.sink_keys.to(torch.float32).transpose(2, 3)),
            cache.quantized_key_scores(x),
            _grouped_matmul(x, cache.key_tail.to(torch.float32).transpose(2, 3)),
        ],
        dim=-1,
    )  # [B, H_q, T, N] fp32
    p = torch.softmax(_apply_mask(scores, attn_mask), dim=-1)
    cache.observe_attention(p)  # a format that picks tokens by attention (SpeCache's top-k) reads p here

    s, mv = cache.n_sink, cache.value_store.n  # value-side token ranges: [0, s) | [s, s + mv) | [s + mv, N)
    out = _grouped_matmul(p[..., :s], cache.sink_values.to(torch.float32))
    out = out + cache.quantized_value_output(p[..., s : s + mv])
    out = out + _grouped_matmul(p[..., s + mv :], cache.value_tail.to(torch.float32))
    return out.to(q.dtype)


def reference_decode_attention(
    q: torch.Tensor,
    k_full: torch.Tensor,
    v_full: torch.Tensor,
    scale: float | None = None,
    attn_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain SDPA in fp32: q [B, H_q, T, D] over k_full, v_full [B, H_kv, N, D]; returns fp32 [B, H_q, T, D].

    The T rows are the last T of the N tokens (causal among themselves unless attn_mask is given, with the
    semantics of decode_attention); GQA by repeat_interleave.
    """
    B, H_kv, N, D = k_full.shape
    _check_q(q, H_kv, D, B, N)
    if v_full.shape != k_full.shape:
        raise ValueError(f"k_full and v_full must match, got {list(k_full.shape)} and {list(v_full.shape)}")
    scale = D**-0.5 if scale is None else float(scale)
    g = q.shape[1] // H_kv
    k = k_full.to(torch.float32).repeat_interleave(g, dim=1)
    v = v_full.to(torch.float32).repeat_interleave(g, dim=1)
    scores = (q.to(torch.float32) * scale) @ k.transpose(2, 3)
    return torch.softmax(_apply_mask(scores, attn_mask), dim=-1) @ v
