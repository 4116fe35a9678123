// KIVI-layout fused dequant-GEMV on tensor cores (reduction over rows r, asym groups of G along the columns c):
//   y[b, h, t, c] = sum_r x[b, h, t, r] * (s[r, c/G] * u[r, c] + z[r, c/G])
//
// Each warp runs m16n8k16 MMAs with A = dequantized codes, 16 columns x 16 rows, and B = the query rows of the KV
// head: 8 columns = 4 query rows x (hi, lo), the fp16 split of the pre-scaled fp32 activations. The MMA form (lane g
// owns CPL = 16, or 8 for 64-column stores, consecutive columns; thread t rows 4t .. 4t + 3 of each 16-row k-step;
// s * u + z rounded once to fp16 before the MMA) is kvkernels/kivi_mma.cuh's, shared with decode_attention_fused's
// KIVI tiles. A warp walks k-steps of its row range with all 8 * CPL columns of its column tile in registers (CPL / 2
// m-tiles x n-tiles x 4 accumulators), so its output needs no reduction inside the warp.
//
// CTA = 8 warps = (column tiles) x (row lanes), (split of R), (b, h_kv). Keys (R = head_dim, C = tokens) spread
// column tiles over warps and CTAs; values (R = tokens, C = head_dim) give every warp of the CTA a slice of the rows
// and sum the slices in shared memory in a fixed order, and split R across CTAs only while the grid is below one
// wave (combine_splits then sums the splits in a fixed order). Planning is a pure function of the params and the
// device's occupancy (plan_kivi), shared with the binding's workspace sizing.
//
// A k-step's codes, scales and zeros reach the registers in one of two ways. With G = 32, and code / scale / zero rows
// aligned to the ring's pieces (16 / 8 / 8 bytes at 16 columns per lane, 8 / 4 / 4 at 8 for a 64-column store: what
// the caches allocate, kivi_ring_ok), a per-warp cp.async ring (kvkernels/code_ring.cuh) keeps the warp's next 2-11
// k-steps in flight while it computes one; else
// each thread loads its rows' words straight into registers, one k-step at a time (the first GPU run measured that
// form at 10-28 % of the fp16 read rate on split R: one k-step in flight per warp).
#include <cuda_runtime.h>

#include <algorithm>

#include "kvkernels/code_ring.cuh"
#include "kvkernels/gemv.cuh"
#include "kvkernels/kivi_mma.cuh"
#include "kvkernels/mma.cuh"

