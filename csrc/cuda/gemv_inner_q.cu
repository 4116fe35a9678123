// InnerQ fused dequant-GEMV (groups along the reduction dim L):
//   y[b, h, t, m] = sum_l xs[b, h, t, l] * (s_g * u[b, h_kv, m, l] + zeff_g),   xs = x * x_scale[h_kv, :]
//                 = sum_g ( s_g * dot(xs_g, u_g) + zeff_g * xsum_g ),           xsum_g = sum_{l in g} xs_l
//
// Block = (row tile of M, split of L, (b, h_kv)). It stages xs for a tile of up to 8 query rows (all query
// heads of the KV head times the launch's T rows) in shared memory as fp32, together with xsum per
// (query row, group), computed once and shared by every row m. Each row is read once and serves all the tile's
// query rows: codes are never expanded per query head. More than 8 query rows (GQA ratio x q_len) loop over 8-row
// tiles inside the block, which re-reads its rows once per tile, right after the previous pass (a few KiB per
// block, so from L1/L2 rather than DRAM; not yet measured on a GPU). Rows are split over `tpr` lanes (a power of
// two <= 32, so a row never straddles warps); each lane decodes whole 16-byte chunks of codes in registers (a
// row's last L % chunk values, whole 32-value blocks, with 32-bit loads), keeps one running dot per query row and
// folds it in with one FMA by s_g per group (plus zeff_g * xsum_g once per group, by the lane holding the group's
// first block). Lanes of a row are combined with a butterfly shuffle.
//
// Batch-1 occupancy: keys (M = tokens, L = head_dim) get many row tiles; values (M = head_dim, L = tokens) get
// L split across blocks (split-K) into a workspace, then combine_splits sums the splits in a fixed order, so the
// result is deterministic. The plan (plan_inner_q) is a pure function of the params, so the binding sizes the
// workspace with the same rule the launcher uses.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdarg>
#include <cstdio>

#include "kvkernels/gemv.cuh"

namespace kvk {

// ---- launcher error message ------------------------------------------------------------------------------------
namespace {
thread_local char g_launch_error[512];
}

const char* last_launch_error() { return g_launch_error; }

void clear_launch_error() { g_launch_error[0] = '\0'; }

void set_launch_error(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g_launch_error, sizeof(g_launch_error), fmt, ap);
  va_end(ap);
}

