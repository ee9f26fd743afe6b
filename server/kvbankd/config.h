// kvbankd's start-up configuration, read from its flags (flags.h): the memory budget and the
// pools' defaults, the models registered at start, authentication, the server-wide caps and the
// data planes. Each step answers INVALID_ARGUMENT (or the failing component's status) naming the
// flag at fault; kvbankd then stops before serving anything.
#ifndef KVBANK_SERVER_KVBANKD_CONFIG_H_
#define KVBANK_SERVER_KVBANKD_CONFIG_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kvbank/v1/kvbank.pb.h"
#include "server/core/memory_limit.h"
#include "server/core/model_registry.h"
#include "server/core/pool_memory.h"
#include "server/core/tier_folder.h"
#include "server/rpc/auth.h"
#include "server/rpc/service.h"

namespace kvbank::kvbankd {

// "1GiB", "512MiB", "4096", "2GB" -> bytes.
absl::StatusOr<uint64_t> ParseBytes(std::string text);

// Whether a --listen address only takes connections from this host.
bool IsLoopback(const std::string& address);

// The models registered at start: the --models presets, then the --config file's.
absl::StatusOr<std::vector<v1::ModelSpec>> StartupModels();

// What all pools together may hold, and where that figure comes from (for the log).
struct MemoryBudget {
  uint64_t max_pool_bytes = 0;
  std::string source;
  MemoryLimit host;  // the host memory this process may use
};

// The memory budget for pools on `device` and the pools' defaults in options->defaults (size,
// staging, tiers, store options). With --disk-tier-path, *tier_folder holds the disk tier's
// folder, locked from now on, so a second kvbankd on it fails at start.
absl::StatusOr<MemoryBudget> ConfigurePools(const DeviceSpec& device, size_t num_models,
                                            rpc::ServiceOptions* options,
                                            std::shared_ptr<TierFolder>* tier_folder);

// --auth-tokens-file, or --no-auth (one of the two is required).
absl::StatusOr<rpc::Authenticator> AuthenticatorFromFlags();

// Registers `specs` in `registry` with `defaults`, each with its tenants' quotas from `auth`, and
// logs each model (and its tiers).
absl::Status RegisterModels(const std::vector<v1::ModelSpec>& specs,
                            const rpc::ModelDefaults& defaults, const rpc::Authenticator& auth,
                            ModelRegistry* registry);

// The service's limits and server-wide caps (a ledger with every tenant of `auth`), and the
// data planes the flags and `device` allow: the shared-memory plane (--shm-socket), CUDA IPC and
// NCCL (a cuda:N pool; NCCL off, with the reason in options->nccl_off, where it cannot run).
absl::Status ConfigureService(const DeviceSpec& device, const rpc::Authenticator& auth,
                              rpc::ServiceOptions* options);

}  // namespace kvbank::kvbankd

#endif  // KVBANK_SERVER_KVBANKD_CONFIG_H_
