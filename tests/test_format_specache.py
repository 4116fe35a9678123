"""SpeCache format (kvkernels.formats.specache) and its two-row decode loop (kvkernels.speculative).

The key exactness facts: with no override the layer is KIVI; overriding every quantized position gives exact
attention; a partial override equals attention over the dequantized cache with those rows exact; the speculative
row is attended to (causally) but leaves no trace; greedy decoding with every position prefetched equals fp16
greedy decoding token for token.
"""

import pytest
import torch
from cache_helpers import kv, make_cache, tiny_llama

from kvkernels import ops
from kvkernels.attention import reference_decode_attention
from kvkernels.formats import PRESETS, KIVIConfig, SpeCacheConfig, effective_bits
from kvkernels.formats.specache import (
    HostKVStore,
    Prefetcher,
    SyncStreams,
    gather_rows,
    paper_cache_size,
    pcie_bytes_per_step,
)

B, H, HQ, D = 2, 2, 4, 64
SMALL = {"bits": 1, "group_size": 32, "residual": 8}


def filled(topk, n=200, seed=0, **kw):
    cfg = SpeCacheConfig(**(SMALL | kw), topk=topk)
    c = make_cache(cfg, B=B, H=H, D=D, capacity=16)
    k, v = kv(B, H, n, D, seed=seed)
    c.prefill(k, v)
    return c, k, v


def step(c, K, V, T=1, seed=1):
    """Append T new tokens, attend with T query rows; returns (out, K, V, q) with K/V the full fp32 history."""
    g = torch.Generator().manual_seed(seed)
    k, v, q = (torch.randn(B, h, T, D, generator=g) for h in (H, H, HQ))
    c.append(k, v)
    out = c.attention(q)
    return out, torch.cat([K, k], 2), torch.cat([V, v], 2), q


# ---------------------------------------------------------------------------------------------------------
# config, accounting


def test_config_defaults_and_errors():
    assert SpeCacheConfig(bits=1).eta == 0.25 and SpeCacheConfig(bits=2).eta == 0.0
    assert SpeCacheConfig(bits=1, eta=0.1).eta == 0.1
    for bad in ({"topk": -1}, {"topk": 1.5}, {"bits": 5}, {"group_size": 20}, {"residual": -2}, {"eta": 0.5}):
        with pytest.raises(ValueError):
            SpeCacheConfig(**bad)
    # the presets spend the device memory of their KIVI counterparts: R 64 + 64 rows = KIVI's R 128
    for spec, kivi in (("specache1", "kivi1_eta"), ("specache2", "kivi2")):
        s, k = PRESETS[spec], PRESETS[kivi]
        assert (s.bits, s.group_size, s.eta) == (k.bits, k.group_size, k.eta)
        assert s.residual + s.topk == k.residual
        es, ek = effective_bits(s), effective_bits(k)
        assert (es.key, es.value) == (ek.key, ek.value)
        assert es.fp16_value_tokens == ek.fp16_value_tokens


# SpeCache Table 1, "KV Cache Size": (model max length, bits, G) -> the printed fraction of fp16
TABLE1_SIZES = {
    (4096, 2, 32): 0.22, (4096, 2, 64): 0.19,                                          # LLaMA-2 7B / 13B
    (32768, 2, 32): 0.19, (32768, 2, 64): 0.16, (32768, 1, 32): 0.13, (32768, 1, 64): 0.10,  # Mistral-7B
    (8192, 2, 32): 0.20, (8192, 2, 64): 0.17, (8192, 1, 32): 0.14, (8192, 1, 64): 0.11,      # LLaMA-3-8B
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(TABLE1_SIZES))
def test_paper_cache_size_reproduces_table1(case):
    max_len, bits, G = case
    assert round(paper_cache_size(bits, G, max_len), 2) == TABLE1_SIZES[case]


def test_pcie_bytes_per_step():
    # batch2.md 2.7: Mistral-7B (32 layers, 8 KV heads, D 128), top-64: 8.4 MB per sequence per step host->device
    got = pcie_bytes_per_step(SpeCacheConfig(), num_layers=32, batch=1, num_kv_heads=8, head_dim=128)
    assert got["h2d"] == 32 * 8 * 64 * 128 * 2 * 2 == 8_388_608
    assert got["d2h"] == 32 * 8 * 128 * 2 * 2 and got["total"] == got["h2d"] + got["d2h"]


