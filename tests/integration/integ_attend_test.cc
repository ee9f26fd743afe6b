// Attend through the real RPC: decode attention computed on the pool equals a reference the
// client computes in fp64 on the KV it fetches (dequantized by the server as fp32), for GQA, MQA
// and MLA layouts, plain and quantized storage, with and without a sliding window.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kvbank/client.h"
#include "tests/integration/server_fixture.h"

namespace kvbank::integ {
namespace {

struct Case {
  const char* name;
  AttentionKind kind;
  uint32_t q_heads, kv_heads, head_dim;
  DType storage;
};

ModelLayout LayoutFor(const Case& c) {
  ModelLayout m;
  m.name = c.name;
  m.kind = c.kind;
  m.num_layers = 3;
  m.num_q_heads = c.q_heads;
  m.num_kv_heads = c.kv_heads;
  if (c.kind == AttentionKind::kMla) {
    m.kv_lora_rank = 32;
    m.rope_dim = 8;
    m.head_dim = 40;
    m.head_dim_v = 32;
  } else {
    m.head_dim = m.head_dim_v = c.head_dim;
  }
  m.block_tokens = 16;
  m.input_dtype = DType::kFp32;
  m.layer_dtypes.assign(3, c.storage);
  return m;
}

// out[h] and lse[h] by fp64 softmax over the attended tokens of K [kv][n][d], V [kv][n][dv].
void Reference(const ModelLayout& m, const float* k, const float* v, uint64_t n,
               const std::vector<float>& q, float scale, uint32_t window, uint32_t sinks,
               std::vector<double>* out, std::vector<double>* lse) {
  const uint32_t group = m.num_q_heads / m.num_kv_heads;
  const bool mla = m.kind == AttentionKind::kMla;
  out->assign(uint64_t{m.num_q_heads} * m.head_dim_v, 0);
  lse->assign(m.num_q_heads, 0);
  auto attends = [&](uint64_t t) {
    if (window == 0 || window >= n) return true;
    return t >= n - window || t < std::min<uint64_t>(sinks, n - window);
  };
  for (uint32_t h = 0; h < m.num_q_heads; ++h) {
    const uint32_t g = h / group;
    std::vector<double> s(n, -INFINITY);
    double mx = -INFINITY;
    for (uint64_t t = 0; t < n; ++t) {
      if (!attends(t)) continue;
      double dot = 0;
      for (uint32_t i = 0; i < m.head_dim; ++i) {
        dot += double(q[h * m.head_dim + i]) * k[(g * n + t) * m.head_dim + i];
      }
      s[t] = dot * scale;
      mx = std::max(mx, s[t]);
    }
    double sum = 0;
    for (uint64_t t = 0; t < n; ++t) sum += attends(t) ? std::exp(s[t] - mx) : 0;
    (*lse)[h] = mx + std::log(sum);
    for (uint64_t t = 0; t < n; ++t) {
      if (!attends(t)) continue;
      const double p = std::exp(s[t] - (*lse)[h]);
      for (uint32_t i = 0; i < m.head_dim_v; ++i) {
        // MLA: V is the first head_dim_v dims of the K row.
        const double val =
            mla ? k[(g * n + t) * m.head_dim + i] : v[(g * n + t) * m.head_dim_v + i];
        (*out)[h * m.head_dim_v + i] += p * val;
      }
    }
  }
}

class AttendTest : public KvbankdTest {};

TEST_F(AttendTest, MatchesAReferenceOnFetchedKvForEveryLayoutAndDtype) {
  ASSERT_NO_FATAL_FAILURE(StartServer({"--models=", "--pool-bytes=64MiB"}));
  auto client = NewClient();
  const Case cases[] = {
      {"gqa-fp16", AttentionKind::kGqa, 8, 2, 64, DType::kFp16},
      {"mha-fp32", AttentionKind::kMha, 4, 4, 32, DType::kFp32},
      {"mqa-bf16", AttentionKind::kMqa, 6, 1, 48, DType::kBf16},
      {"gqa-int8", AttentionKind::kGqa, 8, 2, 64, DType::kInt8},
      {"gqa-e4m3", AttentionKind::kGqa, 8, 2, 64, DType::kFp8E4M3},
      {"mla-int8", AttentionKind::kMla, 4, 1, 40, DType::kInt8},
      {"mla-fp16", AttentionKind::kMla, 4, 1, 40, DType::kFp16},
  };
  const uint64_t seed = 424242;
  std::printf("seed=%llu\n", (unsigned long long)seed);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g(0.f, 1.f);
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const ModelLayout m = LayoutFor(c);
    ASSERT_TRUE(client->EnsureModel(m).ok());
    auto seq = client->CreateSequence(c.name);
    ASSERT_TRUE(seq.ok()) << seq.status();
    const uint64_t n = 83;  // 5 full blocks and a partial one
    const uint64_t k_elems = uint64_t{m.num_layers} * m.num_kv_heads * n * m.head_dim;
    const uint64_t v_elems = m.kind == AttentionKind::kMla
                                 ? 0
                                 : uint64_t{m.num_layers} * m.num_kv_heads * n * m.head_dim_v;
    std::vector<float> k(k_elems), v(v_elems);
    for (float& x : k) x = g(rng);
    for (float& x : v) x = g(rng);
    Client::AppendArgs a;
    a.num_tokens = n;
    a.dtype = DType::kFp32;
    auto appended = client->AppendTensors(
        c.name, seq->id, a,
        absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(k.data()), k.size() * 4),
        absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(v.data()), v.size() * 4));
    ASSERT_TRUE(appended.ok()) << appended.status();
    // What the kernel reads, dequantized by the server exactly as stored.
    std::vector<float> kf(k_elems), vf(v_elems);
    Client::FetchArgs f;
    f.dtype = DType::kFp32;
    ASSERT_TRUE(
        client
            ->FetchTensors(c.name, seq->id, f,
                           absl::MakeSpan(reinterpret_cast<uint8_t*>(kf.data()), kf.size() * 4),
                           absl::MakeSpan(reinterpret_cast<uint8_t*>(vf.data()), vf.size() * 4))
            .ok());
    for (auto [window, sinks] : {std::pair<uint32_t, uint32_t>{0, 0}, {20, 4}, {16, 0}}) {
      std::vector<Client::AttendQuery> queries;
      for (uint32_t layer = 0; layer < m.num_layers; ++layer) {
        Client::AttendQuery q{seq->id, layer, std::vector<float>(m.num_q_heads * m.head_dim)};
        for (float& x : q.query) x = g(rng);
        queries.push_back(std::move(q));
      }
      Client::AttendArgs args;
      args.window = window;
      args.sinks = sinks;
      auto got = client->Attend(c.name, queries, args);
      ASSERT_TRUE(got.ok()) << got.status();
      ASSERT_EQ(got->size(), queries.size());
      const float scale = 1.0f / std::sqrt(float(m.head_dim));
      for (uint32_t layer = 0; layer < m.num_layers; ++layer) {
        const uint64_t k_layer = uint64_t{m.num_kv_heads} * n * m.head_dim;
        const uint64_t v_layer = uint64_t{m.num_kv_heads} * n * m.head_dim_v;
        std::vector<double> out, lse;
        Reference(m, kf.data() + layer * k_layer,
                  vf.empty() ? nullptr : vf.data() + layer * v_layer, n, queries[layer].query,
                  scale, window, sinks, &out, &lse);
        const auto& r = (*got)[layer];
        ASSERT_EQ(r.output.size(), out.size());
        ASSERT_EQ(r.lse.size(), lse.size());
        for (size_t i = 0; i < out.size(); ++i) {
          ASSERT_TRUE(std::isfinite(r.output[i]));
          ASSERT_NEAR(r.output[i], out[i], 2e-4 + 2e-4 * std::fabs(out[i]))
              << "layer " << layer << " window " << window << " element " << i;
        }
        for (size_t h = 0; h < lse.size(); ++h) ASSERT_NEAR(r.lse[h], lse[h], 2e-4);
      }
    }
  }
}

