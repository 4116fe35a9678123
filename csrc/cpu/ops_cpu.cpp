// CPU implementations of the storage ops, written over the same host/device helpers the CUDA kernels use
// (csrc/kvkernels/*.cuh). Their job is twofold: a fast-enough CPU path, and CPU CI coverage of the exact
// bit logic of the kernels (tests/test_packing.py and tests/test_quant.py compare them to the reference).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/Dispatch_v2.h>

#include <string>
#include <vector>

#include "kvkernels/packing.cuh"
#include "kvkernels/quant.cuh"
#include "op_checks.h"

namespace kvk_cpu {

using namespace kvk_checks;

// The dispatcher sends a call here when its highest-priority tensor is on the CPU; the others may still be on
// another device (a CUDA or meta output, say), which these kernels must not touch.
void check_cpu(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), "kvkernels.", op, ": all tensors must be on one device (cpu), ", name,
                    " is on ", t.device());
}

at::Tensor pack_bits(const at::Tensor& codes, int64_t bits) {
  check_pack(codes, bits);
  check_cpu("pack_bits", "codes", codes);
  // Read the codes in their own dtype: a widening copy (uint8 -> int64) would cost 8x the input in memory.
  const at::Tensor flat = codes.contiguous();
  const int64_t n = flat.numel(), nblocks = n / kvk::kBlockValues;
  auto sizes = codes.sizes().vec();
  sizes.back() = sizes.back() / kvk::kBlockValues * bits;
  at::Tensor out = at::empty(sizes, codes.options().dtype(at::kInt));
  uint32_t* dst = reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>());
  AT_DISPATCH_V2(
      flat.scalar_type(), "pack_bits", AT_WRAP([&] {
        const scalar_t* src = flat.const_data_ptr<scalar_t>();
        at::parallel_for(0, nblocks, 1024, [&](int64_t begin, int64_t end) {
          uint32_t block[kvk::kBlockValues];
          for (int64_t b = begin; b < end; ++b) {
            // the low 32 bits, as the int64 -> uint32 cast did; pack_block masks to `bits` anyway
            for (int i = 0; i < kvk::kBlockValues; ++i)
              block[i] = static_cast<uint32_t>(static_cast<uint64_t>(src[b * kvk::kBlockValues + i]));
            kvk::pack_block_rt(block, dst + b * bits, static_cast<int>(bits));
          }
        });
      }),
      AT_EXPAND(AT_INTEGRAL_TYPES_V2));
  return out;
}

at::Tensor unpack_bits(const at::Tensor& packed, int64_t bits) {
  check_unpack(packed, bits);
  check_cpu("unpack_bits", "packed", packed);
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
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_unchecked(const at::Tensor& x, int64_t bits,
                                                                  int64_t group_size, const std::string& mode,
                                                                  double eta) {
  const kvk::QuantMode qmode = parse_mode("quantize_groups", mode);
  const int64_t L = x.size(-1);
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

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_groups(const at::Tensor& x, int64_t bits, int64_t group_size,
                                                               const std::string& mode, double eta) {
  check_quantize("quantize_groups", x, bits, group_size, mode, eta);
  check_cpu("quantize_groups", "x", x);
  return quantize_unchecked(x, bits, group_size, mode, eta);
}

void quantize_groups_into(const at::Tensor& x, int64_t bits, int64_t group_size, const std::string& mode, double eta,
                          at::Tensor codes, at::Tensor scales, at::Tensor zeros) {
  const char* op = "quantize_groups_into";
  check_quantize_into(x, bits, group_size, mode, eta, codes, scales, zeros);
  check_cpu(op, "x", x);
  check_cpu(op, "codes", codes);
  check_cpu(op, "scales", scales);
  check_cpu(op, "zeros", zeros);
  auto [c, s, z] = quantize_unchecked(x, bits, group_size, mode, eta);
  codes.copy_(c);
  scales.copy_(s);
  zeros.copy_(z);
}

at::Tensor dequantize_groups(const at::Tensor& codes, const at::Tensor& scales, const std::optional<at::Tensor>& zeros,
                             int64_t bits, int64_t group_size, const std::string& mode) {
  const char* op = "dequantize_groups";
  const int64_t L = check_dequantize(codes, scales, zeros, bits, group_size, mode);
  check_cpu(op, "codes", codes);
  check_cpu(op, "scales", scales);
  if (zeros.has_value()) check_cpu(op, "zeros", *zeros);
  const kvk::QuantMode qmode = parse_mode(op, mode);
  const at::Tensor c = codes.contiguous();
  const at::Tensor s = scales.contiguous();
  const at::Tensor z = zeros.has_value() ? zeros->contiguous() : at::zeros_like(s);
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
