// The SDK's fetch-stream decoder (client/fetch_decoder.h) reads what protobuf writes: streams of
// FetchResponse serialized by protobuf, cut into gRPC slices at every kind of boundary, with
// fields it does not know mixed in, decode to the header's fields and the exact payload; broken
// streams are refused with INTERNAL.
#include "client/fetch_decoder.h"

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kvbank/v1/kvbank.pb.h"

namespace kvbank {
namespace {

// `bytes` as a ByteBuffer of slices cut at `cuts` (offsets, ascending).
grpc::ByteBuffer Sliced(const std::string& bytes, const std::vector<size_t>& cuts) {
  std::vector<grpc::Slice> slices;
  size_t at = 0;
  for (size_t c : cuts) {
    if (c <= at || c >= bytes.size()) continue;
    slices.emplace_back(bytes.data() + at, c - at);
    at = c;
  }
  slices.emplace_back(bytes.data() + at, bytes.size() - at);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

std::vector<size_t> RandomCuts(size_t size, std::mt19937& rng) {
  std::vector<size_t> cuts;
  if (size < 2) return cuts;
  std::uniform_int_distribution<size_t> pick(1, size - 1);
  const size_t n = rng() % 6;
  for (size_t i = 0; i < n; ++i) cuts.push_back(pick(rng));
  std::sort(cuts.begin(), cuts.end());
  return cuts;
}

// Fields a newer server might add: a varint (7), a fixed32 (8), a fixed64 (9) and a
// length-delimited one (10), in protobuf's wire format.
std::string UnknownFields() {
  std::string u;
  u += static_cast<char>(7 << 3 | 0);
  u += "\xac\x02";  // 300
  u += static_cast<char>(8 << 3 | 5);
  u += std::string("\x01\x02\x03\x04", 4);
  u += static_cast<char>(9 << 3 | 1);
  u += std::string(8, '\x7f');
  u += static_cast<char>(10 << 3 | 2);
  u += "\x03xyz";
  return u;
}

struct Stream {
  v1::FetchHeader header;
  std::string payload;
  std::vector<std::string> messages;  // serialized FetchResponse
};

Stream MakeStream(uint64_t payload_bytes, uint64_t chunk, bool unknown, std::mt19937& rng) {
  Stream s;
  s.header.set_token_begin(16);
  s.header.set_num_tokens(77);
  s.header.set_layer_begin(1);
  s.header.set_layer_end(3);
  s.header.set_dtype(v1::DTYPE_BF16);
  s.header.set_payload_bytes(payload_bytes);
  s.payload.resize(payload_bytes);
  for (char& c : s.payload) c = static_cast<char>(rng());
  uint64_t at = 0;
  do {
    v1::FetchResponse m;
    if (at == 0) *m.mutable_header() = s.header;
    const uint64_t n = std::min(chunk, payload_bytes - at);
    m.set_data(s.payload.substr(at, n));
    at += n;
    std::string bytes = m.SerializeAsString();
    if (unknown) bytes = UnknownFields() + bytes + UnknownFields();
    s.messages.push_back(std::move(bytes));
  } while (at < payload_bytes);
  return s;
}

TEST(FetchDecoder, DecodesWhatProtobufEncodesWhereverTheSlicesSplit) {
  const uint32_t seed = 5150;
  std::printf("seed %u\n", seed);
  std::mt19937 rng(seed);
  for (uint64_t size : {0u, 1u, 127u, 128u, 16383u, 16384u, 100000u}) {
    for (uint64_t chunk : {1u, 100u, 4096u, 1u << 20}) {
      if (size / chunk > 2000) continue;
      for (bool unknown : {false, true}) {
        SCOPED_TRACE(testing::Message() << size << " bytes, chunks of " << chunk
                                        << (unknown ? ", unknown fields" : ""));
        const Stream s = MakeStream(size, chunk, unknown, rng);
        FetchDecoder d;
        for (const std::string& m : s.messages) {
          ASSERT_TRUE(d.Add(Sliced(m, RandomCuts(m.size(), rng))).ok());
        }
        auto r = std::move(d).Finish();
        ASSERT_TRUE(r.ok()) << r.status();
        EXPECT_EQ(r->token_begin, 16u);
        EXPECT_EQ(r->num_tokens, 77u);
        EXPECT_EQ(r->layer_begin, 1u);
        EXPECT_EQ(r->layer_end, 3u);
        EXPECT_EQ(r->dtype, DType::kBf16);
        ASSERT_EQ(r->payload.size(), size);
        EXPECT_EQ(std::string(r->payload.begin(), r->payload.end()), s.payload);
      }
    }
  }
  // Every split of one message into two slices, and into single bytes.
  std::mt19937 fixed(seed + 1);
  const Stream s = MakeStream(300, 1 << 20, true, fixed);
  ASSERT_EQ(s.messages.size(), 1u);
  const std::string& m = s.messages[0];
  for (size_t cut = 1; cut < m.size(); ++cut) {
    FetchDecoder d;
    ASSERT_TRUE(d.Add(Sliced(m, {cut})).ok()) << "cut at " << cut;
    auto r = std::move(d).Finish();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(std::string(r->payload.begin(), r->payload.end()), s.payload);
  }
  std::vector<size_t> every;
  for (size_t i = 1; i < m.size(); ++i) every.push_back(i);
  FetchDecoder d;
  ASSERT_TRUE(d.Add(Sliced(m, every)).ok());
  EXPECT_TRUE(std::move(d).Finish().ok());
}

TEST(FetchDecoder, DecodesIntoTheCallersBuffer) {
  std::mt19937 rng(11);
  const Stream s = MakeStream(10000, 4096, true, rng);
  std::vector<uint8_t> buffer(10000 + 16, 0xa5);
  FetchDecoder d(absl::MakeSpan(buffer));
  for (const std::string& m : s.messages) {
    ASSERT_TRUE(d.Add(Sliced(m, RandomCuts(m.size(), rng))).ok());
  }
  auto r = std::move(d).Finish();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->payload.empty());
  EXPECT_EQ(r->payload_bytes, 10000u);
  EXPECT_EQ(std::string(buffer.begin(), buffer.begin() + 10000), s.payload);
  EXPECT_EQ(std::count(buffer.begin() + 10000, buffer.end(), 0xa5), 16);

  // A byte too small: refused at the header, before any byte is written.
  std::vector<uint8_t> small(9999, 0x5a);
  FetchDecoder too_small(absl::MakeSpan(small));
  const absl::Status st = too_small.Add(Sliced(s.messages[0], {}));
  EXPECT_EQ(st.code(), absl::StatusCode::kOutOfRange) << st;
  EXPECT_EQ(std::count(small.begin(), small.end(), 0x5a), 9999);
}

TEST(FetchDecoder, RefusesBrokenStreams) {
  std::mt19937 rng(7);
  const Stream s = MakeStream(1000, 400, false, rng);  // 3 messages
  ASSERT_EQ(s.messages.size(), 3u);
  auto expect_internal = [](const absl::Status& st, const char* what) {
    EXPECT_EQ(st.code(), absl::StatusCode::kInternal) << what << ": " << st;
  };
  {  // data before any header
    FetchDecoder d;
    expect_internal(d.Add(Sliced(s.messages[1], {})), "data first");
  }
  {  // the header twice
    FetchDecoder d;
    ASSERT_TRUE(d.Add(Sliced(s.messages[0], {})).ok());
    expect_internal(d.Add(Sliced(s.messages[0], {})), "repeated header");
  }
  {  // more data than payload_bytes
    FetchDecoder d;
    for (const std::string& m : s.messages) ASSERT_TRUE(d.Add(Sliced(m, {})).ok());
    expect_internal(d.Add(Sliced(s.messages[1], {})), "past payload_bytes");
  }
  {  // two data fields in one message
    FetchDecoder d;
    ASSERT_TRUE(d.Add(Sliced(s.messages[0], {})).ok());
    expect_internal(d.Add(Sliced(s.messages[1] + s.messages[2], {})), "two chunks in a message");
  }
  {  // a message cut short, at every length
    for (size_t len = 1; len < s.messages[0].size(); len += 37) {
      FetchDecoder d;
      expect_internal(d.Add(Sliced(s.messages[0].substr(0, len), {})), "truncated");
    }
  }
  {  // a group (wire type 3) and an invalid wire type (6)
    FetchDecoder d;
    expect_internal(d.Add(Sliced(std::string(1, static_cast<char>(5 << 3 | 3)), {})), "group");
    expect_internal(d.Add(Sliced(std::string(1, static_cast<char>(5 << 3 | 6)), {})), "type 6");
  }
  {  // a header with an unknown dtype
    v1::FetchResponse m;
    m.mutable_header()->set_dtype(static_cast<v1::DType>(99));
    FetchDecoder d;
    expect_internal(d.Add(Sliced(m.SerializeAsString(), {})), "unknown dtype");
  }
  {  // the stream ends short, or without a header
    FetchDecoder d;
    ASSERT_TRUE(d.Add(Sliced(s.messages[0], {})).ok());
    expect_internal(std::move(d).Finish().status(), "short");
    expect_internal(FetchDecoder().Finish().status(), "no header");
  }
}

// A header may claim any payload_bytes: the decoder must not allocate what it says up front (a
// claim of 2^62 bytes threw std::length_error out of reserve, which ended the process). The
// stream then ends short, with the bytes that did arrive.
TEST(FetchDecoder, SurvivesAHeaderThatClaimsAHugePayload) {
  for (uint64_t claim : {uint64_t{3} << 30, uint64_t{1} << 62, ~uint64_t{0}}) {
    SCOPED_TRACE(testing::Message() << "payload_bytes " << claim);
    v1::FetchResponse m;
    m.mutable_header()->set_dtype(v1::DTYPE_FP16);
    m.mutable_header()->set_payload_bytes(claim);
    m.set_data("0123456789");
    FetchDecoder d;
    ASSERT_TRUE(d.Add(Sliced(m.SerializeAsString(), {3})).ok());
    auto r = std::move(d).Finish();
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInternal) << r.status();
    EXPECT_NE(r.status().message().find("after 10 of"), std::string::npos) << r.status();
  }
}

}  // namespace
}  // namespace kvbank
