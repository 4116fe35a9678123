// Device helpers shared by the CUDA GEMV / quantize kernels (csrc/cuda/*.cu): activation loads, code->float,
// warp reductions, row offsets, and the named dispatch macros that turn runtime choices into template
// arguments. Torch-free; only nvcc includes this header.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../cuda/kernels.h"
#include "mma.cuh"
#include "packing.cuh"
#include "quant.cuh"

namespace kvk {

// Host: records the message last_launch_error() returns; used by the dispatch macros' `default:` branches.
void set_launch_error(const char* fmt, ...);
void clear_launch_error();

// ---- dispatch: a runtime value becomes a constexpr named CONST inside __VA_ARGS__ --------------------------
// Every `default:` records which value is unsupported and returns cudaErrorInvalidValue from the launcher.
#define KVK_DISPATCH_BITS(bits, CONST, ...)                                                        \
  switch (bits) {                                                                                  \
    case 1: { constexpr int CONST = 1; __VA_ARGS__ } break;                                        \
    case 2: { constexpr int CONST = 2; __VA_ARGS__ } break;                                        \
    case 3: { constexpr int CONST = 3; __VA_ARGS__ } break;                                        \
    case 4: { constexpr int CONST = 4; __VA_ARGS__ } break;                                        \
    default:                                                                                       \
      ::kvk::set_launch_error("unsupported bits=%d (supported: 1, 2, 3, 4)", (int)(bits));        \
      return cudaErrorInvalidValue;                                                                \
  }

#define KVK_DISPATCH_MODE(mode, CONST, ...)                                                          \
  switch (mode) {                                                                                    \
    case ::kvk::QuantMode::kSym: {                                                                   \
      constexpr ::kvk::QuantMode CONST = ::kvk::QuantMode::kSym;                                     \
      __VA_ARGS__                                                                                    \
    } break;                                                                                         \
    case ::kvk::QuantMode::kAsym: {                                                                  \
      constexpr ::kvk::QuantMode CONST = ::kvk::QuantMode::kAsym;                                    \
      __VA_ARGS__                                                                                    \
    } break;                                                                                         \
    case ::kvk::QuantMode::kHybrid: {                                                                \
      constexpr ::kvk::QuantMode CONST = ::kvk::QuantMode::kHybrid;                                  \
      __VA_ARGS__                                                                                    \
    } break;                                                                                         \
    default:                                                                                         \
      ::kvk::set_launch_error("unsupported quant mode %d (expected sym=0, asym=1, hybrid=2)", (int)(mode)); \
      return cudaErrorInvalidValue;                                                                  \
  }

// Query rows per register tile: 1, 2, 4 or 8 (see pick_query_tile).
#define KVK_DISPATCH_QUERY_TILE(qt, CONST, ...)                                                 \
  switch (qt) {                                                                                 \
    case 1: { constexpr int CONST = 1; __VA_ARGS__ } break;                                     \
    case 2: { constexpr int CONST = 2; __VA_ARGS__ } break;                                     \
    case 4: { constexpr int CONST = 4; __VA_ARGS__ } break;                                     \
    case 8: { constexpr int CONST = 8; __VA_ARGS__ } break;                                     \
    default:                                                                                    \
      ::kvk::set_launch_error("unsupported query tile %d (expected 1, 2, 4 or 8)", (int)(qt));  \
      return cudaErrorInvalidValue;                                                             \
  }

// n-tiles of the tensor-core GEMVs: 8 MMA columns = 4 query rows x (hi, lo) each.
#define KVK_DISPATCH_NTILES(nt, CONST, ...)                                                      \
  switch (nt) {                                                                                  \
    case 1: { constexpr int CONST = 1; __VA_ARGS__ } break;                                      \
    case 2: { constexpr int CONST = 2; __VA_ARGS__ } break;                                      \
    default:                                                                                     \
      ::kvk::set_launch_error("unsupported n-tile count %d (expected 1 or 2)", (int)(nt));    \
      return cudaErrorInvalidValue;                                                              \
  }

// ---- integer helpers shared by host planning and device code -----------------------------------------------
__host__ __device__ constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
__host__ __device__ constexpr int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// ---- split-K planning -------------------------------------------------------------------------------------------
// Length of each split of a reduction over `total` elements, for a grid of `cols` CTAs per split (batch x heads x
// row / column blocks) on `wave` resident CTAs (occupancy x SMs). The answer is `total` itself (one split) or a
// multiple of `unit` in [min_len, max_len] (max_len: the shared-memory bound, a multiple of unit; a total over it must
// split; a total under 2 min_len never does). It minimizes the modelled time: the waves the grid takes, rounded up,
// times the units one CTA walks plus `fixed` units of per-CTA work (staging, prologue, epilogue). Ties go to longer
// splits (fewer CTAs and partials).
// Why waves rounded up: the first GPU run's rule took ceil(wave / cols) splits to fill a wave, which spills up to
// cols - 1 CTAs into a second one (64 CTAs per split at batch 8 x 8 KV heads on 264 resident: 5 splits = 320 CTAs,
// two waves for 1.2 waves of work, where 4 splits take one), and a long reduction split at the shared-memory bound
// may leave its last wave nearly empty (InnerQ values at 128k tokens, batch 1: 103 splits x 8 = 824 CTAs, 3.1 waves
// run as 4; 128 splits of 1024 values take the same 4 waves with 20 % less work each). The candidates are the
// longest splits that fit the grid in k = 1, 2, ... waves.
inline int64_t wave_split_len(int64_t total, int64_t unit, int64_t min_len, int64_t max_len, int64_t cols, int64_t wave,
                              int64_t fixed) {
  if (total < 1) return 1;  // an empty reduction launches nothing; a plan asked about it must not divide by zero
  cols = cols > 1 ? cols : 1;
  wave = wave > 1 ? wave : 1;
  const int64_t lo = round_up(min_len > unit ? min_len : unit, unit);
  const auto cost = [&](int64_t len) { return ceil_div(cols * ceil_div(total, len), wave) * (ceil_div(len, unit) + fixed); };
  int64_t best = total <= max_len ? total : max_len;
  if (total < 2 * lo || best <= lo) return best;
  int64_t best_cost = cost(best);
  for (int64_t k = 1; k <= 256; ++k) {
    const int64_t fit = k * wave / cols;  // splits that fit k waves
    if (fit < 2) continue;
    const int64_t n = fit < 65535 ? fit : 65535;  // the grid's y dimension (the split-K GEMVs refuse more splits)
    int64_t len = round_up(ceil_div(total, n), unit);
    len = len < lo ? lo : len > max_len ? max_len : len;
    const int64_t c = cost(len);
    if (c < best_cost) best = len, best_cost = c;
    if (len == lo || n == 65535) break;  // shorter splits are not allowed
  }
  return best;
}

// Host planning: true when every row of a [n0, n1, n2, row] tensor starts `align`-byte aligned, i.e. the base pointer
// and the stride (in elements of elem_bytes) of every dim longer than one are multiples of it. The wide-load and
// cp.async paths of the GEMVs ask this of their code / scale / zero rows.
inline bool rows_aligned(const void* base, int64_t align, int64_t elem_bytes, int64_t n0, int64_t s0, int64_t n1,
                         int64_t s1, int64_t n2, int64_t s2) {
  const auto ok = [&](int64_t n, int64_t s) { return n <= 1 || (s * elem_bytes) % align == 0; };
  return reinterpret_cast<uintptr_t>(base) % align == 0 && ok(n0, s0) && ok(n1, s1) && ok(n2, s2);
}

// ---- groups of 32-value blocks without a division -------------------------------------------------------------
// A group of G values is bpg = G / 32 blocks. block_group_magic(bpg) = ceil(2^32 / bpg) (0 for bpg = 1), and the group
// of block n is umulhi(n, magic), exact for n < 2^32 / bpg (the launchers keep block indices below that).
inline uint32_t block_group_magic(int64_t bpg) {
  return bpg > 1 ? static_cast<uint32_t>(((uint64_t{1} << 32) + bpg - 1) / bpg) : 0u;
}
__device__ __forceinline__ uint32_t block_group(uint32_t n, uint32_t magic) { return magic == 0 ? n : umulhi(n, magic); }

// ---- activations --------------------------------------------------------------------------------------------
template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float to_float<float>(float v) { return v; }

// Element i of an activation buffer of runtime dtype (used in staging loops, outside the hot inner loop: a
// uniform branch there is cheaper than tripling the number of kernel instantiations).
__device__ __forceinline__ float load_x(const void* x, XDtype dt, int64_t i) {
  switch (dt) {
    case XDtype::kF16: return to_float(__ldg(static_cast<const __half*>(x) + i));
    case XDtype::kBF16: return to_float(__ldg(static_cast<const __nv_bfloat16*>(x) + i));
    default: return __ldg(static_cast<const float*>(x) + i);
  }
}

// Element i of an output buffer of runtime dtype: v rounded to nearest (as torch's .to()), or stored as is (fp32).
__device__ __forceinline__ void store_act(void* y, XDtype dt, int64_t i, float v) {
  switch (dt) {
    case XDtype::kF16: static_cast<__half*>(y)[i] = __float2half_rn(v); break;
    case XDtype::kBF16: static_cast<__nv_bfloat16*>(y)[i] = __float2bfloat16_rn(v); break;
    default: static_cast<float*>(y)[i] = v;
  }
}

// ---- reductions ----------------------------------------------------------------------------------------------
// Maximum over the warp (NaN-propagating, like nan_max), the same in every lane.
__device__ __forceinline__ float warp_max(float v) {
  for (int off = 16; off > 0; off >>= 1) v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

// ---- query-row staging of the tensor-core GEMVs --------------------------------------------------------------
// The GEMVs feed each query row to the MMAs as hi / lo fp16 terms after scaling the row by 2^e, e chosen so its
// max |value| lies in [2^14, 2^15) (mma.cuh: split_half, scale_exponent). These helpers are the two staging passes
// the kernels share; value(xoff, l) is element l of the row at element offset xoff (xoff < 0: a row past the last
// query row, staged as zeros).

// Pass 1: amax[q] = max |value(xoff_of(q), l)| over l < len for the tile's QR rows (non-negative floats order like
// their bits: one atomicMax per warp, order-independent; NaN propagates), then unscale[q] = 2^-e * unscale_mul.
// amax must be zeroed, and that write visible (a barrier), before the call; ends with unscale written (the caller
// synchronizes before reading it, as it does before reading its fragments).
// The rows are the inner loop: a thread has QR independent loads in flight per step instead of one. (The first GPU
// run measured the split-L GEMVs' CTAs as latency-bound; this pass walked one row at a time, a dependent round trip
// per len / blockDim elements of each row.)
template <int QR, typename XOffOf, typename Value>
__device__ __forceinline__ void stage_row_scales(const XOffOf& xoff_of, const Value& value, int len, unsigned* amax,
                                                 float* unscale, float unscale_mul, int lane) {
  int64_t xoff[QR];
  float m[QR];
#pragma unroll
  for (int q = 0; q < QR; ++q) xoff[q] = xoff_of(q), m[q] = 0.f;
#pragma unroll 1
  for (int l = threadIdx.x; l < len; l += blockDim.x) {
    float v[QR];
#pragma unroll
    for (int q = 0; q < QR; ++q) v[q] = xoff[q] >= 0 ? value(xoff[q], l) : 0.f;
#pragma unroll
    for (int q = 0; q < QR; ++q) m[q] = nan_max(m[q], fabsf(v[q]));
  }
#pragma unroll
  for (int q = 0; q < QR; ++q) {
    const float r = warp_max(m[q]);
    if (lane == 0) atomicMax(amax + q, __float_as_uint(r));
  }
  __syncthreads();
  if (threadIdx.x < QR) unscale[threadIdx.x] = exp2i(-scale_exponent(__uint_as_float(amax[threadIdx.x]))) * unscale_mul;
}

// Pass 2 for B fragments of 16 consecutive reduction elements per k-step (gemv_kivi, gemv_lattice_v): warp task =
// (n-tile nt, k-step ks); lane (col g, t) holds query row 4 nt + g / 2, part g & 1 (hi, lo), elements
// 16 ks + 4t .. + 3 (0 past len) as two half2 words, at xfrag[task * 32 + lane].
template <typename XOffOf, typename Value>
__device__ __forceinline__ void stage_fragments_k16(const XOffOf& xoff_of, const Value& value, int len, int ntiles,
                                                    int nks, const unsigned* amax, uint2* xfrag, int warp, int nwarps,
                                                    int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll 2  // two tasks' loads in flight together
  for (int task = warp; task < ntiles * nks; task += nwarps) {
    const int nt = task / nks, ks = task - nt * nks;
    const int q = 4 * nt + (g >> 1);
    const float scale = exp2i(scale_exponent(__uint_as_float(amax[q])));
    const int64_t xoff = xoff_of(q);
    uint16_t hv[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = 16 * ks + 4 * t + i;
      const float v = xoff >= 0 && r < len ? value(xoff, r) * scale : 0.f;
      const HalfSplit sp = split_half(v);
      hv[i] = (g & 1) ? sp.lo : sp.hi;
    }
    xfrag[task * 32 + lane] = make_uint2(pack_half2(hv[0], hv[1]), pack_half2(hv[2], hv[3]));
  }
}

// ---- InnerQ-packed blocks (mma.cuh's decoders) -------------------------------------------------------------------
// The decoder offset: sym decodes to the signed levels u - 2^(b-1) (no zero term), asym and hybrid to u (their
// zero term zeff * sum(x) is added separately).
template <int BITS, QuantMode MODE>
__host__ __device__ constexpr int decode_offset() {
  return MODE == QuantMode::kSym ? (1 << (BITS - 1)) : 0;
}
// The decoders' constants (mma.cuh) for the offset decode_offset<BITS, MODE> gives, chosen at run time (launchers).
inline DecodeConsts decode_consts_for(int bits, QuantMode mode) {
  return decode_consts(bits, mode == QuantMode::kSym ? 1 << (bits - 1) : 0);
}

// The word of a block that load_gather_block<BITS, true> reads first for thread t: word t (bits 4), t / 2 (bits 2),
// 0 (bits 1; bits 3 read from word 0 in the form without OWN_WORD). A kernel that adds it to a row pointer once reads
// each block with load_gather_block<BITS, BITS != 3>(ptr, 0, ...): the same words, no per-load address add.
template <int BITS>
__device__ __forceinline__ uint32_t own_word(int t) {
  return BITS == 4 ? static_cast<uint32_t>(t) : BITS == 2 ? static_cast<uint32_t>(t >> 1) : 0u;
}

// Canonical words (mma.cuh) of thread t from one 32-value block of BITS words, with 32-bit loads. Bits 2: the
// thread's half-word of the low planes is in word t / 2, so prmt(w, w, sel_lo) reads it from {w:w}; bits 3 read both
// low-plane words (prmt picks the half-word), or with OWN_WORD only word t / 2 (one load fewer; the GEMVs' tails
// keep the two loads: the other form cost them registers); bits 1 and 3: byte t of the (high) plane.
// sel_lo = sel_bytes(2t, 2t + 1), sel_hi = sel_bytes(t, t).
template <int BITS, bool OWN_WORD = false>
__device__ __forceinline__ void load_gather_block(const uint32_t* __restrict__ blk, int t, uint32_t sel_lo,
                                                  uint32_t sel_hi, uint32_t& X, uint32_t& Xh) {
  Xh = 0u;
  if constexpr (BITS == 4) {
    X = __ldg(blk + t);
  } else if constexpr (BITS == 1) {
    const uint32_t w = __ldg(blk);
    X = prmt(w, w, sel_hi);
  } else if constexpr (BITS == 3 && !OWN_WORD) {
    X = prmt(__ldg(blk), __ldg(blk + 1), sel_lo);
    const uint32_t h = __ldg(blk + 2);
    Xh = prmt(h, h, sel_hi);
  } else {
    const uint32_t w = __ldg(blk + (t >> 1));
    X = prmt(w, w, sel_lo);
    if constexpr (BITS == 3) {
      const uint32_t h = __ldg(blk + 2);
      Xh = prmt(h, h, sel_hi);
    }
  }
}

// ---- rows with arbitrary leading strides ------------------------------------------------------------------------
__host__ __device__ __forceinline__ int64_t row_offset(const RowLayout& rl, int64_t r) {
  int64_t off = 0;
  for (int d = rl.ndim - 1; d >= 0; --d) {
    const int64_t sz = rl.size[d];
    off += (r % sz) * rl.stride[d];
    r /= sz;
  }
  return off;
}

// Where a GEMV kernel writes its fp32 results for output (b, h, t, n): y itself, or slice `split` of the
// split-K workspace.
struct OutView {
  float* base;
  int64_t sb, sh, st;  // batch, head, query-row strides (the last dim is contiguous)
  int64_t s_split;     // stride between splits (0 when writing y directly)
};

}  // namespace kvk
