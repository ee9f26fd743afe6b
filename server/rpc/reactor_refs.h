// The lifetime of a callback reactor that hands work to other threads (device workers, timers,
// waits). gRPC holds one reference until OnDone; each piece of work handed out holds one until it
// has run (or is refused); the last to let go deletes the reactor. Without it a step queued on a
// worker could run after gRPC's OnDone freed the reactor (a call cut by its idle timeout while a
// device copy is queued).
#ifndef KVBANK_SERVER_RPC_REACTOR_REFS_H_
#define KVBANK_SERVER_RPC_REACTOR_REFS_H_

#include <atomic>
#include <functional>
#include <utility>

namespace kvbank {

// Base of a final reactor class `Reactor` (CRTP), next to its grpc reactor base. OnDone calls
// Unref() for gRPC's reference.
template <typename Reactor>
class ReactorRefs {
 public:
  ReactorRefs(const ReactorRefs&) = delete;
  ReactorRefs& operator=(const ReactorRefs&) = delete;

 protected:
  ReactorRefs() = default;
  ~ReactorRefs() = default;

  // One more holder (a queued step, a timer, a wait).
  void Ref() { refs_.fetch_add(1, std::memory_order_relaxed); }
  // A holder is done. The last deletes the reactor: the caller touches nothing of it afterwards.
  void Unref() {
    if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete static_cast<Reactor*>(this);
  }
  // `step`, holding a reference from now until it has run. Work that is refused (its step never
  // runs) gives the reference back with Unref().
  template <typename Step>
  std::function<void()> Held(Step step) {
    Ref();
    return [this, step = std::move(step)]() mutable {
      step();
      Unref();
    };
  }

 private:
  std::atomic<int> refs_{1};  // gRPC's, until OnDone
};

}  // namespace kvbank

#endif  // KVBANK_SERVER_RPC_REACTOR_REFS_H_
