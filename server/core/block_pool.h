// The paged block pool: one aligned allocation of fixed-size blocks, with block records kept apart
// from the data, a free list, reference counts, the prefix index of published blocks and the
// eviction order of cached ones.
//
// A block is in exactly one state:
//   free        refcount 0, no hash, on the free list
//   cached      refcount 0, published (has a hash): kept for reuse, evictable unless pinned
//   referenced  refcount > 0 (published or not)
// so free + cached + referenced = total at every moment. A published block is immutable: writers
// copy it first (Writable() is false).
#ifndef KVBANK_SERVER_CORE_BLOCK_POOL_H_
#define KVBANK_SERVER_CORE_BLOCK_POOL_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kvbank/layout.h"
#include "kvbank/prefix_hash.h"
#include "server/core/core_lock.h"
#include "server/core/kv_events.h"
#include "server/core/pool_memory.h"

namespace kvbank {

class BlockPool;

// A counted reference to one block. Move-only; destroying or resetting it drops the reference.
// A BlockRef must not outlive its pool. Not thread-safe itself (one owner at a time); the pool
// it points to is.
class BlockRef {
 public:
  BlockRef() = default;
  BlockRef(BlockRef&& o) noexcept : pool_(o.pool_), id_(o.id_), touch_(o.touch_) {
    o.pool_ = nullptr;
    o.id_ = -1;
  }
  BlockRef& operator=(BlockRef&& o) noexcept;
  BlockRef(const BlockRef&) = delete;
  BlockRef& operator=(const BlockRef&) = delete;
  ~BlockRef() { Reset(); }

  bool valid() const { return pool_ != nullptr; }
  int32_t id() const { return id_; }
  void Reset();

 private:
  friend class BlockPool;
  BlockRef(BlockPool* pool, int32_t id, bool touch = true) : pool_(pool), id_(id), touch_(touch) {}
  BlockPool* pool_ = nullptr;
  int32_t id_ = -1;
  bool touch_ = true;  // false for a peek: releasing it leaves the eviction order as it was
};

struct PoolStats {
  uint64_t total = 0;
  uint64_t free = 0;
  uint64_t cached = 0;  // published, unreferenced (pinned ones included)
  uint64_t used = 0;    // referenced by at least one holder
  uint64_t pinned = 0;
  uint64_t evictions = 0;
};

struct PublishInfo;

// Where a cached block goes when the pool evicts it: a lower tier (server/core/tiers.h) keeps it
// instead of the block being forgotten.
class EvictionSink {
 public:
  virtual ~EvictionSink() = default;
  // A cached block is being evicted. `data` answers its block_bytes bytes in host memory (the
  // pool copies them off a device only when asked); they stay valid only during the call. Called
  // under the pool's lock: must not call into the pool.
  virtual void Evicted(const PublishInfo& info, const std::string& tenant,
                       const std::function<const uint8_t*()>& data) = 0;
};

struct PoolOptions {
  bool enable_prefix_caching = true;
  EvictionSink* eviction_sink = nullptr;  // not owned; may be null (evicted blocks are dropped)
  KvEventLog* events = nullptr;           // not owned; may be null
  std::function<absl::Time()> clock = absl::Now;
  // Touch every page at creation: the pool is a reservation, and first-touch faults would
  // otherwise land on the append path (about 2 GB/s here instead of memcpy speed).
  bool prefault = true;
  // Staged memory (cuda:N, host-staged): the most payload bytes one transfer holds in its staging
  // buffer at a time. Payloads move in pieces of whole layers; a layer larger than this is a
  // piece of its own.
  uint64_t staging_bytes = uint64_t{64} << 20;
};

// What publishing a block records (and its BlockStored event carries).
struct PublishInfo {
  BlockHash hash{};
  bool has_parent = false;  // false for a sequence's first block
  BlockHash parent{};
  std::vector<uint32_t> token_ids;
  std::string lora;
  uint8_t priority = 50;  // 0..100; lower is evicted first
};

// An evicted block whose copy into the eviction sink is still to be made (BlockPool::Allocate):
// the block, held so it is not reused meanwhile, and what publishing it recorded.
struct PendingEviction {
  BlockRef block;
  std::shared_ptr<const PublishInfo> info;
  std::string tenant;
};

// Thread-safe. Lock order: SequenceStore::mu_, then BlockPool::mu_, then KvEventLog's. Both are
// CoreLocks: no block's bytes move under either (an eviction's copy into a tier runs after them).
class BlockPool {
 public:
  static constexpr uint32_t kDefaultTenant = 0;  // the tenant "" when auth is off

