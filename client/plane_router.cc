// kvbank::PlaneRouter (kvbank/plane_router.h): the shared-memory plane found and kept, the
// registered regions a buffer may lie in, the staging regions and the per-plane counters.
#include "kvbank/plane_router.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <optional>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace kvbank {

// Lock order: regions_mu and staging_mu are never held together, nor across an RPC.
struct PlaneRouter::State {
  struct Counter {
    std::atomic<uint64_t> calls{0}, bytes{0};
  };

  State(std::unique_ptr<Client> c, std::string socket, const Options& planes)
      : client(std::move(c)),
        shm_socket(std::move(socket)),
        shm_on(!shm_socket.empty()),
        shm_min_bytes(planes.shm_min_bytes),
        shm_staging_bytes(planes.shm_staging_bytes) {}

  // `r`, after counting its bytes on plane `p` when it succeeded.
  template <typename R>
  R Counted(Plane p, uint64_t bytes, R r) {
    if (r.ok()) {
      counts[p].calls.fetch_add(1, std::memory_order_relaxed);
      counts[p].bytes.fetch_add(bytes, std::memory_order_relaxed);
    }
    return r;
  }

  // The slice of a registered region that holds [p, p + n) whole; none for n == 0.
  std::optional<RegionSlice> InRegion(const uint8_t* p, uint64_t n) {
    if (n == 0) return std::nullopt;
    absl::MutexLock lock(&regions_mu);
    for (const auto& r : regions) {
      if (p >= r->data() && p + n <= r->data() + r->size()) {
        return r->Slice(static_cast<uint64_t>(p - r->data()), n);
      }
    }
    return std::nullopt;
  }

  // A staging region of at least `n` bytes, or null (a small payload, the plane off, or the
  // staging budget spent). A region that fails to register turns the plane off.
  std::unique_ptr<ShmRegion> TakeStaging(uint64_t n) {
    if (n < shm_min_bytes || !shm_on.load()) return nullptr;
    {
      absl::MutexLock lock(&staging_mu);
      for (auto it = free_staging.begin(); it != free_staging.end(); ++it) {
        if ((*it)->size() >= n) {
          std::unique_ptr<ShmRegion> r = std::move(*it);
          free_staging.erase(it);
          return r;
        }
      }
      const uint64_t size =
          std::max<uint64_t>((n + (1 << 20) - 1) & ~uint64_t{(1 << 20) - 1}, uint64_t{8} << 20);
      if (staging_bytes + size > shm_staging_bytes) return nullptr;
      staging_bytes += size;
      n = size;
    }
    auto r = client->RegisterRegion(n);
    if (!r.ok()) {
      // The socket is not this server's, or the plane went away: gRPC from now on.
      shm_on.store(false);
      absl::MutexLock lock(&staging_mu);
      staging_bytes -= n;
      return nullptr;
    }
    return *std::move(r);
  }
  void GiveBack(std::unique_ptr<ShmRegion> r) {
    absl::MutexLock lock(&staging_mu);
    free_staging.push_back(std::move(r));
  }
  // A staging region that is never used again: unregistered (its connection closes) and
  // unmapped here; its budget is free for a new one.
  void Drop(std::unique_ptr<ShmRegion> r) {
    const uint64_t size = r->size();
    r.reset();
    absl::MutexLock lock(&staging_mu);
    staging_bytes -= std::min(staging_bytes, size);
    ++staging_dropped;
  }

  std::unique_ptr<Client> client;
  const std::string shm_socket;  // empty: no shared-memory plane
  std::atomic<bool> shm_on;
  const uint64_t shm_min_bytes, shm_staging_bytes;
  absl::Mutex regions_mu;
  std::vector<std::shared_ptr<ShmRegion>> regions ABSL_GUARDED_BY(regions_mu);
  mutable absl::Mutex staging_mu;
  std::vector<std::unique_ptr<ShmRegion>> free_staging ABSL_GUARDED_BY(staging_mu);
  uint64_t staging_bytes ABSL_GUARDED_BY(staging_mu) = 0;
  uint64_t staging_dropped ABSL_GUARDED_BY(staging_mu) = 0;  // after a failed call
  Counter counts[kNumPlanes];
};

