"""aqua_reconstruct: the reference against its definition (float64, explicit concatenation), validation on every
entry point, and the Triton kernel against the reference over awkward shapes (CPU under TRITON_INTERPRET=1)."""

import pytest
import torch
from triton_helpers import DEVICE, TRITON_MARK, gen, place, seed_for, tk

import kvkernels
from kvkernels import reference
from kvkernels.formats.lattice_grids import grid as lattice_grid

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# |got - want| <= RTOL * (sum_i |prev_i W_ci| + |deq|) + ATOL: the operands enter exactly (fp16 / bf16 values cast
# to fp32), so the difference is fp32 accumulation order (and the epilogue's butterfly, identical to the reference)
RTOL = {"fp32": 1e-5, "fp16": 1e-5, "bf16": 1e-5}
ATOL = 1e-5


def _case(T, C_in, C, G=64, grid_dn=(2, 16), dtype="fp32", two=False, C_in2=None, with_signs=False, seed=0):
    g = gen(seed)
    grid = lattice_grid(*grid_dn)
    signs = (torch.randint(0, 2, (G,), generator=g) * 2 - 1).to(torch.int8) if with_signs else None
    codes, norms = reference.lattice_quantize(torch.randn(T, C, generator=g), grid, G, signs)
    dt = DTYPES[dtype]
    prev = torch.randn(T, C_in, generator=g).to(dt)
    weight = (torch.randn(C, C_in, generator=g) / C_in**0.5).to(dt)
    bias = torch.randn(C, generator=g)
    prev2 = weight2 = None
    if two:
        C_in2 = C_in2 or C
        prev2 = torch.randn(T, C_in2, generator=g).to(dt)
        weight2 = (torch.randn(C, C_in2, generator=g) / C_in2**0.5).to(dt)
    return dict(
        prev=prev, weight=weight, bias=bias, codes=codes, norms=norms, grid=grid, group_size=G, signs=signs,
        prev2=prev2, weight2=weight2,
    )  # fmt: skip


def _definition64(a) -> tuple[torch.Tensor, torch.Tensor]:
    """The formula in float64 with the concatenation formed: (value, magnitude for the tolerance)."""
    x = a["prev"].double()
    w = a["weight"].double()
    if a["prev2"] is not None:
        x = torch.cat([x, a["prev2"].double()], dim=1)  # [k_hat ; v_prev_hat], keys first
        w = torch.cat([w, a["weight2"].double()], dim=1)
    deq = reference.lattice_dequantize(a["codes"], a["norms"], a["grid"], a["group_size"], a["signs"]).double()
    return x @ w.T + a["bias"].double() + deq, x.abs() @ w.abs().T + deq.abs() + a["bias"].double().abs()


