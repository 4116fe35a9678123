// Store tiles of decode_attention_fused on tensor cores: tokens [S, S + F) where the key store ("rows": InnerQ keys,
// per-token groups along channels) and the value store ("cols": InnerQ values, per-channel groups along tokens) both
// hold the token, F = min(mk, mv) rounded down to 64 (decode_attention.h). decode_attention.cu runs everything else
// (sink, store edges, tails, other layouts) with its general kernel and merges both kernels' partials.
//
// CTA = (b, h_kv, row block of 4 NT query rows, split of the store tokens), 4 warps. Each warp walks its own steps of
// TOK = 64 tokens (steps w, w + 4, ... of the split) with its own online softmax, and the CTA merges the 4 warps'
// partials at the end, so no CTA barrier runs inside the step loop. Per step and warp (32-token blocks):
//   scores  S[j, r] = sum_c K[j, c] q'[r, c]: m16n8k16 MMAs with A = 16 key rows x 16 channels (codes decoded two per
//           LOP3 + HFMA2 to exact fp16 integers, mma.cuh) and B = the query rows as hi / lo fp16 pairs (4 rows: 8
//           columns = 4 rows x (hi, lo); 8 rows: 8 columns = 8 rows, hi and lo as two more k-steps into the same
//           accumulators, block_mma4), q' = x * key_x_scale * 2^e per row; each 32-channel block's fp32 result is
//           folded with the token's group scale (and zeff * sum(q') for asym / hybrid keys), as gemv_inner_q does.
//   softmax thread (g, t) holds tokens g, g + 8, 16 + g, 24 + g of query row t (4 rows; rows 2t, 2t + 1 with 8):
//           the row's max and sum over the tile are 3 shuffles each; p * 2^14 = ex2((S - m) 2^-e log2(e) + 14) in fp32
//           on the scores in q' units (score_rows, the kernel's softmax; steps without masks: ex2(S k + (14 - m k)),
//           k = 2^-e log2(e), one FFMA a score).
//   P.V     A = 16 channels x 16 tokens of the value store (the packed block of a channel is 32 tokens, so one tile is
//           one block and one group per channel), B = p * 2^14 as hi / lo pairs, staged through shared memory into
//           the B fragment's token order; the fp32 result is folded with the channel's group scale (and zeff * sum(p)).
//   affines the folds' scales (and zero terms) in fp32 from a per-warp table that the warp's lanes fill once a step
//           (keys, then values, in the same bytes), not from 2-byte loads by every thread of an MMA quad.
// The fp32 accumulators therefore see every product of a code and a query / probability to ~2^-22 relative (the
// hi / lo split) and sum in fp32: the numerical contract of docs/FORMATS.md ("GEMV arithmetic"). p is scaled by
// 2^14 so that small probabilities stay normal fp16 numbers in the split; the partial divides it out.
//
// Instantiated for the (bits, mode) pairs of the InnerQ presets (kvkernels/formats.py) at head_dim 64 and 128 and 4 or
// 8 rows per CTA; KIVI's layouts (keys "cols", values "rows") have kernels of their own below (kivi_tiles_kernel, the
// KIVI presets' widths); the launcher falls back to the general kernel for anything else (store_tiles_supported).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <utility>

#include "cuda/decode_attention.h"
#include "kvkernels/async_copy.cuh"
#include "kvkernels/gemv.cuh"
#include "kvkernels/kivi_mma.cuh"
#include "kvkernels/mma.cuh"

namespace kvk {
namespace {

constexpr int kThreads = 128;  // 4 warps, each its own tiles
constexpr int kWarps = kThreads / 32;
constexpr int kTile = 32;
constexpr float kPScale = 16384.f;  // p * 2^14 in the B fragments (p <= 1: at most 2^14, far below fp16's max)
constexpr float kPScaleLog2 = 14.f;  // log2(kPScale)
constexpr float kLog2e = 1.4426950408889634f;
constexpr int64_t kMinSplitTokens = 512;  // 2 steps per warp: the prologue and the merge stay small

// The InnerQ tiles' shared memory (floats, all parts 16-byte aligned): staged queries [QR][D]; sum of each 32-channel
// block of a staged row [QR][D / 32]; 2^-e per row [QR] (padded to 4); per warp the step's p * 2^14 [QR][TOK]; per warp
// its partial output [QR][D] and (m, l) [QR][2].
// Tokens per warp step: 64 everywhere, which halves the softmax, rescale and value addressing per token against 32.
// Until the step's group affines moved to the warp's table (2026-11-29), 8 query rows at head_dim 128 with zero points
// (asym keys: their per-block query sums and zero rows; hybrid values: their per-block sums of p) took 32-token steps:
// at 64 they spilled at 255 registers (asym keys inside the loop on sm_90, hybrid values on sm_80 / sm_87). With the
// table they fit without a spill on sm_80, sm_87 and sm_90 (nvcc_check). The function stays the one place to say it.
// Resident CTAs (the register cap, __launch_bounds__): 3 at 4 rows (168 registers, no spill since the tables; 7-20
// instructions a step more than the ~200 registers of 2 CTAs would take, for 1.5x the warps keeping loads in flight),
// except where 168 spills: innerq_hybrid at head_dim 128 (every arch) and innerq_base at head_dim 128 on sm_80 / sm_87
// (4-16 bytes, nvcc_check; sm_90 fits), which keep 2 there; 2 at 8 rows. The device pass of each arch reads its own
// value (__CUDA_ARCH__). The trade between fewer instructions and more warps is the static model's choice, not yet
// measured on a GPU.
__host__ __device__ constexpr int tok_per_step(int, int, QuantMode, QuantMode) { return 64; }
__host__ __device__ constexpr bool sm90_pass() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900  // checked there; other archs keep the bound that fits sm_80 / 87
  return true;
#else
  return false;
#endif
}
__host__ __device__ constexpr int store_min_ctas(int D, int NT, int KB, QuantMode VM, int VB) {
  return NT == 1 && (D == 64 || (VM != QuantMode::kHybrid && (sm90_pass() || KB != 3 || VB != 3))) ? 3 : 2;
}
// Where a step's P.V B fragments wait for the value MMAs: in registers, or, with 8 query rows at head_dim 128, in
// lane-private slots of shared memory (each lane reads back only what it wrote: no barrier). Held in registers there
// they spilled to local memory inside the step loop (255 registers); until 2026-11-29 those instantiations took
// 32-token steps instead (innerq_base 13.0 instructions per byte against 11.5 then, sass_budget).
__host__ __device__ constexpr bool pf_in_smem(int D, int NT, QuantMode KM, QuantMode VM) {
  return D == 128 && NT == 2 && tok_per_step(D, NT, KM, VM) == 64;
}

__host__ __device__ constexpr int store_smem_floats(int D, int QR, QuantMode KM, QuantMode VM) {
  return QR * D + QR * (D / 32) + ((QR + 3) / 4) * 4 + kWarps * QR * tok_per_step(D, QR / 4, KM, VM) +
         kWarps * QR * D + kWarps * QR * 2;
}
// After the floats: the key MMAs' B fragments [NT][D / 32][32 lanes] (uint4; read back per block and m-tile, which
// costs fewer instructions than the spills 16-32 more live registers caused at head_dim 128), then (pf_in_smem) per
// warp the P.V B fragments [NT][TOK / 32][32 lanes] (uint4).
__host__ __device__ constexpr int store_smem_bytes(int D, int QR, QuantMode KM, QuantMode VM) {
  return store_smem_floats(D, QR, KM, VM) * 4 + (QR / 4) * (D / 32) * 32 * 16 +
         (pf_in_smem(D, QR / 4, KM, VM) ? kWarps * (QR / 4) * (tok_per_step(D, QR / 4, KM, VM) / 32) * 32 * 16 : 0);
}
// A warp's table of its step's group affines (GroupAffine, fp32) in the MMAs' row pairs: keys [D / G groups][TOK / 16]
// [8] during the scores, values [TOK / 32 blocks][D / 16][8] during P.V, in the same bytes; an entry is (s of row a,
// s of row b), with zero points also (zeff a, zeff b). It lives in the warp's slice of the partial output om, which
// only the warp's own epilogue writes, after its loop (D TOK / 4 bytes at most, the slice QR D 4 >= 16 D).
__host__ __device__ constexpr int affine_bytes(QuantMode m) { return m == QuantMode::kSym ? 8 : 16; }
__host__ __device__ constexpr int warp_table_bytes(int D, int TOK, QuantMode KM, QuantMode VM) {
  const int keys = (D / 32) * (TOK / 16) * 8 * affine_bytes(KM), values = (TOK / 32) * (D / 16) * 8 * affine_bytes(VM);
  return keys > values ? keys : values;
}
// One table entry from the affines of rows / channels a and b: (s_a, s_b), with zero points (s_a, s_b, zeff_a, zeff_b).
template <bool kZero>
__device__ __forceinline__ std::conditional_t<kZero, float4, float2> affine_entry(const GroupAffine& a,
                                                                                   const GroupAffine& b) {
  if constexpr (kZero) return make_float4(a.s, b.s, a.zeff, b.zeff);
  else return make_float2(a.s, b.s);
}

// Canonical words of one key row's D / 32 blocks for thread t (bits 3: the whole row with 8-byte loads, the caller
// guarantees 8-byte aligned rows; other bits: the words the thread needs, load_gather_block; t = 0 where `row` was
// moved on by the thread's own_word).
template <int BITS, int NB>
__device__ __forceinline__ void key_row_words(const uint32_t* __restrict__ row, int t, uint32_t sel_lo, uint32_t sel_hi,
                                              uint32_t (&X)[NB], uint32_t (&Xh)[NB]) {
  if constexpr (BITS == 3) {
    uint32_t w[3 * NB];
#pragma unroll
    for (int i = 0; i < 3 * NB / 2; ++i) {
      const uint2 v = __ldg(reinterpret_cast<const uint2*>(row) + i);
      w[2 * i] = v.x, w[2 * i + 1] = v.y;
    }
#pragma unroll
    for (int cb = 0; cb < NB; ++cb) {
      X[cb] = prmt(w[3 * cb], w[3 * cb + 1], sel_lo);
      Xh[cb] = prmt(w[3 * cb + 2], w[3 * cb + 2], sel_hi);
    }
  } else {
#pragma unroll
    for (int cb = 0; cb < NB; ++cb) load_gather_block<BITS, true>(row + cb * BITS, t, sel_lo, sel_hi, X[cb], Xh[cb]);
  }
}

// One fp16 pair of the hi / lo split (mma.cuh: split_half) of (a, b): part 0 = fp16(v), part 1 = fp16(v - fp16(v)).
// On the device two packed conversions and two FMAs for both parts' lanes alike (part as 0.f / 1.f): v - part * hi.
__device__ __forceinline__ uint32_t split_pair(float a, float b, float part) {
#if defined(__CUDA_ARCH__)
  const __half2 hi = __floats2half2_rn(a, b);
  const float2 hf = __half22float2(hi);
  const __half2 r = __floats2half2_rn(fmaf(-part, hf.x, a), fmaf(-part, hf.y, b));
  return *reinterpret_cast<const uint32_t*>(&r);
#else
  const HalfSplit sa = split_half(a), sb = split_half(b);
  return part != 0.f ? pack_half2(sa.lo, sb.lo) : pack_half2(sa.hi, sb.hi);
#endif
}

// Both fp16 pairs of the split of (a, b) at once: .x = part 0 (hi), .y = part 1 (lo), as split_pair's.
__device__ __forceinline__ uint2 split_pairs(float a, float b) {
#if defined(__CUDA_ARCH__)
  const __half2 hi = __floats2half2_rn(a, b);
  const float2 hf = __half22float2(hi);
  const __half2 lo = __floats2half2_rn(a - hf.x, b - hf.y);
  return make_uint2(*reinterpret_cast<const uint32_t*>(&hi), *reinterpret_cast<const uint32_t*>(&lo));
#else
  const HalfSplit sa = split_half(a), sb = split_half(b);
  return make_uint2(pack_half2(sa.hi, sb.hi), pack_half2(sa.lo, sb.lo));
#endif
}

// B fragment (mma.cuh) of one lane from the 8 values v[0..8) its column takes in one 32-element block: pairs
// (i, i + 4) in the decoders' order, part 0 = hi, 1 = lo of the fp16 split.
__device__ __forceinline__ uint4 b_fragment(const float (&v)[8], float part) {
  return make_uint4(split_pair(v[0], v[4], part), split_pair(v[1], v[5], part), split_pair(v[2], v[6], part),
                    split_pair(v[3], v[7], part));
}

// Two MMAs over one 32-wide reduction block: A0 / A1 the k-steps' A fragments, B = b_fragment's (x, y) / (z, w).
__device__ __forceinline__ void block_mma2(float (&d)[4], const uint32_t (&ha)[4], const uint32_t (&hb)[4],
                                           const uint4& B) {
  const uint32_t A0[4] = {ha[0], hb[0], ha[1], hb[1]};  // k-step 0: pairs P0, P1 of rows g and g + 8
  const uint32_t A1[4] = {ha[2], hb[2], ha[3], hb[3]};  // k-step 1: pairs P2, P3
  const uint32_t B0[2] = {B.x, B.y}, B1[2] = {B.z, B.w};
  const float zero[4] = {0.f, 0.f, 0.f, 0.f};
  mma_m16n8k16(d, A0, B0, zero);
  mma_m16n8k16(d, A1, B1, d);
}

// The 8-row form (kKDup): B's 8 columns are 8 query rows, and the hi / lo halves of the split go to the same
// accumulators as two more k-steps (4 MMAs, as two n-tiles of 4 rows x (hi, lo) take), so d holds (row g, query
// rows 2t, 2t + 1) and (row g + 8, the same): their sum of hi and lo needs no FADD.
__device__ __forceinline__ void block_mma4(float (&d)[4], const uint32_t (&ha)[4], const uint32_t (&hb)[4],
                                           const uint4& Bhi, const uint4& Blo) {
  const uint32_t A0[4] = {ha[0], hb[0], ha[1], hb[1]};
  const uint32_t A1[4] = {ha[2], hb[2], ha[3], hb[3]};
  const uint32_t H0[2] = {Bhi.x, Bhi.y}, H1[2] = {Bhi.z, Bhi.w}, L0[2] = {Blo.x, Blo.y}, L1[2] = {Blo.z, Blo.w};
  const float zero[4] = {0.f, 0.f, 0.f, 0.f};
  mma_m16n8k16(d, A0, H0, zero);
  mma_m16n8k16(d, A1, H1, d);
  mma_m16n8k16(d, A0, L0, d);
  mma_m16n8k16(d, A1, L1, d);
}

// The CTA's coordinates: (b, h_kv), query rows r0 .. r0 + nr - 1 of the R = gq x T rows of the KV head (row block
// blockIdx.x % row_blocks), the split's store tokens [lo, hi) of [0, F) (empty past F), the sink length S and the
// token count N it attends over (from device memory with p.lengths).
struct TileCta {
  int64_t b, hk, S, N, lo, hi;
  int split, r0, nr;
};

template <int QR>
__device__ __forceinline__ TileCta tile_cta(const DecodeAttentionParams& p, const StoreTilesLaunch& L) {
  TileCta c;
  const int rb = static_cast<int>(blockIdx.x % static_cast<unsigned>(L.row_blocks));
  const int64_t bh = blockIdx.x / static_cast<unsigned>(L.row_blocks);
  c.b = bh / p.H_kv, c.hk = bh % p.H_kv;
  c.split = blockIdx.y;
  const TokenCounts cnt = p.lengths != nullptr ? token_counts<true>(p) : token_counts<false>(p);
  c.S = cnt.S, c.N = cnt.N;
  const int64_t F = store_tile_tokens(cnt.mk, cnt.mv);
  c.lo = c.split * L.C, c.hi = min(F, c.lo + L.C);
  const int R = L.gq * static_cast<int>(p.T);
  c.r0 = rb * QR, c.nr = min(QR, R - c.r0);
  return c;
}

// A store's row stride in bytes as a 32-bit number (store_tiles_supported: every slice spans < 2^32 bytes).
__device__ __forceinline__ uint32_t row_bytes(int64_t stride, uint32_t elem) {
  return static_cast<uint32_t>(stride) * elem;
}

// A thread's score rows (slot_row): the caller's mask row or the causal limit, and the online softmax's running max
// and sum (m = -inf, l = 0 until a finite score is seen). The limit is the row's last visible store token counted from
// the split's first (lo), clamped to [-1, 2^30] (F < 2^30: store_tiles_supported's 32-bit row offsets), -1 for a row
// past nr: a step at offset f0 - lo sees step token k while k <= limit - (f0 - lo), one 32-bit subtraction a step.
constexpr int kLimitCap = 1 << 30;
template <int NT>
struct ScoreRows {
  const float* mrow[NT];
  int limit[NT];
  bool live[NT];  // a row of the CTA's (rows past nr: every score -inf)
  float m_run[NT], l_run[NT];
  __device__ __forceinline__ const float* mask_row(int nt) const { return mrow[nt]; }
  __device__ __forceinline__ int limit_of(int nt) const { return limit[nt]; }
};


template <int NT, bool KDUP = false>
__device__ __forceinline__ ScoreRows<NT> score_rows(const DecodeAttentionParams& p, const StoreTilesLaunch& L,
                                                    const TileCta& c, int t) {
  ScoreRows<NT> rows;
  const int64_t T = p.T;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int r = slot_row(KDUP, nt, t), q = c.r0 + min(r, c.nr - 1);
    const int64_t h = c.hk * L.gq + q / T, tq = q % T;
    rows.live[nt] = r < c.nr;
    rows.mrow[nt] = p.mask != nullptr ? p.mask + c.b * p.m_sb + h * p.m_sh + tq * p.m_st : nullptr;
    const int64_t rel = c.N - T + tq - (c.S + c.lo);  // the row sees attention tokens up to N - T + tq
    rows.limit[nt] = r < c.nr ? static_cast<int>(min(max(rel, int64_t{-1}), int64_t{kLimitCap})) : -1;
    rows.m_run[nt] = -INFINITY;
    rows.l_run[nt] = 0.f;
  }
  return rows;
}

