// What the AVX-512 operators share besides exp (avx512_exp.h): storing 16 lanes as float32 or bf16, broadcasting a
// pair of bf16 (AVX-512 BF16), and the softmax's "no maximum yet".
#pragma once

#include <c10/util/BFloat16.h>

#include <cstring>

namespace tokenloom {

// A softmax row's running maximum before its first score: finite (the build assumes no infinities) and so low that
// e^(it - m) is exactly 0 for any real score m.
constexpr float kNoMax = -1e30f;

}  // namespace tokenloom

#if defined(__AVX512F__)
#include <immintrin.h>

namespace tokenloom {

// 16 float32 lanes stored as they are, or rounded to bf16 (nearest even, as c10::BFloat16 rounds) by integer
// arithmetic on the bits: AVX-512 BF16's vcvtneps2bf16 would flush denormal inputs to zero where torch keeps them
// (a kernel's bf16 output then differed from its float32 output rounded); the build assumes no NaNs.
inline void store16(float* at, __m512 v) { _mm512_storeu_ps(at, v); }
inline void store16(c10::BFloat16* at, __m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(at), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}

}  // namespace tokenloom

#endif  // __AVX512F__

#if defined(__AVX512BF16__)
namespace tokenloom {

// A pair of bf16 at `at` in every lane, as the bf16 dot product's broadcast operand. Read as one float so the
// compiler makes it a broadcast load (vbroadcastss from memory: no vector ALU slot), not a scalar load and a
// register broadcast.
inline __m512bh broadcast_pair(const void* at) {
  float pair;
  std::memcpy(&pair, at, sizeof(pair));
  return (__m512bh)_mm512_castps_si512(_mm512_set1_ps(pair));
}

}  // namespace tokenloom

#endif  // __AVX512BF16__
