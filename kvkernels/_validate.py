"""Argument checks shared by the public wrappers and the Python-registered kernels.

Each failure names the argument and what was expected: TypeError for dtypes, ValueError for everything else.
Only metadata is inspected (no device sync), so the checks are free to run on every call.
"""

import itertools
import math

import torch

from .reference.lattice import GRID_BITS

SUPPORTED_BITS = (1, 2, 3, 4)
MODES = ("sym", "asym", "hybrid")
FLOAT_ACTIVATIONS = (torch.float16, torch.bfloat16, torch.float32)
BLOCK = 32


def _fail(op: str, msg: str, exc=ValueError):
    raise exc(f"kvkernels.{op}: {msg}")


def is_int(v) -> bool:
    """A Python int that is not a bool (True would pass isinstance(v, int) as 1)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    """An int or float that is not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_bits(op: str, bits: int) -> None:
    if not is_int(bits) or bits not in SUPPORTED_BITS:
        _fail(op, f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")


def check_mode(op: str, mode: str) -> None:
    if mode not in MODES:
        _fail(op, f"mode must be one of {MODES}, got {mode!r}")


def check_group_size(op: str, group_size: int, length: int, what: str) -> None:
    if not is_int(group_size):
        _fail(op, f"group_size must be an int, got {group_size!r}", TypeError)
    if group_size <= 0 or group_size % BLOCK:
        _fail(op, f"group_size must be a positive multiple of {BLOCK}, got {group_size}")
    if length % group_size:
        _fail(op, f"{what}={length} must be a multiple of group_size={group_size}")


def check_dtype(op: str, name: str, t: torch.Tensor, allowed) -> None:
    allowed = allowed if isinstance(allowed, tuple) else (allowed,)
    if t.dtype not in allowed:
        names = " or ".join(str(a).removeprefix("torch.") for a in allowed)
        _fail(op, f"{name} must be {names}, got {str(t.dtype).removeprefix('torch.')}", TypeError)


def check_shape(op: str, name: str, t: torch.Tensor, expected: tuple) -> None:
    if tuple(t.shape) != tuple(expected):
        _fail(op, f"{name} must have shape {list(expected)}, got {list(t.shape)}")


def check_last_dim_contiguous(op: str, name: str, t: torch.Tensor) -> None:
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        _fail(op, f"{name} must have stride 1 in its last dim (row strides may be anything), got {t.stride()}")


def check_tensors(op: str, **tensors) -> None:
    """Each named argument is a tensor (optional ones are checked where they are not None)."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            _fail(op, f"{name} must be a tensor, got {type(t).__name__}", TypeError)


def check_same_device(op: str, **tensors) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        _fail(op, f"all tensors must be on one device, got {devices}")


def _check_x(op: str, x: torch.Tensor, name: str = "x", last: str = "L") -> None:
    if x.dim() not in (3, 4):
        _fail(op, f"{name} must be [B, H_q, {last}] or [B, H_q, T, {last}], got shape {list(x.shape)}")
    check_dtype(op, name, x, FLOAT_ACTIVATIONS)
    check_last_dim_contiguous(op, name, x)


def _check_kv_heads(op: str, x: torch.Tensor, codes: torch.Tensor, name: str = "x") -> None:
    if codes.dim() != 4:
        _fail(op, f"codes must be 4-D [B, H_kv, rows, words], got shape {list(codes.shape)}")
    check_dtype(op, "codes", codes, torch.int32)
    check_last_dim_contiguous(op, "codes", codes)
    if codes.shape[0] != x.shape[0]:
        _fail(op, f"codes batch {codes.shape[0]} != {name} batch {x.shape[0]}")
    if codes.shape[1] == 0 or x.shape[1] % codes.shape[1]:
        _fail(op, f"query heads H_q={x.shape[1]} must be a multiple of KV heads H_kv={codes.shape[1]}")


def _check_group_params(op, scales, zeros, expected, needs_zeros: bool) -> None:
    check_dtype(op, "scales", scales, torch.float16)
    check_shape(op, "scales", scales, expected)
    check_last_dim_contiguous(op, "scales", scales)
    if zeros is None:
        if needs_zeros:
            _fail(op, "zeros is required for asym and hybrid modes")
        return
    check_dtype(op, "zeros", zeros, torch.float16)
    check_shape(op, "zeros", zeros, expected)
    check_last_dim_contiguous(op, "zeros", zeros)


def check_gemv_inner_q(x, codes, scales, zeros, bits, group_size, mode, x_scale=None, *, op="gemv_inner_q") -> None:
    check_tensors(op, x=x, codes=codes, scales=scales)
    check_bits(op, bits)
    check_mode(op, mode)
    _check_x(op, x)
    _check_kv_heads(op, x, codes)
    L = x.shape[-1]
    check_group_size(op, group_size, L, "x.shape[-1] (L)")
    B, H_kv, M = codes.shape[:3]
    if codes.shape[-1] != L // BLOCK * bits:
        _fail(op, f"codes must hold L*bits/32 = {L // BLOCK * bits} words per row for L={L}, got {codes.shape[-1]}")
    _check_group_params(op, scales, zeros, (B, H_kv, M, L // group_size), mode != "sym")
    if x_scale is not None:
        check_dtype(op, "x_scale", x_scale, torch.float32)
        check_shape(op, "x_scale", x_scale, (H_kv, L))
        check_last_dim_contiguous(op, "x_scale", x_scale)
    check_same_device(op, x=x, codes=codes, scales=scales, zeros=zeros, x_scale=x_scale)


def check_gemv_kivi(x, codes, scales, zeros, bits, group_size, *, op="gemv_kivi") -> None:
    check_tensors(op, x=x, codes=codes, scales=scales, zeros=zeros)
    check_bits(op, bits)
    _check_x(op, x)
    _check_kv_heads(op, x, codes)
    B, H_kv, R, W = codes.shape
    if R != x.shape[-1]:
        _fail(op, f"codes rows R={R} must equal x.shape[-1]={x.shape[-1]}")
    if W % bits:
        _fail(op, f"codes last dim {W} must be a multiple of bits={bits}")
    C = W // bits * BLOCK
    check_group_size(op, group_size, C, "C (columns)")
    _check_group_params(op, scales, zeros, (B, H_kv, R, C // group_size), True)
    check_same_device(op, x=x, codes=codes, scales=scales, zeros=zeros)


def _check_gemv_out(op: str, out, n: int, x_in, workspace, **inputs) -> None:
    """out of the GEMVs' _into forms (fp32, the result's shape with last dim n, x's device, stride 1 in the last dim,
    no self-overlap, no memory shared with an input) and the optional workspace (fp32, contiguous, x's device)."""
    check_tensors(op, out=out)
    check_dtype(op, "out", out, torch.float32)
    check_shape(op, "out", out, (*x_in.shape[:-1], n))
    check_last_dim_contiguous(op, "out", out)
    check_no_self_overlap(op, "out", out)
    if workspace is not None:
        check_tensors(op, workspace=workspace)
        check_dtype(op, "workspace", workspace, torch.float32)
        if not workspace.is_contiguous():
            _fail(op, "workspace must be contiguous")
        inputs["workspace"] = workspace
    for name, t in inputs.items():
        if t is not None and torch._C._is_alias_of(out, t):
            _fail(op, f"out must not share memory with {name}")
    check_same_device(op, x=x_in, out=out, workspace=workspace)


def check_gemv_inner_q_into(
    x, codes, scales, zeros, bits, group_size, quant_mode, x_scale, out, workspace=None
) -> None:
    op = "gemv_inner_q_into"
    check_gemv_inner_q(x, codes, scales, zeros, bits, group_size, quant_mode, x_scale, op=op)
    _check_gemv_out(
        op, out, codes.shape[2], x, workspace, x=x, codes=codes, scales=scales, zeros=zeros, x_scale=x_scale
    )


def check_gemv_kivi_into(x, codes, scales, zeros, bits, group_size, out, workspace=None) -> None:
    op = "gemv_kivi_into"
    check_gemv_kivi(x, codes, scales, zeros, bits, group_size, op=op)
    n = codes.shape[-1] // bits * BLOCK
    _check_gemv_out(op, out, n, x, workspace, x=x, codes=codes, scales=scales, zeros=zeros)


def check_gemv_workspace_numel(gemv, x, codes, scales, zeros, bits, group_size, mode="asym", x_scale=None) -> None:
    op = "gemv_workspace_numel"
    if gemv == "gemv_inner_q":
        check_gemv_inner_q(x, codes, scales, zeros, bits, group_size, mode, x_scale, op=op)
    elif gemv == "gemv_kivi":
        if mode != "asym" or x_scale is not None:
            extra = " and an x_scale" if x_scale is not None else ""
            _fail(op, f"gemv_kivi is asym without x_scale, got mode={mode!r}{extra}")
        check_gemv_kivi(x, codes, scales, zeros, bits, group_size, op=op)
    else:
        _fail(op, f"op must be 'gemv_inner_q' or 'gemv_kivi', got {gemv!r}")


def check_quantize(op: str, x, bits, group_size, mode, eta) -> None:
    check_tensors(op, x=x)
    check_bits(op, bits)
    check_mode(op, mode)
    check_dtype(op, "x", x, FLOAT_ACTIVATIONS)
    if x.dim() < 1:
        _fail(op, "x must have at least one dim")
    check_group_size(op, group_size, x.shape[-1], "x.shape[-1]")
    check_eta(op, eta, mode)


def check_eta(op: str, eta, mode: str, tensor: str = "") -> None:
    """The asym calibration eta: a float in [0, 0.5), 0 unless mode is asym (tensor: "key" / "value" for a cache's
    two stores, prefixing the names)."""
    name, mode_name = (f"{tensor}_eta", f"{tensor}_mode") if tensor else ("eta", "mode")
    if not is_number(eta):
        _fail(op, f"{name} must be a float, got {eta!r}", TypeError)
    if not 0.0 <= eta < 0.5:
        _fail(op, f"{name} must be in [0, 0.5), got {eta}")
    if eta and mode != "asym":
        _fail(op, f"{name} applies to asym mode only, got {mode_name}={mode!r} with eta={eta}")


FP16_SCALE_LIMIT = 60000.0  # below fp16's 65504 with room for the rounding of s and of z + eta * s * (2^b - 1)
VALUE_CHECK_CHUNK = 1 << 24  # elements per pass of check_values: bounds its temporaries to ~100 MB


def _leading_chunks(t: torch.Tensor, limit: int):
    """Views of t split along its leading dims, each of at most `limit` elements (or one last-dim row)."""
    if t.numel() <= limit or t.dim() == 1:
        yield t
        return
    row = t.numel() // t.shape[0]
    if row > limit:  # one index of dim 0 is still too big: split the next dim
        for i in range(t.shape[0]):
            yield from _leading_chunks(t[i], limit)
        return
    step = limit // row
    for start in range(0, t.shape[0], step):
        yield t[start : start + step]


def check_values(op: str, x: torch.Tensor, bits: int, group_size: int, mode: str) -> None:
    """Reject input whose groups would store a non-finite or overflowing fp16 scale or zero (one device sync).

    sym stores s = max|x| / 2^(b-1) (at most max|x|); asym stores z = min and s = (max - min) / (2^b - 1), which
    at 1 bit is the full range: a group spanning -40000..40000 has |x| < 65504 but s = 80000 = inf in fp16.
    Hybrid falls back to sym where asym's scale overflows, so it needs only the sym bound. Per-group min/max
    are reduced in chunks of the leading dims, so the temporaries stay small whatever the size of x.
    """
    if not x.numel() or x.device.type == "meta":  # no data (shape checks still ran): nothing to read
        return
    worst_abs = worst_scale = None
    qmax = float(2**bits - 1)
    for part in _leading_chunks(x.detach(), VALUE_CHECK_CHUNK):
        lo, hi = part.unflatten(-1, (-1, group_size)).aminmax(dim=-1)
        lo, hi = lo.float(), hi.float()
        part_abs = torch.maximum(hi.abs().amax(), lo.abs().amax())  # NaN propagates through amax and maximum
        worst_abs = part_abs if worst_abs is None else torch.maximum(worst_abs, part_abs)
        if mode == "asym":
            part_scale = ((hi - lo) / qmax).amax()
            worst_scale = part_scale if worst_scale is None else torch.maximum(worst_scale, part_scale)
    worst_abs = float(worst_abs) if worst_scale is None else float(torch.maximum(worst_abs, worst_scale))
    if worst_abs != worst_abs or worst_abs == float("inf"):
        _fail(op, "x contains NaN or Inf; quantizing it would poison its group's scale")
    if worst_abs > FP16_SCALE_LIMIT:
        what = "|x|" if worst_scale is None else "|x| or a group's (max - min) / (2^bits - 1)"
        _fail(op, f"{what} reaches {worst_abs:.3g}; scales and zeros are fp16 and must stay below {FP16_SCALE_LIMIT:g}")


def check_no_self_overlap(op: str, name: str, t: torch.Tensor) -> None:
    """An output written in place must not alias itself (an expand()ed buffer, rows closer than a row's length):
    the kernels would race on the shared words. Same rule as csrc/op_checks.h check_no_self_overlap: sorted by
    stride, every dim of size > 1 must step past the span of the smaller-stride dims."""
    if not t.numel():
        return
    span, ok = 0, True
    for stride, size in sorted((t.stride(d), t.shape[d]) for d in range(t.dim()) if t.shape[d] > 1):
        ok = ok and stride > span
        span += stride * (size - 1)
    if not ok:
        _fail(
            op,
            f"{name} must not overlap itself (no stride 0 or overlapping rows), "
            f"got shape {list(t.shape)} and strides {list(t.stride())}",
        )


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return t.storage_offset() * t.element_size(), (t.storage_offset() + last + 1) * t.element_size()


def check_disjoint(op: str, name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    """a and b must not share bytes (an op's outputs with each other and with its input). Conservative, as
    csrc/op_checks.h check_disjoint: same storage and intersecting byte spans are refused. Reads no data."""
    if torch.compiler.is_compiling():  # dynamo cannot trace _is_alias_of; the op's kernels check when they run
        return
    if not a.numel() or not b.numel() or not torch._C._is_alias_of(a, b):
        return
    (a0, a1), (b0, b1) = _byte_span(a), _byte_span(b)
    if a1 > b0 and b1 > a0:
        _fail(op, f"{name_a} and {name_b} must not share memory (their byte ranges in one buffer overlap): "
                  "give each its own buffer")  # fmt: skip


def check_quantize_into(x, bits, group_size, mode, eta, codes, scales, zeros) -> None:
    op = "quantize_groups_into"
    check_tensors(op, x=x, codes=codes, scales=scales, zeros=zeros)
    check_quantize(op, x, bits, group_size, mode, eta)
    lead = tuple(x.shape[:-1])
    L = x.shape[-1]
    check_dtype(op, "codes", codes, torch.int32)
    check_shape(op, "codes", codes, lead + (L // BLOCK * bits,))
    check_last_dim_contiguous(op, "codes", codes)
    _check_group_params(op, scales, zeros, lead + (L // group_size,), True)
    for name, t in (("codes", codes), ("scales", scales), ("zeros", zeros)):
        check_no_self_overlap(op, name, t)
    named = (("x", x), ("codes", codes), ("scales", scales), ("zeros", zeros))
    for (name_a, a), (name_b, b) in itertools.combinations(named, 2):
        check_disjoint(op, name_a, a, name_b, b)
    check_same_device(op, x=x, codes=codes, scales=scales, zeros=zeros)


def check_dequantize(codes, scales, zeros, bits, group_size, mode) -> None:
    op = "dequantize_groups"
    check_tensors(op, codes=codes, scales=scales)
    check_bits(op, bits)
    check_mode(op, mode)
    check_dtype(op, "codes", codes, torch.int32)
    if codes.dim() < 1 or codes.shape[-1] % bits:
        _fail(op, f"codes last dim must be a multiple of bits={bits}, got shape {list(codes.shape)}")
    L = codes.shape[-1] // bits * BLOCK
    check_group_size(op, group_size, L, "L")
    _check_group_params(op, scales, zeros, tuple(codes.shape[:-1]) + (L // group_size,), mode != "sym")
    check_same_device(op, codes=codes, scales=scales, zeros=zeros)


def check_pack(codes, bits) -> None:
    op = "pack_bits"
    check_tensors(op, codes=codes)
    check_bits(op, bits)
    if codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool:
        _fail(op, f"codes must be an integer tensor, got {codes.dtype}", TypeError)
    if codes.dim() < 1 or codes.shape[-1] % BLOCK:
        _fail(op, f"codes last dim must be a multiple of {BLOCK}, got shape {list(codes.shape)}")


def check_unpack(packed, bits) -> None:
    op = "unpack_bits"
    check_tensors(op, packed=packed)
    check_bits(op, bits)
    check_dtype(op, "packed", packed, torch.int32)
    if packed.dim() < 1 or packed.shape[-1] % bits:
        _fail(op, f"packed last dim must be a multiple of bits={bits}, got shape {list(packed.shape)}")


# ---- lattice (HIGGS-style) ops: docs/FORMATS.md "Lattice" ---------------------------------------------------------

LATTICE_GRIDS = GRID_BITS  # grid (d, n) -> bits per value, log2(n) / d: the reference's table (the spec)
LATTICE_GROUP_RANGE = (32, 1024)  # group_size: a power of two in this range (the Hadamard block)


def check_lattice_grid(op: str, grid) -> int:
    """grid is fp32 [n, d] with (d, n) in LATTICE_GRIDS; returns bits per value (what sizes every other argument)."""
    check_tensors(op, grid=grid)
    check_dtype(op, "grid", grid, torch.float32)
    shapes = [[n, d] for d, n in LATTICE_GRIDS]
    # int(): under torch.compile's dynamic shapes a size is a SymInt, which cannot be hashed (this specializes it)
    d_n = (int(grid.shape[1]), int(grid.shape[0])) if grid.dim() == 2 else None
    if d_n not in LATTICE_GRIDS:
        _fail(op, f"grid must be [n, d] with [n, d] one of {shapes}, got shape {list(grid.shape)}")
    check_last_dim_contiguous(op, "grid", grid)
    return LATTICE_GRIDS[d_n]


def check_lattice_group_size(op: str, group_size: int, length: int, what: str) -> None:
    lo, hi = LATTICE_GROUP_RANGE
    if not isinstance(group_size, int | torch.SymInt) or not lo <= group_size <= hi or group_size & (group_size - 1):
        _fail(op, f"group_size must be a power of two in [{lo}, {hi}], got {group_size}")
    if length % group_size:
        _fail(op, f"{what}={length} must be a multiple of group_size={group_size}")


def check_signs(op: str, signs, group_size: int) -> None:
    """signs: None or int8 [group_size] (values +-1: check_signs_values, which syncs)."""
    if signs is None:
        return
    check_tensors(op, signs=signs)
    check_dtype(op, "signs", signs, torch.int8)
    check_shape(op, "signs", signs, (group_size,))
    check_last_dim_contiguous(op, "signs", signs)


def _check_norms_signs(op: str, norms, expected: tuple, signs, group_size: int) -> None:
    # the per-group side inputs of every op that reads codes: fp16 norms of the given shape, optional signs
    check_dtype(op, "norms", norms, torch.float16)
    check_shape(op, "norms", norms, expected)
    check_last_dim_contiguous(op, "norms", norms)
    check_signs(op, signs, group_size)


def _check_lattice_rows(op: str, x, group_size: int, signs) -> None:
    # x [..., C] of values to rotate / quantize in groups of group_size
    check_dtype(op, "x", x, FLOAT_ACTIVATIONS)
    if x.dim() < 1:
        _fail(op, "x must have at least one dim")
    check_last_dim_contiguous(op, "x", x)
    check_lattice_group_size(op, group_size, x.shape[-1], "x.shape[-1]")
    check_signs(op, signs, group_size)


def _check_lattice_gemv(op: str, name: str, x, last: str, codes, norms, grid) -> int:
    # a GEMV's activations `name` [B, H_q, (T,) last] against codes [B, H_kv, N, W]; returns bits per value
    check_tensors(op, **{name: x}, codes=codes, norms=norms)
    bits = check_lattice_grid(op, grid)
    _check_x(op, x, name, last)
    _check_kv_heads(op, x, codes, name)
    return bits


def check_fwht(x, group_size, signs=None, inverse=False) -> None:
    op = "fwht"
    check_tensors(op, x=x)
    _check_lattice_rows(op, x, group_size, signs)
    check_same_device(op, x=x, signs=signs)


def check_lattice_quantize(x, grid, group_size, signs=None) -> None:
    op = "lattice_quantize"
    check_tensors(op, x=x)
    check_lattice_grid(op, grid)
    _check_lattice_rows(op, x, group_size, signs)
    check_same_device(op, x=x, grid=grid, signs=signs)


def check_lattice_dequantize(codes, norms, grid, group_size, signs=None) -> None:
    op = "lattice_dequantize"
    check_tensors(op, codes=codes, norms=norms)
    bits = check_lattice_grid(op, grid)
    check_dtype(op, "codes", codes, torch.int32)
    if codes.dim() < 1 or codes.shape[-1] % bits:
        _fail(op, f"codes last dim must be a multiple of bits={bits}, got shape {list(codes.shape)}")
    check_last_dim_contiguous(op, "codes", codes)
    C = codes.shape[-1] // bits * BLOCK
    check_lattice_group_size(op, group_size, C, "C (values per row)")
    _check_norms_signs(op, norms, (*codes.shape[:-1], C // group_size), signs, group_size)
    check_same_device(op, codes=codes, norms=norms, grid=grid, signs=signs)


def check_gemv_lattice_k(q, codes, norms, grid, group_size, signs=None) -> None:
    op = "gemv_lattice_k"
    bits = _check_lattice_gemv(op, "q", q, "D", codes, norms, grid)
    B, H_kv, N, W = codes.shape
    D = q.shape[-1]
    check_lattice_group_size(op, group_size, D, "q.shape[-1] (D)")
    if W != D // BLOCK * bits:
        _fail(op, f"codes must hold D*bits/32 = {D // BLOCK * bits} words per row for D={D}, got {W}")
    _check_norms_signs(op, norms, (B, H_kv, N, D // group_size), signs, group_size)
    check_same_device(op, q=q, codes=codes, norms=norms, grid=grid, signs=signs)


def check_gemv_lattice_v(p, codes, norms, grid, group_size, signs=None) -> None:
    op = "gemv_lattice_v"
    bits = _check_lattice_gemv(op, "p", p, "N", codes, norms, grid)
    B, H_kv, N, W = codes.shape
    if N != p.shape[-1]:
        _fail(op, f"codes tokens N={N} must equal p.shape[-1]={p.shape[-1]}")
    if W % bits:
        _fail(op, f"codes last dim {W} must be a multiple of bits={bits}")
    D = W // bits * BLOCK
    check_lattice_group_size(op, group_size, D, "D (values per token)")
    _check_norms_signs(op, norms, (B, H_kv, N, D // group_size), signs, group_size)
    check_same_device(op, p=p, codes=codes, norms=norms, grid=grid, signs=signs)


def check_signs_values(op: str, signs) -> None:
    """Every sign is +1 or -1 (one device sync). The ops multiply by what signs hold: a 0 would zero a channel."""
    if signs is None or not signs.numel() or signs.device.type == "meta":
        return
    bad = (signs != 1) & (signs != -1)
    if bool(bad.any()):
        _fail(op, f"signs must hold only +1 and -1, got {sorted(set(signs[bad].tolist()))[:5]}")


def check_lattice_values(op: str, x: torch.Tensor, group_size: int) -> None:
    """Reject x with NaN/Inf, or a group whose RMS would overflow the fp16 norm (one device sync; chunked as
    check_values). Without this check such a group stores a NaN/Inf norm and index 0 (FORMATS.md NaN policy)."""
    if not x.numel() or x.device.type == "meta":
        return
    worst_abs = worst_rms = None
    for part in _leading_chunks(x.detach(), VALUE_CHECK_CHUNK):
        xg = part.unflatten(-1, (-1, group_size)).float()
        part_abs = xg.abs().amax()  # NaN propagates through amax
        part_rms = (xg.square().mean(-1)).sqrt().amax()
        worst_abs = part_abs if worst_abs is None else torch.maximum(worst_abs, part_abs)
        worst_rms = part_rms if worst_rms is None else torch.maximum(worst_rms, part_rms)
    worst_abs, worst_rms = float(worst_abs), float(worst_rms)
    if worst_abs != worst_abs or worst_abs == float("inf"):
        _fail(op, "x contains NaN or Inf; quantizing it would poison its group's norm")
    if worst_rms > FP16_SCALE_LIMIT:
        _fail(op, f"a group's RMS reaches {worst_rms:.3g}; norms are fp16 and must stay below {FP16_SCALE_LIMIT:g}")


# ---- AQUA-KV reconstruction: docs/FORMATS.md "AQUA-KV" ------------------------------------------------------------


def _check_matrix(op: str, name: str, t, rows: int | None, dtype=None) -> None:
    # a 2-D operand of a GEMM [rows, cols] (rows None: any), last dim contiguous, optionally of a given dtype
    if t.dim() != 2:
        _fail(op, f"{name} must be 2-D, got shape {list(t.shape)}")
    check_dtype(op, name, t, FLOAT_ACTIVATIONS if dtype is None else dtype)
    check_last_dim_contiguous(op, name, t)
    if rows is not None and t.shape[0] != rows:
        _fail(op, f"{name} must have {rows} rows, got shape {list(t.shape)}")


def check_aqua_reconstruct(
    prev, weight, bias, codes, norms, grid, group_size, signs=None, prev2=None, weight2=None
) -> None:
    """prev [T, C_in] @ weight [C, C_in]^T (+ prev2 [T, C_in2] @ weight2 [C, C_in2]^T) + bias fp32 [C] + the lattice
    dequantization of codes int32 [T, C*bits/32] / norms fp16 [T, C/G]. The GEMM operands share one float dtype
    (a tensor-core dot takes one input type)."""
    op = "aqua_reconstruct"
    check_tensors(op, prev=prev, weight=weight, bias=bias, codes=codes, norms=norms)
    bits = check_lattice_grid(op, grid)
    _check_matrix(op, "prev", prev, None)
    T = prev.shape[0]
    _check_matrix(op, "weight", weight, None, prev.dtype)
    C, C_in = weight.shape
    if prev.shape[1] != C_in:
        _fail(op, f"prev [T, C_in] and weight [C, C_in] disagree on C_in: {list(prev.shape)} vs {list(weight.shape)}")
    check_dtype(op, "bias", bias, torch.float32)
    check_shape(op, "bias", bias, (C,))
    check_lattice_group_size(op, group_size, C, "C (weight.shape[0])")
    check_dtype(op, "codes", codes, torch.int32)
    check_shape(op, "codes", codes, (T, C // BLOCK * bits))
    check_last_dim_contiguous(op, "codes", codes)
    _check_norms_signs(op, norms, (T, C // group_size), signs, group_size)
    if (prev2 is None) != (weight2 is None):
        _fail(op, "prev2 and weight2 come together (the second input of the value predictor): give both or neither")
    if prev2 is not None:
        check_tensors(op, prev2=prev2, weight2=weight2)
        _check_matrix(op, "prev2", prev2, T, prev.dtype)
        _check_matrix(op, "weight2", weight2, C, prev.dtype)
        if prev2.shape[1] != weight2.shape[1]:
            _fail(op, f"prev2 [T, C_in2] and weight2 [C, C_in2] disagree: {list(prev2.shape)} vs {list(weight2.shape)}")
    check_same_device(
        op, prev=prev, weight=weight, bias=bias, codes=codes, norms=norms, grid=grid, signs=signs, prev2=prev2,
        weight2=weight2,
    )  # fmt: skip


# ---- fused decode attention: kvkernels/reference/attention.py ------------------------------------------------------

LAYOUTS = ("rows", "cols")
MAX_ATTENTION_GROUP = 1 << 20


def _check_window(op: str, name: str, t, batch: int, heads: int, head_dim: int, dtype) -> int:
    # a window-dtype part [B, H_kv, n, D] of the cache (sink or tail); returns n
    if t.dim() != 4 or (t.shape[0], t.shape[1], t.shape[3]) != (batch, heads, head_dim):
        _fail(op, f"{name} must be [B={batch}, H_kv={heads}, n, D={head_dim}], got shape {list(t.shape)}")
    check_dtype(op, name, t, dtype)
    check_last_dim_contiguous(op, name, t)
    return t.shape[2]


def store_token_count(codes: torch.Tensor, bits: int, layout: str) -> int:
    """Tokens a quantized store of the fused attention op holds: the rows of a "rows" store, the columns (words * 32
    / bits) of a "cols" one."""
    return codes.shape[2] if layout == "rows" else codes.shape[3] // bits * BLOCK


def _check_store(op: str, tensor: str, codes, scales, zeros, bits, mode, layout, group_size, batch, heads, D) -> int:
    """One quantized store of the fused attention op (layout "rows" or "cols"); returns its token count."""
    pre = f"{tensor}_"
    if bits not in SUPPORTED_BITS:
        _fail(op, f"{pre}bits must be one of {SUPPORTED_BITS}, got {bits!r}")
    if mode not in MODES:
        _fail(op, f"{pre}mode must be one of {MODES}, got {mode!r}")
    if layout not in LAYOUTS:
        _fail(op, f"{pre}layout must be one of {LAYOUTS}, got {layout!r}")
    check_dtype(op, f"{pre}codes", codes, torch.int32)
    check_last_dim_contiguous(op, f"{pre}codes", codes)
    if codes.dim() != 4 or tuple(codes.shape[:2]) != (batch, heads):
        _fail(op, f"{pre}codes must be 4-D [B={batch}, H_kv={heads}, rows, words], got shape {list(codes.shape)}")
    m = store_token_count(codes, bits, layout)
    if layout == "rows":
        words = D // BLOCK * bits
        if codes.shape[3] != words:
            _fail(op, f"{pre}codes (layout rows) must hold D*bits/32 = {words} words per token, got {codes.shape[3]}")
        groups = (batch, heads, m, D // group_size)
    else:
        if codes.shape[2] != D:
            _fail(op, f"{pre}codes (layout cols) must be [B, H_kv, D={D}, m*bits/32], got shape {list(codes.shape)}")
        if codes.shape[3] % bits:
            _fail(op, f"{pre}codes last dim {codes.shape[3]} must be a multiple of bits={bits}")
        if m % group_size:
            _fail(op, f"{pre}store (layout cols) holds {m} tokens, not a multiple of group_size={group_size}")
        groups = (batch, heads, D, m // group_size)
    for name, t in ((f"{pre}scales", scales), (f"{pre}zeros", zeros)):
        if t is None:
            if name.endswith("zeros") and mode != "sym":
                _fail(op, f"{name} is required for asym and hybrid modes")
            continue
        check_dtype(op, name, t, torch.float16)
        check_shape(op, name, t, groups)
        check_last_dim_contiguous(op, name, t)
    return m


def check_decode_attention_fused(
    x, sink_keys, sink_values, key_codes, key_scales, key_zeros, value_codes, value_scales, value_zeros,
    key_tail, value_tail, key_bits, key_mode, key_layout, value_bits, value_mode, value_layout, group_size,
    key_x_scale=None, attn_mask=None, split_tokens=0, lengths=None, q_scale=1.0, out_dtype=None,
) -> None:  # fmt: skip
    op = "decode_attention_fused"
    check_tensors(
        op, x=x, sink_keys=sink_keys, sink_values=sink_values, key_codes=key_codes, key_scales=key_scales,
        value_codes=value_codes, value_scales=value_scales, key_tail=key_tail, value_tail=value_tail,
    )  # fmt: skip
    if x.dim() != 4:
        _fail(op, f"x must be [B, H_q, T, D], got shape {list(x.shape)}")
    check_dtype(op, "x", x, FLOAT_ACTIVATIONS)
    check_last_dim_contiguous(op, "x", x)
    B, H_q, T, D = x.shape
    if sink_keys.dim() != 4:
        _fail(op, f"sink_keys must be [B, H_kv, S, D], got shape {list(sink_keys.shape)}")
    H_kv = sink_keys.shape[1]
    if H_kv == 0 or H_q % H_kv:
        _fail(op, f"query heads H_q={H_q} must be a multiple of KV heads H_kv={H_kv}")
    check_dtype(op, "sink_keys", sink_keys, FLOAT_ACTIVATIONS)
    dt = sink_keys.dtype
    S = _check_window(op, "sink_keys", sink_keys, B, H_kv, D, dt)
    if _check_window(op, "sink_values", sink_values, B, H_kv, D, dt) != S:
        _fail(op, f"sink_values must match sink_keys {list(sink_keys.shape)}, got {list(sink_values.shape)}")
    n_kt = _check_window(op, "key_tail", key_tail, B, H_kv, D, dt)
    n_vt = _check_window(op, "value_tail", value_tail, B, H_kv, D, dt)
    if group_size <= 0 or group_size % BLOCK or group_size > MAX_ATTENTION_GROUP:
        # the bound: nothing else limits G when a token-grouped store is empty, and the kernels hold G in an int
        _fail(op, f"group_size must be a positive multiple of {BLOCK} up to {MAX_ATTENTION_GROUP}, got {group_size}")
    for tensor, layout in (("key", key_layout), ("value", value_layout)):
        if layout == "rows" and D % group_size:
            _fail(op, f"head_dim D={D} must be a multiple of group_size={group_size} ({tensor} store in layout rows)")
    mk = _check_store(
        op, "key", key_codes, key_scales, key_zeros, key_bits, key_mode, key_layout, group_size, B, H_kv, D
    )
    mv = _check_store(
        op,
        "value",
        value_codes,
        value_scales,
        value_zeros,
        value_bits,
        value_mode,
        value_layout,
        group_size,
        B,
        H_kv,
        D,
    )
    if lengths is not None:
        # device-side lengths: the parts are capacity buffers; what they hold is not read here (no device sync), and
        # the mask must span the most tokens they can hold
        check_dtype(op, "lengths", lengths, torch.int64)
        check_shape(op, "lengths", lengths, (5,))
        check_last_dim_contiguous(op, "lengths", lengths)
        N = S + min(mk + n_kt, mv + n_vt)
        if T < 1:
            _fail(op, f"x has T={T} query rows; need T >= 1")
    else:
        N = S + mk + n_kt
        if S + mv + n_vt != N:
            _fail(
                op, f"keys hold {N} tokens (sink {S} + store {mk} + tail {n_kt}) but values hold {S + mv + n_vt} "
                f"(sink {S} + store {mv} + tail {n_vt}); both must cover the same tokens",
            )  # fmt: skip
        if T < 1 or T > N:
            _fail(op, f"x has T={T} query rows; need 1 <= T <= N={N} (the rows are the last T cached tokens)")
    if key_x_scale is not None:
        check_dtype(op, "key_x_scale", key_x_scale, torch.float32)
        check_shape(op, "key_x_scale", key_x_scale, (H_kv, D))
        check_last_dim_contiguous(op, "key_x_scale", key_x_scale)
    if attn_mask is not None:
        check_dtype(op, "attn_mask", attn_mask, torch.float32)
        if (
            attn_mask.dim() != 4
            or attn_mask.shape[2] != T
            or (attn_mask.shape[3] < N if lengths is not None else attn_mask.shape[3] != N)
            or attn_mask.shape[0] not in (1, B)
            or attn_mask.shape[1] not in (1, H_q)
        ):
            cols = f"M >= {N} (the tokens the buffers hold)" if lengths is not None else f"N={N}"
            _fail(op, f"attn_mask must be [B or 1, H_q or 1, T={T}, {cols}], got shape {list(attn_mask.shape)}")
        check_last_dim_contiguous(op, "attn_mask", attn_mask)
    if not isinstance(split_tokens, int) or split_tokens < 0 or split_tokens % group_size:
        _fail(
            op,
            f"split_tokens must be 0 (planned) or a positive multiple of group_size={group_size}, got {split_tokens}",
        )
    check_same_device(
        op, x=x, sink_keys=sink_keys, sink_values=sink_values, key_codes=key_codes, key_scales=key_scales,
        key_zeros=key_zeros, value_codes=value_codes, value_scales=value_scales, value_zeros=value_zeros,
        key_tail=key_tail, value_tail=value_tail, key_x_scale=key_x_scale, attn_mask=attn_mask, lengths=lengths,
    )  # fmt: skip
    if not isinstance(q_scale, (int, float)):
        _fail(op, f"q_scale must be a float, got {type(q_scale).__name__}", TypeError)
    if not math.isfinite(q_scale):
        _fail(op, f"q_scale must be finite, got {q_scale!r}")
    if out_dtype is not None and out_dtype not in FLOAT_ACTIVATIONS:
        names = " or ".join(str(a).removeprefix("torch.") for a in FLOAT_ACTIVATIONS)
        got = str(out_dtype).removeprefix("torch.")
        _fail(op, f"out_dtype must be {names} (or None: float32), got {got}", TypeError)


def check_static_append(
    k, v, lengths, sink_keys, sink_values, key_codes, key_scales, key_zeros, value_codes, value_scales, value_zeros,
    key_tail, value_tail, key_bits, key_mode, key_layout, key_eta, value_bits, value_mode, value_layout, value_eta,
    group_size, w_recent, key_x_scale=None,
) -> None:  # fmt: skip
    """static_append's metadata: the operands of decode_attention_fused's lengths= form, plus the new tokens k / v
    [B, H_kv, n >= 1, D] in the windows' dtype, the stores' etas and w_recent; every written tensor disjoint from
    every other operand. What the counts say (room left) is on the device: checked there (module docstring of
    kvkernels.reference.static_append)."""
    op = "static_append"
    check_tensors(
        op, k=k, v=v, lengths=lengths, sink_keys=sink_keys, sink_values=sink_values, key_codes=key_codes,
        key_scales=key_scales, value_codes=value_codes, value_scales=value_scales, key_tail=key_tail,
        value_tail=value_tail,
    )  # fmt: skip
    if k.dim() != 4 or k.shape[2] < 1:
        _fail(op, f"k must be [B, H_kv, n >= 1, D], got shape {list(k.shape)}")
    B, H, n, D = k.shape
    check_dtype(op, "sink_keys", sink_keys, FLOAT_ACTIVATIONS)
    dt = sink_keys.dtype
    for name, t in (("k", k), ("v", v)):
        check_dtype(op, name, t, dt)  # the windows' dtype: the wrapper converts, the op copies bits
        check_last_dim_contiguous(op, name, t)
    if tuple(v.shape) != tuple(k.shape):
        _fail(op, f"v must match k {list(k.shape)}, got {list(v.shape)}")
    S = _check_window(op, "sink_keys", sink_keys, B, H, D, dt)
    if _check_window(op, "sink_values", sink_values, B, H, D, dt) != S:
        _fail(op, f"sink_values must match sink_keys {list(sink_keys.shape)}, got {list(sink_values.shape)}")
    _check_window(op, "key_tail", key_tail, B, H, D, dt)
    _check_window(op, "value_tail", value_tail, B, H, D, dt)
    if not is_int(group_size) or group_size <= 0 or group_size % BLOCK or group_size > MAX_ATTENTION_GROUP:
        _fail(op, f"group_size must be a positive multiple of {BLOCK} up to {MAX_ATTENTION_GROUP}, got {group_size}")
    for tensor, layout in (("key", key_layout), ("value", value_layout)):
        if layout == "rows" and D % group_size:
            _fail(op, f"head_dim D={D} must be a multiple of group_size={group_size} ({tensor} store in layout rows)")
    _check_store(op, "key", key_codes, key_scales, key_zeros, key_bits, key_mode, key_layout, group_size, B, H, D)
    _check_store(
        op, "value", value_codes, value_scales, value_zeros, value_bits, value_mode, value_layout, group_size, B, H, D
    )
    check_eta(op, key_eta, key_mode, "key")
    check_eta(op, value_eta, value_mode, "value")
    if not is_int(w_recent) or w_recent < 0:
        _fail(op, f"w_recent must be a non-negative int, got {w_recent!r}")
    check_dtype(op, "lengths", lengths, torch.int64)
    check_shape(op, "lengths", lengths, (5,))
    check_last_dim_contiguous(op, "lengths", lengths)
    if key_x_scale is not None:
        check_dtype(op, "key_x_scale", key_x_scale, torch.float32)
        check_shape(op, "key_x_scale", key_x_scale, (H, D))
        check_last_dim_contiguous(op, "key_x_scale", key_x_scale)
    written = dict(
        lengths=lengths, sink_keys=sink_keys, sink_values=sink_values, key_codes=key_codes, key_scales=key_scales,
        key_zeros=key_zeros, value_codes=value_codes, value_scales=value_scales, value_zeros=value_zeros,
        key_tail=key_tail, value_tail=value_tail,
    )  # fmt: skip
    written = {name: t for name, t in written.items() if t is not None}
    read = {name: t for name, t in (("k", k), ("v", v), ("key_x_scale", key_x_scale)) if t is not None}
    for name, t in written.items():
        check_no_self_overlap(op, name, t)
    for (name_a, a), (name_b, b) in itertools.combinations(written.items(), 2):
        check_disjoint(op, name_a, a, name_b, b)
    for (name_a, a), (name_b, b) in itertools.product(written.items(), read.items()):
        check_disjoint(op, name_a, a, name_b, b)
    check_same_device(op, **written, **read)
