"""The AQUA-KV cache format (kvkernels.formats.aqua): block commit, sinks, first-layer quantizer, encode/decode bitwise
consistency over 30 layers, reconstruction quality against the backbone alone, attention, accounting, errors."""

import dataclasses

import pytest
import torch

from kvkernels import aqua
from kvkernels.cache import ModelKVCache
from kvkernels.formats import effective_bits, get_format
from kvkernels.formats.aqua import AquaConfig, reconstruct_from_codes

H, D = 3, 64  # SmolLM2-135M's KV shape: C = 192 channels per token
C = H * D
INV_FREQ = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))


def _random_predictors(layers, seed=0, bits=2, rank=None):
    """Predictors with random weights of spectral norm < 1, so 30 layers of reconstructions stay bounded; rank r:
    factors up [C, r] (orthonormal columns) and down [r, C_in] of the same kind (mode c)."""
    g = torch.Generator().manual_seed(seed)

    def mat(n_in):
        q, _ = torch.linalg.qr(torch.randn(n_in, n_in, generator=g))
        return 0.6 * q[:C] if n_in > C else 0.6 * q

    def layer():
        kb, vb = 0.1 * torch.randn(C, generator=g), 0.1 * torch.randn(C, generator=g)
        if rank is None:
            return aqua.LayerPredictors(mat(C), kb, mat(2 * C), vb)
        up_k, up_v = mat(C)[:, :rank], mat(C)[:, :rank]
        return aqua.LayerPredictors(up_k, kb, up_v, vb, mat(C)[:rank] / 0.6, mat(2 * C)[:rank] / 0.6)

    preds = [None] + [layer() for _ in range(1, layers)]
    backbone = dataclasses.asdict(aqua.Backbone(bits=bits))
    return aqua.AquaPredictors(preds, INV_FREQ, 1.0, model={}, settings={"backbone": backbone})


def _fill(cache: ModelKVCache, steps, seed=0, B=1, layers=None):
    """Append random post-RoPE K/V in the given step sizes to every layer in order; record each layer's committed
    chunk reconstructions (the encode path's output, handed to the layer above through the scratch: (layer, version,
    lo, hi, k_hat, v_hat)) as they appear. The top layer hands nothing up."""
    g = torch.Generator().manual_seed(seed)
    L = cache.num_layers
    seen = [[] for _ in range(L)]
    for n in steps:
        for l in range(L):
            k, v = torch.randn(B, H, n, D, generator=g), torch.randn(B, H, n, D, generator=g)
            before = cache.scratch.get("aqua.chunk")
            cache.append(l, k, v)
            held = cache.scratch.get("aqua.chunk")
            if held is not None and held is not before:
                assert held[0] == l
                seen[l].append(held[2:])
    return seen


def test_encode_and_decode_agree_bitwise_over_30_layers():
    cfg = AquaConfig(predictors=_random_predictors(30))
    cache = ModelKVCache(cfg, num_layers=30, capacity=64)
    seen = _fill(cache, [200] + [1] * 130)  # a prefill commit (196 tokens), then a decode commit (128)
    layers = [cache.layer(l) for l in range(30)]
    assert layers[0].chunks == [(0, 196), (196, 324)] and all(c.chunks == layers[0].chunks for c in layers)
    decoded = reconstruct_from_codes(layers)
    assert seen[29] == [] and all(len(seen[l]) == 2 for l in range(29))
    for l, layer in enumerate(layers):
        # the encode path's reconstructions, concatenated per token ([B * n, C] rows per chunk, B = 1); the top
        # layer hands none up: its decode is checked against what attention reads, below
        if l < 29:
            k_enc = torch.cat([s[2] for s in seen[l]])
            v_enc = torch.cat([s[3] for s in seen[l]])
            assert torch.equal(decoded[l][0], k_enc) and torch.equal(decoded[l][1], v_enc), f"layer {l}"
        # what attention reads is the reconstruction, re-rotated, in the cache dtype (fp32 here: exact)
        k_rec = layer._k_rec.view()
        pos = torch.arange(4, 4 + 324)
        want = aqua.rope(decoded[l][0].reshape(1, 324, H, D).permute(0, 2, 1, 3), pos, INV_FREQ).to(k_rec.dtype)
        assert torch.equal(k_rec, want) and k_rec.dtype == torch.float32
        assert torch.equal(layer._v_rec.view(), decoded[l][1].reshape(1, 324, H, D).permute(0, 2, 1, 3))
    assert decoded[29][0].isfinite().all() and decoded[29][0].abs().max() < 100  # bounded after 30 layers


