// bfloat16 linears on CPUs with AVX-512 BF16 (and no AMX): tokenloom::bf16_pack_weight and tokenloom::bf16_linear.
//
// Why not oneDNN: at decode batch sizes a linear takes 10-700 us, and with OMP_WAIT_POLICY=PASSIVE (which we keep
// so other processes on the machine are not starved) every OpenMP region first wakes its sleeping worker thread,
// which on our VMs takes 50-100 us, and the region's static split then waits for it. A 4-row decode step spent
// twice as long in oneDNN's linears as vLLM's spinning threads did.
//
// So these linears share work differently: the calling thread starts on the first unit at once, a helper thread
// is rung and takes units from the same counter when it is awake, and the caller waits only for units the helper
// has already taken (a unit is a few microseconds). A helper that wakes late costs only its absence; one that
// sleeps through a short linear is never waited for. Helpers sleep on a futex between linears: nothing spins
// while idle.
//
// The weight is packed once for the bf16 dot-product instruction: for each block of 16 output features, the K
// inputs in pairs, 16 features x 2 inputs to a 64-byte vector. A tile of up to 8 rows x 3 blocks keeps its 24
// float32 accumulators in registers for the whole K; later rows reuse the blocks from L2. Measured against
// oneDNN's prepacked linears on the model's shapes: as fast or faster from 1 to 2,048 rows (98% of the bf16 peak
// at 2,048), and 2-7x faster at 1-4 rows. With AMX, oneDNN's tile instructions are the faster path; this is not
// used there.

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace {

constexpr int kBlock = 16;    // output features per vector
constexpr int kMaxRows = 8;   // rows per register tile
constexpr int kMaxBlocks = 3; // feature blocks per register tile
constexpr int64_t kMinUnitBytes = 48 * 1024;  // weight bytes per unit of shared work: a few microseconds

// ---- work sharing: the caller plus helper threads that sleep on a futex between jobs ----

long futex(std::atomic<uint32_t>* word, int op, uint32_t value) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, nullptr, nullptr, 0);
}

class WorkSharing {
 public:
  static WorkSharing& instance() {
    static WorkSharing pool;
    return pool;
  }

  // Runs body(unit) for every unit in [0, units), on the caller and any helper that is awake.
  void run(int64_t units, const std::function<void(int64_t)>& body) {
    TORCH_CHECK(units < (int64_t{1} << kCountBits), "bf16_linear: too many work units");
    const int helpers = std::max(0, at::get_num_threads() - 1);
    std::lock_guard<std::mutex> one_job_at_a_time(job_mutex_);
    ensure_helpers(helpers);
    if (helpers == 0 || units == 1) {
      for (int64_t u = 0; u < units; ++u) body(u);
      return;
    }
    body_ = &body;
    done_.store(0, std::memory_order_relaxed);
    generation_ = (generation_ + 1) & kGenerationMask;
    ticket_.store(pack(generation_, 0, units), std::memory_order_release);
    bell_.fetch_add(1, std::memory_order_release);
    futex(&bell_, FUTEX_WAKE_PRIVATE, INT_MAX);
    const int64_t mine = work(generation_, /*helper=*/false);
    // Wait only for the units a helper has taken: each is a few microseconds unless its thread was preempted.
    for (int spins = 0; done_.load(std::memory_order_acquire) + mine < units; ++spins) {
      if (spins < 20000) {
        _mm_pause();
      } else {
        std::this_thread::yield();
      }
    }
    body_ = nullptr;
  }

 private:
  static constexpr int kCountBits = 20;
  static constexpr uint64_t kCountMask = (uint64_t{1} << kCountBits) - 1;
  static constexpr uint64_t kGenerationMask = (uint64_t{1} << (64 - 2 * kCountBits)) - 1;

  static uint64_t pack(uint64_t generation, uint64_t next, uint64_t total) {
    return (generation << (2 * kCountBits)) | (next << kCountBits) | total;
  }

  // Takes units of the job `generation` until none is left; returns how many this thread ran.
  int64_t work(uint64_t generation, bool helper) {
    int64_t ran = 0;
    for (;;) {
      uint64_t ticket = ticket_.load(std::memory_order_acquire);
      const uint64_t next = (ticket >> kCountBits) & kCountMask, total = ticket & kCountMask;
      if ((ticket >> (2 * kCountBits)) != generation || next >= total) return ran;
      if (!ticket_.compare_exchange_weak(ticket, ticket + (uint64_t{1} << kCountBits), std::memory_order_acq_rel)) {
        continue;
      }
      // The job cannot end (and body_ change) before this unit is counted done.
      (*body_)(static_cast<int64_t>(next));
      ++ran;
      if (helper) done_.fetch_add(1, std::memory_order_release);
    }
  }

  void helper_loop() {
    for (;;) {
      const uint32_t rung = bell_.load(std::memory_order_acquire);
      const uint64_t generation = ticket_.load(std::memory_order_acquire) >> (2 * kCountBits);
      work(generation, /*helper=*/true);
      futex(&bell_, FUTEX_WAIT_PRIVATE, rung);  // returns at once if rung again since
    }
  }

  void ensure_helpers(int helpers) {
    while (static_cast<int>(threads_.size()) < helpers) {
      threads_.emplace_back([this] { helper_loop(); });
      threads_.back().detach();
    }
  }

