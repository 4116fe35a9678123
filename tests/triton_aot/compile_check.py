"""Compile every Triton kernel variant the wrappers launch, for real NVIDIA targets, on a machine without a GPU.

CI runs the Triton kernels only through TRITON_INTERPRET=1, which executes the Python AST with numpy and never
sees what the compiler rejects (type mismatches across loop iterations, unsupported casts, shapes that are not
powers of two, a tile that needs more shared memory than the chip has) or what ptxas does with it (spills). This
script closes that gap the way .ci/nvcc_check.sh does for csrc/cuda/:

1. With TRITON_INTERPRET unset, it calls the public wrappers of kvkernels.triton_kernels on CPU tensors of decode
   shapes (Llama-3.1-8B keys and values, GQA 1/4/8, q_len 1 and 16, every bit width, mode and dtype), with the
   launch `kernel[grid](...)` replaced by a recorder, so the recorded launches are exactly what the wrappers
   would launch on a GPU (tiles, num_warps, constexprs, pointer dtypes, int widths).
2. Each distinct launch is lowered by triton.compile() through TTIR -> TTGIR -> LLVM -> PTX -> cubin for each
   target in --targets (GPUTarget, no driver needed), with the JIT's own specialisations mimicked: ints equal
   to 1 become constexprs, ints and pointers divisible by 16 get the divisibility hint.
3. cuobjdump reads each cubin's resource usage: stack/local memory above SPILL_TOLERANCE_B (register spills) or
   shared memory above the target's opt-in limit is an error.
4. Every recorded kernel's constexpr globals get the comparison the JIT makes before each launch (stale_globals): a
   NaN global fails it on every launch, which the interpreter never sees.

Usage: python tests/triton_aot/compile_check.py [--targets 80,90] [--jobs N] [--json FILE] [--cover N]
Exit status 0 when every variant compiled for every target within those limits and no kernel reads a global that
fails the launch-time check; prints one line per variant.
"""

import argparse
import concurrent.futures as cf
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

os.environ.pop("TRITON_INTERPRET", None)  # must precede the first import of triton: we want compiled kernels

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

# Max dynamic shared memory per block (opt-in), bytes: sm_80 A100 163 KiB, sm_87 Orin 163 KiB, sm_90 227 KiB.
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 87: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024}
# Spills: the CUDA kernels must have none (.ci/nvcc_check.sh), since their register budget is ours to set. Triton
# leaves the budget to ptxas, which on sm_80 sometimes caps a 256-thread kernel at 64 registers (full occupancy)
# and parks a word or two on the stack. A few bytes of L1-resident stack is that trade-off; more than this means
# a tile too large for the register file, which is a bug in the tile choice.
SPILL_TOLERANCE_B = 16
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "enable_fp_fusion", "maxnreg")
PTR_TYPES = {
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.float32: "*fp32",
    torch.int32: "*i32",
    torch.int16: "*i16",
    torch.int8: "*i8",  # the lattice ops' signs
    torch.int64: "*i64",  # decode_attention_fused's device lengths
}


# --------------------------------------------------------------------------------------------------------------
# 1. record the launches


def record_launches() -> list[tuple[JITFunction, tuple, dict]]:
    import kvkernels.triton_kernels as tk

    return record_calls(representative_calls(tk))


