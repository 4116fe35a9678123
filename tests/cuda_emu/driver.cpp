// Runs the real CUDA launchers (csrc/cuda/*.cu, compiled for the host through emu.h) on random data and checks
// every output against a double-precision dequantize-then-matmul reference written out here, independently of
// the kernels. Modes: `iq` (gemv_inner_q), `kivi` (gemv_kivi), `q` (quantize_groups_into), `lattice`
// (gemv_lattice_k / gemv_lattice_v against the double-precision spec formula), `aqua` (aqua_reconstruct), `attn`
// (decode_attention_fused against a double-precision softmax(x K^T + mask) V), `all`
// (every one, the CI set), `tests [num_sms]` (the shapes of tests/test_cuda_kernels.py at a given SM count;
// minutes, manual).
// Prints one line per case and a summary `cases N fails F shuffles_after_exit S bad_mask K bad_async_copies A
// prefetches P` (L2 prefetches, each address checked by AddressSanitizer: emu.h); exits 1 on a failure or a cp.async
// the GPU would refuse (emu.h).
#include "emu.h"
#include "cuda/kernels.h"
#include "cuda/decode_attention.h"
#include "kvkernels/packing.cuh"
#include "kvkernels/mma.cuh"
#include "kvkernels/lattice.cuh"
#include <random>
#include <cassert>
#include <cstring>
#include <limits>
using namespace kvk;
extern "C" cudaError_t cudaGetLastError(void) { cudaError_t e = kvk_emu::last_err; kvk_emu::last_err = cudaSuccess; return e; }
// Resident CTAs per SM for the launchers' wave planning: a fixed answer (KVK_EMU_OCC, default 2), so the cases'
// num_sms argument alone decides how many splits a plan makes.
extern "C" cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* n, const void*, int, size_t) {
  const char* v = getenv("KVK_EMU_OCC");
  *n = v ? atoi(v) : 2;
  return cudaSuccess;
}
// One device (kernels.h's resident_ctas_per_sm keys its cache by device).
extern "C" cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}

static std::mt19937_64 rng(1234);
static float frand() { return std::uniform_real_distribution<float>(-1.f, 1.f)(rng); }
static uint16_t hbits(float f) { return float_to_half_bits(f); }

template <class T> struct Buf {  // exactly sized heap buffer (ASan catches overruns)
  T* p = nullptr; size_t n = 0;
  explicit Buf(size_t n_) : n(n_) { p = static_cast<T*>(std::aligned_alloc(16, std::max<size_t>(16, (n * sizeof(T) + 15) / 16 * 16))); }
  ~Buf() { std::free(p); }
};

struct Res { long cases = 0, fails = 0; };
static Res res;

// x dtype conversion
static void store_x(void* base, XDtype dt, int64_t i, float v, float& exact) {
  if (dt == XDtype::kF16) { __half h = __float2half_rn(v); static_cast<__half*>(base)[i] = h; exact = __half2float(h); }
  else if (dt == XDtype::kBF16) { __nv_bfloat16 h = __float2bfloat16_rn(v); static_cast<__nv_bfloat16*>(base)[i] = h; exact = __bfloat162float(h); }
  else { static_cast<float*>(base)[i] = v; exact = v; }
}
static size_t xsize(XDtype dt) { return dt == XDtype::kF32 ? 4 : 2; }

// Scale / zero rows of the inner_q cases: -1 (default) padded by 3 and starting 1 / 2 halves into their buffers (no
// 8-byte aligned row: the register-load paths); else rounded up to 4 halves plus this many, starting at the buffers'
// (16-byte aligned) starts: 8-byte aligned rows at a multiple of 4, the cp.async ring's requirement with 16-byte
// aligned code rows and G = 32.
static int g_meta_pad = -1;
// 1-bit hybrid cases: rows m % 5 == 2 hold weights that are all 0 (every group sym, levels {-s, 0}, every code 1,
// s in [4, 6]), so s u + zeff cancels exactly: the kernel's two terms leave a residue that a bound on |deq| alone
// (0) refuses, as test_inner_q_shapes' did for 1-bit hybrid keys on the first GPU run
static bool g_zero_weight_rows = false;

void inner_q_case(int64_t B, int64_t H_q, int64_t H_kv, int64_t T, bool has_t, int64_t M, int64_t L, int bits, int G,
                  QuantMode mode, XDtype dt, bool xscale, int cpad, int coff, int xpad, int num_sms, bool null_zeros,
                  int expect_vec = -1, int expect_ring = -1, int expect_pairs = -1) {
  const int64_t W = L * bits / 32, NG = L / G;
  // codes [B,H_kv,M, W+cpad] starting at coff; scales/zeros [B,H_kv,M,NG+pad] at 1 / 2 (or 0 / 0, g_meta_pad)
  const int64_t c_sm = W + cpad, c_sh = M * c_sm, c_sb = H_kv * c_sh;
  Buf<uint32_t> codes(B * c_sb + coff);
  for (size_t i = 0; i < codes.n; ++i) codes.p[i] = static_cast<uint32_t>(rng());
  const bool legacy_meta = g_meta_pad < 0;
  const int64_t s_sm = legacy_meta ? NG + 3 : (NG + 3) / 4 * 4 + g_meta_pad, s_sh = M * s_sm, s_sb = H_kv * s_sh;
  const int s_off = legacy_meta ? 1 : 0, z_off = legacy_meta ? 2 : 0;
  Buf<uint16_t> sc(B * s_sb + s_off), ze(B * s_sb + z_off);
  for (size_t i = 0; i < sc.n; ++i) {
    float s = std::fabs(frand()) * 0.1f;
    uint16_t b = hbits(s);
    if (mode == QuantMode::kHybrid && (rng() & 1)) b |= 0x8000;
    if (rng() % 17 == 0) b = (mode == QuantMode::kHybrid) ? 0x8000 : 0;  // -0.0 / 0
    sc.p[i] = b;
  }
  for (size_t i = 0; i < ze.n; ++i) ze.p[i] = hbits(frand());
  if (g_zero_weight_rows) {
    if (bits != 1 || mode != QuantMode::kHybrid) { printf("zero-weight rows need 1-bit hybrid\n"); std::abort(); }
    for (int64_t r = 0; r < B * H_kv * M; ++r) {
      if (r % M % 5 != 2) continue;
      for (int64_t w = 0; w < W; ++w) codes.p[coff + r * c_sm + w] = 0xffffffffu;
      for (int64_t g = 0; g < NG; ++g) sc.p[s_off + r * s_sm + g] = hbits(4.f + 2.f * std::fabs(frand()));
    }
  }
  const int64_t x_st = L + xpad, x_sh = T * x_st + 5, x_sb = H_q * x_sh + 3;
  std::vector<char> xbuf_v((B * x_sb + 7) * xsize(dt) + 64);
  void* xb = xbuf_v.data();
  std::vector<float> xe(B * x_sb + 7, 0.f);
  for (int64_t i = 0; i < B * x_sb + 7; ++i) store_x(xb, dt, i, frand(), xe[i]);
  const int64_t xs_sh = L + 4;
  Buf<float> xsc(H_kv * xs_sh);
  for (size_t i = 0; i < xsc.n; ++i) xsc.p[i] = 0.5f + std::fabs(frand());
  Buf<float> y(B * H_q * T * M);
  for (size_t i = 0; i < y.n; ++i) y.p[i] = NAN;

  GemvInnerQParams p{};
  p.x = xb; p.codes = codes.p + coff; p.scales = sc.p + s_off; p.zeros = null_zeros ? nullptr : ze.p + z_off;
  p.x_scale = xscale ? xsc.p : nullptr; p.y = y.p;
  p.B = B; p.H_q = H_q; p.H_kv = H_kv; p.T = T; p.M = M; p.L = L; p.bits = bits; p.group_size = G; p.mode = mode;
  p.x_dtype = dt; p.num_sms = num_sms;
  p.x_sb = x_sb; p.x_sh = x_sh; p.x_st = has_t ? x_st : 0;
  p.c_sb = c_sb; p.c_sh = c_sh; p.c_sm = c_sm;
  p.s_sb = s_sb; p.s_sh = s_sh; p.s_sm = s_sm;
  p.z_sb = s_sb; p.z_sh = s_sh; p.z_sm = s_sm;
  p.xs_sh = xs_sh;
  p.y_sb = H_q * T * M; p.y_sh = T * M; p.y_st = has_t ? M : 0;
  const bool vec = gemv_inner_q_vector_loads(p);
  if (expect_vec >= 0 && vec != (expect_vec != 0)) {
    printf("inner_q: vector loads %d, expected %d\n", (int)vec, expect_vec);
    res.cases++; res.fails++; return;
  }
  const bool ring = gemv_inner_q_ring(p);
  if (expect_ring >= 0 && ring != (expect_ring != 0)) {
    printf("inner_q: cp.async ring %d, expected %d\n", (int)ring, expect_ring);
    res.cases++; res.fails++; return;
  }
  const bool pairs = gemv_inner_q_ring_pairs(p);
  if (expect_pairs >= 0 && pairs != (expect_pairs != 0)) {
    printf("inner_q: two-tile ring items %d, expected %d\n", (int)pairs, expect_pairs);
    res.cases++; res.fails++; return;
  }
  int64_t wsf = gemv_inner_q_workspace_floats(p);
  std::unique_ptr<Buf<float>> ws;
  if (wsf > 0) { ws = std::make_unique<Buf<float>>(wsf); p.workspace = ws->p; p.workspace_floats = wsf; }
  cudaError_t e = launch_gemv_inner_q(p, nullptr);
  res.cases++;
  if (e != cudaSuccess) { printf("inner_q launch error %d: %s\n", (int)e, last_launch_error()); res.fails++; return; }
  // reference
  const int64_t gq = H_q / H_kv;
  double maxex = 0; int64_t bad = 0;
  for (int64_t b = 0; b < B; ++b) for (int64_t h = 0; h < H_q; ++h) for (int64_t t = 0; t < T; ++t) for (int64_t m = 0; m < M; ++m) {
    const int64_t hk = h / gq;
    double acc = 0, mag = 0;
    for (int64_t l = 0; l < L; ++l) {
      const uint32_t* blk = p.codes + b * c_sb + hk * c_sh + m * c_sm + (l / 32) * bits;
      uint32_t u = unpack_one_rt(blk, l % 32, bits);
      int64_t g = l / G;
      uint16_t sb = p.scales[b * s_sb + hk * s_sh + m * s_sm + g];
      uint16_t zb = (mode == QuantMode::kSym) ? 0 : p.zeros[b * s_sb + hk * s_sh + m * s_sm + g];
      GroupAffine a = group_affine_rt(mode, bits, sb, zb);
      double w = (double)a.s * u + a.zeff;
      double xv = xe[b * x_sb + h * x_sh + (has_t ? t * x_st : 0) + l];
      if (xscale) xv *= xsc.p[hk * xs_sh + l];
      // the magnitude of the terms the kernel adds: s u' and, outside sym mode, zeff (docs/FORMATS.md, "GEMV
      // arithmetic"); in sym mode u' = u - 2^(b-1) and there is no zero term
      acc += xv * w;
      mag += std::fabs(xv) * (mode == QuantMode::kSym ? std::fabs(w) : std::fabs((double)a.s * u) + std::fabs(a.zeff));
    }
    double got = y.p[b * p.y_sb + h * p.y_sh + t * M + m];
    double ex = std::fabs(got - acc) - (1e-5 * mag + 1e-6);
    if (!(ex <= 0)) { if (bad < 3) printf("  mismatch b%ld h%ld t%ld m%ld got %g want %g\n", b, h, t, m, got, acc); bad++; }
    maxex = std::max(maxex, ex);
  }
  if (bad) res.fails++;
  printf("inner_q B%ld Hq%ld Hkv%ld T%ld%s M%ld L%ld b%d G%d mode%d dt%d xs%d cpad%d coff%d sms%d %s: %s (bad %ld)\n", B, H_q, H_kv, T,
         has_t ? "" : "(3d)", M, L, bits, G, (int)mode, (int)dt, xscale, cpad, coff, num_sms,
         ring ? "ring" : vec ? "vec" : "words", bad ? "FAIL" : "ok", bad);
}

// Scale / zero rows as g_meta_pad says (inner_q_case); with 8-byte aligned rows, 16-byte aligned code rows (cpad),
// G = 32 and C >= 128 the planner takes the cp.async ring (expect_ring: 1 must, 0 must not, -1 either).
void kivi_case(int64_t B, int64_t H_q, int64_t H_kv, int64_t T, bool has_t, int64_t R, int64_t C, int bits, int G,
               XDtype dt, int cpad, int coff, int num_sms, int expect_ring = -1) {
  const int64_t W = C * bits / 32, NG = C / G;
  const int64_t c_sr = W + cpad, c_sh = R * c_sr, c_sb = H_kv * c_sh;
  Buf<uint32_t> codes(B * c_sb + coff);  // no slack after the last row: a read past column C there is caught
  for (size_t i = 0; i < codes.n; ++i) codes.p[i] = static_cast<uint32_t>(rng());
  const bool legacy_meta = g_meta_pad < 0;
  const int64_t s_sr = legacy_meta ? NG + 3 : (NG + 3) / 4 * 4 + g_meta_pad, s_sh = R * s_sr, s_sb = H_kv * s_sh;
  const int s_off = legacy_meta ? 1 : 0, z_off = legacy_meta ? 2 : 0;
  Buf<uint16_t> sc(B * s_sb + s_off), ze(B * s_sb + z_off);
  for (size_t i = 0; i < sc.n; ++i) sc.p[i] = hbits(std::fabs(frand()) * 0.1f);
  for (size_t i = 0; i < ze.n; ++i) ze.p[i] = hbits(frand());
  const int64_t x_st = R + 2, x_sh = T * x_st + 5, x_sb = H_q * x_sh + 3;
  std::vector<char> xbuf_v((B * x_sb + 7) * xsize(dt) + 64);
  void* xb = xbuf_v.data();
  std::vector<float> xe(B * x_sb + 7, 0.f);
  for (int64_t i = 0; i < B * x_sb + 7; ++i) store_x(xb, dt, i, frand(), xe[i]);
  Buf<float> y(B * H_q * T * C);
  for (size_t i = 0; i < y.n; ++i) y.p[i] = NAN;
  GemvKiviParams p{};
  p.x = xb; p.codes = codes.p + coff; p.scales = sc.p + s_off; p.zeros = ze.p + z_off; p.y = y.p;
  p.B = B; p.H_q = H_q; p.H_kv = H_kv; p.T = T; p.R = R; p.C = C; p.bits = bits; p.group_size = G; p.x_dtype = dt;
  p.num_sms = num_sms;
  p.x_sb = x_sb; p.x_sh = x_sh; p.x_st = has_t ? x_st : 0;
  p.c_sb = c_sb; p.c_sh = c_sh; p.c_sr = c_sr;
  p.s_sb = s_sb; p.s_sh = s_sh; p.s_sr = s_sr;
  p.z_sb = s_sb; p.z_sh = s_sh; p.z_sr = s_sr;
  p.y_sb = H_q * T * C; p.y_sh = T * C; p.y_st = has_t ? C : 0;
  const bool ring = gemv_kivi_ring(p);
  if (expect_ring >= 0 && ring != (expect_ring != 0)) {
    printf("kivi: cp.async ring %d, expected %d\n", (int)ring, expect_ring);
    res.cases++; res.fails++; return;
  }
  int64_t wsf = gemv_kivi_workspace_floats(p);
  std::unique_ptr<Buf<float>> ws;
  if (wsf > 0) { ws = std::make_unique<Buf<float>>(wsf); p.workspace = ws->p; p.workspace_floats = wsf; }
  cudaError_t e = launch_gemv_kivi(p, nullptr);
  res.cases++;
  if (e != cudaSuccess) { printf("kivi launch error %d: %s\n", (int)e, last_launch_error()); res.fails++; return; }
  const int64_t gq = H_q / H_kv;
  int64_t bad = 0;
  for (int64_t b = 0; b < B; ++b) for (int64_t h = 0; h < H_q; ++h) for (int64_t t = 0; t < T; ++t) for (int64_t c = 0; c < C; ++c) {
    const int64_t hk = h / gq;
    double acc = 0, mag = 0;
    for (int64_t r = 0; r < R; ++r) {
      const uint32_t* blk = p.codes + b * c_sb + hk * c_sh + r * c_sr + (c / 32) * bits;
      uint32_t u = unpack_one_rt(blk, c % 32, bits);
      int64_t g = c / G;
      GroupAffine a = group_affine_rt(QuantMode::kAsym, bits, p.scales[b * s_sb + hk * s_sh + r * s_sr + g],
                                      p.zeros[b * s_sb + hk * s_sh + r * s_sr + g]);
      // the contract (docs/FORMATS.md, GEMV arithmetic): s * u + z is rounded once to fp16 before the products
      double w = half_bits_to_float(double_to_half_bits((double)a.s * u + a.zeff));
      double xv = xe[b * x_sb + h * x_sh + (has_t ? t * x_st : 0) + r];
      acc += xv * w; mag += std::fabs(xv * w);
    }
    double got = y.p[b * p.y_sb + h * p.y_sh + t * C + c];
    double ex = std::fabs(got - acc) - (1e-5 * mag + 1e-6);
    if (!(ex <= 0)) { if (bad < 3) printf("  mismatch b%ld h%ld t%ld c%ld got %g want %g\n", b, h, t, c, got, acc); bad++; }
  }
  if (bad) res.fails++;
  printf("kivi B%ld Hq%ld Hkv%ld T%ld%s R%ld C%ld b%d G%d dt%d cpad%d coff%d sms%d %s: %s (bad %ld)\n", B, H_q, H_kv, T,
         has_t ? "" : "(3d)", R, C, bits, G, (int)dt, cpad, coff, num_sms, ring ? "ring" : "regs", bad ? "FAIL" : "ok",
         bad);
}

