// NUMA placement without libnuma: the topology from /sys, memory policy by the mbind syscall.
// Expert e lives on node e % nodes, and the tasks of expert e run first on that node's threads.
#pragma once
#include <cstddef>
#include <string>
#include <vector>

namespace moe {

struct NumaTopology {
  int nodes = 1;                       // nodes holding CPUs this process may run on
  std::vector<int> node_id;            // OS node number of each (fake nodes: -1, no memory binding)
  std::vector<std::vector<int>> cpus;  // our CPUs on each
  std::vector<int> node_of_cpu;        // CPU number -> index into the above (-1: not ours)
  std::string describe() const;
};

// Detected once. MOE_NUMA=0 turns placement off; MOE_NUMA_FAKE=N splits our CPUs into N pretend
// nodes (scheduling only, for tests on one-node machines).
const NumaTopology& numa();
inline int numa_node_of_expert(int e) { return e % numa().nodes; }
int numa_current_node();  // of the CPU this thread runs on now
// Bind the pages of expert e's slice ([e * bytes_per_expert, +bytes_per_expert) from p) to its
// node before they are first touched. Returns the number of slices bound (0 without real NUMA).
int numa_place(void* p, size_t bytes_per_expert, int E);
// Whether numa_place binds memory here (several real nodes): memory that must not be bound
// (a mapped file's pages) is then the wrong home for experts.
inline bool numa_binds() { return numa().nodes > 1 && numa().node_id[0] >= 0; }

}  // namespace moe
