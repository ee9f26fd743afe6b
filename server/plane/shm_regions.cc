#include "server/plane/shm_regions.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "openssl/rand.h"
#include "proto/shm_wire.h"

namespace kvbank::plane {

// A claimed connection's reply side, shared by its calls in flight: replies are written from
// whichever thread answers, while the listener may close the connection.
struct ShmControlLink {
  absl::Mutex mu;
  int fd ABSL_GUARDED_BY(mu) = -1;  // -1 once the connection is closed
  int wake_fd = -1;                 // the listener's eventfd; valid while fd >= 0
  uint32_t in_flight ABSL_GUARDED_BY(mu) = 0;
  absl::flat_hash_map<uint64_t, std::weak_ptr<ShmControlCall>> calls ABSL_GUARDED_BY(mu);
};

namespace {

void Wake(int wake_fd) {
  const uint64_t one = 1;
  (void)!write(wake_fd, &one, sizeof(one));
}

absl::Status Errno(absl::string_view what) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(errno)));
}

// Sends `reply` and `message` without blocking; a peer that does not read loses the answer (its
// connection is closed on error anyway).
void SendReply(int fd, uint32_t status, absl::string_view message, absl::string_view handle,
               uint64_t size) {
  proto::ShmReply reply{};
  std::memcpy(reply.magic, proto::kShmMagic, sizeof(reply.magic));
  reply.status = status;
  message = message.substr(0, proto::kShmMaxMessageBytes);
  reply.message_bytes = static_cast<uint32_t>(message.size());
  std::memcpy(reply.handle, handle.data(), std::min<size_t>(handle.size(), sizeof(reply.handle)));
  reply.size = size;
  std::string out(reinterpret_cast<const char*>(&reply), sizeof(reply));
  out.append(message.data(), message.size());
  (void)send(fd, out.data(), out.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
}

// Whether a server answers on the socket at `path`.
bool Answers(const sockaddr_un& addr) {
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  const bool ok = connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  return ok;
}

}  // namespace

ShmControlCall::ShmControlCall(std::string tenant, proto::ShmControlRequest request,
                               std::shared_ptr<ShmControlLink> link, uint64_t serial)
    : tenant_(std::move(tenant)),
      request_(std::move(request)),
      deadline_(request_.timeout_ms == 0 ? absl::InfiniteFuture()
                                         : absl::Now() + absl::Milliseconds(request_.timeout_ms)),
      link_(std::move(link)),
      serial_(serial) {}

ShmControlCall::~ShmControlCall() {
  // A call dropped unanswered (a handler that failed to answer) still frees its place.
  if (!replied_.load()) Reply(absl::InternalError("kvbankd dropped the request unanswered"));
}

void ShmControlCall::OnEnd(std::function<void()> fn) {
  {
    absl::MutexLock lock(&mu_);
    if (!ended_.load()) {
      on_end_.push_back(std::move(fn));
      return;
    }
  }
  fn();
}

void ShmControlCall::End() {
  std::vector<std::function<void()>> run;
  {
    absl::MutexLock lock(&mu_);
    if (ended_.exchange(true)) return;
    run.swap(on_end_);
  }
  for (auto& fn : run) fn();
}

void ShmControlCall::EndAtDeadline() {
  past_deadline_.store(true, std::memory_order_release);
  End();
}

