#include "server/core/sequence_store.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/random/random.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/quant.h"
#include "server/core/sequence.h"

namespace kvbank {

SequenceStore::SequenceStore(ModelLayout layout, std::unique_ptr<BlockPool> pool,
                             StoreOptions options, std::unique_ptr<KvEventLog> events,
                             std::unique_ptr<TierCache> tiers)
    : layout_(std::move(layout)),
      events_(std::move(events)),
      tiers_(std::move(tiers)),
      pool_(std::move(pool)),
      options_(std::move(options)),
      planner_(layout_, pool_->layout(), pool_->staging_bytes()),
      tenants_(std::make_unique<StoreTenants>(layout_.name, pool_.get())),
      waiters_(std::make_unique<CommitWaiters>(layout_.name, options_.max_waiters)),
      prefix_(std::make_unique<PrefixCache>(
          &planner_, pool_.get(), tiers_.get(), events_.get(), tenants_.get(),
          PrefixCache::Options{options_.hash, options_.prefix_cache_ttl})) {}

SequenceStore::~SequenceStore() {
  CoreLock lock(&mu_);
  live_.clear();  // drops every block reference before the pool goes
}

uint64_t SequenceStore::NewId() {
  // Ids are unpredictable (a caller cannot guess another's id) and never reused while remembered.
  absl::BitGen gen;
  for (;;) {
    const uint64_t id = absl::Uniform<uint64_t>(gen, 1, uint64_t{1} << 53);  // exact in JSON/JS
    if (!live_.contains(id) && !tombstones_.contains(id)) return id;
  }
}

absl::StatusOr<absl::Duration> SequenceStore::ResolveLease(
    std::optional<absl::Duration> lease) const {
  if (!lease.has_value()) return options_.default_lease;
  if (*lease < absl::ZeroDuration()) return absl::InvalidArgumentError("lease_ttl is negative");
  if (*lease > options_.max_lease) {
    return absl::InvalidArgumentError(absl::StrCat("lease_ttl ", absl::FormatDuration(*lease),
                                                   " exceeds the maximum ",
                                                   absl::FormatDuration(options_.max_lease)));
  }
  return *lease;
}

SequenceStore::SeqPtr SequenceStore::Insert(absl::Duration lease, const std::string& tenant) {
  auto s = std::make_shared<Sequence>();
  s->id = NewId();
  s->tenant = tenant;
  s->tenant_id = pool_->InternTenant(tenant);
  s->priority = options_.default_priority;
  s->root = prefix_->Root(tenant, "");
  s->layer_len.assign(layout_.num_layers, 0);
  s->lease_ttl = lease;
  Renew(*s);
  live_[s->id] = s;
  tenants_->SequenceAdded(tenant);
  return s;
}

void SequenceStore::Renew(Sequence& s) {
  s.lease_deadline =
      s.lease_ttl == absl::ZeroDuration() ? absl::InfiniteFuture() : options_.clock() + s.lease_ttl;
}

absl::StatusOr<SequenceStore::SeqPtr> SequenceStore::Find(uint64_t id, const std::string& tenant) {
  auto it = live_.find(id);
  if (it != live_.end() && it->second->tenant == tenant) {
    // A lease that ran out is expired on first touch, even before the reaper sees it; never
    // while an append is in flight (see ExpireLeases).
    if (it->second->busy() || it->second->lease_deadline > options_.clock()) {
      return it->second;
    }
    Remove(it->second, "its lease expired", /*lease_expired=*/true);
  }
  // Another tenant's sequence, live or gone, reads exactly like one that never existed.
  auto t = tombstones_.find(id);
  if (t != tombstones_.end() && t->second.tenant == tenant) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence_id ", id, " is gone: ", t->second.reason));
  }
  return absl::NotFoundError(
      absl::StrCat("sequence_id ", id, " not found in model '", layout_.name, "'"));
}

SequenceInfo SequenceStore::Info(const Sequence& s) const {
  SequenceInfo i;
  i.id = s.id;
  i.length = s.Length();
  i.layer_lengths = s.layer_len;
  // The blocks its tokens hold: not the new blocks of appends in flight.
  i.num_blocks = s.table.held(CeilDiv(s.MaxLength(), layout_.block_tokens));
  i.cached_tokens = s.cached_tokens;
  i.lease_ttl = s.lease_ttl;
  i.compactions = s.generation;
  return i;
}

