// The service's AppendRequest decoder (proto/append_message.h) over fuzzer-chosen bytes cut into
// gRPC slices at fuzzer-chosen points. Properties: it never reads outside the message (ASan);
// where protobuf's own parse accepts the same bytes, an accepted message has the same header and
// data; and protobuf's serialization of whatever protobuf accepted is always accepted, with the
// same header and data (the decoder refuses only what a client never sends).
#include <string>

#include "google/protobuf/unknown_field_set.h"
#include "kvbank/v1/kvbank.pb.h"
#include "proto/append_message.h"
#include "tests/fuzz/fuzz_util.h"

namespace kvbank::fuzz {
namespace {

constexpr uint64_t kMaxHeaderBytes = 4 << 20;  // the service's message limit

std::string Joined(const proto::AppendMessage& m) {
  std::string out;
  for (absl::Span<const uint8_t> s : m.data) out.append(s.begin(), s.end());
  return out;
}

void CheckAgrees(const proto::AppendMessage& m, const v1::AppendRequest& pb) {
  FUZZ_CHECK(m.header.has_value() == pb.has_header());
  if (m.header.has_value()) {
    FUZZ_CHECK(m.header->SerializeAsString() == pb.header().SerializeAsString());
  }
  FUZZ_CHECK(Joined(m) == pb.data());
}

}  // namespace
}  // namespace kvbank::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvbank;
  FuzzedDataProvider in(data, size);
  const fuzz::Cuts cuts = fuzz::ConsumeCuts(in);
  const std::string bytes = in.ConsumeRemainingBytesAsString();

  proto::AppendMessage m;
  const absl::Status s =
      proto::DecodeAppendMessage(fuzz::Sliced(bytes, cuts), fuzz::kMaxHeaderBytes, &m);
  // The ByteBuffer is gone: the spans must live on the message's own slices.
  if (!s.ok()) {
    FUZZ_CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  } else {
    FUZZ_CHECK(fuzz::Joined(m).size() <= bytes.size());
  }
  v1::AppendRequest pb;
  if (!pb.ParseFromString(bytes)) return 0;
  if (s.ok()) fuzz::CheckAgrees(m, pb);

  // A client never sends a group (proto3 has none); protobuf keeps one it read as an unknown field.
  google::protobuf::UnknownFieldSet* unknown = pb.GetReflection()->MutableUnknownFields(&pb);
  for (int i = unknown->field_count() - 1; i >= 0; --i) {
    if (unknown->field(i).type() == google::protobuf::UnknownField::TYPE_GROUP) {
      unknown->DeleteSubrange(i, 1);
    }
  }
  const std::string canonical = pb.SerializeAsString();
  proto::AppendMessage c;
  FUZZ_CHECK(
      proto::DecodeAppendMessage(fuzz::Sliced(canonical, cuts), fuzz::kMaxHeaderBytes, &c).ok());
  fuzz::CheckAgrees(c, pb);
  return 0;
}
