"""Group quantizers, reference implementation (the spec for csrc/kvkernels/quant.cuh and the kernels).

Groups are G consecutive values along the last dim. Every mode stores unsigned b-bit codes u and fp16
scale/zero words and dequantizes a group as  x ~= s * u + zeff:

    sym    s = fp16(max|x| / 2^(b-1)),   u = clamp(round(x / s) + 2^(b-1), 0, 2^b - 1),   zeff = -s * 2^(b-1)
           (a constant non-zero group, b >= 2: s = fp16(|c| / 2^(b-2)), so it reads back exactly)
    asym   s = fp16((max - min) / (2^b - 1)), z = fp16(min),  u = clamp(round((x - z) / s), 0, 2^b - 1), zeff = z
    hybrid per group, whichever of sym/asym has the lower squared error (ties: sym); asym groups store -s
           (fp16 sign bit = mask M of the InnerQ paper, eq. 14) and their zero; sym groups store zero 0.

Asym takes a calibration eta (XQuant, SpeCache): codes are chosen with (z, s) as above but stored as
z' = fp16(z + eta * s * (2^b - 1)), s' = fp16((1 - 2 eta) s); eta = 0 is plain KIVI, and b = 1 with
eta = 0.25 gives SpeCache's 1-bit midpoints z' = (3 min + max) / 4, s' = (max - min) / 2.

The signed level set of sym (two's-complement range -2^(b-1) .. 2^(b-1)-1 with s = max|x| / 2^(b-1)) was picked
by measured MSE against the midtread and midrise alternatives: docs/FORMATS.md has the numbers and
bench/sym_levels.py reproduces them. A group with s == 0 (all zero, or constant under asym) dequantizes exactly, and
so does a constant group under sym (b >= 2). NaN codes (non-finite input only) become 0.
"""

import torch

from .packing import pack_bits, unpack_bits

MODES = ("sym", "asym", "hybrid")


def _round_half(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float16).to(torch.float32)


def _sym(xg: torch.Tensor, bits: int):
    # xg: fp32 [..., ngroups, G]  ->  codes (same shape, fp32 integers), scale [..., ngroups], deq, sq_error
    off = 2.0 ** (bits - 1)
    amax = xg.abs().amax(-1)
    # a constant non-zero group uses max|x| / 2^(b-2), which puts it exactly on a level (b >= 2; see FORMATS.md)
    constant = (xg.amin(-1) == xg.amax(-1)) & (amax > 0) & (bits >= 2)
    s = _round_half(amax / torch.where(constant, 2.0 ** max(bits - 2, 0), off))
    safe = torch.where(s > 0, s, torch.ones_like(s)).unsqueeze(-1)
    u = torch.where(s.unsqueeze(-1) > 0, (xg / safe).round() + off, torch.full_like(xg, off))
    u = _code(u, bits)
    deq = s.unsqueeze(-1) * u - s.unsqueeze(-1) * off
    return u, s, deq, ((deq - xg) ** 2).sum(-1)


def _code(u: torch.Tensor, bits: int) -> torch.Tensor:
    # clamp to [0, 2^b - 1]; NaN (only in a non-finite group, whose scale is NaN/Inf) becomes code 0
    return torch.nan_to_num(u, nan=0.0).clamp(0, 2**bits - 1)


def _asym(xg: torch.Tensor, bits: int, eta: float = 0.0):
    qmax = 2.0**bits - 1
    mn, mx = xg.amin(-1), xg.amax(-1)
    s = _round_half((mx - mn) / qmax)
    z = _round_half(mn)
    safe = torch.where(s > 0, s, torch.ones_like(s)).unsqueeze(-1)
    u = torch.where(s.unsqueeze(-1) > 0, ((xg - z.unsqueeze(-1)) / safe).round(), torch.zeros_like(xg))
    u = _code(u, bits)
    s_st = _round_half((1 - 2 * eta) * s)  # 1 - 2 eta in double, rounded once to fp32 (as quant.cuh asym_calib)
    z_st = _round_half(z + eta * s * qmax)
    deq = s_st.unsqueeze(-1) * u + z_st.unsqueeze(-1)
    return u, s_st, z_st, deq, ((deq - xg) ** 2).sum(-1)


def quantize_groups(x: torch.Tensor, bits: int, group_size: int, mode: str, eta: float = 0.0):
    """x [..., L]  ->  (codes int32 [..., L*bits/32], scales fp16 [..., L/G], zeros fp16 [..., L/G])."""
    xg = x.to(torch.float32).unflatten(-1, (-1, group_size))  # [..., ngroups, G]
    if mode == "sym":
        u, s, _, _ = _sym(xg, bits)
        scales, zeros = s, torch.zeros_like(s)
    elif mode == "asym":
        u, scales, zeros, _, _ = _asym(xg, bits, eta)
    elif mode == "hybrid":
        u_s, s_s, _, err_s = _sym(xg, bits)
        u_a, s_a, z_a, _, err_a = _asym(xg, bits)
        use_asym = err_a < err_s
        u = torch.where(use_asym.unsqueeze(-1), u_a, u_s)
        # -s_a sets the sign bit even when s_a == 0 (fp16 -0.0), so the mask survives constant groups
        scales = torch.where(use_asym, -s_a, s_s)
        zeros = torch.where(use_asym, z_a, torch.zeros_like(z_a))
    else:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    codes = pack_bits(u.to(torch.int64).flatten(-2), bits)
    return codes, scales.to(torch.float16), zeros.to(torch.float16)


def group_affine(scales: torch.Tensor, zeros: torch.Tensor | None, bits: int, mode: str):
    """Per-group (s, zeff) with x ~= s * u + zeff, as fp32 tensors shaped like scales."""
    s = scales.to(torch.float32)
    if mode == "sym":
        return s, -s * 2.0 ** (bits - 1)
    z = zeros.to(torch.float32)
    if mode == "asym":
        return s, z
    is_asym = torch.signbit(scales)  # the hybrid mask; signbit sees -0.0 as well
    s = s.abs()
    return s, torch.where(is_asym, z, -s * 2.0 ** (bits - 1))


def dequantize_groups(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int, group_size: int, mode: str
) -> torch.Tensor:
    """Inverse of quantize_groups: fp32 [..., L]."""
    u = unpack_bits(codes, bits).to(torch.float32).unflatten(-1, (-1, group_size))  # [..., ngroups, G]
    s, zeff = group_affine(scales, zeros, bits, mode)
    return (s.unsqueeze(-1) * u + zeff.unsqueeze(-1)).flatten(-2)
