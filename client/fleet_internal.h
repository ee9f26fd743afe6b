// The state behind kvbank::Fleet (kvbank/fleet.h), shared by its three files: fleet_members.cc
// (target, resolution, health checks, membership), fleet.cc (placement and routed calls) and
// fleet_watch.cc (merged KV events). Not a public header.
#ifndef KVBANK_CLIENT_FLEET_INTERNAL_H_
#define KVBANK_CLIENT_FLEET_INTERNAL_H_

#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kvbank/client.h"
#include "kvbank/fleet.h"

namespace kvbank {

inline const absl::Status& StatusOf(const absl::Status& s) { return s; }
template <typename T>
const absl::Status& StatusOf(const absl::StatusOr<T>& r) {
  return r.status();
}

struct Fleet::Impl {
  // A replica that answered GetServerInfo: the unit of placement.
  struct Member {
    std::string name;
    std::string address;
    std::shared_ptr<Client> client;
    bool healthy = false;
    std::string reason;
  };
  // An address from the resolution whose server has not answered yet (its name is unknown).
  struct Pending {
    std::shared_ptr<Client> client;
    std::string reason;
  };
  // An EnsureModel / EnsurePreset that succeeded through the fleet, replayed on every replica
  // before it takes placements.
  struct EnsureCall {
    std::optional<ModelLayout> layout;  // set: EnsureModel; else EnsurePreset
    std::string name, preset;
    std::optional<DType> storage;
    uint64_t pool_bytes = 0;
    uint32_t block_tokens = 0;
  };
  // A healthy replica picked for a call: its name and its Client (kept alive by the pointer).
  using Pick = std::pair<std::string, std::shared_ptr<Client>>;
  // A replica's live sequences as this fleet knows them: `reported` by its last GetStats, which
  // was sent when this fleet's own counter `placed` (creates answered minus frees) stood at
  // `base`, plus the creates this fleet has sent there and not had answered (`in_flight`).
  struct Load {
    uint64_t reported = 0;
    int64_t placed = 0, base = 0, in_flight = 0;
    uint64_t Now() const {
      const int64_t n = static_cast<int64_t>(reported) + placed - base + in_flight;
      return n > 0 ? static_cast<uint64_t>(n) : 0;
    }
  };
  // One prefix copy to one replica: the create that runs it, and the creates that wait for it.
  struct Copy {
    bool done = false;
    absl::Time done_at;
  };
  using CopyKey = std::pair<std::string, BlockHash>;  // (replica, deepest block copied)
  // The replica this fleet last placed a block's prompt on, for placement_memory hashes.
  struct Placements {
    struct Entry {
      std::string replica;
      uint64_t serial = 0;  // the newest insertion; older queue entries of the hash are stale
    };
    std::map<BlockHash, Entry> where;
    std::deque<std::pair<BlockHash, uint64_t>> order;  // oldest first
    uint64_t next = 0;
  };
  // A prompt's hashes and where its longest known prefix was placed (Source).
  struct Prefix {
    Client::PrefixRootInfo root;    // algorithm, block_tokens
    std::vector<BlockHash> hashes;  // every full block of the prompt
    std::string holder;  // the replica of the deepest hash this fleet placed; empty: none
    size_t holder_blocks = 0;
  };
  // A placement decision (fleet_placement.cc).
  struct Placement {
    std::vector<Pick> order;      // healthy replicas in the key's rendezvous order
    std::vector<uint64_t> loads;  // of `order`
    LoadPick pick;
    bool bounded = false;  // load_epsilon set
  };

  std::string target;
  FleetOptions options;
  bool dns = false;
  std::string dns_host, dns_port;        // dns:///host:port
  std::vector<std::string> static_list;  // host:port,host:port

