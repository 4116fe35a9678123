"""AQUA-KV decode-step cost at the cache level, per mode, next to its backbone alone and a dense cache; and the
reconstruction op against the unfused PyTorch path.

    python bench/aqua_step.py [--device cpu|cuda] [--tokens 8192 32768] [--layers 30] [--steps 3] [--ranks 32 64]

Step: per layer, append one token and decode attention (9 query heads on 3 KV heads, head_dim 64, batch 1: SmolLM2-
135M's shapes), over a cache prefilled with N synthetic tokens. Rows:
  dense          the K/V in a preallocated buffer of the cache dtype, attention by two matmuls (DynamicCache's work)
  lattice2       the backbone alone (2-bit lattice, the quantized GEMVs)
  aqua (b)       the kept fp16 reconstruction, attended as a dense cache
  aqua (a)       codes only: every layer rebuilds all N committed tokens each step (aqua_reconstruct per tensor)
  aqua (a) r=R   the same with rank-R predictors (mode c)
Predictors are random of the right shapes (cost does not depend on their values); no model or calibration needed.
The median step is reported: a step that commits a chunk (one in 128) is an outlier the median leaves out.

Op: aqua_reconstruct of T rows (keys: [T, C] x [C, C]; values: two such GEMMs) against the unfused path (matmul(s),
bias add, lattice_dequantize, add: the GEMM result written and read back), for T = one chunk (128) and T = N.

On CPU the ops are the PyTorch reference: timings there are ratios between CPU code paths and say nothing about GPU
speed (the fused op *is* the unfused path on CPU). Run with --device cuda on a GPU for the numbers that matter.
"""

import argparse
import dataclasses
import statistics
import time

import torch

from kvkernels import aqua, ops
from kvkernels.attention import _grouped_matmul
from kvkernels.cache import ModelKVCache
from kvkernels.formats import PRESETS
from kvkernels.formats.aqua import AquaConfig


