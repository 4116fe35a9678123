"""The lattice format (kvkernels/formats/lattice.py): config validation, bits, stores, hooks, cross-head mode.

The generic protocol tests (test_format_protocol, test_attention, test_layer_cache, test_transformers_integration)
run every registered preset, lattice ones included; this file checks what is lattice-specific.
"""

import pytest
import torch

from kvkernels import ops, reference
from kvkernels.attention import reference_decode_attention
from kvkernels.formats import PRESETS, effective_bits, get_format, make_layer_cache
from kvkernels.formats.lattice import LatticeConfig
from kvkernels.formats.lattice_grids import grid as published_grid

LATTICE = get_format("lattice")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"bits": 1}, "bits"),
        ({"bits": 5}, "bits"),
        ({"dim": 3}, "dim"),
        ({"dim": 4, "bits": 3}, "dim=4"),
        ({"group_size": 48}, "group_size"),
        ({"group_size": 16}, "group_size"),
        ({"group_size": 2048}, "group_size"),
        ({"cross_head": 1}, "cross_head"),
        ({"signs_seed": -1}, "signs_seed"),
        ({"signs_seed": 1.5}, "signs_seed"),
        ({"w_sink": -1}, "w_sink"),
        ({"w_recent": -3}, "w_recent"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LatticeConfig(**kwargs)


def test_presets_and_effective_bits():
    # codes + one fp16 RMS per group of 64
    want = {"lattice2": 2.25, "lattice3": 3.25, "lattice4": 4.25, "lattice2_d4": 2.25}
    assert set(want) == set(LATTICE.presets)
    for name, bits in want.items():
        e = effective_bits(PRESETS[name])
        assert (e.key, e.value, e.average) == (bits, bits, bits), name
        assert e.fp16_key_tokens == e.fp16_value_tokens == PRESETS[name].w_sink + PRESETS[name].w_recent
    assert effective_bits(LatticeConfig(bits=3, group_size=128)).average == 3.125
    assert PRESETS["lattice2_d4"].grid_points == 256 and PRESETS["lattice3"].grid_points == 64


def test_signs_are_seeded_and_device_independent():
    a, b = LatticeConfig(signs_seed=7).signs(), LatticeConfig(signs_seed=7).signs()
    assert a.dtype == torch.int8 and a.shape == (64,) and torch.equal(a, b)
    assert set(a.tolist()) == {-1, 1}
    assert not torch.equal(a, LatticeConfig(signs_seed=8).signs())
    assert LatticeConfig().signs() is None


def _filled(cfg, B=2, H=2, D=64, N=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(B, H, N, D, generator=g), torch.randn(B, H, N, D, generator=g)
    cache = make_layer_cache(cfg, B, H, D, 64, dtype=torch.float32)
    cache.prefill(k, v)
    return cache, k, v


@pytest.mark.parametrize("preset", ["lattice2", "lattice3", "lattice4", "lattice2_d4"])
def test_store_holds_the_ops_codes_of_every_token_outside_the_windows(preset):
    cfg = PRESETS[preset]
    cache, k, v = _filled(cfg)
    n = cache.key_store.n
    assert n == cache.value_store.n == 300 - cfg.w_sink - cfg.w_recent
    grid = published_grid(cfg.dim, cfg.grid_points)
    want_codes, want_norms = reference.lattice_quantize(k[:, :, cfg.w_sink : cfg.w_sink + n], grid, 64)
    codes, norms, zeros = cache.key_store.views()
    assert zeros is None
    assert torch.equal(codes, want_codes) and torch.equal(norms, want_norms)
    # the windows read back exactly, the store as the op dequantizes it
    K, _ = cache.dequantized()
    s = cfg.w_sink
    assert torch.equal(K[:, :, :s], k[:, :, :s]) and torch.equal(K[:, :, s + n :], k[:, :, s + n :])
    deq = reference.lattice_dequantize(want_codes, want_norms, grid, 64)
    torch.testing.assert_close(K[:, :, s : s + n], deq, rtol=0, atol=0)
    torch.testing.assert_close(
        cache.value_store.dequantize(),
        reference.lattice_dequantize(*cache.value_store.views()[:2], grid, 64),
        rtol=0,
        atol=0,
    )


@pytest.mark.parametrize("cfg", [LatticeConfig(bits=3, signs_seed=3), LatticeConfig(bits=2, group_size=32)])
def test_attention_equals_attention_over_the_dequantized_cache(cfg):
    cache, _, _ = _filled(cfg, N=257)
    q = torch.randn(2, 6, 1, 64, generator=torch.Generator().manual_seed(1))
    k, v = cache.dequantized()
    torch.testing.assert_close(cache.attention(q), reference_decode_attention(q, k, v), rtol=1e-4, atol=1e-5)


def test_appends_one_token_at_a_time_match_a_prefill():
    cfg = PRESETS["lattice2"]
    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(1, 2, 200, 64, generator=g), torch.randn(1, 2, 200, 64, generator=g)
    whole = make_layer_cache(cfg, 1, 2, 64, 16, dtype=torch.float32)
    whole.prefill(k, v)
    steps = make_layer_cache(cfg, 1, 2, 64, 16, dtype=torch.float32)  # small capacity: the store grows
    steps.prefill(k[:, :, :150], v[:, :, :150])
    for t in range(150, 200):
        steps.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
    for a, b in zip(whole.key_store.views()[:2], steps.key_store.views()[:2], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(whole.dequantized(), steps.dequantized(), strict=True):
        assert torch.equal(a, b)


def test_cross_head_rows_span_every_kv_head_of_a_token():
    cfg = LatticeConfig(bits=2, group_size=128, cross_head=True, w_sink=0, w_recent=0)
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(1, 2, 40, 64, generator=g), torch.randn(1, 2, 40, 64, generator=g)
    cache = make_layer_cache(cfg, 1, 2, 64, 64, dtype=torch.float32)
    cache.prefill(k, v)
    codes, norms, _ = cache.key_store.views()
    assert codes.shape == (1, 1, 40, 128 * 2 // 32) and norms.shape == (1, 1, 40, 1)
    rows = k.permute(0, 2, 1, 3).reshape(1, 1, 40, 128)  # token t: head 0's 64 channels, then head 1's
    grid = published_grid(2, 16)
    want_codes, want_norms = reference.lattice_quantize(rows, grid, 128)
    assert torch.equal(codes, want_codes) and torch.equal(norms, want_norms)
    deq = reference.lattice_dequantize(want_codes, want_norms, grid, 128).reshape(1, 40, 2, 64).permute(0, 2, 1, 3)
    torch.testing.assert_close(cache.dequantized()[0], deq, rtol=0, atol=0)
    q = torch.randn(1, 4, 1, 64, generator=g)
    kk, vv = cache.dequantized()
    torch.testing.assert_close(cache.attention(q), reference_decode_attention(q, kk, vv), rtol=1e-4, atol=1e-5)


def test_cross_head_group_must_divide_the_token_row():
    with pytest.raises(ValueError, match="must divide H_kv \\* head_dim"):
        make_layer_cache(LatticeConfig(group_size=256, cross_head=True), 1, 3, 64)
    with pytest.raises(ValueError, match="multiple of group_size"):
        make_layer_cache(LatticeConfig(group_size=128), 1, 2, 64)  # per head: G must divide head_dim


def test_the_format_has_no_single_gemv():
    with pytest.raises(NotImplementedError, match="gemv_lattice_k"):
        LATTICE.gemv(ops.gemv_lattice_k, None, None, None, None, 2, 64, "lattice")


def test_describe_names_grid_and_rotation():
    assert LATTICE.describe(PRESETS["lattice2_d4"]) == "K/V 2b EDEN4-256 lattice, Hadamard, fp16 RMS per G 64"
    assert "seed 3" in LATTICE.describe(LatticeConfig(signs_seed=3))
