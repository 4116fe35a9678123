// Torch-free interface of the compiled CUDA kernels: one params struct per op (pointers, int64 sizes and
// strides in elements) and a host launcher per op that returns cudaError_t. Filled and called only by
// csrc/cuda/torch_bindings.cpp, the one CUDA file that sees torch. Math and shapes: csrc/ops.cpp, docs/FORMATS.md.
//
// Conventions for every struct below:
//   * strides are in elements of the pointed-to type, int64 (B*H*M*L may exceed 2^31);
//   * the last dim of every tensor has stride 1 (the binding checks it), other dims any stride;
//   * fp16 tensors are passed as raw uint16_t bits, packed codes as uint32_t words;
//   * launchers never allocate: the split-K workspace is sized with *_workspace_floats() and passed in.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include "kvkernels/lattice.cuh"
#include "kvkernels/quant.cuh"

namespace kvk {

// Activation dtypes the GEMV and quantize kernels read (converted to fp32 on load).
enum class XDtype : int { kF16 = 0, kBF16 = 1, kF32 = 2 };

// Message of the last launcher failure on this thread (unsupported template value, bad config); "" if none.
// The binding appends it to its error so a `default:` dispatch branch reads as a sentence, not a code.
const char* last_launch_error();

// Whether environment variable `name` is set to exactly `value`: the launchers' benchmark switches, read per call
// (a getenv beside a launch).
inline bool env_equals(const char* name, const char* value) {
  const char* v = std::getenv(name);
  return v != nullptr && std::strcmp(v, value) == 0;
}

// Resident CTAs per SM of kernel `fn` with `threads` threads and `smem_bytes` of dynamic shared memory on the current
// device, at least 1 (a failed query counts as 1, is not cached, and does not become the launch's error). Every GEMV
// planner and the fused attention's (twice a call: workspace sizing, then the launch; two kernels each) ask on every
// call, which a decode step without a CUDA graph pays per layer on the host; the answer depends only on these
// arguments and the device, so it is cached (one entry per kernel instantiation and block shape a process plans).
inline int resident_ctas_per_sm(const void* fn, int threads, size_t smem_bytes) {
  struct Entry {
    int device;
    const void* fn;
    int threads;
    size_t smem;
    int ctas;
  };
  static std::mutex mu;
  static std::vector<Entry> cache;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    device = -1;
  }
  {
    const std::lock_guard<std::mutex> lock(mu);
    for (const Entry& e : cache)
      if (e.device == device && e.fn == fn && e.threads == threads && e.smem == smem_bytes) return e.ctas;
  }
  int ctas = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, fn, threads, smem_bytes) != cudaSuccess || ctas < 1) {
    (void)cudaGetLastError();  // an occupancy query failure is not the launch's error
    return 1;
  }
  const std::lock_guard<std::mutex> lock(mu);
  cache.push_back({device, fn, threads, smem_bytes, ctas});
  return ctas;
}

// KVKERNELS_GEMV_PLANNER=v1: the split / CTA-size rules of gemv_inner_q and gemv_kivi as the first GPU run (H200,
// 2026-11-26) measured them (shortest split 1024 / 512, InnerQ rows per CTA doubled while two waves remain, ceil(wave
// / CTAs) splits under a wave), and that split rule for gemv_lattice_v and decode_attention_fused (today's: whole
// waves, wave_split_len in gemv.cuh), so a benchmark can time them against today's rules on one machine. Read per
// plan; the math is the same up to the split-K summation order.
inline bool gemv_planner_v1() { return env_equals("KVKERNELS_GEMV_PLANNER", "v1"); }

// KVKERNELS_GEMV_RING=0: gemv_inner_q, gemv_kivi and gemv_lattice_k read codes into registers one step at a time
// (wide loads where aligned), as before their cp.async rings, so a benchmark can time the rings against them on one
// machine. Same results.
inline bool gemv_ring_disabled() { return env_equals("KVKERNELS_GEMV_RING", "0"); }

// KVKERNELS_GEMV_RING64=0: gemv_inner_q's keys at head_dim 64 (L = 64) take one-tile ring items, as before the
// two-tile items of the kLoadRing64 kernel, so a benchmark can time both on one machine. Same results.
inline bool gemv_ring64_disabled() { return env_equals("KVKERNELS_GEMV_RING64", "0"); }

