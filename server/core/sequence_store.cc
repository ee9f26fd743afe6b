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

namespace {

// "layer L, K|V, head H, token T, element E" for byte `offset` of a converted (uniform wire
// dtype) payload, for error messages.
std::string DescribePayloadByte(const BlockLayout& b, const PayloadLayout& p, uint64_t offset) {
  uint32_t i = 0;
  while (i + 1 < p.layer_offset.size() && p.layer_offset[i + 1] <= offset) ++i;
  const uint32_t l = p.layer_begin + i;
  const LayerView& v = b.layers[l];
  uint64_t rel = offset - p.layer_offset[i];
  const uint64_t k_part = p.KPartBytes(b, l);
  const uint32_t kv = rel < k_part ? 0 : 1;
  if (kv == 1) rel -= k_part;
  const uint64_t dim = kv == 0 ? v.head_dim : v.head_dim_v;
  const uint64_t elem = rel / p.ElemBytes(b, l);
  const uint64_t row = elem / dim;
  return absl::StrCat("layer ", l, ", ", kv ? "V" : "K", ", head ", row / p.num_tokens, ", token ",
                      row % p.num_tokens, ", element ", elem % dim);
}

}  // namespace

SequenceStore::SequenceStore(ModelLayout layout, std::unique_ptr<BlockPool> pool,
                             StoreOptions options, std::unique_ptr<KvEventLog> events)
    : layout_(std::move(layout)),
      events_(std::move(events)),
      pool_(std::move(pool)),
      options_(std::move(options)),
      fingerprint_(LayoutFingerprint(layout_)) {
  absl::BitGen gen;
  id_state_ = absl::Uniform<uint64_t>(gen);
}

SequenceStore::~SequenceStore() {
  absl::MutexLock lock(&mu_);
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
  s->root = Root(tenant, "");
  s->layer_len.assign(layout_.num_layers, 0);
  s->lease_ttl = lease;
  Renew(*s);
  live_[s->id] = s;
  return s;
}

void SequenceStore::Renew(Sequence& s) {
  s.lease_deadline =
      s.lease_ttl == absl::ZeroDuration() ? absl::InfiniteFuture() : options_.clock() + s.lease_ttl;
}

absl::StatusOr<SequenceStore::SeqPtr> SequenceStore::Find(uint64_t id, const std::string& tenant) {
  auto it = live_.find(id);
  if (it != live_.end() && it->second->tenant == tenant) {
    // A lease that ran out is expired on first touch, even before the reaper sees it.
    if (it->second->lease_deadline > options_.clock()) return it->second;
    ++leases_expired_;
    Remove(it->second, "its lease expired");
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
  i.num_blocks = s.blocks.size();
  i.cached_tokens = s.cached_tokens;
  i.lease_ttl = s.lease_ttl;
  i.num_blocks =
      std::count_if(s.blocks.begin(), s.blocks.end(), [](const BlockRef& b) { return b.valid(); });
  i.compactions = s.generation;
  return i;
}

uint64_t SequenceStore::Remove(SeqPtr s, std::string reason) {
  live_.erase(s->id);
  s->removed = true;
  tombstones_[s->id] = Tombstone{s->tenant, std::move(reason)};
  tombstone_order_.push_back(s->id);
  while (tombstone_order_.size() > options_.tombstones) {
    tombstones_.erase(tombstone_order_.front());
    tombstone_order_.pop_front();
  }
  const uint64_t n = s->blocks.size();
  if (!s->append_in_flight) {
    // Tail first: cached blocks then age tail-first, so eviction takes a chain's tail before
    // its head (the head is what other prompts share).
    while (!s->blocks.empty()) s->blocks.pop_back();
  }  // else the transaction releases them when it ends
  return n;
}

kernels::PayloadMap SequenceStore::MakeMap(const PayloadLayout& p) const {
  kernels::PayloadMap m;
  m.pool = pool_->base();
  m.block_bytes = block_layout().block_bytes;
  m.layers = block_layout().layers.data() + p.layer_begin;
  m.layer_offset = p.layer_offset.data();
  m.num_layers = p.layer_end - p.layer_begin;
  m.num_tokens = p.num_tokens;
  m.total_bytes = p.total_bytes;
  return m;
}

BlockHash SequenceStore::Root(const std::string& tenant, const std::string& cache_salt) const {
  return RootHash(options_.hash, PrefixRoot{fingerprint_, tenant, cache_salt});
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
  const BlockHash root = Root(o.tenant, o.cache_salt);
  std::vector<BlockHash> hashes;
  if (pool_->prefix_caching()) {
    hashes = PrefixHashes(options_.hash, root, o.prompt, layout_.block_tokens, o.extra_keys);
  }
  absl::MutexLock lock(&mu_);
  if (live_.size() >= options_.max_sequences) {
    return absl::ResourceExhaustedError(absl::StrCat("model '", layout_.name,
                                                     "' has max_sequences (",
                                                     options_.max_sequences, ") live sequences"));
  }
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
    s->blocks.push_back(std::move(b));
    s->hashes.push_back(h);
  }
  s->cached_tokens = s->blocks.size() * uint64_t{layout_.block_tokens};
  for (uint64_t& l : s->layer_len) l = s->cached_tokens;
  s->retention = o.retention;
  Retain(*s);
  TenantCounters& c = tenant_counters_[o.tenant];
  c.query_tokens += o.prompt.size();
  c.hit_tokens += s->cached_tokens;
  return Info(*s);
}

