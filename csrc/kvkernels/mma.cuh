// Register-level building blocks of the tensor-core GEMVs (csrc/cuda/gemv_*.cu): LOP3 / PRMT bit tricks, packed
// half2 FMA on raw bits, the m16n8k16 MMA, the fp32 -> (hi, lo) fp16 split of activations, and the decoders that
// turn packed codes into exact fp16 integers two values per instruction (docs/FORMATS.md, "GEMV arithmetic").
//
// Every function has an exact host path (plain C++), so CPU CI checks the bit tricks exhaustively and the CUDA
// emulator (tests/cuda_emu) runs the real kernels: lop3 / prmt / hfma2 follow the PTX definitions bit for bit, and
// mma_m16n8k16 calls the emulator's warp-collective implementation. Torch-free.
#pragma once

#include <cstdint>
#include <cstring>

#include "packing.cuh"
#include "quant.cuh"

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#endif

namespace kvk {

// ---- LOP3 / PRMT ------------------------------------------------------------------------------------------------
// lop3.b32 with lookup table LUT over (a, b, c): bit i of LUT is the result for a = i>>2 & 1, b = i>>1 & 1,
// c = i & 1 (PTX: LUT = F(0xF0, 0xCC, 0xAA)).
template <uint32_t LUT>
KVK_HD uint32_t lop3(uint32_t a, uint32_t b, uint32_t c) {
#if defined(__CUDA_ARCH__)
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, %4;" : "=r"(d) : "r"(a), "r"(b), "r"(c), "n"(LUT));
  return d;
#else
  uint32_t d = 0;
  for (int i = 0; i < 8; ++i)
    if ((LUT >> i) & 1u) d |= ((i & 4) ? a : ~a) & ((i & 2) ? b : ~b) & ((i & 1) ? c : ~c);
  return d;
#endif
}

constexpr uint32_t kLutAndOr = 0xEA;  // (a & b) | c

// (a & mask) | magic in one instruction: places masked code bits into the mantissa of an fp16 pair.
KVK_HD uint32_t mask_or(uint32_t a, uint32_t mask, uint32_t magic) { return lop3<kLutAndOr>(a, mask, magic); }

// prmt.b32 (default mode): byte k of the result is byte (sel >> 4k) & 7 of the 8-byte value {b:a} (a = bytes 0-3);
// with bit 3 of that selector nibble set, the byte is instead 0xff or 0x00 by the sign (top bit) of that byte.
KVK_HD uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
#if defined(__CUDA_ARCH__)
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
#else
  const uint64_t v = static_cast<uint64_t>(a) | (static_cast<uint64_t>(b) << 32);
  uint32_t d = 0;
  for (int k = 0; k < 4; ++k) {
    const uint32_t nib = (sel >> (4 * k)) & 0xfu;
    uint32_t byte = static_cast<uint32_t>((v >> (8 * (nib & 7u))) & 0xffu);
    if (nib & 8u) byte = (byte & 0x80u) ? 0xffu : 0u;
    d |= byte << (8 * k);
  }
  return d;
#endif
}

// High 32 bits of a 32x32-bit product (a fast division by a host-computed magic number).
KVK_HD uint32_t umulhi(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
#endif
}

// base + j * stride_bytes as one mad.wide.u32 in PTX, with 32-bit operands (j and stride_bytes; the caller
// guarantees j * stride_bytes < 2^32). With a literal j, ptxas 13 still strength-reduces it to a LEA / LEA.HI.X
// pair per address in the SASS; the 32-bit operands are what it saves over int64 index math.
template <typename T>
KVK_HD const T* offset_rows(const T* base, uint32_t j, uint32_t stride_bytes) {
#if defined(__CUDA_ARCH__)
  uint64_t a;
  asm("mad.wide.u32 %0, %1, %2, %3;" : "=l"(a) : "r"(j), "r"(stride_bytes), "l"(reinterpret_cast<uint64_t>(base)));
  return reinterpret_cast<const T*>(a);
#else
  return reinterpret_cast<const T*>(reinterpret_cast<const char*>(base) + static_cast<uint64_t>(j) * stride_bytes);
#endif
}

