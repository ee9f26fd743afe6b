// SequenceStore: moving KV in and out. BeginAppend / BeginFetch plan a transfer under the lock
// (which blocks, copy-on-write, which format) and hand it to the pool memory's writer or reader
// (transfer.h), which moves the bytes outside the lock.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/cleanup/cleanup.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/quant.h"
#include "server/core/sequence.h"
#include "server/core/sequence_store.h"

namespace kvbank {

absl::StatusOr<AppendRegion> SequenceStore::CheckAppendAt(const Sequence& s, const AppendSpec& spec,
                                                          const TransferPlan& wire,
                                                          uint64_t pos) const {
  const uint32_t l0 = wire.layer_begin, l1 = wire.layer_end;
  const uint32_t h0 = wire.head_begin, h1 = wire.head_end;
  const uint32_t num_heads = layout_.num_kv_heads;
  const uint64_t bt = layout_.block_tokens;
  for (uint32_t l = l0; l < l1; ++l) {
    for (uint32_t h = h0; h < h1; ++h) {
      if (const uint64_t len = s.HeadLength(l, h, num_heads); len != pos) {
        return absl::FailedPreconditionError(absl::StrCat(
            "layer ", l0, " kv head ", h0, " holds ", pos, " tokens but layer ", l, " kv head ", h,
            " holds ", len, "; an append needs equal lengths over its layers and heads"));
      }
    }
  }
  bool fp8 = false;
  for (uint32_t l = l0; l < l1; ++l) {
    fp8 = fp8 || layout_.layer_dtypes[l] == DType::kFp8E4M3 ||
          layout_.layer_dtypes[l] == DType::kFp8E5M2;
  }
  if (wire.mode == TransferMode::kStorage && fp8 && pos % bt != 0) {
    // An fp8 block has one scale per head; a storage-format append brings its own, so it must
    // start a block (appends in fp32 / fp16 / bf16 can continue one: the server quantizes).
    return absl::InvalidArgumentError(
        absl::StrCat("an fp8 storage-format append must start on a block boundary; position ", pos,
                     " is inside a block of ", layout_.block_tokens, " tokens"));
  }
  if (spec.num_tokens > options_.max_tokens_per_sequence - pos) {
    return absl::ResourceExhaustedError(
        absl::StrCat("append of ", spec.num_tokens, " tokens at position ", pos,
                     " exceeds max_tokens_per_sequence ", options_.max_tokens_per_sequence));
  }
  AppendRegion region{0,
                      l0,
                      l1,
                      h0,
                      h1,
                      pos / bt,
                      CeilDiv(pos + spec.num_tokens, bt),
                      /*exclusive=*/fp8 && pos % bt != 0};
  for (const AppendRegion& other : s.appends) {
    if (!other.Overlaps(region)) continue;
    return absl::FailedPreconditionError(absl::StrCat(
        "sequence_id ", s.id, " already has an append in flight over layers [", other.layer_begin,
        ", ", other.layer_end, ") kv heads [", other.head_begin, ", ", other.head_end, ")",
        region.exclusive || other.exclusive ? "; an fp8 append that continues a block runs alone"
                                            : ""));
  }
  if (s.compacting) {
    return absl::FailedPreconditionError(absl::StrCat(
        "sequence_id ", s.id, " is being compacted (heavy-hitter retention); append again"));
  }
  if (!spec.token_ids.empty()) {
    if (pos > s.token_ids.size()) {
      return absl::InvalidArgumentError(absl::StrCat("token_ids start at position ", pos,
                                                     " but ids are known only up to ",
                                                     s.token_ids.size()));
    }
    for (uint64_t i = 0; pos + i < s.token_ids.size() && i < spec.num_tokens; ++i) {
      if (s.token_ids[pos + i] != spec.token_ids[i]) {
        return absl::InvalidArgumentError(absl::StrCat("token_ids[", i, "] = ", spec.token_ids[i],
                                                       " differs from the id already at position ",
                                                       pos + i, " (", s.token_ids[pos + i], ")"));
      }
    }
  }
  return region;
}

absl::StatusOr<std::unique_ptr<AppendTxn>> SequenceStore::BeginAppend(const AppendSpec& spec) {
  auto wire = planner_.Plan(
      {spec.layer_begin, spec.layer_end, spec.kv_head_begin, spec.kv_head_end, spec.dtype},
      /*append=*/true);
  if (!wire.ok()) return wire.status();
  const uint32_t l0 = wire->layer_begin, l1 = wire->layer_end;
  const uint32_t h0 = wire->head_begin, h1 = wire->head_end;
  const uint32_t num_heads = layout_.num_kv_heads;
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

  const uint64_t bt = layout_.block_tokens;
  std::unique_ptr<AppendTxn> txn(new AppendTxn());  // before the locks: its undo takes mu_
  SeqPtr s;
  uint64_t pos = 0;
  std::vector<int32_t> table;
  // Copy on write: logical blocks, their copies, and references on the sources while copied.
  std::vector<size_t> cow;
  std::vector<BlockRef> copies, cow_sources;
  // Blocks Allocate evicts are copied down a tier after the lock, before any byte moves here.
  BlockPool::DeferEvictions evictions(pool_.get());
  {
    CoreLock lock(&mu_);
    auto found = Find(spec.sequence_id, spec.tenant);
    if (!found.ok()) return found.status();
    s = *std::move(found);
    if (s->table_copying) {
      // Another append is copying blocks it shares with this one's: wait for the table it makes.
      mu_.Await(absl::Condition(
          +[](Sequence* q) { return !q->table_copying; }, s.get()));
      if (s->removed) return Find(spec.sequence_id, spec.tenant).status();
    }
    pos = s->HeadLength(l0, h0, num_heads);
    auto checked = CheckAppendAt(*s, spec, *wire, pos);
    if (!checked.ok()) return checked.status();
    AppendRegion region = *checked;
    const uint64_t first = region.block_begin, need = region.block_end;

    // Blocks touched: from the one holding `pos` to the one holding pos + n - 1. Existing ones
    // that must not change (published, or the block a truncate cut while someone else holds it)
    // are copied first (copy on write), unless an append in flight writes into them already (it
    // made them safe to write when it began). Missing ones are allocated and go into the table
    // now, so that appends of the other heads of the same tokens write into them too.
    const uint64_t have = s->table.size();
    for (uint64_t i = first; i < std::min(have, need); ++i) {
      bool in_flight = false;
      for (AppendRegion& a : s->appends) {
        if (a.block_begin <= i && i < a.block_end) in_flight = a.joined = region.joined = true;
      }
      if (in_flight) continue;
      // Published blocks are immutable; the cut block is read past its length by readers from
      // before the truncate (Sequence::cut_block); any other block another holds is a reader's,
      // which reads no row this append writes.
      const int32_t id = s->table.at(i).id();
      if (pool_->Published(id) || (i == s->cut_block && !pool_->Writable(id))) cow.push_back(i);
    }
    const uint64_t fresh = need > have ? need - have : 0;
    auto blocks = pool_->Allocate(cow.size() + fresh, s->tenant_id);
    if (!blocks.ok()) return blocks.status();
    for (uint64_t j = cow.size(); j < blocks->size(); ++j) s->table.Append(std::move((*blocks)[j]));

    region.id = ++last_append_region_;
    s->appends.push_back(region);
    Renew(*s);
    txn->store_ = this;
    txn->seq_ = s;
    txn->spec_ = spec;
    txn->region_ = region.id;
    txn->layer_end_ = l1;
    txn->head_begin_ = h0;
    txn->head_end_ = h1;
    txn->position_ = pos;
    txn->own_blocks_ = have;
    txn->awaited_ = s->handed_off;
    copies.assign(std::make_move_iterator(blocks->begin()),
                  std::make_move_iterator(blocks->begin() + cow.size()));
    for (size_t i : cow) cow_sources.push_back(pool_->Share(s->table.at(i)));
    s->table_copying = !cow.empty();
    if (cow.empty()) {
      table = s->table.Ids();
      table.resize(need);  // another append in flight may have grown the table further
    }
  }  // mu_
  evictions.Run();
  if (!cow.empty()) {
    // Outside the lock: the sources are shared, hence immutable (at most the two blocks at the
    // ends of the append, unless the sequence was forked mid-way), and the copies are no one
    // else's yet. Readers go on reading the sources; appends that begin meanwhile wait.
    std::vector<int32_t> src, dst;
    for (size_t j = 0; j < cow.size(); ++j) {
      src.push_back(cow_sources[j].id());
      dst.push_back(copies[j].id());
    }
    const absl::Status c = pool_->memory().CopyBlocks(src, dst, pool_->layout().block_bytes);
    CoreLock lock(&mu_);
    s->table_copying = false;
    // Failing drops the transaction (after the lock), which undoes everything.
    if (!c.ok()) return c;
    for (size_t j = 0; j < cow.size(); ++j) {
      s->table.Replace(cow[j], std::move(copies[j]));
      txn->originals_.emplace_back(cow[j], std::move(cow_sources[j]));
    }
    table = s->table.Ids();
    table.resize(CeilDiv(pos + spec.num_tokens, bt));
  }

  AppendTxn* t = txn.get();
  auto writer = pool_->memory().BeginWrite(
      pool_->layout(), planner_.Make(*wire, pos, spec.num_tokens, std::move(table)),
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
  const uint32_t num_heads = st.layout_.num_kv_heads;
  // Fetches waiting for these tokens (WhenCommitted) start once the locks below are released.
  CommitWaiters::Fired fired;
  absl::Cleanup wake = [&] { CommitWaiters::Fire(std::move(fired)); };
  const uint64_t n = spec_.num_tokens;
  std::optional<SequenceStore::Compaction> compaction;
  BlockPool::DeferEvictions evictions(st.pool_.get());  // the compaction's blocks, after mu_
  {
    CoreLock lock(&st.mu_);
    done_ = true;
    if (s.removed) {
      replacements_.clear();  // the blocks go now, not when the caller drops the txn
      st.EndAppend(s, region_);
      return absl::AbortedError(
          absl::StrCat("sequence_id ", s.id, " was freed while the append was in flight"));
    }
    originals_.clear();
    if (!spec_.token_ids.empty()) {
      // Another head range's append of the same tokens may have committed its ids meanwhile.
      for (uint64_t i = 0; position_ + i < s.token_ids.size() && i < n; ++i) {
        if (s.token_ids[position_ + i] != spec_.token_ids[i]) {
          replacements_.clear();
          st.EndAppend(s, region_);
          return absl::InvalidArgumentError(
              absl::StrCat("token_ids[", i, "] = ", spec_.token_ids[i],
                           " differs from the id an append of ", "other heads stored at position ",
                           position_ + i, " (", s.token_ids[position_ + i], ")"));
        }
      }
    }
    for (auto& [index, block] : replacements_) s.table.Replace(index, std::move(block));
    replacements_.clear();
    if (head_begin_ == 0 && head_end_ == num_heads && s.head_len.empty()) {
      for (uint32_t l = payload.layer_begin; l < layer_end_; ++l) s.layer_len[l] += n;
    } else {
      if (s.head_len.empty()) {
        s.head_len.resize(s.layer_len.size() * num_heads);
        for (size_t i = 0; i < s.head_len.size(); ++i) s.head_len[i] = s.layer_len[i / num_heads];
      }
      bool even = true;
      for (uint32_t l = 0; l < s.layer_len.size(); ++l) {
        uint64_t* row = s.head_len.data() + size_t{l} * num_heads;
        if (l >= payload.layer_begin && l < layer_end_) {
          for (uint32_t h = head_begin_; h < head_end_; ++h) row[h] += n;
        }
        s.layer_len[l] = *std::min_element(row, row + num_heads);
        even = even && *std::max_element(row, row + num_heads) == s.layer_len[l];
      }
      if (even) s.head_len.clear();
    }
    if (!spec_.token_ids.empty()) {
      for (uint64_t i = s.token_ids.size() - position_; i < n; ++i) {
        s.token_ids.push_back(spec_.token_ids[i]);
      }
    }
    s.appends.erase(std::find_if(s.appends.begin(), s.appends.end(),
                                 [this](const AppendRegion& a) { return a.id == region_; }));
    st.PublishFullBlocks(s);
    compaction = st.Retain(s);
    st.Account(s);
    st.tenants_->Appended(s.tenant, written, s.prefix_copy);
    if (!compaction.has_value()) {
      st.EndAppend(s, /*region_id=*/0);
      st.TakeReadyWaiters(s.id, &fired);
      return st.Info(s);
    }
    s.compacting = true;
  }
  // The append is visible; no other append, truncate or expiry runs while the kept rows are
  // copied outside the lock.
  evictions.Run();
  const absl::Status copied = st.pool_->memory().CopyRows(st.pool_->layout(), compaction->rows);
  compaction->sources.clear();
  CoreLock lock(&st.mu_);
  s.compacting = false;
  if (!s.removed && copied.ok()) {
    st.ApplyCompaction(s, *std::move(compaction));
    st.Account(s);
  }  // else the next append tries again
  st.EndAppend(s, /*region_id=*/0);
  st.TakeReadyWaiters(s.id, &fired);
  return st.Info(s);
}

absl::StatusOr<int32_t> AppendTxn::MakePrivate(uint64_t index) {
  const std::vector<int32_t>& table = writer_->spec().table;
  // Blocks past the sequence's own are the transaction's (no stored rows), and so are the
  // copies. A block copied on write when the append began is in the table, where readers may
  // share it since: it is copied again.
  if (index >= own_blocks_) return table[index];
  for (const auto& [i, block] : replacements_) {
    if (i == index) return table[index];
  }
  SequenceStore& st = *store_;
  BlockRef copy;
  {
    BlockPool::DeferEvictions evictions(st.pool_.get());  // copied once mu_ is released
    {
      CoreLock lock(&st.mu_);
      auto blocks = st.pool_->Allocate(1, seq_->tenant_id);
      if (!blocks.ok()) return blocks.status();
      copy = std::move((*blocks)[0]);
    }
  }
  // NOTE: the source is the sequence's block, held while the append is in flight; its rows past
  // the sequence's length are this append's, copied along with the rest. The append is
  // exclusive (AppendRegion): no other writes into the block meanwhile.
  const int32_t src = table[index], dst = copy.id();
  if (absl::Status c =
          st.pool_->memory().CopyBlocks({&src, 1}, {&dst, 1}, st.pool_->layout().block_bytes);
      !c.ok()) {
    return c;
  }
  replacements_.emplace_back(index, std::move(copy));
  return dst;
}

void AppendTxn::Abort() {
  CoreLock lock(&store_->mu_);
  done_ = true;
  replacements_.clear();
  Sequence& s = *seq_;
  auto it = std::find_if(s.appends.begin(), s.appends.end(),
                         [this](const AppendRegion& a) { return a.id == region_; });
  if (it != s.appends.end() && !it->joined && !s.removed) {
    for (auto& [index, block] : originals_) s.table.Replace(index, std::move(block));
  }
  originals_.clear();
  store_->EndAppend(s, region_);
}

void SequenceStore::EndAppend(Sequence& s, uint64_t region_id) {
  auto it = std::find_if(s.appends.begin(), s.appends.end(),
                         [region_id](const AppendRegion& a) { return a.id == region_id; });
  if (it != s.appends.end()) s.appends.erase(it);
  if (s.busy()) return;
  if (s.removed) {
    s.table.Clear();  // tail first, as in Remove
    return;
  }
  // New blocks of appends that did not commit hold nothing; they go back.
  const uint64_t keep = CeilDiv(s.MaxLength(), layout_.block_tokens);
  if (s.table.size() > keep) s.table.Truncate(keep);
  Renew(s);  // the lease did not run while appends were in flight
}

absl::StatusOr<SequenceInfo> SequenceStore::Append(const AppendSpec& spec,
                                                   absl::Span<const uint8_t> payload) {
  auto txn = BeginAppend(spec);
  if (!txn.ok()) return txn.status();
  if (absl::Status st = (*txn)->Write(payload); !st.ok()) return st;
  return (*txn)->Commit();
}

absl::StatusOr<std::unique_ptr<FetchReader>> SequenceStore::BeginFetch(const FetchSpec& spec) {
  auto wire = planner_.Plan(
      {spec.layer_begin, spec.layer_end, spec.kv_head_begin, spec.kv_head_end, spec.dtype},
      /*append=*/false);
  if (!wire.ok()) return wire.status();
  const uint32_t l0 = wire->layer_begin, l1 = wire->layer_end;
  const uint32_t h0 = wire->head_begin, h1 = wire->head_end;
  std::vector<BlockRef> refs;
  std::vector<int32_t> table;
  uint64_t n = 0;
  {
    CoreLock lock(&mu_);
    auto found = Find(spec.sequence_id, spec.tenant);
    if (!found.ok()) return found.status();
    Sequence& s = **found;
    // The tokens every requested head of every requested layer holds: a rank may read its heads
    // once its prefill counterpart wrote them, before the other ranks did theirs.
    const uint64_t avail = Available(s, WaitRange{l0, l1, h0, h1, 0});
    const uint64_t t1 = spec.token_end.value_or(avail);
    if (spec.token_begin > t1 || t1 > avail) {
      return absl::OutOfRangeError(absl::StrCat("token range [", spec.token_begin, ", ", t1,
                                                ") is outside the ", avail, " tokens layers [", l0,
                                                ", ", l1, ") kv heads [", h0, ", ", h1, ") hold"));
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
      refs.push_back(pool_->Share(s.table.at(i)));
      table[i] = s.table.at(i).id();
    }
    n = t1 - spec.token_begin;
    Renew(s);
  }
  TransferSpec t = planner_.Make(*wire, spec.token_begin, n, std::move(table));
  t.device_payload = spec.device_dest;  // read into device memory: nothing staged on the host
  auto reader = pool_->memory().BeginRead(pool_->layout(), std::move(t));
  if (!reader.ok()) return reader.status();
  auto r =
      std::make_unique<FetchReader>(std::move(refs), *std::move(reader), spec.token_begin, h0, h1);
  tenants_->Fetched(spec.tenant, r->payload_bytes());
  return r;
}

}  // namespace kvbank
