// The CUDA IPC plane's refusals through the real kvbankd on a server that cannot serve it (host
// memory, or a build without CUDA: what CI runs): every call answers a clear status naming the
// problem and changes nothing. The device-to-device path itself is tests/gpu/gpu_cuda_ipc_test.cc.
#include <string>

#include "grpcpp/grpcpp.h"
#include "kvbank/v1/kvbank.grpc.pb.h"
#include "tests/integration/prefix_support.h"

namespace kvbank::integ {
namespace {

class CudaIpcRefusalTest : public KvbankdTest {
 protected:
  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(
        StartServer({"--models=", "--enable-prefix-caching=false", "--device=host"}));
    client_ = NewClient();
    auto model = client_->EnsureModel(SmallLayout("m"), 64 * BlockBytes(SmallLayout("m")));
    ASSERT_TRUE(model.ok()) << model.status();
    per_token_ = model->payload_bytes_per_token;
    auto seq = client_->CreateSequence("m");
    ASSERT_TRUE(seq.ok()) << seq.status();
    seq_ = seq->id;
    stub_ = v1::KvBank::NewStub(
        grpc::CreateChannel(server_->target(), grpc::InsecureChannelCredentials()));
  }

  std::unique_ptr<grpc::ClientContext> Ctx() {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    return ctx;
  }
  grpc::Status Append(const v1::AppendHeader& h) {
    auto ctx = Ctx();
    v1::AppendResponse resp;
    auto w = stub_->Append(ctx.get(), &resp);
    v1::AppendRequest req;
    *req.mutable_header() = h;
    w->Write(req);
    w->WritesDone();
    return w->Finish();
  }
  grpc::Status Fetch(const v1::FetchRequest& req) {
    auto ctx = Ctx();
    auto r = stub_->Fetch(ctx.get(), req);
    v1::FetchResponse resp;
    while (r->Read(&resp)) {
    }
    return r->Finish();
  }
  v1::AppendHeader Header() const {
    v1::AppendHeader h;
    h.set_model("m");
    h.set_sequence_id(seq_);
    h.set_num_tokens(3);
    h.set_dtype(v1::DTYPE_FP16);
    return h;
  }
  void ExpectUnchanged() {
    auto info = client_->GetSequence("m", seq_);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->length, 0u);
  }

  std::unique_ptr<Client> client_;
  uint64_t seq_ = 0;
  uint64_t per_token_ = 0;
  std::unique_ptr<v1::KvBank::Stub> stub_;
};

#define EXPECT_STATUS(s, code, text)                                                  \
  do {                                                                                \
    const grpc::Status st_ = (s);                                                     \
    EXPECT_EQ(st_.error_code(), grpc::StatusCode::code) << st_.error_message();       \
    EXPECT_TRUE(absl::StrContains(st_.error_message(), text)) << st_.error_message(); \
  } while (0)

TEST_F(CudaIpcRefusalTest, RegisterAndUnregisterAreFailedPreconditionNamingThePlane) {
  v1::RegisterDeviceRegionRequest req;
  req.set_handle(std::string(64, '\x01'));
  req.set_size(4096);
  v1::RegisterDeviceRegionResponse resp;
  EXPECT_STATUS(stub_->RegisterDeviceRegion(Ctx().get(), req, &resp), FAILED_PRECONDITION,
                "CUDA IPC plane");
  v1::UnregisterDeviceRegionRequest un;
  un.set_region_id(1);
  v1::UnregisterDeviceRegionResponse unresp;
  EXPECT_STATUS(stub_->UnregisterDeviceRegion(Ctx().get(), un, &unresp), FAILED_PRECONDITION,
                "CUDA IPC plane");
}

TEST_F(CudaIpcRefusalTest, AppendFromADeviceRegionIsRefusedAndChangesNothing) {
  v1::AppendHeader h = Header();
  h.mutable_device_source()->set_region_id(7);
  h.mutable_device_source()->set_length(1);
  EXPECT_STATUS(Append(h), FAILED_PRECONDITION, "CUDA IPC plane");
  ExpectUnchanged();
  h.mutable_device_source()->set_region_id(0);
  EXPECT_STATUS(Append(h), INVALID_ARGUMENT, "header.device_source.region_id");
  ExpectUnchanged();
  h.mutable_device_source()->set_region_id(7);
  h.mutable_source()->set_region_id(7);
  EXPECT_STATUS(Append(h), INVALID_ARGUMENT, "header.device_source");
  ExpectUnchanged();
}

