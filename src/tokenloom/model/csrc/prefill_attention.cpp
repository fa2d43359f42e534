// Causal prefill attention for bfloat16 on CPUs with AVX-512 BF16: tokenloom::prefill_attention.
//
// A chunk of n queries at the end of a context of ctx tokens (the first ctx - n are its past) attends to every key
// up to its own position. Flash-style: keys stream through in blocks of 32 with an online softmax, so no score
// matrix is ever materialised. The products run on the bf16 dot-product instruction (exact products, float32
// sums) over transposed blocks: K^T pairs make 16 query-key dot products one vector, and V pairs make the
// probability-weighted sum one instruction per 16 output dims and two keys. Probabilities enter that sum rounded
// to bf16, as transformers' bfloat16 attention rounds them. Built only where the compiler targets AVX-512 BF16;
// elsewhere the op is not registered and the model uses torch's scaled_dot_product_attention.
//
// Two passes. First each KV head's K and V are packed once into those transposed blocks (the packing is per key,
// not per query, so doing it once instead of once per query block took it off the profile). Then a tile of query
// rows streams every key block it can see with its accumulators, maxima and sums held in registers: no per-block
// loads and stores of the running state, and the softmax's bookkeeping is paid once per 32 keys.

#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "avx512_exp.h"
#include "bf16_vec.h"
#include "work_sharing.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

using tokenloom::broadcast_pair;
using tokenloom::kNoMax;

constexpr int kKeys = 32;         // keys per block: two float32 vectors of scores
constexpr int kQueryTokens = 32;  // query tokens per work item (times the heads sharing a KV head)

inline uint32_t pair_at(const c10::BFloat16* row, int64_t d) {
  uint32_t out;
  std::memcpy(&out, row + d, sizeof(out));
  return out;
}

// One KV head's keys and values in the layout the dot products want, block by block of kKeys:
// K^T as [HD / 2 dim pairs][kKeys] and V as [kKeys / 2 key pairs][HD], each element a pair of bf16.
// Keys past the end of the context repeat the last one; the masks keep them out.
// k_row(t), v_row(t): where key t's K and V (this head's HD values) are: rows of a tensor, or slots of the cache.
template <int HD, typename KRow, typename VRow>
void pack_block(const KRow& k_row, const VRow& v_row, int64_t k0, int64_t ctx, uint32_t* kt, uint32_t* vt) {
  constexpr int kPairs = HD / 2;
  const int64_t nk = std::min<int64_t>(kKeys, ctx - k0);
  for (int64_t j = 0; j < kKeys; ++j) {
    const c10::BFloat16* krow = k_row(k0 + std::min(j, nk - 1));
    for (int p = 0; p < kPairs; ++p) kt[p * kKeys + j] = pair_at(krow, 2 * p);
  }
  for (int64_t j = 0; j < kKeys / 2; ++j) {
    const int64_t a = k0 + std::min(2 * j, nk - 1), b = k0 + std::min(2 * j + 1, nk - 1);
    const uint16_t* va = reinterpret_cast<const uint16_t*>(v_row(a));
    const uint16_t* vb = reinterpret_cast<const uint16_t*>(v_row(b));
    for (int d = 0; d < HD; ++d) vt[j * HD + d] = va[d] | (static_cast<uint32_t>(vb[d]) << 16);
  }
}

// A tile's running state: R rows' accumulators, the sums of their probabilities (per lane) and their maxima.
template <int HD, int R>
struct TileState {
  __m512 acc[R][HD / 16];
  __m512 lane_sums[R];
  float row_max[R];
};

