#include "server/core/prefix_cache.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvbank {

PrefixCache::PrefixCache(const TransferPlanner* planner, BlockPool* pool, TierCache* tiers,
                         KvEventLog* events, StoreTenants* tenants, Options options)
    : planner_(planner),
      pool_(pool),
      tiers_(tiers),
      events_(events),
      tenants_(tenants),
      options_(options),
      fingerprint_(LayoutFingerprint(planner->layout())) {
  if (tiers_ != nullptr && tiers_->options().spill_ahead) {
    spiller_ = std::thread([this] { SpillLoop(); });
  }
}

PrefixCache::~PrefixCache() { StopSpilling(); }

BlockHash PrefixCache::Root(const std::string& tenant, const std::string& cache_salt) const {
  return RootHash(options_.hash, PrefixRoot{fingerprint_, tenant, cache_salt});
}

std::vector<uint64_t> PrefixCache::Match(const std::string& tenant,
                                         const std::vector<MatchQuery>& queries) {
  std::vector<uint64_t> out;
  out.reserve(queries.size());
  for (const MatchResult& r : MatchTiers(tenant, queries)) out.push_back(r.tokens);
  return out;
}

std::vector<MatchResult> PrefixCache::MatchTiers(const std::string& tenant,
                                                 const std::vector<MatchQuery>& queries) {
  const uint32_t tenant_id = pool_->InternTenant(tenant);
  std::vector<MatchResult> out;
  out.reserve(queries.size());
  const uint32_t bt = planner_->layout().block_tokens;
  for (const MatchQuery& q : queries) {
    // Block by block, stopping at the first miss in every tier: a miss costs one hash (and one
    // look-up per tier), not the prompt's.
    MatchResult r;
    const uint64_t full = !q.hashes.empty() ? q.hashes.size() : q.tokens.size() / bt;
    BlockHash h = q.hashes.empty() ? Root(tenant, q.cache_salt) : BlockHash{};
    for (uint64_t i = 0; i < full; ++i) {
      if (q.hashes.empty()) {
        h = ChainHash(options_.hash, h, q.tokens.data() + i * bt, bt, q.extra_keys);
      } else {
        h = q.hashes[i];
      }
      if (pool_->Contains(h, tenant_id)) {
        r.pool_tokens += bt;
      } else if (std::optional<Tier> t = tiers_ ? tiers_->Find(h, tenant) : std::nullopt) {
        (*t == Tier::kHost ? r.host_tokens : r.disk_tokens) += bt;
      } else {
        break;
      }
    }
    r.tokens = r.pool_tokens + r.host_tokens + r.disk_tokens;
    out.push_back(r);
  }
  return out;
}

size_t PrefixCache::Prefetch(const std::string& tenant, const std::vector<MatchQuery>& queries) {
  size_t n = 0;
  for (const MatchQuery& q : queries) {
    std::vector<BlockHash> hashes = q.hashes;
    if (hashes.empty()) {
      hashes = PrefixHashes(options_.hash, Root(tenant, q.cache_salt), q.tokens,
                            planner_->layout().block_tokens, q.extra_keys);
    }
    // Released at once: the promoted blocks stay cached (published, most recently used).
    size_t promoted = 0;
    Promote(tenant, hashes, /*touch=*/false, &promoted);
    n += promoted;
  }
  return n;
}

std::vector<BlockRef> PrefixCache::Promote(const std::string& tenant,
                                           absl::Span<const BlockHash> hashes, bool touch,
                                           size_t* promoted) {
  std::vector<BlockRef> held;
  if (promoted != nullptr) *promoted = 0;
  if (tiers_ == nullptr || hashes.empty()) return held;
  const uint32_t tenant_id = pool_->InternTenant(tenant);
  // Most calls find nothing below the pool: a look without references first.
  size_t in_pool = 0;
  while (in_pool < hashes.size() && pool_->Contains(hashes[in_pool], tenant_id)) ++in_pool;
  if (tiers_->CountChain(hashes.subspan(in_pool), tenant) == 0) return held;
  // The run already in the pool: held, so the allocation below cannot evict it.
  size_t i = 0;
  for (; i < hashes.size(); ++i) {
    BlockRef b = touch ? pool_->Lookup(hashes[i], tenant_id) : pool_->Peek(hashes[i], tenant_id);
    if (!b.valid()) break;
    held.push_back(std::move(b));
  }
  const size_t n = tiers_->CountChain(hashes.subspan(i), tenant);
  if (n == 0) return held;
  // As many as the pool can give now: a promotion never fails the call that asked for it.
  auto blocks = pool_->Allocate(n, tenant_id);
  for (size_t want = n / 2; !blocks.ok() && want > 0; want /= 2) {
    blocks = pool_->Allocate(want, tenant_id);
  }
  if (!blocks.ok()) return held;
  const uint64_t bb = pool_->layout().block_bytes;
  const bool on_host = pool_->memory().kind() != MemoryKind::kCuda;
  std::vector<uint8_t> staging(on_host ? 0 : blocks->size() * bb);
  std::vector<uint8_t*> dst;
  std::vector<int32_t> ids;
  for (size_t k = 0; k < blocks->size(); ++k) {
    ids.push_back((*blocks)[k].id());
    dst.push_back(on_host ? pool_->BlockData(ids.back()) : staging.data() + k * bb);
  }
  std::vector<TierBlock> got = tiers_->ReadChain(hashes.subspan(i, blocks->size()), tenant, dst);
  if (!on_host && !got.empty() &&
      !pool_->CopyIn(absl::MakeSpan(ids).subspan(0, got.size()), staging.data()).ok()) {
    return held;
  }
  for (size_t k = 0; k < got.size(); ++k) {
    // False when another caller promoted (or wrote) the same block meanwhile: its copy is the
    // one the look-up finds, and this one goes back to the free list.
    if (pool_->Publish((*blocks)[k], got[k].info, tenant_id)) {
      held.push_back(std::move((*blocks)[k]));
      if (promoted != nullptr) ++*promoted;
    } else {
      BlockRef b = pool_->Lookup(got[k].info.hash, tenant_id);
      if (!b.valid()) break;
      held.push_back(std::move(b));
    }
  }
  return held;
}