void quant_case(int64_t d0, int64_t d1, int64_t d2, int64_t L, int bits, int G, QuantMode mode, float eta, XDtype dt) {
  // x contiguous [d0,d1,d2,L]; outputs narrowed views of [d0, d1, d2+3, W+2] at row offset 1 (dims 0,1 mergeable)
  const int64_t W = L * bits / 32, NG = L / G, rows = d0 * d1 * d2;
  std::vector<char> xb_v(rows * L * xsize(dt) + 16);
  std::vector<float> xe(rows * L);
  for (int64_t i = 0; i < rows * L; ++i) store_x(xb_v.data(), dt, i, frand() * 3 + ((i % L) < G / 2 ? 2.f : 0.f), xe[i]);
  const int64_t cS = W + 2, sS = NG + 1;
  Buf<uint32_t> cb(d0 * d1 * (d2 + 3) * cS);
  Buf<uint16_t> sb(d0 * d1 * (d2 + 3) * sS), zb(d0 * d1 * (d2 + 3) * sS);
  std::fill(cb.p, cb.p + cb.n, 0xdeadbeefu); std::fill(sb.p, sb.p + sb.n, 0x1234); std::fill(zb.p, zb.p + zb.n, 0x4321);
  QuantizeParams p{};
  p.x = xb_v.data(); p.x_rows = {1, {rows}, {L}};
  auto lay = [&](int64_t S) { RowLayout r{}; r.ndim = 2; r.size[0] = d0 * d1; r.size[1] = d2; r.stride[0] = (d2 + 3) * S; r.stride[1] = S; return r; };
  p.codes = cb.p + 1 * cS; p.scales = sb.p + 1 * sS; p.zeros = zb.p + 1 * sS;
  p.c_rows = lay(cS); p.s_rows = lay(sS); p.z_rows = lay(sS);
  p.rows = rows; p.L = L; p.bits = bits; p.group_size = G; p.mode = mode; p.calib = asym_calib(eta); p.x_dtype = dt;
  cudaError_t e = launch_quantize_groups_into(p, nullptr);
  res.cases++;
  if (e != cudaSuccess) { printf("quant launch error %s\n", last_launch_error()); res.fails++; return; }
  int64_t bad = 0;
  std::vector<uint32_t> gc(G), scr(G);
  for (int64_t r = 0; r < rows; ++r) for (int64_t g = 0; g < NG; ++g) {
    GroupQuant q = mode == QuantMode::kSym ? quantize_group_sym(&xe[r * L + g * G], G, bits, gc.data())
                 : mode == QuantMode::kAsym ? quantize_group_asym(&xe[r * L + g * G], G, bits, asym_calib(eta), gc.data())
                 : quantize_group_hybrid(&xe[r * L + g * G], G, bits, gc.data(), scr.data());
    const int64_t i0 = r / d2, i1 = r % d2;
    const int64_t crow = i0 * (d2 + 3) * cS + (i1 + 1) * cS, srow = i0 * (d2 + 3) * sS + (i1 + 1) * sS;
    if (sb.p[srow + g] != q.scale_bits || zb.p[srow + g] != q.zero_bits) bad++;
    for (int blk = 0; blk < G / 32; ++blk) { uint32_t w[4]; pack_block_rt(gc.data() + blk * 32, w, bits);
      for (int i = 0; i < bits; ++i) if (cb.p[crow + (g * (G / 32) + blk) * bits + i] != w[i]) bad++; }
  }
  // untouched elsewhere
  int64_t touched = 0;
  for (int64_t i0 = 0; i0 < d0 * d1; ++i0) for (int64_t j = 0; j < d2 + 3; ++j) {
    bool in = j >= 1 && j < 1 + d2;
    for (int64_t w = 0; w < cS; ++w) if ((!in || w >= W) && cb.p[(i0 * (d2 + 3) + j) * cS + w] != 0xdeadbeefu) touched++;
    for (int64_t w = 0; w < sS; ++w) if ((!in || w >= NG) && (sb.p[(i0 * (d2 + 3) + j) * sS + w] != 0x1234 || zb.p[(i0 * (d2 + 3) + j) * sS + w] != 0x4321)) touched++;
  }
  if (bad || touched) res.fails++;
  printf("quant %ldx%ldx%ldx%ld b%d G%d mode%d eta%g dt%d : %s (bad %ld, touched %ld)\n", d0, d1, d2, L, bits, G, (int)mode, eta, (int)dt,
         (bad || touched) ? "FAIL" : "ok", bad, touched);
}

// ---- static_append ------------------------------------------------------------------------------------------------
// A decode loop of `steps` appends of n tokens into capacity buffers (padded row strides), against a host model of
// the spec (kvkernels/reference/static_append.py): the sink takes tokens while it has room, the tails take the rest,
// and each tail's oldest tokens past w_recent (whole groups for "cols") are quantized into its store by quant.cuh's
// group functions (keys divided by x_scale first). After every step the counts, the used part of the sink, tails
// and stores must be exactly the model's. tail_extra: tails that many tokens longer than a cache's; tail0: tokens
// (zeros) both tails hold at the start, beside an empty sink; tail_pad: tail rows padded by that many elements (0:
// 16-byte rows, the shift's wide path). bad_at >= 0: lengths are corrupted before step bad_at (bad_kind 0: a full key
// tail, 1: a full key store, 2: a "cols" value store count off its group grid): the kernel must trap and leave the
// counts alone.
struct AppendSideSpec { bool cols; int bits; QuantMode mode; float eta; };
static void append_case(int64_t B, int64_t H, int64_t D, int64_t W, int64_t w_recent, int64_t n, int steps, int G,
                        AppendSideSpec ks, AppendSideSpec vs, XDtype dt, bool x_scale, int bad_at = -1,
                        int bad_kind = 0, int64_t tail_extra = 0, int64_t tail0 = 0, int64_t tail_pad = 3) {
  const size_t es = xsize(dt);
  const AppendSideSpec spec[2] = {ks, vs};
  const int64_t total = n * steps;
  // buffers: tails at w_recent + n (+ G - 1), stores with room for every token plus E, row strides padded
  int64_t tail_cap[2], cap[2], E[2], c_sr[2], s_sr[2];
  std::vector<std::unique_ptr<Buf<char>>> tails, xs;
  std::vector<std::unique_ptr<Buf<uint32_t>>> codes;
  std::vector<std::unique_ptr<Buf<uint16_t>>> scales, zeros;
  Buf<char> sink_k(B * H * std::max<int64_t>(W, 1) * D * es), sink_v(B * H * std::max<int64_t>(W, 1) * D * es);
  Buf<float> xsc(H * D);
  for (int64_t i = 0; i < H * D; ++i) xsc.p[i] = 0.5f + std::fabs(frand()) * 3.f;
  StaticAppendParams p{};
  for (int s = 0; s < 2; ++s) {
    const int64_t step = spec[s].cols ? G : 1;
    tail_cap[s] = w_recent + n + (spec[s].cols ? G - 1 : 0) + tail_extra;
    E[s] = std::max<int64_t>(tail_cap[s] - w_recent, 0) / step * step;
    cap[s] = (tail0 + total + E[s] + G - 1) / G * G;
    if (spec[s].cols) cap[s] = (cap[s] + 127) / 128 * 128;
    tails.emplace_back(new Buf<char>(B * H * tail_cap[s] * (D + tail_pad) * es));
    std::memset(tails.back()->p, 0, tails.back()->n);
    const int64_t rows = spec[s].cols ? D : cap[s], words = spec[s].cols ? cap[s] / 32 * spec[s].bits : D / 32 * spec[s].bits;
    const int64_t groups = spec[s].cols ? cap[s] / G : D / G;
    c_sr[s] = words + 4, s_sr[s] = groups + 2;
    codes.emplace_back(new Buf<uint32_t>(B * H * rows * c_sr[s]));
    scales.emplace_back(new Buf<uint16_t>(B * H * rows * s_sr[s]));
    zeros.emplace_back(new Buf<uint16_t>(B * H * rows * s_sr[s]));
    std::fill(codes.back()->p, codes.back()->p + codes.back()->n, 0xdeadbeefu);
    xs.emplace_back(new Buf<char>(B * H * n * (D + 1) * es));
    AppendSide& a = p.side[s];
    a.x = xs.back()->p; a.x_st = D + 1; a.x_sh = n * (D + 1); a.x_sb = H * a.x_sh;
    a.sink = s == 0 ? sink_k.p : sink_v.p; a.sk_st = D; a.sk_sh = W * D; a.sk_sb = H * W * D;
    a.tail = tails.back()->p; a.t_st = D + tail_pad; a.t_sh = tail_cap[s] * (D + tail_pad); a.t_sb = H * a.t_sh; a.tail_cap = tail_cap[s];
    a.codes = codes.back()->p; a.c_sr = c_sr[s]; a.c_sh = rows * c_sr[s]; a.c_sb = H * a.c_sh;
    a.scales = scales.back()->p; a.s_sr = s_sr[s]; a.s_sh = rows * s_sr[s]; a.s_sb = H * a.s_sh;
    a.zeros = spec[s].mode == QuantMode::kSym ? nullptr : zeros.back()->p; a.z_sr = a.s_sr; a.z_sh = a.s_sh; a.z_sb = a.s_sb;
    a.cap = cap[s]; a.bits = spec[s].bits; a.mode = spec[s].mode;
    a.layout = spec[s].cols ? StoreLayout::kCols : StoreLayout::kRows; a.calib = asym_calib(spec[s].eta);
    a.x_scale = s == 0 && x_scale ? xsc.p : nullptr; a.xs_sh = D;
  }
  Buf<int64_t> lengths(5);
  std::fill(lengths.p, lengths.p + 5, 0);
  lengths.p[2] = lengths.p[4] = tail0;
  p.lengths = lengths.p; p.B = B; p.H = H; p.n = n; p.W = W; p.D = D; p.w_recent = w_recent; p.group_size = G;
  p.elem_bytes = (int)es; p.dtype = dt;
  // the model: per side and (b, h), the sink's and tail's token values and the store's expected words
  std::vector<std::vector<float>> m_sink(2 * B * H), m_tail(2 * B * H);
  std::vector<std::vector<uint32_t>> m_codes(2), m_scales(2), m_zeros(2);  // full expected buffers (used part checked)
  for (int s = 0; s < 2; ++s) { m_codes[s].assign(codes[s]->n, 0); m_scales[s].assign(scales[s]->n, 0); m_zeros[s].assign(zeros[s]->n, 0); }
  int64_t m_len[5] = {0, 0, tail0, 0, tail0};
  for (auto& tl : m_tail) tl.assign(tail0 * D, 0.f);
  int64_t bad = 0;
  bool trapped_ok = true;
  auto value_at = [&](const char* base, int64_t i) {
    return dt == XDtype::kF32 ? reinterpret_cast<const float*>(base)[i]
         : dt == XDtype::kF16 ? __half2float(reinterpret_cast<const __half*>(base)[i])
                              : __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(base)[i]);
  };
  for (int st = 0; st < steps; ++st) {
    for (int s = 0; s < 2; ++s)
      for (int64_t i = 0; i < B * H * n * (D + 1); ++i) { float e; store_x(xs[s]->p, dt, i, frand() * 2 + (i % 7 == 0 ? 3.f : 0.f), e); }
    if (st == bad_at && bad_kind == 0) lengths.p[2] = tail_cap[0];  // a full key tail: the new tokens overflow it
    if (st == bad_at && bad_kind == 1) lengths.p[1] = cap[0] - E[0] + 1;  // a key store without E slots left
    if (st == bad_at && bad_kind == 2) lengths.p[3] += 1;  // off the "cols" value store's group grid
    int64_t before[5]; std::memcpy(before, lengths.p, sizeof(before));
    const long traps0 = kvk_emu::traps.load();
    cudaError_t e = launch_static_append(p, nullptr);
    res.cases++;
    if (e != cudaSuccess) { printf("append launch error %s\n", last_launch_error()); res.fails++; return; }
    if (st == bad_at) {
      trapped_ok = kvk_emu::traps.load() > traps0 && std::memcmp(before, lengths.p, sizeof(before)) == 0;
      break;
    }
    // model step
    const int64_t take = std::min(std::max<int64_t>(W - m_len[0], 0), n), rest = n - take;
    for (int s = 0; s < 2; ++s) {
      const AppendSideSpec& sp = spec[s];
      const int64_t step = sp.cols ? G : 1;
      const int64_t n_out = std::max<int64_t>(m_len[2 + 2 * s] + rest - w_recent, 0) / step * step;
      const int64_t stored = m_len[1 + 2 * s];
      for (int64_t bh = 0; bh < B * H; ++bh) {
        const int64_t b = bh / H, h = bh % H;
        auto& sk = m_sink[s * B * H + bh];
        auto& tl = m_tail[s * B * H + bh];
        for (int64_t j = 0; j < n; ++j)
          for (int64_t d = 0; d < D; ++d) {
            const float x = value_at(xs[s]->p, b * p.side[s].x_sb + h * p.side[s].x_sh + j * (D + 1) + d);
            (j < take ? sk : tl).push_back(x);
          }
        // quantize the n_out oldest tail tokens
        std::vector<float> grp(G);
        std::vector<uint32_t> gc(G), scr(G);
        const int64_t ngroups = sp.cols ? D * (n_out / G) : n_out * (D / G);
        for (int64_t gi = 0; gi < ngroups; ++gi) {
          int64_t row, word, gidx;
          for (int i = 0; i < G; ++i) {
            const int64_t tok = sp.cols ? (gi / D) * G + i : gi / (D / G), ch = sp.cols ? gi % D : (gi % (D / G)) * G + i;
            float x = tl[tok * D + ch];
            if (s == 0 && x_scale) x = x / xsc.p[h * D + ch];
            grp[i] = x;
          }
          const GroupQuant q = sp.mode == QuantMode::kSym ? quantize_group_sym(grp.data(), G, sp.bits, gc.data())
                             : sp.mode == QuantMode::kAsym ? quantize_group_asym(grp.data(), G, sp.bits, asym_calib(sp.eta), gc.data())
                             : quantize_group_hybrid(grp.data(), G, sp.bits, gc.data(), scr.data());
          if (sp.cols) { row = gi % D; gidx = stored / G + gi / D; word = (stored + (gi / D) * G) / 32 * sp.bits; }
          else { row = stored + gi / (D / G); gidx = gi % (D / G); word = gidx * (G / 32) * sp.bits; }
          const int64_t rows = sp.cols ? D : cap[s];
          const int64_t srow = (bh * rows + row) * s_sr[s], crow = (bh * rows + row) * c_sr[s];
          m_scales[s][srow + gidx] = q.scale_bits;
          m_zeros[s][srow + gidx] = q.zero_bits;
          for (int blk = 0; blk < G / 32; ++blk) { uint32_t w[4]; pack_block_rt(gc.data() + blk * 32, w, sp.bits);
            for (int i = 0; i < sp.bits; ++i) m_codes[s][crow + word + blk * sp.bits + i] = w[i]; }
        }
        tl.erase(tl.begin(), tl.begin() + n_out * D);
      }
      m_len[1 + 2 * s] += n_out;
      m_len[2 + 2 * s] += rest - n_out;
    }
    m_len[0] += take;
    // compare
    for (int i = 0; i < 5; ++i) bad += lengths.p[i] != m_len[i];
    for (int s = 0; s < 2; ++s) {
      const AppendSideSpec& sp = spec[s];
      const int64_t rows = sp.cols ? D : cap[s];
      for (int64_t bh = 0; bh < B * H; ++bh) {
        const int64_t b = bh / H, h = bh % H;
        const auto& sk = m_sink[s * B * H + bh];
        const auto& tl = m_tail[s * B * H + bh];
        const char* sinkp = s == 0 ? sink_k.p : sink_v.p;
        for (int64_t i = 0; i < (int64_t)sk.size(); ++i) bad += value_at(sinkp, b * H * W * D + h * W * D + i) != sk[i];
        for (int64_t i = 0; i < (int64_t)tl.size(); ++i)
          bad += value_at(tails[s]->p, b * p.side[s].t_sb + h * p.side[s].t_sh + (i / D) * (D + tail_pad) + i % D) != tl[i];
        const int64_t used = m_len[1 + 2 * s];
        for (int64_t r = 0; r < rows; ++r) {
          if (!sp.cols && r >= used) break;
          const int64_t nw = sp.cols ? used / 32 * sp.bits : D / 32 * sp.bits, ng = sp.cols ? used / G : D / G;
          for (int64_t w = 0; w < nw; ++w) bad += codes[s]->p[(bh * rows + r) * c_sr[s] + w] != m_codes[s][(bh * rows + r) * c_sr[s] + w];
          for (int64_t g = 0; g < ng; ++g) {
            bad += scales[s]->p[(bh * rows + r) * s_sr[s] + g] != m_scales[s][(bh * rows + r) * s_sr[s] + g];
            if (sp.mode != QuantMode::kSym) bad += zeros[s]->p[(bh * rows + r) * s_sr[s] + g] != m_zeros[s][(bh * rows + r) * s_sr[s] + g];
          }
        }
      }
    }
  }
  const bool fail = bad || !trapped_ok;
  if (fail) res.fails++;
  printf("append B%ld H%ld D%ld W%ld wr%ld n%d x%d G%d keys %s b%d m%d, values %s b%d m%d dt%d xs%d +tail %ld "
         "tail0 %ld pad %ld%s : %s (bad %ld) lengths %ld %ld %ld %ld %ld\n", B, H, D, W, w_recent, (int)n, steps, G,
         ks.cols ? "cols" : "rows", ks.bits, (int)ks.mode, vs.cols ? "cols" : "rows", vs.bits, (int)vs.mode, (int)dt,
         (int)x_scale, tail_extra, tail0, tail_pad, bad_at >= 0 ? (bad_kind == 0 ? " trap:tail" : bad_kind == 1 ?
         " trap:store" : " trap:grid") : "", fail ? "FAIL" : "ok", bad, lengths.p[0], lengths.p[1], lengths.p[2],
         lengths.p[3], lengths.p[4]);
}