namespace kvk {
namespace {

constexpr int kWarps = 8;                 // 256 threads
constexpr int kSmemBudget = 40 * 1024;    // staged query tile or the row lanes' partial sums
constexpr size_t kCtaSmem = 48 * 1024;    // with the code ring: ring + query tile (no opt-in attribute)
// Shortest split when splitting R (values: tokens) to fill a wave. Was 512: the first GPU run (H200) measured the
// KIVI value GEMV at 13.5-16 us from 512 to 8k tokens at batch 1, on 8-128 CTAs (gemv_inner_q's kMinSplitValues).
constexpr int64_t kMinSplitRows = 256;
constexpr int64_t kMinSplitRowsV1 = 512;  // the same under KVKERNELS_GEMV_PLANNER=v1 (kernels.h)
constexpr int64_t kMaxTPerLaunch = 16;    // query rows per head per launch
constexpr int kMinCtasPerSm = 2;          // register cap 128 per thread

struct KiviLaunch {
  int64_t t0;              // first query row (of T) of this launch
  int tc;                  // query rows per head in this launch
  int gq;                  // query heads per KV head
  int qb;                  // query rows per CTA = gq * tc
  int cw;                  // column tiles per CTA (warps along C); row lanes = kWarps / cw
  int64_t split_len;       // rows of R per split (a multiple of 16 * row lanes unless it is all of R)
  KiviConsts dec;          // decoder constants for the launch's bits
  OutView out;             // y or the split-K workspace
};

// ---- the code ring (kvkernels/code_ring.cuh) ----------------------------------------------------------------------
// A k-step's slot: 16 rows x the warp's 8 * CPL columns, CPL x BITS bytes of codes per row (rows padded to
// kivi_row_bytes), then each row's CPL / 4 scales (CPL / 2 bytes), then as many zeros. Readers take rows 4t .. 4t + 3
// at the lane's word: at 128 columns (ring_row_bytes) a 2-way bank conflict, the least a 16-byte-multiple pad allows;
// at 64 (lanes g read words BITS (g / 4) + (g % 4) BITS / 4; 3 bits {0, 1, 3, 4} and {2, 5}) 8 more bytes at 2 and 4
// bits and none at 1 and 3 is conflict-free at every width.
//
// A ring item is one k-step of 128 columns (KiviRingStream), or two k-steps of a 64-column store (head_dim-64 values,
// KiviRing64Stream): the same bytes, so the same stages keep the same bytes in flight, and the per-item work (the
// copies' addresses, the wait, the rotation) is paid once per 16 rows x 128 columns either way.
__host__ __device__ constexpr int kivi_row_bytes(int bits, int cpl) {
  return cpl == 16 ? ring_row_bytes(bits) : 8 * bits + (bits % 2 == 0 ? 8 : 0);
}
__host__ __device__ constexpr int kivi_step_bytes(int bits, int cpl) {
  return 16 * kivi_row_bytes(bits, cpl) + 16 * cpl;  // codes, then 16 x CPL / 2 bytes of scales and of zeros
}
__host__ __device__ constexpr int kivi_ring_steps(int cpl) { return cpl == 16 ? 1 : 2; }  // k-steps per item
__host__ __device__ constexpr int kivi_ring_warp_bytes(int bits, int cpl) {
  return ring_stages(bits) * kivi_ring_steps(cpl) * kivi_step_bytes(bits, cpl);
}

template <int BITS, int CPL>
struct KiviSlot {
  static_assert(CPL == 16 || CPL == 8, "the ring's k-steps are 128 or 64 columns");
  static constexpr int kMeta = CPL / 2;               // a row's CPL / 4 scales (or zeros)
  static constexpr int kRow = kivi_row_bytes(BITS, CPL);
  static constexpr int kCode = 16 * kRow;             // the codes (16 rows), then 16 x kMeta scales,
  static constexpr int kZeroAt = kCode + 16 * kMeta;  // then 16 x kMeta zeros
  static constexpr int kBytes = kZeroAt + 16 * kMeta;
  static_assert(kBytes == kivi_step_bytes(BITS, CPL) && kBytes % 16 == 0, "slot layout");
};

// 128 columns: lanes copy code pieces lane and lane + 32 of the 16 x BITS (16 bytes: row pc / BITS, bytes
// 16 (pc % BITS) ..), lanes 0-15 the scales of row `lane`, lanes 16-31 the zeros of row lane - 16 (8 bytes each). In
// the last column tile of a store whose C is not a multiple of 128, a piece copies only its bytes before column C
// and zero-fills the rest (a piece wholly past C reads nothing): those columns decode to 0 and are never stored.
template <int BITS>
struct KiviRingStream : KiviSlot<BITS, 16> {
  using Slot = KiviSlot<BITS, 16>;
  static constexpr int kStages = ring_stages(BITS), kSlot = Slot::kBytes;
  static_assert(kSlot == ring_slot_bytes(BITS, true), "slot layout");
  const char* c0;
  const char* c1;
  const char* m;
  int dc, dm;                // bytes from one item's sources to the next's (16 x row lanes rows; < 2^31: kivi_ring_ok)
  int o0, o1, om;            // offsets in a slot
  uint32_t n0, n1, nm;       // bytes to read of each piece (16 / 8 in a whole column tile)
  bool has0, has1;
  char* ring;
  int n;

  __device__ __forceinline__ void skip(int i) {  // run_ring, prefilled: ring_prologue copied item i
    if (i < n) c0 += dc, c1 += dc, m += dm;
  }

