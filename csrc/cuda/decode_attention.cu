// Fused decode attention over one layer's quantized KV cache (kvkernels/reference/attention.py is the spec):
//   out[b, h, t, :] = softmax_j(x[b, h, t, :] . K[b, h_kv, j, :] + mask[b, h, t, j]) V[b, h_kv, j, :]
// Keys and values are each sink | quantized store | tail in token order; the key store (mk tokens) and the value
// store (mv tokens) cover different token ranges, so a token tile may mix quantized keys with window values.
//
// Two kernels share the work when the store-tile kernel applies (decode_attention_store.cu: InnerQ layouts, the
// presets' bits and modes, at least kMinStoreTileTokens store tokens): it runs the tokens [S, S + F) where both stores
// hold the token on tensor cores and writes workspace slots [0, its splits); this file's general kernel then walks the
// rest ([0, S) and [S + F, N): sink, the stores' edges, tails) in splits of about a group each (its tiles are
// latency-bound one after another, see plan_attention), and merge_splits_kernel combines all of them. Otherwise the
// general kernel does everything, as described next.
//
// Split-KV, FlashDecoding style. Grid (B * H_kv * row blocks, splits). A CTA serves up to ROWS = 4, 8 or 16 query
// rows of one KV head (the R = (H_q / H_kv) * T rows of the head, query head major; ROWS is the smallest that holds
// R, more rows tile over row blocks of 16), so every key and value it dequantizes serves all of them, and GQA 4 at
// q_len 1 (Llama 3) computes 4 rows, not 16. Split 0 covers tokens [0, S + C) (the sink joins it), split
// k >= 1 covers [S + kC, S + (k + 1) C), C = split_tokens or planned (a multiple of G). Inside a split the CTA walks
// token tiles of 32: the sink in tiles of its own, then tiles aligned at S + 32i, so a "cols" store group (G tokens,
// G a multiple of 32) never straddles a tile, and a tile is either wholly inside a cols store or wholly outside it.
//
// Per tile: (1) stage: every thread dequantizes 32-value units of the key and the value tile into shared memory as
// fp32 (token-major [32][D + 4]): a "rows" unit is 32 channels of one token (sink, store or tail, chosen per token;
// the general path that also serves tiles mixing store and tail tokens), a "cols" unit is the 32 tokens of one
// channel (tiles wholly inside a cols store: one packed block, one scale / zero). A thread issues every global read
// of its units (keys and values) before it decodes any (load_unit, finish_unit), so a tile waits for one memory round
// trip. Store keys are multiplied by key_x_scale here. (2) scores: warp w owns rows w, w + 4, ... (ROWS / 4 of them) and lane j token j of the tile; fp32 dot
// products from shared memory (float4, conflict-free: the row pitch D + 4 puts 8 consecutive tokens' 16-byte chunks
// in distinct banks), the mask or the causal rule, then the online softmax of the row inside the warp (running max
// m, sum l; a row whose scores are all -inf so far keeps m = -inf and contributes p = 0, never -inf - -inf).
// (3) P.V: thread (channel c, rows) rescales its fp32 accumulators by exp(m_old - m_new) and adds sum_j p_j V[j, c].
// A single split writes out = acc / l; several write (acc, m, l) per (row, split) to the workspace and
// merge_splits_kernel combines them by log-sum-exp in split order (deterministic).
//
// Device lengths (p.lengths, static caches): the windows and stores are capacity buffers; the grid, the splits and the
// workspace are planned for the capacities (so a CUDA graph replays one launch as the cache grows), and every CTA
// reads the five counts from device memory (token_counts) and runs the same loop over them; splits that start past
// N write a neutral partial.
//
// Numerics: fp32 everywhere (scores, softmax, accumulation); dequantization s * u + zeff in fp32 (FMA), as
// dequantize_groups. Error vs the fp64 reference: ~1e-6 relative in the emulator (libm expf);
// on a GPU --use_fast_math makes expf __expf (not yet measured: the GPU tests allow 1e-4 of max|V|).
// Indexing: int64 for every global offset (row strides of the preallocated buffers may be large), int inside shared
// memory.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "cuda/decode_attention.h"
#include "kvkernels/async_copy.cuh"
#include "kvkernels/gemv.cuh"
#include "kvkernels/mma.cuh"

