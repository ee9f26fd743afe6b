// Layer-wise handoff through the real kvbankd and client: a decode worker's fetch of a layer that
// is not committed yet waits (FetchArgs::wait) and returns that layer's bytes once the prefill
// worker's append of it commits, for a whole sequence and for one tensor-parallel rank's heads.
// A fetch whose tokens do not come in time ends DEADLINE_EXCEEDED; one whose sequence is freed,
// FAILED_PRECONDITION; one whose client gives up leaves no waiter behind; bad requests are
// INVALID_ARGUMENT. Waits are on conditions with deadlines (the server's fetches_waiting).
#include <cstring>
#include <future>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "kvbank/client.h"
#include "tests/integration/kv_reference.h"
#include "tests/integration/server_fixture.h"

namespace kvbank::integ {
namespace {

constexpr uint32_t kLayers = 4, kHeads = 4, kDim = 64;
constexpr uint64_t kTokens = 40;

ModelLayout Layout() {
  ModelLayout m;
  m.name = "handoff";
  m.num_layers = kLayers;
  m.num_q_heads = 8;
  m.num_kv_heads = kHeads;
  m.head_dim = m.head_dim_v = kDim;
  m.block_tokens = 16;
  m.kind = AttentionKind::kGqa;
  m.input_dtype = DType::kFp16;
  m.layer_dtypes.assign(kLayers, DType::kFp16);
  return m;
}

// One layer's payload (K then V, every head, fp16 bytes), distinct per layer.
std::vector<uint8_t> LayerBytes(uint32_t layer) {
  std::vector<uint8_t> out(2ull * kHeads * kTokens * kDim * 2);
  for (size_t i = 0; i < out.size(); i += 2) {
    const uint16_t v = uint16_t(0x3000 + (i / 2 + layer * 977) % 0x0c00);  // finite fp16
    std::memcpy(out.data() + i, &v, 2);
  }
  return out;
}

// Heads [h0, h1) of a layer's payload: those heads' K rows, then their V rows.
std::vector<uint8_t> Heads(const std::vector<uint8_t>& layer, uint32_t h0, uint32_t h1) {
  const size_t head = kTokens * kDim * 2, kv = kHeads * head, n = (h1 - h0) * head;
  std::vector<uint8_t> out(2 * n);
  std::memcpy(out.data(), layer.data() + h0 * head, n);
  std::memcpy(out.data() + n, layer.data() + kv + h0 * head, n);
  return out;
}

class HandoffTest : public KvbankdTest {
 protected:
  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(StartServer({"--models=", "--pool-bytes=64MiB"}));
    client_ = NewClient();
    auto info = client_->EnsureModel(Layout(), 16 << 20);
    ASSERT_TRUE(info.ok()) << info.status();
  }

  uint64_t NewSequence() {
    auto seq = client_->CreateSequence("handoff", absl::ZeroDuration());
    EXPECT_TRUE(seq.ok()) << seq.status();
    return seq.ok() ? seq->id : 0;
  }

  // Waits until the server counts `n` fetches waiting for their tokens.
  void AwaitWaiting(uint64_t n) {
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    uint64_t now = ~uint64_t{0};
    while (absl::Now() < deadline) {
      auto st = client_->GetStats("handoff");
      ASSERT_TRUE(st.ok()) << st.status();
      now = st->at(0).fetches_waiting;
      if (now == n) return;
      absl::SleepFor(absl::Milliseconds(2));
    }
    FAIL() << "fetches waiting: " << now << ", expected " << n;
  }

  Client::FetchArgs LayerArgs(uint32_t layer, absl::Duration wait) {
    Client::FetchArgs f;
    f.layer_begin = layer;
    f.layer_end = layer + 1;
    f.token_end = kTokens;
    f.wait = wait;
    return f;
  }

  absl::Status AppendLayer(uint64_t id, uint32_t layer, uint32_t h0 = 0, uint32_t h1 = kHeads) {
    Client::AppendArgs a;
    a.layer_begin = layer;
    a.layer_end = layer + 1;
    a.num_tokens = kTokens;
    a.kv_head_begin = h0;
    a.kv_head_end = h1;
    return client_->Append("handoff", id, a, Heads(LayerBytes(layer), h0, h1)).status();
  }

  std::unique_ptr<Client> client_;
};

TEST_F(HandoffTest, DecodePullsEachLayerAsItsAppendCommits) {
  const uint64_t id = NewSequence();
  std::unique_ptr<Client> decode = NewClient();
  for (uint32_t layer = 0; layer < kLayers; ++layer) {
    SCOPED_TRACE(testing::Message() << "layer " << layer);
    auto pulled = std::async(std::launch::async, [&] {
      return decode->Fetch("handoff", id, LayerArgs(layer, absl::Seconds(30)));
    });
    ASSERT_NO_FATAL_FAILURE(AwaitWaiting(1));  // registered before the layer exists
    ASSERT_TRUE(AppendLayer(id, layer).ok());
    auto got = pulled.get();
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->num_tokens, kTokens);
    EXPECT_TRUE(BytesEqual(got->payload, LayerBytes(layer)));
  }
  ASSERT_NO_FATAL_FAILURE(AwaitWaiting(0));
  // Without a wait, a layer not there yet is OUT_OF_RANGE at once, as before.
  const uint64_t other = NewSequence();
  auto now = client_->Fetch("handoff", other, LayerArgs(0, absl::ZeroDuration()));
  EXPECT_EQ(now.status().code(), absl::StatusCode::kOutOfRange) << now.status();
}

