"""The layer-cache machinery every format shares (kvkernels.formats.base), run over each format's configs: window
bookkeeping, growth, exact windows, stores vs independent quantization, memory accounting, batch / crop edits.
Format-specific behaviour is in test_format_<name>.py."""

import pytest
import torch
from cache_helpers import expected_counts, kv, make_cache

import kvkernels
from kvkernels.cache import ModelKVCache
from kvkernels.formats import (
    MODES,
    PRESETS,
    InnerQConfig,
    InnerQLayerCache,
    KIVIConfig,
    KIVILayerCache,
    effective_bits,
    format_of,
)

SMALL_INNERQ = InnerQConfig(key_bits=3, value_bits=2, value_mode="hybrid", w_sink=4, w_recent=8)
SMALL_KIVI = KIVIConfig(bits=2, residual=8, w_sink=4, eta=0.1)


CONFIGS = {"innerq": PRESETS["innerq_base"], "kivi": PRESETS["kivi2"], "innerq_small_w": SMALL_INNERQ}
CONFIGS["kivi_sink_small_w"] = SMALL_KIVI


# ---------------------------------------------------------------------------------------------------------
# window bookkeeping


@pytest.mark.parametrize("N", [0, 5, 40, 200])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_window_bookkeeping_over_appends(name, N):
    config = CONFIGS[name]
    D = 32
    chunks = [1] * 40 + [3, 7, 1, 32, 5, 1, 1, 64, 2] + [1] * 10
    k, v = kv(1, 1, N + sum(chunks), D)
    c = make_cache(config, H=1, D=D, capacity=16)
    c.prefill(k[:, :, :N], v[:, :, :N])
    assert c.token_counts() == expected_counts(config, N)
    pos = N
    for n in chunks:
        c.append(k[:, :, pos : pos + n], v[:, :, pos : pos + n])
        pos += n
        assert c.token_counts() == expected_counts(config, pos), (pos, n)
        assert c.seq_len == pos
    # bounds from the module docstring
    G = config.group_size
    counts = c.token_counts()
    one, whole = ("key", "value") if format_of(config).key_layout == "rows" else ("value", "key")
    w = config.w_recent
    assert counts[f"{one}_tail"] == w and w <= counts[f"{whole}_tail"] < w + G
    K, V = c.dequantized()
    assert K.shape == V.shape == (1, 1, pos, D)


def test_prefill_quantizes_outside_the_windows_at_once():
    c = make_cache(PRESETS["innerq_base"], D=32)
    k, v = kv(1, 2, 200, 32)
    c.prefill(k, v)  # 168 after the sink: 72 keys leave, values only the 64 of whole groups
    assert c.token_counts() == dict(
        sink=32, key_quantized=72, key_tail=96, value_quantized=64, value_tail=104, total=200
    )
    c = make_cache(PRESETS["kivi2"], D=32)
    c.prefill(k, v)  # KIVI: keys leave in groups (64 of 72), values one by one
    assert c.token_counts() == dict(
        sink=0, key_quantized=64, key_tail=136, value_quantized=72, value_tail=128, total=200
    )


@pytest.mark.parametrize("name", ["innerq", "kivi"])
def test_prefill_equals_token_by_token_appends(name):
    # with a fixed key norm, the stores do not depend on how the tokens arrived
    config = CONFIGS[name]
    k, v = kv(1, 2, 230, 64)
    kw = {"key_norm_factors": torch.rand(2, 64) + 0.5} if name == "innerq" else {}
    a, b = make_cache(config, **kw), make_cache(config, **kw)
    a.prefill(k, v)
    b.prefill(k[:, :, :3], v[:, :, :3])
    for i in range(3, 230):
        b.append(k[:, :, i : i + 1], v[:, :, i : i + 1])
    assert a.token_counts() == b.token_counts()
    for x, y in zip(a.dequantized(), b.dequantized(), strict=True):
        assert torch.equal(x, y)


