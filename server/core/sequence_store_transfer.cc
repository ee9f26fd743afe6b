// SequenceStore: moving KV in and out. BeginAppend / BeginFetch plan a transfer under the lock
// (which blocks, copy-on-write, which format) and hand it to the pool memory's writer or reader
// (transfer.h), which moves the bytes outside the lock.
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

absl::Status SequenceStore::CheckLayerRange(uint32_t l0, uint32_t l1) const {
  if (l1 > layout_.num_layers || l0 >= l1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer range [", l0, ", ", l1, ") is empty or outside [0, ", layout_.num_layers, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<AppendTxn>> SequenceStore::BeginAppend(const AppendSpec& spec) {
  const uint32_t l0 = spec.layer_begin;
  const uint32_t l1 = spec.layer_end.value_or(layout_.num_layers);
  if (absl::Status s = CheckLayerRange(l0, l1); !s.ok()) return s;
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
  auto wire = PlanTransfer(l0, l1, spec.dtype, /*append=*/true);
  if (!wire.ok()) return wire.status();

  const uint64_t bt = layout_.block_tokens;
  std::unique_ptr<AppendTxn> txn(new AppendTxn());
  absl::ReleasableMutexLock lock(&mu_);
  auto found = Find(spec.sequence_id, spec.tenant);
  if (!found.ok()) return found.status();
  SeqPtr s = *std::move(found);
  if (s->append_in_flight) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence_id ", s->id, " already has an append in flight"));
  }
  const uint64_t pos = s->layer_len[l0];
  if (wire->mode == TransferMode::kStorage && IsQuantized(wire->dtype) &&
      wire->dtype != DType::kInt8 && pos % layout_.block_tokens != 0) {
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
  const uint64_t have = s->table.size();
  std::vector<size_t> cow;
  for (uint64_t i = first; i < std::min(have, need); ++i) {
    if (!pool_->Writable(s->table.at(i).id())) cow.push_back(i);
  }
  const uint64_t fresh = need > have ? need - have : 0;
  auto blocks = pool_->Allocate(cow.size() + fresh, s->tenant_id);
  if (!blocks.ok()) return blocks.status();

  std::vector<int32_t> table = s->table.Ids();
  table.reserve(std::max(need, have));
  size_t next = 0;
  std::vector<int32_t> cow_src, cow_dst;
  std::vector<BlockRef> cow_sources;  // held while they are copied
  for (size_t i : cow) {
    BlockRef copy = std::move((*blocks)[next++]);
    cow_src.push_back(s->table.at(i).id());
    cow_dst.push_back(copy.id());
    cow_sources.push_back(pool_->Share(s->table.at(i)));
    table[i] = copy.id();
    txn->replacements_.emplace_back(i, std::move(copy));
  }
  for (; next < blocks->size(); ++next) {
    table.push_back((*blocks)[next].id());
    txn->new_blocks_.push_back(std::move((*blocks)[next]));
  }

  s->append_in_flight = true;
  Renew(*s);
  txn->store_ = this;
  txn->seq_ = s;
  txn->spec_ = spec;
  txn->layer_end_ = l1;
  txn->position_ = pos;
  txn->own_blocks_ = have;
  lock.Release();

  // Outside the lock: the sources are shared, hence immutable (at most the two blocks at the
  // ends of the append, unless the sequence was forked mid-way), and the copies are the
  // transaction's own. Failing here drops the transaction, which undoes everything.
  if (absl::Status c = pool_->memory().CopyBlocks(cow_src, cow_dst, block_layout().block_bytes);
      !c.ok()) {
    return c;
  }
  cow_sources.clear();
  AppendTxn* t = txn.get();
  auto writer = pool_->memory().BeginWrite(
      block_layout(), MakeTransfer(*wire, l0, l1, pos, spec.num_tokens, std::move(table)),
      [t](uint64_t index) { return t->MakePrivate(index); });
  if (!writer.ok()) return writer.status();
  txn->writer_ = *std::move(writer);
  return txn;
}

AppendTxn::~AppendTxn() {
  if (!done_ && store_ != nullptr) Abort();
}

absl::Status AppendTxn::Write(absl::Span<const uint8_t> data) {
  if (done_) return absl::FailedPreconditionError("append already finished");
  return writer_->Write(data);
}

absl::StatusOr<SequenceInfo> AppendTxn::Commit() {
  if (done_) return absl::FailedPreconditionError("append already finished");
  const PayloadLayout& payload = writer_->spec().payload;
  if (writer_->written() != payload.total_bytes) {
    Abort();
    return absl::InvalidArgumentError(absl::StrCat(
        "payload has ", writer_->written(), " bytes; ", spec_.num_tokens, " tokens of layers [",
        payload.layer_begin, ", ", payload.layer_end, ") take ", payload.total_bytes));
  }
  if (absl::Status f = writer_->Finish(); !f.ok()) {
    Abort();
    return f;
  }
  const uint64_t written = writer_->written();
  SequenceStore& st = *store_;
  Sequence& s = *seq_;
  std::optional<SequenceStore::Compaction> compaction;
  {
    absl::MutexLock lock(&st.mu_);
    done_ = true;
    if (s.removed) {
      s.append_in_flight = false;
      s.table.Clear();        // tail first, as in Remove
      replacements_.clear();  // the blocks go now, not when the caller drops the txn
      new_blocks_.clear();
      return absl::AbortedError(
          absl::StrCat("sequence_id ", s.id, " was freed while the append was in flight"));
    }
    for (auto& [index, block] : replacements_) s.table.Replace(index, std::move(block));
    for (BlockRef& b : new_blocks_) s.table.Append(std::move(b));
    replacements_.clear();
    new_blocks_.clear();
    for (uint32_t l = payload.layer_begin; l < layer_end_; ++l) s.layer_len[l] += spec_.num_tokens;
    if (!spec_.token_ids.empty()) {
      const uint64_t known = s.token_ids.size() - position_;  // ids already there from here on
      for (uint64_t i = std::min<uint64_t>(known, spec_.num_tokens); i < spec_.num_tokens; ++i) {
        s.token_ids.push_back(spec_.token_ids[i]);
      }
    }
    st.PublishFullBlocks(s);
    compaction = st.Retain(s);
    st.Account(s);
    SequenceStore::TenantCounters& c = st.tenant_counters_[s.tenant];
    ++c.appends;
    c.bytes_appended += written;
    st.appends_.fetch_add(1, std::memory_order_relaxed);
    st.bytes_appended_.fetch_add(written, std::memory_order_relaxed);
    if (!compaction.has_value()) {
      s.append_in_flight = false;
      st.Renew(s);
      return st.Info(s);
    }
  }
  // The append is visible; the sequence stays marked in flight (no other append, truncate or
  // expiry) while the kept rows are copied outside the lock.
  const absl::Status copied = st.pool_->memory().CopyRows(st.block_layout(), compaction->rows);
  compaction->sources.clear();
  absl::MutexLock lock(&st.mu_);
  s.append_in_flight = false;
  if (s.removed) {
    s.table.Clear();  // freed meanwhile: its blocks go now
  } else if (copied.ok()) {
    st.ApplyCompaction(s, *std::move(compaction));
    st.Account(s);
  }  // else the next append tries again
  st.Renew(s);
  return st.Info(s);
}

absl::StatusOr<int32_t> AppendTxn::MakePrivate(uint64_t index) {
  const std::vector<int32_t>& table = writer_->spec().table;
  // Blocks past the sequence's own are the transaction's, and so are the copies.
  if (index >= own_blocks_) return table[index];
  for (const auto& [i, block] : replacements_) {
    if (i == index) return table[index];
  }
  SequenceStore& st = *store_;
  BlockRef copy;
  {
    absl::MutexLock lock(&st.mu_);
    auto blocks = st.pool_->Allocate(1, seq_->tenant_id);
    if (!blocks.ok()) return blocks.status();
    copy = std::move((*blocks)[0]);
  }
  // NOTE: the source is the sequence's block, held while the append is in flight; its rows past
  // the sequence's length are this append's, copied along with the rest.
  const int32_t src = table[index], dst = copy.id();
  if (absl::Status c =
          st.pool_->memory().CopyBlocks({&src, 1}, {&dst, 1}, st.block_layout().block_bytes);
      !c.ok()) {
    return c;
  }
  replacements_.emplace_back(index, std::move(copy));
  return dst;
}

void AppendTxn::Abort() {
  absl::MutexLock lock(&store_->mu_);
  done_ = true;
  seq_->append_in_flight = false;
  if (seq_->removed) {
    seq_->table.Clear();  // tail first, as in Remove
  } else {
    store_->Renew(*seq_);  // the lease did not run while the append was in flight
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
  if (absl::Status s = CheckLayerRange(l0, l1); !s.ok()) return s;
  auto wire = PlanTransfer(l0, l1, spec.dtype, /*append=*/false);
  if (!wire.ok()) return wire.status();
  auto heads = ResolveHeads(spec.kv_head_begin, spec.kv_head_end);
  if (!heads.ok()) return heads.status();
  std::unique_ptr<FetchReader> r(new FetchReader());
  std::vector<int32_t> table;
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
    table.assign(b1, BlockTable::kHoleId);
    for (uint64_t i = b0; i < b1; ++i) {
      if (s.table.hole(i)) {
        return absl::FailedPreconditionError(
            absl::StrCat("token range [", spec.token_begin, ", ", t1, ") reaches tokens [", i * bt,
                         ", ", (i + 1) * bt, ") the sequence's sliding window released"));
      }
      r->refs_.push_back(pool_->Share(s.table.at(i)));
      table[i] = s.table.at(i).id();
    }
    r->token_begin_ = spec.token_begin;
    n = t1 - spec.token_begin;
    Renew(s);
  }
  auto reader = pool_->memory().BeginRead(
      block_layout(), MakeTransfer(*wire, l0, l1, r->token_begin_, n, std::move(table), *heads));
  if (!reader.ok()) return reader.status();
  r->reader_ = *std::move(reader);
  r->kv_head_begin_ = heads->begin;
  r->kv_head_end_ = heads->count == 0 ? layout_.num_kv_heads : heads->begin + heads->count;
  CountFetch(spec.tenant, r->payload_bytes());
  return r;
}

void SequenceStore::CountFetch(const std::string& tenant, uint64_t bytes) {
  fetches_.fetch_add(1, std::memory_order_relaxed);
  bytes_fetched_.fetch_add(bytes, std::memory_order_relaxed);
  absl::MutexLock lock(&mu_);
  TenantCounters& c = tenant_counters_[tenant];
  ++c.fetches;
  c.bytes_fetched += bytes;
}

absl::StatusOr<HeadRange> SequenceStore::ResolveHeads(uint32_t begin,
                                                      std::optional<uint32_t> end) const {
  if (layout_.kind == AttentionKind::kMla) return HeadRange{};
  const uint32_t e = end.value_or(layout_.num_kv_heads);
  if (begin >= e || e > layout_.num_kv_heads) {
    return absl::InvalidArgumentError(absl::StrCat("kv head range [", begin, ", ", e,
                                                   ") is empty or outside the model's ",
                                                   layout_.num_kv_heads, " kv heads"));
  }
  if (begin == 0 && e == layout_.num_kv_heads) return HeadRange{};
  return HeadRange{begin, e - begin};
}

TransferSpec SequenceStore::MakeTransfer(const Plan& plan, uint32_t l0, uint32_t l1,
                                         uint64_t token_begin, uint64_t n,
                                         std::vector<int32_t> table, HeadRange heads) const {
  TransferSpec t;
  t.mode = plan.mode;
  t.dtype = plan.dtype;
  t.token_begin = token_begin;
  if (heads.count != 0) t.heads = block_layout().Heads(heads.begin, heads.count);
  const BlockLayout& b = t.heads ? *t.heads : block_layout();
  switch (plan.mode) {
    case TransferMode::kPlain:
      t.payload = PayloadLayout::Make(b, l0, l1, n);
      break;
    case TransferMode::kConvert:
      t.payload = PayloadLayout::Make(b, l0, l1, n, plan.dtype);
      break;
    case TransferMode::kStorage:
      t.payload = PayloadLayout::MakeStorage(b, l0, l1, token_begin, n);
      break;
  }
  t.table = std::move(table);
  t.staging_bytes = pool_->staging_bytes();
  return t;
}

absl::StatusOr<SequenceStore::Plan> SequenceStore::PlanTransfer(uint32_t l0, uint32_t l1,
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
    return Plan{wire, TransferMode::kStorage};
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
  return Plan{wire, plain ? TransferMode::kPlain : TransferMode::kConvert};
}

}  // namespace kvbank
