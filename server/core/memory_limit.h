// How much host memory this process may use: the smaller of physical memory and the memory
// limit of its cgroup (v2 memory.max, v1 memory.limit_in_bytes, the tightest of the cgroup and
// its ancestors), so a pool sized from it fits a container's limit instead of the node's RAM.
#ifndef KVBANK_SERVER_CORE_MEMORY_LIMIT_H_
#define KVBANK_SERVER_CORE_MEMORY_LIMIT_H_

#include <cstdint>
#include <string>

namespace kvbank {

struct MemoryLimit {
  uint64_t bytes = 0;
  // Where the figure came from, for the start-up log: "physical memory", "cgroup v2 memory.max
  // (/sys/fs/cgroup/kubepods/...)", "cgroup v1 memory.limit_in_bytes (...)".
  std::string source;
};

// Where the cgroup files are; tests point these at a fake tree.
struct CgroupPaths {
  std::string proc_self_cgroup = "/proc/self/cgroup";
  std::string cgroup_root = "/sys/fs/cgroup";  // v2: the unified root; v1: holds memory/
};

// The limit that binds: the cgroup's when it is set and below `physical_bytes`, else physical
// memory. A limit file that says "max" (v2) or a v1 figure near 2^63 means none. Files that are
// missing or unreadable are skipped (a host without cgroups gets physical memory). Thread-safe.
MemoryLimit HostMemoryLimit(uint64_t physical_bytes, const CgroupPaths& paths = {});

// sysconf(_SC_PHYS_PAGES) x page size.
uint64_t PhysicalMemoryBytes();

}  // namespace kvbank

#endif  // KVBANK_SERVER_CORE_MEMORY_LIMIT_H_
