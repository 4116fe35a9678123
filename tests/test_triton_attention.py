"""Triton decode_attention_fused (triton_kernels/decode_attention.py) against the reference (its spec).

Runs on CPU under TRITON_INTERPRET=1 (how CI tests it) or on a CUDA GPU. Inputs are built two ways: synthetic stores
(ops.quantize_groups on random data, placed as narrowed views of garbage-filled buffers) over a list of combined
cases (layout pair x bits x modes x key_x_scale x sink x tails x store offsets x splits x T x GQA x D x G x window
dtype x mask), and real layer caches (formats.make_layer_cache with small windows, grown past their capacity so the
stores are narrowed views with real row strides). Every result must match to rounding: the kernel dequantizes and
multiplies in fp32, so only the summation order and the split-KV merge differ from the reference.
"""

import dataclasses
import importlib

import pytest
import torch
from device_lengths import with_capacity
from triton_helpers import DEVICE, DTYPES, TRITON_MARK, gen, place, seed_for, tk

from kvkernels import ops, reference
from kvkernels.formats import PRESETS, make_layer_cache

pytestmark = TRITON_MARK

# |triton - reference| <= RTOL |reference| + ATOL max|V| (the output is a convex combination of the values)
RTOL, ATOL = 1e-4, 1e-5
LAYOUTS = {"innerq": ("rows", "cols"), "kivi": ("cols", "rows"), "rows": ("rows", "rows"), "cols": ("cols", "cols")}
FMIN = torch.finfo(torch.float32).min


def _store(B, H_kv, m, D, bits, G, mode, layout, seed):
    """A quantized store of m tokens (ops.quantize_groups on random data). Hybrid gets shifted tokens (asym wins)
    and a constant group (asym with s == 0, stored as -0.0) so both branches and the sign-bit rule occur."""
    w = torch.randn(B, H_kv, m, D, generator=gen(seed))
    if mode == "hybrid" and m:
        w[:, :, ::3] += 3.0
        w[:, :, -1, :G] = 1.25
        w[:, :, :G, -1] = -0.5
    src = w if layout == "rows" else w.transpose(2, 3).contiguous()
    codes, scales, zeros = ops.quantize_groups(src, bits, G, mode)
    return codes, scales, None if mode == "sym" else zeros


def _mask(kind, B, H_q, T, N, seed):
    """None (causal), "add" (random additive fp32 with -inf entries, broadcast over heads) or "bool" (a bool mask
    turned into 0 / finfo.min as kvkernels.attention does, broadcast over the batch, one row fully masked)."""
    if kind == "causal":
        return None
    g = gen(seed)
    if kind == "add":
        mask = torch.randn(B, 1, T, N, generator=g)
        mask[torch.rand(B, 1, T, N, generator=g) < 0.3] = float("-inf")
        mask[..., -1] = 0.0  # every row keeps a token
        return mask
    keep = torch.rand(1, H_q, T, N, generator=g) < 0.6
    keep[..., 0] = True
    keep[0, H_q - 1, T - 1] = False  # a fully masked row: uniform average, not NaN
    return torch.zeros(keep.shape).masked_fill(~keep, FMIN)


def _check(y, want, v_all):
    y, want = y.cpu(), want.cpu()
    assert y.shape == want.shape and y.dtype == torch.float32
    assert torch.isfinite(y).all()
    tol = RTOL * want.abs() + ATOL * v_all.abs().max()
    bad = (y - want).abs() > tol
    assert not bad.any(), f"max |diff| {(y - want).abs().max():.3g}, {int(bad.sum())} bad of {bad.numel()}"


def _values(args):
    """All N values (fp32) of a call's args, for the tolerance's scale."""
    a = args
    v_store = reference.attention.store_tokens(
        a["value_codes"], a["value_scales"], a["value_zeros"], a["value_bits"], a["group_size"], a["value_mode"],
        a["value_layout"],
    )  # fmt: skip
    return torch.cat([a["sink_values"].cpu().float(), v_store.cpu(), a["value_tail"].cpu().float()], dim=2)


def _run(x, args, mask, split_tokens):
    want = reference.decode_attention_fused(x.cpu(), **{k: _cpu(v) for k, v in args.items()}, attn_mask=mask,
                                            split_tokens=split_tokens)  # fmt: skip
    dev_mask = None if mask is None else mask.to(DEVICE)
    y = tk.decode_attention_fused(x.to(DEVICE), **args, attn_mask=dev_mask, split_tokens=split_tokens)
    return y, want


