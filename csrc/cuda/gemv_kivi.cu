// KIVI-layout fused dequant-GEMV (reduction over rows r, asym groups of G along the packed columns c):
//   y[b, h, t, c] = sum_r x[b, h, t, r] * (s[r, c/G] * u[r, c] + z[r, c/G])
//                 = sum_r (x_r * s_{r,g}) * u_{r,c}  +  sum_r x_r * z_{r,g}
// The coefficient a_r = x_r * s_{r,g} is formed once per (query row, row, group) and the zero term is
// accumulated once per (query row, row, group) into its own register, so the per-element work is one decode
// shared by all query rows plus one FMA per query row.
//
// Block = (column tile, split of R, (b, h_kv)); 256 threads as ct column lanes x (256 / ct) row lanes. A thread
// owns CW consecutive columns (within one group) and walks the block's rows r = ty, ty + ry, ...; its
// accumulators are CW x QT registers, so CW shrinks as the query tile grows (QT * CW <= 64). The row lanes are
// then summed through shared memory in a fixed order. Every query head of the KV head and all T rows of the
// launch are served from the same codes (query tiles of up to 8 rows loop inside the block; codes are re-read
// from L1/L2, never expanded). Values (R = tokens, long; C = head_dim) split R across blocks into a workspace and
// combine deterministically; keys (R = head_dim; C = tokens, long) tile the columns.
#include <cuda_runtime.h>

#include <algorithm>

#include "kvkernels/gemv.cuh"

