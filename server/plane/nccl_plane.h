// The NCCL data plane: payloads move between a client's GPU (an engine on this or another host)
// and the pool's GPU with ncclSend / ncclRecv, while gRPC stays the control plane that names each
// transfer. No gRPC here, and no NCCL or CUDA type in this header: nccl_plane.cc holds the NCCL
// code (built with CUDA and NCCL), nccl_plane_none.cc answers "built without NCCL" otherwise.
//
// A communicator: the client calls ncclGetUniqueId, sends the 128 bytes (over gRPC), and both
// sides call ncclCommInitRank, which blocks until every rank has joined. Here that call runs on
// the communicator's own thread (never on the caller's: an RPC reaction must not block), with a
// deadline (NcclOptions::init_timeout) after which the communicator is aborted.
//
// Ordering (the client's obligation): NCCL matches point-to-point operations between two ranks
// in the order each side issues them, so both sides must issue a communicator's transfers in the
// same order. Here they run in the order Receive / Send are called, one at a time, on the
// communicator's thread. A client keeps one transfer at a time in flight per communicator (or
// issues its own operations in exactly the order its calls reach the server, which gRPC does not
// promise for calls in flight at once).
//
// Failures: a transfer that does not complete within NcclOptions::transfer_timeout (the peer
// never issued its operation, or issued a different one) aborts the communicator (NCCL cannot
// cancel one operation); every later call on it answers FAILED_PRECONDITION saying so, and the
// client connects again. A communicator unused for NcclOptions::idle_timeout is destroyed (its
// lease), as is one whose client calls Disconnect. One that failed to form (a rank that never
// joined, a bad unique id) goes at once, its place free: calls naming it answer why it failed.
// Each tenant holds at most its share of max_comms (the tenant ledger).
//
// Lock order: NcclPlane's mu_, then a communicator's mu_ (nccl_plane.cc).
#ifndef KVBANK_SERVER_PLANE_NCCL_PLANE_H_
#define KVBANK_SERVER_PLANE_NCCL_PLANE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "server/core/tenant_ledger.h"

namespace kvbank::plane {

// Bytes of an ncclUniqueId (NCCL_UNIQUE_ID_BYTES).
inline constexpr size_t kNcclUniqueIdBytes = 128;

struct NcclOptions {
  int device = 0;             // the CUDA device of the pools this plane serves (cuda:N)
  uint32_t max_comms = 16;    // communicators at once, each with a thread and NCCL's buffers
  uint32_t max_ranks = 4096;  // of one communicator
  absl::Duration init_timeout = absl::Seconds(60);      // every rank must join within this
  absl::Duration transfer_timeout = absl::Seconds(60);  // one send / receive must complete
  absl::Duration idle_timeout = absl::Minutes(10);      // unused this long: destroyed
  uint64_t max_transfer_bytes = uint64_t{4} << 30;      // one payload, staged whole on the device
  // Where each tenant's communicators count (its share of max_comms); null: a ledger of its own
  // with max_comms as the cap, one tenant.
  std::shared_ptr<TenantLedger> ledger;
};

// True when this build has the NCCL plane (CUDA and NCCL found).
bool NcclBuiltIn();

// Thread-safe.
class NcclPlane {
 public:
  // A plane on options.device. FAILED_PRECONDITION when kvbank was built without NCCL (or CUDA),
  // or there is no such device.
  static absl::StatusOr<std::unique_ptr<NcclPlane>> Create(NcclOptions options);
  // Aborts every communicator (transfers in flight fail) and joins their threads.
  virtual ~NcclPlane() = default;
  NcclPlane(const NcclPlane&) = delete;
  NcclPlane& operator=(const NcclPlane&) = delete;

  virtual const NcclOptions& options() const = 0;

  // Joins a communicator of `nranks` as rank `rank`, from the peer's ncclUniqueId (its 128
  // bytes). Answers the communicator's id at once; ncclCommInitRank runs on the communicator's
  // thread, and the first transfer on it waits for it (and fails with its error, if any).
  // INVALID_ARGUMENT for a unique id that is not 128 bytes, nranks outside 1..max_ranks or rank
  // outside 0..nranks-1; RESOURCE_EXHAUSTED past the tenant's share of max_comms or max_comms
  // itself. The communicator is `tenant`'s. (The RPC layer checks first that the unique id's
  // bootstrap address is the caller's: nccl_bootstrap.h.)
  virtual absl::StatusOr<uint64_t> Connect(const std::string& tenant, absl::string_view unique_id,
                                           int nranks, int rank) = 0;
  // Aborts and destroys `tenant`'s communicator `id` (a transfer in flight on it fails).
  // NOT_FOUND when the tenant has no communicator `id` (another tenant's included).
  virtual absl::Status Disconnect(const std::string& tenant, uint64_t id) = 0;

  // Gets the received payload (device memory of options().device, `bytes` long) into the pool;
  // runs on the communicator's thread.
  using Consume = std::function<absl::Status(const uint8_t* device, uint64_t bytes)>;
  // Puts the payload to send into `device` (`bytes` long); runs on the communicator's thread.
  using Produce = std::function<absl::Status(uint8_t* device, uint64_t bytes)>;
  // For a process that holds the peer's rank itself (a single-rank communicator, whose one rank
  // sends to itself: the GPU tests): NCCL calls issued in the same group as the plane's own
  // operation, given the ncclComm_t and the cudaStream_t (as void*).
  using PeerOps = std::function<absl::Status(void* comm, void* stream)>;

  // Checks a transfer of `bytes` with rank `peer` on `tenant`'s communicator `id` before any
  // operation is issued: NOT_FOUND for an unknown or foreign id; INVALID_ARGUMENT for bytes of 0
  // or past max_transfer_bytes, or a peer outside the communicator or equal to this side's rank
  // (unless the communicator has one rank); FAILED_PRECONDITION when the communicator failed or
  // was aborted, saying why.
  virtual absl::Status Check(const std::string& tenant, uint64_t id, int peer,
                             uint64_t bytes) const = 0;
  // Receives `bytes` from `peer` into a device buffer and hands them to `consume`. Blocks the
  // caller (a worker, never an RPC reaction) until the transfer is done, in arrival order with
  // the communicator's other transfers. Errors: Check's; DEADLINE_EXCEEDED when the peer's send
  // does not come within transfer_timeout (the communicator is then aborted); INTERNAL for a CUDA
  // or NCCL failure (aborted too); what consume answers (the communicator stays usable).
  virtual absl::Status Receive(const std::string& tenant, uint64_t id, int peer, uint64_t bytes,
                               const Consume& consume, const PeerOps& also = nullptr) = 0;
  // Has `produce` fill a device buffer of `bytes` and sends it to `peer`. As Receive. When
  // produce fails nothing is sent: the peer's receive is left waiting, and the caller must tell
  // the peer (the RPC's status) so that it aborts its own side.
  virtual absl::Status Send(const std::string& tenant, uint64_t id, int peer, uint64_t bytes,
                            const Produce& produce, const PeerOps& also = nullptr) = 0;

  // Communicators open now (tests and stats).
  virtual size_t num_comms() const = 0;

 protected:
  NcclPlane() = default;
};

}  // namespace kvbank::plane

#endif  // KVBANK_SERVER_PLANE_NCCL_PLANE_H_
