// Group quantizers and dequantization parameters shared by InnerQ and KIVI (docs/FORMATS.md).
// Host + device, torch-free: the C++ CPU ops in csrc/ops.cpp run these same functions, so CPU CI checks the
// formulas the CUDA kernels use.
//
// Every format stores unsigned b-bit codes u and dequantizes a group g as   x ~= s_g * u + zeff_g :
//   sym    : scale s >= 0 stored,       zeff = -s * 2^(b-1)   (signed levels -2^(b-1) .. 2^(b-1)-1)
//   asym   : scale s >= 0, zero z,      zeff = z
//   hybrid : sign bit of the fp16 scale set -> that group is asym with s = |scale|, zeff = z;
//            sign bit clear -> sym (its stored zero is 0 and unused).
// Linear in u, so a GEMV can use  sum_l x_l deq(u_l) = s_g * sum_l x_l u_l + zeff_g * sum_l x_l  per group.
#pragma once

#include <cstdint>
#include <cstring>

#include "packing.cuh"

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#endif

namespace kvk {

enum class QuantMode : int { kSym = 0, kAsym = 1, kHybrid = 2 };

constexpr uint16_t kHalfSignBit = 0x8000u;

// ---- fp16 <-> fp32 on raw bits (host path portable; device path uses the intrinsics) ----
KVK_HD float half_bits_to_float(uint16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: renormalize
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      bits = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

// Round-to-nearest-even fp32 -> fp16 bits (the rounding torch's .half() and __float2half_rn use).
KVK_HD uint16_t float_to_half_bits(float f) {
  // Every NaN becomes the one quiet NaN 0x7e00 on both paths: GPU arithmetic and cvt produce canonical NaNs (0x7fff)
  // where x86 keeps sign and payload, so a NaN group's scale/zero bits would otherwise differ CUDA vs CPU op.
  if (f != f) return 0x7e00u;
#if defined(__CUDA_ARCH__)
  return __half_as_ushort(__float2half_rn(f));
#else
  uint32_t x;
  std::memcpy(&x, &f, sizeof(x));
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u));
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds past 65504 -> inf
  if (abs < 0x38800000u) {  // result is subnormal (or zero) in fp16
    if (abs < 0x33000000u) return static_cast<uint16_t>(sign);  // below half the smallest subnormal
    const uint32_t exp = abs >> 23;
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - exp;  // subnormal fp16 = m * 2^-24 and f = mant * 2^(exp - 150)
    uint32_t half_mant = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1u);
    if (rem > halfway || (rem == halfway && (half_mant & 1u))) ++half_mant;
    return static_cast<uint16_t>(sign | half_mant);
  }
  uint32_t h = ((abs - 0x38000000u) >> 13);  // rebias exponent 127 -> 15
  const uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
#endif
}

KVK_HD float round_to_half(float f) { return half_bits_to_float(float_to_half_bits(f)); }

// Round half to even, like torch.round and CUDA rintf.
KVK_HD float round_half_even(float v) {
#if defined(__CUDA_ARCH__)
  return rintf(v);
#else
  return __builtin_rintf(v);
#endif
}

// Code of a quantized value: clamp to [0, qmax], and NaN (a non-finite group: inf / inf, or inf - inf) to 0, so the
// float -> integer conversion is always defined. Such a group's scale is NaN or Inf, so it reads back non-finite.
KVK_HD float clamp_code(float v, float qmax) { return v >= 0.f ? (v <= qmax ? v : qmax) : 0.f; }

// min/max that propagate NaN (fminf/fmaxf drop it), so a NaN input poisons its own group's scale, visibly,
// instead of being silently coded as some level. Matches torch.amin/amax in the reference.
// On sm_80+ one instruction each (max.NaN / min.NaN: a NaN operand gives the canonical NaN).
KVK_HD float nan_max(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float d;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
#else
  return (a != a || b != b) ? a + b : fmaxf(a, b);
#endif
}
KVK_HD float nan_min(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float d;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
#else
  return (a != a || b != b) ? a + b : fminf(a, b);
#endif
}

