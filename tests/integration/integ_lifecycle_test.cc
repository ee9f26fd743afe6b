// The whole sequence lifecycle against the real kvbankd through the real client: prefill and
// decode on separate connections, bit-exact round trips for every unquantized storage dtype and
// MLA, fork / truncate / free accounting, leases, and draining on SIGTERM.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kvbank/client.h"
#include "kvbank/v1/kvbank.grpc.pb.h"
#include "tests/integration/kv_reference.h"
#include "tests/integration/server_fixture.h"

namespace kvbank::integ {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;

ModelLayout SmallGqa(const std::string& name, DType dtype) {
  ModelLayout m;
  m.name = name;
  m.num_layers = 4;
  m.num_q_heads = 8;
  m.num_kv_heads = 2;
  m.head_dim = 64;
  m.head_dim_v = 64;
  m.block_tokens = 16;
  m.kind = AttentionKind::kGqa;
  m.input_dtype = dtype;
  m.layer_dtypes.assign(m.num_layers, dtype);
  return m;
}

ModelLayout SmallMla(const std::string& name) {
  ModelLayout m;
  m.name = name;
  m.num_layers = 4;
  m.num_q_heads = 8;
  m.num_kv_heads = 1;
  m.kv_lora_rank = 32;
  m.rope_dim = 8;
  m.head_dim = 40;
  m.head_dim_v = 32;
  m.block_tokens = 16;
  m.kind = AttentionKind::kMla;
  m.input_dtype = DType::kFp16;
  m.layer_dtypes.assign(m.num_layers, DType::kFp16);
  return m;
}

uint64_t CeilDiv(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

// Stats of one model; a failed call fails the test and returns zeros.
Client::ModelStats StatsOf(Client& client, const std::string& model) {
  auto stats = client.GetStats(model);
  EXPECT_TRUE(stats.ok()) << stats.status();
  if (!stats.ok() || stats->size() != 1) {
    ADD_FAILURE() << "GetStats(" << model << ") did not return one model";
    return {};
  }
  return (*stats)[0];
}

// Fetches [t0, t1) x [l0, l1) and compares with the reference, header fields included.
void ExpectFetch(Client& client, const std::string& model, uint64_t id, const KvReference& ref,
                 uint32_t l0, uint32_t l1, uint64_t t0, uint64_t t1) {
  SCOPED_TRACE(testing::Message() << "fetch tokens [" << t0 << ", " << t1 << ") layers [" << l0
                                  << ", " << l1 << ")");
  Client::FetchArgs args;
  args.token_begin = t0;
  args.token_end = t1;
  args.layer_begin = l0;
  args.layer_end = l1;
  auto r = client.Fetch(model, id, args);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->token_begin, t0);
  EXPECT_EQ(r->num_tokens, t1 - t0);
  EXPECT_EQ(r->layer_begin, l0);
  EXPECT_EQ(r->layer_end, l1);
  EXPECT_EQ(r->dtype, ref.block_layout().layers[l0].dtype);
  EXPECT_TRUE(BytesEqual(r->payload, ref.Payload(l0, l1, t0, t1)));
}

void ExpectFetchTensors(Client& client, const std::string& model, uint64_t id,
                        const KvReference& ref, uint32_t l0, uint32_t l1, uint64_t t0,
                        uint64_t t1) {
  SCOPED_TRACE(testing::Message() << "FetchTensors tokens [" << t0 << ", " << t1 << ") layers ["
                                  << l0 << ", " << l1 << ")");
  std::vector<uint8_t> want_k, want_v;
  ref.Tensors(l0, l1, t0, t1, &want_k, &want_v);
  std::vector<uint8_t> k(want_k.size(), 0xAB), v(want_v.size(), 0xAB);
  Client::FetchArgs args;
  args.token_begin = t0;
  args.token_end = t1;
  args.layer_begin = l0;
  args.layer_end = l1;
  absl::Status s = client.FetchTensors(model, id, args, absl::MakeSpan(k), absl::MakeSpan(v));
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_TRUE(BytesEqual(k, want_k)) << "K";
  EXPECT_TRUE(BytesEqual(v, want_v)) << "V";
}

// Appends `n` tokens of layers [l0, l1) through Append or AppendTensors and checks the reply.
void AppendAndCheck(Client& client, const std::string& model, uint64_t id, KvReference& ref,
                    Random& rng, uint32_t l0, uint32_t l1, uint64_t n, bool as_tensors) {
  SCOPED_TRACE(testing::Message() << (as_tensors ? "AppendTensors " : "Append ") << n
                                  << " tokens, layers [" << l0 << ", " << l1 << ")");
  const uint64_t before = ref.layer_length(l0);
  std::vector<uint8_t> payload = ref.Append(l0, l1, n, rng);
  Client::AppendArgs args;
  args.layer_begin = l0;
  args.layer_end = l1;
  args.num_tokens = n;
  absl::StatusOr<Client::SequenceInfo> info;
  if (as_tensors) {
    std::vector<uint8_t> k, v;
    ref.Tensors(l0, l1, before, before + n, &k, &v);
    info = client.AppendTensors(model, id, args, k, v);
  } else {
    info = client.Append(model, id, args, payload);
  }
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->id, id);
  EXPECT_EQ(info->length, ref.length());
  ASSERT_EQ(info->layer_lengths.size(), ref.num_layers());
  uint64_t longest = 0;
  for (uint32_t l = 0; l < ref.num_layers(); ++l) {
    EXPECT_EQ(info->layer_lengths[l], ref.layer_length(l)) << "layer " << l;
    longest = std::max(longest, ref.layer_length(l));
  }
  EXPECT_EQ(info->num_blocks, CeilDiv(longest, ref.block_layout().block_tokens));
}

