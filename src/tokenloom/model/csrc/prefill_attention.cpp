// Causal prefill attention on CPUs with AVX-512: tokenloom::prefill_attention and paged_prefill_attention, in
// float32 (AVX-512F) and in bfloat16 (where the compiler also targets AVX-512 BF16; on AMX tiles where it targets AMX
// and Linux grants the tiles: AmxBf16Keys).
//
// A chunk of n queries at the end of a context of ctx tokens (the first ctx - n are its past) attends to every key
// up to its own position. Flash-style: keys stream through in blocks of 32 with an online softmax, so no score
// matrix is ever materialised. The products run over transposed blocks: K^T makes 16 query-key dot products one
// vector, and V rows make the probability-weighted sum one instruction per 16 output dims. In bf16 each instruction
// is the bf16 dot product over pairs (exact products, float32 sums; probabilities enter the sum rounded to bf16, as
// transformers' bfloat16 attention rounds them); in float32 a fused multiply-add. Where neither is built the op is
// not registered, and the model uses torch's scaled_dot_product_attention.
//
// Why float32 too: a CPU without AVX-512 BF16 serves in float32, and torch's fused CPU kernel multiplies every block
// under a mask and runs short prompts at a fraction of the float32 rate (1.1-5.5x our time, prefill_attention_f32.py).
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
#include <initializer_list>
#include <limits>
#include <type_traits>
#include <vector>

#include "amx_tiles.h"
#include "avx512_exp.h"
#include "bf16_vec.h"
#include "work_sharing.h"

#if defined(__AVX512F__)
#include <immintrin.h>

namespace {

using tokenloom::kNoMax;

constexpr int kKeys = 32;         // keys per block: two float32 vectors of scores
constexpr int kQueryTokens = 32;  // query tokens per work item (times the heads sharing a KV head)

// A tile's running state (in float32 kept between spans): R rows' accumulators, the sums of their probabilities (per
// lane) and their maxima, made empty.
template <int HD, int R>
struct TileState {
  __m512 acc[R][HD / 16];
  __m512 lane_sums[R];
  float row_max[R];

  TileState() {
    for (int i = 0; i < R; ++i) {
      for (int l = 0; l < HD / 16; ++l) acc[i][l] = _mm512_setzero_ps();
      lane_sums[i] = _mm512_setzero_ps();
      row_max[i] = kNoMax;
    }
  }

  // Row i's running maximum raised to m where m is higher, what it summed under the old one rescaled (nothing was
  // summed before its first keys).
  void raise_max(int i, float m) {
    if (m <= row_max[i]) return;
    if (row_max[i] != kNoMax) {
      const __m512 correction = _mm512_set1_ps(std::exp(row_max[i] - m));
      for (int l = 0; l < HD / 16; ++l) acc[i][l] = _mm512_mul_ps(acc[i][l], correction);
      lane_sums[i] = _mm512_mul_ps(lane_sums[i], correction);
    }
    row_max[i] = m;
  }

  // The first `rows` rows' sums over their probabilities' totals, into orows (float32 or bf16 rows of HD).
  template <typename Elem>
  void write(int64_t rows, Elem* const* orows) const {
    for (int64_t i = 0; i < rows; ++i) {
      const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(lane_sums[i]));
      for (int l = 0; l < HD / 16; ++l) tokenloom::store16(orows[i] + l * 16, _mm512_mul_ps(acc[i][l], inv));
    }
  }
};

// float32: K^T as [HD dims][kKeys] and V as [kKeys][HD], block by block of kKeys. Keys past the end of the context
// repeat the last one; the masks keep them out.
// k_row(t), v_row(t): where key t's K and V (this head's HD values) are: rows of a tensor, or slots of the cache.
//
// A tile of rows takes its keys a span of kSpanBlocks blocks at a time: first every score of the span (a
// multiply-add stream with no dependence between blocks), then the span's softmax in one vectorised pass, then the
// probability-weighted sum of its V rows. Bookkeeping once per 32 keys in 4-row tiles, as the bf16 kernel does it,
// left the float32 kernel waiting on each block's maximum and exponentials: a 2,048-token prompt at 135 GFLOP/s on
// a 2-core AVX-512 Xeon, against 214 with spans, 6-row tiles and every tile taking a span before the next one does
// (benchmarks/prefill_attention_f32.py; torch's fused kernel 167).
struct Float32Keys {
  using Elem = float;
  using Packed = float;
  template <int HD>
  static constexpr int64_t kBlockK = HD * kKeys;
  template <int HD>
  static constexpr int64_t kBlockV = kKeys * HD;
  template <int HD>
  static constexpr int kTile = HD == 64 ? 6 : 3;  // rows at once: their kTile * HD / 16 sums stay in registers
  static constexpr int kSpanBlocks = 8;
  static constexpr int kSpan = kSpanBlocks * kKeys;

