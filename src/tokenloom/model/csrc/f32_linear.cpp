// float32 linears over a weight in blocks of 16 output features, for CPUs with AVX2 and FMA, and AVX-512:
// tokenloom::f32_linear.
//
// A decode step of a few rows reads every weight once and multiplies it by those rows only: it is bound by the
// weight's bytes. oneDNN's packed float32 linear (prepack.py) streamed a step's weights at ~13-16 GB/s on our 2-core
// AVX2 machines where the memory gives ~26, and at 12-32 rows ran its multiplies at 70-105 GFLOP/s where a large
// float32 matmul reaches ~170. Here the weight is packed as [N / 16, K x 16] (f32_pack_weight in prepack.py: for
// each input a block's 16 features side by side), and a register tile of up to 6 rows x 16 features keeps 12 sums:
// each input loads the block's 16 weights once (two vectors) and broadcasts each row's value, 12 FMAs for 8 loads;
// the block is read from memory once and from L1/L2 by every further group of 6 rows. Outputs are stored once, with
// the bias, at the end of the block: no horizontal sums. On a Zen 3 this ran a step's 120 decoder linears 1.3-1.4x
// faster than oneDNN at 1-64 rows and 1.1-1.2x at 256-2,048 (prefill chunks).
//
// With AVX-512 the same layout goes two blocks at a time, tiles of up to 12 rows x 32 features (24 sums in
// registers), a unit's rows in panels of 96 so that a prefill chunk's inputs stay in L2 while the weights pass. On an
// AVX-512 Xeon without BF16 (where the model runs in float32) that ran a step's 120 linears 1.2-1.8x faster than
// oneDNN at 1-64 rows, 0.92-0.95x at 256-2,048 (benchmarks/float32_cpu_ops.py): oneDNN keeps a lead at prefill sizes,
// but a weight in both layouts would double the float32 weights' memory.

#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <utility>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "work_sharing.h"

namespace {

constexpr int64_t kBlock = 16;               // output features of a block (two vectors of 8)
constexpr int kTileRows = 6;                 // rows of a register tile: 12 sums, 2 weight vectors, 1 broadcast
constexpr int64_t kMinUnitBytes = 64 << 10;  // a unit's weight bytes: enough to be worth a helper's taking it

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t);

#if defined(__AVX512F__)
// AVX-512: a tile of up to 12 rows x NB blocks side by side (NB = 2: 32 features, 24 sums): each input loads each
// block's 16 weights once (one vector) and broadcasts each row's value, 24 FMAs for 14 loads.
constexpr int kTileRows512 = 12;
constexpr int kTileBlocks = 2;  // blocks side by side in a tile (8 x 3 and 6 x 4 tiles measured the same)
constexpr int64_t kPanelRows = 96;  // rows a unit takes: their inputs stay in L2 while every block of the unit passes

template <int R, int NB>
void tile512(const float* x, int64_t ldx, const float* block, int64_t k, const float* bias, float* y, int64_t ldy) {
  __m512 sums[R][NB];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    for (int b = 0; b < NB; ++b) sums[r][b] = _mm512_setzero_ps();
  }
  for (int64_t i = 0; i < k; ++i) {
    __m512 w[NB];
    for (int b = 0; b < NB; ++b) w[b] = _mm512_loadu_ps(block + b * k * kBlock + i * kBlock);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512 value = _mm512_set1_ps(x[r * ldx + i]);
      for (int b = 0; b < NB; ++b) sums[r][b] = _mm512_fmadd_ps(value, w[b], sums[r][b]);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    for (int b = 0; b < NB; ++b) {
      const __m512 bb = bias ? _mm512_loadu_ps(bias + b * kBlock) : _mm512_setzero_ps();
      _mm512_storeu_ps(y + r * ldy + b * kBlock, _mm512_add_ps(sums[r][b], bb));
    }
  }
}

template <int NB, int... R>
constexpr std::array<TileFn, sizeof...(R)> tiles512(std::integer_sequence<int, R...>) {
  return {&tile512<R + 1, NB>...};
}

// The tile for `rows` (1 to kTileRows512) rows of nb (1 or 2) blocks.
TileFn tile512_for(int64_t rows, int64_t nb) {
  static_assert(kTileBlocks == 2, "a tile is one block or two");
  static constexpr auto one = tiles512<1>(std::make_integer_sequence<int, kTileRows512>{});
  static constexpr auto two = tiles512<2>(std::make_integer_sequence<int, kTileRows512>{});
  return (nb == 2 ? two : one)[rows - 1];
}

