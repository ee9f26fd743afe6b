// Internal to server/core: the record of one sequence, shared by the SequenceStore's files
// (sequence_store.cc, sequence_store_transfer.cc, sequence_store_prefix.cc,
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
  std::vector<uint64_t> layer_len;  // tokens written per layer
  std::vector<uint32_t> token_ids;  // known token ids, positions [0, size)
  uint64_t cached_tokens = 0;
  absl::Duration lease_ttl = absl::ZeroDuration();
  absl::Time lease_deadline = absl::InfiniteFuture();
  // An AppendTxn is open (or its commit is compacting the sequence outside the lock): the lease
  // does not run out meanwhile (ExpireLeases, Find) and is renewed when the transaction ends.
  bool append_in_flight = false;
  bool removed = false;  // freed or expired; blocks go when the append in flight ends
  RetentionPolicy retention;
  std::vector<double> scores;  // heavy hitter: attention mass per token (all heads and layers)
  uint64_t generation = 0;     // bumped by every compaction (positions move)
  bool publishable = true;     // false once compacted: the ids no longer form a prompt prefix

  // Length() as the store's token counters hold it (SequenceStore::Account).
  uint64_t counted_length = 0;

  uint64_t Length() const { return *std::min_element(layer_len.begin(), layer_len.end()); }
};

inline uint64_t CeilDiv(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

}  // namespace kvbank

#endif  // KVBANK_SERVER_CORE_SEQUENCE_H_
