// Decode attention over a paged KV cache, for CPU, in float32 and bfloat16: registered as the torch operator
// tokenloom::paged_decode_attention, so it is called, checked and traced like any other torch op.
//
// Plain PyTorch must first copy each context out of its scattered blocks (a gather) before it can multiply;
// this kernel reads every cached row in place, once. Work is split over (sequence, KV head) pairs: the query
// heads that share a KV head are served by the same pass over its rows; a long context's pair is cut further into
// up to one split per thread, merged after (decode_all), so one sequence keeps every thread busy. A bf16 cache read
// with AVX-512 BF16 goes by whole sequences instead where there are enough of them (attend_bf16_rows: every KV head
// of a row in one sweep, which memory streams faster); bf16 and fp8 caches are multiplied on AMX tiles where the CPU
// has them (amx_chunk).
// Softmax and sums are in float32 whatever the storage dtype. The float32 path with AVX-512 (attend_f32_avx512) or
// AVX2 and FMA (attend_f32_avx2) sweeps K and V in chunks as the bf16 one does; elsewhere, and for bfloat16 without
// AVX-512 BF16, rows are widened as they are read; the AVX-512 BF16 path multiplies bf16 directly, with its
// probabilities rounded to bf16 for the products with V as transformers' bfloat16 attention rounds them.

#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "amx_tiles.h"
#include "avx512_exp.h"
#include "bf16_vec.h"
#include "kv_codes.h"
#include "vnni_asm.h"
#include "work_sharing.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using tokenloom::kNoMax;

// f.template operator()<N>() with N = n, for 1 <= n <= Max: a count known when compiled, so that register tiles of
// N rows are sized by it and their loops unrolled (a tile sized by a count known only at run time lives in memory).
template <int Max, typename F>
void with_count(int n, F&& f) {
  if constexpr (Max > 1) {
    if (n < Max) return with_count<Max - 1>(n, f);
  }
  f.template operator()<Max>();
}

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

// Where a unit's query heads go: the op's output rows, in their dtype; or, for one split of a long context
// (decode_all), float32 rows normalized within the split and each head's log-sum-exp, merged once all splits are
// done (merge_splits). Every kernel below ends by writing each head through one.
template <typename T>
struct HeadsOut {
  T* out;                    // [heads][hd], when not a split
  float* split = nullptr;    // [heads][hd], for a split
  float* lse = nullptr;      // [heads], for a split
  void put(int64_t i, float value) const {
    if (split != nullptr) {
      split[i] = value;
    } else {
      out[i] = static_cast<T>(value);
    }
  }
  // The head's softmax denominator, exp(run_max) x run_sum: what weighs this split against the others.
  void denominator(int64_t h, float run_max, float run_sum) const {
    if (lse != nullptr) lse[h] = run_max + std::log(run_sum);
  }
  // The same, from query head `head` on (heads of hd dims each).
  HeadsOut from(int64_t head, int64_t hd) const {
    if (split != nullptr) return {out, split + head * hd, lse + head};
    return {out + head * hd};
  }
};

// Each of `rows` rows of `n` scores becomes its softmax, in place, in float32; each row's denominator to `out` (a
// split's log-sum-exp).
template <typename T>
inline void softmax_rows(float* scores, int64_t rows, int64_t n, const HeadsOut<T>& out) {
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
    out.denominator(h, max, sum);
  }
}

// One KV head's rows of a plain (float32 or bfloat16) cache, widened to float32 one slot at a time.
template <typename T>
struct PlainRows {
  const T* head;         // the head's first element in block 0, slot 0
  int64_t row;           // elements from one slot's row to the next
  int64_t block_stride;  // elements from one block to the next
  void widen(int64_t block, int64_t offset, float* dst, int64_t hd) const {
    widen_row(head + block * block_stride + offset * row, dst, hd);
  }
};

// One KV head's entries of an 8-bit cache (kv_codes.h): its codes, times its scale.
template <int64_t Kind>
struct CodeRows {
  const uint8_t* head;   // the head's entry in block 0, slot 0
  int64_t row;           // bytes from one slot's entry to the next
  int64_t block_stride;  // bytes from one block to the next
  int64_t scale_offset;  // from the entry's codes to its scale, in bytes
  void widen(int64_t block, int64_t offset, float* dst, int64_t hd) const {
    const uint8_t* codes = head + block * block_stride + offset * row;
    tokenloom::decode_codes<Kind>(codes, tokenloom::read_scale(codes + scale_offset), dst, hd);
  }
};

// One sequence, one KV head: the `group` query heads that share it, over `ctx` tokens of context.
template <typename T, int HD, typename Rows>
void attend(const T* q, const Rows& k_rows, const Rows& v_rows, const int64_t* table, int64_t ctx, int64_t group,
            int64_t head_dim, int64_t block_size, float scale, const HeadsOut<T>& out, std::vector<float>& scratch) {
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
    k_rows.widen(table[t / block_size], t % block_size, kv, hd);
    for (int64_t h = 0; h < group; ++h) {
      float dot = 0.0f;
      for (int64_t d = 0; d < hd; ++d) dot += qf[h * hd + d] * kv[d];
      scores[h * ctx + t] = dot;
    }
  }
  softmax_rows(scores, group, ctx, out);
  for (int64_t t = 0; t < ctx; ++t) {
    v_rows.widen(table[t / block_size], t % block_size, kv, hd);
    for (int64_t h = 0; h < group; ++h) {
      const float w = scores[h * ctx + t];
      float* a = acc + h * hd;
      for (int64_t d = 0; d < hd; ++d) a[d] += w * kv[d];
    }
  }
  for (int64_t i = 0; i < group * hd; ++i) out.put(i, acc[i]);
}

