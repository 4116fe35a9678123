"""Compiled CUDA kernels (csrc/cuda/) vs kvkernels.reference and the C++ CPU ops.

Skipped (with the reason) without a GPU or without a CUDA build of kvkernels._C. The reference is computed in
fp32 on the CPU. GEMV tolerance: |y - ref| <= rtol * mag + atol, where mag is the magnitude of the terms the kernel
adds (a relative-to-|ref| bound is meaningless where terms cancel): for KIVI sum_l |x * x_scale| * |deq(w)|, for
InnerQ sum_l |x * x_scale| (|s u'| + |zeff|), since it adds s * dot(x, u') and zeff * sum(x) (tests/kernel_bounds.py;
|deq| alone failed 1-bit hybrid keys on the first GPU run, where s u' + zeff = 0 left a bound of atol). The kernels read
x exactly and split it into fp16 hi + lo after a power-of-two prescale (~2^-22), decode codes exactly and accumulate
in fp32: InnerQ differs by ~1e-6 of mag (checked with 100x headroom); KIVI also rounds s * u + z to fp16 once, up to
2^-11 of mag (checked at 2^-10). docs/FORMATS.md, "GEMV arithmetic", states the contract.
Storage ops (quantize, dequantize, pack, unpack) must be bit-identical to the C++ CPU ops.
"""

import pytest
import torch
from kernel_bounds import inner_q_term_magnitude, lattice_gemv_bound

import kvkernels
from kvkernels import reference
from kvkernels._backends import HAS_CUDA_KERNELS

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not HAS_CUDA_KERNELS, reason="kvkernels._C was built without the CUDA kernels"),
]

DEV = "cuda"
BITS = (1, 2, 3, 4)
MODES = ("sym", "asym", "hybrid")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# (rtol on the magnitude sum, atol) per activation dtype; x is read exactly, so these are all summation-order
GEMV_TOL = {torch.float32: (1e-4, 1e-5), torch.float16: (1e-4, 1e-5), torch.bfloat16: (1e-4, 1e-5)}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _narrow_last(t: torch.Tensor, pad: int, offset: int = 0) -> torch.Tensor:
    """Same values as t, as a view [..., offset:offset+n] of a wider buffer (row strides != n)."""
    buf = torch.zeros((*t.shape[:-1], t.shape[-1] + pad), dtype=t.dtype, device=t.device)
    view = buf[..., offset : offset + t.shape[-1]]
    view.copy_(t)
    return view


def _quantized(B, H_kv, rows, L, bits, G, mode, seed):
    """Quantized random KV tensor [B, H_kv, rows, L] on the CPU (reference quantizer): codes, scales, zeros."""
    w = torch.randn((B, H_kv, rows, L), generator=_gen(seed))
    w[..., ::7] += 1.5  # skew some groups so hybrid mixes sym and asym
    return reference.quantize_groups(w, bits, G, mode)


def _to_cuda(*ts, narrow=False, misalign=False):
    """Moves tensors to CUDA. narrow: views of buffers 8 elements wider (row strides change, 16-byte alignment of
    int32 rows is kept); misalign: views starting one element into buffers 5 wider (rows lose alignment)."""
    out = []
    for t in ts:
        if t is None:
            out.append(None)
            continue
        t = t.to(DEV)
        if misalign:
            t = _narrow_last(t, pad=5, offset=1)
        elif narrow:
            t = _narrow_last(t, pad=8)
        out.append(t)
    return out


# gemv_kivi dequantizes to fp16 before the tensor cores (docs/FORMATS.md, "GEMV arithmetic"): each term is off by at
# most half an fp16 ulp of deq, 2^-11 of |x| |deq|; checked at twice that
KIVI_DEQ_RTOL = 2.0**-10


def _assert_gemv_close(y, ref, mag, dtype, rtol_min=0.0):
    rtol, atol = GEMV_TOL[dtype]
    rtol = max(rtol, rtol_min)
    assert y.shape == ref.shape and y.dtype == torch.float32
    err = (y.cpu() - ref).abs()
    bound = rtol * mag + atol
    worst = (err - bound).max().item()
    assert worst <= 0, f"max excess {worst:.3g}; max err {err.max().item():.3g}, max mag {mag.max().item():.3g}"


def _inner_q_case(
    B, H_q, H_kv, T, M, L, bits, G, mode, dtype, x_scale, narrow, misalign=False, seed=0, cache_rows=False
):
    codes, scales, zeros = _quantized(B, H_kv, M, L, bits, G, mode, seed)
    x_shape = (B, H_q, L) if T is None else (B, H_q, T, L)
    x = torch.randn(x_shape, generator=_gen(seed + 1)).to(dtype)
    xs = torch.rand((H_kv, L), generator=_gen(seed + 2)) + 0.5 if x_scale else None
    zeros_arg = None if mode == "sym" and seed % 2 else zeros  # sym accepts zeros=None
    ref = reference.gemv_inner_q(x, codes, scales, zeros_arg, bits, G, mode, xs)
    x4 = x if T is not None else x.unsqueeze(2)  # [B, H_q, T, L]
    mag = inner_q_term_magnitude(x4, codes, scales, zeros_arg, bits, G, mode, H_q, xs)
    mag = mag if T is not None else mag.squeeze(2)
    xc, cc, sc, zc, xsc = _to_cuda(x, codes, scales, zeros_arg, xs, narrow=narrow)
    if misalign:  # codes rows start one word in: forces the 32-bit load path
        (cc,) = _to_cuda(codes, misalign=True)
    if cache_rows:  # rows padded to 4 elements, as the caches allocate them (the ring's 16- / 8-byte aligned rows)
        cc, sc, zc = (None if t is None else _narrow_last(t, pad=-t.shape[-1] % 4) for t in (cc, sc, zc))
    y = torch.ops.kvkernels.gemv_inner_q(xc, cc, sc, zc, bits, G, mode, xsc)
    _assert_gemv_close(y, ref, mag, dtype)
    return y


# ---- gemv_inner_q ---------------------------------------------------------------------------------------------


def test_compiled_kernels_serve_cuda():
    assert kvkernels.ops.CUDA_IMPL["gemv_inner_q"] == "cuda"
    assert kvkernels.ops.CUDA_IMPL["gemv_kivi"] == "cuda"


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"b{b}")
def test_inner_q_bits_modes_dtypes(bits, mode, dtype):
    _inner_q_case(
        B=1,
        H_q=4,
        H_kv=2,
        T=None,
        M=37,
        L=256,
        bits=bits,
        G=32,
        mode=mode,
        dtype=dtype,
        x_scale=False,
        narrow=False,
        seed=bits,
    )


# keys: M = tokens (odd, 1, 1000+), L = head_dim; values: M = head_dim, L = tokens at group edges (G, 1024 + G,
# a multiple of 128 for the vector path, long enough for split-K)
INNER_Q_SHAPES = {
    "keys-D64-M1-gqa1": (1, 8, 8, 1, 64),
    "keys-D128-M37-gqa4": (1, 16, 4, 37, 128),
    "keys-D256-M1031-gqa8-B2": (2, 8, 1, 1031, 256),
    "keys-D128-M4097-gqa8": (1, 16, 2, 4097, 128),
    "values-D64-L32-gqa4": (1, 4, 1, 64, 32),
    "values-D128-L1056-gqa1-B2": (2, 4, 4, 128, 1056),
    "values-D256-L4096-gqa8": (1, 8, 1, 256, 4096),
    "values-D128-L20000-gqa4": (1, 8, 2, 128, 20000),
}


@pytest.mark.parametrize("T", [None, 1, 3, 16], ids=lambda t: "T-none" if t is None else f"T{t}")
@pytest.mark.parametrize("shape", INNER_Q_SHAPES.values(), ids=INNER_Q_SHAPES.keys())
@pytest.mark.parametrize("bits", (1, 2, 3, 4), ids=lambda b: f"b{b}")
def test_inner_q_shapes(shape, T, bits):
    B, H_q, H_kv, M, L = shape
    G = 32 if L % 64 else 64
    if L > 10000 and T == 16:
        pytest.skip("large split-K case covered at T <= 3")
    _inner_q_case(B, H_q, H_kv, T, M, L, bits, G, "hybrid", torch.float16, x_scale=False, narrow=False, seed=M + L)


@pytest.mark.parametrize("T", [None, 3], ids=lambda t: "T-none" if t is None else f"T{t}")
@pytest.mark.parametrize("misalign", [False, True], ids=["aligned", "misaligned-codes"])
@pytest.mark.parametrize("narrow", [False, True], ids=["contig", "narrowed"])
@pytest.mark.parametrize("x_scale", [False, True], ids=["no-xscale", "xscale"])
@pytest.mark.parametrize("bits", (1, 3, 4), ids=lambda b: f"b{b}")
def test_inner_q_views_and_xscale(bits, x_scale, narrow, misalign, T):
    for shape in ((1, 8, 2, 333, 128), (1, 8, 2, 128, 2048)):  # keys-like, values-like (split-K)
        B, H_q, H_kv, M, L = shape
        _inner_q_case(B, H_q, H_kv, T, M, L, bits, 64, "asym", torch.bfloat16, x_scale, narrow, misalign, seed=M)


