// int8 linears on CPUs with AVX-512 VNNI: tokenloom::int8_pack_weight and tokenloom::int8_linear
// (--quantization int8 | int8_w8a16, quantization.py): steps of a few rows where the CPU has AMX (larger ones take
// amx_int8_linear.cpp), every step where it has not.
//
// Why: at 1-12 rows oneDNN's int8 matmul took longer than the whole bf16 linear on our own kernel
// (bf16_linear.cpp), so int8 weights halved batch-1 decode instead of speeding it up; and on an AMD CPU with VNNI
// but no AMX oneDNN ran its reference loops at every size. A decode step reads each weight once; int8 codes are half
// the bytes of bf16, and `vpdpbusd` multiplies 64 byte pairs per instruction.
//
// The weight's codes are packed for `vpdpbusd` (unsigned x signed bytes): for each block of 16 output features, the
// K inputs in groups of 4, 16 features x 4 inputs to a 64-byte vector. The activations' int8 codes are shifted by
// +128 to unsigned (by quantize_rows_int8 as it makes them, with shifted=True; signed ones here, in a pass of its
// own); the shift's share, 128 x the sum of a feature's codes, is taken back from the int32 sum, so the sum is
// exact. 16-bit codes (quantize_rows_int16) multiply the same packing, sign-extended, by `vpdpwssd` (32 word pairs
// an instruction: half the rate, activations about as fine as float's).
// Then, as the oneDNN path scales it (sum x the feature's scale, then x the row's scale plus the bias, fused), bit
// for bit: a request's output does not depend on which path its step took.
//
// On a CPU without AMX this kernel runs every step, and int8 codes come with one scale per 64 inputs of a row (the
// rotation's block; quantize_rows_int8 with a group): each group's exact int32 sum, its shift's share taken back,
// is turned to float32 and times the group's scale, then the groups' sum times the feature's scale plus the bias.
// Why: with one scale a row SmolLM2-135M's top-1 agreement with float32 was 96.0-96.4% in bf16, below the 97%
// asked of int8 weights; with a scale per 64 inputs it is 97.6% (RESULTS.md), at ~1.1-1.2x the per-row kernel's
// time on large steps and ~1.05x at 1-2 rows.

#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <type_traits>

#include "bf16_vec.h"
#include "int8_epilogue.h"
#include "int8_packing.h"
#include "vnni_asm.h"
#include "work_sharing.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>

