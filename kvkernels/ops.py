"""Public, typed wrappers over torch.ops.kvkernels, plus the Python side of op registration.

Schemas live in csrc/ops.cpp. This module adds, for every op:
  * a fake (meta) kernel, so torch.compile and opcheck can trace it;
  * the CPU kernel where C++ has none (the reference), and the CUDA kernel where no compiled one was built
    (Triton if importable, else the reference, which is plain PyTorch and runs on any device);
  * a wrapper that validates arguments (kvkernels._validate) with errors naming the argument.
Every registered kernel (Python or C++) validates the metadata too (dtypes, shapes, devices, bits, overlapping
outputs), so a direct torch.ops.kvkernels.X call gets the same errors for those; the checks that read the data (NaN /
Inf input, out-of-range codes or signs: a device sync each) run in the wrappers only.
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
    "gemv_inner_q_into",
    "gemv_kivi_into",
    "gemv_workspace_numel",
    "fwht",
    "lattice_quantize",
    "lattice_dequantize",
    "gemv_lattice_k",
    "gemv_lattice_v",
    "aqua_reconstruct",
    "decode_attention_fused",
    "static_append",
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
    "gemv_inner_q_into": V.check_gemv_inner_q_into,
    "gemv_kivi_into": V.check_gemv_kivi_into,
    "gemv_workspace_numel": V.check_gemv_workspace_numel,
    "fwht": V.check_fwht,
    "lattice_quantize": V.check_lattice_quantize,
    "lattice_dequantize": V.check_lattice_dequantize,
    "gemv_lattice_k": V.check_gemv_lattice_k,
    "gemv_lattice_v": V.check_gemv_lattice_v,
    "aqua_reconstruct": V.check_aqua_reconstruct,
    "decode_attention_fused": V.check_decode_attention_fused,
    "static_append": V.check_static_append,
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


# Python kernels of the ops that only the compiled CUDA build implements natively: the GEMVs' _into forms call the
# functional op (whichever backend serves it) and copy into out; the workspace is for the compiled kernels only.
def _gemv_inner_q_into(x, codes, scales, zeros, bits, group_size, quant_mode, x_scale, out, workspace=None) -> None:
    out.copy_(torch.ops.kvkernels.gemv_inner_q.default(x, codes, scales, zeros, bits, group_size, quant_mode, x_scale))


def _gemv_kivi_into(x, codes, scales, zeros, bits, group_size, out, workspace=None) -> None:
    out.copy_(torch.ops.kvkernels.gemv_kivi.default(x, codes, scales, zeros, bits, group_size))


def _gemv_workspace_numel(gemv, x, codes, scales, zeros, bits, group_size, mode="asym", x_scale=None) -> int:
    return 0  # the reference and Triton GEMVs take no workspace


_PY_ONLY = {
    "gemv_inner_q_into": _gemv_inner_q_into,
    "gemv_kivi_into": _gemv_kivi_into,
    "gemv_workspace_numel": _gemv_workspace_numel,
}


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
# head_dim values the compiled CUDA decode_attention_fused is built for (csrc/cuda/decode_attention.cu)
CUDA_ATTENTION_HEAD_DIMS = (64, 128)


def fused_attention_takes(device: torch.device, head_dim: int) -> bool:
    """Whether the decode_attention_fused kernel that serves `device` takes this call: the compiled CUDA kernel
    is instantiated for CUDA_ATTENTION_HEAD_DIMS, Triton and the reference take any head_dim (decode_attention
    composes where the op would refuse, kvkernels.static_cache calls the reference). Every backend takes the
    lengths= form."""
    impl = CUDA_IMPL.get("decode_attention_fused", "reference") if device.type == "cuda" else "reference"
    if impl == "cuda":
        return head_dim in CUDA_ATTENTION_HEAD_DIMS
    return True


# Ops whose CPU kernel is C++ behind the Python checks where the extension is built: csrc/cpu/lattice_cpu.cpp and
# csrc/cpu/gemv_cpu.cpp register them as kvkernels_cpu::<op>, bit-identical to the reference (tests/test_lattice.py,
# tests/test_ops.py; their own checks only keep a direct call memory-safe). The lattice ops run their fixed-order
# steps as C++ loops (one decode token of 3 KV heads x 64 quantizes in ~0.07 ms against the reference's ~1.3 ms of
# ~100 small PyTorch ops); the GEMVs are the reference's ATen calls with the C++ dequantizer, without its Python.
_CPP_CPU = ("fwht", "lattice_quantize", "lattice_dequantize", "gemv_lattice_k", "gemv_lattice_v", "gemv_inner_q",
            "gemv_kivi")  # fmt: skip


def _cpu_impl(op: str):
    """The Python CPU kernel of an op C++ does not implement as a public CPU kernel: the private C++ one of _CPP_CPU
    where the extension has it (`make demo` and `make eval` run these on every decode step), else the reference."""
    if op in _PY_ONLY:
        return _PY_ONLY[op]
    if op in _CPP_CPU and hasattr(torch.ops.kvkernels_cpu, op):
        return getattr(torch.ops.kvkernels_cpu, op).default
    return getattr(reference, op)


def _register() -> None:
    for op in OPS:
        qualname = f"kvkernels::{op}"
        if not torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CPU"):
            torch.library.register_kernel(qualname, "cpu", _checked(op, _cpu_impl(op)))
        if _has_cuda_kernel(op):
            CUDA_IMPL[op] = "cuda"
            continue
        if op in _PY_ONLY:  # served by the functional op's CUDA kernel
            CUDA_IMPL[op] = "python"
            torch.library.register_kernel(qualname, "cuda", _checked(op, _PY_ONLY[op]))
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

    @fake("gemv_inner_q_into")
    def _(x, codes, scales, zeros, bits, group_size, quant_mode, x_scale, out, workspace=None):
        return None

    @fake("gemv_kivi_into")
    def _(x, codes, scales, zeros, bits, group_size, out, workspace=None):
        return None

    @fake("gemv_workspace_numel")
    def _(gemv, x, codes, scales, zeros, bits, group_size, mode="asym", x_scale=None):
        raise NotImplementedError(
            "kvkernels.gemv_workspace_numel reads device properties and pointer alignment: call it outside traced "
            "or compiled code (before capturing a graph) and pass the buffer in"
        )

    def lattice_bits(grid):  # grid [n, d], already validated
        return V.check_lattice_grid("lattice", grid)

    @fake("fwht")
    def _(x, group_size, signs=None, inverse=False):
        return x.new_empty(x.shape, dtype=torch.float32)

    @fake("lattice_quantize")
    def _(x, grid, group_size, signs=None):
        lead, C = x.shape[:-1], x.shape[-1]
        codes = x.new_empty((*lead, C // 32 * lattice_bits(grid)), dtype=torch.int32)
        return codes, x.new_empty((*lead, C // group_size), dtype=torch.float16)

    @fake("lattice_dequantize")
    def _(codes, norms, grid, group_size, signs=None):
        return codes.new_empty((*codes.shape[:-1], codes.shape[-1] // lattice_bits(grid) * 32), dtype=torch.float32)

    @fake("gemv_lattice_k")
    def _(q, codes, norms, grid, group_size, signs=None):
        return q.new_empty((*q.shape[:-1], codes.shape[2]), dtype=torch.float32)

    @fake("gemv_lattice_v")
    def _(p, codes, norms, grid, group_size, signs=None):
        return p.new_empty((*p.shape[:-1], codes.shape[-1] // lattice_bits(grid) * 32), dtype=torch.float32)

    @fake("aqua_reconstruct")
    def _(prev, weight, bias, codes, norms, grid, group_size, signs=None, prev2=None, weight2=None):
        return prev.new_empty((prev.shape[0], weight.shape[0]), dtype=torch.float32)

    @fake("decode_attention_fused")
    def _(x, sk, sv, kc, ks, kz, vc, vs, vz, kt, vt, kb, km, kl, vb, vm, vl, g, kxs=None, mask=None, split=0,
          lengths=None, q_scale=1.0, out_dtype=None):  # fmt: skip
        return x.new_empty(x.shape, dtype=out_dtype or torch.float32)

    @fake("static_append")
    def _(*args, **kwargs):
        return None


if HAS_C:
    _register()


# ---------------------------------------------------------------------------------------------------------
# Public wrappers. Each validates (with a device sync only where documented) and calls the dispatcher op.


def unchecked(op: str):
    """torch.ops.kvkernels.<op>.default, for kvkernels' own per-step callers whose arguments are valid by
    construction (a layer cache's buffers and views, queries its attention already checked).

    Every kernel of an op validates its arguments itself (the C++ ops, and the Python-registered ones through
    _checked), so the public wrappers' pre-check is a second pass over the same metadata: ~10-15 us of host time per
    call in Python, paid per layer and decode step on the dynamic path (QuantStore.write, decode_attention). The
    wrappers keep it for users, whose arguments may be wrong, and for the data checks (check_values)."""
    require_c(op)
    return getattr(torch.ops.kvkernels, op).default


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
    *,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """InnerQ fused dequant-GEMV: y[b,h,(t),m] = sum_l x[b,h,(t),l] * x_scale[h_kv,l] * deq(codes[b,h_kv,m,l]).

    x [B, H_q, L] or [B, H_q, T, L] fp16/bf16/fp32; codes int32 [B, H_kv, M, L*bits/32]; scales (and zeros,
    required for asym/hybrid) fp16 [B, H_kv, M, L/G]; x_scale fp32 [H_kv, L] or None. Returns fp32.
    out: write the result there and return it (fp32 [B, H_q, (T,) M], stride 1 in the last dim: a slice of a wider
    buffer works) instead of allocating; workspace (with out): the split-K buffer of the CUDA kernel, at least
    gemv_workspace_numel("gemv_inner_q", ...) floats, so the call allocates nothing.
    """
    require_c("gemv_inner_q")
    if out is None:
        _no_workspace_without_out("gemv_inner_q", workspace)
        V.check_gemv_inner_q(x, codes, scales, zeros, bits, group_size, mode, x_scale)
        return torch.ops.kvkernels.gemv_inner_q.default(x, codes, scales, zeros, bits, group_size, mode, x_scale)
    V.check_gemv_inner_q_into(x, codes, scales, zeros, bits, group_size, mode, x_scale, out, workspace)
    torch.ops.kvkernels.gemv_inner_q_into.default(
        x, codes, scales, zeros, bits, group_size, mode, x_scale, out, workspace
    )
    return out


def gemv_kivi(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bits: int,
    group_size: int,
    *,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """KIVI-layout fused dequant-GEMV: y[b,h,(t),c] = sum_r x[b,h,(t),r] * deq(codes[b,h_kv,r,c]).

    x [B, H_q, R] or [B, H_q, T, R]; codes int32 [B, H_kv, R, C*bits/32]; scales/zeros fp16 [B, H_kv, R, C/G].
    out / workspace: as gemv_inner_q's (out fp32 [B, H_q, (T,) C]).
    """
    require_c("gemv_kivi")
    if out is None:
        _no_workspace_without_out("gemv_kivi", workspace)
        V.check_gemv_kivi(x, codes, scales, zeros, bits, group_size)
        return torch.ops.kvkernels.gemv_kivi.default(x, codes, scales, zeros, bits, group_size)
    V.check_gemv_kivi_into(x, codes, scales, zeros, bits, group_size, out, workspace)
    torch.ops.kvkernels.gemv_kivi_into.default(x, codes, scales, zeros, bits, group_size, out, workspace)
    return out


def _no_workspace_without_out(op: str, workspace) -> None:
    if workspace is not None:
        raise ValueError(f"kvkernels.{op}: workspace= is only taken with out= (the functional form allocates)")


def gemv_workspace_numel(
    op: str,
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bits: int,
    group_size: int,
    mode: str = "asym",
    x_scale: torch.Tensor | None = None,
) -> int:
    """Floats of split-K workspace the CUDA kernel of `op` ("gemv_inner_q" or "gemv_kivi") needs for these arguments
    (0: it does not split; always 0 where the reference or Triton serves the op). The plan depends on the shapes,
    strides, alignment and the device: ask with the tensors the call will use, outside compiled code."""
    require_c("gemv_workspace_numel")
    V.check_gemv_workspace_numel(op, x, codes, scales, zeros, bits, group_size, mode, x_scale)
    return torch.ops.kvkernels.gemv_workspace_numel.default(
        op, x, codes, scales, zeros, bits, group_size, mode, x_scale
    )


# Lattice (HIGGS-style) ops, docs/FORMATS.md "Lattice". grid: fp32 [n, d] (kvkernels.formats.lattice_grids.grid);
# group_size G: a power of two in [32, 1024]; signs: None or int8 [G] of +-1. check_values checks signs (and x for
# lattice_quantize) with one device sync: on by default where the op is not on the decode path.


def fwht(
    x: torch.Tensor,
    group_size: int,
    signs: torch.Tensor | None = None,
    inverse: bool = False,
    check_values: bool = True,
) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform of each group of G values along the last dim, fp32 [..., C].

    y = H_n (s * x_g) with H_n = H / sqrt(G) (Sylvester order, symmetric, its own inverse); inverse=True computes
    x_g = s * (H_n y). check_values=True verifies that signs are +-1 (one device sync).
    """
    require_c("fwht")
    V.check_fwht(x, group_size, signs, inverse)
    if check_values:
        V.check_signs_values("fwht", signs)
    return torch.ops.kvkernels.fwht.default(x, group_size, signs, bool(inverse))


def lattice_quantize(
    x: torch.Tensor,
    grid: torch.Tensor,
    group_size: int,
    signs: torch.Tensor | None = None,
    check_values: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lattice-quantize x [..., C] in groups of G: (codes int32 [..., C*bits/32], norms fp16 [..., C/G]).

    Per group: y = H_n (s * x_g), r = ||x_g|| / sqrt(G) (stored fp16), and each d-vector of y / r replaced by the
    index of its nearest grid row (first on ties); bits = log2(n) / d per value. check_values=True rejects NaN/Inf,
    a group RMS beyond fp16's range and signs other than +-1 (one device sync); with False a non-finite group stores
    a NaN/Inf norm and index 0, every other group is unaffected.
    """
    require_c("lattice_quantize")
    V.check_lattice_quantize(x, grid, group_size, signs)
    if check_values:
        V.check_lattice_values("lattice_quantize", x, group_size)
        V.check_signs_values("lattice_quantize", signs)
    return torch.ops.kvkernels.lattice_quantize.default(x, grid, group_size, signs)


def lattice_dequantize(
    codes: torch.Tensor,
    norms: torch.Tensor,
    grid: torch.Tensor,
    group_size: int,
    signs: torch.Tensor | None = None,
    check_values: bool = False,
) -> torch.Tensor:
    """Inverse of lattice_quantize: x_hat_g = s * H_n (r16 * grid[c]), fp32 [..., C] from codes [..., C*bits/32] and
    norms fp16 [..., C/G]. No sync unless check_values (signs +-1)."""
    require_c("lattice_dequantize")
    V.check_lattice_dequantize(codes, norms, grid, group_size, signs)
    if check_values:
        V.check_signs_values("lattice_dequantize", signs)
    return torch.ops.kvkernels.lattice_dequantize.default(codes, norms, grid, group_size, signs)


def gemv_lattice_k(
    q: torch.Tensor,
    codes: torch.Tensor,
    norms: torch.Tensor,
    grid: torch.Tensor,
    group_size: int,
    signs: torch.Tensor | None = None,
    check_values: bool = False,
) -> torch.Tensor:
    """Key scores on lattice codes: scores[b,h,(t),n] = q[b,h,(t)] . x_hat[b,h_kv,n], h_kv = h // (H_q / H_kv).

    Computed as sum_g r16[n,g] <H_n (s * q_g), grid[c_{n,g}]>: each query row is rotated once, no key is
    dequantized. q [B, H_q, D] or [B, H_q, T, D] fp16/bf16/fp32; codes int32 [B, H_kv, N, D*bits/32]; norms fp16
    [B, H_kv, N, D/G]; G divides D. Returns fp32 [B, H_q, (T,) N]. No sync unless check_values (signs +-1).
    """
    require_c("gemv_lattice_k")
    V.check_gemv_lattice_k(q, codes, norms, grid, group_size, signs)
    if check_values:
        V.check_signs_values("gemv_lattice_k", signs)
    return torch.ops.kvkernels.gemv_lattice_k.default(q, codes, norms, grid, group_size, signs)


def gemv_lattice_v(
    p: torch.Tensor,
    codes: torch.Tensor,
    norms: torch.Tensor,
    grid: torch.Tensor,
    group_size: int,
    signs: torch.Tensor | None = None,
    check_values: bool = False,
) -> torch.Tensor:
    """Attention output on lattice codes: out[b,h,(t)] = sum_n p[b,h,(t),n] x_hat[b,h_kv,n], h_kv = h // (H_q / H_kv).

    Computed in the rotated domain, s * H_n (sum_n p[n] r16[n,g] grid[c_{n,g}]) per group: one inverse transform
    per output row. p [B, H_q, N] or [B, H_q, T, N]; codes int32 [B, H_kv, N, D*bits/32]; norms fp16
    [B, H_kv, N, D/G]. Returns fp32 [B, H_q, (T,) D] (zeros when N == 0). No sync unless check_values (signs +-1).
    """
    require_c("gemv_lattice_v")
    V.check_gemv_lattice_v(p, codes, norms, grid, group_size, signs)
    if check_values:
        V.check_signs_values("gemv_lattice_v", signs)
    return torch.ops.kvkernels.gemv_lattice_v.default(p, codes, norms, grid, group_size, signs)


def aqua_reconstruct(
    prev: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    codes: torch.Tensor,
    norms: torch.Tensor,
    grid: torch.Tensor,
    group_size: int,
    signs: torch.Tensor | None = None,
    prev2: torch.Tensor | None = None,
    weight2: torch.Tensor | None = None,
) -> torch.Tensor:
    """AQUA-KV reconstruction of T tokens: ((prev @ weight^T + prev2 @ weight2^T) + bias) + deq(codes, norms), fp32.

    prev [T, C_in] and weight [C, C_in] in one float dtype (prev2 [T, C_in2] / weight2 [C, C_in2] likewise, both or
    neither: the value predictor's [k_hat ; v_prev_hat] input as two accumulating GEMMs); bias fp32 [C]; codes int32
    [T, C*bits/32] and norms fp16 [T, C/G] of the lattice-quantized residual (grid, group_size, signs as
    lattice_dequantize). Returns fp32 [T, C]. No value checks (no sync): non-finite inputs give non-finite rows.
    """
    require_c("aqua_reconstruct")
    V.check_aqua_reconstruct(prev, weight, bias, codes, norms, grid, group_size, signs, prev2, weight2)
    return torch.ops.kvkernels.aqua_reconstruct.default(
        prev, weight, bias, codes, norms, grid, group_size, signs, prev2, weight2
    )


def decode_attention_fused(
    x: torch.Tensor,
    sink_keys: torch.Tensor,
    sink_values: torch.Tensor,
    key_codes: torch.Tensor,
    key_scales: torch.Tensor,
    key_zeros: torch.Tensor | None,
    value_codes: torch.Tensor,
    value_scales: torch.Tensor,
    value_zeros: torch.Tensor | None,
    key_tail: torch.Tensor,
    value_tail: torch.Tensor,
    key_bits: int,
    key_mode: str,
    key_layout: str,
    value_bits: int,
    value_mode: str,
    value_layout: str,
    group_size: int,
    key_x_scale: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    split_tokens: int = 0,
    lengths: torch.Tensor | None = None,
    q_scale: float = 1.0,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """softmax(x' K^T + mask) V over one layer's sink | quantized store | tail, in one op: [B, H_q, T, D].

    x [B, H_q, T, D] (fp16, bf16 or fp32) are the queries and q_scale the softmax scale: the scores take x' =
    x.to(fp32) * q_scale (one fp32 multiply); the result is computed in fp32 and returned in out_dtype (None: fp32;
    fp16 / bf16: rounded once to nearest). kvkernels.decode_attention passes q, its scale and q.dtype, which is
    bit-identical to passing q.to(fp32) * scale and converting the fp32 result, in three fewer elementwise kernels.
    sink_* [B, H_kv, S, D] and *_tail [B, H_kv, n, D] share one
    float dtype; each store is codes / scales / zeros in layout "rows" (token-major, groups along channels) or
    "cols" (channel-major, groups along tokens), with stored keys = K / key_x_scale when key_x_scale [H_kv, D] is
    given. attn_mask: additive fp32 [B|1, H_q|1, T, N], None = causal among the last T tokens. split_tokens: tokens
    per split-KV chunk (multiple of G; 0 = planned); it changes rounding order only (the CUDA op's KIVI tiles also
    round KIVI's dequantized tokens to fp16, as gemv_kivi: kvkernels/reference/attention.py). lengths: int64 [5] on the
    device, the tokens used of (sink, key store, key tail, value store, value tail); the parts are then capacity
    buffers, the mask [B|1, H_q|1, T, M] spans at least the tokens they can hold, and no token count is read on the
    host (CUDA-graph capturable; kvkernels.static_cache). Spec and shapes:
    kvkernels/reference/attention.py. kvkernels.decode_attention calls this with a cache's operands
    (QuantizedLayerCache.fused_attention_operands).
    """
    require_c("decode_attention_fused")
    args = (
        x, sink_keys, sink_values, key_codes, key_scales, key_zeros, value_codes, value_scales, value_zeros,
        key_tail, value_tail, key_bits, key_mode, key_layout, value_bits, value_mode, value_layout, group_size,
        key_x_scale, attn_mask, split_tokens, lengths, q_scale, out_dtype,
    )  # fmt: skip
    V.check_decode_attention_fused(*args)
    return torch.ops.kvkernels.decode_attention_fused.default(*args)


def static_append(
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    sink_keys: torch.Tensor,
    sink_values: torch.Tensor,
    key_codes: torch.Tensor,
    key_scales: torch.Tensor,
    key_zeros: torch.Tensor | None,
    value_codes: torch.Tensor,
    value_scales: torch.Tensor,
    value_zeros: torch.Tensor | None,
    key_tail: torch.Tensor,
    value_tail: torch.Tensor,
    key_bits: int,
    key_mode: str,
    key_layout: str,
    key_eta: float,
    value_bits: int,
    value_mode: str,
    value_layout: str,
    value_eta: float,
    group_size: int,
    w_recent: int,
    key_x_scale: torch.Tensor | None = None,
) -> None:
    """Append k / v [B, H_kv, n, D] (the windows' dtype) to a static cache in place: decode_attention_fused's lengths=
    operands as capacity buffers, lengths int64 [5] on the device. The first tokens fill the sink while it has room,
    the rest join the tails, and each tail's oldest tokens past w_recent (whole groups of G for a "cols" store) are
    quantized into its store at its count (keys stored as K / key_x_scale), bit-identical to quantize_groups; the
    counts grow. No count is read on the host (CUDA-graph capturable). The compiled CUDA op is two launches (group
    sizes up to ~3400 in hybrid mode, ~5100 otherwise: a quantizing thread's shared memory); elsewhere the reference
    (fixed-shape PyTorch ops). Spec, and the capacity preconditions that only the device can check (the CUDA kernel
    traps where they fail): kvkernels/reference/static_append.py. StaticLayerCache.append calls it."""
    require_c("static_append")
    args = (
        k, v, lengths, sink_keys, sink_values, key_codes, key_scales, key_zeros, value_codes, value_scales,
        value_zeros, key_tail, value_tail, key_bits, key_mode, key_layout, float(key_eta), value_bits, value_mode,
        value_layout, float(value_eta), group_size, w_recent, key_x_scale,
    )  # fmt: skip
    V.check_static_append(*args)
    torch.ops.kvkernels.static_append.default(*args)
