// Internal to server/core: the record of one sequence, shared by the SequenceStore's files
// (sequence_store.cc, sequence_store_transfer.cc, sequence_store_wait.cc,
// sequence_store_attend.cc, sequence_store_retention.cc). Not part of any API.
#ifndef KVBANK_SERVER_CORE_SEQUENCE_H_
#define KVBANK_SERVER_CORE_SEQUENCE_H_

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "kvbank/prefix_hash.h"
#include "server/core/block_pool.h"
#include "server/core/block_table.h"
#include "server/core/sequence_store.h"

namespace kvbank {

// An append in flight: the layers x kv heads it writes and the logical blocks it writes into.
// Appends in flight on one sequence cover disjoint regions, so they write disjoint bytes (a
// block holds each head's rows and scales apart: kvbank/layout.h), and may run at once: the
// tensor-parallel ranks of a prefill each pushing their heads. An exclusive one (an fp8 append
// that continues a block, whose scale may grow and so rewrite stored rows) runs alone.
struct AppendRegion {
  uint64_t id = 0;
  uint32_t layer_begin = 0, layer_end = 0;
  uint32_t head_begin = 0, head_end = 0;
  uint64_t block_begin = 0, block_end = 0;
  bool exclusive = false;
  // Another append in flight writes into some of the same blocks: an abort then keeps its
  // copies on write, which the other writes through.
  bool joined = false;

  bool Overlaps(const AppendRegion& o) const {
    if (exclusive || o.exclusive) return true;
    return layer_begin < o.layer_end && o.layer_begin < layer_end && head_begin < o.head_end &&
           o.head_begin < head_end;
  }
};

// One request's KV: metadata only. Guarded by SequenceStore::mu_; payload bytes move outside it,
// into blocks only the moving transfer may write (rows past the lengths, or its own new blocks).
struct Sequence {
  uint64_t id = 0;
  std::string tenant;
  uint32_t tenant_id = BlockPool::kDefaultTenant;
  BlockHash root{};                  // prefix-hash root: layout, tenant, salt
  std::vector<ExtraKey> extra_keys;  // in every block's hash
  std::string lora;                  // for events
  uint8_t priority = 50;
  std::vector<BlockHash> hashes;    // hash of each leading full block with known token ids
  BlockTable table;                 // logical block i -> physical block (block_table.h)
  std::vector<uint64_t> layer_len;  // tokens every kv head of the layer holds, per layer
  // Tokens each (layer, kv head) holds, layer-major, while appends over head ranges left some
  // heads of a layer ahead of others; empty when each layer's heads all hold layer_len[l] (the
  // usual case, which so costs no memory per head).
  std::vector<uint64_t> head_len;
  std::vector<uint32_t> token_ids;  // known token ids, positions [0, size)
  uint64_t cached_tokens = 0;
  absl::Duration lease_ttl = absl::ZeroDuration();
  absl::Time lease_deadline = absl::InfiniteFuture();
  // Appends in flight (AppendTxn). While any is, or a commit compacts the sequence outside the
  // lock, the lease does not run out (ExpireLeases, Find); it is renewed when each one ends. The
  // table may then hold blocks past the lengths: the appends' new blocks, which go back when the
  // last append ends without filling them.
  std::vector<AppendRegion> appends;
  bool compacting = false;  // heavy-hitter rows being copied after a commit: excludes appends
  // An append's copy-on-write copies are being made outside the lock; the table takes them when
  // they are done, and appends that begin meanwhile wait for that.
  bool table_copying = false;
  bool removed = false;  // freed or expired; blocks go when the last append in flight ends
  // The block a Truncate cut in two (kNoBlock: none). Appends write only rows past the lengths,
  // which no reader of the sequence reads and no other sequence holds (Fork copies partial
  // blocks; the prefix cache holds full published ones), so a block a reader shares is written
  // in place; but readers from before a truncate may read rows of the cut block past the new
  // length, so that block is copied before a write while anyone else holds it.
  static constexpr uint64_t kNoBlock = ~uint64_t{0};
  uint64_t cut_block = kNoBlock;
  RetentionPolicy retention;
  std::vector<double> scores;  // heavy hitter: attention mass per token (all heads and layers)
  uint64_t generation = 0;     // bumped by every compaction (positions move)
  bool publishable = true;     // false once compacted: the ids no longer form a prompt prefix
  bool prefix_copy = false;    // CreateOptions::prefix_copy: its appends count as copied bytes
  // A fetch has waited for its tokens (WhenCommitted): a layer-wise handoff, whose reader pulls
  // each append's bytes as soon as it commits (AppendTxn::awaited).
  bool handed_off = false;

  // Length() as the store's token counters hold it (SequenceStore::Account).
  uint64_t counted_length = 0;

  uint64_t Length() const { return *std::min_element(layer_len.begin(), layer_len.end()); }
  bool busy() const { return !appends.empty() || compacting; }
  // Tokens kv head h of layer l holds; `heads`: the model's kv heads.
  uint64_t HeadLength(uint32_t l, uint32_t h, uint32_t heads) const {
    return head_len.empty() ? layer_len[l] : head_len[size_t{l} * heads + h];
  }
  // Tokens the furthest (layer, head) holds: the table covers them.
  uint64_t MaxLength() const {
    const std::vector<uint64_t>& v = head_len.empty() ? layer_len : head_len;
    return *std::max_element(v.begin(), v.end());
  }
};

inline uint64_t CeilDiv(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

}  // namespace kvbank

#endif  // KVBANK_SERVER_CORE_SEQUENCE_H_
