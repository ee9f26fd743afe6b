#include "server/rpc/fair_work.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <utility>

#include "common/log.h"

namespace kvbank::rpc {

FairWork::FairWork(FairWorkOptions options, std::shared_ptr<TenantLedger> ledger)
    : options_(options), ledger_(std::move(ledger)) {
  const size_t fg = std::max<size_t>(1, options_.threads);
  const size_t bg =
      options_.background_threads > 0 ? options_.background_threads : std::max<size_t>(1, fg / 2);
  for (size_t i = 0; i < fg; ++i) threads_.emplace_back([this] { Run(WorkClass::kForeground); });
  for (size_t i = 0; i < bg; ++i) threads_.emplace_back([this] { Run(WorkClass::kBackground); });
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

void FairWork::Run(WorkClass cls) {
  if (cls == WorkClass::kBackground && options_.background_nice != 0) {
    // Linux nice values are per thread: this one only.
    const auto tid = static_cast<id_t>(syscall(SYS_gettid));
    if (setpriority(PRIO_PROCESS, tid, options_.background_nice) != 0) {
      static std::atomic<bool> told{false};
      if (!told.exchange(true)) {
        log::Warn("background_priority") << "device workers: background threads stay at the "
                                            "process's CPU priority (setpriority: "
                                         << std::strerror(errno) << ")";
      }
    }
  }
  const uint64_t quantum =
      cls == WorkClass::kForeground ? options_.foreground_quantum : options_.background_quantum;
  for (;;) {
    Task task;
    {
      absl::MutexLock lock(&mu_);
      Class& c = classes_[size_t(cls)];
      // Stopping, the queue runs dry first.
      const auto can_take = [this, &c]()
                                ABSL_NO_THREAD_SAFETY_ANALYSIS { return c.queued > 0 || stop_; };
      mu_.Await(absl::Condition(&can_take));
      if (!TakeFromLocked(c, quantum, &task)) return;  // stopping, nothing left
      ++c.running;
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