namespace kvk {
namespace {

constexpr int kThreads = 256;              // 8 warps
constexpr int kMaxColLanes = 32;           // column lanes per block; the rest of the block walks rows
constexpr int kXBudget = 32 * 1024;        // bytes of staged x per block (query tile x rows of the split)
constexpr int kMinRowsPerLane = 8;         // split R only while each row lane keeps >= 8 rows
constexpr int kTargetBlocksPerSm = 4;      // ~2 waves of 2 resident blocks
constexpr int64_t kMaxTPerLaunch = 16;     // query rows per head per launch

// Columns per thread: all accumulators (QT x CW) stay in registers.
__host__ __device__ constexpr int cols_per_thread(int qt) { return qt <= 2 ? 32 : 64 / qt; }

// Whether a whole-block (CW == 32) load can use one vector instruction: 16 bytes (4 bits) or 8 bytes (2 bits).
__host__ __device__ constexpr bool vec_meaningful(int bits, int qt) {
  return cols_per_thread(qt) == 32 && (bits == 2 || bits == 4);
}

struct KiviPlan {
  int qt, cw, ct, ry;       // query tile, columns per thread, column lanes, row lanes
  bool vec;                 // vector loads of whole blocks
  int64_t t_chunk;          // query rows per head per launch
  int64_t col_tiles;        // blocks along C
  int64_t rows_per_split;   // R rows per block
  int64_t num_splits;       // blocks along R
  size_t smem_bytes;
  int64_t workspace_floats;
  const char* error;
};

bool codes_aligned(const GemvKiviParams& p, int64_t words) {
  const auto ok = [&](int64_t size, int64_t stride) { return size <= 1 || stride % words == 0; };
  return reinterpret_cast<uintptr_t>(p.codes) % (4 * words) == 0 && ok(p.B, p.c_sb) && ok(p.H_kv, p.c_sh) &&
         ok(p.R, p.c_sr);
}

KiviPlan plan_kivi(const GemvKiviParams& p) {
  KiviPlan pl{};
  const int64_t gq = p.H_q / p.H_kv;
  pl.t_chunk = std::min<int64_t>(p.T, kMaxTPerLaunch);
  pl.qt = pick_query_tile(gq * pl.t_chunk);
  pl.cw = cols_per_thread(pl.qt);
  pl.vec = vec_meaningful(p.bits, pl.qt) && codes_aligned(p, p.bits);
  const int64_t units = p.C / pl.cw;  // C is a multiple of G >= 32 >= cw
  pl.ct = std::min(kMaxColLanes, next_pow2(units));
  pl.ry = kThreads / pl.ct;
  pl.col_tiles = ceil_div(units, pl.ct);
  const int64_t bh = p.B * p.H_kv;
  const int64_t target = static_cast<int64_t>(kTargetBlocksPerSm) * std::max(p.num_sms, 1);
  pl.rows_per_split = std::min<int64_t>(p.R, kXBudget / (4 * pl.qt));
  pl.num_splits = ceil_div(p.R, pl.rows_per_split);
  while (pl.col_tiles * pl.num_splits * bh < target) {
    const int64_t half = ceil_div(pl.rows_per_split, 2);
    if (half < static_cast<int64_t>(pl.ry) * kMinRowsPerLane) break;
    pl.rows_per_split = half;
    pl.num_splits = ceil_div(p.R, pl.rows_per_split);
  }
  const size_t x_bytes = sizeof(float) * pl.qt * pl.rows_per_split;
  const size_t red_bytes = sizeof(float) * kThreads * (pl.cw + 1);  // row-lane partials, padded against conflicts
  pl.smem_bytes = std::max(x_bytes, red_bytes);
  pl.workspace_floats = pl.num_splits > 1 ? pl.num_splits * p.B * p.H_q * pl.t_chunk * p.C : 0;
  if (pl.col_tiles > 0x7fffffff || pl.num_splits > 65535 || bh > 65535) pl.error = "grid too large";
  return pl;
}

struct KiviLaunch {
  int64_t t0;              // first query row (of T) of this launch
  int tc;                  // query rows per head in this launch
  int gq;                  // query heads per KV head
  int qb;                  // query rows per block = gq * tc
  int ct;                  // column lanes
  int rows_per_split;      // R rows per block
  OutView out;             // y or the split-K workspace
};

// Number of words a thread reads per row for its CW columns of one 32-value block.
template <int BITS, int CW>
__host__ __device__ constexpr int words_per_row() {
  if constexpr (CW == 32) return BITS;                 // the whole block
  else if constexpr (BITS == 3) return 2;              // its low-plane word and the high-plane word
  else return (CW * BITS + 31) / 32;                   // 1 or 2 consecutive words
}

// Loads the words holding columns [sub * CW, sub * CW + CW) of the 32-value block at `blk`, pre-shifted so
// column k of the slice sits at a compile-time bit position.
template <int BITS, int CW, bool VEC>
__device__ __forceinline__ void load_cols(const uint32_t* __restrict__ blk, int sub,
                                          uint32_t (&w)[words_per_row<BITS, CW>()]) {
  if constexpr (CW == 32) {
    if constexpr (VEC && BITS == 4) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(blk));
      w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
    } else if constexpr (VEC && BITS == 2) {
      const uint2 v = __ldg(reinterpret_cast<const uint2*>(blk));
      w[0] = v.x, w[1] = v.y;
    } else {
#pragma unroll
      for (int i = 0; i < BITS; ++i) w[i] = __ldg(blk + i);
    }
  } else if constexpr (BITS == 3) {
    const int first = sub * CW;  // CW <= 16: the slice stays inside one 16-value half of the low plane
    w[0] = __ldg(blk + (first >> 4)) >> ((first & 15) * 2);
    w[1] = __ldg(blk + 2) >> first;
  } else {
    constexpr int kNW = words_per_row<BITS, CW>();
    const int bit0 = sub * CW * BITS;  // multiple of 32 when kNW > 1
#pragma unroll
    for (int i = 0; i < kNW; ++i) w[i] = __ldg(blk + (bit0 >> 5) + i);
    if constexpr (kNW == 1) w[0] >>= (bit0 & 31);
  }
}

// Column k (compile-time) of the slice loaded by load_cols, as float.
template <int BITS, int CW>
__device__ __forceinline__ float col_value(const uint32_t (&w)[words_per_row<BITS, CW>()], int k) {
  if constexpr (CW == 32) {
    return decode<BITS>(w, k);
  } else if constexpr (BITS == 3) {
    return code_to_float(((w[0] >> (2 * k)) & 3u) | (((w[1] >> k) & 1u) << 2));
  } else {
    constexpr uint32_t kMask = (1u << BITS) - 1u;
    return code_to_float((w[(k * BITS) >> 5] >> ((k * BITS) & 31)) & kMask);
  }
}

