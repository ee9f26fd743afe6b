// kvbank::Fleet: placement keys, routed calls, calls on a sequence's own replica.
#include "kvbank/fleet.h"

#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/fleet_internal.h"

namespace kvbank {
absl::StatusOr<Client::PrefixRootInfo> Fleet::Impl::RootInfo(const std::string& model) {
  {
    absl::MutexLock lock(&mu);
    if (auto it = roots.find(model); it != roots.end()) return it->second;
  }
  std::optional<std::pair<std::string, Client::PrefixRootInfo>> first;
  for (const auto& [name, client] : Healthy()) {
    auto r = client->GetPrefixRoot(model);
    if (absl::IsUnavailable(r.status())) {
      MarkDown(name, r.status());
      continue;
    }
    if (!r.ok()) {
      return absl::Status(r.status().code(),
                          absl::StrCat("replica ", name, ": ", r.status().message()));
    }
    if (!first.has_value()) {
      // The root must be what this SDK computes from the replica's fingerprint and tenant:
      // placement keys are computed here, and must chain the server's own root.
      const BlockHash mine = RootHash(r->algorithm, {r->layout_fingerprint, r->tenant, ""});
      if (mine != r->root) {
        return absl::FailedPreconditionError(
            absl::StrCat("replica ", name, "'s prefix root of model ", model,
                         " is not the one this SDK computes from its fingerprint and tenant (",
                         HashToHex(r->root), " vs ", HashToHex(mine), ")"));
      }
      first.emplace(name, *r);
    } else if (std::string why = RootMismatch(first->second, *r); !why.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "replicas ", first->first, " and ", name, " disagree on model ", model,
          "'s prefix root (", why, "): the same prompt would never share blocks across them"));
    }
  }
  if (!first.has_value()) return NoHealthyReplica();
  absl::MutexLock lock(&mu);
  roots[model] = first->second;
  return first->second;
}

absl::StatusOr<Client::PrefixRootInfo> Fleet::PrefixRoot(const std::string& model,
                                                         const std::string& cache_salt) {
  auto info = impl_->RootInfo(model);
  if (!info.ok()) return info.status();
  info->root = RootHash(info->algorithm, {info->layout_fingerprint, info->tenant, cache_salt});
  return info;
}

absl::StatusOr<BlockHash> Fleet::PlacementKey(const std::string& model,
                                              const std::vector<uint32_t>& prompt,
                                              const std::string& cache_salt,
                                              const std::vector<ExtraKey>& extra_keys) {
  auto root = PrefixRoot(model, cache_salt);
  if (!root.ok()) return root.status();
  if (prompt.empty()) {
    // Nothing to share yet: spread empty sequences evenly.
    const uint64_t n = impl_->empty_prompts.fetch_add(1, std::memory_order_relaxed);
    const uint32_t counter[2] = {uint32_t(n), uint32_t(n >> 32)};
    return ChainHash(root->algorithm, root->root, counter, 2, {{ExtraKeyKind::kCustom, "empty"}});
  }
  // The first full block's hash; a shorter prompt hashes its partial block the same way.
  const size_t n = std::min<size_t>(prompt.size(), root->block_tokens);
  return ChainHash(root->algorithm, root->root, prompt.data(), n, extra_keys);
}

absl::StatusOr<std::string> Fleet::ReplicaFor(const BlockHash& key) const {
  auto candidates = impl_->Candidates(key);
  if (candidates.empty()) return impl_->NoHealthyReplica();
  return candidates.front().first;
}

absl::StatusOr<Client::ModelInfo> Fleet::EnsureModel(const ModelLayout& layout,
                                                     uint64_t pool_bytes) {
  Impl::EnsureCall call;
  call.layout = layout;
  call.name = layout.name;
  call.pool_bytes = pool_bytes;
  std::optional<Client::ModelInfo> first;
  absl::Status last = absl::OkStatus();
  for (const auto& [name, client] : impl_->Healthy()) {
    auto r = client->EnsureModel(layout, pool_bytes);
    if (absl::IsUnavailable(r.status())) {
      impl_->MarkDown(name, r.status());
      last = r.status();
      continue;
    }
    if (!r.ok()) {
      return absl::Status(r.status().code(),
                          absl::StrCat("replica ", name, ": ", r.status().message()));
    }
    if (!first.has_value()) first = *r;
  }
  if (!first.has_value()) return last.ok() ? impl_->NoHealthyReplica() : last;
  absl::MutexLock lock(&impl_->mu);
  impl_->ForgetEnsured(call.name);
  impl_->ensured.push_back(std::move(call));
  impl_->roots.erase(layout.name);
  return *first;
}

