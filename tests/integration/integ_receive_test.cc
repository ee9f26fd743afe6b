// The SDK's receive path on a real kvbankd: fetching into a reused buffer must not fault in fresh
// pages for every message gRPC receives (ClientOptions::tune_malloc_trim).
#include <sys/resource.h>

#include <cstdint>
#include <cstdlib>
#include <vector>

#include "gtest/gtest.h"
#include "kvbank/client.h"
#include "tests/integration/server_fixture.h"

namespace kvbank::integ {
namespace {

uint64_t MinorFaults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<uint64_t>(u.ru_minflt);
}

class ReceiveTest : public KvbankdTest {};

TEST_F(ReceiveTest, FetchIntoDoesNotFaultPerMessage) {
  if (std::getenv("MALLOC_TRIM_THRESHOLD_") != nullptr) {
    GTEST_SKIP() << "MALLOC_TRIM_THRESHOLD_ is set: the SDK leaves malloc to it";
  }
  ASSERT_NO_FATAL_FAILURE(
      StartServer({"--models=llama-3.1-8b", "--pool-bytes=64MiB", "--device=host"}));
  auto client = NewClient();  // tune_malloc_trim defaults to true
  const std::string model = "llama-3.1-8b";
  constexpr uint64_t kTokens = 16;  // llama-3.1-8b bf16: 128 KiB a token, 2 MiB in all
  const uint64_t bytes = kTokens * (uint64_t{128} << 10);
  std::vector<uint8_t> payload(bytes);
  for (uint64_t i = 0; i < bytes; ++i) payload[i] = static_cast<uint8_t>(i * 131 + 7);
  auto seq = client->CreateSequence(model, absl::ZeroDuration());
  ASSERT_TRUE(seq.ok()) << seq.status();
  Client::AppendArgs a;
  a.num_tokens = kTokens;
  ASSERT_TRUE(client->Append(model, seq->id, a, payload).ok());
  std::vector<uint8_t> out(bytes, 0);
  for (int i = 0; i < 3; ++i) {  // warm-up: the heap grows to its working size
    ASSERT_TRUE(client->FetchInto(model, seq->id, {}, absl::MakeSpan(out)).ok());
  }
  ASSERT_TRUE(BytesEqual(out, payload));
  constexpr int kCalls = 20;
  const uint64_t before = MinorFaults();
  for (int i = 0; i < kCalls; ++i) {
    ASSERT_TRUE(client->FetchInto(model, seq->id, {}, absl::MakeSpan(out)).ok());
  }
  const double per_call = double(MinorFaults() - before) / kCalls;
  // 512 pages of 4 KiB hold the payload; with the heap's top given back after each message most
  // of them fault again on every call (about 300 measured). A few stray faults are fine.
  EXPECT_LT(per_call, 64) << "minor page faults per 2 MiB FetchInto";
  ASSERT_TRUE(BytesEqual(out, payload));
}

}  // namespace
}  // namespace kvbank::integ
