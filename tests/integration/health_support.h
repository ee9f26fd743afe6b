// grpc.health.v1 from a test without generated health stubs: the request and the answer are
// one field each, so they are encoded by hand over gRPC's generic stub.
#ifndef KVBANK_TESTS_INTEGRATION_HEALTH_SUPPORT_H_
#define KVBANK_TESTS_INTEGRATION_HEALTH_SUPPORT_H_

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"

namespace kvbank::integ {

// grpc.health.v1.Health/Check for `service` on `channel`: 1 SERVING, 2 NOT_SERVING, -1 when the
// call failed (`code`, when given, gets its status code: NOT_FOUND for an unknown service).
inline int HealthOf(grpc::Channel* channel, const std::string& service,
                    grpc::StatusCode* code = nullptr) {
  grpc::GenericStub generic(channel->shared_from_this());
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
  std::string request;
  if (!service.empty())
    request = absl::StrCat("\x0a", std::string(1, char(service.size())), service);
  grpc::Slice slice(request);
  grpc::ByteBuffer req(&slice, 1), resp;
  absl::Notification done;
  grpc::Status status;
  generic.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &req, &resp,
                    [&](grpc::Status s) {
                      status = std::move(s);
                      done.Notify();
                    });
  done.WaitForNotification();
  if (code != nullptr) *code = status.error_code();
  if (!status.ok()) return -1;
  std::vector<grpc::Slice> slices;
  std::string bytes;
  if (resp.Dump(&slices).ok()) {
    for (const auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return bytes.size() == 2 && bytes[0] == 0x08 ? bytes[1] : 0;
}

}  // namespace kvbank::integ

#endif  // KVBANK_TESTS_INTEGRATION_HEALTH_SUPPORT_H_
