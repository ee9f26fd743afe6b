// Internal to the SDK (and its tests): the client side of kvbankd's --shm-socket handshake
// (proto/shm_wire.h).
#ifndef KVBANK_CLIENT_SHM_HANDSHAKE_H_
#define KVBANK_CLIENT_SHM_HANDSHAKE_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace kvbank::internal {

struct ShmHandoff {
  int conn = -1;       // the connection the region lives by; the caller closes it
  std::string handle;  // for RegisterRegion
  uint64_t size = 0;   // bytes the server mapped
};

// A memfd of `size` bytes made for the plane: MFD_ALLOW_SEALING, sized, every page written (the
// pages are the caller's, charged to its memory cgroup, not kvbankd's), sealed with
// F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL. The caller owns the descriptor.
absl::StatusOr<int> CreateSealedMemfd(uint64_t size);

// Connects to `socket_path`, sends `fd` and reads the answer. UNAVAILABLE when nothing answers;
// the server's refusal with its status code and text; INTERNAL for a reply that is not one.
absl::StatusOr<ShmHandoff> HandOver(const std::string& socket_path, int fd);

}  // namespace kvbank::internal

#endif  // KVBANK_CLIENT_SHM_HANDSHAKE_H_