  // K transposed 16 keys x 16 dims at a time in registers, V copied. One element a store, the packing made chunks of
  // 4-64 queries after a long past (every past block packed for few queries) 1.06-1.22x slower a layer, 2 x 200 after
  // 2,000 1.03x (benchmarks/short_chunks_after_past.py); prompts of 2,048 after 2,048 the same.
  template <int HD, typename KRow, typename VRow>
  static void pack(const KRow& k_row, const VRow& v_row, int64_t k0, int64_t ctx, float* kt, float* vt) {
    static_assert(kKeys % 16 == 0 && HD % 16 == 0, "whole 16 x 16 squares");
    const int64_t nk = std::min<int64_t>(kKeys, ctx - k0);
    const float* rows[kKeys];
    for (int64_t j = 0; j < kKeys; ++j) {
      rows[j] = k_row(k0 + std::min(j, nk - 1));
      std::memcpy(vt + j * HD, v_row(k0 + std::min(j, nk - 1)), HD * sizeof(float));
    }
    for (int j0 = 0; j0 < kKeys; j0 += 16) {
      for (int d0 = 0; d0 < HD; d0 += 16) {
        __m512 square[16];
        for (int i = 0; i < 16; ++i) square[i] = _mm512_loadu_ps(rows[j0 + i] + d0);
        transpose16(square);
        for (int d = 0; d < 16; ++d) _mm512_storeu_ps(kt + (d0 + d) * kKeys + j0, square[d]);
      }
    }
  }

  // r[i] lane j -> r[j] lane i, for a 16 x 16 square of floats: pairs, then quads within 128-bit lanes, then lanes.
  static inline void transpose16(__m512* r) {
    __m512 t[16];
    for (int i = 0; i < 8; ++i) {
      t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    __m512 u[16];  // u[4q + c], 128-bit lane L: rows 4q .. 4q + 3 of column 4L + c
    for (int q = 0; q < 4; ++q) {
      const __m512d a = _mm512_castps_pd(t[4 * q]), b = _mm512_castps_pd(t[4 * q + 1]);
      const __m512d c = _mm512_castps_pd(t[4 * q + 2]), d = _mm512_castps_pd(t[4 * q + 3]);
      u[4 * q] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
      u[4 * q + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
      u[4 * q + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
      u[4 * q + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int c = 0; c < 4; ++c) {  // column 4L + c gathers lane L of u[c], u[4 + c], u[8 + c], u[12 + c]
      const __m512 low01 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x44);
      const __m512 high01 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x44);
      const __m512 low23 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xEE);
      const __m512 high23 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xEE);
      r[c] = _mm512_shuffle_f32x4(low01, high01, 0x88);
      r[4 + c] = _mm512_shuffle_f32x4(low01, high01, 0xDD);
      r[8 + c] = _mm512_shuffle_f32x4(low23, high23, 0x88);
      r[12 + c] = _mm512_shuffle_f32x4(low23, high23, 0xDD);
    }
  }

  // The R rows' dot products with B consecutive key blocks (B x 32 keys), into s[i][at..at + B x 32).
  template <int HD, int R, int B>
  __attribute__((always_inline)) static inline void scores(const float* const* qrows, const float* const* kt,
                                                           float (*s)[kSpan], int at) {
    __m512 acc[R][2 * B];
    for (int i = 0; i < R; ++i) {
      for (int c = 0; c < 2 * B; ++c) acc[i][c] = _mm512_setzero_ps();
    }
    for (int d = 0; d < HD; ++d) {
      __m512 k[2 * B];
      for (int c = 0; c < 2 * B; ++c) k[c] = _mm512_loadu_ps(kt[c / 2] + d * kKeys + (c % 2) * 16);
      for (int i = 0; i < R; ++i) {
        const __m512 qd = _mm512_set1_ps(qrows[i][d]);
        for (int c = 0; c < 2 * B; ++c) acc[i][c] = _mm512_fmadd_ps(qd, k[c], acc[i][c]);
      }
    }
    for (int i = 0; i < R; ++i) {
      for (int c = 0; c < 2 * B; ++c) _mm512_store_ps(s[i] + at + 16 * c, acc[i][c]);
    }
  }

  // Row i's scores s[0, n) of a span into probabilities under its running maximum (raised, and what it summed so
  // far rescaled, if the span's is higher); keys from `visible` on are masked to 0.
  template <int HD>
  __attribute__((always_inline)) static inline void softmax_span(float* s, int n, int64_t visible, float scale,
                                                                 float& row_max, __m512& lane_sums, __m512* acc) {
    const __m512 sc = _mm512_set1_ps(scale), none = _mm512_set1_ps(kNoMax);
    __m512 most = none;
    for (int g = 0; g < n; g += 16) {
      const int64_t seen = std::clamp<int64_t>(visible - g, 0, 16);
      const __mmask16 keep = static_cast<__mmask16>((1u << seen) - 1);
      const __m512 x = _mm512_mask_mul_ps(none, keep, _mm512_load_ps(s + g), sc);
      most = _mm512_max_ps(most, x);
      _mm512_store_ps(s + g, x);
    }
    const float span_max = _mm512_reduce_max_ps(most);
    if (span_max > row_max) {
      if (row_max != kNoMax) {  // rescale what was summed under the old maximum (nothing yet on the first span)
        const __m512 correction = _mm512_set1_ps(std::exp(row_max - span_max));
        for (int l = 0; l < HD / 16; ++l) acc[l] = _mm512_mul_ps(acc[l], correction);
        lane_sums = _mm512_mul_ps(lane_sums, correction);
      }
      row_max = span_max;
    }
    const __m512 m = _mm512_set1_ps(row_max);
    for (int g = 0; g < n; g += 16) {
      const int64_t seen = std::clamp<int64_t>(visible - g, 0, 16);
      const __mmask16 keep = static_cast<__mmask16>((1u << seen) - 1);
      const __m512 p = _mm512_maskz_mov_ps(keep, tokenloom::exp_clamped(_mm512_sub_ps(_mm512_load_ps(s + g), m)));
      lane_sums = _mm512_add_ps(lane_sums, p);
      _mm512_store_ps(s + g, p);
    }
  }

