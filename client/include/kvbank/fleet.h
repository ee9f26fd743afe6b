// kvbank fleet: one SDK object over several kvbankd replicas, no cluster manager.
//
//   auto fleet = kvbank::Fleet::Connect("dns:///kvbank-headless.ns:50051");
//   (*fleet)->EnsurePreset("llama", "llama-3.1-8b");            // on every replica
//   auto seq = (*fleet)->CreateSequence("llama", {.prompt = ids});  // placed by its prefix
//   (*fleet)->Append(*seq, {.num_tokens = n}, payload);          // goes where seq lives
//
// Membership. The target is `dns:///name:port` (re-resolved every resolve_interval with
// getaddrinfo: every A / AAAA record is a replica, as a Kubernetes headless Service publishes a
// StatefulSet's pods) or a static list `host:port,host:port`. Each address gets its own
// kvbank::Client. A replica is known by the name kvbankd reports in GetServerInfo
// (--replica-name, default its host name: a StatefulSet's stable pod name), so a pod that comes
// back under a new IP keeps its place; a kvbankd that reports no name is known by its address.
// Addresses that leave the resolution leave the fleet; two addresses that report the same name
// are one replica (the first that answered).
//
// Placement (specified byte for byte, with test vectors, in client/PLACEMENT.md): rendezvous
// (highest-random-weight) hashing with bounded load. Every replica scores a key with
// RendezvousScore(name, key); the healthy replica with the highest score is the key's home.
// Adding a replica to N moves about 1/(N+1) of the keys' homes (only those the new one now
// wins); removing one moves only its own. The home takes a new sequence unless it already holds
// (1 + load_epsilon) x the fleet's mean of live sequences (PickBoundedLoad), when the
// least-loaded replica does: a hot system prompt spreads over the fleet instead of pinning it to
// one replica. Before such a create, the prompt's prefix blocks are copied where it lands from
// the replica that holds them (copy_prefixes): a hit, never a recompute, once per (prefix,
// replica). Route says where a prompt would go and why.
//
// The key of a sequence is its first full block's prefix hash (kvbank/prefix_hash.h, computed
// here; the hash chains the model's root, i.e. layout fingerprint, tenant and cache salt, the
// block's token ids and the extra keys), so every prompt that shares a first block, and thus
// every prompt that could share any cached block, meets on one replica. The root is computed
// client-side from GetPrefixRoot's fingerprint and tenant, which the fleet checks agree on every
// replica (a mismatch is FAILED_PRECONDITION naming both replicas: their hashes would never
// meet). A prompt shorter than one block has no cacheable block, so where it lands does not
// matter for the cache: its key is the hash of its partial block (the same short prompt lands
// on the same replica, different ones spread); an empty prompt takes a per-fleet counter, so
// sequences that start empty spread evenly instead of piling onto one replica.
//
// Failure. A Sequence handle remembers its replica, and every call on it goes there: never
// silently anywhere else. When that replica has left the fleet, or answers UNAVAILABLE (refused,
// unreachable, draining), the call fails UNAVAILABLE naming the replica and the sequence. A
// replica that answers UNAVAILABLE, or whose health check is not SERVING, is skipped for new
// placements (its keys go to their next choice) until a health check says SERVING again
// (checked every probe_interval); models ensured through the fleet are ensured on it first.
//
// Thread safety: a Fleet is thread-safe; share one per process. Inside, one resolution and
// health-check round runs at a time (the background thread's or Refresh's), and no RPC runs
// under the membership lock.
#ifndef KVBANK_FLEET_H_
#define KVBANK_FLEET_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kvbank/client.h"
#include "kvbank/prefix_hash.h"

