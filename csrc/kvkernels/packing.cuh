// Packed 1/2/3/4-bit storage: host + device helpers shared by every CUDA kernel and by the C++ CPU ops
// (csrc/ops.cpp), so CPU CI exercises exactly the bit logic the kernels run. Torch-free on purpose.
//
// Layout (docs/FORMATS.md, "Packed storage"): values are packed along the last dimension in blocks of 32
// values; a block of b-bit values occupies exactly b int32 words.
//   b = 1, 2, 4: value i of the row sits in word i / (32 / b) at bit offset (i % (32 / b)) * b (LSB first).
//   b = 3:       block words 0 and 1 are the 2-bit packing of (v & 3) for values 0..15 and 16..31; word 2
//                holds bit 2 of value i at bit i. Unpacking is shifts and masks only, never straddles words.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define KVK_HD __host__ __device__ __forceinline__
#else
#define KVK_HD inline
#endif

namespace kvk {

constexpr int kBlockValues = 32;  // values per packing block, for every bit width

// Words one block of 32 b-bit values occupies: b.
KVK_HD constexpr int words_per_block(int bits) { return bits; }

KVK_HD constexpr bool is_supported_bits(int bits) { return bits >= 1 && bits <= 4; }

// Value i (0..31) of the block starting at `block`.
template <int BITS>
KVK_HD uint32_t unpack_one(const uint32_t* block, int i) {
  static_assert(BITS >= 1 && BITS <= 4, "bits must be 1..4");
  if constexpr (BITS == 3) {
    const uint32_t lo = (block[i >> 4] >> ((i & 15) * 2)) & 3u;
    const uint32_t hi = (block[2] >> i) & 1u;
    return lo | (hi << 2);
  } else {
    constexpr int kPerWord = 32 / BITS;
    constexpr uint32_t kMask = (1u << BITS) - 1u;
    return (block[i / kPerWord] >> ((i % kPerWord) * BITS)) & kMask;
  }
}

// All 32 values of one block, as floats (what the GEMV kernels consume).
template <int BITS>
KVK_HD void unpack_block(const uint32_t* block, float out[kBlockValues]) {
#pragma unroll
  for (int i = 0; i < kBlockValues; ++i) out[i] = static_cast<float>(unpack_one<BITS>(block, i));
}

// Packs 32 codes (each < 2^BITS; higher bits are masked off) into BITS words.
template <int BITS>
KVK_HD void pack_block(const uint32_t codes[kBlockValues], uint32_t* block) {
  static_assert(BITS >= 1 && BITS <= 4, "bits must be 1..4");
#pragma unroll
  for (int w = 0; w < BITS; ++w) block[w] = 0u;
  if constexpr (BITS == 3) {
#pragma unroll
    for (int i = 0; i < kBlockValues; ++i) {
      const uint32_t v = codes[i] & 7u;
      block[i >> 4] |= (v & 3u) << ((i & 15) * 2);
      block[2] |= (v >> 2) << i;
    }
  } else {
    constexpr int kPerWord = 32 / BITS;
    constexpr uint32_t kMask = (1u << BITS) - 1u;
#pragma unroll
    for (int i = 0; i < kBlockValues; ++i) block[i / kPerWord] |= (codes[i] & kMask) << ((i % kPerWord) * BITS);
  }
}

// Runtime-bits forms for host code (CPU ops and tests); kernels use the templates above.
KVK_HD uint32_t unpack_one_rt(const uint32_t* block, int i, int bits) {
  switch (bits) {
    case 1: return unpack_one<1>(block, i);
    case 2: return unpack_one<2>(block, i);
    case 3: return unpack_one<3>(block, i);
    default: return unpack_one<4>(block, i);
  }
}

KVK_HD void pack_block_rt(const uint32_t codes[kBlockValues], uint32_t* block, int bits) {
  switch (bits) {
    case 1: pack_block<1>(codes, block); break;
    case 2: pack_block<2>(codes, block); break;
    case 3: pack_block<3>(codes, block); break;
    default: pack_block<4>(codes, block); break;
  }
}

}  // namespace kvk
