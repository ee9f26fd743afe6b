// A gRPC server interceptor that counts the calls of one service into a metrics Registry:
//   <prefix>_rpc_duration_seconds{method}  histogram, from the call's start to its status
//   <prefix>_rpc_total{method,code}         counter, code as gRPC's name (OK, NOT_FOUND, ...)
//   <prefix>_rpc_in_flight{method}          gauge, from the call's start until gRPC drops it
// Methods are known up front (their rows exist from the start, at 0), so a call looks its
// metrics up in a map that never changes, and the hot path is a few relaxed atomics on this
// thread's shard (registry.h); no lock is shared between calls. A status code's counter is made
// the first time that code is seen for that method.
#ifndef KVBANK_SERVER_METRICS_RPC_INTERCEPTOR_H_
#define KVBANK_SERVER_METRICS_RPC_INTERCEPTOR_H_

#include <array>
#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "grpcpp/support/server_interceptor.h"
#include "server/metrics/registry.h"

namespace kvbank::metrics {

// Latency buckets for calls between 50 us (a cached lookup) and 60 s (a long fetch wait).
std::vector<double> RpcDurationBuckets();
// gRPC's name of a status code ("OK", "NOT_FOUND", ...); "UNKNOWN" for a code out of range.
const char* StatusCodeName(int code);

// Thread-safe. gRPC owns it once it is in ServingOptions::interceptors; the registry must
// outlive it and every call it counts.
class RpcMetrics final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  // Registers the three families as `prefix`_... in `registry` and the rows of `methods` (short
  // names, e.g. "Fetch") of `service` (its full name, e.g. "kvbank.v1.KvBank"). Calls of other
  // services or methods are not counted. Errors as Registry::Add*.
  static absl::StatusOr<std::unique_ptr<RpcMetrics>> Create(
      Registry* registry, const std::string& prefix, const std::string& service,
      const std::vector<std::string>& methods);

  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override;
  // Counts a call refused before it reached the interceptors (its token checked as its metadata
  // arrived) under `code` in <prefix>_rpc_total. `method_path`: "/kvbank.v1.KvBank/Fetch"; other
  // paths are not counted.
  void CountRefused(absl::string_view method_path, int code);

 private:
  static constexpr int kNumCodes = 17;  // grpc::StatusCode OK .. UNAUTHENTICATED
  struct Method {
    std::string name;
    Histogram* duration = nullptr;
    Gauge* in_flight = nullptr;
    std::array<std::atomic<Counter*>, kNumCodes> by_code{};
  };
  class Tracker;

  RpcMetrics() = default;
  // The counter of `code` for `m`, made on first use.
  Counter* CodeCounter(Method* m, int code);

  Family<Counter>* total_ = nullptr;
  // By full method path ("/kvbank.v1.KvBank/Fetch"); filled by Create, read-only after.
  absl::flat_hash_map<std::string, std::unique_ptr<Method>> methods_;
};

}  // namespace kvbank::metrics

#endif  // KVBANK_SERVER_METRICS_RPC_INTERCEPTOR_H_
