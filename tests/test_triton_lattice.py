"""Triton lattice kernels (triton_kernels/lattice.py) against the reference and an explicit fp64 reading of
docs/FORMATS.md ("Lattice"): fwht and dequantize bit-exact, quantize bit-exact up to argmax near-ties, the GEMVs to
fp32 accumulation-order tolerance.

The fp64 helpers at the top (Sylvester matrix, the packing table read index by index) are written from the spec
alone, so they check the reference and the kernels alike. Runs on CPU under TRITON_INTERPRET=1 (CI) or on a CUDA
GPU; the interpreter is slow, so the sweep is a list of combined cases (grid x G x D x GQA x T x signs x odd N x
strides), every case naming what it covers.
"""

import math
from types import SimpleNamespace

import pytest
import torch
from kernel_bounds import assert_lattice_norms_match
from triton_helpers import DEVICE, DTYPES, TRITON_MARK, gen, place, seed_for, tk, triton

from kvkernels import reference
from kvkernels.formats.lattice_grids import grid as published_grid

pytestmark = TRITON_MARK
GRIDS = {"e2-16": (2, 16), "e2-64": (2, 64), "e2-256": (2, 256), "e4-256": (4, 256)}
# GEMVs: |triton - reference| <= RTOL * sum |q| |x_hat| + ATOL (both see the same input values; they differ in the
# order of fp32 sums and in where r16 multiplies, and the kernels rotate q instead of unrotating the keys)
RTOL = 2e-5
ATOL = 1e-6
# a code other than the reference's is accepted only where its distance is the optimum's to this (FORMATS.md)
TIE_TOL = 1e-5


def _signs(G: int, seed: int) -> torch.Tensor:
    return (torch.randint(0, 2, (G,), generator=gen(seed), dtype=torch.int8) * 2 - 1).to(DEVICE)


# ---------------------------------------------------------------------------------------------------------
# fp64 spec


