"""Direct torch.ops calls with bad arguments raise an error naming the argument, on every registration: the C++ CPU
kernels (csrc/op_checks.h, shared with the CUDA bindings), the Python kernels and the fakes (kvkernels/_validate.py).
Regression tests for the defects found by fuzzing (the robustness issue, items 1-4): each of these used to crash the
process (SIGFPE / SIGSEGV), read out of bounds, or return garbage."""

import os

import pytest
import torch
from cache_helpers import tiny_llama
from conftest import requires_c

import kvkernels

ops = torch.ops.kvkernels


def _quantized(mode="asym"):
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    return x, *kvkernels.quantize_groups(x, 3, 32, mode)


def _half(*shape):
    return torch.zeros(*shape, dtype=torch.float16)


# (name, call, exception, message fragment); x: [4, 64] fp32, c/s/z: its 3-bit codes [4, 6], scales/zeros [4, 2]
CPU_CASES = [
    # 1. dequantize_groups on CPU
    (
        "deq group 16 on codes of 32",
        lambda x, c, s, z: ops.dequantize_groups(c, s, z, 3, 16, "asym"),
        ValueError,
        "group_size",
    ),
    (
        "deq group 0 (was SIGFPE)",
        lambda x, c, s, z: ops.dequantize_groups(c, s, z, 3, 0, "asym"),
        ValueError,
        "group_size",
    ),
    ("deq negative group", lambda x, c, s, z: ops.dequantize_groups(c, s, z, 3, -32, "asym"), ValueError, "group_size"),
    ("deq group 48", lambda x, c, s, z: ops.dequantize_groups(c, s, z, 3, 48, "asym"), ValueError, "group_size"),
    (
        "deq empty scales (was SIGSEGV)",
        lambda x, c, s, z: ops.dequantize_groups(c, _half(0), z, 3, 32, "asym"),
        ValueError,
        "scales must have shape",
    ),
    (
        "deq one scale for all",
        lambda x, c, s, z: ops.dequantize_groups(c, s[:1, :1], z, 3, 32, "asym"),
        ValueError,
        "scales must have shape",
    ),
    (
        "deq short zeros",
        lambda x, c, s, z: ops.dequantize_groups(c, s, z[:2], 3, 32, "asym"),
        ValueError,
        "zeros must have shape",
    ),
    (
        "deq words not a multiple of bits",
        lambda x, c, s, z: ops.dequantize_groups(c[:, :5], s, z, 3, 32, "asym"),
        ValueError,
        "multiple of bits",
    ),
    ("deq fp32 scales", lambda x, c, s, z: ops.dequantize_groups(c, s.float(), z, 3, 32, "asym"), TypeError, "scales"),
    (
        "deq asym without zeros",
        lambda x, c, s, z: ops.dequantize_groups(c, s, None, 3, 32, "asym"),
        ValueError,
        "zeros is required",
    ),
    # 2. quantize_groups / quantize_groups_into on CPU
    ("quant int x", lambda x, c, s, z: ops.quantize_groups(x.int(), 3, 32, "sym", 0.0), TypeError, "x must be"),
    ("quant bool x", lambda x, c, s, z: ops.quantize_groups(x > 0, 3, 32, "sym", 0.0), TypeError, "x must be"),
    ("quant float64 x", lambda x, c, s, z: ops.quantize_groups(x.double(), 3, 32, "sym", 0.0), TypeError, "x must be"),
    (
        "quant complex x",
        lambda x, c, s, z: ops.quantize_groups(x.to(torch.complex64), 3, 32, "sym", 0.0),
        TypeError,
        "x must be",
    ),
    ("quant eta -1", lambda x, c, s, z: ops.quantize_groups(x, 3, 32, "asym", -1.0), ValueError, "eta"),
    ("quant eta 0.7", lambda x, c, s, z: ops.quantize_groups(x, 3, 32, "asym", 0.7), ValueError, "eta"),
    ("quant eta nan", lambda x, c, s, z: ops.quantize_groups(x, 3, 32, "asym", float("nan")), ValueError, "eta"),
    ("quant eta with sym", lambda x, c, s, z: ops.quantize_groups(x, 3, 32, "sym", 0.25), ValueError, "asym mode only"),
    ("quant bits 5", lambda x, c, s, z: ops.quantize_groups(x, 5, 32, "sym", 0.0), ValueError, "bits"),
    (
        "into broadcast codes",
        lambda x, c, s, z: ops.quantize_groups_into(x, 3, 32, "asym", 0.0, c[:1], s, z),
        ValueError,
        "codes must have shape",
    ),
    (
        "into float codes",
        lambda x, c, s, z: ops.quantize_groups_into(x, 3, 32, "asym", 0.0, c.float(), s, z),
        TypeError,
        "codes",
    ),
    (
        "into strided scales",
        lambda x, c, s, z: ops.quantize_groups_into(x, 3, 32, "asym", 0.0, c, _half(2, 4).t(), z),
        ValueError,
        "stride 1",
    ),
    (
        "into meta output",
        lambda x, c, s, z: ops.quantize_groups_into(x, 3, 32, "asym", 0.0, c.to("meta"), s, z),
        ValueError,
        "one device",
    ),
    (
        "into meta x",
        lambda x, c, s, z: ops.quantize_groups_into(x.to("meta"), 3, 32, "asym", 0.0, c, s, z),
        ValueError,
        "one device",
    ),
    ("pack float codes", lambda x, c, s, z: ops.pack_bits(x, 3), TypeError, "integer"),
    ("unpack bits 0", lambda x, c, s, z: ops.unpack_bits(c, 0), ValueError, "bits"),
    # outputs sharing memory with each other or with x (the stores of one landed in the other: a silent wrong answer)
    (
        "into scales is zeros",
        lambda x, c, s, z: ops.quantize_groups_into(x, 3, 32, "asym", 0.0, torch.empty_like(c), s, s),
        ValueError,
        "scales and zeros must not share memory",
    ),
    (
        "into zeros inside scales' rows",
        lambda x, c, s, z: ops.quantize_groups_into(x, 3, 32, "asym", 0.0, torch.empty_like(c), *_interleaved(4, 2)),
        ValueError,
        "scales and zeros must not share memory",
    ),
    (
        "into codes over x",
        lambda x, c, s, z: ops.quantize_groups_into(x, 3, 32, "asym", 0.0, x.view(torch.int32)[:, :6], s, z),
        ValueError,
        "x and codes must not share memory",
    ),
]


