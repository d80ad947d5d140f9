// Is this machine oversubscribed right now? Spin-waits are worth it only while a CPU is free for
// the spinner; otherwise they take the core from a thread that has work (the other service, our
// own worker that holds the last task, or another program), and waits here sleep after a short spin.
#pragma once

namespace moe {
// More runnable threads machine-wide (/proc/stat procs_running) than CPUs this process may use;
// sampled at most every 20 ms (a read of /proc/stat costs a few microseconds). MOE_SPIN=always
// or MOE_SPIN=never overrides the sample (MOE_SPIN=yield: below).
bool cpu_contended();
// The spin a wait keeps while contended: hand-overs inside one forward (a few microseconds) still
// skip the futex round trip, longer waits sleep.
constexpr long long CONTENDED_SPIN_NS = 20'000;
// MOE_SPIN=yield (hosts that run the services alone): waits spin giving the core away between polls
// (sched_yield) for up to YIELDING_SPIN_NS whatever the sample says, so a thread with work on that core runs at
// once and the waiter sees its word within a scheduler pass instead of a futex wake-up. Beside busy programs a
// yielder competes as any runnable thread and loses a sleeper's wake-up boost: not the default (docs/decode_step.md).
bool spin_yields();
constexpr long long YIELDING_SPIN_NS = 2'000'000;  // the gap between two layers' hand-overs
// How long a wait that would spin `ns` should spin now.
inline long long spin_budget_ns(long long ns) {
  if (spin_yields()) return ns > YIELDING_SPIN_NS ? ns : YIELDING_SPIN_NS;
  return cpu_contended() && ns > CONTENDED_SPIN_NS ? CONTENDED_SPIN_NS : ns;
}
// One pause of a spin-wait: sched_yield (spin_yields) or the CPU's pause hint.
void spin_pause();
}  // namespace moe
