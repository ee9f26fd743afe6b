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
#include "google/protobuf/text_format.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "server/core/pool_memory.h"
#include "server/flags.h"
#include "server/rpc/drain.h"
#include "server/rpc/service.h"
#include "server/rpc/serving.h"
#include "server/rpc/tls.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50051", "address to serve on (port 0: pick one)");
ABSL_FLAG(std::string, port_file, "", "write the port actually bound to this file once serving");
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
          "how long calls in flight may finish (and their answers reach the clients) at shutdown");
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

namespace kvbank {
namespace {

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

uint64_t PhysicalMemory() {
  return uint64_t(sysconf(_SC_PHYS_PAGES)) * uint64_t(sysconf(_SC_PAGESIZE));
}

// Whether a --listen address only takes connections from this host.
bool IsLoopback(const std::string& address) {
  const std::string host = address.substr(0, address.rfind(':'));
  return absl::StartsWith(host, "127.") || host == "localhost" || host == "[::1]";
}

int Fail(const std::string& what) {
  std::cerr << "kvbankd: " << what << "\n";
  return 2;
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
  // TLS files are checked before anything is allocated.
  const rpc::TlsFiles tls{absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key),
                          absl::GetFlag(FLAGS_tls_client_ca)};
  auto credentials = rpc::ServerCredentialsFromFlags(tls);
  if (!credentials.ok()) return Fail(std::string(credentials.status().message()));
  if (tls.cert_path.empty() && !IsLoopback(absl::GetFlag(FLAGS_listen))) {
    std::cerr << "kvbankd: warning: serving " << absl::GetFlag(FLAGS_listen)
              << " without TLS: bearer tokens and KV cross the network in clear text "
                 "(--tls-cert, --tls-key)"
              << std::endl;
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
  uint64_t max_pool = PhysicalMemory() / 10 * 8;
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
  }
  if (std::string b = absl::GetFlag(FLAGS_pool_bytes); !b.empty()) {
    auto pool_bytes = ParseBytes(b);
    if (!pool_bytes.ok())
      return Fail(absl::StrCat("--pool-bytes: ", pool_bytes.status().message()));
    options.defaults.pool_bytes = *pool_bytes;
  } else if (on_gpu) {
    options.defaults.pool_bytes = max_pool / std::max<size_t>(num_models, 1);
  } else {
    options.defaults.pool_bytes = uint64_t{1} << 30;
  }
  if (double f = absl::GetFlag(FLAGS_pool_memory_fraction); f > 0) {
    if (on_gpu)
      return Fail("--pool-memory-fraction is for host memory; use --gpu-memory-utilization");
    if (f > 0.95) return Fail("--pool-memory-fraction must be at most 0.95");
    options.defaults.pool_bytes = static_cast<uint64_t>(f * double(PhysicalMemory()));
  }
  if (std::string m = absl::GetFlag(FLAGS_max_pool_bytes); !m.empty()) {
    auto v = ParseBytes(m);
    if (!v.ok()) return Fail(absl::StrCat("--max-pool-bytes: ", v.status().message()));
    max_pool = *v;
  }
  auto chunk = ParseBytes(absl::GetFlag(FLAGS_chunk_bytes));
  if (!chunk.ok() || *chunk == 0 || *chunk > uint64_t(rpc::kMaxMessageBytes) / 2) {
    return Fail(absl::StrCat("--chunk-bytes must be in (0, ", rpc::kMaxMessageBytes / 2, "]"));
  }
  options.chunk_bytes = *chunk;
  auto staging = ParseBytes(absl::GetFlag(FLAGS_staging_bytes));
  if (!staging.ok() || *staging == 0) return Fail("--staging-bytes must be a byte size above 0");
  options.defaults.staging_bytes = *staging;
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
    std::cerr << "kvbankd: --no-auth: every caller is the same tenant\n";
  }

