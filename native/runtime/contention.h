// How a thread that waits for work should spin, and whether the machine is shared with other programs.
//
// A wait that spins with the pause hint keeps its core from every other thread; one that sleeps on a futex pays
// a wake-up when its work comes (tens of microseconds on a virtual CPU that went idle: the exchange's hand-overs
// at every layer, docs/performance/decode_step.md). While only our services use the CPUs, waits spin giving the core away
// between polls (sched_yield): a thread with work on that core (the other service's compute, our own worker)
// runs at once, and the waiter sees its word within a scheduler pass. Beside busy programs a yielder competes as
// any runnable thread and loses the wake-up boost a sleeper gets (decode at a fifth of the sleeping policy's
// rate, measured), so there waits spin with the pause hint only while a CPU is free (procs_running), briefly
// otherwise, and sleep.
//
// "Only our services": the CPU time the machine spent (/proc/stat) less what our processes on this host spent
// (each publishes its CPU time on a board in this user's shared memory, as the exchange ring is) stays under
// FOREIGN_CPUS; measured over windows of SAMPLE_NS (QUIET_WINDOWS of them in a row to count as quiet again).
#pragma once

namespace moe {
// Whether waits now treat the machine as shared: other programs' CPU use above FOREIGN_CPUS, or (MOE_SPIN=never)
// always, or (MOE_SPIN=always|yield) never.
bool machine_shared();
// Whether waits now yield between polls (the machine not shared, or MOE_SPIN=yield).
bool waits_yield();
// More runnable threads machine-wide (/proc/stat procs_running) than CPUs this process may use; sampled at most
// every 20 ms (a read of /proc/stat costs a few microseconds). MOE_SPIN=always|never|yield override it.
bool cpu_contended();
constexpr double FOREIGN_CPUS = 0.35;              // above /proc/stat's tick noise over one window
constexpr long long SAMPLE_NS = 100'000'000;
constexpr int QUIET_WINDOWS = 3;                   // shared at one window's word, quiet after this many
// The spin a wait keeps while contended: hand-overs inside one forward (a few microseconds) still
// skip the futex round trip, longer waits sleep.
constexpr long long CONTENDED_SPIN_NS = 20'000;
constexpr long long YIELDING_SPIN_NS = 2'000'000;  // a yielding wait: the gap between two layers' hand-overs

// A yielding wait whose yields keep coming straight back naps. Under EEVDF a yield only moves the yielder's
// deadline: while the thread that wants this core has used more than its share, the yielder is picked again, and a
// split decode's GPU-side wait can hold most of the core the expert service's worker needs for tens of tokens at a
// time (docs/performance/decode_step.md). After YIELD_NAP_AFTER_NS of yields that came back within
// YIELD_BACK_NS, the wait sleeps up to YIELD_NAP_NS on its futex (the ring's doorbell wakes it at once).
// MOE_YIELD_NAP_US overrides the first (0: never nap).
constexpr long long YIELD_BACK_NS = 3'000;
constexpr long long YIELD_NAP_AFTER_NS = 50'000;
constexpr long long YIELD_NAP_NS = 30'000;
long long yield_nap_after_ns();

struct SpinPolicy {
  bool yields;          // sched_yield between polls (else the pause hint)
  long long budget_ns;  // then sleep
};
// How a wait that would spin `ns` should spin: decided at its start (it also publishes this process's CPU time).
SpinPolicy spin_policy(long long ns);
// One pause of a spin-wait.
void spin_pause(bool yields);

// What the waits decided and why, for the metrics: this process's sampler (each process keeps its own).
struct ContentionStats {
  bool shared = false, contended = false;  // as machine_shared() / cpu_contended() say now
  double foreign_cpus = 0;                 // other programs' CPU use over the last window, in CPUs
  long long windows = 0, foreign_windows = 0;  // windows judged, and of them over FOREIGN_CPUS
  long long turned_shared = 0;             // times the waits went from the quiet policy to the shared one
  double window_s = SAMPLE_NS * 1e-9, foreign_threshold = FOREIGN_CPUS;  // for the metrics' help
};
ContentionStats contention_stats();
}  // namespace moe