def test_memory_bytes():
    c, _, _ = filled(topk=16)
    mem = c.memory_bytes()
    assert mem["prefetch"] == 2 * B * H * 16 * D * 4  # fp32 cache here
    assert mem["total"] == mem["quantized"] + mem["window"] + mem["prefetch"]
    assert mem["host"] == 2 * B * H * 200 * D * 4  # every token, full precision


# ---------------------------------------------------------------------------------------------------------
# the 1-bit quantizer (SpeCache Eq. 3) and the third-party bug it must not have


def test_one_bit_midpoints_and_upper_clamp():
    # SpeCache's 1-bit levels: (3 min + max)/4 and (min + 3 max)/4, ties at the midpoint go up. A public
    # implementation computes round((x - z)/s) without an upper clamp: the group max gets code 2 and reads back as
    # max + (max - min)/4. Ours must give codes 0/1 only and the max must read back as (min + 3 max)/4.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 64, generator=g) * 3 + 1
    codes, scales, zeros = ops.quantize_groups(x, 1, 32, "asym", 0.25)
    assert set(ops.unpack_bits(codes, 1).unique().tolist()) <= {0, 1}
    deq = ops.dequantize_groups(codes, scales, zeros, 1, 32, "asym")
    grp = x.view(4, 3, 2, 32)
    lo, hi = grp.min(-1).values, grp.max(-1).values
    d = deq.view(4, 3, 2, 32)
    at_max = grp == hi[..., None]
    at_min = grp == lo[..., None]
    tol = 2e-3 * (hi - lo).abs().max()  # fp16 scale and zero
    assert ((d - ((lo + 3 * hi) / 4)[..., None]).abs()[at_max] <= tol).all()
    assert ((d - ((3 * lo + hi) / 4)[..., None]).abs()[at_min] <= tol).all()
    assert (d <= hi[..., None] + tol).all()  # nothing reads back above the group max


# ---------------------------------------------------------------------------------------------------------
# attention with the override


def test_no_override_is_kivi():
    cfg = SpeCacheConfig(**SMALL, topk=0)
    kivi = make_cache(KIVIConfig(bits=1, group_size=32, residual=8, eta=0.25), B=B, H=H, D=D, capacity=16)
    c = make_cache(cfg, B=B, H=H, D=D, capacity=16)
    k, v = kv(B, H, 150, D)
    for cache in (c, kivi):
        cache.prefill(k, v)
    for s in range(3):
        outs = [step(cache, k, v, seed=s)[0] for cache in (c, kivi)]
        assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("speculative", [False, True])
def test_override_everything_is_exact(speculative):
    # a step chooses every position that will be quantized at the next step: one more real token (plus, with a
    # speculative row, a token that evicts nothing)
    c, K, V = filled(topk=10_000)
    _, K, V, _ = step(c, K, V, seed=5)
    c.speculative_rows = int(speculative)
    out, K, V, q = step(c, K, V, T=1 + speculative, seed=6)
    assert c.key_store.n > 100 and c.value_store.n > 100
    assert bool((c.override_idx >= 0).any())
    torch.testing.assert_close(out, reference_decode_attention(q, K, V), atol=2e-6, rtol=0)


def test_partial_override_equals_attention_over_the_dequantized_cache():
    c, K, V = filled(topk=5)
    _, K, V, _ = step(c, K, V, seed=5)
    g = torch.Generator().manual_seed(9)
    k, v, q = (torch.randn(B, h, 1, D, generator=g) for h in (H, H, HQ))
    c.append(k, v)
    Kd, Vd = c.dequantized()  # stores dequantized, override rows exact
    idx = c.override_idx
    assert (idx >= 0).all() and idx.shape == (B, H, 5)
    K, V = torch.cat([K, k], 2), torch.cat([V, v], 2)
    rows = idx[..., None].expand(-1, -1, -1, D)
    assert torch.equal(Kd.gather(2, rows), K.gather(2, rows)) and torch.equal(Vd.gather(2, rows), V.gather(2, rows))
    assert not torch.equal(Kd, K)  # the rest stays quantized
    out = c.attention(q)
    torch.testing.assert_close(out, reference_decode_attention(q, Kd, Vd), atol=2e-6, rtol=0)


