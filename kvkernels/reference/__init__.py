"""Pure-PyTorch reference backend: the executable spec of every kvkernels op, and the CPU fallback."""

from .gemv import gemv_inner_q, gemv_kivi
from .packing import pack_bits, unpack_bits
from .quant import dequantize_groups, group_affine, quantize_groups


def quantize_groups_into(x, bits, group_size, mode, eta, codes, scales, zeros) -> None:
    """quantize_groups written into caller buffers (e.g. narrowed views of a preallocated cache)."""
    c, s, z = quantize_groups(x, bits, group_size, mode, eta)
    codes.copy_(c)
    scales.copy_(s)
    zeros.copy_(z)


__all__ = [
    "dequantize_groups",
    "gemv_inner_q",
    "gemv_kivi",
    "group_affine",
    "pack_bits",
    "quantize_groups",
    "quantize_groups_into",
    "unpack_bits",
]
