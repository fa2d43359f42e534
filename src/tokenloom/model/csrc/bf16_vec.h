// What the AVX-512 BF16 operators share besides exp (avx512_exp.h): broadcasting a pair of bf16, and the softmax's
// "no maximum yet".
#pragma once

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

}  // namespace tokenloom

#endif  // __AVX512BF16__
