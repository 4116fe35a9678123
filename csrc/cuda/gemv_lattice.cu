// Lattice (HIGGS-style) GEMVs on tensor cores, scored and accumulated on the codes in the rotated domain
// (docs/FORMATS.md "Lattice"; y_hat = s * H_n (r16 * grid[c]) per group of G channels, H_n orthonormal, symmetric):
//   keys:    q . x_hat_n = sum_g r16[n, g] * <q'_g, grid[c_{n, g}]>,      q'_g = H_n (s * q_g)
//   values:  sum_n p_n x_hat_n = s * H_n (sum_n p_n r16[n, g] grid[c_{n, g}])  per group g
//
// Both run m16n8k16 MMAs (csrc/kvkernels/mma.cuh) whose A operand comes from a shared-memory copy of the grid in
// fp16, looked up with the packed indices (csrc/kvkernels/lattice.cuh: two instructions per index or index pair,
// FLUTE-style vectorized tables), and whose B operand is the fp32 query (keys) or probability (values) rows split
// into fp16 hi + lo after a power-of-two prescale per row, as the other GEMVs do (4 query rows x (hi, lo) = 8 columns
// per n-tile; the keys' 8-row tiles: the 8 rows as columns, hi / lo two k-steps into one accumulator, key_kdup).
//
// Keys: CTA = (token range, (b, h_kv)), 8 warps of 16-token tiles. Per pass of 4 NT query rows the CTA loads the
// rows times the signs into shared memory, runs the fp32 butterflies (one FWHT per group, the spec's order), and
// every thread keeps its B fragments of all D / 16 k-steps in registers (D = 256: in shared memory, one LDS.128 per
// two k-steps). A tile's thread (g, t) reads the whole code row of tokens g and g + 8 (32-bit loads; the quad's four
// threads take different bytes of each word) and supplies A = (token, 2 channels) half2 pairs straight from the table:
// EDEN2-16 through a 256-entry pair table (the two indices of a byte), EDEN4-256 one entry per quad (both read as two
// LDS.32, which land in a[0] / a[2] without moves), EDEN2-256 / EDEN2-64 one LDS.32 per pair. The MMA accumulates a
// group's k-steps in fp32; the group's norm multiplies the sum in fp32 (G is a template argument: one fold per group).
// Up to head_dim 128 whole tiles arrive through a per-warp cp.async ring (KeyRingStream: a tile's code rows and norms,
// 2-6 items in flight), so that a warp's loads are not one tile at a time.
//
// Values: CTA = (split of N, (b, h_kv)); its warps = (D / DW column tiles) x (row lanes over the split's k-steps of
// 16 tokens), as gemv_kivi. A = 16 channels x 16 tokens: lane group g owns a slice of the warp's channels, thread t
// tokens 4t .. 4t + 3 of each k-step; a looked-up half2 holds two channels of one token, so pairs of tokens are
// gathered with PRMT (EDEN2-16 instead uses a two-token table: one LDS.64 gives both channels of a pair for two
// tokens). The main loop takes 2-4 k-steps per iteration, their code words loaded before the first MMA (value_unroll).
// With one group per row (G = D) the norm multiplies p in fp32 before the hi / lo split; otherwise the split's
// norms are staged in shared memory ([group][token], one LDS.64 per k-step gives a thread's four) and multiply A in
// fp16 (HMUL2). The row lanes' fp32 partial sums are added in shared memory in a fixed order; one split finishes in
// the CTA (inverse FWHT, signs), several write their rotated partial sums to the workspace and lattice_v_finish adds
// them in a fixed order before the transform.
//
// Precision contract (docs/FORMATS.md "GEMV arithmetic" states the other GEMVs'): the tensor cores see the grid in
// fp16 (relative 2^-11 per value; values read fp16(grid / 16), the 1/16 undone in fp32). Keys apply the fp16 norm in
// fp32 after the MMA; values multiply p by it in fp32 (G = D) or round r16 * fp16(grid / 16) to fp16 once more
// (G < D: relative 2^-11 more; the 1/16 keeps the product finite for any finite norm, and a subnormal product costs
// an absolute 2^-25 * 16 per term). The rows are read exactly and split hi + lo (~2^-22); the FWHTs and every sum are
// fp32 in a fixed order (deterministic). So keys match the fp32 definition to ~2^-11 and values to ~2^-11 (G = D) /
// ~2^-10 (G < D) of the magnitude the sums are made of, in the rotated domain (tests/test_cuda_kernels.py).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "kvkernels/code_ring.cuh"
#include "kvkernels/gemv.cuh"
#include "kvkernels/lattice.cuh"
#include "kvkernels/mma.cuh"

