// e^x for 16 floats at once with AVX-512, for the operators' softmax and SiLU.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

namespace tokenloom {

// x clamped to [-87, 88] (the results stay finite: the build assumes no infinities), x = n ln2 + r, e^r by a
// degree-6 polynomial (relative error ~2e-7), scaled by 2^n.
inline __m512 exp_clamped(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147181f), x);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// e^x for x <= 0 (a softmax's scores less their maximum) when ~4e-5 relative error is enough, as it is for
// probabilities rounded to bf16: 2^(x log2 e) split into an integer power (scalef) and 2^f, f in [-1/2, 1/2], by a
// degree-4 polynomial. Four fewer instructions than exp_clamped; no clamp is needed, as x below any real score
// (kNoMax, bf16_vec.h) comes out 0.
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(9.6181291e-3f);  // (ln 2)^k / k!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// silu(gate) x up = gate x up / (1 + e^-gate), as the gated linears write it from their float32 sums.
inline __m512 silu_times(__m512 gate, __m512 up) {
  const __m512 e_minus_gate = exp_clamped(_mm512_sub_ps(_mm512_setzero_ps(), gate));
  return _mm512_div_ps(_mm512_mul_ps(gate, up), _mm512_add_ps(_mm512_set1_ps(1.0f), e_minus_gate));
}

}  // namespace tokenloom

#endif  // __AVX512F__