// The same rows in one 64-bit word each, whichever of the mask row's address and the causal limit the call uses
// (p.mask != nullptr: CTA-uniform), two registers less a row: the InnerQ tiles' 64-token steps with 8 query rows at
// head_dim 128 spilled inside the loop without that (255 registers).
template <int NT>
struct PackedScoreRows {
  int64_t sel[NT];
  bool live[NT];
  float m_run[NT], l_run[NT];
  __device__ __forceinline__ const float* mask_row(int nt) const { return reinterpret_cast<const float*>(sel[nt]); }
  __device__ __forceinline__ int limit_of(int nt) const { return static_cast<int>(sel[nt]); }
};

template <int NT>
__device__ __forceinline__ PackedScoreRows<NT> packed(const ScoreRows<NT>& r, bool masked) {
  PackedScoreRows<NT> q;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    q.sel[nt] = masked ? reinterpret_cast<int64_t>(r.mrow[nt]) : r.limit[nt];
    q.live[nt] = r.live[nt], q.m_run[nt] = r.m_run[nt], q.l_run[nt] = r.l_run[nt];
  }
  return q;
}

// p * 2^14 of a row's step scores s (q' units, or score units with a caller's mask; kl = log2(e) per unit) against
// m, the running max, or 0 where the row has seen nothing (every score -inf there: exp2(-inf) = 0, no select a score).
// Steps without masks see finite scores: ex2(s kl + (14 - m kl)), one FFMA a score, as flash attention's; m kl is
// rounded once, an error of |m kl| 2^-24 in the exponent (~1e-6 relative in p at scores ~10, log2(e) included). With
// masks (finfo.min entries: m kl would overflow) the subtraction stays first, exact where s and m are close.
struct PScaled {
  float m, kl, c14;
  __device__ __forceinline__ PScaled(float m_use, float kl_) : m(m_use), kl(kl_), c14(fmaf(-m_use, kl_, kPScaleLog2)) {}
  template <bool kMasks>
  __device__ __forceinline__ float of(float s) const {
    return exp2f(kMasks ? fmaf(s - m, kl, kPScaleLog2) : fmaf(s, kl, c14));
  }
};

struct StepMax {
  float m_new, alpha;  // the row's new running max; the factor rescaling what was accumulated before
  bool seen;           // a finite (or NaN) score so far: else m stays -inf, l 0, o 0
};

// Masks row nt's scores of one warp step (kMasks), s[j] for the step token lane_tok + tok(j) (tok(j) a compile-time
// offset; attention token first + the step token, the step's offset in the split step_off), and takes the row's max
// over the quad's 8 lanes (3 shuffles) into its running max. The scores come in q' units (score * 2^e, us = 2^-e) and
// stay there, or with a caller's mask go to score units (the mask added there); kl is log2(e) per unit of the running
// scores (the KIVI tiles; the InnerQ tiles write the same steps out, store_tiles_kernel).
template <int NS, bool kMasks, int NT, typename TokenOf>
__device__ __forceinline__ StepMax step_max(float* s, const ScoreRows<NT>& rows, int nt, int64_t first, int step_off,
                                            int lane_tok, const TokenOf& tok, float us, float kl) {
  if constexpr (kMasks) {  // (without: every token of the step is visible to every row, run_warp_steps)
    if (rows.mrow[nt] != nullptr) {  // caller's mask (CTA-uniform branch); rows past nr stay -inf
      const float* mj = rows.mrow[nt] + (first + lane_tok);
#pragma unroll
      for (int j = 0; j < NS; ++j) s[j] = rows.live[nt] ? fmaf(s[j], us, __ldg(mj + tok(j))) : -INFINITY;
    } else {  // causal: step token k is visible to the row while k <= its limit (negative: none, a row past nr)
      const int lim = rows.limit[nt] - step_off;
#pragma unroll
      for (int j = 0; j < NS; ++j) s[j] = tok(j) + lane_tok <= lim ? s[j] : -INFINITY;
    }
  }
  float tmax = -INFINITY;
#pragma unroll
  for (int j = 0; j < NS; ++j) tmax = nan_max(tmax, s[j]);
  tmax = nan_max(tmax, __shfl_xor_sync(0xffffffffu, tmax, 4));
  tmax = nan_max(tmax, __shfl_xor_sync(0xffffffffu, tmax, 8));
  tmax = nan_max(tmax, __shfl_xor_sync(0xffffffffu, tmax, 16));
  // nan_max: a NaN score poisons the row (fmaxf(-inf, NaN) = -inf would drop the whole step as unseen)
  StepMax m;
  m.m_new = nan_max(rows.m_run[nt], tmax);
  m.seen = m.m_new != -INFINITY;
  m.alpha = 1.f;
  if (m.seen) m.alpha = exp2f((rows.m_run[nt] - m.m_new) * kl);
  return m;
}

