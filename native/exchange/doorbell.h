// Cross-process doorbells on 32-bit counters in shared memory (the exchange ring's hot path).
#pragma once
#include <atomic>
#include <cstdint>
#include <thread>

namespace moe {
// Wait until *word != seen (spin for spin_us, then sleep on a futex), at most timeout_us.
// Returns the value seen last: == seen on timeout or on a bare wake (doorbell_wake).
uint32_t doorbell_wait(std::atomic<uint32_t>* word, uint32_t seen, int64_t timeout_us, int64_t spin_us);
// Store value (release) and wake every waiter.
void doorbell_ring(std::atomic<uint32_t>* word, uint32_t value);
// Wake every waiter without changing the value (a side leaving the ring).
void doorbell_wake(std::atomic<uint32_t>* word);
}  // namespace moe
