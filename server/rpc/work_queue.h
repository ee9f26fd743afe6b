// A small fixed pool of worker threads: where RPC reactions hand work that takes long (attention
// over long contexts), so that no reaction blocks a gRPC thread.
#ifndef KVBANK_SERVER_RPC_WORK_QUEUE_H_
#define KVBANK_SERVER_RPC_WORK_QUEUE_H_

#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace kvbank::rpc {

// Thread-safe. Tasks run in submission order on `threads` threads; the destructor runs what is
// queued, then joins.
class WorkQueue {
 public:
  explicit WorkQueue(size_t threads) {
    for (size_t i = 0; i < threads; ++i) threads_.emplace_back([this] { Run(); });
  }
  ~WorkQueue() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    for (std::thread& t : threads_) t.join();
  }
  WorkQueue(const WorkQueue&) = delete;
  WorkQueue& operator=(const WorkQueue&) = delete;

  void Submit(std::function<void()> task) {
    absl::MutexLock lock(&mu_);
    tasks_.push_back(std::move(task));
  }

 private:
  void Run() {
    for (;;) {
      std::function<void()> task;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(
            +[](WorkQueue* q)
                 ABSL_EXCLUSIVE_LOCKS_REQUIRED(q->mu_) { return q->stop_ || !q->tasks_.empty(); },
            this));
        if (tasks_.empty()) return;  // stopping, and nothing left
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }

  absl::Mutex mu_;
  std::deque<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace kvbank::rpc

#endif  // KVBANK_SERVER_RPC_WORK_QUEUE_H_
