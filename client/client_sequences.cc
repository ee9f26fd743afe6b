// The Client's sequence calls that move no payload: CreateSequence, Fork, Truncate, Free,
// RenewLease and GetSequence.
#include <algorithm>

#include "client/client_internal.h"
#include "kvbank/client.h"
#include "kvbank/v1/kvbank.grpc.pb.h"

namespace kvbank {

using internal::AddExtraKeys;
using internal::FromProto;

namespace {

void SetLease(std::optional<absl::Duration> lease, uint64_t* ms, bool* none) {
  if (!lease.has_value()) return;
  if (*lease <= absl::ZeroDuration()) {
    *none = true;
  } else {
    *ms = static_cast<uint64_t>(absl::ToInt64Milliseconds(*lease));
  }
}

}  // namespace

absl::StatusOr<Client::SequenceInfo> Client::CreateSequence(const std::string& model,
                                                            std::optional<absl::Duration> lease) {
  CreateArgs args;
  args.lease = lease;
  return CreateSequence(model, args);
}

absl::StatusOr<Client::SequenceInfo> Client::CreateSequence(const std::string& model,
                                                            const CreateArgs& args) {
  v1::CreateSequenceRequest req;
  req.set_model(model);
  uint64_t ms = 0;
  bool none = false;
  SetLease(args.lease, &ms, &none);
  req.set_lease_ttl_ms(ms);
  req.set_no_lease(none);
  for (uint32_t t : args.prompt) req.add_prompt_token_ids(t);
  req.set_cache_salt(args.cache_salt);
  AddExtraKeys(args.extra_keys, req.mutable_extra_keys());
  if (args.priority.has_value()) req.set_priority(*args.priority);
  req.mutable_retention()->set_kind(static_cast<v1::Retention::Kind>(args.retention_kind));
  req.mutable_retention()->set_window(args.window);
  req.mutable_retention()->set_sinks(args.sinks);
  req.mutable_retention()->set_budget(args.budget);
  req.set_prefix_copy(args.prefix_copy);
  v1::SequenceInfo resp;
  if (auto s = impl_->Call(&v1::KvBank::Stub::CreateSequence, req, &resp); !s.ok()) return s;
  return FromProto(resp);
}

absl::StatusOr<Client::SequenceInfo> Client::Fork(const std::string& model, uint64_t id,
                                                  std::optional<absl::Duration> lease) {
  v1::ForkRequest req;
  req.set_model(model);
  req.set_sequence_id(id);
  if (lease.has_value()) {
    req.set_lease_ttl_ms(
        static_cast<uint64_t>(std::max<int64_t>(0, absl::ToInt64Milliseconds(*lease))));
  }
  v1::SequenceInfo resp;
  if (auto s = impl_->Call(&v1::KvBank::Stub::Fork, req, &resp); !s.ok()) return s;
  return FromProto(resp);
}

absl::StatusOr<Client::SequenceInfo> Client::Truncate(const std::string& model, uint64_t id,
                                                      uint64_t num_tokens) {
  v1::TruncateRequest req;
  req.set_model(model);
  req.set_sequence_id(id);
  req.set_num_tokens(num_tokens);
  v1::SequenceInfo resp;
  if (auto s = impl_->Call(&v1::KvBank::Stub::Truncate, req, &resp); !s.ok()) return s;
  return FromProto(resp);
}

absl::StatusOr<uint64_t> Client::Free(const std::string& model, uint64_t id) {
  v1::FreeRequest req;
  req.set_model(model);
  req.set_sequence_id(id);
  v1::FreeResponse resp;
  if (auto s = impl_->Call(&v1::KvBank::Stub::Free, req, &resp); !s.ok()) return s;
  return resp.blocks_released();
}

absl::StatusOr<Client::SequenceInfo> Client::RenewLease(const std::string& model, uint64_t id) {
  v1::RenewLeaseRequest req;
  req.set_model(model);
  req.set_sequence_id(id);
  v1::SequenceInfo resp;
  if (auto s = impl_->Call(&v1::KvBank::Stub::RenewLease, req, &resp); !s.ok()) return s;
  return FromProto(resp);
}

absl::StatusOr<Client::SequenceInfo> Client::GetSequence(const std::string& model, uint64_t id) {
  v1::GetSequenceRequest req;
  req.set_model(model);
  req.set_sequence_id(id);
  v1::SequenceInfo resp;
  if (auto s = impl_->Call(&v1::KvBank::Stub::GetSequence, req, &resp); !s.ok()) return s;
  return FromProto(resp);
}

}  // namespace kvbank
