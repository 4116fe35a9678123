"""Fuzzing every kvkernels op through torch.ops (issue 12): random, mostly invalid, arguments on the CPU registration
(C++ or the reference) and on the fakes (all tensors on device='meta').

Each case is a consistent call (shapes, dtypes, bits, group size, mode, eta; for the lattice ops a grid, signs and
inverse; for decode_attention_fused a sink, two stores in layout rows or cols, tails, a key scale, an additive mask
and a split) plus zero to two mutations: a wrong dtype, a wrong or empty shape, a non-unit last stride, a tensor on
'meta' among CPU tensors, None for a tensor, bits 0/5/9/-1, group sizes 0/negative/non-multiples (lattice: not a
power of two in [32, 1024]), bad modes and layouts, eta NaN/negative/>= 0.5/with sym, split_tokens not a multiple of
the group, another grid than the codes were sized for, Python values of the wrong type. Layouts include padded rows,
storage offsets, stride-0 (broadcast) leading dims and column-major tensors; values include NaN, Inf, huge,
subnormal, constant and arbitrary fp16 bit patterns (additive masks: -inf, finfo.min, biases). Every call must end in
one of two ways:
  * an exception of type ValueError/TypeError/RuntimeError/IndexError whose message names the op, of the same type
    on CPU and on meta (the C++ checks, csrc/op_checks.h, and the Python ones, kvkernels/_validate.py, agree);
  * a result equal to kvkernels.reference (bit-exact for packing and quantization, within fp32 rounding bounds for
    dequantization and the GEMVs, which are checked against a float64 evaluation of their formula), with the
    shapes and dtypes the fake returns for the same call; quantize_groups_into writes nothing outside its views.
    The lattice ops' CPU kernel is the reference itself, so all five are held to a float64 evaluation of
    docs/FORMATS.md ("Lattice") with an explicit Hadamard matrix: lattice_quantize's norms to fp16 rounding, its
    codes to the nearest grid point up to fp32 near-ties. decode_attention_fused is held to a float64
    softmax(x K^T + mask) V, the scores' fp32 error carried through the softmax (check_decode_attention_fused).

Each op runs in its own subprocess (`python tests/test_fuzz_ops.py --worker OP`), so a crash (SIGSEGV, SIGFPE,
abort) fails that op's test, naming the signal and the case being run, instead of killing pytest. Hypothesis runs
derandomized (the same cases on every run) with EXAMPLES examples per op. For longer hunts by hand:
`--examples 20000 --seed N` (other cases), `--backend triton` (the Triton kernels as ops.py registers them for CUDA,
under TRITON_INTERPRET=1 on CPU: about 0.3 s a call, so not in CI).
"""

import argparse
import faulthandler
import functools
import itertools
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import hypothesis
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import kvkernels
from kvkernels import reference

EXAMPLES = 2000
MIN_VALID_FRACTION = 0.2  # of the examples, calls that must succeed (so the value checks really run)
ROOT = Path(__file__).resolve().parent.parent
ALLOWED_ERRORS = (ValueError, TypeError, RuntimeError, IndexError)  # NotImplementedError is a RuntimeError

BITS = (1, 2, 3, 4)
BAD_BITS = (-1, 0, 5, 8, 9, 32, 2**31, -(2**63))
MODES = ("sym", "asym", "hybrid")
BAD_MODES = ("", "SYM", "asymm", "hybrid ", "none", "sym\x00")
GROUPS = (32, 64, 96, 128)
BAD_GROUPS = (0, -32, 1, 16, 33, 48, 2**40, -(2**63))
ETAS = (0.0, 0.0, -0.0, 0.1, 0.25, 0.49)
BAD_ETAS = (math.nan, -0.1, 0.5, 0.7, 1.0, 2.0, math.inf, -math.inf, 0.25)  # 0.25 is bad with sym/hybrid
WRONG_PY_TYPES = (None, 2.5, "2", True)
FLOAT_X = (torch.float16, torch.bfloat16, torch.float32)
INT_CODE_DTYPES = (
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
)
ANY_DTYPE = (
    torch.bool,
    *INT_CODE_DTYPES,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.float8_e4m3fn,
)
FLOAT_VALUES = ("normal", "normal", "wide", "special", "discrete", "constant", "huge", "zeros")
SCALE_VALUES = ("scale", "scale", "scale", "fp16bits", "special", "zeros")
INPUT_LAYOUTS = ("contig", "contig", "contig", "padded", "offset", "bcast", "colmajor")
OUTPUT_LAYOUTS = ("contig", "contig", "padded", "offset")


# ---- cases -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TSpec:
    """How to build one tensor argument: shape, dtype, memory layout, kind of values, device."""

    shape: tuple
    dtype: torch.dtype
    layout: str = "contig"  # contig | padded | offset | bcast | colmajor | last2
    values: str = "normal"
    device: str = "cpu"

    def __repr__(self):
        dev = ", meta" if self.device == "meta" else ""
        return f"T({list(self.shape)}, {str(self.dtype).removeprefix('torch.')}, {self.layout}, {self.values}{dev})"


@dataclass
class Case:
    op: str
    args: dict  # argument name (as in the schema) -> TSpec, None or a Python scalar
    seed: int
    mutations: list = field(default_factory=list)

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.args.items())
        return f"Case({self.op}: {args}; seed={self.seed}, mutations={self.mutations})"


def _strides(shape, layout, pad=3):
    """(strides, storage offset) of a tensor of `shape` in the given layout."""
    n = len(shape)
    fastest_first = range(n) if layout == "colmajor" else range(n - 1, -1, -1)
    strides, acc = [0] * n, 1
    for i, d in enumerate(fastest_first):
        strides[d] = acc * (2 if layout == "last2" and i == 0 else 1)
        acc = strides[d] * max(shape[d], 1) + (pad if layout == "padded" and i == 0 else 0)
    if layout == "bcast" and n >= 2:  # a leading dim read with stride 0 (an expand()ed tensor)
        d = next((d for d in range(n - 1) if shape[d] > 1), 0)
        strides[d] = 0
    return strides, (pad if layout in ("offset", "padded") else 0)


SPECIALS = (math.nan, math.inf, -math.inf, 0.0, -0.0, 65504.0, -65504.0, 65520.0, 3.0e38, -3.0e38, 1e-45, 6e-8, 1e-30)


def _values(n, dtype, kind, gen):
    """n values of `dtype` of the given kind (float kinds for float dtypes, integer kinds for integer ones)."""
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=gen).bool()
    if dtype.is_complex:
        return torch.randn(n, generator=gen, dtype=dtype)
    if not dtype.is_floating_point:
        if kind.startswith("codes"):  # valid codes for `bits`
            v = torch.randint(0, 2 ** int(kind[5:]), (n,), generator=gen)
        elif kind.startswith("counts:"):  # given values (static_append's lengths), then junk
            given = [int(c) for c in kind[7:].split(",")]
            v = torch.cat([torch.tensor(given[:n]), torch.randint(-9, 9, (max(n - len(given), 0),), generator=gen)])
        elif kind == "oob":
            v = torch.randint(-40, 40, (n,), generator=gen)
        elif kind == "signs":  # the lattice ops' sign vectors
            v = torch.randint(0, 2, (n,), generator=gen) * 2 - 1
        else:  # arbitrary bit patterns of the dtype (int64 words, wrapped by the cast)
            v = torch.randint(-(2**63), 2**63 - 1, (n,), generator=gen)
        return v.to(dtype)
    if kind == "fp16bits" and dtype == torch.float16:
        return torch.randint(-(2**15), 2**15, (n,), generator=gen, dtype=torch.int16).view(torch.float16)
    scale = 10.0 ** float(torch.empty(()).uniform_(-2, 2, generator=gen))
    if kind in ("normal", "fp16bits"):
        v = torch.randn(n, generator=gen, dtype=torch.float64) * scale
    elif kind == "scale":  # realistic positive scales
        v = torch.rand(n, generator=gen, dtype=torch.float64) * scale / 10
    elif kind == "sscale":  # realistic scales of either sign (hybrid reads the sign as its asym flag)
        sign = torch.randint(0, 2, (n,), generator=gen) * 2 - 1
        v = sign * torch.rand(n, generator=gen, dtype=torch.float64) * scale / 10
    elif kind == "wide":
        sign = torch.randint(0, 2, (n,), generator=gen) * 2 - 1
        v = sign * 10.0 ** torch.empty(n, dtype=torch.float64).uniform_(-46, 39, generator=gen)
    elif kind == "special":
        v = torch.randn(n, generator=gen, dtype=torch.float64) * scale
        pick = torch.randint(0, len(SPECIALS), (n,), generator=gen)
        hit = torch.rand(n, generator=gen) < 0.2
        v = torch.where(hit, torch.tensor(SPECIALS, dtype=torch.float64)[pick], v)
    elif kind == "discrete":
        v = torch.tensor([0.0, 1.0, -1.0, 0.5, -2.0, 3.0], dtype=torch.float64)[
            torch.randint(0, 6, (n,), generator=gen)
        ]
    elif kind == "constant":
        v = torch.full((n,), float(torch.randn((), generator=gen)) * scale, dtype=torch.float64)
    elif kind == "huge":
        sign = torch.randint(0, 2, (n,), generator=gen) * 2 - 1
        v = sign * torch.empty(n, dtype=torch.float64).uniform_(6e4, 3.4e38, generator=gen)
    elif kind == "zeros":
        v = torch.zeros(n, dtype=torch.float64)
    elif kind in ("mask", "boolmask"):  # additive attention masks: biases, 0, -inf, finfo.min (a masked bool)
        low = torch.finfo(dtype).min
        menu = (0.0, -math.inf, low, math.nan) if kind == "mask" else (0.0, low, low, low)
        v = torch.tensor(menu, dtype=torch.float64)[torch.randint(0, 4, (n,), generator=gen)]
        if kind == "mask":  # the NaN slot: a finite bias
            v = torch.where(v.isnan(), torch.randn(n, generator=gen, dtype=torch.float64) * scale, v)
    else:  # an integer kind on a float dtype (after a dtype mutation)
        v = torch.randn(n, generator=gen, dtype=torch.float64)
    return v.to(dtype)


def build(spec, gen):
    """(tensor, flat backing buffer or None). The buffer holds random values outside the view too."""
    strides, offset = _strides(spec.shape, spec.layout)
    if spec.device == "meta":
        return torch.empty_strided(spec.shape, strides, dtype=spec.dtype, device="meta"), None
    extent = 1 + sum((s - 1) * st for s, st in zip(spec.shape, strides, strict=True)) if all(spec.shape) else 0
    buf = _values(offset + extent + 4, spec.dtype, spec.values, gen)
    view = buf.as_strided(spec.shape, strides, offset)
    if spec.values == "mask" and spec.dtype.is_floating_point and view.dim() and view.numel():
        # a row of -inf only masks every key (the softmax is NaN; the op's callers never pass it): its last entry
        # becomes 0, written through the buffer so that rows sharing memory (stride 0) stay consistent
        dead = torch.isneginf(view.float()).all(-1).nonzero()  # [rows, dim - 1]
        at = offset + (dead * torch.tensor(strides[:-1], dtype=torch.int64)).sum(1) + (view.shape[-1] - 1) * strides[-1]
        buf[at] = 0
    return view, buf


def as_meta(a):
    if isinstance(a, torch.Tensor):
        return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
    return a


# ---- strategies: one consistent call per op, then mutations -------------------------------------------------------


def _float_spec(draw, shape, dtypes=FLOAT_X, layouts=INPUT_LAYOUTS, values=FLOAT_VALUES):
    return TSpec(
        tuple(shape), draw(st.sampled_from(dtypes)), draw(st.sampled_from(layouts)), draw(st.sampled_from(values))
    )


def _codes_spec(draw, shape, layouts=INPUT_LAYOUTS):
    return TSpec(tuple(shape), torch.int32, draw(st.sampled_from(layouts)), "bits")


def _scale_spec(draw, shape, layouts=INPUT_LAYOUTS):
    return TSpec(tuple(shape), torch.float16, draw(st.sampled_from(layouts)), draw(st.sampled_from(SCALE_VALUES)))


def _lead(draw, max_dims=3):
    return draw(st.lists(st.sampled_from((0, 1, 1, 2, 2, 3, 3, 5)), min_size=0, max_size=max_dims))


def _length(draw, group):
    return group * draw(st.sampled_from((0, 1, 1, 1, 2, 2, 3, 4)))


