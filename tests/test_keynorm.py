"""Per-channel key normalization: the factors, their effect on quantization, and folding into Llama weights."""

import pytest
import torch
from torch import nn

from kvkernels.attention import reference_decode_attention
from kvkernels.formats import InnerQConfig, InnerQLayerCache
from kvkernels.keynorm import KEY_NORM_EPS, check_rope_paired, compute_key_norm, fold_key_norm_into_attention


def outlier_keys(B=2, H=2, N=300, D=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, H, N, D, generator=g)
    for c, f in ((3, 15.0), (10, 6.0), (20, 25.0)):  # outlier channels (and their RoPE partners)
        k[..., c] *= f
        k[..., c + D // 2] *= f / 2
    return k, torch.randn(B, H, N, D, generator=g)


def paired_norm(H, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    half = torch.rand(H, D // 2, generator=g) * 2.7 + 0.3
    return torch.cat([half, half], dim=-1)


# ---------------------------------------------------------------------------------------------------------
# the factors


def test_compute_key_norm_definition():
    k, _ = outlier_keys(N=50)
    raw = compute_key_norm(k, rope_paired=False)
    torch.testing.assert_close(raw, k.abs().amax(dim=(0, 2)).sqrt(), rtol=0, atol=0)
    paired = compute_key_norm(k)
    assert paired.shape == (2, 64) and paired.dtype == torch.float32
    torch.testing.assert_close(paired[:, :32], torch.maximum(raw[:, :32], raw[:, 32:]), rtol=0, atol=0)
    check_rope_paired(paired)
    with pytest.raises(ValueError, match="RoPE-paired"):
        check_rope_paired(raw)
    k[:, 1, :, 5] = 0
    k[:, 1, :, 37] = 0
    z = compute_key_norm(k)
    assert z[1, 5] == z[1, 37] == KEY_NORM_EPS**0.5
    assert compute_key_norm(k.half()).dtype == torch.float32


@pytest.mark.parametrize(
    "k, match",
    [
        (torch.randn(2, 5, 64), r"\[B, H_kv, N, D\]"),
        (torch.randn(1, 2, 0, 64), "no tokens"),
        (torch.full((1, 2, 3, 64), float("nan")), "NaN"),
        (torch.randn(1, 2, 3, 63), "even head_dim"),
    ],
)
def test_compute_key_norm_rejects(k, match):
    with pytest.raises(ValueError, match=match):
        compute_key_norm(k)


# ---------------------------------------------------------------------------------------------------------
# in the cache


def _quantized_key_error(key_norm: bool, k, v, q):
    c = InnerQLayerCache(InnerQConfig(key_norm=key_norm), 2, 2, 64, capacity=64, dtype=torch.float32)
    c.prefill(k, v)
    s, m = c.n_sink, c.key_store.n
    K, _ = c.dequantized()
    ref = k[:, :, s : s + m]
    rec = float((K[:, :, s : s + m] - ref).norm() / ref.norm())
    x = q * 64**-0.5
    scores = x @ ref.transpose(2, 3)
    got = c.attention(q)
    assert got.shape == q.shape
    score_err = float((x @ K[:, :, s : s + m].transpose(2, 3) - scores).norm() / scores.norm())
    return rec, score_err, float((got - reference_decode_attention(q, k, v)).norm())


def test_key_norm_reduces_quantization_error_on_outlier_channels():
    k, v = outlier_keys()
    q = torch.randn(2, 2, 1, 64, generator=torch.Generator().manual_seed(9))
    rec_on, score_on, out_on = _quantized_key_error(True, k, v, q)
    rec_off, score_off, out_off = _quantized_key_error(False, k, v, q)
    assert rec_on < 0.8 * rec_off, (rec_on, rec_off)
    assert score_on < score_off, (score_on, score_off)
    assert out_on < out_off, (out_on, out_off)


def test_runtime_norm_equals_folded_norm_cache():
    # runtime: raw q, K into a key_norm cache; folded: q * norm and K / norm into a key_norm=False cache
    k, v = outlier_keys(N=260)
    norm = compute_key_norm(k[:, :, :200])
    q = torch.randn(2, 4, 3, 64, generator=torch.Generator().manual_seed(1))
    runtime = InnerQLayerCache(InnerQConfig(), 2, 2, 64, 64, dtype=torch.float32, key_norm_factors=norm)
    folded = InnerQLayerCache(InnerQConfig(key_norm=False), 2, 2, 64, 64, dtype=torch.float32)
    kn = k / norm[None, :, None, :]
    runtime.prefill(k[:, :, :200], v[:, :, :200])
    folded.prefill(kn[:, :, :200], v[:, :, :200])
    for i in range(200, 260):
        runtime.append(k[:, :, i : i + 1], v[:, :, i : i + 1])
        folded.append(kn[:, :, i : i + 1], v[:, :, i : i + 1])
    assert torch.equal(runtime.key_store.codes, folded.key_store.codes)  # the same quantized keys
    qn = q * norm.repeat_interleave(2, dim=0)[None, :, None, :]
    torch.testing.assert_close(runtime.attention(q), folded.attention(qn), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# folding into a transformers Llama model


def tiny_llama(attention_bias: bool, seed=0):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attention_bias=attention_bias,
        initializer_range=0.2,  # large enough for attention to be far from uniform
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    if attention_bias:  # biases start at zero; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.bias.normal_(0, 0.5)
                layer.self_attn.k_proj.bias.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("attention_bias", [False, True], ids=["no-bias", "bias"])
def test_folding_keeps_logits(attention_bias):
    model = tiny_llama(attention_bias)
    ids = torch.randint(0, 101, (2, 24), generator=torch.Generator().manual_seed(0))
    hidden = torch.randn(2, 24, 64, generator=torch.Generator().manual_seed(1))
    attn0 = model.model.layers[0].self_attn
    with torch.no_grad():
        before = model(ids).logits
        k_before = attn0.k_proj(hidden).view(2, 24, 2, 16)
        q_before = attn0.q_proj(hidden).view(2, 24, 4, 16)
    norms = [paired_norm(2, 16, seed=i) for i in range(2)]
    for layer, norm in zip(model.model.layers, norms, strict=True):
        fold_key_norm_into_attention(layer.self_attn, norm)
    with torch.no_grad():
        after = model(ids).logits
        k_after = attn0.k_proj(hidden).view(2, 24, 2, 16)
        q_after = attn0.q_proj(hidden).view(2, 24, 4, 16)
    assert before.abs().max() > 0.5  # the test is not vacuous
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    # k_proj now emits K / norm, q_proj emits q * norm (query heads 0, 1 -> KV head 0; 2, 3 -> KV head 1)
    torch.testing.assert_close(k_after, k_before / norms[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q_after, q_before * norms[0].repeat_interleave(2, dim=0), rtol=1e-5, atol=1e-5)


def test_folding_rejects_bad_norms_and_modules():
    model = tiny_llama(False)
    attn = model.model.layers[0].self_attn
    w = attn.k_proj.weight.clone()
    unpaired = paired_norm(2, 16)
    unpaired[0, 3] += 0.1
    with pytest.raises(ValueError, match="RoPE-paired"):
        fold_key_norm_into_attention(attn, unpaired)
    with pytest.raises(ValueError, match=r"\[H_kv, D\]"):
        fold_key_norm_into_attention(attn, torch.ones(4, 16))
    with pytest.raises(ValueError, match="positive"):
        fold_key_norm_into_attention(attn, torch.zeros(2, 16))
    assert torch.equal(attn.k_proj.weight, w)  # nothing was modified by the failed calls
    attn.k_norm = nn.Identity()  # Qwen3-style post-projection norm
    with pytest.raises(ValueError, match="k_norm"):
        fold_key_norm_into_attention(attn, paired_norm(2, 16))
    with pytest.raises(ValueError, match="q_proj"):
        fold_key_norm_into_attention(nn.Linear(4, 4), paired_norm(2, 16))
