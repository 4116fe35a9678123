"""Fused decode attention over one layer's quantized cache in Triton: FlashDecoding-style split-KV.

    out = softmax(x K^T + mask) V    fp32 [B, H_q, T, D],   query head h reads KV head h // (H_q / H_kv)

Keys and values are each, in token order, sink [S, fp] | quantized store [m tokens, layout rows or cols] | tail
[fp]; the key store and the value store hold different token counts (kvkernels/reference/attention.py, the spec).

Grid: (B * H_kv * row blocks, splits). A program serves every query row of its KV head (the H_q / H_kv heads times
T positions, flattened to R rows as gemv_inner_q does, padded to RB >= 16 rows for tl.dot; more than MAX_ROWS rows
take several row blocks) over one split of the tokens: split 0 covers [0, S + C) (the sink joins it), split k >= 1
covers [S + kC, S + (k+1)C), C = split_tokens or planned (a multiple of G). Inside a split the program walks
token tiles of BN tokens aligned at S + multiples of BN (BN divides G, so a "cols" group never straddles a tile and
a "cols" tile lies wholly inside or outside its store). Per tile and per tensor, scalar `if`s on the tile's range
pick the sources: sink (j < S), store (S <= j < S + m), tail (j >= S + m), so a tile inside a store never loads a
window. The tile is dequantized to fp32 (store keys times key_x_scale, as the reference does) and multiplied in
fp32 (tl.dot with input_precision="ieee": exact products, fp32 sums), with an online softmax (running max m, sum
l, unnormalized output o; a tile whose scores are all -inf contributes nothing and produces no NaN).

One split: the program writes o / l. Several: it writes (m, l, o) to fp32 workspaces and _merge_kernel combines the
splits by log-sum-exp in a fixed order (deterministic). A row whose mask is finfo.min everywhere averages
uniformly (every score rounds to finfo.min), as in the reference; a row masked to -inf everywhere is NaN, also as
in the reference.
"""

import struct

import torch
import triton
import triton.language as tl

from kvkernels import _validate

from ._common import (
    check_device,
    device_ctx,
    gqa_query_rows,
    group_affine,
    next_pow2,
    num_splits,
    store_rounded,
    unpack_tile,
)

_MODES = {"sym": 0, "asym": 1, "hybrid": 2}


def _fp32(v: float) -> float:
    """v rounded to fp32 (as the reference's fp32 multiply takes a Python float): the kernel's immediate, exact."""
    return struct.unpack("f", struct.pack("f", v))[0]


# Query rows per program (the M side of both dots; more rows take several row blocks) and warps: the fp32 tiles
# ([D, BN] keys and values, [RB, D] output) need 8 warps and 16 rows at D = 128 to stay out of local memory on
# sm_80 / sm_90 (tests/triton_aot/compile_check.py); 32 rows with a mask spilled there.
MAX_ROWS = 16
MERGE_ROWS = 16  # rows of the output per merge program
DOT_PRECISION = "ieee"  # exact fp32 products (FMA, not tensor cores)
NUM_WARPS = 8


@triton.jit
def _window_into(tile, ptr, base, s_tok, jl, ok, c, c_ok, COLS: tl.constexpr):
    """tile with the tokens `ok` replaced by rows jl (window-local token indices [BN]) of a window [n, D] at base.

    COLS: the tile is channel-major [DP, BN], else token-major [BN, DP]."""
    jl64 = jl.to(tl.int64)
    if COLS:
        sel = ok[None, :]
        v = tl.load(ptr + base + jl64[None, :] * s_tok + c[:, None], mask=sel & c_ok[:, None], other=0.0)
    else:
        sel = ok[:, None]
        v = tl.load(ptr + base + jl64[:, None] * s_tok + c[None, :], mask=sel & c_ok[None, :], other=0.0)
    return tl.where(sel, v.to(tl.float32), tile)


