// Store tiles of decode_attention_fused on tensor cores: tokens [S, S + F) where the key store ("rows": InnerQ keys,
// per-token groups along channels) and the value store ("cols": InnerQ values, per-channel groups along tokens) both
// hold the token, F = min(mk, mv) rounded down to 64 (decode_attention.h). decode_attention.cu runs everything else
// (sink, store edges, tails, other layouts) with its general kernel and merges both kernels' partials.
//
// CTA = (b, h_kv, row block of 4 NT query rows, split of the store tokens), 4 warps. Each warp walks its own 32-token
// tiles (tiles w, w + 4, ... of the split) with its own online softmax, and the CTA merges the 4 warps' partials at
// the end, so no barrier runs inside the tile loop. Per tile and warp:
//   scores  S[j, r] = sum_c K[j, c] q'[r, c]: m16n8k16 MMAs with A = 16 key rows x 16 channels (codes decoded two per
//           LOP3 + HFMA2 to exact fp16 integers, mma.cuh) and B = the query rows as hi / lo fp16 pairs (8 columns =
//           4 rows x (hi, lo)), q' = x * key_x_scale * 2^e per row; each 32-channel block's fp32 result is folded
//           with the token's group scale (and zeff * sum(q') for asym / hybrid keys), as gemv_inner_q does.
//   softmax thread (g, t) holds tokens g, g + 8, 16 + g, 24 + g of query row t (per n-tile): the row's max and sum
//           over the tile are 3 shuffles each; p = exp(S - m) in fp32.
//   P.V     A = 16 channels x 16 tokens of the value store (the packed block of a channel is 32 tokens, so one tile is
//           one block and one group per channel), B = p * 2^14 as hi / lo pairs, staged through shared memory into
//           the B fragment's token order; the fp32 result is folded with the channel's group scale (and zeff * sum(p)).
// The fp32 accumulators therefore see every product of a code and a query / probability to ~2^-22 relative (the
// hi / lo split) and sum in fp32: the numerical contract of docs/FORMATS.md ("GEMV arithmetic"). p is scaled by
// 2^14 so that small probabilities stay normal fp16 numbers in the split; the partial divides it out.
//
// Instantiated for the (bits, mode) pairs of the InnerQ presets (kvkernels/formats.py) at head_dim 64 and 128 and 4 or
// 8 rows per CTA; the launcher falls back to the general kernel for anything else (store_tiles_supported).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "cuda/decode_attention.h"
#include "kvkernels/gemv.cuh"
#include "kvkernels/mma.cuh"