// One block of keys (k0 on) for the tile's R rows. Half: only its first 16 keys can be seen by any row (the causal
// edge), so the other 16 are skipped rather than computed and masked.
template <int HD, int R, bool Half>
__attribute__((always_inline)) inline void attend_block(TileState<HD, R>& st, const c10::BFloat16* const* qrows,
                                                        const int64_t* keys, int64_t k0, const uint32_t* kt,
                                                        const uint32_t* vt, float scale) {
  constexpr int kPairs = HD / 2;
  constexpr int kLanes = HD / 16;
  __m512 lo[R], hi[R];
  for (int i = 0; i < R; ++i) lo[i] = hi[i] = _mm512_setzero_ps();
  for (int p = 0; p < kPairs; ++p) {
    const __m512bh k_lo = (__m512bh)_mm512_loadu_si512(kt + p * kKeys);
    const __m512bh k_hi = Half ? k_lo : (__m512bh)_mm512_loadu_si512(kt + p * kKeys + 16);
    for (int i = 0; i < R; ++i) {
      const __m512bh qp = broadcast_pair(qrows[i] + 2 * p);
      lo[i] = _mm512_dpbf16_ps(lo[i], qp, k_lo);
      if constexpr (!Half) hi[i] = _mm512_dpbf16_ps(hi[i], qp, k_hi);
    }
  }
  alignas(64) uint32_t prob_pairs[R][kKeys / 2];
  for (int i = 0; i < R; ++i) {
    const int64_t visible = std::clamp<int64_t>(keys[i] - k0, 0, kKeys);
    const uint32_t keep = visible >= kKeys ? 0xFFFFFFFFu : (1u << visible) - 1;
    const __mmask16 keep_lo = static_cast<__mmask16>(keep), keep_hi = Half ? 0 : static_cast<__mmask16>(keep >> 16);
    const __m512 none = _mm512_set1_ps(kNoMax), sc = _mm512_set1_ps(scale);
    const __m512 s_lo = _mm512_mask_mul_ps(none, keep_lo, lo[i], sc);
    const __m512 s_hi = Half ? none : _mm512_mask_mul_ps(none, keep_hi, hi[i], sc);
    const float block_max = _mm512_reduce_max_ps(_mm512_max_ps(s_lo, s_hi));
    if (block_max > st.row_max[i]) {
      if (st.row_max[i] != kNoMax) {  // rescale what was summed under the old maximum (nothing yet on the first block)
        const __m512 correction = _mm512_set1_ps(std::exp(st.row_max[i] - block_max));
        for (int l = 0; l < kLanes; ++l) st.acc[i][l] = _mm512_mul_ps(st.acc[i][l], correction);
        st.lane_sums[i] = _mm512_mul_ps(st.lane_sums[i], correction);
      }
      st.row_max[i] = block_max;
    }
    const __m512 m = _mm512_set1_ps(st.row_max[i]);
    const __m512 p_lo = _mm512_maskz_mov_ps(keep_lo, tokenloom::exp_nonpositive(_mm512_sub_ps(s_lo, m)));
    // Probabilities as bf16 pairs (key 2j, key 2j + 1), each broadcast against V's pairs for 16 dims.
    _mm256_store_si256(reinterpret_cast<__m256i*>(prob_pairs[i]), (__m256i)_mm512_cvtneps_pbh(p_lo));
    if constexpr (Half) {
      st.lane_sums[i] = _mm512_add_ps(st.lane_sums[i], p_lo);
    } else {
      const __m512 p_hi = _mm512_maskz_mov_ps(keep_hi, tokenloom::exp_nonpositive(_mm512_sub_ps(s_hi, m)));
      st.lane_sums[i] = _mm512_add_ps(st.lane_sums[i], _mm512_add_ps(p_lo, p_hi));
      _mm256_store_si256(reinterpret_cast<__m256i*>(prob_pairs[i] + 8), (__m256i)_mm512_cvtneps_pbh(p_hi));
    }
  }
  for (int j = 0; j < (Half ? kKeys / 4 : kKeys / 2); ++j) {
    for (int l = 0; l < kLanes; ++l) {
      const __m512bh vv = (__m512bh)_mm512_loadu_si512(vt + j * HD + l * 16);
      for (int i = 0; i < R; ++i) st.acc[i][l] = _mm512_dpbf16_ps(st.acc[i][l], broadcast_pair(&prob_pairs[i][j]), vv);
    }
  }
}