namespace kvk {
namespace {

constexpr int kThreads = 128;             // 4 warps
constexpr int kWarps = kThreads / 32;
constexpr int kTile = 32;                 // tokens per tile
constexpr int kMaxRows = 16;              // query rows per CTA: ROWS in {4, 8, 16}
constexpr int64_t kMinSplitTokens = 256;  // planned splits keep at least 8 tiles

__host__ __device__ constexpr int tile_pitch(int D) { return D + 4; }

// Shared memory (floats): key tile, value tile [kTile][D + 4]; queries [ROWS][D]; probabilities [ROWS][kTile];
// per-row rescale factor, running max and sum [ROWS] each; key_x_scale of the head [D] (read as float4).
__host__ __device__ constexpr int smem_floats(int D, int rows) {
  return 2 * kTile * tile_pitch(D) + rows * D + rows * kTile + 3 * rows + D;
}

// One side (keys or values) of the CTA's (b, h_kv): windows and store resolved to that head.
struct Side {
  const char* sink;  // element (j, c) at sink + (j * sink_st + c) * elem
  const char* tail;
  int64_t sink_st, tail_st;
  const uint32_t* codes;
  const uint16_t* scales;
  const uint16_t* zeros;  // nullptr: sym
  int64_t c_sr, s_sr, z_sr;
  int64_t m;
  int bits;
  QuantMode mode;
  bool cols;
  const float* xs;  // key_x_scale row of the head (its shared-memory copy), or nullptr
};

// base + off, or nullptr for an absent (empty) tensor: no arithmetic on a null pointer
template <typename T>
__device__ __forceinline__ const T* at_offset(const T* base, int64_t off) {
  return base != nullptr ? base + off : nullptr;
}

// m: the store's tokens used (st.m, or the count read from device lengths)
__device__ __forceinline__ Side resolve(const AttnWindow& sink, const AttnWindow& tail, const AttnStore& st, int64_t m,
                                        XDtype dt, int64_t b, int64_t hk, const float* xs) {
  const int64_t esz = dt == XDtype::kF32 ? 4 : 2;
  Side s;
  s.sink = at_offset(static_cast<const char*>(sink.p), (b * sink.sb + hk * sink.sh) * esz);
  s.tail = at_offset(static_cast<const char*>(tail.p), (b * tail.sb + hk * tail.sh) * esz);
  s.sink_st = sink.st;
  s.tail_st = tail.st;
  s.codes = at_offset(st.codes, b * st.c_sb + hk * st.c_sh);
  s.scales = at_offset(st.scales, b * st.s_sb + hk * st.s_sh);
  s.zeros = at_offset(st.zeros, b * st.z_sb + hk * st.z_sh);
  s.c_sr = st.c_sr;
  s.s_sr = st.s_sr;
  s.z_sr = st.z_sr;
  s.m = m;
  s.bits = st.bits;
  s.mode = st.mode;
  s.cols = st.layout == StoreLayout::kCols;
  s.xs = xs;
  return s;
}

// 32 codes of one packed block (its BITS words, already in registers), dequantized: v[i] = s * u_i + zeff. The codes
// are decoded two per LOP3 + HFMA2 into exact fp16 integers (mma.cuh: the canonical word of "thread" q holds values
// 8q .. 8q + 7, pair P = (8q + P, 8q + P + 4)) and widened to fp32, then the same FFMA as dequantize_groups:
// bit-identical to a shift-mask-convert per value, in about half the instructions.
template <int BITS>
__device__ __forceinline__ void dequant_words(const uint32_t (&w)[16], GroupAffine a, const DecodeConsts& kc,
                                              float (&v)[32]) {
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const uint32_t X = gather_inner_q<BITS>(w, q);
    const uint32_t Xh = BITS == 3 ? gather_inner_q_high_plane(w, q) : 0u;
    uint32_t h[4];
    decode_inner_q<BITS, 0>(X, Xh, kc, h);
#pragma unroll
    for (int P = 0; P < 4; ++P) {
      v[8 * q + P] = fmaf(a.s, half_bits_to_float(static_cast<uint16_t>(h[P])), a.zeff);
      v[8 * q + P + 4] = fmaf(a.s, half_bits_to_float(static_cast<uint16_t>(h[P] >> 16)), a.zeff);
    }
  }
}

__device__ __forceinline__ void dequant_words_rt(int bits, const uint32_t (&w)[16], GroupAffine a,
                                                 const DecodeConsts& kc, float (&v)[32]) {
  switch (bits) {
    case 1: dequant_words<1>(w, a, kc, v); break;
    case 2: dequant_words<2>(w, a, kc, v); break;
    case 3: dequant_words<3>(w, a, kc, v); break;
    default: dequant_words<4>(w, a, kc, v); break;
  }
}

// ---- staging: every global read of a thread's units first, their decode second ------------------------------------
// A unit is 32 values of a tile: a "rows" unit 32 channels of one token (sink, store or tail, chosen per token), a
// "cols" unit the 32 tokens of one channel (tiles wholly inside a cols store: one packed block, one scale / zero).
// load_unit issues the unit's reads into registers and uses none of them; finish_unit decodes them into the tile. The
// kernel loads all of a thread's units (keys and values) before it finishes any, so a tile waits for one memory
// round trip. Loading and decoding each unit in turn waited for about four at head_dim 128 (a store unit's scale was
// converted before its code words were requested, then the same for the value unit): the first GPU run measured
// ~6 us per tile of this kernel (bench/RESULTS.md), about four DRAM latencies.
enum class UnitKind : int { kZero, kWindow16, kWindow, kStore };

// Where unit w (0 .. D-1) of the tile [j0, j0 + n) of a side reads: a cols unit (channel w) when the tile lies in a
// cols store, else a rows unit (token j0 + w % 32, channels of block w / 32) of a window (sink or tail: src is its
// first element; 16-byte aligned 16-bit windows, the caches' own, are read as 4 x 16 bytes) or of a rows store.
// load_unit and finish_unit both derive it (a few integer operations), so that no pointer or kind is held in
// registers while the reads are in flight.
struct UnitSite {
  UnitKind kind;
  bool channel;
  const char* src;                  // window units
  const uint32_t* blk;              // store units: the packed block
  int64_t sidx, zidx;               // store units: the group's scale and zero
};

template <int D>
__device__ __forceinline__ UnitSite unit_site(const Side& sd, XDtype dt, int64_t S, uint32_t bpg_magic, int64_t j0,
                                              int n, int w) {
  UnitSite u{UnitKind::kZero, false, nullptr, nullptr, 0, 0};
  if (sd.cols && j0 >= S && j0 < S + sd.m) {
    const int64_t blk = (j0 - S) / 32;  // the store column j0 - S is a multiple of 32, inside one group of G
    const int64_t g = block_group(static_cast<uint32_t>(blk), bpg_magic);
    return UnitSite{UnitKind::kStore, true, nullptr, sd.codes + w * sd.c_sr + blk * sd.bits, w * sd.s_sr + g,
                    w * sd.z_sr + g};
  }
  const int jj = w % kTile, cb = w / kTile;
  const int64_t j = j0 + jj;
  if (jj >= n) return u;
  if (j < S || j >= S + sd.m) {  // window token: sink or tail
    const bool sink = j < S;
    const int64_t esz = dt == XDtype::kF32 ? 4 : 2;
    u.src = (sink ? sd.sink : sd.tail) + ((sink ? j * sd.sink_st : (j - S - sd.m) * sd.tail_st) + 32 * cb) * esz;
    u.kind = esz == 2 && reinterpret_cast<uintptr_t>(u.src) % 16 == 0 ? UnitKind::kWindow16 : UnitKind::kWindow;
    return u;
  }
  const int64_t r = j - S;  // rows store token: one packed block, one group
  const int64_t g = block_group(static_cast<uint32_t>(cb), bpg_magic);
  return UnitSite{UnitKind::kStore, false, nullptr, sd.codes + r * sd.c_sr + static_cast<int64_t>(cb) * sd.bits,
                  r * sd.s_sr + g, r * sd.z_sr + g};
}

// L2 prefetch of unit w of the tile at j0: a store unit's block, scale and zero, a window unit's 32 values (64 or 128
// bytes: its first and last byte, in one line or two). The kernel issues its first tile's before it stages the queries.
template <int D>
__device__ __forceinline__ void prefetch_unit(const Side& sd, XDtype dt, int64_t S, uint32_t bpg_magic, int64_t j0,
                                              int n, int w) {
  const UnitSite site = unit_site<D>(sd, dt, S, bpg_magic, j0, n, w);
  if (site.kind == UnitKind::kStore) {
    prefetch_l2(site.blk);
    prefetch_l2(sd.scales + site.sidx);
    if (sd.zeros != nullptr) prefetch_l2(sd.zeros + site.zidx);
  } else if (site.kind != UnitKind::kZero) {
    prefetch_l2(site.src);
    prefetch_l2(site.src + (dt == XDtype::kF32 ? 127 : 63));
  }
}

// A unit's reads in flight: kWindow16 the 32 16-bit values, two per word (element 2k low); kStore the block's bits
// words and the group's scale and zero bits. An fp32 or unaligned window unit (kWindow) reads at finish, element by
// element (a second round trip; not the caches' layout).
struct UnitLoad {
  uint32_t w[16];
  uint16_t sb, zb;
};

template <int D>
__device__ __forceinline__ UnitLoad load_unit(const Side& sd, XDtype dt, int64_t S, uint32_t bpg_magic, int64_t j0, int n,
                                              int w) {
  const UnitSite site = unit_site<D>(sd, dt, S, bpg_magic, j0, n, w);
  UnitLoad u;
  u.sb = u.zb = 0;
  if (site.kind == UnitKind::kStore) {
#pragma unroll
    for (int k = 0; k < 4; ++k) u.w[k] = k < sd.bits ? __ldg(site.blk + k) : 0u;  // predicated: issued together
    u.sb = __ldg(sd.scales + site.sidx);
    u.zb = sd.zeros != nullptr ? __ldg(sd.zeros + site.zidx) : uint16_t{0};
  } else if (site.kind == UnitKind::kWindow16) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint4 q = __ldg(reinterpret_cast<const uint4*>(site.src) + k);
      u.w[4 * k] = q.x, u.w[4 * k + 1] = q.y, u.w[4 * k + 2] = q.z, u.w[4 * k + 3] = q.w;
    }
  }
  return u;
}