namespace kvk {
namespace {

constexpr int kThreads = 128;  // 4 warps, each its own tiles
constexpr int kWarps = kThreads / 32;
constexpr int kTile = 32;
constexpr float kPScale = 16384.f;  // p * 2^14 in the B fragments (p <= 1: at most 2^14, far below fp16's max)
constexpr int64_t kMinSplitTokens = 512;  // 2 steps per warp: the prologue and the merge stay small

// Shared memory (floats, all parts 16-byte aligned): staged queries [QR][D]; sum of each 32-channel block of a staged row [QR][D / 32]; 2^-e per
// row [QR] (padded to 4); per warp the step's p * 2^14 [QR][TOK]; per warp its partial output [QR][D] and (m, l) [QR][2].
// Tokens per warp step and resident CTAs (the register cap): a step of 64 halves the softmax, rescale and value
// addressing per token; with 8 query rows at head_dim 128 it would need more than 255 registers. Head_dim 64 at 4 rows
// fits 3 CTAs (168 registers); the others run 2 (8 warps per SM, each with a whole step's loads in flight). The
// trade between fewer instructions and fewer warps is the static model's choice, not yet measured on a GPU.
__host__ __device__ constexpr int tok_per_step(int D, int NT) { return D == 128 && NT == 2 ? 32 : 64; }
__host__ __device__ constexpr int store_min_ctas(int D, int NT) { return D == 64 && NT == 1 ? 3 : 2; }

__host__ __device__ constexpr int store_smem_floats(int D, int QR) {
  return QR * D + QR * (D / 32) + ((QR + 3) / 4) * 4 + kWarps * QR * tok_per_step(D, QR / 4) + kWarps * QR * D +
         kWarps * QR * 2;
}
// After the floats: the key MMAs' B fragments [NT][D / 32][32 lanes] (uint4; read back per block and m-tile, which
// costs fewer instructions than the spills 16-32 more live registers caused at head_dim 128).
__host__ __device__ constexpr int store_smem_bytes(int D, int QR) {
  return store_smem_floats(D, QR) * 4 + (QR / 4) * (D / 32) * 32 * 16;
}

// Canonical words of one key row's D / 32 blocks for thread t (bits 3: the whole row with 8-byte loads, the caller
// guarantees 8-byte aligned rows; other bits: the words the thread needs, load_gather_block).
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

// TOK: tokens per warp step, 32 or 64 (tok_per_step); a step of 64 halves the softmax, rescale and value-addressing
// work per token, at the cost of registers.
template <int D, int NT, int KB, QuantMode KM, int VB, QuantMode VM>
__global__ void __launch_bounds__(kThreads, store_min_ctas(D, NT)) store_tiles_kernel(const DecodeAttentionParams p, const StoreTilesLaunch L) {
  constexpr int TOK = tok_per_step(D, NT), KT = TOK / 32, KM16 = TOK / 16;
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

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane >> 2, t = lane & 3;
  const float part = static_cast<float>(g & 1);  // this lane's B column holds the lo (1) or hi (0) fp16 terms
  const int rb = static_cast<int>(blockIdx.x % static_cast<unsigned>(L.row_blocks));
  const int64_t bh = blockIdx.x / static_cast<unsigned>(L.row_blocks);
  const int64_t b = bh / p.H_kv, hk = bh % p.H_kv;
  const int split = blockIdx.y;
  const TokenCounts cnt = p.lengths != nullptr ? token_counts<true>(p) : token_counts<false>(p);
  const int64_t S = cnt.S, N = cnt.N, T = p.T;
  const int64_t F = store_tile_tokens(cnt.mk, cnt.mv);
  const int64_t lo = split * L.C, hi = min(F, lo + L.C);  // store tokens of the split (empty past F)
  const int R = L.gq * static_cast<int>(T);
  const int r0 = rb * QR, nr = min(QR, R - r0);

  // ---- queries: q' = x * key_x_scale, scaled per row by 2^e (max |q'| in [2^14, 2^15)) ---------------------------
  for (int r = warp; r < QR; r += kWarps) {
    const int q = r0 + min(r, nr - 1);
    const int64_t h = hk * L.gq + q / T, tq = q % T;
    const float* xr = p.x + b * p.x_sb + h * p.x_sh + tq * p.x_st;
    float v[NB];
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < NB; ++i) {
      const int c = lane + 32 * i;
      v[i] = 0.f;
      if (r < nr) v[i] = p.key_x_scale != nullptr ? __ldg(xr + c) * __ldg(p.key_x_scale + hk * p.xs_sh + c) : __ldg(xr + c);
      amax = nan_max(amax, fabsf(v[i]));
    }
    const int e = scale_exponent(warp_max(amax));
    const float sc = exp2i(e);
#pragma unroll
    for (int i = 0; i < NB; ++i) qs[r * D + lane + 32 * i] = v[i] * sc;
    if (lane == 0) unscale_s[r] = exp2i(-e);
  }
  __syncthreads();
  if constexpr (kKZero) {
    for (int i = tid; i < QR * NB; i += kThreads) {
      const float* blk = qs + (i / NB) * D + (i % NB) * 32;
      float s = 0.f;
      for (int c = 0; c < 32; ++c) s += blk[c];
      xsum_s[i] = s;
    }
    __syncthreads();
  }
  // the key MMAs' B fragments (warp 0 writes them all, the barrier below publishes them), the zero-term sums and 2^-e
  // of this thread's rows (4 nt + t)
  float xsr[NT][NB], us[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int cb = 0; cb < NB; ++cb) {
      if (warp == 0) {
        float v[8];
        const float* src = qs + (4 * nt + (g >> 1)) * D + 32 * cb + 8 * t;
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = src[i];
        qf[(nt * NB + cb) * 32 + lane] = b_fragment(v, part);
      }
      xsr[nt][cb] = kKZero ? xsum_s[(4 * nt + t) * NB + cb] : 0.f;
    }
    us[nt] = unscale_s[4 * nt + t];
  }
  __syncthreads();
  const uint4* const qfl = qf + lane;

