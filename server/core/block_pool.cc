#include "server/core/block_pool.h"

#include <limits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvbank {

BlockRef& BlockRef::operator=(BlockRef&& o) noexcept {
  if (this != &o) {
    Reset();
    pool_ = o.pool_;
    id_ = o.id_;
    touch_ = o.touch_;
    o.pool_ = nullptr;
    o.id_ = -1;
  }
  return *this;
}

void BlockRef::Reset() {
  if (pool_ != nullptr) pool_->Release(id_, touch_);
  pool_ = nullptr;
  id_ = -1;
}

absl::StatusOr<std::unique_ptr<BlockPool>> BlockPool::Create(BlockLayout layout,
                                                             uint64_t pool_bytes,
                                                             const DeviceSpec& device,
                                                             PoolOptions options) {
  if (layout.block_bytes == 0) return absl::InvalidArgumentError("block layout is empty");
  const uint64_t n = pool_bytes / layout.block_bytes;
  if (n == 0) {
    return absl::InvalidArgumentError(absl::StrCat("pool_bytes ", pool_bytes, " holds no block of ",
                                                   layout.block_bytes, " bytes"));
  }
  if (n > uint64_t(std::numeric_limits<int32_t>::max())) {
    return absl::InvalidArgumentError(
        absl::StrCat("pool_bytes ", pool_bytes, " makes ", n, " blocks; at most 2^31-1"));
  }
  auto memory = CreatePoolMemory(device, n * layout.block_bytes, options.prefault);
  if (!memory.ok()) return memory.status();
  return std::unique_ptr<BlockPool>(
      new BlockPool(std::move(layout), *std::move(memory), n, std::move(options)));
}

BlockPool::BlockPool(BlockLayout layout, std::unique_ptr<PoolMemory> memory, uint64_t num_blocks,
                     PoolOptions options)
    : layout_(std::move(layout)),
      memory_(std::move(memory)),
      num_blocks_(num_blocks),
      options_(std::move(options)),
      medium_(memory_->kind() == MemoryKind::kCuda ? "gpu" : "cpu") {
  records_.resize(num_blocks);
  free_list_.reserve(num_blocks);
  // Lowest ids on top of the stack, so a fresh pool hands out blocks in address order.
  for (uint64_t i = num_blocks; i > 0; --i) free_list_.push_back(static_cast<int32_t>(i - 1));
}

BlockPool::~BlockPool() = default;

uint32_t BlockPool::InternTenant(const std::string& tenant) {
  CoreLock lock(&mu_);
  auto [it, inserted] = tenant_ids_.try_emplace(tenant, uint32_t(tenant_names_.size()));
  if (inserted) {
    tenant_names_.push_back(tenant);
    tenant_used_.push_back(0);
    tenant_quota_.push_back(0);
  }
  return it->second;
}

void BlockPool::SetTenantQuota(uint32_t tenant, uint64_t max_blocks) {
  CoreLock lock(&mu_);
  tenant_quota_[tenant] = max_blocks;
}

uint64_t BlockPool::TenantBlocks(uint32_t tenant) const {
  CoreLock lock(&mu_);
  return tenant_used_[tenant];
}

uint64_t BlockPool::TenantQuota(uint32_t tenant) const {
  CoreLock lock(&mu_);
  return tenant_quota_[tenant];
}

BlockPool::EvictKey BlockPool::KeyOf(int32_t id) const {
  return {records_[id].priority, records_[id].tick, id};
}

void BlockPool::AddRefLocked(int32_t id) {
  Record& r = records_[id];
  if (r.refcount++ == 0) {
    if (r.pins == 0) ++tenant_used_[r.tenant];  // a pinned block is counted already
    if (r.published) {
      --cached_;
      if (r.pins == 0) evictable_.erase(KeyOf(id));
    }
  }
}

namespace {
// The DeferEvictions scopes open on this thread, innermost first (through their prev_ links).
thread_local BlockPool::DeferEvictions* open_deferrals = nullptr;
}  // namespace

BlockPool::DeferEvictions::DeferEvictions(BlockPool* pool) : pool_(pool), prev_(open_deferrals) {
  open_deferrals = this;
}

BlockPool::DeferEvictions::~DeferEvictions() {
  Run();
  open_deferrals = prev_;
}

