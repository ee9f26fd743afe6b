// The C++ SDK's data planes: shared-memory regions, CUDA IPC device regions and the NCCL
// communicator (kvbank/client.h). The memfd and socket steps are in shm_region.cc, the NCCL
// link in nccl_link.cc; the gRPC steps are here.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "client/client_internal.h"
#include "client/nccl_link.h"
#include "client/shm_control_channel.h"
#include "client/shm_handshake.h"
#include "kvbank/client.h"
#include "proto/convert.h"
#include "proto/wire.h"

namespace kvbank {

using internal::FromGrpc;
using internal::FromProto;
using internal::MakeFetchBlocksRequest;
using internal::MakeFetchRequest;
using internal::MakeHeader;
using internal::SetSlice;

namespace {
// The answer of a fetch into a region: its header (the payload is in the region). `limit`: the
// slice's length. The server's payload_bytes is its word: past the slice, the answer is an
// error, never a length the caller would read beyond its slice with.
absl::StatusOr<Client::FetchResult> FetchResultOf(const v1::FetchResponse& resp, uint64_t limit) {
  if (!resp.has_header() || !resp.data().empty()) {
    return absl::InternalError("a fetch into a region answered with no header, or with data");
  }
  bool dtype_ok = false;
  Client::FetchResult r = internal::ResultFromHeader(resp.header(), &dtype_ok);
  if (!dtype_ok) return absl::InternalError("a fetch into a region answered with no payload dtype");
  if (r.payload_bytes > limit) {
    return absl::InternalError(absl::StrCat("a fetch into a region of ", limit, " bytes answered ",
                                            r.payload_bytes, " payload bytes"));
  }
  return r;
}

// The one message of a fetch into a region (gRPC), as FetchResultOf.
template <typename Reader>
absl::StatusOr<Client::FetchResult> ReadRegionHeader(Reader& reader, uint64_t limit) {
  v1::FetchResponse resp;
  bool got = false;
  while (reader.Read(&resp)) got = true;
  if (auto s = FromGrpc(reader.Finish()); !s.ok()) return s;
  if (!got) return absl::InternalError("a fetch into a region answered no message");
  return FetchResultOf(resp, limit);
}

// The streams of the two fetches a slice can receive.
std::unique_ptr<grpc::ClientReader<v1::FetchResponse>> Open(v1::KvBank::Stub* stub,
                                                            grpc::ClientContext* ctx,
                                                            const v1::FetchRequest& req) {
  return stub->Fetch(ctx, req);
}
std::unique_ptr<grpc::ClientReader<v1::FetchResponse>> Open(v1::KvBank::Stub* stub,
                                                            grpc::ClientContext* ctx,
                                                            const v1::FetchBlocksRequest& req) {
  return stub->FetchBlocks(ctx, req);
}

}  // namespace

std::shared_ptr<internal::ShmControlChannel> Client::Impl::Control() {
  if (!options.shm_control || options.shm_socket.empty()) return nullptr;
  absl::MutexLock lock(&control_mu);
  if (control != nullptr && !control->broken()) return control;
  // A channel that broke (kvbankd restarted, say) is opened again once; if that fails, region
  // transfers stay on gRPC.
  if (control_off) return nullptr;
  control.reset();
  auto info = owner->GetServerInfo();
  if (!info.ok() || info->shm_control_version != proto::kShmControlVersion ||
      info->shm_socket != options.shm_socket) {
    control_off = true;
    return nullptr;
  }
  // One page: the region is there for its connection, which binds the frames to this tenant.
  auto region = owner->RegisterRegion(4096);
  if (!region.ok()) {
    control_off = true;
    return nullptr;
  }
  const int conn = (*region)->conn_;
  control = std::make_shared<internal::ShmControlChannel>(*std::move(region), conn);
  return control;
}

namespace {

// A region transfer as a control frame on `channel`: its answer, or nullopt when nothing of it
// reached the server (it may go by gRPC then).
template <typename Answer, typename Body>
std::optional<absl::StatusOr<Answer>> AskOverSocket(internal::ShmControlChannel& channel, Body body,
                                                    absl::Time deadline, absl::Duration spin) {
  proto::ShmControlRequest request;
  request.body = std::move(body);
  internal::ShmControlChannel::Outcome out = channel.Call(std::move(request), deadline, spin);
  if (!out.reply.ok()) {
    if (!out.sent) return std::nullopt;
    return out.reply.status();
  }
  if (!out.reply->status.ok()) return out.reply->status;
  const Answer* answer = std::get_if<Answer>(&out.reply->answer);
  if (answer == nullptr) return absl::InternalError("a control frame answered the wrong reply");
  return *answer;
}

}  // namespace

absl::Duration Client::Impl::SpinFor(uint64_t bytes, uint64_t others) const {
  if (bytes <= kShmControlSpinBytes) return options.shm_control_spin;
  if (bytes > kShmControlLoneSpinBytes || others != 0 ||
      options.shm_control_spin <= absl::ZeroDuration()) {
    return absl::ZeroDuration();
  }
  return options.shm_control_spin +
         absl::Nanoseconds(bytes * 1'000'000'000 / kShmControlSpinBytesPerSecond);
}

template <typename Answer, typename Body>
std::optional<absl::StatusOr<Answer>> Client::Impl::AskControl(internal::ShmControlChannel& channel,
                                                               Body body, uint64_t bytes) {
  const uint64_t others = control_in_flight.fetch_add(1, std::memory_order_acq_rel);
  auto answer = AskOverSocket<Answer>(
      channel, std::move(body), absl::Now() + options.stream_deadline, SpinFor(bytes, others));
  control_in_flight.fetch_sub(1, std::memory_order_acq_rel);
  if (answer.has_value()) control_requests.fetch_add(1, std::memory_order_relaxed);
  return answer;
}

template <typename Request>
absl::StatusOr<Client::FetchResult> Client::Impl::FetchToSlice(Request req, const RegionSlice& dest,
                                                               bool device) {
  SetSlice(dest, device ? req.mutable_device_dest() : req.mutable_dest());
  if (std::shared_ptr<internal::ShmControlChannel> channel = Control()) {
    auto answer = AskControl<v1::FetchResponse>(*channel, req, dest.bytes());
    if (answer.has_value()) {
      if (!answer->ok()) return answer->status();
      return FetchResultOf(**answer, dest.bytes());
    }
  }
  grpc::ClientContext ctx;
  Deadline(&ctx, true);
  auto reader = Open(stub.get(), &ctx, req);
  return ReadRegionHeader(*reader, dest.bytes());
}

absl::StatusOr<Client::SequenceInfo> Client::Impl::AppendFromSlice(v1::AppendHeader header,
                                                                   const RegionSlice& source,
                                                                   bool device) {
  // payload_bytes 0: the server checks source.length against the payload and names that field.
  SetSlice(source, device ? header.mutable_device_source() : header.mutable_source());
  if (std::shared_ptr<internal::ShmControlChannel> channel = Control()) {
    auto answer = AskControl<v1::AppendResponse>(*channel, header, source.bytes());
    if (answer.has_value()) {
      if (!answer->ok()) return answer->status();
      return FromProto((*answer)->sequence());
    }
  }
  return StreamAppend(header, {});
}

absl::StatusOr<std::shared_ptr<internal::NcclLink>> Client::Impl::Nccl() {
  std::shared_ptr<internal::NcclLink> link;
  {
    absl::MutexLock lock(&nccl_mu);
    link = nccl;
  }
  if (link == nullptr) {
    return internal::NcclInSdk()
               ? absl::FailedPreconditionError("no NCCL communicator: call NcclConnect first")
               : absl::UnimplementedError("this kvbank SDK was built without NCCL");
  }
  return link;
}

absl::StatusOr<std::unique_ptr<ShmRegion>> Client::RegisterRegion(uint64_t size) {
  if (impl_->options.shm_socket.empty()) {
    return absl::FailedPreconditionError(
        "ClientOptions::shm_socket is not set (kvbankd's --shm-socket path)");
  }
  auto fd = internal::CreateSealedMemfd(size);
  if (!fd.ok()) return fd.status();
  return RegisterMemfd(*fd, size, /*populate=*/false);
}

absl::StatusOr<std::unique_ptr<ShmRegion>> Client::RegisterRegionFd(int fd) {
  if (impl_->options.shm_socket.empty()) {
    return absl::FailedPreconditionError(
        "ClientOptions::shm_socket is not set (kvbankd's --shm-socket path)");
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("descriptor ", fd, " is not a non-empty memfd or shared-memory file"));
  }
  const int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (own < 0) {
    return absl::InternalError(absl::StrCat("dup of descriptor ", fd, ": ", std::strerror(errno)));
  }
  return RegisterMemfd(own, uint64_t(st.st_size), /*populate=*/true);
}

absl::StatusOr<std::unique_ptr<ShmRegion>> Client::RegisterMemfd(int fd, uint64_t size,
                                                                 bool populate) {
  std::unique_ptr<ShmRegion> region(new ShmRegion());
  region->memfd_ = fd;
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  // A page of the caller's file that was never touched is a hole, which kvbankd refuses (its
  // own copies would allocate it, on its account): allocate such pages here, on the caller's,
  // without changing a byte (MADV_POPULATE_WRITE, Linux 5.14; older kernels: kvbankd says which
  // byte has no page).
  constexpr int kPopulateWrite = 23;  // MADV_POPULATE_WRITE, absent from older headers
  if (populate && p != MAP_FAILED) (void)madvise(p, size, kPopulateWrite);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot map a ", size, "-byte region: ", std::strerror(errno)));
  }
  region->data_ = static_cast<uint8_t*>(p);
  region->size_ = size;
  auto handoff = internal::HandOver(impl_->options.shm_socket, fd);
  if (!handoff.ok()) return handoff.status();
  region->conn_ = handoff->conn;
  v1::RegisterRegionRequest req;
  req.set_handle(handoff->handle);
  v1::RegisterRegionResponse resp;
  if (auto s = impl_->Call(&v1::KvBank::Stub::RegisterRegion, req, &resp); !s.ok()) return s;
  region->id_ = resp.region_id();
  return region;
}

