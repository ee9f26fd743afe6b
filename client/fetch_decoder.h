// The SDK's decoder of a Fetch / FetchBlocks response stream, read raw: the data field's bytes go
// from gRPC's slices straight into the result's payload (parsing each FetchResponse would first
// copy them into a std::string). Internal to the client library.
#ifndef KVBANK_CLIENT_FETCH_DECODER_H_
#define KVBANK_CLIENT_FETCH_DECODER_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "grpcpp/support/byte_buffer.h"
#include "kvbank/client.h"

namespace kvbank {

// Messages in stream order: the first carries the header (FetchHeader, field 1), every one a
// chunk of the payload (bytes, field 2). Fields it does not know are skipped, as protobuf would.
class FetchDecoder {
 public:
  // Into a vector of its own (FetchResult::payload).
  FetchDecoder() = default;
  // Into `into`: the payload must fit (OUT_OF_RANGE from Add when the header says it does not).
  explicit FetchDecoder(absl::Span<uint8_t> into) : into_(into), into_buffer_(true) {}

  // One message. INTERNAL when it is not a FetchResponse, repeats the header, comes before the
  // header, or carries data past the header's payload_bytes; the stream is then to be dropped.
  absl::Status Add(const grpc::ByteBuffer& message);
  // After the last message: the result, or INTERNAL when the payload is short.
  absl::StatusOr<Client::FetchResult> Finish() &&;

 private:
  absl::Status TakeHeader(const std::string& serialized);

  Client::FetchResult out_;
  absl::Span<uint8_t> into_;
  bool into_buffer_ = false;
  uint64_t written_ = 0;
  bool have_header_ = false;
  uint64_t expected_ = 0;
};

}  // namespace kvbank

#endif  // KVBANK_CLIENT_FETCH_DECODER_H_