namespace kvk {
namespace {

constexpr int kWarps = 8;  // 256 threads
constexpr int kThreads = 32 * kWarps;
constexpr int kMinCtasPerSm = 2;          // register cap 128 per thread
constexpr int kSmemBudget = 44 * 1024;    // under the 48 KiB a launch gets without opting in
constexpr int64_t kCtaSmem = 48 * 1024;   // the keys with their code ring: all of it
constexpr int64_t kMaxTPerLaunch = 16;    // query rows per head per launch
constexpr int64_t kMinSplitTokens = 512;  // below this a values split's staging costs more than its codes

// ---- dispatch ----------------------------------------------------------------------------------------------------
#define KVK_DISPATCH_LATTICE_GRID(grid, CONST, ...)                                                     \
  switch (grid) {                                                                                       \
    case ::kvk::LatticeGrid::kE2_16: { constexpr auto CONST = ::kvk::LatticeGrid::kE2_16; __VA_ARGS__ } break;   \
    case ::kvk::LatticeGrid::kE2_64: { constexpr auto CONST = ::kvk::LatticeGrid::kE2_64; __VA_ARGS__ } break;   \
    case ::kvk::LatticeGrid::kE2_256: { constexpr auto CONST = ::kvk::LatticeGrid::kE2_256; __VA_ARGS__ } break; \
    case ::kvk::LatticeGrid::kE4_256: { constexpr auto CONST = ::kvk::LatticeGrid::kE4_256; __VA_ARGS__ } break; \
    default:                                                                                            \
      ::kvk::set_launch_error("unsupported lattice grid kind %d (expected (d, n) in (2, 16), (2, 64), (2, 256), " \
                              "(4, 256))", (int)(grid));                                                \
      return cudaErrorInvalidValue;                                                                     \
  }

#define KVK_DISPATCH_HEAD_DIM(dim, CONST, ...)                                                     \
  switch (dim) {                                                                                   \
    case 64: { constexpr int CONST = 64; __VA_ARGS__ } break;                                      \
    case 128: { constexpr int CONST = 128; __VA_ARGS__ } break;                                    \
    case 256: { constexpr int CONST = 256; __VA_ARGS__ } break;                                    \
    default:                                                                                       \
      ::kvk::set_launch_error("unsupported head_dim %d (supported: 64, 128, 256)", (int)(dim));    \
      return cudaErrorInvalidValue;                                                                \
  }

// ---- the grid table in shared memory -------------------------------------------------------------------------------
// Entries of 8 bytes (two half2: EDEN2-16's pair / two-token table, EDEN4-256's quad) or 4 bytes (one half2), kCopies
// interleaved copies (entry e of copy c at slot e * kCopies + c; lane L reads copy L % kCopies) against bank
// conflicts of random indices: 8 KiB per table. kShift = log2(bytes per entry x copies): an index's byte address is
// index << kShift | (L % kCopies) * entry bytes, the table starting at shared offset 0.
template <LatticeGrid GRID>
struct Table {
  static constexpr bool kWide = GRID == LatticeGrid::kE2_16 || GRID == LatticeGrid::kE4_256;
  static constexpr int kEntries = GRID == LatticeGrid::kE2_64 ? 64 : 256;
  static constexpr int kEntryBytes = kWide ? 8 : 4;
  static constexpr int kCopies = GRID == LatticeGrid::kE2_64 ? 32 : (kWide ? 4 : 8);
  static constexpr int kShift = GRID == LatticeGrid::kE2_64 ? 7 : 5;
  static constexpr int kBytes = kEntries * kEntryBytes * kCopies;
  static_assert((1 << kShift) == kEntryBytes * kCopies, "kShift");
  static_assert(kShift <= 7, "x_mul needs 24 + kShift < 32");
};

__device__ __forceinline__ uint32_t h2(float a, float b) { return pack_half2(float_to_half_bits(a), float_to_half_bits(b)); }

// Keys: fp16(grid); EDEN2-16's entry e = (pair of index e & 15, pair of index e >> 4), the two indices of a byte.
// Values: fp16(grid / 16); EDEN2-16's entry e = (channel 0 of indices (e & 15, e >> 4), channel 1 of them): two
// tokens' indices in one byte, the A operand's token pair directly.
template <LatticeGrid GRID, bool VALUES>
__device__ void build_table(const float* __restrict__ grid, uint32_t* tab) {
  using TB = Table<GRID>;
  constexpr int d = lattice_d(GRID);
  const float sc = VALUES ? 1.f / 16 : 1.f;
  const auto gv = [&](int e, int c) { return __ldg(grid + e * d + c) * sc; };
  for (int i = threadIdx.x; i < TB::kEntries * TB::kCopies; i += blockDim.x) {
    const int e = i / TB::kCopies;
    if constexpr (GRID == LatticeGrid::kE2_16) {
      const int i0 = e & 15, i1 = e >> 4;
      tab[2 * i] = VALUES ? h2(gv(i0, 0), gv(i1, 0)) : h2(gv(i0, 0), gv(i0, 1));
      tab[2 * i + 1] = VALUES ? h2(gv(i0, 1), gv(i1, 1)) : h2(gv(i1, 0), gv(i1, 1));
    } else if constexpr (GRID == LatticeGrid::kE4_256) {
      tab[2 * i] = h2(gv(e, 0), gv(e, 1));
      tab[2 * i + 1] = h2(gv(e, 2), gv(e, 3));
    } else {
      tab[i] = h2(gv(e, 0), gv(e, 1));
    }
  }
}

// A read-only element of the codes or norms: from global memory through the non-coherent cache, or (SMEM) from a ring
// slot in shared memory.
template <bool SMEM, typename T>
__device__ __forceinline__ T ld_ro(const T* p) {
  if constexpr (SMEM) return *p;
  else return __ldg(p);
}

// A code row of KW words from shared memory into registers: 16-byte loads (KW % 4 == 0, rows 16-byte aligned), else
// 8-byte ones (the 24-byte rows of EDEN2-64 at D = 64, 8-byte aligned).
template <int KW>
__device__ __forceinline__ void copy_row(const uint32_t* src, uint32_t (&dst)[KW]) {
  if constexpr (KW % 4 == 0) {
#pragma unroll
    for (int i = 0; i < KW / 4; ++i) {
      const uint4 v = reinterpret_cast<const uint4*>(src)[i];
      dst[4 * i] = v.x, dst[4 * i + 1] = v.y, dst[4 * i + 2] = v.z, dst[4 * i + 3] = v.w;
    }
  } else {
    static_assert(KW % 2 == 0, "code rows are whole 8-byte pieces");
#pragma unroll
    for (int i = 0; i < KW / 2; ++i) {
      const uint2 v = reinterpret_cast<const uint2*>(src)[i];
      dst[2 * i] = v.x, dst[2 * i + 1] = v.y;
    }
  }
}

__device__ __forceinline__ uint32_t lds32(const char* tab, uint32_t addr) {
  return *reinterpret_cast<const uint32_t*>(tab + addr);
}
__device__ __forceinline__ uint2 lds64(const char* tab, uint32_t addr) {
  return *reinterpret_cast<const uint2*>(tab + addr);
}

// ---- Walsh-Hadamard transform of shared-memory rows (the whole CTA; ends synchronized) -------------------------------
// Every row of `rows` rows of D floats (stride D), groups of G along the row: stages h = 1 .. G / 2 on (y[i], y[i + h]),
// i % 2h < h, then one multiply by `scale` = fp32(1 / sqrt(G)): docs/FORMATS.md "Lattice" step 1, in its order.
__device__ void fwht_rows(float* buf, int rows, int D, int G, float scale) {
  const int half = D / 2;
  for (int h = 1; h < G; h <<= 1) {
    for (int i = threadIdx.x; i < rows * half; i += blockDim.x) {
      const int r = i / half, bi = i - r * half;
      float* y = buf + r * D + (bi / h) * 2 * h + bi % h;
      const float a = y[0], c = y[h];
      y[0] = a + c;
      y[h] = a - c;
    }
    __syncthreads();
  }
  for (int i = threadIdx.x; i < rows * D; i += blockDim.x) buf[i] *= scale;
  __syncthreads();
}

// =====================================================================================================================
// Keys
// =====================================================================================================================
struct LatticeKLaunch {
  int64_t t0;              // first query row (of T) of this launch
  int tc;                  // query rows per head in this launch
  int gq;                  // query heads per KV head
  int qb;                  // query rows per CTA = gq * tc
  int64_t tokens_per_cta;  // a multiple of 16
  float fwht_scale;        // fp32(1 / sqrt(G))
  OutView out;             // y at this launch's first query row
};

// The lane's constants of the index -> table-address arithmetic (lattice.cuh), computed once.
struct KeyLane {
  int pos;            // bit position of the lane's field: 8t (bytes) or 6t (6-bit quarters)
  uint32_t lane_off;  // the lane's table copy, in bytes
  uint32_t xmask, xmul;  // EDEN2-64: quarter t's X index (x_addr)
};

// A[0] / A[2] of one token for k-step ks: rows g (a0, a2) or g + 8 (a1, a3) of the MMA's A operand. `row` is the
// token's code row in global memory, or (SMEM) in a ring slot.
template <LatticeGrid GRID, bool SMEM>
__device__ __forceinline__ void key_lookup(const uint32_t* __restrict__ row, int ks, const KeyLane& kl,
                                           const char* tab, uint32_t& lo, uint32_t& hi) {
  constexpr int S = Table<GRID>::kShift;
  if constexpr (Table<GRID>::kWide) {  // byte t of word ks: two pairs (EDEN2-16) or one quad (EDEN4-256)
    // two LDS.32 of the entry's halves rather than one LDS.64: the MMA wants them in registers a[0] and a[2], apart
    // (an LDS.64 pair costs four moves per k-step; the shared-memory wavefronts are the same)
    const uint32_t addr = field_addr<S, 8>(ld_ro<SMEM>(row + ks), kl.pos, kl.lane_off);
    lo = lds32(tab, addr);
    hi = lds32(tab, addr + 4);
  } else if constexpr (GRID == LatticeGrid::kE2_256) {  // byte t of words 2 ks (pair t) and 2 ks + 1 (pair 4 + t)
    lo = lds32(tab, field_addr<S, 8>(ld_ro<SMEM>(row + 2 * ks), kl.pos, kl.lane_off));
    hi = lds32(tab, field_addr<S, 8>(ld_ro<SMEM>(row + 2 * ks + 1), kl.pos, kl.lane_off));
  } else {  // EDEN2-64: quarter t of block ks / 2, elements 0 and 1 (even ks) or 2 and 3 (odd ks)
    const uint32_t* blk = row + 3 * (ks / 2);
    if (ks % 2 == 0) {
      lo = lds32(tab, field_addr<S, 6>(ld_ro<SMEM>(blk), kl.pos, kl.lane_off));
      hi = lds32(tab, field_addr<S, 6>(ld_ro<SMEM>(blk + 1), kl.pos, kl.lane_off));
    } else {
      const uint32_t w0 = ld_ro<SMEM>(blk), w1 = ld_ro<SMEM>(blk + 1), w2 = ld_ro<SMEM>(blk + 2);
      lo = lds32(tab, field_addr<S, 6>(w2, kl.pos, kl.lane_off));
      hi = lds32(tab, x_addr<S>(quarter_top(w0, w1, w2), kl.xmask, kl.xmul, kl.lane_off));
    }
  }
}

// B fragments stay in registers at D <= 128 (up to 32 per thread: D / 16 k-steps x NT n-tiles x 2); at D = 256 the
// code rows of two tokens (up to 64 words) need the registers, and each lane reads its own fragments back from shared
// memory (one LDS.128 per two k-steps and n-tile).
__host__ __device__ constexpr bool key_b_in_smem(int dim, int) { return dim > 128; }

// 8 query rows take the k-split MMAs (B's columns the 8 rows, hi / lo two MMAs into one accumulator: no FADD of the
// halves per group fold), up to 13 % fewer instructions a tile by the SASS model, except EDEN2-64 at head_dim 64 with
// one group a row (G = 64), where ptxas at the 128-register cap re-derives lookup and row addresses in the loop: +16
// (251 -> 267, 9.7 -> 10.3 per byte); it keeps the 4 rows x (hi, lo) columns.
__host__ __device__ constexpr bool key_kdup(LatticeGrid grid, int dim, int g, int nt) {
  return nt == 2 && !(grid == LatticeGrid::kE2_64 && dim == 64 && g == 64);
}

// Shared memory before the keys' ring: the table, the rotated query rows, (D = 256) the B fragments, the row maxima.
__host__ __device__ constexpr int64_t key_fixed_bytes(int64_t table, int dim, int nt) {
  return round_up(table + 4 * nt * dim * 4 + (key_b_in_smem(dim, nt) ? dim / 16 * nt * 32 * 8 : 0) + 4 * nt * 4, 16);
}

// ---- the keys' code ring (kvkernels/code_ring.cuh) ------------------------------------------------------------------
// The loop above with register loads keeps one 16-token tile per warp in flight: 5-10 KB per SM at head_dim 64 / 128,
// which the SASS model (bench/sass_budget.py, calibrated on the first GPU run's register-load GEMVs) puts at 23-50 % of
// copy bandwidth. The ring's item is a warp's next tile (head_dim 128) or next two (head_dim 64: tiles w + 16 k and
// w + 8 + 16 k of warp w, so that the copies and the ring's own work are paid per 32 rows as at head_dim 128): per tile
// its 16 code rows, then its [16][D / G] norms, copied with cp.async while the warp scores earlier items. A row is
// D * bits / 8 bytes (16-64; 16-byte pieces, 8-byte ones for the 24-byte rows of EDEN2-64 at D = 64), padded by 16
// bytes where its length is a multiple of 32, so that the rows g = 0..7 one shared load touches (a quad reads one word)
// fall in distinct banks. Head_dim 256 tiles keep 17-36 KB in flight with register loads and keep them.
constexpr int kKeyRingTarget = 1536;  // compulsory bytes a warp keeps in flight (x 16 warps per SM: 24 KB)
__host__ __device__ constexpr bool key_ring_dim(int dim) { return dim <= 128; }
__host__ __device__ constexpr int key_ring_tiles(int dim) { return dim == 64 ? 2 : 1; }  // tiles per item
__host__ __device__ constexpr int key_row_bytes(int bits, int dim) { return dim * bits / 8; }
__host__ __device__ constexpr int key_ring_piece(int bits, int dim) {
  return key_row_bytes(bits, dim) % 16 == 0 ? 16 : 8;
}
__host__ __device__ constexpr int key_ring_stride(int bits, int dim) {
  return key_row_bytes(bits, dim) + (key_row_bytes(bits, dim) % 32 == 0 ? 16 : 0);
}
__host__ __device__ constexpr int key_ring_tile_bytes(int bits, int dim, int ng) {  // one tile's part of a slot
  return 16 * key_ring_stride(bits, dim) + 32 * ng;
}
__host__ __device__ constexpr int key_ring_slot(int bits, int dim, int ng) {
  return key_ring_tiles(dim) * key_ring_tile_bytes(bits, dim, ng);
}
// Stages per warp: enough for kKeyRingTarget bytes in flight (stages - 1 items), within a CTA's 48 KiB after the fixed
// part at 8 query rows.
__host__ __device__ constexpr int key_ring_stages(int bits, int dim, int ng, int64_t table) {
  const int item = key_ring_tiles(dim) * (16 * key_row_bytes(bits, dim) + 32 * ng);
  const int want = 1 + static_cast<int>(ceil_div(kKeyRingTarget, item));
  const int fit = static_cast<int>((kCtaSmem - key_fixed_bytes(table, dim, 2)) / (kWarps * key_ring_slot(bits, dim, ng)));
  return want < fit ? want : fit;
}

__host__ __device__ constexpr int key_ring_lane_codes(int bits, int dim) {  // code pieces a lane copies per item
  return (key_ring_tiles(dim) * 16 * key_row_bytes(bits, dim) / key_ring_piece(bits, dim) + 31) / 32;
}
__host__ __device__ constexpr int key_ring_lane_norms(int dim, int ng) {  // 4-byte norm pieces a lane copies per item
  return (key_ring_tiles(dim) * 8 * ng + 31) / 32;
}

// One warp's stream of n items through its ring (run_ring's Stream; the copies: RingCopies): this lane's code pieces
// (lane, lane + 32, ...) and norm pieces (4 bytes: two norms of a token, or of two tokens at D / G = 1), their offsets
// in a slot, and the bytes the sources move from one item to the next (kTiles x kWarps tiles).
template <LatticeGrid GRID, int DIM, int G>
struct KeyRingStream : RingCopies<key_ring_lane_codes(lattice_bits(GRID), DIM), key_ring_piece(lattice_bits(GRID), DIM),
                                  key_ring_lane_norms(DIM, DIM / G), 4> {
  static constexpr int kBits = lattice_bits(GRID), NG = DIM / G, kTiles = key_ring_tiles(DIM);
  static constexpr int kRow = key_row_bytes(kBits, DIM), kPiece = key_ring_piece(kBits, DIM);
  static constexpr int kStride = key_ring_stride(kBits, DIM);
  static constexpr int kNormAt = 16 * kStride;  // a tile's norms [16][NG] after its code rows
  static constexpr int kTileBytes = key_ring_tile_bytes(kBits, DIM, NG);
  static constexpr int kSlot = key_ring_slot(kBits, DIM, NG);
  static constexpr int kStages = key_ring_stages(kBits, DIM, NG, Table<GRID>::kBytes);
  static constexpr int kRowPieces = kRow / kPiece, kTilePieces = 16 * kRowPieces;
  static constexpr int kTileNormPieces = 8 * NG;
  static_assert(key_ring_dim(DIM) && kRow % kPiece == 0 && kStride % kPiece == 0 && kNormAt % 16 == 0, "layout");
  static_assert(kStages >= 2 && kWarps * kStages * kSlot <= kCtaSmem - key_fixed_bytes(Table<GRID>::kBytes, DIM, 2),
                "the ring fits the CTA's shared memory");
};

// The stream of a warp's n items: tile h of item k starts at token n_first + 16 kWarps (kTiles k + h) of the
// (b, h_kv) slice whose codes start at c_bh and norms at r_bh.
template <LatticeGrid GRID, int DIM, int G>
__device__ __forceinline__ KeyRingStream<GRID, DIM, G> key_ring_stream(char* ring, int n, int64_t n_first,
                                                                       const uint32_t* c_bh, const uint16_t* r_bh,
                                                                       const GemvLatticeParams& p, int lane) {
  using Stream = KeyRingStream<GRID, DIM, G>;
  Stream st;
  st.ring = ring;
  st.n = n;
  st.dc = 16 * kWarps * Stream::kTiles * p.c_sn * 4;
#pragma unroll
  for (int k = 0; k < Stream::kCodes; ++k) {
    const int pc = lane + 32 * k, h = pc / Stream::kTilePieces, pt = pc - h * Stream::kTilePieces;
    const int r = pt / Stream::kRowPieces, j = pt - r * Stream::kRowPieces;
    st.has[k] = h < Stream::kTiles;
    const int64_t tok = n_first + (st.has[k] ? 16 * kWarps * h + r : 0);
    st.c[k] = reinterpret_cast<const char*>(c_bh + tok * p.c_sn) + j * Stream::kPiece;
    st.o[k] = h * Stream::kTileBytes + r * Stream::kStride + j * Stream::kPiece;
  }
#pragma unroll
  for (int k = 0; k < Stream::kMetas; ++k) {
    const int pn = lane + 32 * k, h = pn / Stream::kTileNormPieces;
    const int e = 2 * (pn - h * Stream::kTileNormPieces), r = e / Stream::NG, gi = e - r * Stream::NG;  // of [16][NG]
    st.hasm[k] = h < Stream::kTiles;
    const int64_t tok = n_first + (st.hasm[k] ? 16 * kWarps * h + r : 0);
    st.m[k] = reinterpret_cast<const char*>(r_bh + tok * p.r_sn + gi);
    st.om[k] = h * Stream::kTileBytes + Stream::kNormAt + 2 * e;
    st.dm[k] = 16 * kWarps * Stream::kTiles * p.r_sn * 2;
  }
  return st;
}

// RING: whole tiles through the code ring (key_ring_dim(DIM); the launcher checks the alignment: key_ring_ok).
template <LatticeGrid GRID, int DIM, int G, int NT, bool RING>
__global__ void __launch_bounds__(kThreads, kMinCtasPerSm) gemv_lattice_k_kernel(const GemvLatticeParams p,
                                                                                 const LatticeKLaunch k) {
  using TB = Table<GRID>;
  constexpr int QR = 4 * NT;       // query rows per pass
  constexpr int KS = DIM / 16;     // k-steps of a row
  constexpr int KPG = G / 16;      // k-steps per group
  constexpr int NG = DIM / G;      // groups per row
  constexpr bool kBSmem = key_b_in_smem(DIM, NT);
  extern __shared__ __align__(16) float smem[];
  uint32_t* tab = reinterpret_cast<uint32_t*>(smem);       // the table, at shared offset 0
  float* qbuf = smem + TB::kBytes / 4;                      // [QR][DIM] rotated query rows
  // kBSmem: [KS / 2][NT][32 lanes] B fragments of two k-steps (b[0], b[1] of ks, then of ks + 1) per uint4
  uint4* bsm = reinterpret_cast<uint4*>(qbuf + QR * DIM);
  float* amax = qbuf + QR * DIM + (kBSmem ? KS * NT * 32 * 2 : 0);  // [QR] max |q'| per row
  const char* tabb = reinterpret_cast<const char*>(smem);
  char* ring = reinterpret_cast<char*>(smem) + key_fixed_bytes(TB::kBytes, DIM, NT);  // RING: kWarps rings

  const int H_kv = static_cast<int>(p.H_kv);
  const int64_t b = static_cast<int>(blockIdx.z) / H_kv, hkv = static_cast<int>(blockIdx.z) % H_kv;
  const int64_t n_begin = static_cast<int64_t>(blockIdx.x) * k.tokens_per_cta;
  const int64_t n_end = min(p.N, n_begin + k.tokens_per_cta);
  const int ntiles = static_cast<int>((n_end - n_begin + 15) / 16);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane >> 2, t = lane & 3;

  build_table<GRID, false>(p.grid, tab);
  KeyLane kl;
  kl.pos = GRID == LatticeGrid::kE2_64 ? 6 * t : 8 * t;
  kl.lane_off = static_cast<uint32_t>((lane % TB::kCopies) * TB::kEntryBytes);
  kl.xmask = x_mask(t);
  kl.xmul = x_mul<TB::kShift>(t);
  const uint32_t* c_bh = p.codes + b * p.c_sb + hkv * p.c_sh;
  const uint16_t* r_bh = p.norms + b * p.r_sb + hkv * p.r_sh;

  for (int q0 = 0; q0 < k.qb; q0 += QR) {
    // ---- rotate the pass's query rows: q' = H_n (s * q) per group ----------------------------------------------------
    __syncthreads();  // the table is built; the previous pass no longer reads qbuf
    for (int i = threadIdx.x; i < QR * DIM; i += kThreads) {
      const int q = i / DIM, c = i % DIM, qg = q0 + q;
      float v = 0.f;
      if (qg < k.qb) {
        v = load_x(p.x, p.x_dtype,
                   b * p.x_sb + (hkv * k.gq + qg / k.tc) * p.x_sh + (k.t0 + qg % k.tc) * p.x_st + c);
        if (p.signs != nullptr) v *= static_cast<float>(__ldg(p.signs + c % G));
      }
      qbuf[i] = v;
    }
    __syncthreads();
    fwht_rows(qbuf, QR, DIM, G, k.fwht_scale);
    if (warp < QR) {  // warp q: max |q'| of row q
      float m = 0.f;
      for (int c = lane; c < DIM; c += 32) m = nan_max(m, fabsf(qbuf[warp * DIM + c]));
      m = warp_max(m);
      if (lane == 0) amax[warp] = m;
    }
    __syncthreads();

    // ---- B fragments of every k-step: lane (g, t) holds query row 4 nt + g / 2, hi (g even) or lo. In registers, or
    // (kBSmem: D = 256 with 8 query rows would not fit) in shared memory, each lane reading back its own. 8 rows
    // (kKDup, key_kdup): B's columns are the 8 query rows, and "n-tile" nt holds part nt (hi, lo) of row g, two MMAs
    // into one accumulator (as the InnerQ GEMV's block_mma): no FADD of the halves before each group's fold.
    constexpr bool kKDup = key_kdup(GRID, DIM, G, NT);
    uint32_t bq[kBSmem ? 1 : KS][NT][2];
    float usq[NT];
    float* outq[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int q = b_col_row(kKDup, nt, g);
      const bool lo_part = b_col_lo(kKDup, nt, g);
      const float sc = exp2i(scale_exponent(amax[q]));
      const float* row = qbuf + q * DIM;
#pragma unroll
      for (int ks = 0; ks < KS; ++ks)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int kk = 2 * t + 8 * r;
          const HalfSplit s0 = split_half(row[lattice_key_channel(GRID, ks, kk)] * sc);
          const HalfSplit s1 = split_half(row[lattice_key_channel(GRID, ks, kk + 1)] * sc);
          const uint32_t v = lo_part ? pack_half2(s0.lo, s1.lo) : pack_half2(s0.hi, s1.hi);
          if constexpr (kBSmem) {
            reinterpret_cast<uint32_t*>(bsm + ((ks / 2) * NT + nt) * 32 + lane)[2 * (ks % 2) + r] = v;
          } else {
            bq[ks][nt][r] = v;
          }
        }
      // this thread's results: query row 4 nt + t of the pass (kKDup: 2t + nt)
      const int qo = slot_row(kKDup, nt, t), qg = q0 + qo;
      usq[nt] = exp2i(-scale_exponent(amax[qo]));
      outq[nt] = qg < k.qb ? k.out.base + b * k.out.sb + (hkv * k.gq + qg / k.tc) * k.out.sh + (qg % k.tc) * k.out.st
                           : nullptr;
    }

    // ---- 16-token tiles: thread (g, t) scores tokens g and g + 8 -------------------------------------------------------
    // rows ca / cb of codes, ra / rb of norms (in global memory, or in a ring slot: from_smem) -> acc[nt][0 / 1] for
    // query row 4 nt + t (kKDup: 2t + nt)
    const auto tile_scores = [&](auto from_smem, const uint32_t* ca, const uint32_t* cb, const uint16_t* ra,
                                 const uint16_t* rb, float (&acc)[NT][2]) {
      constexpr bool kSmem = decltype(from_smem)::value;
      // From a ring slot, both rows are read whole first with the widest shared loads their alignment allows (the
      // compiler, left to the per-k-step reads, issues one LDS.32 per word); from global memory, word by word.
      constexpr int KW = DIM * lattice_bits(GRID) / 32;  // words of a code row
      uint32_t wa[kSmem ? KW : 1], wb[kSmem ? KW : 1];
      if constexpr (kSmem) {
        copy_row<KW>(ca, wa);
        copy_row<KW>(cb, wb);
        ca = wa, cb = wb;
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = 0.f;
#pragma unroll
      for (int grp = 0; grp < NG; ++grp) {
        float d[NT][4];  // (kKDup: d[0] only)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) d[nt][0] = d[nt][1] = d[nt][2] = d[nt][3] = 0.f;
        uint4 bpair[NT];  // kBSmem: this k-step pair's B fragments (a group has an even number of k-steps)
#pragma unroll
        for (int kk = 0; kk < KPG; ++kk) {
          const int ks = grp * KPG + kk;
          uint32_t A[4];
          key_lookup<GRID, kSmem>(ca, ks, kl, tabb, A[0], A[2]);
          key_lookup<GRID, kSmem>(cb, ks, kl, tabb, A[1], A[3]);
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            if constexpr (kBSmem) {
              if (ks % 2 == 0) bpair[nt] = bsm[((ks / 2) * NT + nt) * 32 + lane];
              const uint32_t Bn[2] = {ks % 2 ? bpair[nt].z : bpair[nt].x, ks % 2 ? bpair[nt].w : bpair[nt].y};
              mma_m16n8k16(d[kKDup ? 0 : nt], A, Bn, d[kKDup ? 0 : nt]);
            } else {
              mma_m16n8k16(d[kKDup ? 0 : nt], A, bq[ks][nt], d[kKDup ? 0 : nt]);
            }
          }
        }
        // d = (token a: query t hi, lo; token b: query t hi, lo), kKDup d[0] = (token a: query 2t, 2t + 1; token b:
        // the same); the group's norms in fp32
        const float sa = half_bits_to_float(ld_ro<kSmem>(ra + grp)), sb = half_bits_to_float(ld_ro<kSmem>(rb + grp));
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          acc[nt][0] = fmaf(sa, kKDup ? d[0][nt] : d[nt][0] + d[nt][1], acc[nt][0]);
          acc[nt][1] = fmaf(sb, kKDup ? d[0][2 + nt] : d[nt][2] + d[nt][3], acc[nt][1]);
        }
      }
    };
    // Whole tiles: row and output pointers advanced by the warps' stride (the hot loop).
    const int full_tiles = static_cast<int>((n_end - n_begin) / 16);
    int tile = warp;
    {
      const int64_t na = n_begin + 16 * warp + g;
      const uint32_t* ca = c_bh + na * p.c_sn;
      const uint32_t* cb = ca + 8 * p.c_sn;
      const uint16_t* ra = r_bh + na * p.r_sn;
      const uint16_t* rb = ra + 8 * p.r_sn;
      float* o[NT];  // rows past the pass's query rows point at row 0 and store nothing
      bool ok[NT];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        ok[nt] = outq[nt] != nullptr;
        o[nt] = (ok[nt] ? outq[nt] : k.out.base) + na;
      }
      // tile results at token offset `at` from o[], which then moves on by `step` tokens
      const auto store = [&](const float (&acc)[NT][2], int at, int step) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          if (ok[nt]) {
            o[nt][at] = acc[nt][0] * usq[nt];
            o[nt][at + 8] = acc[nt][1] * usq[nt];
          }
          o[nt] += step;
        }
      };
      if constexpr (RING) {
        using Stream = KeyRingStream<GRID, DIM, G>;
        constexpr int kT = Stream::kTiles;
        const int mine = full_tiles > warp ? (full_tiles - warp + kWarps - 1) / kWarps : 0;  // this warp's whole tiles
        const int n = mine / kT;  // items; an odd tile left at head_dim 64 goes to the tiles below
        Stream st = key_ring_stream<GRID, DIM, G>(ring + warp * Stream::kStages * Stream::kSlot, n,
                                                  n_begin + 16 * warp, c_bh, r_bh, p, lane);
        run_ring(st, [&](int, const char* slot) {
#pragma unroll
          for (int h = 0; h < kT; ++h) {
            // 16-byte aligned (slots and tiles are multiples of 16 bytes): rows of 16-byte multiples read as LDS.128
            const char* tb = static_cast<const char*>(__builtin_assume_aligned(slot + h * Stream::kTileBytes, 16));
            const uint32_t* rows = reinterpret_cast<const uint32_t*>(tb);
            const uint16_t* nr = reinterpret_cast<const uint16_t*>(tb + Stream::kNormAt);
            float acc[NT][2];
            tile_scores(std::true_type{}, rows + g * (Stream::kStride / 4), rows + (g + 8) * (Stream::kStride / 4),
                        nr + g * Stream::NG, nr + (g + 8) * Stream::NG, acc);
            store(acc, 16 * kWarps * h, h == kT - 1 ? 16 * kWarps * kT : 0);
          }
        });
        tile += n * kT * kWarps;
      } else {
        const int64_t dc = 16 * kWarps * p.c_sn, dr = 16 * kWarps * p.r_sn;
#pragma unroll 1
        for (; tile < full_tiles; tile += kWarps) {
          float acc[NT][2];
          tile_scores(std::false_type{}, ca, cb, ra, rb, acc);
          store(acc, 0, 16 * kWarps);
          ca += dc, cb += dc, ra += dr, rb += dr;
        }
      }
    }
    // A warp's odd whole tile at head_dim 64 with the ring, and the CTA's last, partial tile: rows past the end read the
    // last token, results not stored. (Two ifs, not a loop: the SASS model finds the ring's loop as the only one.)
    const auto general_tile = [&](int tile) {
      const int64_t tb = n_begin + 16 * tile;
      const int64_t na = min(tb + g, n_end - 1), nb = min(tb + g + 8, n_end - 1);
      float acc[NT][2];
      tile_scores(std::false_type{}, c_bh + na * p.c_sn, c_bh + nb * p.c_sn, r_bh + na * p.r_sn, r_bh + nb * p.r_sn,
                  acc);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        if (outq[nt] == nullptr) continue;
        if (tb + g < n_end) outq[nt][tb + g] = acc[nt][0] * usq[nt];
        if (tb + g + 8 < n_end) outq[nt][tb + g + 8] = acc[nt][1] * usq[nt];
      }
    };
    if (RING && key_ring_tiles(DIM) == 2 && tile < full_tiles) {
      general_tile(tile);
      tile += kWarps;
    }
    if (tile < ntiles) general_tile(tile);
  }
}

