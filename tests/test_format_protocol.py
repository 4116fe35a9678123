"""The format protocol: registry, Format hooks, ModelKVCache, and a toy cross-layer format end to end."""

import ast
from pathlib import Path

import pytest
import torch
import toy_formats

import kvkernels
from kvkernels import formats
from kvkernels.attention import reference_decode_attention
from kvkernels.cache import ModelKVCache
from kvkernels.formats.base import Format, QuantizedLayerCache

PKG = Path(kvkernels.__file__).parent


@pytest.fixture
def toy():
    """The toy cross-layer format, registered for one test."""
    formats.register(toy_formats.FORMAT)
    try:
        yield toy_formats.FORMAT
    finally:
        formats.unregister(toy_formats.FORMAT.name)


def test_registry_maps_presets_and_configs_to_formats():
    names = [f.name for f in formats.all_formats()]
    assert names[:2] == ["innerq", "kivi"]
    # PRESETS is every format's presets in registration order (the demo's and the integration's method order)
    assert list(formats.PRESETS) == [p for f in formats.all_formats() for p in f.presets]
    for fmt in formats.all_formats():
        assert issubclass(fmt.layer_cache_type, QuantizedLayerCache) and fmt.layer_cache_type.format is fmt
        for preset, cfg in fmt.presets.items():
            assert formats.preset_format(preset) is fmt and formats.format_of(cfg) is fmt
            cache = formats.make_layer_cache(cfg, 1, 2, 64, 16)
            assert type(cache) is fmt.layer_cache_type and cache.context is None
    with pytest.raises(TypeError, match="registered format"):
        formats.format_of(object())
    with pytest.raises(ValueError, match="unknown preset"):
        formats.preset_format("kivi3")
    with pytest.raises(ValueError, match="already registered"):
        formats.register(formats.get_format("kivi"))
    with pytest.raises(ValueError, match="take no option"):
        formats.make_layer_cache(formats.PRESETS["kivi2"], 1, 2, 64, 16, rope_paired=True)


def test_register_and_unregister(toy):
    assert formats.get_format(toy.name) is toy
    assert formats.preset_format("toy_shared_key_codes") is toy
    assert formats.format_of(toy_formats.SharedKeyCodesConfig()) is toy  # most derived config type wins
    assert formats.format_of(formats.InnerQConfig()) is formats.get_format("innerq")
    formats.unregister(toy.name)
    assert "toy_shared_key_codes" not in formats.PRESETS
    with pytest.raises(ValueError, match="unknown format"):
        formats.get_format(toy.name)
    formats.register(toy)  # the fixture unregisters it again


def test_format_overrides_and_aliases():
    innerq, kivi = formats.get_format("innerq"), formats.get_format("kivi")
    cfg = innerq.apply_overrides(formats.PRESETS["innerq_base"], {"bits": 4, "value_bits": 2})
    assert (cfg.key_bits, cfg.value_bits) == (4, 2)  # an explicit field wins over the alias
    assert kivi.apply_overrides(formats.PRESETS["kivi2"], {"w_recent": 16}).residual == 16
    with pytest.raises(ValueError, match="alias of residual"):
        kivi.apply_overrides(formats.PRESETS["kivi2"], {"w_recent": 16, "residual": 8})
    with pytest.raises(ValueError, match=r"kivi2: unknown override\(s\) \['key_mode'\]"):
        kivi.apply_overrides(formats.PRESETS["kivi2"], {"key_mode": "sym"}, label="kivi2")
    assert {"bits", "w_recent", "residual", "key_bits"} <= innerq.override_names() | kivi.override_names()


def _names_in_code(path: Path) -> set[str]:
    # identifiers used in code (names, attributes, imports), not in strings or comments
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, ast.alias):
            out.add(node.name.split(".")[-1])
    return out


def test_no_module_outside_formats_names_a_concrete_format():
    # the protocol's promise: attention, caches, demo, bench and integrations go through the registry
    concrete = set()
    for fmt in formats.all_formats():
        concrete |= {fmt.config_type.__name__, fmt.layer_cache_type.__name__, type(fmt).__name__}
    assert {"InnerQConfig", "KIVILayerCache"} <= concrete
    offenders = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG)
        if rel.parts[0] in ("formats", "reference", "triton_kernels"):
            continue
        hits = _names_in_code(path) & concrete
        if hits:
            offenders[str(rel)] = sorted(hits)
    assert not offenders, f"modules naming a concrete format (use kvkernels.formats' registry): {offenders}"


