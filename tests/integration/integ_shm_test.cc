// The same-host shared-memory plane end to end, its transfers: the real kvbankd with
// --shm-socket, the real client (ClientOptions::shm_socket, ShmRegion) and the generated stub for
// what the SDK never sends. Regions' lifecycle and ownership: integ_shm_region_test.cc.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <limits>
#include <thread>
#include <vector>

#include "absl/strings/str_split.h"
#include "client/shm_handshake.h"
#include "grpcpp/grpcpp.h"
#include "kvbank/v1/kvbank.grpc.pb.h"
#include "tests/integration/prefix_support.h"
#include "tests/integration/shm_test_support.h"

namespace kvbank::integ {
namespace {

// A memory cgroup of its own for a process (v1 memory controller or cgroup v2), made below this
// test's own cgroup; the kernel charges the pages the process allocates from then on to it.
class MemoryCgroup {
 public:
  // Null, with *why, when no writable memory cgroup is here.
  static std::unique_ptr<MemoryCgroup> Make(const std::string& name, std::string* why) {
    std::ifstream self("/proc/self/cgroup");
    std::string line, v1_path, v2_path;
    while (std::getline(self, line)) {
      const std::vector<std::string> f = absl::StrSplit(line, absl::MaxSplits(':', 2));
      if (f.size() != 3) continue;
      if (absl::StrContains(f[1], "memory")) v1_path = f[2];
      if (f[0] == "0" && f[1].empty()) v2_path = f[2];
    }
    std::vector<std::pair<std::string, std::string>> tries;  // (folder, usage file)
    if (!v1_path.empty()) {
      tries.push_back({"/sys/fs/cgroup/memory" + v1_path, "memory.usage_in_bytes"});
    }
    if (!v2_path.empty()) {
      tries.push_back({"/sys/fs/cgroup" + v2_path, "memory.current"});
      tries.push_back({"/sys/fs/cgroup/unified" + v2_path, "memory.current"});
    }
    for (const auto& [parent, usage] : tries) {
      const std::string dir = parent + "/" + name;
      if (mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) continue;
      if (access((dir + "/" + usage).c_str(), R_OK) != 0) {
        rmdir(dir.c_str());
        continue;
      }
      return std::unique_ptr<MemoryCgroup>(new MemoryCgroup(dir, usage));
    }
    *why = "no writable memory cgroup below this process's (v1 memory or v2 memory.current)";
    return nullptr;
  }
  ~MemoryCgroup() { rmdir(dir_.c_str()); }  // empty once the process exited
  bool Add(pid_t pid) {
    std::ofstream procs(dir_ + "/cgroup.procs");
    procs << pid << std::endl;
    return bool(procs);
  }
  int64_t Usage() const {
    int64_t v = -1;
    std::ifstream(dir_ + "/" + usage_) >> v;
    return v;
  }

