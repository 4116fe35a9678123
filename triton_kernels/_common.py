"""Shared pieces of the Triton backend: device helpers (unpacking, rounding, group affine) and launch helpers.

Device helpers mirror csrc/kvkernels/{packing,quant}.cuh; the formulas are in kvkernels/reference/quant.py.
Only long-standing tl APIs are used (triton >= 3.0), so the same code runs under TRITON_INTERPRET=1 and compiles
for CUDA GPUs.
"""

import contextlib
import functools
import os

import torch
import triton
import triton.language as tl

# Elements of the largest broadcast product a GEMV program holds (e.g. [rows, BLOCK_M, blocks, 32] for InnerQ):
# 8192 fp32 values is 64 registers per thread at num_warps=4, which leaves room for the operands.
PRODUCT_BUDGET = 8192
# Query rows (query heads of a KV head x q_len) one GEMV launch holds in its register tile: the product tile is
# [next_pow2(rows), ...] under PRODUCT_BUDGET, so more rows would shrink the code tile to a row or two per program;
# longer q_len is split into launches of query_t_chunk(...) rows (the codes are then read once per launch).
MAX_QUERY_ROWS = 64
# Elements of one quantize/dequantize tile [BLOCK_ROWS, blocks per group, 32].
QUANT_TILE = 1024
# A split of the reduction must run at least this many loop iterations, or its partial sum costs more than it saves.
MIN_ITERS_PER_SPLIT = 2


# ---------------------------------------------------------------------------------------------------------
# Device helpers


@triton.jit
def unpack_blocks(word0_ptrs, mask, BITS: tl.constexpr):
    """Codes of whole 32-value blocks. word0_ptrs: int32 pointers [A, NB] to word 0 of each block -> [A, NB, 32].

    A block of b-bit values is exactly b words (csrc/kvkernels/packing.cuh): for b in {1, 2, 4}, value i sits in
    word i // (32 / b) at bit (i % (32 / b)) * b; for b = 3, words 0-1 hold the 2-bit plane (v & 3) of values 0-15
    and 16-31, word 2 the high bit of all 32. Each word is loaded once and expanded by shifts and masks.
    """
    i = tl.arange(0, 32)[None, None, :]
    w0 = tl.load(word0_ptrs, mask=mask, other=0)[:, :, None]
    if BITS == 1:
        u = (w0 >> i) & 1
    elif BITS == 2:
        w1 = tl.load(word0_ptrs + 1, mask=mask, other=0)[:, :, None]
        u = (tl.where(i < 16, w0, w1) >> ((i & 15) * 2)) & 3
    elif BITS == 3:
        w1 = tl.load(word0_ptrs + 1, mask=mask, other=0)[:, :, None]
        w2 = tl.load(word0_ptrs + 2, mask=mask, other=0)[:, :, None]
        lo = (tl.where(i < 16, w0, w1) >> ((i & 15) * 2)) & 3
        u = lo | (((w2 >> i) & 1) << 2)
    else:
        tl.static_assert(BITS == 4, "bits must be 1, 2, 3 or 4")
        w1 = tl.load(word0_ptrs + 1, mask=mask, other=0)[:, :, None]
        w2 = tl.load(word0_ptrs + 2, mask=mask, other=0)[:, :, None]
        w3 = tl.load(word0_ptrs + 3, mask=mask, other=0)[:, :, None]
        w = tl.where(i < 8, w0, tl.where(i < 16, w1, tl.where(i < 24, w2, w3)))
        u = (w >> ((i & 7) * 4)) & 15
    return u


@triton.jit
def gqa_query_rows(pid_bh, H_kv, Q, T, QP: tl.constexpr):
    """The query rows a GEMV program serves: batch b and KV head h_kv from pid_bh, and that head's Q = ratio * T
    query rows q = r * T + t (query head h_q = h_kv * ratio + r, position t), padded to QP.
    Returns b, h_kv, h_q, t as int64 (they scale strides) and the mask q < Q."""
    b = (pid_bh // H_kv).to(tl.int64)
    h_kv = (pid_bh % H_kv).to(tl.int64)
    q = tl.arange(0, QP)
    h_q = h_kv * (Q // T) + (q // T)
    t = (q % T).to(tl.int64)
    return b, h_kv, h_q, t, q < Q


@triton.jit
def half_bits_to_float(h):
    """Raw fp16 bits (int16, or int32 holding them in the low 16 bits) -> fp32."""
    return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def group_affine(scale_bits, zero, BITS: tl.constexpr, MODE: tl.constexpr):
    """(s, zeff) with x ~= s * u + zeff, from raw fp16 scale bits (int16) and the fp16 zero (ignored for sym).

    MODE 0 sym: zeff = -s * 2^(b-1); 1 asym: zeff = z; 2 hybrid: the scale's sign bit selects asym (so -0.0
    counts, unlike a float comparison), s = |scale|.
    """
    OFF: tl.constexpr = float(2 ** (BITS - 1))
    if MODE == 0:
        s = half_bits_to_float(scale_bits)
        zeff = -s * OFF
    elif MODE == 1:
        s = half_bits_to_float(scale_bits)
        zeff = zero.to(tl.float32)
    else:
        sb = scale_bits.to(tl.int32)  # sign-extends: negative iff the fp16 sign bit is set
        s = half_bits_to_float(sb & 0x7FFF)
        zeff = tl.where(sb < 0, zero.to(tl.float32), -s * OFF)
    return s, zeff


@triton.jit
def round_half_even(v):
    """Round to nearest, ties to even (torch.round, CUDA rintf), from floor alone: exact for every fp32.

    floor(v + 0.5) is not: v + 0.5 itself rounds (0.49999997 + 0.5 == 1.0 in fp32).
    """
    r = tl.floor(v)
    # exact by Sterbenz except for v in (-0.5, 0), where any rounding of 1 - |v| still lands on the answer 0
    f = v - r
    half = r * 0.5
    odd = tl.floor(half) != half
    return tl.where((f > 0.5) | ((f == 0.5) & odd), r + 1.0, r)


@triton.jit
def round_to_half(v):
    """fp32 -> nearest fp16 (round half even, overflow to inf) -> fp32, like tensor.half().float()."""
    return v.to(tl.float16).to(tl.float32)


# ---------------------------------------------------------------------------------------------------------
# Launch helpers


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, int(n)))


