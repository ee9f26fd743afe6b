// kvbankd: the kvbank server.
//
//   kvbankd --listen 127.0.0.1:50051 --models llama-3.1-8b --pool-bytes 1GiB
//
// Serves kvbank.v1.KvBank, grpc.health.v1.Health and server reflection. SIGTERM / SIGINT drain:
// new calls fail UNAVAILABLE, Watch streams end, health turns NOT_SERVING, the calls in flight
// finish and their answers reach the clients (up to --drain-timeout-ms); then it exits 0.
//
// This file assembles the server: configuration from the flags (config.h), the gRPC service
// (server/rpc), the data planes (server/plane), /metrics (kvbankd_metrics.h), then the
// housekeeping loop and the drain.
#include <malloc.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "grpc/support/log.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "server/core/tiers.h"
#include "server/kvbankd/config.h"
#include "server/kvbankd/flags.h"
#include "server/kvbankd/kvbankd_metrics.h"
#include "server/rpc/drain.h"
#include "server/rpc/early_auth.h"
#include "server/rpc/request_log.h"
#include "server/rpc/service.h"
#include "server/rpc/serving.h"
#include "server/rpc/tls.h"

namespace kvbank::kvbankd {
namespace {

// After a drain, how long a connection may take to show that its client has read everything sent
// on it (see Drain). A client in a call reads at once; an idle one may take seconds.
constexpr absl::Duration kCloseGrace = absl::Seconds(1);

int Fail(absl::string_view what) {
  log::Error("startup_failed") << what;
  return 2;
}

// gRPC's own log lines, as kvbankd's records (event "grpc"), so that a JSON log stays JSON.
void GrpcLogToRecords(gpr_log_func_args* args) {
  const char* level = args->severity == GPR_LOG_SEVERITY_ERROR   ? "error"
                      : args->severity == GPR_LOG_SEVERITY_DEBUG ? "debug"
                                                                 : "info";
  log::Record(level, "grpc")
          .Field("file", args->file != nullptr ? args->file : "")
          .Field("line", args->line)
      << "grpc: " << (args->message != nullptr ? args->message : "");
}

// Writes `port` to `path` (when set) so that readers never see a half-written file.
void WritePortFile(const std::string& path, int port) {
  if (path.empty()) return;
  const std::string tmp = path + ".tmp";
  std::ofstream(tmp) << port << "\n";
  std::rename(tmp.c_str(), path.c_str());
}

// SIGTERM and SIGINT are taken by the main thread with sigwait, so every other thread must have
// them blocked; threads inherit the mask, and gRPC starts its own as soon as credentials are
// made, so the mask is set first. (A thread with them unblocked may be picked to take the
// signal, and its default action ends the process without a drain.)
sigset_t BlockStopSignals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  return signals;
}

// The server listening, with what the drain and the housekeeping need of it.
struct Served {
  std::unique_ptr<rpc::Serving> serving;
  std::unique_ptr<metrics::KvbankdMetrics> exporter;  // null without --metrics-listen
  const rpc::CallCounter* calls = nullptr;            // gRPC's (an interceptor); lives as long
};

// Builds the server around `service` (interceptors: the call counter, the error log, the
// metrics; early authentication) and starts listening.
absl::StatusOr<Served> StartServing(rpc::KvBankService* service, const rpc::Authenticator* auth,
                                    std::shared_ptr<grpc::ServerCredentials> tls_credentials,
                                    const std::shared_ptr<ModelRegistry>& registry,
                                    uint64_t grpc_memory_bytes) {
  Served served;
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  rpc::ServingOptions o;
  o.listen = absl::GetFlag(FLAGS_listen);
  o.max_connections = absl::GetFlag(FLAGS_max_connections);
  o.grpc_memory_bytes = grpc_memory_bytes;
  o.max_connection_idle = absl::Milliseconds(absl::GetFlag(FLAGS_max_connection_idle_ms));
  o.keepalive_time = absl::Milliseconds(absl::GetFlag(FLAGS_keepalive_time_ms));
  o.health_listen = absl::GetFlag(FLAGS_health_listen);
  auto counter = std::make_unique<rpc::CallCounter>();
  served.calls = counter.get();
  o.interceptors.push_back(std::move(counter));
  auto request_log =
      std::make_unique<rpc::RequestLog>(auth, absl::GetFlag(FLAGS_log_errors_per_second));
  rpc::RequestLog* const errors = request_log.get();  // gRPC's from here on; it outlives calls
  o.interceptors.push_back(std::move(request_log));
  // Prometheus metrics: /metrics on its own port, the RPCs counted by an interceptor, the
  // connections by the listener once it is bound.
  if (std::string address = absl::GetFlag(FLAGS_metrics_listen); !address.empty()) {
    auto m = metrics::KvbankdMetrics::Start({address, absl::GetFlag(FLAGS_metrics_port_file), ""},
                                            registry, service);
    if (!m.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--metrics-listen: ", m.status().message()));
    }
    served.exporter = *std::move(m);
    o.interceptors.push_back(served.exporter->TakeInterceptor());
    log::Info("metrics").Field("url", served.exporter->url())
        << "Prometheus metrics on " << served.exporter->url();
  }
  // The token is checked as a call's metadata arrives, before any of its messages is read; a
  // call refused there never reaches the interceptors, so it is logged and counted here.
  metrics::KvbankdMetrics* const rpc_metrics = served.exporter.get();
  o.credentials = rpc::WithEarlyAuth(
      std::move(tls_credentials), auth,
      [errors, rpc_metrics](absl::string_view method, const grpc::Status& status) {
        errors->Refused(method, status);
        if (rpc_metrics != nullptr) rpc_metrics->CountRefused(method, int(status.error_code()));
      });
  auto serving = rpc::Serving::Start(service, std::move(o));
  if (!serving.ok()) {
    return absl::Status(serving.status().code(),
                        absl::StrCat("cannot listen on ", absl::GetFlag(FLAGS_listen), ": ",
                                     serving.status().message()));
  }
  served.serving = *std::move(serving);
  if (served.exporter != nullptr) served.exporter->WatchListener(&served.serving->listener());
  return served;
}

// Every --lease-check-ms until `stop`: health (NOT_SERVING while the listener cannot accept or a
// pool's memory fails), lease and prefix-cache expiry, idle CUDA IPC regions, and the heap
// trimmed back once nothing is in flight.
void Housekeeping(const absl::Notification& stop, const Served& served,
                  const ModelRegistry& registry, plane::CudaIpcRegions* cuda_ipc) {
  const absl::Duration every = absl::Milliseconds(absl::GetFlag(FLAGS_lease_check_ms));
  bool serving_now = true;
  absl::Time last_trim = absl::Now();
  while (!stop.WaitForNotificationWithTimeout(every)) {
    std::string why_not;
    if (!served.serving->listener().accepting()) why_not = "cannot accept connections";
    for (const auto& model : registry.List()) {
      if (absl::Status h = model->pool().memory().Health(); !h.ok() && why_not.empty()) {
        why_not = absl::StrCat("model '", model->layout().name, "': ", h.message());
      }
    }
    if (const bool now = why_not.empty(); now != serving_now) {
      serving_now = now;
      served.serving->SetServing(now);
      (now ? log::Info("health") : log::Error("health"))
              .Field("status", now ? "SERVING" : "NOT_SERVING")
              .Field("reason", why_not)
          << "health: " << (now ? "SERVING (can serve again)" : "NOT_SERVING (") << why_not
          << (now ? "" : ")");
    }
    if (size_t n = registry.ExpireLeases(absl::Now()); n > 0) {
      log::Info("leases_expired").Field("sequences", n)
          << n << " lease(s) expired; their sequences were freed";
    }
    registry.ExpireCache(absl::Now());
    if (cuda_ipc != nullptr) {
      if (size_t n = cuda_ipc->Sweep(absl::Now()); n > 0) {
        log::Info("cuda_ipc_regions_closed").Field("regions", n)
            << n << " CUDA IPC device region(s) unused for the lease; closed";
      }
    }
    // The heap is kept large on purpose (see the mallopt calls in Main), so a burst (many large
    // messages at once, refused or not) would keep its memory for good: give it back once
    // nothing is in flight, at most once a second.
    if (served.calls->in_flight() == 0 && absl::Now() - last_trim > absl::Seconds(1)) {
      malloc_trim(0);
      last_trim = absl::Now();
    }
  }
}

// Drain before gRPC's Shutdown, which closes connections whose clients may still be reading
// (see server/rpc/drain.h): refuse new calls, report NOT_SERVING, let the calls in flight finish
// and wait until the clients have acknowledged every byte sent; then close the connections.
// Runs until `deadline` at most.
void Drain(rpc::KvBankService& service, const Served& served, int port, absl::Time deadline) {
  service.BeginDrain();
  served.serving->ShutdownHealth();
  uint64_t in_flight = 0, unacked = 0;
  const absl::Time drain_start = absl::Now();
  absl::Time next_progress = drain_start + absl::Seconds(1);
  for (;;) {
    in_flight = served.calls->in_flight();
    unacked = in_flight > 0 ? 0 : rpc::UnackedBytesOnPort(port);
    if ((in_flight == 0 && unacked == 0) || absl::Now() >= deadline) break;
    if (absl::Now() >= next_progress) {
      next_progress += absl::Seconds(1);
      log::Info("drain_progress")
              .Field("in_flight", in_flight)
              .Field("unacked_bytes", unacked)
              .Field("remaining_ms", absl::ToInt64Milliseconds(deadline - absl::Now()))
          << "draining: " << in_flight << " call(s) in flight, " << unacked
          << " byte(s) not acknowledged";
    }
    absl::SleepFor(absl::Milliseconds(2));
  }
  if (in_flight > 0 || unacked > 0) {
    log::Warn("drain_timeout").Field("in_flight", in_flight).Field("unacked_bytes", unacked)
        << "drain timed out with " << in_flight << " call(s) in flight and " << unacked
        << " byte(s) not acknowledged; cancelling";
  } else {
    log::Info("drain_done").Field("ms", absl::ToInt64Milliseconds(absl::Now() - drain_start))
        << "drained in " << absl::ToInt64Milliseconds(absl::Now() - drain_start) << " ms";
  }
  // Nothing is in flight and the clients' kernels have every byte (or the drain timed out). A
  // client may still be reading the end of an answer from its socket buffer, and writing window
  // updates as it goes: a connection closed under it is reset, and the client fails a call that
  // succeeded. So each connection closes once its client has read up to the GOAWAY's PING,
  // within kCloseGrace (idle clients may not answer that soon) and the drain's time.
  const bool drained = in_flight == 0 && unacked == 0;
  served.serving->Stop(drained ? std::min(deadline, absl::Now() + kCloseGrace) : absl::Now());
}

// Warm restart: the pools' cached blocks go to the disk tier, in what is left of the drain's
// time, so the next start serves them.
void FlushTiers(const ModelRegistry& registry, absl::Time deadline) {
  for (const auto& model : registry.List()) {
    if (model->prefix().tiers() == nullptr || !model->prefix().tiers()->has_disk()) continue;
    const absl::Time flush_start = absl::Now();
    const size_t written = model->prefix().FlushToDisk(deadline);
    const TierStats t = model->prefix().tiers()->Stats();
    log::Info("tier_flush")
            .Field("model", model->layout().name)
            .Field("blocks_written", uint64_t(written))
            .Field("disk_blocks", t.disk_blocks)
            .Field("ms", absl::ToInt64Milliseconds(absl::Now() - flush_start))
        << "model " << model->layout().name << ": " << written
        << " cached block(s) written to the disk tier (" << t.disk_blocks << " there in all)";
  }
}

void LogServing(const Served& served, const rpc::ServiceOptions& options,
                const std::vector<v1::ModelSpec>& specs, const rpc::Authenticator& auth,
                const rpc::TlsFiles& tls, const MemoryBudget& budget) {
  const rpc::Serving& s = *served.serving;
  std::string models;
  for (const auto& m : specs) absl::StrAppend(&models, models.empty() ? "" : ",", m.name());
  log::Info("serving")
          .Field("listen", absl::GetFlag(FLAGS_listen))
          .Field("port", s.port())
          .Field("health_port", s.health_port())
          .Field("replica", options.replica_name)
          .Field("device", options.defaults.device.Name())
          .Field("models", models)
          .Field("auth", auth.enabled() ? "tokens" : "none")
          .Field("tls", tls.cert_path.empty()        ? "off"
                        : tls.client_ca_path.empty() ? "on"
                                                     : "mutual")
          .Field("max_pool_bytes", budget.max_pool_bytes)
          .Field("max_connections", s.max_connections())
          .Field("drain_timeout_ms", absl::GetFlag(FLAGS_drain_timeout_ms))
          .Field("version", KVBANK_VERSION_STRING)
      << "serving kvbank.v1 on " << absl::GetFlag(FLAGS_listen) << " (port " << s.port()
      << "; at most " << s.max_connections() << " connections, descriptor limit "
      << s.descriptor_limit() << ")"
      << (s.health_port() != 0 ? absl::StrCat("; health on port ", s.health_port())
                               : std::string());
}

int Main(int argc, char** argv) {
  sigset_t signals = BlockStopSignals();
  // Payload messages are ~1 MiB: keep glibc from mapping and unmapping each one (page faults on
  // every message cost more than the copy itself).
  mallopt(M_MMAP_THRESHOLD, 64 << 20);
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
  // Debian's Abseil builds with deadlock detection on: a graph update per lock (about 1% of CPU).
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  if (std::optional<int> exit = ParseServerFlags(
          argc, argv, "usage: kvbankd [--flag=value ...]\n\nkvbankd: the kvbank KV-cache service.");
      exit.has_value()) {
    return *exit;
  }
  if (log::Format format; log::ParseFormat(absl::GetFlag(FLAGS_log_format), &format)) {
    log::SetFormat(format);
    if (format == log::Format::kJson) gpr_set_log_function(&GrpcLogToRecords);
  } else {
    return Fail("--log-format must be text or json");
  }
  // TLS files are checked before anything is allocated.
  const rpc::TlsFiles tls{absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key),
                          absl::GetFlag(FLAGS_tls_client_ca)};
  auto credentials = rpc::ServerCredentialsFromFlags(tls);
  if (!credentials.ok()) return Fail(credentials.status().message());
  if (tls.cert_path.empty() && !IsLoopback(absl::GetFlag(FLAGS_listen))) {
    log::Warn("no_tls").Field("listen", absl::GetFlag(FLAGS_listen))
        << "warning: serving " << absl::GetFlag(FLAGS_listen)
        << " without TLS: bearer tokens and KV cross the network in clear text "
           "(--tls-cert, --tls-key)";
  }

