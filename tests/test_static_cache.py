"""StaticLayerCache: the static-shape decode step (kvkernels/static_cache.py).

On CPU: the step's tokens, quantization and attention equal the dynamic cache's fed the same K/V, at every step
across sink, group and window boundaries; and no op of a step reads a device value on the host (a dispatch mode
that fails on .item() / nonzero / bool(tensor) etc. while append and attention run). On a GPU: the step is captured
in a CUDA graph and replayed (skipped here).
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvkernels.formats import PRESETS, make_layer_cache
from kvkernels.static_cache import StaticLayerCache

B, H_KV, H_Q, D = 2, 2, 4, 64


def _kv(N, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(B, H_KV, N, D, generator=g), torch.randn(B, H_KV, N, D, generator=g)
    k[..., 7] *= 5.0  # an outlier channel, as real keys have
    return k.half().to(device), v.half().to(device)


def _pair(preset, prefill, k, v, max_tokens, step_tokens, device="cpu"):
    """A dynamic cache and a static one made from an identical prefilled cache."""
    caches = []
    for _ in range(2):
        c = make_layer_cache(PRESETS[preset], B, H_KV, D, capacity=64, device=device, dtype=torch.float16)
        c.prefill(k[:, :, :prefill], v[:, :, :prefill])
        caches.append(c)
    return caches[0], StaticLayerCache(caches[1], max_tokens=max_tokens, step_tokens=step_tokens)


@pytest.mark.parametrize("step_tokens", [1, 3])
# 6: the decode steps still fill the sink (innerq's w_sink is 32), and at 3 tokens a step the sink's last step takes 2
# of them (the rest go to the tail)
@pytest.mark.parametrize("prefill", [6, 150])
@pytest.mark.parametrize("preset", ["innerq_base", "innerq_hybrid", "kivi2", "kivi4"])
def test_static_steps_equal_the_dynamic_cache(preset, prefill, step_tokens):
    steps = 70  # past two token groups of the "cols" store at G 32 and the whole recent window
    N = prefill + steps * step_tokens
    k, v = _kv(N)
    dyn, static = _pair(preset, prefill, k, v, max_tokens=N, step_tokens=step_tokens)
    g = torch.Generator().manual_seed(1)
    for i in range(prefill, N, step_tokens):
        kk, vv = k[:, :, i : i + step_tokens], v[:, :, i : i + step_tokens]
        dyn.append(kk, vv)
        static.append(kk, vv)
        assert static.token_counts() == dyn.token_counts()
        q = torch.randn(B, H_Q, step_tokens, D, generator=g)
        torch.testing.assert_close(static.attention(q), dyn.attention(q, fused_op=True), rtol=1e-5, atol=1e-6)
    for got, want in zip(static.dequantized(), dyn.dequantized(), strict=True):
        assert torch.equal(got, want)  # the same tokens quantized into the same groups


@pytest.mark.parametrize("preset", ["innerq_base", "kivi2"])
def test_load_takes_a_new_prompt_into_the_same_buffers(preset):
    # a used static cache loads another prompt: the buffers keep their addresses (a captured graph replays over them)
    # and every later step equals a dynamic cache fed that prompt
    k, v = _kv(260, seed=3)
    _, static = _pair(preset, 120, k, v, max_tokens=260, step_tokens=1)
    for i in range(120, 160):  # the old conversation advances
        static.append(k[:, :, i : i + 1], v[:, :, i : i + 1])
    before = [t.data_ptr() for t in static._buffers()]
    k2, v2 = _kv(200, seed=4)
    dyn, fresh = _pair(preset, 90, k2, v2, max_tokens=200, step_tokens=1)
    static.load(fresh.cache)
    assert [t.data_ptr() for t in static._buffers()] == before
    assert static.token_counts() == dyn.token_counts()
    g = torch.Generator().manual_seed(5)
    for i in range(90, 200):
        dyn.append(k2[:, :, i : i + 1], v2[:, :, i : i + 1])
        static.append(k2[:, :, i : i + 1], v2[:, :, i : i + 1])
        q = torch.randn(B, H_Q, 1, D, generator=g)
        torch.testing.assert_close(static.attention(q), dyn.attention(q, fused_op=True), rtol=1e-5, atol=1e-6)
    for got, want in zip(static.dequantized(), dyn.dequantized(), strict=True):
        assert torch.equal(got, want)


def test_load_refuses_another_shape_or_format():
    k, v = _kv(100)
    _, static = _pair("kivi2", 60, k, v, max_tokens=100, step_tokens=1)
    other = make_layer_cache(PRESETS["kivi4"], B, H_KV, D, capacity=64, dtype=torch.float16)
    other.prefill(k[:, :, :60], v[:, :, :60])
    with pytest.raises(ValueError, match="same format config"):
        static.load(other)
    empty = make_layer_cache(PRESETS["kivi2"], B, H_KV, D, capacity=64, dtype=torch.float16)
    with pytest.raises(ValueError, match="the cache is empty"):
        static.load(empty)
    big = make_layer_cache(PRESETS["kivi2"], B, H_KV, D, capacity=64, dtype=torch.float16)
    k3, v3 = _kv(120)
    big.prefill(k3, v3)
    with pytest.raises(ValueError, match="over max_tokens=100"):
        static.load(big)


def test_static_mask_equals_the_dynamic_mask():
    k, v = _kv(190)
    dyn, static = _pair("kivi2", 180, k, v, max_tokens=200, step_tokens=2)
    dyn.append(k[:, :, 180:182], v[:, :, 180:182])
    static.append(k[:, :, 180:182], v[:, :, 180:182])
    N = dyn.seq_len
    mask = torch.rand(B, 1, 2, N, generator=torch.Generator().manual_seed(3)) > 0.3
    mask[1, :, 0] = False  # a fully masked row averages, on both paths
    q = torch.randn(B, H_Q, 2, D)
    wide = torch.zeros(B, 1, 2, 200, dtype=torch.bool)  # the static mask spans max_tokens; columns past N unread
    wide[..., :N] = mask
    wide[..., N:] = True
    torch.testing.assert_close(static.attention(q, attn_mask=wide), dyn.attention(q, attn_mask=mask, fused_op=True))
    with pytest.raises(ValueError, match="max_tokens"):
        static.attention(q, attn_mask=mask)  # narrower than max_tokens


class _NoHostReads(TorchDispatchMode):
    """Fails on any op whose result is a host value computed from a tensor's contents (a sync, and a value a CUDA
    graph would freeze), or whose output shape depends on the contents. .item(), int(t), bool(t) and friends reach
    the dispatcher as _local_scalar_dense / is_nonzero; .tolist() and .numpy() read CPU memory without it, so they
    are patched to fail while the mode is on."""

    FORBIDDEN = ("_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal", "masked_select", "unique")

    def __init__(self):
        super().__init__()
        self.ops = []

    def __enter__(self):
        self._saved = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}
        for name in self._saved:
            setattr(torch.Tensor, name, self._refuse(name))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(torch.Tensor, name, fn)
        return super().__exit__(*exc)

    @staticmethod
    def _refuse(name):
        def refuse(*args, **kwargs):
            raise AssertionError(f"the static decode step read a device value on the host: Tensor.{name}")

        return refuse

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops.append(str(func))
        if name in self.FORBIDDEN:
            raise AssertionError(f"the static decode step read a device value on the host: {func}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("preset", ["innerq_base", "kivi2"])
def test_the_step_reads_no_device_value_on_the_host(preset):
    k, v = _kv(120)
    _, static = _pair(preset, 100, k, v, max_tokens=160, step_tokens=1)
    mask = torch.ones(1, 1, 1, 160, dtype=torch.bool)
    for i in range(100, 120):  # past a group boundary, so both evictions happen inside the checked region
        with _NoHostReads() as mode:
            static.append(k[:, :, i : i + 1], v[:, :, i : i + 1])
            static.attention(torch.randn(B, H_Q, 1, D))
            static.attention(torch.randn(B, H_Q, 1, D), attn_mask=mask)
        assert any("decode_attention_fused" in op for op in mode.ops)  # the mode saw the step's ops
    assert static.seq_len == 120
    for read in (lambda: static.seq_len, lambda: int(static.lengths[0]), lambda: bool(static.lengths[1] > 0)):
        with pytest.raises(AssertionError, match="read a device value"), _NoHostReads():
            read()  # the guard itself: host reads are caught


class _DeviceOps(TorchDispatchMode):
    """Counts the ops of a region that launch device work (every dispatched op that is not a view)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not func.is_view
        return func(*args, **(kwargs or {}))


