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
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "work_sharing.h"

namespace {

constexpr int64_t kBlock = 16;               // output features of a block (two vectors of 8)
constexpr int kTileRows = 6;                 // rows of a register tile: 12 sums, 2 weight vectors, 1 broadcast
constexpr int64_t kMinUnitBytes = 64 << 10;  // a unit's weight bytes: enough to be worth a helper's taking it

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t);

// --- A GGUF's 4- and 8-bit weights, widened to float32 as they are used: tokenloom::gguf_linear ---
//
// A GGUF checkpoint's quantized linears (--quantization gguf) whose every group of 32 inputs of a feature is
// code * scale + offset: Q4_0, Q4_1, Q4_K (codes 0-15) and Q8_0 (codes -128-127, offset 0), in blocks of 16 features
// as f32_linear's. Per block and group: the codes, input by input, each input's 16 features side by side (4-bit:
// two inputs a byte, input 2p in the low nibble), then the group's 16 scales and 16 offsets in float32 beside
// (gguf_pack_weight in gguf_linear.py). A weight is widened to float32 by one FMA (code * scale + offset, rounded
// once, as gguf's dequantization rounds it), and the sums run input by input as f32_linear's tiles run them: the
// outputs are f32_linear's over the dequantized weight, bit for bit, from 0.19 (4-bit) or 0.31 (8-bit) of its bytes.
// A step of a few rows (AVX-512: 8, AVX2: 4) widens each block in registers; more rows widen each block (AVX-512: each
// pair of blocks, once per panel) into a buffer that f32_linear's tiles read (on a 2-core AVX-512 Xeon a step's 120
// linears in Q4_1 took 1/2.9 of f32_linear's time at 1 row, 1/1.9 at 8 with registers where the buffer gave 1/1.6,
// 1/1.1 at 64, the same at 1,024: RESULTS.md).
// Inputs per scale and offset (Group): 32, or 16 for 8-bit codes (Q6_K's). Instantiated for (Bits, Group) = (4, 32),
// (8, 32) and (8, 16).
template <int Bits, int Group>
constexpr int64_t kGroupBytes = Group * kBlock * Bits / 8;  // a block's codes for one group

struct GroupedWeight {
  const uint8_t* codes;   // [blocks][groups][kGroupBytes]
  const float* scales;    // [blocks][groups][16]
  const float* offsets;   // [blocks][groups][16]
  int64_t groups;
};

#if defined(__AVX512F__)
// AVX-512: a tile of up to 12 rows x NB blocks side by side (NB = 2: 32 features, 24 sums): each input loads each
// block's 16 weights once (one vector) and broadcasts each row's value, 24 FMAs for 14 loads.
constexpr int kTileRows512 = 12;
constexpr int kTileBlocks = 2;  // blocks side by side in a tile (8 x 3 and 6 x 4 tiles measured the same)
constexpr int64_t kPanelRows = 96;  // rows a unit takes: their inputs stay in L2 while every block of the unit passes

// A tile's sums (+ bias) into its R rows x NB blocks of the output.
template <int R, int NB>
inline void store_sums(const __m512 (&sums)[R][NB], const float* bias, float* y, int64_t ldy) {
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    for (int b = 0; b < NB; ++b) {
      const __m512 bb = bias ? _mm512_loadu_ps(bias + b * kBlock) : _mm512_setzero_ps();
      _mm512_storeu_ps(y + r * ldy + b * kBlock, _mm512_add_ps(sums[r][b], bb));
    }
  }
}

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
  store_sums<R, NB>(sums, bias, y, ldy);
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

