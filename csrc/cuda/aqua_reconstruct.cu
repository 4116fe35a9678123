// AQUA-KV reconstruction (docs/FORMATS.md "AQUA-KV"; kvkernels/reference/aqua.py is the spec), a GEMM whose
// epilogue adds the lattice-coded residual:
//   out[t, c] = ((sum_i prev[t, i] W[c, i] + sum_j prev2[t, j] W2[c, j]) + bias[c]) + deq(codes, norms)[t, c]
// with deq the lattice dequantization, per group of G channels x_hat = s * H_n (r16 * grid[c]) (docs/FORMATS.md
// "Lattice"). M = T tokens, N = C output channels, K = C_in (+ C_in2).
//
// Tiling. A CTA owns BM = 32 x WM tokens x kBN = 128 output channels (whole lattice groups: G in {32, 64, 128}
// divides 128), so each group's residual is dequantized inside the CTA and the GEMM result never leaves it. Its
// 2 x WM warps each own 32 tokens x 64 channels: 2 m-tiles x 8 n-tiles of mma.sync.m16n8k16 (fp16 or bf16 operands,
// fp32 accumulators, 64 per thread). prev / W tiles of kBK = 32 input channels go through a kStages-deep cp.async
// pipeline in shared memory (rows of 64 bytes, 16-byte chunks XOR-swizzled by bits 1-2 of the row so that the
// ldmatrix.x4 of 8 rows hits 8 distinct bank groups) and reach the tensor cores through ldmatrix.x4: per k16 step a
// warp issues 2 + 4 LDSM for 16 HMMA. prev2 / W2 run as a second pass of the same loop into the same accumulators:
// the concatenation [prev ; prev2] is never formed. Rows past T or C read the last valid row instead (their
// accumulators are never stored: no per-row predicates), and input channels past C_in are zero-filled by cp.async's
// src-size, which only the last tile needs: the steady-state loop prefetches whole tiles with plain cp.async, and a
// second short loop runs the last kStages - 1 iterations, whose prefetch may be the K tail. WM = 2 (64 tokens, 4
// warps) by default; WM = 1 (32 tokens) when the tile count is below the SM count (a 128-token chunk: twice the
// CTAs). Every output sums over the input channels in one fixed order whatever WM and T, so a token's row is the
// same bits in any launch (no split-K, no atomics).
//
// Epilogue. acc + bias goes to shared memory (fp32 [BM][kBN + 8]: conflict-free float2 stores from the C fragments),
// then each (token, group) item is taken by a quad of lanes, lane t holding the channel pairs 2t + 8k of the group
// (k < G / 8): the C-fragment layout, in which the inverse Walsh-Hadamard transform's stage h = 1 is within a
// lane's pair, h = 2 and 4 are one shuffle each (partners t ^ 1, t ^ 2), and h >= 8 pairs octets k and k + h / 8 of
// the same lane. The grid is in shared memory (fp32, exact), the lane's code words are read once per 32-channel
// block, and every step is the reference's fp32 operation in its order (r16 * grid, butterflies h = 1 .. G/2, the
// multiplies by fp32(1 / sqrt(G)) and by s, then (acc + bias) + deq), through the _rn intrinsics so that
// --use_fast_math cannot contract them; two steps are fused where that is exact (a butterfly across lanes is one
// fma(+-1, own, partner); x * inv * s is x * (s * inv) for s = +-1). So the residual is bit-identical to
// lattice_dequantize (fp32 subnormals aside: fast-math flushes them), and the result differs from the reference only
// by the GEMM's fp32 accumulation order.
//
// Dtypes. fp16 and bf16 run on tensor cores: a product of two fp16 (or two bf16) is exact in fp32, so only the
// accumulation order differs from the fp32 reference. fp32 operands take a plain SIMT path (FFMA, 64 x 128 CTA tile,
// 4 x 8 outputs per thread): the test path, correct but not fast (no TF32, no hi/lo split). Same epilogue.
//
// The tensor-core path reads rows with 16-byte cp.async: operands must start 16-byte aligned with row strides a
// multiple of 8 elements (csrc/cuda/torch_bindings.cpp copies a view that is not into padded rows). Unsupported:
// G = 256 .. 1024 (the lattice format allows them; a group would not fit the CTA tile): the launcher fails with a
// message, the binding raises ValueError first.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kvkernels/async_copy.cuh"
#include "kvkernels/gemv.cuh"
#include "kvkernels/lattice.cuh"
#include "kvkernels/mma.cuh"