absl::StatusOr<Client::ModelInfo> Fleet::EnsurePreset(const std::string& name,
                                                      const std::string& preset,
                                                      std::optional<DType> storage,
                                                      uint64_t pool_bytes, uint32_t block_tokens) {
  Impl::EnsureCall call{std::nullopt, name, preset, storage, pool_bytes, block_tokens};
  std::optional<Client::ModelInfo> first;
  absl::Status last = absl::OkStatus();
  for (const auto& [replica, client] : impl_->Healthy()) {
    auto r = client->EnsurePreset(name, preset, storage, pool_bytes, block_tokens);
    if (absl::IsUnavailable(r.status())) {
      impl_->MarkDown(replica, r.status());
      last = r.status();
      continue;
    }
    if (!r.ok()) {
      return absl::Status(r.status().code(),
                          absl::StrCat("replica ", replica, ": ", r.status().message()));
    }
    if (!first.has_value()) first = *r;
  }
  if (!first.has_value()) return last.ok() ? impl_->NoHealthyReplica() : last;
  absl::MutexLock lock(&impl_->mu);
  impl_->ForgetEnsured(name);
  impl_->ensured.push_back(std::move(call));
  impl_->roots.erase(name);
  return *first;
}

absl::StatusOr<Client::SequenceInfo> Fleet::Append(const Sequence& seq,
                                                   const Client::AppendArgs& args,
                                                   absl::Span<const uint8_t> payload) {
  return impl_->OnSequence(seq,
                           [&](Client& c) { return c.Append(seq.model, seq.id, args, payload); });
}

absl::StatusOr<Client::SequenceInfo> Fleet::AppendTensors(const Sequence& seq,
                                                          const Client::AppendArgs& args,
                                                          absl::Span<const uint8_t> k,
                                                          absl::Span<const uint8_t> v) {
  return impl_->OnSequence(
      seq, [&](Client& c) { return c.AppendTensors(seq.model, seq.id, args, k, v); });
}

absl::StatusOr<Client::FetchResult> Fleet::Fetch(const Sequence& seq,
                                                 const Client::FetchArgs& args) {
  return impl_->OnSequence(seq, [&](Client& c) { return c.Fetch(seq.model, seq.id, args); });
}

absl::StatusOr<Client::FetchResult> Fleet::FetchInto(const Sequence& seq,
                                                     const Client::FetchArgs& args,
                                                     absl::Span<uint8_t> out) {
  return impl_->OnSequence(seq,
                           [&](Client& c) { return c.FetchInto(seq.model, seq.id, args, out); });
}

absl::Status Fleet::FetchTensors(const Sequence& seq, const Client::FetchArgs& args,
                                 absl::Span<uint8_t> k, absl::Span<uint8_t> v) {
  return impl_->OnSequence(
      seq, [&](Client& c) { return c.FetchTensors(seq.model, seq.id, args, k, v); });
}

absl::StatusOr<Fleet::Sequence> Fleet::Fork(const Sequence& seq,
                                            std::optional<absl::Duration> lease) {
  return impl_->OnSequence(seq, [&](Client& c) -> absl::StatusOr<Sequence> {
    auto info = c.Fork(seq.model, seq.id, lease);
    if (!info.ok()) return info.status();
    return Sequence{seq.replica, seq.model, info->id, *info};
  });
}

absl::StatusOr<Client::SequenceInfo> Fleet::Truncate(const Sequence& seq, uint64_t num_tokens) {
  return impl_->OnSequence(seq,
                           [&](Client& c) { return c.Truncate(seq.model, seq.id, num_tokens); });
}

absl::StatusOr<uint64_t> Fleet::Free(const Sequence& seq) {
  auto r = impl_->OnSequence(seq, [&](Client& c) { return c.Free(seq.model, seq.id); });
  if (r.ok()) impl_->Freed(seq.replica);
  return r;
}

absl::StatusOr<Client::SequenceInfo> Fleet::RenewLease(const Sequence& seq) {
  return impl_->OnSequence(seq, [&](Client& c) { return c.RenewLease(seq.model, seq.id); });
}

absl::StatusOr<Client::SequenceInfo> Fleet::GetSequence(const Sequence& seq) {
  return impl_->OnSequence(seq, [&](Client& c) { return c.GetSequence(seq.model, seq.id); });
}

