// Prefix sharing against the real kvbankd through the real client on loopback: sharing across
// connections, Match / FetchBlocks / Pin with block hashes the SDK computes, eviction only under
// allocation pressure, the cache TTL, tenant isolation over bearer tokens, KV events through
// Watch, and abandoned sequences giving their blocks back.
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
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint32_t kBt = 16;  // block_tokens of the test layout
// Sequence ids are below 2^53, so this one never names a sequence.
constexpr uint64_t kNeverId = (uint64_t{1} << 53) + 12345;
// KV events a model's log keeps (ModelConfig::event_capacity; no kvbankd flag sets it).
constexpr uint64_t kEventCapacity = 65536;

// 2 layers x 2 KV heads x head_dim 16, fp16, 16-token blocks: 4 KiB blocks, 256 payload bytes a
// token.
ModelLayout SmallLayout(const std::string& name) {
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

uint64_t BlockBytes(const ModelLayout& m) { return ComputeBlockLayout(m).block_bytes; }

// Seeded token ids (a vocabulary of 128k).
std::vector<uint32_t> Tokens(uint64_t seed, size_t n) {
  Random rng(seed);
  std::vector<uint32_t> t(n);
  for (uint32_t& x : t) x = static_cast<uint32_t>(rng.Next() % 128000);
  return t;
}

std::vector<uint32_t> Slice(const std::vector<uint32_t>& v, size_t begin, size_t end) {
  return std::vector<uint32_t>(v.begin() + begin, v.begin() + end);
}

Client::ModelStats StatsOf(Client& client, const std::string& model) {
  auto stats = client.GetStats(model);
  EXPECT_TRUE(stats.ok()) << stats.status();
  if (!stats.ok() || stats->size() != 1) {
    ADD_FAILURE() << "GetStats(" << model << ") did not return one model";
    return {};
  }
  return (*stats)[0];
}

// free + cached + referenced = total, as the server reports it.
void ExpectAccounting(const Client::ModelStats& st) {
  EXPECT_EQ(st.blocks_free + st.blocks_cached + st.blocks_used, st.blocks_total)
      << "free " << st.blocks_free << " cached " << st.blocks_cached << " used " << st.blocks_used;
}

const Client::ModelStats::Tenant* TenantRow(const Client::ModelStats& st, const std::string& t) {
  for (const auto& row : st.tenants) {
    if (row.tenant == t) return &row;
  }
  return nullptr;
}

// Appends `n` random tokens of every layer to sequence `id`, mirrored in `ref`.
absl::StatusOr<Client::SequenceInfo> AppendKv(Client& client, const std::string& model, uint64_t id,
                                              KvReference& ref, Random& rng, uint64_t n,
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
bool WaitUntil(const std::function<bool()>& done, absl::Duration timeout = absl::Seconds(10)) {
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
Watched WatchUntil(Client& client, const std::string& model, uint64_t after, bool from_now,
                   const std::function<bool(const Watched&)>& enough,
                   absl::Duration deadline = absl::Seconds(10), std::atomic<bool>* live = nullptr) {
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

std::set<BlockHash> HashSet(const std::vector<BlockHash>& v) { return {v.begin(), v.end()}; }

// A status message with `id` written as <id>, to compare answers about different ids.
std::string WithoutId(const absl::Status& s, uint64_t id) {
  return absl::StrReplaceAll(s.message(), {{std::to_string(id), "<id>"}});
}

// ---------------------------------------------------------------------------------------------
// 1. Two connections, one prompt: the second sequence attaches the first one's full blocks.

class SharingTest : public KvbankdTest, public testing::WithParamInterface<bool> {};

TEST_P(SharingTest, SamePromptOnTwoConnectionsSharesPhysicalBlocks) {
  const bool prompt_at_create = GetParam();
  const uint64_t seed = prompt_at_create ? 7101 : 7102;
  std::cerr << "[sharing] prompt " << (prompt_at_create ? "at create" : "as append token_ids")
            << ", seed " << seed << "\n";
  ASSERT_NO_FATAL_FAILURE(StartServer({"--models="}));
  std::unique_ptr<Client> a = NewClient();
  std::unique_ptr<Client> b = NewClient();
  std::unique_ptr<Client> c = NewClient();
  const ModelLayout layout = SmallLayout("m");
  auto model = a->EnsureModel(layout, 4 * kMiB);
  ASSERT_TRUE(model.ok()) << model.status();
  const uint32_t L = layout.num_layers;
  const std::vector<uint32_t> prompt = Tokens(seed, 5 * kBt + 7);  // 5 full blocks and 7 tokens
  const uint64_t full = 5 * kBt;
  Random rng(seed);

  // The first worker prefills the prompt.
  Client::CreateArgs args;
  if (prompt_at_create) args.prompt = prompt;
  auto first = a->CreateSequence("m", args);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->cached_tokens, 0u);
  KvReference ref_a(layout);
  auto appended = AppendKv(*a, "m", first->id, ref_a, rng, prompt.size(),
                           prompt_at_create ? std::vector<uint32_t>{} : prompt);
  ASSERT_TRUE(appended.ok()) << appended.status();
  Client::ModelStats st = StatsOf(*c, "m");
  EXPECT_EQ(st.blocks_used, 6u);
  EXPECT_EQ(st.blocks_cached, 0u);  // published blocks a sequence holds are referenced, not cached
  ExpectAccounting(st);

  // The second worker, on its own connection, gets the 5 full blocks from the cache.
  args.prompt = prompt;
  auto second = b->CreateSequence("m", args);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->cached_tokens, full);
  EXPECT_EQ(second->length, full);
  EXPECT_EQ(second->num_blocks, 5u);
  st = StatsOf(*c, "m");
  EXPECT_EQ(st.blocks_used, 6u) << "attaching cached blocks takes no new block";
  EXPECT_EQ(st.sequences, 2u);
  ExpectAccounting(st);

  // It appends only the rest (its own KV for the last 7 tokens): one new block.
  KvReference ref_b = ref_a;
  ref_b.Truncate(full);
  Random rng_b(seed + 1);
  auto rest = AppendKv(*b, "m", second->id, ref_b, rng_b, prompt.size() - full);
  ASSERT_TRUE(rest.ok()) << rest.status();
  EXPECT_EQ(rest->length, prompt.size());
  st = StatsOf(*c, "m");
  EXPECT_EQ(st.blocks_used, 7u);
  ExpectAccounting(st);

  // The shared part reads back bit-exact as the first worker wrote it, on every connection.
  for (Client* reader : {a.get(), b.get(), c.get()}) {
    Client::FetchArgs f;
    f.token_end = full;
    auto got = reader->Fetch("m", second->id, f);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(BytesEqual(got->payload, ref_a.Payload(0, L, 0, full)));
  }
  auto whole_b = c->Fetch("m", second->id, {});
  ASSERT_TRUE(whole_b.ok()) << whole_b.status();
  EXPECT_TRUE(BytesEqual(whole_b->payload, ref_b.Payload(0, L, 0, prompt.size())));
  auto whole_a = c->Fetch("m", first->id, {});
  ASSERT_TRUE(whole_a.ok()) << whole_a.status();
  EXPECT_TRUE(BytesEqual(whole_a->payload, ref_a.Payload(0, L, 0, prompt.size())))
      << "the second worker's append must not touch the first one's partial block";

  // Prefix counters: what was looked up at create, and what hit.
  const uint64_t queried = (prompt_at_create ? 2 : 1) * prompt.size();
  EXPECT_EQ(st.prefix_query_tokens, queried);
  EXPECT_EQ(st.prefix_hit_tokens, full);
  ASSERT_EQ(st.tenants.size(), 1u);
  EXPECT_EQ(st.tenants[0].tenant, "");
  EXPECT_EQ(st.tenants[0].prefix_query_tokens, queried);
  EXPECT_EQ(st.tenants[0].prefix_hit_tokens, full);
  EXPECT_EQ(st.tenants[0].sequences, 2u);
  EXPECT_EQ(st.tenants[0].blocks_referenced, 7u);

  // The first sequence goes: the shared blocks stay (the second holds them), its partial one is
  // freed.
  auto released = a->Free("m", first->id);
  ASSERT_TRUE(released.ok()) << released.status();
  EXPECT_EQ(*released, 6u);
  st = StatsOf(*c, "m");
  EXPECT_EQ(st.blocks_used, 6u);
  EXPECT_EQ(st.blocks_cached, 0u);
  ExpectAccounting(st);

  // A third worker: a longer prompt matches the 5 blocks; another salt, and a prompt that differs
  // in block 1, do not (or only up to the difference).
  std::vector<uint32_t> longer = prompt;
  for (uint32_t t : Tokens(seed + 2, 40)) longer.push_back(t);
  Client::CreateArgs third_args;
  third_args.prompt = longer;
  auto third = c->CreateSequence("m", third_args);
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_EQ(third->cached_tokens, full);
  third_args.cache_salt = "other-salt";
  auto salted = c->CreateSequence("m", third_args);
  ASSERT_TRUE(salted.ok()) << salted.status();
  EXPECT_EQ(salted->cached_tokens, 0u);
  Client::CreateArgs diverged_args;
  diverged_args.prompt = prompt;
  diverged_args.prompt[kBt + 4] ^= 1;
  auto diverged = c->CreateSequence("m", diverged_args);
  ASSERT_TRUE(diverged.ok()) << diverged.status();
  EXPECT_EQ(diverged->cached_tokens, kBt);

  // Everything freed: the published blocks stay cached, the rest is free.
  for (uint64_t id : {second->id, third->id, salted->id, diverged->id}) {
    ASSERT_TRUE(c->Free("m", id).ok());
  }
  st = StatsOf(*c, "m");
  EXPECT_EQ(st.blocks_used, 0u);
  EXPECT_EQ(st.blocks_cached, 5u);
  EXPECT_EQ(st.sequences, 0u);
  EXPECT_EQ(st.evictions, 0u);
  ExpectAccounting(st);
}

INSTANTIATE_TEST_SUITE_P(PromptAt, SharingTest, testing::Values(true, false),
                         [](const testing::TestParamInfo<bool>& info) {
                           return info.param ? std::string("Create") : std::string("Append");
                         });

// ---------------------------------------------------------------------------------------------
// 2. Match, FetchBlocks and Pin by block hashes the SDK computes; eviction; TTL; caching off.

class HashTest : public KvbankdTest, public testing::WithParamInterface<std::string> {};

TEST_P(HashTest, SdkHashesEqualTheServersAndMatchHasNoSideEffects) {
  const std::string algo = GetParam();
  const uint64_t seed = algo == "sha256" ? 7201 : 7202;
  std::cerr << "[hash] " << algo << ", seed " << seed << "\n";
  ASSERT_NO_FATAL_FAILURE(StartServer({"--models=", "--hash-algorithm=" + algo}));
  std::unique_ptr<Client> writer = NewClient();
  std::unique_ptr<Client> router = NewClient();
  const ModelLayout layout = SmallLayout("m");
  ASSERT_TRUE(writer->EnsureModel(layout, 4 * kMiB).ok());
  const uint32_t L = layout.num_layers;

  // The root a router computes hashes from, and the same root computed without the server.
  auto root = router->GetPrefixRoot("m");
  ASSERT_TRUE(root.ok()) << root.status();
  EXPECT_EQ(HashAlgorithmName(root->algorithm), algo);
  EXPECT_EQ(root->block_tokens, kBt);
  EXPECT_EQ(root->layout_fingerprint, LayoutFingerprint(layout));
  EXPECT_EQ(root->tenant, "");
  EXPECT_EQ(root->root, RootHash(root->algorithm, PrefixRoot{LayoutFingerprint(layout), "", ""}));
  auto salted_root = router->GetPrefixRoot("m", "salt");
  ASSERT_TRUE(salted_root.ok()) << salted_root.status();
  EXPECT_NE(salted_root->root, root->root);

  // Token ids ride on the append (no prompt at create): 3 full blocks and 5 tokens.
  const std::vector<uint32_t> tokens = Tokens(seed, 3 * kBt + 5);
  auto seq = writer->CreateSequence("m");
  ASSERT_TRUE(seq.ok()) << seq.status();
  KvReference ref(layout);
  Random rng(seed);
  ASSERT_TRUE(AppendKv(*writer, "m", seq->id, ref, rng, tokens.size(), tokens).ok());

  const std::vector<BlockHash> hashes =
      PrefixHashes(root->algorithm, root->root, tokens, root->block_tokens);
  ASSERT_EQ(hashes.size(), 3u);
  std::vector<uint32_t> changed = tokens;
  changed[2 * kBt + 1] += 1;  // block 2 differs
  const BlockHash unknown =
      PrefixHashes(root->algorithm, root->root, Tokens(seed + 1, kBt), kBt)[0];

  const Client::ModelStats before = StatsOf(*router, "m");
  std::vector<Client::MatchQuery> queries(8);
  queries[0].tokens = tokens;
  queries[1].hashes = hashes;
  queries[2].hashes = {hashes[0], hashes[1]};
  queries[3].tokens = changed;
  queries[4].tokens = tokens;
  queries[4].cache_salt = "salt";
  queries[5].hashes = {unknown};
  queries[6].tokens = Slice(tokens, 0, 2 * kBt + 15);  // a partial block never matches
  queries[7].hashes = {hashes[0], unknown, hashes[2]};
  auto matched = router->Match("m", queries);
  ASSERT_TRUE(matched.ok()) << matched.status();
  EXPECT_EQ(*matched,
            (std::vector<uint64_t>{3 * kBt, 3 * kBt, 2 * kBt, 2 * kBt, 0, 0, 2 * kBt, kBt}));
  // No side effects: no block taken, no counter moved.
  const Client::ModelStats after = StatsOf(*router, "m");
  EXPECT_EQ(after.blocks_used, before.blocks_used);
  EXPECT_EQ(after.blocks_cached, before.blocks_cached);
  EXPECT_EQ(after.blocks_free, before.blocks_free);
  EXPECT_EQ(after.prefix_query_tokens, before.prefix_query_tokens);
  EXPECT_EQ(after.prefix_hit_tokens, before.prefix_hit_tokens);
  EXPECT_EQ(after.fetches, before.fetches);
  EXPECT_EQ(after.evictions, before.evictions);

  // FetchBlocks by the SDK's hashes returns what a fetch of the sequence returns.
  Client::FetchArgs head;
  head.token_end = 3 * kBt;
  auto by_seq = router->Fetch("m", seq->id, head);
  ASSERT_TRUE(by_seq.ok()) << by_seq.status();
  auto by_hash = router->FetchBlocks("m", hashes);
  ASSERT_TRUE(by_hash.ok()) << by_hash.status();
  EXPECT_EQ(by_hash->token_begin, 0u);
  EXPECT_EQ(by_hash->num_tokens, 3 * kBt);
  EXPECT_EQ(by_hash->layer_begin, 0u);
  EXPECT_EQ(by_hash->layer_end, L);
  EXPECT_EQ(by_hash->dtype, DType::kFp16);
  EXPECT_TRUE(BytesEqual(by_hash->payload, by_seq->payload));
  EXPECT_TRUE(BytesEqual(by_hash->payload, ref.Payload(0, L, 0, 3 * kBt)));
  auto layer1 = router->FetchBlocks("m", hashes, 1, 2);
  ASSERT_TRUE(layer1.ok()) << layer1.status();
  EXPECT_TRUE(BytesEqual(layer1->payload, ref.Payload(1, 2, 0, 3 * kBt)));
  // The chain stops at the first miss.
  auto cut = router->FetchBlocks("m", {hashes[0], unknown, hashes[2]});
  ASSERT_TRUE(cut.ok()) << cut.status();
  EXPECT_EQ(cut->num_tokens, kBt);
  EXPECT_TRUE(BytesEqual(cut->payload, ref.Payload(0, L, 0, kBt)));
  auto none = router->FetchBlocks("m", {unknown});
  EXPECT_EQ(none.status().code(), absl::StatusCode::kNotFound) << none.status();

  // After the sequence is freed, its full blocks are still there to match and fetch.
  ASSERT_TRUE(writer->Free("m", seq->id).ok());
  // (The fetches above hold references until their streams are done on the server.)
  EXPECT_TRUE(WaitUntil([&] {
    const Client::ModelStats st = StatsOf(*router, "m");
    return st.blocks_cached == 3 && st.blocks_used == 0;
  })) << "the freed sequence's full blocks are not all cached";
  ExpectAccounting(StatsOf(*router, "m"));
  matched = router->Match("m", {queries[1]});
  ASSERT_TRUE(matched.ok()) << matched.status();
  EXPECT_EQ(*matched, std::vector<uint64_t>{3 * kBt});
  by_hash = router->FetchBlocks("m", hashes);
  ASSERT_TRUE(by_hash.ok()) << by_hash.status();
  EXPECT_TRUE(BytesEqual(by_hash->payload, ref.Payload(0, L, 0, 3 * kBt)));
  // The fetch's references go when its stream is done (the server may finish a moment after the
  // client has its status).
  EXPECT_TRUE(WaitUntil([&] {
    const Client::ModelStats st = StatsOf(*router, "m");
    return st.blocks_cached == 3 && st.blocks_used == 0;
  })) << "a fetch by hash kept its references";
}

INSTANTIATE_TEST_SUITE_P(Algorithms, HashTest, testing::Values("sha256", "xxh3_128"));

class CacheTest : public KvbankdTest {};

TEST_F(CacheTest, PinKeepsAPrefixThroughPressureAndEvictionWaitsForAllocation) {
  const ModelLayout layout = SmallLayout("m");
  const uint64_t kBlocks = 12;
  ASSERT_NO_FATAL_FAILURE(
      StartServer({"--models=", "--lease-check-ms=20",
                   absl::StrCat("--pool-bytes=", kBlocks * BlockBytes(layout))}));
  std::unique_ptr<Client> client = NewClient();
  auto model = client->EnsureModel(layout);  // the server's --pool-bytes
  ASSERT_TRUE(model.ok()) << model.status();
  ASSERT_EQ(model->num_blocks, kBlocks);
  const uint32_t L = layout.num_layers;
  std::cerr << "[pin] seed 7301\n";
  Random rng(7301);

  // Two prompts of 4 full blocks each, prefilled and freed: 8 cached blocks, 4 free.
  const std::vector<uint32_t> p = Tokens(7302, 4 * kBt), q = Tokens(7303, 4 * kBt);
  KvReference ref_p(layout), ref_q(layout);
  for (auto [prompt, ref] : {std::pair{&p, &ref_p}, std::pair{&q, &ref_q}}) {
    Client::CreateArgs args;
    args.prompt = *prompt;
    auto seq = client->CreateSequence("m", args);
    ASSERT_TRUE(seq.ok()) << seq.status();
    ASSERT_TRUE(AppendKv(*client, "m", seq->id, *ref, rng, prompt->size()).ok());
    ASSERT_TRUE(client->Free("m", seq->id).ok());
  }
  Client::MatchQuery mp, mq;
  mp.tokens = p;
  mq.tokens = q;
  auto pinned = client->Pin("m", mp);
  ASSERT_TRUE(pinned.ok()) << pinned.status();
  EXPECT_EQ(*pinned, 4u);

  // Nothing is evicted while nothing needs the space, however long it waits.
  absl::SleepFor(absl::Milliseconds(300));
  Client::ModelStats st = StatsOf(*client, "m");
  EXPECT_EQ(st.blocks_cached, 8u);
  EXPECT_EQ(st.blocks_pinned, 4u);
  EXPECT_EQ(st.blocks_free, 4u);
  EXPECT_EQ(st.evictions, 0u);
  ExpectAccounting(st);

  // Allocations the free list covers evict nothing.
  auto r = client->CreateSequence("m");
  ASSERT_TRUE(r.ok()) << r.status();
  KvReference ref_r(layout);
  ASSERT_TRUE(AppendKv(*client, "m", r->id, ref_r, rng, 2 * kBt).ok());  // no ids: not published
  st = StatsOf(*client, "m");
  EXPECT_EQ(st.evictions, 0u);
  EXPECT_EQ(st.blocks_free, 2u);
  auto matched = client->Match("m", {mp, mq});
  ASSERT_TRUE(matched.ok()) << matched.status();
  EXPECT_EQ(*matched, (std::vector<uint64_t>{4 * kBt, 4 * kBt}));

  // 7 more blocks: 2 free + 4 evictable (q's; p's are pinned) are not enough. All or nothing.
  auto too_many = AppendKv(*client, "m", r->id, ref_r, rng, 7 * kBt);
  EXPECT_EQ(too_many.status().code(), absl::StatusCode::kResourceExhausted) << too_many.status();
  st = StatsOf(*client, "m");
  EXPECT_EQ(st.evictions, 0u);
  EXPECT_EQ(st.blocks_cached, 8u);
  matched = client->Match("m", {mp, mq});
  ASSERT_TRUE(matched.ok()) << matched.status();
  EXPECT_EQ(*matched, (std::vector<uint64_t>{4 * kBt, 4 * kBt}));

  // 6 more: q's blocks go, p's stay.
  auto six = AppendKv(*client, "m", r->id, ref_r, rng, 6 * kBt);
  ASSERT_TRUE(six.ok()) << six.status();
  st = StatsOf(*client, "m");
  EXPECT_EQ(st.evictions, 4u);
  EXPECT_EQ(st.blocks_used, 8u);
  EXPECT_EQ(st.blocks_cached, 4u);
  EXPECT_EQ(st.blocks_pinned, 4u);
  EXPECT_EQ(st.blocks_free, 0u);
  ExpectAccounting(st);
  matched = client->Match("m", {mp, mq});
  ASSERT_TRUE(matched.ok()) << matched.status();
  EXPECT_EQ(*matched, (std::vector<uint64_t>{4 * kBt, 0}));
  const std::vector<BlockHash> p_hashes = [&] {
    auto root = client->GetPrefixRoot("m");
    EXPECT_TRUE(root.ok()) << root.status();
    return PrefixHashes(root->algorithm, root->root, p, kBt);
  }();
  auto kept = client->FetchBlocks("m", p_hashes);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_TRUE(BytesEqual(kept->payload, ref_p.Payload(0, L, 0, 4 * kBt)));
  // The pool is full of pinned and referenced blocks.
  auto full = AppendKv(*client, "m", r->id, ref_r, rng, 1 * kBt);
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted) << full.status();

  // Unpinned (by hash this time), the prefix stays cached until an allocation needs the space.
  Client::MatchQuery by_hash;
  by_hash.hashes = p_hashes;
  auto unpinned = client->Pin("m", by_hash, /*pin=*/false);
  ASSERT_TRUE(unpinned.ok()) << unpinned.status();
  EXPECT_EQ(*unpinned, 4u);
  st = StatsOf(*client, "m");
  EXPECT_EQ(st.blocks_pinned, 0u);
  EXPECT_EQ(st.blocks_cached, 4u);
  matched = client->Match("m", {mp});
  ASSERT_TRUE(matched.ok()) << matched.status();
  EXPECT_EQ(*matched, std::vector<uint64_t>{4 * kBt});
  auto last = AppendKv(*client, "m", r->id, ref_r, rng, 4 * kBt);
  ASSERT_TRUE(last.ok()) << last.status();
  st = StatsOf(*client, "m");
  EXPECT_EQ(st.evictions, 8u);
  EXPECT_EQ(st.blocks_used, kBlocks);
  EXPECT_EQ(st.blocks_cached, 0u);
  ExpectAccounting(st);
  matched = client->Match("m", {mp});
  ASSERT_TRUE(matched.ok()) << matched.status();
  EXPECT_EQ(*matched, std::vector<uint64_t>{0});
  // The evicting sequence's own bytes are intact.
  auto r_bytes = client->Fetch("m", r->id, {});
  ASSERT_TRUE(r_bytes.ok()) << r_bytes.status();
  EXPECT_TRUE(BytesEqual(r_bytes->payload, ref_r.Payload(0, L, 0, ref_r.length())));
}

TEST_F(CacheTest, TtlDropsCachedBlocksButNotReferencedOnes) {
  const int64_t kTtlMs = 1500;
  ASSERT_NO_FATAL_FAILURE(StartServer(
      {"--models=", absl::StrCat("--prefix-cache-ttl-ms=", kTtlMs), "--lease-check-ms=20"}));
  std::unique_ptr<Client> client = NewClient();
  const ModelLayout layout = SmallLayout("m");
  ASSERT_TRUE(client->EnsureModel(layout, 2 * kMiB).ok());
  std::cerr << "[ttl] seed 7401\n";
  Random rng(7401);
  const std::vector<uint32_t> kept_prompt = Tokens(7402, 2 * kBt);
  const std::vector<uint32_t> dropped_prompt = Tokens(7403, 3 * kBt);

  Client::CreateArgs args;
  args.prompt = kept_prompt;
  auto kept = client->CreateSequence("m", args);
  ASSERT_TRUE(kept.ok()) << kept.status();
  KvReference ref_kept(layout), ref_dropped(layout);
  ASSERT_TRUE(AppendKv(*client, "m", kept->id, ref_kept, rng, kept_prompt.size()).ok());
  args.prompt = dropped_prompt;
  auto dropped = client->CreateSequence("m", args);
  ASSERT_TRUE(dropped.ok()) << dropped.status();
  ASSERT_TRUE(AppendKv(*client, "m", dropped->id, ref_dropped, rng, dropped_prompt.size()).ok());
  const absl::Time freed_at = absl::Now();
  ASSERT_TRUE(client->Free("m", dropped->id).ok());
  Client::MatchQuery mk, md;
  mk.tokens = kept_prompt;
  md.tokens = dropped_prompt;
  auto matched = client->Match("m", {mk, md});
  ASSERT_TRUE(matched.ok()) << matched.status();
  if (absl::Now() - freed_at < absl::Milliseconds(kTtlMs)) {
    EXPECT_EQ(*matched, (std::vector<uint64_t>{2 * kBt, 3 * kBt}));
  }

  ASSERT_TRUE(WaitUntil([&] { return StatsOf(*client, "m").blocks_cached == 0; }))
      << "cached blocks outlived the TTL";
  EXPECT_GE(absl::Now() - freed_at, absl::Milliseconds(kTtlMs)) << "dropped before the TTL";
  Client::ModelStats st = StatsOf(*client, "m");
  EXPECT_EQ(st.blocks_used, 2u);
  EXPECT_EQ(st.blocks_free, st.blocks_total - 2);
  ExpectAccounting(st);
  matched = client->Match("m", {mk, md});
  ASSERT_TRUE(matched.ok()) << matched.status();
  // Blocks a live sequence references stay published, however old.
  EXPECT_EQ(*matched, (std::vector<uint64_t>{2 * kBt, 0}));
  args.prompt = dropped_prompt;
  auto again = client->CreateSequence("m", args);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->cached_tokens, 0u);
  ASSERT_TRUE(client->Free("m", again->id).ok());

  // Freed, the kept blocks age out too.
  ASSERT_TRUE(client->Free("m", kept->id).ok());
  EXPECT_EQ(StatsOf(*client, "m").blocks_cached, 2u);
  ASSERT_TRUE(WaitUntil([&] { return StatsOf(*client, "m").blocks_cached == 0; }));
  st = StatsOf(*client, "m");
  EXPECT_EQ(st.blocks_free, st.blocks_total);
  matched = client->Match("m", {mk});
  ASSERT_TRUE(matched.ok()) << matched.status();
  EXPECT_EQ(*matched, std::vector<uint64_t>{0});
}

