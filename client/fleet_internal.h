// The state behind kvbank::Fleet (kvbank/fleet.h), shared by its three files: fleet_members.cc
// (target, resolution, health checks, membership), fleet.cc (placement and routed calls) and
// fleet_watch.cc (merged KV events). Not a public header.
#ifndef KVBANK_CLIENT_FLEET_INTERNAL_H_
#define KVBANK_CLIENT_FLEET_INTERNAL_H_

#include <atomic>
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

  absl::Mutex stop_mu;
  bool stop ABSL_GUARDED_BY(stop_mu) = false;
  std::thread background;

  // fleet_members.cc
  absl::StatusOr<std::vector<std::string>> Resolve() const;
  absl::Status ResolveAndUpdate() ABSL_EXCLUSIVE_LOCKS_REQUIRED(refresh_mu);
  void ProbeAll() ABSL_EXCLUSIVE_LOCKS_REQUIRED(refresh_mu);
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
