// The fleet tests' fixture: replicas of kvbankd on loopback, and one request of a trace.
#ifndef KVBANK_TESTS_INTEGRATION_FLEET_SUPPORT_H_
#define KVBANK_TESTS_INTEGRATION_FLEET_SUPPORT_H_

#include <cstring>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gtest/gtest.h"
#include "kvbank/client.h"
#include "kvbank/fleet.h"
#include "tests/integration/prefix_support.h"
#include "tests/integration/server_fixture.h"

namespace kvbank::integ {

inline constexpr char kModel[] = "fleet";

class FleetTest : public ::testing::Test {
 protected:
  // Starts `n` more replicas named kvbank-<i>, each with `extra` flags.
  void StartReplicas(int n, const std::vector<std::string>& extra = {}) {
    for (int i = 0; i < n; ++i) {
      const int index = static_cast<int>(servers_.size());
      std::vector<std::string> flags = {"--no-auth",
                                        "--models=", absl::StrCat("--replica-name=kvbank-", index)};
      flags.insert(flags.end(), extra.begin(), extra.end());
      auto server = ServerProcess::Start(flags);
      ASSERT_TRUE(server.ok()) << server.status();
      auto client = Client::Connect((*server)->target());
      ASSERT_TRUE(client.ok()) << client.status();
      ASSERT_TRUE((*client)->WaitForServing(absl::Seconds(20)));
      servers_.push_back(*std::move(server));
    }
  }
  std::string StaticTarget() const {
    std::vector<std::string> t;
    for (const auto& s : servers_) t.push_back(s->target());
    return absl::StrJoin(t, ",");
  }
  static FleetOptions FastOptions() {
    FleetOptions o;
    o.probe_interval = absl::Milliseconds(100);
    o.probe_deadline = absl::Milliseconds(300);
    o.client.call_deadline = absl::Seconds(10);
    return o;
  }
  // Placement by key alone, for cases that check where a key's sequences land (and what a
  // replica's join, drain, death and return change): bounded-load placement may send a key's
  // sequence elsewhere while its home holds more than the bound, by a load figure a probe may
  // report late in a slow build; it has its own cases (integ_fleet_balance_test).
  static FleetOptions ByKeyOptions() {
    FleetOptions o = FastOptions();
    o.load_epsilon.reset();
    return o;
  }
  void TearDown() override {
    for (auto& s : servers_) {
      if (s->exited()) continue;
      absl::Status st = s->Stop();
      EXPECT_TRUE(st.ok()) << st;
      if (HasFailure()) std::cerr << "[server " << s->target() << "]\n" << s->Log() << "\n";
    }
  }

  std::vector<std::unique_ptr<ServerProcess>> servers_;
};

// A payload of `n` tokens of finite fp16 values.
inline std::vector<uint8_t> Payload(const Client::ModelInfo& m, uint64_t n) {
  std::vector<uint8_t> p(m.payload_bytes_per_token * n);
  for (size_t i = 0; i + 1 < p.size(); i += 2) {
    const uint16_t v = 0x3c00 | static_cast<uint16_t>((i / 2) & 0x3ff);  // 1.0 .. 2.0
    std::memcpy(&p[i], &v, 2);
  }
  return p;
}

// One request: a sequence with `prompt`, its uncached KV appended (so its blocks are
// published), freed (they stay cached). Returns the cached tokens CreateSequence reported.
inline absl::StatusOr<uint64_t> Serve(Fleet& fleet, const Client::ModelInfo& m,
                                      const std::vector<uint32_t>& prompt,
                                      std::string* replica = nullptr) {
  Client::CreateArgs args;
  args.prompt = prompt;
  auto seq = fleet.CreateSequence(kModel, args);
  if (!seq.ok()) return seq.status();
  if (replica != nullptr) *replica = seq->replica;
  const uint64_t cached = seq->info.cached_tokens;
  Client::AppendArgs append;
  append.num_tokens = prompt.size() - cached;
  append.token_ids = Slice(prompt, cached, prompt.size());
  if (append.num_tokens > 0) {
    auto a = fleet.Append(*seq, append, Payload(m, append.num_tokens));
    if (!a.ok()) return a.status();
  }
  auto f = fleet.Free(*seq);
  if (!f.ok()) return f.status();
  return cached;
}

inline std::vector<uint32_t> Concat(std::vector<uint32_t> a, const std::vector<uint32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

}  // namespace kvbank::integ

#endif  // KVBANK_TESTS_INTEGRATION_FLEET_SUPPORT_H_