// Units of up to kPanelRows rows x a group of the tiles' blocks (at least kMinUnitBytes of float32 weights): a decode
// step's few rows read each weight once, a prefill chunk's panels each read the weights from L3 while their inputs
// stay in L2. Each unit's sides (kTileBlocks blocks side by side: the first b, nb of them) go to side(r0, r1, b, nb).
template <typename Side>
void run_panels(int64_t m, int64_t k, int64_t blocks, Side&& side) {
  const int64_t sides = (blocks + kTileBlocks - 1) / kTileBlocks;
  const int64_t side_bytes = kTileBlocks * k * kBlock * 4;
  const int64_t sides_per_unit = std::max<int64_t>(1, kMinUnitBytes / std::max<int64_t>(1, side_bytes));
  const int64_t groups = (sides + sides_per_unit - 1) / sides_per_unit;
  const int64_t panels = (m + kPanelRows - 1) / kPanelRows;
  const std::function<void(int64_t)> body = [&](int64_t unit) {
    const int64_t r0 = unit / groups * kPanelRows, r1 = std::min(m, r0 + kPanelRows), g = unit % groups;
    for (int64_t s = g * sides_per_unit; s < std::min(sides, (g + 1) * sides_per_unit); ++s) {
      side(r0, r1, kTileBlocks * s, std::min<int64_t>(kTileBlocks, blocks - kTileBlocks * s));
    }
  };
  tokenloom::WorkSharing::instance().run(panels * groups, body);
}

// Rows r0 .. r1 of x by NB blocks (1 or 2) of a weight in f32_pack_weight's layout, in tiles of up to 12 rows.
inline void panel_tiles(const float* xp, int64_t ldx, const float* block, int64_t r0, int64_t r1, int64_t k,
                        int64_t nb, const float* bias, float* y, int64_t n) {
  for (int64_t r = r0; r < r1; r += kTileRows512) {
    tile512_for(std::min<int64_t>(kTileRows512, r1 - r), nb)(xp + r * ldx, ldx, block, k, bias, y + r * n, n);
  }
}

void linear_avx512(const float* xp, int64_t ldx, const float* wp, int64_t m, int64_t k, int64_t blocks,
                   const float* bias, float* op) {
  const int64_t n = blocks * kBlock;
  run_panels(m, k, blocks, [&](int64_t r0, int64_t r1, int64_t b, int64_t nb) {
    const int64_t f = b * kBlock;
    panel_tiles(xp, ldx, wp + b * k * kBlock, r0, r1, k, nb, bias ? bias + f : nullptr, op + f, n);
  });
}

// gguf_linear with AVX-512: 16 features a vector.
constexpr int64_t kGroupedRows = 8;  // steps of up to this many rows widen in registers

// Inputs 2p and 2p + 1 of group g of block b, as float32: codes * scale + offset.
template <int Bits, int Group>
inline void widen_pair(const GroupedWeight& w, int64_t b, int64_t g, int p, __m512 scale, __m512 offset,
                       __m512& even, __m512& odd) {
  const uint8_t* group = w.codes + (b * w.groups + g) * kGroupBytes<Bits, Group>;
  if constexpr (Bits == 4) {
    const __m512i pairs = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group + p * 16)));
    even = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(0xF))), scale, offset);
    odd = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(pairs, 4)), scale, offset);
  } else {
    static_assert(Bits == 8, "4- or 8-bit codes");
    const __m128i* at = reinterpret_cast<const __m128i*>(group + p * 32);
    even = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(at))), scale, offset);
    odd = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(at + 1))), scale, offset);
  }
}

// Blocks b .. b + NB - 1 widened into `dst` as f32_pack_weight lays them out ([NB][K][16]).
template <int NB, int Bits, int Group>
void widen_blocks(const GroupedWeight& w, int64_t b, float* dst) {
  const int64_t k = w.groups * Group;
  for (int nb = 0; nb < NB; ++nb) {
    for (int64_t g = 0; g < w.groups; ++g) {
      const __m512 scale = _mm512_loadu_ps(w.scales + ((b + nb) * w.groups + g) * kBlock);
      const __m512 offset = _mm512_loadu_ps(w.offsets + ((b + nb) * w.groups + g) * kBlock);
      float* out = dst + nb * k * kBlock + g * Group * kBlock;
      for (int p = 0; p < Group / 2; ++p) {
        __m512 even, odd;
        widen_pair<Bits, Group>(w, b + nb, g, p, scale, offset, even, odd);
        _mm512_storeu_ps(out + 2 * p * kBlock, even);
        _mm512_storeu_ps(out + (2 * p + 1) * kBlock, odd);
      }
    }
  }
}

