// Sequences of one model: block tables over a BlockPool, append / fetch / fork / truncate / free,
// leases and capacity limits. No gRPC here: an engine can embed this library directly.
#ifndef KVBANK_SERVER_CORE_SEQUENCE_STORE_H_
#define KVBANK_SERVER_CORE_SEQUENCE_STORE_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kernels/block_copy.h"
#include "kvbank/layout.h"
#include "kvbank/prefix_hash.h"
#include "server/core/block_pool.h"
#include "server/core/commit_waiters.h"
#include "server/core/fetch_reader.h"
#include "server/core/kv_events.h"
#include "server/core/pool_memory.h"
#include "server/core/prefix_cache.h"
#include "server/core/store_tenants.h"
#include "server/core/tiers.h"
#include "server/core/transfer_planner.h"

namespace kvbank {

struct StoreOptions {
  uint64_t max_sequences = 65536;
  uint64_t max_tokens_per_sequence = uint64_t{1} << 20;
  absl::Duration default_lease = absl::Minutes(5);
  absl::Duration max_lease = absl::Hours(24);
  size_t tombstones = 65536;   // freed / expired ids remembered for clear errors
  size_t max_waiters = 65536;  // WhenCommitted waiters at once
  std::function<absl::Time()> clock = absl::Now;
  HashAlgorithm hash = HashAlgorithm::kSha256;
  absl::Duration prefix_cache_ttl = absl::ZeroDuration();  // zero: cached blocks never age out
  uint8_t default_priority = 50;                           // of published blocks, 0..100
};

// What a sequence keeps as it grows.
//  full:           everything (default).
//  sliding window: the first `sinks` and the last `window` tokens; blocks holding neither are
//                  released, and Attend attends only those tokens.
//  heavy hitter:   (H2O) once length reaches budget + block_tokens, keep `budget` tokens: the
//                  first, the most attended (attention mass the server sums over heads and layers
//                  during Attend) and the last `window`, compacted in order into fresh blocks;
//                  the length becomes `budget`. Blocks shared with others are never written: the
//                  sequence takes private copies. Not for fp8 layers (a row would change scale).
struct RetentionPolicy {
  enum class Kind : uint8_t { kFull = 0, kSlidingWindow = 1, kHeavyHitter = 2 };
  Kind kind = Kind::kFull;
  uint32_t window = 0;
  uint32_t sinks = 0;
  uint32_t budget = 0;
};

// How a sequence starts. The prompt's full blocks already in the prefix index are attached.
struct CreateOptions {
  std::optional<absl::Duration> lease;  // unset: the default lease; zero: no lease
  std::string tenant;
  std::vector<uint32_t> prompt;      // token ids known up front (appends may then omit them)
  std::string cache_salt;            // part of the root hash: different salts never share
  std::vector<ExtraKey> extra_keys;  // go into every block's hash (LoRA name, ...)
  std::optional<uint8_t> priority;   // of the blocks this sequence publishes
  RetentionPolicy retention;
  // It carries prefix blocks copied from another replica: counted in prefix_copies_in, and its
  // appends' payload in prefix_copy_bytes_in (Stats). A fork of it is not a copy.
  bool prefix_copy = false;
};

// A new empty sequence with this lease: nullopt = the default lease, zero = no lease (it lives
// until freed).
inline CreateOptions WithLease(std::optional<absl::Duration> lease) {
  CreateOptions o;
  o.lease = lease;
  return o;
}

struct SequenceInfo {
  uint64_t id = 0;
  uint64_t length = 0;  // tokens written in every layer
  std::vector<uint64_t> layer_lengths;
  uint64_t num_blocks = 0;  // blocks held (a sliding window releases old ones)
  uint64_t cached_tokens = 0;
  absl::Duration lease_ttl = absl::ZeroDuration();  // zero: no lease
  uint64_t compactions = 0;  // heavy-hitter retention: times the kept tokens were compacted
};

// Stats() for an admin: the model's totals, every tenant's row. Stats(&tenant) is what that
// tenant may see (tenant_view): every figure is the tenant's own (sequences, tokens_stored,
// appends, fetches, bytes, leases_expired, prefix tokens, prefix copies in and their bytes,
// pool.used = its blocks_referenced) and tenants holds its row only. pool.total is the pool's
// fixed size (configuration, not activity); pool.free, cached, pinned and evictions are pool-wide
// and move with other tenants' work, so a tenant view leaves them 0.
struct StoreStats : Activity {
  bool tenant_view = false;
  uint64_t fetches_waiting = 0;  // WhenCommitted waiters now (0 in a tenant view)
  PoolStats pool;
  std::optional<TierStats> tiers;    // the tiers below the pool, if any (not in a tenant view)
  std::vector<TenantStats> tenants;  // tenants with any activity or limit, by name
};

struct AppendSpec {
  std::string tenant;
  uint64_t sequence_id = 0;
  uint32_t layer_begin = 0;
  std::optional<uint32_t> layer_end;  // unset: all layers
  uint64_t num_tokens = 0;
  std::optional<DType> dtype;       // unset: the storage dtype
  std::vector<uint32_t> token_ids;  // empty or num_tokens ids
  // KV heads [kv_head_begin, kv_head_end) only (a tensor-parallel rank's share), as in
  // FetchSpec. Appends over disjoint layer x head regions of one sequence may be in flight at
  // once; a token counts in the sequence's length once every head of every layer holds it.
  uint32_t kv_head_begin = 0;
  std::optional<uint32_t> kv_head_end;
};

struct FetchSpec {
  std::string tenant;
  uint64_t sequence_id = 0;
  uint64_t token_begin = 0;
  std::optional<uint64_t> token_end;  // unset: all tokens every requested layer has
  uint32_t layer_begin = 0;
  std::optional<uint32_t> layer_end;
  std::optional<DType> dtype;
  // KV heads [kv_head_begin, kv_head_end) only (a tensor-parallel rank's share): the payload is
  // the same layout with that many heads. Unset end: every head from kv_head_begin. An MLA model
  // has one latent head, which every range reads whole.
  uint32_t kv_head_begin = 0;
  std::optional<uint32_t> kv_head_end;
  // The caller moves the payload with FetchReader::ReadToDevice: the reader stages nothing at its
  // start (TransferSpec::device_payload).
  bool device_dest = false;
};

class SequenceStore;
struct Sequence;
struct AppendRegion;

// An append in flight. Payload bytes arrive in order through Write (any chunking) straight into
// blocks no reader can see; Commit makes them visible at once. Destroying an uncommitted
// transaction (error, cancel) releases everything it took: the sequence is exactly as before.
// One transaction per sequence at a time. Not thread-safe: one caller drives it.
// Lease: while the transaction is open its sequence does not expire, however long the payload
// streams (BeginAppend renews the lease; ExpireLeases and every call skip the deadline); Commit
// and abort renew it again, so the lease runs from the end of the append. Free still frees the
// sequence at once (Commit then answers ABORTED). An open transaction is the caller's to bound:
// one that never ends keeps its sequence alive (the RPC layer cuts idle append streams).
class AppendTxn {
 public:
  ~AppendTxn();
  AppendTxn(const AppendTxn&) = delete;
  AppendTxn& operator=(const AppendTxn&) = delete;

