// Decode attention over a paged KV cache, for CPU, in float32 and bfloat16: registered as the torch operator
// tokenloom::paged_decode_attention, so it is called, checked and traced like any other torch op.
//
// Plain PyTorch must first copy each context out of its scattered blocks (a gather) before it can multiply;
// this kernel reads every cached row in place, once. Work is split over (sequence, KV head) pairs: the query
// heads that share a KV head are served by the same pass over its rows. Arithmetic is in float32 whatever the
// storage dtype: bfloat16 rows are widened as they are read, and the softmax runs in float32.

#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <type_traits>
#include <vector>

#include "work_sharing.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

inline float widen(float x) { return x; }

inline float widen(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

template <typename T>
inline void widen_row(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = widen(src[i]);
}

// Each of `rows` rows of `n` scores becomes its softmax, in place, in float32.
inline void softmax_rows(float* scores, int64_t rows, int64_t n) {
  for (int64_t h = 0; h < rows; ++h) {
    float* s = scores + h * n;
    float max = std::numeric_limits<float>::lowest();
    for (int64_t t = 0; t < n; ++t) max = std::max(max, s[t]);
    float sum = 0.0f;
    for (int64_t t = 0; t < n; ++t) {
      s[t] = std::exp(s[t] - max);
      sum += s[t];
    }
    const float inv = 1.0f / sum;
    for (int64_t t = 0; t < n; ++t) s[t] *= inv;
  }
}

// One sequence, one KV head: the `group` query heads that share it, over `ctx` tokens of context.
template <typename T, int HD>
void attend(const T* q, const T* k_cache, const T* v_cache, const int64_t* table, int64_t ctx, int64_t group,
            int64_t row, int64_t head_dim, int64_t block_size, float scale, T* out, std::vector<float>& scratch) {
  const int64_t hd = HD ? HD : head_dim;
  scratch.resize(group * hd * 2 + group * ctx + hd);
  float* qf = scratch.data();             // [group, hd]
  float* acc = qf + group * hd;           // [group, hd]
  float* scores = acc + group * hd;       // [group, ctx]
  float* kv = scores + group * ctx;       // [hd]: one widened row
  for (int64_t h = 0; h < group; ++h) {
    for (int64_t d = 0; d < hd; ++d) qf[h * hd + d] = widen(q[h * hd + d]) * scale;
  }
  std::fill(acc, acc + group * hd, 0.0f);
  for (int64_t t = 0; t < ctx; ++t) {
    const T* k = k_cache + (table[t / block_size] * block_size + t % block_size) * row;
    widen_row(k, kv, hd);
    for (int64_t h = 0; h < group; ++h) {
      float dot = 0.0f;
      for (int64_t d = 0; d < hd; ++d) dot += qf[h * hd + d] * kv[d];
      scores[h * ctx + t] = dot;
    }
  }
  softmax_rows(scores, group, ctx);
  for (int64_t t = 0; t < ctx; ++t) {
    const T* v = v_cache + (table[t / block_size] * block_size + t % block_size) * row;
    widen_row(v, kv, hd);
    for (int64_t h = 0; h < group; ++h) {
      const float w = scores[h * ctx + t];
      float* a = acc + h * hd;
      for (int64_t d = 0; d < hd; ++d) a[d] += w * kv[d];
    }
  }
  for (int64_t i = 0; i < group * hd; ++i) out[i] = static_cast<T>(acc[i]);
}

#if defined(__AVX512BF16__)
// Rows of one head, into cache level Hint. The loop over keys is faster than memory, and a block's successor is
// elsewhere in memory where the hardware's stride prefetcher cannot see it coming. At 64 sequences x 350 tokens a
// layer's decode attention took 1.1-1.3 ms with these prefetches against 1.5 ms without (blocks in order).
template <int Hint>
inline void prefetch_rows(const c10::BFloat16* first, int64_t row, int head_dim, int64_t rows) {
  for (int64_t j = 0; j < rows; ++j) {
    for (int d = 0; d < head_dim; d += 32) {
      _mm_prefetch(reinterpret_cast<const char*>(first + j * row + d), static_cast<_mm_hint>(Hint));
    }
  }
}

// 16 vectors in, one out: lane j holds the sum of v[j]'s 16 lanes. 45 shuffles and adds for 16 sums, where one
// horizontal reduction per vector would take about 7 each.
inline __m512 sum_each(const __m512* v) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: [v2i 0+2, v2i+1 0+2, v2i 1+3, v2i+1 1+3]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: that lane's sums of v4i .. v4i+3
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // Add up the four 128-bit lanes of each quad, quad i landing in lane i.
  const __m512 q01 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x44), _mm512_shuffle_f32x4(quads[0], quads[1], 0xEE));
  const __m512 q23 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x44), _mm512_shuffle_f32x4(quads[2], quads[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(q01, q23, 0x88), _mm512_shuffle_f32x4(q01, q23, 0xDD));
}

