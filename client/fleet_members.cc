// kvbank::Fleet membership: the target, its resolution, health checks, the rendezvous order.
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <tuple>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/fleet_internal.h"

namespace kvbank {

uint64_t RendezvousScore(std::string_view replica, const BlockHash& key) {
  const XXH64_hash_t seed = XXH3_64bits(replica.data(), replica.size());
  return XXH3_64bits_withSeed(key.data(), key.size(), seed);
}

std::vector<size_t> RendezvousOrder(absl::Span<const std::string> replicas, const BlockHash& key) {
  std::vector<std::pair<uint64_t, size_t>> scored;
  scored.reserve(replicas.size());
  for (size_t i = 0; i < replicas.size(); ++i) {
    scored.emplace_back(RendezvousScore(replicas[i], key), i);
  }
  std::sort(scored.begin(), scored.end(), [&](const auto& a, const auto& b) {
    if (a.first != b.first) return a.first > b.first;
    return replicas[a.second] < replicas[b.second];
  });
  std::vector<size_t> out;
  out.reserve(scored.size());
  for (const auto& s : scored) out.push_back(s.second);
  return out;
}

LoadPick PickBoundedLoad(absl::Span<const size_t> order, absl::Span<const uint64_t> loads,
                         double epsilon) {
  LoadPick pick;
  uint64_t total = 0;
  for (uint64_t l : loads) total += l;
  const double bound = std::floor((1.0 + epsilon) * static_cast<double>(total + 1) /
                                  static_cast<double>(loads.size()));
  pick.cap = std::max<uint64_t>(1, static_cast<uint64_t>(bound));
  pick.chosen = order.front();
  if (loads[pick.chosen] < pick.cap) return pick;
  for (size_t i : order) {
    if (loads[i] < loads[pick.chosen]) pick.chosen = i;
  }
  pick.home = pick.chosen == order.front();  // at the bound, but no replica is less loaded
  return pick;
}

std::string RootMismatch(const Client::PrefixRootInfo& a, const Client::PrefixRootInfo& b) {
  std::vector<std::string> why;
  if (a.layout_fingerprint != b.layout_fingerprint) {
    why.push_back(
        absl::StrCat("layout fingerprint ", a.layout_fingerprint, " vs ", b.layout_fingerprint));
  }
  if (a.tenant != b.tenant)
    why.push_back(absl::StrCat("tenant '", a.tenant, "' vs '", b.tenant, "'"));
  if (a.algorithm != b.algorithm) {
    why.push_back(absl::StrCat("hash algorithm ", HashAlgorithmName(a.algorithm), " vs ",
                               HashAlgorithmName(b.algorithm)));
  }
  if (a.block_tokens != b.block_tokens) {
    why.push_back(absl::StrCat("block_tokens ", a.block_tokens, " vs ", b.block_tokens));
  }
  if (why.empty() && a.root != b.root) why.push_back("root hash differs");
  return absl::StrJoin(why, ", ");
}

namespace {

// "host:port" with a numeric port; host may be [v6].
bool SplitHostPort(absl::string_view s, std::string* host, std::string* port) {
  const size_t colon = s.rfind(':');
  if (colon == absl::string_view::npos || colon == 0 || colon + 1 == s.size()) return false;
  uint32_t p = 0;
  if (!absl::SimpleAtoi(s.substr(colon + 1), &p) || p == 0 || p > 65535) return false;
  absl::string_view h = s.substr(0, colon);
  if (h.size() >= 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  *host = std::string(h);
  *port = std::string(s.substr(colon + 1));
  return !host->empty();
}

}  // namespace

absl::Status Fleet::Impl::ParseTarget() {
  Fleet::Impl* impl = this;
  if (absl::StartsWith(target, "dns:")) {
    if (!absl::StartsWith(target, "dns:///")) {
      return absl::InvalidArgumentError(absl::StrCat(
          "fleet target '", target, "': a DNS target is dns:///name:port (no authority)"));
    }
    impl->dns = true;
    if (!SplitHostPort(absl::string_view(target).substr(7), &impl->dns_host, &impl->dns_port)) {
      return absl::InvalidArgumentError(
          absl::StrCat("fleet target '", target, "': expected dns:///name:port"));
    }
    return absl::OkStatus();
  }
  for (absl::string_view entry : absl::StrSplit(target, ',')) {
    entry = absl::StripAsciiWhitespace(entry);
    if (entry.empty()) continue;
    std::string host, port;
    if (!absl::StartsWith(entry, "unix:") && !SplitHostPort(entry, &host, &port)) {
      return absl::InvalidArgumentError(
          absl::StrCat("fleet target '", target, "': entry '", entry, "' is not host:port"));
    }
    impl->static_list.emplace_back(entry);
  }
  if (impl->static_list.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "fleet target '", target, "' names no replica (dns:///name:port or host:port,...)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> Fleet::Impl::Resolve() const {
  if (options.resolver) return options.resolver();
  if (!dns) return static_list;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (int rc = getaddrinfo(dns_host.c_str(), dns_port.c_str(), &hints, &res); rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("resolving ", dns_host, " for fleet target ", target, ": ", gai_strerror(rc)));
  }
  std::set<std::string> out;
  for (const addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    char buf[INET6_ADDRSTRLEN] = {};
    if (ai->ai_family == AF_INET) {
      const auto* sin = reinterpret_cast<const sockaddr_in*>(ai->ai_addr);
      if (inet_ntop(AF_INET, &sin->sin_addr, buf, sizeof(buf)) == nullptr) continue;
      out.insert(absl::StrCat(buf, ":", dns_port));
    } else if (ai->ai_family == AF_INET6) {
      const auto* sin6 = reinterpret_cast<const sockaddr_in6*>(ai->ai_addr);
      if (inet_ntop(AF_INET6, &sin6->sin6_addr, buf, sizeof(buf)) == nullptr) continue;
      out.insert(absl::StrCat("[", buf, "]:", dns_port));
    }
  }
  freeaddrinfo(res);
  return std::vector<std::string>(out.begin(), out.end());
}

absl::Status Fleet::Impl::ResolveAndUpdate() {
  auto resolved = Resolve();
  if (!resolved.ok()) return resolved.status();  // membership stays as it was
  const std::set<std::string> now(resolved->begin(), resolved->end());
  std::vector<std::string> fresh;
  {
    absl::MutexLock lock(&mu);
    addresses.assign(now.begin(), now.end());
    for (auto it = members.begin(); it != members.end();) {
      it = now.count(it->second.address) ? std::next(it) : members.erase(it);
    }
    for (auto it = pending.begin(); it != pending.end();) {
      it = now.count(it->first) ? std::next(it) : pending.erase(it);
    }
    std::set<std::string> known;
    for (const auto& [name, m] : members) known.insert(m.address);
    for (const auto& [address, p] : pending) known.insert(address);
    for (const std::string& a : now) {
      if (!known.count(a)) fresh.push_back(a);
    }
  }
  absl::Status first_error;
  for (const std::string& address : fresh) {
    auto client = Client::Connect(address, options.client);
    if (!client.ok()) {
      if (first_error.ok()) first_error = client.status();
      continue;
    }
    absl::MutexLock lock(&mu);
    pending[address] = Pending{std::shared_ptr<Client>(std::move(*client)), "not checked yet"};
  }
  return first_error;
}

absl::Status Fleet::Impl::Prepare(Client& client) {
  std::vector<EnsureCall> calls;
  std::map<std::string, Client::PrefixRootInfo> known_roots;
  {
    absl::MutexLock lock(&mu);
    calls = ensured;
    known_roots = roots;
  }
  for (const EnsureCall& c : calls) {
    absl::Status s =
        c.layout.has_value()
            ? client.EnsureModel(*c.layout, c.pool_bytes).status()
            : client.EnsurePreset(c.name, c.preset, c.storage, c.pool_bytes, c.block_tokens)
                  .status();
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat("ensuring model ", c.name, ": ", s.message()));
    }
  }
  for (const auto& [model, fleet_root] : known_roots) {
    auto r = client.GetPrefixRoot(model);
    if (!r.ok()) {
      return absl::Status(r.status().code(),
                          absl::StrCat("prefix root of model ", model, ": ", r.status().message()));
    }
    if (std::string why = RootMismatch(fleet_root, *r); !why.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("its prefix root of model ", model, " differs from the fleet's (", why,
                       "): its blocks would never match the others'"));
    }
  }
  return absl::OkStatus();
}

