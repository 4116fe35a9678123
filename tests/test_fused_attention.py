"""decode_attention_fused: the op's spec (reference) against the composed decode attention on every format that can be
fused, its argument checks on every entry point, opcheck, and which path decode_attention takes.

The Triton kernel is held to the reference in tests/test_triton_attention.py, the CUDA kernel in the emulator
(tests/test_cuda_emulated.py) and on a GPU (tests/test_cuda_kernels.py).
"""

import pytest
import torch
from device_lengths import with_capacity

import kvkernels
from kvkernels import attention, ops, reference
from kvkernels.cache import ModelKVCache
from kvkernels.formats import PRESETS, format_of, make_layer_cache

FUSABLE = ("innerq", "kivi", "xquant")  # formats whose layer caches keep the base attention hooks


def _filled(preset, B=2, H_kv=2, D=64, N=230, prefill=150, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(B, H_kv, N, D, generator=g), torch.randn(B, H_kv, N, D, generator=g)
    k[..., 5] *= 6.0
    c = make_layer_cache(PRESETS[preset], B, H_kv, D, capacity=64, dtype=dtype)
    c.prefill(k[:, :, :prefill].to(dtype), v[:, :, :prefill].to(dtype))
    for i in range(prefill, N):
        c.append(k[:, :, i : i + 1].to(dtype), v[:, :, i : i + 1].to(dtype))
    return c


def _q(B, H_q, T, D, seed=1):
    return torch.randn(B, H_q, T, D, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("preset", list(PRESETS))
def test_operands_offered_exactly_by_the_plain_formats(preset):
    fmt = format_of(PRESETS[preset])
    if fmt.name == "xquant":
        pytest.skip("XQuant layers need a model cache: test_xquant_layers_fuse")
    if fmt.name not in FUSABLE:  # lattice and SpeCache attend their own way: the op would be wrong for them
        assert make_layer_cache(PRESETS[preset], 1, 2, 64, capacity=64).fused_attention_operands() is None
        return
    c = _filled(preset)
    kw = c.fused_attention_operands()
    assert kw is not None
    assert kw["key_layout"] == fmt.key_layout and kw["value_layout"] == fmt.value_layout
    assert kw["sink_keys"].data_ptr() == c._sink_k.data_ptr()  # views, no copies
    assert kw["key_codes"].data_ptr() == c.key_store.codes.data_ptr()


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("preset", ["innerq_base", "innerq_hybrid", "innerq_asym1_eta", "kivi2", "kivi4"])
def test_fused_equals_composed(preset, T):
    c = _filled(preset)
    q = _q(2, 6, T, 64)
    want = c.attention(q, fused_op=False)
    got = c.attention(q, fused_op=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("N", [1, 3, 31, 40, 129, 161, 200])
@pytest.mark.parametrize("preset", ["innerq_small", "kivi2"])
def test_fused_equals_composed_in_every_window_state(preset, N):
    # sink only, sink + tails, a value store still empty, one store ahead of the other, ...
    c = _filled(preset, N=N, prefill=min(N, 2))
    T = min(N, 2)
    q = _q(2, 4, T, 64)
    torch.testing.assert_close(c.attention(q, fused_op=True), c.attention(q, fused_op=False), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("preset", ["innerq_base", "kivi2"])
def test_fused_masks(preset):
    c = _filled(preset, N=120, prefill=100)
    N = c.seq_len
    q = _q(2, 4, 2, 64)
    bool_mask = torch.rand(2, 1, 2, N, generator=torch.Generator().manual_seed(3)) > 0.4
    bool_mask[1, 0, 1] = False  # a fully masked row (a padding query): uniform average, not NaN
    float_mask = torch.zeros(1, 4, 2, N).masked_fill(~bool_mask[:1].expand(1, 4, 2, N), float("-inf"))
    float_mask[..., 0] = 0.0  # every row keeps a token, so -inf never covers a whole row
    for mask in (bool_mask, float_mask):
        got = c.attention(q, attn_mask=mask, fused_op=True)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, c.attention(q, attn_mask=mask, fused_op=False), rtol=1e-5, atol=2e-6)
    _, v = c.dequantized()
    uniform = v[1].mean(1).repeat_interleave(2, 0)  # [H_q, D]
    torch.testing.assert_close(c.attention(q, attn_mask=bool_mask, fused_op=True)[1, :, 1], uniform)


def test_xquant_layers_fuse():
    # XQuant's reusing layers read another layer's codes through their store views: the op sees them as any store
    model = ModelKVCache(PRESETS["xquant_1.38"], capacity=64, num_layers=4)
    g = torch.Generator().manual_seed(0)
    for layer in range(4):
        k, v = torch.randn(1, 2, 180, 64, generator=g), torch.randn(1, 2, 180, 64, generator=g)
        model.append(layer, k, v)
    q = _q(1, 4, 1, 64)
    for layer in range(4):
        c = model.layer(layer)
        assert c.fused_attention_operands() is not None
        torch.testing.assert_close(c.attention(q, fused_op=True), c.attention(q, fused_op=False), rtol=1e-5, atol=2e-6)


def test_fused_op_true_on_a_format_that_cannot_raises():
    c = make_layer_cache(PRESETS["lattice2"], 1, 2, 64, capacity=64)
    c.append(torch.randn(1, 2, 5, 64), torch.randn(1, 2, 5, 64))
    with pytest.raises(ValueError, match="attends its own way"):
        c.attention(_q(1, 2, 1, 64), fused_op=True)
    c.attention(_q(1, 2, 1, 64))  # the default composes


def _count_fused_op_calls(monkeypatch) -> list:
    """A list that gets a 1 each time decode_attention runs the fused op (which it takes through ops.unchecked)."""
    calls, real = [], ops.unchecked

    def spy(op):
        fn = real(op)
        return (lambda *a, **k: calls.append(1) or fn(*a, **k)) if op == "decode_attention_fused" else fn

    monkeypatch.setattr(ops, "unchecked", spy)
    return calls


def test_policy_env(monkeypatch):
    c = _filled("kivi2", N=60, prefill=60)
    q = _q(2, 4, 1, 64)
    calls = _count_fused_op_calls(monkeypatch)
    c.attention(q)
    assert calls == []  # auto: CPU composes
    monkeypatch.setenv(attention.ATTENTION_ENV, "fused")
    c.attention(q)
    assert calls == [1]
    lattice = make_layer_cache(PRESETS["lattice2"], 1, 2, 64, capacity=64)
    lattice.append(torch.randn(1, 2, 5, 64), torch.randn(1, 2, 5, 64))
    lattice.attention(_q(1, 2, 1, 64))  # "fused" fuses what can be fused; the rest composes
    monkeypatch.setenv(attention.ATTENTION_ENV, "composed")
    c.attention(q, fused_op=True)  # the argument wins over the environment
    assert calls == [1, 1]
    monkeypatch.setenv(attention.ATTENTION_ENV, "fast")
    with pytest.raises(ValueError, match="KVKERNELS_ATTENTION"):
        c.attention(q)


# ---- the op itself -------------------------------------------------------------------------------------------------


def _op_args(T=2, mask=False, seed=4):
    c = _filled("innerq_hybrid", N=150, prefill=140, seed=seed)
    kw = c.fused_attention_operands()
    x = _q(2, 4, T, 64, seed=seed) * 0.125
    if mask:
        kw["attn_mask"] = torch.randn(1, 4, T, c.seq_len, generator=torch.Generator().manual_seed(seed))
    return x, kw


def test_op_dispatch_runs_the_reference_on_cpu():
    x, kw = _op_args(mask=True)
    assert torch.equal(torch.ops.kvkernels.decode_attention_fused(x, **kw), reference.decode_attention_fused(x, **kw))
    assert torch.equal(kvkernels.ops.decode_attention_fused(x, **kw), reference.decode_attention_fused(x, **kw))


def test_split_tokens_is_checked_and_does_not_change_the_reference():
    x, kw = _op_args()
    base = reference.decode_attention_fused(x, **kw)
    assert torch.equal(ops.decode_attention_fused(x, **kw, split_tokens=64), base)
    with pytest.raises(ValueError, match="split_tokens"):
        ops.decode_attention_fused(x, **kw, split_tokens=48)


def _bad_cases():
    x, kw = _op_args()

    def with_(**changes):
        return x, {**kw, **changes}

    N = kw["sink_keys"].shape[2] + kw["key_codes"].shape[2] + kw["key_tail"].shape[2]
    return {
        "x int": ((x.to(torch.int32), kw), TypeError, "x must be float16 or bfloat16 or float32"),
        "q_scale nan": (with_(q_scale=float("nan")), ValueError, "q_scale must be finite"),
        "q_scale inf": (with_(q_scale=float("inf")), ValueError, "q_scale must be finite"),
        "out_dtype": (with_(out_dtype=torch.int32), TypeError, "out_dtype must be float16 or bfloat16 or float32"),
        "x 3-D": ((x[:, :, 0], kw), ValueError, r"x must be \[B, H_q, T, D\]"),
        "heads": ((x[:, :3], kw), ValueError, "multiple of KV heads"),
        "tail dtype": (with_(key_tail=kw["key_tail"].float()), TypeError, "key_tail must be float16"),
        "token counts": (with_(value_tail=kw["value_tail"][:, :, 1:]), ValueError, "both must cover the same tokens"),
        "layout": (with_(key_layout="row"), ValueError, "key_layout must be one of"),
        "mode": (with_(value_mode="int"), ValueError, "value_mode must be one of"),
        "bits": (with_(key_bits=5), ValueError, "key_bits must be one of"),
        "zeros missing": (with_(value_zeros=None), ValueError, "value_zeros is required"),
        "codes dtype": (with_(key_codes=kw["key_codes"].to(torch.int64)), TypeError, "key_codes must be int32"),
        "scales shape": (with_(key_scales=kw["key_scales"][..., :1]), ValueError, "key_scales must have shape"),
        "x_scale shape": (with_(key_x_scale=kw["key_x_scale"][:1]), ValueError, "key_x_scale must have shape"),
        "mask shape": (with_(attn_mask=torch.zeros(1, 1, 2, N - 1)), ValueError, "attn_mask must be"),
        "mask dtype": (with_(attn_mask=torch.zeros(1, 1, 2, N, dtype=torch.bool)), TypeError, "attn_mask must be"),
        "group size": (with_(group_size=48), ValueError, "group_size must be a positive multiple of 32"),
        "huge group": (with_(group_size=2**62), ValueError, "group_size must be a positive multiple of 32 up to"),
        "T > N": ((_q(2, 4, N + 1, 64), kw), ValueError, "1 <= T <= N"),
    }


@pytest.mark.parametrize("entry", ["wrapper", "torch.ops"])
@pytest.mark.parametrize("case", list(_bad_cases()))
def test_bad_arguments_raise_on_every_entry_point(case, entry):
    (x, kw), exc, match = _bad_cases()[case]
    fn = ops.decode_attention_fused if entry == "wrapper" else torch.ops.kvkernels.decode_attention_fused
    with pytest.raises(exc, match=match):
        fn(x, **kw)


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("lengths", [False, True])
@pytest.mark.parametrize("mask", [False, True])
def test_opcheck(mask, lengths, scaled):
    x, kw = _op_args(mask=mask)
    if lengths:
        kw, kw["lengths"] = with_capacity(kw)
    if scaled:  # the queries in bf16 with their scale, the result in bf16
        x, kw["q_scale"], kw["out_dtype"] = x.bfloat16(), 0.125, torch.bfloat16
    defaults = {"split_tokens": 0, "q_scale": 1.0}
    names = [a.name for a in torch.ops.kvkernels.decode_attention_fused.default._schema.arguments]
    args = tuple(x if n == "x" else kw.get(n, defaults.get(n)) for n in names)
    torch.library.opcheck(torch.ops.kvkernels.decode_attention_fused.default, args)


@pytest.mark.parametrize("out_dtype", [None, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_q_scale_and_out_dtype_are_the_conversions_around_the_op(x_dtype, out_dtype):
    # op(q, q_scale=s, out_dtype=o) is op(q.to(fp32) * s).to(o), bit for bit: the arithmetic decode_attention ran
    # around the op before it took them (one fp32 multiply in, one rounding out)
    x, kw = _op_args(mask=True)
    q, s = (x * 3).to(x_dtype), 0.0883883476
    want = reference.decode_attention_fused(q.to(torch.float32) * s, **kw)
    want = want if out_dtype is None else want.to(out_dtype)
    for fn in (ops.decode_attention_fused, torch.ops.kvkernels.decode_attention_fused):
        got = fn(q, **kw, q_scale=s, out_dtype=out_dtype)
        assert got.dtype == (out_dtype or torch.float32) and torch.equal(got, want)
    # the lengths form sums in another order: equal up to fp32 rounding, plus one ulp of the output dtype
    padded, lengths = with_capacity(kw)
    got = ops.decode_attention_fused(q, **padded, lengths=lengths, q_scale=s, out_dtype=out_dtype)
    tol = {torch.float16: 2**-10, torch.bfloat16: 2**-7}.get(out_dtype, 1e-6)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=1e-6)


# ---- device-side lengths (static caches, CUDA graphs) --------------------------------------------------------------


@pytest.mark.parametrize("mask", [False, True])
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("N", [3, 40, 161, 230])
@pytest.mark.parametrize("preset", ["innerq_base", "kivi2"])
def test_device_lengths_equal_the_exact_sizes(preset, N, T, mask):
    # capacity buffers with NaN / random junk past the used tokens, NaN mask columns past N: none of it may leak
    c = _filled(preset, N=N, prefill=min(N, 150))
    kw = c.fused_attention_operands()
    x = _q(2, 4, T, 64) * 0.125
    if mask:
        kw["attn_mask"] = torch.randn(2, 1, T, N, generator=torch.Generator().manual_seed(2))
    want = reference.decode_attention_fused(x, **kw)
    padded, lengths = with_capacity(kw)
    for fn in (ops.decode_attention_fused, torch.ops.kvkernels.decode_attention_fused):
        torch.testing.assert_close(fn(x, **padded, lengths=lengths), want, rtol=1e-6, atol=1e-6)


def test_device_lengths_are_not_checked_against_the_buffers_on_the_host():
    # inconsistent lengths cannot be seen without a sync: the op clamps them into the buffers and does not fail
    x, kw = _op_args()
    padded, lengths = with_capacity(kw)
    for bad in ([10**9, 10**9, 10**9, 10**9, 10**9], [-5, 3, 0, 7, 2], [0, 0, 0, 0, 0]):
        out = ops.decode_attention_fused(x, **padded, lengths=torch.tensor(bad))
        assert out.shape == x.shape


def _bad_length_cases():
    x, kw = _op_args()
    padded, lengths = with_capacity(kw)

    def with_(**changes):
        return x, {**padded, "lengths": lengths, **changes}

    return {
        "lengths dtype": (with_(lengths=lengths.int()), TypeError, "lengths must be int64"),
        "lengths shape": (with_(lengths=lengths[:4]), ValueError, "lengths must have shape"),
        "mask narrower than the buffers": (
            with_(attn_mask=torch.zeros(1, 1, 2, 20)), ValueError, r"M >= \d+ \(the tokens the buffers hold\)",
        ),
    }  # fmt: skip


@pytest.mark.parametrize("entry", ["wrapper", "torch.ops"])
@pytest.mark.parametrize("case", list(_bad_length_cases()))
def test_bad_lengths_raise_on_every_entry_point(case, entry):
    (x, kw), exc, match = _bad_length_cases()[case]
    fn = ops.decode_attention_fused if entry == "wrapper" else torch.ops.kvkernels.decode_attention_fused
    with pytest.raises(exc, match=match):
        fn(x, **kw)


def test_compiles_with_the_fake():
    x, kw = _op_args()

    @torch.compile(fullgraph=True, backend="eager")
    def step(x):
        return torch.ops.kvkernels.decode_attention_fused(x * 1.0, **kw)

    torch.testing.assert_close(step(x), reference.decode_attention_fused(x, **kw))


def test_head_dims_the_serving_kernel_refuses_compose(monkeypatch):
    # the compiled CUDA kernel takes head_dim 64 / 128 only: the default must compose elsewhere, not raise
    c = _filled("kivi2", N=60, prefill=60)
    q = _q(2, 4, 1, 64)
    monkeypatch.setenv(attention.ATTENTION_ENV, "fused")
    calls = _count_fused_op_calls(monkeypatch)
    monkeypatch.setattr(ops, "fused_attention_takes", lambda device, head_dim: False)
    c.attention(q)
    assert calls == []
    c.attention(q, fused_op=True)  # asked for explicitly: the op runs (and would raise where it cannot)
    assert calls == [1]


@pytest.mark.parametrize("preset", ["innerq_base", "kivi2", "xquant_1.38"])
def test_a_decode_step_checks_its_arguments_once(monkeypatch, preset):
    """append + attention (fused and composed) reach each op through ops.unchecked: the op's own kernel validates the
    arguments (on CPU the C++ kernel, or a Python one through _checked, whose checks were bound at registration), and
    the public wrappers' Python pre-checks, a second pass over the same metadata, stay out of the per-layer, per-step
    path (~25 us of host time a step, docs/ARCHITECTURE.md "How an op is dispatched"). The wrappers still check."""
    counts = []
    for name in ("check_quantize_into", "check_decode_attention_fused", "check_gemv_inner_q", "check_gemv_kivi"):
        real = getattr(kvkernels._validate, name)
        spy = lambda *a, _r=real, _n=name, **k: counts.append(_n) or _r(*a, **k)  # noqa: E731
        monkeypatch.setattr(kvkernels._validate, name, spy)
    g = torch.Generator().manual_seed(3)
    model = ModelKVCache(PRESETS[preset], capacity=64, num_layers=2)
    for layer in range(2):  # XQuant's second layer reads the first one's codes
        model.append(layer, torch.randn(1, 2, 100, 64, generator=g), torch.randn(1, 2, 100, 64, generator=g))
    q = _q(1, 4, 1, 64)
    for _ in range(40):  # past a group of G = 32 tokens: the value store writes too
        for layer in range(2):
            model.append(layer, torch.randn(1, 2, 1, 64, generator=g), torch.randn(1, 2, 1, 64, generator=g))
            c = model.layer(layer)
            fused, composed = c.attention(q, fused_op=True), c.attention(q, fused_op=False)
            torch.testing.assert_close(fused, composed, rtol=1e-5, atol=2e-6)
    assert counts == []
    ops.quantize_groups_into(torch.randn(2, 64), 2, 32, "sym", 0.0, *ops.quantize_groups(torch.randn(2, 64), 2, 32))
    assert counts == ["check_quantize_into"]


def test_bool_mask_under_another_default_dtype():
    c = _filled("innerq_base", N=80, prefill=80)
    q = _q(2, 4, 2, 64)
    mask = torch.rand(2, 1, 2, c.seq_len, generator=torch.Generator().manual_seed(5)) > 0.5
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        got = c.attention(q, attn_mask=mask, fused_op=True)
    finally:
        torch.set_default_dtype(old)
    torch.testing.assert_close(got, c.attention(q, attn_mask=mask, fused_op=False), rtol=1e-5, atol=2e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("D", [64, 96, 128])
@pytest.mark.parametrize("preset", ["innerq_base", "kivi2"])
def test_cuda_default_path_equals_composed(preset, D):
    # end to end on the GPU: the default (fused where the serving kernel takes D and auto fuses the layouts, as for
    # innerq_base; composed elsewhere, kivi2 included), bool and float masks through _additive_mask, against the
    # composed path on the same cache. 600 tokens: stores of >= 256 tokens, so innerq_base's store tiles run (at 300
    # only the general kernel did)
    g = torch.Generator().manual_seed(11)
    c = make_layer_cache(PRESETS[preset], 2, 2, D, capacity=64, device="cuda", dtype=torch.float16)
    k, v = torch.randn(2, 2, 600, D, generator=g), torch.randn(2, 2, 600, D, generator=g)
    c.prefill(k.half().cuda(), v.half().cuda())
    q = torch.randn(2, 6, 3, D, generator=g).half().cuda()
    mask = torch.rand(2, 1, 3, c.seq_len, generator=g).cuda() > 0.3
    for m in (None, mask):
        want = c.attention(q, attn_mask=m, fused_op=False).float()
        torch.testing.assert_close(c.attention(q, attn_mask=m).float(), want, rtol=2e-3, atol=2e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("out_dtype", [None, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("preset", ["innerq_base", "kivi2"])
def test_cuda_q_scale_and_out_dtype(preset, x_dtype, out_dtype):
    # the CUDA op (store tiles, general kernel, merge) with q in any float dtype, its scale and the output dtype,
    # against its own fp32 form rounded once: the scale is one fp32 multiply where the queries are staged, the
    # output one rounding where it is written (the merge's or the single split's), so the two agree to the output
    # dtype's half ulp; single split (40 tokens) and many (700: the store tiles run)
    g = torch.Generator().manual_seed(12)
    for n in (40, 700):
        c = make_layer_cache(PRESETS[preset], 1, 2, 128, capacity=64, device="cuda", dtype=torch.float16)
        c.prefill(
            torch.randn(1, 2, n, 128, generator=g).half().cuda(), torch.randn(1, 2, n, 128, generator=g).half().cuda()
        )
        kw = c.fused_attention_operands()
        q = (torch.randn(1, 8, 2, 128, generator=g) * 4).to(x_dtype).cuda()
        want = ops.decode_attention_fused(q.float() * 128**-0.5, **kw)
        got = ops.decode_attention_fused(q, **kw, q_scale=128**-0.5, out_dtype=out_dtype)
        assert got.dtype == (out_dtype or torch.float32)
        ulp = {torch.float16: 2**-11, torch.bfloat16: 2**-8}.get(out_dtype, 0.0)
        tol = (1e-5 + ulp) * want.abs() + 1e-6
        assert ((got.float() - want).abs() <= tol).all(), (n, (got.float() - want).abs().max().item())


def test_which_kernel_takes_a_call(monkeypatch):
    # the compiled CUDA kernel is built for head_dim 64 / 128; Triton and the reference take any (lengths= too)
    cuda = torch.device("cuda")
    for impl in ("cuda", "triton", "reference"):
        monkeypatch.setitem(ops.CUDA_IMPL, "decode_attention_fused", impl)
        assert ops.fused_attention_takes(cuda, 128)
        assert ops.fused_attention_takes(cuda, 96) is (impl != "cuda")
    assert ops.fused_attention_takes(torch.device("cpu"), 96)


def test_auto_fuses_innerq_layouts_only():
    # "auto" on CUDA: InnerQ's layouts fuse (tensor-core store tiles), KIVI's compose (composed beat the fused general
    # kernel on an H200; KIVI's tiles are not measured yet)
    for preset, want in (("innerq_base", True), ("innerq_small", True), ("kivi2", False), ("kivi4", False)):
        c = _filled(preset, N=60, prefill=60)
        assert attention.auto_fuses_layouts(c.fused_attention_operands()) is want, preset
