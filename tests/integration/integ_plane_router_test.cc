// kvbank::PlaneRouter end to end: the real kvbankd with --shm-socket and the real client. Shm
// "auto" finds the socket; a buffer inside a registered region moves on the shared-memory plane,
// a large one through a staging region, a small one on gRPC, and every plane answers the bytes
// the gRPC path does; a payload larger than its buffer is OUT_OF_RANGE on every plane; a plane
// that fails is dropped for good, and a staging region whose fetch failed is not used again.
#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "kvbank/plane_router.h"
#include "tests/integration/prefix_support.h"

namespace kvbank::integ {
namespace {

using Plane = PlaneRouter::Plane;

// Payloads of this many bytes or more, outside a registered region, take a staging region.
constexpr uint64_t kMinStaged = 8192;

class PlaneRouterTest : public KvbankdTest {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/kvbank-router-integ-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    dir_ = dir;
    socket_ = dir_ + "/kvbankd.sock";
  }
  void TearDown() override {
    KvbankdTest::TearDown();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  // Prefix caching on: full blocks get the hashes FetchBlocksInto names.
  void Start() { StartServer({"--models=", "--shm-socket=" + socket_}); }
  std::unique_ptr<PlaneRouter> Router(const std::string& shm) {
    PlaneRouter::Options planes;
    planes.shm = shm;
    planes.shm_min_bytes = kMinStaged;
    planes.shm_staging_bytes = 64 * kMiB;
    auto r = PlaneRouter::Connect(server_->target(), {}, planes);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *std::move(r) : nullptr;
  }

  std::string dir_, socket_;
};

// `n` bytes of seeded fp16 values of magnitude < 1 (the high exponent bits clear): no NaN/Inf.
std::vector<uint8_t> Fp16Bytes(uint64_t seed, size_t n) {
  Random rng(seed);
  std::vector<uint8_t> b(n);
  for (size_t i = 0; i + 1 < n; i += 2) {
    b[i] = static_cast<uint8_t>(rng.Next());
    b[i + 1] = static_cast<uint8_t>(rng.Next() % 0x3b);
  }
  return b;
}

// Calls and bytes each plane has carried, in Plane order.
std::vector<uint64_t> Calls(const PlaneRouter& r) {
  const PlaneRouter::Stats st = r.GetStats();
  return {st.planes[Plane::kShm].calls, st.planes[Plane::kShmStaged].calls,
          st.planes[Plane::kGrpc].calls};
}
std::vector<uint64_t> Bytes(const PlaneRouter& r) {
  const PlaneRouter::Stats st = r.GetStats();
  return {st.planes[Plane::kShm].bytes, st.planes[Plane::kShmStaged].bytes,
          st.planes[Plane::kGrpc].bytes};
}

TEST_F(PlaneRouterTest, EachBufferTakesItsPlaneAndEveryPlaneAnswersTheGrpcBytes) {
  ASSERT_NO_FATAL_FAILURE(Start());
  std::unique_ptr<PlaneRouter> router = Router("auto");
  ASSERT_NE(router, nullptr);
  ASSERT_TRUE(router->shm_on()) << "the server is on this host and names its socket";
  EXPECT_EQ(router->shm_socket(), socket_);
  Client& c = router->client();
  const ModelLayout layout = SmallLayout("m");
  ASSERT_TRUE(c.EnsureModel(layout, 64 * BlockBytes(layout)).ok());

  std::cerr << "[router] seed 9301\n";
  const std::vector<uint32_t> tokens = Tokens(9301, 3 * kBt + 5);
  const std::vector<uint8_t> payload = Fp16Bytes(9301, tokens.size() * 256);
  ASSERT_GE(payload.size(), kMinStaged);
  Client::AppendArgs args;
  args.num_tokens = tokens.size();
  args.token_ids = tokens;

  // Appends: from inside a region (at an odd offset), from a large vector, from a small one.
  auto region = router->RegisterRegion(kMiB);
  ASSERT_TRUE(region.ok()) << region.status();
  std::memcpy((*region)->data() + 3, payload.data(), payload.size());
  auto in_region = c.CreateSequence("m");
  auto staged = c.CreateSequence("m");
  auto small = c.CreateSequence("m");
  ASSERT_TRUE(in_region.ok() && staged.ok() && small.ok());
  auto a = router->Append("m", in_region->id, args,
                          absl::MakeConstSpan((*region)->data() + 3, payload.size()));
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(Calls(*router), (std::vector<uint64_t>{1, 0, 0}));
  auto b = router->Append("m", staged->id, args, payload);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(Calls(*router), (std::vector<uint64_t>{1, 1, 0}));
  Client::AppendArgs few;
  few.num_tokens = 5;
  const std::vector<uint8_t> small_payload(payload.begin(), payload.begin() + 5 * 256);
  auto s = router->Append("m", small->id, few, small_payload);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(Calls(*router), (std::vector<uint64_t>{1, 1, 1}));
  EXPECT_EQ(Bytes(*router), (std::vector<uint64_t>{payload.size(), payload.size(), 5 * 256}));
  EXPECT_EQ(a->length, b->length);

  // Fetches into the region, into a large vector (staged), into a small one (gRPC).
  auto want = c.Fetch("m", staged->id, {});
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_TRUE(BytesEqual(want->payload, payload)) << "appended through a staging region";
  auto want_region = c.Fetch("m", in_region->id, {});
  ASSERT_TRUE(want_region.ok()) << want_region.status();
  EXPECT_TRUE(BytesEqual(want_region->payload, payload)) << "appended from inside a region";
  std::memset((*region)->data(), 0xab, (*region)->size());
  uint8_t* d = (*region)->data() + 4096;
  auto f = router->FetchInto("m", in_region->id, {}, absl::MakeSpan(d, want->payload.size() + 7));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->payload_bytes, want->payload.size());
  EXPECT_TRUE(BytesEqual(std::vector<uint8_t>(d, d + f->payload_bytes), want->payload));
  EXPECT_EQ(d[f->payload_bytes], 0xab) << "nothing past the payload is written";
  std::vector<uint8_t> out(want->payload.size() + 10, 0xcd);
  f = router->FetchInto("m", staged->id, {}, absl::MakeSpan(out));
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_EQ(f->payload_bytes, want->payload.size());
  EXPECT_TRUE(
      BytesEqual(std::vector<uint8_t>(out.begin(), out.begin() + f->payload_bytes), want->payload));
  std::vector<uint8_t> small_out(5 * 256);
  f = router->FetchInto("m", small->id, {}, absl::MakeSpan(small_out));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_TRUE(BytesEqual(small_out, small_payload));
  EXPECT_EQ(Calls(*router), (std::vector<uint64_t>{2, 2, 2}));