def test_every_format_hook_matches_its_dequantized_cache():
    # the two hooks attention calls, per format, against the store's own dequantization
    g = torch.Generator().manual_seed(3)
    for fmt in formats.all_formats():
        for preset, cfg in fmt.presets.items():
            cache = formats.make_layer_cache(cfg, 2, 2, 64, 64, dtype=torch.float32)
            cache.prefill(torch.randn(2, 2, 300, 64, generator=g), torch.randn(2, 2, 300, 64, generator=g))
            x = torch.randn(2, 4, 1, 64, generator=g)
            ks = cache._keys_from_store(cache.key_store.dequantize())  # [B, H_kv, n, D], un-normalized
            want = (x.view(2, 2, 2, 64) @ ks.transpose(2, 3)).view(2, 4, 1, -1)
            torch.testing.assert_close(cache.quantized_key_scores(x), want, rtol=1e-4, atol=1e-4, msg=preset)
            p = torch.rand(2, 4, 1, cache.value_store.n, generator=g)
            want = (p.view(2, 2, 2, -1) @ cache.value_store.dequantize()).view(2, 4, 1, 64)
            torch.testing.assert_close(cache.quantized_value_output(p), want, rtol=1e-4, atol=1e-4, msg=preset)


# ---------------------------------------------------------------------------------------------------------
# ModelKVCache and the toy cross-layer format


def _correlated_layers(n_layers, B, H, N, D, seed=0):
    # odd layer keys = 2 x the even layer's + 1% noise, so shared codes with refitted scales reconstruct them well
    g = torch.Generator().manual_seed(seed)
    ks, vs = [], []
    for layer in range(n_layers):
        k = (
            torch.randn(B, H, N, D, generator=g)
            if layer % 2 == 0
            else 2 * ks[-1] + 0.01 * torch.randn(B, H, N, D, generator=g)
        )
        ks.append(k)
        vs.append(torch.randn(B, H, N, D, generator=g))
    return ks, vs


def test_model_kv_cache_single_layer_formats_are_unchanged():
    # a ModelKVCache layer of a single-layer format is the same layer cache as a standalone one
    ks, vs = _correlated_layers(2, 1, 2, 200, 64)
    cfg = formats.PRESETS["innerq_base"]
    model = ModelKVCache(cfg, 2, capacity=64)
    for i in range(2):
        model.append(i, ks[i].half(), vs[i].half())
    alone = formats.make_layer_cache(cfg, 1, 2, 64, 64)
    alone.append(ks[1].half(), vs[1].half())
    q = torch.randn(1, 4, 1, 64)
    torch.testing.assert_close(model.attention(1, q), alone.attention(q), rtol=0, atol=0)
    assert model.layer(1).context.layer(0) is model.layer(0) and model.layer(0).context.layer(-1) is None
    assert model.seq_len == 200 and model.memory_bytes()["total"] == 2 * alone.memory_bytes()["total"]
    model.crop(150)
    assert [layer.seq_len for layer in model.layers] == [150, 150]
    with pytest.raises(IndexError, match="out of range"):
        model.layer(2)
    with pytest.raises(ValueError, match="append its K/V first"):
        ModelKVCache(cfg, 2).attention(0, q)


