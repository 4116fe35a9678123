"""InnerQ (arXiv InnerQ, sections 4.1-4.4): groups along each GEMV's inner dimension, fp16 sink + recent windows.

Keys are grouped per token (G consecutive channels of one token share a scale: the score GEMV reduces over
channels), values per channel (G consecutive tokens of one channel share a scale: the output GEMV reduces over
tokens). The first w_sink and the last w_recent tokens stay in the activation dtype (fp16 windows). Quantized keys
are stored normalized per channel (paper 4.3, kvkernels.keynorm), and both GEMVs are gemv_inner_q.

Every quantized value costs `bits` plus its group's fp16 metadata: a scale (16/G bits per value) and, for modes
that store a zero point (asym, hybrid), a zero (16/G bits). Format.effective_bits reports exactly that, and the
fp16 windows separately, since their share depends on the sequence length.
"""

from dataclasses import dataclass

import torch

from ..keynorm import compute_key_norm
from .base import (
    Format,
    QuantizedLayerCache,
    check_bits,
    check_eta,
    check_group_size,
    check_mode,
    check_window,
)


@dataclass(frozen=True)
class InnerQConfig:
    """InnerQ cache format.

    key_bits/key_mode:     per-token groups of `group_size` channels (keys are rows of the score GEMV).
    value_bits/value_mode: per-channel groups of `group_size` tokens (tokens are the output GEMV's inner dim).
    w_sink:   the first w_sink tokens stay in fp16 forever (attention sinks).
    w_recent: the last w_recent keys stay in fp16; values leave the window in whole groups of G tokens, so up
              to w_recent + G - 1 values are fp16.
    key_norm: per-channel key normalization (paper 4.3): quantized keys are stored as K / norm with
              norm[h, c] = sqrt(max |K[:, h, :, c]|) over the prefill, and queries are scaled by norm.
    eta:      asym calibration in [0, 0.5) for the tensors whose mode is "asym" (as KIVIConfig.eta; sym and
              hybrid tensors ignore it). Not in the InnerQ paper: it lets the InnerQ layout be compared with
              KIVI's 1-bit calibrated format at the same bits.
    """

    key_bits: int = 3
    key_mode: str = "sym"
    value_bits: int = 3
    value_mode: str = "sym"
    group_size: int = 32
    w_sink: int = 32
    w_recent: int = 96
    key_norm: bool = True
    eta: float = 0.0

    def __post_init__(self):
        check_bits("key_bits", self.key_bits)
        check_bits("value_bits", self.value_bits)
        check_mode("key_mode", self.key_mode)
        check_mode("value_mode", self.value_mode)
        check_group_size(self.group_size)
        check_window("w_sink", self.w_sink)
        check_window("w_recent", self.w_recent)
        if not isinstance(self.key_norm, bool):
            raise ValueError(f"key_norm must be a bool, got {self.key_norm!r}")
        check_eta(self.eta)
        if self.eta and "asym" not in (self.key_mode, self.value_mode):
            raise ValueError(f"eta={self.eta} applies to asym tensors, but key_mode and value_mode are not asym")

    def eta_for(self, mode: str) -> float:
        """The calibration a tensor quantized in `mode` is written with (eta for asym, else 0)."""
        return float(self.eta) if mode == "asym" else 0.0


class InnerQFormat(Format):
    name = "innerq"
    config_type = InnerQConfig
    key_layout, value_layout = "rows", "cols"
    gemv_op = "gemv_inner_q"
    # The InnerQ paper's three presets, and two of ours: the InnerQ layout (groups along each GEMV's reduction dim,
    # windows, key normalization) with KIVI's quantizer at KIVI's bits, so each KIVI row has an InnerQ-layout row at
    # the same effective bits (3.0: innerq_small vs kivi2; 5.0: innerq_asym4 vs kivi4; 2.0: innerq_asym1_eta vs
    # kivi1_eta).
    presets = {
        "innerq_base": InnerQConfig(key_bits=3, key_mode="sym", value_bits=3, value_mode="sym"),
        "innerq_small": InnerQConfig(key_bits=3, key_mode="sym", value_bits=2, value_mode="sym"),
        "innerq_hybrid": InnerQConfig(key_bits=3, key_mode="sym", value_bits=2, value_mode="hybrid"),
        "innerq_asym4": InnerQConfig(key_bits=4, key_mode="asym", value_bits=4, value_mode="asym"),
        "innerq_asym1_eta": InnerQConfig(key_bits=1, key_mode="asym", value_bits=1, value_mode="asym", eta=0.25),
    }
    aliases = {"bits": ("key_bits", "value_bits")}  # one override set fits every format (KIVI has `bits`)
    layer_options = frozenset({"key_norm_factors", "rope_paired"})
    bench_presets = ("innerq_base", "innerq_small", "innerq_hybrid", "innerq_asym4")

    def gemv(self, fn, x, codes, scales, zeros, bits, group_size, mode, x_scale=None):
        return fn(x, codes, scales, zeros, bits, group_size, mode, x_scale)


FORMAT = InnerQFormat()


class InnerQLayerCache(QuantizedLayerCache):
    """One layer's InnerQ KV cache (keys per-token groups, values per-channel groups, fp16 sink + recent).

    Stores: keys "rows" codes [B, H, cap, D*kb/32], scales/zeros [B, H, cap, D/G] (one token leaves the
    w_recent window per step); values "cols" codes [B, H, D, cap*vb/32], scales/zeros [B, H, D, cap/G] (G
    tokens leave together). key_norm_factors: fixed fp32 [H_kv, D] norm to use instead of the prefill's
    (needs config.key_norm); rope_paired: pair channels c and c + D/2 in the computed norm (kvkernels.keynorm).
    `key_norm` is the norm in use (None before the prefill, or when key_norm=False).
    """

    format = FORMAT

    def __init__(
        self,
        config: InnerQConfig,
        batch: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int = 1024,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float16,
        key_norm_factors: torch.Tensor | None = None,
        rope_paired: bool = True,
        *,
        context=None,
    ):
        self.rope_paired = rope_paired
        self._fixed_norm = None
        if key_norm_factors is not None:
            if not config.key_norm:
                raise ValueError("key_norm_factors given but config.key_norm is False")
            f = key_norm_factors.detach().to(device=device, dtype=torch.float32).contiguous()
            if tuple(f.shape) != (num_kv_heads, head_dim):
                raise ValueError(
                    f"key_norm_factors must be [H_kv, D] = [{num_kv_heads}, {head_dim}], got {list(f.shape)}"
                )
            if not torch.isfinite(f).all() or bool((f <= 0).any()):
                raise ValueError("key_norm_factors must be finite and positive")
            self._fixed_norm = f
        super().__init__(config, batch, num_kv_heads, head_dim, capacity, device, dtype, context=context)

    def reset(self) -> None:
        super().reset()
        self.key_norm = self._fixed_norm

    def _on_first_write(self, k: torch.Tensor) -> None:
        if self.config.key_norm and self.key_norm is None:
            self.key_norm = compute_key_norm(k, rope_paired=self.rope_paired)

    def _keys_to_store(self, k: torch.Tensor) -> torch.Tensor:
        if self.key_norm is None:
            return k
        return k / self.key_norm[None, :, None, :]  # in fp32 (key_norm's dtype): k's values exactly, one division

    def _keys_from_store(self, k: torch.Tensor) -> torch.Tensor:
        return k if self.key_norm is None else k * self.key_norm[None, :, None, :]


InnerQFormat.layer_cache_type = InnerQLayerCache