def _interleaved(rows, groups):
    """scales and zeros as the two halves of each row of one [rows, 2 groups] buffer: disjoint elements, but each
    one's byte span covers the other's (refused: the check is conservative, csrc/op_checks.h check_disjoint)."""
    buf = _half(rows, 2 * groups)
    return buf[:, :groups], buf[:, groups:]


@requires_c
@pytest.mark.parametrize("name, call, exc, match", CPU_CASES, ids=[c[0] for c in CPU_CASES])
def test_direct_cpu_op_rejects_bad_arguments(name, call, exc, match):
    x, c, s, z = _quantized()
    with pytest.raises(exc, match=match):
        call(x, c, s, z)


@requires_c
def test_direct_cpu_ops_still_compute_the_reference():
    # the checks must not reject valid calls, including strided rows (last dim contiguous)
    x, c, s, z = _quantized()
    torch.testing.assert_close(
        ops.dequantize_groups(c, s, z, 3, 32, "asym"), kvkernels.reference.dequantize_groups(c, s, z, 3, 32, "asym")
    )
    big = torch.randn(4, 128)
    codes, scales, zeros = torch.empty(4, 12, dtype=torch.int32), _half(4, 4), _half(4, 4)
    ops.quantize_groups_into(big[:, :64], 3, 32, "asym", 0.1, codes[:, :6], scales[:, :2], zeros[:, :2])
    want = kvkernels.reference.quantize_groups(big[:, :64].contiguous(), 3, 32, "asym", 0.1)
    for got, w in zip((codes[:, :6], scales[:, :2], zeros[:, :2]), want, strict=True):
        torch.testing.assert_close(got, w, rtol=0, atol=0)


