"""transformers integration: KVKernelsCache + the "kvkernels" attention on a tiny random Llama (CPU, fp32).

Model: 2 layers, hidden 128, 4 query heads, 2 KV heads (GQA), head_dim 32, vocab 128, initializer_range 0.02.
Windows are shrunk (w_sink 4, w_recent 8, group 32) so that an 80-token prompt + 40 new tokens quantize ~100
tokens per layer. Logit comparisons are teacher-forced (every cache sees the same token sequence), so greedy
divergence cannot hide or fake an error.
"""

import copy
import subprocess
import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

from kvkernels.formats import preset_format  # noqa: E402
from kvkernels.integrations.transformers import (  # noqa: E402
    METHODS,
    KVKernelsCache,
    KVKernelsLayer,
    generate_with_method,
    kvkernels_attention_forward,
    method_config,
    set_kvkernels_attention,
)

QUANT_METHODS = [m for m in METHODS if m != "fp16"]
# formats that choose what to attend to exactly from the attention itself (SpeCache's top-k rows): only the fused
# path sees the probabilities, so its results legitimately differ from dequantize-then-SDPA over the same stores
SELECTS = {m for m in QUANT_METHODS if preset_format(m).speculative_decode(method_config(m))}
PATH_METHODS = [m for m in QUANT_METHODS if m not in SELECTS]
SMALL = {"group_size": 32, "w_sink": 4, "w_recent": 8}  # quantizes all but 12 (+ G - 1) tokens
WIDE = {"group_size": 32, "w_sink": 4, "w_recent": 256}  # windows cover all 120 tokens: nothing is quantized
FOUR_BIT = {
    "innerq4_asym": ("innerq_base", {**SMALL, "bits": 4, "key_mode": "asym", "value_mode": "asym"}),
    "kivi4": ("kivi4", SMALL),
}
PROMPT, NEW = 80, 40


def m_has_field(method: str, field: str) -> bool:
    return method != "fp16" and field in preset_format(method).override_names()


LAYERS = 2

# Measured on this model (teacher-forced, 39 decode steps; torch 2.13 CPU: reference logits max |.| 0.83, std 0.22):
#   relative L2 error ||l - l_fp16|| / ||l_fp16||: innerq 4-bit asym 0.022, kivi4 0.028, innerq_base 0.059,
#   innerq_hybrid 0.106, kivi2 0.136, innerq_asym1_eta 0.154, innerq_small 0.172, kivi1_eta 0.252; max abs error
#   0.018 / 0.024 (4-bit). Windows covering everything: 3.0e-7 relative, 2.7e-7 max abs (fp32 rounding only).
FOUR_BIT_REL, FOUR_BIT_ABS = 0.05, 0.05
EXACT_ATOL = 1e-4  # same math up to fp32 summation order
PATH_ATOL = 1e-5  # fused vs dequantize-then-SDPA over identical cache contents


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=128,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    m = LlamaForCausalLM(cfg).eval()
    set_kvkernels_attention(m)
    return m


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 128, (1, PROMPT + NEW), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def teacher_forced(model, cache, ids, chunks=None, attention_mask=None, prompt=PROMPT):
    """Prefill ids[:, :prompt], then feed the rest in `chunks` (default one token at a time).

    Returns the logits predicting positions prompt .. end, [B, len - prompt, vocab] (the prefill's last row first).
    """
    rest = ids.shape[1] - prompt
    chunks = chunks or [1] * (rest - 1)
    kw = {"past_key_values": cache, "use_cache": True}
    m = attention_mask
    out = [model(ids[:, :prompt], attention_mask=None if m is None else m[:, :prompt], **kw).logits[:, -1:]]
    pos = prompt
    for c in chunks:
        am = None if m is None else m[:, : pos + c]
        out.append(model(ids[:, pos : pos + c], attention_mask=am, **kw).logits)
        pos += c
    return torch.cat(out, dim=1)


@pytest.fixture(scope="module")
def ref_logits(model, tokens):
    return teacher_forced(model, DynamicCache(config=model.config), tokens)


