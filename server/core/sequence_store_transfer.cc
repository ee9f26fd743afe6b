// SequenceStore: moving KV in and out (BeginAppend / AppendTxn, BeginFetch / FetchReader, and how
// a transfer travels: plain copy, conversion or storage format; streamed on direct memory, staged
// whole on memory that is not).
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

absl::Status SequenceStore::CheckLayerRange(uint32_t l0, uint32_t l1) const {
  if (l1 > layout_.num_layers || l0 >= l1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer range [", l0, ", ", l1, ") is empty or outside [0, ", layout_.num_layers, ")"));
  }
  return absl::OkStatus();
}

namespace {
// Bytes of the largest piece: what a transfer's staging buffer must hold.
uint64_t LargestPiece(const std::vector<StagedPiece>& pieces) {
  uint64_t largest = 0;
  for (const StagedPiece& p : pieces) largest = std::max(largest, p.end - p.begin);
  return largest;
}
}  // namespace

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
  // A converted append that continues an fp8 block may rescale it, rewriting rows readers see
  // (kernels/quant_math.h, Fp8GroupScale). On direct memory the codec copies the block when that
  // happens (AppendTxn::MakePrivate); staged memory cannot tell before the kernel runs, so the
  // block is copied now.
  bool rescalable = false;
  if (wire->mode == Mode::kConvert && pos % bt != 0 && !pool_->memory().direct()) {
    for (uint32_t l = l0; l < l1; ++l) {
      rescalable = rescalable || layout_.layer_dtypes[l] == DType::kFp8E4M3 ||
                   layout_.layer_dtypes[l] == DType::kFp8E5M2;
    }
  }
  std::vector<size_t> cow;
  for (uint64_t i = first; i < std::min(have, need); ++i) {
    if (!pool_->Writable(s->blocks[i].id()) || (i == first && rescalable)) cow.push_back(i);
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
  if (!pool_->memory().direct()) txn->pieces_ = SplitForStaging(txn->payload_, txn->job_);
  if (txn->codec_ != nullptr) {
    AppendTxn* t = txn.get();
    txn->codec_->SetMakePrivate([t](uint64_t index) { return t->MakePrivate(index); });
  }
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
      auto staged = store_->pool_->memory().Stage(LargestPiece(pieces_));
      if (!staged.ok()) return staged.status();
      staging_ = *std::move(staged);
    }
    for (uint64_t at = 0; at < data.size();) {
      const StagedPiece& piece = pieces_[piece_];
      const uint64_t n = std::min<uint64_t>(data.size() - at, piece.end - written_);
      std::memcpy(staging_->data() + (written_ - piece.begin), data.data() + at, n);
      if (job_.convert.has_value()) {
        // The elements this chunk completes must be finite, as RowCodec checks on direct memory.
        // (Pieces are whole layers, so they start on an element.)
        const uint32_t width = DTypeBytes(*job_.convert);
        const uint64_t end = (written_ + n) / width;
        const int64_t bad = kernels::FindNonFinite(
            staging_->data() + (checked_ * width - piece.begin), *job_.convert, end - checked_);
        if (bad >= 0) {
          const uint64_t byte = (checked_ + bad) * width;
          const PayloadRow row = LocatePayloadRow(store_->block_layout(), payload_, byte);
          return NonFiniteError(row, (byte - row.begin) / width);
        }
        checked_ = end;
      }
      written_ += n;
      at += n;
      if (written_ == piece.end) {
        if (absl::Status f = FlushPiece(piece); !f.ok()) return f;
        ++piece_;
      }
    }
    return absl::OkStatus();
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
  // Memory that is not direct: every piece moved (and was checked) in Write.
  if (storage_format_ && store_->pool_->memory().direct()) {
    if (absl::Status v = ValidateStorageFormat(payload_.layer_begin, layer_end_, nullptr, 0);
        !v.ok()) {
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
  st.Account(s);
  st.Renew(s);
  done_ = true;
  SequenceStore::TenantCounters& c = st.tenant_counters_[s.tenant];
  ++c.appends;
  c.bytes_appended += written_;
  st.appends_.fetch_add(1, std::memory_order_relaxed);
  st.bytes_appended_.fetch_add(written_, std::memory_order_relaxed);
  return st.Info(s);
}

absl::Status AppendTxn::FlushPiece(const StagedPiece& piece) {
  if (storage_format_) {
    if (absl::Status v = ValidateStorageFormat(piece.layer_begin, piece.layer_end, staging_->data(),
                                               piece.begin);
        !v.ok()) {
      return v;
    }
  }
  if (piece.end == piece.begin) return absl::OkStatus();
  return store_->pool_->memory().WritePayload(piece.job, staging_->data());
}

absl::Status AppendTxn::ValidateStorageFormat(uint32_t l0, uint32_t l1, const uint8_t* staged,
                                              uint64_t staged_begin) const {
  const BlockLayout& b = store_->block_layout();
  const uint64_t bt = b.block_tokens;
  // Where the scales and rows are: in the blocks (direct memory: written already), or in the
  // staged payload (PayloadLayout::MakeStorage's order) from payload byte staged_begin on.
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
      std::memcpy(&scale, staged + (at - staged_begin), 4);
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
      return staged + (part - staged_begin) +
             (uint64_t{h} * payload_.num_tokens + (t - position_)) * row_bytes;
    }
    const uint8_t* block = job_.map.pool + uint64_t(write_table_[t / bt]) * b.block_bytes;
    const uint32_t row = static_cast<uint32_t>(t % bt);
    return block + (kv == 0 ? v.KRow(h, row) : v.VRow(h, row));
  };
  for (uint32_t l = l0; l < l1; ++l) {
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

absl::Status AppendTxn::MakePrivate(uint64_t index) {
  // Blocks past the sequence's own are the transaction's (new_blocks_), and so are the copies.
  if (index >= write_table_.size() - new_blocks_.size()) return absl::OkStatus();
  for (const auto& [i, block] : replacements_) {
    if (i == index) return absl::OkStatus();
  }
  SequenceStore& st = *store_;
  absl::MutexLock lock(&st.mu_);
  auto blocks = st.pool_->Allocate(1, seq_->tenant_id);
  if (!blocks.ok()) return blocks.status();
  BlockRef copy = std::move((*blocks)[0]);
  // NOTE: the source is the sequence's block, held while the append is in flight; its rows past
  // the sequence's length are this append's, copied along with the rest.
  const int32_t src = write_table_[index], dst = copy.id();
  if (absl::Status c =
          st.pool_->memory().CopyBlocks({&src, 1}, {&dst, 1}, st.block_layout().block_bytes);
      !c.ok()) {
    return c;
  }
  write_table_[index] = dst;
  replacements_.emplace_back(index, std::move(copy));
  return absl::OkStatus();
}

void AppendTxn::Abort() {
  absl::MutexLock lock(&store_->mu_);
  done_ = true;
  seq_->append_in_flight = false;
  if (seq_->removed) {
    while (!seq_->blocks.empty()) seq_->blocks.pop_back();  // tail first, as in Remove
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
  CountFetch(spec.tenant, r->payload_.total_bytes);
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

absl::Status FetchReader::Read(uint64_t offset, absl::Span<uint8_t> out) {
  if (out.empty()) return absl::OkStatus();
  if (memory_ != nullptr) {
    // The pieces that hold [offset, offset + out.size()), each read from the device once while
    // the reads go forward.
    size_t i = loaded_ < pieces_.size() && pieces_[loaded_].begin <= offset ? loaded_ : 0;
    for (uint64_t at = 0; at < out.size(); ++i) {
      if (i >= pieces_.size()) {
        return absl::OutOfRangeError(
            absl::StrCat("read past the payload's ", payload_.total_bytes, " bytes"));
      }
      const StagedPiece& piece = pieces_[i];
      if (offset + at >= piece.end) continue;
      if (loaded_ != i) {
        loaded_ = SIZE_MAX;  // until the read succeeds
        if (absl::Status s = memory_->ReadPayload(piece.job, staged_->data()); !s.ok()) return s;
        loaded_ = i;
      }
      const uint64_t n = std::min<uint64_t>(out.size() - at, piece.end - (offset + at));
      std::memcpy(out.data() + at, staged_->data() + (offset + at - piece.begin), n);
      at += n;
    }
  } else if (codec_ != nullptr) {
    codec_->Read(offset, out);
  } else {
    kernels::PayloadCopyCpu(job_.map, kernels::CopyDirection::kPoolToPayload, offset, out.data(),
                            out.size());
    kernels::ScaleCopyCpu(job_.map, kernels::CopyDirection::kPoolToPayload, offset, out.data(),
                          out.size());
  }
  return absl::OkStatus();
}

absl::Status SequenceStore::StageFetch(FetchReader& r) {
  PoolMemory& memory = pool_->memory();
  if (memory.direct()) return absl::OkStatus();
  // Pieces of whole layers, the first read now: a device that fails, fails the fetch before a
  // byte goes out. The reader's blocks stay referenced until it is destroyed, so later pieces
  // read what the sequence held when the fetch began.
  r.pieces_ = SplitForStaging(r.payload_, r.job_);
  const uint64_t largest = LargestPiece(r.pieces_);
  auto staged = memory.Stage(largest);
  if (!staged.ok()) return staged.status();
  r.staged_ = *std::move(staged);
  r.memory_ = &memory;
  if (largest == 0) return absl::OkStatus();
  if (absl::Status s = memory.ReadPayload(r.pieces_[0].job, r.staged_->data()); !s.ok()) return s;
  r.loaded_ = 0;
  return absl::OkStatus();
}

std::vector<StagedPiece> SequenceStore::SplitForStaging(const PayloadLayout& payload,
                                                        const PayloadJob& job) const {
  const uint32_t layers = payload.layer_end - payload.layer_begin;
  auto layer_end = [&](uint32_t i) {
    return i + 1 < layers ? payload.layer_offset[i + 1] : payload.total_bytes;
  };
  const uint64_t budget = pool_->staging_bytes();
  std::vector<StagedPiece> pieces;
  for (uint32_t i = 0; i < layers;) {
    StagedPiece p;
    p.begin = payload.layer_offset[i];
    uint32_t j = i + 1;  // whole layers while they fit; at least one
    while (j < layers && layer_end(j) - p.begin <= budget) ++j;
    p.end = layer_end(j - 1);
    p.layer_begin = payload.layer_begin + i;
    p.layer_end = payload.layer_begin + j;
    for (uint32_t k = i; k < j; ++k) {
      p.layer_offset.push_back(payload.layer_offset[k] - p.begin);
      if (payload.storage_format()) p.scale_offset.push_back(payload.scale_offset[k] - p.begin);
    }
    p.job = job;
    p.job.map.layers = job.map.layers + i;
    p.job.map.num_layers = j - i;
    p.job.map.total_bytes = p.end - p.begin;
    p.job.map.layer_offset = p.layer_offset.data();
    p.job.map.scale_offset = payload.storage_format() ? p.scale_offset.data() : nullptr;
    pieces.push_back(std::move(p));  // moving the vectors keeps their buffers: the map stays valid
    i = j;
  }
  return pieces;
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

}  // namespace kvbank