def test_capacity_grows_by_doubling_and_appends_never_copy():
    c = make_cache(SMALL_INNERQ, D=32, capacity=0)
    k, v = kv(1, 2, 300, 32)
    c.prefill(k[:, :, :20], v[:, :, :20])
    ks, vs = c.key_store, c.value_store
    # keys ("rows") grow by G tokens; values ("cols", tokens along the packed dim) by 128, so every row of codes is
    # whole 16-byte words (the CUDA GEMV's vector loads need that)
    assert ks.cap == 32 and vs.cap == 128
    ptr = ks.codes.data_ptr()
    seen_caps = {32}
    for i in range(20, 300):
        before = c.dequantized()
        stable = c.n_sink + min(ks.n, vs.n)  # sink + tokens quantized in both stores stay bit-identical
        old_cap, old_ptr = ks.cap, ks.codes.data_ptr()
        c.append(k[:, :, i : i + 1], v[:, :, i : i + 1])
        if ks.cap == old_cap:
            assert ks.codes.data_ptr() == old_ptr  # written in place, no copy
        else:
            assert ks.cap == 2 * old_cap
        seen_caps.add(ks.cap)
        after = c.dequantized()
        for x, y in zip(before, after, strict=True):  # what was there is untouched by the append / growth
            assert torch.equal(x[:, :, :stable], y[:, :, :stable])
    assert seen_caps == {32, 64, 128, 256, 512} and ks.codes.data_ptr() != ptr
    assert vs.cap >= vs.n and vs.cap % 128 == 0 and vs.codes.stride(-2) % 4 == 0
    # a chunk larger than twice the capacity grows straight to what it needs
    c2 = make_cache(PRESETS["kivi2"], D=32, capacity=0)
    c2.prefill(*kv(1, 2, 700, 32))
    assert c2.key_store.cap >= c2.key_store.n == 544 and c2.value_store.cap >= 572
    assert c2.key_store.cap % 128 == 0 and c2.key_store.codes.stride(-2) % 4 == 0


def test_store_views_follow_every_change_of_the_store():
    # views() of all used tokens are kept between calls (host time of a decode step); every change of the store's
    # length or buffers must give fresh ones: writes, truncation, growth, batch edits
    from kvkernels.formats.base import QuantStore

    for layout, step in (("rows", 1), ("cols", 32)):
        st = QuantStore(layout, 2, 32, "sym", 0.0, 2, 1, 64, 64, "cpu")
        x = torch.randn(2, 1, 200, 64)

        def check(st=st, layout=layout):
            c, s, z = st.views()
            assert z is None
            if layout == "rows":
                assert c.shape[2] == st.n and s.shape[2] == st.n
                assert c.data_ptr() == st.codes.data_ptr() and s.data_ptr() == st.scales.data_ptr()
            else:
                assert c.shape[-1] == st.n * 2 // 32 and s.shape[-1] == st.n // 32
            assert c.shape[0] == st.codes.shape[0]
            return c

        st.write(x[:, :, :step])
        first = check()
        assert st.views()[0] is first  # nothing changed: the same views
        st.write(x[:, :, step : 2 * step])
        assert check() is not first  # a write
        st.truncate(step)
        check()  # a truncation
        st.write(x[:, :, step : 3 * step])
        st.reserve(st.cap * 4)  # growth: new buffers of the same length
        check()
        st.map_batch(lambda t: t[:1])  # a batch edit
        check()
        # what the views hold equals a fresh narrow of the buffers
        fresh = tuple(st._narrow(t, 0, st.n) for t in (st.codes, st.scales, st.zeros))
        for a, b in zip(st.views(), fresh, strict=True):
            assert (a is None and b is None) or torch.equal(a, b)


# ---------------------------------------------------------------------------------------------------------
# contents