absl::StatusOr<std::vector<Client::AttendOutput>> Fleet::Attend(
    const std::string& model, const std::vector<AttendQuery>& queries,
    const Client::AttendArgs& args) {
  // Per replica: the queries' indices, in order.
  std::map<std::string, std::vector<size_t>> groups;
  for (size_t i = 0; i < queries.size(); ++i) {
    if (queries[i].sequence.model != model) {
      return absl::InvalidArgumentError(absl::StrCat("queries[", i, "]: sequence ",
                                                     queries[i].sequence.id, " is of model ",
                                                     queries[i].sequence.model, ", not ", model));
    }
    groups[queries[i].sequence.replica].push_back(i);
  }
  std::vector<Client::AttendOutput> out(queries.size());
  for (const auto& [replica, indices] : groups) {
    std::vector<Client::AttendQuery> batch;
    batch.reserve(indices.size());
    for (size_t i : indices) {
      batch.push_back({queries[i].sequence.id, queries[i].layer, queries[i].query});
    }
    auto r = impl_->OnSequence(queries[indices.front()].sequence,
                               [&](Client& c) { return c.Attend(model, batch, args); });
    if (!r.ok()) return r.status();
    if (r->size() != indices.size()) {
      return absl::InternalError(absl::StrCat("replica ", replica, " answered ", r->size(),
                                              " outputs for ", indices.size(), " queries"));
    }
    for (size_t j = 0; j < indices.size(); ++j) out[indices[j]] = std::move((*r)[j]);
  }
  return out;
}

absl::StatusOr<std::vector<uint64_t>> Fleet::Match(const std::string& model,
                                                   const std::vector<Client::MatchQuery>& queries) {
  std::vector<BlockHash> keys(queries.size());
  for (size_t i = 0; i < queries.size(); ++i) {
    if (!queries[i].hashes.empty()) {
      keys[i] = queries[i].hashes.front();
      continue;
    }
    auto key = PlacementKey(model, queries[i].tokens, queries[i].cache_salt, queries[i].extra_keys);
    if (!key.ok()) return key.status();
    keys[i] = *key;
  }
  std::vector<uint64_t> out(queries.size(), 0);
  std::vector<size_t> left(queries.size());
  for (size_t i = 0; i < left.size(); ++i) left[i] = i;
  // Each round asks every query's best healthy replica; the queries of a replica that answers
  // UNAVAILABLE (now marked down) go to their next choice in the next round.
  while (!left.empty()) {
    std::map<std::string, std::pair<std::shared_ptr<Client>, std::vector<size_t>>> groups;
    for (size_t i : left) {
      auto candidates = impl_->Candidates(keys[i]);
      if (candidates.empty()) return impl_->NoHealthyReplica();
      auto& g = groups[candidates.front().first];
      g.first = candidates.front().second;
      g.second.push_back(i);
    }
    left.clear();
    for (auto& [name, group] : groups) {
      std::vector<Client::MatchQuery> batch;
      for (size_t i : group.second) batch.push_back(queries[i]);
      auto r = group.first->Match(model, batch);
      if (absl::IsUnavailable(r.status())) {
        impl_->MarkDown(name, r.status());
        left.insert(left.end(), group.second.begin(), group.second.end());
        continue;
      }
      if (!r.ok()) {
        return absl::Status(r.status().code(),
                            absl::StrCat("replica ", name, ": ", r.status().message()));
      }
      for (size_t j = 0; j < group.second.size() && j < r->size(); ++j) {
        out[group.second[j]] = (*r)[j];
      }
    }
  }
  return out;
}

absl::StatusOr<Client::PrefixRootInfo> Fleet::GetPrefixRoot(const std::string& model,
                                                            const std::string& cache_salt) {
  auto root = PrefixRoot(model, cache_salt);
  if (!root.ok()) return root.status();
  return impl_->OnPlacement(root->root, [&](Client& c, const std::string&) {
    return c.GetPrefixRoot(model, cache_salt);
  });
}

absl::StatusOr<Client::FetchResult> Fleet::FetchBlocks(const std::string& model,
                                                       const std::vector<BlockHash>& hashes,
                                                       const Client::FetchArgs& args) {
  if (hashes.empty()) return absl::InvalidArgumentError("hashes is empty");
  return impl_->OnPlacement(hashes.front(), [&](Client& c, const std::string&) {
    return c.FetchBlocks(model, hashes, args);
  });
}

absl::StatusOr<uint64_t> Fleet::Pin(const std::string& model, const Client::MatchQuery& blocks,
                                    bool pin) {
  BlockHash key;
  if (!blocks.hashes.empty()) {
    key = blocks.hashes.front();
  } else {
    auto k = PlacementKey(model, blocks.tokens, blocks.cache_salt, blocks.extra_keys);
    if (!k.ok()) return k.status();
    key = *k;
  }
  return impl_->OnPlacement(
      key, [&](Client& c, const std::string&) { return c.Pin(model, blocks, pin); });
}

}  // namespace kvbank