@triton.jit
def _store_tile(codes_ptr, scales_ptr, zeros_ptr, c_base, s_base, z_base, sc_r, ss_r, sz_r, js, m, D,
                BITS: tl.constexpr, MODE: tl.constexpr, COLS: tl.constexpr, GROUP: tl.constexpr,
                BN: tl.constexpr, DP: tl.constexpr):  # fmt: skip
    """Dequantized store tokens js .. js + BN (store-local, js a multiple of BN) -> fp32, [DP, BN] for COLS (channel
    rows, groups of G tokens: the tile lies inside one group and inside the store) else [BN, DP] (token rows,
    groups of G channels; tokens >= m read as 0)."""
    c = tl.arange(0, DP)
    c_ok = c < D
    c64 = c.to(tl.int64)
    if COLS:
        u = unpack_tile(codes_ptr + c_base + c64 * sc_r, (js // 32) * BITS, c_ok, BN // 32 * BITS, BITS, BN)
        g = js // GROUP
        scale_bits = tl.load(scales_ptr + s_base + c64 * ss_r + g, mask=c_ok, other=0)  # [DP]
        if MODE == 0:
            zero = scale_bits  # unused by sym
        else:
            zero = tl.load(zeros_ptr + z_base + c64 * sz_r + g, mask=c_ok, other=0.0)
        s, zeff = group_affine(scale_bits, zero, BITS, MODE)
        val = s[:, None] * u.to(tl.float32) + zeff[:, None]
    else:
        tok = js + tl.arange(0, BN)
        tok_ok = tok < m
        tok64 = tok.to(tl.int64)
        u = unpack_tile(codes_ptr + c_base + tok64 * sc_r, 0, tok_ok, D // 32 * BITS, BITS, DP)  # [BN, DP]
        g = (c // GROUP)[None, :]
        ok = tok_ok[:, None] & c_ok[None, :]
        scale_bits = tl.load(scales_ptr + s_base + tok64[:, None] * ss_r + g, mask=ok, other=0)
        if MODE == 0:
            zero = scale_bits
        else:
            zero = tl.load(zeros_ptr + z_base + tok64[:, None] * sz_r + g, mask=ok, other=0.0)
        s, zeff = group_affine(scale_bits, zero, BITS, MODE)
        val = s * u.to(tl.float32) + zeff
    return val


@triton.jit
def _kv_tile(j0, valid, S, m, D, sink_ptr, sink_base, s_sink, codes_ptr, scales_ptr, zeros_ptr, c_base, s_base,
             z_base, sc_r, ss_r, sz_r, tail_ptr, tail_base, s_tail, xs,
             BITS: tl.constexpr, MODE: tl.constexpr, COLS: tl.constexpr, GROUP: tl.constexpr, HAS_XS: tl.constexpr,
             BN: tl.constexpr, DP: tl.constexpr):  # fmt: skip
    """Tokens j0 .. j0 + BN of one tensor (keys or values) in fp32, [DP, BN] for COLS else [BN, DP]; tokens not
    `valid` read as 0. j0 is S + a multiple of BN: a tile with j0 < S holds sink tokens only."""
    c = tl.arange(0, DP)
    c_ok = c < D
    jr = tl.arange(0, BN)
    if COLS:
        tile = tl.zeros((DP, BN), dtype=tl.float32)
    else:
        tile = tl.zeros((BN, DP), dtype=tl.float32)
    if j0 < S:
        tile = _window_into(tile, sink_ptr, sink_base, s_sink, j0 + jr, valid, c, c_ok, COLS)
    else:
        js = j0 - S
        if js < m:
            tile = _store_tile(codes_ptr, scales_ptr, zeros_ptr, c_base, s_base, z_base, sc_r, ss_r, sz_r, js, m, D,
                               BITS, MODE, COLS, GROUP, BN, DP)  # fmt: skip
            if HAS_XS:  # the stored key is K / key_x_scale
                if COLS:
                    tile = tile * xs[:, None]
                else:
                    tile = tile * xs[None, :]
        if js + BN > m:
            jt = js - m + jr
            tile = _window_into(tile, tail_ptr, tail_base, s_tail, jt, valid & (jt >= 0), c, c_ok, COLS)
    return tile


@triton.jit
def _attention_split_kernel(
    # pointers
    x_ptr,  # fp16 / bf16 / fp32 [B, H_q, T, D]: the queries, read as x * q_scale in fp32
    sk_ptr,  # window dtype [B, H_kv, S, D]
    sv_ptr,
    kc_ptr,  # int32 key store codes (rows [B, H_kv, mk, D*b/32] or cols [B, H_kv, D, mk*b/32])
    ks_ptr,  # int16 view of the fp16 key scales
    kz_ptr,  # fp16 key zeros (unused for sym)
    vc_ptr,
    vs_ptr,
    vz_ptr,
    kt_ptr,  # window dtype [B, H_kv, n_k, D]
    vt_ptr,
    xs_ptr,  # fp32 [H_kv, D] (unused unless HAS_XS)
    mask_ptr,  # fp32 [B|1, H_q|1, T, N] (unused unless HAS_MASK)
    len_ptr,  # int64 [5] tokens used of sink, key store, key tail, value store, value tail (unused unless HAS_LEN)
    out_ptr,  # out [B * H_q * T, D] in its dtype (one split; the store rounds) or the fp32 workspace o [splits, ...]
    m_ptr,  # fp32 [splits, B * H_q * T] (unused for one split)
    l_ptr,
    # sizes
    H_q,
    H_kv,
    T,
    R,  # query rows per KV head: (H_q / H_kv) * T
    n_rb,  # row blocks per KV head
    S,  # HAS_LEN: this and the next four are the buffers' capacities
    mk,
    mv,
    lk,  # key / value tail tokens (read only with HAS_LEN)
    lv,
    N,
    D,
    per_split,  # tokens per split after the sink, a multiple of BN
    n_rows,  # B * H_q * T
    # strides (elements; every last dim is contiguous; broadcast mask dims have stride 0)
    sx_b, sx_h, sx_t,
    ssk_b, ssk_h, ssk_t,
    ssv_b, ssv_h, ssv_t,
    skc_b, skc_h, skc_r,
    sks_b, sks_h, sks_r,
    skz_b, skz_h, skz_r,
    svc_b, svc_h, svc_r,
    svs_b, svs_h, svs_r,
    svz_b, svz_h, svz_r,
    skt_b, skt_h, skt_t,
    svt_b, svt_h, svt_t,
    sxs_h,
    sm_b, sm_h, sm_t,
    # meta-parameters
    KBITS: tl.constexpr,
    KMODE: tl.constexpr,  # 0 sym, 1 asym, 2 hybrid
    KCOLS: tl.constexpr,  # key store layout: True "cols", False "rows"
    VBITS: tl.constexpr,
    VMODE: tl.constexpr,
    VCOLS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_XS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_LEN: tl.constexpr,  # device lengths: the counts come from len_ptr, each clamped into its buffer
    SPLIT: tl.constexpr,  # several splits: write (m, l, o) partials, else the normalized output
    # the softmax scale, x times it in fp32 (1: x as loaded). A compile-time immediate: one model has one scale, and
    # as a runtime argument it cost D = 64's split kernel a register it did not have (24 B of spills at 255)
    Q_SCALE: tl.constexpr,
    RB: tl.constexpr,  # query rows per program, >= 16
    BN: tl.constexpr,  # tokens per tile, a multiple of 32 dividing GROUP
    DP: tl.constexpr,  # next_pow2(D), >= 32
    PREC: tl.constexpr,  # tl.dot input_precision of the fp32 operands
):  # fmt: skip
    pid = tl.program_id(0)
    sp = tl.program_id(1)
    if HAS_LEN:  # the reference's rule: clamp into [0, capacity], a "cols" store to whole groups, N the shorter side
        # (clamped in int64, then int32 as the capacities are: 64-bit counts cost the InnerQ tiles a spill on sm_90)
        S = tl.minimum(tl.maximum(tl.load(len_ptr + 0), 0), S).to(tl.int32)
        mk = tl.minimum(tl.maximum(tl.load(len_ptr + 1), 0), mk).to(tl.int32)
        lk = tl.minimum(tl.maximum(tl.load(len_ptr + 2), 0), lk).to(tl.int32)
        mv = tl.minimum(tl.maximum(tl.load(len_ptr + 3), 0), mv).to(tl.int32)
        lv = tl.minimum(tl.maximum(tl.load(len_ptr + 4), 0), lv).to(tl.int32)
        if KCOLS:
            mk = mk - mk % GROUP
        if VCOLS:
            mv = mv - mv % GROUP
        N = S + tl.minimum(mk + lk, mv + lv)
    rb = pid % n_rb
    b, h_kv, h_q, t, q_ok = gqa_query_rows(pid // n_rb, H_kv, R, T, rb * RB, RB)
    c = tl.arange(0, DP)
    c_ok = c < D
    x_rows = b * sx_b + h_q * sx_h + t * sx_t  # [RB] int64
    x = tl.load(x_ptr + x_rows[:, None] + c[None, :], mask=q_ok[:, None] & c_ok[None, :], other=0.0)  # [RB, DP]
    x = x.to(tl.float32)
    if Q_SCALE != 1.0:
        x = x * Q_SCALE
    if HAS_XS:
        xs = tl.load(xs_ptr + h_kv * sxs_h + c, mask=c_ok, other=0.0)
    else:
        xs = tl.zeros((DP,), dtype=tl.float32)  # unused
    if HAS_MASK:
        mask_rows = b * sm_b + h_q * sm_h + t * sm_t  # [RB] int64
    last = N - T + t  # [RB] the last token each row sees (causal)

    # the split's tokens: [lo, hi), tiles starting at S + multiples of BN (split 0 from the first sink tile); with
    # device lengths the splits are planned for the capacities, and one past N is empty: it writes m = -inf, l = 0
    sink_tiles = tl.where(sp == 0, (S + BN - 1) // BN, 0)
    lo = S + sp * per_split - sink_tiles * BN
    hi = tl.minimum(S + (sp + 1) * per_split, N)

    m_i = tl.full((RB,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((RB,), dtype=tl.float32)
    acc = tl.zeros((RB, DP), dtype=tl.float32)
    for j0 in range(lo, hi, BN):
        j = j0 + tl.arange(0, BN)
        valid = (j >= 0) & (j < hi)
        k = _kv_tile(
            j0, valid, S, mk, D, sk_ptr, b * ssk_b + h_kv * ssk_h, ssk_t,
            kc_ptr, ks_ptr, kz_ptr, b * skc_b + h_kv * skc_h, b * sks_b + h_kv * sks_h, b * skz_b + h_kv * skz_h,
            skc_r, sks_r, skz_r, kt_ptr, b * skt_b + h_kv * skt_h, skt_t, xs,
            KBITS, KMODE, KCOLS, GROUP, HAS_XS, BN, DP,
        )  # fmt: skip
        if KCOLS:
            kt = k  # [DP, BN]
        else:
            kt = tl.trans(k)
        s = tl.dot(x, kt, input_precision=PREC)  # [RB, BN]
        if HAS_MASK:
            am = tl.load(mask_ptr + mask_rows[:, None] + j[None, :], mask=q_ok[:, None] & valid[None, :], other=0.0)
            s = tl.where(valid[None, :], s + am, float("-inf"))
        else:
            s = tl.where(valid[None, :] & (j[None, :] <= last[:, None]), s, float("-inf"))

        # online softmax; a row whose scores so far are all -inf keeps m = -inf, l = 0, o = 0 (no -inf - -inf)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)

        v = _kv_tile(
            j0, valid, S, mv, D, sv_ptr, b * ssv_b + h_kv * ssv_h, ssv_t,
            vc_ptr, vs_ptr, vz_ptr, b * svc_b + h_kv * svc_h, b * svs_b + h_kv * svs_h, b * svz_b + h_kv * svz_h,
            svc_r, svs_r, svz_r, vt_ptr, b * svt_b + h_kv * svt_h, svt_t, xs,
            VBITS, VMODE, VCOLS, GROUP, False, BN, DP,
        )  # fmt: skip
        if VCOLS:
            vv = tl.trans(v)  # [BN, DP]
        else:
            vv = v
        acc = acc * alpha[:, None] + tl.dot(p, vv, input_precision=PREC)
        m_i = m_new

    row = (b * H_q + h_q) * T + t  # [RB] int64: the output row
    o_mask = q_ok[:, None] & c_ok[None, :]
    if SPLIT:
        ws = sp.to(tl.int64) * n_rows + row
        tl.store(out_ptr + ws[:, None] * D + c[None, :], acc, mask=o_mask)
        tl.store(m_ptr + ws, m_i, mask=q_ok)
        tl.store(l_ptr + ws, l_i, mask=q_ok)
    else:
        den = tl.where(q_ok, l_i, 1.0)  # padding rows (a real row with l 0 is NaN, as in the reference)
        store_rounded(out_ptr + row[:, None] * D + c[None, :], acc / den[:, None], o_mask)


@triton.jit
def _merge_kernel(o_ptr, m_ptr, l_ptr, out_ptr, n_rows, o_split, n_splits, D, BR: tl.constexpr, DP: tl.constexpr):
    """out = sum_s w_s o_s / sum_s w_s l_s, w_s = exp(m_s - max_s m_s), splits in order (deterministic)."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    r_ok = r < n_rows
    r64 = r.to(tl.int64)
    c = tl.arange(0, DP)
    o_mask = r_ok[:, None] & (c < D)[None, :]
    mx = tl.full((BR,), float("-inf"), dtype=tl.float32)
    mp = m_ptr + r64  # split sp's rows are n_rows further on (pointers step, no 32-bit index product)
    for _ in range(0, n_splits):
        mx = tl.maximum(mx, tl.load(mp, mask=r_ok, other=float("-inf")))
        mp += n_rows
    m_use = tl.where(mx == float("-inf"), 0.0, mx)
    den = tl.zeros((BR,), dtype=tl.float32)
    num = tl.zeros((BR, DP), dtype=tl.float32)
    mp = m_ptr + r64
    lp = l_ptr + r64
    op = o_ptr + r64[:, None] * D + c[None, :]
    for _ in range(0, n_splits):
        w = tl.exp(tl.load(mp, mask=r_ok, other=float("-inf")) - m_use)  # an empty split: exp(-inf) = 0
        den += w * tl.load(lp, mask=r_ok, other=0.0)
        num += w[:, None] * tl.load(op, mask=o_mask, other=0.0)
        mp += n_rows
        lp += n_rows
        op += o_split
    den = tl.where(r_ok, den, 1.0)  # padding rows (a real row with den 0 is NaN, as in the reference)
    store_rounded(out_ptr + r64[:, None] * D + c[None, :], num / den[:, None], o_mask)


def tile_tokens(group_size: int, head_dim: int) -> int:
    """BN: tokens per tile, a multiple of 32 dividing the group size (64 where it fits the registers)."""
    return 64 if group_size % 64 == 0 and head_dim <= 64 else 32


MAX_SPLITS = 65535  # CUDA's limit on grid dimension 1 (the CUDA launcher doubles C the same way)


def plan_split_tokens(rest: int, group_size: int, bn: int, base_programs: int, device: torch.device) -> int:
    """Tokens per split after the sink (split_tokens=0): enough splits to give the GPU a few programs per SM,
    never fewer than MIN_ITERS_PER_SPLIT tiles per split; a multiple of G. The interpreter plans as for one base
    program (4 splits where the tokens allow), so tests reach the merge."""
    n_tiles = triton.cdiv(max(rest, 1), bn)
    splits = num_splits(base_programs if device.type == "cuda" else 1, n_tiles, device)
    return triton.cdiv(triton.cdiv(max(rest, 1), splits), group_size) * group_size


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
    """softmax(x' K^T + mask) V over one layer's sink | quantized store | tail, x' = x.to(fp32) * q_scale: [B, H_q,
    T, D] in out_dtype (default fp32; module docstring; spec kvkernels/reference/attention.py). lengths= (int64 [5]
    on the device): the parts are capacity buffers, each program reads the counts, and the launch depends on the
    capacities alone (CUDA-graph replayable)."""
    args = (
        x, sink_keys, sink_values, key_codes, key_scales, key_zeros, value_codes, value_scales, value_zeros,
        key_tail, value_tail, key_bits, key_mode, key_layout, value_bits, value_mode, value_layout, group_size,
        key_x_scale, attn_mask, split_tokens, lengths, q_scale, out_dtype,
    )  # fmt: skip
    _validate.check_decode_attention_fused(*args)
    check_device("decode_attention_fused", x)
    B, H_q, T, D = x.shape
    H_kv, S = sink_keys.shape[1], sink_keys.shape[2]
    mk = _validate.store_token_count(key_codes, key_bits, key_layout)
    mv = _validate.store_token_count(value_codes, value_bits, value_layout)
    lk, lv = key_tail.shape[2], value_tail.shape[2]
    # with lengths these are capacities and N the most tokens the buffers hold: the plan below depends on them alone
    N = S + min(mk + lk, mv + lv)
    odt = out_dtype or torch.float32
    if B * H_q * T * D == 0:
        return torch.zeros((B, H_q, T, D), dtype=odt, device=x.device)

    R = (H_q // H_kv) * T
    rb = min(MAX_ROWS, max(16, next_pow2(R)))
    n_rb = triton.cdiv(R, rb)
    dp = max(32, next_pow2(D))
    bn = tile_tokens(group_size, dp)
    rest = N - S
    per_split = split_tokens or plan_split_tokens(rest, group_size, bn, B * H_kv * n_rb, x.device)
    while triton.cdiv(rest, per_split) > MAX_SPLITS:  # grid dim 1's limit: a caller's tiny split_tokens at 2M tokens
        per_split *= 2
    splits = max(1, triton.cdiv(rest, per_split))
    n_rows = B * H_q * T

    out = torch.empty((B, H_q, T, D), dtype=odt, device=x.device)
    if splits > 1:
        o_ws = torch.empty((splits, n_rows, D), dtype=torch.float32, device=x.device)
        m_ws = torch.empty((splits, n_rows), dtype=torch.float32, device=x.device)
        l_ws = torch.empty_like(m_ws)
    else:
        o_ws, m_ws, l_ws = out, out, out  # the normalized output directly; m / l never written
    kz = key_zeros if key_zeros is not None else key_scales  # sym never reads it
    vz = value_zeros if value_zeros is not None else value_scales
    xs = key_x_scale if key_x_scale is not None else x  # placeholder pointer, never read
    mask = attn_mask if attn_mask is not None else x
    if attn_mask is not None:
        sm = (
            attn_mask.stride(0) if attn_mask.shape[0] > 1 else 0,
            attn_mask.stride(1) if attn_mask.shape[1] > 1 else 0,
            attn_mask.stride(2),
        )
    else:
        sm = (0, 0, 0)
    with device_ctx(x):
        _attention_split_kernel[(B * H_kv * n_rb, splits)](
            x, sink_keys, sink_values,
            key_codes, key_scales.view(torch.int16), kz, value_codes, value_scales.view(torch.int16), vz,
            key_tail, value_tail, xs, mask, lengths if lengths is not None else x, o_ws, m_ws, l_ws,
            H_q, H_kv, T, R, n_rb, S, mk, mv, lk, lv, N, D, per_split, n_rows,
            *x.stride()[:3], *sink_keys.stride()[:3], *sink_values.stride()[:3],
            *key_codes.stride()[:3], *key_scales.stride()[:3], *kz.stride()[:3],
            *value_codes.stride()[:3], *value_scales.stride()[:3], *vz.stride()[:3],
            *key_tail.stride()[:3], *value_tail.stride()[:3], xs.stride(0), *sm,
            KBITS=key_bits, KMODE=_MODES[key_mode], KCOLS=key_layout == "cols",
            VBITS=value_bits, VMODE=_MODES[value_mode], VCOLS=value_layout == "cols",
            GROUP=group_size, HAS_XS=key_x_scale is not None, HAS_MASK=attn_mask is not None,
            HAS_LEN=lengths is not None,
            SPLIT=splits > 1, RB=rb, BN=bn, DP=dp, PREC=DOT_PRECISION, Q_SCALE=_fp32(q_scale),
            num_warps=NUM_WARPS,
        )  # fmt: skip
        if splits > 1:
            _merge_kernel[(triton.cdiv(n_rows, MERGE_ROWS),)](
                o_ws, m_ws, l_ws, out, n_rows, n_rows * D, splits, D, BR=MERGE_ROWS, DP=dp
            )  # fmt: skip
    return out