// R query rows (token and head pairs) against every key block they see. R independent chains of dot products keep
// the vector unit busy, and each block of K^T and V is loaded once for R rows. keys[i]: how many keys row i sees.
template <int HD, int R, typename Blocks>
inline void attend_tile(const c10::BFloat16* const* qrows, const int64_t* keys, const Blocks& blocks, float scale,
                        c10::BFloat16* const* orows) {
  constexpr int kLanes = HD / 16;
  int64_t most = 0;
  for (int i = 0; i < R; ++i) most = std::max(most, keys[i]);
  TileState<HD, R> st;
  for (int i = 0; i < R; ++i) {
    for (int l = 0; l < kLanes; ++l) st.acc[i][l] = _mm512_setzero_ps();
    st.lane_sums[i] = _mm512_setzero_ps();
    st.row_max[i] = kNoMax;
  }
  int64_t k0 = 0, b = 0;
  for (; k0 + kKeys / 2 < most; k0 += kKeys, ++b) {
    attend_block<HD, R, false>(st, qrows, keys, k0, blocks.key(b), blocks.value(b), scale);
  }
  if (k0 < most) attend_block<HD, R, true>(st, qrows, keys, k0, blocks.key(b), blocks.value(b), scale);
  for (int i = 0; i < R; ++i) {
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(st.lane_sums[i]));
    for (int l = 0; l < kLanes; ++l) {
      const __m256bh x = _mm512_cvtneps_pbh(_mm512_mul_ps(st.acc[i][l], inv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(orows[i] + l * 16), (__m256i)x);
    }
  }
}

// One KV head, query tokens [q0, q1) of the chunk, every query head of the group, over the head's packed keys.
// Where a head's packed key blocks are: one after another (a contiguous context), or, for chunks of a step that
// share keys, each block one of the step's packed units.
template <int HD>
struct ContiguousBlocks {
  const uint32_t* k;
  const uint32_t* v;
  const uint32_t* key(int64_t b) const { return k + b * (HD / 2) * kKeys; }
  const uint32_t* value(int64_t b) const { return v + b * (kKeys / 2) * HD; }
};

template <int HD>
struct SharedBlocks {
  const uint32_t* head;  // the step's packed units, offset to this KV head's place in each
  const int64_t* units;  // the unit of each of the chunk's key blocks
  int64_t per_unit;      // every head's K and V blocks
  const uint32_t* key(int64_t b) const { return head + units[b] * per_unit; }
  const uint32_t* value(int64_t b) const { return key(b) + (HD / 2) * kKeys; }
};

template <int HD, typename Blocks>
void attend_queries(const c10::BFloat16* q, int64_t q_stride, const Blocks& blocks, int64_t past, int64_t q0,
                    int64_t q1, int64_t group, float scale, c10::BFloat16* out, int64_t out_stride) {
  constexpr int kTile = HD == 64 ? 4 : 2;  // rows at once: kTile * HD / 16 accumulators stay in registers
  const int64_t rows = (q1 - q0) * group;
  const c10::BFloat16* qrows[kTile];
  c10::BFloat16* orows[kTile];
  int64_t keys[kTile];
  auto load_row = [&](int64_t row, int i) {
    const int64_t t = q0 + row / group, h = row % group;
    keys[i] = past + t + 1;  // causal: the keys up to the token's own position
    qrows[i] = q + t * q_stride + h * HD;
    orows[i] = out + t * out_stride + h * HD;
  };
  int64_t r = 0;
  for (; r + kTile <= rows; r += kTile) {
    for (int i = 0; i < kTile; ++i) load_row(r + i, i);
    attend_tile<HD, kTile>(qrows, keys, blocks, scale, orows);
  }
  for (; r < rows; ++r) {
    load_row(r, 0);
    attend_tile<HD, 1>(qrows, keys, blocks, scale, orows);
  }
}