#if defined(__AVX512F__)
// `rows` rows of `elements` each, into L2. The loop over keys is faster than memory, and a block's
// successor is elsewhere in memory where the hardware's prefetcher cannot see it coming. At 64 sequences x 340
// tokens, 30 layers of cold cache, a layer took 977 us with the kernel's two prefetches and 1,354 us without.
// The AVX-512 kernels fetch a context's first chunk at once, then the next chunk's K rows while a chunk's V rows are
// multiplied. A bf16 cache's V rows are fetched as their own chunk's K rows are multiplied; an 8-bit cache's V
// entries come a chunk ahead with K, and whole (codes and scale: 16 entries end in a 17th line): its V scales are
// read as the chunk begins, and V fetched only then, with the scales' lines left out, stalled on memory (12 x 4,000
// tokens of int8 cache, 30 layers cold: 1.5x slower). A bf16 cache's V fetched with the next K, twice the bytes in
// one burst, was 5-8% slower (benchmarks/RESULTS.md).
// Each line is asked for by `prefetcht1` in volatile asm: GCC 12's dead-code elimination dropped _mm_prefetch
// calls from these kernels whenever the rows came through group_rows in a helper (no prefetch at all was emitted).
template <typename Elem>
inline void prefetch_rows(const Elem* first, int64_t row, int elements, int64_t rows) {
  constexpr int kLine = 64 / sizeof(Elem);  // elements per cache line
  for (int64_t j = 0; j < rows; ++j) {
    for (int d = 0; d < elements; d += kLine) {
      asm volatile("prefetcht1 %0" : : "m"(*reinterpret_cast<const char*>(first + j * row + d)));
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

// Key t's row in a paged cache.
template <typename Elem>
inline const Elem* row_at(const Elem* cache, const int64_t* table, int64_t t, int64_t row, int64_t block_stride,
                          int64_t block_size) {
  return cache + table[t / block_size] * block_stride + (t % block_size) * row;
}

// The 16 rows of keys t0 .. t0 + 15 (past the end of the context: its last row, repeated), with one table lookup
// when they lie in one block.
template <typename Elem>
inline void group_rows(const Elem* cache, const int64_t* table, int64_t t0, int64_t ctx, int64_t row,
                       int64_t block_stride, int64_t block_size, const Elem** rows) {
  auto row_of = [&](int64_t t) { return row_at(cache, table, t, row, block_stride, block_size); };
  if (block_size % 16 == 0 && t0 + 16 <= ctx) {
    const Elem* first = row_of(t0);
    for (int j = 0; j < 16; ++j) rows[j] = first + j * row;
  } else {
    for (int j = 0; j < 16; ++j) rows[j] = row_of(std::min(t0 + j, ctx - 1));
  }
}

// The K and V scales of 16 keys' 8-bit entries (raw: their K entries; V's lie where K's do), times code_unit(Kind).
template <int64_t Kind>
inline void group_scales(const uint8_t* const* raw, const uint8_t* k_cache, const uint8_t* v_cache,
                         int64_t scale_offset, float* k_scales, float* v_scales) {
  const float unit = tokenloom::code_unit(Kind);
  for (int j = 0; j < 16; ++j) {
    k_scales[j] = tokenloom::read_scale(raw[j] + scale_offset) * unit;
    v_scales[j] = tokenloom::read_scale(v_cache + (raw[j] - k_cache) + scale_offset) * unit;
  }
}

// Keys t0 .. t0 + 15 (t0 + 16 <= ctx) into L2: their K rows and, with_v, their V rows (V lies as K does); `entry`
// elements of each row (an 8-bit cache's whole entries).
template <typename Elem>
inline void prefetch_group(const Elem* k_cache, const Elem* v_cache, const int64_t* table, int64_t t0, int64_t row,
                           int64_t block_stride, int64_t block_size, int entry, bool with_v) {
  const Elem* first = row_at(k_cache, table, t0, row, block_stride, block_size);
  const int64_t contiguous = block_size % 16 == 0 ? 16 : 1;  // else only the first row is known to follow
  prefetch_rows(first, row, entry, contiguous);
  if (with_v) prefetch_rows(v_cache + (first - k_cache), row, entry, contiguous);
}

// The K and V rows of a context's keys, whole, asked for from memory a few at a time (some()) as the chunk before
// theirs is worked on. A chunk's rows asked for at once (as bf16_chunk asks for one KV head's) stalled the kernel
// on its own prefetches, then left memory idle while it computed: spread out, on a 2-core Xeon with AMX, 16
// sequences x 4,096 keys read at 19 GB/s, against 15 (benchmarks/RESULTS.md). A row is `row` elements (a bf16
// cache's every KV head, an 8-bit cache's one entry).
template <typename Elem>
struct RowsAhead {
  const Elem *k_cache, *v_cache;
  const int64_t* table;
  int64_t row, block_stride, block_size, ctx;
  int64_t per_step;  // rows a call to some(): enough that a chunk's calls stay a chunk ahead
  // an 8-bit cache's KV heads, whose entries of a key lie head_stride elements apart (kv_codes.h)
  int64_t heads = 1, head_stride = 0;
  int64_t fetched = 0;  // keys [0, fetched) asked for

  void upto(int64_t end) {
    for (end = std::min(end, ctx); fetched < end; ++fetched) {
      const Elem* k_row = row_at(k_cache, table, fetched, row, block_stride, block_size);
      const bool block_start = fetched % block_size == 0;
      for (int64_t h = 0; h < heads; ++h) {
        lines_of(k_row + h * head_stride, block_start);
        lines_of(v_cache + (k_row - k_cache) + h * head_stride, block_start);
      }
    }
  }
  // The lines a row starts (and, first in its block, the one it starts in): a block's rows lie one after the other,
  // so each line is asked for once. Every line each row overlaps (two for an 8-bit entry's 68 bytes) was 1.9x the
  // prefetches of an 8-bit cache and 2-5% of its time at 16 x 4,096 keys (benchmarks/RESULTS.md).
  void lines_of(const Elem* first, bool block_start) const {
    const uintptr_t begin = reinterpret_cast<uintptr_t>(first), end = begin + row * sizeof(Elem);
    const uintptr_t first_line = block_start ? begin & ~uintptr_t{63} : (begin + 63) & ~uintptr_t{63};
    for (uintptr_t line = first_line; line < end; line += 64) {
      asm volatile("prefetcht1 %0" : : "m"(*reinterpret_cast<const char*>(line)));
    }
  }
  void some(int64_t until) { upto(std::min(fetched + per_step, until)); }
};

// The online softmax meeting a chunk whose largest score is chunk_max: what one query head summed under a lower
// running maximum (its HD accumulators and its sum) is rescaled to the new one; nothing is summed before the first.
template <int HD>
inline void raise_running_max(float chunk_max, float& run_max, float& run_sum, float* acc) {
  if (chunk_max <= run_max) return;
  if (run_max != kNoMax) {
    const float correction = std::exp(run_max - chunk_max);
    const __m512 factor = _mm512_set1_ps(correction);
    for (int d = 0; d < HD; d += 16) _mm512_storeu_ps(acc + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), factor));
    run_sum *= correction;
  }
  run_max = chunk_max;
}

// A chunk's keys among the 16 of its group g (a chunk of `keys` scores; the last group may be partial).
inline __mmask16 live_keys(int64_t keys, int g) {
  return static_cast<__mmask16>(keys - 16 * g >= 16 ? 0xFFFF : (1u << (keys - 16 * g)) - 1);
}

// The largest of a chunk's `keys` scores.
inline float chunk_max(const float* scores, int64_t keys) {
  __m512 most = _mm512_set1_ps(kNoMax);
  for (int g = 0; g < (keys + 15) / 16; ++g) {
    most = _mm512_mask_max_ps(most, live_keys(keys, g), most, _mm512_loadu_ps(scores + 16 * g));
  }
  return _mm512_reduce_max_ps(most);
}

// The online softmax over a chunk of `keys` scores for each of `heads` query heads (head h's at scores + h * stride):
// its running maximum raised (what it summed so far rescaled), each group of 16 keys' probabilities (0 past the
// chunk) handed to use(h, g, p), and added to its running sum.
template <int HD, typename Use>
inline void softmax_chunk(const float* scores, int64_t stride, int64_t heads, int64_t keys, float* run_max,
                          float* run_sum, float* acc, Use&& use) {
  for (int64_t h = 0; h < heads; ++h) {
    const float* s = scores + h * stride;
    raise_running_max<HD>(chunk_max(s, keys), run_max[h], run_sum[h], acc + h * HD);
    const __m512 m = _mm512_set1_ps(run_max[h]);
    __m512 total = _mm512_setzero_ps();
    for (int g = 0; g < (keys + 15) / 16; ++g) {
      const __m512 p = _mm512_maskz_mov_ps(live_keys(keys, g),
                                           tokenloom::exp_clamped(_mm512_sub_ps(_mm512_loadu_ps(s + 16 * g), m)));
      use(h, g, p);
      total = _mm512_add_ps(total, p);
    }
    run_sum[h] += _mm512_reduce_add_ps(total);
  }
}

// A float32 kernel's cache element: a float, or an 8-bit cache's byte.
template <int64_t Kind>
using F32Elem = std::conditional_t<Kind == tokenloom::kPlain, float, uint8_t>;

// Vector c (dims 16c .. 16c + 15) of a row: a float32 row's, or an 8-bit row's codes widened (times code_unit).
template <int64_t Kind>
inline __m512 row_vector(const F32Elem<Kind>* row, int c) {
  if constexpr (Kind == tokenloom::kPlain) {
    return _mm512_loadu_ps(row + 16 * c);
  } else {
    return tokenloom::widen16<Kind>(row + 16 * c);
  }
}

// The same attention for float32 queries with AVX-512 (where the model runs in float32 on an AVX-512 CPU without
// BF16): attend_bf16_avx512's sweep, in float32 throughout. q.k 16 keys at a time, their sums transposed into one
// vector (sum_each); each chunk's softmax in vectors; p.v with kPass query heads' accumulators in registers. Against
// the AVX2 kernel below (8 floats a vector, a scalar softmax) on a 2-core Xeon: 15-19 ns per key and KV head where
// it took 21-35 with the cache in L2, 1.1-1.2x faster from memory, where both wait on the cache's bytes
// (benchmarks/RESULTS.md). Units of all of a row's KV heads (each block read in one sweep) were slower.
// An 8-bit cache (Kind != kPlain) is read as attend_bf16_avx512 reads it: each group of 16 K rows widened to float32
// once, into a buffer the query heads share, V's codes widened in registers as each pass multiplies them, and the
// scales applied apart (K's onto the scores, V's onto the probabilities after the running sum).
template <int HD, int64_t Kind>
void attend_f32_avx512(const float* q, const F32Elem<Kind>* k_cache, const F32Elem<Kind>* v_cache,
                       const int64_t* table, int64_t ctx, int64_t group, int64_t row, int64_t block_stride,
                       int64_t block_size, int64_t scale_offset, float scale, const HeadsOut<float>& out,
                       std::vector<float>& scratch) {
  using Elem = F32Elem<Kind>;
  constexpr bool kCodes = Kind != tokenloom::kPlain;
  static_assert(HD % 16 == 0, "whole vectors of 16 floats");
  constexpr int kVecs = HD / 16;                      // vectors per row
  constexpr int kPass = (32 - kVecs - 2) / kVecs;     // query heads whose accumulators fit beside a V row
  constexpr int kChunk = 64;                          // keys per step of the online softmax
  const int64_t heads = group;                        // the query heads that share this KV head
  scratch.resize(heads * (2 * HD + kChunk + 2));
  float* qf = scratch.data();             // [heads][HD]: the queries, times the softmax scale
  float* acc = qf + heads * HD;           // [heads][HD]
  float* probs = acc + heads * HD;        // [heads][kChunk]: the chunk's scores, then its probabilities
  float* run_max = probs + heads * kChunk;
  float* run_sum = run_max + heads;
  for (int64_t i = 0; i < heads * HD; ++i) qf[i] = q[i] * scale;
  std::fill(acc, acc + heads * HD, 0.0f);
  std::fill(run_max, run_max + heads, kNoMax);
  std::fill(run_sum, run_sum + heads, 0.0f);
  const Elem* raw[16];
  const float* rows[16];
  alignas(64) float widened[kCodes ? 16 * HD : 1];  // an 8-bit cache's 16 K rows, as float32
  alignas(64) float k_scales[16];
  alignas(64) float v_scales[kChunk];  // the chunk's
  const int entry = kCodes ? static_cast<int>(row) : HD;  // elements fetched of each row
  const int64_t contiguous = block_size % 16 == 0 ? 16 : 1;  // rows known to follow a group's first
  for (int64_t t0 = 0; t0 + 16 <= std::min<int64_t>(kChunk, ctx); t0 += 16) {
    prefetch_group(k_cache, v_cache, table, t0, row, block_stride, block_size, entry, /*with_v=*/kCodes);
  }
  for (int64_t c0 = 0; c0 < ctx; c0 += kChunk) {
    const int64_t keys = std::min<int64_t>(kChunk, ctx - c0);
    for (int64_t t0 = c0; t0 < c0 + keys; t0 += 16) {
      group_rows(k_cache, table, t0, ctx, row, block_stride, block_size, raw);
      if constexpr (kCodes) {
        for (int j = 0; j < 16; ++j) {
          for (int c = 0; c < kVecs; ++c) _mm512_store_ps(widened + j * HD + 16 * c, row_vector<Kind>(raw[j], c));
          rows[j] = widened + j * HD;
        }
        group_scales<Kind>(raw, k_cache, v_cache, scale_offset, k_scales, v_scales + (t0 - c0));
      } else {
        std::copy(raw, raw + 16, rows);
        if (t0 + 16 <= ctx) prefetch_rows(v_cache + (raw[0] - k_cache), row, HD, contiguous);  // for the V pass
      }
      for (int64_t h = 0; h < heads; ++h) {
        __m512 qv[kVecs];
        for (int c = 0; c < kVecs; ++c) qv[c] = _mm512_loadu_ps(qf + h * HD + 16 * c);
        __m512 dots[16];
        for (int j = 0; j < 16; ++j) {
          __m512 sum = _mm512_mul_ps(qv[0], _mm512_loadu_ps(rows[j]));
          for (int c = 1; c < kVecs; ++c) sum = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(rows[j] + 16 * c), sum);
          dots[j] = sum;
        }
        __m512 scores = sum_each(dots);
        if constexpr (kCodes) scores = _mm512_mul_ps(scores, _mm512_load_ps(k_scales));
        _mm512_storeu_ps(probs + h * kChunk + (t0 - c0), scores);
      }
    }
    // Online softmax: the scores become their probabilities (an 8-bit cache's: times V's scales), in place.
    softmax_chunk<HD>(probs, kChunk, heads, keys, run_max, run_sum, acc, [&](int64_t h, int g, __m512 p) {
      if constexpr (kCodes) p = _mm512_mul_ps(p, _mm512_load_ps(v_scales + 16 * g));
      _mm512_storeu_ps(probs + h * kChunk + 16 * g, p);
    });
    // The chunk's V rows, weighted, kPass query heads at a time (their accumulators in registers); the next chunk's K
    // rows fetched meanwhile.
    for (int64_t h0 = 0; h0 < heads; h0 += kPass) {
      with_count<kPass>(static_cast<int>(std::min<int64_t>(kPass, heads - h0)), [&]<int N>() {
        __m512 sums[N][kVecs];
#pragma GCC unroll 16
        for (int h = 0; h < N; ++h) {
#pragma GCC unroll 16
          for (int c = 0; c < kVecs; ++c) sums[h][c] = _mm512_loadu_ps(acc + (h0 + h) * HD + 16 * c);
        }
        for (int64_t t0 = c0; t0 < c0 + keys; t0 += 16) {
          group_rows(v_cache, table, t0, ctx, row, block_stride, block_size, raw);
          if (h0 == 0 && t0 + kChunk + 16 <= ctx) {
            prefetch_group(k_cache, v_cache, table, t0 + kChunk, row, block_stride, block_size, entry, kCodes);
          }
          const int live = static_cast<int>(std::min<int64_t>(16, c0 + keys - t0));
          for (int j = 0; j < live; ++j) {
            __m512 v[kVecs];
#pragma GCC unroll 16
            for (int c = 0; c < kVecs; ++c) v[c] = row_vector<Kind>(raw[j], c);
#pragma GCC unroll 16
            for (int h = 0; h < N; ++h) {
              const __m512 w = _mm512_set1_ps(probs[(h0 + h) * kChunk + (t0 - c0) + j]);
#pragma GCC unroll 16
              for (int c = 0; c < kVecs; ++c) sums[h][c] = _mm512_fmadd_ps(w, v[c], sums[h][c]);
            }
          }
        }
#pragma GCC unroll 16
        for (int h = 0; h < N; ++h) {
#pragma GCC unroll 16
          for (int c = 0; c < kVecs; ++c) _mm512_storeu_ps(acc + (h0 + h) * HD + 16 * c, sums[h][c]);
        }
      });
    }
  }
  float* dst = out.split != nullptr ? out.split : out.out;
  for (int64_t h = 0; h < heads; ++h) {
    const __m512 inv = _mm512_set1_ps(1.0f / run_sum[h]);
    for (int c = 0; c < kVecs; ++c) {
      _mm512_storeu_ps(dst + h * HD + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(acc + h * HD + 16 * c), inv));
    }
    out.denominator(h, run_max[h], run_sum[h]);
  }
}
#endif  // __AVX512F__

#if defined(__AVX512BF16__)
// A cache element: bf16, or an 8-bit cache's byte.
template <int64_t Kind>
using KVElem = std::conditional_t<Kind == tokenloom::kPlain, c10::BFloat16, uint8_t>;

// 16 rows of HD codes -> 16 rows of bf16 in `widened`, and `rows` pointing at them (the scales are applied apart).
template <int HD, int64_t Kind>
inline void widen_rows(const uint8_t* const* raw, c10::BFloat16* widened, const c10::BFloat16** rows) {
  for (int j = 0; j < 16; ++j) {
    for (int d = 0; d < HD; d += 32) {
      const __m512 lo = tokenloom::widen16<Kind>(raw[j] + d), hi = tokenloom::widen16<Kind>(raw[j] + d + 16);
      _mm512_storeu_si512(reinterpret_cast<void*>(widened + j * HD + d), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
    rows[j] = widened + j * HD;
  }
}

// Group g of a chunk's probabilities for one query head, 16 keys, rounded to bf16 pairs for the dot products with V
// (as transformers' bfloat16 attention rounds them); from an 8-bit cache times V's scales first.
template <int64_t Kind>
inline void store_probabilities(uint32_t* probs, int g, __m512 p, const float* v_scales) {
  if constexpr (Kind != tokenloom::kPlain) p = _mm512_mul_ps(p, _mm512_load_ps(v_scales + 16 * g));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + 8 * g), (__m256i)_mm512_cvtneps_pbh(p));
}

// The running state of `heads` query heads over a context streamed in chunks of kBf16Chunk keys, head by head (a
// KV head's group is the state from its first query head on): each head's scores and bf16 probabilities for the
// chunk, its p.v accumulators (per 32 dims, in unpack order: see bf16_finish), running maximum and sum.
constexpr int kBf16Chunk = 64;  // keys per step of the online softmax

template <int HD>
struct Bf16Running {
  float* scores;    // [heads][kBf16Chunk]
  uint32_t* probs;  // [heads][kBf16Chunk / 2]: bf16 pairs (keys 2i and 2i + 1)
  float* acc;       // [heads][HD]
  float* run_max;   // [heads]
  float* run_sum;   // [heads]

  static Bf16Running start(std::vector<float>& scratch, int64_t heads) {
    scratch.resize(heads * (kBf16Chunk + kBf16Chunk / 2 + HD + 2));
    float* scores = scratch.data();
    float* acc = scores + heads * (kBf16Chunk + kBf16Chunk / 2);
    Bf16Running state{scores, reinterpret_cast<uint32_t*>(scores + heads * kBf16Chunk), acc, acc + heads * HD,
                      acc + heads * HD + heads};
    std::fill(state.acc, state.acc + heads * HD, 0.0f);
    std::fill(state.run_max, state.run_max + heads, kNoMax);
    std::fill(state.run_sum, state.run_sum + heads, 0.0f);
    return state;
  }
  Bf16Running from(int64_t head) const {
    return {scores + head * kBf16Chunk, probs + head * (kBf16Chunk / 2), acc + head * HD, run_max + head,
            run_sum + head};
  }
};

