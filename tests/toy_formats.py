"""A toy cross-layer format for the protocol tests: odd layers reuse the even layer's key codes with their own scales.

This is how a cross-layer format (XQuant's shared codes, AQUA-KV's predictors) plugs into kvkernels, reduced to
the least that exercises every part of the protocol (docs/ARCHITECTURE.md, "Adding a format"):

* a config (SharedKeyCodesConfig: InnerQ's fields, keys sym) and a Format subclass, registered with one line;
* make_layer_cache receives the model-level LayerContext and picks the layer cache by layer parity;
* even layers are plain InnerQ layers; an odd layer's key store (SharedKeyCodesStore) holds no codes: token t's
  key group is  own_scale[t, g] * level(codes of layer l-1 at t, g),  with own_scale the least-squares fit of
  this layer's (normalized) keys to the partner's code levels. Values are the layer's own, as in InnerQ;
* the attention hooks need nothing new: the inherited quantized_key_scores hands the store's views (the
  partner's codes, its own scales) to gemv_inner_q, so the fused GEMV reads the shared codes in place.

Layers are appended in layer order within a step (a transformer's forward does), and both layers of a pair share
the config, so when layer 2i+1 quantizes tokens [a, b) layer 2i has quantized them already in the same step.
"""

from dataclasses import dataclass

import torch

from kvkernels import ops
from kvkernels.formats.innerq import InnerQConfig, InnerQFormat, InnerQLayerCache


@dataclass(frozen=True)
class SharedKeyCodesConfig(InnerQConfig):
    """InnerQ's fields; keys must be sym (the reused levels are symmetric integers, the scale is per layer)."""

    def __post_init__(self):
        super().__post_init__()
        if self.key_mode != "sym":
            raise ValueError(f"SharedKeyCodesConfig shares sym key codes, got key_mode={self.key_mode!r}")


class SharedKeyCodesFormat(InnerQFormat):
    name = "toy_shared_key_codes"
    config_type = SharedKeyCodesConfig
    presets = {"toy_shared_key_codes": SharedKeyCodesConfig()}
    bench_presets = ()

    def make_layer_cache(self, config, batch, num_kv_heads, head_dim, capacity=1024, device="cpu",
                         dtype=torch.float16, *, context=None, **options):  # fmt: skip
        if context is None:
            raise ValueError(f"{self.name} is a cross-layer format: create its layers through a ModelKVCache")
        cls = SharedKeyCodesOddLayer if context.layer_idx % 2 else SharedKeyCodesEvenLayer
        return cls(config, batch, num_kv_heads, head_dim, capacity, device, dtype, context=context, **options)


FORMAT = SharedKeyCodesFormat()


class SharedKeyCodesEvenLayer(InnerQLayerCache):
    """An even layer: an InnerQ layer whose key codes the next layer reads."""

    format = FORMAT


class SharedKeyCodesStore:
    """An odd layer's quantized keys: the partner layer's codes (read in place), this layer's fp16 scales.

    Same interface as kvkernels.formats.base.QuantStore in the "rows" layout: scales [B, H, cap, D/G]; views()
    returns (partner codes, own scales, None).
    """

    layout, step, mode, eta = "rows", 1, "sym", 0.0

    def __init__(self, partner, bits, group_size, batch, heads, head_dim, capacity, device):
        self._partner = partner  # () -> the partner layer's cache
        self.bits, self.group_size, self.heads, self.head_dim = bits, group_size, heads, head_dim
        self.device, self.n = torch.device(device), 0
        self.scales = torch.zeros(batch, heads, max(capacity, group_size), head_dim // group_size,
                                  dtype=torch.float16, device=self.device)  # fmt: skip

    @property
    def batch(self) -> int:
        return self.scales.shape[0]

    def _codes(self, lo: int, hi: int) -> torch.Tensor:
        partner = self._partner()
        if partner is None or partner.key_store.n < hi:
            have = "no cache" if partner is None else f"quantized {partner.key_store.n} key tokens"
            raise RuntimeError(
                f"{FORMAT.name}: this layer reuses key codes of tokens [{lo}, {hi}) of the layer before it, which has "
                f"{have}: append to that layer first (layers are appended in order within a step)"
            )
        return partner.key_store.views(lo, hi)[0]

    def views(self, lo: int = 0, hi: int | None = None):
        hi = self.n if hi is None else hi
        return self._codes(lo, hi), self.scales[:, :, lo:hi], None

    def write(self, x: torch.Tensor) -> None:
        """Fit this layer's scales for tokens [n, n + len) of x [B, H, len, D] to the partner's code levels."""
        n = x.shape[2]
        if n == 0:
            return
        if self.n + n > self.scales.shape[2]:
            grown = self.scales.new_zeros(*self.scales.shape[:2], max(2 * self.scales.shape[2], self.n + n),
                                          self.scales.shape[3])  # fmt: skip
            grown[:, :, : self.n] = self.scales[:, :, : self.n]
            self.scales = grown
        codes = self._codes(self.n, self.n + n)
        unit = torch.ones(
            codes.shape[:3] + (self.head_dim // self.group_size,), dtype=torch.float16, device=codes.device
        )
        levels = ops.dequantize_groups(codes, unit, None, self.bits, self.group_size, "sym")  # u - 2^(b-1)
        lg = levels.unflatten(-1, (-1, self.group_size))
        xg = x.to(torch.float32).unflatten(-1, (-1, self.group_size))
        num, den = (xg * lg).sum(-1), (lg * lg).sum(-1)
        s = torch.where(den > 0, num / den.clamp_min(1e-30), torch.zeros_like(num)).clamp_min(0)
        self.scales[:, :, self.n : self.n + n] = s.to(torch.float16)
        self.n += n

    def dequantize(self, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        hi = self.n if hi is None else hi
        if hi <= lo:
            return torch.zeros(self.batch, self.heads, 0, self.head_dim, device=self.device)
        codes, scales, _ = self.views(lo, hi)
        return ops.dequantize_groups(codes, scales, None, self.bits, self.group_size, "sym")

    def truncate(self, n: int) -> None:
        if not 0 <= n <= self.n:
            raise ValueError(f"SharedKeyCodesStore: cannot truncate {self.n} tokens to {n}")
        self.n = n

    def map_batch(self, fn) -> None:
        self.scales = fn(self.scales)  # the partner reorders its codes itself

    def used_bytes(self) -> int:
        return self.scales[:, :, : self.n].numel() * 2

    def allocated_bytes(self) -> int:
        return self.scales.numel() * 2


class SharedKeyCodesOddLayer(InnerQLayerCache):
    """An odd layer: own values and fp16 windows, keys quantized as own scales over layer l-1's codes."""

    format = FORMAT

    def _make_store(self, tensor, layout, bits, group_size, mode, eta, batch, heads, head_dim, capacity, device):
        if tensor == "value":
            return super()._make_store(tensor, layout, bits, group_size, mode, eta, batch, heads, head_dim,
                                       capacity, device)  # fmt: skip
        ctx = self.context
        return SharedKeyCodesStore(lambda: ctx.layer(ctx.layer_idx - 1), bits, group_size, batch, heads, head_dim,
                                   capacity, device)  # fmt: skip


SharedKeyCodesFormat.layer_cache_type = SharedKeyCodesOddLayer  # make_layer_cache picks per layer