 private:
  MemoryCgroup(std::string dir, std::string usage)
      : dir_(std::move(dir)), usage_(std::move(usage)) {}
  const std::string dir_, usage_;
};

// The pages of a client's region are the client's: kvbankd's copies into it do not grow
// kvbankd's memory cgroup (the SDK writes its memfds whole; kvbankd maps no memfd with a hole,
// whose pages its own copies would allocate on its account).
TEST_F(ShmTest, FetchesIntoRegionsDoNotGrowTheServersMemoryCgroup) {
  ASSERT_NO_FATAL_FAILURE(Start());
  std::string why;
  auto cgroup = MemoryCgroup::Make(absl::StrCat("kvbank-shm-test-", getpid()), &why);
  if (cgroup == nullptr) GTEST_SKIP() << why;
  ASSERT_TRUE(cgroup->Add(server_->pid())) << "cannot move kvbankd into its cgroup";
  std::unique_ptr<Client> c = Shm();
  ModelLayout m = SmallLayout("m");
  m.num_layers = 8;
  m.num_q_heads = 8;
  m.num_kv_heads = 8;
  m.head_dim = m.head_dim_v = 128;
  m.layer_dtypes.assign(m.num_layers, DType::kFp16);
  ASSERT_TRUE(c->EnsureModel(m, 128 * kMiB).ok());
  auto seq = c->CreateSequence("m");
  ASSERT_TRUE(seq.ok()) << seq.status();
  constexpr uint64_t kTokens = 2048;  // 64 MiB at 32 KiB a token
  const uint64_t payload = kTokens * 2 * 8 * 8 * 128 * 2;
  Client::AppendArgs args;
  args.num_tokens = kTokens;
  ASSERT_TRUE(c->Append("m", seq->id, args, std::vector<uint8_t>(payload, 0x3c)).ok());
  std::vector<std::unique_ptr<ShmRegion>> regions;
  for (int i = 0; i < 3; ++i) {
    auto r = c->RegisterRegion(payload);
    ASSERT_TRUE(r.ok()) << r.status();
    regions.push_back(*std::move(r));
  }
  const int64_t before = cgroup->Usage();
  ASSERT_GE(before, 0);
  for (const auto& r : regions) {
    auto got = c->FetchToRegion("m", seq->id, {}, r->Slice(0, payload));
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(got->payload_bytes, payload);
    EXPECT_EQ(r->data()[payload - 1], 0x3c);
  }
  const int64_t after = cgroup->Usage();
  std::cerr << "[shm] kvbankd's memory cgroup: " << before << " bytes before 192 MiB of fetches "
            << "into client regions, " << after << " after\n";
  // (A sanitizer's shadow of the regions' pages is kvbankd's own memory: no bound there.)
  if (!kSanitizedBuild) {
    EXPECT_LT(after - before, int64_t{16} << 20)
        << "kvbankd's cgroup paid for pages of the client's regions";
  }
}

TEST_F(ShmTest, AppendAndFetchThroughARegionEqualTheGrpcPath) {
  ASSERT_NO_FATAL_FAILURE(Start());
  std::unique_ptr<Client> c = Shm();
  // An fp16 model (copied as is) and an int8 one (quantized on the way in: the server reads the
  // region through a private copy).
  ModelLayout plain = SmallLayout("m");
  ModelLayout quant = SmallLayout("q");
  quant.layer_dtypes.assign(quant.num_layers, DType::kInt8);
  for (const ModelLayout& layout : {plain, quant}) {
    SCOPED_TRACE(layout.name);
    auto model = c->EnsureModel(layout, 64 * BlockBytes(layout));
    ASSERT_TRUE(model.ok()) << model.status();
    const uint64_t per_token = model->payload_bytes_per_token;
    auto region = c->RegisterRegion(4 * kMiB);
    ASSERT_TRUE(region.ok()) << region.status();
    ASSERT_NE((*region)->id(), 0u);
    ASSERT_EQ((*region)->size(), 4 * kMiB);
    auto via_shm = c->CreateSequence(layout.name);
    auto via_grpc = c->CreateSequence(layout.name);
    ASSERT_TRUE(via_shm.ok() && via_grpc.ok());
    std::cerr << "[shm] seed 9101\n";
    Random rng(9101);
    // Odd token counts, odd offsets in the region.
    uint64_t offset = 3;
    for (uint64_t n : {37u, 1u, 21u}) {
      Client::AppendArgs args;
      args.num_tokens = n;
      args.dtype = DType::kFp16;
      const uint64_t bytes = n * per_token;
      std::vector<uint8_t> payload(bytes);
      // Values of magnitude < 1 as fp16 (bytes with the high exponent bits clear): no NaN/Inf.
      for (size_t i = 0; i < bytes; i += 2) {
        payload[i] = static_cast<uint8_t>(rng.Next());
        payload[i + 1] = static_cast<uint8_t>(rng.Next() % 0x3b);
      }
      std::memcpy((*region)->data() + offset, payload.data(), bytes);
      auto a = c->AppendFromRegion(layout.name, via_shm->id, args, (*region)->Slice(offset, bytes));
      ASSERT_TRUE(a.ok()) << a.status();
      auto b = c->Append(layout.name, via_grpc->id, args, payload);
      ASSERT_TRUE(b.ok()) << b.status();
      EXPECT_EQ(a->length, b->length);
      offset += bytes + 5;
    }
    for (const Client::FetchArgs& args :
         {Client::FetchArgs{}, Client::FetchArgs{5, 40, 1, 2, DType::kFp16, 0, std::nullopt},
          Client::FetchArgs{0, std::nullopt, 0, std::nullopt, DType::kFp16, 1, 2}}) {
      auto want = c->Fetch(layout.name, via_grpc->id, args);
      ASSERT_TRUE(want.ok()) << want.status();
      auto got_grpc = c->Fetch(layout.name, via_shm->id, args);
      ASSERT_TRUE(got_grpc.ok()) << got_grpc.status();
      EXPECT_TRUE(BytesEqual(got_grpc->payload, want->payload)) << "appended through the region";
      // Into the region, past a sentinel; what follows the payload is not touched.
      std::memset((*region)->data(), 0xab, (*region)->size());
      auto into = c->FetchToRegion(layout.name, via_shm->id, args,
                                   (*region)->Slice(4096, (*region)->size() - 4096));
      ASSERT_TRUE(into.ok()) << into.status();
      EXPECT_EQ(into->payload_bytes, want->payload.size());
      EXPECT_EQ(into->num_tokens, want->num_tokens);
      EXPECT_EQ(into->layer_begin, want->layer_begin);
      EXPECT_EQ(into->layer_end, want->layer_end);
      EXPECT_EQ(into->kv_head_end, want->kv_head_end);
      EXPECT_TRUE(into->payload.empty());
      const uint8_t* d = (*region)->data();
      EXPECT_TRUE(BytesEqual(std::vector<uint8_t>(d + 4096, d + 4096 + into->payload_bytes),
                             want->payload));
      EXPECT_EQ(d[4095], 0xab);
      EXPECT_EQ(d[4096 + into->payload_bytes], 0xab);
    }
    // Dropped on request: the id names nothing any more.
    const uint64_t id = (*region)->id();
    ASSERT_TRUE(c->UnregisterRegion(id).ok());
    EXPECT_TRUE(RegionGone(*c, layout.name, via_shm->id, id));
    EXPECT_EQ(c->UnregisterRegion(id).code(), absl::StatusCode::kNotFound);
  }
  // Dropped when its client's socket connection closes (the ShmRegion goes).
  auto seq = c->CreateSequence("m");
  ASSERT_TRUE(seq.ok());
  auto region = c->RegisterRegion(8192);
  ASSERT_TRUE(region.ok()) << region.status();
  const uint64_t id = (*region)->id();
  EXPECT_FALSE(RegionGone(*c, "m", seq->id, id));
  region->reset();
  EXPECT_TRUE(WaitFor([&] { return RegionGone(*c, "m", seq->id, id); }))
      << "the region outlived its client's socket connection";
  ExpectAccounting(StatsOf(*c, "m"));
}

TEST_F(ShmTest, LargeFetchesCopiedBySeveralWorkersEqualTheGrpcPath) {
  // Fetches of 1 MiB and more on host memory are copied by the worker that runs them and helper
  // workers, each taking pieces (server/rpc/split_copy.h): three helpers here, so that pieces of
  // one payload land on four threads. An fp16 model copied as is and an int8 one decoded to fp16
  // on the way out (RowCodec reads from several threads).
  ASSERT_NO_FATAL_FAILURE(Start({"--device-workers=4", "--region-copy-helpers=3"}));
  std::unique_ptr<Client> c = Shm();
  for (DType stored : {DType::kFp16, DType::kInt8}) {
    ModelLayout layout = SmallLayout(stored == DType::kFp16 ? "big" : "big8");
    SCOPED_TRACE(layout.name);
    layout.num_layers = 4;
    layout.num_q_heads = layout.num_kv_heads = 8;
    layout.head_dim = layout.head_dim_v = 128;
    layout.layer_dtypes.assign(layout.num_layers, stored);
    auto model = c->EnsureModel(layout, 64 * kMiB);
    ASSERT_TRUE(model.ok()) << model.status();
    const uint64_t n = 301;  // 16 KiB a token in fp16: 4.7 MiB, not a multiple of a piece
    const uint64_t bytes = n * model->payload_bytes_per_token;
    std::cerr << "[shm] seed 5151\n";
    Random rng(5151);
    std::vector<uint8_t> payload(bytes);
    for (size_t i = 0; i < bytes; i += 2) {  // fp16 of magnitude < 1: no NaN/Inf
      payload[i] = static_cast<uint8_t>(rng.Next());
      payload[i + 1] = static_cast<uint8_t>(rng.Next() % 0x3b);
    }
    auto seq = c->CreateSequence(layout.name);
    ASSERT_TRUE(seq.ok()) << seq.status();
    Client::AppendArgs append;
    append.num_tokens = n;
    append.dtype = DType::kFp16;
    ASSERT_TRUE(c->Append(layout.name, seq->id, append, payload).ok());
    auto region = c->RegisterRegion(bytes + 8192);
    ASSERT_TRUE(region.ok()) << region.status();
    // The whole payload; an odd token range; two of four layers; a head range.
    for (const Client::FetchArgs& args :
         {Client::FetchArgs{},
          Client::FetchArgs{7, 290, 0, std::nullopt, DType::kFp16, 0, std::nullopt},
          Client::FetchArgs{0, std::nullopt, 1, 3, DType::kFp16, 0, std::nullopt},
          Client::FetchArgs{3, std::nullopt, 0, std::nullopt, DType::kFp16, 2, 7}}) {
      auto want = c->Fetch(layout.name, seq->id, args);
      ASSERT_TRUE(want.ok()) << want.status();
      ASSERT_GE(want->payload.size(), uint64_t{1} << 20) << "small enough to go on one thread";
      std::memset((*region)->data(), 0xab, (*region)->size());
      auto into = c->FetchToRegion(layout.name, seq->id, args,
                                   (*region)->Slice(4096, (*region)->size() - 4096));
      ASSERT_TRUE(into.ok()) << into.status();
      ASSERT_EQ(into->payload_bytes, want->payload.size());
      const uint8_t* d = (*region)->data();
      EXPECT_TRUE(BytesEqual(std::vector<uint8_t>(d + 4096, d + 4096 + into->payload_bytes),
                             want->payload));
      EXPECT_EQ(d[4095], 0xab);
      EXPECT_EQ(d[4096 + into->payload_bytes], 0xab);
    }
    ASSERT_TRUE(c->Free(layout.name, seq->id).ok());
    ExpectAccounting(StatsOf(*c, layout.name));
  }
}

TEST_F(ShmTest, FetchBlocksIntoARegionEqualsTheGrpcPath) {
  // Prefix caching on: full blocks get hashes that FetchBlocks names.
  ASSERT_NO_FATAL_FAILURE(StartServer({"--models=", "--shm-socket=" + socket_}));
  std::unique_ptr<Client> c = Shm();
  const ModelLayout layout = SmallLayout("m");
  ASSERT_TRUE(c->EnsureModel(layout, 64 * BlockBytes(layout)).ok());
  auto seq = c->CreateSequence("m");
  ASSERT_TRUE(seq.ok());
  std::cerr << "[shm] seed 9202\n";
  const std::vector<uint32_t> tokens = Tokens(9202, 3 * kBt + 5);
  Client::AppendArgs args;
  args.num_tokens = tokens.size();
  args.token_ids = tokens;
  ASSERT_TRUE(c->Append("m", seq->id, args, Random(9202).Bytes(tokens.size() * 256)).ok());
  auto root = c->GetPrefixRoot("m");
  ASSERT_TRUE(root.ok()) << root.status();
  const std::vector<BlockHash> hashes =
      PrefixHashes(root->algorithm, root->root, tokens, root->block_tokens);
  ASSERT_EQ(hashes.size(), 3u);
  auto want = c->FetchBlocks("m", hashes, 1, 2);
  ASSERT_TRUE(want.ok()) << want.status();
  ASSERT_EQ(want->payload.size(), 3 * kBt * 128);

  auto region = c->RegisterRegion(64 * 1024);
  ASSERT_TRUE(region.ok()) << region.status();
  std::memset((*region)->data(), 0xee, (*region)->size());
  auto stub = v1::KvBank::NewStub(
      grpc::CreateChannel(server_->target(), grpc::InsecureChannelCredentials()));
  v1::FetchBlocksRequest req;
  req.set_model("m");
  for (const BlockHash& h : hashes) req.add_block_hashes(std::string(h.begin(), h.end()));
  req.set_layer_begin(1);
  req.set_layer_end(2);
  req.mutable_dest()->set_region_id((*region)->id());
  req.mutable_dest()->set_offset(100);
  req.mutable_dest()->set_length(want->payload.size());
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  auto reader = stub->FetchBlocks(&ctx, req);
  std::vector<v1::FetchResponse> got;
  v1::FetchResponse resp;
  while (reader->Read(&resp)) got.push_back(resp);
  grpc::Status s = reader->Finish();
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_EQ(got.size(), 1u) << "the header alone";
  EXPECT_TRUE(got[0].data().empty());
  EXPECT_EQ(got[0].header().payload_bytes(), want->payload.size());
  EXPECT_EQ(got[0].header().num_tokens(), 3 * kBt);
  const uint8_t* d = (*region)->data();
  EXPECT_TRUE(
      BytesEqual(std::vector<uint8_t>(d + 100, d + 100 + want->payload.size()), want->payload));
  EXPECT_EQ(d[99], 0xee);
  EXPECT_EQ(d[100 + want->payload.size()], 0xee);
  // One byte short: refused, nothing written.
  std::memset((*region)->data(), 0xee, (*region)->size());
  req.mutable_dest()->set_length(want->payload.size() - 1);
  grpc::ClientContext ctx2;
  ctx2.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  auto reader2 = stub->FetchBlocks(&ctx2, req);
  while (reader2->Read(&resp)) {
  }
  s = reader2->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_TRUE(absl::StrContains(s.error_message(), "dest.length")) << s.error_message();
  for (uint64_t i = 0; i < (*region)->size(); ++i) ASSERT_EQ(d[i], 0xee) << "byte " << i;
}

// Scattered slices: a payload cut in runs lands at (or is gathered from) offsets of the caller's
// choosing, in one call, byte for byte the contiguous payload; bad runs are refused naming the
// field, and nothing is written or appended.
TEST_F(ShmTest, ScatteredRunsMoveThePayloadInOneCall) {
  ASSERT_NO_FATAL_FAILURE(StartServer({"--models=", "--shm-socket=" + socket_}));
  std::unique_ptr<Client> c = Shm();
  const ModelLayout layout = SmallLayout("m");
  ASSERT_TRUE(c->EnsureModel(layout, 64 * BlockBytes(layout)).ok());
  auto seq = c->CreateSequence("m");
  ASSERT_TRUE(seq.ok());
  std::cerr << "[shm] seed 9203\n";
  const std::vector<uint32_t> tokens = Tokens(9203, 4 * kBt);
  Client::AppendArgs args;
  args.num_tokens = tokens.size();
  args.token_ids = tokens;
  ASSERT_TRUE(c->Append("m", seq->id, args, Random(9203).Bytes(tokens.size() * 256)).ok());
  auto root = c->GetPrefixRoot("m");
  ASSERT_TRUE(root.ok()) << root.status();
  const std::vector<BlockHash> hashes =
      PrefixHashes(root->algorithm, root->root, tokens, root->block_tokens);
  auto want = c->FetchBlocks("m", hashes);
  ASSERT_TRUE(want.ok()) << want.status();
  const uint64_t payload = want->payload.size();
  ASSERT_EQ(payload, 4 * kBt * 256);

  auto region = c->RegisterRegion(64 * 1024);
  ASSERT_TRUE(region.ok()) << region.status();
  ShmRegion& r = **region;
  uint8_t* const d = r.data();
  // 16 runs of 1 KiB, last to first, 1 KiB apart, from byte 100 on.
  constexpr uint64_t kRun = 1024;
  RegionSlice runs{r.id(), 100, 0, kRun, {}};
  for (uint64_t i = 0; i < payload / kRun; ++i) runs.run_offsets.push_back((15 - i) * 2 * kRun);
  std::memset(d, 0xee, r.size());
  auto f = c->FetchBlocksToRegion("m", hashes, {}, runs);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->payload_bytes, payload);
  std::vector<uint8_t> gathered;
  for (uint64_t i = 0; i < runs.run_offsets.size(); ++i) {
    const uint8_t* at = d + 100 + runs.run_offsets[i];
    gathered.insert(gathered.end(), at, at + kRun);
    ASSERT_EQ(at[kRun], 0xee) << "the gap after run " << i;
  }
  EXPECT_TRUE(BytesEqual(gathered, want->payload));
  EXPECT_EQ(d[99], 0xee);
  // Gathered back from the same runs: another sequence with the same bytes.
  auto seq2 = c->CreateSequence("m");
  ASSERT_TRUE(seq2.ok());
  Client::AppendArgs plain;
  plain.num_tokens = tokens.size();
  ASSERT_TRUE(c->AppendFromRegion("m", seq2->id, plain, runs).ok());
  auto back = c->Fetch("m", seq2->id, {});
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(BytesEqual(back->payload, want->payload));