def _mutate_shape(draw, shape):
    shape = list(shape)
    how = draw(st.sampled_from(("grow", "shrink", "zero", "drop", "add", "scalar")))
    if how == "scalar":
        return ()
    if how == "add":
        return (draw(st.sampled_from((1, 2))), *shape)
    if not shape:
        return (draw(st.sampled_from((0, 1, 32))),)
    d = draw(st.integers(0, len(shape) - 1))
    if how == "drop":
        return tuple(shape[:d] + shape[d + 1 :])
    if how == "zero":
        shape[d] = 0
    else:
        shape[d] = max(0, shape[d] + draw(st.sampled_from((1, 2, 32) if how == "grow" else (-1, -2, -32))))
    return tuple(shape)


def _mutate(draw, case: Case, scalar_bad: dict, optional=()):
    tensors = [k for k, v in case.args.items() if isinstance(v, TSpec)]
    menu = ["scalar", "pytype"] + (["dtype", "shape", "shape", "stride", "device", "none"] if tensors else [])
    how = draw(st.sampled_from(menu))
    if how in ("scalar", "pytype"):
        name = draw(st.sampled_from(sorted(scalar_bad)))
        value = draw(st.sampled_from(scalar_bad[name] if how == "scalar" else WRONG_PY_TYPES))
        case.args[name] = value
        case.mutations.append(f"{name}={value!r}" if how == "scalar" else f"pytype:{name}={value!r}")
        return
    name = draw(st.sampled_from(tensors))
    spec = case.args[name]
    if how == "dtype":
        spec = replace(spec, dtype=draw(st.sampled_from(ANY_DTYPE)))
    elif how == "shape":
        spec = replace(spec, shape=_mutate_shape(draw, spec.shape))
    elif how == "stride":
        spec = replace(spec, layout=draw(st.sampled_from(("last2", "colmajor", "bcast"))))
    elif how == "device":
        spec = replace(spec, device="meta")
    elif how == "none":
        spec = None
    case.args[name] = spec
    case.mutations.append(f"{how}:{name}" + ("" if name in optional or how != "none" else "(required)"))


def _finish(draw, case: Case, scalar_bad: dict, optional=()):
    for _ in range(draw(st.sampled_from((0, 0, 0, 1, 1, 2)))):
        _mutate(draw, case, scalar_bad, optional)
    return case


@st.composite
def pack_bits_cases(draw):
    bits = draw(st.sampled_from(BITS))
    shape = (*_lead(draw), 32 * draw(st.sampled_from((0, 1, 1, 2, 3, 4, 5, 8))))
    values = draw(st.sampled_from((f"codes{bits}",) * 4 + ("oob", "bits")))
    codes = TSpec(shape, draw(st.sampled_from(INT_CODE_DTYPES)), draw(st.sampled_from(INPUT_LAYOUTS)), values)
    case = Case("pack_bits", {"codes": codes, "bits": bits}, draw(st.integers(0, 2**32 - 1)))
    return _finish(draw, case, {"bits": BAD_BITS})


@st.composite
def unpack_bits_cases(draw):
    bits = draw(st.sampled_from(BITS))
    packed = _codes_spec(draw, (*_lead(draw), bits * draw(st.sampled_from((0, 1, 1, 2, 3, 4, 5, 8)))))
    case = Case("unpack_bits", {"packed": packed, "bits": bits}, draw(st.integers(0, 2**32 - 1)))
    return _finish(draw, case, {"bits": BAD_BITS})


def _quant_scalars(draw):
    bits, group, mode = draw(st.sampled_from(BITS)), draw(st.sampled_from(GROUPS)), draw(st.sampled_from(MODES))
    eta = draw(st.sampled_from(ETAS)) if mode == "asym" else draw(st.sampled_from((0.0, 0.0, -0.0)))
    return bits, group, mode, eta


QUANT_BAD = {"bits": BAD_BITS, "group_size": BAD_GROUPS, "eta": BAD_ETAS}


@st.composite
def quantize_groups_cases(draw):
    bits, group, mode, eta = _quant_scalars(draw)
    x = _float_spec(draw, (*_lead(draw), _length(draw, group)))
    args = {"x": x, "bits": bits, "group_size": group, "mode": mode, "eta": eta}
    case = Case("quantize_groups", args, draw(st.integers(0, 2**32 - 1)))
    return _finish(draw, case, {**QUANT_BAD, "mode": BAD_MODES})