void SequenceStore::Account(Sequence& s) {
  const uint64_t now = s.removed ? 0 : s.Length();
  tenants_->TokensChanged(s.tenant, s.counted_length, now);
  s.counted_length = now;
}

absl::Status SequenceStore::AdmitSequence(const std::string& tenant) const {
  if (!closed_.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("model '", layout_.name, "': ", closed_));
  }
  if (absl::Status t = tenants_->Admit(tenant); !t.ok()) return t;
  if (live_.size() >= options_.max_sequences) {
    return absl::ResourceExhaustedError(absl::StrCat("model '", layout_.name,
                                                     "' has max_sequences (",
                                                     options_.max_sequences, ") live sequences"));
  }
  return absl::OkStatus();
}

uint64_t SequenceStore::Remove(SeqPtr s, std::string reason, bool lease_expired) {
  live_.erase(s->id);
  s->removed = true;
  tenants_->SequenceRemoved(s->tenant, lease_expired);
  Account(*s);
  tombstones_[s->id] = Tombstone{s->tenant, std::move(reason)};
  tombstone_order_.push_back(s->id);
  while (tombstone_order_.size() > options_.tombstones) {
    tombstones_.erase(tombstone_order_.front());
    tombstone_order_.pop_front();
  }
  // The blocks its tokens hold (not the new blocks of appends in flight).
  const uint64_t n =
      std::min<uint64_t>(s->table.size(), CeilDiv(s->MaxLength(), layout_.block_tokens));
  if (!s->busy()) s->table.Clear();  // else the last append in flight releases them (EndAppend)
  return n;
}

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

absl::StatusOr<SequenceInfo> SequenceStore::Create(const CreateOptions& o) {
  auto ttl = ResolveLease(o.lease);
  if (!ttl.ok()) return ttl.status();
  if (o.priority.has_value() && *o.priority > 100) {
    return absl::InvalidArgumentError(
        absl::StrCat("priority ", int(*o.priority), " is outside [0, 100]"));
  }
  const RetentionPolicy& rp = o.retention;
  if (rp.kind == RetentionPolicy::Kind::kSlidingWindow && rp.window == 0) {
    return absl::InvalidArgumentError("retention.window must be positive for a sliding window");
  }
  if (rp.kind == RetentionPolicy::Kind::kHeavyHitter) {
    if (rp.budget < 2 || rp.window + 1 >= rp.budget) {
      return absl::InvalidArgumentError(
          absl::StrCat("retention.budget (", rp.budget, ") must exceed retention.window (",
                       rp.window, ") + 1: the first token and at least one heavy hitter"));
    }
    for (uint32_t l = 0; l < layout_.num_layers; ++l) {
      if (layout_.layer_dtypes[l] == DType::kFp8E4M3 ||
          layout_.layer_dtypes[l] == DType::kFp8E5M2) {
        return absl::InvalidArgumentError(
            absl::StrCat("heavy-hitter retention moves tokens between blocks; layer ", l,
                         " stores fp8, whose scale is per block"));
      }
    }
  }
  if (o.prompt.size() > options_.max_tokens_per_sequence) {
    return absl::InvalidArgumentError(absl::StrCat("prompt of ", o.prompt.size(),
                                                   " tokens exceeds max_tokens_per_sequence ",
                                                   options_.max_tokens_per_sequence));
  }
  // Hashing happens before taking the lock: it is the expensive part of a long prompt.
  const BlockHash root = prefix_->Root(o.tenant, o.cache_salt);
  std::vector<BlockHash> hashes;
  if (pool_->prefix_caching()) {
    hashes = PrefixHashes(options_.hash, root, o.prompt, layout_.block_tokens, o.extra_keys);
  }
  // Blocks of the prompt found in a tier come back into the pool first (off the lock: disk
  // reads); held until the look-up below attaches them.
  const std::vector<BlockRef> promoted = prefix_->Promote(o.tenant, hashes);
  CoreLock lock(&mu_);
  if (absl::Status a = AdmitSequence(o.tenant); !a.ok()) return a;
  SeqPtr s = Insert(*ttl, o.tenant);
  s->root = root;
  s->extra_keys = o.extra_keys;
  for (const ExtraKey& k : o.extra_keys) {
    if (k.kind == ExtraKeyKind::kLora) s->lora = k.value;
  }
  if (o.priority.has_value()) s->priority = *o.priority;
  s->token_ids = o.prompt;
  for (const BlockHash& h : hashes) {
    BlockRef b = pool_->Lookup(h, s->tenant_id);
    if (!b.valid()) break;
    s->table.Append(std::move(b));
    s->hashes.push_back(h);
  }
  s->cached_tokens = s->table.size() * uint64_t{layout_.block_tokens};
  for (uint64_t& l : s->layer_len) l = s->cached_tokens;
  s->retention = o.retention;
  s->prefix_copy = o.prefix_copy;
  // A sliding window releases now; a heavy-hitter compaction copies rows, which the next
  // append's commit does outside the lock.
  if (o.retention.kind == RetentionPolicy::Kind::kSlidingWindow) Retain(*s);
  Account(*s);
  tenants_->PrefixLookedUp(o.tenant, o.prompt.size(), s->cached_tokens);
  if (o.prefix_copy) tenants_->PrefixCopyCreated(o.tenant);
  return Info(*s);
}