template <int HD>
void prefill_all(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, float scale, at::Tensor& out) {
  const int64_t n = q.size(0), heads = q.size(1), ctx = k.size(0);
  const int64_t kv_heads = k.size(1) / HD, group = heads / kv_heads, past = ctx - n;
  const auto* q_ptr = q.const_data_ptr<c10::BFloat16>();
  const auto* k_ptr = k.const_data_ptr<c10::BFloat16>();
  const auto* v_ptr = v.const_data_ptr<c10::BFloat16>();
  auto* out_ptr = out.mutable_data_ptr<c10::BFloat16>();
  const int64_t key_blocks = (ctx + kKeys - 1) / kKeys;
  const int64_t block_k = (HD / 2) * kKeys, block_v = (kKeys / 2) * HD;
  const int64_t per_head = key_blocks * (block_k + block_v);
  // Every element is written by the packing pass before any is read: no zero fill (it runs once per layer and
  // segment).
  const std::unique_ptr<uint32_t[]> packed(new uint32_t[kv_heads * per_head]);
  // Both passes share their units through work_sharing.h (no wait for a sleeping OpenMP worker).
  tokenloom::WorkSharing& threads = tokenloom::WorkSharing::instance();
  threads.run(kv_heads * key_blocks, [&](int64_t item) {
    const int64_t g = item / key_blocks, b = item % key_blocks;
    uint32_t* head = packed.get() + g * per_head;
    const int64_t k_stride = k.stride(0), v_stride = v.stride(0);
    pack_block<HD>([&](int64_t t) { return k_ptr + t * k_stride + g * HD; },
                   [&](int64_t t) { return v_ptr + t * v_stride + g * HD; }, b * kKeys, ctx, head + b * block_k,
                   head + key_blocks * block_k + b * block_v);
  });
  const int64_t query_blocks = (n + kQueryTokens - 1) / kQueryTokens;
  // Later query blocks see more keys: they are taken first, so the last units taken are short.
  threads.run(query_blocks * kv_heads, [&](int64_t item) {
    const int64_t block = query_blocks - 1 - item / kv_heads, g = item % kv_heads;
    const int64_t q0 = block * kQueryTokens, q1 = std::min(n, q0 + kQueryTokens);
    const uint32_t* head = packed.get() + g * per_head;
    const ContiguousBlocks<HD> blocks{head, head + key_blocks * block_k};
    attend_queries<HD>(q_ptr + g * group * HD, q.stride(0), blocks, past, q0, q1, group, scale,
                       out_ptr + g * group * HD, out.stride(0));
  });
}

// q: [n, heads, d] (rows may be strided, heads contiguous); k, v: [ctx, kv_heads * d] (rows may be strided);
// out: shaped as q (rows may be strided, heads contiguous), a slice of the step's output.
void prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, at::Tensor out) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16,
              "prefill_attention: bfloat16 CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 2 && v.dim() == 2 && k.sizes() == v.sizes(),
              "prefill_attention: q [n, heads, d], k and v [ctx, kv_heads * d]");
  const int64_t n = q.size(0), heads = q.size(1), d = q.size(2), ctx = k.size(0);
  TORCH_CHECK(d == 64 || d == 128, "prefill_attention: head size 64 or 128");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == d && k.stride(1) == 1 && v.stride(1) == 1,
              "prefill_attention: heads and dims must be contiguous");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == at::kBFloat16 && out.device().is_cpu() &&
                  out.stride(2) == 1 && out.stride(1) == d,
              "prefill_attention: out must be shaped as q, bfloat16, heads and dims contiguous");
  TORCH_CHECK(k.size(1) % d == 0 && heads % (k.size(1) / d) == 0, "prefill_attention: heads must group over KV heads");
  TORCH_CHECK(n >= 1 && ctx >= n, "prefill_attention: the chunk must lie within its context");
  if (d == 64) {
    prefill_all<64>(q, k, v, static_cast<float>(scale), out);
  } else {
    prefill_all<128>(q, k, v, static_cast<float>(scale), out);
  }
}

// Segment s of a step: its queries are rows [start, start + n) of q, the last n tokens of a context of ctx tokens
// whose keys and values are in the paged cache, token t in slot table[t / block_size] * block_size + t % block_size.
// Its key blocks read the step's packed units units[0..], which may be packed from another chunk's keys.
struct Segment {
  int64_t start, n, ctx;
  const int64_t* table;
  const int64_t* units;
};

// Each unit of work is one of a segment's pieces; the segments' pieces are numbered one segment after another
// (firsts[s]: segment s's first), so a unit finds its segment by bisection.
inline int64_t segment_of(const std::vector<int64_t>& firsts, int64_t unit) {
  return std::upper_bound(firsts.begin(), firsts.end(), unit) - firsts.begin() - 1;
}

