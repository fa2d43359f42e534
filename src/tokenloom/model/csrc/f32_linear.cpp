// float32 linears of a few rows over a plain row-major weight: tokenloom::f32_small_linear.
//
// A decode step of a few rows reads every weight once and multiplies it by those rows only: it is bound by the
// weight's bytes. oneDNN's packed float32 linear (prepack.py) streamed them at ~13 GB/s on our 2-core AVX2 machines
// where the memory gives ~26, so a float32 batch-1 token spent ~40 ms in its linears for 540 MB of weights. Here each
// unit of work streams a run of the weight's rows front to back, 4 output features at a time (4 independent sums
// per row of x, 8 floats each), with the rows of x read from L1; a step of several rows takes them in pairs over a
// tile of 4 features while it is in L1, so the weight still comes from memory once.

#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <optional>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "work_sharing.h"

namespace {

constexpr int64_t kFeatures = 4;             // output features of a tile: its weight rows are streamed together
constexpr int64_t kMinUnitBytes = 64 << 10;  // a unit's weight bytes: enough to be worth a helper's taking it

// The four sums of four vectors of 8: [sum(a0), sum(a1), sum(a2), sum(a3)].
inline __m128 sums_of_four(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
}

// y[r, 0..3] = x[r, :] . w[0..3, :] (+ bias) for R rows of x; k a multiple of 8.
template <int R>
void tile(const float* x, int64_t ldx, const float* w, int64_t k, const float* bias, float* y, int64_t ldy) {
  __m256 acc[R][kFeatures];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kFeatures; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; i += 8) {
    // The next tile's line at this offset, one tile (~9 KB) ahead: the hardware's prefetch alone kept a core at
    // ~12 GB/s here; with this the two cores read ~21 (past a weight's end the address is only a hint, never read).
    if (i % 16 == 0)
      for (int j = 0; j < kFeatures; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(w + (kFeatures + j) * k + i), _MM_HINT_T0);
    __m256 wv[kFeatures];
    for (int j = 0; j < kFeatures; ++j) wv[j] = _mm256_loadu_ps(w + j * k + i);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * ldx + i);
      for (int j = 0; j < kFeatures; ++j) acc[r][j] = _mm256_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  const __m128 b = bias ? _mm_loadu_ps(bias) : _mm_setzero_ps();
  for (int r = 0; r < R; ++r)
    _mm_storeu_ps(y + r * ldy, _mm_add_ps(sums_of_four(acc[r][0], acc[r][1], acc[r][2], acc[r][3]), b));
}

// x [M, K] float32 (rows of unit stride), weight [N, K] float32 contiguous, bias [N] or none -> [M, N].
at::Tensor f32_small_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "f32_small_linear: x must be float32 [M, K] with rows of unit stride");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 2 && weight.is_contiguous(),
              "f32_small_linear: weight must be a contiguous float32 [N, K]");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0), ldx = x.stride(0);
  TORCH_CHECK(weight.size(1) == k && k % 8 == 0 && n % kFeatures == 0,
              "f32_small_linear: weight [N, K] with x's K, K a multiple of 8 and N of 4");
  const float* bias_data = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "f32_small_linear: bias must be float32 [N]");
    bias_data = bias->const_data_ptr<float>();
  }
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  const float* xp = x.const_data_ptr<float>();
  const float* wp = weight.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  const int64_t tiles = n / kFeatures, tile_bytes = kFeatures * k * 4;
  const int64_t tiles_per_unit = std::max<int64_t>(1, kMinUnitBytes / tile_bytes);
  const int64_t units = (tiles + tiles_per_unit - 1) / tiles_per_unit;
  const std::function<void(int64_t)> body = [&](int64_t unit) {
    const int64_t t1 = std::min(tiles, (unit + 1) * tiles_per_unit);
    for (int64_t t = unit * tiles_per_unit; t < t1; ++t) {
      const int64_t f = t * kFeatures;
      const float* w = wp + f * k;
      const float* b = bias_data ? bias_data + f : nullptr;
      int64_t r = 0;
      for (; r + 2 <= m; r += 2) tile<2>(xp + r * ldx, ldx, w, k, b, op + r * n + f, n);
      if (r < m) tile<1>(xp + r * ldx, ldx, w, k, b, op + r * n + f, n);
    }
  };
  tokenloom::WorkSharing::instance().run(units, body);
  return out;
}


}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloom, m) { m.def("f32_small_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor"); }

TORCH_LIBRARY_IMPL(tokenloom, CPU, m) { m.impl("f32_small_linear", &f32_small_linear); }

#endif  // AVX2 and FMA