// A warp's steps f0 = lo + TOK warp + TOK kWarps i < hi of its split, through step(f0, masks): first, with no caller's
// mask (and kVisibleLoop), those below every live row's causal limit with masks off (a prefix of the steps: the limits
// only grow with the token; every step of a q_len-1 decode), then the rest with masks on. Two loops, so that the common
// one holds no masking code (sass_budget's steady state; `masked steps` the other). The least limit among the CTA's
// live rows: every warp holds all of them (in its 4 t lanes' slots).
template <int NT, int TOK, bool kVisibleLoop, typename Rows, typename Step>
__device__ __forceinline__ void run_warp_steps(const Rows& rows, bool masked, int64_t lo, int64_t hi, int warp,
                                               const Step& step) {
  int64_t f0 = lo + TOK * warp;
  if constexpr (kVisibleLoop) {
    int min_limit = kLimitCap;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      if (rows.live[nt]) min_limit = min(min_limit, rows.limit_of(nt));
    min_limit = min(min_limit, __shfl_xor_sync(0xffffffffu, min_limit, 1));
    min_limit = min(min_limit, __shfl_xor_sync(0xffffffffu, min_limit, 2));
    if (!masked) {
#pragma unroll 1
      for (; f0 < hi && static_cast<int>(f0 - lo) + TOK - 1 <= min_limit; f0 += TOK * kWarps)
        step(f0, std::false_type{});
    }
  }
#pragma unroll 1
  for (; f0 < hi; f0 += TOK * kWarps) step(f0, std::true_type{});
}

// q' = (x * q_scale) * key_x_scale of the CTA's query rows r0 .. r0 + nr - 1 into qs [QR][D] (rows past nr: 0), each
// row scaled by 2^e so that max |q'| lies in [2^14, 2^15); unscale_s [QR] gets 2^-e. One warp per row.
template <int D, int QR>
__device__ __forceinline__ void stage_queries(const DecodeAttentionParams& p, const StoreTilesLaunch& L, const TileCta& c,
                                              float* qs, float* unscale_s, int warp, int lane) {
  constexpr int NB = D / 32;
  const int64_t T = p.T, b = c.b, hk = c.hk;
  const int r0 = c.r0, nr = c.nr;
  for (int r = warp; r < QR; r += kWarps) {
    const int q = r0 + min(r, nr - 1);
    const int64_t h = hk * L.gq + q / T, tq = q % T;
    const int64_t xr = b * p.x_sb + h * p.x_sh + tq * p.x_st;
    float v[NB];
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < NB; ++i) {
      const int ch = lane + 32 * i;
      v[i] = 0.f;
      if (r < nr) {
        v[i] = load_x(p.x, p.x_dtype, xr + ch) * p.q_scale;
        if (p.key_x_scale != nullptr) v[i] *= __ldg(p.key_x_scale + hk * p.xs_sh + ch);
      }
      amax = nan_max(amax, fabsf(v[i]));
    }
    const int e = scale_exponent(warp_max(amax));
    const float sc = exp2i(e);
#pragma unroll
    for (int i = 0; i < NB; ++i) qs[r * D + lane + 32 * i] = v[i] * sc;
    if (lane == 0) unscale_s[r] = exp2i(-e);
  }
}

// The CTA's warps' partials om [kWarps][QR][D] (p * 2^14-weighted sums) and ml [kWarps][QR][2] (running max, sum),
// merged by log-sum-exp in warp order into the split's slot of the workspace (the caller has synchronized).
template <int D, int QR>
__device__ __forceinline__ void merge_warps(const DecodeAttentionParams& p, const StoreTilesLaunch& L, const TileCta& c,
                                            const float* om, const float* ml, int tid) {
  const int64_t T = p.T;
  for (int i = tid; i < c.nr * D; i += kThreads) {
    const int r = i / D, ch = i % D;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = nan_max(mx, ml[(w * QR + r) * 2]);  // a NaN warp keeps m NaN
    float num = 0.f, den = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float mw = ml[(w * QR + r) * 2];
      if (mw == -INFINITY) continue;
      const float f = expf(mw - mx);
      num = fmaf(f, om[(w * QR + r) * D + ch], num);
      den = fmaf(f, ml[(w * QR + r) * 2 + 1], den);
    }
    const int q = c.r0 + r;
    const int64_t h = c.hk * L.gq + q / T, tq = q % T;
    float* ws = partial_row(p, c.split, c.b, h, tq);
    ws[ch] = num * (1.f / kPScale);
    if (ch == 0) ws[D] = mx, ws[D + 1] = den;
  }
}

