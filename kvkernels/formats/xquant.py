"""XQuant (arXiv 2510.11236): KIVI layouts at 1-2 bits, eta-calibrated zero/scale, codes shared across layer pairs.

Per layer l of an L-layer model (kq, vq, km, vm are layer indices; docs/FORMATS.md, "XQuant"):

    key bits    2 if l < kq else 1            value bits   2 if l < vq else 1
    key codes   borrowed from layer l - 1 if l is odd and l >= km, else its own   (values: vm)
    eta         eta2 for 2-bit tensors, eta1 for 1-bit ones (z' = z + eta s (2^b - 1), s' = (1 - 2 eta) s)

Layers pair up as (2j, 2j + 1): the even layer quantizes its keys / values as KIVI does (keys per channel in
groups of G tokens, values per token in groups of G channels, asym, an fp16 residual window) and owns the codes;
the odd layer, from km (keys) / vm (values) on, quantizes its own K/V only to get its own calibrated zero and scale
for the same groups, stores those and no codes, and reads back as  owner_codes * s'_l + z'_l  (the paper's
"accelerated" form with G = 2, k = 0, Table 6, and the public code; its Algorithm 1 swaps codes and parameters).
Decode runs the existing gemv_kivi with the owner's codes (views of its store, no copy) and the layer's own scales.

An owner and its borrower must use one bit width; the paper's code never checks, its configs put kq, vq, km, vm on
even layers. Here a plan that pairs different widths is an error.

Thresholds are given for a `ref_layers`-layer model (the paper's 32) and scaled to the model's layer count, rounded
to even layers; ref_layers=None takes them as absolute indices. A layer cache made without a model context (no
ModelKVCache) is layer 0 of a ref_layers-layer model: it owns its codes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._validate import is_int
from .base import (
    EffectiveBits,
    QuantizedLayerCache,
    QuantStore,
    check_eta,
    check_group_size,
    check_window,
)
from .kivi import KIVIFormat


def _check_layer_index(name: str, val) -> None:
    if not is_int(val) or val < 0:
        raise ValueError(f"{name} must be a layer index >= 0, got {val!r}")


@dataclass(frozen=True)
class XQuantConfig:
    """XQuant cache format.

    kq / vq:     layers below are 2-bit (keys / values), the rest 1-bit.
    km / vm:     odd layers from here on borrow the codes of the layer below (keys / values).
    ref_layers:  the layer count kq..vm refer to; scaled to the model's (rounded to even), None = absolute.
    eta1 / eta2: calibration of 1-bit / 2-bit tensors, in [0, 0.5).
    group_size, residual, w_sink: as KIVIConfig (residual: most recent tokens in fp16).
    """

    kq: int = 30
    vq: int = 2
    km: int = 32
    vm: int = 16
    ref_layers: int | None = 32
    eta1: float = 0.2
    eta2: float = 0.05
    group_size: int = 32
    residual: int = 128
    w_sink: int = 0

    def __post_init__(self):
        for name in ("kq", "vq", "km", "vm"):
            _check_layer_index(name, getattr(self, name))
        if self.ref_layers is not None:
            if not isinstance(self.ref_layers, int) or isinstance(self.ref_layers, bool) or self.ref_layers < 1:
                raise ValueError(f"ref_layers must be a positive int or None, got {self.ref_layers!r}")
            over = [n for n in ("kq", "vq", "km", "vm") if getattr(self, n) > self.ref_layers]
            if over:
                raise ValueError(f"{over} exceed ref_layers={self.ref_layers}")
        check_eta(self.eta1)
        check_eta(self.eta2)
        check_group_size(self.group_size)
        check_window("residual", self.residual)
        check_window("w_sink", self.w_sink)
        # a plan for ref_layers (or the thresholds' own range) must be valid: found now rather than at a layer
        layer_plan(self, self.ref_layers or max(self.kq, self.vq, self.km, self.vm, 1))

    # The uniform view the Format protocol reads (layer 0's widths; layer_plan has every layer's)
    @property
    def key_bits(self) -> int:
        return 2 if self.kq > 0 else 1

    @property
    def value_bits(self) -> int:
        return 2 if self.vq > 0 else 1

    key_mode = property(lambda self: "asym")
    value_mode = property(lambda self: "asym")

    @property
    def w_recent(self) -> int:
        return self.residual

    def eta_for(self, mode: str) -> float:  # per tensor in layer_plan; this is layer 0's key eta
        return self.eta2 if self.key_bits == 2 else self.eta1


@dataclass(frozen=True)
class TensorPlan:
    """One tensor (keys or values) of one layer: its bits, eta, and the layer whose codes it reads."""

    bits: int
    eta: float
    code_layer: int  # this layer (owner) or the one below (borrower)

    def borrows(self, layer: int) -> bool:
        return self.code_layer != layer


def _scaled(t: int, config: XQuantConfig, num_layers: int) -> int:
    if config.ref_layers is None:
        return min(t, num_layers)
    return min(2 * round(t * num_layers / config.ref_layers / 2), num_layers)  # nearest even layer


def layer_plan(config: XQuantConfig, num_layers: int) -> list[tuple[TensorPlan, TensorPlan]]:
    """(key plan, value plan) of every layer of a num_layers-layer model; ValueError if a sharing pair mixes widths."""
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
    kq, vq, km, vm = (_scaled(getattr(config, n), config, num_layers) for n in ("kq", "vq", "km", "vm"))
    plans = []
    for layer in range(num_layers):
        pair = []
        for what, q, m in (("key", kq, km), ("value", vq, vm)):
            width = lambda idx, q=q: 2 if idx < q else 1  # noqa: E731  (layers below q are 2-bit)
            bits = width(layer)
            borrows = layer % 2 == 1 and layer >= m
            if borrows and width(layer - 1) != bits:
                name = "kq" if what == "key" else "vq"
                raise ValueError(
                    f"xquant: layer {layer} borrows the {what} codes of layer {layer - 1}, but {name}={q} makes them "
                    f"{bits}-bit and {3 - bits}-bit; a sharing pair needs one width: put {name} on an even layer"
                    + (
                        f" (it is {getattr(config, name)} for ref_layers={config.ref_layers})"
                        if config.ref_layers
                        else ""
                    )
                )
            pair.append(TensorPlan(bits, config.eta2 if bits == 2 else config.eta1, layer - 1 if borrows else layer))
        plans.append(tuple(pair))
    return plans


def _plan_for(config: XQuantConfig, num_layers: int | None):
    # the plan of a num_layers-layer model, or of the reference depth the thresholds are given for
    return layer_plan(config, num_layers or config.ref_layers or 32)


def paper_equivalent_bits(config: XQuantConfig, num_layers: int | None = None) -> float:
    """The paper's equivalent bit width (App. A): code bits per value averaged over layers and K/V, no metadata.

    Every layer that owns its codes counts its bits, a borrower 0: a 2-bit shared pair is 1 bit per layer, a
    1-bit shared pair 0.5. kq=30, vq=2, km=32, vm=16 on 32 layers gives 1.375 (the paper's "1.38").
    """
    plans = _plan_for(config, num_layers)
    owned = sum(p.bits for layer, pair in enumerate(plans) for p in pair if not p.borrows(layer))
    return owned / (2 * len(plans))


def stored_bits(config: XQuantConfig, num_layers: int | None = None) -> tuple[float, float]:
    """(key, value) bits per quantized value actually stored, averaged over layers: each layer's own codes (none for
    a borrower) plus its fp16 zero and scale per group (2 x 16 / G: borrowers keep their own)."""
    plans = _plan_for(config, num_layers)
    meta = 32.0 / config.group_size

    def mean(i: int) -> float:
        return sum((0 if p[i].borrows(layer) else p[i].bits) + meta for layer, p in enumerate(plans)) / len(plans)

    return mean(0), mean(1)


# ---------------------------------------------------------------------------------------------------------
# the borrower's store


class BorrowedCodesStore(QuantStore):
    """A QuantStore that keeps only its own scales and zeros; its codes are another layer's store's, read in place.

    write(x) quantizes x to get the zero/scale of the same groups the owner used (its codes are dropped);
    views() returns (owner codes, own scales, own zeros), so dequantize and the GEMVs need nothing new.
    owner: () -> the owner's QuantStore (looked up at each use: the owner layer may be recreated).
    """

    def __init__(self, owner, layout, bits, group_size, mode, eta, batch, heads, head_dim, capacity, device):
        self._owner = owner
        super().__init__(layout, bits, group_size, mode, eta, batch, heads, head_dim, capacity, device)

    def _alloc(self, batch: int, cap: int):
        _, scales, zeros = super()._alloc(batch, cap)
        codes = torch.zeros(*scales.shape[:3], 0, dtype=torch.int32, device=self.device)  # no code buffer
        return codes, scales, zeros

    def _owner_codes(self, lo: int, hi: int) -> torch.Tensor:
        owner = self._owner()
        if owner is None or owner.n < hi:
            have = "no cache" if owner is None else f"{owner.n} quantized tokens"
            raise RuntimeError(
                f"xquant: this layer reads the codes of tokens [{lo}, {hi}) of the layer below, which has {have}; "
                "layers must be appended in order within a step and cropped from the top (ModelKVCache does both)"
            )
        if owner.bits != self.bits or owner.layout != self.layout or owner.group_size != self.group_size:
            raise RuntimeError("xquant: the owner layer's store does not match this layer's (bits, layout, group)")
        return owner.views(lo, hi)[0]

    def views(self, lo: int = 0, hi: int | None = None):
        hi = self.n if hi is None else hi
        _, scales, zeros = super().views(lo, hi)
        return self._owner_codes(lo, hi), scales, zeros

    def write(self, x: torch.Tensor) -> None:
        if x.shape[2]:  # the owner must have quantized these tokens (the same groups) already
            self._owner_codes(self.n, self.n + x.shape[2])
        super().write(x)

    def _codes_out(self, codes: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        # the codes are scratch: only this layer's zero and scale are kept
        return torch.empty(src.shape[:-1] + (src.shape[-1] // 32 * self.bits,), dtype=torch.int32, device=src.device)

    def used_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in QuantStore.views(self)[1:] if t is not None)


# ---------------------------------------------------------------------------------------------------------
# the layer cache and the format


class XQuantLayerCache(QuantizedLayerCache):
    """One layer of an XQuant cache: KIVI's stores with this layer's widths and eta, or borrowed codes.

    `plan` is (key TensorPlan, value TensorPlan) of this layer; layer_idx and num_layers come from the context
    (a ModelKVCache with a known layer count), or are 0 and ref_layers for a standalone layer.
    """

    format: XQuantFormat  # set below

    def __init__(
        self, config, batch, num_kv_heads, head_dim, capacity=1024, device="cpu", dtype=torch.float16, *, context=None
    ):
        if not isinstance(config, XQuantConfig):
            raise TypeError(f"XQuantLayerCache needs an XQuantConfig, got {type(config).__name__}")
        if context is None:
            self.layer_idx, num_layers = 0, config.ref_layers or 1
        else:
            self.layer_idx, num_layers = context.layer_idx, context.model.num_layers
            if num_layers is None:
                raise ValueError(
                    "xquant: the model-level cache must know the layer count to plan the layers "
                    "(ModelKVCache(config, num_layers=...), or KVKernelsCache(..., config=model.config))"
                )
            if not context.model.layers or not getattr(context.model, "_fixed", True):
                raise ValueError("xquant: the model-level cache must know the layer count (ModelKVCache(num_layers=))")
        self.plan = layer_plan(config, num_layers)[self.layer_idx]
        super().__init__(config, batch, num_kv_heads, head_dim, capacity, device, dtype, context=context)

    def _make_store(self, tensor, layout, bits, group_size, mode, eta, batch, heads, head_dim, capacity, device):
        plan = self.plan[0 if tensor == "key" else 1]
        args = (layout, plan.bits, group_size, "asym", plan.eta, batch, heads, head_dim, capacity, device)
        if not plan.borrows(self.layer_idx):
            return QuantStore(*args)
        ctx, attr = self.context, f"{tensor}_store"

        def owner():
            layer = ctx.layer(plan.code_layer)
            return None if layer is None else getattr(layer, attr)

        return BorrowedCodesStore(owner, *args)

    def __repr__(self):
        k, v = (describe_plan(p, self.layer_idx) for p in self.plan)
        return f"XQuantLayerCache(layer {self.layer_idx}, K {k}, V {v}, seq_len={self.seq_len})"


def describe_plan(plan: TensorPlan, layer: int) -> str:
    return f"{plan.bits}b eta {plan.eta:g}" + (f" codes of layer {plan.code_layer}" if plan.borrows(layer) else "")


class XQuantFormat(KIVIFormat):
    name = "xquant"
    config_type = XQuantConfig
    layer_cache_type = XQuantLayerCache
    presets = {
        # the paper's Mistral setting (Table 3, "1.38": 1.375 equivalent bits), eta from its Table 4 ablation
        "xquant_1.38": XQuantConfig(kq=30, vq=2, km=32, vm=16),
        # 1.15625 equivalent bits (Table 7's width; its thresholds are not given): keys 2-bit below 20,
        # values 1-bit everywhere and shared from layer 12
        "xquant_1.16": XQuantConfig(kq=20, vq=0, km=32, vm=12),
    }
    aliases = {"w_recent": ("residual",)}
    bench_presets = ()
    dequant_baselines = ()

    def effective_bits(self, config, num_layers: int | None = None) -> EffectiveBits:
        """Stored bits per K/V value averaged over the layers of a num_layers-layer model (default ref_layers; see
        stored_bits); paper_equivalent_bits is the paper's count without the metadata."""
        k, v = stored_bits(config, num_layers)
        G = config.group_size
        window = config.w_sink + config.w_recent
        return EffectiveBits(
            key=k, value=v, average=(k + v) / 2, fp16_key_tokens=window + G - 1, fp16_value_tokens=window
        )

    def describe(self, config) -> str:
        eq = paper_equivalent_bits(config)
        return (
            f"K 2b < {config.kq}, V 2b < {config.vq}, share K >= {config.km}, V >= {config.vm} (of "
            f"{config.ref_layers or 'abs.'}), eta {config.eta1:g}/{config.eta2:g}; paper bits {eq:.3f}"
        )


FORMAT = XQuantFormat()
XQuantLayerCache.format = FORMAT

__all__ = [
    "FORMAT",
    "BorrowedCodesStore",
    "TensorPlan",
    "XQuantConfig",
    "XQuantFormat",
    "XQuantLayerCache",
    "layer_plan",
    "paper_equivalent_bits",
    "stored_bits",
]
