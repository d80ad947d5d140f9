#include "contention.h"

#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace moe {

static int usable_cpus() {
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
#endif
  return 1;
}

static int procs_running() {  // -1: unknown
  FILE* f = std::fopen("/proc/stat", "r");
  if (!f) return -1;
  char line[256];
  int n = -1;
  while (std::fgets(line, sizeof(line), f))
    if (std::strncmp(line, "procs_running ", 14) == 0) {
      n = std::atoi(line + 14);
      break;
    }
  std::fclose(f);
  return n;
}

static int spin_mode() {  // MOE_SPIN: 0 the sample decides, 1 always, 2 never, 3 yield
  static const int mode = [] {
    const char* v = std::getenv("MOE_SPIN");
    return !v ? 0 : std::strcmp(v, "always") == 0 ? 1 : std::strcmp(v, "never") == 0 ? 2
                  : std::strcmp(v, "yield") == 0 ? 3 : 0;
  }();
  return mode;
}

bool spin_yields() { return spin_mode() == 3; }

void spin_pause() {
  if (spin_yields()) {
    sched_yield();
  } else {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
}

bool cpu_contended() {
  const int forced = spin_mode() == 3 ? 0 : spin_mode();
  if (forced) return forced == 2;
  static std::atomic<int64_t> next_ns{0};
  static std::atomic<bool> contended{false};
  const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::steady_clock::now().time_since_epoch()).count();
  int64_t due = next_ns.load(std::memory_order_relaxed);
  if (now >= due && next_ns.compare_exchange_strong(due, now + 20'000'000)) {  // one thread samples
    static const int cpus = usable_cpus();
    const int running = procs_running();
    contended.store(running > cpus, std::memory_order_relaxed);
  }
  return contended.load(std::memory_order_relaxed);
}

}  // namespace moe
