"""Group quantizers: C++ (csrc/kvkernels/quant.cuh) vs the reference, formulas, edge cases, bad input."""

import pytest
import torch

import kvkernels
from kvkernels import reference

MODES = ("sym", "asym", "hybrid")
BITS = (1, 2, 3, 4)


def _data(shape, kind, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind == "gaussian":
        return torch.randn(shape, generator=g)
    if kind == "positive":  # favours asym: hybrid must pick it
        return torch.rand(shape, generator=g) + 2.0
    if kind == "outliers":
        x = torch.randn(shape, generator=g)
        x[..., ::17] *= 30
        return x
    raise ValueError(kind)


def _mismatched_hybrid_groups_are_ties(x, bits, G, mismatch):
    # hybrid picks by summed squared error; C++ sums sequentially, torch may sum in another order, so a group
    # can only flip where the two errors are equal to fp32 rounding
    xg = x.float().unflatten(-1, (-1, G))
    _, _, _, err_s = reference.quant._sym(xg, bits)
    _, _, _, _, err_a = reference.quant._asym(xg, bits)
    gap = (err_s - err_a).abs() / (err_s.abs() + err_a.abs() + 1e-30)
    return bool((gap[mismatch] < 1e-5).all())


@pytest.mark.parametrize("kind", ["gaussian", "positive", "outliers"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_cpp_matches_reference(bits, mode, kind, dtype):
    G = 64 if bits == 4 else 32
    x = _data((3, 5, 4 * G), kind, seed=bits).to(dtype)
    c_ref, s_ref, z_ref = reference.quantize_groups(x, bits, G, mode)
    c_cpp, s_cpp, z_cpp = kvkernels.quantize_groups(x, bits, G, mode)
    same_scale = s_ref.view(torch.int16) == s_cpp.view(torch.int16)
    if mode == "hybrid" and not same_scale.all():
        assert _mismatched_hybrid_groups_are_ties(x, bits, G, ~same_scale)
        return
    assert same_scale.all()
    assert torch.equal(z_ref.view(torch.int16), z_cpp.view(torch.int16))
    assert torch.equal(c_ref, c_cpp)
    assert torch.equal(
        reference.dequantize_groups(c_ref, s_ref, z_ref, bits, G, mode),
        kvkernels.dequantize_groups(c_cpp, s_cpp, z_cpp, bits, G, mode),
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bits", (2, 3, 4))
def test_error_within_half_step(bits, mode):
    # every value lies within half a quantization step of its reconstruction (plus fp16 rounding of s and z)
    G = 32
    x = _data((4, 8 * G), "gaussian", seed=7)
    c, s, z = kvkernels.quantize_groups(x, bits, G, mode)
    err = (kvkernels.dequantize_groups(c, s, z, bits, G, mode) - x).abs().unflatten(-1, (-1, G)).amax(-1)
    step = s.float().abs()
    sym_clip = torch.where(torch.signbit(s) | (torch.tensor(mode == "asym")), 0.0, step)  # sym top level clips 1 step
    assert (err <= 0.5 * step + sym_clip + 1e-3 * x.abs().max()).all()


def test_hybrid_picks_asym_for_positive_groups_and_flags_sign_bit():
    on_sym_grid = (torch.arange(32) % 4 - 2).float().unsqueeze(0) * 0.5  # exactly the sym 2-bit levels
    x = torch.cat([_data((1, 32), "positive"), on_sym_grid], dim=-1)
    _, s, z = kvkernels.quantize_groups(x, 2, 32, "hybrid")
    assert torch.signbit(s[0, 0]) and z[0, 0] != 0  # positive group: asym, mask in the sign bit
    assert not torch.signbit(s[0, 1]) and z[0, 1] == 0  # centred group: sym, zero stored as 0


# fp16-representable constants, large and small, both signs (K/V caches hold fp16/bf16 values)
CONSTANTS = (1.25, -3.0, 0.3, -0.007, 1000.0, 5e-3)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_zero_and_constant_groups_are_exact(bits, mode, dtype):
    x = torch.zeros(1 + len(CONSTANTS), 32)
    for i, c in enumerate(CONSTANTS):
        x[1 + i] = c
    x = x.half().float().flatten().unsqueeze(0).to(dtype)  # one row: an all-zero group, then one group per constant
    for impl in (reference, kvkernels):
        c, s, z = impl.quantize_groups(x, bits, 32, mode)
        y = impl.dequantize_groups(c, s, z, bits, 32, mode)
        assert torch.isfinite(y).all()
        if mode == "sym" and bits == 1:
            # 1-bit sym has the levels {-s, 0}: zero and negative constants are exact, a positive one reads 0
            want = torch.where(x.float() > 0, 0.0, x.float())
            assert torch.equal(y, want), (impl.__name__, y.unflatten(-1, (-1, 32))[..., 0])
        else:
            assert torch.equal(y, x.float()), (impl.__name__, y.unflatten(-1, (-1, 32))[..., 0])


def test_sym_constant_group_rule_is_the_only_change():
    # a group that is constant except for one value keeps the ordinary max|x| / 2^(b-1) scale
    x = torch.full((1, 32), 1.25)
    x[0, 7] = 1.0
    _, s, _ = kvkernels.quantize_groups(x, 3, 32, "sym")
    assert s.item() == 1.25 / 4
    _, s, _ = kvkernels.quantize_groups(torch.full((1, 32), 1.25), 3, 32, "sym")
    assert s.item() == 1.25 / 2


@pytest.mark.parametrize("bits", BITS)
def test_eta_zero_is_the_min_max_formula(bits):
    # eta = 0 stores exactly z = fp16(min), s = fp16(fp32(max - min) / (2^b - 1)), on the C++ op and the reference
    x = _data((4, 8, 64), "outliers", seed=bits)
    xg = x.unflatten(-1, (-1, 32))
    mn, mx = xg.amin(-1), xg.amax(-1)
    want_s = ((mx - mn) / (2**bits - 1)).half()
    for impl in (reference, kvkernels):
        _, s, z = impl.quantize_groups(x, bits, 32, "asym", 0.0)
        assert torch.equal(z.view(torch.int16), mn.half().view(torch.int16))
        assert torch.equal(s.view(torch.int16), want_s.view(torch.int16))


@pytest.mark.parametrize("eta", [0.1, 0.25, 1 / 3, 0.4999])
@pytest.mark.parametrize("bits", BITS)
def test_cpp_matches_reference_calibrated(bits, eta):
    # 1 - 2 eta is rounded once from double on both sides (quant.cuh asym_calib); in fp32 from fp32(eta) it would
    # differ in the last bit near eta = 0.5 (eta = 0.4999 caught that)
    x = _data((3, 16, 128), "outliers", seed=17)
    ref = reference.quantize_groups(x, bits, 32, "asym", eta)
    cpp = kvkernels.quantize_groups(x, bits, 32, "asym", eta)
    assert torch.equal(ref[0], cpp[0])
    for a, b in zip(ref[1:], cpp[1:], strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_eta_zero_is_plain_asym_and_spececache_midpoints():
    x = _data((4, 64), "gaussian", seed=11)
    plain = kvkernels.quantize_groups(x, 2, 32, "asym")
    eta0 = kvkernels.quantize_groups(x, 2, 32, "asym", eta=0.0)
    assert all(
        torch.equal(
            a.view(torch.int16) if a.dtype == torch.float16 else a,
            b.view(torch.int16) if b.dtype == torch.float16 else b,
        )
        for a, b in zip(plain, eta0, strict=True)
    )
    # 1-bit with eta = 1/4: z' = (3 min + max) / 4, s' = (max - min) / 2  (SpeCache eq. 3)
    c, s, z = kvkernels.quantize_groups(x, 1, 32, "asym", eta=0.25)
    xg = x.unflatten(-1, (-1, 32))
    mn = xg.amin(-1).half().float()
    mx = mn + ((xg.amax(-1) - xg.amin(-1)).half().float())
    torch.testing.assert_close(z.float(), ((3 * mn + mx) / 4).half().float(), rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(s.float(), ((mx - mn) / 2).half().float(), rtol=1e-3, atol=1e-3)
    y = kvkernels.dequantize_groups(c, s, z, 1, 32, "asym").unflatten(-1, (-1, 32))
    levels = torch.stack([z.float(), z.float() + s.float()], -1)  # the two midpoints
    assert ((y.unsqueeze(-1) - levels.unsqueeze(-2)).abs().amin(-1) < 1e-6).all()
    # the calibrated midpoints beat plain 1-bit min/max on Gaussian data
    err_eta = ((kvkernels.dequantize_groups(c, s, z, 1, 32, "asym") - x) ** 2).mean()
    err_0 = ((kvkernels.dequantize_groups(*kvkernels.quantize_groups(x, 1, 32, "asym"), 1, 32, "asym") - x) ** 2).mean()
    assert err_eta < err_0


def test_quantize_into_narrowed_views():
    # a preallocated store [B, H, D, cap] quantized along tokens: write columns [64, 128) of a transposed view
    B, H, D, cap, G, bits = 2, 3, 8, 256, 32, 3
    codes = torch.zeros(B, H, D, cap // 32 * bits, dtype=torch.int32)
    scales = torch.zeros(B, H, D, cap // G, dtype=torch.float16)
    zeros = torch.zeros_like(scales)
    v = torch.randn(B, H, 64, D)  # 64 new tokens, stored transposed
    x = v.transpose(-1, -2)  # [B, H, D, 64], non-contiguous
    kvkernels.quantize_groups_into(x, bits, G, "hybrid", 0.0, codes[..., 6:12], scales[..., 2:4], zeros[..., 2:4])
    c_ref, s_ref, z_ref = reference.quantize_groups(x.contiguous(), bits, G, "hybrid")
    assert torch.equal(scales[..., 2:4].view(torch.int16), s_ref.view(torch.int16))
    assert torch.equal(codes[..., 6:12], c_ref)
    assert torch.equal(zeros[..., 2:4], z_ref)
    assert not codes[..., :6].any() and not codes[..., 12:].any(), "write spilled outside the view"


def test_nan_rejected_by_default_and_confined_when_unchecked():
    x = torch.randn(2, 128)
    x[0, 5] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        kvkernels.quantize_groups(x, 2, 32, "sym")
    with pytest.raises(ValueError, match="NaN or Inf"):
        kvkernels.quantize_groups(torch.full((32,), float("inf")), 2, 32, "asym")
    c, s, z = kvkernels.quantize_groups(x, 2, 32, "sym", check_values=False)
    y = kvkernels.dequantize_groups(c, s, z, 2, 32, "sym")
    assert not torch.isfinite(y[0, :32]).all()  # the poisoned group
    assert torch.isfinite(y[0, 32:]).all() and torch.isfinite(y[1]).all()  # nothing else


def test_rejects_values_beyond_fp16_scale_range():
    with pytest.raises(ValueError, match="fp16"):
        kvkernels.quantize_groups(torch.full((32,), 1e6), 4, 32, "asym")


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(bits=5), ValueError, "bits must be one of"),
        (dict(group_size=48), ValueError, "multiple of 32"),
        (dict(group_size=64, x=torch.randn(4, 96)), ValueError, "multiple of group_size"),
        (dict(mode="nf4"), ValueError, "mode must be one of"),
        (dict(x=torch.randint(0, 3, (4, 64))), TypeError, "x must be"),
        (dict(eta=0.25), ValueError, "eta applies to asym"),
        (dict(eta=0.6, mode="asym"), ValueError, "eta must be in"),
    ],
    ids=["bits5", "G48", "L-not-multiple", "bad-mode", "int-x", "eta-sym", "eta-range"],
)
def test_quantize_bad_input(kwargs, exc, match):
    args = dict(x=torch.randn(4, 64), bits=2, group_size=32, mode="sym")
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        kvkernels.quantize_groups(**args)
