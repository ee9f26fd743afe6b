// KvBankService's side of the shared-memory plane's control frames (proto/shm_control.h): a
// region transfer asked for on a claimed region's Unix connection instead of a gRPC call. Each
// frame runs the implementation its gRPC call runs (PrepareFetch / PrepareFetchBlocks and
// StartRegionFetch; BeginAppendTxn, AppendFromRegions and CommitAppend), as the tenant that
// claimed the connection's region, so both ways of asking check, fail and count alike. The
// listener thread that hands a frame over must not block: waits hold no thread, and copies run
// on the device workers but for small ones on host memory, and a lone transfer's up to
// ServiceOptions::lone_listener_copy_bytes (ListenerCopyBytes).
#include <algorithm>
#include <memory>
#include <utility>
#include <variant>

#include "absl/strings/str_cat.h"
#include "server/rpc/handler_util.h"
#include "server/rpc/service.h"

namespace kvbank::rpc {

void KvBankService::ServeControl(std::shared_ptr<plane::ShmControlCall> call) {
  plane_bytes_.AddControlRequest();
  if (draining_.load(std::memory_order_acquire)) {
    call->Reply(
        absl::UnavailableError("kvbankd is draining (shutting down): retry on another replica"));
    return;
  }
  {
    absl::MutexLock lock(&control_mu_);
    ++control_calls_;
  }
  const proto::ShmControlRequestBody& body = call->request().body;
  if (std::holds_alternative<v1::AppendHeader>(body)) return ServeControlAppend(std::move(call));
  if (const auto* f = std::get_if<v1::FetchRequest>(&body)) {
    return ServeControlFetch(call, PrepareFetch(call->tenant(), *f));
  }
  return ServeControlFetch(
      call, PrepareFetchBlocks(call->tenant(), std::get<v1::FetchBlocksRequest>(body)));
}

uint64_t KvBankService::ListenerCopyBytes(const plane::ShmControlCall& call) {
  const uint64_t lone = std::max(kInlineRegionCopyBytes, options_.lone_listener_copy_bytes);
  if (lone == kInlineRegionCopyBytes || !call.alone_in_round() ||
      region_copies_.load(std::memory_order_acquire) != 0) {
    return kInlineRegionCopyBytes;
  }
  absl::MutexLock lock(&control_mu_);
  return control_calls_ == 1 ? lone : kInlineRegionCopyBytes;
}

// The asker's deadline ends a call still pending (as gRPC ends a call past its deadline): its
// work stops. Only work that did not finish on the thread that took it needs the timer (a
// timer costs the timer thread a wake-up), which holds the call weakly and goes with the answer.
void KvBankService::ArmDeadline(const std::shared_ptr<plane::ShmControlCall>& call,
                                const std::shared_ptr<ControlDeadline>& d) {
  if (call->deadline() == absl::InfiniteFuture()) return;
  {
    absl::MutexLock lock(&d->mu);
    if (d->done) return;
  }
  const uint64_t timer =
      timers_.At(call->deadline(), [weak = std::weak_ptr<plane::ShmControlCall>(call)] {
        if (auto c = weak.lock()) c->EndAtDeadline();
      });
  absl::MutexLock lock(&d->mu);
  if (d->done) {
    timers_.Cancel(timer);  // answered meanwhile
  } else {
    d->timer = timer;
  }
}

void KvBankService::ControlCallDone(const std::shared_ptr<ControlDeadline>& d) {
  uint64_t timer = 0;
  if (d != nullptr) {
    absl::MutexLock lock(&d->mu);
    d->done = true;
    timer = d->timer;
  }
  if (timer != 0) timers_.Cancel(timer);
  absl::MutexLock lock(&control_mu_);
  --control_calls_;
}

void KvBankService::ServeControlAppend(std::shared_ptr<plane::ShmControlCall> call) {
  const auto& h = std::get<v1::AppendHeader>(call->request().body);
  const Plane plane = h.has_device_source() ? Plane::kCudaIpc : Plane::kShm;
  auto deadline = std::make_shared<ControlDeadline>();
  auto run = [this, call, plane, deadline] {
    const auto& h = std::get<v1::AppendHeader>(call->request().body);
    absl::StatusOr<v1::AppendResponse> resp = [&]() -> absl::StatusOr<v1::AppendResponse> {
      auto txn = BeginAppendTxn(call->tenant(), h);
      if (!txn.ok()) return txn.status();
      if (absl::Status s = AppendFromRegions(call->tenant(), h, txn->get()); !s.ok()) return s;
      // An asker gone before the commit gets nothing appended, as a cancelled Append stream.
      if (call->ended().load()) {
        return absl::CancelledError(
            "the append ended (cancelled or past its deadline) before its commit: nothing "
            "appended");
      }
      return CommitAppend(*std::move(txn), h.model(), plane);
    }();
    call->Reply(resp.ok() ? absl::StatusOr<proto::ShmControlAnswer>(*std::move(resp))
                          : absl::StatusOr<proto::ShmControlAnswer>(resp.status()));
    ControlCallDone(deadline);
  };
  auto model = FindModel(*registry_, h.model());
  const bool inline_copy = model.ok() && !(*model)->pool().memory().waits_on_device() &&
                           h.has_source() && h.source().length() <= ListenerCopyBytes(*call);
  if (inline_copy && h.source().length() > kInlineRegionCopyBytes) plane_bytes_.AddLoneCopy();
  if (inline_copy || !model.ok()) return run();  // (an unknown model is refused at once)
  ArmDeadline(call, deadline);                   // queued: the deadline may pass before it runs
  if (absl::Status s = device_work_->Submit(call->tenant(), WorkClass::kForeground, run); !s.ok()) {
    call->Reply(s);  // the tenant's backlog is full: nothing was appended
    ControlCallDone(deadline);
  }
}

void KvBankService::ServeControlFetch(std::shared_ptr<plane::ShmControlCall> call,
                                      absl::StatusOr<PreparedFetch> fetch) {
  if (!fetch.ok()) {
    call->Reply(fetch.status());
    ControlCallDone(nullptr);
    return;
  }
  auto deadline = std::make_shared<ControlDeadline>();
  const uint64_t inline_bytes = ListenerCopyBytes(*call);
  std::shared_ptr<RegionFetch> f = StartRegionFetch(
      call->tenant(), *std::move(fetch),
      [this, call, deadline](const absl::StatusOr<v1::FetchResponse>& resp) {
        call->Reply(resp.ok() ? absl::StatusOr<proto::ShmControlAnswer>(*resp) : resp.status());
        ControlCallDone(deadline);
      },
      inline_bytes);
  if (f == nullptr) return;  // answered already
  // A connection that closes (or the deadline) ends the fetch; the call holds it until then.
  call->OnEnd([f] { EndRegionFetch(*f); });
  ArmDeadline(call, deadline);  // nothing when it was answered here already
}

}  // namespace kvbank::rpc
