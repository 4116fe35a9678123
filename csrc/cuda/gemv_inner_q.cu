// InnerQ fused dequant-GEMV on tensor cores (groups along the reduction dim L):
//   y[b, h, t, m] = sum_l xs[b, h, t, l] * (s_g * u[b, h_kv, m, l] + zeff_g),   xs = x * x_scale[h_kv, :]
//                 = sum_blocks ( s_g * dot(xs_blk, u_blk) + zeff_g * sum(xs_blk) )  (32-value blocks, g = group)
//
// Each warp runs m16n8k16 MMAs with A = 16 code rows (exact fp16 integers, decoded two per LOP3 + HFMA2,
// csrc/kvkernels/mma.cuh) and B = the query rows of the KV head: 8 columns = 4 query rows x (hi, lo), the fp16
// split of the fp32 activations (pre-scaled per query row by a power of two); with 8 query rows the 8 columns are
// the rows and hi / lo two more k-steps (kdup, block_mma). One block = two MMAs per n-tile, whose fp32 result is
// folded into the row's accumulator with the block's scale (and zeff * xsum for asym / hybrid), so every product and
// sum after the code decode is fp32: the numerical contract of docs/FORMATS.md ("GEMV arithmetic").
// Per thread and block: 8 values of each of two rows (v = 8t + i, t = lane % 4), see decode_inner_q.
//
// CTA = (row block of M, split of L, (b, h_kv)), 32-256 threads. The CTA stages its query tile once: per query
// row the absolute maximum (-> scale 2^e), then per (n-tile, block, lane) the 16-byte B fragment, laid out so a
// lane reads its own with one conflict-free 16-byte shared load; plus sum(xs) per (query row, block) when the
// mode has zero points. Warps then walk 16-row tiles; along L a warp takes 4 blocks (128 values) of its 16 rows per
// step, and the row's last L % 128 values block by block with 32-bit loads. A step's codes, scales and zeros come
// (kLoadRing: 16-byte aligned code rows, G = 32, 8-byte aligned scale / zero rows, as the caches allocate them)
// through a per-warp cp.async ring in shared memory that keeps the next 2-5 steps in flight, or else straight into
// registers (16-byte loads for aligned rows at 1-3 bits, else 32-bit words), one step at a time.
// More query rows than one tile (GQA ratio x q_len > 16) loop over tiles, re-reading the codes from L2.
//
// Planning (plan_inner_q, a pure function of the params and the device's occupancy, so the binding sizes the
// workspace with the rule the launcher uses): one wave = resident CTAs per SM x SMs. With the ring, its slots and
// the query tile share the 48 KiB a CTA may use without an opt-in (the tile gets what the ring leaves). Keys
// (M = tokens) get row blocks; values (M = head_dim, L = tokens) split L into whole 128-value chunks only while
// (B x H_kv x row blocks) is below one wave, and combine_splits sums the splits in a fixed order (deterministic).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <type_traits>

#include "kvkernels/code_ring.cuh"
#include "kvkernels/gemv.cuh"
#include "kvkernels/mma.cuh"

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

// ---- tiling constants -------------------------------------------------------------------------------------------
constexpr int kMaxWarps = 8;              // 16 rows per warp: a 128-row value store is one CTA
constexpr int kChunkBlocks = 4;           // blocks per main-loop step: 48 bytes of a 3-bit row = three 16-byte loads
constexpr int kChunk = 32 * kChunkBlocks;
constexpr int kSmemBudget = 40 * 1024;    // staged query tile; under the 48 KiB default, so no opt-in attribute
constexpr size_t kCtaSmem = 48 * 1024;    // a CTA's whole dynamic shared memory with the code ring (no opt-in)
// Shortest split when splitting L to fill a wave. Was 1024: on the first GPU run (H200) the value GEMV then took a
// flat ~23 us from 2k to 16k tokens at batch 1, with 16-128 CTAs on 132 SMs, each walking its 8 chunk steps one DRAM
// round trip at a time. 256 (2 steps) gives those shapes a wave; a partial is M x query rows floats, L2-resident.
constexpr int64_t kMinSplitValues = 256;
constexpr int64_t kMinSplitValuesV1 = 1024;  // the same under KVKERNELS_GEMV_PLANNER=v1 (kernels.h)
constexpr int64_t kMaxTPerLaunch = 16;    // query rows per head per launch (q_len > 16 loops in the launcher)
constexpr int kFragBytes = 16;            // B fragment of one lane, block and n-tile: pairs P0..P3 of one column
constexpr int kMinCtasPerSm = 2;          // register cap 128 per thread

// Zero-MMA steps of a split of nblk blocks (zero_mma below), as the host sizes them: one per whole chunk, and one for
// the two blocks of keys at head_dim 64 (L = 64: no whole chunk; thread 0's k-slots hold both blocks, the others' B is
// zero). The kernels stage that one only where they use it (kLoadRing64); the others leave it unused.
constexpr int64_t zero_steps(int64_t nblk) { return nblk == 2 ? 1 : nblk / kChunkBlocks; }

// Shared memory of a CTA staging `len` values for NT n-tiles (4 query rows each).
size_t stage_bytes(int64_t len, int nt, QuantMode mode) {
  const int64_t nblk = len / 32, qr = 4 * static_cast<int64_t>(nt);
  const int64_t xsum = mode == QuantMode::kSym ? 0 : qr * nblk;
  const int64_t zfrag = mode == QuantMode::kSym ? 0 : nt * zero_steps(nblk) * 32 * 8;  // zero-MMA B fragments
  return static_cast<size_t>(nt * nblk * 32 * kFragBytes + zfrag + (xsum + 2 * qr) * 4);
}

struct InnerQLaunch {
  int64_t t0;              // first query row (of T) handled by this launch
  int tc;                  // query rows per head in this launch (<= kMaxTPerLaunch)
  int gq;                  // query heads per KV head
  int qb;                  // query rows per CTA = gq * tc
  int64_t split_len;       // L values per split (a multiple of kChunk unless it is all of L)
  int64_t rows_per_block;  // M rows per CTA (a multiple of 16)
  int bpg;                 // blocks per group, G / 32
  uint32_t bpg_magic;      // ceil(2^32 / bpg): group of block n = umulhi(n, magic) (bpg > 1)
  DecodeConsts dec;        // the decoder's constants for (bits, mode), read from constant memory
  OutView out;             // y, or the split-K workspace
};

// ---- codes -> canonical words (mma.cuh) for one row ------------------------------------------------------------------
// Raw words of one main-loop step (kChunkBlocks blocks) of one row.
template <int BITS, bool VEC>
struct ChunkWords {
  // 4 bits: the thread's own word of each block; VEC: the whole 16 * BITS bytes; else the words each block needs
  static constexpr int kWords = BITS == 4 ? kChunkBlocks : (VEC ? kChunkBlocks * BITS : kChunkBlocks * (BITS == 3 ? 3 : 1));
  uint32_t w[kWords];
};

template <int BITS, bool VEC>
__device__ __forceinline__ void load_chunk(ChunkWords<BITS, VEC>& c, const uint32_t* __restrict__ row, int t) {
  if constexpr (BITS == 4) {
#pragma unroll
    for (int j = 0; j < kChunkBlocks; ++j) c.w[j] = __ldg(row + 4 * j + t);
  } else if constexpr (VEC) {
#pragma unroll
    for (int i = 0; i < kChunkBlocks * BITS / 4; ++i) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(row) + i);
      c.w[4 * i] = v.x, c.w[4 * i + 1] = v.y, c.w[4 * i + 2] = v.z, c.w[4 * i + 3] = v.w;
    }
  } else if constexpr (BITS == 3) {
#pragma unroll
    for (int i = 0; i < 3 * kChunkBlocks; ++i) c.w[i] = __ldg(row + i);
  } else {  // 1 and 2 bits: the one word holding the thread's 8 values of each block
#pragma unroll
    for (int j = 0; j < kChunkBlocks; ++j) c.w[j] = __ldg(row + BITS * j + (BITS == 2 ? (t >> 1) : 0));
  }
}

// Canonical words of block j (compile-time) of a loaded chunk. sel_lo / sel_hi: prmt selectors of this thread.
template <int BITS, bool VEC>
__device__ __forceinline__ void gather_chunk(const ChunkWords<BITS, VEC>& c, int j, uint32_t sel_lo, uint32_t sel_hi,
                                             uint32_t& X, uint32_t& Xh) {
  if constexpr (BITS == 4) {
    X = c.w[j];
  } else if constexpr (BITS == 3) {
    X = prmt(c.w[3 * j], c.w[3 * j + 1], sel_lo);
    Xh = prmt(c.w[3 * j + 2], c.w[3 * j + 2], sel_hi);
  } else if constexpr (BITS == 2) {
    X = VEC ? prmt(c.w[2 * j], c.w[2 * j + 1], sel_lo) : prmt(c.w[j], c.w[j], sel_lo);
  } else {
    X = prmt(c.w[j], c.w[j], sel_hi);
  }
}