namespace kvbank {

// Rendezvous score of `replica` for `key`: a 64-bit hash of both (XXH3-64 of the key seeded by
// XXH3-64 of the name). Deterministic across processes and versions of this SDK.
uint64_t RendezvousScore(std::string_view replica, const BlockHash& key);
// Indices into `replicas`, best first (highest score; equal scores by name). Thread-safe.
std::vector<size_t> RendezvousOrder(absl::Span<const std::string> replicas, const BlockHash& key);

// The bounded-load choice (client/PLACEMENT.md). `order`: the replicas (indices into `loads`) in
// the key's rendezvous order; `loads[i]`: replica i's live sequences. With N = loads.size() and
// T = the sum of loads, the bound is cap = max(1, floor((1 + epsilon) * (T + 1) / N)) (IEEE
// double, in that order). The key's first choice (its "home") takes the placement when its load
// is below cap; otherwise the least-loaded replica does (equal loads: the earlier in `order`).
// REQUIRES: order is a permutation of [0, N), N > 0, epsilon >= 0.
struct LoadPick {
  size_t chosen = 0;  // index into loads
  bool home = true;   // chosen == order[0] (below cap, or no replica is less loaded)
  uint64_t cap = 0;
};
LoadPick PickBoundedLoad(absl::Span<const size_t> order, absl::Span<const uint64_t> loads,
                         double epsilon);

struct FleetOptions {
  ClientOptions client;  // every replica's Client
  // dns:/// targets: how often the name is resolved again.
  absl::Duration resolve_interval = absl::Seconds(10);
  // How often every replica's health is checked (a down one comes back after its first SERVING).
  absl::Duration probe_interval = absl::Seconds(1);
  // Bound on one health check (and on GetServerInfo when an address joins).
  absl::Duration probe_deadline = absl::Milliseconds(500);
  // Bounded-load placement (client/PLACEMENT.md): a sequence goes to its key's first choice
  // unless that replica holds (1 + load_epsilon) x the fleet's mean live sequences or more; then
  // to the least-loaded replica. Unset: by key only (every prompt that shares a first block
  // lands on one replica, however hot).
  std::optional<double> load_epsilon = 0.15;
  // Before a sequence is created, the prefix blocks of its prompt that another replica holds
  // and the chosen one lacks are copied there (fetched by hash there, appended here, then left
  // cached), so its cached_tokens are what that replica would have given. The source is the
  // replica this fleet last placed the prompt's longest known prefix on (a conversation's
  // earlier turn, a prefix used before), else the key's first choice when the sequence is
  // placed away from it. Once per (prefix, replica) even when many creates arrive at once; a
  // copy that fails leaves the create to proceed with what is cached (counted in Stats()).
  bool copy_prefixes = true;
  // How many block hashes the fleet remembers the replica of (the copy source index above):
  // every full block of every prompt it placed, the oldest forgotten first.
  size_t placement_memory = 1 << 18;
  // How long a finished copy is trusted before the next create of that prefix on that replica
  // checks again that the blocks are still there (they may have been evicted).
  absl::Duration copy_recheck = absl::Seconds(5);
  // Set: replaces the target's resolution (another discovery source, or a test's membership):
  // returns the replicas' gRPC addresses now; called where the target would be resolved.
  std::function<absl::StatusOr<std::vector<std::string>>()> resolver;
};

class Fleet {
 public:
  struct Replica {
    std::string name;     // --replica-name, or the address when the server reports none
    std::string address;  // host:port the Client talks to
    bool healthy = false;
    std::string reason;  // why not healthy (the last error); empty when healthy
    // Live sequences as this fleet knows them: the replica's last reported count (GetStats at
    // each health check, all models, the caller's tenant's view) plus the creates this fleet
    // sent it since, minus its frees.
    uint64_t load = 0;
  };
  // Where a new sequence of a prompt goes now, and why (Route).
  struct RouteDecision {
    std::string replica;  // where CreateSequence would place it now
    std::string home;     // the key's first choice among healthy replicas
    // "home": under the load bound; "over_load_bound": home is at the bound, so the
    // least-loaded replica; "by_key": no load bound configured.
    std::string reason;
    BlockHash key{};
    uint64_t load = 0, home_load = 0;  // live sequences (see Replica::load)
    uint64_t load_bound = 0;           // home takes placements while its load is below this
    double mean_load = 0;              // over healthy replicas, with this placement counted
    uint64_t prompt_tokens = 0;
    uint64_t cached_tokens = 0;  // at `replica` now (Match)
    // Where CreateSequence would copy the prompt's prefix from (copy_prefixes; see there), and
    // the tokens it holds of the prompt now (Match); empty and 0 when no copy would run.
    std::string copy_from;
    uint64_t copy_from_cached_tokens = 0;
    // Tokens the copy would bring: copy_from_cached_tokens - cached_tokens when positive.
    uint64_t copy_tokens = 0;
    // The cost of the request at `replica` in tokens the engine must prefill there:
    // prompt_tokens - (cached_tokens + copy_tokens).
    uint64_t cost = 0;
  };
  // What the fleet did, since it was connected.
  struct Stats {
    uint64_t placements = 0;          // sequences created through CreateSequence
    uint64_t home_placements = 0;     // of those, on their key's first choice
    uint64_t bounded_placements = 0;  // moved off a home at the load bound
    uint64_t prefix_copies = 0;       // copies run (replica to replica)
    uint64_t copied_blocks = 0, copied_bytes = 0;
    uint64_t copies_joined = 0;   // creates that waited for a copy another create ran
    uint64_t copies_skipped = 0;  // creates whose prefix was already copied there
    uint64_t copy_failures = 0;   // copies that failed (the create went on without them)
  };
  // A sequence and the replica that holds it. Copyable: a plain value, no resources.
  struct Sequence {
    std::string replica;
    std::string model;
    uint64_t id = 0;
    Client::SequenceInfo info;  // as of the call that returned it
  };
  // A KV event of one replica (Watch): the router's index is keyed by (replica, hash).
  // A kAllCleared event the fleet makes itself (sequence 0) means: forget everything of this
  // replica (its stream broke, it left the fleet, or its resume point is gone).
  struct TaggedEvents {
    std::string replica;
    std::vector<Client::Event> events;
  };
  struct AttendQuery {
    Sequence sequence;
    uint32_t layer = 0;
    std::vector<float> query;  // [num_q_heads][head_dim] fp32
  };

