// The tiers below a model's pool: a host-memory tier and a disk tier on a local SSD. A cached
// block the pool evicts moves one tier down instead of being forgotten (the pool's
// EvictionSink); a prompt or a FetchBlocks that finds its blocks in a tier promotes them back
// into the pool (SequenceStore). Both tiers are inclusive: a promoted block stays in its tier,
// so evicting it again costs nothing; so does evicting one whose copy moved on to the disk.
//
//   host tier  one mapped allocation of slots of block_bytes, LRU. Its victims go to the disk
//              tier (queued, written by the I/O threads) when there is one.
//   disk tier  one file per model (<dir>/<model>-<fingerprint>.kvbank-tier, the model's name
//              escaped injectively: tier_folder.h) of fixed slots, in a folder that is kvbankd's
//              own and locked by one server at a time; each slot is a self-describing record: a
//              header (magic, layout, model name, hash, parent, tenant, LoRA, token ids, a
//              checksum of the block's bytes, a checksum of the header) and the block's bytes as
//              stored (quantized rows and their scales). A record is served only to the model,
//              layout and tenant it names. There is no separate
//              index file: at start the headers are read (in parallel) and every whole one is
//              indexed, so a kill at any moment loses at most the slots being written, which then
//              fail their checksums. A block's bytes are checked against their checksum on every
//              read, and those indexed at start by a background scrubber as well; a block that
//              fails is never served: a miss, counted, removed.
//
// Disk I/O: pread / pwrite of whole slots (4 KiB-aligned, one call each) with O_DIRECT where the
// filesystem takes it, from a small pool of I/O threads: blocks are tens of KiB to MiBs, so a
// call's own cost is small beside its transfer, and a few threads in flight keep an SSD busy
// (bench/tier_bench.cc measures reads against fio's sequential read rate).
#ifndef KVBANK_SERVER_CORE_TIERS_H_
#define KVBANK_SERVER_CORE_TIERS_H_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <list>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kvbank/layout.h"
#include "kvbank/prefix_hash.h"
#include "server/core/block_pool.h"
#include "server/core/kv_events.h"
#include "server/core/pool_memory.h"
#include "server/core/tier_folder.h"

namespace kvbank {

enum class Tier : uint8_t { kPool = 0, kHost = 1, kDisk = 2 };
inline constexpr int kNumTiers = 3;
// The KV events' medium of a tier's blocks: "host" and "disk" (the pool's own is "gpu" / "cpu").
const char* TierMedium(Tier t);

struct TierOptions {
  uint64_t host_bytes = 0;  // 0: no host tier
  std::string disk_path;    // a folder; empty: no disk tier
  uint64_t disk_bytes = 0;  // the disk tier's file is at most this large
  bool direct_io = true;    // O_DIRECT where the filesystem takes it (else buffered I/O)
  uint32_t io_threads = 4;  // disk reads and writes in flight at once
  // Spills queued for the disk at once; a spill past it is dropped (counted).
  uint64_t max_queued_bytes = uint64_t{256} << 20;
  bool prefault_host = true;  // touch the host tier's pages at start
  // While the pool is nearly full, copy its coldest cached blocks down ahead of their eviction
  // (SequenceStore's spiller), so an eviction rarely copies on its caller's path.
  bool spill_ahead = true;
};

struct TierStats {
  uint64_t host_blocks = 0, host_capacity = 0;
  uint64_t disk_blocks = 0, disk_capacity = 0;
  uint64_t spilled_to_host = 0, spilled_to_disk = 0;  // blocks written into the tier
  // Of the blocks the pool evicted, those copied during the eviction (on the evicting caller's
  // path): the spill-ahead had not copied them yet.
  uint64_t spilled_at_eviction = 0;
  uint64_t promoted_from_host = 0, promoted_from_disk = 0;
  uint64_t corrupt = 0;        // disk blocks whose checksum failed on a read (removed)
  uint64_t spill_dropped = 0;  // spills to the disk dropped: its queue was full
  uint64_t disk_bytes_written = 0, disk_bytes_read = 0;
  uint64_t loaded = 0;  // blocks indexed from the disk at start (their headers whole)
  // Slots written before the start found torn or corrupt: at start (the header) or by the
  // scrubber (the block's bytes).
  uint64_t load_invalid = 0;
  uint64_t queued = 0;  // spills waiting for the disk now
  // Blocks indexed at start whose bytes were not checked yet (the scrubber checks them in the
  // background; a read checks them too).
  uint64_t unverified = 0;
  bool direct_io = false;  // the disk tier's file is open with O_DIRECT
};

// One block of a tier as a promotion reads it.
struct TierBlock {
  PublishInfo info;
  Tier from = Tier::kHost;
};

// Thread-safe. Lock order: BlockPool's lock (Evicted runs under it), then mu_, then the event
// log's. No call into a pool is made from here.
class TierCache final : public EvictionSink {
 public:
  // Opens the tiers for blocks of `layout` in `model` (its name and `fingerprint` name and guard
  // the disk file). The disk file is created, or reopened and indexed (every valid slot of this
  // model and layout is a block the tier serves). INVALID_ARGUMENT when no slot fits in
  // disk_bytes or no block in host_bytes; FAILED_PRECONDITION when the folder cannot be used
  // (TierFolder::Open, TierFolder::OpenFile).
  static absl::StatusOr<std::unique_ptr<TierCache>> Open(const BlockLayout& layout,
                                                         const std::string& model,
                                                         const std::string& fingerprint,
                                                         TierOptions options,
                                                         KvEventLog* events = nullptr);
  // Waits for the queued disk writes, stops the I/O threads, syncs the file.
  ~TierCache() override;
  TierCache(const TierCache&) = delete;
  TierCache& operator=(const TierCache&) = delete;

