// The SDK's Fetch stream decoder (client/fetch_decoder.h) over a stream of up to four
// fuzzer-chosen messages, each cut into gRPC slices at fuzzer-chosen points, decoded into its own
// vector or into a caller's buffer of a fuzzer-chosen size. Properties: it never reads or writes
// outside the messages and the buffer (ASan); where protobuf parses every message, a stream the
// decoder accepts has the header's fields and the data of every message in order; and a stream
// protobuf calls well formed (one header, first, a known dtype, exactly payload_bytes of data),
// serialized by protobuf, is accepted with the same result.
#include <optional>
#include <string>
#include <vector>

#include "client/fetch_decoder.h"
#include "google/protobuf/unknown_field_set.h"
#include "kvbank/v1/kvbank.pb.h"
#include "proto/convert.h"
#include "tests/fuzz/fuzz_util.h"

namespace kvbank::fuzz {
namespace {

struct Decoded {
  absl::Status status;
  Client::FetchResult result;
  std::string payload;  // as written into the vector or the buffer
};

Decoded Decode(const std::vector<std::string>& messages, const std::vector<Cuts>& cuts,
               std::optional<size_t> buffer_size) {
  Decoded d;
  std::vector<uint8_t> buffer(buffer_size.value_or(0));
  std::optional<FetchDecoder> decoder;
  if (buffer_size.has_value()) {
    decoder.emplace(absl::MakeSpan(buffer));
  } else {
    decoder.emplace();
  }
  for (size_t i = 0; i < messages.size(); ++i) {
    d.status = decoder->Add(Sliced(messages[i], cuts[i]));
    if (!d.status.ok()) return d;
  }
  auto r = std::move(*decoder).Finish();
  if (!r.ok()) {
    d.status = r.status();
    return d;
  }
  d.result = *std::move(r);
  if (buffer_size.has_value()) {
    FUZZ_CHECK(d.result.payload_bytes <= buffer.size());
    d.payload.assign(buffer.begin(), buffer.begin() + d.result.payload_bytes);
  } else {
    FUZZ_CHECK(d.result.payload.size() == d.result.payload_bytes);
    d.payload.assign(d.result.payload.begin(), d.result.payload.end());
  }
  return d;
}

void CheckAgrees(const Decoded& d, const v1::FetchHeader& h, const std::string& data) {
  FUZZ_CHECK(d.result.token_begin == h.token_begin());
  FUZZ_CHECK(d.result.num_tokens == h.num_tokens());
  FUZZ_CHECK(d.result.layer_begin == h.layer_begin());
  FUZZ_CHECK(d.result.layer_end == h.layer_end());
  FUZZ_CHECK(proto::DTypeToProto(d.result.dtype) == h.dtype());
  FUZZ_CHECK(d.result.payload_bytes == h.payload_bytes());
  FUZZ_CHECK(d.payload == data);
}

void DropGroups(google::protobuf::Message* m) {
  google::protobuf::UnknownFieldSet* u = m->GetReflection()->MutableUnknownFields(m);
  for (int i = u->field_count() - 1; i >= 0; --i) {
    if (u->field(i).type() == google::protobuf::UnknownField::TYPE_GROUP) u->DeleteSubrange(i, 1);
  }
}

}  // namespace
}  // namespace kvbank::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvbank;
  FuzzedDataProvider in(data, size);
  const int num_messages = in.ConsumeIntegralInRange<int>(1, 4);
  std::optional<size_t> buffer_size;
  if (in.ConsumeBool()) buffer_size = in.ConsumeIntegralInRange<size_t>(0, 4096);
  std::vector<fuzz::Cuts> cuts;
  for (int i = 0; i < num_messages; ++i) cuts.push_back(fuzz::ConsumeCuts(in));
  std::vector<std::string> messages;
  for (int i = 0; i + 1 < num_messages; ++i) messages.push_back(in.ConsumeRandomLengthString());
  messages.push_back(in.ConsumeRemainingBytesAsString());

  const fuzz::Decoded d = fuzz::Decode(messages, cuts, buffer_size);
  if (!d.status.ok()) {
    FUZZ_CHECK(d.status.code() == absl::StatusCode::kInternal ||
               (buffer_size.has_value() && d.status.code() == absl::StatusCode::kOutOfRange));
  }

  // protobuf's reading of the same stream.
  std::vector<v1::FetchResponse> pb(messages.size());
  for (size_t i = 0; i < messages.size(); ++i) {
    if (!pb[i].ParseFromString(messages[i])) return 0;
  }
  std::string joined;
  for (const v1::FetchResponse& r : pb) joined += r.data();
  // The decoder takes the header from whichever message carries it, as long as no data comes
  // before it.
  const v1::FetchHeader* header = nullptr;
  for (const v1::FetchResponse& r : pb) {
    if (r.has_header()) {
      header = &r.header();
      break;
    }
  }
  if (d.status.ok()) {
    FUZZ_CHECK(header != nullptr);
    fuzz::CheckAgrees(d, *header, joined);
  }

  bool well_formed = pb[0].has_header() && pb[0].header().payload_bytes() == joined.size();
  for (size_t i = 1; i < pb.size(); ++i) well_formed = well_formed && !pb[i].has_header();
  std::optional<DType> dtype;
  well_formed =
      well_formed && proto::DTypeFromProto(pb[0].header().dtype(), &dtype) && dtype.has_value();
  if (!well_formed || (buffer_size.has_value() && joined.size() > *buffer_size)) return 0;
  std::vector<std::string> canonical;
  for (v1::FetchResponse& r : pb) {
    fuzz::DropGroups(&r);  // a server never sends one (proto3 has none)
    canonical.push_back(r.SerializeAsString());
  }
  const fuzz::Decoded c = fuzz::Decode(canonical, cuts, buffer_size);
  FUZZ_CHECK(c.status.ok());
  fuzz::CheckAgrees(c, pb[0].header(), joined);
  return 0;
}
