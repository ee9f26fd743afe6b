// Bad input through the real RPC: every case must get the exact gRPC status code, a message that
// names the field or the problem, change no state at all, and leave the server serving.
// Raw-protocol cases use the generated stub directly, past the client SDK's own checks.
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kvbank/client.h"
#include "kvbank/v1/kvbank.grpc.pb.h"
#include "tests/integration/kv_reference.h"
#include "tests/integration/server_fixture.h"

namespace kvbank::integ {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kMaxTokens = 4096;  // --max-tokens-per-sequence
constexpr uint64_t kTwoTo63 = uint64_t{1} << 63;
// Sequence ids are below 2^53, so this one never names a sequence.
constexpr uint64_t kUnknownId = (uint64_t{1} << 53) + 7;

ModelLayout Fp16Layout(const std::string& name) {
  ModelLayout m;
  m.name = name;
  m.num_layers = 4;
  m.num_q_heads = 8;
  m.num_kv_heads = 2;
  m.head_dim = 64;
  m.head_dim_v = 64;
  m.block_tokens = 16;
  m.kind = AttentionKind::kGqa;
  m.input_dtype = DType::kFp16;
  m.layer_dtypes.assign(m.num_layers, DType::kFp16);
  return m;
}

// A call's outcome in one shape, whether it came through the SDK or the raw stub.
struct Outcome {
  grpc::StatusCode code = grpc::StatusCode::UNKNOWN;
  std::string message;
};
Outcome Of(const grpc::Status& s) { return {s.error_code(), s.error_message()}; }
Outcome Of(const absl::Status& s) {
  return {static_cast<grpc::StatusCode>(s.code()), std::string(s.message())};
}
template <typename T>
Outcome Of(const absl::StatusOr<T>& s) {
  return Of(s.status());
}

// The code's name (grpc::StatusCode and absl::StatusCode share their numbering).
std::string CodeName(grpc::StatusCode c) {
  return absl::StatusCodeToString(static_cast<absl::StatusCode>(c));
}

// The generated stub on its own channel. It sends messages up to 64 MiB, so oversized ones reach
// the server and are refused there, not here.
class RawStub {
 public:
  explicit RawStub(const std::string& target) {
    grpc::ChannelArguments args;
    args.SetMaxSendMessageSize(64 << 20);
    args.SetMaxReceiveMessageSize(64 << 20);
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    stub_ = v1::KvBank::NewStub(
        grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args));
  }
  v1::KvBank::Stub& operator*() { return *stub_; }
  v1::KvBank::Stub* operator->() { return stub_.get(); }

  static void Deadline(grpc::ClientContext* ctx) {
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  }

  // One append call: the messages in order, then half-close.
  grpc::Status Append(const std::vector<v1::AppendRequest>& messages) {
    grpc::ClientContext ctx;
    Deadline(&ctx);
    v1::AppendResponse resp;
    auto writer = stub_->Append(&ctx, &resp);
    for (const v1::AppendRequest& m : messages) {
      if (!writer->Write(m)) break;  // the server ended the call; Finish says why
    }
    writer->WritesDone();
    return writer->Finish();
  }
  grpc::Status Fetch(const v1::FetchRequest& req) {
    grpc::ClientContext ctx;
    Deadline(&ctx);
    auto reader = stub_->Fetch(&ctx, req);
    v1::FetchResponse resp;
    while (reader->Read(&resp)) {
    }
    return reader->Finish();
  }
  grpc::Status EnsureModel(const v1::ModelSpec& spec) {
    grpc::ClientContext ctx;
    Deadline(&ctx);
    v1::EnsureModelRequest req;
    *req.mutable_spec() = spec;
    v1::EnsureModelResponse resp;
    return stub_->EnsureModel(&ctx, req, &resp);
  }
  grpc::Status CreateSequence(const v1::CreateSequenceRequest& req) {
    grpc::ClientContext ctx;
    Deadline(&ctx);
    v1::SequenceInfo resp;
    return stub_->CreateSequence(&ctx, req, &resp);
  }
  grpc::Status Fork(const v1::ForkRequest& req) {
    grpc::ClientContext ctx;
    Deadline(&ctx);
    v1::SequenceInfo resp;
    return stub_->Fork(&ctx, req, &resp);
  }

 private:
  std::unique_ptr<v1::KvBank::Stub> stub_;
};