absl::StatusOr<std::unique_ptr<AppendTxn>> SequenceStore::BeginAppend(const AppendSpec& spec) {
  const uint32_t l0 = spec.layer_begin;
  const uint32_t l1 = spec.layer_end.value_or(layout_.num_layers);
  if (l1 > layout_.num_layers || l0 >= l1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer range [", l0, ", ", l1, ") is empty or outside [0, ", layout_.num_layers, ")"));
  }
  if (spec.num_tokens == 0) return absl::InvalidArgumentError("num_tokens is 0: empty append");
  if (spec.num_tokens > options_.max_tokens_per_sequence) {
    return absl::InvalidArgumentError(absl::StrCat("num_tokens ", spec.num_tokens,
                                                   " exceeds max_tokens_per_sequence ",
                                                   options_.max_tokens_per_sequence));
  }
  if (!spec.token_ids.empty() && spec.token_ids.size() != spec.num_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("token_ids has ", spec.token_ids.size(),
                                                   " ids for num_tokens ", spec.num_tokens));
  }
  auto wire = Plan(l0, l1, spec.dtype, /*append=*/true);
  if (!wire.ok()) return wire.status();

  const uint64_t bt = layout_.block_tokens;
  std::unique_ptr<AppendTxn> txn(new AppendTxn());
  absl::MutexLock lock(&mu_);
  auto found = Find(spec.sequence_id, spec.tenant);
  if (!found.ok()) return found.status();
  SeqPtr s = *std::move(found);
  if (s->append_in_flight) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence_id ", s->id, " already has an append in flight"));
  }
  const uint64_t pos = s->layer_len[l0];
  if (wire->mode == Mode::kStorage && IsQuantized(wire->dtype) && wire->dtype != DType::kInt8 &&
      pos % layout_.block_tokens != 0) {
    // An fp8 block has one scale per head; a storage-format append brings its own, so it must
    // start a block (appends in fp32 / fp16 / bf16 can continue one: the server quantizes).
    return absl::InvalidArgumentError(
        absl::StrCat("an fp8 storage-format append must start on a block boundary; position ", pos,
                     " is inside a block of ", layout_.block_tokens, " tokens"));
  }
  for (uint32_t l = l0 + 1; l < l1; ++l) {
    if (s->layer_len[l] != pos) {
      return absl::FailedPreconditionError(
          absl::StrCat("layers ", l0, " and ", l, " of the range hold ", pos, " and ",
                       s->layer_len[l], " tokens; a layer-range append needs equal lengths"));
    }
  }
  if (spec.num_tokens > options_.max_tokens_per_sequence - pos) {
    return absl::ResourceExhaustedError(
        absl::StrCat("append of ", spec.num_tokens, " tokens at position ", pos,
                     " exceeds max_tokens_per_sequence ", options_.max_tokens_per_sequence));
  }
  if (!spec.token_ids.empty()) {
    if (pos > s->token_ids.size()) {
      return absl::InvalidArgumentError(absl::StrCat("token_ids start at position ", pos,
                                                     " but ids are known only up to ",
                                                     s->token_ids.size()));
    }
    for (uint64_t i = 0; pos + i < s->token_ids.size() && i < spec.num_tokens; ++i) {
      if (s->token_ids[pos + i] != spec.token_ids[i]) {
        return absl::InvalidArgumentError(absl::StrCat("token_ids[", i, "] = ", spec.token_ids[i],
                                                       " differs from the id already at position ",
                                                       pos + i, " (", s->token_ids[pos + i], ")"));
      }
    }
  }

  // Blocks touched: from the one holding `pos` to the one holding pos + n - 1. Existing ones that
  // are not writable (someone else references them, or they are published and so immutable) are
  // copied first (copy on write); missing ones are allocated.
  const uint64_t first = pos / bt;
  const uint64_t need = CeilDiv(pos + spec.num_tokens, bt);
  const uint64_t have = s->blocks.size();
  std::vector<size_t> cow;
  for (uint64_t i = first; i < std::min(have, need); ++i) {
    if (!pool_->Writable(s->blocks[i].id())) cow.push_back(i);
  }
  const uint64_t fresh = need > have ? need - have : 0;
  auto blocks = pool_->Allocate(cow.size() + fresh, s->tenant_id);
  if (!blocks.ok()) return blocks.status();

  txn->write_table_.reserve(std::max(need, have));
  for (const BlockRef& b : s->blocks) txn->write_table_.push_back(b.id());
  size_t next = 0;
  std::vector<int32_t> cow_src, cow_dst;
  for (size_t i : cow) {
    BlockRef copy = std::move((*blocks)[next++]);
    cow_src.push_back(s->blocks[i].id());
    cow_dst.push_back(copy.id());
    txn->write_table_[i] = copy.id();
    txn->replacements_.emplace_back(i, std::move(copy));
  }
  // NOTE: the sources are shared, hence immutable: copying them whole under mu_ is safe; at most
  // two blocks (the first and last an append touches) unless the sequence was forked mid-way.
  if (absl::Status c = pool_->memory().CopyBlocks(cow_src, cow_dst, block_layout().block_bytes);
      !c.ok()) {
    return c;
  }
  for (; next < blocks->size(); ++next) {
    txn->write_table_.push_back((*blocks)[next].id());
    txn->new_blocks_.push_back(std::move((*blocks)[next]));
  }

  s->append_in_flight = true;
  Renew(*s);
  txn->store_ = this;
  txn->seq_ = s;
  txn->spec_ = spec;
  txn->layer_end_ = l1;
  txn->position_ = pos;
  txn->dtype_ = wire->dtype;
  txn->storage_format_ = wire->mode == Mode::kStorage;
  Configure(*wire, l0, l1, pos, spec.num_tokens, txn->write_table_.data(), &txn->payload_,
            &txn->job_, &txn->codec_);
  return txn;
}

