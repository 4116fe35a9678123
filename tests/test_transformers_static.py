"""KVKernelsStaticCache: generate() with a compiled decode step over static kvkernels layers (tiny random Llama, CPU).

transformers compiles the decode forward for a cache whose is_compileable is True (on CUDA by default; here through
CompileConfig._compile_all_devices). fullgraph=True makes any graph break an error, so a step that read a device
value on the host (.item(), a data-dependent branch) fails the test; error_on_recompile makes a guard that changes
from step to step (a Python counter, a shape) fail it too. Every compiled generation must equal generate() with the
dynamic KVKernelsCache: the same tokens are quantized the same way and the fused op differs in rounding order only.
"""

import copy
import gc
import io
import weakref

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import CompileConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402

from kvkernels.integrations.compat import cache_kwarg  # noqa: E402
from kvkernels.integrations.transformers import (  # noqa: E402
    KVKernelsCache,
    KVKernelsStaticCache,
    set_kvkernels_attention,
)

SMALL = {"group_size": 32, "w_sink": 4, "w_recent": 8}  # quantizes all but the windows of an 80-token prompt
PROMPT, NEW, LAYERS = 80, 24, 2
LOGIT_ATOL = 1e-5  # same cache contents, the fused op's rounding order


@pytest.fixture(scope="module")
def base_model():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=128, max_position_embeddings=512,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    m = LlamaForCausalLM(cfg).eval()
    set_kvkernels_attention(m)
    return m


@pytest.fixture
def model(base_model):
    # a fresh copy and a fresh dynamo state per test: the compiled call lives on the model, and guards from another
    # test's cache would count as recompiles
    torch._dynamo.reset()
    return copy.deepcopy(base_model)


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, 128, (2, PROMPT), generator=torch.Generator().manual_seed(1))


def _compile_config(backend: str = "aot_eager") -> CompileConfig:
    cc = CompileConfig(backend=backend, fullgraph=True, mode=None)
    cc._compile_all_devices = True  # transformers compiles on CUDA only unless told
    return cc


def _generate(model, ids, cache, **kw):
    kw = {"max_new_tokens": NEW, "do_sample": False, "return_dict_in_generate": True, "output_logits": True} | kw
    with torch.no_grad():
        out = model.generate(ids, **{cache_kwarg(): cache}, **kw)
    return out.sequences, torch.stack(out.logits, dim=1)


@pytest.mark.parametrize("method", ["innerq_base", "innerq_hybrid", "kivi2", "kivi4"])
def test_compiled_generate_equals_dynamic_cache(model, prompt, method):
    want_ids, want_logits = _generate(model, prompt, KVKernelsCache(method, config=model.config, **SMALL))
    cache = KVKernelsStaticCache(method, config=model.config, max_cache_len=128, **SMALL)
    with torch._dynamo.config.patch(error_on_recompile=True):
        ids, logits = _generate(model, prompt, cache, compile_config=_compile_config())
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(logits, want_logits, atol=LOGIT_ATOL, rtol=0)
    assert cache.paths == {"prefill": LAYERS, "static": LAYERS * (NEW - 1)}
    for layer in cache.layers:  # the stores really hold the decoded tokens
        counts = layer.static.token_counts()
        assert counts["total"] == PROMPT + NEW - 1 and counts["key_quantized"] >= 64, counts


def test_eager_generate_takes_the_static_path_too(model, prompt):
    # without a compile config (CPU): the same update / attention code, run eagerly
    want_ids, want_logits = _generate(model, prompt, KVKernelsCache("kivi2", config=model.config, **SMALL))
    cache = KVKernelsStaticCache("kivi2", config=model.config, max_cache_len=110, **SMALL)
    ids, logits = _generate(model, prompt, cache)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(logits, want_logits, atol=LOGIT_ATOL, rtol=0)
    assert cache.paths["static"] == LAYERS * (NEW - 1)
    assert int(cache.get_seq_length()) == PROMPT + NEW - 1