  // FetchBlocksInto the same three ways, against FetchBlocks.
  auto root = c.GetPrefixRoot("m");
  ASSERT_TRUE(root.ok()) << root.status();
  const std::vector<BlockHash> hashes =
      PrefixHashes(root->algorithm, root->root, tokens, root->block_tokens);
  ASSERT_EQ(hashes.size(), 3u);
  Client::FetchArgs layer1;
  layer1.layer_begin = 1;
  layer1.layer_end = 2;
  auto blocks = c.FetchBlocks("m", hashes, layer1);
  ASSERT_TRUE(blocks.ok()) << blocks.status();
  ASSERT_EQ(blocks->payload.size(), 3 * kBt * 128);
  f = router->FetchBlocksInto("m", hashes, layer1, absl::MakeSpan(d, blocks->payload.size()));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_TRUE(BytesEqual(std::vector<uint8_t>(d, d + f->payload_bytes), blocks->payload));
  std::vector<uint8_t> blocks_out(kMinStaged);
  f = router->FetchBlocksInto("m", hashes, layer1, absl::MakeSpan(blocks_out));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_TRUE(
      BytesEqual(std::vector<uint8_t>(blocks_out.begin(), blocks_out.begin() + f->payload_bytes),
                 blocks->payload));
  auto one = c.FetchBlocks("m", {hashes[0]}, layer1);
  ASSERT_TRUE(one.ok()) << one.status();
  std::vector<uint8_t> one_out(one->payload.size());
  f = router->FetchBlocksInto("m", {hashes[0]}, layer1, absl::MakeSpan(one_out));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_TRUE(BytesEqual(one_out, one->payload));
  EXPECT_EQ(Calls(*router), (std::vector<uint64_t>{3, 3, 3}));

