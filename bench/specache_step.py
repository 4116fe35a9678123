"""SpeCache decode-step cost at the cache level: attention over every layer of a model-shaped cache, with and without
the top-k prefetch, next to KIVI at the same device memory, and the bytes a step moves between host and device.

    python bench/specache_step.py [--device cpu|cuda] [--tokens 2048 8192] [--layers 30] [--steps 8]

Per step and layer: append the new token(s), decode attention, (SpeCache) choose the next top-k and prefetch it,
drop the speculative row. Shapes default to SmolLM2-135M's (30 layers, 9 query / 3 KV heads, head_dim 64),
batch 1, an fp16 cache on CUDA and fp32 on CPU.
Rows: kivi1_eta (1 query row), specache1 with its two rows (real + speculative) and top-64 prefetch, and
specache1 with topk=0 (the two rows alone: what the prefetch itself costs is the difference). The timings are
ratios within one run on one device; on CPU the ops are the PyTorch reference (dequantize inside each GEMV), so they
say nothing about GPU speed, and the host<->device copies are plain tensor copies.
"""

import argparse
import statistics
import time

import torch

from kvkernels.cache import ModelKVCache
from kvkernels.formats import PRESETS, format_of
from kvkernels.formats.specache import pcie_bytes_per_step, set_speculative_rows


def run(config, n_tokens, layers, heads_q, heads_kv, head_dim, steps, device, rows):
    # fp16 on CUDA; fp32 on CPU, where fp16 matmuls are emulated and would dominate (the eval model runs fp32 there)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    model = ModelKVCache(config, num_layers=layers, capacity=n_tokens + steps + 8)
    k = torch.randn(1, heads_kv, n_tokens, head_dim, generator=g).to(device, dtype)
    v = torch.randn(1, heads_kv, n_tokens, head_dim, generator=g).to(device, dtype)
    for layer in range(layers):
        model.append(layer, k, v)
    layer_caches = [model.layer(i) for i in range(layers)]
    times = []
    for step in range(steps + 1):  # the first step warms up (and makes the first choice)
        q = torch.randn(1, heads_q, rows, head_dim, generator=g).to(device, dtype)
        kn = torch.randn(1, heads_kv, rows, head_dim, generator=g).to(device, dtype)
        set_speculative_rows(layer_caches, rows - 1)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for cache in layer_caches:
            cache.append(kn, kn)
            cache.attention(q)
            if rows > 1:
                cache.drop_speculative()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if step:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    Hq, Hkv, D = 9, 3, 64
    spec = PRESETS["specache1"]
    variants = [
        ("kivi1_eta", PRESETS["kivi1_eta"], 1),
        ("specache1 (2 rows, top-64)", spec, 2),
        ("specache1 topk=0 (2 rows)", format_of(spec).apply_overrides(spec, {"topk": 0}), 2),
    ]
    dtype = "fp16" if device.type == "cuda" else "fp32"
    print(
        f"device {device}, torch {torch.__version__}, threads {torch.get_num_threads()}; {args.layers} layers, "
        f"{Hq}/{Hkv} heads, head_dim {D}, batch 1, {dtype} cache; median of {args.steps} steps"
    )
    print("| tokens | variant | ms / step | vs kivi1_eta |")
    print("|---|---|---|---|")
    for n in args.tokens:
        base = None
        for name, cfg, rows in variants:
            ms = run(cfg, n, args.layers, Hq, Hkv, D, args.steps, device, rows)
            base = base or ms
            print(f"| {n} | {name} | {ms:.1f} | {ms / base:.2f}x |")
    moved = pcie_bytes_per_step(PRESETS["specache1"], args.layers, 1, Hkv, D)
    print(f"\nhost<->device bytes per step (specache1, these shapes): {moved['h2d']:,} prefetched (H2D) + "
          f"{moved['d2h']:,} offloaded (D2H) = {moved['total']:,}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