def _cpu(v):
    return v.cpu() if isinstance(v, torch.Tensor) else v


# ---------------------------------------------------------------------------------------------------------
# synthetic stores

# id: (layouts, key bits/mode, value bits/mode, key_x_scale, S, mk, mv, key tail, T, H_q, H_kv, D, G, dtype, mask,
#      split_tokens, strided). N = S + mk + key tail; the value tail is N - S - mv. B = 2.
CASES = {
    # InnerQ: values lag keys (their window leaves in whole groups), key_x_scale, chunks of one group
    "innerq-k3sym-v2hyb-xs-S5-T3-gqa3-fp32-causal-splitG": (
        "innerq", (3, "sym"), (2, "hybrid"), True, 5, 70, 64, 10, 3, 6, 2, 64, 32, "fp32", "causal", 32, True),
    "innerq-k4asym-v1sym-S0-T1-D128-fp16-add-split2G": (
        "innerq", (4, "asym"), (1, "sym"), False, 0, 33, 64, 40, 1, 2, 2, 128, 32, "fp16", "add", 64, False),
    "innerq-k1hyb-v4hyb-xs-S1-T3-gqa3-G64-bf16-bool-planned": (
        "innerq", (1, "hybrid"), (4, "hybrid"), True, 1, 64, 64, 7, 3, 6, 2, 64, 64, "bf16", "bool", 0, True),
    "innerq-k2hyb-v3asym-xs-S5-T1-gqa3-D128-G64-fp32-causal-planned": (
        "innerq", (2, "hybrid"), (3, "asym"), True, 5, 100, 128, 30, 1, 6, 2, 128, 64, "fp32", "causal", 0, False),
    "innerq-k3asym-v2sym-S0-T3-fp16-bool-splitG-tail0": (
        "innerq", (3, "asym"), (2, "sym"), False, 0, 96, 96, 0, 3, 2, 2, 64, 32, "fp16", "bool", 32, False),
    "innerq-k4sym-v4asym-xs-S1-T1-gqa3-bf16-add-split2G-G64": (
        "innerq", (4, "sym"), (4, "asym"), True, 1, 129, 128, 3, 1, 6, 2, 128, 64, "bf16", "add", 128, True),
    # KIVI: keys in whole groups (cols), values per token (rows): value store ahead of or behind the keys
    "kivi-b2-S0-T3-gqa3-fp16-causal-planned": (
        "kivi", (2, "asym"), (2, "asym"), False, 0, 64, 100, 40, 3, 6, 2, 64, 32, "fp16", "causal", 0, True),
    "kivi-b4-b3-S5-T1-D128-G64-bf16-add-splitG": (
        "kivi", (4, "asym"), (3, "asym"), False, 5, 128, 130, 5, 1, 2, 2, 128, 64, "bf16", "add", 64, False),
    "kivi-b1-b2-S1-T3-gqa3-fp32-bool-split2G-vstore0": (
        "kivi", (1, "asym"), (2, "asym"), False, 1, 32, 0, 20, 3, 6, 2, 64, 32, "fp32", "bool", 64, True),
    "kivi-b3-b1-S0-T1-fp32-causal-splitG-vlags": (
        "kivi", (3, "asym"), (1, "asym"), False, 0, 96, 50, 33, 1, 2, 2, 64, 32, "fp32", "causal", 32, False),
    "kivi-b2-b4-S5-T3-D128-G64-fp16-causal-planned-tail0": (
        "kivi", (2, "asym"), (4, "asym"), False, 5, 64, 64, 0, 3, 6, 2, 128, 64, "fp16", "causal", 0, True),
    # the other two layout pairs (all modes are legal there too)
    "rows-k2sym-v3hyb-xs-S5-T3-bf16-causal-splitG": (
        "rows", (2, "sym"), (3, "hybrid"), True, 5, 37, 45, 20, 3, 2, 2, 64, 32, "bf16", "causal", 32, True),
    "cols-k3hyb-v1asym-S1-T1-gqa3-D128-fp32-add-planned": (
        "cols", (3, "hybrid"), (1, "asym"), False, 1, 64, 96, 40, 1, 6, 2, 128, 32, "fp32", "add", 0, False),
    "cols-k4sym-v2sym-D48-S0-T3-fp16-causal-splitG": (
        "cols", (4, "sym"), (2, "sym"), True, 0, 32, 64, 40, 3, 2, 2, 48, 32, "fp16", "causal", 32, True),
    # degenerate token ranges: empty stores, everything in the sink, one token
    "innerq-empty-stores-S5-T3-fp32-causal": (
        "innerq", (3, "sym"), (2, "sym"), True, 5, 0, 0, 20, 3, 6, 2, 64, 32, "fp32", "causal", 32, False),
    "kivi-sink-only-S5-T3-fp16-bool": (
        "kivi", (2, "asym"), (2, "asym"), False, 5, 0, 0, 0, 3, 2, 2, 64, 32, "fp16", "bool", 0, False),
    "innerq-one-token-T1-fp32": (
        "innerq", (3, "sym"), (2, "sym"), False, 0, 1, 0, 0, 1, 2, 2, 64, 32, "fp32", "causal", 0, False),
    # more query rows than one program holds (row blocks): GQA 8 x T 9 = 72 rows
    "innerq-rowblocks-gqa8-T9-fp16-causal-splitG": (
        "innerq", (2, "asym"), (2, "hybrid"), True, 1, 40, 32, 20, 9, 8, 1, 64, 32, "fp16", "causal", 32, False),
}  # fmt: skip