namespace kvk {
namespace {

constexpr int kBN = 128;       // output channels per CTA (a multiple of every supported G)
constexpr int kBK = 32;        // input channels per pipeline stage: rows of 64 bytes, four 16-byte chunks
constexpr int kStages = 3;     // cp.async pipeline depth
constexpr int kEpiStride = kBN + 8;  // floats per row of the epilogue tile (+8: float2 accesses of 8 rows spread
                                     // over all 32 banks)
constexpr int kF32BM = 64;     // SIMT path: tokens per CTA
constexpr int kF32BK = 16;     // SIMT path: input channels per stage
constexpr int kF32Threads = 256;

// Shared memory of the tensor-core kernel: the pipeline (reused by the epilogue tile), then the grid table, then the
// per-channel output scale (G floats).
__host__ __device__ constexpr int mma_stage_bytes(int bm) { return (bm + kBN) * kBK * 2; }
__host__ __device__ constexpr int mma_region_bytes(int bm) {
  return kStages * mma_stage_bytes(bm) > bm * kEpiStride * 4 ? kStages * mma_stage_bytes(bm) : bm * kEpiStride * 4;
}
__host__ __device__ constexpr int f32_region_bytes() {
  return (kF32BM + kBN) * kF32BK * 4 > kF32BM * kEpiStride * 4 ? (kF32BM + kBN) * kF32BK * 4
                                                                : kF32BM * kEpiStride * 4;
}
constexpr int kMaxTableFloats = 256 * 4;  // grids of n <= 256 entries of d <= 4 values
constexpr int kMaxGroup = 128;
// Resident CTAs per SM the register allocation is sized for (ptxas's cap: 64K / (CTAs x threads)): WM = 2 (128
// threads, 40.5 KB of shared memory) 4 CTAs at <= 128 registers; WM = 1 (64 threads, 34.5 KB) 6 CTAs, which shared
// memory allows anyway, at <= 170 (its 10 chunk pointers per thread do not fit 128 without spilling in the loop).
__host__ __device__ constexpr int mma_min_ctas(int wm) { return wm == 1 ? 6 : 4; }

// ---- ldmatrix (cp.async and shared-memory addresses: kvkernels/async_copy.cuh) ---------------------------------
// ldmatrix.sync.aligned.m8n8.x4.shared.b16: lanes 8j .. 8j + 7 give the row addresses of matrix j; r[j] of lane i is
// matrix j's row i / 4, elements 2 (i % 4), 2 (i % 4) + 1 (an MMA fragment register).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], SmemAddr a) {
#if defined(__CUDA_ARCH__)
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
#elif defined(KVK_EMU)
  kvk_emu::ldmatrix_x4(r, a);
#else
  (void)r, (void)a;  // host pass of nvcc: never called
#endif
}

// 16-byte chunk `chunk` (0..3) of tile row `row` (64 bytes): swizzled by bits 1-2 of the row, so the 8 rows an
// ldmatrix reads (and a cp.async warp writes) fall in 8 distinct groups of 4 banks.
__host__ __device__ constexpr int swizzled(int row, int chunk) { return row * 64 + ((chunk ^ ((row >> 1) & 3)) << 4); }

// ---- tensor-core main loop ---------------------------------------------------------------------------------------
// acc[mt][nt] += A[m0 + rows, :K] @ W[n0 + cols, :K]^T for the warp's 2 x 8 tiles. A [T, K] and W [C, K] hold 16-bit
// values (fp16 or bf16 bits), row strides s_a / s_w in elements. Ends with the pipeline drained and the CTA
// synchronized (the shared memory may be reused).
template <bool BF16, int WM>
__device__ __forceinline__ void mma_pass(float (&acc)[2][8][4], const uint16_t* __restrict__ A,
                                         const uint16_t* __restrict__ W, int64_t K, int64_t s_a, int64_t s_w,
                                         int64_t T, int64_t C, int64_t m0, int64_t n0, char* pipe) {
  constexpr int BM = 32 * WM, kThreads = 64 * WM;
  constexpr int kAChunks = BM * 4 / kThreads;   // 16-byte chunks per thread and stage: 2
  constexpr int kBChunks = kBN * 4 / kThreads;  // 8 / WM
  constexpr int kRowStep = kThreads / 4;        // rows between a thread's chunks (a multiple of 8: same swizzle)
  constexpr int kStage = mma_stage_bytes(BM), kABytes = BM * kBK * 2;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int wm = warp / 2, wn = warp % 2;
  const int ntiles = static_cast<int>(ceil_div(K, kBK));
  const int nfull = static_cast<int>(K / kBK);  // tiles holding kBK input channels; the last may hold fewer
  if (ntiles == 0) return;

  // Loads: thread tid copies chunk tid % 4 of rows tid / 4 + j * kRowStep. A row past T (C) reads row T - 1 (C - 1)
  // instead: its accumulators are never stored, and no per-row predicate is needed. Input channels past K are
  // zero-filled by cp.async's src-size (the last tile only).
  const int kc = tid % 4;
  const uint16_t* asrc[kAChunks];
  const uint16_t* bsrc[kBChunks];
#pragma unroll
  for (int j = 0; j < kAChunks; ++j) asrc[j] = A + min(m0 + tid / 4 + j * kRowStep, T - 1) * s_a + kc * 8;
#pragma unroll
  for (int j = 0; j < kBChunks; ++j) bsrc[j] = W + min(n0 + tid / 4 + j * kRowStep, C - 1) * s_w + kc * 8;
  const SmemAddr base = smem_addr(pipe);
  const int dst0 = swizzled(tid / 4, kc);
  const auto load_full = [&](int stage, int tile) {  // all kBK input channels exist
    const int64_t k0 = static_cast<int64_t>(tile) * kBK;
    const SmemAddr st = base + stage * kStage + dst0;
#pragma unroll
    for (int j = 0; j < kAChunks; ++j) cp_async<16>(st + j * kRowStep * 64, asrc[j] + k0);
#pragma unroll
    for (int j = 0; j < kBChunks; ++j) cp_async<16>(st + kABytes + j * kRowStep * 64, bsrc[j] + k0);
  };
  const auto load_any = [&](int stage, int tile) {  // any tile, the K tail included
    const int64_t k0 = static_cast<int64_t>(tile) * kBK;
    const int64_t rem = K - k0 - kc * 8;  // input channels left from this thread's chunk on
    const uint32_t bytes = rem >= 8 ? 16u : (rem > 0 ? static_cast<uint32_t>(2 * rem) : 0u);
    const SmemAddr st = base + stage * kStage + dst0;
#pragma unroll
    for (int j = 0; j < kAChunks; ++j) cp_async_zfill<16>(st + j * kRowStep * 64, asrc[j] + k0, bytes);
#pragma unroll
    for (int j = 0; j < kBChunks; ++j) cp_async_zfill<16>(st + kABytes + j * kRowStep * 64, bsrc[j] + k0, bytes);
  };

  // Fragments: lane L addresses row L % 16 (A: token; chunk 2 ks + L / 16) and channel (L / 16) * 8 + L % 8 (B:
  // chunk 2 ks + (L / 8) % 2) of each 16-row slab; slabs 1024 bytes apart. The k16 step ks = 1 is chunk ^ 2, i.e.
  // byte offset ^ 32 (the swizzle only touches bits 4-5).
  const int a_off = swizzled(wm * 32 + lane % 16, lane / 16);
  const int b_off = kABytes + swizzled(wn * 64 + (lane / 16) * 8 + lane % 8, (lane / 8) % 2);
  const auto compute = [&](int stage) {
    const SmemAddr st = base + stage * kStage;
#pragma unroll
    for (int ks = 0; ks < 2; ++ks) {
      uint32_t af[2][4], bf[4][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) ldmatrix_x4(af[mt], st + ((a_off ^ (32 * ks)) + mt * 1024));
#pragma unroll
      for (int np = 0; np < 4; ++np) ldmatrix_x4(bf[np], st + ((b_off ^ (32 * ks)) + np * 1024));
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          const uint32_t b[2] = {bf[nt / 2][2 * (nt % 2)], bf[nt / 2][2 * (nt % 2) + 1]};
          if constexpr (BF16) {
            mma_m16n8k16_bf16(acc[mt][nt], af[mt], b, acc[mt][nt]);
          } else {
            mma_m16n8k16(acc[mt][nt], af[mt], b, acc[mt][nt]);
          }
        }
    }
  };

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < ntiles) load_any(s, s);
    cp_async_commit();
  }
  // Iteration i: tile i has landed (cp.async.wait: this thread's copies; the barrier: everyone's), and stage wr,
  // computed at i - 1, is free for tile i + kStages - 1.
  int rd = 0, wr = kStages - 1;  // stages read (computed) and written (loaded) this iteration
  int i = 0;
  // The steady state: every prefetched tile is a full one (plain cp.async, no byte counts).