namespace {

constexpr int kBlock = tokenloom::kInt8Block;  // output features per packed block
constexpr int kGroup = tokenloom::kInt8Group;  // inputs per group
constexpr int kScaleGroup = tokenloom::kInt8ScaleGroup;  // inputs per activation scale, in grouped steps
constexpr int64_t kMinUnitBytes = 32 * 1024;
constexpr int64_t kChunkRows = 128;  // rows whose codes stay in L2 while a unit's blocks pass over them

// Register tiles of rows x feature blocks, 16 int32 accumulators (16-bit codes sum each block in two halves). A
// step of few rows (decode, bound by the weight's bytes) keeps four blocks' weights in flight: 4 x 4 tiles on int8
// codes, 2 x 4 on 16-bit ones. Larger steps on int8 codes take 8 x 2 tiles, which load half the weight vectors per
// `vpdpbusd`: on a Zen 4 they ran the decoder's shapes at 64-1,024 rows 1.2-1.6x faster than 4 x 4 (6 x 4, 4 x 6,
// 10 x 2 and 12 x 2 were slower than either; on the Zen 5 measured before, 6 x 4 and 8 x 3 were no faster than
// 4 x 4; RESULTS.md). Larger 16-bit steps take 4 x 2. Every multiply goes through vnni_asm.h, and every loop over
// a tile's rows or blocks is unrolled: so GCC keeps the accumulators in registers, uncopied (on a Zen 4 the
// decoder's four linears then ran 1.07-1.24x faster at 4-1,024 rows, the same at 1-3; RESULTS.md).
// Grouped steps (int8 codes with a scale per 64 inputs) hold a float32 sum beside each int32 accumulator, so they
// take fewer rows: 2 x 4 and 4 x 2 (on a Zen 4, 4 x 2 ran 1.08-1.20x the per-token 8 x 2's time at 64-2,048 rows;
// 5, 6 and 8 rows 1.12-1.28x).
template <typename Code, bool Few, bool Grouped>
struct TileShape {
  static constexpr bool kWide = std::is_same_v<Code, int16_t>;
  static constexpr int kRows = Few ? (kWide || Grouped ? 2 : 4) : (kWide || Grouped ? 4 : 8);
  static constexpr int kBlocks = Few ? 4 : 2;
};
constexpr int64_t kFewRows = 8;  // int8 steps of fewer rows take the few-row tiles

using tokenloom::dpbusd;
using tokenloom::dpwssd;

struct Scales {
  const float* rows;     // [M, groups]
  const float* weights;  // [N]
  const int32_t* sums;   // [N]: each feature's code sum; grouped, [N / 16, groups, 16], over each group of inputs
  const float* bias;     // [N] or null
  int64_t groups;        // scales per row: 1, or one per kScaleGroup inputs
};

// The int32 sums of Rows x Blocks x 16 outputs from unsigned activation codes xu [Rows, K] (row stride k), each
// 4 of them times a packed 64-byte group by `vpdpbusd`, over the groups [g0, g1) of `groups`, added to acc; the +128
// shift's share is still in them.
template <int Rows, int Blocks>
void sums_of(const uint8_t* xu, int64_t k, const __m512i* w, int64_t groups, int64_t g0, int64_t g1,
             __m512i (&acc)[Rows][Blocks]) {
  for (int64_t g = g0; g < g1; ++g) {
    __m512i wv[Blocks];
#pragma GCC unroll 16
    for (int b = 0; b < Blocks; ++b) wv[b] = _mm512_loadu_si512(w + b * groups + g);
#pragma GCC unroll 16
    for (int r = 0; r < Rows; ++r) {
      int32_t four;
      std::memcpy(&four, xu + r * k + g * kGroup, sizeof(four));
      const __m512i xv = _mm512_set1_epi32(four);
#pragma GCC unroll 16
      for (int b = 0; b < Blocks; ++b) dpbusd(acc[r][b], xv, wv[b]);
    }
  }
}

// The same from 16-bit codes x (quantize_rows_int16), by `vpdpwssd`: a 64-byte group is two halves of 8 features x
// 4 inputs, each sign-extended to 32 words; times the row's 4 codes, broadcast, a half's lanes 2f and 2f + 1 hold
// feature f's two pair sums, which the end adds into acc's place (acc's earlier values are not kept). Exact: the
// codes are small enough that no sum leaves int32.
template <int Rows, int Blocks>
void sums_of(const int16_t* x, int64_t k, const __m512i* w, int64_t groups, int64_t g0, int64_t g1,
             __m512i (&acc)[Rows][Blocks]) {
  __m512i pairs[Rows][Blocks][2];
#pragma GCC unroll 16
  for (int r = 0; r < Rows; ++r) {
#pragma GCC unroll 16
    for (int b = 0; b < Blocks; ++b) pairs[r][b][0] = pairs[r][b][1] = _mm512_setzero_si512();
  }
  const auto* halves = reinterpret_cast<const __m256i*>(w);
  for (int64_t g = g0; g < g1; ++g) {
    __m512i wv[Blocks][2];
#pragma GCC unroll 16
    for (int b = 0; b < Blocks; ++b) {
#pragma GCC unroll 16
      for (int h = 0; h < 2; ++h) wv[b][h] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(halves + 2 * (b * groups + g) + h));
    }
#pragma GCC unroll 16
    for (int r = 0; r < Rows; ++r) {
      int64_t four;
      std::memcpy(&four, x + r * k + g * kGroup, sizeof(four));
      const __m512i xv = _mm512_set1_epi64(four);
#pragma GCC unroll 16
      for (int b = 0; b < Blocks; ++b) {
#pragma GCC unroll 16
        for (int h = 0; h < 2; ++h) dpwssd(pairs[r][b][h], xv, wv[b][h]);
      }
    }
  }
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
#pragma GCC unroll 16
  for (int r = 0; r < Rows; ++r) {
#pragma GCC unroll 16
    for (int b = 0; b < Blocks; ++b) {
      const __m512i lo = pairs[r][b][0], hi = pairs[r][b][1];
      acc[r][b] = _mm512_add_epi32(_mm512_permutex2var_epi32(lo, even, hi), _mm512_permutex2var_epi32(lo, odd, hi));
    }
  }
}

