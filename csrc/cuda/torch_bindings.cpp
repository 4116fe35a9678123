// CUDA registrations of the kvkernels ops: the only CUDA-side file that includes torch. For each op it checks
// the arguments (mirroring kvkernels/_validate.py: TypeError for dtypes, ValueError for shapes), fills the
// torch-free params struct of csrc/cuda/kernels.h, allocates outputs and the split-K workspace with the caching
// allocator (so the ops can be captured in CUDA graphs), launches on the current stream and turns a failed
// launch into an exception that names the op.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>  // c10::cuda::getCurrentCUDAStream, which at::cuda::getCurrentCUDAStream aliases;
                                  // ATen/cuda/CUDAContext.h would also pull in the cuBLAS/cuSPARSE headers
#include <torch/library.h>

#include <algorithm>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "cuda/kernels.h"
#include "op_checks.h"

namespace kvk_cuda {
namespace {

using namespace kvk_checks;  // parse_mode, check_bits, check_group_size, check_shape, ... (csrc/op_checks.h)

void check_cuda(const char* op, const char* name, const at::Tensor& t, const at::Device& device) {
  TORCH_CHECK_VALUE(t.is_cuda(), "kvkernels.", op, ": ", name, " must be a CUDA tensor, got ", t.device());
  TORCH_CHECK_VALUE(t.device() == device, "kvkernels.", op, ": all tensors must be on one device, ", name, " is on ",
                    t.device(), ", expected ", device);
}

kvk::XDtype activation_dtype(const char* op, const char* name, const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kHalf: return kvk::XDtype::kF16;
    case at::kBFloat16: return kvk::XDtype::kBF16;
    case at::kFloat: return kvk::XDtype::kF32;
    default:
      check_activation(op, name, t);  // throws, with the shared message; the return below is unreachable
      return kvk::XDtype::kF32;
  }
}

void check_launch(const char* op, cudaError_t err) {
  if (err == cudaSuccess) return;
  const std::string msg = kvk::last_launch_error();
  TORCH_CHECK(false, "kvkernels.", op, ": CUDA launch failed: ", cudaGetErrorString(err),
              msg.empty() ? "" : " (", msg, msg.empty() ? "" : ")");
}

cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

const uint16_t* half_bits(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.const_data_ptr()); }
const uint32_t* words(const at::Tensor& t) { return reinterpret_cast<const uint32_t*>(t.const_data_ptr()); }

// Leading dims of t (all but the last) as a RowLayout, size-1 dims dropped and adjacent dims merged where their
// strides allow. Returns false if more than kMaxRowDims dims remain (caller falls back to a contiguous copy).
bool row_layout(const at::Tensor& t, kvk::RowLayout& rl) {
  std::vector<int64_t> sizes, strides;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) {
    if (t.size(d) == 1) continue;
    if (!sizes.empty() && strides.back() == t.stride(d) * t.size(d)) {  // merge with the outer dim
      sizes.back() *= t.size(d);
      strides.back() = t.stride(d);
    } else {
      sizes.push_back(t.size(d));
      strides.push_back(t.stride(d));
    }
  }
  if (static_cast<int>(sizes.size()) > kvk::kMaxRowDims) return false;
  rl = kvk::RowLayout{};
  rl.ndim = static_cast<int>(sizes.size());
  for (int i = 0; i < rl.ndim; ++i) {
    rl.size[i] = sizes[i];
    rl.stride[i] = strides[i];
  }
  return true;
}

// ---- storage ops ----------------------------------------------------------------------------------------------

at::Tensor pack_bits(const at::Tensor& codes, int64_t bits) {
  const char* op = "pack_bits";
  check_pack(codes, bits);
  check_cuda(op, "codes", codes, codes.device());
  const c10::cuda::CUDAGuard device_guard(codes.device());
  // The kernel reads int32 codes. Other dtypes are converted a chunk of blocks at a time, so packing 256 MB of
  // uint8 codes needs 64 MB of int32 temporaries, not 1 GB; int32 keeps the low 32 bits, like the CPU op.
  const at::Tensor flat = codes.contiguous().view(-1);
  auto sizes = codes.sizes().vec();
  sizes.back() = sizes.back() / kBlock * bits;
  at::Tensor out = at::empty(sizes, codes.options().dtype(at::kInt));
  constexpr int64_t kChunkValues = int64_t(1) << 24;
  for (int64_t start = 0; start < flat.numel(); start += kChunkValues) {
    const int64_t count = std::min(kChunkValues, flat.numel() - start);  // a multiple of kBlock: numel % 32 == 0
    const at::Tensor src = flat.narrow(0, start, count).to(at::kInt);
    kvk::PackParams p{};
    p.codes = src.const_data_ptr<int32_t>();
    p.packed = reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>()) + start / kBlock * bits;
    p.nblocks = count / kBlock;
    p.bits = static_cast<int>(bits);
    check_launch(op, kvk::launch_pack_bits(p, current_stream()));
  }
  return out;
}

at::Tensor unpack_bits(const at::Tensor& packed, int64_t bits) {
  const char* op = "unpack_bits";
  check_unpack(packed, bits);
  check_cuda(op, "packed", packed, packed.device());
  const c10::cuda::CUDAGuard device_guard(packed.device());
  const at::Tensor src = packed.contiguous();
  auto sizes = packed.sizes().vec();
  sizes.back() = sizes.back() / bits * kBlock;
  at::Tensor out = at::empty(sizes, packed.options().dtype(at::kByte));
  kvk::UnpackParams p{};
  p.packed = words(src);
  p.codes = out.data_ptr<uint8_t>();
  p.nblocks = src.numel() / bits;
  p.bits = static_cast<int>(bits);
  check_launch(op, kvk::launch_unpack_bits(p, current_stream()));
  return out;
}

void check_quantize_cuda(const char* op, const at::Tensor& x, int64_t bits, int64_t group_size,
                         const std::string& mode, double eta) {
  check_quantize(op, x, bits, group_size, mode, eta);
  check_cuda(op, "x", x, x.device());
}

