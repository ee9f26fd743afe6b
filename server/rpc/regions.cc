// KvBankService's side of the same-host planes: the shared-memory plane
// (server/plane/shm_regions.h; an Append whose header names a source slice, a Fetch / FetchBlocks
// whose request names a dest slice) and the CUDA IPC plane (server/plane/cuda_ipc.h; device_source
// and device_dest slices, moved device to device by AppendTxn::WriteFromDevice and
// FetchReader::ReadToDevice). The payload moves in one copy between the pool and the client's
// region, through the core's transfer seam (AppendTxn::Write, FetchReader::Read), always on a
// worker: it is a whole payload, not one chunk, and on memory that waits on a device it is a device
// copy.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/core/cuda_memory.h"
#include "server/rpc/handler_util.h"
#include "server/rpc/reactor_refs.h"
#include "server/rpc/service.h"

namespace kvbank::rpc {
namespace {
// A fetch into a region is copied in pieces of this many bytes (the call's end is checked
// between them).
constexpr uint64_t kRegionCopyPiece = uint64_t{4} << 20;
}  // namespace

absl::StatusOr<plane::ShmRegions*> KvBankService::ShmPlane() const {
  if (options_.shm_regions == nullptr) {
    return absl::FailedPreconditionError(
        "kvbankd serves no shared-memory plane (start it with --shm-socket)");
  }
  return options_.shm_regions.get();
}

absl::Status KvBankService::AppendFromRegion(const std::string& tenant, const SequenceStore& model,
                                             const v1::RegionSlice& source, AppendTxn* txn) const {
  auto regions = ShmPlane();
  if (!regions.ok()) return regions.status();
  auto bytes = (*regions)->Resolve(tenant, source.region_id(), source.offset(), source.length(),
                                   "header.source");
  if (!bytes.ok()) return bytes.status();
  if (source.length() != txn->payload_bytes()) {
    return absl::InvalidArgumentError(absl::StrCat("header.source.length ", source.length(),
                                                   " is not the payload's ", txn->payload_bytes(),
                                                   " bytes"));
  }
  const std::vector<DType>& stored = model.layout().layer_dtypes;
  const bool plain =
      std::all_of(stored.begin(), stored.end(), [&](DType d) { return d == txn->dtype(); });
  if (plain) return txn->Write(bytes->bytes);
  // NOTE: the client may change its region while this reads it. A copy is harmless (the client
  // gets what it wrote), but a conversion reads values more than once (the NaN check, an fp8
  // group's scale, then the codes): it gets each piece from a private copy, read once.
  std::vector<uint8_t> piece(std::min<uint64_t>(bytes->bytes.size(), uint64_t{1} << 20));
  for (uint64_t at = 0; at < bytes->bytes.size(); at += piece.size()) {
    const uint64_t n = std::min<uint64_t>(piece.size(), bytes->bytes.size() - at);
    std::memcpy(piece.data(), bytes->bytes.data() + at, n);
    if (absl::Status s = txn->Write(absl::MakeConstSpan(piece.data(), n)); !s.ok()) return s;
  }
  return absl::OkStatus();
}

// Server stream of one message: the FetchResponse header, once the payload is in the region.
// The reader opens and copies on a worker; its blocks go before the answer is sent.
class KvBankService::RegionFetchReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer>,
                                                public ReactorRefs<RegionFetchReactor> {
 public:
  // Moves the opened reader's whole payload into the caller's region (it holds the region open).
  // `ended` turns true when the call ends (cancelled, past its deadline): a sink that copies in
  // pieces stops between them.
  using Sink = std::function<absl::Status(FetchReader& reader, const std::atomic<bool>& ended)>;
  // wait: copy only once the tokens are committed (FetchRequest.wait_ms).
  // plane: the one `dest` writes through (counted in plane_bytes_ once the copy is done).
  RegionFetchReactor(KvBankService* service, grpc::CallbackServerContext* ctx, std::string tenant,
                     Plane plane, absl::StatusOr<Sink> dest, OpenFetch open,
                     std::optional<FetchWaitSpec> wait)
      : service_(service),
        tenant_(std::move(tenant)),
        plane_(plane),
        stream_(service->watchdog_.Watch(ctx)) {
    if (!dest.ok()) {
      Answer(dest.status());
      return;
    }
    if (!wait.has_value()) {
      CopyOnWorker(*std::move(dest), std::move(open));
      return;
    }
    stream_->SetWaiting(false);  // it waits for the sequence, not for its client
    wait_ = std::make_unique<FetchWait>(
        &service_->timers_, [this] { Ref(); }, [this] { Unref(); });
    wait_->Begin(
        std::move(wait->store), wait->spec, wait->timeout,
        [this, dest = *std::move(dest), open = std::move(open)](absl::Status s) {
          if (!s.ok()) return Answer(s);
          CopyOnWorker(dest, open);
        },
        std::move(wait->claim));
  }

  void OnWriteDone(bool) override { stream_->Progress(); }
  void OnCancel() override {
    ended_.store(true, std::memory_order_release);
    if (wait_ != nullptr) wait_->Cancel();
  }
  void OnDone() override {
    ended_.store(true, std::memory_order_release);
    stream_->Done();
    Unref();
  }

 private:
  void CopyOnWorker(Sink dest, OpenFetch open) {
    if (absl::Status s = service_->device_work_->Submit(
            tenant_, WorkClass::kForeground,
            Held([this, dest = std::move(dest), open = std::move(open)]() mutable {
              absl::StatusOr<v1::FetchResponse> resp = Copy(std::move(dest), open, ended_);
              if (resp.ok()) {
                service_->plane_bytes_.AddSent(plane_, resp->header().payload_bytes());
              }
              Answer(resp);
            }));
        !s.ok()) {
      Answer(s);  // the tenant's backlog is full: nothing was copied
      Unref();    // the copy's reference: it will never run
    }
  }

  // NOTE: nothing is written into the region once the call has ended: a copy that has not
  // started by then never starts, and one under way stops at its next piece (the client treats
  // the region as spoilt after a failed call: the SDK never reuses such a staging region).
  static absl::StatusOr<v1::FetchResponse> Copy(Sink dest, const OpenFetch& open,
                                                const std::atomic<bool>& ended) {
    if (ended.load(std::memory_order_acquire)) return CallEnded();
    auto reader = open();
    if (!reader.ok()) return reader.status();
    if (ended.load(std::memory_order_acquire)) return CallEnded();
    const uint64_t n = (*reader)->payload_bytes();
    if (absl::Status s = dest(**reader, ended); !s.ok()) return s;
    v1::FetchResponse resp;
    v1::FetchHeader* h = resp.mutable_header();
    h->set_token_begin((*reader)->token_begin());
    h->set_num_tokens((*reader)->num_tokens());
    h->set_layer_begin((*reader)->layer_begin());
    h->set_layer_end((*reader)->layer_end());
    h->set_dtype(ToProto((*reader)->dtype()));
    h->set_payload_bytes(n);
    h->set_kv_head_begin((*reader)->kv_head_begin());
    h->set_kv_head_end((*reader)->kv_head_end());
    return resp;  // the reader goes here: a caller that saw the answer sees no block held by it
  }

  void Answer(const absl::StatusOr<v1::FetchResponse>& resp) {
    stream_->SetWaiting(false);
    if (!resp.ok()) return Finish(ToGrpcStatus(resp.status()));
    bool own = false;
    grpc::Status s =
        grpc::SerializationTraits<v1::FetchResponse>::Serialize(*resp, &message_, &own);
    if (!s.ok()) return Finish(s);
    StartWriteAndFinish(&message_, grpc::WriteOptions(), grpc::Status::OK);
  }

  static absl::Status CallEnded() {
    return absl::CancelledError("the fetch ended (cancelled or past its deadline) before its copy");
  }

  KvBankService* const service_;
  const std::string tenant_;  // whose work the copy is
  const Plane plane_;
  std::atomic<bool> ended_{false};  // OnCancel or OnDone ran: nothing more goes into the region
  const std::shared_ptr<StreamWatchdog::Stream> stream_;
  std::unique_ptr<FetchWait> wait_;  // set by the constructor, or never
  grpc::ByteBuffer message_;
};

grpc::ServerWriteReactor<grpc::ByteBuffer>* KvBankService::StartRegionFetch(
    Ctx* ctx, OpenFetch open, const std::string& tenant, const v1::RegionSlice& dest,
    std::optional<FetchWaitSpec> wait) {
  auto regions = ShmPlane();
  absl::StatusOr<plane::RegionBytes> bytes =
      regions.ok()
          ? (*regions)->Resolve(tenant, dest.region_id(), dest.offset(), dest.length(), "dest")
          : absl::StatusOr<plane::RegionBytes>(regions.status());
  absl::StatusOr<RegionFetchReactor::Sink> sink =
      bytes.ok() ? absl::StatusOr<RegionFetchReactor::Sink>(RegionFetchReactor::Sink())
                 : absl::StatusOr<RegionFetchReactor::Sink>(bytes.status());
  if (bytes.ok()) {
    sink = [region = *std::move(bytes)](FetchReader& reader, const std::atomic<bool>& ended) {
      const uint64_t n = reader.payload_bytes();
      if (n > region.bytes.size()) {
        return absl::InvalidArgumentError(absl::StrCat("dest.length ", region.bytes.size(),
                                                       " is less than the payload's ", n,
                                                       " bytes; nothing was written"));
      }
      // In pieces, in order (the cheapest order on staged memory), so that a call that ends
      // stops the copy within a piece.
      for (uint64_t at = 0; at < n; at += kRegionCopyPiece) {
        if (ended.load(std::memory_order_acquire)) {
          return absl::CancelledError("the fetch ended during its copy: stopped");
        }
        const uint64_t len = std::min(kRegionCopyPiece, n - at);
        if (absl::Status s = reader.Read(at, region.bytes.subspan(at, len)); !s.ok()) return s;
      }
      return absl::OkStatus();
    };
  }
  return new RegionFetchReactor(this, ctx, tenant, Plane::kShm, std::move(sink), std::move(open),
                                std::move(wait));
}

// ---- The CUDA IPC plane ----

absl::StatusOr<plane::CudaIpcRegions*> KvBankService::CudaIpcPlane() const {
  if (options_.cuda_ipc == nullptr) {
    return absl::FailedPreconditionError(
        CudaBuiltIn() ? "kvbankd serves no CUDA IPC plane: its pools are not in GPU memory "
                        "(--device cuda:N)"
                      : "kvbankd serves no CUDA IPC plane: it was built without CUDA "
                        "(KVBANK_ENABLE_CUDA)");
  }
  return options_.cuda_ipc.get();
}

absl::StatusOr<plane::DeviceBytes> KvBankService::ResolveDeviceSlice(
    const std::string& tenant, const SequenceStore& model, const v1::RegionSlice& slice,
    absl::string_view field) const {
  if (slice.region_id() == 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".region_id is 0 (unset)"));
  }
  auto ipc = CudaIpcPlane();
  if (!ipc.ok()) return ipc.status();
  const PoolMemory& memory = model.pool().memory();
  const std::string device = absl::StrCat("cuda:", (*ipc)->options().device);
  if (memory.kind() != MemoryKind::kCuda || memory.name() != device) {
    return absl::FailedPreconditionError(absl::StrCat(
        field, " needs a pool on ", device, " (the CUDA IPC plane's device); this model keeps its ",
        "pool in ", memory.name(), " memory"));
  }
  return (*ipc)->Resolve(tenant, slice.region_id(), slice.offset(), slice.length(), field);
}