def test_left_padded_batch_mask_reaches_the_static_step(model, prompt):
    # a padding mask: transformers builds [B, 1, 1, max_cache_len] masks for compileable caches; the padded row must
    # decode as with the dynamic cache (which applies the same mask to the same tokens)
    pad = 7
    ids = prompt.clone()
    ids[1, pad:] = prompt[0, : PROMPT - pad]
    ids[1, :pad] = 0
    am = torch.ones_like(ids)
    am[1, :pad] = 0
    want_ids, want_logits = _generate(model, ids, KVKernelsCache("innerq_base", config=model.config, **SMALL),
                                      attention_mask=am)  # fmt: skip
    cache = KVKernelsStaticCache("innerq_base", config=model.config, max_cache_len=128, **SMALL)
    ids_got, logits = _generate(model, ids, cache, attention_mask=am, compile_config=_compile_config())
    assert torch.equal(ids_got, want_ids)
    torch.testing.assert_close(logits, want_logits, atol=LOGIT_ATOL, rtol=0)


def test_inductor_compiles_the_step(model, prompt):
    # the backend generate() uses by default (here on CPU: C++ codegen around the kvkernels ops, which stay calls)
    want_ids, want_logits = _generate(model, prompt[:1], KVKernelsCache("kivi2", config=model.config, **SMALL),
                                      max_new_tokens=8)  # fmt: skip
    cache = KVKernelsStaticCache("kivi2", config=model.config, max_cache_len=96, **SMALL)
    ids, logits = _generate(model, prompt[:1], cache, max_new_tokens=8, compile_config=_compile_config("inductor"))
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_reset_then_a_new_prompt_in_the_same_buffers(model, prompt, compiled):
    kw = {"compile_config": _compile_config()} if compiled else {}
    cache = KVKernelsStaticCache("innerq_base", config=model.config, max_cache_len=128, **SMALL)
    _generate(model, prompt, cache, max_new_tokens=4, **kw)
    static, ptrs = cache.layers[0].static, [t.data_ptr() for t in cache.layers[0].static._buffers()]
    cache.reset()
    assert cache.get_seq_length() == 0
    with torch._dynamo.config.patch(error_on_recompile=True):  # the same buffers: no new guards either
        ids, logits = _generate(model, prompt.flip(1), cache, max_new_tokens=6, **kw)
    assert cache.layers[0].static is static and [t.data_ptr() for t in static._buffers()] == ptrs
    d = KVKernelsCache("innerq_base", config=model.config, **SMALL)
    want, want_logits = _generate(model, prompt.flip(1), d, max_new_tokens=6)
    assert torch.equal(ids, want)
    torch.testing.assert_close(logits, want_logits, atol=LOGIT_ATOL, rtol=0)


def test_refusals(model, prompt):
    cfg = model.config
    for method, match in (
        ("lattice2", "lattice caches cannot be made static"),
        ("specache1", "specache caches cannot be made static"),
        ("xquant_1.38", r"layer 1: xquant caches cannot be made static"),
        ("fp16", "use transformers' StaticCache"),
    ):
        with pytest.raises(ValueError, match=match):
            KVKernelsStaticCache(method, config=cfg, max_cache_len=128, **({} if method == "fp16" else SMALL))
    for bad in (0, 1, 12.5, True, None):
        with pytest.raises(ValueError, match="max_cache_len must be an int >= 2"):
            KVKernelsStaticCache("kivi2", config=cfg, max_cache_len=bad)
    with pytest.raises(ValueError, match="needs config=model.config"):
        KVKernelsStaticCache("kivi2", max_cache_len=128)
    with pytest.raises(ValueError, match="cannot hold a 80-token prompt"):
        _generate(model, prompt, KVKernelsStaticCache("kivi2", config=cfg, max_cache_len=80, **SMALL))
    cache = KVKernelsStaticCache("kivi2", config=cfg, max_cache_len=128, **SMALL)
    with pytest.raises(NotImplementedError, match="beam search"):
        _generate(model, prompt, cache, num_beams=2, max_new_tokens=3)
    cache = KVKernelsStaticCache("kivi2", config=cfg, max_cache_len=128, **SMALL)
    _generate(model, prompt, cache, max_new_tokens=2)
    for edit in (lambda: cache.crop(-1), lambda: cache.batch_select_indices(torch.tensor([0]))):
        with pytest.raises(NotImplementedError, match="KVKernelsStaticCache does not support"):
            edit()