// Quantizes x into codes / scales / zeros, which already have the right shapes and dtypes.
void quantize_into_checked(const char* op, const at::Tensor& x_in, int64_t bits, int64_t group_size,
                           const std::string& mode, double eta, at::Tensor& codes, at::Tensor& scales,
                           at::Tensor& zeros) {
  const c10::cuda::CUDAGuard device_guard(x_in.device());
  at::Tensor x = x_in.dim() && x_in.size(-1) > 1 && x_in.stride(-1) != 1 ? x_in.contiguous() : x_in;
  kvk::QuantizeParams p{};
  if (!row_layout(x, p.x_rows)) {
    x = x.contiguous();
    row_layout(x, p.x_rows);
  }
  kvk::RowLayout cl{}, sl{}, zl{};
  if (!row_layout(codes, cl) || !row_layout(scales, sl) || !row_layout(zeros, zl)) {
    // more than kMaxRowDims non-mergeable leading dims: quantize into contiguous buffers, then copy
    at::Tensor c = at::empty(codes.sizes(), codes.options());
    at::Tensor s = at::empty(scales.sizes(), scales.options());
    at::Tensor z = at::empty(zeros.sizes(), zeros.options());
    quantize_into_checked(op, x, bits, group_size, mode, eta, c, s, z);
    codes.copy_(c);
    scales.copy_(s);
    zeros.copy_(z);
    return;
  }
  p.x = x.const_data_ptr();
  p.x_dtype = activation_dtype(op, "x", x);
  p.codes = reinterpret_cast<uint32_t*>(codes.data_ptr<int32_t>());
  p.scales = reinterpret_cast<uint16_t*>(scales.data_ptr<at::Half>());
  p.zeros = reinterpret_cast<uint16_t*>(zeros.data_ptr<at::Half>());
  p.c_rows = cl;
  p.s_rows = sl;
  p.z_rows = zl;
  p.L = x.size(-1);
  p.rows = p.L == 0 ? 0 : x.numel() / p.L;
  p.bits = static_cast<int>(bits);
  p.group_size = static_cast<int>(group_size);
  p.mode = parse_mode(op, mode);
  p.calib = kvk::asym_calib(eta);  // the CPU op rounds the same way
  check_launch(op, kvk::launch_quantize_groups_into(p, current_stream()));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_groups(const at::Tensor& x, int64_t bits, int64_t group_size,
                                                               const std::string& mode, double eta) {
  const char* op = "quantize_groups";
  check_quantize_cuda(op, x, bits, group_size, mode, eta);
  const int64_t L = x.size(-1);
  auto code_sizes = x.sizes().vec();
  code_sizes.back() = L / kBlock * bits;
  auto group_sizes = x.sizes().vec();
  group_sizes.back() = L / group_size;
  at::Tensor codes = at::empty(code_sizes, x.options().dtype(at::kInt));
  at::Tensor scales = at::empty(group_sizes, x.options().dtype(at::kHalf));
  at::Tensor zeros = at::empty(group_sizes, x.options().dtype(at::kHalf));
  quantize_into_checked(op, x, bits, group_size, mode, eta, codes, scales, zeros);
  return {codes, scales, zeros};
}

void quantize_groups_into(const at::Tensor& x, int64_t bits, int64_t group_size, const std::string& mode, double eta,
                          at::Tensor codes, at::Tensor scales, at::Tensor zeros) {
  const char* op = "quantize_groups_into";
  check_quantize_into(x, bits, group_size, mode, eta, codes, scales, zeros);
  check_cuda(op, "x", x, x.device());
  check_cuda(op, "codes", codes, x.device());
  check_cuda(op, "scales", scales, x.device());
  check_cuda(op, "zeros", zeros, x.device());
  quantize_into_checked(op, x, bits, group_size, mode, eta, codes, scales, zeros);
}

at::Tensor dequantize_groups(const at::Tensor& codes_in, const at::Tensor& scales_in,
                             const std::optional<at::Tensor>& zeros_in, int64_t bits, int64_t group_size,
                             const std::string& mode) {
  const char* op = "dequantize_groups";
  const int64_t L = check_dequantize(codes_in, scales_in, zeros_in, bits, group_size, mode);
  const kvk::QuantMode qmode = parse_mode(op, mode);
  check_cuda(op, "codes", codes_in, codes_in.device());
  check_cuda(op, "scales", scales_in, codes_in.device());
  if (zeros_in.has_value()) check_cuda(op, "zeros", *zeros_in, codes_in.device());
  const c10::cuda::CUDAGuard device_guard(codes_in.device());
  // Row strides are passed through; a non-unit last stride or > kMaxRowDims leading dims costs a copy.
  const auto prepare = [](const at::Tensor& t, kvk::RowLayout& rl) {
    at::Tensor u = t.dim() && t.size(-1) > 1 && t.stride(-1) != 1 ? t.contiguous() : t;
    if (!row_layout(u, rl)) {
      u = u.contiguous();
      row_layout(u, rl);
    }
    return u;
  };
  kvk::DequantizeParams p{};
  const at::Tensor codes = prepare(codes_in, p.c_rows);
  const at::Tensor scales = prepare(scales_in, p.s_rows);
  at::Tensor zeros;
  if (zeros_in.has_value()) zeros = prepare(*zeros_in, p.z_rows);
  auto out_shape = codes_in.sizes().vec();
  out_shape.back() = L;
  at::Tensor out = at::empty(out_shape, codes_in.options().dtype(at::kFloat));
  p.codes = words(codes);
  p.scales = half_bits(scales);
  p.zeros = zeros.defined() ? half_bits(zeros) : nullptr;
  p.out = out.data_ptr<float>();
  p.L = L;
  p.rows = L == 0 ? 0 : out.numel() / L;
  p.bits = static_cast<int>(bits);
  p.group_size = static_cast<int>(group_size);
  p.mode = qmode;
  check_launch(op, kvk::launch_dequantize_groups(p, current_stream()));
  return out;
}

// ---- GEMVs ------------------------------------------------------------------------------------------------------

// Shared x / codes checks of both GEMVs (kvkernels/_validate.py: _check_x, _check_kv_heads).
void check_x_and_codes(const char* op, const at::Tensor& x, const at::Tensor& codes) {
  TORCH_CHECK_VALUE(x.dim() == 3 || x.dim() == 4, "kvkernels.", op, ": x must be [B, H_q, L] or [B, H_q, T, L], ",
                    "got shape ", x.sizes());
  activation_dtype(op, "x", x);
  check_last_dim_contiguous(op, "x", x);
  TORCH_CHECK_VALUE(codes.dim() == 4, "kvkernels.", op, ": codes must be 4-D [B, H_kv, rows, words], got shape ",
                    codes.sizes());
  check_dtype(op, "codes", codes, at::kInt);
  check_last_dim_contiguous(op, "codes", codes);
  TORCH_CHECK_VALUE(codes.size(0) == x.size(0), "kvkernels.", op, ": codes batch ", codes.size(0), " != x batch ",
                    x.size(0));
  TORCH_CHECK_VALUE(codes.size(1) != 0 && x.size(1) % codes.size(1) == 0, "kvkernels.", op, ": query heads H_q=",
                    x.size(1), " must be a multiple of KV heads H_kv=", codes.size(1));
  check_cuda(op, "x", x, x.device());
  check_cuda(op, "codes", codes, x.device());
}

void check_group_params(const char* op, const at::Tensor& scales, const std::optional<at::Tensor>& zeros,
                        at::IntArrayRef expected, bool needs_zeros, const at::Device& device) {
  check_dtype(op, "scales", scales, at::kHalf);
  check_shape(op, "scales", scales, expected);
  check_last_dim_contiguous(op, "scales", scales);
  check_cuda(op, "scales", scales, device);
  if (!zeros.has_value()) {
    TORCH_CHECK_VALUE(!needs_zeros, "kvkernels.", op, ": zeros is required for asym and hybrid modes");
    return;
  }
  check_dtype(op, "zeros", *zeros, at::kHalf);
  check_shape(op, "zeros", *zeros, expected);
  check_last_dim_contiguous(op, "zeros", *zeros);
  check_cuda(op, "zeros", *zeros, device);
}

// SM count of the current device (the guard has set it); the runtime caches the attribute, so this is cheap.
int num_sms() {
  int device = 0, count = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

// ---- the GEMVs: functional, _into (the caller's out and workspace), and the workspace query ----------------------
// Each op checks its arguments and fills the params without y (inner_q_params / kivi_params); the caller sets the
// device guard and the SM count, then run_* binds y (a new tensor, or `out`) and the workspace and launches.

// out of the _into forms: fp32, y's shape, x's device, stride 1 in the last dim (rows may be strided: a slice of a
// wider scores buffer), no self-overlap, and no storage shared with an input (the kernel reads them while it writes).
void check_gemv_out(const char* op, const at::Tensor& out, at::IntArrayRef shape, const at::Tensor& x,
                    std::initializer_list<std::pair<const char*, const at::Tensor*>> inputs) {
  check_defined(op, "out", out);
  check_dtype(op, "out", out, at::kFloat);
  check_shape(op, "out", out, shape);
  check_cuda(op, "out", out, x.device());
  check_last_dim_contiguous(op, "out", out);
  check_no_self_overlap(op, "out", out);
  for (const auto& [name, t] : inputs)
    TORCH_CHECK_VALUE(t == nullptr || !t->defined() || !out.is_alias_of(*t), "kvkernels.", op, ": out must not share ",
                      "memory with ", name);
}

// The split-K workspace: the caller's (fp32, contiguous, x's device, at least `need` floats) or a new one.
template <typename Params>
void bind_workspace(const char* op, Params& p, int64_t need, const std::optional<at::Tensor>& workspace,
                    const at::Tensor& x, at::Tensor& owned) {
  if (workspace.has_value()) {
    check_dtype(op, "workspace", *workspace, at::kFloat);
    check_cuda(op, "workspace", *workspace, x.device());
    TORCH_CHECK_VALUE(workspace->is_contiguous(), "kvkernels.", op, ": workspace must be contiguous");
    TORCH_CHECK_VALUE(workspace->numel() >= need, "kvkernels.", op, ": workspace holds ", workspace->numel(),
                      " floats, this call needs ", need, " (kvkernels.gemv_workspace_numel)");
  }
  if (need == 0) return;
  if (workspace.has_value()) {
    p.workspace = workspace->data_ptr<float>();
    p.workspace_floats = workspace->numel();
  } else {
    owned = at::empty({need}, x.options().dtype(at::kFloat));
    p.workspace = owned.data_ptr<float>();
    p.workspace_floats = need;
  }
}

std::vector<int64_t> gemv_y_shape(const at::Tensor& x, int64_t n) {
  auto shape = x.sizes().vec();
  shape.back() = n;
  return shape;
}

kvk::GemvInnerQParams inner_q_params(const char* op, const at::Tensor& x, const at::Tensor& codes,
                                     const at::Tensor& scales, const std::optional<at::Tensor>& zeros, int64_t bits,
                                     int64_t group_size, const std::string& mode,
                                     const std::optional<at::Tensor>& x_scale) {
  check_defined(op, "x", x);
  check_defined(op, "codes", codes);
  check_defined(op, "scales", scales);
  check_bits(op, bits);
  const kvk::QuantMode qmode = parse_mode(op, mode);
  check_x_and_codes(op, x, codes);
  const int64_t L = x.size(-1);
  check_group_size(op, group_size, L, "x.shape[-1] (L)");
  const int64_t B = codes.size(0), H_kv = codes.size(1), M = codes.size(2);
  TORCH_CHECK_VALUE(codes.size(3) == L / kBlock * bits, "kvkernels.", op, ": codes must hold L*bits/32 = ",
                    L / kBlock * bits, " words per row for L=", L, ", got ", codes.size(3));
  check_group_params(op, scales, zeros, {B, H_kv, M, L / group_size}, qmode != kvk::QuantMode::kSym, x.device());
  if (x_scale.has_value()) {
    check_dtype(op, "x_scale", *x_scale, at::kFloat);
    check_shape(op, "x_scale", *x_scale, {H_kv, L});
    check_last_dim_contiguous(op, "x_scale", *x_scale);
    check_cuda(op, "x_scale", *x_scale, x.device());
  }
  const bool has_t = x.dim() == 4;
  kvk::GemvInnerQParams p{};
  p.x = x.const_data_ptr();
  p.codes = words(codes);
  p.scales = half_bits(scales);
  p.zeros = zeros.has_value() ? half_bits(*zeros) : nullptr;
  p.x_scale = x_scale.has_value() ? x_scale->const_data_ptr<float>() : nullptr;
  p.B = B, p.H_q = x.size(1), p.H_kv = H_kv, p.T = has_t ? x.size(2) : 1, p.M = M, p.L = L;
  p.bits = static_cast<int>(bits);
  p.group_size = static_cast<int>(group_size);
  p.mode = qmode;
  p.x_dtype = activation_dtype(op, "x", x);
  p.x_sb = x.stride(0), p.x_sh = x.stride(1), p.x_st = has_t ? x.stride(2) : 0;
  p.c_sb = codes.stride(0), p.c_sh = codes.stride(1), p.c_sm = codes.stride(2);
  p.s_sb = scales.stride(0), p.s_sh = scales.stride(1), p.s_sm = scales.stride(2);
  if (zeros.has_value()) p.z_sb = zeros->stride(0), p.z_sh = zeros->stride(1), p.z_sm = zeros->stride(2);
  p.xs_sh = x_scale.has_value() ? x_scale->stride(0) : 0;
  return p;
}

// Binds y (and the workspace) and launches: `reduction` is the summed length (L or R; 0: y = 0), `need` and `launch`
// the kernel's workspace rule and launcher (kernels.h).
template <typename Params>
void run_gemv(const char* op, Params p, int64_t reduction, const at::Tensor& x, const at::Tensor& y,
              const std::optional<at::Tensor>& workspace, int64_t (*need)(const Params&),
              cudaError_t (*launch)(const Params&, cudaStream_t)) {
  at::Tensor owned;
  bind_workspace(op, p, y.numel() == 0 || reduction == 0 ? 0 : need(p), workspace, x, owned);
  if (y.numel() == 0) return;
  if (reduction == 0) {
    y.zero_();
    return;
  }
  p.y = y.data_ptr<float>();
  p.y_sb = y.stride(0), p.y_sh = y.stride(1), p.y_st = x.dim() == 4 ? y.stride(2) : 0;
  check_launch(op, launch(p, current_stream()));
}

void run_inner_q(const char* op, const kvk::GemvInnerQParams& p, const at::Tensor& x, const at::Tensor& y,
                 const std::optional<at::Tensor>& workspace) {
  run_gemv(op, p, p.L, x, y, workspace, &kvk::gemv_inner_q_workspace_floats, &kvk::launch_gemv_inner_q);
}

at::Tensor gemv_inner_q(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const std::optional<at::Tensor>& zeros, int64_t bits, int64_t group_size,
                        const std::string& mode, const std::optional<at::Tensor>& x_scale) {
  const char* op = "gemv_inner_q";
  kvk::GemvInnerQParams p = inner_q_params(op, x, codes, scales, zeros, bits, group_size, mode, x_scale);
  const c10::cuda::CUDAGuard device_guard(x.device());
  p.num_sms = num_sms();
  at::Tensor y = at::empty(gemv_y_shape(x, p.M), x.options().dtype(at::kFloat));
  run_inner_q(op, p, x, y, std::nullopt);
  return y;
}

void gemv_inner_q_into(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       const std::optional<at::Tensor>& zeros, int64_t bits, int64_t group_size,
                       const std::string& quant_mode, const std::optional<at::Tensor>& x_scale, at::Tensor out,
                       const std::optional<at::Tensor>& workspace) {
  const char* op = "gemv_inner_q_into";
  kvk::GemvInnerQParams p = inner_q_params(op, x, codes, scales, zeros, bits, group_size, quant_mode, x_scale);
  check_gemv_out(op, out, gemv_y_shape(x, p.M), x,
                 {{"x", &x}, {"codes", &codes}, {"scales", &scales}, {"zeros", zeros ? &*zeros : nullptr},
                  {"x_scale", x_scale ? &*x_scale : nullptr}, {"workspace", workspace ? &*workspace : nullptr}});
  const c10::cuda::CUDAGuard device_guard(x.device());
  p.num_sms = num_sms();
  run_inner_q(op, p, x, out, workspace);
}

kvk::GemvKiviParams kivi_params(const char* op, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                                const at::Tensor& zeros, int64_t bits, int64_t group_size) {
  check_defined(op, "x", x);
  check_defined(op, "codes", codes);
  check_defined(op, "scales", scales);
  check_defined(op, "zeros", zeros);
  check_bits(op, bits);
  check_x_and_codes(op, x, codes);
  const int64_t B = codes.size(0), H_kv = codes.size(1), R = codes.size(2), W = codes.size(3);
  TORCH_CHECK_VALUE(R == x.size(-1), "kvkernels.", op, ": codes rows R=", R, " must equal x.shape[-1]=", x.size(-1));
  TORCH_CHECK_VALUE(W % bits == 0, "kvkernels.", op, ": codes last dim ", W, " must be a multiple of bits=", bits);
  const int64_t C = W / bits * kBlock;
  check_group_size(op, group_size, C, "C (columns)");
  check_group_params(op, scales, zeros, {B, H_kv, R, C / group_size}, true, x.device());
  const bool has_t = x.dim() == 4;
  kvk::GemvKiviParams p{};
  p.x = x.const_data_ptr();
  p.codes = words(codes);
  p.scales = half_bits(scales);
  p.zeros = half_bits(zeros);
  p.B = B, p.H_q = x.size(1), p.H_kv = H_kv, p.T = has_t ? x.size(2) : 1, p.R = R, p.C = C;
  p.bits = static_cast<int>(bits);
  p.group_size = static_cast<int>(group_size);
  p.x_dtype = activation_dtype(op, "x", x);
  p.x_sb = x.stride(0), p.x_sh = x.stride(1), p.x_st = has_t ? x.stride(2) : 0;
  p.c_sb = codes.stride(0), p.c_sh = codes.stride(1), p.c_sr = codes.stride(2);
  p.s_sb = scales.stride(0), p.s_sh = scales.stride(1), p.s_sr = scales.stride(2);
  p.z_sb = zeros.stride(0), p.z_sh = zeros.stride(1), p.z_sr = zeros.stride(2);
  return p;
}

void run_kivi(const char* op, const kvk::GemvKiviParams& p, const at::Tensor& x, const at::Tensor& y,
              const std::optional<at::Tensor>& workspace) {
  run_gemv(op, p, p.R, x, y, workspace, &kvk::gemv_kivi_workspace_floats, &kvk::launch_gemv_kivi);
}

at::Tensor gemv_kivi(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& zeros,
                     int64_t bits, int64_t group_size) {
  const char* op = "gemv_kivi";
  kvk::GemvKiviParams p = kivi_params(op, x, codes, scales, zeros, bits, group_size);
  const c10::cuda::CUDAGuard device_guard(x.device());
  p.num_sms = num_sms();
  at::Tensor y = at::empty(gemv_y_shape(x, p.C), x.options().dtype(at::kFloat));
  run_kivi(op, p, x, y, std::nullopt);
  return y;
}

void gemv_kivi_into(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& zeros,
                    int64_t bits, int64_t group_size, at::Tensor out, const std::optional<at::Tensor>& workspace) {
  const char* op = "gemv_kivi_into";
  kvk::GemvKiviParams p = kivi_params(op, x, codes, scales, zeros, bits, group_size);
  check_gemv_out(op, out, gemv_y_shape(x, p.C), x,
                 {{"x", &x}, {"codes", &codes}, {"scales", &scales}, {"zeros", &zeros},
                  {"workspace", workspace ? &*workspace : nullptr}});
  const c10::cuda::CUDAGuard device_guard(x.device());
  p.num_sms = num_sms();
  run_kivi(op, p, x, out, workspace);
}

// Floats of split-K workspace the _into form of `gemv` ("gemv_inner_q" or "gemv_kivi") needs for these arguments
// (0: no split). It depends on the shapes, the row strides and alignment and the device: ask with the tensors the
// call will use.
int64_t gemv_workspace_numel(const std::string& gemv, const at::Tensor& x, const at::Tensor& codes,
                             const at::Tensor& scales, const std::optional<at::Tensor>& zeros, int64_t bits,
                             int64_t group_size, const std::string& mode, const std::optional<at::Tensor>& x_scale) {
  const char* op = "gemv_workspace_numel";
  if (gemv == "gemv_inner_q") {
    kvk::GemvInnerQParams p = inner_q_params(op, x, codes, scales, zeros, bits, group_size, mode, x_scale);
    const c10::cuda::CUDAGuard device_guard(x.device());
    p.num_sms = num_sms();
    return p.B * p.H_q * p.T * p.M == 0 || p.L == 0 ? 0 : kvk::gemv_inner_q_workspace_floats(p);
  }
  TORCH_CHECK_VALUE(gemv == "gemv_kivi", "kvkernels.", op, ": op must be 'gemv_inner_q' or 'gemv_kivi', got '", gemv,
                    "'");
  TORCH_CHECK_VALUE(mode == "asym" && !x_scale.has_value(), "kvkernels.", op,
                    ": gemv_kivi is asym without x_scale, got mode='", mode, "'",
                    x_scale.has_value() ? " and an x_scale" : "");
  TORCH_CHECK_VALUE(zeros.has_value(), "kvkernels.", op, ": gemv_kivi needs zeros");
  kvk::GemvKiviParams p = kivi_params(op, x, codes, scales, *zeros, bits, group_size);
  const c10::cuda::CUDAGuard device_guard(x.device());
  p.num_sms = num_sms();
  return p.B * p.H_q * p.T * p.C == 0 || p.R == 0 ? 0 : kvk::gemv_kivi_workspace_floats(p);
}

// ---- lattice GEMVs ---------------------------------------------------------------------------------------------

// The lattice grid kind of an fp32 [n, d] grid (the lattice GEMVs' and aqua_reconstruct's check).
kvk::LatticeGrid checked_lattice_grid(const char* op, const at::Tensor& grid_in) {
  check_defined(op, "grid", grid_in);
  check_dtype(op, "grid", grid_in, at::kFloat);
  const int kind = grid_in.dim() == 2 ? kvk::lattice_grid_of(grid_in.size(1), grid_in.size(0)) : -1;
  TORCH_CHECK_VALUE(kind >= 0, "kvkernels.", op, ": grid must be [n, d] with [n, d] one of [[16, 2], [64, 2], ",
                    "[256, 2], [256, 4]], got shape ", grid_in.sizes());
  check_last_dim_contiguous(op, "grid", grid_in);
  return static_cast<kvk::LatticeGrid>(kind);
}

// Shared checks of gemv_lattice_k / gemv_lattice_v (mirroring kvkernels/_validate.py check_gemv_lattice_k / _v):
// x [B, H_q, (T,) L] with L = D (keys) or N (values); codes int32 [B, H_kv, N, D * bits / 32]; norms fp16
// [B, H_kv, N, D / G]; grid fp32 [n, d] one of the four (bits from its shape); G a power of two in [32, 1024] dividing
// D; signs None or int8 [G]. The kernels take D in {64, 128, 256}. Fills p but the output; returns the grid as the
// kernel reads it (contiguous: a strided view is copied, n * d floats) and D through p.D.
at::Tensor lattice_params(const char* op, bool keys, const at::Tensor& x, const at::Tensor& codes,
                          const at::Tensor& norms, const at::Tensor& grid_in, int64_t group_size,
                          const std::optional<at::Tensor>& signs, kvk::GemvLatticeParams& p) {
  const char* xname = keys ? "q" : "p";
  check_defined(op, xname, x);
  check_defined(op, "codes", codes);
  check_defined(op, "norms", norms);
  check_x_and_codes(op, x, codes);
  const auto g = checked_lattice_grid(op, grid_in);
  const int64_t bits = kvk::lattice_bits(g);
  const int64_t B = codes.size(0), H_kv = codes.size(1), N = codes.size(2), W = codes.size(3);
  int64_t D = 0;
  TORCH_CHECK_VALUE(group_size >= 32 && group_size <= 1024 && (group_size & (group_size - 1)) == 0, "kvkernels.",
                    op, ": group_size must be a power of two in [32, 1024], got ", group_size);
  if (keys) {
    D = x.size(-1);
    TORCH_CHECK_VALUE(D % group_size == 0, "kvkernels.", op, ": q.shape[-1] (D)=", D,
                      " must be a multiple of group_size=", group_size);
    TORCH_CHECK_VALUE(W == D / kBlock * bits, "kvkernels.", op, ": codes must hold D*bits/32 = ", D / kBlock * bits,
                      " words per row for D=", D, ", got ", W);
  } else {
    TORCH_CHECK_VALUE(N == x.size(-1), "kvkernels.", op, ": codes tokens N=", N, " must equal p.shape[-1]=",
                      x.size(-1));
    TORCH_CHECK_VALUE(W % bits == 0, "kvkernels.", op, ": codes last dim ", W, " must be a multiple of bits=", bits);
    D = W / bits * kBlock;
    TORCH_CHECK_VALUE(D % group_size == 0, "kvkernels.", op, ": D (values per token)=", D,
                      " must be a multiple of group_size=", group_size);
  }
  check_dtype(op, "norms", norms, at::kHalf);
  check_shape(op, "norms", norms, {B, H_kv, N, D / group_size});
  check_last_dim_contiguous(op, "norms", norms);
  if (signs.has_value()) {
    check_dtype(op, "signs", *signs, at::kChar);
    check_shape(op, "signs", *signs, {group_size});
    check_last_dim_contiguous(op, "signs", *signs);
  }
  check_cuda(op, "norms", norms, x.device());
  check_cuda(op, "grid", grid_in, x.device());
  if (signs.has_value()) check_cuda(op, "signs", *signs, x.device());
  // D = 0 launches nothing (keys: an empty sum, zeros; values: an empty output), as the reference returns
  TORCH_CHECK_VALUE(D == 0 || D == 64 || D == 128 || D == 256, "kvkernels.", op, ": the CUDA kernel takes head_dim D ",
                    "in (64, 128, 256), got D=", D);
  const at::Tensor grid = grid_in.contiguous();
  const bool has_t = x.dim() == 4;
  p = kvk::GemvLatticeParams{};
  p.x = x.const_data_ptr();
  p.codes = words(codes);
  p.norms = half_bits(norms);
  p.grid = grid.const_data_ptr<float>();
  p.signs = signs.has_value() ? signs->const_data_ptr<int8_t>() : nullptr;
  p.B = B, p.H_q = x.size(1), p.H_kv = H_kv, p.T = has_t ? x.size(2) : 1, p.N = N;
  p.D = static_cast<int>(D);
  p.group_size = static_cast<int>(group_size);
  p.grid_kind = g;
  p.x_dtype = activation_dtype(op, xname, x);
  p.x_sb = x.stride(0), p.x_sh = x.stride(1), p.x_st = has_t ? x.stride(2) : 0;
  p.c_sb = codes.stride(0), p.c_sh = codes.stride(1), p.c_sn = codes.stride(2);
  p.r_sb = norms.stride(0), p.r_sh = norms.stride(1), p.r_sn = norms.stride(2);
  return grid;
}

at::Tensor gemv_lattice_k(const at::Tensor& q, const at::Tensor& codes, const at::Tensor& norms, const at::Tensor& grid,
                          int64_t group_size, const std::optional<at::Tensor>& signs) {
  const char* op = "gemv_lattice_k";
  kvk::GemvLatticeParams p;
  const at::Tensor grid_c = lattice_params(op, true, q, codes, norms, grid, group_size, signs, p);
  const c10::cuda::CUDAGuard device_guard(q.device());
  auto y_shape = q.sizes().vec();
  y_shape.back() = p.N;
  at::Tensor y = at::empty(y_shape, q.options().dtype(at::kFloat));
  if (y.numel() == 0) return y;
  if (p.D == 0) return y.zero_();
  const bool has_t = q.dim() == 4;
  p.y = y.data_ptr<float>();
  p.y_sb = y.stride(0), p.y_sh = y.stride(1), p.y_st = has_t ? y.stride(2) : 0;
  p.num_sms = num_sms();
  check_launch(op, kvk::launch_gemv_lattice_k(p, current_stream()));
  return y;
}

at::Tensor gemv_lattice_v(const at::Tensor& probs, const at::Tensor& codes, const at::Tensor& norms,
                          const at::Tensor& grid, int64_t group_size, const std::optional<at::Tensor>& signs) {
  const char* op = "gemv_lattice_v";
  kvk::GemvLatticeParams p;
  const at::Tensor grid_c = lattice_params(op, false, probs, codes, norms, grid, group_size, signs, p);
  const int64_t D = p.D;
  const c10::cuda::CUDAGuard device_guard(probs.device());
  auto y_shape = probs.sizes().vec();
  y_shape.back() = D;
  at::Tensor y = at::empty(y_shape, probs.options().dtype(at::kFloat));
  if (y.numel() == 0) return y;
  if (p.N == 0) return y.zero_();
  const bool has_t = probs.dim() == 4;
  p.y = y.data_ptr<float>();
  p.y_sb = y.stride(0), p.y_sh = y.stride(1), p.y_st = has_t ? y.stride(2) : 0;
  p.num_sms = num_sms();
  const int64_t ws_floats = kvk::gemv_lattice_v_workspace_floats(p);
  at::Tensor ws;
  if (ws_floats > 0) {
    ws = at::empty({ws_floats}, probs.options().dtype(at::kFloat));
    p.workspace = ws.data_ptr<float>();
    p.workspace_floats = ws_floats;
  }
  check_launch(op, kvk::launch_gemv_lattice_v(p, current_stream()));
  return y;
}

// ---- AQUA-KV reconstruction ----------------------------------------------------------------------------------

// A 2-D GEMM operand of aqua_reconstruct (kvkernels/_validate.py _check_matrix): 2-D, float dtype (`dtype` if given),
// unit last stride, `rows` rows if rows >= 0.
void check_matrix(const char* op, const char* name, const at::Tensor& t, int64_t rows,
                  std::optional<at::ScalarType> dtype) {
  TORCH_CHECK_VALUE(t.dim() == 2, "kvkernels.", op, ": ", name, " must be 2-D, got shape ", t.sizes());
  if (dtype.has_value()) {
    check_dtype(op, name, t, *dtype);
  } else {
    check_activation(op, name, t);
  }
  check_last_dim_contiguous(op, name, t);
  TORCH_CHECK_VALUE(rows < 0 || t.size(0) == rows, "kvkernels.", op, ": ", name, " must have ", rows,
                    " rows, got shape ", t.sizes());
}

// The operand as the fp16 / bf16 kernel reads it (16-byte cp.async of rows: start and row stride 16-byte aligned):
// itself, or a copy into rows padded to a multiple of 8 elements. Only unusual views and an odd number of input
// channels pay for the copy (the kernel never reads past C_in, so the padding stays uninitialized).
at::Tensor aqua_operand(const at::Tensor& t) {
  if (t.scalar_type() == at::kFloat ||
      kvk::aqua_operand_aligned(t.const_data_ptr(), t.size(0), t.size(1), t.stride(0), 2))
    return t;
  const int64_t cols = t.size(1);
  return at::empty({t.size(0), (cols + 7) / 8 * 8}, t.options()).narrow(1, 0, cols).copy_(t);
}

// Mirrors kvkernels/_validate.py check_aqua_reconstruct (same order, same messages), then the CUDA kernel's own
// limit: group_size 32, 64 or 128.
at::Tensor aqua_reconstruct(const at::Tensor& prev, const at::Tensor& weight, const at::Tensor& bias,
                            const at::Tensor& codes, const at::Tensor& norms, const at::Tensor& grid_in,
                            int64_t group_size, const std::optional<at::Tensor>& signs,
                            const std::optional<at::Tensor>& prev2, const std::optional<at::Tensor>& weight2) {
  const char* op = "aqua_reconstruct";
  check_defined(op, "prev", prev);
  check_defined(op, "weight", weight);
  check_defined(op, "bias", bias);
  check_defined(op, "codes", codes);
  check_defined(op, "norms", norms);
  const auto g = checked_lattice_grid(op, grid_in);
  const int64_t bits = kvk::lattice_bits(g);
  check_matrix(op, "prev", prev, -1, std::nullopt);
  const int64_t T = prev.size(0);
  check_matrix(op, "weight", weight, -1, prev.scalar_type());
  const int64_t C = weight.size(0), C_in = weight.size(1);
  TORCH_CHECK_VALUE(prev.size(1) == C_in, "kvkernels.", op, ": prev [T, C_in] and weight [C, C_in] disagree on C_in: ",
                    prev.sizes(), " vs ", weight.sizes());
  check_dtype(op, "bias", bias, at::kFloat);
  check_shape(op, "bias", bias, {C});
  TORCH_CHECK_VALUE(group_size >= 32 && group_size <= 1024 && (group_size & (group_size - 1)) == 0, "kvkernels.",
                    op, ": group_size must be a power of two in [32, 1024], got ", group_size);
  TORCH_CHECK_VALUE(C % group_size == 0, "kvkernels.", op, ": C (weight.shape[0])=", C,
                    " must be a multiple of group_size=", group_size);
  check_dtype(op, "codes", codes, at::kInt);
  check_shape(op, "codes", codes, {T, C / kBlock * bits});
  check_last_dim_contiguous(op, "codes", codes);
  check_dtype(op, "norms", norms, at::kHalf);
  check_shape(op, "norms", norms, {T, C / group_size});
  check_last_dim_contiguous(op, "norms", norms);
  if (signs.has_value()) {
    check_dtype(op, "signs", *signs, at::kChar);
    check_shape(op, "signs", *signs, {group_size});
    check_last_dim_contiguous(op, "signs", *signs);
  }
  TORCH_CHECK_VALUE(prev2.has_value() == weight2.has_value(), "kvkernels.", op, ": prev2 and weight2 come together ",
                    "(the second input of the value predictor): give both or neither");
  if (prev2.has_value()) {
    check_matrix(op, "prev2", *prev2, T, prev.scalar_type());
    check_matrix(op, "weight2", *weight2, C, prev.scalar_type());
    TORCH_CHECK_VALUE(prev2->size(1) == weight2->size(1), "kvkernels.", op, ": prev2 [T, C_in2] and weight2 [C, ",
                      "C_in2] disagree: ", prev2->sizes(), " vs ", weight2->sizes());
  }
  // an empty second input adds nothing: run as keys (an empty tensor's data pointer may be null)
  const bool two = prev2.has_value() && prev2->size(1) > 0;
  const at::Device device = prev.device();
  check_cuda(op, "prev", prev, device);
  check_cuda(op, "weight", weight, device);
  check_cuda(op, "bias", bias, device);
  check_cuda(op, "codes", codes, device);
  check_cuda(op, "norms", norms, device);
  check_cuda(op, "grid", grid_in, device);
  if (signs.has_value()) check_cuda(op, "signs", *signs, device);
  if (prev2.has_value()) {
    check_cuda(op, "prev2", *prev2, device);
    check_cuda(op, "weight2", *weight2, device);
  }
  TORCH_CHECK_VALUE(group_size == 32 || group_size == 64 || group_size == 128, "kvkernels.", op,
                    ": the CUDA kernel takes group_size in (32, 64, 128) (a group must fit its 128-channel tile), ",
                    "got ", group_size, "; kvkernels.reference.aqua_reconstruct computes any group_size");

  const c10::cuda::CUDAGuard device_guard(device);
  at::Tensor out = at::empty({T, C}, prev.options().dtype(at::kFloat));
  if (out.numel() == 0) return out;
  const at::Tensor a = aqua_operand(prev), w = aqua_operand(weight);
  const at::Tensor a2 = two ? aqua_operand(*prev2) : at::Tensor(), w2 = two ? aqua_operand(*weight2) : at::Tensor();
  const at::Tensor grid = grid_in.contiguous(), b = bias.contiguous();
  kvk::AquaReconstructParams p{};
  p.prev = a.const_data_ptr();
  p.weight = w.const_data_ptr();
  p.prev2 = two ? a2.const_data_ptr() : nullptr;
  p.weight2 = two ? w2.const_data_ptr() : nullptr;
  p.bias = b.const_data_ptr<float>();
  p.codes = words(codes);
  p.norms = half_bits(norms);
  p.grid = grid.const_data_ptr<float>();
  p.signs = signs.has_value() ? signs->const_data_ptr<int8_t>() : nullptr;
  p.out = out.data_ptr<float>();
  p.T = T, p.C = C, p.C_in = C_in, p.C_in2 = two ? a2.size(1) : 0;
  p.group_size = static_cast<int>(group_size);
  p.grid_kind = g;
  p.x_dtype = activation_dtype(op, "prev", prev);
  p.num_sms = num_sms();
  p.s_prev = a.stride(0), p.s_w = w.stride(0);
  p.s_prev2 = two ? a2.stride(0) : 0, p.s_w2 = two ? w2.stride(0) : 0;
  p.s_codes = codes.stride(0), p.s_norms = norms.stride(0), p.s_out = out.stride(0);
  check_launch(op, kvk::launch_aqua_reconstruct(p, current_stream()));
  return out;
}

// ---- fused decode attention -------------------------------------------------------------------------------------

kvk::AttnWindow attention_window(const at::Tensor& t) {
  kvk::AttnWindow w{};
  w.n = t.size(2);
  w.p = w.n > 0 ? t.const_data_ptr() : nullptr;
  w.sb = t.stride(0), w.sh = t.stride(1), w.st = t.stride(2);
  return w;
}

kvk::AttnStore attention_store(const at::Tensor& codes, const at::Tensor& scales,
                               const std::optional<at::Tensor>& zeros, int64_t m, int64_t bits, kvk::QuantMode mode,
                               bool cols) {
  kvk::AttnStore st{};
  st.codes = words(codes);
  st.scales = half_bits(scales);
  st.zeros = zeros.has_value() ? half_bits(*zeros) : nullptr;
  st.m = m;
  st.bits = static_cast<int>(bits);
  st.mode = mode;
  st.layout = cols ? kvk::StoreLayout::kCols : kvk::StoreLayout::kRows;
  st.c_sb = codes.stride(0), st.c_sh = codes.stride(1), st.c_sr = codes.stride(2);
  st.s_sb = scales.stride(0), st.s_sh = scales.stride(1), st.s_sr = scales.stride(2);
  if (zeros.has_value()) st.z_sb = zeros->stride(0), st.z_sh = zeros->stride(1), st.z_sr = zeros->stride(2);
  return st;
}

// The cache operands decode_attention_fused and static_append share (sink, the two stores, the two tails, the keys'
// x_scale) are on `device`, in the order both ops check them.
void check_cache_operands_on(const char* op, const at::Device& device, const at::Tensor& sink_keys,
                             const at::Tensor& sink_values, const at::Tensor& key_codes, const at::Tensor& key_scales,
                             const std::optional<at::Tensor>& key_zeros, const at::Tensor& value_codes,
                             const at::Tensor& value_scales, const std::optional<at::Tensor>& value_zeros,
                             const at::Tensor& key_tail, const at::Tensor& value_tail,
                             const std::optional<at::Tensor>& key_x_scale) {
  check_cuda(op, "sink_keys", sink_keys, device);
  check_cuda(op, "sink_values", sink_values, device);
  check_cuda(op, "key_codes", key_codes, device);
  check_cuda(op, "key_scales", key_scales, device);
  if (key_zeros.has_value()) check_cuda(op, "key_zeros", *key_zeros, device);
  check_cuda(op, "value_codes", value_codes, device);
  check_cuda(op, "value_scales", value_scales, device);
  if (value_zeros.has_value()) check_cuda(op, "value_zeros", *value_zeros, device);
  check_cuda(op, "key_tail", key_tail, device);
  check_cuda(op, "value_tail", value_tail, device);
  if (key_x_scale.has_value()) check_cuda(op, "key_x_scale", *key_x_scale, device);
}

// Mirrors kvkernels/_validate.py check_decode_attention_fused (kvk_checks::check_decode_attention_fused), then the
// CUDA kernel's own limit: head_dim 64 or 128.
at::Tensor decode_attention_fused(const at::Tensor& x, const at::Tensor& sink_keys, const at::Tensor& sink_values,
                                  const at::Tensor& key_codes, const at::Tensor& key_scales,
                                  const std::optional<at::Tensor>& key_zeros, const at::Tensor& value_codes,
                                  const at::Tensor& value_scales, const std::optional<at::Tensor>& value_zeros,
                                  const at::Tensor& key_tail, const at::Tensor& value_tail, int64_t key_bits,
                                  const std::string& key_mode, const std::string& key_layout, int64_t value_bits,
                                  const std::string& value_mode, const std::string& value_layout,
                                  int64_t group_size, const std::optional<at::Tensor>& key_x_scale,
                                  const std::optional<at::Tensor>& attn_mask, int64_t split_tokens,
                                  const std::optional<at::Tensor>& lengths, double q_scale,
                                  std::optional<at::ScalarType> out_dtype) {
  const char* op = "decode_attention_fused";
  const AttentionSizes z = check_decode_attention_fused(
      x, sink_keys, sink_values, key_codes, key_scales, key_zeros, value_codes, value_scales, value_zeros, key_tail,
      value_tail, key_bits, key_mode, key_layout, value_bits, value_mode, value_layout, group_size, key_x_scale,
      attn_mask, split_tokens, lengths, q_scale, out_dtype);
  const at::Device device = x.device();
  check_cuda(op, "x", x, device);
  check_cache_operands_on(op, device, sink_keys, sink_values, key_codes, key_scales, key_zeros, value_codes,
                          value_scales, value_zeros, key_tail, value_tail, key_x_scale);
  if (attn_mask.has_value()) check_cuda(op, "attn_mask", *attn_mask, device);
  // device lengths: the counts stay on the device (read by each CTA); the launch is planned for the capacities
  if (lengths.has_value()) check_cuda(op, "lengths", *lengths, device);
  TORCH_CHECK_VALUE(z.D == 64 || z.D == 128, "kvkernels.", op, ": the CUDA kernel takes head_dim in (64, 128), got ",
                    z.D, "; kvkernels.reference.decode_attention_fused computes any head_dim");

  const c10::cuda::CUDAGuard device_guard(device);
  at::Tensor out = at::empty({z.B, z.H_q, z.T, z.D}, x.options().dtype(out_dtype.value_or(at::kFloat)));
  if (out.numel() == 0) return out;

  kvk::DecodeAttentionParams p{};
  p.x = x.const_data_ptr();
  p.x_dtype = activation_dtype(op, "x", x);
  p.q_scale = static_cast<float>(q_scale);
  p.sink_k = attention_window(sink_keys);
  p.sink_v = attention_window(sink_values);
  p.tail_k = attention_window(key_tail);
  p.tail_v = attention_window(value_tail);
  p.keys = attention_store(key_codes, key_scales, key_zeros, z.mk, key_bits, z.key_mode, z.key_cols);
  p.values = attention_store(value_codes, value_scales, value_zeros, z.mv, value_bits, z.value_mode, z.value_cols);
  p.window_dtype = activation_dtype(op, "sink_keys", sink_keys);
  p.key_x_scale = key_x_scale.has_value() ? key_x_scale->const_data_ptr<float>() : nullptr;
  p.xs_sh = key_x_scale.has_value() ? key_x_scale->stride(0) : 0;
  if (attn_mask.has_value()) {
    const at::Tensor& m = *attn_mask;
    p.mask = m.const_data_ptr<float>();
    p.m_sb = m.size(0) == 1 ? 0 : m.stride(0);  // a broadcast dim reads its one row
    p.m_sh = m.size(1) == 1 ? 0 : m.stride(1);
    p.m_st = m.stride(2);
  }
  p.out = out.data_ptr();
  p.out_dtype = activation_dtype(op, "out", out);
  p.B = z.B, p.H_q = z.H_q, p.H_kv = z.H_kv, p.T = z.T, p.N = z.N;
  p.D = static_cast<int>(z.D);
  p.group_size = static_cast<int>(group_size);
  p.split_tokens = split_tokens;
  p.num_sms = num_sms();
  p.x_sb = x.stride(0), p.x_sh = x.stride(1), p.x_st = x.stride(2);
  p.o_sb = out.stride(0), p.o_sh = out.stride(1), p.o_st = out.stride(2);
  p.lengths = lengths.has_value() ? lengths->const_data_ptr<int64_t>() : nullptr;
  const int64_t ws_floats = kvk::decode_attention_workspace_floats(p);
  at::Tensor ws;
  if (ws_floats > 0) {
    ws = at::empty({ws_floats}, x.options().dtype(at::kFloat));
    p.workspace = ws.data_ptr<float>();
    p.workspace_floats = ws_floats;
  }
  check_launch(op, kvk::launch_decode_attention_fused(p, current_stream()));
  return out;
}

// ---- static append ---------------------------------------------------------------------------------------------

kvk::AppendSide append_side(const at::Tensor& x, const at::Tensor& sink, const at::Tensor& tail,
                            const at::Tensor& codes, const at::Tensor& scales, const std::optional<at::Tensor>& zeros,
                            int64_t bits, kvk::QuantMode mode, bool cols, double eta) {
  kvk::AppendSide a{};
  a.x = x.const_data_ptr();
  a.x_sb = x.stride(0), a.x_sh = x.stride(1), a.x_st = x.stride(2);
  a.sink = sink.numel() ? sink.data_ptr() : nullptr;
  a.sk_sb = sink.stride(0), a.sk_sh = sink.stride(1), a.sk_st = sink.stride(2);
  a.tail = tail.numel() ? tail.data_ptr() : nullptr;
  a.t_sb = tail.stride(0), a.t_sh = tail.stride(1), a.t_st = tail.stride(2), a.tail_cap = tail.size(2);
  a.codes = reinterpret_cast<uint32_t*>(codes.data_ptr<int32_t>());
  a.scales = reinterpret_cast<uint16_t*>(scales.data_ptr<at::Half>());
  a.zeros = zeros.has_value() ? reinterpret_cast<uint16_t*>(zeros->data_ptr<at::Half>()) : nullptr;
  a.c_sb = codes.stride(0), a.c_sh = codes.stride(1), a.c_sr = codes.stride(2);
  a.s_sb = scales.stride(0), a.s_sh = scales.stride(1), a.s_sr = scales.stride(2);
  if (zeros.has_value()) a.z_sb = zeros->stride(0), a.z_sh = zeros->stride(1), a.z_sr = zeros->stride(2);
  a.cap = cols ? codes.size(3) / bits * kBlock : codes.size(2);
  a.bits = static_cast<int>(bits);
  a.mode = mode;
  a.layout = cols ? kvk::StoreLayout::kCols : kvk::StoreLayout::kRows;
  a.calib = kvk::asym_calib(eta);  // as quantize_groups_into
  return a;
}

void static_append(const at::Tensor& k, const at::Tensor& v, at::Tensor lengths, at::Tensor sink_keys,
                   at::Tensor sink_values, at::Tensor key_codes, at::Tensor key_scales,
                   const std::optional<at::Tensor>& key_zeros, at::Tensor value_codes, at::Tensor value_scales,
                   const std::optional<at::Tensor>& value_zeros, at::Tensor key_tail, at::Tensor value_tail,
                   int64_t key_bits, const std::string& key_mode, const std::string& key_layout, double key_eta,
                   int64_t value_bits, const std::string& value_mode, const std::string& value_layout,
                   double value_eta, int64_t group_size, int64_t w_recent,
                   const std::optional<at::Tensor>& key_x_scale) {
  const char* op = "static_append";
  const AppendSizes z = check_static_append(
      k, v, lengths, sink_keys, sink_values, key_codes, key_scales, key_zeros, value_codes, value_scales, value_zeros,
      key_tail, value_tail, key_bits, key_mode, key_layout, key_eta, value_bits, value_mode, value_layout, value_eta,
      group_size, w_recent, key_x_scale);
  const at::Device device = k.device();
  check_cuda(op, "k", k, device);
  check_cuda(op, "v", v, device);
  check_cuda(op, "lengths", lengths, device);
  check_cache_operands_on(op, device, sink_keys, sink_values, key_codes, key_scales, key_zeros, value_codes,
                          value_scales, value_zeros, key_tail, value_tail, key_x_scale);

  const c10::cuda::CUDAGuard device_guard(device);
  kvk::StaticAppendParams p{};
  p.side[0] = append_side(k, sink_keys, key_tail, key_codes, key_scales, key_zeros, key_bits, z.key_mode, z.key_cols,
                          key_eta);
  p.side[1] = append_side(v, sink_values, value_tail, value_codes, value_scales, value_zeros, value_bits,
                          z.value_mode, z.value_cols, value_eta);
  if (key_x_scale.has_value()) {
    p.side[0].x_scale = key_x_scale->const_data_ptr<float>();
    p.side[0].xs_sh = key_x_scale->stride(0);
  }
  p.lengths = lengths.data_ptr<int64_t>();
  p.B = z.B, p.H = z.H, p.n = z.n, p.W = z.W, p.D = z.D;
  p.w_recent = w_recent;
  p.group_size = static_cast<int>(group_size);
  p.elem_bytes = static_cast<int>(k.element_size());
  p.dtype = activation_dtype(op, "k", k);
  check_launch(op, kvk::launch_static_append(p, current_stream()));
}

}  // namespace
}  // namespace kvk_cuda

