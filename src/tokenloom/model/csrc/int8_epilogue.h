// How every int8 linear turns its exact int32 sums into outputs (--quantization int8): int8_linear.cpp (VNNI),
// amx_int8_linear.cpp (AMX) and, after oneDNN's matmul, fused.cpp's scale_rows. One definition, so all three give
// the same bits and a request's output does not depend on which kernel its step ran on.
//
//   y = (sum x weight_scale) x row_scale + bias          (oneDNN applies the weight scale inside its matmul)
//   gated ([gate; up] interleaved per 16 features): silu(y_gate) x y_up = y_gate x y_up / (1 + e^-y_gate),
//   from the float32 values, before anything is rounded.
#pragma once

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
