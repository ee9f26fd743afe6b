// What the fault tests share (fault_test.cc, fault_soak_test.cc, fault_messages_test.cc): a small
// model, the scale knobs, pool and RSS readings, and the fixture that starts kvbankd for them.
//
// Scale: KVBANK_FAULT_KILLS (iterations of each kill loop), KVBANK_SOAK_SECONDS and
// KVBANK_SOAK_THREADS override the defaults: 100 kills, 60 s and 4 threads in an optimized build;
// 100 kills and 15 s under AddressSanitizer, where everything runs several times slower.
// KVBANK_RSS_BOUND_MIB (default 64) is how far the server's RSS may end above where it started.
// Under AddressSanitizer RSS is reported, not bounded: its quarantine keeps up to 256 MiB of
// freed memory resident, so the number measures the sanitizer's allocator, not kvbankd.
#ifndef KVBANK_TESTS_INTEGRATION_FAULT_SUPPORT_H_
#define KVBANK_TESTS_INTEGRATION_FAULT_SUPPORT_H_

#include <signal.h>
#include <sys/types.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "kvbank/client.h"
#include "kvbank/layout.h"
#include "tests/integration/server_fixture.h"

// AddressSanitizer (gcc, clang) or ThreadSanitizer (clang): their allocators keep freed memory
// and they run several times slower.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define KVBANK_FAULT_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define KVBANK_FAULT_SANITIZED 1
#endif
#endif
#ifndef KVBANK_FAULT_SANITIZED
#define KVBANK_FAULT_SANITIZED 0
#endif

namespace kvbank::integ {

inline constexpr uint64_t kKiB = 1024;
inline constexpr uint64_t kMiB = kKiB * 1024;
inline constexpr uint32_t kLayers = 2, kKvHeads = 2, kHeadDim = 32, kBlockTokens = 16;
inline constexpr uint64_t kRowBytes = kHeadDim * 2;  // one head, fp16
inline constexpr uint64_t kTokenBytes = uint64_t{kLayers} * 2 * kKvHeads * kRowBytes;  // 512
inline constexpr uint64_t kServerChunkBytes =
    16 * kKiB;  // --chunk-bytes: fetches take many messages

// An integer from the environment, else the default of this build.
inline int64_t Knob(const char* name, int64_t optimized, int64_t sanitized) {
  int64_t v = 0;
  const char* s = std::getenv(name);
  if (s != nullptr && absl::SimpleAtoi(s, &v) && v > 0) return v;
  return KVBANK_FAULT_SANITIZED ? sanitized : optimized;
}

// 2 layers, 2 KV heads of 32, fp16, blocks of 16 tokens: 512 payload bytes per token.
inline ModelLayout SmallLayout(const std::string& name) {
  ModelLayout m;
  m.name = name;
  m.num_layers = kLayers;
  m.num_q_heads = 4;
  m.num_kv_heads = kKvHeads;
  m.head_dim = kHeadDim;
  m.head_dim_v = kHeadDim;
  m.block_tokens = kBlockTokens;
  m.kind = AttentionKind::kGqa;
  m.input_dtype = DType::kFp16;
  m.layer_dtypes.assign(m.num_layers, DType::kFp16);
  return m;
}

inline uint64_t CeilDiv(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

inline uint64_t Fnv(const std::vector<uint8_t>& bytes) {
  uint64_t h = 1469598103934665603ull;
  for (uint8_t b : bytes) h = (h ^ b) * 1099511628211ull;
  return h;
}

// A field of /proc/<pid>/status (VmRSS, VmHWM) in KiB; -1 when it cannot be read.
inline int64_t ProcStatusKiB(pid_t pid, const std::string& field) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) != 0) continue;
    std::vector<std::string> parts = absl::StrSplit(line, ' ', absl::SkipWhitespace());
    int64_t v = 0;
    if (parts.size() >= 2 && absl::SimpleAtoi(parts[1], &v)) return v;
  }
  return -1;
}
// The RSS bound in KiB, or 0 where RSS is not bounded (sanitizer builds, see the top).
inline int64_t RssBoundKiB() {
  if (KVBANK_FAULT_SANITIZED && std::getenv("KVBANK_RSS_BOUND_MIB") == nullptr) return 0;
  return Knob("KVBANK_RSS_BOUND_MIB", 64, 64) * 1024;
}

inline double MiB(int64_t kib) { return double(kib) / 1024.0; }

// Stats of one model; a failed call fails the test and returns zeros.
inline Client::ModelStats StatsOf(Client& client, const std::string& model) {
  auto stats = client.GetStats(model);
  EXPECT_TRUE(stats.ok()) << stats.status();
  if (!stats.ok() || stats->size() != 1) return {};
  return (*stats)[0];
}

// Polls until `used` blocks are referenced and free + cached + used == total (a killed client's
// call is torn down once the server notices the closed connection), for up to `timeout`.
// Returns the last stats; the caller asserts on them.
inline Client::ModelStats AwaitPool(Client& admin, const std::string& model, uint64_t used,
                                    absl::Duration timeout = absl::Seconds(10)) {
  const absl::Time deadline = absl::Now() + timeout;
  Client::ModelStats st = StatsOf(admin, model);
  while (!(st.blocks_used == used && st.blocks_free + st.blocks_cached + used == st.blocks_total) &&
         absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
    st = StatsOf(admin, model);
  }
  return st;
}

inline std::string PoolLine(const Client::ModelStats& st) {
  return absl::StrCat("used ", st.blocks_used, ", free ", st.blocks_free, ", cached ",
                      st.blocks_cached, ", total ", st.blocks_total);
}

// A fixture that starts kvbankd without models (each test registers its own), with small fetch
// chunks, and holds an admin client.
class FaultTest : public KvbankdTest {
 protected:
  void SetUp() override { signal(SIGPIPE, SIG_IGN); }  // writes to a killed child's stdin
  // NOTE: gRPC's Server::Shutdown waits for open client connections (up to --drain-timeout-ms),
  // so the clients go first and the drain is kept short.
  void TearDown() override {
    admin_.reset();
    KvbankdTest::TearDown();
  }
  void Start(std::vector<std::string> more = {}) {
    std::vector<std::string> flags = {"--models=", "--max-pool-bytes=1GiB",
                                      absl::StrCat("--chunk-bytes=", kServerChunkBytes),
                                      "--drain-timeout-ms=2000"};
    flags.insert(flags.end(), more.begin(), more.end());
    ASSERT_NO_FATAL_FAILURE(StartServer(flags));
    admin_ = NewClient();  // --no-auth: every caller is the admin tenant
    ASSERT_NE(admin_, nullptr);
  }
  uint64_t NewSequence(const std::string& model) {
    auto s = admin_->CreateSequence(model, absl::ZeroDuration());  // no lease: lives until freed
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? s->id : 0;
  }

  std::unique_ptr<Client> admin_;
};

}  // namespace kvbank::integ

#endif  // KVBANK_TESTS_INTEGRATION_FAULT_SUPPORT_H_
