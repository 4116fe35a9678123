"""Pure-PyTorch reference backend: the executable spec of every kvkernels op, and the CPU fallback."""

from .aqua import aqua_reconstruct
from .attention import decode_attention_fused
from .gemv import gemv_inner_q, gemv_kivi
from .lattice import (
    fwht,
    gemv_lattice_k,
    gemv_lattice_v,
    lattice_dequantize,
    lattice_quantize,
    pack_lattice_indices,
    unpack_lattice_indices,
)
from .packing import pack_bits, unpack_bits
from .quant import dequantize_groups, group_affine, quantize_groups
from .static_append import static_append


def quantize_groups_into(x, bits, group_size, mode, eta, codes, scales, zeros) -> None:
    """quantize_groups written into caller buffers (e.g. narrowed views of a preallocated cache)."""
    c, s, z = quantize_groups(x, bits, group_size, mode, eta)
    codes.copy_(c)
    scales.copy_(s)
    zeros.copy_(z)


__all__ = [
    "aqua_reconstruct",
    "decode_attention_fused",
    "dequantize_groups",
    "fwht",
    "gemv_inner_q",
    "gemv_kivi",
    "gemv_lattice_k",
    "gemv_lattice_v",
    "group_affine",
    "lattice_dequantize",
    "lattice_quantize",
    "pack_bits",
    "pack_lattice_indices",
    "quantize_groups",
    "quantize_groups_into",
    "static_append",
    "unpack_bits",
    "unpack_lattice_indices",
]
