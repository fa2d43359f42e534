// int8 linears on CPUs with AVX2 but not AVX-512 VNNI: the same tokenloom::int8_pack_weight and
// tokenloom::int8_linear as int8_linear.cpp, for every step size (--quantization int8, quantization.py).
//
// Why: without VNNI, oneDNN's int8 matmul multiplies unsigned by signed bytes with `vpmaddubsw`, whose pairs of
// products saturate at 16 bits (255 x 127 x 2 > 32767): on an AVX2 machine its outputs were off by up to 25% where
// an activation's code was large, and the model's answers with them. Here both codes are sign-extended to 16 bits and
// multiplied with `vpmaddwd` (pairs of 16-bit products summed into 32 bits), so every sum is exact. Since the
// activations are 16-bit words here anyway, they may carry 16-bit codes (quantize_rows_int16) at no cost: int8
// weights with activations as fine as float's, where VNNI's int8 products are not to be had.
//
// The packing is int8_linear.cpp's (for each block of 16 features, the inputs in groups of 4, 16 features x 4 inputs
// to 64 bytes), so one layout serves both CPUs. A 64-byte group is read as four 16-byte quarters (4 features x 4
// inputs each); sign-extended, a quarter times the row's 4 inputs, repeated, gives each feature's two pair sums in
// adjacent lanes, which are added at the end. The sums are scaled as int8_epilogue.h orders it: (sum x weight
// scale) x row scale + bias. No gated epilogue here (it needs a vector exp): the MLP's SiLU is its own operator.
//
// Register tiles hold 8 accumulators of the 16 ymm registers: a 6-row x 2-quarter tile (12) had GCC keep 9 of them
// on the stack, a load and a store each per group. Every step runs 2-row x 16-feature tiles (block_tile) over a
// block's codes: steps of up to 5 rows sign-extend a group's four quarters as they read them (each 64-byte line read
// once, the line 1 KB ahead prefetched; the weight's bytes from memory are what they wait for); steps of 6 rows or
// more widen a block to 16-bit words once (widen_block) and read that in place: sign-extending as read, the
// `vpmovsxbw`s competed with the multiplies. On a Zen 3 core the widened tiles ran at 54-58 GMAC/s, the 6 x 2 tile at
// 36-39; at 69-74 once GCC stopped copying the accumulators between registers every group (store_row). A step's 120
// decoder weights at 1-2 rows streamed 1.2-1.3x faster in block tiles and units of 64 KB than in 4-row tiles over
// half-blocks and units of 32 KB, 1.03-1.1x at 3-6 rows (benchmarks/RESULTS.md).

#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "int8_epilogue.h"
#include "int8_packing.h"
#include "work_sharing.h"

#if defined(__AVX2__) && defined(__FMA__) && !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
#include <immintrin.h>

namespace {

constexpr int kBlock = tokenloom::kInt8Block;  // output features per packed block
constexpr int kGroup = tokenloom::kInt8Group;  // inputs per group
constexpr int kTileRows = 2;  // rows of a register tile: 2 x 4 accumulators, a group's 4 quarters
static_assert(kTileRows == 2, "a chunk's odd row is one tile of 1 row");
constexpr int64_t kWideFromRows = 6;  // a chunk of this many rows or more widens each block once
constexpr int64_t kMinUnitBytes = 64 * 1024;  // a unit's weight bytes (with 32 KB, 1-2-row steps ran 5-8% slower)
constexpr int64_t kChunkRows = 120;  // 60 wide tiles
constexpr int64_t kPrefetchAhead = 1024;  // bytes

inline void store8(float* at, __m256 v) { _mm256_storeu_ps(at, v); }
inline void store8(c10::BFloat16* at, __m256 v) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  for (int i = 0; i < 8; ++i) at[i] = c10::BFloat16(lanes[i]);  // round to nearest even
}

// [a0+a1, a2+a3, a4+a5, a6+a7, b0+b1, ..., b6+b7]: two quarters' pair sums -> their 8 features, in order.
inline __m256i feature_sums(__m256i a, __m256i b) {
  return _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(a, b), _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7));
}

// One row's 4 accumulators over a block, one per quarter of a group (each feature's two pair sums in adjacent lanes).
struct Quarters {
  __m256i q0, q1, q2, q3;
};

