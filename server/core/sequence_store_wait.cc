// SequenceStore: layer-wise handoff. A decode worker waits for the layers (and kv heads) a
// prefill worker is still pushing, and pulls each as soon as it is committed: WhenCommitted
// adds a waiter (CommitWaiters) under the store's lock; the commit (or the free) that completes
// it takes it out under the lock and runs it outside.
#include <algorithm>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/core/sequence.h"
#include "server/core/sequence_store.h"

namespace kvbank {

uint64_t SequenceStore::Available(const Sequence& s, const WaitRange& r) const {
  uint64_t avail = std::numeric_limits<uint64_t>::max();
  for (uint32_t l = r.layer_begin; l < r.layer_end; ++l) {
    if (s.head_len.empty()) {
      avail = std::min(avail, s.layer_len[l]);
      continue;
    }
    for (uint32_t h = r.head_begin; h < r.head_end; ++h) {
      avail = std::min(avail, s.HeadLength(l, h, layout_.num_kv_heads));
    }
  }
  return avail;
}

absl::StatusOr<uint64_t> SequenceStore::WhenCommitted(const FetchSpec& spec,
                                                      std::function<void(absl::Status)> ready) {
  auto plan = planner_.Ranges(
      {spec.layer_begin, spec.layer_end, spec.kv_head_begin, spec.kv_head_end, std::nullopt});
  if (!plan.ok()) return plan.status();
  if (!spec.token_end.has_value()) {
    return absl::InvalidArgumentError(
        "waiting for a fetch's tokens needs token_end: the tokens to wait for");
  }
  if (*spec.token_end > options_.max_tokens_per_sequence) {
    return absl::InvalidArgumentError(absl::StrCat("token_end ", *spec.token_end,
                                                   " exceeds max_tokens_per_sequence ",
                                                   options_.max_tokens_per_sequence));
  }
  const WaitRange range{plan->layer_begin, plan->layer_end, plan->head_begin, plan->head_end,
                        *spec.token_end};
  CoreLock lock(&mu_);
  auto found = Find(spec.sequence_id, spec.tenant);
  if (!found.ok()) return found.status();
  (*found)->handed_off = true;
  if (Available(**found, range) >= range.tokens) return 0;
  return waiters_->Add(spec.sequence_id, range, std::move(ready));
}

void SequenceStore::TakeReadyWaiters(uint64_t id, CommitWaiters::Fired* fired) {
  auto live = live_.find(id);
  if (live != live_.end()) {
    const Sequence& s = *live->second;
    waiters_->TakeReady(
        id, [&](const WaitRange& r) { return Available(s, r); }, fired);
    return;
  }
  auto t = tombstones_.find(id);
  waiters_->TakeAll(
      id,
      absl::FailedPreconditionError(absl::StrCat(
          "sequence_id ", id, " is gone: ", t != tombstones_.end() ? t->second.reason : "freed")),
      fired);
}

}  // namespace kvbank
