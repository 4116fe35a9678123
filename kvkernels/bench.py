"""Decode-attention GEMV sweep: fp16 vs dequantize-then-matmul vs fused InnerQ / KIVI kernels, per backend.

One decode step of one attention layer does two GEMVs per (batch, query head); both read the whole KV cache:

    scores  s[b, h, n] = sum_d q[b, h, d] * K[b, h_kv, n, d]          (q . K^T, reduction over head dim D)
    output  o[b, h, d] = sum_n p[b, h, n] * V[b, h_kv, n, d]          (p . V,   reduction over tokens N)

with h_kv = h // (H_q / H_kv) (GQA). Each method stores K and V differently:

    fp16           K, V fp16 [B, H_kv, N, D]; torch matmul (cuBLAS on GPU), query heads grouped per KV head
    dequant-kivi*  KIVI layout (below); kvkernels.dequantize_groups to fp32, then torch matmul: what
                   transformers' QuantizedCache does (dequantize the whole cache every step, then attend)
    innerq-*       groups along each GEMV's reduction dim: keys [B, H_kv, N, D*b/32] (groups along D),
                   values stored transposed [B, H_kv, D, N*b/32] (groups along tokens); kvkernels.gemv_inner_q
                   base: K/V 3-bit sym; small: K 3-bit sym, V 2-bit sym; hybrid: K 3-bit sym, V 2-bit hybrid
                   (1% asym groups by default); asym4: K/V 4-bit asym, kivi4's bits in the InnerQ layout
    kivi2/4        keys per channel [B, H_kv, D, N*b/32] (groups along tokens), values per token
                   [B, H_kv, N, D*b/32] (groups along D), asym; kvkernels.gemv_kivi

The methods come from the format registry (kvkernels.formats): each format's bench_presets run fused, its
dequant_baselines unfused, in that format's layouts (read when this module is imported, so every format
registered by then joins the sweep without a change here).
Group size 32 throughout. Codes are random 32-bit words (every bit pattern is a valid code) and scales random
positive fp16, so the timed kernels see realistic, non-zero data without paying for quantization.

Bytes (the roofline numerator) are the compulsory traffic of the stored format: every input read once
(codes, scales, zeros when the mode has them, the activation vector), every output written once. The same
count is used for the dequant baselines, so their %-of-copy-bandwidth shows what the unfused round trip costs.
Copy bandwidth is a device-to-device tensor copy measured in the same process, counting bytes read + written.

Timing (GPU): inputs rotated across enough copies to exceed 3x the L2 size, all copies' calls captured in one
CUDA graph (eager with events if capture fails), graph replays timed with CUDA events, median per call.
Timing (CPU): time.perf_counter around each call, median. CPU numbers are not GPU numbers.

Entry point: `python -m kvkernels bench --help`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import math
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

import kvkernels
from kvkernels import _backends, formats
from kvkernels import reference as ref

CPU_WARNING = "CPU numbers are not GPU numbers"
SCHEMA = "kvkernels-bench/1"
GROUP = 32
ERR_TOL = 1e-2  # relative error vs the reference above which a result is flagged WRONG


@dataclass(frozen=True)
class ModelShape:
    """Attention shape of one decoder layer (decode: one query token per sequence)."""

    name: str
    h_q: int  # query heads
    h_kv: int  # KV heads (GQA)
    d: int  # head dim


SHAPES = {
    s.name: s
    for s in (
        ModelShape("llama-3.1-8b", h_q=32, h_kv=8, d=128),
        # head_dim 64: InnerQ keys take the GEMV's half-chunk ring item there (L = 64), KIVI values 64-column ring items
        ModelShape("llama-3.2-1b", h_q=32, h_kv=8, d=64),
        ModelShape("smollm2-135m", h_q=9, h_kv=3, d=64),  # the quality eval's model (docs/QUALITY.md): GQA 3
    )
}


@dataclass(frozen=True)
class Method:
    name: str
    kind: str  # "fp16" | "dequant" (a format's layout, unfused: dequantize_groups + matmul) | "fused"
    format: str | None  # the kvkernels.formats name (None: fp16)
    preset: str | None  # the kvkernels.formats.PRESETS entry whose bits and modes are timed
    k_bits: int
    v_bits: int
    k_mode: str
    v_mode: str
    op: str | None  # the kvkernels op the method needs (None: plain torch)
    doc: str


def _methods() -> dict[str, Method]:
    # fp16, every format's unfused baselines, then every format's fused presets (bench name: "_" -> "-")
    fp16 = Method("fp16", "fp16", None, None, 16, 16, "-", "-", None, "torch matmul on an fp16 cache")
    dequant, fused = [], []
    for fmt in formats.all_formats():
        for preset in fmt.dequant_baselines:
            c = formats.PRESETS[preset]
            bits = (c.key_bits, c.value_bits, c.key_mode, c.value_mode)
            name = "dequant-" + preset.replace("_", "-")
            dequant.append(
                Method(name, "dequant", fmt.name, preset, *bits, "dequantize_groups", "dequantize_groups + matmul")
            )
        for preset in fmt.bench_presets:
            c = formats.PRESETS[preset]
            bits = (c.key_bits, c.value_bits, c.key_mode, c.value_mode)
            fused.append(
                Method(preset.replace("_", "-"), "fused", fmt.name, preset, *bits, fmt.gemv_op, fmt.describe(c))
            )
    return {m.name: m for m in (fp16, *dequant, *fused)}


METHODS: dict[str, Method] = _methods()

BACKENDS = ("cuda", "triton", "reference", "cpp")
BACKEND_DOC = {
    "torch": "plain torch ops (the fp16 baseline)",
    "cuda": "compiled CUDA kernel: torch.ops.kvkernels.<op> on CUDA tensors",
    "triton": "kvkernels.triton_kernels.<op> called directly",
    "reference": "kvkernels.reference.<op> called directly (pure PyTorch)",
    "cpp": "torch.ops.kvkernels.<op> on CPU tensors (C++ where kvkernels._C has it, else the reference)",
}

FULL_SEQLENS = tuple(2**i for i in range(9, 18))  # 512 .. 131072
MAX_SEQLEN = 2**20  # a bound on --seqlens (1M tokens: ~17 GB per batch row by case_peak_bytes)
FULL_BATCHES = (1, 8)
QUICK_SEQLENS = (512, 1024, 2048)
QUICK_BATCHES = (1,)
# The reference dequantizes into fp32 and expands KV heads to query heads: ~40x the packed cache in temporaries.
REFERENCE_MAX_TOKENS_GPU = 32768  # batch * seqlen
ROTATION_CAP = 1024  # most input copies cycled through (and calls captured in one CUDA graph) per GEMV


# ---------------------------------------------------------------------------------------------------------
# Inputs


def _rand_codes(shape, device) -> torch.Tensor:
    # every 32-bit pattern is a valid packed block for every bit width
    return torch.randint(-(2**31), 2**31, shape, dtype=torch.int32, device=device)


def _rand_group_params(shape, mode: str, device, asym_frac: float):
    """scales (and zeros) fp16 [..., groups]: positive scales in [0.01, 0.1]; hybrid sets the sign bit on a
    fraction asym_frac of groups (the asym mask); zeros in [-0.5, 0.5] for asym/hybrid, None for sym."""
    scales = (torch.rand(shape, device=device) * 0.09 + 0.01).half()
    if mode == "hybrid":
        scales = torch.where(torch.rand(shape, device=device) < asym_frac, -scales, scales)
    zeros = None if mode == "sym" else (torch.rand(shape, device=device) - 0.5).half()
    return scales, zeros


def _quant_operand(lead, rows: int, length: int, bits: int, mode: str, device, asym_frac: float) -> dict:
    # packed matrix [*lead, rows, length] grouped along length
    codes = _rand_codes((*lead, rows, length * bits // 32), device)
    scales, zeros = _rand_group_params((*lead, rows, length // GROUP), mode, device, asym_frac)
    return {"codes": codes, "scales": scales, "zeros": zeros}


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass
class Part:
    """One timed GEMV: inputs, the call, the reference call (for a correctness check) and compulsory bytes."""

    name: str  # "scores" | "output"
    inputs: dict
    fn: Callable[[dict], torch.Tensor]
    ref_fn: Callable[[dict], torch.Tensor] | None
    bytes: int


def build_parts(
    method: Method, backend: str, shape: ModelShape, batch: int, seqlen: int, device, asym_frac: float = 0.01
) -> list[Part]:
    """Inputs and callables for the scores and output GEMVs of one (method, backend, batch, seqlen) case.

    The method's ops run on backend (resolve_op; ValueError if one cannot run there). Output shapes: scores
    [B, H_q, N], output [B, H_q, D]; kernels return fp32, the fp16 baseline fp16.
    """
    B, Hq, Hkv, D, N = batch, shape.h_q, shape.h_kv, shape.d, seqlen
    g = Hq // Hkv
    q = torch.randn(B, Hq, D, device=device).half()  # [B, H_q, D]
    p = torch.rand(B, Hq, N, device=device).half()  # [B, H_q, N], attention weights (unnormalized is fine)
    out_scores = B * Hq * N
    out_output = B * Hq * D

    if method.kind == "fp16":
        K = torch.randn(B, Hkv, N, D, device=device).half()
        V = torch.randn(B, Hkv, N, D, device=device).half()

        def scores(a):  # [B, H_kv, g, D] @ [B, H_kv, D, N] -> [B, H_q, N]
            return (a["q"].view(B, Hkv, g, D) @ a["K"].transpose(-1, -2)).view(B, Hq, N)

        def output(a):  # [B, H_kv, g, N] @ [B, H_kv, N, D] -> [B, H_q, D]
            return (a["p"].view(B, Hkv, g, N) @ a["V"]).view(B, Hq, D)

        return [
            Part("scores", {"q": q, "K": K}, scores, None, _nbytes(q, K) + out_scores * 2),
            Part("output", {"p": p, "V": V}, output, None, _nbytes(p, V) + out_output * 2),
        ]

    fmt = formats.get_format(method.format)
    impl = _resolved(method.op, backend, device)
    if method.kind == "fused":  # a format whose GEMVs take their own arguments builds its operands (Format.bench_gemvs)
        own = fmt.bench_gemvs(
            formats.PRESETS[method.preset], lambda op: _resolved(op, backend, device), q, p, (B, Hkv), N, D, device
        )
        if own is not None:
            return [
                Part(name, inputs, call, ref_call, _nbytes(*inputs.values()) + n_out * 4)
                for name, n_out, (inputs, call, ref_call) in zip(
                    ("scores", "output"), (out_scores, out_output), own, strict=True
                )
            ]

    # the format's layouts: "rows" stores a tensor [N, D] grouped along D, "cols" stores it transposed [D, N]
    # grouped along N (kvkernels.formats.base.QuantStore); scores reduce over D, the output over N
    gemv_ref = getattr(ref, fmt.gemv_op)
    parts = [
        ("scores", "q", q, fmt.key_layout, method.k_bits, method.k_mode, out_scores),
        ("output", "p", p, fmt.value_layout, method.v_bits, method.v_mode, out_output),
    ]
    out = []
    for name, xn, x, layout, bits, mode, n_out in parts:
        R, C = (N, D) if layout == "rows" else (D, N)
        o = _quant_operand((B, Hkv), R, C, bits, mode, device, asym_frac)
        # the reduction dim (D for scores, N for the output) is the operand's last dim, or its rows
        reduce_last = (C == D) == (name == "scores")
        if method.kind == "fused":

            def fn(a, xn=xn, bits=bits, mode=mode):
                return fmt.gemv(impl, a[xn], a["codes"], a["scales"], a["zeros"], bits, GROUP, mode)

        else:  # dequant: the whole operand to fp32, then matmul with the query heads grouped per KV head

            def fn(a, xn=xn, bits=bits, mode=mode, R=R, C=C, reduce_last=reduce_last):
                w = impl(a["codes"], a["scales"], a["zeros"], bits, GROUP, mode)  # fp32 [B, H_kv, R, C]
                if reduce_last:
                    return (a[xn].float().view(B, Hkv, g, C) @ w.transpose(-1, -2)).view(B, Hq, R)
                return (a[xn].float().view(B, Hkv, g, R) @ w).view(B, Hq, C)

        def ref_fn(a, xn=xn, bits=bits, mode=mode):
            return fmt.gemv(gemv_ref, a[xn], a["codes"], a["scales"], a["zeros"], bits, GROUP, mode)

        out.append(Part(name, {xn: x, **o}, fn, ref_fn, _nbytes(x, *o.values()) + n_out * 4))
    return out


# ---------------------------------------------------------------------------------------------------------
# Backend resolution


def resolve_impl(method: Method, backend: str, device: torch.device):
    """(callable, None) if method can run on backend here, else (None, reason)."""
    if method.op is None:
        return (None, None) if backend == "torch" else (None, "fp16 runs on backend 'torch' only")
    return resolve_op(method.op, backend, device)


def resolve_op(op: str, backend: str, device: torch.device):
    """(callable, None) if the op torch.ops.kvkernels.<op> can run on backend here, else (None, reason)."""
    status = kvkernels.backends()
    if backend == "cuda":
        if device.type != "cuda":
            return None, "cuda backend needs a CUDA device (running on CPU)"
        if status["cuda"] != "available":
            return None, f"cuda: {status['cuda']}"
        from kvkernels import ops

        if ops.CUDA_IMPL.get(op) != "cuda":
            return None, f"cuda: no compiled CUDA kernel for {op} (CUDA tensors use {ops.CUDA_IMPL.get(op)})"
        return getattr(torch.ops.kvkernels, op).default, None
    if backend == "triton":
        if device.type == "cpu" and not _backends.TRITON_INTERPRET:
            return None, "triton on CPU needs TRITON_INTERPRET=1 (set it before starting Python)"
        if not status["triton"].startswith("available"):
            return None, f"triton: {status['triton']}"
        try:
            from kvkernels import triton_kernels
        except ImportError as e:
            return None, f"triton: kvkernels.triton_kernels failed to import ({e})"
        fn = getattr(triton_kernels, op, None)
        if fn is None:
            return None, f"triton: kvkernels.triton_kernels has no {op} yet"
        return fn, None
    if backend == "reference":
        return getattr(ref, op), None
    if backend == "cpp":
        if device.type != "cpu":
            return None, "cpp backend is the CPU dispatcher path (running on CUDA)"
        if not _backends.HAS_C:
            return None, f"cpp: {status['cpp']}"
        return getattr(torch.ops.kvkernels, op).default, None
    return None, f"unknown backend {backend!r} (choose from {', '.join(BACKENDS)})"


def _resolved(op: str, backend: str, device: torch.device):
    fn, why = resolve_op(op, backend, device)
    if fn is None:
        raise ValueError(f"{op} cannot run on backend {backend!r}: {why}")
    return fn


# ---------------------------------------------------------------------------------------------------------
# Timers


def _quantiles(ms: list[float]) -> tuple[float, float, float]:
    s = sorted(ms)
    q = statistics.quantiles(s, n=4) if len(s) >= 2 else [s[0]] * 3
    return q[0], statistics.median(s), q[2]


def cuda_step(fn, sets: list[dict]) -> tuple[Callable[[], None], dict]:
    """A callable that runs fn once on every rotated input set: a CUDA graph replay when the calls can be
    captured (one launch for all of them, so microsecond kernels are not timed as launch gaps), else an eager
    loop. Warms up first, so Triton compilation and cuBLAS handle creation stay out of any timing."""

    def run_all():
        for a in sets:
            fn(a)

    run_all()
    torch.cuda.synchronize()
    info = {"timer": "cuda-graph+events", "n_rot": len(sets)}
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on a side stream before capture, as torch.cuda.graphs advises
            run_all()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run_all()
        return graph.replay, info  # the bound method keeps the graph (and its memory pool) alive
    except Exception as e:  # a kernel on the legacy stream, a sync inside the op, ...: time eagerly instead
        torch.cuda.synchronize()
        msg = str(e).splitlines()[0][:200] if str(e) else ""
        return run_all, {**info, "timer": "events (eager)", "graph_error": f"{type(e).__name__}: {msg}"}


def time_cuda(fn, sets: list[dict], target_s: float = 0.05, min_reps: int = 10, max_reps: int = 200) -> dict:
    """Median time of one call (us): cuda_step replays timed with CUDA events, divided by the calls per replay.
    The rotation exceeds 3x L2 (rotation_count), so each call reads its operands from DRAM, not from cache."""
    step, info = cuda_step(fn, sets)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ms: list[float] = []
    t0 = time.perf_counter()
    while len(ms) < max_reps and (len(ms) < min_reps or time.perf_counter() - t0 < target_s):
        start.record()
        step()
        end.record()
        end.synchronize()
        ms.append(start.elapsed_time(end) / len(sets))
    del step
    lo, med, hi = _quantiles(ms)
    return {**info, "us": med * 1e3, "iqr_us": (hi - lo) * 1e3, "reps": len(ms)}


def time_cpu(
    fn, sets: list[dict], target_s: float = 0.15, min_reps: int = 3, max_reps: int = 50, warmup: bool = True
) -> dict:
    """Median wall time of one call (us) with time.perf_counter, after one warm-up call. No cache flushing."""
    a = sets[0]
    if warmup:
        fn(a)
    s: list[float] = []
    t0 = time.perf_counter()
    while len(s) < max_reps and (len(s) < min_reps or time.perf_counter() - t0 < target_s):
        t = time.perf_counter()
        fn(a)
        s.append(time.perf_counter() - t)
    lo, med, hi = _quantiles(s)
    return {"timer": "perf_counter", "n_rot": 1, "us": med * 1e6, "iqr_us": (hi - lo) * 1e6, "reps": len(s)}


def copy_bandwidth(device: torch.device) -> dict:
    """Device-to-device copy of a buffer far larger than any cache; GB/s counting bytes read + written."""
    n = (1 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)

    def fn(_a, src=src, dst=dst):
        return dst.copy_(src)

    if device.type == "cuda":
        t = time_cuda(fn, [{}], target_s=0.1, min_reps=10, max_reps=50)
    else:
        t = time_cpu(fn, [{}])
    del src, dst, fn
    return {"bytes": 2 * n, "us": t["us"], "GBps": 2 * n / (t["us"] * 1e-6) / 1e9, "timer": t["timer"]}


def _l2_bytes(device) -> int:
    if device.type != "cuda":
        return 0
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 50 << 20)


def rotation_count(part_bytes: int, l2: int, cap: int = ROTATION_CAP) -> int:
    """Copies of a part's inputs to cycle through so that one pass over them covers 3x L2 (at most cap: the
    smallest case, ~0.2 MB of operands, needs ~750 copies of a 50 MB L2; memory stays ~3x L2 either way)."""
    if l2 <= 0:
        return 1
    return max(1, min(cap, math.ceil(3 * l2 / max(part_bytes, 1))))


def rotated_sets(part: Part, l2: int) -> list[dict]:
    """part.inputs plus clones at other addresses, rotation_count(part.bytes, l2) sets in all."""
    n = rotation_count(part.bytes, l2)
    clones = [{k: (v.clone() if v is not None else None) for k, v in part.inputs.items()} for _ in range(n - 1)]
    return [part.inputs, *clones]


# ---------------------------------------------------------------------------------------------------------
# Environment


def _run(cmd: list[str], cwd=None) -> str | None:
    try:
        r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def gpu_clocks() -> dict | None:
    """nvidia-smi's view of the current GPU clocks (MHz), power and temperature; None when unreadable."""
    fields = "name,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,power.draw,temperature.gpu,driver_version"
    out = _run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"])
    if not out:
        return None
    vals = [v.strip() for v in out.splitlines()[0].split(",")]
    return dict(zip(fields.split(","), vals, strict=False))