#pragma unroll 1
  for (; i + kStages - 1 < nfull; ++i) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    load_full(wr, i + kStages - 1);
    cp_async_commit();
    compute(rd);
    rd = rd == kStages - 1 ? 0 : rd + 1;
    wr = wr == kStages - 1 ? 0 : wr + 1;
  }
  // The last kStages - 1 iterations (or all, for K < kStages x kBK): the prefetch, if any, may be the K tail.
#pragma unroll 1
  for (; i < ntiles; ++i) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    if (i + kStages - 1 < ntiles) load_any(wr, i + kStages - 1);
    cp_async_commit();
    compute(rd);
    rd = rd == kStages - 1 ? 0 : rd + 1;
    wr = wr == kStages - 1 ? 0 : wr + 1;
  }
  cp_async_wait<0>();
  __syncthreads();
}

// ---- the lattice epilogue ----------------------------------------------------------------------------------------
// a * b + c rounded once (the mul_rn / add_rn family of quant.cuh: an intrinsic nvcc never re-associates).
__device__ __forceinline__ float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

// The grid index that lane t of a quad needs from a 32-channel block held in w[0 .. bits) for octet kb (0..3) of the
// block: pair 4 kb + t (d = 2), or quad 2 kb + t / 2 (d = 4). kb is a compile-time constant once unrolled, so every
// word is picked statically (a runtime w[j / 8] would put the array in local memory); docs/FORMATS.md "Packing".
template <LatticeGrid GRID>
__device__ __forceinline__ uint32_t lane_index(const uint32_t (&w)[4], int kb, int t) {
  if constexpr (GRID == LatticeGrid::kE2_16) {  // pair j = 4 kb + t: word j / 8 = kb / 2, nibble j % 8
    return (w[kb / 2] >> (16 * (kb % 2) + 4 * t)) & 15u;
  } else if constexpr (GRID == LatticeGrid::kE2_256) {  // pair j = 4 kb + t: word kb, byte t
    return (w[kb] >> (8 * t)) & 255u;
  } else if constexpr (GRID == LatticeGrid::kE4_256) {  // quad j = 2 kb + t / 2: word kb / 2, byte j % 4
    return (w[kb / 2] >> (16 * (kb % 2) + 8 * (t / 2))) & 255u;
  } else {  // EDEN2-64, pair j = 4 kb + t: j < 15 in word j / 5 at bit 6 (j % 5); j = 15 from the top bits of all three
    const int j = 4 * kb + t;
    if (j == 15) return (w[0] >> 30) | ((w[1] >> 30) << 2) | ((w[2] >> 30) << 4);
    const uint32_t word = j < 5 ? w[0] : (j < 10 ? w[1] : w[2]);
    return (word >> (6 * (j % 5))) & 63u;
  }
}