# Device ops of one eager append step (each a kernel launch on a GPU: ~1.5-2 us of a replayed CUDA graph, which is
# what the first GPU run's static step spent beyond its attention, bench/RESULTS.md). Counted 2026-11-27: InnerQ 78-80
# (key normalization and a rows store), KIVI 68; 2026-11-28, with the keys' and values' counts handled together, the
# new tokens written by index_copy_ instead of where() over the whole tail, and the scratch's index ranges made once:
# InnerQ 41-42 at one token a step (its sink takes 7 of them), KIVI 34. A ceiling, not a target: Inductor fuses the
# step's append into ~15 kernels plus the two quantize_groups_into calls (torch.compile(fullgraph=True), counted on
# CPU), and the compiled CUDA op (ops.static_append, csrc/cuda/static_append.cu) makes it two launches; this counts
# the reference, which serves CPU and Triton-only builds.
APPEND_DEVICE_OPS = {"innerq_base": 41, "innerq_hybrid": 42, "kivi2": 34, "kivi4": 34}


@pytest.mark.parametrize("preset", sorted(APPEND_DEVICE_OPS))
def test_append_launches_stay_within_the_counted_budget(preset):
    k, v = _kv(120)
    _, static = _pair(preset, 100, k, v, max_tokens=160, step_tokens=1)
    counts = set()
    for i in range(100, 120):  # across a group boundary: the count must not depend on whether tokens leave the tail
        with _DeviceOps() as mode:
            static.append(k[:, :, i : i + 1], v[:, :, i : i + 1])
        counts.add(mode.count)
    assert len(counts) == 1, f"the step's ops vary with the lengths: {sorted(counts)}"
    assert counts.pop() <= APPEND_DEVICE_OPS[preset]


