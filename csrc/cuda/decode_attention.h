// Internal interface between decode_attention.cu (the general split-KV kernel, planning, the merge) and
// decode_attention_store.cu (the tensor-core kernel for the token range where both stores hold their tokens).
// Torch-free; only nvcc includes this header.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/kernels.h"
#include "kvkernels/gemv.cuh"
#include "kvkernels/kivi_mma.cuh"
#include "kvkernels/mma.cuh"

namespace kvk {

// The token counts a CTA attends over: the params' own, or (kDevLengths) the counts read from device memory, each
// clamped into its buffer (the params' counts are then capacities), a "cols" store's rounded down to whole groups,
// N = S + min(mk + lk, mv + lv): the reference's rule, so lengths that break the contract never read outside a
// buffer.
struct TokenCounts {
  int64_t S, mk, mv, N;
};

__device__ __forceinline__ int64_t clamp_count(const int64_t* len, int i, int64_t cap) {
  return min(max(__ldg(len + i), int64_t{0}), cap);
}

template <bool kDevLengths>
__device__ __forceinline__ TokenCounts token_counts(const DecodeAttentionParams& p) {
  if constexpr (!kDevLengths) {
    return {p.sink_k.n, p.keys.m, p.values.m, p.N};
  } else {
    const int64_t G = p.group_size;
    TokenCounts c;
    c.S = clamp_count(p.lengths, 0, p.sink_k.n);
    c.mk = clamp_count(p.lengths, 1, p.keys.m);
    const int64_t lk = clamp_count(p.lengths, 2, p.tail_k.n);
    c.mv = clamp_count(p.lengths, 3, p.values.m);
    const int64_t lv = clamp_count(p.lengths, 4, p.tail_v.n);
    if (p.keys.layout == StoreLayout::kCols) c.mk -= c.mk % G;
    if (p.values.layout == StoreLayout::kCols) c.mv -= c.mv % G;
    c.N = c.S + min(c.mk + lk, c.mv + lv);
    return c;
  }
}

// A split's partial for output row (b, h, t) in the workspace: [slot][B][H_q][T][D + 2] = (acc[D], m, l), the layout
// merge_splits_kernel reads; slot = the split's index among all splits of the call (the store tiles' come first).
__device__ __forceinline__ float* partial_row(const DecodeAttentionParams& p, int slot, int64_t b, int64_t h,
                                              int64_t t) {
  return p.workspace + ((static_cast<int64_t>(slot) * p.B + b) * p.H_q * p.T + h * p.T + t) * (p.D + 2);
}

// Store tiles: tokens [S, S + F) with F = min(mk, mv) rounded down to kStoreStep, where every token's key and value
// come from the quantized stores (InnerQ layouts: keys "rows", values "cols"; KIVI's: keys "cols", values "rows"). Both kernels compute F from the counts
// they read, so with device lengths the split between them moves with the cache and the launch stays fixed.
constexpr int64_t kStoreStep = 64;  // the store-tile kernel's largest step of tokens per warp
__host__ __device__ constexpr int64_t store_tile_tokens(int64_t mk, int64_t mv) {
  return (mk < mv ? mk : mv) / kStoreStep * kStoreStep;
}

struct StoreTilesLaunch {
  int64_t C;          // tokens per split (a multiple of kStoreStep); split s covers store tokens [s C, (s + 1) C) of [0, F)
  int num_splits;     // grid y; split s writes workspace slot s
  int row_blocks;     // CTAs per (b, h_kv) along the R = gq * T query rows, 4 * NT rows each
  int nt;             // n-tiles of 4 query rows: 1 or 2
  int gq;             // query heads per KV head
  int k_group_shift;  // log2(G / 32): key group of channel block cb = cb >> shift (G divides D)
  uint32_t v_bpg_magic;       // block_group's magic: value group of a 32-token block (gemv.cuh)
  DecodeConsts dec_k, dec_v;  // InnerQ tiles: the decoders' constants with the sym offset (decode_offset) folded in
  KiviConsts kivi_k, kivi_v;  // KIVI tiles: the dequantizing decoders' constants (kivi_mma.cuh)
  bool prefetch;              // L2 prefetch of each warp's first and next steps, keys and values (attention_prefetch)
};

// KVKERNELS_ATTENTION_PREFETCH=0 turns the attention kernels' L2 prefetches off (the store tiles': each warp's first
// step at entry, each next step in the loop; the general kernel's: the first tile's units before the staging), so a
// benchmark can time both in one process (bench/attention_step.py); read per plan, a getenv beside a launch. Same
// results.
inline bool attention_prefetch() { return !env_equals("KVKERNELS_ATTENTION_PREFETCH", "0"); }

// Split planning shared by both kernels: tokens per split for `tokens` tokens over `ctas` CTAs per split, a multiple
// of unit, at least min_split tokens unless one split takes them all: the split that runs the grid in the fewest
// modelled wave-rounds (wave_split_len, gemv.cuh; resident CTAs of `fn` x SMs), a CTA's fixed work counted as `fixed`
// units. KVKERNELS_GEMV_PLANNER=v1 restores the first GPU run's rule: one split unless the CTAs fill less than a
// wave, then ceil(wave / ctas) splits (which may spill into a second wave).
inline int64_t planned_split_tokens(const void* fn, int threads, int smem_bytes, int num_sms, int64_t ctas,
                                    int64_t tokens, int64_t unit, int64_t min_split, int64_t fixed) {
  const int occ = resident_ctas_per_sm(fn, threads, static_cast<size_t>(smem_bytes));
  const int64_t wave = static_cast<int64_t>(occ) * (num_sms > 1 ? num_sms : 1);
  const int64_t whole = round_up(tokens > 1 ? tokens : 1, unit);  // one split
  if (!gemv_planner_v1()) return wave_split_len(whole, unit, min_split, whole, ctas, wave, fixed);
  int64_t C = whole;
  if (ctas < wave && tokens >= 2 * min_split) {
    const int64_t per = ceil_div(tokens, ceil_div(wave, ctas));
    const int64_t want = round_up(per > min_split ? per : min_split, unit);
    C = want < C ? want : C;
  }
  return C;
}

// Splits of C tokens over `tokens` (at least one); a tiny explicit C on a long cache is doubled until the splits fit
// the grid's y dimension (rounding only: the math never depends on C).
inline int64_t split_count(int64_t tokens, int64_t& C) {
  const auto count = [&] { return tokens > C ? (tokens + C - 1) / C : int64_t{1}; };
  while (count() > 65535) C *= 2;
  return count();
}

// Whether the store-tile kernel is built for these params (layouts, bits and modes, head_dim, alignment).
bool store_tiles_supported(const DecodeAttentionParams& p);
// Plans the store-tile launch (grid, split length) for F_cap store tokens; false if the kernel is missing.
bool plan_store_tiles(const DecodeAttentionParams& p, int64_t F_cap, StoreTilesLaunch& L);
cudaError_t launch_store_tiles(const DecodeAttentionParams& p, const StoreTilesLaunch& L, cudaStream_t stream);

}  // namespace kvk