// =====================================================================================================================
// Values
// =====================================================================================================================
struct LatticeVLaunch {
  int64_t t0;         // first query row (of T) of this launch
  int tc;             // query rows per head in this launch
  int gq;             // query heads per KV head
  int qb;             // query rows per CTA = gq * tc
  int cw;             // column tiles per CTA = D / DW; row lanes = kWarps / cw
  int log2g;          // log2(G)
  int64_t split_len;  // tokens per split (a multiple of 16 x row lanes unless it is all of N)
  float fwht_scale;   // fp32(1 / sqrt(G))
  bool finish;        // one split: inverse transform and signs here, into y; else rotated partial sums to `out`
  OutView out;        // y (finish) or the workspace [splits, B, H_q, tc, D]
};

// Words of a lane group's slice of one token's code row segment (the warp's DW channels), and what it holds.
template <LatticeGrid GRID, int DW>
struct VSlice {
  // EDEN2-16 / EDEN4-256: one word (DW 128) or half of one (DW 64); EDEN2-256: DW / 64 words; EDEN2-64: a block
  static constexpr int kWords = GRID == LatticeGrid::kE2_64 ? 3 : GRID == LatticeGrid::kE2_256 ? DW / 64 : 1;
};
constexpr int quarters_per_slice(int dw) { return dw / 64; }  // EDEN2-64: quarters of a block per lane group

