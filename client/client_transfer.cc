// The Client's payloads on gRPC: the chunked, zero-copy Append stream (Append, AppendTensors) and
// the raw Fetch stream (Fetch, FetchInto, FetchTensors).
#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "client/client_internal.h"
#include "client/fetch_decoder.h"
#include "grpcpp/grpcpp.h"
#include "kvbank/client.h"
#include "kvbank/v1/kvbank.grpc.pb.h"
#include "proto/wire.h"

namespace kvbank {

using internal::FromGrpc;
using internal::FromProto;
using internal::MakeFetchRequest;
using internal::MakeHeader;
using internal::RawFetch;

absl::StatusOr<Client::SequenceInfo> Client::Impl::StreamAppend(
    const v1::AppendHeader& header, absl::Span<const absl::Span<const uint8_t>> pieces) {
  grpc::ClientContext ctx;
  Deadline(&ctx, true);
  // Raw messages (AppendRequest, encoded here): each chunk's data field is slices of the
  // caller's own memory, sent without a copy. The memory outlives every use: this call returns
  // only after the server has answered, so after it has received every byte.
  grpc::ByteBuffer raw_resp;
  std::unique_ptr<grpc::ClientWriter<grpc::ByteBuffer>> writer(
      grpc::internal::ClientWriterFactory<grpc::ByteBuffer>::Create(
          channel.get(),
          grpc::internal::RpcMethod("/kvbank.v1.KvBank/Append",
                                    grpc::internal::RpcMethod::CLIENT_STREAMING),
          &ctx, &raw_resp));
  std::string prefix;
  const std::string serialized_header = header.SerializeAsString();
  std::vector<grpc::Slice> slices;  // [prefix, data pieces...]
  uint64_t chunk = 0;               // data bytes in `slices`
  bool first = true, broken = false, closed = false;
  // last: the message also half-closes the stream (one step less for the server to wait on).
  auto flush = [&](bool last) {
    prefix.clear();
    if (first) {
      proto::AppendLengthDelimitedKey(1, serialized_header.size(), &prefix);
      prefix += serialized_header;
    }
    proto::AppendLengthDelimitedKey(2, chunk, &prefix);
    slices.insert(slices.begin(), grpc::Slice(prefix));
    grpc::ByteBuffer message(slices.data(), slices.size());
    grpc::WriteOptions write_options;
    if (last) write_options.set_last_message();
    closed = last;
    // false: the server ended the call; Finish tells why.
    if (!writer->Write(message, write_options)) broken = true;
    slices.clear();
    chunk = 0;
    first = false;
  };
  for (absl::Span<const uint8_t> piece : pieces) {
    while (!piece.empty() && !broken) {
      const size_t n = std::min<size_t>(piece.size(), options.chunk_bytes - chunk);
      slices.emplace_back(piece.data(), n, grpc::Slice::STATIC_SLICE);
      chunk += n;
      piece.remove_prefix(n);
      if (chunk == options.chunk_bytes) flush(/*last=*/false);
    }
  }
  if (!broken && (first || chunk > 0)) flush(/*last=*/true);
  if (!closed) writer->WritesDone();
  if (auto s = FromGrpc(writer->Finish()); !s.ok()) return s;
  v1::AppendResponse resp;
  if (!grpc::SerializationTraits<v1::AppendResponse>::Deserialize(&raw_resp, &resp).ok()) {
    return absl::InternalError("append answered with something that is not an AppendResponse");
  }
  return FromProto(resp.sequence());
}

absl::StatusOr<Client::SequenceInfo> Client::Append(const std::string& model, uint64_t id,
                                                    const AppendArgs& args,
                                                    absl::Span<const uint8_t> payload) {
  const absl::Span<const uint8_t> pieces[] = {payload};
  return impl_->StreamAppend(MakeHeader(model, id, args, payload.size()), pieces);
}

absl::StatusOr<Client::SequenceInfo> Client::AppendTensors(const std::string& model, uint64_t id,
                                                           const AppendArgs& args,
                                                           absl::Span<const uint8_t> k,
                                                           absl::Span<const uint8_t> v) {
  auto info = GetModel(model);
  if (!info.ok()) return info.status();
  BlockLayout b = ComputeBlockLayout(info->layout);
  const uint32_t l0 = args.layer_begin, l1 = args.layer_end.value_or(info->layout.num_layers);
  if (l0 >= l1 || l1 > b.num_layers()) {
    return absl::InvalidArgumentError(absl::StrCat("layer range [", l0, ", ", l1, ") is invalid"));
  }
  if (info->layout.kind != AttentionKind::kMla) {
    const uint32_t h0 = args.kv_head_begin;
    const uint32_t h1 = args.kv_head_end.value_or(info->layout.num_kv_heads);
    if (h0 >= h1 || h1 > info->layout.num_kv_heads) {
      return absl::InvalidArgumentError(absl::StrCat("kv head range [", h0, ", ", h1,
                                                     ") is empty or outside the model's ",
                                                     info->layout.num_kv_heads, " kv heads"));
    }
    if (h1 - h0 < info->layout.num_kv_heads) b = b.Heads(h0, h1 - h0);  // a rank's payload
  }
  // The tensors' dtype: as asked, else the server's default for the range (kvbank/layout.h).
  AppendArgs sent = args;
  if (!sent.dtype.has_value()) sent.dtype = DefaultWireDType(info->layout, l0, l1);
  const PayloadLayout p = PayloadLayout::Make(b, l0, l1, args.num_tokens, sent.dtype);
  // Per layer: its K slice then its V slice. Each slice is contiguous in the tensors.
  std::vector<absl::Span<const uint8_t>> pieces;
  uint64_t k_off = 0, v_off = 0;
  for (uint32_t l = l0; l < l1; ++l) {
    const uint64_t kb = p.KPartBytes(b, l), vb = p.VPartBytes(b, l);
    if (k_off + kb > k.size() || v_off + vb > v.size()) {
      return absl::InvalidArgumentError(absl::StrCat("k/v spans are smaller than ", l1 - l0,
                                                     " layers x ", args.num_tokens, " tokens of ",
                                                     DTypeName(*sent.dtype)));
    }
    pieces.push_back(k.subspan(k_off, kb));
    if (vb) pieces.push_back(v.subspan(v_off, vb));
    k_off += kb;
    v_off += vb;
  }
  if (k_off != k.size() || v_off != v.size()) {
    return absl::InvalidArgumentError(absl::StrCat("k/v spans are larger than ", l1 - l0,
                                                   " layers x ", args.num_tokens, " tokens of ",
                                                   DTypeName(*sent.dtype)));
  }
  return impl_->StreamAppend(MakeHeader(model, id, sent, k_off + v_off), pieces);
}

absl::StatusOr<Client::FetchResult> Client::Fetch(const std::string& model, uint64_t id,
                                                  const FetchArgs& args) {
  grpc::ClientContext ctx;
  impl_->Deadline(&ctx, true);
  return RawFetch(impl_->channel.get(), "/kvbank.v1.KvBank/Fetch", &ctx,
                  MakeFetchRequest(model, id, args));
}

absl::StatusOr<Client::FetchResult> Client::FetchInto(const std::string& model, uint64_t id,
                                                      const FetchArgs& args,
                                                      absl::Span<uint8_t> out) {
  grpc::ClientContext ctx;
  impl_->Deadline(&ctx, true);
  return RawFetch(impl_->channel.get(), "/kvbank.v1.KvBank/Fetch", &ctx,
                  MakeFetchRequest(model, id, args), FetchDecoder(out));
}

absl::Status Client::FetchTensors(const std::string& model, uint64_t id, const FetchArgs& args,
                                  absl::Span<uint8_t> k, absl::Span<uint8_t> v) {
  auto info = GetModel(model);
  if (!info.ok()) return info.status();
  auto r = Fetch(model, id, args);
  if (!r.ok()) return r.status();
  BlockLayout b = ComputeBlockLayout(info->layout);
  if (r->kv_head_end > r->kv_head_begin &&
      r->kv_head_end - r->kv_head_begin < info->layout.num_kv_heads) {
    b = b.Heads(r->kv_head_begin, r->kv_head_end - r->kv_head_begin);  // a head range's payload
  }
  const PayloadLayout p =
      PayloadLayout::Make(b, r->layer_begin, r->layer_end, r->num_tokens, r->dtype);
  uint64_t k_need = 0, v_need = 0;
  for (uint32_t l = r->layer_begin; l < r->layer_end; ++l) {
    k_need += p.KPartBytes(b, l);
    v_need += p.VPartBytes(b, l);
  }
  if (k.size() != k_need || v.size() != v_need || p.total_bytes != r->payload.size()) {
    return absl::InvalidArgumentError(absl::StrCat("k/v spans hold ", k.size(), "/", v.size(),
                                                   " bytes; the fetch has ", k_need, "/", v_need));
  }
  uint64_t k_off = 0, v_off = 0;
  for (uint32_t l = r->layer_begin; l < r->layer_end; ++l) {
    const uint64_t kb = p.KPartBytes(b, l), vb = p.VPartBytes(b, l);
    std::memcpy(k.data() + k_off, r->payload.data() + p.RowOffset(b, l, 0, 0, 0), kb);
    if (vb) std::memcpy(v.data() + v_off, r->payload.data() + p.RowOffset(b, l, 1, 0, 0), vb);
    k_off += kb;
    v_off += vb;
  }
  return absl::OkStatus();
}

}  // namespace kvbank
