// A bounded soak: threads on their own connections do random operations with every fetched
// token verified, then no mismatch, no leaked block, bounded server RSS, still serving.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "kvbank/client.h"
#include "tests/integration/fault_support.h"
#include "tests/integration/kv_reference.h"
#include "tests/integration/server_fixture.h"

namespace kvbank::integ {
namespace {

// Every token's bytes and token id derive from (key, position, layer): the key of a
// position is the sequence that first wrote it there (a fork's shared positions keep the
// parent's key, a prompt's positions the key of the sequence whose tokens it replays), so any
// fetch of any range is verified without keeping copies of the payloads.

uint64_t Mix(uint64_t a, uint64_t b) {
  uint64_t z = a * 0x9e3779b97f4a7c15ull + b + 0x632be59bd9b4e019ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
uint32_t TokenId(uint64_t key, uint64_t pos) {
  return static_cast<uint32_t>(Mix(key, pos) & 0x7fffffff);
}
// One head's row of one token in one layer, K (part 0) or V (part 1).
void FillRow(uint64_t key, uint64_t pos, uint32_t layer, uint32_t part, uint32_t head,
             uint8_t* out) {
  Random r(Mix(Mix(key, pos), (uint64_t{layer} << 16) | (part << 8) | head));
  r.Fill(out, kRowBytes);
}
// The payload (kvbank/layout.h order) of tokens [t0, t1) x layers [l0, l1), keys[t] per token.
std::vector<uint8_t> SoakPayload(const std::vector<uint64_t>& keys, uint64_t t0, uint64_t t1,
                                 uint32_t l0, uint32_t l1) {
  std::vector<uint8_t> out((t1 - t0) * (l1 - l0) * 2 * kKvHeads * kRowBytes);
  uint8_t* at = out.data();
  for (uint32_t l = l0; l < l1; ++l) {
    for (uint32_t part = 0; part < 2; ++part) {
      for (uint32_t h = 0; h < kKvHeads; ++h) {
        for (uint64_t t = t0; t < t1; ++t, at += kRowBytes) FillRow(keys[t], t, l, part, h, at);
      }
    }
  }
  return out;
}

struct SoakSeq {
  uint64_t id = 0;
  uint64_t key = 0;            // this sequence's own key
  uint64_t length = 0;         // tokens stored in every layer
  std::vector<uint64_t> keys;  // per position: stored tokens, then the prompt's rest
};

struct SoakCounts {
  uint64_t creates = 0, prompt_creates = 0, appends = 0, fetches = 0, forks = 0, truncates = 0;
  uint64_t frees = 0, full = 0, cached_tokens = 0, tokens_verified = 0;
  uint64_t mismatches = 0;  // (token, layer) rows fetched with other bytes than derived
  uint64_t errors = 0;      // calls that failed other than RESOURCE_EXHAUSTED on a full pool
  std::vector<std::string> first_errors;
  uint64_t ops() const { return creates + appends + fetches + forks + truncates + frees; }
  void Add(const SoakCounts& o) {
    creates += o.creates, prompt_creates += o.prompt_creates, appends += o.appends;
    fetches += o.fetches, forks += o.forks, truncates += o.truncates, frees += o.frees;
    full += o.full, cached_tokens += o.cached_tokens, tokens_verified += o.tokens_verified;
    mismatches += o.mismatches, errors += o.errors;
    for (const std::string& e : o.first_errors) {
      if (first_errors.size() < 8) first_errors.push_back(e);
    }
  }
};

// One soak thread: its own connection and sequences, random operations until `stop`.
class SoakWorker {
 public:
  static constexpr size_t kMaxLive = 12;
  static constexpr uint64_t kMaxLength = 600;

  SoakWorker(std::unique_ptr<Client> client, std::string model, uint32_t index, uint64_t seed)
      : client_(std::move(client)), model_(std::move(model)), index_(index), rng_(seed) {}

  void Run(const std::atomic<bool>& stop) {
    while (!stop.load(std::memory_order_relaxed)) Step();
  }
  // Verifies every live sequence in full and frees it.
  void Finish() {
    for (SoakSeq& s : live_) {
      if (s.length > 0) Verify(s, 0, s.length, 0, kLayers);
      auto f = client_->Free(model_, s.id);
      if (!f.ok()) Error("free", f.status());
    }
    live_.clear();
  }
  const SoakCounts& counts() const { return c_; }

 private:
  void Step() {
    const uint64_t r = rng_.Next() % 100;
    if (live_.empty() || (r < 10 && live_.size() < kMaxLive)) return Create();
    SoakSeq& s = live_[rng_.Next() % live_.size()];
    if (r < 45) return Append(s);
    if (r < 75) return Fetch(s);
    if (r < 83) return live_.size() < kMaxLive ? Fork(s) : Fetch(s);
    if (r < 91) return Truncate(s);
    return Free(rng_.Next() % live_.size());
  }

  uint64_t NewKey() { return (uint64_t{index_ + 1} << 40) | ++keys_made_; }

  void Create() {
    Client::CreateArgs args;
    args.lease = absl::ZeroDuration();
    SoakSeq s;
    s.key = NewKey();
    // Half of them replay a prefix of an earlier sequence: its cached full blocks are attached.
    if (!lineages_.empty() && rng_.Next() % 2 == 0) {
      const std::vector<uint64_t>& from = lineages_[rng_.Next() % lineages_.size()];
      s.keys.assign(from.begin(), from.begin() + 1 + rng_.Next() % from.size());
      for (uint64_t p = 0; p < s.keys.size(); ++p) args.prompt.push_back(TokenId(s.keys[p], p));
    }
    auto info = client_->CreateSequence(model_, args);
    ++c_.creates;
    if (!info.ok()) return Error("create", info.status());
    s.id = info->id;
    s.length = info->length;
    if (info->cached_tokens != info->length || info->length > s.keys.size() ||
        info->length % kBlockTokens != 0) {
      Error("create", absl::InternalError(absl::StrCat("length ", info->length, ", cached ",
                                                       info->cached_tokens, " of a ", s.keys.size(),
                                                       "-token prompt")));
    }
    if (!args.prompt.empty()) ++c_.prompt_creates;
    c_.cached_tokens += info->cached_tokens;
    live_.push_back(std::move(s));
    if (info->length > 0) Verify(live_.back(), 0, info->length, 0, kLayers);
  }

  void Append(SoakSeq& s) {
    const uint64_t n = 1 + rng_.Next() % 64;
    if (s.length + n > kMaxLength) return Truncate(s);
    std::vector<uint64_t> keys(s.keys.begin(), s.keys.begin() + s.length);
    for (uint64_t p = s.length; p < s.length + n; ++p) {
      keys.push_back(p < s.keys.size() ? s.keys[p] : s.key);
    }
    Client::AppendArgs args;
    args.num_tokens = n;
    for (uint64_t p = s.length; p < s.length + n; ++p)
      args.token_ids.push_back(TokenId(keys[p], p));
    auto info =
        client_->Append(model_, s.id, args, SoakPayload(keys, s.length, s.length + n, 0, kLayers));
    ++c_.appends;
    if (!info.ok()) {
      if (info.status().code() == absl::StatusCode::kResourceExhausted) {
        ++c_.full;  // the pool is full: nothing changed, which later fetches verify
        return;
      }
      return Error("append", info.status());
    }
    if (info->length != s.length + n) {
      Error("append",
            absl::InternalError(absl::StrCat("length ", info->length, ", want ", s.length + n)));
    }
    if (keys.size() < s.keys.size())
      keys.insert(keys.end(), s.keys.begin() + keys.size(), s.keys.end());
    s.keys = std::move(keys);
    s.length += n;
  }

  void Fetch(const SoakSeq& s) {
    if (s.length == 0) return;
    const uint64_t t0 = rng_.Next() % s.length;
    const uint64_t t1 = t0 + 1 + rng_.Next() % (s.length - t0);
    const uint32_t l0 = static_cast<uint32_t>(rng_.Next() % kLayers);
    const uint32_t l1 = l0 + 1 + static_cast<uint32_t>(rng_.Next() % (kLayers - l0));
    Verify(s, t0, t1, l0, l1);
  }

  void Verify(const SoakSeq& s, uint64_t t0, uint64_t t1, uint32_t l0, uint32_t l1) {
    Client::FetchArgs args;
    args.token_begin = t0;
    args.token_end = t1;
    args.layer_begin = l0;
    args.layer_end = l1;
    auto got = client_->Fetch(model_, s.id, args);
    ++c_.fetches;
    if (!got.ok()) return Error("fetch", got.status());
    const std::vector<uint8_t> want = SoakPayload(s.keys, t0, t1, l0, l1);
    c_.tokens_verified += t1 - t0;
    if (got->payload.size() != want.size()) {
      c_.mismatches += (t1 - t0) * (l1 - l0);
      return;
    }
    // Count the (token, layer) rows that differ: rows of one layer and token sit at
    // [layer][part][head][token] in the payload.
    const uint64_t n = t1 - t0;
    for (uint32_t l = 0; l < l1 - l0; ++l) {
      for (uint64_t t = 0; t < n; ++t) {
        bool same = true;
        for (uint32_t ph = 0; ph < 2 * kKvHeads && same; ++ph) {
          const uint64_t at = ((uint64_t{l} * 2 * kKvHeads + ph) * n + t) * kRowBytes;
          same = std::memcmp(got->payload.data() + at, want.data() + at, kRowBytes) == 0;
        }
        if (!same) ++c_.mismatches;
      }
    }
  }

  void Fork(const SoakSeq& parent) {
    auto info = client_->Fork(model_, parent.id);
    ++c_.forks;
    if (!info.ok()) {
      if (info.status().code() == absl::StatusCode::kResourceExhausted) {
        ++c_.full;
        return;
      }
      return Error("fork", info.status());
    }
    SoakSeq child = parent;
    child.id = info->id;
    child.key = NewKey();
    live_.push_back(std::move(child));
  }

  void Truncate(SoakSeq& s) {
    const uint64_t n = s.length == 0 ? 0 : rng_.Next() % (s.length + 1);
    auto info = client_->Truncate(model_, s.id, n);
    ++c_.truncates;
    if (!info.ok()) return Error("truncate", info.status());
    s.length = n;
    if (s.keys.size() > n) s.keys.resize(n);  // the server keeps token ids up to the new length
  }

  void Free(size_t i) {
    auto f = client_->Free(model_, live_[i].id);
    ++c_.frees;
    if (!f.ok()) return Error("free", f.status());
    if (live_[i].length >= kBlockTokens) {
      std::vector<uint64_t> keys(live_[i].keys.begin(), live_[i].keys.begin() + live_[i].length);
      if (lineages_.size() < 8) {
        lineages_.push_back(std::move(keys));
      } else {
        lineages_[rng_.Next() % lineages_.size()] = std::move(keys);
      }
    }
    live_.erase(live_.begin() + static_cast<ptrdiff_t>(i));
  }

  void Error(const char* op, const absl::Status& s) {
    ++c_.errors;
    if (c_.first_errors.size() < 4) c_.first_errors.push_back(absl::StrCat(op, ": ", s.ToString()));
  }

  std::unique_ptr<Client> client_;
  const std::string model_;
  const uint32_t index_;
  Random rng_;
  uint64_t keys_made_ = 0;
  std::vector<SoakSeq> live_;
  std::vector<std::vector<uint64_t>> lineages_;  // keys of freed sequences, for prompts
  SoakCounts c_;
};

// A bounded soak: threads on their own connections create, append, fetch, fork, truncate and
// free at random; every fetch is verified token by token. Then: no mismatch, no failed call, no
// leaked block, server RSS at the end within RssBoundKiB() (64 MiB) of RSS after the warm-up,
// still serving.
TEST_F(FaultTest, SoakKeepsEveryTokenAndLeaksNothing) {
  const int64_t seconds = Knob("KVBANK_SOAK_SECONDS", 60, 15);
  const int64_t threads = Knob("KVBANK_SOAK_THREADS", 4, 4);
  const int64_t rss_bound = RssBoundKiB();
  ASSERT_NO_FATAL_FAILURE(Start());
  const std::string model = "soak";
  // 3072 blocks: the live sequences need at most about 4 x 12 x 38, so freed sequences' cached
  // blocks fill the rest and get evicted.
  auto info = admin_->EnsureModel(SmallLayout(model), 24 * kMiB);
  ASSERT_TRUE(info.ok()) << info.status();
  const uint64_t seed = 7301;
  std::cerr << "[fault] soak: seed " << seed << ", " << seconds << " s, " << threads
            << " threads\n";

  std::vector<std::unique_ptr<SoakWorker>> workers;
  for (int64_t t = 0; t < threads; ++t) {
    auto client = NewClient();
    ASSERT_NE(client, nullptr);
    workers.push_back(std::make_unique<SoakWorker>(std::move(client), model,
                                                   static_cast<uint32_t>(t), Mix(seed, t)));
  }
  std::atomic<bool> stop{false};
  std::vector<std::thread> running;
  const absl::Time start = absl::Now();
  for (auto& w : workers) running.emplace_back([&w, &stop] { w->Run(stop); });
  // Warm-up: a tenth of the run (at least 2 s), then the RSS the end is compared with.
  const absl::Duration total = absl::Seconds(seconds);
  absl::SleepFor(std::max(absl::Seconds(2), total / 10));
  const int64_t rss_warm = ProcStatusKiB(server_->pid(), "VmRSS");
  while (absl::Now() - start < total) absl::SleepFor(absl::Milliseconds(100));
  stop = true;
  for (std::thread& t : running) t.join();
  const int64_t rss_end = ProcStatusKiB(server_->pid(), "VmRSS");
  const int64_t rss_peak = ProcStatusKiB(server_->pid(), "VmHWM");
  const double elapsed = absl::ToDoubleSeconds(absl::Now() - start);

  SoakCounts sum;
  for (auto& w : workers) {
    w->Finish();
    sum.Add(w->counts());
  }
  const Client::ModelStats st = AwaitPool(*admin_, model, 0);
  // Still serving: a fresh connection creates, appends, fetches and frees.
  auto probe = NewClient();
  ASSERT_NE(probe, nullptr);
  auto seq = probe->CreateSequence(model, absl::ZeroDuration());
  ASSERT_TRUE(seq.ok()) << seq.status();
  const std::vector<uint64_t> keys(3, 99);
  Client::AppendArgs args;
  args.num_tokens = 3;
  ASSERT_TRUE(probe->Append(model, seq->id, args, SoakPayload(keys, 0, 3, 0, kLayers)).ok());
  auto back = probe->Fetch(model, seq->id, {});
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(BytesEqual(back->payload, SoakPayload(keys, 0, 3, 0, kLayers)));
  ASSERT_TRUE(probe->Free(model, seq->id).ok());

  std::cerr << "[fault] soak: " << elapsed << " s, " << threads << " threads, " << sum.ops()
            << " ops (create " << sum.creates << " of which " << sum.prompt_creates
            << " with a prompt, append " << sum.appends << ", fetch " << sum.fetches << ", fork "
            << sum.forks << ", truncate " << sum.truncates << ", free " << sum.frees << "), "
            << sum.tokens_verified << " tokens verified, " << sum.cached_tokens
            << " tokens attached from the prefix cache, " << sum.full
            << " calls refused on a full pool; checksum mismatches " << sum.mismatches
            << ", errors " << sum.errors << "; server RSS after warm-up " << MiB(rss_warm)
            << " MiB, at end " << MiB(rss_end) << " MiB (peak " << MiB(rss_peak)
            << " MiB, bound warm-up + "
            << (rss_bound > 0 ? absl::StrCat(MiB(rss_bound), " MiB") : "none: sanitizer build")
            << "); leaked blocks " << st.blocks_used << " (" << PoolLine(st) << ", evictions "
            << st.evictions << ")\n";
  EXPECT_EQ(sum.mismatches, 0u);
  EXPECT_EQ(sum.errors, 0u) << absl::StrJoin(sum.first_errors, "\n");
  EXPECT_GT(sum.tokens_verified, 0u);
  EXPECT_EQ(st.blocks_used, 0u) << PoolLine(st);
  EXPECT_EQ(st.blocks_free + st.blocks_cached, st.blocks_total) << PoolLine(st);
  ASSERT_GT(rss_warm, 0) << "cannot read /proc/" << server_->pid() << "/status";
  if (rss_bound > 0) {
    EXPECT_LE(rss_end, rss_warm + rss_bound)
        << "server RSS grew from " << rss_warm << " KiB to " << rss_end << " KiB";
  }
}

}  // namespace
}  // namespace kvbank::integ
