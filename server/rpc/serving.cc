#include "server/rpc/serving.h"

#include <algorithm>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/impl/server_builder_option.h"
#include "grpcpp/resource_quota.h"
#include "kvbank/v1/kvbank.grpc.pb.h"
#include "server/rpc/service.h"

namespace kvbank::rpc {
namespace {

// Connections the health-only server keeps open at once: kubelet probes and an operator's
// grpc_health_probe need a handful. Past it the oldest is closed (OverCap::kCloseOldest), so a
// probe always gets a connection however many others are held open.
constexpr uint64_t kHealthConnections = 64;
// A health connection's life, well inside a probe period (kubelet's default is 10 s): one that
// sends no HTTP/2 settings within the handshake timeout, stays idle, or just lives long, is
// closed, so none holds a slot for long.
constexpr int kHealthHandshakeMs = 2000;
constexpr int kHealthIdleMs = 3000;
constexpr int kHealthMaxAgeMs = 10000;
constexpr int kHealthMaxAgeGraceMs = 1000;
// A health request is a service name.
constexpr int kHealthMaxMessageBytes = 4096;

// Drops every server plugin from a builder (reflection among them): the health-only server
// serves grpc.health.v1 and nothing else.
class NoPlugins final : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments*) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    plugins->clear();
  }
};

}  // namespace