// The same attention for bfloat16 with AVX-512 BF16. The context streams through in chunks
// of kBf16Chunk keys with an online softmax: each chunk's scores, then its V rows, so K and V are read in one sweep
// and the rows that come next can be fetched from memory while the current ones are multiplied (a softmax over
// the whole context first would leave memory idle through the V pass). q.k with the hardware's bf16 dot product
// (exact products, float32 sums), 16 keys at a time so their sums come out as one vector; no widening of K at all.
// V too goes through the bf16 dot product, two keys at a time: rows 2i and 2i + 1 interleaved into pairs of dims
// (one unpack each), against the two keys' probabilities rounded to bf16.
//
// From an 8-bit cache (Kind != kPlain), each group of 16 rows is widened to bf16 once, into a buffer the query heads
// share (int8 and both fp8 codes are exact in bf16), and the scales go where they cancel out of the products: K's
// onto the 16 scores, V's onto the probabilities (after the running sum, which must not see them).
//
// One chunk, keys [c0, c0 + keys) of ctx, for the `heads` query heads at q that share the KV head at k_cache and
// v_cache. `fetch`: the elements of each row, from the KV head's first, to fetch ahead (this chunk's V rows while
// its K rows are multiplied, the next chunk's K rows while its V rows are), 0 for none (a caller fetching whole
// rows spreads its fetches over between(), called after each 16 keys' scores and each 16 keys' values).
template <int HD, int64_t Kind, typename Between>
void bf16_chunk(const c10::BFloat16* q, const KVElem<Kind>* k_cache, const KVElem<Kind>* v_cache,
                const int64_t* table, int64_t c0, int64_t keys, int64_t ctx, int64_t heads, int64_t row,
                int64_t block_stride, int64_t block_size, int64_t scale_offset, float scale,
                const Bf16Running<HD>& state, int fetch, Between&& between) {
  using Elem = KVElem<Kind>;
  static_assert(HD % 32 == 0, "whole 32-element bf16 vectors");
  constexpr int kChunks = HD / 32;  // bf16 vectors of 32 per row
  // query heads whose p.v accumulators (2 x kChunks each) fit in the 32 registers beside a key pair's 2 x kChunks
  constexpr int kPass = (32 - 2 * kChunks - 2) / (2 * kChunks);
  constexpr int kChunk = kBf16Chunk;
  const auto [scores, probs, acc, run_max, run_sum] = state;
  const c10::BFloat16* rows[16];
  const Elem* raw[16];
  alignas(64) c10::BFloat16 widened[16 * HD];  // an 8-bit cache's 16 rows, as bf16
  alignas(64) float k_scales[16];
  alignas(64) float v_scales[kChunk];  // the chunk's
  constexpr bool kVWithK = Kind != tokenloom::kPlain;  // V fetched a chunk ahead, with K (see prefetch_rows)
  for (int64_t t0 = c0; t0 < c0 + keys; t0 += 16) {
    group_rows(k_cache, table, t0, ctx, row, block_stride, block_size, raw);
    if (fetch > 0 && !kVWithK && t0 + 16 <= ctx) {  // this group's V rows into L2 for the chunk's second half
      prefetch_rows(v_cache + (raw[0] - k_cache), row, fetch, block_size % 16 == 0 ? 16 : 1);
    }
    if constexpr (Kind == tokenloom::kPlain) {
      std::copy(raw, raw + 16, rows);
    } else {
      widen_rows<HD, Kind>(raw, widened, rows);
      group_scales<Kind>(raw, k_cache, v_cache, scale_offset, k_scales, v_scales + (t0 - c0));
    }
    for (int64_t h = 0; h < heads; ++h) {
      __m512bh qv[kChunks];
      for (int c = 0; c < kChunks; ++c) {
        qv[c] = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(q + h * HD + c * 32));
      }
      __m512 dots[16];
      for (int j = 0; j < 16; ++j) {
        __m512 sum = _mm512_setzero_ps();
        for (int c = 0; c < kChunks; ++c) {
          const void* k = rows[j] + c * 32;
          sum = _mm512_dpbf16_ps(sum, qv[c], (__m512bh)_mm512_loadu_si512(k));
        }
        dots[j] = sum;
      }
      __m512 scaled = _mm512_mul_ps(sum_each(dots), _mm512_set1_ps(scale));
      if constexpr (Kind != tokenloom::kPlain) scaled = _mm512_mul_ps(scaled, _mm512_load_ps(k_scales));
      _mm512_storeu_ps(scores + h * kChunk + (t0 - c0), scaled);
    }
    between();
  }
  // Online softmax: probabilities against the running maximum; what was summed under an older one is rescaled.
  softmax_chunk<HD>(scores, kChunk, heads, keys, run_max, run_sum, acc, [&](int64_t h, int g, __m512 p) {
    store_probabilities<Kind>(probs + h * (kChunk / 2), g, p, v_scales);
  });
  // The chunk's V rows, weighted, for kPass query heads at a time (their accumulators live in registers: N is
  // known when compiled, and every loop over them unrolled). Two keys per bf16 dot product: rows 2i and 2i + 1
  // interleaved into pairs of dims.
  for (int64_t h0 = 0; h0 < heads; h0 += kPass) {
    with_count<kPass>(static_cast<int>(std::min<int64_t>(kPass, heads - h0)), [&]<int N>() {
      __m512 lo[N][kChunks], hi[N][kChunks];
#pragma GCC unroll 16
      for (int h = 0; h < N; ++h) {
#pragma GCC unroll 16
        for (int c = 0; c < kChunks; ++c) {
          lo[h][c] = _mm512_loadu_ps(acc + (h0 + h) * HD + c * 32);
          hi[h][c] = _mm512_loadu_ps(acc + (h0 + h) * HD + c * 32 + 16);
        }
      }
      for (int64_t t0 = c0; t0 < c0 + keys; t0 += 16) {
        group_rows(v_cache, table, t0, ctx, row, block_stride, block_size, raw);
        if constexpr (Kind == tokenloom::kPlain) {
          std::copy(raw, raw + 16, rows);
        } else {
          widen_rows<HD, Kind>(raw, widened, rows);
        }
        // the next chunk's rows, while this chunk's V rows are multiplied
        if (fetch > 0 && h0 == 0 && t0 + kChunk + 16 <= ctx) {
          prefetch_group(k_cache, v_cache, table, t0 + kChunk, row, block_stride, block_size, fetch, kVWithK);
        }
        const int live = static_cast<int>(std::min<int64_t>(16, c0 + keys - t0));  // past it: probability 0
        for (int j = 0; j < live; j += 2) {
          __m512bh pair_lo[kChunks], pair_hi[kChunks];
#pragma GCC unroll 16
          for (int c = 0; c < kChunks; ++c) {
            const __m512i a = _mm512_loadu_si512(reinterpret_cast<const void*>(rows[j] + c * 32));
            const __m512i b = _mm512_loadu_si512(reinterpret_cast<const void*>(rows[j + 1] + c * 32));
            pair_lo[c] = (__m512bh)_mm512_unpacklo_epi16(a, b);
            pair_hi[c] = (__m512bh)_mm512_unpackhi_epi16(a, b);
          }
          const int64_t pair = (t0 - c0 + j) / 2;
#pragma GCC unroll 16
          for (int h = 0; h < N; ++h) {
            const __m512bh w = tokenloom::broadcast_pair(probs + (h0 + h) * (kChunk / 2) + pair);
#pragma GCC unroll 16
            for (int c = 0; c < kChunks; ++c) {
              lo[h][c] = _mm512_dpbf16_ps(lo[h][c], w, pair_lo[c]);
              hi[h][c] = _mm512_dpbf16_ps(hi[h][c], w, pair_hi[c]);
            }
          }
        }
        if (h0 == 0) between();
      }
#pragma GCC unroll 16
      for (int h = 0; h < N; ++h) {
#pragma GCC unroll 16
        for (int c = 0; c < kChunks; ++c) {
          _mm512_storeu_ps(acc + (h0 + h) * HD + c * 32, lo[h][c]);
          _mm512_storeu_ps(acc + (h0 + h) * HD + c * 32 + 16, hi[h][c]);
        }
      }
    });
  }
}

// The first chunk's rows into L2 (`fetch` elements of each, as bf16_chunk's).
template <int HD, int64_t Kind>
void bf16_first_fetch(const KVElem<Kind>* k_cache, const KVElem<Kind>* v_cache, const int64_t* table, int64_t ctx,
                      int64_t row, int64_t block_stride, int64_t block_size, int fetch) {
  for (int64_t t0 = 0; t0 + 16 <= std::min<int64_t>(kBf16Chunk, ctx); t0 += 16) {
    prefetch_group(k_cache, v_cache, table, t0, row, block_stride, block_size, fetch, Kind != tokenloom::kPlain);
  }
}

// Each of `heads` query heads' output: its accumulators over its running sum, to `out`.
template <int HD>
void bf16_finish(const Bf16Running<HD>& state, int64_t heads, const HeadsOut<c10::BFloat16>& out) {
  constexpr int kChunks = HD / 32;
  // unpacklo/hi_epi16 pair dims per 128-bit lane: lane 4L + m of `lo` holds dim 8L + m, of `hi` dim 8L + 4 + m.
  const __m512i first_half = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second_half = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t h = 0; h < heads; ++h) {
    const __m512 inv = _mm512_set1_ps(1.0f / state.run_sum[h]);
    for (int c = 0; c < kChunks; ++c) {
      const float* acc = state.acc + h * HD + c * 32;
      const __m512 lo = _mm512_loadu_ps(acc), hi = _mm512_loadu_ps(acc + 16);
      const __m512 dims_0_15 = _mm512_mul_ps(_mm512_permutex2var_ps(lo, first_half, hi), inv);
      const __m512 dims_16_31 = _mm512_mul_ps(_mm512_permutex2var_ps(lo, second_half, hi), inv);
      if (out.split != nullptr) {
        _mm512_storeu_ps(out.split + h * HD + c * 32, dims_0_15);
        _mm512_storeu_ps(out.split + h * HD + c * 32 + 16, dims_16_31);
        continue;
      }
      // Rounded to nearest even, as c10::BFloat16 does.
      c10::BFloat16* o = out.out + h * HD + c * 32;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), (__m256i)_mm512_cvtneps_pbh(dims_0_15));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16), (__m256i)_mm512_cvtneps_pbh(dims_16_31));
    }
    out.denominator(h, state.run_max[h], state.run_sum[h]);
  }
}

// The same chunk on AMX tiles (a CPU with AMX, and Linux granting the tiles): the arithmetic that took the AVX-512
// kind 12.8 ns a key and KV head from L2 on a 2-core Xeon (one dot product per query head and pair of dims) becomes
// a few tile products per 16 or 32 keys for every query head at once: 8.8 ns. Scores as S^T = K Q^T: the A tile is 16 keys' rows read
// in place from the cache (a tile load takes a row stride), the B tile the group's queries as dim pairs, packed once
// per unit (pack_queries); the 16 x 16 result's columns are the query heads, gathered into each head's scores for the
// same online softmax. Then O += P V per 32 keys: the probabilities (bf16 pairs, as softmax_chunk writes them) are
// the A tile, a query head a row, and V's rows, interleaved two keys at a time as the AVX-512 kind interleaves them,
// the B tiles; the accumulators are C tiles loaded from and stored to the running state around each chunk, in the
// same unpack order, so bf16_finish and the running maximum's rescaling work on them unchanged.
#if defined(TOKENLOOM_AMX_BF16)
namespace amx_decode {

// Tiles 0-3: accumulators (a query head a row, 16 dims); 4: probabilities (a head a row, 32 keys); 5: a B tile (V's
// key pairs, or the queries' dim pairs); 6: scores (16 keys by 16 query heads); 7: 16 keys' rows of 32 dims. (GCC's
// tile intrinsics take the tile's number as a literal: hence the macros.)
#define TL_PROBS 4
#define TL_B 5
#define TL_SCORES 6
#define TL_KEYS 7
constexpr int kProbsTile = TL_PROBS;
constexpr int kAccTiles = 4;  // two 32-dim groups of accumulators (lo and hi halves each) in a pass

// Every tile 64 bytes a row; the accumulators and the probabilities one row per query head of the group.
inline void configure(int64_t group) {
  tokenloom::amx::TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.bytes_per_row[t] = 64;
    config.rows[t] = t <= kProbsTile ? static_cast<uint8_t>(group) : 16;
  }
  tokenloom::amx::load_config(config);
}

inline bool usable(int64_t group) { return group <= 16 && tokenloom::amx::tiles_permitted(); }

// queries [group][HD] -> B tiles [HD / 32][16 dim pairs][16 query heads] (pairs as uint32, 0 past the group).
template <int HD>
void pack_queries(const c10::BFloat16* q, int64_t group, uint32_t (*packed)[16][16]) {
  std::memset(packed, 0, sizeof(uint32_t) * (HD / 32) * 16 * 16);
  for (int64_t n = 0; n < group; ++n) {
    const auto* pairs = reinterpret_cast<const uint32_t*>(q + n * HD);
    for (int c = 0; c < HD / 32; ++c) {
      for (int r = 0; r < 16; ++r) packed[c][r][n] = pairs[c * 16 + r];
    }
  }
}

// The 16 keys' scores for each of `heads` query heads into scores[h][0..15], times scale (and, from an 8-bit cache,
// each key's K scale): the keys' rows are 16 rows at `keys`, `stride` bytes apart.
template <int HD>
inline void score_group(const c10::BFloat16* keys, int64_t stride, int64_t heads, const uint32_t (*queries)[16][16],
                        float scale, const float* key_scales, float* scores, int64_t scores_stride) {
  _tile_zero(TL_SCORES);
  for (int c = 0; c < HD / 32; ++c) {
    _tile_loadd(TL_KEYS, keys + c * 32, stride);
    _tile_loadd(TL_B, queries[c], 64);
    _tile_dpbf16ps(TL_SCORES, TL_KEYS, TL_B);
  }
  alignas(64) float block[16][16];
  _tile_stored(TL_SCORES, block, 64);
  const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(16));
  __m512 times = _mm512_set1_ps(scale);
  if (key_scales != nullptr) times = _mm512_mul_ps(times, _mm512_load_ps(key_scales));
  for (int64_t h = 0; h < heads; ++h) {
    _mm512_storeu_ps(scores + h * scores_stride, _mm512_mul_ps(_mm512_i32gather_ps(column, &block[0][h], 4), times));
  }
}

