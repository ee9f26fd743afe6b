#include "client/fetch_decoder.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvbank/v1/kvbank.pb.h"
#include "proto/convert.h"
#include "proto/wire.h"

namespace kvbank {
namespace {

// A large payload lands on fresh pages, whose first-touch faults (one per 4 KiB page) bound how
// fast it can be written. Where transparent huge pages are on request (madvise mode), ask for
// them: one fault per 2 MiB. A hint; nothing depends on it.
void AskForHugePages(uint8_t* data, size_t bytes) {
#ifdef MADV_HUGEPAGE
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  if (bytes < 2 * kHuge) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHuge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#endif
}

constexpr uint64_t kMaxReserve = uint64_t{256} << 20;

}  // namespace

absl::Status FetchDecoder::Add(const grpc::ByteBuffer& message) {
  const absl::Status bad = absl::InternalError("fetch stream sent a malformed FetchResponse");
  proto::SliceReader in(message);
  bool had_data = false;
  while (!in.done()) {
    uint32_t field = 0, wire_type = 0;
    uint64_t n = 0;
    if (!in.Field(&field, &wire_type, &n)) return bad;
    if (wire_type != 2) continue;  // not a field of this message: skipped, as protobuf would
    if (field == 1) {
      if (n > (uint64_t{1} << 20)) return bad;
      std::string serialized(n, '\0');
      if (!in.Copy(reinterpret_cast<uint8_t*>(serialized.data()), n)) return bad;
      if (absl::Status s = TakeHeader(serialized); !s.ok()) return s;
    } else if (field == 2) {
      if (had_data) return bad;  // one chunk a message
      had_data = true;
      if (!have_header_ || n > expected_ - written_) {
        return absl::InternalError("fetch stream sent data beyond its header's payload_bytes");
      }
      std::vector<absl::Span<const uint8_t>> spans;
      if (!in.Spans(n, &spans)) return bad;
      for (absl::Span<const uint8_t> s : spans) {
        if (into_buffer_) {
          std::memcpy(into_.data() + written_, s.data(), s.size());
        } else {  // appended piece by piece: no zero-filling first, as resize would
          out_.payload.insert(out_.payload.end(), s.begin(), s.end());
        }
        written_ += s.size();
      }
    } else if (!in.Copy(nullptr, n)) {
      return bad;
    }
  }
  return absl::OkStatus();
}

absl::Status FetchDecoder::TakeHeader(const std::string& serialized) {
  v1::FetchHeader h;
  std::optional<DType> d;
  if (have_header_ || !h.ParseFromString(serialized) || !proto::DTypeFromProto(h.dtype(), &d) ||
      !d.has_value()) {
    return absl::InternalError("fetch stream has a bad or repeated header");
  }
  have_header_ = true;
  out_.token_begin = h.token_begin();
  out_.num_tokens = h.num_tokens();
  out_.layer_begin = h.layer_begin();
  out_.layer_end = h.layer_end();
  out_.kv_head_begin = h.kv_head_begin();
  out_.kv_head_end = h.kv_head_end();
  out_.dtype = *d;
  expected_ = h.payload_bytes();
  out_.payload_bytes = expected_;
  if (into_buffer_) {
    if (expected_ > into_.size()) {
      return absl::OutOfRangeError(absl::StrCat(
          "the payload's ", expected_, " bytes do not fit the ", into_.size(), "-byte buffer"));
    }
    return absl::OkStatus();
  }
  // NOTE: payload_bytes is the server's word, not a checked size: at most kMaxReserve is taken
  // up front; past that the vector grows as bytes arrive, so a header that claims more than is
  // sent (2^62 bytes, say) costs no more memory than what is sent.
  out_.payload.reserve(std::min(expected_, kMaxReserve));
  AskForHugePages(out_.payload.data(), out_.payload.capacity());
  return absl::OkStatus();
}

absl::StatusOr<Client::FetchResult> FetchDecoder::Finish() && {
  if (!have_header_ || written_ != expected_) {
    return absl::InternalError(
        absl::StrCat("fetch stream ended after ", written_, " of ", expected_, " payload bytes"));
  }
  return std::move(out_);
}

}  // namespace kvbank
