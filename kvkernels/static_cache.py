"""Static-shape decode: a layer cache with fixed buffers and token counts on the device, for CUDA graphs.

A QuantizedLayerCache (kvkernels.formats.base) keeps its token counts as Python ints: every append decides on the
host how many tokens leave the fp16 tails, slices views of the used part and re-concatenates the tails, so each decode
step has new shapes and host decisions, and cannot be captured in a CUDA graph. StaticLayerCache takes over such a
cache (usually right after its prefill, which stays dynamic) and from then on

* keeps every buffer at a fixed shape: the sink [B, H_kv, w_sink, D], each quantized store at a capacity of
  max_tokens plus one step of slack, each fp16 tail at the most tokens it can hold during a step
  (w_recent + step_tokens, plus G - 1 for a tensor that leaves its tail in whole groups of G tokens);
* keeps the token counts in one int64 device tensor `lengths` = (sink, key store, key tail, value store, value tail);
* appends with one op, ops.static_append (kvkernels/reference/static_append.py is its spec): new tokens fill the
  sink while it has room and join the tails at their ends; the oldest tail tokens that leave (0 .. E a step, counted
  on the device) are quantized into the stores at their device counts and shifted out of the tails; the counts grow.
  Neither the cache nor the op reads a count on the host;
* attends with ops.decode_attention_fused over the whole buffers and `lengths` (the op's device-lengths form), so
  neither the step nor the op reads a token count on the host. Every backend takes that form: the CUDA and Triton
  kernels plan their grid and splits for the capacities and read the counts in each CTA (splits past the used tokens
  write an empty partial), so a replayed launch does the work of the tokens used; the reference dequantizes the
  whole capacity (masks instead of slices). The CUDA head dims the compiled kernel refuses run the reference.

The tokens and their quantization are exactly those of the dynamic cache fed the same K/V (tests/test_static_cache.py
holds it to that, and checks that no op of a step reads a device value on the host). Formats: those whose attention
is the fused op's arithmetic over plain quantized stores (fused_attention_operands() is not None and both stores are
QuantStore): InnerQ, KIVI. Others raise at construction.

Launches: where the compiled CUDA op serves the device, the append is two launches (csrc/cuda/static_append.cu: one
CTA per tensor, batch and KV head, then a one-thread commit of the counts). Elsewhere (CPU, Triton-only builds) the
reference runs: 34-42 small device ops per layer and step at one token a step (InnerQ 41-42, 7 of them its sink's;
KIVI 34; tests/test_static_cache.py holds that ceiling), which a CUDA graph still launches one by one (~1.5-2 us each
on an H100: the first GPU run's ~200 us step beside its ~60 us of attention was 68-80 of them, bench/RESULTS.md), and
torch.compile(fullgraph=True) over the step fuses into ~15 kernels plus the two quantizer calls (counted on CPU).

Capacity: appending past max_tokens is a programming error that cannot be caught on the host without a sync; the
reference's store write then indexes past its buffer (an index error on CPU, a device-side assert on CUDA) and the
CUDA kernel traps before writing, as transformers' StaticCache asserts. seq_len and token_counts() read the device
(a sync): use them outside the captured step.

Usage (a decode loop captured once and replayed; tests/test_cuda_kernels.py runs it on a GPU):

    static = StaticLayerCache(cache, max_tokens=4096)      # cache: a prefilled InnerQ / KIVI layer cache
    k_in, v_in, q_in = (torch.empty(...) for ...)          # static input buffers of the step
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static.append(k_in, v_in)
        out = static.attention(q_in)
    for each step: k_in.copy_(k); v_in.copy_(v); q_in.copy_(q); graph.replay()   # out holds the step's output
"""

import torch

from . import ops, reference
from ._validate import is_int
from .attention import _additive_mask
from .formats.base import QuantizedLayerCache, QuantStore, attention_operands
from .reference.static_append import append_slots, evict_bound

LENGTH_NAMES = ("sink", "key_quantized", "key_tail", "value_quantized", "value_tail")