absl::Status KvBankService::AppendFromDevice(const std::string& tenant, const SequenceStore& model,
                                             const v1::RegionSlice& source, AppendTxn* txn) const {
  auto bytes = ResolveDeviceSlice(tenant, model, source, "header.device_source");
  if (!bytes.ok()) return bytes.status();
  if (source.length() != txn->payload_bytes()) {
    return absl::InvalidArgumentError(absl::StrCat("header.device_source.length ", source.length(),
                                                   " is not the payload's ", txn->payload_bytes(),
                                                   " bytes"));
  }
  // NOTE: the client may change its buffer while the kernels read it; that spoils only its own
  // data (the NaN check and the codec may then see different values: a converted row is still
  // finite-checked bytes or the client's garbage, never memory outside the slice).
  return txn->WriteFromDevice(bytes->data);
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* KvBankService::StartDeviceFetch(
    Ctx* ctx, OpenFetch open, const std::string& tenant, absl::StatusOr<plane::DeviceBytes> dest,
    std::optional<FetchWaitSpec> wait) {
  absl::StatusOr<RegionFetchReactor::Sink> sink =
      dest.ok() ? absl::StatusOr<RegionFetchReactor::Sink>(RegionFetchReactor::Sink())
                : absl::StatusOr<RegionFetchReactor::Sink>(dest.status());
  if (dest.ok()) {
    sink = [region = *std::move(dest)](FetchReader& reader, const std::atomic<bool>&) {
      const uint64_t n = reader.payload_bytes();
      if (n > region.size) {
        return absl::InvalidArgumentError(absl::StrCat("device_dest.length ", region.size,
                                                       " is less than the payload's ", n,
                                                       " bytes; nothing was written"));
      }
      return reader.ReadToDevice(region.data);
    };
  }
  return new RegionFetchReactor(this, ctx, tenant, Plane::kCudaIpc, std::move(sink),
                                std::move(open), std::move(wait));
}

}  // namespace kvbank::rpc
