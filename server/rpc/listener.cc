#include "server/rpc/listener.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace kvbank::rpc {

namespace {

// "host:port" / "[v6]:port" / ":port" -> host (maybe empty) and port.
absl::Status SplitHostPort(const std::string& address, std::string* host, uint16_t* port) {
  const size_t colon = address.rfind(':');
  uint32_t p = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &p) || p > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("listen address '", address.substr(0, 200), "' is not host:port"));
  }
  *host = address.substr(0, colon);
  if (host->size() >= 2 && host->front() == '[' && host->back() == ']') {
    *host = host->substr(1, host->size() - 2);
  }
  *port = static_cast<uint16_t>(p);
  return absl::OkStatus();
}

int LocalPort(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return 0;
  if (addr.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  if (addr.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
  return 0;
}

ino_t SocketInode(int fd) {
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) return 0;
  return st.st_ino;
}

}  // namespace

uint64_t RaiseDescriptorLimit() {
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) != 0) return 0;
  if (lim.rlim_cur < lim.rlim_max) {
    rlimit raised = lim;
    raised.rlim_cur = lim.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &raised) == 0) lim = raised;
  }
  return lim.rlim_cur == RLIM_INFINITY ? uint64_t{1} << 20 : uint64_t(lim.rlim_cur);
}

absl::StatusOr<std::unique_ptr<Listener>> Listener::Bind(const std::string& address, int backlog) {
  std::string host;
  uint16_t port = 0;
  if (absl::Status s = SplitHostPort(address, &host, &port); !s.ok()) return s;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &found);
      rc != 0) {
    return absl::InvalidArgumentError(absl::StrCat("listen address '", address.substr(0, 200),
                                                   "' does not resolve: ", gai_strerror(rc)));
  }
  std::unique_ptr<Listener> l(new Listener());
  size_t count = 0;
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) ++count;
  absl::Status status;
  for (addrinfo* a = found; a != nullptr && status.ok(); a = a->ai_next) {
    if (l->port_ != 0) {  // port 0: every address takes the port the first one got
      if (a->ai_family == AF_INET) {
        reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_port = htons(l->port_);
      } else if (a->ai_family == AF_INET6) {
        reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_port = htons(l->port_);
      }
    }
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
      status = absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
      break;
    }
    l->listen_fds_.push_back(fd);
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));  // TIME_WAIT does not block
    // Several addresses (a name with IPv4 and IPv6 ones): each socket takes its own family only.
    if (a->ai_family == AF_INET6 && count > 1) {
      setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof(one));
    }
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0) {
      const int err = errno;
      char ip[INET6_ADDRSTRLEN] = "?";
      const void* raw =
          a->ai_family == AF_INET
              ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr)
              : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr);
      inet_ntop(a->ai_family, raw, ip, sizeof(ip));
      const int p = a->ai_family == AF_INET
                        ? ntohs(reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_port)
                        : ntohs(reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_port);
      status = err == EADDRINUSE
                   ? absl::FailedPreconditionError(absl::StrCat(
                         "port ", p, " on ", ip, " is in use (is another kvbankd serving it?)"))
                   : absl::FailedPreconditionError(
                         absl::StrCat("cannot bind ", ip, " port ", p, ": ", std::strerror(err)));
      break;
    }
    if (listen(fd, backlog) != 0) {
      status = absl::InternalError(absl::StrCat("listen: ", std::strerror(errno)));
      break;
    }
    if (l->port_ == 0) l->port_ = LocalPort(fd);
  }
  freeaddrinfo(found);
  if (!status.ok()) return status;  // ~Listener closes what was opened
  if (l->listen_fds_.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("listen address '", address.substr(0, 200), "' resolves to nothing"));
  }
  if (pipe2(l->wake_, O_CLOEXEC | O_NONBLOCK) != 0) {
    return absl::InternalError(absl::StrCat("pipe: ", std::strerror(errno)));
  }
  l->reserve_fd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
  return l;
}

Listener::~Listener() {
  Stop();
  for (int fd : listen_fds_) close(fd);
  for (int fd : wake_) {
    if (fd >= 0) close(fd);
  }
  if (reserve_fd_ >= 0) close(reserve_fd_);
}

void Listener::Start(std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> acceptor,
                     uint64_t max_connections, OverCap over_cap) {
  acceptor_ = std::move(acceptor);
  max_connections_ = max_connections;
  over_cap_ = over_cap;
  accepting_.store(true, std::memory_order_release);
  thread_ = std::thread([this] { Run(); });
}

void Listener::Stop() {
  if (!thread_.joinable()) return;
  const char byte = 1;
  (void)!write(wake_[1], &byte, 1);
  thread_.join();
  accepting_.store(false, std::memory_order_release);
}

ListenerStats Listener::stats() const {
  ListenerStats s;
  s.accepted = accepted_.load(std::memory_order_relaxed);
  s.refused_over_cap = refused_over_cap_.load(std::memory_order_relaxed);
  s.refused_no_fds = refused_no_fds_.load(std::memory_order_relaxed);
  s.open = open_.load(std::memory_order_relaxed);
  s.closed_oldest = closed_oldest_.load(std::memory_order_relaxed);
  return s;
}

