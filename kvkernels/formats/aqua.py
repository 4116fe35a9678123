"""AQUA-KV (arXiv 2501.19392): cross-layer linear predictors + a lattice-coded residual. docs/FORMATS.md "AQUA-KV".

Per layer l >= 1 and token, with C = H_kv * head_dim channels (all KV heads of the token concatenated) and keys
taken before RoPE (the predictors were fitted on k_proj outputs, kvkernels.aqua):

    k_hat_l = k_hat_{l-1} @ Wk^T + bk + deq(k_codes_l)                           deq: lattice, G channels per group
    v_hat_l = k_hat_l @ Wv_k^T + v_hat_{l-1} @ Wv_v^T + bv + deq(v_codes_l)      ([k_hat ; v_prev_hat], keys first)

layer 0 stores its own K/V lattice-coded at first_layer_bits (4). One kernel, aqua_reconstruct, computes a
reconstruction from the layer below's and the stored codes.

Token layout per layer (the reference's PredictorHiggsCache): the first w_sink (4) tokens stay fp16 forever; new
tokens gather in an fp16 tail, and as soon as it holds >= block (128) tokens the whole tail is committed as one
chunk: un-rotated (the cache receives post-RoPE keys; positions are the token indices, so no left padding),
predicted from the layer below's reconstruction of the same chunk, the residual lattice-quantized, and
reconstructed. Layers are appended in layer order within a step (kvkernels.cache), so layer l commits the same
chunk right after layer l-1 and reads its reconstruction through the LayerContext.

Three modes (the issue's (a), (b), (c); docs/FORMATS.md "AQUA-KV" has the cost model):
- (b), the default (recompute=False): each committed chunk is reconstructed once, and the reconstruction (keys
  re-rotated) is kept in the cache dtype and attended directly: what the reference's evaluation does
  (save_dequantized_values). memory_bytes says what that costs: the codes + norms ("quantized", the offloadable
  representation), the fp16 reconstruction ("reconstruction", resident), the windows.
- (a) recompute=True: only the codes + norms stay resident. Every step, each layer's attention rebuilds the
  reconstruction of all its committed tokens with one aqua_reconstruct call per tensor, from the layer below's
  rebuild of the same step, handed up through the model's LayerContext.scratch, where each layer's rebuild replaces
  the one below's: two layers' fp32 reconstructions live at a time. Maximum memory saving, a [N, C] x [C, C]
  (+ [N, 2C] x [2C, C]) GEMM per layer per step.
- (c) reduced rank: a predictor file calibrated with `--rank r` (kvkernels.aqua.reduce_rank); either mode above.
  FLOPs per token fall from C^2 to 2rC (keys) and from 2C^2 to 3rC (values).
In every mode a commit hands the chunk's fp32 pre-RoPE reconstruction to the layer above's commit through the same
scratch (one slot, each layer's replacing the one below's, the top layer's not stored): transient, one layer's chunk.

Encode and decode agree bit for bit: the reconstruction a commit hands the layer above is aqua_reconstruct of the
stored codes, the same call reconstruct_from_codes makes later (chunk by chunk), so errors cannot compound
differently along the 30 layers (tests/test_format_aqua.py). Mode (a), and the decode of a chunk cut by crop, run the
same function over other row counts: bitwise the same wherever the GEMMs' per-row arithmetic does not depend on the
row count (the op's CUDA and Triton kernels: no split-K, a fixed K order per row; rank r's small projection GEMM is
torch's; CPU BLAS: observed so; the tests hold mode (a) to mode (b) at 1e-5).

Predictors come from a file written by `python -m kvkernels calibrate aqua` (kvkernels.aqua), given as the config
field `predictors` (a path or a loaded kvkernels.aqua.AquaPredictors):
    KVKernelsCache("aqua", config=model.config, predictors="build/aqua/smollm2-135m.safetensors")
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import ops
from .._validate import is_int
from ..attention import _grouped_matmul
from .base import EffectiveBits, Format, QuantizedLayerCache, SameForBothTensors, check_window
from .lattice import LATTICE_BITS, LatticeConfig, LatticeStore

_OPERAND_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # AquaConfig.operands


@dataclass(frozen=True)
class AquaConfig(SameForBothTensors):
    """AQUA-KV cache format.

    predictors:       a predictor file (kvkernels.aqua, `python -m kvkernels calibrate aqua`) or a loaded
                      kvkernels.aqua.AquaPredictors; required before the first token (no preset can carry one)
    bits:             residual bits per value on layers >= 1 (lattice, 2 / 3 / 4); must match the calibration's
    first_layer_bits: layer 0's bits (the reference hard-codes 4)
    dim, group_size, signs_seed: the lattice grid dimension, channels per group (a power of two dividing
                      head_dim: one group per head at 64), Hadamard signs; must match the calibration's
    w_sink:           first tokens kept fp16 (4)
    block:            fp16 tail tokens that trigger a commit of the whole tail (128)
    recompute:        mode (a): keep only the codes, rebuild the reconstruction every step (module docstring);
                      False = mode (b), keep the fp16 reconstruction resident
    operands:         the predictor GEMMs' operand dtype, "fp32" (exactly the calibration's arithmetic; the op's
                      slow path on a GPU), "bf16" or "fp16" (weights and inputs rounded to it, fp32 accumulation:
                      the op's tensor-core path); the encode and decode paths use the same operands either way
    """

    predictors: object = field(default=None, compare=False)
    bits: int = 2
    first_layer_bits: int = 4
    dim: int = 2
    group_size: int = 64
    signs_seed: int | None = None
    w_sink: int = 4
    block: int = 128
    recompute: bool = False
    operands: str = "fp32"

    mode = "lattice"

    def __post_init__(self):
        for name in ("bits", "first_layer_bits"):
            val = getattr(self, name)
            if not is_int(val) or val not in LATTICE_BITS:
                raise ValueError(f"{name} must be one of {LATTICE_BITS}, got {val!r}")
        self.lattice(0)  # the lattice fields (dim, group_size, signs_seed) are checked by LatticeConfig
        self.lattice(1)
        check_window("w_sink", self.w_sink)
        if not isinstance(self.block, int) or isinstance(self.block, bool) or self.block < 1:
            raise ValueError(f"block must be a positive int, got {self.block!r}")
        if not isinstance(self.recompute, bool):
            raise ValueError(f"recompute must be a bool, got {self.recompute!r}")
        if self.operands not in _OPERAND_DTYPES:
            raise ValueError(f"operands must be one of {sorted(_OPERAND_DTYPES)}, got {self.operands!r}")
        p = self.predictors
        if p is not None and not isinstance(p, (str, os.PathLike)) and not hasattr(p, "layers"):
            raise ValueError(
                f"predictors must be a file path or a kvkernels.aqua.AquaPredictors, got {type(p).__name__}"
            )

    @property
    def w_recent(self) -> int:  # the most tokens the fp16 tail holds between commits
        return self.block - 1

    def eta_for(self, mode: str) -> float:
        return 0.0

    def lattice(self, layer: int) -> LatticeConfig:
        """The lattice config of layer's residual codes: one row of H_kv * head_dim channels per token."""
        bits = self.first_layer_bits if layer == 0 else self.bits
        return LatticeConfig(
            bits=bits,
            dim=self.dim if bits == 2 else 2,
            group_size=self.group_size,
            cross_head=True,
            signs_seed=self.signs_seed,
            w_sink=0,
            w_recent=0,
        )

    def backbone_settings(self) -> dict:
        """The fields a predictor file's calibration backbone must share (kvkernels.aqua.Backbone)."""
        return {
            "bits": self.bits,
            "first_layer_bits": self.first_layer_bits,
            "dim": self.dim,
            "group_size": self.group_size,
            "signs_seed": self.signs_seed,
        }


_LOADED: dict[tuple[str, float], object] = {}
_REBUILD = "aqua.rebuild"  # LayerContext.scratch entries (AquaLayerCache's docstring)
_CHUNK = "aqua.chunk"
_VERSIONS = itertools.count()  # layer-state versions: a rebuild is valid for the version it was made from


def resolve_predictors(config: AquaConfig):
    """config.predictors as an AquaPredictors (a file is read once per path and modification time)."""
    from ..aqua import load_predictors

    p = config.predictors
    if p is None:
        raise ValueError(
            "the aqua format needs calibrated predictors: make a file with `python -m kvkernels calibrate aqua "
            "--model DIR` and pass it, e.g. KVKernelsCache('aqua', config=model.config, "
            "predictors='build/aqua/smollm2-135m.safetensors')"
        )
    if not isinstance(p, (str, os.PathLike)):
        preds = p
    else:
        path = Path(p).expanduser().resolve()
        key = (str(path), path.stat().st_mtime if path.is_file() else 0.0)
        if key not in _LOADED:
            _LOADED[key] = load_predictors(path)
        preds = _LOADED[key]
    settings = preds.settings.get("backbone", {})
    want = config.backbone_settings()
    diff = {k: (settings.get(k), v) for k, v in want.items() if settings.get(k) != v}
    if diff:
        raise ValueError(
            "aqua: the predictors were calibrated with another backbone (field: calibrated, configured): "
            + ", ".join(f"{k}: {a!r}, {b!r}" for k, (a, b) in diff.items())
        )
    return preds


class _Reconstruction:
    """The fp16 reconstruction of one tensor's committed tokens, [B, H, cap, D] in the cache dtype, grown by
    doubling (mode b: what attention reads)."""

    def __init__(self, batch, heads, head_dim, capacity, device, dtype):
        self.n = 0
        self.buf = torch.zeros(batch, heads, max(capacity, 1), head_dim, device=device, dtype=dtype)

    def write(self, x: torch.Tensor) -> None:
        n = x.shape[2]
        if self.n + n > self.buf.shape[2]:
            grown = self.buf.new_zeros(*self.buf.shape[:2], max(2 * self.buf.shape[2], self.n + n), self.buf.shape[3])
            grown[:, :, : self.n] = self.buf[:, :, : self.n]
            self.buf = grown
        self.buf[:, :, self.n : self.n + n] = x
        self.n += n

    def view(self) -> torch.Tensor:
        return self.buf[:, :, : self.n]

    def used_bytes(self) -> int:
        return self.view().numel() * self.buf.element_size()

    def allocated_bytes(self) -> int:
        return self.buf.numel() * self.buf.element_size()


class AquaLayerCache(QuantizedLayerCache):
    """One layer of an AQUA-KV cache (module docstring): fp16 sink | committed chunks | fp16 tail.

    key_store / value_store: the residual codes (LatticeStore, one row of C channels per token);
    chunks: the committed (lo, hi) token ranges, counted after the sink; mode (b): the fp16 reconstructions of the
    committed tokens (_k_rec post-RoPE, _v_rec). In the model's scratch (LayerContext.scratch): _REBUILD = (layer,
    version, n, k_hat_pre, v_hat), mode (a)'s latest rebuild of a layer's n committed tokens, and _CHUNK = (layer,
    version, lo, hi, k_hat_pre, v_hat), the latest commit's chunk reconstruction, all fp32 [B * rows, C], each until
    the layer above replaces it. _version changes with every commit, crop, batch edit and reset, so a stale entry is
    never read; a layer drops its own entries when its state changes.
    """

    format: AquaFormat  # set below

    def __init__(
        self, config, batch, num_kv_heads, head_dim, capacity=1024, device="cpu", dtype=torch.float16, *, context=None
    ):
        if not isinstance(config, AquaConfig):
            raise TypeError(f"AquaLayerCache needs an AquaConfig, got {type(config).__name__}")
        self.layer_idx = 0 if context is None else context.layer_idx
        self.preds = resolve_predictors(config)
        C = num_kv_heads * head_dim
        if self.preds.num_layers > 1 and self.preds.channels != C:
            raise ValueError(
                f"aqua: the predictors are for {self.preds.channels} channels per token, this layer has "
                f"H_kv * head_dim = {num_kv_heads} * {head_dim} = {C}"
            )
        if not self.layer_idx < self.preds.num_layers:
            raise ValueError(f"aqua: layer {self.layer_idx}, but the predictors cover {self.preds.num_layers} layers")
        if self.preds.inv_freq.numel() * 2 != head_dim:
            raise ValueError(f"aqua: the predictors' RoPE is for head_dim {self.preds.inv_freq.numel() * 2}")
        super().__init__(config, batch, num_kv_heads, head_dim, capacity, device, dtype, context=context)
        p = self.preds.layers[self.layer_idx]
        self.weights = None if p is None else p.to(self.device, _OPERAND_DTYPES[config.operands])
        self.inv_freq = self.preds.inv_freq.to(self.device, torch.float32)
        self.lattice_args = self._lattice_args()

    def _lattice_args(self):
        store = self.key_store
        return store.grid, store.group_size, store.signs

    def _make_store(self, tensor, layout, bits, group_size, mode, eta, batch, heads, head_dim, capacity, device):
        return LatticeStore(self.config.lattice(self.layer_idx), batch, heads, head_dim, capacity, device)

    def reset(self) -> None:
        super().reset()
        cap = 0 if self.config.recompute else self.key_store.cap
        self._k_rec = _Reconstruction(self.batch, self.num_kv_heads, self.head_dim, cap, self.device, self.dtype)
        self._v_rec = _Reconstruction(self.batch, self.num_kv_heads, self.head_dim, cap, self.device, self.dtype)
        self.chunks: list[tuple[int, int]] = []
        self._new_version()

    def _new_version(self) -> None:
        """The layer's state changed: entries it left in the scratch are stale; drop them (memory) and re-key."""
        if hasattr(self, "_version"):
            scratch = self._scratch()
            for slot in (_REBUILD, _CHUNK):
                held = scratch.get(slot)
                if held is not None and held[:2] == (self.layer_idx, self._version):
                    del scratch[slot]
        self._version = next(_VERSIONS)

    def _is_top(self) -> bool:
        return self.context is None or self.context.num_layers == self.layer_idx + 1

    # -- writes ----------------------------------------------------------------------------------------------
    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append n >= 1 tokens' post-RoPE K / V [B, H_kv, n, D]: the sink fills first, then the fp16 tail, which is
        committed whole (module docstring) once it holds >= block tokens."""
        self._check_kv(k, v)
        if k.shape[2] == 0:
            return
        if self._sink_k.is_inference() and not torch.is_inference_mode_enabled():
            self._map_batch(torch.clone)  # buffers made under inference_mode cannot be written in place outside it
        k, v = k.to(self.dtype), v.to(self.dtype)
        take = min(self.w_sink - self.n_sink, k.shape[2])
        if take:
            self._sink_k[:, :, self.n_sink : self.n_sink + take] = k[:, :, :take]
            self._sink_v[:, :, self.n_sink : self.n_sink + take] = v[:, :, :take]
            self.n_sink += take
        self.key_tail = torch.cat([self.key_tail, k[:, :, take:]], dim=2)
        self.value_tail = torch.cat([self.value_tail, v[:, :, take:]], dim=2)
        if self.key_tail.shape[2] >= self.config.block:
            self._commit(self.key_tail, self.value_tail)
            self.key_tail, self.value_tail = self._empty_window(), self._empty_window()

    def _rows(self, x: torch.Tensor) -> torch.Tensor:  # [B, H, n, D] -> [B * n, C]
        B, H, n, D = x.shape
        return x.permute(0, 2, 1, 3).reshape(B * n, H * D)

    def _heads(self, rows: torch.Tensor, n: int) -> torch.Tensor:  # [B * n, C] -> [B, H, n, D]
        return rows.reshape(self.batch, n, self.num_kv_heads, self.head_dim).permute(0, 2, 1, 3)

    def _positions(self, lo: int, hi: int) -> torch.Tensor:
        return torch.arange(self.w_sink + lo, self.w_sink + hi, device=self.device)

    def _commit(self, k_post: torch.Tensor, v: torch.Tensor) -> None:
        """Encode (Alg. 2) the chunk k_post / v [B, H, n, D] and keep its reconstruction."""
        from ..aqua import rope

        lo, n = self.key_store.n, k_post.shape[2]
        hi = lo + n
        pos = self._positions(lo, hi)
        k_pre = self._rows(rope(k_post, pos, self.inv_freq, self.preds.rope_scaling, inverse=True))
        v_rows = self._rows(v.to(torch.float32))
        w = self.weights
        if w is None:  # layer 0: quantized directly
            kp = vp = None
            k_res, v_res = k_pre, v_rows
        else:
            kp, vp = self._below(lo, hi)
            k_res = k_pre - w.predict("key", kp)
        self.key_store.write(self._heads(k_res, n))
        k_hat = self._reconstruct("key", lo, hi, kp)
        if w is not None:
            v_res = v_rows - w.predict("value", k_hat, vp)
        self.value_store.write(self._heads(v_res, n))
        v_hat = self._reconstruct("value", lo, hi, k_hat, vp)
        if not self.config.recompute:
            self._k_rec.write(self._rotated(k_hat, lo, hi))
            self._v_rec.write(self._heads(v_hat, n).to(self.dtype))
        self.chunks.append((lo, hi))
        self._new_version()
        if not self._is_top():  # for the layer above's commit of the same chunk; replaces the layer below's
            self._scratch()[_CHUNK] = (self.layer_idx, self._version, lo, hi, k_hat, v_hat)

    def _rotated(self, k_hat: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Pre-RoPE rows [B * n, C] of tokens [lo, hi) -> post-RoPE keys [B, H, n, D] in the cache dtype."""
        from ..aqua import rope

        k = self._heads(k_hat, hi - lo)
        return rope(k, self._positions(lo, hi), self.inv_freq, self.preds.rope_scaling).to(self.dtype)

    def _below_layer(self):
        return None if self.context is None else self.context.layer(self.layer_idx - 1)

    def _below(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer below's reconstruction of the chunk [lo, hi) this layer commits, from its commit."""
        below = self._below_layer()
        held = self._scratch().get(_CHUNK)
        if below is None or held is None or held[:4] != (self.layer_idx - 1, below._version, lo, hi):
            have = "nothing" if held is None else f"layer {held[0]}'s tokens [{held[2]}, {held[3]})"
            raise RuntimeError(
                f"aqua: layer {self.layer_idx} commits tokens [{lo}, {hi}) and needs layer {self.layer_idx - 1}'s "
                f"reconstruction of them, and the model's hand-off holds {have}; layers must be appended in order "
                "within a step (ModelKVCache, KVKernelsCache do)"
            )
        return held[4], held[5]

    def _reconstruct(self, tensor: str, lo: int, hi: int, prev, prev_v=None) -> torch.Tensor:
        """fp32 [B * n, C] reconstruction of tokens [lo, hi) of `tensor` from its codes and the layer below's
        reconstruction (prev: keys -> k_hat_{l-1}; values -> k_hat_l, with prev_v = v_hat_{l-1}). The one function
        both the encode (commit) and the decode (reconstruct_from_codes) paths call."""
        store = self.key_store if tensor == "key" else self.value_store
        codes, norms, _ = store.views(lo, hi)  # [B, 1, n, W], [B, 1, n, C / G]
        codes, norms = codes.reshape(-1, codes.shape[-1]), norms.reshape(-1, norms.shape[-1])
        grid, G, signs = self.lattice_args
        if self.weights is None:
            return ops.lattice_dequantize(codes, norms, grid, G, signs)
        return self.weights.reconstruct(tensor, prev, codes, norms, grid, G, signs, prev_v)

    def _scratch(self) -> dict:
        if self.context is not None:
            return self.context.scratch
        if not hasattr(self, "_own_scratch"):  # a standalone layer (no model): its own slot
            self._own_scratch = {}
        return self._own_scratch

    def _rebuilt(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Mode (a): (k_hat_pre, v_hat) fp32 [B * n, C] of all n committed tokens, rebuilt from the codes and the
        layer below's rebuild (read from the scratch slot if it holds the below layer's current one, else rebuilt
        down the layers), then put in the slot in place of the layer below's: the layer above reads it next."""
        n = self.key_store.n
        scratch = self._scratch()
        held = scratch.get(_REBUILD)
        if held is not None and held[:3] == (self.layer_idx, self._version, n):
            return held[3], held[4]
        if self.weights is None:
            k = self._reconstruct("key", 0, n, None)
            v = self._reconstruct("value", 0, n, None)
        else:
            below = self._below_layer()
            if below is None or below.key_store.n != n:
                have = "no layer" if below is None else f"{below.key_store.n} committed tokens"
                raise RuntimeError(
                    f"aqua: layer {self.layer_idx} has {n} committed tokens and needs layer {self.layer_idx - 1}'s, "
                    f"which has {have}; layers must be appended in order within a step"
                )
            kp, vp = below._rebuilt()
            k = self._reconstruct("key", 0, n, kp)
            v = self._reconstruct("value", 0, n, k, vp)
        scratch[_REBUILD] = (self.layer_idx, self._version, n, k, v)  # replaces the layer below's: two alive at a time
        return k, v

    def _committed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Post-RoPE keys and values [B, H, n, D] of the n committed tokens, in the cache dtype: the stored
        reconstruction (mode b) or this step's rebuild (mode a), the same values either way."""
        if not self.config.recompute:
            return self._k_rec.view(), self._v_rec.view()
        n = self.key_store.n
        k, v = self._rebuilt()
        return self._rotated(k, 0, n), self._heads(v, n).to(self.dtype)

    # -- the attention hooks: attend the reconstruction --------------------------------------------------------
    def quantized_key_scores(self, x: torch.Tensor) -> torch.Tensor:
        if not self.config.recompute:
            return _grouped_matmul(x, self._k_rec.view().to(torch.float32).transpose(2, 3))
        k, _ = self._rebuilt()
        return _grouped_matmul(x, self._rotated(k, 0, self.key_store.n).to(torch.float32).transpose(2, 3))

    def quantized_value_output(self, p: torch.Tensor) -> torch.Tensor:
        if not self.config.recompute:
            return _grouped_matmul(p, self._v_rec.view().to(torch.float32))
        _, v = self._rebuilt()
        out = _grouped_matmul(p, self._heads(v, self.key_store.n).to(self.dtype).to(torch.float32))
        if self._is_top():  # no layer above reads it: hold nothing between steps
            self._new_version()
        return out

    # -- reads -----------------------------------------------------------------------------------------------
    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        k_rec, v_rec = self._committed()
        k = torch.cat([self.sink_keys.float(), k_rec.float(), self.key_tail.float()], dim=2)
        v = torch.cat([self.sink_values.float(), v_rec.float(), self.value_tail.float()], dim=2)
        return k, v

    def memory_bytes(self) -> dict[str, int]:
        """As QuantizedLayerCache's, plus "reconstruction": the resident fp16 reconstruction of the committed tokens
        (mode b; 0 in mode a), counted in total. "quantized" is the codes + norms (the offloadable representation);
        the predictors (shared by all layers' caches, ~13 MB fp32 for SmolLM2), the transient last chunk and mode
        (a)'s per-step rebuild (two layers' fp32 [B * n, C] K and V at a time) are not counted."""
        out = super().memory_bytes()
        rec = self._k_rec.used_bytes() + self._v_rec.used_bytes()
        out["reconstruction"] = rec
        out["total"] += rec
        out["allocated"] += self._k_rec.allocated_bytes() + self._v_rec.allocated_bytes()
        return out

    def crop(self, n: int) -> None:
        """Keep the first n tokens (n < 0: drop the last -n). Nothing is re-encoded: a token's reconstruction
        depends only on its own codes and its own row in the layer below (the predictors act per token), so a cut
        inside a committed chunk keeps the chunk's first tokens decodable as they are; the chunk just ends there.
        Every layer of a model must be cropped alike (DynamicCache.crop does), or the next commit's chunk
        boundaries differ between layers (a clear error then)."""
        N = self.seq_len
        if n < 0:
            n = max(N + n, 0)
        if n >= N:
            return
        if n == 0:
            self.reset()
            return
        rest = max(n - self.w_sink, 0)  # tokens kept after the sink
        committed = self.key_store.n
        if n > self.n_sink and rest >= committed:  # the cut is in the fp16 tail
            self.key_tail = self.key_tail[:, :, : rest - committed]
            self.value_tail = self.value_tail[:, :, : rest - committed]
            return
        self.n_sink = min(self.n_sink, n)
        for store in (self.key_store, self.value_store):
            store.truncate(rest)
        self.key_tail, self.value_tail = self._empty_window(), self._empty_window()
        self.chunks = [(lo, min(hi, rest)) for lo, hi in self.chunks if lo < rest]
        for rec in (self._k_rec, self._v_rec):
            rec.n = min(rec.n, rest)
        self._new_version()

    def _map_batch(self, fn) -> None:
        super()._map_batch(fn)
        self._new_version()  # hand-offs are within a step; batch edits come between steps
        for rec in (self._k_rec, self._v_rec):
            rec.buf = fn(rec.buf)


def reconstruct_from_codes(layers) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The decode path (Alg. 3) over a model's AquaLayerCaches in layer order: every layer's (k_hat_pre, v_hat)
    fp32 [B * committed, C] rebuilt from the stored codes alone, chunk by chunk from layer 0 up."""
    out: list[tuple[list, list]] = [([], []) for _ in layers]
    for lo, hi in layers[0].chunks:
        k_prev = v_prev = None
        for l, layer in enumerate(layers):
            if (lo, hi) not in layer.chunks:
                raise ValueError(f"layer {l} did not commit tokens [{lo}, {hi})")
            k_hat = layer._reconstruct("key", lo, hi, k_prev)
            v_hat = layer._reconstruct("value", lo, hi, k_hat, v_prev)
            out[l][0].append(k_hat.reshape(layer.batch, hi - lo, -1))
            out[l][1].append(v_hat.reshape(layer.batch, hi - lo, -1))
            k_prev, v_prev = k_hat, v_hat
    return [(torch.cat(k, 1).reshape(-1, k[0].shape[-1]), torch.cat(v, 1).reshape(-1, v[0].shape[-1])) for k, v in out]


class AquaFormat(Format):
    name = "aqua"
    config_type = AquaConfig
    layer_cache_type = AquaLayerCache
    key_layout, value_layout = "rows", "rows"
    gemv_op = "aqua_reconstruct"  # not a GEMV: mode (b) attends the reconstruction (AquaLayerCache's hooks)
    # No registered presets: a preset cannot carry the predictors, which exist only after calibration, and every
    # preset must build a cache on its own (the eval, the bench and the protocol tests run them all). Build the
    # config directly: AquaConfig(predictors=PATH) (ModelKVCache), or see docs/FORMATS.md for KVKernelsCache.
    presets = {}
    reference_layers = 30  # SmolLM2-135M, the eval model: effective_bits' default depth

    def gemv(self, fn, x, codes, scales, zeros, bits, group_size, mode, x_scale=None):
        raise NotImplementedError("the aqua format attends its reconstruction; it has no quantized GEMV")

    def effective_bits(self, config, num_layers: int | None = None) -> EffectiveBits:
        """Stored bits per value averaged over a num_layers-layer model (default 30): layer 0 at first_layer_bits,
        the others at bits, each + 16 / G for the fp16 norm. The paper's accounting (Table 2). The fp16
        reconstruction that mode (b) keeps resident is not counted here (memory_bytes counts it)."""
        L = num_layers or self.reference_layers
        meta = 16.0 / config.group_size
        per_value = ((L - 1) * (config.bits + meta) + (config.first_layer_bits + meta)) / L
        window = config.w_sink + config.block - 1
        return EffectiveBits(per_value, per_value, per_value, window, window)

    def describe(self, config) -> str:
        mode = "(a), rebuilt every step" if config.recompute else "(b), fp16 reconstruction kept"
        return (
            f"AQUA-KV mode {mode}: linear cross-layer predictors + {config.bits}b lattice residual (layer 0: "
            f"{config.first_layer_bits}b), G {config.group_size}, {config.w_sink} fp16 sinks, commit every "
            f"{config.block} tokens"
        )


FORMAT = AquaFormat()
AquaLayerCache.format = FORMAT

__all__ = ["FORMAT", "AquaConfig", "AquaFormat", "AquaLayerCache", "reconstruct_from_codes", "resolve_predictors"]
