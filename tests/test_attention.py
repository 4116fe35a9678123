"""Decode attention on the fused ops (InnerQ Figure 2 / KIVI) against SDPA on the dequantized cache."""

import pytest
import torch

from kvkernels.attention import decode_attention, reference_decode_attention
from kvkernels.formats import PRESETS, InnerQConfig, KIVIConfig, format_of, make_layer_cache


def make_cache(config, B, H_kv, D, dtype=torch.float32, device="cpu", capacity=64):
    return make_layer_cache(config, B, H_kv, D, capacity=capacity, device=device, dtype=dtype)


def filled(config, B=2, H_kv=2, D=64, N=230, prefill=170, dtype=torch.float32, device="cpu", seed=0, outlier=8.0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, H_kv, N, D, generator=g)
    v = torch.randn(B, H_kv, N, D, generator=g)
    k[..., 7] *= outlier  # an outlier channel, so the key norm matters
    k, v = k.to(device, dtype), v.to(device, dtype)
    c = make_cache(config, B, H_kv, D, dtype, device)
    c.prefill(k[:, :, :prefill], v[:, :, :prefill])
    for i in range(prefill, N):
        c.append(k[:, :, i : i + 1], v[:, :, i : i + 1])
    return c, k, v


def query(B, H_q, T, D, dtype=torch.float32, device="cpu", seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H_q, T, D, generator=g).to(device, dtype)


@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("preset", list(PRESETS))
def test_fused_matches_sdpa_on_dequantized(preset, gqa, T, device):
    c, _, _ = filled(PRESETS[preset], device=device)
    cnt = c.token_counts()
    assert cnt["key_quantized"] > 0 and cnt["value_quantized"] > 0 and cnt["sink"] == PRESETS[preset].w_sink
    if format_of(PRESETS[preset]).key_layout != format_of(PRESETS[preset]).value_layout:
        assert cnt["key_quantized"] != cnt["value_quantized"]  # the stores cover different token ranges
    q = query(2, 2 * gqa, T, 64, device=device)
    got = c.attention(q)
    want = reference_decode_attention(q, *c.dequantized())
    assert got.shape == q.shape and got.dtype == q.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("N", [1, 5, 40, 131, 161, 200])