def test_empty_keys_without_a_static_prefill_raise(model):
    from kvkernels.integrations.transformers import kvkernels_attention_forward

    attn = model.model.layers[0].self_attn
    q = torch.zeros(1, 4, 1, 32)
    with pytest.raises(RuntimeError, match="no KVKernelsStaticCache layer bound to this module"):
        kvkernels_attention_forward(attn, q, torch.zeros(1, 2, 0, 32), torch.zeros(1, 2, 0, 32), None)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_two_caches_on_one_model_each_attend_their_own(model, prompt, compiled):
    # the attention modules are shared: cache B's prefill must not make A's next decode step read B's buffers
    kw = {"compile_config": _compile_config()} if compiled else {}
    a = KVKernelsStaticCache("kivi2", config=model.config, max_cache_len=128, **SMALL)
    b = KVKernelsStaticCache("kivi2", config=model.config, max_cache_len=128, **SMALL)
    ids_a, _ = _generate(model, prompt, a, max_new_tokens=6, **kw)
    _generate(model, prompt.flip(1), b, max_new_tokens=6, **kw)
    more_a, logits = _generate(model, ids_a, a, max_new_tokens=6, **kw)  # A's conversation continues
    d = KVKernelsCache("kivi2", config=model.config, **SMALL)
    ids_d, _ = _generate(model, prompt, d, max_new_tokens=6)
    more_d, want = _generate(model, ids_d, d, max_new_tokens=6)
    assert torch.equal(ids_a, ids_d) and torch.equal(more_a, more_d)
    torch.testing.assert_close(logits, want, atol=LOGIT_ATOL, rtol=0)


def test_another_attention_implementation_raises(model, prompt):
    # SDPA would read the decode steps' empty K/V as "no tokens" and generate plausible nonsense: refuse instead
    model.set_attn_implementation("sdpa")
    cache = KVKernelsStaticCache("kivi2", config=model.config, max_cache_len=128, **SMALL)
    with pytest.raises(RuntimeError, match="attention implementation other than 'kvkernels'"):
        _generate(model, prompt, cache, max_new_tokens=3)


def test_a_new_prompt_without_reset_raises(model, prompt):
    cache = KVKernelsStaticCache("kivi2", config=model.config, max_cache_len=128, **SMALL)
    ids, _ = _generate(model, prompt, cache, max_new_tokens=3)
    longer = torch.cat([ids, ids[:, :5]], dim=1)  # transformers hands the cache the 6 tokens past its length
    with pytest.raises(ValueError, match=r"needs cache.reset\(\) first"):
        _generate(model, longer, cache, max_new_tokens=3)


def test_the_model_does_not_keep_a_dropped_cache_alive(model, prompt):
    cache = KVKernelsStaticCache("kivi2", config=model.config, max_cache_len=128, **SMALL)
    _generate(model, prompt, cache, max_new_tokens=3)
    # the model can still be pickled and copied, and carries no cache when it is
    torch.save(model, io.BytesIO())
    attn = copy.deepcopy(model).model.layers[0].self_attn
    assert attn._kvkernels_static_layer() is None
    buffers = weakref.ref(cache.layers[0].static)
    del cache
    gc.collect()
    assert buffers() is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", ["innerq_base", "kivi2"])
def test_cuda_reduce_overhead_generate(model, prompt, method):
    # generate()'s default on CUDA: inductor with mode="reduce-overhead", i.e. the decode step replayed from a CUDA
    # graph; against the dynamic cache on the same GPU
    m = model.cuda()
    ids = prompt.cuda()
    want_ids, want_logits = _generate(m, ids, KVKernelsCache(method, config=m.config, **SMALL))
    cache = KVKernelsStaticCache(method, config=m.config, max_cache_len=128, **SMALL)
    ids_got, logits = _generate(m, ids, cache)
    assert torch.equal(ids_got, want_ids)
    torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=0)
    assert cache.paths["static"] == LAYERS * (NEW - 1)
