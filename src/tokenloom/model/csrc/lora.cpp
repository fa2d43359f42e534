// LoRA deltas of a step's rows, each row under its own adapter (or none), added in place: tokenloom::lora_add.
//
//   y[t, :] += (x[t, :] @ a[s]) @ b[s]    for every row t whose adapter s = adapter_of[t] is not -1
//
// a[s] is the adapter's A transposed, [K, R] (for each input its R values side by side), b[s] its scaled B
// transposed, [R, N], both float32. Through torch each adapter's two products were two small matmuls per linear,
// and on our 2-core CPUs each cost 17-120 us whatever its size (oneDNN's bf16 primitive, OpenMP waking a sleeping
// worker): a batch-1 decode step under one adapter ran at 30 tok/s against 80 without it. Here a row's R sums
// stay in registers while its inputs stream by, then its N outputs are added in chunks; rows are shared out by
// work_sharing.h. Any adapter mix is one call per linear (S-LoRA / Punica's SGMV, on a CPU).

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <vector>

#include "work_sharing.h"

namespace {

constexpr int64_t kMaxRank = 1024;     // a fused linear's summed ranks: 3 x max_lora_rank for q, k and v
constexpr int64_t kChunk = 512;        // outputs summed in a float buffer before they are added to y
constexpr int64_t kRowsPerUnit = 8;    // rows a helper takes at a time

template <typename T>
void add_row(T* y, const T* x, const float* a, const float* b, int64_t k, int64_t r, int64_t n) {
  float h[kMaxRank];
  std::fill(h, h + r, 0.0f);
  for (int64_t i = 0; i < k; ++i) {
    const float xi = static_cast<float>(x[i]);
    const float* ai = a + i * r;
    for (int64_t j = 0; j < r; ++j) h[j] += xi * ai[j];
  }
  float sums[kChunk];
  for (int64_t n0 = 0; n0 < n; n0 += kChunk) {
    const int64_t width = std::min(kChunk, n - n0);
    std::fill(sums, sums + width, 0.0f);
    for (int64_t j = 0; j < r; ++j) {
      const float hj = h[j];
      const float* bj = b + j * n + n0;
      for (int64_t c = 0; c < width; ++c) sums[c] += hj * bj[c];
    }
    for (int64_t c = 0; c < width; ++c) y[n0 + c] = static_cast<T>(static_cast<float>(y[n0 + c]) + sums[c]);
  }
}

struct Adapter {
  const float* a;  // [K, R]
  const float* b;  // [R, N]
  int64_t rank;    // 0: the adapter leaves this linear alone
};

template <typename T>
void add_rows(at::Tensor& y, const at::Tensor& x, const std::vector<Adapter>& adapters, const int32_t* adapter_of) {
  const int64_t rows = x.size(0), k = x.size(1), n = y.size(1);
  T* yp = y.mutable_data_ptr<T>();
  const T* xp = x.const_data_ptr<T>();
  const int64_t ldx = x.stride(0), ldy = y.stride(0);
  const int64_t units = (rows + kRowsPerUnit - 1) / kRowsPerUnit;
  const std::function<void(int64_t)> body = [&](int64_t unit) {
    const int64_t end = std::min(rows, (unit + 1) * kRowsPerUnit);
    for (int64_t t = unit * kRowsPerUnit; t < end; ++t) {
      if (adapter_of[t] < 0) continue;
      const Adapter& adapter = adapters[adapter_of[t]];
      if (adapter.rank == 0) continue;
      add_row<T>(yp + t * ldy, xp + t * ldx, adapter.a, adapter.b, k, adapter.rank, n);
    }
  };
  tokenloom::WorkSharing::instance().run(units, body);
}

// y [T, N] and x [T, K], both float32 or both bfloat16 with rows of unit stride; a: S tensors [K, R_s], b: S
// tensors [R_s, N], float32 and contiguous (R_s = 0: that adapter leaves this linear alone); adapter_of [T] int32,
// each in [-1, S).
void lora_add(at::Tensor y, const at::Tensor& x, at::TensorList a, at::TensorList b, const at::Tensor& adapter_of) {
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && y.size(0) == x.size(0), "lora_add: y [T, N] and x [T, K]");
  TORCH_CHECK(y.scalar_type() == x.scalar_type() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "lora_add: x and y must both be float32 or both bfloat16");
  TORCH_CHECK(y.stride(1) == 1 && x.stride(1) == 1, "lora_add: rows of unit stride");
  TORCH_CHECK(a.size() == b.size(), "lora_add: an A and a B for every adapter");
  std::vector<Adapter> adapters;
  for (size_t s = 0; s < a.size(); ++s) {
    TORCH_CHECK(a[s].scalar_type() == at::kFloat && b[s].scalar_type() == at::kFloat && a[s].is_contiguous() &&
                    b[s].is_contiguous() && a[s].dim() == 2 && b[s].dim() == 2,
                "lora_add: A and B must be contiguous 2-D float32");
    if (a[s].numel() == 0 && b[s].numel() == 0) {  // this adapter leaves the linear alone
      adapters.push_back({nullptr, nullptr, 0});
      continue;
    }
    TORCH_CHECK(a[s].size(0) == x.size(1) && b[s].size(1) == y.size(1) && a[s].size(1) == b[s].size(0),
                "lora_add: A [K, R] and B [R, N] must fit x [T, K] and y [T, N]");
    TORCH_CHECK(a[s].size(1) <= kMaxRank, "lora_add: an adapter's rank is above ", kMaxRank);
    adapters.push_back({a[s].const_data_ptr<float>(), b[s].const_data_ptr<float>(), a[s].size(1)});
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