def test_override_improves_on_kivi():
    errs = []
    for topk in (0, 16, 10_000):
        c, K, V = filled(topk=topk, seed=3)
        _, K, V, _ = step(c, K, V, seed=5)
        out, K, V, q = step(c, K, V, seed=5)  # same query as the choosing step: the chosen rows are its top-k
        errs.append(float((out - reference_decode_attention(q, K, V)).norm()))
    assert errs[0] > errs[1] > errs[2] and errs[2] < 1e-4, errs


# ---------------------------------------------------------------------------------------------------------
# top-k choice


def test_select_topk_matches_brute_force():
    c, _, _ = filled(topk=7, n=120)
    N = c.seq_len
    g = torch.Generator().manual_seed(4)
    p = torch.softmax(torch.randn(B, HQ, N, generator=g), -1)
    p[0, :2, 50] = p[0, :2, 51] = 0.9  # a tie between the heads of KV head 0: the lower position wins first
    idx = c.select_topk(p)
    lo, hi = c.eligible_range()
    assert (lo, hi) == (0, N + 1 - 8)  # the next step's value store: every token but the last w_recent - 1
    for b in range(B):
        for h in range(H):
            mean = p[b, 2 * h : 2 * h + 2, lo:hi].mean(0)
            order = sorted(range(hi - lo), key=lambda j: (-float(mean[j]), j))[:7]
            assert idx[b, h].tolist() == sorted(j + lo for j in order)
    assert 50 in idx[0, 0].tolist() and 51 in idx[0, 0].tolist()


def test_select_topk_pads_with_minus_one_and_skips_the_sink_and_window():
    c, _, _ = filled(topk=12, n=16, w_sink=4)  # 16 tokens: sink 4; eligible [4, 16 + 1 - 8)
    assert c.eligible_range() == (4, 9)
    p = torch.full((B, HQ, 16), 1 / 16)
    idx = c.select_topk(p)
    assert idx[..., :5].tolist() == [[[4, 5, 6, 7, 8]] * H] * B and (idx[..., 5:] == -1).all()
    short, _, _ = filled(topk=12, n=10, w_sink=4)  # 10 + 1 - 8 < 4: nothing is eligible
    assert short.eligible_range() == (4, 4) and (short.select_topk(p[..., :10]) == -1).all()


def test_speculative_row_is_never_eligible_nor_kept():
    c, _, _ = filled(topk=10_000, n=100)
    ref, _, _ = filled(topk=10_000, n=100)
    g = torch.Generator().manual_seed(2)
    k, v, q = (torch.randn(B, h, 2, D, generator=g) for h in (H, H, HQ))
    c.speculative_rows = 1
    c.append(k, v)
    assert c.seq_len == 102 and c.host.n == 101  # the speculative token is attended to but never offloaded
    Kd, Vd = c.dequantized()  # no override yet (nothing was chosen before): the stores dequantized
    assert c.override_idx is None and torch.equal(Kd[:, :, -2:], k) and torch.equal(Vd[:, :, -2:], v)
    out = c.attention(q)  # causal: row 1 sees row 0, row 0 does not see row 1
    torch.testing.assert_close(out, reference_decode_attention(q, Kd, Vd), atol=2e-6, rtol=0)
    c.drop_speculative()
    ref.append(k[:, :, :1], v[:, :, :1])
    assert c.token_counts() == ref.token_counts()  # the speculative row evicted nothing
    for a, b in zip(c.dequantized(), ref.dequantized(), strict=True):
        assert torch.equal(a, b)
    # the set it chose is for the next step: every eligible position, and not the speculative one (101)
    c._take_prefetched()
    assert int(c.override_idx.max()) == 101 + 1 - 8 - 1


# ---------------------------------------------------------------------------------------------------------
# host copy and prefetcher