namespace {

// ---- tiling constants (why each value: see the comment next to it) ----------------------------------------------
constexpr int kThreads = 256;               // 8 warps: enough rows in flight per block, fits 2+ blocks per SM
constexpr int kSmemBudget = 40 * 1024;      // x tile + xsum; under the 48 KiB default, so no opt-in attribute
constexpr int64_t kMinSplitValues = 1024;   // below this a split's x staging costs more than its codes
constexpr int kTargetBlocksPerSm = 4;       // ~2 waves of 2 resident blocks: hides the tail at batch 1
constexpr int64_t kMaxTPerLaunch = 16;      // query rows per head per launch (q_len > 16 loops in the launcher)
constexpr int kChunkPad = 4;                // floats of padding per chunk in smem: lanes of a row read
                                            // consecutive chunks, the pad shifts them to distinct banks

// Resident blocks per SM promised to ptxas via __launch_bounds__, i.e. the register cap (65536 / 256 / n).
// Left alone, ptxas squeezes some instantiations to 64 registers and spills; these caps are the tightest that
// compile without spills on sm_80/87/90 (.ci/nvcc_check.sh): 1 query row ~80 registers (3 blocks), 2-4 rows
// 128 (2 blocks); left uncapped (1 block, FMA-bound anyway): the 12-word 3-bit vector chunk with >= 4 rows,
// 8 rows at 1 or 3 bits (their 4-block chunks unroll to 1024 FMAs), and 8 rows with vector loads at any width
// (the 32-bit tail path puts 2 and 4 bits a register or two over 128; with 8 rows every code byte feeds >= 16
// FMAs, above the H100's ~10 FMA per DRAM byte, so these run compute-bound and occupancy matters less).
__host__ __device__ constexpr int min_blocks_per_sm(int bits, int qt, bool vec) {
  if (qt == 1) return 3;
  if (bits == 3 && vec && qt >= 4) return 1;
  if (qt == 8 && (bits == 1 || bits == 3 || vec)) return 1;
  return 2;
}

// Values one lane decodes per step: 16 bytes of codes (lcm(4, bits) words for 3 bits) when vectorized, else
// one 32-value block read with 32-bit loads.
__host__ __device__ constexpr int chunk_blocks(int bits, bool vec) { return vec ? (bits == 3 ? 4 : 4 / bits) : 1; }
__host__ __device__ constexpr int chunk_values(int bits, bool vec) { return 32 * chunk_blocks(bits, vec); }

struct InnerQPlan {
  bool vec;                 // 16-byte code loads
  int chunk;                // values per lane step
  int qt;                   // query rows per register tile
  int64_t t_chunk;          // query rows per head per launch
  int64_t split_len;        // L values per block (multiple of lcm(G, chunk))
  int64_t num_splits;       // blocks along L
  int tpr;                  // lanes per row
  int64_t rows_per_block;   // M rows per block (multiple of kThreads / tpr)
  int64_t row_blocks;       // blocks along M
  size_t smem_bytes;        // dynamic shared memory
  int64_t workspace_floats; // split-K workspace (0 without split)
  const char* error;        // non-null: unsupported configuration
};

size_t stage_bytes(int64_t len, int qt, int chunk, int group_size) {
  const int64_t padded = len + kChunkPad * (len / chunk);
  return static_cast<size_t>(qt) * static_cast<size_t>(padded + len / group_size) * sizeof(float);
}

// 16-byte code loads need 16-byte aligned rows and at least one whole vector chunk per row. L itself need not be a
// multiple of the chunk: the last (L % chunk) values of a row, whole 32-value blocks, are read with 32-bit loads.
// (The InnerQ value store grows by G = 32 tokens, so its L is a multiple of the 128-value 3-bit chunk only one
// step in four; requiring it would put most value GEMVs on the narrow path.)
bool codes_aligned_16(const GemvInnerQParams& p) {
  const auto ok = [](int64_t size, int64_t stride) { return size <= 1 || stride % 4 == 0; };
  return reinterpret_cast<uintptr_t>(p.codes) % 16 == 0 && ok(p.B, p.c_sb) && ok(p.H_kv, p.c_sh) &&
         ok(p.M, p.c_sm) && p.L >= chunk_values(p.bits, true);
}

InnerQPlan plan_inner_q(const GemvInnerQParams& p) {
  InnerQPlan pl{};
  const int64_t gq = p.H_q / p.H_kv;
  pl.t_chunk = std::min<int64_t>(p.T, kMaxTPerLaunch);
  pl.qt = pick_query_tile(gq * pl.t_chunk);
  pl.vec = codes_aligned_16(p);
  pl.chunk = chunk_values(p.bits, pl.vec);
  const int64_t unit = lcm64(p.group_size, pl.chunk);  // splits hold whole groups and whole chunks
  while (stage_bytes(unit, pl.qt, pl.chunk, p.group_size) > kSmemBudget && pl.qt > 1) pl.qt /= 2;
  if (stage_bytes(unit, pl.qt, pl.chunk, p.group_size) > kSmemBudget) {
    pl.error = "group_size too large for the shared-memory x tile";
    return pl;
  }
  const int64_t max_len = unit * (kSmemBudget / stage_bytes(unit, pl.qt, pl.chunk, p.group_size));
  pl.split_len = std::min(p.L, max_len);  // all of L, or a multiple of unit (the last split takes the rest)
  const auto tpr_for = [&](int64_t len) { return std::min(32, next_pow2(ceil_div(len, pl.chunk))); };
  const int64_t bh = p.B * p.H_kv;
  const int64_t target = static_cast<int64_t>(kTargetBlocksPerSm) * std::max(p.num_sms, 1);
  // 1) split L while that still leaves whole-unit splits of useful length (values: few rows, long L)
  pl.num_splits = ceil_div(p.L, pl.split_len);
  while (pl.num_splits * bh < target) {
    const int64_t half = round_up(ceil_div(pl.split_len, 2), unit);
    if (half >= pl.split_len || half < std::max(kMinSplitValues, unit)) break;
    pl.split_len = half;
    pl.num_splits = ceil_div(p.L, pl.split_len);
  }
  pl.tpr = tpr_for(pl.split_len);
  const int64_t rows_per_pass = kThreads / pl.tpr;
  // 2) then tile M (keys: many rows, short L)
  pl.rows_per_block = round_up(std::max<int64_t>(p.M, 1), rows_per_pass);
  while (ceil_div(p.M, pl.rows_per_block) * pl.num_splits * bh < target) {
    const int64_t half = round_up(ceil_div(pl.rows_per_block, 2), rows_per_pass);
    if (half >= pl.rows_per_block) break;
    pl.rows_per_block = half;
  }
  pl.row_blocks = ceil_div(p.M, pl.rows_per_block);
  pl.smem_bytes = stage_bytes(pl.split_len, pl.qt, pl.chunk, p.group_size);
  pl.workspace_floats = pl.num_splits > 1 ? pl.num_splits * p.B * p.H_q * pl.t_chunk * p.M : 0;
  if (pl.row_blocks > 0x7fffffff || pl.num_splits > 65535 || bh > 65535) pl.error = "grid too large";
  return pl;
}

struct InnerQLaunch {
  int64_t t0;              // first query row (of T) handled by this launch
  int tc;                  // query rows per head in this launch (<= kMaxTPerLaunch)
  int gq;                  // query heads per KV head
  int qb;                  // query rows per block = (H_q / H_kv) * tc
  int64_t split_len;       // L values per split
  int groups_per_split;    // split_len / G   (host-side, so the kernel needs no 64-bit division)
  int blocks_per_split;    // split_len / 32
  int tpr;                 // lanes per row
  int64_t rows_per_block;  // M rows per block
  OutView out;             // y, or the split-K workspace
};

template <int WORDS, bool VEC>
__device__ __forceinline__ void load_words(const uint32_t* __restrict__ src, uint32_t (&w)[WORDS]) {
  if constexpr (VEC) {
    static_assert(WORDS % 4 == 0, "vector chunks are whole 16-byte words");
#pragma unroll
    for (int i = 0; i < WORDS / 4; ++i) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(src) + i);
      w[4 * i + 0] = v.x;
      w[4 * i + 1] = v.y;
      w[4 * i + 2] = v.z;
      w[4 * i + 3] = v.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < WORDS; ++i) w[i] = __ldg(src + i);
  }
}

