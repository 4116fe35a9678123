// static_append: a decode step's append into a static cache in two launches (kernels.h, StaticAppendParams).
//
// The eager append of kvkernels.static_cache is 34-42 small device ops per layer and step, and a CUDA graph replays
// them one launch at a time; this is the same step as one CTA per (tensor, batch, KV head) plus a one-thread commit
// of the counts. A CTA
//   1. writes the new tokens: the first `take` fill the sink at S, the rest go to the tail's end;
//   2. quantizes the n_out oldest tail tokens that leave (0 .. E, a multiple of the store's step) into the store at
//      its count, one thread per group, with quant.cuh's quantize_group_* (the functions quantize_groups_into runs,
//      in the same order and IEEE rounding, so the codes, scales and zeros are bit-identical to it);
//   3. shifts the tail left by n_out, in passes staged in registers (a pass reads all it moves before writing).
// The counts cannot be committed by the CTAs, which all read them first: count_kernel does it after them, from the
// same inputs. Not the hot path (per step it moves a tail and quantizes at most one group per row); what it removes
// is ~40 launches.
//
// Preconditions (every backend's; kvkernels/reference/static_append.py): 0 <= S <= W; a "cols" store's count is a
// multiple of G; tail + n <= tail capacity (n: the new tokens); store count + E <= store capacity, E = (tail capacity
// - w_recent) rounded down to the step (the most that can leave). A
// violation is a programming error that the host cannot see without a sync: the kernel traps (as an index_copy_ out
// of bounds asserts), and writes nothing out of bounds.
#include <cuda_runtime.h>

#include <algorithm>

#include "kvkernels/gemv.cuh"