  // The tile's R rows over the span of keys from k0 (span: how many of them any row sees).
  template <int HD, int R, typename Blocks>
  static void attend_span(const float* const* qrows, const int64_t* keys, const Blocks& blocks, float scale,
                          int64_t k0, int span, TileState<HD, R>& state) {
    constexpr int kLanes = HD / 16;
    // In locals, so they stay in registers: the scores' float stores could alias the state's vectors.
    __m512 acc[R][kLanes], lane_sums[R];
    float row_max[R];
    std::memcpy(acc, state.acc, sizeof(acc));
    std::memcpy(lane_sums, state.lane_sums, sizeof(lane_sums));
    std::memcpy(row_max, state.row_max, sizeof(row_max));
    alignas(64) float s[R][kSpan];
    const int64_t first = k0 / kKeys;
    const int nb = (span + kKeys - 1) / kKeys;
    int b = 0;
    for (; b + 2 <= nb; b += 2) {
      const float* kt[2] = {blocks.key(first + b), blocks.key(first + b + 1)};
      scores<HD, R, 2>(qrows, kt, s, b * kKeys);
    }
    if (b < nb) {
      const float* kt[1] = {blocks.key(first + b)};
      scores<HD, R, 1>(qrows, kt, s, b * kKeys);
    }
    for (int i = 0; i < R; ++i) {
      softmax_span<HD>(s[i], nb * kKeys, keys[i] - k0, scale, row_max[i], lane_sums[i], acc[i]);
    }
    for (int j = 0; j < span; ++j) {
      const float* vrow = blocks.value(first + j / kKeys) + (j % kKeys) * HD;
      for (int l = 0; l < kLanes; ++l) {
        const __m512 vv = _mm512_loadu_ps(vrow + l * 16);
        for (int i = 0; i < R; ++i) acc[i][l] = _mm512_fmadd_ps(_mm512_set1_ps(s[i][j]), vv, acc[i][l]);
      }
    }
    std::memcpy(state.acc, acc, sizeof(acc));
    std::memcpy(state.lane_sums, lane_sums, sizeof(lane_sums));
    std::memcpy(state.row_max, row_max, sizeof(row_max));
  }

  // Query rows (token and head pairs; keys[r]: how many keys row r sees) into orows. Tiles of kTile rows share each
  // load of K^T and V; every tile takes a span before any takes the next, so a span's keys (128 KB) are read from
  // L2 by every tile rather than each tile streaming a long context from L3 (which took 2,048 queries after 2,048
  // keys 1.1-1.3x torch's time). A last partial tile repeats its last row: computed twice, written once.
  template <int HD, typename Blocks>
  static void attend_rows(const float* const* qrows, const int64_t* keys, float* const* orows, int64_t rows,
                          const Blocks& blocks, float scale) {
    constexpr int R = kTile<HD>;
    constexpr int kLanes = HD / 16;
    const int64_t tiles = (rows + R - 1) / R;
    std::vector<const float*> tq(tiles * R);
    std::vector<int64_t> tk(tiles * R), tile_keys(tiles, 0);  // tile_keys: how many keys the tile's rows see at most
    for (int64_t r = 0; r < tiles * R; ++r) {
      tq[r] = qrows[std::min(r, rows - 1)];
      tk[r] = keys[std::min(r, rows - 1)];
      tile_keys[r / R] = std::max(tile_keys[r / R], tk[r]);
    }
    const int64_t most = *std::max_element(tile_keys.begin(), tile_keys.end());
    std::vector<TileState<HD, R>> states(tiles);
    for (int64_t k0 = 0; k0 < most; k0 += kSpan) {
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t seen = tile_keys[t] - k0;
        if (seen <= 0) continue;
        const int span = static_cast<int>(std::min<int64_t>(kSpan, seen));
        attend_span<HD, R>(tq.data() + t * R, tk.data() + t * R, blocks, scale, k0, span, states[t]);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const TileState<HD, R>& st = states[r / R];
      const int i = static_cast<int>(r % R);
      const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(st.lane_sums[i]));
      for (int l = 0; l < kLanes; ++l) _mm512_storeu_ps(orows[r] + l * 16, _mm512_mul_ps(st.acc[i][l], inv));
    }
  }
};

#if defined(__AVX512BF16__)
inline uint32_t pair_at(const c10::BFloat16* row, int64_t d) {
  uint32_t out;
  std::memcpy(&out, row + d, sizeof(out));
  return out;
}

