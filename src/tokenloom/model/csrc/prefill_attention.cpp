// Causal prefill attention for bfloat16 on CPUs with AVX-512 BF16: tokenloom::prefill_attention.
//
// A chunk of n queries at the end of a context of ctx tokens (the first ctx - n are its past) attends to every key
// up to its own position. Flash-style: keys stream through in blocks of 16 with an online softmax, so no score
// matrix is ever materialised. The products run on the bf16 dot-product instruction (exact products, float32
// sums) over transposed blocks: K^T pairs make 16 query-key dot products one vector, and V pairs make the
// probability-weighted sum one instruction per 16 output dims and two keys. Probabilities enter that sum rounded
// to bf16, as transformers' bfloat16 attention rounds them. Built only where the compiler targets AVX-512 BF16;
// elsewhere the op is not registered and the model uses torch's scaled_dot_product_attention.

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

constexpr int kKeys = 16;         // keys per block: one float32 vector of scores
constexpr int kQueryTokens = 32;  // query tokens per work item (times the heads sharing a KV head)
// A row's running max before its first key: finite (the build assumes no infinities) and so low that e^(it - m)
// is exactly 0 for any real score m.
constexpr float kNoMax = -1e30f;

// e^x for x <= 0, 16 at a time: x = n ln2 + r, e^r by a degree-6 polynomial (relative error ~2e-7).
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147181f), x);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

inline uint32_t pair_at(const c10::BFloat16* row, int64_t d) {
  uint32_t out;
  std::memcpy(&out, row + d, sizeof(out));
  return out;
}

// The state of a tile's rows (query token and head pairs) while keys stream past.
struct RowState {
  float* acc;        // [rows, HD]
  float* row_max;    // [rows]
  float* row_sum;    // [rows, kKeys]: per-lane sums, added up once at the end
};

// R rows at once against one block of keys: R independent chains of dot products keep the vector unit busy where
// one row's chain would wait on each instruction's latency, and each block of K^T and V is loaded once for R rows.
// A row that sees none of the block (causal) has an empty mask: its scores are kNoMax, its probabilities 0, and
// its state is unchanged.
template <int HD, int R>
inline void attend_rows(const c10::BFloat16* const* qrows, const __mmask16* keep, const uint32_t* kt,
                        const uint32_t* vt, float scale, int64_t r0, RowState st) {
  constexpr int kPairs = HD / 2;
  constexpr int kLanes = HD / 16;
  __m512 s[R], s2[R];
  for (int i = 0; i < R; ++i) s[i] = s2[i] = _mm512_setzero_ps();
  for (int p = 0; p < kPairs; p += 2) {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt + p * kKeys);
    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kt + (p + 1) * kKeys);
    for (int i = 0; i < R; ++i) {
      s[i] = _mm512_dpbf16_ps(s[i], (__m512bh)_mm512_set1_epi32(static_cast<int>(pair_at(qrows[i], 2 * p))), k0);
      s2[i] = _mm512_dpbf16_ps(s2[i], (__m512bh)_mm512_set1_epi32(static_cast<int>(pair_at(qrows[i], 2 * p + 2))), k1);
    }
  }
  __m512 acc[R][kLanes];
  alignas(64) uint32_t prob_pairs[R][kKeys / 2];
  for (int i = 0; i < R; ++i) {
    const int64_t r = r0 + i;
    const __m512 scores = _mm512_mask_mul_ps(_mm512_set1_ps(kNoMax), keep[i], _mm512_add_ps(s[i], s2[i]),
                                             _mm512_set1_ps(scale));
    const float block_max = _mm512_reduce_max_ps(scores);
    float* a = st.acc + r * HD;
    float* sums = st.row_sum + r * kKeys;
    for (int l = 0; l < kLanes; ++l) acc[i][l] = _mm512_loadu_ps(a + l * 16);
    __m512 lane_sums = _mm512_loadu_ps(sums);
    if (block_max > st.row_max[r]) {  // rescale what was summed under the old maximum (0 on the row's first block)
      const __m512 correction = _mm512_set1_ps(std::exp(st.row_max[r] - block_max));
      for (int l = 0; l < kLanes; ++l) acc[i][l] = _mm512_mul_ps(acc[i][l], correction);
      lane_sums = _mm512_mul_ps(lane_sums, correction);
      st.row_max[r] = block_max;
    }
    const __m512 probs =
        _mm512_maskz_mov_ps(keep[i], exp_nonpositive(_mm512_sub_ps(scores, _mm512_set1_ps(st.row_max[r]))));
    _mm512_storeu_ps(sums, _mm512_add_ps(lane_sums, probs));
    // Probabilities as bf16 pairs (key 2j, key 2j + 1), each broadcast against V's pairs for 16 dims.
    _mm256_store_si256(reinterpret_cast<__m256i*>(prob_pairs[i]), (__m256i)_mm512_cvtneps_pbh(probs));
  }
  for (int64_t j = 0; j < kKeys / 2; ++j) {
    for (int l = 0; l < kLanes; ++l) {
      const __m512bh vv = (__m512bh)_mm512_loadu_si512(vt + j * HD + l * 16);
      for (int i = 0; i < R; ++i) {
        acc[i][l] = _mm512_dpbf16_ps(acc[i][l], (__m512bh)_mm512_set1_epi32(static_cast<int>(prob_pairs[i][j])), vv);
      }
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int l = 0; l < kLanes; ++l) _mm512_storeu_ps(st.acc + (r0 + i) * HD + l * 16, acc[i][l]);
  }
}