  // Allocates memory on `device` for as many blocks of `layout.block_bytes` as fit in
  // `pool_bytes`. INVALID_ARGUMENT when not one block fits, RESOURCE_EXHAUSTED when the memory
  // cannot be had, FAILED_PRECONDITION for a device that is not there.
  static absl::StatusOr<std::unique_ptr<BlockPool>> Create(BlockLayout layout, uint64_t pool_bytes,
                                                           const DeviceSpec& device,
                                                           PoolOptions options = {});
  // Create on host memory (page-aligned, transparent huge pages requested).
  static absl::StatusOr<std::unique_ptr<BlockPool>> CreateHost(BlockLayout layout,
                                                               uint64_t pool_bytes,
                                                               PoolOptions options = {}) {
    return Create(std::move(layout), pool_bytes, DeviceSpec(), std::move(options));
  }
  // REQUIRES: every BlockRef of this pool is gone.
  ~BlockPool();
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  // A small stable id for a tenant name ("" is kDefaultTenant).
  uint32_t InternTenant(const std::string& tenant);
  // At most `max_blocks` blocks held by the tenant at once (referenced by its holders, or pinned
  // by it); 0: no limit.
  void SetTenantQuota(uint32_t tenant, uint64_t max_blocks);
  uint64_t TenantBlocks(uint32_t tenant) const;
  uint64_t TenantQuota(uint32_t tenant) const;  // 0: none

  // Takes n blocks, each with one reference, for `tenant`: free ones first, then evicted cached
  // ones (lowest priority, then least recently used). All or nothing: RESOURCE_EXHAUSTED (nothing
  // taken, nothing evicted) when fewer than n can be had or the tenant's quota would be passed.
  // An evicted block the eviction sink keeps is copied to it after the pool's lock is released:
  // before Allocate returns, or, while a DeferEvictions of this pool is open on the thread, when
  // that runs. The copy holds the block meanwhile (it is not reused before its bytes are read).
  absl::StatusOr<std::vector<BlockRef>> Allocate(size_t n, uint32_t tenant = kDefaultTenant);

  // For a caller that allocates under a lock of its own (the store's): while one is open on a
  // thread, the eviction copies of this pool's Allocate calls on that thread wait in it, and run
  // at Run() or when it closes, which the caller places after its lock is released and before
  // it writes into the blocks. Scopes nest (one per pool).
  class DeferEvictions {
   public:
    explicit DeferEvictions(BlockPool* pool);
    ~DeferEvictions();
    DeferEvictions(const DeferEvictions&) = delete;
    DeferEvictions& operator=(const DeferEvictions&) = delete;
    // Makes the copies waiting so far. REQUIRES: no CoreLock held.
    void Run();

   private:
    friend class BlockPool;
    BlockPool* const pool_;
    DeferEvictions* const prev_;
    std::vector<PendingEviction> pending_;
  };
  // Another reference to the block `r` refers to. REQUIRES: r.valid().
  BlockRef Share(const BlockRef& r);

  uint32_t RefCount(int32_t id) const;
  // True when the only reference is the caller's and the block is not published.
  bool Writable(int32_t id) const;
  bool Published(int32_t id) const;

  // Publishes the block under info.hash in the prefix index. Returns false (and changes nothing)
  // when prefix caching is off or another block already has that hash.
  bool Publish(const BlockRef& r, const PublishInfo& info, uint32_t tenant);
  // A new reference to the block published under `hash` by `tenant`, or an invalid BlockRef.
  // Counts as a use for the eviction order. Quota-checked like Allocate.
  BlockRef Lookup(const BlockHash& hash, uint32_t tenant);
  // Like Lookup, but without side effects on the eviction order: neither taking nor releasing
  // the reference counts as a use (a read by hash, not a reuse).
  BlockRef Peek(const BlockHash& hash, uint32_t tenant);
  // Whether `tenant` has a block published under `hash`. No side effects.
  bool Contains(const BlockHash& hash, uint32_t tenant) const;
  // Pins (or unpins) the tenant's published blocks with these hashes: pinned blocks are never
  // evicted. A pinned block counts on the tenant's quota like a referenced one; a pin that would
  // pass the quota is not taken. Returns how many hashes named a published block and were pinned
  // (or unpinned).
  size_t Pin(absl::Span<const BlockHash> hashes, uint32_t tenant, bool pin);
  // Drops cached blocks last used (published, released or looked up) before `cutoff`; pinned
  // ones stay. Returns how many.
  size_t DropCachedBefore(absl::Time cutoff);
  // Drops every cached, unpinned block; an AllCleared event when all cached blocks went.
  size_t ClearCache();
  // Calls fn for every cached block (published, unreferenced; pinned ones included) with what
  // publishing it recorded, its tenant and its bytes in host memory, coldest first, outside the
  // pool's lock: the blocks are held (without touching the eviction order) until fn saw them.
  // Stops when fn answers false. Returns how many blocks fn saw.
  size_t ForEachCached(
      const std::function<bool(const PublishInfo&, const std::string&, const uint8_t*)>& fn);
  // Spill-ahead (the store's spiller, off the callers' path): up to `max` of the coldest cached
  // blocks (in eviction order) for which want(info, tenant) is true, held out of the eviction
  // order so their bytes stay as they are while copied. An Allocate that needs them waits for
  // ReleaseSpillHolds instead of failing. Only blocks published with an eviction sink.
  struct SpillHold {
    int32_t id = -1;
    std::shared_ptr<const PublishInfo> info;
    std::string tenant;
  };
  // Looks at the `depth` coldest only.
  std::vector<SpillHold> HoldColdest(
      size_t max, size_t depth,
      const std::function<bool(const PublishInfo&, const std::string&)>& want);
  void ReleaseSpillHolds(const std::vector<SpillHold>& holds);
  // Copies whole blocks to / from host memory (n * block_bytes at `host`), on any memory kind.
  absl::Status CopyOut(absl::Span<const int32_t> ids, uint8_t* host) const;
  absl::Status CopyIn(absl::Span<const int32_t> ids, const uint8_t* host);
  // The KV events' medium of this pool's blocks: "gpu" on a CUDA device, else "cpu".
  const std::string& medium() const { return medium_; }