  const TierOptions& options() const { return options_; }
  bool has_host() const { return host_capacity_ > 0; }
  bool has_disk() const { return fd_ >= 0; }
  const std::string& disk_file() const { return disk_file_; }

  // EvictionSink: the block goes to the host tier (its LRU victim to the disk), or to the disk
  // when there is no host tier. Nothing is copied when any tier holds the block already (it
  // becomes that tier's most recently used).
  void Evicted(const PublishInfo& info, const std::string& tenant,
               const std::function<const uint8_t*()>& data) override;

  // Spill-ahead: a cached block still in the pool, copied down before the pool evicts it (so
  // the eviction copies nothing). As Evicted, off any lock of the pool. False when the disk's
  // write queue is full (nothing taken, nothing counted: the caller tries again later).
  bool Spill(const PublishInfo& info, const std::string& tenant, const uint8_t* data);

  // The tier that holds `tenant`'s block `hash`, if one does. No side effects.
  std::optional<Tier> Find(const BlockHash& hash, const std::string& tenant) const;
  // Copies the leading run of `hashes` the tiers hold, block i into dst[i] (block_bytes, host
  // memory), disk blocks read in parallel. Stops at the first block in no tier or failing its
  // checksum (removed, counted). Answers the blocks copied, in order; each becomes the most
  // recently used of its tier. REQUIRES: dst.size() == hashes.size().
  std::vector<TierBlock> ReadChain(absl::Span<const BlockHash> hashes, const std::string& tenant,
                                   absl::Span<uint8_t* const> dst);
  // How many leading `hashes` the tiers hold. No side effects.
  size_t CountChain(absl::Span<const BlockHash> hashes, const std::string& tenant) const;
  // Writes a block straight to the disk tier, on the caller's thread (a warm-restart flush).
  // False when there is no disk tier, the block is there already, or the write failed.
  bool WriteToDisk(const PublishInfo& info, const std::string& tenant, const uint8_t* data);
  // Moves the host tier's blocks to the disk (those it lacks), most recently used first, until
  // `deadline`. Returns how many were written.
  size_t FlushHostToDisk(absl::Time deadline);
  // Waits (until `deadline`) for every queued disk write; true when none is left.
  bool WaitForWrites(absl::Time deadline);
  // fdatasync of the disk file.
  absl::Status Sync();
  // Waits (until `deadline`) until the bytes of every block indexed at start were checked (by
  // the scrubber or a read); true when they were.
  bool WaitForScrub(absl::Time deadline);
  TierStats Stats() const;
  // For tests: the slot a disk block lives in (nullopt when it is not on the disk) and the
  // file's geometry, to corrupt a block on purpose.
  std::optional<uint64_t> DiskSlotOf(const BlockHash& hash, const std::string& tenant) const;
  uint64_t slot_bytes() const { return slot_bytes_; }
  uint64_t header_bytes() const { return header_bytes_; }

 private:
  struct Key {
    BlockHash hash;
    std::string tenant;
    bool operator==(const Key& o) const { return hash == o.hash && tenant == o.tenant; }
    template <typename H>
    friend H AbslHashValue(H h, const Key& k) {
      return H::combine(std::move(h), k.hash, k.tenant);
    }
  };
  struct HostEntry {
    uint64_t slot = 0;
    std::shared_ptr<const PublishInfo> info;
    std::list<Key>::iterator lru;
  };
  struct DiskEntry {
    uint64_t slot = 0;
    uint64_t generation = 0;
    uint32_t readers = 0;  // reads in flight: the slot is not reused meanwhile
    bool verified = true;  // its bytes matched their checksum (false: indexed at start, unread)
    std::list<Key>::iterator lru;
  };
  struct WriteJob {
    Key key;
    std::shared_ptr<const PublishInfo> info;
    std::shared_ptr<uint8_t> buffer;  // header + block, slot_bytes, aligned for O_DIRECT
  };

