// ModelRegistry: idempotent Ensure, conflicts naming the differing field, the pool budget,
// unbuilt quantized storage, lookups, lease expiry across models, and dropping models.
#include "server/core/model_registry.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "kvbank/layout.h"

namespace kvbank {
namespace {

using absl::StatusCode;

constexpr uint64_t kMiB = uint64_t{1} << 20;

ModelConfig Config(const std::string& name, uint64_t pool_bytes = kMiB) {
  ModelConfig c;
  c.layout.name = name;
  c.layout.num_layers = 4;
  c.layout.num_q_heads = 8;
  c.layout.num_kv_heads = 2;
  c.layout.head_dim = c.layout.head_dim_v = 16;
  c.layout.block_tokens = 16;
  c.layout.layer_dtypes.assign(4, DType::kFp16);
  c.pool_bytes = pool_bytes;
  c.store.default_lease = absl::ZeroDuration();
  return c;
}

TEST(ModelRegistryTest, EnsureIsIdempotentForTheSameLayout) {
  ModelRegistry reg(8 * kMiB);
  auto first = reg.Ensure(Config("m"));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_TRUE(first->created);
  ASSERT_NE(first->model, nullptr);
  const uint64_t used = reg.pool_bytes_used();
  EXPECT_GT(used, 0u);
  EXPECT_LE(used, kMiB);
  EXPECT_EQ(used, first->model->pool().pool_bytes());

  auto again = reg.Ensure(Config("m", 2 * kMiB));  // the pool size is not part of the layout
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_FALSE(again->created);
  EXPECT_EQ(again->model, first->model) << "a second Ensure made a second store";
  EXPECT_EQ(reg.pool_bytes_used(), used) << "a second Ensure charged the budget";

  auto got = reg.Get("m");
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(*got, first->model);
}

TEST(ModelRegistryTest, DifferentLayoutUnderTheSameNameNamesTheField) {
  ModelRegistry reg(8 * kMiB);
  ASSERT_TRUE(reg.Ensure(Config("m")).ok());
  struct Case {
    void (*mutate)(ModelLayout&);
    const char* field;
  };
  const Case cases[] = {
      {[](ModelLayout& m) { m.head_dim = m.head_dim_v = 32; }, "head_dim"},
      {[](ModelLayout& m) { m.block_tokens = 8; }, "block_tokens"},
      {[](ModelLayout& m) { m.num_kv_heads = 4; }, "num_kv_heads"},
      {[](ModelLayout& m) { m.input_dtype = DType::kBf16; }, "input_dtype"},
      {[](ModelLayout& m) { m.layer_dtypes[2] = DType::kBf16; }, "layer 2"},
      {[](ModelLayout& m) {
         m.num_layers = 5;
         m.layer_dtypes.assign(5, DType::kFp16);
       },
       "num_layers"},
  };
  for (const Case& c : cases) {
    ModelConfig cfg = Config("m");
    c.mutate(cfg.layout);
    ASSERT_EQ(ValidateLayout(cfg.layout), "") << c.field;
    auto r = reg.Ensure(cfg);
    ASSERT_EQ(r.status().code(), StatusCode::kAlreadyExists) << c.field << ": " << r.status();
    EXPECT_NE(r.status().message().find(c.field), std::string::npos) << r.status();
    EXPECT_NE(r.status().message().find("'m'"), std::string::npos) << r.status();
  }
  EXPECT_EQ(reg.List().size(), 1u);
}

TEST(ModelRegistryTest, PoolBudgetIsEnforced) {
  ModelRegistry reg(3 * kMiB);
  auto too_big = reg.Ensure(Config("big", 4 * kMiB));
  EXPECT_EQ(too_big.status().code(), StatusCode::kResourceExhausted) << too_big.status();
  EXPECT_NE(too_big.status().message().find("pool_bytes"), std::string::npos);
  EXPECT_EQ(reg.pool_bytes_used(), 0u);
  ASSERT_TRUE(reg.Ensure(Config("a", 2 * kMiB)).ok());
  auto over = reg.Ensure(Config("b", 2 * kMiB));
  EXPECT_EQ(over.status().code(), StatusCode::kResourceExhausted) << over.status();
  EXPECT_EQ(reg.Get("b").status().code(), StatusCode::kNotFound) << "a refused model registered";
  ASSERT_TRUE(reg.Ensure(Config("c", kMiB)).ok());
  EXPECT_LE(reg.pool_bytes_used(), 3 * kMiB);
  EXPECT_EQ(reg.List().size(), 2u);
}

TEST(ModelRegistryTest, QuantizedStorageRegistersWithSmallerBlocks) {
  ModelRegistry reg(8 * kMiB);
  const uint64_t fp16_block = ComputeBlockLayout(Config("plain").layout).block_bytes;
  for (DType d : {DType::kInt8, DType::kFp8E4M3, DType::kFp8E5M2}) {
    ModelConfig cfg = Config(std::string("q-") + DTypeName(d));
    for (DType& l : cfg.layout.layer_dtypes) l = d;
    auto r = reg.Ensure(cfg);
    ASSERT_TRUE(r.ok()) << r.status();
    // One byte per element instead of two, plus the scales: per layer, K and V of 2 heads x 16
    // tokens x 16 dims; int8 adds an f32 scale and a u8 zero point per row, fp8 an f32 per head.
    const uint64_t data = 2 * 2 * 16 * 16;
    const uint64_t scales = d == DType::kInt8 ? 2 * 2 * 16 * (4 + 1) : 2 * 2 * 4;
    EXPECT_EQ(r->model->pool().layout().block_bytes, 4 * (data + scales)) << DTypeName(d);
    EXPECT_LT(r->model->pool().layout().block_bytes, fp16_block) << DTypeName(d);
  }
  EXPECT_EQ(reg.List().size(), 3u);
}

TEST(ModelRegistryTest, InvalidConfigsAreInvalidArgument) {
  ModelRegistry reg(8 * kMiB);
  ModelConfig bad = Config("bad");
  bad.layout.num_q_heads = 3;
  auto r = reg.Ensure(bad);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("num_q_heads"), std::string::npos) << r.status();
  EXPECT_EQ(reg.Ensure(Config("")).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(reg.Ensure(Config(std::string(129, 'x'))).status().code(),
            StatusCode::kInvalidArgument);
  auto tiny = reg.Ensure(Config("tiny", 100));  // holds no block
  EXPECT_EQ(tiny.status().code(), StatusCode::kInvalidArgument) << tiny.status();
  EXPECT_NE(tiny.status().message().find("'tiny'"), std::string::npos) << tiny.status();
  EXPECT_EQ(reg.pool_bytes_used(), 0u);
  EXPECT_TRUE(reg.List().empty());
}

TEST(ModelRegistryTest, GetListAndExpire) {
  ModelRegistry reg(8 * kMiB);
  auto missing = reg.Get("nope");
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("nope"), std::string::npos) << missing.status();

