// kvbankd's Prometheus metrics: the families (README "Metrics"), the gRPC interceptor that counts
// the calls, and /metrics on a port of its own. Everything but the RPC figures is read when
// /metrics is scraped: the models' and tenants' figures through the same SequenceStore::Stats and
// ModelStats conversion GetStats answers with (as an admin sees them), the data planes' byte
// counters of the service, and the listener's connection counts.
#ifndef KVBANK_SERVER_KVBANKD_KVBANKD_METRICS_H_
#define KVBANK_SERVER_KVBANKD_KVBANKD_METRICS_H_

#include <atomic>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/support/server_interceptor.h"
#include "server/core/model_registry.h"
#include "server/metrics/http_server.h"
#include "server/metrics/registry.h"
#include "server/metrics/rpc_interceptor.h"
#include "server/rpc/listener.h"
#include "server/rpc/service.h"

namespace kvbank::metrics {

struct KvbankdMetricsOptions {
  std::string listen;     // "host:port" of /metrics; port 0 picks one
  std::string port_file;  // when set: the port bound is written there (tmp file, then rename)
  std::string version;    // kvbank_build_info's label; empty: this build's project version
};

// Thread-safe after Start. Must outlive the gRPC server it counts for (the interceptor's rows
// live in its registry) and be destroyed before `models` and `service`' owners are.
class KvbankdMetrics {
 public:
  // Registers every family, makes the interceptor and starts serving /metrics (and writes the
  // port file). `models` and `service` must outlive this. Errors: HttpServer::Start's, INTERNAL
  // for a port file that cannot be written.
  static absl::StatusOr<std::unique_ptr<KvbankdMetrics>> Start(
      KvbankdMetricsOptions options, std::shared_ptr<const ModelRegistry> models,
      const rpc::KvBankService* service);

  // The interceptor for ServingOptions::interceptors; the first call hands it over, later ones
  // return null.
  std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> TakeInterceptor();
  // Counts a call refused as its metadata arrived (RpcMetrics::CountRefused). Thread-safe.
  void CountRefused(absl::string_view method_path, int code) {
    if (rpc_metrics_ != nullptr) rpc_metrics_->CountRefused(method_path, code);
  }
  // From now on kvbank_connections* read `listener` (which must outlive this); 0 before.
  void WatchListener(const rpc::Listener* listener);

  int port() const { return http_->port(); }
  const std::string& url() const { return http_->url(); }
  const Registry& registry() const { return registry_; }

 private:
  KvbankdMetrics() = default;
  void CollectModels(std::vector<FamilySnapshot>* out) const;
  void CollectServer(std::vector<FamilySnapshot>* out) const;

  KvbankdMetricsOptions options_;
  std::shared_ptr<const ModelRegistry> models_;
  const rpc::KvBankService* service_ = nullptr;
  std::atomic<const rpc::Listener*> listener_{nullptr};
  Registry registry_;
  std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> interceptor_;
  RpcMetrics* rpc_metrics_ = nullptr;  // interceptor_, still alive once gRPC owns it
  std::unique_ptr<HttpServer> http_;   // last: stops serving before the rest goes
};

}  // namespace kvbank::metrics

#endif  // KVBANK_SERVER_KVBANKD_KVBANKD_METRICS_H_
