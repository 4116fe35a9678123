"""Empty shapes (issue 12, item 6): every backend returns the same correctly shaped result.

A GEMV with an empty output dim (B, H_q, T or the output length M / C = 0) returns an empty tensor of the full
shape; one with an empty reduction (L or R = 0: a value GEMV over no tokens) returns zeros of the full shape, the
value of an empty sum. The reference GEMVs (the CPU kernels) used to raise a reshape error where Triton returned
the empty tensor. Storage ops (pack/unpack, quantize/dequantize) keep their zero-size leading and last dims.
"""

import os

import pytest
import torch
from triton_helpers import TRITON_MARK

import kvkernels
from kvkernels import reference

ops = torch.ops.kvkernels
TRITON = os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()


def _backends():
    out = ["cpu", "reference", "meta"]
    if TRITON:  # skipped where the interpreter cannot run the kernels (triton 3.6 under numpy >= 2.4)
        out.append(pytest.param("triton", marks=TRITON_MARK))
    if torch.cuda.is_available():
        out.append("cuda")
    return out


def _call(backend: str, op: str, *args):
    """Runs op through one backend; tensors are built on the CPU and moved as the backend needs."""
    if backend in ("meta", "cuda") or (backend == "triton" and torch.cuda.is_available()):
        dev = "cuda" if backend != "meta" else "meta"
        args = tuple(a.to(dev) if isinstance(a, torch.Tensor) else a for a in args)
    if backend == "reference":
        return getattr(reference, op)(*args)
    if backend == "triton":
        import kvkernels.triton_kernels as tk

        return getattr(tk, op)(*args)
    return getattr(ops, op)(*args)