  uint64_t payload_bytes() const { return writer_->spec().payload.total_bytes; }
  uint64_t bytes_written() const { return writer_->written(); }
  DType dtype() const { return writer_->spec().dtype; }  // of the payload
  // Copies (or converts, or quantizes) the next `data.size()` payload bytes into the pool
  // (PayloadWriter::Write: streamed on host memory, staged in pieces of whole layers otherwise).
  // INVALID_ARGUMENT when they would run past payload_bytes(), or hold NaN / Inf on the way to a
  // converted layer; RESOURCE_EXHAUSTED when rows that outgrow an fp8 block's scale need a copy
  // of the block to rescale and the pool or the tenant's quota has no block for it. The
  // transaction must then be dropped (it undoes everything).
  absl::Status Write(absl::Span<const uint8_t> data);
  // The payload written by ranges from several threads at once (PayloadWriter::WriteRange; host
  // memory and a payload stored as it is): WriteRange for disjoint ranges of the next n bytes,
  // then Advance(n).
  bool ConcurrentWrites() const { return !done_ && writer_->ConcurrentWrites(); }
  absl::Status WriteRange(uint64_t offset, absl::Span<const uint8_t> data) {
    if (done_) return absl::FailedPreconditionError("append already finished");
    return writer_->WriteRange(offset, data);
  }
  absl::Status Advance(uint64_t n) {
    if (done_) return absl::FailedPreconditionError("append already finished");
    return writer_->Advance(n);
  }
  // How the copy writes the pool (PayloadWriter::set_stores).
  void SetStores(kernels::CopyStores stores) { writer_->set_stores(stores); }
  // Whether the sequence is handed off layer by layer: a fetch has waited for its tokens
  // (SequenceStore::WhenCommitted), and its reader pulls these bytes as soon as they commit, even
  // one that falls behind and no longer waits.
  bool awaited() const { return awaited_; }
  // The whole payload at once from device memory on the pool's device
  // (PayloadWriter::WriteFromDevice: the kernels read it in place; FAILED_PRECONDITION unless
  // the pool is cuda:N, or for a storage-format payload). Then Commit, as after Write.
  absl::Status WriteFromDevice(const uint8_t* device_payload) {
    if (done_) return absl::FailedPreconditionError("append already finished");
    return writer_->WriteFromDevice(device_payload);
  }
  // Publishes the append. INVALID_ARGUMENT when fewer than payload_bytes() arrived, or a
  // storage-format payload holds a bad scale or code; ABORTED when the sequence was freed
  // meanwhile; INTERNAL when the device failed. The transaction is finished either way.
  absl::StatusOr<SequenceInfo> Commit();

