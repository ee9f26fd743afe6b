// Model-based test of prefix sharing: thousands of random operations on two tenants over a pool
// small enough to evict, each checked against a plain reference model.
//
// The KV of a position is a pure function of (tenant, salt, LoRA, the token ids up to it) when
// the ids are known, and random otherwise. So every block published under a hash must read back
// exactly as that function says, whoever wrote it, and a block that crossed tenants would not.
#include <algorithm>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kvbank/layout.h"
#include "kvbank/prefix_hash.h"
#include "server/core/block_pool.h"
#include "server/core/kv_events.h"
#include "server/core/sequence_store.h"
#include "tests/unit/store_testing.h"
#include "tests/unit/test_memory.h"

namespace kvbank {
namespace {

constexpr uint32_t kBt = 4;
constexpr uint32_t kLayers = 2;
constexpr uint64_t kPoolBlocks = 32;
constexpr uint64_t kMaxLen = 56;
constexpr size_t kMaxSeqs = 12;
const char* const kTenants[] = {"a", "b"};

ModelLayout TestLayout() {
  return store_testing::GqaLayout("tiny", kLayers, 2, 8, kBt, DType::kFp16);
}

uint64_t Mix(uint64_t x) {  // splitmix64
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
uint64_t MixString(uint64_t h, const std::string& s) {
  for (char c : s) h = Mix(h ^ static_cast<uint8_t>(c));
  return Mix(h ^ 0xff);
}

std::vector<uint8_t> BuildPayload(const BlockLayout& bl, uint32_t l0, uint32_t l1, uint64_t t0,
                                  uint64_t n, const std::vector<uint64_t>& seeds) {
  const PayloadLayout p = PayloadLayout::Make(bl, l0, l1, n);
  std::vector<uint8_t> out(p.total_bytes);
  for (uint32_t l = l0; l < l1; ++l) {
    const LayerView& v = bl.layers[l];
    for (uint64_t t = 0; t < n; ++t) {
      uint64_t x = Mix(seeds[t0 + t] ^ (uint64_t{l} << 56));
      for (uint32_t part = 0; part < 2; ++part) {
        const uint64_t row = part == 0 ? v.KRowBytes() : v.VRowBytes();
        const uint64_t base = p.layer_offset[l - l0] + part * v.num_kv_heads * n * v.KRowBytes();
        for (uint32_t h = 0; h < v.num_kv_heads; ++h) {
          uint8_t* dst = out.data() + base + (uint64_t{h} * n + t) * row;
          for (uint64_t b = 0; b < row; ++b) dst[b] = static_cast<uint8_t>(x = Mix(x));
        }
      }
    }
  }
  return out;
}

struct RefSeq {
  uint64_t id = 0;
  std::string tenant, salt, lora;
  std::vector<uint32_t> ids;    // token ids the server knows, from position 0
  std::vector<uint64_t> seeds;  // content seed of every position some layer holds
  uint64_t len[kLayers] = {0, 0};
  std::vector<bool> indexed;  // block i is the one the prefix index names (must stay there)

  uint64_t Length() const { return std::min(len[0], len[1]); }
  uint64_t MaxLen() const { return std::max(len[0], len[1]); }
  std::vector<ExtraKey> Keys() const {
    if (lora.empty()) return {};
    return {{ExtraKeyKind::kLora, lora}};
  }
  uint64_t Tag() const { return MixString(MixString(MixString(7, tenant), salt), lora); }
  uint64_t DigestAt(uint64_t t) const {
    uint64_t s = Tag();
    for (uint64_t i = 0; i <= t; ++i) s = Mix(s ^ ids[i]);
    return s;
  }
};

class PrefixModel {
 public:
  explicit PrefixModel(uint64_t seed) : rng_(seed) {
    auto log = std::make_unique<KvEventLog>(1 << 16);
    events_ = log.get();
    PoolOptions po;
    po.events = events_;
    po.clock = [this] { return now_; };
    StoreOptions so;
    so.clock = [this] { return now_; };
    so.prefix_cache_ttl = absl::Hours(1);
    auto made = testenv::CreateTestStore(TestLayout(), kPoolBlocks, so, po, std::move(log));
    EXPECT_TRUE(made.ok());
    if (made.ok()) store_ = *std::move(made);
    // Shared prefixes of 6 to 16 tokens over a tiny alphabet: prompts overlap a lot.
    for (uint32_t n : {8u, 12u, 6u, 16u}) {
      std::vector<uint32_t> p;
      for (uint32_t i = 0; i < n; ++i) p.push_back(static_cast<uint32_t>(R(3)));
      prefixes_.push_back(p);
    }
  }

  void Run(int steps) {
    for (step_ = 0; step_ < steps && !::testing::Test::HasFatalFailure(); ++step_) {
      Step();
      CheckAfterStep();
      if (step_ % 25 == 24) CheckEverything();
      if (::testing::Test::HasFailure()) {
        ADD_FAILURE() << "first failure at step " << step_ << " (" << op_ << ")";
        return;
      }
    }
    Drain();
  }
  size_t ops(const std::string& name) const {
    auto it = counts_.find(name);
    return it == counts_.end() ? 0 : it->second;
  }

 private:
  uint64_t R(uint64_t n) { return std::uniform_int_distribution<uint64_t>(0, n - 1)(rng_); }
  bool P(double p) { return std::uniform_real_distribution<double>(0, 1)(rng_) < p; }
  RefSeq& Pick() { return seqs_[R(seqs_.size())]; }
  const BlockLayout& Bl() const { return store_->pool().layout(); }
  std::vector<uint32_t> RandomPrompt() {
    std::vector<uint32_t> p = prefixes_[R(prefixes_.size())];
    for (uint64_t i = R(11); i > 0; --i) p.push_back(static_cast<uint32_t>(R(3)));
    return p;
  }
  std::vector<BlockHash> Chain(const RefSeq& s, uint64_t tokens) const {
    std::vector<uint32_t> ids(s.ids.begin(),
                              s.ids.begin() + std::min<uint64_t>(tokens, s.ids.size()));
    return PrefixHashes(store_->options().hash, store_->prefix().Root(s.tenant, s.salt), ids, kBt,
                        s.Keys());
  }
  bool Contains(const std::string& tenant, const BlockHash& h) {
    MatchQuery q;
    q.hashes = {h};
    return store_->prefix().Match(tenant, {q})[0] == kBt;
  }
  std::set<BlockHash> Protected() {
    std::set<BlockHash> out;
    for (const RefSeq& s : seqs_) {
      const auto chain = Chain(s, s.Length());
      for (size_t i = 0; i < s.indexed.size(); ++i) {
        if (s.indexed[i]) out.insert(chain[i]);
      }
    }
    for (const auto& [key, n] : pins_) out.insert(key.second);
    return out;
  }
  void Count(const char* op) {
    op_ = op;
    ++counts_[op];
  }

  void Step() {
    protected_ = Protected();
    const uint64_t r = R(100);
    if (seqs_.empty() || (r < 14 && seqs_.size() < kMaxSeqs)) return Create();
    if (r < 52) return Append();
    if (r < 58) return Fork();
    if (r < 65) return Truncate();
    if (r < 72 || seqs_.size() >= kMaxSeqs) return Free();
    if (r < 80) return Match();
    if (r < 88) return PinOrUnpin();
    if (r < 93) return Expire();
    return Reader();
  }

  void Create() {
    Count("create");
    RefSeq s;
    s.tenant = kTenants[R(2)];
    s.salt = P(0.15) ? "s" : "";
    s.lora = P(0.15) ? "L" : "";
    CreateOptions o;
    o.lease = absl::ZeroDuration();
    o.tenant = s.tenant;
    o.cache_salt = s.salt;
    o.extra_keys = s.Keys();
    if (P(0.85)) o.prompt = RandomPrompt();
    MatchQuery q;
    q.tokens = o.prompt;
    q.cache_salt = s.salt;
    q.extra_keys = s.Keys();
    const uint64_t expect = store_->prefix().Match(s.tenant, {q})[0];
    auto info = store_->Create(o);
    ASSERT_TRUE(info.ok()) << info.status();
    ASSERT_EQ(info->cached_tokens, expect) << "Create attaches what Match promised";
    s.id = info->id;
    s.ids = o.prompt;
    for (uint64_t t = 0; t < expect; ++t) s.seeds.push_back(s.DigestAt(t));
    s.len[0] = s.len[1] = expect;
    s.indexed.assign(expect / kBt, true);
    seqs_.push_back(s);
    touched_ = s.id;
  }

  void Append() {
    Count("append");
    RefSeq& s = Pick();
    touched_ = s.id;
    if (s.MaxLen() >= kMaxLen) return;
    RefSeq next = s;
    uint32_t l0 = 0, l1 = kLayers;
    if (s.len[0] != s.len[1]) {
      l0 = s.len[0] < s.len[1] ? 0 : 1;  // the lagging layer (a layer-streaming prefill)
      l1 = l0 + 1;
    } else if (P(0.3)) {
      l0 = static_cast<uint32_t>(R(kLayers));
      l1 = l0 + 1;
    }
    const uint64_t pos = s.len[l0];
    const uint64_t n = 1 + R(7);
    // Ids may be sent only when no position of the range was written without them before.
    bool with_ids = P(0.8) && pos <= s.ids.size();
    for (uint64_t t = pos; t < pos + n && with_ids; ++t) {
      if (t >= s.ids.size() && t < s.seeds.size()) with_ids = false;
    }
    for (uint64_t t = pos; t < pos + n; ++t) {
      if (t < next.seeds.size()) continue;
      if (t >= next.ids.size() && with_ids) next.ids.push_back(static_cast<uint32_t>(R(3)));
      next.seeds.push_back(t < next.ids.size() ? next.DigestAt(t) : rng_());
    }
    for (uint32_t l = l0; l < l1; ++l) next.len[l] += n;
    AppendSpec spec;
    spec.tenant = s.tenant;
    spec.sequence_id = s.id;
    spec.layer_begin = l0;
    spec.layer_end = l1;
    spec.num_tokens = n;
    if (with_ids) spec.token_ids.assign(next.ids.begin() + pos, next.ids.begin() + pos + n);
    const auto payload = BuildPayload(Bl(), l0, l1, pos, n, next.seeds);
    const uint64_t ev0 = events_->last_sequence();
    const uint64_t used0 = store_->pool().Stats().used;

    if (with_ids && P(0.05) && pos < s.ids.size()) {  // contradicts a known id: refused
      spec.token_ids[0] ^= 1;
      ASSERT_EQ(store_->BeginAppend(spec).status().code(), absl::StatusCode::kInvalidArgument);
      return;
    }
    auto txn = store_->BeginAppend(spec);
    if (!txn.ok()) {
      ASSERT_EQ(txn.status().code(), absl::StatusCode::kResourceExhausted) << txn.status();
      ++counts_["append_exhausted"];
      ASSERT_EQ(events_->last_sequence(), ev0) << "a failed allocation evicts nothing";
      return;
    }
    size_t off = 0;
    const bool abort = P(0.05);
    const size_t stop = abort ? R(payload.size()) : payload.size();
    while (off < stop) {
      const size_t chunk = std::min<size_t>(stop - off, 1 + R(700));
      ASSERT_TRUE((*txn)->Write(absl::MakeConstSpan(payload.data() + off, chunk)).ok());
      off += chunk;
    }
    if (abort) {
      txn->reset();  // a cancelled append leaves everything as before
      ++counts_["append_aborted"];
      ASSERT_EQ(store_->pool().Stats().used, used0);
      return;
    }
    auto info = (*txn)->Commit();
    ASSERT_TRUE(info.ok()) << info.status();
    txn->reset();
    // Stored events of this append name this sequence's next chain blocks.
    const auto chain = Chain(next, next.Length());
    auto batch = events_->Read(ev0, 1000, "", true);
    ASSERT_TRUE(batch.ok()) << batch.status();
    for (const KvEvent& e : batch->events) {
      if (e.type != KvEvent::Type::kBlockStored) continue;
      ASSERT_EQ(e.tenant, next.tenant);
      auto it = std::find(chain.begin(), chain.end(), e.hashes.at(0));
      ASSERT_NE(it, chain.end()) << "a stored hash outside the appending sequence's chain";
      const size_t i = it - chain.begin();
      ASSERT_EQ(e.has_parent, i > 0);
      if (i > 0) {
        ASSERT_EQ(e.parent, chain[i - 1]);
      }
      ASSERT_EQ(e.token_ids, std::vector<uint32_t>(next.ids.begin() + i * kBt,
                                                   next.ids.begin() + (i + 1) * kBt));
      next.indexed.resize(std::max(next.indexed.size(), i + 1), false);
      next.indexed[i] = true;
    }
    s = next;
  }

  void Fork() {
    if (seqs_.size() >= kMaxSeqs) return Free();
    Count("fork");
    RefSeq& p = Pick();
    auto info = store_->Fork(p.id, std::nullopt, p.tenant);
    if (!info.ok()) {
      ASSERT_EQ(info.status().code(), absl::StatusCode::kResourceExhausted) << info.status();
      return;
    }
    RefSeq c = p;
    c.id = info->id;
    c.indexed.resize(std::min<size_t>(c.indexed.size(), p.Length() / kBt));
    seqs_.push_back(c);
    touched_ = c.id;
  }

  void Truncate() {
    Count("truncate");
    RefSeq& s = Pick();
    touched_ = s.id;
    const uint64_t n = R(s.Length() + 1);
    auto info = store_->Truncate(s.id, n, s.tenant);
    ASSERT_TRUE(info.ok()) << info.status();
    s.len[0] = s.len[1] = n;
    s.seeds.resize(n);
    s.ids.resize(std::min<size_t>(s.ids.size(), n));
    s.indexed.resize(std::min<size_t>(s.indexed.size(), n / kBt));
  }

  void Free() {
    Count("free");
    const size_t i = R(seqs_.size());
    const RefSeq s = seqs_[i];
    auto n = store_->Free(s.id, s.tenant);
    ASSERT_TRUE(n.ok()) << n.status();
    ASSERT_EQ(*n, (s.MaxLen() + kBt - 1) / kBt);
    seqs_.erase(seqs_.begin() + i);
    ASSERT_EQ(store_->Get(s.id, s.tenant).status().code(), absl::StatusCode::kFailedPrecondition);
    ASSERT_EQ(store_->Get(s.id, s.tenant == "a" ? "b" : "a").status().code(),
              absl::StatusCode::kNotFound);
    touched_ = 0;
  }

  void Match() {
    Count("match");
    RefSeq probe;
    probe.tenant = kTenants[R(2)];
    probe.salt = P(0.15) ? "s" : "";
    probe.lora = P(0.15) ? "L" : "";
    probe.ids = RandomPrompt();
    MatchQuery by_tokens, by_hashes;
    by_tokens.tokens = probe.ids;
    by_tokens.cache_salt = probe.salt;
    by_tokens.extra_keys = probe.Keys();
    by_hashes.hashes = Chain(probe, probe.ids.size());
    const PoolStats before = store_->pool().Stats();
    const uint64_t ev = events_->last_sequence();
    const auto got = store_->prefix().Match(probe.tenant, {by_tokens, by_hashes});
    ASSERT_EQ(got[0], got[1]);
    ASSERT_EQ(got[0] % kBt, 0u);
    const PoolStats after = store_->pool().Stats();
    ASSERT_TRUE(before.free == after.free && before.cached == after.cached &&
                before.evictions == after.evictions && ev == events_->last_sequence())
        << "Match has side effects";
    if (got[0] == 0) return;
    // The hit reads back as the KV of exactly these tokens for this tenant, salt and LoRA.
    std::vector<BlockHash> run(by_hashes.hashes.begin(), by_hashes.hashes.begin() + got[0] / kBt);
    auto r = store_->prefix().FetchBlocks(probe.tenant, run, 0, std::nullopt);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ((*r)->num_tokens(), got[0]);
    std::vector<uint8_t> bytes((*r)->payload_bytes());
    EXPECT_TRUE((*r)->Read(0, absl::MakeSpan(bytes)).ok());
    for (uint64_t t = 0; t < got[0]; ++t) probe.seeds.push_back(probe.DigestAt(t));
    ASSERT_EQ(bytes, BuildPayload(Bl(), 0, kLayers, 0, got[0], probe.seeds));
    ++counts_["match_hit"];
  }

  void PinOrUnpin() {
    Count("pin");
    if (!pins_.empty() && (pins_.size() >= 6 || P(0.5))) {
      auto it = pins_.begin();
      std::advance(it, R(pins_.size()));
      ASSERT_EQ(store_->prefix().Pin(it->first.first, {it->first.second}, false), 1u)
          << "a pinned block left the index";
      if (--it->second == 0) pins_.erase(it);
      return;
    }
    const RefSeq& s = Pick();
    const auto chain = Chain(s, s.Length());
    if (chain.empty()) return;
    const BlockHash h = chain[R(chain.size())];
    ASSERT_EQ(store_->prefix().Pin(s.tenant == "a" ? "b" : "a", {h}, true), 0u)
        << "pinned across tenants";
    if (store_->prefix().Pin(s.tenant, {h}, true) == 1) ++pins_[{s.tenant, h}];
  }

  void Expire() {
    Count("expire");
    now_ += absl::Minutes(R(40));
    if (P(0.1)) {
      store_->prefix().ClearCache();
      const PoolStats st = store_->pool().Stats();
      ASSERT_LE(st.cached, st.pinned) << "only pinned blocks survive ClearCache";
      return;
    }
    store_->prefix().ExpireCache(now_);
  }

  void Reader() {
    Count("reader");
    if (!readers_.empty() && (readers_.size() >= 3 || P(0.5))) {
      const size_t i = R(readers_.size());
      std::vector<uint8_t> bytes(readers_[i].first->payload_bytes());
      EXPECT_TRUE(readers_[i].first->Read(0, absl::MakeSpan(bytes)).ok());
      ASSERT_EQ(bytes, readers_[i].second) << "a block under a reader changed";
      readers_.erase(readers_.begin() + i);
      return;
    }
    const RefSeq& s = Pick();
    FetchSpec f;
    f.tenant = s.tenant;
    f.sequence_id = s.id;
    auto r = store_->BeginFetch(f);
    ASSERT_TRUE(r.ok()) << r.status();
    readers_.emplace_back(*std::move(r), BuildPayload(Bl(), 0, kLayers, 0, s.Length(), s.seeds));
  }

  void CheckContent(const RefSeq& s) {
    auto info = store_->Get(s.id, s.tenant);
    ASSERT_TRUE(info.ok()) << info.status();
    ASSERT_EQ(info->layer_lengths, std::vector<uint64_t>(s.len, s.len + kLayers));
    ASSERT_EQ(info->num_blocks, (s.MaxLen() + kBt - 1) / kBt);
    for (uint32_t l = 0; l < kLayers; ++l) {
      FetchSpec f;
      f.tenant = s.tenant;
      f.sequence_id = s.id;
      f.layer_begin = l;
      f.layer_end = l + 1;
      auto r = store_->BeginFetch(f);
      ASSERT_TRUE(r.ok()) << r.status();
      std::vector<uint8_t> bytes((*r)->payload_bytes());
      EXPECT_TRUE((*r)->Read(0, absl::MakeSpan(bytes)).ok());
      ASSERT_EQ(bytes, BuildPayload(Bl(), l, l + 1, 0, s.len[l], s.seeds))
          << "sequence content differs in layer " << l;
    }
  }

  void CheckAfterStep() {
    ASSERT_EQ(store_->CheckInvariants(), "");
    const PoolStats st = store_->pool().Stats();
    ASSERT_EQ(st.free + st.cached + st.used, st.total);
    uint64_t most = 0, sum = 0;
    for (const RefSeq& s : seqs_) {
      const uint64_t b = (s.MaxLen() + kBt - 1) / kBt;
      most = std::max(most, b);
      sum += b;
    }
    for (const auto& r : readers_) sum += (r.first->num_tokens() + kBt - 1) / kBt;
    ASSERT_GE(st.used, most);
    ASSERT_LE(st.used, sum) << "a block nobody holds is counted as used";
    ASSERT_EQ(st.pinned, pins_.size());
    // Blocks a live sequence holds from the index, and pinned ones, never leave it.
    for (const RefSeq& s : seqs_) {
      const auto chain = Chain(s, s.Length());
      for (size_t i = 0; i < s.indexed.size(); ++i) {
        if (s.indexed[i]) {
          ASSERT_TRUE(Contains(s.tenant, chain[i])) << "block " << i;
        }
      }
    }
    for (const auto& [key, n] : pins_) ASSERT_TRUE(Contains(key.first, key.second));
    auto batch = events_->Read(events_seen_, 1 << 20, "", true);
    ASSERT_TRUE(batch.ok()) << batch.status();
    for (const KvEvent& e : batch->events) {
      ASSERT_GT(e.sequence, events_seen_) << "event sequence numbers go back";
      events_seen_ = e.sequence;
      if (e.type != KvEvent::Type::kBlockRemoved) continue;
      ++counts_["removed_blocks"];
      for (const BlockHash& h : e.hashes) {
        ASSERT_EQ(protected_.count(h), 0u) << "a referenced or pinned block was dropped";
      }
    }
    events_seen_ = batch->next_after;
    for (const RefSeq& s : seqs_) {
      if (s.id == touched_) CheckContent(s);
    }
  }

  void CheckEverything() {
    for (const RefSeq& s : seqs_) {
      CheckContent(s);
      const std::string other = s.tenant == "a" ? "b" : "a";
      ASSERT_EQ(store_->Get(s.id, other).status().code(), absl::StatusCode::kNotFound);
      const auto chain = Chain(s, s.Length());
      if (chain.empty()) continue;
      MatchQuery q;
      q.hashes = chain;
      ASSERT_EQ(store_->prefix().Match(other, {q})[0], 0u) << "cross-tenant hit";
      ASSERT_EQ(store_->prefix().FetchBlocks(other, chain, 0, std::nullopt).status().code(),
                absl::StatusCode::kNotFound);
      // Every hash of the chain that the index knows names this content.
      for (size_t i = 0; i < chain.size(); ++i) {
        auto r = store_->prefix().FetchBlocks(s.tenant, {chain[i]}, 0, std::nullopt);
        if (!r.ok()) {
          ASSERT_EQ(r.status().code(), absl::StatusCode::kNotFound);
          continue;
        }
        std::vector<uint8_t> bytes((*r)->payload_bytes());
        EXPECT_TRUE((*r)->Read(0, absl::MakeSpan(bytes)).ok());
        std::vector<uint64_t> seeds(s.seeds.begin(), s.seeds.begin() + (i + 1) * kBt);
        ASSERT_EQ(bytes, BuildPayload(Bl(), 0, kLayers, i * kBt, kBt, seeds))
            << "published block " << i << " holds other content";
        ++counts_["hash_checks"];
      }
    }
  }

  // Everything goes; then the pool must be all free after ClearCache.
  void Drain() {
    readers_.clear();
    for (const RefSeq& s : seqs_) ASSERT_TRUE(store_->Free(s.id, s.tenant).ok());
    seqs_.clear();
    for (const auto& [key, n] : pins_) {
      for (int i = 0; i < n; ++i)
        ASSERT_EQ(store_->prefix().Pin(key.first, {key.second}, false), 1u);
    }
    pins_.clear();
    ASSERT_EQ(store_->pool().Stats().used, 0u);
    store_->prefix().ClearCache();
    const PoolStats st = store_->pool().Stats();
    ASSERT_EQ(st.free, st.total);
    ASSERT_EQ(st.pinned, 0u);
    ASSERT_EQ(store_->CheckInvariants(), "");
    auto last = events_->Read(events_->last_sequence() - 1, 1, "", true);
    ASSERT_TRUE(last.ok());
    ASSERT_EQ(last->events.back().type, KvEvent::Type::kAllCleared);
  }

  std::mt19937_64 rng_;
  absl::Time now_ = absl::FromUnixSeconds(1700000000);
  KvEventLog* events_ = nullptr;
  std::unique_ptr<SequenceStore> store_;
  std::vector<std::vector<uint32_t>> prefixes_;
  std::vector<RefSeq> seqs_;
  std::map<std::pair<std::string, BlockHash>, int> pins_;
  std::vector<std::pair<std::unique_ptr<FetchReader>, std::vector<uint8_t>>> readers_;
  std::set<BlockHash> protected_;
  uint64_t events_seen_ = 0;
  uint64_t touched_ = 0;
  int step_ = 0;
  const char* op_ = "";
  std::map<std::string, size_t> counts_;
};

class PrefixModelTest : public ::testing::TestWithParam<uint64_t> {};

TEST_P(PrefixModelTest, RandomOperationsMatchTheReference) {
  const uint64_t seed = GetParam();
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  PrefixModel m(seed);
  m.Run(5000);
  std::printf(
      "creates %zu appends %zu (exhausted %zu, aborted %zu) forks %zu truncates %zu frees %zu "
      "matches %zu (hits %zu) pins %zu expires %zu readers %zu removed %zu hash checks %zu\n",
      m.ops("create"), m.ops("append"), m.ops("append_exhausted"), m.ops("append_aborted"),
      m.ops("fork"), m.ops("truncate"), m.ops("free"), m.ops("match"), m.ops("match_hit"),
      m.ops("pin"), m.ops("expire"), m.ops("reader"), m.ops("removed_blocks"),
      m.ops("hash_checks"));
  if (HasFailure()) return;
  // The run exercised what it is about: sharing hits, evictions, full pools.
  EXPECT_GT(m.ops("match_hit"), 50u);
  EXPECT_GT(m.ops("removed_blocks"), 100u);
  EXPECT_GT(m.ops("append_exhausted"), 5u);
  EXPECT_GT(m.ops("hash_checks"), 500u);
}

INSTANTIATE_TEST_SUITE_P(Seeds, PrefixModelTest, ::testing::Values(1, 20240611, 777, 4242));

}  // namespace
}  // namespace kvbank