// Decodes unit w of load_unit into the tile (token-major [32][D + 4] fp32): a cols unit's rows >= n get zeros; store
// rows units are multiplied by key_x_scale (sd.xs) when the side has one.
template <int D>
__device__ __forceinline__ void finish_unit(const UnitLoad& u, const Side& sd, const DecodeConsts& kc, XDtype dt,
                                            int64_t S, uint32_t bpg_magic, int64_t j0, int n, int w,
                                            float* __restrict__ tile) {
  const UnitSite site = unit_site<D>(sd, dt, S, bpg_magic, j0, n, w);
  float v[32];
  if (site.kind == UnitKind::kStore) {
    dequant_words_rt(sd.bits, u.w, group_affine_rt(sd.mode, sd.bits, u.sb, u.zb), kc, v);
  } else if (site.kind == UnitKind::kWindow16) {
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      if (dt == XDtype::kF16) {
        v[2 * k] = half_bits_to_float(static_cast<uint16_t>(u.w[k]));
        v[2 * k + 1] = half_bits_to_float(static_cast<uint16_t>(u.w[k] >> 16));
      } else {  // bf16: the high half of an fp32
        v[2 * k] = __uint_as_float(u.w[k] << 16);
        v[2 * k + 1] = __uint_as_float(u.w[k] & 0xffff0000u);
      }
    }
  } else if (site.kind == UnitKind::kWindow) {
#pragma unroll
    for (int i = 0; i < 32; ++i) v[i] = load_x(site.src, dt, i);
  } else {
#pragma unroll
    for (int i = 0; i < 32; ++i) v[i] = 0.f;
  }
  if (site.channel) {
    const float xs = sd.xs != nullptr ? sd.xs[w] : 1.f;
#pragma unroll
    for (int i = 0; i < 32; ++i) tile[i * tile_pitch(D) + w] = i < n ? v[i] * xs : 0.f;
    return;
  }
  const int c0 = 32 * (w / kTile);
  float* const row = tile + (w % kTile) * tile_pitch(D);
  if (site.kind == UnitKind::kStore && sd.xs != nullptr) {
#pragma unroll
    for (int i = 0; i < 32; i += 4) {
      const float4 x4 = *reinterpret_cast<const float4*>(sd.xs + c0 + i);
      v[i] *= x4.x, v[i + 1] *= x4.y, v[i + 2] *= x4.z, v[i + 3] *= x4.w;
    }
  }