static void append_cases() {
  const AppendSideSpec rows3{false, 3, QuantMode::kSym, 0.f}, cols3{true, 3, QuantMode::kSym, 0.f};
  const AppendSideSpec rows2a{false, 2, QuantMode::kAsym, 0.f}, cols2a{true, 2, QuantMode::kAsym, 0.f};
  const AppendSideSpec rows4h{false, 4, QuantMode::kHybrid, 0.f}, cols1h{true, 1, QuantMode::kHybrid, 0.f};
  const AppendSideSpec cols4e{true, 4, QuantMode::kAsym, 0.2f};
  // InnerQ-like (keys rows, values cols), one token a step: sink filling, then both tails evicting, 3+ groups leaving
  // a "cols" tail (a store count past 0 at a group's write)
  append_case(2, 2, 64, 4, 8, 1, 80, 32, rows3, cols3, XDtype::kF16, true);
  append_case(1, 2, 128, 4, 16, 1, 88, 32, rows4h, cols2a, XDtype::kBF16, true);
  // KIVI-like (keys cols, values rows), fp32 windows, no sink, keys divided by x_scale, 16-byte tail rows
  append_case(1, 2, 64, 0, 8, 1, 80, 32, cols2a, rows2a, XDtype::kF32, true, -1, 0, 0, 0, 0);
  // several tokens a step (one step splits between sink and tail), G = 64, hybrid 1-bit, eta
  append_case(1, 2, 128, 5, 10, 3, 50, 64, rows4h, cols1h, XDtype::kF16, true);
  append_case(2, 1, 64, 2, 0, 5, 20, 32, cols4e, rows3, XDtype::kF16, false);  // w_recent 0: tokens leave at once
  // an empty batch: no CTA runs, the counts still advance (as the reference's do)
  append_case(0, 2, 64, 2, 4, 1, 40, 32, rows3, cols3, XDtype::kF16, false);
  // a sink with room beside full, longer tails (a direct call's state, not a cache's): the tails evict while the sink
  // still takes tokens (n_out = tail + rest - w_recent, rest = 0), fp16 16-byte tail rows
  append_case(1, 2, 64, 4, 2, 1, 12, 32, rows3, cols2a, XDtype::kF16, true, -1, 0, 40, 38, 0);
  // broken preconditions: trap, counts untouched
  append_case(1, 2, 64, 2, 8, 1, 12, 32, rows3, cols3, XDtype::kF16, false, 10, 0);
  append_case(1, 2, 64, 2, 8, 1, 12, 32, rows3, cols3, XDtype::kF16, false, 10, 1);
  append_case(1, 2, 64, 2, 8, 1, 12, 32, rows3, cols3, XDtype::kF16, false, 10, 2);
}

// ---- lattice GEMVs ------------------------------------------------------------------------------------------------
// Orthonormal Walsh-Hadamard transform of G values in double (the definition; the kernels run it in fp32).
static void fwht_double(double* y, int G) {
  for (int h = 1; h < G; h *= 2)
    for (int i = 0; i < G; ++i)
      if (i % (2 * h) < h) {
        const double a = y[i], b = y[i + h];
        y[i] = a + b, y[i + h] = a - b;
      }
  const double s = 1.0 / std::sqrt((double)G);
  for (int i = 0; i < G; ++i) y[i] *= s;
}

// keys (values = false): scores[b, h, t, n] = sum_g r16 <H_n (s q_g), grid[c]>;  values: out[b, h, t, :] per group
// = s * H_n (sum_n p_n r16 grid[c]). Random codes (every index is valid), norms, grid, signs, strided views.
// The contract (csrc/cuda/gemv_lattice.cu): the grid in fp16 (2^-11), values' r16 * grid rounded to fp16 once more;
// checked at 2^-10 (keys) / 2^-9 (values) of the magnitude sum, plus 2^-20 of sum |x| (values' subnormal products).
// coff < 0: a cache's layout (rows at a capacity of N rounded up to 64, buffers 16-byte aligned): with code rows of a
// multiple of 16 bytes (8 for EDEN2-64's 24-byte rows at D = 64) and rpad even (0 at G = D), the keys' cp.async ring; expect_ring: 1 must, 0 must not, -1 either.
void lattice_case(bool values, int64_t B, int64_t H_q, int64_t H_kv, int64_t T, bool has_t, int64_t N, int D, int G,
                  LatticeGrid gk, XDtype dt, bool with_signs, int cpad, int coff, int rpad, int num_sms,
                  int expect_ring = -1) {
  const int bits = lattice_bits(gk), d = lattice_d(gk), n = lattice_n(gk);
  const int64_t W = D * bits / 32, NG = D / G, L = values ? N : D;
  const bool cache = coff < 0;
  const int64_t cap = cache ? (N + 63) / 64 * 64 : N;
  if (cache) coff = 0;
  const int64_t c_sn = W + cpad, c_sh = cap * c_sn + (cache ? 0 : 3), c_sb = H_kv * c_sh;
  Buf<uint32_t> codes(B * c_sb + coff + 1);
  for (size_t i = 0; i < codes.n; ++i) codes.p[i] = static_cast<uint32_t>(rng());
  const int64_t r_sn = NG + rpad, r_sh = cap * r_sn + (cache ? 0 : 1), r_sb = H_kv * r_sh;
  Buf<uint16_t> nr(B * r_sb + 2);
  for (size_t i = 0; i < nr.n; ++i) nr.p[i] = rng() % 13 == 0 ? 0 : hbits(std::fabs(frand()) * 2.f);
  Buf<float> grid(n * d);
  for (size_t i = 0; i < grid.n; ++i) grid.p[i] = 2.f * frand();
  Buf<int8_t> signs(G);
  for (int i = 0; i < G; ++i) signs.p[i] = (rng() & 1) ? 1 : -1;
  const int64_t x_st = L + 3, x_sh = T * x_st + 5, x_sb = H_q * x_sh + 3;
  std::vector<char> xbuf_v((B * x_sb + 7) * xsize(dt) + 64);
  std::vector<float> xe(B * x_sb + 7, 0.f);
  for (int64_t i = 0; i < B * x_sb + 7; ++i) store_x(xbuf_v.data(), dt, i, frand(), xe[i]);
  const int64_t Y = values ? D : N;
  Buf<float> y(B * H_q * T * Y);
  for (size_t i = 0; i < y.n; ++i) y.p[i] = NAN;

  GemvLatticeParams p{};
  p.x = xbuf_v.data(); p.codes = codes.p + coff; p.norms = nr.p + (cache ? 0 : 1); p.grid = grid.p;
  p.signs = with_signs ? signs.p : nullptr; p.y = y.p;
  p.B = B; p.H_q = H_q; p.H_kv = H_kv; p.T = T; p.N = N; p.D = D; p.group_size = G; p.grid_kind = gk;
  p.x_dtype = dt; p.num_sms = num_sms;
  p.x_sb = x_sb; p.x_sh = x_sh; p.x_st = has_t ? x_st : 0;
  p.c_sb = c_sb; p.c_sh = c_sh; p.c_sn = c_sn;
  p.r_sb = r_sb; p.r_sh = r_sh; p.r_sn = r_sn;
  p.y_sb = H_q * T * Y; p.y_sh = T * Y; p.y_st = has_t ? Y : 0;
  const bool ring = !values && gemv_lattice_k_ring(p);
  if (expect_ring >= 0 && ring != (expect_ring != 0)) {
    printf("lattice_k: cp.async ring %d, expected %d\n", (int)ring, expect_ring);
    res.fails++;
  }
  int64_t wsf = values ? gemv_lattice_v_workspace_floats(p) : gemv_lattice_k_workspace_floats(p);
  std::unique_ptr<Buf<float>> ws;
  if (wsf > 0) { ws = std::make_unique<Buf<float>>(wsf); p.workspace = ws->p; p.workspace_floats = wsf; }
  cudaError_t e = values ? launch_gemv_lattice_v(p, nullptr) : launch_gemv_lattice_k(p, nullptr);
  res.cases++;
  if (e != cudaSuccess) { printf("lattice launch error %d: %s\n", (int)e, last_launch_error()); res.fails++; return; }

  // rotated dequantized row (per group) of token tok: y_rot[c] = r16 * grid[c_j][c % d], and |.| of it
  const auto rot_row = [&](int64_t b, int64_t hk, int64_t tok, std::vector<double>& yr) {
    const uint32_t* row = p.codes + b * c_sb + hk * c_sh + tok * c_sn;
    for (int c = 0; c < D; c += d) {
      const uint32_t idx = lattice_index(row + (c / 32) * bits, (c % 32) / d, gk);
      const double r = half_bits_to_float(p.norms[b * r_sb + hk * r_sh + tok * r_sn + c / G]);
      for (int i = 0; i < d; ++i) yr[c + i] = r * grid.p[idx * d + i];
    }
  };
  const int64_t gq = H_q / H_kv;
  int64_t bad = 0;
  double worst = 0;
  std::vector<double> yr(D), qr(D), acc(D), mag(D);
  for (int64_t b = 0; b < B; ++b) for (int64_t h = 0; h < H_q; ++h) for (int64_t t = 0; t < T; ++t) {
    const int64_t hk = h / gq;
    const float* x = &xe[b * x_sb + h * x_sh + (has_t ? t * x_st : 0)];
    const float* got = y.p + b * p.y_sb + h * p.y_sh + t * (has_t ? Y : 0);
    const auto check = [&](int64_t j, double want, double bound) {
      const double ex = std::fabs(got[j] - want) - bound;
      worst = std::max(worst, ex);
      if (!(ex <= 0)) { if (bad < 3) printf("  mismatch b%ld h%ld t%ld j%ld got %.9g want %.9g bound %.3g\n", b, h, t, j, got[j], want, bound); bad++; }
    };
    if (!values) {
      for (int c = 0; c < D; ++c) qr[c] = (double)x[c] * (with_signs ? signs.p[c % G] : 1);
      for (int g0 = 0; g0 < D; g0 += G) fwht_double(&qr[g0], G);
      for (int64_t tok = 0; tok < N; ++tok) {
        rot_row(b, hk, tok, yr);
        double s = 0, m = 0;
        for (int c = 0; c < D; ++c) s += qr[c] * yr[c], m += std::fabs(qr[c] * yr[c]);
        check(tok, s, std::ldexp(m, -10) + 1e-7);
      }
    } else {
      std::fill(acc.begin(), acc.end(), 0.0);
      std::fill(mag.begin(), mag.end(), 0.0);
      double xs = 0;
      for (int64_t tok = 0; tok < N; ++tok) {
        rot_row(b, hk, tok, yr);
        xs += std::fabs(x[tok]);
        for (int c = 0; c < D; ++c) acc[c] += x[tok] * yr[c], mag[c] += std::fabs(x[tok] * yr[c]);
      }
      for (int g0 = 0; g0 < D; g0 += G) {
        fwht_double(&acc[g0], G);
        double m = 0;
        for (int c = g0; c < g0 + G; ++c) m += mag[c];
        for (int c = g0; c < g0 + G; ++c) {
          const double want = acc[c] * (with_signs ? signs.p[c % G] : 1);
          check(c, want, std::ldexp(m / std::sqrt((double)G), -9) + std::ldexp(xs, -20) + 1e-7);
        }
      }
    }
  }
  if (bad) res.fails++;
  printf("lattice_%s B%ld Hq%ld Hkv%ld T%ld%s N%ld D%d G%d grid(%d,%d) dt%d signs%d cpad%d coff%d rpad%d sms%d ws%ld%s : %s (bad %ld)\n",
         values ? "v" : "k", B, H_q, H_kv, T, has_t ? "" : "(3d)", N, D, G, d, n, (int)dt, (int)with_signs, cpad,
         cache ? -1 : coff, rpad, num_sms, wsf, ring ? " ring" : "", bad ? "FAIL" : "ok", bad);
}

// ---- aqua_reconstruct ----------------------------------------------------------------------------------------------
// out = ((prev @ W^T + prev2 @ W2^T) + bias) + deq against double precision: the operands enter exactly (fp16 / bf16 /
// fp32 values), the residual is the definition s * H_n (r16 * grid[c]) per group of G, in double. Checked at 2^-16 of
// the magnitude (sum |x w| + |bias| + the group's sum |r16 grid| / sqrt(G)) + 1e-6: fp32 accumulation order and fp32
// butterflies only. Operand rows strided (xpad elements past C_in), codes / norms / out rows padded (the out padding
// must stay untouched), random codes (every index is valid), norms (some zero), grid and signs. C_in2 < 0: no prev2.
// `expect` != cudaSuccess: the launcher must refuse (with a message) and write nothing.
void aqua_case(int64_t T, int64_t C_in, int64_t C_in2, int64_t C, int G, LatticeGrid gk, XDtype dt, bool with_signs,
               int num_sms, int xpad = 8, cudaError_t expect = cudaSuccess) {
  const int bits = lattice_bits(gk), d = lattice_d(gk), n = lattice_n(gk);
  const bool two = C_in2 >= 0;
  const int64_t W = C * bits / 32, NG = C / G;
  const int64_t s_codes = W + 3, s_norms = NG + 1, s_out = C + 2;
  // a [rows, cols] operand with row stride cols + xpad; values rounded to dt, their exact floats in `exact`
  const auto operand = [&](int64_t rows, int64_t cols, std::vector<float>& exact) {
    const int64_t stride = cols + xpad;
    auto buf = std::make_unique<Buf<char>>(std::max<int64_t>(1, rows * stride) * xsize(dt));
    exact.assign(rows * stride, 0.f);
    for (int64_t i = 0; i < rows * stride; ++i) store_x(buf->p, dt, i, frand(), exact[i]);
    return buf;
  };
  std::vector<float> xe, we, x2e, w2e;
  auto prev = operand(T, C_in, xe), weight = operand(C, C_in, we);
  std::unique_ptr<Buf<char>> prev2, weight2;
  if (two) prev2 = operand(T, C_in2, x2e), weight2 = operand(C, C_in2, w2e);
  Buf<float> bias(C);
  for (int64_t c = 0; c < C; ++c) bias.p[c] = frand();
  Buf<uint32_t> codes(std::max<int64_t>(1, T * s_codes));
  for (size_t i = 0; i < codes.n; ++i) codes.p[i] = static_cast<uint32_t>(rng());
  Buf<uint16_t> nr(std::max<int64_t>(1, T * s_norms));
  for (size_t i = 0; i < nr.n; ++i) nr.p[i] = rng() % 11 == 0 ? 0 : hbits(std::fabs(frand()) * 2.f);
  Buf<float> grid(n * d);
  for (size_t i = 0; i < grid.n; ++i) grid.p[i] = 2.f * frand();
  Buf<int8_t> signs(G);
  for (int i = 0; i < G; ++i) signs.p[i] = (rng() & 1) ? 1 : -1;
  Buf<float> out(std::max<int64_t>(1, T * s_out));
  for (size_t i = 0; i < out.n; ++i) out.p[i] = NAN;

  AquaReconstructParams p{};
  p.prev = prev->p; p.weight = weight->p; p.prev2 = two ? prev2->p : nullptr; p.weight2 = two ? weight2->p : nullptr;
  p.bias = bias.p; p.codes = codes.p; p.norms = nr.p; p.grid = grid.p; p.signs = with_signs ? signs.p : nullptr;
  p.out = out.p;
  p.T = T; p.C = C; p.C_in = C_in; p.C_in2 = two ? C_in2 : 0; p.group_size = G; p.grid_kind = gk; p.x_dtype = dt;
  p.num_sms = num_sms;
  p.s_prev = C_in + xpad; p.s_w = C_in + xpad; p.s_prev2 = C_in2 + xpad; p.s_w2 = C_in2 + xpad;
  p.s_codes = s_codes; p.s_norms = s_norms; p.s_out = s_out;
  const long ldsm_before = kvk_emu::ldsm_misaligned.load();
  const cudaError_t e = launch_aqua_reconstruct(p, nullptr);
  res.cases++;
  const char* tag = two ? "values" : "keys";
  if (expect != cudaSuccess) {
    long touched = 0;
    for (size_t i = 0; i < out.n; ++i) touched += !std::isnan(out.p[i]);
    const bool good = e == expect && last_launch_error()[0] != '\0' && touched == 0;
    if (!good) res.fails++;
    printf("aqua_%s T%ld Cin%ld C%ld G%d xpad%d: refused with \"%s\" : %s\n", tag, T, C_in, C, G, xpad,
           last_launch_error(), good ? "ok" : "FAIL");
    return;
  }
  if (e != cudaSuccess) { printf("aqua launch error %d: %s\n", (int)e, last_launch_error()); res.fails++; return; }

  int64_t bad = 0;
  std::vector<double> y(G), ymag(G);
  for (int64_t t = 0; t < T; ++t) {
    const uint32_t* row = codes.p + t * s_codes;
    for (int64_t g0 = 0; g0 < C; g0 += G) {
      const double r16 = half_bits_to_float(nr.p[t * s_norms + g0 / G]);
      double dmag = 0;
      for (int i = 0; i < G; ++i) {
        const int64_t c = g0 + i;
        const uint32_t idx = lattice_index(row + (c / 32) * bits, (c % 32) / d, gk);
        y[i] = r16 * grid.p[idx * d + c % d];
        dmag += std::fabs(y[i]);
      }
      fwht_double(y.data(), G);
      dmag /= std::sqrt((double)G);
      for (int i = 0; i < G; ++i) {
        const int64_t c = g0 + i;
        double s = 0, m = 0;
        for (int64_t k = 0; k < C_in; ++k) {
          const double v = (double)xe[t * p.s_prev + k] * we[c * p.s_w + k];
          s += v, m += std::fabs(v);
        }
        for (int64_t k = 0; two && k < C_in2; ++k) {
          const double v = (double)x2e[t * p.s_prev2 + k] * w2e[c * p.s_w2 + k];
          s += v, m += std::fabs(v);
        }
        const double want = s + bias.p[c] + y[i] * (with_signs ? signs.p[i] : 1);
        const double bound = std::ldexp(m + std::fabs(bias.p[c]) + dmag, -16) + 1e-6;
        const float got = out.p[t * s_out + c];
        if (!(std::fabs(got - want) <= bound)) {
          if (bad < 3) printf("  mismatch t%ld c%ld got %.9g want %.9g bound %.3g\n", t, c, got, want, bound);
          bad++;
        }
      }
    }
    for (int64_t c = C; c < s_out; ++c) bad += !std::isnan(out.p[t * s_out + c]);  // the row padding: untouched
  }
  // No GEMM (C_in 0, no prev2): the residual must be bit-identical to the reference's fp32 order (r16 * grid, the
  // butterflies, * fp32(1 / sqrt(G)), * s), and out = bias + deq in fp32 exactly.
  if (C_in == 0 && !two) {
    std::vector<float> yf(G);
    const float inv = static_cast<float>(1.0 / std::sqrt(static_cast<double>(G)));
    for (int64_t t = 0; t < T; ++t)
      for (int64_t g0 = 0; g0 < C; g0 += G) {
        const float r16 = half_bits_to_float(nr.p[t * s_norms + g0 / G]);
        for (int i = 0; i < G; ++i) {
          const int64_t c = g0 + i;
          const uint32_t idx = lattice_index(codes.p + t * s_codes + (c / 32) * bits, (c % 32) / d, gk);
          yf[i] = grid.p[idx * d + c % d] * r16;
        }
        fwht_host(yf.data(), G, inv);
        for (int i = 0; i < G; ++i) {
          const float want = bias.p[g0 + i] + yf[i] * (with_signs ? static_cast<float>(signs.p[i]) : 1.f);
          const float got = out.p[t * s_out + g0 + i];
          if (std::memcmp(&want, &got, 4) != 0 && bad++ < 3)
            printf("  not bit-exact t%ld c%ld got %.9g want %.9g\n", t, g0 + i, got, want);
        }
      }
  }
  const long misaligned = kvk_emu::ldsm_misaligned.load() - ldsm_before;
  if (bad || misaligned) res.fails++;
  printf("aqua_%s T%ld Cin%ld+%ld C%ld G%d grid(%d,%d) dt%d signs%d sms%d xpad%d : %s (bad %ld, "
         "ldmatrix misaligned %ld)\n", tag, T, C_in, two ? C_in2 : 0, C, G, d, n, (int)dt, (int)with_signs, num_sms,
         xpad, bad || misaligned ? "FAIL" : "ok", bad, misaligned);
}

