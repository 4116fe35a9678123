// The GEMVs' code ring (gemv_inner_q, gemv_kivi): a per-warp cp.async pipeline in shared memory. An item is 16 rows
// x 128 values of a store: the codes as 16-byte pieces (16 x BITS bytes per row), each row's four G = 32 scales as one
// 8-byte piece, and as many zeros for modes with zero points. A warp copies item i + kStages - 1 while it computes
// item i, so 2-5 items are in flight instead of the one a register-load loop keeps (the first GPU run measured those
// loops latency-bound: ~12 KB in flight per SM against the ~25-35 KB DRAM latency x bandwidth asks for).
#pragma once

#include <cstdint>

#include "async_copy.cuh"

namespace kvk {

// How a GEMV kernel reads its codes (its last template argument; the planners pick it).
constexpr int kLoadWords = 0;  // 32-bit loads into registers (unaligned rows, short reductions)
constexpr int kLoadVec = 1;    // wide loads into registers: aligned rows, but no ring (G != 32, ...)
constexpr int kLoadRing = 2;   // the cp.async ring
constexpr int kLoadRing64 = 3;  // the ring with two-tile items: gemv_inner_q's keys at head_dim 64 (its own kernel)

// Slots per warp: enough items in flight at every width within 48 KiB per CTA with the query tile.
__host__ __device__ constexpr int ring_stages(int bits) { return bits == 1 ? 6 : bits == 4 ? 3 : 4; }
// A slot's row: 16 x BITS bytes of codes, padded so that the rows one shared load instruction touches fall in
// distinct bank quads as far as the readers' patterns allow (gemv_inner_q: rows g and g + 8 whole, conflict-free;
// gemv_kivi: rows 4t .. 4t + 3 at the lane's columns, 2-way, the least any 16-byte multiple gives; pads 0 / 16 / 32
// / 48 checked exhaustively).
__host__ __device__ constexpr int ring_row_bytes(int bits) { return 16 * bits + (bits % 2 == 0 ? 16 : 0); }
__host__ __device__ constexpr int ring_code_bytes(int bits) { return 16 * ring_row_bytes(bits); }
// Codes, then 16 rows x 8 bytes of scales, then (zeros) 16 rows x 8 bytes of zero points.
__host__ __device__ constexpr int ring_slot_bytes(int bits, bool zeros) {
  return ring_code_bytes(bits) + (zeros ? 256 : 128);
}
__host__ __device__ constexpr int ring_warp_bytes(int bits, bool zeros) {
  return ring_stages(bits) * ring_slot_bytes(bits, zeros);
}

// A lane's share of copying one ring item, the `issue` half of run_ring's Stream contract: up to CODES code pieces of
// PIECE bytes and METAS metadata pieces (scales, zeros, norms) of META bytes, at slot offsets o / om, from sources c / m
// that move on by dc / dm[k] bytes per item; `has` / `hasm` say which of them this lane copies. ring and n: the warp's
// slots and its item count. A stream (gemv_inner_q's RingStream, gemv_lattice's KeyRingStream) derives from it, fills
// these arrays from kCodes / kPiece / kMetas / kMeta (its template arguments: the one place the counts are stated)
// and adds kStages / kSlot and the item's layout.
template <int CODES, int PIECE, int METAS, int META>
struct RingCopies {
  static constexpr int kCodes = CODES, kPiece = PIECE, kMetas = METAS, kMeta = META;
  const char* c[CODES];
  const char* m[METAS];
  int64_t dc, dm[METAS];
  int o[CODES], om[METAS];
  bool has[CODES], hasm[METAS];
  char* ring;
  int n;

  // Moves the sources past item i without copying it (run_ring, prefilled: ring_prologue copied it already).
  __device__ __forceinline__ void skip(int i) {
    if (i < n) {
#pragma unroll
      for (int k = 0; k < CODES; ++k) c[k] += dc;
#pragma unroll
      for (int k = 0; k < METAS; ++k) m[k] += dm[k];
    }
  }

  // Copies item i (if it exists) into its slot, then commits a group (empty past the end): run_ring's contract.
  __device__ __forceinline__ void issue(int i, char* slot) {
    if (i < n) {
#pragma unroll
      for (int k = 0; k < CODES; ++k) {
        if (has[k]) cp_async<PIECE>(smem_addr(slot + o[k]), c[k]);
        c[k] += dc;
      }
#pragma unroll
      for (int k = 0; k < METAS; ++k) {
        if (hasm[k]) cp_async<META>(smem_addr(slot + om[k]), m[k]);
        m[k] += dm[k];
      }
    }
    cp_async_commit();
  }
};

// run_ring's prologue on its own: copies the stream's first kStages - 1 items (committing a group each), so that a
// kernel can start them before other work, e.g. its query staging, whose global reads and barriers then overlap the
// items' DRAM latency. The run_ring that consumes them takes prefilled = true and a stream made the same way. The
// warp's first stream only (run_ring's __syncwarp, which protects slots a previous stream may still read, comes after).
template <typename Stream>
__device__ __forceinline__ void ring_prologue(Stream& st) {
#pragma unroll
  for (int i = 0; i < Stream::kStages - 1; ++i) st.issue(i, st.ring + i * Stream::kSlot);
}

// Runs a warp's stream of st.n items: consume(i, slot) for each, with Stream::kStages - 1 items in flight.
// st.issue(i, slot) copies item i (if it exists) into `slot` and commits a group (empty past the end), so the wait
// counts are the same in every iteration. Item i lives in slot i % kStages; the loop rotates two slot pointers instead
// of taking the remainder (3 and 6 stages are not powers of two). Starts with a __syncwarp: a previous stream of this
// warp may still be reading the slots this one's prologue refills. prefilled: ring_prologue has issued the first
// kStages - 1 items already (st.skip moves the sources past them).
template <typename Stream, typename Consume>
__device__ __forceinline__ void run_ring(Stream& st, const Consume& consume, bool prefilled = false) {
  constexpr int S = Stream::kStages, kSlot = Stream::kSlot;
  __syncwarp();
#pragma unroll
  for (int i = 0; i < S - 1; ++i) {
    if (prefilled)
      st.skip(i);
    else
      st.issue(i, st.ring + i * kSlot);
  }
  char* rd = st.ring;                    // item i's slot
  char* wr = st.ring + (S - 1) * kSlot;  // item i + S - 1's: the slot item i - 1 used
  char* const end = st.ring + S * kSlot;
#pragma unroll 1
  for (int i = 0; i < st.n; ++i) {
    cp_async_wait<S - 2>();  // this lane's copies of item i have landed
    __syncwarp();            // ... and every lane's; every lane is also done with item i - 1, whose slot refills now
    st.issue(i + S - 1, wr);
    consume(i, static_cast<const char*>(rd));
    wr = rd;
    rd = rd + kSlot == end ? st.ring : rd + kSlot;
  }
}

}  // namespace kvk
