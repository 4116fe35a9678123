"""What every format shares: the quantized store, the per-layer cache machinery, and the Format protocol.

Per-layer quantized KV caches live over preallocated stores written in place by the fused ops.

One object holds one layer's keys and values, [B, H_kv, N, D] logically, split by token position into

    sink    the first w_sink tokens, fp16 (the cache dtype) forever                     (K and V share it)
    store   quantized tokens, packed codes + fp16 scales (+ zeros), one store per tensor
    tail    the most recent tokens, fp16; each tensor has its own tail length

in token order: sink | store | tail. The two tensors differ in how tokens leave the tail, because a token can
only be quantized once its whole group exists:

    InnerQ keys    per-token groups of G channels   -> one token per step      (tail <= w_recent)
    InnerQ values  per-channel groups of G tokens   -> G tokens every G steps  (tail <= w_recent + G - 1)
    KIVI keys      per-channel groups of G tokens   -> G tokens every G steps  (tail <= residual + G - 1)
    KIVI values    per-token groups of G channels   -> one token per step      (tail <= residual)

so the key and value stores cover different token ranges; attention splits its probabilities accordingly.
In general a tensor stored in the "rows" layout (grouped along channels) leaves its window one token at a time,
and one stored in the "cols" layout (grouped along tokens) leaves it G tokens at a time.

Stores are preallocated for `capacity` tokens and only the used part is handed to the ops as narrowed views
(e.g. codes[..., :n_words] of a [B, H, D, cap*b/32] buffer, row stride cap*b/32); quantize_groups_into writes
new tokens straight into views of the store. Appends never copy the quantized store: only when the capacity is
exceeded does `_grow` reallocate at twice the size (or what is needed, if more) and copy the used part once
(amortized O(1) per token). The fp16 tails are small tensors re-concatenated on append, an O(window) copy.

Per-channel key normalization (InnerQ, key_norm=True, see kvkernels.keynorm): quantized keys are stored as
K / norm, and attention scales the query by norm inside the fused GEMV (x_scale); the sink and tail keep raw
keys. The norm is fixed by the first non-empty write into an empty cache (the prefill), from all its keys, or
given up front with key_norm_factors=.

crop(n) never re-quantizes: tokens already quantized stay quantized, so after a crop a tail may be shorter than
its window until appends refill it (eviction resumes only once a tail exceeds its window again). Cutting inside
a store truncates it; only when the cut falls inside a token-group (InnerQ values, KIVI keys: groups of G
tokens) are the kept tokens of that one group dequantized back into the front of the fp16 tail (they keep their
quantization error, and are re-quantized when they leave the window again).
"""

import dataclasses
import math

import torch

from .. import ops
from .._validate import is_int, is_number
from ..attention import decode_attention

SUPPORTED_BITS = (1, 2, 3, 4)
MODES = ("sym", "asym", "hybrid")

_BLOCK = 32  # packed storage works in blocks of 32 values, so group sizes are multiples of 32
_VEC_TOKENS = 128  # tokens whose b-bit codes fill whole 16-byte words for every b in 1..4 (128 * b / 8 bytes)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


# -- config field checks, shared by every format's config dataclass ------------------------------------------
def check_bits(name: str, bits) -> None:
    if not is_int(bits) or bits not in SUPPORTED_BITS:
        raise ValueError(f"{name} must be one of {SUPPORTED_BITS}, got {bits!r}")


def check_mode(name: str, mode) -> None:
    if mode not in MODES:
        raise ValueError(f"{name} must be one of {MODES}, got {mode!r}")


def check_group_size(group_size) -> None:
    if not is_int(group_size) or group_size <= 0 or group_size % _BLOCK:
        raise ValueError(f"group_size must be a positive multiple of {_BLOCK}, got {group_size!r}")


def check_window(name: str, w) -> None:
    if not is_int(w) or w < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {w!r}")


def check_eta(eta) -> None:
    if not is_number(eta) or not 0.0 <= eta < 0.5:
        raise ValueError(f"eta must be a number in [0, 0.5), got {eta!r}")


def check_capacity(capacity) -> None:
    if not is_int(capacity) or capacity < 0:
        raise ValueError(f"capacity must be an int >= 0, got {capacity!r}")


class SameForBothTensors:
    """Mixin for a config that codes keys and values alike: the Format protocol's per-tensor view (key_bits,
    value_bits, key_mode, value_mode) read from the config's `bits` and its class attribute `mode`."""

    mode: str

    @property
    def key_bits(self) -> int:
        return self.bits

    @property
    def value_bits(self) -> int:
        return self.bits

    @property
    def key_mode(self) -> str:
        return self.mode

    @property
    def value_mode(self) -> str:
        return self.mode