void ShmControlCall::Reply(const absl::StatusOr<proto::ShmControlAnswer>& answer) {
  if (replied_.exchange(true)) return;
  proto::ShmControlReplyFrame frame;
  frame.request_id = request_.request_id;
  frame.op = request_.op();
  if (answer.ok()) {
    frame.answer = *answer;
  } else if (answer.status().code() == absl::StatusCode::kCancelled &&
             past_deadline_.load(std::memory_order_acquire)) {
    frame.status =
        absl::DeadlineExceededError(absl::StrCat("the request's timeout_ms (", request_.timeout_ms,
                                                 ") passed: ", answer.status().message()));
  } else {
    frame.status = answer.status();
  }
  const std::vector<uint8_t> bytes = proto::EncodeShmControlReply(frame);
  absl::MutexLock lock(&link_->mu);
  link_->calls.erase(serial_);
  const bool was_full = link_->in_flight-- == proto::kShmControlMaxInFlight;
  if (link_->fd < 0) return;  // the asker is gone
  // NOTE: at most kShmControlMaxInFlight replies are ever unread, and they fit the socket's
  // buffer; a reply that does not fit means a client that reads none: it is closed (the
  // listener sees the shutdown and drops the connection).
  const ssize_t n = send(link_->fd, bytes.data(), bytes.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
  if (n != static_cast<ssize_t>(bytes.size())) shutdown(link_->fd, SHUT_RDWR);
  if (was_full) Wake(link_->wake_fd);  // the listener reads the connection again
}

absl::StatusOr<std::string> DefaultShmSocketPath() {
  const char* xdg = std::getenv("XDG_RUNTIME_DIR");
  const std::string dir = xdg != nullptr && xdg[0] == '/' ? absl::StrCat(xdg, "/kvbank")
                                                          : absl::StrCat("/tmp/kvbank-", geteuid());
  if (mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot make the shm socket folder ", dir, ": ", std::strerror(errno)));
  }
  // NOTE: /tmp is shared: another user could have made the folder first (and would then see
  // or replace the socket). Only a real directory of this user, writable by it alone, is used.
  struct stat st;
  if (lstat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != geteuid() ||
      (st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("the shm socket folder ", dir,
                     " is not a directory of this user that only it can write (mode 0700); "
                     "remove it or name a socket with --shm-socket"));
  }
  // Sockets of servers that are gone (killed before they could remove theirs): named by a pid
  // that no process has. (Never by connecting: a server that has bound its socket but not yet
  // listened refuses connections, and its socket would be taken for a stale one.)
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) {
      absl::string_view name = e->d_name;
      int pid = 0;
      if (!absl::ConsumePrefix(&name, "kvbankd-") || !absl::ConsumeSuffix(&name, ".sock") ||
          !absl::SimpleAtoi(name, &pid) || pid <= 0 || pid == getpid()) {
        continue;
      }
      if (kill(pid, 0) != 0 && errno == ESRCH) {
        const std::string path = absl::StrCat(dir, "/", e->d_name);
        struct stat sst;
        if (lstat(path.c_str(), &sst) == 0 && S_ISSOCK(sst.st_mode)) unlink(path.c_str());
      }
    }
    closedir(d);
  }
  return absl::StrCat(dir, "/kvbankd-", getpid(), ".sock");
}

absl::StatusOr<std::unique_ptr<ShmRegions>> ShmRegions::Start(ShmOptions options) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (options.socket_path.empty() || options.socket_path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--shm-socket must be a path of 1..", sizeof(addr.sun_path) - 1, " bytes"));
  }
  if (options.max_regions == 0 || options.max_region_bytes == 0) {
    return absl::InvalidArgumentError("--shm-max-regions and --shm-max-region-bytes must be > 0");
  }
  std::memcpy(addr.sun_path, options.socket_path.data(), options.socket_path.size());
  struct stat st;
  if (lstat(options.socket_path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return absl::FailedPreconditionError(
          absl::StrCat("--shm-socket ", options.socket_path, " exists and is not a socket"));
    }
    if (Answers(addr)) {
      return absl::FailedPreconditionError(
          absl::StrCat("--shm-socket ", options.socket_path, ": another server answers on it"));
    }
    unlink(options.socket_path.c_str());  // stale: its server is gone
  }
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return Errno("--shm-socket: socket");
  if (bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    absl::Status s = Errno(absl::StrCat("--shm-socket: bind ", options.socket_path));
    close(fd);
    return s;
  }
  // Owner only. Connecting gives nothing by itself (a region is claimed only through an
  // authenticated RegisterRegion, with a handle only its sender knows); this keeps other users
  // from holding connections.
  if (chmod(options.socket_path.c_str(), 0600) != 0 || listen(fd, 64) != 0) {
    absl::Status s = Errno(absl::StrCat("--shm-socket: chmod/listen ", options.socket_path));
    close(fd);
    unlink(options.socket_path.c_str());
    return s;
  }
  const int wake = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake < 0) {
    absl::Status s = Errno("--shm-socket: eventfd");
    close(fd);
    unlink(options.socket_path.c_str());
    return s;
  }
  return std::unique_ptr<ShmRegions>(new ShmRegions(std::move(options), fd, wake));
}

