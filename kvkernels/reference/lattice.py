"""Lattice (HIGGS-style) vector quantization, reference implementation: the executable spec of docs/FORMATS.md
("Lattice") and the CPU backend of fwht, lattice_quantize, lattice_dequantize, gemv_lattice_k and gemv_lattice_v.

A row of C values is cut into groups of G (a power of two, 32..1024). Per group, with H_n = H / sqrt(G) the
orthonormal Sylvester-Hadamard matrix (symmetric, H_n H_n = I) and s the sign vector (+1 unless `signs` is given):

    y = H_n (s * x)                                      rotate (fwht)
    r = ||x|| / sqrt(G)                                  the RMS, stored as fp16 `norms`
    u = y / r   (0 where r == 0)                         ~ N(0, 1) per coordinate for Gaussian-like x
    c_j = argmax_c 2 <u_j, grid[c]> - |grid[c]|^2        per d-vector u_j = u[d j : d j + d], first max on ties
    x_hat = s * H_n (r16 * grid[c])                      dequantize (r16: the stored fp16 norm)

Grids are fp32 [n, d] with (d, n) in GRID_BITS (kvkernels.formats.lattice_grids holds the published ones); the
index of a d-vector takes log2(n) bits, `bits` = log2(n) / d per value, and a row of C values packs into
C * bits / 32 int32 words (pack_lattice_indices). All arithmetic is fp32; outputs are fp32 (norms fp16).
NaN policy: a NaN score never wins, so a d-vector whose u holds a NaN (its group of x holds a NaN or an Inf) gets
index 0, and the group's norm is stored as computed (NaN or Inf); the other groups are unaffected.
"""

import math

import torch

from .gemv import _as_4d, _by_kv_head

BLOCK = 32  # values per packing block, as in every other format: a block of `bits`-bit values is `bits` words
GRID_BITS = {(2, 16): 2, (2, 64): 3, (2, 256): 4, (4, 256): 2}  # (d, n) -> bits per value, log2(n) / d
ARGMAX_CHUNK = 1 << 15  # d-vectors scored at a time by lattice_quantize: [chunk, n] fp32 scores, 32 MiB at n = 256


def grid_layout(grid: torch.Tensor) -> tuple[int, int, int]:
    """(d, index_bits, bits) of a grid [n, d]: values per index, bits per index (log2 n), bits per value."""
    n, d = grid.shape
    return d, int(math.log2(n)), GRID_BITS[(d, n)]


# ---- the rotation -----------------------------------------------------------------------------------------------


def _inv_sqrt(group_size: int) -> float:
    # the fp32 nearest to 1/sqrt(G) (exact for G = 4^k); every backend multiplies by this constant once at the end
    return float(torch.tensor(1.0 / math.sqrt(group_size), dtype=torch.float32))


