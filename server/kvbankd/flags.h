// kvbankd's command line: its ABSL_FLAGs, read with the parser kvbank shares
// (common/command_line.h), so that both programs spell flags with dashes, refuse unknown ones
// with a suggestion and print help on stdout.
#ifndef KVBANK_SERVER_KVBANKD_FLAGS_H_
#define KVBANK_SERVER_KVBANKD_FLAGS_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/flags/declare.h"

// Defined in flags.cc, with their help text.
ABSL_DECLARE_FLAG(std::string, listen);
ABSL_DECLARE_FLAG(std::string, port_file);
ABSL_DECLARE_FLAG(std::string, health_listen);
ABSL_DECLARE_FLAG(std::string, health_port_file);
ABSL_DECLARE_FLAG(std::string, log_format);
ABSL_DECLARE_FLAG(uint32_t, log_errors_per_second);
ABSL_DECLARE_FLAG(std::string, device);
ABSL_DECLARE_FLAG(double, gpu_memory_utilization);
ABSL_DECLARE_FLAG(std::string, models);
ABSL_DECLARE_FLAG(std::string, config);
ABSL_DECLARE_FLAG(std::string, pool_bytes);
ABSL_DECLARE_FLAG(double, pool_memory_fraction);
ABSL_DECLARE_FLAG(std::string, max_pool_bytes);
ABSL_DECLARE_FLAG(uint64_t, max_sequences);
ABSL_DECLARE_FLAG(uint64_t, max_tokens_per_sequence);
ABSL_DECLARE_FLAG(int64_t, default_lease_ms);
ABSL_DECLARE_FLAG(int64_t, max_lease_ms);
ABSL_DECLARE_FLAG(int64_t, lease_check_ms);
ABSL_DECLARE_FLAG(std::string, chunk_bytes);
ABSL_DECLARE_FLAG(std::string, staging_bytes);
ABSL_DECLARE_FLAG(int64_t, drain_timeout_ms);
ABSL_DECLARE_FLAG(std::string, host_tier_bytes);
ABSL_DECLARE_FLAG(std::string, disk_tier_path);
ABSL_DECLARE_FLAG(std::string, disk_tier_bytes);
ABSL_DECLARE_FLAG(bool, disk_tier_direct_io);
ABSL_DECLARE_FLAG(uint32_t, tier_io_threads);
ABSL_DECLARE_FLAG(std::string, auth_tokens_file);
ABSL_DECLARE_FLAG(bool, no_auth);
ABSL_DECLARE_FLAG(bool, enable_prefix_caching);
ABSL_DECLARE_FLAG(int64_t, prefix_cache_ttl_ms);
ABSL_DECLARE_FLAG(uint64_t, max_connections);
ABSL_DECLARE_FLAG(int64_t, stream_idle_timeout_ms);
ABSL_DECLARE_FLAG(int64_t, max_connection_idle_ms);
ABSL_DECLARE_FLAG(int64_t, keepalive_time_ms);
ABSL_DECLARE_FLAG(std::string, grpc_memory_bytes);
ABSL_DECLARE_FLAG(std::string, hash_algorithm);
ABSL_DECLARE_FLAG(std::string, tls_cert);
ABSL_DECLARE_FLAG(std::string, tls_key);
ABSL_DECLARE_FLAG(std::string, replica_name);
ABSL_DECLARE_FLAG(std::string, shm_socket);
ABSL_DECLARE_FLAG(std::string, shm_max_region_bytes);
ABSL_DECLARE_FLAG(uint32_t, shm_max_regions);
ABSL_DECLARE_FLAG(uint32_t, shm_control_spin_us);
ABSL_DECLARE_FLAG(std::string, shm_lone_copy_bytes);
ABSL_DECLARE_FLAG(uint32_t, cuda_ipc_lease_ms);
ABSL_DECLARE_FLAG(uint32_t, cuda_ipc_max_regions);
ABSL_DECLARE_FLAG(std::string, shm_max_total_bytes);
ABSL_DECLARE_FLAG(uint32_t, device_workers);
ABSL_DECLARE_FLAG(uint32_t, region_copy_helpers);
ABSL_DECLARE_FLAG(uint64_t, max_queued_work);
ABSL_DECLARE_FLAG(uint64_t, max_queued_prefetch);
ABSL_DECLARE_FLAG(uint64_t, max_watch_streams);
ABSL_DECLARE_FLAG(uint64_t, max_waits);
ABSL_DECLARE_FLAG(uint32_t, nccl_max_comms);
ABSL_DECLARE_FLAG(std::string, nccl_max_transfer_bytes);
ABSL_DECLARE_FLAG(uint32_t, nccl_init_timeout_ms);
ABSL_DECLARE_FLAG(uint32_t, nccl_transfer_timeout_ms);
ABSL_DECLARE_FLAG(uint32_t, nccl_idle_timeout_ms);
ABSL_DECLARE_FLAG(std::string, tls_client_ca);
ABSL_DECLARE_FLAG(std::string, metrics_listen);
ABSL_DECLARE_FLAG(std::string, metrics_port_file);

namespace kvbank {

// Sets the program's ABSL_FLAGs from argv. Returns nothing when the server should go on; else the
// status to exit with: 0 after --help (every flag, its default and help, on stdout), 2 after a
// usage error (unknown flag, bad value, a positional argument), which is printed on stderr.
// REQUIRES: called once, from main, before any flag is read.
std::optional<int> ParseServerFlags(int argc, char** argv, const std::string& usage);

}  // namespace kvbank

#endif  // KVBANK_SERVER_KVBANKD_FLAGS_H_