// One KV head, query tokens [q0, q1) of the chunk, every query head of the group.
template <int HD>
void attend_block(const c10::BFloat16* q, int64_t q_stride, const c10::BFloat16* k, const c10::BFloat16* v,
                  int64_t k_stride, int64_t v_stride, int64_t past, int64_t q0, int64_t q1, int64_t group, float scale,
                  c10::BFloat16* out, int64_t out_stride, std::vector<float>& scratch) {
  constexpr int kPairs = HD / 2;
  constexpr int kLanes = HD / 16;
  constexpr int kTile = HD == 64 ? 4 : 2;  // rows at once: kTile * kLanes accumulators stay in registers
  const int64_t rows = (q1 - q0) * group;
  scratch.resize(rows * (HD + 1 + kKeys) + kPairs * kKeys + (kKeys / 2) * HD + 16);
  float* acc = scratch.data();                     // [rows, HD]
  float* row_max = acc + rows * HD;                // [rows]
  float* row_sum = row_max + rows;                 // [rows, kKeys]
  uint32_t* kt = reinterpret_cast<uint32_t*>(row_sum + rows * kKeys);  // [kPairs, kKeys]: K^T, dims in pairs
  uint32_t* vt = kt + kPairs * kKeys;              // [kKeys / 2, HD]: V, keys in pairs
  std::fill(acc, acc + rows * HD, 0.0f);
  std::fill(row_max, row_max + rows, kNoMax);
  std::fill(row_sum, row_sum + rows * kKeys, 0.0f);
  const RowState state{acc, row_max, row_sum};
  const int64_t end_key = past + q1;  // the last query sees keys [0, past + q1)
  for (int64_t k0 = 0; k0 < end_key; k0 += kKeys) {
    const int64_t nk = std::min<int64_t>(kKeys, end_key - k0);
    for (int64_t j = 0; j < kKeys; ++j) {
      const c10::BFloat16* krow = k + (k0 + std::min(j, nk - 1)) * k_stride;  // past the end: repeat, masked
      for (int p = 0; p < kPairs; ++p) kt[p * kKeys + j] = pair_at(krow, 2 * p);
    }
    for (int64_t j = 0; j < kKeys / 2; ++j) {
      const int64_t a = k0 + std::min(2 * j, nk - 1), b = k0 + std::min(2 * j + 1, nk - 1);
      const uint16_t* va = reinterpret_cast<const uint16_t*>(v + a * v_stride);
      const uint16_t* vb = reinterpret_cast<const uint16_t*>(v + b * v_stride);
      for (int d = 0; d < HD; ++d) vt[j * HD + d] = va[d] | (static_cast<uint32_t>(vb[d]) << 16);
    }
    // Rows whose token sees none of this block are skipped; the rest go kTile at a time.
    const int64_t first_token = std::max<int64_t>(q0, k0 - past);
    int64_t r = (first_token - q0) * group;
    const c10::BFloat16* qrows[kTile];
    __mmask16 keep[kTile];
    auto load_row = [&](int64_t row, int i) {
      const int64_t t = q0 + row / group, h = row % group;
      const int64_t visible = std::min<int64_t>(nk, past + t + 1 - k0);  // causal: keys up to the token's position
      keep[i] = visible <= 0 ? 0 : visible >= kKeys ? static_cast<__mmask16>(0xFFFF)
                                                    : static_cast<__mmask16>((1u << visible) - 1);
      qrows[i] = q + t * q_stride + h * HD;
    };
    for (; r + kTile <= rows; r += kTile) {
      for (int i = 0; i < kTile; ++i) load_row(r + i, i);
      attend_rows<HD, kTile>(qrows, keep, kt, vt, scale, r, state);
    }
    for (; r < rows; ++r) {
      load_row(r, 0);
      attend_rows<HD, 1>(qrows, keep, kt, vt, scale, r, state);
    }
  }
  for (int64_t t = q0; t < q1; ++t) {
    for (int64_t h = 0; h < group; ++h) {
      const int64_t r = (t - q0) * group + h;
      const float inv = 1.0f / _mm512_reduce_add_ps(_mm512_loadu_ps(row_sum + r * kKeys));
      c10::BFloat16* o = out + t * out_stride + h * HD;
      for (int l = 0; l < kLanes; ++l) {
        const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(acc + r * HD + l * 16), _mm512_set1_ps(inv));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + l * 16), (__m256i)_mm512_cvtneps_pbh(x));
      }
    }
  }
}