  // Runs side by side in payload order (kvbankd copies each group as one run): four groups of
  // four, the groups last to first with a 1 KiB gap; both ways, byte for byte.
  RegionSlice grouped{r.id(), 100, 0, kRun, {}};
  for (uint64_t i = 0; i < payload / kRun; ++i) {
    grouped.run_offsets.push_back((3 - i / 4) * 5 * kRun + (i % 4) * kRun);
  }
  std::memset(d, 0xee, r.size());
  f = c->FetchBlocksToRegion("m", hashes, {}, grouped);
  ASSERT_TRUE(f.ok()) << f.status();
  gathered.clear();
  for (uint64_t o : grouped.run_offsets)
    gathered.insert(gathered.end(), d + 100 + o, d + 100 + o + kRun);
  EXPECT_TRUE(BytesEqual(gathered, want->payload));
  for (uint64_t g = 0; g < 4; ++g) EXPECT_EQ(d[100 + g * 5 * kRun + 4 * kRun], 0xee) << "gap " << g;
  auto seq3 = c->CreateSequence("m");
  ASSERT_TRUE(seq3.ok());
  ASSERT_TRUE(c->AppendFromRegion("m", seq3->id, plain, grouped).ok());
  back = c->Fetch("m", seq3->id, {});
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(BytesEqual(back->payload, want->payload));