def test_toy_cross_layer_format_through_model_kv_cache(toy):
    B, H, D = 1, 2, 64
    cfg = toy_formats.SharedKeyCodesConfig(w_sink=4, w_recent=8)
    model = ModelKVCache(cfg, 4, capacity=64)
    ks, vs = _correlated_layers(4, B, H, 150, D)
    q = torch.randn(B, 4, 1, D)
    for t0, t1 in ((0, 120), *((t, t + 1) for t in range(120, 150))):  # prefill, then 30 decode steps
        for i in range(4):
            model.append(i, ks[i][:, :, t0:t1].half(), vs[i][:, :, t0:t1].half())
    even, odd = model.layer(2), model.layer(3)
    assert type(even) is toy_formats.SharedKeyCodesEvenLayer and type(odd) is toy_formats.SharedKeyCodesOddLayer
    assert odd.key_store.n == even.key_store.n == 150 - 4 - 8
    # the odd layer stores scales only: its key store costs D/G fp16 per token against the codes' D*3/8 bytes
    assert odd.key_store.used_bytes() == B * H * odd.key_store.n * (D // 32) * 2
    assert odd.memory_bytes()["key_quantized"] < 0.2 * even.memory_bytes()["key_quantized"]
    # its keys are reconstructed from the partner's codes with its own scales: about as good as the partner's
    k_odd, _ = odd.dequantized()
    k_even, _ = even.dequantized()
    err_odd = float((k_odd - ks[3].half().float()).norm() / ks[3].norm())
    err_even = float((k_even - ks[2].half().float()).norm() / ks[2].norm())
    assert err_odd < 1.5 * err_even + 0.01, (err_odd, err_even)
    # the fused path (the hooks, reading the shared codes in place) equals attention over the reconstruction
    want = reference_decode_attention(q, *odd.dequantized())
    torch.testing.assert_close(model.attention(3, q).float(), want, rtol=2e-3, atol=2e-3)
    # crop and reorder reach both layers of a pair
    model.crop(140)
    model.reorder(torch.zeros(B, dtype=torch.long))
    assert odd.seq_len == 140 and odd.key_store.n == even.key_store.n
    torch.testing.assert_close(
        model.attention(3, q).float(), reference_decode_attention(q, *odd.dequantized()), rtol=2e-3, atol=2e-3
    )


def test_toy_cross_layer_format_errors(toy):
    cfg = toy_formats.SharedKeyCodesConfig(w_sink=0, w_recent=0)
    with pytest.raises(ValueError, match="through a ModelKVCache"):
        formats.make_layer_cache(cfg, 1, 2, 64, 16)
    model = ModelKVCache(cfg, 2)
    k = torch.randn(1, 2, 8, 64).half()
    with pytest.raises(RuntimeError, match="append to that layer first"):
        model.append(1, k, k)  # layer 1 before layer 0 in the same step
    with pytest.raises(ValueError, match="sym key codes"):
        toy_formats.SharedKeyCodesConfig(key_mode="asym")


def test_format_base_class_is_abstract_about_gemv():
    with pytest.raises(NotImplementedError):
        Format().gemv(None, None, None, None, None, 3, 32, "sym")


@torch.no_grad()
def test_toy_cross_layer_format_through_generate(toy):
    # end to end: a KVKernelsCache of the toy format on a 4-layer Llama, fused decode against dequantize-then-SDPA
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvkernels.integrations.transformers import KVKernelsCache, set_kvkernels_attention

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, vocab_size=128, max_position_embeddings=256,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    set_kvkernels_attention(model)
    ids = torch.randint(0, 128, (1, 80), generator=torch.Generator().manual_seed(1))
    small = {"group_size": 32, "w_sink": 4, "w_recent": 8}
    fused = KVKernelsCache("toy_shared_key_codes", config=model.config, **small)
    out = model.generate(ids, past_key_values=fused, max_new_tokens=20, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)  # fmt: skip
    assert fused.paths == {"prefill": 4, "fused": 4 * 19, "dequantized": 0, "full": 0}
    layers = [layer.cache for layer in fused.layers]
    assert [type(c).__name__ for c in layers] == ["SharedKeyCodesEvenLayer", "SharedKeyCodesOddLayer"] * 2
    assert layers[1].context.layer(0) is layers[0] and layers[1].key_store.n == layers[0].key_store.n > 64
    assert layers[1].memory_bytes()["key_quantized"] < 0.2 * layers[0].memory_bytes()["key_quantized"]
    # the same token sequence through fused=False (update returns dequantized() to SDPA): same logits
    deq = KVKernelsCache("toy_shared_key_codes", config=model.config, fused=False, **small)
    seq = out.sequences
    got = [model(seq[:, :80], past_key_values=deq, use_cache=True).logits[:, -1]]
    for j in range(80, seq.shape[1] - 1):
        got.append(model(seq[:, j : j + 1], past_key_values=deq, use_cache=True).logits[:, -1])
    assert deq.paths["fused"] == 0 and deq.paths["dequantized"] == 4 * 19
    torch.testing.assert_close(torch.stack(got, 1), torch.stack(out.logits, 1), atol=1e-4, rtol=0)
