#include "server/rpc/request_log.h"

#include <string>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "server/metrics/rpc_interceptor.h"

namespace kvbank::rpc {

class RequestLog::Interceptor final : public grpc::experimental::Interceptor {
 public:
  Interceptor(RequestLog* log, grpc::experimental::ServerRpcInfo* info) : log_(log), info_(info) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      const grpc::Status status = methods->GetSendStatus();
      if (!status.ok()) log_->Failed(*info_, status);
    }
    methods->Proceed();
  }

 private:
  RequestLog* const log_;
  grpc::experimental::ServerRpcInfo* const info_;
};

grpc::experimental::Interceptor* RequestLog::CreateServerInterceptor(
    grpc::experimental::ServerRpcInfo* info) {
  if (!absl::StartsWith(info->method(), "/kvbank.v1.KvBank/")) return nullptr;
  return new Interceptor(this, info);
}

bool RequestLog::Admit(uint64_t* suppressed) {
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  if (now - window_start_ >= absl::Seconds(1)) {
    window_start_ = now;
    in_window_ = 0;
  }
  if (in_window_ >= max_per_second_) {
    ++suppressed_;
    suppressed_total_.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  ++in_window_;
  *suppressed = suppressed_;
  suppressed_ = 0;
  return true;
}

void RequestLog::Failed(grpc::experimental::ServerRpcInfo& info, const grpc::Status& status) {
  // The tenant is looked up again only for calls that failed; a call refused for its token has
  // none.
  std::string tenant;
  if (auth_ != nullptr && info.server_context() != nullptr) {
    if (auto caller = auth_->Authenticate(*info.server_context()); caller.ok()) {
      tenant = caller->tenant;
    }
  }
  Log(info.method(), tenant, status);
}

void RequestLog::Refused(absl::string_view method, const grpc::Status& status) {
  if (!absl::StartsWith(method, "/kvbank.v1.KvBank/")) return;
  Log(method, "", status);
}

void RequestLog::Log(absl::string_view method_view, const std::string& tenant,
                     const grpc::Status& status) {
  uint64_t suppressed = 0;
  if (!Admit(&suppressed)) return;
  const std::string method(method_view);
  const char* code = metrics::StatusCodeName(int(status.error_code()));
  auto record = log::Warn("rpc_error");
  record.Field("method", method).Field("tenant", tenant).Field("code", code);
  if (suppressed > 0) record.Field("suppressed", suppressed);
  record << method << " failed " << code << " (tenant '" << tenant
         << "'): " << status.error_message();
  if (suppressed > 0) record << " [" << suppressed << " more error(s) not logged]";
  logged_.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace kvbank::rpc
