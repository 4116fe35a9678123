// CPU implementations of the storage ops, written over the same host/device helpers the CUDA kernels use
// (csrc/kvkernels/*.cuh). Their job is twofold: a fast-enough CPU path, and CPU CI coverage of the exact
// bit logic of the kernels (tests/test_packing.py and tests/test_quant.py compare them to the reference).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <string>
#include <vector>

#include "kvkernels/packing.cuh"
#include "kvkernels/quant.cuh"

namespace kvk_cpu {

kvk::QuantMode parse_mode(const std::string& mode) {
  if (mode == "sym") return kvk::QuantMode::kSym;
  if (mode == "asym") return kvk::QuantMode::kAsym;
  if (mode == "hybrid") return kvk::QuantMode::kHybrid;
  TORCH_CHECK(false, "kvkernels: mode must be 'sym', 'asym' or 'hybrid', got '", mode, "'");
}

void check_bits(int64_t bits) { TORCH_CHECK(kvk::is_supported_bits(bits), "kvkernels: bits must be 1..4, got ", bits); }

at::Tensor pack_bits(const at::Tensor& codes, int64_t bits) {
  check_bits(bits);
  TORCH_CHECK(codes.dim() >= 1 && codes.size(-1) % kvk::kBlockValues == 0,
              "kvkernels.pack_bits: last dim must be a multiple of 32, got shape ", codes.sizes());
  const at::Tensor flat = codes.to(at::kLong).contiguous();
  const int64_t n = flat.numel(), nblocks = n / kvk::kBlockValues;
  auto sizes = codes.sizes().vec();
  sizes.back() = sizes.back() / kvk::kBlockValues * bits;
  at::Tensor out = at::empty(sizes, codes.options().dtype(at::kInt));
  const int64_t* src = flat.data_ptr<int64_t>();
  uint32_t* dst = reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>());
  at::parallel_for(0, nblocks, 1024, [&](int64_t begin, int64_t end) {
    uint32_t block[kvk::kBlockValues];
    for (int64_t b = begin; b < end; ++b) {
      for (int i = 0; i < kvk::kBlockValues; ++i) block[i] = static_cast<uint32_t>(src[b * kvk::kBlockValues + i]);
      kvk::pack_block_rt(block, dst + b * bits, static_cast<int>(bits));
    }
  });
  return out;
}

at::Tensor unpack_bits(const at::Tensor& packed, int64_t bits) {
  check_bits(bits);
  TORCH_CHECK(packed.scalar_type() == at::kInt, "kvkernels.unpack_bits: packed must be int32");
  TORCH_CHECK(packed.dim() >= 1 && packed.size(-1) % bits == 0,
              "kvkernels.unpack_bits: last dim must be a multiple of bits=", bits, ", got shape ", packed.sizes());
  const at::Tensor flat = packed.contiguous();
  const int64_t nblocks = flat.numel() / bits;
  auto sizes = packed.sizes().vec();
  sizes.back() = sizes.back() / bits * kvk::kBlockValues;
  at::Tensor out = at::empty(sizes, packed.options().dtype(at::kByte));
  const uint32_t* src = reinterpret_cast<const uint32_t*>(flat.data_ptr<int32_t>());
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, nblocks, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int i = 0; i < kvk::kBlockValues; ++i)
        dst[b * kvk::kBlockValues + i] = static_cast<uint8_t>(kvk::unpack_one_rt(src + b * bits, i, (int)bits));
  });
  return out;
}