  // Bad runs: refused naming the field; nothing written, nothing appended.
  struct Case {
    RegionSlice slice;
    const char* names;
  };
  const uint64_t id = r.id();
  std::vector<Case> cases = {
      {{id, 0, 0, kRun, {0, 512}}, "dest: runs at 0 and 512 of 1024 bytes overlap"},
      {{id, 0, 0, 0, {0, 4096}}, "dest.run_bytes is 0"},
      {{id, 0, 4096, kRun, {}}, "dest.run_bytes is set without run_offsets"},
      {{id, 0, 5, kRun, {0, 4096}}, "dest.length 5 is not run_bytes 1024 x 2 runs"},
      {{id, 64 * 1024 - 512, 0, kRun, {0}}, "runs past the region"},
      {{id, 0, 0, kRun, {0, 2048, 4096}}, "dest.length 3072 is less than the payload's"},
      {{id, 8, 0, kRun, {std::numeric_limits<uint64_t>::max() - 100}}, "overflows"},
  };
  std::memset(d, 0xee, r.size());
  for (const Case& k : cases) {
    auto bad = c->FetchBlocksToRegion("m", hashes, {}, k.slice);
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
    EXPECT_TRUE(absl::StrContains(bad.status().message(), k.names)) << bad.status();
  }
  for (uint64_t i = 0; i < r.size(); ++i) ASSERT_EQ(d[i], 0xee) << "byte " << i;
  RegionSlice short_source{id, 0, 0, kRun, {0, 2048}};
  auto bad_append = c->AppendFromRegion("m", seq2->id, plain, short_source);
  EXPECT_EQ(bad_append.status().code(), absl::StatusCode::kInvalidArgument) << bad_append.status();
  EXPECT_TRUE(absl::StrContains(bad_append.status().message(), "header.source.length 2048"))
      << bad_append.status();
  EXPECT_EQ(c->GetSequence("m", seq2->id)->length, tokens.size());
  // Device regions take no runs.
  auto device = c->FetchBlocksToDevice("m", hashes, {}, {1, 0, 0, kRun, {0}});
  EXPECT_EQ(device.status().code(), absl::StatusCode::kInvalidArgument) << device.status();
  EXPECT_TRUE(absl::StrContains(device.status().message(), "shared-memory regions only"))
      << device.status();
}

TEST_F(ShmTest, BadSlicesAreRefusedNamingThemAndChangeNothing) {
  ASSERT_NO_FATAL_FAILURE(Start());
  std::unique_ptr<Client> c = Shm();
  const ModelLayout layout = SmallLayout("m");
  ASSERT_TRUE(c->EnsureModel(layout, 64 * BlockBytes(layout)).ok());
  auto seq = c->CreateSequence("m");
  ASSERT_TRUE(seq.ok());
  auto region = c->RegisterRegion(64 * 1024);
  ASSERT_TRUE(region.ok()) << region.status();
  ShmRegion& r = **region;
  const uint64_t per_token = 256, n = 16, bytes = n * per_token;
  Client::AppendArgs args;
  args.num_tokens = n;
  const uint64_t max = std::numeric_limits<uint64_t>::max();
  struct Case {
    RegionSlice slice;
    absl::StatusCode code;
    const char* names;
  };
  const Case cases[] = {
      {{r.id(), r.size() - bytes + 1, bytes}, absl::StatusCode::kInvalidArgument, "header.source"},
      {{r.id(), r.size() + 1, 0}, absl::StatusCode::kInvalidArgument, "header.source"},
      {{r.id(), 1, max}, absl::StatusCode::kInvalidArgument, "header.source"},
      {{r.id(), max, 2}, absl::StatusCode::kInvalidArgument, "header.source"},
      {{r.id(), 0, bytes - 1}, absl::StatusCode::kInvalidArgument, "header.source.length"},
      {{r.id(), 0, bytes + 256}, absl::StatusCode::kInvalidArgument, "header.source.length"},
      {{0, 0, bytes}, absl::StatusCode::kInvalidArgument, "header.source.region_id"},
      {{r.id() + 777, 0, bytes}, absl::StatusCode::kNotFound, "header.source.region_id"},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(
        absl::StrCat("slice ", k.slice.region_id, " ", k.slice.offset, " ", k.slice.length));
    auto a = c->AppendFromRegion("m", seq->id, args, k.slice);
    EXPECT_EQ(a.status().code(), k.code) << a.status();
    EXPECT_TRUE(absl::StrContains(a.status().message(), k.names)) << a.status();
    auto info = c->GetSequence("m", seq->id);
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->length, 0u) << "a refused append changed the sequence";
  }
  // A data chunk beside the source: refused, nothing appended.
  {
    auto channel = grpc::CreateChannel(server_->target(), grpc::InsecureChannelCredentials());
    auto stub = v1::KvBank::NewStub(channel);
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    v1::AppendResponse resp;
    auto w = stub->Append(&ctx, &resp);
    v1::AppendRequest req;
    v1::AppendHeader* h = req.mutable_header();
    h->set_model("m");
    h->set_sequence_id(seq->id);
    h->set_num_tokens(n);
    h->mutable_source()->set_region_id(r.id());
    h->mutable_source()->set_length(bytes);
    req.set_data(std::string(bytes, '\0'));
    w->Write(req);
    w->WritesDone();
    grpc::Status s = w->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_TRUE(absl::StrContains(s.error_message(), "header.source")) << s.error_message();
    // ... and in a later message.
    grpc::ClientContext ctx2;
    ctx2.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    auto w2 = stub->Append(&ctx2, &resp);
    req.clear_data();
    w2->Write(req);
    v1::AppendRequest data;
    data.set_data("xyz");
    w2->Write(data);
    w2->WritesDone();
    s = w2->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_TRUE(absl::StrContains(s.error_message(), "header.source")) << s.error_message();
    auto info = c->GetSequence("m", seq->id);
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->length, 0u);
  }
  // A good append, then fetches into bad slices: refused, the region untouched.
  std::memset(r.data(), 1, bytes);
  ASSERT_TRUE(c->AppendFromRegion("m", seq->id, args, r.Slice(0, bytes)).ok());
  std::memset(r.data(), 0xcd, r.size());
  for (const Case& k : std::vector<Case>{
           {{r.id(), 0, bytes - 1}, absl::StatusCode::kInvalidArgument, "dest.length"},
           {{r.id(), r.size() - 10, 11}, absl::StatusCode::kInvalidArgument, "dest"},
           {{r.id(), 1, max}, absl::StatusCode::kInvalidArgument, "dest"},
           {{r.id() + 777, 0, bytes}, absl::StatusCode::kNotFound, "dest.region_id"}}) {
    auto f = c->FetchToRegion("m", seq->id, {}, k.slice);
    EXPECT_EQ(f.status().code(), k.code) << f.status();
    EXPECT_TRUE(absl::StrContains(f.status().message(), k.names)) << f.status();
  }
  for (uint64_t i = 0; i < r.size(); ++i) ASSERT_EQ(r.data()[i], 0xcd) << "byte " << i;
  auto st = StatsOf(*c, "m");
  EXPECT_EQ(st.blocks_used, 1u);
  ExpectAccounting(st);
}