// ---- one block of the two rows: decode, 2 MMAs per n-tile, fold ------------------------------------------------------
// sym decodes to the signed levels u - 2^(b-1) (decode_offset, no zero term); asym and hybrid decode u and add
// zeff * sum(x): in the main loop as one "zero MMA" per chunk (zero_mma below), in the tail per block in fp32 (ZFOLD).
//
// Query slots: thread t's results are for query row slot_row(nt, t) (mma.cuh) of the pass. 4 rows (NT = 1): B's 8
// columns are the 4 rows x (hi, lo) and a fold adds the two (d[0] + d[1]). 8 rows (NT = 2, kdup): B's columns are the
// 8 rows and
// the hi / lo halves of the split are two more k-steps into the same accumulator (4 MMAs a block, as two n-tiles
// take, and no FADD per fold): d = (row g: query rows 2t, 2t + 1; row g + 8: the same), and the "n-tiles" of the
// fragments (frag_nt_stride apart) are the hi and the lo halves of all 8 rows.
template <int NT>
__host__ __device__ constexpr bool kdup() {
  return NT == 2;
}

// The group affines of a block's two rows (row g, row g + 8).
struct AffinePair {
  GroupAffine a, b;
};

// affines() gives the block's AffinePair (zeff read only with ZFOLD); it is called after the decode, where ptxas has
// always seen the conversions (the 128-register kernels' allocation moves with the PTX order).
template <int BITS, QuantMode MODE, int NT, bool ZFOLD, typename Affines>
__device__ __forceinline__ void block_mma(uint32_t Xa, uint32_t Xha, uint32_t Xb, uint32_t Xhb, const Affines& affines,
                                          const uint4* __restrict__ frag, int frag_nt_stride,
                                          const float* __restrict__ xsum_blk, int xsum_q_stride, int t,
                                          const DecodeConsts& kc, float (&acc)[NT][2]) {
  constexpr int OFF = decode_offset<BITS, MODE>();
  uint32_t ha[4], hb[4];
  decode_inner_q<BITS, OFF>(Xa, Xha, kc, ha);
  decode_inner_q<BITS, OFF>(Xb, Xhb, kc, hb);
  const uint32_t A0[4] = {ha[0], hb[0], ha[1], hb[1]};  // k-step 0: pairs P0, P1 of rows g and g + 8
  const uint32_t A1[4] = {ha[2], hb[2], ha[3], hb[3]};  // k-step 1: pairs P2, P3
  const AffinePair f = affines();
  const GroupAffine fa = f.a, fb = f.b;
  const float zero[4] = {0.f, 0.f, 0.f, 0.f};
  if constexpr (kdup<NT>()) {
    const uint4 H = frag[0], L = frag[frag_nt_stride];
    const uint32_t H0[2] = {H.x, H.y}, H1[2] = {H.z, H.w}, L0[2] = {L.x, L.y}, L1[2] = {L.z, L.w};
    float d[4];
    mma_m16n8k16(d, A0, H0, zero);
    mma_m16n8k16(d, A1, H1, d);
    mma_m16n8k16(d, A0, L0, d);
    mma_m16n8k16(d, A1, L1, d);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {  // d[nt]: row g, query row 2t + nt; d[2 + nt]: row g + 8
      if constexpr (MODE == QuantMode::kSym || !ZFOLD) {
        acc[nt][0] = fmaf(fa.s, d[nt], acc[nt][0]);
        acc[nt][1] = fmaf(fb.s, d[2 + nt], acc[nt][1]);
      } else {
        const float xs = xsum_blk[(2 * t + nt) * xsum_q_stride];
        acc[nt][0] = fmaf(fa.s, d[nt], fmaf(fa.zeff, xs, acc[nt][0]));
        acc[nt][1] = fmaf(fb.s, d[2 + nt], fmaf(fb.zeff, xs, acc[nt][1]));
      }
    }
    return;
  }
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const uint4 B = frag[nt * frag_nt_stride];
    const uint32_t B0[2] = {B.x, B.y}, B1[2] = {B.z, B.w};
    float d[4];
    mma_m16n8k16(d, A0, B0, zero);
    mma_m16n8k16(d, A1, B1, d);
    // d = (row g: query t hi, lo; row g + 8: query t hi, lo)
    if constexpr (MODE == QuantMode::kSym || !ZFOLD) {
      acc[nt][0] = fmaf(fa.s, d[0] + d[1], acc[nt][0]);
      acc[nt][1] = fmaf(fb.s, d[2] + d[3], acc[nt][1]);
    } else {
      const float xs = xsum_blk[(4 * nt + t) * xsum_q_stride];
      acc[nt][0] = fmaf(fa.s, d[0] + d[1], fmaf(fa.zeff, xs, acc[nt][0]));
      acc[nt][1] = fmaf(fb.s, d[2] + d[3], fmaf(fb.zeff, xs, acc[nt][1]));
    }
  }
}

// ---- the zero-point term of a chunk on the tensor cores ----------------------------------------------------------------
// sum over the chunk's 4 blocks j of zeff_j * xsum_j (per row and query row) is one m16n8k16 MMA: k-slot j holds
// the block's stored zero (asym groups) and k-slot 8 + j the negated scale -|s_j| (hybrid's sym groups, whose zeff is
// -|s| 2^(b-1)); B holds xsum_j 2^-kZeroShift in slot j and xsum_j 2^(b-1-kZeroShift) in slot 8 + j (hi / lo columns,
// as the main B). Both A entries are fp16 values the store holds exactly, so the only rounding is B's hi/lo split
// (~2^-22) and the fp32 accumulation. Thread t supplies slots 2t, 2t + 1 (8 + ...): blocks 2 (t & 1) + {0, 1};
// threads t >= 2 duplicate them, and B is zero in their slots.
constexpr int kZeroShift = 9;  // xsum <= 32 * 2^15 = 2^20 after the prescale; x 2^(3 - 9) stays below fp16's max

struct ZeroA {
  uint32_t z;  // (zeff of block jj, block jj + 1) as an fp16 pair, asym groups (0 for hybrid's sym groups)
  uint32_t s;  // -|s| pair for hybrid's sym groups (0 for asym groups, and always 0 in asym mode)
};

// sp, zp: the fp16 scales and zeros of the two blocks, each as one pair (low half = the first block).
template <QuantMode MODE>
__device__ __forceinline__ ZeroA zero_a_pair(uint32_t sp, uint32_t zp) {
  if constexpr (MODE == QuantMode::kAsym) {
    return {zp, 0u};
  } else {
    const uint32_t asym = prmt(sp, 0u, 0xBB99u);  // 0xffff in each half whose scale has the sign bit (asym group)
    return {zp & asym, lop3<0x54>(sp, 0x80008000u, asym)};  // (s | sign) & ~asym: -|s| for sym groups
  }
}

// kdup: zfrag's two "n-tiles" are the hi and lo halves of the 8 query rows, both into zacc[0] (zacc[1] stays 0).
template <int NT>
__device__ __forceinline__ void zero_mma(const ZeroA& a, const ZeroA& b, const uint2* __restrict__ zfrag,
                                         int zfrag_nt_stride, float (&zacc)[NT][4]) {
  const uint32_t A[4] = {a.z, b.z, a.s, b.s};
  if constexpr (kdup<NT>()) {
    const uint2 H = zfrag[0], L = zfrag[zfrag_nt_stride];
    const uint32_t Hf[2] = {H.x, H.y}, Lf[2] = {L.x, L.y};
    mma_m16n8k16(zacc[0], A, Hf, zacc[0]);
    mma_m16n8k16(zacc[0], A, Lf, zacc[0]);
    return;
  }
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const uint2 B = zfrag[nt * zfrag_nt_stride];
    const uint32_t Bf[2] = {B.x, B.y};
    mma_m16n8k16(zacc[nt], A, Bf, zacc[nt]);
  }
}

// Row pointers of one thread's two rows (g and g + 8 of a 16-row tile). A row past the end of M points at the last
// row instead (its results are never stored), so every load is unconditional. z points at the thread's zero pair
// (group of block 2 (t & 1) at G = 32; the group base otherwise).
struct RowPair {
  const uint32_t* c[2];
  const uint16_t* s[2];
  const uint16_t* z[2];
};

// Everything one main-loop step needs besides the rows.
struct ChunkCtx {
  const uint4* frag;   // B fragments of the step's first block, this lane
  const uint2* zfrag;  // zero-MMA B fragment of the step, this lane
  int frag_nt_stride, zfrag_nt_stride;
  int t, jj;  // jj = 2 (t & 1): the thread's block pair in the zero MMA
  uint32_t sel_lo, sel_hi;
};

// The fp16 scale of block j (0 or 1) of a stored pair (low half = block 0) as a float; hybrid's |s| (its sign bit flags
// an asym group). On the device one HADD2.F32 with a half selector and an |.| modifier: no shift, no mask.
template <QuantMode MODE>
__device__ __forceinline__ float pair_scale(uint32_t pair, int j) {
#if defined(__CUDA_ARCH__)
  __half2 h;
  memcpy(&h, &pair, sizeof(h));
  const float s = j == 0 ? __low2float(h) : __high2float(h);
#else
  const float s = half_bits_to_float(static_cast<uint16_t>(pair >> (16 * j)));
#endif
  return MODE == QuantMode::kHybrid ? fabsf(s) : s;
}