  absl::Time now = absl::FromUnixSeconds(1000);
  for (const char* name : {"zeta", "alpha", "mid"}) {
    ModelConfig cfg = Config(name);
    cfg.store.clock = [&now] { return now; };
    ASSERT_TRUE(reg.Ensure(cfg).ok());
  }
  const auto list = reg.List();
  ASSERT_EQ(list.size(), 3u);
  EXPECT_EQ(list[0]->layout().name, "alpha");
  EXPECT_EQ(list[1]->layout().name, "mid");
  EXPECT_EQ(list[2]->layout().name, "zeta");

  for (const auto& m : list) {
    ASSERT_TRUE(m->Create(WithLease(absl::Seconds(5))).ok());
    ASSERT_TRUE(m->Create(WithLease(absl::ZeroDuration())).ok());
  }
  EXPECT_EQ(reg.ExpireLeases(now + absl::Seconds(4)), 0u);
  EXPECT_EQ(reg.ExpireLeases(now + absl::Seconds(5)), 3u);
  for (const auto& m : list) EXPECT_EQ(m->Stats().sequences, 1u);
}

// Drop: the name goes at once; the memory (and its share of the budget) when the last holder of
// the store lets go.
TEST(ModelRegistryTest, DropReleasesTheBudgetWhenTheLastHolderLetsGo) {
  ModelRegistry reg(2 * kMiB);
  ASSERT_TRUE(reg.Ensure(Config("a", 2 * kMiB)).ok());
  const uint64_t a_bytes = reg.pool_bytes_used();
  ASSERT_GT(a_bytes, kMiB);
  EXPECT_EQ(reg.Ensure(Config("b", 2 * kMiB)).status().code(), StatusCode::kResourceExhausted);

  // A call in flight holds the store (and a sequence in it) across the drop.
  auto held = reg.Get("a");
  ASSERT_TRUE(held.ok());
  auto seq = (*held)->Create(WithLease(absl::ZeroDuration()));
  ASSERT_TRUE(seq.ok()) << seq.status();
  ASSERT_TRUE(reg.Drop("a").ok());
  EXPECT_EQ(reg.Get("a").status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(reg.List().empty());
  EXPECT_EQ(reg.ExpireLeases(absl::InfiniteFuture()), 0u);
  const absl::Status again = reg.Drop("a");
  EXPECT_EQ(again.code(), StatusCode::kNotFound) << again;
  EXPECT_NE(again.message().find("'a'"), std::string::npos) << again;
  // Still in use: its bytes are still taken, so a model that needs them must wait.
  EXPECT_EQ(reg.pool_bytes_used(), a_bytes);
  // Its sequences went with it, for a holder too (the drop's promise: a model's sequences go at
  // once), and nothing new starts in it.
  auto gone = (*held)->Get(seq->id);
  EXPECT_EQ(gone.status().code(), StatusCode::kFailedPrecondition) << gone.status();
  EXPECT_NE(gone.status().message().find("model 'a' was dropped"), std::string::npos)
      << gone.status();
  EXPECT_EQ((*held)->Create(WithLease(absl::ZeroDuration())).status().code(),
            StatusCode::kFailedPrecondition);
  EXPECT_EQ(reg.Ensure(Config("b", 2 * kMiB)).status().code(), StatusCode::kResourceExhausted);

  held->reset();
  EXPECT_EQ(reg.pool_bytes_used(), 0u);
  auto b = reg.Ensure(Config("b", 2 * kMiB));
  ASSERT_TRUE(b.ok()) << b.status();
  // The name can be registered again: a new, empty model.
  ASSERT_TRUE(reg.Drop("b").ok());
  b->model.reset();  // the last holder
  auto a2 = reg.Ensure(Config("a", kMiB));
  ASSERT_TRUE(a2.ok()) << a2.status();
  EXPECT_TRUE(a2->created);
  EXPECT_EQ(a2->model->Stats().sequences, 0u);
  EXPECT_EQ(reg.Drop("unknown").code(), StatusCode::kNotFound);
}

// A store may outlive its registry; releasing it then must not touch the registry.
TEST(ModelRegistryTest, StoreOutlivesTheRegistry) {
  std::shared_ptr<SequenceStore> held;
  {
    ModelRegistry reg(2 * kMiB);
    auto m = reg.Ensure(Config("a"));
    ASSERT_TRUE(m.ok()) << m.status();
    held = m->model;
  }
  EXPECT_TRUE(held->Create(WithLease(absl::ZeroDuration())).ok());
  held.reset();
}

}  // namespace
}  // namespace kvbank