struct LifecycleCase {
  std::string name;
  ModelLayout layout;  // unused when preset is set
  std::string preset;
  uint64_t seed;
};

class LifecycleTest : public KvbankdTest, public testing::WithParamInterface<LifecycleCase> {};

TEST_P(LifecycleTest, PrefillThenDecodeRoundTripsBitExact) {
  const LifecycleCase& c = GetParam();
  std::cerr << "[lifecycle] model " << c.name << " seed " << c.seed << "\n";
  ASSERT_NO_FATAL_FAILURE(StartServer({"--models=", "--max-pool-bytes=2GiB"}));
  // Separate clients, separate connections: a prefill worker and a decode worker.
  std::unique_ptr<Client> prefill = NewClient();
  std::unique_ptr<Client> decode = NewClient();
  ASSERT_NE(prefill, nullptr);
  ASSERT_NE(decode, nullptr);

  // Registration, and idempotency seen from the other worker.
  absl::StatusOr<Client::ModelInfo> model, again;
  if (!c.preset.empty()) {
    model = prefill->EnsurePreset(c.name, c.preset, DType::kBf16, 256 * kMiB);
    again = decode->EnsurePreset(c.name, c.preset, DType::kBf16, 256 * kMiB);
  } else {
    model = prefill->EnsureModel(c.layout, 64 * kMiB);
    again = decode->EnsureModel(c.layout, 64 * kMiB);
  }
  ASSERT_TRUE(model.ok()) << model.status();
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(model->created);
  EXPECT_FALSE(again->created);
  EXPECT_EQ(again->fingerprint, model->fingerprint);
  EXPECT_EQ(again->num_blocks, model->num_blocks);
  const ModelLayout layout = model->layout;
  EXPECT_EQ(layout.name, c.name);
  if (c.preset.empty()) {
    EXPECT_TRUE(layout == c.layout) << model->fingerprint;
  }
  const uint32_t L = layout.num_layers;
  const uint64_t bt = layout.block_tokens;
  EXPECT_EQ(model->payload_bytes_per_token, ComputeBlockLayout(layout).PayloadBytesPerToken());

  // The same name with another layout is refused, and names the field that differs.
  ModelLayout other = layout;
  other.num_layers += 1;
  other.layer_dtypes.push_back(other.layer_dtypes.back());
  auto clash = decode->EnsureModel(other, 64 * kMiB);
  EXPECT_EQ(clash.status().code(), absl::StatusCode::kAlreadyExists) << clash.status();
  EXPECT_TRUE(absl::StrContains(clash.status().message(), "num_layers")) << clash.status();

  const Client::ModelStats start = StatsOf(*decode, c.name);
  EXPECT_EQ(start.blocks_used, 0u);
  EXPECT_EQ(start.sequences, 0u);
  EXPECT_EQ(start.blocks_total, model->num_blocks);

  auto seq = prefill->CreateSequence(c.name);
  ASSERT_TRUE(seq.ok()) << seq.status();
  EXPECT_EQ(seq->length, 0u);
  EXPECT_GT(seq->lease_ttl, absl::ZeroDuration());
  const uint64_t id = seq->id;
  KvReference ref(layout);
  Random rng(c.seed);
  uint64_t appends = 0;

  // Whole-sequence appends of odd sizes that start and end inside blocks.
  for (uint64_t n : {1, 15, 17, 33}) {
    ASSERT_NO_FATAL_FAILURE(AppendAndCheck(*prefill, c.name, id, ref, rng, 0, L, n, false));
    ++appends;
  }
  // One append of well over 1 MiB: several chunks on the wire, many blocks.
  const uint64_t bpt = model->payload_bytes_per_token;
  const uint64_t big = ((3 * kMiB / 2) / bpt + 1) | 1;
  ASSERT_GT(big * bpt, 1 * kMiB);
  ASSERT_NO_FATAL_FAILURE(AppendAndCheck(*prefill, c.name, id, ref, rng, 0, L, big, false));
  ++appends;
  // The typed path.
  ASSERT_NO_FATAL_FAILURE(AppendAndCheck(*prefill, c.name, id, ref, rng, 0, L, 15, true));
  ++appends;
  // Layer by layer, as a pipelined prefill sends it: the length moves only with the last layer.
  const uint64_t before_layers = ref.length();
  for (uint32_t l = 0; l < L; ++l) {
    ASSERT_NO_FATAL_FAILURE(
        AppendAndCheck(*prefill, c.name, id, ref, rng, l, l + 1, 17, /*as_tensors=*/l % 2 == 1));
    ++appends;
    if (l == 0 && L > 1) {
      // The decode side already sees layer 0's new tokens; the others still stop earlier.
      EXPECT_EQ(ref.length(), before_layers);
      Client::FetchArgs args;
      args.layer_end = 1;
      auto r = decode->Fetch(c.name, id, args);
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(r->num_tokens, before_layers + 17);
      EXPECT_TRUE(BytesEqual(r->payload, ref.Payload(0, 1, 0, before_layers + 17)));
      args.layer_end = L;
      r = decode->Fetch(c.name, id, args);
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(r->num_tokens, before_layers);
    }
  }
  ASSERT_EQ(ref.length(), before_layers + 17);
  if (ref.length() % bt == 0) {  // keep a partial last block for the fork below
    ASSERT_NO_FATAL_FAILURE(AppendAndCheck(*prefill, c.name, id, ref, rng, 0, L, 1, false));
    ++appends;
  }
  const uint64_t len = ref.length();
  std::cerr << "[lifecycle] " << c.name << ": " << len << " tokens, " << len * bpt
            << " payload bytes\n";

  {
    auto got = decode->GetSequence(c.name, id);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->length, len);
    EXPECT_EQ(got->num_blocks, CeilDiv(len, bt));
    const Client::ModelStats st = StatsOf(*decode, c.name);
    EXPECT_EQ(st.blocks_used, CeilDiv(len, bt));
    EXPECT_EQ(st.sequences, 1u);
    EXPECT_EQ(st.tokens_stored, len);
    EXPECT_EQ(st.appends, appends);
  }

  // Decode reads back: everything, then sub-ranges of tokens and layers.
  ASSERT_NO_FATAL_FAILURE(ExpectFetch(*decode, c.name, id, ref, 0, L, 0, len));
  {
    auto whole = decode->Fetch(c.name, id, {});  // defaults: every token of every layer
    ASSERT_TRUE(whole.ok()) << whole.status();
    EXPECT_EQ(whole->num_tokens, len);
    EXPECT_TRUE(BytesEqual(whole->payload, ref.Payload(0, L, 0, len)));
    EXPECT_EQ(whole->payload_bytes, whole->payload.size());

    // Into the caller's buffer: a larger one (sentinel bytes after the payload stay), then one
    // a byte too small.
    const uint64_t bytes = whole->payload.size();
    std::vector<uint8_t> buffer(bytes + 64, 0xa5);
    auto into = decode->FetchInto(c.name, id, {}, absl::MakeSpan(buffer));
    ASSERT_TRUE(into.ok()) << into.status();
    EXPECT_EQ(into->num_tokens, len);
    EXPECT_EQ(into->payload_bytes, bytes);
    EXPECT_TRUE(into->payload.empty());
    EXPECT_TRUE(
        BytesEqual(std::vector<uint8_t>(buffer.begin(), buffer.begin() + bytes), whole->payload));
    EXPECT_EQ(std::count(buffer.begin() + bytes, buffer.end(), 0xa5), 64);
    auto small = decode->FetchInto(c.name, id, {}, absl::MakeSpan(buffer.data(), bytes - 1));
    EXPECT_EQ(small.status().code(), absl::StatusCode::kOutOfRange) << small.status();
    EXPECT_TRUE(absl::StrContains(small.status().message(),
                                  absl::StrCat(bytes, " bytes do not fit the ", bytes - 1)))
        << small.status();
  }
  const uint32_t mid = std::max<uint32_t>(1, L / 2);
  ExpectFetch(*decode, c.name, id, ref, 0, L, 0, 1);
  ExpectFetch(*decode, c.name, id, ref, 0, L, bt - 1, bt + 1);  // straddles a block boundary
  ExpectFetch(*decode, c.name, id, ref, 1, L, 3, len - 2);
  ExpectFetch(*decode, c.name, id, ref, 0, mid, bt, 3 * bt);
  ExpectFetch(*decode, c.name, id, ref, L - 1, L, len - 1, len);
  ExpectFetch(*decode, c.name, id, ref, 0, L, len, len);  // empty range: header only
  ExpectFetchTensors(*decode, c.name, id, ref, 0, L, 0, len);
  ExpectFetchTensors(*decode, c.name, id, ref, mid, L, 5, len - 7);

  // Fork: full blocks are shared, only the partial last block is copied.
  ASSERT_NE(len % bt, 0u);
  const uint64_t used_before_fork = StatsOf(*decode, c.name).blocks_used;
  auto fork = decode->Fork(c.name, id);
  ASSERT_TRUE(fork.ok()) << fork.status();
  EXPECT_NE(fork->id, id);
  EXPECT_EQ(fork->length, len);
  EXPECT_EQ(fork->num_blocks, CeilDiv(len, bt));
  EXPECT_EQ(StatsOf(*decode, c.name).blocks_used, used_before_fork + 1);
  KvReference fork_ref = ref;
  ExpectFetch(*decode, c.name, fork->id, fork_ref, 0, L, 0, len);

  // The fork diverges; the parent does not see it.
  ASSERT_NO_FATAL_FAILURE(AppendAndCheck(*decode, c.name, fork->id, fork_ref, rng, 0, L, 7, false));
  ExpectFetch(*decode, c.name, id, ref, 0, L, 0, len);

  // Truncate the parent into a block it shares with the fork, then append after the cut: the
  // write must go to a private copy (copy on write), the fork keeps its bytes.
  const uint64_t cut = (len / bt - 1) * bt + 3;
  ASSERT_LT(cut, len);
  auto truncated = prefill->Truncate(c.name, id, cut);
  ASSERT_TRUE(truncated.ok()) << truncated.status();
  EXPECT_EQ(truncated->length, cut);
  EXPECT_EQ(truncated->num_blocks, CeilDiv(cut, bt));
  for (uint64_t l : truncated->layer_lengths) EXPECT_EQ(l, cut);
  ref.Truncate(cut);
  ExpectFetch(*decode, c.name, id, ref, 0, L, 0, cut);
  ASSERT_NO_FATAL_FAILURE(AppendAndCheck(*prefill, c.name, id, ref, rng, 0, L, 20, false));
  ExpectFetch(*decode, c.name, id, ref, 0, L, 0, ref.length());
  ExpectFetch(*decode, c.name, fork->id, fork_ref, 0, L, 0, fork_ref.length());

  // A fork at a block boundary shares everything: no block is added.
  const uint64_t aligned = (ref.length() / bt) * bt;
  ASSERT_TRUE(prefill->Truncate(c.name, id, aligned).ok());
  ref.Truncate(aligned);
  const uint64_t used_aligned = StatsOf(*decode, c.name).blocks_used;
  auto fork2 = decode->Fork(c.name, id);
  ASSERT_TRUE(fork2.ok()) << fork2.status();
  EXPECT_EQ(StatsOf(*decode, c.name).blocks_used, used_aligned);
  ExpectFetch(*decode, c.name, fork2->id, ref, 0, L, 0, aligned);

  // Free everything: the pool is back where it started.
  for (uint64_t s : {id, fork->id, fork2->id}) {
    auto info = decode->GetSequence(c.name, s);
    ASSERT_TRUE(info.ok()) << info.status();
    auto released = decode->Free(c.name, s);
    ASSERT_TRUE(released.ok()) << released.status();
    EXPECT_EQ(*released, info->num_blocks);
  }
  const Client::ModelStats end = StatsOf(*decode, c.name);
  EXPECT_EQ(end.blocks_used, start.blocks_used);
  EXPECT_EQ(end.blocks_free, start.blocks_free);
  EXPECT_EQ(end.sequences, 0u);
  EXPECT_EQ(end.tokens_stored, 0u);
  auto gone = prefill->GetSequence(c.name, id);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kFailedPrecondition) << gone.status();
  EXPECT_TRUE(absl::StrContains(gone.status().message(), "freed")) << gone.status();
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, LifecycleTest,
    testing::Values(LifecycleCase{"gqa_fp16", SmallGqa("gqa_fp16", DType::kFp16), "", 1001},
                    LifecycleCase{"gqa_bf16", SmallGqa("gqa_bf16", DType::kBf16), "", 1002},
                    LifecycleCase{"gqa_fp32", SmallGqa("gqa_fp32", DType::kFp32), "", 1003},
                    LifecycleCase{"mla_fp16", SmallMla("mla_fp16"), "", 1004},
                    LifecycleCase{"llama8b", ModelLayout(), "llama-3.1-8b", 1005}),
    [](const testing::TestParamInfo<LifecycleCase>& info) { return info.param.name; });

