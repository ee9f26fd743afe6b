// kvbankd: the kvbank server.
//
//   kvbankd --listen 127.0.0.1:50051 --models llama-3.1-8b --pool-bytes 1GiB
//
// Serves kvbank.v1.KvBank, grpc.health.v1.Health and server reflection. SIGTERM / SIGINT drain:
// new calls fail UNAVAILABLE, Watch streams end, health turns NOT_SERVING, the calls in flight
// finish and their answers reach the clients (up to --drain-timeout-ms); then it exits 0.
#include <malloc.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "google/protobuf/text_format.h"
#include "grpc/support/log.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "server/core/memory_limit.h"
#include "server/core/pool_memory.h"
#include "server/core/tier_folder.h"
#include "server/flags.h"
#include "server/metrics/kvbankd_metrics.h"
#include "server/rpc/drain.h"
#include "server/rpc/early_auth.h"
#include "server/rpc/request_log.h"
#include "server/rpc/service.h"
#include "server/rpc/serving.h"
#include "server/rpc/tls.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50051", "address to serve on (port 0: pick one)");
ABSL_FLAG(std::string, port_file, "", "write the port actually bound to this file once serving");
ABSL_FLAG(std::string, health_listen, "",
          "also serve grpc.health.v1 alone, in plaintext, on this address (for kubelet's gRPC "
          "probes, which cannot do TLS); same statuses as the main port; empty: off");
ABSL_FLAG(std::string, health_port_file, "", "write the health port bound to this file");
ABSL_FLAG(std::string, log_format, "text",
          "text (lines for a person) | json (one JSON object a line: start-up config, models, "
          "errors with method, tenant and code, drain progress; never payloads or tokens)");
ABSL_FLAG(uint32_t, log_errors_per_second, 50,
          "most failed calls logged a second (the rest are counted in the next record)");
ABSL_FLAG(std::string, device, "auto",
          "where pools live: auto (a GPU when there is one, else host memory) | host | cuda:N | "
          "host-staged (host memory through the GPU data path, for tests)");
ABSL_FLAG(double, gpu_memory_utilization, 0.9,
          "on a GPU: fraction of its memory this server may hold in all (the pools' budget is "
          "this fraction of the total minus what is in use already)");
ABSL_FLAG(std::string, models, "llama-3.1-8b",
          "comma-separated presets registered at start, each under its preset name");
ABSL_FLAG(std::string, config, "", "ServerConfig in protobuf text format (models to register)");
ABSL_FLAG(std::string, pool_bytes, "",
          "default pool size of a model (e.g. 512MiB, 4GiB); default: 1GiB in host memory, on a "
          "GPU the budget shared by the models registered at start (--models and --config)");
ABSL_FLAG(double, pool_memory_fraction, 0,
          "if > 0: default pool size of a model as this fraction of physical memory");
ABSL_FLAG(std::string, max_pool_bytes, "",
          "bound on all pools together (default: 80% of physical memory; on a GPU the "
          "--gpu-memory-utilization budget)");
ABSL_FLAG(uint64_t, max_sequences, 65536, "default live-sequence limit per model");
ABSL_FLAG(uint64_t, max_tokens_per_sequence, 1 << 20, "default token limit per sequence");
ABSL_FLAG(int64_t, default_lease_ms, 300000, "lease of a sequence created without one");
ABSL_FLAG(int64_t, max_lease_ms, 86400000, "longest lease a caller may ask for");
ABSL_FLAG(int64_t, lease_check_ms, 200, "how often expired leases are reaped");
ABSL_FLAG(std::string, chunk_bytes, "1MiB", "payload bytes per streamed fetch message");
ABSL_FLAG(std::string, staging_bytes, "64MiB",
          "pools on a GPU: host (pinned) bytes one append or fetch stages at a time; payloads move "
          "in pieces of whole layers, a larger layer alone");
ABSL_FLAG(int64_t, drain_timeout_ms, 10000,
          "how long calls in flight may finish (and their answers reach the clients) at shutdown, "
          "and then the pools' cached blocks go to the disk tier, within the same time");
ABSL_FLAG(std::string, host_tier_bytes, "",
          "per model: host memory below the pool that evicted cached blocks move to (e.g. 8GiB; "
          "default none)");
ABSL_FLAG(std::string, disk_tier_path, "",
          "folder for a disk tier below the pool (and host tier), one file per model; its blocks "
          "survive restarts (default none)");
ABSL_FLAG(std::string, disk_tier_bytes, "64GiB", "per model: the disk tier's file size at most");
ABSL_FLAG(bool, disk_tier_direct_io, true,
          "disk tier I/O with O_DIRECT where the filesystem takes it (false: through the page "
          "cache)");
