"""XQuant: the layer plan and its pair rule, the paper's bit counts, borrowed codes against a reference written from
the formulas, memory accounting, and generate() (greedy, beam search, prompt-lookup crops) across a sharing pair."""

import pytest
import torch
from cache_helpers import tiny_llama

from kvkernels import effective_bits
from kvkernels.cache import ModelKVCache
from kvkernels.formats import PRESETS, get_format, make_layer_cache
from kvkernels.formats.xquant import XQuantConfig, layer_plan, paper_equivalent_bits, stored_bits
from kvkernels.reference.packing import unpack_bits

G = 32


# -- bit counts ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "thresholds, bits",
    [
        ((30, 2, 32, 16), 1.375),  # the paper's "1.38" (Mistral, Table 3)
        ((28, 0, 32, 28), 1.40625),  # "1.4" (Llama-2 TruthfulQA)
        ((32, 0, 32, 20), 1.40625),  # "1.4" (Llama-2-chat)
        ((32, 32, 32, 8), 1.625),  # Table 5/6's "1.63": keys 2-bit, values 2-bit shared from layer 8
        ((32, 0, 32, 32), 1.5),  # AsymKV-32/0
        ((32, 32, 32, 32), 2.0),  # KIVI-2
        ((20, 0, 32, 12), 1.15625),  # Table 7's narrowest width (the xquant_1.16 preset)
    ],
)
def test_paper_equivalent_bits(thresholds, bits):
    kq, vq, km, vm = thresholds
    cfg = XQuantConfig(kq=kq, vq=vq, km=km, vm=vm)
    assert paper_equivalent_bits(cfg, 32) == bits
    # the honest count adds every layer's own fp16 zero and scale per group, borrowers included
    k, v = stored_bits(cfg, 32)
    assert (k + v) / 2 == pytest.approx(bits + 32 / G)


def test_presets_and_effective_bits():
    assert paper_equivalent_bits(PRESETS["xquant_1.38"]) == 1.375
    assert paper_equivalent_bits(PRESETS["xquant_1.16"]) == 1.15625
    eb = effective_bits(PRESETS["xquant_1.38"])
    assert (eb.key, eb.value, eb.average) == (2.9375, 1.8125, 2.375)  # KIVI-2 stores 3.0 / 3.0
    assert "paper bits 1.375" in get_format("xquant").describe(PRESETS["xquant_1.38"])


# -- the plan ------------------------------------------------------------------------------------------------
def test_plan_follows_the_paper():
    plan = layer_plan(XQuantConfig(kq=30, vq=2, km=32, vm=16), 32)
    keys, values = [p[0] for p in plan], [p[1] for p in plan]
    assert [k.bits for k in keys] == [2] * 30 + [1] * 2
    assert all(k.code_layer == i for i, k in enumerate(keys))  # km = 32: no key sharing
    assert [v.bits for v in values] == [2] * 2 + [1] * 30
    assert [v.code_layer for v in values] == [i - (i % 2 and i >= 16) for i in range(32)]
    assert {v.eta for v in values[2:]} == {0.2} and keys[0].eta == 0.05  # eta1 at 1 bit, eta2 at 2 bits


@pytest.mark.parametrize("num_layers", [1, 2, 7, 22, 30, 32, 40, 80])
def test_presets_scale_to_any_layer_count(num_layers):
    for name in ("xquant_1.38", "xquant_1.16"):
        plan = layer_plan(PRESETS[name], num_layers)
        for layer, pair in enumerate(plan):
            for p in pair:
                if p.borrows(layer):
                    assert p.code_layer == layer - 1 and layer % 2 == 1
                    assert plan[layer - 1][pair.index(p)].bits == p.bits


def test_a_pair_of_two_widths_is_rejected():
    with pytest.raises(ValueError, match="layer 3 borrows the value codes of layer 2.*put vq on an even layer"):
        XQuantConfig(kq=4, vq=3, km=4, vm=0, ref_layers=None)
    with pytest.raises(ValueError, match="put kq on an even layer"):
        layer_plan(XQuantConfig(kq=5, vq=0, km=0, vm=0, ref_layers=None), 8)
    for bad in ({"kq": -1}, {"vm": 40}, {"ref_layers": 0}, {"eta1": 0.5}, {"group_size": 48}):
        with pytest.raises(ValueError):
            XQuantConfig(**bad)


