// bfloat16 linears on CPUs with AVX-512 BF16 (and no AMX): tokenloom::bf16_pack_weight, tokenloom::bf16_linear and
// tokenloom::bf16_linear_silu_and_mul (the MLP's gate/up projection with its activation).
//
// Why not oneDNN: at decode batch sizes a linear takes 10-700 us, and each of oneDNN's OpenMP regions first waits
// for a sleeping worker thread to wake (see work_sharing.h); a 4-row decode step spent twice as long in oneDNN's
// linears as vLLM's spinning threads did. These linears share their units of work through work_sharing.h instead.
//
// The weight is packed once for the bf16 dot-product instruction: for each block of 16 output features, the K
// inputs in pairs, 16 features x 2 inputs to a 64-byte vector. A tile of up to 8 rows x 3 blocks (6 x 4 when
// gated) keeps its 24 float32 accumulators in registers for the whole K; later rows reuse the blocks from L2.
// Measured against oneDNN's prepacked linears on the model's layer shapes (weights warm): as fast or faster from 1
// to 2,048 rows (98% of the bf16 peak at 2,048) and 3-7x faster at 1-4 rows; on the 49,152-wide LM head within 7%
// either way. With AMX, oneDNN's tile instructions are the faster path; this is not used there.

#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>

#include "avx512_exp.h"
#include "bf16_vec.h"
#include "work_sharing.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

constexpr int kBlock = 16;    // output features per vector
constexpr int64_t kMinUnitBytes = 48 * 1024;  // weight bytes per unit of shared work: a few microseconds

// Register tiles: rows x feature blocks of float32 accumulators (24 of the 32 vector registers). A gated tile's
// blocks alternate gate and up, and it stores silu(gate) * up: half as many outputs.
template <bool Gated>
struct TileShape {
  static constexpr int kRows = Gated ? 6 : 8;
  static constexpr int kBlocks = Gated ? 4 : 3;
};

// Rows x Blocks outputs (Blocks / 2 when gated): x rows [Rows, K] (row stride ldx); w: Blocks packed blocks one
// after another (each K / 2 vectors); out rows with stride ldo.
template <int Rows, int Blocks, bool Gated>
void tile(const c10::BFloat16* x, int64_t ldx, const __m512bh* w, int64_t pairs, c10::BFloat16* out, int64_t ldo) {
  __m512 acc[Rows][Blocks];
  for (int r = 0; r < Rows; ++r) {
    for (int b = 0; b < Blocks; ++b) acc[r][b] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh wv[Blocks];
    for (int b = 0; b < Blocks; ++b) wv[b] = w[b * pairs + p];
    for (int r = 0; r < Rows; ++r) {
      const __m512bh xv = tokenloom::broadcast_pair(x + r * ldx + 2 * p);
      for (int b = 0; b < Blocks; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xv, wv[b]);
    }
  }
  for (int r = 0; r < Rows; ++r) {
    if constexpr (Gated) {
      // silu(g) * u = g * u / (1 + e^-g), from the float32 sums (the unfused path rounds g and u to bf16 first).
      for (int b = 0; b < Blocks / 2; ++b) {
        tokenloom::store16(out + r * ldo + b * kBlock, tokenloom::silu_times(acc[r][2 * b], acc[r][2 * b + 1]));
      }
    } else {
      for (int b = 0; b < Blocks; ++b) tokenloom::store16(out + r * ldo + b * kBlock, acc[r][b]);
    }
  }
}

using TileFn = void (*)(const c10::BFloat16*, int64_t, const __m512bh*, int64_t, c10::BFloat16*, int64_t);

template <int Rows, bool Gated>
constexpr TileFn tile_for_blocks(int blocks) {
  if constexpr (Gated) {
    return blocks == 2 ? &tile<Rows, 2, true> : &tile<Rows, 4, true>;
  } else {
    return blocks == 1 ? &tile<Rows, 1, false> : blocks == 2 ? &tile<Rows, 2, false> : &tile<Rows, 3, false>;
  }
}

template <bool Gated>
TileFn tile_for(int rows, int blocks) {
  switch (rows) {
    case 1: return tile_for_blocks<1, Gated>(blocks);
    case 2: return tile_for_blocks<2, Gated>(blocks);
    case 3: return tile_for_blocks<3, Gated>(blocks);
    case 4: return tile_for_blocks<4, Gated>(blocks);
    case 5: return tile_for_blocks<5, Gated>(blocks);
    case 6: return tile_for_blocks<6, Gated>(blocks);
    case 7: return tile_for_blocks<7, Gated>(blocks);
    default: return tile_for_blocks<8, Gated>(blocks);
  }
}

