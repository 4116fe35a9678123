"""The GPU tests' error bounds (tests/kernel_bounds.py) against models of the roundings they must admit, on CPU.

The compiled kernels only run on a GPU; these check that the bounds the GPU tests hold them to are neither too tight
for the kernels' documented arithmetic (docs/FORMATS.md, "GEMV arithmetic") nor vacuous.
"""

import torch
from kernel_bounds import inner_q_term_magnitude, inner_q_terms, lattice_gemv_bound

from kvkernels import reference
from kvkernels.formats.lattice_grids import BITS, grid


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _inner_q_kernel_model(x4, codes, scales, zeros, bits, G, mode, H_q):
    """gemv_inner_q's sums in float32 as the CUDA kernel orders them: x prescaled per query row by a power of two,
    per 32-value block s * dot(x, u') plus zeff * sum(x), unscaled at the end. [B, H_q, T, M]."""
    r = H_q // codes.shape[1]
    su, z = (t.repeat_interleave(r, 1) for t in inner_q_terms(codes, scales, zeros, bits, G, mode))
    e = 14 - torch.floor(torch.log2(x4.abs().amax(-1, keepdim=True)))
    v = x4.float() * torch.exp2(e)
    acc = torch.zeros(*v.shape[:-1], codes.shape[2])
    for blk in range(v.shape[-1] // 32):
        cols = slice(32 * blk, 32 * blk + 32)
        acc = (
            acc
            + v[..., cols] @ su[..., cols].transpose(-1, -2)
            + v[..., cols].sum(-1, keepdim=True) * z[..., None, :, 32 * blk]
        )
    return acc * torch.exp2(-e)


def test_inner_q_bound_admits_the_cancelling_terms_of_zero_weight_rows():
    # test_inner_q_shapes[b1-keys-D128-M37-gqa4-T16]'s tensors: 1-bit hybrid, rows whose weights are all 0
    B, H_q, H_kv, M, L, bits, G = 1, 16, 4, 37, 128, 1, 64
    w = torch.randn((B, H_kv, M, L), generator=_gen(M + L))
    w[..., ::7] += 1.5
    codes, scales, zeros = reference.quantize_groups(w, bits, G, "hybrid")
    x4 = torch.randn((B, H_q, 16, L), generator=_gen(M + L + 1)).to(torch.float16)
    deq = reference.dequantize_groups(codes, scales, zeros, bits, G, "hybrid")
    assert (deq == 0).all(-1).any(), "the case needs a row of all-zero weights"
    ref = reference.gemv_inner_q(x4, codes, scales, zeros, bits, G, "hybrid")
    err = (_inner_q_kernel_model(x4, codes, scales, zeros, bits, G, "hybrid", H_q) - ref).abs()
    mag = inner_q_term_magnitude(x4, codes, scales, zeros, bits, G, "hybrid", H_q)
    assert (err <= 1e-4 * mag + 1e-5).all()  # test_cuda_kernels' fp16 tolerance on the terms' magnitude
    assert (err <= 1e-6 * mag + 1e-7).all()  # ... with 100x headroom
    mag_deq = x4.float().abs() @ deq.abs().repeat_interleave(H_q // H_kv, 1).transpose(-1, -2)
    assert not (err <= 1e-4 * mag_deq + 1e-5).all()  # the bound on |deq| the first GPU run failed


def test_inner_q_term_magnitude_is_the_weights_in_sym_mode_and_covers_them_otherwise():
    x4 = torch.randn((2, 6, 3, 96), generator=_gen(1))
    xs = torch.rand((2, 96), generator=_gen(2)) + 0.5
    for mode in ("sym", "asym", "hybrid"):
        codes, scales, zeros = reference.quantize_groups(torch.randn((2, 2, 9, 96), generator=_gen(3)), 2, 32, mode)
        deq = reference.dequantize_groups(codes, scales, zeros, 2, 32, mode)
        mag = inner_q_term_magnitude(x4, codes, scales, zeros, 2, 32, mode, 6, xs)
        want = (x4.abs() * xs.repeat_interleave(3, 0)[None, :, None]) @ deq.abs().repeat_interleave(3, 1).mT
        assert mag.shape == (2, 6, 3, 9)
        if mode == "sym":
            torch.testing.assert_close(mag, want)
        else:
            assert (mag >= want * (1 - 1e-6)).all() and (mag > want * 1.01).any()


def test_lattice_bound_admits_an_fp16_grid_and_refuses_a_coarser_one():
    # test_lattice.test_cuda_matches_the_reference's tensors. The compiled GEMVs see the grid in fp16 (2^-11 per
    # value): the reference on an fp16-rounded grid must pass; on a grid rounded to 4 mantissa bits it must not
    G, signs = 64, (torch.randint(0, 2, (64,), generator=_gen(27), dtype=torch.int8) * 2 - 1)
    for d, n in sorted(BITS):
        g = grid(d, n)
        codes, norms = reference.lattice_quantize(torch.randn(2, 3, 40, 128, generator=_gen(28)), g, G, signs)
        for values, x, op in (
            (False, torch.randn(2, 6, 128, generator=_gen(29)), reference.gemv_lattice_k),
            (True, torch.rand(2, 6, 40, generator=_gen(30)), reference.gemv_lattice_v),
        ):
            want = op(x, codes, norms, g, G, signs)
            bound = lattice_gemv_bound(values, x.unsqueeze(2), codes, norms, g, G, signs, 6).squeeze(2)
            assert bound.shape == want.shape
            fp16 = (op(x, codes, norms, g.half().float(), G, signs) - want).abs()
            assert (fp16 <= bound).all(), (d, n, values)
            m, ex = torch.frexp(g)
            coarse = torch.ldexp(torch.round(m * 16) / 16, ex)  # 4 mantissa bits: ~2^-5 per value
            assert not ((op(x, codes, norms, coarse, G, signs) - want).abs() <= bound).all(), (d, n, values)
