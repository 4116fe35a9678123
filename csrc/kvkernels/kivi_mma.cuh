// KIVI-layout MMA pieces (gemv_kivi.cu's GEMVs and decode_attention_store.cu's KIVI tiles): a matrix reduced over
// its rows r with asym groups of G along its columns c, y = sum_r x[r] * (s[r, c/G] * u[r, c] + z[r, c/G]), on
// m16n8k16 MMAs with A = the dequantized codes (16 columns x 16 rows) and B = the x rows as hi / lo fp16 pairs.
//
// Lane g of a warp owns CPL consecutive columns (16 or 8), so one group's scale and zero serve all of them and its
// codes of a row are one 32/64-bit load; m-tile i pairs column 2i (A row g) with 2i + 1 (A row g + 8). Thread t of the
// lane's quad owns rows 4t .. 4t + 3 of each 16-row k-step (A's k index 2t, 2t + 1 = rows 4t, 4t + 1; 2t + 8, 2t + 9 =
// rows 4t + 2, 4t + 3), so its B fragment is x of those 4 rows. The scale and zero vary along the reduction, so they
// are applied before the MMA: a code is decoded exactly (LOP3 into the mantissa of 1024, HFMA2 removing it) and
// dequantized by one more HFMA2, s * u + z rounded once to fp16 (what a dequantize-to-fp16 cache holds); products and
// sums are fp32 in the tensor cores (docs/FORMATS.md, "GEMV arithmetic").
#pragma once

#include <cstdint>

#include "kvkernels/mma.cuh"