def random_predictors(layers: int, C: int, head_dim: int, rank: int | None, seed: int = 0) -> aqua.AquaPredictors:
    g = torch.Generator().manual_seed(seed)

    def mat(rows, cols):  # spectral norm ~0.6: 30 layers of reconstructions stay bounded
        q, _ = torch.linalg.qr(torch.randn(max(rows, cols), max(rows, cols), generator=g))
        return 0.6 * q[:rows, :cols]

    def layer():
        kb, vb = 0.1 * torch.randn(C, generator=g), 0.1 * torch.randn(C, generator=g)
        if rank is None:
            return aqua.LayerPredictors(mat(C, C), kb, mat(C, 2 * C), vb)
        return aqua.LayerPredictors(mat(C, rank), kb, mat(C, rank), vb, mat(rank, C), mat(rank, 2 * C))

    inv_freq = 1.0 / (1e5 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    backbone = dataclasses.asdict(aqua.Backbone())
    return aqua.AquaPredictors([None] + [layer() for _ in range(1, layers)], inv_freq, 1.0, {}, {"backbone": backbone})


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class DenseLayers:
    """A DynamicCache-like dense cache: preallocated [1, H, cap, D] buffers, attention by two matmuls."""

    def __init__(self, layers, k, v, cap):
        self.n = k.shape[2]
        self.k = [torch.zeros(*k.shape[:2], cap, k.shape[3], dtype=k.dtype, device=k.device) for _ in range(layers)]
        self.v = [torch.zeros_like(b) for b in self.k]
        for kb, vb in zip(self.k, self.v, strict=True):
            kb[:, :, : self.n], vb[:, :, : self.n] = k, v

    def step(self, kn, q):
        for kb, vb in zip(self.k, self.v, strict=True):
            kb[:, :, self.n : self.n + 1], vb[:, :, self.n : self.n + 1] = kn, kn
            s = _grouped_matmul(q.float(), kb[:, :, : self.n + 1].float().transpose(2, 3)) / q.shape[-1] ** 0.5
            _grouped_matmul(s.softmax(-1), vb[:, :, : self.n + 1].float())
        self.n += 1


def step_ms(config, n_tokens, layers, Hq, Hkv, D, steps, device) -> float:
    dtype = torch.float16 if device.type == "cuda" else torch.float32  # fp16 matmuls are emulated on CPU
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, Hkv, n_tokens, D, generator=g).to(device, dtype)
    v = torch.randn(1, Hkv, n_tokens, D, generator=g).to(device, dtype)
    if config is None:
        cache = DenseLayers(layers, k, v, n_tokens + steps + 1)
    else:
        model = ModelKVCache(config, num_layers=layers, capacity=n_tokens + steps + 8)
        for layer in range(layers):
            model.append(layer, k, v)
        caches = [model.layer(i) for i in range(layers)]
    del k, v
    times = []
    for step in range(steps + 1):  # the first step warms up
        q = torch.randn(1, Hq, 1, D, generator=g).to(device, dtype)
        kn = torch.randn(1, Hkv, 1, D, generator=g).to(device, dtype)
        _sync(device)
        t0 = time.perf_counter()
        if config is None:
            cache.step(kn, q)
        else:
            for c in caches:
                c.append(kn, kn)
                c.attention(q)
        _sync(device)
        if step:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def op_ms(T, C, which, device, reps=5) -> tuple[float, float]:
    """(fused, unfused) ms of one reconstruction of T tokens x C channels (which: key / value)."""
    g = torch.Generator().manual_seed(1)
    p = random_predictors(2, C, 64, None).layers[1].to(device)
    bb = aqua.Backbone()
    grid, G, signs = bb.args(1, device)
    prev = torch.randn(T, C, generator=g).to(device)
    prev_v = torch.randn(T, C, generator=g).to(device) if which == "value" else None
    codes, norms = bb.quantize(torch.randn(T, C, generator=g).to(device), 1)

    def fused():
        return p.reconstruct(which, prev, codes, norms, grid, G, signs, prev_v)

    def unfused():
        return p.predict(which, prev, prev_v) + ops.lattice_dequantize(codes, norms, grid, G, signs)

    out = []
    for fn in (fused, unfused):
        fn()
        _sync(device)
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            _sync(device)
            ts.append(time.perf_counter() - t0)
        out.append(statistics.median(ts) * 1e3)
    return out[0], out[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--ranks", type=int, nargs="*", default=[32, 64])
    ap.add_argument("--skip-op", action="store_true", help="skip the op table")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    Hq, Hkv, D = 9, 3, 64
    C = Hkv * D
    full = random_predictors(args.layers, C, D, None)
    variants = [
        ("dense", None),
        ("lattice2 (backbone alone)", PRESETS["lattice2"]),
        ("aqua (b) kept reconstruction", AquaConfig(predictors=full)),
        ("aqua (a) recompute", AquaConfig(predictors=full, recompute=True)),
    ]
    for r in args.ranks:
        low = random_predictors(args.layers, C, D, r)
        variants.append((f"aqua (a) recompute, rank {r}", AquaConfig(predictors=low, recompute=True)))
    dtype = "fp16" if device.type == "cuda" else "fp32"
    label = "" if device.type == "cuda" else " (CPU: reference ops, not a GPU prediction)"
    print(
        f"device {device}{label}, torch {torch.__version__}, threads {torch.get_num_threads()}; {args.layers} "
        f"layers, {Hq}/{Hkv} heads, head_dim {D}, batch 1, {dtype} cache; median of {args.steps} steps"
    )
    print("\n| tokens | variant | ms / step | vs dense | vs lattice2 |")
    print("|---|---|---|---|---|")
    for n in args.tokens:
        base = {}
        for name, cfg in variants:
            ms = step_ms(cfg, n, args.layers, Hq, Hkv, D, args.steps, device)
            base.setdefault("dense", ms)
            if cfg is not None and "lattice2" in name:
                base["lattice2"] = ms
            vs_lat = f"{ms / base['lattice2']:.2f}x" if "lattice2" in base else "-"
            print(f"| {n} | {name} | {ms:.1f} | {ms / base['dense']:.2f}x | {vs_lat} |", flush=True)
    if not args.skip_op:
        print("\naqua_reconstruct vs the unfused path (matmul + bias, lattice_dequantize, add), one layer")
        print("| C | T | tensor | fused ms | unfused ms | unfused / fused |")
        print("|---|---|---|---|---|---|")
        for c in (C, 1024):
            for T in (128, *args.tokens):
                for which in ("key", "value"):
                    f, u = op_ms(T, c, which, device)
                    print(f"| {c} | {T} | {which} | {f:.2f} | {u:.2f} | {u / f:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