// Quantizes every group of x (last dim) into contiguous temporaries; the _into variant copies them out.
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_groups(const at::Tensor& x, int64_t bits, int64_t group_size,
                                                               const std::string& mode, double eta) {
  check_bits(bits);
  const kvk::QuantMode qmode = parse_mode(mode);
  const int64_t L = x.size(-1);
  TORCH_CHECK(group_size > 0 && group_size % kvk::kBlockValues == 0 && L % group_size == 0,
              "kvkernels.quantize_groups: group_size must be a positive multiple of 32 dividing L=", L, ", got ",
              group_size);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t ngroups = xf.numel() / group_size;
  auto code_sizes = x.sizes().vec();
  code_sizes.back() = L / kvk::kBlockValues * bits;
  auto group_sizes = x.sizes().vec();
  group_sizes.back() = L / group_size;
  at::Tensor codes = at::empty(code_sizes, x.options().dtype(at::kInt));
  at::Tensor scales = at::empty(group_sizes, x.options().dtype(at::kHalf));
  at::Tensor zeros = at::empty(group_sizes, x.options().dtype(at::kHalf));
  const float* src = xf.data_ptr<float>();
  uint32_t* code_dst = reinterpret_cast<uint32_t*>(codes.data_ptr<int32_t>());
  uint16_t* scale_dst = reinterpret_cast<uint16_t*>(scales.data_ptr<at::Half>());
  uint16_t* zero_dst = reinterpret_cast<uint16_t*>(zeros.data_ptr<at::Half>());
  const int G = static_cast<int>(group_size), b = static_cast<int>(bits);
  const kvk::AsymCalib calib = kvk::asym_calib(eta);
  at::parallel_for(0, ngroups, 64, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> group_codes(G), scratch(G);
    for (int64_t g = begin; g < end; ++g) {
      const float* xg = src + g * G;
      kvk::GroupQuant q;
      if (qmode == kvk::QuantMode::kSym) {
        q = kvk::quantize_group_sym(xg, G, b, group_codes.data());
      } else if (qmode == kvk::QuantMode::kAsym) {
        q = kvk::quantize_group_asym(xg, G, b, calib, group_codes.data());
      } else {
        q = kvk::quantize_group_hybrid(xg, G, b, group_codes.data(), scratch.data());
      }
      scale_dst[g] = q.scale_bits;
      zero_dst[g] = q.zero_bits;
      // groups are whole 32-value blocks, so a group's words start at g * (G / 32) * bits
      for (int blk = 0; blk < G / kvk::kBlockValues; ++blk)
        kvk::pack_block_rt(group_codes.data() + blk * kvk::kBlockValues,
                           code_dst + (g * (G / kvk::kBlockValues) + blk) * b, b);
    }
  });
  return {codes, scales, zeros};
}

void quantize_groups_into(const at::Tensor& x, int64_t bits, int64_t group_size, const std::string& mode, double eta,
                          at::Tensor codes, at::Tensor scales, at::Tensor zeros) {
  auto [c, s, z] = quantize_groups(x, bits, group_size, mode, eta);
  codes.copy_(c);
  scales.copy_(s);
  zeros.copy_(z);
}

at::Tensor dequantize_groups(const at::Tensor& codes, const at::Tensor& scales, const std::optional<at::Tensor>& zeros,
                             int64_t bits, int64_t group_size, const std::string& mode) {
  check_bits(bits);
  const kvk::QuantMode qmode = parse_mode(mode);
  TORCH_CHECK(qmode == kvk::QuantMode::kSym || zeros.has_value(), "kvkernels.dequantize_groups: mode '", mode,
              "' needs zeros");
  const at::Tensor c = codes.contiguous();
  const at::Tensor s = scales.to(at::kHalf).contiguous();
  const at::Tensor z = zeros.has_value() ? zeros->to(at::kHalf).contiguous() : at::zeros_like(s);
  const int64_t L = codes.size(-1) / bits * kvk::kBlockValues;
  auto sizes = codes.sizes().vec();
  sizes.back() = L;
  at::Tensor out = at::empty(sizes, codes.options().dtype(at::kFloat));
  const uint32_t* cw = reinterpret_cast<const uint32_t*>(c.data_ptr<int32_t>());
  const uint16_t* sw = reinterpret_cast<const uint16_t*>(s.data_ptr<at::Half>());
  const uint16_t* zw = reinterpret_cast<const uint16_t*>(z.data_ptr<at::Half>());
  float* dst = out.data_ptr<float>();
  const int64_t nblocks = out.numel() / kvk::kBlockValues;
  const int64_t blocks_per_group = group_size / kvk::kBlockValues;
  at::parallel_for(0, nblocks, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t g = blk / blocks_per_group;
      const kvk::GroupAffine a = kvk::group_affine_rt(qmode, (int)bits, sw[g], zw[g]);
      for (int i = 0; i < kvk::kBlockValues; ++i)
        dst[blk * kvk::kBlockValues + i] =
            a.s * static_cast<float>(kvk::unpack_one_rt(cw + blk * bits, i, (int)bits)) + a.zeff;
    }
  });
  return out;
}

}  // namespace kvk_cpu

TORCH_LIBRARY_IMPL(kvkernels, CPU, m) {
  m.impl("pack_bits", &kvk_cpu::pack_bits);
  m.impl("unpack_bits", &kvk_cpu::unpack_bits);
  m.impl("quantize_groups", &kvk_cpu::quantize_groups);
  m.impl("quantize_groups_into", &kvk_cpu::quantize_groups_into);
  m.impl("dequantize_groups", &kvk_cpu::dequantize_groups);
}