def test_host_store_grows_and_gathers():
    host = HostKVStore(2, 3, 8, capacity=4, dtype=torch.float32, pin=False)
    k, v = kv(2, 3, 50, 8)
    for lo in range(0, 50, 7):
        host.append(k[:, :, lo : lo + 7], v[:, :, lo : lo + 7])
    assert host.n == 50 and host.capacity >= 50
    assert torch.equal(host.view()[0], k) and torch.equal(host.view()[1], v)
    assert host.k[:50].is_contiguous() and host.k.shape[0] == host.capacity  # token-major: a step is one block
    idx = torch.tensor([[[3, 49, -1]] * 3] * 2)
    rows = gather_rows(host.k[:50], idx)
    assert torch.equal(rows[..., :2, :], k[:, :, [3, 49]]) and (rows[..., 2, :] == 0).all()


class RecordingStreams(SyncStreams):
    """The stream API with a log naming streams and events, to check the order of the prefetcher's operations and
    which stream each happens on."""

    def __init__(self):
        self.log = []
        self.events = iter(f"e{i}" for i in range(100))
        self.streams = iter(f"side{i}" for i in range(100))
        self.compute = self._stream("compute")
        self.active = "compute"

    def _stream(self, name):
        log = self.log

        class S:
            def wait_event(self, e):
                log.append((name, "wait", e.name))

        st = S()
        st.name = name
        return st

    def new_stream(self):
        return self._stream(next(self.streams))

    def current_stream(self):
        return self.compute if self.active == "compute" else self._stream(self.active)

    def use(self, stream):
        outer = self

        class Use:
            def __enter__(self):
                outer.prev, outer.active = outer.active, stream.name

            def __exit__(self, *exc):
                outer.active = outer.prev

        return Use()

    def new_event(self):
        log, name = self.log, next(self.events)

        class E:
            def record(self, stream=None):
                log.append((name, "record on", stream.name))

            def synchronize(self):
                log.append((name, "synchronize"))

        e = E()
        e.name = name
        return e

    def to_host(self, t):
        self.log.append(("copy to host on", self.active))
        return t.to("cpu")

    def to_device(self, t, device):
        self.log.append(("copy to device on", self.active))
        return t.to(device)


def test_prefetcher_orders_streams():
    streams = RecordingStreams()
    pf = Prefetcher("cpu", streams)
    host = HostKVStore(1, 1, 4, capacity=8, dtype=torch.float32, pin=False)
    host.append(*kv(1, 1, 8, 4))
    idx = torch.tensor([[[1, 5]]])
    pf.start(host, idx)
    got = pf.take()
    assert torch.equal(got[1], host.view()[0][:, :, [1, 5]]) and torch.equal(got[0], idx)
    # chosen recorded on the compute stream -> the side stream waits for it -> idx to host on the side stream, its
    # event synchronized by the worker -> rows to the device on the side stream -> ready recorded there -> the
    # compute stream waits for ready
    assert streams.log == [
        ("e0", "record on", "compute"),
        ("side0", "wait", "e0"),
        ("copy to host on", "side0"),
        ("e1", "record on", "side0"),
        ("e1", "synchronize"),
        ("copy to device on", "side0"),
        ("copy to device on", "side0"),
        ("e2", "record on", "side0"),
        ("compute", "wait", "e2"),
    ], streams.log
    assert pf.take() is None


# ---------------------------------------------------------------------------------------------------------
# edits


def test_crop_and_reorder_keep_host_and_override_consistent():
    c, K, V = filled(topk=10_000)
    _, K, V, _ = step(c, K, V, seed=5)
    c.crop(150)
    assert c.host.n == 150 and torch.equal(c.host.view()[0], K[:, :, :150])
    _, K2, V2, _ = step(c, K[:, :, :150], V[:, :, :150], seed=7)
    assert int(c.override_idx.max()) < 150  # chosen before the crop: positions past it were emptied
    _, K2, V2, _ = step(c, K2, V2, seed=8)
    c.reorder([1, 0])
    out, K3, V3, q = step(c, K2.flip(0), V2.flip(0), seed=9)
    torch.testing.assert_close(out, reference_decode_attention(q, *c.dequantized()), atol=2e-6, rtol=0)
    assert torch.equal(c.host.view()[0], K3)
    c.batch_select([1])
    c.batch_repeat_interleave(2)
    assert torch.equal(c.host.view()[1], V3[[1, 1]]) and c.override_idx.shape[0] == 2