  rpc::ServiceOptions options;
  auto device = ResolveDevice(absl::GetFlag(FLAGS_device));
  if (!device.ok()) return Fail(absl::StrCat("--device: ", device.status().message()));
  auto specs = StartupModels();
  if (!specs.ok()) return Fail(specs.status().message());
  std::shared_ptr<TierFolder> tier_folder;  // the disk tier's folder, locked while kvbankd runs
  auto budget = ConfigurePools(*device, specs->size(), &options, &tier_folder);
  if (!budget.ok()) return Fail(budget.status().message());
  auto authenticator = AuthenticatorFromFlags();
  if (!authenticator.ok()) return Fail(authenticator.status().message());
  rpc::Authenticator auth = *std::move(authenticator);
  auto registry = std::make_shared<ModelRegistry>(budget->max_pool_bytes);
  if (absl::Status s = RegisterModels(*specs, options.defaults, auth, registry.get()); !s.ok()) {
    return Fail(s.message());
  }
  auto grpc_memory = ParseBytes(absl::GetFlag(FLAGS_grpc_memory_bytes));
  if (!grpc_memory.ok() || *grpc_memory < (uint64_t{64} << 20)) {
    return Fail("--grpc-memory-bytes must be a byte size of at least 64MiB");
  }
  if (absl::Status s = ConfigureService(*device, auth, &options); !s.ok()) return Fail(s.message());
  // Kept apart from the service's copies: the housekeeping sweeps the CUDA IPC regions, and the
  // shared-memory plane's socket file is removed before exit.
  const std::shared_ptr<plane::CudaIpcRegions> cuda_ipc = options.cuda_ipc;
  const std::shared_ptr<plane::ShmRegions> shm_regions = options.shm_regions;