// tile512 for R rows (at most kGroupedRows) of NB blocks of a grouped weight, each pair of inputs widened in
// registers.
template <int R, int NB, int Bits, int Group>
void grouped_tile(const float* x, int64_t ldx, const GroupedWeight& w, int64_t b, const float* bias, float* y,
                  int64_t ldy) {
  __m512 sums[R][NB];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    for (int nb = 0; nb < NB; ++nb) sums[r][nb] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < w.groups; ++g) {
    __m512 scale[NB], offset[NB];
    for (int nb = 0; nb < NB; ++nb) {
      scale[nb] = _mm512_loadu_ps(w.scales + ((b + nb) * w.groups + g) * kBlock);
      offset[nb] = _mm512_loadu_ps(w.offsets + ((b + nb) * w.groups + g) * kBlock);
    }
    for (int p = 0; p < Group / 2; ++p) {
      __m512 even[NB], odd[NB];
      for (int nb = 0; nb < NB; ++nb) {
        widen_pair<Bits, Group>(w, b + nb, g, p, scale[nb], offset[nb], even[nb], odd[nb]);
      }
      const int64_t i = g * Group + 2 * p;
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 first = _mm512_set1_ps(x[r * ldx + i]), second = _mm512_set1_ps(x[r * ldx + i + 1]);
        for (int nb = 0; nb < NB; ++nb) sums[r][nb] = _mm512_fmadd_ps(first, even[nb], sums[r][nb]);
        for (int nb = 0; nb < NB; ++nb) sums[r][nb] = _mm512_fmadd_ps(second, odd[nb], sums[r][nb]);
      }
    }
  }
  store_sums<R, NB>(sums, bias, y, ldy);
}

using GroupedTileFn = void (*)(const float*, int64_t, const GroupedWeight&, int64_t, const float*, float*, int64_t);

template <int NB, int Bits, int Group, int... R>
constexpr std::array<GroupedTileFn, sizeof...(R)> grouped_tiles(std::integer_sequence<int, R...>) {
  return {&grouped_tile<R + 1, NB, Bits, Group>...};
}

template <int Bits, int Group>
GroupedTileFn grouped_tile_for(int64_t rows, int64_t nb) {
  static constexpr auto one = grouped_tiles<1, Bits, Group>(std::make_integer_sequence<int, kGroupedRows>{});
  static constexpr auto two = grouped_tiles<2, Bits, Group>(std::make_integer_sequence<int, kGroupedRows>{});
  return (nb == 2 ? two : one)[rows - 1];
}