#pragma unroll
  for (int i = 0; i < 32; i += 4) *reinterpret_cast<float4*>(row + c0 + i) = make_float4(v[i], v[i + 1], v[i + 2], v[i + 3]);
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

struct AttnLaunch {
  int64_t C;         // tokens per split past the sink
  int num_splits;    // grid y
  int split_base;    // workspace slot of split 0 (the store-tile kernel's splits come first)
  bool direct;       // one split in all: write out, no workspace
  bool skip_store;   // the store-tile kernel covers [S, S + F): walk [0, S) and [S + F, N)
  int row_blocks;    // CTAs per (b, h_kv) along the R = gq * T query rows
  int gq;            // query heads per KV head
  uint32_t bpg_magic;              // block_group's magic for G / 32 blocks per group (gemv.cuh)
  DecodeConsts dec_k, dec_v;       // the code decoders' constants for the key and the value bits (constant bank)
  bool prefetch;                   // L2 prefetch of the first tile's units before the staging (attention_prefetch)
};

// min blocks 3 (<= 170 registers: 3 CTAs / SM, 132 KB of shared memory): with the thread count alone ptxas capped
// D = 64 at 128 registers and spilled; with min blocks 1 it took 185 at D = 128 (2 CTAs / SM). 16 query rows (4 a
// warp, 16 accumulators a thread at D = 128; no preset's GQA x q_len needs more than 8) take min blocks 2: with a
// thread's units' reads in flight together (load_unit) they spilled 24-32 bytes at 168.
template <int ROWS>
constexpr int attn_min_blocks() { return ROWS > 8 ? 2 : 3; }

