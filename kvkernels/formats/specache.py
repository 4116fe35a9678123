"""SpeCache (arXiv 2503.16163): a low-bit KIVI copy on the device, the full-precision cache in host memory, and the
top-k most attended tokens prefetched back in full precision for the next step.

Per layer (docs/FORMATS.md, "SpeCache"):

    device   KIVI stores (keys per channel, values per token, asym, `bits` 1 or 2, eta: SpeCache's 1-bit midpoints
             are eta 0.25), an fp16 residual window of `residual` tokens (64: R + k = 128 slots, the GPU memory of
             KIVI with residual 128), and the override rows: the `topk` positions per (batch row, KV head) whose
             full-precision K/V were prefetched, with their rows [B, H_kv, topk, D]
    host     every token's K/V in the cache dtype (HostKVStore; pinned when the device is CUDA), offloaded as the
             tokens arrive (the prompt at prefill, then each decode step's real token)

Attention is KIVI's fused path with the override rows substituted (quantized_key_scores / quantized_value_output):
a key score at an overridden position is x . K_fp (not x . deq(K)), and an overridden value position contributes
p * V_fp instead of p * deq(V). Overriding every quantized position therefore gives exact fp16 attention.

Which tokens: after the softmax (observe_attention) the layer ranks the tokens by the probabilities of the LAST
query row, averaged over the query heads of each KV group (the mean of softmax probabilities, as the public
third-party implementation does; the paper is silent), and keeps the `topk` best with ties to the lower position.
With the two-row decode loop (kvkernels.speculative) the last row is the speculative next token, so the set is the
paper's guess of the next step's attention; with plain generate() it is the current token's row (the set then lags
one step). Eligible positions: past the sink and before  real_len + 1 - residual,  i.e. exactly the tokens in the
value store at the next step (rows in the fp16 window gain nothing; keys leave their window in groups of G, so up
to G - 1 of them still have fp16 keys and only their values are overridden); the speculative token's own column
is never eligible. The rows are gathered from the host copy by a Prefetcher (its
module docstring says what overlaps what) into a second buffer, and become the override at the layer's next
append, so the step that chose them finishes with the previous set.

The speculative row's K/V are attended to (row 1 sees row 0; row 0 does not see row 1: causal) but never kept:
append() adds it to the fp16 tails without evicting anything and never offloads it, and drop_speculative() removes
it after the forward.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from dataclasses import dataclass

import torch

from ..attention import _grouped_matmul
from .base import (
    EffectiveBits,
    QuantizedLayerCache,
    SameForBothTensors,
    _round_up,
    check_bits,
    check_eta,
    check_group_size,
    check_window,
)
from .kivi import KIVIFormat


@dataclass(frozen=True)
class SpeCacheConfig(SameForBothTensors):
    """SpeCache cache format: KIVI's low-bit copy + full-precision host copy + top-k prefetch.

    bits:       1 or 2 (the paper's settings; 3 and 4 work too)
    group_size: KIVI's G (keys: G tokens per channel; values: G channels per token)
    residual:   fp16 residual window R (the paper's 64)
    topk:       prefetched full-precision rows per (layer, batch row, KV head) (the paper's 64; 0 = plain KIVI
                with a host copy)
    eta:        asym calibration; None: 0.25 at 1 bit (SpeCache's Eq. 3 midpoints), 0 otherwise
    w_sink:     optional fp16 sink window (the paper has none)
    two_rows:   generation feeds [token, speculative next token] and the speculative row chooses (the paper);
                False: plain one-row decoding, the current token's row chooses (the set lags one step)
    """

    bits: int = 1
    group_size: int = 32
    residual: int = 64
    topk: int = 64
    eta: float | None = None
    w_sink: int = 0
    two_rows: bool = True

    mode = "asym"

    def __post_init__(self):
        check_bits("bits", self.bits)
        check_group_size(self.group_size)
        check_window("residual", self.residual)
        check_window("w_sink", self.w_sink)
        check_window("topk", self.topk)
        if not isinstance(self.two_rows, bool):
            raise ValueError(f"two_rows must be a bool, got {self.two_rows!r}")
        if self.eta is None:
            object.__setattr__(self, "eta", 0.25 if self.bits == 1 else 0.0)
        check_eta(self.eta)

    def eta_for(self, mode: str) -> float:
        return float(self.eta)

    @property
    def w_recent(self) -> int:
        return self.residual


def paper_cache_size(bits: int, group_size: int, max_len: int, residual: int = 64, topk: int = 64) -> float:
    """SpeCache's "KV Cache Size" column (its Tables 1-2): device memory as a fraction of an fp16 cache of max_len
    tokens, (bits + 32/G)/16 + (R + k)/max_len (codes + fp16 scale and zero per group, and the fp16 slots of the
    residual window and the prefetch buffer; the host copy is not counted). 1-bit, G 64, 32k: 0.098 ("0.10x")."""
    return (bits + 32.0 / group_size) / 16.0 + (residual + topk) / max_len


def pcie_bytes_per_step(
    config: SpeCacheConfig, num_layers: int, batch: int, num_kv_heads: int, head_dim: int, esize: int = 2
) -> dict[str, int]:
    """Bytes a decode step moves between host and device: the prefetched K/V rows (host -> device) and the new
    token's K/V (device -> host), over all layers."""
    rows = num_layers * batch * num_kv_heads * head_dim * 2 * esize  # K and V of one token position
    return {"h2d": rows * config.topk, "d2h": rows, "total": rows * (config.topk + 1)}


# ---------------------------------------------------------------------------------------------------------
# the host copy and the prefetcher


class HostKVStore:
    """Every token's K/V of one layer in host memory, token-major [cap, B, H, D] each, in the cache dtype.

    Token-major so that a step's new tokens are one contiguous block: a device -> pinned copy into it is truly
    asynchronous (into a strided destination PyTorch would stage through pageable memory and block). Pinned when the
    layer lives on CUDA. Preallocated; grows by doubling (copying the used part once), like the quantized stores.
    Host-side readers (grow, batch edits) first wait for the last offload (wait()); the prefetcher's gathers are
    ordered after it by the event it records on the compute stream.
    """

    def __init__(self, batch, heads, head_dim, capacity, dtype, pin: bool):
        self.pin, self.dtype = pin, dtype
        self.n = 0
        self._offloaded = None  # CUDA event after the last non-blocking offload
        self.k, self.v = self._alloc(max(int(capacity), 1), batch, heads, head_dim)

    def _alloc(self, cap, batch, heads, head_dim):
        def make():
            t = torch.zeros(cap, batch, heads, head_dim, dtype=self.dtype)
            return t.pin_memory() if self.pin else t

        return make(), make()

    @property
    def capacity(self) -> int:
        return self.k.shape[0]

    def wait(self) -> None:
        """Block until the last offload has landed (before reading the host copy on the host)."""
        if self._offloaded is not None:
            self._offloaded.synchronize()
            self._offloaded = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Offload k, v [B, H, n, D] (any device) behind the stored tokens."""
        if self.k.is_inference() and not torch.is_inference_mode_enabled():
            self._remap(torch.clone)  # made under inference_mode: not writable outside it (as the device buffers)
        n = k.shape[2]
        if self.n + n > self.capacity:
            self.wait()
            new_k, new_v = self._alloc(_round_up(max(2 * self.capacity, self.n + n), 64), *self.k.shape[1:])
            new_k[: self.n] = self.k[: self.n]
            new_v[: self.n] = self.v[: self.n]
            self.k, self.v = new_k, new_v
        self.k[self.n : self.n + n].copy_(k.permute(2, 0, 1, 3), non_blocking=self.pin)
        self.v[self.n : self.n + n].copy_(v.permute(2, 0, 1, 3), non_blocking=self.pin)
        if self.pin and k.is_cuda:
            self._offloaded = torch.cuda.Event()
            self._offloaded.record(torch.cuda.current_stream(k.device))
        self.n += n

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored tokens as [B, H, n, D] views (for inspection; not contiguous)."""
        self.wait()
        return self.k[: self.n].permute(1, 2, 0, 3), self.v[: self.n].permute(1, 2, 0, 3)

    def truncate(self, n: int) -> None:
        self.n = min(self.n, n)

    def select(self, index: torch.Tensor) -> None:
        """Keep batch rows `index` (a CPU int64 tensor), in that order (reorder / batch_select)."""
        self._remap(lambda t: t.index_select(1, index))

    def repeat_interleave(self, repeats: int) -> None:
        self._remap(lambda t: t.repeat_interleave(repeats, dim=1))

    def _remap(self, fn) -> None:
        self.wait()
        k, v = fn(self.k), fn(self.v)
        self.k, self.v = (k.pin_memory(), v.pin_memory()) if self.pin else (k, v)

    def nbytes(self) -> int:
        return 2 * self.k[: self.n].numel() * self.k.element_size()


def gather_rows(host: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """rows[b, h, j] = host[idx[b, h, j], b, h] (idx -1: a zero row). host token-major [N, B, H, D] (HostKVStore),
    idx int64 [B, H, k]; returns [B, H, k, D] on host's device."""
    idx = idx.to(host.device)
    B, H, _ = idx.shape
    b = torch.arange(B, device=host.device)[:, None, None]
    h = torch.arange(H, device=host.device)[None, :, None]
    rows = host[idx.clamp(min=0), b, h]
    return rows.masked_fill((idx < 0)[..., None], 0)


class _Done:
    """A finished job (SyncStreams.run): result() returns its value."""

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


class SyncStreams:
    """The stream API the Prefetcher speaks, for a device without streams (CPU): every call runs now, in order.

    CudaStreams is the CUDA implementation; tests substitute a recording fake to check the ordering."""

    class _Event:
        def record(self, stream=None):
            pass

        def synchronize(self):
            pass

    class _Stream:
        def wait_event(self, event):
            pass

    def new_stream(self):
        return self._Stream()

    def current_stream(self):
        return self._Stream()

    def new_event(self):
        return self._Event()

    def use(self, stream):
        return contextlib.nullcontext(stream)

    def run(self, job):
        """Run job() (a prefetch) and return an object whose result() is its value."""
        return _Done(job())

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        return t.to("cpu")

    def to_device(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        return t.to(device)


class CudaStreams(SyncStreams):
    """torch.cuda streams and events; prefetch jobs run on one worker thread shared by all layers (UNVERIFIED:
    never run on a GPU)."""

    _worker = None  # one worker thread for every layer and cache: jobs run in the order layers start them

    def __init__(self, device: torch.device):
        self.device = device

    def new_stream(self):
        return torch.cuda.Stream(self.device)

    def current_stream(self):
        return torch.cuda.current_stream(self.device)

    def new_event(self):
        return torch.cuda.Event()

    def use(self, stream):
        return torch.cuda.stream(stream)

    def run(self, job):
        if CudaStreams._worker is None:
            CudaStreams._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="specache")
        return CudaStreams._worker.submit(job)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return out.copy_(t, non_blocking=True)

    def to_device(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        return t.pin_memory().to(device, non_blocking=True)


class Prefetcher:
    """Gathers a layer's chosen rows from its host copy into device buffers, off the compute stream's path.

    start(host, idx): the layer has chosen idx (int64 [B, H_kv, k], on the device) on the compute stream. start
    records an event `chosen` there and hands a job to the stream API's worker (CUDA: one background thread; CPU:
    run at once). The job: the side stream waits for `chosen` (idx and every earlier offload of the host copy are
    complete), copies idx to pinned host memory and the worker waits for that copy; it gathers the rows from the
    host copy on the host, copies them to the device on the side stream and records `ready`.
    take(): at the layer's next append; waits for the job on the host (it has normally finished) and makes the
    compute stream wait for `ready` (a stream wait, no device synchronization); returns (idx, k_rows, v_rows).

    So on CUDA the copies and the host gather overlap this step's later layers and the next step's earlier ones;
    the main thread blocks only if a layer's job has not finished by that layer's next append. The host gather is
    a CPU index of pinned memory (the rows are not contiguous: the paper measures ~5x the latency of contiguous
    copies); a device kernel reading mapped host memory directly would save the host round trip (not built).
    UNVERIFIED on a GPU. On CPU (SyncStreams) the same calls run immediately, in order.
    """

    def __init__(self, device: torch.device, streams: SyncStreams | None = None):
        self.device = torch.device(device)
        if streams is None:
            streams = CudaStreams(self.device) if self.device.type == "cuda" else SyncStreams()
        self.streams = streams
        self.side = streams.new_stream()
        self._pending = None

    def start(self, host: HostKVStore, idx: torch.Tensor) -> None:
        s = self.streams
        chosen = s.new_event()
        chosen.record(s.current_stream())
        hk, hv = host.k[: host.n], host.v[: host.n]  # the tensors as of now (a grow reallocates)
        self._pending = (idx, s.run(lambda: self._gather(chosen, hk, hv, idx)))

    def _gather(self, chosen, hk, hv, idx):
        s = self.streams
        with s.use(self.side):
            self.side.wait_event(chosen)
            idx_host = s.to_host(idx)
            copied = s.new_event()
            copied.record(self.side)
        copied.synchronize()
        with s.use(self.side):
            k = s.to_device(gather_rows(hk, idx_host), self.device)
            v = s.to_device(gather_rows(hv, idx_host), self.device)
            ready = s.new_event()
            ready.record(self.side)
        return k, v, ready

    def take(self):
        """(idx, k_rows, v_rows) of the last start(), usable on the compute stream; None if nothing is pending."""
        if self._pending is None:
            return None
        idx, job = self._pending
        self._pending = None
        k, v, ready = job.result()
        self.streams.current_stream().wait_event(ready)
        return idx, k, v

    def cancel(self) -> None:
        """Forget a pending prefetch (after a crop or a batch reorder its rows may be stale)."""
        if self._pending is not None:
            self._pending[1].result()  # let the job finish before its inputs change
        self._pending = None


# ---------------------------------------------------------------------------------------------------------
# the layer cache and the format


class SpeCacheLayerCache(QuantizedLayerCache):
    """One layer of a SpeCache cache: KIVI stores + fp16 windows on the device, the full-precision host copy, and
    the override rows (module docstring). `speculative_rows` (0 or 1, set by the decode loop through
    set_speculative_rows) says whether the last row of each append is a speculative token."""

    format: SpeCacheFormat  # set below

    def __init__(
        self, config, batch, num_kv_heads, head_dim, capacity=1024, device="cpu", dtype=torch.float16, *, context=None
    ):
        self.speculative_rows = 0
        self._pending_spec = 0
        super().__init__(config, batch, num_kv_heads, head_dim, capacity, device, dtype, context=context)
        self.host = HostKVStore(batch, num_kv_heads, head_dim, capacity, dtype, pin=self.device.type == "cuda")
        self.prefetcher = Prefetcher(self.device)
        self._clear_override()

    # -- state ---------------------------------------------------------------------------------------------------
    def _clear_override(self) -> None:
        self._staged = None  # (idx, k, v) prefetched for the next step, once taken out of the prefetcher
        self.override_idx = None  # int64 [B, H_kv, topk] positions (-1 = empty slot), or None
        self.override_k = self.override_v = None  # [B, H_kv, topk, D] in the cache dtype

    def reset(self) -> None:
        super().reset()
        self.speculative_rows = 0
        if hasattr(self, "host"):
            self.host.truncate(0)
            self.prefetcher.cancel()
            self._clear_override()
        self._pending_spec = 0

    # -- writes ----------------------------------------------------------------------------------------------
    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append n tokens; with speculative_rows = 1 the last is the speculative token: attended to this step,
        kept in the fp16 tails without evicting anything, never offloaded, and removed by drop_speculative()."""
        self._check_kv(k, v)
        if self._pending_spec:
            raise RuntimeError("specache: drop_speculative() must follow every forward that had a speculative row")
        self._take_prefetched()
        n = k.shape[2]
        spec = min(self.speculative_rows, n)
        real = n - spec
        if real:
            super().append(k[:, :, :real], v[:, :, :real])
            self.host.append(k[:, :, :real].to(self.dtype), v[:, :, :real].to(self.dtype))
        if spec:
            ks, vs = k[:, :, real:].to(self.dtype), v[:, :, real:].to(self.dtype)
            if self.n_sink < self.w_sink:  # only for prompts shorter than the sink; crop() undoes it there too
                super().append(ks, vs)
            else:
                self.key_tail = torch.cat([self.key_tail, ks], dim=2)
                self.value_tail = torch.cat([self.value_tail, vs], dim=2)
            self._pending_spec = spec

    def drop_speculative(self) -> None:
        """Remove the speculative token appended by the last step (no-op if there is none)."""
        if self._pending_spec:
            super().crop(self.seq_len - self._pending_spec)
            self._pending_spec = 0

    def _stage(self) -> None:
        # take a prefetch out of the prefetcher so that crop / reorder can edit it with the rest of the cache
        got = self.prefetcher.take()
        if got is not None:
            self._staged = got

    def _take_prefetched(self) -> None:
        # the rows chosen by the last step become the override (at the layer's first append of a step)
        self._stage()
        if self._staged is not None:
            self.override_idx, self.override_k, self.override_v = self._staged
            self._staged = None

    # -- the override, in the two attention hooks ------------------------------------------------------------------
    def _columns(self, n: int, H_q: int, T: int):
        """Override positions as columns of a store of n tokens (stores start after the sink): cols [B, H_q, T, k],
        n for slots outside the store, expanded to the query heads of each KV group; None without an override."""
        if self.override_idx is None or n == 0:
            return None
        col = self.override_idx - self.n_sink
        col = torch.where((self.override_idx >= 0) & (col >= 0) & (col < n), col, n)
        g = H_q // self.num_kv_heads
        return col.repeat_interleave(g, dim=1)[:, :, None, :].expand(-1, -1, T, -1)

    def quantized_key_scores(self, x: torch.Tensor) -> torch.Tensor:
        scores = super().quantized_key_scores(x)
        B, H_q, T, n = scores.shape
        cols = self._columns(n, H_q, T)
        if cols is None:
            return scores
        exact = _grouped_matmul(x, self.override_k.to(torch.float32).transpose(2, 3))  # [B, H_q, T, k]
        ext = torch.cat([scores, scores.new_zeros(B, H_q, T, 1)], dim=-1)  # column n: where unused slots go
        return ext.scatter(-1, cols, exact)[..., :n]

    def quantized_value_output(self, p: torch.Tensor) -> torch.Tensor:
        B, H_q, T, n = p.shape
        cols = self._columns(n, H_q, T)
        if cols is None:
            return super().quantized_value_output(p)
        ext = torch.cat([p, p.new_zeros(B, H_q, T, 1)], dim=-1)
        p_override = ext.gather(-1, cols)  # 0 for unused slots (column n is 0)
        rest = ext.scatter(-1, cols, 0.0)[..., :n]
        return super().quantized_value_output(rest) + _grouped_matmul(p_override, self.override_v.to(torch.float32))

    def observe_attention(self, p: torch.Tensor) -> None:
        """Choose the next step's rows from the probabilities p fp32 [B, H_q, T, N] of this step (module
        docstring) and start prefetching them."""
        if self.config.topk == 0:
            return
        idx = self.select_topk(p[:, :, -1])
        self.prefetcher.start(self.host, idx)

    def eligible_range(self) -> tuple[int, int]:
        """Token positions [lo, hi) the next selection may choose: those in the value store at the next step."""
        real = self.seq_len - self._pending_spec
        hi = min(max(self.n_sink, real + 1 - self.w_recent), real)
        return self.n_sink, max(hi, self.n_sink)

    def select_topk(self, p_last: torch.Tensor) -> torch.Tensor:
        """Positions int64 [B, H_kv, topk] of the topk eligible tokens with the largest probability in p_last
        [B, H_q, N] averaged over each KV group's query heads; ties go to the lower position; -1 fills the slots
        when fewer are eligible. Sorted by position."""
        B, H_q, N = p_last.shape
        lo, hi = self.eligible_range()
        mean = p_last[..., lo:hi].reshape(B, self.num_kv_heads, H_q // self.num_kv_heads, hi - lo).mean(2)
        k = min(self.config.topk, hi - lo)
        idx = torch.full((B, self.num_kv_heads, self.config.topk), -1, dtype=torch.long, device=p_last.device)
        if k:
            order = torch.sort(mean, dim=-1, descending=True, stable=True).indices[..., :k]
            idx[..., :k] = order.sort(dim=-1).values + lo
        return idx

    # -- reads, editing, accounting ----------------------------------------------------------------------------
    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) fp32 as attention sees them: windows exact, stores dequantized, override rows exact."""
        k, v = super().dequantized()
        if self.override_idx is None:
            return k, v
        idx, lo = self.override_idx, self.n_sink
        # as the hooks do: only positions inside each tensor's quantized store are overridden (a tail may hold
        # dequantized tokens after a crop; they stay as they are)
        for full, rows, store in ((k, self.override_k, self.key_store), (v, self.override_v, self.value_store)):
            b, h, j = ((idx >= lo) & (idx < lo + store.n)).nonzero(as_tuple=True)
            full[b, h, idx[b, h, j]] = rows[b, h, j].float()
        return k, v

    def crop(self, n: int) -> None:
        self.drop_speculative()
        self._stage()
        super().crop(n)
        self.host.truncate(self.seq_len)
        # rows past the cut are gone (new tokens will take their positions): their slots become empty
        if self.override_idx is not None:
            self.override_idx = idx = self.override_idx.masked_fill(self.override_idx >= self.seq_len, -1)
            # a cut inside a token group moves that group's kept tokens back into the fp16 tail, dequantized; an
            # overridden one goes back exact, so attention sees every kept token as it did before the crop
            for name, rows, store in (
                ("key_tail", self.override_k, self.key_store),
                ("value_tail", self.override_v, self.value_store),
            ):
                tail, start = getattr(self, name), self.n_sink + store.n
                b, h, j = ((idx >= start) & (idx < start + tail.shape[2])).nonzero(as_tuple=True)
                if b.numel():
                    tail = tail.clone()
                    tail[b, h, idx[b, h, j] - start] = rows[b, h, j].to(tail.dtype)
                    setattr(self, name, tail)
        if self._staged is not None:
            idx, k, v = self._staged
            self._staged = (idx.masked_fill(idx >= self.seq_len, -1), k, v)

    # batch edits: the device parts go through _map_batch; the host copy is token-major and on the host, so it
    # gets the same edit along its batch dim with a CPU index
    def reorder(self, index) -> None:
        host_index = self._index(index).cpu()
        super().reorder(index)
        self.host.select(host_index)

    def batch_select(self, index) -> None:
        host_index = self._index(index).cpu()
        super().batch_select(index)
        self.host.select(host_index)

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self.host.repeat_interleave(repeats)

    def _map_batch(self, fn) -> None:
        self._stage()  # beam search reorders between steps: the rows for the next step are reordered too
        super()._map_batch(fn)
        if self.override_idx is not None:
            self.override_idx, self.override_k, self.override_v = map(
                fn, (self.override_idx, self.override_k, self.override_v)
            )
        if self._staged is not None:
            self._staged = tuple(map(fn, self._staged))

    def memory_bytes(self) -> dict[str, int]:
        """memory_bytes() of the device part, plus prefetch (the override rows' K and V: device memory attention
        reads, in total) and host (the full-precision copy in host memory, not in total)."""
        mem = super().memory_bytes()
        esize = torch.empty((), dtype=self.dtype).element_size()
        prefetch = 2 * self.batch * self.num_kv_heads * self.config.topk * self.head_dim * esize
        mem["prefetch"] = prefetch
        mem["total"] += prefetch
        mem["allocated"] += 2 * prefetch  # the override rows and the next set being prefetched
        mem["host"] = self.host.nbytes()
        return mem


def set_speculative_rows(layers, rows: int) -> None:
    """Tell every SpeCache layer cache in `layers` whether the last row of the next appends is speculative."""
    for layer in layers:
        if isinstance(layer, SpeCacheLayerCache):
            layer.speculative_rows = rows


class SpeCacheFormat(KIVIFormat):
    name = "specache"
    config_type = SpeCacheConfig
    layer_cache_type = SpeCacheLayerCache
    # at equal device memory with kivi1_eta / kivi2 (residual 128): residual 64 + 64 prefetched rows
    presets = {
        "specache1": SpeCacheConfig(bits=1),
        "specache2": SpeCacheConfig(bits=2),
    }
    aliases = {"w_recent": ("residual",)}
    bench_presets = ()
    dequant_baselines = ()

    def speculative_decode(self, config) -> bool:
        return config.two_rows

    def effective_bits(self, config, num_layers: int | None = None) -> EffectiveBits:
        """KIVI's per-value cost; the prefetch rows count as fp16 window tokens (they occupy device memory)."""
        eb = super().effective_bits(config, num_layers)
        return EffectiveBits(
            key=eb.key,
            value=eb.value,
            average=eb.average,
            fp16_key_tokens=eb.fp16_key_tokens + config.topk,
            fp16_value_tokens=eb.fp16_value_tokens + config.topk,
        )

    def describe(self, config) -> str:
        return (
            f"K {config.bits}b per-channel, V {config.bits}b per-token, eta {config.eta:g}, R {config.residual} + "
            f"top-{config.topk} fp16 from host"
        )


FORMAT = SpeCacheFormat()
SpeCacheLayerCache.format = FORMAT

__all__ = [
    "FORMAT",
    "HostKVStore",
    "Prefetcher",
    "SpeCacheConfig",
    "SpeCacheFormat",
    "SpeCacheLayerCache",
    "SyncStreams",
    "gather_rows",
    "paper_cache_size",
    "pcie_bytes_per_step",
    "set_speculative_rows",
]