@pytest.mark.parametrize("name", ["innerq_hybrid", "kivi2"])
def test_every_window_state(name, N):
    # short caches: sink only, sink + tail, values not yet quantized, ...
    c, _, _ = filled(PRESETS[name], N=N, prefill=min(N, 3))
    T = min(N, 3)
    q = query(2, 4, T, 64)
    torch.testing.assert_close(c.attention(q), reference_decode_attention(q, *c.dequantized()), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize(
    "config",
    [
        InnerQConfig(value_bits=2, value_mode="asym", w_sink=2, w_recent=3),
        InnerQConfig(w_sink=0, w_recent=0, key_mode="hybrid"),
        KIVIConfig(bits=3, residual=2, w_sink=1, eta=0.1),
    ],
    ids=["innerq_tiny_windows", "innerq_no_windows", "kivi_tiny_windows"],
)
def test_causal_mask_reaching_into_the_stores(config):
    # T larger than the fp16 tail: query rows must not see later tokens even where those are quantized
    c, _, _ = filled(config, N=120, prefill=60)
    q = query(2, 4, 16, 64)
    got = c.attention(q)
    torch.testing.assert_close(got, reference_decode_attention(q, *c.dequantized()), rtol=1e-5, atol=2e-6)
    # row t equals a single-row query over the first N - T + t + 1 tokens
    K, V = c.dequantized()
    for t in (0, 7, 15):
        n = 120 - 16 + t + 1
        one = reference_decode_attention(q[:, :, t : t + 1], K[:, :, :n], V[:, :, :n])
        torch.testing.assert_close(got[:, :, t : t + 1], one, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("family", ["innerq", "kivi"])
def test_error_vs_fp16_cache_shrinks_with_bits_and_is_small_at_4(family):
    # Gaussian K/V and queries: the attention output is a near-uniform average, so its relative error is about
    # the per-element value SNR (4-bit groups: ~10%); more bits must help, and 4 bits must be close to exact
    errs = {}
    for bits in (2, 3, 4):
        if family == "innerq":
            config = InnerQConfig(key_bits=bits, value_bits=bits)
        else:
            config = KIVIConfig(bits=bits)
        c, k, v = filled(config, N=400, prefill=300, outlier=1.0)
        q = query(2, 4, 1, 64)
        exact = reference_decode_attention(q, k, v)
        got = c.attention(q)
        errs[bits] = float((got - exact).norm() / exact.norm())
        if bits == 4:
            assert float((got - exact).abs().max()) < 0.06
    assert errs[4] < errs[3] < errs[2], errs
    assert errs[4] < 0.15, errs


def test_quantized_scores_apply_the_key_norm():
    # InnerQ keys are stored as K / norm; the fused GEMV must scale the query by norm (x_scale)
    import kvkernels

    c, k, _ = filled(PRESETS["innerq_base"])
    assert float(c.key_norm.max() / c.key_norm.min()) > 2
    x = query(2, 2, 1, 64) * 64**-0.5
    s, m = c.n_sink, c.key_store.n
    want = x @ k[:, :, s : s + m].transpose(2, 3)
    codes, scales, zeros = c.key_store.views()
    with_norm = kvkernels.gemv_inner_q(x, codes, scales, zeros, 3, 32, "sym", c.key_norm)
    without = kvkernels.gemv_inner_q(x, codes, scales, zeros, 3, 32, "sym")
    rel = float((with_norm - want).norm() / want.norm())
    assert rel < 0.2 and float((without - want).norm() / want.norm()) > 3 * rel


@pytest.mark.parametrize("preset", ["innerq_small", "kivi2"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision_caches(preset, dtype, device):
    c, _, _ = filled(PRESETS[preset], dtype=dtype, device=device)
    q = query(2, 4, 2, 64, dtype=dtype, device=device)
    got = c.attention(q)
    assert got.dtype == dtype
    want = reference_decode_attention(q, *c.dequantized())
    tol = 2e-3 if dtype == torch.float16 else 1e-2  # the output rounding of the cache dtype
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_scale_argument_and_method():
    ci, _, _ = filled(PRESETS["innerq_base"])
    ck, _, _ = filled(PRESETS["kivi2"])
    q = query(2, 4, 1, 64)
    # fp32 on both sides, summed in different orders (split softmax + GEMVs vs one SDPA over |out| ~ 1): 1e-5
    torch.testing.assert_close(
        decode_attention(q, ci, 0.3), reference_decode_attention(q, *ci.dequantized(), 0.3), rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(ck.attention(q), decode_attention(q, ck), rtol=0, atol=0)
    with pytest.raises(TypeError, match="layer cache"):
        decode_attention(q, object())


def test_query_validation():
    c, _, _ = filled(PRESETS["innerq_base"], N=10, prefill=10)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        c.attention(query(2, 3, 1, 64))
    with pytest.raises(ValueError, match="append the new tokens first"):
        c.attention(query(2, 4, 11, 64))
    with pytest.raises(ValueError, match="D=64"):
        c.attention(query(2, 4, 1, 32))
    with pytest.raises(ValueError, match=r"\[B, H_q, T, D\]"):
        c.attention(torch.randn(2, 4, 64))
    empty = make_cache(PRESETS["kivi2"], 2, 2, 64)
    with pytest.raises(ValueError, match="holds 0 tokens"):
        empty.attention(query(2, 4, 1, 64))


@pytest.mark.parametrize("preset", ["innerq_hybrid", "kivi1_eta"])
def test_attn_mask(preset, device):
    c, _, _ = filled(PRESETS[preset], device=device)
    N, T = c.seq_len, 3
    q = query(2, 4, T, 64, device=device)
    K, V = c.dequantized()
    causal = torch.ones(T, N, dtype=torch.bool, device=device).tril(N - T)[None, None]
    torch.testing.assert_close(c.attention(q, attn_mask=causal), c.attention(q), rtol=1e-6, atol=1e-7)
    # padding-style bool mask per batch row, hiding tokens in the sink, the stores and the tails
    g = torch.Generator().manual_seed(3)
    m = (torch.rand(2, 1, T, N, generator=g) > 0.3).to(device)
    m[1, :, 2] = False  # a fully masked row: uniform average, no NaN
    got = c.attention(q, attn_mask=m)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, reference_decode_attention(q, K, V, attn_mask=m), rtol=1e-5, atol=2e-6)
    additive = torch.randn(1, 4, T, N, generator=g).to(device)
    torch.testing.assert_close(
        c.attention(q, 0.2, additive), reference_decode_attention(q, K, V, 0.2, additive), rtol=1e-5, atol=2e-6
    )
    with pytest.raises(ValueError, match="attn_mask"):
        c.attention(q, attn_mask=m[..., :-1])