// ---------------------------------------------------------------------------------------------------------
// gemv_inner_q:  y[b, h, t, m] = sum_l x[b, h, t, l] * x_scale[h_kv, l] * deq(codes[b, h_kv, m, l])
// with groups of G along l; h_kv = h / (H_q / H_kv).
struct GemvInnerQParams {
  // ---- pointers ----
  const void* x;             // [B, H_q, T, L] activations of dtype x_dtype
  const uint32_t* codes;     // [B, H_kv, M, L * bits / 32] packed codes
  const uint16_t* scales;    // [B, H_kv, M, L / G] fp16 scale bits (hybrid: sign bit = asym group)
  const uint16_t* zeros;     // [B, H_kv, M, L / G] fp16 zero bits; nullptr allowed for sym only
  const float* x_scale;      // [H_kv, L] per-channel multiplier of x, or nullptr (= all ones)
  float* y;                  // [B, H_q, T, M] fp32 output
  float* workspace;          // split-K partial sums, >= gemv_inner_q_workspace_floats(*this) floats (or nullptr if 0)
  int64_t workspace_floats;  // size of `workspace`, checked by the launcher
  // ---- sizes ----
  int64_t B, H_q, H_kv;  // batch, query heads, KV heads (H_q % H_kv == 0)
  int64_t T;             // query rows per head (1 for a 3-D x)
  int64_t M;             // output rows per head (tokens for keys, head_dim for values)
  int64_t L;             // reduction length (head_dim for keys, tokens for values), multiple of group_size
  int bits;              // 1..4
  int group_size;        // G, positive multiple of 32 dividing L
  QuantMode mode;        // sym / asym / hybrid
  XDtype x_dtype;        // dtype of x
  int num_sms;           // multiprocessor count of the device, drives the split-K / row-tiling plan
  // ---- strides (elements) ----
  int64_t x_sb, x_sh, x_st;  // x: batch, head, query-row
  int64_t c_sb, c_sh, c_sm;  // codes (uint32 words): batch, KV head, row
  int64_t s_sb, s_sh, s_sm;  // scales: batch, KV head, row
  int64_t z_sb, z_sh, z_sm;  // zeros: batch, KV head, row (ignored when zeros == nullptr)
  int64_t xs_sh;             // x_scale: KV head (row) stride
  int64_t y_sb, y_sh, y_st;  // y: batch, head, query-row
};

