#include "server/core/commit_waiters.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace kvbank {

CommitWaiters::CommitWaiters(std::string model, size_t max_waiters)
    : model_(std::move(model)), max_waiters_(max_waiters) {}

absl::StatusOr<uint64_t> CommitWaiters::Add(uint64_t sequence, const WaitRange& range,
                                            Ready ready) {
  absl::MutexLock lock(&mu_);
  if (sequence_of_.size() >= max_waiters_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("model '", model_, "' has ", max_waiters_, " fetches waiting already"));
  }
  const uint64_t id = ++last_;
  sequence_of_[id] = sequence;
  by_sequence_[sequence].push_back(Waiter{id, range, std::move(ready)});
  return id;
}

bool CommitWaiters::Cancel(uint64_t waiter) {
  absl::MutexLock lock(&mu_);
  auto it = sequence_of_.find(waiter);
  if (it == sequence_of_.end()) return false;
  std::vector<Waiter>& list = by_sequence_[it->second];
  list.erase(
      std::find_if(list.begin(), list.end(), [waiter](const Waiter& w) { return w.id == waiter; }));
  if (list.empty()) by_sequence_.erase(it->second);
  sequence_of_.erase(it);
  return true;
}

void CommitWaiters::Take(uint64_t sequence, absl::FunctionRef<bool(const WaitRange&)> done,
                         const absl::Status& status, Fired* fired) {
  absl::MutexLock lock(&mu_);
  auto it = by_sequence_.find(sequence);
  if (it == by_sequence_.end()) return;
  std::vector<Waiter>& list = it->second;
  for (size_t i = 0; i < list.size();) {
    if (!done(list[i].range)) {
      ++i;
      continue;
    }
    fired->emplace_back(std::move(list[i].ready), status);
    sequence_of_.erase(list[i].id);
    list.erase(list.begin() + i);
  }
  if (list.empty()) by_sequence_.erase(it);
}

void CommitWaiters::TakeReady(uint64_t sequence,
                              absl::FunctionRef<uint64_t(const WaitRange&)> available,
                              Fired* fired) {
  Take(
      sequence, [&](const WaitRange& r) { return available(r) >= r.tokens; }, absl::OkStatus(),
      fired);
}

void CommitWaiters::TakeAll(uint64_t sequence, const absl::Status& why, Fired* fired) {
  Take(
      sequence, [](const WaitRange&) { return true; }, why, fired);
}

std::vector<uint64_t> CommitWaiters::Sequences() const {
  absl::MutexLock lock(&mu_);
  std::vector<uint64_t> out;
  out.reserve(by_sequence_.size());
  for (const auto& [id, list] : by_sequence_) out.push_back(id);
  return out;
}

size_t CommitWaiters::size() const {
  absl::MutexLock lock(&mu_);
  return sequence_of_.size();
}

void CommitWaiters::Fire(Fired fired) {
  for (auto& [ready, status] : fired) ready(std::move(status));
}

}  // namespace kvbank
