#include "server/kvbankd/flags.h"

#include <algorithm>
#include <cstdint>
#include <iostream>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/command_line.h"
#include "server/rpc/service.h"  // the defaults of the server-wide caps

// kvbankd's flags (--help lists them sorted by name).
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
ABSL_FLAG(std::string, shm_socket, "auto",
          "same-host shared-memory plane: listen for memfd regions and their transfers on this "
          "Unix socket path (mode 0600; a stale file is replaced, one a server answers on is "
          "refused). auto: kvbankd-<pid>.sock in $XDG_RUNTIME_DIR/kvbank, else /tmp/kvbank-<uid> "
          "(a folder of mode 0700); empty (--shm-socket=): off");
ABSL_FLAG(std::string, shm_max_region_bytes, "64GiB",
          "largest shared-memory region a client may register");
ABSL_FLAG(uint32_t, shm_max_regions, 256,
          "most shared-memory regions (each one socket connection) registered or pending at once");
ABSL_FLAG(uint32_t, shm_control_spin_us, 50,
          "after a round of control frames it answered itself (small transfers), the "
          "shared-memory listener looks for the next frame this many microseconds without "
          "sleeping, so that back-to-back small transfers find it awake (that much CPU time at "
          "most after such a round; 0: always sleep)");
ABSL_FLAG(std::string, shm_lone_copy_bytes, "4MiB",
          "a control-frame transfer on host memory of at most this many bytes is copied on the "
          "shared-memory listener itself when it is the only one under way (no hand-off to a "
          "device worker, no wake-up); up to 256KiB always are; 0: only those");
ABSL_FLAG(
    uint32_t, cuda_ipc_lease_ms, 60000,
    "CUDA IPC plane (a cuda:N pool): a device region no Append / Fetch names for this long is "
    "closed (cudaIpcCloseMemHandle); the client registers again");
ABSL_FLAG(uint32_t, cuda_ipc_max_regions, 256, "most CUDA IPC device regions registered at once");
ABSL_FLAG(std::string, shm_max_total_bytes, "1TiB",
          "most bytes of shared-memory regions registered at once, all tenants together");
ABSL_FLAG(uint32_t, device_workers, 4,
          "threads that run device copies, disk reads and region copies (fair across tenants)");
ABSL_FLAG(uint32_t, region_copy_helpers, 1,
          "device workers that help copy one fetch into, or one append from, a shared-memory "
          "region of 1 MiB or more, when no other such copy is under way (taken only when "
          "idle; 0: one thread a copy)");
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

std::string Dashed(std::string name) {
  std::replace(name.begin(), name.end(), '_', '-');
  return name;
}

std::string Underscored(std::string name) {
  std::replace(name.begin(), name.end(), '-', '_');
  return name;
}

// What a flag's value is, for the help text: by its name where that says more than its type.
std::string ValueName(const std::string& name, const absl::CommandLineFlag& flag) {
  if (flag.IsOfType<bool>()) return "";  // a switch
  if (name == "listen") return "HOST:PORT";
  if (absl::EndsWith(name, "-bytes")) return "SIZE";
  if (absl::EndsWith(name, "-ms")) return "MS";
  if (absl::EndsWith(name, "-file") || absl::StartsWith(name, "tls-") || name == "config") {
    return "PATH";
  }
  if (flag.IsOfType<double>()) return "X";
  if (flag.IsOfType<std::string>()) return "TEXT";
  return "N";
}

// What a value of the flag's type looks like, for an error about a bad one.
std::string Expected(const absl::CommandLineFlag& flag) {
  if (flag.IsOfType<bool>()) return "true or false";
  if (flag.IsOfType<double>()) return "a number";
  if (flag.IsOfType<uint64_t>()) return "an integer >= 0";
  return "an integer";
}

// Every flag of this program, sorted by name; Abseil's own (--flagfile, --fromenv, ...) are left
// out: kvbankd reads no flag files.
std::vector<cmdline::FlagSpec> ServerFlagSpecs() {
  std::vector<cmdline::FlagSpec> specs;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (absl::StrContains(flag->Filename(), "absl/flags/")) continue;
    cmdline::FlagSpec s;
    s.name = Dashed(std::string(name));
    s.help = flag->Help();
    s.default_value = flag->DefaultValue();  // empty strings: the help says what happens
    s.value_name = ValueName(s.name, *flag);
    specs.push_back(std::move(s));
  }
  std::sort(specs.begin(), specs.end(),
            [](const cmdline::FlagSpec& a, const cmdline::FlagSpec& b) { return a.name < b.name; });
  return specs;
}

int UsageError(const std::string& what) {
  std::cerr << "kvbankd: " << what << "\nkvbankd --help lists every flag\n";
  return 2;
}

}  // namespace

std::optional<int> ParseServerFlags(int argc, char** argv, const std::string& usage) {
  const std::vector<cmdline::FlagSpec> specs = ServerFlagSpecs();
  const std::vector<std::string> args(argv + std::min(argc, 1), argv + argc);
  auto parsed = cmdline::Parse(args, specs);
  if (!parsed.ok()) return UsageError(std::string(parsed.status().message()));
  if (parsed->help) {
    std::cout << usage << "\n\nFlags (--name=value or --name value; a switch is on when given "
              << "bare, --name=false turns it off):\n"
              << cmdline::FormatFlags(specs);
    std::cout.flush();
    return 0;
  }
  if (!parsed->positional.empty()) {
    return UsageError(absl::StrCat("unexpected argument '", parsed->positional[0],
                                   "' (kvbankd takes flags only)"));
  }
  for (const auto& [name, value] : parsed->values) {
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(Underscored(name));
    std::string error;
    if (flag == nullptr) return UsageError(absl::StrCat("unknown flag --", name));
    if (!flag->ParseFrom(value, &error)) {
      return UsageError(
          absl::StrCat("--", name, ": '", value, "' is not a valid value (", Expected(*flag), ")"));
    }
  }
  return std::nullopt;
}

}  // namespace kvbank
