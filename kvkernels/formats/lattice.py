"""Lattice (HIGGS-style vector quantization): rotate each token's group, scale by its RMS, round pairs to a grid.

Per (token, KV head) vector, in groups of G channels: y = H_n (s * x) (orthonormal Walsh-Hadamard, optional seeded
signs s), r = ||x|| / sqrt(G) stored as fp16, and each pair (or quad) of y / r replaced by the index of the nearest
point of a Gaussian-MSE-optimal grid (HIGGS/EDEN, kvkernels.formats.lattice_grids): 16 / 64 / 256 points per pair
for 2 / 3 / 4 bits per value, or 256 points per quad for 2 bits. docs/FORMATS.md ("Lattice") is the bit-exact spec.

Keys and values are both stored per token (the "rows" layout: a token leaves the fp16 window as soon as it is
written, no token groups), with InnerQ's fp16 sink and recent windows. Decode never forms a dequantized key or
value: gemv_lattice_k rotates each query row once and scores on the codes (q . x_hat = (H_n s q) . (r grid[c])),
and gemv_lattice_v accumulates p r grid[c] in the rotated domain with one inverse transform per output row.

cross_head=True quantizes a token's H_kv * head_dim channels as one row (AQUA-KV's choice: G = 1024 spans all KV
heads of a Llama-3-8B token); a query head then needs every group its KV head touches, so this mode dequantizes
the store and multiplies (the research notes, section 4.4, explain why no fused GEMV fits it).
"""

from dataclasses import dataclass

import torch

from .. import ops
from .. import reference as ref
from .._validate import is_int
from ..attention import _grouped_matmul
from .base import _BLOCK, EffectiveBits, Format, QuantizedLayerCache, QuantStore, SameForBothTensors, check_window
from .lattice_grids import grid as published_grid

LATTICE_BITS = (2, 3, 4)
GRID_DIMS = (2, 4)
MAX_GROUP = 1024


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class LatticeConfig(SameForBothTensors):
    """Lattice cache format (both tensors the same way).

    bits:       2, 3 or 4 bits of grid index per value (a grid of 2^(bits * dim) points).
    dim:        grid dimension d: 2 (pairs; every bits) or 4 (quads; bits=2 only: EDEN4-256, 8 bits per quad).
    group_size: G channels per norm and per Hadamard transform, a power of two in [32, 1024]. 64 is one group per
                head on head_dim-64 models; head_dim 128 models get two groups per head (+0.125 bits per value
                over G = 128, and a norm that follows each half).
    cross_head: quantize a token's H_kv * head_dim channels as one row (G may then exceed head_dim; it must
                divide H_kv * head_dim). Decode dequantizes in this mode.
    signs_seed: None: the plain Sylvester transform (the reference implementations'); an int: a seeded +-1 sign
                vector applied before the transform (papers' "random Hadamard").
    w_sink, w_recent: fp16 windows of the first / last tokens, as InnerQ's.
    """

    bits: int = 2
    dim: int = 2
    group_size: int = 64
    cross_head: bool = False
    signs_seed: int | None = None
    w_sink: int = 32
    w_recent: int = 96

    def __post_init__(self):
        if not isinstance(self.bits, int) or isinstance(self.bits, bool) or self.bits not in LATTICE_BITS:
            raise ValueError(f"bits must be one of {LATTICE_BITS}, got {self.bits!r}")
        if not isinstance(self.dim, int) or isinstance(self.dim, bool) or self.dim not in GRID_DIMS:
            raise ValueError(f"dim must be one of {GRID_DIMS}, got {self.dim!r}")
        if self.dim == 4 and self.bits != 2:
            raise ValueError(f"dim=4 has one grid (EDEN4-256, 2 bits per value), got bits={self.bits}")
        G = self.group_size
        if not is_int(G) or not _is_power_of_two(G) or not _BLOCK <= G <= MAX_GROUP:
            raise ValueError(f"group_size must be a power of two in [{_BLOCK}, {MAX_GROUP}], got {G!r}")
        if not isinstance(self.cross_head, bool):
            raise ValueError(f"cross_head must be a bool, got {self.cross_head!r}")
        seed = self.signs_seed
        if seed is not None and (not is_int(seed) or seed < 0):
            raise ValueError(f"signs_seed must be None or an int >= 0, got {seed!r}")
        check_window("w_sink", self.w_sink)
        check_window("w_recent", self.w_recent)

    @property
    def grid_points(self) -> int:
        return 2 ** (self.bits * self.dim)

    # The uniform view the Format protocol reads: both tensors lattice-coded at `bits` (SameForBothTensors), no eta
    mode = "lattice"

    def eta_for(self, mode: str) -> float:
        return 0.0

    def signs(self, device=None) -> torch.Tensor | None:
        """The int8 [G] sign vector (None without signs_seed); drawn on the CPU, so every device gets the same."""
        if self.signs_seed is None:
            return None
        gen = torch.Generator().manual_seed(self.signs_seed)
        s = torch.randint(0, 2, (self.group_size,), generator=gen, dtype=torch.int8) * 2 - 1
        return s.to(device) if device is not None else s