template <int D, int NT, int KB, QuantMode KM, int VB, QuantMode VM>
__global__ void __launch_bounds__(kThreads, store_min_ctas(D, NT, KB, VM, VB)) store_tiles_kernel(const DecodeAttentionParams p, const StoreTilesLaunch L) {
  constexpr int TOK = tok_per_step(D, NT, KM, VM), KT = TOK / 32, KM16 = TOK / 16;
  constexpr int QR = 4 * NT, NB = D / 32, MT = D / 16;
  constexpr int KOFF = decode_offset<KB, KM>(), VOFF = decode_offset<VB, VM>();
  constexpr bool kKZero = KM != QuantMode::kSym, kVZero = VM != QuantMode::kSym;
  extern __shared__ __align__(16) float smem[];
  float* const qs = smem;                      // [QR][D]
  float* const xsum_s = qs + QR * D;           // [QR][NB]
  float* const unscale_s = xsum_s + QR * NB;   // [QR]
  float* const ps_all = unscale_s + (QR + 3) / 4 * 4;  // [kWarps][QR][TOK]
  float* const om = ps_all + kWarps * QR * TOK;        // [kWarps][QR][D]
  float* const ml = om + kWarps * QR * D;              // [kWarps][QR][2]
  uint4* const qf = reinterpret_cast<uint4*>(ml + kWarps * QR * 2);  // [NT][NB][32]
  constexpr bool kPfSmem = pf_in_smem(D, NT, KM, VM);
  // 8 rows: B's columns are the 8 query rows, hi and lo two more k-steps (block_mma4); slot nt of a thread is row
  // 2t + nt. 4 rows: 4 rows x (hi, lo) columns (block_mma2), slot nt row 4 nt + t.
  constexpr bool kKDup = NT == 2;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane >> 2, t = lane & 3;
  const float part = static_cast<float>(g & 1);  // this lane's B column holds the lo (1) or hi (0) fp16 terms
  const TileCta c = tile_cta<QR>(p, L);
  const int64_t b = c.b, hk = c.hk, S = c.S, lo = c.lo, hi = c.hi;

  // L2 prefetch of the warp's first step before the queries are staged (the loop prefetches each later step with the
  // one before it): a warp with one step (short caches, splits of one round of warps) would otherwise ask DRAM for its
  // keys only after the staging's barriers, and for its values after the scores. The loop's sets: one key row a lane
  // per 32 tokens (codes, scales, zeros), every channel's first value block (with its scale and zero here: cold).
  if (L.prefetch && lo + TOK * warp < hi) {
    const AttnStore& K = p.keys;
    const AttnStore& V = p.values;
    const uint32_t f0 = static_cast<uint32_t>(lo + TOK * warp), blk = f0 / kTile;
    const uint32_t gv0 = block_group(blk, L.v_bpg_magic);
#pragma unroll
    for (int k = 0; k < KT; ++k) {
      const uint32_t r = f0 + 32u * k + static_cast<uint32_t>(lane);
      prefetch_l2(offset_rows(K.codes + b * K.c_sb + hk * K.c_sh, r, row_bytes(K.c_sr, 4)));
      prefetch_l2(offset_rows(K.scales + b * K.s_sb + hk * K.s_sh, r, row_bytes(K.s_sr, 2)));
      if constexpr (kKZero) prefetch_l2(offset_rows(K.zeros + b * K.z_sb + hk * K.z_sh, r, row_bytes(K.z_sr, 2)));
    }
#pragma unroll
    for (int i = 0; i < D / 32; ++i) {
      const uint32_t ch = static_cast<uint32_t>(lane) + 32u * i;
      prefetch_l2(offset_rows(V.codes + b * V.c_sb + hk * V.c_sh, ch, row_bytes(V.c_sr, 4)) + blk * VB);
      prefetch_l2(offset_rows(V.scales + b * V.s_sb + hk * V.s_sh, ch, row_bytes(V.s_sr, 2)) + gv0);
      if constexpr (kVZero) prefetch_l2(offset_rows(V.zeros + b * V.z_sb + hk * V.z_sh, ch, row_bytes(V.z_sr, 2)) + gv0);
    }
  }

  stage_queries<D, QR>(p, L, c, qs, unscale_s, warp, lane);
  __syncthreads();
  if constexpr (kKZero) {
    for (int i = tid; i < QR * NB; i += kThreads) {
      const float* blk = qs + (i / NB) * D + (i % NB) * 32;
      float s = 0.f;
      for (int k = 0; k < 32; ++k) s += blk[k];
      xsum_s[i] = s;
    }
    __syncthreads();
  }
  // the key MMAs' B fragments (warp 0 writes them all, the barrier below publishes them), the zero-term sums and 2^-e
  // of this thread's rows (slot_row)
  float xsr[NT][NB], us[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int cb = 0; cb < NB; ++cb) {
      if (warp == 0) {
        float v[8];  // (kKDup: slot nt holds part nt of row g)
        const float* src = qs + b_col_row(kKDup, nt, g) * D + 32 * cb + 8 * t;
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = src[i];
        qf[(nt * NB + cb) * 32 + lane] = b_fragment(v, kKDup ? static_cast<float>(nt) : part);
      }
      xsr[nt][cb] = kKZero ? xsum_s[slot_row(kKDup, nt, t) * NB + cb] : 0.f;
    }
    us[nt] = unscale_s[slot_row(kKDup, nt, t)];
  }
  __syncthreads();
  const uint4* const qfl = qf + lane;

  // ---- the warp's score rows: mask pointers or causal limits, running max and sum ---------------------------------
  const bool masked = p.mask != nullptr;
  // The online softmax runs on the folds' results as they come (q' units: score * 2^e), or where a caller's mask is
  // added, in score units (fmaf(s, 2^-e, mask): a mask of finfo.min stays finite there, as the reference's): kl is
  // log2(e) per unit of the row's running scores, so that p * 2^14 is one FFMA and an ex2 from s - m (the scaling by
  // 2^-e, by log2(e) and by 2^14 folded in), and the running max goes back to score units once, in the epilogue.
  // l_run sums p * 2^14 likewise.
  // the packed form where the steps need its registers (kPfSmem; and 4 rows at head_dim 128 with asym keys, where the
  // softmax's per-row log2(e) / 2^e factor spilled at 168 registers); elsewhere ptxas lays the plain one out better
  auto rows = [&] {
    if constexpr (kPfSmem || (D == 128 && kKZero)) return packed(score_rows<NT, kKDup>(p, L, c, t), masked);
    else return score_rows<NT, kKDup>(p, L, c, t);
  }();

  // Addressing: 64-bit bases of the (b, h_kv) slices, rows reached by one mad.wide.u32 each (offset_rows) with the
  // row strides in bytes as 32-bit numbers (store_tiles_supported: every slice spans < 2^32 bytes). Key rows are
  // tokens, value rows channels (this thread's g + 8 j); a thread's code loads start at its own word of a block.
  // kRowPtrs (head_dim 64, 8 rows): every row a thread loads from (codes, the affine tables' scales / zeros, the
  // prefetches) is a loop-invariant pointer of its own, laundered (else ptxas re-derives each from the slice bases
  // every step), and a step's address is that pointer plus one product shared by the rows of a kind (f0 x stride, or
  // the value block). Elsewhere (4 rows: 168 registers; head_dim 128) the pointers do not fit beside the step's
  // registers (spills): the step derives each address from the slice bases, and the loads add the thread's word (tw).
  constexpr bool kRowPtrs = D == 64 && NT == 2;
  const auto hold = [](auto ptr) {
    if constexpr (kRowPtrs) return launder(ptr);
    else return ptr;
  };
  const AttnStore& K = p.keys;
  const AttnStore& V = p.values;
  const uint32_t kcs = row_bytes(K.c_sr, 4), kss = row_bytes(K.s_sr, 2), kzs = row_bytes(K.z_sr, 2);
  const uint32_t vcs = row_bytes(V.c_sr, 4), vss = row_bytes(V.s_sr, 2), vzs = row_bytes(V.z_sr, 2);
  const uint32_t* const kc = hold(K.codes + b * K.c_sb + hk * K.c_sh);
  const uint16_t* const ksc = hold(K.scales + b * K.s_sb + hk * K.s_sh);
  const uint16_t* const kz = kKZero ? hold(K.zeros + b * K.z_sb + hk * K.z_sh) : nullptr;
  const uint32_t* const vc_g = hold(offset_rows(V.codes + b * V.c_sb + hk * V.c_sh, static_cast<uint32_t>(g), vcs));
  const uint16_t* const vs0 = hold(V.scales + b * V.s_sb + hk * V.s_sh);
  const uint16_t* const vz0 = kVZero ? hold(V.zeros + b * V.z_sb + hk * V.z_sh) : nullptr;
  const int tw = kRowPtrs ? 0 : t;
  constexpr bool kVOwnWord = !kRowPtrs || VB != 3;  // (3-bit values with row pointers: the whole-block loads)
  // the key affine table (KPAIRS row pairs a step): the lane's rows 16 (kpr / 8) + kpr % 8 and + 8 from group kg0 on
  constexpr int KPAIRS = KM16 * 8, KLPG = 32 / KPAIRS;
  const int kpr = lane % KPAIRS, kg0 = lane / KPAIRS;
  // the value affine table: the lane's channels 16 (pr / 8) + pr % 8 and + 8 of pr = lane + 32 q
  constexpr int VPL = MT * 8 / 32;
  // the pointers (kRowPtrs; one-element placeholders otherwise)
  constexpr int NKR = kRowPtrs ? 2 * KM16 : 1, NVR = kRowPtrs ? 2 * MT : 1, NVQ = kRowPtrs ? VPL : 1;
  constexpr int NVP = kRowPtrs ? D / 32 : 1;
  const uint32_t* krow[NKR];  // key rows g + 8 j of the step at token 0
  const uint32_t* vrow[NVR];  // value channels g + 8 j at block 0
  const uint32_t* vpf[NVP];   // value channels lane + 32 i, 8 blocks on (the next step's prefetch)
  const uint16_t *vs_a[NVQ], *vs_b[NVQ], *vz_a[NVQ], *vz_b[NVQ];
  const uint32_t* kpf_c = nullptr;  // the lane's key prefetch rows (codes, scales, zeros) of the step at token 0
  const uint16_t *kpf_s = nullptr, *kpf_z = nullptr;
  const uint16_t *ks_a = nullptr, *ks_b = nullptr, *kz_a = nullptr, *kz_b = nullptr;  // its key table rows
  if constexpr (kRowPtrs) {
#pragma unroll
    for (int j = 0; j < NKR; ++j)  // (3-bit keys: whole rows)
      krow[j] = launder(offset_rows(kc, static_cast<uint32_t>(g + 8 * j), kcs) + (KB == 3 ? 0u : own_word<KB>(t)));
#pragma unroll
    for (int j = 0; j < NVR; ++j)
      vrow[j] = launder(offset_rows(vc_g, static_cast<uint32_t>(8 * j), vcs) + own_word<VB>(t));
#pragma unroll
    for (int i = 0; i < NVP; ++i)
      vpf[i] = launder(offset_rows(vc_g, static_cast<uint32_t>(lane - g + 32 * i), vcs) + TOK * kWarps / kTile * VB);
#pragma unroll
    for (int q = 0; q < NVQ; ++q) {
      const int pr = lane + 32 * q;
      const uint32_t ch = 16u * (pr / 8) + (pr % 8);
      vs_a[q] = launder(offset_rows(vs0, ch, vss));
      vs_b[q] = launder(offset_rows(vs0, ch + 8u, vss));
      vz_a[q] = kVZero ? launder(offset_rows(vz0, ch, vzs)) : nullptr;
      vz_b[q] = kVZero ? launder(offset_rows(vz0, ch + 8u, vzs)) : nullptr;
    }
    const uint32_t kpf = static_cast<uint32_t>(lane + TOK * kWarps);  // the lane's key row of the next step's prefetch
    const uint32_t kr_a = 16u * (kpr / 8) + (kpr % 8);
    kpf_c = launder(offset_rows(kc, kpf, kcs));
    kpf_s = launder(offset_rows(ksc, kpf, kss));
    kpf_z = kKZero ? launder(offset_rows(kz, kpf, kzs)) : nullptr;
    ks_a = launder(offset_rows(ksc, kr_a, kss) + kg0);
    ks_b = launder(offset_rows(ksc, kr_a + 8u, kss) + kg0);
    kz_a = kKZero ? launder(offset_rows(kz, kr_a, kzs) + kg0) : nullptr;
    kz_b = kKZero ? launder(offset_rows(kz, kr_a + 8u, kzs) + kg0) : nullptr;
  }
  const uint32_t sel_lo = sel_bytes(2 * t, 2 * t + 1), sel_hi = sel_bytes(t, t);
  float* const ps = ps_all + warp * QR * TOK;
  uint4* const pfs = qf + NT * NB * 32 + warp * NT * KT * 32 + lane;  // [kWarps][NT][KT][32] (kPfSmem)
  // the warp's table of the step's group affines (see warp_table_bytes): an entry is (s_a, s_b) or, with zero points,
  // (s_a, s_b, zeff_a, zeff_b) of the rows / channels g and g + 8 of one 16-row tile; keys, then values, in one place
  using KAff = std::conditional_t<kKZero, float4, float2>;
  using VAff = std::conditional_t<kVZero, float4, float2>;
  static_assert(warp_table_bytes(D, TOK, KM, VM) <= QR * D * 4, "the table fits the warp's slice of om");
  char* const table = reinterpret_cast<char*>(om + warp * QR * D);
  KAff* const ktab = reinterpret_cast<KAff*>(table);  // [group][mt][g]
  VAff* const vtab = reinterpret_cast<VAff*>(table);  // [kb][mt][g]
  const int n_kg = NB >> L.k_group_shift;  // key groups along a row

  float o[NT][MT][2];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) o[nt][mt][0] = o[nt][mt][1] = 0.f;

  // One warp step from f0. kMasks: with the caller's mask or the causal limits; without: every token of the step is
  // visible to every row of the CTA (no caller mask, the step below each row's limit: decode at q_len 1 everywhere,
  // longer queries but for their last steps). Rows past nr are left unmasked there: their scores come from zero
  // queries, stay in their own MMA columns, shuffles and accumulators, and nothing of theirs is written.
  const auto warp_step = [&](const int64_t f0, auto masks) {
    constexpr bool kMasks = decltype(masks)::value;
    // L2 prefetch of the warp's next step (below: its key rows with this step's, its value blocks with this step's), so
    // that a step's loads wait for L2 instead of two dependent DRAM round trips (keys, then values after the softmax).
    // Nothing stays live across the step: the addresses are this step's own pointers plus a constant.
    const bool prefetch_next = L.prefetch && f0 + TOK * kWarps < hi;
    // ---- scores of tokens f0 + 16 mt + g + 8 i ------------------------------------------------------------------
    float sc[NT][KM16][2];
#pragma unroll
    for (int mt = 0; mt < KM16; ++mt) {
      const uint32_t f0u = static_cast<uint32_t>(f0);
      [[maybe_unused]] const uint32_t ra = f0u + 16u * mt + g;  // token rows ra and ra + 8 of the key store
      uint32_t Xa[NB], Xha[NB], Xb[NB], Xhb[NB];
      const uint32_t* rowa;
      const uint32_t* rowb;
      if constexpr (kRowPtrs) {
        rowa = offset_rows(krow[2 * mt], f0u, kcs);
        rowb = offset_rows(krow[2 * mt + 1], f0u, kcs);
      } else {
        rowa = offset_rows(kc, ra, kcs);
        rowb = offset_rows(rowa, 8u, kcs);
      }
      key_row_words<KB, NB>(rowa, tw, sel_lo, sel_hi, Xa, Xha);
      key_row_words<KB, NB>(rowb, tw, sel_lo, sel_hi, Xb, Xhb);
      if (mt == 0) {
        if (prefetch_next) {  // rows f0 + TOK kWarps + lane + 32 k of the next step
          if constexpr (kRowPtrs) {
            const uint32_t* const pc = offset_rows(kpf_c, f0u, kcs);
            const uint16_t* const pscale = offset_rows(kpf_s, f0u, kss);
            [[maybe_unused]] const uint16_t* const pz = kKZero ? offset_rows(kpf_z, f0u, kzs) : nullptr;
#pragma unroll
            for (int k = 0; k < KT; ++k) {
              prefetch_l2(offset_rows(pc, 32u * k, kcs));
              prefetch_l2(offset_rows(pscale, 32u * k, kss));
              if constexpr (kKZero) prefetch_l2(offset_rows(pz, 32u * k, kzs));
            }
          } else {  // ra + that - g
            const uint16_t* const sa = offset_rows(ksc, ra, kss);
            [[maybe_unused]] const uint16_t* const za = kKZero ? offset_rows(kz, ra, kzs) : nullptr;
#pragma unroll
            for (int k = 0; k < KT; ++k) {
              const uint32_t dr = TOK * kWarps + 32u * k + static_cast<uint32_t>(lane - g);
              prefetch_l2(offset_rows(rowa, dr, kcs));
              prefetch_l2(offset_rows(sa, dr, kss));
              if constexpr (kKZero) prefetch_l2(offset_rows(za, dr, kzs));
            }
          }
        }
        // The step's key affines, after the first tile's code loads are issued: the (mt, g) row pairs of the step over
        // the lanes (KPAIRS of them; 2 lanes a pair, taking alternate groups, when there are 16), each pair's
        // groups loaded, converted to fp32 and stored once, where every thread of an MMA quad loaded them itself
        __syncwarp();  // the previous step's P.V has read the values' table in the same bytes
        const int pr = kpr, g0 = kg0;
        const uint16_t *s_a, *s_b, *z_a = nullptr, *z_b = nullptr;
        if constexpr (kRowPtrs) {
          s_a = offset_rows(ks_a, f0u, kss);
          s_b = offset_rows(ks_b, f0u, kss);
          if constexpr (kKZero) z_a = offset_rows(kz_a, f0u, kzs), z_b = offset_rows(kz_b, f0u, kzs);
        } else {
          const uint32_t r_a = f0u + 16u * (pr / 8) + (pr % 8);
          s_a = offset_rows(ksc, r_a, kss) + g0;
          s_b = offset_rows(s_a, 8u, kss);
          if constexpr (kKZero) z_a = offset_rows(kz, r_a, kzs) + g0, z_b = offset_rows(z_a, 8u, kzs);
        }
#pragma unroll
        for (int m = 0; m < (NB + KLPG - 1) / KLPG; ++m) {
          if (g0 + KLPG * m < n_kg) {
            const GroupAffine fa = group_affine<KM, KB>(__ldg(s_a + KLPG * m), kKZero ? __ldg(z_a + KLPG * m) : uint16_t{0});
            const GroupAffine fb = group_affine<KM, KB>(__ldg(s_b + KLPG * m), kKZero ? __ldg(z_b + KLPG * m) : uint16_t{0});
            ktab[((g0 + KLPG * m) * KM16 + pr / 8) * 8 + pr % 8] = affine_entry<kKZero>(fa, fb);
          }
        }
        __syncwarp();  // publishes the table
      }
      float acc[NT][2];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = 0.f;
#pragma unroll
      for (int cb = 0; cb < NB; ++cb) {
        const KAff e = ktab[((cb >> L.k_group_shift) * KM16 + mt) * 8 + g];  // rows ra, ra + 8 at cb's group
        uint32_t ha[4], hb[4];
        decode_inner_q<KB, KOFF>(Xa[cb], Xha[cb], L.dec_k, ha);
        decode_inner_q<KB, KOFF>(Xb[cb], Xhb[cb], L.dec_k, hb);
        if constexpr (kKDup) {  // d: (token a, rows 2t, 2t + 1), (token b, the same)
          float d[4];
          block_mma4(d, ha, hb, qfl[cb * 32], qfl[(NB + cb) * 32]);
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            if constexpr (kKZero) {
              acc[nt][0] = fmaf(e.x, d[nt], fmaf(e.z, xsr[nt][cb], acc[nt][0]));
              acc[nt][1] = fmaf(e.y, d[2 + nt], fmaf(e.w, xsr[nt][cb], acc[nt][1]));
            } else {
              acc[nt][0] = fmaf(e.x, d[nt], acc[nt][0]);
              acc[nt][1] = fmaf(e.y, d[2 + nt], acc[nt][1]);
            }
          }
        } else {
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            float d[4];
            block_mma2(d, ha, hb, qfl[(nt * NB + cb) * 32]);
            if constexpr (kKZero) {
              acc[nt][0] = fmaf(e.x, d[0] + d[1], fmaf(e.z, xsr[nt][cb], acc[nt][0]));
              acc[nt][1] = fmaf(e.y, d[2] + d[3], fmaf(e.w, xsr[nt][cb], acc[nt][1]));
            } else {
              acc[nt][0] = fmaf(e.x, d[0] + d[1], acc[nt][0]);
              acc[nt][1] = fmaf(e.y, d[2] + d[3], acc[nt][1]);
            }
          }
        }
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) sc[nt][mt][0] = acc[nt][0], sc[nt][mt][1] = acc[nt][1];
    }

    // ---- online softmax of the thread's rows; p * 2^14 to the warp's shared tile ---------------------------------
    float psum[NT][KT];  // sum of p * 2^14 over each 32-token block (the asym / hybrid values' zero term)
    __syncwarp();  // the previous step's p is read
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      // step_max's masking and max, written out over sc[nt][mt][i] (step token g + 16 mt + 8 i): through step_max
      // (a pointer into sc) ptxas allocated this loop differently, +0.1-0.5 instructions per byte on 12 of the 20
      // instantiations (sass_budget, 2026-11-27)
      float tmax = -INFINITY;
      if constexpr (kMasks) {
        if (masked) {  // caller's mask (CTA-uniform branch); rows past nr stay -inf
          const float* mj = rows.mask_row(nt) + (S + f0 + g);
#pragma unroll
          for (int mt = 0; mt < KM16; ++mt)
#pragma unroll
            for (int i = 0; i < 2; ++i)
              sc[nt][mt][i] = rows.live[nt] ? fmaf(sc[nt][mt][i], us[nt], __ldg(mj + 16 * mt + 8 * i)) : -INFINITY;
        } else {  // causal: step token k is visible to the row while k <= its limit (-1: a row past nr)
          const int lim = rows.limit_of(nt) - static_cast<int>(f0 - lo);  // (negative: none, a row past nr)
#pragma unroll
          for (int mt = 0; mt < KM16; ++mt)
#pragma unroll
            for (int i = 0; i < 2; ++i) sc[nt][mt][i] = 16 * mt + 8 * i + g <= lim ? sc[nt][mt][i] : -INFINITY;
        }
      }
