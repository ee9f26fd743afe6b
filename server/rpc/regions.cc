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
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/core/cuda_memory.h"
#include "server/rpc/handler_util.h"
#include "server/rpc/reactor_refs.h"
#include "server/rpc/service.h"
#include "server/rpc/split_copy.h"

namespace kvbank::rpc {
namespace {
// A fetch into a region is copied in pieces of this many bytes (the call's end is checked
// between them).
constexpr uint64_t kRegionCopyPiece = uint64_t{4} << 20;
// On host memory, a payload of at least this many bytes, fetched into a region or appended from
// one, is copied by several threads (the service's region_copy_helpers), each taking pieces of
// kRegionCopySplitPiece.
constexpr uint64_t kSplitRegionCopyBytes = uint64_t{1} << 20;
constexpr uint64_t kRegionCopySplitPiece = uint64_t{256} << 10;
// A region copy of at least this many bytes may write its destination around the caches
// (kernels::CopyStores::kStream): over memory larger than the caches that skips reading each
// written line first (2 MiB rotating over 128 MiB, four at once on a 2-vCPU VM: 0.73-0.85 of
// memcpy -> 0.89-1.02). It does where the bytes are not read again while they would still be
// cached:
// - an append, unless the sequence is handed off layer by layer (a fetch has waited for its
//   tokens: AppendTxn::awaited), whose reader pulls the bytes at once (with them streamed, a
//   decode's last pull ended 0.17 ms after the prefill's last push instead of 0.10);
// - a fetch into a region of at least kStreamRegionBytes. A smaller region is a buffer its
//   client reuses and reads at once (the SDK's staging regions: streamed, a staged 2 MiB fetch
//   took 0.21 ms instead of 0.17); a larger one, slices of a host KV buffer.
constexpr uint64_t kStreamRegionCopyBytes = uint64_t{1} << 20;
constexpr uint64_t kStreamRegionBytes = uint64_t{32} << 20;

// A large region copy under way, counted in the service's region_copies_ while it lasts. Only
// a copy that starts alone takes helpers: with others under way their workers are the
// parallelism already, and a helper would hold a worker that a queued transfer is waiting for
// (four 2 MiB transfers at once on a 16-core H200 host reached 0.78-0.79 of memcpy with one
// helper and 0.69-0.72 with three).
class LargeRegionCopy {
 public:
  explicit LargeRegionCopy(std::atomic<uint32_t>& copies)
      : copies_(copies), alone_(copies.fetch_add(1, std::memory_order_acq_rel) == 0) {}
  ~LargeRegionCopy() { copies_.fetch_sub(1, std::memory_order_acq_rel); }
  LargeRegionCopy(const LargeRegionCopy&) = delete;
  LargeRegionCopy& operator=(const LargeRegionCopy&) = delete;
  bool alone() const { return alone_; }

 private:
  std::atomic<uint32_t>& copies_;
  const bool alone_;
};
}  // namespace

absl::StatusOr<plane::ShmRegions*> KvBankService::ShmPlane() const {
  if (options_.shm_regions == nullptr) {
    return absl::FailedPreconditionError(
        "kvbankd serves no shared-memory plane (start it with --shm-socket)");
  }
  return options_.shm_regions.get();
}

namespace {

// A shared-memory slice as runs: a plain slice is one run; a scattered one its runs.
absl::StatusOr<plane::RegionRuns> ResolveSlice(const plane::ShmRegions& regions,
                                               const std::string& tenant,
                                               const v1::RegionSlice& slice,
                                               absl::string_view field) {
  if (slice.run_offsets_size() == 0) {
    if (slice.run_bytes() != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".run_bytes is set without run_offsets"));
    }
    auto bytes = regions.Resolve(tenant, slice.region_id(), slice.offset(), slice.length(), field);
    if (!bytes.ok()) return bytes.status();
    plane::RegionRuns out;
    out.Add(bytes->bytes);
    out.mapping = std::move(bytes->mapping);
    return out;
  }
  const uint64_t n = uint64_t(slice.run_offsets_size()), rb = slice.run_bytes();
  if (slice.length() != 0 && (rb == 0 || slice.length() % rb != 0 || slice.length() / rb != n)) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".length ", slice.length(),
                                                   " is not run_bytes ", rb, " x ", n, " runs"));
  }
  return regions.ResolveRuns(tenant, slice.region_id(), slice.offset(), rb,
                             absl::MakeConstSpan(slice.run_offsets().data(), n), field);
}

}  // namespace

