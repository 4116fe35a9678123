"""Helpers for decode_attention_fused's device-lengths form: turn exact-size operands (views of a cache's used
tokens, QuantizedLayerCache.fused_attention_operands) into capacity buffers with junk past the used part, plus the
lengths tensor. Every backend's lengths form must then equal the exact-size call: the junk (NaN scales and windows,
random codes, a NaN mask tail) proves no kernel reads a token it was not given.
"""

import torch

PARTS = ("sink", "key store", "key tail", "value store", "value tail")


def _pad_tokens(t: torch.Tensor | None, dim: int, extra: int, fill, gen) -> torch.Tensor | None:
    if t is None:
        return None
    shape = list(t.shape)
    shape[dim] = extra
    if t.dtype == torch.int32:
        junk = torch.randint(-(2**31), 2**31 - 1, shape, generator=gen, dtype=torch.int32)
    else:
        junk = torch.full(shape, fill, dtype=t.dtype)
    return torch.cat([t, junk.to(t.device)], dim=dim).contiguous()


def _pad_store(kw: dict, tensor: str, extra: int, fill, gen) -> None:
    bits, layout, G = kw[f"{tensor}_bits"], kw[f"{tensor}_layout"], kw["group_size"]
    for part in ("codes", "scales", "zeros"):
        name = f"{tensor}_{part}"
        t = kw[name]
        if layout == "rows":
            kw[name] = _pad_tokens(t, 2, extra, fill, gen)
        elif part == "codes":
            kw[name] = _pad_tokens(t, 3, extra * bits // 32, fill, gen)
        else:
            kw[name] = _pad_tokens(t, 3, extra // G, fill, gen)


def with_capacity(kw: dict, extra=(3, 64, 5, 64, 7), fill=float("nan"), seed=0) -> tuple[dict, torch.Tensor]:
    """(operands over capacity buffers, lengths int64 [5]) for exact-size operands kw (not modified).

    extra: tokens of junk appended to each part (PARTS order); a "cols" store's extra must be a multiple of G.
    A mask in kw gets junk columns up to the most tokens the buffers hold."""
    gen = torch.Generator().manual_seed(seed)
    out = dict(kw)
    device = kw["sink_keys"].device
    used = [kw["sink_keys"].shape[2], None, kw["key_tail"].shape[2], None, kw["value_tail"].shape[2]]
    for tensor, i in (("key", 1), ("value", 3)):
        codes, bits = kw[f"{tensor}_codes"], kw[f"{tensor}_bits"]
        used[i] = codes.shape[2] if kw[f"{tensor}_layout"] == "rows" else codes.shape[3] * 32 // bits
        if kw[f"{tensor}_layout"] == "cols" and extra[i] % kw["group_size"]:
            raise ValueError(f"a cols store's extra must be a multiple of G, got {extra[i]}")
        _pad_store(out, tensor, extra[i], fill, gen)
    out["sink_keys"] = _pad_tokens(kw["sink_keys"], 2, extra[0], fill, gen)
    out["sink_values"] = _pad_tokens(kw["sink_values"], 2, extra[0], fill, gen)
    out["key_tail"] = _pad_tokens(kw["key_tail"], 2, extra[2], fill, gen)
    out["value_tail"] = _pad_tokens(kw["value_tail"], 2, extra[4], fill, gen)
    if kw.get("attn_mask") is not None:
        caps = [u + e for u, e in zip(used, extra, strict=True)]
        n_cap = caps[0] + min(caps[1] + caps[2], caps[3] + caps[4])
        out["attn_mask"] = _pad_tokens(kw["attn_mask"], 3, n_cap - kw["attn_mask"].shape[3], fill, gen)
    return out, torch.tensor(used, dtype=torch.int64, device=device)