def test_inner_q_gqa_sixteen_heads_and_long_T():
    # H_q / H_kv = 16 and T = 20 > 16: query tiles loop in-block and T chunks loop in the launcher
    _inner_q_case(1, 32, 2, 20, 100, 128, 2, 32, "sym", torch.float32, x_scale=True, narrow=True)


def test_inner_q_deterministic():
    codes, scales, zeros = _quantized(1, 2, 128, 8192, 2, 32, "asym", 0)
    x = torch.randn((1, 8, 8192), generator=_gen(1)).to(DEV)
    cc, sc, zc = _to_cuda(codes, scales, zeros)
    y1 = torch.ops.kvkernels.gemv_inner_q(x, cc, sc, zc, 2, 32, "asym")
    y2 = torch.ops.kvkernels.gemv_inner_q(x, cc, sc, zc, 2, 32, "asym")
    assert torch.equal(y1, y2)


def test_inner_q_errors():
    codes, scales, zeros = _to_cuda(*_quantized(1, 1, 8, 64, 2, 32, "asym", 0))
    x = torch.randn((1, 2, 64), device=DEV)
    with pytest.raises(TypeError, match="x must be"):
        torch.ops.kvkernels.gemv_inner_q(x.double(), codes, scales, zeros, 2, 32, "asym")
    with pytest.raises(ValueError, match="zeros is required"):
        torch.ops.kvkernels.gemv_inner_q(x, codes, scales, None, 2, 32, "asym")
    with pytest.raises(ValueError, match="codes must hold"):
        torch.ops.kvkernels.gemv_inner_q(x, codes, scales, zeros, 3, 32, "asym")
    with pytest.raises(ValueError, match="mode"):
        torch.ops.kvkernels.gemv_inner_q(x, codes, scales, zeros, 2, 32, "nope")


def test_inner_q_cuda_graph():
    B, H_q, H_kv, M, L = 1, 8, 2, 128, 4096  # values-like: split-K, so the workspace is allocated in the graph
    codes, scales, zeros = _quantized(B, H_kv, M, L, 2, 32, "hybrid", 3)
    cc, sc, zc = _to_cuda(codes, scales, zeros)
    x_static = torch.randn((B, H_q, L), device=DEV, dtype=torch.float16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            torch.ops.kvkernels.gemv_inner_q(x_static, cc, sc, zc, 2, 32, "hybrid")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = torch.ops.kvkernels.gemv_inner_q(x_static, cc, sc, zc, 2, 32, "hybrid")
    for seed in (10, 11):
        x_new = torch.randn((B, H_q, L), generator=_gen(seed)).to(torch.float16)
        x_static.copy_(x_new)
        graph.replay()
        torch.cuda.synchronize()
        ref = reference.gemv_inner_q(x_new, codes, scales, zeros, 2, 32, "hybrid")
        eager = torch.ops.kvkernels.gemv_inner_q(x_new.to(DEV), cc, sc, zc, 2, 32, "hybrid")
        assert torch.equal(y_static, eager)
        mag = inner_q_term_magnitude(x_new.unsqueeze(2), codes, scales, zeros, 2, 32, "hybrid", H_q)
        _assert_gemv_close(y_static, ref, mag.squeeze(2), torch.float16)


# ---- gemv_kivi ------------------------------------------------------------------------------------------------


def _kivi_case(B, H_q, H_kv, T, R, C, bits, G, dtype, narrow, misalign=False, seed=0, cache_rows=False):
    codes, scales, zeros = _quantized(B, H_kv, R, C, bits, G, "asym", seed)
    x_shape = (B, H_q, R) if T is None else (B, H_q, T, R)
    x = torch.randn(x_shape, generator=_gen(seed + 1)).to(dtype)
    ref = reference.gemv_kivi(x, codes, scales, zeros, bits, G)
    w = reference.dequantize_groups(codes, scales, zeros, bits, G, "asym")
    xa = x.float().abs() if T is not None else x.float().abs().unsqueeze(2)
    mag = xa @ w.abs().repeat_interleave(H_q // H_kv, 1)
    mag = mag if T is not None else mag.squeeze(2)
    xc, cc, sc, zc = _to_cuda(x, codes, scales, zeros, narrow=narrow)
    if misalign:
        (cc,) = _to_cuda(codes, misalign=True)
    if cache_rows:  # rows padded to 4 elements, as the caches allocate them: 16-byte code rows, 8-byte scale rows
        cc, sc, zc = (_narrow_last(t, pad=-t.shape[-1] % 4) for t in (cc, sc, zc))
    y = torch.ops.kvkernels.gemv_kivi(xc, cc, sc, zc, bits, G)
    _assert_gemv_close(y, ref, mag, dtype, rtol_min=KIVI_DEQ_RTOL)
    return y


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"b{b}")
def test_kivi_bits_dtypes(bits, dtype):
    _kivi_case(1, 4, 2, None, 37, 128, bits, 32, dtype, narrow=False, seed=bits)


# values: R = tokens (long, split-K), C = head_dim; keys: R = head_dim, C = tokens (long, column tiles)
KIVI_SHAPES = {
    "values-D64-R1-gqa1": (1, 8, 8, 1, 64),
    "values-D128-R1031-gqa4-B2": (2, 16, 4, 1031, 128),
    "values-D256-R20000-gqa8": (1, 8, 1, 20000, 256),
    "keys-D64-C32-gqa4": (1, 4, 1, 64, 32),
    "keys-D128-C4128-gqa8": (1, 16, 2, 128, 4128),
    "keys-D256-C1024-gqa1-B2": (2, 4, 4, 256, 1024),
}


@pytest.mark.parametrize("T", [None, 1, 3, 16], ids=lambda t: "T-none" if t is None else f"T{t}")
@pytest.mark.parametrize("shape", KIVI_SHAPES.values(), ids=KIVI_SHAPES.keys())
@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"b{b}")
def test_kivi_shapes(shape, T, bits):
    B, H_q, H_kv, R, C = shape
    G = 32 if C % 64 else 64
    if R > 10000 and T == 16:
        pytest.skip("large split-K case covered at T <= 3")
    _kivi_case(B, H_q, H_kv, T, R, C, bits, G, torch.float16, narrow=False, seed=R + C)


@pytest.mark.parametrize("misalign", [False, True], ids=["aligned", "misaligned-codes"])
@pytest.mark.parametrize("narrow", [False, True], ids=["contig", "narrowed"])
@pytest.mark.parametrize("T", [None, 3], ids=lambda t: "T-none" if t is None else f"T{t}")
@pytest.mark.parametrize("bits", (2, 3, 4), ids=lambda b: f"b{b}")
def test_kivi_views(bits, T, narrow, misalign):
    for B, H_q, H_kv, R, C in ((1, 8, 2, 2048, 128), (1, 8, 2, 128, 640)):
        _kivi_case(B, H_q, H_kv, T, R, C, bits, 32, torch.bfloat16, narrow, misalign, seed=R)


@pytest.mark.parametrize("ring", [True, False], ids=["ring", "KVKERNELS_GEMV_RING=0"])
@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"b{b}")
def test_kivi_ring_and_register_loads(bits, ring, monkeypatch):
    # the caches' layout (G = 32, rows padded to 4 elements) takes the cp.async ring unless switched off: keys of 992
    # tokens (a last column tile of 96, zero-filled past C), values of 1000 tokens at batch 2 (split R, a partial last
    # k-step), 12 query rows (two passes), values at head_dim 64 (the two-k-step items of 64-column stores; 693
    # tokens: an odd whole k-step left to the registers in some warps)
    if not ring:
        monkeypatch.setenv("KVKERNELS_GEMV_RING", "0")
    shapes = ((1, 8, 2, None, 128, 992), (2, 8, 2, 1, 1000, 128), (1, 12, 1, None, 600, 128), (2, 8, 2, 1, 693, 64))
    for B, H_q, H_kv, T, R, C in shapes:
        _kivi_case(B, H_q, H_kv, T, R, C, bits, 32, torch.float16, narrow=False, seed=R + C, cache_rows=True)