META_CASES = [
    # 3. the fakes validate what they can (metadata)
    (
        "dequantize bits 9",
        lambda m: ops.dequantize_groups(m(4, 6, dtype=torch.int32), m(4, 2, dtype=torch.half), None, 9, 32, "sym"),
        ValueError,
        "bits",
    ),
    (
        "unpack bits 0 (was ZeroDivisionError)",
        lambda m: ops.unpack_bits(m(4, 6, dtype=torch.int32), 0),
        ValueError,
        "bits",
    ),
    ("quantize group 48", lambda m: ops.quantize_groups(m(4, 96), 3, 48, "sym", 0.0), ValueError, "group_size"),
    (
        "gemv H_q not a multiple of H_kv",
        lambda m: ops.gemv_inner_q(
            m(1, 3, 1, 64), m(1, 2, 8, 6, dtype=torch.int32), m(1, 2, 8, 2, dtype=torch.half), None, 3, 32, "sym"
        ),
        ValueError,
        "multiple of KV heads",
    ),
    (
        "kivi wrong rows",
        lambda m: ops.gemv_kivi(
            m(1, 2, 64),
            m(1, 1, 32, 2, dtype=torch.int32),
            m(1, 1, 32, 1, dtype=torch.half),
            m(1, 1, 32, 1, dtype=torch.half),
            2,
            32,
        ),
        ValueError,
        "rows",
    ),
    (
        "pack int32 ok but last dim 33",
        lambda m: ops.pack_bits(m(4, 33, dtype=torch.int32), 3),
        ValueError,
        "multiple of 32",
    ),
]


@requires_c
@pytest.mark.parametrize("name, call, exc, match", META_CASES, ids=[c[0] for c in META_CASES])
def test_fake_kernels_validate(name, call, exc, match):
    def meta(*shape, dtype=torch.float32):
        return torch.empty(*shape, dtype=dtype, device="meta")

    with pytest.raises(exc, match=match):
        call(meta)


def test_public_dequantize_rejects_mixed_devices():
    # 4. CPU codes with meta scales used to return garbage
    _, c, s, z = _quantized()
    with pytest.raises(ValueError, match="one device"):
        kvkernels.dequantize_groups(c, s.to("meta"), z, 3, 32, "asym")


# 5. the value check bounds what is stored: asym's (max - min) / (2^b - 1) and min, sym's max|x| / 2^(b-1)
@requires_c
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_value_check_bounds_the_stored_scale(dtype):
    x = torch.zeros(2, 64)
    x[0, :16], x[0, 16:32] = -40000.0, 40000.0  # |x| < 65504, but the 1-bit asym scale is 80000 -> inf in fp16
    x = x.to(dtype)
    with pytest.raises(ValueError, match=r"\(max - min\)"):
        kvkernels.quantize_groups(x, 1, 32, "asym")
    # without the check it really is poisoned: the whole group reads back NaN
    c, s, z = kvkernels.quantize_groups(x, 1, 32, "asym", check_values=False)
    assert kvkernels.dequantize_groups(c, s, z, 1, 32, "asym")[0, :32].isnan().all()
    # sym stores at most max|x| and hybrid falls back to sym where asym's scale overflows: both are accepted
    for mode in ("sym", "hybrid"):
        c, s, z = kvkernels.quantize_groups(x, 1, 32, mode)
        assert torch.isfinite(kvkernels.dequantize_groups(c, s, z, 1, 32, mode)).all()
    # 2 bits divide the same range by 3: 26667 fits
    c, s, z = kvkernels.quantize_groups(x, 2, 32, "asym")
    assert torch.isfinite(kvkernels.dequantize_groups(c, s, z, 2, 32, "asym")).all()
    x[1, 40] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        kvkernels.quantize_groups(x, 4, 32, "sym")


# 12. check_values reduces in chunks (small temporaries) and still sees a bad value in the last chunk
@requires_c
def test_value_check_works_in_chunks(monkeypatch):
    from kvkernels import _validate

    monkeypatch.setattr(_validate, "VALUE_CHECK_CHUNK", 256)
    x = torch.randn(3, 5, 64)
    chunks = list(_validate._leading_chunks(x, 256))
    assert sum(c.numel() for c in chunks) == x.numel() and max(c.numel() for c in chunks) <= 256
    kvkernels.quantize_groups(x, 2, 32, "asym")  # passes
    x[2, 4, 63] = 70000.0
    with pytest.raises(ValueError, match="reaches 7e\\+04"):
        kvkernels.quantize_groups(x, 2, 32, "sym")
    x[2, 4, 63] = float("inf")
    with pytest.raises(ValueError, match="NaN or Inf"):
        kvkernels.quantize_groups_into(
            x,
            2,
            32,
            "sym",
            0.0,
            *(t.clone() for t in kvkernels.quantize_groups(x.clamp(-9, 9), 2, 32, "sym")),
            check_values=True,
        )