// Layer-wise handoff into a region: a fetch that waits for its tokens, registered before they
// are appended, writes them into the region once the append commits.
TEST_F(ShmTest, AFetchIntoARegionWaitsForItsTokens) {
  ASSERT_NO_FATAL_FAILURE(Start());
  std::unique_ptr<Client> c = Shm();
  constexpr uint64_t kTokens = 24;
  OneSequence one;
  ASSERT_NO_FATAL_FAILURE(MakeOneSequence(*c, kTokens, &one));
  Client::FetchArgs wait;
  wait.token_end = kTokens;
  wait.wait = absl::Seconds(30);
  std::unique_ptr<Client> decode = Shm();
  auto pulled = std::async(std::launch::async, [&] {
    return decode->FetchToRegion("m", one.seq, wait, one.region->Slice(0, one.bytes));
  });
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  for (;;) {  // the fetch waits on the server before the tokens exist
    auto st = c->GetStats("m");
    ASSERT_TRUE(st.ok()) << st.status();
    if (st->at(0).fetches_waiting == 1) break;
    ASSERT_LT(absl::Now(), deadline) << "the fetch never waited";
    absl::SleepFor(absl::Milliseconds(2));
  }
  std::vector<uint8_t> payload(one.bytes);
  for (size_t i = 0; i < one.bytes; i += 2) {
    payload[i] = static_cast<uint8_t>(i * 7);
    payload[i + 1] = static_cast<uint8_t>(i % 0x3b);
  }
  Client::AppendArgs args;
  args.num_tokens = kTokens;
  ASSERT_TRUE(c->Append("m", one.seq, args, payload).ok());
  auto got = pulled.get();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->payload_bytes, one.bytes);
  EXPECT_EQ(std::memcmp(one.region->data(), payload.data(), one.bytes), 0);
}

