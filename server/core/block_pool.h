// The paged block pool: one aligned allocation of fixed-size blocks, with block records (reference
// counts) kept apart from the data and a free list.
#ifndef KVBANK_SERVER_CORE_BLOCK_POOL_H_
#define KVBANK_SERVER_CORE_BLOCK_POOL_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kvbank/layout.h"

namespace kvbank {

class BlockPool;

// A counted reference to one block. Move-only; destroying or resetting it drops the reference,
// and the block returns to the free list when its last reference goes. A BlockRef must not
// outlive its pool. Not thread-safe itself (one owner at a time); the pool it points to is.
class BlockRef {
 public:
  BlockRef() = default;
  BlockRef(BlockRef&& o) noexcept : pool_(o.pool_), id_(o.id_) {
    o.pool_ = nullptr;
    o.id_ = -1;
  }
  BlockRef& operator=(BlockRef&& o) noexcept;
  BlockRef(const BlockRef&) = delete;
  BlockRef& operator=(const BlockRef&) = delete;
  ~BlockRef() { Reset(); }

  bool valid() const { return pool_ != nullptr; }
  int32_t id() const { return id_; }
  void Reset();

 private:
  friend class BlockPool;
  BlockRef(BlockPool* pool, int32_t id) : pool_(pool), id_(id) {}
  BlockPool* pool_ = nullptr;
  int32_t id_ = -1;
};

struct PoolStats {
  uint64_t total = 0;
  uint64_t free = 0;
  uint64_t used = 0;  // referenced by at least one holder
};

// Thread-safe. Lock order: callers' locks (SequenceStore::mu_) before BlockPool::mu_.
class BlockPool {
 public:
  // Allocates host memory for as many blocks of `layout.block_bytes` as fit in `pool_bytes`
  // (page-aligned, transparent huge pages requested). INVALID_ARGUMENT when not one block fits,
  // RESOURCE_EXHAUSTED when the memory cannot be mapped.
  static absl::StatusOr<std::unique_ptr<BlockPool>> CreateHost(BlockLayout layout,
                                                               uint64_t pool_bytes);
  // REQUIRES: every BlockRef of this pool is gone.
  ~BlockPool();
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  // Takes n free blocks, each with one reference, all or nothing: RESOURCE_EXHAUSTED (nothing
  // taken) when fewer than n are free.
  absl::StatusOr<std::vector<BlockRef>> Allocate(size_t n);
  // Another reference to the block `r` refers to. REQUIRES: r.valid().
  BlockRef Share(const BlockRef& r);

  uint32_t RefCount(int32_t id) const;
  // Start of block `id`'s bytes. Stable for the pool's lifetime.
  uint8_t* BlockData(int32_t id) const { return base_ + uint64_t(id) * layout_.block_bytes; }
  uint8_t* base() const { return base_; }
  const BlockLayout& layout() const { return layout_; }
  uint64_t num_blocks() const { return num_blocks_; }
  uint64_t pool_bytes() const { return mapped_bytes_; }
  PoolStats Stats() const;

  // For tests: checks free + used == total, that free blocks have count 0 and appear once.
  // Returns an empty string when all hold, else what failed.
  std::string CheckInvariants() const;

 private:
  friend class BlockRef;
  BlockPool(BlockLayout layout, uint8_t* base, uint64_t mapped_bytes, uint64_t num_blocks);
  void Release(int32_t id);

  const BlockLayout layout_;
  uint8_t* const base_;
  const uint64_t mapped_bytes_;
  const uint64_t num_blocks_;

  mutable absl::Mutex mu_;
  std::vector<uint32_t> refcount_ ABSL_GUARDED_BY(mu_);  // block records, apart from the data
  std::vector<int32_t> free_list_ ABSL_GUARDED_BY(mu_);  // LIFO: recently freed blocks are warm
};

}  // namespace kvbank

#endif  // KVBANK_SERVER_CORE_BLOCK_POOL_H_