  __device__ __forceinline__ void issue(int i, char* slot) {
    if (i < n) {
      if (has0) cp_async_zfill<16>(smem_addr(slot + o0), c0, n0);
      if (has1) cp_async_zfill<16>(smem_addr(slot + o1), c1, n1);
      cp_async_zfill<8>(smem_addr(slot + om), m, nm);
      c0 += dc, c1 += dc, m += dm;
    }
    cp_async_commit();
  }
};

// The stream of n k-steps whose first has rows row0 .. row0 + 15 (all within the split); c_tile, s_tile, z_tile: row 0
// of the (b, h_kv) slice at the warp's first column; cols: columns of the tile before C (1 .. 128, a multiple of 32).
template <int BITS>
__device__ __forceinline__ KiviRingStream<BITS> kivi_ring_stream(char* ring, int n, int64_t row0, int rw,
                                                                 const uint32_t* c_tile, int64_t c_sr,
                                                                 const uint16_t* s_tile, int64_t s_sr,
                                                                 const uint16_t* z_tile, int64_t z_sr, int cols,
                                                                 int lane) {
  constexpr int kPieces = 16 * BITS;
  KiviRingStream<BITS> st;
  st.ring = ring;
  st.n = n;
  const int valid = cols * BITS / 8;  // code bytes of a row before column C
  const auto piece = [&](int pc, const char*& src, int& off, uint32_t& bytes) {
    const int r = pc / BITS, kb = 16 * (pc - r * BITS);
    const char* row = reinterpret_cast<const char*>(c_tile + (row0 + r) * c_sr);
    bytes = static_cast<uint32_t>(min(max(valid - kb, 0), 16));
    src = bytes > 0 ? row + kb : row;  // a piece past C reads nothing; its address stays inside the row
    off = r * st.kRow + kb;
  };
  st.has0 = lane < kPieces;
  st.has1 = lane + 32 < kPieces;
  st.c0 = st.c1 = nullptr;
  st.o0 = st.o1 = 0;
  st.n0 = st.n1 = 0;
  if (st.has0) piece(lane, st.c0, st.o0, st.n0);
  if (st.has1) piece(lane + 32, st.c1, st.o1, st.n1);
  st.dc = static_cast<int>(16 * rw * c_sr * 4);
  const int64_t r = row0 + (lane & 15);
  const bool scales = lane < 16;
  st.m = reinterpret_cast<const char*>(scales ? s_tile + r * s_sr : z_tile + r * z_sr);
  st.dm = static_cast<int>(16 * rw * (scales ? s_sr : z_sr) * 2);
  st.om = (scales ? st.kCode : st.kZeroAt) + st.kMeta * (lane & 15);
  st.nm = static_cast<uint32_t>(2 * min(cols / 32, 4));
  return st;
}

// A 64-column store (C = 64 exactly: no partial tile): an item is the warp's k-steps i and i + 1 of its rows (rows
// row0 + 32 rw i' .. and 16 rw further), one KiviSlot<BITS, 8> each. Its 2 x 16 x BITS code pieces are 8 bytes (row r
// of k-step h = pc / (16 BITS): pc % (16 BITS) / BITS, bytes 8 (pc % BITS) ..), BITS per lane; its 2 x 16 scale and
// zero rows are 4-byte pieces, two per lane (lane & 15 the row, lane < 16 scales, k the k-step).
template <int BITS>
struct KiviRing64Stream : RingCopies<BITS, 8, 2, 4> {
  using Slot = KiviSlot<BITS, 8>;
  static constexpr int kStages = ring_stages(BITS), kSlot = 2 * Slot::kBytes;
};

template <int BITS>
__device__ __forceinline__ KiviRing64Stream<BITS> kivi_ring64_stream(char* ring, int n, int64_t row0, int rw,
                                                                     const uint32_t* c_tile, int64_t c_sr,
                                                                     const uint16_t* s_tile, int64_t s_sr,
                                                                     const uint16_t* z_tile, int64_t z_sr,
                                                                     int lane) {
  using Stream = KiviRing64Stream<BITS>;
  Stream st;
  st.ring = ring;
  st.n = n;
  const char* codes = reinterpret_cast<const char*>(c_tile);
#pragma unroll
  for (int k = 0; k < BITS; ++k) {
    const int pc = lane + 32 * k, h = pc / (16 * BITS), rest = pc - h * 16 * BITS;
    const int r = rest / BITS, kb = 8 * (rest - r * BITS);
    st.has[k] = true;  // 32 BITS pieces: every lane copies BITS
    st.c[k] = codes + ((row0 + 16 * rw * h + r) * c_sr) * 4 + kb;
    st.o[k] = h * Stream::Slot::kBytes + r * Stream::Slot::kRow + kb;
  }
  st.dc = 32 * rw * c_sr * 4;
  const int r = lane & 15;
  const bool scales = lane < 16;
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int64_t row = row0 + 16 * rw * k + r;
    st.hasm[k] = true;
    st.m[k] = reinterpret_cast<const char*>(scales ? s_tile + row * s_sr : z_tile + row * z_sr);
    st.dm[k] = 32 * rw * (scales ? s_sr : z_sr) * 2;
    using Slot = typename Stream::Slot;
    st.om[k] = k * Slot::kBytes + (scales ? Slot::kCode : Slot::kZeroAt) + Slot::kMeta * r;
  }
  return st;
}

// Where a lane reads in a k-step's slot: row 4t's word(s) of the lane's columns and its scale of group g CPL / 32 (its
// zero kZeroAt - kCode bytes on); rows 4t + 1 .. 4t + 3 follow at fixed strides. Computed once per stream, so an item
// costs immediate offsets.
struct KiviRingLane {
  int code, hcode;  // bytes: the (low-plane) word, the high-plane word (3 bits)
  int meta;
};

template <int BITS, int CPL>
__device__ __forceinline__ KiviRingLane kivi_ring_lane(int g, int t) {
  using Slot = KiviSlot<BITS, CPL>;
  const LaneSlot sl = lane_slot<BITS>(static_cast<int64_t>(g) * CPL);  // words relative to the tile's first column
  const int row = 4 * t * Slot::kRow;
  return {row + 4 * sl.word, row + 4 * sl.hword, Slot::kCode + Slot::kMeta * 4 * t + 2 * (g * CPL / 32)};
}

// The k-step in a slot: rows 4t .. 4t + 3 of the lane's words, scales and zeros; then the arithmetic.
template <int BITS, int NT, int CPL>
__device__ __forceinline__ void kivi_ring_compute(const char* slot, const KiviRingLane& ln,
                                                  const uint2* __restrict__ frag, int frag_nt_stride,
                                                  const LaneSel& ls, const KiviConsts& dec,
                                                  float (&d)[CPL / 2][NT][4]) {
  using Slot = KiviSlot<BITS, CPL>;
  constexpr int kRow = Slot::kRow;
  LaneCodes<BITS, CPL> lc[4];
  uint16_t s[4], z[4];
  const char* code = slot + ln.code;
  const char* hcode = slot + ln.hcode;
  const char* meta = slot + ln.meta;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if constexpr (BITS == 4 && CPL == 16) {
      const uint2 v = *reinterpret_cast<const uint2*>(code + j * kRow);
      lc[j].w[0] = v.x, lc[j].w[1] = v.y;
    } else {
      lc[j].w[0] = *reinterpret_cast<const uint32_t*>(code + j * kRow);
      lc[j].w[1] = BITS == 3 ? *reinterpret_cast<const uint32_t*>(hcode + j * kRow) : 0u;
    }
    s[j] = *reinterpret_cast<const uint16_t*>(meta + Slot::kMeta * j);
    z[j] = *reinterpret_cast<const uint16_t*>(meta + (Slot::kZeroAt - Slot::kCode) + Slot::kMeta * j);
  }
  kstep_compute<BITS, NT, CPL>(lc, s, z, frag, frag_nt_stride, ls, dec, d);
}