def environment(device: torch.device) -> dict:
    repo = Path(__file__).resolve().parent.parent
    commit = _run(["git", "rev-parse", "HEAD"], cwd=repo)
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    env = {
        "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name(),
        "clocks": gpu_clocks() if device.type == "cuda" else None,
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "kvkernels": kvkernels.__version__,
        "backends": kvkernels.backends(),
        "python": platform.python_version(),
        "git_commit": commit,
        "git_dirty": None if dirty is None else bool(dirty),
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "torch_threads": torch.get_num_threads(),
        "triton_interpret": _backends.TRITON_INTERPRET,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["sm_count"] = props.multi_processor_count
        env["l2_bytes"] = _l2_bytes(device)
        env["capability"] = f"{props.major}.{props.minor}"
        from kvkernels import ops

        env["cuda_impl"] = dict(ops.CUDA_IMPL)
    return env


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return "CPU " + line.split(":", 1)[1].strip()
    return f"CPU {platform.processor() or platform.machine()}"


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", s).strip("-")[:60] or "device"


# ---------------------------------------------------------------------------------------------------------
# Sweep


@dataclass
class Config:
    device: torch.device
    shape: ModelShape
    batches: tuple
    seqlens: tuple
    methods: tuple
    backends: tuple
    quick: bool = False
    budget_s: float | None = None
    check: bool = True
    progress: bool = True
    asym_frac: float = 0.01


def plan(cfg: Config) -> tuple[list[tuple], list[dict]]:
    """Cases to run, ordered so a time budget cuts the least useful ones: fp16 and the first available
    backend over the whole grid first, then the other backends. Also the (method, backend) pairs skipped."""
    runnable, skipped = [], []
    backend_rank = {"torch": 0}
    for name in cfg.methods:
        m = METHODS[name]
        for be in ("torch",) if m.op is None else cfg.backends:
            _, reason = resolve_impl(m, be, cfg.device)
            if reason:
                skipped.append({"method": name, "backend": be, "reason": reason})
                continue
            backend_rank.setdefault(be, len(backend_rank))
            runnable.append((m, be))
    cases = [(m, be, b, n) for (m, be) in runnable for b in cfg.batches for n in cfg.seqlens]
    cases.sort(key=lambda c: (max(backend_rank[c[1]], 1) - 1, c[2], c[3], list(METHODS).index(c[0].name)))
    return cases, skipped


def _rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    out, want = out.double(), want.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - want).norm() / want.norm().clamp_min(1e-30))