absl::StatusOr<SequenceInfo> SequenceStore::Fork(uint64_t id, std::optional<absl::Duration> lease,
                                                 const std::string& tenant) {
  // Planned under the lock (the parent as it is now: its full blocks shared, its partial ones
  // allocated for copies), copied outside it, inserted under it again. The fork is the parent
  // as it was when planned, whatever the parent does meanwhile.
  const uint64_t bt = layout_.block_tokens;
  absl::Duration ttl;
  Sequence snapshot;  // the parent's metadata; its table holds the shared full blocks
  std::vector<BlockRef> copies, sources;
  std::vector<kernels::RowCopy> rows;
  BlockPool::DeferEvictions evictions(pool_.get());  // copied down once mu_ is released
  {
    CoreLock lock(&mu_);
    auto found = Find(id, tenant);
    if (!found.ok()) return found.status();
    Sequence& parent = **found;
    ttl = parent.lease_ttl;
    if (lease.has_value()) {
      auto resolved = ResolveLease(lease);
      if (!resolved.ok()) return resolved.status();
      ttl = *resolved;
    }
    if (absl::Status a = AdmitSequence(parent.tenant); !a.ok()) return a;
    const uint64_t full = parent.Length() / bt;  // blocks full in every layer: shared
    // Rows every head of a layer holds are copied; rows only some heads hold (appends over head
    // ranges that the other ranks have not matched yet) stay with the parent.
    const uint64_t max_len = *std::max_element(parent.layer_len.begin(), parent.layer_len.end());
    const uint64_t partial = CeilDiv(max_len, bt) - full;  // blocks some layer has rows in: copied
    auto allocated = pool_->Allocate(partial, parent.tenant_id);
    if (!allocated.ok()) return allocated.status();
    copies = *std::move(allocated);
    for (uint64_t j = 0; j < partial; ++j) {
      const uint64_t i = full + j;
      // Held while copied: shared, so an append to the parent meanwhile copies it first.
      sources.push_back(pool_->Share(parent.table.at(i)));
      for (uint32_t l = 0; l < layout_.num_layers; ++l) {
        const uint64_t len = parent.layer_len[l];
        const uint64_t n = len <= i * bt ? 0 : std::min<uint64_t>(len - i * bt, bt);
        // Only rows below the lengths: an append in flight may be writing the rows past them.
        for (uint32_t r = 0; r < n; ++r) {
          rows.push_back({parent.table.at(i).id(), copies[j].id(), r, r, l});
        }
      }
    }
    for (uint64_t i = 0; i < full; ++i) {
      snapshot.table.Append(parent.table.hole(i) ? BlockRef() : pool_->Share(parent.table.at(i)));
    }
    snapshot.tenant = parent.tenant;
    snapshot.root = parent.root;
    snapshot.extra_keys = parent.extra_keys;
    snapshot.lora = parent.lora;
    snapshot.priority = parent.priority;
    snapshot.hashes = parent.hashes;
    snapshot.retention = parent.retention;
    snapshot.scores = parent.scores;
    snapshot.publishable = parent.publishable;
    snapshot.layer_len = parent.layer_len;
    snapshot.token_ids = parent.token_ids;
    snapshot.cached_tokens = parent.cached_tokens;
    Renew(parent);
  }
  evictions.Run();
  if (absl::Status c = pool_->memory().CopyRows(pool_->layout(), rows); !c.ok()) return c;
  sources.clear();

  CoreLock lock(&mu_);
  if (absl::Status a = AdmitSequence(snapshot.tenant); !a.ok()) return a;
  SeqPtr child = Insert(ttl, snapshot.tenant);
  child->root = snapshot.root;
  child->extra_keys = std::move(snapshot.extra_keys);
  child->lora = std::move(snapshot.lora);
  child->priority = snapshot.priority;
  child->hashes = std::move(snapshot.hashes);
  child->retention = snapshot.retention;
  child->scores = std::move(snapshot.scores);
  child->publishable = snapshot.publishable;
  child->layer_len = std::move(snapshot.layer_len);
  child->token_ids = std::move(snapshot.token_ids);
  child->cached_tokens = snapshot.cached_tokens;
  child->table = std::move(snapshot.table);
  for (BlockRef& copy : copies) child->table.Append(std::move(copy));
  Account(*child);
  return Info(*child);
}

