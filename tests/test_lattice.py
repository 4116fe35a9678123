"""Lattice (HIGGS-style) ops: the grids, the reference against explicit definitions, packing, the GEMVs, registration.

Definitions used as oracles here are built independently of kvkernels/reference/lattice.py: an explicit float64
Sylvester-Hadamard matrix instead of butterflies, brute-force distances instead of the score argmax, bit positions
one index at a time instead of shifts over tensors. docs/FORMATS.md ("Lattice") is the spec.
Slow tests (`pytest -m slow tests/test_lattice.py` or KVKERNELS_SLOW=1, about a minute and a half): the bigger grids'
reproduction by lloyd_grid; skipped otherwise, as in tests/test_quality_eval.py.
"""

import hashlib
import math

import pytest
import torch
from kernel_bounds import assert_lattice_norms_match, lattice_gemv_bound

import kvkernels
from kvkernels import _validate, ops, reference
from kvkernels.formats import lattice_grids
from kvkernels.formats.lattice_grids import BITS, PUBLISHED_MSE, gaussian_mse, grid, lloyd_grid
from kvkernels.reference import lattice as ref_lattice

GRIDS = sorted(BITS)  # (d, n)
GRID_IDS = [f"d{d}n{n}" for d, n in GRIDS]
EPS32 = 2.0**-23


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def sylvester(G: int) -> torch.Tensor:
    """The unnormalized Sylvester-Hadamard matrix, float64 [G, G]: H_1 = [1], H_2k = [[H_k, H_k], [H_k, -H_k]]."""
    H = torch.ones(1, 1, dtype=torch.float64)
    while H.shape[0] < G:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    return H


def random_signs(G, seed=0):
    return (torch.randint(0, 2, (G,), generator=_gen(seed)) * 2 - 1).to(torch.int8)


def index_bits(d, n):
    return int(math.log2(n))


def explicit_u(x, G, signs=None):
    """float64 (u [..., C], r [..., C/G]): u = H_n (s x_g) / r, r = ||x_g|| / sqrt(G), u = 0 where r == 0."""
    xg = x.double().reshape(*x.shape[:-1], x.shape[-1] // G, G)
    s = torch.ones(G, dtype=torch.float64) if signs is None else signs.double()
    y = (xg * s) @ sylvester(G) / math.sqrt(G)
    r = xg.norm(dim=-1) / math.sqrt(G)
    u = torch.where(r.unsqueeze(-1) == 0, 0.0, y / torch.where(r == 0, 1.0, r).unsqueeze(-1))
    return u.reshape(x.shape), r


def brute_force_nearest(u, g):
    """(first argmin index, squared distances [M, n]) of every d-vector of u [..., C], float64."""
    d = g.shape[1]
    dist = ((u.reshape(-1, 1, d) - g.double().unsqueeze(0)) ** 2).sum(-1)  # [M, n]
    return dist.argmin(-1), dist  # torch.argmin returns the first minimum


def assert_nearest(idx, u, g, tol=1e-5):
    """Every index names a nearest grid point: its distance is the minimum up to tol (fp32 near-ties, FORMATS.md), and
    where the best two points are further apart than that, it is exactly the brute-force first argmin."""
    want, dist = brute_force_nearest(u, g)
    mine = dist.gather(1, idx.reshape(-1, 1)).squeeze(1)
    best = dist.min(-1).values
    assert bool((mine <= best + tol).all()), f"{int((mine > best + tol).sum())} indices are not nearest"
    second = dist.sort(-1).values[:, 1]
    clear = second - best > tol
    assert torch.equal(idx.reshape(-1)[clear], want[clear])
    return clear


def explicit_dequantize(codes, norms, g, G, signs=None):
    """float64 s * H_n (r16 * grid[c]) from unpacked indices."""
    n, d = g.shape
    idx = unpack_by_the_letter(codes, index_bits(d, n))
    pts = g.double()[idx].reshape(*codes.shape[:-1], -1)
    v = pts.reshape(*pts.shape[:-1], -1, G) * norms.double().unsqueeze(-1)
    s = torch.ones(G, dtype=torch.float64) if signs is None else signs.double()
    return ((v @ sylvester(G) / math.sqrt(G)) * s).reshape(pts.shape)


# ---- grids -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d, n", GRIDS, ids=GRID_IDS)
def test_grid_data(d, n):
    g = grid(d, n)
    assert g.shape == (n, d) and g.dtype == torch.float32 and g.is_contiguous()
    assert hashlib.sha256(g.numpy().tobytes()).hexdigest() == lattice_grids.SHA256[(d, n)]
    assert len({tuple(row) for row in g.tolist()}) == n, "grid points are distinct"
    assert bits_ok(d, n)
    g.add_(1.0)  # a fresh copy each call: modifying one leaves the cached table alone
    assert hashlib.sha256(grid(d, n).numpy().tobytes()).hexdigest() == lattice_grids.SHA256[(d, n)]


def bits_ok(d, n):
    return lattice_grids.bits_of(d, n) == math.log2(n) / d == _validate.LATTICE_GRIDS[(d, n)]


def test_grid_tables_agree():
    # the grid module, the reference and the validation each name the allowed grids; they must agree
    assert BITS == ref_lattice.GRID_BITS == _validate.LATTICE_GRIDS
    with pytest.raises(ValueError, match="no published lattice grid"):
        grid(2, 32)
    with pytest.raises(ValueError, match="no published lattice grid"):
        lattice_grids.bits_of(4, 16)


@pytest.mark.parametrize("d, n", [(2, 16), (2, 64), (2, 256)], ids=GRID_IDS[:3])
def test_grid_matches_transformers(d, n):
    higgs = pytest.importorskip("transformers.integrations.higgs")
    assert torch.equal(grid(d, n), higgs.get_higgs_grid(d, n).to(torch.float32))


@pytest.mark.parametrize("d, n", GRIDS, ids=GRID_IDS)
def test_grid_mse_matches_published(d, n):
    # the MSE per coordinate on N(0, 1) the research notes measured (4M samples); 1M coordinates here: a standard
    # error of about 0.15%
    assert gaussian_mse(grid(d, n), 1_000_000 // d, seed=1) == pytest.approx(PUBLISHED_MSE[(d, n)], rel=0.01)


def test_grid_2_16_has_a_point_at_the_origin():
    # a zero group (u = 0) takes the point nearest the origin; EDEN2-16's is within 0.0012 of it
    assert grid(2, 16).norm(dim=1).min() < 2e-3


def _lloyd_within_one_percent(d, n, **kwargs):
    mine = gaussian_mse(lloyd_grid(d, n, seed=0, **kwargs), 500_000, seed=7)
    published = gaussian_mse(grid(d, n), 500_000, seed=7)  # same samples: the ratio's noise mostly cancels
    assert mine == pytest.approx(published, rel=0.01), (mine, published)


def test_lloyd_reproduces_the_2_16_grid():
    # fast settings (about a second): 8 starts, 60 steps of 20k samples, two polish steps
    _lloyd_within_one_percent(2, 16, steps=30, samples_per_step=20_000, search_steps=30)


def test_lloyd_is_seeded():
    a = lloyd_grid(2, 16, seed=3, steps=2, samples_per_step=1000, restarts=2, search_steps=2, polish_samples=2000)
    b = lloyd_grid(2, 16, seed=3, steps=2, samples_per_step=1000, restarts=2, search_steps=2, polish_samples=2000)
    c = lloyd_grid(2, 16, seed=4, steps=2, samples_per_step=1000, restarts=2, search_steps=2, polish_samples=2000)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.shape == (16, 2) and a.dtype == torch.float32


@pytest.mark.slow
@pytest.mark.parametrize(
    "d, n, kwargs",
    [
        (2, 64, {}),  # measured: 0.02965 vs 0.02962, 10 s
        (2, 256, {"restarts": 1, "search_steps": 0}),  # 0.00778 vs 0.00774, 30 s: many points, local optima close
        (4, 256, {"restarts": 1, "search_steps": 0}),  # 0.0965 vs 0.0964, 35 s
    ],
    ids=["d2n64", "d2n256", "d4n256"],
)
def test_lloyd_reproduces_the_bigger_grids(d, n, kwargs):
    _lloyd_within_one_percent(d, n, **kwargs)


# ---- fwht --------------------------------------------------------------------------------------------------------


def butterflies_by_the_letter(v):
    """FORMATS.md step 1 word for word, on one fp32 vector: stage h = 1, 2, ..., G/2 maps each pair (y[i], y[i + h]),
    i % 2h < h, to (a + b, a - b); then one multiply by the fp32 nearest 1/sqrt(G)."""
    G = v.shape[-1]
    y = v.clone()
    h = 1
    while h < G:
        i = torch.tensor([i for i in range(G) if i % (2 * h) < h])
        a, b = y[..., i], y[..., i + h]
        y[..., i], y[..., i + h] = a + b, a - b
        h *= 2
    return y * torch.tensor(1 / math.sqrt(G), dtype=torch.float32)


@pytest.mark.parametrize("G", [32, 64, 128, 256, 512, 1024])
def test_fwht_is_the_sylvester_matrix(G):
    x = torch.randn(3, 2, 2 * G, generator=_gen(G))  # two groups per row
    y = reference.fwht(x, G)
    H_n = sylvester(G) / math.sqrt(G)
    assert torch.equal(H_n, H_n.T) and torch.allclose(H_n @ H_n, torch.eye(G, dtype=torch.float64))
    want = (x.double().reshape(3, 2, 2, G) @ H_n).reshape(x.shape)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), want, rtol=0, atol=(math.log2(G) + 2) * EPS32 * x.abs().max() * 4)


