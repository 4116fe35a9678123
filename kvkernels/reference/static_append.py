"""Reference of static_append: a decode step's append into a static cache (kvkernels.static_cache), as fixed-shape
PyTorch ops that read no token count on the host.

The cache is the operand set of decode_attention_fused's lengths= form: a sink [B, H, W, D], per tensor a quantized
store (layout "rows" or "cols", capacity `cap` tokens) and an fp16 tail [B, H, tail_cap, D], and lengths = int64 [5]
(S, key store, key tail, value store, value tail) on the device. Appending n tokens k / v [B, H, n, D] does what
QuantizedLayerCache.append does to the used parts:

    take = clamp(W - S, 0, n)             the first `take` tokens fill the sink at S (only while the rest is empty)
    rest = n - take                       the others join each tail at its end
    n_out = max(tail + rest - w_recent, 0) rounded down to the store's step (1 for "rows", G for "cols"):
                                          the tail's oldest n_out tokens are quantized (quantize_groups, keys divided by
                                          key_x_scale in fp32 first) into the store at its count, and leave the tail
    the counts grow accordingly.

Preconditions (no backend can check them on the host without a sync): 0 <= S <= W; a "cols" store's count is a
multiple of G; tail + n <= tail_cap (the n new tokens are written at the tail's end, those the sink takes past the
count); store count + E <= cap, where E = (tail_cap - w_recent) rounded down to the step is the most that can leave in
one step. Tails and stores as a cache leaves them meet these with room for one step. This reference quantizes the
tail's first E tokens every step into the store at its count (so it writes up to E tokens past it) and commits n_out
of them; slots past a count are never read.
Out of bounds, its index_copy_ raises (an index error on CPU, a device assert on CUDA); the CUDA kernel traps.

`slots` (StaticLayerCache passes them, made once by append_slots) are the index ranges the ops need; without them
each call makes its own.
"""

import torch

from .quant import quantize_groups


def evict_bound(tail_cap: int, w_recent: int, step: int) -> int:
    """E: the most tokens that can leave a tail of tail_cap tokens in one step."""
    return max(tail_cap - w_recent, 0) // step * step


