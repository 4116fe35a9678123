// cp.async (sm_80+): global -> shared copies that complete in the background, grouped by commit and waited for by
// group count. Shared by the kernels that keep loads in flight with a shared-memory pipeline (aqua_reconstruct's
// GEMM tiles, the GEMVs' code ring: code_ring.cuh). The emulator (tests/cuda_emu/emu.h) defers every copy until a
// cp_async_wait that covers its group, so a read before the matching wait sees stale bytes there, as it could on a
// GPU, instead of the data arriving early.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace kvk {

// A shared-memory address as cp.async / ldmatrix take it: 32-bit on the device, a host pointer in the emulator.
#if defined(__CUDA_ARCH__)
using SmemAddr = uint32_t;
__device__ __forceinline__ SmemAddr smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
#else
using SmemAddr = char*;
inline SmemAddr smem_addr(const void* p) { return static_cast<char*>(const_cast<void*>(p)); }
#endif

// N bytes (16, 8 or 4) global -> shared, both addresses N-byte aligned. 16-byte pieces go through L2 only
// (cp.async.cg, which takes no other size): the code rows of the rings and aqua's GEMM tiles; 8- and 4-byte pieces
// (scales and zero points) through L1 (cp.async.ca).
template <int N>
__device__ __forceinline__ void cp_async(SmemAddr dst, const void* src) {
  static_assert(N == 16 || N == 8 || N == 4, "cp.async copies 4, 8 or 16 bytes");
#if defined(__CUDA_ARCH__)
  if constexpr (N == 16) asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
  else asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(dst), "l"(src), "n"(N));
#elif defined(KVK_EMU)
  kvk_emu::cp_async(dst, src, N, N);
#else
  (void)dst, (void)src;  // host pass of nvcc: never called
#endif
}

// The same, reading only the first `bytes` (0..N) of the source and zero-filling the rest (src-size): the last,
// partial tile of a row.
template <int N>
__device__ __forceinline__ void cp_async_zfill(SmemAddr dst, const void* src, uint32_t bytes) {
  static_assert(N == 16 || N == 8 || N == 4, "cp.async copies 4, 8 or 16 bytes");
#if defined(__CUDA_ARCH__)
  if constexpr (N == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
  else asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst), "l"(src), "n"(N), "r"(bytes));
#elif defined(KVK_EMU)
  kvk_emu::cp_async(dst, src, bytes, N);
#else
  (void)dst, (void)src, (void)bytes;
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#elif defined(KVK_EMU)
  kvk_emu::cp_async_commit();
#endif
}

// Waits until at most N of this thread's committed groups are still in flight. The copies of other lanes are
// visible only after they waited too and a barrier (__syncwarp / __syncthreads) ordered them.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#elif defined(KVK_EMU)
  kvk_emu::cp_async_wait(N);
#endif
}

// prefetch.global.L2: asks L2 for the 128-byte line holding `p` and returns at once, holding no register and no
// scoreboard slot, so a later load of the line waits for an L2 hit instead of a DRAM round trip. The kernels pass
// addresses inside their tensors only; the emulator reads one byte there, so AddressSanitizer checks that.
__device__ __forceinline__ void prefetch_l2(const void* p) {
#if defined(__CUDA_ARCH__)
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
#elif defined(KVK_EMU)
  kvk_emu::prefetch_l2(p);
#else
  (void)p;  // host pass of nvcc: never called
#endif
}

}  // namespace kvk