def _group_bound(x, layout, bits, mode, eta, G):
    """Per-element bound of |x - deq(quant(x))| for the groups of a store layout ([B, H, N, D] input)."""
    xt = x if layout == "rows" else x.transpose(2, 3)
    xg = xt.unflatten(-1, (-1, G))
    amax = xg.abs().amax(-1, keepdim=True)
    rng = xg.amax(-1, keepdim=True) - xg.amin(-1, keepdim=True)
    qmax = 2**bits - 1
    sym = amax / 2 ** (bits - 1)  # the top level is clipped, so the error reaches one step there
    asym = rng / qmax * (0.5 + eta * qmax)
    b = {"sym": sym, "asym": asym, "hybrid": torch.maximum(sym, asym)}[mode] * 1.01 + amax * 2e-3 + 1e-6
    b = b.expand_as(xg).flatten(-2)
    return b if layout == "rows" else b.transpose(2, 3)


# formats built on the group quantizers (quantize_groups); the lattice format's stores are held to its own ops in
# tests/test_format_lattice.py
GROUP_QUANTIZED = [p for p, c in PRESETS.items() if c.key_mode in MODES and c.value_mode in MODES]


@pytest.mark.parametrize("preset", GROUP_QUANTIZED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_dequantized_exact_in_windows_and_bounded_in_stores(preset, dtype):
    config = PRESETS[preset]
    N = 260
    k, v = kv(2, 2, N, 64, seed=1, outliers=True)
    k, v = k.to(dtype), v.to(dtype)
    c = make_cache(config, B=2, dtype=dtype)
    c.prefill(k[:, :, :150], v[:, :, :150])
    for i in range(150, N):
        c.append(k[:, :, i : i + 1], v[:, :, i : i + 1])
    K, V = c.dequantized()
    assert K.dtype == V.dtype == torch.float32
    cnt = c.token_counts()
    s = cnt["sink"]
    G = config.group_size
    fmt = format_of(config)
    # bits / mode / eta as the layer's stores hold them (a per-layer format such as XQuant picks them per layer)
    for name, x, X, layout, store in (
        ("key", k, K, fmt.key_layout, c.key_store),
        ("value", v, V, fmt.value_layout, c.value_store),
    ):
        bits, mode, eta = store.bits, store.mode, store.eta
        m = cnt[f"{name}_quantized"]
        assert torch.equal(X[:, :, :s], x[:, :, :s].float()), name  # sink: exact
        assert torch.equal(X[:, :, s + m :], x[:, :, s + m :].float()), name  # tail: exact
        # store: exactly an independent quantization of the same tokens (keys divided by the norm) ...
        xq = x[:, :, s : s + m].float()
        norm = c.key_norm[None, :, None, :] if (c.key_norm is not None and name == "key") else torch.ones(())
        src = (xq / norm) if layout == "rows" else (xq / norm).transpose(2, 3)
        codes, scales, zeros = kvkernels.quantize_groups(src, bits, G, mode, eta)
        want = kvkernels.dequantize_groups(codes, scales, zeros, bits, G, mode)
        want = (want if layout == "rows" else want.transpose(2, 3)) * norm
        torch.testing.assert_close(X[:, :, s : s + m], want, rtol=1e-6, atol=1e-6)
        # ... so within the quantizer's error bound
        err = (X[:, :, s : s + m] - xq).abs()
        assert bool((err <= _group_bound(xq / norm, layout, bits, mode, eta, G) * norm).all()), name


@pytest.mark.parametrize("preset", list(PRESETS))
def test_memory_bytes_match_effective_bits(preset):
    # a whole model's layers: a cross-layer format's layers differ, effective_bits averages over them
    config, L = PRESETS[preset], 6
    B, H, D = 2, 2, 64
    model = ModelKVCache(config, num_layers=L, capacity=64)
    k, v = (t.half() for t in kv(B, H, 300, D))
    for layer in range(L):
        model.append(layer, k, v)
    mem, cnt = model.memory_bytes(), model.layer(0).token_counts()
    e = effective_bits(config, num_layers=L)
    assert mem["key_quantized"] * 8 == e.key * B * H * D * cnt["key_quantized"] * L
    assert mem["value_quantized"] * 8 == e.value * B * H * D * cnt["value_quantized"] * L
    window_tokens = 2 * cnt["sink"] + cnt["key_tail"] + cnt["value_tail"]
    assert mem["window"] == window_tokens * B * H * D * 2 * L
    # prefetch: fp16 rows a format keeps on the device besides its windows (SpeCache's top-k rows)
    assert mem["total"] == mem["quantized"] + mem["window"] + mem.get("prefetch", 0)
    assert mem["fp16_equivalent"] == 2 * B * H * 300 * D * 2 * L
    assert mem["allocated"] >= mem["total"]


# ---------------------------------------------------------------------------------------------------------
# edits: batch ops and crop


@pytest.mark.parametrize("name", list(CONFIGS))
def test_reorder_select_repeat_on_quantized_part(name):
    config = CONFIGS[name]
    k, v = kv(3, 2, 200, 64, seed=2)
    c = make_cache(config, B=3)
    c.prefill(k, v)
    assert c.key_store.n > 0 and c.value_store.n > 0
    K, V = c.dequantized()

    c.reorder([2, 0, 1])
    K2, V2 = c.dequantized()
    assert torch.equal(K2, K[[2, 0, 1]]) and torch.equal(V2, V[[2, 0, 1]])
    with pytest.raises(ValueError, match="batch_select"):
        c.reorder([0, 1])
    with pytest.raises(IndexError):
        c.reorder([0, 1, 3])

    c.batch_repeat_interleave(2)
    assert c.batch == 6
    K3, V3 = c.dequantized()
    assert torch.equal(K3, K2.repeat_interleave(2, 0)) and torch.equal(V3, V2.repeat_interleave(2, 0))

    c.batch_select(torch.tensor([5, 0]))
    assert c.batch == 2
    K4, V4 = c.dequantized()
    assert torch.equal(K4, K3[[5, 0]]) and torch.equal(V4, V3[[5, 0]])
    # the cache keeps working at the new batch size
    k2, v2 = kv(2, 2, 40, 64, seed=3)
    for i in range(40):
        c.append(k2[:, :, i : i + 1], v2[:, :, i : i + 1])
    K5, _ = c.dequantized()
    assert K5.shape == (2, 2, 240, 64) and torch.equal(K5[:, :, :32], K4[:, :, :32])


def _filled(config, N=200, seed=4):
    k, v = kv(1, 2, N, 64, seed=seed)
    c = make_cache(config)
    c.prefill(k[:, :, : N - 40], v[:, :, : N - 40])
    for i in range(N - 40, N):
        c.append(k[:, :, i : i + 1], v[:, :, i : i + 1])
    return c


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("cut", ["tail", "store_group_edge", "store_mid_group", "sink", "negative", "zero"])
def test_crop(name, cut):
    config = CONFIGS[name]
    c = _filled(config)
    K, V = c.dequantized()
    cnt = c.token_counts()
    s = cnt["sink"]
    G = config.group_size
    m = min(cnt["key_quantized"], cnt["value_quantized"])
    assert m >= 2 * G
    n = {
        "tail": c.seq_len - 3,
        "store_group_edge": s + G,
        "store_mid_group": s + G + 7,
        "sink": min(s, 2),
        "negative": -5,
        "zero": 0,
    }[cut]
    n_abs = n if n >= 0 else c.seq_len + n
    c.crop(n)
    assert c.seq_len == n_abs
    K2, V2 = c.dequantized()
    # the kept prefix is unchanged (a dequantized-back partial group is exact in an fp32 tail)
    assert torch.equal(K2, K[:, :, :n_abs]) and torch.equal(V2, V[:, :, :n_abs])
    if cut == "store_mid_group":
        tails = (c.key_tail.shape[2], c.value_tail.shape[2])
        assert sorted(tails) == [0, 7]  # only the tensor grouped along tokens moved 7 tokens back to fp16
    # the cache keeps working: append back to 200 tokens; the old prefix stays close to what it was
    k, v = kv(1, 2, 200 - n_abs, 64, seed=5)
    for i in range(200 - n_abs):
        c.append(k[:, :, i : i + 1], v[:, :, i : i + 1])
    assert c.seq_len == 200
    K3, V3 = c.dequantized()
    torch.testing.assert_close(K3[:, :, :n_abs], K2, rtol=0, atol=1.5)  # a re-quantized group may move a bit
    torch.testing.assert_close(V3[:, :, :n_abs], V2, rtol=0, atol=1.5)
    ck = c.token_counts()
    assert ck["key_tail"] <= config.w_recent + G - 1 and ck["value_tail"] <= config.w_recent + G - 1


@pytest.mark.parametrize("name", list(CONFIGS))
def test_crop_speculative_chunk(name):
    # append a draft chunk of 5, keep 2. The rejected tokens are all in the fp16 tails, but the chunk pushed 5
    # tokens out of the one-per-step tail: crop keeps those quantized (never re-materialized), so the state
    # differs from never having seen the draft only in those tokens being quantized early, and becomes
    # identical once the same number of tokens has been appended (their quantization does not depend on when)
    config = CONFIGS[name]
    c, ref = _filled(config), _filled(config)
    k, v = kv(1, 2, 8, 64, seed=6)
    c.append(k[:, :, :5], v[:, :, :5])
    c.crop(-3)
    ref.append(k[:, :, :2], v[:, :, :2])
    assert c.seq_len == ref.seq_len
    (Kc, Vc), (Kr, Vr) = c.dequantized(), ref.dequantized()
    s = c.n_sink
    for x, y, qc, qr in ((Kc, Kr, c.key_store, ref.key_store), (Vc, Vr, c.value_store, ref.value_store)):
        lo, hi = s + qr.n, s + qc.n  # quantized in c, still fp16 in ref
        assert torch.equal(x[:, :, :lo], y[:, :, :lo]) and torch.equal(x[:, :, hi:], y[:, :, hi:])
    per_token = "key" if format_of(config).key_layout == "rows" else "value"  # the tensor leaving one token per step
    assert c.token_counts()[f"{per_token}_quantized"] - ref.token_counts()[f"{per_token}_quantized"] == 3
    c.append(k[:, :, 5:], v[:, :, 5:])
    ref.append(k[:, :, 5:], v[:, :, 5:])
    assert c.token_counts() == ref.token_counts()
    for x, y in zip(c.dequantized(), ref.dequantized(), strict=True):
        assert torch.equal(x, y)


def test_append_and_prefill_validation():
    c = make_cache(PRESETS["innerq_base"], B=1, H=2, D=64)
    k, v = kv(1, 2, 10, 64)
    with pytest.raises(ValueError, match="B=1, H_kv=2"):
        c.append(k[:, :1], v[:, :1])
    with pytest.raises(ValueError, match="both"):
        c.append(k, v[:, :, :5])
    c.prefill(k, v)
    with pytest.raises(ValueError, match="empty cache"):
        c.prefill(k, v)
    c.append(k[:, :, :0], v[:, :, :0])  # no-op
    assert c.seq_len == 10
    with pytest.raises(ValueError, match="multiple of group_size"):
        make_cache(PRESETS["innerq_base"], D=48)
    with pytest.raises(TypeError, match="InnerQConfig"):
        InnerQLayerCache(PRESETS["kivi2"], 1, 2, 64, 16)
    with pytest.raises(TypeError, match="KIVIConfig"):
        KIVILayerCache(PRESETS["innerq_base"], 1, 2, 64, 16)