size_t PrefixCache::FlushToDisk(absl::Time deadline) {
  if (tiers_ == nullptr || !tiers_->has_disk()) return 0;
  StopSpilling();  // every cached block back in the eviction order, where ForEachCached sees it
  size_t n = 0;
  // Under the pool's lock (ForEachCached): fine after a drain, when nothing else is running.
  pool_->ForEachCached([&](const PublishInfo& info, const std::string& tenant, const uint8_t* d) {
    if (absl::Now() >= deadline) return false;
    n += tiers_->WriteToDisk(info, tenant, d);
    return true;
  });
  n += tiers_->FlushHostToDisk(deadline);
  tiers_->WaitForWrites(deadline);
  tiers_->Sync().IgnoreError();
  return n;
}

absl::StatusOr<std::unique_ptr<FetchReader>> PrefixCache::FetchBlocks(
    const std::string& tenant, const std::vector<BlockHash>& hashes, uint32_t layer_begin,
    std::optional<uint32_t> layer_end, std::optional<DType> dtype, uint32_t kv_head_begin,
    std::optional<uint32_t> kv_head_end, bool device_dest) {
  const uint32_t l1 = layer_end.value_or(planner_->layout().num_layers);
  if (absl::Status s = planner_->CheckLayers(layer_begin, l1); !s.ok()) return s;
  if (hashes.empty()) return absl::InvalidArgumentError("block_hashes is empty");
  auto plan = planner_->Plan({layer_begin, l1, kv_head_begin, kv_head_end, dtype},
                             /*append=*/false);
  if (!plan.ok()) return plan.status();
  const uint32_t tenant_id = pool_->InternTenant(tenant);
  // Blocks in a tier below come back into the pool first; held until the reader holds them.
  const std::vector<BlockRef> promoted = Promote(tenant, hashes, /*touch=*/false);
  std::vector<BlockRef> refs;
  std::vector<int32_t> table;
  for (const BlockHash& h : hashes) {
    BlockRef b = pool_->Peek(h, tenant_id);  // a read, not a reuse: eviction order stays
    if (!b.valid()) break;
    table.push_back(b.id());
    refs.push_back(std::move(b));
  }
  if (refs.empty()) {
    return absl::NotFoundError("no block of block_hashes is cached (the first one is not)");
  }
  const uint64_t n = refs.size() * uint64_t{planner_->layout().block_tokens};
  TransferSpec t = planner_->Make(*plan, 0, n, std::move(table));
  t.device_payload = device_dest;
  auto reader = pool_->memory().BeginRead(pool_->layout(), std::move(t));
  if (!reader.ok()) return reader.status();
  auto r = std::make_unique<FetchReader>(std::move(refs), *std::move(reader), 0, plan->head_begin,
                                         plan->head_end);
  tenants_->Fetched(tenant, r->payload_bytes());
  return r;
}

size_t PrefixCache::Pin(const std::string& tenant, const std::vector<BlockHash>& hashes, bool pin) {
  return pool_->Pin(hashes, pool_->InternTenant(tenant), pin);
}

size_t PrefixCache::ExpireCache(absl::Time now) {
  if (options_.ttl <= absl::ZeroDuration()) return 0;
  return pool_->DropCachedBefore(now - options_.ttl);
}

void PrefixCache::StopSpilling() {
  if (!spill_stop_.HasBeenNotified()) spill_stop_.Notify();
  if (spiller_.joinable()) spiller_.join();
}

void PrefixCache::SpillLoop() {
  // Keeps the coldest `ahead` cached blocks copied down a tier while fewer than `ahead` blocks
  // are free: the next evictions then find their blocks there already.
  const uint64_t ahead = std::max<uint64_t>(16, pool_->num_blocks() / 8);
  constexpr size_t kBatch = 64;
  const uint64_t bb = pool_->layout().block_bytes;
  const bool on_host = pool_->memory().kind() != MemoryKind::kCuda;
  std::vector<uint8_t> staging;
  while (!spill_stop_.WaitForNotificationWithTimeout(absl::Milliseconds(5))) {
    while (!spill_stop_.HasBeenNotified() && pool_->Stats().free < ahead) {
      std::vector<BlockPool::SpillHold> holds =
          pool_->HoldColdest(kBatch, ahead, [&](const PublishInfo& info, const std::string& t) {
            return !tiers_->Find(info.hash, t).has_value();
          });
      if (holds.empty()) break;
      bool copied = true;
      if (!on_host) {
        std::vector<int32_t> ids;
        for (const auto& h : holds) ids.push_back(h.id);
        staging.resize(ids.size() * bb);
        copied = pool_->CopyOut(ids, staging.data()).ok();
      }
      bool taken = true;  // false: the disk's write queue is full, try again next round
      for (size_t i = 0; copied && taken && i < holds.size(); ++i) {
        const uint8_t* data = on_host ? pool_->BlockData(holds[i].id) : staging.data() + i * bb;
        taken = tiers_->Spill(*holds[i].info, holds[i].tenant, data);
      }
      pool_->ReleaseSpillHolds(holds);
      if (!copied || !taken) break;
    }
  }
}

}  // namespace kvbank