@pytest.mark.parametrize("ring", [True, False], ids=["ring", "KVKERNELS_GEMV_RING=0"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"b{b}")
def test_inner_q_ring_and_register_loads(bits, mode, ring, monkeypatch):
    # keys (L = 128: the ring's tile stream, a partial last tile; L = 64: the head_dim-64 item) and split values (a
    # len % 128 tail), rows padded as the caches pad them: unpadded, the values' 65-group rows (130-byte scale rows)
    # missed the ring's alignment and both runs took the register loads
    if not ring:
        monkeypatch.setenv("KVKERNELS_GEMV_RING", "0")
    for B, H_q, H_kv, M, L in ((1, 8, 2, 1000, 128), (1, 8, 1, 300, 64), (2, 4, 1, 128, 2080)):
        f16 = torch.float16
        _inner_q_case(B, H_q, H_kv, None, M, L, bits, 32, mode, f16, False, False, seed=M, cache_rows=True)


def test_gemv_out_and_workspace():
    # split-K shapes (the value GEMVs at batch 1), so both kernels need a workspace; out is a slice of a wider buffer
    B, H_q, H_kv, D, N = 1, 8, 2, 128, 4096
    ic, iscales, izeros = _to_cuda(*_quantized(B, H_kv, D, N, 2, 32, "asym", 5))  # InnerQ values: M = D, L = N
    kc, kscales, kzeros = _to_cuda(*_quantized(B, H_kv, N, D, 2, 32, "asym", 6))  # KIVI values: R = N, C = D
    x = torch.randn((B, H_q, N), device=DEV)
    calls = {
        "gemv_inner_q": lambda **kw: kvkernels.gemv_inner_q(x, ic, iscales, izeros, 2, 32, "asym", **kw),
        "gemv_kivi": lambda **kw: kvkernels.gemv_kivi(x, kc, kscales, kzeros, 2, 32, **kw),
    }
    operands = {"gemv_inner_q": (ic, iscales, izeros), "gemv_kivi": (kc, kscales, kzeros)}
    for name, call in calls.items():
        want = call()
        need = kvkernels.gemv_workspace_numel(name, x, *operands[name], 2, 32)
        assert need > 0, name
        buf = torch.full((B, H_q, D + 8), 7.0, device=DEV)
        out = buf[..., 4 : 4 + D]
        ws = torch.empty(need, device=DEV)
        assert call(out=out, workspace=ws) is out
        assert torch.equal(out, want), name  # the same plan: the same bits
        assert (buf[..., :4] == 7).all() and (buf[..., 4 + D :] == 7).all()
        with pytest.raises(ValueError, match=f"workspace holds {need - 1} floats, this call needs {need}"):
            call(out=out, workspace=ws[1:])
        # a CUDA graph over fixed buffers: nothing is allocated inside
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            call(out=out, workspace=ws)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call(out=out, workspace=ws)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, call()), name


def test_kivi_deterministic():
    codes, scales, zeros = _to_cuda(*_quantized(1, 2, 8192, 128, 2, 32, "asym", 0))
    x = torch.randn((1, 8, 8192), device=DEV)
    assert torch.equal(
        torch.ops.kvkernels.gemv_kivi(x, codes, scales, zeros, 2, 32),
        torch.ops.kvkernels.gemv_kivi(x, codes, scales, zeros, 2, 32),
    )


# ---- gemv_lattice_k / gemv_lattice_v ----------------------------------------------------------------------------
# The contract (csrc/cuda/gemv_lattice.cu): the tensor cores see the grid in fp16 (relative 2^-11 per value); keys apply
# the fp16 norm in fp32 after the MMA; values with G < D round r16 * grid once more to fp16 (G = D folds the norm into
# p in fp32). Both are checked at twice that (tests/kernel_bounds.py, lattice_gemv_bound): 2^-10 (keys) / 2^-9 (values)
# of the magnitude the sum is made of, in the rotated domain where the kernels sum.
LATTICE_GRIDS = {"eden2-16": (2, 16), "eden2-64": (2, 64), "eden2-256": (2, 256), "eden4-256": (4, 256)}


def _lattice_store(B, H_kv, N, D, G, d_n, signs, seed):
    """Random K or V rows [B, H_kv, N, D] quantized with the reference: codes, norms, grid (fp32 [n, d])."""
    from kvkernels.formats import lattice_grids

    grid = lattice_grids.grid(*d_n)
    x = torch.randn((B, H_kv, N, D), generator=_gen(seed)) * (1 + torch.rand((B, H_kv, N, 1), generator=_gen(seed + 1)))
    codes, norms = reference.lattice_quantize(x, grid, G, signs)
    return codes, norms, grid


def _lattice_case(values, B, H_q, H_kv, T, N, D, G, d_n, dtype, with_signs, narrow=False, seed=0, rerun=None):
    """The op against the reference within the contract's bound; returns its output. rerun(): called after the
    check, e.g. to switch an environment variable; the op then runs again on the same inputs and must give the same
    bits (the reference and its bound, minutes of CPU time at 70k tokens, are not recomputed)."""
    signs = (torch.randint(0, 2, (G,), generator=_gen(seed + 7), dtype=torch.int8) * 2 - 1) if with_signs else None
    codes, norms, grid = _lattice_store(B, H_kv, N, D, G, d_n, signs, seed)
    L = N if values else D
    x = torch.randn((B, H_q, L) if T is None else (B, H_q, T, L), generator=_gen(seed + 2)).to(dtype)
    if values:
        x = x.float().softmax(-1).to(dtype) if seed % 2 else x  # probabilities, or signed weights
    x4 = (x if T is not None else x.unsqueeze(2)).float()  # [B, H_q, T, L]
    fn = reference.gemv_lattice_v if values else reference.gemv_lattice_k
    ref = fn(x, codes, norms, grid, G, signs)
    bound = lattice_gemv_bound(values, x4, codes, norms, grid, G, signs, H_q)
    bound = bound if T is not None else bound.squeeze(2)
    xc, cc, rc, gc, sc = _to_cuda(x, codes, norms, grid, signs)
    if narrow:  # codes and norms as narrowed views of wider rows (row strides != their length)
        cc, rc = _to_cuda(codes, norms, narrow=True)
    op = torch.ops.kvkernels.gemv_lattice_v if values else torch.ops.kvkernels.gemv_lattice_k
    out = op(xc, cc, rc, gc, G, sc)
    assert out.shape == ref.shape and out.dtype == torch.float32
    excess = ((out.cpu() - ref).abs() - bound).max().item()
    assert excess <= 0, f"max excess {excess:.3g}; max err {(out.cpu() - ref).abs().max().item():.3g}"
    if rerun is not None:
        rerun()
        assert torch.equal(op(xc, cc, rc, gc, G, sc), out)
    return out


def test_compiled_lattice_kernels_serve_cuda():
    assert kvkernels.ops.CUDA_IMPL["gemv_lattice_k"] == "cuda"
    assert kvkernels.ops.CUDA_IMPL["gemv_lattice_v"] == "cuda"


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("grid", LATTICE_GRIDS.values(), ids=LATTICE_GRIDS.keys())
@pytest.mark.parametrize("values", [False, True], ids=["keys", "values"])
def test_lattice_grids_dtypes(values, grid, dtype):
    _lattice_case(values, 1, 8, 2, None, 301, 128, 64, grid, dtype, with_signs=grid[1] == 64, seed=grid[1])


# head_dim 64 / 128 / 256 with G from 32 to D (G = D: values fold the norm into p), GQA 1 to 8, odd token counts, long
# values rows (split-K with the finish kernel), 16 query rows (two passes of 8)
LATTICE_SHAPES = {
    "D64-G64-N77-gqa4-B2": (2, 8, 2, 77, 64, 64),
    "D64-G32-N1031-gqa1": (1, 4, 4, 1031, 64, 32),
    "D128-G64-N4097-gqa8": (1, 16, 2, 4097, 128, 64),
    "D128-G128-N333-gqa2": (1, 4, 2, 333, 128, 128),
    "D128-G32-N20000-gqa4": (1, 8, 2, 20000, 128, 32),
    "D256-G256-N130-gqa1-B2": (2, 2, 2, 130, 256, 256),
    "D256-G32-N1500-gqa8": (1, 8, 1, 1500, 256, 32),
}


@pytest.mark.parametrize("T", [None, 3, 16], ids=lambda t: "T-none" if t is None else f"T{t}")
@pytest.mark.parametrize("shape", LATTICE_SHAPES.values(), ids=LATTICE_SHAPES.keys())
@pytest.mark.parametrize("grid", LATTICE_GRIDS.values(), ids=LATTICE_GRIDS.keys())
@pytest.mark.parametrize("values", [False, True], ids=["keys", "values"])
def test_lattice_shapes(values, grid, shape, T):
    B, H_q, H_kv, N, D, G = shape
    if N > 10000 and T == 16:
        pytest.skip("large case covered at T <= 3")
    _lattice_case(values, B, H_q, H_kv, T, N, D, G, grid, torch.float16, with_signs=N % 2 == 1, seed=N + D)


@pytest.mark.parametrize("grid", [(2, 16), (2, 64)], ids=["EDEN2-16", "EDEN2-64"])
@pytest.mark.parametrize("D, G", [(64, 64), (64, 32), (128, 128), (128, 32)], ids=lambda v: str(v))
def test_lattice_keys_ring_matches_register_loads(D, G, grid, monkeypatch):
    # contiguous codes and norms (a cache's layout) take the keys' cp.async ring up to head_dim 128, with several items
    # per warp at 70k tokens on one KV head; KVKERNELS_GEMV_RING=0 the register loads: the same arithmetic in the same
    # order, so bit-identical scores. EDEN2-64 at D 64: 24-byte rows, 8-byte pieces; G = D: two tokens' norms a piece.
    args = (False, 1, 4, 1, None, 70_001, D, G, grid, torch.float16, True)
    _lattice_case(*args, seed=D + G, rerun=lambda: monkeypatch.setenv("KVKERNELS_GEMV_RING", "0"))