// 32 keys' V rows interleaved two by two, as B tiles: [32-dim group c][lo, hi][16 key pairs][16 dims' pairs].
template <int HD>
inline void interleave_values(const c10::BFloat16* const* rows, int c_first, int c_count,
                              uint32_t (*tiles)[2][16][16]) {
  for (int r = 0; r < 16; ++r) {
    for (int i = 0; i < c_count; ++i) {
      const int c = c_first + i;
      const __m512i a = _mm512_loadu_si512(reinterpret_cast<const void*>(rows[2 * r] + c * 32));
      const __m512i b = _mm512_loadu_si512(reinterpret_cast<const void*>(rows[2 * r + 1] + c * 32));
      _mm512_store_si512(tiles[i][0][r], _mm512_unpacklo_epi16(a, b));
      _mm512_store_si512(tiles[i][1][r], _mm512_unpackhi_epi16(a, b));
    }
  }
}

}  // namespace amx_decode

// bf16_chunk's work on AMX tiles (the tiles configured by the caller: amx_decode::configure), from a bf16 cache or
// an 8-bit one, whose codes are widened to bf16 (exact) 16 rows at a time and whose scales go where bf16_chunk puts
// them. between() is called after each 16 keys' scores and each 32 keys' values: where a caller spreads its fetches.
template <int HD, int64_t Kind, typename Between>
void amx_chunk(const KVElem<Kind>* k_cache, const KVElem<Kind>* v_cache, const int64_t* table, int64_t c0,
               int64_t keys, int64_t ctx, int64_t heads, int64_t row, int64_t block_stride, int64_t block_size,
               int64_t scale_offset, float scale, const Bf16Running<HD>& state, const uint32_t (*queries)[16][16],
               int fetch, Between&& between) {
  using namespace amx_decode;
  using Elem = KVElem<Kind>;
  constexpr bool kCodes = Kind != tokenloom::kPlain;
  constexpr int kChunks = HD / 32;
  constexpr int kChunk = kBf16Chunk;
  const auto [scores, probs, acc, run_max, run_sum] = state;
  const Elem* raw[32];
  const c10::BFloat16* rows[32];
  alignas(64) c10::BFloat16 widened[32 * HD];  // 16 K rows, or 32 V rows, as one run of bf16
  alignas(64) float k_scales[16];
  alignas(64) float v_scales[kChunk];
  for (int64_t t0 = c0; t0 < c0 + keys; t0 += 16) {
    group_rows(k_cache, table, t0, ctx, row, block_stride, block_size, raw);
    if (fetch > 0 && !kCodes && t0 + 16 <= ctx) {  // this group's V rows into L2 for the chunk's second half
      prefetch_rows(v_cache + (raw[0] - k_cache), row, fetch, block_size % 16 == 0 ? 16 : 1);
    }
    const c10::BFloat16* a = widened;
    int64_t stride = HD * sizeof(c10::BFloat16);
    if constexpr (kCodes) {
      widen_rows<HD, Kind>(raw, widened, rows);
      group_scales<Kind>(raw, k_cache, v_cache, scale_offset, k_scales, v_scales + (t0 - c0));
    } else {
      if (block_size % 16 == 0 && t0 + 16 <= ctx) {  // 16 rows of one block: read in place
        a = raw[0];
        stride = row * static_cast<int64_t>(sizeof(c10::BFloat16));
      } else {  // rows from two blocks, or the context's last row repeated: copied into one run
        for (int j = 0; j < 16; ++j) std::memcpy(widened + j * HD, raw[j], HD * sizeof(c10::BFloat16));
      }
    }
    score_group<HD>(a, stride, heads, queries, scale, kCodes ? k_scales : nullptr, scores + (t0 - c0), kChunk);
    between();
  }
  softmax_chunk<HD>(scores, kChunk, heads, keys, run_max, run_sum, acc, [&](int64_t h, int g, __m512 p) {
    store_probabilities<Kind>(probs + h * (kChunk / 2), g, p, v_scales);
  });
  const int64_t live_pairs = (keys + 15) / 16 * 8;  // softmax_chunk wrote whole groups of 16 keys
  for (int64_t h = 0; h < heads; ++h) {  // a last group of 32 keys reaching past the chunk: probability 0 there
    std::fill(probs + h * (kChunk / 2) + live_pairs, probs + (h + 1) * (kChunk / 2), 0u);
  }
  alignas(64) uint32_t values[kAccTiles / 2][2][16][16];
  for (int c_first = 0; c_first < kChunks; c_first += kAccTiles / 2) {
    const int c_count = std::min(kAccTiles / 2, kChunks - c_first);
    float* const first = acc + c_first * 32;  // the pass's two 32-dim groups: tiles 0-1, then 2-3
    _tile_loadd(0, first, HD * sizeof(float));
    _tile_loadd(1, first + 16, HD * sizeof(float));
    if (c_count == 2) {
      _tile_loadd(2, first + 32, HD * sizeof(float));
      _tile_loadd(3, first + 48, HD * sizeof(float));
    }
    for (int64_t t0 = c0; t0 < c0 + keys; t0 += 32) {
      group_rows(v_cache, table, t0, ctx, row, block_stride, block_size, raw);
      group_rows(v_cache, table, std::min(t0 + 16, ctx - 1), ctx, row, block_stride, block_size, raw + 16);
      if (fetch > 0 && c_first == 0) {  // the next chunk's rows, while this chunk's V rows are multiplied
        for (int64_t next = t0 + kChunk; next < t0 + kChunk + 32 && next + 16 <= ctx; next += 16) {
          prefetch_group(k_cache, v_cache, table, next, row, block_stride, block_size, fetch, kCodes);
        }
      }
      if constexpr (kCodes) {
        widen_rows<HD, Kind>(raw, widened, rows);
        widen_rows<HD, Kind>(raw + 16, widened + 16 * HD, rows + 16);
      } else {
        std::copy(raw, raw + 32, rows);
      }
      interleave_values<HD>(rows, c_first, c_count, values);
      _tile_loadd(TL_PROBS, probs + (t0 - c0) / 2, (kChunk / 2) * sizeof(uint32_t));
      _tile_loadd(TL_B, values[0][0], 64);
      _tile_dpbf16ps(0, TL_PROBS, TL_B);
      _tile_loadd(TL_B, values[0][1], 64);
      _tile_dpbf16ps(1, TL_PROBS, TL_B);
      if (c_count == 2) {
        _tile_loadd(TL_B, values[1][0], 64);
        _tile_dpbf16ps(2, TL_PROBS, TL_B);
        _tile_loadd(TL_B, values[1][1], 64);
        _tile_dpbf16ps(3, TL_PROBS, TL_B);
      }
      between();
    }
    _tile_stored(0, first, HD * sizeof(float));
    _tile_stored(1, first + 16, HD * sizeof(float));
    if (c_count == 2) {
      _tile_stored(2, first + 32, HD * sizeof(float));
      _tile_stored(3, first + 48, HD * sizeof(float));
    }
  }
}
#undef TL_PROBS
#undef TL_B
#undef TL_SCORES
#undef TL_KEYS
#endif  // TOKENLOOM_AMX_BF16

// One sequence, one KV head: its `group` query heads over ctx keys, chunk after chunk.
template <int HD, int64_t Kind>
void attend_bf16_avx512(const c10::BFloat16* q, const KVElem<Kind>* k_cache, const KVElem<Kind>* v_cache,
                        const int64_t* table, int64_t ctx, int64_t group, int64_t row, int64_t block_stride,
                        int64_t block_size, int64_t scale_offset, float scale, const HeadsOut<c10::BFloat16>& out,
                        std::vector<float>& scratch) {
  const Bf16Running<HD> state = Bf16Running<HD>::start(scratch, group);
  const int fetch = Kind == tokenloom::kPlain ? HD : static_cast<int>(row);  // an 8-bit cache's whole entries
  bf16_first_fetch<HD, Kind>(k_cache, v_cache, table, ctx, row, block_stride, block_size, fetch);
#if defined(TOKENLOOM_AMX_BF16)
  if (amx_decode::usable(group)) {
    alignas(64) uint32_t queries[HD / 32][16][16];
    amx_decode::pack_queries<HD>(q, group, queries);
    amx_decode::configure(group);
    for (int64_t c0 = 0; c0 < ctx; c0 += kBf16Chunk) {
      amx_chunk<HD, Kind>(k_cache, v_cache, table, c0, std::min<int64_t>(kBf16Chunk, ctx - c0), ctx, group, row,
                          block_stride, block_size, scale_offset, scale, state, queries, fetch, [] {});
    }
    _tile_release();
    bf16_finish<HD>(state, group, out);
    return;
  }
#endif
  for (int64_t c0 = 0; c0 < ctx; c0 += kBf16Chunk) {
    bf16_chunk<HD, Kind>(q, k_cache, v_cache, table, c0, std::min<int64_t>(kBf16Chunk, ctx - c0), ctx, group, row,
                         block_stride, block_size, scale_offset, scale, state, fetch, [] {});
  }
  bf16_finish<HD>(state, group, out);
}

// One sequence, every KV head, from a bf16 cache: each chunk's rows read whole, one KV head after another, and
// fetched a chunk ahead (RowsAhead). A KV head's part of a row is 2 of its 6 cache lines on SmolLM2 (3 heads of 64):
// read head by head, in units of their own, such rows stream at 13 GB/s on a 2-core Xeon whose memory gives 26;
// whole, 22-26 (benchmarks/RESULTS.md). Each head's arithmetic is the one its own unit would do, in the same order.
template <int HD>
void attend_bf16_rows(const c10::BFloat16* q, const c10::BFloat16* k_cache, const c10::BFloat16* v_cache,
                      const int64_t* table, int64_t ctx, int64_t group, int64_t num_kv_heads, int64_t block_size,
                      float scale, const HeadsOut<c10::BFloat16>& out, std::vector<float>& scratch) {
  const int64_t row = num_kv_heads * HD, block_stride = block_size * row;
  const Bf16Running<HD> state = Bf16Running<HD>::start(scratch, num_kv_heads * group);
  // 4 rows a call: with 3 KV heads, 18 calls a chunk on tiles, 24 without
  RowsAhead<c10::BFloat16> ahead{k_cache, v_cache, table, row, block_stride, block_size, ctx, 4};
  ahead.upto(kBf16Chunk);
  // chunk(kv_head, c0, keys, between) for every chunk, KV head by KV head
  auto each_chunk = [&](auto&& chunk) {
    for (int64_t c0 = 0; c0 < ctx; c0 += kBf16Chunk) {
      const auto between = [&] { ahead.some(c0 + 2 * kBf16Chunk); };
      for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
        chunk(kv_head, c0, std::min<int64_t>(kBf16Chunk, ctx - c0), between);
      }
    }
  };
#if defined(TOKENLOOM_AMX_BF16)
  if (amx_decode::usable(group)) {
    thread_local std::vector<uint32_t> packed;  // [kv head][HD / 32][16][16], on a 64-byte boundary
    packed.resize(num_kv_heads * (HD / 32) * 256 + 16);
    auto* queries = reinterpret_cast<uint32_t(*)[16][16]>(
        (reinterpret_cast<uintptr_t>(packed.data()) + 63) & ~uintptr_t{63});
    for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
      amx_decode::pack_queries<HD>(q + kv_head * group * HD, group, queries + kv_head * (HD / 32));
    }
    amx_decode::configure(group);
    each_chunk([&](int64_t kv_head, int64_t c0, int64_t keys, const auto& between) {
      amx_chunk<HD, tokenloom::kPlain>(k_cache + kv_head * HD, v_cache + kv_head * HD, table, c0, keys, ctx, group,
                                       row, block_stride, block_size, 0, scale, state.from(kv_head * group),
                                       queries + kv_head * (HD / 32), 0, between);
    });
    _tile_release();
  } else