#pragma unroll
      for (int mt = 0; mt < KM16; ++mt)
#pragma unroll
        for (int i = 0; i < 2; ++i) tmax = nan_max(tmax, sc[nt][mt][i]);
      tmax = nan_max(tmax, __shfl_xor_sync(0xffffffffu, tmax, 4));
      tmax = nan_max(tmax, __shfl_xor_sync(0xffffffffu, tmax, 8));
      tmax = nan_max(tmax, __shfl_xor_sync(0xffffffffu, tmax, 16));
      const float m_new = nan_max(rows.m_run[nt], tmax);
      float alpha = 1.f;
      const bool seen = m_new != -INFINITY;  // else nothing seen yet: keep m = -inf, l = 0, o = 0
      const float kl = masked ? kLog2e : us[nt] * kLog2e;  // (a register a row less than keeping it: spills at 168)
      if (seen) alpha = exp2f((rows.m_run[nt] - m_new) * kl);
      const PScaled pscaled(seen ? m_new : 0.f, kl);  // (0: no zeroing move before each predicated ex2)
      float sum = 0.f;  // of p * 2^14, as l_run
#pragma unroll
      for (int kb = 0; kb < KT; ++kb) {
        float pj[4];  // p * 2^14 of tokens 32 kb + 8 j + g
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float s = sc[nt][2 * kb + j / 2][j % 2];
          pj[j] = pscaled.of<kMasks>(s);
          ps[slot_row(kKDup, nt, t) * TOK + 32 * kb + 8 * j + g] = pj[j];
        }
        const float bsum = (pj[0] + pj[1]) + (pj[2] + pj[3]);
        if (kVZero || kb == KT - 1) {  // one butterfly for the row's sum; one per block where the values need it
          const float v = kVZero ? bsum : sum + bsum;
          float r = v + __shfl_xor_sync(0xffffffffu, v, 4);
          r += __shfl_xor_sync(0xffffffffu, r, 8);
          r += __shfl_xor_sync(0xffffffffu, r, 16);
          if (kVZero) {
            psum[nt][kb] = r;
            sum += r;
          } else {
            sum = r;
          }
        } else {
          sum += bsum;
        }
      }
      rows.l_run[nt] = fmaf(rows.l_run[nt], alpha, sum);
      rows.m_run[nt] = m_new;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) o[nt][mt][0] *= alpha, o[nt][mt][1] *= alpha;
    }
    __syncwarp();
    // B fragments of p: lane (g, t) takes row 4 nt + g / 2, tokens 32 kb + 8t .. + 7, part g & 1 (kKDup: row g, both
    // parts, pf[0] hi and pf[1] lo) (pf_in_smem: into this lane's slots of pfs, read back by this lane only)
    uint4 pf[NT][KT];
    if constexpr (kKDup) {  // both halves of the lane's row from one split of each pair (split_pairs)
#pragma unroll
      for (int kb = 0; kb < KT; ++kb) {
        const float* src = ps + g * TOK + 32 * kb + 8 * t;
        const float4 a = *reinterpret_cast<const float4*>(src), c = *reinterpret_cast<const float4*>(src + 4);
        const uint2 s0 = split_pairs(a.x, c.x), s1 = split_pairs(a.y, c.y), s2 = split_pairs(a.z, c.z),
                    s3 = split_pairs(a.w, c.w);
        const uint4 hi = make_uint4(s0.x, s1.x, s2.x, s3.x), lo = make_uint4(s0.y, s1.y, s2.y, s3.y);
        if constexpr (kPfSmem) pfs[kb * 32] = hi, pfs[(KT + kb) * 32] = lo;
        else pf[0][kb] = hi, pf[NT - 1][kb] = lo;
      }
    } else {
#pragma unroll
      for (int kb = 0; kb < KT; ++kb) {
        const float* src = ps + b_col_row(false, 0, g) * TOK + 32 * kb + 8 * t;
        const float4 a = *reinterpret_cast<const float4*>(src), c = *reinterpret_cast<const float4*>(src + 4);
        const float v[8] = {a.x, a.y, a.z, a.w, c.x, c.y, c.z, c.w};
        if constexpr (kPfSmem) pfs[kb * 32] = b_fragment(v, part);
        else pf[0][kb] = b_fragment(v, part);
      }
    }

    // ---- P.V: the value store's blocks f0 / 32 + kb of channels 16 mt + g (+ 8) ---------------------------------
    // (f0 / kTile in int64 at head_dim 128: with the 32-bit division ptxas allocated sm_80's 8-row hybrid kernel with
    // a spill; at 64 two fewer instructions)
    const uint32_t blk0 = D == 64 ? static_cast<uint32_t>(f0) / kTile : static_cast<uint32_t>(f0 / kTile);
    [[maybe_unused]] const uint32_t* const vct = vc_g + blk0 * VB;  // channel g's first block (not kRowPtrs)
    uint32_t gv[KT];
#pragma unroll
    for (int kb = 0; kb < KT; ++kb) gv[kb] = block_group(blk0 + kb, L.v_bpg_magic);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      // channels 16 mt + g and 16 mt + g + 8
      const uint32_t* ca;
      const uint32_t* cb8;
      if constexpr (kRowPtrs) {
        ca = offset_rows(vrow[2 * mt], blk0, VB * 4);
        cb8 = offset_rows(vrow[2 * mt + 1], blk0, VB * 4);
      } else {
        ca = offset_rows(vct, 16u * mt, vcs);
        cb8 = offset_rows(vct, 16u * mt + 8u, vcs);
      }
      if (mt == 0 && prefetch_next) {  // the next step's first block of channels lane + 32 i = g + (lane - g + 32 i)
#pragma unroll
        for (int i = 0; i < D / 32; ++i) {
          if constexpr (kRowPtrs) prefetch_l2(offset_rows(vpf[i], blk0, VB * 4));
          else prefetch_l2(offset_rows(ca, static_cast<uint32_t>(lane - g) + 32u * i, vcs) + TOK * kWarps / kTile * VB);
        }
      }