def run_case(cfg: Config, m: Method, be: str, batch: int, seqlen: int, check: bool) -> dict:
    dev = cfg.device
    parts = build_parts(m, be, cfg.shape, batch, seqlen, dev, cfg.asym_frac)
    rec = {"method": m.name, "backend": be, "batch": batch, "seqlen": seqlen, "k_bits": m.k_bits, "v_bits": m.v_bits}
    l2 = _l2_bytes(dev)  # 0 on CPU: no rotation
    for part in parts:
        sets = rotated_sets(part, l2)
        if check and part.ref_fn is not None:
            rec[f"{part.name}_rel_err"] = _rel_err(part.fn(part.inputs), part.ref_fn(part.inputs))
        if dev.type == "cuda":
            t = time_cuda(part.fn, sets)
        elif be == "triton":  # the Triton interpreter takes seconds per call: one timed call, no warm-up
            t = time_cpu(part.fn, sets, target_s=0.0, min_reps=1, warmup=False)
        else:
            t = time_cpu(part.fn, sets)
        rec[f"{part.name}_us"] = t["us"]
        rec[f"{part.name}_iqr_us"] = t["iqr_us"]
        rec[f"{part.name}_bytes"] = part.bytes
        rec[f"{part.name}_timer"] = {k: v for k, v in t.items() if k not in ("us", "iqr_us")}
        del sets
    rec["total_us"] = rec["scores_us"] + rec["output_us"]
    rec["total_bytes"] = rec["scores_bytes"] + rec["output_bytes"]
    return rec