// Row i's scores for one block of keys (lo: its first 16, hi: the rest) into probabilities: the keys it cannot see
// (visible: how many of the block's it sees) masked to 0, what it summed before rescaled if this block raises its
// maximum, the new probabilities added to its sums. Half: the block's last 16 keys are seen by no row of the tile.
// e^x to the ~4e-5 that probabilities rounded to bf16 need.
template <int HD, int R, bool Half>
__attribute__((always_inline)) inline void block_softmax(TileState<HD, R>& st, int i, __m512 lo, __m512 hi,
                                                         int64_t visible, float scale, __m512& p_lo, __m512& p_hi) {
  visible = std::clamp<int64_t>(visible, 0, kKeys);
  const uint32_t keep = visible >= kKeys ? 0xFFFFFFFFu : (1u << visible) - 1;
  const __mmask16 keep_lo = static_cast<__mmask16>(keep), keep_hi = Half ? 0 : static_cast<__mmask16>(keep >> 16);
  const __m512 none = _mm512_set1_ps(kNoMax), sc = _mm512_set1_ps(scale);
  const __m512 s_lo = _mm512_mask_mul_ps(none, keep_lo, lo, sc);
  const __m512 s_hi = Half ? none : _mm512_mask_mul_ps(none, keep_hi, hi, sc);
  st.raise_max(i, _mm512_reduce_max_ps(_mm512_max_ps(s_lo, s_hi)));
  const __m512 m = _mm512_set1_ps(st.row_max[i]);
  p_lo = _mm512_maskz_mov_ps(keep_lo, tokenloom::exp_nonpositive(_mm512_sub_ps(s_lo, m)));
  p_hi = Half ? _mm512_setzero_ps() : _mm512_maskz_mov_ps(keep_hi, tokenloom::exp_nonpositive(_mm512_sub_ps(s_hi, m)));
  st.lane_sums[i] = _mm512_add_ps(st.lane_sums[i], _mm512_add_ps(p_lo, p_hi));
}

// bf16: K^T as [HD / 2 dim pairs][kKeys] and V as [kKeys / 2 key pairs][HD], each element a pair of bf16.
struct Bf16Keys {
  using Elem = c10::BFloat16;
  using Packed = uint32_t;
  template <int HD>
  static constexpr int64_t kBlockK = (HD / 2) * kKeys;
  template <int HD>
  static constexpr int64_t kBlockV = (kKeys / 2) * HD;

  template <int HD, typename KRow, typename VRow>
  static void pack(const KRow& k_row, const VRow& v_row, int64_t k0, int64_t ctx, uint32_t* kt, uint32_t* vt) {
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

  // One block of keys (k0 on) for the tile's R rows: dim pairs of the queries against K^T's pairs, then key pairs'
  // probabilities against V's.
  template <int HD, int R, bool Half>
  __attribute__((always_inline)) static inline void attend(TileState<HD, R>& st, const c10::BFloat16* const* qrows,
                                                           const int64_t* keys, int64_t k0, const uint32_t* kt,
                                                           const uint32_t* vt, float scale) {
    using tokenloom::broadcast_pair;
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
    // Probabilities as bf16 pairs (key 2j, key 2j + 1), each broadcast against V's pairs for 16 dims.
    alignas(64) uint32_t prob_pairs[R][kKeys / 2];
    for (int i = 0; i < R; ++i) {
      __m512 p_lo, p_hi;
      block_softmax<HD, R, Half>(st, i, lo[i], hi[i], keys[i] - k0, scale, p_lo, p_hi);
      _mm256_store_si256(reinterpret_cast<__m256i*>(prob_pairs[i]), (__m256i)_mm512_cvtneps_pbh(p_lo));
      if constexpr (!Half) {
        _mm256_store_si256(reinterpret_cast<__m256i*>(prob_pairs[i] + 8), (__m256i)_mm512_cvtneps_pbh(p_hi));
      }
    }
    for (int j = 0; j < (Half ? kKeys / 4 : kKeys / 2); ++j) {
      for (int l = 0; l < kLanes; ++l) {
        const __m512bh vv = (__m512bh)_mm512_loadu_si512(vt + j * HD + l * 16);
        for (int i = 0; i < R; ++i) {
          st.acc[i][l] = _mm512_dpbf16_ps(st.acc[i][l], broadcast_pair(&prob_pairs[i][j]), vv);
        }
      }
    }
  }

  // R query rows (token and head pairs) against every key block they see. R independent chains of dot products keep
  // the vector unit busy, and each block of K^T and V is loaded once for R rows. keys[i]: how many keys row i sees.
  template <int HD, int R, typename Blocks>
  static void attend_tile(const c10::BFloat16* const* qrows, const int64_t* keys, const Blocks& blocks, float scale,
                          c10::BFloat16* const* orows) {
    int64_t most = 0;
    for (int i = 0; i < R; ++i) most = std::max(most, keys[i]);
    TileState<HD, R> st;
    int64_t k0 = 0, b = 0;
    for (; k0 + kKeys / 2 < most; k0 += kKeys, ++b) {
      attend<HD, R, false>(st, qrows, keys, k0, blocks.key(b), blocks.value(b), scale);
    }
    if (k0 < most) attend<HD, R, true>(st, qrows, keys, k0, blocks.key(b), blocks.value(b), scale);
    st.write(R, orows);
  }

  template <int HD, typename Blocks>
  static void attend_rows(const c10::BFloat16* const* qrows, const int64_t* keys, c10::BFloat16* const* orows,
                          int64_t rows, const Blocks& blocks, float scale) {
    constexpr int kTile = HD == 64 ? 4 : 2;  // rows at once: kTile * HD / 16 accumulators stay in registers
    int64_t r = 0;
    for (; r + kTile <= rows; r += kTile) attend_tile<HD, kTile>(qrows + r, keys + r, blocks, scale, orows + r);
    for (; r < rows; ++r) attend_tile<HD, 1>(qrows + r, keys + r, blocks, scale, orows + r);
  }
};
#endif  // __AVX512BF16__

// The bf16 kinds on AMX tiles: built for a CPU with AMX (and Linux, which grants the tiles on request).
#if defined(__AVX512BF16__) && defined(TOKENLOOM_AMX_BF16)
#define TOKENLOOM_PREFILL_ON_AMX 1
#endif

#if defined(TOKENLOOM_PREFILL_ON_AMX)
// bf16 on AMX tiles: the same packed blocks as Bf16Keys (K^T's 16 dim pairs by 16 keys and V's 16 key pairs by 16
// dims are each one B tile as they lie), 32 query rows at a time (two A tiles; a last tile of 16 or fewer takes one).
// A span of two blocks of keys: the rows' scores in C tiles (Q's 32-dim A tiles against K^T's), stored for the online
// softmax on AVX-512 (one maximum a row a span), the probabilities rounded to bf16 into A tiles, and their products
// with V's B tiles added to the rows' float32 sums. The tiles multiply a block's 32 x 32 x HD products in a few
// instructions each way, where the AVX-512 BF16 kind issues one dot product per pair: with AMX torch's fused attention
// was 1.2-3.2x faster than that kind; this one is 0.46-0.78x torch's time, at the softmax's pace
// (benchmarks/prefill_attention_amx.py).
struct AmxBf16Keys : Bf16Keys {
  static constexpr int kTileRows = tokenloom::amx::kTileRows;