def test_needs_the_layer_count_in_a_model():
    with pytest.raises(ValueError, match="must know the layer count"):
        ModelKVCache(PRESETS["xquant_1.38"]).append(0, torch.randn(1, 2, 4, 64), torch.randn(1, 2, 4, 64))


# -- borrowed codes against the formulas ---------------------------------------------------------------------
def _formula_params(x: torch.Tensor, bits: int, eta: float):
    # XQuant Eq. 9 on groups along the last dim: z' = z + eta s (2^b - 1), s' = (1 - 2 eta) s, fp16 as stored
    xg = x.float().unflatten(-1, (-1, G))
    qmax = 2**bits - 1
    z = xg.amin(-1).half().float()
    s = ((xg.amax(-1) - xg.amin(-1)) / qmax).half().float()
    return ((1 - 2 * eta) * s).half().float(), (z + eta * s * qmax).half().float()


def _formula_dequant(codes: torch.Tensor, s: torch.Tensor, z: torch.Tensor, bits: int) -> torch.Tensor:
    u = unpack_bits(codes.contiguous(), bits).float().unflatten(-1, (-1, G))
    return (u * s.unsqueeze(-1) + z.unsqueeze(-1)).flatten(-2)


@pytest.mark.parametrize("bits", [1, 2])
def test_borrower_dequantizes_the_owner_codes_with_its_own_parameters(bits):
    q = 4 if bits == 2 else 0
    cfg = XQuantConfig(kq=q, vq=q, km=0, vm=0, ref_layers=None, residual=32, eta1=0.2, eta2=0.05)
    eta = cfg.eta2 if bits == 2 else cfg.eta1
    model = ModelKVCache(cfg, num_layers=4, capacity=64)
    gen = torch.Generator().manual_seed(bits)
    kv = [(torch.randn(2, 2, 203, 64, generator=gen), torch.randn(2, 2, 203, 64, generator=gen)) for _ in range(4)]
    for layer in range(4):  # a prefill of 150 tokens, then one token per step, layers in order
        model.append(layer, kv[layer][0][:, :, :150], kv[layer][1][:, :, :150])
    for t in range(150, 203):
        for layer in range(4):
            model.append(layer, kv[layer][0][:, :, t : t + 1], kv[layer][1][:, :, t : t + 1])
    for owner, borrower in ((0, 1), (2, 3)):
        o, b = model.layer(owner), model.layer(borrower)
        assert b.key_store.n == o.key_store.n > 0 and b.value_store.n == o.value_store.n > 0
        # keys: per channel, groups of G tokens ("cols": the store holds K^T)
        n = b.key_store.n
        s, z = _formula_params(kv[borrower][0][:, :, :n].transpose(2, 3), bits, eta)
        want = _formula_dequant(o.key_store.codes[..., : n * bits // 32], s, z, bits).transpose(2, 3)
        torch.testing.assert_close(b.key_store.dequantize(), want, rtol=0, atol=1e-6)
        # values: per token, groups of G channels
        n = b.value_store.n
        s, z = _formula_params(kv[borrower][1][:, :, :n], bits, eta)
        want = _formula_dequant(o.value_store.codes[:, :, :n], s, z, bits)
        torch.testing.assert_close(b.value_store.dequantize(), want, rtol=0, atol=1e-6)
        # and the fused GEMVs read the same thing: attention equals attention over the dequantized cache
        qry = torch.randn(2, 4, 1, 64, generator=gen)
        k, v = b.dequantized()
        scores = (qry.view(2, 2, 2, 64) @ k.transpose(-1, -2)).view(2, 4, 1, -1) / 8
        ref = (torch.softmax(scores, -1).view(2, 2, 2, -1) @ v).view(2, 4, 1, 64)
        torch.testing.assert_close(b.attention(qry), ref, rtol=1e-5, atol=1e-5)


def test_memory_counts_no_codes_for_a_borrower():
    cfg = XQuantConfig(kq=2, vq=2, km=0, vm=0, ref_layers=None, residual=32)
    model = ModelKVCache(cfg, num_layers=2, capacity=64)
    x = torch.randn(1, 2, 160, 64)
    model.append(0, x, x)
    model.append(1, x, x)
    owner, borrower = model.layer(0).memory_bytes(), model.layer(1).memory_bytes()
    n_k, n_v = model.layer(1).key_store.n, model.layer(1).value_store.n
    meta = lambda n: 2 * 2 * (n * 64 // G) * 2  # noqa: E731  (H=2) x (scale + zero) x groups x 2 bytes
    assert borrower["key_quantized"] == meta(n_k) and borrower["value_quantized"] == meta(n_v)
    codes = lambda n: 2 * n * 64 * 2 // 8  # noqa: E731  2 bits
    assert owner["key_quantized"] == meta(n_k) + codes(n_k)
    assert owner["value_quantized"] == meta(n_v) + codes(n_v)


def test_a_standalone_layer_owns_its_codes():
    cache = make_layer_cache(PRESETS["xquant_1.38"], 1, 2, 64, capacity=64, dtype=torch.float32)
    assert cache.layer_idx == 0 and not any(p.borrows(0) for p in cache.plan)
    cache.append(torch.randn(1, 2, 300, 64), torch.randn(1, 2, 300, 64))
    assert cache.key_store.bits == 2 and cache.value_store.bits == 2 and cache.value_store.eta == 0.05


# -- generate() across a sharing pair -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    return tiny_llama(head_dim=64, layers=2, heads=4, kv_heads=2, vocab=96, hidden=128)


SHARED = {"kq": 2, "vq": 0, "km": 0, "vm": 0, "ref_layers": None, "residual": 16}  # layer 1 borrows K and V


def test_generate_greedy_beam_and_prompt_lookup(model, monkeypatch):
    from kvkernels.integrations.transformers import KVKernelsCache

    crops = []
    crop = KVKernelsCache.crop
    monkeypatch.setattr(KVKernelsCache, "crop", lambda self, n: (crops.append(n), crop(self, n))[1])

    ids = torch.randint(0, 96, (1, 120), generator=torch.Generator().manual_seed(0))
    ids[:, 60:90] = ids[:, 20:50]  # repeated text, so prompt lookup proposes (and crops) candidates

    def run(**kw):
        cache = KVKernelsCache("xquant_1.38", config=model.config, **SHARED)
        out = model.generate(ids, past_key_values=cache, max_new_tokens=12, do_sample=False, **kw)
        return out, cache

    greedy, cache = run()
    layer1 = cache.layers[1].cache
    assert layer1.plan[0].borrows(1) and layer1.plan[1].borrows(1) and cache.paths["fused"] > 0
    beams, _ = run(num_beams=3)
    lookup, lookup_cache = run(prompt_lookup_num_tokens=4)
    assert greedy.shape == beams.shape == lookup.shape == (1, 132)
    assert lookup_cache.get_seq_length() == 131 and crops  # rejected candidates were cropped across the pair
    assert all(layer.cache.seq_len == 131 for layer in lookup_cache.layers)


def test_fused_equals_the_dequantized_path(model):
    from kvkernels.integrations.transformers import KVKernelsCache

    ids = torch.randint(0, 96, (1, 100), generator=torch.Generator().manual_seed(1))
    logits = []
    for fused in (True, False):
        cache = KVKernelsCache("xquant_1.38", config=model.config, fused=fused, **SHARED)
        with torch.no_grad():
            out = [model(ids[:, :60], past_key_values=cache).logits[:, -1]]
            out += [model(ids[:, t : t + 1], past_key_values=cache).logits[:, -1] for t in range(60, 100)]
        logits.append(torch.stack(out))
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=1e-5)