v1::AppendRequest Header(const std::string& model, uint64_t id, uint64_t num_tokens,
                         uint64_t data_bytes = 0, uint64_t payload_bytes = 0) {
  v1::AppendRequest r;
  v1::AppendHeader* h = r.mutable_header();
  h->set_model(model);
  h->set_sequence_id(id);
  h->set_num_tokens(num_tokens);
  h->set_payload_bytes(payload_bytes);
  r.set_data(std::string(data_bytes, '\x5a'));
  return r;
}
v1::AppendRequest Data(uint64_t bytes) {
  v1::AppendRequest r;
  r.set_data(std::string(bytes, '\x33'));
  return r;
}

v1::ModelSpec Spec(const std::string& name, uint32_t layers, uint32_t q_heads, uint32_t kv_heads,
                   uint32_t head_dim, v1::DType storage = v1::DTYPE_FP16) {
  v1::ModelSpec s;
  s.set_name(name);
  s.set_num_layers(layers);
  s.set_num_q_heads(q_heads);
  s.set_num_kv_heads(kv_heads);
  s.set_head_dim(head_dim);
  s.set_storage_dtype(storage);
  s.set_pool_bytes(1 * kMiB);
  return s;
}

// Everything a bad call could disturb, read through the SDK.
struct Snapshot {
  std::vector<std::string> lines;  // one fact per line, so a difference reads well

  bool operator==(const Snapshot& o) const { return lines == o.lines; }
  std::string Diff(const Snapshot& o) const {
    std::string out;
    for (size_t i = 0; i < std::max(lines.size(), o.lines.size()); ++i) {
      const std::string a = i < lines.size() ? lines[i] : "(none)";
      const std::string b = i < o.lines.size() ? o.lines[i] : "(none)";
      if (a != b) absl::StrAppend(&out, "  before: ", a, "\n  after:  ", b, "\n");
    }
    return out;
  }
};

struct SeqRef {
  std::string model;
  uint64_t id;
};

Snapshot TakeSnapshot(Client& client, const std::vector<SeqRef>& seqs) {
  Snapshot s;
  auto models = client.ListModels();
  if (!models.ok()) {
    s.lines.push_back(absl::StrCat("ListModels failed: ", models.status().ToString()));
    return s;
  }
  for (const auto& m : *models) {
    s.lines.push_back(
        absl::StrCat("model ", m.layout.name, " ", m.fingerprint, " blocks ", m.num_blocks));
  }
  auto stats = client.GetStats();
  if (!stats.ok()) {
    s.lines.push_back(absl::StrCat("GetStats failed: ", stats.status().ToString()));
    return s;
  }
  // Fetch counters are left out: the snapshot itself fetches.
  for (const auto& m : *stats) {
    s.lines.push_back(absl::StrCat(
        "stats ", m.model, ": used ", m.blocks_used, " free ", m.blocks_free, " total ",
        m.blocks_total, " sequences ", m.sequences, " tokens ", m.tokens_stored, " appends ",
        m.appends, " bytes_appended ", m.bytes_appended, " leases_expired ", m.leases_expired));
  }
  for (const SeqRef& r : seqs) {
    auto info = client.GetSequence(r.model, r.id);
    if (!info.ok()) {
      s.lines.push_back(absl::StrCat("seq ", r.id, ": ", info.status().ToString()));
      continue;
    }
    s.lines.push_back(absl::StrCat("seq ", r.id, ": length ", info->length, " layers [",
                                   absl::StrJoin(info->layer_lengths, ","), "] blocks ",
                                   info->num_blocks, " lease ",
                                   absl::FormatDuration(info->lease_ttl)));
    Client::FetchArgs args;
    args.layer_end = 1;  // layer 0 holds the most tokens in every sequence here
    auto data = client.Fetch(r.model, r.id, args);
    if (!data.ok()) {
      s.lines.push_back(absl::StrCat("seq ", r.id, " fetch: ", data.status().ToString()));
      continue;
    }
    // A cheap digest: every byte counts, position-dependent.
    uint64_t h = 1469598103934665603ull;
    for (uint8_t b : data->payload) h = (h ^ b) * 1099511628211ull;
    s.lines.push_back(absl::StrCat("seq ", r.id, " layer 0: ", data->num_tokens, " tokens, ",
                                   data->payload.size(), " bytes, fnv ", h));
  }
  return s;
}

class BadInputTest : public KvbankdTest {
 protected:
  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(StartServer({"--models=", "--max-pool-bytes=1GiB",
                                         absl::StrCat("--max-tokens-per-sequence=", kMaxTokens),
                                         "--lease-check-ms=50", "--drain-timeout-ms=2000"}));
    client_ = NewClient();
    ASSERT_NE(client_, nullptr);
    raw_ = std::make_unique<RawStub>(server_->target());
    Random rng(4001);
    std::cerr << "[bad input] seed 4001\n";

