// Quantized storage through the real kvbankd and the real client: int8 and fp8_e4m3 models fed
// fp16 in streamed appends of over 1 MiB, fetched back as fp32 with every element within the
// bound its scale implies (kernels/quant.h); the capacity a quantized model gets from the same
// pool bytes; NaN / Inf refused over the RPC with nothing changed; and a preset stored int8 with
// high_precision_layers keeping its first and last layers in the input dtype. Seeds are printed.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <iostream>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kernels/quant_math.h"
#include "kvbank/client.h"
#include "kvbank/v1/kvbank.grpc.pb.h"
#include "tests/integration/kv_reference.h"
#include "tests/integration/server_fixture.h"

namespace kvbank::integ {
namespace {

namespace qmath = kernels::qmath;

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kPoolBytes = 64 * kMiB;

// 4 layers x 8 KV heads x 128 dims x 16 tokens: Llama-like rows, a small model.
ModelLayout Gqa(const std::string& name, DType storage) {
  ModelLayout m;
  m.name = name;
  m.num_layers = 4;
  m.num_q_heads = 32;
  m.num_kv_heads = 8;
  m.head_dim = m.head_dim_v = 128;
  m.block_tokens = 16;
  m.kind = AttentionKind::kGqa;
  m.input_dtype = DType::kFp16;
  m.layer_dtypes.assign(m.num_layers, storage);
  return m;
}

float DTypeRound(DType d, float x) {
  return d == DType::kBf16 ? qmath::Bf16ToFloat(qmath::FloatToBf16(x, true))
                           : qmath::HalfToFloat(qmath::FloatToHalf(x, true));
}

// The values one sequence was sent ([layer][kv][head] rows of every token, as the input dtype
// holds them), the tensors of each append, and for fp8 layers the largest scale each
// (layer, K/V, head, block) can have: the server sets it from the rows at hand when the block's
// first row arrives, times a headroom of 4 when they are not the whole block.
class Sent {
 public:
  explicit Sent(const ModelLayout& m)
      : m_(m), rows_(size_t{m.num_layers} * 2 * m.num_kv_heads), scale_(rows_.size()) {}

  uint64_t length() const { return len_; }
  const float* Row(uint32_t l, uint32_t kv, uint32_t h, uint64_t t) const {
    return rows_[Slot(l, kv, h)].data() + t * m_.head_dim;
  }
  float Fp8Scale(uint32_t l, uint32_t kv, uint32_t h, uint64_t block) const {
    return scale_[Slot(l, kv, h)][block];
  }

  // Adds n tokens of uniform values in [-mag, mag] (mag by layer and head, an outlier channel
  // within the fp8 headroom) and returns them as K and V tensors
  // ([layers][heads][n][dim], the input dtype) for AppendTensors.
  void Add(uint64_t n, Random& rng, std::vector<uint8_t>* k, std::vector<uint8_t>* v) {
    const DType in = m_.input_dtype;
    const uint64_t t0 = len_, t1 = len_ + n, bt = m_.block_tokens;
    k->clear();
    v->clear();
    for (uint32_t l = 0; l < m_.num_layers; ++l) {
      for (uint32_t kv = 0; kv < 2; ++kv) {
        std::vector<uint8_t>* out = kv == 0 ? k : v;
        for (uint32_t h = 0; h < m_.num_kv_heads; ++h) {
          std::vector<float>& rows = rows_[Slot(l, kv, h)];
          for (uint64_t t = t0; t < t1; ++t) {
            for (uint32_t i = 0; i < m_.head_dim; ++i) {
              const float u = float(rng.Next() >> 40) * 0x1p-23f - 1.0f;
              const float mag = (0.5f + 0.25f * l + 0.125f * h) * (i == 7 ? 2.5f : 1.0f);
              const float x = DTypeRound(in, u * mag);
              rows.push_back(x);
              uint16_t bits =
                  in == DType::kBf16 ? qmath::FloatToBf16(x, true) : qmath::FloatToHalf(x, true);
              out->push_back(uint8_t(bits));
              out->push_back(uint8_t(bits >> 8));
            }
          }
          if (!qmath::IsFp8DType(m_.layer_dtypes[l])) continue;
          for (uint64_t b = (t0 + bt - 1) / bt; b * bt < t1; ++b) {
            float amax = 0;
            for (uint64_t t = b * bt; t < std::min(t1, (b + 1) * bt); ++t) {
              for (uint32_t i = 0; i < m_.head_dim; ++i)
                amax = std::max(amax, std::fabs(Row(l, kv, h, t)[i]));
            }
            scale_[Slot(l, kv, h)].resize(b + 1);
            scale_[Slot(l, kv, h)][b] = qmath::Fp8ScaleFor(4 * amax, m_.layer_dtypes[l]);
          }
        }
      }
    }
    len_ = t1;
  }