TORCH_LIBRARY_IMPL(kvkernels, CUDA, m) {
  m.impl("pack_bits", &kvk_cuda::pack_bits);
  m.impl("unpack_bits", &kvk_cuda::unpack_bits);
  m.impl("quantize_groups", &kvk_cuda::quantize_groups);
  m.impl("quantize_groups_into", &kvk_cuda::quantize_groups_into);
  m.impl("dequantize_groups", &kvk_cuda::dequantize_groups);
  m.impl("gemv_inner_q", &kvk_cuda::gemv_inner_q);
  m.impl("gemv_kivi", &kvk_cuda::gemv_kivi);
  m.impl("gemv_inner_q_into", &kvk_cuda::gemv_inner_q_into);
  m.impl("gemv_kivi_into", &kvk_cuda::gemv_kivi_into);
  m.impl("gemv_workspace_numel", &kvk_cuda::gemv_workspace_numel);
  m.impl("gemv_lattice_k", &kvk_cuda::gemv_lattice_k);
  m.impl("gemv_lattice_v", &kvk_cuda::gemv_lattice_v);
  m.impl("aqua_reconstruct", &kvk_cuda::aqua_reconstruct);
  m.impl("decode_attention_fused", &kvk_cuda::decode_attention_fused);
  m.impl("static_append", &kvk_cuda::static_append);
}
