#include <malloc.h>

#include <chrono>
#include <cstdlib>
#include <memory>
#include <type_traits>

#include <pthread.h>
#include <sched.h>

#include "runtime/common.h"
#include "runtime/contention.h"
#include "runtime/numa.h"

namespace moe {

static inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

static int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

ThreadPool::ThreadPool(int n) {
  const char* env = std::getenv("MOE_SPIN_US");  // 0: sleep at once (machines shared with other work)
  spin_ns_ = (env ? std::atoll(env) : 200) * 1000;
  const NumaTopology& topo = numa();
  for (int i = 1; i < n; ++i) home_.push_back(i % topo.nodes);  // the caller (index 0) is usually on node 0
  for (int i = 1; i < n; ++i) {
    workers_.emplace_back([this, i] { worker_loop(i); });
    if (topo.nodes > 1 && topo.node_id[0] >= 0) {  // real nodes: keep each worker on its node's CPUs
      cpu_set_t set;
      CPU_ZERO(&set);
      for (int c : topo.cpus[home_[i - 1]]) CPU_SET(c, &set);
      pthread_setaffinity_np(workers_.back().native_handle(), sizeof(set), &set);
    }
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::run_tasks(int home) {
  const int G = groups_;
  home = std::min(home, G - 1);
  for (int j = 0; j < G; ++j) {
    const int g = (home + j) % G, base = group_start_[g], n = group_start_[g + 1] - base;
    for (int i = next_[g].fetch_add(1); i < n; i = next_[g].fetch_add(1)) {
      if (failed_.load(std::memory_order_relaxed)) continue;  // drain the counter, run nothing more
      try {
        (*fn_)(base + i);
      } catch (...) {
        std::lock_guard<std::mutex> lk(error_mu_);
        if (!error_) error_ = std::current_exception();
        failed_.store(true, std::memory_order_relaxed);
      }
    }
  }
}

void ThreadPool::worker_loop(int index) {
  uint64_t seen = 0;
  for (;;) {
    uint64_t g;
    // the phases of one forward follow within microseconds: worth a short spin even when contended
    const SpinPolicy spin = spin_policy(spin_ns_);
    const int64_t until = now_ns() + spin.budget_ns;
    for (int spins = 0; (g = generation_.load(std::memory_order_acquire)) == seen && !stop_.load(); ++spins) {
      if ((spin.yields || (spins & 63) == 63) && now_ns() > until) {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stop_.load() || generation_.load() != seen; });
      } else {
        spin_pause(spin.yields);
      }
    }
    if (stop_) return;
    seen = g;
    run_tasks(home_[index - 1]);
    // every worker checks in once per generation, so none can carry a stale task list into the next
    finished_.fetch_add(1, std::memory_order_release);
  }
}

void ThreadPool::parallel_for(int n_tasks, const std::function<void(int)>& fn) {
  const int range[2] = {0, n_tasks};
  parallel_for_grouped(range, 1, fn);
}

void ThreadPool::parallel_for_grouped(const int* group_start, int groups, const std::function<void(int)>& fn) {
  MOE_CHECK(groups >= 1 && groups <= MAX_GROUPS, "bad task group count");
  const int n_tasks = group_start[groups] - group_start[0];
  if (workers_.empty() || n_tasks <= 1) {
    for (int i = group_start[0]; i < group_start[groups]; ++i) fn(i);
    return;
  }
  // the previous call returned only once every worker checked in: nobody reads these now
  fn_ = &fn;
  group_start_ = group_start;
  groups_ = groups;
  for (int g = 0; g < groups; ++g) next_[g].store(0, std::memory_order_relaxed);
  finished_.store(0, std::memory_order_relaxed);
  failed_.store(false, std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> g(mu_);  // a worker about to sleep either sees the new generation or gets the notify
    generation_.fetch_add(1, std::memory_order_release);
  }
  cv_.notify_all();
  run_tasks(groups > 1 ? numa_current_node() : 0);
  // the rest is at most one task per worker: spin, yielding if a worker was descheduled (at once
  // when the machine is oversubscribed: the straggler may be waiting for this very core)
  const bool yield_now = cpu_contended() || waits_yield();  // or a yielding waiter may hold the straggler's core
  for (int spins = 0; finished_.load(std::memory_order_acquire) < int(workers_.size()); ++spins) {
    if (yield_now || spins > 4096) std::this_thread::yield();
    else cpu_relax();
  }
  fn_ = nullptr;
  if (failed_.load(std::memory_order_acquire)) {  // every worker has checked in: safe to unwind
    std::exception_ptr e;
    {
      std::lock_guard<std::mutex> lk(error_mu_);
      std::swap(e, error_);
    }
    std::rethrow_exception(e);
  }
}

static std::unique_ptr<ThreadPool> g_pool;
static std::mutex g_pool_mu;

ThreadPool& pool(int threads) {
  std::lock_guard<std::mutex> g(g_pool_mu);
  if (!g_pool) g_pool = std::make_unique<ThreadPool>(threads > 0 ? threads : int(std::thread::hardware_concurrency()));
  return *g_pool;
}

int resize_pool(int threads) {
  std::lock_guard<std::mutex> c(compute_mutex());
  std::lock_guard<std::mutex> g(g_pool_mu);
  g_pool.reset();  // join the old workers before starting new ones (2 cores: no overlap)
  g_pool = std::make_unique<ThreadPool>(threads > 0 ? threads : int(std::thread::hardware_concurrency()));
  return g_pool->size();
}

std::mutex& compute_mutex() {
  static std::mutex mu;
  return mu;
}

template <class V>
static size_t capacity_bytes(const V& v) {
  return v.capacity() * sizeof(typename V::value_type);
}

size_t Scratch::release(size_t keep) {
  size_t freed = 0;
  each([&](auto& v) {
    if (capacity_bytes(v) > keep) {
      freed += capacity_bytes(v);
      std::remove_reference_t<decltype(v)>().swap(v);
    }
  });
  return freed;
}

size_t Scratch::bytes() {
  size_t n = 0;
  each([&](auto& v) { n += capacity_bytes(v); });
  return n;
}

void release_scratch(size_t keep) {
  // buffers above glibc's mmap threshold go back to the OS on free; trim gives back heap pages too
  if (pool().scratch.release(keep)) malloc_trim(0);
}

}  // namespace moe