def test_errors():
    k, v = _kv(40)
    lattice = make_layer_cache(PRESETS["lattice2"], B, H_KV, D, capacity=64)
    with pytest.raises(ValueError, match="cannot be made static"):
        StaticLayerCache(lattice, max_tokens=64)
    c = make_layer_cache(PRESETS["kivi2"], B, H_KV, D, capacity=64, dtype=torch.float16)
    with pytest.raises(ValueError, match="prefill it"):
        StaticLayerCache(c, max_tokens=64)
    c.prefill(k, v)
    with pytest.raises(ValueError, match="max_tokens"):
        StaticLayerCache(c, max_tokens=10)
    with pytest.raises(ValueError, match="step_tokens"):
        StaticLayerCache(c, max_tokens=64, step_tokens=0)
    static = StaticLayerCache(c, max_tokens=64)
    with pytest.raises(ValueError, match="step_tokens"):
        static.append(k[:, :, :2], v[:, :, :2])
    with pytest.raises(TypeError, match="floating point"):
        static.append(k[:, :, :1].int(), v[:, :, :1])
    with pytest.raises(ValueError, match="q must be"):
        static.attention(torch.randn(B, 3, 1, D))


def test_overflow_past_the_buffers_is_an_error_not_a_silent_write():
    # the stores keep max_tokens plus slack (rounded to their capacity unit); appending past what they hold must fail
    # loudly (an index error here, a device-side assert on CUDA), never write outside them or wrap around
    k, v = _kv(40)
    _, static = _pair("innerq_base", 40, k, v, max_tokens=41, step_tokens=1)
    room = min(static.keys.store.cap, static.values.store.cap) + static.w_recent + 64
    tok = torch.zeros(B, H_KV, 1, D, dtype=torch.float16)
    with pytest.raises((IndexError, RuntimeError)):
        for _ in range(room):
            static.append(tok, tok)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("preset", ["innerq_base", "kivi2"])