// The fp16 scales of a step's kChunkBlocks blocks for its two rows (0: row g, 1: row g + 8): scale(i, j) is block j's
// as a float (|s| in hybrid), pair(i, hi) blocks 2 hi and 2 hi + 1 as an fp16 pair (zero_a_pair).
// Apart: as the register path loads them, one 2-byte load each.
template <QuantMode MODE, int BITS>
struct ScalesApart {
  uint16_t s[2][kChunkBlocks];
  __device__ __forceinline__ float scale(int i, int j) const { return group_affine<MODE, BITS>(s[i][j], 0).s; }
  __device__ __forceinline__ uint32_t pair(int i, bool hi) const {
    return prmt(hi ? s[i][2] : s[i][0], hi ? s[i][3] : s[i][1], 0x5410u);
  }
};
// Pairs: as the ring holds them (a row's 4 scales are one 8-byte piece), converted by half (pair_scale): no mask, no
// shift, no PRMT for the zero MMA (2 hybrid at 8 rows: 245 -> 221 instructions a key tile).
template <QuantMode MODE, int BITS>
struct ScalePairs {
  uint32_t p[2][2];
  __device__ __forceinline__ float scale(int i, int j) const { return pair_scale<MODE>(p[i][j >> 1], j & 1); }
  __device__ __forceinline__ uint32_t pair(int i, bool hi) const { return hi ? p[i][1] : p[i][0]; }
};

// The arithmetic of one main-loop step: kChunkBlocks blocks of the two rows, given their raw words, the blocks' scales
// sc (ScalesApart or ScalePairs) and (modes with zeros) the packed zero pairs za / zb of blocks jj, jj + 1
// (zero_a_pair).
template <int BITS, QuantMode MODE, int NT, bool VEC, typename Scales>
__device__ __forceinline__ void chunk_compute(const ChunkWords<BITS, VEC>& wa, const ChunkWords<BITS, VEC>& wb,
                                              const Scales& sc, uint32_t za, uint32_t zb, const ChunkCtx& x,
                                              const DecodeConsts& kc, float (&acc)[NT][2], float (&zacc)[NT][4]) {
  if constexpr (MODE != QuantMode::kSym) {
    const bool hi = x.jj != 0;
    const ZeroA a = zero_a_pair<MODE>(MODE == QuantMode::kAsym ? 0u : sc.pair(0, hi), za);
    const ZeroA b = zero_a_pair<MODE>(MODE == QuantMode::kAsym ? 0u : sc.pair(1, hi), zb);
    zero_mma<NT>(a, b, x.zfrag, x.zfrag_nt_stride, zacc);
  }
#pragma unroll
  for (int j = 0; j < kChunkBlocks; ++j) {
    uint32_t Xa, Xha = 0, Xb, Xhb = 0;
    gather_chunk(wa, j, x.sel_lo, x.sel_hi, Xa, Xha);
    gather_chunk(wb, j, x.sel_lo, x.sel_hi, Xb, Xhb);
    const auto affines = [&] { return AffinePair{{sc.scale(0, j), 0.f}, {sc.scale(1, j), 0.f}}; };
    block_mma<BITS, MODE, NT, false>(Xa, Xha, Xb, Xhb, affines, x.frag + j * 32, x.frag_nt_stride, nullptr, 0, x.t,
                                     kc, acc);
  }
}

// One main-loop step with loads to registers: kChunkBlocks blocks of the two rows. GROUP32: G = 32, the group of
// block n is n itself, so the four scales are one base pointer plus immediate offsets; otherwise
// group(n) = umulhi(n, bpg_magic) with n the absolute block index of the step's first block (blk_abs) plus j.
template <int BITS, QuantMode MODE, int NT, bool VEC, bool GROUP32>
__device__ __forceinline__ void chunk_step(const RowPair& r, uint32_t blk_abs, uint32_t bpg_magic, const ChunkCtx& x,
                                           const DecodeConsts& kc, float (&acc)[NT][2], float (&zacc)[NT][4]) {
  ChunkWords<BITS, VEC> wa, wb;
  load_chunk(wa, r.c[0], x.t);
  load_chunk(wb, r.c[1], x.t);
  ScalesApart<MODE, BITS> sc;
#pragma unroll
  for (int j = 0; j < kChunkBlocks; ++j) {
    const uint32_t gi = GROUP32 ? j : umulhi(blk_abs + j, bpg_magic);
    sc.s[0][j] = __ldg(r.s[0] + gi);
    sc.s[1][j] = __ldg(r.s[1] + gi);
  }
  uint32_t za = 0, zb = 0;
  if constexpr (MODE != QuantMode::kSym) {
    uint32_t z[2][2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint32_t gi = GROUP32 ? i : umulhi(blk_abs + x.jj + i, bpg_magic);
      z[0][i] = __ldg(r.z[0] + gi);
      z[1][i] = __ldg(r.z[1] + gi);
    }
    za = prmt(z[0][0], z[0][1], 0x5410u);
    zb = prmt(z[1][0], z[1][1], 0x5410u);
  }
  chunk_compute<BITS, MODE, NT, VEC>(wa, wb, sc, za, zb, x, kc, acc, zacc);
}

template <int BITS, QuantMode MODE, int NT, bool VEC, bool GROUP32>
__device__ __forceinline__ void chunk_loop(RowPair r, int nchunks, uint32_t blk_abs0, uint32_t bpg_magic, ChunkCtx x,
                                           const DecodeConsts& kc, float (&acc)[NT][2], float (&zacc)[NT][4]) {
#pragma unroll 1
  for (int c = 0; c < nchunks; ++c) {
    chunk_step<BITS, MODE, NT, VEC, GROUP32>(r, blk_abs0 + c * kChunkBlocks, bpg_magic, x, kc, acc, zacc);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      r.c[i] += kChunkBlocks * BITS;
      if (GROUP32) r.s[i] += kChunkBlocks;
      if (GROUP32 && MODE != QuantMode::kSym) r.z[i] += kChunkBlocks;
    }
    x.frag += kChunkBlocks * 32;
    x.zfrag += 32;
  }
}

// ---- the code ring (kvkernels/code_ring.cuh): cp.async keeps a warp's next chunks in flight ---------------------
// The first GPU run (H200) measured the loops above with L split across CTAs (the value GEMV) at 10-16 % of the fp16
// read rate, although their instruction count allows the full rate: a step's loads went out only after the previous
// step's MMAs had used their data, so a warp had one chunk (768 bytes at 3 bits) in flight. The ring's item is 16
// rows x one chunk; a thread reads its rows g and g + 8 whole from the slot (conflict-free with the padded rows).
// Needs 16-byte aligned code rows, G = 32 and 8-byte aligned scale / zero rows (ring_ok); the launcher falls back to
// the register loads otherwise.

// One warp's stream of n items through its ring: this lane's sources for the next item to copy (code pieces lane,
// lane + 32, ... of the ROWS x BITS pieces; the scales and zeros of the item's rows: at 16 rows lanes 0-15 copy the
// scales of row `lane` and lanes 16-31 the zeros of row lane - 16, at 32 rows every lane both of row `lane`), their
// offsets in a slot, and how far the sources move from one item to the next. BLOCKS: 32-value blocks per row of an
// item, 4 (a chunk: 16-byte code pieces, 8 bytes of scales per row) or 2 (keys at head_dim 64, below: 8 and 4). ROWS:
// 16 (one tile) or 32 (two consecutive tiles: keys at head_dim 64, below).
// The lane's copies: ceil(ROWS x BITS / 32) code pieces of 4 x BLOCKS bytes (a row is BITS pieces), and one piece of
// a row's 2 x BLOCKS bytes of scales or zeros (two, scales and zeros, at 32 rows with zeros).
template <int BITS, QuantMode MODE, int BLOCKS, int ROWS>
using RingStreamCopies =
    RingCopies<(ROWS * BITS + 31) / 32, 4 * BLOCKS, ROWS == 32 && MODE != QuantMode::kSym ? 2 : 1, 2 * BLOCKS>;

template <int BITS, QuantMode MODE, int BLOCKS = kChunkBlocks, int ROWS = 16>
struct RingStream : RingStreamCopies<BITS, MODE, BLOCKS, ROWS> {
  using Copies = RingStreamCopies<BITS, MODE, BLOCKS, ROWS>;
  static constexpr bool kZeros = MODE != QuantMode::kSym;
  static constexpr int kMeta = Copies::kMeta;
  static constexpr int kRow = BLOCKS == kChunkBlocks ? ring_row_bytes(BITS) : 8 * BITS + (BITS == 4 ? 16 : 0);
  static constexpr int kCode = ROWS * kRow;              // the codes, then ROWS x kMeta scales,
  static constexpr int kZeroAt = kCode + ROWS * kMeta;  // then (kZeros) ROWS x kMeta zeros
  static constexpr int kSlot = kZeroAt + (kZeros ? ROWS * kMeta : 0);
  static constexpr int kPieces = ROWS * BITS;
  // Smaller items than a chunk's take more stages: as many as the planner's 128-value ring holds, up to twice its
  // count, so that a warp keeps as many bytes in flight at head_dim 64 as at 128 (3 stages of 64 values left the
  // 2-bit key tile latency-bound in the SASS model: 15 KB in flight per SM).
  static constexpr int kWarpBytes = ring_warp_bytes(BITS, kZeros);
  static constexpr int kFit = kWarpBytes / kSlot, kTwice = 2 * ring_stages(BITS);
  static constexpr int kStages = BLOCKS == kChunkBlocks ? ring_stages(BITS) : kFit < kTwice ? kFit : kTwice;
  static_assert(ROWS == 16 || ROWS == 32, "an item is one or two 16-row tiles");
  static_assert(kSlot <= ring_slot_bytes(BITS, kZeros), "the planner sizes 128-value slots");
  static_assert(kStages >= 2 && kStages * kSlot <= kWarpBytes, "the ring fits the planner's per-warp bytes");
};

