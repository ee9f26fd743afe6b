// Raw and malformed requests on every method of kvbank.v1.KvBank: bytes that are not a message,
// messages over the server's 4 MiB limit (and the server's RSS across bursts of them), and
// 9000-character strings in every string field, whose errors must not echo them back.
#include <algorithm>
#include <atomic>
#include <functional>
#include <iostream>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "google/protobuf/descriptor.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kvbank/client.h"
#include "kvbank/v1/kvbank.grpc.pb.h"
#include "tests/integration/fault_support.h"
#include "tests/integration/server_fixture.h"

namespace kvbank::integ {
namespace {

// The code's name (grpc::StatusCode and absl::StatusCode share their numbering).
std::string CodeName(grpc::StatusCode c) {
  return absl::StatusCodeToString(static_cast<absl::StatusCode>(c));
}

// Every method of the service, from its descriptor: a method added later is covered too.
std::vector<const google::protobuf::MethodDescriptor*> KvBankMethods() {
  const google::protobuf::ServiceDescriptor* service =
      v1::EnsureModelRequest::descriptor()->file()->FindServiceByName("KvBank");
  std::vector<const google::protobuf::MethodDescriptor*> out;
  for (int i = 0; service != nullptr && i < service->method_count(); ++i) {
    out.push_back(service->method(i));
  }
  return out;
}
std::string MethodPath(const google::protobuf::MethodDescriptor* m) {
  return absl::StrCat("/", m->service()->full_name(), "/", m->name());
}

// A channel without client-side size limits, so that oversized messages reach the server.
std::shared_ptr<grpc::Channel> UnlimitedChannel(const std::string& target) {
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(-1);
  args.SetMaxReceiveMessageSize(-1);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
}

// One call of any method, unary or streaming, whose only message is `bytes` as they are (a
// generic stub does no serialization). Blocks until the call ends.
grpc::Status RawCall(grpc::GenericStub& stub, const std::string& method, const std::string& bytes,
                     absl::Duration timeout = absl::Seconds(20)) {
  class Call final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
   public:
    Call(grpc::GenericStub& stub, const std::string& method, const std::string& bytes,
         absl::Duration timeout) {
      ctx_.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
      grpc::Slice slice(bytes);
      request_ = grpc::ByteBuffer(&slice, 1);
      stub.PrepareBidiStreamingCall(&ctx_, method, grpc::StubOptions(), this);
      StartWriteLast(&request_, grpc::WriteOptions());
      StartRead(&response_);
      StartCall();
    }
    void OnReadDone(bool ok) override {
      if (ok) StartRead(&response_);
    }
    void OnDone(const grpc::Status& s) override {
      absl::MutexLock lock(&mu_);
      status_ = s;
      done_ = true;
    }
    grpc::Status Await() {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(&done_));
      return status_;
    }

   private:
    grpc::ClientContext ctx_;
    grpc::ByteBuffer request_, response_;
    absl::Mutex mu_;
    bool done_ ABSL_GUARDED_BY(mu_) = false;
    grpc::Status status_ ABSL_GUARDED_BY(mu_);
  };
  Call call(stub, method, bytes, timeout);
  return call.Await();
}

