// int8 linears for large steps on CPUs with AMX-INT8: tokenloom::int8_amx_linear (--quantization int8,
// quantization.py).
//
// Why: oneDNN's int8 matmul alone ran 1.6-1.8x the bf16 linear at 512-2,048 rows, but it takes one activation scale
// per tensor, so our per-token scales were applied after it in a second pass over its float32 output, which with
// the activations' quantization cancelled the gain (benchmarks/RESULTS.md, "Where an int8 linear's time goes").
// Here both scales and the bias are applied as each 32 x 32 block of int32 sums leaves the tiles, and the output is
// written once, in the activations' dtype.
//
// The weight is the one int8_linear.cpp packs for VNNI: per 16 output features, the inputs in groups of 4, 16
// features x 4 inputs to 64 bytes. 16 consecutive groups of a feature block are exactly the B operand of
// `tdpbssd` for 64 inputs (16 rows of 4 inputs x 16 features), so one packing serves both kernels. `tdpbssd`
// multiplies signed by signed bytes, so unlike VNNI no shift is taken back. The int32 sums are exact, and they are
// scaled in the order the other paths scale them (sum x the feature's scale, then x the row's scale plus the
// bias, fused): a request's output does not depend on which kernel its step ran on.

#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "amx_tiles.h"
#include "bf16_vec.h"
#include "int8_epilogue.h"

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512BF16__) && defined(__linux__)
#include <immintrin.h>

namespace {

using namespace tokenloom::amx;

constexpr int kTileK = 64;  // inputs per A tile row (bytes)

struct Epilogue {
  const float* row_scales;     // [M]
  const float* weight_scales;  // [N]
  const float* bias;           // [N] or null
};

// The 32 x 32 block of sums for (row, feature block) -> out, `rows` of its rows (the rest pad a short step). Gated,
// the block's two halves are gate and up (16 features each) and it writes their 16 silu(gate) x up.
template <bool Gated, typename T>
void write_block(const int32_t (&sums)[kRows][kBlockFeatures], int rows, int64_t row, int64_t block,
                 const Epilogue& e, T* out, int64_t ldo) {
  __m512 weight_scale[2], bias[2];
  for (int half = 0; half < 2; ++half) {
    const int64_t f = block * kBlockFeatures + half * kFeatures;
    weight_scale[half] = _mm512_loadu_ps(e.weight_scales + f);
    bias[half] = e.bias ? _mm512_loadu_ps(e.bias + f) : _mm512_setzero_ps();
  }
  for (int r = 0; r < rows; ++r) {
    const __m512 row_scale = _mm512_set1_ps(e.row_scales[row + r]);
    __m512 y[2];
    for (int half = 0; half < 2; ++half) {
      const __m512i acc = _mm512_loadu_si512(&sums[r][half * kFeatures]);
      y[half] = tokenloom::scale_sums(acc, weight_scale[half], row_scale, bias[half]);
    }
    T* at = out + (row + r) * ldo;
    if constexpr (Gated) {
      tokenloom::store16(at + block * kFeatures, tokenloom::silu_times(y[0], y[1]));
    } else {
      tokenloom::store16(at + block * kBlockFeatures, y[0]);
      tokenloom::store16(at + block * kBlockFeatures + kFeatures, y[1]);
    }
  }
}

struct SignedBytes {
  static void four() {
    _tile_dpbssd(0, 4, 6);
    _tile_dpbssd(1, 4, 7);
    _tile_dpbssd(2, 5, 6);
    _tile_dpbssd(3, 5, 7);
  }
};

// Tiles 0-3 = the 32 rows of codes at a (row stride k) times feature block `block` (32 features).
inline void accumulate(const int8_t* a, int64_t k, const int8_t* packed, int64_t block) {
  const int64_t half_bytes = k * kFeatures;
  const auto* b0 = reinterpret_cast<const uint8_t*>(packed) + 2 * block * half_bytes;
  accumulate_block<SignedBytes>(reinterpret_cast<const uint8_t*>(a), k, b0, b0 + half_bytes, k / kTileK);
}

template <bool Gated, typename T>
void multiply_rows(const Rows& rows, int64_t k, const int8_t* packed, int64_t first, int64_t last, const Epilogue& e,
                   T* out, int64_t ldo) {
  alignas(64) int32_t sums[kRows][kBlockFeatures];
  const auto* a = reinterpret_cast<const int8_t*>(rows.a);
  for (int64_t block = first; block < last; ++block) {
    for (int64_t r = 0; r < rows.count; r += kRows) {
      accumulate(a + r * k, k, packed, block);
      store_block(sums);
      write_block<Gated>(sums, static_cast<int>(std::min<int64_t>(kRows, rows.count - r)), rows.row + r, block, e,
                         out, ldo);
    }
  }
}

bool int8_amx_available() { return tiles_permitted(); }

// codes [M, K] int8 (rows contiguous; K a multiple of 64), row_scales [M, 1] float32, a weight from
// int8_pack_weight (N a multiple of 32) with its scales [N] float32, bias [N] or none -> [M, N] in out_dtype; gated
// (the weight's features [gate; up] interleaved per 16): [M, N / 2], silu(gate) x up.
at::Tensor int8_amx_linear(const at::Tensor& codes, const at::Tensor& row_scales, const at::Tensor& packed,
                           const at::Tensor& weight_scales, const std::optional<at::Tensor>& bias,
                           at::ScalarType out_dtype, bool gated) {
  TORCH_CHECK(tiles_permitted(), "int8_amx_linear: the kernel did not grant this process the AMX tiles");
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.dim() == 2 && codes.is_contiguous(),
              "int8_amx_linear: codes must be contiguous int8 [M, K]");
  const int64_t m = codes.size(0), k = codes.size(1), n = packed.size(0) * kFeatures;
  TORCH_CHECK(k % kTileK == 0 && n % kBlockFeatures == 0, "int8_amx_linear: K a multiple of 64, N of 32");
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous() && packed.size(1) == k * kFeatures,
              "int8_amx_linear: a weight from int8_pack_weight with the codes' K");
  const at::Tensor bias_f =
      tokenloom::checked_scales_and_bias("int8_amx_linear", row_scales, m, weight_scales, n, bias, out_dtype);
  const int64_t width = gated ? n / 2 : n;
  at::Tensor out = at::empty({m, width}, codes.options().dtype(out_dtype));
  if (m == 0) return out;
  const Epilogue e{row_scales.const_data_ptr<float>(), weight_scales.const_data_ptr<float>(),
                   bias_f.defined() ? bias_f.const_data_ptr<float>() : nullptr};
  const int8_t* w = packed.const_data_ptr<int8_t>();
  auto run = [&](auto* o) {
    using T = std::remove_pointer_t<decltype(o)>;
    const auto multiply = gated ? &multiply_rows<true, T> : &multiply_rows<false, T>;
    for_units(codes.const_data_ptr<int8_t>(), k, k, m, n / kBlockFeatures,
              [&](const Rows& rows, int64_t first, int64_t last) { multiply(rows, k, w, first, last, e, o, width); });
  };
  tokenloom::with_output_data(out, run);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloom, m) {
  m.def("int8_amx_available() -> bool", &int8_amx_available);
  m.def(
      "int8_amx_linear(Tensor codes, Tensor row_scales, Tensor packed, Tensor weight_scales, Tensor? bias, "
      "ScalarType out_dtype, bool gated=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenloom, CPU, m) { m.impl("int8_amx_linear", &int8_amx_linear); }

#endif  // __AMX_TILE__ && __AMX_INT8__
