"""static_append: a static cache's decode-step append as one op (kvkernels/reference/static_append.py is the spec).

On CPU: the op through the dispatcher (the reference, registered for CPU) equals StaticLayerCache.append's call of
the reference with its prepared index ranges, on every buffer; its argument checks on the wrapper and on the direct
torch.ops call (tests/test_ops.py has its opcheck, tests/test_fuzz_ops.py fuzzes it against the spec written out).
The CUDA kernel's logic runs under tests/cuda_emu (`drv append`: against a host model of the spec, strided buffers,
every mode, a trapped overflow). On a GPU, tests/test_cuda_kernels.py holds the compiled op
(two launches) to the reference's tokens, counts and codes at every step.
"""

import pytest
import torch
from conftest import requires_c

from kvkernels import ops, reference
from kvkernels.formats import PRESETS, make_layer_cache
from kvkernels.static_cache import StaticLayerCache

B, H_KV, D = 2, 2, 64

pytestmark = requires_c


def _kv(N, seed=0, device="cpu", dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(B, H_KV, N, D, generator=g), torch.randn(B, H_KV, N, D, generator=g)
    k[..., 7] *= 5.0
    return k.to(device, dtype), v.to(device, dtype)


def _static(preset, prefill, k, v, max_tokens, step_tokens, device="cpu", dtype=torch.float16):
    c = make_layer_cache(PRESETS[preset], B, H_KV, D, capacity=64, device=device, dtype=dtype)
    c.prefill(k[:, :, :prefill], v[:, :, :prefill])
    return StaticLayerCache(c, max_tokens=max_tokens, step_tokens=step_tokens)


def _operands(static, k, v):
    """ops.static_append's arguments over a static cache's buffers."""
    ks, vs = static.keys.store, static.values.store
    return (
        k, v, static.lengths, static.cache._sink_k, static.cache._sink_v, ks.codes, ks.scales, ks.zeros, vs.codes,
        vs.scales, vs.zeros, static.keys.tail, static.values.tail, ks.bits, ks.mode, ks.layout, ks.eta, vs.bits,
        vs.mode, vs.layout, vs.eta, ks.group_size, static.w_recent, static.key_norm,
    )  # fmt: skip


def _buffers(static):
    return [t.clone() for t in static._buffers()]


@pytest.mark.parametrize("step_tokens", [1, 3])
@pytest.mark.parametrize("preset", ["innerq_base", "innerq_hybrid", "kivi2", "kivi4"])
def test_the_dispatched_op_equals_the_cache_path(preset, step_tokens):
    # the registered CPU kernel (the reference making its own index ranges) and StaticLayerCache.append (the reference
    # over ranges made once) write the same bytes into every buffer, from a sink still filling to groups leaving
    prefill, steps = 6, 50
    N = prefill + steps * step_tokens
    k, v = _kv(N)
    a = _static(preset, prefill, k, v, N, step_tokens)
    b = _static(preset, prefill, k, v, N, step_tokens)
    for i in range(prefill, N, step_tokens):
        kk, vv = k[:, :, i : i + step_tokens], v[:, :, i : i + step_tokens]
        a.append(kk, vv)
        ops.static_append(*_operands(b, kk, vv))
        for x, y in zip(_buffers(a), _buffers(b), strict=True):
            assert torch.equal(x, y)
    assert a.token_counts()["total"] == N


def test_the_direct_op_call_and_the_wrapper_refuse_bad_arguments():
    k, v = _kv(60)
    static = _static("innerq_base", 40, k, v, 60, 1)
    tok_k, tok_v = k[:, :, 40:41], v[:, :, 40:41]
    args = list(_operands(static, tok_k, tok_v))
    names = [a.name for a in torch.ops.kvkernels.static_append.default._schema.arguments]
    at = {n: i for i, n in enumerate(names)}

    def bad(**changes):
        a = list(args)
        for name, val in changes.items():
            a[at[name]] = val
        return a

    cases = [
        (bad(k=tok_k.float()), TypeError, "k must be float16"),
        (bad(k=k[:, :, 40:40], v=v[:, :, 40:40]), ValueError, "n >= 1"),
        (bad(v=v[:, :, 40:42]), ValueError, "v must match k"),
        (bad(lengths=static.lengths.int()), TypeError, "lengths must be int64"),
        (bad(key_eta=0.1), ValueError, "key_eta applies to asym mode only"),
        (bad(value_eta=0.7), ValueError, "value_eta must be in"),
        (bad(w_recent=-1), ValueError, "w_recent must be a non-negative int"),
        (bad(group_size=48), ValueError, "group_size must be a positive multiple of 32"),
        (bad(key_bits=5), ValueError, "key_bits must be one of"),
        (bad(value_layout="tokens"), ValueError, "value_layout must be one of"),
        (bad(key_x_scale=static.key_norm[:1]), ValueError, "key_x_scale must have shape"),
        (bad(value_tail=static.keys.tail), ValueError, "key_tail and value_tail must not share memory"),
        (bad(k=static.keys.tail[:, :, :1]), ValueError, "key_tail and k must not share memory"),
        (bad(key_scales=None), TypeError, "key_scales must be a tensor, got None"),
    ]
    before = _buffers(static)
    for a, exc, match in cases:
        with pytest.raises(exc, match=match):
            ops.static_append(*a)
        with pytest.raises(exc, match=match):
            torch.ops.kvkernels.static_append.default(*a)
    for x, y in zip(before, _buffers(static), strict=True):
        assert torch.equal(x, y)  # a refused call writes nothing


def test_the_reference_refuses_to_write_past_a_full_store():
    # the capacity precondition (store count + E <= capacity) broken on the device: an index error, not a silent write
    k, v = _kv(60)
    static = _static("kivi2", 40, k, v, 60, 1)
    static.lengths[3] = static.values.store.cap  # the value store claims to be full
    tok = torch.zeros(B, H_KV, 1, D, dtype=torch.float16)
    with pytest.raises((IndexError, RuntimeError)):
        reference.static_append(*_operands(static, tok, tok))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_the_op_compiles_into_one_graph_without_recompiles(backend):
    # the path a CUDA build takes under torch.compile (KVKernelsStaticCache's generate()): the mutating op traced in
    # a fullgraph step, the same graph every step, the same bytes in every buffer (Inductor's output code calls it on
    # the graph inputs, no clones: read on 2026-11-28); here its CPU kernel, the reference, serves it
    prefill, steps = 150, 20
    N = prefill + steps
    k, v = _kv(N)
    fast, ref = _static("innerq_base", prefill, k, v, N, 1), _static("innerq_base", prefill, k, v, N, 1)
    fast.compiled_append = True  # as on CUDA: the dispatcher's op instead of the reference's ops
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, backend=backend)
    def step(kk, vv):
        fast.append(kk, vv)

    with torch._dynamo.config.patch(error_on_recompile=True):
        for i in range(prefill, N):
            step(k[:, :, i : i + 1], v[:, :, i : i + 1])
            ref.append(k[:, :, i : i + 1], v[:, :, i : i + 1])
            assert torch.equal(fast.lengths, ref.lengths)
    for x, y in zip(_buffers(fast), _buffers(ref), strict=True):
        assert torch.equal(x, y)