namespace {
std::shared_ptr<TenantLedger> LedgerFor(const ShmOptions& o) {
  if (o.ledger != nullptr) return o.ledger;
  std::shared_ptr<TenantLedger> own = TenantLedger::Create();
  own->SetCap(Resource::kShmRegions, o.max_regions);
  own->SetCap(Resource::kShmRegionBytes, o.max_total_bytes);
  return own;
}
}  // namespace

ShmRegions::ShmRegions(ShmOptions options, int listen_fd, int wake_fd)
    : options_(std::move(options)),
      ledger_(LedgerFor(options_)),
      listen_fd_(listen_fd),
      wake_fd_(wake_fd),
      listener_([this] { Loop(); }) {}

ShmRegions::~ShmRegions() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof(one));
  listener_.join();
  std::vector<std::shared_ptr<ShmControlCall>> ending;
  {
    absl::MutexLock lock(&mu_);
    std::vector<int> fds;
    for (const auto& [fd, conn] : conns_) fds.push_back(fd);
    for (int fd : fds) Close(fd);
    close(listen_fd_);
    close(wake_fd_);
    unlink(options_.socket_path.c_str());
    ending.swap(ending_);
    for (auto& c : dispatch_) ending.push_back(std::move(c));
    dispatch_.clear();
  }
  for (const auto& c : ending) {
    c->End();
    c->Reply(absl::UnavailableError("kvbankd stopped serving region transfers"));
  }
}

void ShmRegions::Loop() {
  std::vector<pollfd> polled;
  absl::Time spin_until;  // no sleeping in poll before then (ShmOptions::spin)
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      if (stop_) return;
      polled.clear();
      polled.push_back({wake_fd_, POLLIN, 0});
      // Out of descriptors, accept fails and the listener stays readable: it rests a while.
      polled.push_back(
          {listen_fd_, absl::Now() < accept_paused_until_ ? short{0} : short{POLLIN}, 0});
      for (auto& [fd, conn] : conns_) {
        short events = POLLIN;
        if (conn.link != nullptr) {
          absl::MutexLock link_lock(&conn.link->mu);
          // A connection with its calls in flight at the limit is not read until one is
          // answered (POLLHUP still says when it closes).
          if (conn.link->in_flight >= proto::kShmControlMaxInFlight) events = 0;
        }
        polled.push_back({fd, events, 0});
      }
    }
    // A bounded wait, so that claim timeouts are enforced without a timer per connection;
    // none while the spin after a round of small transfers lasts.
    const bool spinning = spin_until > absl::Time() && absl::Now() < spin_until;
    const int n = poll(polled.data(), polled.size(), spinning ? 0 : 200);
    HandleEvents(polled, n);
    if (Dispatch()) {
      spin_until = absl::Now() + options_.spin;
    } else if (n != 0) {
      spin_until = absl::Time();  // other work (a hello, a close, a copy handed over)
    } else if (spinning) {
      sched_yield();  // a client on this CPU goes first: its next frame is what is awaited
    }
  }
}

