"""Hugging Face transformers (5.x) integration: a quantized `Cache` whose decode attention runs the fused kernels.

Usage::

    from kvkernels.integrations.transformers import KVKernelsCache

    model.set_attn_implementation("kvkernels")          # or from_pretrained(..., attn_implementation="kvkernels")
    cache = KVKernelsCache("innerq_base", config=model.config)   # overrides: group_size=, w_sink=, w_recent=, bits=...
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=64)

Methods: the presets of kvkernels.formats.PRESETS (innerq_*, kivi*, xquant_*, lattice*: `python -m kvkernels
eval --help` lists them), and "fp16", an unquantized pass-through (the model's dtype) for comparisons.

The handoff between the cache and the attention function
--------------------------------------------------------
A transformers attention layer (LlamaAttention and every model written like it) does

    key, value = past_key_values.update(key_states, value_states, self.layer_idx)
    out, _ = ALL_ATTENTION_FUNCTIONS[config._attn_implementation](self, query, key, value, attention_mask,
                                                                 dropout=..., scaling=self.scaling, **kwargs)

with nothing in between (repeat_kv for GQA happens inside the attention function), and the attention function
is not given the cache (only the module, whose layer_idx it could read, and position_ids). So the cache tells
the attention function what to do through the tensors it returns:

* prefill (the layer's cache was empty, so the query is the whole prompt): `update` quantizes the prompt into
  the layer's kvkernels cache per the method's window rules and returns the full-precision key/value it was
  given; the attention function sees ordinary tensors and runs transformers' SDPA (`sdpa_attention_forward`,
  with the mask from `sdpa_mask`, registered as this implementation's mask function).
* decode (a non-empty cache and at most `max_fused_q_len` new tokens, default 32, which covers assisted
  decoding's candidate chunks up to 31 candidates): `update` appends the new tokens and returns two *handles*:
  empty tensors [B, H_kv, 0, D] of the key's dtype and device carrying a `_kvkernels_layer` attribute that
  points at the KVKernelsLayer. The attention function recognizes the attribute and calls the layer's fused
  decode attention (kvkernels.attention.decode_attention: dequant-GEMVs over the quantized stores + the fp16
  windows, one softmax). No dequantized copy of the cache is handed to the model on this path, and no global
  registry is involved, so several caches (or models) can run side by side. What the GEMVs do with the stores
  depends on the backend serving the ops (op_backends(device) says which):
    - CUDA, compiled kernels or Triton: the GEMVs read the packed codes and scales and dequantize in registers;
      no dequantized K or V exists in memory at any point.
    - CPU: the GEMV ops have no C++ kernel and fall back to the pure-PyTorch reference (kvkernels.reference),
      which dequantizes each store it is given inside the op, per call, into a transient fp32 tensor (n x D
      values per batch row and KV head) that is freed when the op returns. That is correct but not what the GPU
      does, and costs time and memory proportional to the quantized tokens at every step. (So does CUDA when
      neither the compiled kernels nor Triton are available.)
* a non-empty cache given more than `max_fused_q_len` tokens gets the whole dequantized cache back (K, V in the
  model dtype) and SDPA with the mask. That covers larger prefill chunks, a second generate() turn, and assisted /
  prompt-lookup decoding whenever a verification chunk (candidates + 1 tokens) is longer than max_fused_q_len,
  e.g. num_assistant_tokens >= 32, or the "heuristic" schedule growing it by 2 after each fully accepted round:
  those steps are correct but dequantize the cache; raise max_fused_q_len to keep them fused.

Masks: AttentionMaskInterface.register("kvkernels", sdpa_mask) (without a registered mask function transformers
silently drops the mask). Prefill gets exactly what SDPA gets. On the fused path a `None` mask means "causal
among the T new tokens" (decode_attention applies it); a materialized mask (left padding in a batch, or T > 1
with a cache, where sdpa_mask builds a causal one) is applied to the scores of all N cached tokens, in token
order, before the single softmax, so left-padded batches are supported (boolean masks: True = attend; float
masks are added). The windows are positional, though: in a left-padded row the fp16 sink holds padding rather
than that row's first tokens, and the prefill key norm (InnerQ) also sees the padding's keys, so padded rows get
somewhat worse quantization than unpadded ones.

Safety net: with `fused=None` (default) the cache reads `config._attn_implementation` at every decode step; if it
is not "kvkernels" (e.g. the model still runs "sdpa"), handles would be misread as zero-length keys, so `update`
returns the dequantized cache instead, with a one-time warning (correct, but slow: simulated quantization).
fused=False forces that path. With no config given, fused defaults to True; the handles then guard themselves:
they are a tensor subclass on which any torch operation but a metadata read raises, so an attention function
other than "kvkernels" fails at the first decode step with a message naming the fix.

Compiled decoding: KVKernelsStaticCache (below) keeps the same formats in fixed buffers with device-side token
counts after an eager prefill, so generate() compiles its decode step (CUDA graphs under mode="reduce-overhead");
docs/INTEGRATION.md "Compiled decoding".

Generation support: get_seq_length, get_mask_sizes, get_max_length / get_max_cache_shape (-1: unbounded),
reorder_cache (beam search), crop (assisted / prompt-lookup decoding; negative = drop that many tokens, positive
= keep that many, 5.17's legacy meaning), batch_select_indices, batch_repeat_interleave, reset;
is_compileable=False (caches change shape every step) and is_croppable=True (transformers >= 5.24 asks before
assisted decoding: a crop leaves a valid cache, though tokens quantized while the cropped tokens were present stay
so quantized, see kvkernels.formats.base). Works with transformers 5.17+.
Only full-attention layers are supported (no sliding-window / linear-attention layer types).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

try:
    import transformers
    from transformers.cache_utils import Cache, CacheLayerMixin
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface
except ImportError as e:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "kvkernels.integrations.transformers needs Hugging Face transformers>=5.0: "
        f"pip install kvkernels[transformers] ({e})"
    ) from e

if int(transformers.__version__.split(".")[0]) < 5:  # pragma: no cover
    raise ImportError(
        f"kvkernels.integrations.transformers needs transformers>=5.0 (found {transformers.__version__}): "
        "pip install kvkernels[transformers]"
    )

from .. import ops
from .._validate import is_int
from ..cache import ModelKVCache, check_num_layers
from ..formats import PRESETS, all_formats, format_of, preset_format
from ..formats.base import check_capacity
from ..speculative import generate_kwargs
from ..static_cache import StaticLayerCache, static_format_error
from .compat import cache_kwarg

ATTN_IMPLEMENTATION = "kvkernels"
METHODS = (*PRESETS, "fp16")
_HANDLE_ATTR = "_kvkernels_layer"
# a static cache's prefill tags the key it returns with its layer; the attention function tells the layer which
# attention module serves it, and every decode update of the layer puts a weak reference to itself on that module
# (same attribute name), where the attention function of the (compiled) step finds it
_STATIC_ATTR = "_kvkernels_static_layer"


class _LayerRef:
    """A weak reference to a KVKernelsStaticLayer, as its attention module holds it: a dropped cache is freed, and a
    pickled or deep-copied model carries no cache (it pickles as a dead reference; a weakref itself cannot be)."""

    __slots__ = ("_ref",)

    def __init__(self, layer=None):
        self._ref = None if layer is None else weakref.ref(layer)

    def __call__(self):
        return None if self._ref is None else self._ref()

    def __reduce__(self):
        return (_LayerRef, ())


# options that configure the cache object rather than the quantization format
_CACHE_OPTIONS = ("capacity", "fused", "max_fused_q_len", "key_norm_factors", "rope_paired", "num_layers")


# ---------------------------------------------------------------------------------------------------------
# method configs


def method_config(method: str, **overrides):
    """The config of preset `method` with overrides applied (None for "fp16", which ignores quantization overrides).
    `method` may also name a format that has no presets (its default config + overrides, e.g. "aqua" with
    predictors=PATH).

    Overrides are the config's fields (InnerQConfig: key_bits, key_mode, value_bits, value_mode, group_size,
    w_sink, w_recent, key_norm, eta; KIVIConfig: bits, group_size, residual, eta, w_sink), plus each format's
    aliases (Format.aliases) so one set of overrides fits every method: `bits` sets key_bits and value_bits
    (InnerQ), `w_recent` sets residual (KIVI).
    """
    if method == "fp16":
        return None
    if method not in PRESETS:  # read now, not at import: formats registered later count
        # a format whose configs need an argument no preset can carry (AQUA-KV's predictors) is named by its
        # format name, with that argument as an override: KVKernelsCache("aqua", predictors=PATH)
        fmt = next((f for f in all_formats() if f.name == method and not f.presets), None)
        if fmt is not None:
            return fmt.apply_overrides(fmt.config_type(), overrides, label=method)
        others = [f.name for f in all_formats() if not f.presets]
        raise ValueError(f"unknown method {method!r}; choose from {', '.join((*PRESETS, 'fp16', *others))}")
    return preset_format(method).apply_overrides(PRESETS[method], overrides, label=method)


# ---------------------------------------------------------------------------------------------------------
# the decode handle


def _metadata_getters() -> frozenset:
    # what an attention layer may read of its key/value before choosing what to do with them
    props = ("shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "layout", "is_meta", "is_cpu")
    methods = (torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.__repr__, torch.Tensor.__format__)
    return frozenset((*(getattr(torch.Tensor, p).__get__ for p in props), *methods))


_HANDLE_METADATA = _metadata_getters()


class _DecodeHandle(torch.Tensor):
    """The empty [B, H_kv, 0, D] tensor a fused decode step returns from update() (see the module docstring).

    Only the "kvkernels" attention function knows what it means. Any other attention function would read it as
    zero cached tokens and produce plausible garbage, so every torch operation on it but metadata reads raises:
    a model left on SDPA / eager fails at its first decode step instead of generating nonsense.
    """

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _HANDLE_METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", repr(func))
        raise RuntimeError(
            f"kvkernels: a KVKernelsCache decode handle reached {name}(), i.e. an attention implementation other than "
            f"{ATTN_IMPLEMENTATION!r}. Call model.set_attn_implementation({ATTN_IMPLEMENTATION!r}) (or load the model "
            f"with attn_implementation={ATTN_IMPLEMENTATION!r}), or build the cache with config=model.config so it "
            "notices the model's implementation and returns the dequantized cache instead (fused=None)."
        )


# ---------------------------------------------------------------------------------------------------------
# the unquantized pass-through store ("fp16")


class _FullPrecisionLayerCache:
    """K/V [B, H_kv, N, D] in the model dtype, grown by concatenation (DynamicLayer's behaviour), same interface
    as the quantized layer caches so KVKernelsLayer treats every method alike."""

    config = None

    def __init__(self, batch, num_kv_heads, head_dim, device, dtype):
        self.batch, self.num_kv_heads, self.head_dim = batch, num_kv_heads, head_dim
        self.device, self.dtype = torch.device(device), dtype
        self.reset()

    def reset(self) -> None:
        self.keys = torch.zeros(self.batch, self.num_kv_heads, 0, self.head_dim, dtype=self.dtype, device=self.device)
        self.values = self.keys.clone()

    @property
    def seq_len(self) -> int:
        return self.keys.shape[2]

    def prefill(self, k, v) -> None:
        self.append(k, v)

    def append(self, k, v) -> None:
        self.keys = torch.cat([self.keys, k.to(self.dtype)], dim=2)
        self.values = torch.cat([self.values, v.to(self.dtype)], dim=2)

    def dequantized(self):
        return self.keys.float(), self.values.float()

    def crop(self, n: int) -> None:
        n = max(self.seq_len + n, 0) if n < 0 else n
        self.keys, self.values = self.keys[:, :, :n], self.values[:, :, :n]

    def _map(self, fn) -> None:
        self.keys, self.values = fn(self.keys), fn(self.values)
        self.batch = self.keys.shape[0]

    def reorder(self, index) -> None:
        self._map(lambda t: t.index_select(0, index))

    def batch_select(self, index) -> None:
        self._map(lambda t: t.index_select(0, index))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def memory_bytes(self) -> dict[str, int]:
        n = (self.keys.numel() + self.values.numel()) * self.keys.element_size()
        ref = 2 * self.batch * self.num_kv_heads * self.seq_len * self.head_dim * 2
        return {
            "key_quantized": 0,
            "value_quantized": 0,
            "quantized": 0,
            "window": n,
            "total": n,
            "fp16_equivalent": ref,
            "allocated": n,
        }


# ---------------------------------------------------------------------------------------------------------
# the cache


class KVKernelsLayer(CacheLayerMixin):
    """One transformer layer's KV cache: a kvkernels layer cache of the config's format (or the fp16 store),
    created on the first update from the tensors' batch, heads, head_dim, device and dtype, as layer layer_idx of
    model_cache (the KVKernelsCache's ModelKVCache, through which cross-layer formats read their neighbours; a
    private one-layer ModelKVCache when None).

    `cache` is that object (None before the first update); `paths` counts how update served each call:
    prefill (quantize, return full precision for SDPA), fused (append, return handles), dequantized (append,
    return the dequantized cache), full (the fp16 method).
    """

    is_compileable = False
    is_croppable = True  # valid after a crop, not bit-identical to a cache that never saw the cropped tokens
    is_sliding = False

    def __init__(
        self,
        config,
        capacity: int = 256,
        fused: bool | None = None,
        max_fused_q_len: int = 32,
        key_norm_factors: torch.Tensor | None = None,
        rope_paired: bool = True,
        model_config=None,
        layer_idx: int | None = None,
        model_cache: ModelKVCache | None = None,
    ):
        super().__init__()
        if not isinstance(max_fused_q_len, int) or max_fused_q_len < 1:
            raise ValueError(f"max_fused_q_len must be a positive int, got {max_fused_q_len!r}")
        self._format = None if config is None else format_of(config)
        if key_norm_factors is not None and (
            self._format is None or "key_norm_factors" not in self._format.layer_options
        ):
            name = "fp16" if self._format is None else self._format.name
            raise ValueError(f"key_norm_factors does not apply to the {name} format")
        if config is not None and model_cache is None:  # a private cache of the layers up to this one
            model_cache = ModelKVCache(config, num_layers=(layer_idx or 0) + 1)
        self.model_cache = model_cache
        self.config = config
        self.capacity = int(capacity)
        self.fused = fused
        self.max_fused_q_len = max_fused_q_len
        self.key_norm_factors = key_norm_factors
        self.rope_paired = rope_paired
        self.model_config = model_config
        self.layer_idx = layer_idx
        self.cache = None
        self.paths = {"prefill": 0, "fused": 0, "dequantized": 0, "full": 0}
        self._last_update_len = 0
        self._warned = False

    def __repr__(self):
        name = "fp16" if self.config is None else type(self.config).__name__
        return f"{type(self).__name__}({name}, seq_len={self.get_seq_length()})"

    # -- lifecycle -----------------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        cfg = self.config
        if cfg is None:
            self.cache = _FullPrecisionLayerCache(B, H, D, self.device, self.dtype)
        else:
            self.cache = _quantized_layer_cache(self, key_states)
        self.is_initialized = True

    def _matches(self, k: torch.Tensor) -> bool:
        c = self.cache
        return (k.shape[0], k.shape[1], k.shape[3]) == (c.batch, c.num_kv_heads, c.head_dim) and (
            k.device,
            k.dtype,
        ) == (c.device, c.dtype)

    def reset(self) -> None:
        """Forget every token (buffers are kept; a new batch shape rebuilds the cache on the next prefill)."""
        if self.cache is not None:
            self.cache.reset()
        self.paths = dict.fromkeys(self.paths, 0)
        self._last_update_len = 0

    # -- the handoff ---------------------------------------------------------------------------------------------
    def _use_fused(self) -> bool:
        if self.fused is not None:
            return self.fused
        if self.model_config is None:
            return True
        impl = getattr(self.model_config, "_attn_implementation", None)
        if impl == ATTN_IMPLEMENTATION:
            return True
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"KVKernelsCache: the model's attention implementation is {impl!r}, not {ATTN_IMPLEMENTATION!r}, so "
                "decode steps return the dequantized cache to it (correct but slow). Call "
                f"model.set_attn_implementation({ATTN_IMPLEMENTATION!r}) to run the fused kernels.",
                stacklevel=4,
            )
        return False

    def _handle(self, like: torch.Tensor) -> torch.Tensor:
        h = like.new_empty((like.shape[0], like.shape[1], 0, like.shape[3])).as_subclass(_DecodeHandle)
        setattr(h, _HANDLE_ATTR, self)
        return h

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store the new K/V [B, H_kv, n, D]; return what the attention function needs (module docstring)."""
        if self.cache is None or (self.cache.seq_len == 0 and not self._matches(key_states)):
            self.lazy_initialization(key_states, value_states)
        cache, n = self.cache, key_states.shape[2]
        self._last_update_len = n
        if self.config is None:
            cache.append(key_states, value_states)
            self.paths["full"] += 1
            return cache.keys, cache.values
        if cache.seq_len == 0:
            cache.prefill(key_states, value_states)
            self.paths["prefill"] += 1
            return key_states, value_states
        cache.append(key_states, value_states)
        if n <= self.max_fused_q_len and self._use_fused():
            self.paths["fused"] += 1
            return self._handle(key_states), self._handle(value_states)
        self.paths["dequantized"] += 1
        k, v = cache.dequantized()
        return k.to(key_states.dtype), v.to(value_states.dtype)

    def fused_attention(self, query: torch.Tensor, scale: float | None, mask: torch.Tensor | None) -> torch.Tensor:
        """Attention of query [B, H_q, T, D] (the T tokens of the last update) over this layer, [B, H_q, T, D]."""
        T = query.shape[2]
        if T != self._last_update_len:
            raise ValueError(
                f"kvkernels attention: the query has {T} rows but the last update of layer {self.layer_idx} added "
                f"{self._last_update_len} tokens; the handle must be used right after its update"
            )
        scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
        # mask None: causal among the T rows; else it replaces the causal mask (kvkernels.attention.decode_attention)
        return self.cache.attention(query, scale, attn_mask=mask)

    # -- generation API ------------------------------------------------------------------------------------------
    def get_seq_length(self) -> int:
        return 0 if self.cache is None else self.cache.seq_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of the mask for the next query_length tokens: every cached token, from 0."""
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1  # grows without bound

    def get_max_cache_shape(self) -> int:  # the 5.17 name of get_max_length
        return -1

    @property
    def batch_size(self) -> int:
        if self.cache is None:  # hasattr() is then False, as Cache.batch_size expects of uninitialized layers
            raise AttributeError("batch_size: layer not initialized")
        return self.cache.batch

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.get_seq_length() > 0:
            self.cache.reorder(beam_idx.to(self.cache.device))

    def crop(self, tokens_to_remove: int) -> None:
        """crop(-n) drops the last n tokens; crop(n > 0) keeps the first n (5.17's legacy meaning); crop(0): no-op."""
        if tokens_to_remove == 0 or self.cache is None:
            return
        self.cache.crop(int(tokens_to_remove))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.cache is not None:
            self.cache.batch_repeat_interleave(int(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.cache is None:
            return
        idx = torch.as_tensor(indices, device=self.cache.device)
        if idx.dtype == torch.bool:
            idx = idx.nonzero().flatten()
        self.cache.batch_select(idx.long())

    def offload(self):  # the stores are not offloadable; KVKernelsCache never enables offloading
        pass

    def prefetch(self):
        pass

    def memory_bytes(self) -> dict[str, int]:
        return {} if self.cache is None else self.cache.memory_bytes()


class KVKernelsCache(Cache):
    """A transformers Cache of KVKernelsLayer, one per decoder layer.

    KVKernelsCache(method="innerq_base", config=model.config, **overrides)

    method:    a kvkernels.formats.PRESETS name or "fp16" (unquantized pass-through).
    config:    the model config (its decoder text config gives the layer count; its _attn_implementation is
               checked at decode time when fused=None). Without it give num_layers, or layers are added lazily.
    overrides: format fields, see method_config (group_size=, w_sink=, w_recent=, bits=, key_bits=, eta=, ...).
    capacity:  initial token capacity of each layer's quantized stores (they double when full).
    fused:     True: decode steps always return handles (the model must run attn_implementation="kvkernels");
               False: always return the dequantized cache; None: decide from config._attn_implementation.
    max_fused_q_len: appends of more tokens than this (to a non-empty cache) return the dequantized cache.
    key_norm_factors: per-layer fixed InnerQ key norms ([H_kv, D] each; a sequence or {layer_idx: tensor}).
    rope_paired: InnerQ computed key norm pairs channels c and c + D/2 (kvkernels.keynorm).
    """

    def __init__(
        self,
        method: str = "innerq_base",
        config=None,
        *,
        num_layers: int | None = None,
        capacity: int = 256,
        fused: bool | None = None,
        max_fused_q_len: int = 32,
        key_norm_factors: Sequence[torch.Tensor] | Mapping[int, torch.Tensor] | None = None,
        rope_paired: bool = True,
        **overrides,
    ):
        self.method = method
        self.format = method_config(method, **overrides)
        check_capacity(capacity)  # checked again by each layer cache, but only at its first update
        text, num_layers, _ = _model_shape(config, num_layers, self.format)
        self._layer_kwargs = {
            "capacity": capacity,
            "fused": fused,
            "max_fused_q_len": max_fused_q_len,
            "rope_paired": rope_paired,
            "model_config": text,
        }
        self._key_norm_factors = key_norm_factors
        # every layer's cache, one object, so a cross-layer format's layer can read its neighbour (kvkernels.cache)
        self.model_cache = None if self.format is None else ModelKVCache(self.format, num_layers)
        if num_layers is not None:
            super().__init__(layers=[self._new_layer(i) for i in range(num_layers)])
        else:  # Cache.update appends layers on demand, calling this without arguments
            super().__init__(layer_class_to_replicate=lambda: self._new_layer(len(self.layers)))

    def _new_layer(self, idx: int) -> KVKernelsLayer:
        factors = _layer_factors(self._key_norm_factors, idx)
        return KVKernelsLayer(
            self.format, key_norm_factors=factors, layer_idx=idx, model_cache=self.model_cache, **self._layer_kwargs
        )

    def __repr__(self):
        n = self.get_seq_length()
        return f"{type(self).__name__}(method={self.method!r}, layers={len(self.layers)}, seq_len={n})"

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:  # 5.17 name; -1 = unbounded
        return -1

    def crop(self, max_length: int) -> None:
        """Cache.crop, from the top layer down (see ModelKVCache.crop: cross-layer formats read the layer below)."""
        for layer in reversed(self.layers):
            layer.crop(max_length)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if self.layer_class_to_replicate is None and not 0 <= layer_idx < len(self.layers):
            raise ValueError(
                f"KVKernelsCache was built for {len(self.layers)} layers but the model updated layer {layer_idx}; "
                "pass config=model.config (or the model's num_layers)"
            )
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def memory_bytes(self) -> dict[str, int]:
        """Per-layer memory_bytes() summed over the initialized layers (kvkernels.formats.base for the keys)."""
        return _summed(layer.memory_bytes() for layer in self.layers)

    @property
    def paths(self) -> dict[str, int]:
        """How many layer updates took each path (KVKernelsLayer.paths), summed over layers."""
        return _summed(layer.paths for layer in self.layers)


# ---------------------------------------------------------------------------------------------------------
# the static cache: torch.compile / CUDA graphs


class KVKernelsStaticLayer(CacheLayerMixin):
    """One layer of KVKernelsStaticCache. The first update (the prompt, run eagerly) quantizes into a kvkernels
    layer cache exactly as KVKernelsLayer does and hands it to a kvkernels.static_cache.StaticLayerCache: fixed
    buffers for max_cache_len tokens, token counts in a device tensor. Every later update appends one token with
    fixed-shape device ops and returns empty [B, H_kv, 0, D] tensors; the "kvkernels" attention function then runs
    StaticLayerCache.attention (decode_attention_fused's device-lengths form) for the module it bound to this layer
    at the prefill. Nothing of a decode step reads the device on the host, so torch.compile traces it as one graph
    (fullgraph=True) and mode="reduce-overhead" replays it from a CUDA graph.

    `static` is the StaticLayerCache (None before the prefill); `paths` counts prefill and static updates (the
    latter from the device token count when read: a Python counter in the step would be a guard that recompiles).
    """

    is_compileable = True
    is_croppable = False
    is_sliding = False

    def __init__(self, config, max_cache_len, capacity, key_norm_factors, rope_paired, layer_idx, model_cache):
        super().__init__()
        self._format = format_of(config)
        self.config, self.max_cache_len, self.capacity = config, max_cache_len, capacity
        self.key_norm_factors, self.rope_paired = key_norm_factors, rope_paired
        self.layer_idx, self.model_cache = layer_idx, model_cache
        self.cache = None  # the layer cache the prompt is quantized into (taken over by `static`)
        self.static = None
        self._spare = None  # the StaticLayerCache of before a reset(): its buffers take the next prompt
        self._prompt_tokens = 0
        self._module = None  # the attention module that runs this layer (bound by the attention function)
        self._self_ref = _LayerRef(self)  # what the module holds: a dropped cache is not kept alive by the model

    def __repr__(self):
        return f"{type(self).__name__}({type(self.config).__name__}, max_cache_len={self.max_cache_len})"

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.cache = _quantized_layer_cache(self, key_states)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """The prompt: quantize it, return it for SDPA (tagged for the attention function). A decode token: append
        it to the static buffers, return empty tensors (the attention function reads the buffers)."""
        if self.static is None:
            return self._prefill(key_states, value_states)
        if self._module is None:  # the prompt's attention did not run "kvkernels": empty K/V would be read as no tokens
            raise RuntimeError(
                f"KVKernelsStaticCache: layer {self.layer_idx}'s prompt went through an attention implementation "
                f"other than {ATTN_IMPLEMENTATION!r}; call model.set_attn_implementation({ATTN_IMPLEMENTATION!r}) (or "
                f"load the model with attn_implementation={ATTN_IMPLEMENTATION!r}), then cache.reset() and generate "
                "again"
            )
        if key_states.shape[2] != self.static.step_tokens:
            raise ValueError(
                f"KVKernelsStaticCache decodes {self.static.step_tokens} token per step, got {key_states.shape[2]} at "
                f"layer {self.layer_idx}: a new prompt on a used cache needs cache.reset() first (or a new cache); "
                "assisted / prompt-lookup decoding and chunked prefill need KVKernelsCache"
            )
        self.static.append(key_states, value_states)
        # this layer's attention module may serve another static cache's layer meanwhile (two caches on one model):
        # every step says which one it is now
        setattr(self._module, _STATIC_ATTR, self._self_ref)
        B, H, _, D = key_states.shape
        return key_states.new_empty((B, H, 0, D)), value_states.new_empty((B, H, 0, D))

    def _prefill(self, key_states: torch.Tensor, value_states: torch.Tensor):
        if torch.compiler.is_compiling():
            raise RuntimeError(
                "KVKernelsStaticCache: the prompt must be prefilled eagerly (generate() does; compile only the decode "
                "steps)"
            )
        n = key_states.shape[2]
        if n >= self.max_cache_len:
            raise ValueError(
                f"KVKernelsStaticCache(max_cache_len={self.max_cache_len}) cannot hold a {n}-token prompt plus a new "
                "token; build it with a larger max_cache_len"
            )
        self.lazy_initialization(key_states, value_states)
        self.cache.prefill(key_states, value_states)
        spare, self._spare = self._spare, None
        if spare is not None and spare.takes(self.cache):
            spare.load(self.cache)  # the same buffers: a compiled step's CUDA graph replays without re-recording
            self.static, self.cache = spare, spare.cache
        else:
            self.static = StaticLayerCache(self.cache, self.max_cache_len)
        self._prompt_tokens = n
        setattr(key_states, _STATIC_ATTR, self)
        return key_states, value_states

    def fused_attention(self, query: torch.Tensor, scale: float | None, mask: torch.Tensor | None) -> torch.Tensor:
        """Attention of query [B, H_q, 1, D] over this layer's static buffers, [B, H_q, 1, D] (no host read)."""
        if self.static is None:
            raise RuntimeError(f"kvkernels attention: layer {self.layer_idx} of a KVKernelsStaticCache has no prompt")
        scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
        return self.static.attention(query, scale, attn_mask=mask)

    @property
    def paths(self) -> dict[str, int]:
        """Updates per path: the prefill (0 or 1) and the static decode steps (reads the device)."""
        if self.static is None:
            return {"prefill": 0, "static": 0}
        return {"prefill": 1, "static": self.static.seq_len - self._prompt_tokens}

    # -- generation API ------------------------------------------------------------------------------------------
    def get_seq_length(self):
        """Tokens held: a 0-d device tensor once prefilled (as transformers' StaticLayer: no sync), else 0."""
        return 0 if self.static is None else self.static.seq_len_tensor

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """The prompt's SDPA sees the prompt; a decode step's mask spans the max_cache_len token positions."""
        return (query_length, 0) if self.static is None else (self.max_cache_len, 0)

    def get_max_length(self) -> int:
        return self.max_cache_len

    def get_max_cache_shape(self) -> int:
        return self.max_cache_len

    @property
    def batch_size(self) -> int:
        if self.static is None:
            raise AttributeError("batch_size: layer not initialized")
        return self.static.batch

    def reset(self) -> None:
        """Forget every token: the next update is a new prompt, loaded into the same buffers when its batch, heads,
        dtype and device are unchanged (so a compiled step's CUDA graph replays as it is), else into new ones."""
        if self.static is not None:
            self._spare = self.static
        self.cache = self.static = None
        self._module = None

    def _unsupported(self, what: str):
        raise NotImplementedError(
            f"KVKernelsStaticCache does not support {what} (fixed-shape decoding of one token per step): use "
            "KVKernelsCache for beam search, assisted or prompt-lookup decoding"
        )

    def reorder_cache(self, beam_idx):
        self._unsupported("beam search (reorder_cache)")

    def crop(self, tokens_to_remove: int):
        self._unsupported("crop")

    def batch_repeat_interleave(self, repeats: int):
        self._unsupported("batch_repeat_interleave")

    def batch_select_indices(self, indices):
        self._unsupported("batch_select_indices")

    def offload(self):
        pass

    def prefetch(self):
        pass


class KVKernelsStaticCache(Cache):
    """A transformers Cache for compiled decoding: KVKernelsStaticLayer per decoder layer (InnerQ, KIVI, XQuant's
    even layers: formats whose attention is decode_attention_fused over plain stores).

    KVKernelsStaticCache(method="innerq_base", config=model.config, max_cache_len=4096, **overrides)

    generate() prefills the prompt eagerly, then compiles the decode step (it does so for a cache whose
    is_compileable is True: on CUDA by default, elsewhere with compile_config._compile_all_devices):

        model.set_attn_implementation("kvkernels")
        cache = KVKernelsStaticCache("innerq_base", config=model.config, max_cache_len=2048)
        out = model.generate(ids, past_key_values=cache, max_new_tokens=256)          # CUDA graphs on a GPU

    max_cache_len: the most tokens (prompt + generated) a layer holds; buffers are allocated for it at the prefill.
    Past it (the stores' real capacity is max_cache_len plus a step, rounded up to the store's capacity unit) a step
    indexes out of its buffers: an IndexError on CPU, a device-side assert on CUDA, as with transformers' StaticCache.
    The decode steps append one token each: beam search, assisted and prompt-lookup decoding, crop and batch edits
    raise (use KVKernelsCache). A later generate() call continues the cache's conversation (its input_ids the whole
    sequence so far); a new prompt needs cache.reset() first, else the update raises. After reset() the new prompt
    is loaded into the same buffers (StaticLayerCache.load) when batch, heads, dtype and device are unchanged, so
    the compiled step and its CUDA graph replay as they are; a new cache allocates new buffers, which dynamo does not
    recompile for but mode="reduce-overhead" records its graph again for: reuse one cache with reset().
    The cache's layers hold the attention modules that serve them, and a module holds only a weak reference back:
    several caches can share one model, and a dropped cache is freed.
    Other arguments as KVKernelsCache (capacity: the prefill's initial store capacity).
    """

    def __init__(
        self,
        method: str = "innerq_base",
        config=None,
        *,
        max_cache_len: int,
        num_layers: int | None = None,
        capacity: int = 256,
        key_norm_factors: Sequence[torch.Tensor] | Mapping[int, torch.Tensor] | None = None,
        rope_paired: bool = True,
        **overrides,
    ):
        self.method = method
        self.format = method_config(method, **overrides)
        if self.format is None:
            raise ValueError(
                "KVKernelsStaticCache quantizes; for an unquantized static cache use transformers' StaticCache"
            )
        if not is_int(max_cache_len) or max_cache_len < 2:
            raise ValueError(f"max_cache_len must be an int >= 2, got {max_cache_len!r}")
        check_capacity(capacity)
        _, num_layers, head_dim = _model_shape(config, num_layers, self.format)
        if num_layers is None:
            raise ValueError("KVKernelsStaticCache needs config=model.config (or num_layers=)")
        # every layer must be a static layer: probe a one-head model cache of the same depth (no data is read)
        probe = ModelKVCache(self.format, num_layers)
        for i in range(num_layers):
            error = static_format_error(probe.create_layer(i, 1, 1, head_dim or 128, capacity=0))
            if error is not None:
                raise ValueError(f"KVKernelsStaticCache({method!r}), layer {i}: {error}")
        self._max_cache_len = max_cache_len  # transformers 5.17's Cache has a read-only max_cache_len property
        self.model_cache = ModelKVCache(self.format, num_layers)
        layers = [
            KVKernelsStaticLayer(
                self.format,
                max_cache_len,
                capacity,
                _layer_factors(key_norm_factors, i),
                rope_paired,
                i,
                self.model_cache,
            )
            for i in range(num_layers)
        ]
        super().__init__(layers=layers)

    @property
    def max_cache_len(self) -> int:
        return self._max_cache_len

    def __repr__(self):
        n, L = self.max_cache_len, len(self.layers)
        return f"{type(self).__name__}(method={self.method!r}, layers={L}, max_cache_len={n})"

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if not 0 <= layer_idx < len(self.layers):
            raise ValueError(
                f"KVKernelsStaticCache was built for {len(self.layers)} layers but the model updated layer {layer_idx}"
            )
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    @property
    def paths(self) -> dict[str, int]:
        """How many layer updates took each path (prefill, static), summed over layers (reads the device)."""
        return _summed(layer.paths for layer in self.layers)


def _quantized_layer_cache(layer, like: torch.Tensor):
    """The format's layer cache for `layer` (KVKernelsLayer or KVKernelsStaticLayer) shaped like `like` [B, H_kv,
    n, D]: layer layer_idx of its ModelKVCache, with the layer options its format takes."""
    B, H, _, D = like.shape
    options = {"key_norm_factors": layer.key_norm_factors, "rope_paired": layer.rope_paired}
    options = {k: v for k, v in options.items() if k in layer._format.layer_options and v is not None}
    idx = 0 if layer.layer_idx is None else layer.layer_idx
    return layer.model_cache.create_layer(idx, B, H, D, like.device, like.dtype, capacity=layer.capacity, **options)


def _model_shape(config, num_layers, format_config) -> tuple:
    """(decoder text config or None, layer count, head_dim or None) for a cache built with config= / num_layers=;
    checks now what the first update inside generate() would find out."""
    check_num_layers(num_layers)
    text = config.get_text_config(decoder=True) if config is not None else None
    if text is None:
        return None, num_layers, None
    _check_model_config(text, format_config)
    if num_layers is not None and num_layers != text.num_hidden_layers:
        raise ValueError(
            f"num_layers={num_layers} but the model config has {text.num_hidden_layers} layers; "
            "leave num_layers out when config= is given"
        )
    return text, text.num_hidden_layers, _head_dim(text)


def _head_dim(text) -> int:
    return getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads


def _layer_factors(factors, idx: int):
    """Layer idx's fixed InnerQ key norm from a per-layer sequence or {layer_idx: tensor} (None: computed)."""
    if factors is None:
        return None
    if isinstance(factors, Mapping):
        return factors.get(idx)
    if idx >= len(factors):
        raise ValueError(
            f"key_norm_factors holds {len(factors)} layers' factors but the model has layer {idx}: give one per "
            "decoder layer, or a {layer_idx: tensor} mapping"
        )
    return factors[idx]


def _summed(dicts) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in dicts:
        for key, val in d.items():
            out[key] = out.get(key, 0) + val
    return out


def _check_model_config(text, format_config) -> None:
    """Reject, at construction, a model whose layers the cache cannot serve (text: the decoder text config)."""
    layer_types = getattr(text, "layer_types", None)
    if layer_types:  # authoritative where present (Qwen2 sets sliding_window but uses it on no layer)
        other = sorted({t for t in layer_types if t != "full_attention"})
        if other:
            raise NotImplementedError(f"KVKernelsCache supports full-attention layers only; this model has {other}")
    elif getattr(text, "sliding_window", None) is not None and getattr(text, "use_sliding_window", True):
        raise NotImplementedError(
            f"KVKernelsCache supports full-attention layers only; this model uses a sliding window of "
            f"{text.sliding_window} tokens"
        )
    if format_config is not None:
        format_of(format_config).check_head_dim(format_config, _head_dim(text))


# ---------------------------------------------------------------------------------------------------------
# attention and mask functions


def kvkernels_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The "kvkernels" attention implementation: fused decode attention for handles, transformers SDPA otherwise.

    query [B, H_q, T, D]; returns ([B, T, H_q, D], None) like every transformers attention function.
    """
    eager = not torch.compiler.is_compiling()
    layer = getattr(key, _HANDLE_ATTR, None) if eager else None
    if layer is None and key.shape[2] == 0:  # a static cache's decode step: the layer its update put here
        ref = getattr(module, _STATIC_ATTR, None)
        layer = ref() if ref is not None else None
        if layer is None:
            raise RuntimeError(
                "kvkernels attention: empty keys, and no KVKernelsStaticCache layer bound to this module"
            )
    if layer is None:
        if eager and (static := getattr(key, _STATIC_ATTR, None)) is not None:
            static._module = module  # a static cache's prefill: its decode updates bind themselves here
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    for name in ("softcap", "position_bias", "s_aux", "sinks"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"kvkernels attention does not support {name}")
    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError("kvkernels attention does not support sliding-window layers")
    out = layer.fused_attention(query, scaling, attention_mask)  # [B, H_q, T, D]
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register "kvkernels" with transformers' AttentionInterface and AttentionMaskInterface (done on import)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, kvkernels_attention_forward)
    # prefill runs SDPA, so it needs SDPA's mask; on the fused path None means causal (see the module docstring)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


register()


def set_kvkernels_attention(model) -> str:
    """Switch `model` to attn_implementation="kvkernels"; returns the previous implementation (to restore)."""
    previous = model.config._attn_implementation
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    else:  # pragma: no cover - every 5.x PreTrainedModel has it
        model.config._attn_implementation = ATTN_IMPLEMENTATION
    return previous


# ---------------------------------------------------------------------------------------------------------
# convenience for the demo, the eval and the bench


def op_backends(device: torch.device | str) -> dict[str, str]:
    """Which implementation serves each kvkernels op for tensors on `device` (cuda / triton / cpp / reference)."""
    device = torch.device(device)
    if device.type == "cuda":
        return dict(ops.CUDA_IMPL)
    out = {}
    for op in ops.OPS:
        # kvkernels.ops registers the Python reference where C++ has no CPU kernel; the dispatcher says which
        dump = torch._C._dispatch_dump(f"kvkernels::{op}")
        line = next((ln for ln in dump.splitlines() if ln.startswith("CPU:")), "")
        out[op] = "reference" if ("torch/library.py" in line or not line) else "cpp"
    return out


@dataclass
class GenerationResult:
    """What generate_with_method returns.

    sequences: [B, prompt + new] token ids; logits: [B, new, vocab] fp32 (the scores of each generated
    position, before sampling processors); cache: the KVKernelsCache (memory_bytes(), paths, layers);
    backend: method, attention implementation, device, per-op implementation, and path counts.
    """

    sequences: torch.Tensor
    logits: torch.Tensor
    cache: KVKernelsCache
    backend: dict = field(default_factory=dict)


@torch.no_grad()
def generate_with_method(model, input_ids: torch.Tensor, method: str, **kw) -> GenerationResult:
    """Greedy-generate with a KVKernelsCache of `method` on the fused path; returns a GenerationResult.

    kw: format overrides (method_config) and KVKernelsCache options (capacity, fused, max_fused_q_len,
    key_norm_factors, rope_paired) go to the cache; everything else goes to model.generate (max_new_tokens
    defaults to 32, do_sample to False). The model runs attn_implementation="kvkernels" for the call and is
    restored afterwards.
    """
    format_fields = _format_fields()
    cache_kw = {k: v for k, v in kw.items() if k in _CACHE_OPTIONS or k in format_fields}
    gen_kw = {k: v for k, v in kw.items() if k not in cache_kw}
    if method == "fp16":  # no format: quantization overrides are dropped so one kwargs set fits every method
        cache_kw = {k: v for k, v in cache_kw.items() if k in _CACHE_OPTIONS and k != "key_norm_factors"}
    gen_kw.setdefault("max_new_tokens", 32)
    gen_kw.setdefault("do_sample", False)
    previous = set_kvkernels_attention(model)
    try:
        cache = KVKernelsCache(method, config=model.config, **cache_kw)
        gen_kw = generate_kwargs(cache) | gen_kw  # a speculative format's two-row loop (kvkernels.speculative)
        out = model.generate(
            input_ids, **{cache_kwarg(): cache}, return_dict_in_generate=True, output_logits=True, **gen_kw
        )
    finally:
        if previous != ATTN_IMPLEMENTATION and hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(previous)
    logits = torch.stack([x.float() for x in out.logits], dim=1)
    backend = {
        "method": method,
        "attn_implementation": ATTN_IMPLEMENTATION,
        "device": str(input_ids.device),
        "ops": op_backends(input_ids.device),
        "paths": cache.paths,
    }
    return GenerationResult(sequences=out.sequences, logits=logits, cache=cache, backend=backend)


def _format_fields() -> frozenset[str]:
    # every override name of every registered format (routes kwargs in generate_with_method)
    return frozenset().union(*(fmt.override_names() for fmt in all_formats()))


__all__ = [
    "ATTN_IMPLEMENTATION",
    "METHODS",
    "GenerationResult",
    "KVKernelsCache",
    "KVKernelsLayer",
    "KVKernelsStaticCache",
    "KVKernelsStaticLayer",
    "generate_with_method",
    "kvkernels_attention_forward",
    "method_config",
    "op_backends",
    "register",
    "set_kvkernels_attention",
]
