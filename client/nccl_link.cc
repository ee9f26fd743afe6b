// client/nccl_link.h. With KVBANK_SDK_NCCL: a non-blocking NCCL communicator whose every
// operation is polled against a deadline (a peer that never takes part must not hang the caller:
// past it the communicator is aborted). Without: UNIMPLEMENTED.
#include "client/nccl_link.h"

#include <string>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#ifdef KVBANK_SDK_NCCL
#include <cuda_runtime.h>
#include <nccl.h>

#include "absl/synchronization/mutex.h"
#endif

namespace kvbank::internal {

#ifndef KVBANK_SDK_NCCL

bool NcclInSdk() { return false; }

absl::StatusOr<std::unique_ptr<NcclLink>> NcclLink::Connect(v1::KvBank::Stub*, PrepareCall, int,
                                                            absl::Duration) {
  return absl::UnimplementedError(
      "this kvbank SDK was built without NCCL (it needs CUDA and libnccl at build time)");
}

#else  // KVBANK_SDK_NCCL

bool NcclInSdk() { return true; }

namespace {

constexpr int kClientRank = 0;
constexpr int kServerRank = 1;

absl::Status FromGrpcStatus(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

std::string CudaText(cudaError_t e) {
  return absl::StrCat(cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
}

// Makes `device` current for the guard's life (CUDA's current device is per thread).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    status_ = cudaSetDevice(device);
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  cudaError_t status() const { return status_; }

 private:
  int previous_ = -1;
  cudaError_t status_ = cudaSuccess;
};

bool ServerReady(const grpc::ClientContext& ctx, uint64_t* bytes) {
  const auto& md = ctx.GetServerInitialMetadata();
  auto it = md.find("kvbank-nccl");
  if (it == md.end() || std::string(it->second.data(), it->second.size()) != "ready") return false;
  if (bytes != nullptr) {
    auto b = md.find("kvbank-nccl-bytes");
    if (b == md.end() ||
        !absl::SimpleAtoi(absl::string_view(b->second.data(), b->second.size()), bytes)) {
      return false;
    }
  }
  return true;
}

class NcclLinkImpl final : public NcclLink {
 public:
  NcclLinkImpl(v1::KvBank::Stub* stub, PrepareCall prepare, int device, absl::Duration timeout)
      : stub_(stub), prepare_(std::move(prepare)), device_(device), timeout_(timeout) {}

  ~NcclLinkImpl() override {
    absl::MutexLock lock(&mu_);
    if (comm_id_ != 0 && broken_.ok()) {
      grpc::ClientContext ctx;
      prepare_(&ctx, false);
      v1::NcclDisconnectRequest req;
      req.set_comm_id(comm_id_);
      v1::NcclDisconnectResponse resp;
      stub_->NcclDisconnect(&ctx, req, &resp);  // best effort: kvbankd's lease ends it anyway
    }
    DeviceGuard guard(device_);
    if (comm_ != nullptr) ncclCommAbort(comm_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  absl::Status Open() {
    absl::MutexLock lock(&mu_);
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      cudaGetLastError();
      n = 0;
    }
    if (device_ < 0 || device_ >= n) {
      return absl::FailedPreconditionError(
          absl::StrCat("no CUDA device ", device_, " for NCCL: this machine has ", n));
    }
    DeviceGuard guard(device_);
    if (guard.status() != cudaSuccess) {
      return absl::InternalError(absl::StrCat("cuda:", device_, ": ", CudaText(guard.status())));
    }
    if (cudaError_t e = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
        e != cudaSuccess) {
      return absl::InternalError(absl::StrCat("cuda:", device_, ": ", CudaText(e)));
    }
    ncclUniqueId uid;
    if (ncclResult_t r = ncclGetUniqueId(&uid); r != ncclSuccess) {
      return absl::InternalError(absl::StrCat("ncclGetUniqueId: ", ncclGetErrorString(r)));
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    const ncclResult_t r = ncclCommInitRankConfig(&comm_, 2, uid, kClientRank, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      return absl::InternalError(absl::StrCat("ncclCommInitRank: ", ncclGetErrorString(r)));
    }
    // kvbankd joins as rank 1 while this rank's join is in progress.
    v1::NcclConnectRequest req;
    req.set_unique_id(std::string(uid.internal, sizeof(uid.internal)));
    req.set_nranks(2);
    req.set_server_rank(kServerRank);
    v1::NcclConnectResponse resp;
    grpc::ClientContext ctx;
    prepare_(&ctx, false);
    if (absl::Status s = FromGrpcStatus(stub_->NcclConnect(&ctx, req, &resp)); !s.ok()) return s;
    comm_id_ = resp.comm_id();
    return Wait(absl::Now() + timeout_, "ncclCommInitRank (waiting for kvbankd to join)", false);
  }

  uint64_t comm_id() const override { return comm_id_; }

  absl::StatusOr<v1::AppendResponse> Append(v1::AppendHeader header,
                                            const void* device_ptr) override {
    absl::MutexLock lock(&mu_);
    if (!broken_.ok()) return broken_;
    const uint64_t bytes = header.payload_bytes();
    header.mutable_nccl()->set_comm_id(comm_id_);
    header.mutable_nccl()->set_peer_rank(kClientRank);
    grpc::ClientContext ctx;
    prepare_(&ctx, true);
    v1::AppendResponse resp;
    auto writer = stub_->Append(&ctx, &resp);
    v1::AppendRequest first;
    *first.mutable_header() = std::move(header);
    writer->Write(first);
    writer->WaitForInitialMetadata();
    absl::Status sent = absl::OkStatus();
    const bool ready = ServerReady(ctx, nullptr);
    if (ready) {
      DeviceGuard guard(device_);
      ncclComm_t comm = comm_;
      cudaStream_t stream = stream_;
      sent =
          Issue([&] { return ncclSend(device_ptr, bytes, ncclUint8, kServerRank, comm, stream); },
                "ncclSend");
      if (!sent.ok()) ctx.TryCancel();
    }
    writer->WritesDone();
    absl::Status s = FromGrpcStatus(writer->Finish());
    if (!sent.ok()) return sent;
    if (!s.ok()) {
      if (ready) Break(s).IgnoreError();  // kvbankd may have left this rank's send unmatched
      return s;
    }
    return resp;
  }

  absl::StatusOr<v1::FetchHeader> Fetch(v1::FetchRequest req, void* device_ptr,
                                        uint64_t capacity) override {
    absl::MutexLock lock(&mu_);
    if (!broken_.ok()) return broken_;
    req.mutable_nccl()->set_comm_id(comm_id_);
    req.mutable_nccl()->set_peer_rank(kClientRank);
    req.mutable_nccl()->set_max_bytes(capacity);
    grpc::ClientContext ctx;
    prepare_(&ctx, true);
    auto reader = stub_->Fetch(&ctx, req);
    reader->WaitForInitialMetadata();
    uint64_t bytes = 0;
    absl::Status received = absl::OkStatus();
    const bool ready = ServerReady(ctx, &bytes);
    if (ready && bytes > capacity) {
      received = absl::InternalError(
          absl::StrCat("kvbankd is sending ", bytes, " bytes into a buffer of ", capacity));
      ctx.TryCancel();
      Break(received).IgnoreError();
    } else if (ready) {
      DeviceGuard guard(device_);
      ncclComm_t comm = comm_;
      cudaStream_t stream = stream_;
      received =
          Issue([&] { return ncclRecv(device_ptr, bytes, ncclUint8, kServerRank, comm, stream); },
                "ncclRecv");
      if (!received.ok()) ctx.TryCancel();
    }
    v1::FetchResponse resp;
    bool got = false;
    while (reader->Read(&resp)) got = true;
    absl::Status s = FromGrpcStatus(reader->Finish());
    if (!received.ok()) return received;
    if (!s.ok()) {
      if (ready) Break(s).IgnoreError();
      return s;
    }
    if (!got || !resp.has_header()) {
      return absl::InternalError("a fetch over NCCL answered with no header");
    }
    return resp.header();
  }

 private:
  // One operation in its own group, polled until it and the stream are done.
  template <typename Op>
  absl::Status Issue(Op op, const char* what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    ncclResult_t r = ncclGroupStart();
    if (r == ncclSuccess) {
      r = op();
      const ncclResult_t end = ncclGroupEnd();
      if (r == ncclSuccess) r = end;
    }
    if (r != ncclSuccess && r != ncclInProgress) {
      return Break(absl::InternalError(absl::StrCat(what, ": ", ncclGetErrorString(r))));
    }
    return Wait(absl::Now() + timeout_, what, true);
  }

  // NOTE: polls with short sleeps: NCCL's non-blocking API has no completion callback.
  absl::Status Wait(absl::Time deadline, const char* what, bool stream)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (;;) {
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(comm_, &async);
      if (async != ncclSuccess && async != ncclInProgress) {
        return Break(absl::InternalError(absl::StrCat(what, ": ", ncclGetErrorString(async))));
      }
      if (async == ncclSuccess) {
        const cudaError_t q = stream ? cudaStreamQuery(stream_) : cudaSuccess;
        if (q == cudaSuccess) return absl::OkStatus();
        if (q != cudaErrorNotReady) {
          return Break(absl::InternalError(absl::StrCat(what, ": ", CudaText(q))));
        }
      }
      if (absl::Now() >= deadline) {
        return Break(absl::DeadlineExceededError(
            absl::StrCat(what, ": kvbankd's rank did not take part in time")));
      }
      absl::SleepFor(absl::Microseconds(20));
    }
  }

  // Aborts the communicator; every later call answers FAILED_PRECONDITION naming `why`.
  absl::Status Break(absl::Status why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (comm_ != nullptr) {
      ncclCommAbort(comm_);
      comm_ = nullptr;
    }
    if (broken_.ok()) {
      broken_ = absl::FailedPreconditionError(absl::StrCat(
          "the NCCL communicator was aborted (", why.message(), "): call NcclConnect again"));
    }
    return why;
  }

  v1::KvBank::Stub* const stub_;
  const PrepareCall prepare_;
  const int device_;
  const absl::Duration timeout_;
  absl::Mutex mu_;  // one transfer at a time
  ncclComm_t comm_ ABSL_GUARDED_BY(mu_) = nullptr;
  cudaStream_t stream_ ABSL_GUARDED_BY(mu_) = nullptr;
  uint64_t comm_id_ = 0;  // set by Open
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<NcclLink>> NcclLink::Connect(v1::KvBank::Stub* stub,
                                                            PrepareCall prepare, int device,
                                                            absl::Duration timeout) {
  auto link = std::make_unique<NcclLinkImpl>(stub, std::move(prepare), device, timeout);
  if (absl::Status s = link->Open(); !s.ok()) return s;  // the destructor aborts what began
  return std::unique_ptr<NcclLink>(std::move(link));
}

#endif  // KVBANK_SDK_NCCL

}  // namespace kvbank::internal