  // ---- the warp's score rows: mask pointers or causal limits, running max and sum ---------------------------------
  const float* mrow[NT];
  int64_t limit[NT];
  bool live[NT];
  float m_run[NT], l_run[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int r = 4 * nt + t, q = r0 + min(r, nr - 1);
    const int64_t h = hk * L.gq + q / T, tq = q % T;
    live[nt] = r < nr;
    mrow[nt] = p.mask != nullptr ? p.mask + b * p.m_sb + h * p.m_sh + tq * p.m_st : nullptr;
    limit[nt] = N - T + tq;
    m_run[nt] = -INFINITY;
    l_run[nt] = 0.f;
  }

  // Addressing: 64-bit bases of the (b, h_kv) slices, rows reached by one mad.wide.u32 each (offset_rows) with the
  // row strides in bytes as 32-bit numbers (store_tiles_supported: every slice spans < 2^32 bytes). Value rows are
  // channels: this thread's channel g is the base, channel 16 mt + g (+ 8) adds a compile-time multiple of the stride.
  const AttnStore& K = p.keys;
  const AttnStore& V = p.values;
  const uint32_t kcs = static_cast<uint32_t>(K.c_sr) * 4u, kss = static_cast<uint32_t>(K.s_sr) * 2u;
  const uint32_t kzs = static_cast<uint32_t>(K.z_sr) * 2u;
  const uint32_t vcs = static_cast<uint32_t>(V.c_sr) * 4u, vss = static_cast<uint32_t>(V.s_sr) * 2u;
  const uint32_t vzs = static_cast<uint32_t>(V.z_sr) * 2u;
  const uint32_t* const kc = K.codes + b * K.c_sb + hk * K.c_sh;
  const uint16_t* const ksc = K.scales + b * K.s_sb + hk * K.s_sh;
  const uint16_t* const kz = kKZero ? K.zeros + b * K.z_sb + hk * K.z_sh : nullptr;
  const uint32_t* const vc_g = offset_rows(V.codes + b * V.c_sb + hk * V.c_sh, static_cast<uint32_t>(g), vcs);
  const uint16_t* const vs_g = offset_rows(V.scales + b * V.s_sb + hk * V.s_sh, static_cast<uint32_t>(g), vss);
  const uint16_t* const vz_g = kVZero ? offset_rows(V.zeros + b * V.z_sb + hk * V.z_sh, static_cast<uint32_t>(g), vzs) : nullptr;
  const uint32_t sel_lo = sel_bytes(2 * t, 2 * t + 1), sel_hi = sel_bytes(t, t);
  float* const ps = ps_all + warp * QR * TOK;

  float o[NT][MT][2];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) o[nt][mt][0] = o[nt][mt][1] = 0.f;