  // Start of block `id`'s bytes (a device pointer on cuda:N memory). Stable for
  // the pool's lifetime.
  uint8_t* BlockData(int32_t id) const { return base() + uint64_t(id) * layout_.block_bytes; }
  uint8_t* base() const { return memory_->base(); }
  // Where the blocks live and how bytes move in and out of them.
  PoolMemory& memory() const { return *memory_; }
  const BlockLayout& layout() const { return layout_; }
  uint64_t num_blocks() const { return num_blocks_; }
  uint64_t pool_bytes() const { return memory_->bytes(); }
  bool prefix_caching() const { return options_.enable_prefix_caching; }
  uint64_t staging_bytes() const { return options_.staging_bytes; }
  PoolStats Stats() const;

  // For tests: free + cached + used == total, every state consistent with the records, the index
  // and the eviction set agree. Empty string when all hold, else what failed.
  std::string CheckInvariants() const;

 private:
  friend class BlockRef;
  struct Record {
    uint32_t refcount = 0;
    uint32_t pins = 0;
    uint32_t tenant = kDefaultTenant;
    bool published = false;
    uint8_t priority = 50;
    uint64_t tick = 0;     // last use, for LRU
    absl::Time last_used;  // published, released or looked up: what the prefix-cache TTL ages
    BlockHash hash{};
    // What publishing recorded (parent, token ids, LoRA): what a lower tier keeps with the
    // block. Only with an eviction sink.
    std::shared_ptr<const PublishInfo> info;
    bool spill_hold = false;  // HoldColdest took it out of the eviction order for a copy
  };
  using EvictKey = std::tuple<uint8_t, uint64_t, int32_t>;  // priority, tick, id

  BlockPool(BlockLayout layout, std::unique_ptr<PoolMemory> memory, uint64_t num_blocks,
            PoolOptions options);
  // Hands an evicted block's bytes to the eviction sink and drops the entry's hold on it.
  void CopyEvicted(PendingEviction& e);
  void Release(int32_t id, bool touch);
  BlockRef LookupImpl(const BlockHash& hash, uint32_t tenant, bool touch);
  void AddRefLocked(int32_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool Evictable(const Record& r) const {
    return r.published && r.refcount == 0 && r.pins == 0 && !r.spill_hold;
  }
  EvictKey KeyOf(int32_t id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Unpublishes an evictable block and puts it on the free list; its hash goes to `removed`.
  void DropLocked(int32_t id, std::vector<BlockHash>* removed) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EmitRemovedLocked(uint32_t tenant, std::vector<BlockHash> hashes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const BlockLayout layout_;
  const std::unique_ptr<PoolMemory> memory_;
  const uint64_t num_blocks_;
  const PoolOptions options_;
  const std::string medium_;

  mutable absl::Mutex mu_;
  std::vector<Record> records_ ABSL_GUARDED_BY(mu_);     // block records, apart from the data
  std::vector<int32_t> free_list_ ABSL_GUARDED_BY(mu_);  // LIFO: recently freed blocks are warm
  std::set<EvictKey> evictable_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<BlockHash, int32_t> index_ ABSL_GUARDED_BY(mu_);
  uint64_t tick_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t cached_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t pinned_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t evictions_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t spill_holds_ ABSL_GUARDED_BY(mu_) = 0;  // blocks HoldColdest holds now
  std::vector<std::string> tenant_names_ ABSL_GUARDED_BY(mu_) = {""};
  absl::flat_hash_map<std::string, uint32_t> tenant_ids_ ABSL_GUARDED_BY(mu_) = {{"", 0}};
  std::vector<uint64_t> tenant_used_ ABSL_GUARDED_BY(mu_) = {0};
  std::vector<uint64_t> tenant_quota_ ABSL_GUARDED_BY(mu_) = {0};
};

}  // namespace kvbank

#endif  // KVBANK_SERVER_CORE_BLOCK_POOL_H_