 private:
  size_t Slot(uint32_t l, uint32_t kv, uint32_t h) const {
    return (size_t{l} * 2 + kv) * m_.num_kv_heads + h;
  }

  ModelLayout m_;
  uint64_t len_ = 0;
  std::vector<std::vector<float>> rows_;
  std::vector<std::vector<float>> scale_;
};

// The most |x' - x| may be for element i of input row `row` stored as `stored`.
double Bound(DType stored, DType input, const float* row, uint32_t dim, uint32_t i, float scale) {
  const double x = std::fabs(row[i]);
  if (stored == DType::kInt8) {
    const auto [mn, mx] = std::minmax_element(row, row + dim);
    if (*mn == *mx) return 0;
    const double range = double(std::max(*mx, 0.0f)) - double(std::min(*mn, 0.0f));
    const double s = std::max(double(float(range / 255.0)), double(FLT_MIN));
    return s / 2 + s * 0x1p-12 + x * 0x1p-22;
  }
  if (stored == DType::kFp8E4M3) return x * 0x1p-4 + double(scale) * 0x1p-10 + x * 0x1p-20;
  if (stored == DType::kFp8E5M2) return x * 0x1p-3 + double(scale) * 0x1p-17 + x * 0x1p-20;
  return stored == input ? 0 : x * 0x1p-8;
}

// Fetches the whole sequence as fp32 tensors (FetchTensors) and as a payload (Fetch), which must
// agree, and checks every element against its bound.
void ExpectWithinBounds(Client& client, const ModelLayout& m, uint64_t id, const Sent& sent) {
  const uint64_t n = sent.length();
  const uint64_t part = uint64_t{m.num_layers} * m.num_kv_heads * n * m.head_dim;
  std::vector<float> k(part), v(part);
  Client::FetchArgs args;
  args.dtype = DType::kFp32;
  absl::Status s = client.FetchTensors(
      m.name, id, args, absl::MakeSpan(reinterpret_cast<uint8_t*>(k.data()), part * 4),
      absl::MakeSpan(reinterpret_cast<uint8_t*>(v.data()), part * 4));
  ASSERT_TRUE(s.ok()) << s;
  auto r = client.Fetch(m.name, id, args);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->dtype, DType::kFp32);
  EXPECT_EQ(r->num_tokens, n);
  ASSERT_EQ(r->payload.size(), 2 * part * 4);
  const uint64_t layer_part = part / m.num_layers;
  uint64_t bad = 0, mismatched = 0;
  double worst = 0;
  for (uint32_t l = 0; l < m.num_layers; ++l) {
    for (uint32_t kv = 0; kv < 2; ++kv) {
      const float* tensor = (kv == 0 ? k : v).data() + l * layer_part;
      // Payload: per layer K then V, each [heads][n][dim].
      const uint8_t* payload = r->payload.data() + (2 * l + kv) * layer_part * 4;
      if (std::memcmp(tensor, payload, layer_part * 4) != 0) ++mismatched;
      for (uint32_t h = 0; h < m.num_kv_heads; ++h) {
        for (uint64_t t = 0; t < n; ++t) {
          const float* row = sent.Row(l, kv, h, t);
          const DType stored = m.layer_dtypes[l];
          const float scale =
              qmath::IsFp8DType(stored) ? sent.Fp8Scale(l, kv, h, t / m.block_tokens) : 0;
          for (uint32_t i = 0; i < m.head_dim; ++i) {
            const float y = tensor[(uint64_t{h} * n + t) * m.head_dim + i];
            const double err = std::fabs(double(y) - double(row[i]));
            const double bound = Bound(stored, m.input_dtype, row, m.head_dim, i, scale);
            if (bound > 0) worst = std::max(worst, err / bound);
            if (!std::isfinite(y) || !(err <= bound)) {
              if (++bad <= 5) {
                ADD_FAILURE() << m.name << " layer " << l << (kv ? " V" : " K") << " head " << h
                              << " token " << t << " element " << i << ": sent " << row[i]
                              << ", fetched " << y << ", bound " << bound;
              }
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(bad, 0u);
  EXPECT_EQ(mismatched, 0u) << "FetchTensors and Fetch disagree";
  std::cerr << "[quant] " << m.name << ": " << 2 * part << " elements within bounds, worst "
            << "error / bound " << worst << "\n";
}

Client::ModelStats StatsOf(Client& client, const std::string& model) {
  auto stats = client.GetStats(model);
  EXPECT_TRUE(stats.ok()) << stats.status();
  if (!stats.ok() || stats->size() != 1) return {};
  return (*stats)[0];
}

// What a refused append must leave as it was.
struct State {
  Client::SequenceInfo info;
  std::vector<uint8_t> content;
  uint64_t blocks_used = 0, blocks_free = 0, tokens_stored = 0, appends = 0;
};
State Capture(Client& client, const std::string& model, uint64_t id) {
  State s;
  auto info = client.GetSequence(model, id);
  EXPECT_TRUE(info.ok()) << info.status();
  if (info.ok()) s.info = *info;
  Client::FetchArgs args;
  args.dtype = DType::kFp32;
  auto r = client.Fetch(model, id, args);
  EXPECT_TRUE(r.ok()) << r.status();
  if (r.ok()) s.content = r->payload;
  const Client::ModelStats st = StatsOf(client, model);
  s.blocks_used = st.blocks_used;
  s.blocks_free = st.blocks_free;
  s.tokens_stored = st.tokens_stored;
  s.appends = st.appends;
  return s;
}
void ExpectSame(const State& a, const State& b) {
  EXPECT_EQ(a.info.length, b.info.length);
  EXPECT_EQ(a.info.layer_lengths, b.info.layer_lengths);
  EXPECT_EQ(a.info.num_blocks, b.info.num_blocks);
  EXPECT_TRUE(BytesEqual(a.content, b.content)) << "content changed";
  EXPECT_EQ(a.blocks_used, b.blocks_used);
  EXPECT_EQ(a.blocks_free, b.blocks_free);
  EXPECT_EQ(a.tokens_stored, b.tokens_stored);
  EXPECT_EQ(a.appends, b.appends);
}

class QuantTest : public KvbankdTest, public testing::WithParamInterface<DType> {};

TEST_P(QuantTest, Fp16InWithinBoundsOutCapacityAndNaNRefused) {
  const DType storage = GetParam();
  const uint64_t seed = 0x9e11 + uint64_t(storage);
  std::cerr << "[quant] storage " << DTypeName(storage) << " seed " << seed << "\n";
  ASSERT_NO_FATAL_FAILURE(StartServer({"--models=", "--max-pool-bytes=1GiB"}));
  std::unique_ptr<Client> client = NewClient();
  ASSERT_NE(client, nullptr);

  const ModelLayout m = Gqa(absl::StrCat("q-", DTypeName(storage)), storage);
  const ModelLayout plain = Gqa("plain-fp16", DType::kFp16);
  auto info = client->EnsureModel(m, kPoolBytes);
  ASSERT_TRUE(info.ok()) << info.status();
  auto plain_info = client->EnsureModel(plain, kPoolBytes);
  ASSERT_TRUE(plain_info.ok()) << plain_info.status();
  EXPECT_TRUE(info->layout == m);
  EXPECT_NE(info->fingerprint, plain_info->fingerprint);
  EXPECT_EQ(info->fingerprint, LayoutFingerprint(m));
  // Per layer K and V of 8 x 16 x 128 one-byte elements, plus int8's f32 scale and u8 zero point
  // per row (2 x 8 x 16 x 5) or fp8's f32 scale per head (2 x 8 x 4); fp16 is 2 x 8 x 16 x 128 x 2.
  const uint64_t want_block = storage == DType::kInt8 ? 4 * (32768 + 1280) : 4 * (32768 + 64);
  EXPECT_EQ(info->block_bytes, want_block);
  EXPECT_EQ(plain_info->block_bytes, 4u * 65536);
  // A default append travels as the input dtype: fp16 bytes per token whatever the storage.
  EXPECT_EQ(info->payload_bytes_per_token, plain_info->payload_bytes_per_token);
  EXPECT_EQ(info->payload_bytes_per_token, 4u * 2 * 8 * 128 * 2);

  // Capacity from the same pool bytes: as many blocks as fit, 16 tokens each.
  const Client::ModelStats q = StatsOf(*client, m.name), p = StatsOf(*client, plain.name);
  EXPECT_EQ(q.blocks_total, kPoolBytes / want_block);
  EXPECT_EQ(p.blocks_total, kPoolBytes / (4 * 65536));
  EXPECT_EQ(q.capacity_tokens, q.blocks_total * 16);
  EXPECT_EQ(p.capacity_tokens, p.blocks_total * 16);
  const double ratio = double(q.capacity_tokens) / double(p.capacity_tokens);
  // int8: 492 blocks against 256, 1.921875x; fp8: 511 against 256, 1.99609375x.
  EXPECT_DOUBLE_EQ(ratio, storage == DType::kInt8 ? 7872.0 / 4096 : 8176.0 / 4096);
  std::cerr << "[quant] " << m.name << ": capacity " << q.capacity_tokens << " tokens against "
            << p.capacity_tokens << " for fp16 in " << kPoolBytes << " pool bytes: " << ratio
            << "x\n";

  // Prefill: 100 tokens, 1.6 MiB of fp16, streamed in 1 MiB chunks; then decode steps.
  auto seq = client->CreateSequence(m.name, absl::ZeroDuration());
  ASSERT_TRUE(seq.ok()) << seq.status();
  const uint64_t id = seq->id;
  Sent sent(m);
  Random rng(seed);
  std::vector<uint8_t> k, v;
  sent.Add(100, rng, &k, &v);
  ASSERT_GT(k.size() + v.size(), 1 * kMiB);
  Client::AppendArgs args;
  args.num_tokens = 100;
  auto appended = client->AppendTensors(m.name, id, args, k, v);
  ASSERT_TRUE(appended.ok()) << appended.status();
  EXPECT_EQ(appended->length, 100u);
  EXPECT_EQ(appended->num_blocks, 7u);
  for (int step = 0; step < 3; ++step) {
    sent.Add(1, rng, &k, &v);
    args.num_tokens = 1;
    args.dtype = DType::kFp16;  // named explicitly this time: the input dtype
    appended = client->AppendTensors(m.name, id, args, k, v);
    ASSERT_TRUE(appended.ok()) << appended.status();
  }
  ASSERT_NO_FATAL_FAILURE(ExpectWithinBounds(*client, m, id, sent));
  {
    // Unspecified: out as the input dtype, finite.
    auto r = client->Fetch(m.name, id, {});
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->dtype, DType::kFp16);
    EXPECT_EQ(r->payload.size(), 103 * info->payload_bytes_per_token);
    for (size_t i = 0; i < r->payload.size() / 2; ++i) {
      ASSERT_FALSE(qmath::IsNonFinite(r->payload.data(), DType::kFp16, i)) << "element " << i;
    }
  }
  EXPECT_EQ(StatsOf(*client, m.name).blocks_used, 7u);

  // NaN in the second MiB (layer 3) and Inf at the very start: refused, nothing changed.
  const State before = Capture(*client, m.name, id);
  Sent poisoned = sent;
  poisoned.Add(90, rng, &k, &v);
  args.num_tokens = 90;
  args.dtype.reset();
  const uint64_t layer_bytes = uint64_t{8} * 90 * 128 * 2;
  struct Poison {
    std::vector<uint8_t>* tensor;
    uint64_t offset;
    uint16_t bits;
  };
  for (const Poison& x : {Poison{&v, 3 * layer_bytes + 5 * 128 * 2 + 2, 0x7e00},          // NaN
                          Poison{&k, 2, 0x7c00}, Poison{&v, layer_bytes - 2, 0xfc00}}) {  // +-Inf
    std::vector<uint8_t> bad = *x.tensor;
    bad[x.offset] = uint8_t(x.bits);
    bad[x.offset + 1] = uint8_t(x.bits >> 8);
    auto refused = x.tensor == &k ? client->AppendTensors(m.name, id, args, bad, v)
                                  : client->AppendTensors(m.name, id, args, k, bad);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
    EXPECT_TRUE(absl::StrContains(refused.status().message(), "NaN or Inf")) << refused.status();
    ExpectSame(before, Capture(*client, m.name, id));
  }
  // The clean payload still goes in.
  appended = client->AppendTensors(m.name, id, args, k, v);
  ASSERT_TRUE(appended.ok()) << appended.status();
  EXPECT_EQ(appended->length, 193u);
  ASSERT_NO_FATAL_FAILURE(ExpectWithinBounds(*client, m, id, poisoned));

  // A quantized dtype other than the storage one is refused, naming the storage format.
  Client::FetchArgs other;
  other.dtype = storage == DType::kInt8 ? DType::kFp8E4M3 : DType::kInt8;
  auto wrong = client->Fetch(m.name, id, other);
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument) << wrong.status();
  EXPECT_TRUE(absl::StrContains(wrong.status().message(), "storage format")) << wrong.status();
}

// The bytes an fp8 model stores must not depend on how gRPC cuts the append: a 1-layer MHA model
// (head_dim 48, fp32 input), 512 tokens sent in one message, in 2 KiB messages and in 1337-byte
// messages, rows 0-7 of each 16-token block 100x smaller than rows 8-15. The storage-format
// fetches (codes and scales) are byte for byte the same, and fetched as fp32 no element is
// clipped: each block is complete within the append, so its scale is the exact one. (Each scale
// used to follow the rows that had arrived with the first message holding the block, so rows
// 8-15 of up to half of the blocks came back clipped, with a relative error near 1.)
TEST_F(KvbankdTest, Fp8StoredBytesDoNotDependOnMessageBoundaries) {
  ASSERT_NO_FATAL_FAILURE(StartServer({"--models=", "--max-pool-bytes=1GiB"}));
  for (DType fp8 : {DType::kFp8E4M3, DType::kFp8E5M2}) {
    SCOPED_TRACE(DTypeName(fp8));
    ModelLayout m;
    m.name = absl::StrCat("mha-", DTypeName(fp8));
    m.num_layers = 1;
    m.num_q_heads = m.num_kv_heads = 4;
    m.head_dim = m.head_dim_v = 48;
    m.block_tokens = 16;
    m.kind = AttentionKind::kMha;
    m.input_dtype = DType::kFp32;
    m.layer_dtypes.assign(1, fp8);
    std::unique_ptr<Client> admin = NewClient();
    auto info = admin->EnsureModel(m, 16 * kMiB);
    ASSERT_TRUE(info.ok()) << info.status();

    constexpr uint64_t kTokens = 512;
    const uint64_t elems = uint64_t{2} * m.num_kv_heads * kTokens * m.head_dim;  // 768 KiB of fp32
    std::vector<float> values(elems);
    Random rng(0xf8b0 + uint64_t(fp8));
    std::cerr << "[quant] boundaries " << m.name << " seed " << 0xf8b0 + uint64_t(fp8) << "\n";
    for (uint64_t i = 0; i < elems; ++i) {
      const uint64_t token = (i / m.head_dim) % kTokens;  // payload: [kv][head][token][dim]
      const float u = float(rng.Next() >> 40) * 0x1p-23f - 1.0f;
      values[i] = u * (token % 16 < 8 ? 0.01f : 1.0f);
    }
    const auto* payload = reinterpret_cast<const uint8_t*>(values.data());
    std::vector<std::vector<uint8_t>> stored;
    for (uint64_t chunk : {uint64_t{2} * kMiB, uint64_t{2048}, uint64_t{1337}}) {
      SCOPED_TRACE(absl::StrCat(chunk, "-byte messages"));
      ClientOptions options;
      options.chunk_bytes = chunk;
      std::unique_ptr<Client> client = NewClient(options);
      auto seq = client->CreateSequence(m.name, absl::ZeroDuration());
      ASSERT_TRUE(seq.ok()) << seq.status();
      Client::AppendArgs args;
      args.num_tokens = kTokens;
      args.dtype = DType::kFp32;
      auto appended = client->Append(m.name, seq->id, args, {payload, elems * 4});
      ASSERT_TRUE(appended.ok()) << appended.status();
      Client::FetchArgs as_stored;
      as_stored.dtype = fp8;
      auto raw = client->Fetch(m.name, seq->id, as_stored);
      ASSERT_TRUE(raw.ok()) << raw.status();
      stored.push_back(raw->payload);
      Client::FetchArgs as_fp32;
      as_fp32.dtype = DType::kFp32;
      auto back = client->Fetch(m.name, seq->id, as_fp32);
      ASSERT_TRUE(back.ok()) << back.status();
      ASSERT_EQ(back->payload.size(), elems * 4);
      const auto* got = reinterpret_cast<const float*>(back->payload.data());
      // e4m3 keeps 3 mantissa bits (relative error <= 2^-4), e5m2 2 bits (<= 2^-3); the scale's
      // own rounding and subnormals add a term relative to the block's largest value.
      const double rel = fp8 == DType::kFp8E4M3 ? 0x1p-4 : 0x1p-3;
      uint64_t clipped = 0;
      for (uint64_t i = 0; i < elems; ++i) {
        const double err = std::fabs(double(got[i]) - double(values[i]));
        if (!(err <= rel * std::fabs(values[i]) +
                         1e-3 * (i / m.head_dim % kTokens % 16 < 8 ? 0.01 : 1.0))) {
          if (++clipped <= 3) {
            ADD_FAILURE() << "element " << i << ": sent " << values[i] << ", fetched " << got[i];
          }
        }
      }
      EXPECT_EQ(clipped, 0u);
    }
    ASSERT_EQ(stored.size(), 3u);
    EXPECT_TRUE(BytesEqual(stored[1], stored[0])) << "2 KiB messages stored other bytes";
    EXPECT_TRUE(BytesEqual(stored[2], stored[0])) << "1337-byte messages stored other bytes";
  }
}

INSTANTIATE_TEST_SUITE_P(Storage, QuantTest, testing::Values(DType::kInt8, DType::kFp8E4M3),
                         [](const testing::TestParamInfo<DType>& i) {
                           return std::string(DTypeName(i.param));
                         });

// A preset stored int8 with high_precision_layers 3: the first and last 3 layers keep the input
// dtype (bf16), the rest store int8; bf16 layers round-trip bit-exact, int8 ones within bounds.
class QuantPresetTest : public KvbankdTest {};

TEST_F(QuantPresetTest, HighPrecisionLayersKeepTheInputDType) {
  const uint64_t seed = 0x3a7;
  std::cerr << "[quant] preset seed " << seed << "\n";
  ASSERT_NO_FATAL_FAILURE(StartServer({"--models=", "--max-pool-bytes=1GiB"}));
  v1::ModelSpec spec;
  spec.set_name("llama-int8");
  spec.set_preset("llama-3.1-8b");
  spec.set_storage_dtype(v1::DTYPE_INT8);
  spec.set_high_precision_layers(3);
  spec.set_pool_bytes(32 * kMiB);
  v1::EnsureModelResponse resp;
  {
    auto stub = v1::KvBank::NewStub(
        grpc::CreateChannel(server_->target(), grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::EnsureModelRequest req;
    *req.mutable_spec() = spec;
    grpc::Status s = stub->EnsureModel(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  const v1::ModelSpec& got = resp.model().spec();
  EXPECT_EQ(got.input_dtype(), v1::DTYPE_BF16);
  ASSERT_EQ(got.layer_dtypes_size(), 32);
  for (int l = 0; l < 32; ++l) {
    EXPECT_EQ(got.layer_dtypes(l), l < 3 || l >= 29 ? v1::DTYPE_BF16 : v1::DTYPE_INT8)
        << "layer " << l;
  }
  // 6 bf16 layers of 2 x 8 x 16 x 128 x 2 bytes, 26 int8 ones of 32768 + 1280.
  EXPECT_EQ(resp.model().block_bytes(), 6u * 65536 + 26u * 34048);

  std::unique_ptr<Client> client = NewClient();
  auto info = client->GetModel("llama-int8");
  ASSERT_TRUE(info.ok()) << info.status();
  const ModelLayout& m = info->layout;
  ASSERT_EQ(m.layer_dtypes.size(), 32u);
  for (uint32_t l = 0; l < 32; ++l) {
    EXPECT_EQ(m.layer_dtypes[l], l < 3 || l >= 29 ? DType::kBf16 : DType::kInt8) << "layer " << l;
  }
  EXPECT_EQ(m.input_dtype, DType::kBf16);
  EXPECT_EQ(info->fingerprint, LayoutFingerprint(m));
  EXPECT_EQ(DefaultWireDType(m, 0, 32), DType::kBf16);

  // 24 tokens of bf16 in (3 MiB, three chunks), fp32 out.
  auto seq = client->CreateSequence(m.name, absl::ZeroDuration());
  ASSERT_TRUE(seq.ok()) << seq.status();
  Sent sent(m);
  Random rng(seed);
  std::vector<uint8_t> k, v;
  sent.Add(24, rng, &k, &v);
  Client::AppendArgs args;
  args.num_tokens = 24;
  auto appended = client->AppendTensors(m.name, seq->id, args, k, v);
  ASSERT_TRUE(appended.ok()) << appended.status();
  ASSERT_NO_FATAL_FAILURE(ExpectWithinBounds(*client, m, seq->id, sent));
  // The bf16 layers as bf16: the bytes sent.
  for (uint32_t l0 : {0u, 29u}) {
    Client::FetchArgs f;
    f.layer_begin = l0;
    f.layer_end = l0 + 3;
    const uint64_t bytes = uint64_t{3} * 8 * 24 * 128 * 2;
    std::vector<uint8_t> fk(bytes), fv(bytes);
    absl::Status s =
        client->FetchTensors(m.name, seq->id, f, absl::MakeSpan(fk), absl::MakeSpan(fv));
    ASSERT_TRUE(s.ok()) << s;
    const uint64_t at = uint64_t{l0} * 8 * 24 * 128 * 2;
    EXPECT_TRUE(std::equal(fk.begin(), fk.end(), k.begin() + at)) << "K of layers " << l0;
    EXPECT_TRUE(std::equal(fv.begin(), fv.end(), v.begin() + at)) << "V of layers " << l0;
  }
}

}  // namespace
}  // namespace kvbank::integ
