// Internal to the SDK: the client's side of the NCCL plane (Client::NcclConnect and the
// transfers over it). A communicator of two ranks: this process (rank 0, on the caller's CUDA
// device) and kvbankd (rank 1). Built with NCCL where the SDK is built with CUDA and NCCL
// (KVBANK_SDK_NCCL); otherwise every call answers UNIMPLEMENTED.
#ifndef KVBANK_CLIENT_NCCL_LINK_H_
#define KVBANK_CLIENT_NCCL_LINK_H_

#include <cstdint>
#include <functional>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvbank/v1/kvbank.grpc.pb.h"

namespace kvbank::internal {

// True when this SDK was built with NCCL.
bool NcclInSdk();

// Sets up one call's context: its deadline (stream: a transfer's) and credentials.
using PrepareCall = std::function<void(grpc::ClientContext* ctx, bool stream)>;

// One communicator with kvbankd. Thread-safe: transfers run one at a time (NCCL needs both
// ranks to issue them in the same order, and kvbankd runs them in arrival order).
class NcclLink {
 public:
  // ncclGetUniqueId on `device`, NcclConnect, and ncclCommInitRank for rank 0 (begun before the
  // RPC, completed after it, so both ranks join at once). `stub` and `prepare` must outlive
  // the link. UNIMPLEMENTED without NCCL in the SDK; the server's refusal as is; INTERNAL for a
  // CUDA or NCCL failure; DEADLINE_EXCEEDED when the join does not complete in time.
  static absl::StatusOr<std::unique_ptr<NcclLink>> Connect(v1::KvBank::Stub* stub,
                                                           PrepareCall prepare, int device,
                                                           absl::Duration timeout);
  // Aborts the communicator (NcclDisconnect to kvbankd first, when it is still usable).
  virtual ~NcclLink() = default;

  virtual uint64_t comm_id() const = 0;
  // Append whose payload (header.payload_bytes bytes at `device_ptr` on the link's device) goes
  // by ncclSend once kvbankd says it is ready. A failure after the send began (the server
  // answered an error, or the send did not complete) aborts the communicator: connect again.
  virtual absl::StatusOr<v1::AppendResponse> Append(v1::AppendHeader header,
                                                    const void* device_ptr) = 0;
  // Fetch received by ncclRecv into `device_ptr` (capacity bytes). Answers the header (its
  // payload_bytes: what was received).
  virtual absl::StatusOr<v1::FetchHeader> Fetch(v1::FetchRequest req, void* device_ptr,
                                                uint64_t capacity) = 0;

 protected:
  NcclLink() = default;
};

}  // namespace kvbank::internal

#endif  // KVBANK_CLIENT_NCCL_LINK_H_
