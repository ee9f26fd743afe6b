// The device workers every tenant shares: where reactions hand work that blocks (device copies,
// disk reads, region copies, NCCL transfers), scheduled fairly across tenants.
//
//  - Two classes: foreground (a client waits for it) and background (prefetches a Match asked
//    for), each on threads of its own: foreground work never waits behind a background task for
//    a worker. The background threads run at a lower CPU priority (background_nice, as RocksDB
//    runs its compactions), so when the CPUs are busy a prefetch takes only the time that calls
//    leave, on any tenant's behalf.
//  - Within a class, deficit round robin over the tenants with queued tasks: each visit adds a
//    quantum to the tenant's deficit and runs its tasks while their cost fits; a tenant's burst
//    waits behind its own tasks, not in front of everyone else's.
//  - Bounded backlogs: a new task is a claim on the tenant ledger (queued_work or
//    queued_background, released when the task starts), so a tenant past its share of queued
//    work gets RESOURCE_EXHAUSTED (foreground) or has its prefetch dropped, counted (background).
//    A stream's next step (Continue) belongs to a call already admitted: never refused.
#ifndef KVBANK_SERVER_RPC_FAIR_WORK_H_
#define KVBANK_SERVER_RPC_FAIR_WORK_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "server/core/tenant_ledger.h"

namespace kvbank::rpc {

enum class WorkClass : uint8_t { kForeground = 0, kBackground = 1 };

struct FairWorkOptions {
  size_t threads = 4;  // foreground threads
  // Background threads (the most background tasks running at once); 0: half the foreground
  // threads, at least 1.
  size_t background_threads = 0;
  // The background threads' nice value (Linux: each thread lowers its own priority; raising it
  // needs no privilege). 0 leaves them at the process's.
  int background_nice = 10;
  // Cost added to a tenant's deficit on each visit.
  uint64_t foreground_quantum = 1;
  uint64_t background_quantum = 64;
};

struct FairWorkStats {
  uint64_t queued_foreground = 0, queued_background = 0;
  uint64_t running_foreground = 0, running_background = 0;
  uint64_t ran_foreground = 0, ran_background = 0;
};

// Thread-safe. The destructor runs every queued task, then joins the threads.
class FairWork {
 public:
  // `ledger` holds the backlog claims (its kQueuedWork and kQueuedBackground caps and shares).
  FairWork(FairWorkOptions options, std::shared_ptr<TenantLedger> ledger);
  ~FairWork();
  FairWork(const FairWork&) = delete;
  FairWork& operator=(const FairWork&) = delete;

  // Queues new work of `tenant`. `cost`: its size in the class's units (1 for a foreground task;
  // blocks for a prefetch). RESOURCE_EXHAUSTED (the ledger's, naming the share or the cap) when
  // the tenant's backlog of that class is full; the task is then dropped, never run.
  absl::Status Submit(const std::string& tenant, WorkClass cls, std::function<void()> task,
                      uint64_t cost = 1);
  // Queues the next step of a foreground call already admitted (a stream's next chunk): counted
  // and scheduled like any foreground task of `tenant`, never refused.
  void Continue(const std::string& tenant, std::function<void()> task);
  FairWorkStats Stats() const;

 private:
  struct Task {
    std::function<void()> run;
    uint64_t cost = 1;
    LedgerClaim claim;  // its place in the backlog; released when it starts
  };
  struct Queue {
    std::deque<Task> tasks;
    uint64_t deficit = 0;
    bool active = false;  // in the class's ring
  };
  struct Class {
    absl::flat_hash_map<std::string, Queue> by_tenant;
    std::deque<std::string> ring;  // tenants with queued tasks, in visiting order
    uint64_t queued = 0, running = 0, ran = 0;
  };
  void Push(const std::string& tenant, WorkClass cls, Task task);
  // A worker of class `cls`: runs that class's tasks until stopped with its queue empty.
  void Run(WorkClass cls);
  // The class's next task by deficit round robin over its tenants; false when it has none.
  bool TakeFromLocked(Class& c, uint64_t quantum, Task* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const FairWorkOptions options_;
  const std::shared_ptr<TenantLedger> ledger_;
  mutable absl::Mutex mu_;
  Class classes_[2] ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace kvbank::rpc

#endif  // KVBANK_SERVER_RPC_FAIR_WORK_H_