// linear_avx512's units over a grouped weight: a few rows widen in registers; a panel of more widens each pair of
// blocks once into a buffer of this thread's and runs f32_linear's tiles over it.
template <int Bits, int Group>
void grouped_linear_avx512(const float* xp, int64_t ldx, const GroupedWeight& w, int64_t m, int64_t blocks,
                           const float* bias, float* op) {
  const int64_t k = w.groups * Group, n = blocks * kBlock;
  run_panels(m, k, blocks, [&](int64_t r0, int64_t r1, int64_t b, int64_t nb) {
    const int64_t f = b * kBlock;
    const float* bb = bias ? bias + f : nullptr;
    if (r1 - r0 <= kGroupedRows) {
      grouped_tile_for<Bits, Group>(r1 - r0, nb)(xp + r0 * ldx, ldx, w, b, bb, op + r0 * n + f, n);
      return;
    }
    thread_local std::vector<float> widened;
    widened.resize(kTileBlocks * k * kBlock);
    if (nb == 2) {
      widen_blocks<2, Bits, Group>(w, b, widened.data());
    } else {
      widen_blocks<1, Bits, Group>(w, b, widened.data());
    }
    panel_tiles(xp, ldx, widened.data(), r0, r1, k, nb, bb, op + f, n);
  });
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

// Units of blocks worth a helper's taking (at least kMinUnitBytes of float32 weights), each block handed to block(b).
template <typename Block>
void run_blocks(int64_t k, int64_t blocks, Block&& block) {
  const int64_t block_bytes = k * kBlock * 4;
  const int64_t blocks_per_unit = std::max<int64_t>(1, kMinUnitBytes / std::max<int64_t>(1, block_bytes));
  const int64_t units = (blocks + blocks_per_unit - 1) / blocks_per_unit;
  const std::function<void(int64_t)> body = [&](int64_t unit) {
    for (int64_t b = unit * blocks_per_unit; b < std::min(blocks, (unit + 1) * blocks_per_unit); ++b) block(b);
  };
  tokenloom::WorkSharing::instance().run(units, body);
}

// Every row of x by one block ([K, 16]) in 6-row tiles.
inline void block_tiles(const float* xp, int64_t ldx, const float* block, int64_t m, int64_t k, const float* bias,
                        float* y, int64_t n) {
  for (int64_t r = 0; r < m; r += kTileRows) {
    tile_for(std::min<int64_t>(kTileRows, m - r))(xp + r * ldx, ldx, block, k, bias, y + r * n, n);
  }
}

// Every row of x by every block of the weight.
void linear_avx2(const float* xp, int64_t ldx, const float* wp, int64_t m, int64_t k, int64_t blocks,
                 const float* bias_data, float* op) {
  const int64_t n = blocks * kBlock;
  run_blocks(k, blocks, [&](int64_t b) {
    const int64_t f = b * kBlock;
    block_tiles(xp, ldx, wp + b * k * kBlock, m, k, bias_data ? bias_data + f : nullptr, op + f, n);
  });
}

// gguf_linear with AVX2: a block's 16 features in two vectors of 8, as tile's.
constexpr int64_t kGroupedRows8 = 4;  // rows widened in registers

// Inputs 2p and 2p + 1 of group g of block b, features 0-7 and 8-15, as float32: codes * scale + offset.
template <int Bits, int Group>
inline void widen_pair8(const GroupedWeight& w, int64_t b, int64_t g, int p, const __m256* scale,
                        const __m256* offset, __m256* even, __m256* odd) {
  const uint8_t* group = w.codes + (b * w.groups + g) * kGroupBytes<Bits, Group>;
  for (int half = 0; half < 2; ++half) {
    if constexpr (Bits == 4) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(group + p * 16 + 8 * half));
      const __m256i pairs = _mm256_cvtepu8_epi32(bytes);
      const __m256 low = _mm256_cvtepi32_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(0xF)));
      even[half] = _mm256_fmadd_ps(low, scale[half], offset[half]);
      odd[half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(pairs, 4)), scale[half], offset[half]);
    } else {
      static_assert(Bits == 8, "4- or 8-bit codes");
      const uint8_t* at = group + p * 32 + 8 * half;
      const __m256 first =
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(at))));
      const __m256 second =
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(at + 16))));
      even[half] = _mm256_fmadd_ps(first, scale[half], offset[half]);
      odd[half] = _mm256_fmadd_ps(second, scale[half], offset[half]);
    }
  }
}

// Group g's scales and offsets of block b, features 0-7 and 8-15.
inline void group_terms8(const GroupedWeight& w, int64_t b, int64_t g, __m256* scale, __m256* offset) {
  for (int half = 0; half < 2; ++half) {
    scale[half] = _mm256_loadu_ps(w.scales + (b * w.groups + g) * kBlock + 8 * half);
    offset[half] = _mm256_loadu_ps(w.offsets + (b * w.groups + g) * kBlock + 8 * half);
  }
}