def rel_err(a, b):
    return float((a - b).norm() / b.norm())


# ---------------------------------------------------------------------------------------------------------
# end to end


@pytest.mark.parametrize("method", METHODS)
def test_generate_runs_every_method(model, tokens, method):
    # SpeCache's 64 prefetched fp16 rows would be most of a 120-token cache: 8 here
    small = SMALL | ({"topk": 8} if m_has_field(method, "topk") else {})
    cache = KVKernelsCache(method, config=model.config, **small)
    with torch.no_grad():
        out = model.generate(tokens[:, :PROMPT], past_key_values=cache, max_new_tokens=NEW, do_sample=False)
    assert out.shape == (1, PROMPT + NEW)
    assert cache.get_seq_length() == PROMPT + NEW - 1  # the last generated token is never fed back
    if method == "fp16":
        assert cache.paths["full"] == LAYERS * NEW
        return
    assert cache.paths == {"prefill": LAYERS, "fused": LAYERS * (NEW - 1), "dequantized": 0, "full": 0}
    for layer in cache.layers:
        counts = layer.cache.token_counts()
        assert counts["key_quantized"] >= 64 and counts["value_quantized"] >= 64, counts
    mem = cache.memory_bytes()
    assert mem["total"] < 0.6 * mem["fp16_equivalent"], mem


@pytest.mark.parametrize("method", ["innerq_base", "kivi2"])
def test_windows_covering_everything_match_dynamic_cache(model, tokens, ref_logits, method):
    # nothing is quantized, so the fused path (windows only) must reproduce plain SDPA over a DynamicCache
    logits = teacher_forced(model, KVKernelsCache(method, config=model.config, **WIDE), tokens)
    torch.testing.assert_close(logits, ref_logits, atol=EXACT_ATOL, rtol=0)
    with torch.no_grad():
        ids = tokens[:, :PROMPT]
        want = model.generate(ids, past_key_values=DynamicCache(config=model.config), max_new_tokens=NEW)
        cache = KVKernelsCache(method, config=model.config, **WIDE)
        got = model.generate(ids, past_key_values=cache, max_new_tokens=NEW)
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", sorted(FOUR_BIT))
def test_4bit_logits_close_to_fp16(model, tokens, ref_logits, name):
    method, overrides = FOUR_BIT[name]
    cache = KVKernelsCache(method, config=model.config, **overrides)
    logits = teacher_forced(model, cache, tokens)
    assert cache.layers[0].cache.token_counts()["key_quantized"] > 64  # the bound is about quantized tokens
    rel, mx = rel_err(logits, ref_logits), float((logits - ref_logits).abs().max())
    assert rel < FOUR_BIT_REL and mx < FOUR_BIT_ABS, (rel, mx)


def test_error_grows_as_bits_shrink(model, tokens, ref_logits):
    errs = [rel_err(teacher_forced(model, KVKernelsCache(m, config=model.config, **SMALL), tokens), ref_logits)
            for m in ("kivi4", "kivi2", "kivi1_eta")]  # fmt: skip
    assert errs[0] < errs[1] < errs[2], errs


# ---------------------------------------------------------------------------------------------------------
# fused path == dequantize-then-SDPA on the same cache contents


@pytest.mark.parametrize("method", PATH_METHODS)
def test_fused_matches_dequantized_sdpa_in_model(model, tokens, method):
    # fused=False makes update() return the dequantized cache to SDPA; the cache contents are identical.
    # Chunks: 3 tokens at once right after the prefill (q_len > 1 decode, causal mask among them), then singles,
    # then 5 at once (crosses a G-token value/key eviction boundary inside one append).
    chunks = [3] + [1] * 30 + [5]
    fused = teacher_forced(model, KVKernelsCache(method, config=model.config, **SMALL), tokens, chunks)
    deq_cache = KVKernelsCache(method, config=model.config, fused=False, **SMALL)
    deq = teacher_forced(model, deq_cache, tokens, chunks)
    assert deq_cache.paths["fused"] == 0 and deq_cache.paths["dequantized"] == LAYERS * len(chunks)
    torch.testing.assert_close(fused, deq, atol=PATH_ATOL, rtol=0)