AppendTxn::~AppendTxn() {
  if (!done_ && store_ != nullptr) Abort();
}

absl::Status AppendTxn::Write(absl::Span<const uint8_t> data) {
  if (done_) return absl::FailedPreconditionError("append already finished");
  if (data.size() > payload_.total_bytes - written_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "payload exceeds the ", payload_.total_bytes, " bytes that ", spec_.num_tokens,
        " tokens of layers [", payload_.layer_begin, ", ", payload_.layer_end, ") take"));
  }
  if (data.empty()) return absl::OkStatus();
  if (!store_->pool_->memory().direct()) {
    if (staging_ == nullptr) {
      auto staged = store_->pool_->memory().Stage(payload_.total_bytes);
      if (!staged.ok()) return staged.status();
      staging_ = *std::move(staged);
    }
    std::memcpy(staging_->data() + written_, data.data(), data.size());
    if (job_.convert.has_value()) {
      // The elements this chunk completes must be finite, as RowCodec checks on direct memory.
      const uint32_t width = DTypeBytes(*job_.convert);
      const uint64_t end = (written_ + data.size()) / width;
      const int64_t bad = kernels::FindNonFinite(staging_->data() + checked_ * width, *job_.convert,
                                                 end - checked_);
      if (bad >= 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "payload holds NaN or Inf (",
            DescribePayloadByte(store_->block_layout(), payload_, (checked_ + bad) * width),
            "); refused, nothing stored"));
      }
      checked_ = end;
    }
  } else if (codec_ != nullptr) {
    if (absl::Status s = codec_->Write(written_, data); !s.ok()) return s;
  } else {
    uint8_t* bytes = const_cast<uint8_t*>(data.data());  // read, never written
    kernels::PayloadCopyCpu(job_.map, kernels::CopyDirection::kPayloadToPool, written_, bytes,
                            data.size());
    kernels::ScaleCopyCpu(job_.map, kernels::CopyDirection::kPayloadToPool, written_, bytes,
                          data.size());
  }
  written_ += data.size();
  return absl::OkStatus();
}