// The stream of a warp's items whose row r (0..ROWS - 1) is row min(row0 + r, last) of the (b, h_kv) slice: codes c_bh
// (at the first item's chunk), scales s_bh and zeros z_bh (at the first item's group); item k + 1 starts dc_bytes
// (codes), ds_bytes (scales) and dz_bytes (zeros) after item k.
template <int BITS, QuantMode MODE, int BLOCKS = kChunkBlocks, int ROWS = 16>
__device__ __forceinline__ RingStream<BITS, MODE, BLOCKS, ROWS> ring_stream(char* ring, int n, int64_t row0,
                                                                            int64_t last, const uint32_t* c_bh,
                                                                            int64_t c_sm, const uint16_t* s_bh,
                                                                            int64_t s_sm, const uint16_t* z_bh,
                                                                            int64_t z_sm, int64_t dc_bytes,
                                                                            int64_t ds_bytes, int64_t dz_bytes,
                                                                            int lane) {
  using Stream = RingStream<BITS, MODE, BLOCKS, ROWS>;
  Stream st;
  st.ring = ring;
  st.n = n;
#pragma unroll
  for (int k = 0; k < Stream::kCodes; ++k) {
    const int pc = lane + 32 * k, r = pc / BITS, j = pc - r * BITS;
    st.has[k] = pc < Stream::kPieces;
    st.c[k] = st.has[k] ? reinterpret_cast<const char*>(c_bh + min(row0 + r, last) * c_sm) + Stream::kPiece * j
                        : nullptr;
    st.o[k] = r * Stream::kRow + Stream::kPiece * j;
  }
  st.dc = dc_bytes;
  if constexpr (ROWS == 16) {
    const int64_t r = min(row0 + (lane & 15), last);
    if (lane < 16) {
      st.hasm[0] = true;
      st.m[0] = reinterpret_cast<const char*>(s_bh + r * s_sm);
      st.om[0] = Stream::kCode + Stream::kMeta * lane;
      st.dm[0] = ds_bytes;
    } else {
      st.hasm[0] = Stream::kZeros;
      st.m[0] = st.hasm[0] ? reinterpret_cast<const char*>(z_bh + r * z_sm) : nullptr;
      st.om[0] = Stream::kZeroAt + Stream::kMeta * (lane - 16);
      st.dm[0] = dz_bytes;
    }
  } else {
    const int64_t r = min(row0 + lane, last);
    st.hasm[0] = true;
    st.m[0] = reinterpret_cast<const char*>(s_bh + r * s_sm);
    st.om[0] = Stream::kCode + Stream::kMeta * lane;
    st.dm[0] = ds_bytes;
    if constexpr (Stream::kMetas == 2) {
      st.hasm[1] = true;
      st.m[1] = reinterpret_cast<const char*>(z_bh + r * z_sm);
      st.om[1] = Stream::kZeroAt + Stream::kMeta * lane;
      st.dm[1] = dz_bytes;
    }
  }
  return st;
}

// Rows g and g + 8 of an item's codes from its slot, in the register path's word layouts (every word at 1-3 bits, word
// 4j + t of block j at 4 bits): BLOCKS 32-value blocks per row, read in the pieces they were copied in (16 bytes for a
// chunk, 8 for keys at head_dim 64).
template <int BITS, QuantMode MODE, int BLOCKS>
__device__ __forceinline__ void slot_rows(const char* slot, int g, int t, ChunkWords<BITS, BITS != 4>& wa,
                                          ChunkWords<BITS, BITS != 4>& wb) {
  constexpr int kRow = RingStream<BITS, MODE, BLOCKS>::kRow;
  const char* ra = slot + g * kRow;
  const char* rb = ra + 8 * kRow;
  if constexpr (BITS == 4) {
#pragma unroll
    for (int j = 0; j < BLOCKS; ++j) {
      wa.w[j] = *reinterpret_cast<const uint32_t*>(ra + 4 * (4 * j + t));
      wb.w[j] = *reinterpret_cast<const uint32_t*>(rb + 4 * (4 * j + t));
    }
  } else {
    using Piece = std::conditional_t<BLOCKS == kChunkBlocks, uint4, uint2>;
#pragma unroll
    for (int i = 0; i < BITS; ++i) {
      const Piece va = *reinterpret_cast<const Piece*>(ra + sizeof(Piece) * i);
      const Piece vb = *reinterpret_cast<const Piece*>(rb + sizeof(Piece) * i);
      memcpy(&wa.w[BLOCKS * i], &va, sizeof(Piece));
      memcpy(&wb.w[BLOCKS * i], &vb, sizeof(Piece));
    }
  }
}

// One item from its slot: the two rows' words (the register path's layouts: every word at 1-3 bits, word 4j + t of
// block j at 4 bits), scales, zero pairs; then the step's arithmetic.
template <int BITS, QuantMode MODE, int NT>
__device__ __forceinline__ void ring_compute(const char* slot, int g, const ChunkCtx& x, const DecodeConsts& kc,
                                             float (&acc)[NT][2], float (&zacc)[NT][4]) {
  using Stream = RingStream<BITS, MODE>;
  constexpr int kCode = Stream::kCode;
  constexpr bool kWide = BITS != 4;
  ChunkWords<BITS, kWide> wa, wb;
  slot_rows<BITS, MODE, kChunkBlocks>(slot, g, x.t, wa, wb);
  const uint2 sva = *reinterpret_cast<const uint2*>(slot + kCode + 8 * g);
  const uint2 svb = *reinterpret_cast<const uint2*>(slot + kCode + 8 * (g + 8));
  const ScalePairs<MODE, BITS> sc{{{sva.x, sva.y}, {svb.x, svb.y}}};
  uint32_t za = 0, zb = 0;
  if constexpr (MODE != QuantMode::kSym) {
    za = *reinterpret_cast<const uint32_t*>(slot + Stream::kZeroAt + 8 * g + 2 * x.jj);
    zb = *reinterpret_cast<const uint32_t*>(slot + Stream::kZeroAt + 8 * (g + 8) + 2 * x.jj);
  }
  chunk_compute<BITS, MODE, NT, kWide>(wa, wb, sc, za, zb, x, kc, acc, zacc);
}

// ---- keys at head_dim 64: a 64-value ring item ----------------------------------------------------------------------
// L = 64 is two blocks, half a chunk: no main-loop step, so without this the key GEMV of a head_dim-64 model walked
// the tail loop, one block of 32-bit loads in flight per warp. An item is a whole 16-row tile, or two consecutive
// ones (ring64_rows): the codes as 8-byte pieces (8 x BITS bytes per row), each row's two G = 32 scales (zeros) as one
// 4-byte piece; the zero term is one zero MMA per tile in the two-tile kernel (kLoadRing64, below 4 bits), and folds
// per block in fp32 as in the tail (block_mma<ZFOLD>) in the one-tile items of kLoadRing. 4-bit rows are padded to 48
// bytes so the 8 rows a warp reads at once (thread t: word 4j + t) fall in distinct banks; the other widths' rows (8,
// 16, 24 bytes) already do. The stream is RingStream<BITS, MODE, 2, ROWS>.

// Rows per item: two tiles below 4 bits. A 16-row tile is ~45 instructions of fixed work per warp (the ring's copies
// behind a divergent branch, the loop, the slot rotation) over half a chunk's bytes, which kept the 1-3-bit tiles at
// 11-21 instructions per byte in the SASS model; two tiles share it. 4 bits stay at one (within the budget already;
// two would be 128 code pieces, 4 copies a lane, and a 1.8 KB slot).
template <int BITS>
__host__ __device__ constexpr int ring64_rows() {
  return BITS == 4 ? 16 : 32;
}

// Keys at head_dim 64 in the two-tile kernel (kLoadRing64): the zero term as one zero MMA per tile (ring64_compute's
// ZMMA), or folded per block in fp32. At 8 query rows (kdup) the zero MMA adds 2 MMAs to a tile's 8; before sm_90
// (A100, Orin: an m16n8k16 every 4 clocks per SM in the SASS model, H100 every 2) the 1- and 2-bit 8-row tiles are
// bound by the MMAs there, and with it 1 asym on sm_87 went 16.0 -> 18.0 weighted instructions per byte, 2 asym
// 11.2 -> 13.3: they fold.
template <int NT>
__host__ __device__ constexpr bool l64_zero_mma() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  return !kdup<NT>();
#else
  return true;
#endif
}

