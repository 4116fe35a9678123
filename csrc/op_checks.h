// Argument checks shared by every compiled registration of the kvkernels ops: the C++ CPU kernels
// (csrc/cpu/ops_cpu.cpp) and the CUDA bindings (csrc/cuda/torch_bindings.cpp). They mirror kvkernels/_validate.py,
// which the Python-registered kernels and the fakes use: TypeError (TORCH_CHECK_TYPE) for dtypes, ValueError
// (TORCH_CHECK_VALUE) for everything else, each message naming the op and the argument. Only metadata is read.
// The device of each tensor is checked by the caller (CPU or one CUDA device), after these.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvkernels/quant.cuh"

namespace kvk_checks {

constexpr int64_t kBlock = 32;

inline kvk::QuantMode parse_mode(const char* op, const std::string& mode) {
  if (mode == "sym") return kvk::QuantMode::kSym;
  if (mode == "asym") return kvk::QuantMode::kAsym;
  if (mode == "hybrid") return kvk::QuantMode::kHybrid;
  TORCH_CHECK_VALUE(false, "kvkernels.", op, ": mode must be one of ('sym', 'asym', 'hybrid'), got '", mode, "'");
}

inline void check_bits(const char* op, int64_t bits) {
  TORCH_CHECK_VALUE(bits >= 1 && bits <= 4, "kvkernels.", op, ": bits must be one of (1, 2, 3, 4), got ", bits);
}

inline void check_group_size(const char* op, int64_t group_size, int64_t length, const char* what) {
  TORCH_CHECK_VALUE(group_size > 0 && group_size % kBlock == 0, "kvkernels.", op,
                    ": group_size must be a positive multiple of 32, got ", group_size);
  TORCH_CHECK_VALUE(length % group_size == 0, "kvkernels.", op, ": ", what, "=", length,
                    " must be a multiple of group_size=", group_size);
}

// The dispatcher passes None in a (non-optional) Tensor argument as an undefined tensor; every other check would
// fail on it with an unrelated message (or worse), so the ops check these first, as kvkernels/ops.py does.
inline void check_defined(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_TYPE(t.defined(), "kvkernels.", op, ": ", name, " must be a tensor, got None");
}

// Outputs written in place must not alias themselves (an expand()ed buffer, or rows closer than a row's length):
// the kernels would race on the shared words. Sufficient condition checked: sorted by stride, every dim of size > 1
// steps past the whole span of the smaller-stride dims.
inline void check_no_self_overlap(const char* op, const char* name, const at::Tensor& t) {
  if (t.numel() == 0) return;
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of the dims with size > 1
  for (int64_t d = 0; d < t.dim(); ++d)
    if (t.size(d) > 1) dims.emplace_back(t.stride(d), t.size(d));
  std::sort(dims.begin(), dims.end());
  int64_t span = 0;  // elements covered by the dims before, minus one
  bool ok = true;
  for (const auto& [stride, size] : dims) {
    ok = ok && stride > span;
    span += stride * (size - 1);
  }
  TORCH_CHECK_VALUE(ok, "kvkernels.", op, ": ", name, " must not overlap itself (no stride 0 or overlapping rows), ",
                    "got shape ", t.sizes(), " and strides ", t.strides());
}

inline void check_last_dim_contiguous(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.dim() == 0 || t.size(-1) <= 1 || t.stride(-1) == 1, "kvkernels.", op, ": ", name,
                    " must have stride 1 in its last dim (row strides may be anything), got ", t.strides());
}

inline void check_shape(const char* op, const char* name, const at::Tensor& t, at::IntArrayRef expected) {
  TORCH_CHECK_VALUE(t.sizes() == expected, "kvkernels.", op, ": ", name, " must have shape ", expected, ", got ",
                    t.sizes());
}

// the dtype as Python spells it ("int32", "float16"), so messages read as kvkernels/_validate.py's do
inline std::string_view dtype_name(at::ScalarType s) { return c10::getDtypeNames(s).first; }

inline void check_dtype(const char* op, const char* name, const at::Tensor& t, at::ScalarType want) {
  TORCH_CHECK_TYPE(t.scalar_type() == want, "kvkernels.", op, ": ", name, " must be ", dtype_name(want), ", got ",
                   dtype_name(t.scalar_type()));
}

inline void check_activation(const char* op, const char* name, const at::Tensor& t) {
  const auto s = t.scalar_type();
  TORCH_CHECK_TYPE(s == at::kHalf || s == at::kBFloat16 || s == at::kFloat, "kvkernels.", op, ": ", name,
                   " must be float16 or bfloat16 or float32, got ", dtype_name(s));
}

// ---- per-op checks (everything but devices) --------------------------------------------------------------------

inline void check_pack(const at::Tensor& codes, int64_t bits) {
  const char* op = "pack_bits";
  check_defined(op, "codes", codes);
  check_bits(op, bits);
  TORCH_CHECK_TYPE(!at::isFloatingType(codes.scalar_type()) && !at::isComplexType(codes.scalar_type()) &&
                       codes.scalar_type() != at::kBool,
                   "kvkernels.pack_bits: codes must be an integer tensor, got ", dtype_name(codes.scalar_type()));
  TORCH_CHECK_VALUE(codes.dim() >= 1 && codes.size(-1) % kBlock == 0,
                    "kvkernels.pack_bits: codes last dim must be a multiple of 32, got shape ", codes.sizes());
}