// Bytes that are not a message, on every method: INVALID_ARGUMENT naming the request type,
// nothing changed, the server still serving.
TEST_F(FaultTest, GarbageOnEveryMethodIsInvalidArgumentNamingTheRequestType) {
  ASSERT_NO_FATAL_FAILURE(Start());
  ASSERT_TRUE(admin_->EnsureModel(SmallLayout("m"), 1 * kMiB).ok());
  const uint64_t id = NewSequence("m");
  grpc::GenericStub stub(UnlimitedChannel(server_->target()));
  // An unterminated varint tag; a length-delimited field 1 that claims 127 bytes and has 1.
  const std::vector<std::string> garbage = {std::string("\xff\xff\xff", 3),
                                            std::string("\x0a\x7f\x01", 3)};
  const auto methods = KvBankMethods();
  ASSERT_EQ(methods.size(), 25u) << "kvbank.v1.KvBank changed: review this test's expectations";
  int wrong = 0;
  for (const auto* m : methods) {
    for (const std::string& bytes : garbage) {
      const grpc::Status s = RawCall(stub, MethodPath(m), bytes);
      const std::string type = m->input_type()->full_name();
      const bool right = s.error_code() == grpc::StatusCode::INVALID_ARGUMENT &&
                         absl::StrContains(s.error_message(), type);
      if (!right) ++wrong;
      EXPECT_TRUE(right) << m->name() << " with " << bytes.size()
                         << " garbage bytes: " << CodeName(s.error_code()) << " '"
                         << s.error_message() << "', want INVALID_ARGUMENT naming " << type;
    }
  }
  // Nothing changed; still serving.
  const Client::ModelStats st = StatsOf(*admin_, "m");
  EXPECT_EQ(st.sequences, 1u);
  EXPECT_EQ(st.appends, 0u);
  auto info = admin_->GetSequence("m", id);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->length, 0u);
  std::cerr << "[fault] garbage: " << methods.size() << " methods x " << garbage.size()
            << " payloads, " << wrong << " not answered INVALID_ARGUMENT naming the request type\n";
}

// A message over the server's 4 MiB limit on every method: RESOURCE_EXHAUSTED, the server
// still serving. Then many at once: the server's RSS comes back within RssBoundKiB() (64 MiB) of
// where it was.
TEST_F(FaultTest, OversizedMessagesAreRefusedAndTheirMemoryReturns) {
  // gRPC's memory is bounded (its ResourceQuota): past the bound it shrinks its reads and sheds
  // connections (GOAWAY), so the server's memory stays near the bound however many arrive.
  ASSERT_NO_FATAL_FAILURE(Start({"--grpc-memory-bytes=64MiB"}));
  ASSERT_TRUE(admin_->EnsureModel(SmallLayout("m"), 1 * kMiB).ok());
  auto channel = UnlimitedChannel(server_->target());
  grpc::GenericStub stub(channel);
  const auto methods = KvBankMethods();
  ASSERT_FALSE(methods.empty());
  const std::string five_mib(5 * kMiB, 'x');
  for (const auto* m : methods) {
    const grpc::Status s = RawCall(stub, MethodPath(m), five_mib);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
        << m->name() << ": " << CodeName(s.error_code()) << " '" << s.error_message() << "'";
    ASSERT_TRUE(admin_->GetStats("m").ok()) << "kvbankd stopped serving after " << m->name();
  }

  // Two bursts, each of 8 connections sending 3 messages of 32 MiB to rotating methods at once.
  // The second shows whether the first's memory is reused or kept on top.
  constexpr int kSenders = 8, kEach = 3, kBursts = 2;
  const int64_t bound = RssBoundKiB();  // 0: not bounded (sanitizer build)
  const pid_t pid = server_->pid();
  const int64_t before = ProcStatusKiB(pid, "VmRSS");
  ASSERT_GT(before, 0) << "cannot read /proc/" << pid << "/status";
  const std::string big(32 * kMiB, 'y');
  std::string report;
  for (int burst = 0; burst < kBursts; ++burst) {
    std::atomic<bool> sampling{true};
    std::atomic<int64_t> peak{ProcStatusKiB(pid, "VmRSS")};
    std::thread sampler([&] {
      while (sampling.load()) {
        const int64_t rss = ProcStatusKiB(pid, "VmRSS");
        if (rss > peak.load()) peak = rss;
        absl::SleepFor(absl::Milliseconds(2));
      }
    });
    std::atomic<int> refused{0}, other{0};
    std::vector<std::thread> senders;
    const absl::Time start = absl::Now();
    for (int t = 0; t < kSenders; ++t) {
      senders.emplace_back([&, t] {
        grpc::GenericStub own(UnlimitedChannel(server_->target()));
        for (int i = 0; i < kEach; ++i) {
          const auto* m = methods[(t * kEach + i) % methods.size()];
          const grpc::Status s = RawCall(own, MethodPath(m), big, absl::Seconds(60));
          // Refused by the size limit, or shed with its connection under memory pressure.
          const bool shed = s.error_code() == grpc::StatusCode::UNAVAILABLE;
          (s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED || shed ? refused : other)++;
          if (s.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED) {
            std::cerr << "[fault] oversized: " << CodeName(s.error_code()) << " '"
                      << s.error_message() << "'\n";
          }
        }
      });
    }
    for (std::thread& t : senders) t.join();
    const int64_t send_ms = MsSince(start);
    // The server's memory settles once the calls and connections are gone: poll with a deadline.
    const absl::Time deadline = absl::Now() + absl::Seconds(5);
    int64_t after = ProcStatusKiB(pid, "VmRSS");
    while (bound > 0 && after > before + bound && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(20));
      after = ProcStatusKiB(pid, "VmRSS");
    }
    sampling = false;
    sampler.join();
    absl::StrAppend(&report, "; burst ", burst + 1, ": ", kSenders * kEach,
                    " concurrent 32 MiB messages in ", send_ms, " ms, ", refused.load(),
                    " refused (RESOURCE_EXHAUSTED or shed UNAVAILABLE), ", other.load(),
                    " other, RSS peak ", MiB(peak.load()), " MiB, after ", MiB(after), " MiB");
    EXPECT_EQ(refused.load(), kSenders * kEach) << "burst " << burst + 1;
    if (bound > 0) {
      EXPECT_LE(after, before + bound) << "burst " << burst + 1 << ": server RSS " << after
                                       << " KiB, before the bursts " << before << " KiB";
    }
    EXPECT_TRUE(admin_->GetStats("m").ok());
  }
  std::cerr << "[fault] oversized: server RSS before " << MiB(before) << " MiB" << report
            << " (bound: before + "
            << (bound > 0 ? absl::StrCat(MiB(bound), " MiB") : "none: sanitizer build") << ")\n";
}

