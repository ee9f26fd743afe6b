// The fixtures the store tests share, in tests/unit and tests/gpu: small GQA and MLA layouts, spec
// builders, a SequenceStore over a pool on a given memory, fp16 and fp32 payloads from a fixed
// seed, and a fetch read back to host bytes. Which memory the tests in tests/unit run on is
// tests/unit/test_memory.h's job (testenv::CreateTestStore); these take the memory as an argument,
// so the GPU tests can put a store on cuda:0 and another on host-staged memory side by side.
#ifndef KVBANK_TESTS_UNIT_STORE_TESTING_H_
#define KVBANK_TESTS_UNIT_STORE_TESTING_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvbank/layout.h"
#include "server/core/block_pool.h"
#include "server/core/pool_memory.h"
#include "server/core/sequence_store.h"

namespace kvbank::store_testing {

// A GQA model: `layers` layers of `kv_heads` KV heads (two query heads each), K and V rows of
// `head_dim` elements, `block_tokens` tokens a block, every layer stored as `stored`, payloads in
// `input` unless a spec says otherwise.
ModelLayout GqaLayout(std::string name, uint32_t layers, uint32_t kv_heads, uint32_t head_dim,
                      uint32_t block_tokens, DType stored, DType input = DType::kFp16);

// An MLA model: `layers` layers of one latent head of `kv_lora_rank` + `rope_dim` elements (K; V
// is the latent part), four query heads, `block_tokens` tokens a block, stored as `stored`,
// payloads in `input`.
ModelLayout MlaLayout(std::string name, uint32_t layers, uint32_t kv_lora_rank, uint32_t rope_dim,
                      uint32_t block_tokens, DType stored, DType input = DType::kFp16);

// Spec builders in field order (aggregate init would leave fields unnamed).
AppendSpec MakeAppend(uint64_t id, uint32_t l0, std::optional<uint32_t> l1, uint64_t n,
                      std::optional<DType> dtype = std::nullopt, std::vector<uint32_t> ids = {});
FetchSpec MakeFetch(uint64_t id, uint64_t t0 = 0, std::optional<uint64_t> t1 = std::nullopt,
                    uint32_t l0 = 0, std::optional<uint32_t> l1 = std::nullopt,
                    std::optional<DType> dtype = std::nullopt);

// A SequenceStore of `m` over a pool of `blocks` blocks on `device`; the pool's error if it cannot
// be made.
absl::StatusOr<std::unique_ptr<SequenceStore>> CreateStore(const ModelLayout& m, uint64_t blocks,
                                                           const DeviceSpec& device,
                                                           PoolOptions pool = {},
                                                           StoreOptions store = {});

// A new sequence of the default tenant with `lease`; its id, or 0 after a test failure.
uint64_t NewSequence(SequenceStore& store,
                     std::optional<absl::Duration> lease = absl::ZeroDuration());

// `bytes` bytes of fp16 values drawn from N(0, 1) by std::mt19937_64 seeded with `seed` (an odd
// last byte stays 0).
std::vector<uint8_t> RandomFp16(uint64_t bytes, uint64_t seed);

// `bytes` bytes of fp32 values drawn uniformly from [-2, 2) by std::mt19937 seeded with `seed` (a
// last partial value stays 0).
std::vector<uint8_t> RandomFp32(uint64_t bytes, uint32_t seed);

// The bytes of an fp16 payload of `tokens` tokens of every layer of GQA model `m`.
uint64_t Fp16PayloadBytes(const ModelLayout& m, uint64_t tokens);

// Everything `reader` yields, read in one piece.
absl::StatusOr<std::vector<uint8_t>> ReadAll(FetchReader& reader);

// Everything `spec` selects, read in one piece into host memory: BeginFetch's or Read's error.
absl::StatusOr<std::vector<uint8_t>> FetchToHost(SequenceStore& store, const FetchSpec& spec);

// The bytes of `r`; none, after a non-fatal test failure naming the error, when it holds one.
std::vector<uint8_t> ExpectBytes(absl::StatusOr<std::vector<uint8_t>> r);

}  // namespace kvbank::store_testing

#endif  // KVBANK_TESTS_UNIT_STORE_TESTING_H_