  // C tile (a, b) of T x 2: rows 16a.. of the row tiles, keys (or dims) 16b.. of the pair of B tiles.
  template <int T>
  static inline void multiply_pairs() {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (T == 2) {
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }

  // C tiles 0-1 (and 2-3) into out's rows: 16 rows, 32 columns (16 a tile) each, `stride` bytes apart.
  template <int T>
  static inline void store_pairs(float* out, int64_t stride) {
    const int64_t below = kTileRows * stride / sizeof(float);
    _tile_stored(0, out, stride);
    _tile_stored(1, out + 16, stride);
    if constexpr (T == 2) {
      _tile_stored(2, out + below, stride);
      _tile_stored(3, out + below + 16, stride);
    }
  }

  template <int T>
  static inline void zero_pairs() {
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (T == 2) {
      _tile_zero(2);
      _tile_zero(3);
    }
  }

  // Row i's scores for B blocks of keys from k0 (s: B x 32 of them) into probabilities, as bf16 pairs into p: the
  // keys it cannot see (visible: how many from k0) masked to 0, what it summed before rescaled if this span raises its
  // maximum, the new probabilities added to its sums. One maximum a span, so a span of two blocks halves its cost.
  template <int HD, int R, int B>
  __attribute__((always_inline)) static inline void span_softmax(TileState<HD, R>& st, int i, const float* s,
                                                                 int64_t visible, float scale, uint32_t* p) {
    constexpr int kVectors = 2 * B;
    const __m512 none = _mm512_set1_ps(kNoMax), sc = _mm512_set1_ps(scale);
    __m512 x[kVectors], most = none;
    __mmask16 keep[kVectors];
    for (int c = 0; c < kVectors; ++c) {
      const int64_t seen = std::clamp<int64_t>(visible - 16 * c, 0, 16);
      keep[c] = static_cast<__mmask16>((1u << seen) - 1);
      x[c] = _mm512_mask_mul_ps(none, keep[c], _mm512_load_ps(s + 16 * c), sc);
      most = _mm512_max_ps(most, x[c]);
    }
    st.raise_max(i, _mm512_reduce_max_ps(most));
    const __m512 m = _mm512_set1_ps(st.row_max[i]);
    for (int c = 0; c < kVectors; c += 2) {
      const __m512 lo = _mm512_maskz_mov_ps(keep[c], tokenloom::exp_nonpositive(_mm512_sub_ps(x[c], m)));
      const __m512 hi = _mm512_maskz_mov_ps(keep[c + 1], tokenloom::exp_nonpositive(_mm512_sub_ps(x[c + 1], m)));
      st.lane_sums[i] = _mm512_add_ps(st.lane_sums[i], _mm512_add_ps(lo, hi));
      _mm512_store_si512(p + 8 * c, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }

  // A span of B blocks of keys from block b for the tile's 16 T rows: their scores, softmax, and probability-weighted
  // V rows added to their sums. Tiles 4-5 hold the rows' A tiles (queries, then probabilities), 6-7 a pair of B tiles
  // (K^T for keys 0-15 and 16-31 of a block, then V for 32 dims), 0-3 their products: each B tile loaded serves both
  // row tiles.
  template <int HD, int T, int B, typename Blocks>
  static void attend_span(TileState<HD, 16 * T>& st, const c10::BFloat16 (*q)[HD], const int64_t* seen,
                          const Blocks& blocks, int64_t b, float scale) {
    constexpr int kM = kTileRows * T, kLanes = HD / 16, kSpan = B * kKeys;
    constexpr int64_t q_stride = HD * sizeof(c10::BFloat16), kt_stride = kKeys * sizeof(uint32_t);
    alignas(64) float s[kM][kSpan];
    alignas(64) uint32_t p[kM][kSpan / 2];  // a row's probabilities as bf16 pairs: B A tiles' rows
    alignas(64) float pv[kM][HD];
    for (int j = 0; j < B; ++j) {
      const uint32_t* kt = blocks.key(b + j);
      zero_pairs<T>();
      for (int c = 0; c < HD / 32; ++c) {  // dims 32c.. against K^T's pair rows 16c..
        _tile_loadd(4, &q[0][c * 32], q_stride);
        if constexpr (T == 2) _tile_loadd(5, &q[kTileRows][c * 32], q_stride);
        _tile_loadd(6, kt + c * 16 * kKeys, kt_stride);
        _tile_loadd(7, kt + c * 16 * kKeys + 16, kt_stride);
        multiply_pairs<T>();
      }
      store_pairs<T>(&s[0][j * kKeys], kSpan * sizeof(float));
    }
    const int64_t k0 = b * kKeys;
    for (int i = 0; i < kM; ++i) span_softmax<HD, kM, B>(st, i, s[i], seen[i] - k0, scale, p[i]);
    for (int l = 0; l < kLanes; l += 2) {  // V's key pairs by dims 16l.. and 16(l + 1)..
      zero_pairs<T>();
      for (int j = 0; j < B; ++j) {
        const uint32_t* vt = blocks.value(b + j);
        _tile_loadd(4, &p[0][j * kKeys / 2], sizeof(p[0]));
        if constexpr (T == 2) _tile_loadd(5, &p[kTileRows][j * kKeys / 2], sizeof(p[0]));
        _tile_loadd(6, vt + l * 16, HD * sizeof(uint32_t));
        _tile_loadd(7, vt + (l + 1) * 16, HD * sizeof(uint32_t));
        multiply_pairs<T>();
      }
      store_pairs<T>(&pv[0][l * 16], HD * sizeof(float));
    }
    for (int i = 0; i < kM; ++i) {
      for (int l = 0; l < kLanes; ++l) st.acc[i][l] = _mm512_add_ps(st.acc[i][l], _mm512_load_ps(pv[i] + l * 16));
    }
  }

  // 16 T query rows (token and head pairs; rows: how many are real) against every key block any of them sees, two
  // blocks a span.
  template <int HD, int T, typename Blocks>
  static void attend_tile(const c10::BFloat16* const* qrows, const int64_t* keys, int64_t rows, const Blocks& blocks,
                          float scale, c10::BFloat16* const* orows) {
    constexpr int kM = kTileRows * T;
    alignas(64) c10::BFloat16 q[kM][HD];
    int64_t seen[kM], most = 0;
    for (int i = 0; i < kM; ++i) {  // a short tile repeats its last row: computed, never written
      const int64_t row = std::min<int64_t>(i, rows - 1);
      std::memcpy(q[i], qrows[row], HD * sizeof(c10::BFloat16));
      seen[i] = keys[row];
      most = std::max(most, seen[i]);
    }
    TileState<HD, kM> st;
    const int64_t blocks_seen = (most + kKeys - 1) / kKeys;
    int64_t b = 0;
    for (; b + 2 <= blocks_seen; b += 2) attend_span<HD, T, 2>(st, q, seen, blocks, b, scale);
    if (b < blocks_seen) attend_span<HD, T, 1>(st, q, seen, blocks, b, scale);
    st.write(rows, orows);
  }

  template <int HD, typename Blocks>
  static void attend_rows(const c10::BFloat16* const* qrows, const int64_t* keys, c10::BFloat16* const* orows,
                          int64_t rows, const Blocks& blocks, float scale) {
    if (!tokenloom::amx::tiles_permitted()) {
      Bf16Keys::attend_rows<HD>(qrows, keys, orows, rows, blocks, scale);
      return;
    }
    tokenloom::amx::configure_tiles();  // per call: other code on this thread (oneDNN) may have set its own
    int64_t r = 0;
    for (; rows - r > kTileRows; r += 2 * kTileRows) {
      attend_tile<HD, 2>(qrows + r, keys + r, std::min<int64_t>(2 * kTileRows, rows - r), blocks, scale, orows + r);
    }
    if (r < rows) attend_tile<HD, 1>(qrows + r, keys + r, rows - r, blocks, scale, orows + r);
    _tile_release();
  }
};
using Bf16Kind = AmxBf16Keys;
#elif defined(__AVX512BF16__)
using Bf16Kind = Bf16Keys;
#endif

// One KV head, query tokens [q0, q1) of the chunk, every query head of the group, over the head's packed keys.
// Where a head's packed key blocks are: one after another (a contiguous context), or, for chunks of a step that
// share keys, each block one of the step's packed units.
template <typename Kind, int HD>
struct ContiguousBlocks {
  using Packed = typename Kind::Packed;
  const Packed* k;
  const Packed* v;
  const Packed* key(int64_t b) const { return k + b * Kind::template kBlockK<HD>; }
  const Packed* value(int64_t b) const { return v + b * Kind::template kBlockV<HD>; }
};

template <typename Kind, int HD>
struct SharedBlocks {
  using Packed = typename Kind::Packed;
  const Packed* head;    // the step's packed units, offset to this KV head's place in each
  const int64_t* units;  // the unit of each of the chunk's key blocks
  int64_t per_unit;      // every head's K and V blocks
  const Packed* key(int64_t b) const { return head + units[b] * per_unit; }
  const Packed* value(int64_t b) const { return key(b) + Kind::template kBlockK<HD>; }
};

template <typename Kind, int HD, typename Blocks>
void attend_queries(const typename Kind::Elem* q, int64_t q_stride, const Blocks& blocks, int64_t past, int64_t q0,
                    int64_t q1, int64_t group, float scale, typename Kind::Elem* out, int64_t out_stride) {
  using Elem = typename Kind::Elem;
  const int64_t rows = (q1 - q0) * group;
  std::vector<const Elem*> qrows(rows);
  std::vector<Elem*> orows(rows);
  std::vector<int64_t> keys(rows);
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t t = q0 + row / group, h = row % group;
    keys[row] = past + t + 1;  // causal: the keys up to the token's own position
    qrows[row] = q + t * q_stride + h * HD;
    orows[row] = out + t * out_stride + h * HD;
  }
  Kind::template attend_rows<HD>(qrows.data(), keys.data(), orows.data(), rows, blocks, scale);
}

// The calling thread's buffer for the packed keys, of at least `size` elements: grown, never shrunk, as a fresh one
// each layer would be mapped and page-faulted in anew. Every element a call reads its packing pass writes first: no
// zero fill. Only the caller asks (a helper thread would find a buffer of its own).
template <typename Packed>
Packed* packing_buffer(int64_t size) {
  thread_local std::vector<Packed> buffer;
  if (static_cast<int64_t>(buffer.size()) < size) buffer.resize(size);
  return buffer.data();
}

template <typename Kind, int HD>
void prefill_all(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, float scale, at::Tensor& out) {
  using Elem = typename Kind::Elem;
  using Packed = typename Kind::Packed;
  const int64_t n = q.size(0), heads = q.size(1), ctx = k.size(0);
  const int64_t kv_heads = k.size(1) / HD, group = heads / kv_heads, past = ctx - n;
  const auto* q_ptr = q.const_data_ptr<Elem>();
  const auto* k_ptr = k.const_data_ptr<Elem>();
  const auto* v_ptr = v.const_data_ptr<Elem>();
  auto* out_ptr = out.mutable_data_ptr<Elem>();
  const int64_t key_blocks = (ctx + kKeys - 1) / kKeys;
  const int64_t block_k = Kind::template kBlockK<HD>, block_v = Kind::template kBlockV<HD>;
  const int64_t per_head = key_blocks * (block_k + block_v);
  Packed* packed = packing_buffer<Packed>(kv_heads * per_head);
  // Both passes share their units through work_sharing.h (no wait for a sleeping OpenMP worker).
  tokenloom::WorkSharing& threads = tokenloom::WorkSharing::instance();
  threads.run(kv_heads * key_blocks, [&](int64_t item) {
    const int64_t g = item / key_blocks, b = item % key_blocks;
    Packed* head = packed + g * per_head;
    const int64_t k_stride = k.stride(0), v_stride = v.stride(0);
    Kind::template pack<HD>([&](int64_t t) { return k_ptr + t * k_stride + g * HD; },
                            [&](int64_t t) { return v_ptr + t * v_stride + g * HD; }, b * kKeys, ctx,
                            head + b * block_k, head + key_blocks * block_k + b * block_v);
  });
  const int64_t query_blocks = (n + kQueryTokens - 1) / kQueryTokens;
  // Later query blocks see more keys: they are taken first, so the last units taken are short.
  threads.run(query_blocks * kv_heads, [&](int64_t item) {
    const int64_t block = query_blocks - 1 - item / kv_heads, g = item % kv_heads;
    const int64_t q0 = block * kQueryTokens, q1 = std::min(n, q0 + kQueryTokens);
    const Packed* head = packed + g * per_head;
    const ContiguousBlocks<Kind, HD> blocks{head, head + key_blocks * block_k};
    attend_queries<Kind, HD>(q_ptr + g * group * HD, q.stride(0), blocks, past, q0, q1, group, scale,
                             out_ptr + g * group * HD, out.stride(0));
  });
}

#if defined(__AVX512BF16__)
constexpr bool kTakesBf16 = true;
#else
constexpr bool kTakesBf16 = false;
#endif

// f(Kind{}, head size as an integral constant) for the tensors' dtype and a head size of 64 or 128.
template <typename F>
void for_kind(at::ScalarType dtype, int64_t d, const F& f) {
  using D64 = std::integral_constant<int, 64>;
  using D128 = std::integral_constant<int, 128>;
  if (dtype == at::kFloat) {
    d == 64 ? f(Float32Keys{}, D64{}) : f(Float32Keys{}, D128{});
    return;
  }
#if defined(__AVX512BF16__)
  d == 64 ? f(Bf16Kind{}, D64{}) : f(Bf16Kind{}, D128{});
#endif
}

// The operators' dtypes: float32, or bfloat16 where built with AVX-512 BF16; q, the keys and out all of one.
void check_dtypes(const char* op, std::initializer_list<const at::Tensor*> tensors) {
  const at::ScalarType dtype = (*tensors.begin())->scalar_type();
  for (const at::Tensor* t : tensors) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == dtype, op, ": CPU tensors of one dtype");
  }
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, op, ": float32 or bfloat16 tensors only");
  TORCH_CHECK(dtype == at::kFloat || kTakesBf16, op, ": bfloat16 needs a CPU with AVX-512 BF16 (float32 does not)");
}