template <LatticeGrid GRID, int DW>
__device__ __forceinline__ int slice_word(int g) {  // first word of lane group g's slice in the segment
  if constexpr (GRID == LatticeGrid::kE2_64) return 3 * (g / (4 / quarters_per_slice(DW)));
  else if constexpr (GRID == LatticeGrid::kE2_256) return g * VSlice<GRID, DW>::kWords;
  else return DW == 128 ? g : g / 2;
}

struct ValueLane {
  int bbase;          // first byte of the slice in its word (EDEN2-16 / EDEN4-256 at DW 64: 2 (g & 1))
  int qpos[2];        // EDEN2-64: bit position 6q of the slice's quarters
  uint32_t xmask[2], xmul[2];
  uint32_t lane_off;  // the lane's table copy, in bytes
};

// The slice's A registers of one token pair (tokens u0, u1 in the low / high halves): A[mt][2 P + h], h = 0 for the
// m-tile's row g, 1 for row g + 8, each multiplied by the pair's norms r01 (unless NB: the norms are in B).
template <LatticeGrid GRID, int DW, bool NB>
__device__ __forceinline__ void value_pair(const uint32_t (&x0)[VSlice<GRID, DW>::kWords],
                                           const uint32_t (&x1)[VSlice<GRID, DW>::kWords], uint32_t r01, int P,
                                           const ValueLane& vl, const char* tab, uint32_t (&A)[DW / 16][4]) {
  constexpr int S = Table<GRID>::kShift, MT = DW / 16;
  const auto scale = [&](uint32_t a) { return NB ? a : hmul2(a, r01); };
  if constexpr (GRID == LatticeGrid::kE2_16) {
    // byte b of u: pair 2b of the word for both tokens (u0's index low nibble), of v: pair 2b + 1
    const uint32_t u = lop3<kLutSelect>(x0[0], x1[0] << 4, 0x0F0F0F0Fu);
    const uint32_t v = lop3<kLutSelect>(x0[0] >> 4, x1[0], 0x0F0F0F0Fu);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const uint2 e = lds64(tab, field_addr<S, 8>(mt % 2 ? v : u, 8 * (vl.bbase + mt / 2), vl.lane_off));
      A[mt][2 * P] = scale(e.x);
      A[mt][2 * P + 1] = scale(e.y);
    }
  } else if constexpr (GRID == LatticeGrid::kE4_256) {
#pragma unroll
    for (int qd = 0; qd < MT / 2; ++qd) {
      const int pos = 8 * (vl.bbase + qd);
      const uint2 e0 = lds64(tab, field_addr<S, 8>(x0[0], pos, vl.lane_off));
      const uint2 e1 = lds64(tab, field_addr<S, 8>(x1[0], pos, vl.lane_off));
      A[2 * qd][2 * P] = scale(prmt(e0.x, e1.x, 0x5410u));
      A[2 * qd][2 * P + 1] = scale(prmt(e0.x, e1.x, 0x7632u));
      A[2 * qd + 1][2 * P] = scale(prmt(e0.y, e1.y, 0x5410u));
      A[2 * qd + 1][2 * P + 1] = scale(prmt(e0.y, e1.y, 0x7632u));
    }
  } else {
    uint32_t e0[MT], e1[MT];
    if constexpr (GRID == LatticeGrid::kE2_256) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        e0[mt] = lds32(tab, field_addr<S, 8>(x0[mt / 4], 8 * (mt % 4), vl.lane_off));
        e1[mt] = lds32(tab, field_addr<S, 8>(x1[mt / 4], 8 * (mt % 4), vl.lane_off));
      }
    } else {  // EDEN2-64: m-tile 4 qi + e is element e of the slice's quarter qi
      const uint32_t top0 = quarter_top(x0[0], x0[1], x0[2]), top1 = quarter_top(x1[0], x1[1], x1[2]);
#pragma unroll
      for (int qi = 0; qi < MT / 4; ++qi) {
#pragma unroll
        for (int e = 0; e < 3; ++e) {
          e0[4 * qi + e] = lds32(tab, field_addr<S, 6>(x0[e], vl.qpos[qi], vl.lane_off));
          e1[4 * qi + e] = lds32(tab, field_addr<S, 6>(x1[e], vl.qpos[qi], vl.lane_off));
        }
        e0[4 * qi + 3] = lds32(tab, x_addr<S>(top0, vl.xmask[qi], vl.xmul[qi], vl.lane_off));
        e1[4 * qi + 3] = lds32(tab, x_addr<S>(top1, vl.xmask[qi], vl.xmul[qi], vl.lane_off));
      }
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      A[mt][2 * P] = scale(prmt(e0[mt], e1[mt], 0x5410u));
      A[mt][2 * P + 1] = scale(prmt(e0[mt], e1[mt], 0x7632u));
    }
  }
}