def record_calls(calls) -> list[tuple[JITFunction, tuple, dict]]:
    """Run each call (a wrapper call on CPU tensors) with every `kernel[grid](...)` replaced by a recorder.

    An autotuned kernel (triton.autotune) records one launch per config of its list (each is a compiled variant
    the autotuner may pick on a GPU): the config's meta-parameters and launch options join the call's arguments.
    """
    from kvkernels.triton_kernels import _common
    from triton.runtime.autotuner import Autotuner

    # let check_device accept CPU tensors: nothing is launched, only recorded (and no interpreter to probe)
    saved = _common.INTERPRETED, _common.interpreter_problem
    _common.INTERPRETED = True
    _common.interpreter_problem = lambda: None
    launches = []

    def recorder(self, grid):
        if isinstance(self, Autotuner):

            def record_configs(*args, **kwargs):
                configs = self.configs
                if self.early_config_prune:  # the configs the autotuner would try for these arguments
                    configs = self.early_config_prune(configs, dict(zip(self.arg_names, args, strict=False)), **kwargs)
                for config in configs:
                    options = {k: v for k, v in config.all_kwargs().items() if k in LAUNCH_OPTIONS}
                    launches.append((self.fn, args, {**kwargs, **config.kwargs, **options}))

            return record_configs
        return lambda *args, **kwargs: launches.append((self, args, kwargs))

    originals = {cls: cls.__dict__.get("__getitem__") for cls in (JITFunction, Autotuner)}
    for cls in originals:
        cls.__getitem__ = recorder
    try:
        for call in calls:
            call()
    finally:
        for cls, original in originals.items():
            if original is None:
                del cls.__getitem__  # inherited from KernelInterface again
            else:
                cls.__getitem__ = original
        _common.INTERPRETED, _common.interpreter_problem = saved
    return launches