void ShmRegions::HandleEvents(const std::vector<pollfd>& polled, int n) {
  absl::MutexLock lock(&mu_);
  if (stop_) return;
  if (n > 0 && polled[0].revents != 0) {
    uint64_t woken;
    (void)!read(wake_fd_, &woken, sizeof(woken));
    // A reply made room on a connection at its limit: frames it sent meanwhile are taken now.
    std::vector<int> buffered;
    for (const auto& [fd, conn] : conns_) {
      if (conn.link != nullptr && !conn.in.empty()) buffered.push_back(fd);
    }
    for (int fd : buffered) TakeFrames(fd);
  }
  if (n > 0) {
    // Connections before new ones: an Unregister may have closed one meanwhile, and its
    // descriptor number must not be taken for a new connection's while these events are read.
    for (size_t i = 2; i < polled.size(); ++i) {
      const pollfd& p = polled[i];
      if (p.revents == 0) continue;
      auto it = conns_.find(p.fd);
      if (it == conns_.end()) continue;  // closed meanwhile
      if (it->second.state == Conn::State::kHello && (p.revents & POLLIN)) {
        ReceiveHello(p.fd);
      } else {
        ReadAfterHello(p.fd);
      }
    }
    if (polled[1].revents != 0) Accept();
  }
  Expire(absl::Now());
}

bool ShmRegions::Dispatch() {
  std::vector<std::shared_ptr<ShmControlCall>> calls, ending;
  {
    absl::MutexLock lock(&mu_);
    calls.swap(dispatch_);
    ending.swap(ending_);
  }
  for (const auto& c : ending) c->End();
  if (calls.empty()) return false;
  absl::ReaderMutexLock lock(&handler_mu_);
  for (auto& c : calls) {
    c->alone_in_round_ = calls.size() == 1;
    if (handler_ == nullptr) {
      c->Reply(absl::UnavailableError("kvbankd is not serving region transfers (stopping)"));
    } else {
      handler_(c);
    }
  }
  return std::all_of(calls.begin(), calls.end(), [](const auto& c) { return c->replied(); });
}

void ShmRegions::SetControlHandler(ControlHandler handler) {
  absl::MutexLock lock(&handler_mu_);
  handler_ = std::move(handler);
}

void ShmRegions::EndControlCalls() {
  std::vector<std::shared_ptr<ShmControlCall>> calls;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [fd, conn] : conns_) {
      if (conn.link == nullptr) continue;
      absl::MutexLock link_lock(&conn.link->mu);
      for (const auto& [serial, weak] : conn.link->calls) {
        if (auto c = weak.lock()) calls.push_back(std::move(c));
      }
    }
    for (auto& c : dispatch_) calls.push_back(c);
  }
  for (const auto& c : calls) c->End();
}

void ShmRegions::Accept() {
  for (;;) {
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR && errno != ECONNABORTED) {
        accept_paused_until_ = absl::Now() + absl::Milliseconds(100);
      }
      return;
    }
    if (conns_.size() >= options_.max_regions) {
      SendReply(fd, static_cast<uint32_t>(absl::StatusCode::kResourceExhausted),
                absl::StrCat("kvbankd holds ", options_.max_regions,
                             " shared-memory regions and connections already (--shm-max-regions)"),
                "", 0);
      close(fd);
      continue;
    }
    conns_[fd].opened = absl::Now();
  }
}

void ShmRegions::ReceiveHello(int fd) {
  proto::ShmHello hello{};
  // Room for more than one descriptor, so that extra ones are received (and closed), not left
  // to MSG_CTRUNC.
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 8)];
  iovec iov{&hello, sizeof(hello)};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  const ssize_t got = recvmsg(fd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  if (got < 0 && (errno == EAGAIN || errno == EINTR)) return;
  std::vector<int> fds;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < n; ++i) {
      int received;
      std::memcpy(&received, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      fds.push_back(received);
    }
  }
  auto close_fds = [&fds] {
    for (int f : fds) close(f);
  };
  const bool hello_ok = got == static_cast<ssize_t>(sizeof(hello)) &&
                        std::memcmp(hello.magic, proto::kShmMagic, sizeof(hello.magic)) == 0 &&
                        (msg.msg_flags & MSG_CTRUNC) == 0;
  if (!hello_ok || fds.size() != 1) {
    // Garbage, EOF or not exactly one descriptor: nothing was registered; the peer is closed.
    if (hello_ok) {
      SendReply(fd, static_cast<uint32_t>(absl::StatusCode::kInvalidArgument),
                "shm hello must carry exactly one descriptor (SCM_RIGHTS)", "", 0);
    }
    close_fds();
    return Close(fd);
  }
  auto mapping = ShmMapping::Map(fds[0], options_.max_region_bytes);
  close_fds();  // the mapping keeps the memory
  if (!mapping.ok()) {
    SendReply(fd, static_cast<uint32_t>(mapping.status().code()), mapping.status().message(), "",
              0);
    return Close(fd);
  }
  std::string handle(proto::kShmHandleBytes, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(handle.data()), handle.size()) != 1) {
    SendReply(fd, static_cast<uint32_t>(absl::StatusCode::kInternal),
              "no random bytes for a region handle", "", 0);
    return Close(fd);
  }
  Conn& conn = conns_[fd];
  conn.state = Conn::State::kPending;
  conn.opened = absl::Now();  // the claim timeout runs from the answer
  conn.handle = handle;
  pending_[handle] = Pending{*mapping, fd};
  SendReply(fd, 0, "", handle, (*mapping)->size());
}

