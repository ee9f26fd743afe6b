#include "server/metrics/rpc_interceptor.h"

#include <chrono>

#include "absl/strings/str_cat.h"

namespace kvbank::metrics {

std::vector<double> RpcDurationBuckets() {
  return {50e-6,  100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3,
          100e-3, 250e-3, 500e-3, 1,      2.5,  5,      10,   30,    60};
}

const char* StatusCodeName(int code) {
  // grpc::StatusCode's values in order, as gRPC names them.
  static constexpr const char* kNames[] = {"OK",
                                           "CANCELLED",
                                           "UNKNOWN",
                                           "INVALID_ARGUMENT",
                                           "DEADLINE_EXCEEDED",
                                           "NOT_FOUND",
                                           "ALREADY_EXISTS",
                                           "PERMISSION_DENIED",
                                           "RESOURCE_EXHAUSTED",
                                           "FAILED_PRECONDITION",
                                           "ABORTED",
                                           "OUT_OF_RANGE",
                                           "UNIMPLEMENTED",
                                           "INTERNAL",
                                           "UNAVAILABLE",
                                           "DATA_LOSS",
                                           "UNAUTHENTICATED"};
  if (code < 0 || code >= int(sizeof(kNames) / sizeof(kNames[0]))) return "UNKNOWN";
  return kNames[code];
}

// One call: in flight from construction (gRPC makes it as the call starts) to destruction (after
// its status is written); its duration and code are taken when the status is sent.
class RpcMetrics::Tracker final : public grpc::experimental::Interceptor {
 public:
  Tracker(RpcMetrics* owner, Method* m)
      : owner_(owner), method_(m), start_(std::chrono::steady_clock::now()) {
    method_->in_flight->Add(1);
  }
  ~Tracker() override {
    // A call that ends without a status of its own (its client went away first).
    if (!recorded_.load(std::memory_order_acquire)) Record(grpc::StatusCode::CANCELLED);
    method_->in_flight->Add(-1);
  }

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    // A streaming call's send and receive batches may be intercepted on two threads at once;
    // the status is sent once, so only that batch records.
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS) &&
        !recorded_.exchange(true, std::memory_order_acq_rel)) {
      Record(methods->GetSendStatus().error_code());
    }
    methods->Proceed();
  }

 private:
  void Record(int code) {
    const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start_;
    method_->duration->Observe(took.count());
    owner_->CodeCounter(method_, code)->Inc();
  }

  RpcMetrics* const owner_;
  Method* const method_;
  const std::chrono::steady_clock::time_point start_;
  std::atomic<bool> recorded_{false};
};

absl::StatusOr<std::unique_ptr<RpcMetrics>> RpcMetrics::Create(
    Registry* registry, const std::string& prefix, const std::string& service,
    const std::vector<std::string>& methods) {
  std::unique_ptr<RpcMetrics> r(new RpcMetrics());
  auto duration =
      registry->AddHistogram(prefix + "_rpc_duration_seconds",
                             absl::StrCat("Time from the start of a ", service,
                                          " call to its status being sent, in seconds, by method."),
                             {"method"}, RpcDurationBuckets());
  if (!duration.ok()) return duration.status();
  auto total = registry->AddCounter(
      prefix + "_rpc_total",
      absl::StrCat(service, " calls answered, by method and gRPC status code (CANCELLED also for ",
                   "calls whose client went away before an answer)."),
      {"method", "code"});
  if (!total.ok()) return total.status();
  auto in_flight = registry->AddGauge(
      prefix + "_rpc_in_flight", absl::StrCat(service, " calls in flight, by method."), {"method"});
  if (!in_flight.ok()) return in_flight.status();
  r->total_ = *total;
  for (const std::string& name : methods) {
    auto m = std::make_unique<Method>();
    m->name = name;
    auto d = (*duration)->WithLabels({name});
    auto g = (*in_flight)->WithLabels({name});
    if (!d.ok()) return d.status();
    if (!g.ok()) return g.status();
    m->duration = *d;
    m->in_flight = *g;
    r->CodeCounter(m.get(), grpc::StatusCode::OK);  // the OK row exists from the start
    r->methods_[absl::StrCat("/", service, "/", name)] = std::move(m);
  }
  return r;
}

Counter* RpcMetrics::CodeCounter(Method* m, int code) {
  if (code < 0 || code >= kNumCodes) code = grpc::StatusCode::UNKNOWN;
  Counter* c = m->by_code[code].load(std::memory_order_acquire);
  if (c != nullptr) return c;
  // Two threads may get here at once: WithLabels hands both the same child.
  c = *total_->WithLabels({m->name, StatusCodeName(code)});
  m->by_code[code].store(c, std::memory_order_release);
  return c;
}

void RpcMetrics::CountRefused(absl::string_view method_path, int code) {
  auto it = methods_.find(method_path);
  if (it == methods_.end()) return;
  CodeCounter(it->second.get(), code)->Inc();
}

grpc::experimental::Interceptor* RpcMetrics::CreateServerInterceptor(
    grpc::experimental::ServerRpcInfo* info) {
  auto it = methods_.find(absl::string_view(info->method()));
  if (it == methods_.end()) return nullptr;
  return new Tracker(this, it->second.get());
}

}  // namespace kvbank::metrics