def _case_inputs(name):
    pair, (kb, km), (vb, vm), use_xs, S, mk, mv, ntk, T, H_q, H_kv, D, G, dt, mask_kind, split, strided = CASES[name]
    x, args, N = _synthetic(seed_for(name), pair, kb, km, vb, vm, use_xs, S, mk, mv, ntk, T, H_q, H_kv, D, G, dt,
                            strided)  # fmt: skip
    return x, args, N, mask_kind, split


def _synthetic(seed, pair, kb, km, vb, vm, use_xs, S, mk, mv, ntk, T, H_q, H_kv, D, G, dt, strided, B=2):
    klay, vlay = LAYOUTS[pair]
    N = S + mk + ntk
    ntv = N - S - mv
    assert ntv >= 0 and 1 <= T <= N
    dtype = DTYPES[dt]
    x = torch.randn(B, H_q, T, D, generator=gen(seed)) * 0.5
    kc, ks, kz = _store(B, H_kv, mk, D, kb, G, km, klay, seed + 1)
    vc, vs, vz = _store(B, H_kv, mv, D, vb, G, vm, vlay, seed + 2)
    win = [torch.randn(B, H_kv, n, D, generator=gen(seed + 3 + i)).to(dtype) for i, n in enumerate((S, S, ntk, ntv))]
    tensors = {
        "sink_keys": win[0], "sink_values": win[1], "key_codes": kc, "key_scales": ks, "key_zeros": kz,
        "value_codes": vc, "value_scales": vs, "value_zeros": vz, "key_tail": win[2], "value_tail": win[3],
    }  # fmt: skip
    args = {k: None if t is None else place(t, strided, seed + 10 + i) for i, (k, t) in enumerate(tensors.items())}
    args.update(key_bits=kb, key_mode=km, key_layout=klay, value_bits=vb, value_mode=vm, value_layout=vlay)
    args.update(group_size=G, key_x_scale=None)
    if use_xs:
        args["key_x_scale"] = place(torch.rand(H_kv, D, generator=gen(seed + 20)) + 0.5, strided, seed + 21)
    return x, args, N