    // "m": 64 blocks of 16 tokens. "tiny": 4 blocks, filled up by sequence P.
    auto m = client_->EnsureModel(Fp16Layout("m"), 64 * 32 * 1024);
    ASSERT_TRUE(m.ok()) << m.status();
    ASSERT_EQ(m->num_blocks, 64u);
    bpt_ = m->payload_bytes_per_token;
    auto tiny = client_->EnsureModel(Fp16Layout("tiny"), 4 * 32 * 1024);
    ASSERT_TRUE(tiny.ok()) << tiny.status();
    ASSERT_EQ(tiny->num_blocks, 4u);

    // A: 21 tokens with token ids. B: only layer 0 has 5 tokens.
    KvReference ref_a(m->layout), ref_b(m->layout), ref_p(tiny->layout);
    a_ = MakeSeq("m");
    Client::AppendArgs args;
    args.num_tokens = 21;
    for (uint32_t t = 0; t < 21; ++t) args.token_ids.push_back(100 + t);
    ASSERT_TRUE(client_->Append("m", a_, args, ref_a.Append(0, 4, 21, rng)).ok());
    b_ = MakeSeq("m");
    args = {};
    args.layer_end = 1;
    args.num_tokens = 5;
    ASSERT_TRUE(client_->Append("m", b_, args, ref_b.Append(0, 1, 5, rng)).ok());
    // F: freed. E: its 1 ms lease runs out and the reaper takes it.
    f_ = MakeSeq("m");
    ASSERT_TRUE(client_->Free("m", f_).ok());
    auto e = client_->CreateSequence("m", absl::Milliseconds(1));
    ASSERT_TRUE(e.ok()) << e.status();
    e_ = e->id;
    // P fills the tiny pool (56 tokens: 3 full blocks and a partial one); Q is empty.
    p_ = MakeSeq("tiny");
    args = {};
    args.num_tokens = 56;
    ASSERT_TRUE(client_->Append("tiny", p_, args, ref_p.Append(0, 4, 56, rng)).ok());
    q_ = MakeSeq("tiny");
    const absl::Time start = absl::Now();
    while (absl::Now() - start < absl::Seconds(10)) {
      auto st = client_->GetStats("m");
      if (st.ok() && (*st)[0].leases_expired == 1) break;
      absl::SleepFor(absl::Milliseconds(20));
    }
    seqs_ = {{"m", a_}, {"m", b_}, {"tiny", p_}, {"tiny", q_}};
    baseline_ = TakeSnapshot(*client_, seqs_);
    ASSERT_TRUE(absl::StrContains(absl::StrJoin(baseline_.lines, "\n"),
                                  "stats m: used 3 free 61 total 64 sequences 2 tokens 21 appends "
                                  "2 bytes_appended 45568 leases_expired 1"))
        << absl::StrJoin(baseline_.lines, "\n");
    ASSERT_TRUE(absl::StrContains(absl::StrJoin(baseline_.lines, "\n"),
                                  "stats tiny: used 4 free 0 total 4 sequences 2 tokens 56"))
        << absl::StrJoin(baseline_.lines, "\n");
  }

  // The clients go away before the server is stopped. NOTE: gRPC's Server::Shutdown waits for
  // open client connections to close (seen: ~5 s for an idle one, up to ~10 s after a cancelled
  // stream), up to --drain-timeout-ms; nothing here tests draining, so that is kept short.
  void TearDown() override {
    client_.reset();
    raw_.reset();
    KvbankdTest::TearDown();
  }

  uint64_t MakeSeq(const std::string& model) {
    auto s = client_->CreateSequence(model);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? s->id : 0;
  }

  // Polls until the state matches the baseline again (a cancelled call may be torn down a moment
  // after the client returns), then returns the last snapshot.
  Snapshot SettledSnapshot() {
    Snapshot now = TakeSnapshot(*client_, seqs_);
    const absl::Time start = absl::Now();
    while (!(now == baseline_) && absl::Now() - start < absl::Seconds(5)) {
      absl::SleepFor(absl::Milliseconds(20));
      now = TakeSnapshot(*client_, seqs_);
    }
    return now;
  }

  std::unique_ptr<Client> client_;
  std::unique_ptr<RawStub> raw_;
  uint64_t bpt_ = 0;
  uint64_t a_ = 0, b_ = 0, e_ = 0, f_ = 0, p_ = 0, q_ = 0;
  std::vector<SeqRef> seqs_;
  Snapshot baseline_;
};