void BlockPool::DeferEvictions::Run() {
  for (PendingEviction& e : pending_) pool_->CopyEvicted(e);
  pending_.clear();
}

void BlockPool::CopyEvicted(PendingEviction& e) {
  CheckNoCoreLock("an evicted block's copy into a tier");
  std::vector<uint8_t> staged;  // the block off a device
  options_.eviction_sink->Evicted(*e.info, e.tenant, [&]() -> const uint8_t* {
    if (memory_->kind() != MemoryKind::kCuda) return BlockData(e.block.id());
    staged.resize(layout_.block_bytes);
    const int32_t id[] = {e.block.id()};
    if (!memory_->CopyBlocksToHost(id, layout_.block_bytes, staged.data()).ok()) return nullptr;
    return staged.data();
  });
  e.block.Reset();  // the copy is made: the block is its allocator's alone
}

absl::StatusOr<std::vector<BlockRef>> BlockPool::Allocate(size_t n, uint32_t tenant) {
  std::vector<BlockRef> out;
  // Evicted blocks a tier keeps: copied once this lock is released (by Allocate itself, or by
  // the caller's DeferEvictions once the caller's lock is released too). Each holds its block
  // meanwhile, so the block is not reused before its bytes are copied.
  std::vector<PendingEviction> pending;
  {
    CoreLock lock(&mu_);
    if (tenant_quota_[tenant] != 0 && tenant_used_[tenant] + n > tenant_quota_[tenant]) {
      return absl::ResourceExhaustedError(
          absl::StrCat("tenant '", tenant_names_[tenant], "' block quota: ", tenant_used_[tenant],
                       " of ", tenant_quota_[tenant], " blocks in use, ", n, " more needed"));
    }
    // Blocks the spiller holds for a copy come back in a moment: wait for them rather than fail.
    while (free_list_.size() + evictable_.size() < n && spill_holds_ > 0 &&
           free_list_.size() + evictable_.size() + spill_holds_ >= n) {
      mu_.Await(absl::Condition(
          +[](uint64_t* holds) { return *holds == 0; }, &spill_holds_));
    }
    if (free_list_.size() + evictable_.size() < n) {
      return absl::ResourceExhaustedError(
          absl::StrCat("block pool exhausted: need ", n, " blocks, ", free_list_.size(),
                       " free and ", evictable_.size(), " evictable of ", num_blocks_));
    }
    // Evict (lowest priority, least recently used first); one Removed event per run of a tenant.
    std::vector<BlockHash> removed;
    uint32_t removed_tenant = 0;
    std::vector<std::pair<int32_t, PendingEviction>> victims;  // to copy down, by block
    while (free_list_.size() < n) {
      const int32_t victim = std::get<2>(*evictable_.begin());
      if (!removed.empty() && records_[victim].tenant != removed_tenant) {
        EmitRemovedLocked(removed_tenant, std::move(removed));
        removed.clear();
      }
      removed_tenant = records_[victim].tenant;
      if (options_.eviction_sink != nullptr && records_[victim].info != nullptr) {
        // One tier down instead of forgotten.
        victims.emplace_back(victim, PendingEviction{BlockRef(), records_[victim].info,
                                                     tenant_names_[removed_tenant]});
      }
      DropLocked(victim, &removed);
      ++evictions_;
    }
    EmitRemovedLocked(removed_tenant, std::move(removed));
    out.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      const int32_t id = free_list_.back();
      free_list_.pop_back();
      Record& r = records_[id];
      r = Record();
      r.refcount = 1;
      r.tenant = tenant;
      ++tenant_used_[tenant];
      out.push_back(BlockRef(this, id));
    }
    // Every victim is among the blocks handed out (evictions stop once n are free); each pending
    // copy holds its own reference.
    for (auto& [id, e] : victims) {
      ++records_[id].refcount;
      e.block = BlockRef(this, id);
      pending.push_back(std::move(e));
    }
  }
  if (pending.empty()) return out;
  DeferEvictions* scope = open_deferrals;
  while (scope != nullptr && scope->pool_ != this) scope = scope->prev_;
  for (PendingEviction& e : pending) {
    if (scope != nullptr) {
      scope->pending_.push_back(std::move(e));
    } else {
      CopyEvicted(e);
    }
  }
  return out;
}

