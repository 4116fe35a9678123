"""Public, typed wrappers over torch.ops.kvkernels, plus the Python side of op registration.

Schemas live in csrc/ops.cpp. This module adds, for every op:
  * a fake (meta) kernel, so torch.compile and opcheck can trace it;
  * the CPU kernel where C++ has none (the reference), and the CUDA kernel where no compiled one was built
    (Triton if importable, else the reference, which is plain PyTorch and runs on any device);
  * a wrapper that validates arguments (kvkernels._validate) with errors naming the argument.
Every registered Python kernel validates too, so calling torch.ops.kvkernels.X directly is just as safe.
"""

import functools

import torch

from . import _validate as V
from . import reference
from ._backends import HAS_C, HAS_TRITON, _has_cuda_kernel, require_c

OPS = (
    "pack_bits",
    "unpack_bits",
    "quantize_groups",
    "quantize_groups_into",
    "dequantize_groups",
    "gemv_inner_q",
    "gemv_kivi",
)


_CHECKS = {
    "pack_bits": V.check_pack,
    "unpack_bits": V.check_unpack,
    "quantize_groups": lambda x, bits, group_size, mode, eta=0.0: V.check_quantize(
        "quantize_groups", x, bits, group_size, mode, eta
    ),
    "quantize_groups_into": V.check_quantize_into,
    "dequantize_groups": V.check_dequantize,
    "gemv_inner_q": V.check_gemv_inner_q,
    "gemv_kivi": V.check_gemv_kivi,
}


def _required_tensors(op: str) -> tuple[tuple[int, str], ...]:
    # (position, name) of the schema's non-optional Tensor arguments: the dispatcher lets None through for them
    schema = getattr(torch.ops.kvkernels, op).default._schema
    return tuple((i, a.name) for i, a in enumerate(schema.arguments) if isinstance(a.type, torch.TensorType))


def _checked(op: str, fn):
    check = _CHECKS[op]
    required = _required_tensors(op)

    @functools.wraps(fn)
    def kernel(*args, **kwargs):
        for i, name in required:  # first, as the C++ ops do (csrc/op_checks.h check_defined)
            if (args[i] if i < len(args) else kwargs.get(name)) is None:
                raise TypeError(f"kvkernels.{op}: {name} must be a tensor, got None")
        check(*args, **kwargs)
        return fn(*args, **kwargs)

    return kernel


def _triton_impl(op: str):
    if not HAS_TRITON:
        return None
    try:
        from . import triton_kernels
    except ImportError:
        return None
    return getattr(triton_kernels, op, None)


# Which implementation serves CUDA tensors, per op (for kvkernels.backends() and tests).
CUDA_IMPL: dict[str, str] = {}


def _register() -> None:
    for op in OPS:
        qualname = f"kvkernels::{op}"
        if not torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CPU"):
            torch.library.register_kernel(qualname, "cpu", _checked(op, getattr(reference, op)))
        if _has_cuda_kernel(op):
            CUDA_IMPL[op] = "cuda"
            continue
        impl = _triton_impl(op)
        CUDA_IMPL[op] = "triton" if impl is not None else "reference"
        torch.library.register_kernel(qualname, "cuda", _checked(op, impl or getattr(reference, op)))
    _register_fakes()