uint64_t Client::ShmControlRequests() const {
  return impl_->control_requests.load(std::memory_order_relaxed);
}

absl::Status Client::UnregisterRegion(uint64_t region_id) {
  return impl_->Unregister(&v1::KvBank::Stub::UnregisterRegion, region_id);
}

absl::StatusOr<Client::SequenceInfo> Client::AppendFromRegion(const std::string& model, uint64_t id,
                                                              const AppendArgs& args,
                                                              const RegionSlice& source) {
  return impl_->AppendFromSlice(MakeHeader(model, id, args, 0), source, /*device=*/false);
}

absl::StatusOr<Client::FetchResult> Client::FetchToRegion(const std::string& model, uint64_t id,
                                                          const FetchArgs& args,
                                                          const RegionSlice& dest) {
  return impl_->FetchToSlice(MakeFetchRequest(model, id, args), dest, /*device=*/false);
}

absl::StatusOr<Client::DeviceRegion> Client::RegisterDeviceRegion(
    absl::Span<const uint8_t> ipc_handle, uint64_t offset, uint64_t size) {
  v1::RegisterDeviceRegionRequest req;
  req.set_handle(std::string(ipc_handle.begin(), ipc_handle.end()));
  req.set_offset(offset);
  req.set_size(size);
  v1::RegisterDeviceRegionResponse resp;
  if (auto s = impl_->Call(&v1::KvBank::Stub::RegisterDeviceRegion, req, &resp); !s.ok()) {
    return s;
  }
  return DeviceRegion{resp.region_id(), resp.size(), resp.device()};
}

