#include <memory>

#include "common.h"

namespace moe {

ThreadPool::ThreadPool(int n) {
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
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return stop_ || generation_ != seen; });
    if (stop_) return;
    seen = generation_;
    auto* fn = fn_;
    int n = n_tasks_;
    lk.unlock();
    for (int i = next_.fetch_add(1); i < n; i = next_.fetch_add(1)) (*fn)(i);
    lk.lock();
    // every worker checks in once per generation, so none can carry a stale task list into the next
    if (++finished_ == int(workers_.size())) done_cv_.notify_all();
  }
}

void ThreadPool::parallel_for(int n_tasks, const std::function<void(int)>& fn) {
  if (workers_.empty() || n_tasks <= 1) {
    for (int i = 0; i < n_tasks; ++i) fn(i);
    return;
  }
  {
    std::lock_guard<std::mutex> g(mu_);
    fn_ = &fn;
    n_tasks_ = n_tasks;
    next_ = 0;
    finished_ = 0;
    ++generation_;
  }
  cv_.notify_all();
  for (int i = next_.fetch_add(1); i < n_tasks; i = next_.fetch_add(1)) fn(i);
  std::unique_lock<std::mutex> lk(mu_);
  done_cv_.wait(lk, [&] { return finished_ == int(workers_.size()); });
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