template <int BITS, int NT, int CPL, int LOADS>
__global__ void __launch_bounds__(kWarps * 32, kMinCtasPerSm) gemv_kivi_kernel(const GemvKiviParams p,
                                                                                const KiviLaunch k) {
  constexpr int QR = 4 * NT;      // query rows per pass
  constexpr int MT = CPL / 2;     // m-tiles per warp
  constexpr int CT = 8 * CPL;     // columns per warp
  constexpr bool VEC = LOADS == kLoadVec;
  constexpr bool kRing = LOADS == kLoadRing;
  extern __shared__ __align__(16) float smem[];

  const int H_kv = static_cast<int>(p.H_kv);
  const int64_t b = static_cast<int>(blockIdx.z) / H_kv, hkv = static_cast<int>(blockIdx.z) % H_kv;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * k.split_len;
  const int rlen = static_cast<int>(min(k.split_len, p.R - r0));
  const int nks = (rlen + 15) / 16;  // k-steps of the split (the last may be partial)
  const int nfull = rlen / 16;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane >> 2, t = lane & 3;
  const int cw = k.cw, rw = kWarps / cw;
  const int ctile = warp % cw, rlane = warp / cw;
  const int64_t c_cta = static_cast<int64_t>(blockIdx.x) * cw * CT;  // first column of the CTA
  const int64_t c_warp = c_cta + static_cast<int64_t>(ctile) * CT;
  // C is a multiple of 32, so a lane's columns are all in or all out; a lane past the end reads the warp's first
  // columns instead (every lane must join the MMAs) and its results are not stored. A warp wholly past the end idles.
  const bool warp_ok = c_warp < p.C;
  const int64_t c_lane = c_warp + static_cast<int64_t>(g) * CPL < p.C ? c_warp + static_cast<int64_t>(g) * CPL : c_warp;

  float* unscale = smem;                                               // [QR] 2^-e per query row
  unsigned* amax = reinterpret_cast<unsigned*>(smem + QR);             // [QR] float bits of max |x|
  char* body = reinterpret_cast<char*>(smem + 2 * QR);                 // 16-byte aligned (QR = 4 NT)
  constexpr int kRingWarp = kRing ? kivi_ring_warp_bytes(BITS, CPL) : 0;
  char* ring = body + warp * kRingWarp;                                // [kWarps][kRingWarp] (kRing)
  uint2* xfrag = reinterpret_cast<uint2*>(body + kWarps * kRingWarp);  // [NT][nks][32 lanes]
  float* red = reinterpret_cast<float*>(body);                         // [kWarps][QR][CT] after the main loop

  // The warp's ring stream of the first pass starts before the query staging (ring_prologue, as gemv_inner_q): its
  // first items' DRAM latency overlaps the staging's reads of x and its barriers. Made as the main loop makes it below.
  // The ring's stream of the split's whole k-steps, kivi_ring_steps(CPL) per item: made for the prologue here and
  // again for the main loop below (the same stream: a stream's sources move as it copies).
  constexpr int kSteps = kivi_ring_steps(CPL);
  const auto ring_of = [&](auto run) {
    const int whole = nfull > rlane ? (nfull - rlane + rw - 1) / rw : 0;  // the warp's whole k-steps
    const int n = whole / kSteps;
    const int64_t c_off = c_warp * BITS / 32, g_off = c_warp / 32;  // the tile's first word and group
    const uint32_t* c_tile = p.codes + b * p.c_sb + hkv * p.c_sh + c_off;
    const uint16_t* s_tile = p.scales + b * p.s_sb + hkv * p.s_sh + g_off;
    const uint16_t* z_tile = p.zeros + b * p.z_sb + hkv * p.z_sh + g_off;
    if constexpr (CPL == 16) {
      const int cols = static_cast<int>(min(static_cast<int64_t>(CT), p.C - c_warp));
      KiviRingStream<BITS> st = kivi_ring_stream<BITS>(ring, n, r0 + 16 * rlane, rw, c_tile, p.c_sr, s_tile, p.s_sr,
                                                       z_tile, p.z_sr, cols, lane);
      run(st);
    } else {
      KiviRing64Stream<BITS> st = kivi_ring64_stream<BITS>(ring, n, r0 + 16 * rlane, rw, c_tile, p.c_sr, s_tile,
                                                           p.s_sr, z_tile, p.z_sr, lane);
      run(st);
    }
    return n;
  };
  bool prefilled = false;
  if constexpr (kRing) {
    if (warp_ok) {
      ring_of([](auto& st) { ring_prologue(st); });
      prefilled = true;
    }
  }

  for (int q0 = 0; q0 < k.qb; q0 += QR) {
    // ---- stage the query tile (as gemv_inner_q: per-row scale 2^e, then hi / lo fragments) ---------------------------
    __syncthreads();
    if (threadIdx.x < QR) amax[threadIdx.x] = 0u;
    const auto xoff_of = [&](int q) -> int64_t {
      const int qg = q0 + q;
      return qg < k.qb ? b * p.x_sb + (hkv * k.gq + qg / k.tc) * p.x_sh + (k.t0 + qg % k.tc) * p.x_st + r0 : -1;
    };
    const auto xval = [&](int64_t xoff, int r) { return load_x(p.x, p.x_dtype, xoff + r); };
    __syncthreads();
    stage_row_scales<QR>(xoff_of, xval, rlen, amax, unscale, 1.f, lane);
    // fragment of lane (col g, t) for k-step ks: x[q][16 ks + 4t .. + 3], q = 4 nt + g / 2, hi (g even) or lo
    stage_fragments_k16(xoff_of, xval, rlen, NT, nks, amax, xfrag, warp, kWarps, lane);
    __syncthreads();

    // ---- main loop: this warp's k-steps rlane, rlane + rw, ... of the split -------------------------------------------
    float d[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) d[i][nt][0] = d[i][nt][1] = d[i][nt][2] = d[i][nt][3] = 0.f;

    if (warp_ok) {
      const LaneSlot slot = lane_slot<BITS>(c_lane);
      LaneSel ls;
#pragma unroll
      for (int i = 0; i < 4; ++i) ls.sel[i] = pair_sel(slot.byte0 + i);
#pragma unroll
      for (int i = 0; i < 2; ++i) ls.hsel[i] = pair_sel(slot.hbyte0 + i);
      const int64_t gi = c_lane / p.group_size;
      // rows 4t .. 4t + 3 of the warp's first k-step, advanced by 16 * rw rows per step; row j = base + j * stride
      // (offset_rows; strides < 2^29 elements, host-checked)
      const int64_t rfirst = r0 + 16 * rlane + 4 * t;
      const uint32_t* crow = p.codes + b * p.c_sb + hkv * p.c_sh + rfirst * p.c_sr;
      const uint32_t* cr = crow + slot.word;
      const uint32_t* ch = crow + slot.hword;
      const uint16_t* sr = p.scales + b * p.s_sb + hkv * p.s_sh + rfirst * p.s_sr + gi;
      const uint16_t* zr = p.zeros + b * p.z_sb + hkv * p.z_sh + rfirst * p.z_sr + gi;
      const int64_t c_step = 16 * rw * p.c_sr, s_step = 16 * rw * p.s_sr, z_step = 16 * rw * p.z_sr;
      const uint2* frag = xfrag + rlane * 32 + lane;
      const uint32_t cs = static_cast<uint32_t>(4 * p.c_sr), ss = static_cast<uint32_t>(2 * p.s_sr),
                     zs = static_cast<uint32_t>(2 * p.z_sr);  // bytes
      const auto kstep = [&](bool partial, int rows_left) {
        LaneCodes<BITS, CPL> lc[4];
        uint16_t s[4], z[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const bool ok = !partial || 4 * t + j < rows_left;  // rows past the split's end dequantize to 0
          if (ok) {
            load_lane<BITS, CPL, VEC>(lc[j], offset_rows(cr, j, cs), BITS == 3 ? offset_rows(ch, j, cs) : nullptr);
            s[j] = __ldg(offset_rows(sr, j, ss));
            z[j] = __ldg(offset_rows(zr, j, zs));
          } else {
            lc[j].w[0] = lc[j].w[1] = 0u;
            s[j] = z[j] = 0;
          }
        }
        kstep_compute<BITS, NT, CPL>(lc, s, z, frag, nks * 32, ls, k.dec, d);
      };
      int ks = rlane;
      if constexpr (kRing) {  // the split's whole k-steps through the ring (ring_of), kSteps per item
        const KiviRingLane ln = kivi_ring_lane<BITS, CPL>(g, t);
        const auto consume = [&](int, const char* slot) {
#pragma unroll
          for (int h = 0; h < kSteps; ++h) {
            kivi_ring_compute<BITS, NT, CPL>(slot + h * KiviSlot<BITS, CPL>::kBytes, ln, frag, nks * 32, ls, k.dec,
                                             d);
            frag += rw * 32;
          }
        };
        const int n = ring_of([&](auto& st) { run_ring(st, consume, prefilled); });
        prefilled = false;
        ks += n * kSteps * rw;
        cr += n * kSteps * c_step, ch += n * kSteps * c_step, sr += n * kSteps * s_step, zr += n * kSteps * z_step;
        if (CPL == 8 && ks < nfull) {  // an odd whole k-step left over by the two-step items
          kstep(false, 16);
          ks += rw, cr += c_step, ch += c_step, sr += s_step, zr += z_step, frag += rw * 32;
        }
      } else {
#pragma unroll 1
        for (; ks < nfull; ks += rw) {
          kstep(false, 16);
          cr += c_step, ch += c_step, sr += s_step, zr += z_step, frag += rw * 32;
        }
      }
      if (ks < nks) kstep(true, rlen - 16 * ks);  // the split's last, partial k-step
    }

    // ---- combine hi + lo, sum the row lanes, store ----------------------------------------------------------------
    // lane (g, t) holds, for query row 4 nt + t, columns 2i (d[i][nt][0] + [1]) and 2i + 1 ([2] + [3]) of its range
    __syncthreads();  // the staged fragments are no longer read: `red` reuses the shared memory
    float* mine = red + static_cast<int64_t>(warp) * QR * CT;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      float* row = mine + (4 * nt + t) * CT + g * CPL;
#pragma unroll
      for (int i = 0; i < MT; i += 2) {
        const float4 v = make_float4(d[i][nt][0] + d[i][nt][1], d[i][nt][2] + d[i][nt][3],
                                     d[i + 1][nt][0] + d[i + 1][nt][1], d[i + 1][nt][2] + d[i + 1][nt][3]);
        *reinterpret_cast<float4*>(row + 2 * i) = v;
      }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < QR * cw * CT; idx += blockDim.x) {
      const int q = idx / (cw * CT), rest = idx - q * (cw * CT);
      const int ct = rest / CT, cc = rest - ct * CT;
      const int qg = q0 + q;
      const int64_t c = c_cta + rest;
      if (qg >= k.qb || c >= p.C) continue;
      float sum = 0.f;
      for (int rl = 0; rl < rw; ++rl) sum += red[(static_cast<int64_t>(rl * cw + ct) * QR + q) * CT + cc];  // fixed order
      float* out = k.out.base + blockIdx.y * k.out.s_split + b * k.out.sb + (hkv * k.gq + qg / k.tc) * k.out.sh +
                   (qg % k.tc) * k.out.st;
      out[c] = sum * unscale[q];
    }
  }
}