// The quarter arithmetic of the 6-bit layout and the byte / field addressing against lattice_index, exhaustively
// over random blocks (the kernels' index -> table-address path must give index << S | lane offset).
void lattice_index_cases() {
  std::mt19937 r(11);
  long bad = 0;
  for (int it = 0; it < 20000; ++it) {
    uint32_t w[4];
    for (auto& x : w) x = r();
    const uint32_t off = r() % 4 * 4;  // a lane's copy offset (< 2^S)
    const uint32_t top = quarter_top(w[0], w[1], w[2]);
    for (int q = 0; q < 4; ++q)
      for (int e = 0; e < 4; ++e) {
        const uint32_t want = lattice_index(w, quarter_index(q, e), LatticeGrid::kE2_64);
        const uint32_t got7 = e < 3 ? field_addr<7, 6>(w[e], 6 * q, off) : x_addr<7>(top, x_mask(q), x_mul<7>(q), off);
        const uint32_t got5 = e < 3 ? field_addr<5, 6>(w[e], 6 * q, off) : x_addr<5>(top, x_mask(q), x_mul<5>(q), off);
        if (got7 != ((want << 7) | off) || got5 != ((want << 5) | off)) bad++;
      }
    for (int byte = 0; byte < 4; ++byte)
      if (field_addr<5, 8>(w[0], 8 * byte, off) != (((w[0] >> (8 * byte)) & 255u) << 5 | off)) bad++;
    // packing round trip of every grid
    for (int gk = 0; gk < 4; ++gk) {
      const LatticeGrid g = (LatticeGrid)gk;
      uint32_t idx[16], blk[4];
      for (int j = 0; j < 32 / lattice_d(g); ++j) idx[j] = r() % lattice_n(g);
      lattice_pack_block(idx, blk, g);
      for (int j = 0; j < 32 / lattice_d(g); ++j) if (lattice_index(blk, j, g) != idx[j]) bad++;
    }
  }
  // every (k-step, k) of a row is one channel, and every (lane group, m-tile, h) of a warp's slice one channel
  for (int gk = 0; gk < 4; ++gk) {
    const LatticeGrid g = (LatticeGrid)gk;
    for (int D : {64, 128, 256}) {
      std::vector<int> seen(D, 0);
      for (int ks = 0; ks < D / 16; ++ks) for (int k = 0; k < 16; ++k) {
        const int c = lattice_key_channel(g, ks, k);
        if (c < 16 * (ks / 2 * 2) || c >= 16 * (ks / 2 * 2) + 32) bad++;  // inside the k-step's 32-channel block
        seen[c]++;
      }
      for (int c = 0; c < D; ++c) if (seen[c] != 1) bad++;
    }
    for (int DW : {64, 128}) {
      std::vector<int> seen(DW, 0);
      for (int gg = 0; gg < 8; ++gg) for (int mt = 0; mt < DW / 16; ++mt) for (int h = 0; h < 2; ++h)
        seen[lattice_value_channel(g, DW, gg, mt, h)]++;
      for (int c = 0; c < DW; ++c) if (seen[c] != 1) bad++;
    }
  }
  res.cases++;
  if (bad) res.fails++;
  printf("lattice index arithmetic: %s (bad %ld)\n", bad ? "FAIL" : "ok", bad);
}

// The register-level decoders of mma.cuh against unpack_one, for random blocks and every thread of a quad (exact:
// the MMA's A operand must hold the integer codes exactly), and the bit helpers they rely on.
template <int BITS, int OFF>
long decode_check(std::mt19937& r, int iters) {
  long bad = 0;
  const DecodeConsts k = decode_consts(BITS, OFF);
  for (int it = 0; it < iters; ++it) {
    uint32_t w[4];
    for (auto& x : w) x = r();
    for (int t = 0; t < 4; ++t) {
      const uint32_t X = gather_inner_q<BITS>(w, t), Xh = BITS == 3 ? gather_inner_q_high_plane(w, t) : 0u;
      uint32_t h[4];
      decode_inner_q<BITS, OFF>(X, Xh, k, h);
      for (int P = 0; P < 4; ++P)
        for (int half = 0; half < 2; ++half) {
          const float want = static_cast<float>(unpack_one<BITS>(w, 8 * t + P + 4 * half)) - OFF;
          const float got = half_bits_to_float(static_cast<uint16_t>(h[P] >> (16 * half)));
          if (got != want && bad++ < 5)
            printf("decode b%d off%d t%d P%d half%d: got %g want %g\n", BITS, OFF, t, P, half, got, want);
        }
    }
  }
  return bad;
}

void decode_cases() {
  std::mt19937 r(7);
  const long bad = decode_check<1, 0>(r, 20000) + decode_check<1, 1>(r, 20000) + decode_check<2, 0>(r, 20000) +
                   decode_check<2, 2>(r, 20000) + decode_check<3, 0>(r, 20000) + decode_check<3, 4>(r, 20000) +
                   decode_check<4, 0>(r, 20000) + decode_check<4, 8>(r, 20000);
  // prmt sign replication (the hybrid zero MMA's group mask): 0xffff per half whose top bit is set
  long pbad = 0;
  for (uint32_t v : {0x80000000u, 0x00008000u, 0x7fff7fffu, 0x80008000u, 0x12345678u, 0xfedcba98u}) {
    const uint32_t want = ((v & 0x8000u) ? 0x0000ffffu : 0u) | ((v & 0x80000000u) ? 0xffff0000u : 0u);
    if (prmt(v, 0u, 0xBB99u) != want) pbad++;
  }
  // double_to_half_bits (the host hfma2's rounding) agrees with the float conversion
  long hbad = 0;
  for (int i = 0; i < 200000; ++i) {
    const float f = std::uniform_real_distribution<float>(-70000.f, 70000.f)(r) * (i % 3 ? 1e-6f : 1.f);
    if (double_to_half_bits(f) != float_to_half_bits(f)) hbad++;
  }
  res.cases++;
  if (bad || pbad || hbad) res.fails++;
  printf("decode: %s (decoder mismatches %ld, prmt %ld, half rounding %ld)\n", bad || pbad || hbad ? "FAIL" : "ok", bad,
         pbad, hbad);
}


// ---- decode_attention_fused ----------------------------------------------------------------------------------------
// softmax(x K^T + mask) V over sink | quantized store | tail (keys and values each; key store mk tokens, value store mv)
// against double precision: keys/values dequantized in double ((s u + zeff) * key_x_scale), scores in double, the mask
// added in fp32 as the reference does (so a finfo.min row is uniform), softmax and P V in double. Every tensor is a
// strided view of a larger buffer (rows padded, stores narrowed from a larger capacity), the mask broadcast over the
// batch (stride 0). Checked at (4e-6 + 1e-6 * max_j sum_c |x k|) * sum_j p_j |v_j| + 1e-7 per output (fp32 scores,
// expf and accumulation order; the scores' error enters the probabilities relatively).
// mask_kind: 0 causal (null), 1 additive with -inf entries, 2 additive with a row of all finfo.min, 3 as 1 with a row
// (head 0, query 0) -inf over the sink and the first half of the key store: a warp's first steps in which a live row
// sees nothing, then steps in which it does.
// expect != cudaSuccess: the launcher must refuse with a message and write nothing.
struct AttnCase {
  int64_t B = 2, H_q = 2, H_kv = 2, T = 1;
  int D = 64, G = 32;
  int64_t S = 0, mk = 64, mv = 64, ntk = 3;  // key tail ntk; value tail = mk + ntk - mv
  int kbits = 2, vbits = 2;
  QuantMode kmode = QuantMode::kSym, vmode = QuantMode::kSym;
  StoreLayout klay = StoreLayout::kRows, vlay = StoreLayout::kCols;
  bool xscale = false;
  XDtype dt = XDtype::kF16;
  int mask_kind = 0;
  int64_t split_tokens = 0;
  int num_sms = 4;
  int64_t expect_splits = -1;  // >= 0: the plan must make this many splits
  bool aligned = false;        // stores without row padding, 16-byte aligned (3-bit keys need it for the store tiles)
  int64_t nan_key_token = -1;  // >= 0: the key store's scale of this token (b 0, h_kv 0, first group) is NaN
  // KIVI layouts on the store tiles: the tokens [S, S + F) go through kivi_tiles_kernel, which rounds each dequantized
  // key and value to fp16 (s u + z in one HFMA2, as gemv_kivi): the reference does too there, so the bound stays
  // fp32's. (A case that expects the tiles but runs the exact general kernel, or the reverse, fails the bound.)
  bool kivi_tiles = false;
  cudaError_t expect = cudaSuccess;
  // device lengths: every part becomes a capacity buffer with extra[i] junk tokens (sink, key store, key tail, value
  // store, value tail; a "cols" store's a multiple of G, a store's <= 64): NaN windows, mask columns and scales /
  // zeros everywhere outside the used tokens, random codes; p.lengths holds the used counts. Must equal the exact form.
  bool dev_lengths = false;
  int64_t extra[5] = {3, 64, 5, 64, 7};
  int windows_aligned = -1;  // 1: 16-byte aligned window rows, 0: misaligned (element offset 1), -1: every other case
  // the queries' dtype, q_scale and the output's dtype; -1 / 0: rotated over the cases (attn_case), so that every kind
  // of case (general kernel, store tiles, KIVI tiles, device lengths) meets fp16 / bf16 queries and outputs
  int xdt = -1, odt = -1;
  float q_scale = 0.f;
};

struct AttnStoreBuf {
  std::unique_ptr<Buf<uint32_t>> codes;
  std::unique_ptr<Buf<uint16_t>> sc, ze;
  AttnStore st{};
};

// A store of m tokens: a view of a buffer with capacity m + 64 tokens (cols: row stride = the buffer's width).
// aligned: no padding, every row 16-byte aligned (the caches' own layout).
static AttnStoreBuf make_store(int64_t B, int64_t H, int D, int G, int64_t m, int bits, QuantMode mode, StoreLayout lay,
                               bool aligned = false) {
  AttnStoreBuf sb;
  const int64_t cap = m + 64;
  const int pad = aligned ? 0 : 1;
  int64_t rows, c_sr, s_sr;
  if (lay == StoreLayout::kRows) rows = cap, c_sr = D * bits / 32 + 3 * pad, s_sr = D / G + pad;
  else rows = D, c_sr = cap * bits / 32 + pad, s_sr = cap / G + 2 * pad;
  const int64_t c_sh = rows * c_sr + pad, s_sh = rows * s_sr + 2 * pad;
  sb.codes = std::make_unique<Buf<uint32_t>>(B * H * c_sh + 4);
  for (size_t i = 0; i < sb.codes->n; ++i) sb.codes->p[i] = static_cast<uint32_t>(rng());
  sb.sc = std::make_unique<Buf<uint16_t>>(B * H * s_sh + 1);
  sb.ze = std::make_unique<Buf<uint16_t>>(B * H * s_sh + 1);
  for (size_t i = 0; i < sb.sc->n; ++i) {
    uint16_t b = hbits(std::fabs(frand()) * 0.2f);
    if (mode == QuantMode::kHybrid && (rng() & 1)) b |= 0x8000;
    if (rng() % 19 == 0) b = mode == QuantMode::kHybrid ? 0x8000 : 0;
    sb.sc->p[i] = b;
  }
  for (size_t i = 0; i < sb.ze->n; ++i) sb.ze->p[i] = hbits(frand());
  AttnStore& st = sb.st;
  st.codes = sb.codes->p + 1 + 3 * (1 - pad);  // word 4 (16 bytes) when aligned: Buf's allocation is 16-byte aligned
  st.scales = sb.sc->p + 1; st.zeros = mode == QuantMode::kSym ? nullptr : sb.ze->p + 1;
  st.m = m; st.bits = bits; st.mode = mode; st.layout = lay;
  st.c_sb = H * c_sh; st.c_sh = c_sh; st.c_sr = c_sr;
  st.s_sb = H * s_sh; st.s_sh = s_sh; st.s_sr = s_sr;
  st.z_sb = H * s_sh; st.z_sh = s_sh; st.z_sr = s_sr;
  return sb;
}

// token j (0 .. m-1), channel c of a store, in double (fp16: rounded once to fp16, as the KIVI tiles' HFMA2)
static double store_value(const AttnStore& st, int G, int64_t b, int64_t hk, int64_t j, int c, bool fp16 = false) {
  const bool rows = st.layout == StoreLayout::kRows;
  const int64_t r = rows ? j : c, col = rows ? c : j;  // packed row and position along it
  const uint32_t u = unpack_one_rt(st.codes + b * st.c_sb + hk * st.c_sh + r * st.c_sr + (col / 32) * st.bits, col % 32, st.bits);
  const uint16_t sbits = st.scales[b * st.s_sb + hk * st.s_sh + r * st.s_sr + col / G];
  const uint16_t zbits = st.zeros ? st.zeros[b * st.z_sb + hk * st.z_sh + r * st.z_sr + col / G] : 0;
  const GroupAffine a = group_affine_rt(st.mode, st.bits, sbits, zbits);
  const double w = (double)a.s * u + a.zeff;
  return fp16 ? (double)half_bits_to_float(double_to_half_bits(w)) : w;
}

struct AttnWindowBuf {
  std::vector<char> buf;
  std::vector<float> exact;
  AttnWindow w{};
  int64_t off = 1;  // element offset of the window's first element in buf / exact
  // element (b, h, t, c) of the window, as an index into buf / exact
  int64_t at(int64_t b, int64_t h, int64_t t, int64_t c) const { return off + b * w.sb + h * w.sh + t * w.st + c; }
};

// Device lengths: NaN in every scale / zero of a store outside its first `used` tokens (row padding included), and the
// store's m set to its capacity used + extra (the buffer holds used + 64 tokens).
static void junk_store(AttnStoreBuf& sb, int64_t B, int64_t H, int D, int G, int64_t used, int64_t extra) {
  AttnStore& st = sb.st;
  const bool rows = st.layout == StoreLayout::kRows;
  const int64_t nrow = rows ? used : D, ngrp = rows ? D / G : used / G;  // the used (row, group) block
  for (Buf<uint16_t>* buf : {sb.sc.get(), sb.ze.get()}) {
    const uint16_t* base = buf == sb.sc.get() ? st.scales : sb.ze->p + 1;
    std::vector<char> keep(buf->n, 0);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t r = 0; r < nrow; ++r)
          for (int64_t g = 0; g < ngrp; ++g) keep[(base - buf->p) + b * st.s_sb + h * st.s_sh + r * st.s_sr + g] = 1;
    for (size_t i = 0; i < buf->n; ++i)
      if (!keep[i]) buf->p[i] = 0x7e00;  // fp16 NaN
  }
  st.m = used + extra;
}

// Device lengths: tokens [n_used, capacity) of a window set to NaN
static void junk_window(AttnWindowBuf& wb, int64_t B, int64_t H, int64_t n_used, int D, XDtype dt) {
  float dummy;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = n_used; t < wb.w.n; ++t)
        for (int c = 0; c < D; ++c) store_x(wb.buf.data(), dt, wb.at(b, h, t, c), NAN, dummy);
}

// [B, H, n, D] of dtype dt (values in [-1, 1]). Misaligned: token stride D + 5, head stride n * (D + 5) + 7, element
// offset 1 (the general kernel reads such rows element by element). Aligned: every token row 16-byte aligned (token
// stride D, head stride n * D + 8: the caches' windows, which the general kernel reads as 16-byte vectors when 16-bit).
static AttnWindowBuf make_window(int64_t B, int64_t H, int64_t n, int D, XDtype dt, bool aligned) {
  AttnWindowBuf wb;
  const int64_t st = aligned ? D : D + 5, sh = aligned ? n * st + 8 : n * st + 7;
  const int64_t pad = 16 / xsize(dt);  // room to align the first element
  const int64_t total = B * H * sh + pad;
  wb.buf.assign(total * xsize(dt) + 16, 0);
  wb.exact.assign(total, 0.f);
  for (int64_t i = 0; i < total; ++i) store_x(wb.buf.data(), dt, i, frand(), wb.exact[i]);
  const uintptr_t base = reinterpret_cast<uintptr_t>(wb.buf.data());
  wb.off = aligned ? static_cast<int64_t>((16 - base % 16) % 16) / xsize(dt) : 1;
  assert(!aligned || (base + wb.off * xsize(dt)) % 16 == 0);
  wb.w.p = n ? wb.buf.data() + wb.off * xsize(dt) : nullptr;
  wb.w.n = n; wb.w.sb = H * sh; wb.w.sh = sh; wb.w.st = st;
  return wb;
}