  auto registry = std::make_shared<ModelRegistry>(max_pool);
  for (const auto& s : *specs) {
    auto c = rpc::ToModelConfig(s, options.defaults);
    if (!c.ok()) return Fail(absl::StrCat("model '", s.name(), "': ", c.status().message()));
    auto r = registry->Ensure(*std::move(c));
    if (!r.ok()) return Fail(std::string(r.status().message()));
    auth.ApplyQuotas(*r->model);
    std::cerr << "kvbankd: model '" << s.name() << "': " << r->model->pool().num_blocks()
              << " blocks of " << r->model->block_layout().block_bytes << " bytes ("
              << r->model->pool().num_blocks() * r->model->layout().block_tokens << " tokens), "
              << r->model->pool().memory().name() << " memory\n";
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
  if (std::string path = absl::GetFlag(FLAGS_shm_socket); !path.empty()) {
    plane::ShmOptions shm;
    shm.socket_path = path;
    auto max_region = ParseBytes(absl::GetFlag(FLAGS_shm_max_region_bytes));
    if (!max_region.ok() || *max_region == 0) {
      return Fail("--shm-max-region-bytes must be a byte size above 0");
    }
    shm.max_region_bytes = *max_region;
    shm.max_regions = absl::GetFlag(FLAGS_shm_max_regions);
    auto regions = plane::ShmRegions::Start(shm);
    if (!regions.ok()) return Fail(std::string(regions.status().message()));
    options.shm_regions = *std::move(regions);
    std::cerr << "kvbankd: shared-memory plane on " << path << " (regions up to " << *max_region
              << " bytes, at most " << shm.max_regions << ")" << std::endl;
  }
  if (on_gpu) {
    plane::CudaIpcOptions ipc;
    ipc.device = device->cuda_device;
    ipc.lease = absl::Milliseconds(std::max<uint32_t>(absl::GetFlag(FLAGS_cuda_ipc_lease_ms), 1));
    ipc.max_regions = absl::GetFlag(FLAGS_cuda_ipc_max_regions);
    options.cuda_ipc = std::make_shared<plane::CudaIpcRegions>(ipc);
    std::cerr << "kvbankd: CUDA IPC plane on " << device->Name() << " (lease "
              << absl::GetFlag(FLAGS_cuda_ipc_lease_ms) << " ms)" << std::endl;
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
      std::cerr << "kvbankd: NCCL plane on " << device->Name() << " (at most " << nccl.max_comms
                << " communicators)" << std::endl;
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
  serving_options.credentials = *credentials;
  serving_options.max_connections = absl::GetFlag(FLAGS_max_connections);
  serving_options.grpc_memory_bytes = *grpc_memory;
  serving_options.max_connection_idle =
      absl::Milliseconds(absl::GetFlag(FLAGS_max_connection_idle_ms));
  serving_options.keepalive_time = absl::Milliseconds(absl::GetFlag(FLAGS_keepalive_time_ms));
  auto counter = std::make_unique<rpc::CallCounter>();
  const rpc::CallCounter& calls = *counter;
  serving_options.interceptors.push_back(std::move(counter));
  auto serving = rpc::Serving::Start(&service, std::move(serving_options));
  if (!serving.ok()) {
    return Fail(absl::StrCat("cannot listen on ", absl::GetFlag(FLAGS_listen), ": ",
                             serving.status().message()));
  }
  const int port = (*serving)->port();
  std::cerr << "kvbankd: serving kvbank.v1 on " << absl::GetFlag(FLAGS_listen) << " (port " << port
            << "; at most " << (*serving)->max_connections() << " connections, descriptor limit "
            << (*serving)->descriptor_limit() << ")" << std::endl;
  if (std::string pf = absl::GetFlag(FLAGS_port_file); !pf.empty()) {
    const std::string tmp = pf + ".tmp";
    std::ofstream(tmp) << port << "\n";
    std::rename(tmp.c_str(), pf.c_str());  // readers never see a half-written file
  }

  absl::Notification stop;
  std::thread reaper([&] {
    const absl::Duration every = absl::Milliseconds(absl::GetFlag(FLAGS_lease_check_ms));
    bool accepting = true;
    absl::Time last_trim = absl::Now();
    while (!stop.WaitForNotificationWithTimeout(every)) {
      // Health reports a listener that cannot take connections (out of descriptors).
      if (bool now = (*serving)->listener().accepting(); now != accepting) {
        accepting = now;
        (*serving)->SetServing(now);
        std::cerr << "kvbankd: health: "
                  << (now ? "SERVING (accepting connections again)"
                          : "NOT_SERVING (cannot accept connections)")
                  << std::endl;
      }
      if (size_t n = registry->ExpireLeases(absl::Now()); n > 0) {
        std::cerr << "kvbankd: " << n << " lease(s) expired; their sequences were freed\n";
      }
      registry->ExpireCache(absl::Now());
      if (cuda_ipc != nullptr) {
        if (size_t n = cuda_ipc->Sweep(absl::Now()); n > 0) {
          std::cerr << "kvbankd: " << n
                    << " CUDA IPC device region(s) unused for the lease; closed\n";
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
  std::cerr << "kvbankd: signal " << sig << ": draining calls in flight" << std::endl;
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
  for (;;) {
    in_flight = calls.in_flight();
    unacked = in_flight > 0 ? 0 : rpc::UnackedBytesOnPort(port);
    if ((in_flight == 0 && unacked == 0) || absl::Now() >= deadline) break;
    absl::SleepFor(absl::Milliseconds(2));
  }
  if (in_flight > 0 || unacked > 0) {
    std::cerr << "kvbankd: drain timed out with " << in_flight << " call(s) in flight and "
              << unacked << " byte(s) not acknowledged; cancelling" << std::endl;
  }
  // Nothing is in flight and the clients have every byte (or the drain timed out): cancel what
  // is left and close the connections now.
  (*serving)->Stop();
  if (shm_regions != nullptr) unlink(shm_regions->options().socket_path.c_str());
  std::cerr << "kvbankd: stopped" << std::endl;
  // Every call is done and every pool is quiescent; skip the library teardown, in which gRPC 1.51
  // sometimes waits ~10 s for one of its internal threads.
  std::fflush(nullptr);
  std::_Exit(0);
}

}  // namespace
}  // namespace kvbank

int main(int argc, char** argv) { return kvbank::Main(argc, argv); }
