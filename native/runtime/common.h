// Shared helpers for the MoE kernels: bf16 conversion, checks, the thread pool.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "moe.h"

#define MOE_CHECK(cond, msg)                                                       \
  do {                                                                             \
    if (!(cond)) throw std::invalid_argument(std::string("moe kernel: ") + (msg)); \
  } while (0)

// Fully unroll a micro-kernel's loops over its register tile. Every loop that touches the
// accumulator array must be unrolled before GCC's scalar replacement runs, or GCC 12 keeps the
// array on the stack and stores and copies all accumulators every iteration (int8 prefill ran at a third
// of the VNNI peak that way).
#define MOE_UNROLL _Pragma("GCC unroll 16")

namespace moe {

// A micro-kernel's R row streams from base, ld apart; a short last block (nr < R) repeats row 0,
// whose sums the caller drops.
template <int R, class T>
inline void row_streams(const T* base, size_t ld, int nr, const T* (&p)[R]) {
  MOE_UNROLL for (int r = 0; r < R; ++r) p[r] = base + (r < nr ? r : 0) * ld;
}

// How the kernels stream weights, chosen by interleaved A/B runs (bench/bench_tuning.py; docs/performance/kernels.md):
// software-prefetch this many bytes ahead in each row stream of the multi-token tiles, AVX2's one-token passes
// and q5k/q6k (the hardware prefetcher stops at 4 KiB page ends; AVX-512's one-token streams do not prefetch: several
// rows in flight hide the latency there), and cut work into tasks of about this many weight bytes (each task start is
// a new stream that ramps up again; 64-row tasks cost int4 decode a third of its speed); decode attention fetches
// up to this many bytes of a head's V into L2 while its scores read K (attention.cpp; half this core's L2, so
// that the rows do not evict each other or K's stream before their use; 0: none).
// AVX-512's prefill of the formats with a scale per group pairs 16-row blocks (each broadcast activation chunk serving
// both) from this many tokens a call on (0: never; gemm_blocked_avx512.h).
// MOE_PF_BYTES / MOE_TASK_KB / MOE_V_PREFETCH_KB / MOE_PAIR_FROM override at start; set_tuning() between calls
// (benchmarks).
struct Tuning {
  size_t pf_bytes = 32768;
  size_t task_bytes = size_t(1) << 20;
  int pair_from_tokens = 8;
  size_t v_prefetch_bytes = [] {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);  // (0 or -1 where the system does not say: 1 MiB assumed)
    return size_t(l2 > 0 ? l2 : 1 << 20) / 2;
  }();
};
// The calling thread's T, through a call. A thread_local named in place costs a __tls_get_addr call at each use
// in this shared object (GCC's PIC code does not keep its address, not even through a reference bound to it): 29
// call sites in each blocked kernel's loop over 16-row blocks, 33 in the decode loop. Here: one call a use site.
template <class T>
__attribute__((noinline)) T& thread_scratch() {
  static thread_local T t;
  return t;
}

inline Tuning& tuning() {
  static Tuning t = [] {
    Tuning d;
    if (const char* v = std::getenv("MOE_PF_BYTES")) d.pf_bytes = size_t(std::atoll(v));
    if (const char* v = std::getenv("MOE_TASK_KB")) d.task_bytes = size_t(std::atoll(v)) * 1024;
    if (const char* v = std::getenv("MOE_V_PREFETCH_KB")) d.v_prefetch_bytes = size_t(std::atoll(v)) * 1024;
    if (const char* v = std::getenv("MOE_PAIR_FROM")) d.pair_from_tokens = std::atoi(v);
    return d;
  }();
  return t;
}
// Rows per task for rows of `row_bytes`: about task_bytes, in whole 64-row blocks, 64..1024.
inline int task_rows(size_t row_bytes) {
  size_t rows = tuning().task_bytes / row_bytes / 64 * 64;
  return int(rows < 64 ? 64 : rows > 1024 ? 1024 : rows);
}
// Prefetch offset in rows for rows of `row_bytes`: at least one block of `rb` rows ahead.
inline size_t prefetch_rows(size_t row_bytes, int rb) {
  size_t rows = (tuning().pf_bytes + row_bytes - 1) / row_bytes;
  rows = (rows + rb - 1) / rb * rb;
  return rows < size_t(rb) ? size_t(rb) : rows;
}

// One line into L1 (prefetch_t0) or L2 (prefetch_t1), as _mm_prefetch, but one the compiler cannot drop: GCC 12
// deletes _mm_prefetch / __builtin_prefetch whose address comes through a table read in the loop (decode attention's
// paged rows: not one prefetch instruction was left in those kernels, objdump; docs/performance/kernels.md, "The paged path's
// prefetches were never there").
inline void prefetch_t0(const void* p) { asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p))); }
inline void prefetch_t1(const void* p) { asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p))); }

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