def test_cuda_graph_captures_the_decode_step(preset):
    """Capture append + attention once, replay it for every step, and match the dynamic cache run eagerly."""
    prefill, steps = 150, 90
    k, v = _kv(prefill + steps, device="cuda")
    dyn, static = _pair(preset, prefill, k, v, max_tokens=prefill + steps, step_tokens=1, device="cuda")
    k_in, v_in = torch.zeros_like(k[:, :, :1]), torch.zeros_like(v[:, :, :1])
    q_in = torch.zeros(B, H_Q, 1, D, device="cuda", dtype=torch.float16)
    # warm up on a side stream (allocator, lazy init, Triton compiles) with a throwaway cache of the same shapes: a
    # step run outside the graph would advance the captured cache's state
    _, warm = _pair(preset, prefill, k, v, max_tokens=prefill + steps, step_tokens=1, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        warm.append(k_in, v_in)
        warm.attention(q_in)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # records the kernels without running them: static's state is unchanged
        static.append(k_in, v_in)
        out = static.attention(q_in)
    g = torch.Generator(device="cuda").manual_seed(5)
    for i in range(prefill, prefill + steps):
        q = torch.randn(B, H_Q, 1, D, device="cuda", generator=g).half()
        k_in.copy_(k[:, :, i : i + 1])
        v_in.copy_(v[:, :, i : i + 1])
        q_in.copy_(q)
        graph.replay()
        dyn.append(k[:, :, i : i + 1], v[:, :, i : i + 1])
        want = dyn.attention(q, fused_op=True)
        torch.testing.assert_close(out, want, rtol=2e-3, atol=2e-3)
    assert static.token_counts() == dyn.token_counts()


@pytest.mark.parametrize("preset", ["innerq_base", "kivi2"])
def test_the_step_compiles_to_one_graph_without_recompiles(preset):
    # what torch.compile(mode="reduce-overhead") needs before it can capture a CUDA graph: the whole step traced
    # as one graph (fullgraph: no graph break), and the same graph for every step (no recompile as lengths change)
    prefill, steps = 150, 40
    k, v = _kv(prefill + steps)
    dyn, static = _pair(preset, prefill, k, v, max_tokens=prefill + steps, step_tokens=1)
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(kk, vv, q):
        static.append(kk, vv)
        return static.attention(q)

    g = torch.Generator().manual_seed(4)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i in range(prefill, prefill + steps):
            q = torch.randn(B, H_Q, 1, D, generator=g)
            out = step(k[:, :, i : i + 1], v[:, :, i : i + 1], q)
            dyn.append(k[:, :, i : i + 1], v[:, :, i : i + 1])
            torch.testing.assert_close(out, dyn.attention(q, fused_op=True), rtol=1e-5, atol=1e-6)
    assert static.token_counts() == dyn.token_counts()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_reduce_overhead_runs_the_step_as_a_cuda_graph():
    from torch._dynamo.utils import counters

    prefill, steps = 150, 60
    k, v = _kv(prefill + steps, device="cuda")
    dyn, static = _pair("innerq_base", prefill, k, v, max_tokens=prefill + steps, step_tokens=1, device="cuda")
    torch._dynamo.reset()
    counters.clear()

    @torch.compile(fullgraph=True, mode="reduce-overhead")
    def step(kk, vv, q):
        static.append(kk, vv)
        return static.attention(q).clone()

    g = torch.Generator(device="cuda").manual_seed(6)
    for i in range(prefill, prefill + steps):
        q = torch.randn(B, H_Q, 1, D, device="cuda", generator=g).half()
        out = step(k[:, :, i : i + 1], v[:, :, i : i + 1], q)
        dyn.append(k[:, :, i : i + 1], v[:, :, i : i + 1])
        torch.testing.assert_close(out, dyn.attention(q, fused_op=True), rtol=2e-3, atol=2e-3)
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    assert static.token_counts() == dyn.token_counts()