// Block b's inputs two at a time, widened: use(i, even, odd) for inputs i and i + 1, features 0-7 and 8-15 of each.
template <int Bits, int Group, typename Use>
inline void for_each_pair8(const GroupedWeight& w, int64_t b, Use&& use) {
  for (int64_t g = 0; g < w.groups; ++g) {
    __m256 scale[2], offset[2];
    group_terms8(w, b, g, scale, offset);
    for (int p = 0; p < Group / 2; ++p) {
      __m256 even[2], odd[2];
      widen_pair8<Bits, Group>(w, b, g, p, scale, offset, even, odd);
      use(g * Group + 2 * p, even, odd);
    }
  }
}

// Block b widened into `dst` as f32_pack_weight lays it out ([K][16]).
template <int Bits, int Group>
void widen_block8(const GroupedWeight& w, int64_t b, float* dst) {
  for_each_pair8<Bits, Group>(w, b, [&](int64_t i, const __m256* even, const __m256* odd) {
    for (int half = 0; half < 2; ++half) {
      _mm256_storeu_ps(dst + i * kBlock + 8 * half, even[half]);
      _mm256_storeu_ps(dst + (i + 1) * kBlock + 8 * half, odd[half]);
    }
  });
}

// tile for R rows (at most kGroupedRows8) of block b of a grouped weight, each pair of inputs widened in registers.
template <int R, int Bits, int Group>
void grouped_tile8(const float* x, int64_t ldx, const GroupedWeight& w, int64_t b, const float* bias, float* y,
                   int64_t ldy) {
  __m256 low[R], high[R];
  for (int r = 0; r < R; ++r) low[r] = high[r] = _mm256_setzero_ps();
  for_each_pair8<Bits, Group>(w, b, [&](int64_t i, const __m256* even, const __m256* odd) {
    for (int r = 0; r < R; ++r) {
      const __m256 first = _mm256_broadcast_ss(x + r * ldx + i), second = _mm256_broadcast_ss(x + r * ldx + i + 1);
      low[r] = _mm256_fmadd_ps(first, even[0], low[r]);
      high[r] = _mm256_fmadd_ps(first, even[1], high[r]);
      low[r] = _mm256_fmadd_ps(second, odd[0], low[r]);
      high[r] = _mm256_fmadd_ps(second, odd[1], high[r]);
    }
  });
  const __m256 b0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  const __m256 b1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(y + r * ldy, _mm256_add_ps(low[r], b0));
    _mm256_storeu_ps(y + r * ldy + 8, _mm256_add_ps(high[r], b1));
  }
}

using GroupedTileFn8 = void (*)(const float*, int64_t, const GroupedWeight&, int64_t, const float*, float*, int64_t);

// linear_avx2's units over a grouped weight: up to 4 rows widen in registers (3 and 4 rows 1.3-1.6x faster so than
// over the buffer, with an AVX2 build on an AVX-512 Xeon); more widen each block once into a buffer of this thread's
// and run tile over it.
template <int Bits, int Group>
void grouped_linear_avx2(const float* xp, int64_t ldx, const GroupedWeight& w, int64_t m, int64_t blocks,
                         const float* bias, float* op) {
  const int64_t k = w.groups * Group, n = blocks * kBlock;
  run_blocks(k, blocks, [&](int64_t b) {
    const int64_t f = b * kBlock;
    const float* bb = bias ? bias + f : nullptr;
    if (m <= kGroupedRows8) {
      static constexpr std::array<GroupedTileFn8, 4> tiles = {
          &grouped_tile8<1, Bits, Group>, &grouped_tile8<2, Bits, Group>, &grouped_tile8<3, Bits, Group>,
          &grouped_tile8<4, Bits, Group>};
      tiles[m - 1](xp, ldx, w, b, bb, op + f, n);
      return;
    }
    thread_local std::vector<float> widened;
    widened.resize(k * kBlock);
    widen_block8<Bits, Group>(w, b, widened.data());
    block_tiles(xp, ldx, widened.data(), m, k, bb, op + f, n);
  });
}
#endif  // !__AVX512F__

