"""Op registry: opcheck for every op, the reference GEMVs against a naive definition, validation errors."""

import pytest
import torch

import kvkernels
from kvkernels import reference


def _inner_q_case(B=2, H_q=4, H_kv=2, T=None, M=37, L=96, G=32, bits=3, mode="hybrid", dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(B, H_kv, M, L, generator=g)
    codes, scales, zeros = reference.quantize_groups(w, bits, G, mode)
    shape = (B, H_q, L) if T is None else (B, H_q, T, L)
    x = torch.randn(shape, generator=g).to(dtype)
    return x, codes, scales, zeros


def _kivi_case(B=2, H_q=4, H_kv=2, T=None, R=40, C=64, G=32, bits=2, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(B, H_kv, R, C, generator=g)
    codes, scales, zeros = reference.quantize_groups(w, bits, G, "asym")
    shape = (B, H_q, R) if T is None else (B, H_q, T, R)
    return torch.randn(shape, generator=g).to(dtype), codes, scales, zeros


def _naive_inner_q(x, codes, scales, zeros, bits, G, mode, x_scale=None):
    # the definition, one output element at a time, from packed words (independent of the reference's matmul)
    x4 = x if x.dim() == 4 else x.unsqueeze(2)
    B, H_q, T, L = x4.shape
    H_kv, M = codes.shape[1], codes.shape[2]
    u = reference.unpack_bits(codes, bits).float()
    y = torch.zeros(B, H_q, T, M)
    for b in range(B):
        for h in range(H_q):
            hk = h // (H_q // H_kv)
            for m in range(M):
                for g in range(L // G):
                    sb = scales[b, hk, m, g]
                    asym = mode == "asym" or (mode == "hybrid" and torch.signbit(sb))
                    s = sb.float().abs()
                    zeff = zeros[b, hk, m, g].float() if asym else -s * 2 ** (bits - 1)
                    xs = x4[b, h, :, g * G : (g + 1) * G].float()
                    if x_scale is not None:
                        xs = xs * x_scale[hk, g * G : (g + 1) * G]
                    y[b, h, :, m] += (xs * (s * u[b, hk, m, g * G : (g + 1) * G] + zeff)).sum(-1)
    return y if x.dim() == 4 else y.squeeze(2)


@pytest.mark.parametrize("mode", ["sym", "asym", "hybrid"])
@pytest.mark.parametrize("T", [None, 3], ids=["no-T", "T3"])
def test_reference_inner_q_matches_definition(mode, T):
    x, codes, scales, zeros = _inner_q_case(M=5, T=T, mode=mode, dtype=torch.float32)
    x_scale = torch.rand(2, 96) + 0.5
    zeros_arg = None if mode == "sym" else zeros
    got = reference.gemv_inner_q(x, codes, scales, zeros_arg, 3, 32, mode, x_scale)
    torch.testing.assert_close(got, _naive_inner_q(x, codes, scales, zeros, 3, 32, mode, x_scale), rtol=1e-5, atol=1e-4)


def _naive_kivi(x, codes, scales, zeros, bits, G):
    # the definition, one output column at a time, from packed words: y[b,h,t,c] = sum_r x[b,h,t,r] * deq[r, c]
    x4 = x if x.dim() == 4 else x.unsqueeze(2)
    B, H_q, T, R = x4.shape
    H_kv = codes.shape[1]
    u = reference.unpack_bits(codes, bits).float()  # [B, H_kv, R, C]
    C = u.shape[-1]
    y = torch.zeros(B, H_q, T, C)
    for b in range(B):
        for h in range(H_q):
            hk = h // (H_q // H_kv)
            for c in range(C):
                s = scales[b, hk, :, c // G].float()  # [R]: one (scale, zero) per row and column group
                z = zeros[b, hk, :, c // G].float()
                y[b, h, :, c] = (x4[b, h].float() * (s * u[b, hk, :, c] + z)).sum(-1)
    return y if x.dim() == 4 else y.squeeze(2)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("T, H_q", [(None, 4), (3, 8)], ids=["no-T-gqa2", "T3-gqa4"])
def test_reference_kivi_matches_definition(bits, T, H_q):
    x, codes, scales, zeros = _kivi_case(H_q=H_q, T=T, R=13, C=96, bits=bits, dtype=torch.float32, seed=bits)
    got = reference.gemv_kivi(x, codes, scales, zeros, bits, 32)
    torch.testing.assert_close(got, _naive_kivi(x, codes, scales, zeros, bits, 32), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_cpu_dispatch_runs_the_reference(bits):
    # the CPU GEMV kernels are the reference's ATen ops in C++ with the C++ dequantizer where the extension is built
    # (csrc/cpu/gemv_cpu.cpp, ops._cpu_impl): bit-identical to the reference, every bit width and mode, sym without
    # zeros, x_scale
    for mode, G, T, use_xs in (("hybrid", 32, None, False), ("sym", 32, 3, True), ("asym", 96, 1, True)):
        x, codes, scales, zeros = _inner_q_case(bits=bits, mode=mode, G=G, T=T, seed=bits)
        zeros = None if mode == "sym" else zeros
        xs = torch.rand(2, 96, generator=torch.Generator().manual_seed(7)) + 0.5 if use_xs else None
        want = reference.gemv_inner_q(x, codes, scales, zeros, bits, G, mode, xs)
        assert torch.equal(torch.ops.kvkernels.gemv_inner_q(x, codes, scales, zeros, bits, G, mode, xs), want)
    x, codes, scales, zeros = _kivi_case(bits=bits, T=2, seed=bits)
    want = reference.gemv_kivi(x, codes, scales, zeros, bits, 32)
    assert torch.equal(torch.ops.kvkernels.gemv_kivi(x, codes, scales, zeros, bits, 32), want)


@pytest.mark.skipif(not hasattr(torch.ops.kvkernels_cpu, "gemv_inner_q"), reason="no C++ CPU GEMV kernels")
def test_cpu_gemv_kernels_keep_direct_calls_memory_safe():
    # kvkernels_cpu::gemv_* sit behind the Python checks; called directly they still refuse mismatched operands
    x, codes, scales, zeros = _inner_q_case()
    with pytest.raises(RuntimeError, match="do not match x"):
        torch.ops.kvkernels_cpu.gemv_inner_q(x[..., :64], codes, scales, zeros, 3, 32, "hybrid")
    with pytest.raises(RuntimeError, match="H_q a multiple"):
        torch.ops.kvkernels_cpu.gemv_inner_q(x[:, :3], codes, scales, zeros, 3, 32, "hybrid")
    with pytest.raises(ValueError, match="scales must have shape"):  # the C++ dequantizer's own check
        torch.ops.kvkernels_cpu.gemv_inner_q(x, codes, scales[:, :, :5], zeros[:, :, :5], 3, 32, "hybrid")
    kx, kcodes, kscales, kzeros = _kivi_case()
    with pytest.raises(RuntimeError, match="do not match x"):
        torch.ops.kvkernels_cpu.gemv_kivi(kx[..., :32], kcodes, kscales, kzeros, 2, 32)


def _opcheck_cases():
    x, codes, scales, zeros = _inner_q_case(T=2)
    kx, kcodes, kscales, kzeros = _kivi_case()
    w = torch.randn(3, 64)
    c, s, z = reference.quantize_groups(w, 4, 32, "asym")
    return {
        "pack_bits": (torch.ops.kvkernels.pack_bits.default, (torch.randint(0, 8, (3, 64)), 3)),
        "unpack_bits": (
            torch.ops.kvkernels.unpack_bits.default,
            (reference.pack_bits(torch.randint(0, 8, (3, 64)), 3), 3),
        ),
        "quantize_groups": (torch.ops.kvkernels.quantize_groups.default, (w, 4, 32, "hybrid", 0.0)),
        "quantize_groups_into": (
            torch.ops.kvkernels.quantize_groups_into.default,
            (w, 4, 32, "asym", 0.25, torch.empty_like(c), torch.empty_like(s), torch.empty_like(z)),
        ),
        "dequantize_groups": (torch.ops.kvkernels.dequantize_groups.default, (c, s, z, 4, 32, "asym")),
        "gemv_inner_q": (torch.ops.kvkernels.gemv_inner_q.default, (x, codes, scales, zeros, 3, 32, "hybrid", None)),
        "gemv_inner_q_xscale": (
            torch.ops.kvkernels.gemv_inner_q.default,
            (x, codes, scales, None, 3, 32, "sym", torch.rand(2, 96)),
        ),
        "gemv_kivi": (torch.ops.kvkernels.gemv_kivi.default, (kx, kcodes, kscales, kzeros, 2, 32)),
        "gemv_inner_q_into": (
            torch.ops.kvkernels.gemv_inner_q_into.default,
            (x, codes, scales, zeros, 3, 32, "hybrid", None, torch.empty(2, 4, 2, 37), None),
        ),
        "gemv_kivi_into": (
            torch.ops.kvkernels.gemv_kivi_into.default,
            (kx, kcodes, kscales, kzeros, 2, 32, torch.empty(2, 4, 64), torch.empty(16)),
        ),
        **_lattice_opcheck_cases(),
        **_aqua_opcheck_cases(),
        **_attention_opcheck_cases(),
        **_static_append_opcheck_cases(),
    }


def _static_append_opcheck_cases():
    # one decode step into a static KIVI cache whose key tail is about to leave a group (tests/test_static_append.py)
    from kvkernels.formats import PRESETS, make_layer_cache
    from kvkernels.static_cache import StaticLayerCache

    g = torch.Generator().manual_seed(8)
    c = make_layer_cache(PRESETS["kivi2"], 1, 2, 64, capacity=64)
    c.prefill(torch.randn(1, 2, 160, 64, generator=g).half(), torch.randn(1, 2, 160, 64, generator=g).half())
    st = StaticLayerCache(c, max_tokens=200)
    ks, vs = st.keys.store, st.values.store
    k, v = torch.randn(1, 2, 1, 64, generator=g).half(), torch.randn(1, 2, 1, 64, generator=g).half()
    args = (
        k, v, st.lengths, c._sink_k, c._sink_v, ks.codes, ks.scales, ks.zeros, vs.codes, vs.scales, vs.zeros,
        st.keys.tail, st.values.tail, ks.bits, ks.mode, ks.layout, ks.eta, vs.bits, vs.mode, vs.layout, vs.eta,
        ks.group_size, st.w_recent, st.key_norm,
    )  # fmt: skip
    return {"static_append": (torch.ops.kvkernels.static_append.default, args)}


def _attention_opcheck_cases():
    # fused decode attention over a real InnerQ cache's views (tests/test_fused_attention.py has the sweep)
    from kvkernels.formats import PRESETS, make_layer_cache

    g = torch.Generator().manual_seed(7)
    c = make_layer_cache(PRESETS["innerq_hybrid"], 1, 2, 64, capacity=64)
    c.prefill(torch.randn(1, 2, 170, 64, generator=g).half(), torch.randn(1, 2, 170, 64, generator=g).half())
    kw = c.fused_attention_operands()
    names = [a.name for a in torch.ops.kvkernels.decode_attention_fused.default._schema.arguments]
    x = torch.randn(1, 4, 2, 64, generator=g).half()  # q itself, scaled in the op, the result in fp16
    mask = torch.randn(1, 1, 2, c.seq_len, generator=g)
    fixed = {"x": x, "attn_mask": mask, "split_tokens": 0, "lengths": None, "q_scale": 0.125, "out_dtype": x.dtype}
    args = tuple(fixed[n] if n in fixed else kw[n] for n in names)
    return {"decode_attention_fused": (torch.ops.kvkernels.decode_attention_fused.default, args)}


def _aqua_opcheck_cases():
    # AQUA-KV reconstruction, with the value predictor's second input (tests/test_aqua_ops.py has the sweep)
    from kvkernels.formats.lattice_grids import grid

    g = grid(2, 16)
    codes, norms = reference.lattice_quantize(torch.randn(5, 128), g, 64)
    prev, w, prev2, w2 = torch.randn(5, 96), torch.randn(128, 96), torch.randn(5, 128), torch.randn(128, 128)
    return {
        "aqua_reconstruct": (
            torch.ops.kvkernels.aqua_reconstruct.default,
            (prev, w, torch.randn(128), codes, norms, g, 64, None, prev2, w2),
        ),
    }


def _lattice_opcheck_cases():
    # the lattice ops (tests/test_lattice.py has more variants: signs, inverse, fp16 activations)
    from kvkernels.formats.lattice_grids import grid

    g = grid(2, 64)
    signs = (torch.randint(0, 2, (64,), generator=torch.Generator().manual_seed(0)) * 2 - 1).to(torch.int8)
    w = torch.randn(2, 2, 5, 128)
    codes, norms = reference.lattice_quantize(w, g, 64, signs)
    return {
        "fwht": (torch.ops.kvkernels.fwht.default, (w, 64, signs, True)),
        "lattice_quantize": (torch.ops.kvkernels.lattice_quantize.default, (w, g, 64, signs)),
        "lattice_dequantize": (torch.ops.kvkernels.lattice_dequantize.default, (codes, norms, g, 64, signs)),
        "gemv_lattice_k": (
            torch.ops.kvkernels.gemv_lattice_k.default,
            (torch.randn(2, 4, 3, 128), codes, norms, g, 64),
        ),
        "gemv_lattice_v": (
            torch.ops.kvkernels.gemv_lattice_v.default,
            (torch.rand(2, 4, 5), codes, norms, g, 64, None),
        ),
    }


@pytest.mark.parametrize("name", list(_opcheck_cases()))
def test_opcheck(name):
    op, args = _opcheck_cases()[name]
    torch.library.opcheck(op, args)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(_opcheck_cases()))
def test_opcheck_on_cuda_whatever_serves_it(name):
    # the same cases on CUDA tensors, through whichever implementation is registered for CUDA: the compiled
    # kernels, or in a build without them the Triton kernels (kvkernels.ops.CUDA_IMPL says which)
    op, args = _opcheck_cases()[name]
    torch.library.opcheck(op, tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args))


def test_every_schema_has_an_opcheck_case():
    # gemv_workspace_numel returns a plan-dependent int: no fake can answer it (test_gemv_workspace_numel)
    schemas = {n for n in kvkernels.ops.OPS} - {"gemv_workspace_numel"}
    covered = {name.removesuffix("_xscale") for name in _opcheck_cases()}
    assert schemas == covered


# ---- the GEMVs' out= / workspace= forms ---------------------------------------------------------------------------
def test_gemv_out_writes_a_slice_of_a_wider_buffer_and_nothing_else():
    x, codes, scales, zeros = _inner_q_case(T=2)
    want = reference.gemv_inner_q(x, codes, scales, zeros, 3, 32, "hybrid")
    buf = torch.full((2, 4, 2, 37 + 10), 7.0)
    out = buf[..., 3:40]
    got = kvkernels.gemv_inner_q(x, codes, scales, zeros, 3, 32, "hybrid", out=out)
    assert got is out and torch.equal(out, want)
    assert (buf[..., :3] == 7).all() and (buf[..., 40:] == 7).all()
    kx, kcodes, kscales, kzeros = _kivi_case()
    kout = torch.full((2, 4, 64), float("nan"))
    ws = torch.empty(kvkernels.gemv_workspace_numel("gemv_kivi", kx, kcodes, kscales, kzeros, 2, 32))
    kvkernels.gemv_kivi(kx, kcodes, kscales, kzeros, 2, 32, out=kout, workspace=ws)
    assert torch.equal(kout, reference.gemv_kivi(kx, kcodes, kscales, kzeros, 2, 32))
    # the registered op behind torch.ops, positionally
    kout.zero_()
    torch.ops.kvkernels.gemv_kivi_into(kx, kcodes, kscales, kzeros, 2, 32, kout)
    assert torch.equal(kout, reference.gemv_kivi(kx, kcodes, kscales, kzeros, 2, 32))


@pytest.mark.parametrize(
    "out, workspace, exc, match",
    [
        (lambda x: torch.empty(2, 4, 37, dtype=torch.float16), None, TypeError, "out must be float32"),
        (lambda x: torch.empty(2, 4, 36), None, ValueError, "out must have shape"),
        (lambda x: torch.empty(2, 4, 37 * 2)[..., ::2], None, ValueError, "out must have stride 1"),
        (lambda x: torch.empty(1, 1, 37).expand(2, 4, 37), None, ValueError, "out must not overlap itself"),
        (lambda x: torch.empty(2, 4, 37), torch.empty(0), None, None),  # no split on the CPU: any length
        (lambda x: torch.empty(2, 4, 37), torch.empty(8, dtype=torch.float16), TypeError, "workspace must be float32"),
        (lambda x: torch.empty(2, 4, 37), torch.empty(8, 2).t(), ValueError, "workspace must be contiguous"),
        (lambda x: None, torch.empty(8), ValueError, "workspace= is only taken with out="),
    ],
    ids=["dtype", "shape", "last-stride", "self-overlap", "fine", "ws-dtype", "ws-strided", "ws-without-out"],
)
def test_gemv_out_validation(out, workspace, exc, match):
    x, codes, scales, zeros = _inner_q_case()
    args = (x, codes, scales, zeros, 3, 32, "hybrid", None)
    o = out(x)
    if exc is None:
        kvkernels.gemv_inner_q(*args, out=o, workspace=workspace)
        return
    with pytest.raises(exc, match=match):
        kvkernels.gemv_inner_q(*args, out=o, workspace=workspace)
    if o is not None:  # the registered kernel behind torch.ops validates the same way
        with pytest.raises(exc, match=match):
            torch.ops.kvkernels.gemv_inner_q_into(*args, o, workspace)


def test_gemv_out_must_not_share_memory_with_an_input():
    x, codes, scales, zeros = _kivi_case(dtype=torch.float32, R=64)  # x [2, 4, 64] fp32 and out [2, 4, 64]
    with pytest.raises(ValueError, match="out must not share memory with x"):
        kvkernels.gemv_kivi(x, codes, scales, zeros, 2, 32, out=x)
    ws = torch.empty(2 * 4 * 64 + 8)
    with pytest.raises(ValueError, match="out must not share memory with workspace"):
        torch.ops.kvkernels.gemv_kivi_into(x, codes, scales, zeros, 2, 32, ws[8:].view(2, 4, 64), ws)


def test_gemv_workspace_numel():
    x, codes, scales, zeros = _inner_q_case()
    # the reference takes no workspace; the CUDA kernels' need is tested on a GPU (tests/test_cuda_kernels.py)
    assert kvkernels.gemv_workspace_numel("gemv_inner_q", x, codes, scales, zeros, 3, 32, "hybrid") == 0
    with pytest.raises(ValueError, match="op must be 'gemv_inner_q' or 'gemv_kivi'"):
        kvkernels.gemv_workspace_numel("gemv_lattice_k", x, codes, scales, zeros, 3, 32)
    with pytest.raises(ValueError, match="gemv_kivi is asym without x_scale"):
        kvkernels.gemv_workspace_numel("gemv_kivi", x, codes, scales, zeros, 3, 32, "sym")
    with pytest.raises(ValueError, match="gemv_workspace_numel: codes must hold"):
        torch.ops.kvkernels.gemv_workspace_numel("gemv_inner_q", x, codes[..., 1:], scales, zeros, 3, 32, "hybrid")
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake = FakeTensorMode()
    fx, fcodes, fscales, fzeros = (fake.from_tensor(t) for t in (x, codes, scales, zeros))
    with fake, pytest.raises(NotImplementedError, match="outside traced or compiled code"):
        torch.ops.kvkernels.gemv_workspace_numel("gemv_inner_q", fx, fcodes, fscales, fzeros, 3, 32, "hybrid")


def test_compiles_with_fakes():
    x, codes, scales, zeros = _inner_q_case()

    @torch.compile(fullgraph=True, backend="eager")
    def step(x):
        return torch.ops.kvkernels.gemv_inner_q(x * 2, codes, scales, zeros, 3, 32, "hybrid").softmax(-1)

    want = reference.gemv_inner_q(x * 2, codes, scales, zeros, 3, 32, "hybrid").softmax(-1)
    torch.testing.assert_close(step(x), want)


@pytest.mark.parametrize(
    "change, exc, match",
    [
        (dict(bits=5), ValueError, "bits must be one of"),
        (dict(mode="nf"), ValueError, "mode must be one of"),
        (dict(group_size=24), ValueError, "multiple of 32"),
        (dict(x=lambda a: a["x"].long()), TypeError, "x must be float16"),
        (dict(x=lambda a: a["x"][0]), ValueError, r"x must be \[B, H_q, L\]"),
        (dict(codes=lambda a: a["codes"].long()), TypeError, "codes must be int32"),
        (dict(codes=lambda a: a["codes"][..., :-1]), ValueError, "words per row"),
        (dict(scales=lambda a: a["scales"].float()), TypeError, "scales must be float16"),
        (dict(scales=lambda a: a["scales"][..., :1]), ValueError, "scales must have shape"),
        (dict(zeros=None), ValueError, "zeros is required"),
        (dict(x=lambda a: a["x"][:, :3]), ValueError, "multiple of KV heads"),
        (dict(x_scale=torch.ones(3, 96)), ValueError, "x_scale must have shape"),
        (dict(codes=lambda a: a["codes"].transpose(-1, -2).contiguous().transpose(-1, -2)), ValueError, "stride 1"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_gemv_inner_q_validation(change, exc, match):
    x, codes, scales, zeros = _inner_q_case()
    args = dict(x=x, codes=codes, scales=scales, zeros=zeros, bits=3, group_size=32, mode="hybrid", x_scale=None)
    for k, v in change.items():
        args[k] = v(args) if callable(v) else v
    with pytest.raises(exc, match=match):
        kvkernels.gemv_inner_q(**args)
    with pytest.raises(exc, match=match):  # the registered kernel behind torch.ops validates the same way
        torch.ops.kvkernels.gemv_inner_q(*args.values())


def test_gemv_kivi_validation():
    x, codes, scales, zeros = _kivi_case()
    with pytest.raises(ValueError, match="rows R=40 must equal"):
        kvkernels.gemv_kivi(x[..., :39], codes, scales, zeros, 2, 32)
    with pytest.raises(ValueError, match="scales must have shape"):
        kvkernels.gemv_kivi(x, codes, scales[..., :1], zeros, 2, 32)


def test_backends_report():
    b = kvkernels.backends()
    assert set(b) == {"reference", "cpp", "cuda", "triton"}
    assert b["reference"] == "available" and b["cpp"] == "available"
