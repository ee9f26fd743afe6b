// A gRPC server for kvbank.v1.KvBank as kvbankd runs it: on kvbankd's own listener (listener.h),
// with the message-size limits, a bound on gRPC's memory, idle-connection and keepalive settings,
// health (answering for "" and kvbank.v1.KvBank) and reflection. kvbankd and the benchmarks that
// serve in-process start it the same way, so a benchmark measures what kvbankd does.
#ifndef KVBANK_SERVER_RPC_SERVING_H_
#define KVBANK_SERVER_RPC_SERVING_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/support/server_interceptor.h"
#include "server/rpc/listener.h"

namespace kvbank::rpc {

struct ServingOptions {
  std::string listen = "127.0.0.1:0";  // port 0: the system picks one (Serving::port)
  std::shared_ptr<grpc::ServerCredentials> credentials;  // null: plaintext
  // Most connections open at once; 0: the descriptor limit less a reserve.
  uint64_t max_connections = 0;
  // gRPC's memory for connections and messages in flight (its ResourceQuota).
  uint64_t grpc_memory_bytes = uint64_t{256} << 20;
  // Zero: off.
  absl::Duration max_connection_idle = absl::Minutes(10);
  absl::Duration keepalive_time = absl::Seconds(60);
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  // When set, a second, plaintext gRPC server on this address serves grpc.health.v1 only (no
  // reflection), with the same statuses as the main one: kubelet's native gRPC probes cannot
  // speak TLS or send tokens. It has its own listener (a few connections, the oldest closed to
  // make room for a new one; it survives running out of descriptors like the main one) and its
  // own short handshake, idle and age limits, so a probe gets through within a probe period
  // however many connections others hold open.
  std::string health_listen;
  // Extra channel arguments (benchmark experiments).
  std::vector<std::pair<std::string, int>> channel_args;
};

// How far a stream being read may run ahead of kvbankd (GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES;
// gRPC's BDP probe is off, serving.cc). On loopback appends move as fast as with the probe's
// windows (transfer_bench --grpc-bdp-probe 0|1), and 8 MiB in flight covers 100 Gb/s at 0.6 ms
// round trips.
inline constexpr int kStreamWindowBytes = 8 << 20;

// Descriptors kept out of the connection cap: pools, logs, gRPC's own pipes and epoll.
inline constexpr uint64_t kReservedDescriptors = 64;

// Not thread-safe: one owner starts and stops it. Health and the server may be used from any
// thread.
class Serving {
 public:
  // Raises the descriptor limit, binds the listener (FAILED_PRECONDITION naming a port in use),
  // builds and starts the server with `service` (which must outlive this) and starts accepting.
  static absl::StatusOr<std::unique_ptr<Serving>> Start(grpc::Service* service,
                                                        ServingOptions options);
  ~Serving();  // Stop()s

  int port() const { return listener_->port(); }
  // The health-only server's port; 0 without ServingOptions::health_listen.
  int health_port() const { return health_listener_ != nullptr ? health_listener_->port() : 0; }
  uint64_t max_connections() const { return max_connections_; }
  uint64_t descriptor_limit() const { return descriptor_limit_; }
  grpc::Server* server() const { return server_.get(); }
  const Listener& listener() const { return *listener_; }
  // Health of "" and of kvbank.v1.KvBank, on the main server and the health-only one. No effect
  // once the health service is shut down.
  void SetServing(bool serving);
  // The drain: health answers NOT_SERVING from now on, for good.
  void ShutdownHealth();
  // Stops accepting and closes every connection, gracefully until `close_by`: each connection
  // gets a GOAWAY and a PING and is closed once its client answers the PING, which it reads only
  // after every byte sent before it, so a client still reading the end of an answer is not reset.
  // At `close_by` what is left is cancelled and closed. Waits for the server's threads.
  // Idempotent.
  void Stop(absl::Time close_by = absl::InfinitePast());

 private:
  Serving() = default;
  std::unique_ptr<Listener> listener_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<Listener> health_listener_;  // with health_server_, or both null
  std::unique_ptr<grpc::CallbackGenericService> health_generic_;  // outlives health_server_
  std::unique_ptr<grpc::Server> health_server_;
  uint64_t max_connections_ = 0;
  uint64_t descriptor_limit_ = 0;
  bool stopped_ = false;
};

}  // namespace kvbank::rpc

#endif  // KVBANK_SERVER_RPC_SERVING_H_
