"""Triton backend (triton_kernels/) against the reference: GEMVs to accumulation-order tolerance, quantizers bit-exact.

Runs on CPU under TRITON_INTERPRET=1 (how CI tests it) or on a CUDA GPU. The interpreter is slow, so shapes are
small and the sweep is a list of combined cases (bits x mode x dtype x GQA x T x odd sizes x strides) rather
than a cartesian product; every case still names what it covers.
"""

import importlib
from unittest import mock

import pytest
import torch
from triton_helpers import DEVICE, DTYPES, TRITON_MARK, gen, place, seed_for, tk, triton

from kvkernels import reference

if tk is not None:
    from kvkernels.triton_kernels._common import EMULATE_DOT
    from triton_probes import decode_probe, perm_probe

pytestmark = TRITON_MARK
# |triton - reference| <= RTOL * sum_l |x_l| |w_l| + ATOL: x enters both exactly (same fp16/bf16 values cast to
# fp32), so the difference is fp32 accumulation order only.
RTOL = {"fp32": 1e-4, "fp16": 1e-3, "bf16": 1e-3}
ATOL = 1e-6


def _weights(shape, bits, G, mode, seed):
    """Random weights quantized by the reference. Hybrid gets positive rows (asym wins) and a constant group
    (asym with s == 0, stored as -0.0, in the last row) so both branches and the sign-bit rule are exercised."""
    w = torch.randn(shape, generator=gen(seed))
    if mode == "hybrid":
        w[..., ::3, :] += 3.0
        w[..., -1, :G] = 1.25
    return reference.quantize_groups(w, bits, G, mode)


# gemv_kivi's (and 1-bit asym / hybrid gemv_inner_q's) fp16 rounding of each dequantized value: half an fp16 ulp,
# 2^-11 of |x| |deq|, checked at twice that
KIVI_DEQ_RTOL = 2.0**-10


def _check_close(y, ref, mag, dtype_name, rtol_min=0.0):
    y, ref, mag = y.cpu(), ref.cpu(), mag.cpu()
    assert y.shape == ref.shape and y.dtype == torch.float32
    assert torch.isfinite(y).all()
    bad = (y - ref).abs() > max(RTOL[dtype_name], rtol_min) * mag + ATOL
    assert not bad.any(), f"max |diff| {(y - ref).abs().max():.3g}, magnitude {mag.max():.3g}, {int(bad.sum())} bad"


# ---------------------------------------------------------------------------------------------------------
# gemv_inner_q