// The float32 sums of Rows x Blocks x 16 outputs from unsigned activation codes with one scale per kScaleGroup inputs
// of a row (quantize_rows_int8 with a group): each group's exact int32 sums, less the +128 shift's share over the
// group, times the row's scale for the group.
template <int Rows, int Blocks>
void grouped_sums_of(const uint8_t* xu, int64_t k, const __m512i* w, int64_t groups, const Scales& s,
                     int64_t feature, __m512 (&total)[Rows][Blocks]) {
  constexpr int64_t steps = kScaleGroup / kGroup;
#pragma GCC unroll 16
  for (int r = 0; r < Rows; ++r) {
#pragma GCC unroll 16
    for (int b = 0; b < Blocks; ++b) total[r][b] = _mm512_setzero_ps();
  }
  for (int64_t sg = 0; sg < s.groups; ++sg) {
    __m512i acc[Rows][Blocks];
#pragma GCC unroll 16
    for (int b = 0; b < Blocks; ++b) {
      // minus 128 x the group's code sum: the shift's share, taken back before any product is added
      const int32_t* sums = s.sums + ((feature / kBlock + b) * s.groups + sg) * kBlock;
      const __m512i start = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(_mm512_loadu_si512(sums), 7));
#pragma GCC unroll 16
      for (int r = 0; r < Rows; ++r) acc[r][b] = start;
    }
    sums_of<Rows, Blocks>(xu, k, w, groups, sg * steps, (sg + 1) * steps, acc);
#pragma GCC unroll 16
    for (int r = 0; r < Rows; ++r) {
      const __m512 row_scale = _mm512_set1_ps(s.rows[r * s.groups + sg]);
#pragma GCC unroll 16
      for (int b = 0; b < Blocks; ++b) {
        total[r][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][b]), row_scale, total[r][b]);
      }
    }
  }
}