@pytest.mark.parametrize("method", ["innerq_base", "kivi2"])
def test_multi_token_decode_matches_dynamic_cache(model, tokens, ref_logits, method):
    # q_len = 3 after the prefill on the fused path, exact windows: same as DynamicCache fed one at a time
    chunks = [3] + [1] * (NEW - 4)
    logits = teacher_forced(model, KVKernelsCache(method, config=model.config, **WIDE), tokens, chunks)
    torch.testing.assert_close(logits, ref_logits, atol=EXACT_ATOL, rtol=0)


class _Attn(torch.nn.Module):  # what the attention functions read off the module
    num_key_value_groups, is_causal, layer_idx = 2, True, 0


def _causal(T, N, pad=None):
    # [B, 1, T, N] bool: query row t (position N - T + t) sees keys j <= N - T + t, minus the padded keys
    keep = torch.arange(N)[None, :] <= torch.arange(N - T, N)[:, None]
    keep = keep[None, None].repeat(2, 1, 1, 1)
    if pad is not None:
        keep[1, :, :, :pad] = False
    return keep


@pytest.mark.parametrize("method", PATH_METHODS)
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "pad-mask"])
def test_fused_attention_equals_dequantize_then_sdpa(method, T, masked):
    g = torch.Generator().manual_seed(2)
    B, H_kv, H_q, D, N0 = 2, 2, 4, 32, 77
    layer = KVKernelsLayer(method_config(method, **SMALL), fused=True)
    k, v = torch.randn(B, H_kv, N0, D, generator=g), torch.randn(B, H_kv, N0, D, generator=g)
    layer.update(k, v)  # prefill
    hk, hv = layer.update(*(torch.randn(B, H_kv, T, D, generator=g) for _ in range(2)))
    assert hk.shape == (B, H_kv, 0, D)
    q = torch.randn(B, H_q, T, D, generator=g)
    N = N0 + T
    mask = _causal(T, N, pad=5) if masked else None
    got, _ = kvkernels_attention_forward(_Attn(), q, hk, hv, mask, scaling=D**-0.5)
    K, V = layer.cache.dequantized()
    want, _ = sdpa_attention_forward(_Attn(), q, K, V, _causal(T, N, pad=5 if masked else None), scaling=D**-0.5)
    assert got.shape == (B, T, H_q, D)
    torch.testing.assert_close(got, want, atol=PATH_ATOL, rtol=0)


# ---------------------------------------------------------------------------------------------------------
# generation features: beam search, crop / assisted decoding, left padding


# Beam search. With 2 beams the running beams share most of their prefix (a step that keeps two continuations of
# one beam collapses them), so a reorder_cache that mishandled a quantized store would only show where that store
# differs between the two rows. BEAM windows make both stores differ early: w_recent 0 quantizes every token
# after the sink at once into the per-token store (InnerQ keys, KIVI values), and a BEAM_PROMPT-token prompt
# leaves 31 tokens in the token-grouped tail (InnerQ values, KIVI keys; G = 32), so the first decode step
# quantizes a group holding the first generated token, which differs between the two beams. Skipping the
# index_select of either store in reorder shifts the teacher-forced check below by 2e-3 to 6e-3 (per-token
# store) and 4e-2 to 0.15 (token-grouped store) for every method; a correct reorder agrees to ~3e-7.
BEAM = {"group_size": 32, "w_sink": 4, "w_recent": 0}
BEAM_PROMPT = 67  # (67 - w_sink) % 32 == 31