#pragma unroll 1
  for (int64_t f0 = lo + TOK * warp; f0 < hi; f0 += TOK * kWarps) {
    // ---- scores of tokens f0 + 16 mt + g + 8 i ------------------------------------------------------------------
    float sc[NT][KM16][2];
#pragma unroll
    for (int mt = 0; mt < KM16; ++mt) {
      const uint32_t ra = static_cast<uint32_t>(f0) + 16u * mt + g;  // token rows ra and ra + 8 of the key store
      uint32_t Xa[NB], Xha[NB], Xb[NB], Xhb[NB];
      const uint32_t* const rowa = offset_rows(kc, ra, kcs);
      key_row_words<KB, NB>(rowa, t, sel_lo, sel_hi, Xa, Xha);
      key_row_words<KB, NB>(offset_rows(rowa, 8u, kcs), t, sel_lo, sel_hi, Xb, Xhb);
      const uint16_t* const sa = offset_rows(ksc, ra, kss);
      const uint16_t* const sb = offset_rows(sa, 8u, kss);
      const uint16_t* const za = kKZero ? offset_rows(kz, ra, kzs) : nullptr;
      const uint16_t* const zb = kKZero ? offset_rows(za, 8u, kzs) : nullptr;
      float acc[NT][2];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = 0.f;
#pragma unroll
      for (int cb = 0; cb < NB; ++cb) {
        const int gi = cb >> L.k_group_shift;
        const GroupAffine fa = group_affine<KM, KB>(__ldg(sa + gi), kKZero ? __ldg(za + gi) : uint16_t{0});
        const GroupAffine fb = group_affine<KM, KB>(__ldg(sb + gi), kKZero ? __ldg(zb + gi) : uint16_t{0});
        uint32_t ha[4], hb[4];
        decode_inner_q<KB, KOFF>(Xa[cb], Xha[cb], L.dec_k, ha);
        decode_inner_q<KB, KOFF>(Xb[cb], Xhb[cb], L.dec_k, hb);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          float d[4];
          block_mma2(d, ha, hb, qfl[(nt * NB + cb) * 32]);
          if constexpr (kKZero) {
            acc[nt][0] = fmaf(fa.s, d[0] + d[1], fmaf(fa.zeff, xsr[nt][cb], acc[nt][0]));
            acc[nt][1] = fmaf(fb.s, d[2] + d[3], fmaf(fb.zeff, xsr[nt][cb], acc[nt][1]));
          } else {
            acc[nt][0] = fmaf(fa.s, d[0] + d[1], acc[nt][0]);
            acc[nt][1] = fmaf(fb.s, d[2] + d[3], acc[nt][1]);
          }
        }
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) sc[nt][mt][0] = acc[nt][0] * us[nt], sc[nt][mt][1] = acc[nt][1] * us[nt];
    }

    // ---- online softmax of the thread's rows; p * 2^14 to the warp's shared tile ---------------------------------
    float psum[NT][KT];  // sum of p * 2^14 over each 32-token block (the asym / hybrid values' zero term)
    __syncwarp();  // the previous step's p is read
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      float tmax = -INFINITY;
      if (mrow[nt] != nullptr) {  // caller's mask (CTA-uniform branch); rows past nr stay -inf
        const float* mj = mrow[nt] + (S + f0 + g);
#pragma unroll
        for (int mt = 0; mt < KM16; ++mt)
#pragma unroll
          for (int i = 0; i < 2; ++i) sc[nt][mt][i] = live[nt] ? sc[nt][mt][i] + __ldg(mj + 16 * mt + 8 * i) : -INFINITY;
      } else {  // causal: step token k is visible to the row while k <= its limit (-1: a row past nr)
        const int lim = live[nt] ? static_cast<int>(min(max(limit[nt] - (S + f0), int64_t{-1}), int64_t{TOK})) : -1;
#pragma unroll
        for (int mt = 0; mt < KM16; ++mt)
#pragma unroll
          for (int i = 0; i < 2; ++i) sc[nt][mt][i] = 16 * mt + 8 * i + g <= lim ? sc[nt][mt][i] : -INFINITY;
      }
#pragma unroll
      for (int mt = 0; mt < KM16; ++mt)
#pragma unroll
        for (int i = 0; i < 2; ++i) tmax = nan_max(tmax, sc[nt][mt][i]);
      tmax = nan_max(tmax, __shfl_xor_sync(0xffffffffu, tmax, 4));
      tmax = nan_max(tmax, __shfl_xor_sync(0xffffffffu, tmax, 8));
      tmax = nan_max(tmax, __shfl_xor_sync(0xffffffffu, tmax, 16));
      // nan_max: a NaN score poisons the row (fmaxf(-inf, NaN) = -inf would drop the whole step as unseen)
      const float m_new = nan_max(m_run[nt], tmax);
      float alpha = 1.f;
      const bool seen = m_new != -INFINITY;  // else nothing seen yet: keep m = -inf, l = 0, o = 0
      if (seen) alpha = expf(m_run[nt] - m_new);
      float sum = 0.f;