bool Fleet::Impl::Admit(const std::string& address, const std::string& name,
                        const std::shared_ptr<Client>& client, const absl::Status& checked) {
  absl::MutexLock lock(&mu);
  auto p = pending.find(address);
  if (p == pending.end()) return false;  // left the resolution meanwhile
  if (!checked.ok()) {
    p->second.reason = std::string(checked.message());
    return false;
  }
  auto m = members.find(name);
  if (m != members.end() &&
      std::find(addresses.begin(), addresses.end(), m->second.address) != addresses.end()) {
    p->second.reason = absl::StrCat("duplicate of replica ", name, " at ", m->second.address);
    return false;
  }
  // New, or a replica back under a new address (a pod rescheduled): same name, same keys.
  members[name] = Member{name, address, client, true, ""};
  pending.erase(p);
  return true;
}

void Fleet::Impl::ProbeAll() {
  std::vector<std::pair<std::string, std::shared_ptr<Client>>> waiting, joined;
  {
    absl::MutexLock lock(&mu);
    for (const auto& [address, p] : pending) waiting.emplace_back(address, p.client);
    for (const auto& [name, m] : members) joined.emplace_back(name, m.client);
  }
  const absl::Duration deadline = options.probe_deadline;
  for (auto& [address, client] : waiting) {
    absl::Status s = client->CheckServing(deadline);
    absl::StatusOr<Client::ServerInfo> info;
    if (s.ok()) {
      info = client->GetServerInfo();
      s = info.status();
    }
    const std::string name = s.ok() && !info->replica.empty() ? info->replica : address;
    if (s.ok()) s = Prepare(*client);
    if (Admit(address, name, client, s)) ReportLoad(name, *client);
  }
  for (auto& [name, client] : joined) {
    bool was_healthy = false;
    {
      absl::MutexLock lock(&mu);
      auto m = members.find(name);
      if (m == members.end() || m->second.client != client) continue;
      was_healthy = m->second.healthy;
    }
    absl::Status s = client->CheckServing(deadline);
    if (s.ok() && !was_healthy) s = Prepare(*client);
    if (s.ok()) ReportLoad(name, *client);
    absl::MutexLock lock(&mu);
    auto m = members.find(name);
    if (m == members.end() || m->second.client != client) continue;
    m->second.healthy = s.ok();
    m->second.reason = s.ok() ? "" : std::string(s.message());
  }
}