 private:
  friend class SequenceStore;
  AppendTxn() = default;
  // Ends the transaction without publishing: drops its blocks, clears the in-flight mark.
  void Abort();
  // PayloadWriter::MakePrivate: makes logical block `index` one only this transaction holds
  // (copying it outside the store's lock; the copy is swapped in at commit) unless it is one
  // already, and answers its id. RESOURCE_EXHAUSTED when the pool or the tenant's quota has no
  // block for the copy.
  absl::StatusOr<int32_t> MakePrivate(uint64_t index);

  SequenceStore* store_ = nullptr;
  std::shared_ptr<Sequence> seq_;
  AppendSpec spec_;
  uint64_t region_ = 0;  // its AppendRegion's id in seq_->appends
  uint32_t layer_end_ = 0;
  uint32_t head_begin_ = 0, head_end_ = 0;
  uint64_t position_ = 0;                  // sequence position of payload token 0
  uint64_t own_blocks_ = 0;                // the sequence's table size when the append began
  std::unique_ptr<PayloadWriter> writer_;  // the payload over write_table (TransferSpec::table)
  // MakePrivate's copies, swapped into the table at commit: table[i] <- block.
  std::vector<std::pair<size_t, BlockRef>> replacements_;
  // The blocks copied on write when the append began, at their logical index: an abort puts them
  // back (unless another append wrote through the copies meanwhile: AppendRegion::joined).
  std::vector<std::pair<size_t, BlockRef>> originals_;
  bool awaited_ = false;
  bool done_ = false;
};

// One model's sequences: their lifecycle (create, fork, truncate, free, leases) and the
// transactions that move their KV (appends, fetches, waits, attention). The parts it is built
// from each own their state and lock: the tenants' figures and limits (tenants()), the cached
// blocks and the tiers (prefix()), the waiters of WhenCommitted, how transfers are planned.
//
// Thread-safe. Lock order: mu_, then CommitWaiters' and StoreTenants' locks, then BlockPool's.
// mu_ guards sequence metadata only (tables, references, lengths, leases, publishing): every
// byte move (transfers, copy-on-write and fork copies, compaction, attention, and the copies
// into a tier of the blocks an allocation evicts: BlockPool::DeferEvictions) runs outside it and
// the pool's lock, on blocks its caller holds references to. Both are CoreLocks (core_lock.h):
// the copy paths check that neither is held.
class SequenceStore {
 public:
  // `layout` must be valid (ValidateLayout) and match the pool's block layout. `events` is the
  // log the pool was created with (may be null); the store keeps it alive past the pool.
  // `tiers` (may be null) is the pool's eviction sink, if it has one: the store keeps it alive
  // past the pool, and promotes blocks from it.
  SequenceStore(ModelLayout layout, std::unique_ptr<BlockPool> pool, StoreOptions options,
                std::unique_ptr<KvEventLog> events = nullptr,
                std::unique_ptr<TierCache> tiers = nullptr);
  ~SequenceStore();

  const ModelLayout& layout() const { return layout_; }
  const StoreOptions& options() const { return options_; }
  BlockPool& pool() const { return *pool_; }
  // The cached blocks: look-ups, reads and pins by hash, the tiers, the event log.
  PrefixCache& prefix() const { return *prefix_; }
  // Per-tenant figures and limits (block quota, live sequences).
  StoreTenants& tenants() const { return *tenants_; }