def run_sweep(cfg: Config, log=print) -> dict:
    """Run every case of cfg; returns the result dict that is written as JSON (see bench/README.md)."""
    from tqdm import tqdm

    t_start = time.perf_counter()
    env = environment(cfg.device)
    cases, skipped = plan(cfg)
    for s in skipped:
        log(f"skip {s['method']}[{s['backend']}]: {s['reason']}")
    if cfg.device.type == "cpu" and any(c[1] == "triton" for c in cases):
        log("note: triton on CPU runs in the Triton interpreter, seconds per call at N=512 (try --seqlens 64)")
    copy_bw = copy_bandwidth(cfg.device)
    results: list[dict] = []
    checked: set = set()
    bar = tqdm(
        cases, desc="kvkernels bench", unit="case", disable=None if cfg.progress else True, file=sys.stderr
    )  # None: only on a terminal
    for m, be, b, n in bar:
        bar.set_postfix_str(f"{m.name}[{be}] B={b} N={n}", refresh=False)
        base = {"method": m.name, "backend": be, "batch": b, "seqlen": n}
        if cfg.budget_s is not None and time.perf_counter() - t_start > cfg.budget_s:
            skipped.append({**base, "reason": f"time budget of {cfg.budget_s:.0f} s used up"})
            continue
        if be == "reference" and cfg.device.type == "cuda" and b * n > REFERENCE_MAX_TOKENS_GPU:
            skipped.append(
                {**base, "reason": f"reference on GPU limited to batch*seqlen <= {REFERENCE_MAX_TOKENS_GPU}"}
            )
            continue
        key = (m.name, be, b)
        try:
            rec = run_case(cfg, m, be, b, n, check=cfg.check and key not in checked)
            checked.add(key)
            results.append(rec)
        except torch.OutOfMemoryError:
            skipped.append({**base, "reason": "out of memory"})
        except Exception as e:  # a broken backend must not end the sweep
            skipped.append({**base, "reason": f"error: {type(e).__name__}: {str(e).splitlines()[0][:300]}"})
        finally:
            if cfg.device.type == "cuda":
                torch.cuda.empty_cache()
    bar.close()
    if cfg.device.type == "cuda":
        env["clocks_end"] = gpu_clocks()
    _derive(results, copy_bw["GBps"])
    out = {
        "schema": SCHEMA,
        "note": CPU_WARNING if cfg.device.type == "cpu" else "GPU timings (CUDA events)",
        "env": env,
        "config": {
            "shape": vars(cfg.shape),
            "group_size": GROUP,
            "batches": list(cfg.batches),
            "seqlens": list(cfg.seqlens),
            "methods": {k: vars(METHODS[k]) for k in cfg.methods},
            "backends": {k: BACKEND_DOC.get(k, "") for k in ("torch", *cfg.backends)},
            "quick": cfg.quick,
            "budget_s": cfg.budget_s,
            "hybrid_asym_frac": cfg.asym_frac,
            "timing": (
                "CUDA: inputs rotated over >3x L2, one CUDA graph per pass (events if capture fails), median of "
                "replays / calls per replay"
                if cfg.device.type == "cuda"
                else "CPU: time.perf_counter per call after one warm-up, median; no cache flushing"
            ),
            "bytes": "compulsory bytes of the stored format: inputs read once + output written once",
        },
        "copy_bandwidth": copy_bw,
        "results": results,
        "skipped": skipped,
        "elapsed_s": time.perf_counter() - t_start,
    }
    return out


