// The handshake of the same-host shared-memory plane on kvbankd's --shm-socket (a Unix-domain
// SOCK_STREAM socket). Both ends run on one host, so integers travel in host byte order.
//
//   client -> server  one message: ShmHello (8 bytes), exactly one descriptor in SCM_RIGHTS: a
//                     memfd or other tmpfs file of 1 .. --shm-max-region-bytes, every page
//                     written; sealed against shrinking (F_SEAL_SHRINK, as the SDK's are) or not
//                     (kvbankd guards the mapping; transfers fail once the file shrinks)
//   server -> client  ShmReply, then `message_bytes` bytes of text (why, when status is not 0)
//
// On status 0 the server has mapped the memfd and the client claims it with the gRPC call
// RegisterRegion{handle}; the region lives until UnregisterRegion or until the client closes this
// connection, whichever comes first. On any other status the server closes the connection. A
// peer that sends anything else (no descriptor, other bytes, more than the hello) is closed.
#ifndef KVBANK_PROTO_SHM_WIRE_H_
#define KVBANK_PROTO_SHM_WIRE_H_

#include <cstdint>

namespace kvbank::proto {

inline constexpr char kShmMagic[8] = {'K', 'V', 'B', 'S', 'H', 'M', '0', '1'};
inline constexpr uint32_t kShmHandleBytes = 16;
inline constexpr uint32_t kShmMaxMessageBytes = 512;

struct ShmHello {
  char magic[8];
};

struct ShmReply {
  char magic[8];
  uint32_t status;         // a gRPC status code: 0 OK
  uint32_t message_bytes;  // the text after this struct, at most kShmMaxMessageBytes
  uint8_t handle[kShmHandleBytes];
  uint64_t size;  // bytes of the region mapped
};

}  // namespace kvbank::proto

#endif  // KVBANK_PROTO_SHM_WIRE_H_