TEST_F(CacheTest, DisabledPrefixCachingSharesNothing) {
  ASSERT_NO_FATAL_FAILURE(StartServer({"--models=", "--enable-prefix-caching=false"}));
  std::unique_ptr<Client> a = NewClient();
  std::unique_ptr<Client> b = NewClient();
  const ModelLayout layout = SmallLayout("m");
  ASSERT_TRUE(a->EnsureModel(layout, 2 * kMiB).ok());
  std::cerr << "[no-cache] seed 7501\n";
  Random rng(7501);
  const std::vector<uint32_t> prompt = Tokens(7502, 3 * kBt + 3);
  Client::CreateArgs args;
  args.prompt = prompt;
  auto first = a->CreateSequence("m", args);
  ASSERT_TRUE(first.ok()) << first.status();
  KvReference ref_a(layout), ref_b(layout);
  ASSERT_TRUE(AppendKv(*a, "m", first->id, ref_a, rng, prompt.size()).ok());
  auto second = b->CreateSequence("m", args);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->cached_tokens, 0u);
  EXPECT_EQ(second->length, 0u);
  ASSERT_TRUE(AppendKv(*b, "m", second->id, ref_b, rng, prompt.size()).ok());
  Client::ModelStats st = StatsOf(*b, "m");
  EXPECT_EQ(st.blocks_used, 8u);
  EXPECT_EQ(st.prefix_hit_tokens, 0u);

  Client::MatchQuery q;
  q.tokens = prompt;
  auto matched = b->Match("m", {q});
  ASSERT_TRUE(matched.ok()) << matched.status();
  EXPECT_EQ(*matched, std::vector<uint64_t>{0});
  auto root = b->GetPrefixRoot("m");
  ASSERT_TRUE(root.ok()) << root.status();
  const std::vector<BlockHash> hashes = PrefixHashes(root->algorithm, root->root, prompt, kBt);
  auto fetched = b->FetchBlocks("m", hashes);
  EXPECT_EQ(fetched.status().code(), absl::StatusCode::kNotFound) << fetched.status();
  auto pinned = b->Pin("m", q);
  ASSERT_TRUE(pinned.ok()) << pinned.status();
  EXPECT_EQ(*pinned, 0u);

  ASSERT_TRUE(a->Free("m", first->id).ok());
  ASSERT_TRUE(b->Free("m", second->id).ok());
  st = StatsOf(*b, "m");
  EXPECT_EQ(st.blocks_cached, 0u);
  EXPECT_EQ(st.blocks_free, st.blocks_total);
  // No block was published, so there is no event either.
  Watched w = WatchUntil(*b, "m", 0, false, [](const Watched&) { return true; });
  EXPECT_TRUE(w.status.ok()) << w.status;
  EXPECT_TRUE(w.events.empty());
  EXPECT_EQ(w.last, 0u);
}