absl::StatusOr<SequenceInfo> SequenceStore::Truncate(uint64_t id, uint64_t num_tokens,
                                                     const std::string& tenant) {
  CoreLock lock(&mu_);
  auto found = Find(id, tenant);
  if (!found.ok()) return found.status();
  Sequence& s = **found;
  if (s.busy()) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence_id ", id, " has an append in flight; truncate after it ends"));
  }
  const uint64_t len = s.Length();
  if (num_tokens > len) {
    return absl::OutOfRangeError(
        absl::StrCat("num_tokens ", num_tokens, " is past the end: the sequence holds ", len));
  }
  if (const uint64_t tail = CeilDiv(num_tokens, layout_.block_tokens);
      tail > 0 && s.table.hole(tail - 1)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot truncate to ", num_tokens, " tokens: the sliding window released that block"));
  }
  for (uint64_t& l : s.layer_len) l = num_tokens;
  s.head_len.clear();
  if (s.token_ids.size() > num_tokens) s.token_ids.resize(num_tokens);
  s.cached_tokens = std::min(s.cached_tokens, num_tokens);
  // Blocks past the end are dropped tail first; a block cut in two keeps its place in the index
  // (it is immutable) but leaves the sequence's hash chain, and is copied before any write.
  const uint64_t keep = CeilDiv(num_tokens, layout_.block_tokens);
  s.table.Truncate(keep);
  s.cut_block = num_tokens % layout_.block_tokens != 0 ? num_tokens / layout_.block_tokens
                                                       : Sequence::kNoBlock;
  if (s.scores.size() > num_tokens) s.scores.resize(num_tokens);
  s.hashes.resize(std::min<uint64_t>(s.hashes.size(), num_tokens / layout_.block_tokens));
  Account(s);
  Renew(s);
  return Info(s);
}

absl::StatusOr<uint64_t> SequenceStore::Free(uint64_t id, const std::string& tenant) {
  CommitWaiters::Fired fired;
  uint64_t released = 0;
  {
    CoreLock lock(&mu_);
    auto found = Find(id, tenant);
    if (!found.ok()) return found.status();
    released = Remove(*found, "it was freed");
    TakeReadyWaiters(id, &fired);
  }
  CommitWaiters::Fire(std::move(fired));
  return released;
}

absl::StatusOr<SequenceInfo> SequenceStore::RenewLease(uint64_t id, const std::string& tenant) {
  CoreLock lock(&mu_);
  auto found = Find(id, tenant);
  if (!found.ok()) return found.status();
  Renew(**found);
  return Info(**found);
}

absl::StatusOr<SequenceInfo> SequenceStore::Get(uint64_t id, const std::string& tenant) {
  CoreLock lock(&mu_);
  auto found = Find(id, tenant);
  if (!found.ok()) return found.status();
  return Info(**found);
}