def append_slots(n: int, w_sink: int, sides, w_recent: int, group_size: int, device) -> dict:
    """The index ranges static_append uses for n new tokens and a sink of w_sink; sides: (tail_cap, layout, bits) of
    the keys and of the values. Made once and passed in, they save a launch each per step (and made inside a CUDA
    graph capture they would hold nothing until the graph runs)."""
    out = {"step": torch.arange(n, device=device), "sink": torch.arange(w_sink, device=device), "sides": []}
    steps = []
    for tail_cap, layout, bits in sides:
        step = 1 if layout == "rows" else group_size
        E = evict_bound(tail_cap, w_recent, step)
        side = {"tail": torch.arange(tail_cap, device=device), "evict": torch.arange(E, device=device)}
        if layout == "cols":  # the quantized block's code words and groups, after the store's count
            side["words"] = torch.arange(E // 32 * bits, device=device)
            side["groups"] = torch.arange(E // group_size, device=device)
        out["sides"].append(side)
        steps.append(step)
    # made on the device (a host list copied in would be a sync, and not capturable, each call without slots)
    out["store_steps"] = torch.arange(2, device=device) * (steps[1] - steps[0]) + steps[0]
    return out


def _quantize(x, bits, G, mode, eta):
    # the dispatcher's op where the extension is built (its kernels are bit-identical to the reference's)
    if hasattr(torch.ops.kvkernels, "quantize_groups"):
        return torch.ops.kvkernels.quantize_groups.default(x, bits, G, mode, float(eta))
    return quantize_groups(x, bits, G, mode, eta)


def _quantize_into_store(src, codes_buf, scales_buf, zeros_buf, bits, G, mode, eta, layout, stored, slots):
    """Quantize src [B, H, E, D] and write it into the store at token `stored` (a 0-d device tensor)."""
    x = (src if layout == "rows" else src.transpose(2, 3)).contiguous()
    codes, scales, zeros = _quantize(x, bits, G, mode, eta)
    if layout == "rows":
        tok = stored + slots["evict"]
        codes_buf.index_copy_(2, tok, codes)
        scales_buf.index_copy_(2, tok, scales)
        if zeros_buf is not None:
            zeros_buf.index_copy_(2, tok, zeros)
    else:  # stored is a multiple of G: its first group is g0 = stored / G, its first code word g0 * G * bits / 32
        g0 = stored // G
        words = g0 * (G * bits // 32) + slots["words"]
        groups = g0 + slots["groups"]
        codes_buf.index_copy_(3, words, codes)
        scales_buf.index_copy_(3, groups, scales)
        if zeros_buf is not None:
            zeros_buf.index_copy_(3, groups, zeros)


def static_append(
    k, v, lengths, sink_keys, sink_values, key_codes, key_scales, key_zeros, value_codes, value_scales, value_zeros,
    key_tail, value_tail, key_bits, key_mode, key_layout, key_eta, value_bits, value_mode, value_layout, value_eta,
    group_size, w_recent, key_x_scale=None, *, slots=None,
) -> None:  # fmt: skip
    G = group_size
    n, W = k.shape[2], sink_keys.shape[2]
    sides = (
        (key_tail, key_codes, key_scales, key_zeros, key_bits, key_mode, key_layout, key_eta),
        (value_tail, value_codes, value_scales, value_zeros, value_bits, value_mode, value_layout, value_eta),
    )
    if slots is None:
        slots = append_slots(n, W, [(s[0].shape[2], s[6], s[4]) for s in sides], w_recent, G, k.device)
    stored, tails = lengths[1::2], lengths[2::2]  # (key store, value store), (key tail, value tail): views
    if W:
        S = lengths[0]
        take = (W - S).clamp(0, n)  # tokens that fill the sink (only while stores and tails are empty)
        rest = n - take
        if n == 1:  # slot S (if any) takes the token, broadcast by where(); if it did, the token also goes to the
            # tail below, past the tail's count, where nothing reads it
            fresh = slots["sink"] == S
            sink_keys.copy_(torch.where(fresh[:, None], k, sink_keys))
            sink_values.copy_(torch.where(fresh[:, None], v, sink_values))
        else:  # sink slot j takes token j - S when 0 <= j - S < take; as j < W, j - S < take iff j - S < n
            src_idx = slots["sink"] - S
            clamped = src_idx.clamp(0, n - 1)
            fresh = clamped == src_idx
            sink_keys.copy_(torch.where(fresh[:, None], k.index_select(2, clamped), sink_keys))
            sink_values.copy_(torch.where(fresh[:, None], v.index_select(2, clamped), sink_values))
            src = (take + slots["step"]).clamp(max=n - 1)  # the tail's tokens: those after the sink's
            k, v = k.index_select(2, src), v.index_select(2, src)
    else:
        rest = n
    # the new tokens at each tail's end: the n - rest slots past those that really go there lie past the count
    at = tails[:, None] + slots["step"]  # [2, n]
    key_tail.index_copy_(2, at[0], k)
    value_tail.index_copy_(2, at[1], v)
    store_steps = slots["store_steps"]
    n_out = (tails + rest - w_recent).clamp(min=0) // store_steps * store_steps
    for i, (tail, codes, scales, zeros, bits, mode, layout, eta) in enumerate(sides):
        side = slots["sides"][i]
        E = side["evict"].shape[0]
        if E:
            oldest = tail[:, :, :E]
            if i == 0 and key_x_scale is not None:
                oldest = oldest / key_x_scale[None, :, None, :]  # fp32, one division: the stored keys
            _quantize_into_store(oldest, codes, scales, zeros, bits, G, mode, eta, layout, stored[i], side)
            shifted = (side["tail"] + n_out[i]).clamp(max=tail.shape[2] - 1)
            tail.copy_(tail.index_select(2, shifted))
    stored.add_(n_out)  # in place, after every read of the counts above
    tails.add_(rest - n_out)
    if W:
        lengths[0].add_(take)