@pytest.mark.parametrize("method", METHODS)
def test_beam_search(model, tokens, method):
    ids = tokens[:, :BEAM_PROMPT]
    kw = {"num_beams": 2, "num_return_sequences": 2, "max_new_tokens": 12, "do_sample": False}
    kw |= {"return_dict_in_generate": True, "output_logits": True}
    reorders = []
    cache = KVKernelsCache(method, config=model.config, **BEAM)
    reorder = cache.reorder_cache
    cache.reorder_cache = lambda idx: (reorders.append(idx.tolist()), reorder(idx))[1]
    with torch.no_grad():
        want = model.generate(ids, past_key_values=DynamicCache(config=model.config), **kw)
        got = model.generate(ids, past_key_values=cache, **kw)
        if method != "fp16":
            exact = model.generate(ids, past_key_values=KVKernelsCache(method, config=model.config, **WIDE), **kw)
            deq_cache = KVKernelsCache(method, config=model.config, fused=False, **BEAM)
            deq = model.generate(ids, past_key_values=deq_cache, **kw)
    assert cache.layers[0].batch_size == 2 and any(i != [0, 1] for i in reorders[1:]), reorders
    logits = torch.stack(got.logits)  # [steps, beams, V]: row b of step t = running beam b at step t
    if method == "fp16":
        assert torch.equal(got.sequences, want.sequences)
        torch.testing.assert_close(logits, torch.stack(want.logits), atol=EXACT_ATOL, rtol=0)
    else:
        assert cache.paths["fused"] > 0 and deq_cache.paths["fused"] == 0
        for layer in cache.layers:  # both quantized stores hold generated (beam-dependent) tokens
            counts = layer.cache.token_counts()
            assert min(counts["key_quantized"], counts["value_quantized"]) > BEAM_PROMPT - BEAM["w_sink"], counts
        # nothing quantized: the fp16 windows must be reordered exactly like DynamicCache's tensors
        assert torch.equal(exact.sequences, want.sequences)
        if method not in SELECTS:
            # fused vs dequantize-then-SDPA: same cache contents (both reordered by the same code), same beams
            assert torch.equal(got.sequences, deq.sequences)
            torch.testing.assert_close(logits, torch.stack(deq.logits), atol=PATH_ATOL, rtol=0)
    # independent of reorder_cache: the logits each returned sequence was chosen from (the row its beam occupied at
    # each step, beam_indices) equal teacher-forcing that sequence through a fresh cache of the same method
    # (batch 2 = the two returned sequences, so every matmul has the beam-search shapes)
    steps = torch.arange(logits.shape[0])
    chosen = torch.stack([logits[steps, got.beam_indices[r]] for r in range(2)])  # [2, steps, V]
    ref = teacher_forced(model, KVKernelsCache(method, config=model.config, **BEAM), got.sequences, prompt=BEAM_PROMPT)
    torch.testing.assert_close(chosen, ref, atol=PATH_ATOL, rtol=0)


@pytest.mark.parametrize("method", METHODS)
def test_crop_then_continue(model, tokens, method):
    # Two crops, each followed by re-feeding the dropped tokens one at a time: crop(-20) (drop the last 20 of the
    # 119 tokens held) and crop(PROMPT) (keep the first PROMPT). With SMALL windows both cuts land inside both
    # quantized stores (checked with token_counts below): the per-token store (InnerQ keys, KIVI values) is
    # truncated, and the token-grouped one (InnerQ values, KIVI keys) is cut inside a G-token group, whose kept
    # tokens go back to the fp16 tail dequantized. A crop that only trimmed the fp16 tails cannot pass.
    caches = [KVKernelsCache(method, config=model.config, fused=f, **SMALL) for f in (True, False)]
    for cache in caches:
        teacher_forced(model, cache, tokens)  # holds PROMPT + NEW - 1 tokens
    held = PROMPT + NEW - 1
    for crop, keep in ((-20, held - 20), (PROMPT, PROMPT)):
        before = [layer.cache.dequantized() for layer in caches[0].layers]
        counts = [layer.cache.token_counts() for layer in caches[0].layers] if method != "fp16" else None
        for cache in caches:
            cache.crop(crop)
            assert cache.get_seq_length() == keep
        for i, (layer, (k, v)) in enumerate(zip(caches[0].layers, before, strict=True)):
            k2, v2 = layer.cache.dequantized()  # a crop never re-quantizes: exactly the kept prefix
            assert torch.equal(k2, k[:, :, :keep]) and torch.equal(v2, v[:, :, :keep])
            if counts is not None:  # the cut reached into both quantized stores, not only the fp16 tails
                after = layer.cache.token_counts()
                assert after["key_quantized"] < counts[i]["key_quantized"], (counts[i], after)
                assert after["value_quantized"] < counts[i]["value_quantized"], (counts[i], after)
        # continue from the crop point (re-feeding the dropped tokens): fused and dequantized paths still agree
        ids = tokens[:, keep : keep + 20]
        with torch.no_grad():
            outs = [torch.cat([model(ids[:, j : j + 1], past_key_values=c).logits for j in range(ids.shape[1])], 1)
                    for c in caches]  # fmt: skip
        if method not in SELECTS:
            torch.testing.assert_close(outs[0], outs[1], atol=PATH_ATOL, rtol=0)
        assert all(c.get_seq_length() == keep + 20 for c in caches)
    if method != "fp16":
        assert caches[0].paths["dequantized"] == 0 and caches[1].paths["fused"] == 0


