// CPU kernels of the lattice (HIGGS-style) ops: fwht, lattice_quantize, lattice_dequantize, gemv_lattice_k,
// gemv_lattice_v. Bit-identical to kvkernels/reference/lattice.py, which stays the spec and is what these replace
// on the CPU for speed (the reference issues ~100 small PyTorch ops per call: 1.3 ms to quantize one token of 3 KV
// heads, `make demo` and `make eval` do it twice per layer and decode step).
//
// How they stay bit-identical: every step whose rounding the spec fixes (the butterflies in their order, the
// ordered d-term dots and the first-maximum argmax, the products by norms and signs) is a plain fp32 loop here; every
// step the reference leaves to PyTorch (the norm's sum of squares, the GEMVs' matmuls) calls the same ATen op on
// tensors of the same shapes and strides. tests/test_lattice.py checks torch.equal against the reference. Built
// with -ffp-contract=off (setup.py): a fused multiply-add would round the dots differently.
//
// These are registered in the private namespace kvkernels_cpu, not as the public ops' CPU kernels: the public ops'
// CPU kernels are kvkernels/ops.py's Python ones, which run the argument checks of kvkernels/_validate.py (the
// messages users see) and then call these. The checks here only keep a direct call memory-safe.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "kvkernels/lattice.cuh"

namespace kvk_lattice_cpu {

constexpr int64_t kBlock = 32;  // values per packing block

struct Grid {
  kvk::LatticeGrid kind;
  int d, n, index_bits, bits;
  std::vector<float> points;  // [n * d]
};

Grid grid_of(const at::Tensor& grid, const char* op) {
  TORCH_CHECK(grid.dim() == 2 && grid.scalar_type() == at::kFloat, "kvkernels_cpu.", op, ": grid must be fp32 [n, d]");
  const int kind = kvk::lattice_grid_of(grid.size(1), grid.size(0));
  TORCH_CHECK(kind >= 0, "kvkernels_cpu.", op, ": no lattice grid of shape ", grid.sizes());
  Grid g;
  g.kind = static_cast<kvk::LatticeGrid>(kind);
  g.d = kvk::lattice_d(g.kind);
  g.n = kvk::lattice_n(g.kind);
  g.index_bits = kvk::lattice_index_bits(g.kind);
  g.bits = kvk::lattice_bits(g.kind);
  const at::Tensor c = grid.contiguous();
  g.points.assign(c.data_ptr<float>(), c.data_ptr<float>() + g.n * g.d);
  return g;
}

void check_group_size(int64_t G, int64_t length, const char* op) {
  TORCH_CHECK(G >= 32 && G <= 1024 && (G & (G - 1)) == 0 && length % G == 0, "kvkernels_cpu.", op,
              ": group_size must be a power of two in [32, 1024] dividing ", length, ", got ", G);
}

// The signs as fp32 (the reference multiplies by signs.to(float32)), or empty for none.
std::vector<float> signs_of(const std::optional<at::Tensor>& signs, int64_t G, const char* op) {
  if (!signs.has_value()) return {};
  TORCH_CHECK(signs->scalar_type() == at::kChar && signs->numel() == G, "kvkernels_cpu.", op,
              ": signs must be int8 [group_size]");
  const at::Tensor s = signs->to(at::kFloat).contiguous();
  return std::vector<float>(s.data_ptr<float>(), s.data_ptr<float>() + G);
}

// fp32 nearest to 1 / sqrt(G), as the reference's _inv_sqrt
float inv_sqrt(int64_t G) { return static_cast<float>(1.0 / std::sqrt(static_cast<double>(G))); }

// The reference's fwht on one group in place: forward y = H_n (s * v), inverse v = s * (H_n y), H_n = H / sqrt(G).
void rotate(float* v, int G, const std::vector<float>& s, float scale, bool inverse) {
  if (!s.empty() && !inverse)
    for (int i = 0; i < G; ++i) v[i] = v[i] * s[i];
  kvk::fwht_host(v, G, scale);
  if (!s.empty() && inverse)
    for (int i = 0; i < G; ++i) v[i] = v[i] * s[i];
}

// sum_k a[k] * b[k], k = 0 .. d - 1 left to right, each product rounded: the reference's _dot_in_order
float dot_in_order(const float* a, const float* b, int d) {
  float total = a[0] * b[0];
  for (int k = 1; k < d; ++k) total = total + a[k] * b[k];
  return total;
}

// The fp32 grid points the int32 codes [rows, W] name, into out [rows, W * 32 / bits] (still rotated, unscaled).
void grid_values(const int32_t* codes, int64_t rows, int64_t W, const Grid& g, float* out) {
  const int64_t blocks_per_row = W / g.bits, per_block = kBlock / g.d;
  at::parallel_for(0, rows * blocks_per_row, 256, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const uint32_t* blk = reinterpret_cast<const uint32_t*>(codes) + b * g.bits;
      float* dst = out + b * kBlock;
      for (int j = 0; j < per_block; ++j) {
        const float* p = g.points.data() + kvk::lattice_index(blk, j, g.kind) * g.d;
        for (int k = 0; k < g.d; ++k) dst[j * g.d + k] = p[k];
      }
    }
  });
}