template <int D, int ROWS, bool kDevLengths>
__global__ void __launch_bounds__(kThreads, attn_min_blocks<ROWS>())
    decode_attention_kernel(const DecodeAttentionParams p, const AttnLaunch L) {
  static_assert(ROWS % kWarps == 0 && ROWS <= kMaxRows, "ROWS: 4, 8 or 16");
  constexpr int kRows = ROWS, kRowsPerWarp = ROWS / kWarps;
  extern __shared__ __align__(16) float smem[];
  constexpr int P = tile_pitch(D);
  float* const ks = smem;                  // [kTile][P]
  float* const vs = ks + kTile * P;        // [kTile][P]
  float* const xq = vs + kTile * P;        // [kRows][D]
  float* const ps = xq + kRows * D;        // [kRows][kTile]
  float* const alpha_s = ps + kRows * kTile;
  float* const m_s = alpha_s + kRows;
  float* const l_s = m_s + kRows;
  float* const xs_s = l_s + kRows;         // [D] key_x_scale of the head (16-byte aligned: every part above is)

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int rb = static_cast<int>(blockIdx.x % static_cast<unsigned>(L.row_blocks));
  const int64_t bh = blockIdx.x / static_cast<unsigned>(L.row_blocks);
  const int64_t b = bh / p.H_kv, hk = bh % p.H_kv;
  const int split = blockIdx.y;
  const TokenCounts cnt = token_counts<kDevLengths>(p);
  const int64_t T = p.T, N = cnt.N, S = cnt.S;
  const int R = L.gq * static_cast<int>(T);
  const int r0 = rb * kRows, nr = min(kRows, R - r0);

  const Side sk = resolve(p.sink_k, p.tail_k, p.keys, cnt.mk, p.window_dtype, b, hk,
                          p.key_x_scale != nullptr ? xs_s : nullptr);  // xs_s is staged below, read after a barrier
  const Side sv = resolve(p.sink_v, p.tail_v, p.values, cnt.mv, p.window_dtype, b, hk, nullptr);

  // tokens the store-tile kernel covers, [S, S + F): this kernel walks the others in a virtual order where token
  // v >= S is token v + F (tiles past the sink stay aligned at S + 32i: F is a multiple of 64)
  const int64_t F = L.skip_store ? store_tile_tokens(cnt.mk, cnt.mv) : 0;
  // token range of the split (with device lengths the grid is planned for the capacities: a split past N is empty and
  // writes the neutral partial m = -inf, l = 0, which the merge skips); the last split runs to the end, so that no
  // token depends on the planner's bound on the rest (plan_attention, device lengths with store tiles)
  const int64_t lo = split == 0 ? 0 : S + split * L.C;
  const int64_t hi = split == L.num_splits - 1 ? N - F : min(N - F, S + (split + 1) * L.C);

  // the thread's staging units, unit tid + i * kThreads of the tile's 2D (keys 0 .. D-1, values D .. 2D-1); at D =
  // kThreads its first is a key unit and its second a value unit at compile time
  constexpr int kUnits = 2 * D / kThreads;
  static_assert(2 * D % kThreads == 0, "head_dim: a whole number of staging units per thread");
  const auto unit_is_key = [](int i, int t) { return D == kThreads ? i == 0 : t + i * kThreads < D; };
  const auto unit_col = [](int i, int t) { return (t + i * kThreads) % D; };

  // L2 prefetch of the first tile's units before the queries and key_x_scale are staged: its reads, issued after the
  // staging's barrier, then wait for L2 rather than DRAM. (A split is often one tile: the rest next to the store tiles
  // runs in splits of about a group.) Prefetching keeps the tile loop as it was; issuing the loads themselves here
  // made every tile derive its units' sites twice (no longer next to each other for ptxas to share): +0.8-6.1
  // instructions per byte on the sass_budget rows of this kernel.
  if (L.prefetch && lo < hi) {
    const int n = static_cast<int>((lo < S ? min(S, lo + kTile) : min(hi, lo + kTile)) - lo);
    const int64_t j0 = lo < S ? lo : lo + F;
#pragma unroll
    for (int i = 0; i < kUnits; ++i)
      prefetch_unit<D>(unit_is_key(i, tid) ? sk : sv, p.window_dtype, S, L.bpg_magic, j0, n, unit_col(i, tid));
  }

  // the head's key_x_scale, staged once (a token unit reads 32 of it as 8 float4 per tile)
  if (p.key_x_scale != nullptr)
    for (int c = tid; c < D; c += kThreads) xs_s[c] = __ldg(p.key_x_scale + hk * p.xs_sh + c);

  // queries of the CTA's rows (zeros past nr)
  for (int i = tid; i < kRows * D; i += kThreads) {
    const int r = i / D, c = i % D;
    float v = 0.f;
    if (r < nr) {
      const int q = r0 + r;
      const int64_t h = hk * L.gq + q / T, t = q % T;
      v = load_x(p.x, p.x_dtype, b * p.x_sb + h * p.x_sh + t * p.x_st + c) * p.q_scale;
    }
    xq[i] = v;
  }

  // the warp's score rows: mask row pointers (or causal limits), running max and sum
  const float* mrow[kRowsPerWarp];
  int64_t limit[kRowsPerWarp];
  float m_run[kRowsPerWarp], l_run[kRowsPerWarp];
#pragma unroll
  for (int k = 0; k < kRowsPerWarp; ++k) {
    const int r = warp + kWarps * k, q = r0 + min(r, nr - 1);
    const int64_t h = hk * L.gq + q / T, t = q % T;
    mrow[k] = p.mask != nullptr ? p.mask + b * p.m_sb + h * p.m_sh + t * p.m_st : nullptr;
    limit[k] = N - T + t;
    m_run[k] = -INFINITY;
    l_run[k] = 0.f;
  }

  // the thread's output slots: channel c, rows rsub + kTpc * k
  constexpr int kTpc = kThreads / D;  // threads per channel (1 or 2)
  constexpr int kOut = kRows / kTpc;  // rows per thread
  const int c_own = tid % D, rsub = tid / D;
  float acc[kOut];
#pragma unroll
  for (int k = 0; k < kOut; ++k) acc[k] = 0.f;
  __syncthreads();  // xs_s is read by other threads' staging

  for (int64_t v0 = lo; v0 < hi;) {
    const int64_t v1 = v0 < S ? min(S, v0 + kTile) : min(hi, v0 + kTile);
    const int n = static_cast<int>(v1 - v0);
    const int64_t j0 = v0 < S ? v0 : v0 + F;  // the tile's first token
    // (1) stage keys (units 0 .. D-1) and values (units D .. 2D-1), warp-uniform side: every read of the thread's
    // units issued before any is decoded (load_unit / finish_unit)
    UnitLoad ld[kUnits];
#pragma unroll
    for (int i = 0; i < kUnits; ++i) {
      if (unit_is_key(i, tid))
        ld[i] = load_unit<D>(sk, p.window_dtype, S, L.bpg_magic, j0, n, unit_col(i, tid));
      else
        ld[i] = load_unit<D>(sv, p.window_dtype, S, L.bpg_magic, j0, n, unit_col(i, tid));
    }
#pragma unroll
    for (int i = 0; i < kUnits; ++i) {
      if (unit_is_key(i, tid))
        finish_unit<D>(ld[i], sk, L.dec_k, p.window_dtype, S, L.bpg_magic, j0, n, unit_col(i, tid), ks);
      else
        finish_unit<D>(ld[i], sv, L.dec_v, p.window_dtype, S, L.bpg_magic, j0, n, unit_col(i, tid), vs);
    }
    __syncthreads();
    // (2) scores and the online softmax of the warp's rows
    {
      float s[kRowsPerWarp];
#pragma unroll
      for (int k = 0; k < kRowsPerWarp; ++k) s[k] = 0.f;
      const float* kr = ks + lane * P;
#pragma unroll 4
      for (int c = 0; c < D; c += 4) {
        const float4 kv = *reinterpret_cast<const float4*>(kr + c);
#pragma unroll
        for (int k = 0; k < kRowsPerWarp; ++k) {
          const float4 xv = *reinterpret_cast<const float4*>(xq + (warp + kWarps * k) * D + c);
          s[k] = fmaf(xv.x, kv.x, s[k]);
          s[k] = fmaf(xv.y, kv.y, s[k]);
          s[k] = fmaf(xv.z, kv.z, s[k]);
          s[k] = fmaf(xv.w, kv.w, s[k]);
        }
      }
      const int64_t j = j0 + lane;
#pragma unroll
      for (int k = 0; k < kRowsPerWarp; ++k) {
        const int r = warp + kWarps * k;
        float sc = -INFINITY;
        if (lane < n && r < nr) {
          if (mrow[k] != nullptr)
            sc = s[k] + __ldg(mrow[k] + j);
          else if (j <= limit[k])
            sc = s[k];
        }
        // nan_max: a NaN score (a NaN scale or query) must reach the output, also before any finite score
        const float m_new = nan_max(m_run[k], warp_max(sc));
        float alpha = 1.f, pj = 0.f;
        if (m_new != -INFINITY) {  // else nothing seen yet: keep m = -inf, l = 0, acc = 0
          alpha = expf(m_run[k] - m_new);
          pj = expf(sc - m_new);
        }
        l_run[k] = fmaf(l_run[k], alpha, warp_sum(pj));
        m_run[k] = m_new;
        ps[r * kTile + lane] = pj;
        if (lane == 0) alpha_s[r] = alpha;
      }
    }
    __syncthreads();
    // (3) acc = acc * alpha + P V
    {
      float v[kTile];
#pragma unroll
      for (int jj = 0; jj < kTile; ++jj) v[jj] = vs[jj * P + c_own];
#pragma unroll
      for (int k = 0; k < kOut; ++k) {
        const int r = rsub + kTpc * k;
        float a = acc[k] * alpha_s[r];
#pragma unroll
        for (int jj = 0; jj < kTile; jj += 4) {
          const float4 pp = *reinterpret_cast<const float4*>(ps + r * kTile + jj);
          a = fmaf(pp.x, v[jj], a);
          a = fmaf(pp.y, v[jj + 1], a);
          a = fmaf(pp.z, v[jj + 2], a);
          a = fmaf(pp.w, v[jj + 3], a);
        }
        acc[k] = a;
      }
    }
    __syncthreads();
    v0 = v1;
  }

  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < kRowsPerWarp; ++k) {
      m_s[warp + kWarps * k] = m_run[k];
      l_s[warp + kWarps * k] = l_run[k];
    }
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < kOut; ++k) {
    const int r = rsub + kTpc * k;
    if (r >= nr) continue;
    const int q = r0 + r;
    const int64_t h = hk * L.gq + q / T, t = q % T;
    if (L.direct) {
      store_act(p.out, p.out_dtype, b * p.o_sb + h * p.o_sh + t * p.o_st + c_own, acc[k] / l_s[r]);
    } else {
      float* w = partial_row(p, L.split_base + split, b, h, t);
      w[c_own] = acc[k];
      if (c_own == 0) {
        w[D] = m_s[r];
        w[D + 1] = l_s[r];
      }
    }
  }
}