absl::Status Client::UnregisterDeviceRegion(uint64_t region_id) {
  return impl_->Unregister(&v1::KvBank::Stub::UnregisterDeviceRegion, region_id);
}

absl::StatusOr<Client::SequenceInfo> Client::AppendFromDevice(const std::string& model, uint64_t id,
                                                              const AppendArgs& args,
                                                              const RegionSlice& source) {
  return impl_->AppendFromSlice(MakeHeader(model, id, args, 0), source, /*device=*/true);
}

absl::StatusOr<Client::FetchResult> Client::FetchToDevice(const std::string& model, uint64_t id,
                                                          const FetchArgs& args,
                                                          const RegionSlice& dest) {
  return impl_->FetchToSlice(MakeFetchRequest(model, id, args), dest, /*device=*/true);
}

absl::StatusOr<Client::FetchResult> Client::FetchBlocksToRegion(
    const std::string& model, const std::vector<BlockHash>& hashes, const FetchArgs& args,
    const RegionSlice& dest) {
  return impl_->FetchToSlice(MakeFetchBlocksRequest(model, hashes, args), dest,
                             /*device=*/false);
}

absl::StatusOr<Client::FetchResult> Client::FetchBlocksToDevice(
    const std::string& model, const std::vector<BlockHash>& hashes, const FetchArgs& args,
    const RegionSlice& dest) {
  return impl_->FetchToSlice(MakeFetchBlocksRequest(model, hashes, args), dest,
                             /*device=*/true);
}

absl::Status Client::NcclConnect(int device) {
  NcclDisconnect();
  auto link = internal::NcclLink::Connect(
      impl_->stub.get(),
      [impl = impl_.get()](grpc::ClientContext* ctx, bool stream) { impl->Deadline(ctx, stream); },
      device, impl_->options.call_deadline);
  if (!link.ok()) return link.status();
  absl::MutexLock lock(&impl_->nccl_mu);
  impl_->nccl = *std::move(link);
  return absl::OkStatus();
}

void Client::NcclDisconnect() {
  std::shared_ptr<internal::NcclLink> link;
  absl::MutexLock lock(&impl_->nccl_mu);
  link = std::move(impl_->nccl);
}

absl::StatusOr<Client::SequenceInfo> Client::AppendOverNccl(const std::string& model, uint64_t id,
                                                            const AppendArgs& args,
                                                            const void* device_ptr,
                                                            uint64_t bytes) {
  auto link = impl_->Nccl();
  if (!link.ok()) return link.status();
  if (bytes == 0) return absl::InvalidArgumentError("an append over NCCL of 0 bytes");
  auto resp = (*link)->Append(MakeHeader(model, id, args, bytes), device_ptr);
  if (!resp.ok()) return resp.status();
  return FromProto(resp->sequence());
}

absl::StatusOr<Client::FetchResult> Client::FetchOverNccl(const std::string& model, uint64_t id,
                                                          const FetchArgs& args, void* device_ptr,
                                                          uint64_t capacity) {
  auto link = impl_->Nccl();
  if (!link.ok()) return link.status();
  auto h = (*link)->Fetch(MakeFetchRequest(model, id, args), device_ptr, capacity);
  if (!h.ok()) return h.status();
  bool dtype_ok = false;
  FetchResult r = internal::ResultFromHeader(*h, &dtype_ok);
  if (!dtype_ok) return absl::InternalError("a fetch over NCCL answered with no payload dtype");
  return r;
}

}  // namespace kvbank