def _inner_q_args(B, H_q, H_kv, T, L, M, bits=3, G=32, mode="asym", x_scale=False):
    g = torch.Generator().manual_seed(0)
    x = torch.randn((B, H_q, L) if T is None else (B, H_q, T, L), generator=g)
    codes = torch.randint(-(2**31), 2**31, (B, H_kv, M, L // 32 * bits), generator=g, dtype=torch.int32)
    scales = torch.rand(B, H_kv, M, L // G, generator=g).half()
    zeros = None if mode == "sym" else torch.randn(B, H_kv, M, L // G, generator=g).half()
    xs = torch.rand(H_kv, L, generator=g) if x_scale else None
    return x, codes, scales, zeros, bits, G, mode, xs


# (id, B, H_q, H_kv, T, L, M): L is the reduction (key dim for scores, tokens for the value GEMV), M the output
INNER_Q = [
    ("batch0", 0, 2, 1, 3, 64, 5),
    ("heads0", 1, 0, 1, 3, 64, 5),
    ("qlen0", 1, 2, 1, 0, 64, 5),
    ("no-keys-M0", 2, 4, 2, 3, 64, 0),
    ("no-keys-M0-3d", 2, 4, 2, None, 64, 0),
    ("no-tokens-L0", 2, 4, 2, 3, 0, 5),
    ("no-tokens-L0-3d", 1, 2, 1, None, 0, 8),
    ("all-empty", 0, 0, 1, 0, 0, 0),
]


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("mode, x_scale", [("asym", False), ("sym", True), ("hybrid", True)])
@pytest.mark.parametrize("case", INNER_Q, ids=[c[0] for c in INNER_Q])
def test_gemv_inner_q_empty(case, mode, x_scale, backend):
    _, B, H_q, H_kv, T, L, M = case
    y = _call(backend, "gemv_inner_q", *_inner_q_args(B, H_q, H_kv, T, L, M, mode=mode, x_scale=x_scale))
    assert y.shape == ((B, H_q, M) if T is None else (B, H_q, T, M)) and y.dtype == torch.float32
    if backend != "meta":
        assert torch.equal(y.cpu(), torch.zeros(y.shape)), "an empty reduction sums to zero"


# (id, B, H_q, H_kv, T, R, C): R is the reduction (tokens), C the output columns
KIVI = [
    ("batch0", 0, 2, 1, 3, 17, 64),
    ("heads0", 1, 0, 1, 3, 17, 64),
    ("qlen0", 1, 2, 1, 0, 17, 64),
    ("columns0", 2, 4, 2, 3, 17, 0),
    ("no-tokens-R0", 2, 4, 2, 3, 0, 64),
    ("no-tokens-R0-3d", 1, 3, 1, None, 0, 96),
]


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("case", KIVI, ids=[c[0] for c in KIVI])
def test_gemv_kivi_empty(case, backend):
    _, B, H_q, H_kv, T, R, C = case
    bits, G = 2, 32
    g = torch.Generator().manual_seed(1)
    x = torch.randn((B, H_q, R) if T is None else (B, H_q, T, R), generator=g).half()
    codes = torch.randint(-(2**31), 2**31, (B, H_kv, R, C // 32 * bits), generator=g, dtype=torch.int32)
    scales = torch.rand(B, H_kv, R, C // G, generator=g).half()
    zeros = torch.randn(B, H_kv, R, C // G, generator=g).half()
    y = _call(backend, "gemv_kivi", x, codes, scales, zeros, bits, G)
    assert y.shape == ((B, H_q, C) if T is None else (B, H_q, T, C)) and y.dtype == torch.float32
    if backend != "meta":
        assert torch.equal(y.cpu(), torch.zeros(y.shape))


def test_empty_value_gemv_matches_nonempty_limit():
    # the zeros are the limit of the value GEMV as its tokens go: one token less at a time down to none
    x, codes, scales, zeros, bits, G, mode, _ = _inner_q_args(1, 2, 1, None, 64, 4)
    for L in (64, 32, 0):
        y = ops.gemv_inner_q(x[..., :L], codes[..., : L // 32 * bits], scales[..., : L // G], zeros[..., : L // G],
                             bits, G, mode)  # fmt: skip
        want = reference.gemv_inner_q(x[..., :L], codes[..., : L // 32 * bits], scales[..., : L // G],
                                      zeros[..., : L // G], bits, G, mode)  # fmt: skip
        torch.testing.assert_close(y, want)
    assert torch.equal(y, torch.zeros(1, 2, 4))


STORAGE_SHAPES = [(0, 64), (3, 0), (0,), (2, 0, 64), (0, 0), (1, 1, 0)]


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("mode", ["sym", "asym", "hybrid"])
@pytest.mark.parametrize("shape", STORAGE_SHAPES, ids=str)
def test_quantize_dequantize_empty(shape, mode, backend):
    bits, G = 3, 32
    x = torch.randn(shape)
    lead, L = shape[:-1], shape[-1]
    codes, scales, zeros = _call(backend, "quantize_groups", x, bits, G, mode, 0.0)
    assert codes.shape == (*lead, L // 32 * bits) and codes.dtype == torch.int32
    assert scales.shape == zeros.shape == (*lead, L // G) and scales.dtype == zeros.dtype == torch.float16
    y = _call(backend, "dequantize_groups", codes, scales, zeros, bits, G, mode)
    assert y.shape == shape and y.dtype == torch.float32
    outs = (torch.empty_like(codes), torch.empty_like(scales), torch.empty_like(zeros))
    dev = outs[0].device
    assert _call(backend, "quantize_groups_into", x.to(dev), bits, G, mode, 0.0, *outs) is None


@pytest.mark.parametrize("backend", ["cpu", "reference", "meta"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("shape", STORAGE_SHAPES, ids=str)
def test_pack_unpack_empty(shape, backend):
    bits = 3
    packed = _call(backend, "pack_bits", torch.zeros(shape, dtype=torch.uint8), bits)
    assert packed.shape == (*shape[:-1], shape[-1] // 32 * bits) and packed.dtype == torch.int32
    codes = _call(backend, "unpack_bits", packed, bits)
    assert codes.shape == shape and codes.dtype == torch.uint8


def test_public_wrappers_empty():
    x, codes, scales, zeros, bits, G, mode, _ = _inner_q_args(0, 2, 1, 3, 64, 5)
    assert kvkernels.gemv_inner_q(x, codes, scales, zeros, bits, G, mode).shape == (0, 2, 3, 5)
    c, s, z = kvkernels.quantize_groups(torch.randn(0, 64), 2, 32, "asym")
    assert kvkernels.dequantize_groups(c, s, z, 2, 32, "asym").shape == (0, 64)
    assert kvkernels.unpack_bits(kvkernels.pack_bits(torch.zeros(4, 0, dtype=torch.long), 2), 2).shape == (4, 0)