@pytest.mark.parametrize("method", ["fp16", "innerq_base"])
def test_prompt_lookup_decoding_crops(model, tokens, method):
    # assisted (prompt-lookup) decoding verifies candidate chunks on the fused path and crops rejected ones
    cache = KVKernelsCache(method, config=model.config, **SMALL)
    crops = []
    crop = cache.crop
    cache.crop = lambda n: (crops.append(n), crop(n))[1]
    ids = tokens[:, :PROMPT]
    with torch.no_grad():
        out = model.generate(ids, past_key_values=cache, max_new_tokens=NEW, prompt_lookup_num_tokens=4)
        want = model.generate(ids, past_key_values=DynamicCache(config=model.config), max_new_tokens=NEW)
    assert out.shape == want.shape and cache.get_seq_length() == PROMPT + NEW - 1
    assert any(n < 0 for n in crops), crops
    if method == "fp16":
        assert torch.equal(out, want)


def test_left_padded_batch(model, tokens):
    pad = 6
    ids = torch.stack([tokens[0, :PROMPT], torch.cat([torch.zeros(pad, dtype=torch.long), tokens[0, : PROMPT - pad]])])
    am = torch.ones_like(ids)
    am[1, :pad] = 0
    kw = {"attention_mask": am, "max_new_tokens": 16, "do_sample": False, "return_dict_in_generate": True}
    kw["output_logits"] = True
    with torch.no_grad():
        want = model.generate(ids, past_key_values=DynamicCache(config=model.config), **kw)
        exact = model.generate(ids, past_key_values=KVKernelsCache("kivi2", config=model.config, **WIDE), **kw)
        fused = model.generate(ids, past_key_values=KVKernelsCache("innerq_base", config=model.config, **SMALL), **kw)
        deq_cache = KVKernelsCache("innerq_base", config=model.config, fused=False, **SMALL)
        deq = model.generate(ids, past_key_values=deq_cache, **kw)
    # the padding mask reaches the fused path: exact windows reproduce DynamicCache, row by row
    assert torch.equal(exact.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(exact.logits), torch.stack(want.logits), atol=EXACT_ATOL, rtol=0)
    torch.testing.assert_close(torch.stack(fused.logits), torch.stack(deq.logits), atol=PATH_ATOL, rtol=0)