@pytest.mark.parametrize("two", [False, True], ids=["keys", "values-two-gemms"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_reference_matches_definition(two, dtype):
    a = _case(7, 96, 128, dtype=dtype, two=two, with_signs=True, seed=3)
    want, mag = _definition64(a)
    got = reference.aqua_reconstruct(**a)
    assert got.dtype == torch.float32 and got.shape == (7, 128)
    assert ((got.double() - want).abs() <= 1e-5 * mag + 1e-6).all()


def test_registered_op_runs_the_reference_on_cpu():
    a = _case(5, 64, 64, two=True)
    assert torch.equal(kvkernels.aqua_reconstruct(**a), reference.aqua_reconstruct(**a))
    assert torch.equal(torch.ops.kvkernels.aqua_reconstruct(*a.values()), reference.aqua_reconstruct(**a))


def test_nan_stays_in_its_row():
    a = _case(6, 64, 128)
    a["prev"][2, 5] = float("nan")
    a["norms"][4, 1] = float("inf")
    out = kvkernels.aqua_reconstruct(**a)
    assert out[2].isnan().all()
    assert not out[4, 64:].isfinite().any() and out[4, :64].isfinite().all()
    assert out[[0, 1, 3, 5]].isfinite().all()


def test_fake_gives_the_shape():
    a = _case(5, 64, 128, two=True)
    meta = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
    out = torch.ops.kvkernels.aqua_reconstruct(*meta.values())
    assert out.shape == (5, 128) and out.dtype == torch.float32 and out.device.type == "meta"


@pytest.mark.parametrize(
    "change, exc, match",
    [
        (dict(prev=lambda a: a["prev"][0]), ValueError, "prev must be 2-D"),
        (dict(prev=lambda a: a["prev"].long()), TypeError, "prev must be float16"),
        (dict(weight=lambda a: a["weight"].half()), TypeError, "weight must be float32"),
        (dict(weight=lambda a: a["weight"][:, :-1]), ValueError, "disagree on C_in"),
        (dict(bias=lambda a: a["bias"].half()), TypeError, "bias must be float32"),
        (dict(bias=lambda a: a["bias"][:-1]), ValueError, "bias must have shape"),
        (dict(codes=lambda a: a["codes"][:-1]), ValueError, "codes must have shape"),
        (dict(codes=lambda a: a["codes"].long()), TypeError, "codes must be int32"),
        (dict(norms=lambda a: a["norms"].float()), TypeError, "norms must be float16"),
        (dict(group_size=48), ValueError, "power of two"),
        (dict(grid=lambda a: a["grid"][:10]), ValueError, "grid must be"),
        (dict(prev2=None), ValueError, "both or neither"),
        (dict(prev2=lambda a: a["prev2"][:-1]), ValueError, "prev2 must have 5 rows"),
        (dict(weight2=lambda a: a["weight2"][:, :-1]), ValueError, "prev2 .* and weight2 .* disagree"),
        (dict(weight2=lambda a: a["weight2"][:-1]), ValueError, "weight2 must have 128 rows"),
        (dict(prev2=lambda a: a["prev2"].half()), TypeError, "prev2 must be float32"),
        (dict(prev=lambda a: a["prev"].T.contiguous().T), ValueError, "stride 1"),
        (dict(signs=torch.ones(32, dtype=torch.int8)), ValueError, "signs must have shape"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_validation(change, exc, match):
    a = _case(5, 64, 128, two=True)
    for k, v in change.items():
        a[k] = v(a) if callable(v) else v
    with pytest.raises(exc, match=match):
        kvkernels.aqua_reconstruct(**a)
    with pytest.raises(exc, match=match):  # the kernel registered behind torch.ops validates the same way
        torch.ops.kvkernels.aqua_reconstruct(*a.values())


def test_required_tensor_none_is_a_type_error():
    a = _case(5, 64, 64)
    a["bias"] = None
    with pytest.raises(TypeError, match="bias must be a tensor"):
        torch.ops.kvkernels.aqua_reconstruct(*a.values())


# ---------------------------------------------------------------------------------------------------------
# Triton

# id: (T, C_in, C, G, grid (d, n), dtype, two GEMMs, C_in2, signs, strided)
TRITON_CASES = {
    "keys-T1-C192-fp32": (1, 192, 192, 64, (2, 16), "fp32", False, None, False, False),
    "values-T37-C192-fp16-signs": (37, 192, 192, 64, (2, 16), "fp16", True, None, True, False),
    "values-T130-C128-bf16-4bit-strided": (130, 128, 128, 64, (2, 256), "bf16", True, None, False, True),
    "keys-T5-Cin40-C96-G32-3bit": (5, 40, 96, 32, (2, 64), "fp32", False, None, True, True),
    "values-T17-Cin2-72-C256-G128-d4": (17, 64, 256, 128, (4, 256), "fp16", True, 72, False, False),
    "keys-T64-Cin1-C64-fp16-strided": (64, 1, 64, 64, (2, 16), "fp16", False, None, False, True),
}


@TRITON_MARK
@pytest.mark.parametrize("name", TRITON_CASES)
def test_triton_matches_reference(name):
    T, C_in, C, G, grid_dn, dtype, two, C_in2, with_signs, as_strided = TRITON_CASES[name]
    seed = seed_for(name)
    a = _case(T, C_in, C, G, grid_dn, dtype, two, C_in2, with_signs, seed)
    want = reference.aqua_reconstruct(**a)
    _, mag = _definition64(a)
    placed = {
        k: (place(v, as_strided and v.dim() == 2, seed + i) if isinstance(v, torch.Tensor) else v)
        for i, (k, v) in enumerate(a.items())
    }
    got = tk.aqua_reconstruct(**placed).cpu()
    assert got.shape == want.shape and got.dtype == torch.float32
    bad = (got - want).abs() > RTOL[dtype] * mag.float() + ATOL
    assert not bad.any(), f"max |diff| {(got - want).abs().max():.3g}, {int(bad.sum())} bad"


@TRITON_MARK
def test_triton_empty():
    a = _case(0, 64, 64)
    assert tk.aqua_reconstruct(
        **{k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
    ).shape == (0, 64)
