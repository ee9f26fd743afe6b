// Logs every kvbank.v1.KvBank call that ends in an error: one record with the method, the
// caller's tenant, the status code and its message (never payload bytes or token ids). At most
// `max_per_second` records a second; the ones over that are counted and the count is logged
// with the next record that goes out, so a client hammering a bad call cannot flood the log.
#ifndef KVBANK_SERVER_RPC_REQUEST_LOG_H_
#define KVBANK_SERVER_RPC_REQUEST_LOG_H_

#include <atomic>
#include <cstdint>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/support/server_interceptor.h"
#include "server/rpc/auth.h"

namespace kvbank::rpc {

// Thread-safe. `auth` must outlive the factory (and the server it is given to).
class RequestLog final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  RequestLog(const Authenticator* auth, uint32_t max_per_second)
      : auth_(auth), max_per_second_(max_per_second) {}

  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override;

  // Logs a call refused before it reached the interceptors (its token checked as its metadata
  // arrived): no tenant. Same rate limit.
  void Refused(absl::string_view method, const grpc::Status& status);
  // Records written and records dropped by the rate limit, so far.
  uint64_t logged() const { return logged_.load(std::memory_order_relaxed); }
  uint64_t suppressed_total() const { return suppressed_total_.load(std::memory_order_relaxed); }

 private:
  class Interceptor;
  // Logs the failed call unless the second's budget is spent.
  void Failed(grpc::experimental::ServerRpcInfo& info, const grpc::Status& status);
  void Log(absl::string_view method, const std::string& tenant, const grpc::Status& status);
  // Takes a record from the second's budget; false when it is spent (counted). *suppressed:
  // the records dropped since the last one that went out.
  bool Admit(uint64_t* suppressed);

  const Authenticator* const auth_;
  const uint32_t max_per_second_;
  absl::Mutex mu_;
  absl::Time window_start_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  uint32_t in_window_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t suppressed_ ABSL_GUARDED_BY(mu_) = 0;  // since the last record that went out
  std::atomic<uint64_t> logged_{0};
  std::atomic<uint64_t> suppressed_total_{0};
};

}  // namespace kvbank::rpc

#endif  // KVBANK_SERVER_RPC_REQUEST_LOG_H_