#pragma unroll
      for (int kb = 0; kb < KT; ++kb) {
        uint32_t Xa, Xha, Xb, Xhb;
        load_gather_block<VB, kVOwnWord>(ca + kb * VB, tw, sel_lo, sel_hi, Xa, Xha);
        load_gather_block<VB, kVOwnWord>(cb8 + kb * VB, tw, sel_lo, sel_hi, Xb, Xhb);
        if (mt == 0 && kb == 0) {
          // The step's value affines, after the first tile's code loads are issued, as the keys' above: the store's
          // (mt, g) channel pairs over the lanes (VPL each), every block's group
#pragma unroll
          for (int q = 0; q < VPL; ++q) {
            const int pr = lane + 32 * q;
            const uint16_t *s_a, *s_b, *z_a = nullptr, *z_b = nullptr;
            if constexpr (kRowPtrs) {
              s_a = vs_a[q], s_b = vs_b[q];
              if constexpr (kVZero) z_a = vz_a[q], z_b = vz_b[q];
            } else {
              const uint32_t ch = 16u * (pr / 8) + (pr % 8);
              s_a = offset_rows(vs0, ch, vss);
              s_b = offset_rows(s_a, 8u, vss);
              if constexpr (kVZero) z_a = offset_rows(vz0, ch, vzs), z_b = offset_rows(z_a, 8u, vzs);
            }
#pragma unroll
            for (int k = 0; k < KT; ++k) {
              const GroupAffine fa = group_affine<VM, VB>(__ldg(s_a + gv[k]), kVZero ? __ldg(z_a + gv[k]) : uint16_t{0});
              const GroupAffine fb = group_affine<VM, VB>(__ldg(s_b + gv[k]), kVZero ? __ldg(z_b + gv[k]) : uint16_t{0});
              vtab[(k * MT + pr / 8) * 8 + pr % 8] = affine_entry<kVZero>(fa, fb);
            }
          }
          // publishes the table (this step's reads of the keys' table in the same bytes came before its softmax's
          // __syncwarp)
          __syncwarp();
        }
        const VAff e = vtab[(kb * MT + mt) * 8 + g];  // channels 16 mt + g, + 8 at block kb's group
        uint32_t ha[4], hb[4];
        decode_inner_q<VB, VOFF>(Xa, Xha, L.dec_v, ha);
        decode_inner_q<VB, VOFF>(Xb, Xhb, L.dec_v, hb);
        if constexpr (kKDup) {  // d: (channel 16 mt + g, rows 2t, 2t + 1), (channel + 8, the same)
          float d[4];
          block_mma4(d, ha, hb, kPfSmem ? pfs[kb * 32] : pf[0][kb], kPfSmem ? pfs[(KT + kb) * 32] : pf[NT - 1][kb]);
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            if constexpr (kVZero) {
              o[nt][mt][0] = fmaf(e.x, d[nt], fmaf(e.z, psum[nt][kb], o[nt][mt][0]));
              o[nt][mt][1] = fmaf(e.y, d[2 + nt], fmaf(e.w, psum[nt][kb], o[nt][mt][1]));
            } else {
              o[nt][mt][0] = fmaf(e.x, d[nt], o[nt][mt][0]);
              o[nt][mt][1] = fmaf(e.y, d[2 + nt], o[nt][mt][1]);
            }
          }
        } else {
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            float d[4];
            block_mma2(d, ha, hb, kPfSmem ? pfs[(nt * KT + kb) * 32] : pf[nt][kb]);
            if constexpr (kVZero) {
              o[nt][mt][0] = fmaf(e.x, d[0] + d[1], fmaf(e.z, psum[nt][kb], o[nt][mt][0]));
              o[nt][mt][1] = fmaf(e.y, d[2] + d[3], fmaf(e.w, psum[nt][kb], o[nt][mt][1]));
            } else {
              o[nt][mt][0] = fmaf(e.x, d[0] + d[1], o[nt][mt][0]);
              o[nt][mt][1] = fmaf(e.y, d[2] + d[3], o[nt][mt][1]);
            }
          }
        }
      }
    }
  };
  // Not at 4 rows and head_dim 128, whose 3 CTAs an SM (168 registers) spilled between the two loops (innerq_small,
  // sm_90): one loop with the masks there, 3-4 % more instructions a step, within the budget.
  run_warp_steps<NT, TOK, !(D == 128 && NT == 1)>(rows, masked, lo, hi, warp, warp_step);

  // ---- merge the warps' partials (log-sum-exp, warp order) and write the split's slot of the workspace -----------
  __syncwarp();  // the loop's last reads of the affine table, in the slice of om written here
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int r = slot_row(kKDup, nt, t);
    float* dst = om + (warp * QR + r) * D;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) dst[16 * mt + g] = o[nt][mt][0], dst[16 * mt + g + 8] = o[nt][mt][1];
    if (g == 0) {
      ml[(warp * QR + r) * 2] = masked ? rows.m_run[nt] : rows.m_run[nt] * us[nt];
      ml[(warp * QR + r) * 2 + 1] = rows.l_run[nt] * (1.f / kPScale);
    }
  }
  __syncthreads();
  merge_warps<D, QR>(p, L, c, om, ml, tid);
}

// ---- KIVI layouts: keys "cols" (a channel's codes along tokens, groups of G tokens), values "rows" ----------------
// Both products reduce over a store's rows with asym groups along its columns, the form of gemv_kivi (kivi_mma.cuh):
// A = 16 store columns x 16 store rows, dequantized to fp16 (s * u + z) before the MMA, B = the other operand's hi / lo
// pairs of the thread's rows 4t .. 4t + 3. Per warp step of 64 tokens:
//   scores  the key store's rows are channels: D / 16 k-steps; lane g owns tokens 8g .. 8g + 7 of the step (8 columns,
//           4 m-tiles); B = q' staged once per CTA as fragments [NT][D / 16][32 lanes]. Thread (g, t) gets the scores of
//           query row slot_row(nt, t) for its 8 tokens: 4 nt + t, B's columns 4 rows x (hi, lo); with 8 rows (kKDup)
//           2t + nt, B's columns the 8 rows and the fragments' two "n-tiles" the hi and lo halves, two MMAs into one
//           accumulator (kstep_compute_paired's KDUP).
//   softmax as the InnerQ tiles (3 shuffles for a row's max and sum); p * 2^14, split into its fp16 hi and lo halves
//           by the thread that computed it (8 tokens: 4 pairs), to the warp's shared rows (kKiviPs, kivi_lo_at).
//   P.V     the value store's rows are tokens: 4 k-steps; lane g owns channels (D / 8) g .. + D / 8 - 1 (16 or 8
//           columns); B = p of the thread's 4 tokens, one 8-byte load of each half it takes. The fp32 accumulators
//           hold channel 2i (o[i][nt][0] + [1]) and 2i + 1 ([2] + [3]) of the lane's columns; with 8 rows o[i][0][nt]
//           and o[i][0][2 + nt] for row 2t + nt.
// Precision: the composed KIVI path's (gemv_kivi): every dequantized key and value is rounded once to fp16
// (relative 2^-11), products and sums fp32. The InnerQ tiles above are exact in the codes instead.
constexpr int kKiviTok = 64;  // tokens per warp step: 8 lanes x 8 key columns (= kStoreStep)
// fp16 elements per row of a warp's p halves (hi rows, then lo rows kKiviLo further): rows 32 bytes past the tokens and
// the lo rows 64 bytes past a multiple of 128, so that each half-warp's 8-byte P.V fragment loads (4 lanes g x 4 lanes
// t: 8 rows of one half, or 4 rows x both halves) fall in distinct banks, 2 wavefronts a load (the least). The
// softmax's 16-byte stores take 4 at 4 rows (the least) and 8 at 8 rows (rows 2t and 2t + 2 share banks; a row stride
// that separated them would put those loads' rows g and g + 2 in the same banks, and the loads are twice as many).
constexpr int kKiviPs = kKiviTok + 16;
__host__ __device__ constexpr int kivi_lo_at(int QR) { return QR * kKiviPs + 32; }

__host__ __device__ constexpr int kivi_smem_floats(int D, int QR) {
  return (QR + 3) / 4 * 4 + kWarps * (kivi_lo_at(QR) + QR * kKiviPs) / 2 + kWarps * QR * D + kWarps * QR * 2;
}
// After the floats: the key MMAs' B fragments [NT][D / 16][32 lanes] (uint2), then per warp the step's scales and
// zeros in the MMAs' row pairs (uint4): keys [2 token halves][D / 4 channel quads], values [D / 32 groups at most][TOK
// / 4 token quads].
__host__ __device__ constexpr int kivi_smem_bytes(int D, int QR) {
  return kivi_smem_floats(D, QR) * 4 + (QR / 4) * (D / 16) * 32 * 8 + kWarps * (2 * (D / 4) + (D / 32) * (kKiviTok / 4)) * 16;
}

// Resident CTAs of the KIVI tiles: 3 with 4 query rows (168 registers, no spill, +14-18 instructions a step against
// 192-206 registers at 2 CTAs; 12 warps an SM keep 1.5x the loads in flight), 2 with 8 (at 3, head_dim 64 also fits
// 168 registers but takes +6-14 instructions a step, 10.3 -> 10.4 per byte at 2 bits, which the model calls slower;
// its 1- and 4-bit instantiations take <= 168 registers at 2 and so hold 3 CTAs anyway)
__host__ __device__ constexpr int kivi_min_ctas(int NT) { return NT == 1 ? 3 : 2; }