  // Lock order: refresh_mu before mu. No RPC runs under mu.
  absl::Mutex refresh_mu;  // one resolution + probe round at a time
  mutable absl::Mutex mu;
  std::map<std::string, Member> members ABSL_GUARDED_BY(mu);   // by name
  std::map<std::string, Pending> pending ABSL_GUARDED_BY(mu);  // by address
  std::vector<std::string> addresses ABSL_GUARDED_BY(mu);      // the last resolution
  std::vector<EnsureCall> ensured ABSL_GUARDED_BY(mu);
  // Per model: the prefix root info for cache salt "" every replica agreed on.
  std::map<std::string, Client::PrefixRootInfo> roots ABSL_GUARDED_BY(mu);
  std::atomic<uint64_t> empty_prompts{0};
  std::map<std::string, Load> loads ABSL_GUARDED_BY(mu);  // by replica name
  Placements placements ABSL_GUARDED_BY(copy_mu);
  absl::Mutex copy_mu;    // never held with mu
  absl::CondVar copy_cv;  // a copy ended
  std::map<CopyKey, Copy> copies ABSL_GUARDED_BY(copy_mu);
  Fleet::Stats stats ABSL_GUARDED_BY(copy_mu);

  absl::Mutex stop_mu;
  bool stop ABSL_GUARDED_BY(stop_mu) = false;
  std::thread background;

  // fleet_members.cc
  absl::StatusOr<std::vector<std::string>> Resolve() const;
  absl::Status ResolveAndUpdate() ABSL_EXCLUSIVE_LOCKS_REQUIRED(refresh_mu);
  void ProbeAll() ABSL_EXCLUSIVE_LOCKS_REQUIRED(refresh_mu);
  // Makes the pending `address` the member `name` when `checked` is OK and the name is not
  // taken by a live address; else records why. Returns whether it joined.
  bool Admit(const std::string& address, const std::string& name,
             const std::shared_ptr<Client>& client, const absl::Status& checked)
      ABSL_LOCKS_EXCLUDED(mu);
  // Ensures the remembered models on `client` and checks its prefix roots against the fleet's.
  absl::Status Prepare(Client& client) ABSL_LOCKS_EXCLUDED(mu);
  void BackgroundLoop();

  // Healthy replicas in rendezvous order for `key`.
  std::vector<Pick> Candidates(const BlockHash& key) const ABSL_LOCKS_EXCLUDED(mu);
  // UNAVAILABLE: no replica is healthy, with each one's reason.
  absl::Status NoHealthyReplica() const ABSL_LOCKS_EXCLUDED(mu);
  void MarkDown(const std::string& name, const absl::Status& why) ABSL_LOCKS_EXCLUDED(mu);
  // The member's Client and address, or nullopt when it is not in the fleet.
  std::optional<std::pair<std::shared_ptr<Client>, std::string>> Find(const std::string& name) const
      ABSL_LOCKS_EXCLUDED(mu);
  std::vector<Pick> Healthy() const ABSL_LOCKS_EXCLUDED(mu);

