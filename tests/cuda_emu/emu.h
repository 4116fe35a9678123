// Host emulation of the CUDA execution model, so CPU CI runs the real csrc/cuda/*.cu kernels and launchers
// (tests/test_cuda_emulated.py). One std::thread per CUDA thread, std::barrier for __syncthreads, a per-warp
// barrier for shuffles; blocks run one after another. Built with AddressSanitizer + UBSan, it catches
// out-of-bounds global/shared accesses, misaligned vector loads, bad launch configurations (> 48 KiB dynamic
// smem, grid limits), shuffles with partial masks or after a lane exited; results are compared with a
// double-precision dequantize-then-matmul reference in driver.cpp. It checks logic, not speed: warp-synchronous
// timing, memory ordering beyond barriers, and real NaN bit patterns of the hardware are not modelled.
// prep.sh rewrites the two constructs host C++ cannot parse (<<<...>>> launches, extern __shared__ arrays).
#pragma once
#define KVK_EMU 1  // csrc/kvkernels/mma.cuh: host paths call the warp-collective emulations below
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <barrier>
#include <thread>
#include <vector>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <algorithm>
#include <functional>
#include <memory>
#include <atomic>

namespace kvk_emu {
struct Warp {
  std::unique_ptr<std::barrier<>> bar;
  float buf[32];
  uint32_t mma_a[32][4], mma_b[32][2];
  float mma_c[32][4];
  const char* ldsm[32];  // ldmatrix row addresses
  std::atomic<int> exited{0};
};
struct Block {
  std::unique_ptr<std::barrier<>> bar;
  std::vector<std::unique_ptr<Warp>> warps;
  void* smem;
};
inline thread_local uint3 t_thread, t_block;
inline thread_local dim3 t_bdim, t_gdim;
inline thread_local Block* t_blk;
inline std::atomic<long> traps{0};  // __trap() of a kernel (a device-side abort on a GPU)
inline void trap() { traps++; }
inline std::atomic<long> shuffles_after_exit{0}, bad_mask{0}, mmas{0}, ldsm_misaligned{0}, bad_async_copies{0}, prefetches{0};
inline size_t cur_smem = 0;
inline cudaError_t last_err = cudaSuccess;

inline void launch(dim3 grid, dim3 block, size_t smem, cudaStream_t, std::function<void()> fn) {
  const int nt = block.x * block.y * block.z;
  if (smem > 48 * 1024 || nt > 1024 || grid.y > 65535 || grid.z > 65535 || grid.x == 0 || grid.y == 0 || grid.z == 0) { printf("EMU: bad launch config grid %u %u %u block %d smem %zu\n", grid.x, grid.y, grid.z, nt, smem); last_err = cudaErrorInvalidConfiguration; return; }
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        Block B;
        B.bar = std::make_unique<std::barrier<>>(nt);
        int nw = (nt + 31) / 32;
        for (int w = 0; w < nw; ++w) {
          B.warps.push_back(std::make_unique<Warp>());
          int lanes = std::min(32, nt - 32 * w);
          B.warps.back()->bar = std::make_unique<std::barrier<>>(lanes);
        }
        B.smem = smem ? std::aligned_alloc(16, (smem + 15) / 16 * 16) : nullptr;
        if (smem) std::memset(B.smem, 0xff, (smem + 15) / 16 * 16);  // NaN garbage: unwritten reads show
        cur_smem = smem;
        std::vector<std::thread> th;
        th.reserve(nt);
        for (int t = 0; t < nt; ++t)
          th.emplace_back([&, t] {
            t_thread = make_uint3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
            t_block = make_uint3(bx, by, bz);
            t_bdim = block;
            t_gdim = grid;
            t_blk = &B;
            fn();
            B.bar->arrive_and_drop();
            Warp& w = *B.warps[t / 32];
            w.exited++;
            w.bar->arrive_and_drop();
          });
        for (auto& x : th) x.join();
        std::free(B.smem);
      }
}
template <class T>
T* dyn_smem() { return reinterpret_cast<T*>(t_blk->smem); }
inline void syncthreads() { t_blk->bar->arrive_and_wait(); }
inline void syncwarp() {  // __syncwarp(): the warp's lanes meet (memory ordering: every lane is a host thread)
  Warp& w = *t_blk->warps[t_thread.x / 32];
  if (w.exited.load()) shuffles_after_exit++;
  w.bar->arrive_and_wait();
}
inline float shfl_xor(unsigned mask, float v, int off) {
  if (mask != 0xffffffffu) bad_mask++;
  const int tid = t_thread.x;
  Warp& w = *t_blk->warps[tid / 32];
  if (w.exited.load()) shuffles_after_exit++;
  w.buf[tid % 32] = v;
  w.bar->arrive_and_wait();
  float r = w.buf[(tid % 32) ^ off];
  w.bar->arrive_and_wait();
  return r;
}
// ints ride the float lanes as bits (copies only, no arithmetic: every pattern survives)
inline int shfl_xor(unsigned mask, int v, int off) {
  float f;
  std::memcpy(&f, &v, sizeof f);
  f = shfl_xor(mask, f, off);
  int r;
  std::memcpy(&r, &f, sizeof r);
  return r;
}
// mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 and its bf16 twin (fragment layout in csrc/kvkernels/mma.cuh):
// every lane posts its fragments, then computes its four outputs from all 32 lanes' A and B. Products of fp16 (or
// bf16) values are exact in double and the 16-term sums nearly so; the result is rounded once to fp32 (the
// hardware's fp32 accumulation differs in the last bits, which the tests' tolerances cover).
inline float half_to_float_bits(uint16_t h) {
  __half_raw r; r.x = h; return __half2float(__half(r));
}
inline float bf16_to_float_bits(uint16_t h) {  // bf16 is the top half of an fp32
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f; std::memcpy(&f, &u, 4); return f;
}
// The m16n8k16 on 16-bit operands whose values to_float(bits) gives (fp16 or bf16): products exact in double.
template <float (*to_float)(uint16_t)>
inline void mma_m16n8k16_16bit(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], const float (&c)[4]);
inline void mma_m16n8k16_f16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], const float (&c)[4]) {
  mma_m16n8k16_16bit<half_to_float_bits>(d, a, b, c);
}
inline void mma_m16n8k16_bf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], const float (&c)[4]) {
  mma_m16n8k16_16bit<bf16_to_float_bits>(d, a, b, c);
}
template <float (*to_float)(uint16_t)>
inline void mma_m16n8k16_16bit(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], const float (&c)[4]) {
  const int tid = t_thread.x, lane = tid % 32;
  Warp& w = *t_blk->warps[tid / 32];
  if (w.exited.load()) shuffles_after_exit++;
  mmas++;
  for (int i = 0; i < 4; ++i) w.mma_a[lane][i] = a[i], w.mma_c[lane][i] = c[i];
  w.mma_b[lane][0] = b[0], w.mma_b[lane][1] = b[1];
  w.bar->arrive_and_wait();
  auto A = [&](int m, int k) {  // owner lane (m % 8) * 4 + (k % 8) / 2, register (m >= 8) + 2 (k >= 8), half k % 2
    const uint32_t r = w.mma_a[(m % 8) * 4 + (k % 8) / 2][(m >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)];
    return (double)to_float((uint16_t)(r >> (16 * (k % 2))));
  };
  auto B = [&](int k, int n) {
    const uint32_t r = w.mma_b[n * 4 + (k % 8) / 2][k >= 8 ? 1 : 0];
    return (double)to_float((uint16_t)(r >> (16 * (k % 2))));
  };
  const int g = lane / 4, t = lane % 4;
  float out[4];
  for (int i = 0; i < 4; ++i) {
    const int m = g + (i >= 2 ? 8 : 0), n = 2 * t + (i % 2);
    double s = w.mma_c[lane][i];
    for (int k = 0; k < 16; ++k) s += A(m, k) * B(k, n);
    out[i] = (float)s;
  }
  w.bar->arrive_and_wait();
  for (int i = 0; i < 4; ++i) d[i] = out[i];
}
// ldmatrix.sync.aligned.m8n8.x4.shared.b16: lane 8j + i gives the address of row i of matrix j (16-byte aligned,
// counted in ldsm_misaligned otherwise); r[j] of lane L is that matrix's row L / 4, 32-bit word L % 4.
inline void ldmatrix_x4(uint32_t (&r)[4], const char* addr) {
  const int tid = t_thread.x, lane = tid % 32;
  Warp& w = *t_blk->warps[tid / 32];
  if (w.exited.load()) shuffles_after_exit++;
  if (reinterpret_cast<uintptr_t>(addr) % 16) ldsm_misaligned++;
  w.ldsm[lane] = addr;
  w.bar->arrive_and_wait();
  uint32_t out[4];
  for (int j = 0; j < 4; ++j) std::memcpy(&out[j], w.ldsm[8 * j + lane / 4] + 4 * (lane % 4), 4);
  w.bar->arrive_and_wait();
  for (int j = 0; j < 4; ++j) r[j] = out[j];
}
// cp.async (csrc/kvkernels/async_copy.cuh): each copy is recorded, not done; commit closes the thread's group and
// cp_async_wait(n) performs the thread's oldest groups until n remain. So data arrives at the wait that covers it,
// never earlier: a read of a stage before its wait (or, for another lane's copy, before that lane's wait and a
// barrier) sees the stale bytes that were there. A copy the GPU would refuse is counted in bad_async_copies (the
// driver fails on any): cp-size other than 4, 8 or 16, src-size over cp-size (undefined in PTX), or a destination or
// (reading) source not aligned to cp-size (a misaligned-address fault on the GPU), none of which memcpy minds.
struct AsyncCopy { char* dst; const char* src; unsigned bytes, size; };
inline thread_local std::vector<AsyncCopy> t_async_open;
inline thread_local std::vector<std::vector<AsyncCopy>> t_async_groups;
inline void cp_async(char* dst, const void* src, unsigned bytes, unsigned size) {
  const bool size_ok = (size == 4 || size == 8 || size == 16) && bytes <= size;
  if (!size_ok || reinterpret_cast<uintptr_t>(dst) % size || (bytes && reinterpret_cast<uintptr_t>(src) % size))
    bad_async_copies++;
  t_async_open.push_back({dst, static_cast<const char*>(src), bytes, size});
}
inline void cp_async_commit() {
  t_async_groups.push_back(std::move(t_async_open));
  t_async_open.clear();
}
inline void cp_async_wait(int n) {
  while (static_cast<int>(t_async_groups.size()) > n) {
    for (const AsyncCopy& c : t_async_groups.front()) {
      if (c.bytes) std::memcpy(c.dst, c.src, c.bytes);
      std::memset(c.dst + c.bytes, 0, c.size - c.bytes);
    }
    t_async_groups.erase(t_async_groups.begin());
  }
}
// prefetch.global.L2 (async_copy.cuh): no data moves; reading one byte lets AddressSanitizer check that the address
// lies inside an allocation, as the kernels promise (a prefetch out of bounds is a bug even where it does not fault).
inline void prefetch_l2(const void* p) {
  volatile char c = *static_cast<const volatile char*>(p);
  (void)c;
  prefetches++;
}
inline unsigned atomic_max_u32(unsigned* p, unsigned v) {
  unsigned old = __atomic_load_n(p, __ATOMIC_RELAXED);
  while (old < v && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
  return old;
}
}  // namespace kvk_emu

#define threadIdx kvk_emu::t_thread
#define blockIdx kvk_emu::t_block
#define blockDim kvk_emu::t_bdim
#define gridDim kvk_emu::t_gdim
#define __syncthreads() kvk_emu::syncthreads()
#define __shfl_xor_sync(m, v, o) kvk_emu::shfl_xor(m, v, o)
#define __syncwarp(...) kvk_emu::syncwarp()
#define atomicMax(p, v) kvk_emu::atomic_max_u32(p, v)
#undef __launch_bounds__
#define __launch_bounds__(...)
template <class T> inline T __ldg(const T* p) { return *p; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
using std::min;
using std::max;
