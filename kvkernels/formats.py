"""Quantized KV cache configurations (InnerQ, KIVI), named presets, and their effective storage cost.

InnerQ (arXiv InnerQ, sections 4.1-4.4) groups both caches along the GEMV's inner dimension: keys per token
(G consecutive channels of one token share a scale), values per channel (G consecutive tokens of one channel
share a scale). The first w_sink and the last w_recent tokens stay in the activation dtype (fp16 windows).
KIVI groups keys per channel (G consecutive tokens) and values per token (G consecutive channels), always
asymmetric, with an fp16 residual window of the most recent R tokens; eta is the XQuant/SpeCache calibration of
the asymmetric zero/scale (kvkernels.quantize_groups, mode="asym").

Every quantized value costs `bits` plus its group's fp16 metadata: a scale (16/G bits per value) and, for modes
that store a zero point (asym, hybrid, and KIVI always), a zero (16/G bits). effective_bits() reports exactly
that, and the fp16 windows separately, since their share depends on the sequence length.
"""

from dataclasses import dataclass

SUPPORTED_BITS = (1, 2, 3, 4)
MODES = ("sym", "asym", "hybrid")
_BLOCK = 32  # packed storage works in blocks of 32 values, so group sizes are multiples of 32


def _check_bits(name: str, bits) -> None:
    if not isinstance(bits, int) or isinstance(bits, bool) or bits not in SUPPORTED_BITS:
        raise ValueError(f"{name} must be one of {SUPPORTED_BITS}, got {bits!r}")


def _check_mode(name: str, mode) -> None:
    if mode not in MODES:
        raise ValueError(f"{name} must be one of {MODES}, got {mode!r}")


def _check_group_size(group_size) -> None:
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0 or group_size % _BLOCK:
        raise ValueError(f"group_size must be a positive multiple of {_BLOCK}, got {group_size!r}")


def _check_window(name: str, w) -> None:
    if not isinstance(w, int) or isinstance(w, bool) or w < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {w!r}")


def _check_eta(eta) -> None:
    if not isinstance(eta, (int, float)) or isinstance(eta, bool) or not 0.0 <= eta < 0.5:
        raise ValueError(f"eta must be a number in [0, 0.5), got {eta!r}")


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
        _check_bits("key_bits", self.key_bits)
        _check_bits("value_bits", self.value_bits)
        _check_mode("key_mode", self.key_mode)
        _check_mode("value_mode", self.value_mode)
        _check_group_size(self.group_size)
        _check_window("w_sink", self.w_sink)
        _check_window("w_recent", self.w_recent)
        if not isinstance(self.key_norm, bool):
            raise ValueError(f"key_norm must be a bool, got {self.key_norm!r}")
        _check_eta(self.eta)
        if self.eta and "asym" not in (self.key_mode, self.value_mode):
            raise ValueError(f"eta={self.eta} applies to asym tensors, but key_mode and value_mode are not asym")

    def eta_for(self, mode: str) -> float:
        """The calibration a tensor quantized in `mode` is written with (eta for asym, else 0)."""
        return float(self.eta) if mode == "asym" else 0.0


@dataclass(frozen=True)
class KIVIConfig:
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
        _check_bits("bits", self.bits)
        _check_group_size(self.group_size)
        _check_window("residual", self.residual)
        _check_window("w_sink", self.w_sink)
        _check_eta(self.eta)

    def eta_for(self, mode: str) -> float:
        """The calibration a tensor is written with: KIVI is asym for both tensors."""
        return float(self.eta)

    # Uniform view used by the caches and effective_bits: KIVI is asym for both tensors.
    @property
    def key_bits(self) -> int:
        return self.bits

    @property
    def value_bits(self) -> int:
        return self.bits

    @property
    def key_mode(self) -> str:
        return "asym"

    @property
    def value_mode(self) -> str:
        return "asym"

    @property
    def w_recent(self) -> int:
        return self.residual


