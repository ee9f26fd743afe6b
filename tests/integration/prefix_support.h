// Shared by the prefix-cache and tenancy integration tests: a small layout, token and stats
// helpers, and a Watch helper.
#ifndef KVBANK_TESTS_INTEGRATION_PREFIX_SUPPORT_H_
#define KVBANK_TESTS_INTEGRATION_PREFIX_SUPPORT_H_

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "gtest/gtest.h"
#include "kvbank/client.h"
#include "kvbank/prefix_hash.h"
#include "tests/integration/kv_reference.h"
#include "tests/integration/server_fixture.h"

namespace kvbank::integ {

inline constexpr uint64_t kMiB = uint64_t{1} << 20;
inline constexpr uint32_t kBt = 16;  // block_tokens of the test layout
// Sequence ids are below 2^53, so this one never names a sequence.
inline constexpr uint64_t kNeverId = (uint64_t{1} << 53) + 12345;
// KV events a model's log keeps (ModelConfig::event_capacity; no kvbankd flag sets it).
inline constexpr uint64_t kEventCapacity = 65536;

// 2 layers x 2 KV heads x head_dim 16, fp16, 16-token blocks: 4 KiB blocks, 256 payload bytes a
// token.
inline ModelLayout SmallLayout(const std::string& name) {
  ModelLayout m;
  m.name = name;
  m.num_layers = 2;
  m.num_q_heads = 4;
  m.num_kv_heads = 2;
  m.head_dim = 16;
  m.head_dim_v = 16;
  m.block_tokens = kBt;
  m.kind = AttentionKind::kGqa;
  m.input_dtype = DType::kFp16;
  m.layer_dtypes.assign(m.num_layers, DType::kFp16);
  return m;
}

inline uint64_t BlockBytes(const ModelLayout& m) { return ComputeBlockLayout(m).block_bytes; }

// Seeded token ids (a vocabulary of 128k).
inline std::vector<uint32_t> Tokens(uint64_t seed, size_t n) {
  Random rng(seed);
  std::vector<uint32_t> t(n);
  for (uint32_t& x : t) x = static_cast<uint32_t>(rng.Next() % 128000);
  return t;
}

inline std::vector<uint32_t> Slice(const std::vector<uint32_t>& v, size_t begin, size_t end) {
  return std::vector<uint32_t>(v.begin() + begin, v.begin() + end);
}

inline Client::ModelStats StatsOf(Client& client, const std::string& model) {
  auto stats = client.GetStats(model);
  EXPECT_TRUE(stats.ok()) << stats.status();
  if (!stats.ok() || stats->size() != 1) {
    ADD_FAILURE() << "GetStats(" << model << ") did not return one model";
    return {};
  }
  return (*stats)[0];
}

// free + cached + referenced = total, as the server reports it.
inline void ExpectAccounting(const Client::ModelStats& st) {
  EXPECT_EQ(st.blocks_free + st.blocks_cached + st.blocks_used, st.blocks_total)
      << "free " << st.blocks_free << " cached " << st.blocks_cached << " used " << st.blocks_used;
}

inline const Client::ModelStats::Tenant* TenantRow(const Client::ModelStats& st,
                                                   const std::string& t) {
  for (const auto& row : st.tenants) {
    if (row.tenant == t) return &row;
  }
  return nullptr;
}

// Appends `n` random tokens of every layer to sequence `id`, mirrored in `ref`.
inline absl::StatusOr<Client::SequenceInfo> AppendKv(Client& client, const std::string& model,
                                                     uint64_t id, KvReference& ref, Random& rng,
                                                     uint64_t n,
                                                     std::vector<uint32_t> token_ids = {}) {
  KvReference next = ref;
  std::vector<uint8_t> payload = next.Append(0, next.num_layers(), n, rng);
  Client::AppendArgs args;
  args.num_tokens = n;
  args.token_ids = std::move(token_ids);
  auto info = client.Append(model, id, args, payload);
  if (info.ok()) ref = std::move(next);
  return info;
}

// Polls `done` every 20 ms for up to `timeout`; true once it holds.
inline bool WaitUntil(const std::function<bool()>& done,
                      absl::Duration timeout = absl::Seconds(10)) {
  const absl::Time until = absl::Now() + timeout;
  while (absl::Now() < until) {
    if (done()) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return done();
}

struct Watched {
  absl::Status status;
  std::vector<Client::Event> events;
  uint64_t last = 0;  // last_sequence of the latest batch
  int batches = 0;
};

// Watches until `enough` holds (checked after every batch, the first, maybe empty, one included)
// or the deadline passes (status DEADLINE_EXCEEDED then).
inline Watched WatchUntil(Client& client, const std::string& model, uint64_t after, bool from_now,
                          const std::function<bool(const Watched&)>& enough,
                          absl::Duration deadline = absl::Seconds(10),
                          std::atomic<bool>* live = nullptr) {
  Watched w;
  w.status = client.Watch(model, after, from_now, deadline,
                          [&](const std::vector<Client::Event>& events, uint64_t last) {
                            w.events.insert(w.events.end(), events.begin(), events.end());
                            w.last = last;
                            ++w.batches;
                            if (live != nullptr) *live = true;
                            return !enough(w);
                          });
  return w;
}

inline std::set<BlockHash> HashSet(const std::vector<BlockHash>& v) { return {v.begin(), v.end()}; }

// A status message with `id` written as <id>, to compare answers about different ids.
inline std::string WithoutId(const absl::Status& s, uint64_t id) {
  return absl::StrReplaceAll(s.message(), {{std::to_string(id), "<id>"}});
}

// ---------------------------------------------------------------------------------------------
// 1. Two connections, one prompt: the second sequence attaches the first one's full blocks.

}  // namespace kvbank::integ

#endif  // KVBANK_TESTS_INTEGRATION_PREFIX_SUPPORT_H_