namespace kvk {

// The decoder's constants (constant memory, see DecodeConsts in mma.cuh): magic, and per column position
// cc % 8 of the lane's columns the addend that removes the magic from the decoded pair.
struct KiviConsts {
  uint32_t magic;
  uint32_t add[8];
};

// Bit position, within each half of a gathered pair word, of the code of the lane's column cc (cc % 8 decides it):
// 4 bits: nibble of its byte; 2 bits: 2 * (cc % 4); 1 bit: cc % 8; 3 bits: the low plane as 2 bits, the high bit
// as 1 bit.
__host__ __device__ constexpr int pos_of(int bits, int cc) {
  return bits == 4 ? 4 * (cc % 2) : bits == 2 || bits == 3 ? 2 * (cc % 4) : cc % 8;
}

inline KiviConsts kivi_consts(int bits) {
  KiviConsts k{kMagic1024x2, {}};
  for (int cc = 0; cc < 8; ++cc) {
    const double ml = 1.0 / (1 << pos_of(bits, cc));
    if (bits == 3) {  // h' = 4 hi - 1024 * 2^-p_lo: the addend of the high-bit step (see decode_pair)
      const double mh = 4.0 / (1 << (cc % 8));
      k.add[cc] = hconst2(-1024 * mh - 1024 * ml, -1024 * mh - 1024 * ml);
    } else {
      k.add[cc] = hconst2(-1024 * ml, -1024 * ml);
    }
  }
  return k;
}

// ---- one lane's codes of one row ----------------------------------------------------------------------------------
// The word(s) holding the lane's CPL columns: 4 bits with CPL = 16 spans two words; 3 bits keeps its low-plane word
// in w[0] and its high-plane word in w[1]; otherwise one word, of which the lane's columns start at byte `byte0`.
template <int BITS, int CPL>
struct LaneCodes {
  uint32_t w[2];
};

// Where a lane's columns sit in a row: words from the row start (folded into the lane's row pointers once), and
// the first byte of its bits inside the loaded word(s), which the gather selectors absorb (no shifts per row).
struct LaneSlot {
  int word;    // first word (3 bits: the low-plane word)
  int hword;   // 3 bits: the high-plane word
  int byte0;   // byte of the lane's first column inside w[0]
  int hbyte0;  // 3 bits: byte of the lane's first column inside the high-plane word
};

template <int BITS>
__device__ __forceinline__ LaneSlot lane_slot(int64_t c0) {  // c0: the lane's first column (a multiple of CPL)
  LaneSlot s{};
  const int blk = static_cast<int>(c0 / 32), cb = static_cast<int>(c0 % 32);  // block and column inside it
  if constexpr (BITS == 3) {
    s.word = 3 * blk + cb / 16;
    s.byte0 = (2 * (cb % 16)) / 8;
    s.hword = 3 * blk + 2;
    s.hbyte0 = cb / 8;
  } else {
    s.word = BITS * blk + cb * BITS / 32;
    s.byte0 = ((cb * BITS) % 32) / 8;
  }
  return s;
}

template <int BITS, int CPL, bool VEC>
__device__ __forceinline__ void load_lane(LaneCodes<BITS, CPL>& c, const uint32_t* __restrict__ lo,
                                          const uint32_t* __restrict__ hi) {
  if constexpr (BITS == 4 && CPL == 16) {
    if constexpr (VEC) {
      const uint2 v = __ldg(reinterpret_cast<const uint2*>(lo));
      c.w[0] = v.x, c.w[1] = v.y;
    } else {
      c.w[0] = __ldg(lo), c.w[1] = __ldg(lo + 1);
    }
  } else if constexpr (BITS == 3) {
    c.w[0] = __ldg(lo);
    c.w[1] = __ldg(hi);
  } else {
    c.w[0] = __ldg(lo);
    c.w[1] = 0u;
  }
}

// prmt selector taking byte b of row a (result byte 0) and of row b (result byte 2)
__host__ __device__ constexpr uint32_t pair_sel(int b) { return static_cast<uint32_t>(b | ((4 + b) << 8)); }

// Per-lane gather selectors: sel[i] for the i-th byte of the lane's low / single plane, hsel[i] for the high plane.
struct LaneSel {
  uint32_t sel[4];
  uint32_t hsel[2];
};

// Gathered pair word of column cc: the byte holding cc of row a in byte 0, of row b in byte 2.
template <int BITS, int CPL>
__device__ __forceinline__ uint32_t pair_word(const LaneCodes<BITS, CPL>& a, const LaneCodes<BITS, CPL>& b, int cc,
                                              bool high_plane, const LaneSel& ls) {
  if constexpr (BITS == 4) {
    const int byte = cc / 2;  // 2 nibbles per byte; CPL = 16: bytes 0-7 over two words
    return prmt(a.w[byte / 4], b.w[byte / 4], pair_sel(byte % 4));
  } else if constexpr (BITS == 3) {
    return high_plane ? prmt(a.w[1], b.w[1], ls.hsel[cc / 8]) : prmt(a.w[0], b.w[0], ls.sel[cc / 4]);
  } else {
    return prmt(a.w[0], b.w[0], ls.sel[cc * BITS / 8]);
  }
}

// Dequantized pair (row a, row b) of the lane's column cc: s * u + z in fp16, from the gathered words.
template <int BITS>
__device__ __forceinline__ uint32_t decode_pair(uint32_t X, uint32_t Xh, int cc, const KiviConsts& k, uint32_t s2,
                                                uint32_t z2) {
  const int p = pos_of(BITS, cc);
  const double ml = 1.0 / (1 << p);
  const uint32_t lo_mask = ((1u << (BITS == 3 ? 2 : BITS)) - 1u) << p;
  uint32_t u;
  if constexpr (BITS == 3) {  // u = lo + 4 hi, as in decode_inner_q
    const int ph = cc % 8;
    const double mh = 4.0 / (1 << ph);
    const uint32_t hp = hfma2(mask_or(Xh, 0x00010001u << ph, k.magic), hconst2(mh, mh), k.add[cc % 8]);
    u = hfma2(mask_or(X, lo_mask * 0x00010001u, k.magic), hconst2(ml, ml), hp);
  } else {
    u = hfma2(mask_or(X, lo_mask * 0x00010001u, k.magic), hconst2(ml, ml), k.add[cc % 8]);
  }
  return hfma2(u, s2, z2);
}

// ---- one k-step's arithmetic -------------------------------------------------------------------------------------
// Rows 4t .. 4t + 3 of the lane's columns (codes lc) against the step's B fragments (frag: n-tile 0, the next n-tile
// frag_nt_stride further), accumulated into d, with the four rows' scales and zeros as fp16 pairs: s01 = (s of row
// 4t, s of row 4t + 1), s23, z01, z23 (kstep_compute below takes them one by one).
// KDUP (8 query rows, NT = 2): B's 8 columns are the 8 rows, and frag's two "n-tiles" are the hi and lo halves of
// the split, two MMAs into the one accumulator d[i][0] (the hi + lo sum needs no FADD, and the accumulators are half
// as many): d[i][0] holds (column 2i, query rows 2t, 2t + 1), (column 2i + 1, the same).
template <int BITS, int NT, int CPL, bool KDUP = false>
__device__ __forceinline__ void kstep_compute_paired(const LaneCodes<BITS, CPL> (&lc)[4], uint32_t s01, uint32_t s23,
                                                     uint32_t z01, uint32_t z23, const uint2* __restrict__ frag,
                                                     int frag_nt_stride, const LaneSel& ls, const KiviConsts& dec,
                                                     float (&d)[CPL / 2][KDUP ? 1 : NT][4]) {
  static_assert(!KDUP || NT == 2, "the k-split form takes the hi and lo halves as its two fragments");
  uint2 B[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) B[nt] = frag[nt * frag_nt_stride];
#pragma unroll
  for (int i = 0; i < CPL / 2; ++i) {
    uint32_t A[4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // h = 0: column 2i (A row g), 1: column 2i + 1 (A row g + 8)
      const int cc = 2 * i + h;
      const uint32_t X01 = pair_word(lc[0], lc[1], cc, false, ls), X23 = pair_word(lc[2], lc[3], cc, false, ls);
      const uint32_t H01 = BITS == 3 ? pair_word(lc[0], lc[1], cc, true, ls) : 0u;
      const uint32_t H23 = BITS == 3 ? pair_word(lc[2], lc[3], cc, true, ls) : 0u;
      A[h] = decode_pair<BITS>(X01, H01, cc, dec, s01, z01);      // rows 4t, 4t + 1
      A[2 + h] = decode_pair<BITS>(X23, H23, cc, dec, s23, z23);  // rows 4t + 2, 4t + 3
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const uint32_t Bn[2] = {B[nt].x, B[nt].y};
      float (&acc)[4] = d[i][KDUP ? 0 : nt];
      mma_m16n8k16(acc, A, Bn, acc);
    }
  }
}

// The same with scales s[j] and zeros z[j] of rows 4t + j one by one (the GEMVs').
template <int BITS, int NT, int CPL>
__device__ __forceinline__ void kstep_compute(const LaneCodes<BITS, CPL> (&lc)[4], const uint16_t (&s)[4],
                                              const uint16_t (&z)[4], const uint2* __restrict__ frag,
                                              int frag_nt_stride, const LaneSel& ls, const KiviConsts& dec,
                                              float (&d)[CPL / 2][NT][4]) {
  kstep_compute_paired<BITS, NT, CPL>(lc, pack_half2(s[0], s[1]), pack_half2(s[2], s[3]), pack_half2(z[0], z[1]),
                                      pack_half2(z[2], z[3]), frag, frag_nt_stride, ls, dec, d);
}

}  // namespace kvk