template <int HD>
void paged_prefill_all(const at::Tensor& q, const at::Tensor& cache_k, const at::Tensor& cache_v,
                       const at::Tensor& segments, const at::Tensor& tables, const at::Tensor& key_units,
                       const at::Tensor& unit_sources, int64_t block_size, float scale, at::Tensor& out) {
  const int64_t num_segments = segments.size(0), heads = q.size(1), kv_heads = cache_k.size(1) / HD;
  const int64_t group = heads / kv_heads, num_units = unit_sources.size(0);
  const int64_t block_k = (HD / 2) * kKeys, block_v = (kKeys / 2) * HD, per_head = block_k + block_v;
  const int64_t per_unit = kv_heads * per_head;
  const int64_t* info = segments.const_data_ptr<int64_t>();
  const int64_t* units = key_units.const_data_ptr<int64_t>();
  std::vector<Segment> segs(num_segments);
  std::vector<int64_t> attend_firsts(num_segments + 1, 0);
  for (int64_t s = 0; s < num_segments; ++s) {
    Segment& seg = segs[s];
    seg.start = info[3 * s], seg.n = info[3 * s + 1], seg.ctx = info[3 * s + 2];
    const int64_t key_blocks = (seg.ctx + kKeys - 1) / kKeys;
    TORCH_CHECK(seg.n >= 1 && seg.ctx >= seg.n && seg.start >= 0 && seg.start + seg.n <= q.size(0) &&
                    (seg.ctx + block_size - 1) / block_size <= tables.size(1) && key_blocks <= key_units.size(1),
                "paged_prefill_attention: a segment outside the step's rows or its block table");
    seg.table = tables.const_data_ptr<int64_t>() + s * tables.size(1);
    seg.units = units + s * key_units.size(1);
    for (int64_t b = 0; b < key_blocks; ++b) {
      TORCH_CHECK(seg.units[b] >= 0 && seg.units[b] < num_units, "paged_prefill_attention: a key block's unit");
    }
    attend_firsts[s + 1] = attend_firsts[s] + (seg.n + kQueryTokens - 1) / kQueryTokens * kv_heads;
  }
  const int64_t* sources = unit_sources.const_data_ptr<int64_t>();
  for (int64_t u = 0; u < num_units; ++u) {
    TORCH_CHECK(sources[2 * u] >= 0 && sources[2 * u] < num_segments && sources[2 * u + 1] >= 0 &&
                    sources[2 * u + 1] * kKeys < segs[sources[2 * u]].ctx,
                "paged_prefill_attention: a unit's source outside its chunk");
  }
  // Grown, never shrunk: a fresh buffer each layer would be mapped and page-faulted in anew.
  thread_local std::vector<uint32_t> buffer;
  if (static_cast<int64_t>(buffer.size()) < num_units * per_unit) buffer.resize(num_units * per_unit);
  uint32_t* packed = buffer.data();  // the caller's buffer: a helper thread naming `buffer` would find its own
  const auto* q_ptr = q.const_data_ptr<c10::BFloat16>();
  const auto* k_ptr = cache_k.const_data_ptr<c10::BFloat16>();
  const auto* v_ptr = cache_v.const_data_ptr<c10::BFloat16>();
  auto* out_ptr = out.mutable_data_ptr<c10::BFloat16>();
  const int64_t k_stride = cache_k.stride(0), v_stride = cache_v.stride(0);
  tokenloom::WorkSharing& threads = tokenloom::WorkSharing::instance();
  threads.run(num_units * kv_heads, [&](int64_t item) {
    const int64_t u = item / kv_heads, g = item % kv_heads;
    const Segment& seg = segs[sources[2 * u]];
    auto slot = [&](int64_t t) { return seg.table[t / block_size] * block_size + t % block_size; };
    uint32_t* head = packed + u * per_unit + g * per_head;
    pack_block<HD>([&](int64_t t) { return k_ptr + slot(t) * k_stride + g * HD; },
                   [&](int64_t t) { return v_ptr + slot(t) * v_stride + g * HD; }, sources[2 * u + 1] * kKeys,
                   seg.ctx, head, head + block_k);
  });
  threads.run(attend_firsts[num_segments], [&](int64_t item) {
    const int64_t s = segment_of(attend_firsts, item), piece = item - attend_firsts[s];
    const Segment& seg = segs[s];
    const int64_t query_blocks = (seg.n + kQueryTokens - 1) / kQueryTokens;
    const int64_t block = query_blocks - 1 - piece / kv_heads, g = piece % kv_heads;  // later blocks first
    const int64_t q0 = block * kQueryTokens, q1 = std::min(seg.n, q0 + kQueryTokens);
    const SharedBlocks<HD> blocks{packed + g * per_head, seg.units, per_unit};
    attend_queries<HD>(q_ptr + seg.start * q.stride(0) + g * group * HD, q.stride(0), blocks, seg.ctx - seg.n, q0,
                       q1, group, scale, out_ptr + seg.start * out.stride(0) + g * group * HD, out.stride(0));
  });
}