def test_multi_turn_and_chunked_prefill(model, tokens):
    # a second generate() on the same cache appends a 60-token turn (> max_fused_q_len: dequantized + SDPA path);
    # prefill_chunk_size=16 prefills the first chunk, then appends 16-token chunks on the fused path
    ids = tokens[:, :PROMPT]
    with torch.no_grad():
        for kw in ({}, {"prefill_chunk_size": 16}):
            cache, ref = KVKernelsCache("kivi2", config=model.config, **WIDE), DynamicCache(config=model.config)
            got = model.generate(ids, past_key_values=cache, max_new_tokens=8, **kw)
            want = model.generate(ids, past_key_values=ref, max_new_tokens=8, **kw)
            assert torch.equal(got, want)
            got = model.generate(torch.cat([got, tokens[:, :60]], 1), past_key_values=cache, max_new_tokens=8)
            want = model.generate(torch.cat([want, tokens[:, :60]], 1), past_key_values=ref, max_new_tokens=8)
            assert torch.equal(got, want) and cache.get_seq_length() == ref.get_seq_length()
    assert cache.paths["dequantized"] == LAYERS and cache.paths["fused"] > 0


# ---------------------------------------------------------------------------------------------------------
# API surface


def test_cache_api(model, tokens):
    cache = KVKernelsCache("kivi2", config=model.config, **SMALL)
    assert len(cache.layers) == LAYERS and not cache.is_compileable
    assert cache.get_seq_length() == 0 and cache.get_mask_sizes(5, 0) == (5, 0)
    assert cache.get_max_length() == -1 and cache.get_max_cache_shape() == -1
    teacher_forced(model, cache, tokens[:, : PROMPT + 3])
    n = PROMPT + 2
    assert cache.get_seq_length() == n and cache.get_mask_sizes(1, 1) == (n + 1, 0)
    assert cache.batch_size == 1
    cache.batch_repeat_interleave(3)
    assert cache.batch_size == 3
    cache.reorder_cache(torch.tensor([2, 0, 1]))
    cache.batch_select_indices(torch.tensor([0, 2]))
    assert cache.batch_size == 2 and cache.get_seq_length() == n
    mem = cache.memory_bytes()
    assert set(mem) >= {"quantized", "window", "total", "fp16_equivalent"} and mem["total"] < mem["fp16_equivalent"]
    cache.reset()
    assert cache.get_seq_length() == 0 and "kivi2" in repr(cache)
    # lazily grown layers without a config
    lazy = KVKernelsCache("innerq_small", **SMALL)
    teacher_forced(model, lazy, tokens[:, : PROMPT + 2])
    assert len(lazy.layers) == LAYERS and lazy.paths["fused"] == LAYERS


def test_overrides_and_errors(model):
    cfg = method_config("innerq_base", bits=4, w_sink=0)
    assert (cfg.key_bits, cfg.value_bits, cfg.w_sink) == (4, 4, 0)
    assert method_config("kivi2", w_recent=16).residual == 16
    assert method_config("fp16", bits=2) is None
    with pytest.raises(ValueError, match="unknown method"):
        KVKernelsCache("kivi3", config=model.config)
    with pytest.raises(ValueError, match="unknown override"):
        KVKernelsCache("kivi2", config=model.config, key_mode="sym")
    sliding = LlamaConfig(num_hidden_layers=2, layer_types=["full_attention", "sliding_attention"], sliding_window=8)
    with pytest.raises(NotImplementedError, match="sliding_attention"):
        KVKernelsCache("kivi2", config=sliding)


def test_falls_back_to_dequantized_when_attention_is_not_kvkernels(model, tokens):
    fused = teacher_forced(model, KVKernelsCache("innerq_hybrid", config=model.config, **SMALL), tokens[:, :100])
    model.set_attn_implementation("sdpa")
    try:
        cache = KVKernelsCache("innerq_hybrid", config=model.config, **SMALL)
        with pytest.warns(UserWarning, match="dequantized"):
            deq = teacher_forced(model, cache, tokens[:, :100])
    finally:
        set_kvkernels_attention(model)
    assert cache.paths["fused"] == 0 and cache.paths["dequantized"] > 0
    torch.testing.assert_close(fused, deq, atol=PATH_ATOL, rtol=0)