// K-steps per iteration of the values' main loop, their code words (4 tokens x kWords per thread and k-step) loaded
// together before any of their MMAs: one k-step is 256-1024 bytes a warp, and with one in flight per warp the SASS
// model put these loops latency-bound at 23-65 % of copy bandwidth (4.5-13 KB in flight per SM). Up to 16 registers of
// words per k-step batch (one-word slices: 4 k-steps; EDEN2-256's two words at 128 channels: 2; EDEN2-64's three: 2,
// 24 registers beside the accumulators' 32-64, spilling a few outside the loop at 8 query rows).
template <LatticeGrid GRID, int DW>
__host__ __device__ constexpr int value_unroll() {
  return VSlice<GRID, DW>::kWords == 1 ? 4 : 2;
}

// NB (one group per row, G = D): every m-tile has the row's one norm, so it multiplies p in fp32 before the hi / lo
// split (B = p r) and A is the bare table entry: no HMUL2, no norm loads in the main loop, one fp16 rounding fewer.
template <LatticeGrid GRID, int DW, int NT, bool NB>
__global__ void __launch_bounds__(kThreads, kMinCtasPerSm) gemv_lattice_v_kernel(const GemvLatticeParams p,
                                                                                 const LatticeVLaunch k) {
  using TB = Table<GRID>;
  using SL = VSlice<GRID, DW>;
  constexpr int QR = 4 * NT;   // query rows per pass
  constexpr int MT = DW / 16;  // m-tiles per warp
  constexpr int BITS = lattice_bits(GRID);
  extern __shared__ __align__(16) float smem[];
  uint32_t* tab = reinterpret_cast<uint32_t*>(smem);      // the table, at shared offset 0
  const char* tabb = reinterpret_cast<const char*>(smem);
  float* unscale = smem + TB::kBytes / 4;                 // [QR] 2^-e * 16 per query row
  unsigned* amax = reinterpret_cast<unsigned*>(unscale + QR);  // [QR] float bits of max |p|
  float* region = unscale + 4 * NT * 2;                   // 16-byte aligned: the staged B fragments, then the sums
  uint2* xfrag = reinterpret_cast<uint2*>(region);        // [NT][nks][32 lanes]
  uint16_t* rsm = reinterpret_cast<uint16_t*>(xfrag + NT * ((min(k.split_len, p.N) + 15) / 16) * 32);  // [D/G][nks*16]
  float* red = region;                                    // [kWarps][QR][DW] after the main loop
  float* fbuf = region;                                   // [QR][D] after the row lanes are summed

  const int H_kv = static_cast<int>(p.H_kv);
  const int64_t b = static_cast<int>(blockIdx.z) / H_kv, hkv = static_cast<int>(blockIdx.z) % H_kv;
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * k.split_len;
  const int rlen = static_cast<int>(min(k.split_len, p.N - n0));
  const int nks = (rlen + 15) / 16, nfull = rlen / 16;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane >> 2, t = lane & 3;
  const int cw = k.cw, rw = kWarps / cw;
  const int ctile = warp % cw, rlane = warp / cw;
  const int D = cw * DW;
  const int G = 1 << k.log2g;
  const int NGr = D >> k.log2g;  // groups per row

  build_table<GRID, true>(p.grid, tab);
  ValueLane vl;
  vl.lane_off = static_cast<uint32_t>((lane % TB::kCopies) * TB::kEntryBytes);
  vl.bbase = DW == 64 ? 2 * (g & 1) : 0;
  int slice_ch;  // first channel (of the warp's DW) of the slice's 32-channel block or of the slice itself
  if constexpr (GRID == LatticeGrid::kE2_64) {
    constexpr int nq = quarters_per_slice(DW), per_block = 4 / nq;  // quarters per slice, lane groups per block
#pragma unroll
    for (int qi = 0; qi < 2; ++qi) {
      const int q = (g % per_block) * nq + (qi < nq ? qi : 0);
      vl.qpos[qi] = 6 * q;
      vl.xmask[qi] = x_mask(q);
      vl.xmul[qi] = x_mul<TB::kShift>(q);
    }
    slice_ch = 32 * (g / per_block);
  } else {
    vl.qpos[0] = vl.qpos[1] = 0;
    vl.xmask[0] = vl.xmask[1] = vl.xmul[0] = vl.xmul[1] = 0u;
    slice_ch = g * (DW / 8);
  }
  const int grp = (ctile * DW + slice_ch) >> k.log2g;  // the slice's group: one norm per token

  for (int q0 = 0; q0 < k.qb; q0 += QR) {
    // ---- stage the probabilities (as gemv_kivi: per-row scale 2^e, then hi / lo fragments) -------------------------
    __syncthreads();
    if (threadIdx.x < QR) amax[threadIdx.x] = 0u;
    const auto xoff_of = [&](int q) -> int64_t {
      const int qg = q0 + q;
      return qg < k.qb ? b * p.x_sb + (hkv * k.gq + qg / k.tc) * p.x_sh + (k.t0 + qg % k.tc) * p.x_st + n0 : -1;
    };
    // B's value for token r of the split: p, or (NB) p times the token's norm in fp32
    const uint16_t* r_row = p.norms + b * p.r_sb + hkv * p.r_sh + n0 * p.r_sn;
    const auto bval = [&](int64_t xoff, int r) {
      const float v = load_x(p.x, p.x_dtype, xoff + r);
      return NB ? v * half_bits_to_float(__ldg(r_row + r * p.r_sn)) : v;
    };
    __syncthreads();
    stage_row_scales<QR>(xoff_of, bval, rlen, amax, unscale, 16.f, lane);
    // fragment of lane (col g, t) for k-step ks: p[q][16 ks + 4t .. + 3], q = 4 nt + g / 2, hi (g even) or lo
    stage_fragments_k16(xoff_of, bval, rlen, NT, nks, amax, xfrag, warp, kWarps, lane);
    // the split's norms, [group][token] (0 past the split's end): a thread reads its four tokens' with one LDS.64
    for (int i = threadIdx.x; !NB && i < NGr * nks * 16; i += kThreads) {
      const int gi = i / (nks * 16), r = i - gi * (nks * 16);
      rsm[i] = r < rlen ? __ldg(p.norms + b * p.r_sb + hkv * p.r_sh + (n0 + r) * p.r_sn + gi) : uint16_t{0};
    }
    __syncthreads();

    // ---- main loop: this warp's k-steps rlane, rlane + rw, ... of the split ------------------------------------------
    float d[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) d[i][nt][0] = d[i][nt][1] = d[i][nt][2] = d[i][nt][3] = 0.f;
    {
      // Code rows of the thread's four tokens (4t + j of the k-step), one pointer per row, each advanced by 16 rw
      // rows per k-step: one 64-bit add per row (laundered, or the compiler re-derives three of them from the first
      // every k-step, at two or three instructions each). Their norms come from the staged copy.
      const int64_t nfirst = n0 + 16 * rlane + 4 * t;
      const uint32_t* cr[4];
#pragma unroll
      for (int j = 0; j < 4; ++j)
        cr[j] = launder(p.codes + b * p.c_sb + hkv * p.c_sh + (nfirst + j) * p.c_sn + ctile * (DW * BITS / 32) +
                        slice_word<GRID, DW>(g));
      const int64_t c_step = 16 * rw * p.c_sn;
      const uint2* frag = xfrag + rlane * 32 + lane;
      const uint2* rn = reinterpret_cast<const uint2*>(rsm + grp * nks * 16 + 16 * rlane) + t;
      const int frag_nt = nks * 32;
      // the MMAs of one k-step on its code words w, B fragments from f, norms from r
      const auto mma_step = [&](const uint32_t (&w)[4][SL::kWords], const uint2* f, const uint2* r_at) {
        const uint2 r = NB ? make_uint2(0u, 0u) : *r_at;  // (norm 4t, 4t + 1), (4t + 2, 4t + 3) as fp16 pairs
        uint2 B[NT];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) B[nt] = f[nt * frag_nt];
        uint32_t A[MT][4];
        value_pair<GRID, DW, NB>(w[0], w[1], r.x, 0, vl, tabb, A);  // tokens 4t, 4t + 1
        value_pair<GRID, DW, NB>(w[2], w[3], r.y, 1, vl, tabb, A);  // tokens 4t + 2, 4t + 3
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            const uint32_t Bn[2] = {B[nt].x, B[nt].y};
            mma_m16n8k16(d[mt][nt], A[mt], Bn, d[mt][nt]);
          }
      };
      const auto advance = [&](int steps) {
#pragma unroll
        for (int j = 0; j < 4; ++j) cr[j] += steps * c_step;
        frag += steps * rw * 32;
        if (!NB) rn += steps * 4 * rw;
      };
      int ks = rlane;
      // U whole k-steps per iteration, all their code words loaded before the first MMA (value_unroll)
      constexpr int U = value_unroll<GRID, DW>();
      if constexpr (U > 1) {
        int64_t uoff[U];  // k-step u's rows from cr[]
#pragma unroll
        for (int u = 0; u < U; ++u) uoff[u] = u * c_step;
#pragma unroll 1
        for (; ks + (U - 1) * rw < nfull; ks += U * rw) {
          uint32_t w[U][4][SL::kWords];
#pragma unroll
          for (int u = 0; u < U; ++u)
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
              for (int i = 0; i < SL::kWords; ++i) w[u][j][i] = __ldg(cr[j] + uoff[u] + i);
#pragma unroll
          for (int u = 0; u < U; ++u) mma_step(w[u], frag + u * rw * 32, rn + (NB ? 0 : u * 4 * rw));
          advance(U);
        }
      }
      // the rest one k-step at a time, then the split's last, partial k-step (tokens past its end: zero norm, no load)
      const auto load_step = [&](uint32_t (&w)[4][SL::kWords], int rows_left) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
          for (int i = 0; i < SL::kWords; ++i) w[j][i] = 4 * t + j < rows_left ? __ldg(cr[j] + i) : 0u;
        }
      };
