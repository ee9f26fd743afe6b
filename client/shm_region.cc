// The SDK's side of the same-host shared-memory plane: the sealed memfd, the socket handshake
// (proto/shm_wire.h) and the region's teardown. Client::RegisterRegion (client_planes.cc) adds the
// gRPC step.
#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/shm_handshake.h"
#include "kvbank/client.h"
#include "proto/shm_wire.h"

namespace kvbank {
namespace internal {
namespace {

absl::Status Errno(absl::string_view what, absl::StatusCode code = absl::StatusCode::kInternal) {
  return absl::Status(code, absl::StrCat(what, ": ", std::strerror(errno)));
}

// Reads exactly n bytes; false on EOF or error.
bool ReadFull(int fd, void* out, size_t n) {
  auto* p = static_cast<char*>(out);
  while (n > 0) {
    const ssize_t got = read(fd, p, n);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    p += got;
    n -= static_cast<size_t>(got);
  }
  return true;
}

}  // namespace

absl::StatusOr<int> CreateSealedMemfd(uint64_t size) {
  if (size == 0) return absl::InvalidArgumentError("region size is 0");
  const int fd = memfd_create("kvbank-region", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return Errno("memfd_create");
  // Every page written here, so that it is this process's memory (and memory cgroup's):
  // kvbankd refuses a memfd with a hole, whose pages its own copies would allocate. (fallocate
  // would allocate them too, but tmpfs reports allocated pages that were never written as holes.)
  auto fill = [fd, size] {
    static const std::vector<char> zeros(size_t{1} << 20, 0);
    for (uint64_t at = 0; at < size;) {
      const ssize_t n =
          pwrite(fd, zeros.data(), std::min<uint64_t>(zeros.size(), size - at), off_t(at));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      at += uint64_t(n);
    }
    return true;
  };
  if (ftruncate(fd, static_cast<off_t>(size)) != 0 || !fill() ||
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    absl::Status s = Errno("memfd: size, allocate and seal",
                           errno == ENOSPC || errno == ENOMEM ? absl::StatusCode::kResourceExhausted
                                                              : absl::StatusCode::kInternal);
    close(fd);
    return s;
  }
  return fd;
}

absl::StatusOr<ShmHandoff> HandOver(const std::string& socket_path, int fd) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (socket_path.empty() || socket_path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm socket path '", socket_path, "' is empty or too long"));
  }
  std::memcpy(addr.sun_path, socket_path.data(), socket_path.size());
  ShmHandoff out;
  out.conn = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (out.conn < 0) return Errno("shm socket");
  auto fail = [&out](absl::Status s) {
    close(out.conn);
    return s;
  };
  if (connect(out.conn, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    return fail(Errno(absl::StrCat("connect to kvbankd's shm socket ", socket_path),
                      absl::StatusCode::kUnavailable));
  }
  // The memory goes only to a server of this user (or root): a socket another user made at the
  // path the server named would otherwise receive this process's memory.
  ucred peer{};
  socklen_t peer_len = sizeof(peer);
  if (getsockopt(out.conn, SOL_SOCKET, SO_PEERCRED, &peer, &peer_len) != 0) {
    return fail(Errno("shm socket: SO_PEERCRED", absl::StatusCode::kUnavailable));
  }
  if (peer.uid != geteuid() && peer.uid != 0) {
    return fail(absl::PermissionDeniedError(
        absl::StrCat("the shm socket ", socket_path, " is served by uid ", peer.uid,
                     ", not this user (", geteuid(), ") or root: no region handed over")));
  }
  struct stat st;
  if (fstat(fd, &st) != 0) return fail(Errno("region memfd: fstat"));
  // A reply that never comes (a server that hangs) must not hang the caller.
  timeval timeout{30, 0};
  setsockopt(out.conn, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  proto::ShmHello hello{};
  std::memcpy(hello.magic, proto::kShmMagic, sizeof(hello.magic));
  iovec iov{&hello, sizeof(hello)};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  // A server that refuses at once (too many regions) may have answered and closed before this
  // send: its answer is still read, and says why.
  absl::Status sent = absl::OkStatus();
  if (sendmsg(out.conn, &msg, MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof(hello))) {
    sent = Errno("send the region to kvbankd", absl::StatusCode::kUnavailable);
  }
  proto::ShmReply reply{};
  if (!ReadFull(out.conn, &reply, sizeof(reply)) ||
      std::memcmp(reply.magic, proto::kShmMagic, sizeof(reply.magic)) != 0 ||
      reply.message_bytes > proto::kShmMaxMessageBytes) {
    return fail(!sent.ok() ? sent
                           : absl::UnavailableError(
                                 "kvbankd's shm socket closed or answered no shm reply"));
  }
  std::string text(reply.message_bytes, '\0');
  if (!ReadFull(out.conn, text.data(), text.size())) {
    return fail(absl::UnavailableError("kvbankd's shm reply was cut short"));
  }
  if (reply.status != 0) {
    const auto code = reply.status <= uint32_t(absl::StatusCode::kUnauthenticated)
                          ? static_cast<absl::StatusCode>(reply.status)
                          : absl::StatusCode::kInternal;
    return fail(absl::Status(code, text.empty() ? "kvbankd refused the region" : text));
  }
  if (reply.size != static_cast<uint64_t>(st.st_size)) {
    return fail(absl::InternalError(absl::StrCat("kvbankd's shm reply names ", reply.size,
                                                 " bytes for a region of ", st.st_size)));
  }
  out.handle.assign(reinterpret_cast<const char*>(reply.handle), sizeof(reply.handle));
  out.size = reply.size;
  return out;
}

}  // namespace internal

ShmRegion::~ShmRegion() {
  if (conn_ >= 0) close(conn_);  // kvbankd drops the region when this connection closes
  if (data_ != nullptr) munmap(data_, size_);
  if (memfd_ >= 0) close(memfd_);
}

}  // namespace kvbank