// out = E + deq for the CTA's tile, E = acc + bias (fp32 [BM][kEpiStride] in shared memory), BM = 2^bm_log2. Items
// (token row r, group q) go to quads, r fastest (the 8 quads of a warp read 8 rows: float2 loads of E without bank
// conflicts, and each output store instruction writes 8 full 32-byte sectors). Every lane runs the same number of
// items (a row past T or a group past C is computed on valid data and not stored), so the shuffles see the whole
// warp.
template <LatticeGrid GRID, int G>
__device__ __forceinline__ void residual_epilogue(const uint32_t* __restrict__ codes,
                                                  const uint16_t* __restrict__ norms, float* __restrict__ out,
                                                  int64_t T, int64_t C, int64_t s_codes, int64_t s_norms,
                                                  int64_t s_out, const float* E, const float* tab, const float* scale,
                                                  int64_t m0, int64_t n0, int bm_log2) {
  constexpr int K8 = G / 8;  // channel octets of a group: pairs per lane
  constexpr int kD = lattice_d(GRID), kWords = lattice_bits(GRID);
  const int quads = static_cast<int>(blockDim.x) / 4;
  const int items = (kBN / G) << bm_log2;  // a multiple of `quads` for every kernel's (BM, threads)
  const int t = threadIdx.x % 4;
  const int rounds = items / quads;  // uniform: the compiler can see that the warp stays converged for the shuffles
#pragma unroll 1
  for (int round = 0; round < rounds; ++round) {
    const int it = static_cast<int>(threadIdx.x) / 4 + round * quads;
    const int r = it & ((1 << bm_log2) - 1), cl = (it >> bm_log2) * G;  // tile row, group's first tile channel
    const int64_t tok = m0 + r, c0 = n0 + cl;
    const bool ok = tok < T && c0 < C;
    // an item past T or C decodes the last row's last group instead (the same work on valid memory; not stored)
    const int64_t tr = min(tok, T - 1), cr = min(c0, C - G);
    float v[2 * K8];
    const uint32_t* crow = codes + tr * s_codes + cr / 32 * kWords;
    const float r16 = half_bits_to_float(__ldg(norms + tr * s_norms + cr / G));
    // r16 * grid[c] of the lane's pairs: octet k = 4 b + kb of block b holds pair 4 kb + t of the block (d = 2), or
    // half t % 2 of its quad 2 kb + t / 2 (d = 4)
#pragma unroll
    for (int b = 0; b < G / 32; ++b) {
      uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
      for (int i = 0; i < kWords; ++i) w[i] = __ldg(crow + b * kWords + i);
#pragma unroll
      for (int kb = 0; kb < 4; ++kb) {
        const int k = 4 * b + kb;
        const uint32_t idx = lane_index<GRID>(w, kb, t);
        const float2 x = reinterpret_cast<const float2*>(tab)[kD == 2 ? idx : 2 * idx + (t & 1)];
        v[2 * k] = mul_rn(x.x, r16);
        v[2 * k + 1] = mul_rn(x.y, r16);
      }
    }
    // butterflies in the reference's order: h = 1 (the pair), 2 and 4 (lanes t ^ 1, t ^ 2), 8 .. G / 2 (octets)
#pragma unroll
    for (int k = 0; k < K8; ++k) {
      const float a = v[2 * k], c = v[2 * k + 1];
      v[2 * k] = add_rn(a, c);
      v[2 * k + 1] = sub_rn(a, c);
    }
#pragma unroll
    for (int h = 1; h <= 2; h <<= 1) {
      // the lane holding a keeps a + b, the one holding b keeps a - b: fma(+-1, own, partner), the product exact and
      // the sum rounded once, as the reference's add / subtract
      const float own = (t & h) != 0 ? -1.f : 1.f;
#pragma unroll
      for (int i = 0; i < 2 * K8; ++i) v[i] = fma_rn(own, v[i], __shfl_xor_sync(0xffffffffu, v[i], h));
    }
#pragma unroll
    for (int m = 1; m < K8; m <<= 1)
#pragma unroll
      for (int k = 0; k < K8; ++k)
        if ((k & m) == 0)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float a = v[2 * k + e], c = v[2 * (k + m) + e];
            v[2 * k + e] = add_rn(a, c);
            v[2 * (k + m) + e] = sub_rn(a, c);
          }
    const float* erow = E + r * kEpiStride + cl;
    float* orow = out + tr * s_out + cr;
#pragma unroll
    for (int k = 0; k < K8; ++k) {
      const int j = 8 * k + 2 * t;  // channel within the group
      const float2 sc = *reinterpret_cast<const float2*>(scale + j);
      const float2 e = *reinterpret_cast<const float2*>(erow + j);
      if (ok)
        *reinterpret_cast<float2*>(orow + j) =
            make_float2(add_rn(e.x, mul_rn(v[2 * k], sc.x)), add_rn(e.y, mul_rn(v[2 * k + 1], sc.y)));
    }
  }
}