// The same pointer, opaque to the optimizer: keeps per-row pointers as separate induction variables, each moved on by
// one 64-bit add (ptxas otherwise re-derives each row's address from a common base: with a literal row, a multiply
// and a 64-bit add per address).
template <typename T>
KVK_HD const T* launder(const T* p) {
#if defined(__CUDA_ARCH__)
  uint64_t v;
  asm("mov.b64 %0, %1;" : "=l"(v) : "l"(reinterpret_cast<uint64_t>(p)));
  return reinterpret_cast<const T*>(v);
#else
  return p;
#endif
}

// ---- query rows on the MMAs' n side ---------------------------------------------------------------------------------
// B's 8 columns hold 4 query rows x (hi, lo) of the activations' fp16 split per n-tile; with 8 query rows (kdup) they
// hold the 8 rows, and the n-tile index is the half (two MMAs into one accumulator: no FADD of hi and lo). Column g of
// n-tile nt takes query row b_col_row and its lo half where b_col_lo; accumulator slot nt of thread t (C's columns
// 2t, 2t + 1, hi and lo or two rows) is query row slot_row.
KVK_HD constexpr int b_col_row(bool kdup, int nt, int g) { return kdup ? g : 4 * nt + (g >> 1); }
KVK_HD constexpr bool b_col_lo(bool kdup, int nt, int g) { return kdup ? nt != 0 : (g & 1) != 0; }
KVK_HD constexpr int slot_row(bool kdup, int nt, int t) { return kdup ? 2 * t + nt : 4 * nt + t; }

// ---- fp16 on raw bits -----------------------------------------------------------------------------------------------
// IEEE binary16 bits of a double, round to nearest even (exact for every value the kernels feed it on the host: a
// product of two fp16 plus an fp16, which a double holds exactly, rounded once, as fma.rn.f16x2 does).
KVK_HD uint16_t double_to_half_bits(double v) {
  if (v != v) return 0x7e00u;
  const uint16_t sign = v < 0 ? 0x8000u : 0u;
  double a = v < 0 ? -v : v;
  if (a >= 65520.0) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  // scale so the integer part holds the 11 significant bits (or the subnormal grid 2^-24)
  int e = 0;
  if (a >= 6.103515625e-05) {  // normal: a in [2^e, 2^(e+1))
    while (a >= 2.0) a *= 0.5, ++e;
    while (a < 1.0) a *= 2.0, --e;
    double m = a * 1024.0;  // [1024, 2048)
    double r = static_cast<double>(static_cast<int64_t>(m));
    const double f = m - r;
    if (f > 0.5 || (f == 0.5 && (static_cast<int64_t>(r) & 1))) r += 1.0;
    int64_t mi = static_cast<int64_t>(r);
    if (mi == 2048) mi = 1024, ++e;
    if (e > 15) return static_cast<uint16_t>(sign | 0x7c00u);
    return static_cast<uint16_t>(sign | ((e + 15) << 10) | (mi - 1024));
  }
  double m = a * 16777216.0;  // subnormal grid: units of 2^-24
  double r = static_cast<double>(static_cast<int64_t>(m));
  const double f = m - r;
  if (f > 0.5 || (f == 0.5 && (static_cast<int64_t>(r) & 1))) r += 1.0;
  return static_cast<uint16_t>(sign | static_cast<uint16_t>(r));  // r == 1024 is the smallest normal: same bits
}