// IEEE round-to-nearest fp32 arithmetic for the quantizers. setup.py builds the kernels with --use_fast_math
// (approximate division) and nvcc fuses a*b+c into FMA by default; either would make CUDA codes differ from the
// C++ CPU op. The __f*_rn intrinsics are never approximated nor contracted, so both paths round identically
// (only fp32 subnormals differ: fast-math also flushes them to zero; they round to the same codes).
KVK_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
KVK_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
KVK_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
KVK_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

// ---- dequantization parameters of one group: x ~= s * u + zeff ----
struct GroupAffine {
  float s;
  float zeff;
};

template <int BITS>
KVK_HD constexpr float sym_offset() {
  return static_cast<float>(1 << (BITS - 1));
}

KVK_HD float sym_offset_rt(int bits) { return static_cast<float>(1 << (bits - 1)); }

// scale_bits/zero_bits are the raw fp16 words; zero_bits is ignored for sym.
template <QuantMode MODE, int BITS>
KVK_HD GroupAffine group_affine(uint16_t scale_bits, uint16_t zero_bits) {
  if constexpr (MODE == QuantMode::kSym) {
    const float s = half_bits_to_float(scale_bits);
    return {s, -s * sym_offset<BITS>()};
  } else if constexpr (MODE == QuantMode::kAsym) {
    return {half_bits_to_float(scale_bits), half_bits_to_float(zero_bits)};
  } else {
    const bool asym = (scale_bits & kHalfSignBit) != 0;  // sign bit, so -0.0 (constant asym group) counts too
    const float s = half_bits_to_float(static_cast<uint16_t>(scale_bits & 0x7fffu));
    return {s, asym ? half_bits_to_float(zero_bits) : -s * sym_offset<BITS>()};
  }
}

// As group_affine: only hybrid reads the sign bit as a flag (and drops it); sym and asym take the scale as stored,
// negative or not, like the reference and the compiled GEMVs.
KVK_HD GroupAffine group_affine_rt(QuantMode mode, int bits, uint16_t scale_bits, uint16_t zero_bits) {
  if (mode == QuantMode::kHybrid) {
    const float s = half_bits_to_float(static_cast<uint16_t>(scale_bits & 0x7fffu));
    return {s, (scale_bits & kHalfSignBit) != 0 ? half_bits_to_float(zero_bits) : -s * sym_offset_rt(bits)};
  }
  const float s = half_bits_to_float(scale_bits);
  return {s, mode == QuantMode::kAsym ? half_bits_to_float(zero_bits) : -s * sym_offset_rt(bits)};
}

// ---- quantizing one group (reference formulas in kvkernels/reference/quant.py) ----
// Writes codes[0..n) and returns the fp16 scale/zero words to store.
struct GroupQuant {
  uint16_t scale_bits;
  uint16_t zero_bits;
  float sq_error;  // sum of squared reconstruction error, with the stored (fp16) scale/zero
};

// Scale denominators of sym: 2^(b-1) (max|x| on the edge of the level set), except for a constant non-zero group
// (every value c) at b >= 2, which uses 2^(b-2): with 2^(b-1), c = +max|x| would land on the clipped top code
// 2^(b-1) - 1 and read back as (1 - 2^(1-b)) c; with 2^(b-2), +-c is the level +-2^(b-2) times s = |c| / 2^(b-2),
// a division by a power of two, so the group reads back exactly. (b = 1 has no positive level at all.)
KVK_HD float sym_denominator(int bits, bool constant_group) {
  return static_cast<float>(1 << (constant_group && bits >= 2 ? bits - 2 : bits - 1));
}