  // One byte short: OUT_OF_RANGE on every plane (the region paths fall back to gRPC, which
  // answers so), and the staging region stays in use.
  const uint64_t need = want->payload.size();
  for (absl::Span<uint8_t> buf : {absl::MakeSpan(d, need - 1), absl::MakeSpan(out.data(), need - 1),
                                  absl::MakeSpan(small_out.data(), small_out.size() - 1)}) {
    const uint64_t id = buf.data() == small_out.data() ? small->id : staged->id;
    f = router->FetchInto("m", id, {}, buf);
    EXPECT_EQ(f.status().code(), absl::StatusCode::kOutOfRange) << f.status();
  }
  for (uint8_t* buf : {d, blocks_out.data()}) {  // the region's, then gRPC's
    f = router->FetchBlocksInto("m", hashes, layer1,
                                absl::MakeSpan(buf, blocks->payload.size() - 1));
    EXPECT_EQ(f.status().code(), absl::StatusCode::kOutOfRange) << f.status();
  }
  EXPECT_EQ(Calls(*router), (std::vector<uint64_t>{3, 3, 3})) << "failures are not counted";
  EXPECT_EQ(router->GetStats().staging_dropped, 0u);

  // A staged fetch that fails for another reason: its staging region is let go.
  f = router->FetchInto("m", kNeverId, {}, absl::MakeSpan(out));
  EXPECT_EQ(f.status().code(), absl::StatusCode::kNotFound) << f.status();
  EXPECT_EQ(router->GetStats().staging_dropped, 1u);
  f = router->FetchInto("m", staged->id, {}, absl::MakeSpan(out));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(Calls(*router), (std::vector<uint64_t>{3, 4, 3})) << "a new staging region serves";

  // A region the router forgot routes as any other memory (here: staged).
  router->UnregisterRegion(*region);
  f = router->FetchInto("m", in_region->id, {}, absl::MakeSpan(d, need));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_TRUE(BytesEqual(std::vector<uint8_t>(d, d + need), want->payload));
  EXPECT_EQ(Calls(*router), (std::vector<uint64_t>{3, 5, 3}));
  ExpectAccounting(StatsOf(c, "m"));
}

TEST_F(PlaneRouterTest, OffAndFailedPlanesCarryEverythingOnGrpc) {
  ASSERT_NO_FATAL_FAILURE(Start());
  // Off: no region can be registered, and a large payload goes on gRPC.
  std::unique_ptr<PlaneRouter> off = Router("");
  ASSERT_NE(off, nullptr);
  EXPECT_FALSE(off->shm_on());
  EXPECT_EQ(off->shm_socket(), "");
  EXPECT_EQ(off->RegisterRegion(kMiB).status().code(), absl::StatusCode::kFailedPrecondition);
  const ModelLayout layout = SmallLayout("m");
  ASSERT_TRUE(off->client().EnsureModel(layout, 64 * BlockBytes(layout)).ok());
  std::cerr << "[router] seed 9302\n";
  const std::vector<uint8_t> payload = Fp16Bytes(9302, 40 * 256);
  Client::AppendArgs args;
  args.num_tokens = 40;
  auto seq = off->client().CreateSequence("m");
  ASSERT_TRUE(seq.ok()) << seq.status();
  ASSERT_TRUE(off->Append("m", seq->id, args, payload).ok());
  std::vector<uint8_t> out(payload.size());
  auto f = off->FetchInto("m", seq->id, {}, absl::MakeSpan(out));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_TRUE(BytesEqual(out, payload));
  EXPECT_EQ(Calls(*off), (std::vector<uint64_t>{0, 0, 2}));

  // A socket nothing listens on: the first staging region fails to register, the plane is
  // dropped for good and the call goes on gRPC.
  std::unique_ptr<PlaneRouter> broken = Router(dir_ + "/nobody.sock");
  ASSERT_NE(broken, nullptr);
  EXPECT_TRUE(broken->shm_on()) << "a named socket is tried";
  auto seq2 = broken->client().CreateSequence("m");
  ASSERT_TRUE(seq2.ok()) << seq2.status();
  auto a = broken->Append("m", seq2->id, args, payload);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_FALSE(broken->shm_on());
  EXPECT_EQ(Calls(*broken), (std::vector<uint64_t>{0, 0, 1}));
  EXPECT_EQ(broken->RegisterRegion(kMiB).status().code(), absl::StatusCode::kFailedPrecondition);
  f = broken->FetchInto("m", seq2->id, {}, absl::MakeSpan(out));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_TRUE(BytesEqual(out, payload));
  EXPECT_EQ(Calls(*broken), (std::vector<uint64_t>{0, 0, 2}));
}

}  // namespace
}  // namespace kvbank::integ