template <int D, int NT, int KB, int VB>
__global__ void __launch_bounds__(kThreads, kivi_min_ctas(NT)) kivi_tiles_kernel(const DecodeAttentionParams p, const StoreTilesLaunch L) {
  constexpr int TOK = kKiviTok, QR = 4 * NT, KS = D / 16, VS = TOK / 16;
  constexpr int KCPL = 8, VCPL = D / 8;  // columns per lane: key tokens, value channels
  static_assert(8 * KCPL == TOK && (VCPL == 8 || VCPL == 16), "a warp step covers 8 lanes' columns");
  extern __shared__ __align__(16) float smem[];
  constexpr bool kKDup = NT == 2;  // 8 rows: the k-split MMAs (see above)
  constexpr int ND = kKDup ? 1 : NT;  // accumulator n-tiles
  float* const unscale_s = smem;                       // [QR] (padded to 4)
  constexpr int kPsHalves = kivi_lo_at(QR) + QR * kKiviPs;  // a warp's p: [QR][kKiviPs] hi, at kivi_lo_at the lo
  float* const ps_all = unscale_s + (QR + 3) / 4 * 4;  // [kWarps][kPsHalves] fp16
  float* const om = ps_all + kWarps * kPsHalves / 2;   // [kWarps][QR][D]; before the loop: the staged queries [QR][D]
  float* const ml = om + kWarps * QR * D;              // [kWarps][QR][2]
  uint2* const qf = reinterpret_cast<uint2*>(ml + kWarps * QR * 2);  // [NT][KS][32]

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane >> 2, t = lane & 3;
  uint4* const tables = reinterpret_cast<uint4*>(qf + NT * KS * 32);      // keys' [kWarps][2][D / 4], then values'
  uint4* const kaff = tables + warp * 2 * (D / 4);                          // the warp's [2][D / 4]
  uint4* const vaff = tables + kWarps * 2 * (D / 4) + warp * (D / 32) * (TOK / 4);  // and [D / 32][TOK / 4]
  const TileCta c = tile_cta<QR>(p, L);
  const int64_t b = c.b, hk = c.hk, S = c.S, lo = c.lo, hi = c.hi;

  // L2 prefetch of the warp's first step before the queries are staged, as in the InnerQ tiles: every key channel's
  // codes of the step and its group's scale and zero (cold here), the step's value rows (codes, scales, zeros)
  if (L.prefetch && lo + TOK * warp < hi) {
    const AttnStore& K = p.keys;
    const AttnStore& V = p.values;
    const uint32_t f0 = static_cast<uint32_t>(lo + TOK * warp), kw0 = f0 / 32 * KB;
    const uint32_t kg0 = block_group(f0 / 32, L.v_bpg_magic);
#pragma unroll
    for (int i = 0; i < D / 32; ++i) {
      const uint32_t ch = static_cast<uint32_t>(lane) + 32u * i;
      prefetch_l2(offset_rows(K.codes + b * K.c_sb + hk * K.c_sh, ch, row_bytes(K.c_sr, 4)) + kw0);
      prefetch_l2(offset_rows(K.scales + b * K.s_sb + hk * K.s_sh, ch, row_bytes(K.s_sr, 2)) + kg0);
      prefetch_l2(offset_rows(K.zeros + b * K.z_sb + hk * K.z_sh, ch, row_bytes(K.z_sr, 2)) + kg0);
    }
#pragma unroll
    for (int j = 0; j < TOK / 32; ++j) {
      const uint32_t r = f0 + 32u * j + static_cast<uint32_t>(lane);
      prefetch_l2(offset_rows(V.codes + b * V.c_sb + hk * V.c_sh, r, row_bytes(V.c_sr, 4)));
      prefetch_l2(offset_rows(V.scales + b * V.s_sb + hk * V.s_sh, r, row_bytes(V.s_sr, 2)));
      prefetch_l2(offset_rows(V.zeros + b * V.z_sb + hk * V.z_sh, r, row_bytes(V.z_sr, 2)));
    }
  }

  // ---- queries, then the key MMAs' B fragments: lane (g, t) of k-step ks, n-tile nt: q'[4 nt + g / 2][16 ks + 4t ..
  // + 3], part g & 1 (kKDup: q'[g][...], part nt) -------------------------------------------------------------------
  stage_queries<D, QR>(p, L, c, om, unscale_s, warp, lane);
  __syncthreads();
  for (int i = tid; i < NT * KS * 32; i += kThreads) {
    const int ln = i % 32, ks = (i / 32) % KS, nt = i / (32 * KS), lg = ln >> 2;
    const float* src = om + b_col_row(kKDup, nt, lg) * D + 16 * ks + 4 * (ln & 3);
    const float pl = static_cast<float>(b_col_lo(kKDup, nt, lg));
    qf[i] = make_uint2(split_pair(src[0], src[1], pl), split_pair(src[2], src[3], pl));
  }
  float us[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) us[nt] = unscale_s[slot_row(kKDup, nt, t)];
  __syncthreads();

  // ---- the warp's score rows: mask pointers or causal limits, running max and sum ---------------------------------
  ScoreRows<NT> rows = score_rows<NT, kKDup>(p, L, c, t);
  const bool masked = p.mask != nullptr;

  // Addressing (32-bit row offsets from 64-bit slice bases, as above). Keys: this thread's channel rows 16 ks + 4t + j,
  // at the lane's tokens of the step: word (f0 / 32) KB + kslot.word, group of token f0 + 8g. Values: token rows
  // f0 + 16 vs + 4t + j, at the lane's channels VCPL g (word vslot.word, group VCPL g / G).
  // Scales and zeros: an MMA thread needs its 4 rows' (s, z) of one group per k-step, as fp16 pairs of rows (4t, 4t + 1)
  // and (4t + 2, 4t + 3). Four lanes share each key group, and every load is 2 bytes with its own address (~3
  // instructions) and a PRMT per pair: 96 loads a step. Instead each lane loads a distinct part of the step's scales and
  // zeros once (keys: a quad of channels per token half; values: a pair of token rows, every group), pairs them and
  // stores them to the warp's tables, and each k-step reads its 4 pairs with one 16-byte LDS.
  const AttnStore& K = p.keys;
  const AttnStore& V = p.values;
  const uint32_t kcs = row_bytes(K.c_sr, 4), kss = row_bytes(K.s_sr, 2), kzs = row_bytes(K.z_sr, 2);
  const uint32_t vcs = row_bytes(V.c_sr, 4), vss = row_bytes(V.s_sr, 2), vzs = row_bytes(V.z_sr, 2);
  const uint32_t kcs16 = 16u * kcs, vcs16 = 16u * vcs;  // a k-step's 16 rows
  const LaneSlot kslot = lane_slot<KB>(KCPL * g), vslot = lane_slot<VB>(VCPL * g);
  LaneSel ksel, vsel;
#pragma unroll
  for (int i = 0; i < 4; ++i) ksel.sel[i] = pair_sel(kslot.byte0 + i), vsel.sel[i] = pair_sel(vslot.byte0 + i);
  ksel.hsel[0] = ksel.hsel[1] = vsel.hsel[0] = vsel.hsel[1] = 0u;  // no 3-bit stores here (kivi_kernel_for)
  const uint32_t* const kc_t = offset_rows(K.codes + b * K.c_sb + hk * K.c_sh + kslot.word, 4u * t, kcs);
  // the lane's staging items: keys, channel quad kq = i % (D / 4) at token half i / (D / 4) for i = lane + 32 m;
  // values, token rows 2 lane and 2 lane + 1 of the step in each of the n_vg groups
  constexpr int KITEMS = 2 * (D / 4) / 32;
  const uint32_t kq = static_cast<uint32_t>(lane % (D / 4));
  const uint16_t* const ks_q = offset_rows(K.scales + b * K.s_sb + hk * K.s_sh, 4u * kq, kss);
  const uint16_t* const kz_q = offset_rows(K.zeros + b * K.z_sb + hk * K.z_sh, 4u * kq, kzs);
  const int n_vg = D / p.group_size;
  const int vgi = VCPL * g / p.group_size;
  const uint32_t* const vc_b = V.codes + b * V.c_sb + hk * V.c_sh + vslot.word;
  const uint16_t* const vs_b = V.scales + b * V.s_sb + hk * V.s_sh;
  const uint16_t* const vz_b = V.zeros + b * V.z_sb + hk * V.z_sh;
  // the warp's p halves (kPsHalves); this lane's P.V fragment loads start at pf_lane: row 4 nt + g / 2, half g & 1
  // (kKDup: row g, each half)
  constexpr int kLo = kivi_lo_at(QR);
  uint16_t* const ps = reinterpret_cast<uint16_t*>(ps_all + warp * kPsHalves / 2);
  const uint16_t* const pf_lane = ps + (kKDup ? g * kKiviPs : (g & 1) * kLo + (g >> 1) * kKiviPs) + 4 * t;

  float o[VCPL / 2][ND][4];
#pragma unroll
  for (int i = 0; i < VCPL / 2; ++i)
#pragma unroll
    for (int nt = 0; nt < ND; ++nt) o[i][nt][0] = o[i][nt][1] = o[i][nt][2] = o[i][nt][3] = 0.f;

  // One warp step from f0, with or without the masks (run_warp_steps)
  const auto warp_step = [&](const int64_t f0, auto masks) {
    constexpr bool kMasks = decltype(masks)::value;
    // L2 prefetch of the warp's next step, as in the InnerQ tiles: its key codes in every channel with this step's
    // first key loads, its value rows (codes, scales, zeros) with this step's first value loads (a key channel's group
    // scales and zeros span 64 groups a line: earlier steps have them in cache)
    const bool prefetch_next = L.prefetch && f0 + TOK * kWarps < hi;
    // ---- scores of tokens f0 + 8g + j, j = 0 .. 7 -------------------------------------------------------------------
    const uint32_t kw = static_cast<uint32_t>(f0 / 32) * KB;  // the step's first word
    // the step's word offset goes into the row base once, so each load below is one IMAD.WIDE with a literal row
    // (base + (16 ks + j) * stride + kw would cost a 64-bit add per load after it)
    const uint32_t* const kc_s = kc_t + kw;
    // the thread's 4 rows of the first k-step; each row's pointer then moves on by 16 rows per k-step, one 64-bit add
    // (laundered: else ptxas re-derives each load's address from kc_s, a multiply and a 64-bit add)
    const uint32_t* kr[4];
    kr[0] = kc_s;
#pragma unroll
    for (int j = 1; j < 4; ++j) kr[j] = launder(offset_rows(kr[j - 1], 1u, kcs));
    float d[KCPL / 2][ND][4];
#pragma unroll
    for (int i = 0; i < KCPL / 2; ++i)
#pragma unroll
      for (int nt = 0; nt < ND; ++nt) d[i][nt][0] = d[i][nt][1] = d[i][nt][2] = d[i][nt][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      LaneCodes<KB, KCPL> lc[4];
      if (ks == 0 && prefetch_next) {  // channel 4t + (g & 3) + 16 (g >> 2) + 32 i: every channel once, offset >= 0
#pragma unroll
        for (int i = 0; i < D / 32; ++i)
          prefetch_l2(offset_rows(kc_s + TOK * kWarps / 32 * KB, (g & 3) + 16u * (g >> 2) + 32u * i, kcs));
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        load_lane<KB, KCPL, false>(lc[j], kr[j], nullptr);
        if (ks + 1 < KS) kr[j] = launder(offset_rows(kr[j], 1u, kcs16));
      }
      if (ks == 0) {  // after the first k-step's code loads are issued: the keys' table (see Addressing)
#pragma unroll
        for (int m = 0; m < KITEMS; ++m) {
          const int half = (lane + 32 * m) / (D / 4);
          const uint32_t grp = block_group(static_cast<uint32_t>(f0 / 32) + half, L.v_bpg_magic);
          const uint16_t* sq = ks_q + grp;  // row by row, one 64-bit add each (as kr)
          const uint16_t* zq = kz_q + grp;
          uint16_t sk[4], zk[4];
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            sk[j] = __ldg(sq), zk[j] = __ldg(zq);
            if (j < 3) sq = launder(offset_rows(sq, 1u, kss)), zq = launder(offset_rows(zq, 1u, kzs));
          }
          kaff[half * (D / 4) + kq] = make_uint4(pack_half2(sk[0], sk[1]), pack_half2(sk[2], sk[3]),
                                                 pack_half2(zk[0], zk[1]), pack_half2(zk[2], zk[3]));
        }
        // the table's writes before any lane reads it (the previous step's reads came before its softmax's
        // __syncwarp, so these writes do not race them)
        __syncwarp();
      }
      const uint4 kf = kaff[(g >> 2) * (D / 4) + 4 * ks + t];  // (s01, s23, z01, z23) of rows 16 ks + 4t + j
      kstep_compute_paired<KB, NT, KCPL, kKDup>(lc, kf.x, kf.y, kf.z, kf.w, qf + ks * 32 + lane, KS * 32, ksel,
                                                L.kivi_k, d);
    }
    float sc[NT][KCPL];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < KCPL / 2; ++i) {
        sc[nt][2 * i] = kKDup ? d[i][0][nt] : d[i][nt][0] + d[i][nt][1];
        sc[nt][2 * i + 1] = kKDup ? d[i][0][2 + nt] : d[i][nt][2] + d[i][nt][3];
      }

    // ---- online softmax of the thread's rows; p * 2^14 to the warp's shared tile ---------------------------------
    __syncwarp();  // the previous step's p is read
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      // the lane's offset inside tok (not lane_tok): 1 point less at 1 bit, head_dim 64, 8 rows (ptxas)
      const float kl = masked ? kLog2e : us[nt] * kLog2e;  // the store tiles' softmax (see there)
      const auto tok_of = [&](int j) { return KCPL * g + j; };
      const StepMax sm =
          step_max<KCPL, kMasks>(sc[nt], rows, nt, S + f0, static_cast<int>(f0 - lo), 0, tok_of, us[nt], kl);
      const float m_new = sm.m_new, alpha = sm.alpha;
      const PScaled pscaled(sm.seen ? m_new : 0.f, kl);
      float pj[KCPL];  // p * 2^14
#pragma unroll
      for (int j = 0; j < KCPL; ++j) pj[j] = pscaled.of<kMasks>(sc[nt][j]);
      float sum = pj[0];
#pragma unroll
      for (int j = 1; j < KCPL; ++j) sum += pj[j];
      // split here, once per pair of p (read back, the hi lane and the lo lane that take it would each split it)
      uint2 sp[KCPL / 2];
#pragma unroll
      for (int j = 0; j < KCPL / 2; ++j) sp[j] = split_pairs(pj[2 * j], pj[2 * j + 1]);
      uint16_t* const dst = ps + slot_row(kKDup, nt, t) * kKiviPs + KCPL * g;
      *reinterpret_cast<uint4*>(dst) = make_uint4(sp[0].x, sp[1].x, sp[2].x, sp[3].x);
      *reinterpret_cast<uint4*>(dst + kLo) = make_uint4(sp[0].y, sp[1].y, sp[2].y, sp[3].y);
      sum += __shfl_xor_sync(0xffffffffu, sum, 4);
      sum += __shfl_xor_sync(0xffffffffu, sum, 8);
      sum += __shfl_xor_sync(0xffffffffu, sum, 16);
      rows.l_run[nt] = fmaf(rows.l_run[nt], alpha, sum);
      rows.m_run[nt] = m_new;
#pragma unroll
      for (int i = 0; i < VCPL / 2; ++i) {
        if constexpr (kKDup) {  // this row's accumulators: o[i][0][nt], o[i][0][2 + nt]
          o[i][0][nt] *= alpha, o[i][0][2 + nt] *= alpha;
        } else {
#pragma unroll
          for (int k = 0; k < 4; ++k) o[i][nt][k] *= alpha;
        }
      }
    }
    __syncwarp();
    // B fragments of p: lane (g, t) of k-step vs takes tokens 16 vs + 4t .. + 3 of row 4 nt + g / 2, half g & 1
    // (kKDup: of row g, half nt), one 8-byte load
    uint2 pf[VS][NT];
#pragma unroll
    for (int vs = 0; vs < VS; ++vs)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        pf[vs][nt] = *reinterpret_cast<const uint2*>(pf_lane + (kKDup ? nt * kLo : 4 * nt * kKiviPs) + 16 * vs);

    // ---- P.V: value rows f0 + 16 vs + 4t + j at the lane's channels ---------------------------------------------
    const uint32_t row0 = static_cast<uint32_t>(f0) + 4u * t;
    const uint32_t* const vc_s = offset_rows(vc_b, row0, vcs);  // the step's rows, as the keys' columns above
    const uint32_t* vr[4];  // (as kr)
    vr[0] = vc_s;