// A client that waits for small replies on the CPU (shm_control_spin) stops at its call's
// deadline however long its spin. (A reply that comes long after the spin is the case above:
// the waiting fetch outlasts the default spin, and its waiter takes the reply from poll.)
TEST_F(ShmTest, ASpinningWaiterKeepsItsDeadline) {
  ASSERT_NO_FATAL_FAILURE(Start());
  std::unique_ptr<Client> c = Shm();
  OneSequence one;
  ASSERT_NO_FATAL_FAILURE(MakeOneSequence(*c, 4, &one));
  ASSERT_LE(one.bytes, kShmControlSpinBytes);  // a transfer that spins
  Client::FetchArgs wait;
  wait.token_end = 4;
  wait.wait = absl::Seconds(30);
  ClientOptions o;
  o.shm_socket = socket_;
  o.shm_control = Frames();
  o.shm_control_spin = absl::Seconds(5);
  o.stream_deadline = absl::Milliseconds(300);
  std::unique_ptr<Client> spinning = NewClient(o);
  const absl::Time t0 = absl::Now();
  auto late = spinning->FetchToRegion("m", one.seq, wait, one.region->Slice(0, one.bytes));
  const absl::Duration took = absl::Now() - t0;
  EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded) << late.status();
  EXPECT_LT(took, absl::Seconds(3)) << "the spin outlasted the call's deadline";
}

