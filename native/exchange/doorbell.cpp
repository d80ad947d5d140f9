// Doorbells for the shared-memory exchange ring (see moe_core/shm.py for the layout): a 32-bit
// counter in a shared mapping that one process bumps and the other waits on. Waiting spins for a
// short while (a result is often microseconds away; only briefly on an oversubscribed machine,
// see contention.h) and then sleeps on a futex; the futex is
// process-shared (no FUTEX_PRIVATE_FLAG) because the two sides are different processes.
#include "exchange/doorbell.h"

#include "runtime/contention.h"

#include <algorithm>
#include <chrono>

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#endif

namespace moe {

uint32_t doorbell_wait(std::atomic<uint32_t>* word, uint32_t seen, int64_t timeout_us, int64_t spin_us) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  const SpinPolicy spin = spin_policy(spin_us * 1000);
  const auto deadline = start + std::chrono::microseconds(timeout_us);
  const auto spin_end = std::min(deadline, start + std::chrono::nanoseconds(spin.budget_ns));
  const auto nap_after = std::chrono::nanoseconds(yield_nap_after_ns());
  auto yields_since = start;  // since when the yields have come straight back (contention.h YIELD_NAP_AFTER_NS)
  uint32_t v;
  // Spin: check the clock only every 64 polls, it costs more than a load.
  for (;;) {
    for (int i = 0; i < (spin.yields ? 1 : 64); ++i) {  // a yield costs more than the clock
      if ((v = word->load(std::memory_order_acquire)) != seen) return v;
      if (!spin.yields || nap_after.count() == 0) {
        spin_pause(spin.yields);
        continue;
      }
      const auto t0 = clock::now();
      spin_pause(true);
      const auto t1 = clock::now();
      if (t1 - t0 > std::chrono::nanoseconds(YIELD_BACK_NS)) {
        yields_since = t1;  // the core went to another thread
      } else if (t1 - yields_since > nap_after) {
#if defined(__linux__)
        struct timespec nap{0, long(YIELD_NAP_NS)};
        syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, seen, &nap, nullptr, 0);
#endif
        yields_since = clock::now();
      }
    }
    if (clock::now() >= spin_end) break;
  }
#if defined(__linux__)
  for (;;) {
    auto now = clock::now();
    if (now >= deadline) return word->load(std::memory_order_acquire);
    int64_t left_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - now).count();
    struct timespec ts{time_t(left_ns / 1000000000), long(left_ns % 1000000000)};
    // Returns at once if the word already moved on (EAGAIN); a wake without a change (the other side
    // leaving) returns the unchanged value so the caller can look at the ring's flags.
    long r = syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, seen, &ts, nullptr, 0);
    v = word->load(std::memory_order_acquire);
    if (v != seen || r == 0) return v;
  }
#else
  for (;;) {
    if ((v = word->load(std::memory_order_acquire)) != seen || clock::now() >= deadline) return v;
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
#endif
}

void doorbell_ring(std::atomic<uint32_t>* word, uint32_t value) {
  word->store(value, std::memory_order_release);
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
#endif
}

void doorbell_wake(std::atomic<uint32_t>* word) {
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
#endif
}

}  // namespace moe