at::Tensor fwht(const at::Tensor& x, int64_t group_size, const std::optional<at::Tensor>& signs, bool inverse) {
  const char* op = "fwht";
  TORCH_CHECK(x.dim() >= 1, "kvkernels_cpu.", op, ": x must have at least one dim");
  check_group_size(group_size, x.size(-1), op);
  const std::vector<float> s = signs_of(signs, group_size, op);
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  out.copy_(x);  // a contiguous fp32 copy (half -> float is exact, as the reference's x.to(float32))
  float* v = out.data_ptr<float>();
  const int G = static_cast<int>(group_size);
  const float scale = inv_sqrt(G);
  at::parallel_for(0, out.numel() / G, 16, [&](int64_t begin, int64_t end) {
    for (int64_t grp = begin; grp < end; ++grp) rotate(v + grp * G, G, s, scale, inverse);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> lattice_quantize(const at::Tensor& x, const at::Tensor& grid, int64_t group_size,
                                                    const std::optional<at::Tensor>& signs) {
  const char* op = "lattice_quantize";
  TORCH_CHECK(x.dim() >= 1, "kvkernels_cpu.", op, ": x must have at least one dim");
  const Grid g = grid_of(grid, op);
  const int64_t C = x.size(-1), G = group_size;
  check_group_size(G, C, op);
  const std::vector<float> s = signs_of(signs, G, op);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t groups = xf.numel() / G;
  // the RMS from the unrotated x, by the reference's ATen ops (its sum's order is ATen's)
  const at::Tensor r = (xf.view({groups, G}).square().sum(-1).sqrt() * static_cast<double>(inv_sqrt(G))).contiguous();
  auto code_sizes = x.sizes().vec();
  code_sizes.back() = C / kBlock * g.bits;
  auto norm_sizes = x.sizes().vec();
  norm_sizes.back() = C / G;
  at::Tensor codes = at::empty(code_sizes, x.options().dtype(at::kInt));
  const float* src = xf.data_ptr<float>();
  const float* rp = r.data_ptr<float>();
  uint32_t* dst = reinterpret_cast<uint32_t*>(codes.data_ptr<int32_t>());
  std::vector<float> sq(g.n);  // |grid[c]|^2
  for (int c = 0; c < g.n; ++c) sq[c] = dot_in_order(g.points.data() + c * g.d, g.points.data() + c * g.d, g.d);
  const float scale = inv_sqrt(G);
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> u(G);
    std::vector<uint32_t> idx(kBlock / g.d);
    for (int64_t grp = begin; grp < end; ++grp) {
      std::copy(src + grp * G, src + (grp + 1) * G, u.begin());
      rotate(u.data(), static_cast<int>(G), s, scale, false);
      const float rr = rp[grp];
      for (int64_t i = 0; i < G; ++i) u[i] = rr == 0.0f ? 0.0f : u[i] / rr;  // a NaN r keeps u NaN: index 0
      for (int64_t blk = 0; blk < G / kBlock; ++blk) {
        for (int j = 0; j < kBlock / g.d; ++j) {
          const float* uj = u.data() + blk * kBlock + j * g.d;
          float best = -std::numeric_limits<float>::infinity();
          uint32_t best_c = 0;
          for (int c = 0; c < g.n; ++c) {  // argmax of 2 <u_j, grid[c]> - |grid[c]|^2, first maximum, NaN never wins
            const float score = 2.0f * dot_in_order(uj, g.points.data() + c * g.d, g.d) - sq[c];
            if (score > best) {
              best = score;
              best_c = static_cast<uint32_t>(c);
            }
          }
          idx[j] = best_c;
        }
        kvk::lattice_pack_block(idx.data(), dst + (grp * (G / kBlock) + blk) * g.bits, g.kind);
      }
    }
  });
  return {codes, r.to(at::kHalf).view(norm_sizes)};
}

// codes [..., W] as a contiguous int32 matrix, its grid points fp32 [..., W * 32 / bits]
at::Tensor points_of(const at::Tensor& codes, const Grid& g, const char* op) {
  TORCH_CHECK(codes.scalar_type() == at::kInt && codes.dim() >= 1 && codes.size(-1) % g.bits == 0, "kvkernels_cpu.",
              op, ": codes must be int32 [..., a multiple of bits]");
  const at::Tensor c = codes.contiguous();
  auto sizes = c.sizes().vec();
  const int64_t W = sizes.back();
  sizes.back() = W / g.bits * kBlock;
  at::Tensor points = at::empty(sizes, c.options().dtype(at::kFloat));
  grid_values(c.data_ptr<int32_t>(), W ? c.numel() / W : 0, W, g, points.data_ptr<float>());
  return points;
}

// r16 * grid[c] for every value of codes [..., W], one norm per group of G values: fp32 [..., W * 32 / bits],
// still rotated (what lattice_dequantize and gemv_lattice_v transform back)
at::Tensor scaled_points(const at::Tensor& codes, const at::Tensor& norms, const Grid& g, int64_t G, const char* op) {
  at::Tensor v = points_of(codes, g, op);
  check_group_size(G, v.size(-1), op);
  const int64_t groups = v.numel() / G;
  TORCH_CHECK(norms.numel() == groups, "kvkernels_cpu.", op, ": norms must be one value per group of codes");
  const at::Tensor nf = norms.to(at::kFloat).contiguous();
  const float* np = nf.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  at::parallel_for(0, groups, 64, [&](int64_t begin, int64_t end) {
    for (int64_t grp = begin; grp < end; ++grp)
      for (int64_t i = 0; i < G; ++i) vp[grp * G + i] = vp[grp * G + i] * np[grp];
  });
  return v;
}

at::Tensor lattice_dequantize(const at::Tensor& codes, const at::Tensor& norms, const at::Tensor& grid,
                              int64_t group_size, const std::optional<at::Tensor>& signs) {
  const char* op = "lattice_dequantize";
  at::Tensor out = scaled_points(codes, norms, grid_of(grid, op), group_size, op);
  const std::vector<float> s = signs_of(signs, group_size, op);
  float* v = out.data_ptr<float>();
  const int G = static_cast<int>(group_size);
  const float scale = inv_sqrt(G);
  at::parallel_for(0, out.numel() / G, 16, [&](int64_t begin, int64_t end) {
    for (int64_t grp = begin; grp < end; ++grp) rotate(v + grp * G, G, s, scale, true);
  });
  return out;
}

// A GEMV's activations x [B, H_q, (T,) L] as 4-D, whether T was given, and the grid.
struct GemvInput {
  at::Tensor x4;
  bool has_t;
  Grid g;
};

GemvInput gemv_input(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& norms, const at::Tensor& grid,
                     const char* op) {
  TORCH_CHECK((x.dim() == 3 || x.dim() == 4) && codes.dim() == 4 && norms.dim() == 4 &&
                  x.size(0) == codes.size(0) && codes.size(1) > 0 && x.size(1) % codes.size(1) == 0,
              "kvkernels_cpu.", op, ": bad shapes");
  const bool has_t = x.dim() == 4;
  return {has_t ? x : x.unsqueeze(2), has_t, grid_of(grid, op)};
}

at::Tensor gemv_lattice_k(const at::Tensor& q, const at::Tensor& codes, const at::Tensor& norms,
                          const at::Tensor& grid, int64_t group_size, const std::optional<at::Tensor>& signs) {
  const char* op = "gemv_lattice_k";
  const auto [q4, has_t, g] = gemv_input(q, codes, norms, grid, op);
  const int64_t B = q4.size(0), H_q = q4.size(1), T = q4.size(2), D = q4.size(3);
  const int64_t H_kv = codes.size(1), N = codes.size(2), G = group_size, groups = D / G;
  check_group_size(G, D, op);
  TORCH_CHECK(codes.size(3) == D / kBlock * g.bits && norms.sizes() == at::IntArrayRef({B, H_kv, N, groups}),
              "kvkernels_cpu.", op, ": codes / norms do not match q");
  const at::Tensor q_rot = fwht(q4, G, signs, false);  // [B, H_q, T, D] contiguous, as the reference's
  const at::Tensor points = points_of(codes, g, op);   // [B, H_kv, N, D]
  // the reference's ATen ops, on the same shapes and strides
  const int64_t rows = H_q / H_kv * T;
  const at::Tensor q_g = q_rot.reshape({B, H_kv, rows, groups, G}).transpose(2, 3);
  const at::Tensor k_g = points.reshape({B, H_kv, N, groups, G}).permute({0, 1, 3, 4, 2});
  const at::Tensor r16 = norms.to(at::kFloat).permute({0, 1, 3, 2}).unsqueeze(3);
  at::Tensor scores = (at::matmul(q_g, k_g) * r16).sum(2).reshape({B, H_q, T, N});
  return (has_t ? scores : scores.squeeze(2)).contiguous();
}

at::Tensor gemv_lattice_v(const at::Tensor& p, const at::Tensor& codes, const at::Tensor& norms,
                          const at::Tensor& grid, int64_t group_size, const std::optional<at::Tensor>& signs) {
  const char* op = "gemv_lattice_v";
  const auto [p4, has_t, g] = gemv_input(p, codes, norms, grid, op);
  const int64_t B = p4.size(0), H_q = p4.size(1), T = p4.size(2), N = p4.size(3);
  const int64_t H_kv = codes.size(1), G = group_size;
  const int64_t D = codes.size(3) / g.bits * kBlock;
  check_group_size(G, D, op);
  TORCH_CHECK(codes.size(2) == N && norms.sizes() == at::IntArrayRef({B, H_kv, N, D / G}),
              "kvkernels_cpu.", op, ": norms must be [B, H_kv, N, D / G] with codes [B, H_kv, N, D * bits / 32]");
  const at::Tensor scaled = scaled_points(codes, norms, g, G, op);  // [B, H_kv, N, D]
  const at::Tensor pg = p4.to(at::kFloat).reshape({B, H_kv, H_q / H_kv * T, N});
  const at::Tensor acc = at::matmul(pg, scaled);  // [B, H_kv, H_q / H_kv * T, D], still rotated
  at::Tensor out = fwht(acc.reshape({B, H_q, T, D}), G, signs, true);
  return has_t ? out : out.squeeze(2).contiguous();
}

}  // namespace kvk_lattice_cpu

