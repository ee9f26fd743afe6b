// kvbank::PlaneRouter: a Client that moves each payload on the cheapest data plane that can
// carry it.
//
//   auto router = kvbank::PlaneRouter::Connect("127.0.0.1:50051");  // shm "auto"
//   auto region = (*router)->RegisterRegion(64 << 20);              // when shm_on()
//   (*router)->Append("llama", id, args, payload);    // shm, staged shm or gRPC
//   (*router)->FetchInto("llama", id, fetch_args, out);
//
// The planes, in the order they are tried:
//   kShm        the buffer lies inside a region registered through this router: the server
//               copies between its pool and that memory, nothing else moves;
//   kShmStaged  a buffer of at least shm_min_bytes elsewhere goes through a staging region (one
//               memcpy on this side), taken from a pool of at most shm_staging_bytes in all;
//   kGrpc       everything else, and everything once the shared-memory plane is off.
// A shared-memory plane that fails to register a region is dropped for good (gRPC from then
// on); a staging region whose fetch failed is never used again (the server may still be copying
// into it). The results are what Client's calls answer, whichever plane carried the bytes.
#ifndef KVBANK_PLANE_ROUTER_H_
#define KVBANK_PLANE_ROUTER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvbank/client.h"

namespace kvbank {

// How a PlaneRouter picks its planes.
struct PlaneRouterOptions {
  // "auto": kvbankd's --shm-socket when GetServerInfo names one, the server runs on this host
  // (its boot id is ours) and this process may read and write the socket; "": no
  // shared-memory plane; else the socket path to use.
  std::string shm = "auto";
  // Payloads of at least this many bytes outside a registered region go through staging.
  uint64_t shm_min_bytes = uint64_t{1} << 20;
  // The staging regions' budget, all together (each is a multiple of 1 MiB, at least 8 MiB).
  uint64_t shm_staging_bytes = uint64_t{1} << 30;
};

// Thread-safe: every method may be called from any thread, concurrently.
class PlaneRouter {
 public:
  using Options = PlaneRouterOptions;

  enum Plane { kShm = 0, kShmStaged = 1, kGrpc = 2 };
  static constexpr int kNumPlanes = 3;
  struct PlaneCount {
    uint64_t calls = 0;  // successful calls the plane carried
    uint64_t bytes = 0;  // payload bytes they moved
  };
  struct Stats {
    PlaneCount planes[kNumPlanes];  // indexed by Plane
    uint64_t staging_dropped = 0;   // staging regions let go after a failed call
    // Region transfers (of shm and shm_staged) asked for with a control frame on the shm socket
    // rather than a gRPC call (ClientOptions::shm_control).
    uint64_t shm_control_requests = 0;
  };

  // Connects a Client with `options` (its shm_socket is set here from planes.shm). Errors are
  // Client::Connect's. With shm "auto", a server that cannot be asked (GetServerInfo fails)
  // leaves the plane off; the connection is still made.
  static absl::StatusOr<std::unique_ptr<PlaneRouter>> Connect(const std::string& target,
                                                              ClientOptions options = {},
                                                              Options planes = {});
  ~PlaneRouter();
  PlaneRouter(const PlaneRouter&) = delete;
  PlaneRouter& operator=(const PlaneRouter&) = delete;

  // The Client under the router, for every call that moves no routed payload. Lives as long as
  // the router.
  Client& client();
  // Whether payloads may still take the shared-memory plane (false once it failed).
  bool shm_on() const;
  // The socket of the shared-memory plane; empty when there is none.
  const std::string& shm_socket() const;

  // A region of `size` bytes whose buffers then move on kShm. FAILED_PRECONDITION when the
  // shared-memory plane is off; else Client::RegisterRegion's errors. The router keeps a
  // reference until UnregisterRegion; the region stays registered while any reference lives.
  absl::StatusOr<std::shared_ptr<ShmRegion>> RegisterRegion(uint64_t size);
  // The same for memory the caller has in a shared file (Client::RegisterRegionFd): buffers in
  // the region's own mapping (ShmRegion::data()) move on kShm.
  absl::StatusOr<std::shared_ptr<ShmRegion>> RegisterRegionFd(int fd);
  // Stops routing through `region` (the caller's reference keeps it registered).
  void UnregisterRegion(const std::shared_ptr<ShmRegion>& region);

  // Client::Append of `payload`, on the plane it fits.
  absl::StatusOr<Client::SequenceInfo> Append(const std::string& model, uint64_t id,
                                              const Client::AppendArgs& args,
                                              absl::Span<const uint8_t> payload);
  // Client::FetchInto: the payload written to the start of `out`, payload_bytes long; OUT_OF_RANGE
  // when it does not fit (on every plane: a region refusal that names dest.length falls back to
  // gRPC, which answers so).
  absl::StatusOr<Client::FetchResult> FetchInto(const std::string& model, uint64_t id,
                                                const Client::FetchArgs& args,
                                                absl::Span<uint8_t> out);
  // Client::FetchBlocks (args' layer, dtype and head fields) written into `out` as FetchInto.
  absl::StatusOr<Client::FetchResult> FetchBlocksInto(const std::string& model,
                                                      const std::vector<BlockHash>& hashes,
                                                      const Client::FetchArgs& args,
                                                      absl::Span<uint8_t> out);

  // What each plane has carried so far.
  Stats GetStats() const;

 private:
  struct State;
  explicit PlaneRouter(std::unique_ptr<State> state);
  // Keeps a registered region for routing.
  absl::StatusOr<std::shared_ptr<ShmRegion>> Track(absl::StatusOr<std::unique_ptr<ShmRegion>> r);
  absl::StatusOr<Client::FetchResult> RouteFetch(const std::string& model, uint64_t id,
                                                 const std::vector<BlockHash>* hashes,
                                                 const Client::FetchArgs& args,
                                                 absl::Span<uint8_t> out);
  std::unique_ptr<State> state_;
};

}  // namespace kvbank

#endif  // KVBANK_PLANE_ROUTER_H_
