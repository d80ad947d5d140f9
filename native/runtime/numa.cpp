#include "runtime/numa.h"

#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <sstream>

namespace moe {

static std::vector<int> parse_cpulist(const std::string& s) {  // "0-3,8,10-11"
  std::vector<int> out;
  std::stringstream ss(s);
  std::string part;
  while (std::getline(ss, part, ',')) {
    if (part.empty() || part == "\n") continue;
    auto dash = part.find('-');
    int a = std::atoi(part.c_str()), b = dash == std::string::npos ? a : std::atoi(part.c_str() + dash + 1);
    for (int c = a; c <= b; ++c) out.push_back(c);
  }
  return out;
}

static NumaTopology detect() {
  NumaTopology t;
  cpu_set_t mine;
  CPU_ZERO(&mine);
  sched_getaffinity(0, sizeof(mine), &mine);
  std::vector<int> ours;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &mine)) ours.push_back(c);
  const char* off = std::getenv("MOE_NUMA");
  const char* fake = std::getenv("MOE_NUMA_FAKE");
  if (fake && std::atoi(fake) > 1) {
    int n = std::min<int>(std::atoi(fake), int(ours.size()));
    t.cpus.assign(n, {});
    for (size_t i = 0; i < ours.size(); ++i) t.cpus[i * n / ours.size()].push_back(ours[i]);
    t.node_id.assign(n, -1);
  } else if (!(off && std::string(off) == "0")) {
    for (int node = 0; node < 1024; ++node) {
      std::ifstream f("/sys/devices/system/node/node" + std::to_string(node) + "/cpulist");
      if (!f) continue;
      std::string line;
      std::getline(f, line);
      std::vector<int> mine_here;
      for (int c : parse_cpulist(line))
        if (c < CPU_SETSIZE && CPU_ISSET(c, &mine)) mine_here.push_back(c);
      if (!mine_here.empty()) {
        t.cpus.push_back(mine_here);
        t.node_id.push_back(node);
      }
    }
  }
  if (t.cpus.size() < 2) {  // one node (or unknown): nothing to place
    t.cpus.assign(1, ours);
    t.node_id.assign(1, -1);
  }
  t.nodes = int(t.cpus.size());
  t.node_of_cpu.assign(CPU_SETSIZE, -1);
  for (int n = 0; n < t.nodes; ++n)
    for (int c : t.cpus[n]) t.node_of_cpu[c] = n;
  return t;
}

const NumaTopology& numa() {
  static const NumaTopology t = detect();
  return t;
}

std::string NumaTopology::describe() const {
  std::string s = std::to_string(nodes) + (nodes > 1 && node_id[0] < 0 ? " pretend" : "") + " node(s):";
  for (int n = 0; n < nodes; ++n) s += " [" + std::to_string(cpus[n].size()) + " cpus]";
  return s;
}

int numa_current_node() {
  const NumaTopology& t = numa();
  if (t.nodes == 1) return 0;
  int c = sched_getcpu();
  int n = c >= 0 && c < int(t.node_of_cpu.size()) ? t.node_of_cpu[c] : -1;
  return n < 0 ? 0 : n;
}

int numa_place(void* p, size_t bytes_per_expert, int E) {
  const NumaTopology& t = numa();
  if (!numa_binds() || bytes_per_expert == 0) return 0;
  const uintptr_t page = uintptr_t(sysconf(_SC_PAGESIZE));
  int bound = 0;
  for (int e = 0; e < E; ++e) {
    // whole pages inside the slice: a page shared by two experts stays where it falls
    uintptr_t a = reinterpret_cast<uintptr_t>(p) + size_t(e) * bytes_per_expert;
    uintptr_t b = a + bytes_per_expert;
    a = (a + page - 1) / page * page;
    b = b / page * page;
    if (b <= a) continue;
    const int node = t.node_id[numa_node_of_expert(e)];
    unsigned long mask[16] = {};
    mask[node / 64] |= 1ul << (node % 64);
    constexpr int MPOL_BIND = 2;
    constexpr unsigned MPOL_MF_MOVE = 1u << 1;
    if (syscall(SYS_mbind, a, b - a, MPOL_BIND, mask, sizeof(mask) * 8, MPOL_MF_MOVE) == 0) ++bound;
  }
  return bound;
}

}  // namespace moe
