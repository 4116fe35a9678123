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
#include <tuple>
#include <utility>
#include <vector>

#include "kvkernels/quant.cuh"

namespace kvk_checks {

constexpr int64_t kBlock = 32;

// name: the argument, as messages call it ("mode", or "key_mode" for an op with one mode per tensor)
inline kvk::QuantMode parse_mode(const char* op, const std::string& mode, const char* name = "mode") {
  if (mode == "sym") return kvk::QuantMode::kSym;
  if (mode == "asym") return kvk::QuantMode::kAsym;
  if (mode == "hybrid") return kvk::QuantMode::kHybrid;
  TORCH_CHECK_VALUE(false, "kvkernels.", op, ": ", name, " must be one of ('sym', 'asym', 'hybrid'), got '", mode,
                    "'");
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

// Two tensors an op reads / writes must not share bytes (quantize_groups_into's outputs with each other and with x:
// one output's stores would land in another, or in x while it is being read). Conservative: same storage and
// intersecting byte spans (first to last element) is refused, so interleaved views of one buffer are refused too.
// Reads no data (meta tensors too). kvkernels/_validate.py check_disjoint is the same rule.
inline void check_disjoint(const char* op, const char* name_a, const at::Tensor& a, const char* name_b,
                           const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0 || !a.is_alias_of(b)) return;
  auto span = [](const at::Tensor& t) {
    int64_t last = 0;
    for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
    const int64_t item = static_cast<int64_t>(t.element_size());
    return std::make_pair(t.storage_offset() * item, (t.storage_offset() + last + 1) * item);
  };
  const auto [a0, a1] = span(a);
  const auto [b0, b1] = span(b);
  TORCH_CHECK_VALUE(a1 <= b0 || b1 <= a0, "kvkernels.", op, ": ", name_a, " and ", name_b,
                    " must not share memory (their byte ranges in one buffer overlap): give each its own buffer");
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
// A copy: torch 2.11's getDtypeNames returns its pair by value, so a view of .first dangled once the statement
// ended (garbage bytes in the message, UnicodeDecodeError in Python; found on the first GPU run, torch 2.11).
inline std::string dtype_name(at::ScalarType s) { return std::string(c10::getDtypeNames(s).first); }

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
  check_disjoint(op, "codes", codes, "scales", scales);
  check_disjoint(op, "codes", codes, "zeros", zeros);
  check_disjoint(op, "scales", scales, "zeros", zeros);
  check_disjoint(op, "x", x, "codes", codes);
  check_disjoint(op, "x", x, "scales", scales);
  check_disjoint(op, "x", x, "zeros", zeros);
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

// ---- decode_attention_fused (kvkernels/_validate.py check_decode_attention_fused; same messages, but an
// input with several faults may be named by a different one first) ----

struct AttentionSizes {
  int64_t B, H_q, H_kv, T, D, S, mk, mv, n_kt, n_vt, N;
  kvk::QuantMode key_mode, value_mode;
  bool key_cols, value_cols;
  bool device_lengths;  // lengths given: S, mk, mv, n_kt, n_vt are capacities and N the most tokens they hold
};

// A window-dtype part [B, H_kv, n, D] (sink or tail); returns n.
inline int64_t check_attention_window(const char* op, const char* name, const at::Tensor& t, int64_t B, int64_t H,
                                      int64_t D, at::ScalarType dt) {
  TORCH_CHECK_VALUE(t.dim() == 4 && t.size(0) == B && t.size(1) == H && t.size(3) == D, "kvkernels.", op, ": ", name,
                    " must be [B=", B, ", H_kv=", H, ", n, D=", D, "], got shape ", t.sizes());
  check_dtype(op, name, t, dt);
  check_last_dim_contiguous(op, name, t);
  return t.size(2);
}

inline bool parse_layout(const char* op, const std::string& pre, const std::string& layout) {
  TORCH_CHECK_VALUE(layout == "rows" || layout == "cols", "kvkernels.", op, ": ", pre,
                    "layout must be one of ('rows', 'cols'), got '", layout, "'");
  return layout == "cols";
}

// One quantized store; returns its token count.
inline int64_t check_attention_store(const char* op, const std::string& pre, const at::Tensor& codes,
                                     const at::Tensor& scales, const std::optional<at::Tensor>& zeros, int64_t bits,
                                     kvk::QuantMode mode, bool cols, int64_t G, int64_t B, int64_t H, int64_t D) {
  check_dtype(op, (pre + "codes").c_str(), codes, at::kInt);
  check_last_dim_contiguous(op, (pre + "codes").c_str(), codes);
  TORCH_CHECK_VALUE(codes.dim() == 4 && codes.size(0) == B && codes.size(1) == H, "kvkernels.", op, ": ", pre,
                    "codes must be 4-D [B=", B, ", H_kv=", H, ", rows, words], got shape ", codes.sizes());
  int64_t m;
  std::vector<int64_t> groups;
  if (!cols) {
    m = codes.size(2);
    TORCH_CHECK_VALUE(codes.size(3) == D / kBlock * bits, "kvkernels.", op, ": ", pre, "codes (layout rows) must hold ",
                      "D*bits/32 = ", D / kBlock * bits, " words per token, got ", codes.size(3));
    groups = {B, H, m, D / G};
  } else {
    TORCH_CHECK_VALUE(codes.size(2) == D, "kvkernels.", op, ": ", pre, "codes (layout cols) must be [B, H_kv, D=", D,
                      ", m*bits/32], got shape ", codes.sizes());
    TORCH_CHECK_VALUE(codes.size(3) % bits == 0, "kvkernels.", op, ": ", pre, "codes last dim ", codes.size(3),
                      " must be a multiple of bits=", bits);
    m = codes.size(3) / bits * kBlock;
    TORCH_CHECK_VALUE(m % G == 0, "kvkernels.", op, ": ", pre, "store (layout cols) holds ", m,
                      " tokens, not a multiple of group_size=", G);
    groups = {B, H, D, m / G};
  }
  check_dtype(op, (pre + "scales").c_str(), scales, at::kHalf);
  check_shape(op, (pre + "scales").c_str(), scales, groups);
  check_last_dim_contiguous(op, (pre + "scales").c_str(), scales);
  TORCH_CHECK_VALUE(zeros.has_value() || mode == kvk::QuantMode::kSym, "kvkernels.", op, ": ", pre,
                    "zeros is required for asym and hybrid modes");
  if (zeros.has_value()) {
    check_dtype(op, (pre + "zeros").c_str(), *zeros, at::kHalf);
    check_shape(op, (pre + "zeros").c_str(), *zeros, groups);
    check_last_dim_contiguous(op, (pre + "zeros").c_str(), *zeros);
  }
  return m;
}

// The two quantized stores of a cache (decode_attention_fused, static_append): group size, bits, modes, layouts, a
// "rows" layout's D % G, then each store's tensors.
struct StorePair {
  kvk::QuantMode key_mode, value_mode;
  bool key_cols, value_cols;
  int64_t mk, mv;  // tokens each store holds (its capacity)
};

inline StorePair check_store_pair(const char* op, const at::Tensor& key_codes, const at::Tensor& key_scales,
                                  const std::optional<at::Tensor>& key_zeros, int64_t key_bits,
                                  const std::string& key_mode, const std::string& key_layout,
                                  const at::Tensor& value_codes, const at::Tensor& value_scales,
                                  const std::optional<at::Tensor>& value_zeros, int64_t value_bits,
                                  const std::string& value_mode, const std::string& value_layout, int64_t group_size,
                                  int64_t B, int64_t H, int64_t D) {
  // the bound: nothing else limits G when a token-grouped store is empty, and the kernels hold G in an int
  TORCH_CHECK_VALUE(group_size > 0 && group_size % kBlock == 0 && group_size <= (int64_t{1} << 20), "kvkernels.", op,
                    ": group_size must be a positive multiple of 32 up to 1048576, got ", group_size);
  StorePair st{};
  TORCH_CHECK_VALUE(key_bits >= 1 && key_bits <= 4, "kvkernels.", op, ": key_bits must be one of (1, 2, 3, 4), got ",
                    key_bits);
  st.key_mode = parse_mode(op, key_mode, "key_mode");
  st.key_cols = parse_layout(op, "key_", key_layout);
  TORCH_CHECK_VALUE(value_bits >= 1 && value_bits <= 4, "kvkernels.", op,
                    ": value_bits must be one of (1, 2, 3, 4), got ", value_bits);
  st.value_mode = parse_mode(op, value_mode, "value_mode");
  st.value_cols = parse_layout(op, "value_", value_layout);
  TORCH_CHECK_VALUE(st.key_cols || D % group_size == 0, "kvkernels.", op, ": head_dim D=", D,
                    " must be a multiple of group_size=", group_size, " (key store in layout rows)");
  TORCH_CHECK_VALUE(st.value_cols || D % group_size == 0, "kvkernels.", op, ": head_dim D=", D,
                    " must be a multiple of group_size=", group_size, " (value store in layout rows)");
  st.mk = check_attention_store(op, "key_", key_codes, key_scales, key_zeros, key_bits, st.key_mode, st.key_cols,
                                group_size, B, H, D);
  st.mv = check_attention_store(op, "value_", value_codes, value_scales, value_zeros, value_bits, st.value_mode,
                                st.value_cols, group_size, B, H, D);
  return st;
}

inline AttentionSizes check_decode_attention_fused(
    const at::Tensor& x, const at::Tensor& sink_keys, const at::Tensor& sink_values, const at::Tensor& key_codes,
    const at::Tensor& key_scales, const std::optional<at::Tensor>& key_zeros, const at::Tensor& value_codes,
    const at::Tensor& value_scales, const std::optional<at::Tensor>& value_zeros, const at::Tensor& key_tail,
    const at::Tensor& value_tail, int64_t key_bits, const std::string& key_mode, const std::string& key_layout,
    int64_t value_bits, const std::string& value_mode, const std::string& value_layout, int64_t group_size,
    const std::optional<at::Tensor>& key_x_scale, const std::optional<at::Tensor>& attn_mask, int64_t split_tokens,
    const std::optional<at::Tensor>& lengths, double q_scale, std::optional<at::ScalarType> out_dtype) {
  const char* op = "decode_attention_fused";
  check_defined(op, "x", x);
  check_defined(op, "sink_keys", sink_keys);
  check_defined(op, "sink_values", sink_values);
  check_defined(op, "key_codes", key_codes);
  check_defined(op, "key_scales", key_scales);
  check_defined(op, "value_codes", value_codes);
  check_defined(op, "value_scales", value_scales);
  check_defined(op, "key_tail", key_tail);
  check_defined(op, "value_tail", value_tail);
  AttentionSizes z{};
  TORCH_CHECK_VALUE(x.dim() == 4, "kvkernels.", op, ": x must be [B, H_q, T, D], got shape ", x.sizes());
  check_activation(op, "x", x);
  check_last_dim_contiguous(op, "x", x);
  z.B = x.size(0), z.H_q = x.size(1), z.T = x.size(2), z.D = x.size(3);
  TORCH_CHECK_VALUE(sink_keys.dim() == 4, "kvkernels.", op, ": sink_keys must be [B, H_kv, S, D], got shape ",
                    sink_keys.sizes());
  z.H_kv = sink_keys.size(1);
  TORCH_CHECK_VALUE(z.H_kv != 0 && z.H_q % z.H_kv == 0, "kvkernels.", op, ": query heads H_q=", z.H_q,
                    " must be a multiple of KV heads H_kv=", z.H_kv);
  check_activation(op, "sink_keys", sink_keys);
  const at::ScalarType dt = sink_keys.scalar_type();
  z.S = check_attention_window(op, "sink_keys", sink_keys, z.B, z.H_kv, z.D, dt);
  TORCH_CHECK_VALUE(check_attention_window(op, "sink_values", sink_values, z.B, z.H_kv, z.D, dt) == z.S, "kvkernels.",
                    op, ": sink_values must match sink_keys ", sink_keys.sizes(), ", got ", sink_values.sizes());
  z.n_kt = check_attention_window(op, "key_tail", key_tail, z.B, z.H_kv, z.D, dt);
  z.n_vt = check_attention_window(op, "value_tail", value_tail, z.B, z.H_kv, z.D, dt);
  const StorePair st = check_store_pair(op, key_codes, key_scales, key_zeros, key_bits, key_mode, key_layout,
                                        value_codes, value_scales, value_zeros, value_bits, value_mode, value_layout,
                                        group_size, z.B, z.H_kv, z.D);
  z.key_mode = st.key_mode, z.value_mode = st.value_mode, z.key_cols = st.key_cols, z.value_cols = st.value_cols;
  z.mk = st.mk, z.mv = st.mv;
  z.device_lengths = lengths.has_value();
  if (z.device_lengths) {
    // device-side lengths: the parts are capacity buffers, what they hold is not read here (no device sync); N is
    // the most tokens they can hold (the mask must span it, the launch is planned for it)
    check_dtype(op, "lengths", *lengths, at::kLong);
    check_shape(op, "lengths", *lengths, {5});
    check_last_dim_contiguous(op, "lengths", *lengths);
    z.N = z.S + std::min(z.mk + z.n_kt, z.mv + z.n_vt);
    TORCH_CHECK_VALUE(z.T >= 1, "kvkernels.", op, ": x has T=", z.T, " query rows; need T >= 1");
  } else {
    z.N = z.S + z.mk + z.n_kt;
    TORCH_CHECK_VALUE(z.S + z.mv + z.n_vt == z.N, "kvkernels.", op, ": keys hold ", z.N, " tokens (sink ", z.S,
                      " + store ", z.mk, " + tail ", z.n_kt, ") but values hold ", z.S + z.mv + z.n_vt, " (sink ",
                      z.S, " + store ", z.mv, " + tail ", z.n_vt, "); both must cover the same tokens");
    TORCH_CHECK_VALUE(z.T >= 1 && z.T <= z.N, "kvkernels.", op, ": x has T=", z.T, " query rows; need 1 <= T <= N=",
                      z.N, " (the rows are the last T cached tokens)");
  }
  if (key_x_scale.has_value()) {
    check_dtype(op, "key_x_scale", *key_x_scale, at::kFloat);
    check_shape(op, "key_x_scale", *key_x_scale, {z.H_kv, z.D});
    check_last_dim_contiguous(op, "key_x_scale", *key_x_scale);
  }
  if (attn_mask.has_value()) {
    const at::Tensor& m = *attn_mask;
    check_dtype(op, "attn_mask", m, at::kFloat);
    const bool cols_ok = m.dim() == 4 && (z.device_lengths ? m.size(3) >= z.N : m.size(3) == z.N);
    TORCH_CHECK_VALUE(cols_ok && m.size(2) == z.T && (m.size(0) == 1 || m.size(0) == z.B) &&
                          (m.size(1) == 1 || m.size(1) == z.H_q),
                      "kvkernels.", op, ": attn_mask must be [B or 1, H_q or 1, T=", z.T, ", ",
                      z.device_lengths ? "M >= " : "N=", z.N, z.device_lengths ? " (the tokens the buffers hold)" : "",
                      "], got shape ", m.sizes());
    check_last_dim_contiguous(op, "attn_mask", m);
  }
  TORCH_CHECK_VALUE(split_tokens >= 0 && split_tokens % group_size == 0, "kvkernels.", op,
                    ": split_tokens must be 0 (planned) or a positive multiple of group_size=", group_size, ", got ",
                    split_tokens);
  TORCH_CHECK_VALUE(std::isfinite(q_scale), "kvkernels.", op, ": q_scale must be finite, got ", q_scale);
  if (out_dtype.has_value()) {
    const at::ScalarType o = *out_dtype;
    TORCH_CHECK_TYPE(o == at::kHalf || o == at::kBFloat16 || o == at::kFloat, "kvkernels.", op,
                     ": out_dtype must be float16 or bfloat16 or float32 (or None: float32), got ", dtype_name(o));
  }
  return z;
}

struct AppendSizes {
  int64_t B, H, n, D, W;
  kvk::QuantMode key_mode, value_mode;
  bool key_cols, value_cols;
};

// Mirrors kvkernels/_validate.py check_static_append: decode_attention_fused's lengths= operands, the new tokens in
// the windows' dtype, the etas, w_recent, and every written tensor disjoint from every other operand.
inline AppendSizes check_static_append(
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& lengths, const at::Tensor& sink_keys,
    const at::Tensor& sink_values, const at::Tensor& key_codes, const at::Tensor& key_scales,
    const std::optional<at::Tensor>& key_zeros, const at::Tensor& value_codes, const at::Tensor& value_scales,
    const std::optional<at::Tensor>& value_zeros, const at::Tensor& key_tail, const at::Tensor& value_tail,
    int64_t key_bits, const std::string& key_mode, const std::string& key_layout, double key_eta, int64_t value_bits,
    const std::string& value_mode, const std::string& value_layout, double value_eta, int64_t group_size,
    int64_t w_recent, const std::optional<at::Tensor>& key_x_scale) {
  const char* op = "static_append";
  const std::pair<const char*, const at::Tensor*> required[] = {
      {"k", &k}, {"v", &v}, {"lengths", &lengths}, {"sink_keys", &sink_keys}, {"sink_values", &sink_values},
      {"key_codes", &key_codes}, {"key_scales", &key_scales}, {"value_codes", &value_codes},
      {"value_scales", &value_scales}, {"key_tail", &key_tail}, {"value_tail", &value_tail}};
  for (const auto& [name, t] : required) check_defined(op, name, *t);
  AppendSizes z{};
  TORCH_CHECK_VALUE(k.dim() == 4 && k.size(2) >= 1, "kvkernels.", op, ": k must be [B, H_kv, n >= 1, D], got shape ",
                    k.sizes());
  z.B = k.size(0), z.H = k.size(1), z.n = k.size(2), z.D = k.size(3);
  check_activation(op, "sink_keys", sink_keys);
  const at::ScalarType dt = sink_keys.scalar_type();
  check_dtype(op, "k", k, dt);
  check_last_dim_contiguous(op, "k", k);
  check_dtype(op, "v", v, dt);
  check_last_dim_contiguous(op, "v", v);
  TORCH_CHECK_VALUE(v.sizes() == k.sizes(), "kvkernels.", op, ": v must match k ", k.sizes(), ", got ", v.sizes());
  z.W = check_attention_window(op, "sink_keys", sink_keys, z.B, z.H, z.D, dt);
  TORCH_CHECK_VALUE(check_attention_window(op, "sink_values", sink_values, z.B, z.H, z.D, dt) == z.W, "kvkernels.",
                    op, ": sink_values must match sink_keys ", sink_keys.sizes(), ", got ", sink_values.sizes());
  check_attention_window(op, "key_tail", key_tail, z.B, z.H, z.D, dt);
  check_attention_window(op, "value_tail", value_tail, z.B, z.H, z.D, dt);
  const StorePair st = check_store_pair(op, key_codes, key_scales, key_zeros, key_bits, key_mode, key_layout,
                                        value_codes, value_scales, value_zeros, value_bits, value_mode, value_layout,
                                        group_size, z.B, z.H, z.D);
  z.key_mode = st.key_mode, z.value_mode = st.value_mode, z.key_cols = st.key_cols, z.value_cols = st.value_cols;
  for (const auto& [pre, mode, eta] : {std::tuple<const char*, const std::string*, double>{"key", &key_mode, key_eta},
                                       {"value", &value_mode, value_eta}}) {
    TORCH_CHECK_VALUE(eta >= 0.0 && eta < 0.5, "kvkernels.", op, ": ", pre, "_eta must be in [0, 0.5), got ", eta);
    TORCH_CHECK_VALUE(eta == 0.0 || *mode == "asym", "kvkernels.", op, ": ", pre, "_eta applies to asym mode only, got ",
                      pre, "_mode='", *mode, "' with eta=", eta);
  }
  TORCH_CHECK_VALUE(w_recent >= 0, "kvkernels.", op, ": w_recent must be a non-negative int, got ", w_recent);
  check_dtype(op, "lengths", lengths, at::kLong);
  check_shape(op, "lengths", lengths, {5});
  check_last_dim_contiguous(op, "lengths", lengths);
  if (key_x_scale.has_value()) {
    check_dtype(op, "key_x_scale", *key_x_scale, at::kFloat);
    check_shape(op, "key_x_scale", *key_x_scale, {z.H, z.D});
    check_last_dim_contiguous(op, "key_x_scale", *key_x_scale);
  }
  // in the Python check's order, so that both name the same pair first
  std::vector<std::pair<const char*, const at::Tensor*>> written = {
      {"lengths", &lengths}, {"sink_keys", &sink_keys}, {"sink_values", &sink_values}, {"key_codes", &key_codes},
      {"key_scales", &key_scales}};
  if (key_zeros.has_value()) written.emplace_back("key_zeros", &*key_zeros);
  written.emplace_back("value_codes", &value_codes);
  written.emplace_back("value_scales", &value_scales);
  if (value_zeros.has_value()) written.emplace_back("value_zeros", &*value_zeros);
  written.emplace_back("key_tail", &key_tail);
  written.emplace_back("value_tail", &value_tail);
  std::vector<std::pair<const char*, const at::Tensor*>> read = {{"k", &k}, {"v", &v}};
  if (key_x_scale.has_value()) read.emplace_back("key_x_scale", &*key_x_scale);
  for (const auto& [name, t] : written) check_no_self_overlap(op, name, *t);
  for (size_t i = 0; i < written.size(); ++i)
    for (size_t j = i + 1; j < written.size(); ++j)
      check_disjoint(op, written[i].first, *written[i].second, written[j].first, *written[j].second);
  for (const auto& [wname, w] : written)
    for (const auto& [rname, r] : read) check_disjoint(op, wname, *w, rname, *r);
  return z;
}

}  // namespace kvk_checks