// ---- kernel selection and planning -------------------------------------------------------------------------------
using KiviKernel = void (*)(const GemvKiviParams, const KiviLaunch);

// The ring variants: every width and query tile, except 3 bits at 8 query rows and 16 columns per lane, whose ring
// loop spilled to local memory at the 128-register cap (3 bits is no preset's KIVI width; it keeps the register loads
// there). At 8 columns per lane a warp holds half the accumulators.
__host__ __device__ constexpr bool kivi_has_ring(int bits, int nt, int cpl) {
  return cpl == 8 || !(bits == 3 && nt == 2);
}

template <int BITS, int NT>
KiviKernel kivi_kernel(int cpl, int loads) {
  if (cpl == 8) {
    return loads == kLoadRing ? gemv_kivi_kernel<BITS, NT, 8, kLoadRing> : gemv_kivi_kernel<BITS, NT, 8, kLoadWords>;
  }
  if constexpr (kivi_has_ring(BITS, NT, 16)) {
    if (loads == kLoadRing) return gemv_kivi_kernel<BITS, NT, 16, kLoadRing>;
  }
  if constexpr (BITS == 4) {  // the only width whose 16 columns span two words: one 8-byte load when aligned
    if (loads == kLoadVec) return gemv_kivi_kernel<4, NT, 16, kLoadVec>;
  }
  return gemv_kivi_kernel<BITS, NT, 16, kLoadWords>;
}