void SequenceStore::Close(const std::string& reason) {
  CommitWaiters::Fired fired;
  {
    CoreLock lock(&mu_);
    closed_ = reason;
    std::vector<SeqPtr> all;
    all.reserve(live_.size());
    for (const auto& [id, s] : live_) all.push_back(s);
    for (const SeqPtr& s : all) Remove(s, reason);
    // Every waiter's sequence is gone now: each ends FAILED_PRECONDITION with the reason.
    for (uint64_t id : waiters_->Sequences()) TakeReadyWaiters(id, &fired);
  }
  CommitWaiters::Fire(std::move(fired));
}

size_t SequenceStore::ExpireLeases(absl::Time now) {
  CommitWaiters::Fired fired;
  std::vector<SeqPtr> expired;
  {
    CoreLock lock(&mu_);
    for (const auto& [id, s] : live_) {
      // An append in flight keeps its sequence: it renews the lease when it ends.
      if (s->lease_deadline <= now && !s->busy()) expired.push_back(s);
    }
    for (const SeqPtr& s : expired) {
      Remove(s, "its lease expired", /*lease_expired=*/true);
      TakeReadyWaiters(s->id, &fired);
    }
  }
  CommitWaiters::Fire(std::move(fired));
  return expired.size();
}

StoreStats SequenceStore::Stats(const std::string* tenant) const {
  StoreStats st;
  if (tenant != nullptr) {
    st.tenant_view = true;
    const TenantStats t = tenants_->Row(*tenant);
    static_cast<Activity&>(st) = t;
    st.pool.total = pool_->num_blocks();
    st.pool.used = t.blocks_referenced;
    st.tenants.push_back(t);
    return st;
  }
  static_cast<Activity&>(st) = tenants_->Totals();
  st.tenants = tenants_->Rows();
  st.fetches_waiting = waiters_->size();
  st.pool = pool_->Stats();
  if (tiers_ != nullptr) st.tiers = tiers_->Stats();
  return st;
}

std::string SequenceStore::CheckInvariants() const {
  if (std::string e = pool_->CheckInvariants(); !e.empty()) return e;
  CoreLock lock(&mu_);
  for (const auto& [id, s] : live_) {
    const uint64_t max_len = s->MaxLength();
    if (!s->head_len.empty()) {
      const uint32_t heads = layout_.num_kv_heads;
      if (s->head_len.size() != s->layer_len.size() * heads) {
        return absl::StrCat("sequence ", id, " has ", s->head_len.size(), " head lengths");
      }
      for (size_t l = 0; l < s->layer_len.size(); ++l) {
        const uint64_t* row = s->head_len.data() + l * heads;
        if (*std::min_element(row, row + heads) != s->layer_len[l]) {
          return absl::StrCat("sequence ", id, " layer ", l, " length ", s->layer_len[l],
                              " is not its heads' least");
        }
      }
    }
    if (s->table.size() != CeilDiv(max_len, layout_.block_tokens) && !s->busy()) {
      return absl::StrCat("sequence ", id, " has ", s->table.size(), " blocks for ", max_len,
                          " tokens");
    }
    for (size_t i = 0; i < s->table.size(); ++i) {
      if (s->table.hole(i)) {
        if (s->retention.kind == RetentionPolicy::Kind::kSlidingWindow) continue;
        return absl::StrCat("sequence ", id, " has a hole at block ", i, " but no sliding window");
      }
      if (pool_->RefCount(s->table.at(i).id()) == 0) {
        return absl::StrCat("sequence ", id, " holds a dead block reference");
      }
    }
  }
  // The counters Stats reads, against a recount.
  absl::flat_hash_map<std::string, std::pair<uint64_t, uint64_t>> per;  // sequences, tokens
  for (const auto& [id, s] : live_) {
    if (s->counted_length != s->Length()) {
      return absl::StrCat("sequence ", id, " is counted with ", s->counted_length,
                          " tokens but holds ", s->Length());
    }
    auto& [n, t] = per[s->tenant];
    ++n;
    t += s->Length();
  }
  return tenants_->CheckCounts(per);
}

}  // namespace kvbank