// q: [n, heads, d] (rows may be strided, heads contiguous); k, v: [ctx, kv_heads * d] (rows may be strided).
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16,
              "prefill_attention: bfloat16 CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 2 && v.dim() == 2 && k.sizes() == v.sizes(),
              "prefill_attention: q [n, heads, d], k and v [ctx, kv_heads * d]");
  const int64_t n = q.size(0), heads = q.size(1), d = q.size(2), ctx = k.size(0);
  TORCH_CHECK(d == 64 || d == 128, "prefill_attention: head size 64 or 128");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == d && k.stride(1) == 1 && v.stride(1) == 1,
              "prefill_attention: heads and dims must be contiguous");
  TORCH_CHECK(k.size(1) % d == 0 && heads % (k.size(1) / d) == 0, "prefill_attention: heads must group over KV heads");
  TORCH_CHECK(n >= 1 && ctx >= n, "prefill_attention: the chunk must lie within its context");
  const int64_t kv_heads = k.size(1) / d, group = heads / kv_heads, past = ctx - n;
  at::Tensor out = at::empty({n, heads, d}, q.options());
  const auto* q_ptr = q.const_data_ptr<c10::BFloat16>();
  const auto* k_ptr = k.const_data_ptr<c10::BFloat16>();
  const auto* v_ptr = v.const_data_ptr<c10::BFloat16>();
  auto* out_ptr = out.mutable_data_ptr<c10::BFloat16>();
  const int64_t blocks = (n + kQueryTokens - 1) / kQueryTokens, items = blocks * kv_heads;
  const float s = static_cast<float>(scale);
  // Later query blocks see more keys; dealing items from both ends evens out the threads' work.
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t dealt = begin; dealt < end; ++dealt) {
      const int64_t item = dealt % 2 == 0 ? dealt / 2 : items - 1 - dealt / 2;
      const int64_t block = item / kv_heads, g = item % kv_heads;
      const int64_t q0 = block * kQueryTokens, q1 = std::min(n, q0 + kQueryTokens);
      const c10::BFloat16* qg = q_ptr + g * group * d;
      const c10::BFloat16* kg = k_ptr + g * d;
      const c10::BFloat16* vg = v_ptr + g * d;
      c10::BFloat16* og = out_ptr + g * group * d;
      if (d == 64) {
        attend_block<64>(qg, q.stride(0), kg, vg, k.stride(0), v.stride(0), past, q0, q1, group, s, og, heads * d, scratch);
      } else {
        attend_block<128>(qg, q.stride(0), kg, vg, k.stride(0), v.stride(0), past, q0, q1, group, s, og, heads * d, scratch);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloom, m) { m.def("prefill_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor"); }

TORCH_LIBRARY_IMPL(tokenloom, CPU, m) { m.impl("prefill_attention", &prefill_attention); }

#endif  // __AVX512BF16__
