"""One layer's decode attention per step: the fused op against the composed path and against SDPA on an fp16 cache,
in the same run.

    python bench/attention_step.py [--device cpu|cuda] [--tokens 1024 4096 ...] [--batch 1 8] [--presets ...]
                                   [--q-len 1] [--query-heads 32] [--head-dim 128]
                                   [--no-steps | --steps-tokens 32768 ...]
                                   [--json out.json]

Shape: Llama-3.1-8B's attention layer (32 query heads on 8 KV heads, head_dim 128; --query-heads 64 makes it GQA 8, as
Llama-3-70B's layers, whose fused tiles run 8 query rows a CTA; --head-dim 64 gives Llama-3.2-1B's shape, whose tiles
have their own instantiations), a cache prefilled with N random
tokens (the quantized formats' windows as their presets set them). Rows per (preset, batch, N):
  sdpa fp16   torch SDPA (enable_gqa) over the same N tokens as one fp16 K/V tensor: what an fp16 cache costs
  composed    kvkernels.decode_attention(fused_op=False): window matmuls + the two quantized GEMVs + softmax, ~8-10 ops
  fused       kvkernels.decode_attention(fused_op=True): ops.decode_attention_fused (CUDA kernel, else Triton)
  fused general   (compiled CUDA op only) the same with KVKERNELS_ATTENTION_STORE_TILES=0: every token through the
                  general kernel, none through the tensor-core tiles (InnerQ's store tiles, KIVI's tiles)
  fused rest 1 split   (compiled CUDA op only) with KVKERNELS_ATTENTION_REST_SPLITS=1: next to the tiles, the general
                  kernel walks the sink, the stores' edges and the tails in one split, as in the first GPU run (the
                  before of splitting them by about a group, 2026-11-28)
  fused no prefetch   (compiled CUDA op only) with KVKERNELS_ATTENTION_PREFETCH=0: no L2 prefetch in the attention
                  kernels (the store tiles' of each warp's first and next steps, the general kernel's of its first
                  tile; the before of 2026-11-29)
Each row is the median time of one call (kvkernels.bench: CUDA graph replays timed with events on a GPU, rotating
over enough caches to exceed 3x L2 so the codes come from DRAM; perf_counter on CPU). A row whose calls a CUDA graph
cannot capture falls back to eager timing (launch gaps and host time then count): it is printed with a WARNING
and listed as "eager_rows" in the JSON (the first GPU run's log did not say which timer its rows took). "vs sdpa"
is sdpa / row (> 1: faster than fp16). The fused row's max |error| against the composed path is printed too.

Whole decode steps (append one token + attention, the cache advancing every step), timed the same way for both rows
(wall clock over STEP_COUNT consecutive steps, synchronized at the end, so host work counts):
  dynamic step   QuantizedLayerCache.append + decode_attention as generate() runs them (host decisions, new shapes)
  static step    kvkernels.StaticLayerCache: the step captured once in a CUDA graph and replayed (CPU: run eagerly)
                 (its append: the compiled static_append op, two launches, where the CUDA extension is built)
  static step, reference append   (CUDA, where that op serves) the same graph with the reference's append: 34-42
                 small device ops (68-80 in the first GPU run; tests/test_static_cache.py counts them), the before
  compiled static step   (CUDA; the first step row of each preset) the static step with the reference append through
                 torch.compile(fullgraph=True), captured the same way: Inductor fuses the append's index arithmetic,
                 where()s and copies into ~15 kernels (counted on CPU)
"static / dynamic" < 1 means the graph-captured step is faster. The static step's attention is the fused op's
device-lengths form (grid planned for the capacity, only the used tokens read); on CPU it is the PyTorch reference,
which dequantizes the whole capacity.

On CPU the fused op runs the PyTorch reference (dequantize everything, one softmax): CPU rows compare CPU code paths
and say nothing about GPU speed. The GPU numbers are what this script is for (bench/gpu_verify.sh runs it).
"""

import argparse
import contextlib
import functools
import json
import os
import sys

