// One model's cached blocks, found by prefix hash: look-ups (Match), reads by hash
// (FetchBlocks), pins, the cache's TTL, and the tiers below the pool: promotion back into it
// (Promote, Prefetch), the spill-ahead thread that copies the coldest blocks down before they
// are evicted, and the warm-restart flush to disk. Sequences publish into it and attach from it
// (SequenceStore); this part owns no sequence.
#ifndef KVBANK_SERVER_CORE_PREFIX_CACHE_H_
#define KVBANK_SERVER_CORE_PREFIX_CACHE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kvbank/layout.h"
#include "kvbank/prefix_hash.h"
#include "server/core/block_pool.h"
#include "server/core/fetch_reader.h"
#include "server/core/kv_events.h"
#include "server/core/store_tenants.h"
#include "server/core/tiers.h"
#include "server/core/transfer_planner.h"

namespace kvbank {

// Where a prompt's leading cached tokens are: the pool, then the tiers below it (in that order
// along the prompt). tokens = pool + host + disk: what a Create with the prompt attaches.
struct MatchResult {
  uint64_t tokens = 0;
  uint64_t pool_tokens = 0, host_tokens = 0, disk_tokens = 0;
};

// A batched, side-effect-free look-up: how many leading tokens of a prompt are cached.
struct MatchQuery {
  std::vector<uint32_t> tokens;   // either token ids (hashed with the caller's root) ...
  std::vector<BlockHash> hashes;  // ... or block hashes the caller computed
  std::string cache_salt;
  std::vector<ExtraKey> extra_keys;
};

// Thread-safe; no lock of its own (the pool's and the tiers' guard what it reads). Every call
// names the caller's tenant: another tenant's blocks are never seen.
class PrefixCache {
 public:
  struct Options {
    HashAlgorithm hash = HashAlgorithm::kSha256;
    absl::Duration ttl = absl::ZeroDuration();  // of cached blocks; zero: they never age out
  };
  // Everything but `options` must outlive this (the store owns them); `tiers` and `events`
  // may be null. With tiers that spill ahead, starts the spill thread.
  PrefixCache(const TransferPlanner* planner, BlockPool* pool, TierCache* tiers, KvEventLog* events,
              StoreTenants* tenants, Options options);
  ~PrefixCache();  // stops the spill thread
  PrefixCache(const PrefixCache&) = delete;
  PrefixCache& operator=(const PrefixCache&) = delete;

  TierCache* tiers() const { return tiers_; }
  KvEventLog* events() const { return events_; }
  // The root hash of `tenant`'s prompts with this salt (what a router computes hashes from).
  BlockHash Root(const std::string& tenant, const std::string& cache_salt) const;

  // Cached tokens at the start of each prompt, for `tenant`, in the pool or a tier below it. No
  // side effects.
  std::vector<uint64_t> Match(const std::string& tenant, const std::vector<MatchQuery>& queries);
  // The same, with where the tokens are.
  std::vector<MatchResult> MatchTiers(const std::string& tenant,
                                      const std::vector<MatchQuery>& queries);
  // A reader over the longest run of leading `hashes` that `tenant` has cached: full blocks,
  // the layers, heads and dtype of `ask`. NOT_FOUND when not even the first is cached. No side
  // effects on the eviction order. device_dest: as FetchSpec's (the reader stages nothing on
  // the host; its payload goes to device memory with ReadToDevice).
  absl::StatusOr<std::unique_ptr<FetchReader>> FetchBlocks(
      const std::string& tenant, const std::vector<BlockHash>& hashes, uint32_t layer_begin,
      std::optional<uint32_t> layer_end, std::optional<DType> dtype = std::nullopt,
      uint32_t kv_head_begin = 0, std::optional<uint32_t> kv_head_end = std::nullopt,
      bool device_dest = false);
  // Pins (pin) or unpins the tenant's cached blocks with these hashes; returns how many matched
  // (a pin past the tenant's quota is not taken: pinned blocks count on it).
  size_t Pin(const std::string& tenant, const std::vector<BlockHash>& hashes, bool pin);
  // Drops cached blocks older than the TTL (if one is set); returns how many.
  size_t ExpireCache(absl::Time now);
  // Drops every unpinned cached block.
  size_t ClearCache() { return pool_->ClearCache(); }

  // Brings the blocks of `hashes` that follow its leading run in the pool and sit in a tier
  // below back into the pool, published (one allocation, disk reads in parallel), stopping at
  // the first block in neither. Answers references on the whole leading run now in the pool,
  // which the caller holds until it attached them. Call with no lock held: it reads disks.
  // touch false: the run already in the pool keeps its place in the eviction order (a read by
  // hash, not a reuse). Without a block to promote it takes no reference and answers nothing.
  // *promoted (when not null): how many blocks it brought up.
  std::vector<BlockRef> Promote(const std::string& tenant, absl::Span<const BlockHash> hashes,
                                bool touch = true, size_t* promoted = nullptr);
  // Promotes the queries' blocks (as a Create with the prompt would, without a sequence): they
  // are cached in the pool afterwards. Returns how many blocks it promoted. Blocks (disk
  // reads): call off any thread that must not wait.
  size_t Prefetch(const std::string& tenant, const std::vector<MatchQuery>& queries);
  // Warm restart: stops the spill thread, writes every cached block of the pool (then the host
  // tier's) that the disk tier lacks to it, until `deadline`, waits for queued writes and syncs
  // the file. Returns how many blocks were written; 0 without a disk tier. Meant for after a
  // drain: appends and promotions still running may or may not make it.
  size_t FlushToDisk(absl::Time deadline);

 private:
  // Spill-ahead: while the pool is nearly full, its coldest cached blocks are copied down a
  // tier before they are evicted, so evictions copy nothing on the caller's path.
  void SpillLoop();
  void StopSpilling();

  const TransferPlanner* const planner_;
  BlockPool* const pool_;
  TierCache* const tiers_;
  KvEventLog* const events_;
  StoreTenants* const tenants_;
  const Options options_;
  const std::string fingerprint_;
  absl::Notification spill_stop_;
  std::thread spiller_;
};

}  // namespace kvbank

#endif  // KVBANK_SERVER_CORE_PREFIX_CACHE_H_