#pragma unroll 1
      for (; ks < nfull; ks += rw) {
        uint32_t w[4][SL::kWords];
        load_step(w, 16);
        mma_step(w, frag, rn);
        advance(1);
      }
      if (ks < nks) {
        uint32_t w[4][SL::kWords];
        load_step(w, rlen - 16 * ks);
        mma_step(w, frag, rn);
      }
    }

    // ---- combine hi + lo, sum the row lanes in a fixed order --------------------------------------------------------
    // lane (g, t) holds, for query row 4 nt + t, rows g (d[..][0] + [1]) and g + 8 ([2] + [3]) of every m-tile
    __syncthreads();  // the staged fragments are no longer read: `red` reuses the shared memory
    float* mine = red + warp * QR * DW;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          mine[(4 * nt + t) * DW + lattice_value_channel(GRID, DW, g, mt, h)] = d[mt][nt][2 * h] + d[mt][nt][2 * h + 1];
    __syncthreads();
    float sums[QR * 256 / kThreads];  // QR x D values over the CTA's threads (D <= 256)
#pragma unroll
    for (int i = 0; i < QR * 256 / kThreads; ++i) {
      const int idx = threadIdx.x + i * kThreads;
      sums[i] = 0.f;
      if (idx < QR * D) {
        const int q = idx / D, c = idx - q * D, ct = c / DW, cc = c - ct * DW;
        float s = 0.f;
        for (int rl = 0; rl < rw; ++rl) s += red[((rl * cw + ct) * QR + q) * DW + cc];  // fixed order
        sums[i] = s * unscale[q];
      }
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < QR * 256 / kThreads; ++i) {
      const int idx = threadIdx.x + i * kThreads;
      if (idx < QR * D) fbuf[idx] = sums[i];
    }
    __syncthreads();

    // ---- one split: inverse transform, signs, y; else the rotated partial sums ---------------------------------------
    if (k.finish) fwht_rows(fbuf, QR, D, G, k.fwht_scale);
    for (int idx = threadIdx.x; idx < QR * D; idx += kThreads) {
      const int q = idx / D, c = idx - q * D, qg = q0 + q;
      if (qg >= k.qb) continue;
      float v = fbuf[idx];
      if (k.finish && p.signs != nullptr) v *= static_cast<float>(__ldg(p.signs + (c & (G - 1))));
      float* out = k.out.base + blockIdx.y * k.out.s_split + b * k.out.sb + (hkv * k.gq + qg / k.tc) * k.out.sh +
                   (qg % k.tc) * k.out.st;
      out[c] = v;
    }
  }
}