namespace kvk {
namespace {

constexpr int kAppendThreads = 128;
constexpr int kAppendSmemBudget = 40 * 1024;  // under the 48 KiB default
constexpr int kShiftUnits = 4;                // units staged per thread and pass of the tail shift

struct AppendCounts {
  int64_t take, rest, n_out, E;
  bool ok;
};

// The step's counts for one side, from lengths (the CTAs and count_kernel compute the same).
__host__ __device__ inline AppendCounts append_counts(const StaticAppendParams& p, int side) {
  const AppendSide& a = p.side[side];
  const int64_t S = p.lengths[0], stored = p.lengths[1 + 2 * side], tail = p.lengths[2 + 2 * side];
  const int64_t step = a.layout == StoreLayout::kCols ? p.group_size : 1;
  AppendCounts c{};
  const int64_t room = p.W - S > 0 ? p.W - S : 0;
  c.take = room < p.n ? room : p.n;
  c.rest = p.n - c.take;
  const int64_t over = tail + c.rest - p.w_recent;
  c.n_out = (over > 0 ? over : 0) / step * step;
  c.E = (a.tail_cap > p.w_recent ? a.tail_cap - p.w_recent : 0) / step * step;
  // written as differences so that no garbage count can overflow its way past them (n <= tail_cap and E <= cap are
  // checked first)
  c.ok = S >= 0 && S <= p.W && stored >= 0 && tail >= 0 && p.n <= a.tail_cap && tail <= a.tail_cap - p.n &&
         c.E <= a.cap && stored <= a.cap - c.E && stored % step == 0;
  return c;
}

__device__ inline void trap_bad_counts() {
#if defined(KVK_EMU)
  kvk_emu::trap();  // tests/cuda_emu/emu.h counts it
#else
  __trap();
#endif
}

// Element i of a window (plain loads: the tail is written earlier in the same kernel, so no __ldg).
__device__ inline float load_window(const void* w, XDtype dt, int64_t i) {
  switch (dt) {
    case XDtype::kF16: return __half2float(static_cast<const __half*>(w)[i]);
    case XDtype::kBF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(w)[i]);
    default: return static_cast<const float*>(w)[i];
  }
}

__device__ inline void copy_element(void* dst, int64_t di, const void* src, int64_t si, int bytes) {
  if (bytes == 2) {
    static_cast<uint16_t*>(dst)[di] = static_cast<const uint16_t*>(src)[si];
  } else {
    static_cast<uint32_t*>(dst)[di] = static_cast<const uint32_t*>(src)[si];
  }
}

// Moves rows [from, from + keep) of a [*, upr units] strided buffer to rows [0, keep), from >= 1. Each pass reads
// kShiftUnits units per thread, syncs, writes them, syncs: a pass's reads lie at or past its writes, and every later
// pass reads past them, so nothing is read after being overwritten. Called by the whole CTA (uniform bounds).
template <typename U>
__device__ void shift_rows(char* base, int64_t row_bytes, int64_t upr, int64_t from, int64_t keep) {
  const int64_t total = keep * upr, shift = from * upr;
  for (int64_t start = 0; start < total; start += int64_t{kShiftUnits} * blockDim.x) {
    U v[kShiftUnits];
#pragma unroll
    for (int r = 0; r < kShiftUnits; ++r) {
      const int64_t i = start + r * blockDim.x + threadIdx.x;
      if (i < total) {
        const int64_t s = i + shift;
        v[r] = *reinterpret_cast<const U*>(base + (s / upr) * row_bytes + (s % upr) * sizeof(U));
      }
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < kShiftUnits; ++r) {
      const int64_t i = start + r * blockDim.x + threadIdx.x;
      if (i < total) *reinterpret_cast<U*>(base + (i / upr) * row_bytes + (i % upr) * sizeof(U)) = v[r];
    }
    __syncthreads();
  }
}

// Packs a group's G codes (a multiple of 32) and stores its G / 32 * BITS words.
template <int BITS>
__device__ void store_packed(const uint32_t* codes, int G, uint32_t* dst) {
  for (int blk = 0; blk < G / kBlockValues; ++blk) {
    uint32_t w[BITS];
    pack_block<BITS>(codes + blk * kBlockValues, w);
#pragma unroll
    for (int k = 0; k < BITS; ++k) dst[blk * BITS + k] = w[k];
  }
}

// (kAppendThreads, 1): without the minimum ptxas held the kernel to 64 registers on sm_80 and spilled; it is not a hot
// kernel (one CTA per tensor, batch and KV head), so its occupancy does not matter
__global__ void __launch_bounds__(kAppendThreads, 1) static_append_kernel(const StaticAppendParams p, int qthreads) {
  extern __shared__ float smem[];
  const int side = blockIdx.y;
  const AppendSide& a = p.side[side];
  const int64_t b = blockIdx.x / p.H, h = blockIdx.x % p.H;
  const AppendCounts c = append_counts(p, side);
  if (!c.ok) {  // uniform over the CTA
    if (threadIdx.x == 0) trap_bad_counts();
    return;
  }
  const int64_t S = p.lengths[0], stored = p.lengths[1 + 2 * side], tail_n = p.lengths[2 + 2 * side];
  const int64_t D = p.D;
  const int G = p.group_size, eb = p.elem_bytes;
  const int64_t x_off = b * a.x_sb + h * a.x_sh, sink_off = b * a.sk_sb + h * a.sk_sh, tail_off = b * a.t_sb + h * a.t_sh;

  // 1. the new tokens: token j < take to sink slot S + j, the others to tail slot tail_n + j - take
  for (int64_t i = threadIdx.x; i < p.n * D; i += blockDim.x) {
    const int64_t j = i / D, d = i - j * D;
    if (j < c.take) {
      copy_element(a.sink, sink_off + (S + j) * a.sk_st + d, a.x, x_off + j * a.x_st + d, eb);
    } else {
      copy_element(a.tail, tail_off + (tail_n + j - c.take) * a.t_st + d, a.x, x_off + j * a.x_st + d, eb);
    }
  }
  if (c.n_out == 0) return;  // uniform: nothing leaves the tail this step
  __syncthreads();

  // 2. the n_out oldest tail tokens into the store at token `stored`, one group of G per thread
  const bool cols = a.layout == StoreLayout::kCols;
  const int64_t ngroups = cols ? D * (c.n_out / G) : c.n_out * (D / G);
  if (threadIdx.x < qthreads) {
    const int seg = G + 1;
    float* xs = smem + threadIdx.x * seg;
    uint32_t* codes = reinterpret_cast<uint32_t*>(smem + (qthreads + threadIdx.x) * seg);
    uint32_t* scratch = reinterpret_cast<uint32_t*>(smem + (2 * qthreads + threadIdx.x) * seg);  // hybrid only
    for (int64_t gi = threadIdx.x; gi < ngroups; gi += qthreads) {
      // rows: group g of token t (channels g*G ..); cols: group g of channel d (tokens g*G ..)
      const int64_t t = cols ? 0 : gi / (D / G), g = cols ? 0 : gi % (D / G);  // rows
      const int64_t tg = cols ? gi / D : 0, d = cols ? gi % D : 0;               // cols: tg-th group leaving
      for (int i = 0; i < G; ++i) {
        const int64_t tok = cols ? tg * G + i : t, ch = cols ? d : g * G + i;
        float v = load_window(a.tail, p.dtype, tail_off + tok * a.t_st + ch);
        if (a.x_scale != nullptr) v = div_rn(v, a.x_scale[h * a.xs_sh + ch]);
        xs[i] = v;
      }
      GroupQuant q;
      if (a.mode == QuantMode::kSym) {
        q = quantize_group_sym(xs, G, a.bits, codes);
      } else if (a.mode == QuantMode::kAsym) {
        q = quantize_group_asym(xs, G, a.bits, a.calib, codes);
      } else {
        q = quantize_group_hybrid(xs, G, a.bits, codes, scratch);
      }
      // the store's row and its first word / group of this group
      int64_t row, word, grp;
      if (cols) {
        row = d;
        grp = stored / G + tg;
        word = (stored + tg * G) / kBlockValues * a.bits;
      } else {
        row = stored + t;
        grp = g;
        word = g * (G / kBlockValues) * a.bits;
      }
      a.scales[b * a.s_sb + h * a.s_sh + row * a.s_sr + grp] = q.scale_bits;
      if (a.zeros != nullptr) a.zeros[b * a.z_sb + h * a.z_sh + row * a.z_sr + grp] = q.zero_bits;
      uint32_t* dst = a.codes + b * a.c_sb + h * a.c_sh + row * a.c_sr + word;
      switch (a.bits) {  // compile-time widths: a runtime-indexed word array would live in local memory
        case 1: store_packed<1>(codes, G, dst); break;
        case 2: store_packed<2>(codes, G, dst); break;
        case 3: store_packed<3>(codes, G, dst); break;
        default: store_packed<4>(codes, G, dst); break;
      }
    }
  }
  __syncthreads();

  // 3. the tail keeps tokens [n_out, tail_n + rest), moved to [0, ..)
  const int64_t keep = tail_n + c.rest - c.n_out;
  char* base = static_cast<char*>(a.tail) + tail_off * eb;
  const int64_t row_bytes = a.t_st * eb, bytes = D * eb;
  const bool wide = bytes % 16 == 0 && row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(base) % 16 == 0;
  if (wide) {
    shift_rows<uint4>(base, row_bytes, bytes / 16, c.n_out, keep);
  } else if (eb == 2) {
    shift_rows<uint16_t>(base, row_bytes, D, c.n_out, keep);
  } else {
    shift_rows<uint32_t>(base, row_bytes, D, c.n_out, keep);
  }
}

// Commits the step's counts once every CTA of static_append_kernel has read them (stream order).
__global__ void static_append_counts_kernel(const StaticAppendParams p) {
  const AppendCounts k = append_counts(p, 0), v = append_counts(p, 1);
  if (!k.ok || !v.ok) return;  // the append kernel trapped
  p.lengths[0] += k.take;
  p.lengths[1] += k.n_out;
  p.lengths[2] += k.rest - k.n_out;
  p.lengths[3] += v.n_out;
  p.lengths[4] += v.rest - v.n_out;
}

}  // namespace