struct BadCase {
  std::string name;
  grpc::StatusCode code;
  std::string needle;  // the message must contain this
  std::function<Outcome()> call;
};

TEST_F(BadInputTest, EveryBadInputIsRefusedPreciselyAndChangesNothing) {
  Client& c = *client_;
  RawStub& raw = *raw_;
  const std::string bpt = absl::StrCat(bpt_);
  auto fetch = [](const std::string& model, uint64_t id) {
    v1::FetchRequest r;
    r.set_model(model);
    r.set_sequence_id(id);
    return r;
  };
  const std::vector<BadCase> cases = {
      // Models and ids.
      {"create in an unknown model", grpc::StatusCode::NOT_FOUND, "model 'nope' not found",
       [&] { return Of(c.CreateSequence("nope")); }},
      {"create with an empty model name", grpc::StatusCode::INVALID_ARGUMENT, "model is empty",
       [&] { return Of(c.CreateSequence("")); }},
      {"append to an unknown model", grpc::StatusCode::NOT_FOUND, "model 'nope'",
       [&] { return Of(raw.Append({Header("nope", a_, 1, bpt_)})); }},
      {"stats of an unknown model", grpc::StatusCode::NOT_FOUND, "model 'nope'",
       [&] { return Of(c.GetStats("nope")); }},
      {"unknown sequence id", grpc::StatusCode::NOT_FOUND,
       absl::StrCat("sequence_id ", kUnknownId, " not found"),
       [&] { return Of(c.GetSequence("m", kUnknownId)); }},
      {"fetch sequence id 0", grpc::StatusCode::INVALID_ARGUMENT, "sequence_id is 0",
       [&] { return Of(c.Fetch("m", 0, {})); }},
      {"append to sequence id 0", grpc::StatusCode::INVALID_ARGUMENT, "sequence_id is 0",
       [&] { return Of(raw.Append({Header("m", 0, 1, bpt_)})); }},
      {"fork sequence id 0", grpc::StatusCode::INVALID_ARGUMENT, "sequence_id is 0",
       [&] { return Of(c.Fork("m", 0)); }},
      // Payload sizes.
      {"payload one byte short", grpc::StatusCode::INVALID_ARGUMENT,
       absl::StrCat("payload has ", 5 * bpt_ - 1, " bytes"),
       [&] { return Of(raw.Append({Header("m", a_, 5, 5 * bpt_ - 1)})); }},
      {"payload one byte long", grpc::StatusCode::INVALID_ARGUMENT, "payload exceeds",
       [&] {
         return Of(raw.Append({Header("m", a_, 5, 5 * bpt_), Data(1)}));
       }},
      {"header.payload_bytes disagrees with the layout", grpc::StatusCode::INVALID_ARGUMENT,
       "header.payload_bytes",
       [&] { return Of(raw.Append({Header("m", a_, 5, 5 * bpt_, 5 * bpt_ + 64)})); }},
      {"SDK append with a short payload", grpc::StatusCode::INVALID_ARGUMENT,
       "header.payload_bytes",
       [&] {
         Client::AppendArgs args;
         args.num_tokens = 3;
         return Of(c.Append("m", a_, args, std::vector<uint8_t>(3 * bpt_ - 2)));
       }},
      // Layer ranges and dtypes.
      {"append layer range past the last layer", grpc::StatusCode::INVALID_ARGUMENT,
       "layer range [2, 9)",
       [&] {
         auto h = Header("m", a_, 1, bpt_);
         h.mutable_header()->set_layer_begin(2);
         h.mutable_header()->set_layer_end(9);
         return Of(raw.Append({h}));
       }},
      {"fetch layer_begin at num_layers", grpc::StatusCode::INVALID_ARGUMENT, "layer range [4, 4)",
       [&] {
         auto r = fetch("m", a_);
         r.set_layer_begin(4);
         return Of(raw.Fetch(r));
       }},
      {"fetch empty layer range", grpc::StatusCode::INVALID_ARGUMENT, "layer range [2, 2)",
       [&] {
         auto r = fetch("m", a_);
         r.set_layer_begin(2);
         r.set_layer_end(2);
         return Of(raw.Fetch(r));
       }},
      {"append dtype differs from storage", grpc::StatusCode::INVALID_ARGUMENT,
       "dtype fp32 does not match",
       [&] {
         Client::AppendArgs args;
         args.num_tokens = 1;
         args.dtype = DType::kFp32;
         return Of(c.Append("m", a_, args, std::vector<uint8_t>(bpt_)));
       }},
      {"fetch in a quantized (storage-format) dtype", grpc::StatusCode::INVALID_ARGUMENT,
       "storage format",
       [&] {
         auto r = fetch("m", a_);
         r.set_dtype(v1::DTYPE_INT8);
         return Of(raw.Fetch(r));
       }},
      {"append dtype outside the enum", grpc::StatusCode::INVALID_ARGUMENT, "header.dtype",
       [&] {
         auto h = Header("m", a_, 1, bpt_);
         h.mutable_header()->set_dtype(static_cast<v1::DType>(99));
         return Of(raw.Append({h}));
       }},
      // Token counts.
      {"empty append (num_tokens 0)", grpc::StatusCode::INVALID_ARGUMENT, "num_tokens is 0",
       [&] { return Of(raw.Append({Header("m", a_, 0)})); }},
      {"append above max_tokens_per_sequence", grpc::StatusCode::INVALID_ARGUMENT,
       "max_tokens_per_sequence",
       [&] { return Of(raw.Append({Header("m", a_, kMaxTokens + 1)})); }},
      {"append of 2^63 tokens", grpc::StatusCode::INVALID_ARGUMENT,
       absl::StrCat("num_tokens ", kTwoTo63, " exceeds"),
       [&] { return Of(raw.Append({Header("m", a_, kTwoTo63, 0, 1 * kMiB)})); }},
      {"append that would pass max_tokens_per_sequence at its position",
       grpc::StatusCode::RESOURCE_EXHAUSTED, "at position 21",
       [&] { return Of(raw.Append({Header("m", a_, kMaxTokens)})); }},
      {"token_ids count differs from num_tokens", grpc::StatusCode::INVALID_ARGUMENT,
       "token_ids has 3 ids for num_tokens 5",
       [&] {
         auto h = Header("m", a_, 5, 5 * bpt_);
         for (uint32_t t : {1, 2, 3}) h.mutable_header()->add_token_ids(t);
         return Of(raw.Append({h}));
       }},
      {"token_ids after a gap in the known ids", grpc::StatusCode::INVALID_ARGUMENT,
       "token_ids start at position 5",
       [&] {
         Client::AppendArgs args;
         args.layer_end = 1;
         args.num_tokens = 1;
         args.token_ids = {7};
         return Of(c.Append("m", b_, args, std::vector<uint8_t>(bpt_ / 4)));
       }},
      {"layer-range append over unequal layer lengths", grpc::StatusCode::FAILED_PRECONDITION,
       "equal lengths",
       [&] {
         Client::AppendArgs args;
         args.num_tokens = 1;
         return Of(c.Append("m", b_, args, std::vector<uint8_t>(bpt_)));
       }},
      // Stream shape.
      {"append stream without header", grpc::StatusCode::INVALID_ARGUMENT, "header",
       [&] { return Of(raw.Append({Data(bpt_)})); }},
      {"append header repeated", grpc::StatusCode::INVALID_ARGUMENT,
       "header may appear only in the first",
       [&] {
         return Of(raw.Append({Header("m", a_, 2, bpt_), Header("m", a_, 2, bpt_)}));
       }},
      {"append stream with no message at all", grpc::StatusCode::INVALID_ARGUMENT, "no header",
       [&] { return Of(raw.Append({})); }},
      // Capacity.
      {"append larger than the pool", grpc::StatusCode::RESOURCE_EXHAUSTED, "block pool exhausted",
       [&] {
         Client::AppendArgs args;
         args.num_tokens = 2000;  // 125 blocks; 61 are free
         return Of(c.Append("m", a_, args, std::vector<uint8_t>(2000 * bpt_)));
       }},
      {"append into an exhausted pool", grpc::StatusCode::RESOURCE_EXHAUSTED,
       "block pool exhausted",
       [&] {
         Client::AppendArgs args;
         args.num_tokens = 1;
         return Of(c.Append("tiny", q_, args, std::vector<uint8_t>(bpt_)));
       }},
      {"fork in an exhausted pool", grpc::StatusCode::RESOURCE_EXHAUSTED, "block pool exhausted",
       [&] { return Of(c.Fork("tiny", p_)); }},
      // Lifecycle misuse.
      {"fetch after free", grpc::StatusCode::FAILED_PRECONDITION, "it was freed",
       [&] { return Of(c.Fetch("m", f_, {})); }},
      {"append after free", grpc::StatusCode::FAILED_PRECONDITION, "it was freed",
       [&] { return Of(raw.Append({Header("m", f_, 1, bpt_)})); }},
      {"double free", grpc::StatusCode::FAILED_PRECONDITION, "it was freed",
       [&] { return Of(c.Free("m", f_)); }},
      {"truncate past the end", grpc::StatusCode::OUT_OF_RANGE, "past the end",
       [&] { return Of(c.Truncate("m", a_, 22)); }},
      {"fetch past the end", grpc::StatusCode::OUT_OF_RANGE, "token range [0, 22)",
       [&] {
         Client::FetchArgs args;
         args.token_end = 22;
         return Of(c.Fetch("m", a_, args));
       }},
      {"fetch with token_begin > token_end", grpc::StatusCode::OUT_OF_RANGE, "token range [10, 5)",
       [&] {
         Client::FetchArgs args;
         args.token_begin = 10;
         args.token_end = 5;
         return Of(c.Fetch("m", a_, args));
       }},
      {"fetch starting past the end", grpc::StatusCode::OUT_OF_RANGE, "token range [30, 21)",
       [&] {
         Client::FetchArgs args;
         args.token_begin = 30;
         return Of(c.Fetch("m", a_, args));
       }},
      {"sequence whose lease expired", grpc::StatusCode::FAILED_PRECONDITION, "its lease expired",
       [&] { return Of(c.GetSequence("m", e_)); }},
      {"renew an expired lease", grpc::StatusCode::FAILED_PRECONDITION, "its lease expired",
       [&] { return Of(c.RenewLease("m", e_)); }},
      // Leases.
      {"lease_ttl_ms 2^63", grpc::StatusCode::INVALID_ARGUMENT, "lease_ttl_ms",
       [&] {
         v1::CreateSequenceRequest r;
         r.set_model("m");
         r.set_lease_ttl_ms(kTwoTo63);
         return Of(raw.CreateSequence(r));
       }},
      {"lease above --max-lease-ms", grpc::StatusCode::INVALID_ARGUMENT, "exceeds the maximum",
       [&] {
         v1::CreateSequenceRequest r;
         r.set_model("m");
         r.set_lease_ttl_ms(uint64_t{1} << 40);
         return Of(raw.CreateSequence(r));
       }},
      {"lease_ttl_ms together with no_lease", grpc::StatusCode::INVALID_ARGUMENT, "no_lease",
       [&] {
         v1::CreateSequenceRequest r;
         r.set_model("m");
         r.set_lease_ttl_ms(5000);
         r.set_no_lease(true);
         return Of(raw.CreateSequence(r));
       }},
      {"fork with lease_ttl_ms 2^63", grpc::StatusCode::INVALID_ARGUMENT, "lease_ttl_ms",
       [&] {
         v1::ForkRequest r;
         r.set_model("m");
         r.set_sequence_id(a_);
         r.set_lease_ttl_ms(kTwoTo63);
         return Of(raw.Fork(r));
       }},
      // Model specs.
      {"model with zero layers", grpc::StatusCode::INVALID_ARGUMENT, "num_layers",
       [&] { return Of(raw.EnsureModel(Spec("z", 0, 8, 2, 64))); }},
      {"model with billions of layers", grpc::StatusCode::INVALID_ARGUMENT,
       "num_layers must be in [1, 1024], got 3066666625",
       [&] { return Of(raw.EnsureModel(Spec("z", 3066666625u, 8, 2, 64))); }},
      {"billions of layers, most of them high precision", grpc::StatusCode::INVALID_ARGUMENT,
       "num_layers must be in [1, 1024]",
       [&] {
         v1::ModelSpec s = Spec("z", 4000000000u, 8, 2, 64, v1::DTYPE_INT8);
         s.set_high_precision_layers(1000000000);
         return Of(raw.EnsureModel(s));
       }},
      {"q heads not a multiple of kv heads", grpc::StatusCode::INVALID_ARGUMENT,
       "num_q_heads (3) must be a multiple of num_kv_heads (2)",
       [&] { return Of(raw.EnsureModel(Spec("z", 4, 3, 2, 64))); }},
      {"unknown preset", grpc::StatusCode::INVALID_ARGUMENT, "spec.preset: unknown preset 'gpt-9'",
       [&] {
         v1::ModelSpec s;
         s.set_name("z");
         s.set_preset("gpt-9");
         return Of(raw.EnsureModel(s));
       }},
      {"preset together with shape fields", grpc::StatusCode::INVALID_ARGUMENT, "either preset",
       [&] {
         v1::ModelSpec s = Spec("z", 4, 8, 2, 64);
         s.set_preset("llama-3.1-8b");
         return Of(raw.EnsureModel(s));
       }},
      {"layer_dtypes count differs from num_layers", grpc::StatusCode::INVALID_ARGUMENT,
       "spec.layer_dtypes has 2 entries for 4 layers",
       [&] {
         v1::ModelSpec s = Spec("z", 4, 8, 2, 64);
         s.add_layer_dtypes(v1::DTYPE_FP16);
         s.add_layer_dtypes(v1::DTYPE_FP16);
         return Of(raw.EnsureModel(s));
       }},
      {"quantized input dtype", grpc::StatusCode::INVALID_ARGUMENT, "input_dtype",
       [&] {
         v1::ModelSpec s = Spec("z", 4, 8, 2, 64, v1::DTYPE_INT8);
         s.set_input_dtype(v1::DTYPE_INT8);
         return Of(raw.EnsureModel(s));
       }},
      {"pool_bytes beyond the server's budget", grpc::StatusCode::RESOURCE_EXHAUSTED, "pool budget",
       [&] {
         v1::ModelSpec s = Spec("z", 4, 8, 2, 64);
         s.set_pool_bytes(uint64_t{2} << 30);
         return Of(raw.EnsureModel(s));
       }},
      {"empty model name in a spec", grpc::StatusCode::INVALID_ARGUMENT, "model name",
       [&] { return Of(raw.EnsureModel(Spec("", 4, 8, 2, 64))); }},
      {"existing name, other layout", grpc::StatusCode::ALREADY_EXISTS, "different layout",
       [&] { return Of(raw.EnsureModel(Spec("m", 4, 8, 4, 64))); }},
      // Transport limits.
      {"append message over the 4 MiB limit", grpc::StatusCode::RESOURCE_EXHAUSTED,
       "larger than max",
       [&] {
         const uint64_t n = (5 * kMiB) / bpt_ + 1;
         return Of(raw.Append({Header("m", a_, n, n * bpt_)}));
       }},
      {"unary message over the 4 MiB limit", grpc::StatusCode::RESOURCE_EXHAUSTED,
       "larger than max",
       [&] {
         v1::ModelSpec s = Spec(std::string(5 * kMiB, 'x'), 4, 8, 2, 64);
         return Of(raw.EnsureModel(s));
       }},
  };
  ASSERT_GE(cases.size(), 24u);
  std::cerr << "[bad input] " << cases.size() << " cases\n";

  for (const BadCase& bc : cases) {
    SCOPED_TRACE(bc.name);
    const Outcome got = bc.call();
    EXPECT_EQ(got.code, bc.code) << bc.name << ": got " << CodeName(got.code) << " \""
                                 << got.message << "\", want " << CodeName(bc.code);
    EXPECT_TRUE(absl::StrContains(got.message, bc.needle))
        << bc.name << ": message \"" << got.message << "\" lacks \"" << bc.needle << "\"";
    const Snapshot after = SettledSnapshot();
    EXPECT_TRUE(after == baseline_) << bc.name << " changed state:\n" << baseline_.Diff(after);
    EXPECT_TRUE(client_->WaitForServing(absl::Seconds(5))) << bc.name << ": server stopped serving";
  }

  // Still fully usable: the sequences accept a valid append and a valid fetch.
  Client::AppendArgs args;
  args.num_tokens = 3;
  auto ok = c.Append("m", a_, args, Random(4002).Bytes(3 * bpt_));
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->length, 24u);
}

