#include "server/kvbankd/config.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/log.h"
#include "google/protobuf/text_format.h"
#include "server/core/tiers.h"
#include "server/kvbankd/flags.h"
#include "server/plane/cuda_ipc.h"
#include "server/plane/nccl_plane.h"
#include "server/plane/shm_regions.h"
#include "server/rpc/convert.h"

namespace kvbank::kvbankd {

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

bool IsLoopback(const std::string& address) {
  const std::string host = address.substr(0, address.rfind(':'));
  return absl::StartsWith(host, "127.") || host == "localhost" || host == "[::1]";
}

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

absl::StatusOr<MemoryBudget> ConfigurePools(const DeviceSpec& device, size_t num_models,
                                            rpc::ServiceOptions* options,
                                            std::shared_ptr<TierFolder>* tier_folder) {
  options->defaults.device = device;
  const bool on_gpu = device.kind == MemoryKind::kCuda;
  MemoryBudget budget;
  const double util = absl::GetFlag(FLAGS_gpu_memory_utilization);
  if (!(util > 0 && util <= 1))
    return absl::InvalidArgumentError("--gpu-memory-utilization must be in (0, 1]");
  // Host memory this process may use: physical memory, or less under a cgroup limit (a
  // container's): pools sized from it fit the pod's memory limit.
  budget.host = HostMemoryLimit(PhysicalMemoryBytes());
  budget.max_pool_bytes = budget.host.bytes / 10 * 8;
  budget.source = absl::StrCat("80% of ", budget.host.source);
  if (on_gpu) {
    uint64_t free_bytes = 0, total_bytes = 0;
    if (absl::Status s = CudaMemoryInfo(device.cuda_device, &free_bytes, &total_bytes); !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--device ", device.Name(), ": ", s.message()));
    }
    // As vLLM's gpu_memory_utilization: this process may hold util x total; what others (or the
    // CUDA context) hold already comes off it.
    const double room = util * double(total_bytes) - double(total_bytes - free_bytes);
    if (room < double(64 << 20)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--gpu-memory-utilization ", util, " of ", total_bytes, " bytes leaves no room: ",
          total_bytes - free_bytes, " bytes are in use on ", device.Name()));
    }
    budget.max_pool_bytes = static_cast<uint64_t>(room);
    budget.source =
        absl::StrCat("--gpu-memory-utilization ", util, " of ", device.Name(), "'s ", total_bytes,
                     " bytes less ", total_bytes - free_bytes, " in use (", free_bytes, " free)");
  }
  if (std::string b = absl::GetFlag(FLAGS_pool_bytes); !b.empty()) {
    auto pool_bytes = ParseBytes(b);
    if (!pool_bytes.ok())
      return absl::InvalidArgumentError(
          absl::StrCat("--pool-bytes: ", pool_bytes.status().message()));
    options->defaults.pool_bytes = *pool_bytes;
  } else if (on_gpu) {
    options->defaults.pool_bytes = budget.max_pool_bytes / std::max<size_t>(num_models, 1);
  } else {
    // 1 GiB, or less where the memory limit leaves less for the models registered at start.
    options->defaults.pool_bytes = std::min<uint64_t>(
        uint64_t{1} << 30, budget.max_pool_bytes / std::max<size_t>(num_models, 1));
  }
  if (double f = absl::GetFlag(FLAGS_pool_memory_fraction); f > 0) {
    if (on_gpu)
      return absl::InvalidArgumentError(
          "--pool-memory-fraction is for host memory; use --gpu-memory-utilization");
    if (f > 0.95) return absl::InvalidArgumentError("--pool-memory-fraction must be at most 0.95");
    options->defaults.pool_bytes = static_cast<uint64_t>(f * double(budget.host.bytes));
  }
  if (std::string m = absl::GetFlag(FLAGS_max_pool_bytes); !m.empty()) {
    auto v = ParseBytes(m);
    if (!v.ok())
      return absl::InvalidArgumentError(absl::StrCat("--max-pool-bytes: ", v.status().message()));
    budget.max_pool_bytes = *v;
    budget.source = "--max-pool-bytes";
  }
  auto chunk = ParseBytes(absl::GetFlag(FLAGS_chunk_bytes));
  if (!chunk.ok() || *chunk == 0 || *chunk > uint64_t(rpc::kMaxMessageBytes) / 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("--chunk-bytes must be in (0, ", rpc::kMaxMessageBytes / 2, "]"));
  }
  options->chunk_bytes = *chunk;
  auto staging = ParseBytes(absl::GetFlag(FLAGS_staging_bytes));
  if (!staging.ok() || *staging == 0)
    return absl::InvalidArgumentError("--staging-bytes must be a byte size above 0");
  options->defaults.staging_bytes = *staging;
  if (std::string b = absl::GetFlag(FLAGS_host_tier_bytes); !b.empty()) {
    auto host_tier = ParseBytes(b);
    if (!host_tier.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--host-tier-bytes: ", host_tier.status().message()));
    }
    options->defaults.tiers.host_bytes = *host_tier;
  }
  if (std::string path = absl::GetFlag(FLAGS_disk_tier_path); !path.empty()) {
    auto disk_tier = ParseBytes(absl::GetFlag(FLAGS_disk_tier_bytes));
    if (!disk_tier.ok() || *disk_tier == 0) {
      return absl::InvalidArgumentError("--disk-tier-bytes must be a byte size above 0");
    }
    options->defaults.tiers.disk_path = path;
    options->defaults.tiers.disk_bytes = *disk_tier;
    // Held (locked) from the start, models or not: a second kvbankd on the folder fails now,
    // not when a model is registered.
    auto folder = TierFolder::Open(path);
    if (!folder.ok())
      return absl::InvalidArgumentError(
          absl::StrCat("--disk-tier-path: ", folder.status().message()));
    *tier_folder = *std::move(folder);
  }
  options->defaults.tiers.direct_io = absl::GetFlag(FLAGS_disk_tier_direct_io);
  options->defaults.tiers.io_threads = std::max<uint32_t>(1, absl::GetFlag(FLAGS_tier_io_threads));
  StoreOptions& store = options->defaults.store;
  store.max_sequences = absl::GetFlag(FLAGS_max_sequences);
  store.max_tokens_per_sequence = absl::GetFlag(FLAGS_max_tokens_per_sequence);
  store.default_lease = absl::Milliseconds(absl::GetFlag(FLAGS_default_lease_ms));
  store.max_lease = absl::Milliseconds(absl::GetFlag(FLAGS_max_lease_ms));
  store.prefix_cache_ttl = absl::Milliseconds(absl::GetFlag(FLAGS_prefix_cache_ttl_ms));
  if (!ParseHashAlgorithm(absl::GetFlag(FLAGS_hash_algorithm), &store.hash)) {
    return absl::InvalidArgumentError("--hash-algorithm must be sha256 or xxh3_128");
  }
  options->defaults.enable_prefix_caching = absl::GetFlag(FLAGS_enable_prefix_caching);
  log::Info("memory_budget")
          .Field("max_pool_bytes", budget.max_pool_bytes)
          .Field("source", budget.source)
          .Field("default_pool_bytes", options->defaults.pool_bytes)
          .Field("host_memory_bytes", budget.host.bytes)
          .Field("host_memory_source", budget.host.source)
      << "memory budget: " << budget.max_pool_bytes << " bytes for all pools (" << budget.source
      << "); a model's pool " << options->defaults.pool_bytes << " bytes by default";
  return budget;
}