void ShmRegions::ReadAfterHello(int fd) {
  Conn& conn = conns_[fd];
  char buf[64 << 10];
  for (;;) {
    const ssize_t got = recv(fd, buf, conn.link != nullptr ? sizeof(buf) : 64, MSG_DONTWAIT);
    if (got < 0 && (errno == EAGAIN || errno == EINTR)) break;
    // got == 0: the client closed its end (exit, crash); got < 0: the connection broke; got > 0
    // before the region is claimed: more than the protocol has. The region goes in each case.
    if (got <= 0 || conn.link == nullptr) return Close(fd);
    conn.in.append(buf, size_t(got));
    // Enough for now: the frames taken so far go out before more is read.
    if (size_t(got) < sizeof(buf) ||
        conn.in.size() > sizeof(proto::ShmControlHeader) + proto::kShmControlMaxBody) {
      break;
    }
  }
  TakeFrames(fd);
}

void ShmRegions::TakeFrames(int fd) {
  Conn& conn = conns_[fd];
  constexpr size_t kHeader = sizeof(proto::ShmControlHeader);
  size_t used = 0;
  for (;;) {
    const absl::Span<const uint8_t> rest(reinterpret_cast<const uint8_t*>(conn.in.data()) + used,
                                         conn.in.size() - used);
    if (rest.size() < kHeader) break;
    {
      absl::MutexLock link_lock(&conn.link->mu);
      if (conn.link->in_flight >= proto::kShmControlMaxInFlight) break;
    }
    auto header = proto::DecodeShmControlHeader(rest, /*reply=*/false);
    absl::StatusOr<proto::ShmControlRequest> request =
        header.ok() ? absl::StatusOr<proto::ShmControlRequest>() : header.status();
    if (header.ok()) {
      if (rest.size() < kHeader + header->body_bytes) break;  // the rest is still coming
      request = proto::DecodeShmControlRequest(rest.subspan(0, kHeader + header->body_bytes));
    }
    if (!request.ok()) {
      // A frame that does not decode ends the connection, answered with why (by its request id,
      // whatever its other fields say).
      proto::ShmControlHeader raw;
      std::memcpy(&raw, rest.data(), kHeader);
      const uint16_t op = raw.op & ~proto::kShmControlReply;
      proto::ShmControlReplyFrame reply;
      reply.request_id = raw.request_id;
      reply.op =
          op >= 1 && op <= 3 ? static_cast<proto::ShmControlOp>(op) : proto::ShmControlOp::kAppend;
      reply.status = request.status();
      const std::vector<uint8_t> bytes = proto::EncodeShmControlReply(reply);
      (void)send(fd, bytes.data(), bytes.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
      return Close(fd);
    }
    used += kHeader + header->body_bytes;
    const uint64_t serial = next_call_++;
    auto call = std::make_shared<ShmControlCall>(regions_[conn.region_id].tenant,
                                                 *std::move(request), conn.link, serial);
    {
      absl::MutexLock link_lock(&conn.link->mu);
      ++conn.link->in_flight;
      conn.link->calls[serial] = call;
    }
    dispatch_.push_back(std::move(call));
  }
  conn.in.erase(0, used);
}

void ShmRegions::Close(int fd) {
  auto it = conns_.find(fd);
  if (it == conns_.end()) return;
  if (it->second.state == Conn::State::kPending) pending_.erase(it->second.handle);
  if (it->second.state == Conn::State::kClaimed) regions_.erase(it->second.region_id);
  if (const std::shared_ptr<ShmControlLink>& link = it->second.link; link != nullptr) {
    // Replies stop here; the calls in flight end (Dispatch runs their ends outside mu_).
    absl::MutexLock link_lock(&link->mu);
    link->fd = -1;
    for (const auto& [serial, weak] : link->calls) {
      if (auto c = weak.lock()) ending_.push_back(std::move(c));
    }
    close(fd);
  } else {
    close(fd);
  }
  conns_.erase(it);
}

void ShmRegions::Expire(absl::Time now) {
  std::vector<int> late;
  for (const auto& [fd, conn] : conns_) {
    if (conn.state != Conn::State::kClaimed && now - conn.opened > options_.claim_timeout) {
      late.push_back(fd);
    }
  }
  for (int fd : late) Close(fd);
}

absl::StatusOr<ShmRegions::Claimed> ShmRegions::Claim(const std::string& tenant,
                                                      absl::string_view handle) {
  if (handle.size() != proto::kShmHandleBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("handle must be ", proto::kShmHandleBytes, " bytes, not ", handle.size()));
  }
  absl::MutexLock lock(&mu_);
  auto it = pending_.find(handle);
  if (it == pending_.end()) {
    return absl::NotFoundError(
        "handle names no shared-memory region waiting to be registered (unknown, claimed "
        "already, or its socket connection closed or timed out)");
  }
  const int fd = it->second.conn;
  const uint64_t size = it->second.mapping->size();
  auto count = ledger_->Acquire(tenant, Resource::kShmRegions);
  absl::StatusOr<LedgerClaim> bytes =
      count.ok() ? ledger_->Acquire(tenant, Resource::kShmRegionBytes, size) : count.status();
  if (!bytes.ok()) {
    Close(fd);  // nothing registered: the client's memfd is let go
    return bytes.status();
  }
  const uint64_t id = next_id_++;
  Claimed claimed{id, size};
  regions_[id] =
      Region{tenant, std::move(it->second.mapping), fd, *std::move(count), *std::move(bytes)};
  pending_.erase(it);
  Conn& conn = conns_[fd];
  conn.state = Conn::State::kClaimed;
  conn.handle.clear();
  conn.region_id = id;
  conn.link = std::make_shared<ShmControlLink>();
  conn.link->wake_fd = wake_fd_;
  absl::MutexLock link_lock(&conn.link->mu);
  conn.link->fd = fd;
  return claimed;
}