// Rows x Blocks outputs from activation codes x [Rows, K] (unsigned-shifted int8, or 16-bit) and Blocks packed
// blocks; gated, the blocks alternate gate and up and the tile writes Blocks / 2 blocks of silu(gate) x up.
// Grouped: the int8 codes carry a scale per kScaleGroup inputs (Scales::groups of them a row).
template <typename Code, int Rows, int Blocks, bool Gated, bool Grouped, typename T>
void tile(const Code* x, int64_t k, const __m512i* w, int64_t groups, const Scales& s, int64_t feature, T* out,
          int64_t ldo) {
  static_assert(!Gated || Blocks % 2 == 0, "a gated tile holds gate and up blocks in pairs");
  static_assert(!Grouped || std::is_same_v<Code, uint8_t>, "group scales are for int8 codes");
  __m512i acc[Rows][Blocks];
  __m512 total[Rows][Blocks];
  if constexpr (Grouped) {
    grouped_sums_of<Rows, Blocks>(x, k, w, groups, s, feature, total);
  } else {
#pragma GCC unroll 16
    for (int r = 0; r < Rows; ++r) {
#pragma GCC unroll 16
      for (int b = 0; b < Blocks; ++b) acc[r][b] = _mm512_setzero_si512();
    }
    sums_of<Rows, Blocks>(x, k, w, groups, 0, groups, acc);
  }
  __m512i shift[Blocks];
  __m512 weight_scale[Blocks], bias[Blocks];
#pragma GCC unroll 16
  for (int b = 0; b < Blocks; ++b) {
    const int64_t f = feature + b * kBlock;
    // 128 x the code sum, for the unsigned shift of int8 codes
    shift[b] = std::is_same_v<Code, uint8_t> && !Grouped ? _mm512_slli_epi32(_mm512_loadu_si512(s.sums + f), 7)
                                                         : _mm512_setzero_si512();
    weight_scale[b] = _mm512_loadu_ps(s.weights + f);
    bias[b] = s.bias ? _mm512_loadu_ps(s.bias + f) : _mm512_setzero_ps();
  }
#pragma GCC unroll 16
  for (int r = 0; r < Rows; ++r) {
    __m512 y[Blocks];
    if constexpr (Grouped) {
#pragma GCC unroll 16
      for (int b = 0; b < Blocks; ++b) y[b] = tokenloom::scale_sums(total[r][b], weight_scale[b], bias[b]);
    } else {
      const __m512 row_scale = _mm512_set1_ps(s.rows[r]);
#pragma GCC unroll 16
      for (int b = 0; b < Blocks; ++b) {
        y[b] = tokenloom::scale_sums(_mm512_sub_epi32(acc[r][b], shift[b]), weight_scale[b], row_scale, bias[b]);
      }
    }
    if constexpr (Gated) {
#pragma GCC unroll 16
      for (int b = 0; b < Blocks / 2; ++b) {
        tokenloom::store16(out + r * ldo + b * kBlock, tokenloom::silu_times(y[2 * b], y[2 * b + 1]));
      }
    } else {
#pragma GCC unroll 16
      for (int b = 0; b < Blocks; ++b) tokenloom::store16(out + r * ldo + b * kBlock, y[b]);
    }
  }
}

template <typename Code, typename T>
using TileFn = void (*)(const Code*, int64_t, const __m512i*, int64_t, const Scales&, int64_t, T*, int64_t);

// The tile for a remainder of rows or blocks: the largest shape that fits them (gated blocks come in pairs).
template <typename Code, int Rows, bool Gated, bool Grouped, typename T, int Blocks>
TileFn<Code, T> tile_for_blocks(int blocks) {
  constexpr int step = Gated ? 2 : 1;
  if constexpr (Blocks > step) {
    if (blocks < Blocks) return tile_for_blocks<Code, Rows, Gated, Grouped, T, Blocks - step>(blocks);
  }
  return &tile<Code, Rows, Blocks, Gated, Grouped, T>;
}

template <typename Code, bool Gated, bool Grouped, typename T, int Rows, int Blocks>
TileFn<Code, T> tile_for(int rows, int blocks) {
  if constexpr (Rows > 1) {
    if (rows < Rows) return tile_for<Code, Gated, Grouped, T, Rows - 1, Blocks>(rows, blocks);
  }
  return tile_for_blocks<Code, Rows, Gated, Grouped, T, Blocks>(blocks);
}