def _derive(results: list[dict], copy_gbps: float) -> None:
    """Bandwidth, roofline fraction and ratios vs the fp16 baseline of the same run and (batch, seqlen)."""
    fp16 = {(r["batch"], r["seqlen"]): r for r in results if r["method"] == "fp16"}
    for r in results:
        r["GBps"] = r["total_bytes"] / (r["total_us"] * 1e-6) / 1e9
        r["pct_copy_bw"] = 100.0 * r["GBps"] / copy_gbps
        base = fp16.get((r["batch"], r["seqlen"]))
        for part in ("scores", "output", "total"):
            r[f"speedup_{part}"] = base[f"{part}_us"] / r[f"{part}_us"] if base else None


# ---------------------------------------------------------------------------------------------------------
# Reporting


def _label(r: dict) -> str:
    return f"{r['method']}[{r['backend']}]"


def _fmt_us(us: float) -> str:
    return f"{us:.0f}" if us >= 100 else f"{us:.1f}"


def _max_err(r: dict) -> float | None:
    errs = [r[k] for k in ("scores_rel_err", "output_rel_err") if r.get(k) is not None]
    return max(errs) if errs else None


def check_errors(rows: list[dict]) -> dict[tuple, float]:
    """(label, batch) -> max relative error vs kvkernels.reference, from the case where it was checked."""
    return {(_label(r), r["batch"]): e for r in rows if (e := _max_err(r)) is not None}