ABSL_FLAG(uint32_t, tier_io_threads, 4, "per model: disk tier reads and writes in flight at once");
ABSL_FLAG(std::string, auth_tokens_file, "",
          "bearer tokens: one '<token> <tenant> [admin] [max_blocks_fraction=F]' a line");
ABSL_FLAG(bool, no_auth, false, "serve without authentication: every caller is one tenant");
ABSL_FLAG(bool, enable_prefix_caching, true, "share full blocks by prefix hash");
ABSL_FLAG(int64_t, prefix_cache_ttl_ms, 0, "drop cached blocks older than this (0: never)");
ABSL_FLAG(uint64_t, max_connections, 0,
          "most connections open at once; more are closed at once (0: the descriptor limit less "
          "a reserve)");
ABSL_FLAG(int64_t, stream_idle_timeout_ms, 60000,
          "a stream that waits this long on its client (an append that sends nothing, a fetch or "
          "watch whose client does not read) is cancelled and releases its blocks (0: never)");
ABSL_FLAG(int64_t, max_connection_idle_ms, 600000,
          "a connection with no call for this long is closed (0: never)");
ABSL_FLAG(int64_t, keepalive_time_ms, 60000,
          "ping idle connections this often; one that does not answer within 20 s is closed");
ABSL_FLAG(std::string, grpc_memory_bytes, "256MiB",
          "bound on the memory gRPC may take for connections and messages in flight (past it, "
          "gRPC reads less and sheds connections)");
ABSL_FLAG(std::string, hash_algorithm, "sha256",
          "prefix hash: sha256 | xxh3_128 (not safe "
          "against hostile tenants)");
ABSL_FLAG(std::string, tls_cert, "",
          "serve TLS with this certificate chain (PEM); needs --tls-key. Without it bearer tokens "
          "travel in clear text");
ABSL_FLAG(std::string, tls_key, "", "private key (PEM) of --tls-cert");
ABSL_FLAG(std::string, replica_name, "",
          "this replica's name in a fleet (GetServerInfo), which clients hash sequences to; "
          "empty: the host name (a StatefulSet pod's stable name)");
ABSL_FLAG(std::string, shm_socket, "",
          "same-host shared-memory plane: listen for memfd regions on this Unix socket path "
          "(mode 0600; a stale file is replaced, one a server answers on is refused); empty: off");
ABSL_FLAG(std::string, shm_max_region_bytes, "64GiB",
          "largest shared-memory region a client may register");
ABSL_FLAG(uint32_t, shm_max_regions, 256,
          "most shared-memory regions (each one socket connection) registered or pending at once");
ABSL_FLAG(
    uint32_t, cuda_ipc_lease_ms, 60000,
    "CUDA IPC plane (a cuda:N pool): a device region no Append / Fetch names for this long is "
    "closed (cudaIpcCloseMemHandle); the client registers again");
ABSL_FLAG(uint32_t, cuda_ipc_max_regions, 256, "most CUDA IPC device regions registered at once");
ABSL_FLAG(std::string, shm_max_total_bytes, "1TiB",
          "most bytes of shared-memory regions registered at once, all tenants together");
ABSL_FLAG(uint32_t, device_workers, 4,
          "threads that run device copies, disk reads and region copies (fair across tenants)");
ABSL_FLAG(uint64_t, max_queued_work, kvbank::rpc::kDefaultMaxQueuedWork,
          "device-worker tasks queued at once, all tenants together (each tenant gets its share)");
ABSL_FLAG(uint64_t, max_queued_prefetch, kvbank::rpc::kDefaultMaxQueuedBackground,
          "background prefetches (Match with prefetch) queued at once; past a tenant's share one "
          "is dropped, counted");
ABSL_FLAG(uint64_t, max_watch_streams, kvbank::rpc::kDefaultMaxWatchStreams,
          "Watch streams open at once, all tenants together (each tenant gets its share)");
ABSL_FLAG(uint64_t, max_waits, kvbank::rpc::kDefaultMaxWaits,
          "fetches waiting for their tokens (wait_ms) at once, all tenants together");
ABSL_FLAG(uint32_t, nccl_max_comms, 16,
          "NCCL plane (pools on cuda:N, built with NCCL): most communicators at once");
ABSL_FLAG(std::string, nccl_max_transfer_bytes, "4GiB",
          "NCCL plane: largest payload of one transfer (staged whole on the device)");
ABSL_FLAG(uint32_t, nccl_init_timeout_ms, 60000,
          "NCCL plane: every rank of a communicator must join within this");
ABSL_FLAG(uint32_t, nccl_transfer_timeout_ms, 60000,
          "NCCL plane: a transfer whose peer does not take part within this aborts the "
          "communicator");