inline void accumulate(Quarters& acc, const Quarters& w, __m256i xv) {
  acc.q0 = _mm256_add_epi32(acc.q0, _mm256_madd_epi16(w.q0, xv));
  acc.q1 = _mm256_add_epi32(acc.q1, _mm256_madd_epi16(w.q1, xv));
  acc.q2 = _mm256_add_epi32(acc.q2, _mm256_madd_epi16(w.q2, xv));
  acc.q3 = _mm256_add_epi32(acc.q3, _mm256_madd_epi16(w.q3, xv));
}

// A row's block of 16 outputs from its accumulators: scaled as int8_epilogue.h orders it, plus the bias.
template <typename T>
inline void store_row(Quarters acc, float row_scale, const float* weight_scales, const float* bias, T* out) {
  // The accumulators as they are, in their registers: without this, GCC (12) let each group's sums in the loop
  // before land in other registers and copied them back, 8 moves a group (30 instructions where 22 do).
  asm("" : "+x"(acc.q0), "+x"(acc.q1), "+x"(acc.q2), "+x"(acc.q3));
  const __m256 rs = _mm256_set1_ps(row_scale);
  const __m256i sums[2] = {feature_sums(acc.q0, acc.q1), feature_sums(acc.q2, acc.q3)};
  for (int half = 0; half < 2; ++half) {
    const __m256 ws = _mm256_loadu_ps(weight_scales + half * 8);
    const __m256 b = bias ? _mm256_loadu_ps(bias + half * 8) : _mm256_setzero_ps();
    store8(out + half * 8, _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sums[half]), ws), rs, b));
  }
}

// One block's codes [groups, 64] sign-extended to 16-bit words, for the rows of a chunk to share.
void widen_block(const int8_t* w, int64_t bytes, int16_t* wide) {
  for (int64_t i = 0; i < bytes; i += 16) {
    const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i));
    _mm256_store_si256(reinterpret_cast<__m256i*>(wide + i), _mm256_cvtepi8_epi16(codes));
  }
}

// Group g's four quarters as 16-bit words: from the packed int8 codes, sign-extended as they are read (each 64-byte
// group once, the line 1 KB ahead prefetched); or from a block widen_block widened, read in place from L1.
inline Quarters group_quarters(const int8_t* w, int64_t g) {
  _mm_prefetch(reinterpret_cast<const char*>(w + g * 64 + kPrefetchAhead), _MM_HINT_T0);
  const auto quarter = [&](int q) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + g * 64 + 16 * q)));
  };
  return {quarter(0), quarter(1), quarter(2), quarter(3)};
}
inline Quarters group_quarters(const int16_t* wide, int64_t g) {
  const __m256i* group = reinterpret_cast<const __m256i*>(wide + g * kBlock * kGroup);
  return {_mm256_load_si256(group), _mm256_load_si256(group + 1), _mm256_load_si256(group + 2),
          _mm256_load_si256(group + 3)};
}

// A row's 4 inputs of group g, repeated across the vector (each quarter's 4 features take them in turn).
inline __m256i row_inputs(const int16_t* x, int64_t g) {
  int64_t four;
  std::memcpy(&four, x + g * kGroup, sizeof(four));
  return _mm256_set1_epi64x(four);
}

// Rows (1 or 2) x 16 outputs (a whole block) from its codes (int8 as packed, or int16 as widened).
template <int Rows, typename Code, typename T>
void block_tile(const int16_t* x, int64_t k, const Code* codes, int64_t groups, const float* row_scales,
                const float* weight_scales, const float* bias, T* out, int64_t ldo) {
  static_assert(Rows == 1 || Rows == 2);
  const __m256i zero = _mm256_setzero_si256();
  Quarters first{zero, zero, zero, zero}, second{zero, zero, zero, zero};
  for (int64_t g = 0; g < groups; ++g) {
    const Quarters w = group_quarters(codes, g);
    accumulate(first, w, row_inputs(x, g));
    if constexpr (Rows == 2) accumulate(second, w, row_inputs(x + k, g));
  }
  store_row(first, row_scales[0], weight_scales, bias, out);
  if constexpr (Rows == 2) store_row(second, row_scales[1], weight_scales, bias, out + ldo);
}

// Scratch for widen_block: one block of up to `bytes` codes as 16-bit words, 32-byte aligned, per thread.
int16_t* wide_scratch(int64_t bytes) {
  struct alignas(32) Words {
    int16_t lanes[16];
  };
  thread_local std::vector<Words> words;
  const size_t vectors = static_cast<size_t>(bytes / 16);
  if (words.size() < vectors) words.resize(vectors);
  return reinterpret_cast<int16_t*>(words.data());
}