// q: [n, heads, d] (rows may be strided, heads contiguous); k, v: [ctx, kv_heads * d] (rows may be strided);
// out: shaped as q (rows may be strided, heads contiguous), a slice of the step's output.
void prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, at::Tensor out) {
  check_dtypes("prefill_attention", {&q, &k, &v, &out});
  TORCH_CHECK(q.dim() == 3 && k.dim() == 2 && v.dim() == 2 && k.sizes() == v.sizes(),
              "prefill_attention: q [n, heads, d], k and v [ctx, kv_heads * d]");
  const int64_t n = q.size(0), heads = q.size(1), d = q.size(2), ctx = k.size(0);
  TORCH_CHECK(d == 64 || d == 128, "prefill_attention: head size 64 or 128");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == d && k.stride(1) == 1 && v.stride(1) == 1,
              "prefill_attention: heads and dims must be contiguous");
  TORCH_CHECK(out.sizes() == q.sizes() && out.stride(2) == 1 && out.stride(1) == d,
              "prefill_attention: out must be shaped as q, heads and dims contiguous");
  TORCH_CHECK(k.size(1) % d == 0 && heads % (k.size(1) / d) == 0, "prefill_attention: heads must group over KV heads");
  TORCH_CHECK(n >= 1 && ctx >= n, "prefill_attention: the chunk must lie within its context");
  for_kind(q.scalar_type(), d, [&](auto kind, auto hd) {
    prefill_all<decltype(kind), decltype(hd)::value>(q, k, v, static_cast<float>(scale), out);
  });
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