# 12. pack_bits reads narrow integer codes in their own dtype (it used to widen everything to int64 first)
@requires_c
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.int64])
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_pack_bits_any_integer_dtype(dtype, bits):
    from kvkernels.reference import packing

    codes = torch.randint(0, 2**bits, (3, 96), generator=torch.Generator().manual_seed(bits)).to(dtype)
    torch.testing.assert_close(ops.pack_bits(codes, bits), packing.pack_bits(codes.long(), bits), rtol=0, atol=0)
    strided = codes.repeat(1, 2)[:, ::2]  # non-contiguous
    torch.testing.assert_close(ops.pack_bits(strided, bits), packing.pack_bits(strided.long(), bits), rtol=0, atol=0)


# -- the cache and the transformers integration (items 7-10) -------------------------------------------------


def _tiny_llama(head_dim=64, layers=2):
    return tiny_llama(head_dim=head_dim, layers=layers, heads=2, kv_heads=1, vocab=64, attn="sdpa")


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_handles_never_reach_another_attention_silently(impl):
    # 7. no config -> fused=True; a model left on SDPA / eager read the handles as zero keys (5% agreement, no warning)
    from kvkernels.integrations.transformers import KVKernelsCache

    model = _tiny_llama()
    model.set_attn_implementation(impl)
    ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="set_attn_implementation\\('kvkernels'\\)"):
        model.generate(ids, past_key_values=KVKernelsCache("kivi4", num_layers=2), max_new_tokens=3, do_sample=False)
    # on the kvkernels attention the same cache runs, and the handles' metadata stays readable
    model.set_attn_implementation("kvkernels")
    cache = KVKernelsCache("kivi4", num_layers=2)
    model.generate(ids, past_key_values=cache, max_new_tokens=3, do_sample=False)
    assert cache.paths["fused"] == 2 * 2
    k = torch.randn(1, 1, 1, 64)
    handle, _ = cache.update(k, k, 0)
    assert handle.shape == (1, 1, 0, 64) and handle.dtype == torch.float32 and handle.dim() == 4


def test_integer_attention_masks_are_rejected():
    # 8. an int64 0/1 mask used to be added to the scores
    from kvkernels.formats import PRESETS, make_layer_cache

    cache = make_layer_cache(PRESETS["kivi4"], 1, 2, 64, capacity=64, dtype=torch.float32)
    cache.append(torch.randn(1, 2, 10, 64), torch.randn(1, 2, 10, 64))
    q = torch.randn(1, 4, 1, 64)
    with pytest.raises(TypeError, match="attn_mask must be bool"):
        cache.attention(q, attn_mask=torch.ones(1, 1, 1, 10, dtype=torch.int64))
    as_bool = cache.attention(q, attn_mask=torch.ones(1, 1, 1, 10, dtype=torch.bool))
    torch.testing.assert_close(as_bool, cache.attention(q))


@pytest.mark.parametrize("method", ["innerq_base", "kivi4", "specache1"])  # specache1: its host copy too
def test_cache_filled_under_inference_mode_appends_outside_it(method):
    # 9. "Inplace update to inference tensor outside InferenceMode"; DynamicCache handles the same sequence
    from kvkernels.integrations.transformers import KVKernelsCache

    transformers = pytest.importorskip("transformers")
    model = _tiny_llama()
    model.set_attn_implementation("kvkernels")
    ids = torch.randint(0, 64, (1, 300), generator=torch.Generator().manual_seed(0))
    cache, ref = KVKernelsCache(method, config=model.config), transformers.DynamicCache()
    with torch.inference_mode():
        model(ids[:, :280], past_key_values=cache)
        model(ids[:, :280], past_key_values=ref)
    with torch.no_grad():
        for t in range(280, 300):  # crosses value-group evictions (writes into the stores)
            out = model(ids[:, t : t + 1], past_key_values=cache).logits
            model(ids[:, t : t + 1], past_key_values=ref)
    assert cache.get_seq_length() == ref.get_seq_length() == 300
    assert torch.isfinite(out).all()


