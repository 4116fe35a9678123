// Lattice (HIGGS-style) format helpers shared by the CUDA GEMVs (csrc/cuda/gemv_lattice.cu) and the CPU side of the
// CUDA emulator (tests/cuda_emu/driver.cpp): grid kinds, the index layout of a 32-value block, the register-level
// index -> shared-memory-table address arithmetic, and where each looked-up pair lands in the MMA fragments.
// docs/FORMATS.md ("Lattice") is the bit-exact spec; every function has a plain C++ host path. Torch-free.
//
// Index layout of one 32-value block (`bits` words, bits = log2(n) / d per value):
//   4-bit indices (EDEN2-16):            index j in word j / 8, bits 4 (j % 8) .. +3
//   8-bit indices (EDEN2-256, EDEN4-256): index j in word j / 4, bits 8 (j % 4) .. +7
//   6-bit indices (EDEN2-64, FLUTE's):    j < 15 in word j / 5, bits 6 (j % 5) .. +5; j = 15: bits 2w, 2w+1 in bits
//                                         30-31 of word w (w = 0, 1, 2)
//
// The 6-bit layout is read by "quarters": quarter q in 0..3 of a block is the four indices {q, 5 + q, 10 + q, X_q},
// X = (4, 9, 14, 15). The first three are a 6-bit field at bit 6q of words 0, 1, 2 (one funnel shift and one LOP3
// each); X_q comes from `top`, the three top bytes of the words gathered by two PRMTs (top bits 8-13: index 4, 16-21:
// index 9, 24-29: index 14, and index 15's two-bit pieces at bits 14-15, 22-23, 30-31), through one IMAD.HI whose
// multiplier moves the wanted bits to the field (x_mul below; for q = 3 a sum of three powers of two gathers the
// pieces, with no carries between the partial products) and one LOP3 that masks and adds the lane's table copy.
#pragma once

#include <cstdint>

#include "mma.cuh"
#include "packing.cuh"

