// The NCCL plane's RPCs against the real kvbankd where it cannot serve them: host-memory pools
// (this suite's server: --device host, as on a machine without a GPU), or a build without NCCL.
// Every call refuses with the status that names what is missing, changes nothing and leaves the
// server serving; the SDK's calls answer UNIMPLEMENTED (SDK without NCCL) or FAILED_PRECONDITION.
// Transfers themselves need GPUs: tests/gpu/gpu_nccl_plane_test.cc.
#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "grpcpp/grpcpp.h"
#include "kvbank/v1/kvbank.grpc.pb.h"
#include "tests/integration/prefix_support.h"

namespace kvbank::integ {
namespace {

class NcclTest : public KvbankdTest {
 protected:
  void Start() {
    ASSERT_NO_FATAL_FAILURE(
        StartServer({"--models=", "--device=host", "--enable-prefix-caching=false"}));
    client_ = NewClient();
    model_ = SmallLayout("m");
    auto m = client_->EnsureModel(model_, 16 * BlockBytes(model_));
    ASSERT_TRUE(m.ok()) << m.status();
    per_token_ = m->payload_bytes_per_token;
    auto seq = client_->CreateSequence("m");
    ASSERT_TRUE(seq.ok()) << seq.status();
    seq_ = seq->id;
    stub_ = v1::KvBank::NewStub(
        grpc::CreateChannel(server_->target(), grpc::InsecureChannelCredentials()));
  }
  std::unique_ptr<grpc::ClientContext> Ctx() {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
    return ctx;
  }
  // An Append of 3 tokens whose header is `h` (model and sequence filled in unless set).
  grpc::Status Append(v1::AppendHeader h) {
    if (h.model().empty()) h.set_model("m");
    if (h.sequence_id() == 0) h.set_sequence_id(seq_);
    h.set_num_tokens(3);
    auto ctx = Ctx();
    v1::AppendResponse resp;
    auto w = stub_->Append(ctx.get(), &resp);
    v1::AppendRequest req;
    *req.mutable_header() = h;
    w->Write(req);
    w->WritesDone();
    return w->Finish();
  }
  grpc::Status Fetch(v1::FetchRequest req) {
    req.set_model("m");
    req.set_sequence_id(seq_);
    auto ctx = Ctx();
    auto r = stub_->Fetch(ctx.get(), req);
    v1::FetchResponse resp;
    while (r->Read(&resp)) {
    }
    return r->Finish();
  }
  // The sequence is as it was: empty.
  void ExpectUnchanged() {
    auto info = client_->GetSequence("m", seq_);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->length, 0u);
  }

  std::unique_ptr<Client> client_;
  ModelLayout model_;
  uint64_t per_token_ = 0;
  uint64_t seq_ = 0;
  std::unique_ptr<v1::KvBank::Stub> stub_;
};

v1::NcclTransfer Transfer(uint64_t comm = 7, uint32_t peer = 0) {
  v1::NcclTransfer t;
  t.set_comm_id(comm);
  t.set_peer_rank(peer);
  return t;
}

// What a server without the plane answers: FAILED_PRECONDITION saying which of NCCL (build) or
// a CUDA pool is missing.
void ExpectPlaneOff(const grpc::Status& s, const char* what) {
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
      << what << ": " << s.error_message();
  const std::string& m = s.error_message();
  EXPECT_TRUE(absl::StrContains(m, "built without NCCL") ||
              absl::StrContains(m, "the NCCL plane needs a CUDA pool"))
      << what << ": " << m;
}

TEST_F(NcclTest, ConnectAndDisconnectRefuseWithoutACudaPool) {
  ASSERT_NO_FATAL_FAILURE(Start());
  v1::NcclConnectRequest req;
  req.set_unique_id(std::string(128, '\x01'));
  req.set_nranks(2);
  req.set_server_rank(1);
  v1::NcclConnectResponse resp;
  ExpectPlaneOff(stub_->NcclConnect(Ctx().get(), req, &resp), "NcclConnect");
  v1::NcclDisconnectRequest d;
  d.set_comm_id(1);
  v1::NcclDisconnectResponse dresp;
  ExpectPlaneOff(stub_->NcclDisconnect(Ctx().get(), d, &dresp), "NcclDisconnect");
  // Still serving.
  ASSERT_TRUE(client_->GetSequence("m", seq_).ok());
}

TEST_F(NcclTest, AppendOverNcclRefusesAndAppendsNothing) {
  ASSERT_NO_FATAL_FAILURE(Start());
  v1::AppendHeader h;
  *h.mutable_nccl() = Transfer();
  h.set_dtype(v1::DTYPE_FP16);
  ExpectPlaneOff(Append(h), "Append with header.nccl");
  ExpectUnchanged();
  // The append's own checks come first: an unknown model is NOT_FOUND, as without nccl.
  v1::AppendHeader unknown = h;
  unknown.set_model("nope");
  EXPECT_EQ(Append(unknown).error_code(), grpc::StatusCode::NOT_FOUND);
  // A region and a communicator at once: INVALID_ARGUMENT naming both.
  v1::AppendHeader both = h;
  both.mutable_source()->set_region_id(1);
  const grpc::Status s = Append(both);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_TRUE(absl::StrContains(s.error_message(), "header.nccl excludes header.source"))
      << s.error_message();
  ExpectUnchanged();
}

TEST_F(NcclTest, FetchOverNcclRefuses) {
  ASSERT_NO_FATAL_FAILURE(Start());
  Client::AppendArgs two;
  two.num_tokens = 2;
  two.dtype = DType::kFp16;
  ASSERT_TRUE(client_->Append("m", seq_, two, std::vector<uint8_t>(2 * per_token_, 0)).ok());
  v1::FetchRequest req;
  *req.mutable_nccl() = Transfer();
  ExpectPlaneOff(Fetch(req), "Fetch with nccl");
  v1::FetchRequest waiting = req;
  waiting.set_wait_ms(10);
  waiting.set_token_end(2);
  grpc::Status s = Fetch(waiting);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_TRUE(absl::StrContains(s.error_message(), "wait_ms")) << s.error_message();
  v1::FetchRequest both = req;
  both.mutable_dest()->set_region_id(1);
  s = Fetch(both);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_TRUE(absl::StrContains(s.error_message(), "nccl excludes dest")) << s.error_message();
  auto info = client_->GetSequence("m", seq_);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->length, 2u);
}

TEST_F(NcclTest, SdkRefusesWithoutACommunicator) {
  ASSERT_NO_FATAL_FAILURE(Start());
  std::vector<uint8_t> host(3 * per_token_);
  // No communicator: nothing is sent (the pointer is never read).
  Client::AppendArgs three;
  three.num_tokens = 3;
  auto a = client_->AppendOverNccl("m", seq_, three, host.data(), host.size());
  EXPECT_TRUE(a.status().code() == absl::StatusCode::kFailedPrecondition ||
              a.status().code() == absl::StatusCode::kUnimplemented)
      << a.status();
  auto f = client_->FetchOverNccl("m", seq_, {}, host.data(), host.size());
  EXPECT_TRUE(f.status().code() == absl::StatusCode::kFailedPrecondition ||
              f.status().code() == absl::StatusCode::kUnimplemented)
      << f.status();
  // Connecting: the SDK without NCCL, a machine without the device, or this server's refusal.
  const absl::Status c = client_->NcclConnect(0);
  EXPECT_TRUE(c.code() == absl::StatusCode::kFailedPrecondition ||
              c.code() == absl::StatusCode::kUnimplemented)
      << c;
  ExpectUnchanged();
}

}  // namespace
}  // namespace kvbank::integ