def query_t_chunk(gq: int, T: int) -> int:
    """q_len rows per launch: all T if gq * T <= MAX_QUERY_ROWS, else the most that fit (at least one)."""
    return T if gq * T <= MAX_QUERY_ROWS else max(1, MAX_QUERY_ROWS // gq)


# Read once, at import, like @triton.jit itself: the kernels below are interpreted iff this is True.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _probe_runtime_loop(out_ptr, n):
    for k in range(0, n):
        tl.store(out_ptr + k, k)


@functools.cache
def interpreter_problem() -> str | None:
    """Why TRITON_INTERPRET=1 cannot run these kernels in this environment, or None.

    The GEMV kernels loop over their reduction with bounds passed at launch. triton 3.6's interpreter turns such a
    bound into a 1-element numpy array and calls int() on it, which numpy >= 2.4 refuses; triton 3.9 squeezes it
    first. Probed once with a 2-iteration loop rather than by version numbers, so a patched release just works.
    """
    if not INTERPRETED:
        return None
    out = torch.zeros(2, dtype=torch.int32)
    try:
        _probe_runtime_loop[(1,)](out, 2)
    except Exception as e:  # noqa: BLE001 - any failure of the probe means the interpreter cannot run our loops
        import numpy

        return (
            f"triton {triton.__version__}'s interpreter cannot run loops with launch-time bounds under numpy "
            f"{numpy.__version__} ({type(e).__name__}: {e}); use triton >= 3.9 or numpy < 2.4"
        )
    return None if out.tolist() == [0, 1] else f"triton {triton.__version__}'s interpreter ran a probe loop wrongly"


def check_device(op: str, t: torch.Tensor) -> None:
    """Compiled Triton kernels need CUDA tensors; CPU tensors run only under a working interpreter."""
    if not t.is_cuda and not INTERPRETED:
        raise ValueError(
            f"kvkernels.triton_kernels.{op}: tensors are on {t.device}; the Triton kernels run on CUDA, or on CPU "
            "with TRITON_INTERPRET=1 set before importing kvkernels (kvkernels.reference runs anywhere)"
        )
    if not t.is_cuda and (problem := interpreter_problem()):
        raise RuntimeError(f"kvkernels.triton_kernels.{op}: {problem} (kvkernels.reference runs anywhere)")


def device_ctx(t: torch.Tensor):
    """Launch on t's GPU (Triton launches on the current device), nothing to do on CPU (the interpreter)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_splits(base_programs: int, n_iters: int, device: torch.device) -> int:
    """How many programs share one reduction: enough to give every SM a few programs, never a split shorter
    than MIN_ITERS_PER_SPLIT loop iterations. The interpreter targets 4 programs so tests reach the split path."""
    target = 4 * _sm_count(device.index or 0) if device.type == "cuda" else 4
    want = triton.cdiv(target, max(1, base_programs))
    return max(1, min(want, n_iters // MIN_ITERS_PER_SPLIT))


def unit_last(t: torch.Tensor) -> torch.Tensor:
    """t, or a contiguous copy if its last dim is strided: the kernels read each row's last dim contiguously."""
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def collapse_rows(lead: tuple[int, ...], *tensors: torch.Tensor):
    """View the leading dims `lead` shared by `tensors` as 3 dims [D0, D1, D2] with per-tensor strides.

    Adjacent dims merge when every tensor is contiguous across them, so narrowed views of a cache keep their
    row strides without a copy. Returns ((D0, D1, D2), [(s0, s1, s2) per tensor]) or None when more than three
    unmergeable dims remain.
    """
    dims = [(size, [t.stride(k) for t in tensors]) for k, size in enumerate(lead) if size != 1]
    merged: list[tuple[int, list[int]]] = []
    for size, strides in dims:
        if merged and all(ps == s * size for ps, s in zip(merged[-1][1], strides, strict=True)):
            merged[-1] = (merged[-1][0] * size, strides)
        else:
            merged.append((size, strides))
    if len(merged) > 3:
        return None
    merged = [(1, [0] * len(tensors))] * (3 - len(merged)) + merged
    sizes = tuple(size for size, _ in merged)
    strides = [tuple(merged[d][1][k] for d in range(3)) for k in range(len(tensors))]
    return sizes, strides
