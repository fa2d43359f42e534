// int8 linears for steps of a few rows, on CPUs with AVX-512 VNNI: tokenloom::int8_pack_weight and
// tokenloom::int8_linear (--quantization int8, quantization.py).
//
// Why: at 1-12 rows oneDNN's int8 matmul took longer than the whole bf16 linear on our own kernel
// (bf16_linear.cpp), so int8 weights halved batch-1 decode instead of speeding it up. A decode step reads each weight
// once; int8 codes are half the bytes of bf16, and `vpdpbusd` multiplies 64 byte pairs per instruction.
//
// The weight's codes are packed for `vpdpbusd` (unsigned x signed bytes): for each block of 16 output features, the
// K inputs in groups of 4, 16 features x 4 inputs to a 64-byte vector. The activations' codes (signed, from
// quantize_rows_int8) are shifted by +128 to unsigned; the shift's share, 128 x the sum of a feature's codes, is
// taken back from the int32 sum, so the sum is exact. Then, as the oneDNN path scales it (sum x the feature's scale,
// then x the row's scale plus the bias, fused), bit for bit: a request's output does not depend on which path its
// step took.

#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <string>

#include "bf16_vec.h"
#include "int8_epilogue.h"
#include "int8_packing.h"
#include "work_sharing.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

constexpr int kBlock = tokenloom::kInt8Block;  // output features per packed block
constexpr int kGroup = tokenloom::kInt8Group;  // inputs per group
constexpr int kRows = 4;    // rows of a register tile
constexpr int kBlocks = 4;  // feature blocks of a register tile: 16 int32 accumulators
constexpr int64_t kMinUnitBytes = 32 * 1024;

struct Scales {
  const float* rows;     // [M]
  const float* weights;  // [N]
  const int32_t* sums;   // [N]: each feature's code sum
  const float* bias;     // [N] or null
};

// Rows x Blocks outputs from unsigned activation codes xu [Rows, K] (row stride k) and Blocks packed blocks;
// gated, the blocks alternate gate and up and the tile writes Blocks / 2 blocks of silu(gate) x up.
template <int Rows, int Blocks, bool Gated, typename T>
void tile(const uint8_t* xu, int64_t k, const __m512i* w, int64_t groups, const Scales& s, int64_t feature, T* out,
          int64_t ldo) {
  static_assert(!Gated || Blocks % 2 == 0, "a gated tile holds gate and up blocks in pairs");
  __m512i acc[Rows][Blocks];
  for (int r = 0; r < Rows; ++r) {
    for (int b = 0; b < Blocks; ++b) acc[r][b] = _mm512_setzero_si512();
  }
  for (int64_t g = 0; g < groups; ++g) {
    __m512i wv[Blocks];
    for (int b = 0; b < Blocks; ++b) wv[b] = _mm512_loadu_si512(w + b * groups + g);
    for (int r = 0; r < Rows; ++r) {
      int32_t four;
      std::memcpy(&four, xu + r * k + g * kGroup, sizeof(four));
      const __m512i xv = _mm512_set1_epi32(four);
      for (int b = 0; b < Blocks; ++b) acc[r][b] = _mm512_dpbusd_epi32(acc[r][b], xv, wv[b]);
    }
  }
  __m512i shift[Blocks];
  __m512 weight_scale[Blocks], bias[Blocks];
  for (int b = 0; b < Blocks; ++b) {
    const int64_t f = feature + b * kBlock;
    shift[b] = _mm512_slli_epi32(_mm512_loadu_si512(s.sums + f), 7);  // 128 x the code sum
    weight_scale[b] = _mm512_loadu_ps(s.weights + f);
    bias[b] = s.bias ? _mm512_loadu_ps(s.bias + f) : _mm512_setzero_ps();
  }
  for (int r = 0; r < Rows; ++r) {
    const __m512 row_scale = _mm512_set1_ps(s.rows[r]);
    __m512 y[Blocks];
    for (int b = 0; b < Blocks; ++b) {
      y[b] = tokenloom::scale_sums(_mm512_sub_epi32(acc[r][b], shift[b]), weight_scale[b], row_scale, bias[b]);
    }
    if constexpr (Gated) {
      for (int b = 0; b < Blocks / 2; ++b) {
        tokenloom::store16(out + r * ldo + b * kBlock, tokenloom::silu_times(y[2 * b], y[2 * b + 1]));
      }
    } else {
      for (int b = 0; b < Blocks; ++b) tokenloom::store16(out + r * ldo + b * kBlock, y[b]);
    }
  }
}

template <typename T>
using TileFn = void (*)(const uint8_t*, int64_t, const __m512i*, int64_t, const Scales&, int64_t, T*, int64_t);