class ServerTest : public KvbankdTest {};

TEST_F(ServerTest, RegistersTheDefaultPresetAtStart) {
  ASSERT_NO_FATAL_FAILURE(StartServer({}));
  auto client = NewClient();
  auto models = client->ListModels();
  ASSERT_TRUE(models.ok()) << models.status();
  ASSERT_EQ(models->size(), 1u);
  EXPECT_EQ((*models)[0].layout.name, "llama-3.1-8b");
  EXPECT_EQ((*models)[0].layout.num_layers, 32u);
  EXPECT_EQ((*models)[0].layout.num_kv_heads, 8u);
  // --device auto: a GPU where there is one, else host memory; the suite's own device if set.
  const std::string device = (*models)[0].device;
  if (const char* want = std::getenv("KVBANK_TEST_DEVICE"); want != nullptr && *want) {
    EXPECT_EQ(device, want);
  } else {
    EXPECT_TRUE(device == "host" || device.rfind("cuda:", 0) == 0) << device;
  }
  // Usable right away.
  auto seq = client->CreateSequence("llama-3.1-8b");
  ASSERT_TRUE(seq.ok()) << seq.status();
  EXPECT_TRUE(client->Free("llama-3.1-8b", seq->id).ok());
}

TEST_F(ServerTest, EmptyModelsFlagRegistersNothing) {
  ASSERT_NO_FATAL_FAILURE(StartServer({"--models="}));
  auto client = NewClient();
  auto models = client->ListModels();
  ASSERT_TRUE(models.ok()) << models.status();
  EXPECT_TRUE(models->empty());
  auto stats = client->GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_TRUE(stats->empty());
}