void attn_case(const AttnCase& a) {
  const int64_t B = a.B, H_q = a.H_q, H_kv = a.H_kv, T = a.T, S = a.S;
  const int D = a.D, G = a.G;
  const int64_t ntv = a.mk + a.ntk - a.mv, N = S + a.mk + a.ntk;
  assert(ntv >= 0);
  const bool dev = a.dev_lengths;
  const int64_t ex[5] = {dev ? a.extra[0] : 0, dev ? a.extra[1] : 0, dev ? a.extra[2] : 0, dev ? a.extra[3] : 0,
                         dev ? a.extra[4] : 0};
  // windows: aligned in every other case unless the case says (both of the general kernel's window reads)
  static int calls = 0;
  const bool wal = a.windows_aligned < 0 ? (calls++ % 2 == 0) : a.windows_aligned == 1;
  AttnWindowBuf sk = make_window(B, H_kv, S + ex[0], D, a.dt, wal), sv = make_window(B, H_kv, S + ex[0], D, a.dt, wal);
  AttnWindowBuf tk = make_window(B, H_kv, a.ntk + ex[2], D, a.dt, wal);
  AttnWindowBuf tv = make_window(B, H_kv, ntv + ex[4], D, a.dt, wal);
  AttnStoreBuf ks = make_store(B, H_kv, D, G, a.mk, a.kbits, a.kmode, a.klay, a.aligned);
  AttnStoreBuf vs = make_store(B, H_kv, D, G, a.mv, a.vbits, a.vmode, a.vlay, a.aligned);
  if (a.nan_key_token >= 0) {  // a NaN scale (a non-finite group): the rows reading (b 0, h_kv 0) must come out NaN
    AttnStore& st = ks.st;
    const bool rows = st.layout == StoreLayout::kRows;
    const_cast<uint16_t*>(st.scales)[rows ? a.nan_key_token * st.s_sr : a.nan_key_token / G] = 0x7e00;
  }
  const AttnStore ks_used = ks.st, vs_used = vs.st;  // the reference reads the used tokens through these
  // the most tokens the buffers hold (the launch's N with device lengths) and the mask's width
  const int64_t n_cap = S + ex[0] + std::min(a.mk + ex[1] + a.ntk + ex[2], a.mv + ex[3] + ntv + ex[4]);
  const int64_t lengths[5] = {S, a.mk, a.ntk, a.mv, ntv};
  if (dev) {
    junk_window(sk, B, H_kv, S, D, a.dt), junk_window(sv, B, H_kv, S, D, a.dt);
    junk_window(tk, B, H_kv, a.ntk, D, a.dt), junk_window(tv, B, H_kv, ntv, D, a.dt);
    junk_store(ks, B, H_kv, D, G, a.mk, ex[1]), junk_store(vs, B, H_kv, D, G, a.mv, ex[3]);
  }
  const int64_t xs_sh = D + 3;
  Buf<float> xsc(H_kv * xs_sh);
  for (size_t i = 0; i < xsc.n; ++i) xsc.p[i] = 0.5f + std::fabs(frand());
  // queries in xdt (x.p: the values the kernel reads), times q_scale in fp32; output in odt
  static int qcalls = 0;
  static const XDtype xdts[3] = {XDtype::kF32, XDtype::kF16, XDtype::kBF16};
  static const XDtype odts[3] = {XDtype::kF32, XDtype::kBF16, XDtype::kF16};
  const int qk = qcalls++;
  const XDtype xdt = a.xdt >= 0 ? (XDtype)a.xdt : xdts[qk % 3];
  const XDtype odt = a.odt >= 0 ? (XDtype)a.odt : odts[qk / 3 % 3];
  const float q_scale = a.q_scale != 0.f ? a.q_scale : qk % 2 ? 0.0883883476f : 1.f;
  const int64_t x_st = D + 4, x_sh = T * x_st + 4, x_sb = H_q * x_sh + 8;
  Buf<float> x(B * x_sb);
  std::vector<char> xbuf(x.n * xsize(xdt) + 16);
  for (size_t i = 0; i < x.n; ++i) store_x(xbuf.data(), xdt, i, 0.4f * frand(), x.p[i]);
  // mask [1 (broadcast), H_q, T, N or n_cap] with row stride + 2; device lengths: NaN past N
  const int64_t m_st = (dev ? n_cap : N) + 2, m_sh = T * m_st;
  Buf<float> mask(H_q * m_sh);
  for (int64_t h = 0; h < H_q; ++h)
    for (int64_t t = 0; t < T; ++t) {
      float* row = mask.p + h * m_sh + t * m_st;
      const bool all_min = a.mask_kind == 2 && h == H_q - 1 && t == 0;
      const bool late = a.mask_kind == 3 && h == 0 && t == 0;
      for (int64_t j = 0; j < m_st; ++j) {
        const int r = rng() % 4;
        row[j] = all_min ? -std::numeric_limits<float>::max() : r == 0 ? -INFINITY : r == 1 ? -0.5f * std::fabs(frand()) : 0.f;
        if (late && j < a.S + a.mk / 2) row[j] = -INFINITY;
        if (dev && j >= N) row[j] = NAN;
      }
      if (!all_min) row[rng() % N] = 0.f;  // at least one finite score per row
    }
  const size_t n_out = B * H_q * T * D;
  std::vector<char> out(n_out * xsize(odt), (char)0xff);  // NaN in every dtype
  const auto out_at = [&](int64_t i) -> double {
    if (odt == XDtype::kF32) { float f; std::memcpy(&f, out.data() + 4 * i, 4); return f; }
    uint16_t h; std::memcpy(&h, out.data() + 2 * i, 2);
    if (odt == XDtype::kF16) return half_bits_to_float(h);
    const uint32_t w = (uint32_t)h << 16; float f; std::memcpy(&f, &w, 4); return f;
  };

  DecodeAttentionParams p{};
  p.x = xbuf.data(); p.x_dtype = xdt; p.q_scale = q_scale; p.out_dtype = odt;
  p.sink_k = sk.w; p.sink_v = sv.w; p.tail_k = tk.w; p.tail_v = tv.w;
  p.keys = ks.st; p.values = vs.st; p.window_dtype = a.dt;
  p.key_x_scale = a.xscale ? xsc.p : nullptr;
  p.mask = a.mask_kind ? mask.p : nullptr;
  p.out = out.data();
  p.B = B; p.H_q = H_q; p.H_kv = H_kv; p.T = T; p.N = dev ? n_cap : N; p.D = D; p.group_size = G;
  p.lengths = dev ? lengths : nullptr;
  p.split_tokens = a.split_tokens; p.num_sms = a.num_sms;
  p.x_sb = x_sb; p.x_sh = x_sh; p.x_st = x_st; p.xs_sh = xs_sh;
  p.m_sb = 0; p.m_sh = m_sh; p.m_st = m_st;
  p.o_sb = H_q * T * D; p.o_sh = T * D; p.o_st = D;
  const int64_t splits = decode_attention_num_splits(p);
  const int64_t wsf = decode_attention_workspace_floats(p);
  std::unique_ptr<Buf<float>> ws;
  if (wsf > 0) { ws = std::make_unique<Buf<float>>(wsf); p.workspace = ws->p; p.workspace_floats = wsf; }
  const cudaError_t e = launch_decode_attention_fused(p, nullptr);
  res.cases++;
  char tag[256];
  snprintf(tag, sizeof tag, "attn B%ld Hq%ld Hkv%ld T%ld D%d G%d S%ld mk%ld mv%ld nkt%ld k%d%c%c v%d%c%c xs%d dt%d mask%d split%ld sms%d q%d%s o%d%s",
           B, H_q, H_kv, T, D, G, S, a.mk, a.mv, a.ntk, a.kbits, "sah"[(int)a.kmode], "rc"[(int)a.klay], a.vbits,
           "sah"[(int)a.vmode], "rc"[(int)a.vlay], (int)a.xscale, (int)a.dt, a.mask_kind, (long)a.split_tokens, a.num_sms,
           (int)xdt, q_scale != 1.f ? "s" : "", (int)odt, dev ? " dev-lengths" : "");
  if (a.expect != cudaSuccess) {
    long touched = 0;
    for (size_t i = 0; i < n_out; ++i) touched += !std::isnan(out_at(i));
    const bool good = e == a.expect && last_launch_error()[0] != '\0' && touched == 0;
    if (!good) res.fails++;
    printf("%s: refused with \"%s\" : %s\n", tag, last_launch_error(), good ? "ok" : "FAIL");
    return;
  }
  if (e != cudaSuccess) { printf("%s: launch error %d: %s\n", tag, (int)e, last_launch_error()); res.fails++; return; }
  if (a.expect_splits >= 0 && splits != a.expect_splits) {
    printf("%s: %ld splits planned, expected %ld\n", tag, (long)splits, (long)a.expect_splits);
    res.fails++;
    return;
  }
  // reference
  const int64_t gq = H_q / H_kv;
  std::vector<double> K(N * D), V(N * D), sc(N), pr(N);
  int64_t bad = 0;
  double worst = 0;  // largest error / bound
  for (int64_t b = 0; b < B; ++b)
    for (int64_t hk = 0; hk < H_kv; ++hk) {
      for (int64_t j = 0; j < N; ++j)
        for (int c = 0; c < D; ++c) {
          double k, v;
          if (j < S) {
            k = sk.exact[sk.at(b, hk, j, c)];
            v = sv.exact[sv.at(b, hk, j, c)];
          } else {
            const bool tile = a.kivi_tiles && j - S < store_tile_tokens(a.mk, a.mv);
            if (j < S + a.mk) k = store_value(ks_used, G, b, hk, j - S, c, tile) * (a.xscale ? xsc.p[hk * xs_sh + c] : 1.0);
            else k = tk.exact[tk.at(b, hk, j - S - a.mk, c)];
            if (j < S + a.mv) v = store_value(vs_used, G, b, hk, j - S, c, tile);
            else v = tv.exact[tv.at(b, hk, j - S - a.mv, c)];
          }
          K[j * D + c] = k, V[j * D + c] = v;
        }
      for (int64_t hh = 0; hh < gq; ++hh)
        for (int64_t t = 0; t < T; ++t) {
          const int64_t h = hk * gq + hh;
          float xr[256];  // the row times q_scale in fp32, as the kernels read it
          for (int c = 0; c < D; ++c) xr[c] = x.p[b * x_sb + h * x_sh + t * x_st + c] * q_scale;
          double mx = -INFINITY, smag = 0;
          for (int64_t j = 0; j < N; ++j) {
            double s = 0, m = 0;
            for (int c = 0; c < D; ++c) s += xr[c] * K[j * D + c], m += std::fabs(xr[c] * K[j * D + c]);
            smag = std::max(smag, m);
            if (a.mask_kind) s = (double)((float)s + mask.p[h * m_sh + t * m_st + j]);  // added in fp32, as torch
            else if (j > N - T + t) s = -INFINITY;
            sc[j] = s;
            mx = std::max(mx, s);
          }
          double den = 0;
          for (int64_t j = 0; j < N; ++j) den += pr[j] = sc[j] == -INFINITY ? 0.0 : std::exp(sc[j] - mx);
          for (int c = 0; c < D; ++c) {
            double want = 0, mag = 0;
            for (int64_t j = 0; j < N; ++j) want += pr[j] * V[j * D + c], mag += pr[j] * std::fabs(V[j * D + c]);
            want /= den, mag /= den;
            const double got = out_at(b * p.o_sb + h * p.o_sh + t * p.o_st + c);
            // + the output's one rounding to nearest (half an ulp: 2^-11 fp16, 2^-8 bf16, relative)
            const double round_out = odt == XDtype::kF16 ? 0x1p-11 : odt == XDtype::kBF16 ? 0x1p-8 : 0.0;
            const double bound = (4e-6 + 1e-6 * smag) * mag + 1e-7 + round_out * std::fabs(want) * (1 + 1e-6);
            worst = std::max(worst, std::fabs(got - want) / bound);
            if (!(std::fabs(got - want) <= bound) && !(std::isnan(want) && std::isnan(got))) {  // NaN must stay NaN
              if (bad < 3) printf("  mismatch b%ld h%ld t%ld c%d got %.9g want %.9g bound %.3g\n", b, h, t, c, got, want, bound);
              bad++;
            }
          }
        }
    }
  if (bad) res.fails++;
  printf("%s splits%ld : %s (bad %ld, worst error/bound %.3f)\n", tag, (long)splits, bad ? "FAIL" : "ok", bad, worst);
}