template <int Rows, bool Gated, typename T>
TileFn<T> tile_for_blocks(int blocks) {
  if constexpr (Gated) {
    return blocks == 2 ? &tile<Rows, 2, true, T> : &tile<Rows, 4, true, T>;
  } else {
    switch (blocks) {
      case 1: return &tile<Rows, 1, false, T>;
      case 2: return &tile<Rows, 2, false, T>;
      case 3: return &tile<Rows, 3, false, T>;
      default: return &tile<Rows, 4, false, T>;
    }
  }
}

template <bool Gated, typename T>
TileFn<T> tile_for(int rows, int blocks) {
  switch (rows) {
    case 1: return tile_for_blocks<1, Gated, T>(blocks);
    case 2: return tile_for_blocks<2, Gated, T>(blocks);
    case 3: return tile_for_blocks<3, Gated, T>(blocks);
    default: return tile_for_blocks<4, Gated, T>(blocks);
  }
}

// codes [M, K] int8 (rows contiguous), row_scales [M, 1] float32, a weight from int8_pack_weight with its code sums
// and scales [N] float32, bias [N] or none -> [M, N] in out_dtype (float32 or bfloat16); gated (the features
// [gate; up] interleaved per 16): [M, N / 2], silu(gate) x up.
at::Tensor int8_linear(const at::Tensor& codes, const at::Tensor& row_scales, const at::Tensor& packed,
                       const at::Tensor& code_sums, const at::Tensor& weight_scales,
                       const std::optional<at::Tensor>& bias, at::ScalarType out_dtype, bool gated) {
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.dim() == 2 && codes.is_contiguous(),
              "int8_linear: codes must be contiguous int8 [M, K]");
  const int64_t m = codes.size(0), k = codes.size(1), blocks = packed.size(0), n = blocks * kBlock;
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous() && packed.size(1) == k * kBlock,
              "int8_linear: a weight from int8_pack_weight with the codes' K");
  TORCH_CHECK(code_sums.scalar_type() == at::kInt && code_sums.numel() == n, "int8_linear: code sums int32 [N]");
  const at::Tensor bias_f =
      tokenloom::checked_scales_and_bias("int8_linear", row_scales, m, weight_scales, n, bias, out_dtype);
  TORCH_CHECK(!gated || blocks % 2 == 0, "int8_linear: a gated weight has gate and up blocks in pairs");
  const int64_t width = gated ? n / 2 : n;
  at::Tensor out = at::empty({m, width}, codes.options().dtype(out_dtype));
  if (m == 0) return out;
  at::Tensor shifted = at::empty({m, k}, codes.options().dtype(at::kByte));  // codes + 128, as unsigned bytes
  const int8_t* c = codes.const_data_ptr<int8_t>();
  uint8_t* u = shifted.mutable_data_ptr<uint8_t>();
  for (int64_t i = 0; i < m * k; ++i) u[i] = static_cast<uint8_t>(c[i] + 128);
  const Scales scales{row_scales.const_data_ptr<float>(), weight_scales.const_data_ptr<float>(),
                      code_sums.const_data_ptr<int32_t>(), bias_f.defined() ? bias_f.const_data_ptr<float>() : nullptr};
  const auto* wp = reinterpret_cast<const __m512i*>(packed.const_data_ptr<int8_t>());
  const int64_t groups = k / kGroup;
  const int64_t block_bytes = k * kBlock;
  const int64_t tiles_per_unit = std::max<int64_t>(1, kMinUnitBytes / (block_bytes * kBlocks));
  const int64_t blocks_per_unit = tiles_per_unit * kBlocks;
  const int64_t units = (blocks + blocks_per_unit - 1) / blocks_per_unit;
  auto run = [&](auto* op) {
    using T = std::remove_pointer_t<decltype(op)>;
    const std::function<void(int64_t)> body = [&](int64_t unit) {
      const int64_t b0 = unit * blocks_per_unit, b1 = std::min(blocks, b0 + blocks_per_unit);
      for (int64_t b = b0; b < b1; b += kBlocks) {
        const int nb = static_cast<int>(std::min<int64_t>(kBlocks, b1 - b));
        for (int64_t r = 0; r < m; r += kRows) {
          const int nr = static_cast<int>(std::min<int64_t>(kRows, m - r));
          Scales at_rows = scales;
          at_rows.rows += r;
          T* at = op + r * width + (gated ? b / 2 : b) * kBlock;
          const auto fn = gated ? tile_for<true, T>(nr, nb) : tile_for<false, T>(nr, nb);
          fn(u + r * k, k, wp + b * groups, groups, at_rows, b * kBlock, at, width);
        }
      }
    };
    tokenloom::WorkSharing::instance().run(units, body);
  };
  tokenloom::with_output_data(out, run);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloom, m) {
  tokenloom::define_int8_linear_ops(m);
  m.def("int8_linear_isa() -> str", []() -> std::string { return "avx512_vnni"; });
}

TORCH_LIBRARY_IMPL(tokenloom, CPU, m) {
  m.impl("int8_pack_weight", &tokenloom::int8_pack_weight);
  m.impl("int8_linear", &int8_linear);
}

#endif  // __AVX512VNNI__