def stores_zeros(mode: str) -> bool:
    """Whether a mode keeps an fp16 zero point per group (sym's zero is implied, so it is not stored)."""
    check_mode("mode", mode)
    return mode != "sym"


class QuantStore:
    """Quantized tokens of one tensor (K or V) of one layer, preallocated for `capacity` tokens.

    layout "rows": token t is row t, grouped along channels:
        codes [B, H, cap, D*bits/32], scales/zeros [B, H, cap, D/G]; tokens are added one at a time.
    layout "cols": transposed, tokens packed along the last dim, grouped along tokens:
        codes [B, H, D, cap*bits/32], scales/zeros [B, H, D, cap/G]; tokens are added in multiples of G.
    zeros is None for sym (its zero is implied); writes then use a scratch buffer for the op's zeros output.
    `n` tokens are used; views() returns the used part as views of the buffers (no copy).
    """

    def __init__(self, layout, bits, group_size, mode, eta, batch, heads, head_dim, capacity, device):
        if layout not in ("rows", "cols"):
            raise ValueError(f"layout must be 'rows' or 'cols', got {layout!r}")
        self.layout, self.bits, self.group_size, self.mode, self.eta = layout, bits, group_size, mode, float(eta)
        self.heads, self.head_dim, self.device = heads, head_dim, torch.device(device)
        self.step = 1 if layout == "rows" else group_size  # token granularity of writes and truncations
        # capacity granularity: G tokens; "cols" rounds to lcm(G, 128) tokens, so a row of cap*b/32 code words is a
        # whole number of 16-byte words at every b and the CUDA GEMV can read it with 16-byte loads
        self.cap_unit = group_size if layout == "rows" else math.lcm(group_size, _VEC_TOKENS)
        self.n = 0
        self.cap = _round_up(max(int(capacity), group_size), self.cap_unit)
        self.codes, self.scales, self.zeros = self._alloc(batch, self.cap)
        self._used_views = None  # views() of all used tokens, with what they were made of (views())
        self._zeros_scratch = None  # sym writes: the op's zeros output, kept for the next write of the same shape

    # -- buffers ---------------------------------------------------------------------------------------------
    def _alloc(self, batch: int, cap: int):
        B, H, D, G, b = batch, self.heads, self.head_dim, self.group_size, self.bits
        if self.layout == "rows":
            cshape, gshape = (B, H, cap, D // _BLOCK * b), (B, H, cap, D // G)
        else:
            cshape, gshape = (B, H, D, cap // _BLOCK * b), (B, H, D, cap // G)
        codes = torch.zeros(cshape, dtype=torch.int32, device=self.device)
        scales = torch.zeros(gshape, dtype=torch.float16, device=self.device)
        zeros = torch.zeros(gshape, dtype=torch.float16, device=self.device) if stores_zeros(self.mode) else None
        return codes, scales, zeros

    @property
    def batch(self) -> int:
        return self.codes.shape[0]

    def _narrow(self, t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        # tokens [lo, hi) of one buffer, as a view
        if t is None:
            return None
        if self.layout == "rows":
            return t[:, :, lo:hi]
        if t.dtype == torch.int32:  # codes: bits/32 words per token (lo, hi are multiples of G, so of 32)
            return t[..., lo * self.bits // _BLOCK : hi * self.bits // _BLOCK]
        return t[..., lo // self.group_size : hi // self.group_size]  # scales/zeros: one per G tokens

    def views(self, lo: int = 0, hi: int | None = None):
        """(codes, scales, zeros) of tokens [lo, hi) (default: all used), as views of the buffers."""
        hi = self.n if hi is None else hi
        if lo != 0 or hi != self.n:
            return tuple(self._narrow(t, lo, hi) for t in (self.codes, self.scales, self.zeros))
        # All used tokens: what every attention call reads, once or twice a layer and step. A view costs ~1.3 us of
        # host time and the value store's n moves only every G tokens, so the last ones are kept while n and the
        # buffers (by identity: growth and batch edits assign new tensors) are what they were made of.
        made_of = (hi, id(self.codes), id(self.scales), id(self.zeros))
        memo = self._used_views
        if memo is None or memo[0] != made_of:
            memo = (made_of, tuple(self._narrow(t, 0, hi) for t in (self.codes, self.scales, self.zeros)))
            self._used_views = memo
        return memo[1]

    def _grow(self, needed: int) -> None:
        """Reallocate to max(2 * cap, needed) tokens and copy the used part (appends: amortized O(1) per token)."""
        self.reserve(max(2 * self.cap, needed))

    def reserve(self, tokens: int) -> None:
        """Reallocate to exactly `tokens` (rounded up to the capacity unit) if the store holds fewer, copying the
        used part; the only place the store is copied. A static cache sizes its stores once with it."""
        new_cap = _round_up(tokens, self.cap_unit)
        if new_cap <= self.cap:
            return
        used = QuantStore.views(self)  # this store's own buffers (a subclass's views() may read another's codes)
        self.cap = new_cap
        self.codes, self.scales, self.zeros = self._alloc(self.batch, new_cap)
        for dst, src in zip((self.codes, self.scales, self.zeros), used, strict=True):
            if dst is not None:
                self._narrow(dst, 0, self.n).copy_(src)

    # -- writes ----------------------------------------------------------------------------------------------
    def write(self, x: torch.Tensor) -> None:
        """Quantize x [B, H, n, D] (any float dtype) into tokens [self.n, self.n + n), in place."""
        n = x.shape[2]
        if n == 0:
            return
        if n % self.step:
            raise ValueError(f"QuantStore({self.layout}): writes must be multiples of {self.step} tokens, got {n}")
        if self.n + n > self.cap:
            self._grow(self.n + n)
        codes, scales, zeros = QuantStore.views(self, self.n, self.n + n)  # this store's own buffers
        if zeros is None:  # sym: the op still writes (all-zero) zeros, into a throwaway buffer (kept: a step's shape)
            zeros = self._zeros_scratch
            if zeros is None or zeros.shape != scales.shape or zeros.device != scales.device:
                zeros = self._zeros_scratch = torch.empty(scales.shape, dtype=torch.float16, device=scales.device)
        src = (x if self.layout == "rows" else x.transpose(2, 3)).contiguous()
        # the op validates its arguments itself (ops.unchecked): this store's own views and a contiguous src
        ops.unchecked("quantize_groups_into")(
            src, self.bits, self.group_size, self.mode, self.eta, self._codes_out(codes, src), scales, zeros
        )
        self.n += n

    def _codes_out(self, codes: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """Where write() puts the codes of src: the view `codes` of the code buffer (a store that keeps no codes
        of its own returns a scratch tensor)."""
        return codes

    def dequantize(self, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Tokens [lo, hi) (multiples of step) as fp32 [B, H, hi - lo, D]."""
        hi = self.n if hi is None else hi
        if hi <= lo:
            return torch.zeros(self.batch, self.heads, 0, self.head_dim, device=self.device)
        codes, scales, zeros = self.views(lo, hi)
        x = ops.dequantize_groups(codes, scales, zeros, self.bits, self.group_size, self.mode)
        return x if self.layout == "rows" else x.transpose(2, 3)

    def truncate(self, n: int) -> None:
        if n % self.step or not 0 <= n <= self.n:
            raise ValueError(f"QuantStore: cannot truncate {self.n} tokens to {n} (step {self.step})")
        self.n = n

    def map_batch(self, fn) -> None:
        """Apply a batch-dim transform (index_select, repeat_interleave) to every buffer."""
        self.codes, self.scales = fn(self.codes), fn(self.scales)
        if self.zeros is not None:
            self.zeros = fn(self.zeros)

    # -- accounting ------------------------------------------------------------------------------------------
    def used_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.views() if t is not None)

    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.zeros) if t is not None)


def attention_operands(sink_keys, sink_values, key_store, key_parts, value_store, value_parts, key_tail, value_tail,
                       key_x_scale) -> dict:  # fmt: skip
    """ops.decode_attention_fused's keyword arguments (all but x, attn_mask, split_tokens, lengths) from a cache's
    parts: key_parts / value_parts are (codes, scales, zeros) of the stores (the used views, or whole buffers)."""
    (kc, kscale, kz), (vc, vscale, vz) = key_parts, value_parts
    return {
        "sink_keys": sink_keys,
        "sink_values": sink_values,
        "key_codes": kc,
        "key_scales": kscale,
        "key_zeros": kz,
        "value_codes": vc,
        "value_scales": vscale,
        "value_zeros": vz,
        "key_tail": key_tail,
        "value_tail": value_tail,
        "key_bits": key_store.bits,
        "key_mode": key_store.mode,
        "key_layout": key_store.layout,
        "value_bits": value_store.bits,
        "value_mode": value_store.mode,
        "value_layout": value_store.layout,
        "group_size": key_store.group_size,
        "key_x_scale": key_x_scale,
    }


class QuantizedLayerCache:
    """One layer's quantized KV cache: fp16 sink, per-tensor quantized store and fp16 tail, batch ops, accounting.

    A format subclasses it and sets `format` (its Format: the config type, the stores' layouts and the GEMV op
    the attention hooks call). It may override how keys enter / leave the key store (_on_first_write,
    _keys_to_store, _keys_from_store), which store objects hold the tokens (_make_store), and the two attention
    hooks (quantized_key_scores, quantized_value_output).

    context: the model-level LayerContext (kvkernels.cache.ModelKVCache) when the cache is one layer of a model,
    else None. Cross-layer formats read their neighbour layer through it; single-layer formats ignore it.
    """

    format: "Format"
    key_norm = None  # x_scale of the key GEMV (InnerQ's per-channel key norm); None: keys stored as they are

    def __init__(
        self, config, batch, num_kv_heads, head_dim, capacity=1024, device="cpu", dtype=torch.float16, *, context=None
    ):
        if not isinstance(config, self.format.config_type):
            raise TypeError(
                f"{type(self).__name__} needs a config of type {self.format.config_type.__name__}, "
                f"got {type(config).__name__}"
            )
        for name, val in (("batch", batch), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if not is_int(val) or val <= 0:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        self.format.check_head_dim(config, head_dim)
        check_capacity(capacity)
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"dtype must be float16, bfloat16 or float32, got {dtype}")
        self.config, self.context = config, context
        self.batch, self.num_kv_heads, self.head_dim = batch, num_kv_heads, head_dim
        # resolved through a tensor so "cuda" compares equal to the tensors' "cuda:0"
        self.device, self.dtype = torch.empty(0, device=device).device, dtype
        self.w_sink, self.w_recent = config.w_sink, config.w_recent
        G = config.group_size
        qcap = max(capacity - self.w_sink - self.w_recent, G)
        args = (batch, num_kv_heads, head_dim, qcap, self.device)
        kmode, vmode = config.key_mode, config.value_mode
        fmt = self.format
        self.key_store = self._make_store(
            "key", fmt.key_layout, config.key_bits, G, kmode, config.eta_for(kmode), *args
        )
        self.value_store = self._make_store(
            "value", fmt.value_layout, config.value_bits, G, vmode, config.eta_for(vmode), *args
        )
        # the sink is preallocated (it never moves); tails are re-concatenated on append (O(window))
        self._sink_k = torch.zeros(batch, num_kv_heads, self.w_sink, head_dim, dtype=dtype, device=self.device)
        self._sink_v = torch.zeros_like(self._sink_k)
        self.reset()

    def _make_store(self, tensor: str, layout, bits, group_size, mode, eta, batch, heads, head_dim, capacity, device):
        """The store holding the quantized tokens of `tensor` ("key" / "value"): a QuantStore unless overridden."""
        return QuantStore(layout, bits, group_size, mode, eta, batch, heads, head_dim, capacity, device)

    def __repr__(self):
        return f"{type(self).__name__}({self.config}, seq_len={self.seq_len})"

    # -- state -----------------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget every token (buffers are kept for reuse); a computed key norm is forgotten too."""
        self.n_sink = 0
        self.key_store.truncate(0)
        self.value_store.truncate(0)
        self.key_tail = self._empty_window()
        self.value_tail = self._empty_window()

    def _empty_window(self) -> torch.Tensor:
        return torch.zeros(self.batch, self.num_kv_heads, 0, self.head_dim, dtype=self.dtype, device=self.device)

    @property
    def seq_len(self) -> int:
        """Tokens held (sink + quantized + fp16 tail; equal for keys and values)."""
        return self.n_sink + self.key_store.n + self.key_tail.shape[2]

    @property
    def sink_keys(self) -> torch.Tensor:
        """fp16 sink keys [B, H_kv, n_sink, D] (a view)."""
        return self._sink_k[:, :, : self.n_sink]

    @property
    def sink_values(self) -> torch.Tensor:
        return self._sink_v[:, :, : self.n_sink]

    def token_counts(self) -> dict[str, int]:
        """Tokens in each part: sink, key_quantized, key_tail, value_quantized, value_tail, total."""
        return {
            "sink": self.n_sink,
            "key_quantized": self.key_store.n,
            "key_tail": self.key_tail.shape[2],
            "value_quantized": self.value_store.n,
            "value_tail": self.value_tail.shape[2],
            "total": self.seq_len,
        }

    # -- key transform hooks (InnerQ normalizes; KIVI stores keys as they are) --------------------------------
    def _on_first_write(self, k: torch.Tensor) -> None:
        pass

    def _keys_to_store(self, k: torch.Tensor) -> torch.Tensor:
        return k

    def _keys_from_store(self, k: torch.Tensor) -> torch.Tensor:
        return k

    # -- writes ----------------------------------------------------------------------------------------------
    def _check_kv(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if k.dim() != 4 or k.shape != v.shape:
            raise ValueError(f"k and v must both be [B, H_kv, n, D], got {list(k.shape)} and {list(v.shape)}")
        B, H, _, D = k.shape
        if (B, H, D) != (self.batch, self.num_kv_heads, self.head_dim):
            raise ValueError(
                f"k/v must be [B={self.batch}, H_kv={self.num_kv_heads}, n, D={self.head_dim}], got {list(k.shape)}"
            )
        if k.device != self.device or v.device != self.device:
            raise ValueError(f"k/v must be on {self.device}, got {k.device} / {v.device}")
        if not (k.dtype.is_floating_point and v.dtype.is_floating_point):
            raise TypeError(f"k/v must be floating point, got {k.dtype} / {v.dtype}")

    def prefill(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the prompt's K/V [B, H_kv, N, D] into an empty cache (N may be 0 or shorter than the windows).

        Fixes the key norm (InnerQ, key_norm=True) from these keys, then quantizes everything outside the windows
        at once: keys/values per the module docstring (the tensor grouped along tokens quantizes the largest
        multiple of G and leaves the rest in its fp16 tail).
        """
        if self.seq_len:
            raise ValueError(f"prefill needs an empty cache, this one holds {self.seq_len} tokens; call reset() first")
        self.append(k, v)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append n >= 1 new tokens' K/V [B, H_kv, n, D] (a decode step, or a speculative chunk).

        Tokens fill the sink first, then join the fp16 tails; whatever leaves a tail is quantized in place into
        the stores. Appending to an empty cache is a prefill.
        """
        self._check_kv(k, v)
        n = k.shape[2]
        if n == 0:
            return
        if self._sink_k.is_inference() and not torch.is_inference_mode_enabled():
            # buffers made under torch.inference_mode() cannot be written in place outside it; DynamicCache only
            # concatenates, so it does not care. Copy them once into normal tensors (the used part is kept).
            self._map_batch(torch.clone)
            if self.key_norm is not None:
                self.key_norm = self.key_norm.clone()
        if self.seq_len == 0:
            self._on_first_write(k)
        if k.dtype != self.dtype or v.dtype != self.dtype:  # (.to() of the same dtype still costs a dispatch a step)
            k, v = k.to(self.dtype), v.to(self.dtype)
        take = min(self.w_sink - self.n_sink, n)
        if take:  # only while the cache is shorter than w_sink, so stores and tails are empty
            self._sink_k[:, :, self.n_sink : self.n_sink + take] = k[:, :, :take]
            self._sink_v[:, :, self.n_sink : self.n_sink + take] = v[:, :, :take]
            self.n_sink += take
        if take == n:
            return
        self.key_tail = self._evict(
            torch.cat([self.key_tail, k[:, :, take:]], dim=2), self.key_store, self._keys_to_store
        )
        self.value_tail = self._evict(torch.cat([self.value_tail, v[:, :, take:]], dim=2), self.value_store, None)

    def _evict(self, tail: torch.Tensor, store: QuantStore, transform) -> torch.Tensor:
        # quantize the oldest tail tokens beyond the window, in whole multiples of the store's step
        n_out = (tail.shape[2] - self.w_recent) // store.step * store.step
        if n_out <= 0:
            return tail
        out = tail[:, :, :n_out]
        store.write(transform(out) if transform is not None else out)
        return tail[:, :, n_out:]

    # -- the two hooks decode attention calls (kvkernels.attention.decode_attention) ----------------------------
    def quantized_key_scores(self, x: torch.Tensor) -> torch.Tensor:
        """Scores x . K^T of x fp32 [B, H_q, T, D] against the quantized keys: fp32 [B, H_q, T, key_store.n]."""
        B, H_q, T, _ = x.shape
        if self.key_store.n == 0:
            return x.new_zeros(B, H_q, T, 0)
        # a normalized key store holds K / norm: the format's GEMV folds norm back in on the query side
        return self.format.store_gemv(x, self.key_store, x_scale=self.key_norm)

    def quantized_value_output(self, p: torch.Tensor) -> torch.Tensor:
        """p . V of probabilities p fp32 [B, H_q, T, value_store.n] over the quantized values: [B, H_q, T, D]."""
        B, H_q, T, _ = p.shape
        if self.value_store.n == 0:
            return p.new_zeros(B, H_q, T, self.head_dim)
        return self.format.store_gemv(p, self.value_store)

    def observe_attention(self, p: torch.Tensor) -> None:
        """Called by decode attention with the probabilities fp32 [B, H_q, T, N] of every cached token, after the
        softmax and before the value GEMVs. A format that chooses tokens by attention (SpeCache's top-k prefetch)
        reads them here; the default does nothing."""

    # The attention hooks whose base versions make decode attention the plain composition the fused op computes.
    _COMPOSED_HOOKS = ("quantized_key_scores", "quantized_value_output", "observe_attention")

    def fused_attention_operands(self) -> dict | None:
        """The keyword arguments of ops.decode_attention_fused (all but x and attn_mask) describing this cache, or
        None when this cache's attention is not that op's arithmetic: a format that overrides an attention hook
        (SpeCache reads p, lattice and AQUA attend other codes) or whose stores another GEMV reads.

        Views only (no copy). The stores' layouts say how each one is read, so a format whose GEMV is gemv_inner_q
        or gemv_kivi over QuantStore-like stores (InnerQ, KIVI, XQuant) gets the fused op without writing code.
        """
        cls = type(self)
        if self.format.gemv_op not in ("gemv_inner_q", "gemv_kivi") or any(
            getattr(cls, hook) is not getattr(QuantizedLayerCache, hook) for hook in self._COMPOSED_HOOKS
        ):
            return None
        return attention_operands(
            self.sink_keys, self.sink_values, self.key_store, self.key_store.views(), self.value_store,
            self.value_store.views(), self.key_tail, self.value_tail, self.key_norm,
        )  # fmt: skip

    # -- reads -----------------------------------------------------------------------------------------------
    def attention(
        self,
        q: torch.Tensor,
        scale: float | None = None,
        attn_mask: torch.Tensor | None = None,
        fused_op: bool | None = None,
    ) -> torch.Tensor:
        """Decode attention of q [B, H_q, T, D] over the whole cache (see kvkernels.attention.decode_attention).

        The T query rows are the last T tokens of the cache (append them first), with a causal mask among them
        unless attn_mask [B or 1, H_q or 1, T, N] (bool True = attend, or additive float) is given. fused_op: the one-op
        path (None: decode_attention's default).
        """
        return decode_attention(q, self, scale, attn_mask, fused_op=fused_op)

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Full (K, V) [B, H_kv, N, D] in fp32: windows exact, stores dequantized (keys un-normalized)."""
        ks = self._keys_from_store(self.key_store.dequantize())
        k = torch.cat([self.sink_keys.float(), ks, self.key_tail.float()], dim=2)
        v = torch.cat([self.sink_values.float(), self.value_store.dequantize(), self.value_tail.float()], dim=2)
        return k, v

    def memory_bytes(self) -> dict[str, int]:
        """Bytes used: quantized stores (codes + scales + zeros, used part only), fp16 windows, and references.

        keys: key_quantized, value_quantized, quantized (their sum), window (sink + tails, in the cache dtype),
        total (quantized + window), fp16_equivalent (2 * B * H_kv * N * D * 2), allocated (every buffer,
        capacity included).
        """
        kq, vq = self.key_store.used_bytes(), self.value_store.used_bytes()
        esize = torch.empty((), dtype=self.dtype).element_size()
        window_tokens = 2 * self.n_sink + self.key_tail.shape[2] + self.value_tail.shape[2]
        window = window_tokens * self.batch * self.num_kv_heads * self.head_dim * esize
        tails_alloc = (self.key_tail.numel() + self.value_tail.numel()) * esize
        sink_alloc = 2 * self._sink_k.numel() * esize
        return {
            "key_quantized": kq,
            "value_quantized": vq,
            "quantized": kq + vq,
            "window": window,
            "total": kq + vq + window,
            "fp16_equivalent": 2 * self.batch * self.num_kv_heads * self.seq_len * self.head_dim * 2,
            "allocated": self.key_store.allocated_bytes()
            + self.value_store.allocated_bytes()
            + sink_alloc
            + tails_alloc,
        }

    # -- editing ---------------------------------------------------------------------------------------------
    def crop(self, n: int) -> None:
        """Keep the first n tokens (n < 0: drop the last -n, like transformers' DynamicCache.crop).

        Quantized tokens are never re-quantized: a cut inside a store truncates it, and a cut inside a
        token-group dequantizes that group's kept tokens back into the fp16 tail (module docstring).
        """
        if not is_int(n):
            raise TypeError(f"crop takes an int token count, got {n!r}")
        N = self.seq_len
        if n < 0:
            n = max(N + n, 0)
        if n >= N:
            return
        if n == 0:  # an empty cache: the next write is a prefill again (and fixes a new key norm, InnerQ)
            self.reset()
            return
        if n <= self.n_sink:
            self.n_sink = n
            self.key_store.truncate(0)
            self.value_store.truncate(0)
            self.key_tail, self.value_tail = self._empty_window(), self._empty_window()
            return
        rest = n - self.n_sink
        self.key_tail = self._crop_one(rest, self.key_store, self.key_tail, self._keys_from_store)
        self.value_tail = self._crop_one(rest, self.value_store, self.value_tail, None)

    def _crop_one(self, rest: int, store: QuantStore, tail: torch.Tensor, from_store) -> torch.Tensor:
        # keep `rest` tokens after the sink of one tensor; returns its new tail
        if rest >= store.n:
            return tail[:, :, : rest - store.n]
        keep = rest // store.step * store.step
        back = store.dequantize(keep, keep + store.step)[:, :, : rest - keep] if rest > keep else None
        store.truncate(keep)
        if back is None:
            return self._empty_window()
        back = from_store(back) if from_store is not None else back
        return back.to(self.dtype).contiguous()

    def _map_batch(self, fn) -> None:
        self.key_store.map_batch(fn)
        self.value_store.map_batch(fn)
        self._sink_k, self._sink_v = fn(self._sink_k), fn(self._sink_v)
        self.key_tail, self.value_tail = fn(self.key_tail), fn(self.value_tail)
        self.batch = self._sink_k.shape[0]

    def _index(self, index) -> torch.Tensor:
        idx = torch.as_tensor(index, device=self.device)
        if idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
            raise TypeError(f"index must hold integers, got {str(idx.dtype).removeprefix('torch.')}")
        idx = idx.long()
        if idx.dim() != 1:
            raise ValueError(f"index must be 1-D, got shape {list(idx.shape)}")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.batch):
            raise IndexError(f"batch index out of range [0, {self.batch}): {idx.tolist()}")
        return idx

    def reorder(self, index) -> None:
        """Beam search: row b becomes old row index[b] (index_select on the batch dim; batch size unchanged)."""
        idx = self._index(index)
        if idx.numel() != self.batch:
            raise ValueError(f"reorder keeps the batch size {self.batch}; use batch_select for {idx.numel()} rows")
        self._map_batch(lambda t: t.index_select(0, idx))

    def batch_select(self, index) -> None:
        """Keep the batch rows in index (in that order); the batch size becomes len(index)."""
        idx = self._index(index)
        if idx.numel() == 0:
            raise ValueError("batch_select needs at least one row")
        self._map_batch(lambda t: t.index_select(0, idx))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every batch row `repeats` times in place (row b -> rows b*r .. b*r + r - 1)."""
        if not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"repeats must be a positive int, got {repeats!r}")
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))


# ---------------------------------------------------------------------------------------------------------
# the Format protocol


@dataclasses.dataclass(frozen=True)
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


class Format:
    """One KV cache format: what attention, caches, the demo, the bench and the transformers integration know.

    A format module defines its config dataclass (fields key_bits, key_mode, value_bits, value_mode, group_size,
    w_sink, w_recent, or properties of those names, and eta_for(mode)), its QuantizedLayerCache subclass, and
    one instance of a Format subclass naming them, registered in kvkernels.formats. Class attributes:

    name:              registry key ("innerq")
    config_type:       the config dataclass
    layer_cache_type:  the QuantizedLayerCache subclass make_layer_cache builds
    key_layout / value_layout: "rows" (grouped along channels, tokens leave the fp16 window one at a time) or
                       "cols" (grouped along tokens, G at a time); QuantStore documents both
    gemv_op:           the kvkernels op serving both attention GEMVs (store_gemv calls it)
    presets:           named configs, merged into kvkernels.formats.PRESETS in registration order
    aliases:           override name -> the config fields it sets (method_config), e.g. bits -> key/value bits
    layer_options:     extra keyword arguments make_layer_cache accepts (key_norm_factors, rope_paired)
    bench_presets:     presets `python -m kvkernels bench` times (bench name: "_" -> "-")
    dequant_baselines: presets whose layout the bench also times unfused (dequantize_groups, then matmul)
    """

    name: str
    config_type: type
    layer_cache_type: type
    key_layout: str
    value_layout: str
    gemv_op: str
    presets: dict = {}
    aliases: dict[str, tuple[str, ...]] = {}
    layer_options: frozenset[str] = frozenset()
    bench_presets: tuple[str, ...] = ()
    dequant_baselines: tuple[str, ...] = ()

    def __repr__(self):
        return f"<kvkernels format {self.name!r}>"

    # -- GEMVs ----------------------------------------------------------------------------------------------
    def gemv(self, fn, x, codes, scales, zeros, bits, group_size, mode, x_scale=None) -> torch.Tensor:
        """Call fn, an implementation of gemv_op (torch.ops, Triton, reference), with this format's arguments."""
        raise NotImplementedError

    def store_gemv(self, x: torch.Tensor, store, x_scale=None) -> torch.Tensor:
        """gemv_op of x over every used token of a store (QuantStore or a store with its interface)."""
        codes, scales, zeros = store.views()
        # the op validates its arguments itself (ops.unchecked): the store's own views, x from decode attention
        return self.gemv(
            ops.unchecked(self.gemv_op), x, codes, scales, zeros, store.bits, store.group_size, store.mode, x_scale
        )

    def bench_gemvs(self, config, resolve, q, p, lead, n: int, d: int, device):
        """The two GEMVs `python -m kvkernels bench` times, for a format whose GEMVs do not take `gemv`'s (codes,
        scales, zeros) arguments: [(inputs, call, reference call)] for the scores (q [B, H_q, d] against n keys) and
        the output (p [B, H_q, n] over n values), operands on `lead` = (B, H_kv). resolve(op) is the timed backend's
        implementation of a kvkernels op. None (the default): the bench builds the store layouts itself."""
        return None

    def speculative_decode(self, config) -> bool:
        """Whether generation should feed this config's caches [token, speculative next token] each step (the
        two-row loop of kvkernels.speculative; SpeCache). Default: no."""
        return False

    # -- caches ---------------------------------------------------------------------------------------------
    def make_layer_cache(
        self,
        config,
        batch,
        num_kv_heads,
        head_dim,
        capacity=1024,
        device="cpu",
        dtype=torch.float16,
        *,
        context=None,
        **options,
    ):
        """A layer cache for config; context: the model-level LayerContext (None for a standalone layer)."""
        unknown = sorted(set(options) - set(self.layer_options))
        if unknown:
            raise ValueError(
                f"{self.name} layer caches take no option(s) {unknown} (they take "
                f"{sorted(self.layer_options) or 'none'})"
            )
        return self.layer_cache_type(
            config, batch, num_kv_heads, head_dim, capacity, device, dtype, context=context, **options
        )

    # -- costs and descriptions -----------------------------------------------------------------------------
    def check_head_dim(self, config, head_dim: int) -> None:
        """Raise ValueError unless a layer of this head_dim can be stored (both layouts group G channels of a token
        or G tokens of a channel; the per-token one needs head_dim % G == 0). Callers that know the model's
        head_dim before the first token (KVKernelsCache given a model config) check it up front."""
        if head_dim % config.group_size == 0:
            return
        fits = [g for g in range(_BLOCK, head_dim + 1, _BLOCK) if head_dim % g == 0]
        hint = (
            f"group_size={fits[-1]} would fit"
            if fits
            else f"no group size fits: head_dim is not a multiple of {_BLOCK}"
        )
        raise ValueError(
            f"head_dim={head_dim} must be a multiple of group_size={config.group_size} for the {self.name} format "
            f"({hint})"
        )

    def effective_bits(self, config, num_layers: int | None = None) -> EffectiveBits:
        """Bits per quantized key/value including fp16 group metadata, averaged over the layers of a num_layers-layer
        model (a cross-layer format's layers differ; None: the format's reference depth); windows reported
        separately. Every layer of a single-layer format costs the same, so it ignores num_layers."""
        G = config.group_size
        meta = 16.0 / G

        def cost(bits: int, mode: str) -> float:
            return bits + meta + (meta if stores_zeros(mode) else 0.0)

        def window(layout: str) -> int:  # a "cols" tensor leaves its window in whole groups of G tokens
            return config.w_sink + config.w_recent + (G - 1 if layout == "cols" else 0)

        k, v = cost(config.key_bits, config.key_mode), cost(config.value_bits, config.value_mode)
        return EffectiveBits(
            key=k,
            value=v,
            average=(k + v) / 2,
            fp16_key_tokens=window(self.key_layout),
            fp16_value_tokens=window(self.value_layout),
        )

    def describe(self, config) -> str:
        """One line for tables: bits and modes of each tensor."""
        return f"K {config.key_bits}b {config.key_mode}, V {config.value_bits}b {config.value_mode}"

    def apply_overrides(self, config, overrides: dict, label: str | None = None):
        """config with overrides (its fields, or this format's aliases) applied; ValueError names unknown ones.

        label prefixes error messages (the preset name, say)."""
        where = f"{label}: " if label else ""
        kw = dict(overrides)
        for alias, fields in self.aliases.items():
            if alias not in kw:
                continue
            val = kw.pop(alias)
            for f in fields:
                if f in kw and kw[f] != val and len(fields) == 1:
                    raise ValueError(f"{where}{alias} is an alias of {f}; give one of them")
                kw.setdefault(f, val)
        names = {f.name for f in dataclasses.fields(config)}
        unknown = sorted(set(kw) - names)
        if unknown:
            aliases = f" (and the alias(es) {sorted(self.aliases)})" if self.aliases else ""
            raise ValueError(
                f"{where}unknown override(s) {unknown}; {type(config).__name__} fields are {sorted(names)}" + aliases
            )
        return dataclasses.replace(config, **kw)

    def override_names(self) -> frozenset[str]:
        """Every name apply_overrides accepts."""
        return frozenset({f.name for f in dataclasses.fields(self.config_type)} | set(self.aliases))