// A 9000-character string in every string (and bytes) field of every request that has one:
// the proper code, a status message under 1 KiB, and the same stock channel (default metadata
// limits) still working after each call. A message that echoes the whole input arrives as
// RESOURCE_EXHAUSTED (metadata too large) at such a client.
TEST_F(FaultTest, ErrorMessagesDoNotEchoLongInput) {
  ASSERT_NO_FATAL_FAILURE(Start());
  ASSERT_TRUE(admin_->EnsureModel(SmallLayout("m"), 1 * kMiB).ok());
  const uint64_t id = NewSequence("m");
  auto stub = v1::KvBank::NewStub(
      grpc::CreateChannel(server_->target(), grpc::InsecureChannelCredentials()));
  const std::string big(9000, 'x');
  const std::string big_hash(9000, '\x01');
  const std::string hash(32, '\x02');
  using Code = grpc::StatusCode;
  const std::set<Code> kUnknownModel = {Code::NOT_FOUND, Code::INVALID_ARGUMENT};
  const std::set<Code> kAllowedOrRefused = {Code::OK, Code::INVALID_ARGUMENT};
  const std::set<Code> kRefused = {Code::INVALID_ARGUMENT};

  auto deadline = [](grpc::ClientContext* ctx) {
    ctx->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
  };
  std::vector<uint64_t> created;  // sequences a long cache_salt was allowed to create
  auto create = [&](const v1::CreateSequenceRequest& req) {
    grpc::ClientContext ctx;
    deadline(&ctx);
    v1::SequenceInfo resp;
    grpc::Status s = stub->CreateSequence(&ctx, req, &resp);
    if (s.ok()) created.push_back(resp.sequence_id());
    return s;
  };
  auto create_req = [&](const std::string& model) {
    v1::CreateSequenceRequest r;
    r.set_model(model);
    r.set_no_lease(true);
    return r;
  };
  auto spec = [&](const std::string& name) {
    v1::ModelSpec s;
    s.set_name(name);
    s.set_num_layers(2);
    s.set_num_kv_heads(2);
    s.set_head_dim(32);
    s.set_storage_dtype(v1::DTYPE_FP16);
    s.set_pool_bytes(1 * kMiB);
    return s;
  };
  auto match = [&](const v1::MatchRequest& req) {
    grpc::ClientContext ctx;
    deadline(&ctx);
    v1::MatchResponse resp;
    return stub->Match(&ctx, req, &resp);
  };
  auto pin = [&](const v1::PinRequest& req) {
    grpc::ClientContext ctx;
    deadline(&ctx);
    v1::PinResponse resp;
    return stub->Pin(&ctx, req, &resp);
  };
  auto fetch_blocks = [&](const v1::FetchBlocksRequest& req) {
    grpc::ClientContext ctx;
    deadline(&ctx);
    auto reader = stub->FetchBlocks(&ctx, req);
    v1::FetchResponse resp;
    while (reader->Read(&resp)) {
    }
    return reader->Finish();
  };
  auto prefix_root = [&](const v1::GetPrefixRootRequest& req) {
    grpc::ClientContext ctx;
    deadline(&ctx);
    v1::GetPrefixRootResponse resp;
    return stub->GetPrefixRoot(&ctx, req, &resp);
  };
  // A request for model "m" with one field made long.
  auto extra_key = [&](auto* keys) {
    v1::ExtraKey* k = keys->Add();
    k->set_kind(v1::EXTRA_KEY_KIND_LORA);
    k->set_value(big);
  };
  std::vector<uint32_t> block_of_tokens(kBlockTokens, 5);

  struct LongCase {
    std::string field;
    std::set<Code> codes;
    std::function<grpc::Status()> call;
  };
  const std::vector<LongCase> cases = {
      {"EnsureModel spec.name", kRefused,
       [&] {
         grpc::ClientContext ctx;
         deadline(&ctx);
         v1::EnsureModelRequest req;
         *req.mutable_spec() = spec(big);
         v1::EnsureModelResponse resp;
         return stub->EnsureModel(&ctx, req, &resp);
       }},
      {"EnsureModel spec.preset", kRefused,
       [&] {
         grpc::ClientContext ctx;
         deadline(&ctx);
         v1::EnsureModelRequest req;
         req.mutable_spec()->set_name("p");
         req.mutable_spec()->set_preset(big);
         v1::EnsureModelResponse resp;
         return stub->EnsureModel(&ctx, req, &resp);
       }},
      {"GetStats model", kUnknownModel,
       [&] {
         grpc::ClientContext ctx;
         deadline(&ctx);
         v1::GetStatsRequest req;
         req.set_model(big);
         v1::GetStatsResponse resp;
         return stub->GetStats(&ctx, req, &resp);
       }},
      {"CreateSequence model", kUnknownModel, [&] { return create(create_req(big)); }},
      {"CreateSequence cache_salt", kAllowedOrRefused,
       [&] {
         auto r = create_req("m");
         r.set_cache_salt(big);
         return create(r);
       }},
      {"CreateSequence extra_keys[0].value", kRefused,
       [&] {
         auto r = create_req("m");
         extra_key(r.mutable_extra_keys());
         return create(r);
       }},
      {"Append header.model", kUnknownModel,
       [&] {
         grpc::ClientContext ctx;
         deadline(&ctx);
         v1::AppendResponse resp;
         auto writer = stub->Append(&ctx, &resp);
         v1::AppendRequest req;
         req.mutable_header()->set_model(big);
         req.mutable_header()->set_sequence_id(id);
         req.mutable_header()->set_num_tokens(1);
         req.set_data(std::string(kTokenBytes, '\x11'));
         writer->Write(req);
         writer->WritesDone();
         return writer->Finish();
       }},
      {"Fetch model", kUnknownModel,
       [&] {
         grpc::ClientContext ctx;
         deadline(&ctx);
         v1::FetchRequest req;
         req.set_model(big);
         req.set_sequence_id(id);
         auto reader = stub->Fetch(&ctx, req);
         v1::FetchResponse resp;
         while (reader->Read(&resp)) {
         }
         return reader->Finish();
       }},
      {"Fork model", kUnknownModel,
       [&] {
         grpc::ClientContext ctx;
         deadline(&ctx);
         v1::ForkRequest req;
         req.set_model(big);
         req.set_sequence_id(id);
         v1::SequenceInfo resp;
         return stub->Fork(&ctx, req, &resp);
       }},
      {"Truncate model", kUnknownModel,
       [&] {
         grpc::ClientContext ctx;
         deadline(&ctx);
         v1::TruncateRequest req;
         req.set_model(big);
         req.set_sequence_id(id);
         v1::SequenceInfo resp;
         return stub->Truncate(&ctx, req, &resp);
       }},
      {"Free model", kUnknownModel,
       [&] {
         grpc::ClientContext ctx;
         deadline(&ctx);
         v1::FreeRequest req;
         req.set_model(big);
         req.set_sequence_id(id);
         v1::FreeResponse resp;
         return stub->Free(&ctx, req, &resp);
       }},
      {"RenewLease model", kUnknownModel,
       [&] {
         grpc::ClientContext ctx;
         deadline(&ctx);
         v1::RenewLeaseRequest req;
         req.set_model(big);
         req.set_sequence_id(id);
         v1::SequenceInfo resp;
         return stub->RenewLease(&ctx, req, &resp);
       }},
      {"GetSequence model", kUnknownModel,
       [&] {
         grpc::ClientContext ctx;
         deadline(&ctx);
         v1::GetSequenceRequest req;
         req.set_model(big);
         req.set_sequence_id(id);
         v1::SequenceInfo resp;
         return stub->GetSequence(&ctx, req, &resp);
       }},
      {"Match model", kUnknownModel,
       [&] {
         v1::MatchRequest req;
         req.set_model(big);
         req.add_queries()->add_token_ids(1);
         return match(req);
       }},
      {"Match queries[0].cache_salt", kAllowedOrRefused,
       [&] {
         v1::MatchRequest req;
         req.set_model("m");
         v1::MatchQuery* q = req.add_queries();
         q->add_token_ids(1);
         q->set_cache_salt(big);
         return match(req);
       }},
      {"Match queries[0].extra_keys[0].value", kRefused,
       [&] {
         v1::MatchRequest req;
         req.set_model("m");
         v1::MatchQuery* q = req.add_queries();
         q->add_token_ids(1);
         extra_key(q->mutable_extra_keys());
         return match(req);
       }},
      {"Match queries[0].block_hashes[0]", kRefused,
       [&] {
         v1::MatchRequest req;
         req.set_model("m");
         req.add_queries()->add_block_hashes(big_hash);
         return match(req);
       }},
      {"FetchBlocks model", kUnknownModel,
       [&] {
         v1::FetchBlocksRequest req;
         req.set_model(big);
         req.add_block_hashes(hash);
         return fetch_blocks(req);
       }},
      {"FetchBlocks block_hashes[0]", kRefused,
       [&] {
         v1::FetchBlocksRequest req;
         req.set_model("m");
         req.add_block_hashes(big_hash);
         return fetch_blocks(req);
       }},
      {"Pin model", kUnknownModel,
       [&] {
         v1::PinRequest req;
         req.set_model(big);
         req.add_block_hashes(hash);
         return pin(req);
       }},
      {"Pin block_hashes[0]", kRefused,
       [&] {
         v1::PinRequest req;
         req.set_model("m");
         req.add_block_hashes(big_hash);
         return pin(req);
       }},
      {"Pin cache_salt", kAllowedOrRefused,
       [&] {
         v1::PinRequest req;
         req.set_model("m");
         for (uint32_t t : block_of_tokens) req.add_token_ids(t);
         req.set_cache_salt(big);
         return pin(req);
       }},
      {"Pin extra_keys[0].value", kRefused,
       [&] {
         v1::PinRequest req;
         req.set_model("m");
         for (uint32_t t : block_of_tokens) req.add_token_ids(t);
         extra_key(req.mutable_extra_keys());
         return pin(req);
       }},
      {"GetPrefixRoot model", kUnknownModel,
       [&] {
         v1::GetPrefixRootRequest req;
         req.set_model(big);
         return prefix_root(req);
       }},
      {"GetPrefixRoot cache_salt", kAllowedOrRefused,
       [&] {
         v1::GetPrefixRootRequest req;
         req.set_model("m");
         req.set_cache_salt(big);
         return prefix_root(req);
       }},
      {"Watch model", kUnknownModel,
       [&] {
         grpc::ClientContext ctx;
         deadline(&ctx);
         v1::WatchRequest req;
         req.set_model(big);
         auto reader = stub->Watch(&ctx, req);
         v1::KvEventBatch batch;
         while (reader->Read(&batch)) {
         }
         return reader->Finish();
       }},
      {"Attend model", kUnknownModel,
       [&] {
         grpc::ClientContext ctx;
         deadline(&ctx);
         v1::AttendRequest req;
         req.set_model(big);
         v1::AttendItem* item = req.add_items();
         item->set_sequence_id(id);
         for (uint32_t i = 0; i < 4 * kHeadDim; ++i) item->add_query(0.5f);
         v1::AttendResponse resp;
         return stub->Attend(&ctx, req, &resp);
       }},
  };

  int wrong = 0;
  size_t longest = 0;
  for (const LongCase& c : cases) {
    const grpc::Status s = c.call();
    longest = std::max(longest, s.error_message().size());
    const bool code_ok = c.codes.count(s.error_code()) > 0;
    const bool message_ok =
        s.error_message().size() < 1024 && (s.ok() || !s.error_message().empty());
    // The same channel must still work: a GetStats of model "m".
    grpc::ClientContext ctx;
    deadline(&ctx);
    v1::GetStatsRequest req;
    req.set_model("m");
    v1::GetStatsResponse resp;
    const grpc::Status after = stub->GetStats(&ctx, req, &resp);
    if (!code_ok || !message_ok || !after.ok()) ++wrong;
    EXPECT_TRUE(code_ok) << c.field << ": " << CodeName(s.error_code()) << " '"
                         << s.error_message().substr(0, 200) << "'";
    EXPECT_TRUE(message_ok) << c.field << ": a " << s.error_message().size()
                            << "-character message";
    EXPECT_TRUE(after.ok()) << "after " << c.field
                            << " the channel fails: " << CodeName(after.error_code()) << " '"
                            << after.error_message() << "'";
  }
  for (uint64_t s : created) EXPECT_TRUE(admin_->Free("m", s).ok());
  // Nothing else changed: one model, one sequence.
  auto models = admin_->ListModels();
  ASSERT_TRUE(models.ok()) << models.status();
  ASSERT_EQ(models->size(), 1u);
  EXPECT_EQ((*models)[0].layout.name, "m");
  EXPECT_EQ(StatsOf(*admin_, "m").sequences, 1u);
  std::cerr << "[fault] long strings: " << cases.size() << " fields, " << wrong
            << " with a wrong code, a message of 1 KiB or more, or a broken channel after; the "
               "longest message had "
            << longest << " characters\n";
}

}  // namespace
}  // namespace kvbank::integ