// codes [M, K] int16 or int8 (rows contiguous; int16 ones small enough that 127 x K x their largest |code| fits
// int32), row_scales [M, 1] float32, a weight from int8_pack_weight with its code sums (unread here) and scales [N]
// float32, bias [N] or none -> [M, N] in out_dtype (float32 or bfloat16).
at::Tensor int8_linear(const at::Tensor& codes, const at::Tensor& row_scales, const at::Tensor& packed,
                       const at::Tensor& code_sums, const at::Tensor& weight_scales,
                       const std::optional<at::Tensor>& bias, at::ScalarType out_dtype, bool gated) {
  TORCH_CHECK(!gated, "int8_linear: the AVX2 kernel has no gated epilogue");
  TORCH_CHECK((codes.scalar_type() == at::kShort || codes.scalar_type() == at::kChar) && codes.dim() == 2 &&
                  codes.is_contiguous(),
              "int8_linear: codes must be contiguous int16 or int8 [M, K]");
  const int64_t m = codes.size(0), k = codes.size(1), blocks = packed.size(0), n = blocks * kBlock;
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous() && packed.size(1) == k * kBlock,
              "int8_linear: a weight from int8_pack_weight with the codes' K");
  TORCH_CHECK(code_sums.scalar_type() == at::kInt && code_sums.numel() == n, "int8_linear: code sums int32 [N]");
  const at::Tensor bias_f =
      tokenloom::checked_scales_and_bias("int8_linear", row_scales, m, weight_scales, n, bias, out_dtype);
  at::Tensor out = at::empty({m, n}, codes.options().dtype(out_dtype));
  if (m == 0) return out;
  // 16-bit activation codes (quantize_rows_int16) as they are; int8 ones sign-extended once, not once per block.
  const at::Tensor wide = codes.scalar_type() == at::kShort ? codes : codes.to(at::kShort);
  const int16_t* x = wide.const_data_ptr<int16_t>();
  const int8_t* wp = packed.const_data_ptr<int8_t>();
  const float* rows = row_scales.const_data_ptr<float>();
  const float* scales = weight_scales.const_data_ptr<float>();
  const float* bias_data = bias_f.defined() ? bias_f.const_data_ptr<float>() : nullptr;
  const int64_t groups = k / kGroup, block_bytes = k * kBlock;
  // A unit: up to kChunkRows rows (their 16-bit codes stay in L2 across the unit's blocks) by enough blocks that
  // their weights are worth a thread's start; the chunk's rows run over a block while it is in L1.
  const int64_t blocks_per_unit = std::max<int64_t>(1, kMinUnitBytes / block_bytes);
  const int64_t block_units = (blocks + blocks_per_unit - 1) / blocks_per_unit;
  const int64_t chunks = (m + kChunkRows - 1) / kChunkRows;
  const int64_t units = chunks * block_units;
  auto run = [&](auto* op) {
    using T = std::remove_pointer_t<decltype(op)>;
    const std::function<void(int64_t)> body = [&](int64_t unit) {
      const int64_t r0 = (unit / block_units) * kChunkRows, r1 = std::min(m, r0 + kChunkRows);
      const int64_t b0 = (unit % block_units) * blocks_per_unit, b1 = std::min(blocks, b0 + blocks_per_unit);
      const bool wide = r1 - r0 >= kWideFromRows;
      int16_t* widened = wide ? wide_scratch(block_bytes) : nullptr;
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t f = b * kBlock;
        const float* bb = bias_data ? bias_data + f : nullptr;
        const int8_t* wb = wp + b * block_bytes;
        // The chunk's rows over the block, 2 at a time: from its int8 codes, or widened once for them to share.
        const auto tiles = [&](const auto* block) {
          using Code = std::remove_cv_t<std::remove_pointer_t<decltype(block)>>;
          for (int64_t r = r0; r < r1; r += kTileRows) {
            const auto tile_fn = r + kTileRows <= r1 ? &block_tile<kTileRows, Code, T> : &block_tile<1, Code, T>;
            tile_fn(x + r * k, k, block, groups, rows + r, scales + f, bb, op + r * n + f, n);
          }
        };
        if (wide) {
          widen_block(wb, block_bytes, widened);
          tiles(static_cast<const int16_t*>(widened));
        } else {
          tiles(wb);
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
  m.def("int8_linear_isa() -> str", []() -> std::string { return "avx2"; });
}

TORCH_LIBRARY_IMPL(tokenloom, CPU, m) {
  m.impl("int8_pack_weight", &tokenloom::int8_pack_weight);
  m.impl("int8_linear", &int8_linear);
}

#endif  // AVX2 without AVX-512 VNNI