// Units of up to kPanelRows rows x a group of the tiles' blocks (at least kMinUnitBytes of weights): a decode step's few
// rows read each weight once, a prefill chunk's panels each read the weights from L3 while their inputs stay in L2.
void linear_avx512(const float* xp, int64_t ldx, const float* wp, int64_t m, int64_t k, int64_t blocks,
                   const float* bias, float* op) {
  const int64_t n = blocks * kBlock, sides = (blocks + kTileBlocks - 1) / kTileBlocks;  // tiles' blocks side by side
  const int64_t side_bytes = kTileBlocks * k * kBlock * 4;
  const int64_t sides_per_unit = std::max<int64_t>(1, kMinUnitBytes / std::max<int64_t>(1, side_bytes));
  const int64_t groups = (sides + sides_per_unit - 1) / sides_per_unit;
  const int64_t panels = (m + kPanelRows - 1) / kPanelRows;
  const std::function<void(int64_t)> body = [&](int64_t unit) {
    const int64_t r0 = unit / groups * kPanelRows, r1 = std::min(m, r0 + kPanelRows), g = unit % groups;
    for (int64_t side = g * sides_per_unit; side < std::min(sides, (g + 1) * sides_per_unit); ++side) {
      const int64_t b = kTileBlocks * side, nb = std::min<int64_t>(kTileBlocks, blocks - b), f = b * kBlock;
      for (int64_t r = r0; r < r1; r += kTileRows512) {
        const int64_t rows = std::min<int64_t>(kTileRows512, r1 - r);
        tile512_for(rows, nb)(xp + r * ldx, ldx, wp + b * k * kBlock, k, bias ? bias + f : nullptr, op + r * n + f,
                              n);
      }
    }
  };
  tokenloom::WorkSharing::instance().run(panels * groups, body);
}
#endif  // __AVX512F__

#if !defined(__AVX512F__)
// y[r, 0..15] = x[r, :] . block's features (+ bias) for R rows; the block is [K, 16]. The loops over rows are
// unrolled by pragma: without it GCC kept the 12 sums in a stack array, stored every input (`g++ -S`), 2x slower.
template <int R>
void tile(const float* x, int64_t ldx, const float* block, int64_t k, const float* bias, float* y, int64_t ldy) {
  __m256 low[R], high[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    low[r] = _mm256_setzero_ps();
    high[r] = _mm256_setzero_ps();
  }
  for (int64_t i = 0; i < k; ++i) {
    const __m256 w0 = _mm256_loadu_ps(block + i * kBlock), w1 = _mm256_loadu_ps(block + i * kBlock + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 value = _mm256_broadcast_ss(x + r * ldx + i);
      low[r] = _mm256_fmadd_ps(value, w0, low[r]);
      high[r] = _mm256_fmadd_ps(value, w1, high[r]);
    }
  }
  const __m256 b0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  const __m256 b1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(y + r * ldy, _mm256_add_ps(low[r], b0));
    _mm256_storeu_ps(y + r * ldy + 8, _mm256_add_ps(high[r], b1));
  }
}

TileFn tile_for(int64_t rows) {
  switch (rows) {
    case 1: return &tile<1>;
    case 2: return &tile<2>;
    case 3: return &tile<3>;
    case 4: return &tile<4>;
    case 5: return &tile<5>;
    default: return &tile<kTileRows>;
  }
}

// Every row of x by every block of the weight, in units of blocks worth a helper's taking, 6-row tiles.
void linear_avx2(const float* xp, int64_t ldx, const float* wp, int64_t m, int64_t k, int64_t blocks,
                 const float* bias_data, float* op) {
  const int64_t n = blocks * kBlock;
  const int64_t block_bytes = k * kBlock * 4;
  const int64_t blocks_per_unit = std::max<int64_t>(1, kMinUnitBytes / std::max<int64_t>(1, block_bytes));
  const int64_t units = (blocks + blocks_per_unit - 1) / blocks_per_unit;
  const std::function<void(int64_t)> body = [&](int64_t unit) {
    const int64_t b1 = std::min(blocks, (unit + 1) * blocks_per_unit);
    for (int64_t b = unit * blocks_per_unit; b < b1; ++b) {
      const int64_t f = b * kBlock;
      const float* block = wp + b * k * kBlock;
      const float* bb = bias_data ? bias_data + f : nullptr;
      for (int64_t r = 0; r < m; r += kTileRows) {
        tile_for(std::min<int64_t>(kTileRows, m - r))(xp + r * ldx, ldx, block, k, bb, op + r * n + f, n);
      }
    }
  };
  tokenloom::WorkSharing::instance().run(units, body);
}
#endif  // !__AVX512F__

// x [M, K] float32 (rows of unit stride), a weight from f32_pack_weight [N / 16, K x 16], bias [N] or none -> [M, N].
at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "f32_linear: x must be float32 [M, K] with rows of unit stride");
  TORCH_CHECK(packed.scalar_type() == at::kFloat && packed.dim() == 2 && packed.is_contiguous(),
              "f32_linear: the weight must be a contiguous float32 [N / 16, K x 16] from f32_pack_weight");
  const int64_t m = x.size(0), k = x.size(1), blocks = packed.size(0), n = blocks * kBlock;
  TORCH_CHECK(packed.size(1) == k * kBlock, "f32_linear: the weight's K is not x's");
  const float* bias_data = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "f32_linear: bias must be float32 [N]");
    bias_data = bias->const_data_ptr<float>();
  }
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return out;
#if defined(__AVX512F__)
  linear_avx512(x.const_data_ptr<float>(), x.stride(0), packed.const_data_ptr<float>(), m, k, blocks, bias_data,
                out.mutable_data_ptr<float>());
#else
  linear_avx2(x.const_data_ptr<float>(), x.stride(0), packed.const_data_ptr<float>(), m, k, blocks, bias_data,
              out.mutable_data_ptr<float>());
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloom, m) { m.def("f32_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor"); }

TORCH_LIBRARY_IMPL(tokenloom, CPU, m) { m.impl("f32_linear", &f32_linear); }

#endif  // AVX2 and FMA