def test_cache_construction_rejects_what_generate_would_find_late():
    # 10. these used to fail only at the first update inside generate(), or with a bare IndexError
    transformers = pytest.importorskip("transformers")
    from kvkernels.integrations.transformers import KVKernelsCache

    model = _tiny_llama()
    with pytest.raises(ValueError, match="head_dim=80 must be a multiple of group_size"):
        KVKernelsCache("kivi4", config=_tiny_llama(head_dim=80).config)
    with pytest.raises(ValueError, match="capacity must be an int >= 0"):
        KVKernelsCache("innerq_base", config=model.config, capacity=-5)
    with pytest.raises(ValueError, match="num_layers=3 but the model config has 2"):
        KVKernelsCache("innerq_base", config=model.config, num_layers=3)
    with pytest.raises(NotImplementedError, match="sliding window of 4096"):
        KVKernelsCache("kivi4", config=transformers.MistralConfig(num_hidden_layers=2))
    KVKernelsCache("kivi4", config=transformers.Qwen2Config(num_hidden_layers=2))  # sliding_window unused: fine
    model.set_attn_implementation("kvkernels")
    ids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="built for 1 layers but the model updated layer 1"):
        model.generate(ids, past_key_values=KVKernelsCache("kivi4", num_layers=1), max_new_tokens=2)


@pytest.mark.parametrize("method", ["innerq_base", "kivi4"])
def test_crop_to_zero_is_a_reset(method):
    # 10. crop(0) kept the old prompt's InnerQ key norm; the next write must fix a new one, like a fresh cache
    from kvkernels.formats import PRESETS, make_layer_cache

    def make():
        return make_layer_cache(PRESETS[method], 1, 2, 64, capacity=64, dtype=torch.float32)

    gen = torch.Generator().manual_seed(0)
    first = [torch.randn(1, 2, 300, 64, generator=gen) * 8 for _ in range(2)]
    second = [torch.randn(1, 2, 300, 64, generator=gen) for _ in range(2)]
    cropped, fresh = make(), make()
    cropped.append(*first)
    cropped.crop(0)
    assert cropped.seq_len == 0
    cropped.append(*second)
    fresh.append(*second)
    for a, b in zip(cropped.dequantized(), fresh.dequantized(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    q = torch.randn(1, 4, 1, 64, generator=gen)
    torch.testing.assert_close(cropped.attention(q), fresh.attention(q), rtol=0, atol=0)


# -- NaN policy of the GEMVs (docs/FORMATS.md, "NaN / Inf"): a NaN stays in the outputs it contributes to ----------


def _gemv_backends():
    from kvkernels import reference

    yield "reference", reference
    if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available():
        try:
            import kvkernels.triton_kernels as tk
            from kvkernels.triton_kernels._common import interpreter_problem
        except ImportError:
            return
        if torch.cuda.is_available() or not interpreter_problem():
            yield "triton", tk


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the Triton interpreter's numpy
@pytest.mark.parametrize("backend", [name for name, _ in _gemv_backends()])
def test_gemv_nan_stays_in_the_outputs_it_feeds(backend):
    impl = dict(_gemv_backends())[backend]
    # compiled Triton takes CUDA tensors only (the first GPU run failed this test on CPU ones); the interpreter CPU ones
    compiled_triton = backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1"
    dev = "cuda" if compiled_triton else "cpu"
    gen = torch.Generator().manual_seed(0)
    B, H_kv, ratio, M, L = 2, 2, 2, 5, 64
    k = torch.randn(B, H_kv, M, L, generator=gen)
    codes, scales, zeros = (t.to(dev) for t in kvkernels.quantize_groups(k, 3, 32, "asym"))
    x = torch.randn(B, H_kv * ratio, L, generator=gen).to(dev)
    x[1, 3, 7] = float("nan")  # query row (b=1, h_q=3)
    y = impl.gemv_inner_q(x, codes, scales, zeros, 3, 32, "asym").cpu()
    nan = torch.zeros_like(y, dtype=torch.bool)
    nan[1, 3] = True  # every score of that row, nothing else
    assert torch.equal(y.isnan(), nan)
    x[1, 3, 7] = 0.0
    scales[0, 1, 4, 1] = float("nan")  # token 4 of KV head 1 in batch 0: its score in both query heads of head 1
    y = impl.gemv_inner_q(x, codes, scales, zeros, 3, 32, "asym").cpu()
    nan = torch.zeros_like(y, dtype=torch.bool)
    nan[0, 2:4, 4] = True
    assert torch.equal(y.isnan(), nan)
    # the value side (KIVI layout, groups along the reduced rows' columns): a NaN probability poisons its row
    v = torch.randn(B, H_kv, L, 64, generator=gen)
    codes, scales, zeros = (t.to(dev) for t in kvkernels.quantize_groups(v, 2, 32, "asym"))
    p = torch.rand(B, H_kv * ratio, L, generator=gen).to(dev)
    p[0, 0, 3] = float("nan")
    y = impl.gemv_kivi(p, codes, scales, zeros, 2, 32).cpu()
    nan = torch.zeros_like(y, dtype=torch.bool)
    nan[0, 0] = True
    assert torch.equal(y.isnan(), nan)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_quantize_into_takes_disjoint_parts_of_one_buffer(device):
    # the sharing rule must not refuse outputs carved from one allocation without overlap (codes, scales, zeros of a
    # packed block), on the C++ kernel and on the fake
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    block = torch.zeros(4 * 6 + 2 * 4 * 2 // 2, dtype=torch.int32)
    codes = block[:24].view(4, 6)
    halves = block[24:].view(torch.float16)
    scales, zeros = halves[:8].view(4, 2), halves[8:].view(4, 2)
    if device == "meta":
        x, codes, scales, zeros = (t.to("meta") for t in (x, codes, scales, zeros))
    if device == "cpu" and kvkernels.backends()["cpp"] != "available":
        pytest.skip("kvkernels._C not built")
    ops.quantize_groups_into(x, 3, 32, "asym", 0.0, codes, scales, zeros)
    if device == "cpu":
        want = kvkernels.reference.quantize_groups(x, 3, 32, "asym")
        for got, w in zip((codes, scales, zeros), want, strict=True):
            assert torch.equal(got, w)


def test_wrapper_refuses_outputs_sharing_memory():
    x = torch.randn(4, 64)
    codes, scales, zeros = kvkernels.quantize_groups(x, 3, 32, "asym")
    with pytest.raises(ValueError, match="scales and zeros must not share memory"):
        kvkernels.quantize_groups_into(x, 3, 32, "asym", 0.0, codes, scales, scales)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"bits": True}, ValueError, "bits must be one of"),
        ({"bits": 3.0}, ValueError, "bits must be one of"),
        ({"group_size": 32.0}, TypeError, "group_size must be an int"),
        ({"eta": None}, TypeError, "eta must be a float"),
        ({"eta": True}, TypeError, "eta must be a float"),
    ],
)
def test_quantize_refuses_arguments_of_the_wrong_type(kwargs, exc, match):
    args = {"bits": 3, "group_size": 32, "mode": "asym", "eta": 0.0} | kwargs
    with pytest.raises(exc, match=match):
        kvkernels.quantize_groups(torch.randn(4, 64), **args)