void Fleet::Impl::BackgroundLoop() {
  absl::Time next_resolve = absl::Now() + options.resolve_interval;
  for (;;) {
    {
      absl::MutexLock lock(&stop_mu);
      if (stop_mu.AwaitWithTimeout(absl::Condition(&stop), options.probe_interval)) return;
    }
    absl::MutexLock refresh(&refresh_mu);
    if (absl::Now() >= next_resolve) {
      ResolveAndUpdate().IgnoreError();  // a failed resolution keeps the membership
      next_resolve = absl::Now() + options.resolve_interval;
    }
    ProbeAll();
  }
}

std::vector<Fleet::Impl::Pick> Fleet::Impl::Healthy() const {
  std::vector<Pick> out;
  absl::MutexLock lock(&mu);
  for (const auto& [name, m] : members) {
    if (m.healthy) out.emplace_back(name, m.client);
  }
  return out;
}

std::vector<Fleet::Impl::Pick> Fleet::Impl::Candidates(const BlockHash& key) const {
  std::vector<Pick> healthy = Healthy();
  std::vector<std::string> names;
  names.reserve(healthy.size());
  for (const Pick& p : healthy) names.push_back(p.first);
  std::vector<Pick> out;
  out.reserve(healthy.size());
  for (size_t i : RendezvousOrder(names, key)) out.push_back(healthy[i]);
  return out;
}