ABSL_FLAG(uint32_t, nccl_idle_timeout_ms, 600000,
          "NCCL plane: a communicator unused this long is destroyed");
ABSL_FLAG(std::string, tls_client_ca, "",
          "with --tls-cert: require client certificates signed by these CAs (PEM): mutual TLS");
ABSL_FLAG(std::string, metrics_listen, "",
          "serve Prometheus metrics (GET /metrics) over HTTP on this host:port (port 0: pick "
          "one; a pod uses 0.0.0.0:9400); empty: off");
ABSL_FLAG(std::string, metrics_port_file, "",
          "write the metrics port actually bound to this file once serving it");

namespace kvbank {
namespace {

// After a drain, how long a connection may take to show that its client has read everything sent
// on it (see the end of Main). A client in a call reads at once; an idle one may take seconds.
constexpr absl::Duration kCloseGrace = absl::Seconds(1);

// "1GiB", "512MiB", "4096", "2GB" -> bytes.
absl::StatusOr<uint64_t> ParseBytes(std::string text) {
  text = absl::AsciiStrToLower(absl::StripAsciiWhitespace(text));
  struct Unit {
    const char* suffix;
    uint64_t mult;
  };
  static constexpr Unit kUnits[] = {
      {"kib", 1ull << 10},   {"mib", 1ull << 20},      {"gib", 1ull << 30},
      {"tib", 1ull << 40},   {"kb", 1000ull},          {"mb", 1000000ull},
      {"gb", 1000000000ull}, {"tb", 1000000000000ull}, {"b", 1}};
  uint64_t mult = 1;
  for (const Unit& u : kUnits) {
    if (absl::EndsWith(text, u.suffix)) {
      mult = u.mult;
      text.resize(text.size() - strlen(u.suffix));
      break;
    }
  }
  double v = 0;
  if (!absl::SimpleAtod(text, &v) || v < 0 || v * double(mult) > 1e18) {
    return absl::InvalidArgumentError(absl::StrCat("not a byte size: '", text, "'"));
  }
  return static_cast<uint64_t>(v * double(mult));
}

// Whether a --listen address only takes connections from this host.
bool IsLoopback(const std::string& address) {
  const std::string host = address.substr(0, address.rfind(':'));
  return absl::StartsWith(host, "127.") || host == "localhost" || host == "[::1]";
}

int Fail(const std::string& what) {
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

// The models registered at start: the --models presets, then the --config file's.
absl::StatusOr<std::vector<v1::ModelSpec>> StartupModels() {
  std::vector<v1::ModelSpec> specs;
  for (absl::string_view preset :
       absl::StrSplit(absl::GetFlag(FLAGS_models), ',', absl::SkipWhitespace())) {
    v1::ModelSpec s;
    s.set_name(std::string(preset));
    s.set_preset(std::string(preset));
    specs.push_back(s);
  }
  if (std::string path = absl::GetFlag(FLAGS_config); !path.empty()) {
    std::ifstream in(path);
    if (!in) return absl::InvalidArgumentError(absl::StrCat("--config: cannot read ", path));
    std::stringstream text;
    text << in.rdbuf();
    v1::ServerConfig config;
    if (!google::protobuf::TextFormat::ParseFromString(text.str(), &config)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--config: ", path, " is not a valid ServerConfig text proto"));
    }
    for (const auto& s : config.models()) specs.push_back(s);
  }
  return specs;
}

int Main(int argc, char** argv) {
  // SIGTERM and SIGINT are taken by the main thread with sigwait, so every other thread must
  // have them blocked; threads inherit the mask, and gRPC starts its own as soon as credentials
  // are made, so the mask is set first. (A thread with them unblocked may be picked to take the
  // signal, and its default action ends the process without a drain.)
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
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
  if (!credentials.ok()) return Fail(std::string(credentials.status().message()));
  if (tls.cert_path.empty() && !IsLoopback(absl::GetFlag(FLAGS_listen))) {
    log::Warn("no_tls").Field("listen", absl::GetFlag(FLAGS_listen))
        << "warning: serving " << absl::GetFlag(FLAGS_listen)
        << " without TLS: bearer tokens and KV cross the network in clear text "
           "(--tls-cert, --tls-key)";
  }

  rpc::ServiceOptions options;
  auto device = ResolveDevice(absl::GetFlag(FLAGS_device));
  if (!device.ok()) return Fail(absl::StrCat("--device: ", device.status().message()));
  options.defaults.device = *device;
  const bool on_gpu = device->kind == MemoryKind::kCuda;
  auto specs = StartupModels();
  if (!specs.ok()) return Fail(std::string(specs.status().message()));
  const size_t num_models = specs->size();
  const double util = absl::GetFlag(FLAGS_gpu_memory_utilization);
  if (!(util > 0 && util <= 1)) return Fail("--gpu-memory-utilization must be in (0, 1]");
  // Host memory this process may use: physical memory, or less under a cgroup limit (a
  // container's): pools sized from it fit the pod's memory limit.
  const MemoryLimit host_limit = HostMemoryLimit(PhysicalMemoryBytes());
  uint64_t max_pool = host_limit.bytes / 10 * 8;
  std::string budget_source = absl::StrCat("80% of ", host_limit.source);
  if (on_gpu) {
    uint64_t free_bytes = 0, total_bytes = 0;
    if (absl::Status s = CudaMemoryInfo(device->cuda_device, &free_bytes, &total_bytes); !s.ok()) {
      return Fail(absl::StrCat("--device ", device->Name(), ": ", s.message()));
    }
    // As vLLM's gpu_memory_utilization: this process may hold util x total; what others (or the
    // CUDA context) hold already comes off it.
    const double budget = util * double(total_bytes) - double(total_bytes - free_bytes);
    if (budget < double(64 << 20)) {
      return Fail(absl::StrCat("--gpu-memory-utilization ", util, " of ", total_bytes,
                               " bytes leaves no room: ", total_bytes - free_bytes,
                               " bytes are in use on ", device->Name()));
    }
    max_pool = static_cast<uint64_t>(budget);
    budget_source =
        absl::StrCat("--gpu-memory-utilization ", util, " of ", device->Name(), "'s ", total_bytes,
                     " bytes less ", total_bytes - free_bytes, " in use (", free_bytes, " free)");
  }
  if (std::string b = absl::GetFlag(FLAGS_pool_bytes); !b.empty()) {
    auto pool_bytes = ParseBytes(b);
    if (!pool_bytes.ok())
      return Fail(absl::StrCat("--pool-bytes: ", pool_bytes.status().message()));
    options.defaults.pool_bytes = *pool_bytes;
  } else if (on_gpu) {
    options.defaults.pool_bytes = max_pool / std::max<size_t>(num_models, 1);
  } else {
    // 1 GiB, or less where the memory limit leaves less for the models registered at start.
    options.defaults.pool_bytes =
        std::min<uint64_t>(uint64_t{1} << 30, max_pool / std::max<size_t>(num_models, 1));
  }
  if (double f = absl::GetFlag(FLAGS_pool_memory_fraction); f > 0) {
    if (on_gpu)
      return Fail("--pool-memory-fraction is for host memory; use --gpu-memory-utilization");
    if (f > 0.95) return Fail("--pool-memory-fraction must be at most 0.95");
    options.defaults.pool_bytes = static_cast<uint64_t>(f * double(host_limit.bytes));
  }
  if (std::string m = absl::GetFlag(FLAGS_max_pool_bytes); !m.empty()) {
    auto v = ParseBytes(m);
    if (!v.ok()) return Fail(absl::StrCat("--max-pool-bytes: ", v.status().message()));
    max_pool = *v;
    budget_source = "--max-pool-bytes";
  }
  log::Info("memory_budget")
          .Field("max_pool_bytes", max_pool)
          .Field("source", budget_source)
          .Field("default_pool_bytes", options.defaults.pool_bytes)
          .Field("host_memory_bytes", host_limit.bytes)
          .Field("host_memory_source", host_limit.source)
      << "memory budget: " << max_pool << " bytes for all pools (" << budget_source
      << "); a model's pool " << options.defaults.pool_bytes << " bytes by default";
  auto chunk = ParseBytes(absl::GetFlag(FLAGS_chunk_bytes));
  if (!chunk.ok() || *chunk == 0 || *chunk > uint64_t(rpc::kMaxMessageBytes) / 2) {
    return Fail(absl::StrCat("--chunk-bytes must be in (0, ", rpc::kMaxMessageBytes / 2, "]"));
  }
  options.chunk_bytes = *chunk;
  auto staging = ParseBytes(absl::GetFlag(FLAGS_staging_bytes));
  if (!staging.ok() || *staging == 0) return Fail("--staging-bytes must be a byte size above 0");
  options.defaults.staging_bytes = *staging;
  if (std::string b = absl::GetFlag(FLAGS_host_tier_bytes); !b.empty()) {
    auto host_tier = ParseBytes(b);
    if (!host_tier.ok()) {
      return Fail(absl::StrCat("--host-tier-bytes: ", host_tier.status().message()));
    }
    options.defaults.tiers.host_bytes = *host_tier;
  }
  std::shared_ptr<TierFolder> tier_folder;  // the disk tier's folder, locked while kvbankd runs
  if (std::string path = absl::GetFlag(FLAGS_disk_tier_path); !path.empty()) {
    auto disk_tier = ParseBytes(absl::GetFlag(FLAGS_disk_tier_bytes));
    if (!disk_tier.ok() || *disk_tier == 0) {
      return Fail("--disk-tier-bytes must be a byte size above 0");
    }
    options.defaults.tiers.disk_path = path;
    options.defaults.tiers.disk_bytes = *disk_tier;
    // Held (locked) from the start, models or not: a second kvbankd on the folder fails now,
    // not when a model is registered.
    auto folder = TierFolder::Open(path);
    if (!folder.ok()) return Fail(absl::StrCat("--disk-tier-path: ", folder.status().message()));
    tier_folder = *std::move(folder);
  }
  options.defaults.tiers.direct_io = absl::GetFlag(FLAGS_disk_tier_direct_io);
  options.defaults.tiers.io_threads = std::max<uint32_t>(1, absl::GetFlag(FLAGS_tier_io_threads));
  StoreOptions& store = options.defaults.store;
  store.max_sequences = absl::GetFlag(FLAGS_max_sequences);
  store.max_tokens_per_sequence = absl::GetFlag(FLAGS_max_tokens_per_sequence);
  store.default_lease = absl::Milliseconds(absl::GetFlag(FLAGS_default_lease_ms));
  store.max_lease = absl::Milliseconds(absl::GetFlag(FLAGS_max_lease_ms));
  store.prefix_cache_ttl = absl::Milliseconds(absl::GetFlag(FLAGS_prefix_cache_ttl_ms));
  if (!ParseHashAlgorithm(absl::GetFlag(FLAGS_hash_algorithm), &store.hash)) {
    return Fail("--hash-algorithm must be sha256 or xxh3_128");
  }
  options.defaults.enable_prefix_caching = absl::GetFlag(FLAGS_enable_prefix_caching);

  rpc::Authenticator auth = rpc::Authenticator::Disabled();
  if (std::string path = absl::GetFlag(FLAGS_auth_tokens_file); !path.empty()) {
    if (absl::GetFlag(FLAGS_no_auth)) return Fail("give --auth-tokens-file or --no-auth, not both");
    auto a = rpc::Authenticator::FromFile(path);
    if (!a.ok()) return Fail(std::string(a.status().message()));
    auth = *std::move(a);
  } else if (!absl::GetFlag(FLAGS_no_auth)) {
    return Fail("authentication needs --auth-tokens-file FILE; --no-auth serves without it");
  } else {
    log::Warn("no_auth") << "--no-auth: every caller is the same tenant";
  }

  auto registry = std::make_shared<ModelRegistry>(max_pool);
  for (const auto& s : *specs) {
    auto c = rpc::ToModelConfig(s, options.defaults);
    if (!c.ok()) return Fail(absl::StrCat("model '", s.name(), "': ", c.status().message()));
    auto r = registry->Ensure(*std::move(c));
    if (!r.ok()) return Fail(std::string(r.status().message()));
    auth.ApplyQuotas(*r->model);
    const uint64_t blocks = r->model->pool().num_blocks();
    log::Info("model_registered")
            .Field("model", s.name())
            .Field("blocks", blocks)
            .Field("block_bytes", r->model->block_layout().block_bytes)
            .Field("tokens", blocks * r->model->layout().block_tokens)
            .Field("memory", r->model->pool().memory().name())
        << "model '" << s.name() << "': " << blocks << " blocks of "
        << r->model->block_layout().block_bytes << " bytes ("
        << blocks * r->model->layout().block_tokens << " tokens), "
        << r->model->pool().memory().name() << " memory";
    if (const TierCache* t = r->model->tiers(); t != nullptr) {
      const TierStats ts = t->Stats();
      log::Info("tiers_opened")
              .Field("model", s.name())
              .Field("host_blocks", ts.host_capacity)
              .Field("disk_blocks", ts.disk_capacity)
              .Field("disk_file", t->disk_file())
              .Field("direct_io", ts.direct_io)
              .Field("loaded", ts.loaded)
              .Field("load_invalid", ts.load_invalid)
          << "model '" << s.name() << "': host tier " << ts.host_capacity << " blocks, disk tier "
          << ts.disk_capacity << " blocks" << (ts.direct_io ? " (O_DIRECT)" : "") << "; "
          << ts.loaded << " block(s) found on the disk, " << ts.load_invalid
          << " torn or corrupt slot(s) skipped";
    }
  }

  auto grpc_memory = ParseBytes(absl::GetFlag(FLAGS_grpc_memory_bytes));
  if (!grpc_memory.ok() || *grpc_memory < (uint64_t{64} << 20)) {
    return Fail("--grpc-memory-bytes must be a byte size of at least 64MiB");
  }
  options.stream_idle_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_stream_idle_timeout_ms));
  options.replica_name = absl::GetFlag(FLAGS_replica_name);
  if (char host[256] = {};
      options.replica_name.empty() && gethostname(host, sizeof(host) - 1) == 0) {
    options.replica_name = host;
  }
  std::getline(std::ifstream("/proc/sys/kernel/random/boot_id"), options.host_id);
  // One ledger of what each tenant holds of every server-wide cap (the service's queues, waits
  // and streams; the planes' regions and communicators): each tenant of the tokens file gets
  // its share of each.
  options.device_workers = std::max<uint32_t>(1, absl::GetFlag(FLAGS_device_workers));
  options.ledger = rpc::DefaultLedger();
  options.ledger->SetTenants(auth.Tenants());
  options.ledger->SetCap(Resource::kQueuedWork, absl::GetFlag(FLAGS_max_queued_work));
  options.ledger->SetCap(Resource::kQueuedBackground, absl::GetFlag(FLAGS_max_queued_prefetch));
  options.ledger->SetCap(Resource::kWatchStreams, absl::GetFlag(FLAGS_max_watch_streams));
  options.ledger->SetCap(Resource::kWaits, absl::GetFlag(FLAGS_max_waits));
  if (std::string path = absl::GetFlag(FLAGS_shm_socket); !path.empty()) {
    plane::ShmOptions shm;
    shm.socket_path = path;
    auto total = ParseBytes(absl::GetFlag(FLAGS_shm_max_total_bytes));
    if (!total.ok() || *total == 0)
      return Fail("--shm-max-total-bytes must be a byte size above 0");
    shm.max_total_bytes = *total;
    shm.ledger = options.ledger;
    options.ledger->SetCap(Resource::kShmRegions, absl::GetFlag(FLAGS_shm_max_regions));
    options.ledger->SetCap(Resource::kShmRegionBytes, *total);
    auto max_region = ParseBytes(absl::GetFlag(FLAGS_shm_max_region_bytes));
    if (!max_region.ok() || *max_region == 0) {
      return Fail("--shm-max-region-bytes must be a byte size above 0");
    }
    shm.max_region_bytes = *max_region;
    shm.max_regions = absl::GetFlag(FLAGS_shm_max_regions);
    auto regions = plane::ShmRegions::Start(shm);
    if (!regions.ok()) return Fail(std::string(regions.status().message()));
    options.shm_regions = *std::move(regions);
    log::Info("plane").Field("plane", "shm").Field("socket", path)
        << "shared-memory plane on " << path << " (regions up to " << *max_region
        << " bytes, at most " << shm.max_regions << ")";
  }
  if (on_gpu) {
    plane::CudaIpcOptions ipc;
    ipc.device = device->cuda_device;
    ipc.lease = absl::Milliseconds(std::max<uint32_t>(absl::GetFlag(FLAGS_cuda_ipc_lease_ms), 1));
    ipc.max_regions = absl::GetFlag(FLAGS_cuda_ipc_max_regions);
    ipc.ledger = options.ledger;
    options.ledger->SetCap(Resource::kDeviceRegions, ipc.max_regions);
    options.cuda_ipc = std::make_shared<plane::CudaIpcRegions>(ipc);
    log::Info("plane").Field("plane", "cuda_ipc").Field("device", device->Name())
        << "CUDA IPC plane on " << device->Name() << " (lease "
        << absl::GetFlag(FLAGS_cuda_ipc_lease_ms) << " ms)";
  }
  const std::shared_ptr<plane::CudaIpcRegions> cuda_ipc = options.cuda_ipc;
  if (!plane::NcclBuiltIn()) {
    options.nccl_off = "kvbankd was built without NCCL (it needs CUDA and libnccl at build time)";
  } else if (!on_gpu) {
    options.nccl_off = absl::StrCat("kvbankd's pools are in ", device->Name(),
                                    " memory; the NCCL plane needs a CUDA pool (--device cuda:N)");
  } else {
    plane::NcclOptions nccl;
    nccl.device = device->cuda_device;
    nccl.max_comms = absl::GetFlag(FLAGS_nccl_max_comms);
    nccl.ledger = options.ledger;
    options.ledger->SetCap(Resource::kNcclComms, nccl.max_comms);
    auto max_transfer = ParseBytes(absl::GetFlag(FLAGS_nccl_max_transfer_bytes));
    if (!max_transfer.ok() || *max_transfer == 0) {
      return Fail("--nccl-max-transfer-bytes must be a byte size above 0");
    }
    nccl.max_transfer_bytes = *max_transfer;
    nccl.init_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_nccl_init_timeout_ms));
    nccl.transfer_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_nccl_transfer_timeout_ms));
    nccl.idle_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_nccl_idle_timeout_ms));
    auto created = plane::NcclPlane::Create(nccl);
    if (created.ok()) {
      options.nccl = *std::move(created);
      log::Info("plane").Field("plane", "nccl").Field("device", device->Name())
          << "NCCL plane on " << device->Name() << " (at most " << nccl.max_comms
          << " communicators)";
    } else {
      options.nccl_off = absl::StrCat("the NCCL plane is off: ", created.status().message());
    }
  }
  // Kept apart from the service's copy: the socket file is removed before exit.
  const std::shared_ptr<plane::ShmRegions> shm_regions = options.shm_regions;

  rpc::KvBankService service(registry, options, auth);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  rpc::ServingOptions serving_options;
  serving_options.listen = absl::GetFlag(FLAGS_listen);
  serving_options.max_connections = absl::GetFlag(FLAGS_max_connections);
  serving_options.grpc_memory_bytes = *grpc_memory;
  serving_options.max_connection_idle =
      absl::Milliseconds(absl::GetFlag(FLAGS_max_connection_idle_ms));
  serving_options.keepalive_time = absl::Milliseconds(absl::GetFlag(FLAGS_keepalive_time_ms));
  serving_options.health_listen = absl::GetFlag(FLAGS_health_listen);
  auto counter = std::make_unique<rpc::CallCounter>();
  const rpc::CallCounter& calls = *counter;
  serving_options.interceptors.push_back(std::move(counter));
  auto request_log =
      std::make_unique<rpc::RequestLog>(&auth, absl::GetFlag(FLAGS_log_errors_per_second));
  rpc::RequestLog* const errors = request_log.get();  // gRPC's from here on; it outlives calls
  serving_options.interceptors.push_back(std::move(request_log));
  // Prometheus metrics (server/metrics/): /metrics on its own port, the RPCs counted by an
  // interceptor, the connections by the listener once it is bound.
  std::unique_ptr<metrics::KvbankdMetrics> exporter;
  if (std::string address = absl::GetFlag(FLAGS_metrics_listen); !address.empty()) {
    auto m = metrics::KvbankdMetrics::Start({address, absl::GetFlag(FLAGS_metrics_port_file), ""},
                                            registry, &service);
    if (!m.ok()) return Fail(absl::StrCat("--metrics-listen: ", m.status().message()));
    exporter = *std::move(m);
    serving_options.interceptors.push_back(exporter->TakeInterceptor());
    log::Info("metrics").Field("url", exporter->url())
        << "Prometheus metrics on " << exporter->url();
  }
  // The token is checked as a call's metadata arrives, before any of its messages is read; a
  // call refused there never reaches the interceptors, so it is logged and counted here.
  metrics::KvbankdMetrics* const rpc_metrics = exporter.get();
  serving_options.credentials = rpc::WithEarlyAuth(
      tls.cert_path.empty() ? nullptr : *credentials, &auth,
      [errors, rpc_metrics](absl::string_view method, const grpc::Status& status) {
        errors->Refused(method, status);
        if (rpc_metrics != nullptr) rpc_metrics->CountRefused(method, int(status.error_code()));
      });
  auto serving = rpc::Serving::Start(&service, std::move(serving_options));
  if (!serving.ok()) {
    return Fail(absl::StrCat("cannot listen on ", absl::GetFlag(FLAGS_listen), ": ",
                             serving.status().message()));
  }
  if (exporter != nullptr) exporter->WatchListener(&(*serving)->listener());
  const int port = (*serving)->port();
  {
    std::string models;
    for (const auto& s : *specs) absl::StrAppend(&models, models.empty() ? "" : ",", s.name());
    log::Info("serving")
            .Field("listen", absl::GetFlag(FLAGS_listen))
            .Field("port", port)
            .Field("health_port", (*serving)->health_port())
            .Field("replica", options.replica_name)
            .Field("device", device->Name())
            .Field("models", models)
            .Field("auth", auth.enabled() ? "tokens" : "none")
            .Field("tls", tls.cert_path.empty()        ? "off"
                          : tls.client_ca_path.empty() ? "on"
                                                       : "mutual")
            .Field("max_pool_bytes", max_pool)
            .Field("max_connections", (*serving)->max_connections())
            .Field("drain_timeout_ms", absl::GetFlag(FLAGS_drain_timeout_ms))
            .Field("version", KVBANK_VERSION_STRING)
        << "serving kvbank.v1 on " << absl::GetFlag(FLAGS_listen) << " (port " << port
        << "; at most " << (*serving)->max_connections() << " connections, descriptor limit "
        << (*serving)->descriptor_limit() << ")"
        << ((*serving)->health_port() != 0
                ? absl::StrCat("; health on port ", (*serving)->health_port())
                : std::string());
  }
  WritePortFile(absl::GetFlag(FLAGS_port_file), port);
  WritePortFile(absl::GetFlag(FLAGS_health_port_file), (*serving)->health_port());

  absl::Notification stop;
  std::thread reaper([&] {
    const absl::Duration every = absl::Milliseconds(absl::GetFlag(FLAGS_lease_check_ms));
    bool serving_now = true;
    absl::Time last_trim = absl::Now();
    while (!stop.WaitForNotificationWithTimeout(every)) {
      // Health reports a listener that cannot take connections (out of descriptors) and a pool
      // whose memory cannot serve (a GPU with a sticky error).
      std::string why_not;
      if (!(*serving)->listener().accepting()) why_not = "cannot accept connections";
      for (const auto& model : registry->List()) {
        if (absl::Status h = model->pool().memory().Health(); !h.ok() && why_not.empty()) {
          why_not = absl::StrCat("model '", model->layout().name, "': ", h.message());
        }
      }
      if (const bool now = why_not.empty(); now != serving_now) {
        serving_now = now;
        (*serving)->SetServing(now);
        (now ? log::Info("health") : log::Error("health"))
                .Field("status", now ? "SERVING" : "NOT_SERVING")
                .Field("reason", why_not)
            << "health: " << (now ? "SERVING (can serve again)" : "NOT_SERVING (") << why_not
            << (now ? "" : ")");
      }
      if (size_t n = registry->ExpireLeases(absl::Now()); n > 0) {
        log::Info("leases_expired").Field("sequences", n)
            << n << " lease(s) expired; their sequences were freed";
      }
      registry->ExpireCache(absl::Now());
      if (cuda_ipc != nullptr) {
        if (size_t n = cuda_ipc->Sweep(absl::Now()); n > 0) {
          log::Info("cuda_ipc_regions_closed").Field("regions", n)
              << n << " CUDA IPC device region(s) unused for the lease; closed";
        }
      }
      // The heap is kept large on purpose (see mallopt above), so a burst (many large messages
      // at once, refused or not) would keep its memory for good: give it back once nothing is
      // in flight, at most once a second.
      if (calls.in_flight() == 0 && absl::Now() - last_trim > absl::Seconds(1)) {
        malloc_trim(0);
        last_trim = absl::Now();
      }
    }
  });

  int sig = 0;
  sigwait(&signals, &sig);
  log::Info("drain_start")
          .Field("signal", sig)
          .Field("in_flight", calls.in_flight())
          .Field("drain_timeout_ms", absl::GetFlag(FLAGS_drain_timeout_ms))
      << "signal " << sig << ": draining calls in flight";
  // Drain before gRPC's Shutdown, which closes connections whose clients may still be reading
  // (see server/rpc/drain.h): refuse new calls, report NOT_SERVING, let the calls in flight
  // finish and wait until the clients have acknowledged every byte sent.
  const absl::Time deadline =
      absl::Now() + absl::Milliseconds(absl::GetFlag(FLAGS_drain_timeout_ms));
  stop.Notify();  // the reaper (and its health updates) end before health shuts down
  reaper.join();
  service.BeginDrain();
  (*serving)->ShutdownHealth();
  uint64_t in_flight = 0, unacked = 0;
  const absl::Time drain_start = absl::Now();
  absl::Time next_progress = drain_start + absl::Seconds(1);
  for (;;) {
    in_flight = calls.in_flight();
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
  (*serving)->Stop(drained ? std::min(deadline, absl::Now() + kCloseGrace) : absl::Now());
  // Warm restart: the pools' cached blocks go to the disk tier, in what is left of the drain's
  // time, so the next start serves them.
  for (const auto& model : registry->List()) {
    if (model->tiers() == nullptr || !model->tiers()->has_disk()) continue;
    const absl::Time flush_start = absl::Now();
    const size_t written = model->FlushToDisk(deadline);
    const TierStats t = model->tiers()->Stats();
    log::Info("tier_flush")
            .Field("model", model->layout().name)
            .Field("blocks_written", uint64_t(written))
            .Field("disk_blocks", t.disk_blocks)
            .Field("ms", absl::ToInt64Milliseconds(absl::Now() - flush_start))
        << "model " << model->layout().name << ": " << written
        << " cached block(s) written to the disk tier (" << t.disk_blocks << " there in all)";
  }
  if (shm_regions != nullptr) unlink(shm_regions->options().socket_path.c_str());
  log::Info("stopped") << "stopped";
  // Every call is done and every pool is quiescent; skip the library teardown, in which gRPC 1.51
  // sometimes waits ~10 s for one of its internal threads.
  std::fflush(nullptr);
  std::_Exit(0);
}

}  // namespace
}  // namespace kvbank

int main(int argc, char** argv) { return kvbank::Main(argc, argv); }