absl::Status ShmRegions::Unregister(const std::string& tenant, uint64_t id) {
  absl::MutexLock lock(&mu_);
  auto it = regions_.find(id);
  if (it == regions_.end() || it->second.tenant != tenant) {
    return absl::NotFoundError(absl::StrCat("region_id ", id, " names no region of this tenant"));
  }
  // The listener closes the connection (and drops the region) under this lock; the region is
  // gone for every caller from now on. The listener ends the connection's calls in flight.
  Close(it->second.conn);
  Wake(wake_fd_);
  return absl::OkStatus();
}

absl::StatusOr<RegionBytes> ShmRegions::Resolve(const std::string& tenant, uint64_t id,
                                                uint64_t offset, uint64_t length,
                                                absl::string_view field) const {
  return ResolveSpan(tenant, id, offset, length, field, /*check_allocated=*/true);
}

absl::StatusOr<RegionBytes> ShmRegions::ResolveSpan(const std::string& tenant, uint64_t id,
                                                    uint64_t offset, uint64_t length,
                                                    absl::string_view field,
                                                    bool check_allocated) const {
  if (id == 0) return absl::InvalidArgumentError(absl::StrCat(field, ".region_id is 0 (unset)"));
  std::shared_ptr<ShmMapping> mapping;
  {
    absl::MutexLock lock(&mu_);
    auto it = regions_.find(id);
    if (it == regions_.end() || it->second.tenant != tenant) {
      return absl::NotFoundError(
          absl::StrCat(field, ".region_id ", id, " names no shared-memory region of this tenant"));
    }
    mapping = it->second.mapping;
  }
  // Written so that nothing overflows: offset <= size, then length <= size - offset.
  if (offset > mapping->size() || length > mapping->size() - offset) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": offset ", offset, " + length ", length,
                                                   " runs past the region's ", mapping->size(),
                                                   " bytes"));
  }
  absl::Status s = mapping->CheckIntact();
  if (s.ok() && check_allocated) s = mapping->CheckAllocated(offset, length);
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat(field, ": ", s.message()));
  RegionBytes out;
  out.bytes = absl::MakeSpan(mapping->data() + offset, length);
  out.mapping = std::move(mapping);
  return out;
}

