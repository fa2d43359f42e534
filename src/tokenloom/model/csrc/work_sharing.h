// Work sharing between the calling thread and helper threads that sleep between jobs, for the operators whose
// jobs are short (decode steps): tokenloom::WorkSharing::instance().run(units, body).
//
// Why not OpenMP's parallel_for: with OMP_WAIT_POLICY=PASSIVE (which we keep so other processes on the machine
// are not starved) every parallel region first wakes its sleeping worker, which on our VMs takes 50-100 us, and
// the region's static split then waits for it. A decode step runs ~150 such regions; a 4-row step spent half its
// time waiting. Here the caller starts on the first unit at once, helpers are rung and take units from the same
// counter when they are awake, and the caller waits only for units a helper has already taken (each a few
// microseconds). A helper that wakes late costs only its absence; one that sleeps through a short job is never
// waited for.
//
// After a job a helper stays awake for up to 300 us (TOKENLOOM_HELPER_SPIN_US; 0: never), since within a step the
// next job follows in microseconds, then sleeps on a futex: nothing spins while idle. It spins only while nobody
// waits for a CPU: if the caller's thread or the helper itself waited more than 2% of the last 20 ms, something else
// wants these cores, and a spinning helper would take time from it or, looking like load to the scheduler, push our
// caller onto the busy core (measured with one busy process: decode steps 18-50% slower with an unconditional spin,
// unchanged with this one; on a quiet machine decode steps ~4% faster with it; benchmarks/helper_spin.py).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
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
    caller_tid_.store(thread_id(), std::memory_order_relaxed);
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

  void helper_loop(int index) {
    for (;;) {
      const uint32_t rung = bell_.load(std::memory_order_acquire);
      take_units(ticket_.load(std::memory_order_acquire) >> (2 * kCountBits), /*helper=*/true);
      if (index == 0) reassess_spinning();
      if (!rung_while_spinning(rung)) sleep_unless_rung_since(rung);
    }
  }

  void start_helpers(int helpers) {
    for (; started_ < helpers; ++started_) std::thread([this, index = started_] { helper_loop(index); }).detach();
  }

  static int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  static int64_t spin_ns_from_environment() {
    const char* value = std::getenv("TOKENLOOM_HELPER_SPIN_US");
    return value == nullptr ? 300'000 : std::max(0L, std::atol(value)) * 1000;
  }

  // Up to spin_ns_ awake after a job, while spinning is allowed: true if the next job rang meanwhile.
  bool rung_while_spinning(uint32_t rung) {
    if (spin_ns_ == 0 || !spin_allowed_.load(std::memory_order_relaxed)) return false;
    const int64_t until = now_ns() + spin_ns_;
    do {
      for (int i = 0; i < 16; ++i) pause();
      if (bell_.load(std::memory_order_acquire) != rung) return true;
    } while (now_ns() < until);
    return false;
  }

  // Every 20 ms (helper 0 only): spinning stays allowed while the caller's thread and this one together waited for a
  // CPU less than 2% of the time since the last look.
  void reassess_spinning() {
    const int64_t now = now_ns();
    if (now - last_look_ns_ < 20'000'000) return;
    const int64_t caller = run_delay_ns(caller_tid_.load(std::memory_order_relaxed)), self = run_delay_ns(thread_id());
    const int64_t waited = caller + self;
    const bool known = caller >= 0 && self >= 0 && last_look_ns_ > 0 && last_waited_ns_ >= 0;
    spin_allowed_.store(known && (waited - last_waited_ns_) * 50 < now - last_look_ns_, std::memory_order_relaxed);
    last_look_ns_ = now;
    last_waited_ns_ = caller >= 0 && self >= 0 ? waited : -1;
  }

#if defined(__linux__)
  static int thread_id() {
    thread_local const int id = static_cast<int>(syscall(SYS_gettid));
    return id;
  }

  // Nanoseconds the thread has waited for a CPU while runnable (the second field of its schedstat), or -1.
  static int64_t run_delay_ns(int tid) {
    char path[64];
    std::snprintf(path, sizeof(path), "/proc/self/task/%d/schedstat", tid);
    FILE* file = std::fopen(path, "r");
    if (file == nullptr) return -1;
    long long on_cpu = 0, waited = -1;
    if (std::fscanf(file, "%lld %lld", &on_cpu, &waited) != 2) waited = -1;
    std::fclose(file);
    return waited;
  }
#else
  static int thread_id() { return 0; }
  static int64_t run_delay_ns(int) { return -1; }  // unknown: never spin
#endif

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

  const int64_t spin_ns_ = spin_ns_from_environment();
  std::atomic<bool> spin_allowed_{false};
  std::atomic<int> caller_tid_{0};
  int64_t last_look_ns_ = 0, last_waited_ns_ = -1;  // helper 0's alone
  std::mutex job_mutex_;
  int started_ = 0;
  std::atomic<uint32_t> bell_{0};
  std::atomic<uint64_t> ticket_{0};
  std::atomic<int64_t> helper_done_{0};
  uint64_t generation_ = 0;
  const std::function<void(int64_t)>* body_ = nullptr;
};

}  // namespace tokenloom