void Listener::Run() {
  std::vector<pollfd> fds;
  for (int fd : listen_fds_) fds.push_back({fd, POLLIN, 0});
  fds.push_back({wake_[0], POLLIN, 0});
  int backoff_ms = -1;  // after running out of descriptors: wait before trying again
  absl::Time last_complaint = absl::InfinitePast();
  for (;;) {
    const int ready = poll(fds.data(), fds.size(), backoff_ms);
    if (ready < 0 && errno != EINTR) break;
    if (fds.back().revents != 0) break;                               // Stop
    if (backoff_ms > 0 && ready == 0 && !DescriptorFree()) continue;  // still none to spare
    backoff_ms = -1;
    for (size_t i = 0; i + 1 < fds.size(); ++i) {
      for (;;) {
        errno = 0;
        if (AcceptOne(fds[i].fd)) continue;
        if (errno == EMFILE || errno == ENFILE) {
          if (absl::Now() - last_complaint > absl::Seconds(10)) {
            // write(2), not iostreams: nothing here may need a descriptor or much memory.
            static constexpr char kMessage[] =
                "kvbankd: out of file descriptors: closing new connections at once until some "
                "are free (raise the limit or lower --max-connections)\n";
            (void)!write(STDERR_FILENO, kMessage, sizeof(kMessage) - 1);
            last_complaint = absl::Now();
          }
          backoff_ms = 20;
        }
        break;
      }
    }
  }
}

bool Listener::DescriptorFree() {
  if (reserve_fd_ < 0) reserve_fd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (reserve_fd_ < 0) return false;
  const int probe = fcntl(reserve_fd_, F_DUPFD_CLOEXEC, 0);
  if (probe < 0) return false;
  close(probe);
  accepting_.store(true, std::memory_order_release);
  return true;
}

bool Listener::AcceptOne(int listen_fd) {
  int fd = accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
  if (fd < 0) {
    const int err = errno;
    if (err == EINTR || err == ECONNABORTED) return true;  // that one is gone; take the next
    if (err != EMFILE && err != ENFILE) return false;      // EAGAIN: nothing pending
    accepting_.store(false, std::memory_order_release);
    // No descriptor is left: spend the reserve one on the waiting connection and close it, so
    // its client fails now instead of hanging in the backlog until its deadline.
    if (reserve_fd_ >= 0) {
      close(reserve_fd_);
      reserve_fd_ = -1;
      const int doomed = accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
      if (doomed >= 0) {
        close(doomed);
        refused_no_fds_.fetch_add(1, std::memory_order_relaxed);
      }
      reserve_fd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
    }
    errno = err;
    return false;
  }
  accepting_.store(true, std::memory_order_release);
  // Closed connections are forgotten lazily: at the cap, and whenever the list has doubled since
  // the last sweep (so it stays within twice the open connections, at O(1) a connection).
  if (handed_.size() >= max_connections_ || handed_.size() >= next_sweep_) Sweep();
  if (handed_.size() >= max_connections_ && over_cap_ == OverCap::kCloseOldest) {
    // The oldest connection still open goes: gRPC sees it end and closes its descriptor. The
    // inode is checked first, so a descriptor gRPC already closed and reused is left alone.
    while (!handed_.empty() && handed_.size() >= max_connections_) {
      const auto [old_fd, old_ino] = handed_.front();
      handed_.erase(handed_.begin());
      if (old_ino != 0 && SocketInode(old_fd) == old_ino) {
        shutdown(old_fd, SHUT_RDWR);
        closed_oldest_.fetch_add(1, std::memory_order_relaxed);
      }
    }
  }
  if (handed_.size() >= max_connections_) {
    close(fd);
    refused_over_cap_.fetch_add(1, std::memory_order_relaxed);
    return true;
  }
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  handed_.emplace_back(fd, SocketInode(fd));
  open_.store(handed_.size(), std::memory_order_relaxed);
  accepted_.fetch_add(1, std::memory_order_relaxed);
  grpc::experimental::ExternalConnectionAcceptor::NewConnectionParameters p;
  p.listener_fd = listen_fd;
  p.fd = fd;
  acceptor_->HandleNewConnection(&p);  // gRPC owns fd from here on
  return true;
}

void Listener::Sweep() {
  // At the cap, a flood of connections would sweep once each: at most one sweep a millisecond.
  const absl::Time now = absl::Now();
  if (now - last_sweep_ < absl::Milliseconds(1)) return;
  last_sweep_ = now;
  std::vector<std::pair<int, ino_t>> open;
  open.reserve(handed_.size());
  for (const auto& [fd, ino] : handed_) {
    // Closed by gRPC: the descriptor is gone, or was reused for another file or connection.
    if (ino != 0 && SocketInode(fd) == ino) open.emplace_back(fd, ino);
  }
  handed_ = std::move(open);
  next_sweep_ = std::max<size_t>(2 * handed_.size(), 1024);
  open_.store(handed_.size(), std::memory_order_relaxed);
}

}  // namespace kvbank::rpc