// Log-sum-exp merge of the splits' partials, in split order: one CTA per output row (b, h, t), one thread per
// channel. A split whose row saw only -inf scores (m = -inf, l = 0) weighs 0.
// The second pass reads kMergeBatch splits' (m, acc, l) into registers before it uses any: with `if (m == -inf)
// continue` in one loop, ptxas issued each split's loads after the previous split's test of its m (sm_90 SASS: LDG m,
// FSETP, @P LDG acc / l, LDG next m, ...), one dependent L2 round trip per split, ~40 in a row at 8k tokens x batch 1
// (the store tiles' and the rest's splits). The same operations in the same order for the live splits (a dead split
// is skipped, as before): the results are bit-identical.
constexpr int kMergeBatch = 8;
__global__ void merge_splits_kernel(const float* __restrict__ ws, int splits, int64_t rows, int D, int H_q, int T,
                                    void* __restrict__ out, XDtype out_dtype, int64_t o_sb, int64_t o_sh,
                                    int64_t o_st) {
  const int64_t q = blockIdx.x;  // (b * H_q + h) * T + t
  const int c = threadIdx.x;
  const int64_t t = q % T, h = (q / T) % H_q, b = q / (static_cast<int64_t>(T) * H_q);
  const int64_t stride = rows * (D + 2);
  const float* w = ws + q * (D + 2);
  float mx = -INFINITY;
  for (int s = 0; s < splits; ++s) mx = nan_max(mx, w[s * stride + D]);
  float num = 0.f, den = 0.f;
  for (int s0 = 0; s0 < splits; s0 += kMergeBatch) {
    float ms[kMergeBatch], acc[kMergeBatch], l[kMergeBatch];
#pragma unroll
    for (int u = 0; u < kMergeBatch; ++u) {  // past the last split: the last one again (read, never used)
      const float* part = w + min(s0 + u, splits - 1) * stride;
      ms[u] = part[D], acc[u] = part[c], l[u] = part[D + 1];
    }
#pragma unroll
    for (int u = 0; u < kMergeBatch; ++u) {
      if (s0 + u >= splits || ms[u] == -INFINITY) continue;
      const float e = expf(ms[u] - mx);
      num = fmaf(e, acc[u], num);
      den = fmaf(e, l[u], den);
    }
  }
  store_act(out, out_dtype, b * o_sb + h * o_sh + t * o_st + c, num / den);
}

using AttnKernel = void (*)(const DecodeAttentionParams, const AttnLaunch);

template <int D, int ROWS>
AttnKernel attention_kernel_of(bool dev) {
  if (dev) return &decode_attention_kernel<D, ROWS, true>;
  return &decode_attention_kernel<D, ROWS, false>;
}

