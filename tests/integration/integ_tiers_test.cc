// The tiers below the pool through kvbankd: a warm restart (SIGTERM writes the pool's cached
// blocks to the disk tier, the next start serves them), and kill -9 at random moments while
// blocks spill to the disk: after every restart each block served is checked against the KV
// its hash chain names.
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "kvbank/client.h"
#include "kvbank/prefix_hash.h"
#include "tests/integration/prefix_support.h"
#include "tests/integration/server_fixture.h"
#include "tests/metrics_http.h"

namespace kvbank::integ {
namespace {

uint64_t Mix(uint64_t x) {  // splitmix64
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The KV of a prompt's full blocks, each block's rows made from its hash (and `salt`) alone:
// whatever block the server serves under a hash must hold exactly these bytes.
std::vector<uint8_t> PayloadOf(const ModelLayout& m, const std::vector<BlockHash>& hashes,
                               uint64_t salt = 0) {
  const BlockLayout bl = ComputeBlockLayout(m);
  const uint64_t n = hashes.size() * uint64_t{m.block_tokens};
  const PayloadLayout p = PayloadLayout::Make(bl, 0, m.num_layers, n);
  std::vector<uint8_t> out(p.total_bytes);
  for (uint32_t l = 0; l < m.num_layers; ++l) {
    const LayerView& v = bl.layers[l];
    for (uint64_t t = 0; t < n; ++t) {
      uint64_t seed;
      std::memcpy(&seed, hashes[t / m.block_tokens].data(), sizeof(seed));
      seed ^= salt;
      uint64_t x = Mix(seed ^ (t % m.block_tokens) ^ (uint64_t{l} << 40));
      for (uint32_t part = 0; part < 2; ++part) {
        const uint64_t row = part == 0 ? v.KRowBytes() : v.VRowBytes();
        const uint64_t base =
            p.layer_offset[l] + part * uint64_t{v.num_kv_heads} * n * v.KRowBytes();
        for (uint32_t h = 0; h < v.num_kv_heads; ++h) {
          uint8_t* dst = out.data() + base + (uint64_t{h} * n + t) * row;
          for (uint64_t b = 0; b < row; ++b) dst[b] = static_cast<uint8_t>(x = Mix(x));
        }
      }
    }
  }
  return out;
}

std::string TempDir() {
  std::string tmpl =
      (std::filesystem::temp_directory_path() / "kvbank-integ-tiers-XXXXXX").string();
  EXPECT_NE(mkdtemp(tmpl.data()), nullptr);
  return tmpl;
}

class TiersIntegTest : public KvbankdTest {
 protected:
  void TearDown() override {
    KvbankdTest::TearDown();
    std::filesystem::remove_all(dir_);
  }

  std::vector<std::string> Flags(const std::string& pool, const std::string& disk) const {
    return {"--models=", "--pool-bytes=" + pool, "--disk-tier-path=" + dir_,
            "--disk-tier-bytes=" + disk, "--drain-timeout-ms=20000"};
  }

  // Writes a prompt of `blocks` full blocks (KV from PayloadOf) and frees it: its blocks stay
  // cached. Answers the prompt's hashes.
  static absl::StatusOr<std::vector<BlockHash>> WritePrompt(Client& c, const ModelLayout& m,
                                                            const BlockHash& root,
                                                            const std::vector<uint32_t>& prompt,
                                                            uint64_t salt = 0) {
    const std::vector<BlockHash> hashes =
        PrefixHashes(HashAlgorithm::kSha256, root, prompt, m.block_tokens);
    auto seq = c.CreateSequence(m.name);
    if (!seq.ok()) return seq.status();
    Client::AppendArgs a;
    a.num_tokens = prompt.size();
    a.token_ids = prompt;
    auto appended = c.Append(m.name, seq->id, a, PayloadOf(m, hashes, salt));
    if (!appended.ok()) return appended.status();
    auto freed = c.Free(m.name, seq->id);
    if (!freed.ok()) return freed.status();
    return hashes;
  }

  // Zeroes the second half of slot (seed % capacity) of the disk tier's file.
  void TearSlot(uint64_t seed, uint64_t capacity) {
    for (const auto& e : std::filesystem::directory_iterator(dir_)) {
      const std::string path = e.path().string();
      if (path.size() < 12 || path.substr(path.size() - 12) != ".kvbank-tier") continue;
      const uint64_t slot_bytes = std::filesystem::file_size(e.path()) / capacity;
      const uint64_t slot = seed % capacity;
      const int fd = open(path.c_str(), O_WRONLY);
      ASSERT_GE(fd, 0) << path;
      std::vector<uint8_t> zeros(slot_bytes / 2, 0);
      ASSERT_EQ(pwrite(fd, zeros.data(), zeros.size(), off_t(slot * slot_bytes + slot_bytes / 2)),
                ssize_t(zeros.size()));
      close(fd);
      ++torn_;
    }
  }

  std::string dir_ = TempDir();
  int torn_ = 0;
};

TEST_F(TiersIntegTest, WarmRestartServesTheCacheFromDisk) {
  const ModelLayout m = SmallLayout("m");
  constexpr int kPrompts = 20;
  std::vector<std::vector<uint32_t>> prompts;
  for (int i = 0; i < kPrompts; ++i) prompts.push_back(Tokens(100 + i, 4 * kBt));
  std::vector<std::vector<BlockHash>> hashes;
  {
    ASSERT_NO_FATAL_FAILURE(StartServer(Flags("4MiB", "16MiB")));
    auto c = NewClient();
    ASSERT_TRUE(c->EnsureModel(m).ok());
    auto root = c->GetPrefixRoot("m");
    ASSERT_TRUE(root.ok()) << root.status();
    for (const auto& p : prompts) {
      auto h = WritePrompt(*c, m, root->root, p);
      ASSERT_TRUE(h.ok()) << h.status();
      hashes.push_back(*h);
    }
    Client::MatchQuery q;
    q.tokens = prompts[0];
    auto before = c->MatchTiers("m", {q});
    ASSERT_TRUE(before.ok()) << before.status();
    EXPECT_EQ((*before)[0].pool_tokens, 4 * kBt) << "the pool holds every prompt before";
    // SIGTERM: drain, then the pool's cached blocks go to the disk tier.
    ASSERT_TRUE(server_->Stop().ok()) << server_->Log();
    EXPECT_NE(server_->Log().find("80 cached block(s) written to the disk tier"), std::string::npos)
        << server_->Log();
    server_.reset();
  }
  std::vector<std::string> flags = Flags("4MiB", "16MiB");
  flags.push_back("--metrics-listen=127.0.0.1:0");
  flags.push_back("--metrics-port-file=" + dir_ + "/metrics_port");
  ASSERT_NO_FATAL_FAILURE(StartServer(flags));
  int metrics_port = 0;
  std::ifstream(dir_ + "/metrics_port") >> metrics_port;  // written before the gRPC port file
  ASSERT_GT(metrics_port, 0);
  auto c = NewClient();
  ASSERT_TRUE(c->EnsureModel(m).ok());
  const std::string scraped = testing_http::Body(testing_http::Request(metrics_port, "/metrics"));
  EXPECT_NE(scraped.find("kvbank_tier_blocks{model=\"m\",medium=\"disk\"} 80\n"), std::string::npos)
      << scraped;
  Client::ModelStats st = StatsOf(*c, "m");
  ASSERT_TRUE(st.tiers.has_value());
  EXPECT_EQ(st.tiers->loaded, uint64_t{4 * kPrompts});
  EXPECT_EQ(st.tiers->load_invalid, 0u);
  EXPECT_EQ(st.blocks_cached, 0u) << "a fresh pool";
  // The first prompt: a Match that prefetches, then (once the blocks are in the pool) a create
  // that finds them there.
  {
    Client::MatchQuery q;
    q.tokens = prompts[0];
    auto r = c->MatchTiers("m", {q}, /*prefetch=*/true);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ((*r)[0].disk_tokens, 4 * kBt) << "the answer is as without prefetch";
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    std::vector<Client::MatchTiersResult> now;
    do {
      auto m2 = c->MatchTiers("m", {q});
      ASSERT_TRUE(m2.ok()) << m2.status();
      now = *m2;
      if (now[0].pool_tokens < 4 * kBt) absl::SleepFor(absl::Milliseconds(2));
    } while (now[0].pool_tokens < 4 * kBt && absl::Now() < deadline);
    EXPECT_EQ(now[0].pool_tokens, 4 * kBt) << "the prefetch brought nothing into the pool";
    EXPECT_EQ(StatsOf(*c, "m").tiers->promoted_from_disk, 4u);
  }
  for (int i = 0; i < kPrompts; ++i) {
    Client::MatchQuery q;
    q.tokens = prompts[i];
    auto r = c->MatchTiers("m", {q});
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(i == 0 ? (*r)[0].pool_tokens : (*r)[0].disk_tokens, 4 * kBt) << "prompt " << i;
    Client::CreateArgs args;
    args.prompt = prompts[i];
    auto seq = c->CreateSequence("m", args);
    ASSERT_TRUE(seq.ok()) << seq.status();
    EXPECT_EQ(seq->cached_tokens, 4 * kBt) << "prompt " << i;
    auto data = c->Fetch("m", seq->id, {});
    ASSERT_TRUE(data.ok()) << data.status();
    EXPECT_TRUE(BytesEqual(data->payload, PayloadOf(m, hashes[i]))) << "prompt " << i;
    ASSERT_TRUE(c->Free("m", seq->id).ok());
  }
  st = StatsOf(*c, "m");
  EXPECT_EQ(st.tiers->promoted_from_disk, uint64_t{4 * kPrompts});
  const std::string after = testing_http::Body(testing_http::Request(metrics_port, "/metrics"));
  EXPECT_NE(after.find("kvbank_tier_promoted_total{model=\"m\",medium=\"disk\"} 80\n"),
            std::string::npos)
      << after;
  EXPECT_EQ(st.tiers->corrupt, 0u);
}

// Two models whose names differ only where a file name cannot (llama-3.1-8b and llama-3_1-8b),
// with one layout (so one root and the same block hashes for one prompt): each keeps its own disk
// tier file and is only ever served its own bytes, live and after a restart, whichever model is
// registered first.
TEST_F(TiersIntegTest, ModelsNamedAlikeNeverServeEachOthersBlocks) {
  const ModelLayout dot = SmallLayout("m.a"), under = SmallLayout("m_a");
  const std::vector<uint32_t> prompt = Tokens(7, 4 * kBt);
  constexpr uint64_t kDotSalt = 0x0d07, kUnderSalt = 0x5f5f;
  // Each model's view: its own prompt's blocks, wherever they are, hold its own bytes (or are a
  // miss); never the other model's.
  auto check = [&](Client& c, const ModelLayout& m, uint64_t salt, const std::string& when) {
    auto root = c.GetPrefixRoot(m.name);
    ASSERT_TRUE(root.ok()) << root.status();
    const std::vector<BlockHash> hashes =
        PrefixHashes(HashAlgorithm::kSha256, root->root, prompt, m.block_tokens);
    auto got = c.FetchBlocks(m.name, hashes);
    ASSERT_TRUE(got.ok()) << when << ", " << m.name << ": " << got.status();
    ASSERT_EQ(got->num_tokens, 4 * kBt) << when << ", " << m.name << ": a block went missing";
    EXPECT_TRUE(BytesEqual(got->payload, PayloadOf(m, hashes, salt)))
        << when << ", " << m.name << ": served bytes that are not its own";
  };
  ASSERT_NO_FATAL_FAILURE(StartServer(Flags("256KiB", "4MiB")));  // 64 blocks a pool
  {
    auto c = NewClient();
    ASSERT_TRUE(c->EnsureModel(under).ok());
    ASSERT_TRUE(c->EnsureModel(dot).ok());
    auto root = c->GetPrefixRoot("m_a");
    ASSERT_TRUE(root.ok()) << root.status();
    auto dot_root = c->GetPrefixRoot("m.a");
    ASSERT_TRUE(dot_root.ok()) << dot_root.status();
    ASSERT_EQ(root->root, dot_root->root) << "one layout, one tenant: the same hashes";
    ASSERT_TRUE(WritePrompt(*c, under, root->root, prompt, kUnderSalt).ok());
    ASSERT_TRUE(WritePrompt(*c, dot, root->root, prompt, kDotSalt).ok());
    // 30 more prompts of 4 blocks in each pool of 64 evict the first one to the disk tiers.
    for (int i = 0; i < 30; ++i) {
      ASSERT_TRUE(WritePrompt(*c, under, root->root, Tokens(1000 + i, 4 * kBt), kUnderSalt).ok());
      ASSERT_TRUE(WritePrompt(*c, dot, root->root, Tokens(2000 + i, 4 * kBt), kDotSalt).ok());
    }
    for (const ModelLayout* m : {&under, &dot}) {
      Client::MatchQuery q;
      q.tokens = prompt;
      auto where = c->MatchTiers(m->name, {q});
      ASSERT_TRUE(where.ok()) << where.status();
      EXPECT_EQ((*where)[0].disk_tokens, 4 * kBt) << m->name << ": the prompt is on its disk tier";
    }
    ASSERT_NO_FATAL_FAILURE(check(*c, under, kUnderSalt, "live"));
    ASSERT_NO_FATAL_FAILURE(check(*c, dot, kDotSalt, "live"));
  }
  std::vector<std::string> files;
  for (const auto& e : std::filesystem::directory_iterator(dir_)) {
    if (e.path().extension() == ".kvbank-tier") files.push_back(e.path().filename().string());
  }
  EXPECT_EQ(files.size(), 2u) << "one disk tier file a model";
  // Restarts: SIGTERM writes the pools down; the next server registers the models in either order.
  for (bool dot_first : {true, false}) {
    ASSERT_TRUE(server_->Stop().ok()) << server_->Log();
    server_.reset();
    ASSERT_NO_FATAL_FAILURE(StartServer(Flags("256KiB", "4MiB")));
    auto c = NewClient();
    for (const ModelLayout* m : dot_first ? std::vector{&dot, &under} : std::vector{&under, &dot}) {
      ASSERT_TRUE(c->EnsureModel(*m).ok());
    }
    const std::string when = dot_first ? "restarted, m.a first" : "restarted, m_a first";
    ASSERT_NO_FATAL_FAILURE(check(*c, under, kUnderSalt, when));
    ASSERT_NO_FATAL_FAILURE(check(*c, dot, kDotSalt, when));
  }
}

// The disk tier's folder is one server's: a second kvbankd on it is refused at start, naming the
// first; a folder others may write, and a tier file that is a symbolic link, are refused too.
TEST_F(TiersIntegTest, FolderIsOneServersOwn) {
  ASSERT_NO_FATAL_FAILURE(StartServer(Flags("256KiB", "4MiB")));
  auto second = ServerProcess::Start(Flags("256KiB", "4MiB"));
  ASSERT_FALSE(second.ok()) << "a second kvbankd started on a folder in use";
  EXPECT_NE(second.status().ToString().find("in use by another kvbankd (pid " +
                                            std::to_string(server_->pid()) + ")"),
            std::string::npos)
      << second.status();
  // A tier file planted as a link (to a file the test owns) is not followed: the model is refused
  // and the link's target is untouched.
  const ModelLayout m = SmallLayout("linked");
  const std::string target = dir_ + "-target";
  std::ofstream(target) << "not a tier";
  auto c = NewClient();
  ASSERT_TRUE(c->EnsureModel(SmallLayout("plain")).ok());
  std::string plain_file;
  for (const auto& e : std::filesystem::directory_iterator(dir_)) {
    if (e.path().extension() == ".kvbank-tier") plain_file = e.path().filename().string();
  }
  ASSERT_FALSE(plain_file.empty());
  // The fingerprint part of the name is the layout's, which both models share.
  const std::string linked_file = "linked" + plain_file.substr(std::string("plain").size());
  std::filesystem::create_symlink(target, dir_ + "/" + linked_file);
  auto refused = c->EnsureModel(m);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_NE(refused.status().message().find("symbolic link"), std::string::npos)
      << refused.status();
  EXPECT_EQ(std::filesystem::file_size(target), std::string("not a tier").size());
  std::filesystem::remove(target);
  ASSERT_TRUE(server_->Stop().ok()) << server_->Log();
  server_.reset();
  // A folder that group or others may write.
  std::filesystem::permissions(dir_, std::filesystem::perms::others_write,
                               std::filesystem::perm_options::add);
  auto open_folder = ServerProcess::Start(Flags("256KiB", "4MiB"));
  ASSERT_FALSE(open_folder.ok()) << "kvbankd started on a folder anyone may write";
  EXPECT_NE(open_folder.status().ToString().find("lets group or others write it"),
            std::string::npos)
      << open_folder.status();
}

// kill -9 while prompts stream in and the small pool spills to a small disk tier (its slots
// reused over and over): after each restart, every block a FetchBlocks serves holds the KV of
// the hash it was asked for, and a served run follows the chain from its first block.
TEST_F(TiersIntegTest, KillNineAnywhereServesOnlyValidBlocks) {
  const int kills =
      std::getenv("KVBANK_TIER_KILLS") ? std::atoi(std::getenv("KVBANK_TIER_KILLS")) : 50;
  const ModelLayout m = SmallLayout("m");
  std::mt19937_64 rng(20261201);
  std::vector<std::vector<uint32_t>> written;  // every prompt a writer finished, all restarts
  uint64_t served_blocks = 0, checked_prompts = 0, load_invalid = 0, loaded = 0;
  BlockHash root{};
  for (int k = 0; k <= kills; ++k) {
    // Pool: 64 blocks; disk tier: 512 slots of 8 KiB.
    ASSERT_NO_FATAL_FAILURE(StartServer(Flags("256KiB", "4MiB")));
    auto c = NewClient();
    ASSERT_TRUE(c->EnsureModel(m).ok());
    auto r = c->GetPrefixRoot("m");
    ASSERT_TRUE(r.ok()) << r.status();
    root = r->root;
    Client::ModelStats st = StatsOf(*c, "m");
    ASSERT_TRUE(st.tiers.has_value());
    loaded += st.tiers->loaded;
    // Check a sample of what was written before (the newest, most of which the disk holds).
    const size_t from = written.size() > 40 ? written.size() - 40 : 0;
    for (size_t i = from; i < written.size(); ++i) {
      const std::vector<BlockHash> want =
          PrefixHashes(HashAlgorithm::kSha256, root, written[i], m.block_tokens);
      auto got = c->FetchBlocks("m", want);
      if (!got.ok()) {
        ASSERT_EQ(got.status().code(), absl::StatusCode::kNotFound) << got.status();
        continue;
      }
      const uint64_t blocks = got->num_tokens / kBt;
      ASSERT_EQ(got->num_tokens % kBt, 0u);
      ASSERT_LE(blocks, want.size());
      const std::vector<BlockHash> served(want.begin(), want.begin() + blocks);
      ASSERT_TRUE(BytesEqual(got->payload, PayloadOf(m, served)))
          << "restart " << k << ", prompt " << i
          << ": a served block is not the one its hash names";
      served_blocks += blocks;
      ++checked_prompts;
    }
    // Every block indexed at this start gets its bytes checked in the background; the torn ones
    // are found then (or by a read, which never serves them).
    const absl::Time scrub_deadline = absl::Now() + absl::Seconds(30);
    do {
      st = StatsOf(*c, "m");
    } while (st.tiers->unverified > 0 && absl::Now() < scrub_deadline);
    ASSERT_EQ(st.tiers->unverified, 0u) << "the background check did not finish";
    load_invalid += st.tiers->load_invalid + st.tiers->corrupt;
    if (k == kills) break;
    // Writers stream prompts until the kill; the kill comes after a random number of them.
    const int target = 5 + int(rng() % 40);
    std::atomic<int> done{0};
    std::atomic<bool> stop{false};
    std::vector<std::vector<uint32_t>> mine;
    std::thread writer([&, seed = rng()] {
      auto wc = NewClient();
      std::mt19937_64 wr(seed);
      while (!stop.load()) {
        std::vector<uint32_t> p = Tokens(wr(), (1 + wr() % 6) * kBt);
        if (!WritePrompt(*wc, m, root, p).ok()) break;
        mine.push_back(std::move(p));
        done.fetch_add(1);
      }
    });
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    while (done.load() < target && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
    server_->SendSignal(SIGKILL);
    stop.store(true);
    writer.join();
    EXPECT_GE(done.load(), target) << "the writer stalled before the kill";
    written.insert(written.end(), mine.begin(), mine.end());
    EXPECT_FALSE(server_->WaitForExit(absl::Seconds(30)).ok()) << "killed, not exited";
    // A killed server's exit status says nothing; what a sanitizer build found is in its log.
    for (const char* report : {"ThreadSanitizer", "AddressSanitizer", "runtime error:"}) {
      EXPECT_EQ(server_->Log().find(report), std::string::npos) << server_->Log();
    }
    server_.reset();
    // A kill leaves whole writes behind (the kernel finishes a write a killed process began); a
    // machine that loses power mid-write does not. Every other restart, one slot is torn the
    // way that would leave it: the second half of its record zeroed.
    if (k % 2 == 1) TearSlot(rng(), st.tiers->disk_capacity);
  }
  std::cerr << "[kill -9] " << kills << " kills, " << written.size() << " prompts written, "
            << checked_prompts << " prompt fetches checked, " << served_blocks
            << " blocks served and checked; " << loaded << " blocks indexed at the starts, "
            << load_invalid << " torn or corrupt slots skipped (" << torn_ << " slots torn)\n";
  EXPECT_GT(served_blocks, 0u) << "no block ever came back from the disk tier";
  EXPECT_GT(load_invalid, 0u) << "no torn slot was ever found at a start";
  EXPECT_GT(loaded, 0u);
}

}  // namespace
}  // namespace kvbank::integ