absl::StatusOr<std::unique_ptr<PlaneRouter>> PlaneRouter::Connect(const std::string& target,
                                                                  ClientOptions options,
                                                                  Options planes) {
  auto c = Client::Connect(target, options);
  if (!c.ok()) return c.status();
  std::string socket = planes.shm == "auto" ? "" : planes.shm;
  if (planes.shm == "auto") {
    // A socket path that exists here is this host's (a remote server's path would not be
    // ours); should it be another kvbankd's, registering fails and the plane is dropped.
    // The server must be on this host (its boot id is this one's); the socket's owner is
    // checked when a region is handed over (SO_PEERCRED: this user or root).
    auto info = (*c)->GetServerInfo();
    if (info.ok() && info->OnThisHost() && !info->shm_socket.empty() &&
        access(info->shm_socket.c_str(), R_OK | W_OK) == 0) {
      socket = info->shm_socket;
    }
  }
  if (!socket.empty()) {
    options.shm_socket = socket;
    c = Client::Connect(target, options);
    if (!c.ok()) return c.status();
  }
  return std::unique_ptr<PlaneRouter>(
      new PlaneRouter(std::make_unique<State>(*std::move(c), std::move(socket), planes)));
}

PlaneRouter::PlaneRouter(std::unique_ptr<State> state) : state_(std::move(state)) {}
PlaneRouter::~PlaneRouter() = default;

Client& PlaneRouter::client() { return *state_->client; }
bool PlaneRouter::shm_on() const { return state_->shm_on.load(); }
const std::string& PlaneRouter::shm_socket() const { return state_->shm_socket; }

absl::StatusOr<std::shared_ptr<ShmRegion>> PlaneRouter::RegisterRegion(uint64_t size) {
  if (!state_->shm_on.load()) {
    return absl::FailedPreconditionError(
        "no shared-memory plane: the server names no --shm-socket this host has");
  }
  return Track(state_->client->RegisterRegion(size));
}

absl::StatusOr<std::shared_ptr<ShmRegion>> PlaneRouter::RegisterRegionFd(int fd) {
  if (!state_->shm_on.load()) {
    return absl::FailedPreconditionError(
        "no shared-memory plane: the server names no --shm-socket this host has");
  }
  return Track(state_->client->RegisterRegionFd(fd));
}

absl::StatusOr<std::shared_ptr<ShmRegion>> PlaneRouter::Track(
    absl::StatusOr<std::unique_ptr<ShmRegion>> r) {
  if (!r.ok()) return r.status();
  std::shared_ptr<ShmRegion> shared = *std::move(r);
  absl::MutexLock lock(&state_->regions_mu);
  state_->regions.push_back(shared);
  return shared;
}

void PlaneRouter::UnregisterRegion(const std::shared_ptr<ShmRegion>& region) {
  absl::MutexLock lock(&state_->regions_mu);
  auto& regions = state_->regions;
  regions.erase(std::remove(regions.begin(), regions.end(), region), regions.end());
}

absl::StatusOr<Client::SequenceInfo> PlaneRouter::Append(const std::string& model, uint64_t id,
                                                         const Client::AppendArgs& args,
                                                         absl::Span<const uint8_t> payload) {
  State& s = *state_;
  if (auto slice = s.InRegion(payload.data(), payload.size())) {
    return s.Counted(kShm, payload.size(), s.client->AppendFromRegion(model, id, args, *slice));
  }
  if (std::unique_ptr<ShmRegion> st = s.TakeStaging(payload.size())) {
    std::memcpy(st->data(), payload.data(), payload.size());
    auto r = s.client->AppendFromRegion(model, id, args, st->Slice(0, payload.size()));
    s.GiveBack(std::move(st));
    return s.Counted(kShmStaged, payload.size(), std::move(r));
  }
  return s.Counted(kGrpc, payload.size(), s.client->Append(model, id, args, payload));
}

absl::StatusOr<Client::FetchResult> PlaneRouter::FetchInto(const std::string& model, uint64_t id,
                                                           const Client::FetchArgs& args,
                                                           absl::Span<uint8_t> out) {
  return RouteFetch(model, id, nullptr, args, out);
}