TEST_F(AttendTest, BadInputsGetAClearStatus) {
  ASSERT_NO_FATAL_FAILURE(StartServer({"--models=", "--pool-bytes=16MiB"}));
  auto client = NewClient();
  const ModelLayout m = LayoutFor({"m", AttentionKind::kGqa, 8, 2, 64, DType::kFp16});
  ASSERT_TRUE(client->EnsureModel(m).ok());
  auto seq = client->CreateSequence("m");
  ASSERT_TRUE(seq.ok());
  const std::vector<float> good(8 * 64, 0.5f);
  auto code = [&](std::vector<Client::AttendQuery> q, Client::AttendArgs a = {}) {
    return client->Attend("m", q, a).status();
  };
  absl::Status s = code({{seq->id, 0, std::vector<float>(7, 1.f)}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("query"), std::string::npos) << s;
  s = code({{seq->id, 3, good}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("layer"), std::string::npos) << s;
  s = code({{seq->id + 1, 0, good}});
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  std::vector<float> nan = good;
  nan[5] = std::nanf("");
  s = code({{seq->id, 0, nan}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("NaN"), std::string::npos) << s;
  s = code({});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  Client::AttendArgs sinks_only;
  sinks_only.sinks = 4;
  s = code({{seq->id, 0, good}}, sinks_only);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  // An empty sequence attends nothing: output 0, lse -inf, no NaN.
  auto empty = client->Attend("m", {{seq->id, 0, good}});
  ASSERT_TRUE(empty.ok()) << empty.status();
  for (float x : (*empty)[0].output) EXPECT_EQ(x, 0.f);
  for (float x : (*empty)[0].lse) EXPECT_TRUE(std::isinf(x) && x < 0);
  // The server still serves.
  EXPECT_TRUE(client->GetStats("m").ok());
}

TEST_F(AttendTest, SlidingWindowRetentionThroughTheRpc) {
  ASSERT_NO_FATAL_FAILURE(StartServer({"--models=", "--pool-bytes=16MiB"}));
  auto client = NewClient();
  const ModelLayout m = LayoutFor({"w", AttentionKind::kGqa, 8, 2, 64, DType::kFp32});
  ASSERT_TRUE(client->EnsureModel(m).ok());
  Client::CreateArgs ca;
  ca.retention_kind = 1;  // sliding window
  ca.window = 20;
  ca.sinks = 4;
  auto seq = client->CreateSequence("w", ca);
  ASSERT_TRUE(seq.ok()) << seq.status();
  const uint64_t n = 100;
  std::vector<uint8_t> payload(ComputeBlockLayout(m).PayloadBytes(0, m.num_layers, n), 0x3c);
  Client::AppendArgs a;
  a.num_tokens = n;
  auto info = client->Append("w", seq->id, a, payload);
  ASSERT_TRUE(info.ok()) << info.status();
  // Kept: block 0 (the sinks) and blocks 5, 6 (tokens 80..99, the last 20): 3 of 7 blocks.
  EXPECT_EQ(info->num_blocks, 3u);
  EXPECT_EQ(info->length, n);
  Client::FetchArgs released;
  released.token_begin = 20;
  released.token_end = 40;
  auto f = client->Fetch("w", seq->id, released);
  EXPECT_EQ(f.status().code(), absl::StatusCode::kFailedPrecondition) << f.status();
  EXPECT_NE(f.status().message().find("sliding window"), std::string::npos) << f.status();
  Client::FetchArgs recent;
  recent.token_begin = 80;
  EXPECT_TRUE(client->Fetch("w", seq->id, recent).ok());
  auto attended = client->Attend("w", {{seq->id, 0, std::vector<float>(8 * 64, 0.1f)}});
  ASSERT_TRUE(attended.ok()) << attended.status();
  for (float x : (*attended)[0].output) EXPECT_TRUE(std::isfinite(x));
  auto st = client->GetStats("w");
  ASSERT_TRUE(st.ok());
  EXPECT_EQ((*st)[0].blocks_used, 3u);
}

}  // namespace
}  // namespace kvbank::integ
