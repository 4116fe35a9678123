// CPU kernels of gemv_inner_q and gemv_kivi: kvkernels/reference/gemv.py's ATen ops, in C++, with the C++
// dequantizer (csrc/cpu/ops_cpu.cpp). Same ops on the same shapes and strides, so bit-identical to the reference
// (tests/test_ops.py); what they save is the reference's Python around its ~10 ATen calls, paid twice per layer and
// decode step by `make demo` and `make eval`.
//
// Registered privately as kvkernels_cpu::* (like csrc/cpu/lattice_cpu.cpp): the public ops' CPU kernels are
// kvkernels/ops.py's Python ones, which run _validate's checks first. The checks here keep a direct call
// memory-safe (the dequantizer checks codes / scales / zeros itself).
#include <torch/library.h>
#include <ATen/ATen.h>

#include <optional>
#include <string>

namespace kvk_cpu {
at::Tensor dequantize_groups(const at::Tensor& codes, const at::Tensor& scales, const std::optional<at::Tensor>& zeros,
                             int64_t bits, int64_t group_size, const std::string& mode);
}  // namespace kvk_cpu

namespace kvk_gemv_cpu {

// x [B, H_q, (T,) L] -> the rows of each KV head's query heads stacked: fp32 [B, H_kv, H_q / H_kv * T, L]
at::Tensor rows_by_kv_head(const at::Tensor& x4, const at::Tensor& codes, const char* op) {
  TORCH_CHECK(x4.dim() == 4 && codes.dim() == 4 && codes.size(0) == x4.size(0) && codes.size(1) > 0 &&
                  x4.size(1) % codes.size(1) == 0,
              "kvkernels_cpu.", op, ": x must be [B, H_q, (T,) L] with H_q a multiple of codes' H_kv");
  const int64_t B = x4.size(0), H_q = x4.size(1), T = x4.size(2), L = x4.size(3), H_kv = codes.size(1);
  return x4.to(at::kFloat).reshape({B, H_kv, H_q / H_kv * T, L});
}

at::Tensor gemv_inner_q(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const std::optional<at::Tensor>& zeros, int64_t bits, int64_t group_size,
                        const std::string& mode, const std::optional<at::Tensor>& x_scale) {
  const char* op = "gemv_inner_q";
  const bool has_t = x.dim() == 4;
  const at::Tensor x4 = has_t ? x : x.unsqueeze(2);
  at::Tensor xg = rows_by_kv_head(x4, codes, op);
  if (x_scale.has_value()) xg = xg * x_scale->to(at::kFloat).unsqueeze(0).unsqueeze(2);  // [H_kv, L]
  const at::Tensor w = kvk_cpu::dequantize_groups(codes, scales, zeros, bits, group_size, mode);  // [B, H_kv, M, L]
  TORCH_CHECK(w.size(0) == xg.size(0) && w.size(1) == xg.size(1) && w.size(3) == xg.size(3), "kvkernels_cpu.", op,
              ": codes [B, H_kv, M, L * bits / 32] do not match x");
  const at::Tensor y = at::matmul(xg, w.transpose(-1, -2)).reshape({x4.size(0), x4.size(1), x4.size(2), w.size(2)});
  return has_t ? y : y.squeeze(2);
}

at::Tensor gemv_kivi(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& zeros,
                     int64_t bits, int64_t group_size) {
  const char* op = "gemv_kivi";
  const bool has_t = x.dim() == 4;
  const at::Tensor x4 = has_t ? x : x.unsqueeze(2);
  const at::Tensor xg = rows_by_kv_head(x4, codes, op);
  const at::Tensor w = kvk_cpu::dequantize_groups(codes, scales, zeros, bits, group_size, "asym");  // [B, H_kv, R, C]
  TORCH_CHECK(w.size(0) == xg.size(0) && w.size(1) == xg.size(1) && w.size(2) == xg.size(3), "kvkernels_cpu.", op,
              ": codes [B, H_kv, R, C * bits / 32] do not match x");
  const at::Tensor y = at::matmul(xg, w).reshape({x4.size(0), x4.size(1), x4.size(2), w.size(3)});
  return has_t ? y : y.squeeze(2);
}

}  // namespace kvk_gemv_cpu

TORCH_LIBRARY_FRAGMENT(kvkernels_cpu, m) {
  m.def(
      "gemv_inner_q(Tensor x, Tensor codes, Tensor scales, Tensor? zeros, int bits, int group_size, str quant_mode, "
      "Tensor? x_scale=None) -> Tensor");
  m.def("gemv_kivi(Tensor x, Tensor codes, Tensor scales, Tensor zeros, int bits, int group_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvkernels_cpu, CPU, m) {
  m.impl("gemv_inner_q", &kvk_gemv_cpu::gemv_inner_q);
  m.impl("gemv_kivi", &kvk_gemv_cpu::gemv_kivi);
}
