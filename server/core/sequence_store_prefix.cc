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
  const uint32_t tenant_id = pool_->InternTenant(tenant);
  std::vector<uint64_t> out;
  out.reserve(queries.size());
  const uint32_t bt = layout_.block_tokens;
  for (const MatchQuery& q : queries) {
    uint64_t hits = 0;
    if (!q.hashes.empty()) {
      while (hits < q.hashes.size() && pool_->Contains(q.hashes[hits], tenant_id)) ++hits;
    } else if (q.tokens.size() >= bt) {
      // Block by block, stopping at the first miss: a miss costs one hash, not the prompt's.
      const uint64_t full = q.tokens.size() / bt;
      BlockHash parent = Root(tenant, q.cache_salt);
      while (hits < full) {
        parent = ChainHash(options_.hash, parent, q.tokens.data() + hits * bt, bt, q.extra_keys);
        if (!pool_->Contains(parent, tenant_id)) break;
        ++hits;
      }
    }
    out.push_back(hits * bt);
  }
  return out;
}

absl::StatusOr<std::unique_ptr<FetchReader>> SequenceStore::FetchBlocks(
    const std::string& tenant, const std::vector<BlockHash>& hashes, uint32_t layer_begin,
    std::optional<uint32_t> layer_end, std::optional<DType> dtype, uint32_t kv_head_begin,
    std::optional<uint32_t> kv_head_end) {
  const uint32_t l0 = layer_begin, l1 = layer_end.value_or(layout_.num_layers);
  if (absl::Status s = CheckLayerRange(l0, l1); !s.ok()) return s;
  if (hashes.empty()) return absl::InvalidArgumentError("block_hashes is empty");
  auto wire = PlanTransfer(l0, l1, dtype, /*append=*/false);
  if (!wire.ok()) return wire.status();
  auto heads = ResolveHeads(kv_head_begin, kv_head_end);
  if (!heads.ok()) return heads.status();
  const uint32_t tenant_id = pool_->InternTenant(tenant);
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
  auto reader = pool_->memory().BeginRead(
      block_layout(), MakeTransfer(*wire, l0, l1, 0, n, std::move(table), *heads));
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
  absl::MutexLock lock(&mu_);  // a Create cannot slip between the two limits
  pool_->SetTenantQuota(pool_->InternTenant(tenant), limits.max_blocks);
  tenant_counters_[tenant].max_sequences = limits.max_sequences;
}

size_t SequenceStore::ExpireCache(absl::Time now) {
  if (options_.prefix_cache_ttl <= absl::ZeroDuration()) return 0;
  return pool_->DropCachedBefore(now - options_.prefix_cache_ttl);
}

}  // namespace kvbank
