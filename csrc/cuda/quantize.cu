// Storage ops on CUDA: quantize_groups_into, dequantize_groups, pack_bits, unpack_bits.
//
// quantize: one thread per group runs exactly the kvk::quantize_group_* code the C++ CPU op runs (quant.cuh),
// in the same sequential order and with IEEE-rounded arithmetic (quant.cuh's *_rn helpers, immune to
// --use_fast_math and FMA contraction), so codes, scales and zeros are bit-identical to the CPU op. The group is
// staged as fp32 in the thread's own shared-memory segment (stride G + 1 floats: consecutive threads start in
// consecutive banks), its codes go to shared memory too, then are packed block by block in registers and
// written to the (arbitrarily strided) outputs. Quantization runs once per token, not per step: it is not the
// hot path, and bit-exactness matters more here than bandwidth.
#include <cuda_runtime.h>

#include <algorithm>

#include "kvkernels/gemv.cuh"

namespace kvk {
namespace {

constexpr int kQuantSmemBudget = 40 * 1024;  // under the 48 KiB default: no opt-in attribute needed
constexpr int kQuantMaxThreads = 128;
constexpr int kElementwiseThreads = 256;

// Shared-memory floats per thread: x, codes, and (hybrid) the losing candidate's codes, each G + 1 long.
__host__ __device__ constexpr int quant_segments(QuantMode mode) { return mode == QuantMode::kHybrid ? 3 : 2; }

template <int BITS, QuantMode MODE>
__global__ void __launch_bounds__(kQuantMaxThreads) quantize_groups_kernel(const QuantizeParams p) {
  extern __shared__ float smem[];
  const int G = p.group_size;
  const int seg = G + 1;
  const int64_t groups_per_row = p.L / G;
  const int64_t gidx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (gidx >= p.rows * groups_per_row) return;  // no block-level sync below: early exit is safe
  const int64_t row = gidx / groups_per_row;
  const int64_t gi = gidx - row * groups_per_row;

  float* xs = smem + threadIdx.x * seg;
  uint32_t* codes = reinterpret_cast<uint32_t*>(smem + (blockDim.x + threadIdx.x) * seg);
  uint32_t* scratch = reinterpret_cast<uint32_t*>(smem + (2 * blockDim.x + threadIdx.x) * seg);  // hybrid only

  const int64_t xoff = row_offset(p.x_rows, row) + gi * G;
  for (int i = 0; i < G; ++i) xs[i] = load_x(p.x, p.x_dtype, xoff + i);

  GroupQuant q;
  if constexpr (MODE == QuantMode::kSym) {
    q = quantize_group_sym(xs, G, BITS, codes);
  } else if constexpr (MODE == QuantMode::kAsym) {
    q = quantize_group_asym(xs, G, BITS, p.calib, codes);
  } else {
    q = quantize_group_hybrid(xs, G, BITS, codes, scratch);
  }
  p.scales[row_offset(p.s_rows, row) + gi] = q.scale_bits;
  p.zeros[row_offset(p.z_rows, row) + gi] = q.zero_bits;

  // A group is G / 32 whole blocks, so its words start at gi * (G / 32) * BITS.
  uint32_t* dst = p.codes + row_offset(p.c_rows, row) + gi * (G / 32) * BITS;
  for (int blk = 0; blk < G / 32; ++blk) {
    uint32_t words[BITS];
    pack_block<BITS>(codes + blk * kBlockValues, words);  // in registers: one store per word
#pragma unroll
    for (int w = 0; w < BITS; ++w) dst[blk * BITS + w] = words[w];
  }
}

// One thread per value: out[r, l] = s * u + zeff, rounded exactly like the CPU op (no FMA contraction).
template <int BITS>
__global__ void dequantize_groups_kernel(const DequantizeParams p) {
  const int64_t n = p.rows * p.L;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / p.L, l = i - row * p.L;
    const int64_t g = l / p.group_size;
    const uint32_t* blk = p.codes + row_offset(p.c_rows, row) + (l >> 5) * BITS;
    const uint32_t u = unpack_one<BITS>(blk, static_cast<int>(l & 31));
    const uint16_t sb = p.scales[row_offset(p.s_rows, row) + g];
    const uint16_t zb = p.zeros == nullptr ? uint16_t{0} : p.zeros[row_offset(p.z_rows, row) + g];
    const GroupAffine a = group_affine_rt(p.mode, BITS, sb, zb);
    p.out[i] = add_rn(mul_rn(a.s, static_cast<float>(u)), a.zeff);
  }
}

template <int BITS>
__global__ void pack_bits_kernel(const PackParams p) {
  for (int64_t blk = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; blk < p.nblocks;
       blk += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint32_t vals[kBlockValues];
#pragma unroll
    for (int i = 0; i < kBlockValues; ++i) vals[i] = static_cast<uint32_t>(p.codes[blk * kBlockValues + i]);
    uint32_t words[BITS];
    pack_block<BITS>(vals, words);
#pragma unroll
    for (int w = 0; w < BITS; ++w) p.packed[blk * BITS + w] = words[w];
  }
}

template <int BITS>
__global__ void unpack_bits_kernel(const UnpackParams p) {
  const int64_t n = p.nblocks * kBlockValues;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    p.codes[i] = static_cast<uint8_t>(unpack_one<BITS>(p.packed + (i >> 5) * BITS, static_cast<int>(i & 31)));
  }
}

