// kvbank::Fleet placement: bounded load over the rendezvous order, and prefix copies to where a
// sequence lands when that is not its key's first choice (client/PLACEMENT.md).
#include <algorithm>
#include <numeric>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/fleet_internal.h"

namespace kvbank {
namespace {

// Finished copies kept for copy_recheck; past this many, the expired ones are dropped.
constexpr size_t kCopiesKept = 4096;
// A copy's sequence lives this long if the fleet dies before freeing it.
constexpr absl::Duration kCopyLease = absl::Seconds(60);

}  // namespace

absl::StatusOr<Fleet::Impl::Placement> Fleet::Impl::Place(const BlockHash& key, bool reserve) {
  Placement p;
  p.order = Candidates(key);
  if (p.order.empty()) return NoHealthyReplica();
  p.bounded = options.load_epsilon.has_value();
  std::vector<size_t> order(p.order.size());
  std::iota(order.begin(), order.end(), size_t{0});
  absl::MutexLock lock(&mu);  // the loads read and the reservation are one step
  for (const Pick& r : p.order) {
    auto it = loads.find(r.first);
    p.loads.push_back(it == loads.end() ? 0 : it->second.Now());
  }
  if (p.bounded) p.pick = PickBoundedLoad(order, p.loads, *options.load_epsilon);
  if (reserve) ++loads[p.order[p.pick.chosen].first].in_flight;
  return p;
}

void Fleet::Impl::Placed(const std::string& replica, bool created) {
  absl::MutexLock lock(&mu);
  Load& l = loads[replica];
  --l.in_flight;
  if (created) ++l.placed;
}

void Fleet::Impl::Freed(const std::string& replica) {
  absl::MutexLock lock(&mu);
  --loads[replica].placed;
}

void Fleet::Impl::ReportLoad(const std::string& name, Client& client) {
  int64_t base = 0;
  {
    absl::MutexLock lock(&mu);
    base = loads[name].placed;
  }
  auto stats = client.GetStats();
  if (!stats.ok()) return;  // the health check decides health; the load stays as it was
  uint64_t sequences = 0;
  for (const Client::ModelStats& m : *stats) sequences += m.sequences;
  absl::MutexLock lock(&mu);
  Load& l = loads[name];
  l.reported = sequences;
  l.base = base;
}

absl::StatusOr<Fleet::Impl::Prefix> Fleet::Impl::Lookup(const std::string& model,
                                                        const std::vector<uint32_t>& prompt,
                                                        const std::string& cache_salt,
                                                        const std::vector<ExtraKey>& extra_keys) {
  Prefix out;
  auto info = RootInfo(model);
  if (!info.ok()) return info.status();
  out.root = *info;
  const uint32_t bt = info->block_tokens;
  if (bt == 0 || prompt.size() < bt) return out;  // no full block to share
  const BlockHash root =
      RootHash(info->algorithm, {info->layout_fingerprint, info->tenant, cache_salt});
  out.hashes = PrefixHashes(info->algorithm, root, prompt, bt, extra_keys);
  FindHolder(&out);
  return out;
}

void Fleet::Impl::FindHolder(Prefix* prefix) {
  absl::MutexLock lock(&copy_mu);
  for (size_t i = prefix->hashes.size(); i > 0; --i) {
    auto it = placements.where.find(prefix->hashes[i - 1]);
    if (it == placements.where.end()) continue;
    prefix->holder = it->second.replica;
    prefix->holder_blocks = i;
    return;
  }
}

void Fleet::Impl::Remember(const Prefix& prefix, const std::string& replica) {
  absl::MutexLock lock(&copy_mu);
  Placements& p = placements;
  for (const BlockHash& h : prefix.hashes) {
    const uint64_t serial = ++p.next;
    p.where[h] = Placements::Entry{replica, serial};
    p.order.emplace_back(h, serial);
  }
  while (p.order.size() > options.placement_memory) {
    const auto [h, serial] = p.order.front();
    p.order.pop_front();
    auto it = p.where.find(h);
    if (it != p.where.end() && it->second.serial == serial) p.where.erase(it);
  }
}

const Fleet::Impl::Pick* Fleet::Impl::CopySource(const Placement& p, const Prefix& prefix) const {
  const std::string& chosen = p.order[p.pick.chosen].first;
  if (!prefix.holder.empty()) {
    for (const Pick& r : p.order) {
      if (r.first == prefix.holder) return r.first == chosen ? nullptr : &r;
    }
    // The holder is not healthy: as if unknown.
  }
  return p.pick.home ? nullptr : &p.order.front();
}

absl::Status Fleet::Impl::CopyPrefix(const std::string& model, const Client::CreateArgs& args,
                                     const Prefix& prefix, const Pick& from, const Pick& to) {
  const std::vector<BlockHash>& hashes = prefix.hashes;
  const uint32_t bt = prefix.root.block_tokens;
  if (hashes.empty()) return absl::OkStatus();
  if (from.first == prefix.holder && prefix.holder_blocks > 0) {
    // Copied there lately: no call at all.
    absl::MutexLock lock(&copy_mu);
    auto it = copies.find(CopyKey{to.first, hashes[prefix.holder_blocks - 1]});
    if (it != copies.end() && it->second.done &&
        absl::Now() - it->second.done_at < options.copy_recheck) {
      ++stats.copies_skipped;
      return absl::OkStatus();
    }
  }
  Client::MatchQuery q;
  q.hashes = hashes;
  auto held = from.second->Match(model, {q});
  if (!held.ok() || held->empty()) {
    absl::MutexLock lock(&copy_mu);
    ++stats.copy_failures;
    return held.ok() ? absl::InternalError("Match answered nothing") : held.status();
  }
  const size_t blocks = std::min<size_t>(held->front() / bt, hashes.size());
  if (blocks == 0) return absl::OkStatus();  // the source holds none of it either

  const CopyKey key{to.first, hashes[blocks - 1]};
  {
    absl::MutexLock lock(&copy_mu);
    auto it = copies.find(key);
    if (it != copies.end() && !it->second.done) {
      ++stats.copies_joined;
      while (true) {  // until the running copy ends (done, or erased when it failed)
        auto now = copies.find(key);
        if (now == copies.end() || now->second.done) break;
        copy_cv.Wait(&copy_mu);
      }
      return absl::OkStatus();
    }
    if (it != copies.end() && absl::Now() - it->second.done_at < options.copy_recheck) {
      ++stats.copies_skipped;
      return absl::OkStatus();
    }
    if (copies.size() >= kCopiesKept) {
      const absl::Time expired = absl::Now() - options.copy_recheck;
      for (auto c = copies.begin(); c != copies.end();) {
        c = c->second.done && c->second.done_at < expired ? copies.erase(c) : std::next(c);
      }
    }
    copies[key] = Copy{};  // this caller runs it
  }
  auto copied = RunCopy(model, args, hashes, bt, blocks, from, to);
  absl::MutexLock lock(&copy_mu);
  if (copied.ok()) {
    Copy& c = copies[key];
    c.done = true;
    c.done_at = absl::Now();
    if (copied->first > 0) {
      ++stats.prefix_copies;
      stats.copied_blocks += copied->first;
      stats.copied_bytes += copied->second;
    }
  } else {
    copies.erase(key);
    ++stats.copy_failures;
  }
  copy_cv.SignalAll();
  return copied.status();
}

absl::StatusOr<std::pair<uint64_t, uint64_t>> Fleet::Impl::RunCopy(
    const std::string& model, const Client::CreateArgs& args, const std::vector<BlockHash>& hashes,
    uint32_t bt, size_t blocks, const Pick& from, const Pick& to) {
  // Already there (another copy, or the target's own sequences): no copy sequence at all.
  Client::MatchQuery q;
  q.hashes.assign(hashes.begin(), hashes.begin() + blocks);
  auto there = to.second->Match(model, {q});
  if (!there.ok()) return there.status();
  if (!there->empty() && there->front() >= uint64_t(blocks) * bt) return std::make_pair(0, 0);
  auto layout = to.second->GetModel(model);
  if (!layout.ok()) return layout.status();
  Client::CreateArgs c;
  c.prompt.assign(args.prompt.begin(), args.prompt.begin() + blocks * bt);
  c.cache_salt = args.cache_salt;
  c.extra_keys = args.extra_keys;
  c.priority = args.priority;
  c.lease = kCopyLease;
  c.prefix_copy = true;  // counted as a copy on `to` (GetStats, /metrics)
  // The create attaches whatever `to` holds already; the copy fills in the rest.
  auto seq = to.second->CreateSequence(model, c);
  if (!seq.ok()) return seq.status();
  const size_t first = std::min<size_t>(seq->cached_tokens / bt, blocks);
  const uint64_t tokens = uint64_t(blocks - first) * bt;
  const std::vector<BlockHash> want(hashes.begin() + first, hashes.begin() + blocks);
  uint64_t bytes = 0;
  absl::Status status;
  const std::vector<DType>& dtypes = layout->layout.layer_dtypes;
  // Layer runs of one storage dtype travel in it (quantized ones in their storage format, with
  // their scales): the bytes land as they were stored.
  for (uint32_t l0 = 0; tokens > 0 && l0 < dtypes.size() && status.ok();) {
    uint32_t l1 = l0 + 1;
    while (l1 < dtypes.size() && dtypes[l1] == dtypes[l0]) ++l1;
    Client::FetchArgs fa;
    fa.layer_begin = l0;
    fa.layer_end = l1;
    fa.dtype = dtypes[l0];
    auto payload = from.second->FetchBlocks(model, want, fa);
    if (!payload.ok()) {
      status = absl::Status(payload.status().code(),
                            absl::StrCat("fetching ", want.size(), " blocks of model ", model,
                                         " from ", from.first, ": ", payload.status().message()));
      break;
    }
    if (payload->num_tokens != tokens) {
      status = absl::FailedPreconditionError(absl::StrCat(
          from.first, " answered ", payload->num_tokens, " tokens for ", tokens, " asked"));
      break;
    }
    Client::AppendArgs aa;
    aa.layer_begin = l0;
    aa.layer_end = l1;
    aa.num_tokens = tokens;
    aa.dtype = payload->dtype;
    aa.token_ids.assign(c.prompt.begin() + first * bt, c.prompt.end());
    auto appended = to.second->Append(model, seq->id, aa, payload->payload);
    if (!appended.ok()) {
      status = absl::Status(
          appended.status().code(),
          absl::StrCat("appending the copy to ", to.first, ": ", appended.status().message()));
      break;
    }
    bytes += payload->payload.size();
    l0 = l1;
  }
  // Freed, the sequence's published blocks stay cached for the create that follows.
  to.second->Free(model, seq->id).IgnoreError();
  if (!status.ok()) return status;
  return std::make_pair(uint64_t(blocks - first), bytes);
}

absl::StatusOr<Fleet::Sequence> Fleet::CreateSequence(const std::string& model,
                                                      const Client::CreateArgs& args) {
  Impl::Prefix prefix;
  if (impl_->options.copy_prefixes) {
    auto p = impl_->Lookup(model, args.prompt, args.cache_salt, args.extra_keys);
    if (!p.ok()) return p.status();
    prefix = *std::move(p);
  }
  BlockHash key;
  if (!prefix.hashes.empty()) {
    key = prefix.hashes.front();  // what PlacementKey computes for a prompt of a block or more
  } else {
    auto k = PlacementKey(model, args.prompt, args.cache_salt, args.extra_keys);
    if (!k.ok()) return k.status();
    key = *k;
  }
  absl::Status last;
  for (;;) {
    auto p = impl_->Place(key, /*reserve=*/true);
    if (!p.ok()) {
      if (last.ok()) return p.status();
      return absl::UnavailableError(
          absl::StrCat("every healthy replica answered UNAVAILABLE; the last: ", last.message()));
    }
    const Impl::Pick& chosen = p->order[p->pick.chosen];
    if (const Impl::Pick* from = impl_->CopySource(*p, prefix); from != nullptr) {
      // Errors are counted; the create goes on with what `chosen` holds.
      impl_->CopyPrefix(model, args, prefix, *from, chosen).IgnoreError();
    }
    auto info = chosen.second->CreateSequence(model, args);
    impl_->Placed(chosen.first, info.ok());
    if (!info.ok()) {
      if (!absl::IsUnavailable(info.status())) return info.status();
      impl_->MarkDown(chosen.first, info.status());
      last = absl::UnavailableError(
          absl::StrCat("replica ", chosen.first, ": ", info.status().message()));
      continue;
    }
    impl_->Remember(prefix, chosen.first);
    {
      absl::MutexLock lock(&impl_->copy_mu);
      ++impl_->stats.placements;
      if (p->pick.home) {
        ++impl_->stats.home_placements;
      } else {
        ++impl_->stats.bounded_placements;
      }
    }
    return Sequence{chosen.first, model, info->id, *info};
  }
}

absl::StatusOr<Fleet::RouteDecision> Fleet::Route(const std::string& model,
                                                  const Client::MatchQuery& prompt) {
  RouteDecision d;
  if (!prompt.hashes.empty()) {
    d.key = prompt.hashes.front();
  } else {
    auto key = PlacementKey(model, prompt.tokens, prompt.cache_salt, prompt.extra_keys);
    if (!key.ok()) return key.status();
    d.key = *key;
  }
  auto p = impl_->Place(d.key, /*reserve=*/false);
  if (!p.ok()) return p.status();
  const Impl::Pick& chosen = p->order[p->pick.chosen];
  d.replica = chosen.first;
  d.home = p->order.front().first;
  d.reason = !p->bounded ? "by_key" : p->pick.home ? "home" : "over_load_bound";
  d.load = p->loads[p->pick.chosen];
  d.home_load = p->loads.front();
  d.load_bound = p->pick.cap;
  const uint64_t total = std::accumulate(p->loads.begin(), p->loads.end(), uint64_t{0});
  d.mean_load = static_cast<double>(total + 1) / static_cast<double>(p->loads.size());
  if (!prompt.hashes.empty()) {
    auto info = impl_->RootInfo(model);
    if (!info.ok()) return info.status();
    d.prompt_tokens = prompt.hashes.size() * uint64_t(info->block_tokens);
  } else {
    d.prompt_tokens = prompt.tokens.size();
  }
  auto cached = chosen.second->Match(model, {prompt});
  if (!cached.ok()) {
    return absl::Status(cached.status().code(),
                        absl::StrCat("replica ", chosen.first, ": ", cached.status().message()));
  }
  d.cached_tokens = cached->empty() ? 0 : cached->front();
  if (impl_->options.copy_prefixes) {
    Impl::Prefix prefix;
    if (prompt.hashes.empty()) {
      auto looked = impl_->Lookup(model, prompt.tokens, prompt.cache_salt, prompt.extra_keys);
      if (!looked.ok()) return looked.status();
      prefix = *std::move(looked);
    } else {
      prefix.hashes = prompt.hashes;
      impl_->FindHolder(&prefix);
    }
    if (const Impl::Pick* from = impl_->CopySource(*p, prefix); from != nullptr) {
      auto there = from->second->Match(model, {prompt});
      if (!there.ok()) {
        return absl::Status(there.status().code(),
                            absl::StrCat("replica ", from->first, ": ", there.status().message()));
      }
      d.copy_from = from->first;
      d.copy_from_cached_tokens = there->empty() ? 0 : there->front();
      if (d.copy_from_cached_tokens > d.cached_tokens) {
        d.copy_tokens = d.copy_from_cached_tokens - d.cached_tokens;
      }
    }
  }
  const uint64_t after = d.cached_tokens + d.copy_tokens;
  d.cost = d.prompt_tokens > after ? d.prompt_tokens - after : 0;
  return d;
}

Fleet::Stats Fleet::GetStats() const {
  absl::MutexLock lock(&impl_->copy_mu);
  return impl_->stats;
}

}  // namespace kvbank