// The same pass for bfloat16 with AVX-512 BF16: q.k with the hardware's bf16 dot product (exact products, float32
// sums), 16 keys at a time so their sums come out as one vector; no widening of K at all. V is widened by a shift
// (even dims) and a mask (odd dims) of each pair, so its accumulators hold the dims de-interleaved until the end.
template <int HD>
void attend_bf16_avx512(const c10::BFloat16* q, const c10::BFloat16* k_cache, const c10::BFloat16* v_cache,
                        const int64_t* table, int64_t ctx, int64_t group, int64_t row, int64_t block_size,
                        float scale, c10::BFloat16* out, std::vector<float>& scratch) {
  static_assert(HD % 32 == 0, "whole 32-element bf16 vectors");
  constexpr int kChunks = HD / 32;   // bf16 vectors of 32 per row
  constexpr int kMaxGroup = 8;
  const int64_t padded = (ctx + 15) / 16 * 16;
  scratch.resize(group * padded);
  float* scores = scratch.data();
  auto row_of = [&](const c10::BFloat16* cache, int64_t t) {
    return cache + (table[t / block_size] * block_size + t % block_size) * row;
  };
  for (int64_t h0 = 0; h0 < group; h0 += kMaxGroup) {
    const int64_t heads = std::min<int64_t>(kMaxGroup, group - h0);
    __m512bh qv[kMaxGroup][kChunks];
    for (int64_t h = 0; h < heads; ++h)
      for (int c = 0; c < kChunks; ++c)
        qv[h][c] = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(q + (h0 + h) * HD + c * 32));
    for (int64_t t0 = 0; t0 < ctx; t0 += 16) {
      const c10::BFloat16* rows[16];
      if (block_size % 16 == 0 && t0 + 16 <= ctx) {
        // 16 keys inside one block: one table lookup (and no division per key), rows a fixed stride apart.
        const c10::BFloat16* first = row_of(k_cache, t0);
        for (int j = 0; j < 16; ++j) rows[j] = first + j * row;
        if (h0 == 0) {
          // Memory is slower than this loop: fetch the K rows two groups ahead, and this group's V rows into L2
          // for the second pass.
          if (t0 + 32 < ctx) {
            prefetch_rows<_MM_HINT_T0>(row_of(k_cache, t0 + 32), row, HD, std::min<int64_t>(16, ctx - t0 - 32));
          }
          prefetch_rows<_MM_HINT_T1>(row_of(v_cache, t0), row, HD, 16);
        }
      } else {
        for (int j = 0; j < 16; ++j) rows[j] = row_of(k_cache, std::min(t0 + j, ctx - 1));  // past the end: repeated
      }
      for (int64_t h = 0; h < heads; ++h) {
        __m512 dots[16];
        for (int j = 0; j < 16; ++j) {
          __m512 acc = _mm512_setzero_ps();
          for (int c = 0; c < kChunks; ++c) {
            acc = _mm512_dpbf16_ps(acc, qv[h][c], (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(rows[j] + c * 32)));
          }
          dots[j] = acc;
        }
        _mm512_storeu_ps(scores + (h0 + h) * padded + t0, _mm512_mul_ps(sum_each(dots), _mm512_set1_ps(scale)));
      }
    }
  }
  for (int64_t h = 0; h < group; ++h) softmax_rows(scores + h * padded, 1, ctx);
  const __m512i odd_mask = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t h0 = 0; h0 < group; h0 += kMaxGroup) {
    const int64_t heads = std::min<int64_t>(kMaxGroup, group - h0);
    __m512 even[kMaxGroup][kChunks], odd[kMaxGroup][kChunks];
    for (int64_t h = 0; h < heads; ++h)
      for (int c = 0; c < kChunks; ++c) even[h][c] = odd[h][c] = _mm512_setzero_ps();
    const c10::BFloat16* v_block = row_of(v_cache, 0);  // the current block's first row: a lookup per block
    for (int64_t t = 0, in_block = 0; t < ctx; ++t) {
      const c10::BFloat16* v = v_block + in_block * row;
      if (++in_block == block_size && t + 1 < ctx) {
        in_block = 0;
        v_block = row_of(v_cache, t + 1);
      }
      __m512 ve[kChunks], vo[kChunks];
      for (int c = 0; c < kChunks; ++c) {
        const __m512i raw = _mm512_loadu_si512(reinterpret_cast<const void*>(v + c * 32));
        ve[c] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));  // dims 2i of the chunk, widened exactly
        vo[c] = _mm512_castsi512_ps(_mm512_and_si512(raw, odd_mask));  // dims 2i + 1
      }
      for (int64_t h = 0; h < heads; ++h) {
        const __m512 w = _mm512_set1_ps(scores[(h0 + h) * padded + t]);
        for (int c = 0; c < kChunks; ++c) {
          even[h][c] = _mm512_fmadd_ps(w, ve[c], even[h][c]);
          odd[h][c] = _mm512_fmadd_ps(w, vo[c], odd[h][c]);
        }
      }
    }
    for (int64_t h = 0; h < heads; ++h) {
      for (int c = 0; c < kChunks; ++c) {
        // Round to nearest even, as c10::BFloat16 does, then interleave the even and odd dims back as bf16 pairs.
        const __m512i e = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(even[h][c]));
        const __m512i o = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(odd[h][c]));
        _mm512_storeu_si512(reinterpret_cast<void*>(out + (h0 + h) * HD + c * 32), _mm512_or_si512(e, _mm512_slli_epi32(o, 16)));
      }
    }
  }
}
#endif

