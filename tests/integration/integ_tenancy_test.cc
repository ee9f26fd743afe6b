// Tenant isolation over bearer tokens, KV events through Watch, and abandoned sequences giving
// their blocks back, against the real kvbankd through the real client on loopback.
#include "tests/integration/prefix_support.h"

namespace kvbank::integ {
namespace {

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

// Pools are prefaulted memory out of a server-wide budget and model names are global: only an
// admin adds or drops a model. Any tenant may ensure one that is there with the same layout.
TEST_F(TenantTest, RegisteringAndDroppingModelsIsForAdmins) {
  const ModelLayout layout = SmallLayout("m");
  const uint64_t pool = 64 * BlockBytes(layout);
  // The server's budget holds exactly one such pool: registering anew needs the dropped one back.
  ASSERT_NO_FATAL_FAILURE(StartServer({"--models=", "--auth-tokens-file=" + tokens_file_,
                                       "--max-pool-bytes=" + std::to_string(pool)}));
  std::unique_ptr<Client> a = As("token-of-a");
  std::unique_ptr<Client> admin = As("token-of-ops");
  auto squat = a->EnsureModel(layout, pool);
  EXPECT_EQ(squat.status().code(), absl::StatusCode::kPermissionDenied) << squat.status();
  EXPECT_TRUE(absl::StrContains(squat.status().message(), "admin")) << squat.status();
  auto listed = admin->ListModels();
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_TRUE(listed->empty()) << "a refused registration registers nothing";

  ASSERT_TRUE(admin->EnsureModel(layout, pool).ok());
  auto same = a->EnsureModel(layout, pool);
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_FALSE(same->created);
  ModelLayout other = layout;
  other.head_dim = other.head_dim_v = 32;
  EXPECT_EQ(a->EnsureModel(other).status().code(), absl::StatusCode::kAlreadyExists);

  auto seq = a->CreateSequence("m");
  ASSERT_TRUE(seq.ok()) << seq.status();
  EXPECT_EQ(a->DropModel("m").code(), absl::StatusCode::kPermissionDenied);
  ASSERT_TRUE(a->GetSequence("m", seq->id).ok()) << "a refused drop changes nothing";

  // A watch on the model holds it (and its pool): the drop ends the watch.
  std::atomic<bool> live{false};
  Watched watched;
  std::thread watch([&] {
    watched = WatchUntil(
        *admin, "m", 0, /*from_now=*/true, [](const Watched&) { return false; }, absl::Seconds(30),
        &live);
  });
  ASSERT_TRUE(WaitUntil([&] { return live.load(); })) << "the watch never started";
  const absl::Status dropped = admin->DropModel("m");
  watch.join();
  ASSERT_TRUE(dropped.ok()) << dropped;
  EXPECT_EQ(watched.status.code(), absl::StatusCode::kNotFound) << watched.status;
  EXPECT_EQ(a->GetSequence("m", seq->id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(admin->DropModel("m").code(), absl::StatusCode::kNotFound);
  listed = admin->ListModels();
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_TRUE(listed->empty());
  // The dropped pool's budget comes back once nothing holds the model.
  absl::StatusOr<Client::ModelInfo> again = absl::UnknownError("not tried");
  ASSERT_TRUE(WaitUntil([&] {
    again = admin->EnsureModel(layout, pool);
    return again.ok();
  })) << again.status();
  EXPECT_TRUE(again->created);
}

TEST_F(TenantTest, BlockQuotaBindsOnlyItsTenant) {
  ASSERT_NO_FATAL_FAILURE(StartServer({"--models=", "--auth-tokens-file=" + tokens_file_}));
  std::unique_ptr<Client> q = As("token-of-q");
  std::unique_ptr<Client> a = As("token-of-a");
  const ModelLayout layout = SmallLayout("m");
  ASSERT_TRUE(As("token-of-ops")->EnsureModel(layout, 64 * BlockBytes(layout)).ok());
  auto model = a->EnsureModel(layout, 64 * BlockBytes(layout));  // there already: any tenant
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
  const Client::ModelStats st = StatsOf(*As("token-of-ops"), "m");  // the admin's view: all
  EXPECT_EQ(st.blocks_used, 56u);
  ExpectAccounting(st);
  EXPECT_EQ(StatsOf(*a, "m").blocks_used, 40u) << "a tenant sees its own blocks only";

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
