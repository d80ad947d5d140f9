// Shared helpers for the MoE kernels: bf16 conversion, checks, the thread pool.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#define MOE_CHECK(cond, msg)                                                       \
  do {                                                                             \
    if (!(cond)) throw std::invalid_argument(std::string("moe kernel: ") + (msg)); \
  } while (0)

namespace moe {

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch does
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffff) > 0x7f800000) return uint16_t((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7fff + ((u >> 16) & 1);
  return uint16_t(u >> 16);
}

// A fixed pool created once and shared by every layer: parallel_for hands out task indices
// from an atomic counter; the calling thread works too. Workers spin for a short while after each
// job before sleeping on a condition variable, so the phases of one forward (a few per layer, each
// a few hundred microseconds at decode) hand over in well under a microsecond instead of paying a
// futex wake-up each; between requests they sleep and cost nothing.
class ThreadPool {
 public:
  explicit ThreadPool(int n);
  ~ThreadPool();
  int size() const { return int(workers_.size()) + 1; }
  void parallel_for(int n_tasks, const std::function<void(int)>& fn);
  // Tasks in groups (NUMA nodes): [group_start[g], group_start[g+1]) belong to group g. Each thread
  // takes tasks of its own node's group first, then helps the others.
  void parallel_for_grouped(const int* group_start, int groups, const std::function<void(int)>& fn);

 private:
  static constexpr int MAX_GROUPS = 64;
  void worker_loop(int index);
  void run_tasks(int home);
  std::vector<std::thread> workers_;
  std::vector<int> home_;  // NUMA node of each worker
  std::mutex mu_;
  std::condition_variable cv_;
  const std::function<void(int)>* fn_ = nullptr;
  const int* group_start_ = nullptr;
  int groups_ = 1;
  std::atomic<int> next_[MAX_GROUPS];
  std::atomic<int> finished_{0};  // workers done with the current generation
  std::atomic<uint64_t> generation_{0};
  std::atomic<bool> stop_{false};
  int64_t spin_ns_;
};

ThreadPool& pool(int threads = 0);  // the process-wide pool (sized on first use)
int resize_pool(int threads);

}  // namespace moe
