// The fixture of the shared-memory plane's integration tests (integ_shm_test.cc: transfers;
// integ_shm_region_test.cc: regions' lifecycle and ownership): the real kvbankd with
// --shm-socket in a folder of its own, clients that take the plane, and the way region transfers
// are asked for (KVBANK_TEST_SHM_CONTROL).
#ifndef KVBANK_TESTS_INTEGRATION_SHM_TEST_SUPPORT_H_
#define KVBANK_TESTS_INTEGRATION_SHM_TEST_SUPPORT_H_

#include <stdlib.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "tests/integration/prefix_support.h"

namespace kvbank::integ {

// Polls `done` until it holds or the deadline passes.
inline bool WaitFor(const std::function<bool()>& done,
                    absl::Duration deadline = absl::Seconds(15)) {
  const absl::Time end = absl::Now() + deadline;
  while (!done()) {
    if (absl::Now() > end) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return true;
}

class ShmTest : public KvbankdTest {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/kvbank-shm-integ-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    dir_ = dir;
    socket_ = dir_ + "/kvbankd.sock";
    std::ofstream(dir_ + "/tokens") << "token-of-a a\n"
                                    << "token-of-b b\n"
                                    << "token-of-ops ops admin\n";
  }
  void TearDown() override {
    KvbankdTest::TearDown();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  void Start(std::vector<std::string> flags = {}) {
    flags.insert(flags.begin(), {"--models=", "--enable-prefix-caching=false"});
    flags.push_back("--shm-socket=" + socket_);
    StartServer(flags);
  }
  // Region transfers go as control frames on the shm socket, or (KVBANK_TEST_SHM_CONTROL=0:
  // ctest's integ_shm_test_grpc_control) as gRPC calls: every case runs both ways.
  static bool Frames() {
    const char* v = std::getenv("KVBANK_TEST_SHM_CONTROL");
    return v == nullptr || std::string(v) != "0";
  }
  std::unique_ptr<Client> Shm(const std::string& token = "") {
    ClientOptions o;
    o.shm_socket = socket_;
    o.bearer_token = token;
    o.shm_control = Frames();
    return NewClient(o);
  }

  // Model "m" (SmallLayout), one sequence of it, and a region for `tokens` tokens of its
  // payload (bytes long).
  struct OneSequence {
    uint64_t seq = 0;
    uint64_t bytes = 0;
    std::unique_ptr<ShmRegion> region;
  };
  static void MakeOneSequence(Client& c, uint64_t tokens, OneSequence* out) {
    const ModelLayout layout = SmallLayout("m");
    auto model = c.EnsureModel(layout, 64 * BlockBytes(layout));
    ASSERT_TRUE(model.ok()) << model.status();
    auto seq = c.CreateSequence("m");
    ASSERT_TRUE(seq.ok()) << seq.status();
    out->seq = seq->id;
    out->bytes = tokens * model->payload_bytes_per_token;
    auto region = c.RegisterRegion(out->bytes);
    ASSERT_TRUE(region.ok()) << region.status();
    out->region = *std::move(region);
  }

  std::string dir_, socket_;
};

// Whether region `id` is gone for `c`'s tenant: a fetch into it answers NOT_FOUND naming it (an
// existing region answers that the slice is too small, before anything is written).
inline bool RegionGone(Client& c, const std::string& model, uint64_t seq, uint64_t id) {
  auto r = c.FetchToRegion(model, seq, {}, {id, 0, 1});
  return r.status().code() == absl::StatusCode::kNotFound &&
         absl::StrContains(r.status().message(), "dest.region_id");
}

}  // namespace kvbank::integ

#endif  // KVBANK_TESTS_INTEGRATION_SHM_TEST_SUPPORT_H_