template <LatticeGrid GRID>
__device__ __forceinline__ void residual_epilogue_g(const AquaReconstructParams& p, const float* E, const float* tab,
                                                    const float* scale, int64_t m0, int64_t n0, int bm_log2) {
#define KVK_AQUA_EPILOGUE(G)                                                                                      \
  residual_epilogue<GRID, G>(p.codes, p.norms, p.out, p.T, p.C, p.s_codes, p.s_norms, p.s_out, E, tab, scale, m0, \
                             n0, bm_log2)
  switch (p.group_size) {  // the launcher admits 32, 64, 128 only
    case 32: KVK_AQUA_EPILOGUE(32); break;
    case 64: KVK_AQUA_EPILOGUE(64); break;
    default: KVK_AQUA_EPILOGUE(128); break;
  }
#undef KVK_AQUA_EPILOGUE
}

// The grid and G are uniform runtime choices of the epilogue only (the main loop does not depend on them): one kernel
// per dtype and tile height, and a switch here.
__device__ __forceinline__ void residual_epilogue_any(const AquaReconstructParams& p, const float* E, const float* tab,
                                                      const float* scale, int64_t m0, int64_t n0, int bm_log2) {
  switch (p.grid_kind) {
    case LatticeGrid::kE2_16:
      residual_epilogue_g<LatticeGrid::kE2_16>(p, E, tab, scale, m0, n0, bm_log2);
      break;
    case LatticeGrid::kE2_64:
      residual_epilogue_g<LatticeGrid::kE2_64>(p, E, tab, scale, m0, n0, bm_log2);
      break;
    case LatticeGrid::kE2_256:
      residual_epilogue_g<LatticeGrid::kE2_256>(p, E, tab, scale, m0, n0, bm_log2);
      break;
    default:
      residual_epilogue_g<LatticeGrid::kE4_256>(p, E, tab, scale, m0, n0, bm_log2);
      break;
  }
}