@pytest.mark.parametrize("G", [32, 128, 1024])
def test_fwht_butterfly_order_is_bit_exact(G):
    # the stage order is part of the spec: every backend rounds the same way
    x = torch.randn(4, G, generator=_gen(1))
    assert torch.equal(reference.fwht(x, G), butterflies_by_the_letter(x))


@pytest.mark.parametrize("G", [32, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_fwht_inverse_and_signs(G, dtype):
    x = torch.randn(5, 3 * G, generator=_gen(2)).to(dtype)
    s = random_signs(G, seed=G)
    y = reference.fwht(x, G, s)
    xg = x.double().reshape(5, 3, G)
    want = ((xg * s.double()) @ sylvester(G) / math.sqrt(G)).reshape(x.shape)  # H_n (s * x)
    torch.testing.assert_close(y.double(), want, rtol=0, atol=1e-5)
    back = reference.fwht(y, G, s, inverse=True)  # s * (H_n y)
    torch.testing.assert_close(back, x.float(), rtol=0, atol=1e-5)
    inv = ((xg @ sylvester(G) / math.sqrt(G)) * s.double()).reshape(x.shape)
    torch.testing.assert_close(reference.fwht(x, G, s, inverse=True).double(), inv, rtol=0, atol=1e-5)
    assert torch.equal(ops.fwht(x, G, s), y) and torch.equal(ops.fwht(y, G, s, inverse=True), back)


# ---- packing -----------------------------------------------------------------------------------------------------


def pack_by_the_letter(idx, b):
    """FORMATS.md's packing table, one index at a time with Python ints: [K] -> list of uint32 words."""
    idx = [int(v) for v in idx]
    if b in (4, 8):
        per_word = 32 // b
        words = [0] * (len(idx) // per_word)
        for j, v in enumerate(idx):
            words[j // per_word] |= v << (b * (j % per_word))
        return words
    words = [0] * (len(idx) // 16 * 3)
    for k in range(len(idx) // 16):  # 16 indices per 3 words
        block = idx[16 * k : 16 * k + 16]
        for j in range(15):
            words[3 * k + j // 5] |= block[j] << (6 * (j % 5))
        for w in range(3):  # index 15's bits 2w, 2w + 1 in bits 30-31 of word w
            words[3 * k + w] |= ((block[15] >> (2 * w)) & 3) << 30
    return words


def unpack_by_the_letter(codes, b):
    """int32 [..., W] -> int64 [..., W * 32 / b], one index at a time."""
    flat = codes.reshape(-1, codes.shape[-1]).tolist()
    rows = []
    for row in flat:
        row = [w & 0xFFFFFFFF for w in row]
        if b in (4, 8):
            rows.append(
                [(row[j // (32 // b)] >> (b * (j % (32 // b)))) & (2**b - 1) for j in range(len(row) * 32 // b)]
            )
            continue
        out = []
        for k in range(len(row) // 3):
            words = row[3 * k : 3 * k + 3]
            out += [(words[j // 5] >> (6 * (j % 5))) & 63 for j in range(15)]
            out.append(sum(((words[w] >> 30) & 3) << (2 * w) for w in range(3)))
        rows.append(out)
    return torch.tensor(rows, dtype=torch.int64).reshape(*codes.shape[:-1], codes.shape[-1] * 32 // b)


def as_int32(words):
    return torch.tensor([w - 2**32 if w >= 2**31 else w for w in words], dtype=torch.int32)


@pytest.mark.parametrize("b", [4, 6, 8])
@pytest.mark.parametrize("fill", ["random", "all-ones", "zeros"])
def test_pack_unpack_bit_exact(b, fill):
    K = 96  # 6 runs of 16 indices; 12 words of 4-bit, 24 of 8-bit
    idx = {
        "random": torch.randint(0, 2**b, (3, 2, K), generator=_gen(b)),
        "all-ones": torch.full((3, 2, K), 2**b - 1),
        "zeros": torch.zeros(3, 2, K, dtype=torch.int64),
    }[fill]
    words = reference.pack_lattice_indices(idx, b)
    assert words.dtype == torch.int32 and words.shape == (3, 2, K * b // 32)
    for row_idx, row_words in zip(idx.reshape(-1, K), words.reshape(-1, K * b // 32), strict=True):
        assert torch.equal(row_words, as_int32(pack_by_the_letter(row_idx, b)))
    assert torch.equal(reference.unpack_lattice_indices(words, b), idx)
    assert torch.equal(unpack_by_the_letter(words, b), idx)
    if fill == "all-ones":
        assert bool((words == -1).all()), "every bit is used"


def test_pack_6bit_worked_example():
    # indices 1, 2, ..., 15 and then 54 = 0b11_01_10: its 2-bit pieces 10, 01, 11 (low first) go to bits 30-31
    # of words 0, 1, 2
    idx = torch.tensor([*range(1, 16), 54])
    want = [
        1 | 2 << 6 | 3 << 12 | 4 << 18 | 5 << 24 | 0b10 << 30,
        6 | 7 << 6 | 8 << 12 | 9 << 18 | 10 << 24 | 0b01 << 30,
        11 | 12 << 6 | 13 << 12 | 14 << 18 | 15 << 24 | 0b11 << 30,
    ]
    assert want == [0x85103081, 0x4A2481C6, 0xCF38D30B]  # the same words, as a reader would write them down
    words = reference.pack_lattice_indices(idx, 6)
    assert torch.equal(words, as_int32(want))
    assert torch.equal(reference.unpack_lattice_indices(words, 6), idx)


def test_pack_keeps_the_low_bits_and_checks_lengths():
    idx = torch.tensor([17, -1] * 8)  # 17 = 0b1_0001 -> 1 at 4 bits; -1 -> 15
    assert torch.equal(reference.unpack_lattice_indices(reference.pack_lattice_indices(idx, 4), 4),
                       torch.tensor([1, 15] * 8))  # fmt: skip
    with pytest.raises(ValueError, match="runs of 16"):
        reference.pack_lattice_indices(torch.zeros(8, dtype=torch.int64), 6)
    with pytest.raises(ValueError, match="index_bits must be 4, 6 or 8"):
        reference.pack_lattice_indices(torch.zeros(8, dtype=torch.int64), 5)


# ---- quantize / dequantize ---------------------------------------------------------------------------------------


def quantized_indices(x, g, G, signs=None):
    codes, norms = reference.lattice_quantize(x, g, G, signs)
    d, n = g.shape[1], g.shape[0]
    return unpack_by_the_letter(codes, index_bits(d, n)), norms


@pytest.mark.parametrize("d, n", GRIDS, ids=GRID_IDS)
@pytest.mark.parametrize("G, signed", [(32, False), (128, True), (1024, False)], ids=["G32", "G128-signs", "G1024"])
def test_quantize_is_the_nearest_grid_point(d, n, G, signed):
    g = grid(d, n)
    signs = random_signs(G, seed=5) if signed else None
    x = torch.randn(6, 2048, generator=_gen(d * n + G)) * 3
    idx, norms = quantized_indices(x, g, G, signs)
    u, r = explicit_u(x, G, signs)
    clear = assert_nearest(idx, u, g)
    assert clear.float().mean() > 0.999  # near-ties are rare: the comparison above is not vacuous
    torch.testing.assert_close(norms.double(), r.to(torch.float16).double(), rtol=2**-10, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_quantize_half_inputs(dtype):
    g = grid(2, 64)
    x = torch.randn(4, 256, generator=_gen(3)).to(dtype)
    idx, norms = quantized_indices(x, g, 128)
    assert_nearest(idx, explicit_u(x, 128)[0], g)
    assert torch.equal(ops.lattice_quantize(x, g, 128)[0], reference.lattice_quantize(x.float(), g, 128)[0])


def test_ties_go_to_the_lowest_index():
    # a grid with two equal rows gives them bit-identical scores (the reference sums over d in a fixed order, the
    # same for every row): the lower index must win every time, and the higher never appears
    g = grid(2, 16)
    x = torch.randn(8, 64, generator=_gen(4))
    u = explicit_u(x, 32)[0]
    idx, _ = quantized_indices(x, g, 32)
    for low, high in ((4, 15), (0, 9)):
        dup = g.clone()
        dup[high] = g[low]
        idx_dup, _ = quantized_indices(x, dup, 32)
        assert bool((idx_dup == low).any()) and not bool((idx_dup == high).any())
        assert_nearest(idx_dup, u, dup)
        assert torch.equal(idx_dup[idx == low], idx[idx == low])  # the lower copy keeps every vector it had
    # equidistant distinct points: u = 0 (a zero group) sits between +-v; the lower index wins, in either order
    sym = torch.rand(16, 2, generator=_gen(6)) + 3  # every other point far from the origin
    sym[5], sym[9] = torch.tensor([0.5, -0.25]), torch.tensor([-0.5, 0.25])
    zero = torch.zeros(1, 32)
    assert bool((quantized_indices(zero, sym, 32)[0] == 5).all())
    sym[5], sym[9] = sym[9].clone(), sym[5].clone()
    assert bool((quantized_indices(zero, sym, 32)[0] == 5).all())


@pytest.mark.parametrize("d, n", GRIDS, ids=GRID_IDS)
def test_aqua_kv_convention_gives_the_same_codes(d, n):
    # AQUA-KV divides the unnormalized H x by ||x||; we divide H_n x by ||x|| / sqrt(G): the same u, the same codes,
    # and AQUA-KV's scale is sqrt(G) times our norm
    G = 128
    g = grid(d, n)
    x = torch.randn(16, 256, generator=_gen(8))
    xg = x.double().reshape(16, 2, G)
    aqua_u = (xg @ sylvester(G)) / xg.norm(dim=-1, keepdim=True)
    idx, norms = quantized_indices(x, g, G)
    assert_nearest(idx, aqua_u.reshape(x.shape), g)
    torch.testing.assert_close(norms.double() * math.sqrt(G), xg.norm(dim=-1), rtol=2**-10, atol=0)


@pytest.mark.parametrize("d, n", GRIDS, ids=GRID_IDS)
def test_scale_invariance(d, n):
    g = grid(d, n)
    x = torch.randn(8, 256, generator=_gen(9))
    idx, norms = quantized_indices(x, g, 64)
    for a in (0.25, 8.0):  # powers of two scale every fp32 step exactly: the same codes, norms scaled exactly
        idx_a, norms_a = quantized_indices(x * a, g, 64)
        assert torch.equal(idx_a, idx) and torch.equal(norms_a, (norms.float() * a).half())
    idx_a, norms_a = quantized_indices(x * 3.7, g, 64)  # otherwise only near-ties may move
    assert (idx_a != idx).float().mean() < 1e-3
    assert_nearest(idx_a, explicit_u(x * 3.7, 64)[0], g)
    torch.testing.assert_close(norms_a.float(), norms.float() * 3.7, rtol=2**-9, atol=0)


@pytest.mark.parametrize("d, n", GRIDS, ids=GRID_IDS)
def test_zero_groups(d, n):
    g = grid(d, n)
    x = torch.randn(3, 128, generator=_gen(10))
    x[1, 32:64] = 0  # one zero group among others
    x[2] = 0  # a zero row
    codes, norms = reference.lattice_quantize(x, g, 32)
    assert bool((norms[1, 1] == 0) & (norms[2] == 0).all())
    origin = int(g.double().norm(dim=1).argmin())
    idx = unpack_by_the_letter(codes, index_bits(d, n)).reshape(3, 4, -1)
    assert bool((idx[1, 1] == origin).all()) and bool((idx[2] == origin).all())
    deq = reference.lattice_dequantize(codes, norms, g, 32)
    assert not deq.isnan().any()
    assert bool((deq[1, 32:64] == 0).all()) and bool((deq[2] == 0).all())
    others = reference.lattice_quantize(x[:1], g, 32)
    assert torch.equal(others[0], codes[:1]) and torch.equal(others[1], norms[:1])


def test_non_finite_groups_stay_in_their_group():
    # FORMATS.md NaN policy: a NaN or Inf makes its group's norm NaN/Inf and its indices 0; other groups unaffected
    g = grid(2, 16)
    x = torch.randn(2, 96, generator=_gen(11))
    clean_codes, clean_norms = reference.lattice_quantize(x, g, 32)
    x[0, 40], x[1, 70] = float("nan"), float("inf")
    codes, norms = ops.lattice_quantize(x, g, 32, check_values=False)
    assert norms[0, 1].isnan() and norms[1, 2].isinf()
    idx = unpack_by_the_letter(codes, 4).reshape(2, 3, 16)
    assert bool((idx[0, 1] == 0).all()) and bool((idx[1, 2] == 0).all())
    clean_idx = unpack_by_the_letter(clean_codes, 4).reshape(2, 3, 16)
    for row, bad in ((0, 1), (1, 2)):
        keep = [k for k in range(3) if k != bad]
        assert torch.equal(idx[row, keep], clean_idx[row, keep])
        assert torch.equal(norms[row, keep], clean_norms[row, keep])
    with pytest.raises(ValueError, match="kvkernels.lattice_quantize: x contains NaN or Inf"):
        ops.lattice_quantize(x, g, 32)


@pytest.mark.parametrize("d, n", GRIDS, ids=GRID_IDS)
@pytest.mark.parametrize("G, signed", [(32, True), (256, False)], ids=["G32-signs", "G256"])
def test_dequantize_is_the_definition(d, n, G, signed):
    g = grid(d, n)
    signs = random_signs(G, seed=12) if signed else None
    x = torch.randn(2, 3, 512, generator=_gen(13))
    codes, norms = reference.lattice_quantize(x, g, G, signs)
    got = ops.lattice_dequantize(codes, norms, g, G, signs)
    assert got.dtype == torch.float32 and got.shape == x.shape
    torch.testing.assert_close(got.double(), explicit_dequantize(codes, norms, g, G, signs), rtol=0, atol=1e-5)


@pytest.mark.parametrize("d, n", GRIDS, ids=GRID_IDS)
@pytest.mark.parametrize("G", [128, 1024])
def test_roundtrip_error_is_the_grid_mse(d, n, G):
    # research notes 4.6(c): the relative squared error of Gaussian 1024-vectors is the grid's MSE per coordinate
    # (the rotation keeps a Gaussian Gaussian; the norm is stored to fp16, ~2^-11, which adds nothing visible)
    g = grid(d, n)
    x = torch.randn(256, 1024, generator=_gen(14))
    codes, norms = ops.lattice_quantize(x, g, G)
    err = ((ops.lattice_dequantize(codes, norms, g, G) - x) ** 2).sum() / (x**2).sum()
    assert float(err) == pytest.approx(PUBLISHED_MSE[(d, n)], rel=0.03)


@pytest.mark.parametrize("d, n", [(2, 16), (2, 256), (4, 256)], ids=["d2n16", "d2n256", "d4n256"])
@pytest.mark.parametrize("H_kv, D, G", [(8, 128, 1024), (4, 128, 512), (2, 64, 128)])
def test_cross_head_rows(d, n, H_kv, D, G):
    # the format's cross-head mode quantizes a token's H_kv * head_dim channels as one row, in groups spanning heads
    g = grid(d, n)
    kv = torch.randn(2, H_kv, 9, D, generator=_gen(15))  # [B, H_kv, N, D]
    rows = kv.permute(0, 2, 1, 3).reshape(2, 9, H_kv * D)  # [B, N, H_kv * D]
    codes, norms = ops.lattice_quantize(rows, g, G)
    assert codes.shape == (2, 9, H_kv * D * BITS[(d, n)] // 32) and norms.shape == (2, 9, H_kv * D // G)
    deq = ops.lattice_dequantize(codes, norms, g, G)
    torch.testing.assert_close(deq.double(), explicit_dequantize(codes, norms, g, G), rtol=0, atol=1e-5)
    err = ((deq - rows) ** 2).sum() / (rows**2).sum()
    assert float(err) == pytest.approx(PUBLISHED_MSE[(d, n)], rel=0.1)
    back = deq.reshape(2, 9, H_kv, D).permute(0, 2, 1, 3)  # as the format reads it back per head
    assert back.shape == kv.shape


# ---- GEMVs -------------------------------------------------------------------------------------------------------


def lattice_cache(B, H_kv, N, D, G, d=2, n=16, signs=None, seed=0):
    g = grid(d, n)
    kv = torch.randn(B, H_kv, N, D, generator=_gen(seed))
    codes, norms = reference.lattice_quantize(kv, g, G, signs)
    return codes, norms, g


def explicit_gemvs(act, codes, norms, g, G, signs, keys: bool):
    """float64 q . x_hat (keys) or sum_n p[n] x_hat_n (values), dequantize-then-matmul, query head h on KV head
    h // (H_q / H_kv)."""
    x_hat = explicit_dequantize(codes, norms, g, G, signs)  # [B, H_kv, N, D]
    a4 = act if act.dim() == 4 else act.unsqueeze(2)
    B, H_q, T, _ = a4.shape
    H_kv = codes.shape[1]
    out = torch.zeros(B, H_q, T, x_hat.shape[2] if keys else x_hat.shape[3], dtype=torch.float64)
    for h in range(H_q):
        kv = x_hat[:, h // (H_q // H_kv)]  # [B, N, D]
        a = a4[:, h].double()  # [B, T, D or N]
        out[:, h] = a @ kv.transpose(-1, -2) if keys else a @ kv
    return out if act.dim() == 4 else out.squeeze(2)


# (id, B, H_q, H_kv, T, N, D, G, grid): GQA, with and without T, one token, N a prime, several groups per head
GEMV_CASES = [
    ("mha-noT", 2, 2, 2, None, 37, 128, 128, (2, 16)),
    ("gqa4-T3", 1, 8, 2, 3, 50, 128, 64, (2, 64)),
    ("gqa3-N1", 2, 6, 2, None, 1, 64, 32, (2, 256)),
    ("groups4-d4", 1, 4, 1, 2, 23, 256, 64, (4, 256)),
    ("G32-odd-N", 3, 3, 1, 5, 11, 96, 32, (2, 16)),
]


@pytest.mark.parametrize("signed", [False, True], ids=["no-signs", "signs"])
@pytest.mark.parametrize("case", GEMV_CASES, ids=[c[0] for c in GEMV_CASES])
def test_gemvs_are_dequantize_then_matmul(case, signed):
    _, B, H_q, H_kv, T, N, D, G, (d, n) = case
    signs = random_signs(G, seed=16) if signed else None
    codes, norms, g = lattice_cache(B, H_kv, N, D, G, d, n, signs, seed=N)
    lead = (B, H_q) if T is None else (B, H_q, T)
    q = torch.randn(*lead, D, generator=_gen(17))
    p = torch.rand(*lead, N, generator=_gen(18))
    scores = ops.gemv_lattice_k(q, codes, norms, g, G, signs)
    out = ops.gemv_lattice_v(p, codes, norms, g, G, signs)
    assert scores.shape == (*lead, N) and out.shape == (*lead, D)
    assert scores.dtype == out.dtype == torch.float32
    torch.testing.assert_close(
        scores.double(), explicit_gemvs(q, codes, norms, g, G, signs, True), rtol=1e-5, atol=1e-4
    )
    torch.testing.assert_close(out.double(), explicit_gemvs(p, codes, norms, g, G, signs, False), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gemvs_half_activations(dtype):
    codes, norms, g = lattice_cache(1, 2, 19, 128, 64, 2, 64)
    q, p = torch.randn(1, 4, 128).to(dtype), torch.rand(1, 4, 19).to(dtype)
    torch.testing.assert_close(
        ops.gemv_lattice_k(q, codes, norms, g, 64), ops.gemv_lattice_k(q.float(), codes, norms, g, 64)
    )
    torch.testing.assert_close(
        ops.gemv_lattice_v(p, codes, norms, g, 64), ops.gemv_lattice_v(p.float(), codes, norms, g, 64)
    )


@pytest.mark.parametrize("d, n", GRIDS, ids=GRID_IDS)
def test_identity_gemvs_read_back_the_dequantized_cache(d, n):
    # FLUTE's test pattern: an identity matrix through the GEMV reads back what dequantization gives. Values: row t
    # of p = e_t sums exactly one scaled grid vector, so the result is dequantize's bit for bit. Keys: q = e_i
    # scores x_hat_n[i], through a different (rotated) order of operations: fp32-close.
    N, D, G = 24, 128, 64
    signs = random_signs(G, seed=19)
    codes, norms, g = lattice_cache(1, 1, N, D, G, d, n, signs, seed=20)
    deq = ops.lattice_dequantize(codes, norms, g, G, signs)  # [1, 1, N, D]
    out = ops.gemv_lattice_v(torch.eye(N).reshape(1, 1, N, N), codes, norms, g, G, signs)
    assert torch.equal(out, deq)
    scores = ops.gemv_lattice_k(torch.eye(D).reshape(1, 1, D, D), codes, norms, g, G, signs)  # [1, 1, D, N]
    torch.testing.assert_close(scores.transpose(-1, -2), deq, rtol=0, atol=1e-6 * float(deq.abs().max()))


def test_values_gemv_accumulates_before_one_inverse_transform():
    # the value GEMV is linear in p: out(p1 + p2) = out(p1) + out(p2) (up to rounding), and equals the inverse
    # transform of the rotated-domain sum, i.e. fwht(inverse) of sum_n p[n] r16 grid[c]
    codes, norms, g = lattice_cache(1, 1, 30, 64, 32)
    p1, p2 = torch.rand(1, 1, 30, generator=_gen(21)), torch.rand(1, 1, 30, generator=_gen(22))
    torch.testing.assert_close(
        ops.gemv_lattice_v(p1 + p2, codes, norms, g, 32),
        ops.gemv_lattice_v(p1, codes, norms, g, 32) + ops.gemv_lattice_v(p2, codes, norms, g, 32),
    )
    idx = unpack_by_the_letter(codes, 4)  # [1, 1, 30, 32]
    rotated = (g[idx].reshape(1, 1, 30, 2, 32) * norms.float().unsqueeze(-1)).reshape(1, 1, 30, 64)
    acc = (p1.unsqueeze(-2) @ rotated).squeeze(-2)  # [1, 1, 64]
    assert torch.equal(ops.gemv_lattice_v(p1, codes, norms, g, 32), reference.fwht(acc, 32, inverse=True))


# ---- empty shapes --------------------------------------------------------------------------------------------------


def _empty_backends():
    return ["cpu", "reference", "meta"] + (["cuda"] if torch.cuda.is_available() else [])


def _call(backend, op, *args):
    if backend in ("meta", "cuda"):
        args = tuple(a.to(backend) if isinstance(a, torch.Tensor) else a for a in args)
    fn = getattr(reference, op) if backend == "reference" else getattr(torch.ops.kvkernels, op)
    return fn(*args)


# (id, B, H_q, H_kv, T, N, D): an empty output returns an empty tensor; an empty reduction (D = 0 for keys, N = 0
# for values) returns zeros, the value of an empty sum
EMPTY_GEMV = [
    ("batch0", 0, 2, 1, 3, 5, 64),
    ("heads0", 1, 0, 1, 3, 5, 64),
    ("qlen0", 1, 2, 1, 0, 5, 64),
    ("tokens0", 2, 4, 2, 3, 0, 64),
    ("tokens0-3d", 1, 2, 1, None, 0, 128),
    ("dim0", 1, 2, 1, 2, 5, 0),
]


@pytest.mark.parametrize("backend", _empty_backends())
@pytest.mark.parametrize("case", EMPTY_GEMV, ids=[c[0] for c in EMPTY_GEMV])
def test_gemvs_empty(case, backend):
    _, B, H_q, H_kv, T, N, D = case
    G, g = 32, grid(2, 64)
    codes = torch.randint(-(2**31), 2**31, (B, H_kv, N, D // 32 * 3), generator=_gen(23), dtype=torch.int32)
    norms = torch.rand(B, H_kv, N, D // G).half()
    lead = (B, H_q) if T is None else (B, H_q, T)
    scores = _call(backend, "gemv_lattice_k", torch.randn(*lead, D), codes, norms, g, G, None)
    out = _call(backend, "gemv_lattice_v", torch.randn(*lead, N), codes, norms, g, G, None)
    assert scores.shape == (*lead, N) and out.shape == (*lead, D)
    assert scores.dtype == out.dtype == torch.float32
    if backend != "meta":  # an empty reduction sums to zero (an empty output has nothing to compare)
        if not N:
            assert torch.equal(out.cpu(), torch.zeros(out.shape))
        if not D:
            assert torch.equal(scores.cpu(), torch.zeros(scores.shape))


@pytest.mark.parametrize("backend", _empty_backends())
@pytest.mark.parametrize("shape", [(0, 64), (3, 0), (0,), (2, 0, 128), (1, 1, 0)], ids=str)
def test_storage_ops_empty(shape, backend):
    G, g = 32, grid(4, 256)
    x = torch.randn(shape)
    lead, C = shape[:-1], shape[-1]
    assert _call(backend, "fwht", x, G, None, False).shape == shape
    codes, norms = _call(backend, "lattice_quantize", x, g, G, None)
    assert codes.shape == (*lead, C // 32 * 2) and codes.dtype == torch.int32
    assert norms.shape == (*lead, C // G) and norms.dtype == torch.float16
    y = _call(backend, "lattice_dequantize", codes, norms, g, G, None)
    assert y.shape == shape and y.dtype == torch.float32


def test_public_wrappers_empty():
    g = grid(2, 16)
    codes, norms = kvkernels.lattice_quantize(torch.randn(0, 4, 128), g, 128)
    assert kvkernels.lattice_dequantize(codes, norms, g, 128).shape == (0, 4, 128)
    assert kvkernels.fwht(torch.randn(5, 0), 64).shape == (5, 0)


# ---- registration: opcheck, compile, other devices ------------------------------------------------------------------


def _opcheck_cases():
    G, s = 64, random_signs(64, seed=24)
    g2, g4 = grid(2, 64), grid(4, 256)
    x = torch.randn(3, 2, 128, generator=_gen(25))
    codes, norms, g = lattice_cache(2, 2, 7, 128, G, 2, 64, s, seed=26)
    return {
        "fwht": (torch.ops.kvkernels.fwht.default, (x, G, None, False)),
        "fwht-inverse-signs": (torch.ops.kvkernels.fwht.default, (x.half(), G, s, True)),
        "lattice_quantize": (torch.ops.kvkernels.lattice_quantize.default, (x, g4, G, None)),
        "lattice_quantize-signs": (torch.ops.kvkernels.lattice_quantize.default, (x, g2, G, s)),
        "lattice_dequantize": (torch.ops.kvkernels.lattice_dequantize.default, (codes, norms, g, G, s)),
        "gemv_lattice_k": (
            torch.ops.kvkernels.gemv_lattice_k.default,
            (torch.randn(2, 4, 3, 128), codes, norms, g, G, s),
        ),
        "gemv_lattice_v": (
            torch.ops.kvkernels.gemv_lattice_v.default,
            (torch.rand(2, 4, 7).half(), codes, norms, g, G, None),
        ),
    }


@pytest.mark.parametrize("name", list(_opcheck_cases()))
def test_opcheck(name):
    op, args = _opcheck_cases()[name]
    torch.library.opcheck(op, args)


def test_compiles_with_fakes():
    codes, norms, g = lattice_cache(1, 2, 9, 64, 32)
    q = torch.randn(1, 4, 64)

    @torch.compile(fullgraph=True, backend="eager")
    def step(q):
        p = torch.ops.kvkernels.gemv_lattice_k(q * 2, codes, norms, g, 32, None).softmax(-1)
        return torch.ops.kvkernels.gemv_lattice_v(p, codes, norms, g, 32, None)

    p = reference.gemv_lattice_k(q * 2, codes, norms, g, 32).softmax(-1)
    torch.testing.assert_close(step(q), reference.gemv_lattice_v(p, codes, norms, g, 32))


@pytest.mark.parametrize("d, n", GRIDS, ids=GRID_IDS)
def test_cpu_dispatch_is_bit_identical_to_the_reference(d, n):
    # the CPU kernels are C++ where the extension is built (csrc/cpu/lattice_cpu.cpp, ops._CPP_CPU), else the
    # reference itself: either way torch.equal, for every op, grid, G, signs or none, fp16 / strided input, a zero
    # group, T or not
    g = grid(d, n)
    cases = ((32, False, (2, 3, 5, 64)), (64, True, (1, 3, 7, 128)), (128, True, (2, 1, 3, 256)))
    for G, signed, (B, H_kv, N, D) in cases:
        s = random_signs(G, seed=G) if signed else None
        gen = _gen(G + d + n)
        x = torch.randn(B, H_kv, N, D, generator=gen) * (3 * torch.rand(B, H_kv, N, 1, generator=gen))
        x[0, 0, 0, :G] = 0
        for xs in (x, x.half(), x.transpose(1, 2)):
            codes, norms = torch.ops.kvkernels.lattice_quantize(xs, g, G, s)
            want_codes, want_norms = reference.lattice_quantize(xs, g, G, s)
            assert torch.equal(codes, want_codes) and torch.equal(norms, want_norms)
            deq = torch.ops.kvkernels.lattice_dequantize(codes, norms, g, G, s)
            assert torch.equal(deq, reference.lattice_dequantize(codes, norms, g, G, s))
            for inverse in (False, True):
                assert torch.equal(torch.ops.kvkernels.fwht(xs, G, s, inverse), reference.fwht(xs, G, s, inverse))
        codes, norms = reference.lattice_quantize(x, g, G, s)
        for t in ((), (3,)):
            q = torch.randn(B, 3 * H_kv, *t, D, generator=gen)
            p = torch.rand(B, 3 * H_kv, *t, N, generator=gen)
            got_k = torch.ops.kvkernels.gemv_lattice_k(q, codes, norms, g, G, s)
            got_v = torch.ops.kvkernels.gemv_lattice_v(p, codes, norms, g, G, s)
            assert torch.equal(got_k, reference.gemv_lattice_k(q, codes, norms, g, G, s)) and got_k.is_contiguous()
            assert torch.equal(got_v, reference.gemv_lattice_v(p, codes, norms, g, G, s)) and got_v.is_contiguous()


@pytest.mark.skipif(ops._cpu_impl("lattice_quantize") is reference.lattice_quantize, reason="no C++ CPU kernels")
def test_cpu_kernels_keep_direct_calls_memory_safe():
    # kvkernels_cpu::* sit behind the Python checks; called directly they still refuse what would read out of bounds
    codes, norms, g = lattice_cache(1, 2, 6, 128, 64)
    with pytest.raises(RuntimeError, match="norms must be"):
        torch.ops.kvkernels_cpu.gemv_lattice_v(torch.rand(1, 4, 6), codes, norms[:, :1], g, 64)
    with pytest.raises(RuntimeError, match="group_size"):
        torch.ops.kvkernels_cpu.lattice_quantize(torch.randn(3, 96), g, 64)
    with pytest.raises(RuntimeError, match="grid"):
        torch.ops.kvkernels_cpu.lattice_dequantize(codes, norms, g[:5], 64)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("d, n", GRIDS, ids=GRID_IDS)
def test_cuda_matches_the_reference(d, n):
    # whatever serves CUDA (compiled kernels, Triton or the reference; kvkernels.ops.CUDA_IMPL says which)
    G, s = 64, random_signs(64, seed=27)
    g = grid(d, n)
    x = torch.randn(2, 3, 40, 128, generator=_gen(28))
    codes, norms = reference.lattice_quantize(x, g, G, s)
    c_cuda, n_cuda = ops.lattice_quantize(x.cuda(), g.cuda(), G, s.cuda())
    assert_lattice_norms_match(n_cuda, norms, x, G)  # one fp16 step apart on a rounding boundary (FORMATS.md)
    assert_nearest(unpack_by_the_letter(c_cuda.cpu(), index_bits(d, n)), explicit_u(x, G, s)[0], g)
    deq = ops.lattice_dequantize(codes.cuda(), norms.cuda(), g.cuda(), G, s.cuda())
    torch.testing.assert_close(deq.cpu(), reference.lattice_dequantize(codes, norms, g, G, s), rtol=0, atol=1e-5)
    # the GEMVs to the compiled kernels' contract (fp16 grid on tensor cores, ~2^-11 of the rotated magnitude): the
    # first GPU run failed all four grids on rtol 1e-5 / atol 1e-4, which only the reference and Triton can meet
    q, p = torch.randn(2, 6, 128), torch.rand(2, 6, 40)
    args = (codes.cuda(), norms.cuda(), g.cuda(), G, s.cuda())
    for values, a, op, ref_op in ((False, q, ops.gemv_lattice_k, reference.gemv_lattice_k),
                                  (True, p, ops.gemv_lattice_v, reference.gemv_lattice_v)):  # fmt: skip
        err = (op(a.cuda(), *args).cpu() - ref_op(a, codes, norms, g, G, s)).abs()
        bound = lattice_gemv_bound(values, a.unsqueeze(2), codes, norms, g, G, s, 6).squeeze(2)
        assert (err <= bound).all(), f"values={values}: max excess {(err - bound).max().item():.3g}"


# ---- validation ------------------------------------------------------------------------------------------------------


def _k_args():
    codes, norms, g = lattice_cache(1, 2, 6, 128, 64, 2, 64)
    return dict(q=torch.randn(1, 4, 128), codes=codes, norms=norms, grid=g, group_size=64, signs=random_signs(64))


def _v_args():
    a = _k_args()
    return dict(p=torch.rand(1, 4, 6), **{k: v for k, v in a.items() if k != "q"})


def _q_args():
    return dict(x=torch.randn(3, 256), grid=grid(2, 16), group_size=128, signs=None)


def _dq_args():
    codes, norms = reference.lattice_quantize(torch.randn(3, 256), grid(2, 256), 128)
    return dict(codes=codes, norms=norms, grid=grid(2, 256), group_size=128, signs=None)


def _fwht_args():
    return dict(x=torch.randn(3, 256), group_size=64, signs=None, inverse=False)


def _strided(t):
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


ARGS = {"fwht": _fwht_args, "lattice_quantize": _q_args, "lattice_dequantize": _dq_args, "gemv_lattice_k": _k_args,
        "gemv_lattice_v": _v_args}  # fmt: skip

# (op, change, exception, message): each message is checked with the op's name in front
BAD = [
    ("fwht", dict(group_size=48), ValueError, r"group_size must be a power of two in \[32, 1024\], got 48"),
    ("fwht", dict(group_size=16), ValueError, "power of two"),
    ("fwht", dict(group_size=2048), ValueError, "power of two"),
    ("fwht", dict(group_size=512), ValueError, r"x.shape\[-1\]=256 must be a multiple of group_size=512"),
    ("fwht", dict(x=lambda a: a["x"].double()), TypeError, "x must be float16 or bfloat16 or float32, got float64"),
    ("fwht", dict(signs=torch.ones(64, dtype=torch.int32)), TypeError, "signs must be int8, got int32"),
    ("fwht", dict(signs=torch.ones(32, dtype=torch.int8)), ValueError, r"signs must have shape \[64\]"),
    ("fwht", dict(x=lambda a: _strided(a["x"])), ValueError, "x must have stride 1 in its last dim"),
    ("lattice_quantize", dict(grid=lambda a: a["grid"].half()), TypeError, "grid must be float32, got float16"),
    ("lattice_quantize", dict(grid=torch.zeros(32, 2)), ValueError, r"grid must be \[n, d\] with \[n, d\] one of"),
    ("lattice_quantize", dict(grid=torch.zeros(2, 16)), ValueError, r"grid must be \[n, d\]"),
    ("lattice_quantize", dict(grid=lambda a: _strided(a["grid"])), ValueError, "grid must have stride 1"),
    ("lattice_quantize", dict(group_size=96), ValueError, "power of two"),
    ("lattice_quantize", dict(x=torch.randn(3, 96)), ValueError, "must be a multiple of group_size=128"),
    ("lattice_quantize", dict(x=lambda a: a["x"].long()), TypeError, "x must be float16"),
    ("lattice_dequantize", dict(codes=lambda a: a["codes"][..., :-1]), ValueError, "multiple of bits=4"),
    ("lattice_dequantize", dict(codes=lambda a: a["codes"].long()), TypeError, "codes must be int32"),
    ("lattice_dequantize", dict(norms=lambda a: a["norms"].float()), TypeError, "norms must be float16"),
    ("lattice_dequantize", dict(norms=lambda a: a["norms"][..., :1]), ValueError, r"norms must have shape \[3, 2\]"),
    (
        "lattice_dequantize",
        dict(grid=grid(2, 16)),
        ValueError,
        r"C \(values per row\)=128 must be a multiple of group_size=128|norms must have shape",
    ),  # noqa: E501
    ("gemv_lattice_k", dict(codes=lambda a: a["codes"][..., :-1]), ValueError, "D\\*bits/32 = 12 words per row"),
    ("gemv_lattice_k", dict(grid=grid(2, 256)), ValueError, "D\\*bits/32 = 16 words per row"),
    ("gemv_lattice_k", dict(q=lambda a: a["q"][:, :3]), ValueError, "multiple of KV heads"),
    ("gemv_lattice_k", dict(q=lambda a: a["q"][0]), ValueError, r"q must be \[B, H_q, D\] or \[B, H_q, T, D\]"),
    ("gemv_lattice_k", dict(q=lambda a: torch.randn(2, 4, 128)), ValueError, "codes batch 1 != q batch 2"),
    ("gemv_lattice_k", dict(norms=lambda a: a["norms"][:, :, :5]), ValueError, r"norms must have shape \[1, 2, 6, 2\]"),
    (
        "gemv_lattice_k",
        dict(group_size=256),
        ValueError,
        "q.shape\\[-1\\] \\(D\\)=128 must be a multiple of group_size",
    ),
    ("gemv_lattice_k", dict(signs=lambda a: a["signs"].to("meta")), ValueError, "all tensors must be on one device"),
    ("gemv_lattice_v", dict(p=lambda a: a["p"][..., :5]), ValueError, "codes tokens N=6 must equal p.shape\\[-1\\]=5"),
    ("gemv_lattice_v", dict(p=lambda a: a["p"].long()), TypeError, "p must be float16"),
    ("gemv_lattice_v", dict(codes=lambda a: _strided(a["codes"])), ValueError, "codes must have stride 1"),
    ("gemv_lattice_v", dict(grid=None), TypeError, "grid must be a tensor, got None"),
]


def _bad_args(op, change):
    args = ARGS[op]()
    for k, v in change.items():
        args[k] = v(args) if callable(v) else v
    return args


# every bad call on cpu and on meta, except the device-mismatch ones on meta (moving the CPU tensors there puts every
# tensor on one device: nothing left to mismatch)
BAD_ON_DEVICE = [(*b, dev) for b in BAD for dev in ("cpu", "meta") if not (dev == "meta" and "one device" in b[3])]


@pytest.mark.parametrize(
    "op, change, exc, match, device", BAD_ON_DEVICE, ids=[f"{b[0]}-{b[3][:40]}-{b[4]}" for b in BAD_ON_DEVICE]
)
def test_bad_arguments_are_rejected_everywhere(op, change, exc, match, device):
    args = _bad_args(op, change)
    with pytest.raises(exc, match=f"kvkernels.{op}: .*{match}"):
        getattr(ops, op)(**args)  # the public wrapper
    on_device = [a.to(device) if isinstance(a, torch.Tensor) and a.device.type == "cpu" else a for a in args.values()]
    with pytest.raises(exc, match=f"kvkernels.{op}: .*{match}"):
        getattr(torch.ops.kvkernels, op)(*on_device)  # the registered kernel (cpu) or fake (meta)


@pytest.mark.parametrize("op", list(ARGS))
def test_sign_values_are_checked_on_request(op):
    args = ARGS[op]()
    G = args["group_size"]
    args["signs"] = torch.ones(G, dtype=torch.int8)
    args["signs"][3] = 0
    defaults_check = op in ("fwht", "lattice_quantize")  # the decode-path ops do not sync unless asked
    if defaults_check:
        with pytest.raises(ValueError, match=f"kvkernels.{op}: signs must hold only \\+1 and -1, got \\[0\\]"):
            getattr(ops, op)(**args)
    else:
        getattr(ops, op)(**args)
    with pytest.raises(ValueError, match="signs must hold only"):
        getattr(ops, op)(**args, check_values=True)
    getattr(ops, op)(**args, check_values=False)  # the ops multiply by what signs hold


def test_quantize_rejects_norms_beyond_fp16():
    g = grid(2, 16)
    x = torch.full((2, 64), 7e4)
    with pytest.raises(ValueError, match="kvkernels.lattice_quantize: a group's RMS reaches 7e\\+04"):
        ops.lattice_quantize(x, g, 32)
    x[:, 1::2] = 0  # RMS 7e4 / sqrt(2) = 4.9e4: fits
    codes, norms = ops.lattice_quantize(x, g, 32)
    assert bool(norms.isfinite().all())