// --config registers its models after the --models presets, each with its own settings; a file
// that is missing or not a ServerConfig stops the server at start, naming the file.
TEST_F(ServerTest, ConfigFileRegistersItsModelsAtStart) {
  char path[] = "/tmp/kvbank-config-XXXXXX";
  const int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  close(fd);
  std::ofstream(path) << "models { name: \"small\" num_layers: 2 num_q_heads: 4 num_kv_heads: 2\n"
                      << "         head_dim: 32 storage_dtype: DTYPE_INT8 input_dtype: DTYPE_FP16\n"
                      << "         pool_bytes: 8388608 }\n"
                      << "models { name: \"eight-b\" preset: \"llama-3.1-8b\" }\n";
  ASSERT_NO_FATAL_FAILURE(
      StartServer({"--models=qwen2.5-7b", "--pool-bytes=64MiB", "--config=" + std::string(path)}));
  auto client = NewClient();
  auto models = client->ListModels();
  ASSERT_TRUE(models.ok()) << models.status();
  std::vector<std::string> names;
  for (const auto& m : *models) names.push_back(m.layout.name);
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"eight-b", "qwen2.5-7b", "small"}));
  for (const auto& m : *models) {
    if (m.layout.name != "small") continue;
    EXPECT_EQ(m.pool_bytes, m.num_blocks * m.block_bytes);  // 8 MiB in whole blocks
    EXPECT_LE(m.pool_bytes, 8u * kMiB);
    EXPECT_GT(m.pool_bytes + m.block_bytes, 8u * kMiB);
    EXPECT_EQ(m.layout.head_dim, 32u);
    EXPECT_EQ(m.layout.layer_dtypes, std::vector<DType>(2, DType::kInt8));
  }
  std::remove(path);

  auto missing = ServerProcess::Start({"--no-auth", "--config=" + std::string(path)});
  ASSERT_FALSE(missing.ok()) << "a missing --config file started a server";
  EXPECT_TRUE(absl::StrContains(missing.status().message(), "--config: cannot read"))
      << missing.status();
  std::ofstream(path) << "models { no_such_field: 1 }\n";
  auto garbled = ServerProcess::Start({"--no-auth", "--config=" + std::string(path)});
  ASSERT_FALSE(garbled.ok()) << "a garbled --config file started a server";
  EXPECT_TRUE(absl::StrContains(garbled.status().message(), "not a valid ServerConfig"))
      << garbled.status();
  std::remove(path);
}

