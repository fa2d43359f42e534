// LoRA deltas of a step's rows, each row under its own adapter (or none), added in place: tokenloom::lora_add.
//
//   y[t, :] += (x[t, :] @ a[s]) @ b[s]    for every row t whose adapter s = adapter_of[t] is not -1
//
// a[s] is the adapter's A transposed, [K, R] (for each input its R values side by side), b[s] its scaled B
// transposed, [R, N], both in the model's dtype (an adapter's bytes are read every step, as the model's are), R
// padded with zeros to a multiple of 16; the sums are float32. Through torch each adapter's two products were two
// small matmuls per linear, and on our 2-core CPUs each cost 17-120 us whatever its size (oneDNN's bf16 primitive,
// OpenMP waking a sleeping worker): a batch-1 decode step under one adapter ran at 30 tok/s against 80 without it.
// Here the rows are sorted by adapter into tiles of up to 8 rows; a tile's sums live in registers, 16 at a time per
// row, while A (then B) streams by, each load serving every row of the tile; tiles are shared out by
// work_sharing.h. Any adapter mix is one call per linear (S-LoRA / Punica's SGMV, on a CPU).

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#include "work_sharing.h"

namespace {

constexpr int64_t kMaxRank = 1024;  // a fused linear's summed ranks: 3 x max_lora_rank for q, k and v
constexpr int kTileRows = 8;        // rows of one adapter that share each load of its A and B

struct Adapter {
  const void* a;   // [K, R], in x's dtype
  const void* b;   // [R, N]
  int64_t rank;    // 0: the adapter leaves this linear alone
};

struct Tile {
  int32_t adapter;
  int32_t count;
  int64_t rows[kTileRows];
};

// Sixteen floats: GCC's vector extension, one AVX-512 register (two AVX2 ones where the CPU has no AVX-512).
typedef float Vec __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;

typedef uint16_t Half __attribute__((vector_size(32)));  // 16 bf16 bit patterns
typedef uint32_t Bits __attribute__((vector_size(64)));

inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline Vec load(const c10::BFloat16* p) {  // bf16 is float32's upper half
  Half half;
  std::memcpy(&half, p, sizeof half);
  const Bits bits = __builtin_convertvector(half, Bits) << 16;
  Vec v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

inline void store(float* p, Vec v) { std::memcpy(p, &v, sizeof v); }

inline void store(c10::BFloat16* p, Vec v) {  // rounded to nearest even, as c10::BFloat16 rounds
  Bits bits;
  std::memcpy(&bits, &v, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  const Half half = __builtin_convertvector(bits >> 16, Half);
  std::memcpy(p, &half, sizeof half);
}

// acc[m] = sum over i of s[m][i] * w[i * ldw : i * ldw + 16], for M rows: the M sums stay in registers while the
// inner dimension streams by, each load of w used by every row.
template <typename S, typename W, int M>
inline void tile_sums(Vec* acc, const S* const* s, const W* w, int64_t inner, int64_t ldw) {
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) acc[m] = Vec{};
  for (int64_t i = 0; i < inner; ++i) {
    const Vec wv = load(w + i * ldw);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) acc[m] += static_cast<float>(s[m][i]) * wv;
  }
}

// h[m, :] = x[m, :] @ a for M rows, a's R columns 16 at a time.
template <typename T, int M>
void shrink(const T* const* xs, const T* a, int64_t k, int64_t r, float* h) {
  for (int64_t jb = 0; jb < r; jb += kLanes) {
    Vec acc[M];
    tile_sums<T, T, M>(acc, xs, a + jb, k, r);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) std::memcpy(h + m * r + jb, &acc[m], sizeof(Vec));
  }
}

// y[m, :] += h[m, :] @ b for M rows, 16 outputs at a time.
template <typename T, int M>
void expand(T* const* ys, const float* h, const T* b, int64_t r, int64_t n) {
  const float* hs[M];
  for (int m = 0; m < M; ++m) hs[m] = h + m * r;
  int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes) {
    Vec acc[M];
    tile_sums<float, T, M>(acc, hs, b + c, r, n);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) store(ys[m] + c, load(ys[m] + c) + acc[m]);
  }
  for (; c < n; ++c) {  // the last n % 16 outputs
    for (int m = 0; m < M; ++m) {
      float sum = 0.0f;
      for (int64_t j = 0; j < r; ++j) sum += h[m * r + j] * static_cast<float>(b[j * n + c]);
      ys[m][c] = static_cast<T>(static_cast<float>(ys[m][c]) + sum);
    }
  }
}

// Up to kTileRows rows under one adapter: each load of its A and B serves every row of the tile.
template <typename T, int M>
void add_tile(const Tile& tile, const Adapter& adapter, T* y, int64_t ldy, const T* x, int64_t ldx, int64_t k,
              int64_t n) {
  static thread_local std::vector<float> h(kTileRows * kMaxRank);
  const T* xs[M];
  T* ys[M];
  for (int m = 0; m < M; ++m) {
    xs[m] = x + tile.rows[m] * ldx;
    ys[m] = y + tile.rows[m] * ldy;
  }
  shrink<T, M>(xs, static_cast<const T*>(adapter.a), k, adapter.rank, h.data());
  expand<T, M>(ys, h.data(), static_cast<const T*>(adapter.b), adapter.rank, n);
}

template <typename T>
using TileFn = void (*)(const Tile&, const Adapter&, T*, int64_t, const T*, int64_t, int64_t, int64_t);