  // A new sequence; with a prompt, the longest run of its full blocks found in the prefix index
  // (or a tier below the pool) is attached (SequenceInfo::cached_tokens) and the ids are
  // remembered.
  absl::StatusOr<SequenceInfo> Create(const CreateOptions& options);
  absl::StatusOr<std::unique_ptr<AppendTxn>> BeginAppend(const AppendSpec& spec);
  // BeginAppend + one Write + Commit.
  absl::StatusOr<SequenceInfo> Append(const AppendSpec& spec, absl::Span<const uint8_t> payload);
  absl::StatusOr<std::unique_ptr<FetchReader>> BeginFetch(const FetchSpec& spec);
  // Layer-wise handoff: a decode worker waits for a prefill worker's layers. Answers 0 when the
  // tokens [0, spec.token_end) of spec's layers and kv heads are committed already; else the id
  // of a waiter whose `ready` runs once, outside the lock, on the thread that commits them (OK)
  // or that frees or expires the sequence (FAILED_PRECONDITION saying it is gone). Errors as
  // BeginFetch's (INVALID_ARGUMENT without token_end); RESOURCE_EXHAUSTED past
  // StoreOptions::max_waiters. A sequence that expires on a touch, not through ExpireLeases,
  // leaves its waiters to their caller's timeout.
  absl::StatusOr<uint64_t> WhenCommitted(const FetchSpec& spec,
                                         std::function<void(absl::Status)> ready);
  // Drops a waiter. True when it was still waiting (its `ready` never runs); false when `ready`
  // has run or is running.
  bool CancelWait(uint64_t waiter) { return waiters_->Cancel(waiter); }
  // The new sequence shares every full block and gets a private copy of the partial one.
  // Every call on a sequence names the caller's tenant: another tenant's sequence answers exactly
  // like one that never existed (NOT_FOUND).
  absl::StatusOr<SequenceInfo> Fork(uint64_t id, std::optional<absl::Duration> lease,
                                    const std::string& tenant = "");
  absl::StatusOr<SequenceInfo> Truncate(uint64_t id, uint64_t num_tokens,
                                        const std::string& tenant = "");
  // Returns the number of blocks whose reference the sequence dropped.
  absl::StatusOr<uint64_t> Free(uint64_t id, const std::string& tenant = "");
  absl::StatusOr<SequenceInfo> RenewLease(uint64_t id, const std::string& tenant = "");
  absl::StatusOr<SequenceInfo> Get(uint64_t id, const std::string& tenant = "");

  // Decode attention on the pool: for each item, the query of one new token against the KV that
  // layer `layer` of the sequence holds (read in its storage dtype, dequantized in the kernel).
  // query: [num_q_heads][head_dim] fp32; out: [items][num_q_heads][head_dim_v]; lse:
  // [items][num_q_heads]. sm_scale 0: 1/sqrt(head_dim). window 0: every token; else the last
  // `window` plus the first `sinks`. The blocks read are pinned for the call; the kernel runs
  // outside the store's lock.
  struct AttendItem {
    uint64_t sequence_id = 0;
    uint32_t layer = 0;
    absl::Span<const float> query;
  };
  struct AttendOptions {
    std::string tenant;
    float sm_scale = 0;
    uint32_t window = 0;
    uint32_t sinks = 0;
    uint32_t num_threads = 0;  // CPU kernel threads; 0: all cores
  };
  // Most items one Attend call may carry.
  static constexpr size_t kMaxAttendItems = 4096;
  absl::Status Attend(const AttendOptions& options, absl::Span<const AttendItem> items,
                      absl::Span<float> out, absl::Span<float> lse);

  // The model is going (dropped from its registry): every live sequence is freed now (an append
  // in flight releases its blocks when it ends), every waiter ends FAILED_PRECONDITION, and so
  // does every later Create, Fork and call on a sequence, each naming `reason` (e.g. "model 'm'
  // was dropped"). Idempotent.
  void Close(const std::string& reason);
  // Frees every sequence whose lease ran out by `now`; returns how many. A sequence with an
  // append in flight is not expired, whatever its deadline: the append renews the lease when it
  // commits or aborts. (A stalled append is the caller's to cut: the RPC layer ends a stream that
  // stays idle too long, which aborts its transaction.)
  size_t ExpireLeases(absl::Time now);

  // tenant null: the admin's view (the model's totals, every tenant's row). Otherwise what that
  // tenant may see (StoreStats::tenant_view). O(tenants): every figure is a counter kept as
  // sequences change, nothing scans the sequences.
  StoreStats Stats(const std::string* tenant = nullptr) const;
  // For tests: pool invariants plus: every live sequence's table covers its lengths and holds
  // valid references; the counters Stats reads (sequences and tokens per tenant) equal a full
  // recount. Empty string when all hold.
  std::string CheckInvariants() const;