// A --device that names nothing usable stops the server at start with a message saying why.
TEST_F(ServerTest, UnusableDeviceIsRefusedAtStart) {
  struct Case {
    const char* flag;
    const char* says;
  };
  const Case kCases[] = {
      {"--device=tpu", "expected auto, host (or cpu), cuda, cuda:N or host-staged"},
      {"--device=cuda:x", "bad CUDA device number"},
      {"--device=cuda:4096", "cuda:4096"},  // no such device (or no CUDA in this build)
      {"--staging-bytes=0", "--staging-bytes must be"},
      {"--staging-bytes=lots", "--staging-bytes must be"},
      {"--shm-lone-copy-bytes=lots", "--shm-lone-copy-bytes must be"},
  };
  for (const Case& c : kCases) {
    auto server = ServerProcess::Start({"--no-auth", c.flag}, absl::Seconds(10));
    ASSERT_FALSE(server.ok()) << c.flag << " started a server";
    EXPECT_TRUE(absl::StrContains(server.status().message(), c.says))
        << c.flag << ": " << server.status();
  }
  // Checked whatever memory the pools would go to.
  auto bad_util = ServerProcess::Start({"--no-auth", "--gpu-memory-utilization=1.5"});
  ASSERT_FALSE(bad_util.ok()) << "--gpu-memory-utilization=1.5 started a server";
  EXPECT_TRUE(absl::StrContains(bad_util.status().message(), "--gpu-memory-utilization must be"))
      << bad_util.status();
}

class LeaseTest : public KvbankdTest {};

TEST_F(LeaseTest, UnrenewedSequenceExpiresAndReturnsItsBlocks) {
  ASSERT_NO_FATAL_FAILURE(
      StartServer({"--models=", "--default-lease-ms=300", "--lease-check-ms=50"}));
  auto client = NewClient();
  const ModelLayout layout = SmallGqa("leased", DType::kFp16);
  ASSERT_TRUE(client->EnsureModel(layout, 16 * kMiB).ok());
  auto seq = client->CreateSequence("leased");
  ASSERT_TRUE(seq.ok()) << seq.status();
  EXPECT_EQ(seq->lease_ttl, absl::Milliseconds(300));
  KvReference ref(layout);
  Random rng(2001);
  ASSERT_NO_FATAL_FAILURE(AppendAndCheck(*client, "leased", seq->id, ref, rng, 0, 4, 20, false));
  EXPECT_EQ(StatsOf(*client, "leased").blocks_used, 2u);

  // The reaper frees it without anyone touching it (stats do not renew a lease): waited for,
  // with a deadline far past the 300 ms lease.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  Client::ModelStats st = StatsOf(*client, "leased");
  while (st.sequences != 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
    st = StatsOf(*client, "leased");
  }
  EXPECT_EQ(st.blocks_used, 0u);
  EXPECT_EQ(st.sequences, 0u);
  EXPECT_GE(st.leases_expired, 1u);
  auto got = client->GetSequence("leased", seq->id);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kFailedPrecondition) << got.status();
  EXPECT_TRUE(absl::StrContains(got.status().message(), "lease")) << got.status();
  auto fetched = client->Fetch("leased", seq->id, {});
  EXPECT_EQ(fetched.status().code(), absl::StatusCode::kFailedPrecondition) << fetched.status();
}