// fma.rn.f16x2 on packed pairs (low half = element 0): d = a * b + c per half, rounded once.
KVK_HD uint32_t hfma2(uint32_t a, uint32_t b, uint32_t c) {
#if defined(__CUDA_ARCH__)
  uint32_t d;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
#else
  uint32_t d = 0;
  for (int h = 0; h < 2; ++h) {
    const double x = static_cast<double>(half_bits_to_float(static_cast<uint16_t>(a >> (16 * h)))) *
                         static_cast<double>(half_bits_to_float(static_cast<uint16_t>(b >> (16 * h)))) +
                     static_cast<double>(half_bits_to_float(static_cast<uint16_t>(c >> (16 * h))));
    d |= static_cast<uint32_t>(double_to_half_bits(x)) << (16 * h);
  }
  return d;
#endif
}

KVK_HD constexpr uint32_t pack_half2(uint16_t lo, uint16_t hi) {
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}

// Compile-time fp16 bits of a value that fp16 holds exactly (the decoders' constants: sums of a few powers of two).
constexpr uint16_t hconst(double v) {
  if (v == 0.0) return 0;
  const uint16_t sign = v < 0 ? 0x8000u : 0u;
  double a = v < 0 ? -v : v;
  int e = 0;
  while (a >= 2.0) a *= 0.5, ++e;
  while (a < 1.0) a *= 2.0, --e;
  return static_cast<uint16_t>(sign | ((e + 15) << 10) | static_cast<uint16_t>(a * 1024.0 - 1024.0));
}
constexpr uint32_t hconst2(double lo, double hi) { return pack_half2(hconst(lo), hconst(hi)); }

constexpr uint32_t kMagic1024x2 = 0x64006400u;  // fp16 1024.0 in both halves: 0x6400 | u == 1024 + u for u < 1024

// ---- activations: fp32 -> (hi, lo) fp16 ------------------------------------------------------------------------------
// The GEMVs feed x to the tensor cores as two fp16 terms: hi = fp16(v), lo = fp16(v - hi). With v pre-scaled by a
// power of two so that max |v| of a row lies in [2^14, 2^15) (scale_exponent), hi + lo equals v to ~2^-22
// relative for every element within 2^-10 of the row maximum, and fp16's range is never exceeded.
struct HalfSplit {
  uint16_t hi, lo;
};
KVK_HD HalfSplit split_half(float v) {
  const uint16_t hi = float_to_half_bits(v);
  const float rest = v - half_bits_to_float(hi);
  return {hi, float_to_half_bits(rest)};
}