class _StaticTensor:
    """One tensor's (keys' or values') store and fixed-size fp16 tail."""

    def __init__(self, store: QuantStore, tail: torch.Tensor, w_recent: int, step_tokens: int, max_tokens: int):
        self.store = store
        G = store.group_size
        # the tail's size during a step: before an append a "rows" tail holds <= w_recent tokens, a "cols" tail
        # <= w_recent + G - 1
        tail_cap = w_recent + step_tokens + (0 if store.layout == "rows" else G - 1)
        if tail.shape[2] > tail_cap - step_tokens:
            raise ValueError(f"the cache's tail holds {tail.shape[2]} tokens, over its window {tail_cap - step_tokens}")
        B, H, _, D = tail.shape
        self.tail = torch.zeros(B, H, tail_cap, D, dtype=tail.dtype, device=tail.device)
        self.tail[:, :, : tail.shape[2]] = tail
        # E, the most tokens that can leave the tail in one step: the append writes up to E past the store's count
        store.reserve(max_tokens + evict_bound(tail_cap, w_recent, store.step))


def static_format_error(cache: QuantizedLayerCache) -> str | None:
    """Why `cache` cannot be made static (None if it can): its format's attention must be the fused op over plain
    quantized stores (InnerQ, KIVI). Reads no data: an empty cache of the format answers for every cache of it."""
    if cache.fused_attention_operands() is None or not all(
        type(s) is QuantStore for s in (cache.key_store, cache.value_store)
    ):
        return (
            f"{cache.format.name} caches cannot be made static: their attention is not the fused op over plain "
            "quantized stores (static caches serve InnerQ and KIVI)"
        )
    return None