  // Resolves `target` once (INVALID_ARGUMENT for a malformed one, UNAVAILABLE when the name does
  // not resolve), learns the replicas that answer within probe_deadline and starts the
  // background thread that re-resolves and health-checks. Replicas that do not answer yet join
  // when they do.
  static absl::StatusOr<std::unique_ptr<Fleet>> Connect(const std::string& target,
                                                        FleetOptions options = {});
  // Stops the background thread. REQUIRES: no call on this Fleet is in flight.
  ~Fleet();
  Fleet(const Fleet&) = delete;
  Fleet& operator=(const Fleet&) = delete;

  // Resolves and health-checks now (what the background thread does periodically); returns the
  // resolution's error, if any (membership then stays as it was).
  absl::Status Refresh();
  // Every replica known (joined), sorted by name.
  std::vector<Replica> Replicas() const;
  // The Client of a replica (for calls the fleet does not route), or null when it is not in the
  // fleet. The Client stays valid while the caller holds it.
  std::shared_ptr<Client> ReplicaClient(const std::string& name) const;

  // Registers the model on every healthy replica (the first replica's answer is returned; any
  // non-UNAVAILABLE error is returned as is) and remembers it: a replica that joins or recovers
  // gets it before it takes placements.
  absl::StatusOr<Client::ModelInfo> EnsureModel(const ModelLayout& layout, uint64_t pool_bytes = 0);
  absl::StatusOr<Client::ModelInfo> EnsurePreset(const std::string& name, const std::string& preset,
                                                 std::optional<DType> storage = std::nullopt,
                                                 uint64_t pool_bytes = 0,
                                                 uint32_t block_tokens = 0);

  // The placement key of a prompt (see the top of this file).
  absl::StatusOr<BlockHash> PlacementKey(const std::string& model,
                                         const std::vector<uint32_t>& prompt,
                                         const std::string& cache_salt = "",
                                         const std::vector<ExtraKey>& extra_keys = {});
  // The healthy replica a new placement of `key` goes to now; UNAVAILABLE when none is healthy.
  absl::StatusOr<std::string> ReplicaFor(const BlockHash& key) const;
  // The model's prefix root for `cache_salt`, computed here and checked equal on every healthy
  // replica (learnt once per model).
  absl::StatusOr<Client::PrefixRootInfo> PrefixRoot(const std::string& model,
                                                    const std::string& cache_salt = "");

