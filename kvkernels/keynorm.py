"""Per-channel key normalization (InnerQ paper, section 4.3) and folding it into attention weights.

InnerQ groups keys per token (G consecutive channels share one scale), so a channel with outliers inflates
the scale of every group it sits in. Dividing each channel by

    norm[h, c] = sqrt(max over batch and tokens of |K[:, h, :, c]|)

flattens those outliers before quantization, and scores are unchanged because q . k = (q * norm) . (k / norm).
Two ways to use it:

  * at runtime (the caches' default, key_norm=True): quantized keys are stored as K / norm and the decode query
    is scaled by norm inside the fused GEMV (x_scale); the fp16 windows keep raw keys. Nothing in the model
    changes.
  * folded (paper): fold_key_norm_into_attention() divides the k_proj rows by norm and multiplies the q_proj rows
    of every query head in the group by norm, so k_proj emits K / norm and q_proj emits q * norm. Then every key
    the cache sees is already normalized, including the fp16 windows, so such a cache must not normalize again:
    create it with key_norm=False, and write keys that were produced before folding (the prefill) as
    K / norm yourself. Folding is exact only because RoPE rotates channel c with channel c + D/2 (Llama's
    rotate_half) by the same angle, so both channels of a pair must share one factor: compute_key_norm pairs
    them by default, and fold_key_norm_into_attention rejects unpaired norms.
"""

import torch
from torch import nn

# amax is clamped here before the sqrt, so an all-zero channel gets norm 1e-2 rather than a division by zero,
# and a later key in such a channel is amplified by at most 100x (kept well inside the fp16 scale range).
KEY_NORM_EPS = 1e-4


def compute_key_norm(k: torch.Tensor, rope_paired: bool = True, eps: float = KEY_NORM_EPS) -> torch.Tensor:
    """norm[h, c] = sqrt(max(max_{b,n} |k[b, h, n, c]|, eps)) as fp32 [H_kv, D].

    k: [B, H_kv, N, D] (N >= 1). rope_paired=True gives channels c and c + D/2 the same factor,
    max(norm_c, norm_{c + D/2}), which keeps folding into q_proj/k_proj exact under rotate_half RoPE.
    """
    if k.dim() != 4:
        raise ValueError(f"compute_key_norm: k must be [B, H_kv, N, D], got shape {list(k.shape)}")
    if k.shape[0] * k.shape[2] == 0:
        raise ValueError("compute_key_norm: k has no tokens; the norm needs at least one key per head")
    amax = k.detach().abs().amax(dim=(0, 2)).to(torch.float32)  # [H_kv, D]
    if not torch.isfinite(amax).all():
        raise ValueError("compute_key_norm: k contains NaN or Inf")
    norm = amax.clamp_min(eps).sqrt()
    if rope_paired:
        D = norm.shape[-1]
        if D % 2:
            raise ValueError(f"compute_key_norm: rope_paired needs an even head_dim, got {D}")
        half = torch.maximum(norm[:, : D // 2], norm[:, D // 2 :])
        norm = torch.cat([half, half], dim=-1)
    return norm.contiguous()


def check_rope_paired(norm: torch.Tensor) -> None:
    """Raise ValueError unless norm[:, c] == norm[:, c + D/2] for every channel c (rotate_half pairing)."""
    D = norm.shape[-1]
    if D % 2 or not torch.equal(norm[..., : D // 2], norm[..., D // 2 :]):
        raise ValueError(
            "key norm must be RoPE-paired (norm[:, c] == norm[:, c + head_dim/2]) to fold into q_proj/k_proj "
            "exactly; build it with compute_key_norm(k, rope_paired=True)"
        )


@torch.no_grad()
def fold_key_norm_into_attention(attn_module: nn.Module, norm: torch.Tensor) -> None:
    """Fold norm [H_kv, D] into a Llama-style attention module's q_proj / k_proj, in place.

    k_proj rows (h, c) are divided by norm[h, c]; q_proj rows (h_q, c) of every query head of KV group h
    (h_q // (H_q / H_kv) == h) are multiplied by norm[h, c]; biases likewise. Afterwards the module produces
    q * norm and k / norm, so attention scores (and outputs) are unchanged up to rounding. The math is done in
    fp32 and stored back in the weights' dtype. The module needs q_proj, k_proj (nn.Linear), head_dim and
    config.num_attention_heads / num_key_value_heads (transformers LlamaAttention, Mistral, ...). Modules that
    normalize q/k after the projection (q_norm/k_norm, e.g. Qwen3) are rejected: the fold would not be exact.
    """
    for name in ("q_proj", "k_proj", "head_dim", "config"):
        if not hasattr(attn_module, name):
            raise ValueError(f"fold_key_norm_into_attention: module has no {name!r}; expected a Llama-style attention")
    for name in ("q_norm", "k_norm"):
        if getattr(attn_module, name, None) is not None:
            raise ValueError(
                f"fold_key_norm_into_attention: module applies {name} after the projection; folding the key norm "
                "into the projection weights would not be exact (use the cache's runtime key_norm instead)"
            )
    D = int(attn_module.head_dim)
    H_q = int(attn_module.config.num_attention_heads)
    H_kv = int(getattr(attn_module.config, "num_key_value_heads", None) or H_q)
    if tuple(norm.shape) != (H_kv, D):
        raise ValueError(
            f"fold_key_norm_into_attention: norm must be [H_kv, D] = [{H_kv}, {D}], got {list(norm.shape)}"
        )
    if H_q % H_kv:
        raise ValueError(f"fold_key_norm_into_attention: H_q={H_q} is not a multiple of H_kv={H_kv}")
    n = norm.detach().to(torch.float32)
    if not torch.isfinite(n).all() or bool((n <= 0).any()):
        raise ValueError("fold_key_norm_into_attention: norm must be finite and positive")
    check_rope_paired(n)
    q_proj, k_proj = attn_module.q_proj, attn_module.k_proj
    if q_proj.weight.shape[0] != H_q * D or k_proj.weight.shape[0] != H_kv * D:
        raise ValueError(
            f"fold_key_norm_into_attention: q_proj/k_proj output sizes {q_proj.weight.shape[0]}/"
            f"{k_proj.weight.shape[0]} do not match H_q*D={H_q * D} / H_kv*D={H_kv * D}"
        )
    k_factor = (1.0 / n).reshape(-1)  # output row h * D + c of k_proj
    q_factor = n.repeat_interleave(H_q // H_kv, dim=0).reshape(-1)  # query head h_q reads KV head h_q // group

    def scale_rows(linear: nn.Linear, factor: torch.Tensor) -> None:
        f = factor.to(linear.weight.device)
        linear.weight.copy_((linear.weight.to(torch.float32) * f[:, None]).to(linear.weight.dtype))
        if linear.bias is not None:
            linear.bias.copy_((linear.bias.to(torch.float32) * f).to(linear.bias.dtype))

    scale_rows(k_proj, k_factor)
    scale_rows(q_proj, q_factor)