class StaticLayerCache:
    """A layer cache with fixed buffer shapes and device-side token counts (module docstring).

    StaticLayerCache(cache, max_tokens, step_tokens=1)

    cache: a QuantizedLayerCache of a format the fused op serves (InnerQ, KIVI), typically just prefilled; its
    buffers are taken over (the store buffers grown once to max_tokens), so do not use it afterwards.
    max_tokens: the most tokens the cache will hold (prompt + generated).
    step_tokens: tokens per append (1 for plain decoding; more for a speculative chunk of fixed size).
    """

    def __init__(self, cache: QuantizedLayerCache, max_tokens: int, step_tokens: int = 1):
        if not isinstance(cache, QuantizedLayerCache):
            raise TypeError(f"cache must be a kvkernels layer cache (QuantizedLayerCache), got {type(cache).__name__}")
        if (error := static_format_error(cache)) is not None:
            raise ValueError(error)
        for name, val in (("max_tokens", max_tokens), ("step_tokens", step_tokens)):
            if not is_int(val) or val < 1:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        if cache.seq_len == 0:  # the first write fixes what a format derives from the prompt (InnerQ's key norm)
            raise ValueError("the cache is empty: prefill it (dynamically) before making it static")
        if cache.seq_len > max_tokens:
            raise ValueError(f"the cache already holds {cache.seq_len} tokens, over max_tokens={max_tokens}")
        if cache._sink_k.is_inference() and not torch.is_inference_mode_enabled():
            cache._map_batch(torch.clone)  # in-place writes outside inference mode need normal tensors
        self.cache, self.max_tokens, self.step_tokens = cache, max_tokens, step_tokens
        self.batch, self.num_kv_heads, self.head_dim = cache.batch, cache.num_kv_heads, cache.head_dim
        self.device, self.dtype = cache.device, cache.dtype
        self.w_sink, self.w_recent = cache.w_sink, cache.w_recent
        self.keys = _StaticTensor(cache.key_store, cache.key_tail, cache.w_recent, step_tokens, max_tokens)
        self.values = _StaticTensor(cache.value_store, cache.value_tail, cache.w_recent, step_tokens, max_tokens)
        counts = cache.token_counts()
        self.lengths = torch.tensor([counts[n] for n in LENGTH_NAMES], dtype=torch.int64, device=self.device)
        self.key_norm = cache.key_norm
        # the append: the compiled CUDA op (two launches) where it serves this device, else the reference's fixed-shape
        # PyTorch ops over index ranges made once here
        self.compiled_append = self.device.type == "cuda" and ops.CUDA_IMPL.get("static_append") == "cuda"
        sides = [(t.tail.shape[2], t.store.layout, t.store.bits) for t in (self.keys, self.values)]
        self._slots = append_slots(step_tokens, self.w_sink, sides, self.w_recent, cache.config.group_size, self.device)
        # the op's mask spans every token the buffers can hold; a caller's mask (>= max_tokens columns) is padded
        stores = [t.store.cap + t.tail.shape[2] for t in (self.keys, self.values)]
        self.mask_tokens = self.w_sink + min(stores)
        # torch.compile(mode="reduce-overhead") captures a CUDA graph only if the state it mutates keeps its address
        # (as transformers' StaticCache marks its buffers); without the mark it skips the graph for mutated inputs
        for t in self._buffers():
            torch._dynamo.mark_static_address(t)

    def takes(self, cache: QuantizedLayerCache) -> bool:
        """Whether load() can take `cache`: the same layer-cache type, format config, batch, heads, head_dim, dtype and
        device (its buffers then have this cache's shapes)."""
        c = self.cache
        mine = (type(c), c.config, c.batch, c.num_kv_heads, c.head_dim, c.dtype, c.device)
        return mine == (type(cache), cache.config, cache.batch, cache.num_kv_heads, cache.head_dim, cache.dtype,
                        cache.device)  # fmt: skip

    def load(self, cache: QuantizedLayerCache) -> None:
        """Replace every token with those of `cache`, a freshly prefilled layer cache of the same format, shape, dtype
        and device: its sink, stores, tails, key norm and counts are copied into this cache's buffers, whose
        addresses stay, so a compiled step (or a captured CUDA graph) replays over the new prompt without being
        recorded again. `cache` itself is left as it was (a temporary)."""
        c = self.cache
        if not self.takes(cache):
            raise ValueError(
                "load() takes a layer cache of the same format config, batch, heads, head_dim, dtype and device"
            )
        if cache.seq_len == 0:
            raise ValueError("the cache is empty: prefill it (dynamically) before loading it")
        if cache.seq_len > self.max_tokens:
            raise ValueError(f"the cache holds {cache.seq_len} tokens, over max_tokens={self.max_tokens}")
        for side, tail in ((self.keys, cache.key_tail), (self.values, cache.value_tail)):
            if tail.shape[2] > side.tail.shape[2] - self.step_tokens:
                raise ValueError(f"the cache's tail holds {tail.shape[2]} tokens, over its window")
        if (self.key_norm is None) != (cache.key_norm is None):
            raise ValueError("load() takes a cache whose key norm is present exactly when this one's is")
        with torch.no_grad():
            c._sink_k.copy_(cache._sink_k)
            c._sink_v.copy_(cache._sink_v)
            for side, store, tail in ((self.keys, cache.key_store, cache.key_tail),
                                      (self.values, cache.value_store, cache.value_tail)):  # fmt: skip
                for dst, src in zip(QuantStore.views(side.store, 0, store.n), QuantStore.views(store), strict=True):
                    if dst is not None:
                        dst.copy_(src)
                side.store.n = store.n
                side.tail.zero_()
                side.tail[:, :, : tail.shape[2]] = tail
            if self.key_norm is not None:
                self.key_norm.copy_(cache.key_norm)
            counts = cache.token_counts()
            self.lengths.copy_(torch.tensor([counts[n] for n in LENGTH_NAMES], dtype=torch.int64))

    def _buffers(self):
        yield from (self.cache._sink_k, self.cache._sink_v, self.lengths)
        for side in (self.keys, self.values):
            st = side.store
            yield from (t for t in (st.codes, st.scales, st.zeros) if t is not None)
            yield side.tail

    def __repr__(self):
        return f"StaticLayerCache({self.cache.config}, max_tokens={self.max_tokens}, step_tokens={self.step_tokens})"

    # -- host reads (a device sync each): not for the captured step --------------------------------------------
    def token_counts(self) -> dict[str, int]:
        """Tokens in each part and the total (reads the device)."""
        counts = dict(zip(LENGTH_NAMES, self.lengths.tolist(), strict=True))
        counts["total"] = counts["sink"] + counts["key_quantized"] + counts["key_tail"]
        return counts

    @property
    def seq_len(self) -> int:
        """Tokens held (reads the device)."""
        return self.token_counts()["total"]

    @property
    def seq_len_tensor(self) -> torch.Tensor:
        """Tokens held, as a 0-d device tensor (no sync)."""
        return self.lengths[0] + self.lengths[1] + self.lengths[2]

    # -- the decode step --------------------------------------------------------------------------------------
    def _check_kv(self, k: torch.Tensor, v: torch.Tensor) -> None:
        want = (self.batch, self.num_kv_heads, self.step_tokens, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != want:
                raise ValueError(f"{name} must be [B, H_kv, step_tokens, D] = {list(want)}, got {list(t.shape)}")
            if t.device != self.device:
                raise ValueError(f"{name} must be on {self.device}, got {t.device}")
            if not t.dtype.is_floating_point:
                raise TypeError(f"{name} must be floating point, got {t.dtype}")

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append step_tokens new tokens' K/V [B, H_kv, step_tokens, D]: ops.static_append over this cache's buffers and
        `lengths` (module docstring), so it can be captured in a CUDA graph."""
        self._check_kv(k, v)
        k, v = (t.to(self.dtype) for t in (k, v))
        k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v))  # the op reads rows of D channels
        ks, vs = self.keys.store, self.values.store
        args = (
            k, v, self.lengths, self.cache._sink_k, self.cache._sink_v, ks.codes,
            ks.scales, ks.zeros, vs.codes, vs.scales, vs.zeros, self.keys.tail, self.values.tail, ks.bits, ks.mode,
            ks.layout, ks.eta, vs.bits, vs.mode, vs.layout, vs.eta, ks.group_size, self.w_recent, self.key_norm,
        )  # fmt: skip
        if self.compiled_append:
            torch.ops.kvkernels.static_append.default(*args)
        else:
            reference.static_append(*args, slots=self._slots)

    def fused_attention_operands(self) -> dict:
        """ops.decode_attention_fused's keyword arguments (all but x and attn_mask) over the whole buffers, with
        lengths: views only, no token count read."""
        ks, vs = self.keys.store, self.values.store
        kw = attention_operands(
            self.cache._sink_k, self.cache._sink_v, ks, (ks.codes, ks.scales, ks.zeros), vs,
            (vs.codes, vs.scales, vs.zeros), self.keys.tail, self.values.tail, self.key_norm,
        )  # fmt: skip
        return {**kw, "lengths": self.lengths}

    def _mask(self, attn_mask: torch.Tensor | None, B: int, H_q: int, T: int) -> torch.Tensor | None:
        # a caller's mask covers token positions 0 .. M - 1 with M >= max_tokens; the op's spans mask_tokens columns
        if attn_mask is None:
            return None
        M = attn_mask.shape[-1] if attn_mask.dim() == 4 else -1
        if M < self.max_tokens:
            raise ValueError(
                f"attn_mask must be [B or 1, H_q or 1, T={T}, M] with M >= max_tokens={self.max_tokens} (column j: "
                f"token j), got shape {list(attn_mask.shape)}"
            )
        mask = _additive_mask(attn_mask, B, H_q, T, M)
        if M < self.mask_tokens:  # columns past max_tokens are never tokens; the op needs them to exist
            mask = torch.nn.functional.pad(mask, (0, self.mask_tokens - M))
        return mask.contiguous()

    def attention(self, q: torch.Tensor, scale: float | None = None, attn_mask: torch.Tensor | None = None):
        """Decode attention of q [B, H_q, T, D] over the cache, as QuantizedLayerCache.attention (the T rows are the
        last T tokens; causal among them unless attn_mask [B|1, H_q|1, T, M >= max_tokens] is given, bool True =
        attend or additive float), with no host read: returns [B, H_q, T, D] in q.dtype."""
        if q.dim() != 4 or q.shape[0] != self.batch or q.shape[3] != self.head_dim or q.shape[1] % self.num_kv_heads:
            raise ValueError(
                f"q must be [B={self.batch}, H_q (a multiple of {self.num_kv_heads}), T, D={self.head_dim}], got "
                f"{list(q.shape)}"
            )
        if q.device != self.device:
            raise ValueError(f"q is on {q.device} but the cache is on {self.device}")
        B, H_q, T, D = q.shape
        scale = D**-0.5 if scale is None else float(scale)
        kw = self.fused_attention_operands()
        mask = self._mask(attn_mask, B, H_q, T)
        # where the serving kernel does not take this head_dim the reference runs it: plain torch ops, capturable
        # too, but it dequantizes the whole capacity every step
        fast = ops.fused_attention_takes(q.device, D)
        op = ops.decode_attention_fused if fast else reference.decode_attention_fused
        return op(q, **kw, attn_mask=mask, q_scale=scale, out_dtype=q.dtype)  # q.to(fp32) * scale in, q.dtype out

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Full (K, V) [B, H_kv, N, D] in fp32, as QuantizedLayerCache.dequantized (reads the device)."""
        c = self.token_counts()
        S, lk, lv = c["sink"], c["key_tail"], c["value_tail"]
        kq = self.cache._keys_from_store(self.keys.store.dequantize(0, c["key_quantized"]))
        vq = self.values.store.dequantize(0, c["value_quantized"])
        k = torch.cat([self.cache._sink_k[:, :, :S].float(), kq, self.keys.tail[:, :, :lk].float()], dim=2)
        v = torch.cat([self.cache._sink_v[:, :, :S].float(), vq, self.values.tail[:, :, :lv].float()], dim=2)
        return k, v
