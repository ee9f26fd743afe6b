#include "server/rpc/fair_work.h"

#include <algorithm>
#include <utility>

namespace kvbank::rpc {

FairWork::FairWork(FairWorkOptions options, std::shared_ptr<TenantLedger> ledger)
    : options_(options),
      max_background_running_(options.max_background_running > 0
                                  ? options.max_background_running
                                  : std::max<size_t>(1, options.threads / 2)),
      ledger_(std::move(ledger)) {
  const size_t n = std::max<size_t>(1, options_.threads);
  for (size_t i = 0; i < n; ++i) threads_.emplace_back([this] { Run(); });
}

FairWork::~FairWork() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  for (std::thread& t : threads_) t.join();
}

absl::Status FairWork::Submit(const std::string& tenant, WorkClass cls, std::function<void()> task,
                              uint64_t cost) {
  auto claim = ledger_->Acquire(
      tenant, cls == WorkClass::kForeground ? Resource::kQueuedWork : Resource::kQueuedBackground);
  if (!claim.ok()) return claim.status();
  Push(tenant, cls, Task{std::move(task), std::max<uint64_t>(1, cost), *std::move(claim)});
  return absl::OkStatus();
}

void FairWork::Continue(const std::string& tenant, std::function<void()> task) {
  Push(tenant, WorkClass::kForeground, Task{std::move(task), 1, LedgerClaim()});
}

void FairWork::Push(const std::string& tenant, WorkClass cls, Task task) {
  absl::MutexLock lock(&mu_);
  Class& c = classes_[size_t(cls)];
  Queue& q = c.by_tenant[tenant];
  q.tasks.push_back(std::move(task));
  ++c.queued;
  if (!q.active) {
    q.active = true;
    c.ring.push_back(tenant);
  }
}

bool FairWork::TakeFromLocked(Class& c, uint64_t quantum, Task* out) {
  // Deficit round robin: the tenant at the front runs its next task when its deficit covers the
  // task's cost; else it gets a quantum and goes to the back. Each task's cost is at least 1 and
  // each visit adds at least 1, so a pass over the ring always ends in a pick.
  while (!c.ring.empty()) {
    const std::string tenant = c.ring.front();
    Queue& q = c.by_tenant[tenant];
    if (q.tasks.empty()) {  // cannot happen (a tenant leaves the ring with its last task)
      q.active = false;
      q.deficit = 0;
      c.ring.pop_front();
      continue;
    }
    if (q.deficit < q.tasks.front().cost) {
      q.deficit += std::max<uint64_t>(1, quantum);
      c.ring.pop_front();
      c.ring.push_back(tenant);
      continue;
    }
    q.deficit -= q.tasks.front().cost;
    *out = std::move(q.tasks.front());
    q.tasks.pop_front();
    --c.queued;
    if (q.tasks.empty()) {
      q.active = false;
      q.deficit = 0;
      c.ring.pop_front();
      c.by_tenant.erase(tenant);
    }
    return true;
  }
  return false;
}

bool FairWork::PickLocked(Task* out, WorkClass* cls) {
  Class& fg = classes_[0];
  Class& bg = classes_[1];
  const bool bg_may_run = bg.queued > 0 && bg.running < max_background_running_;
  ++picks_;
  // Foreground first, but a background task now and then under a steady foreground load.
  const bool bg_turn = bg_may_run && (fg.queued == 0 || picks_ % kBackgroundEvery == 0);
  if (!bg_turn && TakeFromLocked(fg, options_.foreground_quantum, out)) {
    *cls = WorkClass::kForeground;
    return true;
  }
  if (bg_may_run && TakeFromLocked(bg, options_.background_quantum, out)) {
    *cls = WorkClass::kBackground;
    return true;
  }
  if (TakeFromLocked(fg, options_.foreground_quantum, out)) {
    *cls = WorkClass::kForeground;
    return true;
  }
  return false;
}

void FairWork::Run() {
  for (;;) {
    Task task;
    WorkClass cls = WorkClass::kForeground;
    {
      absl::MutexLock lock(&mu_);
      // Stopping, the queues run dry first (a background task waits for a running one).
      const auto can_pick = [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
        const Class& fg = classes_[0];
        const Class& bg = classes_[1];
        return fg.queued > 0 || (bg.queued > 0 && bg.running < max_background_running_) ||
               (stop_ && bg.queued == 0);
      };
      mu_.Await(absl::Condition(&can_pick));
      if (!PickLocked(&task, &cls)) return;  // stopping, nothing left
      ++classes_[size_t(cls)].running;
    }
    task.claim.Release();  // out of the backlog: it runs now
    task.run();
    task.run = nullptr;  // what the task captured goes before the count drops
    absl::MutexLock lock(&mu_);
    Class& c = classes_[size_t(cls)];
    --c.running;
    ++c.ran;
  }
}

FairWorkStats FairWork::Stats() const {
  absl::MutexLock lock(&mu_);
  FairWorkStats s;
  s.queued_foreground = classes_[0].queued;
  s.queued_background = classes_[1].queued;
  s.running_foreground = classes_[0].running;
  s.running_background = classes_[1].running;
  s.ran_foreground = classes_[0].ran;
  s.ran_background = classes_[1].ran;
  return s;
}

}  // namespace kvbank::rpc