inline void check_unpack(const at::Tensor& packed, int64_t bits) {
  const char* op = "unpack_bits";
  check_defined(op, "packed", packed);
  check_bits(op, bits);
  check_dtype(op, "packed", packed, at::kInt);
  TORCH_CHECK_VALUE(packed.dim() >= 1 && packed.size(-1) % bits == 0, "kvkernels.unpack_bits: packed last dim must ",
                    "be a multiple of bits=", bits, ", got shape ", packed.sizes());
}

inline void check_quantize(const char* op, const at::Tensor& x, int64_t bits, int64_t group_size,
                           const std::string& mode, double eta) {
  check_defined(op, "x", x);
  check_bits(op, bits);
  parse_mode(op, mode);
  check_activation(op, "x", x);
  TORCH_CHECK_VALUE(x.dim() >= 1, "kvkernels.", op, ": x must have at least one dim");
  check_group_size(op, group_size, x.size(-1), "x.shape[-1]");
  // written so that NaN fails too
  TORCH_CHECK_VALUE(eta >= 0.0 && eta < 0.5, "kvkernels.", op, ": eta must be in [0, 0.5), got ", eta);
  TORCH_CHECK_VALUE(eta == 0.0 || mode == "asym", "kvkernels.", op,
                    ": eta applies to asym mode only, got mode='", mode, "' with eta=", eta);
}

// The outputs of quantize_groups_into: exact shapes (no broadcasting), dtypes, unit last stride.
inline void check_quantize_outputs(const char* op, const at::Tensor& x, int64_t bits, int64_t group_size,
                                   const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& zeros) {
  const int64_t L = x.size(-1);
  std::vector<int64_t> lead(x.sizes().begin(), x.sizes().end() - 1);
  auto code_shape = lead;
  code_shape.push_back(L / kBlock * bits);
  auto group_shape = lead;
  group_shape.push_back(L / group_size);
  check_dtype(op, "codes", codes, at::kInt);
  check_shape(op, "codes", codes, code_shape);
  check_last_dim_contiguous(op, "codes", codes);
  check_dtype(op, "scales", scales, at::kHalf);
  check_shape(op, "scales", scales, group_shape);
  check_last_dim_contiguous(op, "scales", scales);
  check_dtype(op, "zeros", zeros, at::kHalf);
  check_shape(op, "zeros", zeros, group_shape);
  check_last_dim_contiguous(op, "zeros", zeros);
  check_no_self_overlap(op, "codes", codes);
  check_no_self_overlap(op, "scales", scales);
  check_no_self_overlap(op, "zeros", zeros);
}

// quantize_groups_into: every tensor present, then x and the parameters, then the outputs.
inline void check_quantize_into(const at::Tensor& x, int64_t bits, int64_t group_size, const std::string& mode,
                                double eta, const at::Tensor& codes, const at::Tensor& scales,
                                const at::Tensor& zeros) {
  const char* op = "quantize_groups_into";
  check_defined(op, "x", x);
  check_defined(op, "codes", codes);
  check_defined(op, "scales", scales);
  check_defined(op, "zeros", zeros);
  check_quantize(op, x, bits, group_size, mode, eta);
  check_quantize_outputs(op, x, bits, group_size, codes, scales, zeros);
}

// dequantize_groups: returns the dequantized length L (values per row).
inline int64_t check_dequantize(const at::Tensor& codes, const at::Tensor& scales,
                                const std::optional<at::Tensor>& zeros, int64_t bits, int64_t group_size,
                                const std::string& mode) {
  const char* op = "dequantize_groups";
  check_defined(op, "codes", codes);
  check_defined(op, "scales", scales);
  check_bits(op, bits);
  const kvk::QuantMode qmode = parse_mode(op, mode);
  check_dtype(op, "codes", codes, at::kInt);
  TORCH_CHECK_VALUE(codes.dim() >= 1 && codes.size(-1) % bits == 0, "kvkernels.", op,
                    ": codes last dim must be a multiple of bits=", bits, ", got shape ", codes.sizes());
  const int64_t L = codes.size(-1) / bits * kBlock;
  check_group_size(op, group_size, L, "L");
  auto group_shape = codes.sizes().vec();
  group_shape.back() = L / group_size;
  check_dtype(op, "scales", scales, at::kHalf);
  check_shape(op, "scales", scales, group_shape);
  // unit last stride as for every other op's scales/zeros (kvkernels/_validate.py checks it for all of them)
  check_last_dim_contiguous(op, "scales", scales);
  TORCH_CHECK_VALUE(qmode == kvk::QuantMode::kSym || zeros.has_value(), "kvkernels.", op,
                    ": zeros is required for asym and hybrid modes");
  if (zeros.has_value()) {
    check_dtype(op, "zeros", *zeros, at::kHalf);
    check_shape(op, "zeros", *zeros, group_shape);
    check_last_dim_contiguous(op, "zeros", *zeros);
  }
  return L;
}

}  // namespace kvk_checks