#endif
  {
    each_chunk([&](int64_t kv_head, int64_t c0, int64_t keys, const auto& between) {
      bf16_chunk<HD, tokenloom::kPlain>(q + kv_head * group * HD, k_cache + kv_head * HD, v_cache + kv_head * HD,
                                        table, c0, keys, ctx, group, row, block_stride, block_size, 0, scale,
                                        state.from(kv_head * group), 0, between);
    });
  }
  for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
    bf16_finish<HD>(state.from(kv_head * group), group, out.from(kv_head * group, HD));
  }
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// 16 vectors of 16 dwords, transposed in place: m[r] lane j becomes m[j] lane r (64 shuffles).
[[gnu::always_inline]] inline void transpose_dwords(__m512i (&m)[16]) {
  __m512i a[16], b[16];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane l: rows 2i, 2i + 1's dwords 4l, 4l + 1, then 4l + 2, 4l + 3
    a[2 * i] = _mm512_unpacklo_epi32(m[2 * i], m[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(m[2 * i], m[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // b[4i + k], lane l: rows 4i .. 4i + 3's dword 4l + k
    b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
  for (int k = 0; k < 4; ++k) {  // dword 4l + k of every row: lane l of b[k], b[4 + k], b[8 + k], b[12 + k]
    const __m512i c0 = _mm512_shuffle_i32x4(b[k], b[4 + k], 0x44), c1 = _mm512_shuffle_i32x4(b[k], b[4 + k], 0xEE);
    const __m512i c2 = _mm512_shuffle_i32x4(b[8 + k], b[12 + k], 0x44);
    const __m512i c3 = _mm512_shuffle_i32x4(b[8 + k], b[12 + k], 0xEE);
    m[k] = _mm512_shuffle_i32x4(c0, c2, 0x88);
    m[4 + k] = _mm512_shuffle_i32x4(c0, c2, 0xDD);
    m[8 + k] = _mm512_shuffle_i32x4(c1, c3, 0x88);
    m[12 + k] = _mm512_shuffle_i32x4(c1, c3, 0xDD);
  }
}

// p.v of one group of 16 keys for N query heads, a count known when compiled so that their N x 4 x kVecs integer
// sums stay in registers: the 16 rows of V codes, 4 keys interleaved per dimension, times each head's 16 weight
// bytes (head h's at w8 + h * w_stride; keys from `live` on weigh 0), added into each head's float32 accumulator
// (acc + h * HD) times its weight scale for the group (w_mul[h * w_mul_stride]).
template <int HD, int N>
void weigh_group_vnni(const uint8_t* const* rows, int live, const uint8_t* w8, int64_t w_stride, const float* w_mul,
                      int64_t w_mul_stride, float* acc) {
  constexpr int kVecs = HD / 64;
  __m512i sums[N][4 * kVecs];
#pragma GCC unroll 16
  for (int h = 0; h < N; ++h) {
#pragma GCC unroll 16
    for (int i = 0; i < 4 * kVecs; ++i) sums[h][i] = _mm512_setzero_si512();
  }
  for (int j = 0; j < live; j += 4) {
    __m512i quads[4 * kVecs];
#pragma GCC unroll 16
    for (int c = 0; c < kVecs; ++c) {
      const __m512i r0 = _mm512_loadu_si512(reinterpret_cast<const void*>(rows[j] + 64 * c));
      const __m512i r1 = _mm512_loadu_si512(reinterpret_cast<const void*>(rows[j + 1] + 64 * c));
      const __m512i r2 = _mm512_loadu_si512(reinterpret_cast<const void*>(rows[j + 2] + 64 * c));
      const __m512i r3 = _mm512_loadu_si512(reinterpret_cast<const void*>(rows[j + 3] + 64 * c));
      const __m512i lo01 = _mm512_unpacklo_epi8(r0, r1), hi01 = _mm512_unpackhi_epi8(r0, r1);
      const __m512i lo23 = _mm512_unpacklo_epi8(r2, r3), hi23 = _mm512_unpackhi_epi8(r2, r3);
      quads[4 * c + 0] = _mm512_unpacklo_epi16(lo01, lo23);
      quads[4 * c + 1] = _mm512_unpackhi_epi16(lo01, lo23);
      quads[4 * c + 2] = _mm512_unpacklo_epi16(hi01, hi23);
      quads[4 * c + 3] = _mm512_unpackhi_epi16(hi01, hi23);
    }
#pragma GCC unroll 16
    for (int h = 0; h < N; ++h) {
      int32_t four;
      std::memcpy(&four, w8 + h * w_stride + j, sizeof(four));
      const __m512i w = _mm512_set1_epi32(four);
#pragma GCC unroll 16
      for (int i = 0; i < 4 * kVecs; ++i) tokenloom::dpbusd(sums[h][i], w, quads[i]);
    }
  }
#pragma GCC unroll 16
  for (int h = 0; h < N; ++h) {
    const __m512 f = _mm512_set1_ps(w_mul[h * w_mul_stride]);
    float* a = acc + h * HD;
#pragma GCC unroll 16
    for (int i = 0; i < 4 * kVecs; ++i) {
      _mm512_storeu_ps(a + 16 * i, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[h][i]), f, _mm512_loadu_ps(a + 16 * i)));
    }
  }
}

// Decode attention over an int8 cache with AVX-512 VNNI: integer dot products of 64 bytes per instruction, twice
// the multiplies of a bf16 dot product in less time on the CPUs measured (benchmarks/RESULTS.md), so the 8-bit
// cache is read faster than a bf16 one, not just in fewer bytes. As llama.cpp does for its q8_0 cache:
//   q.k: each query head is quantized once per call in two int8 parts, q = s (q1 + q2 / 256) (one part alone cost
//        up to 5% of an output's norm: a score's error grows with K's outlier channels), so each row takes two
//        integer dot products, combined as 256 q1.k + q2.k in int32; K's codes go in as unsigned (code + 128, one
//        XOR a vector, shared by the heads) and the 128 * sum(q) that adds is taken off again. 16 keys' codes are
//        transposed first, 4 codes of every key a vector, so each head's sums build up in the keys' lanes against
//        its query's 4 codes broadcast: no horizontal sums (they took 45 shuffles a head and 16 keys, the transpose
//        64 shared by the heads; 64 keys x 512 contexts 1.2x faster, benchmarks/RESULTS.md);
//   p.v: per 16 keys, each head's probabilities times V's scales are quantized to 0..255 against their largest, and
//        4 keys' weights meet 4 keys' codes interleaved per dimension; each 16 keys' integer sums are then added,
//        scaled, into float32 accumulators under the running softmax (as attend_bf16_avx512 streams its chunks).
// Accumulators hold the dimensions in the order the interleave leaves them (see int8_finish). The work is split as
// the bf16 kernels' is: a running state (Int8Running), a chunk of 64 keys of one KV head (int8_chunk), the end
// (int8_finish); a unit is one KV head (attend_int8_vnni) or a whole sequence (attend_int8_rows).
template <int HD>
struct Int8Running {
  static constexpr int kChunk = 64;
  float* scores;      // [heads][kChunk]
  float* acc;         // [heads][HD]
  float* run_max;     // [heads]
  float* run_sum;     // [heads]
  float* q_mul;       // [heads]: each head's q scale x the softmax scale
  float* w_mul;       // [heads][kChunk / 16]: each 16 keys' weight scale
  int32_t* q_offset;  // [heads]: 128 x the sum of 256 q1 + q2
  int8_t* q8;         // [heads][2][HD]: each head's two parts
  uint8_t* w8;        // [heads][kChunk]

  // The queries [heads][HD] quantized, nothing summed yet; in the caller's scratch.
  template <typename T>
  static Int8Running start(const T* q, int64_t heads, float scale, std::vector<float>& scratch) {
    const int64_t floats = heads * (kChunk + HD + 4 + kChunk / 16);  // q_offset's int32 among them
    scratch.resize(floats + heads * (2 * HD + kChunk) / 4 + 16);
    float* f = scratch.data();
    Int8Running state{f, f + heads * kChunk, f + heads * (kChunk + HD), f + heads * (kChunk + HD + 1),
                      f + heads * (kChunk + HD + 2), f + heads * (kChunk + HD + 3),
                      reinterpret_cast<int32_t*>(f + heads * (kChunk + HD + 3 + kChunk / 16)),
                      reinterpret_cast<int8_t*>(f + floats), nullptr};
    state.w8 = reinterpret_cast<uint8_t*>(state.q8 + 2 * heads * HD);
    for (int64_t h = 0; h < heads; ++h) {
      float amax = 0.0f;
      for (int d = 0; d < HD; ++d) amax = std::max(amax, std::fabs(widen(q[h * HD + d])));
      const float qs = amax > 0.0f ? amax / 127.0f : 1.0f;
      int32_t sum = 0;
      int8_t* q1 = state.q8 + 2 * h * HD;
      int8_t* q2 = q1 + HD;
      for (int d = 0; d < HD; ++d) {
        const float x = widen(q[h * HD + d]) / qs;
        const float first = std::nearbyint(x);
        q1[d] = static_cast<int8_t>(first);
        q2[d] = static_cast<int8_t>(std::clamp(std::nearbyint((x - first) * 256.0f), -127.0f, 127.0f));
        sum += 256 * q1[d] + q2[d];
      }
      state.q_offset[h] = 128 * sum;
      state.q_mul[h] = qs / 256.0f * scale;
    }
    std::fill(state.acc, state.acc + heads * HD, 0.0f);
    std::fill(state.run_max, state.run_max + heads, kNoMax);
    std::fill(state.run_sum, state.run_sum + heads, 0.0f);
    return state;
  }

  // The state of query heads from `first` on.
  Int8Running from(int64_t first) const {
    return {scores + first * kChunk, acc + first * HD, run_max + first, run_sum + first, q_mul + first,
            w_mul + first * (kChunk / 16), q_offset + first, q8 + first * 2 * HD, w8 + first * kChunk};
  }
};

// The query heads whose integer accumulators fit in registers at once, in the p.v pass.
template <int HD>
constexpr int64_t kInt8Pass = 256 / HD;

// The calls int8_chunk makes to between() in a chunk of 64 keys: one a head and 16 keys in the q.k pass, one a pass
// and 16 keys in the p.v pass.
template <int HD>
constexpr int64_t int8_chunk_calls(int64_t heads) {
  return (Int8Running<HD>::kChunk / 16) * (heads + (heads + kInt8Pass<HD> - 1) / kInt8Pass<HD>);
}

// Keys c0 .. c0 + keys of one KV head (its `heads` query heads' state) into the running softmax: q.k 16 keys at a
// time, the chunk's softmax, then p.v. between() is called int8_chunk_calls times, spread over the chunk: where the
// caller fetches the next chunk.
template <int HD, typename Between>
void int8_chunk(const Int8Running<HD>& state, const uint8_t* k_cache, const uint8_t* v_cache, const int64_t* table,
                int64_t c0, int64_t keys, int64_t ctx, int64_t heads, int64_t row, int64_t block_stride,
                int64_t block_size, int64_t scale_offset, const Between& between) {
  static_assert(HD % 64 == 0, "whole 64-byte vectors of codes");
  constexpr int kVecs = HD / 64;
  constexpr int kChunk = Int8Running<HD>::kChunk;
  constexpr int kPass = kInt8Pass<HD>;
  const uint8_t* raw[16];
  alignas(64) float k_scales[16];
  alignas(64) float v_scales[kChunk];
  auto store_scores = [&](int64_t h, int64_t t0, __m512i exact) {
    const __m512 times = _mm512_mul_ps(_mm512_set1_ps(state.q_mul[h]), _mm512_load_ps(k_scales));
    _mm512_storeu_ps(state.scores + h * kChunk + (t0 - c0), _mm512_mul_ps(_mm512_cvtepi32_ps(exact), times));
  };
  for (int64_t t0 = c0; t0 < c0 + keys; t0 += 16) {
    group_rows(k_cache, table, t0, ctx, row, block_stride, block_size, raw);
    group_scales<tokenloom::kInt8>(raw, k_cache, v_cache, scale_offset, k_scales, v_scales + (t0 - c0));
    __m512i columns[16 * kVecs];  // codes 4i .. 4i + 3 of the 16 keys, as unsigned (+ 128)
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int c = 0; c < kVecs; ++c) {
      __m512i m[16];
      for (int j = 0; j < 16; ++j) m[j] = _mm512_loadu_si512(reinterpret_cast<const void*>(raw[j] + 64 * c));
      transpose_dwords(m);
      for (int r = 0; r < 16; ++r) columns[16 * c + r] = _mm512_xor_si512(m[r], flip);
    }
    for (int64_t h = 0; h < heads; ++h) {
      between();
      const int8_t* q1 = state.q8 + 2 * h * HD;
      const int8_t* q2 = q1 + HD;
      __m512i first[4], second[4];  // 4 sums each: the multiply-adds' latency covered
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) first[i] = second[i] = _mm512_setzero_si512();
#pragma GCC unroll 32
      for (int i = 0; i < 16 * kVecs; ++i) {
        int32_t four1, four2;
        std::memcpy(&four1, q1 + 4 * i, sizeof(four1));
        std::memcpy(&four2, q2 + 4 * i, sizeof(four2));
        tokenloom::dpbusd(first[i % 4], columns[i], _mm512_set1_epi32(four1));
        tokenloom::dpbusd(second[i % 4], columns[i], _mm512_set1_epi32(four2));
      }
      const __m512i one = _mm512_add_epi32(_mm512_add_epi32(first[0], first[1]), _mm512_add_epi32(first[2], first[3]));
      const __m512i two =
          _mm512_add_epi32(_mm512_add_epi32(second[0], second[1]), _mm512_add_epi32(second[2], second[3]));
      const __m512i exact = _mm512_add_epi32(_mm512_slli_epi32(one, 8), two);
      store_scores(h, t0, _mm512_sub_epi32(exact, _mm512_set1_epi32(state.q_offset[h])));
    }
  }
  // Online softmax, as attend_bf16_avx512; then each 16 keys' weights (p x V's scale) as bytes.
  softmax_chunk<HD>(state.scores, kChunk, heads, keys, state.run_max, state.run_sum, state.acc,
                    [&](int64_t h, int g, __m512 p) {
                      const __m512 w = _mm512_mul_ps(p, _mm512_load_ps(v_scales + 16 * g));
                      const float w_max = _mm512_reduce_max_ps(w);
                      const float to_byte = w_max > 0.0f ? 255.0f / w_max : 0.0f;
                      state.w_mul[h * (kChunk / 16) + g] = w_max / 255.0f;
                      const __m512i bytes = _mm512_cvtps_epi32(_mm512_mul_ps(w, _mm512_set1_ps(to_byte)));  // nearest
                      _mm_storeu_si128(reinterpret_cast<__m128i*>(state.w8 + h * kChunk + 16 * g),
                                       _mm512_cvtusepi32_epi8(bytes));
                    });
  // p.v, kPass heads at a time: per 16 keys, 4 keys per integer dot product (their codes interleaved per dim).
  for (int64_t h0 = 0; h0 < heads; h0 += kPass) {
    const int n = static_cast<int>(std::min<int64_t>(kPass, heads - h0));
    for (int64_t t0 = c0; t0 < c0 + keys; t0 += 16) {
      group_rows(v_cache, table, t0, ctx, row, block_stride, block_size, raw);
      between();
      const int live = static_cast<int>(std::min<int64_t>(16, c0 + keys - t0));  // past it: weight 0
      const int64_t g = (t0 - c0) / 16;
      with_count<kPass>(n, [&]<int N>() {
        weigh_group_vnni<HD, N>(raw, live, state.w8 + h0 * kChunk + (t0 - c0), kChunk,
                                state.w_mul + h0 * (kChunk / 16) + g, kChunk / 16, state.acc + h0 * HD);
      });
    }
  }
}