unsigned grid_for(int64_t n, int threads) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(ceil_div(n, threads), 65535 * 8)));
}

}  // namespace

cudaError_t launch_quantize_groups_into(const QuantizeParams& p, cudaStream_t stream) {
  clear_launch_error();
  if (p.group_size <= 0 || p.group_size % 32 != 0 || p.L % p.group_size != 0) {
    set_launch_error("quantize_groups_into: group_size=%d must be a positive multiple of 32 dividing L=%lld",
                     p.group_size, (long long)p.L);
    return cudaErrorInvalidValue;
  }
  const int64_t ngroups = p.rows * (p.L / p.group_size);
  if (ngroups == 0) return cudaSuccess;
  const size_t per_thread = sizeof(float) * (p.group_size + 1) * quant_segments(p.mode);
  if (per_thread > static_cast<size_t>(kQuantSmemBudget)) {
    set_launch_error("quantize_groups_into: group_size=%d needs %zu bytes of shared memory per group (max %d)",
                     p.group_size, per_thread, kQuantSmemBudget);
    return cudaErrorInvalidConfiguration;
  }
  const int threads = static_cast<int>(std::min<size_t>(kQuantMaxThreads, kQuantSmemBudget / per_thread));
  const int64_t blocks = ceil_div(ngroups, threads);
  if (blocks > 0x7fffffff) {
    set_launch_error("quantize_groups_into: too many groups (%lld)", (long long)ngroups);
    return cudaErrorInvalidConfiguration;
  }
  KVK_DISPATCH_BITS(p.bits, BITS, {
    KVK_DISPATCH_MODE(p.mode, MODE, {
      quantize_groups_kernel<BITS, MODE><<<static_cast<unsigned>(blocks), threads, per_thread * threads, stream>>>(p);
    })
  })
  return cudaGetLastError();
}

cudaError_t launch_dequantize_groups(const DequantizeParams& p, cudaStream_t stream) {
  clear_launch_error();
  if (p.group_size <= 0 || p.group_size % 32 != 0 || p.L % p.group_size != 0) {
    set_launch_error("dequantize_groups: group_size=%d must be a positive multiple of 32 dividing L=%lld",
                     p.group_size, (long long)p.L);
    return cudaErrorInvalidValue;
  }
  const int64_t n = p.rows * p.L;
  if (n == 0) return cudaSuccess;  // before the zeros check: an empty zeros tensor has no data pointer
  if (p.mode != QuantMode::kSym && p.zeros == nullptr) {
    set_launch_error("dequantize_groups: asym and hybrid modes need zeros");
    return cudaErrorInvalidValue;
  }
  KVK_DISPATCH_BITS(p.bits, BITS, {
    dequantize_groups_kernel<BITS><<<grid_for(n, kElementwiseThreads), kElementwiseThreads, 0, stream>>>(p);
  })
  return cudaGetLastError();
}

cudaError_t launch_pack_bits(const PackParams& p, cudaStream_t stream) {
  clear_launch_error();
  if (p.nblocks == 0) return cudaSuccess;
  KVK_DISPATCH_BITS(p.bits, BITS, {
    pack_bits_kernel<BITS><<<grid_for(p.nblocks, kElementwiseThreads), kElementwiseThreads, 0, stream>>>(p);
  })
  return cudaGetLastError();
}

cudaError_t launch_unpack_bits(const UnpackParams& p, cudaStream_t stream) {
  clear_launch_error();
  const int64_t n = p.nblocks * kBlockValues;
  if (n == 0) return cudaSuccess;
  KVK_DISPATCH_BITS(p.bits, BITS, {
    unpack_bits_kernel<BITS><<<grid_for(n, kElementwiseThreads), kElementwiseThreads, 0, stream>>>(p);
  })
  return cudaGetLastError();
}

}  // namespace kvk