def format_table(res: dict) -> str:
    """Total (scores + output) microseconds and speedup vs fp16, one block per batch; then the roofline at the
    largest sequence length of each batch, with the correctness check of that method/backend."""
    rows = res["results"]
    lines = []
    is_cpu = res["env"]["device"] == "cpu"
    if is_cpu:
        lines.append(f"*** {CPU_WARNING} ***")
    cbw = res["copy_bandwidth"]["GBps"]
    lines.append(f"device: {res['env']['device_name']}   copy bandwidth: {cbw:.1f} GB/s (read+write)")
    labels = list(dict.fromkeys(_label(r) for r in rows))
    by = {(_label(r), r["batch"], r["seqlen"]): r for r in rows}
    errs = check_errors(rows)
    w = max((len(x) for x in labels), default=10) + 2
    for b in res["config"]["batches"]:
        ns = [n for n in res["config"]["seqlens"] if any(r["batch"] == b and r["seqlen"] == n for r in rows)]
        if not ns:
            continue
        lines.append("")
        lines.append(f"batch {b}: total us = scores + output   (x = speedup vs fp16, same run)")
        lines.append("method[backend]".ljust(w) + "".join(f"N={n}".rjust(15) for n in ns))
        for lab in labels:
            cells = []
            for n in ns:
                r = by.get((lab, b, n))
                sp = None if r is None else r["speedup_total"]
                cell = "-" if r is None else _fmt_us(r["total_us"]) + (f" {sp:5.2f}x" if sp is not None else "")
                cells.append(cell.rjust(15))
            if any(c.strip() != "-" for c in cells):
                bad = (errs.get((lab, b)) or 0) > ERR_TOL
                lines.append(lab.ljust(w) + "".join(cells) + ("  WRONG" if bad else ""))
        nmax = ns[-1]
        lines.append(f"  at N={nmax}:".ljust(w + 2) + "scores_us output_us      GB/s  %copy-bw  rel.err vs reference")
        for lab in labels:
            r = by.get((lab, b, nmax))
            if r is None:
                continue
            err = errs.get((lab, b))
            err_s = "-" if err is None else f"{err:.1e}" + ("  WRONG" if err > ERR_TOL else "")
            lines.append(
                f"  {lab.ljust(w)}{_fmt_us(r['scores_us']):>9} {_fmt_us(r['output_us']):>9} "
                f"{r['GBps']:9.3g} {r['pct_copy_bw']:8.3g}%  {err_s}"
            )
    if any(e > ERR_TOL for e in errs.values()):
        lines.append(
            f"WRONG = output differs from kvkernels.reference by > {ERR_TOL:g} relative (checked once per batch)"
        )
    if is_cpu:
        lines.append(f"*** {CPU_WARNING} ***")
    return "\n".join(lines)


