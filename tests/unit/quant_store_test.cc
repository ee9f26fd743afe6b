// Quantized storage in SequenceStore, element by element: int8, fp8_e4m3, fp8_e5m2 and a mixed
// model, fed fp32 / fp16 / bf16, GQA with odd sizes and MLA; every element fetched back is
// checked against the bound its scale implies (see quant_store_testing.h). Seeds fixed, printed.
#include "tests/unit/quant_store_testing.h"

namespace kvbank {
namespace {

using namespace quant_testing;  // NOLINT: the test support of this file

class QuantRoundTrip : public testing::TestWithParam<Case> {};

// A whole prompt then decode steps on one sequence; chunked appends (1, 7, 1000 bytes) on another.
TEST_P(QuantRoundTrip, EveryElementWithinItsBound) {
  const Case c = GetParam();
  QuantStore store(Layout(c.storage, c.input, c.mla));
  const uint32_t seed = SeedOf(c, 1);
  std::printf("seed %u\n", seed);

  const uint64_t a = store.NewSeq();
  Ref ra(store.layout());
  ASSERT_TRUE(store.Append(a, 23, ra.Add(23, Uniform(seed)), 0).ok());
  ASSERT_NO_FATAL_FAILURE(store.ExpectWithinBounds(a, ra));
  for (int step = 0; step < 10; ++step) {  // decode: one token per append
    const std::vector<uint8_t> p = ra.Add(1, Uniform(seed + 100 + step));
    ASSERT_TRUE(store.Append(a, 1, p, 0).ok()) << "decode step " << step;
  }
  ASSERT_NO_FATAL_FAILURE(store.ExpectWithinBounds(a, ra));

  const uint64_t b = store.NewSeq();
  Ref rb(store.layout());
  struct Step {
    uint64_t tokens;
    size_t chunk;
  };
  for (const Step& s : {Step{5, 1}, Step{9, 7}, Step{16, 1000}, Step{1, 7}, Step{3, 1}}) {
    SCOPED_TRACE(testing::Message() << s.tokens << " tokens in chunks of " << s.chunk);
    const std::vector<uint8_t> p = rb.Add(s.tokens, Uniform(seed + 7 * s.chunk + s.tokens));
    absl::Status st = store.Append(b, s.tokens, p, s.chunk);
    ASSERT_TRUE(st.ok()) << st;
    ASSERT_NO_FATAL_FAILURE(store.ExpectWithinBounds(b, rb));
  }
  EXPECT_EQ(store->CheckInvariants(), "");
}

// Constant, zero, huge (the fp16 maximum) and subnormal rows, side by side in the same blocks.
// The decode steps after the prompt put huge rows into fp8 blocks whose scale came from smaller
// ones: the block is rescaled, and nothing saturates.
TEST_P(QuantRoundTrip, SpecialRowsStayFiniteAndWithinBounds) {
  const Case c = GetParam();
  QuantStore store(Layout(c.storage, c.input, c.mla));
  const uint32_t seed = SeedOf(c, 2);
  std::printf("seed %u\n", seed);
  // The largest value every input dtype holds that fp16 holds too (bf16 rounds 65504 up).
  const float huge = c.input == DType::kBf16 ? 65280.0f : 65504.0f;
  // Subnormal in the input dtype: fp16 2^-24 steps; bf16 and fp32 below FLT_MIN.
  const float tiny = c.input == DType::kFp16 ? 0x1p-24f : 0x1p-130f;
  auto rng = std::make_shared<std::mt19937>(seed);
  const Ref::Gen gen = [&, rng](uint32_t l, uint32_t kv, uint32_t h, uint64_t t, uint32_t i) {
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    switch ((t + l + h + kv) % 6) {
      case 0:
        return 0.375f;  // constant row
      case 1:
        return 0.0f;  // zero row
      case 2:
        return i == 0 ? huge : (i == 1 ? -huge : u(*rng) * 100.0f);  // huge, both signs
      case 3:
        return tiny * float(int(i % 9) - 4);  // subnormal, both signs, zeros
      case 4:
        return -2.5f;  // negative constant row
      default:
        return u(*rng);
    }
  };
  const uint64_t id = store.NewSeq();
  Ref ref(store.layout());
  ASSERT_TRUE(store.Append(id, 16, ref.Add(16, gen), 0).ok());
  ASSERT_NO_FATAL_FAILURE(store.ExpectWithinBounds(id, ref));
  for (int step = 0; step < 4; ++step) {
    ASSERT_TRUE(store.Append(id, 1, ref.Add(1, gen), 0).ok());
  }
  ASSERT_NO_FATAL_FAILURE(store.ExpectWithinBounds(id, ref));
}

INSTANTIATE_TEST_SUITE_P(AllStorage, QuantRoundTrip, testing::ValuesIn(AllCases()), CaseName);

// Everything a refused append could disturb.

}  // namespace
}  // namespace kvbank