  // Where CreateSequence would place a prompt now, with the loads, the cached tokens at the
  // chosen replica and at the copy source (one Match on each), and the cost.
  absl::StatusOr<RouteDecision> Route(const std::string& model, const Client::MatchQuery& prompt);
  Stats GetStats() const;

  // Placed by its key with bounded load (see FleetOptions::load_epsilon; the next choice when
  // the chosen replica answers UNAVAILABLE), after copying its prefix there when it is not the
  // key's first choice (FleetOptions::copy_prefixes).
  absl::StatusOr<Sequence> CreateSequence(const std::string& model,
                                          const Client::CreateArgs& args = {});
  // Calls on a sequence: on its replica only (UNAVAILABLE naming both when it is gone).
  absl::StatusOr<Client::SequenceInfo> Append(const Sequence& seq, const Client::AppendArgs& args,
                                              absl::Span<const uint8_t> payload);
  absl::StatusOr<Client::SequenceInfo> AppendTensors(const Sequence& seq,
                                                     const Client::AppendArgs& args,
                                                     absl::Span<const uint8_t> k,
                                                     absl::Span<const uint8_t> v);
  absl::StatusOr<Client::FetchResult> Fetch(const Sequence& seq, const Client::FetchArgs& args);
  absl::StatusOr<Client::FetchResult> FetchInto(const Sequence& seq, const Client::FetchArgs& args,
                                                absl::Span<uint8_t> out);
  absl::Status FetchTensors(const Sequence& seq, const Client::FetchArgs& args,
                            absl::Span<uint8_t> k, absl::Span<uint8_t> v);
  // The fork lives on the same replica (it shares the parent's blocks).
  absl::StatusOr<Sequence> Fork(const Sequence& seq,
                                std::optional<absl::Duration> lease = std::nullopt);
  absl::StatusOr<Client::SequenceInfo> Truncate(const Sequence& seq, uint64_t num_tokens);
  absl::StatusOr<uint64_t> Free(const Sequence& seq);
  absl::StatusOr<Client::SequenceInfo> RenewLease(const Sequence& seq);
  absl::StatusOr<Client::SequenceInfo> GetSequence(const Sequence& seq);
  // Queries grouped by their sequences' replicas; outputs in the order of `queries`.
  absl::StatusOr<std::vector<Client::AttendOutput>> Attend(const std::string& model,
                                                           const std::vector<AttendQuery>& queries,
                                                           const Client::AttendArgs& args = {});

  // Prefix cache, each query asked of the replica its prompt (or first hash) would be placed
  // on: the answer a single server holding that prompt's blocks gives.
  absl::StatusOr<std::vector<uint64_t>> Match(const std::string& model,
                                              const std::vector<Client::MatchQuery>& queries);
  // GetPrefixRoot answered by the replica the root's own key is placed on (every replica gives
  // the same answer; PrefixRoot checks that).
  absl::StatusOr<Client::PrefixRootInfo> GetPrefixRoot(const std::string& model,
                                                       const std::string& cache_salt = "");
  absl::StatusOr<Client::FetchResult> FetchBlocks(const std::string& model,
                                                  const std::vector<BlockHash>& hashes,
                                                  const Client::FetchArgs& args = {});
  absl::StatusOr<uint64_t> Pin(const std::string& model, const Client::MatchQuery& blocks,
                               bool pin = true);

  // Merged KV events of every replica, each batch tagged with its replica, until on_batch
  // returns false (OK) or `deadline` passes (DEADLINE_EXCEEDED). One stream per replica; a
  // replica that joins meanwhile is watched from its first event. A stream that breaks, or a
  // replica that leaves, is reported as a kAllCleared event of that replica, and the stream
  // starts again from now once the replica is healthy. on_batch is called from one thread at a
  // time (never concurrently).
  absl::Status Watch(const std::string& model, bool from_now, absl::Duration deadline,
                     const std::function<bool(const TaggedEvents&)>& on_batch);

 private:
  struct Impl;
  explicit Fleet(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvbank

#endif  // KVBANK_FLEET_H_