template <int BITS, int QT, bool VEC>
__global__ void __launch_bounds__(kThreads) gemv_kivi_kernel(const GemvKiviParams p, const KiviLaunch k) {
  constexpr int CW = cols_per_thread(QT);
  constexpr int kNW = words_per_row<BITS, CW>();
  constexpr int kRedStride = CW + 1;  // padded: column lanes write CW-float runs without bank conflicts
  extern __shared__ __align__(16) float smem[];

  const int ct = k.ct;
  const int tx = threadIdx.x % ct, ty = threadIdx.x / ct, ry = blockDim.x / ct;
  const int H_kv = static_cast<int>(p.H_kv);
  const int64_t b = static_cast<int>(blockIdx.z) / H_kv, hkv = static_cast<int>(blockIdx.z) % H_kv;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * k.rows_per_split;
  const int rlen = static_cast<int>(min(static_cast<int64_t>(k.rows_per_split), p.R - r0));
  const int64_t tile_c0 = static_cast<int64_t>(blockIdx.x) * ct * CW;
  const int64_t c0 = tile_c0 + static_cast<int64_t>(tx) * CW;  // this thread's first column
  const bool active = c0 < p.C;
  const int64_t g = c0 / p.group_size;  // CW divides G, so [c0, c0 + CW) is inside group g
  const int sub = static_cast<int>(c0 & 31) / CW;

  const uint32_t* cbase = p.codes + b * p.c_sb + hkv * p.c_sh + r0 * p.c_sr + (c0 >> 5) * BITS;
  const uint16_t* sbase = p.scales + b * p.s_sb + hkv * p.s_sh + r0 * p.s_sr + g;
  const uint16_t* zbase = p.zeros + b * p.z_sb + hkv * p.z_sh + r0 * p.z_sr + g;
  float* xs = smem;   // [QT][rlen] staged x
  float* red = smem;  // [ry][ct * kRedStride] row-lane partials (reuses xs once the rows are done)

  for (int q0 = 0; q0 < k.qb; q0 += QT) {
    __syncthreads();
    for (int q = 0; q < QT; ++q) {
      const int qg = q0 + q;
      int64_t xoff = -1;
      if (qg < k.qb) {
        const int hq = qg / k.tc, t = qg % k.tc;
        xoff = b * p.x_sb + (hkv * k.gq + hq) * p.x_sh + (k.t0 + t) * p.x_st + r0;
      }
      for (int rr = threadIdx.x; rr < rlen; rr += blockDim.x)
        xs[q * rlen + rr] = xoff >= 0 ? load_x(p.x, p.x_dtype, xoff + rr) : 0.f;
    }
    __syncthreads();

    float acc[QT][CW];
    float zacc[QT];
#pragma unroll
    for (int q = 0; q < QT; ++q) {
      zacc[q] = 0.f;
#pragma unroll
      for (int c = 0; c < CW; ++c) acc[q][c] = 0.f;
    }
    if (active) {
#pragma unroll 2
      for (int rr = ty; rr < rlen; rr += ry) {
        uint32_t w[kNW];
        load_cols<BITS, CW, VEC>(cbase + rr * p.c_sr, sub, w);
        const float s = half_bits_to_float(__ldg(sbase + rr * p.s_sr));
        const float z = half_bits_to_float(__ldg(zbase + rr * p.z_sr));
        float a[QT];
#pragma unroll
        for (int q = 0; q < QT; ++q) {
          const float xq = xs[q * rlen + rr];
          a[q] = xq * s;                   // the scale, once per (query row, row, group)
          zacc[q] = fmaf(xq, z, zacc[q]);  // the zero term, once per (query row, row, group)
        }
#pragma unroll
        for (int c = 0; c < CW; ++c) {
          const float u = col_value<BITS, CW>(w, c);
#pragma unroll
          for (int q = 0; q < QT; ++q) acc[q][c] = fmaf(a[q], u, acc[q][c]);
        }
      }
    }

    // Sum the ry row lanes, one query row at a time, in a fixed order (deterministic).
#pragma unroll
    for (int q = 0; q < QT; ++q) {
      __syncthreads();  // xs / the previous query row's partials are no longer read
      float* mine = red + ty * (ct * kRedStride) + tx * kRedStride;
#pragma unroll
      for (int c = 0; c < CW; ++c) mine[c] = acc[q][c] + zacc[q];
      __syncthreads();
      const int qg = q0 + q;
      if (qg < k.qb) {
        const int hq = qg / k.tc, t = qg % k.tc;
        float* out = k.out.base + blockIdx.y * k.out.s_split + b * k.out.sb + (hkv * k.gq + hq) * k.out.sh +
                     t * k.out.st;
        for (int col = threadIdx.x; col < ct * CW; col += blockDim.x) {
          const int64_t cg = tile_c0 + col;
          if (cg >= p.C) continue;
          const int off = (col / CW) * kRedStride + col % CW;
          float sum = 0.f;
          for (int y = 0; y < ry; ++y) sum += red[y * (ct * kRedStride) + off];
          out[cg] = sum;
        }
      }
    }
  }
}