// w: [N, K] bfloat16 -> [N / 16, K / 2, 16, 2] (as [N / 16, K * 16]).
at::Tensor bf16_pack_weight(const at::Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kBFloat16 && w.dim() == 2,
              "bf16_pack_weight: a 2-d bfloat16 CPU weight");
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(n % kBlock == 0 && k % 2 == 0, "bf16_pack_weight: out features must be a multiple of 16, in "
                                             "features even");
  const at::Tensor src = w.contiguous();
  at::Tensor packed = at::empty({n / kBlock, k * kBlock}, w.options());
  const c10::BFloat16* s = src.data_ptr<c10::BFloat16>();
  c10::BFloat16* d = packed.data_ptr<c10::BFloat16>();
  for (int64_t block = 0; block < n / kBlock; ++block) {
    for (int64_t p = 0; p < k / 2; ++p) {
      for (int f = 0; f < kBlock; ++f) {
        const c10::BFloat16* row = s + (block * kBlock + f) * k + 2 * p;
        c10::BFloat16* to = d + block * k * kBlock + p * 2 * kBlock + 2 * f;
        to[0] = row[0];
        to[1] = row[1];
      }
    }
  }
  return packed;
}

// x: [M, K] (rows may be strided) times a weight packed by bf16_pack_weight into out: [M, N], or with Gated a
// weight whose 16-row blocks alternate gate and up into out: [M, N / 2] = silu(gate) * up. Rows of out may be
// strided. No bias (the models here have none).
template <bool Gated>
void linear(const char* name, const at::Tensor& x, const at::Tensor& packed, at::Tensor& out) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu() && out.device().is_cpu(), name, ": CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16,
              name, ": bfloat16 only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.dim() == 2 && out.stride(1) == 1, name,
              ": x [M, K] and out [M, N] with contiguous rows");
  TORCH_CHECK(packed.dim() == 2 && packed.is_contiguous(), name, ": packed weight from bf16_pack_weight");
  const int64_t m = x.size(0), k = x.size(1), blocks = packed.size(0);
  TORCH_CHECK(packed.size(1) == k * kBlock, name, ": the packed weight's in features differ from x's");
  TORCH_CHECK(!Gated || blocks % 2 == 0, name, ": gate and up blocks must pair up");
  TORCH_CHECK(out.size(0) == m && out.size(1) == (Gated ? blocks / 2 : blocks) * kBlock, name,
              ": out must be [M, N]", Gated ? " with N half the weight's out features" : "");
  if (m == 0) return;
  constexpr int kRows = TileShape<Gated>::kRows, kBlocks = TileShape<Gated>::kBlocks;
  const int64_t pairs = k / 2;
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  const auto* wp = reinterpret_cast<const __m512bh*>(packed.data_ptr<c10::BFloat16>());
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  const int64_t ldx = x.stride(0), ldo = out.stride(0);
  // A unit: a run of tiles' worth of blocks (all rows), at least kMinUnitBytes of weight.
  const int64_t block_bytes = k * kBlock * 2;
  const int64_t tiles_per_unit = std::max<int64_t>(1, kMinUnitBytes / (block_bytes * kBlocks));
  const int64_t blocks_per_unit = tiles_per_unit * kBlocks;
  const int64_t units = (blocks + blocks_per_unit - 1) / blocks_per_unit;
  const std::function<void(int64_t)> body = [&](int64_t unit) {
    const int64_t b0 = unit * blocks_per_unit, b1 = std::min(blocks, b0 + blocks_per_unit);
    for (int64_t b = b0; b < b1; b += kBlocks) {
      const int nb = static_cast<int>(std::min<int64_t>(kBlocks, b1 - b));
      c10::BFloat16* out_block = op + (Gated ? b / 2 : b) * kBlock;
      for (int64_t r = 0; r < m; r += kRows) {
        const int nr = static_cast<int>(std::min<int64_t>(kRows, m - r));
        tile_for<Gated>(nr, nb)(xp + r * ldx, ldx, wp + b * pairs, pairs, out_block + r * ldo, ldo);
      }
    }
  };
  tokenloom::WorkSharing::instance().run(units, body);
}

void bf16_linear(const at::Tensor& x, const at::Tensor& packed, at::Tensor out) {
  linear<false>("bf16_linear", x, packed, out);
}

void bf16_linear_silu_and_mul(const at::Tensor& x, const at::Tensor& packed, at::Tensor out) {
  linear<true>("bf16_linear_silu_and_mul", x, packed, out);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloom, m) {
  m.def("bf16_pack_weight(Tensor w) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor packed, Tensor(a!) out) -> ()");
  m.def("bf16_linear_silu_and_mul(Tensor x, Tensor packed, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(tokenloom, CPU, m) {
  m.impl("bf16_pack_weight", &bf16_pack_weight);
  m.impl("bf16_linear", &bf16_linear);
  m.impl("bf16_linear_silu_and_mul", &bf16_linear_silu_and_mul);
}

#endif  // __AVX512BF16__