cudaError_t launch_static_append(const StaticAppendParams& p, cudaStream_t stream) {
  clear_launch_error();
  const int G = p.group_size;
  if (G <= 0 || G % kBlockValues != 0) {
    set_launch_error("static_append: group_size=%d must be a positive multiple of 32", G);
    return cudaErrorInvalidValue;
  }
  if (p.elem_bytes != 2 && p.elem_bytes != 4) {
    set_launch_error("static_append: window elements of %d bytes (2 or 4)", p.elem_bytes);
    return cudaErrorInvalidValue;
  }
  // x, codes and (hybrid) the losing candidate's codes, G + 1 floats each, per quantizing thread
  const bool hybrid = p.side[0].mode == QuantMode::kHybrid || p.side[1].mode == QuantMode::kHybrid;
  const size_t per_thread = sizeof(float) * (G + 1) * (hybrid ? 3 : 2);
  if (per_thread > static_cast<size_t>(kAppendSmemBudget)) {
    set_launch_error("static_append: group_size=%d needs %zu bytes of shared memory per group (max %d)", G,
                     per_thread, kAppendSmemBudget);
    return cudaErrorInvalidConfiguration;
  }
  if (p.B * p.H > 0x7fffffff) {
    set_launch_error("static_append: too many (batch, head) pairs (%lld)", (long long)(p.B * p.H));
    return cudaErrorInvalidConfiguration;
  }
  if (p.B * p.H * p.D > 0) {  // an empty batch has no tokens to move, but its counts advance as the reference's do
    const int qthreads = static_cast<int>(std::min<size_t>(kAppendThreads, kAppendSmemBudget / per_thread));
    const dim3 grid(static_cast<unsigned>(p.B * p.H), 2);
    static_append_kernel<<<grid, kAppendThreads, per_thread * qthreads, stream>>>(p, qthreads);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  static_append_counts_kernel<<<1, 1, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace kvk