# id: (bits, mode, dtype, B, H_kv, ratio, T, M, L, G, x_scale, noncontig)
INNER_Q_CASES = {
    "b4-sym-fp32-D128-M37-B2": (4, "sym", "fp32", 2, 2, 1, None, 37, 128, 32, False, False),
    "b2-asym-fp16-gqa4-D64-xscale-strided": (2, "asym", "fp16", 1, 2, 4, None, 37, 64, 64, True, True),
    "b3-hybrid-bf16-gqa8-T3-G96-xscale": (3, "hybrid", "bf16", 1, 1, 8, 3, 9, 96, 96, True, False),
    "b1-hybrid-fp32-T16-M1-D256-B2-strided": (1, "hybrid", "fp32", 2, 1, 1, 16, 1, 256, 128, False, True),
    "b3-sym-fp16-M8-L800-G160-split": (3, "sym", "fp16", 1, 1, 1, None, 8, 800, 160, False, False),
    "b4-asym-bf16-gqa4-T16-xscale-strided": (4, "asym", "bf16", 1, 1, 4, 16, 5, 64, 32, True, True),
    "b2-hybrid-fp32-gqa4-T3-D256-B2": (2, "hybrid", "fp32", 2, 1, 4, 3, 6, 256, 64, False, False),
    "b1-asym-fp16-L32-M37": (1, "asym", "fp16", 1, 2, 1, 1, 37, 32, 32, False, False),
    "b4-hybrid-fp16-M4-L416-split-strided-xscale": (4, "hybrid", "fp16", 1, 1, 1, None, 4, 416, 32, True, True),
    "b1-sym-bf16-gqa8-M37-D64-B2-strided": (1, "sym", "bf16", 2, 2, 8, None, 37, 64, 32, False, True),
    "b2-sym-fp32-gqa8-T16-M3-L96-xscale": (2, "sym", "fp32", 1, 1, 8, 16, 3, 96, 32, True, False),
    "b3-asym-fp32-gqa4-T1-M37-D128-B2-xscale-strided": (3, "asym", "fp32", 2, 1, 4, 1, 37, 128, 128, True, True),
    "b4-hybrid-bf16-gqa8-M37-L160": (4, "hybrid", "bf16", 1, 1, 8, None, 37, 160, 32, False, False),
    "b1-asym-bf16-M16-L1024-G256-split": (1, "asym", "bf16", 1, 1, 1, None, 16, 1024, 256, False, False),
    "b2-hybrid-fp16-T3-L160-G160-strided": (2, "hybrid", "fp16", 1, 1, 1, 3, 37, 160, 160, False, True),
    # awkward shapes of the tensor-core kernel: query rows Q = ratio * T not a power of two (padded to the MMA's
    # N >= 8 and masked), L not a multiple of 128 (chunks of BK = 32 / 64 / 128, the largest dividing G), M not a
    # multiple of the tile, fp16 / bf16 activations (one dot) vs fp32 or x_scale (three bf16 parts)
    "b4-sym-fp16-gqa5-M70-L96": (4, "sym", "fp16", 1, 1, 5, None, 70, 96, 32, False, False),
    "b2-asym-bf16-gqa3-T4-M19-L192-G64": (2, "asym", "bf16", 1, 2, 3, 4, 19, 192, 64, False, False),
    "b1-sym-fp32-gqa6-T2-L384-G128-split": (1, "sym", "fp32", 1, 1, 6, 2, 9, 384, 128, False, False),
    "b3-hybrid-fp16-gqa3-M65-L224-xscale": (3, "hybrid", "fp16", 1, 1, 3, None, 65, 224, 32, True, False),
    "b4-asym-fp32-T5-M33-L640-G128-split": (4, "asym", "fp32", 1, 1, 1, 5, 33, 640, 128, False, False),
    "b2-sym-bf16-gqa7-M17-L64-G64": (2, "sym", "bf16", 1, 1, 7, None, 17, 64, 64, False, False),
    # M of 65-128 (the value GEMV at head_dim 128): the 256-row tile holds 128 rows x 2 sub-chunks of L; an odd count
    # of chunks per split leaves the last sub-chunk masked (L 1184: 37 chunks in 2 splits of 19 and 18)
    "b2-asym-fp32-gqa4-M128-L1184-split": (2, "asym", "fp32", 1, 1, 4, None, 128, 1184, 32, False, False),
    "b3-sym-bf16-gqa2-T2-M100-L224-G32-xscale": (3, "sym", "bf16", 1, 2, 2, 2, 100, 224, 32, True, False),
    # M over 128 (the key GEMV's tokens): the 256-row tile, partly masked
    "b3-sym-fp32-gqa4-M300-D128-xscale": (3, "sym", "fp32", 1, 2, 4, None, 300, 128, 32, True, False),
    "b1-asym-fp32-gqa4-M257-D128-xscale": (1, "asym", "fp32", 1, 1, 4, None, 257, 128, 32, True, False),
}


@pytest.mark.parametrize("name", INNER_Q_CASES)
def test_gemv_inner_q(name):
    bits, mode, dt, B, H_kv, ratio, T, M, L, G, use_xs, noncontig = INNER_Q_CASES[name]
    seed = seed_for(name)
    codes, scales, zeros = _weights((B, H_kv, M, L), bits, G, mode, seed)
    x_shape = (B, H_kv * ratio, L) if T is None else (B, H_kv * ratio, T, L)
    x = torch.randn(x_shape, generator=gen(seed + 1)).to(DTYPES[dt])
    xs = torch.rand(H_kv, L, generator=gen(seed + 2)) + 0.5 if use_xs else None
    z_in = None if mode == "sym" else zeros  # zeros are optional for sym

    ref = reference.gemv_inner_q(x, codes, scales, z_in, bits, G, mode, xs)
    # magnitude sum_l |x_l x_scale_l| |w_ml| with w the dequantized weights: the scale of the rounding error
    x4 = (x if T else x.unsqueeze(2)).float().abs()  # [B, H_q, T, L]
    if xs is not None:
        x4 = x4 * xs.repeat_interleave(ratio, 0).unsqueeze(1)  # [H_q, 1, L]
    wa = reference.dequantize_groups(codes, scales, zeros, bits, G, mode).abs().repeat_interleave(ratio, 1)
    mag = x4 @ wa.transpose(-1, -2)
    mag = mag if T else mag.squeeze(2)

    args = [place(t, noncontig, seed + k) for k, t in enumerate((x, codes, scales, zeros))]
    if mode == "sym":
        args[3] = None
    xs_dev = None if xs is None else place(xs, noncontig, seed + 9)
    y = tk.gemv_inner_q(*args[:4], bits, G, mode, xs_dev)
    # 1-bit asym / hybrid: gemv_kivi's arithmetic (each dequantized value rounded once to fp16, docs/FORMATS.md)
    deq16 = bits == 1 and mode != "sym"
    _check_close(y, ref, mag, dt, KIVI_DEQ_RTOL if deq16 else 0.0)
    if deq16:  # ... and otherwise fp32-exact: against that fp16 model, to fp32 accumulation (a lost lo part fails)
        _check_fp16_weight_model(y, x if T else x.unsqueeze(2), xs, codes, scales, zeros, bits, G, mode, ratio)
    if "split" in name:  # the split path sums partials in a fixed order: run-to-run identical
        assert torch.equal(y, tk.gemv_inner_q(*args[:4], bits, G, mode, xs_dev))