def _register_fakes() -> None:
    # The fakes (meta kernels, used by torch.compile, opcheck and meta tensors) run the same metadata checks as every
    # real kernel, so a bad call fails at trace time with the same message instead of returning plausible shapes.
    def fake(op: str):
        def register(fn):
            torch.library.register_fake(f"kvkernels::{op}")(_checked(op, fn))
            return fn

        return register

    @fake("pack_bits")
    def _(codes, bits):
        return codes.new_empty((*codes.shape[:-1], codes.shape[-1] // 32 * bits), dtype=torch.int32)

    @fake("unpack_bits")
    def _(packed, bits):
        return packed.new_empty((*packed.shape[:-1], packed.shape[-1] // bits * 32), dtype=torch.uint8)

    @fake("quantize_groups")
    def _(x, bits, group_size, mode, eta=0.0):
        lead, L = x.shape[:-1], x.shape[-1]
        codes = x.new_empty((*lead, L // 32 * bits), dtype=torch.int32)
        scales = x.new_empty((*lead, L // group_size), dtype=torch.float16)
        return codes, scales, torch.empty_like(scales)

    @fake("quantize_groups_into")
    def _(x, bits, group_size, mode, eta, codes, scales, zeros):
        return None

    @fake("dequantize_groups")
    def _(codes, scales, zeros, bits, group_size, mode):
        return codes.new_empty((*codes.shape[:-1], codes.shape[-1] // bits * 32), dtype=torch.float32)

    @fake("gemv_inner_q")
    def _(x, codes, scales, zeros, bits, group_size, mode, x_scale=None):
        return x.new_empty((*x.shape[:-1], codes.shape[2]), dtype=torch.float32)

    @fake("gemv_kivi")
    def _(x, codes, scales, zeros, bits, group_size):
        return x.new_empty((*x.shape[:-1], codes.shape[-1] // bits * 32), dtype=torch.float32)


if HAS_C:
    _register()


# ---------------------------------------------------------------------------------------------------------
# Public wrappers. Each validates (with a device sync only where documented) and calls the dispatcher op.


def pack_bits(codes: torch.Tensor, bits: int, check_range: bool = True) -> torch.Tensor:
    """Pack integer codes [..., N] (N % 32 == 0, values in [0, 2^bits)) into int32 words [..., N*bits/32].

    check_range=True verifies the value range, which costs a device sync; set False inside graphs.
    """
    require_c("pack_bits")
    V.check_pack(codes, bits)
    if check_range and codes.numel():
        lo, hi = int(codes.min()), int(codes.max())
        if lo < 0 or hi >= 2**bits:
            raise ValueError(
                f"kvkernels.pack_bits: codes must be in [0, {2**bits - 1}] for bits={bits}, got [{lo}, {hi}]"
            )
    return torch.ops.kvkernels.pack_bits.default(codes, bits)


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Unpack int32 words [..., W] (W % bits == 0) into uint8 codes [..., W*32/bits]."""
    require_c("unpack_bits")
    V.check_unpack(packed, bits)
    return torch.ops.kvkernels.unpack_bits.default(packed, bits)


def quantize_groups(
    x: torch.Tensor, bits: int, group_size: int, mode: str = "sym", eta: float = 0.0, check_values: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize x [..., L] in groups of group_size along L. Returns (codes, scales, zeros); see FORMATS.md.

    check_values=True rejects NaN/Inf and out-of-fp16-range input (one device sync). With False, a NaN stays
    inside its own group: that group's scale becomes NaN, every other group is unaffected.
    """
    require_c("quantize_groups")
    V.check_quantize("quantize_groups", x, bits, group_size, mode, eta)
    if check_values:
        V.check_values("quantize_groups", x, bits, group_size, mode)
    return torch.ops.kvkernels.quantize_groups.default(x, bits, group_size, mode, float(eta))


def quantize_groups_into(
    x: torch.Tensor,
    bits: int,
    group_size: int,
    mode: str,
    eta: float,
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    check_values: bool = False,
) -> None:
    """quantize_groups writing into caller buffers (views with any row strides). No sync unless check_values."""
    require_c("quantize_groups_into")
    V.check_quantize_into(x, bits, group_size, mode, eta, codes, scales, zeros)
    if check_values:
        V.check_values("quantize_groups_into", x, bits, group_size, mode)
    torch.ops.kvkernels.quantize_groups_into.default(x, bits, group_size, mode, float(eta), codes, scales, zeros)


def dequantize_groups(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int, group_size: int, mode: str
) -> torch.Tensor:
    """Inverse of quantize_groups: fp32 [..., L]."""
    require_c("dequantize_groups")
    V.check_dequantize(codes, scales, zeros, bits, group_size, mode)
    return torch.ops.kvkernels.dequantize_groups.default(codes, scales, zeros, bits, group_size, mode)


def gemv_inner_q(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bits: int,
    group_size: int,
    mode: str,
    x_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """InnerQ fused dequant-GEMV: y[b,h,(t),m] = sum_l x[b,h,(t),l] * x_scale[h_kv,l] * deq(codes[b,h_kv,m,l]).

    x [B, H_q, L] or [B, H_q, T, L] fp16/bf16/fp32; codes int32 [B, H_kv, M, L*bits/32]; scales (and zeros,
    required for asym/hybrid) fp16 [B, H_kv, M, L/G]; x_scale fp32 [H_kv, L] or None. Returns fp32.
    """
    require_c("gemv_inner_q")
    V.check_gemv_inner_q(x, codes, scales, zeros, bits, group_size, mode, x_scale)
    return torch.ops.kvkernels.gemv_inner_q.default(x, codes, scales, zeros, bits, group_size, mode, x_scale)


def gemv_kivi(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group_size: int
) -> torch.Tensor:
    """KIVI-layout fused dequant-GEMV: y[b,h,(t),c] = sum_r x[b,h,(t),r] * deq(codes[b,h_kv,r,c]).

    x [B, H_q, R] or [B, H_q, T, R]; codes int32 [B, H_kv, R, C*bits/32]; scales/zeros fp16 [B, H_kv, R, C/G].
    """
    require_c("gemv_kivi")
    V.check_gemv_kivi(x, codes, scales, zeros, bits, group_size)
    return torch.ops.kvkernels.gemv_kivi.default(x, codes, scales, zeros, bits, group_size)