absl::StatusOr<std::unique_ptr<Serving>> Serving::Start(grpc::Service* service,
                                                        ServingOptions options) {
  std::unique_ptr<Serving> s(new Serving());
  // gRPC 1.51 stops accepting for good after one EMFILE, so take every descriptor the process may
  // have and cap connections well below the limit (listener.h).
  s->descriptor_limit_ = RaiseDescriptorLimit();
  s->max_connections_ = options.max_connections;
  if (s->max_connections_ == 0) {
    if (s->descriptor_limit_ <= 2 * kReservedDescriptors) {
      return absl::FailedPreconditionError(
          absl::StrCat("the descriptor limit (", s->descriptor_limit_, ") is too low: raise it"));
    }
    s->max_connections_ = s->descriptor_limit_ - kReservedDescriptors;
  } else if (s->max_connections_ + kReservedDescriptors > s->descriptor_limit_) {
    std::cerr << "kvbankd: warning: --max-connections " << s->max_connections_ << " needs "
              << s->max_connections_ + kReservedDescriptors << " descriptors and the limit is "
              << s->descriptor_limit_
              << ": past it, new connections are closed at once until descriptors are free"
              << std::endl;
  }
  auto listener = Listener::Bind(options.listen);
  if (!listener.ok()) return listener.status();
  s->listener_ = *std::move(listener);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  auto credentials =
      options.credentials != nullptr ? options.credentials : grpc::InsecureServerCredentials();
  auto acceptor = builder.experimental().AddExternalConnectionAcceptor(
      grpc::ServerBuilder::experimental_type::ExternalConnectionType::FROM_FD, credentials);
  builder.RegisterService(service);
  if (!options.interceptors.empty()) {
    builder.experimental().SetInterceptorCreators(std::move(options.interceptors));
  }
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  // Under memory pressure gRPC shrinks its flow-control windows, reads less from the sockets
  // and sheds connections: a burst of large messages cannot take the server's memory.
  grpc::ResourceQuota quota("kvbankd");
  quota.Resize(options.grpc_memory_bytes);
  builder.SetResourceQuota(quota);
  // Fixed flow-control windows instead of gRPC's BDP probe, which on loopback grows them past
  // 16 MiB for every stream, read or not: a caller without a token that loops on 100 MiB
  // messages pushed ~19 MB a call into kvbankd's sockets before its refusal (early_auth.h)
  // reached it (3.8 GB/s read and dropped for two such callers, 0.7 of a core). Now a stream
  // not being read holds the 64 KiB initial window (65 KB a refused call, measured), and one
  // being read runs kStreamWindowBytes ahead: appends as fast as with the probe.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, int(kStreamWindowBytes));
  if (options.max_connection_idle > absl::ZeroDuration()) {
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS,
                               int(absl::ToInt64Milliseconds(options.max_connection_idle)));
  }
  if (options.keepalive_time > absl::ZeroDuration()) {
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS,
                               int(absl::ToInt64Milliseconds(options.keepalive_time)));
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 20000);
  }
  for (const auto& [name, value] : options.channel_args) builder.AddChannelArgument(name, value);
  s->server_ = builder.BuildAndStart();
  if (s->server_ == nullptr) {
    return absl::InternalError(absl::StrCat("gRPC could not start serving on ", options.listen));
  }
  s->listener_->Start(std::move(acceptor), s->max_connections_);
  if (!options.health_listen.empty()) {
    auto health_listener = Listener::Bind(options.health_listen);
    if (!health_listener.ok()) {
      return absl::Status(health_listener.status().code(),
                          absl::StrCat("the health address ", options.health_listen, ": ",
                                       health_listener.status().message()));
    }
    s->health_listener_ = *std::move(health_listener);
    // No service registered: the server holds only the default health service.
    grpc::ServerBuilder health_builder;
    auto health_acceptor = health_builder.experimental().AddExternalConnectionAcceptor(
        grpc::ServerBuilder::experimental_type::ExternalConnectionType::FROM_FD,
        grpc::InsecureServerCredentials());
    health_builder.SetOption(std::make_unique<NoPlugins>());
    // Every other method answers UNIMPLEMENTED (the generic service's default); it also gives
    // the server the callback completion queue the health service runs on.
    s->health_generic_ = std::make_unique<grpc::CallbackGenericService>();
    health_builder.RegisterCallbackGenericService(s->health_generic_.get());
    health_builder.SetMaxReceiveMessageSize(kHealthMaxMessageBytes);
    health_builder.SetMaxSendMessageSize(kHealthMaxMessageBytes);
    health_builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS, kHealthHandshakeMs);
    health_builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS, kHealthIdleMs);
    health_builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_MS, kHealthMaxAgeMs);
    health_builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS, kHealthMaxAgeGraceMs);
    health_builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, 4);
    s->health_server_ = health_builder.BuildAndStart();
    if (s->health_server_ == nullptr || s->health_server_->GetHealthCheckService() == nullptr) {
      return absl::InternalError(
          absl::StrCat("gRPC could not start the health server on ", options.health_listen));
    }
    s->health_listener_->Start(std::move(health_acceptor), kHealthConnections,
                               OverCap::kCloseOldest);
  }
  s->SetServing(true);
  return s;
}

Serving::~Serving() { Stop(); }

void Serving::SetServing(bool serving) {
  for (grpc::Server* server : {server_.get(), health_server_.get()}) {
    if (server == nullptr) continue;
    grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
    if (health == nullptr) continue;
    health->SetServingStatus(serving);
    health->SetServingStatus(v1::KvBank::service_full_name(), serving);
  }
}

void Serving::ShutdownHealth() {
  for (grpc::Server* server : {server_.get(), health_server_.get()}) {
    if (server == nullptr) continue;
    if (grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService()) {
      health->Shutdown();
    }
  }
}

void Serving::Stop(absl::Time close_by) {
  if (stopped_ || server_ == nullptr) return;  // stopped, or never started
  stopped_ = true;
  listener_->Stop();
  // An idle client may answer the GOAWAY's PING only when it next polls (gRPC's backup poller:
  // up to 5 s), a raw TCP peer never: the caller bounds the wait.
  server_->Shutdown(absl::ToChronoTime(std::max(close_by, absl::Now())));
  server_->Wait();
  if (health_server_ != nullptr) {
    health_listener_->Stop();
    health_server_->Shutdown(std::chrono::system_clock::now());
    health_server_->Wait();
  }
}

}  // namespace kvbank::rpc
