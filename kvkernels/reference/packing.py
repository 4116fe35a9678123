"""Packed 1/2/3/4-bit storage, reference implementation (the spec for csrc/kvkernels/packing.cuh).

Values are packed along the last dim in blocks of 32; a block of b-bit values is exactly b int32 words.
b in {1, 2, 4}: value i sits in word i // (32 // b) at bit (i % (32 // b)) * b, LSB first.
b = 3: a 2-bit plane then a 1-bit plane per block: words 0-1 are the 2-bit packing of (v & 3), word 2 is the
1-bit packing of (v >> 2). Every unpack is a shift and a mask; no value straddles two words.
"""

import torch

BLOCK = 32
SUPPORTED_BITS = (1, 2, 3, 4)


def _pack_plane(codes: torch.Tensor, bits: int) -> torch.Tensor:
    # codes: int64 [..., N] with values < 2^bits, bits in {1, 2, 4}  ->  int32 [..., N * bits // 32]
    per_word = 32 // bits
    shifts = torch.arange(per_word, device=codes.device, dtype=torch.int64) * bits
    words = (codes.unflatten(-1, (-1, per_word)) << shifts).sum(-1)  # disjoint bit fields: sum == or
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _unpack_plane(words: torch.Tensor, bits: int) -> torch.Tensor:
    # words: int32 [..., W]  ->  int64 [..., W * 32 // bits]
    per_word = 32 // bits
    shifts = torch.arange(per_word, device=words.device, dtype=torch.int64) * bits
    w = words.to(torch.int64) & 0xFFFFFFFF
    return ((w.unsqueeze(-1) >> shifts) & (2**bits - 1)).flatten(-2)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [..., N] integers in [0, 2^bits), N % 32 == 0  ->  int32 words [..., N * bits / 32].

    A code outside the range keeps its low `bits` bits (two's complement), as in csrc/kvkernels/packing.cuh.
    """
    c = codes.to(torch.int64) & (2**bits - 1)
    if bits != 3:
        return _pack_plane(c, bits)
    blocks = c.unflatten(-1, (-1, BLOCK))  # [..., nblocks, 32]
    lo = _pack_plane(blocks & 3, 2)  # [..., nblocks, 2]
    hi = _pack_plane(blocks >> 2, 1)  # [..., nblocks, 1]
    return torch.cat([lo, hi], dim=-1).flatten(-2)


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words [..., W], W % bits == 0  ->  uint8 codes [..., W * 32 / bits]."""
    if bits != 3:
        return _unpack_plane(packed, bits).to(torch.uint8)
    blocks = packed.unflatten(-1, (-1, 3))  # [..., nblocks, 3]
    lo = _unpack_plane(blocks[..., :2], 2)  # [..., nblocks, 32]
    hi = _unpack_plane(blocks[..., 2:], 1)
    return (lo | (hi << 2)).flatten(-2).to(torch.uint8)
