// The 8-bit KV cache's codes (--kv-cache-dtype): int8, fp8 e4m3 and fp8 e5m2, each (token, KV head) with one
// float32 scale. Inside a block of B slots the bytes lie head by head, each head's slots one after the other, an
// entry of d codes then the scale (kv_quant.py draws it):
//
//     block b: [ head 0: entry of slot 0 | ... | entry of slot B-1 ] ... [ head H-1: ... ],  entry: [ d codes | scale ]
//
// Writing (quantize_head) is scalar: a step writes only its new tokens. Reading is per entry in the attention
// kernels, vectorised here (decode_codes) for AVX-512 and AVX2 with F16C, scalar elsewhere.
//
// Both fp8 formats widen exactly through float16: e5m2 is float16's top byte, and e4m3's 7 magnitude bits placed at
// float16's bit 7 read as the same value times 2^-8 (normals and subnormals alike; e4m3 has no infinities and the
// writer never makes its NaN), so the reader multiplies by 256 (kCodeUnit) along with the scale.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace tokenloom {

enum KVKind : int64_t { kPlain = 0, kInt8 = 1, kFp8E4M3 = 2, kFp8E5M2 = 3 };

inline bool is_kv_kind(int64_t kind) { return kind >= kInt8 && kind <= kFp8E5M2; }

// f.template operator()<Kind>() with the cache's kind known when compiled.
template <typename F>
void with_kv_kind(int64_t kind, const F& f) {
  if (kind == kPlain) return f.template operator()<kPlain>();
  if (kind == kInt8) return f.template operator()<kInt8>();
  if (kind == kFp8E4M3) return f.template operator()<kFp8E4M3>();
  f.template operator()<kFp8E5M2>();
}

// The largest code magnitude: a head's largest |x| maps onto it.
inline float max_code(int64_t kind) {
  return kind == kInt8 ? 127.0f : kind == kFp8E4M3 ? 448.0f : 57344.0f;
}

// What the vector readers' widened codes must be multiplied by (besides the scale) to be the codes' values.
inline float code_unit(int64_t kind) { return kind == kFp8E4M3 ? 256.0f : 1.0f; }

inline float read_scale(const uint8_t* at) {
  float scale;
  std::memcpy(&scale, at, sizeof(scale));
  return scale;
}

inline float widen_value(float x) { return x; }
inline float widen_value(c10::BFloat16 x) { return static_cast<float>(x); }

// Where slot `offset` of block `block` keeps head `head`'s entry, in bytes from the cache's start.
inline int64_t entry_offset(int64_t block, int64_t head, int64_t offset, int64_t heads, int64_t block_size,
                            int64_t d) {
  return ((block * heads + head) * block_size + offset) * (d + 4);
}

// x: one head's d values -> entry: their codes, then their scale. Scale = amax times 1 / the largest code, code =
// x times 1 / scale rounded to nearest even: products of reciprocals, as kv_quant.encode computes them, because the
// build's -ffast-math would make divisions such products anyway.
template <typename T>
void quantize_head(int64_t kind, const T* xh, int64_t d, uint8_t* entry) {
  const float top = max_code(kind);
  const float inv_top = 1.0f / top;
  float amax = 0.0f;
  for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::fabs(widen_value(xh[i])));
  const float scale = amax > 0.0f ? amax * inv_top : 1.0f;
  const float inv_scale = 1.0f / scale;
  for (int64_t i = 0; i < d; ++i) {
    const float c = std::clamp(widen_value(xh[i]) * inv_scale, -top, top);
    if (kind == kInt8) {
      entry[i] = static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(c)));
    } else if (kind == kFp8E4M3) {
      entry[i] = c10::Float8_e4m3fn(c).x;
    } else {
      entry[i] = c10::Float8_e5m2(c).x;
    }
  }
  std::memcpy(entry + d, &scale, sizeof(scale));
}

// One code's value (without the vector readers' unit).
inline float code_value(int64_t kind, uint8_t code) {
  if (kind == kInt8) return static_cast<float>(static_cast<int8_t>(code));
  if (kind == kFp8E4M3) return static_cast<float>(c10::Float8_e4m3fn(code, c10::Float8_e4m3fn::from_bits()));
  return static_cast<float>(c10::Float8_e5m2(code, c10::Float8_e5m2::from_bits()));
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// e4m3 codes, sign-extended to 16 bits -> the same values as fp16, divided by code_unit (256). Shifted left 7, a code's
// exponent and mantissa land in fp16's and its sign in bit 15 (sign extension); bit 14, the code's sign again, is
// cleared. Three instructions where masking sign and magnitude apart took six; fp8's subnormals are fp16's.
inline __m256i e4m3_as_half(__m256i signed_codes) {
  return _mm256_and_si256(_mm256_slli_epi16(signed_codes, 7), _mm256_set1_epi16(static_cast<int16_t>(0xBFFF)));
}

// 16 codes -> 16 floats, times code_unit(Kind).
template <int64_t Kind>
inline __m512 widen16(const uint8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (Kind == kInt8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
  if constexpr (Kind == kFp8E5M2) return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 8));
  return _mm512_cvtph_ps(e4m3_as_half(_mm256_cvtepi8_epi16(bytes)));
}
#elif defined(__AVX2__) && defined(__F16C__)
// 8 codes -> 8 floats, times code_unit(Kind).
template <int64_t Kind>
inline __m256 widen8(const uint8_t* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  if constexpr (Kind == kInt8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  if constexpr (Kind == kFp8E5M2) return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(bytes), 8));
  const __m128i shifted = _mm_slli_epi16(_mm_cvtepi8_epi16(bytes), 7);  // as e4m3_as_half, in 128 bits
  return _mm256_cvtph_ps(_mm_and_si128(shifted, _mm_set1_epi16(static_cast<int16_t>(0xBFFF))));
}
#endif

// n codes -> n floats, times scale: one head's row, for the float32 kernels.
template <int64_t Kind>
inline void decode_codes(const uint8_t* codes, float scale, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512 s = _mm512_set1_ps(scale * code_unit(Kind));
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, _mm512_mul_ps(widen16<Kind>(codes + i), s));
#elif defined(__AVX2__) && defined(__F16C__)
  const __m256 s = _mm256_set1_ps(scale * code_unit(Kind));
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_mul_ps(widen8<Kind>(codes + i), s));
#endif
  for (; i < n; ++i) dst[i] = code_value(Kind, codes[i]) * scale;
}

}  // namespace tokenloom