// ---------------------------------------------------------------------------------------------
// 3. Tenants: nothing of one tenant's state is reachable, or even visible, to another.

class TenantTest : public KvbankdTest {
 protected:
  void SetUp() override {
    char path[] = "/tmp/kvbank-tokens-XXXXXX";
    const int fd = mkstemp(path);
    ASSERT_GE(fd, 0);
    close(fd);
    tokens_file_ = path;
    std::ofstream(tokens_file_) << "# integ_prefix_test tokens\n"
                                << "token-of-a a\n"
                                << "token-of-b b\n"
                                << "token-of-q q max_blocks_fraction=0.25\n"
                                << "token-of-ops ops admin\n";
  }
  void TearDown() override {
    KvbankdTest::TearDown();
    std::remove(tokens_file_.c_str());
  }
  std::unique_ptr<Client> As(const std::string& token) {
    ClientOptions o;
    o.bearer_token = token;
    return NewClient(o);
  }
  std::string tokens_file_;
};

TEST_F(TenantTest, NoTokenOrAWrongOneIsUnauthenticated) {
  ASSERT_NO_FATAL_FAILURE(StartServer({"--models=", "--auth-tokens-file=" + tokens_file_}));
  std::unique_ptr<Client> admin = As("token-of-ops");
  ASSERT_TRUE(admin->EnsureModel(SmallLayout("m"), 2 * kMiB).ok());
  for (const std::string& token :
       {std::string(), std::string("token-of-nobody"), std::string("token-of-A")}) {
    SCOPED_TRACE("token '" + token + "'");
    std::unique_ptr<Client> c = As(token);
    EXPECT_EQ(c->GetStats().status().code(), absl::StatusCode::kUnauthenticated);
    EXPECT_EQ(c->ListModels().status().code(), absl::StatusCode::kUnauthenticated);
    EXPECT_EQ(c->EnsureModel(SmallLayout("x"), 2 * kMiB).status().code(),
              absl::StatusCode::kUnauthenticated);
    EXPECT_EQ(c->CreateSequence("m").status().code(), absl::StatusCode::kUnauthenticated);
    Client::AppendArgs args;
    args.num_tokens = 1;
    EXPECT_EQ(c->Append("m", 1, args, std::vector<uint8_t>(256)).status().code(),
              absl::StatusCode::kUnauthenticated);
    EXPECT_EQ(c->Fetch("m", 1, {}).status().code(), absl::StatusCode::kUnauthenticated);
    Client::MatchQuery q;
    q.tokens = Tokens(1, kBt);
    EXPECT_EQ(c->Match("m", {q}).status().code(), absl::StatusCode::kUnauthenticated);
    EXPECT_EQ(c->GetPrefixRoot("m").status().code(), absl::StatusCode::kUnauthenticated);
    Watched w = WatchUntil(*c, "m", 0, false, [](const Watched&) { return true; });
    EXPECT_EQ(w.status.code(), absl::StatusCode::kUnauthenticated) << w.status;
  }
  auto models = admin->ListModels();
  ASSERT_TRUE(models.ok()) << models.status();
  EXPECT_EQ(models->size(), 1u) << "no unauthenticated call registered a model";
}