def topline(res: dict) -> list[str]:
    """One line per (batch, method) at the largest measured seqlen: best backend, total us, speedup, %copy."""
    out = []
    rows = res["results"]
    errs = check_errors(rows)
    for b in res["config"]["batches"]:
        ns = [r["seqlen"] for r in rows if r["batch"] == b and r["method"] == "fp16"]
        if not ns:
            continue
        n = max(ns)
        best: dict[str, dict] = {}
        for r in rows:
            ok = (errs.get((_label(r), b)) or 0) <= ERR_TOL  # a wrong kernel's speed is not a result
            if (
                r["batch"] == b
                and r["seqlen"] == n
                and ok
                and (r["method"] not in best or r["total_us"] < best[r["method"]]["total_us"])
            ):
                best[r["method"]] = r
        for name in METHODS:
            r = best.get(name)
            if r:
                err = errs.get((_label(r), b))
                out.append(
                    f"B={b} N={n} {_label(r):28s} {_fmt_us(r['total_us']):>9} us  "
                    f"{r['speedup_total']:5.2f}x fp16  {r['pct_copy_bw']:5.1f}% copy-bw"
                    + ("  WRONG vs reference" if err is not None and err > ERR_TOL else "")
                )
    if res["env"]["device"] == "cpu":
        out.append(CPU_WARNING)
    return out