#pragma unroll
      for (int kb = 0; kb < KT; ++kb) {
        float bsum = 0.f;
#pragma unroll
        for (int mt = 2 * kb; mt < 2 * kb + 2; ++mt)
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const float pj = seen ? expf(sc[nt][mt][i] - m_new) : 0.f;
            bsum += pj;
            ps[(4 * nt + t) * TOK + 16 * mt + 8 * i + g] = pj * kPScale;
          }
        if (kVZero || kb == KT - 1) {  // one butterfly for the row's sum; one per block where the values need it
          const float v = kVZero ? bsum : sum + bsum;
          float r = v + __shfl_xor_sync(0xffffffffu, v, 4);
          r += __shfl_xor_sync(0xffffffffu, r, 8);
          r += __shfl_xor_sync(0xffffffffu, r, 16);
          if (kVZero) {
            psum[nt][kb] = r * kPScale;
            sum += r;
          } else {
            sum = r;
          }
        } else {
          sum += bsum;
        }
      }
      l_run[nt] = fmaf(l_run[nt], alpha, sum);
      m_run[nt] = m_new;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) o[nt][mt][0] *= alpha, o[nt][mt][1] *= alpha;
    }
    __syncwarp();
    // B fragments of p: lane (g, t) takes row 4 nt + g / 2, tokens 32 kb + 8t .. + 7, part g & 1
    uint4 pf[NT][KT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int kb = 0; kb < KT; ++kb) {
        const float* src = ps + (4 * nt + (g >> 1)) * TOK + 32 * kb + 8 * t;
        const float4 a = *reinterpret_cast<const float4*>(src), c = *reinterpret_cast<const float4*>(src + 4);
        const float v[8] = {a.x, a.y, a.z, a.w, c.x, c.y, c.z, c.w};
        pf[nt][kb] = b_fragment(v, part);
      }

    // ---- P.V: the value store's blocks f0 / 32 + kb of channels 16 mt + g (+ 8) ---------------------------------
    const uint32_t blk0 = static_cast<uint32_t>(f0 / kTile);
    const uint32_t* const vct = vc_g + blk0 * VB;  // channel g's first block
    uint32_t gv[KT];
#pragma unroll
    for (int kb = 0; kb < KT; ++kb) gv[kb] = block_group(blk0 + kb, L.v_bpg_magic);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      // channels 16 mt + g and 16 mt + g + 8
      const uint32_t* const ca = offset_rows(vct, 16u * mt, vcs);
      const uint32_t* const cb8 = offset_rows(vct, 16u * mt + 8u, vcs);
      const uint16_t* const sa = offset_rows(vs_g, 16u * mt, vss);
      const uint16_t* const sb = offset_rows(vs_g, 16u * mt + 8u, vss);
      const uint16_t* const za = kVZero ? offset_rows(vz_g, 16u * mt, vzs) : nullptr;
      const uint16_t* const zb = kVZero ? offset_rows(vz_g, 16u * mt + 8u, vzs) : nullptr;
#pragma unroll
      for (int kb = 0; kb < KT; ++kb) {
        uint32_t Xa, Xha, Xb, Xhb;
        load_gather_block<VB, true>(ca + kb * VB, t, sel_lo, sel_hi, Xa, Xha);
        load_gather_block<VB, true>(cb8 + kb * VB, t, sel_lo, sel_hi, Xb, Xhb);
        const GroupAffine fa = group_affine<VM, VB>(__ldg(sa + gv[kb]), kVZero ? __ldg(za + gv[kb]) : uint16_t{0});
        const GroupAffine fb = group_affine<VM, VB>(__ldg(sb + gv[kb]), kVZero ? __ldg(zb + gv[kb]) : uint16_t{0});
        uint32_t ha[4], hb[4];
        decode_inner_q<VB, VOFF>(Xa, Xha, L.dec_v, ha);
        decode_inner_q<VB, VOFF>(Xb, Xhb, L.dec_v, hb);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          float d[4];
          block_mma2(d, ha, hb, pf[nt][kb]);
          if constexpr (kVZero) {
            o[nt][mt][0] = fmaf(fa.s, d[0] + d[1], fmaf(fa.zeff, psum[nt][kb], o[nt][mt][0]));
            o[nt][mt][1] = fmaf(fb.s, d[2] + d[3], fmaf(fb.zeff, psum[nt][kb], o[nt][mt][1]));
          } else {
            o[nt][mt][0] = fmaf(fa.s, d[0] + d[1], o[nt][mt][0]);
            o[nt][mt][1] = fmaf(fb.s, d[2] + d[3], o[nt][mt][1]);
          }
        }
      }
    }
  }

  // ---- merge the warps' partials (log-sum-exp, warp order) and write the split's slot of the workspace -----------
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int r = 4 * nt + t;
    float* dst = om + (warp * QR + r) * D;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) dst[16 * mt + g] = o[nt][mt][0], dst[16 * mt + g + 8] = o[nt][mt][1];
    if (g == 0) ml[(warp * QR + r) * 2] = m_run[nt], ml[(warp * QR + r) * 2 + 1] = l_run[nt];
  }
  __syncthreads();
  for (int i = tid; i < nr * D; i += kThreads) {
    const int r = i / D, c = i % D;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = nan_max(mx, ml[(w * QR + r) * 2]);  // a NaN warp keeps m NaN
    float num = 0.f, den = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float mw = ml[(w * QR + r) * 2];
      if (mw == -INFINITY) continue;
      const float f = expf(mw - mx);
      num = fmaf(f, om[(w * QR + r) * D + c], num);
      den = fmaf(f, ml[(w * QR + r) * 2 + 1], den);
    }
    const int q = r0 + r;
    const int64_t h = hk * L.gq + q / T, tq = q % T;
    float* ws = partial_row(p, split, b, h, tq);
    ws[c] = num * (1.f / kPScale);
    if (c == 0) ws[D] = mx, ws[D + 1] = den;
  }
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

