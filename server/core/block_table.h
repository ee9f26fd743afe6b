// A sequence's block table: logical block i (tokens [i * block_tokens, (i + 1) * block_tokens))
// -> a counted reference to the physical block that holds it, or a hole.
//
// Invariants (SequenceStore::CheckInvariants checks them for every live sequence):
//   - size() == ceil(longest layer length / block_tokens) whenever no append is in flight: every
//     token some layer holds has an entry, and there is no entry past the last one.
//   - An entry is a hole only where the sequence's retention released it (a sliding window drops
//     blocks that hold neither sinks nor window tokens). Nothing reads through a hole: transfers
//     and attention ask for the tokens they need, and a range that reaches a hole is refused.
//   - Every other entry holds a live reference, so the block stays as it is while the table
//     names it; a block shared with other tables or published is immutable (writers copy it
//     first and swap the copy in with Replace).
//   - Entries are released tail first (Truncate, Clear): cached blocks then age tail first, so
//     eviction takes a chain's tail before its head, which is what other prompts share.
//
// Not thread-safe: SequenceStore guards each table with its lock.
#ifndef KVBANK_SERVER_CORE_BLOCK_TABLE_H_
#define KVBANK_SERVER_CORE_BLOCK_TABLE_H_

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "server/core/block_pool.h"

namespace kvbank {

class BlockTable {
 public:
  // What Ids() and id() give for a hole: not a block (nothing reads through a hole).
  static constexpr int32_t kHoleId = -1;

  BlockTable() = default;
  BlockTable(BlockTable&&) = default;
  BlockTable& operator=(BlockTable&& o) noexcept {
    Clear();  // tail first, as everywhere
    entries_ = std::move(o.entries_);
    return *this;
  }
  BlockTable(const BlockTable&) = delete;
  BlockTable& operator=(const BlockTable&) = delete;
  ~BlockTable() { Clear(); }

  size_t size() const { return entries_.size(); }
  bool empty() const { return entries_.empty(); }
  bool hole(size_t i) const { return !entries_[i].valid(); }
  // REQUIRES: i < size() and !hole(i).
  const BlockRef& at(size_t i) const { return entries_[i]; }
  // Physical id of logical block i; kHoleId for a hole. REQUIRES: i < size().
  int32_t id(size_t i) const { return entries_[i].valid() ? entries_[i].id() : kHoleId; }
  // Entries that are not holes, among the first `end`.
  size_t held(size_t end = SIZE_MAX) const {
    size_t n = 0;
    for (size_t i = 0; i < std::min(end, entries_.size()); ++i) n += entries_[i].valid() ? 1 : 0;
    return n;
  }
  // True when any of logical blocks [b0, b1) is a hole. REQUIRES: b1 <= size().
  bool HasHole(size_t b0, size_t b1) const {
    for (size_t i = b0; i < b1; ++i) {
      if (hole(i)) return true;
    }
    return false;
  }
  // Physical ids of logical blocks [0, size()), holes as kHoleId: what transfers and kernels
  // index by logical block.
  std::vector<int32_t> Ids() const {
    std::vector<int32_t> ids(entries_.size());
    for (size_t i = 0; i < entries_.size(); ++i) ids[i] = id(i);
    return ids;
  }

  void Append(BlockRef b) { entries_.push_back(std::move(b)); }
  // Puts `b` at logical block i (a private copy of what was there); the old reference drops.
  void Replace(size_t i, BlockRef b) { entries_[i] = std::move(b); }
  // Makes logical block i a hole (retention released it).
  void Release(size_t i) { entries_[i].Reset(); }
  // Keeps the first `n` entries, dropping the rest tail first.
  void Truncate(size_t n) {
    while (entries_.size() > n) entries_.pop_back();
  }
  void Clear() { Truncate(0); }

 private:
  std::vector<BlockRef> entries_;
};

}  // namespace kvbank

#endif  // KVBANK_SERVER_CORE_BLOCK_TABLE_H_
