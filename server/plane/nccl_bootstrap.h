// Where an ncclUniqueId sends kvbankd: NcclConnect hands kvbankd a client's unique id, and
// ncclCommInitRank then connects to the bootstrap address inside it. A unique id that names
// someone else's address would have kvbankd connect wherever a client likes (a port scan, a
// connection to a service on kvbankd's network), so the address must be the caller's own.
//
// The unique id is NCCL's ncclBootstrapHandle: a 64-bit magic, then the bootstrap root's socket
// address (a sockaddr_in or sockaddr_in6, as NCCL 2.x lays it out).
#ifndef KVBANK_SERVER_PLANE_NCCL_BOOTSTRAP_H_
#define KVBANK_SERVER_PLANE_NCCL_BOOTSTRAP_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvbank::plane {

// The bootstrap root's IP address in a unique id (kNcclUniqueIdBytes), as text ("10.0.0.7",
// "fd00::1"). INVALID_ARGUMENT when it names no IPv4 or IPv6 address.
absl::StatusOr<std::string> NcclBootstrapAddress(absl::string_view unique_id);

// OK when the unique id's bootstrap address is the caller's: the address of `grpc_peer` (gRPC's
// ServerContext::peer(): "ipv4:1.2.3.4:port", "ipv6:[::1]:port"), or, for a caller on this host
// (a loopback or Unix-socket peer), one of `local_addresses` (this host's). PERMISSION_DENIED
// naming both otherwise; INVALID_ARGUMENT for a unique id with no address.
absl::Status CheckNcclBootstrap(absl::string_view unique_id, absl::string_view grpc_peer,
                                const std::vector<std::string>& local_addresses);

// This host's interface addresses, as text (getifaddrs).
std::vector<std::string> LocalAddresses();

}  // namespace kvbank::plane

#endif  // KVBANK_SERVER_PLANE_NCCL_BOOTSTRAP_H_
