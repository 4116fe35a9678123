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
def store_rounded(ptrs, v, mask):
    """Stores fp32 v at ptrs in their element type, rounded to nearest even as torch's .to() rounds. bf16 is rounded
    by hand: TRITON_INTERPRET=1's implicit and explicit fp32 -> bf16 casts truncate (triton 3.9); fp16 casts round to
    nearest everywhere, fp32 stores as is. NaN stays NaN, overflow goes to inf."""
    if ptrs.dtype.element_ty == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        r = bits + 0x7FFF + ((bits >> 16) & 1)
        r = tl.where(v != v, 0x7FC00000, r)
        tl.store(ptrs, (r >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(ptrs, v.to(ptrs.dtype.element_ty), mask=mask)


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
def gqa_query_rows(pid_bh, H_kv, Q, T, q0, QP: tl.constexpr):
    """The query rows a program serves: batch b and KV head h_kv from pid_bh, and QP of that head's Q = ratio * T
    query rows from q0 on, q = r * T + t (query head h_q = h_kv * ratio + r, position t); the GEMVs take all of them
    (q0 = 0), fused attention one row block. Returns b, h_kv, h_q, t as int64 (they scale strides) and the mask
    q < Q."""
    b = (pid_bh // H_kv).to(tl.int64)
    h_kv = (pid_bh % H_kv).to(tl.int64)
    q = q0 + tl.arange(0, QP)
    h_q = h_kv * (Q // T) + (q // T).to(tl.int64)
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


# ---------------------------------------------------------------------------------------------------------
# Tensor-core GEMV helpers (gemv_inner_q, gemv_kivi): codes as exact 16-bit integers, activations split into parts

# Whether tl.dot on bf16 operands must be emulated: triton's interpreter multiplies bf16 operands as their raw bit
# patterns (garbage), so under TRITON_INTERPRET=1 the 16-bit operands are widened to fp32 first (exact: they are
# integers < 2^4 and 8-bit-mantissa parts, whose products fp32 holds exactly). Captured at import like INTERPRETED,
# but never reassigned (tests/triton_aot/compile_check.py flips INTERPRETED to record launches on CPU tensors; the
# kernels it compiles must be the GPU's).
EMULATE_DOT = INTERPRETED


@triton.jit
def unpack_tile(row_ptrs, word0, mask, n_words, BITS: tl.constexpr, BK: tl.constexpr):
    """Codes of BK consecutive values (a multiple of 32, starting at a block boundary) of each row -> int32 [R, BK].

    row_ptrs: int32 pointers [R] to each row's codes; word0: the word of the first value (a scalar); mask [R]: the
    rows to read; n_words: how many words from word0 on exist (the rest read as 0). Same packing as unpack_blocks,
    but each word is loaded once and broadcast to its 32 / BITS values with constant shifts ([R, words, 32 / BITS]
    reshaped to [R, BK]): no per-value word select.
    """
    if BITS == 3:
        NB: tl.constexpr = BK // 32
        nb = tl.arange(0, NB)
        h = tl.arange(0, 2)
        j = tl.arange(0, 16)
        base = row_ptrs[:, None] + word0 + nb[None, :] * 3  # [R, NB] word 0 of each block
        nb_ok = mask[:, None] & (nb * 3 < n_words)[None, :]
        w01 = tl.load(base[:, :, None] + h[None, None, :], mask=nb_ok[:, :, None], other=0)  # [R, NB, 2]
        w2 = tl.load(base + 2, mask=nb_ok, other=0)  # [R, NB]
        lo = (w01[:, :, :, None] >> (j * 2)[None, None, None, :]) & 3  # [R, NB, 2, 16]
        sh = (h[:, None] * 16 + j[None, :])[None, None, :, :]
        hi = (w2[:, :, None, None] >> sh) & 1
        u = tl.reshape(lo | (hi << 2), (row_ptrs.shape[0], BK))
    else:
        PER: tl.constexpr = 32 // BITS  # values per word
        W: tl.constexpr = BK // PER
        wi = tl.arange(0, W)
        w = tl.load(row_ptrs[:, None] + word0 + wi[None, :], mask=mask[:, None] & (wi < n_words)[None, :], other=0)
        u = (w[:, :, None] >> (tl.arange(0, PER) * BITS)[None, None, :]) & ((1 << BITS) - 1)
        u = tl.reshape(u, (row_ptrs.shape[0], BK))
    return u


@triton.jit
def pow2_scales(xv):
    """Per column q of xv [K, N] (fp32): (up, down), powers of two with max_k |xv[k, q]| * up in [2^14, 2^15) and
    up * down == 1, from the max's exponent field (clamped so both stay normal fp32; an all-zero column gets 2^126)."""
    m = tl.max(tl.abs(xv), axis=0)
    e = (m.to(tl.int32, bitcast=True) >> 23) & 0xFF
    e = tl.minimum(tl.maximum(e, 15), 254)
    up = ((268 - e) << 23).to(tl.float32, bitcast=True)  # 2^(141 - e)
    down = ((e - 14) << 23).to(tl.float32, bitcast=True)  # 2^(e - 141)
    return up, down


@triton.jit
def split_dot(a, x, acc, XPARTS: tl.constexpr, DOT16: tl.constexpr, EMU: tl.constexpr):
    """acc + a @ x in fp32: a [M, K] fp16 / bf16 (DOT16 0 / 1), x [K, N] the activations.

    XPARTS 1: x holds values of the 16-bit type DOT16 names (the activations arrived in it): one dot, products exact.
    XPARTS 2 (fp16; gemv_kivi): each column of x is scaled by a power of two so its largest |x| lies in [2^14, 2^15)
    (pow2_scales) and split into fp16 hi + lo, two dots whose fp32 sum is scaled back (exact). hi + lo holds 22
    significant bits of the column's largest value: an element's error is at most 2^-23 of that maximum.
    XPARTS 3 (bf16; gemv_inner_q, whose a are exact integers): x = hi + mid + lo, each bf16 (8 + 8 + 8 significant
    bits hold fp32's 24, and bf16 has fp32's exponent range, so the split is exact without any scaling), three dots
    into the same accumulator: products exact. (Two fp16 parts instead, with the scaling per chunk, measured worse
    on its wgmma tiles: the column maxima's shuffles and the rescale cost more than the third dot, bench/README.md.)
    EMU: the operands widened to fp32 (the interpreter; a may be fp32 already, see unpack_pairs).
    """
    if XPARTS == 1:
        if EMU:  # a may already be fp32 here (unpack_pairs): round x through the 16-bit type it arrived in
            xa = x.to(tl.bfloat16 if DOT16 == 1 else tl.float16)
            acc = tl.dot(a.to(tl.float32), xa.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, x.to(a.dtype), acc)
    elif XPARTS == 2:
        tl.static_assert(DOT16 == 0, "XPARTS 2 splits into fp16 parts")
        xf = x.to(tl.float32)
        up, down = pow2_scales(xf)
        xs = xf * up[None, :]
        hi = xs.to(tl.float16)
        lo = (xs - hi.to(tl.float32)).to(tl.float16)
        if EMU:
            af = a.to(tl.float32)
            part = tl.dot(af, hi.to(tl.float32), input_precision="ieee")
            part = tl.dot(af, lo.to(tl.float32), part, input_precision="ieee")
        else:
            part = tl.dot(a, hi)
            part = tl.dot(a, lo, part)
        acc += part * down[None, :]
    else:
        tl.static_assert(XPARTS == 3, "XPARTS must be 1, 2 or 3")
        hi = x.to(tl.bfloat16)
        r = x - hi.to(tl.float32)
        mid = r.to(tl.bfloat16)
        lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
        if EMU:
            af = a.to(tl.float32)
            acc = tl.dot(af, hi.to(tl.float32), acc, input_precision="ieee")
            acc = tl.dot(af, mid.to(tl.float32), acc, input_precision="ieee")
            acc = tl.dot(af, lo.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, hi, acc)
            acc = tl.dot(a, mid, acc)
            acc = tl.dot(a, lo, acc)
    return acc


def dot_operands(x_dtype: torch.dtype, has_x_scale: bool = False) -> tuple[int, int]:
    """(DOT16, XPARTS) of the tensor-core GEMVs: DOT16 0 = fp16, 1 = bf16 operands; XPARTS 1 when the activations
    are exactly that 16-bit type, else 3 (fp32 activations, or scaled by an fp32 x_scale: three bf16 parts)."""
    if x_dtype == torch.float16 and not has_x_scale:
        return 0, 1
    if x_dtype == torch.bfloat16 and not has_x_scale:
        return 1, 1
    return 1, 3


def bucket(n: int, lo: int = 128, hi: int = 65536) -> int:
    """Power-of-two bucket of a length for autotune keys: next_pow2(n) clamped to [lo, hi]."""
    return min(hi, max(lo, next_pow2(n)))


@triton.jit
def _pair_leaf(w, J: tl.constexpr, BITS: tl.constexpr, MAGIC2: tl.constexpr):
    """Pair-word J of a word (see unpack_pairs): values J and J + HALF in the low / high 16 bits, over MAGIC2."""
    M2: tl.constexpr = ((1 << BITS) - 1) * 0x10001
    return ((w >> (J * BITS)) & M2) | MAGIC2


@triton.jit
def _pair_leaf3(a, bc, w2, J: tl.constexpr, MAGIC2: tl.constexpr):
    """3-bit pair-word J (values J and J + 16 of a block): 2-bit plane from a (J < 8) or bc, high bit from w2."""
    if J < 8:
        lo = (a >> (2 * J)) & 0x30003
    else:
        lo = (bc >> (2 * (J - 8))) & 0x30003
    if J >= 2:
        hi = (w2 >> (J - 2)) & 0x40004
    else:
        hi = (w2 << (2 - J)) & 0x40004
    return lo | hi | MAGIC2


@triton.jit
def _pair_tree(a, bc, w2, J0: tl.constexpr, STRIDE: tl.constexpr, N: tl.constexpr, BITS: tl.constexpr,
               MAGIC2: tl.constexpr):  # fmt: skip
    """The N pair-words J0 + STRIDE * i (i < N) as [..., 2, ..., 2] (log2 N joins; bit 0 of i last): in-thread."""
    if N == 1:
        if BITS == 3:
            r = _pair_leaf3(a, bc, w2, J0, MAGIC2)
        else:
            r = _pair_leaf(a, J0, BITS, MAGIC2)
    else:
        r = tl.join(
            _pair_tree(a, bc, w2, J0, STRIDE * 2, N // 2, BITS, MAGIC2),
            _pair_tree(a, bc, w2, J0 + STRIDE, STRIDE * 2, N // 2, BITS, MAGIC2),
        )
    return r


@triton.jit
def load_words(row_ptrs, word0, mask, n_words, W: tl.constexpr):
    """Code words word0 .. word0 + W of each row -> int32 [R, W]. mask [R]: the rows to read, and words from n_words
    on read as 0; mask None: every row and word exists (no predicates, n_words ignored)."""
    wi = tl.arange(0, W)
    ptrs = row_ptrs[:, None] + word0 + wi[None, :]
    if mask is None:
        w = tl.load(ptrs)
    else:
        w = tl.load(ptrs, mask=mask[:, None] & (wi < n_words)[None, :], other=0)
    return w


@triton.jit
def halves(p, R: tl.constexpr, N: tl.constexpr):
    """Pair words p (int32, R x N / 2 elements) -> their 16-bit halves as int16 [R, N], low half first."""
    return tl.reshape(tl.join(p.to(tl.int16), (p >> 16).to(tl.int16)), (R, N))


@triton.jit
def _sign_bytes(x, SEL: tl.constexpr):
    """prmt.b32 with selector SEL (0xAA88 or 0xBB99) on x alone: each result byte is the sign bit of the byte its
    nibble picks, replicated (a nibble's bit 3 asks for the sign; PTX ISA, prmt)."""
    if SEL == 0xAA88:
        r = tl.inline_asm_elementwise("prmt.b32 $0, $1, 0, 0xAA88;", "=r,r", [x], dtype=tl.int32, is_pure=True, pack=1)
    else:
        tl.static_assert(SEL == 0xBB99)
        r = tl.inline_asm_elementwise("prmt.b32 $0, $1, 0, 0xBB99;", "=r,r", [x], dtype=tl.int32, is_pure=True, pack=1)
    return r


@triton.jit
def _select_leaf(w, lo_bits, hi_bits, J: tl.constexpr):
    """Pair J of a 1-bit word (values J, J + 16): shifted so their bits are the sign bits of bytes 0 / 2 (J < 8) or
    1 / 3, each spread over its 16-bit half by one byte permute, then a 3-input select: hi_bits where set."""
    if J < 8:
        m = _sign_bytes(w << (7 - J), 0xAA88)
    else:
        m = _sign_bytes(w << (15 - J), 0xBB99)
    return (lo_bits & ~m) | (hi_bits & m)


@triton.jit
def _select_tree(w, lo_bits, hi_bits, J0: tl.constexpr, STRIDE: tl.constexpr, N: tl.constexpr):
    """The N pairs J0 + STRIDE * i (i < N) joined as _pair_tree joins them: the order pair_perm gives."""
    if N == 1:
        r = _select_leaf(w, lo_bits, hi_bits, J0)
    else:
        r = tl.join(
            _select_tree(w, lo_bits, hi_bits, J0, STRIDE * 2, N // 2),
            _select_tree(w, lo_bits, hi_bits, J0 + STRIDE, STRIDE * 2, N // 2),
        )
    return r


@triton.jit
def select_pairs_1bit(w, lo_bits, hi_bits):
    """Every pair of values of 1-bit words w (int32, any shape S) as 32-bit words [*S, 2, 2, 2, 2] in pair_perm order:
    each 16-bit half is lo_bits' or hi_bits' half as the value's code is 0 or 1 (pair j: values j and j + 16).

    Per two values a byte permute and a LOP3, and a shift per two pairs (pairs j and j + 8 share it): the shift puts
    the pair's code bits at bit 7 of bytes 0 and 2 (j < 8) or 1 and 3, and prmt's sign-replicating selector spreads
    each over its 16-bit half, the select mask. No arithmetic: the 16-bit patterns are whatever the caller makes them
    (exact integers, dequantized values). Inline PTX: not under TRITON_INTERPRET=1 (callers take another path there).
    """
    return _select_tree(w, lo_bits, hi_bits, 0, 1, 16)


@triton.jit
def pair_perm(k, BITS: tl.constexpr):
    """Value index (within the tile) of position k of unpack_pairs' output: positions 2j, 2j + 1 of a word's (b = 3:
    a block's) stretch hold values j and j + HALF, HALF = half the values per word (16 for b = 3)."""
    PER: tl.constexpr = 32 if BITS == 3 else 32 // BITS
    return (k // PER) * PER + (k % 2) * (PER // 2) + (k % PER) // 2


@triton.jit
def unpack_pairs(row_ptrs, word0, mask, n_words, OFFSET: tl.constexpr, BITS: tl.constexpr, BK: tl.constexpr,
                 DOT16: tl.constexpr, EMU: tl.constexpr):  # fmt: skip
    """Codes of BK values of each row (as unpack_tile) -> exact (u - OFFSET) in fp16 / bf16 [R, BK], in the order
    pair_perm gives (the reduction's order is free: the caller permutes the other operand to match). mask None: every
    row and word exists (no predicates; n_words is ignored).

    Two values per 32-bit operation, as csrc/kvkernels/mma.cuh decodes them: a shift and a mask put values j and
    j + HALF of a word at bits 0 and 16, OR-ed over the magic pair (fp16 1024 / bf16 128 in each half); the halves
    become the 16-bit pair and one packed subtraction removes magic + OFFSET: the code sits in the mantissa of a
    power of two (fp16 1024 = 0x6400, bf16 128 = 0x4300, whose last mantissa bit is 1, so 1024 + u / 128 + u are
    exact). The values of a word are joined into the last dims (tl.join keeps them in one thread), so the tile leaves
    for the MMA's shared-memory staging as wide vectors when a thread holds whole rows (gemv_inner_q's configs).
    EMU (the interpreter, whose bf16 arithmetic is broken): the same exact values in fp32.
    """
    MAGIC2: tl.constexpr = 0x64006400 if DOT16 == 0 else 0x43004300
    R: tl.constexpr = row_ptrs.shape[0]
    if BITS == 3:
        NB: tl.constexpr = BK // 32
        nb = tl.arange(0, NB)
        base = row_ptrs[:, None] + word0 + nb[None, :] * 3  # [R, NB]
        if mask is None:
            w0 = tl.load(base)
            w1 = tl.load(base + 1)
            w2 = tl.load(base + 2)
        else:
            ok = mask[:, None] & (nb * 3 < n_words)[None, :]
            w0 = tl.load(base, mask=ok, other=0)
            w1 = tl.load(base + 1, mask=ok, other=0)
            w2 = tl.load(base + 2, mask=ok, other=0)
        a = (w0 & 0xFFFF) | (w1 << 16)
        bc = ((w0 >> 16) & 0xFFFF) | (w1 & -65536)
        p = _pair_tree(a, bc, w2, 0, 1, 16, 3, MAGIC2)  # [R, NB, 2 x4]
    else:
        PER: tl.constexpr = 32 // BITS
        W: tl.constexpr = BK // PER
        w = load_words(row_ptrs, word0, mask, n_words, W)
        if BITS == 1 and OFFSET == 0 and not EMU:
            # 1 bit, unsigned codes: each value is 0 or 1, a select between two constant 16-bit patterns (sym's
            # -1 / 0 would need a constant over int32's range here: it keeps the generic decode)
            ONE: tl.constexpr = 0x3C00 if DOT16 == 0 else 0x3F80  # 1.0
            v = halves(select_pairs_1bit(w, 0, ONE * 0x10001), R, BK)
            return v.to(tl.float16 if DOT16 == 0 else tl.bfloat16, bitcast=True)
        p = _pair_tree(w, w, w, 0, 1, PER // 2, BITS, MAGIC2)
    v = halves(p, R, BK)
    if DOT16 == 0:
        r = v.to(tl.float16, bitcast=True) - tl.full((), 1024.0 + OFFSET, tl.float16)
    elif EMU:  # the interpreter's bf16 arithmetic is broken: the same exact values in fp32
        r = (v.to(tl.int32) - 0x4300 - OFFSET).to(tl.float32)
    else:
        r = v.to(tl.bfloat16, bitcast=True) - tl.full((), 128.0 + OFFSET, tl.bfloat16)
    return r