namespace kvk {

enum class LatticeGrid : int { kE2_16 = 0, kE2_64 = 1, kE2_256 = 2, kE4_256 = 3 };

KVK_HD constexpr int lattice_d(LatticeGrid g) { return g == LatticeGrid::kE4_256 ? 4 : 2; }
KVK_HD constexpr int lattice_n(LatticeGrid g) { return g == LatticeGrid::kE2_16 ? 16 : g == LatticeGrid::kE2_64 ? 64 : 256; }
KVK_HD constexpr int lattice_index_bits(LatticeGrid g) {
  return g == LatticeGrid::kE2_16 ? 4 : g == LatticeGrid::kE2_64 ? 6 : 8;
}
// stored bits per value = int32 words per 32-value block
KVK_HD constexpr int lattice_bits(LatticeGrid g) { return lattice_index_bits(g) / lattice_d(g); }

// The grid kind of an fp32 [n, d] grid, or -1 if the format has no such grid.
inline int lattice_grid_of(int64_t d, int64_t n) {
  if (d == 2 && n == 16) return static_cast<int>(LatticeGrid::kE2_16);
  if (d == 2 && n == 64) return static_cast<int>(LatticeGrid::kE2_64);
  if (d == 2 && n == 256) return static_cast<int>(LatticeGrid::kE2_256);
  if (d == 4 && n == 256) return static_cast<int>(LatticeGrid::kE4_256);
  return -1;
}

// Index j (0 <= j < 32 / d) of the block starting at `blk` (the reference decoder; kernels use the quarter / byte
// arithmetic below).
KVK_HD uint32_t lattice_index(const uint32_t* blk, int j, LatticeGrid g) {
  switch (lattice_index_bits(g)) {
    case 4: return (blk[j / 8] >> (4 * (j % 8))) & 15u;
    case 8: return (blk[j / 4] >> (8 * (j % 4))) & 255u;
    default:
      if (j < 15) return (blk[j / 5] >> (6 * (j % 5))) & 63u;
      return (blk[0] >> 30) | ((blk[1] >> 30) << 2) | ((blk[2] >> 30) << 4);
  }
}

// Packs 32 / d indices (each < n) into one block of lattice_bits(g) words (host tests).
inline void lattice_pack_block(const uint32_t* idx, uint32_t* blk, LatticeGrid g) {
  const int ib = lattice_index_bits(g), ni = 32 / lattice_d(g);
  for (int w = 0; w < lattice_bits(g); ++w) blk[w] = 0u;
  for (int j = 0; j < ni; ++j) {
    const uint32_t v = idx[j] & ((1u << ib) - 1u);
    if (ib == 4) blk[j / 8] |= v << (4 * (j % 8));
    else if (ib == 8) blk[j / 4] |= v << (8 * (j % 4));
    else if (j < 15) blk[j / 5] |= v << (6 * (j % 5));
    else for (int w = 0; w < 3; ++w) blk[w] |= ((v >> (2 * w)) & 3u) << 30;
  }
}

// ---- register arithmetic ---------------------------------------------------------------------------------------
// Rotate right by n % 32 (one SHF.R.W funnel shift).
KVK_HD uint32_t rotr32(uint32_t w, uint32_t n) {
#if defined(__CUDA_ARCH__)
  return __funnelshift_r(w, w, n);
#else
  n &= 31u;
  return n ? (w >> n) | (w << (32u - n)) : w;
#endif
}

constexpr uint32_t kLutSelect = 0xE4;  // (a & c) | (b & ~c): bits of a where c is set, of b elsewhere (kLutAndOr: mma.cuh)

// mul.rn.f16x2 on packed pairs: a * b per half, rounded once.
KVK_HD uint32_t hmul2(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
#else
  uint32_t d = 0;
  for (int h = 0; h < 2; ++h) {
    const double x = static_cast<double>(half_bits_to_float(static_cast<uint16_t>(a >> (16 * h)))) *
                     static_cast<double>(half_bits_to_float(static_cast<uint16_t>(b >> (16 * h))));
    d |= static_cast<uint32_t>(double_to_half_bits(x)) << (16 * h);
  }
  return d;
#endif
}

// Shared-memory byte address of a table entry: a field of `width` bits at bit `pos` of w, times 2^S, plus the lane's
// copy offset (< 2^S, so OR is the add). One funnel shift and one LOP3; pos may be a per-thread value.
template <int S, int WIDTH>
KVK_HD uint32_t field_addr(uint32_t w, int pos, uint32_t lane_off) {
  return lop3<kLutAndOr>(rotr32(w, static_cast<uint32_t>(pos - S) & 31u), ((1u << WIDTH) - 1u) << S, lane_off);
}

// ---- 6-bit quarters ------------------------------------------------------------------------------------------------
// Element e (0..3) of quarter q: the block's index {q, 5 + q, 10 + q, X_q}[e].
KVK_HD constexpr int quarter_index(int q, int e) { return e < 3 ? 5 * e + q : (q < 3 ? 4 + 5 * q : 15); }

// The three top bytes of a block's words: index 4 at bits 8-13, 9 at 16-21, 14 at 24-29, index 15's pieces at bits
// 14-15 (its bits 0-1), 22-23 (2-3), 30-31 (4-5). Two PRMTs, shared by the block's four quarters.
KVK_HD uint32_t quarter_top(uint32_t w0, uint32_t w1, uint32_t w2) { return prmt(prmt(w0, w1, 0x0730u), w2, 0x7210u); }

// IMAD.HI constants of X_q for table stride 2^S: umulhi(top & x_mask(q), x_mul(q)) has X_q at bits S .. S + 5 (and
// bits of other fields outside them, removed by the LOP3 of x_addr).
KVK_HD constexpr uint32_t x_mask(int q) { return q == 3 ? 0xC0C0C000u : 0x3Fu << (8 * q + 8); }
template <int S>
KVK_HD constexpr uint32_t x_mul(int q) {
  return q == 3 ? (1u << (18 + S)) + (1u << (12 + S)) + (1u << (6 + S)) : 1u << (24 - 8 * q + S);
}
template <int S>
KVK_HD uint32_t x_addr(uint32_t top, uint32_t mask, uint32_t mul, uint32_t lane_off) {
  return lop3<kLutAndOr>(umulhi(top & mask, mul), 63u << S, lane_off);
}

// ---- where the looked-up values go -------------------------------------------------------------------------------
// Keys (gemv_lattice_k): the MMA's A operand is 16 tokens x 16 channels of the rotated key, one k-step per 16
// channels; thread t of a quad supplies k = 2t, 2t + 1 (a[0], a[1]) and 2t + 8, 2t + 9 (a[2], a[3]) of every
// k-step. Channel (within the row) that MMA k-slot k of k-step ks holds, per grid; the query fragment B is staged in
// the same order. Every k-step lies inside one 32-channel block, so inside one group.
//   EDEN2-16: thread t reads byte t of word ks (pairs 2t, 2t + 1 of the word) with one LDS.64 of a pair table
//   EDEN4-256: byte t of word ks is quad t of the k-step, one LDS.64 (channels 4t .. 4t + 3)
//   EDEN2-256: byte t of words 2 ks, 2 ks + 1 (pairs t and 4 + t): the natural order
//   EDEN2-64: block ks / 2; k-step 2b takes quarter t's elements 0, 1 and k-step 2b + 1 its elements 2, 3
KVK_HD int lattice_key_channel(LatticeGrid g, int ks, int k) {
  const int j = (k % 8) / 2, hi = k / 8, lo = k % 2;
  switch (g) {
    case LatticeGrid::kE2_256: return 16 * ks + k;
    case LatticeGrid::kE2_64: return 32 * (ks / 2) + 2 * quarter_index(j, 2 * (ks % 2) + hi) + lo;
    default: return 16 * ks + 4 * j + 2 * hi + lo;
  }
}

// Values (gemv_lattice_v): the A operand is 16 channels x 16 tokens; a warp covers DW channels (DW / 16 m-tiles),
// of which lane group g (= lane / 4) owns a slice of DW / 8 and supplies rows g and g + 8 of every m-tile. Channel
// (within the warp's DW) of row g + 8 h of m-tile mt for lane group gg.
//   EDEN2-16, EDEN2-256: pair mt of the slice (channels 2 mt, 2 mt + 1 of the slice); EDEN4-256: quad mt / 2, its
//   channels 2 (mt % 2) + h; the slice is DW / 8 consecutive channels.
//   EDEN2-64: the slice is quarter(s) of a block (DW = 128: block gg / 2, quarters 2 (gg % 2) and + 1; DW = 64: block
//   gg / 4, quarter gg % 4); m-tile mt takes element mt % 4 of the slice's quarter mt / 4.
KVK_HD int lattice_value_channel(LatticeGrid g, int DW, int gg, int mt, int h) {
  if (g != LatticeGrid::kE2_64) return gg * (DW / 8) + 2 * mt + h;
  const int per_block = 32 / (DW / 8);  // lane groups per 32-channel block: 2 (DW 128) or 4 (DW 64)
  const int q = (gg % per_block) * (4 / per_block) + mt / 4;
  return 32 * (gg / per_block) + 2 * quarter_index(q, mt % 4) + h;
}

// ---- Walsh-Hadamard transform (host reference; the kernels run the same butterflies on shared memory) -----------
// In place on G values: stages h = 1, 2, ..., G / 2 map (y[i], y[i + h]), i % 2h < h, to (a + b, a - b); then one
// multiply by `scale` (fp32(1 / sqrt(G))). docs/FORMATS.md, "Lattice", step 1.
inline void fwht_host(float* y, int G, float scale) {
  for (int h = 1; h < G; h *= 2)
    for (int i = 0; i < G; ++i)
      if (i % (2 * h) < h) {
        const float a = y[i], b = y[i + h];
        y[i] = a + b;
        y[i + h] = a - b;
      }
  for (int i = 0; i < G; ++i) y[i] *= scale;
}

}  // namespace kvk
