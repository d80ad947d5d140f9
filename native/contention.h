// Is this machine oversubscribed right now? Spin-waits are worth it only while a CPU is free for
// the spinner; otherwise they take the core from a thread that has work (the other service, our
// own worker that holds the last task, or another program), and waits here sleep after a short spin.
#pragma once

namespace moe {
// More runnable threads machine-wide (/proc/stat procs_running) than CPUs this process may use;
// sampled at most every 20 ms (a read of /proc/stat costs a few microseconds). MOE_SPIN=always
// or MOE_SPIN=never overrides the sample.
bool cpu_contended();
// The spin a wait keeps while contended: hand-overs inside one forward (a few microseconds) still
// skip the futex round trip, longer waits sleep.
constexpr long long CONTENDED_SPIN_NS = 20'000;
// How long a wait that would spin `ns` should spin now.
inline long long spin_budget_ns(long long ns) {
  return cpu_contended() && ns > CONTENDED_SPIN_NS ? CONTENDED_SPIN_NS : ns;
}
}  // namespace moe