absl::Status Fleet::Impl::NoHealthyReplica() const {
  std::vector<std::string> why;
  absl::MutexLock lock(&mu);
  for (const auto& [name, m] : members) why.push_back(absl::StrCat(name, ": ", m.reason));
  for (const auto& [address, p] : pending) why.push_back(absl::StrCat(address, ": ", p.reason));
  return absl::UnavailableError(
      absl::StrCat("no healthy replica in fleet ", target, " (",
                   why.empty() ? "none resolved" : absl::StrJoin(why, "; "), ")"));
}

void Fleet::Impl::MarkDown(const std::string& name, const absl::Status& why) {
  absl::MutexLock lock(&mu);
  auto m = members.find(name);
  if (m == members.end()) return;
  m->second.healthy = false;
  m->second.reason = std::string(why.message());
}

std::optional<std::pair<std::shared_ptr<Client>, std::string>> Fleet::Impl::Find(
    const std::string& name) const {
  absl::MutexLock lock(&mu);
  auto m = members.find(name);
  if (m == members.end()) return std::nullopt;
  return std::make_pair(m->second.client, m->second.address);
}

Fleet::Fleet(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Fleet::~Fleet() {
  {
    absl::MutexLock lock(&impl_->stop_mu);
    impl_->stop = true;
  }
  if (impl_->background.joinable()) impl_->background.join();
}

absl::StatusOr<std::unique_ptr<Fleet>> Fleet::Connect(const std::string& target,
                                                      FleetOptions options) {
  if (!(options.probe_interval > absl::ZeroDuration()) ||
      !(options.resolve_interval > absl::ZeroDuration()) ||
      !(options.probe_deadline > absl::ZeroDuration())) {
    return absl::InvalidArgumentError(
        "FleetOptions: probe_interval, resolve_interval and probe_deadline must be > 0");
  }
  auto impl = std::make_unique<Impl>();
  impl->target = target;
  impl->options = std::move(options);
  if (!impl->options.resolver) {
    if (auto s = impl->ParseTarget(); !s.ok()) return s;
  }
  std::unique_ptr<Fleet> fleet(new Fleet(std::move(impl)));
  {
    absl::MutexLock refresh(&fleet->impl_->refresh_mu);
    if (auto s = fleet->impl_->ResolveAndUpdate(); !s.ok()) return s;
    fleet->impl_->ProbeAll();
  }
  Impl* raw = fleet->impl_.get();
  raw->background = std::thread([raw] { raw->BackgroundLoop(); });
  return fleet;
}

absl::Status Fleet::Refresh() {
  absl::MutexLock refresh(&impl_->refresh_mu);
  absl::Status s = impl_->ResolveAndUpdate();
  impl_->ProbeAll();
  return s;
}

std::vector<Fleet::Replica> Fleet::Replicas() const {
  std::vector<Replica> out;
  absl::MutexLock lock(&impl_->mu);
  for (const auto& [name, m] : impl_->members) {
    auto l = impl_->loads.find(name);
    out.push_back(Replica{name, m.address, m.healthy, m.reason,
                          l == impl_->loads.end() ? 0 : l->second.Now()});
  }
  return out;
}

std::shared_ptr<Client> Fleet::ReplicaClient(const std::string& name) const {
  auto found = impl_->Find(name);
  return found.has_value() ? found->first : nullptr;
}

}  // namespace kvbank