// The heads' outputs (and a split's denominators). Accumulator 4c + m, lane 4L + r holds dim 64c + 16L + 4m + r
// (the unpacks work within 128-bit lanes).
template <typename T, int HD>
void int8_finish(const Int8Running<HD>& state, int64_t heads, const HeadsOut<T>& out) {
  for (int64_t h = 0; h < heads; ++h) {
    const float inv = 1.0f / state.run_sum[h];
    for (int c = 0; c < HD / 64; ++c) {
      for (int m = 0; m < 4; ++m) {
        for (int lane = 0; lane < 16; ++lane) {
          const int dim = 64 * c + 16 * (lane / 4) + 4 * m + lane % 4;
          out.put(h * HD + dim, state.acc[h * HD + 16 * (4 * c + m) + lane] * inv);
        }
      }
    }
    out.denominator(h, state.run_max[h], state.run_sum[h]);
  }
}

// One sequence's KV heads `kv_heads` (one unit's: one, or every head of the cache) from an int8 cache: each chunk's
// keys KV head by KV head, a block's entries for all of them (kv_heads x block_size x (HD + 4) bytes in one run for a
// whole sequence, kv_codes.h) fetched a chunk ahead a few keys at a time (RowsAhead; V's with K's: see prefetch_rows).
// A head's arithmetic is the same whichever unit it is in, so its output bits are.
template <typename T, int HD>
void attend_int8_heads(const T* q, const uint8_t* k_cache, const uint8_t* v_cache, const int64_t* table, int64_t ctx,
                       int64_t group, int64_t kv_heads, int64_t head_stride, int64_t block_stride, int64_t block_size,
                       float scale, const HeadsOut<T>& out, std::vector<float>& scratch) {
  constexpr int64_t kChunk = Int8Running<HD>::kChunk;
  constexpr int64_t kEntry = HD + 4;  // codes, then the scale
  const Int8Running<HD> state = Int8Running<HD>::start(q, kv_heads * group, scale, scratch);
  const int64_t calls = kv_heads * int8_chunk_calls<HD>(group);
  RowsAhead<uint8_t> ahead{k_cache,    v_cache,      table, kEntry, block_stride, block_size, ctx,
                           (kChunk + calls - 1) / calls, kv_heads, head_stride};
  ahead.upto(kChunk);
  for (int64_t c0 = 0; c0 < ctx; c0 += kChunk) {
    for (int64_t kv_head = 0; kv_head < kv_heads; ++kv_head) {
      int8_chunk<HD>(state.from(kv_head * group), k_cache + kv_head * head_stride, v_cache + kv_head * head_stride,
                     table, c0, std::min(kChunk, ctx - c0), ctx, group, kEntry, block_stride, block_size, HD,
                     [&] { ahead.some(c0 + 2 * kChunk); });
    }
  }
  for (int64_t kv_head = 0; kv_head < kv_heads; ++kv_head) {
    int8_finish<T, HD>(state.from(kv_head * group), group, out.from(kv_head * group, HD));
  }
}

// One sequence, one KV head (its layout's `row` is an entry, HD + 4 bytes; its scale HD bytes in).
template <typename T, int HD>
void attend_int8_vnni(const T* q, const uint8_t* k_cache, const uint8_t* v_cache, const int64_t* table, int64_t ctx,
                      int64_t group, int64_t row, int64_t block_stride, int64_t block_size, int64_t scale_offset,
                      float scale, const HeadsOut<T>& out, std::vector<float>& scratch) {
  TORCH_INTERNAL_ASSERT(row == HD + 4 && scale_offset == HD, "an int8 head's entries: HD codes, then the scale");
  attend_int8_heads<T, HD>(q, k_cache, v_cache, table, ctx, group, 1, 0, block_stride, block_size, scale, out,
                           scratch);
}

// One sequence, every KV head.
template <typename T, int HD>
void attend_int8_rows(const T* q, const uint8_t* k_cache, const uint8_t* v_cache, const int64_t* table, int64_t ctx,
                      int64_t group, int64_t num_kv_heads, int64_t block_size, float scale, const HeadsOut<T>& out,
                      std::vector<float>& scratch) {
  const int64_t head_stride = block_size * (HD + 4);
  attend_int8_heads<T, HD>(q, k_cache, v_cache, table, ctx, group, num_kv_heads, head_stride,
                           num_kv_heads * head_stride, block_size, scale, out, scratch);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// 8 vectors in, one out: lane j holds the sum of v[j]'s 8 lanes (6 horizontal adds, 2 permutes, 1 add for 8 sums).
inline __m256 sum_each8(const __m256* v) {
  // Per 128-bit lane, hadd(a, b) = [a0 + a1, a2 + a3, b0 + b1, b2 + b3]: two rounds leave each lane of each half
  // holding one vector's sum over that half.
  const __m256 low = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 high = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20), _mm256_permute2f128_ps(low, high, 0x31));
}

// Where the keys of a chunk lie in a cache (elements from its start), walked block by block (no division per key);
// and their K and V rows (row_bytes each, codes and scale for an 8-bit cache) fetched into L2 while the chunk before
// them is multiplied: a block's successor lies elsewhere, where no hardware prefetcher looks.
template <typename Elem>
struct ChunkWalk {
  const Elem* k_cache;
  const Elem* v_cache;
  const int64_t* table;
  int64_t ctx, row, block_stride, block_size, row_bytes;

  void locate(int64_t c0, int64_t chunk, int64_t* at) const {
    const int64_t keys = std::min<int64_t>(chunk, ctx - c0);
    int64_t block = c0 / block_size, offset = c0 % block_size;
    for (int64_t t = 0; t < keys; ++t) {
      at[t] = table[block] * block_stride + offset * row;
      if (++offset == block_size) {
        offset = 0;
        ++block;
      }
    }
    for (int64_t t = 0; t < keys; ++t) {
      const char* k = reinterpret_cast<const char*>(k_cache + at[t]);
      const char* v = reinterpret_cast<const char*>(v_cache + at[t]);
      for (int64_t b = 0; b < row_bytes; b += 64) {
        _mm_prefetch(k + b, _MM_HINT_T1);
        _mm_prefetch(v + b, _MM_HINT_T1);
      }
      _mm_prefetch(k + row_bytes - 1, _MM_HINT_T1);  // a row that starts mid-line ends in one more
      _mm_prefetch(v + row_bytes - 1, _MM_HINT_T1);
    }
  }
};

// The online softmax meeting a chunk of `keys` scores (the AVX2 kernels): what one query head summed under a lower
// running maximum (its HD accumulators and its sum) is rescaled to the chunk's; returns the running maximum.
template <int HD>
inline float meet_chunk(const float* scores, int keys, float& run_max, float& run_sum, float* acc) {
  float chunk_max = kNoMax;
  for (int t = 0; t < keys; ++t) chunk_max = std::max(chunk_max, scores[t]);
  if (chunk_max > run_max) {
    const float correction = std::exp(run_max - chunk_max);  // 0 before the first chunk (kNoMax)
    for (int d = 0; d < HD; ++d) acc[d] *= correction;
    run_sum *= correction;
    run_max = chunk_max;
  }
  return run_max;
}

// The same attention for float32 queries with AVX2 and FMA (the default dtype where the CPU has no AVX-512 BF16),
// from a float32 cache or an 8-bit one. As in the bf16 kernel the context streams through in chunks of kChunk keys
// with an online softmax, K and V in one sweep; q.k for 8 keys at a time, their sums transposed into one vector
// (sum_each8), and the query vector loaded once for the 8. The generic loop this replaces widened every row into a
// buffer, reduced each dot product alone and divided by the block size for every key: about half the time per key
// and KV head here (20 ns with the cache in L3; from memory ~40-54 ns, ~10-12 GB/s of cache read; benchmarks/
// RESULTS.md). An 8-bit cache's rows are widened to float32, scale applied, once a chunk (the query heads share
// them).
template <int HD, int64_t Kind>
void attend_f32_avx2(const float* q, const std::conditional_t<Kind == tokenloom::kPlain, float, uint8_t>* k_cache,
                     const std::conditional_t<Kind == tokenloom::kPlain, float, uint8_t>* v_cache,
                     const int64_t* table, int64_t ctx, int64_t group, int64_t row, int64_t block_stride,
                     int64_t block_size, int64_t scale_offset, float scale, const HeadsOut<float>& out,
                     std::vector<float>& scratch) {
  using Elem = std::conditional_t<Kind == tokenloom::kPlain, float, uint8_t>;
  static_assert(HD % 64 == 0, "whole tiles of 64 dims");
  constexpr int kChunk = 64;  // keys per step of the online softmax
  constexpr int kTile = 8;    // accumulator vectors (64 dims) held in registers at once
  const int64_t heads = group;
  const int64_t widened_floats = Kind == tokenloom::kPlain ? 0 : 2 * kChunk * HD;
  scratch.resize(heads * (2 * HD + kChunk + 2) + widened_floats);
  float* qf = scratch.data();          // [heads][HD]: the queries, times the softmax scale
  float* acc = qf + heads * HD;        // [heads][HD]
  float* scores = acc + heads * HD;    // [heads][kChunk]: the chunk's scores, then its probabilities
  float* run_max = scores + heads * kChunk;
  float* run_sum = run_max + heads;
  float* k_widened = run_sum + heads;  // an 8-bit cache's chunk of K rows, then of V rows, as float32
  float* v_widened = k_widened + kChunk * HD;
  for (int64_t i = 0; i < heads * HD; ++i) qf[i] = q[i] * scale;
  std::fill(acc, acc + heads * HD, 0.0f);
  std::fill(run_max, run_max + heads, kNoMax);
  std::fill(run_sum, run_sum + heads, 0.0f);
  const float* k_rows[kChunk];
  const float* v_rows[kChunk];
  int64_t chunk_at[2][kChunk];  // where each key of this chunk and of the next lies, from the cache's start
  constexpr int64_t kRowBytes = Kind == tokenloom::kPlain ? HD * sizeof(float) : HD + 4;  // codes and scale
  const ChunkWalk<Elem> walk{k_cache, v_cache, table, ctx, row, block_stride, block_size, kRowBytes};
  walk.locate(0, kChunk, chunk_at[0]);
  for (int64_t c0 = 0; c0 < ctx; c0 += kChunk) {
    const int keys = static_cast<int>(std::min<int64_t>(kChunk, ctx - c0));
    const int64_t* here = chunk_at[(c0 / kChunk) % 2];
    if (c0 + kChunk < ctx) walk.locate(c0 + kChunk, kChunk, chunk_at[(c0 / kChunk + 1) % 2]);
    for (int t = 0; t < keys; ++t) {
      const int64_t at = here[t];
      if constexpr (Kind == tokenloom::kPlain) {
        k_rows[t] = k_cache + at;
        v_rows[t] = v_cache + at;
      } else {
        tokenloom::decode_codes<Kind>(k_cache + at, tokenloom::read_scale(k_cache + at + scale_offset),
                                      k_widened + t * HD, HD);
        tokenloom::decode_codes<Kind>(v_cache + at, tokenloom::read_scale(v_cache + at + scale_offset),
                                      v_widened + t * HD, HD);
        k_rows[t] = k_widened + t * HD;
        v_rows[t] = v_widened + t * HD;
      }
    }
    for (int t = keys; t < (keys + 7) / 8 * 8; ++t) k_rows[t] = k_rows[keys - 1];  // a last group's spare lanes
    for (int64_t h = 0; h < heads; ++h) {
      const float* qh = qf + h * HD;
      for (int j0 = 0; j0 < keys; j0 += 8) {
        __m256 dots[8];
        for (int j = 0; j < 8; ++j) dots[j] = _mm256_setzero_ps();
        for (int d = 0; d < HD; d += 8) {
          const __m256 qv = _mm256_loadu_ps(qh + d);
          for (int j = 0; j < 8; ++j) dots[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k_rows[j0 + j] + d), dots[j]);
        }
        _mm256_storeu_ps(scores + h * kChunk + j0, sum_each8(dots));  // lanes past `keys` are never read
      }
    }
    // Online softmax: probabilities against the running maximum; what was summed under an older one is rescaled.
    for (int64_t h = 0; h < heads; ++h) {
      float* s = scores + h * kChunk;
      float* a = acc + h * HD;
      const float m = meet_chunk<HD>(s, keys, run_max[h], run_sum[h], a);
      float total = 0.0f;
      for (int t = 0; t < keys; ++t) {
        s[t] = std::exp(s[t] - m);
        total += s[t];
      }
      run_sum[h] += total;
      // The chunk's V rows, weighted, 64 dims at a time (their accumulators in registers).
      for (int d0 = 0; d0 < HD; d0 += 8 * kTile) {
        __m256 sums[kTile];
        for (int c = 0; c < kTile; ++c) sums[c] = _mm256_loadu_ps(a + d0 + 8 * c);
        for (int t = 0; t < keys; ++t) {
          const __m256 w = _mm256_set1_ps(s[t]);
          const float* v = v_rows[t] + d0;
          for (int c = 0; c < kTile; ++c) sums[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * c), sums[c]);
        }
        for (int c = 0; c < kTile; ++c) _mm256_storeu_ps(a + d0 + 8 * c, sums[c]);
      }
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    const float inv = 1.0f / run_sum[h];
    for (int d = 0; d < HD; ++d) out.put(h * HD + d, acc[h * HD + d] * inv);
    out.denominator(h, run_max[h], run_sum[h]);
  }
}

// 8 int32 vectors in, one out: lane j holds the sum of v[j]'s 8 lanes (sum_each8, in integers).
inline __m256i sum_each8_epi32(const __m256i* v) {
  const __m256i low = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i high = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(low, high, 0x20), _mm256_permute2x128_si256(low, high, 0x31));
}

// 8 int32 -> 8 int16, saturating, in order.
inline __m128i narrow8_epi32(__m256i x) {
  return _mm_packs_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
}