def _check_fp16_weight_model(y, x4, xs, codes, scales, zeros, bits, G, mode, ratio):
    """y (the Triton 1-bit asym / hybrid GEMV) against the float64 sum over fp16(s u + zeff), one rounding each:
    within 4e-6 of sum |x'| |w16| (fp32 accumulation; the activations' hi + lo split adds at most 2^-23 of a chunk's
    largest |x'|). Rounding the activations to fp16 instead (a lost lo part) is ~1e-5-1e-4 off."""
    u = reference.unpack_bits(codes, bits).double()
    s, zeff = (t.double().repeat_interleave(G, -1) for t in reference.group_affine(scales, zeros, bits, mode))
    w16 = (s * u + zeff).half().double().repeat_interleave(ratio, 1)  # [B, H_q, M, L]
    xd = x4.double()  # [B, H_q, T, L], fp32 activations (times x_scale) as the kernel forms them
    if xs is not None:
        xd = (x4.float() * xs.repeat_interleave(ratio, 0).unsqueeze(1)).double()
    want, mag = xd @ w16.transpose(-1, -2), xd.abs() @ w16.abs().transpose(-1, -2)
    got = y.cpu().double().reshape(want.shape)
    bad = (got - want).abs() > 4e-6 * mag + ATOL
    assert not bad.any(), f"max |diff| {(got - want).abs().max():.3g} of magnitude {mag.max():.3g}"


