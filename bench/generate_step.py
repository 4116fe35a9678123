"""Whole-model decode steps through generate(): the time per generated token of each cache, in the same run.

    python bench/generate_step.py [--device cuda|cpu] [--model 1b|tiny] [--tokens 1024 8192] [--batch 1 8]
                                  [--presets innerq_base kivi2] [--new 64] [--json out.json]

A random-weight Llama of the chosen shape (no download: the GPU machines have no network) in fp16 on CUDA (fp32 on
CPU), a random prompt of N tokens, greedy decoding. Rows per (batch, N):
  fp16 dynamic        transformers' DynamicCache, eager (the default generate())
  fp16 static+compile transformers' StaticCache, the decode step compiled (CUDA: inductor, reduce-overhead)
  <preset> dynamic    KVKernelsCache, eager: the fused decode attention, host-side bookkeeping every step
  <preset> static     KVKernelsStaticCache, the decode step compiled like fp16's static row (CUDA graphs on a GPU)
Time per token = (time of generate(max_new_tokens=new) - time of generate(max_new_tokens=new // 2)) / (new - new // 2),
medians of --reps runs after a warm-up run (which also compiles): prefill, compilation and whatever happens once per
call cancel out. The static rows reuse one cache with reset() across calls, as a server would (its buffers, and so
the compiled step's CUDA graph, stay); the dynamic rows make a cache per call, as generate() does. "vs fp16" is the
fp16 dynamic row's time / the row's (> 1: faster); "vs fp16 static" the same against the compiled fp16 row. Every
quantized row's generated tokens are compared with its dynamic twin's (the static path must decode the same).

On CPU (--model tiny) the rows compare CPU code paths (the fused op is the PyTorch reference there) and say nothing
about GPU speed: this script is for the GPU sessions (bench/gpu_verify.sh and the GPU-verification issue).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

MODELS = {
    # Llama-3.2-1B's attention and depth (GQA 4, head_dim 64), a small vocabulary: the KV cache dominates at long N
    "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 32000},
    "tiny": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8,
             "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024},
}  # fmt: skip


def build_model(shape: str, device: torch.device, max_tokens: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvkernels.integrations.transformers import set_kvkernels_attention

    cfg = LlamaConfig(
        **MODELS[shape], max_position_embeddings=max_tokens + 64, bos_token_id=None, eos_token_id=None, pad_token_id=0
    )
    torch.manual_seed(0)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype).eval()
    set_kvkernels_attention(model)  # SDPA for the fp16 caches (no handles reach it), fused for the kvkernels ones
    return model


def compile_config(device: torch.device, backend: str):
    from transformers import CompileConfig

    if device.type == "cuda":  # generate()'s default: inductor, mode="reduce-overhead" (the step as a CUDA graph)
        return CompileConfig(fullgraph=True, backend=backend)
    cc = CompileConfig(backend=backend, fullgraph=True, mode=None)
    cc._compile_all_devices = True
    return cc


def make_cache(kind: str, preset: str | None, model, max_len: int):
    from transformers import DynamicCache, StaticCache

    from kvkernels.integrations.transformers import KVKernelsCache, KVKernelsStaticCache

    if preset is None:
        if kind == "dynamic":
            return DynamicCache(config=model.config)
        return StaticCache(config=model.config, max_cache_len=max_len)
    if kind == "dynamic":
        return KVKernelsCache(preset, config=model.config)
    return KVKernelsStaticCache(preset, config=model.config, max_cache_len=max_len)


def timed_generate(model, ids, cache_fn, new: int, compiled, device) -> tuple[float, torch.Tensor]:
    """Seconds of one generate() of `new` tokens (compiled: a torch.compile backend name, or None for eager)."""
    from kvkernels.integrations.compat import cache_kwarg

    kw = {"do_sample": False, "max_new_tokens": new, "min_new_tokens": new, cache_kwarg(): cache_fn()}
    kw["compile_config"] = compile_config(device, compiled) if compiled else None
    kw["disable_compile"] = not compiled
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, **kw)
    sync()
    return time.perf_counter() - t0, out


def per_token_us(model, ids, cache_fn, new: int, compiled, device, reps: int) -> tuple[float, torch.Tensor]:
    timed_generate(model, ids, cache_fn, new, compiled, device)  # warm-up (and compilation)
    long, short = [], []
    out = None
    for _ in range(reps):
        t, out = timed_generate(model, ids, cache_fn, new, compiled, device)
        long.append(t)
        short.append(timed_generate(model, ids, cache_fn, new // 2, compiled, device)[0])
    return (statistics.median(long) - statistics.median(short)) / (new - new // 2) * 1e6, out


def run(args) -> list[dict]:
    device = torch.device(args.device)
    model = build_model(args.model, device, max(args.tokens) + args.new)
    rows = []
    for n in args.tokens:
        for batch in args.batch:
            g = torch.Generator().manual_seed(n + batch)
            ids = torch.randint(1, model.config.vocab_size, (batch, n), generator=g).to(device)
            max_len = n + args.new + 1
            base = base_static = None
            for preset in (None, *args.presets):
                twin = None
                for kind in ("dynamic", "static"):
                    label = f"{preset or 'fp16'} {kind}" + (" +compile" if preset is None and kind == "static" else "")

                    reused = {}

                    def cache_fn(k=kind, p=preset, n_max=max_len, reused=reused):
                        # a static cache is reused with reset(), as a server would (its buffers, and so the step's
                        # CUDA graph, stay); a dynamic one is made per call, as generate() does
                        if k == "static":
                            if "cache" not in reused:
                                reused["cache"] = make_cache(k, p, model, n_max)
                            reused["cache"].reset()
                            return reused["cache"]
                        return make_cache(k, p, model, n_max)

                    try:
                        us, out = per_token_us(
                            model, ids, cache_fn, args.new, kind == "static" and args.backend, device, args.reps
                        )
                    except Exception as e:  # one failing row must not lose the others
                        print(f"  {label:28s} N={n:6d} B={batch}: FAILED {type(e).__name__}: {e}", file=sys.stderr)
                        rows.append({"row": label, "tokens": n, "batch": batch, "error": f"{type(e).__name__}: {e}"})
                        continue
                    same = None
                    if kind == "dynamic":
                        twin = out
                    elif twin is not None and preset is not None:
                        same = bool(torch.equal(out.cpu(), twin.cpu()))
                    if preset is None:
                        base, base_static = (us, base_static) if kind == "dynamic" else (base, us)
                    row = {"row": label, "tokens": n, "batch": batch, "us_per_token": round(us, 1), "same_tokens": same}
                    row["vs_fp16"] = round(base / us, 3) if base else None
                    row["vs_fp16_static"] = round(base_static / us, 3) if base_static else None
                    rows.append(row)
                    print(
                        f"  {label:28s} N={n:6d} B={batch}: {us:9.1f} us/token  vs fp16 {row['vs_fp16'] or '-'}  "
                        f"vs fp16 static {row['vs_fp16_static'] or '-'}"
                        + ("" if same is None else f"  same tokens {same}")
                    )
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", choices=sorted(MODELS), default=None, help="default: 1b on CUDA, tiny on CPU")
    ap.add_argument("--tokens", type=int, nargs="+", default=None, help="prompt lengths (default 1024 8192; CPU 256)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--presets", nargs="+", default=["innerq_base", "kivi2"])
    ap.add_argument("--new", type=int, default=64, help="generated tokens of the long timed run (>= 4)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--backend", default="inductor", help="torch.compile backend of the static rows (default inductor)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    args.model = args.model or ("1b" if cuda else "tiny")
    args.tokens = args.tokens or ([1024, 8192] if cuda else [256])
    if args.new < 4 or args.reps < 1 or min(args.tokens) < 1 or min(args.batch) < 1:
        ap.error("--new must be >= 4, --reps >= 1, --tokens and --batch positive")
    print(
        f"generate() per-token time, model {args.model}, device {args.device}"
        + ("" if cuda else " (CPU: not GPU speed)")
    )
    rows = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "model": args.model, "new": args.new, "rows": rows}, f, indent=1)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