  // fleet_placement.cc
  // Where a new placement of `key` goes now (UNAVAILABLE when no replica is healthy). With
  // `reserve`, the chosen replica's load counts the placement at once (in flight), so concurrent
  // placements see each other; the caller then calls Placed.
  absl::StatusOr<Placement> Place(const BlockHash& key, bool reserve) ABSL_LOCKS_EXCLUDED(mu);
  // A reserved placement on `replica` was answered: created (counted) or not (dropped).
  void Placed(const std::string& replica, bool created) ABSL_LOCKS_EXCLUDED(mu);
  // A sequence on `replica` was freed through this fleet.
  void Freed(const std::string& replica) ABSL_LOCKS_EXCLUDED(mu);
  // The prompt's block hashes and the replica this fleet last placed its longest prefix on.
  absl::StatusOr<Prefix> Lookup(const std::string& model, const std::vector<uint32_t>& prompt,
                                const std::string& cache_salt,
                                const std::vector<ExtraKey>& extra_keys)
      ABSL_LOCKS_EXCLUDED(copy_mu);
  // Sets prefix's holder from its hashes (none when this fleet placed none of them).
  void FindHolder(Prefix* prefix) ABSL_LOCKS_EXCLUDED(copy_mu);
  // Remembers every hash of `prefix` as placed on `replica`.
  void Remember(const Prefix& prefix, const std::string& replica) ABSL_LOCKS_EXCLUDED(copy_mu);
  // Where a sequence placed on `chosen` (home: the key's first choice) copies its prefix from:
  // the known holder, else home when chosen is not home; null when none.
  const Pick* CopySource(const Placement& p, const Prefix& prefix) const;
  // Copies the prefix blocks of `args.prompt` that `from` holds and `to` lacks from one to the
  // other, once per (prefix, replica) across concurrent callers. Errors are counted and
  // returned; the caller goes on without the copy.
  absl::Status CopyPrefix(const std::string& model, const Client::CreateArgs& args,
                          const Prefix& prefix, const Pick& from, const Pick& to)
      ABSL_LOCKS_EXCLUDED(copy_mu);
  // The copy itself: the prompt's first `blocks` blocks (hashes `hashes`) that `to` lacks,
  // fetched from `from`. Returns the blocks and bytes copied.
  absl::StatusOr<std::pair<uint64_t, uint64_t>> RunCopy(const std::string& model,
                                                        const Client::CreateArgs& args,
                                                        const std::vector<BlockHash>& hashes,
                                                        uint32_t block_tokens, size_t blocks,
                                                        const Pick& from, const Pick& to);
  // Learns the replica's live sequences (GetStats; no change when it fails).
  void ReportLoad(const std::string& name, Client& client) ABSL_LOCKS_EXCLUDED(mu);

  // fleet.cc
  absl::StatusOr<Client::PrefixRootInfo> RootInfo(const std::string& model) ABSL_LOCKS_EXCLUDED(mu);
  void ForgetEnsured(const std::string& model) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (auto it = ensured.begin(); it != ensured.end();) {
      it = it->name == model ? ensured.erase(it) : std::next(it);
    }
  }
  absl::Status ParseTarget();  // fleet_members.cc

  // A call on the replica that holds `seq`, and nowhere else: UNAVAILABLE naming the replica
  // and the sequence when the replica has left the fleet or answers UNAVAILABLE.
  template <typename F>
  auto OnSequence(const Fleet::Sequence& seq, F&& f) -> decltype(f(std::declval<Client&>())) {
    auto found = Find(seq.replica);
    if (!found.has_value()) {
      return absl::UnavailableError(absl::StrCat("replica ", seq.replica, " holding sequence ",
                                                 seq.id, " of model ", seq.model,
                                                 " has left the fleet"));
    }
    auto r = f(*found->first);
    if (const absl::Status& s = StatusOf(r); absl::IsUnavailable(s)) {
      MarkDown(seq.replica, s);
      return absl::UnavailableError(absl::StrCat("replica ", seq.replica, " (", found->second,
                                                 ") holding sequence ", seq.id, " of model ",
                                                 seq.model, " is unavailable: ", s.message()));
    }
    return r;
  }

  // A call placed by `key`: the best healthy replica, the next one when it answers UNAVAILABLE
  // (then marked down). f(client, replica name).
  template <typename F>
  auto OnPlacement(const BlockHash& key, F&& f)
      -> decltype(f(std::declval<Client&>(), std::string())) {
    auto candidates = Candidates(key);
    if (candidates.empty()) return NoHealthyReplica();
    absl::Status last;
    for (const auto& [name, client] : candidates) {
      auto r = f(*client, name);
      if (const absl::Status& s = StatusOf(r); absl::IsUnavailable(s)) {
        MarkDown(name, s);
        last = absl::UnavailableError(absl::StrCat("replica ", name, ": ", s.message()));
        continue;
      }
      return r;
    }
    return absl::UnavailableError(
        absl::StrCat("every healthy replica answered UNAVAILABLE; the last: ", last.message()));
  }
};

// Why `a` and `b` (two replicas' GetPrefixRoot answers for one model) would never share a block;
// empty when they agree.
std::string RootMismatch(const Client::PrefixRootInfo& a, const Client::PrefixRootInfo& b);

}  // namespace kvbank

#endif  // KVBANK_CLIENT_FLEET_INTERNAL_H_