# ---------------------------------------------------------------------------------------------------------
# end to end in generate()


@pytest.fixture(scope="module")
def model():
    return tiny_llama(layers=2)


def test_generate_everything_prefetched_equals_fp16_greedy(model):
    from transformers import DynamicCache

    from kvkernels.integrations.transformers import KVKernelsCache
    from kvkernels.speculative import specache_decode

    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    kw = {"max_new_tokens": 30, "do_sample": False}
    with torch.no_grad():
        want = model.generate(ids, past_key_values=DynamicCache(config=model.config), **kw)
        cache = KVKernelsCache("specache1", config=model.config, topk=10_000, residual=4)
        got = model.generate(ids, past_key_values=cache, custom_generate=specache_decode, **kw)
        plain = KVKernelsCache("specache1", config=model.config, topk=0, residual=4)
        low = model.generate(ids, past_key_values=plain, custom_generate=specache_decode, **kw)
    assert cache.layers[0].cache.key_store.n > 0  # quantized stores exist: the override is what makes it exact
    assert torch.equal(got, want)
    assert not torch.equal(low, want)  # 1-bit KIVI alone does change the tokens here
    assert cache.paths == {"prefill": 2, "fused": 2 * 30, "dequantized": 0, "full": 0}  # pre-decode + 29 steps
    assert cache.get_seq_length() == 40 + 30 - 1  # no speculative token left behind


def test_generate_sampling_and_dict_output(model):
    from kvkernels.integrations.transformers import KVKernelsCache
    from kvkernels.speculative import specache_decode

    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(2))
    outs = []
    for _ in range(2):
        torch.manual_seed(0)
        cache = KVKernelsCache("specache2", config=model.config, topk=8)
        outs.append(
            model.generate(
                ids, past_key_values=cache, custom_generate=specache_decode, max_new_tokens=12, do_sample=True,
                top_k=10, return_dict_in_generate=True, output_scores=True,
            )
        )  # fmt: skip
    assert torch.equal(outs[0].sequences, outs[1].sequences) and outs[0].sequences.shape == (1, 42)
    assert len(outs[0].scores) == 12 and outs[0].past_key_values is not None


def test_generate_errors(model):
    from transformers import DynamicCache

    from kvkernels.integrations.transformers import KVKernelsCache
    from kvkernels.speculative import specache_decode

    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match="speculative preset"):
        model.generate(ids, past_key_values=DynamicCache(config=model.config), custom_generate=specache_decode)
    with pytest.raises(ValueError, match="speculative preset"):
        model.generate(
            ids, past_key_values=KVKernelsCache("kivi2", config=model.config), custom_generate=specache_decode
        )
    mask = torch.ones_like(ids)
    mask[0, 0] = 0
    cache = KVKernelsCache("specache1", config=model.config)
    with pytest.raises(NotImplementedError, match="padded"):
        model.generate(ids, attention_mask=mask, past_key_values=cache, custom_generate=specache_decode)
    with pytest.raises(NotImplementedError, match="beam search"):
        model.generate(ids, past_key_values=KVKernelsCache("specache1", config=model.config), num_beams=2,
                       custom_generate=specache_decode)  # fmt: skip
    with pytest.raises(NotImplementedError, match="prompt-lookup"):
        model.generate(ids, past_key_values=KVKernelsCache("specache1", config=model.config),
                       prompt_lookup_num_tokens=3, custom_generate=specache_decode)  # fmt: skip
    sdpa = tiny_llama(layers=2, attn="sdpa")
    with pytest.raises(ValueError, match="attn_implementation='kvkernels'"):
        sdpa.generate(
            ids, past_key_values=KVKernelsCache("specache1", config=sdpa.config), custom_generate=specache_decode
        )


def test_teacher_forced_everything_prefetched_equals_dynamic_cache(model):
    from kvkernels import quality
    from kvkernels.integrations.transformers import KVKernelsCache

    ids = torch.randint(0, 128, (70,), generator=torch.Generator().manual_seed(4))
    kv_prompt = quality.prefill_kv(model, ids[:50])
    logits = {}
    for name, cache in (
        ("fp16", quality.make_cache("fp16", model)),
        ("all", KVKernelsCache("specache1", config=model.config, topk=10_000, residual=4)),
        ("top0", KVKernelsCache("specache1", config=model.config, topk=0, residual=4)),
    ):
        quality.fill_cache(cache, kv_prompt)
        logits[name], seconds = quality.decode_logits(model, cache, ids[50:])
        assert len(seconds) == 20
    torch.testing.assert_close(logits["all"], logits["fp16"], atol=1e-4, rtol=0)
    assert float((logits["top0"] - logits["fp16"]).abs().max()) > 1e-2