  std::mutex job_mutex_;
  std::vector<std::thread> threads_;
  std::atomic<uint32_t> bell_{0};
  std::atomic<uint64_t> ticket_{0};
  std::atomic<int64_t> done_{0};
  uint64_t generation_ = 0;
  const std::function<void(int64_t)>* body_ = nullptr;
};

// ---- the kernel ----

inline __m512bh pair_broadcast(const c10::BFloat16* at) {
  float pair;
  std::memcpy(&pair, at, sizeof(pair));
  return reinterpret_cast<__m512bh>(_mm512_set1_ps(pair));
}

// rows x blocks outputs: x rows [rows, K] (row stride ldx), w_blocks: `blocks` packed blocks one after another
// (each K/2 vectors), out rows with stride ldo.
template <int Rows, int Blocks>
void tile(const c10::BFloat16* x, int64_t ldx, const __m512bh* w, int64_t pairs, c10::BFloat16* out, int64_t ldo) {
  __m512 acc[Rows][Blocks];
  for (int r = 0; r < Rows; ++r) {
    for (int b = 0; b < Blocks; ++b) acc[r][b] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh wv[Blocks];
    for (int b = 0; b < Blocks; ++b) wv[b] = w[b * pairs + p];
    for (int r = 0; r < Rows; ++r) {
      const __m512bh xv = pair_broadcast(x + r * ldx + 2 * p);
      for (int b = 0; b < Blocks; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xv, wv[b]);
    }
  }
  for (int r = 0; r < Rows; ++r) {
    for (int b = 0; b < Blocks; ++b) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo + b * kBlock),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(acc[r][b])));
    }
  }
}

using TileFn = void (*)(const c10::BFloat16*, int64_t, const __m512bh*, int64_t, c10::BFloat16*, int64_t);

template <int Rows>
constexpr TileFn tile_for_blocks(int blocks) {
  return blocks == 1 ? &tile<Rows, 1> : blocks == 2 ? &tile<Rows, 2> : &tile<Rows, 3>;
}

TileFn tile_for(int rows, int blocks) {
  switch (rows) {
    case 1: return tile_for_blocks<1>(blocks);
    case 2: return tile_for_blocks<2>(blocks);
    case 3: return tile_for_blocks<3>(blocks);
    case 4: return tile_for_blocks<4>(blocks);
    case 5: return tile_for_blocks<5>(blocks);
    case 6: return tile_for_blocks<6>(blocks);
    case 7: return tile_for_blocks<7>(blocks);
    default: return tile_for_blocks<8>(blocks);
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

// x: [M, K] bfloat16 (rows may be strided); packed from bf16_pack_weight; out: [M, N] bfloat16, rows may be
// strided. No bias (the models here have none).
void bf16_linear(const at::Tensor& x, const at::Tensor& packed, at::Tensor out) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu() && out.device().is_cpu(), "bf16_linear: CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16,
              "bf16_linear: bfloat16 only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.dim() == 2 && out.stride(1) == 1,
              "bf16_linear: x [M, K] and out [M, N] with contiguous rows");
  TORCH_CHECK(packed.dim() == 2 && packed.is_contiguous(), "bf16_linear: packed weight from bf16_pack_weight");
  const int64_t m = x.size(0), k = x.size(1), blocks = packed.size(0), n = blocks * kBlock;
  TORCH_CHECK(packed.size(1) == k * kBlock, "bf16_linear: the packed weight's in features differ from x's");
  TORCH_CHECK(out.size(0) == m && out.size(1) == n, "bf16_linear: out must be [M, N]");
  if (m == 0) return;
  const int64_t pairs = k / 2;
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  const auto* wp = reinterpret_cast<const __m512bh*>(packed.data_ptr<c10::BFloat16>());
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  const int64_t ldx = x.stride(0), ldo = out.stride(0);
  // A unit: a run of tiles' worth of blocks (all rows), at least kMinUnitBytes of weight.
  const int64_t block_bytes = k * kBlock * 2;
  const int64_t tiles_per_unit = std::max<int64_t>(1, kMinUnitBytes / (block_bytes * kMaxBlocks));
  const int64_t blocks_per_unit = tiles_per_unit * kMaxBlocks;
  const int64_t units = (blocks + blocks_per_unit - 1) / blocks_per_unit;
  const std::function<void(int64_t)> body = [&](int64_t unit) {
    const int64_t b0 = unit * blocks_per_unit, b1 = std::min(blocks, b0 + blocks_per_unit);
    for (int64_t b = b0; b < b1; b += kMaxBlocks) {
      const int nb = static_cast<int>(std::min<int64_t>(kMaxBlocks, b1 - b));
      for (int64_t r = 0; r < m; r += kMaxRows) {
        const int nr = static_cast<int>(std::min<int64_t>(kMaxRows, m - r));
        tile_for(nr, nb)(xp + r * ldx, ldx, wp + b * pairs, pairs, op + r * ldo + b * kBlock, ldo);
      }
    }
  };
  WorkSharing::instance().run(units, body);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloom, m) {
  m.def("bf16_pack_weight(Tensor w) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor packed, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(tokenloom, CPU, m) {
  m.impl("bf16_pack_weight", &bf16_pack_weight);
  m.impl("bf16_linear", &bf16_linear);
}

#endif  // __AVX512BF16__