@pytest.mark.parametrize("narrow", [False, True], ids=["contig", "narrowed"])
@pytest.mark.parametrize("values", [False, True], ids=["keys", "values"])
def test_lattice_views_and_long_T(values, narrow):
    # T = 20 > 16: the launcher's T chunks; narrowed codes / norms rows; bf16
    _lattice_case(values, 1, 4, 2, 20, 200, 128, 64, (2, 64), torch.bfloat16, True, narrow=narrow, seed=5)


@pytest.mark.parametrize("values", [False, True], ids=["keys", "values"])
def test_lattice_deterministic(values):
    codes, norms, grid = (t.to(DEV) for t in _lattice_store(1, 2, 8192, 128, 64, (2, 16), None, 0))
    L = 8192 if values else 128
    x = torch.randn((1, 8, L), device=DEV)
    op = torch.ops.kvkernels.gemv_lattice_v if values else torch.ops.kvkernels.gemv_lattice_k
    assert torch.equal(op(x, codes, norms, grid, 64), op(x, codes, norms, grid, 64))


def test_lattice_empty_and_errors():
    codes, norms, grid = (t.to(DEV) for t in _lattice_store(1, 2, 0, 128, 64, (2, 16), None, 0))
    scores = torch.ops.kvkernels.gemv_lattice_k(torch.randn((1, 4, 128), device=DEV), codes, norms, grid, 64)
    assert scores.shape == (1, 4, 0)
    out = torch.ops.kvkernels.gemv_lattice_v(torch.randn((1, 4, 0), device=DEV), codes, norms, grid, 64)
    assert out.shape == (1, 4, 128) and not out.any()
    codes, norms, grid = (t.to(DEV) for t in _lattice_store(1, 1, 8, 128, 64, (2, 16), None, 0))
    q = torch.randn((1, 2, 128), device=DEV)
    with pytest.raises(ValueError, match="grid must be"):
        torch.ops.kvkernels.gemv_lattice_k(q, codes, norms, grid[:8], 64)
    with pytest.raises(ValueError, match="group_size"):
        torch.ops.kvkernels.gemv_lattice_k(q, codes, norms, grid, 48)
    with pytest.raises(TypeError, match="signs must be"):
        torch.ops.kvkernels.gemv_lattice_k(q, codes, norms, grid, 64, torch.ones(64, device=DEV))


# ---- aqua_reconstruct ----------------------------------------------------------------------------------------
# csrc/cuda/aqua_reconstruct.cu: fp16 / bf16 operands on tensor cores (products exact in fp32, fp32 accumulation),
# fp32 operands on a SIMT path (FFMA); the residual epilogue is the reference's fp32 arithmetic in its order. So the
# result differs from kvkernels.reference.aqua_reconstruct by accumulation order only: |out - ref| <= rtol * mag +
# atol with mag = |prev| @ |W|^T (+ |prev2| @ |W2|^T) + |bias| + |deq| (float64), rtol 2e-5 for fp32 and 1e-4 for
# fp16 / bf16 (the tensor cores' fp32 accumulation truncates; an operand rounded to fp16 anywhere would show at
# ~2^-11 of mag).
AQUA_RTOL = {torch.float32: 2e-5, torch.float16: 1e-4, torch.bfloat16: 1e-4}


def _aqua_args(T, C_in, C, G, d_n, dtype, C_in2=None, with_signs=False, seed=0):
    """Random operands of aqua_reconstruct on the CPU: the residual quantized with the reference."""
    from kvkernels.formats import lattice_grids

    g = _gen(seed)
    grid = lattice_grids.grid(*d_n)
    signs = (torch.randint(0, 2, (G,), generator=g, dtype=torch.int8) * 2 - 1) if with_signs else None
    codes, norms = reference.lattice_quantize(torch.randn(T, C, generator=g), grid, G, signs)
    a = dict(
        prev=torch.randn(T, C_in, generator=g).to(dtype),
        weight=(torch.randn(C, C_in, generator=g) / max(C_in, 1) ** 0.5).to(dtype),
        bias=torch.randn(C, generator=g), codes=codes, norms=norms, grid=grid, group_size=G, signs=signs,
        prev2=None, weight2=None,
    )  # fmt: skip
    if C_in2 is not None:
        a["prev2"] = torch.randn(T, C_in2, generator=g).to(dtype)
        a["weight2"] = (torch.randn(C, C_in2, generator=g) / max(C_in2, 1) ** 0.5).to(dtype)
    return a


def _aqua_run(a, views=None):
    """The CUDA op on a's tensors (views: None, "narrow" (rows of wider buffers) or "misalign" (and starting one
    element in: the binding copies those operands into aligned rows)) against the reference; returns the output."""
    want = reference.aqua_reconstruct(**a)
    x, w = a["prev"].double(), a["weight"].double()
    mag = x.abs() @ w.abs().T + a["bias"].double().abs()
    if a["prev2"] is not None:
        mag += a["prev2"].double().abs() @ a["weight2"].double().abs().T
    deq = reference.lattice_dequantize(a["codes"], a["norms"], a["grid"], a["group_size"], a["signs"])
    mag += deq.double().abs()
    dev = {}
    for k, v in a.items():
        if isinstance(v, torch.Tensor) and v.dim() == 2 and k != "grid" and views is not None:
            (v,) = _to_cuda(v, narrow=views == "narrow", misalign=views == "misalign")
        dev[k] = v.to(DEV) if isinstance(v, torch.Tensor) else v
    out = torch.ops.kvkernels.aqua_reconstruct(*dev.values())
    assert out.shape == want.shape and out.dtype == torch.float32 and out.device.type == "cuda"
    rtol = AQUA_RTOL[a["prev"].dtype]
    excess = ((out.cpu().double() - want.double()).abs() - (rtol * mag + 1e-5)).max().item() if out.numel() else 0
    assert excess <= 0, f"max excess {excess:.3g}; max err {(out.cpu() - want).abs().max().item():.3g}"
    return out


def test_compiled_aqua_kernel_serves_cuda():
    assert kvkernels.ops.CUDA_IMPL["aqua_reconstruct"] == "cuda"


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("grid", LATTICE_GRIDS.values(), ids=LATTICE_GRIDS.keys())
@pytest.mark.parametrize("two", [False, True], ids=["keys", "values"])
def test_aqua_grids_dtypes(two, grid, dtype):
    a = _aqua_args(37, 192, 192, 64, grid, dtype, C_in2=192 if two else None, with_signs=grid[1] != 64, seed=grid[1])
    _aqua_run(a)


# id: (T, C_in, C, G, grid, C_in2). SmolLM2 (C 192 = 3 x 64) and Llama-8B (C 1024 = 8 x 128) chunks of 128 tokens
# (32-token tiles) and longer blocks (64-token tiles), recompute-length T, reduced-rank predictors (C_in 16 .. 128),
# G 32 / 64 / 128, tails everywhere (T, C_in not a multiple of 32 or 8, C not a multiple of 128)
AQUA_SHAPES = {
    "smollm2-keys-T128": (128, 192, 192, 64, (2, 16), None),
    "smollm2-values-T256": (256, 192, 192, 64, (2, 16), 192),
    "smollm2-recompute-T32768": (32768, 192, 192, 64, (4, 256), None),
    "llama-keys-T128-G128": (128, 1024, 1024, 128, (2, 256), None),
    "llama-values-T4096-G64": (4096, 1024, 1024, 64, (2, 64), 1024),
    "rank16-T333": (333, 16, 1024, 64, (4, 256), None),
    "rank48-values-T37-G128": (37, 48, 256, 128, (2, 16), 48),
    "rank128-T1-G32": (1, 128, 128, 32, (2, 64), None),
    "C96-G32-Cin40-T5": (5, 40, 96, 32, (2, 64), None),
    "Cin20-T65": (65, 20, 128, 64, (2, 256), None),
    "Cin1-C64-T64": (64, 1, 64, 64, (2, 16), None),
    "Cin2-72-T17": (17, 64, 256, 128, (4, 256), 72),
}


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", AQUA_SHAPES.values(), ids=AQUA_SHAPES.keys())
def test_aqua_shapes(shape, dtype):
    T, C_in, C, G, grid, C_in2 = shape
    _aqua_run(_aqua_args(T, C_in, C, G, grid, dtype, C_in2, with_signs=T % 2 == 1, seed=T + C_in))