cudaError_t select_kivi_kernel(int bits, int nt, int cpl, int loads, KiviKernel* fn) {
  KVK_DISPATCH_BITS(bits, BITS, {
    switch (nt) {
      case 1: *fn = kivi_kernel<BITS, 1>(cpl, loads); break;
      case 2: *fn = kivi_kernel<BITS, 2>(cpl, loads); break;
      default:
        set_launch_error("gemv_kivi: unsupported n-tile count %d", nt);
        return cudaErrorInvalidValue;
    }
  })
  return cudaSuccess;
}

struct KiviPlan {
  int nt, cpl, cw;           // n-tiles, columns per lane, column tiles per CTA
  int loads;                 // kLoadWords / kLoadVec (8-byte code loads: 4 bits, 16 columns per lane) / kLoadRing
  int64_t t_chunk;           // query rows per head per launch
  int64_t col_blocks;        // CTAs along C
  int64_t split_len;         // rows per split
  int64_t num_splits;        // CTAs along R
  size_t smem_bytes;
  int64_t workspace_floats;
  int ctas_per_sm;
  KiviKernel fn;
  const char* error;
};

// unscale and amax first, then (ring slots +) the staged query tile, or after the main loop the row lanes' sums
size_t kivi_smem(int64_t rows, int nt, int ct, size_t ring_bytes) {
  const size_t stage = static_cast<size_t>(nt) * ceil_div(rows, 16) * 32 * 8;
  const size_t reduce = static_cast<size_t>(kWarps) * 4 * nt * ct * sizeof(float);
  return 2 * 4 * nt * sizeof(float) + std::max(ring_bytes + stage, reduce);
}