absl::StatusOr<SequenceInfo> AppendTxn::Commit() {
  if (done_) return absl::FailedPreconditionError("append already finished");
  if (written_ != payload_.total_bytes) {
    Abort();
    return absl::InvalidArgumentError(absl::StrCat(
        "payload has ", written_, " bytes; ", spec_.num_tokens, " tokens of layers [",
        payload_.layer_begin, ", ", payload_.layer_end, ") take ", payload_.total_bytes));
  }
  if (!store_->pool_->memory().direct()) {
    if (absl::Status f = FlushStaged(); !f.ok()) {
      Abort();
      return f;
    }
  } else if (storage_format_) {
    if (absl::Status v = ValidateStorageFormat(); !v.ok()) {
      Abort();
      return v;
    }
  }
  SequenceStore& st = *store_;
  absl::MutexLock lock(&st.mu_);
  Sequence& s = *seq_;
  if (s.removed) {
    done_ = true;
    s.append_in_flight = false;
    while (!s.blocks.empty()) s.blocks.pop_back();  // tail first, as in Remove
    replacements_.clear();  // the blocks go now, not when the caller drops the txn
    new_blocks_.clear();
    return absl::AbortedError(
        absl::StrCat("sequence_id ", s.id, " was freed while the append was in flight"));
  }
  for (auto& [index, block] : replacements_) s.blocks[index] = std::move(block);
  for (BlockRef& b : new_blocks_) s.blocks.push_back(std::move(b));
  for (uint32_t l = payload_.layer_begin; l < layer_end_; ++l) s.layer_len[l] += spec_.num_tokens;
  if (!spec_.token_ids.empty()) {
    const uint64_t known = s.token_ids.size() - position_;  // ids already there from this position
    for (uint64_t i = std::min<uint64_t>(known, spec_.num_tokens); i < spec_.num_tokens; ++i) {
      s.token_ids.push_back(spec_.token_ids[i]);
    }
  }
  s.append_in_flight = false;
  st.PublishFullBlocks(s);
  st.Retain(s);
  st.Renew(s);
  done_ = true;
  st.appends_.fetch_add(1, std::memory_order_relaxed);
  st.bytes_appended_.fetch_add(written_, std::memory_order_relaxed);
  return st.Info(s);
}

absl::Status AppendTxn::FlushStaged() {
  const uint8_t* payload = staging_ != nullptr ? staging_->data() : nullptr;
  if (storage_format_) {
    if (absl::Status v = ValidateStorageFormat(); !v.ok()) return v;
  }
  if (payload_.total_bytes == 0) return absl::OkStatus();
  return store_->pool_->memory().WritePayload(job_, payload);
}