TEST_F(LeaseTest, RenewLeaseKeepsASequencePastItsTtl) {
  ASSERT_NO_FATAL_FAILURE(
      StartServer({"--models=", "--default-lease-ms=1500", "--lease-check-ms=50"}));
  auto client = NewClient();
  const ModelLayout layout = SmallGqa("renewed", DType::kBf16);
  ASSERT_TRUE(client->EnsureModel(layout, 16 * kMiB).ok());
  auto kept = client->CreateSequence("renewed");
  auto dropped = client->CreateSequence("renewed");
  ASSERT_TRUE(kept.ok() && dropped.ok());
  KvReference ref(layout);
  Random rng(2002);
  ASSERT_NO_FATAL_FAILURE(AppendAndCheck(*client, "renewed", kept->id, ref, rng, 0, 4, 5, false));

  // Renewed every 100 ms until the other one, never renewed, has expired (at least two and a
  // half TTLs; waited for in the stats, which renew nothing, with a deadline): the renewed one
  // is still there.
  const absl::Time start = absl::Now();
  while (absl::Now() - start < absl::Milliseconds(3750) ||
         (StatsOf(*client, "renewed").sequences > 1 && absl::Now() - start < absl::Seconds(30))) {
    absl::SleepFor(absl::Milliseconds(100));
    auto renewed = client->RenewLease("renewed", kept->id);
    ASSERT_TRUE(renewed.ok()) << renewed.status() << " after " << MsSince(start) << " ms";
    EXPECT_EQ(renewed->lease_ttl, absl::Milliseconds(1500));
  }
  auto got = client->GetSequence("renewed", kept->id);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->length, 5u);
  ExpectFetch(*client, "renewed", kept->id, ref, 0, 4, 0, 5);
  auto gone = client->GetSequence("renewed", dropped->id);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kFailedPrecondition) << gone.status();
  EXPECT_TRUE(absl::StrContains(gone.status().message(), "lease")) << gone.status();

  // Left alone, it goes too (waited for, with a deadline).
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  Client::ModelStats st = StatsOf(*client, "renewed");
  while (st.sequences != 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
    st = StatsOf(*client, "renewed");
  }
  EXPECT_EQ(st.sequences, 0u);
  EXPECT_EQ(st.blocks_used, 0u);
  EXPECT_EQ(st.leases_expired, 2u);
}

class DrainTest : public KvbankdTest {
 protected:
  // A server with that pool size and drain timeout, model "drain" (small GQA, fp16) on it, and
  // `setup`, the client that registered it.
  Client::ModelInfo StartWithModel(const std::string& pool_bytes, int drain_timeout_ms,
                                   std::unique_ptr<Client>* setup) {
    StartServer({"--models=", "--pool-bytes=" + pool_bytes, "--max-pool-bytes=1GiB",
                 "--drain-timeout-ms=" + std::to_string(drain_timeout_ms)});
    if (HasFatalFailure()) return {};
    *setup = NewClient();
    auto model = (*setup)->EnsureModel(SmallGqa("drain", DType::kFp16));  // pool: --pool-bytes
    EXPECT_TRUE(model.ok()) << model.status();
    return model.ok() ? *model : Client::ModelInfo{};
  }
  // The generated stub on a connection of its own: for calls the SDK only makes whole.
  std::unique_ptr<v1::KvBank::Stub> RawStub() {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetMaxReceiveMessageSize(64 << 20);
    return v1::KvBank::NewStub(
        grpc::CreateCustomChannel(server_->target(), grpc::InsecureChannelCredentials(), args));
  }
};