KVK_HD GroupQuant quantize_group_sym(const float* x, int n, int bits, uint32_t* codes) {
  float amax = 0.f, mn = x[0], mx = x[0];
  for (int i = 0; i < n; ++i) {
    amax = nan_max(amax, fabsf(x[i]));
    mn = nan_min(mn, x[i]);
    mx = nan_max(mx, x[i]);
  }
  const float off = sym_offset_rt(bits);
  const float qmax = static_cast<float>((1 << bits) - 1);
  const bool constant_group = mn == mx && amax > 0.f;  // false under NaN
  const uint16_t sb = float_to_half_bits(div_rn(amax, sym_denominator(bits, constant_group)));
  const float s = half_bits_to_float(sb);
  float err = 0.f;
  for (int i = 0; i < n; ++i) {
    const float u = s > 0.f ? clamp_code(add_rn(round_half_even(div_rn(x[i], s)), off), qmax) : off;
    codes[i] = static_cast<uint32_t>(u);
    const float d = sub_rn(sub_rn(mul_rn(s, u), mul_rn(s, off)), x[i]);
    err = add_rn(err, mul_rn(d, d));
  }
  return {sb, 0u, err};
}

// eta: calibrated zero/scale (XQuant/SpeCache): codes from (z, s), stored z' = z + eta*s*(2^b-1),
// s' = (1 - 2 eta) s. eta = 0 is plain min/max asymmetric quantization. Both factors are fp32, and 1 - 2 eta is
// computed in double from the caller's double eta and rounded once (asym_calib), exactly as the reference and
// Triton do (a Python float times an fp32 tensor): computing it in fp32 from fp32(eta) differs near eta = 0.5.
struct AsymCalib {
  float s_mul;  // fp32(1 - 2 eta)
  float eta;    // fp32(eta)
};

inline AsymCalib asym_calib(double eta) { return {static_cast<float>(1.0 - 2.0 * eta), static_cast<float>(eta)}; }

constexpr AsymCalib kNoCalib{1.f, 0.f};

KVK_HD GroupQuant quantize_group_asym(const float* x, int n, int bits, AsymCalib cal, uint32_t* codes) {
  float mn = x[0], mx = x[0];
  for (int i = 1; i < n; ++i) {
    mn = nan_min(mn, x[i]);
    mx = nan_max(mx, x[i]);
  }
  const float qmax = static_cast<float>((1 << bits) - 1);
  const float s = round_to_half(div_rn(sub_rn(mx, mn), qmax));
  const float z = round_to_half(mn);
  for (int i = 0; i < n; ++i) {
    const float u = s > 0.f ? clamp_code(round_half_even(div_rn(sub_rn(x[i], z), s)), qmax) : 0.f;
    codes[i] = static_cast<uint32_t>(u);
  }
  const uint16_t sb = float_to_half_bits(mul_rn(cal.s_mul, s));
  const uint16_t zb = float_to_half_bits(add_rn(z, mul_rn(mul_rn(cal.eta, s), qmax)));
  const float s_st = half_bits_to_float(sb), z_st = half_bits_to_float(zb);
  float err = 0.f;
  for (int i = 0; i < n; ++i) {
    const float d = sub_rn(add_rn(mul_rn(s_st, static_cast<float>(codes[i])), z_st), x[i]);
    err = add_rn(err, mul_rn(d, d));
  }
  return {sb, zb, err};
}

// Hybrid: the mode with the lower squared error wins (ties -> sym); asym is flagged in the scale's sign bit.
// `scratch` holds n codes for the losing candidate.
KVK_HD GroupQuant quantize_group_hybrid(const float* x, int n, int bits, uint32_t* codes, uint32_t* scratch) {
  const GroupQuant sym = quantize_group_sym(x, n, bits, codes);
  const GroupQuant asym = quantize_group_asym(x, n, bits, kNoCalib, scratch);
  if (asym.sq_error < sym.sq_error) {
    for (int i = 0; i < n; ++i) codes[i] = scratch[i];
    return {static_cast<uint16_t>(asym.scale_bits | kHalfSignBit), asym.zero_bits, asym.sq_error};
  }
  return sym;
}

}  // namespace kvk