// IEEE half <-> fp32 with torch's results (c10::Half: round to nearest even, overflow to inf, subnormals kept; a NaN
// becomes the quiet 0x7e00 with its sign). Integer arithmetic only, so no build or fp-contract setting changes a bit.
inline float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, u;
  if (e == 0x1f) {
    u = sign | 0x7f800000 | (m << 13);
  } else if (e) {
    u = sign | ((e + 112) << 23) | (m << 13);
  } else if (!m) {
    u = sign;
  } else {  // subnormal: normalize its leading bit into the exponent
    const int s = __builtin_clz(m) - 21;
    u = sign | ((113 - s) << 23) | (((m << s) & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000, ax = x & 0x7fffffff;
  if (ax > 0x7f800000) return uint16_t(sign | 0x7e00);
  if (ax >= 0x477ff000) return uint16_t(sign | 0x7c00);  // 65520 and above round to inf
  if (ax >= 0x38800000) {                                // a normal half: rebias the exponent, round 13 bits off
    uint32_t m = ax - 0x38000000;
    m += 0xfff + ((m >> 13) & 1);
    return uint16_t(sign | (m >> 13));
  }
  if (ax <= 0x33000000) return uint16_t(sign);  // up to 2^-25 (a tie with 0): zero
  const uint32_t e = ax >> 23, mant = (ax & 0x7fffff) | 0x800000, shift = 126 - e;  // a subnormal half: 2^-24 units
  const uint32_t half = 1u << (shift - 1), rem = mant & ((1u << shift) - 1);
  uint32_t r = mant >> shift;
  if (rem > half || (rem == half && (r & 1))) ++r;
  return uint16_t(sign | r);
}

// Activations of several rows in one format (bf16 rows, u8 rows q + 128 with a scale each, or fp8's fp32 rows
// each followed by its bf16 rounding).
struct ActBuf {
  std::vector<uint8_t> data;
  std::vector<float> scale, scales_of_slot;
  std::vector<const void*> rows;
  size_t row_bytes = 0;

  void resize(Fmt fmt, int n, int Kp) {
    row_bytes = fmt == Fmt::Bf16 ? size_t(Kp) * 2 : fmt == Fmt::Fp8 ? size_t(Kp) * 6 : size_t(Kp);
    data.assign(size_t(n) * row_bytes, 0);  // zero padding: the kernels read whole rows
    scale.assign(n, 1.f);
  }
  Acts view(const int* row_of_slot, int ns) {  // slot s reads row row_of_slot[s] (or s)
    rows.resize(ns);
    scales_of_slot.resize(ns);
    for (int s = 0; s < ns; ++s) {
      int r = row_of_slot ? row_of_slot[s] : s;
      rows[s] = data.data() + size_t(r) * row_bytes;
      scales_of_slot[s] = scale[r];
    }
    return Acts{rows.data(), scales_of_slot.data()};
  }
};

// `bytes` of v (grown as needed, its capacity kept) from its first 64-byte line, as tile loads and aligned vector
// stores want
template <class T>
inline T* line_aligned(std::vector<T>& v, size_t bytes) {
  const size_t n = (bytes + 64 + sizeof(T) - 1) / sizeof(T);
  if (v.size() < n) v.resize(n);
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(v.data()) + 63) / 64 * 64);
}

// The drivers' scratch memory: one arena, owned with the pool, used by one forward at a time
// (every kernel call holds compute_mutex()). Buffers keep their capacity between calls (fresh
// multi-MB buffers page-fault on every call), but release() after a call frees every buffer
// above `keep` bytes, so one long prefill does not pin its peak for the life of the process.
struct Scratch {
  std::vector<float> x32, y32, gu, y;  // part: hidden in fp32, output; driver: gate/up, down outputs
  std::vector<int32_t> ids, isel;     // part: private copy of the ids (never index with shared memory),
  std::vector<float> wts, wsel;       // of the weights, and the deferral split's selection
  std::vector<uint8_t> amx;
  ActBuf xb, act;
  // `bytes` of the AMX buffer (activations in tile layout), starting on a 64-byte line as tile loads like
  uint8_t* amx_space(size_t bytes) { return line_aligned(amx, bytes); }
  // Frees every buffer above `keep` bytes; returns the bytes freed.
  size_t release(size_t keep);
  size_t bytes();  // held now

 private:
  template <class F>
  void each(F f) {  // every buffer of the arena, once
    f(x32), f(y32), f(gu), f(y), f(wts), f(wsel), f(ids), f(isel), f(amx);
    for (ActBuf* b : {&xb, &act}) f(b->data), f(b->scale), f(b->scales_of_slot), f(b->rows);
  }
};

// A fixed pool created once and shared by every layer: parallel_for hands out task indices
// from an atomic counter; the calling thread works too. Workers spin for a short while after each
// job before sleeping on a condition variable, so the phases of one forward (a few per layer, each
// a few hundred microseconds at decode) hand over in well under a microsecond instead of paying a
// futex wake-up each; between requests they sleep and cost nothing.
// A task that throws: the first exception is kept, the remaining tasks are skipped, and it is
// rethrown on the calling thread once every worker has checked in (never while workers still
// run tasks that reference the caller's stack).
class ThreadPool {
 public:
  explicit ThreadPool(int n);
  ~ThreadPool();
  int size() const { return int(workers_.size()) + 1; }
  void parallel_for(int n_tasks, const std::function<void(int)>& fn);
  // Tasks in groups (NUMA nodes): [group_start[g], group_start[g+1]) belong to group g. Each thread
  // takes tasks of its own node's group first, then helps the others.
  void parallel_for_grouped(const int* group_start, int groups, const std::function<void(int)>& fn);
  Scratch scratch;

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
  std::atomic<bool> failed_{false};  // a task of the current generation threw
  std::mutex error_mu_;
  std::exception_ptr error_;
  int64_t spin_ns_;
};

// Every native kernel call holds this: the pool and its scratch arena serve one forward at a time.
std::mutex& compute_mutex();

ThreadPool& pool(int threads = 0);  // the process-wide pool (sized on first use)
int resize_pool(int threads);       // takes compute_mutex(): never swaps the pool under a running forward
// After a forward (compute_mutex() held): give back scratch buffers above this many bytes.
constexpr size_t SCRATCH_KEEP = size_t(32) << 20;
void release_scratch(size_t keep = SCRATCH_KEEP);

}  // namespace moe