TEST_F(HandoffTest, ADecodeRankWaitsForItsOwnHeadsOnly) {
  const uint64_t id = NewSequence();
  Client::FetchArgs mine = LayerArgs(0, absl::Seconds(30));
  mine.kv_head_begin = 0;
  mine.kv_head_end = 2;
  auto pulled = std::async(std::launch::async, [&] { return client_->Fetch("handoff", id, mine); });
  ASSERT_NO_FATAL_FAILURE(AwaitWaiting(1));
  ASSERT_TRUE(AppendLayer(id, 0, 2, 4).ok());  // the other rank's heads: still waiting
  ASSERT_NO_FATAL_FAILURE(AwaitWaiting(1));
  ASSERT_TRUE(AppendLayer(id, 0, 0, 2).ok());
  auto got = pulled.get();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->kv_head_end, 2u);
  EXPECT_TRUE(BytesEqual(got->payload, Heads(LayerBytes(0), 0, 2)));
}

TEST_F(HandoffTest, TimeoutsFreesAndCancelsEndTheWait) {
  // Not committed in time.
  const uint64_t id = NewSequence();
  auto late = client_->Fetch("handoff", id, LayerArgs(1, absl::Milliseconds(200)));
  ASSERT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded) << late.status();
  EXPECT_TRUE(absl::StrContains(late.status().message(), "wait_ms=200")) << late.status();
  ASSERT_NO_FATAL_FAILURE(AwaitWaiting(0));

  // Freed while waited for.
  auto freed = std::async(std::launch::async, [&] {
    return client_->Fetch("handoff", id, LayerArgs(1, absl::Seconds(30)));
  });
  ASSERT_NO_FATAL_FAILURE(AwaitWaiting(1));
  ASSERT_TRUE(client_->Free("handoff", id).ok());
  auto gone = freed.get();
  ASSERT_EQ(gone.status().code(), absl::StatusCode::kFailedPrecondition) << gone.status();
  EXPECT_TRUE(absl::StrContains(gone.status().message(), "freed")) << gone.status();

  // A client that gives up first (its own deadline): the server drops the waiter.
  ClientOptions impatient;
  impatient.stream_deadline = absl::Milliseconds(300);
  std::unique_ptr<Client> quick = NewClient(impatient);
  const uint64_t other = NewSequence();
  auto cancelled = quick->Fetch("handoff", other, LayerArgs(2, absl::Seconds(60)));
  ASSERT_EQ(cancelled.status().code(), absl::StatusCode::kDeadlineExceeded) << cancelled.status();
  ASSERT_NO_FATAL_FAILURE(AwaitWaiting(0));

  // Bad requests.
  Client::FetchArgs no_end = LayerArgs(0, absl::Seconds(1));
  no_end.token_end.reset();
  auto bad = client_->Fetch("handoff", other, no_end);
  ASSERT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "token_end")) << bad.status();
  auto too_long = client_->Fetch("handoff", other, LayerArgs(0, absl::Minutes(11)));
  ASSERT_EQ(too_long.status().code(), absl::StatusCode::kInvalidArgument) << too_long.status();
  EXPECT_TRUE(absl::StrContains(too_long.status().message(), "wait_ms")) << too_long.status();
  // The sequence still takes its layers and serves them.
  ASSERT_TRUE(AppendLayer(other, 2).ok());
  auto fine = client_->Fetch("handoff", other, LayerArgs(2, absl::Seconds(1)));
  ASSERT_TRUE(fine.ok()) << fine.status();
  EXPECT_TRUE(BytesEqual(fine->payload, LayerBytes(2)));
}

// A model dropped while fetches wait on its sequences: each wait ends at once with
// FAILED_PRECONDITION naming the drop (the proto's promise: a dropped model's sequences go at
// once), a plain wait and one into nothing else alike, instead of running out its wait_ms.
TEST_F(HandoffTest, DroppingTheModelEndsItsWaits) {
  const uint64_t a = NewSequence(), b = NewSequence();
  const absl::Time start = absl::Now();
  auto first = std::async(std::launch::async, [&] {
    return client_->Fetch("handoff", a, LayerArgs(1, absl::Seconds(60)));
  });
  auto second = std::async(std::launch::async, [&] {
    return client_->Fetch("handoff", b, LayerArgs(3, absl::Seconds(60)));
  });
  ASSERT_NO_FATAL_FAILURE(AwaitWaiting(2));
  ASSERT_TRUE(client_->DropModel("handoff").ok());
  for (auto* f : {&first, &second}) {
    auto r = f->get();
    ASSERT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
    EXPECT_TRUE(absl::StrContains(r.status().message(), "was dropped")) << r.status();
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(30)) << "the waits ran out instead of ending";
  // The name may be registered again at once, empty.
  auto again = client_->EnsureModel(Layout(), 16 << 20);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(client_->GetSequence("handoff", a).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvbank::integ