// p.v of one chunk for query heads h0 .. h0 + N - 1 over the 32 dims at d0, into their float accumulators: each
// pair of keys' V codes interleaved per dim and widened to int16, against the two keys' int16 weights in one
// vpmaddwd; the chunk's int32 sums (|w| <= 32767, |code| <= 127, 64 keys: under 2^31) scaled once at the end.
template <int N, int HD>
inline void weigh_values_int16(const uint8_t* const* v_rows, int pairs, const int16_t* w16, int chunk,
                               const float* w_mul, float* acc, int d0) {
  __m256i sums[N][4];
  for (int h = 0; h < N; ++h) {
    for (int i = 0; i < 4; ++i) sums[h][i] = _mm256_setzero_si256();
  }
  for (int p = 0; p < pairs; ++p) {
    for (int c = 0; c < 2; ++c) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v_rows[2 * p] + d0 + 16 * c));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v_rows[2 * p + 1] + d0 + 16 * c));
      const __m256i low = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(a, b));  // (a_d, b_d) for the first 8 dims
      const __m256i high = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(a, b));
      for (int h = 0; h < N; ++h) {
        int32_t two;
        std::memcpy(&two, w16 + h * chunk + 2 * p, sizeof(two));
        const __m256i w = _mm256_set1_epi32(two);
        sums[h][2 * c] = _mm256_add_epi32(sums[h][2 * c], _mm256_madd_epi16(low, w));
        sums[h][2 * c + 1] = _mm256_add_epi32(sums[h][2 * c + 1], _mm256_madd_epi16(high, w));
      }
    }
  }
  for (int h = 0; h < N; ++h) {
    const __m256 f = _mm256_set1_ps(w_mul[h]);
    float* a = acc + h * HD + d0;
    for (int i = 0; i < 4; ++i) {
      _mm256_storeu_ps(a + 8 * i, _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[h][i]), f, _mm256_loadu_ps(a + 8 * i)));
    }
  }
}

// Decode attention for float32 queries over an int8 cache with AVX2, in integers where the float32 kernel above
// widens every code to float32 (which left it bound by those conversions, not by memory: 22 ns per key and KV
// head against float32's 36, for a quarter of the bytes; benchmarks/RESULTS.md). As attend_int8_vnni does with
// bytes, in 16-bit words that AVX2's vpmaddwd multiplies exactly:
//   q.k: each query head quantized once per call to int16 against its largest |q| (an error of 2^-16 of it); a
//        chunk's K rows sign-extended to int16 once and shared by the heads; 8 keys' int32 dot products summed
//        into one vector, then times q's scale and each key's K scale;
//   p.v: each head's probabilities times V's scales, quantized to int16 against the chunk's largest, two keys per
//        vpmaddwd (their codes interleaved per dim), summed over the chunk in int32 and added, scaled, into the
//        float32 accumulators under the running softmax.
template <int HD>
void attend_int8_avx2(const float* q, const uint8_t* k_cache, const uint8_t* v_cache, const int64_t* table,
                      int64_t ctx, int64_t group, int64_t row, int64_t block_stride, int64_t block_size,
                      int64_t scale_offset, float scale, const HeadsOut<float>& out, std::vector<float>& scratch) {
  static_assert(HD % 32 == 0, "whole tiles of 32 dims");
  constexpr int kChunk = 64;  // keys per step of the online softmax
  constexpr int kPass = 3;    // query heads whose p.v sums fit in registers at once (12 of 16)
  const int64_t heads = group;
  // float scratch: acc [heads][HD], scores [heads][kChunk], run_max, run_sum, q_mul, w_mul [heads], k_scales and
  // v_scales [kChunk]; then int16: q16 [heads][HD], k16 [kChunk][HD], w16 [heads][kChunk].
  const int64_t floats = heads * (HD + kChunk + 4) + 2 * kChunk;
  scratch.resize(floats + (heads * HD + kChunk * HD + heads * kChunk) / 2 + 8);
  float* acc = scratch.data();
  float* scores = acc + heads * HD;
  float* run_max = scores + heads * kChunk;
  float* run_sum = run_max + heads;
  float* q_mul = run_sum + heads;  // each head's q scale x the softmax scale
  float* w_mul = q_mul + heads;    // each head's weight scale in this chunk
  float* k_scales = w_mul + heads;
  float* v_scales = k_scales + kChunk;
  int16_t* q16 = reinterpret_cast<int16_t*>(scratch.data() + floats);
  int16_t* k16 = q16 + heads * HD;
  int16_t* w16 = k16 + kChunk * HD;
  for (int64_t h = 0; h < heads; ++h) {
    float amax = 0.0f;
    for (int d = 0; d < HD; ++d) amax = std::max(amax, std::fabs(q[h * HD + d]));
    const float qs = amax > 0.0f ? amax / 32767.0f : 1.0f;
    const float inv = 1.0f / qs;
    for (int d = 0; d < HD; ++d) q16[h * HD + d] = static_cast<int16_t>(std::nearbyint(q[h * HD + d] * inv));
    q_mul[h] = qs * scale;
  }
  std::fill(acc, acc + heads * HD, 0.0f);
  std::fill(run_max, run_max + heads, kNoMax);
  std::fill(run_sum, run_sum + heads, 0.0f);
  const uint8_t* v_rows[kChunk];
  int64_t chunk_at[2][kChunk];
  const ChunkWalk<uint8_t> walk{k_cache, v_cache, table, ctx, row, block_stride, block_size, HD + 4};
  walk.locate(0, kChunk, chunk_at[0]);
  for (int64_t c0 = 0; c0 < ctx; c0 += kChunk) {
    const int keys = static_cast<int>(std::min<int64_t>(kChunk, ctx - c0));
    const int padded = (keys + 7) / 8 * 8;  // whole groups of 8 keys: the spare ones score 0 and weigh 0
    const int64_t* here = chunk_at[(c0 / kChunk) % 2];
    if (c0 + kChunk < ctx) walk.locate(c0 + kChunk, kChunk, chunk_at[(c0 / kChunk + 1) % 2]);
    for (int t = 0; t < keys; ++t) {
      const uint8_t* k = k_cache + here[t];
      for (int d = 0; d < HD; d += 16) {
        const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(k + d));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(k16 + t * HD + d), _mm256_cvtepi8_epi16(codes));
      }
      k_scales[t] = tokenloom::read_scale(k + scale_offset);
      v_scales[t] = tokenloom::read_scale(v_cache + here[t] + scale_offset);
      v_rows[t] = v_cache + here[t];
    }
    for (int t = keys; t < padded; ++t) {
      k_scales[t] = 0.0f;
      std::memset(k16 + t * HD, 0, HD * sizeof(int16_t));
    }
    if (keys % 2) v_rows[keys] = v_rows[keys - 1];  // the last pair's spare key, under weight 0
    for (int64_t h = 0; h < heads; ++h) {
      const int16_t* qh = q16 + h * HD;
      const __m256 q_scale = _mm256_set1_ps(q_mul[h]);
      for (int j0 = 0; j0 < padded; j0 += 8) {
        __m256i dots[8];
        for (int j = 0; j < 8; ++j) dots[j] = _mm256_setzero_si256();
        for (int d = 0; d < HD; d += 16) {
          const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + d));
          for (int j = 0; j < 8; ++j) {
            const __m256i k = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k16 + (j0 + j) * HD + d));
            dots[j] = _mm256_add_epi32(dots[j], _mm256_madd_epi16(qv, k));
          }
        }
        const __m256 ks = _mm256_mul_ps(q_scale, _mm256_loadu_ps(k_scales + j0));
        _mm256_storeu_ps(scores + h * kChunk + j0, _mm256_mul_ps(_mm256_cvtepi32_ps(sum_each8_epi32(dots)), ks));
      }
    }
    // Online softmax as in attend_f32_avx2; then each head's weights, p x V's scale, as int16.
    for (int64_t h = 0; h < heads; ++h) {
      float* s = scores + h * kChunk;
      const float m = meet_chunk<HD>(s, keys, run_max[h], run_sum[h], acc + h * HD);
      float total = 0.0f, w_max = 0.0f;
      for (int t = 0; t < keys; ++t) {
        const float p = std::exp(s[t] - m);
        total += p;
        s[t] = p * v_scales[t];
        w_max = std::max(w_max, s[t]);
      }
      run_sum[h] += total;
      const __m256 to_word = _mm256_set1_ps(w_max > 0.0f ? 32767.0f / w_max : 0.0f);
      w_mul[h] = w_max / 32767.0f;
      int16_t* w = w16 + h * kChunk;
      for (int t = 0; t < padded; t += 8) {
        const __m256i words = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(s + t), to_word));  // to nearest
        _mm_storeu_si128(reinterpret_cast<__m128i*>(w + t), narrow8_epi32(words));
      }
    }
    const int pairs = (keys + 1) / 2;
    for (int64_t h0 = 0; h0 < heads; h0 += kPass) {
      const int16_t* w = w16 + h0 * kChunk;
      with_count<kPass>(static_cast<int>(std::min<int64_t>(kPass, heads - h0)), [&]<int N>() {
        for (int d0 = 0; d0 < HD; d0 += 32) {
          weigh_values_int16<N, HD>(v_rows, pairs, w, kChunk, w_mul + h0, acc + h0 * HD, d0);
        }
      });
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    const float inv = 1.0f / run_sum[h];
    for (int d = 0; d < HD; ++d) out.put(h * HD + d, acc[h * HD + d] * inv);
    out.denominator(h, run_max[h], run_sum[h]);
  }
}
#endif  // __AVX2__ && __FMA__

// Where one sequence's KV head lies in a cache: its first element in slot 0, the slot's stride (elements of the
// cache's dtype), and for an 8-bit cache the bytes from the head's codes to its scale.
struct HeadLayout {
  int64_t offset, row, block_stride, scale_offset;
};

inline HeadLayout head_layout(int64_t kind, int64_t row, int64_t num_kv_heads, int64_t head_dim, int64_t kv_head,
                              int64_t block_size) {
  if (kind == tokenloom::kPlain) return {kv_head * head_dim, row, block_size * row, 0};
  const int64_t entry = head_dim + 4;  // kv_codes.h: a block's entries, head by head
  return {tokenloom::entry_offset(0, kv_head, 0, num_kv_heads, block_size, head_dim), entry, block_size * row,
          head_dim};
}

// One (sequence, KV head) unit of decode attention, from a cache of kind Kind.
template <typename T, int64_t Kind>
void attend_unit(const T* q_head, const at::Tensor& k_cache, const at::Tensor& v_cache, HeadLayout at,
                 const int64_t* table, int64_t ctx, int64_t group, int64_t head_dim, int64_t block_size, float s,
                 const HeadsOut<T>& out_head, std::vector<float>& scratch) {
  using Elem = std::conditional_t<Kind == tokenloom::kPlain, T, uint8_t>;
  const Elem* k = k_cache.const_data_ptr<Elem>() + at.offset;
  const Elem* v = v_cache.const_data_ptr<Elem>() + at.offset;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  // An int8 cache stays on VNNI's integer products on AMX CPUs too: widened to bf16 for the tiles it was read 1.3x
  // slower (benchmarks/RESULTS.md).
  if constexpr (Kind == tokenloom::kInt8) {
    if (head_dim == 64) {
      attend_int8_vnni<T, 64>(q_head, k, v, table, ctx, group, at.row, at.block_stride, block_size, at.scale_offset, s,
                              out_head, scratch);
      return;
    }
    if (head_dim == 128) {
      attend_int8_vnni<T, 128>(q_head, k, v, table, ctx, group, at.row, at.block_stride, block_size, at.scale_offset,
                               s, out_head, scratch);
      return;
    }
  }
#endif
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (head_dim == 64) {
      attend_bf16_avx512<64, Kind>(q_head, k, v, table, ctx, group, at.row, at.block_stride, block_size,
                                   at.scale_offset, s, out_head, scratch);
      return;
    }
    if (head_dim == 128) {
      attend_bf16_avx512<128, Kind>(q_head, k, v, table, ctx, group, at.row, at.block_stride, block_size,
                                    at.scale_offset, s, out_head, scratch);
      return;
    }
  }
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
  // An int8 cache without VNNI stays on attend_int8_avx2's integer products (not measured against widening here).
  if constexpr (std::is_same_v<T, float> && Kind != tokenloom::kInt8) {
    if (head_dim == 64) {
      attend_f32_avx512<64, Kind>(q_head, k, v, table, ctx, group, at.row, at.block_stride, block_size,
                                  at.scale_offset, s, out_head, scratch);
      return;
    }
    if (head_dim == 128) {
      attend_f32_avx512<128, Kind>(q_head, k, v, table, ctx, group, at.row, at.block_stride, block_size,
                                   at.scale_offset, s, out_head, scratch);
      return;
    }
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<T, float> && Kind == tokenloom::kInt8) {
    if (head_dim == 64) {
      attend_int8_avx2<64>(q_head, k, v, table, ctx, group, at.row, at.block_stride, block_size, at.scale_offset, s,
                           out_head, scratch);
      return;
    }
    if (head_dim == 128) {
      attend_int8_avx2<128>(q_head, k, v, table, ctx, group, at.row, at.block_stride, block_size, at.scale_offset,
                            s, out_head, scratch);
      return;
    }
  }
  if constexpr (std::is_same_v<T, float>) {
    if (head_dim == 64) {
      attend_f32_avx2<64, Kind>(q_head, k, v, table, ctx, group, at.row, at.block_stride, block_size, at.scale_offset,
                                s, out_head, scratch);
      return;
    }
    if (head_dim == 128) {
      attend_f32_avx2<128, Kind>(q_head, k, v, table, ctx, group, at.row, at.block_stride, block_size,
                                 at.scale_offset, s, out_head, scratch);
      return;
    }
  }