def test_block_commit_sinks_and_first_layer_bits():
    cfg = AquaConfig(predictors=_random_predictors(3))
    cache = ModelKVCache(cfg, num_layers=3)
    g = torch.Generator().manual_seed(1)
    k0 = torch.randn(1, H, 3, D, generator=g)
    for l in range(3):
        cache.append(l, k0, k0)
    c0 = cache.layer(0)
    assert c0.token_counts()["sink"] == 3 and c0.chunks == []
    _fill(cache, [126])  # 1 more sink, 125 in the tail: no commit yet
    assert c0.n_sink == 4 and c0.key_tail.shape[2] == 125 and c0.key_store.n == 0
    _fill(cache, [1, 1])  # 127 tail tokens: still fp16
    assert c0.key_tail.shape[2] == 127 and c0.chunks == []
    _fill(cache, [1])  # the tail reaches 128: committed whole
    assert c0.key_tail.shape[2] == 0 and c0.key_store.n == 128 and c0.chunks == [(0, 128)]
    assert torch.equal(c0.sink_keys[:, :, :3], k0)  # sinks stay in the cache dtype, never quantized
    assert c0.key_store.bits == 4 and cache.layer(1).key_store.bits == 2 and cache.layer(2).value_store.bits == 2
    assert c0.seq_len == 4 + 128


def test_cache_beats_its_backbone_on_predictable_kv():
    # K/V whose layers depend linearly on the layer below, calibrated with Alg. 1, then fed through the cache as a
    # model would (post-RoPE keys): the cache's reconstruction error is well below the backbone's at the same bits
    g = torch.Generator().manual_seed(3)
    L, N = 4, 1200
    kv = []
    k, v = torch.randn(N, C, generator=g), torch.randn(N, C, generator=g)
    for l in range(L):
        if l:
            k = k @ (torch.randn(C, C, generator=g) / C**0.5) + 0.2 * torch.randn(N, C, generator=g) + 1.0
            v = torch.cat([k, v], 1) @ (torch.randn(2 * C, C, generator=g) / (2 * C) ** 0.5)
            v = v + 0.2 * torch.randn(N, C, generator=g)
        kv.append((k, v))
    train = [(k[:1000], v[:1000]) for k, v in kv]
    layers, _ = aqua.calibrate_on_kv(train, None, aqua.CalibrationSettings(), progress=False)
    settings = {"backbone": dataclasses.asdict(aqua.Backbone())}
    preds = aqua.AquaPredictors(layers, INV_FREQ, 1.0, model={}, settings=settings)
    cache = ModelKVCache(AquaConfig(predictors=preds), num_layers=L)
    n = 4 + 196
    pos = torch.arange(n)
    for l, (k, v) in enumerate(kv):
        k_pre = k[1000 : 1000 + n].reshape(1, n, H, D).permute(0, 2, 1, 3)
        cache.append(l, aqua.rope(k_pre, pos, INV_FREQ), v[1000 : 1000 + n].reshape(1, n, H, D).permute(0, 2, 1, 3))
    from kvkernels.formats.lattice import LatticeConfig

    lat = ModelKVCache(LatticeConfig(bits=2, w_sink=4, w_recent=0), num_layers=L)
    for l, (k, v) in enumerate(kv):
        k_post = aqua.rope(k[1000 : 1000 + n].reshape(1, n, H, D).permute(0, 2, 1, 3), pos, INV_FREQ)
        v_heads = v[1000 : 1000 + n].reshape(1, n, H, D).permute(0, 2, 1, 3)
        lat.append(l, k_post, v_heads)
        got_k, got_v = cache.layer(l).dequantized()
        base_k, base_v = lat.layer(l).dequantized()
        err_k, base_err_k = aqua.rel_mse(got_k, k_post), aqua.rel_mse(base_k, k_post)
        err_v, base_err_v = aqua.rel_mse(got_v, v_heads), aqua.rel_mse(base_v, v_heads)
        if l == 0:  # 4-bit layer 0 vs the 2-bit backbone
            assert err_k < base_err_k / 4
        else:
            assert err_k < base_err_k / 3 and err_v < base_err_v, (l, err_k, base_err_k, err_v, base_err_v)