  TierCache(const BlockLayout& layout, std::string model, TierOptions options, KvEventLog* events);
  absl::Status OpenDisk(const std::string& fingerprint);
  void LoadDisk();
  void IoLoop();
  // A slot for a new disk block: a free one, else the least recently used block's (which leaves
  // the index now). nullopt when every slot is being read.
  std::optional<uint64_t> TakeDiskSlotLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Encodes a slot record (header + block) into `buf` (slot_bytes).
  void Encode(const PublishInfo& info, const std::string& tenant, uint64_t generation,
              const uint8_t* data, uint8_t* buf) const;
  // Checks a slot record read back (its header, and the block's bytes against their checksum
  // unless `data` is null); fills info / tenant / generation. False when torn, corrupt or
  // foreign.
  bool Decode(const uint8_t* header, const uint8_t* data, PublishInfo* info, std::string* tenant,
              uint64_t* generation) const;
  // Checks, in the background, the bytes of the blocks LoadDisk indexed.
  void ScrubLoop();
  std::shared_ptr<uint8_t> NewBuffer() const;
  // Evicted and Spill: the block one tier down unless the tier holds it already (an eviction
  // then makes it the tier's most recently used). kFull: the disk's queue is full (a spill-ahead
  // only; an eviction's spill is dropped then, counted).
  enum class Put : uint8_t { kHeld, kCopied, kFull };
  Put PutLocked(const Key& key, const PublishInfo& info,
                const std::function<const uint8_t*()>& data, bool eviction)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool QueueFullLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether a disk record can hold the block (tenant and LoRA names of at most 255 bytes).
  bool Fits(const std::string& tenant, const PublishInfo& info) const;
  // Every disk write: a slot and a generation reserved under mu_ (counted in writing_), the
  // record written outside it, then indexed (or the slot freed) under mu_ again.
  struct Reserved {
    uint64_t slot = 0, generation = 0;
  };
  std::optional<Reserved> ReserveSlotLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Seals the encoded record in buf (slot_bytes) with r's generation and writes it to r's slot.
  bool WriteRecord(const Reserved& r, uint8_t* buf) const;
  // Ends the write: indexed (answers true) when ok, else the slot goes back.
  bool FinishWriteLocked(const Key& key, const PublishInfo& info, const Reserved& r, bool ok)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool QueueDiskWriteLocked(const Key& key, std::shared_ptr<const PublishInfo> info,
                            const uint8_t* data) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PutHostLocked(const Key& key, std::shared_ptr<const PublishInfo> info, const uint8_t* data)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EraseDiskLocked(const Key& key, bool emit) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EmitLocked(KvEvent::Type type, const Key& key, const PublishInfo* info, Tier tier)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Reads slot `slot` (the header into buf, of slot_bytes; the block into dst when not null,
  // else into buf after the header) and decodes it; false on an I/O error or a record that fails
  // its checks (dst then holds whatever was read).
  bool ReadSlot(uint64_t slot, uint8_t* buf, uint8_t* dst, PublishInfo* info, std::string* tenant,
                uint64_t* generation) const;
  uint8_t* HostSlot(uint64_t slot) const { return host_->base() + slot * block_bytes_; }

  const std::string model_;  // every disk record names it
  const uint64_t block_bytes_;
  const uint32_t block_tokens_;
  const TierOptions options_;
  KvEventLog* const events_;
  uint64_t layout_key_ = 0;  // checksum of the fingerprint: a file of another layout is foreign
  uint64_t header_bytes_ = 0, slot_bytes_ = 0;
  std::string disk_file_;
  std::unique_ptr<TierFile> file_;  // the disk tier's file (its folder locked meanwhile)
  int fd_ = -1;                     // file_'s
  bool direct_ = false;
  std::unique_ptr<PoolMemory> host_;  // the host tier's slots
  uint64_t host_capacity_ = 0, disk_capacity_ = 0;

  mutable absl::Mutex mu_;
  absl::flat_hash_map<Key, HostEntry> host_index_ ABSL_GUARDED_BY(mu_);
  std::list<Key> host_lru_ ABSL_GUARDED_BY(mu_);  // most recently used first
  std::vector<uint64_t> host_free_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<Key, DiskEntry> disk_index_ ABSL_GUARDED_BY(mu_);
  std::list<Key> disk_lru_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> disk_free_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<Key, WriteJob> queued_ ABSL_GUARDED_BY(mu_);  // spills not yet written
  std::deque<Key> queue_ ABSL_GUARDED_BY(mu_);
  uint64_t writing_ ABSL_GUARDED_BY(mu_) = 0;  // jobs an I/O thread took and is writing
  uint64_t next_generation_ ABSL_GUARDED_BY(mu_) = 1;
  std::vector<Key> scrub_keys_ ABSL_GUARDED_BY(mu_);  // blocks indexed at start, to check
  uint64_t unverified_ ABSL_GUARDED_BY(mu_) = 0;      // of those, not checked yet
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  TierStats stats_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> io_threads_;
};

}  // namespace kvbank

#endif  // KVBANK_SERVER_CORE_TIERS_H_