def plot(res: dict, stem: Path) -> list[Path]:
    """Three PNGs: latency vs seqlen (log-log), speedup vs fp16, % of copy bandwidth; one panel per batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["results"]
    batches = res["config"]["batches"]
    title_dev = res["env"]["device_name"] + (f"  ({CPU_WARNING})" if res["env"]["device"] == "cpu" else "")
    specs = [
        ("latency", "total_us", "scores + output latency (us)", True),
        ("speedup", "speedup_total", "speedup vs fp16 (same run)", False),
        ("bandwidth", "pct_copy_bw", "achieved bandwidth, % of copy bandwidth", False),
    ]
    paths = []
    labels = list(dict.fromkeys(_label(r) for r in rows))
    for suffix, key, ylabel, logy in specs:
        fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4.5), squeeze=False)
        for ax, b in zip(axes[0], batches, strict=True):
            for lab in labels:
                pts = sorted(
                    (r["seqlen"], r[key]) for r in rows if _label(r) == lab and r["batch"] == b and r[key] is not None
                )
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker="o", ms=3, label=lab, ls="--" if "fp16" in lab else "-")
            ax.set_xscale("log", base=2)
            if logy:
                ax.set_yscale("log")
            if key == "speedup_total":
                ax.axhline(1.0, color="gray", lw=0.8)
            if key == "pct_copy_bw":
                ax.axhline(100.0, color="gray", lw=0.8)
            ax.set_xlabel("sequence length (tokens)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{res['config']['shape']['name']} decode, batch {b}", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            if not rows:
                ax.text(0.5, 0.5, "no results", ha="center", transform=ax.transAxes)
        handles, labs = axes[0][0].get_legend_handles_labels()
        if handles:
            fig.legend(handles, labs, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
        fig.suptitle(title_dev, fontsize=9)
        fig.tight_layout()
        path = stem.with_name(f"{stem.name}-{suffix}.png")
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    return paths


# ---------------------------------------------------------------------------------------------------------
# CLI


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {n}")
    return n


def _seqlen(text: str) -> int:
    n = _positive_int(text)
    if n % GROUP:
        raise argparse.ArgumentTypeError(f"sequence lengths must be multiples of {GROUP}, got {n}")
    if n > MAX_SEQLEN:
        raise argparse.ArgumentTypeError(f"sequence lengths above {MAX_SEQLEN} are not benchmarked, got {n}")
    return n


def _float_in(lo: float, hi: float, lo_open: bool = False):
    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not (lo < x if lo_open else lo <= x) or not x <= hi:  # NaN fails both
            raise argparse.ArgumentTypeError(f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {text}")
        return x

    return parse


# bytes one case may hold per K/V element at its peak: fp16 K and V (4), a dequantized fp32 operand (4) and the
# reference check's fp32 dequantization with its temporaries (~8); a generous model, checked before the sweep
PEAK_BYTES_PER_KV_ELEMENT = 16


def _available_memory(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def case_peak_bytes(shape: ModelShape, batch: int, seqlen: int) -> int:
    """Estimated peak memory of the largest case of a (batch, seqlen): see PEAK_BYTES_PER_KV_ELEMENT."""
    kv_elements = batch * shape.h_kv * seqlen * shape.d
    return kv_elements * PEAK_BYTES_PER_KV_ELEMENT + batch * shape.h_q * seqlen * 6  # + p (fp16) and scores (fp32)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kvkernels bench",
        description="Sweep the decode-attention GEMVs (scores q.K^T and output p.V) over methods, backends, batch "
        "sizes and sequence lengths; write DIR/<device>-<date>.json and PNG plots, print a table.",
    )
    p.add_argument("--quick", action="store_true", help="small grid: batch 1, seqlens 512-2048 (the CPU default)")
    p.add_argument("--out", default="bench_results", help="output directory (default: bench_results)")
    p.add_argument("--batch", nargs="+", type=_positive_int, help=f"batch sizes (default {list(FULL_BATCHES)})")
    p.add_argument(
        "--seqlens", nargs="+", type=_seqlen, help=f"sequence lengths, multiples of {GROUP} (default 512 .. 131072)"
    )
    p.add_argument("--methods", nargs="+", choices=list(METHODS), help="methods (fp16 is always added)")
    p.add_argument(
        "--backends",
        nargs="+",
        choices=BACKENDS,
        help=f"backends among {', '.join(BACKENDS)} (default: cuda triton reference on GPU, cpp on CPU)",
    )
    p.add_argument("--model", default="llama-3.1-8b", choices=list(SHAPES), help="attention shape")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument(
        "--budget-s",
        type=_float_in(0, math.inf, lo_open=True),
        default=None,
        help="stop starting new cases after this many seconds",
    )
    p.add_argument(
        "--hybrid-asym-frac", type=_float_in(0.0, 1.0), default=0.01, help="fraction of asym groups in hybrid V"
    )
    p.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--no-check", action="store_true", help="skip the correctness check against the reference")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    return p


def config_from_args(a: argparse.Namespace, log=print) -> Config:
    if a.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    elif a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("kvkernels bench: --device cuda, but torch sees no CUDA device")
    else:
        device = torch.device(a.device)
    small = a.quick or device.type == "cpu"
    if device.type == "cpu" and not a.quick and (a.batch is None or a.seqlens is None):
        log("kvkernels bench: on CPU the default grid is the --quick one (batch 1, seqlens 512-2048)")
    batches = tuple(a.batch) if a.batch else (QUICK_BATCHES if small else FULL_BATCHES)
    seqlens = tuple(a.seqlens) if a.seqlens else (QUICK_SEQLENS if small else FULL_SEQLENS)
    need, have = case_peak_bytes(SHAPES[a.model], max(batches), max(seqlens)), _available_memory(device)
    if have is not None and need > have:
        raise SystemExit(
            f"kvkernels bench: the largest case (batch {max(batches)}, seqlen {max(seqlens)}) needs about "
            f"{need / 2**30:.1f} GiB, but {device.type} has {have / 2**30:.1f} GiB available; lower --batch/--seqlens"
        )
    methods = tuple(dict.fromkeys(["fp16", *(a.methods or METHODS)]))  # the baseline of every ratio
    backends = (
        tuple(a.backends) if a.backends else (("cuda", "triton", "reference") if device.type == "cuda" else ("cpp",))
    )
    return Config(
        device=device,
        shape=SHAPES[a.model],
        batches=batches,
        seqlens=tuple(sorted(seqlens)),
        methods=methods,
        backends=backends,
        quick=a.quick,
        budget_s=a.budget_s,
        check=not a.no_check,
        progress=not a.no_progress,
        asym_frac=a.hybrid_asym_frac,
    )


def main(argv: list[str] | None = None) -> int:
    p = parser()
    a = p.parse_args(argv)
    out_dir = Path(a.out)
    if out_dir.exists() and not out_dir.is_dir():  # found before the sweep, not after it
        p.error(f"--out {a.out}: exists and is not a directory")
    cfg = config_from_args(a)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        p.error(f"--out {a.out}: cannot create it ({e.strerror})")
    if a.threads:
        torch.set_num_threads(a.threads)
    if cfg.device.type == "cpu":
        print(f"*** {CPU_WARNING}: this run times the CPU paths, not the GPU kernels ***")
    res = run_sweep(cfg)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    stem = out_dir / f"{_slug(res['env']['device_name'])}-{stamp}"
    json_path = stem.with_suffix(".json")
    pngs = [] if a.no_plots else plot(res, stem)
    res["files"] = {"json": json_path.name, "plots": [p.name for p in pngs]}
    json_path.write_text(json.dumps(res, indent=1, default=str) + "\n")
    print(format_table(res))
    late = [s for s in res["skipped"] if "seqlen" in s]
    if late:
        reasons: dict[tuple, int] = {}
        for s in late:
            reasons[(f"{s['method']}[{s['backend']}]", s["reason"])] = (
                reasons.get((f"{s['method']}[{s['backend']}]", s["reason"]), 0) + 1
            )
        print("skipped cases:")
        for (lab, why), n in reasons.items():
            print(f"  {lab} x{n}: {why}")
    print(f"wrote {json_path}" + "".join(f"\nwrote {p}" for p in pngs))
    print(f"elapsed {res['elapsed_s']:.1f} s")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