TEST_F(TenantTest, AnotherTenantsStateIsUnreachableAndInvisible) {
  ASSERT_NO_FATAL_FAILURE(StartServer({"--models=", "--auth-tokens-file=" + tokens_file_}));
  std::unique_ptr<Client> a = As("token-of-a");
  std::unique_ptr<Client> b = As("token-of-b");
  std::unique_ptr<Client> admin = As("token-of-ops");
  const ModelLayout layout = SmallLayout("m");
  auto model = admin->EnsureModel(layout, 64 * BlockBytes(layout));
  ASSERT_TRUE(model.ok()) << model.status();
  ASSERT_EQ(model->num_blocks, 64u);
  const uint32_t L = layout.num_layers;
  std::cerr << "[tenant] seed 7601\n";
  Random rng(7601);

  // Roots differ by tenant.
  auto root_a = a->GetPrefixRoot("m");
  auto root_b = b->GetPrefixRoot("m");
  ASSERT_TRUE(root_a.ok() && root_b.ok());
  EXPECT_EQ(root_a->tenant, "a");
  EXPECT_EQ(root_b->tenant, "b");
  EXPECT_NE(root_a->root, root_b->root);
  EXPECT_EQ(root_a->root,
            RootHash(root_a->algorithm, PrefixRoot{LayoutFingerprint(layout), "a", ""}));

  // a prefills a prompt of 3 full blocks and 4 tokens.
  const std::vector<uint32_t> prompt = Tokens(7602, 3 * kBt + 4);
  Client::CreateArgs args;
  args.prompt = prompt;
  auto seq_a = a->CreateSequence("m", args);
  ASSERT_TRUE(seq_a.ok()) << seq_a.status();
  KvReference ref_a(layout);
  ASSERT_TRUE(AppendKv(*a, "m", seq_a->id, ref_a, rng, prompt.size()).ok());
  const uint64_t id = seq_a->id;
  ASSERT_NE(id, kNeverId);
  const std::vector<BlockHash> hashes_a =
      PrefixHashes(root_a->algorithm, root_a->root, prompt, kBt);

  // Every call b makes on a's sequence answers exactly as for an id that never existed.
  struct Attempt {
    const char* what;
    std::function<absl::Status(uint64_t)> call;
  };
  const std::vector<Attempt> attempts = {
      {"GetSequence", [&](uint64_t s) { return b->GetSequence("m", s).status(); }},
      {"Fork", [&](uint64_t s) { return b->Fork("m", s).status(); }},
      {"Truncate", [&](uint64_t s) { return b->Truncate("m", s, 0).status(); }},
      {"RenewLease", [&](uint64_t s) { return b->RenewLease("m", s).status(); }},
      {"Append",
       [&](uint64_t s) {
         Client::AppendArgs ap;
         ap.num_tokens = 1;
         const std::vector<uint8_t> payload(model->payload_bytes_per_token, 0x5A);
         return b->Append("m", s, ap, payload).status();
       }},
      {"Fetch", [&](uint64_t s) { return b->Fetch("m", s, {}).status(); }},
      {"Fetch range",
       [&](uint64_t s) {
         Client::FetchArgs range;
         range.token_end = 1;
         return b->Fetch("m", s, range).status();
       }},
      {"Free", [&](uint64_t s) { return b->Free("m", s).status(); }},
  };
  auto expect_unreachable = [&](const char* when) {
    for (const Attempt& t : attempts) {
      SCOPED_TRACE(absl::StrCat(t.what, " by b ", when));
      const absl::Status on_a = t.call(id);
      const absl::Status never = t.call(kNeverId);
      EXPECT_EQ(on_a.code(), absl::StatusCode::kNotFound) << on_a;
      EXPECT_EQ(never.code(), absl::StatusCode::kNotFound) << never;
      EXPECT_EQ(WithoutId(on_a, id), WithoutId(never, kNeverId));
    }
  };
  expect_unreachable("while a's sequence lives");
  // ... and changed nothing.
  auto still = a->GetSequence("m", id);
  ASSERT_TRUE(still.ok()) << still.status();
  EXPECT_EQ(still->length, prompt.size());
  auto bytes_a = a->Fetch("m", id, {});
  ASSERT_TRUE(bytes_a.ok()) << bytes_a.status();
  EXPECT_TRUE(BytesEqual(bytes_a->payload, ref_a.Payload(0, L, 0, prompt.size())));

  // a's prefix: b matches none of it, by tokens or by a's own hashes; cannot fetch or pin it.
  // `b_own`: the blocks b published itself for the same prompt (under its own root), which b's
  // token-id queries find instead.
  auto expect_prefix_hidden = [&](const char* when, uint64_t b_own) {
    SCOPED_TRACE(when);
    std::vector<Client::MatchQuery> queries(3);
    queries[0].tokens = prompt;
    queries[1].hashes = hashes_a;
    queries[2].hashes = {hashes_a[0]};
    auto matched = b->Match("m", queries);
    ASSERT_TRUE(matched.ok()) << matched.status();
    EXPECT_EQ(*matched, (std::vector<uint64_t>{b_own * kBt, 0, 0}));
    auto fetched = b->FetchBlocks("m", hashes_a);
    const BlockHash unknown =
        PrefixHashes(root_a->algorithm, root_a->root, Tokens(7603, kBt), kBt)[0];
    auto fetched_unknown = b->FetchBlocks("m", {unknown});
    EXPECT_EQ(fetched.status().code(), absl::StatusCode::kNotFound) << fetched.status();
    EXPECT_EQ(fetched.status(), fetched_unknown.status());
    Client::MatchQuery by_hash, by_tokens;
    by_hash.hashes = hashes_a;
    by_tokens.tokens = prompt;
    for (bool pin : {true, false}) {
      auto n = b->Pin("m", by_hash, pin);
      ASSERT_TRUE(n.ok()) << n.status();
      EXPECT_EQ(*n, 0u);
      n = b->Pin("m", by_tokens, pin);
      ASSERT_TRUE(n.ok()) << n.status();
      EXPECT_EQ(*n, b_own);
    }
    EXPECT_EQ(StatsOf(*admin, "m").blocks_pinned, 0u);
  };
  expect_prefix_hidden("while a's sequence lives", 0);

  // b's own sequence with the same prompt attaches nothing of a's and takes its own blocks.
  const uint64_t used_before_b = StatsOf(*admin, "m").blocks_used;
  auto seq_b = b->CreateSequence("m", args);
  ASSERT_TRUE(seq_b.ok()) << seq_b.status();
  EXPECT_EQ(seq_b->cached_tokens, 0u);
  EXPECT_EQ(seq_b->length, 0u);
  KvReference ref_b(layout);
  ASSERT_TRUE(AppendKv(*b, "m", seq_b->id, ref_b, rng, prompt.size()).ok());
  EXPECT_EQ(StatsOf(*admin, "m").blocks_used, used_before_b + 4);
  const std::vector<BlockHash> hashes_b =
      PrefixHashes(root_b->algorithm, root_b->root, prompt, kBt);
  auto own = b->FetchBlocks("m", hashes_b);
  ASSERT_TRUE(own.ok()) << own.status();
  EXPECT_TRUE(BytesEqual(own->payload, ref_b.Payload(0, L, 0, 3 * kBt)));
  bytes_a = a->Fetch("m", id, {});
  ASSERT_TRUE(bytes_a.ok()) << bytes_a.status();
  EXPECT_TRUE(BytesEqual(bytes_a->payload, ref_a.Payload(0, L, 0, prompt.size())));
  // a, in turn, does not see b's.
  Client::MatchQuery b_blocks;
  b_blocks.hashes = hashes_b;
  auto a_sees = a->Match("m", {b_blocks});
  ASSERT_TRUE(a_sees.ok()) << a_sees.status();
  EXPECT_EQ(*a_sees, std::vector<uint64_t>{0});

  // Stats: each tenant gets its own row only; the admin gets every row.
  auto rows_of = [&](Client& c) {
    std::set<std::string> rows;
    for (const auto& t : StatsOf(c, "m").tenants) rows.insert(t.tenant);
    return rows;
  };
  EXPECT_EQ(rows_of(*a), std::set<std::string>{"a"});
  EXPECT_EQ(rows_of(*b), std::set<std::string>{"b"});
  const std::set<std::string> all = rows_of(*admin);
  EXPECT_TRUE(all.count("a") && all.count("b")) << all.size() << " rows";
  const Client::ModelStats st_b = StatsOf(*b, "m");
  ASSERT_NE(TenantRow(st_b, "b"), nullptr);
  EXPECT_EQ(TenantRow(st_b, "b")->sequences, 1u);
  EXPECT_EQ(TenantRow(st_b, "b")->prefix_query_tokens, prompt.size());
  EXPECT_EQ(TenantRow(st_b, "b")->prefix_hit_tokens, 0u);
  EXPECT_EQ(TenantRow(st_b, "b")->blocks_referenced, 4u);

  // Events: the admin sees both tenants' BlockStored with their names; b sees only its own.
  Watched all_events =
      WatchUntil(*admin, "m", 0, false, [](const Watched& w) { return w.events.size() >= 6; });
  ASSERT_TRUE(all_events.status.ok()) << all_events.status;
  ASSERT_EQ(all_events.events.size(), 6u);
  std::set<BlockHash> stored_a, stored_b;
  for (const Client::Event& e : all_events.events) {
    ASSERT_EQ(e.type, Client::Event::Type::kStored);
    ASSERT_EQ(e.hashes.size(), 1u);
    if (e.tenant == "a") stored_a.insert(e.hashes[0]);
    if (e.tenant == "b") stored_b.insert(e.hashes[0]);
  }
  EXPECT_EQ(stored_a, HashSet(hashes_a));
  EXPECT_EQ(stored_b, HashSet(hashes_b));
  const uint64_t end = all_events.last;
  Watched b_events = WatchUntil(*b, "m", 0, false, [&](const Watched& w) { return w.last >= end; });
  ASSERT_TRUE(b_events.status.ok()) << b_events.status;
  EXPECT_EQ(b_events.last, end);
  ASSERT_EQ(b_events.events.size(), 3u);
  for (const Client::Event& e : b_events.events) {
    EXPECT_EQ(e.tenant, "") << "tenant names are for admin watchers";
    ASSERT_EQ(e.hashes.size(), 1u);
    EXPECT_TRUE(HashSet(hashes_b).count(e.hashes[0]));
    EXPECT_FALSE(HashSet(hashes_a).count(e.hashes[0]));
  }

  // a frees its sequence: to b it still never existed (a itself is told it is gone), and its
  // now-cached blocks stay out of b's reach.
  ASSERT_TRUE(a->Free("m", id).ok());
  auto gone = a->GetSequence("m", id);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kFailedPrecondition) << gone.status();
  expect_unreachable("after a freed its sequence");
  expect_prefix_hidden("after a freed its sequence", 3);
  EXPECT_EQ(StatsOf(*admin, "m").blocks_cached, 3u);
  auto again = b->CreateSequence("m", args);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->cached_tokens, 3 * kBt) << "b's own blocks, not a's";
  // The prefix still serves a.
  auto a_again = a->CreateSequence("m", args);
  ASSERT_TRUE(a_again.ok()) << a_again.status();
  EXPECT_EQ(a_again->cached_tokens, 3 * kBt);
  Client::FetchArgs head;
  head.token_end = 3 * kBt;
  auto a_bytes = a->Fetch("m", a_again->id, head);
  ASSERT_TRUE(a_bytes.ok()) << a_bytes.status();
  EXPECT_TRUE(BytesEqual(a_bytes->payload, ref_a.Payload(0, L, 0, 3 * kBt)));
}