template <int D>
AttnKernel attention_kernel(int rows, bool dev) {
  switch (rows) {
    case 4: return attention_kernel_of<D, 4>(dev);
    case 8: return attention_kernel_of<D, 8>(dev);
    default: return attention_kernel_of<D, kMaxRows>(dev);
  }
}

struct AttnPlan {
  AttnKernel fn = nullptr;
  AttnLaunch launch{};
  int smem_bytes = 0;
  bool store_tiles = false;     // the store-tile kernel runs first (decode_attention_store.cu)
  StoreTilesLaunch store{};
  int total_splits = 0;         // partials the merge combines (1: the general kernel writes out directly)
  int64_t workspace_floats = 0;
  const char* error = nullptr;
};

// Below this many store tokens (at capacity, with device lengths) the general kernel walks the store too: the
// store-tile kernel's extra launch and merge would cost more than its faster tiles save (a guess, not yet measured).
constexpr int64_t kMinStoreTileTokens = 256;

// KVKERNELS_ATTENTION_STORE_TILES=0 sends every token through the general kernel, so a benchmark can time both in one
// process (bench/attention_step.py); read per call, a getenv beside a launch. Never changes the math beyond rounding.
bool store_tiles_enabled() { return !env_equals("KVKERNELS_ATTENTION_STORE_TILES", "0"); }
// KVKERNELS_ATTENTION_REST_SPLITS=1: next to the store tiles, the general kernel walks the rest in one split, as the
// first GPU run measured it (plan_attention); for the A/B in bench/attention_step.py, read per call as above.
bool rest_in_one_split() { return env_equals("KVKERNELS_ATTENTION_REST_SPLITS", "1"); }

// Validates the params (sets the launch error) and plans the launch; a pure function of the params and the
// device's occupancy, shared with the binding's workspace sizing.
AttnPlan plan_attention(const DecodeAttentionParams& p) {
  AttnPlan pl{};
  const bool dev = p.lengths != nullptr;
  const int64_t gq = p.H_kv > 0 ? p.H_q / p.H_kv : 0, R = gq * p.T;
  const int block_rows = R <= 4 ? 4 : R <= 8 ? 8 : kMaxRows;  // the smallest row block that holds the head's rows
  switch (p.D) {
    case 64: pl.fn = attention_kernel<64>(block_rows, dev); break;
    case 128: pl.fn = attention_kernel<128>(block_rows, dev); break;
    default: pl.error = "unsupported head_dim (supported: 64, 128)"; return pl;
  }
  pl.smem_bytes = smem_floats(p.D, block_rows) * static_cast<int>(sizeof(float));
  const int G = p.group_size;
  const int64_t S = p.sink_k.n;
  // device lengths: the counts are capacities and T > N is the caller's (unspecified, never out of bounds)
  if (p.B < 1 || p.H_kv < 1 || p.H_q % p.H_kv != 0 || p.T < 1 || (!dev && p.T > p.N) || G <= 0 || G % 32 != 0) {
    pl.error = "inconsistent sizes";
    return pl;
  }
  const bool adds_up = dev ? p.N == S + std::min(p.keys.m + p.tail_k.n, p.values.m + p.tail_v.n)
                           : S + p.keys.m + p.tail_k.n == p.N && S + p.values.m + p.tail_v.n == p.N;
  if (p.sink_v.n != S || !adds_up) {
    pl.error = dev ? "N must be the most tokens the capacity buffers hold (device lengths)"
                   : "sink / store / tail token counts do not add up to N for keys and values";
    return pl;
  }
  for (const AttnStore* st : {&p.keys, &p.values}) {
    if (!is_supported_bits(st->bits)) { pl.error = "unsupported bits (supported: 1, 2, 3, 4)"; return pl; }
    if (st->mode != QuantMode::kSym && st->mode != QuantMode::kAsym && st->mode != QuantMode::kHybrid) {
      pl.error = "unsupported quant mode";
      return pl;
    }
    if (st->mode != QuantMode::kSym && st->zeros == nullptr && st->m > 0) {
      pl.error = "asym and hybrid stores need zeros";
      return pl;
    }
    if (st->layout == StoreLayout::kRows ? p.D % G != 0 : st->m % G != 0) {
      pl.error = "group_size must divide head_dim (rows layout) or the store's tokens (cols layout)";
      return pl;
    }
  }
  if (p.split_tokens < 0 || p.split_tokens % G != 0) {
    pl.error = "split_tokens must be 0 or a positive multiple of group_size";
    return pl;
  }
  if (R > 0x7fffffff / kMaxRows || p.T > 0x7fffffff) {
    pl.error = "too many query rows per KV head";
    return pl;
  }
  pl.launch.gq = static_cast<int>(gq);
  const int64_t bpg = G / 32;
  pl.launch.bpg_magic = block_group_magic(bpg);
  for (const AttnStore* st : {&p.keys, &p.values}) {  // block_group is exact for block indices < 2^32 / bpg
    if (st->layout == StoreLayout::kCols && (st->m / 32 + 1) * bpg > (int64_t{1} << 32)) {
      pl.error = "store too long for its group_size (block index past the exact range of the group lookup)";
      return pl;
    }
  }
  pl.launch.prefetch = attention_prefetch();
  pl.launch.dec_k = decode_consts(p.keys.bits, 0);
  pl.launch.dec_v = decode_consts(p.values.bits, 0);
  pl.launch.row_blocks = static_cast<int>(ceil_div(R, block_rows));
  const int64_t ctas = p.B * p.H_kv * pl.launch.row_blocks;
  const int64_t tokens = p.N - S;  // past the sink (device lengths: the most there can be)
  const int64_t F_cap = store_tile_tokens(p.keys.m, p.values.m);
  int64_t C = p.split_tokens;
  int64_t walked = tokens;  // tokens past the sink this kernel walks (device lengths: the most there can be)
  int64_t min_split = kMinSplitTokens;
  if (F_cap >= kMinStoreTileTokens && store_tiles_enabled() && store_tiles_supported(p) &&
      plan_store_tiles(p, F_cap, pl.store)) {
    // The store tiles go to the tensor-core kernel; this kernel walks the sink and the rest: the stores' edges past F
    // and the tails, ~100-250 tokens at the presets' windows. It walks them tile by tile, each tile's loads issued
    // after the last tile's math, so one split over them is a chain of ~4-8 tiles' latencies: the first GPU run
    // measured ~57 us for the fused step at 8k tokens, batch 1, with or without the store tiles (SDPA on fp16: 16 us).
    // Splits of one group (planned to fill a wave, as the general case) run those tiles side by side.
    // Device lengths: F, and so the rest, move with the counts; the splits are planned for the most the rest can
    // hold. With F = min(mk, mv) rounded down to 64 and N = S + min(mk + lk, mv + lv), the rest N - S - F is at most
    // 63 tokens of the shorter store plus its tail: under 64 + the larger tail capacity. (The kernel's last split runs
    // to the end all the same.)
    pl.store_tiles = true;
    pl.launch.skip_store = true;
    pl.launch.split_base = pl.store.num_splits;
    walked = dev ? std::min(tokens, std::max(p.tail_k.n, p.tail_v.n) + kStoreStep - 1) : tokens - F_cap;
    min_split = G;
    if (rest_in_one_split()) {
      if (dev) C = round_up(std::max<int64_t>(tokens, 1), G);
      min_split = kMinSplitTokens;
    }
  }
  if (C == 0)
    C = planned_split_tokens(reinterpret_cast<const void*>(pl.fn), kThreads, pl.smem_bytes, p.num_sms, ctas, walked, G,
                             min_split, 1);  // a CTA's fixed work (queries, key_x_scale, partials): ~ a tile
  const int64_t splits = split_count(walked, C);
  pl.launch.C = C;
  pl.launch.num_splits = static_cast<int>(splits);
  pl.total_splits = static_cast<int>(splits) + (pl.store_tiles ? pl.store.num_splits : 0);
  pl.launch.direct = pl.total_splits == 1;
  if (ctas > 0x7fffffff || (pl.store_tiles && p.B * p.H_kv * pl.store.row_blocks > 0x7fffffff)) {
    pl.error = "grid too large";
    return pl;
  }
  const int64_t rows = p.B * p.H_q * p.T;
  pl.workspace_floats = pl.total_splits > 1 ? pl.total_splits * rows * (p.D + 2) : 0;
  if (pl.total_splits > 1 && rows > 0x7fffffff) pl.error = "too many output rows for the merge grid";
  return pl;
}

}  // namespace