def test_attention_reads_the_reconstruction():
    cache = ModelKVCache(AquaConfig(predictors=_random_predictors(2)), num_layers=2)
    _fill(cache, [140, 3])
    layer = cache.layer(1)
    q = torch.randn(1, 9, 2, D)
    k, v = layer.dequantized()
    assert k.shape[2] == 4 + 136 + 3 and layer.key_tail.shape[2] == 3
    got = layer.attention(q)
    want = _sdpa(q, k, v)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert layer.fused_attention_operands() is None  # the fused op would read the residual codes, not K


def _sdpa(q, k, v):
    ratio = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(ratio, 1), v.repeat_interleave(ratio, 1)
    T, N = q.shape[2], k.shape[2]
    mask = torch.ones(T, N, dtype=torch.bool).tril(N - T)
    return torch.nn.functional.scaled_dot_product_attention(q.float(), k, v, attn_mask=mask)


@pytest.mark.parametrize("rank", [None, 24])
def test_recompute_mode_attends_what_the_kept_reconstruction_holds(rank):
    # mode (a) keeps only codes and rebuilds every committed token each step from the layer below's rebuild;
    # mode (b) keeps the reconstruction: the same values (tolerance: one GEMM over all rows vs one per chunk)
    preds = _random_predictors(6, rank=rank)
    caches = {mode: ModelKVCache(AquaConfig(predictors=preds, recompute=mode), num_layers=6) for mode in (True, False)}
    for cache in caches.values():
        _fill(cache, [200] + [1] * 130, seed=2)
    q = torch.randn(1, 9, 1, D, generator=torch.Generator().manual_seed(4))
    for l in range(6):
        a, b = caches[True].layer(l), caches[False].layer(l)
        assert a.chunks == b.chunks == [(0, 196), (196, 324)]
        torch.testing.assert_close(a.attention(q), b.attention(q), atol=1e-5, rtol=1e-5)
        # two layers live at a time: layer l's rebuild replaced layer l - 1's; the top layer's is dropped after its
        # attention, so nothing is held between steps
        held = caches[True].scratch.get("aqua.rebuild")
        assert (held is None) if l == 5 else (held[0] == l)
        for x, y in zip(a.dequantized(), b.dequantized(), strict=True):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    mem_a, mem_b = caches[True].layer(3).memory_bytes(), caches[False].layer(3).memory_bytes()
    assert mem_a["reconstruction"] == 0 < mem_b["reconstruction"] and mem_a["quantized"] == mem_b["quantized"]
    assert mem_a["total"] == mem_b["total"] - mem_b["reconstruction"]
    # the rebuild is the decode path (reconstruct_from_codes) and survives a layer being asked out of order
    decoded = reconstruct_from_codes([caches[True].layer(l) for l in range(6)])
    for l in (0, 5, 3):  # the slot holds another layer's rebuild each time: rebuilt down the layers
        k, v = caches[True].layer(l)._rebuilt()
        torch.testing.assert_close(k, decoded[l][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, decoded[l][1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("operands", ["bf16", "fp16"])
def test_half_operands_put_the_op_on_tensor_cores_and_stay_consistent(operands):
    # operands="bf16"/"fp16": the predictor GEMMs' inputs and weights rounded to it (the op's tensor-core path);
    # encode and decode use the same operands, so the decode path still reproduces what was encoded, mode (a) still
    # attends what mode (b) keeps, and the reconstruction stays close to the fp32-operand one
    preds = _random_predictors(4)
    caches = {
        (ops_, rec): ModelKVCache(AquaConfig(predictors=preds, operands=ops_, recompute=rec), num_layers=4)
        for ops_ in (operands, "fp32")
        for rec in (False, True)
    }
    g = torch.Generator().manual_seed(15)
    kv = [(torch.randn(1, H, 200, D, generator=g), torch.randn(1, H, 200, D, generator=g)) for _ in range(4)]
    for cache in caches.values():
        for l, (k, v) in enumerate(kv):
            cache.append(l, k, v)
    half = caches[(operands, False)]
    assert half.layer(1).weights.key_weight.dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[operands]
    decoded = reconstruct_from_codes([half.layer(l) for l in range(4)])
    torch.testing.assert_close(half.layer(3)._v_rec.view(), decoded[3][1].reshape(1, 196, H, D).permute(0, 2, 1, 3))
    q = torch.randn(1, 9, 1, D, generator=torch.Generator().manual_seed(16))
    _assert_modes_agree(caches[(operands, True)], half, q)
    full = caches[("fp32", False)]
    for l, (k, v) in enumerate(kv):  # as accurate as fp32 operands, against the K/V that went in
        for got, want, x in zip(half.layer(l).dequantized(), full.layer(l).dequantized(), (k, v), strict=True):
            assert aqua.rel_mse(got, x) < 1.02 * aqua.rel_mse(want, x), l
    with pytest.raises(ValueError, match="operands must be one of"):
        AquaConfig(operands="float8")


def _both_modes(preds, layers):
    return [ModelKVCache(AquaConfig(predictors=preds, recompute=mode), num_layers=layers) for mode in (True, False)]


def _assert_modes_agree(a: ModelKVCache, b: ModelKVCache, q):
    for l in range(a.num_layers):
        assert a.layer(l).chunks == b.layer(l).chunks
        torch.testing.assert_close(a.layer(l).attention(q), b.layer(l).attention(q), atol=1e-5, rtol=1e-5)


def test_batch_edits_and_reset_keep_the_two_modes_in_step():
    # B = 3 rows, batch-major everywhere; reorder / batch_select / batch_repeat_interleave between steps (beam
    # search), a commit after each, then a reset and a new prefill: mode (a)'s rebuild (scratch entries keyed by the
    # layer's state version) must follow every edit, and a B = 1 cache of one row must equal that row
    preds = _random_predictors(3, rank=16)
    a, b = _both_modes(preds, 3)
    g = torch.Generator().manual_seed(8)
    q = torch.randn(3, 9, 1, D, generator=g)
    for cache in (a, b):
        _fill(cache, [150, 1], seed=9, B=3)
    _assert_modes_agree(a, b, q)
    for edit in ("reorder", "select", "repeat"):
        a.layer(0).attention(q)  # leaves layer 0's rebuild in the scratch: the edit must make it stale
        for cache in (a, b):
            for l in range(3):
                layer = cache.layer(l)
                if edit == "reorder":
                    layer.reorder(torch.tensor([2, 0, 1]))
                elif edit == "select":
                    layer.batch_select(torch.tensor([0, 2, 1]))
                else:
                    layer.batch_select(torch.tensor([1]))
                    layer.batch_repeat_interleave(3)
        torch.testing.assert_close(a.layer(0).attention(q), b.layer(0).attention(q), atol=1e-5, rtol=1e-5)
        for cache in (a, b):
            _fill(cache, [60, 70], seed=10, B=3)  # commits once more after the edit
        _assert_modes_agree(a, b, q)
    # one row alone attends as that row of the batch (per-token predictors, per-row codes: rows never mix)
    batch, single = _both_modes(preds, 3)[0], _both_modes(preds, 3)[0]
    for step in (150, 1):
        for l in range(3):
            k, v = torch.randn(3, H, step, D, generator=g), torch.randn(3, H, step, D, generator=g)
            batch.append(l, k, v)
            single.append(l, k[1:2], v[1:2])
    torch.testing.assert_close(single.layer(2).attention(q[1:2]), batch.layer(2).attention(q)[1:2])
    for cache in (a, b):
        cache.reset()
        assert cache.scratch == {}
        _fill(cache, [140], seed=11, B=3)
    _assert_modes_agree(a, b, q)


def test_filled_under_inference_mode_appends_outside_it():
    # a cache filled under torch.inference_mode() and appended to under no_grad (its buffers are cloned once)
    for cache in _both_modes(_random_predictors(2), 2):
        with torch.inference_mode():
            _fill(cache, [120], seed=12)
        with torch.no_grad():
            _fill(cache, [20], seed=13)  # commits: writes into the stores and the reconstruction
        assert cache.layer(1).chunks == [(0, 136)]


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("cut", [400, 330, 300, 200, 100, 4, 2, -5])
def test_crop_keeps_a_decodable_prefix_and_goes_on(recompute, cut):
    # 4 sinks + chunks [0, 196) and [196, 324) + a 76-token tail = 400 tokens; every cut point: the kept tokens read
    # back as they did (nothing is re-encoded), and appending after the cut commits consistent chunks in every layer
    preds = _random_predictors(3)
    cache = ModelKVCache(AquaConfig(predictors=preds, recompute=recompute), num_layers=3)
    _fill(cache, [200, 124, 76], seed=6)
    before = [cache.layer(l).dequantized() for l in range(3)]
    keep = cut if cut >= 0 else 400 + cut
    for l in range(3):
        cache.layer(l).crop(cut)
    for l in range(3):
        layer = cache.layer(l)
        assert layer.seq_len == keep
        for x, full in zip(layer.dequantized(), before[l], strict=True):
            torch.testing.assert_close(x, full[:, :, :keep], atol=1e-5, rtol=1e-5)
    assert all(cache.layer(l).chunks == cache.layer(0).chunks for l in range(3))
    _fill(cache, [150, 1], seed=7)  # the tail commits again (>= 128), from the cut on
    layers = [cache.layer(l) for l in range(3)]
    assert all(c.chunks == layers[0].chunks for c in layers) and layers[0].seq_len == keep + 151
    assert layers[0].chunks[-1][1] == layers[0].key_store.n and layers[0].key_tail.shape[2] < 128
    decoded = reconstruct_from_codes(layers)
    for l, layer in enumerate(layers):
        n = layer.key_store.n
        k_hat = decoded[l][0]
        k = aqua.rope(k_hat.reshape(1, n, H, D).permute(0, 2, 1, 3), torch.arange(4, 4 + n), INV_FREQ)
        torch.testing.assert_close(layer.dequantized()[0][:, :, 4 : 4 + n], k.to(layer.dtype).float())
    if recompute:  # the same history in mode (b), whose commits keep what they encoded: the same attention
        kept = ModelKVCache(AquaConfig(predictors=preds), num_layers=3)
        _fill(kept, [200, 124, 76], seed=6)
        for l in range(3):
            kept.layer(l).crop(cut)
        _fill(kept, [150, 1], seed=7)
        _assert_modes_agree(cache, kept, torch.randn(1, 9, 1, D, generator=torch.Generator().manual_seed(14)))


def test_memory_and_bits():
    cache = ModelKVCache(AquaConfig(predictors=_random_predictors(2)), num_layers=2)
    _fill(cache, [132])
    mem = cache.layer(1).memory_bytes()
    codes_per_token = C * 2 // 8 + C // 64 * 2  # 2-bit codes + one fp16 norm per group of 64, per tensor
    assert mem["quantized"] == 2 * 128 * codes_per_token
    esize = cache.layer(1).dtype.itemsize  # the cache dtype (fp32 here: ModelKVCache takes the first K/V's)
    assert mem["reconstruction"] == 2 * 128 * C * esize  # K and V of the committed tokens (mode b)
    assert mem["total"] == mem["quantized"] + mem["window"] + mem["reconstruction"]
    eb = effective_bits(AquaConfig(), num_layers=28)  # the paper's Table 2 formula, HIGGS G -> our G = 64
    assert eb.average == pytest.approx((27 * (2 + 16 / 64) + (4 + 16 / 64)) / 28)
    assert get_format("aqua").presets == {}


def test_errors():
    with pytest.raises(ValueError, match="needs calibrated predictors"):
        ModelKVCache(AquaConfig(), num_layers=2).append(0, torch.randn(1, H, 1, D), torch.randn(1, H, 1, D))
    with pytest.raises(ValueError, match="another backbone.*bits: 3, 2"):
        ModelKVCache(AquaConfig(predictors=_random_predictors(2, bits=3)), num_layers=2).append(
            0, torch.randn(1, H, 1, D), torch.randn(1, H, 1, D)
        )
    with pytest.raises(ValueError, match="192 channels per token"):
        ModelKVCache(AquaConfig(predictors=_random_predictors(2)), num_layers=2).append(
            0, torch.randn(1, 2, 1, D), torch.randn(1, 2, 1, D)
        )
    cache = ModelKVCache(AquaConfig(predictors=_random_predictors(2)), num_layers=2)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, H, 140, D, generator=g)
    with pytest.raises(RuntimeError, match="appended in order"):
        cache.append(1, k, k)  # layer 1 commits before layer 0 has
    with pytest.raises(ValueError, match="bits must be one of"):
        AquaConfig(bits=1)
    with pytest.raises(ValueError, match="predictors must be"):
        AquaConfig(predictors=3)
    with pytest.raises(ValueError, match="recompute must be a bool"):
        AquaConfig(recompute=1)


def test_predictor_file_roundtrip_through_the_config(tmp_path):
    preds = _random_predictors(2)
    preds.inv_freq = INV_FREQ
    path = preds.save(tmp_path / "p.safetensors")
    a = ModelKVCache(AquaConfig(predictors=str(path)), num_layers=2)
    b = ModelKVCache(AquaConfig(predictors=preds), num_layers=2)
    _fill(a, [140], seed=5)
    _fill(b, [140], seed=5)
    for l in range(2):
        assert all(torch.equal(x, y) for x, y in zip(a.layer(l).dequantized(), b.layer(l).dequantized(), strict=True))


def test_kvkernels_cache_by_format_name_in_generate():
    # the format has no presets (a preset cannot carry predictors): KVKernelsCache takes its name + predictors=
    from cache_helpers import tiny_llama

    from kvkernels.integrations.transformers import KVKernelsCache, method_config

    model = tiny_llama(head_dim=D, layers=3, heads=6, kv_heads=H)
    preds = _random_predictors(3)
    assert method_config("aqua", predictors=preds) == AquaConfig(predictors=preds, block=128)
    cache = KVKernelsCache("aqua", config=model.config, predictors=preds, block=32)
    ids = torch.randint(0, 128, (1, 70), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model.generate(ids, past_key_values=cache, max_new_tokens=40, do_sample=False)
    assert out.shape == (1, 110) and cache.paths["fused"] == 3 * 39
    assert cache.layers[1].cache.chunks[-1][1] > 70  # decode steps committed chunks too
    # mode (a) through generate(): the same tokens, with no reconstruction kept
    rebuilt = KVKernelsCache("aqua", config=model.config, predictors=preds, block=32, recompute=True)
    with torch.no_grad():
        out_a = model.generate(ids, past_key_values=rebuilt, max_new_tokens=40, do_sample=False)
    assert torch.equal(out_a, out) and rebuilt.layers[1].cache.memory_bytes()["reconstruction"] == 0
    with pytest.raises(ValueError, match="unknown method 'aqua2'"):
        method_config("aqua2")
