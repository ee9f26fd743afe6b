// The models one server holds, each with its own pool, budget and sequences.
#ifndef KVBANK_SERVER_CORE_MODEL_REGISTRY_H_
#define KVBANK_SERVER_CORE_MODEL_REGISTRY_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kvbank/layout.h"
#include "server/core/pool_memory.h"
#include "server/core/sequence_store.h"

namespace kvbank {

struct ModelConfig {
  ModelLayout layout;  // layout.name is the model's name
  uint64_t pool_bytes = 0;
  DeviceSpec device;                                     // where the pool's blocks live
  uint64_t staging_bytes = PoolOptions().staging_bytes;  // see PoolOptions
  StoreOptions store;
  bool enable_prefix_caching = true;
  size_t event_capacity = 65536;  // KV events kept for watchers to resume from
  // The tiers below the pool (none by default). A disk tier's file is named for the model and
  // its layout, so a restarted server with the same model finds its blocks again.
  TierOptions tiers;
};

struct EnsureResult {
  std::shared_ptr<SequenceStore> model;
  bool created = false;
};

// Thread-safe. A model lives until it is dropped or the registry goes, and after that as long as
// anyone holds its shared_ptr (calls in flight, watch streams): its pool memory is released, and
// its bytes return to the budget, when the last shared_ptr goes.
class ModelRegistry {
 public:
  // `total_pool_bytes` bounds the sum of every model's pool.
  explicit ModelRegistry(uint64_t total_pool_bytes) : total_pool_bytes_(total_pool_bytes) {}

  // Registers the model or returns the one already there with the same layout. A different
  // layout under the same name is ALREADY_EXISTS naming the first field that differs; an invalid
  // layout INVALID_ARGUMENT; a pool over the remaining budget RESOURCE_EXHAUSTED.
  absl::StatusOr<EnsureResult> Ensure(ModelConfig config);
  // NOT_FOUND naming the model when there is none.
  absl::StatusOr<std::shared_ptr<SequenceStore>> Get(const std::string& name) const;
  std::vector<std::shared_ptr<SequenceStore>> List() const;  // sorted by name
  // Removes the model: Get and List no longer find it from now on, and Ensure may register the
  // name again (a new, empty model). Its sequences are freed at once and every fetch waiting on
  // one ends FAILED_PRECONDITION (SequenceStore::Close); its cached blocks go with its store; the
  // store, its pool memory, and their share of the budget (pool_bytes_used) are released when
  // the last shared_ptr to it is dropped: at once when nothing holds it, else when the last call
  // in flight or watch stream on it ends. NOT_FOUND naming the model when there is none.
  absl::Status Drop(const std::string& name);
  // Expires leases in every model; returns how many sequences went.
  size_t ExpireLeases(absl::Time now) const;
  // Drops cached blocks past each model's prefix-cache TTL; returns how many.
  size_t ExpireCache(absl::Time now) const;
  // Bytes of every pool not yet released: registered models and dropped ones still held.
  uint64_t pool_bytes_used() const;

 private:
  const uint64_t total_pool_bytes_;
  // Shared with each store's deleter, which may run after the registry is gone.
  const std::shared_ptr<std::atomic<uint64_t>> pool_bytes_used_ =
      std::make_shared<std::atomic<uint64_t>>(0);
  mutable absl::Mutex mu_;  // serializes Ensure's check-and-reserve of the budget
  absl::flat_hash_map<std::string, std::shared_ptr<SequenceStore>> models_ ABSL_GUARDED_BY(mu_);
};

// The first field in which two layouts differ, for error messages ("" when equal).
std::string FirstLayoutDifference(const ModelLayout& a, const ModelLayout& b);

}  // namespace kvbank

#endif  // KVBANK_SERVER_CORE_MODEL_REGISTRY_H_