// Split-K finish: y[b, h, t, :] = s * H_n (sum_{split} ws[split, b, h, t, :]) per group (sum in a fixed order). One CTA
// per row (b, h, t), blockDim >= D / 2; dynamic shared memory holds the row.
__global__ void lattice_v_finish_kernel(const float* __restrict__ ws, int splits, int64_t split_stride, int H, int T,
                                        int D, int G, float scale, const int8_t* __restrict__ signs, float* y,
                                        int64_t y_sb, int64_t y_sh, int64_t y_st) {
  extern __shared__ __align__(16) float smem[];
  const int r = blockIdx.x;  // (b * H + h) * T + t
  const int t = r % T, h = (r / T) % H, b = r / (T * H);
  const float* src = ws + static_cast<int64_t>(r) * D;
  for (int c = threadIdx.x; c < D; c += blockDim.x) {
    float s = 0.f;
    const float* w = src + c;
    for (int sp = 0; sp < splits; ++sp, w += split_stride) s += *w;  // fixed order: deterministic
    smem[c] = s;
  }
  __syncthreads();
  fwht_rows(smem, 1, D, G, scale);
  float* dst = y + b * y_sb + h * y_sh + t * y_st;
  for (int c = threadIdx.x; c < D; c += blockDim.x)
    dst[c] = signs == nullptr ? smem[c] : smem[c] * static_cast<float>(__ldg(signs + c % G));
}

// ---- planning --------------------------------------------------------------------------------------------------
using LatticeKernel = void (*)(const GemvLatticeParams, const LatticeKLaunch);
using LatticeVKernel = void (*)(const GemvLatticeParams, const LatticeVLaunch);

int log2i(int v) {
  int l = 0;
  while ((1 << l) < v) ++l;
  return l;
}

float fwht_scale(int G) { return static_cast<float>(1.0 / std::sqrt(static_cast<double>(G))); }

template <LatticeGrid GRID, int DIM, int NT, bool RING>
LatticeKernel key_kernel(int G) {
  switch (G) {
    case 32: return gemv_lattice_k_kernel<GRID, DIM, 32, NT, RING>;
    case 64: return gemv_lattice_k_kernel<GRID, DIM, 64, NT, RING>;
    case 128:
      if constexpr (DIM >= 128) return gemv_lattice_k_kernel<GRID, DIM, 128, NT, RING>;
      break;
    case 256:
      if constexpr (DIM >= 256) return gemv_lattice_k_kernel<GRID, DIM, 256, NT, RING>;
      break;
    default: break;
  }
  return nullptr;
}

template <LatticeGrid GRID, int DIM, int NT>
LatticeKernel key_kernel(int G, bool ring) {
  if constexpr (key_ring_dim(DIM)) {
    if (ring) return key_kernel<GRID, DIM, NT, true>(G);
  }
  return key_kernel<GRID, DIM, NT, false>(G);
}