// The way of asking is the one chosen (frames, or gRPC calls with KVBANK_TEST_SHM_CONTROL=0),
// and a device region's transfer on a server with a host pool is refused alike either way,
// naming the CUDA IPC plane, with nothing changed.
TEST_F(ShmTest, RegionTransfersTakeTheControlPathAskedForAndDeviceOnesAreRefusedAlike) {
  ASSERT_NO_FATAL_FAILURE(Start());
  std::unique_ptr<Client> c = Shm();
  const ModelLayout layout = SmallLayout("m");
  auto model = c->EnsureModel(layout, 64 * BlockBytes(layout));
  ASSERT_TRUE(model.ok()) << model.status();
  auto seq = c->CreateSequence("m");
  ASSERT_TRUE(seq.ok()) << seq.status();
  const uint64_t per_token = model->payload_bytes_per_token;
  auto region = c->RegisterRegion(4 * per_token);
  ASSERT_TRUE(region.ok()) << region.status();
  Client::AppendArgs args;
  args.num_tokens = 4;
  for (uint64_t i = 0; i < 4 * per_token; ++i) (*region)->data()[i] = uint8_t(i * 7);
  ASSERT_TRUE(c->AppendFromRegion("m", seq->id, args, (*region)->Slice(0, 4 * per_token)).ok());
  auto back = c->FetchToRegion("m", seq->id, {}, (*region)->Slice(0, 4 * per_token));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(c->ShmControlRequests(), Frames() ? 2u : 0u);

  const RegionSlice device{7, 0, 4 * per_token};
  auto appended = c->AppendFromDevice("m", seq->id, args, device);
  EXPECT_EQ(appended.status().code(), absl::StatusCode::kFailedPrecondition) << appended.status();
  EXPECT_NE(appended.status().message().find("CUDA IPC plane"), std::string::npos)
      << appended.status();
  auto fetched = c->FetchToDevice("m", seq->id, {}, device);
  EXPECT_EQ(fetched.status().code(), absl::StatusCode::kFailedPrecondition) << fetched.status();
  EXPECT_NE(fetched.status().message().find("CUDA IPC plane"), std::string::npos)
      << fetched.status();
  EXPECT_EQ(c->ShmControlRequests(), Frames() ? 4u : 0u);
  auto info = c->GetSequence("m", seq->id);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->length, 4u) << "a refused append changed the sequence";
}