template <typename T>
TileFn<T> tile_for(int rows) {
  switch (rows) {
    case 1: return &add_tile<T, 1>;
    case 2: return &add_tile<T, 2>;
    case 3: return &add_tile<T, 3>;
    case 4: return &add_tile<T, 4>;
    case 5: return &add_tile<T, 5>;
    case 6: return &add_tile<T, 6>;
    case 7: return &add_tile<T, 7>;
    default: return &add_tile<T, 8>;
  }
}

// The rows of each adapter that adapts this linear, in tiles of up to kTileRows.
std::vector<Tile> tiles_of(const std::vector<Adapter>& adapters, const int32_t* adapter_of, int64_t rows) {
  std::vector<Tile> tiles;
  std::vector<int64_t> open(adapters.size(), -1);  // each adapter's tile being filled
  for (int64_t t = 0; t < rows; ++t) {
    const int32_t s = adapter_of[t];
    if (s < 0 || adapters[s].rank == 0) continue;
    if (open[s] < 0 || tiles[open[s]].count == kTileRows) {
      open[s] = static_cast<int64_t>(tiles.size());
      tiles.push_back(Tile{s, 0, {}});
    }
    Tile& tile = tiles[open[s]];
    tile.rows[tile.count++] = t;
  }
  return tiles;
}

template <typename T>
void add_rows(at::Tensor& y, const at::Tensor& x, const std::vector<Adapter>& adapters, const int32_t* adapter_of) {
  const std::vector<Tile> tiles = tiles_of(adapters, adapter_of, x.size(0));
  T* yp = y.mutable_data_ptr<T>();
  const T* xp = x.const_data_ptr<T>();
  const int64_t ldx = x.stride(0), ldy = y.stride(0), k = x.size(1), n = y.size(1);
  // A tile is a unit, its outputs not split: for a lone row (batch 1) splitting them between the threads measured
  // 2-3x slower, the handing out costing more than the row's ~25,000 products.
  const std::function<void(int64_t)> body = [&](int64_t unit) {
    const Tile& tile = tiles[unit];
    tile_for<T>(tile.count)(tile, adapters[tile.adapter], yp, ldy, xp, ldx, k, n);
  };
  tokenloom::WorkSharing::instance().run(static_cast<int64_t>(tiles.size()), body);
}

// y [T, N] and x [T, K], both float32 or both bfloat16 with rows of unit stride; a: S tensors [K, R_s], b: S
// tensors [R_s, N], in x's dtype and contiguous (R_s = 0: that adapter leaves this linear alone); adapter_of [T]
// int32, each in [-1, S).
void lora_add(at::Tensor y, const at::Tensor& x, at::TensorList a, at::TensorList b, const at::Tensor& adapter_of) {
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && y.size(0) == x.size(0), "lora_add: y [T, N] and x [T, K]");
  TORCH_CHECK(y.scalar_type() == x.scalar_type() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "lora_add: x and y must both be float32 or both bfloat16");
  TORCH_CHECK(y.stride(1) == 1 && x.stride(1) == 1, "lora_add: rows of unit stride");
  TORCH_CHECK(a.size() == b.size(), "lora_add: an A and a B for every adapter");
  std::vector<Adapter> adapters;
  for (size_t s = 0; s < a.size(); ++s) {
    if (a[s].numel() == 0 && b[s].numel() == 0) {  // this adapter leaves the linear alone
      adapters.push_back({nullptr, nullptr, 0});
      continue;
    }
    TORCH_CHECK(a[s].scalar_type() == x.scalar_type() && b[s].scalar_type() == x.scalar_type() &&
                    a[s].is_contiguous() && b[s].is_contiguous() && a[s].dim() == 2 && b[s].dim() == 2,
                "lora_add: A and B must be contiguous 2-D, in x's dtype");
    TORCH_CHECK(a[s].size(0) == x.size(1) && b[s].size(1) == y.size(1) && a[s].size(1) == b[s].size(0),
                "lora_add: A [K, R] and B [R, N] must fit x [T, K] and y [T, N]");
    TORCH_CHECK(a[s].size(1) <= kMaxRank && a[s].size(1) % kLanes == 0,
                "lora_add: an adapter's rank must be a multiple of 16 (padded with zeros), at most ", kMaxRank);
    adapters.push_back({a[s].const_data_ptr(), b[s].const_data_ptr(), a[s].size(1)});
  }
  TORCH_CHECK(adapter_of.scalar_type() == at::kInt && adapter_of.is_contiguous() &&
                  adapter_of.numel() == x.size(0),
              "lora_add: adapter_of must be int32 [T]");
  const int32_t* of = adapter_of.const_data_ptr<int32_t>();
  const int64_t count = static_cast<int64_t>(adapters.size());
  for (int64_t t = 0; t < x.size(0); ++t) {
    TORCH_CHECK(of[t] >= -1 && of[t] < count, "lora_add: adapter_of[", t, "] = ", of[t], " names no adapter");
  }
  if (x.scalar_type() == at::kFloat) {
    add_rows<float>(y, x, adapters, of);
  } else {
    add_rows<c10::BFloat16>(y, x, adapters, of);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloom, m) {
  m.def("lora_add(Tensor(a!) y, Tensor x, Tensor[] a, Tensor[] b, Tensor adapter_of) -> ()");
}

TORCH_LIBRARY_IMPL(tokenloom, CPU, m) { m.impl("lora_add", &lora_add); }