absl::Status KvBankService::AppendFromRegion(const std::string& tenant, const SequenceStore& model,
                                             const v1::RegionSlice& source, AppendTxn* txn) const {
  auto regions = ShmPlane();
  if (!regions.ok()) return regions.status();
  auto runs = ResolveSlice(**regions, tenant, source, "header.source");
  if (!runs.ok()) return runs.status();
  if (runs->size() != txn->payload_bytes()) {
    return absl::InvalidArgumentError(absl::StrCat("header.source.length ", runs->size(),
                                                   " is not the payload's ", txn->payload_bytes(),
                                                   " bytes"));
  }
  // An unsealed region that its owner truncated under the copy read throwaway pages: the append
  // fails before it commits (CheckIntact).
  auto intact = [&]() {
    absl::Status s = runs->mapping->CheckIntact();
    return s.ok() ? s : absl::Status(s.code(), absl::StrCat("header.source: ", s.message()));
  };
  const std::vector<DType>& stored = model.layout().layer_dtypes;
  const bool plain =
      std::all_of(stored.begin(), stored.end(), [&](DType d) { return d == txn->dtype(); });
  if (plain) {
    const uint64_t n = runs->size();
    if (n >= kStreamRegionCopyBytes && !txn->awaited()) {
      txn->SetStores(kernels::CopyStores::kStream);
    }
    if (n >= kSplitRegionCopyBytes && txn->ConcurrentWrites()) {
      // As a large fetch: by ranges (maybe on helper workers too), then counted.
      const uint64_t base = txn->bytes_written();
      const std::atomic<bool> never_ended{false};
      absl::Status s = CopyRegionBytes(
          tenant, n, /*concurrent=*/true,
          [&](uint64_t at, uint64_t len) {
            return runs->ForEachPiece(at, len, [&](uint64_t p, absl::Span<uint8_t> from) {
              return txn->WriteRange(base + p, from);
            });
          },
          never_ended);
      if (s.ok()) s = txn->Advance(n);
      if (!s.ok()) return s;
      return intact();
    }
    for (absl::Span<uint8_t> run : runs->runs) {
      if (absl::Status s = txn->Write(run); !s.ok()) return s;
    }
    return intact();
  }
  // NOTE: the client may change its region while this reads it. A copy is harmless (the client
  // gets what it wrote), but a conversion reads values more than once (the NaN check, an fp8
  // group's scale, then the codes): it gets each piece from a private copy, read once.
  std::vector<uint8_t> piece(std::min<uint64_t>(runs->size(), uint64_t{1} << 20));
  for (uint64_t at = 0; at < runs->size(); at += piece.size()) {
    const uint64_t n = std::min<uint64_t>(piece.size(), runs->size() - at);
    absl::Status s = runs->ForEachPiece(at, n, [&](uint64_t p, absl::Span<uint8_t> from) {
      std::memcpy(piece.data() + (p - at), from.data(), from.size());
      return absl::OkStatus();
    });
    if (s.ok()) s = intact();
    if (s.ok()) s = txn->Write(absl::MakeConstSpan(piece.data(), n));
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

// One fetch into a region (a shared-memory or a device region), from its wait to its answer,
// whichever way it was asked for: a gRPC call (RegionFetchReactor) or a control frame on the
// shared-memory plane's socket (control.cc). The reader opens and copies on a worker, or here
// when the pool is host memory and the payload small (CopiesInline); its blocks go before the
// answer. Reference counted: the asker holds one (the shared_ptr StartRegionFetch returns), and
// each piece of work handed out holds its own.
class KvBankService::RegionFetch final : public ReactorRefs<RegionFetch> {
 public:
  RegionFetch(KvBankService* service, std::string tenant, Plane plane, RegionSink dest,
              OpenFetch open, bool on_device, uint64_t inline_bytes, FetchDone done)
      : service_(service),
        tenant_(std::move(tenant)),
        plane_(plane),
        on_device_(on_device),
        inline_bytes_(inline_bytes),
        dest_(std::move(dest)),
        open_(std::move(open)),
        done_(std::move(done)) {}

  void Start(std::optional<FetchWaitSpec> wait) {
    if (!wait.has_value()) return Go();
    // The wait ends on whichever thread commits or times out: that thread copies small ones only.
    inline_bytes_ = std::min(inline_bytes_, kInlineRegionCopyBytes);
    wait_ = std::make_unique<FetchWait>(
        &service_->timers_, [this] { Ref(); }, [this] { Unref(); });
    wait_->Begin(
        std::move(wait->store), wait->spec, wait->timeout,
        [this](absl::Status s) {
          if (!s.ok()) return Answer(s);
          Go();
        },
        std::move(wait->claim));
  }

  // The asker is gone (cancelled, past its deadline, its connection closed): a wait ends, a copy
  // that has not started never starts, one under way stops at its next piece.
  void End() {
    ended_.store(true, std::memory_order_release);
    if (wait_ != nullptr) wait_->Cancel();
  }
  void Release() { Unref(); }

 private:
  void Go() {
    if (ended_.load(std::memory_order_acquire)) return Answer(CallEnded());
    if (!on_device_) {
      // Host memory: opening costs a look-up; a small payload is copied here too.
      auto reader = open_();
      if (!reader.ok()) return Answer(reader.status());
      if (const uint64_t n = (*reader)->payload_bytes(); n <= inline_bytes_) {
        if (n > kInlineRegionCopyBytes) service_->plane_bytes_.AddLoneCopy();
        return Answer(Copy(**reader));
      }
      auto shared = std::shared_ptr<FetchReader>(*std::move(reader));
      return OnWorker([this, shared] { Answer(Copy(*shared)); });
    }
    OnWorker([this] {
      if (ended_.load(std::memory_order_acquire)) return Answer(CallEnded());
      auto reader = open_();
      Answer(reader.ok() ? Copy(**reader) : absl::StatusOr<v1::FetchResponse>(reader.status()));
    });
  }

  void OnWorker(std::function<void()> step) {
    if (absl::Status s =
            service_->device_work_->Submit(tenant_, WorkClass::kForeground, Held(std::move(step)));
        !s.ok()) {
      Answer(s);  // the tenant's backlog is full: nothing was copied
      Unref();    // the copy's reference: it will never run
    }
  }

  // NOTE: nothing is written into the region once the asker is gone: a copy that has not
  // started by then never starts, and one under way stops at its next piece (the client treats
  // the region as spoilt after a failed call: the SDK never reuses such a staging region).
  absl::StatusOr<v1::FetchResponse> Copy(FetchReader& reader) {
    if (ended_.load(std::memory_order_acquire)) return CallEnded();
    const uint64_t n = reader.payload_bytes();
    if (absl::Status s = dest_(reader, ended_); !s.ok()) return s;
    v1::FetchResponse resp;
    v1::FetchHeader* h = resp.mutable_header();
    h->set_token_begin(reader.token_begin());
    h->set_num_tokens(reader.num_tokens());
    h->set_layer_begin(reader.layer_begin());
    h->set_layer_end(reader.layer_end());
    h->set_dtype(ToProto(reader.dtype()));
    h->set_payload_bytes(n);
    h->set_kv_head_begin(reader.kv_head_begin());
    h->set_kv_head_end(reader.kv_head_end());
    return resp;
  }

  // Runs done_ once; the reader is gone by then (a caller that saw the answer sees no block held
  // by it).
  void Answer(const absl::StatusOr<v1::FetchResponse>& resp) {
    if (answered_.exchange(true)) return;
    if (resp.ok()) service_->plane_bytes_.AddSent(plane_, resp->header().payload_bytes());
    FetchDone done = std::move(done_);
    done(resp);
  }

  static absl::Status CallEnded() {
    return absl::CancelledError("the fetch ended (cancelled or past its deadline) before its copy");
  }

  KvBankService* const service_;
  const std::string tenant_;  // whose work the copy is
  const Plane plane_;
  const bool on_device_;
  uint64_t inline_bytes_;  // the most copied on the thread that starts the copy (set by Start)
  const RegionSink dest_;
  const OpenFetch open_;
  FetchDone done_;
  std::atomic<bool> ended_{false};
  std::atomic<bool> answered_{false};
  std::unique_ptr<FetchWait> wait_;  // set by Start, or never
};

bool KvBankService::CopiesInline(uint64_t payload_bytes) {
  return payload_bytes <= kInlineRegionCopyBytes;
}

std::shared_ptr<KvBankService::RegionFetch> KvBankService::StartRegionFetch(
    const std::string& tenant, PreparedFetch fetch, FetchDone done, uint64_t inline_bytes) {
  Plane plane = Plane::kShm;
  absl::StatusOr<RegionSink> sink = absl::FailedPreconditionError("no region named");
  if (fetch.dest.has_value()) {
    sink = RegionSinkFor(tenant, *fetch.dest);
  } else if (fetch.device_dest.has_value()) {
    plane = Plane::kCudaIpc;
    sink = DeviceSinkFor(*std::move(fetch.device_dest));
  }
  if (!sink.ok()) {
    done(sink.status());
    return nullptr;
  }
  auto* f = new RegionFetch(this, tenant, plane, *std::move(sink), std::move(fetch.open),
                            fetch.on_device, inline_bytes, std::move(done));
  std::shared_ptr<RegionFetch> asker(f, [](RegionFetch* r) { r->Release(); });
  f->Start(std::move(fetch.wait));
  return asker;
}

void KvBankService::EndRegionFetch(RegionFetch& f) { f.End(); }

absl::Status KvBankService::CopyRegionBytes(
    const std::string& tenant, uint64_t n, bool concurrent,
    const std::function<absl::Status(uint64_t, uint64_t)>& copy,
    const std::atomic<bool>& ended) const {
  SplitCopyOptions split;
  std::optional<LargeRegionCopy> large;
  if (n >= kSplitRegionCopyBytes) large.emplace(region_copies_);
  if (concurrent && large.has_value() && large->alone()) {
    split.piece_bytes = kRegionCopySplitPiece;
    split.max_helpers = options_.region_copy_helpers;
  } else {
    // In pieces, in order (the cheapest order on staged memory), so that a call that ends
    // stops the copy within a piece.
    split.piece_bytes = kRegionCopyPiece;
  }
  return SplitCopy(n, split, copy, ended, [this, &tenant](std::function<void()> task) {
    device_work_->Continue(tenant, std::move(task));
  });
}

absl::StatusOr<KvBankService::RegionSink> KvBankService::RegionSinkFor(
    const std::string& tenant, const v1::RegionSlice& dest) const {
  auto regions = ShmPlane();
  if (!regions.ok()) return regions.status();
  auto runs = ResolveSlice(**regions, tenant, dest, "dest");
  if (!runs.ok()) return runs.status();
  return RegionSink([this, tenant, region = *std::move(runs)](FetchReader& reader,
                                                              const std::atomic<bool>& ended) {
    const uint64_t n = reader.payload_bytes();
    if (n > region.size()) {
      return absl::InvalidArgumentError(absl::StrCat("dest.length ", region.size(),
                                                     " is less than the payload's ", n,
                                                     " bytes; nothing was written"));
    }
    if (n >= kStreamRegionCopyBytes && region.mapping->size() >= kStreamRegionBytes) {
      reader.SetStores(kernels::CopyStores::kStream);
    }
    auto copy = [&](uint64_t at, uint64_t len) {
      return region.ForEachPiece(
          at, len, [&](uint64_t p, absl::Span<uint8_t> to) { return reader.Read(p, to); });
    };
    absl::Status s = CopyRegionBytes(tenant, n, reader.ConcurrentReads(), copy, ended);
    if (!s.ok()) return s;
    // An unsealed region truncated under the copy: the bytes went to throwaway pages.
    s = region.mapping->CheckIntact();
    return s.ok() ? s : absl::Status(s.code(), absl::StrCat("dest: ", s.message()));
  });
}

// The gRPC side of a fetch into a region: a server stream of one message, the FetchResponse
// header, once the payload is in the region.
class KvBankService::RegionFetchReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer>,
                                                public ReactorRefs<RegionFetchReactor> {
 public:
  RegionFetchReactor(KvBankService* service, grpc::CallbackServerContext* ctx, std::string tenant,
                     PreparedFetch fetch)
      : stream_(service->watchdog_.Watch(ctx)) {
    // It waits for the sequence and the copy, not for its client.
    if (fetch.wait.has_value()) stream_->SetWaiting(false);
    Ref();  // the answer's
    std::shared_ptr<RegionFetch> f =
        service->StartRegionFetch(tenant, std::move(fetch), [this](const auto& resp) {
          Answer(resp);
          Unref();
        });
    absl::MutexLock lock(&mu_);
    fetch_ = std::move(f);
  }

  void OnWriteDone(bool) override { stream_->Progress(); }
  void OnCancel() override {
    std::shared_ptr<RegionFetch> f;
    {
      absl::MutexLock lock(&mu_);
      f = fetch_;
    }
    if (f != nullptr) EndRegionFetch(*f);
  }
  void OnDone() override {
    stream_->Done();
    {
      absl::MutexLock lock(&mu_);
      if (fetch_ != nullptr) EndRegionFetch(*fetch_);
      fetch_.reset();
    }
    Unref();
  }

 private:
  void Answer(const absl::StatusOr<v1::FetchResponse>& resp) {
    stream_->SetWaiting(false);
    if (!resp.ok()) return Finish(ToGrpcStatus(resp.status()));
    bool own = false;
    grpc::Status s =
        grpc::SerializationTraits<v1::FetchResponse>::Serialize(*resp, &message_, &own);
    if (!s.ok()) return Finish(s);
    StartWriteAndFinish(&message_, grpc::WriteOptions(), grpc::Status::OK);
  }

  const std::shared_ptr<StreamWatchdog::Stream> stream_;
  absl::Mutex mu_;
  std::shared_ptr<RegionFetch> fetch_ ABSL_GUARDED_BY(mu_);  // the asker's reference
  grpc::ByteBuffer message_;
};

grpc::ServerWriteReactor<grpc::ByteBuffer>* KvBankService::StartRegionFetchCall(
    Ctx* ctx, const std::string& tenant, PreparedFetch fetch) {
  return new RegionFetchReactor(this, ctx, tenant, std::move(fetch));
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
  if (slice.run_offsets_size() != 0 || slice.run_bytes() != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": runs (run_bytes, run_offsets) are for shared-memory regions only"));
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

absl::StatusOr<KvBankService::RegionSink> KvBankService::DeviceSinkFor(
    absl::StatusOr<plane::DeviceBytes> dest) {
  if (!dest.ok()) return dest.status();
  return RegionSink([region = *std::move(dest)](FetchReader& reader, const std::atomic<bool>&) {
    const uint64_t n = reader.payload_bytes();
    if (n > region.size) {
      return absl::InvalidArgumentError(absl::StrCat("device_dest.length ", region.size,
                                                     " is less than the payload's ", n,
                                                     " bytes; nothing was written"));
    }
    return reader.ReadToDevice(region.data);
  });
}

}  // namespace kvbank::rpc