@pytest.mark.parametrize("views", ["narrow", "misalign"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
def test_aqua_views(dtype, views):
    # every 2-D operand a view of wider rows; "misalign": also starting one element in (a copy for fp16 / bf16)
    _aqua_run(_aqua_args(70, 72, 192, 64, (2, 64), dtype, C_in2=40, with_signs=True, seed=9), views=views)


def test_aqua_empty_and_no_input_channels():
    assert _aqua_run(_aqua_args(0, 64, 128, 64, (2, 16), torch.float16)).shape == (0, 128)
    a = _aqua_args(9, 0, 256, 64, (2, 16), torch.bfloat16, with_signs=True)
    # bias + residual only: the epilogue is the reference's fp32 arithmetic in its order, so this is bit-exact
    assert torch.equal(_aqua_run(a).cpu(), reference.aqua_reconstruct(**a))
    _aqua_run(_aqua_args(9, 32, 128, 32, (2, 16), torch.float16, C_in2=0))  # an empty second input adds nothing


def test_aqua_deterministic_and_nan_rows():
    a = _aqua_args(300, 192, 192, 64, (2, 16), torch.float16, C_in2=192, seed=4)
    a["prev"][7, 3] = float("nan")
    a["norms"][11, 1] = float("inf")
    dev = [v.to(DEV) if isinstance(v, torch.Tensor) else v for v in a.values()]
    out = torch.ops.kvkernels.aqua_reconstruct(*dev)
    again = torch.ops.kvkernels.aqua_reconstruct(*dev)
    torch.testing.assert_close(again, out, rtol=0, atol=0, equal_nan=True)  # no atomics, a fixed order
    assert out[7].isnan().all()  # a NaN in prev poisons its row only
    assert not out[11, 64:128].isfinite().any() and out[11, :64].isfinite().all() and out[11, 128:].isfinite().all()
    rows = torch.ones(300, dtype=torch.bool)
    rows[[7, 11]] = False
    assert out[rows].isfinite().all()


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_aqua_rows_do_not_depend_on_T(dtype):
    # a row's result is the same bits whatever T (and so the tile height the launcher picks: 64 tokens at T 2200 x
    # C 1024, 32 at T 128): every output accumulates over the input channels in one fixed order. The AQUA cache's
    # commit and its later chunk-by-chunk reconstruction rely on it.
    a = _aqua_args(2200, 256, 1024, 128, (2, 16), dtype, C_in2=64, with_signs=True, seed=6)
    dev = {k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
    full = torch.ops.kvkernels.aqua_reconstruct(*dev.values())
    part = {k: (v[1000:1128] if isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape[0] == 2200 else v)
            for k, v in dev.items()}  # fmt: skip
    assert torch.equal(torch.ops.kvkernels.aqua_reconstruct(*part.values()), full[1000:1128])


def test_aqua_errors():
    a = _aqua_args(5, 64, 256, 256, (2, 16), torch.float16)
    dev = {k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
    with pytest.raises(ValueError, match=r"group_size in \(32, 64, 128\)"):
        torch.ops.kvkernels.aqua_reconstruct(*dev.values())
    dev["group_size"] = 64
    dev["norms"] = torch.zeros((5, 4), dtype=torch.float16, device=DEV)
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        torch.ops.kvkernels.aqua_reconstruct(*{**dev, "bias": a["bias"]}.values())
    with pytest.raises(TypeError, match="weight must be float16"):
        torch.ops.kvkernels.aqua_reconstruct(*{**dev, "weight": dev["weight"].float()}.values())
    with pytest.raises(ValueError, match="both or neither"):
        torch.ops.kvkernels.aqua_reconstruct(*{**dev, "prev2": dev["prev"]}.values())


# ---- storage ops: bit-exact vs the C++ CPU ops ---------------------------------------------------------------


@pytest.mark.parametrize("G", (32, 64, 128), ids=lambda g: f"G{g}")
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize(
    "mode_eta",
    [("sym", 0.0), ("asym", 0.0), ("asym", 0.25), ("hybrid", 0.0)],
    ids=["sym", "asym", "asym-eta0.25", "hybrid"],
)
@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"b{b}")
def test_quantize_into_matches_cpu_bit_exact(bits, mode_eta, dtype, G):
    mode, eta = mode_eta
    B, H, T_max, t0, T, L = 2, 3, 40, 5, 17, 4 * G
    x = (torch.randn((B, H, T, L), generator=_gen(bits)) * 3).to(dtype)
    x[..., : G // 2] += 2.0  # some positive-skewed groups
    c_cpu, s_cpu, z_cpu = torch.ops.kvkernels.quantize_groups(x, bits, G, mode, eta)
    # write into narrowed views of a preallocated cache; everything outside the view must stay untouched
    codes_buf = torch.full((B, H, T_max, L // 32 * bits + 3), -7, dtype=torch.int32, device=DEV)
    scales_buf = torch.full((B, H, T_max, L // G + 1), 9.0, dtype=torch.float16, device=DEV)
    zeros_buf = torch.full((B, H, T_max, L // G + 2), 9.0, dtype=torch.float16, device=DEV)
    codes_v = codes_buf[:, :, t0 : t0 + T, : L // 32 * bits]
    scales_v = scales_buf[:, :, t0 : t0 + T, : L // G]
    zeros_v = zeros_buf[:, :, t0 : t0 + T, 1 : 1 + L // G]
    # expected buffers: the old contents with exactly the viewed elements replaced by the CPU op's results
    expected = []
    for buf, view, want in zip(
        (codes_buf, scales_buf, zeros_buf), (codes_v, scales_v, zeros_v), (c_cpu, s_cpu, z_cpu), strict=True
    ):
        exp = buf.cpu().clone()
        exp.as_strided(view.shape, view.stride(), view.storage_offset()).copy_(want)
        expected.append(exp)
    torch.ops.kvkernels.quantize_groups_into(x.to(DEV), bits, G, mode, eta, codes_v, scales_v, zeros_v)
    assert torch.equal(codes_buf.cpu(), expected[0])
    assert torch.equal(scales_buf.cpu().view(torch.int16), expected[1].view(torch.int16))
    assert torch.equal(zeros_buf.cpu().view(torch.int16), expected[2].view(torch.int16))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"b{b}")
def test_quantize_groups_out_of_place_matches_cpu(bits, mode):
    x = torch.randn((3, 5, 7, 256), generator=_gen(bits))[:, ::2]  # non-contiguous leading dims
    cpu = torch.ops.kvkernels.quantize_groups(x, bits, 64, mode, 0.0)
    gpu = torch.ops.kvkernels.quantize_groups(x.to(DEV), bits, 64, mode, 0.0)
    for a, b in zip(cpu, gpu, strict=True):
        assert torch.equal(
            a.view(torch.int16) if a.dtype == torch.float16 else a,
            b.cpu().view(torch.int16) if b.dtype == torch.float16 else b.cpu(),
        )


@pytest.mark.parametrize("narrow", [False, True], ids=["contig", "narrowed"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"b{b}")
def test_dequantize_matches_cpu_bit_exact(bits, mode, narrow):
    codes, scales, zeros = _quantized(2, 3, 33, 256, bits, 64, mode, bits)
    want = torch.ops.kvkernels.dequantize_groups(codes, scales, zeros, bits, 64, mode)
    cc, sc, zc = _to_cuda(codes, scales, zeros, narrow=narrow)
    got = torch.ops.kvkernels.dequantize_groups(cc, sc, zc, bits, 64, mode)
    assert torch.equal(got.cpu(), want)
    assert torch.equal(want, reference.dequantize_groups(codes, scales, zeros, bits, 64, mode))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8], ids=["i64", "i32", "u8"])
@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"b{b}")
def test_pack_unpack_match_cpu(bits, dtype):
    codes = torch.randint(0, 2**bits, (3, 7, 96), generator=_gen(bits)).to(dtype)
    packed_cpu = torch.ops.kvkernels.pack_bits(codes, bits)
    packed_gpu = torch.ops.kvkernels.pack_bits(codes.to(DEV), bits)
    assert torch.equal(packed_gpu.cpu(), packed_cpu)
    assert torch.equal(torch.ops.kvkernels.unpack_bits(packed_gpu, bits).cpu(), codes.to(torch.uint8))
    assert torch.equal(
        torch.ops.kvkernels.unpack_bits(packed_gpu, bits).cpu(), torch.ops.kvkernels.unpack_bits(packed_cpu, bits)
    )


# ---- opcheck ----------------------------------------------------------------------------------------------------


def _opcheck_cases():
    codes, scales, zeros = _to_cuda(*_quantized(1, 2, 16, 128, 2, 32, "hybrid", 0))
    x = torch.randn((1, 4, 128), device=DEV, dtype=torch.float16)
    x_scale = torch.rand((2, 128), device=DEV) + 0.5
    xk = torch.randn((1, 4, 3, 16), device=DEV)
    kc, ks, kz = _to_cuda(*_quantized(1, 2, 16, 128, 2, 32, "asym", 1))
    xq = torch.randn((2, 3, 128), device=DEV)
    qc = torch.empty((2, 3, 8), dtype=torch.int32, device=DEV)
    qs = torch.empty((2, 3, 4), dtype=torch.float16, device=DEV)
    qz = torch.empty((2, 3, 4), dtype=torch.float16, device=DEV)
    ls = torch.ones(64, dtype=torch.int8)
    ls[::3] = -1
    lc, ln, lg = (t.to(DEV) for t in _lattice_store(1, 2, 40, 128, 64, (2, 64), ls, 0))
    ls = ls.to(DEV)
    xk4 = torch.randn((1, 4, 3, 128), device=DEV)
    lp = torch.randn((1, 4, 40), device=DEV, dtype=torch.float16)
    aq = {k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in _aqua_args(
        20, 48, 192, 64, (2, 64), torch.bfloat16, C_in2=32, with_signs=True, seed=2).items()}  # fmt: skip
    return {
        "gemv_inner_q": (torch.ops.kvkernels.gemv_inner_q.default, (x, codes, scales, zeros, 2, 32, "hybrid", x_scale)),
        "gemv_kivi": (torch.ops.kvkernels.gemv_kivi.default, (xk, kc, ks, kz, 2, 32)),
        "quantize_groups": (torch.ops.kvkernels.quantize_groups.default, (xq, 2, 32, "asym", 0.0)),
        "quantize_groups_into": (
            torch.ops.kvkernels.quantize_groups_into.default,
            (xq, 2, 32, "hybrid", 0.0, qc, qs, qz),
        ),
        "dequantize_groups": (torch.ops.kvkernels.dequantize_groups.default, (codes, scales, zeros, 2, 32, "hybrid")),
        "pack_bits": (
            torch.ops.kvkernels.pack_bits.default,
            (torch.randint(0, 4, (3, 64), device=DEV, dtype=torch.int32), 2),
        ),
        "unpack_bits": (torch.ops.kvkernels.unpack_bits.default, (codes, 2)),
        "gemv_lattice_k": (torch.ops.kvkernels.gemv_lattice_k.default, (xk4, lc, ln, lg, 64, ls)),
        "gemv_lattice_v": (torch.ops.kvkernels.gemv_lattice_v.default, (lp, lc, ln, lg, 64, None)),
        "aqua_reconstruct": (torch.ops.kvkernels.aqua_reconstruct.default, tuple(aq.values())),
    }


@pytest.mark.parametrize(
    "name",
    [
        "gemv_inner_q",
        "gemv_kivi",
        "quantize_groups",
        "quantize_groups_into",
        "dequantize_groups",
        "pack_bits",
        "unpack_bits",
        "gemv_lattice_k",
        "gemv_lattice_v",
        "aqua_reconstruct",
    ],
)
def test_opcheck_cuda(name):
    op, args = _opcheck_cases()[name]
    torch.library.opcheck(op, args)


# ---- decode_attention_fused -------------------------------------------------------------------------------------
# softmax(x K^T + mask) V over sink | quantized store | tail vs kvkernels.reference.decode_attention_fused (fp32 on
# the CPU). The kernel is fp32 throughout (scores, softmax, P V; expf of --use_fast_math), so it differs from the
# reference by summation order only: checked at 1e-4 of max |V| (+ 1e-5), with scores of order one.


def _attn_store(kv, bits, mode, layout, G, pad, seed):
    """Quantizes kv [B, H, m, D] into a store of the given layout, as views of buffers `pad` wider."""
    src = kv if layout == "rows" else kv.transpose(-1, -2).contiguous()  # cols: groups of G tokens
    codes, scales, zeros = reference.quantize_groups(src, bits, G, mode)
    zeros = None if mode == "sym" and seed % 2 else zeros
    return [None if t is None else _narrow_last(t, pad) for t in (codes, scales, zeros)]


def _attn_operands(B, H_kv, D, S, mk, mv, n_kt, key, value, G, dtype, x_scale, seed):
    """Random operands (CPU) of decode_attention_fused; key / value = (bits, mode, layout)."""
    g = _gen(seed)
    N = S + mk + n_kt
    k_all = torch.randn((B, H_kv, N, D), generator=g)
    v_all = torch.randn((B, H_kv, N, D), generator=g)
    xs = torch.rand((H_kv, D), generator=g) + 0.5 if x_scale else None
    k_store = k_all[:, :, S : S + mk] / (xs[None, :, None, :] if xs is not None else 1.0)
    kc, ks, kz = _attn_store(k_store, *key, G, pad=8, seed=seed)
    vc, vs, vz = _attn_store(v_all[:, :, S : S + mv], *value, G, pad=4, seed=seed + 1)
    win = lambda t: _narrow_last(t.to(dtype), pad=3)  # noqa: E731 (strided window views)
    return {
        "sink_keys": win(k_all[:, :, :S]), "sink_values": win(v_all[:, :, :S]),
        "key_codes": kc, "key_scales": ks, "key_zeros": kz, "value_codes": vc, "value_scales": vs, "value_zeros": vz,
        "key_tail": win(k_all[:, :, S + mk :]), "value_tail": win(v_all[:, :, S + mv :]),
        "key_bits": key[0], "key_mode": key[1], "key_layout": key[2],
        "value_bits": value[0], "value_mode": value[1], "value_layout": value[2],
        "group_size": G, "key_x_scale": xs,
    }  # fmt: skip


def _attn_check(x, kw, attn_mask=None, split_tokens=0):
    """Runs the CUDA op on copies of the CPU operands and compares with the reference; returns the CUDA output."""
    ref = reference.decode_attention_fused(x, **kw, attn_mask=attn_mask, split_tokens=split_tokens)
    dev = {k: v.to(DEV) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    m = attn_mask.to(DEV) if attn_mask is not None else None
    y = torch.ops.kvkernels.decode_attention_fused(x.to(DEV), **dev, attn_mask=m, split_tokens=split_tokens)
    assert y.shape == ref.shape and y.dtype == torch.float32
    vmax = max(
        reference.attention.store_tokens(kw["value_codes"], kw["value_scales"], kw["value_zeros"], kw["value_bits"],
                                          kw["group_size"], kw["value_mode"], kw["value_layout"]).abs().max().item()
        if kw["value_codes"].numel() else 0.0,
        kw["sink_values"].float().abs().max().item() if kw["sink_values"].numel() else 0.0,
        kw["value_tail"].float().abs().max().item() if kw["value_tail"].numel() else 0.0,
    )  # fmt: skip
    err = (y.cpu() - ref).abs()
    assert torch.isfinite(ref).all() == torch.isfinite(y.cpu()).all()
    bound = 1e-4 * vmax + 1e-5
    assert err.max().item() <= bound, f"max err {err.max().item():.3g} > {bound:.3g}"
    return y


INNERQ_PAIRS = [
    ((kb, km, "rows"), (vb, vm, "cols"))
    for kb, km, vb, vm in [
        (1, "sym", 4, "asym"),
        (2, "hybrid", 3, "sym"),
        (3, "asym", 2, "hybrid"),
        (4, "sym", 1, "sym"),
    ]
]
KIVI_PAIRS = [((b, "asym", "cols"), (5 - b, "asym", "rows")) for b in BITS]
OTHER_PAIRS = [((3, "hybrid", "rows"), (2, "asym", "rows")), ((2, "sym", "cols"), (4, "hybrid", "cols"))]


@pytest.mark.parametrize("key,value", INNERQ_PAIRS + KIVI_PAIRS + OTHER_PAIRS)
@pytest.mark.parametrize("split_tokens", [0, 64])
def test_decode_attention_fused_layouts_bits(key, value, split_tokens):
    B, H_kv, gq, T, D, G = 2, 2, 3, 1, 128, 32
    kw = _attn_operands(B, H_kv, D, S=1, mk=128, mv=96, n_kt=5, key=key, value=value, G=G, dtype=torch.float16,
                        x_scale=key[2] == "rows", seed=sum(key[:1]) * 7 + value[0])  # fmt: skip
    x = torch.randn((B, H_kv * gq, T, D), generator=_gen(3)) * D**-0.5
    _attn_check(x, kw, split_tokens=split_tokens)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("D,G", [(64, 32), (128, 64)])
@pytest.mark.parametrize("S,mk,mv,n_kt", [(0, 64, 64, 0), (5, 256, 192, 7), (1, 32, 320, 300)])
@pytest.mark.parametrize("T,gq", [(1, 1), (3, 3), (5, 4)])
def test_decode_attention_fused_shapes(dtype, D, G, S, mk, mv, n_kt, T, gq):
    kw = _attn_operands(2, 2, D, S, mk, mv, n_kt, (3, "hybrid", "rows"), (2, "asym", "cols"), G, dtype, True, seed=5)
    x = torch.randn((2, 2 * gq, T, D), generator=_gen(4)) * D**-0.5
    for split_tokens in (0, G, 3 * G):
        _attn_check(x, kw, split_tokens=split_tokens)


def test_decode_attention_fused_masks():
    B, H_kv, gq, T, D = 2, 2, 2, 3, 64
    kw = _attn_operands(
        B, H_kv, D, 1, 96, 64, 9, (2, "asym", "cols"), (2, "asym", "rows"), 32, torch.bfloat16, False, 9
    )
    N = 1 + 96 + 9
    x = torch.randn((B, H_kv * gq, T, D), generator=_gen(5)) * D**-0.5
    g = _gen(6)
    for shape in [(B, H_kv * gq, T, N), (1, H_kv * gq, T, N), (B, 1, T, N), (1, 1, T, N)]:
        mask = torch.where(torch.rand(shape, generator=g) < 0.3, float("-inf"), -torch.rand(shape, generator=g))
        mask[..., 0] = 0.0  # one finite score per row
        mask[..., 0, :] = torch.finfo(torch.float32).min  # a fully masked (bool -> finfo.min) row: uniform average
        for split_tokens in (0, 32):
            _attn_check(x, kw, attn_mask=_narrow_last(mask, 5), split_tokens=split_tokens)


@pytest.mark.parametrize("preset", ["innerq_base", "kivi2"])
@pytest.mark.parametrize("prompt,steps", [(40, 0), (100, 3), (600, 2)])
def test_decode_attention_fused_real_caches(preset, prompt, steps):
    from kvkernels.formats import PRESETS, make_layer_cache

    B, H_kv, gq, D = 2, 2, 4, 128
    g = torch.Generator(device=DEV).manual_seed(prompt + steps)
    c = make_layer_cache(PRESETS[preset], B, H_kv, D, capacity=64, device=DEV)
    k = torch.randn((B, H_kv, prompt, D), generator=g, device=DEV)
    v = torch.randn((B, H_kv, prompt, D), generator=g, device=DEV)
    c.prefill(k.half(), v.half())
    for _ in range(steps):
        c.append(torch.randn((B, H_kv, 1, D), device=DEV).half(), torch.randn((B, H_kv, 1, D), device=DEV).half())
    kw = c.fused_attention_operands()
    assert kw is not None
    x = torch.randn((B, H_kv * gq, 1, D), generator=g, device=DEV) * D**-0.5
    cpu = {k2: v2.cpu() if isinstance(v2, torch.Tensor) else v2 for k2, v2 in kw.items()}
    # kivi2 past 256 store tokens runs the KIVI tiles (fp16-rounded dequantization: _kivi_tiles_expected)
    if preset == "kivi2":
        ref = _kivi_tiles_expected(x.cpu(), cpu)[0]
    else:
        ref = reference.decode_attention_fused(x.cpu(), **cpu)
    y = torch.ops.kvkernels.decode_attention_fused(x, **kw, attn_mask=None)
    torch.testing.assert_close(y.cpu().to(ref.dtype), ref, rtol=1e-4, atol=1e-4)
    y2 = torch.ops.kvkernels.decode_attention_fused(x, **kw, attn_mask=None, split_tokens=kw["group_size"])
    torch.testing.assert_close(y2.cpu().to(ref.dtype), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("pair", ["innerq", "kivi"])
@pytest.mark.parametrize("split_tokens", [0, 32])
def test_decode_attention_fused_device_lengths(pair, split_tokens):
    # capacity buffers with NaN / random junk past the used tokens (tests/device_lengths.py), the counts on the
    # device: equal to the exact-size call; the launch is planned for the capacities (many splits start past N)
    from device_lengths import with_capacity

    key, value = INNERQ_PAIRS[1] if pair == "innerq" else KIVI_PAIRS[1]
    kw = _attn_operands(2, 2, 128, 1, 128, 96, 40, key, value, 32, torch.float16, pair == "innerq", seed=21)
    kw = {k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    N = 1 + 128 + 40
    x = torch.randn((2, 6, 3, 128), generator=_gen(8)) * 128**-0.5
    for mask in (None, torch.randn((2, 1, 3, N), generator=_gen(9))):
        exact = {**kw, "attn_mask": mask}
        ref = reference.decode_attention_fused(x, **exact, split_tokens=split_tokens)
        padded, lengths = with_capacity(exact, extra=(3, 64, 300, 128, 250))
        dev = {k: v.to(DEV) if isinstance(v, torch.Tensor) else v for k, v in padded.items()}
        op = torch.ops.kvkernels.decode_attention_fused
        y = op(x.to(DEV), **dev, split_tokens=split_tokens, lengths=lengths.to(DEV))
        torch.testing.assert_close(y.cpu(), ref, rtol=1e-4, atol=1e-4)


# The InnerQ presets' (bits, mode) pairs: over >= 256 store tokens the op runs csrc/cuda/decode_attention_store.cu's
# tensor-core kernel on [S, S + F) and the general kernel on the sink, the store edges and the tails (the emulator's
# attn cases check the same split on the CPU).
STORE_TILE_PAIRS = [
    ((kb, km, "rows"), (vb, vm, "cols"))
    for kb, km, vb, vm in [
        (3, "sym", 3, "sym"),
        (3, "sym", 2, "sym"),
        (3, "sym", 2, "hybrid"),
        (4, "asym", 4, "asym"),
        (1, "asym", 1, "asym"),
    ]
]


@pytest.mark.parametrize("key,value", STORE_TILE_PAIRS)
# G 64 / 128: fewer key groups a row and value groups a channel than the per-warp affine table's unrolled maximum
@pytest.mark.parametrize(
    "D,gq,T,G",
    [(128, 4, 1, 32), (64, 3, 1, 32), (128, 8, 1, 32), (64, 6, 2, 32), (128, 12, 1, 32), (128, 4, 1, 128),
     (128, 8, 1, 64), (64, 3, 1, 64)],
)  # fmt: skip
def test_decode_attention_fused_store_tiles(key, value, D, gq, T, G):
    mv = 992 // G * G  # the value store ("cols") holds whole groups of tokens
    kw = _attn_operands(2, 2, D, S=3, mk=1000, mv=mv, n_kt=40, key=key, value=value, G=G, dtype=torch.float16,
                        x_scale=True, seed=D + gq + key[0])  # fmt: skip
    x = torch.randn((2, 2 * gq, T, D), generator=_gen(10)) * D**-0.5
    for split_tokens in (0, 128):
        _attn_check(x, kw, split_tokens=split_tokens)


# The KIVI presets' pairs (keys "cols", values "rows", asym, equal widths): over >= 256 store tokens the op runs
# decode_attention_store.cu's KIVI tiles, which round every dequantized key and value to fp16 as gemv_kivi does (its
# numerical contract, docs/FORMATS.md): the expected output rounds the store tokens [0, F) likewise (F = min(mk, mv)
# rounded down to 64) and is computed in fp64; the general kernel's store edges and tails stay exact.
KIVI_TILE_PAIRS = [((b, "asym", "cols"), (b, "asym", "rows")) for b in (2, 4, 1)]


def _kivi_tiles_expected(x, kw, attn_mask=None):
    """fp64 softmax(x K^T + mask) V with the store tokens the KIVI tiles run rounded to fp16; mask None = causal."""

    def tokens(side):
        return reference.attention.store_tokens(
            kw[f"{side}_codes"], kw[f"{side}_scales"], kw[f"{side}_zeros"], kw[f"{side}_bits"], kw["group_size"],
            kw[f"{side}_mode"], kw[f"{side}_layout"],
        ).double()  # fmt: skip

    assert kw.get("key_x_scale") is None  # KIVI caches have none
    keys, values = tokens("key"), tokens("value")
    F = min(keys.shape[2], values.shape[2]) // 64 * 64
    if F >= 256:  # the tiles run from kMinStoreTileTokens (decode_attention.cu)
        keys[:, :, :F], values[:, :, :F] = keys[:, :, :F].half().double(), values[:, :, :F].half().double()
    K = torch.cat([kw["sink_keys"].double(), keys, kw["key_tail"].double()], 2)
    V = torch.cat([kw["sink_values"].double(), values, kw["value_tail"].double()], 2)
    B, H_q, T, D = x.shape
    H_kv, N = K.shape[1], K.shape[2]
    scores = (x.double().view(B, H_kv, H_q // H_kv * T, D) @ K.transpose(-1, -2)).view(B, H_q, T, N)
    if attn_mask is None:
        attn_mask = reference.attention.causal_mask(T, N, x.device)
    p = (scores + attn_mask.double()).softmax(-1).view(B, H_kv, H_q // H_kv * T, N)
    return (p @ V).view(B, H_q, T, D), V.abs().max().item()


@pytest.mark.parametrize("key,value", KIVI_TILE_PAIRS)
# G 64 / 128: fewer value groups a token row than the per-warp scale tables have slots for, key groups spanning steps
@pytest.mark.parametrize(
    "D,gq,T,G",
    [(128, 4, 1, 32), (64, 3, 1, 32), (128, 8, 1, 32), (64, 6, 1, 32), (128, 2, 3, 32), (64, 1, 5, 32),
     (128, 4, 1, 128), (64, 3, 1, 64)],
)  # fmt: skip
def test_decode_attention_fused_kivi_tiles(key, value, D, gq, T, G, monkeypatch):
    mk = 992 // G * G  # the key store ("cols") holds whole groups of tokens; the value store 8 more
    kw = _attn_operands(2, 2, D, S=3, mk=mk, mv=mk + 8, n_kt=40, key=key, value=value, G=G, dtype=torch.float16,
                        x_scale=False, seed=D + gq + key[0])  # fmt: skip
    x = torch.randn((2, 2 * gq, T, D), generator=_gen(12)) * D**-0.5
    N = 3 + mk + 40
    mask = None
    if T > 1:  # a caller's mask (broadcast over the batch) with -inf entries and one finite score per row
        g = _gen(13)
        mask = torch.where(
            torch.rand((1, 2 * gq, T, N), generator=g) < 0.2, float("-inf"), -torch.rand((1, 2 * gq, T, N), generator=g)
        )
        mask[..., 5] = 0.0
    want, vmax = _kivi_tiles_expected(x, kw, mask)
    dev = {k: v.to(DEV) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    m = mask.to(DEV) if mask is not None else None
    for split_tokens in (0, 128, 384 if G == 128 else 320):  # explicit splits are whole groups
        y = torch.ops.kvkernels.decode_attention_fused(x.to(DEV), **dev, attn_mask=m, split_tokens=split_tokens)
        err = (y.cpu().double() - want).abs().max().item()
        assert err <= 1e-4 * vmax + 1e-5, f"max err {err:.3g}"
    # KVKERNELS_ATTENTION_STORE_TILES=0 (read per call): the general kernel alone, exact (the fp32 reference); the
    # fp16 rounding must show (4e-5 to 5e-4 here), or the tiles did not run
    monkeypatch.setenv("KVKERNELS_ATTENTION_STORE_TILES", "0")
    y_general = _attn_check(x, kw, attn_mask=mask)
    assert (y.cpu() - y_general.cpu()).abs().max().item() > 1e-6


@pytest.mark.parametrize("key,value", [STORE_TILE_PAIRS[0], KIVI_TILE_PAIRS[0]])
def test_decode_attention_fused_store_tiles_prefetch_changes_nothing(key, value, monkeypatch):
    # the L2 prefetches are hints (the tiles' of each warp's first and next steps, the general kernel's of its first
    # tile, which here walks the sink, the stores' edges and the tails): KVKERNELS_ATTENTION_PREFETCH=0 (read per call)
    # must give the same bits. Splits of 320 tokens (5 steps of 64): warp 0 takes two, a prefetching step and a last one
    mk, mv = (1000, 992) if key[2] == "rows" else (992, 1000)  # a "cols" store holds whole groups of 32 tokens
    kw = _attn_operands(2, 2, 128, S=3, mk=mk, mv=mv, n_kt=40, key=key, value=value, G=32, dtype=torch.float16,
                        x_scale=key[2] == "rows", seed=29)  # fmt: skip
    x = torch.randn((2, 8, 1, 128), generator=_gen(13)) * 128**-0.5
    dev = {k: v.to(DEV) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    with_prefetch = torch.ops.kvkernels.decode_attention_fused(x.to(DEV), **dev, split_tokens=320)
    monkeypatch.setenv("KVKERNELS_ATTENTION_PREFETCH", "0")
    without = torch.ops.kvkernels.decode_attention_fused(x.to(DEV), **dev, split_tokens=320)
    assert torch.equal(with_prefetch, without)


@pytest.mark.parametrize("rest_splits", [None, "1"])
@pytest.mark.parametrize("split_tokens", [0, 64])
def test_decode_attention_fused_store_tiles_device_lengths(split_tokens, rest_splits, monkeypatch):
    # capacity 576 key / 544 value store tokens, 320 / 288 used: the store-tile split moves with the counts. The rest
    # (sink, edges, tails) in splits planned for its bound, or (KVKERNELS_ATTENTION_REST_SPLITS=1) in one split
    from device_lengths import with_capacity

    if rest_splits is not None:
        monkeypatch.setenv("KVKERNELS_ATTENTION_REST_SPLITS", rest_splits)

    key, value = STORE_TILE_PAIRS[0]
    kw = _attn_operands(2, 2, 128, 2, 320, 288, 40, key, value, 32, torch.float16, True, seed=23)
    kw = {k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    x = torch.randn((2, 8, 1, 128), generator=_gen(11)) * 128**-0.5
    ref = reference.decode_attention_fused(x, **kw, split_tokens=split_tokens)
    padded, lengths = with_capacity(kw, extra=(3, 256, 100, 256, 80))
    dev = {k: v.to(DEV) if isinstance(v, torch.Tensor) else v for k, v in padded.items()}
    y = torch.ops.kvkernels.decode_attention_fused(x.to(DEV), **dev, split_tokens=split_tokens, lengths=lengths.to(DEV))
    torch.testing.assert_close(y.cpu(), ref, rtol=1e-4, atol=1e-4)


def test_decode_attention_fused_deterministic_and_errors():
    kw = _attn_operands(1, 1, 64, 0, 2048, 2048, 3, (2, "sym", "rows"), (2, "sym", "cols"), 64, torch.float16, True, 11)
    dev = {k: v.to(DEV) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    x = torch.randn((1, 4, 1, 64), generator=_gen(7)).to(DEV)
    op = torch.ops.kvkernels.decode_attention_fused
    y1, y2 = op(x, **dev), op(x, **dev)  # planned: split-KV over the long store (one CTA < a wave)
    assert torch.equal(y1, y2)
    kw96 = _attn_operands(1, 1, 96, 0, 64, 64, 1, (2, "sym", "rows"), (2, "sym", "cols"), 32, torch.float16, False, 1)
    dev96 = {k: v.to(DEV) if isinstance(v, torch.Tensor) else v for k, v in kw96.items()}
    with pytest.raises((ValueError, RuntimeError), match="head_dim"):
        op(torch.randn((1, 1, 1, 96), device=DEV), **dev96)


# ---- static_append ---------------------------------------------------------------------------------------------
# The compiled op (csrc/cuda/static_append.cu, two launches) against the reference (kvkernels/reference/
# static_append.py) over the same decode loop: the same counts, dequantized tokens and store words at every step, from
# a sink still filling (prefill 6) or a long prompt (150), one or three tokens a step, fp16 / bf16 / fp32 windows.
STATIC_APPEND_CASES = [
    ("innerq_base", 6, 1, torch.float16), ("innerq_base", 150, 3, torch.bfloat16),
    ("innerq_hybrid", 6, 3, torch.float16), ("innerq_hybrid", 150, 1, torch.float32),
    ("kivi2", 6, 3, torch.float32), ("kivi2", 150, 1, torch.float16),
    ("kivi4", 6, 1, torch.bfloat16), ("kivi4", 150, 3, torch.float16),
]  # fmt: skip


@pytest.mark.parametrize(
    "preset, prefill, step_tokens, dtype",
    STATIC_APPEND_CASES,
    ids=[f"{p}-prefill{n}-step{s}-{str(d).split('.')[1]}" for p, n, s, d in STATIC_APPEND_CASES],
)
def test_static_append_matches_the_reference(preset, prefill, step_tokens, dtype):
    from kvkernels import ops
    from kvkernels.formats import PRESETS, make_layer_cache
    from kvkernels.static_cache import StaticLayerCache

    assert ops.CUDA_IMPL.get("static_append") == "cuda"
    # 210 tokens a case: past every preset's sink and recent window from a prefill of 6 (at 70 steps of one token
    # the innerq_base and kivi4 cases never reached their stores)
    B, H, D, steps = 2, 2, 128, 210 // step_tokens
    N = prefill + steps * step_tokens
    g = _gen(11)
    k = torch.randn(B, H, N, D, generator=g).to(DEV, dtype)
    v = torch.randn(B, H, N, D, generator=g).to(DEV, dtype)

    def static():
        c = make_layer_cache(PRESETS[preset], B, H, D, capacity=64, device=DEV, dtype=dtype)
        c.prefill(k[:, :, :prefill], v[:, :, :prefill])
        return StaticLayerCache(c, max_tokens=N, step_tokens=step_tokens)

    fast, ref = static(), static()
    assert fast.compiled_append
    ref.compiled_append = False  # the reference's fixed-shape ops on the same device
    for step, i in enumerate(range(prefill, N, step_tokens)):
        kk, vv = k[:, :, i : i + step_tokens], v[:, :, i : i + step_tokens]
        fast.append(kk, vv)
        ref.append(kk, vv)
        assert torch.equal(fast.lengths, ref.lengths)
        if step % 5 == 4 or i + step_tokens >= N:  # every few steps (the sanitizers run this test too) and at the end
            for got, want in zip(fast.dequantized(), ref.dequantized(), strict=True):
                assert torch.equal(got, want)
    for side, count in (("keys", 1), ("values", 3)):
        a, b = getattr(fast, side).store, getattr(ref, side).store
        n = int(fast.lengths[count])
        assert n > 0, f"the {side} store never received a token: the case does not test the quantizing append"
        for x, y in zip(type(a).views(a, 0, n), type(b).views(b, 0, n), strict=True):
            if x is not None:
                assert torch.equal(x, y)  # codes, scales, zeros of the used part, word for word
