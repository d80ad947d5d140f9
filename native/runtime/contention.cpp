#include "runtime/contention.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>

namespace moe {

namespace {

int64_t now_ns() {  // CLOCK_MONOTONIC: one clock for every process (and container) on the host
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int64_t process_cpu_ns() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return int64_t(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

int usable_cpus() {
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
#endif
  return 1;
}

// /proc/stat: procs_running, and the CPU time spent so far (user + nice + system + irq + softirq, ns; steal and
// idle not); -1 where unreadable
void proc_stat(int* running, int64_t* busy_ns) {
  *running = -1, *busy_ns = -1;
  FILE* f = std::fopen("/proc/stat", "r");
  if (!f) return;
  static const double tick_ns = 1e9 / double(sysconf(_SC_CLK_TCK));
  char line[512];
  while (std::fgets(line, sizeof(line), f)) {
    unsigned long long u, n, s, idle, io, irq, sirq;
    if (std::strncmp(line, "cpu ", 4) == 0 &&
        std::sscanf(line + 4, "%llu %llu %llu %llu %llu %llu %llu", &u, &n, &s, &idle, &io, &irq, &sirq) == 7)
      *busy_ns = int64_t(double(u + n + s + irq + sirq) * tick_ns);
    else if (std::strncmp(line, "procs_running ", 14) == 0)
      *running = std::atoi(line + 14);
  }
  std::fclose(f);
}

int spin_mode() {  // MOE_SPIN: 0 the samples decide, 1 always (pause hint), 2 never (sleep), 3 yield
  static const int mode = [] {
    const char* v = std::getenv("MOE_SPIN");
    return !v ? 0 : std::strcmp(v, "always") == 0 ? 1 : std::strcmp(v, "never") == 0 ? 2
                  : std::strcmp(v, "yield") == 0 ? 3 : 0;
  }();
  return mode;
}

// The board: a slot per process of ours on this host, its CPU time and when it last said so. POSIX shared
// memory of this user (the services share /dev/shm on one host, as the exchange ring does; compose: one IPC
// namespace); where
// that fails, this process's own board, and the other service's CPU time then looks foreign (the safe side).
// A slot silent for STALE_NS is free again; a dead process's CPU time stops moving, which adds nothing.
constexpr int SLOTS = 64;
constexpr int64_t STALE_NS = 5'000'000'000;
struct Slot {
  std::atomic<uint64_t> token;  // 0: free
  std::atomic<int64_t> cpu_ns, beat_ns;
};
struct Board {
  Slot slot[SLOTS];
};

Board* board() {
  static Board* b = [] {
    static Board local{};
    // one board per user, owner-only as the exchange's regions are (another user's processes count as foreign)
    char name[64];
    std::snprintf(name, sizeof(name), "/moe-cpu-board-%u", unsigned(getuid()));
    const int fd = shm_open(name, O_RDWR | O_CREAT, 0600);
    if (fd < 0) return &local;
    void* p = ftruncate(fd, sizeof(Board)) == 0
                  ? mmap(nullptr, sizeof(Board), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
    close(fd);
    return p == MAP_FAILED ? &local : static_cast<Board*>(p);
  }();
  return b;
}

std::atomic<int> my_slot{-1};

uint64_t my_token() {
  static const uint64_t t = [] {
    std::random_device rd;
    return (uint64_t(rd()) << 32 | rd()) | 1;
  }();
  return t;
}

// This process's CPU time onto the board (claiming a slot first, or again after going stale), at most every
// PUBLISH_NS: the process clock is a system call, and the windows are SAMPLE_NS long.
constexpr int64_t PUBLISH_NS = 2'000'000;
std::atomic<int64_t> published_ns{-PUBLISH_NS};

void publish(int64_t now) {
  int64_t last = published_ns.load(std::memory_order_relaxed);
  if (now - last < PUBLISH_NS || !published_ns.compare_exchange_strong(last, now)) return;
  Board* b = board();
  int i = my_slot.load(std::memory_order_relaxed);
  const uint64_t me = my_token();
  if (i < 0 || b->slot[i].token.load(std::memory_order_relaxed) != me) {
    i = -1;
    for (int j = 0; j < SLOTS && i < 0; ++j) {
      uint64_t t = b->slot[j].token.load(std::memory_order_relaxed);
      if ((t == 0 || now - b->slot[j].beat_ns.load(std::memory_order_relaxed) > STALE_NS) &&
          b->slot[j].token.compare_exchange_strong(t, me)) {
        b->slot[j].cpu_ns.store(process_cpu_ns(), std::memory_order_relaxed);  // before the beat: a fresh start
        i = j;
      }
    }
    my_slot.store(i, std::memory_order_relaxed);
    if (i < 0) return;  // the board is full: this process's time looks foreign
  }
  b->slot[i].cpu_ns.store(process_cpu_ns(), std::memory_order_relaxed);
  b->slot[i].beat_ns.store(now, std::memory_order_relaxed);
}

struct Sampler {  // one thread at a time (next_ns's CAS)
  std::atomic<int64_t> next_ns{0};
  std::atomic<bool> shared{true}, contended{false};  // until the first window says otherwise
  int64_t t0 = -1, busy0 = 0;
  int quiet = 0;  // windows in a row without foreign CPU use
  // what the metrics read (contention_stats): the last window's foreign CPU use, windows judged, of them foreign,
  // and how often the waits turned to the shared policy
  std::atomic<double> foreign_last{0};
  std::atomic<int64_t> windows{0}, foreign_windows{0}, turned_shared{0};
  uint64_t token0[SLOTS] = {};
  int64_t cpu0[SLOTS] = {};

  void sample(int64_t now) {
    int running;
    int64_t busy;
    proc_stat(&running, &busy);
    static const int cpus = usable_cpus();
    contended.store(running > cpus, std::memory_order_relaxed);
    // our processes' CPU time over the window: per slot, what it moved while holding the same token
    Board* b = board();
    int64_t ours = 0;
    for (int j = 0; j < SLOTS; ++j) {
      const uint64_t t = b->slot[j].token.load(std::memory_order_relaxed);
      const int64_t c = b->slot[j].cpu_ns.load(std::memory_order_relaxed);
      if (t && t == token0[j] && c >= cpu0[j]) ours += c - cpu0[j];
      token0[j] = t, cpu0[j] = c;
    }
    if (busy >= 0 && t0 >= 0 && now > t0) {
      // shared at once, quiet again only after QUIET_WINDOWS windows in a row
      const double foreign = double(busy - busy0 - ours) / double(now - t0);
      quiet = foreign > FOREIGN_CPUS ? 0 : quiet + 1;
      const bool was = shared.exchange(quiet < QUIET_WINDOWS, std::memory_order_relaxed);
      foreign_last.store(foreign, std::memory_order_relaxed);
      windows.fetch_add(1, std::memory_order_relaxed);
      if (quiet == 0) foreign_windows.fetch_add(1, std::memory_order_relaxed);
      if (!was && quiet == 0) turned_shared.fetch_add(1, std::memory_order_relaxed);
    } else if (busy < 0) {
      shared.store(true, std::memory_order_relaxed);
    }
    t0 = now, busy0 = busy;
  }

  void maybe_sample(int64_t now, int64_t every) {
    int64_t due = next_ns.load(std::memory_order_relaxed);
    if (now >= due && next_ns.compare_exchange_strong(due, now + every)) sample(now);
  }
};

Sampler& sampler() {
  static Sampler s;
  return s;
}

}  // namespace

bool machine_shared() {
  const int mode = spin_mode();
  if (mode != 0) return mode == 2;
  const int64_t now = now_ns();
  sampler().maybe_sample(now, SAMPLE_NS);
  return sampler().shared.load(std::memory_order_relaxed);
}

bool cpu_contended() {
  const int mode = spin_mode();
  if (mode != 0) return mode == 2;
  sampler().maybe_sample(now_ns(), SAMPLE_NS);
  return sampler().contended.load(std::memory_order_relaxed);
}

ContentionStats contention_stats() {
  ContentionStats st;
  st.shared = machine_shared();  // samples first where a window is due (an idle service's state is otherwise old)
  st.contended = cpu_contended();
  Sampler& s = sampler();
  st.foreign_cpus = s.foreign_last.load(std::memory_order_relaxed);
  st.windows = s.windows.load(std::memory_order_relaxed);
  st.foreign_windows = s.foreign_windows.load(std::memory_order_relaxed);
  st.turned_shared = s.turned_shared.load(std::memory_order_relaxed);
  return st;
}

bool waits_yield() {
  const int mode = spin_mode();
  return mode == 3 || (mode == 0 && !machine_shared());
}

SpinPolicy spin_policy(long long ns) {
  const int mode = spin_mode();
  if (mode == 0) publish(now_ns());
  if (mode == 1) return {false, ns};
  if (waits_yield()) return {true, ns > YIELDING_SPIN_NS ? ns : YIELDING_SPIN_NS};
  return {false, cpu_contended() && ns > CONTENDED_SPIN_NS ? CONTENDED_SPIN_NS : ns};
}

long long yield_nap_after_ns() {
  static const long long ns = [] {
    const char* v = std::getenv("MOE_YIELD_NAP_US");
    return v ? std::atoll(v) * 1000 : YIELD_NAP_AFTER_NS;
  }();
  return ns;
}

void spin_pause(bool yields) {
  if (yields) {
    sched_yield();
  } else {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
}

}  // namespace moe