// Pages under their own keys, many in one call (PutPagesFromRegion): each page held afterwards,
// named by its key alone, byte for byte what its runs held; pages already held are OK again; a
// bad page fails alone and leaves nothing, the others are stored; bad arguments fail every page.
TEST_F(ShmTest, PutPagesStoresEachPageUnderItsKey) {
  ASSERT_NO_FATAL_FAILURE(StartServer({"--models=", "--shm-socket=" + socket_}));
  std::unique_ptr<Client> c = Shm();
  const ModelLayout layout = SmallLayout("m");
  ASSERT_TRUE(c->EnsureModel(layout, 64 * BlockBytes(layout)).ok());
  const uint64_t page = kBt * 256;  // one block's payload
  constexpr uint64_t kRun = 512;    // a page's payload in 8 runs, kept apart in the region
  auto region = c->RegisterRegion(64 * 1024);
  ASSERT_TRUE(region.ok()) << region.status();
  ShmRegion& r = **region;
  std::cerr << "[shm] seed 9204\n";
  Random rng(9204);
  rng.Fill(r.data(), r.size());
  // Page p's run j at 1024 * (8 * p + j): runs of 512 bytes with 512-byte gaps.
  auto runs_of = [&](uint64_t p) {
    std::vector<uint64_t> offsets;
    for (uint64_t j = 0; j < page / kRun; ++j) offsets.push_back(1024 * (8 * p + j));
    return offsets;
  };
  auto bytes_of = [&](uint64_t p) {
    std::vector<uint8_t> out;
    for (uint64_t o : runs_of(p)) out.insert(out.end(), r.data() + o, r.data() + o + kRun);
    return out;
  };
  auto key_of = [](uint64_t p) {
    return std::vector<ExtraKey>{{ExtraKeyKind::kCustom, "page-" + std::to_string(p)}};
  };
  std::vector<Client::PagePut> pages;
  for (uint64_t p = 0; p < 6; ++p) pages.push_back({key_of(p), {r.id(), 0, 0, kRun, runs_of(p)}});
  Client::PutPagesArgs args;
  args.num_tokens = kBt;
  args.parallel = 3;
  // Whether page p is held: a sequence of the page's placeholder tokens and key attaches it, and
  // it reads back as the page's bytes.
  auto held = [&](uint64_t p) -> ::testing::AssertionResult {
    Client::CreateArgs ca;
    ca.prompt.assign(kBt, 0);
    ca.extra_keys = key_of(p);
    auto seq = c->CreateSequence("m", ca);
    if (!seq.ok()) return ::testing::AssertionFailure() << seq.status();
    auto back = c->Fetch("m", seq->id, {});
    (void)c->Free("m", seq->id);
    if (seq->cached_tokens != kBt) {
      return ::testing::AssertionFailure()
             << "page " << p << ": " << seq->cached_tokens << " tokens cached";
    }
    if (!back.ok()) return ::testing::AssertionFailure() << back.status();
    return BytesEqual(back->payload, bytes_of(p));
  };

  std::vector<absl::Status> st = c->PutPagesFromRegion("m", args, pages);
  ASSERT_EQ(st.size(), pages.size());
  for (uint64_t p = 0; p < pages.size(); ++p) {
    EXPECT_TRUE(st[p].ok()) << "page " << p << ": " << st[p];
    EXPECT_TRUE(held(p));
  }
  const uint64_t used = StatsOf(*c, "m").blocks_cached;
  EXPECT_EQ(used, pages.size()) << "each page one cached block";
  st = c->PutPagesFromRegion("m", args, pages);  // held already: OK, nothing new
  for (const absl::Status& s : st) EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(StatsOf(*c, "m").blocks_cached, used);

  // A page whose runs are past the region fails alone.
  std::vector<Client::PagePut> mixed = {{key_of(6), {r.id(), 0, 0, kRun, runs_of(6)}},
                                        {key_of(11), {r.id(), 0, 0, kRun, runs_of(70)}},
                                        {key_of(7), {r.id(), 0, 0, kRun, runs_of(7)}}};
  st = c->PutPagesFromRegion("m", args, mixed);
  ASSERT_EQ(st.size(), 3u);
  EXPECT_TRUE(st[0].ok()) << st[0];
  EXPECT_EQ(st[1].code(), absl::StatusCode::kInvalidArgument) << st[1];
  EXPECT_TRUE(absl::StrContains(st[1].message(), "runs past the region")) << st[1];
  EXPECT_TRUE(st[2].ok()) << st[2];
  EXPECT_TRUE(held(6));
  EXPECT_TRUE(held(7));
  Client::MatchQuery q;
  q.tokens.assign(kBt, 0);
  q.extra_keys = key_of(11);
  auto m = c->Match("m", {q});
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ((*m)[0], 0u) << "the failed page is held";

  Client::PutPagesArgs bad = args;
  bad.num_tokens = 0;
  for (const absl::Status& s : c->PutPagesFromRegion("m", bad, pages)) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  }
  bad = args;
  bad.parallel = 0;
  for (const absl::Status& s : c->PutPagesFromRegion("m", bad, pages)) {
    EXPECT_TRUE(absl::StrContains(s.message(), "parallel 0")) << s;
  }
  EXPECT_TRUE(c->PutPagesFromRegion("m", args, {}).empty());
  // No sequence is left open: every page's sequence was freed.
  EXPECT_EQ(StatsOf(*c, "m").blocks_used, 0u);
}

}  // namespace
}  // namespace kvbank::integ