absl::Status AppendTxn::ValidateStorageFormat() const {
  const BlockLayout& b = store_->block_layout();
  const uint64_t bt = b.block_tokens;
  // Where the scales and rows are: in the blocks (direct memory: written already), or in the
  // staged payload (PayloadLayout::MakeStorage's order).
  const uint8_t* staged = staging_ != nullptr ? staging_->data() : nullptr;
  auto scale_at = [&](const LayerView& v, uint32_t l, uint32_t kv, uint32_t h, uint64_t t) {
    float scale;
    if (staged != nullptr) {
      const uint64_t section = payload_.scale_offset[l - payload_.layer_begin];
      const uint64_t at =
          v.dtype == DType::kInt8
              ? section +
                    ((uint64_t{kv} * v.num_kv_heads + h) * payload_.num_tokens + (t - position_)) *
                        4
              : section + ((uint64_t{kv} * v.num_kv_heads + h) * payload_.num_blocks +
                           (t / bt - payload_.first_block)) *
                              4;
      std::memcpy(&scale, staged + at, 4);
    } else {
      const uint8_t* block = job_.map.pool + uint64_t(write_table_[t / bt]) * b.block_bytes;
      const uint32_t row = static_cast<uint32_t>(t % bt);
      std::memcpy(&scale,
                  block + (v.dtype == DType::kInt8 ? v.Int8Scale(kv, h, row) : v.Fp8Scale(kv, h)),
                  4);
    }
    return scale;
  };
  auto row_at = [&](const LayerView& v, uint32_t l, uint32_t kv, uint32_t h, uint64_t t) {
    if (staged != nullptr) {
      const uint64_t part = payload_.layer_offset[l - payload_.layer_begin] +
                            (kv == 0 ? 0 : payload_.KPartBytes(b, l));
      const uint64_t row_bytes = kv == 0 ? v.KRowBytes() : v.VRowBytes();
      return staged + part + (uint64_t{h} * payload_.num_tokens + (t - position_)) * row_bytes;
    }
    const uint8_t* block = job_.map.pool + uint64_t(write_table_[t / bt]) * b.block_bytes;
    const uint32_t row = static_cast<uint32_t>(t % bt);
    return block + (kv == 0 ? v.KRow(h, row) : v.VRow(h, row));
  };
  for (uint32_t l = payload_.layer_begin; l < layer_end_; ++l) {
    const LayerView& v = b.layers[l];
    for (uint32_t kv = 0; kv < v.KvParts(); ++kv) {
      for (uint32_t h = 0; h < v.num_kv_heads; ++h) {
        const uint32_t dim = kv == 0 ? v.head_dim : v.head_dim_v;
        for (uint64_t t = position_; t < position_ + spec_.num_tokens; ++t) {
          const float scale = scale_at(v, l, kv, h, t);
          if (v.dtype != DType::kInt8) {
            const uint8_t* q = row_at(v, l, kv, h, t);
            for (uint32_t i = 0; i < dim; ++i) {
              if (kernels::Fp8IsNonFinite(q[i], v.dtype)) {
                return absl::InvalidArgumentError(absl::StrCat(
                    "storage-format payload: layer ", l, ", ", kv ? "V" : "K", ", head ", h,
                    ", token ", t, ", element ", i, " is an fp8 NaN/Inf code"));
              }
            }
          }
          const bool ok = v.dtype == DType::kInt8 ? std::isfinite(scale) && scale >= 0
                                                  : std::isfinite(scale) && scale > 0;
          if (!ok) {
            return absl::InvalidArgumentError(
                absl::StrCat("storage-format payload: layer ", l, ", ", kv ? "V" : "K", ", head ",
                             h, ", token ", t, " has scale ", scale, "; scales must be finite and ",
                             v.dtype == DType::kInt8 ? "non-negative" : "positive"));
          }
        }
      }
    }
  }
  return absl::OkStatus();
}

void AppendTxn::Abort() {
  absl::MutexLock lock(&store_->mu_);
  done_ = true;
  seq_->append_in_flight = false;
  if (seq_->removed) {
    while (!seq_->blocks.empty()) seq_->blocks.pop_back();  // tail first, as in Remove
  }
  replacements_.clear();
  new_blocks_.clear();
}

absl::StatusOr<SequenceInfo> SequenceStore::Append(const AppendSpec& spec,
                                                   absl::Span<const uint8_t> payload) {
  auto txn = BeginAppend(spec);
  if (!txn.ok()) return txn.status();
  if (absl::Status st = (*txn)->Write(payload); !st.ok()) return st;
  return (*txn)->Commit();
}

absl::StatusOr<std::unique_ptr<FetchReader>> SequenceStore::BeginFetch(const FetchSpec& spec) {
  const uint32_t l0 = spec.layer_begin;
  const uint32_t l1 = spec.layer_end.value_or(layout_.num_layers);
  if (l1 > layout_.num_layers || l0 >= l1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer range [", l0, ", ", l1, ") is empty or outside [0, ", layout_.num_layers, ")"));
  }
  auto wire = Plan(l0, l1, spec.dtype, /*append=*/false);
  if (!wire.ok()) return wire.status();
  std::unique_ptr<FetchReader> r(new FetchReader());
  uint64_t n = 0;
  {
    absl::MutexLock lock(&mu_);
    auto found = Find(spec.sequence_id, spec.tenant);
    if (!found.ok()) return found.status();
    Sequence& s = **found;
    uint64_t avail = std::numeric_limits<uint64_t>::max();
    for (uint32_t l = l0; l < l1; ++l) avail = std::min(avail, s.layer_len[l]);
    const uint64_t t1 = spec.token_end.value_or(avail);
    if (spec.token_begin > t1 || t1 > avail) {
      return absl::OutOfRangeError(absl::StrCat("token range [", spec.token_begin, ", ", t1,
                                                ") is outside the ", avail, " tokens layers [", l0,
                                                ", ", l1, ") hold"));
    }
    const uint64_t bt = layout_.block_tokens;
    const uint64_t b0 = spec.token_begin / bt, b1 = CeilDiv(t1, bt);
    r->table_.assign(b1, -1);
    for (uint64_t i = b0; i < b1; ++i) {
      if (!s.blocks[i].valid()) {
        return absl::FailedPreconditionError(
            absl::StrCat("token range [", spec.token_begin, ", ", t1, ") reaches tokens [", i * bt,
                         ", ", (i + 1) * bt, ") the sequence's sliding window released"));
      }
      r->refs_.push_back(pool_->Share(s.blocks[i]));
      r->table_[i] = s.blocks[i].id();
    }
    r->token_begin_ = spec.token_begin;
    n = t1 - spec.token_begin;
    Renew(s);
  }
  r->dtype_ = wire->dtype;
  Configure(*wire, l0, l1, r->token_begin_, n, r->table_.data(), &r->payload_, &r->job_,
            &r->codec_);
  if (absl::Status st = StageFetch(*r); !st.ok()) return st;
  fetches_.fetch_add(1, std::memory_order_relaxed);
  bytes_fetched_.fetch_add(r->payload_.total_bytes, std::memory_order_relaxed);
  return r;
}