def test_generate_with_method(model, tokens):
    model.set_attn_implementation("sdpa")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the call itself switches to kvkernels: no fallback warning
            res = generate_with_method(model, tokens[:, :PROMPT], "innerq_small", max_new_tokens=10, **SMALL)
        assert model.config._attn_implementation == "sdpa"  # restored
    finally:
        set_kvkernels_attention(model)
    assert res.sequences.shape == (1, PROMPT + 10) and res.logits.shape == (1, 10, 128)
    assert res.backend["paths"]["fused"] == LAYERS * 9 and res.backend["ops"]["gemv_inner_q"] in ("reference", "cpp")
    assert res.cache.memory_bytes()["total"] > 0
    assert generate_with_method(model, tokens[:, :PROMPT], "fp16", max_new_tokens=4, **SMALL).logits.shape[1] == 4


def test_attn_implementation_at_load_time(model):
    m = LlamaForCausalLM._from_config(model.config, attn_implementation="kvkernels")
    assert m.config._attn_implementation == "kvkernels"


def test_optional_dependency():
    code = (
        "import sys\n"
        "import kvkernels, kvkernels.integrations\n"
        "assert 'transformers' not in sys.modules, 'import kvkernels pulled in transformers'\n"
        "sys.modules['transformers'] = None  # as if not installed\n"
        "try:\n"
        "    import kvkernels.integrations.transformers\n"
        "except ImportError as e:\n"
        "    assert 'pip install kvkernels[transformers]' in str(e), e\n"
        "else:\n"
        "    raise SystemExit('no ImportError')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


# ---------------------------------------------------------------------------------------------------------
# half-precision models, and the same model and caches on a GPU (compiled kernels, or Triton if not built)

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# The GPU stores the same codes as the CPU (quantizers are bit-exact across backends) except where K/V, which
# the GPU computes with its own fp32 rounding, sit on a rounding boundary; GEMVs differ in summation order only.
# So GPU-vs-CPU logits must agree far below the quantization error itself (smallest here: kivi4, 0.023).
CUDA_VS_CPU_REL = 5e-3


@pytest.fixture(scope="module")
def cuda_model(model):
    return copy.deepcopy(model).to("cuda")


@requires_gpu
@pytest.mark.parametrize("method", QUANT_METHODS)
def test_cuda_fused_decode_matches_cpu(model, cuda_model, tokens, method):
    cpu = teacher_forced(model, KVKernelsCache(method, config=model.config, **SMALL), tokens)
    cache = KVKernelsCache(method, config=cuda_model.config, **SMALL)
    gpu = teacher_forced(cuda_model, cache, tokens.cuda()).cpu()
    assert cache.paths["fused"] == LAYERS * (NEW - 1) and cache.paths["dequantized"] == 0, cache.paths
    assert rel_err(gpu, cpu) < CUDA_VS_CPU_REL, rel_err(gpu, cpu)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", sorted(FOUR_BIT))
def test_half_precision_model_4bit_close_to_dynamic_cache(model, device, tokens, name, dtype):
    # the usual deployment: an fp16/bf16 model; reference is the same model with a DynamicCache. Measured on CPU:
    # rel. L2 0.023 (innerq 4-bit asym) and 0.027-0.028 (kivi4) in both dtypes.
    m = copy.deepcopy(model).to(device=device, dtype=dtype)
    ids = tokens.to(device)
    ref = teacher_forced(m, DynamicCache(config=m.config), ids).float()
    method, overrides = FOUR_BIT[name]
    cache = KVKernelsCache(method, config=m.config, **overrides)
    logits = teacher_forced(m, cache, ids).float()
    assert cache.paths["fused"] == LAYERS * (NEW - 1), cache.paths
    assert torch.isfinite(logits).all()
    assert rel_err(logits, ref) < FOUR_BIT_REL, rel_err(logits, ref)


@requires_gpu
def test_cuda_generate_reports_gpu_backend(cuda_model, tokens):
    res = generate_with_method(cuda_model, tokens[:, :PROMPT].cuda(), "innerq_small", max_new_tokens=8, **SMALL)
    assert res.sequences.is_cuda and res.backend["paths"]["fused"] == LAYERS * 7
    assert res.backend["ops"]["gemv_inner_q"] in ("cuda", "triton"), res.backend["ops"]
