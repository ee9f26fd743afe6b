// Conversions between the C++ SDK's values and the wire messages (kvbank/v1/kvbank.proto), shared
// by the Client's files through client_internal.h.
#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "client/client_internal.h"
#include "kvbank/client.h"
#include "kvbank/v1/kvbank.grpc.pb.h"
#include "proto/convert.h"

namespace kvbank {
namespace internal {

absl::Status FromGrpc(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

Client::SequenceInfo FromProto(const v1::SequenceInfo& p) {
  Client::SequenceInfo s;
  s.model = p.model();
  s.id = p.sequence_id();
  s.length = p.length();
  s.layer_lengths.assign(p.layer_lengths().begin(), p.layer_lengths().end());
  s.num_blocks = p.num_blocks();
  s.cached_tokens = p.cached_tokens();
  s.lease_ttl = absl::Milliseconds(static_cast<int64_t>(p.lease_ttl_ms()));
  s.compactions = p.compactions();
  return s;
}

v1::AppendHeader MakeHeader(const std::string& model, uint64_t id, const Client::AppendArgs& a,
                            uint64_t payload_bytes) {
  v1::AppendHeader h;
  h.set_model(model);
  h.set_sequence_id(id);
  h.set_layer_begin(a.layer_begin);
  if (a.layer_end.has_value()) h.set_layer_end(*a.layer_end);
  h.set_num_tokens(a.num_tokens);
  if (a.dtype.has_value()) h.set_dtype(proto::DTypeToProto(*a.dtype));
  for (uint32_t t : a.token_ids) h.add_token_ids(t);
  h.set_payload_bytes(payload_bytes);
  h.set_kv_head_begin(a.kv_head_begin);
  if (a.kv_head_end.has_value()) h.set_kv_head_end(*a.kv_head_end);
  return h;
}

void SetSlice(const RegionSlice& slice, v1::RegionSlice* out) {
  out->set_region_id(slice.region_id);
  out->set_offset(slice.offset);
  out->set_length(slice.length);
  out->set_run_bytes(slice.run_bytes);
  out->mutable_run_offsets()->Assign(slice.run_offsets.begin(), slice.run_offsets.end());
}

v1::FetchRequest MakeFetchRequest(const std::string& model, uint64_t id,
                                  const Client::FetchArgs& args) {
  v1::FetchRequest req;
  req.set_model(model);
  req.set_sequence_id(id);
  req.set_token_begin(args.token_begin);
  if (args.token_end.has_value()) req.set_token_end(*args.token_end);
  req.set_layer_begin(args.layer_begin);
  if (args.layer_end.has_value()) req.set_layer_end(*args.layer_end);
  if (args.dtype.has_value()) req.set_dtype(proto::DTypeToProto(*args.dtype));
  req.set_kv_head_begin(args.kv_head_begin);
  if (args.kv_head_end.has_value()) req.set_kv_head_end(*args.kv_head_end);
  if (args.wait > absl::ZeroDuration()) {
    req.set_wait_ms(static_cast<uint32_t>(std::min<int64_t>(
        absl::ToInt64Milliseconds(absl::Ceil(args.wait, absl::Milliseconds(1))), UINT32_MAX)));
  }
  return req;
}

Client::FetchResult ResultFromHeader(const v1::FetchHeader& h, bool* dtype_ok) {
  Client::FetchResult r;
  r.token_begin = h.token_begin();
  r.num_tokens = h.num_tokens();
  r.layer_begin = h.layer_begin();
  r.layer_end = h.layer_end();
  r.kv_head_begin = h.kv_head_begin();
  r.kv_head_end = h.kv_head_end();
  std::optional<DType> dtype;
  *dtype_ok = proto::DTypeFromProto(h.dtype(), &dtype) && dtype.has_value();
  if (*dtype_ok) r.dtype = *dtype;
  r.payload_bytes = h.payload_bytes();
  return r;
}

std::string HashBytes(const BlockHash& h) { return std::string(h.begin(), h.end()); }

v1::FetchBlocksRequest MakeFetchBlocksRequest(const std::string& model,
                                              const std::vector<BlockHash>& hashes,
                                              const Client::FetchArgs& args) {
  v1::FetchBlocksRequest req;
  req.set_model(model);
  for (const BlockHash& h : hashes) req.add_block_hashes(HashBytes(h));
  req.set_layer_begin(args.layer_begin);
  if (args.layer_end.has_value()) req.set_layer_end(*args.layer_end);
  if (args.dtype.has_value()) req.set_dtype(proto::DTypeToProto(*args.dtype));
  req.set_kv_head_begin(args.kv_head_begin);
  if (args.kv_head_end.has_value()) req.set_kv_head_end(*args.kv_head_end);
  return req;
}

absl::StatusOr<Client::ModelInfo> ModelFromProto(const v1::ModelInfo& p) {
  Client::ModelInfo m;
  if (!proto::LayoutFromResolvedSpec(p.spec(), &m.layout)) {
    return absl::InternalError(
        absl::StrCat("server sent an unreadable spec for model '", p.spec().name(), "'"));
  }
  m.fingerprint = p.fingerprint();
  m.block_bytes = p.block_bytes();
  m.num_blocks = p.num_blocks();
  m.pool_bytes = p.spec().pool_bytes();
  m.payload_bytes_per_token = p.payload_bytes_per_token();
  m.device = p.device();
  m.max_sequences = p.spec().max_sequences();
  m.max_tokens_per_sequence = p.spec().max_tokens_per_sequence();
  return m;
}

void AddExtraKeys(const std::vector<ExtraKey>& keys,
                  google::protobuf::RepeatedPtrField<v1::ExtraKey>* out) {
  for (const ExtraKey& k : keys) {
    v1::ExtraKey* p = out->Add();
    p->set_kind(static_cast<v1::ExtraKeyKind>(k.kind));
    p->set_value(k.value);
  }
}

BlockHash HashFromBytes(const std::string& b) {
  BlockHash h{};
  std::memcpy(h.data(), b.data(), std::min(b.size(), h.size()));
  return h;
}

}  // namespace internal
}  // namespace kvbank