void FetchReader::Read(uint64_t offset, absl::Span<uint8_t> out) const {
  if (out.empty()) return;
  if (staged_ != nullptr) {
    std::memcpy(out.data(), staged_->data() + offset, out.size());
  } else if (codec_ != nullptr) {
    codec_->Read(offset, out);
  } else {
    kernels::PayloadCopyCpu(job_.map, kernels::CopyDirection::kPoolToPayload, offset, out.data(),
                            out.size());
    kernels::ScaleCopyCpu(job_.map, kernels::CopyDirection::kPoolToPayload, offset, out.data(),
                          out.size());
  }
}

absl::Status SequenceStore::StageFetch(FetchReader& r) {
  PoolMemory& memory = pool_->memory();
  if (memory.direct()) return absl::OkStatus();
  // NOTE: the whole payload at once: the device gathers (and dequantizes) it in one pass and
  // one copy brings it over; the reader's blocks stay referenced until it is destroyed.
  auto staged = memory.Stage(r.payload_.total_bytes);
  if (!staged.ok()) return staged.status();
  if (r.payload_.total_bytes > 0) {
    if (absl::Status s = memory.ReadPayload(r.job_, (*staged)->data()); !s.ok()) return s;
  }
  r.staged_ = *std::move(staged);
  return absl::OkStatus();
}

void SequenceStore::Configure(const Transfer& t, uint32_t l0, uint32_t l1, uint64_t token_begin,
                              uint64_t n, const int32_t* table, PayloadLayout* payload,
                              PayloadJob* job, std::unique_ptr<RowCodec>* codec) const {
  switch (t.mode) {
    case Mode::kPlain:
      *payload = PayloadLayout::Make(block_layout(), l0, l1, n);
      break;
    case Mode::kConvert:
      *payload = PayloadLayout::Make(block_layout(), l0, l1, n, t.dtype);
      break;
    case Mode::kStorage:
      *payload = PayloadLayout::MakeStorage(block_layout(), l0, l1, token_begin, n);
      break;
  }
  kernels::PayloadMap* map = &job->map;
  *map = MakeMap(*payload);
  map->block_table = table;
  map->token_begin = token_begin;
  if (t.mode == Mode::kStorage) {
    map->scale_offset = payload->scale_offset.data();
    map->first_block = payload->first_block;
  }
  job->convert.reset();
  if (t.mode == Mode::kConvert) job->convert = t.dtype;
  if (t.mode == Mode::kConvert && pool_->memory().direct()) {
    *codec = std::make_unique<RowCodec>(block_layout(), *payload, t.dtype, pool_->base(), table,
                                        token_begin);
  }
}

absl::StatusOr<SequenceStore::Transfer> SequenceStore::Plan(uint32_t l0, uint32_t l1,
                                                            std::optional<DType> requested,
                                                            bool append) const {
  const DType wire = requested.value_or(DefaultWireDType(layout_, l0, l1));
  if (IsQuantized(wire)) {
    // The storage format: every layer of the range must store exactly this dtype.
    for (uint32_t l = l0; l < l1; ++l) {
      if (layout_.layer_dtypes[l] != wire) {
        return absl::InvalidArgumentError(
            absl::StrCat("dtype ", DTypeName(wire), " (storage format) but layer ", l, " stores ",
                         DTypeName(layout_.layer_dtypes[l]),
                         "; transfer fp32, fp16 or bf16, or a layer range "
                         "that stores ",
                         DTypeName(wire)));
      }
    }
    return Transfer{wire, Mode::kStorage};
  }
  bool plain = true;
  for (uint32_t l = l0; l < l1; ++l) {
    const DType stored = layout_.layer_dtypes[l];
    if (stored == wire) continue;
    plain = false;
    if (append && wire != layout_.input_dtype) {
      return absl::InvalidArgumentError(absl::StrCat(
          "dtype ", DTypeName(wire), " does not match layer ", l, " storage dtype ",
          DTypeName(stored), " nor the model's input dtype ", DTypeName(layout_.input_dtype)));
    }
  }
  return Transfer{wire, plain ? Mode::kPlain : Mode::kConvert};
}

