"""Triton kernels the tests launch to probe a building block of kvkernels.triton_kernels on its own.

Kept apart from the test modules (no pytest here) so tests/triton_aot/compile_check.py compiles them for sm_80 /
sm_90 too: a probe that only the interpreter accepts fails in CPU CI, not on the first GPU. The first GPU run (H200,
2026-11-26) lost test_pair_decode_order that way: the probe read the module global EMULATE_DOT, a plain bool, which
the interpreter allows and Triton's compiler refuses (only constexpr globals); EMU is now an argument.
"""

import triton
import triton.language as tl
from kvkernels.triton_kernels._common import pair_perm, unpack_pairs


@triton.jit
def decode_probe(codes_ptr, out_ptr, BITS: tl.constexpr, EMU: tl.constexpr):
    """unpack_pairs' exact codes of 3 rows of 128 values (a fourth row masked off) -> fp32 [3, 128]."""
    r = tl.arange(0, 4)
    ok = r < 3
    u = unpack_pairs(codes_ptr + r * (4 * BITS), 0, ok, 4 * BITS, 0, BITS, 128, 0, EMU)
    k = tl.arange(0, 128)
    tl.store(out_ptr + r[:, None] * 128 + k[None, :], u.to(tl.float32), mask=ok[:, None])


@triton.jit
def perm_probe(out_ptr, BITS: tl.constexpr):
    """pair_perm of positions 0..127 -> int32 [128]."""
    k = tl.arange(0, 128)
    tl.store(out_ptr + k, pair_perm(k, BITS))