// Tile h (rows 16 h + g and 16 h + g + 8) of an item from its slot, blocks 0 and 1 (the register path's word
// layouts). ZMMA (the kLoadRing64 kernel, l64_zero_mma): the zero term of both blocks is one zero MMA (zero_steps:
// x.zfrag is the L = 64 step's fragment), as a chunk's in the 128-value loops; folded per block in fp32 it cost each
// of a quad's 4 threads a zero's conversion, the hybrid select and 2 FFMAs per query slot for every (row, block): 2
// hybrid at 8 rows 292 -> 258 instructions an item. Otherwise it folds per block: 8 rows before sm_90
// (l64_zero_mma), and kLoadRing's one-tile items (4 bits, KVKERNELS_GEMV_RING64=0), so that that kernel's 128-value
// loops keep their register allocation (ptxas moved them by up to +0.6).
template <int BITS, QuantMode MODE, int NT, int ROWS, bool ZMMA>
__device__ __forceinline__ void ring64_compute(const char* slot, int h, int g, const ChunkCtx& x, const float* xsum,
                                               const DecodeConsts& kc, float (&acc)[NT][2], float (&zacc)[NT][4]) {
  using Stream = RingStream<BITS, MODE, 2, ROWS>;
  constexpr bool kWide = BITS != 4;
  const int ra = 16 * h + g, rb = ra + 8;
  ChunkWords<BITS, kWide> wa, wb;  // blocks 0 and 1 filled (gather_chunk reads no further for j < 2)
  slot_rows<BITS, MODE, 2>(slot + 16 * h * Stream::kRow, g, x.t, wa, wb);
  const uint32_t sa = *reinterpret_cast<const uint32_t*>(slot + Stream::kCode + 4 * ra);
  const uint32_t sb = *reinterpret_cast<const uint32_t*>(slot + Stream::kCode + 4 * rb);
  uint32_t za = 0, zb = 0;
  if constexpr (MODE != QuantMode::kSym) {
    za = *reinterpret_cast<const uint32_t*>(slot + Stream::kZeroAt + 4 * ra);
    zb = *reinterpret_cast<const uint32_t*>(slot + Stream::kZeroAt + 4 * rb);
    if constexpr (ZMMA)
      zero_mma<NT>(zero_a_pair<MODE>(sa, za), zero_a_pair<MODE>(sb, zb), x.zfrag, x.zfrag_nt_stride, zacc);
  }
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    uint32_t Xa, Xha = 0, Xb, Xhb = 0;
    gather_chunk(wa, j, x.sel_lo, x.sel_hi, Xa, Xha);
    gather_chunk(wb, j, x.sel_lo, x.sel_hi, Xb, Xhb);
    if constexpr (ZMMA) {
      const auto scales = [&] {
        return AffinePair{{pair_scale<MODE>(sa, j), 0.f}, {pair_scale<MODE>(sb, j), 0.f}};
      };
      block_mma<BITS, MODE, NT, false>(Xa, Xha, Xb, Xhb, scales, x.frag + j * 32, x.frag_nt_stride, nullptr, 0, x.t,
                                       kc, acc);
    } else {
      const auto affines = [&] {
        const auto half = [j](uint32_t pair) { return static_cast<uint16_t>(pair >> (16 * j)); };
        return AffinePair{group_affine<MODE, BITS>(half(sa), half(za)), group_affine<MODE, BITS>(half(sb), half(zb))};
      };
      block_mma<BITS, MODE, NT, true>(Xa, Xha, Xb, Xhb, affines, x.frag + j * 32, x.frag_nt_stride, xsum + j, 2, x.t,
                                      kc, acc);
    }
  }
}

// Result of row g (i = 0) or g + 8 (i = 1) of the tile for query slot nt: the fp32 sums plus the zero MMA's (kdup:
// its column of the slot's row; else the sum of its hi and lo columns).
template <QuantMode MODE, int NT>
__device__ __forceinline__ float tile_result(const float (&acc)[NT][2], const float (&zacc)[NT][4], int nt, int i) {
  if constexpr (MODE == QuantMode::kSym) {
    return acc[nt][i];
  } else if constexpr (kdup<NT>()) {
    return fmaf(zacc[0][2 * i + nt], static_cast<float>(1 << kZeroShift), acc[nt][i]);
  } else {
    return fmaf(zacc[nt][2 * i] + zacc[nt][2 * i + 1], static_cast<float>(1 << kZeroShift), acc[nt][i]);
  }
}

template <int NT>
__device__ __forceinline__ void zero_tile(float (&acc)[NT][2], float (&zacc)[NT][4]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = zacc[nt][0] = zacc[nt][1] = zacc[nt][2] = zacc[nt][3] = 0.f;
}

// Epilogue of a tile: thread (g, t) writes rows ma = g (if store_a) and ma + 8 (if store_b) for query row slot_row(nt,
// t) of each slot (outq[nt] null: past the last query row), unscaled.
template <QuantMode MODE, int NT, bool kAllRows = false>
__device__ __forceinline__ void store_tile(float* const (&outq)[NT], const float (&usq)[NT], int64_t ma,
                                           const float (&acc)[NT][2], const float (&zacc)[NT][4], bool store_a,
                                           bool store_b) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    if (!kAllRows && outq[nt] == nullptr) continue;
    if (store_a) outq[nt][ma] = tile_result<MODE, NT>(acc, zacc, nt, 0) * usq[nt];
    if (store_b) outq[nt][ma + 8] = tile_result<MODE, NT>(acc, zacc, nt, 1) * usq[nt];
  }
}