TEST_F(TenantTest, BlockQuotaBindsOnlyItsTenant) {
  ASSERT_NO_FATAL_FAILURE(StartServer({"--models=", "--auth-tokens-file=" + tokens_file_}));
  std::unique_ptr<Client> q = As("token-of-q");
  std::unique_ptr<Client> a = As("token-of-a");
  const ModelLayout layout = SmallLayout("m");
  auto model = a->EnsureModel(layout, 64 * BlockBytes(layout));
  ASSERT_TRUE(model.ok()) << model.status();
  ASSERT_EQ(model->num_blocks, 64u);  // q's quota: 0.25 of it, 16 blocks
  std::cerr << "[quota] seed 7701\n";
  Random rng(7701);

  auto seq_q = q->CreateSequence("m");
  ASSERT_TRUE(seq_q.ok()) << seq_q.status();
  KvReference ref_q(layout);
  ASSERT_TRUE(AppendKv(*q, "m", seq_q->id, ref_q, rng, 16 * kBt).ok());
  auto over = AppendKv(*q, "m", seq_q->id, ref_q, rng, 1);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted) << over.status();
  EXPECT_TRUE(absl::StrContains(over.status().message(), "quota")) << over.status();
  auto other = q->CreateSequence("m");
  ASSERT_TRUE(other.ok()) << other.status();
  KvReference ref_other(layout);
  auto over2 = AppendKv(*q, "m", other->id, ref_other, rng, 1);
  EXPECT_EQ(over2.status().code(), absl::StatusCode::kResourceExhausted) << over2.status();
  auto info = q->GetSequence("m", seq_q->id);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->length, 16 * kBt) << "a refused append changes nothing";

  // Another tenant allocates well past q's quota.
  auto seq_a = a->CreateSequence("m");
  ASSERT_TRUE(seq_a.ok()) << seq_a.status();
  KvReference ref_a(layout);
  auto big = AppendKv(*a, "m", seq_a->id, ref_a, rng, 40 * kBt);
  ASSERT_TRUE(big.ok()) << big.status();
  const Client::ModelStats st = StatsOf(*a, "m");
  EXPECT_EQ(st.blocks_used, 56u);
  ExpectAccounting(st);

  // Freeing gives q its room back.
  ASSERT_TRUE(q->Free("m", seq_q->id).ok());
  EXPECT_TRUE(AppendKv(*q, "m", other->id, ref_other, rng, 8 * kBt).ok());
}

