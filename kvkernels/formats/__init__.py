"""KV cache formats: one module per format behind one protocol (kvkernels.formats.base.Format), and their registry.

Each format module (innerq.py, kivi.py, xquant.py, lattice.py, specache.py, aqua.py) holds its config dataclass,
its layer cache (a QuantizedLayerCache subclass: stores, append rules, the attention hooks) and a Format instance
naming them; the registry below maps format names, config types and preset names to formats. Attention, the
model-level cache, the demo, the bench and the transformers integration go through the registry and never name a
format, so a new format is one module (+ its kernels and tests) and one `register` line (docs/ARCHITECTURE.md,
"Adding a format").

    format_of(config)        the Format of a config instance (TypeError for an unregistered type)
    preset_format(name)      the Format of a preset name (ValueError for an unknown name)
    make_layer_cache(config, batch, num_kv_heads, head_dim, ...)   format_of(config).make_layer_cache(...)
    effective_bits(config, num_layers=None)   format_of(config).effective_bits(config, num_layers)
    PRESETS                  every registered format's presets, in registration order
"""

import torch

from . import aqua, innerq, kivi, lattice, specache, xquant
from .base import MODES, SUPPORTED_BITS, EffectiveBits, Format, QuantizedLayerCache, QuantStore, stores_zeros
from .innerq import InnerQConfig, InnerQLayerCache
from .kivi import KIVIConfig, KIVILayerCache
from .lattice import LatticeConfig, LatticeLayerCache
from .specache import SpeCacheConfig, SpeCacheLayerCache
from .xquant import XQuantConfig, XQuantLayerCache

_FORMATS: dict[str, Format] = {}
PRESETS: dict = {}
_PRESET_FORMAT: dict[str, Format] = {}


def register(fmt: Format) -> Format:
    """Add a format (and its presets) to the registry; returns it. Names and preset names must be new."""
    if not isinstance(fmt, Format):
        raise TypeError(f"register needs a kvkernels.formats.base.Format instance, got {type(fmt).__name__}")
    if fmt.name in _FORMATS:
        raise ValueError(f"a format named {fmt.name!r} is already registered")
    if any(f.config_type is fmt.config_type for f in _FORMATS.values()):
        raise ValueError(f"config type {fmt.config_type.__name__} already belongs to a registered format")
    taken = sorted(set(fmt.presets) & set(PRESETS))
    if taken:
        raise ValueError(f"preset name(s) {taken} already registered")
    for name, cfg in fmt.presets.items():
        if not isinstance(cfg, fmt.config_type):
            raise TypeError(f"preset {name!r} of format {fmt.name!r} is not a {fmt.config_type.__name__}")
    _FORMATS[fmt.name] = fmt
    PRESETS.update(fmt.presets)
    _PRESET_FORMAT.update(dict.fromkeys(fmt.presets, fmt))
    return fmt


def unregister(name: str) -> None:
    """Remove a registered format and its presets (tests register toy formats for one test)."""
    fmt = _FORMATS.pop(name)
    for preset in fmt.presets:
        PRESETS.pop(preset, None)
        _PRESET_FORMAT.pop(preset, None)


def all_formats() -> tuple[Format, ...]:
    """The registered formats, in registration order."""
    return tuple(_FORMATS.values())


def get_format(name: str) -> Format:
    if name not in _FORMATS:
        raise ValueError(f"unknown format {name!r}; registered: {', '.join(_FORMATS)}")
    return _FORMATS[name]


def format_of(config) -> Format:
    """The registered Format of config's type, or of its nearest registered base class (a format may derive its
    config from another format's)."""
    by_type = {fmt.config_type: fmt for fmt in _FORMATS.values()}
    for cls in type(config).__mro__:
        if cls in by_type:
            return by_type[cls]
    types = " or ".join(f.config_type.__name__ for f in _FORMATS.values())
    raise TypeError(f"config must be a registered format's config ({types}), got {type(config).__name__}")


def preset_format(name: str) -> Format:
    if name not in _PRESET_FORMAT:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    return _PRESET_FORMAT[name]


def make_layer_cache(
    config, batch, num_kv_heads, head_dim, capacity=1024, device="cpu", dtype=torch.float16, **options
):
    """One layer's cache for config (any registered format); options: the format's layer_options and context."""
    return format_of(config).make_layer_cache(config, batch, num_kv_heads, head_dim, capacity, device, dtype, **options)


def effective_bits(config, num_layers: int | None = None) -> EffectiveBits:
    """Bits per quantized key/value including fp16 group metadata, averaged over a num_layers-layer model's layers
    (it matters for cross-layer formats only; None: the format's reference depth); windows reported separately.

    Example (G=32, any head_dim): innerq_base K 3.5 / V 3.5; innerq_small 3.5 / 2.5; innerq_hybrid 3.5 / 3.0;
    innerq_asym4 5.0 / 5.0; innerq_asym1_eta 2.0 / 2.0; kivi2 3.0 / 3.0; kivi4 5.0 / 5.0; kivi1_eta 2.0 / 2.0.
    """
    return format_of(config).effective_bits(config, num_layers)


register(innerq.FORMAT)
register(kivi.FORMAT)
register(xquant.FORMAT)
register(lattice.FORMAT)
register(specache.FORMAT)
register(aqua.FORMAT)  # no presets: its configs need calibrated predictors (KVKernelsCache("aqua", predictors=))

__all__ = [
    "MODES",
    "PRESETS",
    "SUPPORTED_BITS",
    "EffectiveBits",
    "Format",
    "InnerQConfig",
    "InnerQLayerCache",
    "KIVIConfig",
    "KIVILayerCache",
    "LatticeConfig",
    "LatticeLayerCache",
    "QuantStore",
    "QuantizedLayerCache",
    "SpeCacheConfig",
    "SpeCacheLayerCache",
    "XQuantConfig",
    "XQuantLayerCache",
    "effective_bits",
    "format_of",
    "all_formats",
    "get_format",
    "make_layer_cache",
    "preset_format",
    "register",
    "stores_zeros",
    "unregister",
]