// out [M, width] from codes x [M, K] (rows contiguous): units of up to kChunkRows rows by enough feature blocks that
// their weights are worth a thread's start; a unit's rows run in tiles over each of its blocks while it is in L1.
template <typename Code, bool Gated, bool Few, bool Grouped>
void run_tiles(const Code* x, int64_t m, int64_t k, const __m512i* wp, int64_t blocks, const Scales& scales,
               at::Tensor& out) {
  const int64_t groups = k / kGroup, block_bytes = k * kBlock, width = out.size(1);
  constexpr int tile_blocks = TileShape<Code, Few, Grouped>::kBlocks;
  constexpr int tile_rows = TileShape<Code, Few, Grouped>::kRows;
  const int64_t tiles_per_unit = std::max<int64_t>(1, kMinUnitBytes / (block_bytes * tile_blocks));
  const int64_t blocks_per_unit = tiles_per_unit * tile_blocks;
  const int64_t block_units = (blocks + blocks_per_unit - 1) / blocks_per_unit;
  const int64_t chunks = (m + kChunkRows - 1) / kChunkRows;
  auto run = [&](auto* op) {
    using T = std::remove_pointer_t<decltype(op)>;
    const std::function<void(int64_t)> body = [&](int64_t unit) {
      const int64_t r0 = (unit / block_units) * kChunkRows, r1 = std::min(m, r0 + kChunkRows);
      const int64_t b0 = (unit % block_units) * blocks_per_unit, b1 = std::min(blocks, b0 + blocks_per_unit);
      for (int64_t b = b0; b < b1; b += tile_blocks) {
        const int nb = static_cast<int>(std::min<int64_t>(tile_blocks, b1 - b));
        for (int64_t r = r0; r < r1; r += tile_rows) {
          const int nr = static_cast<int>(std::min<int64_t>(tile_rows, r1 - r));
          Scales at_rows = scales;
          at_rows.rows += r * scales.groups;
          T* at = op + r * width + (Gated ? b / 2 : b) * kBlock;
          const auto fn = tile_for<Code, Gated, Grouped, T, tile_rows, tile_blocks>(nr, nb);
          fn(x + r * k, k, wp + b * groups, groups, at_rows, b * kBlock, at, width);
        }
      }
    };
    tokenloom::WorkSharing::instance().run(chunks * block_units, body);
  };
  tokenloom::with_output_data(out, run);
}

// codes [M, K] int8 (or uint8: int8 + 128, as quantize_rows_int8 shifts them for this kernel), or int16 small enough
// that 127 x K x their largest |code| fits int32 (rows contiguous),
// row_scales [M, 1] float32, a weight from int8_pack_weight with its code sums and scales [N] float32, bias [N] or
// none -> [M, N] in out_dtype (float32 or bfloat16); gated (the features [gate; up] interleaved per 16): [M, N / 2],
// silu(gate) x up. Grouped int8 codes (quantize_rows_int8 with a group of 64) come with row_scales [M, K / 64] and
// code_sums [N / 16, K / 64, 16], each feature's code sum over each group, a block's groups together
// (quantization.group_code_sums).
at::Tensor int8_linear(const at::Tensor& codes, const at::Tensor& row_scales, const at::Tensor& packed,
                       const at::Tensor& code_sums, const at::Tensor& weight_scales,
                       const std::optional<at::Tensor>& bias, at::ScalarType out_dtype, bool gated) {
  const bool wide = codes.scalar_type() == at::kShort, shifted = codes.scalar_type() == at::kByte;
  TORCH_CHECK((wide || shifted || codes.scalar_type() == at::kChar) && codes.dim() == 2 && codes.is_contiguous(),
              "int8_linear: codes must be contiguous int8, uint8 (int8 + 128) or int16 [M, K]");
  const int64_t m = codes.size(0), k = codes.size(1), blocks = packed.size(0), n = blocks * kBlock;
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous() && packed.size(1) == k * kBlock,
              "int8_linear: a weight from int8_pack_weight with the codes' K");
  const int64_t groups = row_scales.dim() == 2 ? row_scales.size(1) : 1;
  const bool grouped = groups > 1;
  TORCH_CHECK(!grouped || (!wide && groups * kScaleGroup == k),
              "int8_linear: grouped row scales are [M, K / 64], for int8 codes");
  TORCH_CHECK(code_sums.scalar_type() == at::kInt && code_sums.numel() == groups * n && code_sums.is_contiguous(),
              grouped ? "int8_linear: code sums int32 [N / 16, K / 64, 16]" : "int8_linear: code sums int32 [N]");
  const at::Tensor bias_f =
      tokenloom::checked_scales_and_bias("int8_linear", row_scales, m, weight_scales, n, bias, out_dtype, groups);
  TORCH_CHECK(!gated || blocks % 2 == 0, "int8_linear: a gated weight has gate and up blocks in pairs");
  at::Tensor out = at::empty({m, gated ? n / 2 : n}, codes.options().dtype(out_dtype));
  if (m == 0) return out;
  const Scales scales{row_scales.const_data_ptr<float>(), weight_scales.const_data_ptr<float>(),
                      code_sums.const_data_ptr<int32_t>(), bias_f.defined() ? bias_f.const_data_ptr<float>() : nullptr,
                      groups};
  const auto* wp = reinterpret_cast<const __m512i*>(packed.const_data_ptr<int8_t>());
  // few: the step takes its code type's few-row tiles (TileShape)
  auto run = [&](const auto* x, bool few) {
    using Code = std::remove_const_t<std::remove_pointer_t<decltype(x)>>;
    auto with_tiles = [&](auto few_rows, auto by_groups) {
      constexpr bool kFew = decltype(few_rows)::value, kGrouped = decltype(by_groups)::value;
      if (gated) {
        run_tiles<Code, true, kFew, kGrouped>(x, m, k, wp, blocks, scales, out);
      } else {
        run_tiles<Code, false, kFew, kGrouped>(x, m, k, wp, blocks, scales, out);
      }
    };
    auto with_groups = [&](auto few_rows) {
      if constexpr (std::is_same_v<Code, uint8_t>) {
        if (grouped) return with_tiles(few_rows, std::true_type{});
      }
      with_tiles(few_rows, std::false_type{});
    };
    if (few) {
      with_groups(std::true_type{});
    } else {
      with_groups(std::false_type{});
    }
  };
  if (wide) {
    run(codes.const_data_ptr<int16_t>(), m <= 2);
    return out;
  }
  if (shifted) {  // quantize_rows_int8(..., shifted=True) made them unsigned already
    run(codes.const_data_ptr<uint8_t>(), m < kFewRows);
    return out;
  }
  at::Tensor unsigned_codes = at::empty({m, k}, codes.options().dtype(at::kByte));  // codes + 128
  const int8_t* c = codes.const_data_ptr<int8_t>();
  uint8_t* u = unsigned_codes.mutable_data_ptr<uint8_t>();
  for (int64_t i = 0; i < m * k; ++i) u[i] = static_cast<uint8_t>(c[i] + 128);
  run(static_cast<const uint8_t*>(u), m < kFewRows);
  return out;
}