// e such that amax * 2^e lies in [2^14, 2^15): computed from the exponent bits of amax (a float >= 0), clamped
// to [-100, 100] (a zero, subnormal or huge amax keeps the scaled values inside fp32). A NaN or Inf amax gives 0:
// the row then produces NaN/Inf results, as the exact sum would.
KVK_HD int scale_exponent(float amax) {
  uint32_t bits;
  std::memcpy(&bits, &amax, sizeof(bits));
  const int ebits = static_cast<int>((bits >> 23) & 0xffu);
  if (ebits == 0xff || bits == 0u) return 0;
  const int e = 14 - (ebits - 127);
  return e < -100 ? -100 : (e > 100 ? 100 : e);
}
KVK_HD float exp2i(int e) {  // 2^e for |e| <= 126, exactly
  const uint32_t bits = static_cast<uint32_t>(e + 127) << 23;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// ---- decoders: InnerQ (groups along the reduction dim) ----------------------------------------------------------------
// In the InnerQ GEMV each thread of an MMA owns, per 32-value block and row, the 8 values v = 8t + i (t = lane % 4,
// i = 0..7), as 4 fp16 pairs P = 0..3 holding (value 8t + P, value 8t + P + 4): exactly the pairs of one row that
// the m16n8k16 A fragment takes from that thread over the block's two k-steps (P0, P1: k-step 0; P2, P3: k-step 1).
// The thread's 8 values are first gathered into canonical words (gather_*), then decoded to exact fp16 integers
// u - OFF (OFF = 2^(b-1) turns sym codes into their signed levels; 0 keeps asym codes unsigned):
//   X (b = 1, 2, 4): value i < 4 in the low half at bit b*i, value i >= 4 in the high half at bit 16 + b*(i-4)
//                    (b = 1: the thread's byte in both halves, so value i >= 4 sits at bit 16 + i);
//   b = 3: X = the 2-bit low planes as for b = 2, Xh = the high-plane bits as for b = 1.
// A pair costs one LOP3 (code bits OR the exponent of 1024 -> 1024 + 2^p u in each half) and one HFMA2 that
// scales by 2^-p and subtracts 1024 * 2^-p + OFF: both exact, so the A operand holds the integer codes exactly.

// Selector for prmt: byte `src` of {b:a} to result bytes 0 and 1, byte `src2` to bytes 2 and 3.
KVK_HD constexpr uint32_t sel_bytes(uint32_t src, uint32_t src2) {
  return src | (src << 4) | (src2 << 8) | (src2 << 12);
}

// Canonical word of thread t from one block's words w[0 .. BITS) (host/tests, and kernels holding the whole block).
template <int BITS>
KVK_HD uint32_t gather_inner_q(const uint32_t* w, int t) {
  if constexpr (BITS == 4) {
    return w[t];
  } else if constexpr (BITS == 1) {
    return prmt(w[0], w[0], sel_bytes(t, t));
  } else {  // BITS 2, and the low planes of 3: the thread's 16 bits are half-word t of {w1:w0}
    return prmt(w[0], w[1], sel_bytes(2 * t, 2 * t + 1));
  }
}
KVK_HD uint32_t gather_inner_q_high_plane(const uint32_t* w, int t) { return prmt(w[2], w[2], sel_bytes(t, t)); }

// The decoder's non-immediate constants: the exponent pattern, and per pair the addend whose multiplier is the
// immediate (an HFMA2 encodes one immediate pair). Kernels receive them in their launch parameters, i.e. constant
// memory, which the instructions read as operands: left as compile-time constants, ptxas re-creates them with a
// MOV before every use. decode_consts(bits, off) builds them on the host; CPU tests pass the same table.
struct DecodeConsts {
  uint32_t magic;
  uint32_t add[4];
};

inline DecodeConsts decode_consts(int bits, int offset) {
  const double off = offset;
  DecodeConsts k{kMagic1024x2, {0u, 0u, 0u, 0u}};
  for (int P = 0; P < 4; ++P) {
    if (bits == 4) {  // pairs 1 and 3 (x 1/16); pairs 0 and 2 are an HADD2 with an immediate
      k.add[P] = (P & 1) ? hconst2(-64 - off, -64 - off) : 0u;
    } else if (bits == 2) {
      const double m = 1.0 / (1 << (2 * P));
      k.add[P] = hconst2(-1024 * m - off, -1024 * m - off);
    } else if (bits == 1) {
      const double m0 = 1.0 / (1 << P), m1 = 1.0 / (1 << (P + 4));
      k.add[P] = hconst2(-1024 * m0 - off, -1024 * m1 - off);
    } else {
      const double ml = 1.0 / (1 << (2 * P)), m0 = 4.0 / (1 << P), m1 = 4.0 / (1 << (P + 4));
      k.add[P] = hconst2(-1024 * m0 - 1024 * ml - off, -1024 * m1 - 1024 * ml - off);
    }
  }
  return k;
}

template <int BITS, int OFF>
KVK_HD void decode_inner_q(uint32_t X, uint32_t Xh, const DecodeConsts& k, uint32_t (&h)[4]) {
  static_assert(BITS >= 1 && BITS <= 4, "bits must be 1..4");
  constexpr double off = OFF;
  if constexpr (BITS == 4) {
    const uint32_t Y = X >> 8;  // pairs 2, 3: their nibbles at bits 0-3 / 4-7 of each half
    h[0] = hfma2(mask_or(X, 0x000F000Fu, k.magic), hconst2(1, 1), hconst2(-1024 - off, -1024 - off));
    h[1] = hfma2(mask_or(X, 0x00F000F0u, k.magic), hconst2(1. / 16, 1. / 16), k.add[1]);
    h[2] = hfma2(mask_or(Y, 0x000F000Fu, k.magic), hconst2(1, 1), hconst2(-1024 - off, -1024 - off));
    h[3] = hfma2(mask_or(Y, 0x00F000F0u, k.magic), hconst2(1. / 16, 1. / 16), k.add[3]);
  } else if constexpr (BITS == 2) {
#pragma unroll
    for (int P = 0; P < 4; ++P) {
      const double m = 1.0 / (1 << (2 * P));  // 4^-P
      h[P] = hfma2(mask_or(X, 0x00030003u << (2 * P), k.magic), hconst2(m, m), k.add[P]);
    }
  } else if constexpr (BITS == 1) {
#pragma unroll
    for (int P = 0; P < 4; ++P) {
      const double m0 = 1.0 / (1 << P), m1 = 1.0 / (1 << (P + 4));  // value P at bit P, value P + 4 at bit 20 + P
      h[P] = hfma2(mask_or(X, (1u << P) | (1u << (20 + P)), k.magic), hconst2(m0, m1), k.add[P]);
    }
  } else {  // 3 bits: u = lo + 4 hi. First h' = 4 hi - 1024 * 4^-P - OFF from the high bit, then u = lo-pair + h'
#pragma unroll
    for (int P = 0; P < 4; ++P) {
      const double ml = 1.0 / (1 << (2 * P));
      const double m0 = 4.0 / (1 << P), m1 = 4.0 / (1 << (P + 4));
      const uint32_t hp = hfma2(mask_or(Xh, (1u << P) | (1u << (20 + P)), k.magic), hconst2(m0, m1), k.add[P]);
      h[P] = hfma2(mask_or(X, 0x00030003u << (2 * P), k.magic), hconst2(ml, ml), hp);
    }
  }
}

// ---- the MMA ------------------------------------------------------------------------------------------------------
// D = A * B + C, mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32. Fragments (g = lane / 4, t = lane % 4):
//   A (16 x 16): a[0] = (row g, k 2t..2t+1), a[1] = (row g+8, k 2t..2t+1), a[2] = (row g, k 2t+8..2t+9),
//                a[3] = (row g+8, k 2t+8..2t+9);  B (16 x 8): b[0] = (k 2t..2t+1, col g), b[1] = (k 2t+8..2t+9, col g);
//   C, D (16 x 8): c[0..1] = (row g, cols 2t, 2t+1), c[2..3] = (row g+8, cols 2t, 2t+1). Low half = lower k.
#if defined(__CUDACC__) || defined(KVK_EMU)  // device code, or the emulator's host build of it
#if !defined(__CUDA_ARCH__) && defined(KVK_EMU)
}  // namespace kvk
namespace kvk_emu {
void mma_m16n8k16_f16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], const float (&c)[4]);
void mma_m16n8k16_bf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], const float (&c)[4]);
}
namespace kvk {
#endif

__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                             const float (&c)[4]) {
#if defined(__CUDA_ARCH__)
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %11, %12, %13};"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
        "f"(c[3]));
#elif defined(KVK_EMU)
  kvk_emu::mma_m16n8k16_f16(d, a, b, c);
#else
  (void)d, (void)a, (void)b, (void)c;  // host pass of nvcc: never called
#endif
}

// The same MMA on bf16 operands (mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, sm_80+): the fragment layout
// above, each 32-bit register a pair of bf16 (low half = lower k). A product of two bf16 is exact in fp32.
__device__ __forceinline__ void mma_m16n8k16_bf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                                  const float (&c)[4]) {
#if defined(__CUDA_ARCH__)
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %11, %12, %13};"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
        "f"(c[3]));
#elif defined(KVK_EMU)
  kvk_emu::mma_m16n8k16_bf16(d, a, b, c);
#else
  (void)d, (void)a, (void)b, (void)c;  // host pass of nvcc: never called
#endif
}
#endif

}  // namespace kvk