absl::StatusOr<rpc::Authenticator> AuthenticatorFromFlags() {
  rpc::Authenticator auth = rpc::Authenticator::Disabled();
  if (std::string path = absl::GetFlag(FLAGS_auth_tokens_file); !path.empty()) {
    if (absl::GetFlag(FLAGS_no_auth)) {
      return absl::InvalidArgumentError("give --auth-tokens-file or --no-auth, not both");
    }
    auto a = rpc::Authenticator::FromFile(path);
    if (!a.ok()) return a.status();
    auth = *std::move(a);
  } else if (!absl::GetFlag(FLAGS_no_auth)) {
    return absl::InvalidArgumentError(
        "authentication needs --auth-tokens-file FILE; --no-auth serves without it");
  } else {
    log::Warn("no_auth") << "--no-auth: every caller is the same tenant";
  }
  return auth;
}

absl::Status RegisterModels(const std::vector<v1::ModelSpec>& specs,
                            const rpc::ModelDefaults& defaults, const rpc::Authenticator& auth,
                            ModelRegistry* registry) {
  for (const auto& s : specs) {
    auto c = rpc::ToModelConfig(s, defaults);
    if (!c.ok())
      return absl::InvalidArgumentError(
          absl::StrCat("model '", s.name(), "': ", c.status().message()));
    auto r = registry->Ensure(*std::move(c));
    if (!r.ok()) return r.status();
    auth.ApplyQuotas(*r->model);
    const uint64_t blocks = r->model->pool().num_blocks();
    log::Info("model_registered")
            .Field("model", s.name())
            .Field("blocks", blocks)
            .Field("block_bytes", r->model->pool().layout().block_bytes)
            .Field("tokens", blocks * r->model->layout().block_tokens)
            .Field("memory", r->model->pool().memory().name())
        << "model '" << s.name() << "': " << blocks << " blocks of "
        << r->model->pool().layout().block_bytes << " bytes ("
        << blocks * r->model->layout().block_tokens << " tokens), "
        << r->model->pool().memory().name() << " memory";
    if (const TierCache* t = r->model->prefix().tiers(); t != nullptr) {
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
  return absl::OkStatus();
}

absl::Status ConfigureService(const DeviceSpec& device, const rpc::Authenticator& auth,
                              rpc::ServiceOptions* options) {
  const bool on_gpu = device.kind == MemoryKind::kCuda;
  options->stream_idle_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_stream_idle_timeout_ms));
  options->replica_name = absl::GetFlag(FLAGS_replica_name);
  if (char host[256] = {};
      options->replica_name.empty() && gethostname(host, sizeof(host) - 1) == 0) {
    options->replica_name = host;
  }
  std::getline(std::ifstream("/proc/sys/kernel/random/boot_id"), options->host_id);
  // One ledger of what each tenant holds of every server-wide cap (the service's queues, waits
  // and streams; the planes' regions and communicators): each tenant of the tokens file gets
  // its share of each.
  options->device_workers = std::max<uint32_t>(1, absl::GetFlag(FLAGS_device_workers));
  options->region_copy_helpers = absl::GetFlag(FLAGS_region_copy_helpers);
  auto lone = ParseBytes(absl::GetFlag(FLAGS_shm_lone_copy_bytes));
  if (!lone.ok()) return absl::InvalidArgumentError("--shm-lone-copy-bytes must be a byte size");
  options->lone_listener_copy_bytes = *lone;
  options->ledger = rpc::DefaultLedger();
  options->ledger->SetTenants(auth.Tenants());
  options->ledger->SetCap(Resource::kQueuedWork, absl::GetFlag(FLAGS_max_queued_work));
  options->ledger->SetCap(Resource::kQueuedBackground, absl::GetFlag(FLAGS_max_queued_prefetch));
  options->ledger->SetCap(Resource::kWatchStreams, absl::GetFlag(FLAGS_max_watch_streams));
  options->ledger->SetCap(Resource::kWaits, absl::GetFlag(FLAGS_max_waits));
  std::string shm_path = absl::GetFlag(FLAGS_shm_socket);
  const bool shm_auto = shm_path == "auto";
  if (shm_auto) {
    // On by default: the same-host clients then move payloads through shared memory with no
    // flag. A folder that is not safe to use turns it off, said once.
    auto path = plane::DefaultShmSocketPath();
    if (path.ok()) {
      shm_path = *path;
    } else {
      log::Warn("plane").Field("plane", "shm")
          << "shared-memory plane off: " << path.status().message();
      shm_path.clear();
    }
  }
  if (std::string path = shm_path; !path.empty()) {
    plane::ShmOptions shm;
    shm.socket_path = path;
    auto total = ParseBytes(absl::GetFlag(FLAGS_shm_max_total_bytes));
    if (!total.ok() || *total == 0)
      return absl::InvalidArgumentError("--shm-max-total-bytes must be a byte size above 0");
    shm.max_total_bytes = *total;
    shm.ledger = options->ledger;
    options->ledger->SetCap(Resource::kShmRegions, absl::GetFlag(FLAGS_shm_max_regions));
    options->ledger->SetCap(Resource::kShmRegionBytes, *total);
    auto max_region = ParseBytes(absl::GetFlag(FLAGS_shm_max_region_bytes));
    if (!max_region.ok() || *max_region == 0) {
      return absl::InvalidArgumentError("--shm-max-region-bytes must be a byte size above 0");
    }
    shm.max_region_bytes = *max_region;
    shm.max_regions = absl::GetFlag(FLAGS_shm_max_regions);
    shm.spin = absl::Microseconds(absl::GetFlag(FLAGS_shm_control_spin_us));
    auto regions = plane::ShmRegions::Start(shm);
    if (!regions.ok()) return regions.status();
    options->shm_regions = *std::move(regions);
    log::Info("plane").Field("plane", "shm").Field("socket", path)
        << "shared-memory plane on " << path
        << (shm_auto ? " (the default; --shm-socket= turns it off)" : "") << " (regions up to "
        << *max_region << " bytes, at most " << shm.max_regions << ")";
  } else {
    log::Info("plane").Field("plane", "shm") << "shared-memory plane off";
  }
  if (on_gpu) {
    plane::CudaIpcOptions ipc;
    ipc.device = device.cuda_device;
    ipc.lease = absl::Milliseconds(std::max<uint32_t>(absl::GetFlag(FLAGS_cuda_ipc_lease_ms), 1));
    ipc.max_regions = absl::GetFlag(FLAGS_cuda_ipc_max_regions);
    ipc.ledger = options->ledger;
    options->ledger->SetCap(Resource::kDeviceRegions, ipc.max_regions);
    options->cuda_ipc = std::make_shared<plane::CudaIpcRegions>(ipc);
    log::Info("plane").Field("plane", "cuda_ipc").Field("device", device.Name())
        << "CUDA IPC plane on " << device.Name() << " (lease "
        << absl::GetFlag(FLAGS_cuda_ipc_lease_ms) << " ms)";
  }
  if (!plane::NcclBuiltIn()) {
    options->nccl_off = "kvbankd was built without NCCL (it needs CUDA and libnccl at build time)";
  } else if (!on_gpu) {
    options->nccl_off = absl::StrCat("kvbankd's pools are in ", device.Name(),
                                     " memory; the NCCL plane needs a CUDA pool (--device cuda:N)");
  } else {
    plane::NcclOptions nccl;
    nccl.device = device.cuda_device;
    nccl.max_comms = absl::GetFlag(FLAGS_nccl_max_comms);
    nccl.ledger = options->ledger;
    options->ledger->SetCap(Resource::kNcclComms, nccl.max_comms);
    auto max_transfer = ParseBytes(absl::GetFlag(FLAGS_nccl_max_transfer_bytes));
    if (!max_transfer.ok() || *max_transfer == 0) {
      return absl::InvalidArgumentError("--nccl-max-transfer-bytes must be a byte size above 0");
    }
    nccl.max_transfer_bytes = *max_transfer;
    nccl.init_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_nccl_init_timeout_ms));
    nccl.transfer_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_nccl_transfer_timeout_ms));
    nccl.idle_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_nccl_idle_timeout_ms));
    auto created = plane::NcclPlane::Create(nccl);
    if (created.ok()) {
      options->nccl = *std::move(created);
      log::Info("plane").Field("plane", "nccl").Field("device", device.Name())
          << "NCCL plane on " << device.Name() << " (at most " << nccl.max_comms
          << " communicators)";
    } else {
      options->nccl_off = absl::StrCat("the NCCL plane is off: ", created.status().message());
    }
  }
  return absl::OkStatus();
}

}  // namespace kvbank::kvbankd
