#include <chrono>
#include <cstdlib>
#include <memory>

#include "common.h"

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
  for (int i = 1; i < n; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::worker_loop() {
  uint64_t seen = 0;
  for (;;) {
    uint64_t g;
    const int64_t until = now_ns() + spin_ns_;
    for (int spins = 0; (g = generation_.load(std::memory_order_acquire)) == seen && !stop_.load(); ++spins) {
      if ((spins & 63) == 63 && now_ns() > until) {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stop_.load() || generation_.load() != seen; });
      } else {
        cpu_relax();
      }
    }
    if (stop_) return;
    seen = g;
    auto* fn = fn_;
    const int n = n_tasks_;
    for (int i = next_.fetch_add(1); i < n; i = next_.fetch_add(1)) (*fn)(i);
    // every worker checks in once per generation, so none can carry a stale task list into the next
    finished_.fetch_add(1, std::memory_order_release);
  }
}

void ThreadPool::parallel_for(int n_tasks, const std::function<void(int)>& fn) {
  if (workers_.empty() || n_tasks <= 1) {
    for (int i = 0; i < n_tasks; ++i) fn(i);
    return;
  }
  // the previous call returned only once every worker checked in: nobody reads these now
  fn_ = &fn;
  n_tasks_ = n_tasks;
  next_.store(0, std::memory_order_relaxed);
  finished_.store(0, std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> g(mu_);  // a worker about to sleep either sees the new generation or gets the notify
    generation_.fetch_add(1, std::memory_order_release);
  }
  cv_.notify_all();
  for (int i = next_.fetch_add(1); i < n_tasks; i = next_.fetch_add(1)) fn(i);
  // the rest is at most one task per worker: spin, yielding if a worker was descheduled
  for (int spins = 0; finished_.load(std::memory_order_acquire) < int(workers_.size()); ++spins) {
    if (spins > 4096) std::this_thread::yield();
    else cpu_relax();
  }
  fn_ = nullptr;
}

static std::unique_ptr<ThreadPool> g_pool;
static std::mutex g_pool_mu;

ThreadPool& pool(int threads) {
  std::lock_guard<std::mutex> g(g_pool_mu);
  if (!g_pool) g_pool = std::make_unique<ThreadPool>(threads > 0 ? threads : int(std::thread::hardware_concurrency()));
  return *g_pool;
}

int resize_pool(int threads) {
  std::lock_guard<std::mutex> g(g_pool_mu);
  g_pool = std::make_unique<ThreadPool>(threads > 0 ? threads : int(std::thread::hardware_concurrency()));
  return g_pool->size();
}

}  // namespace moe