// One lane step: CB consecutive 32-value blocks of one row, starting at block blk0 of the split, whose staged
// activations start at xc (query row q at xc + q * xs_stride), against QT query rows.
template <int BITS, QuantMode MODE, int QT, int CB>
__device__ __forceinline__ void process_blocks(const uint32_t (&w)[CB * BITS], int blk0, const float* __restrict__ xc,
                                               int xs_stride, const float* __restrict__ xsum, int ngroups,
                                               const uint16_t* __restrict__ srow, const uint16_t* __restrict__ zrow,
                                               int bpg, float (&acc)[QT]) {
  constexpr int kCB = CB;
  int g = blk0 / bpg;      // the group of the first block
  int r = blk0 - g * bpg;  // its position in the group
  float dot[QT];
#pragma unroll
  for (int q = 0; q < QT; ++q) dot[q] = 0.f;
#pragma unroll
  for (int j = 0; j < kCB; ++j) {
#pragma unroll
    for (int i4 = 0; i4 < 8; ++i4) {
      const float u0 = decode<BITS>(w + j * BITS, 4 * i4 + 0);
      const float u1 = decode<BITS>(w + j * BITS, 4 * i4 + 1);
      const float u2 = decode<BITS>(w + j * BITS, 4 * i4 + 2);
      const float u3 = decode<BITS>(w + j * BITS, 4 * i4 + 3);
#pragma unroll
      for (int q = 0; q < QT; ++q) {
        const float4 xv = *reinterpret_cast<const float4*>(xc + q * xs_stride + 32 * j + 4 * i4);
        dot[q] = fmaf(xv.x, u0, dot[q]);
        dot[q] = fmaf(xv.y, u1, dot[q]);
        dot[q] = fmaf(xv.z, u2, dot[q]);
        dot[q] = fmaf(xv.w, u3, dot[q]);
      }
    }
    ++r;
    if (r == bpg || j == kCB - 1) {  // group g ends here, or the chunk does: fold with one FMA per query row
      const uint16_t zb = MODE == QuantMode::kSym ? uint16_t{0} : __ldg(zrow + g);
      const GroupAffine a = group_affine<MODE, BITS>(__ldg(srow + g), zb);
      const bool owns_offset = g * bpg >= blk0;  // the group's first block is in this chunk: add zeff * xsum once
#pragma unroll
      for (int q = 0; q < QT; ++q) {
        float v = fmaf(a.s, dot[q], acc[q]);
        if (owns_offset) v = fmaf(a.zeff, xsum[q * ngroups + g], v);
        acc[q] = v;
        dot[q] = 0.f;
      }
      if (r == bpg) {
        ++g;
        r = 0;
      }
    }
  }
}