// A client that cancels an append mid-stream, or after sending every byte but before the
// half-close, leaves the sequence exactly as it was.
TEST_F(BadInputTest, CancelledAppendLeavesTheSequenceUnchanged) {
  const uint64_t n = 600;  // 1.2 MB: several chunks
  for (bool all_bytes : {false, true}) {
    SCOPED_TRACE(all_bytes ? "cancelled after the last byte" : "cancelled mid-stream");
    grpc::ClientContext ctx;
    RawStub::Deadline(&ctx);
    v1::AppendResponse resp;
    auto writer = (*raw_)->Append(&ctx, &resp);
    ASSERT_TRUE(writer->Write(Header("m", a_, n, 0, n * bpt_)));
    const uint64_t chunk = 256 * 1024;
    uint64_t sent = 0;
    const uint64_t stop_at = all_bytes ? n * bpt_ : 2 * chunk;
    while (sent < stop_at) {
      const uint64_t k = std::min(chunk, stop_at - sent);
      ASSERT_TRUE(writer->Write(Data(k)));
      sent += k;
    }
    // Let the server take in what was sent before cancelling.
    absl::SleepFor(absl::Milliseconds(100));
    ctx.TryCancel();
    const grpc::Status st = writer->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::CANCELLED) << st.error_message();
    const Snapshot after = SettledSnapshot();
    EXPECT_TRUE(after == baseline_) << baseline_.Diff(after);
  }
  // No append is left marked in flight: a real one goes through.
  Client::AppendArgs args;
  args.num_tokens = 2;
  auto ok = client_->Append("m", a_, args, Random(4003).Bytes(2 * bpt_));
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->length, 23u);
}

