// SequenceStore: layer-wise handoff. A decode worker waits for the layers (and kv heads) a
// prefill worker is still pushing, and pulls each as soon as it is committed: WhenCommitted
// registers a waiter under the lock; the commit (or the free) that completes it takes it out
// under the lock and runs it outside.
#include <algorithm>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/core/sequence.h"
#include "server/core/sequence_store.h"

namespace kvbank {

uint64_t SequenceStore::Available(const Sequence& s, uint32_t l0, uint32_t l1, uint32_t h0,
                                  uint32_t h1) const {
  uint64_t avail = std::numeric_limits<uint64_t>::max();
  for (uint32_t l = l0; l < l1; ++l) {
    if (s.head_len.empty()) {
      avail = std::min(avail, s.layer_len[l]);
      continue;
    }
    for (uint32_t h = h0; h < h1; ++h) {
      avail = std::min(avail, s.HeadLength(l, h, layout_.num_kv_heads));
    }
  }
  return avail;
}

absl::StatusOr<uint64_t> SequenceStore::WhenCommitted(const FetchSpec& spec,
                                                      std::function<void(absl::Status)> ready) {
  const uint32_t l0 = spec.layer_begin;
  const uint32_t l1 = spec.layer_end.value_or(layout_.num_layers);
  if (absl::Status s = CheckLayerRange(l0, l1); !s.ok()) return s;
  if (!spec.token_end.has_value()) {
    return absl::InvalidArgumentError(
        "waiting for a fetch's tokens needs token_end: the tokens to wait for");
  }
  if (*spec.token_end > options_.max_tokens_per_sequence) {
    return absl::InvalidArgumentError(absl::StrCat("token_end ", *spec.token_end,
                                                   " exceeds max_tokens_per_sequence ",
                                                   options_.max_tokens_per_sequence));
  }
  auto heads = ResolveHeads(spec.kv_head_begin, spec.kv_head_end);
  if (!heads.ok()) return heads.status();
  Waiter w;
  w.layer_begin = l0;
  w.layer_end = l1;
  w.head_begin = heads->begin;
  w.head_end = heads->count == 0 ? layout_.num_kv_heads : heads->begin + heads->count;
  w.tokens = *spec.token_end;
  CoreLock lock(&mu_);
  auto found = Find(spec.sequence_id, spec.tenant);
  if (!found.ok()) return found.status();
  if (Available(**found, w.layer_begin, w.layer_end, w.head_begin, w.head_end) >= w.tokens) {
    return 0;
  }
  if (waiter_sequence_.size() >= options_.max_waiters) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "model '", layout_.name, "' has ", options_.max_waiters, " fetches waiting already"));
  }
  w.id = ++last_waiter_;
  w.ready = std::move(ready);
  waiter_sequence_[w.id] = spec.sequence_id;
  const uint64_t id = w.id;
  waiters_[spec.sequence_id].push_back(std::move(w));
  return id;
}

bool SequenceStore::CancelWait(uint64_t waiter) {
  CoreLock lock(&mu_);
  auto it = waiter_sequence_.find(waiter);
  if (it == waiter_sequence_.end()) return false;
  std::vector<Waiter>& list = waiters_[it->second];
  list.erase(
      std::find_if(list.begin(), list.end(), [waiter](const Waiter& w) { return w.id == waiter; }));
  if (list.empty()) waiters_.erase(it->second);
  waiter_sequence_.erase(it);
  return true;
}

void SequenceStore::TakeReadyWaiters(uint64_t id, Fired* fired) {
  auto it = waiters_.find(id);
  if (it == waiters_.end()) return;
  auto live = live_.find(id);
  absl::Status gone;
  if (live == live_.end()) {
    auto t = tombstones_.find(id);
    gone = absl::FailedPreconditionError(absl::StrCat(
        "sequence_id ", id, " is gone: ", t != tombstones_.end() ? t->second.reason : "freed"));
  }
  std::vector<Waiter>& list = it->second;
  for (size_t i = 0; i < list.size();) {
    Waiter& w = list[i];
    const bool ready = !gone.ok() || Available(*live->second, w.layer_begin, w.layer_end,
                                               w.head_begin, w.head_end) >= w.tokens;
    if (!ready) {
      ++i;
      continue;
    }
    fired->emplace_back(std::move(w.ready), gone);
    waiter_sequence_.erase(w.id);
    list.erase(list.begin() + i);
  }
  if (list.empty()) waiters_.erase(it);
}

void SequenceStore::Fire(Fired fired) {
  for (auto& [ready, status] : fired) ready(std::move(status));
}

}  // namespace kvbank