// fp32 workspace the launcher needs (0 when no split-K is planned). Deterministic in the params.
int64_t gemv_inner_q_workspace_floats(const GemvInnerQParams& p);
// Whether launch_gemv_inner_q will read codes with 16-byte loads (to registers, or through its cp.async ring) for
// these params, and whether through the ring (16-byte aligned code rows, G = 32, 8-byte aligned scale / zero rows).
bool gemv_inner_q_vector_loads(const GemvInnerQParams& p);
bool gemv_inner_q_ring(const GemvInnerQParams& p);
// ... and whether its ring items are two tiles (keys at head_dim 64 below 4 bits, KVKERNELS_GEMV_RING64 not 0).
bool gemv_inner_q_ring_pairs(const GemvInnerQParams& p);
cudaError_t launch_gemv_inner_q(const GemvInnerQParams& p, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------------------
// gemv_kivi:  y[b, h, t, c] = sum_r x[b, h, t, r] * (s[b, h_kv, r, c / G] * u[b, h_kv, r, c] + z[b, h_kv, r, c / G])
struct GemvKiviParams {
  // ---- pointers ----
  const void* x;             // [B, H_q, T, R] activations of dtype x_dtype
  const uint32_t* codes;     // [B, H_kv, R, C * bits / 32] packed codes, groups along C
  const uint16_t* scales;    // [B, H_kv, R, C / G] fp16 scale bits (asym)
  const uint16_t* zeros;     // [B, H_kv, R, C / G] fp16 zero bits
  float* y;                  // [B, H_q, T, C] fp32 output
  float* workspace;          // split-K partial sums, >= gemv_kivi_workspace_floats(*this) floats (or nullptr if 0)
  int64_t workspace_floats;  // size of `workspace`, checked by the launcher
  // ---- sizes ----
  int64_t B, H_q, H_kv;  // batch, query heads, KV heads (H_q % H_kv == 0)
  int64_t T;             // query rows per head (1 for a 3-D x)
  int64_t R;             // reduction length = rows of codes (tokens for values, head_dim for keys)
  int64_t C;             // output length = packed columns (head_dim for values, tokens for keys)
  int bits;              // 1..4
  int group_size;        // G along C, positive multiple of 32 dividing C
  XDtype x_dtype;        // dtype of x
  int num_sms;           // multiprocessor count of the device
  // ---- strides (elements) ----
  int64_t x_sb, x_sh, x_st;  // x: batch, head, query-row
  int64_t c_sb, c_sh, c_sr;  // codes (uint32 words): batch, KV head, row
  int64_t s_sb, s_sh, s_sr;  // scales: batch, KV head, row
  int64_t z_sb, z_sh, z_sr;  // zeros: batch, KV head, row
  int64_t y_sb, y_sh, y_st;  // y: batch, head, query-row
};

int64_t gemv_kivi_workspace_floats(const GemvKiviParams& p);
// Whether launch_gemv_kivi reads codes through its cp.async ring (16 columns per lane, G = 32, 16-byte aligned code
// rows, 8-byte aligned scale / zero rows, KVKERNELS_GEMV_RING not 0).
bool gemv_kivi_ring(const GemvKiviParams& p);
cudaError_t launch_gemv_kivi(const GemvKiviParams& p, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------------------
// Lattice (HIGGS-style) GEMVs, docs/FORMATS.md "Lattice"; y = s * H_n(r16 * grid[c]) per group of G channels:
//   gemv_lattice_k:  y[b, h, t, n] = sum_g r16[n, g] * <H_n (s * x_g), grid[c_{n, g}]>          (x = q, keys)
//   gemv_lattice_v:  y[b, h, t, :] = per group g: s * H_n (sum_n x[n] r16[n, g] grid[c_{n, g}])  (x = p, values)
// with h_kv = h / (H_q / H_kv). One struct serves both (x is the query for keys and the probabilities for values).
struct GemvLatticeParams {
  // ---- pointers ----
  const void* x;             // keys: q [B, H_q, T, D]; values: p [B, H_q, T, N]; of dtype x_dtype
  const uint32_t* codes;     // [B, H_kv, N, D * bits / 32] packed grid indices (docs/FORMATS.md, "Packing")
  const uint16_t* norms;     // [B, H_kv, N, D / G] fp16 bits of the group RMS r16
  const float* grid;         // [n, d] fp32, contiguous
  const int8_t* signs;       // [G] +-1, or nullptr (no signs)
  float* y;                  // keys: [B, H_q, T, N]; values: [B, H_q, T, D]; fp32
  float* workspace;          // split-K partial sums, >= gemv_lattice_*_workspace_floats(*this) floats (or nullptr)
  int64_t workspace_floats;  // size of `workspace`, checked by the launcher
  // ---- sizes ----
  int64_t B, H_q, H_kv;  // batch, query heads, KV heads (H_q % H_kv == 0)
  int64_t T;             // query rows per head (1 for a 3-D x)
  int64_t N;             // tokens
  int D;                 // head_dim: 64, 128 or 256
  int group_size;        // G: power of two in [32, D]
  LatticeGrid grid_kind; // which (d, n) grid `grid` is
  XDtype x_dtype;        // dtype of x
  int num_sms;           // multiprocessor count of the device (planning)
  // ---- strides (elements) ----
  int64_t x_sb, x_sh, x_st;  // x: batch, head, query-row
  int64_t c_sb, c_sh, c_sn;  // codes (uint32 words): batch, KV head, token
  int64_t r_sb, r_sh, r_sn;  // norms: batch, KV head, token
  int64_t y_sb, y_sh, y_st;  // y: batch, head, query-row
};

int64_t gemv_lattice_k_workspace_floats(const GemvLatticeParams& p);  // always 0 (no split-K for keys)
// Whether launch_gemv_lattice_k reads whole tiles through its cp.async ring (head_dim <= 128; code rows aligned to the
// ring's 16- or 8-byte pieces, norm rows to 4 bytes, dense norms at one group per row; KVKERNELS_GEMV_RING not 0).
bool gemv_lattice_k_ring(const GemvLatticeParams& p);
cudaError_t launch_gemv_lattice_k(const GemvLatticeParams& p, cudaStream_t stream);
int64_t gemv_lattice_v_workspace_floats(const GemvLatticeParams& p);
cudaError_t launch_gemv_lattice_v(const GemvLatticeParams& p, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------------------
// aqua_reconstruct (AQUA-KV, docs/FORMATS.md "AQUA-KV"; kvkernels/reference/aqua.py), a GEMM with a lattice epilogue:
//   out[t, c] = ((sum_i prev[t, i] W[c, i] + sum_j prev2[t, j] W2[c, j]) + bias[c]) + deq(codes, norms)[t, c]
// deq = lattice_dequantize: per group of G channels, s * H_n (r16 * grid[c]). fp16 / bf16 operands run on tensor
// cores, fp32 operands on a SIMT path (the test path). csrc/cuda/aqua_reconstruct.cu has the design.
struct AquaReconstructParams {
  // ---- pointers ----
  const void* prev;       // [T, C_in] of dtype x_dtype
  const void* weight;     // [C, C_in] of dtype x_dtype
  const void* prev2;      // [T, C_in2] of dtype x_dtype, or nullptr (the value predictor's second input)
  const void* weight2;    // [C, C_in2] of dtype x_dtype; nullptr exactly when prev2 is
  const float* bias;      // [C], contiguous
  const uint32_t* codes;  // [T, C * bits / 32] packed grid indices (docs/FORMATS.md, "Packing")
  const uint16_t* norms;  // [T, C / G] fp16 bits of the group RMS r16
  const float* grid;      // [n, d] fp32, contiguous
  const int8_t* signs;    // [G] +-1, or nullptr (no signs)
  float* out;             // [T, C] fp32, 8-byte aligned, even row stride
  // ---- sizes ----
  int64_t T, C;          // tokens, output channels (C a multiple of group_size)
  int64_t C_in, C_in2;   // input channels of prev / prev2 (C_in2 ignored without prev2); 0 allowed
  int group_size;        // G: 32, 64 or 128 (the CUDA kernel's; the format allows up to 1024)
  LatticeGrid grid_kind; // which (d, n) grid `grid` is
  XDtype x_dtype;        // dtype of prev / weight / prev2 / weight2
  int num_sms;           // multiprocessor count of the device (tile-height choice)
  // ---- row strides (elements) ----
  int64_t s_prev, s_w, s_prev2, s_w2, s_codes, s_norms, s_out;
};

// Whether a [rows, cols] GEMM operand of elem_bytes-byte values can be read by the fp16 / bf16 path, which copies
// rows with 16-byte cp.async: the start and (with more than one row) the row stride 16-byte aligned. cols need not
// be a multiple of 8 (the last chunk of a row is partial). The binding copies an operand that is not.
inline bool aqua_operand_aligned(const void* ptr, int64_t rows, int64_t cols, int64_t stride, int elem_bytes) {
  if (rows == 0 || cols == 0) return true;
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && (rows == 1 || (stride * elem_bytes) % 16 == 0);
}

cudaError_t launch_aqua_reconstruct(const AquaReconstructParams& p, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------------------
// decode_attention_fused (kvkernels/reference/attention.py is the spec): one layer's decode attention
//   out[b, h, t, :] = softmax_j(x[b, h, t, :] . K[b, h_kv, j, :] + mask[b, h, t, j]) V[b, h_kv, j, :]
// with h_kv = h / (H_q / H_kv). Keys and values are each, in token order, a window sink [S tokens] | a quantized store
// [m tokens] | a window tail [N - S - m tokens]; the key and value stores may hold different token counts.
// Split-KV (FlashDecoding): csrc/cuda/decode_attention.cu has the design.

// Window-dtype rows [B, H_kv, n, D] (sink or tail) of dtype DecodeAttentionParams::window_dtype.
struct AttnWindow {
  const void* p;          // (nullptr allowed when n == 0)
  int64_t n;              // tokens
  int64_t sb, sh, st;     // batch, KV head, token strides (elements)
};

enum class StoreLayout : int { kRows = 0, kCols = 1 };

// A quantized store: "rows" = codes [B, H_kv, m, D*bits/32] + scales/zeros [B, H_kv, m, D/G] (token-major, groups
// of G channels); "cols" = codes [B, H_kv, D, m*bits/32] + scales/zeros [B, H_kv, D, m/G] (groups of G tokens).
struct AttnStore {
  const uint32_t* codes;   // packed words
  const uint16_t* scales;  // fp16 bits (hybrid: sign bit = asym group)
  const uint16_t* zeros;   // fp16 bits; nullptr allowed for sym only
  int64_t m;               // tokens (cols: a multiple of group_size)
  int bits;                // 1..4
  QuantMode mode;          // sym / asym / hybrid
  StoreLayout layout;
  int64_t c_sb, c_sh, c_sr;  // codes: batch, KV head, row (token for rows, channel for cols) strides (words)
  int64_t s_sb, s_sh, s_sr;  // scales
  int64_t z_sb, z_sh, z_sr;  // zeros (ignored when zeros == nullptr)
};

struct DecodeAttentionParams {
  const void* x;              // [B, H_q, T, D] in x_dtype: the queries; the kernels read x * q_scale in fp32
  XDtype x_dtype;
  float q_scale;              // the softmax scale (x is q_scale-times the queries the scores take)
  AttnWindow sink_k, sink_v;  // [B, H_kv, S, D] (same S)
  AttnWindow tail_k, tail_v;  // [B, H_kv, N - S - m, D]
  AttnStore keys, values;     // the quantized stores (keys.m != values.m allowed)
  XDtype window_dtype;        // dtype of the four windows
  const float* key_x_scale;   // [H_kv, D]: stored keys are K / key_x_scale (the store's keys are deq * it); or nullptr
  const float* mask;          // additive fp32 [B|1, H_q|1, T, N], or nullptr = causal among the last T tokens
  void* out;                  // [B, H_q, T, D] in out_dtype: the fp32 result rounded once (to nearest)
  XDtype out_dtype;
  float* workspace;           // split partials, >= decode_attention_workspace_floats(*this) floats (nullptr if 0)
  int64_t workspace_floats;   // size of `workspace`, checked by the launcher
  int64_t B, H_q, H_kv, T, N;  // N = S + keys.m + tail_k.n = S + values.m + tail_v.n (lengths: below)
  int D;                      // head_dim: 64 or 128
  int group_size;             // G, a positive multiple of 32 (rows layout: dividing D)
  int64_t split_tokens;       // tokens per split-KV chunk (multiple of G), 0 = planned; never changes the math
  int num_sms;                // multiprocessor count of the device (split planning)
  int64_t x_sb, x_sh, x_st;   // x strides
  int64_t xs_sh;              // key_x_scale row stride
  int64_t m_sb, m_sh, m_st;   // mask strides (0 for a broadcast batch / head dim)
  int64_t o_sb, o_sh, o_st;   // out strides
  // Device-side lengths (static caches, CUDA graphs): int64 [5] in device memory, the tokens used of (sink, key
  // store, key tail, value store, value tail), or nullptr. When set, sink_k.n / keys.m / tail_k.n / values.m /
  // tail_v.n above are the buffers' capacities, N = S_cap + min(mk_cap + lk_cap, mv_cap + lv_cap), and the launch
  // (grid, splits, workspace) depends on those alone; each CTA reads the counts, clamps each into [0, capacity] (a
  // "cols" store's down to a multiple of G) and takes N = S + min(mk + lk, mv + lv) (the reference's rule).
  const int64_t* lengths;
};

// fp32 workspace the launcher needs (0 with a single split). Deterministic in the params.
int64_t decode_attention_workspace_floats(const DecodeAttentionParams& p);
// Splits the launcher will run (tests and diagnostics); 0 for invalid params.
int64_t decode_attention_num_splits(const DecodeAttentionParams& p);
cudaError_t launch_decode_attention_fused(const DecodeAttentionParams& p, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------------------
// Storage ops. Their tensors are "rows" of a last dim, with up to kMaxRowDims leading dims of any stride
// (the binding coalesces adjacent dims first and falls back to a contiguous copy beyond that).
constexpr int kMaxRowDims = 4;

// Element offset of row r (row-major over the leading dims) = sum_d index_d(r) * stride[d].
struct RowLayout {
  int ndim;                      // number of leading dims used (0 = a single row)
  int64_t size[kMaxRowDims];     // leading sizes, outermost first
  int64_t stride[kMaxRowDims];   // leading strides in elements
};

// quantize_groups_into: every group of G values along the last dim -> codes / scale / zero (quant.cuh).
struct QuantizeParams {
  const void* x;       // [rows..., L] input of dtype x_dtype (last-dim stride 1)
  uint32_t* codes;     // [rows..., L * bits / 32] output words
  uint16_t* scales;    // [rows..., L / G] output fp16 bits
  uint16_t* zeros;     // [rows..., L / G] output fp16 bits (0 for sym groups)
  RowLayout x_rows, c_rows, s_rows, z_rows;  // leading dims of each tensor (same sizes, own strides)
  int64_t rows;        // product of the leading sizes
  int64_t L;           // values per row
  int bits;            // 1..4
  int group_size;      // G
  QuantMode mode;      // sym / asym / hybrid
  AsymCalib calib;     // asym calibration: fp32(1 - 2 eta), fp32(eta) (kNoCalib = plain min/max)
  XDtype x_dtype;      // dtype of x
};
cudaError_t launch_quantize_groups_into(const QuantizeParams& p, cudaStream_t stream);

// dequantize_groups: out[r, l] = s * u + zeff for every value; out is contiguous fp32 [rows, L].
struct DequantizeParams {
  const uint32_t* codes;   // [rows..., L * bits / 32]
  const uint16_t* scales;  // [rows..., L / G]
  const uint16_t* zeros;   // [rows..., L / G] or nullptr (sym only)
  float* out;              // [rows, L] contiguous
  RowLayout c_rows, s_rows, z_rows;
  int64_t rows, L;
  int bits, group_size;
  QuantMode mode;
};
cudaError_t launch_dequantize_groups(const DequantizeParams& p, cudaStream_t stream);

// pack_bits / unpack_bits on contiguous buffers of whole 32-value blocks.
struct PackParams {
  const int32_t* codes;  // [nblocks * 32] codes (only the low `bits` bits are used)
  uint32_t* packed;      // [nblocks * bits] words
  int64_t nblocks;
  int bits;
};
cudaError_t launch_pack_bits(const PackParams& p, cudaStream_t stream);

struct UnpackParams {
  const uint32_t* packed;  // [nblocks * bits] words
  uint8_t* codes;          // [nblocks * 32] codes
  int64_t nblocks;
  int bits;
};
cudaError_t launch_unpack_bits(const UnpackParams& p, cudaStream_t stream);

// static_append: one decode step's append into a static cache (capacity-shaped buffers, token counts on the device),
// the effect of QuantizedLayerCache.append on the used parts (kvkernels/reference/static_append.py is the spec).
// lengths = (S, key store, key tail, value store, value tail) tokens, read by every CTA and committed by a second,
// one-thread kernel after the first ends, so nothing is read on the host and the pair can be captured in a graph.
struct AppendSide {        // keys or values
  const void* x;           // the new tokens [B, H, n, D] (window dtype)
  int64_t x_sb, x_sh, x_st;
  void* sink;              // [B, H, W, D]
  int64_t sk_sb, sk_sh, sk_st;
  void* tail;              // [B, H, tail_cap, D]
  int64_t t_sb, t_sh, t_st, tail_cap;
  uint32_t* codes;         // the quantized store (layout rows or cols, as AttnStore), `cap` tokens
  uint16_t* scales;
  uint16_t* zeros;         // nullptr for sym
  int64_t c_sb, c_sh, c_sr, s_sb, s_sh, s_sr, z_sb, z_sh, z_sr;
  int64_t cap;
  int bits;
  QuantMode mode;
  StoreLayout layout;
  AsymCalib calib;
  const float* x_scale;    // keys: stored as x / x_scale[h, d] (fp32 [H, D], row stride xs_sh); nullptr: as they are
  int64_t xs_sh;
};
struct StaticAppendParams {
  AppendSide side[2];      // keys, values
  int64_t* lengths;        // int64 [5] on the device
  int64_t B, H, n, W, D;   // batch, KV heads, new tokens, sink capacity, head_dim
  int64_t w_recent;
  int group_size;
  int elem_bytes;          // 2 (fp16 / bf16) or 4 (fp32): the windows' element size
  XDtype dtype;
};
cudaError_t launch_static_append(const StaticAppendParams& p, cudaStream_t stream);

// Deterministic split-K combine shared by both GEMVs: y[b, h, t, n] = sum_{s < splits} ws[s, b, h, t, n]
// (fixed order), ws contiguous [splits, B, H, T, N], y with strides (y_sb, y_sh, y_st, 1).
cudaError_t launch_combine_splits(const float* ws, int splits, int64_t B, int64_t H, int64_t T, int64_t N, float* y,
                                  int64_t y_sb, int64_t y_sh, int64_t y_st, cudaStream_t stream);

}  // namespace kvk