absl::StatusOr<RegionRuns> ShmRegions::ResolveRuns(const std::string& tenant, uint64_t id,
                                                   uint64_t offset, uint64_t run_bytes,
                                                   absl::Span<const uint64_t> run_offsets,
                                                   absl::string_view field) const {
  if (run_offsets.empty() || run_offsets.size() > kMaxRegionRuns) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".run_offsets: ", run_offsets.size(),
                                                   " runs (1 .. ", kMaxRegionRuns, ")"));
  }
  if (run_bytes == 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".run_bytes is 0 with run_offsets set"));
  }
  std::vector<uint64_t> sorted(run_offsets.begin(), run_offsets.end());
  std::sort(sorted.begin(), sorted.end());
  const uint64_t max = std::numeric_limits<uint64_t>::max();
  if (sorted.back() > max - run_bytes || offset > max - (sorted.back() + run_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": offset ", offset, " + run offset ",
                                                   sorted.back(), " + run_bytes ", run_bytes,
                                                   " overflows"));
  }
  for (size_t i = 1; i < sorted.size(); ++i) {
    if (sorted[i] - sorted[i - 1] < run_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": runs at ", sorted[i - 1], " and ",
                                                     sorted[i], " of ", run_bytes,
                                                     " bytes overlap"));
    }
  }
  // One check for the span the runs lie in (bounds, tenancy, the file whole) ...
  auto span = ResolveSpan(tenant, id, offset + sorted.front(),
                          sorted.back() + run_bytes - sorted.front(), field,
                          /*check_allocated=*/false);
  if (!span.ok()) return span.status();
  // ... and its pages where the runs are, runs less than kRunCheckGap apart checked as one
  // extent. NOTE: not the whole span: an engine's runs (each layer's K and V of its pages) can
  // lie across all of a large host pool, and mincore over pages kvbankd never mapped looks
  // each up in the page cache (a fifth of a 64 MiB fetch's time, measured, when the span was
  // four times the runs' bytes).
  const ShmMapping& mapping = *span->mapping;
  uint64_t begin = sorted.front(), end = sorted.front() + run_bytes;
  for (size_t i = 1; i <= sorted.size(); ++i) {
    if (i < sorted.size() && sorted[i] - end <= kRunCheckGap) {
      end = sorted[i] + run_bytes;
      continue;
    }
    if (absl::Status s = mapping.CheckAllocated(offset + begin, end - begin); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat(field, ": ", s.message()));
    }
    if (i < sorted.size()) begin = sorted[i], end = sorted[i] + run_bytes;
  }
  RegionRuns out;
  uint8_t* const base = span->bytes.data() - sorted.front();
  for (uint64_t r : run_offsets) out.Add(absl::MakeSpan(base + r, run_bytes));
  out.mapping = std::move(span->mapping);
  return out;
}

size_t ShmRegions::num_regions() const {
  absl::MutexLock lock(&mu_);
  return regions_.size();
}
size_t ShmRegions::num_pending() const {
  absl::MutexLock lock(&mu_);
  return pending_.size();
}
size_t ShmRegions::num_connections() const {
  absl::MutexLock lock(&mu_);
  return conns_.size();
}

}  // namespace kvbank::plane