// The grid (fp32, exact: n * d floats) and the per-channel output scale s_j * fp32(1 / sqrt(G)) (s_j = +1 without
// signs) into shared memory, read after the CTA's next __syncthreads. The reference multiplies by fp32(1 / sqrt(G))
// and then by s_j; s_j = +-1 makes that one multiply by +-fp32(1 / sqrt(G)), bit for bit (a sign flip is exact).
__device__ __forceinline__ void stage_table_and_scale(const AquaReconstructParams& p, float inv_sqrt_g, float* tab,
                                                      float* scale) {
  const int nd = lattice_n(p.grid_kind) * lattice_d(p.grid_kind);
  for (int i = threadIdx.x; i < nd; i += blockDim.x) tab[i] = __ldg(p.grid + i);
  for (int i = threadIdx.x; i < p.group_size; i += blockDim.x)
    scale[i] = p.signs == nullptr ? inv_sqrt_g : mul_rn(static_cast<float>(__ldg(p.signs + i)), inv_sqrt_g);
}

// ---- kernels -----------------------------------------------------------------------------------------------------
// Grid: (token tiles, column tiles of kBN).
template <bool BF16, int WM>
__global__ void __launch_bounds__(64 * WM, mma_min_ctas(WM))
    aqua_reconstruct_mma_kernel(const AquaReconstructParams p, float inv_sqrt_g) {
  constexpr int BM = 32 * WM;
  extern __shared__ __align__(16) float smem[];
  char* pipe = reinterpret_cast<char*>(smem);
  float* tab = smem + mma_region_bytes(BM) / 4;
  float* scale = tab + kMaxTableFloats;
  stage_table_and_scale(p, inv_sqrt_g, tab, scale);
  const int64_t m0 = static_cast<int64_t>(blockIdx.x) * BM, n0 = static_cast<int64_t>(blockIdx.y) * kBN;

  float acc[2][8][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.f;
  mma_pass<BF16, WM>(acc, static_cast<const uint16_t*>(p.prev), static_cast<const uint16_t*>(p.weight), p.C_in,
                     p.s_prev, p.s_w, p.T, p.C, m0, n0, pipe);
  if (p.prev2 != nullptr)
    mma_pass<BF16, WM>(acc, static_cast<const uint16_t*>(p.prev2), static_cast<const uint16_t*>(p.weight2), p.C_in2,
                       p.s_prev2, p.s_w2, p.T, p.C, m0, n0, pipe);

  // acc + bias -> E. Lane (g, t) holds rows g, g + 8 of each m-tile, channels 2t, 2t + 1 of each n-tile.
  float* E = smem;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
  const int wm = warp / 2, wn = warp % 2;
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    const int c = wn * 64 + nt * 8 + 2 * t;
    const bool cok = n0 + c < p.C;  // C is a multiple of G >= 32: channel c + 1 exists too
    const float b0 = cok ? __ldg(p.bias + n0 + c) : 0.f, b1 = cok ? __ldg(p.bias + n0 + c + 1) : 0.f;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = wm * 32 + mt * 16 + g + 8 * h;
        *reinterpret_cast<float2*>(E + r * kEpiStride + c) =
            make_float2(add_rn(acc[mt][nt][2 * h], b0), add_rn(acc[mt][nt][2 * h + 1], b1));
      }
  }
  __syncthreads();
  residual_epilogue_any(p, E, tab, scale, m0, n0, WM == 1 ? 5 : 6);
}