// ---------------------------------------------------------------------------------------------
// 4. KV events through Watch.

class EventsTest : public KvbankdTest {};

TEST_F(EventsTest, StoredAndRemovedEventsArriveInOrderAndResume) {
  ASSERT_NO_FATAL_FAILURE(StartServer({"--models="}));
  std::unique_ptr<Client> writer = NewClient();
  std::unique_ptr<Client> watcher = NewClient();
  const ModelLayout layout = SmallLayout("m");
  ASSERT_TRUE(writer->EnsureModel(layout, 8 * BlockBytes(layout)).ok());  // 8 blocks
  std::cerr << "[events] seed 7801\n";
  Random rng(7801);
  auto root = watcher->GetPrefixRoot("m");
  ASSERT_TRUE(root.ok()) << root.status();

  // Nothing yet: the first batch is empty and says so.
  Watched empty = WatchUntil(*watcher, "m", 0, false, [](const Watched&) { return true; });
  ASSERT_TRUE(empty.status.ok()) << empty.status;
  EXPECT_TRUE(empty.events.empty());
  EXPECT_EQ(empty.last, 0u);

  const std::vector<uint32_t> tokens = Tokens(7802, 3 * kBt + 2);
  auto seq = writer->CreateSequence("m");
  ASSERT_TRUE(seq.ok()) << seq.status();
  KvReference ref(layout);
  ASSERT_TRUE(AppendKv(*writer, "m", seq->id, ref, rng, tokens.size(), tokens).ok());
  const std::vector<BlockHash> hashes = PrefixHashes(root->algorithm, root->root, tokens, kBt);

  Watched stored =
      WatchUntil(*watcher, "m", 0, false, [](const Watched& w) { return w.events.size() >= 3; });
  ASSERT_TRUE(stored.status.ok()) << stored.status;
  ASSERT_EQ(stored.events.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    SCOPED_TRACE(absl::StrCat("event ", i));
    const Client::Event& e = stored.events[i];
    EXPECT_EQ(e.sequence, i + 1);
    EXPECT_EQ(e.type, Client::Event::Type::kStored);
    EXPECT_EQ(e.hashes, std::vector<BlockHash>{hashes[i]});
    if (i == 0) {
      EXPECT_FALSE(e.parent.has_value()) << "the first block has no parent hash";
    } else {
      ASSERT_TRUE(e.parent.has_value());
      EXPECT_EQ(*e.parent, hashes[i - 1]);
    }
    EXPECT_EQ(e.token_ids, Slice(tokens, i * kBt, (i + 1) * kBt));
    EXPECT_EQ(e.block_size, kBt);
    EXPECT_EQ(e.lora, "");
  }
  EXPECT_EQ(stored.last, 3u);

  // Resuming after event 2 gives exactly event 3; resuming at the end gives nothing.
  Watched resumed = WatchUntil(*watcher, "m", stored.events[1].sequence, false,
                               [](const Watched& w) { return !w.events.empty(); });
  ASSERT_TRUE(resumed.status.ok()) << resumed.status;
  ASSERT_EQ(resumed.events.size(), 1u);
  EXPECT_EQ(resumed.events[0].sequence, 3u);
  EXPECT_EQ(resumed.events[0].hashes, std::vector<BlockHash>{hashes[2]});
  Watched quiet = WatchUntil(
      *watcher, "m", 3, false, [](const Watched& w) { return !w.events.empty(); },
      absl::Milliseconds(300));
  EXPECT_EQ(quiet.status.code(), absl::StatusCode::kDeadlineExceeded) << quiet.status;
  EXPECT_TRUE(quiet.events.empty());
  EXPECT_EQ(quiet.last, 3u);
  // A cursor past the end (from another log) is refused.
  Watched ahead = WatchUntil(*watcher, "m", 100, false, [](const Watched&) { return true; });
  EXPECT_EQ(ahead.status.code(), absl::StatusCode::kFailedPrecondition) << ahead.status;

  // A live watch from now: it sees the eviction, not the history.
  ASSERT_TRUE(writer->Free("m", seq->id).ok());
  EXPECT_EQ(StatsOf(*writer, "m").blocks_cached, 3u);
  std::atomic<bool> live{false};
  Watched from_now;
  std::thread live_watch([&] {
    from_now = WatchUntil(
        *watcher, "m", 0, /*from_now=*/true,
        [](const Watched& w) {
          return std::any_of(w.events.begin(), w.events.end(), [](const Client::Event& e) {
            return e.type == Client::Event::Type::kRemoved;
          });
        },
        absl::Seconds(20), &live);
  });
  ASSERT_TRUE(WaitUntil([&] { return live.load(); })) << "the watch never started";
  // 8 unpublished blocks: 5 free ones and the 3 cached ones, evicted.
  auto filler = writer->CreateSequence("m");
  ASSERT_TRUE(filler.ok()) << filler.status();
  KvReference ref_filler(layout);
  ASSERT_TRUE(AppendKv(*writer, "m", filler->id, ref_filler, rng, 8 * kBt).ok());
  live_watch.join();
  ASSERT_TRUE(from_now.status.ok()) << from_now.status;
  ASSERT_EQ(from_now.events.size(), 1u);
  const Client::Event& removed = from_now.events[0];
  EXPECT_EQ(removed.type, Client::Event::Type::kRemoved);
  EXPECT_EQ(removed.sequence, 4u);
  EXPECT_EQ(HashSet(removed.hashes), HashSet(hashes));
  EXPECT_EQ(removed.hashes.size(), 3u);
  EXPECT_EQ(StatsOf(*writer, "m").evictions, 3u);

  // The whole history, from the start, in order.
  Watched history =
      WatchUntil(*watcher, "m", 0, false, [](const Watched& w) { return w.events.size() >= 4; });
  ASSERT_TRUE(history.status.ok()) << history.status;
  ASSERT_EQ(history.events.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(history.events[i].sequence, i + 1);
  EXPECT_EQ(history.events[3].type, Client::Event::Type::kRemoved);
}

TEST_F(EventsTest, ResumePointOlderThanTheBufferIsFailedPrecondition) {
  // The log keeps kEventCapacity events and no flag changes that, so this fills it: one append of
  // one-token blocks publishes one block (one event) per token.
  ASSERT_NO_FATAL_FAILURE(StartServer({"--models="}));
  std::unique_ptr<Client> client = NewClient();
  ModelLayout tiny = SmallLayout("tiny");
  tiny.num_layers = 1;
  tiny.num_q_heads = 1;
  tiny.num_kv_heads = 1;
  tiny.head_dim = 1;
  tiny.head_dim_v = 1;
  tiny.block_tokens = 1;
  tiny.layer_dtypes = {DType::kFp16};
  const uint64_t n = kEventCapacity + 500;
  auto model = client->EnsureModel(tiny, n * BlockBytes(tiny));
  ASSERT_TRUE(model.ok()) << model.status();
  ASSERT_EQ(model->num_blocks, n);
  auto seq = client->CreateSequence("tiny");
  ASSERT_TRUE(seq.ok()) << seq.status();
  KvReference ref(tiny);
  Random rng(7901);
  std::cerr << "[events] " << n << " one-token blocks, seed 7901\n";
  std::vector<uint32_t> ids(n);
  for (uint64_t i = 0; i < n; ++i) ids[i] = static_cast<uint32_t>(i);
  const absl::Time t = absl::Now();
  ASSERT_TRUE(AppendKv(*client, "tiny", seq->id, ref, rng, n, ids).ok());
  std::cerr << "[events] appended in " << MsSince(t) << " ms\n";

  const uint64_t oldest = n - kEventCapacity + 1;  // the first event still kept
  for (uint64_t after : {uint64_t{0}, oldest - 2}) {
    Watched stale = WatchUntil(*client, "tiny", after, false, [](const Watched&) { return true; });
    EXPECT_EQ(stale.status.code(), absl::StatusCode::kFailedPrecondition)
        << "after " << after << ": " << stale.status;
    EXPECT_TRUE(absl::StrContains(stale.status.message(), "dropped")) << stale.status;
  }
  Watched first_kept = WatchUntil(*client, "tiny", oldest - 1, false,
                                  [](const Watched& w) { return !w.events.empty(); });
  ASSERT_TRUE(first_kept.status.ok()) << first_kept.status;
  EXPECT_EQ(first_kept.events[0].sequence, oldest);
  Watched tail =
      WatchUntil(*client, "tiny", n - 10, false, [&](const Watched& w) { return w.last >= n; });
  ASSERT_TRUE(tail.status.ok()) << tail.status;
  ASSERT_EQ(tail.events.size(), 10u);
  for (uint64_t i = 0; i < 10; ++i) {
    EXPECT_EQ(tail.events[i].sequence, n - 9 + i);
    EXPECT_EQ(tail.events[i].token_ids, std::vector<uint32_t>{static_cast<uint32_t>(n - 10 + i)});
  }
}

// ---------------------------------------------------------------------------------------------
// 5. A client that goes away: its lease runs out and its blocks return (full ones to the cache).

class AbandonTest : public KvbankdTest {};

TEST_F(AbandonTest, AbandonedSequenceReleasesItsBlocksToTheCache) {
  ASSERT_NO_FATAL_FAILURE(StartServer({"--models=", "--lease-check-ms=20"}));
  std::unique_ptr<Client> observer = NewClient();
  const ModelLayout layout = SmallLayout("m");
  ASSERT_TRUE(observer->EnsureModel(layout, 2 * kMiB).ok());
  const uint32_t L = layout.num_layers;
  std::cerr << "[abandon] seed 8001\n";
  Random rng(8001);
  const std::vector<uint32_t> prompt = Tokens(8002, 3 * kBt + 5);
  KvReference ref(layout);
  const Client::ModelStats start = StatsOf(*observer, "m");
  {
    std::unique_ptr<Client> worker = NewClient();
    Client::CreateArgs args;
    args.prompt = prompt;
    args.lease = absl::Seconds(1);
    auto seq = worker->CreateSequence("m", args);
    ASSERT_TRUE(seq.ok()) << seq.status();
    EXPECT_EQ(seq->lease_ttl, absl::Seconds(1));
    ASSERT_TRUE(AppendKv(*worker, "m", seq->id, ref, rng, prompt.size()).ok());
    EXPECT_EQ(StatsOf(*observer, "m").blocks_used, 4u);
  }  // the worker goes away without freeing

  ASSERT_TRUE(WaitUntil([&] { return StatsOf(*observer, "m").sequences == 0; }))
      << "the abandoned sequence outlived its lease";
  const Client::ModelStats st = StatsOf(*observer, "m");
  EXPECT_EQ(st.blocks_used, start.blocks_used);
  EXPECT_EQ(st.blocks_cached, 3u);
  EXPECT_EQ(st.blocks_free, st.blocks_total - 3);
  EXPECT_EQ(st.leases_expired, 1u);
  ExpectAccounting(st);

  // The full blocks serve the next worker with the same prompt.
  std::unique_ptr<Client> next = NewClient();
  Client::CreateArgs args;
  args.prompt = prompt;
  auto seq = next->CreateSequence("m", args);
  ASSERT_TRUE(seq.ok()) << seq.status();
  EXPECT_EQ(seq->cached_tokens, 3 * kBt);
  auto got = next->Fetch("m", seq->id, {});
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(BytesEqual(got->payload, ref.Payload(0, L, 0, 3 * kBt)));
  ASSERT_TRUE(next->Free("m", seq->id).ok());
}

}  // namespace
}  // namespace kvbank::integ