template <int BITS, QuantMode MODE, int NT, int LOADS>
__global__ void __launch_bounds__(kMaxWarps * 32, kMinCtasPerSm) gemv_inner_q_kernel(const GemvInnerQParams p,
                                                                                      const InnerQLaunch k) {
  constexpr int QR = 4 * NT;  // query rows per pass
  constexpr bool kZeros = MODE != QuantMode::kSym;
  constexpr bool VEC = LOADS == kLoadVec;
  // kLoadRing64: keys at head_dim 64 (L = 64, below 4 bits), whose two-tile ring items get a kernel of their own so
  // that the other kernels' register allocation does not change with them (ptxas allocates a kernel as a whole: in
  // one kernel they moved the 128-value loops by up to +0.7 instructions per byte and added spills outside the loops)
  constexpr bool kRing64 = LOADS == kLoadRing64;
  constexpr bool kRing = LOADS == kLoadRing || kRing64;
  static_assert(!kRing64 || BITS != 4, "4-bit keys at head_dim 64 take one-tile items in the kLoadRing kernel");
  extern __shared__ __align__(16) float smem[];

  // 32-bit index math where the sizes allow: grid dims are < 2^31, 64-bit division would be a called subroutine
  const int H_kv = static_cast<int>(p.H_kv);
  const int64_t b = static_cast<int>(blockIdx.z) / H_kv, hkv = static_cast<int>(blockIdx.z) % H_kv;
  const int64_t l0 = static_cast<int64_t>(blockIdx.y) * k.split_len;
  const int len = static_cast<int>(min(k.split_len, p.L - l0));  // a multiple of 32
  const int nblk = len / 32;
  const int nchunks = len / kChunk;
  constexpr bool kZeroMma64 = kRing64 && l64_zero_mma<NT>();
  const int nzs = kRing64 ? kZeroMma64 : nchunks;  // zero-MMA steps (zero_steps: L = 64's only where it is used)
  const uint32_t blk_abs0 = static_cast<uint32_t>(l0 / 32);  // absolute block index of the split's first block

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nwarps = blockDim.x / 32;
  const int g = lane >> 2, t = lane & 3;
  // [nwarps][ring_warp_bytes] (kRing), then the query tile
  char* ring = reinterpret_cast<char*>(smem) + warp * ring_warp_bytes(BITS, kZeros);
  uint4* xfrag = reinterpret_cast<uint4*>(reinterpret_cast<char*>(smem) +
                                          (kRing ? nwarps * ring_warp_bytes(BITS, kZeros) : 0));  // [NT][nblk][32]
  uint2* zfrag = reinterpret_cast<uint2*>(xfrag + NT * nblk * 32);           // [NT][nzs][32] (zeros)
  float* xsum = reinterpret_cast<float*>(zfrag + (kZeros ? NT * nzs * 32 : 0));  // [QR][nblk] (zeros)
  float* unscale = xsum + (kZeros ? QR * nblk : 0);                          // [QR] 2^-e per query row
  unsigned* amax = reinterpret_cast<unsigned*>(unscale + QR);                // [QR] float bits of max |xs|


  const int64_t m_begin = static_cast<int64_t>(blockIdx.x) * k.rows_per_block;
  const int64_t m_end = min(p.M, m_begin + k.rows_per_block);
  const int mtiles = static_cast<int>((m_end - m_begin + 15) / 16);
  const int full_tiles = static_cast<int>((m_end - m_begin) / 16);  // tiles whose 16 rows all exist
  const float* xscale = p.x_scale == nullptr ? nullptr : p.x_scale + hkv * p.xs_sh + l0;
  // The warp's first ring stream starts before the query staging (ring_prologue): the staging reads x twice and
  // waits at three barriers, so a CTA's first items otherwise leave DRAM only after one to two round trips of it. The
  // stream is the one the first pass runs first: the keys' whole tiles from the warp's first (one_tile_items), or the
  // value GEMV's chunks of the warp's first tile (the general tiles). Keys at head_dim 64 (kRing64, nblk 2) start as
  // before.
  // (The stream's sources are made here as the tile loops make them below; kept out of the staging's live registers.)
  bool prefilled = false;
  if constexpr (kRing && !kRing64) {
    const int64_t row0 = m_begin + 16 * warp, step = 16 * nwarps;
    const uint32_t* c_bh = p.codes + b * p.c_sb + hkv * p.c_sh + l0 / 32 * BITS;
    const uint16_t* s_bh = p.scales + b * p.s_sb + hkv * p.s_sh + blk_abs0;  // the ring: G = 32 (bpg 1)
    const uint16_t* zg = kZeros ? p.zeros + b * p.z_sb + hkv * p.z_sh + blk_abs0 : nullptr;
    if (nblk == kChunkBlocks) {
      const int n = full_tiles > warp ? (full_tiles - warp + nwarps - 1) / nwarps : 0;
      if (n > 0) {
        RingStream<BITS, MODE> st = ring_stream<BITS, MODE>(ring, n, row0, m_end - 1, c_bh, p.c_sm, s_bh, p.s_sm, zg,
                                                            p.z_sm, 4 * step * p.c_sm, 2 * step * p.s_sm,
                                                            2 * step * p.z_sm, lane);
        ring_prologue(st);
        prefilled = true;
      }
    } else if (nblk != 2 && warp < mtiles) {
      RingStream<BITS, MODE> st = ring_stream<BITS, MODE>(ring, nchunks, row0, m_end - 1, c_bh, p.c_sm, s_bh, p.s_sm,
                                                          zg, p.z_sm, 16 * BITS, 8, 8, lane);
      ring_prologue(st);
      prefilled = true;
    }
  }

  for (int q0 = 0; q0 < k.qb; q0 += QR) {
    // ---- stage the query tile ------------------------------------------------------------------------------------
    __syncthreads();  // the previous tile is no longer read
    if (threadIdx.x < QR) amax[threadIdx.x] = 0u;
    // element offset of query row q of the tile; -1 past the last query row (staged as zeros)
    const auto xoff_of = [&](int q) -> int64_t {
      const int qg = q0 + q;
      return qg < k.qb ? b * p.x_sb + (hkv * k.gq + qg / k.tc) * p.x_sh + (k.t0 + qg % k.tc) * p.x_st + l0 : -1;
    };
    const auto xs_at = [&](int64_t xoff, int l) -> float {
      if (xoff < 0) return 0.f;
      const float v = load_x(p.x, p.x_dtype, xoff + l);
      return xscale == nullptr ? v : v * __ldg(xscale + l);
    };
    __syncthreads();
    // pass 1: max |xs| per query row, the row's 2^-e
    stage_row_scales<QR>(xoff_of, xs_at, len, amax, unscale, 1.f, lane);
    // pass 2: B fragments. Warp task = (n-tile, block); lane (col = g, t) holds query row 4 nt + g / 2, part g & 1
    // (kdup: query row g, part nt), values 8t + i of the block as pairs (i, i + 4).
    constexpr bool kKDup = kdup<NT>();
#pragma unroll 2  // two tasks' 8 loads each in flight together
    for (int task = warp; task < NT * nblk; task += nwarps) {
      const int nt = task / nblk, blk = task - nt * nblk;
      const int q = b_col_row(kKDup, nt, g);
      const bool lo_part = b_col_lo(kKDup, nt, g);
      const float scale = exp2i(scale_exponent(__uint_as_float(amax[q])));
      const int64_t xoff = xoff_of(q);
      uint16_t hv[8];
      float part_sum = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float v = xs_at(xoff, 32 * blk + 8 * t + i) * scale;
        part_sum += v;
        const HalfSplit sp = split_half(v);
        hv[i] = lo_part ? sp.lo : sp.hi;
      }
      xfrag[task * 32 + lane] = make_uint4(pack_half2(hv[0], hv[4]), pack_half2(hv[1], hv[5]),
                                           pack_half2(hv[2], hv[6]), pack_half2(hv[3], hv[7]));
      if constexpr (kZeros) {
        part_sum += __shfl_xor_sync(0xffffffffu, part_sum, 1);
        part_sum += __shfl_xor_sync(0xffffffffu, part_sum, 2);
        if (t == 0 && !lo_part) xsum[q * nblk + blk] = part_sum;  // one lane of the row's two
      }
    }
    if constexpr (kZeros) {
      // pass 3: the zero MMA's B fragments from xsum (slot layout: zero_a_pair)
      __syncthreads();
#pragma unroll 1
      for (int task = warp; task < NT * nzs; task += nwarps) {
        const int nt = task / nzs, c = task - nt * nzs;
        const int q = b_col_row(kKDup, nt, g);
        const bool lo_part = b_col_lo(kKDup, nt, g);
        uint2 f = make_uint2(0u, 0u);
        if (kRing64 ? t == 0 : t < 2) {  // L = 64: blocks 0 and 1, thread 0's slots
          const float* xs = xsum + q * nblk + c * kChunkBlocks + 2 * t;
          const float v0 = xs[0] * (1.f / (1 << kZeroShift)), v1 = xs[1] * (1.f / (1 << kZeroShift));
          const auto part = [&](float v) { const HalfSplit sp = split_half(v); return lo_part ? sp.lo : sp.hi; };
          f.x = pack_half2(part(v0), part(v1));
          if constexpr (MODE == QuantMode::kHybrid) {
            constexpr float m = static_cast<float>(1 << (BITS - 1));
            f.y = pack_half2(part(v0 * m), part(v1 * m));
          }
        }
        zfrag[task * 32 + lane] = f;
      }
    }
    __syncthreads();

    // ---- 16-row tiles ---------------------------------------------------------------------------------------------
    // this thread's output pointers (query row slot_row(nt, t) of each slot) and unscale factors for the whole pass
    float* outq[NT];
    float usq[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int qg = q0 + slot_row(kKDup, nt, t);
      outq[nt] = nullptr;
      usq[nt] = unscale[slot_row(kKDup, nt, t)];
      if (qg < k.qb)
        outq[nt] = k.out.base + blockIdx.y * k.out.s_split + b * k.out.sb + (hkv * k.gq + qg / k.tc) * k.out.sh +
                   (qg % k.tc) * k.out.st;
    }
    const DecodeConsts& kc = k.dec;
    ChunkCtx cx;
    cx.frag = xfrag + lane;
    cx.zfrag = zfrag + lane;
    cx.frag_nt_stride = nblk * 32;
    cx.zfrag_nt_stride = nzs * 32;
    cx.t = t;
    cx.jj = 2 * (t & 1);
    cx.sel_lo = sel_bytes(2 * t, 2 * t + 1);
    cx.sel_hi = sel_bytes(t, t);
    // base pointers of the (b, h_kv) slice at the split's first block; z at the thread's zero pair (G = 32)
    const uint32_t* c_bh = p.codes + b * p.c_sb + hkv * p.c_sh + l0 / 32 * BITS;
    const uint16_t* s_bh = p.scales + b * p.s_sb + hkv * p.s_sh + (k.bpg == 1 ? blk_abs0 : 0);
    const uint16_t* z_bh =
        kZeros ? p.zeros + b * p.z_sb + hkv * p.z_sh + (k.bpg == 1 ? blk_abs0 + cx.jj : 0) : nullptr;
    const auto rows_at = [&](int64_t ra, int64_t rb) {
      RowPair r;
      r.c[0] = c_bh + ra * p.c_sm, r.c[1] = c_bh + rb * p.c_sm;
      r.s[0] = s_bh + ra * p.s_sm, r.s[1] = s_bh + rb * p.s_sm;
      r.z[0] = kZeros ? z_bh + ra * p.z_sm : nullptr;
      r.z[1] = kZeros ? z_bh + rb * p.z_sm : nullptr;
      return r;
    };
    const uint16_t* zg = kZeros ? z_bh - cx.jj : nullptr;  // the ring's zero rows: the group base (z_bh is the pair)
    const int64_t step = 16 * nwarps;
    int mt = warp;
    int64_t ma = m_begin + 16 * warp + g;  // row g of the warp's current tile

    // Keys (L = 4 blocks = one step per row, G = 32): the tile loop itself is the hot loop. Whole tiles only, with
    // pointers advanced by a fixed stride; a last partial tile goes to the general loop below.
    if constexpr (kRing) {
      // the ring's item is ROWS / 16 consecutive whole tiles of BLOCKS 32-value blocks per row: one tile of 4 (L =
      // 128), or ring64_rows of 2 (L = 64, keys at head_dim 64); kRing implies G = 32. The warp's n items start at its
      // tile mt and advance by that many tiles per warp. compute(slot, h, acc, zacc) adds tile h's products.
      // all_rows (std::true_type): the pass has no query rows past the last (every q_len-1 decode at GQA 4 or 8), so
      // the stores skip that check. The callers take it for modes with zero points only (unchecked): there ptxas
      // made the check branches with convergence barriers (BSSY / BSYNC) around the epilogue, the zero MMA's fold
      // sunk into them (2 hybrid at 8 rows: 258 -> 239 instructions an item at L = 64, 221 -> 203 a tile at L = 128);
      // sym's stores were predicated already, and a second loop there only moved the allocation (2 sym at 8 rows,
      // L = 64: +3).
      const bool unchecked = kZeros && q0 + QR <= k.qb;
      const auto ring_tiles = [&](auto blocks, auto rows, int n, const auto& compute, auto all_rows) {
        constexpr int BLOCKS = decltype(blocks)::value, ROWS = decltype(rows)::value, kTiles = ROWS / 16;
        RingStream<BITS, MODE, BLOCKS, ROWS> st = ring_stream<BITS, MODE, BLOCKS, ROWS>(
            ring, n, ma - g, m_end - 1, c_bh, p.c_sm, s_bh, p.s_sm, zg, p.z_sm, 4 * kTiles * step * p.c_sm,
            2 * kTiles * step * p.s_sm, 2 * kTiles * step * p.z_sm, lane);
        run_ring(
            st,
            [&](int, const char* slot) {
#pragma unroll
              for (int h = 0; h < kTiles; ++h) {
                float acc[NT][2], zacc[NT][4];
                zero_tile(acc, zacc);
                compute(slot, h, acc, zacc);
                store_tile<MODE, NT, decltype(all_rows)::value>(outq, usq, ma + 16 * h, acc, zacc, true, true);
              }
              ma += kTiles * step;
            },
            prefilled);
        prefilled = false;
      };
      // items of one tile: the warp's share of the full tiles from mt on (mt = warp + a multiple of nwarps)
      const auto one_tile_items = [&](auto blocks, const auto& compute, auto all_rows) {
        const int n = full_tiles > mt ? (full_tiles - mt + nwarps - 1) / nwarps : 0;
        ring_tiles(blocks, std::integral_constant<int, 16>{}, n, compute, all_rows);
        mt += n * nwarps;
      };
      const auto l64_compute = [&](auto rows) {
        return [&](const char* slot, int h, auto& acc, auto& zacc) {
          ring64_compute<BITS, MODE, NT, decltype(rows)::value, kZeroMma64>(slot, h, g, cx, xsum, kc, acc, zacc);
        };
      };
      if constexpr (kRing64) {  // the launcher's L = 64 (nblk == 2)
        // tile pairs while every warp gets the same number of them (warp w: tiles 2 w, 2 w + 1, then 2 (w + nwarps),
        // ...); the rest one tile per item, so that short stores still spread over every warp
        using Pair = std::integral_constant<int, 32>;
        const int pairs = full_tiles / (2 * nwarps);
        if (pairs > 0) {
          mt = 2 * warp, ma = m_begin + 16 * mt + g;
          if (unchecked)
            ring_tiles(std::integral_constant<int, 2>{}, Pair{}, pairs, l64_compute(Pair{}), std::true_type{});
          else
            ring_tiles(std::integral_constant<int, 2>{}, Pair{}, pairs, l64_compute(Pair{}), std::false_type{});
          mt = 2 * pairs * nwarps + warp, ma = m_begin + 16 * mt + g;
        }
        one_tile_items(std::integral_constant<int, 2>{}, l64_compute(std::integral_constant<int, 16>{}),
                       std::false_type{});
      } else if (nblk == kChunkBlocks) {
        const auto compute = [&](const char* slot, int, auto& acc, auto& zacc) {
          ring_compute<BITS, MODE, NT>(slot, g, cx, kc, acc, zacc);
        };
        if (unchecked)
          one_tile_items(std::integral_constant<int, kChunkBlocks>{}, compute, std::true_type{});
        else
          one_tile_items(std::integral_constant<int, kChunkBlocks>{}, compute, std::false_type{});
      } else if (nblk == 2) {
        // keys at head_dim 64 in one-tile items: 4 bits (ring64_rows), and the others under KVKERNELS_GEMV_RING64=0
        one_tile_items(std::integral_constant<int, 2>{}, l64_compute(std::integral_constant<int, 16>{}),
                       std::false_type{});
      }
    } else if (nblk == kChunkBlocks && k.bpg == 1) {
      RowPair r = rows_at(ma, ma + 8);
      const int64_t dc = step * p.c_sm, ds = step * p.s_sm, dz = step * p.z_sm;
#pragma unroll 1
      for (; mt < full_tiles; mt += nwarps, ma += step) {
        float acc[NT][2], zacc[NT][4];
        zero_tile(acc, zacc);
        chunk_step<BITS, MODE, NT, VEC, true>(r, blk_abs0, 0u, cx, kc, acc, zacc);
        store_tile<MODE, NT>(outq, usq, ma, acc, zacc, true, true);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          r.c[i] += dc;
          r.s[i] += ds;
          if (kZeros) r.z[i] += dz;
        }
      }
    }

    // General tiles: any L, any G, rows past M clamped.
    const int64_t last = m_end - 1;
