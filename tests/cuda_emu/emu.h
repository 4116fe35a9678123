// Host emulation of the CUDA execution model, so CPU CI runs the real csrc/cuda/*.cu kernels and launchers
// (tests/test_cuda_emulated.py). One std::thread per CUDA thread, std::barrier for __syncthreads, a per-warp
// barrier for shuffles; blocks run one after another. Built with AddressSanitizer + UBSan, it catches
// out-of-bounds global/shared accesses, misaligned vector loads, bad launch configurations (> 48 KiB dynamic
// smem, grid limits), shuffles with partial masks or after a lane exited; results are compared with a
// double-precision dequantize-then-matmul reference in driver.cpp. It checks logic, not speed: warp-synchronous
// timing, memory ordering beyond barriers, and real NaN bit patterns of the hardware are not modelled.
// prep.sh rewrites the two constructs host C++ cannot parse (<<<...>>> launches, extern __shared__ arrays).
#pragma once
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
inline std::atomic<long> shuffles_after_exit{0}, bad_mask{0};
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
}  // namespace kvk_emu

#define threadIdx kvk_emu::t_thread
#define blockIdx kvk_emu::t_block
#define blockDim kvk_emu::t_bdim
#define gridDim kvk_emu::t_gdim
#define __syncthreads() kvk_emu::syncthreads()
#define __shfl_xor_sync(m, v, o) kvk_emu::shfl_xor(m, v, o)
#undef __launch_bounds__
#define __launch_bounds__(...)
template <class T> inline T __ldg(const T* p) { return *p; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
using std::min;
using std::max;