// Wide code loads (8-byte vectors, the ring's 16-byte pieces) need code rows aligned to their width.
bool codes_aligned(const GemvKiviParams& p, int64_t align) {
  return rows_aligned(p.codes, align, sizeof(uint32_t), p.B, p.c_sb, p.H_kv, p.c_sh, p.R, p.c_sr);
}

// The ring's pieces: code rows aligned to the piece (16 bytes; a column tile starts at a multiple of 16 x BITS bytes),
// and each row's G = 32 scales (zeros) of a tile as one 8-byte piece; at 8 columns per lane a store of exactly 64
// columns (head_dim-64 values), 8-byte code pieces and 4-byte scale / zero pieces. The caches' stores meet this
// ("cols": capacity a multiple of lcm(G, 128); "rows" at head_dim 128: 16 x BITS-byte rows, at head_dim 64: 8 x BITS).
bool kivi_ring_ok(const GemvKiviParams& p, int cpl, int nt) {
  const int64_t piece = cpl, meta = cpl / 2;
  const auto meta_ok = [&](const uint16_t* base, int64_t sb, int64_t sh, int64_t sr) {
    return rows_aligned(base, meta, sizeof(uint16_t), p.B, sb, p.H_kv, sh, p.R, sr);
  };
  // a k-step of all row lanes is 128 rows: the sources move by 32-bit byte offsets
  const bool strides_ok = 128 * std::max({4 * p.c_sr, 2 * p.s_sr, 2 * p.z_sr}) < (int64_t{1} << 31);
  return (cpl == 16 || p.C == 64) && kivi_has_ring(p.bits, nt, cpl) && p.group_size == 32 &&
         codes_aligned(p, piece) && meta_ok(p.scales, p.s_sb, p.s_sh, p.s_sr) &&
         meta_ok(p.zeros, p.z_sb, p.z_sh, p.z_sr) && strides_ok && !gemv_ring_disabled();
}