import torch

from kvkernels import bench, ops
from kvkernels.attention import decode_attention
from kvkernels.formats import PRESETS, make_layer_cache
from kvkernels.static_cache import StaticLayerCache

H_Q, H_KV, D = 32, 8, 128  # (D: --head-dim sets it for the run)
STEP_COUNT = 64  # decode steps per timing of the whole-step rows


def build_cache(preset: str, batch: int, n: int, device, seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)
    c = make_layer_cache(PRESETS[preset], batch, H_KV, D, capacity=n, device=device, dtype=torch.float16)
    chunk = 8192  # prefill in chunks: the fp32 temporaries of one quantize call stay small
    for lo in range(0, n, chunk):
        m = min(chunk, n - lo)
        k = torch.randn(batch, H_KV, m, D, generator=g).to(device, torch.float16)
        v = torch.randn(batch, H_KV, m, D, generator=g).to(device, torch.float16)
        c.append(k, v)
    return c


def sdpa_step(q, n: int, q_len: int, a: dict) -> torch.Tensor:
    # the q_len rows are the last of the n tokens: SDPA's is_causal aligns to the top-left, so give the mask
    mask = None
    if q_len > 1:
        pos = torch.arange(n - q_len, n, device=q.device)[:, None]
        mask = torch.arange(n, device=q.device)[None, :] <= pos
    return torch.nn.functional.scaled_dot_product_attention(q, a["k"], a["v"], attn_mask=mask, enable_gqa=True)


def cache_step(q, fused: bool, a: dict) -> torch.Tensor:
    return decode_attention(q, a["c"], fused_op=fused)


EAGER_ROWS: list[str] = []  # rows a CUDA graph could not capture (timed eagerly: launch gaps and host time count)


def time_fn(fn, sets, device, label: str = "") -> float:
    if device.type == "cuda":
        r = bench.time_cuda(fn, sets)
        if r.get("timer") != "cuda-graph+events":  # say so: an eager row is not comparable with the graph rows
            EAGER_ROWS.append(label)
            print(f"  WARNING {label}: timed eagerly, not as a CUDA graph ({r.get('graph_error', '')})", flush=True)
        return r["us"]
    return bench.time_cpu(fn, sets, target_s=0.3)["us"]


def _time_steps(step, device) -> float:
    """us per step: wall clock over STEP_COUNT consecutive calls of step(), synchronized at the end."""
    import time

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(STEP_COUNT):
        step()
    sync()
    return (time.perf_counter() - t0) / STEP_COUNT * 1e6


def step_rows(preset: str, batch: int, n: int, q, device, compile_step: bool) -> tuple[dict[str, float], float]:
    """({path: us per decode step}, max |static - dynamic|) at n cached tokens (module docstring): "dynamic step",
    "static step", and on CUDA "static step, reference append" (where the compiled static_append op serves the static
    step: the same graph with the reference's fixed-shape append, the before) and, with compile_step, "compiled static
    step" (torch.compile over the step with the reference append: Inductor's fusion of it, the other alternative)."""
    g = torch.Generator(device="cpu").manual_seed(n)
    k_new = torch.randn(batch, H_KV, 1, D, generator=g).to(device, torch.float16)
    v_new = torch.randn(batch, H_KV, 1, D, generator=g).to(device, torch.float16)
    warm = 3
    dyn = build_cache(preset, batch, n, device, seed=1)
    # room for three warm-up + timing runs on the one static cache
    static = StaticLayerCache(build_cache(preset, batch, n, device, seed=1), max_tokens=n + 3 * (STEP_COUNT + warm))
    want = got = None

    def dyn_step():
        nonlocal want
        dyn.append(k_new, v_new)
        want = decode_attention(q, dyn)

    def static_step():
        nonlocal got
        static.append(k_new, v_new)
        got = static.attention(q)

    for _ in range(warm):
        dyn_step()
        static_step()
    err = (got.float() - want.float()).abs().max().item()
    out = {"dynamic step": _time_steps(dyn_step, device)}
    if device.type != "cuda":
        out["static step"] = _time_steps(static_step, device)
        return out, err

    def captured(fn):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # records the step without running it
            fn()
        return graph.replay

    out["static step"] = _time_steps(captured(static_step), device)
    fused_append = static.compiled_append
    static.compiled_append = False  # the reference append, for the rows below
    try:
        if fused_append:
            for _ in range(warm):
                static_step()
            out["static step, reference append"] = _time_steps(captured(static_step), device)
        if compile_step:
            # the step through torch.compile (Inductor fuses the reference append's index arithmetic, where() and
            # copies; the custom ops stay opaque), then captured the same way
            compiled = torch.compile(static_step, fullgraph=True)
            for _ in range(warm):
                compiled()
            out["compiled static step"] = _time_steps(captured(compiled), device)
    finally:
        static.compiled_append = fused_append
    return out, err