template <typename T>
void decode_all(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size, double scale,
                at::Tensor& out) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t q_stride = q.stride(0), out_stride = out.stride(0);
  const int64_t row = k_cache.size(1), num_kv_heads = row / head_dim, group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const T* q_ptr = q.const_data_ptr<T>();
  const T* k_ptr = k_cache.const_data_ptr<T>();
  const T* v_ptr = v_cache.const_data_ptr<T>();
  const int64_t* tables = block_tables.const_data_ptr<int64_t>();
  const int64_t* lens = context_lens.const_data_ptr<int64_t>();
  T* out_ptr = out.mutable_data_ptr<T>();
  // One unit per sequence and KV head, taken in order by whichever thread is free (work_sharing.h): longest
  // contexts first (the runner sorts decodes by context length, ascending), so the last units taken are short and
  // the threads finish together.
  const float s = static_cast<float>(scale);
  const std::function<void(int64_t)> body = [&](int64_t unit) {
    thread_local std::vector<float> scratch;
    const int64_t seq = num_seqs - 1 - unit / num_kv_heads, kv_head = unit % num_kv_heads;
    const T* q_head = q_ptr + seq * q_stride + kv_head * group * head_dim;
    T* out_head = out_ptr + seq * out_stride + kv_head * group * head_dim;
    const T* k = k_ptr + kv_head * head_dim;
    const T* v = v_ptr + kv_head * head_dim;
    const int64_t* table = tables + seq * max_blocks;
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (head_dim == 64) {
        attend_bf16_avx512<64>(q_head, k, v, table, lens[seq], group, row, block_size, s, out_head, scratch);
        return;
      }
      if (head_dim == 128) {
        attend_bf16_avx512<128>(q_head, k, v, table, lens[seq], group, row, block_size, s, out_head, scratch);
        return;
      }
    }