TORCH_LIBRARY(kvkernels_cpu, m) {
  m.def("fwht(Tensor x, int group_size, Tensor? signs=None, bool inverse=False) -> Tensor");
  m.def("lattice_quantize(Tensor x, Tensor grid, int group_size, Tensor? signs=None) -> (Tensor, Tensor)");
  m.def("lattice_dequantize(Tensor codes, Tensor norms, Tensor grid, int group_size, Tensor? signs=None) -> Tensor");
  m.def("gemv_lattice_k(Tensor q, Tensor codes, Tensor norms, Tensor grid, int group_size, Tensor? signs=None) -> "
        "Tensor");
  m.def("gemv_lattice_v(Tensor p, Tensor codes, Tensor norms, Tensor grid, int group_size, Tensor? signs=None) -> "
        "Tensor");
}

TORCH_LIBRARY_IMPL(kvkernels_cpu, CPU, m) {
  m.impl("fwht", &kvk_lattice_cpu::fwht);
  m.impl("lattice_quantize", &kvk_lattice_cpu::lattice_quantize);
  m.impl("lattice_dequantize", &kvk_lattice_cpu::lattice_dequantize);
  m.impl("gemv_lattice_k", &kvk_lattice_cpu::gemv_lattice_k);
  m.impl("gemv_lattice_v", &kvk_lattice_cpu::gemv_lattice_v);
}