template <typename Kind, int HD>
void paged_prefill_all(const at::Tensor& q, const at::Tensor& cache_k, const at::Tensor& cache_v,
                       const at::Tensor& segments, const at::Tensor& tables, const at::Tensor& key_units,
                       const at::Tensor& unit_sources, int64_t block_size, float scale, at::Tensor& out) {
  const int64_t num_segments = segments.size(0), heads = q.size(1), kv_heads = cache_k.size(1) / HD;
  const int64_t group = heads / kv_heads, num_units = unit_sources.size(0);
  using Elem = typename Kind::Elem;
  using Packed = typename Kind::Packed;
  const int64_t block_k = Kind::template kBlockK<HD>, per_head = block_k + Kind::template kBlockV<HD>;
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
  Packed* packed = packing_buffer<Packed>(num_units * per_unit);
  const auto* q_ptr = q.const_data_ptr<Elem>();
  const auto* k_ptr = cache_k.const_data_ptr<Elem>();
  const auto* v_ptr = cache_v.const_data_ptr<Elem>();
  auto* out_ptr = out.mutable_data_ptr<Elem>();
  const int64_t k_stride = cache_k.stride(0), v_stride = cache_v.stride(0);
  tokenloom::WorkSharing& threads = tokenloom::WorkSharing::instance();
  threads.run(num_units * kv_heads, [&](int64_t item) {
    const int64_t u = item / kv_heads, g = item % kv_heads;
    const Segment& seg = segs[sources[2 * u]];
    auto slot = [&](int64_t t) { return seg.table[t / block_size] * block_size + t % block_size; };
    Packed* head = packed + u * per_unit + g * per_head;
    Kind::template pack<HD>([&](int64_t t) { return k_ptr + slot(t) * k_stride + g * HD; },
                            [&](int64_t t) { return v_ptr + slot(t) * v_stride + g * HD; },
                            sources[2 * u + 1] * kKeys, seg.ctx, head, head + block_k);
  });
  threads.run(attend_firsts[num_segments], [&](int64_t item) {
    const int64_t s = segment_of(attend_firsts, item), piece = item - attend_firsts[s];
    const Segment& seg = segs[s];
    const int64_t query_blocks = (seg.n + kQueryTokens - 1) / kQueryTokens;
    const int64_t block = query_blocks - 1 - piece / kv_heads, g = piece % kv_heads;  // later blocks first
    const int64_t q0 = block * kQueryTokens, q1 = std::min(seg.n, q0 + kQueryTokens);
    const SharedBlocks<Kind, HD> blocks{packed + g * per_head, seg.units, per_unit};
    attend_queries<Kind, HD>(q_ptr + seg.start * q.stride(0) + g * group * HD, q.stride(0), blocks, seg.ctx - seg.n,
                             q0, q1, group, scale, out_ptr + seg.start * out.stride(0) + g * group * HD,
                             out.stride(0));
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
  check_dtypes("paged_prefill_attention", {&q, &cache_k, &cache_v, &out});
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
  for_kind(q.scalar_type(), d, [&](auto kind, auto hd) {
    paged_prefill_all<decltype(kind), decltype(hd)::value>(q, cache_k, cache_v, segments, tables, key_units,
                                                           unit_sources, block_size, static_cast<float>(scale), out);
  });
}

bool prefill_attention_takes_bf16() { return kTakesBf16; }

// Whether bf16 chunks run on AMX tiles (built for a CPU with AMX, and the tiles granted to the process).
bool prefill_attention_uses_amx() {
#if defined(TOKENLOOM_PREFILL_ON_AMX)
  return tokenloom::amx::tiles_permitted();
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloom, m) {
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, float scale, Tensor(a!) out) -> ()");
  m.def("prefill_attention_takes_bf16() -> bool", &prefill_attention_takes_bf16);
  m.def("prefill_attention_uses_amx() -> bool", &prefill_attention_uses_amx);
  m.def(
      "paged_prefill_attention(Tensor q, Tensor cache_k, Tensor cache_v, Tensor segments, Tensor tables, "
      "Tensor key_units, Tensor unit_sources, int block_size, float scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(tokenloom, CPU, m) {
  m.impl("prefill_attention", &prefill_attention);
  m.impl("paged_prefill_attention", &paged_prefill_attention);
}

#endif  // __AVX512F__