BlockRef BlockPool::Share(const BlockRef& r) {
  CoreLock lock(&mu_);
  AddRefLocked(r.id());
  return BlockRef(this, r.id());
}

uint32_t BlockPool::RefCount(int32_t id) const {
  CoreLock lock(&mu_);
  return records_[id].refcount;
}

bool BlockPool::Writable(int32_t id) const {
  CoreLock lock(&mu_);
  return records_[id].refcount == 1 && !records_[id].published;
}

bool BlockPool::Published(int32_t id) const {
  CoreLock lock(&mu_);
  return records_[id].published;
}

void BlockPool::Release(int32_t id, bool touch) {
  CoreLock lock(&mu_);
  Record& r = records_[id];
  if (--r.refcount > 0) return;
  if (r.pins == 0) --tenant_used_[r.tenant];  // a pinned block stays on the tenant's quota
  if (r.published) {
    ++cached_;
    if (touch) {
      r.tick = ++tick_;
      r.last_used = options_.clock();
    }
    if (r.pins == 0 && !r.spill_hold) evictable_.insert(KeyOf(id));
  } else {
    free_list_.push_back(id);
  }
}

bool BlockPool::Publish(const BlockRef& ref, const PublishInfo& info, uint32_t tenant) {
  if (!options_.enable_prefix_caching) return false;
  CoreLock lock(&mu_);
  Record& r = records_[ref.id()];
  if (r.published || !index_.try_emplace(info.hash, ref.id()).second) return false;
  r.published = true;
  r.hash = info.hash;
  r.tenant = tenant;
  r.priority = info.priority;
  r.last_used = options_.clock();
  if (options_.eviction_sink != nullptr) r.info = std::make_shared<const PublishInfo>(info);
  if (options_.events != nullptr) {
    // Under mu_, so the log's order is the index's order (a block's Stored precedes its Removed).
    KvEvent e;
    e.type = KvEvent::Type::kBlockStored;
    e.time = r.last_used;
    e.tenant = tenant_names_[tenant];
    e.hashes.push_back(info.hash);
    e.has_parent = info.has_parent;
    e.parent = info.parent;
    e.token_ids = info.token_ids;
    e.block_tokens = layout_.block_tokens;
    e.lora = info.lora;
    e.medium = medium_;
    options_.events->Append(std::move(e));
  }
  return true;
}

BlockRef BlockPool::Lookup(const BlockHash& hash, uint32_t tenant) {
  return LookupImpl(hash, tenant, true);
}

BlockRef BlockPool::Peek(const BlockHash& hash, uint32_t tenant) {
  return LookupImpl(hash, tenant, false);
}

BlockRef BlockPool::LookupImpl(const BlockHash& hash, uint32_t tenant, bool touch) {
  CoreLock lock(&mu_);
  auto it = index_.find(hash);
  if (it == index_.end() || records_[it->second].tenant != tenant) return BlockRef();
  const int32_t id = it->second;
  if (records_[id].refcount == 0 && records_[id].pins == 0 && tenant_quota_[tenant] != 0 &&
      tenant_used_[tenant] + 1 > tenant_quota_[tenant]) {
    return BlockRef();
  }
  AddRefLocked(id);
  if (touch) {
    records_[id].tick = ++tick_;
    records_[id].last_used = options_.clock();
  }
  return BlockRef(this, id, touch);
}

bool BlockPool::Contains(const BlockHash& hash, uint32_t tenant) const {
  CoreLock lock(&mu_);
  auto it = index_.find(hash);
  return it != index_.end() && records_[it->second].tenant == tenant;
}

size_t BlockPool::Pin(absl::Span<const BlockHash> hashes, uint32_t tenant, bool pin) {
  CoreLock lock(&mu_);
  size_t n = 0;
  for (const BlockHash& h : hashes) {
    auto it = index_.find(h);
    if (it == index_.end() || records_[it->second].tenant != tenant) continue;
    const int32_t id = it->second;
    Record& r = records_[id];
    if (pin) {
      if (r.pins == 0) {
        // A pinned block holds pool space like a reference does, so it counts on the quota:
        // else pinning and freeing would let a tenant keep any number of blocks from others.
        if (r.refcount == 0) {
          if (tenant_quota_[tenant] != 0 && tenant_used_[tenant] + 1 > tenant_quota_[tenant]) {
            continue;
          }
          ++tenant_used_[tenant];
          evictable_.erase(KeyOf(id));
        }
        ++pinned_;
      }
      ++r.pins;
    } else if (r.pins > 0) {
      if (--r.pins == 0) {
        --pinned_;
        if (r.refcount == 0) {
          --tenant_used_[tenant];
          if (!r.spill_hold) evictable_.insert(KeyOf(id));
        }
      }
    }
    ++n;
  }
  return n;
}

