// Each row's k largest values' indices over a vocabulary of float32 logits, in one pass: tokenloom::row_topk.
//
// torch's topk and argmax over the last dimension of [64, 49152] float32 logits ran at ~1 GB/s on our 2-core
// machines (2.7 ms and 3.5 ms, hot), and reductions.py's two passes (chunk maxima, then the chunks that can hold
// the answer) still took 2.7 ms for the LM head's top 8 there, as much as a fifth of the head's own time. Here each
// row is read once: 16 values are compared with the row's current k-th largest, and only one that beats it goes into
// a sorted list of k. After the first few hundred values almost none does, so the scan runs at memory speed.
//
// Ties keep the first index, as torch's argmax does (k = 1 is the first maximum); the first k values seed the list,
// so a row of -inf (every token masked) still gets k indices. A NaN ranks below -inf: it is chosen only where a
// row has fewer than k other values. (NaN is told by its bits: -ffast-math lets the compiler drop x != x.)

#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "work_sharing.h"

namespace {

constexpr int64_t kMaxK = 64;

inline bool is_nan(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return (bits & 0x7fffffffu) > 0x7f800000u;
}

// What a value ranks as: itself, or a NaN as -inf (a seed that any later value but -inf or NaN displaces).
inline float rank_of(float x) { return is_nan(x) ? -std::numeric_limits<float>::infinity() : x; }

// A row's best k so far, largest first; values[k - 1] is the bar a new value must beat.
struct TopK {
  int64_t k;
  float values[kMaxK];
  int64_t indices[kMaxK];

  void seed(const float* row) {
    for (int64_t i = 0; i < k; ++i) indices[i] = i;
    // Largest first; among equals the earlier index first (a stable sort of the seeds).
    std::stable_sort(indices, indices + k, [&](int64_t a, int64_t b) { return rank_of(row[a]) > rank_of(row[b]); });
    for (int64_t i = 0; i < k; ++i) values[i] = rank_of(row[indices[i]]);
  }

  void offer(float value, int64_t index) {
    if (is_nan(value) || !(value > values[k - 1])) return;  // equals keep the earlier index
    int64_t at = k - 1;
    while (at > 0 && value > values[at - 1]) {
      values[at] = values[at - 1];
      indices[at] = indices[at - 1];
      --at;
    }
    values[at] = value;
    indices[at] = index;
  }
};

void scan_row(const float* row, int64_t n, TopK& best) {
  best.seed(row);
  int64_t i = best.k;
#if defined(__AVX512F__)
  for (; i < n && i % 16; ++i) best.offer(row[i], i);
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(row + i);
    __mmask16 above = _mm512_cmp_ps_mask(v, _mm512_set1_ps(best.values[best.k - 1]), _CMP_GT_OQ);
    while (above) {  // in index order, so among equal values the first stays
      const int j = __builtin_ctz(above);
      best.offer(row[i + j], i + j);
      above &= above - 1;
      above &= _mm512_cmp_ps_mask(v, _mm512_set1_ps(best.values[best.k - 1]), _CMP_GT_OQ);  // the bar rose
    }
  }
#elif defined(__AVX2__)
  for (; i + 32 <= n; i += 32) {
    // Four vectors against the bar at once: past the first few hundred values almost no block holds a candidate,
    // and one test a block instead of one a vector keeps the scan at memory speed (scalar, it ran at ~4 GB/s).
    const __m256 bar = _mm256_set1_ps(best.values[best.k - 1]);
    const __m256 above = _mm256_or_ps(
        _mm256_or_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i), bar, _CMP_GT_OQ),
                     _mm256_cmp_ps(_mm256_loadu_ps(row + i + 8), bar, _CMP_GT_OQ)),
        _mm256_or_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i + 16), bar, _CMP_GT_OQ),
                     _mm256_cmp_ps(_mm256_loadu_ps(row + i + 24), bar, _CMP_GT_OQ)));
    if (_mm256_testz_ps(above, above)) continue;
    for (int64_t j = i; j < i + 32; ++j) best.offer(row[j], j);  // in index order, so among equals the first stays
  }