def test_two_rows_false_is_plain_decoding(model):
    from kvkernels import quality
    from kvkernels.integrations.transformers import KVKernelsCache
    from kvkernels.speculative import generate_kwargs, is_speculative

    two = KVKernelsCache("specache1", config=model.config)
    one = KVKernelsCache("specache1", config=model.config, two_rows=False)
    assert is_speculative(two) and not is_speculative(one) and not is_speculative(quality.make_cache("kivi2", model))
    assert generate_kwargs(one) == {}
    ids = torch.randint(0, 128, (60,), generator=torch.Generator().manual_seed(6))
    quality.fill_cache(one, quality.prefill_kv(model, ids[:40]))
    quality.decode_logits(model, one, ids[40:])
    assert one.paths["fused"] == 2 * 20  # one forward per token: no pre-decode, no second row
    with pytest.raises(ValueError, match="two_rows"):
        SpeCacheConfig(two_rows=1)


def test_generate_with_method_and_a_prefilled_cache(model):
    # generate_with_method picks the two-row loop for a speculative preset; the demo's route hands generate() a
    # cache that already holds all but the last prompt token
    from transformers import DynamicCache

    from kvkernels import quality
    from kvkernels.integrations.transformers import generate_with_method
    from kvkernels.speculative import generate_kwargs

    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = model.generate(ids, past_key_values=DynamicCache(config=model.config), max_new_tokens=16)
    res = generate_with_method(model, ids, "specache1", max_new_tokens=16, topk=10_000, residual=4)
    assert torch.equal(res.sequences, want) and res.cache.paths["fused"] == 2 * 16
    cache = quality.make_cache("specache1", model, {"topk": 10_000, "residual": 4})
    quality.fill_cache(cache, quality.prefill_kv(model, ids[0, :-1]))
    assert set(generate_kwargs(cache)) == {"custom_generate"} and generate_kwargs(DynamicCache()) == {}
    with torch.no_grad():
        got = model.generate(ids, past_key_values=cache, max_new_tokens=16, **generate_kwargs(cache))
    assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------------------------
# CUDA: the side-stream prefetch (skipped without a GPU; the CUDA path has not run on one yet)

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@requires_gpu
def test_cuda_prefetch_matches_cpu():
    # the same steps on CPU (SyncStreams) and CUDA (side stream + worker thread): same chosen rows, same outputs
    # up to the GEMVs' fp16 arithmetic
    outs, idxs = [], []
    for device in ("cpu", "cuda"):
        cfg = SpeCacheConfig(**SMALL, topk=16)
        c = make_cache(cfg, B=B, H=H, D=D, capacity=16, dtype=torch.float16, device=device)
        assert c.host.k.is_pinned() == (device == "cuda")  # capacity 16: the prefill grows the host copy
        k, v = kv(B, H, 300, D)
        c.prefill(k.half().to(device), v.half().to(device))
        g = torch.Generator().manual_seed(3)
        for t in range(6):
            c.speculative_rows = int(t > 0)
            kn, vn, q = (torch.randn(B, h, 1 + (t > 0), D, generator=g).half().to(device) for h in (H, H, HQ))
            c.append(kn, vn)
            out = c.attention(q)
            c.drop_speculative()
            if t == 3:
                c.reorder([1, 0])  # the host copy is reordered with a CPU index, the device parts on the device
        outs.append(out.float().cpu())
        assert torch.equal(c.host.view()[0][:, :, :300].cpu(), k.half()[[1, 0]])
        c._take_prefetched()
        idxs.append(c.override_idx.cpu())
        assert c.override_k.device.type == device
    assert torch.equal(idxs[0], idxs[1])
    torch.testing.assert_close(outs[1], outs[0], atol=2e-2, rtol=0)