TEST_F(DrainTest, SigtermLetsCallsInFlightFinishThenExitsZero) {
  std::unique_ptr<Client> setup;
  const Client::ModelInfo model = StartWithModel("512MiB", 60000, &setup);
  ASSERT_FALSE(HasFailure());
  EXPECT_EQ(model.pool_bytes, 512 * kMiB);
  // 200 MiB and an odd tail, one whole-sequence payload each.
  const uint64_t n = 200 * kMiB / model.payload_bytes_per_token + 17;
  const uint64_t bytes = n * model.payload_bytes_per_token;
  const uint64_t seed_fetched = 3001, seed_appended = 3002;
  std::cerr << "[drain] " << n << " tokens = " << bytes << " bytes per payload, seeds "
            << seed_fetched << ", " << seed_appended << "\n";
  std::vector<uint8_t> stored = Random(seed_fetched).Bytes(bytes);
  std::vector<uint8_t> incoming = Random(seed_appended).Bytes(bytes);

  auto f = setup->CreateSequence("drain", absl::ZeroDuration());
  auto g = setup->CreateSequence("drain", absl::ZeroDuration());
  ASSERT_TRUE(f.ok() && g.ok());
  Client::AppendArgs args;
  args.num_tokens = n;
  absl::Time t = absl::Now();
  ASSERT_TRUE(setup->Append("drain", f->id, args, stored).ok());
  std::cerr << "[drain] stored " << bytes << " bytes in " << MsSince(t) << " ms\n";
  const Client::ModelStats before = StatsOf(*setup, "drain");
  ASSERT_EQ(before.fetches, 0u);

  // A fetch and an append, each on its own connection, both in flight when SIGTERM comes.
  auto reader = NewClient();
  auto writer = NewClient();
  std::atomic<bool> fetch_done{false}, append_done{false};
  absl::StatusOr<Client::FetchResult> fetched = absl::UnknownError("not run");
  absl::StatusOr<Client::SequenceInfo> appended = absl::UnknownError("not run");
  // The fetch counts when it starts; the append takes its blocks when its header arrives. The
  // append starts once the fetch has (the fetch streams for longer), so that neither is over
  // before the other began, however slow the machine.
  auto started = [&](auto done) {
    const absl::Time t0 = absl::Now();
    while (absl::Now() - t0 < absl::Seconds(30)) {
      if (done(StatsOf(*setup, "drain"))) return true;
      absl::SleepFor(absl::Milliseconds(1));
    }
    return false;
  };
  std::thread fetch_thread([&] {
    fetched = reader->Fetch("drain", f->id, {});
    fetch_done = true;
  });
  bool both_started = started([](const Client::ModelStats& st) { return st.fetches >= 1; });
  std::thread append_thread([&] {
    appended = writer->Append("drain", g->id, args, incoming);
    append_done = true;
  });
  both_started = both_started && started([&](const Client::ModelStats& st) {
                   return st.blocks_used > before.blocks_used;
                 });
  const bool fetch_in_flight = !fetch_done, append_in_flight = !append_done;
  server_->SendSignal(SIGTERM);
  const absl::Time signalled = absl::Now();
  fetch_thread.join();
  append_thread.join();
  std::cerr << "[drain] calls finished " << MsSince(signalled) << " ms after SIGTERM\n";
  EXPECT_TRUE(both_started);
  EXPECT_TRUE(fetch_in_flight) << "the fetch ended before SIGTERM: nothing was drained";
  EXPECT_TRUE(append_in_flight) << "the append ended before SIGTERM: nothing was drained";

  ASSERT_TRUE(fetched.ok()) << fetched.status();
  EXPECT_EQ(fetched->num_tokens, n);
  EXPECT_TRUE(BytesEqual(fetched->payload, stored));
  ASSERT_TRUE(appended.ok()) << appended.status();
  EXPECT_EQ(appended->id, g->id);
  EXPECT_EQ(appended->length, n);

  absl::Status exit = server_->WaitForExit(absl::Seconds(90));
  EXPECT_TRUE(exit.ok()) << exit;
  EXPECT_TRUE(absl::StrContains(server_->Log(), "draining")) << server_->Log();

  // Nothing answers any more: neither the old connections nor a new one.
  ClientOptions quick;
  quick.call_deadline = absl::Seconds(5);
  auto fresh = Client::Connect(server_->target(), quick);
  ASSERT_TRUE(fresh.ok());
  for (Client* c : {setup.get(), reader.get(), fresh->get()}) {
    auto st = c->GetStats("drain");
    EXPECT_EQ(st.status().code(), absl::StatusCode::kUnavailable) << st.status();
  }
  auto seq = writer->GetSequence("drain", g->id);
  EXPECT_EQ(seq.status().code(), absl::StatusCode::kUnavailable) << seq.status();
}

// While a call is in flight, a stopping server refuses every new call with UNAVAILABLE naming the
// drain and ends Watch streams at once; the call in flight still completes and is kept. The
// append here is held open by the test, so each step happens at a known point of the drain.
TEST_F(DrainTest, NewCallsAreRefusedAndWatchesEndWhileAnAppendIsInFlight) {
  std::unique_ptr<Client> setup;
  const Client::ModelInfo model = StartWithModel("64MiB", 60000, &setup);
  ASSERT_FALSE(HasFailure());
  auto seq = setup->CreateSequence("drain", absl::ZeroDuration());
  ASSERT_TRUE(seq.ok()) << seq.status();
  const Client::ModelStats before = StatsOf(*setup, "drain");

  // A Watch stream, live once its first batch is in.
  std::atomic<bool> watching{false};
  absl::Status watch_status = absl::UnknownError("not run");
  auto watcher = NewClient();
  std::thread watch_thread([&] {
    watch_status = watcher->Watch("drain", 0, false, absl::Seconds(60),
                                  [&](const std::vector<Client::Event>&, uint64_t) {
                                    watching = true;
                                    return true;
                                  });
  });

  // An append of 40 tokens, through the raw stub: header and half the payload, then held.
  const uint64_t tokens = 40, bytes = tokens * model.payload_bytes_per_token;
  auto stub = RawStub();
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  v1::AppendResponse resp;
  auto writer = stub->Append(&ctx, &resp);
  v1::AppendRequest first;
  first.mutable_header()->set_model("drain");
  first.mutable_header()->set_sequence_id(seq->id);
  first.mutable_header()->set_num_tokens(tokens);
  first.mutable_header()->set_payload_bytes(bytes);
  first.set_data(std::string(bytes / 2, '\0'));
  ASSERT_TRUE(writer->Write(first));

  // Both in flight: the watch has its first batch, the append has taken its blocks.
  absl::Time t = absl::Now();
  while (absl::Now() - t < absl::Seconds(30) &&
         !(watching && StatsOf(*setup, "drain").blocks_used > before.blocks_used)) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_TRUE(watching);
  ASSERT_GT(StatsOf(*setup, "drain").blocks_used, before.blocks_used);

  server_->SendSignal(SIGTERM);
  t = absl::Now();
  watch_thread.join();
  std::cerr << "[drain] the watch ended " << absl::ToInt64Milliseconds(absl::Now() - t)
            << " ms after SIGTERM\n";
  EXPECT_EQ(watch_status.code(), absl::StatusCode::kUnavailable) << watch_status;
  EXPECT_TRUE(absl::StrContains(watch_status.message(), "draining")) << watch_status;

  // The server is still up (the append holds it): a new call, on an old or a new connection,
  // is refused by name.
  auto fresh = NewClient();
  for (Client* c : {setup.get(), fresh.get()}) {
    auto st = c->GetStats("drain");
    EXPECT_EQ(st.status().code(), absl::StatusCode::kUnavailable) << st.status();
    EXPECT_TRUE(absl::StrContains(st.status().message(), "draining")) << st.status();
  }

  // The rest of the payload: the append commits, and the server exits 0 once it is answered.
  v1::AppendRequest rest;
  rest.set_data(std::string(bytes - bytes / 2, '\0'));
  ASSERT_TRUE(writer->Write(rest));
  writer->WritesDone();
  grpc::Status appended = writer->Finish();
  ASSERT_TRUE(appended.ok()) << appended.error_message();
  EXPECT_EQ(resp.sequence().sequence_id(), seq->id);
  EXPECT_EQ(resp.sequence().length(), tokens);
  absl::Status exit = server_->WaitForExit(absl::Seconds(30));
  EXPECT_TRUE(exit.ok()) << exit;
}