  rpc::KvBankService service(registry, options, auth);
  auto served = StartServing(&service, &auth, tls.cert_path.empty() ? nullptr : *credentials,
                             registry, *grpc_memory);
  if (!served.ok()) return Fail(served.status().message());
  const int port = served->serving->port();
  LogServing(*served, options, *specs, auth, tls, *budget);
  WritePortFile(absl::GetFlag(FLAGS_port_file), port);
  WritePortFile(absl::GetFlag(FLAGS_health_port_file), served->serving->health_port());

  absl::Notification stop;
  std::thread housekeeping([&] { Housekeeping(stop, *served, *registry, cuda_ipc.get()); });
  int sig = 0;
  sigwait(&signals, &sig);
  log::Info("drain_start")
          .Field("signal", sig)
          .Field("in_flight", served->calls->in_flight())
          .Field("drain_timeout_ms", absl::GetFlag(FLAGS_drain_timeout_ms))
      << "signal " << sig << ": draining calls in flight";
  const absl::Time deadline =
      absl::Now() + absl::Milliseconds(absl::GetFlag(FLAGS_drain_timeout_ms));
  stop.Notify();  // the housekeeping (and its health updates) end before health shuts down
  housekeeping.join();
  Drain(service, *served, port, deadline);
  FlushTiers(*registry, deadline);
  if (shm_regions != nullptr) unlink(shm_regions->options().socket_path.c_str());
  log::Info("stopped") << "stopped";
  // Every call is done and every pool is quiescent; skip the library teardown, in which gRPC 1.51
  // sometimes waits ~10 s for one of its internal threads.
  std::fflush(nullptr);
  std::_Exit(0);
}

}  // namespace
}  // namespace kvbank::kvbankd

int main(int argc, char** argv) { return kvbank::kvbankd::Main(argc, argv); }