// fp32 operands: the SIMT test path. 256 threads, 64 tokens x 128 channels, thread (tx, ty) = (tid % 16, tid / 16)
// computes tokens 4 ty .. 4 ty + 3 x channels 4 tx .. + 3 and 64 + 4 tx .. + 3 with FFMA, operands staged k-major.
__device__ __forceinline__ void f32_pass(float (&acc)[4][8], const float* __restrict__ A, const float* __restrict__ W,
                                         int64_t K, int64_t s_a, int64_t s_w, int64_t T, int64_t C, int64_t m0,
                                         int64_t n0, float* As, float* Bs) {
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
#pragma unroll 1
  for (int64_t k0 = 0; k0 < K; k0 += kF32BK) {
    __syncthreads();  // the previous tile is no longer read
    for (int i = tid; i < kF32BM * kF32BK; i += kF32Threads) {
      const int r = i / kF32BK, kk = i % kF32BK;
      const int64_t tok = m0 + r;
      As[kk * kF32BM + r] = tok < T && k0 + kk < K ? __ldg(A + tok * s_a + k0 + kk) : 0.f;
    }
    for (int i = tid; i < kBN * kF32BK; i += kF32Threads) {
      const int n = i / kF32BK, kk = i % kF32BK;
      const int64_t c = n0 + n;
      Bs[kk * kBN + n] = c < C && k0 + kk < K ? __ldg(W + c * s_w + k0 + kk) : 0.f;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kF32BK; ++kk) {
      const float4 a = *reinterpret_cast<const float4*>(As + kk * kF32BM + 4 * ty);
      const float4 b0 = *reinterpret_cast<const float4*>(Bs + kk * kBN + 4 * tx);
      const float4 b1 = *reinterpret_cast<const float4*>(Bs + kk * kBN + 64 + 4 * tx);
      const float av[4] = {a.x, a.y, a.z, a.w}, bv[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
    }
  }
  __syncthreads();  // the staging buffers may be reused
}

__global__ void __launch_bounds__(kF32Threads, 2)
    aqua_reconstruct_f32_kernel(const AquaReconstructParams p, float inv_sqrt_g) {
  extern __shared__ __align__(16) float smem[];
  float* tab = smem + f32_region_bytes() / 4;
  float* scale = tab + kMaxTableFloats;
  stage_table_and_scale(p, inv_sqrt_g, tab, scale);
  const int64_t m0 = static_cast<int64_t>(blockIdx.x) * kF32BM, n0 = static_cast<int64_t>(blockIdx.y) * kBN;
  float* As = smem;
  float* Bs = smem + kF32BM * kF32BK;
  float acc[4][8];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[i][j] = 0.f;
  f32_pass(acc, static_cast<const float*>(p.prev), static_cast<const float*>(p.weight), p.C_in, p.s_prev, p.s_w, p.T,
           p.C, m0, n0, As, Bs);
  if (p.prev2 != nullptr)
    f32_pass(acc, static_cast<const float*>(p.prev2), static_cast<const float*>(p.weight2), p.C_in2, p.s_prev2,
             p.s_w2, p.T, p.C, m0, n0, As, Bs);
  float* E = smem;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int c = (j < 4 ? 0 : 64) + 4 * tx + j % 4;
    const float b = n0 + c < p.C ? __ldg(p.bias + n0 + c) : 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) E[(4 * ty + i) * kEpiStride + c] = add_rn(acc[i][j], b);
  }
  __syncthreads();
  static_assert(kF32BM == 64, "bm_log2 below");
  residual_epilogue_any(p, E, tab, scale, m0, n0, 6);
}

// ---- planning ----------------------------------------------------------------------------------------------------
bool is_supported_group(int G) { return G == 32 || G == 64 || G == 128; }