template <int BITS, QuantMode MODE, int QT, bool VEC>
__global__ void __launch_bounds__(kThreads, min_blocks_per_sm(BITS, QT, VEC))
    gemv_inner_q_kernel(const GemvInnerQParams p, const InnerQLaunch k) {
  constexpr int kChunk = chunk_values(BITS, VEC);
  constexpr int kCB = chunk_blocks(BITS, VEC);
  constexpr int kWords = kCB * BITS;
  constexpr int kStride = kChunk + kChunkPad;
  // Register double-buffering of codes pays where the kernel is memory-bound (few query rows); with 4-8 query
  // rows it is FMA-bound and the extra registers would only cost occupancy.
  constexpr bool kPrefetch = QT <= 2;
  extern __shared__ __align__(16) float smem[];

  const int G = p.group_size;
  const int bpg = G / 32;
  // 32-bit index math: grid dims are < 2^31, and 64-bit division would be a called subroutine (ABI spills)
  const int H_kv = static_cast<int>(p.H_kv);
  const int64_t b = static_cast<int>(blockIdx.z) / H_kv, hkv = static_cast<int>(blockIdx.z) % H_kv;
  const int64_t gq = k.gq;
  const int64_t l0 = static_cast<int64_t>(blockIdx.y) * k.split_len;
  const int len = static_cast<int>(min(k.split_len, p.L - l0));
  const int nchunks = len / kChunk;  // whole vector chunks per row (VEC: then len % kChunk values, the tail)
  const int ngroups = len / G;
  // floats per staged query row (a multiple of 4: float4 reads); the tail is staged unpadded after the chunks
  const int xs_stride = nchunks * kStride + (len - nchunks * kChunk);
  float* xs = smem;                         // [QT][xs_stride]
  float* xsum = smem + QT * xs_stride;      // [QT][ngroups]

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nwarps = blockDim.x / 32;
  const int tpr = k.tpr;
  const int sub = threadIdx.x & (tpr - 1);
  const int rloc = threadIdx.x / tpr;
  const int rows_per_pass = blockDim.x / tpr;
  const int64_t m_begin = static_cast<int64_t>(blockIdx.x) * k.rows_per_block;
  const int64_t m_end = min(p.M, m_begin + k.rows_per_block);

  const int64_t g0 = static_cast<int64_t>(blockIdx.y) * k.groups_per_split;  // first group of the split
  const uint32_t* codes_bh =
      p.codes + b * p.c_sb + hkv * p.c_sh + static_cast<int64_t>(blockIdx.y) * k.blocks_per_split * BITS;
  const uint16_t* scales_bh = p.scales + b * p.s_sb + hkv * p.s_sh + g0;
  const uint16_t* zeros_bh = MODE == QuantMode::kSym ? nullptr : p.zeros + b * p.z_sb + hkv * p.z_sh + g0;
  const float* xscale = p.x_scale == nullptr ? nullptr : p.x_scale + hkv * p.xs_sh + l0;

  for (int q0 = 0; q0 < k.qb; q0 += QT) {
    __syncthreads();  // the previous query tile is no longer being read
    // Stage xs = x * x_scale for QT query rows, and xsum per (query row, group): a warp per (row, group).
    for (int pair = warp; pair < QT * ngroups; pair += nwarps) {
      const int q = pair / ngroups, g = pair - q * ngroups;
      const int qg = q0 + q;
      const bool valid = qg < k.qb;  // rows past the last query row are zero (their results are not stored)
      int64_t xoff = 0;
      if (valid) {
        const int hq = qg / k.tc, t = qg % k.tc;
        xoff = b * p.x_sb + (hkv * gq + hq) * p.x_sh + (k.t0 + t) * p.x_st + l0;
      }
      float part = 0.f;
      for (int i = lane; i < G; i += 32) {
        const int l = g * G + i;
        float v = 0.f;
        if (valid) {
          v = load_x(p.x, p.x_dtype, xoff + l);
          if (xscale != nullptr) v *= __ldg(xscale + l);
        }
        xs[q * xs_stride + (l / kChunk) * kStride + (l % kChunk)] = v;
        part += v;
      }
      part = group_sum(part, 32);
      if (lane == 0) xsum[q * ngroups + g] = part;
    }
    __syncthreads();

    for (int64_t base = m_begin; base < m_end; base += rows_per_pass) {  // uniform trip count: shuffles below
      const int64_t m = base + rloc;
      float acc[QT];
#pragma unroll
      for (int q = 0; q < QT; ++q) acc[q] = 0.f;
      if (m < m_end) {
        const uint32_t* crow = codes_bh + m * p.c_sm;
        const uint16_t* srow = scales_bh + m * p.s_sm;
        const uint16_t* zrow = MODE == QuantMode::kSym ? nullptr : zeros_bh + m * p.z_sm;
        if constexpr (kPrefetch) {  // next chunk's codes in flight while this one is decoded
          uint32_t next[kWords];
          int c = sub;
          if (c < nchunks) load_words<kWords, VEC>(crow + static_cast<int64_t>(c) * kWords, next);
          for (; c < nchunks; c += tpr) {
            uint32_t cur[kWords];
#pragma unroll
            for (int i = 0; i < kWords; ++i) cur[i] = next[i];
            if (c + tpr < nchunks) load_words<kWords, VEC>(crow + static_cast<int64_t>(c + tpr) * kWords, next);
            process_blocks<BITS, MODE, QT, kCB>(cur, c * kCB, xs + c * kStride, xs_stride, xsum, ngroups, srow, zrow,
                                                bpg, acc);
          }
        } else {
          for (int c = sub; c < nchunks; c += tpr) {
            uint32_t cur[kWords];
            load_words<kWords, VEC>(crow + static_cast<int64_t>(c) * kWords, cur);
            process_blocks<BITS, MODE, QT, kCB>(cur, c * kCB, xs + c * kStride, xs_stride, xsum, ngroups, srow, zrow,
                                                bpg, acc);
          }
        }
        if constexpr (VEC) {  // the row's last len % chunk values: whole blocks, 32-bit loads
          const int tail_blocks = (len - nchunks * kChunk) / 32;
#pragma unroll 1
          for (int tb = sub; tb < tail_blocks; tb += tpr) {
            const int blk = nchunks * kCB + tb;
            uint32_t cur[BITS];
            load_words<BITS, false>(crow + static_cast<int64_t>(blk) * BITS, cur);
            process_blocks<BITS, MODE, QT, 1>(cur, blk, xs + nchunks * kStride + tb * 32, xs_stride, xsum, ngroups,
                                              srow, zrow, bpg, acc);
          }
        }
      }
#pragma unroll
      for (int q = 0; q < QT; ++q) acc[q] = group_sum(acc[q], tpr);
      if (m < m_end && sub == 0) {
#pragma unroll
        for (int q = 0; q < QT; ++q) {
          const int qg = q0 + q;
          if (qg < k.qb) {
            const int hq = qg / k.tc, t = qg % k.tc;
            k.out.base[blockIdx.y * k.out.s_split + b * k.out.sb + (hkv * gq + hq) * k.out.sh + t * k.out.st + m] =
                acc[q];
          }
        }
      }
    }
  }
}