absl::StatusOr<SequenceInfo> SequenceStore::Fork(uint64_t id, std::optional<absl::Duration> lease,
                                                 const std::string& tenant) {
  absl::MutexLock lock(&mu_);
  auto found = Find(id, tenant);
  if (!found.ok()) return found.status();
  Sequence& parent = **found;
  absl::Duration ttl = parent.lease_ttl;
  if (lease.has_value()) {
    auto resolved = ResolveLease(lease);
    if (!resolved.ok()) return resolved.status();
    ttl = *resolved;
  }
  if (live_.size() >= options_.max_sequences) {
    return absl::ResourceExhaustedError(absl::StrCat("model '", layout_.name,
                                                     "' has max_sequences (",
                                                     options_.max_sequences, ") live sequences"));
  }
  const uint64_t bt = layout_.block_tokens;
  const uint64_t full = parent.Length() / bt;  // blocks full in every layer: shared
  const uint64_t max_len = *std::max_element(parent.layer_len.begin(), parent.layer_len.end());
  const uint64_t partial = CeilDiv(max_len, bt) - full;  // blocks some layer has rows in: copied
  auto copies = pool_->Allocate(partial, parent.tenant_id);
  if (!copies.ok()) return copies.status();
  std::vector<kernels::RowCopy> rows;
  for (uint64_t j = 0; j < partial; ++j) {
    const uint64_t i = full + j;
    for (uint32_t l = 0; l < layout_.num_layers; ++l) {
      const uint64_t len = parent.layer_len[l];
      const uint64_t n = len <= i * bt ? 0 : std::min<uint64_t>(len - i * bt, bt);
      // Only rows below the lengths: an append in flight may be writing the rows past them.
      for (uint32_t r = 0; r < n; ++r) {
        rows.push_back({parent.blocks[i].id(), (*copies)[j].id(), r, r, l});
      }
    }
  }
  if (absl::Status c = pool_->memory().CopyRows(block_layout(), rows); !c.ok()) return c;

  SeqPtr child = Insert(ttl, parent.tenant);
  child->root = parent.root;
  child->extra_keys = parent.extra_keys;
  child->lora = parent.lora;
  child->priority = parent.priority;
  child->hashes = parent.hashes;
  child->retention = parent.retention;
  child->scores = parent.scores;
  child->publishable = parent.publishable;
  child->layer_len = parent.layer_len;
  child->token_ids = parent.token_ids;
  child->cached_tokens = parent.cached_tokens;
  for (uint64_t i = 0; i < full; ++i) {
    child->blocks.push_back(parent.blocks[i].valid() ? pool_->Share(parent.blocks[i]) : BlockRef());
  }
  for (BlockRef& copy : *copies) child->blocks.push_back(std::move(copy));
  Renew(parent);
  return Info(*child);
}

absl::StatusOr<SequenceInfo> SequenceStore::Truncate(uint64_t id, uint64_t num_tokens,
                                                     const std::string& tenant) {
  absl::MutexLock lock(&mu_);
  auto found = Find(id, tenant);
  if (!found.ok()) return found.status();
  Sequence& s = **found;
  if (s.append_in_flight) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence_id ", id, " has an append in flight; truncate after it ends"));
  }
  const uint64_t len = s.Length();
  if (num_tokens > len) {
    return absl::OutOfRangeError(
        absl::StrCat("num_tokens ", num_tokens, " is past the end: the sequence holds ", len));
  }
  if (const uint64_t tail = CeilDiv(num_tokens, layout_.block_tokens);
      tail > 0 && !s.blocks[tail - 1].valid()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot truncate to ", num_tokens, " tokens: the sliding window released that block"));
  }
  for (uint64_t& l : s.layer_len) l = num_tokens;
  if (s.token_ids.size() > num_tokens) s.token_ids.resize(num_tokens);
  s.cached_tokens = std::min(s.cached_tokens, num_tokens);
  // Blocks past the end are dropped tail first; a block cut in two keeps its place in the index
  // (it is immutable) but leaves the sequence's hash chain, and is copied before any write.
  const uint64_t keep = CeilDiv(num_tokens, layout_.block_tokens);
  while (s.blocks.size() > keep) s.blocks.pop_back();
  if (s.scores.size() > num_tokens) s.scores.resize(num_tokens);
  s.hashes.resize(std::min<uint64_t>(s.hashes.size(), num_tokens / layout_.block_tokens));
  Renew(s);
  return Info(s);
}