def _hadamard64(G: int) -> torch.Tensor:
    """H_n = H / sqrt(G), the Sylvester matrix: H_1 = [1], H_2k = [[H_k, H_k], [H_k, -H_k]]."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < G:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(G)


def _rotate64(x, G, signs=None):
    """y = H_n (s * x) per group: fp64 [..., C]."""
    xg = x.double().cpu().unflatten(-1, (-1, G))
    if signs is not None:
        xg = xg * signs.double().cpu()
    return (xg @ _hadamard64(G)).flatten(-2)  # H_n is symmetric


def _unpack64(codes, d, n) -> torch.Tensor:
    """Grid indices [..., C / d] from codes int32 [..., C * bits / 32], read per FORMATS.md's table."""
    ib = n.bit_length() - 1
    words, per_block, per_word = ib // d, 32 // d, 32 // ib
    w = codes.cpu().long().unflatten(-1, (-1, words)) & 0xFFFFFFFF
    idx = []
    for j in range(per_block):
        if ib == 6 and j == 15:  # bits 2w, 2w + 1 in bits 30-31 of word w
            idx.append(sum(((w[..., k] >> 30) & 3) << (2 * k) for k in range(3)))
        else:
            idx.append((w[..., j // per_word] >> (ib * (j % per_word))) & (2**ib - 1))
    return torch.stack(idx, -1).flatten(-2)


def _dequantize64(codes, norms, grid, G, signs=None) -> torch.Tensor:
    """x_hat = s * H_n (r16 * grid[c]) per group: fp64 [..., C]."""
    n, d = grid.shape
    v = grid.double().cpu()[_unpack64(codes, d, n)].flatten(-2).unflatten(-1, (-1, G))
    x = (v * norms.cpu().double()[..., None]) @ _hadamard64(G)
    if signs is not None:
        x = x * signs.double().cpu()
    return x.flatten(-2)


def _assert_codes_match(codes, codes_ref, x, grid, G, signs):
    """codes equal the reference's, or differ only at near-ties: the chosen point's distance to u = y / r is the
    optimum's to TIE_TOL (both measured in fp64)."""
    n, d = grid.shape
    idx, idx_ref = _unpack64(codes, d, n), _unpack64(codes_ref, d, n)
    if torch.equal(idx, idx_ref):
        return
    y = _rotate64(x, G, signs).unflatten(-1, (-1, G))
    r = x.double().cpu().unflatten(-1, (-1, G)).norm(dim=-1, keepdim=True) / math.sqrt(G)
    u = torch.where(r == 0, 0.0, y / r).flatten(-2).unflatten(-1, (-1, d))  # [..., C / d, d]
    g = grid.double().cpu()
    dist = ((u[..., None, :] - g) ** 2).sum(-1)  # [..., C / d, n]
    best = dist.min(-1).values
    got = dist.gather(-1, idx[..., None]).squeeze(-1)
    differ = idx != idx_ref
    assert (got[differ] - best[differ]).abs().max() <= TIE_TOL, f"{int(differ.sum())} codes differ beyond a tie"


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu(), b.cpu()
    if a.dtype == torch.float16:
        a, b = a.view(torch.int16), b.view(torch.int16)
    return torch.equal(a, b)


# ---------------------------------------------------------------------------------------------------------
# fwht

# id: (G, C, lead, dtype, signs, inverse, strided)
FWHT_CASES = {
    "G32-C64-fp32": (32, 64, (3,), "fp32", False, False, False),
    "G64-C128-fp16-signs-strided": (64, 128, (2, 3), "fp16", True, False, True),
    "G128-C256-bf16-signs-inverse": (128, 256, (5,), "bf16", True, True, False),
    "G256-C256-fp32-inverse-strided": (256, 256, (2, 2), "fp32", False, True, True),
    "G1024-C1024-fp32-signs": (1024, 1024, (2,), "fp32", True, False, False),
    "G32-C96-fp32-signs-inverse-1d": (32, 96, (), "fp32", True, True, False),
}


@pytest.mark.parametrize("name", FWHT_CASES)
def test_fwht(name):
    G, C, lead, dt, use_signs, inverse, strided = FWHT_CASES[name]
    seed = seed_for(name)
    x = torch.randn(*lead, C, generator=gen(seed)).to(DTYPES[dt])
    signs = _signs(G, seed + 1) if use_signs else None
    y = tk.fwht(place(x, strided, seed + 2), G, signs, inverse)
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert _same_bits(y, reference.fwht(x, G, None if signs is None else signs.cpu(), inverse))
    if inverse:  # x = s * (H_n y)
        want = _rotate64(x, G) * (1.0 if signs is None else signs.double().cpu().repeat(C // G))
    else:
        want = _rotate64(x, G, signs)
    torch.testing.assert_close(y.double().cpu(), want, rtol=0, atol=1e-5 * want.abs().max().item())
    # the inverse undoes the forward transform
    back = tk.fwht(tk.fwht(y, G, signs, not inverse), G, signs, inverse)
    torch.testing.assert_close(back.cpu(), y.cpu(), rtol=0, atol=1e-5 * y.abs().max().item())


# ---------------------------------------------------------------------------------------------------------
# quantize / dequantize

# id: (grid, G, C, lead, dtype, signs, strided)
QUANT_CASES = {
    "e2-16-G32-C64-fp32": ("e2-16", 32, 64, (6,), "fp32", False, False),
    "e2-64-G64-C128-fp16-signs-strided": ("e2-64", 64, 128, (2, 3), "fp16", True, True),
    "e2-256-G128-C128-bf16": ("e2-256", 128, 128, (3,), "bf16", False, False),
    "e4-256-G32-C96-fp32-signs": ("e4-256", 32, 96, (5,), "fp32", True, False),
    "e2-64-G256-C256-crosshead-strided": ("e2-64", 256, 256, (2, 2), "fp32", False, True),
    "e4-256-G128-C256-fp16-signs": ("e4-256", 128, 256, (2, 2), "fp16", True, False),
    "e2-16-G256-C256-bf16-signs-crosshead": ("e2-16", 256, 256, (3,), "bf16", True, False),
    "e2-256-G64-C64-fp32-strided": ("e2-256", 64, 64, (2, 3), "fp32", False, True),
}


@pytest.mark.parametrize("name", QUANT_CASES)
def test_quantize_and_dequantize(name):
    grid_name, G, C, lead, dt, use_signs, strided = QUANT_CASES[name]
    seed = seed_for(name)
    grid = published_grid(*GRIDS[grid_name])
    x = torch.randn(*lead, C, generator=gen(seed)).reshape(-1, C)
    x[0, :G] = 0.0  # a zero group: norm 0, the code nearest the origin, dequantizes to exactly 0
    x[-1, -G:] *= 1000.0  # a large group (fp16 norm far from 1)
    x = x.reshape(*lead, C).to(DTYPES[dt])
    signs = _signs(G, seed + 1) if use_signs else None
    s_cpu = None if signs is None else signs.cpu()

    codes, norms = tk.lattice_quantize(place(x, strided, seed + 2), grid.to(DEVICE), G, signs)
    codes_ref, norms_ref = reference.lattice_quantize(x, grid, G, s_cpu)
    assert codes.shape == codes_ref.shape and codes.dtype == torch.int32
    assert_lattice_norms_match(norms, norms_ref, x, G)
    _assert_codes_match(codes, codes_ref, x, grid, G, s_cpu)

    out = tk.lattice_dequantize(place(codes.cpu(), strided, seed + 3), place(norms.cpu(), strided, seed + 4),
                                grid.to(DEVICE), G, signs)  # fmt: skip
    assert out.dtype == torch.float32 and out.shape == x.shape
    assert _same_bits(out, reference.lattice_dequantize(codes.cpu(), norms.cpu(), grid, G, s_cpu))
    want = _dequantize64(codes, norms, grid, G, s_cpu)
    torch.testing.assert_close(out.double().cpu(), want, rtol=1e-6, atol=1e-6 * want.abs().max().item())
    assert not out.reshape(-1, C)[0, :G].any()


@pytest.mark.parametrize("grid_name", GRIDS)
def test_dequantize_reads_every_bit_of_the_layout(grid_name):
    # random words (all-ones included): every index position and the 6-bit layout's split 16th index
    d, n = GRIDS[grid_name]
    bits = (n.bit_length() - 1) // d
    G, C = 32, 128
    g = gen(seed_for(grid_name))
    codes = torch.randint(-(2**31), 2**31 - 1, (3, C // 32 * bits), generator=g, dtype=torch.int64).to(torch.int32)
    codes[0] = -1
    norms = (torch.rand(3, C // G, generator=g) + 0.5).half()
    grid = published_grid(d, n)
    out = tk.lattice_dequantize(codes.to(DEVICE), norms.to(DEVICE), grid.to(DEVICE), G)
    assert _same_bits(out, reference.lattice_dequantize(codes, norms, grid, G))
    want = _dequantize64(codes, norms, grid, G)
    torch.testing.assert_close(out.double().cpu(), want, rtol=1e-6, atol=1e-6 * want.abs().max().item())


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy on NaN
def test_quantize_nan_stays_in_its_group():
    grid = published_grid(2, 64)
    x = torch.randn(2, 128, generator=gen(3))
    x[0, 5] = float("nan")
    codes, norms = tk.lattice_quantize(x.to(DEVICE), grid.to(DEVICE), 64)
    codes_ref, norms_ref = reference.lattice_quantize(x, grid, 64)
    assert torch.isnan(norms[0, 0].float()).item()
    assert not codes[0, :6].any()  # a NaN score never wins: every index of the group is 0 (ops.lattice_quantize)
    assert _same_bits(norms[:, 1:], norms_ref[:, 1:]) and _same_bits(norms[1], norms_ref[1])
    assert torch.equal(codes[:, 6:].cpu(), codes_ref[:, 6:]) and torch.equal(codes[1].cpu(), codes_ref[1])
    out = tk.lattice_dequantize(codes, norms, grid.to(DEVICE), 64).cpu()
    assert out[0, :64].isnan().all() and not out[0, 64:].isnan().any()


# ---------------------------------------------------------------------------------------------------------
# GEMVs

# id: (grid, G, D, B, H_kv, ratio, T, N, signs, dtype, strided)
GEMV_CASES = {
    "e2-16-G32-D64-H2-N17": ("e2-16", 32, 64, 1, 2, 1, None, 17, False, "fp32", False),
    "e2-64-G64-D128-gqa3-T3-N100-signs-strided": ("e2-64", 64, 128, 1, 1, 3, 3, 100, True, "fp16", True),
    "e2-256-G128-D128-B2-N1": ("e2-256", 128, 128, 2, 1, 1, None, 1, False, "bf16", False),
    "e4-256-G32-D96-gqa3-T16-N33-signs": ("e4-256", 32, 96, 1, 1, 3, 16, 33, True, "fp32", False),
    "e2-16-G64-D64-gqa3-N100-split-strided": ("e2-16", 64, 64, 1, 1, 3, None, 100, False, "fp32", True),
    "e2-64-G32-D128-T1-N17-signs": ("e2-64", 32, 128, 1, 2, 1, 1, 17, True, "bf16", False),
    "e2-256-G64-D64-gqa3-T3-N17-signs-strided": ("e2-256", 64, 64, 2, 1, 3, 3, 17, True, "fp32", True),
    "e4-256-G128-D128-N300-split": ("e4-256", 128, 128, 1, 1, 1, None, 300, False, "fp16", False),
}


def _gemv_case(name) -> SimpleNamespace:
    """One case's cache quantized by the reference, its fp64 dequantization repeated per query head (x_hat
    [B, H_q, N, D]), the reference's arguments and the kernel's (device copies, strided views if the case says so)."""
    grid_name, G, D, B, H_kv, ratio, T, N, use_signs, dt, strided = GEMV_CASES[name]
    seed = seed_for(name)
    grid = published_grid(*GRIDS[grid_name])
    signs = _signs(G, seed + 1) if use_signs else None
    s_cpu = None if signs is None else signs.cpu()
    codes, norms = reference.lattice_quantize(torch.randn(B, H_kv, N, D, generator=gen(seed)), grid, G, s_cpu)
    x_hat = reference.lattice_dequantize(codes, norms, grid, G, s_cpu).double().repeat_interleave(ratio, 1)
    dev_codes, dev_norms = place(codes, strided, seed + 2), place(norms, strided, seed + 3)
    return SimpleNamespace(
        rows=(B, H_kv * ratio) if T is None else (B, H_kv * ratio, T),  # leading dims of q / p
        dtype=DTYPES[dt],
        place=lambda t: place(t, strided, seed + 4),
        gen=gen(seed + 5),
        x_hat=x_hat,
        ref_args=(codes, norms, grid, G, s_cpu),
        dev_args=(dev_codes, dev_norms, grid.to(DEVICE), G, signs),
    )


def _check_gemv(y, ref, mag):
    y, ref = y.cpu(), ref.cpu()
    assert y.shape == ref.shape and y.dtype == torch.float32 and torch.isfinite(y).all()
    err = (y.double() - ref.double()).abs()
    bad = err > RTOL * mag + ATOL
    assert not bad.any(), f"max |diff| {err.max():.3g}, magnitude {mag.max():.3g}, {int(bad.sum())} bad"


def _check_gemv_op(name, c, x, tk_op, ref_op, rhs):
    """tk_op(x, codes, ...) against ref_op and against the fp64 definition x . rhs: rhs is x_hat^T [.., D, N] for
    the keys (scores q . x_hat), x_hat [.., N, D] for the values (sum_n p[n] x_hat[n])."""
    y = tk_op(c.place(x), *c.dev_args)
    x4 = x.double() if len(c.rows) == 3 else x.double().unsqueeze(2)  # [B, H_q, T, D or N]
    exact, mag = (x4 @ rhs).reshape(y.shape), (x4.abs() @ rhs.abs()).reshape(y.shape)
    _check_gemv(y, ref_op(x, *c.ref_args), mag)
    _check_gemv(y, exact, mag)
    if "split" in name:  # tokens split over programs, values' partials summed in a fixed order: same run to run
        assert torch.equal(y, tk_op(c.place(x), *c.dev_args))


@pytest.mark.parametrize("name", GEMV_CASES)
def test_gemv_lattice_k(name):
    c = _gemv_case(name)
    q = torch.randn(*c.rows, c.x_hat.shape[-1], generator=c.gen).to(c.dtype)
    _check_gemv_op(name, c, q, tk.gemv_lattice_k, reference.gemv_lattice_k, c.x_hat.transpose(-1, -2))


@pytest.mark.parametrize("name", GEMV_CASES)
def test_gemv_lattice_v(name):
    c = _gemv_case(name)
    p = torch.rand(*c.rows, c.x_hat.shape[-2], generator=c.gen).to(c.dtype)
    _check_gemv_op(name, c, p, tk.gemv_lattice_v, reference.gemv_lattice_v, c.x_hat)


def test_split_paths_are_taken():
    lat = pytest.importorskip("kvkernels.triton_kernels.lattice")
    common = pytest.importorskip("kvkernels.triton_kernels._common")
    for name in ("e2-16-G64-D64-gqa3-N100-split-strided", "e4-256-G128-D128-N300-split"):
        _, G, D, B, H_kv, ratio, T, N, *_ = GEMV_CASES[name]
        _, _, block_n, _ = lat._gemv_tiles(ratio, T or 1, N, D)
        assert common.num_splits(B * H_kv, triton.cdiv(N, block_n), torch.device(DEVICE)) > 1, name
    # q_len 16 with GQA 3 at D 96 needs more query rows than one launch holds: the T-chunked path
    assert lat._gemv_tiles(3, 16, 33, 128)[0] < 16


def test_empty_shapes():
    grid = published_grid(2, 16).to(DEVICE)
    c, n = torch.zeros(1, 1, 0, 4, dtype=torch.int32, device=DEVICE), torch.zeros(1, 1, 0, 2, dtype=torch.float16)
    n = n.to(DEVICE)
    assert tk.gemv_lattice_k(torch.randn(1, 2, 64, device=DEVICE), c, n, grid, 32).shape == (1, 2, 0)
    y = tk.gemv_lattice_v(torch.rand(1, 2, 3, 0, device=DEVICE), c, n, grid, 32)
    assert y.shape == (1, 2, 3, 64) and not y.any()
    codes, norms = tk.lattice_quantize(torch.randn(0, 3, 64, device=DEVICE), grid, 32)
    assert codes.shape == (0, 3, 4) and norms.shape == (0, 3, 2)
    assert tk.lattice_dequantize(codes, norms, grid, 32).shape == (0, 3, 64)
    assert tk.fwht(torch.randn(2, 0, 64, device=DEVICE), 32).shape == (2, 0, 64)