#endif
    if (head_dim == 64) {
      attend<T, 64>(q_head, k, v, table, lens[seq], group, row, head_dim, block_size, s, out_head, scratch);
    } else if (head_dim == 128) {
      attend<T, 128>(q_head, k, v, table, lens[seq], group, row, head_dim, block_size, s, out_head, scratch);
    } else {
      attend<T, 0>(q_head, k, v, table, lens[seq], group, row, head_dim, block_size, s, out_head, scratch);
    }
  };
  tokenloom::WorkSharing::instance().run(num_seqs * num_kv_heads, body);
}

// q: [num_seqs, heads, d], rows may be strided (a view into the fused qkv output); out: the same shape, rows may
// be strided (a slice of the step's output). Both have their heads and dims contiguous.
void paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size,
                            double scale, at::Tensor out) {
  TORCH_CHECK(q.device().is_cpu() && out.device().is_cpu(), "paged_decode_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3, "q must be [num_seqs, num_heads, head_dim]");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(), "out must be shaped as q, its dtype");
  TORCH_CHECK(k_cache.dim() == 2 && v_cache.sizes() == k_cache.sizes(),
              "k_cache and v_cache must be [num_slots, num_kv_heads * head_dim], the same shape");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q, k_cache and v_cache must share a dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "paged_decode_attention: float32 or bfloat16 only");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && out.stride(2) == 1 && out.stride(1) == out.size(2),
              "q and out must have their heads and dims contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "k_cache and v_cache must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block_tables and context_lens must be int64");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.is_contiguous(), "block_tables must be [num_seqs, max_blocks]");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.is_contiguous(), "context_lens must be [num_seqs]");
  const int64_t num_seqs = q.size(0), head_dim = q.size(2);
  TORCH_CHECK(block_tables.size(0) == num_seqs && context_lens.size(0) == num_seqs,
              "one block table and one context length per sequence");
  TORCH_CHECK(block_size > 0 && head_dim > 0 && k_cache.size(1) % head_dim == 0,
              "the cache row must hold whole heads");
  const int64_t num_kv_heads = k_cache.size(1) / head_dim;
  TORCH_CHECK(num_kv_heads > 0 && q.size(1) % num_kv_heads == 0, "query heads must be a multiple of KV heads");
  // Every block a context reaches must exist: a bad table would read outside the cache.
  const int64_t num_blocks = k_cache.size(0) / block_size;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t* lens = context_lens.const_data_ptr<int64_t>();
  const int64_t* tables = block_tables.const_data_ptr<int64_t>();
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(lens[s] > 0 && lens[s] <= max_blocks * block_size, "context length out of range for sequence ", s);
    for (int64_t b = 0; b < (lens[s] + block_size - 1) / block_size; ++b) {
      const int64_t block = tables[s * max_blocks + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block id ", block, " out of range for sequence ", s);
    }
  }
  if (q.scalar_type() == at::kFloat) {
    decode_all<float>(q, k_cache, v_cache, block_tables, context_lens, block_size, scale, out);
  } else {
    decode_all<c10::BFloat16>(q, k_cache, v_cache, block_tables, context_lens, block_size, scale, out);
  }
}

}  // namespace

TORCH_LIBRARY(tokenloom, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
      "int block_size, float scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(tokenloom, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