 private:
  friend class AppendTxn;
  using SeqPtr = std::shared_ptr<Sequence>;

  absl::StatusOr<SeqPtr> Find(uint64_t id, const std::string& tenant)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What an append of `spec` at position `pos` of `s` would write (its AppendRegion, without an
  // id), or why it may not begin: lengths that differ over its layers and heads, an fp8
  // storage-format append inside a block, past max_tokens_per_sequence, an append in flight over
  // the same rows, a compaction running, token ids that differ from those known.
  absl::StatusOr<AppendRegion> CheckAppendAt(const Sequence& s, const AppendSpec& spec,
                                             const TransferPlan& wire, uint64_t pos) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Hashes and publishes every block that became full in all layers with known token ids.
  void PublishFullBlocks(Sequence& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Heavy-hitter retention's move of the kept tokens into fresh blocks: planned under mu_, the
  // rows copied outside it, applied under it again (sequence_store_retention.cc).
  struct Compaction {
    std::vector<uint64_t> keep;  // token positions kept, ascending
    std::vector<BlockRef> fresh;
    std::vector<kernels::RowCopy> rows;
    std::vector<BlockRef> sources;  // references on the blocks copied from, held for the copy
  };
  // Applies the sequence's retention policy after it grew: a sliding window releases blocks at
  // once; heavy-hitter retention answers the compaction to run (none when there is nothing to
  // do, or no room for it now: the next append tries again).
  std::optional<Compaction> Retain(Sequence& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The compaction's rows are copied: the sequence keeps only its kept tokens.
  void ApplyCompaction(Sequence& s, Compaction c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // RESOURCE_EXHAUSTED when `tenant` may not have one more live sequence (its own limit, then
  // the model's max_sequences); FAILED_PRECONDITION once the model is closed.
  absl::Status AdmitSequence(const std::string& tenant) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Brings the token counters in line with s.Length() (s.counted_length is what they hold).
  // Called after every change of a live sequence's lengths.
  void Account(Sequence& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<absl::Duration> ResolveLease(std::optional<absl::Duration> lease) const;
  uint64_t NewId() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  SeqPtr Insert(absl::Duration lease, const std::string& tenant) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Renew(Sequence& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  SequenceInfo Info(const Sequence& s) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Tokens every (layer, head) of the range holds.
  uint64_t Available(const Sequence& s, const WaitRange& r) const;
  // Takes the waiters of sequence `id` whose tokens are committed now, or all of them when it is
  // gone, for CommitWaiters::Fire to call outside the lock.
  void TakeReadyWaiters(uint64_t id, CommitWaiters::Fired* fired)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // An append over `region_id` ended (committed or not): the region goes; when it was the last
  // thing in flight, a freed sequence's blocks go, and blocks past the lengths (new blocks of
  // appends that did not commit) go back.
  void EndAppend(Sequence& s, uint64_t region_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes `s` from the live set, leaving a tombstone with `reason`; its blocks go now, or when
  // its append in flight ends. lease_expired: counted as an expiry.
  // Takes `s` by value: callers often pass the map's own entry, which this erases.
  uint64_t Remove(SeqPtr s, std::string reason, bool lease_expired = false)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ModelLayout layout_;
  const std::unique_ptr<KvEventLog> events_;  // declared before pool_: outlives it
  const std::unique_ptr<TierCache> tiers_;    // the pool's eviction sink: outlives it too
  const std::unique_ptr<BlockPool> pool_;
  const StoreOptions options_;
  const TransferPlanner planner_;
  const std::unique_ptr<StoreTenants> tenants_;
  const std::unique_ptr<CommitWaiters> waiters_;
  const std::unique_ptr<PrefixCache> prefix_;  // declared after the pool: its thread stops first

  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, SeqPtr> live_ ABSL_GUARDED_BY(mu_);
  struct Tombstone {
    std::string tenant;
    std::string reason;
  };
  absl::flat_hash_map<uint64_t, Tombstone> tombstones_ ABSL_GUARDED_BY(mu_);
  std::deque<uint64_t> tombstone_order_ ABSL_GUARDED_BY(mu_);
  uint64_t id_state_ ABSL_GUARDED_BY(mu_);
  uint64_t last_append_region_ ABSL_GUARDED_BY(mu_) = 0;  // AppendRegion ids
  std::string closed_ ABSL_GUARDED_BY(mu_);               // Close's reason; empty while open
};

}  // namespace kvbank

#endif  // KVBANK_SERVER_CORE_SEQUENCE_STORE_H_