def _butterflies(v: torch.Tensor) -> torch.Tensor:
    """Unnormalized Sylvester-Hadamard transform H v along the last dim (a power of two), fp32.

    Stage h = 1, 2, 4, ..., G/2 maps each pair (a, b) = (v[i], v[i + h]), i % 2h < h, to (a + b, a - b): the
    order FORMATS.md fixes, so every backend's fp32 rounding is the same.
    """
    G = v.shape[-1]
    lead = v.shape[:-1]
    h = 1
    while h < G:
        pairs = v.reshape(*lead, G // (2 * h), 2, h)  # [..., block, (a | b), i within the half block]
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        v = torch.stack((a + b, a - b), dim=-2).reshape(*lead, G)
        h *= 2
    return v


def fwht(x: torch.Tensor, group_size: int, signs: torch.Tensor | None = None, inverse: bool = False) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform of each group of G values along the last dim: fp32 [..., C].

    forward: y = H_n (s * x_g);  inverse: x_g = s * (H_n y)  (H_n is its own inverse). signs: None or int8 [G].
    """
    G = group_size
    C = x.shape[-1]
    v = x.to(torch.float32).reshape(*x.shape[:-1], C // G, G)  # [..., groups, G]
    s = None if signs is None else signs.to(device=v.device, dtype=torch.float32)
    if s is not None and not inverse:
        v = v * s
    v = _butterflies(v) * _inv_sqrt(G)
    if s is not None and inverse:
        v = v * s
    return v.reshape(x.shape).contiguous()


# ---- packing of indices -------------------------------------------------------------------------------------------


def _indices_per_block(index_bits: int) -> int:
    # indices per run of whole words: 8 or 4 per word for 4 / 8 bits; 16 per 3 words for 6 bits (FLUTE's layout)
    if index_bits == 6:
        return 16
    if index_bits in (4, 8):
        return 32 // index_bits
    raise ValueError(f"index_bits must be 4, 6 or 8, got {index_bits}")


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    # int64 holding 32-bit patterns -> int32 with the same bits
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_lattice_indices(indices: torch.Tensor, index_bits: int) -> torch.Tensor:
    """Grid indices [..., K] (integers; values keep their low index_bits bits) -> int32 words [..., K*index_bits/32].

    4 / 8 bits: index j in word j // (32 / b), bits b * (j % (32 / b)) .. + b - 1 (LSB first); K % (32 / b) == 0.
    6 bits (FLUTE): per 16 indices, 3 words; index j < 15 in word j // 5, bits 6 (j % 5) .. + 5; index 15's bits
    2w, 2w + 1 in bits 30, 31 of word w (w = 0, 1, 2); K % 16 == 0. No index straddles two words.
    """
    per_block = _indices_per_block(index_bits)
    K = indices.shape[-1]
    if K % per_block:
        raise ValueError(f"pack_lattice_indices: {index_bits}-bit indices come in runs of {per_block}, got K={K}")
    c = indices.to(torch.int64) & (2**index_bits - 1)
    lead = c.shape[:-1]
    if index_bits != 6:
        fields = c.reshape(*lead, K // per_block, per_block)
        shifts = torch.arange(per_block, device=c.device, dtype=torch.int64) * index_bits
        words = (fields << shifts).sum(-1)  # disjoint bit fields: sum == or
        return _to_int32(words)
    blocks = c.reshape(*lead, K // 16, 16)
    five = blocks[..., :15].reshape(*lead, K // 16, 3, 5)  # indices 0..14: five to a word
    words = (five << (torch.arange(5, device=c.device, dtype=torch.int64) * 6)).sum(-1)  # [..., blocks, 3]
    last = blocks[..., 15:]  # [..., blocks, 1]: its 2-bit pieces, low first, go to words 0, 1, 2
    pieces = (last >> (torch.arange(3, device=c.device, dtype=torch.int64) * 2)) & 3
    words = words | (pieces << 30)
    return _to_int32(words.reshape(*lead, K // 16 * 3))


def unpack_lattice_indices(words: torch.Tensor, index_bits: int) -> torch.Tensor:
    """int32 words [..., W] -> grid indices int64 [..., W * 32 / index_bits] (int64: ready to index a grid)."""
    per_block = _indices_per_block(index_bits)
    words_per_block = per_block * index_bits // 32
    W = words.shape[-1]
    if W % words_per_block:
        raise ValueError(f"unpack_lattice_indices: {index_bits}-bit words come in runs of {words_per_block}, got {W}")
    w = words.to(torch.int64) & 0xFFFFFFFF
    lead = w.shape[:-1]
    mask = 2**index_bits - 1
    if index_bits != 6:
        shifts = torch.arange(per_block, device=w.device, dtype=torch.int64) * index_bits
        return ((w.unsqueeze(-1) >> shifts) & mask).reshape(*lead, W * per_block)
    blocks = w.reshape(*lead, W // 3, 3)
    five = (blocks.unsqueeze(-1) >> (torch.arange(5, device=w.device, dtype=torch.int64) * 6)) & mask
    pieces = (blocks >> 30) << (torch.arange(3, device=w.device, dtype=torch.int64) * 2)  # bits 30-31 -> 2w, 2w + 1
    last = pieces.sum(-1, keepdim=True)  # [..., blocks, 1]
    return torch.cat((five.reshape(*lead, W // 3, 15), last), dim=-1).reshape(*lead, W // 3 * 16)


# ---- quantize / dequantize ----------------------------------------------------------------------------------------


def _dot_in_order(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # sum_k a[..., k] * b[..., k] in fp32, k = 0, 1, ..., d - 1 left to right, each product rounded (no FMA): the same
    # rounding for every grid row. A matmul would not do: BLAS kernels round columns differently (a grid with two
    # equal rows gave them different scores), which breaks "first maximum on ties".
    total = a[..., 0] * b[..., 0]
    for k in range(1, a.shape[-1]):
        total = total + a[..., k] * b[..., k]
    return total


def nearest_grid_indices(u: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """u fp32 [M, d] -> int64 [M]: argmax_c 2 <u_m, grid[c]> - |grid[c]|^2, the first maximum on ties.

    Both sums run over k = 0 .. d-1 in order (_dot_in_order). A NaN score never wins (as in a kernel's
    `if (score > best)` scan from best = -inf, index 0), so a u_m holding a NaN, whose scores are all NaN, gets
    index 0. Scored ARGMAX_CHUNK rows at a time to bound the [M, n] scores.
    """
    sq_norms = _dot_in_order(grid, grid)  # [n]
    out = torch.empty(u.shape[0], dtype=torch.int64, device=u.device)
    for start in range(0, u.shape[0], ARGMAX_CHUNK):
        part = u[start : start + ARGMAX_CHUNK].unsqueeze(1)  # [chunk, 1, d]
        scores = 2 * _dot_in_order(part, grid) - sq_norms  # [chunk, n]
        scores = torch.where(scores.isnan(), -torch.inf, scores)  # torch.argmax would pick the first NaN
        out[start : start + ARGMAX_CHUNK] = scores.argmax(-1)  # the first maximum
    return out


def lattice_quantize(
    x: torch.Tensor, grid: torch.Tensor, group_size: int, signs: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., C] -> (codes int32 [..., C * bits / 32], norms fp16 [..., C / G])."""
    G = group_size
    d, index_bits, _ = grid_layout(grid)
    lead, C = x.shape[:-1], x.shape[-1]
    xg = x.to(torch.float32).reshape(*lead, C // G, G)  # [..., groups, G]
    r = xg.square().sum(-1).sqrt() * _inv_sqrt(G)  # [..., groups]: the RMS, from the unrotated x
    y = fwht(xg, G, signs)  # [..., groups, G]
    zero = (r == 0).unsqueeze(-1)  # a zero group gets u = 0; a NaN r (non-finite x) keeps u = NaN: index 0
    u = torch.where(zero, torch.zeros_like(y), y / torch.where(zero, 1.0, r.unsqueeze(-1)))
    idx = nearest_grid_indices(u.reshape(-1, d), grid.to(torch.float32))  # [all d-vectors]
    codes = pack_lattice_indices(idx.reshape(*lead, C // d), index_bits)
    return codes, r.to(torch.float16)


def _grid_values(codes: torch.Tensor, grid: torch.Tensor, index_bits: int) -> torch.Tensor:
    # codes int32 [..., W] -> the grid points they name, fp32 [..., C] (still rotated and unscaled)
    idx = unpack_lattice_indices(codes, index_bits)  # [..., C / d]
    # index_select on the flat indices: the same gather as grid[idx], several times faster on CPU
    points = grid.to(torch.float32).index_select(0, idx.reshape(-1))
    return points.reshape(*codes.shape[:-1], idx.shape[-1] * grid.shape[1])


def lattice_dequantize(
    codes: torch.Tensor, norms: torch.Tensor, grid: torch.Tensor, group_size: int, signs: torch.Tensor | None = None
) -> torch.Tensor:
    """Inverse of lattice_quantize: x_hat = s * H_n (r16 * grid[c]) per group, fp32 [..., C]."""
    G = group_size
    _, index_bits, _ = grid_layout(grid)
    g = _grid_values(codes, grid, index_bits)  # [..., C]
    lead, C = g.shape[:-1], g.shape[-1]
    scaled = g.reshape(*lead, C // G, G) * norms.to(torch.float32).unsqueeze(-1)  # r16 * grid[c]
    return fwht(scaled.reshape(*lead, C), G, signs, inverse=True)


# ---- the fused GEMVs ----------------------------------------------------------------------------------------------


def gemv_lattice_k(
    q: torch.Tensor,
    codes: torch.Tensor,
    norms: torch.Tensor,
    grid: torch.Tensor,
    group_size: int,
    signs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Key scores on the codes: scores[b, h, t, n] = sum_g r16[n, g] * <q'_g, grid[c_{n, g}]>, q'_g = H_n (s * q_g).

    Equals q . x_hat_n, because H_n is symmetric and orthonormal: q . (s * H_n v) = (H_n (s * q)) . v. No key is
    dequantized: each query row is rotated once. q [B, H_q, (T,) D]; codes [B, H_kv, N, D * bits / 32];
    norms fp16 [B, H_kv, N, D / G]; query head h reads KV head h // (H_q / H_kv). fp32 [B, H_q, (T,) N].
    """
    G = group_size
    _, index_bits, _ = grid_layout(grid)
    q4, has_t = _as_4d(q)
    B, H_q, T, D = q4.shape
    H_kv, N = codes.shape[1], codes.shape[2]
    groups = D // G
    q_rot = fwht(q4, G, signs)  # [B, H_q, T, D]
    # per KV head and group, one matmul: the rows of its query heads (they sit together) against its tokens
    q_g = q_rot.reshape(B, H_kv, H_q // H_kv * T, groups, G).transpose(2, 3)  # [B, H_kv, groups, rows, G]
    points = _grid_values(codes, grid, index_bits)  # [B, H_kv, N, D]: rotated, unscaled keys
    k_g = points.reshape(B, H_kv, N, groups, G).permute(0, 1, 3, 4, 2)  # [B, H_kv, groups, G, N]
    r16 = norms.to(torch.float32).permute(0, 1, 3, 2).unsqueeze(3)  # [B, H_kv, groups, 1, N]
    scores = ((q_g @ k_g) * r16).sum(2).reshape(B, H_q, T, N)
    return (scores if has_t else scores.squeeze(2)).contiguous()


def gemv_lattice_v(
    p: torch.Tensor,
    codes: torch.Tensor,
    norms: torch.Tensor,
    grid: torch.Tensor,
    group_size: int,
    signs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Values in the rotated domain: out[b, h, t] = s * H_n (sum_n p[b, h, t, n] r16[n, g] grid[c_{n, g}]) per group.

    Equals sum_n p[n] x_hat_n (the transform is linear): the tokens are summed first and each output row takes one
    inverse transform. p [B, H_q, (T,) N]; codes [B, H_kv, N, D * bits / 32]; norms fp16 [B, H_kv, N, D / G].
    fp32 [B, H_q, (T,) D]; zeros when N == 0.
    """
    G = group_size
    _, index_bits, _ = grid_layout(grid)
    p4, has_t = _as_4d(p)
    B, H_q, T, N = p4.shape
    H_kv = codes.shape[1]
    points = _grid_values(codes, grid, index_bits)  # [B, H_kv, N, D]
    D = points.shape[-1]
    scaled = (points.reshape(B, H_kv, N, D // G, G) * norms.to(torch.float32).unsqueeze(-1)).reshape(B, H_kv, N, D)
    pg = _by_kv_head(p4.to(torch.float32), H_kv)  # [B, H_kv, H_q / H_kv * T, N]
    acc = pg @ scaled  # [B, H_kv, H_q / H_kv * T, D]: sum_n p[n] r16[n] grid[c_n], still rotated
    out = fwht(acc.reshape(B, H_q, T, D), G, signs, inverse=True)
    return (out if has_t else out.squeeze(2)).contiguous()
