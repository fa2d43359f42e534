// The int8 weight packing both int8 linears read (int8_linear.cpp with VNNI, int8_linear_avx2.cpp without), and
// the operators' schema: one layout and one signature, whichever kernel this CPU's build holds.
#pragma once

#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace tokenloom {

constexpr int kInt8Block = 16;  // output features per packed block
constexpr int kInt8Group = 4;   // inputs per 32-bit lane (VNNI's vpdpbusd; the AVX2 kernel reads a lane as 2 pairs)
// Inputs per activation scale where a row's int8 codes carry one per group (the VNNI kernel's grouped steps): the
// rotation's block (quantization.py), so a group's outliers stay in their group.
constexpr int kInt8ScaleGroup = 64;

// w: [N, K] int8 codes -> ([N / 16, K / 4, 16, 4] as [N / 16, K * 16] int8, the features' code sums [N] int32): for
// each block of 16 output features, the K inputs in groups of 4, 16 features x 4 inputs to 64 bytes.
inline std::tuple<at::Tensor, at::Tensor> int8_pack_weight(const at::Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kChar && w.dim() == 2, "int8_pack_weight: int8 [N, K]");
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(n % kInt8Block == 0 && k % kInt8Group == 0, "int8_pack_weight: N a multiple of 16, K of 4");
  const at::Tensor src = w.contiguous();
  at::Tensor packed = at::empty({n / kInt8Block, k * kInt8Block}, w.options());
  at::Tensor sums = at::empty({n}, w.options().dtype(at::kInt));
  const int8_t* s = src.const_data_ptr<int8_t>();
  int8_t* d = packed.mutable_data_ptr<int8_t>();
  int32_t* total = sums.mutable_data_ptr<int32_t>();
  for (int64_t f = 0; f < n; ++f) {
    const int64_t block = f / kInt8Block, lane = f % kInt8Block;
    int32_t sum = 0;
    for (int64_t i = 0; i < k; ++i) {
      d[block * k * kInt8Block + (i / kInt8Group) * kInt8Block * kInt8Group + lane * kInt8Group + i % kInt8Group] =
          s[f * k + i];
      sum += s[f * k + i];
    }
    total[f] = sum;
  }
  return {packed, sums};
}

// fused.cpp's quantize_rows_int8 operator, for a kernel that quantizes its rows itself (int8_linear_rows).
std::tuple<at::Tensor, at::Tensor> quantize_rows_int8(const at::Tensor& x, const std::optional<at::Tensor>& signs,
                                                      int64_t group, bool shifted);

inline void define_int8_linear_ops(torch::Library& m) {
  m.def("int8_pack_weight(Tensor w) -> (Tensor, Tensor)");
  m.def(
      "int8_linear(Tensor codes, Tensor row_scales, Tensor packed, Tensor code_sums, Tensor weight_scales, "
      "Tensor? bias, ScalarType out_dtype, bool gated=False) -> Tensor");
}

}  // namespace tokenloom