#endif
  auto rows = [&](const Elem* head) {
    if constexpr (Kind == tokenloom::kPlain) {
      return PlainRows<T>{head, at.row, at.block_stride};
    } else {
      return CodeRows<Kind>{head, at.row, at.block_stride, at.scale_offset};
    }
  };
  const auto k_rows = rows(k), v_rows = rows(v);
  if (head_dim == 64) {
    attend<T, 64>(q_head, k_rows, v_rows, table, ctx, group, head_dim, block_size, s, out_head, scratch);
  } else if (head_dim == 128) {
    attend<T, 128>(q_head, k_rows, v_rows, table, ctx, group, head_dim, block_size, s, out_head, scratch);
  } else {
    attend<T, 0>(q_head, k_rows, v_rows, table, ctx, group, head_dim, block_size, s, out_head, scratch);
  }
}

// The fewest keys in a split of a long context (split-K): a (sequence, KV head) unit is cut into up to one split per
// thread, each of at least this many keys, attended apart (by whichever threads are free) and merged. At batch 1 a
// model's few KV heads (3 for SmolLM2) would otherwise leave threads idle however long the context. 512 keys are
// 10-20 us of work, against a split's cost of writing and merging its heads' rows (~1 KB) and of starting on keys
// not yet fetched; splits of 512 whatever the thread count cost a crowd of long contexts 7-10% of an 8-bit cache's
// time on 2 threads (benchmarks/RESULTS.md), where no thread idles anyway.
constexpr int64_t kMinSplitKeys = 512;

// Keys per split of a context of ctx keys when the caller leaves it to the operator (0: attended whole). It depends on
// the context and the thread count alone, never on the batch, so a sequence's output is the same bit for bit alone
// or in a crowd. One thread: no splits.
int64_t auto_split_keys(int64_t ctx, int64_t block_size, int64_t threads) {
  const int64_t splits = std::min<int64_t>(threads, ctx / kMinSplitKeys);
  if (splits < 2) return 0;
  const int64_t keys = (ctx + splits - 1) / splits;
  return (keys + block_size - 1) / block_size * block_size;
}

// One piece of work: a (sequence, KV head) unit's keys [first, first + keys); `part` is its split's index among all
// splits (their rows in the partials), -1 where the unit is not split and writes the output itself. Where the call
// reads whole rows (reads_whole_rows), a unit is a sequence with every KV head, and kv_head is 0.
struct Piece {
  int64_t seq, kv_head, first, keys, part;
};

// Whether a call's units are whole sequences, every KV head of a block read in one sweep: a bf16 cache on AVX-512
// BF16 (attend_bf16_rows) or an int8 cache on VNNI (attend_int8_rows), with more than one KV head, where there are
// pieces enough to keep the threads busy (a sequence's pieces are its splits; below 2 a thread, one unit per KV
// head spreads better). The choice moves no output bit: each head's arithmetic is the same either way.
template <typename T, int64_t Kind>
bool reads_whole_rows(int64_t num_kv_heads, int64_t head_dim, int64_t whole_pieces, int64_t threads) {
  const bool worth_it = num_kv_heads > 1 && (head_dim == 64 || head_dim == 128) && whole_pieces >= 2 * threads;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16> && Kind == tokenloom::kPlain) return worth_it;
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if constexpr (Kind == tokenloom::kInt8) return worth_it;
#endif
  return false;
}

// One piece of a call that reads whole rows: every KV head of its sequence.
template <typename T, int64_t Kind>
void attend_rows_unit(const T* q_seq, const at::Tensor& k_cache, const at::Tensor& v_cache, const int64_t* table,
                      int64_t ctx, int64_t group, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                      float s, const HeadsOut<T>& out, std::vector<float>& scratch) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if constexpr (Kind == tokenloom::kInt8) {
    const uint8_t* k = k_cache.const_data_ptr<uint8_t>();
    const uint8_t* v = v_cache.const_data_ptr<uint8_t>();
    if (head_dim == 64) {
      attend_int8_rows<T, 64>(q_seq, k, v, table, ctx, group, num_kv_heads, block_size, s, out, scratch);
      return;
    }
    if (head_dim == 128) {
      attend_int8_rows<T, 128>(q_seq, k, v, table, ctx, group, num_kv_heads, block_size, s, out, scratch);
      return;
    }
  }
#endif
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16> && Kind == tokenloom::kPlain) {
    const T* k = k_cache.const_data_ptr<T>();
    const T* v = v_cache.const_data_ptr<T>();
    if (head_dim == 64) {
      attend_bf16_rows<64>(q_seq, k, v, table, ctx, group, num_kv_heads, block_size, s, out, scratch);
      return;
    }
    if (head_dim == 128) {
      attend_bf16_rows<128>(q_seq, k, v, table, ctx, group, num_kv_heads, block_size, s, out, scratch);
      return;
    }
  }
#endif
  TORCH_INTERNAL_ASSERT(false, "reads_whole_rows chose a kernel this build lacks");
}

// A split unit's rows, each head's splits weighed by exp(lse - the largest lse): the softmax over the whole context.
template <typename T>
void merge_splits(const float* partials, const float* lse, int64_t first_part, int64_t parts, int64_t heads,
                  int64_t head_dim, T* out, std::vector<float>& merged) {
  merged.resize(head_dim);
  for (int64_t h = 0; h < heads; ++h) {
    float most = kNoMax;
    for (int64_t p = 0; p < parts; ++p) most = std::max(most, lse[(first_part + p) * heads + h]);
    std::fill(merged.begin(), merged.end(), 0.0f);
    float total = 0.0f;
    for (int64_t p = 0; p < parts; ++p) {
      const float w = std::exp(lse[(first_part + p) * heads + h] - most);
      total += w;
      const float* rows = partials + ((first_part + p) * heads + h) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) merged[d] += w * rows[d];
    }
    const float inv = 1.0f / total;
    for (int64_t d = 0; d < head_dim; ++d) out[h * head_dim + d] = static_cast<T>(merged[d] * inv);
  }
}

template <typename T, int64_t Kind>
void decode_all(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size, double scale,
                int64_t num_kv_heads, int64_t split_keys, at::Tensor& out) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t q_stride = q.stride(0), out_stride = out.stride(0);
  const int64_t row = k_cache.size(1), group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const T* q_ptr = q.const_data_ptr<T>();
  const int64_t* tables = block_tables.const_data_ptr<int64_t>();
  const int64_t* lens = context_lens.const_data_ptr<int64_t>();
  T* out_ptr = out.mutable_data_ptr<T>();
  // The pieces in the order threads take them (work_sharing.h): longest contexts first (the runner sorts decodes
  // by context length, ascending), so the last taken are short and the threads finish together. Kept from call to
  // call (no allocation a layer), and read through pointers: a helper naming a thread_local would get its own.
  thread_local std::vector<Piece> piece_list;
  thread_local std::vector<std::pair<int64_t, int64_t>> split_list;  // each split unit's first piece and splits
  piece_list.clear();
  split_list.clear();
  int64_t parts = 0;
  const int64_t threads = at::get_num_threads();
  auto split_of = [&](int64_t ctx) {
    const int64_t keys = split_keys == 0 ? auto_split_keys(ctx, block_size, threads) : split_keys;
    TORCH_INTERNAL_ASSERT(keys % block_size == 0);
    return keys;
  };
  int64_t whole_pieces = 0;  // the pieces if units are whole sequences
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t keys = split_of(lens[seq]);
    whole_pieces += keys == 0 ? 1 : (lens[seq] + keys - 1) / keys;
  }
  const bool whole_rows = reads_whole_rows<T, Kind>(num_kv_heads, head_dim, whole_pieces, threads);
  const int64_t unit_kv_heads = whole_rows ? num_kv_heads : 1, unit_heads = unit_kv_heads * group;
  for (int64_t seq = num_seqs - 1; seq >= 0; --seq) {
    const int64_t ctx = lens[seq];
    const int64_t keys_per_split = split_of(ctx);
    for (int64_t kv_head = 0; kv_head < num_kv_heads; kv_head += unit_kv_heads) {
      if (keys_per_split == 0 || ctx <= keys_per_split) {
        piece_list.push_back({seq, kv_head, 0, ctx, -1});
        continue;
      }
      const int64_t unit_first = static_cast<int64_t>(piece_list.size());
      for (int64_t first = 0; first < ctx; first += keys_per_split) {
        piece_list.push_back({seq, kv_head, first, std::min(keys_per_split, ctx - first), parts++});
      }
      split_list.emplace_back(unit_first, static_cast<int64_t>(piece_list.size()) - unit_first);
    }
  }
  const Piece* const pieces = piece_list.data();
  const std::pair<int64_t, int64_t>* const split_units = split_list.data();
  // [parts][unit_heads][head_dim], [parts][unit_heads]: the caller's, as above.
  thread_local std::vector<float> partial_rows, partial_lse;
  partial_rows.resize(parts * unit_heads * head_dim);
  partial_lse.resize(parts * unit_heads);
  float* const partials = partial_rows.data();
  float* const lse = partial_lse.data();
  const float s = static_cast<float>(scale);
  const std::function<void(int64_t)> body = [&](int64_t index) {
    thread_local std::vector<float> scratch;
    const Piece piece = pieces[index];
    const int64_t head_offset = piece.kv_head * group * head_dim;
    HeadsOut<T> sink{out_ptr + piece.seq * out_stride + head_offset};
    if (piece.part >= 0) {
      sink.split = partials + piece.part * unit_heads * head_dim;
      sink.lse = lse + piece.part * unit_heads;
    }
    // A split reads its keys' blocks only: the table from its first block on (splits start on a block's start).
    const int64_t* table = tables + piece.seq * max_blocks + piece.first / block_size;
    if (whole_rows) {
      attend_rows_unit<T, Kind>(q_ptr + piece.seq * q_stride, k_cache, v_cache, table, piece.keys, group, num_kv_heads,
                          head_dim, block_size, s, sink, scratch);
      return;
    }
    attend_unit<T, Kind>(q_ptr + piece.seq * q_stride + head_offset, k_cache, v_cache,
                         head_layout(Kind, row, num_kv_heads, head_dim, piece.kv_head, block_size), table, piece.keys,
                         group, head_dim, block_size, s, sink, scratch);
  };
  tokenloom::WorkSharing::instance().run(static_cast<int64_t>(piece_list.size()), body);
  const std::function<void(int64_t)> merge = [&](int64_t index) {
    thread_local std::vector<float> merged;
    const auto [first_piece, unit_parts] = split_units[index];
    const Piece& first = pieces[first_piece];
    merge_splits(partials, lse, first.part, unit_parts, unit_heads, head_dim,
                 out_ptr + first.seq * out_stride + first.kv_head * group * head_dim, merged);
  };
  tokenloom::WorkSharing::instance().run(static_cast<int64_t>(split_list.size()), merge);
}

template <typename T>
void decode_any_kind(int64_t kind, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size, double scale,
                     int64_t num_kv_heads, int64_t split_keys, at::Tensor& out) {
  tokenloom::with_kv_kind(kind, [&]<int64_t Kind>() {
    decode_all<T, Kind>(q, k_cache, v_cache, block_tables, context_lens, block_size, scale, num_kv_heads, split_keys,
                        out);
  });
}

// q: [num_seqs, heads, d], rows may be strided (a view into the fused qkv output); out: the same shape, rows may
// be strided (a slice of the step's output). Both have their heads and dims contiguous. kv_kind 0: the caches are
// [num_slots, kv_heads * d] of q's dtype; else they are 8-bit (kv_codes.h), uint8 [num_slots, kv_heads * (d + 4)].
void paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size,
                            double scale, at::Tensor out, int64_t kv_kind, int64_t split_keys) {
  TORCH_CHECK(q.device().is_cpu() && out.device().is_cpu(), "paged_decode_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3, "q must be [num_seqs, num_heads, head_dim]");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(), "out must be shaped as q, its dtype");
  TORCH_CHECK(k_cache.dim() == 2 && v_cache.sizes() == k_cache.sizes(),
              "k_cache and v_cache must be [num_slots, row], the same shape");
  TORCH_CHECK(kv_kind == tokenloom::kPlain || tokenloom::is_kv_kind(kv_kind), "kv_kind must be 0, 1, 2 or 3");
  const at::ScalarType cache_type = kv_kind == tokenloom::kPlain ? q.scalar_type() : at::kByte;
  TORCH_CHECK(k_cache.scalar_type() == cache_type && v_cache.scalar_type() == cache_type,
              kv_kind == tokenloom::kPlain ? "q, k_cache and v_cache must share a dtype"
                                           : "an 8-bit cache (kv_kind > 0) must be uint8");
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
  const int64_t head_bytes = kv_kind == tokenloom::kPlain ? head_dim : head_dim + 4;  // an 8-bit head's codes and scale
  TORCH_CHECK(block_size > 0 && head_dim > 0 && k_cache.size(1) % head_bytes == 0,
              "the cache row must hold whole heads");
  TORCH_CHECK(split_keys >= 0 && split_keys % block_size == 0, "split_keys must be 0 or a multiple of block_size");
  const int64_t num_kv_heads = k_cache.size(1) / head_bytes;
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
    decode_any_kind<float>(kv_kind, q, k_cache, v_cache, block_tables, context_lens, block_size, scale, num_kv_heads,
                           split_keys, out);
  } else {
    decode_any_kind<c10::BFloat16>(kv_kind, q, k_cache, v_cache, block_tables, context_lens, block_size, scale,
                                   num_kv_heads, split_keys, out);
  }
}

}  // namespace

TORCH_LIBRARY(tokenloom, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
      "int block_size, float scale, Tensor(a!) out, int kv_kind=0, int split_keys=0) -> ()");
}

TORCH_LIBRARY_IMPL(tokenloom, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
