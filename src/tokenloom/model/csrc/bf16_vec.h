// What the AVX-512 BF16 operators share besides exp (avx512_exp.h): broadcasting a pair of bf16, storing 16 lanes as
// float32 or bf16, and the softmax's "no maximum yet".
#pragma once

#include <c10/util/BFloat16.h>

#include <cstring>

namespace tokenloom {

// A softmax row's running maximum before its first score: finite (the build assumes no infinities) and so low that
// e^(it - m) is exactly 0 for any real score m.
constexpr float kNoMax = -1e30f;

}  // namespace tokenloom

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace tokenloom {

// A pair of bf16 at `at` in every lane, as the bf16 dot product's broadcast operand. Read as one float so the
// compiler makes it a broadcast load (vbroadcastss from memory: no vector ALU slot), not a scalar load and a
// register broadcast.
inline __m512bh broadcast_pair(const void* at) {
  float pair;
  std::memcpy(&pair, at, sizeof(pair));
  return (__m512bh)_mm512_castps_si512(_mm512_set1_ps(pair));
}

// 16 float32 lanes stored as they are, or rounded to bf16 (nearest even).
inline void store16(float* at, __m512 v) { _mm512_storeu_ps(at, v); }
inline void store16(c10::BFloat16* at, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(at), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}

}  // namespace tokenloom

#endif  // __AVX512BF16__