void attn_cases() {
  using QM = QuantMode;
  using SL = StoreLayout;
  const XDtype dts[3] = {XDtype::kF16, XDtype::kBF16, XDtype::kF32};
  const QM modes[3] = {QM::kSym, QM::kAsym, QM::kHybrid};
  int i = 0;
  // InnerQ (key rows / value cols): bits 1-4 with K != V, every mode, key_x_scale on/off, S 0/1/5, tails incl. 0,
  // mk != mv both ways, split sizes 32 .. one split, T 1 / 3, GQA 1 / 3, D 64 / 128, G 32 / 64, every window dtype
  for (int kb = 1; kb <= 4; ++kb) {
    AttnCase a;
    a.kbits = kb; a.vbits = 5 - kb; a.kmode = modes[kb % 3]; a.vmode = modes[(kb + 1) % 3];
    a.klay = SL::kRows; a.vlay = SL::kCols; a.xscale = kb != 2; a.dt = dts[kb % 3];
    { static const int64_t v[] = {0, 1, 5, 1}; a.S = v[kb - 1]; }
    a.D = kb % 2 ? 64 : 128; a.G = kb == 4 ? 64 : 32;
    a.mk = kb == 4 ? 128 : 96; a.mv = kb == 4 ? 64 : 64; { static const int64_t v[] = {0, 7, 5, 2}; a.ntk = v[kb - 1]; }
    if (a.ntk + a.mk < a.mv) a.ntk = a.mv - a.mk;
    a.T = kb % 2 ? 3 : 1; a.H_q = kb >= 3 ? 6 : 2; a.H_kv = 2;
    { static const int64_t v[] = {32, 64, 0, 64}; a.split_tokens = v[kb - 1]; }
    a.mask_kind = kb == 3 ? 1 : 0;
    attn_case(a);
  }
  // value store longer than the key store (mv > mk), rows keys with a store tile cut by the tail mid-tile
  { AttnCase a; a.mk = 37; a.mv = 96; a.ntk = 70; a.S = 1; a.kbits = 3; a.vbits = 1; a.kmode = QM::kHybrid;
    a.vmode = QM::kAsym; a.xscale = true; a.split_tokens = 32; a.T = 3; a.H_q = 6; attn_case(a); }
  // KIVI (key cols / value rows, asym): bits, splits, masks
  for (int kb = 1; kb <= 4; ++kb) {
    AttnCase a;
    a.kbits = kb; a.vbits = (kb % 4) + 1; a.kmode = a.vmode = QM::kAsym; a.klay = SL::kCols; a.vlay = SL::kRows;
    a.D = kb <= 2 ? 128 : 64; a.G = kb % 2 ? 32 : 64; a.S = kb == 2 ? 5 : kb == 3 ? 1 : 0;
    a.mk = kb == 1 ? 128 : 64; a.mv = kb == 1 ? 100 : 64 + 3 * kb; a.ntk = kb == 1 ? 0 : 20 + 3 * kb;
    a.T = kb % 2 ? 1 : 3; a.H_q = kb == 3 ? 6 : 2; a.dt = dts[(kb + 1) % 3];
    { static const int64_t v[] = {32, 0, 64, 128}; a.split_tokens = v[kb - 1]; } a.mask_kind = kb == 4 ? 2 : kb == 2 ? 1 : 0;
    attn_case(a);
  }
  // both rows / both cols
  { AttnCase a; a.klay = a.vlay = SL::kRows; a.kmode = QM::kHybrid; a.vmode = QM::kSym; a.kbits = 4; a.vbits = 3;
    a.S = 5; a.mk = 50; a.mv = 80; a.ntk = 33; a.split_tokens = 32; a.T = 3; a.H_q = 2; a.H_kv = 1; a.dt = XDtype::kF32;
    a.xscale = true; attn_case(a); }
  { AttnCase a; a.klay = a.vlay = SL::kCols; a.kmode = QM::kSym; a.vmode = QM::kHybrid; a.kbits = 1; a.vbits = 4;
    a.S = 1; a.mk = 96; a.mv = 32; a.ntk = 9; a.split_tokens = 64; a.T = 1; a.H_q = 6; a.H_kv = 2; a.D = 128;
    a.mask_kind = 1; attn_case(a); }
  // chunk boundaries at every tile offset: split 32 .. 96 over the same cache, and the planned split at 1 / 64 SMs
  for (int64_t sp : {32, 96, 0}) {
    AttnCase a; a.S = 1; a.mk = 160; a.mv = 128; a.ntk = 40; a.kbits = 2; a.vbits = 4; a.kmode = QM::kHybrid;
    a.vmode = QM::kAsym; a.xscale = true; a.split_tokens = sp; a.T = 3; a.H_q = 2; a.H_kv = 1; a.B = 1;
    a.num_sms = sp == 0 ? 64 : 4; a.expect_splits = sp == 32 ? 7 : sp == 96 ? 3 : 1;  // 200 tokens < 2 * 256: one
    attn_case(a);
  }
  { AttnCase a; a.B = 1; a.H_kv = 1; a.H_q = 1; a.S = 0; a.mk = 640; a.mv = 576; a.ntk = 5; a.num_sms = 8;
    a.expect_splits = 3; attn_case(a); }  // planned: 645 tokens, 1 CTA < a wave of 16 -> 256-token splits
  // more than 16 query rows per KV head: two row blocks (GQA 6 x T 3 = 18)
  { AttnCase a; a.H_q = 6; a.H_kv = 1; a.B = 1; a.T = 3; a.mk = 64; a.mv = 32; a.ntk = 4; a.split_tokens = 32;
    a.vbits = 3; a.mask_kind = 1; attn_case(a); }
  // no store at all (window only), and T = N
  { AttnCase a; a.mk = 0; a.mv = 0; a.ntk = 11; a.S = 1; a.T = 3; a.split_tokens = 32; attn_case(a); }
  { AttnCase a; a.mk = 32; a.mv = 0; a.ntk = 0; a.S = 0; a.T = 32; a.H_q = 2; a.H_kv = 2; a.B = 1; attn_case(a); }
  // device lengths (capacity buffers with NaN junk past the used tokens, counts read by the kernel): InnerQ and KIVI
  // layouts, planned and explicit splits (splits past N are empty: their neutral partial must not disturb the merge),
  // a used sink of 0 in a sink buffer of 3, an empty used store, masks, GQA over two row blocks
  { AttnCase a; a.dev_lengths = true; a.S = 1; a.mk = 96; a.mv = 64; a.ntk = 5; a.kbits = 3; a.vbits = 2;
    a.xscale = true; a.split_tokens = 32; a.T = 3; a.H_q = 6; a.mask_kind = 1; attn_case(a); }
  { AttnCase a; a.dev_lengths = true; a.S = 5; a.mk = 64; a.mv = 96; a.ntk = 45; a.kbits = 2; a.vbits = 4;
    a.kmode = a.vmode = QM::kAsym; a.klay = SL::kCols; a.vlay = SL::kRows; a.D = 128; a.G = 32;
    a.extra[2] = 300; a.extra[4] = 250; a.split_tokens = 32; a.dt = XDtype::kBF16; attn_case(a); }
  { AttnCase a; a.dev_lengths = true; a.S = 0; a.mk = 0; a.mv = 0; a.ntk = 9; a.T = 2; a.split_tokens = 0;
    a.num_sms = 64; a.extra[2] = 600; a.extra[4] = 600; a.mask_kind = 2; a.H_q = 4; attn_case(a); }
  { AttnCase a; a.dev_lengths = true; a.B = 1; a.H_kv = 1; a.H_q = 6; a.T = 3; a.S = 2; a.mk = 128; a.mv = 64;
    a.ntk = 7; a.kbits = 4; a.vbits = 1; a.kmode = QM::kHybrid; a.vmode = QM::kAsym; a.G = 64; a.D = 64;
    a.num_sms = 16; a.extra[2] = 400; a.extra[4] = 500; a.dt = XDtype::kF32; attn_case(a); }
  { AttnCase a; a.dev_lengths = true; a.klay = a.vlay = SL::kRows; a.S = 1; a.mk = 50; a.mv = 80; a.ntk = 33;
    a.extra[1] = 17; a.extra[3] = 3; a.split_tokens = 64; a.T = 1; a.xscale = true; attn_case(a); }
  // row blocks of 8 (R = 5 .. 8) and 4 (R <= 4) at both head dims, with masks (the kernel is chosen by R)
  { AttnCase a; a.H_q = 6; a.H_kv = 2; a.T = 2; a.S = 3; a.mk = 96; a.mv = 64; a.ntk = 9; a.mask_kind = 1;
    a.split_tokens = 32; a.kbits = 3; a.xscale = true; attn_case(a); }
  { AttnCase a; a.H_q = 8; a.H_kv = 1; a.B = 1; a.T = 1; a.D = 128; a.mk = 128; a.mv = 96; a.ntk = 40;
    a.kmode = a.vmode = QM::kAsym; a.klay = SL::kCols; a.vlay = SL::kRows; a.mask_kind = 2; attn_case(a); }
  { AttnCase a; a.H_q = 5; a.H_kv = 1; a.B = 1; a.T = 1; a.D = 128; a.S = 1; a.mk = 64; a.mv = 64; a.ntk = 7;
    a.dev_lengths = true; a.split_tokens = 32; a.kmode = QM::kHybrid; attn_case(a); }
  { AttnCase a; a.H_q = 8; a.H_kv = 2; a.T = 1; a.D = 64; a.S = 2; a.mk = 160; a.mv = 128; a.ntk = 3;
    a.split_tokens = 64; a.vbits = 4; a.xscale = true; a.dt = XDtype::kBF16; attn_case(a); }
  { AttnCase a; a.H_q = 3; a.H_kv = 1; a.B = 2; a.T = 1; a.D = 64; a.mk = 64; a.mv = 64; a.ntk = 30;
    a.mask_kind = 1; a.num_sms = 16; attn_case(a); }
  // store tiles (decode_attention_store.cu: tensor-core kernel for [S, S + F), F = min(mk, mv) rounded down to 64, from
  // 256 store tokens, for the InnerQ presets' bits and modes) next to the general kernel's sink / edge / tail split:
  // every preset, head_dim 64 / 128, 4 and 8 rows per CTA (and two row blocks of 8), key groups of 32 / 64 / 128
  // channels, masks, causal T = 3, key_x_scale, device lengths with splits past the used F. The expected split counts
  // are the store tiles' (split_tokens rounded up to 64) plus one; the general kernel alone would plan another number.
  { AttnCase a; a.aligned = true; a.D = 128; a.kbits = a.vbits = 3; a.S = 5; a.mk = 300; a.mv = 288; a.ntk = 20;
    a.H_q = 8; a.H_kv = 2; a.xscale = true; a.split_tokens = 96; a.expect_splits = 3; attn_case(a); }   // innerq_base
  { AttnCase a; a.aligned = true; a.D = 64; a.G = 64; a.kbits = 3; a.vbits = 2; a.S = 3; a.mk = 320; a.mv = 320;
    a.ntk = 7; a.H_q = 6; a.H_kv = 1; a.mask_kind = 1; a.split_tokens = 128; a.expect_splits = 4; attn_case(a); }  // small
  { AttnCase a; a.aligned = true; a.D = 128; a.kbits = 3; a.vbits = 2; a.vmode = QM::kHybrid; a.T = 3; a.H_q = 2;
    a.H_kv = 1; a.S = 0; a.mk = 288; a.mv = 256; a.ntk = 40; a.dev_lengths = true; a.extra[1] = 32; a.extra[2] = 10;
    a.extra[3] = 64; a.extra[4] = 20; a.xscale = true; attn_case(a); }                                   // hybrid
  { AttnCase a; a.D = 128; a.G = 128; a.kbits = a.vbits = 4; a.kmode = a.vmode = QM::kAsym; a.mk = 400; a.mv = 384;
    a.ntk = 10; a.H_q = 12; a.H_kv = 1; a.B = 1; a.mask_kind = 2; a.split_tokens = 256; a.expect_splits = 3;
    a.dt = XDtype::kF32; attn_case(a); }                                                                  // asym4
  { AttnCase a; a.D = 64; a.kbits = a.vbits = 1; a.kmode = a.vmode = QM::kAsym; a.H_q = 4; a.H_kv = 1; a.mk = 512;
    a.mv = 512; a.ntk = 96; a.S = 32; a.dt = XDtype::kBF16; a.xscale = true; attn_case(a); }            // asym1
  // 8 rows at head_dim 64, the per-row pointers (kRowPtrs): asym4 (the keys' loads start at the thread's own word) and
  // asym1, two steps per warp in a split, no mask (the visible-steps loop and its one-FFMA softmax)
  { AttnCase a; a.D = 64; a.G = 64; a.kbits = a.vbits = 4; a.kmode = a.vmode = QM::kAsym; a.H_q = 8; a.H_kv = 1;
    a.S = 1; a.mk = 640; a.mv = 640; a.ntk = 9; a.split_tokens = 320; attn_case(a); }                  // asym4
  { AttnCase a; a.D = 64; a.kbits = a.vbits = 1; a.kmode = a.vmode = QM::kAsym; a.H_q = 6; a.H_kv = 1; a.mk = 576;
    a.mv = 576; a.ntk = 20; a.dt = XDtype::kF32; a.xscale = true; attn_case(a); }                        // asym1
  { AttnCase a; a.aligned = true; a.kbits = a.vbits = 3; a.S = 2; a.mk = 200; a.mv = 192; a.ntk = 9; a.H_q = 8;
    a.H_kv = 2; a.dev_lengths = true; a.extra[0] = 3; a.extra[1] = 64; a.extra[2] = 5; a.extra[3] = 64; a.extra[4] = 7;
    a.split_tokens = 32; a.expect_splits = 7; a.mask_kind = 1; attn_case(a); }
  // ... 4 store-tile splits (1 past F = 192), and the rest's 3: its bound, 64 - 1 + the larger tail capacity (24) = 87
  // tokens, in 32-token splits
  { AttnCase a; a.aligned = true; a.D = 128; a.kbits = a.vbits = 3; a.H_q = 8; a.H_kv = 1; a.B = 1; a.S = 0; a.mk = 256;
    a.mv = 256; a.ntk = 0; a.xscale = true; a.mask_kind = 1; a.num_sms = 2; attn_case(a); }  // 8 rows, empty remainder
  // 8 rows at head_dim 128, several steps per warp: sym keys and values take 64-token steps with P's fragments in
  // shared memory (each step reusing its slots) and the packed score rows (2026-11-29; causal T = 2 with device
  // lengths, and planned splits); hybrid values too since the affine tables (32-token steps until then; a caller's mask)
  { AttnCase a; a.aligned = true; a.D = 128; a.kbits = 3; a.vbits = 2; a.vmode = QM::kHybrid; a.H_q = 8; a.H_kv = 1;
    a.B = 1; a.S = 3; a.mk = 1024; a.mv = 992; a.ntk = 41; a.xscale = true; a.mask_kind = 1; a.num_sms = 2;
    attn_case(a); }                                                                                    // hybrid
  { AttnCase a; a.aligned = true; a.D = 128; a.kbits = a.vbits = 3; a.H_q = 8; a.H_kv = 2; a.T = 2; a.S = 1;
    a.mk = 800; a.mv = 768; a.ntk = 33; a.xscale = true; a.dev_lengths = true; attn_case(a); }         // innerq_base
  { AttnCase a; a.aligned = true; a.D = 128; a.kbits = 3; a.vbits = 2; a.H_q = 8; a.H_kv = 1; a.B = 2; a.S = 0;
    a.mk = 1024; a.mv = 1024; a.ntk = 0; a.split_tokens = 512; a.expect_splits = 3; attn_case(a); }    // small
  { AttnCase a; a.aligned = true; a.D = 128; a.kbits = a.vbits = 3; a.H_q = 6; a.H_kv = 1; a.B = 1; a.S = 2;
    a.mk = 768; a.mv = 768; a.ntk = 17; a.xscale = true; a.split_tokens = 256; attn_case(a); }  // 6 rows in a CTA of 8
  // 64-token steps at head_dim 128 (4 rows): asym and hybrid values (a zero term per 32-token block), G 32 and 64
  { AttnCase a; a.D = 128; a.kbits = a.vbits = 4; a.kmode = a.vmode = QM::kAsym; a.H_q = 4; a.H_kv = 1; a.S = 1;
    a.mk = 392; a.mv = 384; a.ntk = 5; a.split_tokens = 128; a.expect_splits = 4; a.mask_kind = 1; attn_case(a); }
  { AttnCase a; a.aligned = true; a.D = 128; a.G = 64; a.kbits = 3; a.vbits = 2; a.vmode = QM::kHybrid; a.S = 4;
    a.mk = 320; a.mv = 320; a.ntk = 3; a.T = 2; a.H_q = 2; a.H_kv = 1; a.xscale = true; a.dt = XDtype::kBF16;
    attn_case(a); }
  // a key store much longer than the value store: the general kernel's rest (749 tokens past the sink) in splits of
  // its own, ceil(749 / 128) = 6, after the store tiles' 256 / 128 = 2
  { AttnCase a; a.aligned = true; a.kbits = a.vbits = 3; a.S = 3; a.mk = 1000; a.mv = 288; a.ntk = 5; a.H_q = 4;
    a.H_kv = 1; a.split_tokens = 128; a.expect_splits = 8; a.mask_kind = 1; attn_case(a); }
  // The rest in splits of about a group, planned to fill a wave (the general kernel's tiles are latency-bound one after
  // another): the presets' windows (sink 32, 96-token tail), one CTA on 64 SMs: the store tiles' 512 tokens in one
  // split (their minimum is 512), the rest's 96 tokens in 32-token splits: 3 (one 96-token split before 2026-11-28)
  { AttnCase a; a.aligned = true; a.D = 128; a.kbits = a.vbits = 3; a.S = 32; a.mk = 512; a.mv = 512; a.ntk = 96;
    a.H_q = 4; a.H_kv = 1; a.B = 1; a.num_sms = 64; a.expect_splits = 4; attn_case(a);
    // device lengths: the rest planned for 63 + the larger tail capacity (103) = 166 tokens, 6 splits of 32
    a.dev_lengths = true; a.expect_splits = 7; attn_case(a); a.dev_lengths = false;
    // KVKERNELS_ATTENTION_REST_SPLITS=1 (bench/attention_step.py's before): the rest in one split, same answer
    setenv("KVKERNELS_ATTENTION_REST_SPLITS", "1", 1);
    a.expect_splits = 2; attn_case(a);
    a.dev_lengths = true; a.expect_splits = 2; attn_case(a);
    unsetenv("KVKERNELS_ATTENTION_REST_SPLITS"); }
  // device lengths, the key store 712 tokens ahead of the value store (so the value tail holds them): store tiles
  // over F_cap = 320, 1; the rest planned for min(1074, 724 + 63) = 787 tokens, 25 splits of 32; at the counts it is
  // 749 tokens past F = 256, so the last split is empty
  { AttnCase a; a.aligned = true; a.D = 128; a.kbits = a.vbits = 3; a.S = 3; a.mk = 1000; a.mv = 288; a.ntk = 5;
    a.H_q = 4; a.H_kv = 1; a.B = 1; a.num_sms = 64; a.dev_lengths = true; a.mask_kind = 1; a.expect_splits = 26;
    attn_case(a); }
  // KIVI tiles (kivi_tiles_kernel: keys "cols", values "rows", asym, equal widths 1 / 2 / 4): head_dim 64 / 128, 4 and
  // 8 rows per CTA (and two row blocks), key groups of 32 / 64 / 128 tokens, causal T = 3, masks, planned and explicit
  // splits, device lengths, a NaN key group; the store edges and tails in the general kernel
  { AttnCase a; a.kivi_tiles = true; a.aligned = true; a.D = 128; a.kbits = a.vbits = 2; a.kmode = a.vmode = QM::kAsym;
    a.klay = SL::kCols; a.vlay = SL::kRows; a.S = 0; a.mk = 448; a.mv = 470; a.ntk = 60; a.H_q = 8; a.H_kv = 2;
    a.split_tokens = 128; attn_case(a); }                                                                  // kivi2
  { AttnCase a; a.kivi_tiles = true; a.D = 64; a.G = 64; a.kbits = a.vbits = 4; a.kmode = a.vmode = QM::kAsym;
    a.klay = SL::kCols; a.vlay = SL::kRows; a.S = 2; a.mk = 384; a.mv = 400; a.ntk = 30; a.H_q = 6; a.H_kv = 1;
    a.mask_kind = 1; a.dt = XDtype::kBF16; a.num_sms = 16; attn_case(a); }                                // kivi4
  // causal limits inside the tiles' last step (q_len T > 1 and no tails: query row tq sees the store up to its
  // N - T + tq), in a split that starts past 0 (the limits count from the split's first token): InnerQ at 4 and 8 rows,
  // KIVI at 4 rows. T = 2 puts the least limit at step token 62: the step must take the masked loop (InnerQ tiles:
  // steps below every row's limit run without masks), and an off-by-one either way fails.
  { AttnCase a; a.aligned = true; a.kbits = a.vbits = 3; a.T = 2; a.H_q = 4; a.S = 2; a.mk = 320; a.mv = 320;
    a.ntk = 0; a.split_tokens = 128; a.expect_splits = 4; attn_case(a); }
  { AttnCase a; a.aligned = true; a.D = 128; a.kbits = 3; a.vbits = 2; a.vmode = QM::kHybrid; a.H_q = 2; a.H_kv = 1;
    a.T = 4; a.S = 1; a.mk = 384; a.mv = 384; a.ntk = 0; a.xscale = true; a.split_tokens = 128; a.expect_splits = 4; attn_case(a); }
  { AttnCase a; a.kivi_tiles = true; a.kbits = a.vbits = 2; a.kmode = a.vmode = QM::kAsym; a.klay = SL::kCols;
    a.vlay = SL::kRows; a.T = 2; a.H_q = 4; a.S = 0; a.mk = 320; a.mv = 320; a.ntk = 0; a.split_tokens = 128;
    attn_case(a); }
  { AttnCase a; a.kivi_tiles = true; a.D = 128; a.kbits = a.vbits = 1; a.kmode = a.vmode = QM::kAsym;
    a.klay = SL::kCols; a.vlay = SL::kRows; a.S = 5; a.mk = 320; a.mv = 330; a.ntk = 40; a.T = 3; a.H_q = 2;
    a.H_kv = 1; a.split_tokens = 64; attn_case(a); }                                                       // kivi1
  { AttnCase a; a.kivi_tiles = true; a.D = 64; a.kbits = a.vbits = 2; a.kmode = a.vmode = QM::kAsym;
    a.klay = SL::kCols; a.vlay = SL::kRows; a.S = 1; a.mk = 288; a.mv = 300; a.ntk = 20; a.H_q = 8; a.H_kv = 1;
    a.B = 1; a.mask_kind = 2; a.dev_lengths = true; a.extra[1] = 64; a.extra[3] = 40; a.split_tokens = 64;
    attn_case(a); }                                                                                        // 8 rows
  { AttnCase a; a.kivi_tiles = true; a.D = 128; a.kbits = a.vbits = 4; a.kmode = a.vmode = QM::kAsym;
    a.klay = SL::kCols; a.vlay = SL::kRows; a.mk = 256; a.mv = 256; a.ntk = 130; a.T = 2; a.H_q = 6; a.H_kv = 1;
    a.mask_kind = 1; a.xscale = true; attn_case(a); }                                                      // 2 row blocks
  { AttnCase a; a.kivi_tiles = true; a.D = 64; a.kbits = a.vbits = 1; a.kmode = a.vmode = QM::kAsym;
    a.klay = SL::kCols; a.vlay = SL::kRows; a.S = 0; a.mk = 256; a.mv = 300; a.ntk = 50; a.H_q = 6; a.H_kv = 2;
    a.mask_kind = 1; a.split_tokens = 128; attn_case(a); }                                                 // 1 bit, D 64
  { AttnCase a; a.kivi_tiles = true; a.D = 128; a.G = 64; a.kbits = a.vbits = 4; a.kmode = a.vmode = QM::kAsym;
    a.klay = SL::kCols; a.vlay = SL::kRows; a.S = 1; a.mk = 320; a.mv = 330; a.ntk = 20; a.H_q = 2; a.H_kv = 2;
    a.dt = XDtype::kF32; attn_case(a); }                                                                   // 4 bit, 4 rows
  { AttnCase a; a.kivi_tiles = true; a.D = 128; a.G = 128; a.kbits = a.vbits = 2; a.kmode = a.vmode = QM::kAsym;
    a.klay = SL::kCols; a.vlay = SL::kRows; a.S = 2; a.mk = 640; a.mv = 660; a.ntk = 40; a.H_q = 7; a.H_kv = 1;
    a.split_tokens = 512; attn_case(a); }              // one value group per token row; a warp's tables reused
  // a row that sees nothing in a warp's first steps and something in its later ones (mask_kind 3, splits of 8 steps
  // for 4 warps): its p must be 0 in the first, not exp2(-inf - -inf) = NaN, which its running sum would carry (the
  // tiles' softmax subtracts 0 where nothing is seen). KIVI tiles at 8 and 4 rows, the InnerQ tiles at 4 and 8.
  { AttnCase a; a.kivi_tiles = true; a.D = 64; a.kbits = a.vbits = 2; a.kmode = a.vmode = QM::kAsym;
    a.klay = SL::kCols; a.vlay = SL::kRows; a.S = 0; a.mk = 640; a.mv = 640; a.ntk = 6; a.H_q = 8; a.H_kv = 1;
    a.B = 1; a.mask_kind = 3; a.split_tokens = 512; attn_case(a); }
  { AttnCase a; a.kivi_tiles = true; a.D = 128; a.kbits = a.vbits = 4; a.kmode = a.vmode = QM::kAsym;
    a.klay = SL::kCols; a.vlay = SL::kRows; a.S = 2; a.mk = 640; a.mv = 644; a.ntk = 5; a.H_q = 4; a.H_kv = 2;
    a.B = 1; a.mask_kind = 3; a.split_tokens = 512; attn_case(a); }
  { AttnCase a; a.aligned = true; a.D = 128; a.kbits = a.vbits = 3; a.S = 1; a.mk = 640; a.mv = 640; a.ntk = 4;
    a.H_q = 4; a.H_kv = 1; a.B = 1; a.mask_kind = 3; a.split_tokens = 512; attn_case(a); }
  { AttnCase a; a.aligned = true; a.D = 64; a.kbits = 3; a.vbits = 2; a.H_q = 8; a.H_kv = 1; a.S = 0; a.mk = 640;
    a.mv = 640; a.ntk = 3; a.B = 1; a.mask_kind = 3; a.split_tokens = 512; attn_case(a); }
  for (int64_t k : {0, 200}) {  // a NaN key group (channel 0): tokens k .. in the tiles, rows NaN
    AttnCase a; a.kivi_tiles = true; a.D = 64; a.kbits = a.vbits = 2; a.kmode = a.vmode = QM::kAsym;
    a.klay = SL::kCols; a.vlay = SL::kRows; a.mk = 320; a.mv = 320; a.ntk = 4; a.H_q = 4; a.H_kv = 2;
    a.nan_key_token = k; attn_case(a);
  }
  // KVKERNELS_ATTENTION_STORE_TILES=0: the same innerq_base call as the first store-tile case, general kernel only
  // (its own plan: ceil(320 / 96) = 4 splits, not 2 + 1)
  setenv("KVKERNELS_ATTENTION_STORE_TILES", "0", 1);
  { AttnCase a; a.aligned = true; a.D = 128; a.kbits = a.vbits = 3; a.S = 5; a.mk = 300; a.mv = 288; a.ntk = 20;
    a.H_q = 8; a.H_kv = 2; a.xscale = true; a.split_tokens = 96; a.expect_splits = 4; attn_case(a); }
  { AttnCase a; a.D = 128; a.kbits = a.vbits = 2; a.kmode = a.vmode = QM::kAsym; a.klay = SL::kCols;
    a.vlay = SL::kRows; a.mk = 448; a.mv = 470; a.ntk = 60; a.H_q = 8; a.H_kv = 2; a.split_tokens = 128;
    attn_case(a); }  // and the kivi2 one: exact
  unsetenv("KVKERNELS_ATTENTION_STORE_TILES");
  // a NaN key scale in the first step of a split (S = 0: nothing finite seen before it) must make the head's rows NaN,
  // in the store tiles (tokens 0 and 192: warp 0's and warp 3's first step) and in the general kernel alone
  for (int64_t k : {0, 192}) {
    AttnCase a; a.aligned = true; a.D = 128; a.kbits = a.vbits = 3; a.S = 0; a.mk = 320; a.mv = 320; a.ntk = 4;
    a.H_q = 4; a.H_kv = 2; a.nan_key_token = k; a.expect_splits = 2; attn_case(a);
  }
  { AttnCase a; a.S = 0; a.mk = 64; a.mv = 64; a.ntk = 3; a.nan_key_token = 0; a.split_tokens = 32; attn_case(a); }
  // 3-bit keys in padded (8-byte misaligned) rows: the general kernel alone (its plan: ceil(320 / 64) splits)
  { AttnCase a; a.D = 128; a.kbits = a.vbits = 3; a.mk = 300; a.mv = 288; a.ntk = 20; a.H_q = 4; a.H_kv = 1;
    a.split_tokens = 64; a.expect_splits = 5; attn_case(a); }
  // refused: head_dim 96 and 256, split_tokens not a multiple of G
  { AttnCase a; a.D = 96; a.expect = cudaErrorInvalidValue; attn_case(a); }
  { AttnCase a; a.D = 256; a.expect = cudaErrorInvalidValue; attn_case(a); }
  { AttnCase a; a.G = 64; a.split_tokens = 32; a.expect = cudaErrorInvalidValue; attn_case(a); }
  (void)i;
}