__global__ void combine_splits_kernel(const float* __restrict__ ws, int splits, int64_t n, int64_t H, int64_t T,
                                      int64_t N, float* __restrict__ y, int64_t y_sb, int64_t y_sh, int64_t y_st) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float s = 0.f;
    for (int sp = 0; sp < splits; ++sp) s += ws[sp * n + i];  // fixed order: deterministic
    const int64_t nn = i % N, t = (i / N) % T, h = (i / (N * T)) % H, b = i / (N * T * H);
    y[b * y_sb + h * y_sh + t * y_st + nn] = s;
  }
}

}  // namespace

cudaError_t launch_combine_splits(const float* ws, int splits, int64_t B, int64_t H, int64_t T, int64_t N, float* y,
                                  int64_t y_sb, int64_t y_sh, int64_t y_st, cudaStream_t stream) {
  const int64_t n = B * H * T * N;
  if (n == 0) return cudaSuccess;
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>(ceil_div(n, threads), 65535);
  combine_splits_kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(ws, splits, n, H, T, N, y, y_sb, y_sh,
                                                                               y_st);
  return cudaGetLastError();
}

bool gemv_inner_q_vector_loads(const GemvInnerQParams& p) { return plan_inner_q(p).vec; }

int64_t gemv_inner_q_workspace_floats(const GemvInnerQParams& p) {
  if (p.B * p.H_q * p.T * p.M == 0 || p.L == 0) return 0;
  return plan_inner_q(p).workspace_floats;
}

