// Prefix sharing against the real kvbankd through the real client on loopback: sharing across
// connections, Match / FetchBlocks / Pin with block hashes the SDK computes, eviction only under
// allocation pressure, the cache TTL. (Tenancy, events, abandonment: integ_tenancy_test.cc.)
#include "tests/integration/prefix_support.h"

namespace kvbank::integ {
namespace {

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

}  // namespace
}  // namespace kvbank::integ
