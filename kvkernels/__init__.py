"""kvkernels: fused kernels for quantized KV caches in LLM decoding.

Ops live under torch.ops.kvkernels (schemas in csrc/ops.cpp); the typed wrappers below validate their
arguments. kvkernels.reference is the pure-PyTorch spec. kvkernels.backends() says what can run here.
"""

from . import formats, reference
from ._backends import backends
from .attention import decode_attention, reference_decode_attention
from .cache import LayerContext, ModelKVCache
from .formats import *  # noqa: F403 - every format's config and layer cache, PRESETS, the registry (formats.__all__)
from .keynorm import compute_key_norm, fold_key_norm_into_attention
from .ops import (
    aqua_reconstruct,
    dequantize_groups,
    fwht,
    gemv_inner_q,
    gemv_kivi,
    gemv_lattice_k,
    gemv_lattice_v,
    gemv_workspace_numel,
    lattice_dequantize,
    lattice_quantize,
    pack_bits,
    quantize_groups,
    quantize_groups_into,
    unpack_bits,
)
from .static_cache import StaticLayerCache

__version__ = "0.1.0"

__all__ = [
    *formats.__all__,
    "LayerContext",
    "ModelKVCache",
    "StaticLayerCache",
    "backends",
    "compute_key_norm",
    "decode_attention",
    "fold_key_norm_into_attention",
    "reference_decode_attention",
    "aqua_reconstruct",
    "dequantize_groups",
    "fwht",
    "gemv_inner_q",
    "gemv_kivi",
    "gemv_workspace_numel",
    "gemv_lattice_k",
    "gemv_lattice_v",
    "lattice_dequantize",
    "lattice_quantize",
    "pack_bits",
    "quantize_groups",
    "quantize_groups_into",
    "reference",
    "unpack_bits",
]