KiviPlan plan_kivi(const GemvKiviParams& p) {
  KiviPlan pl{};
  const int64_t gq = p.H_q / p.H_kv;
  pl.t_chunk = std::min<int64_t>(p.T, kMaxTPerLaunch);
  pl.nt = gq * pl.t_chunk <= 4 ? 1 : 2;
  pl.cpl = p.C <= 64 ? 8 : 16;  // 64-column stores (head_dim 64 values): one column tile, no idle lanes
  pl.loads = kivi_ring_ok(p, pl.cpl, pl.nt)                          ? kLoadRing
             : p.bits == 4 && pl.cpl == 16 && codes_aligned(p, 8) ? kLoadVec
                                                                 : kLoadWords;
  if (select_kivi_kernel(p.bits, pl.nt, pl.cpl, pl.loads, &pl.fn) != cudaSuccess) {
    pl.error = "unsupported bits";
    return pl;
  }
  // the ring's slots come first; the query tile gets the rest of the 48 KiB a CTA may use without an opt-in
  const size_t ring_bytes =
      pl.loads == kLoadRing ? static_cast<size_t>(kWarps) * kivi_ring_warp_bytes(p.bits, pl.cpl) : 0;
  const size_t budget = pl.loads == kLoadRing ? kCtaSmem : kSmemBudget;
  const int occ = resident_ctas_per_sm(reinterpret_cast<const void*>(pl.fn), kWarps * 32, budget);
  pl.ctas_per_sm = occ;
  const int64_t wave = static_cast<int64_t>(occ) * std::max(p.num_sms, 1);
  const int64_t bh = p.B * p.H_kv;
  const int ct = 8 * pl.cpl;
  const int64_t tiles = ceil_div(p.C, ct);
  // column tiles per CTA: the most (fewer CTAs stage the query) that still leaves a wave of CTAs
  pl.cw = 1;
  while (pl.cw < kWarps && pl.cw * 2 <= tiles && bh * ceil_div(tiles, pl.cw * 2) >= wave) pl.cw *= 2;
  pl.col_blocks = ceil_div(tiles, pl.cw);
  const int rw = kWarps / pl.cw;
  // rows per split: all of R if shared memory allows, else the longest multiple of 16 * rw that fits
  int64_t max_rows = 16 * rw;
  while (kivi_smem(max_rows + 16 * rw, pl.nt, ct, ring_bytes) <= budget) max_rows += 16 * rw;
  const bool v1 = gemv_planner_v1();
  const int64_t min_split = v1 ? kMinSplitRowsV1 : kMinSplitRows;
  if (v1) {  // the first GPU run's rule: ceil(wave / CTAs) splits when the grid is under a wave
    pl.split_len = p.R <= max_rows ? p.R : max_rows;
    if (bh * pl.col_blocks * ceil_div(p.R, pl.split_len) < wave && p.R >= 2 * min_split) {
      const int64_t want = ceil_div(wave, bh * pl.col_blocks);  // splits for one wave (values: long R)
      const int64_t len = round_up(std::max(ceil_div(p.R, want), min_split), 16 * rw);
      if (len < pl.split_len) pl.split_len = len;
    }
  } else {  // whole waves (gemv.cuh); a CTA's fixed work (query staging, the ring's first copies) ~2 k-steps
    pl.split_len = wave_split_len(p.R, 16 * rw, min_split, max_rows, bh * pl.col_blocks, wave, 2);
  }
  pl.num_splits = ceil_div(p.R, pl.split_len);
  pl.smem_bytes = kivi_smem(pl.split_len, pl.nt, ct, ring_bytes);
  if (pl.smem_bytes > budget) pl.error = "query tile too large for shared memory";
  pl.workspace_floats = pl.num_splits > 1 ? pl.num_splits * p.B * p.H_q * pl.t_chunk * p.C : 0;
  if (pl.col_blocks > 0x7fffffff || pl.num_splits > 65535 || bh > 65535) pl.error = "grid too large";
  if (std::max({p.c_sr, p.s_sr, p.z_sr}) >= (int64_t{1} << 29)) pl.error = "row stride too large";
  return pl;
}

}  // namespace

bool gemv_kivi_ring(const GemvKiviParams& p) { return plan_kivi(p).loads == kLoadRing; }

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
  const dim3 grid(static_cast<unsigned>(pl.col_blocks), static_cast<unsigned>(pl.num_splits),
                  static_cast<unsigned>(p.B * p.H_kv));
  const int64_t gq = p.H_q / p.H_kv;
  for (int64_t t0 = 0; t0 < p.T; t0 += pl.t_chunk) {
    KiviLaunch k{};
    k.t0 = t0;
    k.tc = static_cast<int>(std::min(pl.t_chunk, p.T - t0));
    k.gq = static_cast<int>(gq);
    k.qb = static_cast<int>(gq * k.tc);
    k.cw = pl.cw;
    k.split_len = pl.split_len;
    k.dec = kivi_consts(p.bits);
    if (pl.num_splits == 1) {
      k.out = OutView{p.y + t0 * p.y_st, p.y_sb, p.y_sh, p.y_st, 0};
    } else {
      k.out = OutView{p.workspace, p.H_q * k.tc * p.C, k.tc * p.C, p.C, p.B * p.H_q * k.tc * p.C};
    }
    const KiviKernel fn = pl.fn;
    fn<<<grid, kWarps * 32, pl.smem_bytes, stream>>>(p, k);
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