def representative_calls(tk):
    """Wrapper calls covering every compiled specialisation a user can reach through the public ops."""
    calls = []
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    modes = ("sym", "asym", "hybrid")

    def z(*shape, dtype=torch.float32):
        return torch.zeros(shape, dtype=dtype)

    def gemv_inner_q(B, H_q, H_kv, T, M, L, bits, G, mode, dtype, xs=False):
        x = z(B, H_q, T, L, dtype=dtype) if T else z(B, H_q, L, dtype=dtype)
        codes = z(B, H_kv, M, L * bits // 32, dtype=torch.int32)
        scales = z(B, H_kv, M, L // G, dtype=torch.float16)
        zeros = None if mode == "sym" else torch.zeros_like(scales)
        x_scale = z(H_kv, L) if xs else None
        calls.append(lambda: tk.gemv_inner_q(x, codes, scales, zeros, bits, G, mode, x_scale))

    def gemv_kivi(B, H_q, H_kv, T, R, C, bits, G, dtype):
        x = z(B, H_q, T, R, dtype=dtype) if T else z(B, H_q, R, dtype=dtype)
        codes = z(B, H_kv, R, C * bits // 32, dtype=torch.int32)
        scales, zeros = z(B, H_kv, R, C // G, dtype=torch.float16), z(B, H_kv, R, C // G, dtype=torch.float16)
        calls.append(lambda: tk.gemv_kivi(x, codes, scales, zeros, bits, G))

    def quantize(shape, bits, G, mode, dtype, eta=0.0):
        x = z(*shape, dtype=dtype)
        calls.append(lambda: tk.quantize_groups(x, bits, G, mode, eta))

    def dequantize(shape, bits, G, mode):
        lead, L = shape[:-1], shape[-1]
        codes = z(*lead, L * bits // 32, dtype=torch.int32)
        scales = z(*lead, L // G, dtype=torch.float16)
        calls.append(lambda: tk.dequantize_groups(codes, scales, None if mode == "sym" else scales, bits, G, mode))

    for bits in (1, 2, 3, 4):
        for mode in modes:
            for dtype in dtypes:
                # InnerQ keys (M = tokens, L = head_dim) and values (M = head_dim, L = tokens), Llama-3.1-8B GQA 4
                gemv_inner_q(1, 32, 8, 0, 4096, 128, bits, 32, mode, dtype)
                gemv_inner_q(1, 32, 8, 0, 128, 4096, bits, 32, mode, dtype)
            gemv_inner_q(1, 32, 8, 0, 4096, 128, bits, 32, mode, torch.float16, xs=True)  # fused key norm
            quantize((1, 8, 16, 128), bits, 32, mode, torch.float16)
            quantize((1, 8, 128, 64), bits, 64, mode, torch.bfloat16)
            dequantize((1, 8, 16, 128), bits, 32, mode)
        for dtype in dtypes:
            gemv_kivi(1, 32, 8, 0, 128, 4096, bits, 32, dtype)  # keys: rows = head_dim, columns = tokens
            gemv_kivi(1, 32, 8, 0, 4096, 128, bits, 32, dtype)  # values: rows = tokens, columns = head_dim
        quantize((1, 8, 128, 256), bits, 128, "asym", torch.float32, eta=0.25)
    # tile shapes: GQA 1 and 8, q_len 16 (QP up to 128), batch 8, D 64 / 256, group 128
    for T, H_q in ((16, 32), (0, 8), (0, 64), (4, 8)):
        gemv_inner_q(8, H_q, 8, T, 4096, 128, 2, 32, "sym", torch.float16)
        gemv_inner_q(8, H_q, 8, T, 128, 4096, 2, 32, "hybrid", torch.bfloat16)
        gemv_kivi(8, H_q, 8, T, 4096, 128, 2, 32, torch.float16)
        gemv_kivi(8, H_q, 8, T, 128, 4096, 2, 32, torch.bfloat16)
    # 64-bit strides (a cache past 2^31 elements): the JIT passes them as i64, a different specialisation.
    # Meta tensors: shapes and strides without the memory.
    big = 2**31 + 4096

    def huge(shape, dtype):
        strides = torch.empty(shape, device="meta").stride()
        return torch.empty_strided(shape, (big, *strides[1:]), dtype=dtype, device="meta")

    for bits in (2, 3):
        x = torch.empty((2, 32, 128), dtype=torch.float16, device="meta")
        c, s = huge((2, 8, 4096, 4 * bits), torch.int32), huge((2, 8, 4096, 4), torch.float16)
        calls.append(lambda x=x, c=c, s=s, bits=bits: tk.gemv_inner_q(x, c, s, s, bits, 32, "hybrid"))
        xk = torch.empty((2, 32, 4096), dtype=torch.bfloat16, device="meta")
        ck, sk = huge((2, 8, 4096, 4 * bits), torch.int32), huge((2, 8, 4096, 4), torch.float16)
        calls.append(lambda x=xk, c=ck, s=sk, bits=bits: tk.gemv_kivi(x, c, s, s, bits, 32))
        xq = huge((2, 8, 16, 128), torch.float16)
        calls.append(lambda x=xq, bits=bits: tk.quantize_groups(x, bits, 32, "hybrid"))
        cd, sd = huge((2, 8, 16, 4 * bits), torch.int32), huge((2, 8, 16, 4), torch.float16)
        calls.append(lambda c=cd, s=sd, bits=bits: tk.dequantize_groups(c, s, s, bits, 32, "asym"))
    gemv_inner_q(1, 16, 4, 0, 2048, 256, 3, 128, "asym", torch.float16)
    gemv_inner_q(1, 16, 4, 0, 64, 2048, 4, 64, "sym", torch.float16)
    gemv_kivi(1, 16, 4, 0, 64, 2048, 3, 128, torch.float16)
    quantize((2, 4, 32, 2048), 4, 2048, "hybrid", torch.float16)
    dequantize((2, 4, 32, 2048), 4, 2048, "hybrid")
    lattice_calls(tk, calls, dtypes)
    aqua_calls(tk, calls, dtypes)
    attention_calls(tk, calls, dtypes)
    probe_calls(calls)
    return calls


def probe_calls(calls):
    """The tests' own probe kernels (tests/triton_probes.py), as the tests launch them on a GPU (EMU off): a probe only
    the interpreter accepts would fail on the first GPU, as test_pair_decode_order did (a non-constexpr global)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from triton_probes import decode_probe, perm_probe

    for bits in (1, 2, 3, 4):
        codes, out = torch.zeros(3, 4 * bits, dtype=torch.int32), torch.zeros(3, 128)
        calls.append(lambda c=codes, o=out, bits=bits: decode_probe[(1,)](c, o, BITS=bits, EMU=False))
        calls.append(lambda bits=bits: perm_probe[(1,)](torch.zeros(128, dtype=torch.int32), BITS=bits))


def lattice_calls(tk, calls, dtypes):
    """The lattice ops: every grid and activation dtype, signs on and off, q_len 16, G 32 .. 1024."""
    from kvkernels.formats.lattice_grids import BITS, grid

    def z(*shape, dtype=torch.float32):
        return torch.zeros(shape, dtype=dtype)

    signs = torch.ones(64, dtype=torch.int8)
    for (d, n), bits in BITS.items():
        g = grid(d, n)
        codes, norms = z(1, 8, 4096, 128 * bits // 32, dtype=torch.int32), z(1, 8, 4096, 2, dtype=torch.float16)
        for dtype in dtypes:
            q, p = z(1, 32, 128, dtype=dtype), z(1, 32, 4096, dtype=dtype)
            calls.append(lambda q=q, c=codes, r=norms, g=g: tk.gemv_lattice_k(q, c, r, g, 64))
            calls.append(lambda p=p, c=codes, r=norms, g=g: tk.gemv_lattice_v(p, c, r, g, 64))
            x = z(1, 8, 16, 128, dtype=dtype)
            calls.append(lambda x=x, g=g: tk.lattice_quantize(x, g, 64))
        q16, p16 = z(1, 32, 16, 128, dtype=torch.float16), z(1, 32, 16, 4096, dtype=torch.float16)
        calls.append(lambda q=q16, c=codes, r=norms, g=g: tk.gemv_lattice_k(q, c, r, g, 64, signs))
        calls.append(lambda p=p16, c=codes, r=norms, g=g: tk.gemv_lattice_v(p, c, r, g, 64, signs))
        calls.append(lambda c=codes, r=norms, g=g: tk.lattice_dequantize(c, r, g, 64, signs))
        calls.append(lambda g=g: tk.lattice_quantize(z(1, 8, 16, 1024, dtype=torch.float16), g, 1024))
    for G in (32, 1024):
        calls.append(lambda G=G: tk.fwht(z(8, 2048, dtype=torch.bfloat16), G))
        calls.append(lambda G=G: tk.fwht(z(8, 2048), G, torch.ones(G, dtype=torch.int8), True))


def aqua_calls(tk, calls, dtypes):
    """aqua_reconstruct (AQUA-KV's predictor GEMM + lattice residual): every grid at every GEMM dtype for one decode
    token, and with signs and the value predictor's second input over a 128-token block."""
    from kvkernels.formats.lattice_grids import BITS, grid

    def z(*shape, dtype=torch.float32):
        return torch.zeros(shape, dtype=dtype)

    C, C_in, G = 1024, 1024, 64
    for (d, n), bits in BITS.items():
        g = grid(d, n)
        for dtype in dtypes:
            args = (z(1, C_in, dtype=dtype), z(C, C_in, dtype=dtype), z(C), z(1, C // 32 * bits, dtype=torch.int32),
                    z(1, C // G, dtype=torch.float16), g, G)  # fmt: skip
            calls.append(lambda a=args: tk.aqua_reconstruct(*a))
        args = (z(128, C_in, dtype=torch.float16), z(C, C_in, dtype=torch.float16), z(C),
                z(128, C // 32 * bits, dtype=torch.int32), z(128, C // G, dtype=torch.float16), g, G)  # fmt: skip
        two = {"signs": torch.ones(G, dtype=torch.int8), "prev2": z(128, 512, dtype=torch.float16),
               "weight2": z(C, 512, dtype=torch.float16)}  # fmt: skip
        calls.append(lambda a=args, k=two: tk.aqua_reconstruct(*a, **k))


def attention_calls(tk, calls, dtypes):
    """decode_attention_fused: InnerQ (keys rows, values cols, key_x_scale) and KIVI (keys cols, values rows) layer
    caches at every bit width, every mode and window dtype, Llama-3.1-8B heads (GQA 4, D 128); q_len 16 with a mask
    (64 query rows: row blocks); one split (no merge); D 64 with G 64 (64-token tiles); the other two layout
    pairs; 64-bit store strides; the device-lengths form (static caches) of both layer caches. q=True: as
    kvkernels.decode_attention calls it since 2026-11-29, the queries in the windows' dtype with their softmax scale
    (SCALED) and the output in that dtype (the bf16 store rounds by hand); else fp32 x, no scale, fp32 out."""

    def z(*shape, dtype=torch.float32, device="cpu"):
        return torch.zeros(shape, dtype=dtype, device=device)

    def store(B, H_kv, D, m, bits, G, mode, layout, big=False):
        shape = (B, H_kv, m, D * bits // 32) if layout == "rows" else (B, H_kv, D, m * bits // 32)
        gshape = (B, H_kv, m, D // G) if layout == "rows" else (B, H_kv, D, m // G)
        if big:  # a cache past 2^31 elements: meta tensors with a huge batch stride
            codes, scales = (
                torch.empty_strided(s, (2**31 + 4096, *torch.empty(s, device="meta").stride()[1:]), dtype=d,
                                    device="meta")
                for s, d in ((shape, torch.int32), (gshape, torch.float16))
            )  # fmt: skip
        else:
            codes, scales = z(*shape, dtype=torch.int32), z(*gshape, dtype=torch.float16)
        return codes, scales, None if mode == "sym" else scales

    def attn(key, value, dtype, T=1, H_q=32, H_kv=8, D=128, G=32, S=32, mk=3968, mv=3968, tail=96, xs=False,
             mask=False, big=False, lengths=False, q=False):  # fmt: skip
        (kb, km, kl), (vb, vm, vl) = key, value
        B, N = 1, S + mk + tail
        dev = "meta" if big else "cpu"
        x = z(B, H_q, T, D, dtype=dtype if q else torch.float32, device=dev)
        sk, sv = z(B, H_kv, S, D, dtype=dtype, device=dev), z(B, H_kv, S, D, dtype=dtype, device=dev)
        kt, vt = z(B, H_kv, tail, D, dtype=dtype, device=dev), z(B, H_kv, N - S - mv, D, dtype=dtype, device=dev)
        kc, ks, kz = store(B, H_kv, D, mk, kb, G, km, kl, big)
        vc, vs, vz = store(B, H_kv, D, mv, vb, G, vm, vl, big)
        x_scale = z(H_kv, D, device=dev) if xs else None
        m = z(B, 1, T, N, device=dev) if mask else None
        n_used = z(5, dtype=torch.int64, device=dev) if lengths else None
        args = (x, sk, sv, kc, ks, kz, vc, vs, vz, kt, vt, kb, km, kl, vb, vm, vl, G, x_scale, m, 0, n_used)
        scaled = {"q_scale": D**-0.5, "out_dtype": dtype} if q else {}
        calls.append(lambda: tk.decode_attention_fused(*args, **scaled))

    for bits in (1, 2, 3, 4):
        attn((bits, "sym", "rows"), (bits, "sym", "cols"), torch.float16, xs=True, q=True)  # InnerQ
        attn((bits, "asym", "cols"), (bits, "asym", "rows"), torch.bfloat16, S=0, mv=4000, tail=160, q=True)  # KIVI
    for dtype in dtypes:  # the window dtypes (sink and tail loads)
        attn((3, "hybrid", "rows"), (2, "hybrid", "cols"), dtype, xs=True, q=True)
        attn((3, "hybrid", "rows"), (2, "hybrid", "cols"), dtype, xs=True)
    attn((1, "asym", "rows"), (4, "asym", "cols"), torch.float32, S=0, mv=4000, tail=160)
    attn((2, "sym", "rows"), (2, "sym", "cols"), torch.float16, T=16, xs=True, mask=True)  # 64 query rows
    attn((2, "asym", "cols"), (2, "asym", "rows"), torch.bfloat16, T=16, H_q=64, S=0, mv=4000, tail=160, mask=True)
    attn((3, "sym", "rows"), (2, "sym", "cols"), torch.float16, S=4, mk=30, mv=0, tail=20, xs=True)  # one split
    attn((2, "sym", "rows"), (4, "asym", "cols"), torch.bfloat16, D=64, G=64, S=0, mk=4000, mv=3968, tail=96)
    attn((2, "sym", "rows"), (4, "asym", "cols"), torch.bfloat16, D=64, G=64, S=0, mk=4000, mv=3968, tail=96, q=True)
    attn((4, "hybrid", "cols"), (1, "asym", "cols"), torch.float16, G=64)
    attn((2, "asym", "rows"), (2, "asym", "rows"), torch.float16, mv=4000, tail=160, xs=True)
    attn((3, "sym", "rows"), (3, "sym", "cols"), torch.float16, xs=True, big=True)
    attn((3, "sym", "rows"), (2, "sym", "cols"), torch.float16, xs=True, lengths=True, q=True)  # static caches
    attn((2, "asym", "cols"), (2, "asym", "rows"), torch.float16, S=0, mv=4000, tail=160, lengths=True, q=True)
    attn((2, "hybrid", "rows"), (2, "hybrid", "cols"), torch.bfloat16, T=4, xs=True, mask=True, lengths=True)


# Planted faults for --self-test: each must be reported, or the check could pass without looking.


@triton.jit
def _planted_not_pow2(x_ptr, y_ptr):
    i = tl.arange(0, 48)  # Triton requires power-of-two ranges: a compile error, the interpreter runs it
    tl.store(y_ptr + i, tl.load(x_ptr + i))


@triton.jit
def _planted_spill(x_ptr, y_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i)  # BLOCK / 32 values per thread stay live across the reduction: past 255 registers
    tl.store(y_ptr + i, x / tl.max(x, 0))


def planted_launches():
    x, y = torch.zeros(16384), torch.zeros(16384)
    return [(_planted_not_pow2, (x, y), {"num_warps": 1}), (_planted_spill, (x, y), {"BLOCK": 16384, "num_warps": 1})]


def stale_globals(fns) -> list[str]:
    """The launch-time check Triton's JIT makes and the interpreter does not: before every launch JITFunction.run
    compares each constexpr global the kernel (or a function it calls) read with the global's current value (`!=`) and
    raises "Global variable ... has changed since we compiled this kernel" when they differ. A NaN never equals
    itself, so a kernel that reads a NaN global fails every launch on a GPU: every Triton quantize test of the first
    GPU run (H200, 2026-11-26) did. One message per (kernel, global) that would fail the check now."""
    problems = []
    for fn in dict.fromkeys(fns):
        fn.cache_key  # noqa: B018 - computing the key runs the dependency finder, which records the globals read
        for (name, _), (val, scope) in fn.used_global_vals.items():
            if scope.get(name) != val:
                problems.append(f"{fn.__name__}: global {name} = {val!r} fails Triton's launch-time check")
    return problems


_PLANTED_NAN = tl.constexpr(float("nan"))


@triton.jit
def _planted_nan_global(x_ptr):
    tl.store(x_ptr, _PLANTED_NAN)


# --------------------------------------------------------------------------------------------------------------
# 2. turn a recorded launch into a compile job, as the JIT would specialise it


def int_type(v: int) -> str:
    if -(2**31) <= v < 2**31:
        return "i32"
    if -(2**63) <= v < 2**63:
        return "i64"
    return "u64"


def compile_job(fn: JITFunction, args: tuple, kwargs: dict) -> dict:
    names = fn.arg_names
    bound = dict(zip(names, args, strict=False))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    options = {k: v for k, v in kwargs.items() if k in LAUNCH_OPTIONS}
    unknown = set(kwargs) - set(names) - set(LAUNCH_OPTIONS)
    if unknown or len(bound) != len(names):
        raise RuntimeError(f"{fn.__name__}: cannot bind launch (unknown {unknown}, missing {set(names) - set(bound)})")
    signature, constexprs, divisible = {}, {}, []
    for i, name in enumerate(names):
        v = bound[name]
        if fn.params[i].is_constexpr:
            signature[name], constexprs[name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            signature[name] = PTR_TYPES[v.dtype]
            if v.device.type == "meta" or v.data_ptr() % 16 == 0:  # meta: as a fresh CUDA allocation would be
                divisible.append(i)
        elif isinstance(v, bool):
            signature[name] = "i1"
        elif isinstance(v, int):
            if v == 1:  # the JIT specialises 1 into the kernel
                signature[name], constexprs[name] = "constexpr", 1
            else:
                signature[name] = int_type(v)
                if v % 16 == 0:
                    divisible.append(i)
        elif isinstance(v, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: argument {name} of type {type(v).__name__} is not handled")
    # One compile per (kernel, constexprs, argument types, launch options): launches that differ only in which
    # ints are divisible by 16 or equal 1 would compile to near-identical code, so the first one stands for them.
    meta = {name: constexprs[name] for i, name in enumerate(names) if fn.params[i].is_constexpr}
    wide = tuple(name for name, v in signature.items() if v in ("i64", "u64"))
    key = (fn.__name__, tuple(sorted(meta.items())), tuple(v for v in signature.values() if v[0] == "*"), wide,
           tuple(sorted(options.items())))  # fmt: skip
    label = " ".join(f"{k}={v}" for k, v in meta.items()) + (f" i64:{','.join(wide)}" if wide else "")
    dt = next((signature[n][1:] for n in ("x_ptr",) if n in signature), None)
    return {
        "fn": fn,
        "signature": signature,
        "constexprs": constexprs,
        "divisible": divisible,
        "options": options,
        "key": key,
        "label": f"{fn.__name__} {label}" + (f" x={dt}" if dt else "") + f" warps={options.get('num_warps', 4)}",
    }


# --------------------------------------------------------------------------------------------------------------
# 3. compile and read resource usage


def cuobjdump_path() -> str:
    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return bundled if os.path.exists(bundled) else (shutil.which("cuobjdump") or "")


def resource_usage(cubin: bytes) -> dict:
    tool = cuobjdump_path()
    if not tool:
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    return dict(zip(("regs", "stack", "shared", "local"), map(int, m.groups()), strict=True)) if m else {}


def covering(jobs: list[dict], strength: int) -> list[dict]:
    """A subset of the jobs in which every combination of `strength` features (a constexpr's value, the pointer
    types, the 64-bit ints, a launch option) that some job of a kernel has is held by at least one chosen job of that
    kernel: greedy, the job covering the most uncovered combinations first (ties: recording order). Faults that
    depend on at most `strength` of a launch's parameters together are caught by the subset; CI compiles the 3-way
    cover (~45% of the launches), `pytest -m slow` every launch."""

    def features(job: dict) -> list[str]:
        _, meta, ptrs, wide, options = job["key"]
        return sorted([f"{k}={v!r}" for k, v in (*meta, *options)] + [f"ptrs={ptrs}", f"wide={wide}"])

    chosen = []
    for name in dict.fromkeys(job["key"][0] for job in jobs):
        mine = [job for job in jobs if job["key"][0] == name]
        combos = [set(itertools.combinations(f, min(strength, len(f)))) for f in map(features, mine)]
        need = set().union(*combos)
        while need:
            i = max(range(len(mine)), key=lambda i: len(combos[i] & need))
            chosen.append(mine[i])
            need -= combos[i]
    return chosen


def compile_one(job: dict, cc: int) -> dict:
    fn = job["fn"]
    target = GPUTarget("cuda", cc, 32)
    backend = triton.compiler.make_backend(target)
    options = backend.parse_options(dict(job["options"]))
    attrs = {(i,): [["tt.divisibility", 16]] for i in job["divisible"]}
    src = ASTSource(fn=fn, signature=job["signature"], constexprs=job["constexprs"], attrs=attrs)
    t0 = time.perf_counter()
    try:
        kernel = triton.compile(src, target=target, options=options.__dict__)
    except Exception as e:  # noqa: BLE001 - report every failure, keep compiling the rest
        return {"label": job["label"], "cc": cc, "ok": False, "error": f"{type(e).__name__}: {e}"[-2000:]}
    usage = resource_usage(kernel.asm["cubin"])
    shared = max(usage.get("shared", 0), int(getattr(kernel.metadata, "shared", 0)))
    problems, notes = [], []
    spill = usage.get("local", 0) + usage.get("stack", 0)
    if spill > SPILL_TOLERANCE_B:
        problems.append(f"{spill} B of stack/local memory (register spills)")
    elif spill:
        notes.append(f"{spill} B stack (ptxas traded a register for occupancy)")
    if shared > SHARED_LIMIT.get(cc, 48 * 1024):
        problems.append(f"shared memory {shared} B > {SHARED_LIMIT.get(cc)} B")
    return {
        "label": job["label"],
        "cc": cc,
        "ok": not problems,
        "error": "; ".join(problems + notes),
        "regs": usage.get("regs"),
        "shared": shared,
        "seconds": round(time.perf_counter() - t0, 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--targets", default="80,90", help="compute capabilities, comma separated (default 80,90)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", help="write the per-variant results here")
    ap.add_argument("--self-test", action="store_true", help="compile only planted faults; exit 0 iff all FAIL")
    ap.add_argument("--only", help="compile only the launches whose label contains this string")
    ap.add_argument(
        "--cover",
        type=int,
        default=0,
        metavar="N",
        help="compile only a subset of the launches covering every N-way combination of their parameters (0: all)",
    )
    args = ap.parse_args()
    targets = [int(t) for t in args.targets.split(",")]

    jobs = {}
    recorded = planted_launches() if args.self_test else record_launches()
    for launch in recorded:
        job = compile_job(*launch)
        if args.only is None or args.only in job["label"]:
            jobs.setdefault(job["key"], job)
    print(f"triton {triton.__version__}, torch {torch.__version__}: {len(jobs)} distinct launches x targets {targets}")
    if args.cover:
        jobs = {job["key"]: job for job in covering(list(jobs.values()), args.cover)}
        print(f"compiling the {len(jobs)} launches that cover every {args.cover}-way combination of their parameters")
    if not cuobjdump_path():
        print("note: cuobjdump not found, register/spill usage is not checked")

    # every kernel recorded, whatever --only and --cover select (the check costs no compile)
    fns = [_planted_nan_global] if args.self_test else [launch[0] for launch in recorded]
    stale = stale_globals(fns)
    for problem in stale:
        print(f"FAIL globals {problem}")

    work = [(job, cc) for job in jobs.values() for cc in targets]
    t0 = time.perf_counter()
    # compilation is CPU-bound in C++ (MLIR, LLVM, ptxas): threads overlap well enough and share the imports
    with cf.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(lambda w: compile_one(*w), work))
    for r in sorted(results, key=lambda r: (r["label"], r["cc"])):
        state = "ok  " if r["ok"] else "FAIL"
        usage = f"regs {r['regs']:>3}  smem {r['shared']:>6} B" if r.get("regs") is not None else ""
        print(f"{state} sm_{r['cc']}  {r['label']:<72} {usage}  {r['error']}".rstrip())
    failed = [r for r in results if not r["ok"]]
    print(f"{len(results) - len(failed)}/{len(results)} compiled within limits in {time.perf_counter() - t0:.0f} s")
    failing = {problem.split(":")[0] for problem in stale}  # a kernel may read several such globals
    print(f"{len(set(fns)) - len(failing)}/{len(set(fns))} kernels pass the launch-time check of their globals")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.self_test:
        print(f"self-test: {len(failed)}/{len(results)} planted faults reported, {len(stale)}/1 planted NaN global")
        return 0 if len(failed) == len(results) and len(stale) == 1 else 1
    return 1 if failed or stale else 0


if __name__ == "__main__":
    sys.exit(main())
