"""The InnerQ format (kvkernels/formats/innerq.py): config validation, effective bits, key normalization."""

import pytest
import torch
from cache_helpers import kv, make_cache

import kvkernels
from kvkernels.formats import PRESETS, InnerQConfig, effective_bits, get_format

INNERQ = get_format("innerq")


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: InnerQConfig(key_bits=5), "key_bits"),
        (lambda: InnerQConfig(value_bits=0), "value_bits"),
        (lambda: InnerQConfig(key_mode="nf4"), "key_mode"),
        (lambda: InnerQConfig(value_mode="symm"), "value_mode"),
        (lambda: InnerQConfig(group_size=48), "group_size"),
        (lambda: InnerQConfig(group_size=0), "group_size"),
        (lambda: InnerQConfig(w_sink=-1), "w_sink"),
        (lambda: InnerQConfig(w_recent=-3), "w_recent"),
        (lambda: InnerQConfig(eta=0.25), "eta=0.25 applies to asym tensors"),  # both tensors sym
        (lambda: InnerQConfig(key_mode="asym", eta=0.5), "eta"),
    ],
)
def test_config_validation(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_effective_bits_of_presets():
    want = {
        "innerq_base": (3.5, 3.5, 3.5),
        "innerq_small": (3.5, 2.5, 3.0),
        "innerq_hybrid": (3.5, 3.0, 3.25),
        "innerq_asym4": (5.0, 5.0, 5.0),
        "innerq_asym1_eta": (2.0, 2.0, 2.0),
    }
    assert set(want) == set(INNERQ.presets)
    for name, (k, v, avg) in want.items():
        e = effective_bits(PRESETS[name])
        assert (e.key, e.value, e.average) == (k, v, avg), name
    e = effective_bits(PRESETS["innerq_base"])
    # keys leave the window one token at a time, values in whole groups: the value window is G - 1 longer
    assert (e.fp16_key_tokens, e.fp16_value_tokens) == (128, 159)
    assert e.with_windows(128) == 16.0
    assert 3.5 < e.with_windows(4096) < 4.0
    assert effective_bits(InnerQConfig(group_size=64, key_mode="asym")).key == 3.5


def test_key_norm_fixed_at_prefill_and_reset():
    k, v = kv(2, 2, 150, 64, outliers=True)
    c = make_cache(PRESETS["innerq_base"], B=2)
    assert c.key_norm is None
    c.prefill(k[:, :, :140], v[:, :, :140])
    norm = kvkernels.keynorm.compute_key_norm(k[:, :, :140], rope_paired=True)
    assert torch.equal(c.key_norm, norm) and c.key_norm.shape == (2, 64) and c.key_norm.dtype == torch.float32
    c.append(k[:, :, 140:] * 100, v[:, :, 140:])
    assert torch.equal(c.key_norm, norm)  # fixed after prefill
    c.reset()
    assert c.key_norm is None and c.seq_len == 0
    fixed = torch.rand(2, 64) + 0.5
    c = make_cache(PRESETS["innerq_base"], B=2, key_norm_factors=fixed)
    c.prefill(k, v)
    assert torch.equal(c.key_norm, fixed)
    c.reset()
    assert torch.equal(c.key_norm, fixed)
    c = make_cache(InnerQConfig(key_norm=False), B=2)
    c.prefill(k, v)
    assert c.key_norm is None
    with pytest.raises(ValueError, match="key_norm"):
        make_cache(InnerQConfig(key_norm=False), key_norm_factors=fixed)
    with pytest.raises(ValueError, match="H_kv, D"):
        make_cache(PRESETS["innerq_base"], key_norm_factors=torch.ones(2, 32))


def test_zero_key_channel_gets_a_finite_norm():
    k, v = kv(1, 2, 200, 64)
    k[..., 5] = 0
    k[..., 5 + 32] = 0
    c = make_cache(PRESETS["innerq_base"])
    c.prefill(k, v)
    assert torch.isfinite(c.key_norm).all() and bool((c.key_norm > 0).all())
    K, _ = c.dequantized()
    assert torch.equal(K[..., 5], torch.zeros_like(K[..., 5]))


def test_key_store_holds_normalized_keys_and_the_gemv_folds_the_norm_back():
    # the key hook passes the norm as gemv_inner_q's x_scale: scores equal x . K with K un-normalized
    k, v = kv(1, 2, 200, 64, outliers=True)
    c = make_cache(PRESETS["innerq_base"])
    c.prefill(k, v)
    stored = c.key_store.dequantize()
    assert float(stored.abs().max()) < 0.5 * float(k.abs().max())  # outlier channels flattened by the norm
    x = torch.randn(1, 4, 1, 64)
    K = stored * c.key_norm[None, :, None, :]
    want = (x.view(1, 2, 2, 64) @ K.transpose(2, 3)).view(1, 4, 1, -1)
    torch.testing.assert_close(c.quantized_key_scores(x), want, rtol=1e-4, atol=1e-4)