void BlockPool::DropLocked(int32_t id, std::vector<BlockHash>* removed) {
  Record& r = records_[id];
  evictable_.erase(KeyOf(id));
  index_.erase(r.hash);
  removed->push_back(r.hash);
  r.published = false;
  r.info.reset();
  --cached_;
  free_list_.push_back(id);
}

void BlockPool::EmitRemovedLocked(uint32_t tenant, std::vector<BlockHash> hashes) {
  if (options_.events == nullptr || hashes.empty()) return;
  KvEvent e;
  e.type = KvEvent::Type::kBlockRemoved;
  e.time = options_.clock();
  e.tenant = tenant_names_[tenant];
  e.hashes = std::move(hashes);
  e.medium = medium_;
  options_.events->Append(std::move(e));
}

size_t BlockPool::DropCachedBefore(absl::Time cutoff) {
  CoreLock lock(&mu_);
  std::vector<int32_t> victims;
  for (const EvictKey& k : evictable_) {
    if (records_[std::get<2>(k)].last_used < cutoff) victims.push_back(std::get<2>(k));
  }
  absl::flat_hash_map<uint32_t, std::vector<BlockHash>> removed;
  for (int32_t id : victims) {
    const uint32_t tenant = records_[id].tenant;
    DropLocked(id, &removed[tenant]);
  }
  for (auto& [tenant, hashes] : removed) EmitRemovedLocked(tenant, std::move(hashes));
  return victims.size();
}

size_t BlockPool::ClearCache() {
  const size_t n = DropCachedBefore(absl::InfiniteFuture());
  CoreLock lock(&mu_);
  if (index_.empty() && options_.events != nullptr) {
    KvEvent e;
    e.type = KvEvent::Type::kAllCleared;
    e.time = options_.clock();
    options_.events->Append(std::move(e));
  }
  return n;
}

size_t BlockPool::ForEachCached(
    const std::function<bool(const PublishInfo&, const std::string&, const uint8_t*)>& fn) {
  struct Held {
    BlockRef block;
    std::shared_ptr<const PublishInfo> info;
    std::string tenant;
  };
  std::vector<Held> held;  // evictable ones coldest first, then the pinned ones
  {
    CoreLock lock(&mu_);
    std::vector<int32_t> ids;
    for (const EvictKey& k : evictable_) ids.push_back(std::get<2>(k));
    for (uint64_t id = 0; id < num_blocks_; ++id) {
      const Record& r = records_[id];
      if (r.published && r.refcount == 0 && r.pins > 0) ids.push_back(int32_t(id));
    }
    for (int32_t id : ids) {
      if (records_[id].info == nullptr) continue;
      AddRefLocked(id);
      held.push_back({BlockRef(this, id, /*touch=*/false), records_[id].info,
                      tenant_names_[records_[id].tenant]});
    }
  }
  std::vector<uint8_t> staged;  // a block off a device
  size_t n = 0;
  for (Held& h : held) {
    const uint8_t* data = BlockData(h.block.id());
    if (memory_->kind() == MemoryKind::kCuda) {
      staged.resize(layout_.block_bytes);
      const int32_t one[] = {h.block.id()};
      if (!memory_->CopyBlocksToHost(one, layout_.block_bytes, staged.data()).ok()) break;
      data = staged.data();
    }
    ++n;
    if (!fn(*h.info, h.tenant, data)) break;
  }
  return n;
}

std::vector<BlockPool::SpillHold> BlockPool::HoldColdest(
    size_t max, size_t depth,
    const std::function<bool(const PublishInfo&, const std::string&)>& want) {
  std::vector<SpillHold> out;
  CoreLock lock(&mu_);
  size_t seen = 0;
  for (auto it = evictable_.begin(); it != evictable_.end() && out.size() < max && seen < depth;
       ++seen) {
    const int32_t id = std::get<2>(*it);
    Record& r = records_[id];
    if (r.info == nullptr || !want(*r.info, tenant_names_[r.tenant])) {
      ++it;
      continue;
    }
    it = evictable_.erase(it);
    r.spill_hold = true;
    ++spill_holds_;
    out.push_back({id, r.info, tenant_names_[r.tenant]});
  }
  return out;
}

