"""Packed storage: reference (Python) vs C++ helpers (the header the CUDA kernels use), round trips, bad input."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvkernels
from kvkernels import reference

BITS = (1, 2, 3, 4)


@st.composite
def code_tensors(draw):
    bits = draw(st.sampled_from(BITS))
    lead = draw(st.lists(st.integers(1, 4), min_size=0, max_size=3))
    nblocks = draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (*lead, 32 * nblocks), generator=g, dtype=torch.int64)
    return bits, codes


@settings(max_examples=150, deadline=None)
@given(code_tensors())
def test_round_trip_and_cpp_matches_reference(case):
    bits, codes = case
    packed_ref = reference.pack_bits(codes, bits)
    packed_cpp = kvkernels.pack_bits(codes, bits)
    assert packed_ref.dtype == torch.int32 and packed_ref.shape[-1] == codes.shape[-1] * bits // 32
    assert torch.equal(packed_ref, packed_cpp), "C++ packing.cuh and the Python reference disagree"
    assert torch.equal(reference.unpack_bits(packed_ref, bits).to(torch.int64), codes)
    assert torch.equal(kvkernels.unpack_bits(packed_ref, bits).to(torch.int64), codes)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32, torch.int64])
def test_any_integer_code_dtype(dtype):
    codes = torch.randint(0, 16, (3, 64)).to(dtype)
    assert torch.equal(kvkernels.pack_bits(codes, 4), reference.pack_bits(codes, 4))


def test_three_bit_layout_is_two_planes():
    # value i: low 2 bits in words 0-1 (2-bit packing), high bit in word 2 at bit i (docs/FORMATS.md)
    codes = torch.arange(32) % 8
    words = reference.pack_bits(codes, 3)
    assert words.shape == (3,)
    assert torch.equal(words[:2], reference.pack_bits(codes & 3, 2))
    assert torch.equal(words[2:], reference.pack_bits(codes >> 2, 1))
    # all-ones input sets every bit of all three words
    assert torch.equal(reference.pack_bits(torch.full((32,), 7), 3), torch.full((3,), -1, dtype=torch.int32))


def test_sign_bit_words_round_trip():
    # the top code of a word lands in bit 31: int32 words are negative and must still unpack exactly
    for bits in BITS:
        codes = torch.full((2, 32), 2**bits - 1)
        packed = kvkernels.pack_bits(codes, bits)
        assert (packed < 0).all()
        assert torch.equal(kvkernels.unpack_bits(packed, bits).long(), codes)


@pytest.mark.parametrize("bits", BITS)
def test_rejects_out_of_range_codes(bits):
    with pytest.raises(ValueError, match="codes must be in"):
        kvkernels.pack_bits(torch.full((32,), 2**bits), bits)
    with pytest.raises(ValueError, match="codes must be in"):
        kvkernels.pack_bits(torch.full((32,), -1), bits)


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: kvkernels.pack_bits(torch.zeros(31, dtype=torch.int64), 2), ValueError, "multiple of 32"),
        (lambda: kvkernels.pack_bits(torch.zeros(32), 2), TypeError, "integer tensor"),
        (lambda: kvkernels.pack_bits(torch.zeros(32, dtype=torch.int64), 5), ValueError, "bits must be one of"),
        (lambda: kvkernels.pack_bits(torch.zeros(32, dtype=torch.int64), 0), ValueError, "bits must be one of"),
        (lambda: kvkernels.unpack_bits(torch.zeros(4, dtype=torch.int32), 3), ValueError, "multiple of bits=3"),
        (lambda: kvkernels.unpack_bits(torch.zeros(3, dtype=torch.int64), 3), TypeError, "packed must be int32"),
    ],
    ids=["len31", "float-codes", "bits5", "bits0", "words-not-multiple", "int64-words"],
)
def test_bad_input_is_rejected(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_torch_ops_entry_point_validates_too():
    # users call torch.ops.kvkernels.* directly: the C++ CPU kernel runs the wrappers' checks (csrc/op_checks.h),
    # with the same exception types and messages
    with pytest.raises(ValueError, match=r"bits must be one of \(1, 2, 3, 4\)"):
        torch.ops.kvkernels.pack_bits(torch.zeros(32, dtype=torch.int64), 7)
    with pytest.raises(ValueError, match="multiple of 32"):
        torch.ops.kvkernels.pack_bits(torch.zeros(33, dtype=torch.int64), 2)