cudaError_t select_key_kernel(LatticeGrid grid, int D, int G, int nt, bool ring, LatticeKernel* fn) {
  *fn = nullptr;
  KVK_DISPATCH_LATTICE_GRID(grid, GRID, {
    KVK_DISPATCH_HEAD_DIM(D, DIM, { KVK_DISPATCH_NTILES(nt, NT, { *fn = key_kernel<GRID, DIM, NT>(G, ring); }) })
  })
  if (*fn == nullptr) {
    set_launch_error("unsupported group_size %d for head_dim %d (a power of two in [32, head_dim])", G, D);
    return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

template <LatticeGrid GRID, int NT, bool NB>
LatticeVKernel value_kernel(int dw) {
  return dw == 64 ? gemv_lattice_v_kernel<GRID, 64, NT, NB> : gemv_lattice_v_kernel<GRID, 128, NT, NB>;
}

cudaError_t select_value_kernel(LatticeGrid grid, int dw, int nt, bool nb, LatticeVKernel* fn) {
  KVK_DISPATCH_LATTICE_GRID(grid, GRID, {
    KVK_DISPATCH_NTILES(nt, NT, { *fn = nb ? value_kernel<GRID, NT, true>(dw) : value_kernel<GRID, NT, false>(dw); })
  })
  return cudaSuccess;
}

int occupancy(const void* fn, size_t smem) { return resident_ctas_per_sm(fn, kThreads, smem); }

size_t table_bytes(LatticeGrid g) {
  switch (g) {
    case LatticeGrid::kE2_16: return Table<LatticeGrid::kE2_16>::kBytes;
    case LatticeGrid::kE2_64: return Table<LatticeGrid::kE2_64>::kBytes;
    case LatticeGrid::kE2_256: return Table<LatticeGrid::kE2_256>::kBytes;
    default: return Table<LatticeGrid::kE4_256>::kBytes;
  }
}

// The shapes both launchers accept; a message, or nullptr.
const char* check_sizes(const GemvLatticeParams& p) {
  if (p.H_kv <= 0 || p.H_q % p.H_kv != 0) return "H_q must be a multiple of H_kv";
  if (p.D != 64 && p.D != 128 && p.D != 256) return "head_dim must be 64, 128 or 256";
  const int G = p.group_size;
  if (G < 32 || G > p.D || (G & (G - 1)) != 0) return "group_size must be a power of two in [32, head_dim]";
  if (p.grid == nullptr || lattice_grid_of(lattice_d(p.grid_kind), lattice_n(p.grid_kind)) < 0) return "bad grid";
  return nullptr;
}

// The keys' ring (key_ring_stream) copies 16- or 8-byte code pieces (key_ring_piece) at row starts and 4-byte norm
// pieces: two norms of a token (D / G >= 2), or of two consecutive tokens (D / G = 1, norms one per token, dense).
bool key_ring_ok(const GemvLatticeParams& p) {
  if (!key_ring_dim(p.D) || gemv_ring_disabled()) return false;
  const int64_t ng = p.D / p.group_size;
  const bool codes = rows_aligned(p.codes, key_ring_piece(lattice_bits(p.grid_kind), p.D), sizeof(uint32_t), p.B,
                                  p.c_sb, p.H_kv, p.c_sh, p.N, p.c_sn);
  const bool norms = ng >= 2 ? rows_aligned(p.norms, 4, sizeof(uint16_t), p.B, p.r_sb, p.H_kv, p.r_sh, p.N, p.r_sn)
                             : (p.N <= 1 || p.r_sn == 1) &&
                                   rows_aligned(p.norms, 4, sizeof(uint16_t), p.B, p.r_sb, p.H_kv, p.r_sh, 1, 0);
  return codes && norms;
}

struct KeyPlan {
  int nt;
  bool ring;
  int64_t t_chunk, tokens_per_cta, blocks;
  size_t smem_bytes;
  int ctas_per_sm;
  LatticeKernel fn;
  const char* error;
};

KeyPlan plan_keys(const GemvLatticeParams& p) {
  KeyPlan pl{};
  const int64_t gq = p.H_q / p.H_kv;
  pl.t_chunk = std::min<int64_t>(p.T, kMaxTPerLaunch);
  pl.nt = gq * pl.t_chunk <= 4 ? 1 : 2;
  pl.ring = key_ring_ok(p);
  if (select_key_kernel(p.grid_kind, p.D, p.group_size, pl.nt, pl.ring, &pl.fn) != cudaSuccess) {
    pl.error = "unsupported grid / head_dim / group_size";
    return pl;
  }
  const int64_t table = static_cast<int64_t>(table_bytes(p.grid_kind)), ng = p.D / p.group_size;
  const int bits = lattice_bits(p.grid_kind);
  pl.smem_bytes = static_cast<size_t>(
      key_fixed_bytes(table, p.D, pl.nt) +
      (pl.ring ? kWarps * key_ring_stages(bits, p.D, static_cast<int>(ng), table) *
                     key_ring_slot(bits, p.D, static_cast<int>(ng))
               : 0));
  pl.ctas_per_sm = occupancy(reinterpret_cast<const void*>(pl.fn), pl.smem_bytes);
  const int64_t wave = static_cast<int64_t>(pl.ctas_per_sm) * std::max(p.num_sms, 1);
  const int64_t bh = p.B * p.H_kv, tiles = ceil_div(p.N, 16);
  // tiles per warp: doubled while the grid still spans two waves (fewer CTAs build the table and rotate the query)
  // and a CTA does not yet cover every token (beyond that, doubling changes nothing and would run to overflow). With
  // the ring, one wave: its items stream only while a warp has more tiles than stages (32k tokens, 8 KV heads, 132
  // SMs: 4 tiles a warp instead of 2).
  const int64_t waves = pl.ring ? 1 : 2;
  int64_t tpw = 1;
  while (kWarps * tpw < tiles && bh * ceil_div(tiles, kWarps * tpw * 2) >= waves * wave) tpw *= 2;
  pl.tokens_per_cta = 16 * kWarps * tpw;
  pl.blocks = ceil_div(p.N, pl.tokens_per_cta);
  if (pl.smem_bytes > static_cast<size_t>(pl.ring ? kCtaSmem : kSmemBudget)) pl.error = "shared memory";
  if (pl.blocks > 0x7fffffff || bh > 65535) pl.error = "grid too large";
  return pl;
}

struct ValuePlan {
  int nt, dw, cw;
  bool nb;  // norms in B (G = D)
  int64_t t_chunk, split_len, num_splits;
  size_t smem_bytes;
  int64_t workspace_floats;
  int ctas_per_sm;
  LatticeVKernel fn;
  const char* error;
};

size_t value_smem(LatticeGrid g, int nt, int dw, int ngroups, int64_t rows) {
  const size_t fixed = table_bytes(g) + 2 * 4 * nt * sizeof(float);
  const size_t stage = static_cast<size_t>(ceil_div(rows, 16)) * (nt * 32 * 8 + ngroups * 16 * 2);  // B, norms
  const size_t red = static_cast<size_t>(kWarps) * 4 * nt * dw * sizeof(float);  // >= QR x D (D <= 4 DW)
  return fixed + std::max(stage, red);
}

ValuePlan plan_values(const GemvLatticeParams& p) {
  ValuePlan pl{};
  const int64_t gq = p.H_q / p.H_kv;
  pl.t_chunk = std::min<int64_t>(p.T, kMaxTPerLaunch);
  pl.nt = gq * pl.t_chunk <= 4 ? 1 : 2;
  pl.dw = p.D == 64 ? 64 : 128;
  pl.cw = p.D / pl.dw;
  pl.nb = p.group_size == p.D;
  if (select_value_kernel(p.grid_kind, pl.dw, pl.nt, pl.nb, &pl.fn) != cudaSuccess) {
    pl.error = "unsupported grid";
    return pl;
  }
  pl.ctas_per_sm = occupancy(reinterpret_cast<const void*>(pl.fn), kSmemBudget);
  const int64_t wave = static_cast<int64_t>(pl.ctas_per_sm) * std::max(p.num_sms, 1);
  const int64_t bh = p.B * p.H_kv;
  const int rw = kWarps / pl.cw;
  // tokens per split: all of N if shared memory allows, else the longest multiple of 16 x rw that fits
  int64_t max_rows = 16 * rw;
  const int ng = pl.nb ? 0 : p.D / p.group_size;  // staged norm groups
  while (value_smem(p.grid_kind, pl.nt, pl.dw, ng, max_rows + 16 * rw) <= kSmemBudget) max_rows += 16 * rw;
  if (gemv_planner_v1()) {  // the first GPU run's rule (the GEMVs then): ceil(wave / CTAs) splits under a wave
    pl.split_len = p.N <= max_rows ? p.N : max_rows;
    if (bh * ceil_div(p.N, pl.split_len) < wave && p.N >= 2 * kMinSplitTokens) {
      const int64_t want = ceil_div(wave, bh);  // splits for one wave
      const int64_t len = round_up(std::max(ceil_div(p.N, want), kMinSplitTokens), 16 * rw);
      if (len < pl.split_len) pl.split_len = len;
    }
  } else {  // whole waves (gemv.cuh); a CTA's fixed work (the table, the query, the norms' staging) ~2 k-steps
    pl.split_len = wave_split_len(p.N, 16 * rw, kMinSplitTokens, max_rows, bh, wave, 2);
  }
  pl.num_splits = ceil_div(p.N, pl.split_len);
  pl.smem_bytes = value_smem(p.grid_kind, pl.nt, pl.dw, ng, pl.split_len);
  if (pl.smem_bytes > kSmemBudget) pl.error = "shared memory";
  pl.workspace_floats = pl.num_splits > 1 ? pl.num_splits * p.B * p.H_q * pl.t_chunk * p.D : 0;
  if (pl.num_splits > 65535 || bh > 65535) pl.error = "grid too large";
  return pl;
}

}  // namespace

int64_t gemv_lattice_k_workspace_floats(const GemvLatticeParams&) { return 0; }

bool gemv_lattice_k_ring(const GemvLatticeParams& p) { return check_sizes(p) == nullptr && key_ring_ok(p); }

cudaError_t launch_gemv_lattice_k(const GemvLatticeParams& p, cudaStream_t stream) {
  clear_launch_error();
  if (p.B * p.H_q * p.T * p.N == 0) return cudaSuccess;
  if (const char* e = check_sizes(p)) {
    set_launch_error("gemv_lattice_k: %s (H_q=%lld H_kv=%lld D=%d G=%d)", e, (long long)p.H_q, (long long)p.H_kv, p.D,
                     p.group_size);
    return cudaErrorInvalidValue;
  }
  const KeyPlan pl = plan_keys(p);
  if (pl.error != nullptr) {
    if (last_launch_error()[0] == '\0') set_launch_error("gemv_lattice_k: %s", pl.error);
    return cudaErrorInvalidConfiguration;
  }
  const dim3 grid(static_cast<unsigned>(pl.blocks), 1u, static_cast<unsigned>(p.B * p.H_kv));
  const int64_t gq = p.H_q / p.H_kv;
  for (int64_t t0 = 0; t0 < p.T; t0 += pl.t_chunk) {
    LatticeKLaunch k{};
    k.t0 = t0;
    k.tc = static_cast<int>(std::min(pl.t_chunk, p.T - t0));
    k.gq = static_cast<int>(gq);
    k.qb = static_cast<int>(gq * k.tc);
    k.tokens_per_cta = pl.tokens_per_cta;
    k.fwht_scale = fwht_scale(p.group_size);
    k.out = OutView{p.y + t0 * p.y_st, p.y_sb, p.y_sh, p.y_st, 0};
    const LatticeKernel fn = pl.fn;
    fn<<<grid, kThreads, pl.smem_bytes, stream>>>(p, k);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

int64_t gemv_lattice_v_workspace_floats(const GemvLatticeParams& p) {
  if (p.B * p.H_q * p.T == 0 || p.N == 0 || check_sizes(p) != nullptr) return 0;
  return plan_values(p).workspace_floats;
}

cudaError_t launch_gemv_lattice_v(const GemvLatticeParams& p, cudaStream_t stream) {
  clear_launch_error();
  if (p.B * p.H_q * p.T == 0) return cudaSuccess;
  if (p.N == 0) {
    set_launch_error("gemv_lattice_v: N == 0 must be handled by the caller (y = 0)");
    return cudaErrorInvalidValue;
  }
  if (const char* e = check_sizes(p)) {
    set_launch_error("gemv_lattice_v: %s (H_q=%lld H_kv=%lld D=%d G=%d)", e, (long long)p.H_q, (long long)p.H_kv, p.D,
                     p.group_size);
    return cudaErrorInvalidValue;
  }
  const ValuePlan pl = plan_values(p);
  if (pl.error != nullptr) {
    if (last_launch_error()[0] == '\0') set_launch_error("gemv_lattice_v: %s", pl.error);
    return cudaErrorInvalidConfiguration;
  }
  if (pl.workspace_floats > 0 && (p.workspace == nullptr || p.workspace_floats < pl.workspace_floats)) {
    set_launch_error("gemv_lattice_v: workspace of %lld floats given, %lld needed", (long long)p.workspace_floats,
                     (long long)pl.workspace_floats);
    return cudaErrorInvalidValue;
  }
  const dim3 grid(1u, static_cast<unsigned>(pl.num_splits), static_cast<unsigned>(p.B * p.H_kv));
  const int64_t gq = p.H_q / p.H_kv;
  for (int64_t t0 = 0; t0 < p.T; t0 += pl.t_chunk) {
    LatticeVLaunch k{};
    k.t0 = t0;
    k.tc = static_cast<int>(std::min(pl.t_chunk, p.T - t0));
    k.gq = static_cast<int>(gq);
    k.qb = static_cast<int>(gq * k.tc);
    k.cw = pl.cw;
    k.log2g = log2i(p.group_size);
    k.split_len = pl.split_len;
    k.fwht_scale = fwht_scale(p.group_size);
    k.finish = pl.num_splits == 1;
    const int64_t rows = p.B * p.H_q * k.tc;
    if (k.finish) {
      k.out = OutView{p.y + t0 * p.y_st, p.y_sb, p.y_sh, p.y_st, 0};
    } else {
      k.out = OutView{p.workspace, p.H_q * k.tc * p.D, k.tc * p.D, p.D, rows * p.D};
    }
    const LatticeVKernel fn = pl.fn;
    fn<<<grid, kThreads, pl.smem_bytes, stream>>>(p, k);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    if (!k.finish) {
      if (rows > 0x7fffffff) {
        set_launch_error("gemv_lattice_v: %lld output rows exceed the grid", (long long)rows);
        return cudaErrorInvalidValue;
      }
      lattice_v_finish_kernel<<<static_cast<unsigned>(rows), 128, p.D * sizeof(float), stream>>>(
          p.workspace, static_cast<int>(pl.num_splits), rows * p.D, static_cast<int>(p.H_q), k.tc, p.D,
          p.group_size, k.fwht_scale, p.signs, p.y + t0 * p.y_st, p.y_sb, p.y_sh, p.y_st);
      err = cudaGetLastError();
      if (err != cudaSuccess) return err;
    }
  }
  return cudaSuccess;
}

}  // namespace kvk
