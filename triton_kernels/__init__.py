"""Triton backend (installed as kvkernels.triton_kernels). Same signatures as kvkernels.reference.

Runs on CUDA, and on CPU under TRITON_INTERPRET=1, which is how CI tests it.
"""

from .aqua import aqua_reconstruct
from .decode_attention import decode_attention_fused
from .gemv_inner_q import gemv_inner_q
from .gemv_kivi import gemv_kivi
from .lattice import fwht, gemv_lattice_k, gemv_lattice_v, lattice_dequantize, lattice_quantize
from .quantize import dequantize_groups, quantize_groups, quantize_groups_into

__all__ = [
    "aqua_reconstruct",
    "decode_attention_fused",
    "dequantize_groups",
    "fwht",
    "gemv_inner_q",
    "gemv_kivi",
    "gemv_lattice_k",
    "gemv_lattice_v",
    "lattice_dequantize",
    "lattice_quantize",
    "quantize_groups",
    "quantize_groups_into",
]
