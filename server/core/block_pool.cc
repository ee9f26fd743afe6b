#include "block_pool.h"

#include <sys/mman.h>

#include <limits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvbank {

BlockRef& BlockRef::operator=(BlockRef&& o) noexcept {
  if (this != &o) {
    Reset();
    pool_ = o.pool_;
    id_ = o.id_;
    o.pool_ = nullptr;
    o.id_ = -1;
  }
  return *this;
}

void BlockRef::Reset() {
  if (pool_ != nullptr) pool_->Release(id_);
  pool_ = nullptr;
  id_ = -1;
}

absl::StatusOr<std::unique_ptr<BlockPool>> BlockPool::CreateHost(BlockLayout layout,
                                                                 uint64_t pool_bytes) {
  if (layout.block_bytes == 0) return absl::InvalidArgumentError("block layout is empty");
  const uint64_t n = pool_bytes / layout.block_bytes;
  if (n == 0) {
    return absl::InvalidArgumentError(absl::StrCat("pool_bytes ", pool_bytes, " holds no block of ",
                                                   layout.block_bytes, " bytes"));
  }
  if (n > uint64_t(std::numeric_limits<int32_t>::max())) {
    return absl::InvalidArgumentError(
        absl::StrCat("pool_bytes ", pool_bytes, " makes ", n, " blocks; at most 2^31-1"));
  }
  const uint64_t bytes = n * layout.block_bytes;
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot map ", bytes, " bytes of host memory"));
  }
  madvise(p, bytes, MADV_HUGEPAGE);  // best effort
  return std::unique_ptr<BlockPool>(
      new BlockPool(std::move(layout), static_cast<uint8_t*>(p), bytes, n));
}

BlockPool::BlockPool(BlockLayout layout, uint8_t* base, uint64_t mapped_bytes, uint64_t num_blocks)
    : layout_(std::move(layout)),
      base_(base),
      mapped_bytes_(mapped_bytes),
      num_blocks_(num_blocks) {
  refcount_.assign(num_blocks, 0);
  free_list_.reserve(num_blocks);
  // Lowest ids on top of the stack, so a fresh pool hands out blocks in address order.
  for (uint64_t i = num_blocks; i > 0; --i) free_list_.push_back(static_cast<int32_t>(i - 1));
}

BlockPool::~BlockPool() { munmap(base_, mapped_bytes_); }

absl::StatusOr<std::vector<BlockRef>> BlockPool::Allocate(size_t n) {
  std::vector<BlockRef> out;
  out.reserve(n);
  absl::MutexLock lock(&mu_);
  if (free_list_.size() < n) {
    return absl::ResourceExhaustedError(absl::StrCat("block pool exhausted: need ", n, " blocks, ",
                                                     free_list_.size(), " free of ", num_blocks_));
  }
  for (size_t i = 0; i < n; ++i) {
    const int32_t id = free_list_.back();
    free_list_.pop_back();
    refcount_[id] = 1;
    out.push_back(BlockRef(this, id));
  }
  return out;
}

BlockRef BlockPool::Share(const BlockRef& r) {
  absl::MutexLock lock(&mu_);
  ++refcount_[r.id()];
  return BlockRef(this, r.id());
}

uint32_t BlockPool::RefCount(int32_t id) const {
  absl::MutexLock lock(&mu_);
  return refcount_[id];
}

void BlockPool::Release(int32_t id) {
  absl::MutexLock lock(&mu_);
  if (--refcount_[id] == 0) free_list_.push_back(id);
}

PoolStats BlockPool::Stats() const {
  absl::MutexLock lock(&mu_);
  PoolStats s;
  s.total = num_blocks_;
  s.free = free_list_.size();
  s.used = num_blocks_ - s.free;
  return s;
}

std::string BlockPool::CheckInvariants() const {
  absl::MutexLock lock(&mu_);
  std::vector<bool> seen(num_blocks_, false);
  for (int32_t id : free_list_) {
    if (id < 0 || uint64_t(id) >= num_blocks_) return absl::StrCat("free id ", id, " out of range");
    if (seen[id]) return absl::StrCat("block ", id, " twice on the free list");
    if (refcount_[id] != 0) return absl::StrCat("free block ", id, " has count ", refcount_[id]);
    seen[id] = true;
  }
  uint64_t used = 0;
  for (uint64_t id = 0; id < num_blocks_; ++id) {
    if (!seen[id] && refcount_[id] == 0) return absl::StrCat("block ", id, " leaked (count 0)");
    used += refcount_[id] > 0;
  }
  if (used + free_list_.size() != num_blocks_) {
    return absl::StrCat("free ", free_list_.size(), " + used ", used, " != total ", num_blocks_);
  }
  return "";
}

}  // namespace kvbank
