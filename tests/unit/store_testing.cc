#include "tests/unit/store_testing.h"

#include <cstring>
#include <random>
#include <utility>

#include "gtest/gtest.h"
#include "kernels/quant_math.h"

namespace kvbank::store_testing {

ModelLayout GqaLayout(std::string name, uint32_t layers, uint32_t kv_heads, uint32_t head_dim,
                      uint32_t block_tokens, DType stored, DType input) {
  ModelLayout m;
  m.name = std::move(name);
  m.kind = AttentionKind::kGqa;
  m.num_layers = layers;
  m.num_q_heads = 2 * kv_heads;
  m.num_kv_heads = kv_heads;
  m.head_dim = m.head_dim_v = head_dim;
  m.block_tokens = block_tokens;
  m.input_dtype = input;
  m.layer_dtypes.assign(layers, stored);
  return m;
}

ModelLayout MlaLayout(std::string name, uint32_t layers, uint32_t kv_lora_rank, uint32_t rope_dim,
                      uint32_t block_tokens, DType stored, DType input) {
  ModelLayout m;
  m.name = std::move(name);
  m.kind = AttentionKind::kMla;
  m.num_layers = layers;
  m.num_q_heads = 4;
  m.num_kv_heads = 1;
  m.kv_lora_rank = kv_lora_rank;
  m.rope_dim = rope_dim;
  m.head_dim = kv_lora_rank + rope_dim;
  m.head_dim_v = kv_lora_rank;
  m.block_tokens = block_tokens;
  m.input_dtype = input;
  m.layer_dtypes.assign(layers, stored);
  return m;
}

AppendSpec MakeAppend(uint64_t id, uint32_t l0, std::optional<uint32_t> l1, uint64_t n,
                      std::optional<DType> dtype, std::vector<uint32_t> ids) {
  AppendSpec s;
  s.sequence_id = id;
  s.layer_begin = l0;
  s.layer_end = l1;
  s.num_tokens = n;
  s.dtype = dtype;
  s.token_ids = std::move(ids);
  return s;
}

FetchSpec MakeFetch(uint64_t id, uint64_t t0, std::optional<uint64_t> t1, uint32_t l0,
                    std::optional<uint32_t> l1, std::optional<DType> dtype) {
  FetchSpec s;
  s.sequence_id = id;
  s.token_begin = t0;
  s.token_end = t1;
  s.layer_begin = l0;
  s.layer_end = l1;
  s.dtype = dtype;
  return s;
}

absl::StatusOr<std::unique_ptr<SequenceStore>> CreateStore(const ModelLayout& m, uint64_t blocks,
                                                           const DeviceSpec& device,
                                                           PoolOptions pool, StoreOptions store) {
  const BlockLayout b = ComputeBlockLayout(m);
  auto p = BlockPool::Create(b, blocks * b.block_bytes, device, std::move(pool));
  if (!p.ok()) return p.status();
  return std::make_unique<SequenceStore>(m, *std::move(p), std::move(store));
}

uint64_t NewSequence(SequenceStore& store, std::optional<absl::Duration> lease) {
  auto s = store.Create(WithLease(lease));
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? s->id : 0;
}

std::vector<uint8_t> RandomFp16(uint64_t bytes, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<uint8_t> out(bytes);
  for (uint64_t i = 0; i + 1 < bytes; i += 2) {
    const uint16_t h = kernels::qmath::FloatToHalf(dist(rng), true);
    std::memcpy(out.data() + i, &h, 2);
  }
  return out;
}

std::vector<uint8_t> RandomFp32(uint64_t bytes, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  std::vector<uint8_t> out(bytes);
  for (uint64_t i = 0; i + 4 <= bytes; i += 4) {
    const float x = u(rng);
    std::memcpy(out.data() + i, &x, 4);
  }
  return out;
}

uint64_t Fp16PayloadBytes(const ModelLayout& m, uint64_t tokens) {
  return tokens * m.num_layers * m.num_kv_heads * (m.head_dim + m.head_dim_v) * 2;
}

absl::StatusOr<std::vector<uint8_t>> ReadAll(FetchReader& reader) {
  std::vector<uint8_t> out(reader.payload_bytes());
  if (absl::Status s = reader.Read(0, absl::MakeSpan(out)); !s.ok()) return s;
  return out;
}

absl::StatusOr<std::vector<uint8_t>> FetchToHost(SequenceStore& store, const FetchSpec& spec) {
  auto r = store.BeginFetch(spec);
  if (!r.ok()) return r.status();
  return ReadAll(**r);
}

std::vector<uint8_t> ExpectBytes(absl::StatusOr<std::vector<uint8_t>> r) {
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *std::move(r) : std::vector<uint8_t>();
}

}  // namespace kvbank::store_testing