StoreKernel store_kernel(const DecodeAttentionParams& p, int nt) {
  const int combo = combo_of(p);
  if (combo < 0) return nullptr;
  if (p.D == 64) return nt == 1 ? store_kernel_for<64, 1>(combo) : store_kernel_for<64, 2>(combo);
  if (p.D == 128) return nt == 1 ? store_kernel_for<128, 1>(combo) : store_kernel_for<128, 2>(combo);
  return nullptr;
}

int smem_bytes(int D, int nt) { return store_smem_bytes(D, 4 * nt); }

}  // namespace

bool store_tiles_supported(const DecodeAttentionParams& p) {
  if (p.keys.layout != StoreLayout::kRows || p.values.layout != StoreLayout::kCols) return false;
  if ((p.D != 64 && p.D != 128) || combo_of(p) < 0) return false;
  if (p.group_size <= 0 || p.group_size > p.D || p.D % p.group_size != 0 || p.group_size % 32 != 0) return false;
  // the kernel's 32-bit row offsets: each (b, h_kv) slice of codes / scales / zeros spans < 2^32 bytes
  const auto fits = [](int64_t rows, int64_t stride, int64_t esz) { return rows * stride * esz < (int64_t{1} << 32) - 64; };
  for (const AttnStore* st : {&p.keys, &p.values}) {
    const int64_t rows = st == &p.keys ? p.keys.m + 32 : p.D;
    if (!fits(rows, st->c_sr, 4) || !fits(rows, st->s_sr, 2) || (st->zeros != nullptr && !fits(rows, st->z_sr, 2)))
      return false;
  }
  if (p.keys.bits == 3) {  // whole key rows with 8-byte loads
    const uint64_t addr = reinterpret_cast<uint64_t>(p.keys.codes);
    if (addr % 8 != 0 || p.keys.c_sb % 2 != 0 || p.keys.c_sh % 2 != 0 || p.keys.c_sr % 2 != 0) return false;
  }
  return true;
}

bool plan_store_tiles(const DecodeAttentionParams& p, int64_t F_cap, StoreTilesLaunch& L) {
  const int64_t gq = p.H_q / p.H_kv, R = gq * p.T;
  L.nt = R <= 4 ? 1 : 2;
  const StoreKernel fn = store_kernel(p, L.nt);
  if (fn == nullptr) return false;
  L.gq = static_cast<int>(gq);
  L.row_blocks = static_cast<int>(ceil_div(R, 4 * L.nt));
  int shift = 0;
  while ((32 << shift) < p.group_size) ++shift;
  L.k_group_shift = shift;
  L.v_bpg_magic = block_group_magic(p.group_size / 32);
  L.dec_k = decode_consts_for(p.keys.bits, p.keys.mode);
  L.dec_v = decode_consts_for(p.values.bits, p.values.mode);
  const int64_t ctas = p.B * p.H_kv * L.row_blocks;
  int64_t C = p.split_tokens;
  if (C == 0)
    C = planned_split_tokens(reinterpret_cast<const void*>(fn), kThreads, smem_bytes(p.D, L.nt), p.num_sms, ctas,
                             F_cap, kStoreStep, kMinSplitTokens);
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
  fn<<<grid, kThreads, smem_bytes(p.D, L.nt), stream>>>(p, L);
  return cudaGetLastError();
}

}  // namespace kvk