int64_t decode_attention_workspace_floats(const DecodeAttentionParams& p) {
  const AttnPlan pl = plan_attention(p);
  return pl.error != nullptr ? 0 : pl.workspace_floats;
}

int64_t decode_attention_num_splits(const DecodeAttentionParams& p) {
  const AttnPlan pl = plan_attention(p);
  return pl.error != nullptr ? 0 : pl.total_splits;
}

cudaError_t launch_decode_attention_fused(const DecodeAttentionParams& p, cudaStream_t stream) {
  clear_launch_error();
  if (p.B * p.H_q * p.T == 0) return cudaSuccess;
  const AttnPlan pl = plan_attention(p);
  if (pl.error != nullptr) {
    set_launch_error("decode_attention_fused: %s (B=%lld H_q=%lld H_kv=%lld T=%lld N=%lld D=%d G=%d "
                     "split_tokens=%lld)", pl.error, (long long)p.B, (long long)p.H_q, (long long)p.H_kv,
                     (long long)p.T, (long long)p.N, p.D, p.group_size, (long long)p.split_tokens);
    return cudaErrorInvalidValue;
  }
  if (pl.workspace_floats > 0 && (p.workspace == nullptr || p.workspace_floats < pl.workspace_floats)) {
    set_launch_error("decode_attention_fused: workspace of %lld floats given, %lld needed",
                     (long long)p.workspace_floats, (long long)pl.workspace_floats);
    return cudaErrorInvalidValue;
  }
  cudaError_t err = cudaSuccess;
  if (pl.store_tiles) {
    err = launch_store_tiles(p, pl.store, stream);
    if (err != cudaSuccess) return err;
  }
  const dim3 grid(static_cast<unsigned>(p.B * p.H_kv * pl.launch.row_blocks),
                  static_cast<unsigned>(pl.launch.num_splits));
  const AttnKernel fn = pl.fn;
  const AttnLaunch L = pl.launch;
  fn<<<grid, kThreads, pl.smem_bytes, stream>>>(p, L);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  if (pl.total_splits > 1) {
    const int64_t rows = p.B * p.H_q * p.T;
    merge_splits_kernel<<<static_cast<unsigned>(rows), p.D, 0, stream>>>(
        p.workspace, pl.total_splits, rows, p.D, static_cast<int>(p.H_q), static_cast<int>(p.T), p.out,
        p.out_dtype, p.o_sb, p.o_sh, p.o_st);
    err = cudaGetLastError();
  }
  return err;
}

}  // namespace kvk