// A client that reads slowly still gets all of a fetch that finished during the drain: its last
// megabytes sit unread in its socket buffer when the server has nothing left in flight, and
// closing the connection then would reset it and drop them (UNAVAILABLE for a call that succeeded).
TEST_F(DrainTest, ASlowReaderGetsAllOfAFetchThatEndsDuringTheDrain) {
  std::unique_ptr<Client> setup;
  const Client::ModelInfo model = StartWithModel("256MiB", 60000, &setup);
  ASSERT_FALSE(HasFailure());
  const uint64_t n = 48 * kMiB / model.payload_bytes_per_token;
  const std::vector<uint8_t> stored = Random(3201).Bytes(n * model.payload_bytes_per_token);
  auto seq = setup->CreateSequence("drain", absl::ZeroDuration());
  ASSERT_TRUE(seq.ok()) << seq.status();
  Client::AppendArgs args;
  args.num_tokens = n;
  ASSERT_TRUE(setup->Append("drain", seq->id, args, stored).ok());

  auto stub = RawStub();
  grpc::ClientContext ctx;
  v1::FetchRequest req;
  req.set_model("drain");
  req.set_sequence_id(seq->id);
  auto reader = stub->Fetch(&ctx, req);
  v1::FetchResponse msg;
  ASSERT_TRUE(reader->Read(&msg));
  ASSERT_TRUE(msg.has_header());
  server_->SendSignal(SIGTERM);
  // A consumer that works on each 1 MiB message for a while before it reads the next one.
  std::string got = msg.data();
  while (reader->Read(&msg)) {
    got += msg.data();
    absl::SleepFor(absl::Milliseconds(40));
  }
  grpc::Status finished = reader->Finish();
  ASSERT_TRUE(finished.ok()) << finished.error_code() << ": " << finished.error_message() << "\n"
                             << server_->Log();
  ASSERT_EQ(got.size(), stored.size());
  EXPECT_EQ(std::memcmp(got.data(), stored.data(), stored.size()), 0);
  absl::Status exit = server_->WaitForExit(absl::Seconds(30));
  EXPECT_TRUE(exit.ok()) << exit;
  EXPECT_TRUE(absl::StrContains(server_->Log(), "drained in")) << server_->Log();
}

// A client that stops reading cannot hold a stopping server: at --drain-timeout-ms the server
// cancels what is left, says so, and exits 0.
TEST_F(DrainTest, AStalledReaderIsCutOffAtTheDrainTimeout) {
  std::unique_ptr<Client> setup;
  const Client::ModelInfo model = StartWithModel("256MiB", 1000, &setup);
  ASSERT_FALSE(HasFailure());
  // 64 MiB: far more than the socket buffers and flow-control windows hold.
  const uint64_t n = 64 * kMiB / model.payload_bytes_per_token;
  auto seq = setup->CreateSequence("drain", absl::ZeroDuration());
  ASSERT_TRUE(seq.ok()) << seq.status();
  Client::AppendArgs args;
  args.num_tokens = n;
  ASSERT_TRUE(
      setup->Append("drain", seq->id, args, Random(3101).Bytes(n * model.payload_bytes_per_token))
          .ok());

  // A fetch whose client reads the first message and then nothing.
  auto stub = RawStub();
  grpc::ClientContext ctx;
  v1::FetchRequest req;
  req.set_model("drain");
  req.set_sequence_id(seq->id);
  auto reader = stub->Fetch(&ctx, req);
  v1::FetchResponse first;
  ASSERT_TRUE(reader->Read(&first));
  ASSERT_TRUE(first.has_header());
  ASSERT_EQ(first.header().num_tokens(), n);

  server_->SendSignal(SIGTERM);
  const absl::Time signalled = absl::Now();
  absl::Status exit = server_->WaitForExit(absl::Seconds(30));
  const absl::Duration took = absl::Now() - signalled;
  std::cerr << "[drain] a stalled reader: exited " << absl::ToInt64Milliseconds(took)
            << " ms after SIGTERM\n";
  EXPECT_TRUE(exit.ok()) << exit;
  EXPECT_GE(took, absl::Milliseconds(900)) << "did not wait for the fetch in flight";
  EXPECT_LT(took, absl::Seconds(20));
  EXPECT_TRUE(absl::StrContains(server_->Log(), "drain timed out")) << server_->Log();
  ctx.TryCancel();
}

}  // namespace
}  // namespace kvbank::integ
