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

// 16 bytes global -> shared (cp.async.cg: through L2 only; both addresses 16-byte aligned).
__device__ __forceinline__ void cp_async16(SmemAddr dst, const void* src) {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
#elif defined(KVK_EMU)
  kvk_emu::cp_async(dst, src, 16, 16);
#else
  (void)dst, (void)src;  // host pass of nvcc: never called
#endif
}

// The same, reading only the first `bytes` (0..16) and zero-filling the rest (src-size).
__device__ __forceinline__ void cp_async16_zfill(SmemAddr dst, const void* src, uint32_t bytes) {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
#elif defined(KVK_EMU)
  kvk_emu::cp_async(dst, src, bytes, 16);
#else
  (void)dst, (void)src, (void)bytes;
#endif
}

// 8 bytes global -> shared (cp.async.ca; both addresses 8-byte aligned): scales and zero points.
__device__ __forceinline__ void cp_async8(SmemAddr dst, const void* src) {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst), "l"(src));
#elif defined(KVK_EMU)
  kvk_emu::cp_async(dst, src, 8, 8);
#else
  (void)dst, (void)src;
#endif
}

// 4 bytes global -> shared (cp.async.ca; both addresses 4-byte aligned): a row's two scales of a 64-value item.
__device__ __forceinline__ void cp_async4(SmemAddr dst, const void* src) {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src));
#elif defined(KVK_EMU)
  kvk_emu::cp_async(dst, src, 4, 4);
#else
  (void)dst, (void)src;
#endif
}

// The same, reading only the first `bytes` (0..8) and zero-filling the rest.
__device__ __forceinline__ void cp_async8_zfill(SmemAddr dst, const void* src, uint32_t bytes) {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
#elif defined(KVK_EMU)
  kvk_emu::cp_async(dst, src, bytes, 8);
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

}  // namespace kvk
