"""The model-level cache: every layer's quantized KV cache of one model, and the context cross-layer formats read.

A layer cache (kvkernels.formats.base.QuantizedLayerCache: one layer's keys and values, with its own windows and
stores) is all a single-layer format such as InnerQ or KIVI needs, and it can be used on its own. Cross-layer
formats also read another layer: AQUA-KV predicts layer l from layer l-1's reconstruction, XQuant's odd layers
reuse the even layer's codes. ModelKVCache owns one layer cache per layer and creates each with a LayerContext
(its index, and read access to the other layers' caches); the format's make_layer_cache receives it, and a
cross-layer layer cache keeps it. The per-layer API is unchanged: append / attention / dequantized / crop ...
on a layer cache, or the same through ModelKVCache with a layer index.

Layers are appended in layer order within a step (as a transformer's forward does), so layer l may read what
layer l-1 wrote in the same step. The transformers integration (kvkernels.integrations.transformers) keeps one
ModelKVCache per KVKernelsCache; docs/ARCHITECTURE.md, "Adding a format", shows a cross-layer format plugged in.
"""

import torch

from ._validate import is_int
from .formats import format_of


def check_num_layers(num_layers) -> None:
    """A model's layer count: a positive int, or None where it is not known (layers are then added as they come)."""
    if num_layers is not None and (not is_int(num_layers) or num_layers < 1):
        raise ValueError(f"num_layers must be a positive int or None, got {num_layers!r}")


class LayerContext:
    """What one layer cache may read of the model it belongs to: its index and the other layers' caches."""

    def __init__(self, model: "ModelKVCache", layer_idx: int):
        self.model, self.layer_idx = model, layer_idx

    def layer(self, idx: int):
        """Layer idx's cache, or None if it does not exist (yet). Read it; never write another layer."""
        layers = self.model.layers
        return layers[idx] if 0 <= idx < len(layers) else None

    @property
    def num_layers(self) -> int | None:
        """The model's layer count, or None when it grows as layers are created."""
        return self.model.num_layers

    @property
    def scratch(self) -> dict:
        """A dict the model's layers share for transient hand-offs within a step (AQUA-KV's mode (a) passes its
        per-step rebuild up through it, each layer's replacing the one below's, so only two are alive at a time).
        Entries say who wrote them and for which state; a reader checks that before using one."""
        return self.model.scratch

    def __repr__(self):
        return f"LayerContext(layer {self.layer_idx} of {len(self.model.layers)})"


class ModelKVCache:
    """Every layer's KV cache of one model in one format (any registered config).

    ModelKVCache(config, num_layers=None, capacity=1024, **layer_options)

    num_layers: the model's layer count (None: the list grows as layers are created).
    capacity, layer_options: passed to each layer's make_layer_cache (layer_options: the format's, e.g. InnerQ's
    rope_paired); create_layer can override them per layer (e.g. one key_norm_factors tensor per layer).
    Layers are created explicitly (create_layer) or on their first append, from the K/V it is given.
    """

    def __init__(self, config, num_layers: int | None = None, *, capacity: int = 1024, **layer_options):
        self.format = format_of(config)
        check_num_layers(num_layers)
        self.config, self.capacity, self.layer_options = config, capacity, layer_options
        self.layers: list = [None] * (num_layers or 0)
        self.scratch: dict = {}  # LayerContext.scratch
        self._fixed = num_layers is not None

    def __repr__(self):
        made = sum(layer is not None for layer in self.layers)
        return f"ModelKVCache({self.format.name}, layers={len(self.layers)} ({made} created), seq_len={self.seq_len})"

    @property
    def num_layers(self) -> int | None:
        """The model's layer count, or None when it was not given (the list grows as layers are created)."""
        return len(self.layers) if self._fixed else None

    def _check_idx(self, idx: int) -> None:
        if not isinstance(idx, int) or idx < 0 or (self._fixed and idx >= len(self.layers)):
            raise IndexError(f"layer index {idx!r} out of range for a {len(self.layers)}-layer ModelKVCache")

    def context(self, idx: int) -> LayerContext:
        return LayerContext(self, idx)

    def create_layer(self, idx, batch, num_kv_heads, head_dim, device="cpu", dtype=torch.float16, **options):
        """(Re)create layer idx's cache, empty; options override the constructor's capacity / layer_options."""
        self._check_idx(idx)
        if idx >= len(self.layers):
            self.layers.extend([None] * (idx + 1 - len(self.layers)))
        kw = {"capacity": self.capacity, **self.layer_options, **options}
        capacity = kw.pop("capacity")
        self.layers[idx] = self.format.make_layer_cache(
            self.config, batch, num_kv_heads, head_dim, capacity, device, dtype, context=self.context(idx), **kw
        )
        return self.layers[idx]

    def layer(self, idx: int):
        """Layer idx's cache (None before it is created)."""
        self._check_idx(idx)
        return self.layers[idx] if idx < len(self.layers) else None

    # -- the per-layer API, by layer index --------------------------------------------------------------------
    def append(self, idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append K/V [B, H_kv, n, D] to layer idx, creating it from their shape, device and dtype if needed."""
        cache = self.layer(idx)
        if cache is None:
            if k.dim() != 4:
                raise ValueError(f"k must be [B, H_kv, n, D], got shape {list(k.shape)}")
            dtype = k.dtype if k.dtype in (torch.float16, torch.bfloat16, torch.float32) else torch.float16
            cache = self.create_layer(idx, k.shape[0], k.shape[1], k.shape[3], k.device, dtype)
        cache.append(k, v)

    def attention(self, idx: int, q: torch.Tensor, scale: float | None = None, attn_mask=None) -> torch.Tensor:
        """Decode attention of q [B, H_q, T, D] over layer idx (kvkernels.attention.decode_attention)."""
        cache = self.layer(idx)
        if cache is None:
            raise ValueError(f"layer {idx} has no cache yet: append its K/V first")
        return cache.attention(q, scale, attn_mask)

    def _created(self):
        return [layer for layer in self.layers if layer is not None]

    @property
    def seq_len(self) -> int:
        """Tokens held by the first created layer (0 if none)."""
        created = self._created()
        return created[0].seq_len if created else 0

    def reset(self) -> None:
        for layer in self._created():
            layer.reset()
        self.scratch.clear()

    def crop(self, n: int) -> None:
        # from the top layer down: a cross-layer layer may read the layer below while it crops (XQuant's borrowed
        # codes of a token group it dequantizes back into its window), so the layer below must still hold them
        for layer in reversed(self._created()):
            layer.crop(n)

    def reorder(self, index) -> None:
        for layer in self._created():
            layer.reorder(index)

    def memory_bytes(self) -> dict[str, int]:
        """Every created layer's memory_bytes(), summed."""
        total: dict[str, int] = {}
        for layer in self._created():
            for key, val in layer.memory_bytes().items():
                total[key] = total.get(key, 0) + val
        return total
