#include "server/core/memory_limit.h"

#include <unistd.h>

#include <fstream>
#include <optional>
#include <sstream>
#include <string_view>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace kvbank {
namespace {

// v1 reports "no limit" as the largest page-aligned signed 64-bit value (9223372036854771712);
// anything from 2^62 up is treated as none.
constexpr uint64_t kNoLimitV1 = uint64_t{1} << 62;

std::optional<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::stringstream s;
  s << in.rdbuf();
  return std::string(absl::StripAsciiWhitespace(s.str()));
}

// "/a/b/c" -> {"/a/b/c", "/a/b", "/a", ""}: the cgroup and its ancestors, as suffixes of a root.
std::vector<std::string> SelfAndAncestors(std::string path) {
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  if (path == "/") path.clear();
  std::vector<std::string> out;
  for (;;) {
    out.push_back(path);
    if (path.empty()) break;
    const size_t slash = path.rfind('/');
    path.resize(slash == std::string::npos ? 0 : slash);
  }
  return out;
}

struct Found {
  uint64_t bytes;
  std::string source;  // which file, for the log
};

// The tightest limit in `file_name` under `root` + each of `cgroup`'s ancestors. In a container
// with its own cgroup namespace the path is "/" and the root holds the container's own limit.
std::optional<Found> Tightest(const std::string& root, const std::string& cgroup,
                              const char* file_name, bool v1) {
  const char* version = v1 ? "cgroup v1 " : "cgroup v2 ";
  std::optional<Found> best;
  for (const std::string& dir : SelfAndAncestors(cgroup)) {
    const std::string file = absl::StrCat(root, dir, "/", file_name);
    std::optional<std::string> text = ReadFile(file);
    if (!text.has_value() || *text == "max") continue;
    uint64_t v = 0;
    if (!absl::SimpleAtoi(*text, &v) || v == 0 || (v1 && v >= kNoLimitV1)) continue;
    if (!best.has_value() || v < best->bytes)
      best = Found{v, absl::StrCat(version, file_name, " (", file, ")")};
  }
  return best;
}

}  // namespace

uint64_t PhysicalMemoryBytes() {
  return uint64_t(sysconf(_SC_PHYS_PAGES)) * uint64_t(sysconf(_SC_PAGESIZE));
}

MemoryLimit HostMemoryLimit(uint64_t physical_bytes, const CgroupPaths& paths) {
  MemoryLimit limit{physical_bytes, "physical memory"};
  std::optional<std::string> membership = ReadFile(paths.proc_self_cgroup);
  if (!membership.has_value()) return limit;
  std::optional<Found> found;
  // Lines: "0::/path" (v2), "N:memory:/path" or "N:cpu,memory:/path" (v1).
  for (absl::string_view line : absl::StrSplit(*membership, '\n', absl::SkipEmpty())) {
    std::vector<absl::string_view> parts = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (parts.size() != 3) continue;
    const std::string cgroup(parts[2]);
    std::optional<Found> f;
    if (parts[0] == "0" && parts[1].empty()) {
      f = Tightest(paths.cgroup_root, cgroup, "memory.max", /*v1=*/false);
    } else {
      bool memory = false;
      for (absl::string_view c : absl::StrSplit(parts[1], ',')) memory |= c == "memory";
      if (!memory) continue;
      f = Tightest(paths.cgroup_root + "/memory", cgroup, "memory.limit_in_bytes", /*v1=*/true);
    }
    if (f.has_value() && (!found.has_value() || f->bytes < found->bytes)) found = f;
  }
  if (found.has_value() && found->bytes < physical_bytes) {
    limit = MemoryLimit{found->bytes, found->source};
  }
  return limit;
}

}  // namespace kvbank
