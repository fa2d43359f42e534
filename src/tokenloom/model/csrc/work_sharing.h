// Work sharing between the calling thread and helper threads that sleep between jobs, for the operators whose
// jobs are short (decode steps): tokenloom::WorkSharing::instance().run(units, body).
//
// Why not OpenMP's parallel_for: with OMP_WAIT_POLICY=PASSIVE (which we keep so other processes on the machine
// are not starved) every parallel region first wakes its sleeping worker, which on our VMs takes 50-100 us, and
// the region's static split then waits for it. A decode step runs ~150 such regions; a 4-row step spent half its
// time waiting. Here the caller starts on the first unit at once, helpers are rung and take units from the same
// counter when they are awake, and the caller waits only for units a helper has already taken (each a few
// microseconds). A helper that wakes late costs only its absence; one that sleeps through a short job is never
// waited for. Helpers sleep on a futex between jobs: nothing spins while idle.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace tokenloom {

class WorkSharing {
 public:
  static WorkSharing& instance() {
    static WorkSharing* pool = new WorkSharing();  // never destroyed: its detached helpers outlive static destruction
    return *pool;
  }

  // Runs body(unit) once for every unit in [0, units), on the caller and on any helper that is awake. Jobs from
  // different threads run one at a time. body must not throw: a helper may still be running a unit of it.
  void run(int64_t units, const std::function<void(int64_t)>& body) {
    TORCH_CHECK(units >= 0 && units <= static_cast<int64_t>(kCountMask), "work sharing: too many units");
    const int helpers = kCanSleep ? std::max(0, at::get_num_threads() - 1) : 0;
    if (helpers == 0 || units <= 1) {
      for (int64_t u = 0; u < units; ++u) body(u);
      return;
    }
    std::lock_guard<std::mutex> one_job_at_a_time(job_mutex_);
    start_helpers(helpers);
    body_ = &body;
    helper_done_.store(0, std::memory_order_relaxed);
    generation_ = (generation_ + 1) & kGenerationMask;
    ticket_.store(pack(generation_, 0, static_cast<uint64_t>(units)), std::memory_order_release);
    bell_.fetch_add(1, std::memory_order_release);
    wake_all();
    const int64_t mine = take_units(generation_, /*helper=*/false);
    // Wait only for units a helper has taken: microseconds, unless its thread was preempted, hence the yield.
    for (int spins = 0; helper_done_.load(std::memory_order_acquire) + mine < units; ++spins) {
      if (spins < 20000) {
        pause();
      } else {
        std::this_thread::yield();
      }
    }
  }

 private:
#if defined(__linux__)
  static constexpr bool kCanSleep = true;
#else
  static constexpr bool kCanSleep = false;  // no futex: everything runs on the caller
#endif
  static constexpr int kCountBits = 20;
  static constexpr uint64_t kCountMask = (uint64_t{1} << kCountBits) - 1;
  static constexpr uint64_t kGenerationMask = (uint64_t{1} << (64 - 2 * kCountBits)) - 1;

  // The ticket holds the job's generation, its next unit and its unit count in one word, so a helper that read a
  // finished job's ticket can never take a unit of the next one: its compare-exchange fails.
  static uint64_t pack(uint64_t generation, uint64_t next, uint64_t total) {
    return (generation << (2 * kCountBits)) | (next << kCountBits) | total;
  }

  static void pause() {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }

  // Takes units of the job `generation` until none is left; returns how many this thread ran.
  int64_t take_units(uint64_t generation, bool helper) {
    int64_t ran = 0;
    for (;;) {
      uint64_t ticket = ticket_.load(std::memory_order_acquire);
      const uint64_t next = (ticket >> kCountBits) & kCountMask, total = ticket & kCountMask;
      if ((ticket >> (2 * kCountBits)) != generation || next >= total) return ran;
      if (!ticket_.compare_exchange_weak(ticket, ticket + (uint64_t{1} << kCountBits), std::memory_order_acq_rel)) {
        continue;
      }
      (*body_)(static_cast<int64_t>(next));  // the job cannot end (and body_ change) before this unit is counted
      ++ran;
      if (helper) helper_done_.fetch_add(1, std::memory_order_release);
    }
  }

  void helper_loop() {
    for (;;) {
      const uint32_t rung = bell_.load(std::memory_order_acquire);
      take_units(ticket_.load(std::memory_order_acquire) >> (2 * kCountBits), /*helper=*/true);
      sleep_unless_rung_since(rung);
    }
  }

  void start_helpers(int helpers) {
    for (; started_ < helpers; ++started_) std::thread([this] { helper_loop(); }).detach();
  }

#if defined(__linux__)
  void wake_all() {
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&bell_), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
  }
  void sleep_unless_rung_since(uint32_t rung) {
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&bell_), FUTEX_WAIT_PRIVATE, rung, nullptr, nullptr, 0);
  }
#else
  void wake_all() {}
  void sleep_unless_rung_since(uint32_t) {}
#endif

  std::mutex job_mutex_;
  int started_ = 0;
  std::atomic<uint32_t> bell_{0};
  std::atomic<uint64_t> ticket_{0};
  std::atomic<int64_t> helper_done_{0};
  uint64_t generation_ = 0;
  const std::function<void(int64_t)>* body_ = nullptr;
};

}  // namespace tokenloom