class LatticeStore(QuantStore):
    """Quantized tokens of one tensor in the lattice format ("rows": token t is row t).

    codes [B, H, cap, D * bits / 32] int32 and norms [B, H, cap, D / G] fp16 (held in QuantStore's `scales` slot,
    so growth, truncation, batch edits and accounting are QuantStore's); no zeros. Cross-head stores keep one
    row of H * D channels per token (codes [B, 1, cap, H * D * bits / 32]) and reshape on the way in and out.
    """

    def __init__(self, config: LatticeConfig, batch, heads, head_dim, capacity, device):
        self.config = config
        self.grid = published_grid(config.dim, config.grid_points).to(device)
        self.signs = config.signs(device)
        # the stored row: one KV head's D channels, or (cross-head) all H * D channels of a token
        self.row_heads, self.row_dim = (1, heads * head_dim) if config.cross_head else (heads, head_dim)
        super().__init__(
            "rows", config.bits, config.group_size, "lattice", 0.0, batch, heads, head_dim, capacity, device
        )

    def _alloc(self, batch: int, cap: int):
        B, H, D, b = batch, self.row_heads, self.row_dim, self.bits
        codes = torch.zeros(B, H, cap, D // _BLOCK * b, dtype=torch.int32, device=self.device)
        norms = torch.zeros(B, H, cap, D // self.group_size, dtype=torch.float16, device=self.device)
        return codes, norms, None

    def _to_rows(self, x: torch.Tensor) -> torch.Tensor:
        # [B, H, n, D] -> the stored rows [B, row_heads, n, row_dim]
        if not self.config.cross_head:
            return x
        B, H, n, D = x.shape
        return x.permute(0, 2, 1, 3).reshape(B, 1, n, H * D)

    def _from_rows(self, x: torch.Tensor) -> torch.Tensor:
        if not self.config.cross_head:
            return x
        B, _, n, _ = x.shape
        return x.reshape(B, n, self.heads, self.head_dim).permute(0, 2, 1, 3)

    def write(self, x: torch.Tensor) -> None:
        """Quantize x [B, H, n, D] into tokens [self.n, self.n + n)."""
        n = x.shape[2]
        if n == 0:
            return
        if self.n + n > self.cap:
            self._grow(self.n + n)
        codes, norms, _ = self.views(self.n, self.n + n)
        # check_values=False: the cache's appends do not sync the device (a NaN key stays NaN, as in the other
        # formats' stores); ops.lattice_quantize's default checks are for direct calls
        c, r = ops.lattice_quantize(
            self._to_rows(x).contiguous(), self.grid, self.group_size, self.signs, check_values=False
        )
        codes.copy_(c)
        norms.copy_(r)
        self.n += n

    def dequantize(self, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Tokens [lo, hi) as fp32 [B, H, hi - lo, D]."""
        hi = self.n if hi is None else hi
        if hi <= lo:
            return torch.zeros(self.batch, self.heads, 0, self.head_dim, device=self.device)
        codes, norms, _ = self.views(lo, hi)
        return self._from_rows(ops.lattice_dequantize(codes, norms, self.grid, self.group_size, self.signs))


class LatticeLayerCache(QuantizedLayerCache):
    """One layer's lattice KV cache: fp16 sink + recent windows, per-token lattice codes for keys and values."""

    def __init__(
        self, config, batch, num_kv_heads, head_dim, capacity=1024, device="cpu", dtype=torch.float16, *, context=None
    ):
        if isinstance(config, LatticeConfig) and config.cross_head and isinstance(num_kv_heads, int):
            row = num_kv_heads * head_dim
            if row % config.group_size:
                raise ValueError(
                    f"cross_head: group_size={config.group_size} must divide H_kv * head_dim = {num_kv_heads} * "
                    f"{head_dim} = {row}"
                )
        super().__init__(config, batch, num_kv_heads, head_dim, capacity, device, dtype, context=context)

    def _make_store(self, tensor: str, layout, bits, group_size, mode, eta, batch, heads, head_dim, capacity, device):
        return LatticeStore(self.config, batch, heads, head_dim, capacity, device)

    def quantized_key_scores(self, x: torch.Tensor) -> torch.Tensor:
        B, H_q, T, _ = x.shape
        store = self.key_store
        if store.n == 0:
            return x.new_zeros(B, H_q, T, 0)
        if self.config.cross_head:  # a query head needs groups spanning other heads: dequantize, then multiply
            return _grouped_matmul(x, store.dequantize().transpose(-1, -2))
        codes, norms, _ = store.views()
        return ops.gemv_lattice_k(x, codes, norms, store.grid, store.group_size, store.signs)

    def quantized_value_output(self, p: torch.Tensor) -> torch.Tensor:
        B, H_q, T, _ = p.shape
        store = self.value_store
        if store.n == 0:
            return p.new_zeros(B, H_q, T, self.head_dim)
        if self.config.cross_head:
            return _grouped_matmul(p, store.dequantize())
        codes, norms, _ = store.views()
        return ops.gemv_lattice_v(p, codes, norms, store.grid, store.group_size, store.signs)


class LatticeFormat(Format):
    name = "lattice"
    config_type = LatticeConfig
    layer_cache_type = LatticeLayerCache
    key_layout, value_layout = "rows", "rows"
    gemv_op = "gemv_lattice_k"  # the keys' op; values use gemv_lattice_v (LatticeLayerCache's hooks call both)
    # bits 2 / 3 / 4 on pairs, and 2 bits on quads; windows as InnerQ's; G = 64 (norm: 0.25 bits per value)
    presets = {
        "lattice2": LatticeConfig(bits=2),
        "lattice3": LatticeConfig(bits=3),
        "lattice4": LatticeConfig(bits=4),
        "lattice2_d4": LatticeConfig(bits=2, dim=4),
    }
    # `python -m kvkernels bench` times both GEMVs (bench_gemvs: they take grids and norms, not Format.gemv's arguments)
    bench_presets = ("lattice2", "lattice3", "lattice4", "lattice2_d4")

    def gemv(self, fn, x, codes, scales, zeros, bits, group_size, mode, x_scale=None):
        raise NotImplementedError(
            "the lattice format has two GEMVs (gemv_lattice_k for keys, gemv_lattice_v for values) with their own "
            "arguments; LatticeLayerCache's quantized_key_scores / quantized_value_output call them"
        )

    def bench_gemvs(self, config, resolve, q, p, lead, n, d, device):
        """Keys through gemv_lattice_k (q rotated once per query row), values through gemv_lattice_v (one inverse
        transform per output row), each on its own store layout: random codes [*lead, n, d * bits / 32] (every bit
        pattern is a valid index), fp16 norms in [0.5, 1.5) per group, the config's grid and signs."""
        grid = published_grid(config.dim, config.grid_points, device=device)
        signs, G = config.signs(device), config.group_size
        out = []
        for xn, x, op in (("q", q, "gemv_lattice_k"), ("p", p, "gemv_lattice_v")):
            inputs = {
                xn: x,
                "codes": torch.randint(
                    -(2**31), 2**31, (*lead, n, d * config.bits // 32), dtype=torch.int32, device=device
                ),
                "norms": (torch.rand(*lead, n, d // G, device=device) + 0.5).half(),
            }

            fn, ref_fn = resolve(op), getattr(ref, op)

            def call(a, f=fn, xn=xn):
                return f(a[xn], a["codes"], a["norms"], grid, G, signs)

            def ref_call(a, f=ref_fn, xn=xn):
                return f(a[xn], a["codes"], a["norms"], grid, G, signs)

            out.append((inputs, call, ref_call))
        return out

    def check_head_dim(self, config, head_dim: int) -> None:
        if config.cross_head:  # G spans heads; the cache checks H_kv * head_dim % G once it knows H_kv
            if head_dim % _BLOCK:
                raise ValueError(f"head_dim={head_dim} must be a multiple of {_BLOCK} for the lattice format")
            return
        super().check_head_dim(config, head_dim)

    def effective_bits(self, config, num_layers: int | None = None) -> EffectiveBits:
        per_value = config.bits + 16.0 / config.group_size  # codes + the fp16 norm of each group
        window = config.w_sink + config.w_recent  # both tensors leave the window one token at a time
        return EffectiveBits(
            key=per_value,
            value=per_value,
            average=per_value,
            fp16_key_tokens=window,
            fp16_value_tokens=window,
        )

    def describe(self, config) -> str:
        grid = f"EDEN{config.dim}-{config.grid_points}"
        rot = "Hadamard" if config.signs_seed is None else f"Hadamard with signs (seed {config.signs_seed})"
        across = f"per token across heads, G {config.group_size}" if config.cross_head else f"G {config.group_size}"
        return f"K/V {config.bits}b {grid} lattice, {rot}, fp16 RMS per {across}"


FORMAT = LatticeFormat()

LatticeLayerCache.format = FORMAT
