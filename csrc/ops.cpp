// The one place kvkernels op schemas are defined. Implementations register elsewhere:
//   CPU   : csrc/cpu/ops_cpu.cpp (C++ over the shared headers) and kvkernels/ops.py (the PyTorch reference)
//   CUDA  : csrc/cuda/torch_bindings.cpp (compiled kernels), else kvkernels/ops.py registers the Triton ones
//   Meta  : kvkernels/ops.py (register_fake), so torch.compile can trace every op.
// Shapes, dtypes and formulas: docs/FORMATS.md; argument checks with readable errors: kvkernels/ops.py.
#include <Python.h>
#include <torch/library.h>

// `import kvkernels._C` only has to run the static registrations below; the module itself is empty.
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}

TORCH_LIBRARY(kvkernels, m) {
  // codes [..., N] (any integer dtype, values < 2^bits), N % 32 == 0  ->  int32 [..., N * bits / 32]
  m.def("pack_bits(Tensor codes, int bits) -> Tensor");
  // int32 [..., W], W % bits == 0  ->  uint8 codes [..., W * 32 / bits]
  m.def("unpack_bits(Tensor packed, int bits) -> Tensor");
  // Group quantization along the last dim (groups of group_size). mode: "sym" | "asym" | "hybrid".
  // eta (asym only): calibrated zero/scale, 0 = plain min/max. Returns (codes int32 [..., L*bits/32],
  // scales fp16 [..., L/G], zeros fp16 [..., L/G]); zeros are all 0 for sym.
  m.def("quantize_groups(Tensor x, int bits, int group_size, str mode, float eta=0.0) -> (Tensor, Tensor, Tensor)");
  // Same, written into caller buffers (narrowed views of a preallocated cache; any row strides). The mode
  // argument is named quant_mode here because torch's functionalization of mutating ops passes its own `mode`.
  m.def(
      "quantize_groups_into(Tensor x, int bits, int group_size, str quant_mode, float eta, Tensor(a!) codes, "
      "Tensor(b!) scales, Tensor(c!) zeros) -> ()");
  // Inverse of quantize_groups: fp32 [..., L].
  m.def("dequantize_groups(Tensor codes, Tensor scales, Tensor? zeros, int bits, int group_size, str mode) -> Tensor");
  // InnerQ fused dequant-GEMV, groups along the reduction dim L:
  //   y[b, h, t, m] = sum_l x[b, h, t, l] * x_scale[h_kv, l] * deq(codes[b, h_kv, m, l]),  h_kv = h / (H_q / H_kv)
  // x [B, H_q, L] or [B, H_q, T, L] (fp16/bf16/fp32); codes int32 [B, H_kv, M, L*bits/32];
  // scales/zeros fp16 [B, H_kv, M, L/G]; x_scale fp32 [H_kv, L] or None. Returns fp32 [B, H_q, (T,) M].
  m.def(
      "gemv_inner_q(Tensor x, Tensor codes, Tensor scales, Tensor? zeros, int bits, int group_size, str mode, "
      "Tensor? x_scale=None) -> Tensor");
  // KIVI-layout fused dequant-GEMV, reduction over rows, groups along the packed columns C:
  //   y[b, h, t, c] = sum_r x[b, h, t, r] * deq(codes[b, h_kv, r, c]),  scale/zero per (r, c / G)
  // x [B, H_q, R] or [B, H_q, T, R]; codes int32 [B, H_kv, R, C*bits/32]; scales/zeros fp16 [B, H_kv, R, C/G].
  // Returns fp32 [B, H_q, (T,) C].
  m.def("gemv_kivi(Tensor x, Tensor codes, Tensor scales, Tensor zeros, int bits, int group_size) -> Tensor");
  // The GEMVs written into the caller's `out` (fp32, the functional result's shape, stride 1 in the last dim: e.g. a
  // slice of a wider scores buffer) with an optional caller-provided split-K workspace (fp32, contiguous, at least
  // gemv_workspace_numel floats; None: allocated per call): no allocation on the hot path, fixed buffers for graphs.
  // (quant_mode is gemv_inner_q's mode: torch's functionalization of mutable ops passes the arguments by name, and a
  // `mode` argument collides with its own; torch 2.13, opcheck's test_aot_dispatch_dynamic.)
  m.def(
      "gemv_inner_q_into(Tensor x, Tensor codes, Tensor scales, Tensor? zeros, int bits, int group_size, "
      "str quant_mode, Tensor? x_scale, Tensor(a!) out, Tensor(b!)? workspace=None) -> ()");
  m.def(
      "gemv_kivi_into(Tensor x, Tensor codes, Tensor scales, Tensor zeros, int bits, int group_size, Tensor(a!) out, "
      "Tensor(b!)? workspace=None) -> ()");
  // Floats of workspace the _into form of op ("gemv_inner_q" / "gemv_kivi") needs for these tensors (0: none; the
  // CUDA plan depends on shapes, strides, alignment and the device). Not traceable: ask before capturing a graph.
  m.def(
      "gemv_workspace_numel(str op, Tensor x, Tensor codes, Tensor scales, Tensor? zeros, int bits, int group_size, "
      "str mode='asym', Tensor? x_scale=None) -> int");

  // Lattice (HIGGS-style) format, docs/FORMATS.md "Lattice". grid: fp32 [n, d], (d, n) in {(2,16), (2,64), (2,256),
  // (4,256)}, bits = log2(n) / d; group_size G: power of two in [32, 1024]; signs: None or int8 [G] of +-1.
  // Orthonormal Walsh-Hadamard transform of each group of G along the last dim (inverse: signs applied after). fp32.
  m.def("fwht(Tensor x, int group_size, Tensor? signs=None, bool inverse=False) -> Tensor");
  // x [..., C] -> (codes int32 [..., C*bits/32], norms fp16 [..., C/G]): rotate, divide by the group RMS, nearest
  // grid point per d-vector (first on ties).
  m.def("lattice_quantize(Tensor x, Tensor grid, int group_size, Tensor? signs=None) -> (Tensor, Tensor)");
  // Inverse of lattice_quantize: fp32 [..., C].
  m.def("lattice_dequantize(Tensor codes, Tensor norms, Tensor grid, int group_size, Tensor? signs=None) -> Tensor");
  // Keys: scores[b, h, t, n] = q[b, h, t] . deq(codes[b, h_kv, n]), scored on the codes after rotating q.
  // q [B, H_q, D] or [B, H_q, T, D]; codes int32 [B, H_kv, N, D*bits/32]; norms fp16 [B, H_kv, N, D/G]. fp32.
  m.def(
      "gemv_lattice_k(Tensor q, Tensor codes, Tensor norms, Tensor grid, int group_size, Tensor? signs=None) -> "
      "Tensor");
  // Values: out[b, h, t] = sum_n p[b, h, t, n] * deq(codes[b, h_kv, n]), reduced in the rotated domain, one inverse
  // transform per row. p [B, H_q, N] or [B, H_q, T, N]; codes/norms as gemv_lattice_k. fp32 [B, H_q, (T,) D].
  m.def(
      "gemv_lattice_v(Tensor p, Tensor codes, Tensor norms, Tensor grid, int group_size, Tensor? signs=None) -> "
      "Tensor");

  // AQUA-KV reconstruction of a block of T tokens of one layer (docs/FORMATS.md "AQUA-KV"), C = H_kv * head_dim:
  //   out = ((prev @ weight^T + prev2 @ weight2^T) + bias) + lattice_dequantize(codes, norms)    fp32 [T, C]
  // prev [T, C_in], weight [C, C_in] (fp16/bf16/fp32, one dtype); bias fp32 [C]; codes int32 [T, C*bits/32];
  // norms fp16 [T, C/G]; grid/group_size/signs as the lattice ops; prev2 [T, C_in2] + weight2 [C, C_in2] (both or
  // neither): the value predictor's second input, a second accumulating GEMM instead of a concatenation.
  m.def(
      "aqua_reconstruct(Tensor prev, Tensor weight, Tensor bias, Tensor codes, Tensor norms, Tensor grid, "
      "int group_size, Tensor? signs=None, Tensor? prev2=None, Tensor? weight2=None) -> Tensor");

  // Decode attention over one layer's quantized cache in one op (kvkernels/reference/attention.py is the spec):
  //   out = softmax(x K^T + mask) V    fp32 [B, H_q, T, D],   query head h reads KV head h / (H_q / H_kv)
  // x fp32 [B, H_q, T, D] (queries times the softmax scale). Keys and values are each, in token order, a window-dtype
  // sink [B, H_kv, S, D] | a quantized store | a window-dtype tail [B, H_kv, *, D]; a store in layout "rows" is
  // codes int32 [B, H_kv, m, D*bits/32] + scales/zeros fp16 [B, H_kv, m, D/G], "cols" is codes [B, H_kv, D,
  // m*bits/32] + scales/zeros [B, H_kv, D, m/G]; zeros None for sym. Stored keys are K / key_x_scale (fp32 [H_kv, D])
  // when it is given. attn_mask: additive fp32 [B|1, H_q|1, T, N], None = causal among the last T tokens.
  // split_tokens: tokens per split-KV chunk (a multiple of G; 0 = the kernel plans), never changes the result.
  // lengths: int64 [5] on the device, (S, key store, key tail, value store, value tail) tokens used: the parts are then
  // capacity buffers and no token count is read on the host, so the call can be captured in a CUDA graph.
  m.def(
      "decode_attention_fused(Tensor x, Tensor sink_keys, Tensor sink_values, Tensor key_codes, Tensor key_scales, "
      "Tensor? key_zeros, Tensor value_codes, Tensor value_scales, Tensor? value_zeros, Tensor key_tail, "
      "Tensor value_tail, int key_bits, str key_mode, str key_layout, int value_bits, str value_mode, "
      "str value_layout, int group_size, Tensor? key_x_scale=None, Tensor? attn_mask=None, int split_tokens=0, "
      "Tensor? lengths=None, float q_scale=1., ScalarType? out_dtype=None) -> Tensor");
  // One decode step's append into a static cache: decode_attention_fused's lengths= operands as capacity buffers,
  // written in place (kvkernels/reference/static_append.py is the spec). k, v [B, H_kv, n, D] in the windows' dtype:
  // the first tokens fill the sink while it has room, the others join the tails, and each tail's oldest tokens past
  // w_recent (whole groups of G for a "cols" store) are quantized into its store (keys stored as K / key_x_scale);
  // lengths grows accordingly. Reads no count on the host: a step can be captured in a CUDA graph.
  m.def(
      "static_append(Tensor k, Tensor v, Tensor(a!) lengths, Tensor(b!) sink_keys, Tensor(c!) sink_values, "
      "Tensor(d!) key_codes, Tensor(e!) key_scales, Tensor(f!)? key_zeros, Tensor(g!) value_codes, "
      "Tensor(h!) value_scales, Tensor(i!)? value_zeros, Tensor(j!) key_tail, Tensor(k!) value_tail, int key_bits, "
      "str key_mode, str key_layout, float key_eta, int value_bits, str value_mode, str value_layout, "
      "float value_eta, int group_size, int w_recent, Tensor? key_x_scale=None) -> ()");
}