STORE_TILES_ENV = "KVKERNELS_ATTENTION_STORE_TILES"  # csrc/cuda/decode_attention.cu: "0" = general kernel only
REST_SPLITS_ENV = "KVKERNELS_ATTENTION_REST_SPLITS"  # "1" = the rest next to the tiles in one split
PREFETCH_ENV = "KVKERNELS_ATTENTION_PREFETCH"  # csrc/cuda/decode_attention_store.cu: "0" = no L2 prefetch in the tiles


@contextlib.contextmanager
def _env(name: str, value: str | None):
    """Sets (value not None) an environment variable for the block, restoring it after."""
    old = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if value is not None:
            if old is None:
                del os.environ[name]
            else:
                os.environ[name] = old


def run(args) -> list[dict]:
    device = torch.device(args.device)
    l2 = bench._l2_bytes(device) if device.type == "cuda" else 0
    rows = []
    compiled = set()  # presets whose compiled static step has been timed
    for n in args.tokens:
        for batch in args.batch:
            g = torch.Generator(device="cpu").manual_seed(n + batch)
            q = torch.randn(batch, args.query_heads, args.q_len, D, generator=g).to(device, torch.float16)
            kv_bytes = 2 * batch * H_KV * n * D * 2
            n_rot = bench.rotation_count(kv_bytes, l2) if device.type == "cuda" else 1
            dense = [
                {
                    "k": torch.randn(batch, H_KV, n, D, generator=g).to(device, torch.float16),
                    "v": torch.randn(batch, H_KV, n, D, generator=g).to(device, torch.float16),
                }
                for _ in range(n_rot)
            ]
            sdpa = functools.partial(sdpa_step, q, n, args.q_len)
            base = time_fn(sdpa, dense, device, f"N {n} B {batch} sdpa fp16")
            del dense
            rows.append({"preset": "sdpa fp16", "batch": batch, "tokens": n, "us": base, "vs_sdpa": 1.0})
            print(f"N {n:>6} B {batch}: sdpa fp16 {base:10.1f} us", flush=True)
            for preset in args.presets:
                n_rot_q = bench.rotation_count(kv_bytes // 4, l2) if device.type == "cuda" else 1
                caches = [{"c": build_cache(preset, batch, n, device, seed=s)} for s in range(min(n_rot_q, 8))]
                want = decode_attention(q, caches[0]["c"], fused_op=False).float()
                got = decode_attention(q, caches[0]["c"], fused_op=True).float()
                err = (got - want).abs().max().item()
                # (path, fused, {environment variable: value} for the compiled op's switches)
                paths = [("composed", False, {}), ("fused", True, {})]
                if device.type == "cuda" and ops.CUDA_IMPL.get("decode_attention_fused") == "cuda":
                    paths.append(("fused general", True, {STORE_TILES_ENV: "0"}))  # without the store-tile kernel
                    paths.append(("fused rest 1 split", True, {REST_SPLITS_ENV: "1"}))
                    paths.append(("fused no prefetch", True, {PREFETCH_ENV: "0"}))
                for path, fused, switches in paths:
                    with contextlib.ExitStack() as stack:
                        for name, value in switches.items():
                            stack.enter_context(_env(name, value))
                        label = f"N {n} B {batch} {preset} {path}"
                        us = time_fn(functools.partial(cache_step, q, fused), caches, device, label)
                    row = {"preset": preset, "path": path, "batch": batch, "tokens": n, "us": us, "vs_sdpa": base / us}
                    if fused and not switches:
                        row["max_abs_err_vs_composed"] = err
                    rows.append(row)
                    print(
                        f"N {n:>6} B {batch}: {preset:>14} {path:>18} {us:10.1f} us  x{base / us:5.2f} vs sdpa"
                        + (f"  (max |fused - composed| {err:.2e})" if "max_abs_err_vs_composed" in row else ""),
                        flush=True,
                    )
                del caches
                if args.steps and (args.steps_tokens is None or n in args.steps_tokens):
                    compile_step = preset not in compiled  # one compile per preset: Inductor takes tens of seconds
                    compiled.add(preset)
                    steps, err = step_rows(preset, batch, n, q, device, compile_step)
                    dyn_us, static_us = steps["dynamic step"], steps["static step"]
                    for path, us in steps.items():
                        row = {"preset": preset, "path": path, "batch": batch, "tokens": n, "us": us}
                        if path == "static step":
                            row.update(static_vs_dynamic=us / dyn_us, max_abs_err_vs_dynamic=err)
                        elif path != "dynamic step":
                            row["vs_static"] = us / static_us
                        rows.append(row)
                    others = "".join(
                        f", {p} {us:.1f} us" for p, us in steps.items() if p not in ("dynamic step", "static step")
                    )
                    print(
                        f"N {n:>6} B {batch}: {preset:>14} step: dynamic {dyn_us:10.1f} us, static "
                        f"{static_us:10.1f} us{others} (static / dynamic {static_us / dyn_us:.2f}, max |diff| "
                        f"{err:.2e})",
                        flush=True,
                    )
    return rows


def main(argv=None) -> int:
    global D
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, nargs="+", default=None)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--presets", nargs="+", default=["innerq_base", "kivi2"])
    p.add_argument("--q-len", type=int, default=1)
    p.add_argument("--query-heads", type=int, default=H_Q,
                   help=f"query heads on the {H_KV} KV heads (64: GQA 8, the fused tiles' 8-row kernels)")  # fmt: skip
    p.add_argument("--head-dim", type=int, default=D, choices=[64, 128],
                   help="head_dim of the layer (64: Llama-3.2-1B's; the fused tiles' head_dim-64 kernels)")  # fmt: skip
    p.add_argument("--json", default=None)
    p.add_argument("--no-steps", dest="steps", action="store_false", help="skip the whole-decode-step rows")
    p.add_argument("--steps-tokens", type=int, nargs="+", default=None,
                   help="the whole-decode-step rows only at these token counts (default: every --tokens)")  # fmt: skip
    args = p.parse_args(argv)
    if args.tokens is None:
        args.tokens = [1024, 4096, 16384, 65536, 131072] if args.device.startswith("cuda") else [1024, 4096]
    if args.query_heads < H_KV or args.query_heads % H_KV:
        p.error(f"--query-heads must be a positive multiple of the {H_KV} KV heads, got {args.query_heads}")
    D = args.head_dim  # the shape every function of this module builds its tensors with
    unknown = [name for name in args.presets if name not in PRESETS]
    if unknown:
        p.error(f"unknown preset(s) {unknown}")
    env = bench.environment(torch.device(args.device))
    print(f"# device {args.device}: {env.get('device_name', env.get('cpu', ''))}" + (
        "  (CPU: the fused op is the PyTorch reference; these are not GPU numbers)" if args.device == "cpu" else ""
    ))  # fmt: skip
    rows = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "args": vars(args), "rows": rows, "eager_rows": EAGER_ROWS}, f, indent=1)
    if EAGER_ROWS:
        print(f"# {len(EAGER_ROWS)} row(s) timed eagerly (no CUDA graph): {EAGER_ROWS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