# The InnerQ paper's three presets, KIVI at 2 and 4 bits and SpeCache's calibrated 1 bit, and two of ours: the InnerQ
# layout (groups along each GEMV's reduction dim, windows, key normalization) with KIVI's quantizer at KIVI's
# bits, so each KIVI row has an InnerQ-layout row at the same effective bits (3.0: innerq_small vs kivi2; 5.0:
# innerq_asym4 vs kivi4; 2.0: innerq_asym1_eta vs kivi1_eta).
PRESETS: dict[str, InnerQConfig | KIVIConfig] = {
    "innerq_base": InnerQConfig(key_bits=3, key_mode="sym", value_bits=3, value_mode="sym"),
    "innerq_small": InnerQConfig(key_bits=3, key_mode="sym", value_bits=2, value_mode="sym"),
    "innerq_hybrid": InnerQConfig(key_bits=3, key_mode="sym", value_bits=2, value_mode="hybrid"),
    "innerq_asym4": InnerQConfig(key_bits=4, key_mode="asym", value_bits=4, value_mode="asym"),
    "innerq_asym1_eta": InnerQConfig(key_bits=1, key_mode="asym", value_bits=1, value_mode="asym", eta=0.25),
    "kivi2": KIVIConfig(bits=2),
    "kivi4": KIVIConfig(bits=4),
    "kivi1_eta": KIVIConfig(bits=1, eta=0.25),
}


def stores_zeros(mode: str) -> bool:
    """Whether a mode keeps an fp16 zero point per group (sym's zero is implied, so it is not stored)."""
    _check_mode("mode", mode)
    return mode != "sym"


@dataclass(frozen=True)
class EffectiveBits:
    """Storage cost of a config in bits per quantized value, and the fp16 windows (in tokens) it keeps.

    key/value: bits + 16/G (fp16 scale) + 16/G if the mode stores zeros; average = (key + value) / 2.
    fp16_key_tokens / fp16_value_tokens: the most tokens a layer keeps in fp16 once the cache is long
    (sink + recent window, plus G - 1 for the tensor that leaves its window in whole groups).
    """

    key: float
    value: float
    average: float
    fp16_key_tokens: int
    fp16_value_tokens: int

    def with_windows(self, seq_len: int, fp16_bits: int = 16) -> float:
        """Average bits per K/V element at seq_len tokens, counting the fp16 windows at their largest."""
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        total = 0.0
        for per_value, window in ((self.key, self.fp16_key_tokens), (self.value, self.fp16_value_tokens)):
            w = min(window, seq_len)
            total += (w * fp16_bits + (seq_len - w) * per_value) / seq_len
        return total / 2


def effective_bits(config: InnerQConfig | KIVIConfig) -> EffectiveBits:
    """Bits per quantized key/value including fp16 group metadata; windows reported separately.

    Example (G=32, any head_dim): innerq_base K 3.5 / V 3.5; innerq_small 3.5 / 2.5; innerq_hybrid 3.5 / 3.0;
    innerq_asym4 5.0 / 5.0; innerq_asym1_eta 2.0 / 2.0; kivi2 3.0 / 3.0; kivi4 5.0 / 5.0; kivi1_eta 2.0 / 2.0.
    """
    if not isinstance(config, (InnerQConfig, KIVIConfig)):
        raise TypeError(f"config must be an InnerQConfig or KIVIConfig, got {type(config).__name__}")
    G = config.group_size
    meta = 16.0 / G

    def cost(bits: int, mode: str) -> float:
        return bits + meta + (meta if stores_zeros(mode) else 0.0)

    k = cost(config.key_bits, config.key_mode)
    v = cost(config.value_bits, config.value_mode)
    if isinstance(config, InnerQConfig):  # keys leave one at a time, values in groups of G tokens
        fk, fv = config.w_sink + config.w_recent, config.w_sink + config.w_recent + G - 1
    else:  # KIVI: keys leave in groups of G tokens, values one at a time
        fk, fv = config.w_sink + config.residual + G - 1, config.w_sink + config.residual
    return EffectiveBits(key=k, value=v, average=(k + v) / 2, fp16_key_tokens=fk, fp16_value_tokens=fv)