// Every prefill chunk of a step that has a past, in one call, reading K and V where they lie in the paged cache:
// q, out: [T, heads, d], the step's rows; cache_k, cache_v: [slots, kv_heads * d]; segments: [S, 3] int64 (first
// row, rows, context length); tables: [S, max_blocks] int64, each segment's blocks; key_units: [S, max key blocks]
// int64, the packed unit each of a segment's blocks of 32 keys reads; unit_sources: [U, 2] int64, the segment and
// key block each unit is packed from (attention.py's shared_key_blocks: chunks over the same cache slots, such as
// the beams of one search, share their units).
void paged_prefill_attention(const at::Tensor& q, const at::Tensor& cache_k, const at::Tensor& cache_v,
                             const at::Tensor& segments, const at::Tensor& tables, const at::Tensor& key_units,
                             const at::Tensor& unit_sources, int64_t block_size, double scale, at::Tensor out) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kBFloat16 && cache_k.scalar_type() == at::kBFloat16 &&
                  cache_v.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              "paged_prefill_attention: bfloat16 CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && cache_k.dim() == 2 && cache_k.sizes() == cache_v.sizes() && out.sizes() == q.sizes(),
              "paged_prefill_attention: q and out [T, heads, d], the caches [slots, kv_heads * d]");
  const int64_t d = q.size(2);
  TORCH_CHECK(d == 64 || d == 128, "paged_prefill_attention: head size 64 or 128");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == d && out.stride(2) == 1 && out.stride(1) == d &&
                  cache_k.stride(1) == 1 && cache_v.stride(1) == 1,
              "paged_prefill_attention: heads and dims must be contiguous");
  TORCH_CHECK(cache_k.size(1) % d == 0 && q.size(1) % (cache_k.size(1) / d) == 0,
              "paged_prefill_attention: heads must group over KV heads");
  for (const at::Tensor* t : {&segments, &tables, &key_units, &unit_sources}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 2 && t->is_contiguous(),
                "paged_prefill_attention: segments, tables, key_units and unit_sources are 2-d int64, contiguous");
  }
  TORCH_CHECK(segments.size(1) == 3 && tables.size(0) == segments.size(0) && key_units.size(0) == segments.size(0) &&
                  unit_sources.size(1) == 2 && block_size >= 1,
              "paged_prefill_attention: segments [S, 3], tables [S, blocks], key_units [S, key blocks], "
              "unit_sources [U, 2]");
  if (d == 64) {
    paged_prefill_all<64>(q, cache_k, cache_v, segments, tables, key_units, unit_sources, block_size,
                          static_cast<float>(scale), out);
  } else {
    paged_prefill_all<128>(q, cache_k, cache_v, segments, tables, key_units, unit_sources, block_size,
                           static_cast<float>(scale), out);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloom, m) {
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, float scale, Tensor(a!) out) -> ()");
  m.def(
      "paged_prefill_attention(Tensor q, Tensor cache_k, Tensor cache_v, Tensor segments, Tensor tables, "
      "Tensor key_units, Tensor unit_sources, int block_size, float scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(tokenloom, CPU, m) {
  m.impl("prefill_attention", &prefill_attention);
  m.impl("paged_prefill_attention", &paged_prefill_attention);
}

#endif  // __AVX512BF16__
