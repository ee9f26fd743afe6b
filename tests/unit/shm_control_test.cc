// The shared-memory plane's control frames (proto/shm_control.h): round trips of every request
// and reply, and every malformed frame refused with the problem named.
#include "proto/shm_control.h"

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace kvbank::proto {
namespace {

v1::RegionSlice Slice(uint64_t region, uint64_t offset, uint64_t length) {
  v1::RegionSlice s;
  s.set_region_id(region);
  s.set_offset(offset);
  s.set_length(length);
  return s;
}

ShmControlRequest Append() {
  v1::AppendHeader h;
  h.set_model("llama");
  h.set_sequence_id(42);
  h.set_num_tokens(3);
  h.add_token_ids(7);
  h.add_token_ids(8);
  h.add_token_ids(9);
  *h.mutable_source() = Slice(5, 4096, 3 * 256);
  return ShmControlRequest{17, 0, h};
}

ShmControlRequest Fetch() {
  v1::FetchRequest f;
  f.set_model("llama");
  f.set_sequence_id(42);
  f.set_token_end(64);
  f.set_wait_ms(250);
  *f.mutable_dest() = Slice(5, 0, 1 << 20);
  return ShmControlRequest{18, 0, f};
}

ShmControlRequest FetchBlocks() {
  v1::FetchBlocksRequest f;
  f.set_model("llama");
  f.add_block_hashes(std::string(32, 'a'));
  f.add_block_hashes(std::string(32, 'b'));
  *f.mutable_dest() = Slice(6, 0, 1 << 20);
  return ShmControlRequest{19, 0, f};
}

ShmControlHeader HeaderOf(const std::vector<uint8_t>& frame) {
  ShmControlHeader h;
  std::memcpy(&h, frame.data(), sizeof(h));
  return h;
}
void SetHeader(std::vector<uint8_t>* frame, const ShmControlHeader& h) {
  std::memcpy(frame->data(), &h, sizeof(h));
}

void ExpectRefused(const absl::Status& s, const std::string& why) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), why)) << s.message() << " lacks '" << why << "'";
}

TEST(ShmControl, RequestsRoundTrip) {
  for (const ShmControlRequest& r : {Append(), Fetch(), FetchBlocks()}) {
    const std::vector<uint8_t> frame = EncodeShmControlRequest(r);
    const ShmControlHeader h = HeaderOf(frame);
    EXPECT_EQ(h.op, static_cast<uint16_t>(r.op()));
    EXPECT_EQ(h.body_bytes, frame.size() - sizeof(ShmControlHeader));
    auto back = DecodeShmControlRequest(frame);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->request_id, r.request_id);
    ASSERT_EQ(back->body.index(), r.body.index());
    std::string a, b;
    std::visit([&](const auto& m) { m.SerializeToString(&a); }, r.body);
    std::visit([&](const auto& m) { m.SerializeToString(&b); }, back->body);
    EXPECT_EQ(a, b);
  }
}

TEST(ShmControl, RepliesRoundTrip) {
  v1::AppendResponse appended;
  appended.mutable_sequence()->set_sequence_id(42);
  appended.mutable_sequence()->set_length(3);
  ShmControlReplyFrame ok{17, ShmControlOp::kAppend, absl::OkStatus(), appended};
  auto back = DecodeShmControlReply(EncodeShmControlReply(ok));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->request_id, 17u);
  EXPECT_TRUE(back->status.ok());
  EXPECT_EQ(std::get<v1::AppendResponse>(back->answer).sequence().length(), 3u);

  v1::FetchResponse fetched;
  fetched.mutable_header()->set_num_tokens(64);
  ShmControlReplyFrame f{18, ShmControlOp::kFetch, absl::OkStatus(), fetched};
  back = DecodeShmControlReply(EncodeShmControlReply(f));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(std::get<v1::FetchResponse>(back->answer).header().num_tokens(), 64u);

  // An error travels as its code and text, the text cut to kShmControlMaxMessage.
  ShmControlReplyFrame err{
      19, ShmControlOp::kFetchBlocks, absl::NotFoundError(std::string(10000, 'x')), {}};
  back = DecodeShmControlReply(EncodeShmControlReply(err));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->status.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(back->status.message().size(), kShmControlMaxMessage);
  EXPECT_EQ(back->op, ShmControlOp::kFetchBlocks);
}