#pragma unroll 1
    for (; mt < mtiles; mt += nwarps, ma += step) {
      const bool ok_a = ma < m_end, ok_b = ma + 8 < m_end;
      const RowPair r = rows_at(ok_a ? ma : last, ok_b ? ma + 8 : last);
      float acc[NT][2], zacc[NT][4];
      zero_tile(acc, zacc);
      if constexpr (kRing64) {
        // L = 64: no whole chunk; the tail below
      } else if constexpr (kRing) {
        RingStream<BITS, MODE> st = ring_stream<BITS, MODE>(ring, nchunks, ma - g, last, c_bh, p.c_sm, s_bh, p.s_sm,
                                                            zg, p.z_sm, 16 * BITS, 8, 8, lane);
        ChunkCtx x = cx;  // at the step's fragments, as chunk_loop advances them
        run_ring(
            st,
            [&](int, const char* slot) {
              ring_compute<BITS, MODE, NT>(slot, g, x, kc, acc, zacc);
              x.frag += kChunkBlocks * 32;
              x.zfrag += 32;
            },
            prefilled);
        prefilled = false;
      } else if (k.bpg == 1) {
        chunk_loop<BITS, MODE, NT, VEC, true>(r, nchunks, blk_abs0, k.bpg_magic, cx, kc, acc, zacc);
      } else {
        chunk_loop<BITS, MODE, NT, VEC, false>(r, nchunks, blk_abs0, k.bpg_magic, cx, kc, acc, zacc);
      }
      // the row's last len % 128 values, block by block, zero term folded in fp32
      const uint16_t* z0 = kZeros ? r.z[0] - (k.bpg == 1 ? cx.jj : 0) : nullptr;
      const uint16_t* z1 = kZeros ? r.z[1] - (k.bpg == 1 ? cx.jj : 0) : nullptr;
#pragma unroll 1
      for (int blk = nchunks * kChunkBlocks; blk < nblk; ++blk) {
        const uint32_t gi = k.bpg == 1 ? blk : umulhi(blk_abs0 + blk, k.bpg_magic);
        uint32_t Xa, Xha, Xb, Xhb;
        load_gather_block<BITS>(r.c[0] + blk * BITS, t, cx.sel_lo, cx.sel_hi, Xa, Xha);
        load_gather_block<BITS>(r.c[1] + blk * BITS, t, cx.sel_lo, cx.sel_hi, Xb, Xhb);
        const uint16_t za = kZeros ? __ldg(z0 + gi) : uint16_t{0};
        const uint16_t zb = kZeros ? __ldg(z1 + gi) : uint16_t{0};
        const auto affines = [&] {
          return AffinePair{group_affine<MODE, BITS>(__ldg(r.s[0] + gi), za),
                            group_affine<MODE, BITS>(__ldg(r.s[1] + gi), zb)};
        };
        block_mma<BITS, MODE, NT, true>(Xa, Xha, Xb, Xhb, affines, cx.frag + blk * 32, nblk * 32, xsum + blk, nblk, t,
                                        kc, acc);
      }
      // epilogue: thread (g, t) holds rows g and g + 8 of the tile for query row slot_row(nt, t) of each slot
      store_tile<MODE, NT>(outq, usq, ma, acc, zacc, ok_a, ok_b);
    }
  }
}

// ---- kernel selection and planning -------------------------------------------------------------------------------
using InnerQKernel = void (*)(const GemvInnerQParams, const InnerQLaunch);

template <int BITS, QuantMode MODE, int NT>
InnerQKernel inner_q_kernel(int loads) {
  if (loads == kLoadRing) return gemv_inner_q_kernel<BITS, MODE, NT, kLoadRing>;
  if constexpr (BITS != 4) {  // 4 bits reads one word per block and lane: no register vector form
    if (loads == kLoadRing64) return gemv_inner_q_kernel<BITS, MODE, NT, kLoadRing64>;
    if (loads == kLoadVec) return gemv_inner_q_kernel<BITS, MODE, NT, kLoadVec>;
  }
  return gemv_inner_q_kernel<BITS, MODE, NT, kLoadWords>;
}

cudaError_t select_inner_q_kernel(int bits, QuantMode mode, int nt, int loads, InnerQKernel* fn) {
  KVK_DISPATCH_BITS(bits, BITS, {
    KVK_DISPATCH_MODE(mode, MODE, { KVK_DISPATCH_NTILES(nt, NT, { *fn = inner_q_kernel<BITS, MODE, NT>(loads); }) })
  })
  return cudaSuccess;
}

struct InnerQPlan {
  int loads;                 // kLoadWords / kLoadVec / kLoadRing / kLoadRing64
  int nt;                    // n-tiles: 4 query rows each
  int threads;               // 32 x warps
  int64_t t_chunk;           // query rows per head per launch
  int64_t split_len;         // L values per split
  int64_t num_splits;        // CTAs along L
  int64_t rows_per_block;    // M rows per CTA
  int64_t row_blocks;        // CTAs along M
  size_t smem_bytes;         // dynamic shared memory
  int64_t workspace_floats;  // split-K workspace (0 without split)
  int ctas_per_sm;           // resident CTAs per SM (occupancy), for the record
  InnerQKernel fn;
  const char* error;         // non-null: unsupported configuration
};

// Wide code loads (16-byte vectors, the ring's 16- or 8-byte pieces) need code rows aligned to their width.
bool codes_aligned(const GemvInnerQParams& p, int64_t align) {
  return rows_aligned(p.codes, align, sizeof(uint32_t), p.B, p.c_sb, p.H_kv, p.c_sh, p.M, p.c_sm);
}