def test_value_checks_pass_over_meta_tensors():
    # no data to read: the wrappers' shape checks run, the value checks (a device sync) are skipped
    codes, scales, zeros = kvkernels.quantize_groups(torch.empty(2, 64, device="meta"), 3, 32, "asym")
    assert codes.device.type == "meta" and tuple(scales.shape) == (2, 2)


def test_decode_attention_refuses_non_float_queries():
    from kvkernels.formats import make_layer_cache

    cache = make_layer_cache(kvkernels.PRESETS["innerq_base"], 1, 2, 64, capacity=64, dtype=torch.float32)
    cache.append(torch.randn(1, 2, 40, 64), torch.randn(1, 2, 40, 64))
    q = torch.randn(1, 4, 1, 64)
    for bad in (q.int(), q > 0):
        with pytest.raises(TypeError, match="q must be floating point"):
            kvkernels.decode_attention(bad, cache)
    assert kvkernels.decode_attention(q, cache).dtype == torch.float32


def test_layer_cache_crop_and_reorder_refuse_non_integers():
    from kvkernels.formats import make_layer_cache

    cache = make_layer_cache(kvkernels.PRESETS["kivi2"], 2, 2, 64, capacity=64, dtype=torch.float32)
    cache.append(torch.randn(2, 2, 20, 64), torch.randn(2, 2, 20, 64))
    with pytest.raises(TypeError, match="crop takes an int"):
        cache.crop(5.0)
    with pytest.raises(TypeError, match="index must hold integers"):
        cache.reorder(torch.tensor([0.7, 1.0]))
    cache.reorder(torch.tensor([1, 0]))
    cache.crop(5)
    assert cache.seq_len == 5


def test_key_norm_factors_shorter_than_the_model_is_named():
    from kvkernels.integrations.transformers import _layer_factors

    assert _layer_factors({0: "f0"}, 3) is None
    assert _layer_factors(["f0", "f1"], 1) == "f1"
    with pytest.raises(ValueError, match="key_norm_factors holds 2 layers' factors but the model has layer 2"):
        _layer_factors(["f0", "f1"], 2)