#endif
  for (; i < n; ++i) best.offer(row[i], i);
}

at::Tensor row_topk(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, "row_topk: float32 CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "row_topk: x must be [rows, n] with contiguous rows");
  TORCH_CHECK(k >= 1 && k <= kMaxK && k <= x.size(1), "row_topk: k must be in 1..min(64, n)");
  const int64_t rows = x.size(0), n = x.size(1), ld = x.stride(0);
  at::Tensor out = at::empty({rows, k}, x.options().dtype(at::kLong));
  const float* xp = x.const_data_ptr<float>();
  int64_t* op = out.mutable_data_ptr<int64_t>();
  const std::function<void(int64_t)> body = [&](int64_t r) {
    TopK best{k, {}, {}};
    scan_row(xp + r * ld, n, best);
    std::copy(best.indices, best.indices + k, op + r * k);
  };
  tokenloom::WorkSharing::instance().run(rows, body);
  return out;
}

// The float32 dot product of a normed row with one row of the head (bf16 values widen exactly).
template <typename W>
float dot_with(const float* x, const W* w, int64_t n) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += x[i] * static_cast<float>(w[i]);
  return sum;
}

// In place: each row's k largest logits (approximate ones: a bf16 head's rounded matmul, an int8 head's) computed
// again in float32 from the row's float32 norm and the head's plain weight (llama.CausalLM.compute_logits). One call
// for what took a top-k, a gather of head rows, their widening, a batched matmul and a scatter: at batch 1 those five
// operators cost ~0.2 ms a token between them.
void refine_top_logits(at::Tensor logits, const at::Tensor& normed, const at::Tensor& head, int64_t k) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2 &&
                  logits.stride(1) == 1,
              "refine_top_logits: logits must be float32 [rows, vocab] with contiguous rows");
  TORCH_CHECK(normed.scalar_type() == at::kFloat && normed.dim() == 2 && normed.stride(1) == 1 &&
                  normed.size(0) == logits.size(0),
              "refine_top_logits: normed must be float32 [rows, hidden] with contiguous rows, a row per logits row");
  TORCH_CHECK((head.scalar_type() == at::kFloat || head.scalar_type() == at::kBFloat16) && head.dim() == 2 &&
                  head.stride(1) == 1 && head.size(0) == logits.size(1) && head.size(1) == normed.size(1),
              "refine_top_logits: head must be float32 or bfloat16 [vocab, hidden] with contiguous rows");
  TORCH_CHECK(k >= 1 && k <= kMaxK && k <= logits.size(1), "refine_top_logits: k must be in 1..min(64, vocab)");
  const int64_t rows = logits.size(0), vocab = logits.size(1), hidden = normed.size(1);
  float* lp = logits.mutable_data_ptr<float>();
  const float* np = normed.const_data_ptr<float>();
  const std::function<void(int64_t)> body = [&](int64_t r) {
    TopK best{k, {}, {}};
    float* row = lp + r * logits.stride(0);
    const float* x = np + r * normed.stride(0);
    scan_row(row, vocab, best);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t t = best.indices[j];
      row[t] = head.scalar_type() == at::kFloat
                   ? dot_with(x, head.const_data_ptr<float>() + t * head.stride(0), hidden)
                   : dot_with(x, head.const_data_ptr<c10::BFloat16>() + t * head.stride(0), hidden);
    }
  };
  tokenloom::WorkSharing::instance().run(rows, body);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloom, m) {
  m.def("row_topk(Tensor x, int k) -> Tensor");
  m.def("refine_top_logits(Tensor(a!) logits, Tensor normed, Tensor head, int k) -> ()");
}

TORCH_LIBRARY_IMPL(tokenloom, CPU, m) {
  m.impl("row_topk", &row_topk);
  m.impl("refine_top_logits", &refine_top_logits);
}