// wave_split_len (gemv.cuh), the split planner of the split-K GEMVs and decode_attention_fused, on the shapes its
// comment argues from: (total, unit, min_len, max_len, CTAs per split, resident CTAs, fixed units) -> split length.
void plan_cases() {
  struct PlanCase { int64_t total, unit, min_len, max_len, cols, wave, fixed, want; const char* what; };
  const PlanCase cases[] = {
      // InnerQ values, 3 bits, 128k tokens, batch 1 x 8 KV heads, 2 CTAs x 132 SMs: at the shared-memory bound 103
      // splits = 824 CTAs (3.1 waves, 4 rounds of 10 chunks); 128 splits of 8 chunks take the same 4 rounds
      {131072, 128, 256, 1280, 8, 264, 2, 1024, "innerq values 128k b1"},
      // store tiles at 8k tokens, batch 8 (64 CTAs per split): 4 splits fill one wave; the first run's rule made 5
      // (320 CTAs, 2 waves)
      {8192, 64, 512, 8192, 64, 264, 8, 2048, "store tiles 8k b8"},
      // batch 1: a wave of 33 splits is shorter than the minimum: 16 of 512
      {8192, 64, 512, 8192, 8, 264, 8, 512, "store tiles 8k b1"},
      // under two minimum splits: one split
      {480, 32, 256, 480, 1, 264, 1, 480, "short"},
      // a grid of exactly two waves: splitting it in two takes four rounds of half the work plus the fixed costs
      {4096, 128, 256, 4096, 528, 264, 2, 4096, "two full waves"},
      // 600 CTAs = 2.27 waves run as 3 rounds (102 units); two splits, 1200 CTAs, 5 rounds of half (90)
      {4096, 128, 256, 4096, 600, 264, 2, 2048, "2.27 waves"},
      // the shared-memory bound alone (one CTA per split, a wave of 1): the longest allowed
      {10000, 100, 200, 1000, 1, 1, 0, 1000, "wave of one"},
      // an empty reduction (the GEMVs' plan queries may see L = 0): a length to divide by
      {0, 128, 256, 1280, 8, 264, 2, 1, "empty"},
      // one CTA per split on a wave of 100000: the first candidate is capped at the grid's 65535 splits (58255 of
      // 1152 values), not 100000 splits of 768
      {int64_t{1} << 26, 128, 256, int64_t{1} << 26, 1, 100000, 2, 1152, "grid y limit"},
  };
  for (const PlanCase& c : cases) {
    const int64_t got = kvk::wave_split_len(c.total, c.unit, c.min_len, c.max_len, c.cols, c.wave, c.fixed);
    const bool ok = got == c.want;
    res.cases++;
    if (!ok) res.fails++;
    printf("plan %s: split %ld (want %ld) : %s\n", c.what, (long)got, (long)c.want, ok ? "ok" : "FAIL");
  }
}

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);
  std::string which = argc > 1 ? argv[1] : "all";
  if (which == "iq" || which == "all") {
    for (int bits = 1; bits <= 4; ++bits)
      for (int mode = 0; mode < 3; ++mode)
        inner_q_case(1, 4, 2, 1, false, 37, 256, bits, 32, (QuantMode)mode, (XDtype)(bits % 3), bits & 1, 0, 0, 0, 8, mode == 0 && bits % 2);
    // split-K (values-like), narrowed/misaligned, T chunks
    inner_q_case(1, 8, 2, 3, true, 8, 2048, 3, 64, QuantMode::kAsym, XDtype::kBF16, true, 8, 0, 4, 16, false);
    inner_q_case(1, 8, 2, 3, true, 8, 2048, 3, 64, QuantMode::kAsym, XDtype::kBF16, true, 5, 1, 4, 16, false);
    inner_q_case(2, 4, 4, 1, false, 5, 1056, 2, 32, QuantMode::kHybrid, XDtype::kF16, false, 0, 0, 0, 16, false);
    inner_q_case(1, 32, 2, 20, true, 9, 128, 2, 32, QuantMode::kSym, XDtype::kF32, true, 8, 0, 0, 4, false);
    inner_q_case(1, 4, 1, 3, true, 3, 4032, 1, 96, QuantMode::kHybrid, XDtype::kF16, false, 4, 0, 0, 32, false);
    inner_q_case(1, 2, 1, 2, true, 70, 384, 4, 384, QuantMode::kAsym, XDtype::kF32, false, 0, 0, 0, 8, false);
    inner_q_case(1, 2, 1, 1, true, 3, 8192, 3, 2048, QuantMode::kHybrid, XDtype::kF32, false, 0, 0, 0, 64, false);
    // 1-bit hybrid keys-like tiles (L = 128) at 8 / 64 query rows: the first GPU run failed such shapes of
    // test_inner_q_shapes (b1-keys-D128-M4097-gqa8 at T 1 and 16, M37-gqa4 at T16; 12 and 24 rows passed)
    inner_q_case(1, 8, 1, 1, true, 4097, 128, 1, 64, QuantMode::kHybrid, XDtype::kF16, false, 0, 0, 0, 132, false);
    inner_q_case(1, 4, 1, 16, true, 37, 128, 1, 64, QuantMode::kHybrid, XDtype::kF16, false, 0, 0, 0, 132, false);
    // ... with rows of all-zero weights (that run's data had 58 of 8194): checked against the terms' magnitude
    g_zero_weight_rows = true;
    inner_q_case(1, 8, 1, 1, true, 4097, 128, 1, 64, QuantMode::kHybrid, XDtype::kF16, false, 0, 0, 0, 132, false);
    inner_q_case(1, 4, 1, 16, true, 37, 128, 1, 64, QuantMode::kHybrid, XDtype::kF16, false, 0, 0, 0, 132, false);
    inner_q_case(2, 4, 2, 1, false, 64, 2080, 1, 32, QuantMode::kHybrid, XDtype::kF32, true, 0, 0, 0, 16, false);
    g_zero_weight_rows = false;
    // keys-like, 8 (b, h_kv) at a wave of 8: 8 tiles per warp, one CTA per head (the full-tile loop, then a partial)
    inner_q_case(2, 8, 4, 1, true, 1000, 128, 3, 32, QuantMode::kSym, XDtype::kF16, false, 0, 0, 0, 4, false);
    // the first GPU run's planner (KVKERNELS_GEMV_PLANNER=v1: other splits and CTA sizes, the same results)
    setenv("KVKERNELS_GEMV_PLANNER", "v1", 1);
    inner_q_case(2, 8, 4, 1, true, 1000, 128, 3, 32, QuantMode::kSym, XDtype::kF16, false, 0, 0, 0, 4, false);
    inner_q_case(1, 8, 2, 3, true, 8, 2048, 3, 64, QuantMode::kAsym, XDtype::kBF16, true, 8, 0, 4, 16, false);
    unsetenv("KVKERNELS_GEMV_PLANNER");
    // (b, h_kv) x splits alone span two waves (8 x 4 splits at a wave of 4 SMs x 2): the rows-per-CTA doubling
    // must stop at one CTA per row range (it ran to overflow and SIGFPE: values at batch 8 x 32k tokens on an H200)
    inner_q_case(1, 8, 8, 1, true, 16, 8192, 3, 128, QuantMode::kSym, XDtype::kF16, false, 0, 0, 0, 4, false);
    // 16-byte loads with a 32-bit tail (L not a multiple of the vector chunk, rows 16-byte aligned): split-K with the
    // tail in the last split; L < 2 chunks; a G = 96 group straddling the last chunk and the tail; 1 and 2 bits
    inner_q_case(1, 8, 2, 1, false, 16, 4000, 3, 32, QuantMode::kHybrid, XDtype::kF16, false, 1, 0, 0, 16, false, 1);
    inner_q_case(1, 4, 1, 2, true, 37, 288, 3, 96, QuantMode::kAsym, XDtype::kBF16, true, 1, 0, 0, 8, false, 1);
    inner_q_case(2, 4, 2, 1, false, 21, 160, 2, 32, QuantMode::kSym, XDtype::kF32, true, 2, 0, 0, 8, false, 1);
    inner_q_case(1, 16, 2, 2, true, 9, 160, 1, 32, QuantMode::kHybrid, XDtype::kF16, false, 3, 0, 0, 8, false, 1);
    // keys (L = 128, G = 32): the whole-tile loop, then a partial last tile; many tiles per warp on 1 SM; 8 and 12
    // query rows (two n-tiles; two passes of 8 + 4)
    for (int mode = 0; mode < 3; ++mode) {
      inner_q_case(1, 8, 2, 1, false, 1000, 128, 1 + mode, 32, (QuantMode)mode, XDtype::kF16, false, 0, 0, 0, 1, false, 1);
      inner_q_case(2, 12, 1, 1, false, 77, 128, 4 - mode, 32, (QuantMode)mode, XDtype::kBF16, mode == 1, 0, 0, 0, 8, false);
    }
    inner_q_case(1, 4, 1, 1, false, 512, 128, 3, 32, QuantMode::kHybrid, XDtype::kF32, false, 4, 0, 0, 2, false, 1);
    // no whole chunk (L = 96 < 128 at 3 bits), or rows not 16-byte aligned: 32-bit loads throughout
    inner_q_case(1, 4, 2, 1, false, 33, 96, 3, 32, QuantMode::kSym, XDtype::kF16, false, 1, 0, 0, 8, false, 0);
    inner_q_case(1, 4, 2, 1, false, 33, 1056, 3, 32, QuantMode::kSym, XDtype::kF16, false, 2, 0, 0, 8, false, 0);
    // the cp.async ring (8-byte aligned scale / zero rows, G = 32, 16-byte aligned code rows), every bits x mode:
    // keys (L = 128: the tile stream, many tiles per warp, a partial last tile), values (split L: the chunk stream,
    // rows past M clamped, a len % 128 tail), 8 query rows (two n-tiles); then each requirement missed once
    g_meta_pad = 4;
    for (int bits = 1; bits <= 4; ++bits)
      for (int mode = 0; mode < 3; ++mode) {
        const QuantMode qm = static_cast<QuantMode>(mode);
        inner_q_case(1, 8, 2, 1, false, 300, 128, bits, 32, qm, XDtype::kF16, false, 0, 0, 0, 1, false, 1, 1);
        inner_q_case(2, 4, 1, 1, true, 37, 2080, bits, 32, qm, (XDtype)(mode % 3), mode == 1, (4 - 65 * bits % 4) % 4,
                     0, 0, 16, false, 1, 1);
        inner_q_case(1, 16, 2, 1, true, 24, 1024, bits, 32, qm, XDtype::kBF16, false, 0, 0, 3, 8, false, 1, 1);
      }
    inner_q_case(1, 8, 2, 3, true, 130, 2048, 3, 32, QuantMode::kHybrid, XDtype::kF32, true, 4, 0, 0, 32, false, 1, 1);
    // keys at head_dim 64 (L = 64: the 64-value item, 8-byte code pieces, the zero term folded per block), every
    // bits x mode: many tiles per warp on 1 SM and a partial last tile; 8 query rows over 77 rows at batch 2
    for (int bits = 1; bits <= 4; ++bits)
      for (int mode = 0; mode < 3; ++mode) {
        const QuantMode qm = static_cast<QuantMode>(mode);
        inner_q_case(1, 8, 2, 1, false, 300, 64, bits, 32, qm, (XDtype)(bits % 3), mode == 1, 0, 0, 0, 1, false, 1, 1);
        inner_q_case(2, 8, 1, 1, true, 77, 64, bits, 32, qm, XDtype::kBF16, false, 0, 0, 0, 8, false, 1, 1);
      }
    // ... and rings deeper than at L = 128 (5-12 stages: RingStream's kStages), wrapped several times: 6000 rows on 1 SM
    for (int bits : {1, 3, 4})
      inner_q_case(1, 4, 1, 1, false, 6000, 64, bits, 32, QuantMode::kAsym, XDtype::kF16, true, 0, 0, 0, 1, false, 1, 1);
    // ... two-tile items below 4 bits: a CTA's tile pairs (every warp the same count), then its last full tiles one per
    // item, then a partial tile (565 rows = 35 tiles + 5 on 1 SM: 16 pairs on 8 warps, 3 single tiles, 5 rows); 4 bits
    // one-tile items; KVKERNELS_GEMV_RING64=0 the one-tile items at 3 bits (the benchmark switch)
    for (int bits = 1; bits <= 4; ++bits)
      inner_q_case(1, 8, 2, 1, false, 565, 64, bits, 32, static_cast<QuantMode>(bits % 3), XDtype::kF16, bits == 3, 0,
                   0, 0, 1, false, 1, 1, bits != 4);
    inner_q_case(1, 16, 2, 1, true, 565, 64, 2, 32, QuantMode::kHybrid, XDtype::kBF16, false, 0, 0, 0, 1, false, 1, 1,
                 1);
    // ... 12 query rows (GQA 4 x q_len 3): a pass of 8 rows that stores without checking for rows past the last (modes
    // with zeros), then one of 4 whose other 4 slots the checked stores skip, both through the tile pairs
    for (int bits : {1, 2})
      inner_q_case(1, 4, 1, 3, true, 565, 64, bits, 32, bits == 1 ? QuantMode::kAsym : QuantMode::kHybrid,
                   XDtype::kF16, false, 0, 0, 0, 1, false, 1, 1, 1);
    // ... and the L = 128 key tiles the same way (their one-tile ring items)
    for (int bits : {1, 3})
      inner_q_case(1, 4, 1, 3, true, 300, 128, bits, 32, bits == 1 ? QuantMode::kAsym : QuantMode::kHybrid,
                   XDtype::kBF16, false, 0, 0, 0, 1, false, 1, 1);
    setenv("KVKERNELS_GEMV_RING64", "0", 1);
    inner_q_case(1, 8, 2, 1, false, 565, 64, 3, 32, QuantMode::kSym, XDtype::kF16, true, 0, 0, 0, 1, false, 1, 1, 0);
    unsetenv("KVKERNELS_GEMV_RING64");
    inner_q_case(1, 4, 1, 1, false, 100, 64, 3, 32, QuantMode::kAsym, XDtype::kF16, false, 1, 0, 0, 8, false, 0, 0);
    g_meta_pad = 1;  // L = 64 with scale / zero rows 2-byte aligned only: register loads
    inner_q_case(1, 4, 1, 1, false, 100, 64, 2, 32, QuantMode::kAsym, XDtype::kF16, false, 0, 0, 0, 8, false, 0, 0);
    g_meta_pad = 4;
    setenv("KVKERNELS_GEMV_PLANNER", "v1", 1);
    inner_q_case(1, 8, 2, 3, true, 130, 2048, 2, 32, QuantMode::kAsym, XDtype::kF32, true, 4, 0, 0, 32, false, 1, 1);
    unsetenv("KVKERNELS_GEMV_PLANNER");
    setenv("KVKERNELS_GEMV_RING", "0", 1);  // the benchmark switch: the same store through the register loads
    inner_q_case(1, 8, 2, 3, true, 130, 2048, 3, 32, QuantMode::kHybrid, XDtype::kF32, true, 4, 0, 0, 32, false, 1, 0);
    unsetenv("KVKERNELS_GEMV_RING");
    inner_q_case(1, 4, 1, 1, true, 40, 1024, 3, 64, QuantMode::kSym, XDtype::kF16, false, 0, 0, 0, 8, false, 1, 0);
    inner_q_case(1, 4, 1, 1, true, 40, 1024, 3, 32, QuantMode::kSym, XDtype::kF16, false, 1, 0, 0, 8, false, 0, 0);
    g_meta_pad = 2;  // rows 4-byte aligned only
    inner_q_case(1, 4, 1, 1, true, 40, 1024, 2, 32, QuantMode::kAsym, XDtype::kF16, false, 0, 0, 0, 8, false, 1, 0);
    g_meta_pad = -1;
  }
  if (which == "kivi" || which == "all") {
    for (int bits = 1; bits <= 4; ++bits) kivi_case(1, 4, 2, 1, false, 37, 128, bits, 32, (XDtype)(bits % 3), 0, 0, 8);
    for (int bits = 1; bits <= 4; ++bits) {
      kivi_case(1, 8, 2, 3, true, 600, 128, bits, 32, XDtype::kBF16, 4, 0, 8);   // qt 8? gq*T = 12 -> 8
      kivi_case(1, 8, 2, 3, true, 64, 640, bits, 32, XDtype::kF16, 5, 1, 8);
      kivi_case(1, 4, 2, 1, true, 100, 96, bits, 96, XDtype::kF32, 0, 0, 4);     // qt 2, cw 32
      kivi_case(1, 8, 2, 1, true, 50, 64, bits, 64, XDtype::kF32, 0, 0, 4);       // qt 4, cw 16
    }
    kivi_case(1, 16, 1, 20, true, 40, 64, 3, 32, XDtype::kF32, 2, 0, 4);
    kivi_case(2, 4, 4, 1, false, 3000, 64, 2, 64, XDtype::kF16, 0, 0, 16);
    setenv("KVKERNELS_GEMV_PLANNER", "v1", 1);  // the first GPU run's splits (longer), the same results
    kivi_case(2, 4, 4, 1, false, 3000, 64, 2, 64, XDtype::kF16, 0, 0, 16);
    unsetenv("KVKERNELS_GEMV_PLANNER");
    // the cp.async ring (16-byte code rows, 8-byte scale / zero rows, G = 32), every width: keys (R = head_dim,
    // C = 992 tokens: 7 whole column tiles and a last one of 96 columns whose pieces zero-fill past C; 1 SM, so
    // warps walk many k-steps), values split along R (R % 16 = 8: a partial last k-step through the register
    // path; 8 and 12 query rows), a short store (C = 160 at 4 bits: one tile of 32 columns past the first)
    g_meta_pad = 4;
    for (int bits = 1; bits <= 4; ++bits) {
      const auto cpad = [&](int64_t C) { return static_cast<int>((4 - C * bits / 32 % 4) % 4); };
      kivi_case(1, 8, 2, 1, false, 128, 992, bits, 32, XDtype::kF16, cpad(992), 0, 1, 1);
      kivi_case(2, 8, 2, 1, true, 1000, 128, bits, 32, (XDtype)(bits % 3), cpad(128), 0, 16, 1);
      kivi_case(1, 12, 1, 1, true, 600, 128, bits, 32, XDtype::kBF16, cpad(128), 0, 8, bits != 3);  // 3 x 8: regs
      kivi_case(1, 4, 2, 2, true, 64, 160, bits, 32, XDtype::kF32, cpad(160), 0, 4, 1);
    }
    setenv("KVKERNELS_GEMV_PLANNER", "v1", 1);
    kivi_case(2, 8, 2, 1, true, 1000, 128, 2, 32, XDtype::kF16, 0, 0, 16, 1);
    unsetenv("KVKERNELS_GEMV_PLANNER");
    setenv("KVKERNELS_GEMV_RING", "0", 1);  // the benchmark switch: the same store through the register loads
    kivi_case(2, 8, 2, 1, true, 1000, 128, 2, 32, XDtype::kF16, 0, 0, 16, 0);
    unsetenv("KVKERNELS_GEMV_RING");
    kivi_case(1, 4, 1, 1, true, 100, 256, 2, 64, XDtype::kF16, 0, 0, 8, 0);  // G = 64
    kivi_case(1, 4, 1, 1, true, 100, 256, 2, 32, XDtype::kF16, 1, 0, 8, 0);  // code rows 4-byte aligned
    // 64-column stores (head_dim-64 values, 8 columns per lane): the ring's items are two k-steps of 8-byte code
    // pieces and 4-byte scale / zero pieces. Split R over 16 SMs with a partial last k-step; 1 SM and R = 693 (43
    // whole k-steps over 8 row lanes: warps with an odd count take their last whole one through the registers);
    // 12 query rows (two passes); code rows padded by 2 words
    for (int bits = 1; bits <= 4; ++bits) {
      kivi_case(2, 8, 2, 1, true, 1000, 64, bits, 32, (XDtype)(bits % 3), 0, 0, 16, 1);
      kivi_case(1, 4, 1, 1, false, 693, 64, bits, 32, XDtype::kF16, 2, 0, 1, 1);
      kivi_case(1, 12, 1, 1, true, 600, 64, bits, 32, XDtype::kBF16, 0, 0, 8, 1);
    }
    kivi_case(1, 4, 2, 3, true, 264, 64, 2, 32, XDtype::kF32, 0, 0, 8, 1);  // one item per warp, a partial k-step
    setenv("KVKERNELS_GEMV_RING", "0", 1);
    kivi_case(1, 4, 1, 1, true, 100, 64, 2, 32, XDtype::kF16, 0, 0, 8, 0);
    unsetenv("KVKERNELS_GEMV_RING");
    kivi_case(1, 4, 1, 1, true, 100, 64, 2, 32, XDtype::kF16, 1, 0, 8, 0);  // code rows 4-byte aligned
    g_meta_pad = 2;  // scale / zero rows 4-byte aligned only: enough at 64 columns, not at 128
    kivi_case(1, 4, 1, 1, true, 100, 256, 2, 32, XDtype::kF16, 0, 0, 8, 0);
    kivi_case(1, 4, 1, 1, true, 100, 64, 2, 32, XDtype::kF16, 0, 0, 8, 1);
    g_meta_pad = -1;
  }
  if (which == "q" || which == "all") {
    for (int bits = 1; bits <= 4; ++bits)
      for (int mode = 0; mode < 3; ++mode)
        quant_case(2, 3, 4, 128, bits, bits == 3 ? 64 : 32, (QuantMode)mode, 0.f, (XDtype)(mode));
    quant_case(1, 2, 3, 256, 1, 256, QuantMode::kAsym, 0.25f, XDtype::kF16);
    quant_case(1, 1, 2, 2048, 3, 1024, QuantMode::kHybrid, 0.f, XDtype::kBF16);
    // empty asym / hybrid dequantize: torch hands an empty zeros tensor over as a null pointer, which is no error
    // when there is nothing to read (it was one: the first GPU run's test_quantize_dequantize_empty[asym-cuda])
    for (int64_t rows : {0, 3}) {
      DequantizeParams dp{};
      dp.rows = rows; dp.L = rows ? 0 : 64; dp.bits = 3; dp.group_size = 32; dp.mode = QuantMode::kHybrid;
      const cudaError_t e = launch_dequantize_groups(dp, nullptr);
      res.cases++;
      if (e != cudaSuccess) { printf("empty dequantize rows %ld: error %s\n", (long)rows, last_launch_error()); res.fails++; }
    }
  }
  if (which == "decode" || which == "all") decode_cases();
  if (which == "append" || which == "all") append_cases();
  if (which == "attn" || which == "all") attn_cases(), plan_cases();
  if (which == "lattice" || which == "all") {
    using LG = LatticeGrid;
    lattice_index_cases();
    // every grid, keys and values: head_dim 128, G 64, GQA 4, odd N, a 3-D query; signs on every other grid
    for (int gk = 0; gk < 4; ++gk)
      for (bool v : {false, true})
        lattice_case(v, 1, 8, 2, 1, false, 301, 128, 64, (LG)gk, (XDtype)(gk % 3), gk % 2, 0, 0, 0, 8);
    // head_dim 64 and 256, G from 32 to D, T > 1 (8 and 12 query rows: one and two passes), strided views
    lattice_case(false, 2, 4, 2, 3, true, 77, 64, 32, LG::kE2_64, XDtype::kBF16, true, 3, 1, 2, 8);
    lattice_case(true, 2, 4, 2, 3, true, 77, 64, 64, LG::kE2_16, XDtype::kF16, true, 3, 1, 2, 8);
    lattice_case(false, 1, 2, 1, 4, true, 130, 256, 32, LG::kE4_256, XDtype::kF32, false, 5, 0, 1, 8);
    lattice_case(true, 1, 2, 1, 4, true, 130, 256, 256, LG::kE2_256, XDtype::kF32, true, 5, 0, 1, 8);
    lattice_case(false, 1, 4, 4, 1, true, 50, 256, 256, LG::kE2_64, XDtype::kF16, true, 0, 0, 0, 8);
    lattice_case(true, 1, 4, 4, 1, true, 50, 256, 32, LG::kE4_256, XDtype::kBF16, false, 0, 0, 0, 8);
    lattice_case(false, 1, 8, 1, 2, true, 40, 64, 64, LG::kE2_256, XDtype::kF32, false, 1, 0, 0, 8);
    lattice_case(true, 1, 8, 1, 2, true, 40, 64, 32, LG::kE2_64, XDtype::kF32, true, 1, 0, 0, 8);
    // keys: many tiles per warp (1 SM), a partial last tile, 16 query rows (GQA 16: two passes)
    lattice_case(false, 1, 16, 1, 1, false, 1000, 128, 128, LG::kE2_16, XDtype::kF16, true, 2, 0, 1, 1);
    // values split-K (workspace + finish kernel; G < D and G = D), and splits forced by shared memory at 8 query rows
    lattice_case(true, 1, 8, 2, 1, false, 2100, 128, 64, LG::kE2_64, XDtype::kF16, true, 0, 0, 0, 8);
    lattice_case(true, 2, 4, 1, 1, false, 1500, 128, 128, LG::kE2_16, XDtype::kF32, true, 2, 1, 1, 8);  // G = D
    lattice_case(true, 1, 16, 2, 1, false, 1300, 64, 32, LG::kE4_256, XDtype::kBF16, false, 1, 1, 1, 64);
    // T > 16: launcher T chunks (20 = 16 + 4 rows per head); GQA 1
    lattice_case(false, 1, 2, 2, 20, true, 33, 128, 32, LG::kE2_256, XDtype::kF32, true, 0, 0, 0, 8);
    lattice_case(true, 1, 2, 2, 20, true, 33, 128, 128, LG::kE2_16, XDtype::kF32, false, 0, 0, 0, 8);
    // keys through the cp.async ring (a cache's layout): every grid at head_dim 64 and 128, G = D (one norm per token,
    // two tokens per 4-byte piece) and G < D, 4 and 8 query rows, a partial last tile; on 1 SM the warps stream up to 8
    // tiles each, wrapping rings of 3-6 stages. Padded rows (cpad, rpad) stay on the ring; the register loads take a
    // misaligned view, head_dim 256, and KVKERNELS_GEMV_RING=0.
    for (int gk = 0; gk < 4; ++gk) {
      const int cp = (LG)gk == LG::kE2_64 ? 2 : 4;
      lattice_case(false, 1, 4, 1, 1, false, 4100, 64, 64, (LG)gk, XDtype::kF16, gk % 2, 0, -1, 0, 1, 1);
      lattice_case(false, 2, 8, 2, 1, false, 2077, 64, 32, (LG)gk, XDtype::kBF16, true, cp, -1, 2, 1, 1);
      lattice_case(false, 1, 8, 2, 1, false, 4100, 128, 128, (LG)gk, XDtype::kF32, gk % 2 == 0, 0, -1, 0, 1, 1);
      lattice_case(false, 1, 16, 2, 2, true, 1500, 128, 32, (LG)gk, XDtype::kF16, true, 4, -1, 2, 1, 1);
    }
    lattice_case(false, 1, 4, 1, 1, false, 300, 64, 64, LG::kE2_16, XDtype::kF16, true, 1, -1, 0, 1, 0);   // 4-byte rows
    lattice_case(false, 1, 4, 1, 1, false, 300, 128, 128, LG::kE2_16, XDtype::kF16, true, 0, -1, 1, 1, 0);  // r_sn 2
    lattice_case(false, 1, 4, 1, 1, false, 300, 256, 64, LG::kE2_16, XDtype::kF16, true, 0, -1, 0, 1, 0);   // D 256
    // values: value_unroll's batches of 2 or 4 k-steps per warp, the whole k-steps left one at a time, a partial one
    // (1623 tokens = 12 full batches of 4 x 8 row lanes + 5 k-steps + 7 tokens), 64 and 128 channels per warp
    for (int gk = 0; gk < 4; ++gk) {
      lattice_case(true, 1, 4, 1, 1, false, 1623, 64, 32, (LG)gk, XDtype::kF16, gk % 2, 0, -1, 0, 1);
      lattice_case(true, 1, 8, 1, 1, false, 1623, 128, 128, (LG)gk, XDtype::kBF16, true, 0, 0, 0, 1);
    }
    setenv("KVKERNELS_GEMV_RING", "0", 1);
    lattice_case(false, 1, 4, 1, 1, false, 300, 128, 64, LG::kE2_64, XDtype::kF16, true, 0, -1, 0, 1, 0);
    unsetenv("KVKERNELS_GEMV_RING");
  }
  if (which == "aqua" || which == "all") {
    using LG = LatticeGrid;
    // every grid x dtype: T 37 (a partial token tile), C 192 (a full and a half-empty 128-channel tile), K tails
    // (C_in 48 = 32 + 16), prev2 on every other case, signs on the others; fp16 / bf16 at 8 SMs (32-token tiles)
    for (int gk = 0; gk < 4; ++gk)
      aqua_case(37, 48, gk % 2 ? 16 : -1, 192, 64, (LG)gk, gk < 2 ? XDtype::kF16 : XDtype::kBF16, gk % 2 == 0, 8);
    // T 1; C_in 16 (one k16 step, half a tile); G 32 (four groups per tile) and 128 (one); prev2 of 48
    aqua_case(1, 16, -1, 128, 32, LG::kE2_64, XDtype::kBF16, true, 8);
    aqua_case(1, 16, 48, 128, 128, LG::kE4_256, XDtype::kF16, false, 8);
    // 64-token tiles (1 SM): T 70 = 64 + 6, three pipeline stages deep (C_in 96), G 128 with signs, C 256
    aqua_case(70, 96, 32, 256, 128, LG::kE2_16, XDtype::kF16, true, 1);
    aqua_case(70, 24, -1, 256, 32, LG::kE2_256, XDtype::kBF16, false, 1);  // C_in 24: a partial 16-byte chunk
    // the steady-state loop (full tiles only) then the K tail: C_in 136 = 4 x 32 + 8
    aqua_case(40, 136, -1, 128, 64, LG::kE2_64, XDtype::kBF16, true, 8);
    // C_in 0: bias + residual only; C 96 (G 32: three of the tile's four groups)
    aqua_case(5, 0, -1, 96, 32, LG::kE2_16, XDtype::kF16, true, 8);
    // fp32 operands (the SIMT path): prev2, signs, T past one 64-token tile, C_in not a multiple of its 16
    aqua_case(37, 48, 16, 192, 64, LG::kE2_64, XDtype::kF32, true, 8, 3);
    aqua_case(66, 20, -1, 128, 128, LG::kE4_256, XDtype::kF32, false, 8, 1);
    // refused: rows not 16-byte aligned (fp16 row stride 20 + 1), G 256; T 0 is a no-op
    aqua_case(5, 20, -1, 128, 64, LG::kE2_16, XDtype::kF16, false, 8, 1, cudaErrorInvalidValue);
    aqua_case(5, 16, -1, 256, 256, LG::kE2_16, XDtype::kF16, false, 8, 8, cudaErrorInvalidValue);
    aqua_case(0, 16, -1, 128, 64, LG::kE2_16, XDtype::kBF16, false, 8);
  }
  if (which == "tests") {
    int sms = argc > 2 ? atoi(argv[2]) : 132;
    struct S { int64_t B, Hq, Hkv, M, L; };
    S iq[] = {{1,8,8,1,64},{1,16,4,37,128},{2,8,1,1031,256},{1,16,2,4097,128},{1,4,1,64,32},{2,4,4,128,1056},{1,8,1,256,4096},{1,8,2,128,20000}};
    if (getenv("SKIP_IQ") == nullptr) for (auto s : iq) for (int T : {0, 3, 16}) for (int bits : {1, 3, 4}) {
      if (s.L > 10000 && T == 16) continue;
      if (T == 16 && bits != 3) continue;
      int G = s.L % 64 ? 32 : 64;
      inner_q_case(s.B, s.Hq, s.Hkv, T ? T : 1, T != 0, s.M, s.L, bits, G, QuantMode::kHybrid, XDtype::kF16, false, (bits==3)?8:0, 0, 0, sms, false);
    }
    S kv[] = {{1,8,8,1,64},{2,16,4,1031,128},{1,8,1,20000,256},{1,4,1,64,32},{1,16,2,128,4128},{2,4,4,256,1024}};
    for (auto s : kv) for (int T : {0, 3, 16}) for (int bits : {1, 2, 3, 4}) {
      if (s.M > 10000 && T == 16) continue;
      if (T == 16 && bits != 3) continue;
      int G = s.L % 64 ? 32 : 64;
      kivi_case(s.B, s.Hq, s.Hkv, T ? T : 1, T != 0, s.M, s.L, bits, G, XDtype::kF16, bits==2?8:0, 0, sms);
    }
  }
  printf("cases %ld fails %ld shuffles_after_exit %ld bad_mask %ld bad_async_copies %ld prefetches %ld\n", res.cases,
         res.fails, kvk_emu::shuffles_after_exit.load(), kvk_emu::bad_mask.load(), kvk_emu::bad_async_copies.load(),
         kvk_emu::prefetches.load());
  return res.fails != 0 || kvk_emu::bad_async_copies.load() != 0;
}