const char* check_params(const AquaReconstructParams& p) {
  if (!is_supported_group(p.group_size))
    return "the CUDA kernel takes group_size 32, 64 or 128 (a group must fit its 128-channel tile)";
  if (p.C % p.group_size != 0) return "C must be a multiple of group_size";
  if (p.C_in < 0 || p.C_in2 < 0) return "negative C_in";
  if (lattice_grid_of(lattice_d(p.grid_kind), lattice_n(p.grid_kind)) != static_cast<int>(p.grid_kind))
    return "bad grid kind";
  if ((p.C_in > 0 && (p.prev == nullptr || p.weight == nullptr)) || p.bias == nullptr || p.codes == nullptr ||
      p.norms == nullptr || p.grid == nullptr || p.out == nullptr)
    return "a required pointer is null";
  if ((p.prev2 == nullptr) != (p.weight2 == nullptr)) return "prev2 and weight2 come together";
  if (reinterpret_cast<uintptr_t>(p.out) % 8 != 0 || p.s_out % 2 != 0)
    return "out must be 8-byte aligned with an even row stride (float2 stores)";
  if (p.x_dtype != XDtype::kF32) {
    const int64_t c_in2 = p.prev2 != nullptr ? p.C_in2 : 0;
    if (!aqua_operand_aligned(p.prev, p.T, p.C_in, p.s_prev, 2) ||
        !aqua_operand_aligned(p.weight, p.C, p.C_in, p.s_w, 2) ||
        (c_in2 > 0 && (!aqua_operand_aligned(p.prev2, p.T, c_in2, p.s_prev2, 2) ||
                       !aqua_operand_aligned(p.weight2, p.C, c_in2, p.s_w2, 2))))
      return "fp16 / bf16 operands need 16-byte aligned rows (start and row stride a multiple of 8 elements)";
  }
  return nullptr;
}

using AquaKernel = void (*)(const AquaReconstructParams, float);

template <int WM>
AquaKernel mma_kernel(XDtype dt) {
  return dt == XDtype::kBF16 ? aqua_reconstruct_mma_kernel<true, WM> : aqua_reconstruct_mma_kernel<false, WM>;
}

}  // namespace

cudaError_t launch_aqua_reconstruct(const AquaReconstructParams& p, cudaStream_t stream) {
  clear_launch_error();
  if (p.T == 0 || p.C == 0) return cudaSuccess;
  if (const char* e = check_params(p)) {
    set_launch_error("aqua_reconstruct: %s (T=%lld C=%lld C_in=%lld G=%d)", e, (long long)p.T, (long long)p.C,
                     (long long)p.C_in, p.group_size);
    return cudaErrorInvalidValue;
  }
  const float inv_sqrt_g = static_cast<float>(1.0 / std::sqrt(static_cast<double>(p.group_size)));
  const int64_t col_tiles = ceil_div(p.C, kBN);
  const size_t side = (kMaxTableFloats + kMaxGroup) * sizeof(float);  // grid table + output scale
  AquaKernel fn;
  int bm, threads;
  size_t smem;
  if (p.x_dtype == XDtype::kF32) {
    fn = aqua_reconstruct_f32_kernel, bm = kF32BM, threads = kF32Threads, smem = f32_region_bytes() + side;
  } else {
    // 64-token tiles, or 32 where that leaves SMs idle (a 128-token chunk: 4 x C / 128 CTAs instead of 2 x)
    const bool small = ceil_div(p.T, 64) * col_tiles < std::max(p.num_sms, 1);
    fn = small ? mma_kernel<1>(p.x_dtype) : mma_kernel<2>(p.x_dtype);
    bm = small ? 32 : 64, threads = small ? 64 : 128;
    smem = (small ? mma_region_bytes(32) : mma_region_bytes(64)) + side;
  }
  const int64_t row_tiles = ceil_div(p.T, bm);
  if (row_tiles > 0x7fffffff || col_tiles > 65535) {
    set_launch_error("aqua_reconstruct: grid too large (T=%lld C=%lld)", (long long)p.T, (long long)p.C);
    return cudaErrorInvalidValue;
  }
  const dim3 grid(static_cast<unsigned>(row_tiles), static_cast<unsigned>(col_tiles));
  fn<<<grid, threads, smem, stream>>>(p, inv_sqrt_g);
  return cudaGetLastError();
}

}  // namespace kvk