absl::StatusOr<Client::FetchResult> PlaneRouter::FetchBlocksInto(
    const std::string& model, const std::vector<BlockHash>& hashes, const Client::FetchArgs& args,
    absl::Span<uint8_t> out) {
  return RouteFetch(model, 0, &hashes, args, out);
}

namespace {

// A payload larger than the slice is refused by the region path as INVALID_ARGUMENT naming
// dest.length; the gRPC path then answers what it always does (OUT_OF_RANGE).
bool TooSmall(const absl::Status& s) {
  return s.code() == absl::StatusCode::kInvalidArgument &&
         absl::StrContains(s.message(), "dest.length");
}

// FetchBlocks on gRPC, copied into `out`: OUT_OF_RANGE when it does not fit.
absl::StatusOr<Client::FetchResult> FetchBlocksCopied(Client& c, const std::string& model,
                                                      const std::vector<BlockHash>& hashes,
                                                      const Client::FetchArgs& args,
                                                      absl::Span<uint8_t> out) {
  absl::StatusOr<Client::FetchResult> r = c.FetchBlocks(model, hashes, args);
  if (!r.ok()) return r;
  if (r->payload.size() > out.size()) {
    return absl::OutOfRangeError(absl::StrCat("the payload has ", r->payload.size(),
                                              " bytes; the buffer holds ", out.size()));
  }
  std::memcpy(out.data(), r->payload.data(), r->payload.size());
  r->payload_bytes = r->payload.size();
  r->payload.clear();
  return r;
}

}  // namespace

absl::StatusOr<Client::FetchResult> PlaneRouter::RouteFetch(const std::string& model, uint64_t id,
                                                            const std::vector<BlockHash>* hashes,
                                                            const Client::FetchArgs& args,
                                                            absl::Span<uint8_t> out) {
  State& s = *state_;
  auto into_region = [&](const RegionSlice& slice) {
    return hashes != nullptr ? s.client->FetchBlocksToRegion(model, *hashes, args, slice)
                             : s.client->FetchToRegion(model, id, args, slice);
  };
  // (The SDK bounds the server's payload_bytes by the slice: a larger one is an error.)
  if (auto slice = s.InRegion(out.data(), out.size())) {
    auto r = into_region(*slice);
    if (!TooSmall(r.status())) return s.Counted(kShm, r.ok() ? r->payload_bytes : 0, r);
  } else if (std::unique_ptr<ShmRegion> st = s.TakeStaging(out.size())) {
    auto r = into_region(st->Slice(0, out.size()));
    if (r.ok() && r->payload_bytes <= out.size()) {
      std::memcpy(out.data(), st->data(), r->payload_bytes);
    }
    // NOTE: a staging region whose call failed (a deadline, a cancel) may still be written by a
    // copy the server started before the call ended: it is never used again (dropped and
    // unregistered here), so no later call reads those bytes.
    if (r.ok() || TooSmall(r.status())) {
      s.GiveBack(std::move(st));
    } else {
      s.Drop(std::move(st));
    }
    if (!TooSmall(r.status())) return s.Counted(kShmStaged, r.ok() ? r->payload_bytes : 0, r);
  }
  absl::StatusOr<Client::FetchResult> r =
      hashes == nullptr ? s.client->FetchInto(model, id, args, out)
                        : FetchBlocksCopied(*s.client, model, *hashes, args, out);
  return s.Counted(kGrpc, r.ok() ? r->payload_bytes : 0, std::move(r));
}

PlaneRouter::Stats PlaneRouter::GetStats() const {
  Stats st;
  for (int p = 0; p < kNumPlanes; ++p) {
    st.planes[p].calls = state_->counts[p].calls.load();
    st.planes[p].bytes = state_->counts[p].bytes.load();
  }
  st.shm_control_requests = state_->client->ShmControlRequests();
  absl::MutexLock lock(&state_->staging_mu);
  st.staging_dropped = state_->staging_dropped;
  return st;
}

}  // namespace kvbank
