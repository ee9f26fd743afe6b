#include "server/rpc/drain.h"

#include <dirent.h>
#include <linux/sockios.h>
#include <netinet/in.h>
#include <sys/ioctl.h>
#include <sys/socket.h>

#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"

namespace kvbank::rpc {

class CallCounter::Tracker final : public grpc::experimental::Interceptor {
 public:
  explicit Tracker(std::atomic<uint64_t>* count) : count_(count) {
    count_->fetch_add(1, std::memory_order_acq_rel);
  }
  ~Tracker() override { count_->fetch_sub(1, std::memory_order_acq_rel); }

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    methods->Proceed();
  }

 private:
  std::atomic<uint64_t>* const count_;
};

grpc::experimental::Interceptor* CallCounter::CreateServerInterceptor(
    grpc::experimental::ServerRpcInfo* info) {
  if (!absl::StartsWith(info->method(), "/kvbank.v1.KvBank/")) return nullptr;
  return new Tracker(&in_flight_);
}

uint64_t UnackedBytesOnPort(int port) {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return 0;
  uint64_t total = 0;
  while (const dirent* e = readdir(dir)) {
    int fd = -1;
    if (!absl::SimpleAtoi(e->d_name, &fd) || fd == dirfd(dir)) continue;
    // The descriptor may be closed (and reused) under us by gRPC's threads; every call below
    // only reads, and a wrong answer for one poll is corrected by the next.
    sockaddr_storage addr;
    std::memset(&addr, 0, sizeof(addr));
    socklen_t len = sizeof(addr);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) continue;
    int local_port = -1;
    if (addr.ss_family == AF_INET) {
      local_port = ntohs(reinterpret_cast<const sockaddr_in*>(&addr)->sin_port);
    } else if (addr.ss_family == AF_INET6) {
      local_port = ntohs(reinterpret_cast<const sockaddr_in6*>(&addr)->sin6_port);
    }
    int queued = 0;  // the listening socket has no queue: ioctl fails with EINVAL
    if (local_port == port && ioctl(fd, SIOCOUTQ, &queued) == 0 && queued > 0) total += queued;
  }
  closedir(dir);
  return total;
}

}  // namespace kvbank::rpc
