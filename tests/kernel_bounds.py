"""Error bounds of the compiled kernels, from their numerical contracts (docs/FORMATS.md, "GEMV arithmetic", "Lattice").

A kernel's rounding error is relative to the magnitude of the terms it adds, not to the result, and not to the
dequantized weights when the kernel never forms them:
- InnerQ (`gemv_inner_q`) sums `s * dot(x, u')` and, in asym / hybrid mode, `zeff * sum(x)` per 32-value block (u'
  the decoded level: u - 2^(b-1) in sym mode, u otherwise). Where `s * u' + zeff` cancels, e.g. a 1-bit hybrid group
  stored as sym (levels {-s, 0}) whose codes are all 1, the weights are 0 but the two terms are not: their residue
  is ~1e-8 of sum |x| (|s u'| + |zeff|). The first GPU run (H200, 2026-11-26) failed four 1-bit hybrid key cases on
  a bound that used |deq| there: rows of all-zero weights gave a bound of atol alone.
- Lattice (`gemv_lattice_k` / `_v`): the tensor cores see the grid in fp16 (2^-11 per value), in the rotated domain.
"""

import math

import torch

from kvkernels import reference


def inner_q_terms(codes, scales, zeros, bits, G, mode):
    """(s u', zeff) per weight, [B, H_kv, M, L] each: the two parts gemv_inner_q adds separately. In sym mode zeff
    is 0 (the decoded level carries the offset) and s u' is the weight."""
    deq = reference.dequantize_groups(codes, scales, zeros, bits, G, mode)
    if mode == "sym":
        return deq, torch.zeros_like(deq)
    # zeff is the weight at code 0 (asym and hybrid decode u without an offset)
    zeff = reference.dequantize_groups(torch.zeros_like(codes), scales, zeros, bits, G, mode)
    return deq - zeff, zeff


def inner_q_term_magnitude(x4, codes, scales, zeros, bits, G, mode, H_q, xs=None):
    """sum_l |x_l * xs_l| (|s u'_l| + |zeff_l|) per (b, query head, t, row m): [B, H_q, T, M] (x4 is [B, H_q, T, L],
    xs the [H_kv, L] x_scale or None). In sym mode zeff is 0 and |s u'| is |deq|."""
    su, zeff = inner_q_terms(codes, scales, zeros, bits, G, mode)
    terms = su.abs() + zeff.abs()
    xa = x4.float().abs()
    if xs is not None:
        xa = xa * xs.repeat_interleave(H_q // xs.shape[0], 0)[None, :, None, :]
    return xa @ terms.repeat_interleave(H_q // codes.shape[1], 1).transpose(-1, -2)


def lattice_rotated(codes, norms, grid, G):
    """y = r16 * grid[c] per group: the rotated dequantized rows [B, H_kv, N, D] the kernels sum over (fp32)."""
    d, index_bits, _ = reference.lattice.grid_layout(grid)
    idx = reference.unpack_lattice_indices(codes, index_bits)
    points = grid[idx].reshape(*codes.shape[:-1], idx.shape[-1] * d)
    D = points.shape[-1]
    return (points.reshape(*points.shape[:-1], D // G, G) * norms.float().unsqueeze(-1)).reshape(points.shape)


def lattice_gemv_bound(values, x4, codes, norms, grid, G, signs, H_q):
    """Allowed |out - reference| of gemv_lattice_v (values) / gemv_lattice_k, [B, H_q, T, D] / [B, H_q, T, N] for
    x4 [B, H_q, T, L]: twice the contract, 2^-10 (keys) / 2^-9 (values) of the magnitude the sum is made of in the
    rotated domain (keys: sum_i |q'_i| |y_i|; values, output channel j of group g: G^-1/2 sum_{i in g} sum_n |p_n|
    |y_{n,i}|), plus an absolute 2^-20 sum |p| for values' subnormal fp16 products, plus 1e-5."""
    B = x4.shape[0]
    y = lattice_rotated(codes, norms, grid, G).abs().repeat_interleave(H_q // codes.shape[1], 1)  # [B, H_q, N, D]
    x4 = x4.float()
    if values:
        D = y.shape[-1]
        mag = (x4.abs() @ y).reshape(B, H_q, -1, D // G, G).sum(-1, keepdim=True) / G**0.5  # per group
        mag = mag.expand(-1, -1, -1, -1, G).reshape(B, H_q, -1, D)
        return 2.0**-9 * mag + 2.0**-20 * x4.abs().sum(-1, keepdim=True) + 1e-5
    q_rot = reference.fwht(x4, G, signs).abs()
    return 2.0**-10 * (q_rot @ y.transpose(-1, -2)) + 1e-5


def assert_lattice_norms_match(norms, norms_ref, x, G):
    """norms equal the reference's bit for bit, or differ by one fp16 step where the RMS sits on an fp16 rounding
    boundary to fp32 precision (the sum of squares runs in a backend-specific order)."""
    a, b = norms.cpu().view(torch.int16).int(), norms_ref.cpu().view(torch.int16).int()
    differ = a != b
    if not differ.any():
        return
    assert ((a - b).abs()[differ] == 1).all(), "norms differ by more than one fp16 step"
    rms = x.double().cpu().unflatten(-1, (-1, G)).norm(dim=-1) / math.sqrt(G)
    mid = (norms.cpu().double() + norms_ref.cpu().double()) / 2
    assert ((rms - mid).abs()[differ] <= 1e-6 * rms[differ]).all(), "norms differ away from a rounding boundary"
