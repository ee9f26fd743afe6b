// Client::CheckServing / WaitForServing: grpc.health.v1 probes through a generic stub, waiting
// on the channel's reconnect backoff between tries.
#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "client/client_internal.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "kvbank/client.h"

namespace kvbank {

using internal::FromGrpc;

absl::Status Client::CheckServing(absl::Duration deadline) {
  const absl::Time until = absl::Now() + deadline;
  grpc::GenericStub generic(impl_->channel);
  absl::Status last = absl::DeadlineExceededError("no answer");
  for (;;) {
    // grpc.health.v1.Health/Check with an empty HealthCheckRequest (service ""). The reply is
    // HealthCheckResponse; field 1 (status) = 1 is SERVING, encoded as bytes 0x08 0x01. Not
    // wait_for_ready: a failed connection answers at once with its reason (refused, TLS
    // handshake), which is what the caller is told when the deadline passes.
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(std::min(until, absl::Now() + absl::Seconds(1))));
    grpc::ByteBuffer request, response;
    grpc::Slice empty;
    request = grpc::ByteBuffer(&empty, 1);
    absl::Notification done;
    grpc::Status status;
    generic.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request,
                      &response, [&](grpc::Status s) {
                        status = std::move(s);
                        done.Notify();
                      });
    done.WaitForNotification();
    if (status.ok()) {
      std::vector<grpc::Slice> slices;
      std::string bytes;
      if (response.Dump(&slices).ok()) {
        for (const auto& s : slices)
          bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
      }
      if (bytes == std::string("\x08\x01", 2)) return absl::OkStatus();
      last = absl::UnavailableError("the server answers but is not SERVING (it is draining)");
    } else if (status.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED ||
               absl::IsDeadlineExceeded(last)) {
      // A try cut short by the deadline says less than an earlier refusal with its reason.
      last = FromGrpc(status);
    }
    const absl::Time now = absl::Now();
    if (now >= until) break;
    // Between connection attempts the channel waits (gRPC's reconnect backoff); wake up when it
    // tries again rather than spinning on calls that fail at once.
    const grpc_connectivity_state state = impl_->channel->GetState(/*try_to_connect=*/true);
    if (state == GRPC_CHANNEL_TRANSIENT_FAILURE || state == GRPC_CHANNEL_CONNECTING) {
      impl_->channel->WaitForStateChange(
          state, absl::ToChronoTime(std::min(until, now + absl::Milliseconds(200))));
    } else {
      absl::SleepFor(std::min(until - now, absl::Milliseconds(50)));
    }
  }
  return absl::Status(last.code(),
                      absl::StrCat(last.message(), " (for ", absl::FormatDuration(deadline), ")"));
}

bool Client::WaitForServing(absl::Duration deadline) { return CheckServing(deadline).ok(); }

}  // namespace kvbank