@st.composite
def quantize_groups_into_cases(draw):
    bits, group, mode, eta = _quant_scalars(draw)
    lead, L = _lead(draw), _length(draw, group)
    x = _float_spec(draw, (*lead, L))
    codes = _codes_spec(draw, (*lead, L // 32 * bits), OUTPUT_LAYOUTS)
    scales = _scale_spec(draw, (*lead, L // group), OUTPUT_LAYOUTS)
    zeros = _scale_spec(draw, (*lead, L // group), OUTPUT_LAYOUTS)
    args = {"x": x, "bits": bits, "group_size": group, "quant_mode": mode, "eta": eta}
    args |= {"codes": codes, "scales": scales, "zeros": zeros}
    case = Case("quantize_groups_into", args, draw(st.integers(0, 2**32 - 1)))
    return _finish(draw, case, {**QUANT_BAD, "quant_mode": BAD_MODES})


@st.composite
def dequantize_groups_cases(draw):
    bits, group, mode, _ = _quant_scalars(draw)
    lead, L = _lead(draw), _length(draw, group)
    codes = _codes_spec(draw, (*lead, L // 32 * bits))
    scales = _scale_spec(draw, (*lead, L // group))
    zeros = None if mode == "sym" and draw(st.booleans()) else _scale_spec(draw, (*lead, L // group))
    args = {"codes": codes, "scales": scales, "zeros": zeros, "bits": bits, "group_size": group, "mode": mode}
    case = Case("dequantize_groups", args, draw(st.integers(0, 2**32 - 1)))
    return _finish(draw, case, {"bits": BAD_BITS, "group_size": BAD_GROUPS, "mode": BAD_MODES}, optional=("zeros",))


def _gemv_heads(draw):
    B = draw(st.sampled_from((0, 1, 1, 1, 2, 2, 3, 3)))
    H_kv = draw(st.sampled_from((1, 1, 2)))
    H_q = H_kv * draw(st.sampled_from((1, 2, 3)))
    T = draw(st.sampled_from((None, None, None, 0, 1, 2, 3, 5)))
    return B, H_q, H_kv, T


def _gemv_inner_q_args(draw):
    B, H_q, H_kv, T = _gemv_heads(draw)
    bits, group, mode, _ = _quant_scalars(draw)
    L, M = _length(draw, group), draw(st.sampled_from((0, 1, 3, 5, 8, 13, 16, 33)))
    x = _float_spec(draw, (B, H_q, L) if T is None else (B, H_q, T, L))
    codes = _codes_spec(draw, (B, H_kv, M, L // 32 * bits))
    scales = _scale_spec(draw, (B, H_kv, M, L // group))
    zeros = None if mode == "sym" and draw(st.booleans()) else _scale_spec(draw, (B, H_kv, M, L // group))
    x_scale = None if draw(st.booleans()) else _float_spec(draw, (H_kv, L), (torch.float32,), values=SCALE_VALUES)
    args = {"x": x, "codes": codes, "scales": scales, "zeros": zeros, "bits": bits, "group_size": group}
    args |= {"mode": mode, "x_scale": x_scale}
    return args, (*x.shape[:-1], M)


@st.composite
def gemv_inner_q_cases(draw):
    args, _ = _gemv_inner_q_args(draw)
    case = Case("gemv_inner_q", args, draw(st.integers(0, 2**32 - 1)))
    bad = {"bits": BAD_BITS, "group_size": BAD_GROUPS, "mode": BAD_MODES}
    return _finish(draw, case, bad, optional=("zeros", "x_scale"))


def _gemv_out_args(draw, out_shape):
    """out (fp32 in an output layout: rows may be padded) and workspace (None, or any length: the CPU kernels
    take none) of the GEMVs' _into forms."""
    out = TSpec(tuple(out_shape), torch.float32, draw(st.sampled_from(OUTPUT_LAYOUTS)), "normal")
    workspace = None if draw(st.booleans()) else TSpec((draw(st.sampled_from((0, 1, 64))),), torch.float32)
    return {"out": out, "workspace": workspace}


@st.composite
def gemv_inner_q_into_cases(draw):
    args, out_shape = _gemv_inner_q_args(draw)
    args["quant_mode"] = args.pop("mode")
    args["x_scale"] = args.pop("x_scale")  # the schema's order: ..., quant_mode, x_scale, out, workspace
    args |= _gemv_out_args(draw, out_shape)
    case = Case("gemv_inner_q_into", args, draw(st.integers(0, 2**32 - 1)))
    bad = {"bits": BAD_BITS, "group_size": BAD_GROUPS, "quant_mode": BAD_MODES}
    return _finish(draw, case, bad, optional=("zeros", "x_scale", "workspace"))


@st.composite
def gemv_workspace_numel_cases(draw):
    if draw(st.booleans()):
        args, _ = _gemv_inner_q_args(draw)
        args = {"op": "gemv_inner_q", **args}
    else:
        args, _ = _gemv_kivi_args(draw)
        args = {"op": "gemv_kivi", **args, "mode": "asym", "x_scale": None}
    case = Case("gemv_workspace_numel", args, draw(st.integers(0, 2**32 - 1)))
    bad = {"op": ("", "gemv_lattice_k", "GEMV_KIVI"), "bits": BAD_BITS, "group_size": BAD_GROUPS}
    return _finish(draw, case, bad | {"mode": BAD_MODES}, optional=("zeros", "x_scale"))


def _gemv_kivi_args(draw):
    B, H_q, H_kv, T = _gemv_heads(draw)
    bits, group = draw(st.sampled_from(BITS)), draw(st.sampled_from(GROUPS))
    R, C = draw(st.sampled_from((0, 1, 3, 8, 17, 40, 64, 100))), _length(draw, group)
    x = _float_spec(draw, (B, H_q, R) if T is None else (B, H_q, T, R))
    codes = _codes_spec(draw, (B, H_kv, R, C // 32 * bits))
    scales = _scale_spec(draw, (B, H_kv, R, C // group))
    zeros = _scale_spec(draw, (B, H_kv, R, C // group))
    args = {"x": x, "codes": codes, "scales": scales, "zeros": zeros, "bits": bits, "group_size": group}
    return args, (*x.shape[:-1], C)


@st.composite
def gemv_kivi_cases(draw):
    args, _ = _gemv_kivi_args(draw)
    case = Case("gemv_kivi", args, draw(st.integers(0, 2**32 - 1)))
    return _finish(draw, case, {"bits": BAD_BITS, "group_size": BAD_GROUPS})


@st.composite
def gemv_kivi_into_cases(draw):
    args, out_shape = _gemv_kivi_args(draw)
    args |= _gemv_out_args(draw, out_shape)
    case = Case("gemv_kivi_into", args, draw(st.integers(0, 2**32 - 1)))
    return _finish(draw, case, {"bits": BAD_BITS, "group_size": BAD_GROUPS}, optional=("workspace",))


LATTICE_BITS = {(2, 16): 2, (2, 64): 3, (2, 256): 4, (4, 256): 2}  # grid (d, n) -> bits per value
LATTICE_GROUPS = (32, 32, 64, 128, 256, 1024)
BAD_LATTICE_GROUPS = (0, -32, 1, 16, 48, 96, 160, 2048, 2**40, -(2**63))
GRID_VALUES = ("normal", "normal", "discrete", "constant")  # finite: a grid is data, the ops do not check its values
GRID_LAYOUTS = ("contig", "contig", "padded", "offset", "bcast")  # column-major only by mutation: enough valid calls
SIGN_VALUES = ("signs", "signs", "signs", "bits")  # +-1, or any int8 (outside the contract, multiplied as is)
LATTICE_BAD = {"group_size": BAD_LATTICE_GROUPS}


def _lattice_scalars(draw):
    """(bits, group, grid spec, signs spec or None) of one consistent lattice call."""
    d, n = draw(st.sampled_from(sorted(LATTICE_BITS)))
    group = draw(st.sampled_from(LATTICE_GROUPS))
    grid = TSpec((n, d), torch.float32, draw(st.sampled_from(GRID_LAYOUTS)), draw(st.sampled_from(GRID_VALUES)))
    signs = None
    if draw(st.booleans()):
        signs = TSpec((group,), torch.int8, draw(st.sampled_from(INPUT_LAYOUTS)), draw(st.sampled_from(SIGN_VALUES)))
    return LATTICE_BITS[(d, n)], group, grid, signs


def _lattice_length(draw, group):
    # values per row; a group of 1024 at most twice, so the oracle's float64 scores stay small
    return group * draw(st.sampled_from((0, 1, 1, 1, 2, 2) if group == 1024 else (0, 1, 1, 1, 2, 2, 3, 4)))


def _lattice_finish(draw, case: Case):
    # another grid than the one the codes were sized for: same bits ((2, 16) and (4, 256)) is a valid call
    if draw(st.sampled_from((False,) * 9 + (True,))):
        d, n = draw(st.sampled_from(sorted(LATTICE_BITS)))
        case.args["grid"] = replace(case.args["grid"], shape=(n, d))
        case.mutations.append(f"regrid:{n}x{d}")
    return _finish(draw, case, LATTICE_BAD, optional=("signs",))


@st.composite
def fwht_cases(draw):
    _, group, _, signs = _lattice_scalars(draw)
    x = _float_spec(draw, (*_lead(draw, 2), _lattice_length(draw, group)))
    args = {"x": x, "group_size": group, "signs": signs, "inverse": draw(st.booleans())}
    case = Case("fwht", args, draw(st.integers(0, 2**32 - 1)))
    return _finish(draw, case, LATTICE_BAD | {"inverse": (None, 2, 0.5)}, optional=("signs",))


@st.composite
def lattice_quantize_cases(draw):
    _, group, grid, signs = _lattice_scalars(draw)
    x = _float_spec(draw, (*_lead(draw, 2), _lattice_length(draw, group)))
    args = {"x": x, "grid": grid, "group_size": group, "signs": signs}
    return _lattice_finish(draw, Case("lattice_quantize", args, draw(st.integers(0, 2**32 - 1))))


@st.composite
def lattice_dequantize_cases(draw):
    bits, group, grid, signs = _lattice_scalars(draw)
    lead, C = _lead(draw, 2), _lattice_length(draw, group)
    codes = _codes_spec(draw, (*lead, C // 32 * bits))
    norms = _scale_spec(draw, (*lead, C // group))
    args = {"codes": codes, "norms": norms, "grid": grid, "group_size": group, "signs": signs}
    return _lattice_finish(draw, Case("lattice_dequantize", args, draw(st.integers(0, 2**32 - 1))))


def _lattice_gemv_case(draw, op):
    B, H_q, H_kv, T = _gemv_heads(draw)
    bits, group, grid, signs = _lattice_scalars(draw)
    D, N = _lattice_length(draw, group), draw(st.sampled_from((0, 1, 3, 5, 8, 13, 16, 33)))
    L = D if op == "gemv_lattice_k" else N  # the activation's last dim: keys reduce over D, values over N
    act = _float_spec(draw, (B, H_q, L) if T is None else (B, H_q, T, L))
    codes = _codes_spec(draw, (B, H_kv, N, D // 32 * bits))
    norms = _scale_spec(draw, (B, H_kv, N, D // group))
    name = "q" if op == "gemv_lattice_k" else "p"
    args = {name: act, "codes": codes, "norms": norms, "grid": grid, "group_size": group, "signs": signs}
    return _lattice_finish(draw, Case(op, args, draw(st.integers(0, 2**32 - 1))))


@st.composite
def gemv_lattice_k_cases(draw):
    return _lattice_gemv_case(draw, "gemv_lattice_k")


@st.composite
def gemv_lattice_v_cases(draw):
    return _lattice_gemv_case(draw, "gemv_lattice_v")


@st.composite
def aqua_reconstruct_cases(draw):
    bits, group, grid, signs = _lattice_scalars(draw)
    T, C = draw(st.sampled_from((0, 1, 3, 5, 17))), _lattice_length(draw, group)
    C = min(C, 256)  # the oracle's float64 GEMM stays small; 1024-groups still come through C = 0
    dtype = draw(st.sampled_from(FLOAT_X))  # one dtype for every GEMM operand

    def operand(shape):
        return _float_spec(draw, shape, dtypes=(dtype,))

    C_in = draw(st.sampled_from((1, 3, 16, 33, 64)))
    args = {
        "prev": operand((T, C_in)),
        "weight": operand((C, C_in)),
        "bias": _float_spec(draw, (C,), dtypes=(torch.float32,)),
        "codes": _codes_spec(draw, (T, C // 32 * bits)),
        "norms": _scale_spec(draw, (T, C // group)),
        "grid": grid,
        "group_size": group,
        "signs": signs,
        "prev2": None,
        "weight2": None,
    }
    if draw(st.booleans()):
        C_in2 = draw(st.sampled_from((1, 16, 40)))
        args["prev2"], args["weight2"] = operand((T, C_in2)), operand((C, C_in2))
    case = Case("aqua_reconstruct", args, draw(st.integers(0, 2**32 - 1)))
    return _finish(draw, case, LATTICE_BAD, optional=("signs", "prev2", "weight2"))


LAYOUTS = ("rows", "cols")
# bad layout names, and both valid ones: the other layout is a valid call wherever the shapes still fit (m == D)
LAYOUT_MUTATIONS = ("", "ROWS", "row", "cols ", "tokens", "rows\x00", "rows", "cols")
ATTN_GROUPS = (32, 64)
ATTN_DIMS = (32, 64, 128)
# positive multiples of 32 too: then the shapes disagree (or m = 0 fits); 2**62 only the bound refuses
ATTN_BAD_GROUPS = (*BAD_GROUPS, 96, 128, 2**62)
BAD_SPLITS = (-1, -32, 1, 16, 33, 48, 96, 2**40, 2**63 - 1, -(2**63))  # 96 (G = 32) and 2**40 are valid
# eleven tensors: with column-major in the menu, too few calls would be valid (column-major comes by mutation)
ATTN_LAYOUTS = ("contig", "contig", "contig", "padded", "offset", "bcast")
MASK_VALUES = ("mask", "mask", "boolmask", "normal", "zeros")  # _values: additive masks, -inf rows kept finite
# one non-finite key or value anywhere in a KV head makes its rows NaN (0 * Inf), so the values are finite in most
# cases (all kinds in the rest), or the oracle would check few rows
TAME_VALUES = ("normal", "normal", "normal", "discrete", "constant", "zeros")
TAME_SCALES = ("scale", "sscale", "sscale", "zeros")


@functools.cache
def _product(*menus):
    """One draw for a combination (layout and values of a tensor, ...): eleven tensors, so fewer draws per case."""
    return st.sampled_from(list(itertools.product(*menus)))


def _attention_spec(draw, shape, dtype, values):
    layout, kind = draw(_product(ATTN_LAYOUTS, values))
    return TSpec(tuple(shape), dtype, layout, kind)


def _attention_store(draw, B, H_kv, D, group, layout, scale_values):
    """(bits, mode, codes, scales, zeros, tokens) of one quantized store of decode_attention_fused."""
    bits, mode = draw(_product(BITS, MODES))
    if layout == "rows":  # token t is row t, groups along the D channels
        m = draw(st.sampled_from((0, 1, 3, 5, 8, 17, 40)))
        words, groups = (B, H_kv, m, D // 32 * bits), (B, H_kv, m, D // group)
    else:  # channel-major, groups along the tokens: m a multiple of G
        m = group * draw(st.sampled_from((0, 1, 1, 2)))
        words, groups = (B, H_kv, D, m // 32 * bits), (B, H_kv, D, m // group)
    codes = _attention_spec(draw, words, torch.int32, ("bits",))
    scales = _attention_spec(draw, groups, torch.float16, scale_values)
    zeros = None
    if mode != "sym" or draw(st.booleans()):
        zeros = _attention_spec(draw, groups, torch.float16, scale_values)
    return bits, mode, codes, scales, zeros, m


@st.composite
def decode_attention_fused_cases(draw):
    B, H_kv, ratio = draw(_product((0, 1, 1, 1, 2, 2, 3), (1, 1, 2), (1, 2, 3, 4)))
    H_q = H_kv * ratio
    group, k_layout, v_layout = draw(_product(ATTN_GROUPS, LAYOUTS, LAYOUTS))
    D = draw(st.sampled_from([d for d in ATTN_DIMS if d % group == 0 or "rows" not in (k_layout, v_layout)]))
    wild = draw(st.sampled_from((False, False, False, True)))
    values, scale_values = (FLOAT_VALUES, SCALE_VALUES + ("sscale",)) if wild else (TAME_VALUES, TAME_SCALES)
    k_bits, k_mode, k_codes, k_scales, k_zeros, mk = _attention_store(draw, B, H_kv, D, group, k_layout, scale_values)
    v_bits, v_mode, v_codes, v_scales, v_zeros, mv = _attention_store(draw, B, H_kv, D, group, v_layout, scale_values)
    S, extra, T = draw(_product((0, 0, 1, 2, 4), (0, 1, 2, 5, 16, 33), (1, 1, 2, 3, 5)))
    after = max(max(mk, mv) + extra, 1 - S)  # store + tail tokens, the same for keys and values; N >= 1
    N = S + after
    T = min(T, N)
    dtype = draw(st.sampled_from(FLOAT_X))  # the window dtype: sinks and tails

    def window(n):
        return _attention_spec(draw, (B, H_kv, n, D), dtype, values)

    x_scale = None
    if draw(st.booleans()):
        x_scale = _attention_spec(draw, (H_kv, D), torch.float32, ("scale",))
    mask = None
    if draw(st.booleans()):
        mask_b, mask_h = draw(_product((B, 1), (H_q, 1)))
        mask = _attention_spec(draw, (mask_b, mask_h, T, N), torch.float32, MASK_VALUES)
    args = {
        "x": _attention_spec(draw, (B, H_q, T, D), draw(st.sampled_from((torch.float32,) * 3 + FLOAT_X)), values),
        "sink_keys": window(S),
        "sink_values": window(S),
        "key_codes": k_codes,
        "key_scales": k_scales,
        "key_zeros": k_zeros,
        "value_codes": v_codes,
        "value_scales": v_scales,
        "value_zeros": v_zeros,
        "key_tail": window(after - mk),
        "value_tail": window(after - mv),
        "key_bits": k_bits,
        "key_mode": k_mode,
        "key_layout": k_layout,
        "value_bits": v_bits,
        "value_mode": v_mode,
        "value_layout": v_layout,
        "group_size": group,
        "key_x_scale": x_scale,
        "attn_mask": mask,
        "split_tokens": draw(st.sampled_from((0, 0, group, 2 * group, 4 * group))),
        "lengths": None,
        "q_scale": draw(st.sampled_from((1.0, 1.0, 0.125, 0.0883883476, 3.0, -0.5))),
        "out_dtype": draw(st.sampled_from((None, None, *FLOAT_X))),
    }
    case = Case("decode_attention_fused", args, draw(st.integers(0, 2**32 - 1)))
    bad = {"key_bits": BAD_BITS, "value_bits": BAD_BITS, "key_mode": BAD_MODES, "value_mode": BAD_MODES}
    bad |= {"key_layout": LAYOUT_MUTATIONS, "value_layout": LAYOUT_MUTATIONS, "group_size": ATTN_BAD_GROUPS}
    bad |= {"split_tokens": BAD_SPLITS, "q_scale": (math.nan, math.inf, -math.inf, 1e300)}
    bad |= {"out_dtype": (torch.int32, torch.float64, torch.bool)}
    return _finish(draw, case, bad, optional=("key_zeros", "value_zeros", "key_x_scale", "attn_mask"))


@st.composite
def static_append_cases(draw):
    # capacity buffers and device counts that meet the op's preconditions (kvkernels/reference/static_append.py: the
    # tails have room for the new tokens, the stores for E more past their counts, "cols" counts whole groups), so
    # that the meta call (which cannot read the counts) and the CPU call agree; mutations break the metadata
    B, H, n = draw(_product((0, 1, 1, 2), (1, 2), (1, 1, 2, 3)))
    group, k_layout, v_layout = draw(_product(ATTN_GROUPS, LAYOUTS, LAYOUTS))
    D = draw(st.sampled_from([d for d in ATTN_DIMS if d % group == 0 or "rows" not in (k_layout, v_layout)]))
    W, w_recent = draw(_product((0, 1, 2, 4), (0, 1, 4, 8)))
    S = draw(st.integers(0, W))
    wild = draw(st.sampled_from((False, False, False, True)))
    values, scale_values = (FLOAT_VALUES, SCALE_VALUES + ("sscale",)) if wild else (TAME_VALUES, TAME_SCALES)
    dtype = draw(st.sampled_from(FLOAT_X))
    args, counts = {}, [S]
    sides = {}
    for side, layout in (("key", k_layout), ("value", v_layout)):
        bits, mode = draw(_product(BITS, MODES))
        eta = draw(st.sampled_from(ETAS)) if mode == "asym" else 0.0
        step = 1 if layout == "rows" else group
        tail_cap = w_recent + n + (group - 1 if layout == "cols" else 0) + draw(st.sampled_from((0, 0, 1, 3)))
        E = max(tail_cap - w_recent, 0) // step * step
        cap = E + step * draw(st.sampled_from((0, 1, 2, 3)))
        stored = step * draw(st.integers(0, (cap - E) // step))
        tail = draw(st.integers(0, tail_cap - n))
        counts += [stored, tail]
        if layout == "rows":
            words, groups = (B, H, cap, D // 32 * bits), (B, H, cap, D // group)
        else:
            words, groups = (B, H, D, cap // 32 * bits), (B, H, D, cap // group)
        zeros = None
        if mode != "sym" or draw(st.booleans()):
            zeros = _attention_spec(draw, groups, torch.float16, scale_values)
        sides[side] = {
            "codes": _attention_spec(draw, words, torch.int32, ("bits",)),
            "scales": _attention_spec(draw, groups, torch.float16, scale_values),
            "zeros": zeros,
            "tail": _attention_spec(draw, (B, H, tail_cap, D), dtype, values),
            "bits": bits,
            "mode": mode,
            "layout": layout,
            "eta": eta,
        }
    x_scale = _attention_spec(draw, (H, D), torch.float32, ("scale",)) if draw(st.booleans()) else None
    args = {
        "k": _attention_spec(draw, (B, H, n, D), dtype, values),
        "v": _attention_spec(draw, (B, H, n, D), dtype, values),
        "lengths": TSpec((5,), torch.int64, "contig", "counts:" + ",".join(map(str, counts))),
        "sink_keys": _attention_spec(draw, (B, H, W, D), dtype, values),
        "sink_values": _attention_spec(draw, (B, H, W, D), dtype, values),
    }
    for side in ("key", "value"):
        args |= {f"{side}_{t}": sides[side][t] for t in ("codes", "scales", "zeros")}
    args |= {"key_tail": sides["key"]["tail"], "value_tail": sides["value"]["tail"]}
    for side in ("key", "value"):
        args |= {f"{side}_{t}": sides[side][t] for t in ("bits", "mode", "layout", "eta")}
    args |= {"group_size": group, "w_recent": w_recent, "key_x_scale": x_scale}
    case = Case("static_append", args, draw(st.integers(0, 2**32 - 1)))
    bad = {"key_bits": BAD_BITS, "value_bits": BAD_BITS, "key_mode": BAD_MODES, "value_mode": BAD_MODES}
    bad |= {"key_layout": LAYOUT_MUTATIONS, "value_layout": LAYOUT_MUTATIONS, "group_size": ATTN_BAD_GROUPS}
    bad |= {"key_eta": BAD_ETAS, "value_eta": BAD_ETAS, "w_recent": (-1, -8, -(2**63))}
    return _finish(draw, case, bad, optional=("key_zeros", "value_zeros", "key_x_scale"))


CASES = {
    "pack_bits": pack_bits_cases,
    "unpack_bits": unpack_bits_cases,
    "quantize_groups": quantize_groups_cases,
    "quantize_groups_into": quantize_groups_into_cases,
    "dequantize_groups": dequantize_groups_cases,
    "gemv_inner_q": gemv_inner_q_cases,
    "gemv_kivi": gemv_kivi_cases,
    "gemv_inner_q_into": gemv_inner_q_into_cases,
    "gemv_kivi_into": gemv_kivi_into_cases,
    "gemv_workspace_numel": gemv_workspace_numel_cases,
    "fwht": fwht_cases,
    "lattice_quantize": lattice_quantize_cases,
    "lattice_dequantize": lattice_dequantize_cases,
    "gemv_lattice_k": gemv_lattice_k_cases,
    "gemv_lattice_v": gemv_lattice_v_cases,
    "aqua_reconstruct": aqua_reconstruct_cases,
    "decode_attention_fused": decode_attention_fused_cases,
    "static_append": static_append_cases,
}


# ---- oracles -----------------------------------------------------------------------------------------------------

EPS32 = 2.0**-23


def _same_bits_or_nan(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # fp16 tensors: identical bit patterns, or both NaN (the payload and sign of a NaN are not part of the contract)
    return (a.view(torch.int16) == b.view(torch.int16)) | (a.isnan() & b.isnan())


def _hybrid_tie(x, bits, group):
    # per group: whether sym and asym have equal squared error to fp32 rounding (the C++ sums in another order)
    xg = x.float().unflatten(-1, (-1, group))
    err_s = reference.quant._sym(xg, bits)[3]
    err_a = reference.quant._asym(xg, bits)[4]
    gap = (err_s - err_a).abs() / (err_s.abs() + err_a.abs() + 1e-30)
    return (gap < 1e-5) | ~torch.isfinite(gap)


def check_quantized(x, bits, group, mode, eta, got):
    codes, scales, zeros = got
    want_c, want_s, want_z = reference.quantize_groups(x, bits, group, mode, eta)
    agree = _same_bits_or_nan(scales, want_s) & _same_bits_or_nan(zeros, want_z)  # per group
    if mode == "hybrid":  # a group may flip between sym and asym only where their errors tie
        assert bool((agree | _hybrid_tie(x, bits, group)).all()), "hybrid picked another mode off a tie"
    else:
        assert bool(agree.all()), f"scales/zeros differ from the reference in {int((~agree).sum())} groups"
    u, want_u = reference.unpack_bits(codes, bits), reference.unpack_bits(want_c, bits)
    same = (u == want_u).unflatten(-1, (-1, group)).all(-1)
    assert bool((same | ~agree).all()), f"codes differ from the reference in {int((~same & agree).sum())} groups"


def _assert_within(got, want64, mag64, rel: float, what: str, gate64=None, slack64=0.0):
    """|got - want64| <= rel * mag64 + slack64 (+ fp32 underflow) where gate64 (default mag64), a bound on every
    partial sum, is finite and fp32-representable: there the fp32 evaluation can neither overflow nor meet an Inf or a
    NaN."""
    assert got.dtype == torch.float32, f"{what}: dtype {got.dtype}"
    gate64 = mag64 if gate64 is None else gate64
    checked = torch.isfinite(gate64) & (gate64 < 1e37)
    err = (got.double() - want64).abs()
    bad = checked & ~(err <= rel * mag64 + slack64 + 1e-40)  # NaN err (got NaN) is bad too
    if bad.any():
        i = tuple(int(j) for j in bad.nonzero()[0])
        raise AssertionError(f"{what}: {int(bad.sum())} elements off, e.g. at {i}: {got[i]} vs {want64[i]}")


def check_dequantized(codes, scales, zeros, bits, group, mode, got):
    want = reference.dequantize_groups(codes, scales, zeros, bits, group, mode)
    assert got.shape == want.shape, (got.shape, want.shape)
    nonfinite = ~torch.isfinite(want)
    assert torch.equal(got[nonfinite].isnan(), want[nonfinite].isnan()), "NaN where the reference has none"
    s, zeff = reference.group_affine(scales, zeros, bits, mode)
    mag = (s.abs() * (2**bits - 1) + zeff.abs()).double().repeat_interleave(group, dim=-1)
    _assert_within(got, want.double(), mag, 4 * EPS32, "dequantize_groups")


def _weights(codes, scales, zeros, bits, group, mode, factorized):
    """(w, magnitude, gate), float64 [..., rows, L]: w the dequantized weights; the magnitude its rounding follows,
    |w| where w is formed first (the reference: dequantize, then matmul), |s| u + |zeff| where s and zeff are
    folded out of the dot products (Triton: s * dot(x, u) + zeff * sum(x)); the gate also bounds those unscaled
    intermediates, which overflow fp32 first when |x| nears 2^128 / 2^b and s is small (Triton only)."""
    w = reference.dequantize_groups(codes, scales, zeros, bits, group, mode).double()
    if not factorized:
        return w, w.abs(), w.abs()
    u = reference.unpack_bits(codes, bits).double()
    s, zeff = (
        t.double().abs().repeat_interleave(group, dim=-1) for t in reference.group_affine(scales, zeros, bits, mode)
    )
    return w, s * u + zeff, s * u + zeff + u + 1  # the last also bounds dot(x, u) and sum(x), formed unscaled


def _gemv_oracle(x, w, w_mag, w_gate, x_scale, H_kv, reduce_first):
    """float64 sum of the exact products of the fp32 operands the kernel sees: (y, error scale, partial-sum bound)."""
    x4 = x if x.dim() == 4 else x.unsqueeze(2)
    B, H_q, T, L = x4.shape
    xf = x4.float().reshape(B, H_kv, H_q // H_kv, T, L)
    if x_scale is not None:
        xf = xf * x_scale.float()[None, :, None, None, :]  # fp32 products, as the reference forms them
    xf = xf.double()
    eq = "bkgtl,bkml->bkgtm" if reduce_first else "bkgtr,bkrc->bkgtc"
    n_out = w.shape[2] if reduce_first else w.shape[3]  # explicit: the result may be empty
    y = torch.einsum(eq, xf, w).reshape(B, H_q, T, n_out)
    mag, gate = (torch.einsum(eq, xf.abs(), t).reshape(y.shape) for t in (w_mag, w_gate))
    return (y, mag, gate) if x.dim() == 4 else (y.squeeze(2), mag.squeeze(2), gate.squeeze(2))


def _fp16_weights(codes, scales, zeros, bits, group, mode):
    """float64 [..., rows, L]: the weights as a kernel that rounds each dequantized value once to fp16 holds them
    (docs/FORMATS.md, "GEMV arithmetic": the Triton gemv_kivi, and gemv_inner_q at 1 bit asym / hybrid):
    fp16(s u + zeff), where float64 forms s u + zeff exactly, so this is the single rounding of fma.rn.f16x2 (and
    of the 1-bit select's fp16(s * 0 + zeff) / fp16(s + zeff)), overflow to inf included."""
    u = reference.unpack_bits(codes, bits).double()
    s, zeff = (t.double().repeat_interleave(group, dim=-1) for t in reference.group_affine(scales, zeros, bits, mode))
    return (s * u + zeff).half().double()


def _fp16_weight_check(x, w16, x_scale, H_kv, reduce_first):
    """(want, magnitude, slack) of such a kernel: the float64 sum over its fp16 weights w16, the fp32 accumulation's
    magnitude sum |x'| |w16|, and the activations' split into fp16 hi + lo, each column scaled by a power of two
    from its chunk's largest |x'|: an element's error is at most 2^-23 of that maximum (a rounding tie), so the
    slack is 2^-23 max |x'| sum |w16| (the row's maximum bounds every chunk's). Outputs that meet an infinite weight
    have an infinite magnitude and go unchecked: there the kernel gives NaN (inf times a lo part of 0), the
    reference inf. Under TRITON_INTERPRET=1 bf16 subnormal activations get 2^-125 |x_scale| |w16| each more: the
    interpreter decodes them wrongly (triton 3.9: 4.3e-39 -> 5.5e-39, 1e-40 -> 0; a compiled kernel does not)."""
    want, mag, _ = _gemv_oracle(x, w16, w16.abs(), w16.abs(), x_scale, H_kv, reduce_first)
    x4 = x if x.dim() == 4 else x.unsqueeze(2)
    xf = x4.float()
    if x_scale is not None:
        xf = xf * x_scale.float().repeat_interleave(x4.shape[1] // H_kv, 0)[None, :, None, :]
    x_max = torch.zeros(*xf.shape[:-1], 1, dtype=torch.float64)  # an empty reduction
    if xf.shape[-1]:
        x_max = xf.double().abs().amax(-1, keepdim=True)
    w_sum = w16.abs().sum(-1 if reduce_first else -2)  # [B, H_kv, rows or columns]
    split = 2.0**-23 * x_max * w_sum.repeat_interleave(x4.shape[1] // H_kv, 1).unsqueeze(2)  # [B, H_q, T, n]
    if x.dim() == 3:
        split = split.squeeze(2)
    slack = split
    if os.environ.get("TRITON_INTERPRET") == "1" and x.dtype == torch.bfloat16:
        sub = (x != 0) & (x.float().abs() < 2.0**-126)
        xs = torch.ones(H_kv, x.shape[-1]) if x_scale is None else x_scale.float().abs()
        _, bad, _ = _gemv_oracle(sub.float() * 2.0**-125, w16, w16.abs(), w16.abs(), xs, H_kv, reduce_first)
        slack = slack + bad
    return want, mag, slack


def check_gemv_inner_q(x, codes, scales, zeros, bits, group, mode, x_scale, got, factorized=False):
    if factorized and bits == 1 and mode != "sym":  # the Triton kernel's 1-bit asym / hybrid path: fp16 weights
        w16 = _fp16_weights(codes, scales, zeros, bits, group, mode)
        y, mag, slack = _fp16_weight_check(x, w16, x_scale, codes.shape[1], True)
        assert got.shape == y.shape, (got.shape, y.shape)
        _assert_within(got, y, mag, (x.shape[-1] + 2) * EPS32, "gemv_inner_q", None, slack)
        return
    w, w_mag, w_gate = _weights(codes, scales, zeros, bits, group, mode, factorized)  # [B, H_kv, M, L]
    y, mag, gate = _gemv_oracle(x, w, w_mag, w_gate, x_scale, codes.shape[1], True)
    assert got.shape == y.shape, (got.shape, y.shape)
    _assert_within(got, y, mag, (x.shape[-1] + 2) * EPS32, "gemv_inner_q", gate)


def check_gemv_kivi(x, codes, scales, zeros, bits, group, got, factorized=False):
    if factorized:  # the Triton kernel: fp16 weights (the CPU kernel, like the reference, keeps them in fp32)
        w16 = _fp16_weights(codes, scales, zeros, bits, group, "asym")
        y, mag, slack = _fp16_weight_check(x, w16, None, codes.shape[1], False)
        assert got.shape == y.shape, (got.shape, y.shape)
        _assert_within(got, y, mag, (x.shape[-1] + 2) * EPS32, "gemv_kivi", None, slack)
        return
    w, w_mag, w_gate = _weights(codes, scales, zeros, bits, group, "asym", False)  # [B, H_kv, R, C]
    y, mag, gate = _gemv_oracle(x, w, w_mag, w_gate, None, codes.shape[1], False)
    assert got.shape == y.shape, (got.shape, y.shape)
    _assert_within(got, y, mag, (x.shape[-1] + 2) * EPS32, "gemv_kivi", gate)


@functools.cache
def _hadamard64(G: int) -> torch.Tensor:
    """The orthonormal Sylvester-Hadamard matrix H_n = H / sqrt(G), float64 [G, G] (built, not butterflied)."""
    H = torch.ones(1, 1, dtype=torch.float64)
    while H.shape[0] < G:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    return H / math.sqrt(G)


def _groups64(t, G):
    # [..., C] -> float64 [..., C / G, G]
    return t.double().reshape(*t.shape[:-1], t.shape[-1] // G, G)


def _signs64(signs, G):
    return torch.ones(G, dtype=torch.float64) if signs is None else signs.double()


def check_fwht(x, G, signs, inverse, got):
    """float64 H_n (s * x) (or s * H_n x) with the butterflies' fp32 bound: log2(G) adds per output, each rounding
    at most 2^-24 of the group's magnitude sum, plus the final 1/sqrt(G) multiply."""
    s, H = _signs64(signs, G), _hadamard64(G)
    xg = _groups64(x, G)  # [..., groups, G]
    if inverse:
        want = (xg @ H) * s
        gate = xg.abs().sum(-1, keepdim=True).expand(xg.shape)  # bounds the butterflies' (unscaled) partial sums
        mag = gate / math.sqrt(G) * s.abs()
    else:
        want = (xg * s) @ H
        gate = (xg * s).abs().sum(-1, keepdim=True).expand(xg.shape)
        mag = gate / math.sqrt(G)
    assert got.shape == x.shape, (got.shape, x.shape)
    _assert_within(got, want.reshape(x.shape), mag.reshape(x.shape), (math.log2(G) + 3) * EPS32, "fwht",
                   gate.reshape(x.shape))  # fmt: skip


def _fp16_bounds(r64, rel):
    """The fp16 values a backend may store for a norm computed in fp32 with relative error `rel` of r64."""
    return (r64 * (1 - rel)).to(torch.float16).double(), (r64 * (1 + rel)).to(torch.float16).double()


def check_lattice_quantized(x, grid, G, signs, got):
    """Norms: fp16 of ||x_g|| / sqrt(G) up to the fp32 sum of squares. Codes: each index's grid point is the
    nearest to u = H_n (s x) / r within the fp32 evaluation's error (FORMATS.md near-ties), index 0 where x is not
    finite; groups whose fp32 norm underflows or overflows (|x| < 1e-18 or > 1e18) are not checked."""
    codes, norms = got
    n, d = grid.shape
    index_bits = int(math.log2(n))
    bits = index_bits // d
    lead, C = x.shape[:-1], x.shape[-1]
    assert codes.shape == (*lead, C // 32 * bits) and norms.shape == (*lead, C // G)
    xg = _groups64(x, G)  # [..., groups, G]
    r64 = xg.square().sum(-1).sqrt() / math.sqrt(G)
    lo, hi = _fp16_bounds(r64, (G + 4) * EPS32)
    got_r = norms.double()
    ok = ((got_r >= lo) & (got_r <= hi)) | (got_r.isnan() & r64.isnan())
    assert bool(ok.all()), f"lattice_quantize: {int((~ok).sum())} norms off, e.g. {got_r[~ok][:3]} vs {r64[~ok][:3]}"

    s, H, g = _signs64(signs, G), _hadamard64(G), grid.double()
    sx = xg * s
    y = sx @ H
    u = torch.where(r64.unsqueeze(-1) == 0, torch.zeros_like(y), y / torch.where(r64 == 0, 1.0, r64).unsqueeze(-1))
    spread = sx.abs().sum(-1) / math.sqrt(G) / torch.where(r64 > 0, r64, 1.0)  # bounds |u| and its fp32 error scale
    u = u.reshape(-1, d)  # [M, d]
    per_vector = lambda t: t.unsqueeze(-1).expand(*t.shape, G // d).reshape(-1)  # noqa: E731 - group -> d-vectors
    finite = per_vector(torch.isfinite(xg).all(-1))
    checked = finite & per_vector((r64 == 0) | ((r64 > 1e-18) & (r64 < 1e18)))
    idx = reference.unpack_lattice_indices(codes, index_bits).reshape(-1)
    assert bool((idx[~finite] == 0).all()), "lattice_quantize: a non-finite group's index is not 0"
    err = 8 * (math.log2(G) + 8) * EPS32
    g_abs_sum, g_sq = g.abs().sum(-1).max(), (g * g).sum(-1)
    for start in range(0, u.shape[0], 8192):
        uu, ii = u[start : start + 8192], idx[start : start + 8192]
        scores = 2 * uu @ g.T - g_sq  # [m, n] float64
        tol = err * (per_vector(spread).reshape(-1)[start : start + 8192] + uu.abs().amax(-1)) * g_abs_sum
        tol = tol + 16 * EPS32 * (2 * (uu.abs() @ g.abs().T).amax(-1) + g_sq.max())
        mine = scores.gather(1, ii.unsqueeze(1)).squeeze(1)
        bad = checked[start : start + 8192] & ~(mine >= scores.amax(-1) - tol)
        if bad.any():
            j = int(bad.nonzero()[0])
            best = f"{int(scores[j].argmax())} ({float(scores[j].max())})"
            raise AssertionError(
                f"lattice_quantize: index {int(ii[j])} (score {float(mine[j])}) for u={uu[j].tolist()}, best {best}"
            )


def _lattice_points64(codes, norms, grid, G):
    """(r16 * grid[c], |r16 * grid[c]|) float64 [..., C / G, G]: the rotated, scaled values the codes name."""
    n, d = grid.shape
    idx = reference.unpack_lattice_indices(codes, int(math.log2(n)))  # [..., C / d]
    pts = grid.double()[idx].reshape(*codes.shape[:-1], idx.shape[-1] * d)
    v = _groups64(pts, G) * norms.double().unsqueeze(-1)
    return v, v.abs()


def check_lattice_dequantized(codes, norms, grid, G, signs, got):
    v, v_abs = _lattice_points64(codes, norms, grid, G)  # [..., groups, G]
    s = _signs64(signs, G)
    want = (v @ _hadamard64(G)) * s
    gate = v_abs.sum(-1, keepdim=True).expand(want.shape)  # bounds the butterflies' partial sums (before s)
    mag = gate / math.sqrt(G) * s.abs()
    shape = (*codes.shape[:-1], v.shape[-2] * G)
    assert got.shape == shape, (got.shape, shape)
    _assert_within(got, want.reshape(shape), mag.reshape(shape), (math.log2(G) + 4) * EPS32, "lattice_dequantize",
                   gate.reshape(shape))  # fmt: skip


def check_gemv_lattice_k(q, codes, norms, grid, G, signs, got):
    """float64 q . x_hat. The fp32 path rotates q (each q' within log2(G) roundings of Q = sum|q_g| / sqrt(G)),
    sums G products per group, scales by r16 and sums the groups: bounded by (log2 G + G + groups + 4) roundings
    of sum_g Q_g * sum_i |r16 grid|."""
    q4 = q if q.dim() == 4 else q.unsqueeze(2)
    B, H_q, T, D = q4.shape
    H_kv, N = codes.shape[1], codes.shape[2]
    v, v_abs = _lattice_points64(codes, norms, grid, G)  # [B, H_kv, N, groups, G]
    x_hat = ((v @ _hadamard64(G)) * _signs64(signs, G)).reshape(B, H_kv, N, D)
    qg = q4.float().double().reshape(B, H_kv, H_q // H_kv, T, D)
    want = torch.einsum("bkqtd,bknd->bkqtn", qg, x_hat).reshape(B, H_q, T, N)
    q_mag = (qg.abs() * _signs64(signs, G).abs().repeat(D // G)).reshape(B, H_kv, H_q // H_kv, T, D // G, G)
    q_mag = q_mag.sum(-1) / math.sqrt(G)  # [B, H_kv, gq, T, groups]: bounds every |q'| of the group
    mag = torch.einsum("bkqtg,bkng->bkqtn", q_mag, v_abs.sum(-1)).reshape(B, H_q, T, N)
    gate = mag + q_mag.sum(-1).reshape(B, H_q, T, 1) * math.sqrt(G)  # the unscaled butterflies
    if q.dim() == 3:
        want, mag, gate = want.squeeze(2), mag.squeeze(2), gate.squeeze(2)
    assert got.shape == want.shape, (got.shape, want.shape)
    _assert_within(got, want, mag, (math.log2(G) + G + D // G + 4) * EPS32, "gemv_lattice_k", gate)


def check_gemv_lattice_v(p, codes, norms, grid, G, signs, got):
    """float64 sum_n p[n] x_hat_n. The fp32 path sums N products per rotated coordinate, then one inverse transform
    (log2(G) roundings of the group's magnitude sum): bounded by (N + log2 G + 4) roundings of
    |s| * sum_n |p_n| sum_i |r16 grid| / sqrt(G)."""
    p4 = p if p.dim() == 4 else p.unsqueeze(2)
    B, H_q, T, N = p4.shape
    H_kv = codes.shape[1]
    v, v_abs = _lattice_points64(codes, norms, grid, G)  # [B, H_kv, N, groups, G]
    groups = v.shape[-2]
    s = _signs64(signs, G)
    x_hat = ((v @ _hadamard64(G)) * s).reshape(B, H_kv, N, groups * G)
    pg = p4.float().double().reshape(B, H_kv, H_q // H_kv, T, N)
    want = (pg @ x_hat.unsqueeze(2)).reshape(B, H_q, T, groups * G)
    group_mag = torch.einsum("bkqtn,bkng->bkqtg", pg.abs(), v_abs.sum(-1)) / math.sqrt(G)  # [.., T, groups]
    mag = (group_mag.unsqueeze(-1) * s.abs()).reshape(B, H_q, T, groups * G)
    gate = (group_mag.unsqueeze(-1) * math.sqrt(G)).expand(*group_mag.shape, G).reshape(mag.shape)  # before s
    if p.dim() == 3:
        want, mag, gate = want.squeeze(2), mag.squeeze(2), gate.squeeze(2)
    assert got.shape == want.shape, (got.shape, want.shape)
    _assert_within(got, want, mag, (N + math.log2(G) + 4) * EPS32, "gemv_lattice_v", gate)


def check_aqua_reconstruct(prev, weight, bias, codes, norms, grid, G, signs, prev2, weight2, got):
    """float64 ((prev @ W^T + prev2 @ W2^T) + bias) + deq. The fp32 path sums C_in (+ C_in2) products per output
    and adds the bias and the dequantized residual (log2(G) butterfly roundings of its group's magnitude sum):
    bounded by (C_in + C_in2 + log2 G + 8) roundings of sum |prev W| + |bias| + sum |r16 grid| / sqrt(G)."""
    x, w = prev.double(), weight.double()
    if prev2 is not None:
        x, w = torch.cat([x, prev2.double()], 1), torch.cat([w, weight2.double()], 1)
    T, C = prev.shape[0], weight.shape[0]
    v, v_abs = _lattice_points64(codes, norms, grid, G)  # [T, groups, G]
    deq = ((v @ _hadamard64(G)) * _signs64(signs, G)).reshape(T, C)
    deq_gate = v_abs.sum(-1, keepdim=True).expand(v.shape).reshape(T, C)  # every butterfly partial sum
    want = x @ w.T + bias.double() + deq
    gemm_mag = x.abs() @ w.abs().T + bias.double().abs()
    mag = gemm_mag + deq_gate / math.sqrt(G) * _signs64(signs, G).abs().repeat(C // G)
    assert got.shape == (T, C), (got.shape, (T, C))
    _assert_within(got, want, mag, (x.shape[1] + math.log2(G) + 8) * EPS32, "aqua_reconstruct", mag + deq_gate)


def _attention_part64(codes, scales, zeros, bits, G, mode, layout, factorized):
    """A store's tokens as _weights sees them, token-major float64 [B, H_kv, m, D]: (w, magnitude, gate)."""
    parts = _weights(codes, scales, zeros, bits, G, mode, factorized)
    return parts if layout == "rows" else tuple(t.transpose(-1, -2) for t in parts)


def _attention_cache64(sink, store, tail):
    # sink | store | tail along the tokens: (values, magnitude, gate), float64 [B, H_kv, N, D]
    window = lambda t: (t.double(), t.double().abs(), t.double().abs())  # noqa: E731 - exact in fp32
    return tuple(torch.cat(ts, 2) for ts in zip(window(sink), store, window(tail), strict=True))


def check_decode_attention_fused(
    x, sink_keys, sink_values, key_codes, key_scales, key_zeros, value_codes, value_scales, value_zeros, key_tail,
    value_tail, key_bits, key_mode, key_layout, value_bits, value_mode, value_layout, G, key_x_scale, attn_mask,
    split_tokens, lengths, q_scale, out_dtype, got, factorized=False,
):  # fmt: skip
    """float64 softmax(x K^T + mask) V over the exact values of the fp32 operands, with the fp32 error propagated:
    each score is off by at most (D + 8) roundings of sum |x||k| (plus the mask add's); a logit perturbed by e_j
    moves p_j by the factor e^(e_j) / sum_k p_k e^(e_k), so |p32_j - p_j| <= (g_j + p_j d) / (1 - d) with
    g_j = p_j (e^(a_j) - 1), a_j bounding e_j and the shift / exp roundings (2|z_j - max| + 4 roundings: also an
    online softmax's chunk rescales) and d = sum_k g_k plus the normalization's N + 4 roundings; the output adds
    N + 8 roundings of sum_j p_j |v_j|. A mask entry that dwarfs its score (2^26 times its bound) is the fp32 logit
    exactly: rows of finfo.min (a fully masked bool row) average uniformly in both. Rows are checked where every
    fp32 key, value, score and logit is finite and far from overflow. The queries are x' = x.to(fp32) * q_scale, the
    fp32 values every backend computes first; an fp16 / bf16 out_dtype adds its one rounding (half an ulp of the
    value, the bound's own size in the bound, or half its smallest subnormal) and leaves rows unchecked that its range
    cannot hold."""
    assert got.dtype == (out_dtype or torch.float32), (got.dtype, out_dtype)
    x = x.to(torch.float32) * q_scale
    B, H_q, T, D = x.shape
    H_kv = sink_keys.shape[1]
    k_store = _attention_part64(key_codes, key_scales, key_zeros, key_bits, G, key_mode, key_layout, factorized)
    if key_x_scale is not None:  # stored keys are K / key_x_scale; the fp32 product rounds once more
        xs = key_x_scale.double()[None, :, None, :]
        k_store = (k_store[0] * xs, k_store[1] * xs.abs(), k_store[2] * xs.abs())
    v_store = _attention_part64(value_codes, value_scales, value_zeros, value_bits, G, value_mode, value_layout,
                                factorized)  # fmt: skip
    k, k_mag, k_gate = _attention_cache64(sink_keys, k_store, key_tail)
    v, v_mag, v_gate = _attention_cache64(sink_values, v_store, value_tail)
    N = k.shape[2]
    xg = x.double().reshape(B, H_kv, H_q // H_kv, T, D)
    score = lambda a, b: torch.einsum("bkgtd,bknd->bkgtn", a, b).reshape(B, H_q, T, N)  # noqa: E731
    s, s_mag, s_gate = score(xg, k), score(xg.abs(), k_mag), score(xg.abs(), k_gate)
    if attn_mask is None:
        future = torch.arange(N)[None, :] > torch.arange(N - T, N)[:, None]
        mask = torch.zeros(T, N, dtype=torch.float64).masked_fill(future, -math.inf).expand(B, H_q, T, N)
    else:
        mask = attn_mask.double().expand(B, H_q, T, N)
    err_s = (D + 8) * EPS32 * s_mag
    finite = torch.isfinite(mask)
    absorbed = finite & (mask.abs() * 2.0**-26 > s_mag + err_s)  # fl32(score + mask) == mask
    z = torch.where(absorbed, mask, s + mask)
    exact = absorbed | torch.isneginf(mask)
    delta = torch.where(exact, 0.0, err_s + EPS32 * (s_mag + err_s + mask.abs()))
    # checked rows: every fp32 key and value of the KV head finite (a masked token's too: 0 * inf is NaN), every
    # score's partial sums and every logit within fp32's range
    tokens_ok = ((k_gate < 1e37).all(-1) & (v_gate < 1e37).all(-1)).all(-1)  # [B, H_kv]
    logit_bound = torch.where(exact | ~finite, 0.0, s_gate + err_s + mask.abs())
    row_ok = (s_gate < 1e37).all(-1) & (logit_bound < 3e38).all(-1)  # [B, H_q, T]
    row_ok &= tokens_ok.repeat_interleave(H_q // H_kv, 1)[..., None]

    logp = torch.log_softmax(z, -1)
    p = logp.exp()
    a = delta + 2 * EPS32 * (z - z.amax(-1, keepdim=True)).abs() + 4 * EPS32
    a = torch.where(torch.isneginf(z), 0.0, a)  # p_j = 0 exactly in fp32 too
    grow = torch.exp(logp + a) - p  # p_j (e^(a_j) - 1), without inf * 0
    d = grow.sum(-1, keepdim=True) + (N + 4) * EPS32
    p_err = torch.where(d < 1, (grow + p * d) / (1 - d), math.inf)
    p_err = p_err + torch.where(torch.isneginf(z), 0.0, 2.0**-126)  # exp underflowing past fp32's smallest normal
    w_err = p_err + (N + 8) * EPS32 * (p + p_err)

    out = lambda w, t: (w.reshape(B, H_kv, H_q // H_kv, T, N) @ t.unsqueeze(2)).reshape(B, H_q, T, D)  # noqa: E731
    want, mag = out(p, v), out(w_err, v_mag)
    gate = torch.where(row_ok[..., None], mag + out(p + p_err, v_gate), math.inf)
    assert got.shape == want.shape, (got.shape, want.shape)
    if out_dtype in (torch.float16, torch.bfloat16):
        ulp = 2.0**-11 if out_dtype == torch.float16 else 2.0**-8
        tiny = 2.0**-25 if out_dtype == torch.float16 else 2.0**-134  # half the smallest subnormal: underflow
        mag = mag + ulp * (want.abs() + 2 * mag) + tiny
        top = torch.finfo(out_dtype).max / 2  # the rounded value must stay finite
        gate = torch.where(want.abs() + 2 * mag < top, gate, math.inf)
        got = got.float()
    _assert_within(got, want, mag, 2.0, "decode_attention_fused", gate)


def _check_nothing_outside(op, before, a):
    """The _into ops write their outputs' views only: the rest of each backing buffer is as it was."""
    for name, (buf, snapshot) in before.items():
        view = a[name]
        inside = torch.zeros(buf.shape, dtype=torch.bool)
        inside.as_strided(view.shape, view.stride(), view.storage_offset()).fill_(True)
        same = (_bits(buf) == snapshot) | inside  # bit patterns: a NaN left alone is unchanged
        assert bool(same.all()), f"{op} wrote outside {name}"


def check_result(op, a, got, before, backend="cpu"):
    """The output of a successful call (a: the built arguments by name) against the reference."""
    if op == "pack_bits":
        want = reference.pack_bits(a["codes"], a["bits"])
        assert got.dtype == torch.int32 and torch.equal(got, want), "pack_bits differs from the reference"
    elif op == "unpack_bits":
        want = reference.unpack_bits(a["packed"], a["bits"])
        assert got.dtype == torch.uint8 and torch.equal(got, want), "unpack_bits differs from the reference"
    elif op == "quantize_groups":
        check_quantized(a["x"], a["bits"], a["group_size"], a["mode"], a["eta"], got)
    elif op == "quantize_groups_into":
        assert got is None
        outs = (a["codes"], a["scales"], a["zeros"])
        check_quantized(a["x"], a["bits"], a["group_size"], a["quant_mode"], a["eta"], outs)
        _check_nothing_outside(op, before, a)
    elif op == "dequantize_groups":
        check_dequantized(*(a[k] for k in ("codes", "scales", "zeros", "bits", "group_size", "mode")), got)
    elif op == "gemv_inner_q":
        names = ("x", "codes", "scales", "zeros", "bits", "group_size", "mode", "x_scale")
        check_gemv_inner_q(*(a[k] for k in names), got, factorized=backend == "triton")
    elif op == "gemv_kivi":
        check_gemv_kivi(
            *(a[k] for k in ("x", "codes", "scales", "zeros", "bits", "group_size")), got, backend == "triton"
        )
    elif op in ("gemv_inner_q_into", "gemv_kivi_into"):
        assert got is None
        names = _ARG_NAMES[op][: _ARG_NAMES[op].index("out")]
        if op == "gemv_inner_q_into":
            check_gemv_inner_q(*(a[k] for k in names), a["out"], factorized=backend == "triton")
        else:
            check_gemv_kivi(*(a[k] for k in names), a["out"], backend == "triton")
        _check_nothing_outside(op, before, a)
    elif op == "gemv_workspace_numel":
        assert got == 0, f"gemv_workspace_numel is {got} on the CPU (its kernels take no workspace)"
    elif op == "fwht":
        check_fwht(a["x"], a["group_size"], a["signs"], a["inverse"], got)
    elif op == "lattice_quantize":
        check_lattice_quantized(a["x"], a["grid"], a["group_size"], a["signs"], got)
    elif op == "lattice_dequantize":
        check_lattice_dequantized(*(a[k] for k in ("codes", "norms", "grid", "group_size", "signs")), got)
    elif op == "gemv_lattice_k":
        check_gemv_lattice_k(*(a[k] for k in ("q", "codes", "norms", "grid", "group_size", "signs")), got)
    elif op == "gemv_lattice_v":
        check_gemv_lattice_v(*(a[k] for k in ("p", "codes", "norms", "grid", "group_size", "signs")), got)
    elif op == "aqua_reconstruct":
        check_aqua_reconstruct(*(a[k] for k in _ARG_NAMES[op]), got)
    elif op == "decode_attention_fused":
        check_decode_attention_fused(*(a[k] for k in _ARG_NAMES[op]), got, factorized=backend == "triton")
    elif op == "static_append":
        assert got is None
        check_static_append(a, before)
        _check_nothing_outside(op, before, a)
    else:
        raise AssertionError(f"no oracle for {op}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t's raw bit patterns (NaNs compare by payload, as copies keep them)."""
    if not (t.is_floating_point() or t.is_complex()):
        return t
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.int64}[t.element_size()])


def _was(before, a, name):
    """Argument `name` as it was before the call (from the snapshot of its backing buffer)."""
    buf, snap = before[name]
    view = a[name]
    return snap.view(buf.dtype).as_strided(view.shape, view.stride(), view.storage_offset())


def check_static_append(a, before):
    """The spec of kvkernels/reference/static_append.py, written out: counts, sink, tails (their kept tokens), and
    each store's new tokens against reference.quantize_groups of the tokens that left (keys divided by key_x_scale);
    the stores' earlier tokens and everything past count + E unchanged, the sink's other slots unchanged."""
    L0 = [int(c) for c in _was(before, a, "lengths")]
    n, W, G, wr = a["k"].shape[2], a["sink_keys"].shape[2], a["group_size"], a["w_recent"]
    take = min(max(W - L0[0], 0), n)
    rest = n - take
    want_len = [L0[0] + take]
    for i, (side, new) in enumerate((("key", a["k"]), ("value", a["v"]))):
        sink = a[f"sink_{side}s"]
        sink0 = _was(before, a, f"sink_{side}s")
        S = L0[0]
        assert torch.equal(_bits(sink[:, :, S : S + take]), _bits(new[:, :, :take])), f"{side} sink slots"
        assert torch.equal(_bits(sink[:, :, :S]), _bits(sink0[:, :, :S])), f"{side} sink overwritten"
        assert torch.equal(_bits(sink[:, :, S + take :]), _bits(sink0[:, :, S + take :])), f"{side} sink overwritten"
        layout, bits, mode, eta = (a[f"{side}_{t}"] for t in ("layout", "bits", "mode", "eta"))
        stored, tail_n = L0[1 + 2 * i], L0[2 + 2 * i]
        step = 1 if layout == "rows" else G
        n_out = max(tail_n + rest - wr, 0) // step * step
        tail0 = _was(before, a, f"{side}_tail")
        full = torch.cat([tail0[:, :, :tail_n], new[:, :, take:]], dim=2)  # the tail after the new tokens joined
        keep = tail_n + rest - n_out
        assert torch.equal(_bits(a[f"{side}_tail"][:, :, :keep]), _bits(full[:, :, n_out:])), f"{side} tail"
        want_len += [stored + n_out, keep]
        left = full[:, :, :n_out].float()
        if side == "key" and a["key_x_scale"] is not None:
            left = left / a["key_x_scale"][None, :, None, :]
        E = max(a[f"{side}_tail"].shape[2] - wr, 0) // step * step
        for t in ("codes", "scales", "zeros"):
            name = f"{side}_{t}"
            if a[name] is None:
                continue
            got, was = a[name], _was(before, a, name)
            if layout == "rows":
                lo, hi = stored, stored + E
            elif t == "codes":  # "cols": bits / 32 words, or one group's scale per G tokens
                lo, hi = stored * bits // 32, (stored + E) * bits // 32
            else:
                lo, hi = stored // G, (stored + E) // G
            dim = 2 if layout == "rows" else 3
            assert torch.equal(_bits(got.narrow(dim, 0, lo)), _bits(was.narrow(dim, 0, lo))), f"{name}: earlier tokens"
            past = got.shape[dim] - hi
            assert torch.equal(_bits(got.narrow(dim, hi, past)), _bits(was.narrow(dim, hi, past))), f"{name}: past E"
        if n_out:
            x = left if layout == "rows" else left.transpose(2, 3)
            lo = stored if layout == "rows" else stored * bits // 32
            if layout == "rows":
                sl = [a[f"{side}_{t}"][:, :, stored : stored + n_out] if a[f"{side}_{t}"] is not None else None
                      for t in ("codes", "scales", "zeros")]  # fmt: skip
            else:
                sl = [a[f"{side}_codes"][..., lo : lo + n_out * bits // 32]]
                sl += [a[f"{side}_{t}"][..., stored // G : (stored + n_out) // G] if a[f"{side}_{t}"] is not None
                       else None for t in ("scales", "zeros")]  # fmt: skip
            if sl[2] is None:  # sym without a zeros buffer: the quantizer's zeros are 0
                sl[2] = torch.zeros_like(sl[1])
            check_quantized(x, bits, G, mode, eta, tuple(sl))
    assert [int(c) for c in a["lengths"]] == want_len, f"lengths {a['lengths'].tolist()}, want {want_len}"


def _assert_clear(op, e, where):
    assert isinstance(e, ALLOWED_ERRORS), f"{where}: {type(e).__name__} is not a check's error: {e}"
    assert op in str(e), f"{where}: the message does not name kvkernels.{op}: {e}"


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype.is_floating_point or a.dtype.is_complex:
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


def _meta_of(x):
    return [(t.shape, t.dtype) for t in x] if isinstance(x, tuple | list) else (x if x is None else (x.shape, x.dtype))


def _kernel(op: str, backend: str):
    """What a CPU call runs: the dispatcher (C++ or reference), or the Triton kernel as ops.py registers it for CUDA."""
    if backend == "triton":
        import kvkernels.triton_kernels as tk

        from kvkernels.ops import _checked

        return _checked(op, getattr(tk, op))
    return getattr(torch.ops.kvkernels, op).default


# the tensors each _into op writes (its other tensor arguments are read only)
_OUTPUTS = {
    "quantize_groups_into": ("codes", "scales", "zeros"),
    "gemv_inner_q_into": ("out",),
    "gemv_kivi_into": ("out",),
    "static_append": (
        "lengths",
        "sink_keys",
        "sink_values",
        "key_codes",
        "key_scales",
        "key_zeros",
        "value_codes",
        "value_scales",
        "value_zeros",
        "key_tail",
        "value_tail",
    ),
}


def run_case(case: Case, backend: str = "cpu") -> tuple[str, str]:
    """Runs one case on CPU and on meta: (outcome, message), outcome 'ok' or the exception type; or AssertionError."""
    op = case.op
    gen = torch.Generator().manual_seed(case.seed)
    a, bufs = {}, {}
    for name, spec in case.args.items():
        if isinstance(spec, TSpec):
            a[name], bufs[name] = build(spec, gen)
        else:
            a[name] = spec
    if backend == "triton" and any(m.startswith("pytype:") for m in case.mutations):
        return "skipped (Python types: the dispatcher parses them before any kernel)", ""
    devices = {t.device.type for t in a.values() if isinstance(t, torch.Tensor)}
    fake = getattr(torch.ops.kvkernels, op).default  # the dispatcher: the fake for meta tensors
    fn = _kernel(op, backend) if devices == {"cpu"} else fake  # a meta tensor or none: no CPU kernel runs
    before = {}
    if op in _OUTPUTS:
        for name in _OUTPUTS[op]:
            if bufs.get(name) is not None:
                buf = bufs[name]
                before[name] = (buf, _bits(buf).clone())
    inputs = {k: (v.clone() if isinstance(v, torch.Tensor) and v.device.type == "cpu" else v) for k, v in a.items()}

    cpu_err = got = None
    try:
        got = fn(*a.values())
    except Exception as e:  # noqa: BLE001 - the point is to see every exception
        cpu_err = e
        _assert_clear(op, e, "cpu")
    if len(devices) > 1:  # CPU and meta tensors
        assert cpu_err is not None, "a call with CPU and meta tensors did not raise"

    meta_err = meta_got = None
    try:
        meta_got = fake(*(as_meta(v) for v in a.values()))
    except Exception as e:  # noqa: BLE001
        meta_err = e
        _assert_clear(op, e, "meta")
    if len(devices) <= 1 and not (op == "gemv_workspace_numel" and cpu_err is None):
        assert type(cpu_err) is type(meta_err), f"cpu raised {cpu_err!r} but meta raised {meta_err!r}"
    if cpu_err is not None:
        return type(cpu_err).__name__, str(cpu_err).splitlines()[0][:160]
    if "meta" in devices:
        return "ok (all on meta)", ""  # a device mutation moved the only tensors: the call above was the fake

    for k, v in inputs.items():  # inputs are read only (the outputs of the _into ops aside)
        if isinstance(v, torch.Tensor) and k not in _OUTPUTS.get(op, ()) + ("workspace",):
            assert _same(v, a[k]), f"{op} modified its input {k}"
    if op == "gemv_workspace_numel":  # no fake can plan a CUDA launch: it refuses to trace, after the same checks
        assert isinstance(meta_err, NotImplementedError), f"the fake of gemv_workspace_numel returned {meta_got!r}"
    else:
        assert _meta_of(got) == _meta_of(meta_got), f"cpu returned {_meta_of(got)}, the fake {_meta_of(meta_got)}"
    check_result(op, a, got, before, backend)
    if op == "gemv_workspace_numel":
        return "ok", ""
    outputs = tuple(a[k] for k in _OUTPUTS[op]) if got is None else got if isinstance(got, tuple) else (got,)
    return ("ok" if any(t.numel() for t in outputs) else "ok (empty)"), ""


# ---- the worker (one op per process) and the pytest side -----------------------------------------------------------


def schema_ops() -> list[str]:
    """Every op csrc/ops.cpp defines."""
    return re.findall(r'm\.def\(\s*"(\w+)\(', (ROOT / "csrc" / "ops.cpp").read_text())


def worker(op: str, examples: int, trace: str | None, seed: int | None = None, backend: str = "cpu") -> int:
    faulthandler.enable()
    torch.set_num_threads(1)
    stats, messages = Counter(), defaultdict(list)  # outcome -> count, a few of its messages

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=seed is None,
        database=None,
        suppress_health_check=list(HealthCheck),
        phases=(Phase.generate, Phase.shrink),
        print_blob=False,
    )
    @given(CASES[op]())
    def fuzz(case):
        if trace:  # the case in flight, for the parent to show if this process dies
            Path(trace).write_text(repr(case))
        stats["examples"] += 1
        outcome, message = run_case(case, backend)
        stats[outcome] += 1
        if message and len(messages[outcome]) < 3 and message not in messages[outcome]:
            messages[outcome].append(message)

    start = time.perf_counter()
    (fuzz if seed is None else hypothesis.seed(seed)(fuzz))()
    report = {"op": op, "backend": backend, "examples": stats.pop("examples")}
    report["seconds"] = round(time.perf_counter() - start, 1)
    print("FUZZ-REPORT " + json.dumps(report | {"outcomes": dict(stats)}), flush=True)
    for outcome, texts in sorted(messages.items()):
        print(f"  {outcome}: " + " | ".join(texts))
    return 0


requires_c = pytest.mark.skipif(kvkernels.backends()["cpp"] != "available", reason="kvkernels._C not built")


_ARG_NAMES = {
    "pack_bits": ("codes", "bits"),
    "unpack_bits": ("packed", "bits"),
    "quantize_groups": ("x", "bits", "group_size", "mode", "eta"),
    "quantize_groups_into": ("x", "bits", "group_size", "quant_mode", "eta", "codes", "scales", "zeros"),
    "dequantize_groups": ("codes", "scales", "zeros", "bits", "group_size", "mode"),
    "gemv_inner_q": ("x", "codes", "scales", "zeros", "bits", "group_size", "mode", "x_scale"),
    "gemv_kivi": ("x", "codes", "scales", "zeros", "bits", "group_size"),
    "gemv_inner_q_into": (
        "x",
        "codes",
        "scales",
        "zeros",
        "bits",
        "group_size",
        "quant_mode",
        "x_scale",
        "out",
        "workspace",
    ),
    "gemv_kivi_into": ("x", "codes", "scales", "zeros", "bits", "group_size", "out", "workspace"),
    "gemv_workspace_numel": ("op", "x", "codes", "scales", "zeros", "bits", "group_size", "mode", "x_scale"),
    "fwht": ("x", "group_size", "signs", "inverse"),
    "lattice_quantize": ("x", "grid", "group_size", "signs"),
    "lattice_dequantize": ("codes", "norms", "grid", "group_size", "signs"),
    "gemv_lattice_k": ("q", "codes", "norms", "grid", "group_size", "signs"),
    "gemv_lattice_v": ("p", "codes", "norms", "grid", "group_size", "signs"),
    "aqua_reconstruct": (
        "prev",
        "weight",
        "bias",
        "codes",
        "norms",
        "grid",
        "group_size",
        "signs",
        "prev2",
        "weight2",
    ),
    "decode_attention_fused": (
        "x",
        "sink_keys",
        "sink_values",
        "key_codes",
        "key_scales",
        "key_zeros",
        "value_codes",
        "value_scales",
        "value_zeros",
        "key_tail",
        "value_tail",
        "key_bits",
        "key_mode",
        "key_layout",
        "value_bits",
        "value_mode",
        "value_layout",
        "group_size",
        "key_x_scale",
        "attn_mask",
        "split_tokens",
        "lengths",  # the device-lengths form: tests/test_fused_attention.py (capacity buffers with junk)
        "q_scale",
        "out_dtype",
    ),
    "static_append": (
        "k",
        "v",
        "lengths",
        "sink_keys",
        "sink_values",
        "key_codes",
        "key_scales",
        "key_zeros",
        "value_codes",
        "value_scales",
        "value_zeros",
        "key_tail",
        "value_tail",
        "key_bits",
        "key_mode",
        "key_layout",
        "key_eta",
        "value_bits",
        "value_mode",
        "value_layout",
        "value_eta",
        "group_size",
        "w_recent",
        "key_x_scale",
    ),
}


@requires_c
def test_fuzzer_covers_every_schema():
    # a new op needs a case strategy and an oracle here; the cases pass arguments in the schema's order
    assert sorted(CASES) == sorted(schema_ops())
    for op in schema_ops():
        schema = getattr(torch.ops.kvkernels, op).default._schema
        assert [a.name for a in schema.arguments] == list(_ARG_NAMES[op]), op


JOBS = int(os.environ.get("KVKERNELS_FUZZ_JOBS", "2"))  # workers at a time (one thread each)


def _run_worker(op: str, trace: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", op, "--examples", str(EXAMPLES)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    return subprocess.run([*cmd, "--trace", str(trace)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def fuzz_runs(request, tmp_path_factory):
    """op -> Future of its worker's CompletedProcess: the selected ops' workers start together, JOBS at a time."""
    selected = [i.callspec.params["op"] for i in request.session.items if i.originalname == "test_fuzz_op"]
    traces = tmp_path_factory.mktemp("fuzz")
    with ThreadPoolExecutor(max_workers=JOBS) as pool:
        yield {op: (pool.submit(_run_worker, op, traces / f"{op}.txt"), traces / f"{op}.txt") for op in selected}


@requires_c
@pytest.mark.parametrize("op", schema_ops())
def test_fuzz_op(op, fuzz_runs):
    future, trace = fuzz_runs[op]
    proc = future.result()
    out = (proc.stdout + proc.stderr)[-6000:]
    if proc.returncode < 0:
        last = trace.read_text() if trace.exists() else "?"
        pytest.fail(f"{op}: the worker died of {signal.Signals(-proc.returncode).name} on {last}\n{out}")
    assert proc.returncode == 0, f"{op}: the fuzzer found a failing case:\n{out}"
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("FUZZ-REPORT "))
    report = json.loads(line.removeprefix("FUZZ-REPORT "))
    print(line)
    assert report["examples"] >= EXAMPLES, report
    assert report["outcomes"].get("ok", 0) >= MIN_VALID_FRACTION * report["examples"], "too few valid calls"


# ---- regressions: what the fuzzer found, one direct test each ------------------------------------------------------


def _meta(t):
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


@requires_c
@pytest.mark.parametrize("bits", BITS)
def test_pack_bits_keeps_the_low_bits_of_out_of_range_codes(bits):
    # the op does not check values (the public wrapper does, with a sync): C++ masked, the reference overflowed
    # into the neighbouring fields; both now keep each code's low `bits` bits
    codes = torch.arange(-40, 88, dtype=torch.int64).reshape(4, 32)
    want = reference.pack_bits(codes & (2**bits - 1), bits)
    assert torch.equal(torch.ops.kvkernels.pack_bits(codes, bits), want)
    assert torch.equal(reference.pack_bits(codes, bits), want)


def _negative_scale_case(mode):
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(-(2**31), 2**31, (2, 6), generator=g, dtype=torch.int32)
    scales = -torch.rand(2, 2, generator=g).half()  # never produced by quantize_groups, but a valid fp16 tensor
    return codes, scales, torch.randn(2, 2, generator=g).half(), 3, 32, mode


@requires_c
@pytest.mark.parametrize("mode", MODES)
def test_dequantize_negative_scales_matches_reference(mode):
    # C++ (group_affine_rt) dropped the sign of every scale; only hybrid reads it (as its asym flag)
    args = _negative_scale_case(mode)
    want = reference.dequantize_groups(*args)
    torch.testing.assert_close(torch.ops.kvkernels.dequantize_groups(*args), want, rtol=1e-6, atol=1e-6)
    if os.environ.get("TRITON_INTERPRET") == "1":
        import kvkernels.triton_kernels as tk
        from kvkernels.triton_kernels._common import interpreter_problem

        if not interpreter_problem():  # triton 3.6 under numpy >= 2.4 (the GPU machines' stack on CPU) cannot run it
            torch.testing.assert_close(tk.dequantize_groups(*args), want, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="Triton needs a GPU or TRITON_INTERPRET=1",
)
@pytest.mark.parametrize("mode", MODES)
def test_triton_dequantize_strided_codes(mode):
    # the Triton wrapper read codes with a non-unit last stride as if it were 1: silently wrong values
    import kvkernels.triton_kernels as tk
    from kvkernels.triton_kernels._common import interpreter_problem

    if not torch.cuda.is_available() and interpreter_problem():  # triton 3.6 under numpy >= 2.4 (CI fails instead)
        pytest.skip(interpreter_problem())

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    codes, scales, zeros, bits, G, _ = _negative_scale_case(mode)
    codes = codes.t().contiguous().t()  # same words, strides (1, 2)
    want = reference.dequantize_groups(codes, scales, zeros, bits, G, mode)
    got = tk.dequantize_groups(codes.to(dev), scales.to(dev), zeros.to(dev), bits, G, mode)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6)


@requires_c
@pytest.mark.parametrize("which", ["scales", "zeros"])
def test_dequantize_strided_group_params_rejected_everywhere(which):
    # C++ accepted a non-unit last stride in scales/zeros where the fakes (kvkernels/_validate.py) rejected it
    codes, scales, zeros, bits, G, mode = _negative_scale_case("asym")
    t = {"scales": scales, "zeros": zeros}
    t[which] = t[which].t().contiguous().t()  # same values, strides (1, 2)
    args = (codes, t["scales"], t["zeros"], bits, G, mode)
    for call in (args, tuple(_meta(a) if isinstance(a, torch.Tensor) else a for a in args)):
        with pytest.raises(ValueError, match=f"{which} must have stride 1 in its last dim"):
            torch.ops.kvkernels.dequantize_groups(*call)


def _quant_into_args():
    x = torch.randn(4, 64)
    return [x, 3, 32, "asym", 0.0, torch.empty(4, 6, dtype=torch.int32), *torch.empty(2, 4, 2).half().unbind(0)]


@requires_c
@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize(
    "op, position, name",
    [
        ("pack_bits", 0, "codes"),
        ("unpack_bits", 0, "packed"),
        ("quantize_groups", 0, "x"),
        ("quantize_groups_into", 0, "x"),
        ("quantize_groups_into", 5, "codes"),
        ("quantize_groups_into", 7, "zeros"),
        ("dequantize_groups", 1, "scales"),
        ("gemv_inner_q", 1, "codes"),
        ("gemv_kivi", 3, "zeros"),
        ("gemv_inner_q_into", 8, "out"),
        ("gemv_kivi_into", 0, "x"),
        ("gemv_workspace_numel", 2, "codes"),
        ("fwht", 0, "x"),
        ("lattice_quantize", 1, "grid"),
        ("lattice_dequantize", 1, "norms"),
        ("gemv_lattice_k", 0, "q"),
        ("gemv_lattice_v", 3, "grid"),
        ("aqua_reconstruct", 2, "bias"),
        ("decode_attention_fused", 3, "key_codes"),
    ],
)
def test_none_for_a_required_tensor_is_a_type_error(op, position, name, device):
    # the dispatcher passes None as an undefined tensor: the C++ ops failed with "Unimplemented scalar type",
    # the Python kernels and fakes with an AttributeError, and a second tensor-less call ran no check at all
    x, bits, G, mode, eta, codes, scales, zeros = _quant_into_args()
    gx = torch.randn(1, 2, 64)
    gemv_codes = torch.zeros(1, 1, 64, 6, dtype=torch.int32)
    gemv_scales = torch.ones(1, 1, 64, 2).half()
    calls = {
        "pack_bits": [codes, bits],
        "unpack_bits": [codes, bits],
        "quantize_groups": [x, bits, G, mode, eta],
        "quantize_groups_into": [x, bits, G, mode, eta, codes, scales, zeros],
        "dequantize_groups": [codes, scales, zeros, bits, G, mode],
        "gemv_inner_q": [gx, gemv_codes, gemv_scales, gemv_scales, bits, G, mode, None],
        "gemv_kivi": [gx, gemv_codes, gemv_scales, gemv_scales, bits, G],
        "gemv_inner_q_into": [gx, gemv_codes, gemv_scales, gemv_scales, bits, G, mode, None, torch.empty(1, 2, 64)],
        "gemv_kivi_into": [gx, gemv_codes, gemv_scales, gemv_scales, bits, G, torch.empty(1, 2, 64)],
        "gemv_workspace_numel": ["gemv_inner_q", gx, gemv_codes, gemv_scales, gemv_scales, bits, G, mode, None],
        "fwht": [x, G, None, False],
        "lattice_quantize": [x, torch.zeros(16, 2), G, None],
        "lattice_dequantize": [codes[:, :2], scales[:, :1], torch.zeros(16, 2), G, None],
        "gemv_lattice_k": [gx, gemv_codes[..., :4], gemv_scales, torch.zeros(16, 2), G, None],
        "gemv_lattice_v": [gx, gemv_codes[..., :4], gemv_scales, torch.zeros(16, 2), G, None],
        "aqua_reconstruct": [
            gx[0],
            torch.zeros(64, 64),
            torch.zeros(64),
            gemv_codes[0, 0, :2, :4],
            gemv_scales[0, 0, :2, :1],
            torch.zeros(16, 2),
            G,
            None,
            None,
            None,
        ],
        "decode_attention_fused": [  # [1, 2, 1, 64] against one KV head: 64 store tokens (rows) and a 1-token tail
            gx[:, :, None],
            *torch.zeros(2, 1, 1, 0, 64).unbind(0),
            gemv_codes,
            gemv_scales,
            gemv_scales,
            gemv_codes,
            gemv_scales,
            gemv_scales,
            *torch.zeros(2, 1, 1, 1, 64).unbind(0),
            bits,
            mode,
            "rows",
            bits,
            mode,
            "rows",
            G,
            None,
            None,
            0,
        ],
    }
    args = [(_meta(a) if device == "meta" else a) if isinstance(a, torch.Tensor) else a for a in calls[op]]
    args[position] = None
    if not any(isinstance(a, torch.Tensor) for a in args):  # no tensor left: the dispatcher itself refuses
        with pytest.raises(NotImplementedError, match=op):
            getattr(torch.ops.kvkernels, op)(*args)
        return
    with pytest.raises(TypeError, match=f"kvkernels.{op}: {name} must be a tensor, got None"):
        getattr(torch.ops.kvkernels, op)(*args)


@requires_c
@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize(
    "which, view",
    [
        ("codes", lambda t: t[:1].expand(4, 6)),  # stride 0: four rows, one buffer row
        ("scales", lambda t: torch.empty(8, dtype=t.dtype).as_strided((4, 2), (1, 1))),  # rows 1 apart, 2 long
        ("zeros", lambda t: t[:1].expand(4, 2)),
    ],
)
def test_quantize_into_rejects_self_overlapping_outputs(which, view, device):
    # an expand()ed output: C++ failed inside copy_ with torch's message, the fakes accepted it, and the Triton
    # and CUDA kernels would race on the shared words
    x, bits, G, mode, eta, codes, scales, zeros = _quant_into_args()
    outs = {"codes": codes, "scales": scales, "zeros": zeros}
    outs[which] = view(outs[which])
    args = [x, bits, G, mode, eta, outs["codes"], outs["scales"], outs["zeros"]]
    args = [(_meta(a) if device == "meta" else a) if isinstance(a, torch.Tensor) else a for a in args]
    with pytest.raises(ValueError, match=f"{which} must not overlap itself"):
        torch.ops.kvkernels.quantize_groups_into(*args)


@requires_c
def test_quantize_into_accepts_permuted_and_padded_outputs():
    # the overlap rule must not reject legitimate layouts: a permuted cache block and padded rows
    x = torch.randn(2, 3, 64)
    codes = torch.empty(3, 2, 8, dtype=torch.int32)[..., :6].transpose(0, 1)  # [2, 3, 6], rows padded to 8
    scales = torch.empty(3, 2, 2).half().transpose(0, 1)
    zeros = torch.empty(2, 3, 5).half()[..., 1:3]
    torch.ops.kvkernels.quantize_groups_into(x, 3, 32, "asym", 0.0, codes, scales, zeros)
    want = reference.quantize_groups(x, 3, 32, "asym")
    for got, w in zip((codes, scales, zeros), want, strict=True):
        assert torch.equal(got, w)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", required=True, choices=sorted(CASES))
    parser.add_argument("--examples", type=int, default=EXAMPLES)
    parser.add_argument("--trace", help="file to hold the case in flight")
    parser.add_argument("--seed", type=int, help="other cases than CI's (which runs derandomized), for longer hunts")
    parser.add_argument(
        "--backend",
        choices=["cpu", "triton"],
        default="cpu",
        help="triton: the Triton kernels (TRITON_INTERPRET=1 on CPU; about 0.3 s a call, so not in CI)",
    )
    cli = parser.parse_args()
    sys.exit(worker(cli.worker, cli.examples, cli.trace, cli.seed, cli.backend))