// While an append is open on a sequence, a second append and a truncate are refused; freeing the
// sequence makes the open append fail with ABORTED at commit, and none of its blocks leak.
TEST_F(BadInputTest, AppendInFlightExcludesOthersAndFreeAbortsIt) {
  auto seq = client_->CreateSequence("m");
  ASSERT_TRUE(seq.ok()) << seq.status();
  const uint64_t id = seq->id;
  auto used = [&] {
    auto st = client_->GetStats("m");
    EXPECT_TRUE(st.ok()) << st.status();
    return st.ok() ? (*st)[0].blocks_used : 0;
  };
  const uint64_t used_before = used();

  grpc::ClientContext ctx;
  RawStub::Deadline(&ctx);
  v1::AppendResponse resp;
  auto writer = (*raw_)->Append(&ctx, &resp);
  const uint64_t n = 40;  // 3 blocks
  ASSERT_TRUE(writer->Write(Header("m", id, n, n * bpt_ / 2, n * bpt_)));
  // The header is in once its blocks are taken.
  const absl::Time start = absl::Now();
  while (used() != used_before + 3 && absl::Now() - start < absl::Seconds(10)) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_EQ(used(), used_before + 3);

  Client::AppendArgs args;
  args.num_tokens = 1;
  auto second = client_->Append("m", id, args, std::vector<uint8_t>(bpt_));
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition) << second.status();
  EXPECT_TRUE(absl::StrContains(second.status().message(), "in flight")) << second.status();
  auto cut = client_->Truncate("m", id, 0);
  EXPECT_EQ(cut.status().code(), absl::StatusCode::kFailedPrecondition) << cut.status();
  auto info = client_->GetSequence("m", id);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->length, 0u);  // nothing visible before the commit

  ASSERT_TRUE(client_->Free("m", id).ok());
  ASSERT_TRUE(writer->Write(Data(n * bpt_ / 2)));
  writer->WritesDone();
  const grpc::Status st = writer->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::ABORTED) << st.error_message();
  EXPECT_TRUE(absl::StrContains(st.error_message(), "freed")) << st.error_message();
  EXPECT_EQ(used(), used_before);
  const Snapshot after = SettledSnapshot();
  EXPECT_TRUE(after == baseline_) << baseline_.Diff(after);
}

