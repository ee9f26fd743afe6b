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

namespace kvbank {
namespace {

// Reads a serialized message held in gRPC slices without joining them.
class SliceCursor {
 public:
  explicit SliceCursor(const grpc::ByteBuffer& buffer) {
    if (!buffer.Dump(&slices_).ok()) slices_.clear();
  }
  bool done() {
    while (i_ < slices_.size() && off_ == slices_[i_].size()) {
      ++i_;
      off_ = 0;
    }
    return i_ == slices_.size();
  }
  bool Varint(uint64_t* v) {
    *v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (done()) return false;
      const uint8_t b = slices_[i_].begin()[off_++];
      *v |= uint64_t{b & 0x7fu} << shift;
      if ((b & 0x80) == 0) return true;
    }
    return false;
  }
  // Appends the next n bytes to *out (no zero-filling first, as resize would); false when
  // fewer are left.
  bool Append(std::vector<uint8_t>* out, uint64_t n) {
    while (n > 0) {
      if (done()) return false;
      const uint64_t take = std::min<uint64_t>(n, slices_[i_].size() - off_);
      const uint8_t* p = slices_[i_].begin() + off_;
      out->insert(out->end(), p, p + take);
      off_ += take;
      n -= take;
    }
    return true;
  }
  // Copies the next n bytes to dst (skips them when dst is null); false when fewer are left.
  bool Copy(uint8_t* dst, uint64_t n) {
    while (n > 0) {
      if (done()) return false;
      const uint64_t take = std::min<uint64_t>(n, slices_[i_].size() - off_);
      if (dst != nullptr) {
        std::memcpy(dst, slices_[i_].begin() + off_, take);
        dst += take;
      }
      off_ += take;
      n -= take;
    }
    return true;
  }

 private:
  std::vector<grpc::Slice> slices_;
  size_t i_ = 0;
  size_t off_ = 0;
};

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

}  // namespace

absl::Status FetchDecoder::Add(const grpc::ByteBuffer& message) {
  const absl::Status bad = absl::InternalError("fetch stream sent a malformed FetchResponse");
  SliceCursor in(message);
  bool had_data = false;
  while (!in.done()) {
    uint64_t key = 0, n = 0;
    if (!in.Varint(&key)) return bad;
    const uint64_t field = key >> 3;
    switch (key & 7) {
      case 0:  // varint
        if (!in.Varint(&n)) return bad;
        continue;
      case 1:  // fixed64
        if (!in.Copy(nullptr, 8)) return bad;
        continue;
      case 5:  // fixed32
        if (!in.Copy(nullptr, 4)) return bad;
        continue;
      case 2:  // length-delimited: the header, the data, or a field this client does not know
        if (!in.Varint(&n)) return bad;
        break;
      default:  // groups (deprecated) and invalid wire types
        return bad;
    }
    if (field == 1) {
      if (n > (uint64_t{1} << 20)) return bad;
      std::string serialized(n, '\0');
      if (!in.Copy(reinterpret_cast<uint8_t*>(serialized.data()), n)) return bad;
      if (absl::Status s = TakeHeader(serialized); !s.ok()) return s;
    } else if (field == 2) {
      if (had_data) return bad;  // one chunk a message
      had_data = true;
      if (!have_header_ || n > expected_ - out_.payload.size()) {
        return absl::InternalError("fetch stream sent data beyond its header's payload_bytes");
      }
      if (!in.Append(&out_.payload, n)) return bad;
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
  out_.dtype = *d;
  expected_ = h.payload_bytes();
  out_.payload.reserve(expected_);
  AskForHugePages(out_.payload.data(), out_.payload.capacity());
  return absl::OkStatus();
}

absl::StatusOr<Client::FetchResult> FetchDecoder::Finish() && {
  if (!have_header_ || out_.payload.size() != expected_) {
    return absl::InternalError(absl::StrCat("fetch stream ended after ", out_.payload.size(),
                                            " of ", expected_, " payload bytes"));
  }
  return std::move(out_);
}

}  // namespace kvbank
