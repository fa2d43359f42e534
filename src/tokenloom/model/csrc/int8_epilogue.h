// How every int8 linear turns its exact int32 sums into outputs (--quantization int8): int8_linear.cpp (VNNI),
// amx_int8_linear.cpp (AMX) and, after oneDNN's matmul, fused.cpp's scale_rows. One definition, so all three give
// the same bits and a request's output does not depend on which kernel its step ran on.
//
//   y = (sum x weight_scale) x row_scale + bias          (oneDNN applies the weight scale inside its matmul)
//   gated ([gate; up] interleaved per 16 features): silu(y_gate) x y_up (avx512_exp.h's silu_times), from the
//   float32 values, before anything is rounded.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <optional>

namespace tokenloom {

// The checks every int8 epilogue makes of the row scales [M, 1] (or [M, G], one per group of a row's inputs, where
// the kernel takes them), the bias [N] and the output dtype; returns the bias as float32, or an undefined tensor
// without one.
inline at::Tensor checked_rows_and_bias(const char* name, const at::Tensor& row_scales, int64_t m, int64_t n,
                                        const std::optional<at::Tensor>& bias, at::ScalarType out_dtype,
                                        int64_t groups = 1) {
  TORCH_CHECK(row_scales.scalar_type() == at::kFloat && row_scales.numel() == m * groups && row_scales.is_contiguous(),
              name, groups == 1 ? ": row_scales must be float32 [M, 1]" : ": row_scales must be float32 [M, G]");
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16, name, ": float32 or bfloat16 out");
  if (!bias.has_value()) return {};
  TORCH_CHECK(bias->numel() == n, name, ": bias must be [N]");
  return bias->to(at::kFloat).contiguous();
}

// And the weight's scales [N], which the int8 kernels apply themselves (oneDNN does before scale_rows).
inline at::Tensor checked_scales_and_bias(const char* name, const at::Tensor& row_scales, int64_t m,
                                          const at::Tensor& weight_scales, int64_t n,
                                          const std::optional<at::Tensor>& bias, at::ScalarType out_dtype,
                                          int64_t groups = 1) {
  TORCH_CHECK(weight_scales.scalar_type() == at::kFloat && weight_scales.numel() == n && weight_scales.is_contiguous(),
              name, ": weight scales float32 [N]");
  return checked_rows_and_bias(name, row_scales, m, n, bias, out_dtype, groups);
}

// f(out's data), typed float* or c10::BFloat16* as out is.
template <typename F>
void with_output_data(at::Tensor& out, const F& f) {
  if (out.scalar_type() == at::kFloat) {
    f(out.mutable_data_ptr<float>());
  } else {
    f(out.mutable_data_ptr<c10::BFloat16>());
  }
}

}  // namespace tokenloom

#if defined(__AVX512F__)
#include <immintrin.h>

#include "avx512_exp.h"

namespace tokenloom {

inline __m512 scale_sums(__m512 weighted_sums, __m512 row_scale, __m512 bias) {
  return _mm512_fmadd_ps(weighted_sums, row_scale, bias);
}

inline __m512 scale_sums(__m512i sums, __m512 weight_scale, __m512 row_scale, __m512 bias) {
  return scale_sums(_mm512_mul_ps(_mm512_cvtepi32_ps(sums), weight_scale), row_scale, bias);
}

}  // namespace tokenloom

#endif  // __AVX512F__