@pytest.mark.parametrize("name", CASES)
def test_decode_attention_fused(name):
    x, args, N, mask_kind, split = _case_inputs(name)
    B, H_q, T, _ = x.shape
    mask = _mask(mask_kind, B, H_q, T, N, seed_for(name) + 99)
    y, want = _run(x, args, mask, split)
    _check(y, want, _values(args))
    if split:  # several chunks: merged in a fixed order, so run-to-run identical
        y2 = tk.decode_attention_fused(x.to(DEVICE), **args, attn_mask=None if mask is None else mask.to(DEVICE),
                                       split_tokens=split)  # fmt: skip
        assert torch.equal(y, y2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_q_scale_and_out_dtype(dtype):
    """q in fp16 / bf16 with its softmax scale, the result in q's dtype (as kvkernels.decode_attention calls it):
    the fp32 path's result rounded once, up to the fp32 path's own tolerance. Two chunks, so both the direct write
    and the merge's write take the output dtype."""
    name = "innerq-k3sym-v2hyb-xs-S5-T3-gqa3-fp32-causal-splitG"
    x, args, N, _, _ = _case_inputs(name)
    q, s = (x * 8).to(dtype), 0.125
    for split in (32, 1024):
        want = reference.decode_attention_fused(q.to(torch.float32) * s, **args, split_tokens=split)
        y = tk.decode_attention_fused(q.to(DEVICE), **{k: v for k, v in args.items()}, split_tokens=split,
                                      q_scale=s, out_dtype=dtype)  # fmt: skip
        assert y.dtype == dtype
        y, want = y.cpu().float(), want.cpu()
        ulp = 2.0 ** (-8 if dtype == torch.bfloat16 else -11)  # half an ulp: the one rounding of the output
        tol = (RTOL + ulp) * want.abs() + ATOL * _values(args).abs().max()
        assert ((y - want).abs() <= tol).all(), f"max |diff| {(y - want).abs().max():.3g}"


def test_split_tokens_change_rounding_only():
    """One case under every chunking: G, 2G, 3G, planned, one chunk holding everything."""
    name = "innerq-k3sym-v2hyb-xs-S5-T3-gqa3-fp32-causal-splitG"
    x, args, N, _, _ = _case_inputs(name)
    outs = [_run(x, args, None, split)[0].cpu() for split in (32, 64, 96, 0, 1024)]
    for y in outs[1:]:
        torch.testing.assert_close(y, outs[0], rtol=1e-5, atol=1e-6)


def test_fully_finfo_min_row_averages_uniformly():
    """Every entry of a row at finfo.min (a bool mask with nothing to attend): the uniform average of the values,
    across split boundaries too."""
    x, args, N = _synthetic(7, "kivi", 2, "asym", 2, "asym", False, 5, 64, 64, 20, 2, 2, 2, 64, 32, "fp32", False)
    mask = torch.zeros(2, 2, 2, N)
    mask[1, 0, 1] = FMIN
    v = _values(args)
    for split in (32, 0):
        y, want = _run(x, args, mask, split)
        _check(y, want, v)
        torch.testing.assert_close(y[1, 0, 1].cpu(), v[1, 0].mean(0), rtol=1e-5, atol=1e-5)


def test_chunk_with_every_score_masked():
    """A chunk where a row sees no token (causal: the last chunk holds only tokens after row 0; an additive mask
    that is -inf over a whole chunk) contributes nothing, with no NaN from (-inf) - (-inf)."""
    x, args, N = _synthetic(11, "innerq", 3, "sym", 2, "asym", True, 2, 50, 32, 16, 3, 2, 1, 64, 32, "fp32", False)
    assert (N - 2) % 32 == 2  # chunks of 32 after the sink: the last one holds the last 2 tokens
    v = _values(args)
    y, want = _run(x, args, None, 32)
    _check(y, want, v)
    mask = torch.zeros(2, 1, 3, N)
    mask[:, :, 1, : 2 + 32] = float("-inf")  # row 1: nothing in chunk 0 (sink included)
    mask[1, :, 2, 2 + 32 :] = float("-inf")  # row 2 of batch 1: nothing after chunk 0
    for split in (32, 64):
        y, want = _run(x, args, mask, split)
        _check(y, want, v)


# the key and value stores at every offset around a tile / group boundary (each tile picks its sources per tensor)
OFFSETS = [(0, 0), (1, 0), (31, 32), (32, 0), (33, 64), (63, 32), (64, 64), (65, 96)]


@pytest.mark.parametrize("pair", ["innerq", "kivi"])
def test_store_boundaries_every_offset(pair):
    """Rows stores of every length around 32-token tiles, against cols stores in whole groups, chunks of G."""
    for i, (m_rows, m_cols) in enumerate(OFFSETS):
        mk, mv = (m_rows, m_cols) if pair == "innerq" else (m_cols, m_rows)
        S = i % 3 * 2
        ntk = 100 - mk
        x, args, N = _synthetic(100 + i, pair, 2, "asym", 3, "sym", i % 2 == 0, S, mk, mv, ntk, 2, 2, 1, 64, 32,
                                "fp16", i % 2 == 1, B=1)  # fmt: skip
        y, want = _run(x, args, None, 32)
        _check(y, want, _values(args))


@pytest.mark.slow
@pytest.mark.parametrize("pair", ["innerq", "kivi", "rows", "cols"])
def test_store_boundaries_sweep(pair):
    """Every store length 0 .. 2G (rows) against every group count (cols), with sinks and tails."""
    klay, vlay = LAYOUTS[pair]
    G = 32
    for mr in range(0, 2 * G + 2):
        for mc in (0, G, 2 * G):
            mk = mr if klay == "rows" else mc
            mv = mr if vlay == "rows" else mc
            if klay == vlay:
                mv = (mv + 7) if klay == "rows" else mv
            S = mr % 4
            ntk = max(mk, mv) + 3 - mk
            x, args, N = _synthetic(mr * 7 + mc, pair, 1 + mr % 4, "hybrid", 1 + mc % 3, "asym", mr % 2 == 0, S, mk,
                                    mv, ntk, 2, 2, 1, 64, G, "fp32", True, B=1)  # fmt: skip
            y, want = _run(x, args, None, G)
            _check(y, want, _values(args))


def test_planned_split_reaches_several_chunks():
    da = importlib.import_module("kvkernels.triton_kernels.decode_attention")
    per = da.plan_split_tokens(300, 32, 32, 4, torch.device("cpu"))
    assert per % 32 == 0 and -(-300 // per) > 1
    assert da.tile_tokens(32, 128) == 32 and da.tile_tokens(64, 64) == 64 and da.tile_tokens(96, 64) == 32


def test_empty_batch():
    x, args, N = _synthetic(3, "innerq", 2, "sym", 2, "sym", False, 1, 32, 32, 3, 1, 2, 2, 64, 32, "fp32", False)
    args = {k: v[:0] if isinstance(v, torch.Tensor) and k != "key_x_scale" else v for k, v in args.items()}
    y = tk.decode_attention_fused(x[:0].to(DEVICE), **args)
    assert y.shape == (0, 2, 1, 64)


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU tensors are rejected only without the interpreter")
def test_rejects_cpu_tensors_without_interpreter(monkeypatch):
    common = importlib.import_module("kvkernels.triton_kernels._common")
    x, args, N = _synthetic(5, "kivi", 2, "asym", 2, "asym", False, 0, 32, 32, 3, 1, 2, 2, 64, 32, "fp32", False)
    monkeypatch.setattr(common, "INTERPRETED", False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        tk.decode_attention_fused(x, **args)


# ---------------------------------------------------------------------------------------------------------
# device lengths (static caches): capacity buffers with junk past the used tokens (NaN windows, scales and mask
# columns, random codes), the counts in an int64 tensor; the launch is planned for the capacities, so with large
# extras many splits start past N and must write an empty partial the merge ignores

LENGTH_CASES = {
    # case in CASES, extra tokens per part (sink, key store, key tail, value store, value tail), split_tokens
    "innerq-xs-gqa3-splitG": ("innerq-k3sym-v2hyb-xs-S5-T3-gqa3-fp32-causal-splitG", (3, 64, 5, 64, 7), 32),
    "innerq-add-planned-long-tails": ("innerq-k4asym-v1sym-S0-T1-D128-fp16-add-split2G", (2, 40, 300, 64, 250), 0),
    "kivi-bool-splitG-many-empty": ("kivi-b1-b2-S1-T3-gqa3-fp32-bool-split2G-vstore0", (4, 96, 200, 17, 300), 32),
    "cols-G64-planned": ("innerq-k1hyb-v4hyb-xs-S1-T3-gqa3-G64-bf16-bool-planned", (0, 3, 9, 128, 70), 0),
    "empty-stores-sink-only": ("kivi-sink-only-S5-T3-fp16-bool", (1, 64, 40, 32, 33), 32),
}  # fmt: skip


@pytest.mark.parametrize("name", LENGTH_CASES)
def test_device_lengths_equal_the_exact_sizes(name):
    case, extra, split = LENGTH_CASES[name]
    x, args, N, mask_kind, _ = _case_inputs(case)
    B, H_q, T, _ = x.shape
    exact = {k: _cpu(v) for k, v in args.items()}
    exact["attn_mask"] = _mask(mask_kind, B, H_q, T, N, seed_for(name))
    want = reference.decode_attention_fused(x, **exact, split_tokens=split)
    padded, lengths = with_capacity(exact, extra=extra, seed=seed_for(name))
    padded = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in padded.items()}
    y = tk.decode_attention_fused(x.to(DEVICE), **padded, split_tokens=split, lengths=lengths.to(DEVICE))
    _check(y, want, _values(args))


def test_device_lengths_out_of_range_are_clamped():
    # counts past a buffer, negative or zero cannot be checked without a sync: clamped, never read out of bounds
    x, args, N, _, _ = _case_inputs("kivi-b4-b3-S5-T1-D128-G64-bf16-add-splitG")
    exact = {k: _cpu(v) for k, v in args.items()}
    padded, lengths = with_capacity(exact, extra=(3, 64, 5, 64, 7), fill=0.0)
    padded = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in padded.items()}
    for bad in ([10**9] * 5, [-5, 3, 0, 7, 2], [1, 0, 0, 0, 0]):
        lengths = torch.tensor(bad, device=DEVICE)
        y = tk.decode_attention_fused(x.to(DEVICE), **padded, split_tokens=64, lengths=lengths)
        want = reference.decode_attention_fused(x, **{k: _cpu(v) for k, v in padded.items()}, split_tokens=64,
                                                lengths=lengths.cpu())  # fmt: skip
        torch.testing.assert_close(y.cpu(), want, rtol=1e-4, atol=1e-5, equal_nan=True)


# ---------------------------------------------------------------------------------------------------------
# real layer caches: the operands a format hands the op (narrowed views with the buffers' row strides)

REAL = {
    # preset, overrides (small windows so the stores fill), dtype, decode steps, T, H_q, mask
    "innerq_base-fp16-T1": ("innerq_base", {"w_sink": 5, "w_recent": 8}, "fp16", 3, 1, 6, "causal"),
    "innerq_hybrid-bf16-T3-bool": ("innerq_hybrid", {"w_sink": 3, "w_recent": 20}, "bf16", 5, 3, 2, "bool"),
    "innerq_asym4-fp32-T3-add": ("innerq_asym4", {"w_sink": 0, "w_recent": 8, "group_size": 64}, "fp32", 2, 3, 6,
                                 "add"),
    "kivi2-fp16-T3": ("kivi2", {"residual": 16}, "fp16", 4, 3, 6, "causal"),
    "kivi4-sink-bf16-T1-bool": ("kivi4", {"residual": 8, "w_sink": 4}, "bf16", 3, 1, 2, "bool"),
}  # fmt: skip


@pytest.mark.parametrize("name", REAL)
@pytest.mark.parametrize("groups_per_split", [1, 0])
def test_real_cache_operands(name, groups_per_split):
    preset, overrides, dt, steps, T, H_q, mask_kind = REAL[name]
    cfg = dataclasses.replace(PRESETS[preset], **overrides)
    split = groups_per_split * cfg.group_size  # chunks of one group, or planned
    B, H_kv, D = 2, 2, 64
    dtype = DTYPES[dt]
    seed = seed_for(name)
    cache = make_layer_cache(cfg, B, H_kv, D, capacity=64, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(B, H_kv, 90, D, generator=gen(seed + i)) for i in range(2))
    cache.prefill(k.to(dtype).to(DEVICE), v.to(dtype).to(DEVICE))
    for step in range(steps):  # decode steps: the stores grow past the capacity, the tails move
        kn, vn = (torch.randn(B, H_kv, 1, D, generator=gen(seed + 10 + 2 * step + i)) for i in range(2))
        cache.append(kn.to(dtype).to(DEVICE), vn.to(dtype).to(DEVICE))
    operands = cache.fused_attention_operands()
    assert operands is not None
    kc, vc = operands["key_codes"], operands["value_codes"]
    assert not (kc.is_contiguous() and vc.is_contiguous()), "the stores should be narrowed views"
    N = cache.seq_len
    x = torch.randn(B, H_q, T, D, generator=gen(seed + 50)) * 0.5
    mask = _mask(mask_kind, B, H_q, T, N, seed + 60)
    y, want = _run(x, operands, mask, split)
    _check(y, want, _values(operands))