@pytest.mark.parametrize("mode, M, L", [("asym", 300, 224), ("hybrid", 128, 1184)])
def test_gemv_inner_q_1bit_rounds_values_to_fp16(mode, M, L):
    """1-bit asym / hybrid take gemv_kivi's arithmetic (docs/FORMATS.md, "GEMV arithmetic"): each dequantized value is
    fp16(s u + zeff), rounded once, then summed in fp32. With s + zeff 3/4 of an fp16 ulp above 1 in every group the
    rounding is systematic: the result is the fp16 model's to fp32 accuracy, 2^-12 of it away from the exact
    reference. The activations, 1 + 2^-13, are not fp16 numbers: their lo part must reach the dot (fp16 alone would
    be 1, 2^-13 off). Keys-shaped (M 300: one 256-row tile, L 224: whole iterations and a tail chunk) and
    values-shaped (M 128: two sub-chunks of L stacked; L 1184 split) launches."""
    G = 32
    codes = reference.pack_bits(torch.ones(1, 1, M, L, dtype=torch.uint8), 1)
    s = torch.full((1, 1, M, L // G), 3 * 2.0**-12, dtype=torch.float16)
    z = torch.ones_like(s)
    if mode == "hybrid":
        s = -s  # the scale's sign bit: a group stored asym
    x = torch.full((1, 2, L), 1 + 2.0**-13)  # fp32 activations: the hi / lo split, GQA 2
    y = tk.gemv_inner_q(x.to(DEVICE), codes.to(DEVICE), s.to(DEVICE), z.to(DEVICE), 1, G, mode).cpu()
    exact = reference.gemv_inner_q(x, codes, s, z, 1, G, mode)
    assert torch.allclose(exact, torch.full_like(exact, L * (1 + 2.0**-13) * (1 + 3 * 2.0**-12)), rtol=1e-6, atol=0)
    fp16_model = L * (1 + 2.0**-13) * (1 + 2.0**-10)
    assert torch.allclose(y, torch.full_like(y, fp16_model), rtol=1e-6, atol=0), (y.min(), y.max())


def test_gemv_empty_sizes():
    c, s, z = reference.quantize_groups(torch.randn(1, 1, 0, 64), 2, 32, "asym")  # M = 0 rows
    y = tk.gemv_inner_q(torch.randn(1, 2, 64, device=DEVICE), c.to(DEVICE), s.to(DEVICE), z.to(DEVICE), 2, 32, "asym")
    assert y.shape == (1, 2, 0)
    c, s, z = reference.quantize_groups(torch.randn(1, 1, 0, 64), 2, 32, "asym")  # R = 0 rows
    y = tk.gemv_kivi(torch.randn(1, 2, 3, 0, device=DEVICE), c.to(DEVICE), s.to(DEVICE), z.to(DEVICE), 2, 32)
    assert y.shape == (1, 2, 3, 64) and not y.any()


def test_gemv_inner_q_split_path_is_taken():
    gq = importlib.import_module("kvkernels.triton_kernels.gemv_inner_q")
    common = importlib.import_module("kvkernels.triton_kernels._common")
    # "b3-sym-fp16-M8-L800-G160-split": 8 rows, L = 800 in chunks of BK = 32 (G = 160)
    assert gq.block_values(160) == 32
    assert common.num_splits(triton.cdiv(8, gq._SPLIT_BLOCK_M), 800 // 32, torch.device("cpu")) > 1


@pytest.mark.parametrize("mod, name", [("gemv_inner_q", "_gemv_inner_q_tuned"), ("gemv_kivi", "_gemv_kivi_tuned")])
def test_gemv_autotune_configs(mod, name):
    """Interpreted, the autotuner runs one config (tuning would only multiply test time); compiled, a short list.
    InnerQ's tiles give each thread two or more whole rows (its decode stays in registers) but the last, the tile for
    32+ query rows; KIVI's split of R is planned in rows that every config divides."""
    m = importlib.import_module(f"kvkernels.triton_kernels.{mod}")
    tuned = getattr(m, name)
    assert tuned.configs[0] is m._CONFIGS[0] and 2 <= len(m._CONFIGS) <= 4
    for i, c in enumerate(m._CONFIGS):
        if mod == "gemv_inner_q":
            assert c.kwargs["BLOCK_M"] % (16 * c.num_warps) == 0
            assert c.kwargs["BLOCK_M"] >= 2 * 32 * c.num_warps or i == len(m._CONFIGS) - 1
        else:
            assert m._SPLIT_BLOCK_R % c.kwargs["BLOCK_R"] == 0
    if mod == "gemv_kivi":
        assert len(tuned.configs) == (1 if DEVICE == "cpu" else len(m._CONFIGS))


def test_gemv_inner_q_prune():
    """The configs an InnerQ launch may run: none whose accumulator is over _MAX_ACC_REGS per thread (a tile stacked
    for a short M holds STACK x QP columns), stacked only on warpgroup tiles, never none; interpreted, only the
    first."""
    m = importlib.import_module("kvkernels.triton_kernels.gemv_inner_q")

    def kept(m_cap, qp, interpreted=False):
        with mock.patch.object(m, "INTERPRETED", interpreted):
            return [(c.kwargs["BLOCK_M"], c.num_warps) for c in m._prune(m._CONFIGS, {"M_CAP": m_cap, "QP": qp})]

    assert kept(256, 8)[0] == (256, 4) and len(kept(256, 8)) == len(m._CONFIGS)  # key GEMV: every config
    assert kept(128, 8)[0] == (256, 4)  # values at head_dim 128: 128 rows x 2 sub-chunks of L
    assert kept(128, 16)[0] == (128, 2)  # 8 query rows: the stacked accumulator would be 64 registers
    assert kept(64, 8) == [(64, 1), (64, 4)]  # values at head_dim 64: no stacking on the two-warp tile
    for qp in (16, 32, 64):
        for m_cap in (64, 128, 256):
            for rows, warps in kept(m_cap, qp):
                stack = rows // min(rows, m_cap)
                assert rows * stack * qp <= m._MAX_ACC_REGS * 32 * warps and (stack == 1 or warps == 4)
    assert kept(256, 64) == [(64, 4)]  # 64 query rows: the tile of one row per thread
    with mock.patch.object(m, "_MAX_ACC_REGS", 1):
        assert kept(256, 8) == [(m._CONFIGS[-1].kwargs["BLOCK_M"], m._CONFIGS[-1].num_warps)]  # nothing fits: the last
    assert kept(256, 8, interpreted=True) == [(256, 4)]


def test_pair_decode_order():
    """unpack_pairs puts values j and j + HALF of a word (b = 3: of a block) next to each other; pair_perm is that
    order, a permutation of each word's (block's) values."""
    for bits in (1, 2, 3, 4):
        c, s, _ = reference.quantize_groups(torch.randn(3, 128, generator=gen(bits)), bits, 32, "sym")
        out = torch.zeros(3, 128, dtype=torch.float32, device=DEVICE)
        decode_probe[(1,)](c.to(DEVICE), out, BITS=bits, EMU=EMULATE_DOT)
        perm = torch.zeros(128, dtype=torch.int32, device=DEVICE)
        perm_probe[(1,)](perm, BITS=bits)
        perm = perm.cpu().long()
        per = 32 if bits == 3 else 32 // bits  # values per word (b = 3: per block)
        assert torch.equal(perm.view(-1, per).sort(-1).values, torch.arange(128).view(-1, per)), bits
        # the codes themselves: sym dequantization with unit scales is u - 2^(b-1)
        u = reference.dequantize_groups(c, torch.ones_like(s), None, bits, 32, "sym") + 2 ** (bits - 1)
        assert torch.equal(out.cpu(), u[:, perm]), bits


# ---------------------------------------------------------------------------------------------------------
# gemv_kivi

# id: (bits, dtype, B, H_kv, ratio, T, R, C, G, noncontig)
KIVI_CASES = {
    "b2-fp16-B2-R37-C128": (2, "fp16", 2, 2, 1, None, 37, 128, 32, False),
    "b4-bf16-gqa4-T3-C64-strided": (4, "bf16", 1, 2, 4, 3, 20, 64, 64, True),
    "b3-fp32-gqa8-C96-G96": (3, "fp32", 1, 1, 8, None, 21, 96, 96, False),
    "b1-fp16-R300-split-strided": (1, "fp16", 1, 1, 1, None, 300, 64, 32, True),
    "b3-bf16-T16-B2-C32": (3, "bf16", 2, 1, 1, 16, 17, 32, 32, False),
    "b4-fp32-gqa4-C256-G128": (4, "fp32", 1, 1, 4, 1, 9, 256, 128, False),
    "b1-bf16-gqa8-T16-R5-C64": (1, "bf16", 1, 1, 8, 16, 5, 64, 32, False),
    "b2-fp32-B2-T3-R64-C32-strided": (2, "fp32", 2, 1, 1, 3, 64, 32, 32, True),
    "b3-fp16-R1-C128": (3, "fp16", 1, 2, 1, None, 1, 128, 64, False),
    "b4-fp16-R500-C128-split": (4, "fp16", 1, 1, 1, None, 500, 128, 128, False),
    "b2-bf16-gqa4-C160-G32-strided": (2, "bf16", 1, 2, 4, None, 33, 160, 32, True),
}


@pytest.mark.parametrize("name", KIVI_CASES)
def test_gemv_kivi(name):
    bits, dt, B, H_kv, ratio, T, R, C, G, noncontig = KIVI_CASES[name]
    seed = seed_for(name)
    codes, scales, zeros = _weights((B, H_kv, R, C), bits, G, "asym", seed)
    x_shape = (B, H_kv * ratio, R) if T is None else (B, H_kv * ratio, T, R)
    x = torch.randn(x_shape, generator=gen(seed + 1)).to(DTYPES[dt])

    ref = reference.gemv_kivi(x, codes, scales, zeros, bits, G)
    deq = reference.dequantize_groups(codes, scales, zeros, bits, G, "asym").repeat_interleave(ratio, 1)
    x4 = x if T else x.unsqueeze(2)
    mag = x4.float().abs() @ deq.abs()
    # gemv_kivi rounds each dequantized value to fp16 before the tensor cores (docs/FORMATS.md, "GEMV arithmetic"):
    # against that rounding (fp64 sums) only the accumulation order remains; against the fp32 definition, half an
    # fp16 ulp of each term on top
    ref16 = (x4.double() @ deq.half().double()).float()
    mag, ref16 = (mag, ref16) if T else (mag.squeeze(2), ref16.squeeze(2))

    args = [place(t, noncontig, seed + k) for k, t in enumerate((x, codes, scales, zeros))]
    y = tk.gemv_kivi(*args, bits, G)
    _check_close(y, ref16, mag, dt)
    _check_close(y, ref, mag, dt, rtol_min=KIVI_DEQ_RTOL)
    if "split" in name:  # split path: fixed-order combine, run-to-run identical
        assert torch.equal(y, tk.gemv_kivi(*args, bits, G))


# ---------------------------------------------------------------------------------------------------------
# quantize / dequantize


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu(), b.cpu()
    if a.dtype == torch.float16:
        a, b = a.view(torch.int16), b.view(torch.int16)
    return torch.equal(a, b)


def _near_tie(x, bits, G, groups):
    # hybrid compares two fp32 sums whose order differs between torch and Triton: a group may only flip where
    # the errors agree to fp32 rounding
    xg = x.float().unflatten(-1, (-1, G))
    err_s = reference.quant._sym(xg, bits)[3]
    err_a = reference.quant._asym(xg, bits)[4]
    gap = (err_s - err_a).abs() / (err_s.abs() + err_a.abs() + 1e-30)
    return bool((gap[groups] < 1e-5).all())


def _assert_matches_reference(x, bits, G, mode, eta, got):
    c, s, z = (t.cpu() for t in got)
    c_ref, s_ref, z_ref = reference.quantize_groups(x.cpu(), bits, G, mode, eta)
    same = s.view(torch.int16) == s_ref.view(torch.int16)
    if mode == "hybrid" and not same.all():
        assert _near_tie(x.cpu(), bits, G, ~same), "hybrid picked another mode outside a near-tie"
        return
    assert same.all()
    assert _same_bits(z, z_ref)
    assert torch.equal(c, c_ref)


# id: (bits, mode, dtype, shape, G, eta)
QUANT_CASES = {
    "b1-sym-fp32": (1, "sym", "fp32", (3, 5, 64), 32, 0.0),
    "b1-asym-eta.25-fp16": (1, "asym", "fp16", (7, 96), 32, 0.25),
    "b2-hybrid-bf16-G64": (2, "hybrid", "bf16", (2, 3, 4, 128), 64, 0.0),
    "b2-asym-fp32-G96": (2, "asym", "fp32", (5, 192), 96, 0.0),
    "b2-asym-eta.4999-fp32": (2, "asym", "fp32", (4, 128), 32, 0.4999),
    "b3-sym-bf16-G96": (3, "sym", "bf16", (4, 96), 96, 0.0),
    "b3-hybrid-fp32-G160": (3, "hybrid", "fp32", (3, 320), 160, 0.0),
    "b4-asym-eta.1-bf16-G128": (4, "asym", "bf16", (6, 256), 128, 0.1),
    "b4-hybrid-fp16": (4, "hybrid", "fp16", (2, 2, 5, 64), 32, 0.0),
    "b4-sym-fp16-1d": (4, "sym", "fp16", (64,), 32, 0.0),
}


@pytest.mark.parametrize("name", QUANT_CASES)
def test_quantize_and_dequantize_match_reference(name):
    bits, mode, dt, shape, G, eta = QUANT_CASES[name]
    g = gen(seed_for(name))
    x = torch.randn(shape, generator=g).reshape(-1, shape[-1])  # rows
    x[::2] += 2.0  # positive rows: hybrid chooses asym there
    x[1::3, :G] = 0.0  # all-zero groups
    x[0, G - 32 : G] = -0.75  # a constant block
    x[-1, :G] = 1.5  # a constant group (asym s == 0: hybrid stores -0.0)
    x = x.reshape(shape).to(DTYPES[dt])

    got = tk.quantize_groups(x.to(DEVICE), bits, G, mode, eta)
    _assert_matches_reference(x, bits, G, mode, eta, got)
    c, s, z = got
    out = tk.dequantize_groups(c, s, None if mode == "sym" else z, bits, G, mode)
    assert out.dtype == torch.float32 and out.shape == x.shape
    assert torch.equal(out.cpu(), reference.dequantize_groups(c.cpu(), s.cpu(), z.cpu(), bits, G, mode))


@pytest.mark.parametrize("bits, mode", [(3, "hybrid"), (1, "asym"), (2, "sym")], ids=["b3-hybrid", "b1-asym", "b2-sym"])
def test_quantize_into_narrowed_cache_views(bits, mode):
    # a preallocated cache [B, H, D, cap] quantized along tokens: write columns [64, 128) from a transposed view
    B, H, D, cap, G = 2, 3, 5, 256, 32
    codes = torch.zeros(B, H, D, cap // 32 * bits, dtype=torch.int32, device=DEVICE)
    scales = torch.zeros(B, H, D, cap // G, dtype=torch.float16, device=DEVICE)
    zeros = torch.zeros_like(scales)
    v = torch.randn(B, H, 64, D, generator=gen(bits)) + (1.0 if mode == "hybrid" else 0.0)
    x = v.transpose(-1, -2).to(DEVICE)  # [B, H, D, 64], non-contiguous
    eta = 0.25 if mode == "asym" else 0.0
    w0, w1 = 64 // 32 * bits, 128 // 32 * bits
    tk.quantize_groups_into(x, bits, G, mode, eta, codes[..., w0:w1], scales[..., 2:4], zeros[..., 2:4])
    _assert_matches_reference(x, bits, G, mode, eta, (codes[..., w0:w1], scales[..., 2:4], zeros[..., 2:4]))
    assert not codes[..., :w0].any() and not codes[..., w1:].any(), "write spilled outside the view"
    assert not scales[..., :2].any() and not scales[..., 4:].any(), "write spilled outside the view"

    # dequantize reads the same narrowed views
    out = tk.dequantize_groups(codes[..., w0:w1], scales[..., 2:4], zeros[..., 2:4], bits, G, mode)
    c, s, z = (t.contiguous().cpu() for t in (codes[..., w0:w1], scales[..., 2:4], zeros[..., 2:4]))
    assert torch.equal(out.cpu(), reference.dequantize_groups(c, s, z, bits, G, mode))


def test_quantize_many_unmergeable_leading_dims():
    # 5-D permuted input: more than three leading dims that cannot merge -> contiguous fallback, same result
    x = torch.randn(2, 3, 2, 3, 2, 64, generator=gen(5)).permute(4, 3, 2, 1, 0, 5).to(DEVICE)
    got = tk.quantize_groups(x, 2, 32, "hybrid")
    _assert_matches_reference(x, 2, 32, "hybrid", 0.0, got)
    c, s, z = got
    codes, scales, zeros = torch.empty_like(c), torch.empty_like(s), torch.empty_like(z)
    args = (codes.permute(0, 1, 2, 4, 3, 5), scales.permute(0, 1, 2, 4, 3, 5), zeros.permute(0, 1, 2, 4, 3, 5))
    tk.quantize_groups_into(x.permute(0, 1, 2, 4, 3, 5), 2, 32, "hybrid", 0.0, *args)
    assert torch.equal(codes, c) and _same_bits(scales, s) and _same_bits(zeros, z)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy on NaN
def test_quantize_nan_stays_in_its_group():
    x = torch.randn(2, 128, generator=gen(3))
    x[0, 5] = float("nan")
    for mode in ("sym", "asym", "hybrid"):
        c, s, z = tk.quantize_groups(x.to(DEVICE), 2, 32, mode)
        c_ref, s_ref, z_ref = reference.quantize_groups(x, 2, 32, mode)
        assert torch.isnan(s[0, 0].float()).item()
        assert _same_bits(s[:, 1:], s_ref[:, 1:]) and _same_bits(s[1], s_ref[1])
        assert torch.equal(c.cpu(), c_ref)


def test_rejects_bad_arguments():
    x = torch.randn(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="bits must be one of"):
        tk.quantize_groups(x, 5, 32, "sym")
    c, s, z = reference.quantize_groups(torch.randn(1, 2, 8, 64), 2, 32, "asym")
    with pytest.raises(ValueError, match="zeros is required"):
        tk.gemv_inner_q(torch.randn(1, 2, 64, device=DEVICE), c.to(DEVICE), s.to(DEVICE), None, 2, 32, "asym")
    with pytest.raises(ValueError, match="codes rows R"):
        tk.gemv_kivi(torch.randn(1, 2, 7, device=DEVICE), c.to(DEVICE), s.to(DEVICE), z.to(DEVICE), 2, 32)