TEST(ShmControl, MalformedHeadersAreRefused) {
  const std::vector<uint8_t> good = EncodeShmControlRequest(Fetch());
  ExpectRefused(DecodeShmControlRequest({good.data(), 10}).status(), "less than its 32-byte");
  auto mutate = [&](auto f) {
    std::vector<uint8_t> frame = good;
    ShmControlHeader h = HeaderOf(frame);
    f(h);
    SetHeader(&frame, h);
    return DecodeShmControlRequest(frame).status();
  };
  ExpectRefused(mutate([](ShmControlHeader& h) { h.magic[0] = 'X'; }), "bad magic");
  ExpectRefused(mutate([](ShmControlHeader& h) { h.version = 2; }), "version 2");
  ExpectRefused(mutate([](ShmControlHeader& h) { h.reserved = 1; }), "reserved");
  EXPECT_TRUE(mutate([](ShmControlHeader& h) { h.timeout_ms = 250; }).ok());  // a deadline
  ExpectRefused(mutate([](ShmControlHeader& h) { h.op = 9; }), "op 9");
  ExpectRefused(mutate([](ShmControlHeader& h) { h.op |= kShmControlReply; }), "is not a request");
  ExpectRefused(mutate([](ShmControlHeader& h) { h.status = 5; }), "status must be 0");
  ExpectRefused(mutate([](ShmControlHeader& h) { h.body_bytes = kShmControlMaxBody + 1; }),
                "more than");
  ExpectRefused(mutate([](ShmControlHeader& h) { h.body_bytes -= 1; }), "the frame has");
  // A reply is not a request, and the other way round.
  ExpectRefused(DecodeShmControlReply(good).status(), "is not a reply");
  std::vector<uint8_t> reply = EncodeShmControlReply(
      ShmControlReplyFrame{1, ShmControlOp::kFetch, absl::InternalError("x"), {}});
  ShmControlHeader h = HeaderOf(reply);
  h.status = 17;
  SetHeader(&reply, h);
  ExpectRefused(DecodeShmControlReply(reply).status(), "not a gRPC status code");
}

TEST(ShmControl, BodiesWithoutTheirRegionAreRefused) {
  ShmControlRequest a = Append();
  std::get<v1::AppendHeader>(a.body).clear_source();
  ExpectRefused(DecodeShmControlRequest(EncodeShmControlRequest(a)).status(),
                "(source or device_source)");
  ShmControlRequest a2 = Append();
  *std::get<v1::AppendHeader>(a2.body).mutable_device_source() = Slice(1, 0, 1);
  ExpectRefused(DecodeShmControlRequest(EncodeShmControlRequest(a2)).status(),
                "(source or device_source)");
  ShmControlRequest f = Fetch();
  std::get<v1::FetchRequest>(f.body).clear_dest();
  ExpectRefused(DecodeShmControlRequest(EncodeShmControlRequest(f)).status(),
                "(dest or device_dest)");
  ShmControlRequest d = Fetch();
  *std::get<v1::FetchRequest>(d.body).mutable_device_dest() = Slice(1, 0, 1);
  ExpectRefused(DecodeShmControlRequest(EncodeShmControlRequest(d)).status(),
                "(dest or device_dest)");
  ShmControlRequest b = FetchBlocks();
  std::get<v1::FetchBlocksRequest>(b.body).clear_dest();
  ExpectRefused(DecodeShmControlRequest(EncodeShmControlRequest(b)).status(),
                "(dest or device_dest)");
  // A device region alone is a request of the CUDA IPC plane on the same path.
  ShmControlRequest dev = Fetch();
  std::get<v1::FetchRequest>(dev.body).clear_dest();
  *std::get<v1::FetchRequest>(dev.body).mutable_device_dest() = Slice(1, 0, 1);
  dev.timeout_ms = 1500;
  auto dev_back = DecodeShmControlRequest(EncodeShmControlRequest(dev));
  ASSERT_TRUE(dev_back.ok()) << dev_back.status();
  EXPECT_EQ(dev_back->timeout_ms, 1500u);
  ShmControlRequest adev = Append();
  std::get<v1::AppendHeader>(adev.body).clear_source();
  *std::get<v1::AppendHeader>(adev.body).mutable_device_source() = Slice(1, 0, 1);
  EXPECT_TRUE(DecodeShmControlRequest(EncodeShmControlRequest(adev)).ok());

  // A body that is not the message.
  std::vector<uint8_t> frame = EncodeShmControlRequest(Fetch());
  frame.resize(sizeof(ShmControlHeader) + 3);
  frame[sizeof(ShmControlHeader)] = 0xff;
  frame[sizeof(ShmControlHeader) + 1] = 0xff;
  frame[sizeof(ShmControlHeader) + 2] = 0xff;
  ShmControlHeader h = HeaderOf(frame);
  h.body_bytes = 3;
  SetHeader(&frame, h);
  ExpectRefused(DecodeShmControlRequest(frame).status(), "not a serialized FetchRequest");

  // A fetch's reply carries its bytes in the region, never inline.
  v1::FetchResponse inline_data;
  inline_data.set_data("abc");
  ExpectRefused(DecodeShmControlReply(EncodeShmControlReply(ShmControlReplyFrame{
                                          1, ShmControlOp::kFetch, absl::OkStatus(), inline_data}))
                    .status(),
                "not inline");
}

}  // namespace
}  // namespace kvbank::proto
