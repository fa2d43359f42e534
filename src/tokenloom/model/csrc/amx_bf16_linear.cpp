// bfloat16 linears for large steps on CPUs with AMX-BF16: tokenloom::bf16_amx_linear (prepack.py).
//
// Why not oneDNN, which the engine used here before: on the model's layer shapes its packed bf16 linear reached
// about a fifth of this machine's AMX-BF16 rate at 512-2,048 rows (benchmarks/RESULTS.md), and the MLP's activation
// was a pass of its own after it. This is the int8 kernel's loop (amx_tiles.h) on `tdpbf16ps`: 32 x 32 blocks of
// float32 sums in four tiles, written once in bf16, the fused gate/up projection's silu(gate) x up taken from the
// float32 sums as they leave the tiles.
//
// The weight is the one bf16_linear.cpp packs: per 16 output features, the inputs in pairs, 16 features x 2 inputs
// to 64 bytes. 16 consecutive pairs of a feature block are exactly the B operand of `tdpbf16ps` for 32 inputs, so
// one packing serves both kernels (ours for steps of a few rows, this one above).

#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "amx_tiles.h"
#include "avx512_exp.h"
#include "bf16_vec.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <immintrin.h>

namespace {

using namespace tokenloom::amx;

constexpr int kTileK = 32;  // bf16 inputs per A tile row

struct Bf16Pairs {
  static void four() {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
};

// Tiles 0-3 = the 32 rows at a (row stride lda elements) times feature block `block` (32 features).
inline void accumulate(const c10::BFloat16* a, int64_t lda, const c10::BFloat16* packed, int64_t k, int64_t block) {
  const int64_t half_bytes = k * kFeatures * 2;
  const auto* b0 = reinterpret_cast<const uint8_t*>(packed) + 2 * block * half_bytes;
  accumulate_block<Bf16Pairs>(reinterpret_cast<const uint8_t*>(a), lda * 2, b0, b0 + half_bytes, k / kTileK);
}

template <bool Gated>
void write_block(const float (&sums)[kRows][kBlockFeatures], int rows, int64_t row, int64_t block, c10::BFloat16* out,
                 int64_t ldo) {
  for (int r = 0; r < rows; ++r) {
    const __m512 lo = _mm512_loadu_ps(&sums[r][0]), hi = _mm512_loadu_ps(&sums[r][kFeatures]);
    c10::BFloat16* at = out + (row + r) * ldo;
    if constexpr (Gated) {
      tokenloom::store16(at + block * kFeatures, tokenloom::silu_times(lo, hi));
    } else {
      tokenloom::store16(at + block * kBlockFeatures, lo);
      tokenloom::store16(at + block * kBlockFeatures + kFeatures, hi);
    }
  }
}

template <bool Gated>
void multiply_rows(const Rows& rows, int64_t k, const c10::BFloat16* packed, int64_t first, int64_t last,
                   c10::BFloat16* out, int64_t ldo) {
  alignas(64) float sums[kRows][kBlockFeatures];
  const auto* a = reinterpret_cast<const c10::BFloat16*>(rows.a);
  const int64_t lda = rows.stride / 2;
  for (int64_t block = first; block < last; ++block) {
    for (int64_t r = 0; r < rows.count; r += kRows) {
      accumulate(a + r * lda, lda, packed, k, block);
      store_block(sums);
      write_block<Gated>(sums, static_cast<int>(std::min<int64_t>(kRows, rows.count - r)), rows.row + r, block, out,
                         ldo);
    }
  }
}

bool bf16_amx_available() { return tiles_permitted(); }

// x [M, K] bf16 (rows contiguous, possibly strided; K a multiple of 32) times a weight from bf16_pack_weight
// (N a multiple of 32) into out [M, N], or gated (the weight's features [gate; up] interleaved per 16) into
// out [M, N / 2] = silu(gate) x up. No bias (the models here have none).
void bf16_amx_linear(const at::Tensor& x, const at::Tensor& packed, at::Tensor out, bool gated) {
  TORCH_CHECK(tiles_permitted(), "bf16_amx_linear: the kernel did not grant this process the AMX tiles");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16 && x.device().is_cpu(),
              "bf16_amx_linear: bfloat16 CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.dim() == 2 && out.stride(1) == 1,
              "bf16_amx_linear: x [M, K] and out [M, N] with contiguous rows");
  const int64_t m = x.size(0), k = x.size(1), n = packed.size(0) * kFeatures;
  TORCH_CHECK(packed.dim() == 2 && packed.is_contiguous() && packed.size(1) == k * kFeatures,
              "bf16_amx_linear: a weight from bf16_pack_weight with x's K");
  TORCH_CHECK(k % kTileK == 0 && n % kBlockFeatures == 0, "bf16_amx_linear: K a multiple of 32, N of 32");
  const int64_t width = gated ? n / 2 : n;
  TORCH_CHECK(out.size(0) == m && out.size(1) == width, "bf16_amx_linear: out must be [M, ", width, "]");
  if (m == 0) return;
  const c10::BFloat16* w = packed.const_data_ptr<c10::BFloat16>();
  c10::BFloat16* o = out.mutable_data_ptr<c10::BFloat16>();
  const int64_t ldo = out.stride(0);
  const auto multiply = gated ? &multiply_rows<true> : &multiply_rows<false>;
  for_units(x.const_data_ptr<c10::BFloat16>(), x.stride(0) * 2, k * 2, m, n / kBlockFeatures,
            [&](const Rows& rows, int64_t first, int64_t last) { multiply(rows, k, w, first, last, o, ldo); });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloom, m) {
  m.def("bf16_amx_available() -> bool", &bf16_amx_available);
  m.def("bf16_amx_linear(Tensor x, Tensor packed, Tensor(a!) out, bool gated=False) -> ()");
}

TORCH_LIBRARY_IMPL(tokenloom, CPU, m) { m.impl("bf16_amx_linear", &bf16_amx_linear); }

#endif  // __AMX_TILE__ && __AMX_BF16__
