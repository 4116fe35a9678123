"""KIVI (arXiv 2402.02750): keys per channel, values per token, asymmetric, with an fp16 residual window.

Keys are grouped per channel (G consecutive tokens of one channel share a scale and zero), values per token (G
consecutive channels), always asymmetric, with the most recent R tokens in fp16; eta is the XQuant/SpeCache
calibration of the asymmetric zero/scale (kvkernels.quantize_groups, mode="asym"). Both GEMVs are gemv_kivi.
"""

from dataclasses import dataclass

from .base import (
    Format,
    QuantizedLayerCache,
    SameForBothTensors,
    check_bits,
    check_eta,
    check_group_size,
    check_window,
)


@dataclass(frozen=True)
class KIVIConfig(SameForBothTensors):
    """KIVI cache format (asymmetric only).

    Keys: per-channel groups of `group_size` tokens; values: per-token groups of `group_size` channels.
    residual: the most recent R values stay fp16; keys leave in whole groups of G tokens, so up to R + G - 1
              keys are fp16.
    eta:      asym calibration in [0, 0.5) (0 = plain KIVI min/max; 0.25 at 1 bit = SpeCache's midpoints).
    w_sink:   optional fp16 attention-sink window of the first tokens (0 = plain KIVI; KIVI_Sink uses 32 with
              residual 96).
    """

    bits: int = 2
    group_size: int = 32
    residual: int = 128
    eta: float = 0.0
    w_sink: int = 0

    def __post_init__(self):
        check_bits("bits", self.bits)
        check_group_size(self.group_size)
        check_window("residual", self.residual)
        check_window("w_sink", self.w_sink)
        check_eta(self.eta)

    def eta_for(self, mode: str) -> float:
        """The calibration a tensor is written with: KIVI is asym for both tensors."""
        return float(self.eta)

    # The uniform view the Format protocol reads: KIVI is asym for both tensors (SameForBothTensors), and its
    # window is `residual`.
    mode = "asym"

    @property
    def w_recent(self) -> int:
        return self.residual


class KIVIFormat(Format):
    name = "kivi"
    config_type = KIVIConfig
    key_layout, value_layout = "cols", "rows"
    gemv_op = "gemv_kivi"
    # KIVI at 2 and 4 bits, and SpeCache's calibrated 1 bit
    presets = {
        "kivi2": KIVIConfig(bits=2),
        "kivi4": KIVIConfig(bits=4),
        "kivi1_eta": KIVIConfig(bits=1, eta=0.25),
    }
    aliases = {"w_recent": ("residual",)}  # one override set fits every format (InnerQ has `w_recent`)
    bench_presets = ("kivi2", "kivi4")
    # what transformers' QuantizedCache does: dequantize the whole cache every step, then attend
    dequant_baselines = ("kivi2", "kivi4")

    def gemv(self, fn, x, codes, scales, zeros, bits, group_size, mode, x_scale=None):
        if mode != "asym" or x_scale is not None:
            raise ValueError(f"gemv_kivi is asym without x_scale, got mode={mode!r}, x_scale={x_scale is not None}")
        return fn(x, codes, scales, zeros, bits, group_size)

    def describe(self, config) -> str:
        return f"K {config.bits}b per-channel, V {config.bits}b per-token"


FORMAT = KIVIFormat()


class KIVILayerCache(QuantizedLayerCache):
    """One layer's KIVI KV cache (keys per-channel groups of G tokens, values per-token groups; asym + eta).

    Stores: keys "cols" codes [B, H, D, cap*b/32], scales/zeros [B, H, D, cap/G] (G tokens leave the residual
    window together); values "rows" codes [B, H, cap, D*b/32], scales/zeros [B, H, cap, D/G] (one per step).
    Optional fp16 sink of the first config.w_sink tokens (KIVI_Sink); w_sink=0 is plain KIVI. Keys are stored as
    they are (no key normalization).
    """

    format = FORMAT


KIVIFormat.layer_cache_type = KIVILayerCache