class MaxSequencesTest : public KvbankdTest {};

TEST_F(MaxSequencesTest, LimitIsEnforcedWithoutSideEffects) {
  ASSERT_NO_FATAL_FAILURE(StartServer({"--models=", "--max-sequences=2"}));
  auto client = NewClient();
  ASSERT_TRUE(client->EnsureModel(Fp16Layout("m"), 4 * kMiB).ok());
  auto s1 = client->CreateSequence("m");
  auto s2 = client->CreateSequence("m");
  ASSERT_TRUE(s1.ok() && s2.ok());
  Client::AppendArgs args;
  args.num_tokens = 9;
  const uint64_t bpt = client->GetModel("m")->payload_bytes_per_token;
  ASSERT_TRUE(client->Append("m", s1->id, args, Random(5001).Bytes(9 * bpt)).ok());
  const std::vector<SeqRef> seqs = {{"m", s1->id}, {"m", s2->id}};
  const Snapshot before = TakeSnapshot(*client, seqs);

  auto s3 = client->CreateSequence("m");
  EXPECT_EQ(s3.status().code(), absl::StatusCode::kResourceExhausted) << s3.status();
  EXPECT_TRUE(absl::StrContains(s3.status().message(), "max_sequences (2)")) << s3.status();
  auto fork = client->Fork("m", s1->id);
  EXPECT_EQ(fork.status().code(), absl::StatusCode::kResourceExhausted) << fork.status();
  EXPECT_TRUE(absl::StrContains(fork.status().message(), "max_sequences")) << fork.status();
  const Snapshot after = TakeSnapshot(*client, seqs);
  EXPECT_TRUE(after == before) << before.Diff(after);

  // Room again once one is freed.
  ASSERT_TRUE(client->Free("m", s2->id).ok());
  auto s4 = client->Fork("m", s1->id);
  ASSERT_TRUE(s4.ok()) << s4.status();
  EXPECT_EQ(s4->length, 9u);
}

}  // namespace
}  // namespace kvbank::integ
