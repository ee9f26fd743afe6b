// SequenceStore: the prefix cache side (publishing, look-ups, pins, quotas, cache TTL).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/quant.h"
#include "server/core/sequence.h"
#include "server/core/sequence_store.h"

namespace kvbank {

void SequenceStore::PublishFullBlocks(Sequence& s) {
  if (!s.publishable) return;
  const uint64_t bt = layout_.block_tokens;
  const uint64_t full = std::min<uint64_t>(s.Length(), s.token_ids.size()) / bt;
  while (s.hashes.size() < full) {
    const size_t i = s.hashes.size();
    PublishInfo info;
    info.has_parent = i > 0;
    info.parent = i > 0 ? s.hashes[i - 1] : s.root;
    const uint32_t* tokens = s.token_ids.data() + i * bt;
    info.hash = ChainHash(options_.hash, info.parent, tokens, bt, s.extra_keys);
    info.token_ids.assign(tokens, tokens + bt);
    info.lora = s.lora;
    info.priority = s.priority;
    s.hashes.push_back(info.hash);
    if (s.table.hole(i)) continue;  // released by a sliding window
    // False when the block is already published (shared from the cache) or another block holds
    // the same hash: then this copy stays private and goes back to the free list when released.
    pool_->Publish(s.table.at(i), info, s.tenant_id);
  }
}

std::vector<uint64_t> SequenceStore::Match(const std::string& tenant,
                                           const std::vector<MatchQuery>& queries) {
  std::vector<uint64_t> out;
  out.reserve(queries.size());
  for (const MatchResult& r : MatchTiers(tenant, queries)) out.push_back(r.tokens);
  return out;
}

std::vector<MatchResult> SequenceStore::MatchTiers(const std::string& tenant,
                                                   const std::vector<MatchQuery>& queries) {
  const uint32_t tenant_id = pool_->InternTenant(tenant);
  std::vector<MatchResult> out;
  out.reserve(queries.size());
  const uint32_t bt = layout_.block_tokens;
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

size_t SequenceStore::Prefetch(const std::string& tenant, const std::vector<MatchQuery>& queries) {
  size_t n = 0;
  for (const MatchQuery& q : queries) {
    std::vector<BlockHash> hashes = q.hashes;
    if (hashes.empty()) {
      hashes = PrefixHashes(options_.hash, Root(tenant, q.cache_salt), q.tokens,
                            layout_.block_tokens, q.extra_keys);
    }
    // Released at once: the promoted blocks stay cached (published, most recently used).
    size_t promoted = 0;
    PromoteFromTiers(tenant, hashes, /*touch=*/false, &promoted);
    n += promoted;
  }
  return n;
}

std::vector<BlockRef> SequenceStore::PromoteFromTiers(const std::string& tenant,
                                                      absl::Span<const BlockHash> hashes,
                                                      bool touch, size_t* promoted) {
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
  const uint64_t bb = block_layout().block_bytes;
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

size_t SequenceStore::FlushToDisk(absl::Time deadline) {
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

absl::StatusOr<std::unique_ptr<FetchReader>> SequenceStore::FetchBlocks(
    const std::string& tenant, const std::vector<BlockHash>& hashes, uint32_t layer_begin,
    std::optional<uint32_t> layer_end, std::optional<DType> dtype, uint32_t kv_head_begin,
    std::optional<uint32_t> kv_head_end, bool device_dest) {
  const uint32_t l0 = layer_begin, l1 = layer_end.value_or(layout_.num_layers);
  if (absl::Status s = CheckLayerRange(l0, l1); !s.ok()) return s;
  if (hashes.empty()) return absl::InvalidArgumentError("block_hashes is empty");
  auto wire = PlanTransfer(l0, l1, dtype, /*append=*/false);
  if (!wire.ok()) return wire.status();
  auto heads = ResolveHeads(kv_head_begin, kv_head_end);
  if (!heads.ok()) return heads.status();
  const uint32_t tenant_id = pool_->InternTenant(tenant);
  // Blocks in a tier below come back into the pool first; held until the reader holds them.
  const std::vector<BlockRef> promoted = PromoteFromTiers(tenant, hashes, /*touch=*/false);
  std::unique_ptr<FetchReader> r(new FetchReader());
  std::vector<int32_t> table;
  for (const BlockHash& h : hashes) {
    BlockRef b = pool_->Peek(h, tenant_id);  // a read, not a reuse: eviction order stays
    if (!b.valid()) break;
    table.push_back(b.id());
    r->refs_.push_back(std::move(b));
  }
  if (r->refs_.empty()) {
    return absl::NotFoundError("no block of block_hashes is cached (the first one is not)");
  }
  r->token_begin_ = 0;
  const uint64_t n = r->refs_.size() * uint64_t{layout_.block_tokens};
  TransferSpec t = MakeTransfer(*wire, l0, l1, 0, n, std::move(table), *heads);
  t.device_payload = device_dest;
  auto reader = pool_->memory().BeginRead(block_layout(), std::move(t));
  if (!reader.ok()) return reader.status();
  r->reader_ = *std::move(reader);
  r->kv_head_begin_ = heads->begin;
  r->kv_head_end_ = heads->count == 0 ? layout_.num_kv_heads : heads->begin + heads->count;
  CountFetch(tenant, r->payload_bytes());
  return r;
}

size_t SequenceStore::Pin(const std::string& tenant, const std::vector<BlockHash>& hashes,
                          bool pin) {
  return pool_->Pin(hashes, pool_->InternTenant(tenant), pin);
}

void SequenceStore::SetTenantQuota(const std::string& tenant, uint64_t max_blocks) {
  pool_->SetTenantQuota(pool_->InternTenant(tenant), max_blocks);
}

void SequenceStore::SetTenantLimits(const std::string& tenant, const TenantLimits& limits) {
  CoreLock lock(&mu_);  // a Create cannot slip between the two limits
  pool_->SetTenantQuota(pool_->InternTenant(tenant), limits.max_blocks);
  tenant_counters_[tenant].max_sequences = limits.max_sequences;
}

size_t SequenceStore::ExpireCache(absl::Time now) {
  if (options_.prefix_cache_ttl <= absl::ZeroDuration()) return 0;
  return pool_->DropCachedBefore(now - options_.prefix_cache_ttl);
}

}  // namespace kvbank