void BlockPool::ReleaseSpillHolds(const std::vector<SpillHold>& holds) {
  CoreLock lock(&mu_);
  for (const SpillHold& h : holds) {
    Record& r = records_[h.id];
    r.spill_hold = false;
    --spill_holds_;
    // Back at its place in the eviction order, unless it was looked up (or pinned) meanwhile.
    if (Evictable(r)) evictable_.insert(KeyOf(h.id));
  }
}

absl::Status BlockPool::CopyOut(absl::Span<const int32_t> ids, uint8_t* host) const {
  return memory_->CopyBlocksToHost(ids, layout_.block_bytes, host);
}

absl::Status BlockPool::CopyIn(absl::Span<const int32_t> ids, const uint8_t* host) {
  return memory_->CopyBlocksFromHost(ids, layout_.block_bytes, host);
}

PoolStats BlockPool::Stats() const {
  CoreLock lock(&mu_);
  PoolStats s;
  s.total = num_blocks_;
  s.free = free_list_.size();
  s.cached = cached_;
  s.used = num_blocks_ - s.free - s.cached;
  s.pinned = pinned_;
  s.evictions = evictions_;
  return s;
}

std::string BlockPool::CheckInvariants() const {
  CoreLock lock(&mu_);
  std::vector<bool> on_free(num_blocks_, false);
  for (int32_t id : free_list_) {
    if (id < 0 || uint64_t(id) >= num_blocks_) return absl::StrCat("free id ", id, " out of range");
    if (on_free[id]) return absl::StrCat("block ", id, " twice on the free list");
    const Record& r = records_[id];
    if (r.refcount != 0 || r.published) {
      return absl::StrCat("free block ", id, " has count ", r.refcount, " / published ",
                          r.published);
    }
    on_free[id] = true;
  }
  uint64_t used = 0, cached = 0, evictable = 0;
  std::vector<uint64_t> per_tenant(tenant_used_.size(), 0);
  for (uint64_t id = 0; id < num_blocks_; ++id) {
    const Record& r = records_[id];
    if (r.refcount > 0 || r.pins > 0) ++per_tenant[r.tenant];
    if (r.pins > 0 && !r.published) return absl::StrCat("pinned block ", id, " is not published");
    if (r.refcount > 0) {
      ++used;
    } else if (r.published) {
      ++cached;
    } else if (!on_free[id]) {
      return absl::StrCat("block ", id, " leaked: no reference, no hash, not free");
    }
    if (r.published) {
      auto it = index_.find(r.hash);
      if (it == index_.end() || it->second != int32_t(id)) {
        return absl::StrCat("published block ", id, " is not in the index");
      }
    }
    if (Evictable(r)) {
      ++evictable;
      if (evictable_.count(KeyOf(int32_t(id))) == 0) {
        return absl::StrCat("cached block ", id, " is missing from the eviction order");
      }
    }
  }
  if (used + cached + free_list_.size() != num_blocks_) {
    return absl::StrCat("free ", free_list_.size(), " + cached ", cached, " + used ", used,
                        " != total ", num_blocks_);
  }
  if (cached != cached_) return absl::StrCat("cached count ", cached_, " != ", cached);
  if (evictable != evictable_.size()) {
    return absl::StrCat("eviction order has ", evictable_.size(), " entries for ", evictable);
  }
  // A plain loop, not a lambda: the thread-safety analysis does not see mu_ held inside one.
  uint64_t published_referenced = 0;
  for (const Record& r : records_) published_referenced += r.published && r.refcount > 0;
  if (index_.size() != cached + published_referenced) {
    return "index size differs from the published blocks";
  }
  for (size_t t = 0; t < per_tenant.size(); ++t) {
    if (per_tenant[t] != tenant_used_[t]) {
      return absl::StrCat("tenant ", t, " counted ", tenant_used_[t], " blocks, holds ",
                          per_tenant[t]);
    }
  }
  return "";
}

}  // namespace kvbank