absl::StatusOr<uint64_t> SequenceStore::Free(uint64_t id, const std::string& tenant) {
  absl::MutexLock lock(&mu_);
  auto found = Find(id, tenant);
  if (!found.ok()) return found.status();
  return Remove(*found, "it was freed");
}

absl::StatusOr<SequenceInfo> SequenceStore::RenewLease(uint64_t id, const std::string& tenant) {
  absl::MutexLock lock(&mu_);
  auto found = Find(id, tenant);
  if (!found.ok()) return found.status();
  Renew(**found);
  return Info(**found);
}

absl::StatusOr<SequenceInfo> SequenceStore::Get(uint64_t id, const std::string& tenant) {
  absl::MutexLock lock(&mu_);
  auto found = Find(id, tenant);
  if (!found.ok()) return found.status();
  return Info(**found);
}

size_t SequenceStore::ExpireLeases(absl::Time now) {
  absl::MutexLock lock(&mu_);
  std::vector<SeqPtr> expired;
  for (const auto& [id, s] : live_) {
    if (s->lease_deadline <= now) expired.push_back(s);
  }
  for (const SeqPtr& s : expired) Remove(s, "its lease expired");
  leases_expired_ += expired.size();
  return expired.size();
}

StoreStats SequenceStore::Stats() const {
  StoreStats st;
  {
    absl::MutexLock lock(&mu_);
    st.sequences = live_.size();
    absl::flat_hash_map<std::string, TenantStats> tenants;
    for (const auto& [id, s] : live_) {
      st.tokens_stored += s->Length();
      TenantStats& t = tenants[s->tenant];
      ++t.sequences;
    }
    for (const auto& [name, c] : tenant_counters_) {
      TenantStats& t = tenants[name];
      t.prefix_query_tokens = c.query_tokens;
      t.prefix_hit_tokens = c.hit_tokens;
      st.prefix_query_tokens += c.query_tokens;
      st.prefix_hit_tokens += c.hit_tokens;
    }
    for (auto& [name, t] : tenants) {
      t.tenant = name;
      t.blocks_referenced = pool_->TenantBlocks(pool_->InternTenant(name));
      st.tenants.push_back(std::move(t));
    }
    st.leases_expired = leases_expired_;
  }
  std::sort(st.tenants.begin(), st.tenants.end(),
            [](const TenantStats& a, const TenantStats& b) { return a.tenant < b.tenant; });
  st.pool = pool_->Stats();
  st.appends = appends_.load(std::memory_order_relaxed);
  st.fetches = fetches_.load(std::memory_order_relaxed);
  st.bytes_appended = bytes_appended_.load(std::memory_order_relaxed);
  st.bytes_fetched = bytes_fetched_.load(std::memory_order_relaxed);
  return st;
}

std::string SequenceStore::CheckInvariants() const {
  if (std::string e = pool_->CheckInvariants(); !e.empty()) return e;
  absl::MutexLock lock(&mu_);
  for (const auto& [id, s] : live_) {
    const uint64_t max_len = *std::max_element(s->layer_len.begin(), s->layer_len.end());
    if (s->blocks.size() != CeilDiv(max_len, layout_.block_tokens) && !s->append_in_flight) {
      return absl::StrCat("sequence ", id, " has ", s->blocks.size(), " blocks for ", max_len,
                          " tokens");
    }
    for (const BlockRef& b : s->blocks) {
      if (!b.valid() && s->retention.kind == RetentionPolicy::Kind::kSlidingWindow) continue;
      if (!b.valid() || pool_->RefCount(b.id()) == 0) {
        return absl::StrCat("sequence ", id, " holds a dead block reference");
      }
    }
  }
  return "";
}

}  // namespace kvbank