// A linear's input rows (float32 [M, K], rows of unit stride) checked, and its bias's data (float32 [N], or none).
const float* checked_inputs(const char* op, const at::Tensor& x, const std::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1, op,
              ": x must be float32 [M, K] with rows of unit stride");
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n, op,
              ": bias must be float32 [N]");
  return bias->const_data_ptr<float>();
}

// x [M, K] float32 (rows of unit stride), a weight from f32_pack_weight [N / 16, K x 16], bias [N] or none -> [M, N].
at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.scalar_type() == at::kFloat && packed.dim() == 2 && packed.is_contiguous(),
              "f32_linear: the weight must be a contiguous float32 [N / 16, K x 16] from f32_pack_weight");
  const int64_t m = x.size(0), k = x.size(1), blocks = packed.size(0), n = blocks * kBlock;
  const float* bias_data = checked_inputs("f32_linear", x, bias, n);
  TORCH_CHECK(packed.size(1) == k * kBlock, "f32_linear: the weight's K is not x's");
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

// gguf_linear's weight, in the instantiation its layout calls for: (Bits, Group) = (4, 32), (8, 32) or (8, 16).
template <typename Run>
void with_format(int64_t group, int64_t bits, Run&& run) {
  if (group == 32 && bits == 4) {
    run(std::integral_constant<int, 4>{}, std::integral_constant<int, 32>{});
  } else if (group == 32 && bits == 8) {
    run(std::integral_constant<int, 8>{}, std::integral_constant<int, 32>{});
  } else {
    TORCH_CHECK(group == 16 && bits == 8,
                "gguf_linear: codes must be 4 bits in groups of 32 inputs or 8 bits in groups of 32 or 16");
    run(std::integral_constant<int, 8>{}, std::integral_constant<int, 16>{});
  }
}

// x [M, K] float32 (rows of unit stride), a grouped weight from gguf_pack_weight (codes [N / 16, K / G, G, 16 x bits
// / 8] uint8 for G inputs a group; scales and offsets [N / 16, K / G, 16] float32), bias [N] or none -> [M, N].
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       const at::Tensor& offsets, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 4 && codes.is_contiguous() &&
                  (codes.size(3) == kBlock / 2 || codes.size(3) == kBlock),
              "gguf_linear: codes must be contiguous uint8 [N / 16, K / G, G, 16 x bits / 8] from gguf_pack_weight");
  const int64_t m = x.size(0), blocks = codes.size(0), groups = codes.size(1), n = blocks * kBlock;
  const int64_t group = codes.size(2), bits = codes.size(3) * 8 / kBlock;
  const float* bias_data = checked_inputs("gguf_linear", x, bias, n);
  TORCH_CHECK(x.size(1) == groups * group, "gguf_linear: the weight's K is not x's");
  for (const at::Tensor* t : {&scales, &offsets}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 && t->size(0) == blocks &&
                    t->size(1) == groups && t->size(2) == kBlock,
                "gguf_linear: scales and offsets must be contiguous float32 [N / 16, K / G, 16]");
  }
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return out;
  const GroupedWeight w{codes.const_data_ptr<uint8_t>(), scales.const_data_ptr<float>(),
                        offsets.const_data_ptr<float>(), groups};
  const float* xp = x.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  with_format(group, bits, [&](auto width, auto size) {
#if defined(__AVX512F__)
    grouped_linear_avx512<decltype(width)::value, decltype(size)::value>(xp, x.stride(0), w, m, blocks, bias_data, op);
#else
    grouped_linear_avx2<decltype(width)::value, decltype(size)::value>(xp, x.stride(0), w, m, blocks, bias_data, op);
#endif
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloom, m) { m.def("f32_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor"); }

TORCH_LIBRARY_IMPL(tokenloom, CPU, m) { m.impl("f32_linear", &f32_linear); }

TORCH_LIBRARY_FRAGMENT(tokenloom, m) {
  m.def("gguf_linear(Tensor x, Tensor codes, Tensor scales, Tensor offsets, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenloom, CPU, m) { m.impl("gguf_linear", &gguf_linear); }

#endif  // AVX2 and FMA
