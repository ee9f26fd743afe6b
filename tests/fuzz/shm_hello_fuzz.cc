// kvbankd's shared-memory socket (plane::ShmRegions) over fuzzer-chosen hellos: bytes on a Unix
// connection, with or without a descriptor attached (a memfd of a fuzzer-chosen size, written
// whole or not, sealed or not; or a plain pipe), sent in one piece or two. Properties: the
// listener never crashes; an answer, when one comes, is a whole reply with the magic, a status
// code in range and at most kShmMaxMessageBytes of text, and its status is 0 only for exactly the
// hello and one well-formed memfd; nothing is left registered or pending once the connection
// closes; the socket still takes a well-formed region afterwards (checked now and then).
#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "absl/time/clock.h"
#include "client/shm_handshake.h"
#include "proto/shm_wire.h"
#include "server/plane/shm_regions.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

using kvbank::plane::ShmRegions;

ShmRegions& Regions() {
  static ShmRegions* regions = [] {
    char dir[] = "/tmp/kvbank-shm-fuzz-XXXXXX";
    if (mkdtemp(dir) == nullptr) std::abort();
    kvbank::plane::ShmOptions o;
    o.socket_path = std::string(dir) + "/shm.sock";
    o.max_region_bytes = 1 << 20;
    // Every connection is closed by its round; the timeout only must not cut a slow hello.
    o.claim_timeout = absl::Seconds(60);
    auto r = ShmRegions::Start(o);
    if (!r.ok()) std::abort();
    return r->release();
  }();
  return *regions;
}

int Connect(const std::string& path) {
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  if (fd < 0 || connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) std::abort();
  // The server answers or closes every connection promptly once the client has shut down its
  // end; the limit is only there so that a server that hangs fails the run instead of stalling
  // it, and is long because eight fuzzers on two cores can stall the listener for seconds.
  timeval t{30, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &t, sizeof(t));
  return fd;
}

// Sends `bytes` with `fd` (-1: none) attached.
void Send(int conn, const std::string& bytes, int fd) {
  iovec iov{const_cast<char*>(bytes.data()), bytes.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  if (fd >= 0) {
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  }
  (void)sendmsg(conn, &msg, MSG_NOSIGNAL);
}

// Reads what the server answers until it closes its end (or breaks the connection). A server
// that neither answers nor closes within the receive timeout is a failure of its own.
std::string Drain(int conn) {
  std::string got;
  char buf[1024];
  for (;;) {
    const ssize_t n = recv(conn, buf, sizeof(buf), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      std::fprintf(stderr, "kvbankd's shm listener neither answered nor closed in 30 s\n");
      std::abort();
    }
    if (n <= 0) break;
    got.append(buf, size_t(n));
  }
  return got;
}

bool WaitUntilEmpty(ShmRegions& r) {
  // Long for the same reason as the receive timeout; the usual wait is a millisecond or two.
  const absl::Time until = absl::Now() + absl::Seconds(30);
  while (absl::Now() < until) {
    if (r.num_regions() == 0 && r.num_pending() == 0 && r.num_connections() == 0) return true;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return false;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ShmRegions& regions = Regions();
  const std::string& path = regions.options().socket_path;
  FuzzedDataProvider in(data, size);
  // No descriptor, a memfd, a pipe, or the memfd sent with both pieces.
  const int attach = in.ConsumeIntegralInRange<int>(0, 3);
  const uint32_t memfd_size = in.ConsumeIntegralInRange<uint32_t>(0, 2 << 20);
  const bool written = in.ConsumeBool();
  const bool sealed = in.ConsumeBool();
  const size_t split = in.ConsumeIntegralInRange<size_t>(0, 64);
  const std::string bytes = in.ConsumeRemainingBytesAsString();

  int fd = -1, extra = -1;
  if (attach == 1 || attach == 3) {
    fd = memfd_create("fuzz", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd >= 0 && memfd_size > 0) {
      if (ftruncate(fd, memfd_size) != 0) std::abort();
      if (written) {
        const std::string zeros(memfd_size, '\0');
        if (pwrite(fd, zeros.data(), zeros.size(), 0) != ssize_t(zeros.size())) std::abort();
      }
    }
    if (fd >= 0 && sealed) fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW);
  } else if (attach == 2) {
    int p[2];
    if (pipe2(p, O_CLOEXEC) == 0) {
      fd = p[0];
      extra = p[1];
    }
  }
  const int conn = Connect(path);
  const size_t cut = std::min(split, bytes.size());
  Send(conn, bytes.substr(0, cut), fd);
  if (cut < bytes.size()) Send(conn, bytes.substr(cut), attach == 3 ? fd : -1);
  shutdown(conn, SHUT_WR);
  const std::string answer = Drain(conn);
  // A region can be taken only from the magic and a well-formed memfd (its first 8 bytes: the
  // server reads the hello alone, and drops the region at anything after it); the exact hello,
  // sent whole with such a memfd, is always taken.
  // Sealed or not: an unsealed memfd is taken too, its mapping guarded against SIGBUS.
  const bool good_fd =
      (attach == 1 || attach == 3) && memfd_size > 0 && memfd_size <= (1u << 20) && written;
  const bool may_take =
      good_fd && bytes.size() >= 8 && std::memcmp(bytes.data(), kvbank::proto::kShmMagic, 8) == 0;
  const bool exact = may_take && attach == 1 && bytes.size() == 8 && cut == 8;
  if (!answer.empty()) {
    kvbank::proto::ShmReply reply{};
    FUZZ_CHECK(answer.size() >= sizeof(reply));
    std::memcpy(&reply, answer.data(), sizeof(reply));
    FUZZ_CHECK(std::memcmp(reply.magic, kvbank::proto::kShmMagic, 8) == 0);
    FUZZ_CHECK(reply.status <= 16);
    FUZZ_CHECK(reply.message_bytes <= kvbank::proto::kShmMaxMessageBytes);
    FUZZ_CHECK(answer.size() == sizeof(reply) + reply.message_bytes);
    if (reply.status == 0) FUZZ_CHECK(may_take && reply.size == memfd_size);
    if (exact) FUZZ_CHECK(reply.status == 0);
  } else {
    FUZZ_CHECK(!exact);  // a well-formed region is always answered
  }
  close(conn);
  if (fd >= 0) close(fd);
  if (extra >= 0) close(extra);
  // The connection is gone: so is whatever came on it.
  FUZZ_CHECK(WaitUntilEmpty(regions));
  // Now and then, a well-formed region still goes through.
  static int round = 0;
  if (++round % 64 == 0) {
    auto memfd = kvbank::internal::CreateSealedMemfd(4096);
    FUZZ_CHECK(memfd.ok());
    auto h = kvbank::internal::HandOver(path, *memfd);
    FUZZ_CHECK(h.ok());
    close(h->conn);
    close(*memfd);
    FUZZ_CHECK(WaitUntilEmpty(regions));
  }
  return 0;
}