// Vector loads only exist for whole-block slices of 2- and 4-bit codes; other combinations get one kernel.
template <int BITS, int QT>
void launch_kivi_kernel(bool vec, dim3 grid, size_t smem, cudaStream_t stream, const GemvKiviParams& p,
                        const KiviLaunch& k) {
  if constexpr (vec_meaningful(BITS, QT)) {
    if (vec) {
      gemv_kivi_kernel<BITS, QT, true><<<grid, kThreads, smem, stream>>>(p, k);
      return;
    }
  }
  gemv_kivi_kernel<BITS, QT, false><<<grid, kThreads, smem, stream>>>(p, k);
}

}  // namespace

int64_t gemv_kivi_workspace_floats(const GemvKiviParams& p) {
  if (p.B * p.H_q * p.T * p.C == 0 || p.R == 0) return 0;
  return plan_kivi(p).workspace_floats;
}

cudaError_t launch_gemv_kivi(const GemvKiviParams& p, cudaStream_t stream) {
  clear_launch_error();
  if (p.B * p.H_q * p.T * p.C == 0) return cudaSuccess;
  if (p.R == 0) {
    set_launch_error("gemv_kivi: R == 0 must be handled by the caller (y = 0)");
    return cudaErrorInvalidValue;
  }
  if (p.H_kv <= 0 || p.H_q % p.H_kv != 0 || p.group_size <= 0 || p.group_size % 32 != 0 ||
      p.C % p.group_size != 0) {
    set_launch_error("gemv_kivi: inconsistent sizes (H_q=%lld H_kv=%lld C=%lld G=%d)", (long long)p.H_q,
                     (long long)p.H_kv, (long long)p.C, p.group_size);
    return cudaErrorInvalidValue;
  }
  const KiviPlan pl = plan_kivi(p);
  if (pl.error != nullptr) {
    set_launch_error("gemv_kivi: %s", pl.error);
    return cudaErrorInvalidConfiguration;
  }
  if (pl.workspace_floats > 0 && (p.workspace == nullptr || p.workspace_floats < pl.workspace_floats)) {
    set_launch_error("gemv_kivi: workspace of %lld floats given, %lld needed", (long long)p.workspace_floats,
                     (long long)pl.workspace_floats);
    return cudaErrorInvalidValue;
  }
  const dim3 grid(static_cast<unsigned>(pl.col_tiles), static_cast<unsigned>(pl.num_splits),
                  static_cast<unsigned>(p.B * p.H_kv));
  const int64_t gq = p.H_q / p.H_kv;
  for (int64_t t0 = 0; t0 < p.T; t0 += pl.t_chunk) {
    KiviLaunch k{};
    k.t0 = t0;
    k.tc = static_cast<int>(std::min(pl.t_chunk, p.T - t0));
    k.gq = static_cast<int>(gq);
    k.qb = static_cast<int>(gq * k.tc);
    k.ct = pl.ct;
    k.rows_per_split = static_cast<int>(pl.rows_per_split);
    if (pl.num_splits == 1) {
      k.out = OutView{p.y + t0 * p.y_st, p.y_sb, p.y_sh, p.y_st, 0};
    } else {
      k.out = OutView{p.workspace, p.H_q * k.tc * p.C, k.tc * p.C, p.C, p.B * p.H_q * k.tc * p.C};
    }
    KVK_DISPATCH_BITS(p.bits, BITS, {
      KVK_DISPATCH_QUERY_TILE(pl.qt, QT, { launch_kivi_kernel<BITS, QT>(pl.vec, grid, pl.smem_bytes, stream, p, k); })
    })
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    if (pl.num_splits > 1) {
      err = launch_combine_splits(p.workspace, static_cast<int>(pl.num_splits), p.B, p.H_q, k.tc, p.C,
                                  p.y + t0 * p.y_st, p.y_sb, p.y_sh, p.y_st, stream);
      if (err != cudaSuccess) return err;
    }
  }
  return cudaSuccess;
}

}  // namespace kvk