// int8_linear of rows [M, K] in bfloat16 or float32, quantized here (quantize_rows_int8 with signs and group,
// shifted): the two operators a linear of an int8 model takes, in one call. Why: a decode step of one sequence makes
// ~120 of them, and each operator call from Python costs a few microseconds of dispatch and allocation, about as much
// as quantizing a row of 576 inputs.
at::Tensor int8_linear_rows(const at::Tensor& rows, const std::optional<at::Tensor>& signs, int64_t group,
                            const at::Tensor& packed, const at::Tensor& code_sums, const at::Tensor& weight_scales,
                            const std::optional<at::Tensor>& bias, at::ScalarType out_dtype, bool gated) {
  const auto [codes, row_scales] = tokenloom::quantize_rows_int8(rows, signs, group, /*shifted=*/true);
  return int8_linear(codes, row_scales, packed, code_sums, weight_scales, bias, out_dtype, gated);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloom, m) {
  tokenloom::define_int8_linear_ops(m);
  m.def("int8_linear_isa() -> str", []() -> std::string { return "avx512_vnni"; });
  m.def(
      "int8_linear_rows(Tensor rows, Tensor? signs, int group, Tensor packed, Tensor code_sums, Tensor weight_scales, "
      "Tensor? bias, ScalarType out_dtype, bool gated=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenloom, CPU, m) {
  m.impl("int8_pack_weight", &tokenloom::int8_pack_weight);
  m.impl("int8_linear", &int8_linear);
  m.impl("int8_linear_rows", &int8_linear_rows);
}

#endif  // __AVX512VNNI__
