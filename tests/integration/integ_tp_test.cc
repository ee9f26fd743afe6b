// Tensor parallelism on the wire, through the real kvbankd and client: a prefill (TP 1) stores
// every kv head; a decode engine with TP 2 pulls each rank's half with a kv head range (Fetch,
// FetchInto and FetchBlocks), and the two halves are exactly the full payload's rows of those
// heads. A prefill with TP 2 pushes each rank's half at once, layer by layer, from two clients;
// a decode with TP 1 reads what one all-heads append stores. Bad ranges are INVALID_ARGUMENT.
// Seeds are printed.
#include <cstring>
#include <iostream>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "kvbank/client.h"
#include "kvbank/prefix_hash.h"
#include "tests/integration/kv_reference.h"
#include "tests/integration/server_fixture.h"

namespace kvbank::integ {
namespace {

ModelLayout Gqa(DType storage) {
  ModelLayout m;
  m.name = std::string("tp-") + DTypeName(storage);
  m.num_layers = 3;
  m.num_q_heads = 16;
  m.num_kv_heads = 4;
  m.head_dim = m.head_dim_v = 64;
  m.block_tokens = 16;
  m.kind = AttentionKind::kGqa;
  m.input_dtype = DType::kFp16;
  m.layer_dtypes.assign(m.num_layers, storage);
  return m;
}

// Rows [kv][heads h0..h1) of every layer of a dense payload of n tokens (elem bytes wide).
std::vector<uint8_t> Heads(const std::vector<uint8_t>& full, const ModelLayout& m, uint64_t n,
                           uint32_t elem, uint32_t h0, uint32_t h1) {
  std::vector<uint8_t> out;
  const uint64_t part = uint64_t{m.num_kv_heads} * n * m.head_dim * elem;  // K or V of a layer
  const uint64_t head = n * m.head_dim * elem;
  for (uint32_t l = 0; l < m.num_layers; ++l) {
    for (uint32_t kv = 0; kv < 2; ++kv) {
      const uint8_t* p = full.data() + (2 * l + kv) * part;
      out.insert(out.end(), p + h0 * head, p + h1 * head);
    }
  }
  return out;
}

class TpTest : public KvbankdTest {};

TEST_F(TpTest, DecodeRanksPullTheirKvHeads) {
  ASSERT_NO_FATAL_FAILURE(StartServer({"--models=", "--max-pool-bytes=1GiB"}));
  std::unique_ptr<Client> client = NewClient();
  for (DType storage : {DType::kFp16, DType::kInt8}) {
    SCOPED_TRACE(DTypeName(storage));
    const ModelLayout m = Gqa(storage);
    auto info = client->EnsureModel(m, 32 << 20);
    ASSERT_TRUE(info.ok()) << info.status();
    constexpr uint64_t kTokens = 70;
    std::vector<uint32_t> ids(kTokens);
    for (uint64_t i = 0; i < kTokens; ++i) ids[i] = uint32_t(1000 + i);
    Client::CreateArgs create;
    create.lease = absl::ZeroDuration();
    auto seq = client->CreateSequence(m.name, create);
    ASSERT_TRUE(seq.ok()) << seq.status();
    Random rng(0x7e9 + uint64_t(storage));
    std::cerr << "[tp] " << m.name << " seed " << 0x7e9 + uint64_t(storage) << "\n";
    std::vector<uint8_t> payload(info->payload_bytes_per_token * kTokens);
    for (size_t i = 0; i < payload.size(); i += 2) {  // finite fp16 in [-1, 1)
      const uint16_t bits = uint16_t(rng.Next() % 0x3c00) | uint16_t((rng.Next() & 1) << 15);
      std::memcpy(payload.data() + i, &bits, 2);
    }
    Client::AppendArgs append;
    append.num_tokens = kTokens;
    append.token_ids = ids;
    ASSERT_TRUE(client->Append(m.name, seq->id, append, payload).ok());

    Client::FetchArgs all;
    all.dtype = DType::kFp16;
    auto full = client->Fetch(m.name, seq->id, all);
    ASSERT_TRUE(full.ok()) << full.status();
    EXPECT_EQ(full->kv_head_begin, 0u);
    EXPECT_EQ(full->kv_head_end, 4u);
    for (uint32_t rank = 0; rank < 2; ++rank) {
      SCOPED_TRACE(testing::Message() << "rank " << rank << " of 2");
      Client::FetchArgs mine = all;
      mine.kv_head_begin = 2 * rank;
      mine.kv_head_end = 2 * rank + 2;
      auto part = client->Fetch(m.name, seq->id, mine);
      ASSERT_TRUE(part.ok()) << part.status();
      EXPECT_EQ(part->kv_head_begin, 2 * rank);
      EXPECT_EQ(part->kv_head_end, 2 * rank + 2);
      const std::vector<uint8_t> want = Heads(full->payload, m, kTokens, 2, 2 * rank, 2 * rank + 2);
      EXPECT_TRUE(BytesEqual(part->payload, want));
      std::vector<uint8_t> buffer(want.size());
      auto into = client->FetchInto(m.name, seq->id, mine, absl::MakeSpan(buffer));
      ASSERT_TRUE(into.ok()) << into.status();
      EXPECT_TRUE(BytesEqual(buffer, want));
      // The prompt's full blocks by hash: the same heads of the first 64 tokens.
      auto root = client->GetPrefixRoot(m.name);
      ASSERT_TRUE(root.ok()) << root.status();
      const std::vector<BlockHash> hashes =
          PrefixHashes(root->algorithm, root->root, ids, m.block_tokens, {});
      ASSERT_EQ(hashes.size(), 4u);
      auto blocks = client->FetchBlocks(m.name, hashes, mine);
      ASSERT_TRUE(blocks.ok()) << blocks.status();
      Client::FetchArgs first64 = all;
      first64.token_end = 64;
      auto full64 = client->Fetch(m.name, seq->id, first64);
      ASSERT_TRUE(full64.ok()) << full64.status();
      EXPECT_TRUE(
          BytesEqual(blocks->payload, Heads(full64->payload, m, 64, 2, 2 * rank, 2 * rank + 2)));
    }
    Client::FetchArgs bad = all;
    bad.kv_head_begin = 3;
    bad.kv_head_end = 5;
    auto refused = client->Fetch(m.name, seq->id, bad);
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(refused.status().message(), "kv head range")) << refused.status();
  }
}

TEST_F(TpTest, PrefillRanksPushTheirKvHeadsAtOnce) {
  ASSERT_NO_FATAL_FAILURE(StartServer({"--models=", "--max-pool-bytes=1GiB"}));
  std::unique_ptr<Client> admin = NewClient();
  for (DType storage : {DType::kFp16, DType::kInt8}) {
    SCOPED_TRACE(DTypeName(storage));
    const ModelLayout m = Gqa(storage);
    auto info = admin->EnsureModel(m, 32 << 20);
    ASSERT_TRUE(info.ok()) << info.status();
    constexpr uint64_t kTokens = 70;
    std::vector<uint32_t> ids(kTokens);
    for (uint64_t i = 0; i < kTokens; ++i) ids[i] = uint32_t(3000 + i);
    const uint64_t seed = 0x7ea + uint64_t(storage);
    std::cerr << "[tp] prefill TP 2, " << m.name << " seed " << seed << "\n";
    Random rng(seed);
    std::vector<uint8_t> payload(info->payload_bytes_per_token * kTokens);
    for (size_t i = 0; i < payload.size(); i += 2) {
      const uint16_t bits = uint16_t(rng.Next() % 0x3c00) | uint16_t((rng.Next() & 1) << 15);
      std::memcpy(payload.data() + i, &bits, 2);
    }
    Client::CreateArgs create;
    create.lease = absl::ZeroDuration();
    auto ref = admin->CreateSequence(m.name, create);
    auto seq = admin->CreateSequence(m.name, create);
    ASSERT_TRUE(ref.ok() && seq.ok());
    Client::AppendArgs whole;
    whole.num_tokens = kTokens;
    whole.token_ids = ids;
    ASSERT_TRUE(admin->Append(m.name, ref->id, whole, payload).ok());

    // Each rank pushes its two heads of one layer at a time, as a prefill does while it runs.
    const uint64_t layer_bytes = payload.size() / m.num_layers;
    std::vector<absl::Status> results(2);
    std::vector<std::thread> ranks;
    for (uint32_t rank = 0; rank < 2; ++rank) {
      ranks.emplace_back([&, rank] {
        std::unique_ptr<Client> client = NewClient();
        for (uint32_t l = 0; l < m.num_layers && results[rank].ok(); ++l) {
          std::vector<uint8_t> layer(payload.begin() + l * layer_bytes,
                                     payload.begin() + (l + 1) * layer_bytes);
          ModelLayout one = m;
          one.num_layers = 1;
          Client::AppendArgs a;
          a.layer_begin = l;
          a.layer_end = l + 1;
          a.num_tokens = kTokens;
          a.token_ids = ids;
          a.kv_head_begin = 2 * rank;
          a.kv_head_end = 2 * rank + 2;
          auto done = client->Append(m.name, seq->id, a,
                                     Heads(layer, one, kTokens, 2, 2 * rank, 2 * rank + 2));
          results[rank] = done.status();
        }
      });
    }
    for (std::thread& t : ranks) t.join();
    ASSERT_TRUE(results[0].ok()) << results[0];
    ASSERT_TRUE(results[1].ok()) << results[1];

    auto got = admin->GetSequence(m.name, seq->id);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->length, kTokens);
    Client::FetchArgs stored;  // as stored: int8 with its scales, byte for byte
    stored.dtype = storage;
    auto want = admin->Fetch(m.name, ref->id, stored);
    auto have = admin->Fetch(m.name, seq->id, stored);
    ASSERT_TRUE(want.ok() && have.ok());
    EXPECT_TRUE(BytesEqual(have->payload, want->payload));
    // Both published the prompt's 4 full blocks under the same hashes.
    Client::MatchQuery query;
    query.tokens = ids;
    auto hits = admin->Match(m.name, {query});
    ASSERT_TRUE(hits.ok()) << hits.status();
    EXPECT_EQ(hits->at(0), 64u);

    // A head range outside the model is INVALID_ARGUMENT, with nothing appended.
    Client::AppendArgs bad;
    bad.num_tokens = 1;
    bad.kv_head_begin = 3;
    bad.kv_head_end = 5;
    auto refused = admin->Append(m.name, seq->id, bad, std::vector<uint8_t>(16));
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(refused.status().message(), "kv head range")) << refused.status();
  }
}

}  // namespace
}  // namespace kvbank::integ