// The C++ SDK's calls reach the plane (and its refusals) without CUDA in the client.
TEST_F(CudaIpcRefusalTest, TheSdkCallsReachThePlane) {
  const std::vector<uint8_t> handle(64, 1);
  auto r = client_->RegisterDeviceRegion(handle, 0, 4096);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_TRUE(absl::StrContains(r.status().message(), "CUDA IPC plane")) << r.status();
  Client::AppendArgs args;
  args.num_tokens = 3;
  args.dtype = DType::kFp16;
  auto a = client_->AppendFromDevice("m", seq_, args, {7, 0, 3 * per_token_});
  EXPECT_EQ(a.status().code(), absl::StatusCode::kFailedPrecondition) << a.status();
  ExpectUnchanged();
  auto f = client_->FetchToDevice("m", seq_, {}, {7, 0, 1 << 20});
  EXPECT_EQ(f.status().code(), absl::StatusCode::kFailedPrecondition) << f.status();
  EXPECT_EQ(client_->UnregisterDeviceRegion(7).code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(CudaIpcRefusalTest, FetchIntoADeviceRegionIsRefused) {
  Client::AppendArgs args;
  args.num_tokens = 2;
  args.dtype = DType::kFp16;
  auto a = client_->Append("m", seq_, args, std::vector<uint8_t>(2 * per_token_, 0));
  ASSERT_TRUE(a.ok()) << a.status();
  v1::FetchRequest req;
  req.set_model("m");
  req.set_sequence_id(seq_);
  req.mutable_device_dest()->set_region_id(7);
  req.mutable_device_dest()->set_length(1 << 20);
  EXPECT_STATUS(Fetch(req), FAILED_PRECONDITION, "CUDA IPC plane");
  req.mutable_device_dest()->set_region_id(0);
  EXPECT_STATUS(Fetch(req), INVALID_ARGUMENT, "device_dest.region_id");
  req.mutable_device_dest()->set_region_id(7);
  req.mutable_dest()->set_region_id(7);
  EXPECT_STATUS(Fetch(req), INVALID_ARGUMENT, "device_dest");
  // The plain fetch still works: nothing was held or changed.
  auto f = client_->Fetch("m", seq_, {});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->num_tokens, 2u);
}

// FetchBlocks into a device region: refused as a Fetch is, before any block is looked up.
TEST_F(CudaIpcRefusalTest, FetchBlocksIntoADeviceRegionIsRefused) {
  v1::FetchBlocksRequest req;
  req.set_model("m");
  req.add_block_hashes(std::string(32, '\x07'));
  req.mutable_device_dest()->set_region_id(7);
  req.mutable_device_dest()->set_length(1 << 20);
  auto fetch_blocks = [&] {
    auto ctx = Ctx();
    auto r = stub_->FetchBlocks(ctx.get(), req);
    v1::FetchResponse resp;
    while (r->Read(&resp)) {
    }
    return r->Finish();
  };
  EXPECT_STATUS(fetch_blocks(), FAILED_PRECONDITION, "CUDA IPC plane");
  req.mutable_device_dest()->set_region_id(0);
  EXPECT_STATUS(fetch_blocks(), INVALID_ARGUMENT, "device_dest.region_id");
  req.mutable_device_dest()->set_region_id(7);
  req.mutable_dest()->set_region_id(7);
  EXPECT_STATUS(fetch_blocks(), INVALID_ARGUMENT, "dest and device_dest");
  BlockHash h;
  h.fill(7);
  auto f = client_->FetchBlocksToDevice("m", {h}, {}, {7, 0, 1 << 20});
  EXPECT_EQ(f.status().code(), absl::StatusCode::kFailedPrecondition) << f.status();
  EXPECT_TRUE(absl::StrContains(f.status().message(), "CUDA IPC plane")) << f.status();
}

// GetServerInfo tells a client which planes it may pick: none of the GPU ones on a host pool,
// and the host it runs on (this one).
TEST_F(CudaIpcRefusalTest, ServerInfoSaysWhichPlanesAreServed) {
  auto info = client_->GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_FALSE(info->cuda_ipc_device.has_value());
  EXPECT_FALSE(info->nccl);
  EXPECT_TRUE(absl::StrContains(info->nccl_off, "NCCL")) << info->nccl_off;
  EXPECT_FALSE(info->host_id.empty());
  EXPECT_EQ(info->host_id, LocalHostId());
  EXPECT_TRUE(info->OnThisHost());
  Client::ServerInfo elsewhere = *info;
  elsewhere.host_id = "another-machine";
  EXPECT_FALSE(elsewhere.OnThisHost());
}

}  // namespace
}  // namespace kvbank::integ