cudaError_t launch_gemv_inner_q(const GemvInnerQParams& p, cudaStream_t stream) {
  clear_launch_error();
  if (p.B * p.H_q * p.T * p.M == 0) return cudaSuccess;
  if (p.L == 0) {  // empty reduction: y = 0
    set_launch_error("gemv_inner_q: L == 0 must be handled by the caller (y = 0)");
    return cudaErrorInvalidValue;
  }
  if (p.H_kv <= 0 || p.H_q % p.H_kv != 0 || p.group_size <= 0 || p.group_size % 32 != 0 ||
      p.L % p.group_size != 0) {
    set_launch_error("gemv_inner_q: inconsistent sizes (H_q=%lld H_kv=%lld L=%lld G=%d)", (long long)p.H_q,
                     (long long)p.H_kv, (long long)p.L, p.group_size);
    return cudaErrorInvalidValue;
  }
  if (p.mode != QuantMode::kSym && p.zeros == nullptr) {
    set_launch_error("gemv_inner_q: asym and hybrid modes need zeros");
    return cudaErrorInvalidValue;
  }
  const InnerQPlan pl = plan_inner_q(p);
  if (pl.error != nullptr) {
    set_launch_error("gemv_inner_q: %s (L=%lld, G=%d)", pl.error, (long long)p.L, p.group_size);
    return cudaErrorInvalidConfiguration;
  }
  if (pl.workspace_floats > 0 && (p.workspace == nullptr || p.workspace_floats < pl.workspace_floats)) {
    set_launch_error("gemv_inner_q: workspace of %lld floats given, %lld needed", (long long)p.workspace_floats,
                     (long long)pl.workspace_floats);
    return cudaErrorInvalidValue;
  }
  const dim3 grid(static_cast<unsigned>(pl.row_blocks), static_cast<unsigned>(pl.num_splits),
                  static_cast<unsigned>(p.B * p.H_kv));
  const int64_t gq = p.H_q / p.H_kv;
  for (int64_t t0 = 0; t0 < p.T; t0 += pl.t_chunk) {
    InnerQLaunch k{};
    k.t0 = t0;
    k.tc = static_cast<int>(std::min(pl.t_chunk, p.T - t0));
    k.gq = static_cast<int>(gq);
    k.qb = static_cast<int>(gq * k.tc);
    k.split_len = pl.split_len;
    k.groups_per_split = static_cast<int>(pl.split_len / p.group_size);
    k.blocks_per_split = static_cast<int>(pl.split_len / 32);
    k.tpr = pl.tpr;
    k.rows_per_block = pl.rows_per_block;
    if (pl.num_splits == 1) {
      k.out = OutView{p.y + t0 * p.y_st, p.y_sb, p.y_sh, p.y_st, 0};
    } else {
      k.out = OutView{p.workspace, p.H_q * k.tc * p.M, k.tc * p.M, p.M, p.B * p.H_q * k.tc * p.M};
    }
    KVK_DISPATCH_BITS(p.bits, BITS, {
      KVK_DISPATCH_MODE(p.mode, MODE, {
        KVK_DISPATCH_QUERY_TILE(pl.qt, QT, {
          KVK_DISPATCH_VEC(pl.vec, VEC, {
            gemv_inner_q_kernel<BITS, MODE, QT, VEC><<<grid, kThreads, pl.smem_bytes, stream>>>(p, k);
          })
        })
      })
    })
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    if (pl.num_splits > 1) {
      err = launch_combine_splits(p.workspace, static_cast<int>(pl.num_splits), p.B, p.H_q, k.tc, p.M,
                                  p.y + t0 * p.y_st, p.y_sb, p.y_sh, p.y_st, stream);
      if (err != cudaSuccess) return err;
    }
  }
  return cudaSuccess;
}

}  // namespace kvk