// The ring copies each row's four scales (and zeros) of a chunk as one 8-byte piece: G = 32, and every scale / zero
// row of every (b, h_kv) 8-byte aligned (chunks start at multiples of 4 groups).
// Keys at head_dim 64 (L = 64): 8-byte code pieces and 4-byte scale / zero pieces, so 8- and 4-byte aligned rows.
bool ring_ok(const GemvInnerQParams& p) {
  const bool l64 = p.L == 64;
  const int64_t meta_align = l64 ? 4 : 8;
  const auto meta_ok = [&](const uint16_t* base, int64_t sb, int64_t sh, int64_t sm) {
    return rows_aligned(base, meta_align, sizeof(uint16_t), p.B, sb, p.H_kv, sh, p.M, sm);
  };
  const bool codes_ok = l64 ? codes_aligned(p, 8) : p.L >= kChunk && codes_aligned(p, 16);
  return codes_ok && p.group_size == 32 && meta_ok(p.scales, p.s_sb, p.s_sh, p.s_sm) &&
         (p.mode == QuantMode::kSym || meta_ok(p.zeros, p.z_sb, p.z_sh, p.z_sm));
}

InnerQPlan plan_inner_q(const GemvInnerQParams& p) {
  InnerQPlan pl{};
  const int64_t gq = p.H_q / p.H_kv;
  pl.t_chunk = std::min<int64_t>(p.T, kMaxTPerLaunch);
  const int64_t qb = gq * pl.t_chunk;
  pl.nt = qb <= 4 ? 1 : 2;  // more query rows loop over 8-row passes in the CTA
  const bool ring_l64 = p.L == 64 && p.bits != 4 && !gemv_ring64_disabled();  // two-tile items, their own kernel
  pl.loads = ring_ok(p) && !gemv_ring_disabled()                        ? (ring_l64 ? kLoadRing64 : kLoadRing)
             : p.bits != 4 && p.L >= kChunk && codes_aligned(p, 16) ? kLoadVec
                                                                    : kLoadWords;
  const bool ring = pl.loads == kLoadRing || pl.loads == kLoadRing64;
  if (select_inner_q_kernel(p.bits, p.mode, pl.nt, pl.loads, &pl.fn) != cudaSuccess) {
    pl.error = "unsupported bits / mode";
    return pl;
  }
  const int64_t mt = ceil_div(std::max<int64_t>(p.M, 1), 16);  // 16-row tiles per (b, h_kv)
  const int warps = static_cast<int>(std::min<int64_t>(kMaxWarps, mt));
  pl.threads = 32 * warps;
  // the ring's slots come first; the query tile gets the rest of the 48 KiB a CTA may use without an opt-in
  const size_t ring_bytes =
      ring ? static_cast<size_t>(warps) * ring_warp_bytes(p.bits, p.mode != QuantMode::kSym) : 0;
  const size_t budget = ring ? kCtaSmem - ring_bytes : kSmemBudget;
  const int occ = resident_ctas_per_sm(reinterpret_cast<const void*>(pl.fn), pl.threads, ring_bytes + budget);
  pl.ctas_per_sm = occ;
  const int64_t wave = static_cast<int64_t>(occ) * std::max(p.num_sms, 1);
  const int64_t bh = p.B * p.H_kv;

  // longest split the shared-memory budget allows (whole chunks), and the split from the wave rule
  int64_t max_len = kChunk;
  while (stage_bytes(max_len + kChunk, pl.nt, p.mode) <= budget) max_len += kChunk;
  if (stage_bytes(std::min<int64_t>(p.L, max_len), pl.nt, p.mode) > budget) {
    pl.error = "query tile too large for shared memory";
    return pl;
  }
  const bool v1 = gemv_planner_v1();
  const int64_t min_split = v1 ? kMinSplitValuesV1 : kMinSplitValues;
  const int64_t rb1 = ceil_div(mt, warps);  // CTAs per (b, h_kv) with one tile per warp
  if (v1) {  // the first GPU run's rule: ceil(wave / CTAs) splits when the grid is under a wave
    pl.split_len = p.L <= max_len ? p.L : max_len;
    if (bh * rb1 * ceil_div(p.L, pl.split_len) < wave && p.L > min_split) {
      const int64_t want = ceil_div(wave, bh * rb1);  // splits for one wave
      const int64_t len = round_up(std::max(ceil_div(p.L, want), min_split), kChunk);
      if (len < pl.split_len) pl.split_len = len;
    }
  } else {  // whole waves (gemv.cuh); a CTA's fixed work (query staging, the ring's first copies) ~2 chunks
    pl.split_len = wave_split_len(p.L, kChunk, min_split, max_len, bh * rb1, wave, 2);
  }
  pl.num_splits = ceil_div(p.L, pl.split_len);
  // rows per CTA: one tile per warp, doubled while the doubled grid still fills a wave (fewer CTAs stage the query)
  // and a CTA does not yet cover every row. The first GPU run (H200, keys at batch 1) measured the CTA, not the
  // tile, as the cost: 1024 CTAs of one tile per warp took 25 us (16k tokens), 1024 of two 29 us (32k); the rule
  // was "two waves" then. Without the second condition, (b, h_kv) x splits alone filling the waves (values at batch 8
  // x 32k tokens) doubled the count until it overflowed to 0: SIGFPE in ceil_div.
  int64_t tiles_per_warp = 1;
  const int64_t fill = v1 ? 2 * wave : wave;
  while (warps * tiles_per_warp < mt && bh * ceil_div(mt, warps * tiles_per_warp * 2) * pl.num_splits >= fill)
    tiles_per_warp *= 2;
  pl.rows_per_block = 16 * warps * tiles_per_warp;
  pl.row_blocks = ceil_div(std::max<int64_t>(p.M, 1), pl.rows_per_block);
  pl.smem_bytes = ring_bytes + stage_bytes(pl.split_len, pl.nt, p.mode);
  pl.workspace_floats = pl.num_splits > 1 ? pl.num_splits * p.B * p.H_q * pl.t_chunk * p.M : 0;
  if (pl.row_blocks > 0x7fffffff || pl.num_splits > 65535 || bh > 65535) pl.error = "grid too large";
  if (ceil_div(p.L, 32) * (p.group_size / 32) > 0xffffffffLL) pl.error = "L x group_size too large";
  return pl;
}

// Deterministic split-K combine: one CTA per output row (b, h, t), threads over its N values; every index fits 32
// bits except the split stride, applied as a running pointer.
__global__ void combine_splits_kernel(const float* __restrict__ ws, int splits, int H, int T, int N,
                                      int64_t split_stride, float* __restrict__ y, int64_t y_sb, int64_t y_sh,
                                      int64_t y_st) {
  const int r = blockIdx.x;  // (b * H + h) * T + t
  const int t = r % T, h = (r / T) % H, b = r / (T * H);
  const float* src = ws + static_cast<int64_t>(r) * N;
  float* dst = y + b * y_sb + h * y_sh + t * y_st;
  for (int n = threadIdx.x; n < N; n += blockDim.x) {
    float s = 0.f;
    const float* w = src + n;
    for (int sp = 0; sp < splits; ++sp, w += split_stride) s += *w;  // fixed order: deterministic
    dst[n] = s;
  }
}

}  // namespace

cudaError_t launch_combine_splits(const float* ws, int splits, int64_t B, int64_t H, int64_t T, int64_t N, float* y,
                                  int64_t y_sb, int64_t y_sh, int64_t y_st, cudaStream_t stream) {
  const int64_t rows = B * H * T;
  if (rows * N == 0) return cudaSuccess;
  if (rows > 0x7fffffff || N > 0x7fffffff) {
    set_launch_error("combine_splits: %lld rows of %lld values exceed the grid", (long long)rows, (long long)N);
    return cudaErrorInvalidValue;
  }
  const int threads = N >= 256 ? 256 : static_cast<int>(round_up(N, 32));
  combine_splits_kernel<<<static_cast<unsigned>(rows), threads, 0, stream>>>(
      ws, splits, static_cast<int>(H), static_cast<int>(T), static_cast<int>(N), rows * N, y, y_sb, y_sh, y_st);
  return cudaGetLastError();
}

bool gemv_inner_q_vector_loads(const GemvInnerQParams& p) { return plan_inner_q(p).loads != kLoadWords; }

bool gemv_inner_q_ring(const GemvInnerQParams& p) {
  const int loads = plan_inner_q(p).loads;
  return loads == kLoadRing || loads == kLoadRing64;
}

bool gemv_inner_q_ring_pairs(const GemvInnerQParams& p) { return plan_inner_q(p).loads == kLoadRing64; }

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
  const int bpg = p.group_size / 32;
  for (int64_t t0 = 0; t0 < p.T; t0 += pl.t_chunk) {
    InnerQLaunch k{};
    k.t0 = t0;
    k.tc = static_cast<int>(std::min(pl.t_chunk, p.T - t0));
    k.gq = static_cast<int>(gq);
    k.qb = static_cast<int>(gq * k.tc);
    k.split_len = pl.split_len;
    k.rows_per_block = pl.rows_per_block;
    k.bpg = bpg;
    k.bpg_magic = block_group_magic(bpg);
    k.dec = decode_consts_for(p.bits, p.mode);
    if (pl.num_splits == 1) {
      k.out = OutView{p.y + t0 * p.y_st, p.y_sb, p.y_sh, p.y_st, 0};
    } else {
      k.out = OutView{p.workspace, p.H_q * k.tc * p.M, k.tc * p.M, p.M, p.B * p.H_q * k.tc * p.M};
    }
    const InnerQKernel fn = pl.fn;
    fn<<<grid, pl.threads, pl.smem_bytes, stream>>>(p, k);
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
