// Tests of the capacity planner: the two published reference figures (exact, one decimal), MLA,
// batch, KV dtypes, capacity and kvbank's own bytes per token.
#include "kvbank/planner.h"

#include <cstdio>
#include <string>

#include "gtest/gtest.h"

namespace kvbank {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

std::string OneDecimal(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f", ToGb(bytes));
  return buf;
}

PlanInput Preset(const std::string& name) {
  PlanInput in;
  EXPECT_TRUE(PresetLayout(name, &in.layout)) << name;
  in.params = PresetParams(name);
  return in;
}

PlanResult Plan(const PlanInput& in) {
  PlanResult r;
  EXPECT_EQ(ComputePlan(in, &r), "");
  return r;
}

// Llama 3 8B, fp16 weights and KV, 8K context, batch 1: 14.9 + 1.0 + 2.4 = 18.3 GB.
TEST(PlannerTest, ReferenceLlama8bFp16At8k) {
  PlanInput in = Preset("llama-3.1-8b");
  in.context_tokens = 8192;
  const PlanResult r = Plan(in);
  EXPECT_EQ(OneDecimal(r.weight_bytes), "14.9");
  EXPECT_EQ(OneDecimal(r.kv_bytes), "1.0");
  EXPECT_EQ(OneDecimal(r.overhead_bytes), "2.4");
  EXPECT_EQ(OneDecimal(r.total_bytes), "18.3");
  // The exact values behind them: 16e9 B of weights, 2*32*8*128*8192*2 = 2^30 B of KV.
  EXPECT_DOUBLE_EQ(r.weight_bytes, 16e9);
  EXPECT_DOUBLE_EQ(r.kv_bytes, kGiB);
  EXPECT_DOUBLE_EQ(r.kv_bytes_per_token, 131072);
  EXPECT_FALSE(r.mla);
  EXPECT_EQ(r.kv_formula, "2*L*n_kv*d*S*b*batch = 2*32*8*128*8192*2*1");
}

// Same model, int4 weights, 32K context: 3.7 + 4.0 + 1.2 = 8.9 GB.
TEST(PlannerTest, ReferenceLlama8bInt4WeightsAt32k) {
  PlanInput in = Preset("llama-3.1-8b");
  in.weight_dtype = WeightDType::kInt4;
  in.context_tokens = 32768;
  const PlanResult r = Plan(in);
  EXPECT_EQ(OneDecimal(r.weight_bytes), "3.7");
  EXPECT_EQ(OneDecimal(r.kv_bytes), "4.0");
  EXPECT_EQ(OneDecimal(r.overhead_bytes), "1.2");
  EXPECT_EQ(OneDecimal(r.total_bytes), "8.9");
  EXPECT_DOUBLE_EQ(r.weight_bytes, 4e9);
}

TEST(PlannerTest, BatchScalesKvOnly) {
  PlanInput in = Preset("llama-3.1-8b");
  const PlanResult one = Plan(in);
  in.batch = 7;
  const PlanResult seven = Plan(in);
  EXPECT_DOUBLE_EQ(seven.kv_bytes, 7 * one.kv_bytes);
  EXPECT_DOUBLE_EQ(seven.weight_bytes, one.weight_bytes);
  EXPECT_DOUBLE_EQ(seven.overhead_bytes, 0.15 * (seven.weight_bytes + seven.kv_bytes));
  EXPECT_DOUBLE_EQ(seven.total_bytes, seven.weight_bytes + seven.kv_bytes + seven.overhead_bytes);
  EXPECT_EQ(seven.kv_formula, "2*L*n_kv*d*S*b*batch = 2*32*8*128*8192*2*7");
  EXPECT_DOUBLE_EQ(seven.kvbank_kv_bytes, 7 * one.kvbank_kv_bytes);
}

TEST(PlannerTest, KvDTypeSetsBytesPerElement) {
  PlanInput in = Preset("llama-3.1-8b");
  const double fp16 = Plan(in).kv_bytes;
  in.kv_dtype = DType::kBf16;
  EXPECT_DOUBLE_EQ(Plan(in).kv_bytes, fp16);
  in.kv_dtype = DType::kFp32;
  EXPECT_DOUBLE_EQ(Plan(in).kv_bytes, 2 * fp16);
  for (DType d : {DType::kInt8, DType::kFp8E4M3, DType::kFp8E5M2}) {
    in.kv_dtype = d;
    EXPECT_DOUBLE_EQ(Plan(in).kv_bytes, fp16 / 2) << DTypeName(d);
  }
}

TEST(PlannerTest, WeightDTypeBitsAndNames) {
  const std::pair<const char*, uint32_t> kWant[] = {{"fp32", 32}, {"fp16", 16}, {"bf16", 16},
                                                    {"int8", 8},  {"fp8", 8},   {"int4", 4}};
  for (const auto& [name, bits] : kWant) {
    WeightDType d = WeightDType::kFp32;
    ASSERT_TRUE(ParseWeightDType(name, &d)) << name;
    EXPECT_EQ(WeightDTypeBits(d), bits) << name;
    EXPECT_STREQ(WeightDTypeName(d), name);
  }
  WeightDType d = WeightDType::kInt4;
  EXPECT_FALSE(ParseWeightDType("int3", &d));
  EXPECT_EQ(d, WeightDType::kInt4);
}

// DeepSeek-V3 stores one 512 + 64 latent per token and layer: 61 * 576 * 2 B per token in fp16.
TEST(PlannerTest, MlaUsesOneLatentVectorPerTokenAndLayer) {
  PlanInput in = Preset("deepseek-v3");
  in.weight_dtype = WeightDType::kFp8;
  in.context_tokens = 32768;
  const PlanResult r = Plan(in);
  EXPECT_TRUE(r.mla);
  EXPECT_DOUBLE_EQ(r.kv_bytes_per_token, 61.0 * 576 * 2);
  EXPECT_DOUBLE_EQ(r.kv_bytes, 61.0 * 576 * 2 * 32768);
  EXPECT_EQ(r.kv_formula, "MLA: L*(kv_lora_rank+rope)*S*b*batch = 61*(512+64)*32768*2*1");
  EXPECT_EQ(OneDecimal(r.kv_bytes), "2.1");        // 2,302,672,896 B
  EXPECT_EQ(OneDecimal(r.weight_bytes), "624.9");  // 671e9 B
  EXPECT_FALSE(r.fits);                            // not on one 80 GiB GPU
  EXPECT_EQ(r.max_tokens, 0u);
  EXPECT_EQ(r.max_sequences, 0u);
  EXPECT_EQ(r.kvbank_max_sequences, 0u);
  // A GQA model of the same size would need 2*n_kv*d per layer: MLA is the smaller formula.
  PlanInput gqa = in;
  ASSERT_TRUE(PresetLayout("llama-3-70b", &gqa.layout));
  EXPECT_GT(Plan(gqa).kv_bytes_per_token, r.kv_bytes_per_token);
}

TEST(PlannerTest, DifferentKAndVWidthsUseBothInTheFormula) {
  PlanInput in;
  in.layout.num_layers = 2;
  in.layout.num_q_heads = 4;
  in.layout.num_kv_heads = 2;
  in.layout.head_dim = 192;
  in.layout.head_dim_v = 128;
  in.context_tokens = 100;
  const PlanResult r = Plan(in);
  EXPECT_DOUBLE_EQ(r.kv_bytes_per_token, 2.0 * 2 * (192 + 128) * 2);
  EXPECT_EQ(r.kv_formula, "L*n_kv*(d_k+d_v)*S*b*batch = 2*2*(192+128)*100*2*1");
  EXPECT_EQ(r.weight_bytes, 0);  // no parameter count given
}

// Capacity: KV room = GPU / 1.15 - weights; tokens and sequences are its floors.
TEST(PlannerTest, CapacityAfterWeightsAndOverhead) {
  PlanInput in = Preset("llama-3.1-8b");
  in.gpu_memory_bytes = uint64_t{80} << 30;
  const PlanResult r = Plan(in);
  const double room = 80 * kGiB / 1.15 - 16e9;
  EXPECT_DOUBLE_EQ(r.kv_budget_bytes, room);
  EXPECT_EQ(r.max_tokens, static_cast<uint64_t>(room / 131072));
  EXPECT_EQ(r.max_sequences, r.max_tokens / 8192);
  EXPECT_TRUE(r.fits);
  // Filling exactly that many sequences fits; one more does not.
  in.batch = r.max_sequences;
  EXPECT_TRUE(Plan(in).fits);
  in.batch = r.max_sequences + 1;
  EXPECT_FALSE(Plan(in).fits);
}

// kvbank's own layout: fp16 adds nothing, int8 adds a 4 B scale and a 1 B zero point per
// (K/V, head, token), fp8 a 4 B scale per (K/V, head) per 16-token block.
TEST(PlannerTest, KvbankBytesPerTokenIncludeScales) {
  PlanInput in = Preset("llama-3.1-8b");
  PlanResult r = Plan(in);
  EXPECT_EQ(r.block_tokens, 16u);
  EXPECT_EQ(r.block_bytes, 32u * 65536);
  EXPECT_DOUBLE_EQ(r.kvbank_bytes_per_token, r.kv_bytes_per_token);
  EXPECT_EQ(r.kvbank_blocks_per_sequence, 512u);
  EXPECT_DOUBLE_EQ(r.kvbank_kv_bytes, r.kv_bytes);

  in.kv_dtype = DType::kInt8;
  r = Plan(in);
  EXPECT_DOUBLE_EQ(r.kv_bytes_per_token, 65536);
  EXPECT_DOUBLE_EQ(r.kvbank_bytes_per_token, 32 * (2048 + 2 * 8 * 5));
  EXPECT_GT(r.kvbank_kv_bytes, r.kv_bytes);

  in.kv_dtype = DType::kFp8E4M3;
  r = Plan(in);
  EXPECT_DOUBLE_EQ(r.kvbank_bytes_per_token, 32 * (2048 + 2 * 8 * 4 / 16.0));

  // A partial last block still takes a whole block.
  in.kv_dtype = DType::kFp16;
  in.context_tokens = 8193;
  r = Plan(in);
  EXPECT_EQ(r.kvbank_blocks_per_sequence, 513u);
  EXPECT_DOUBLE_EQ(r.kvbank_kv_bytes, 513.0 * 32 * 65536);
}

TEST(PlannerTest, PresetParamsAreKnown) {
  for (const std::string& n : PresetNames()) EXPECT_GT(PresetParams(n), 1e9) << n;
  EXPECT_EQ(PresetParams("llama-3.1-8b"), 8.0e9);
  EXPECT_EQ(PresetParams("deepseek-v3"), 671e9);
  EXPECT_EQ(PresetParams("gpt-5"), 0);
}

TEST(PlannerTest, ParseMemorySize) {
  uint64_t b = 0;
  EXPECT_TRUE(ParseMemorySize("80GiB", &b));
  EXPECT_EQ(b, uint64_t{80} << 30);
  EXPECT_TRUE(ParseMemorySize("141GB", &b));
  EXPECT_EQ(b, 141'000'000'000u);
  EXPECT_TRUE(ParseMemorySize("24", &b));
  EXPECT_EQ(b, uint64_t{24} << 30);
  EXPECT_TRUE(ParseMemorySize("0.5tib", &b));
  EXPECT_EQ(b, uint64_t{1} << 39);
  EXPECT_TRUE(ParseMemorySize("512MiB", &b));
  EXPECT_EQ(b, uint64_t{512} << 20);
  b = 7;
  for (const char* bad : {"", "GB", "-1GB", "0", "80 GiB", "80XB", "1e30GB", "nan"}) {
    EXPECT_FALSE(ParseMemorySize(bad, &b)) << bad;
  }
  EXPECT_EQ(b, 7u);
}

TEST(PlannerTest, BadInputNamesTheField) {
  PlanInput in = Preset("llama-3.1-8b");
  PlanResult r;
  in.context_tokens = 0;
  EXPECT_NE(ComputePlan(in, &r).find("context_tokens"), std::string::npos);
  in = Preset("llama-3.1-8b");
  in.batch = 0;
  EXPECT_NE(ComputePlan(in, &r).find("batch"), std::string::npos);
  in = Preset("llama-3.1-8b");
  in.params = -1;
  EXPECT_NE(ComputePlan(in, &r).find("params"), std::string::npos);
  in = Preset("llama-3.1-8b");
  in.layout.num_kv_heads = 0;
  EXPECT_NE(ComputePlan(in, &r).find("num_kv_heads"), std::string::npos);
  in = Preset("llama-3.1-8b");
  in.gpu_memory_bytes = 0;
  EXPECT_NE(ComputePlan(in, &r).find("gpu_memory_bytes"), std::string::npos);
}

}  // namespace
}  // namespace kvbank