#pragma unroll
    for (int j = 1; j < 4; ++j) vr[j] = launder(offset_rows(vr[j - 1], 1u, vcs));
    const uint16_t* const vs_r = offset_rows(vs_b, static_cast<uint32_t>(f0) + 2u * lane, vss);  // the lane's 2 rows
    const uint16_t* const vz_r = offset_rows(vz_b, static_cast<uint32_t>(f0) + 2u * lane, vzs);
#pragma unroll
    for (int vs = 0; vs < VS; ++vs) {
      LaneCodes<VB, VCPL> lc[4];
      if (vs == 0 && prefetch_next) {  // rows f0 + TOK kWarps + 8t + g + 32 j: each once, offset >= 0 from row0
#pragma unroll
        for (int j = 0; j < TOK / 32; ++j) {
          const uint32_t dr = TOK * kWarps + 32u * j + 4u * t + g;
          prefetch_l2(offset_rows(vc_s, dr, vcs));
          prefetch_l2(offset_rows(vs_r, TOK * kWarps + j, vss));  // rows f0 + TOK kWarps + 2 lane + j
          prefetch_l2(offset_rows(vz_r, TOK * kWarps + j, vzs));
        }
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        load_lane<VB, VCPL, false>(lc[j], vr[j], nullptr);
        if (vs + 1 < VS) vr[j] = launder(offset_rows(vr[j], 1u, vcs16));
      }
      if (vs == 0) {  // the values' table, after the first k-step's code loads (the previous step's reads of it came
                      // before this step's softmax __syncwarp)
        const uint16_t* const vs_r1 = offset_rows(vs_r, 1u, vss);
        const uint16_t* const vz_r1 = offset_rows(vz_r, 1u, vzs);
#pragma unroll
        for (int vg = 0; vg < D / 32; ++vg) {
          if (vg < n_vg) {  // token quad lane / 2, its row pair lane & 1: (s, z) in .x, .y or .z, .w
            const uint32_t sp = pack_half2(__ldg(vs_r + vg), __ldg(vs_r1 + vg));
            const uint32_t zp = pack_half2(__ldg(vz_r + vg), __ldg(vz_r1 + vg));
            reinterpret_cast<uint2*>(vaff + vg * (TOK / 4) + lane / 2)[lane & 1] = make_uint2(sp, zp);
          }
        }
        __syncwarp();
      }
      const uint4 vf = vaff[vgi * (TOK / 4) + 4 * vs + t];  // (s01, z01, s23, z23) of rows 16 vs + 4t + j
      kstep_compute_paired<VB, NT, VCPL, kKDup>(lc, vf.x, vf.z, vf.y, vf.w, &pf[vs][0], 1, vsel, L.kivi_v, o);
    }
  };
  run_warp_steps<NT, TOK, true>(rows, masked, lo, hi, warp, warp_step);

  // ---- merge the warps' partials and write the split's slot of the workspace --------------------------------------
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int r = slot_row(kKDup, nt, t);
    float* dst = om + (warp * QR + r) * D + VCPL * g;
#pragma unroll
    for (int i = 0; i < VCPL / 2; ++i) {
      dst[2 * i] = kKDup ? o[i][0][nt] : o[i][nt][0] + o[i][nt][1];
      dst[2 * i + 1] = kKDup ? o[i][0][2 + nt] : o[i][nt][2] + o[i][nt][3];
    }
    if (g == 0) {
      ml[(warp * QR + r) * 2] = masked ? rows.m_run[nt] : rows.m_run[nt] * us[nt];
      ml[(warp * QR + r) * 2 + 1] = rows.l_run[nt] * (1.f / kPScale);
    }
  }
  __syncthreads();
  merge_warps<D, QR>(p, L, c, om, ml, tid);
}

// ---- instantiations: the InnerQ presets' (key bits, mode, value bits, mode) --------------------------------------
using StoreKernel = void (*)(const DecodeAttentionParams, const StoreTilesLaunch);

struct StoreCombo {
  int kb;
  QuantMode km;
  int vb;
  QuantMode vm;
};
// innerq_base, innerq_small, innerq_hybrid, innerq_asym4, innerq_asym1_eta
constexpr StoreCombo kCombos[] = {{3, QuantMode::kSym, 3, QuantMode::kSym},
                                  {3, QuantMode::kSym, 2, QuantMode::kSym},
                                  {3, QuantMode::kSym, 2, QuantMode::kHybrid},
                                  {4, QuantMode::kAsym, 4, QuantMode::kAsym},
                                  {1, QuantMode::kAsym, 1, QuantMode::kAsym}};

constexpr int kNumCombos = static_cast<int>(sizeof(kCombos) / sizeof(kCombos[0]));

// The kernel of combination `combo` (index into kCombos): one instantiation per entry, the list written once.
template <int D, int NT, size_t... I>
StoreKernel store_kernel_of(int combo, std::index_sequence<I...>) {
  static const StoreKernel kernels[] = {
      &store_tiles_kernel<D, NT, kCombos[I].kb, kCombos[I].km, kCombos[I].vb, kCombos[I].vm>...};
  return kernels[combo];
}

template <int D, int NT>
StoreKernel store_kernel_for(int combo) {
  return store_kernel_of<D, NT>(combo, std::make_index_sequence<kNumCombos>{});
}

int combo_of(const DecodeAttentionParams& p) {
  for (int i = 0; i < kNumCombos; ++i) {
    const StoreCombo& c = kCombos[i];
    if (p.keys.bits == c.kb && p.keys.mode == c.km && p.values.bits == c.vb && p.values.mode == c.vm) return i;
  }
  return -1;
}

// KIVI tiles: the KIVI presets' (kivi2, kivi4, kivi1_eta) equal key and value widths, asym both.
template <int D, int NT>
StoreKernel kivi_kernel_for(int bits) {
  switch (bits) {
    case 1: return &kivi_tiles_kernel<D, NT, 1, 1>;
    case 2: return &kivi_tiles_kernel<D, NT, 2, 2>;
    case 4: return &kivi_tiles_kernel<D, NT, 4, 4>;
    default: return nullptr;
  }
}

bool innerq_layouts(const DecodeAttentionParams& p) {
  return p.keys.layout == StoreLayout::kRows && p.values.layout == StoreLayout::kCols;
}
bool kivi_layouts(const DecodeAttentionParams& p) {
  return p.keys.layout == StoreLayout::kCols && p.values.layout == StoreLayout::kRows;
}

StoreKernel store_kernel(const DecodeAttentionParams& p, int nt) {
  if (kivi_layouts(p)) {
    if (p.keys.mode != QuantMode::kAsym || p.values.mode != QuantMode::kAsym || p.keys.bits != p.values.bits)
      return nullptr;
    if (p.D == 64) return nt == 1 ? kivi_kernel_for<64, 1>(p.keys.bits) : kivi_kernel_for<64, 2>(p.keys.bits);
    if (p.D == 128) return nt == 1 ? kivi_kernel_for<128, 1>(p.keys.bits) : kivi_kernel_for<128, 2>(p.keys.bits);
    return nullptr;
  }
  const int combo = combo_of(p);
  if (combo < 0) return nullptr;
  if (p.D == 64) return nt == 1 ? store_kernel_for<64, 1>(combo) : store_kernel_for<64, 2>(combo);
  if (p.D == 128) return nt == 1 ? store_kernel_for<128, 1>(combo) : store_kernel_for<128, 2>(combo);
  return nullptr;
}

int smem_bytes(const DecodeAttentionParams& p, int nt) {
  return kivi_layouts(p) ? kivi_smem_bytes(p.D, 4 * nt) : store_smem_bytes(p.D, 4 * nt, p.keys.mode, p.values.mode);
}

}  // namespace

bool store_tiles_supported(const DecodeAttentionParams& p) {
  if (!innerq_layouts(p) && !kivi_layouts(p)) return false;
  if ((p.D != 64 && p.D != 128) || store_kernel(p, 1) == nullptr) return false;
  if (p.group_size <= 0 || p.group_size > p.D || p.D % p.group_size != 0 || p.group_size % 32 != 0) return false;
  if (kivi_layouts(p) && (p.keys.zeros == nullptr || p.values.zeros == nullptr)) return false;
  if (std::min(p.keys.m, p.values.m) >= kLimitCap) return false;  // the score rows' 32-bit causal limits
  // the kernel's 32-bit row offsets: each (b, h_kv) slice of codes / scales / zeros spans < 2^32 bytes
  const auto fits = [](int64_t rows, int64_t stride, int64_t esz) { return rows * stride * esz < (int64_t{1} << 32) - 64; };
  for (const AttnStore* st : {&p.keys, &p.values}) {
    const int64_t rows = st->layout == StoreLayout::kRows ? st->m + 64 : p.D;
    if (!fits(rows, st->c_sr, 4) || !fits(rows, st->s_sr, 2) || (st->zeros != nullptr && !fits(rows, st->z_sr, 2)))
      return false;
  }
  if (innerq_layouts(p) && p.keys.bits == 3) {  // whole key rows with 8-byte loads
    const uint64_t addr = reinterpret_cast<uint64_t>(p.keys.codes);
    if (addr % 8 != 0 || p.keys.c_sb % 2 != 0 || p.keys.c_sh % 2 != 0 || p.keys.c_sr % 2 != 0) return false;
  }
  return true;
}

bool plan_store_tiles(const DecodeAttentionParams& p, int64_t F_cap, StoreTilesLaunch& L) {
  const int64_t gq = p.H_q / p.H_kv, R = gq * p.T;
  L.nt = R <= 4 ? 1 : 2;
  L.prefetch = attention_prefetch();
  const StoreKernel fn = store_kernel(p, L.nt);
  if (fn == nullptr) return false;
  L.gq = static_cast<int>(gq);
  L.row_blocks = static_cast<int>(ceil_div(R, 4 * L.nt));
  int shift = 0;
  while ((32 << shift) < p.group_size) ++shift;
  L.k_group_shift = shift;
  L.v_bpg_magic = block_group_magic(p.group_size / 32);
  if (kivi_layouts(p)) {  // each kernel reads its own decoders' constants
    L.kivi_k = kivi_consts(p.keys.bits);
    L.kivi_v = kivi_consts(p.values.bits);
  } else {
    L.dec_k = decode_consts_for(p.keys.bits, p.keys.mode);
    L.dec_v = decode_consts_for(p.values.bits, p.values.mode);
  }
  const int64_t ctas = p.B * p.H_kv * L.row_blocks;
  int64_t C = p.split_tokens;
  if (C == 0)
    // a CTA's fixed work (query fragments, the warps' merge, partials) ~2 rounds of its 4 warps' 64-token steps
    C = planned_split_tokens(reinterpret_cast<const void*>(fn), kThreads, smem_bytes(p, L.nt), p.num_sms, ctas,
                             F_cap, kStoreStep, kMinSplitTokens, 8);
  C = round_up(C, kStoreStep);  // an explicit split_tokens (a multiple of G) to whole steps
  const int64_t splits = split_count(F_cap, C);
  L.C = C;
  L.num_splits = static_cast<int>(splits);
  return true;
}

cudaError_t launch_store_tiles(const DecodeAttentionParams& p, const StoreTilesLaunch& L, cudaStream_t stream) {
  const StoreKernel fn = store_kernel(p, L.nt);
  if (fn == nullptr) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(p.B * p.H_kv * L.row_blocks), static_cast<unsigned>(L.num_splits));
  fn<<<grid, kThreads, smem_bytes(p, L.nt), stream>>>(p, L);
  return cudaGetLastError();
}

}  // namespace kvk
