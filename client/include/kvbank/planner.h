// kvbank capacity planner: how much GPU memory a model, a context length and a batch need, and how
// many tokens and sequences fit in a given GPU.
//
// The "plan" figures follow the usual back-of-the-envelope formula for LLM serving:
//   weights  = parameters x bytes per weight (int4: half a byte)
//   KV cache = 2 * L * n_kv * d * S * b * batch       (MHA, GQA, MQA: a K and a V row per head)
//            = L * (kv_lora_rank + rope_dim) * S * b * batch    (MLA: one latent vector per token)
//   overhead = 15% of (weights + KV)   (activations, CUDA context, fragmentation)
//   total    = weights + KV + overhead
// where L = layers, n_kv = KV heads, d = head_dim, S = context tokens and b = bytes per KV element
// (fp32 4, fp16/bf16 2, int8/fp8 1, scales ignored). "GB" is bytes / 1024^3 throughout, as in the
// figures this planner reproduces.
//
// Separately it reports what kvbank itself stores: ComputeBlockLayout's block bytes per token,
// which include int8 scales and zero points, fp8 scales and part alignment.
//
// Dependency-free (standard library and kvbank/layout.h only). Every function is pure and may be
// called from any thread.
#ifndef KVBANK_PLANNER_H_
#define KVBANK_PLANNER_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "kvbank/layout.h"

namespace kvbank {

// Weight storage types. int4 packs two weights per byte.
enum class WeightDType : uint8_t { kFp32, kFp16, kBf16, kInt8, kFp8, kInt4 };

const char* WeightDTypeName(WeightDType d);
// Accepts fp32, fp16, bf16, int8, fp8, int4. Returns false (and leaves *out alone) otherwise.
bool ParseWeightDType(std::string_view s, WeightDType* out);
// Bits per weight: 32, 16, 16, 8, 8, 4.
uint32_t WeightDTypeBits(WeightDType d);

// Approximate parameter count of a preset (see PresetNames()); 0 for an unknown name.
double PresetParams(std::string_view preset);

// Parses a memory size: a number with an optional unit. Decimal units B, KB, MB, GB, TB (10^3
// steps) and binary units KiB, MiB, GiB, TiB (2^10 steps), case-insensitive; a bare number is in
// GiB, the unit the planner prints as "GB". "80GiB" -> 80 * 2^30, "141GB" -> 141e9. Returns false
// on anything else, on a non-positive size or one above 2^60 bytes.
bool ParseMemorySize(std::string_view s, uint64_t* bytes);

// bytes / 1024^3, the planner's "GB".
constexpr double ToGb(double bytes) { return bytes / (1024.0 * 1024.0 * 1024.0); }

struct PlanInput {
  // The KV shape: num_layers, num_kv_heads, head_dim, head_dim_v, kind, kv_lora_rank, rope_dim,
  // block_tokens and num_q_heads are read; layer_dtypes is ignored (every layer stores kv_dtype).
  ModelLayout layout;
  double params = 0;  // model parameters (not billions); 0 = weights not counted
  WeightDType weight_dtype = WeightDType::kFp16;
  DType kv_dtype = DType::kFp16;
  uint64_t context_tokens = 8192;           // S, tokens per sequence
  uint64_t batch = 1;                       // sequences held at once
  uint64_t gpu_memory_bytes = 80ull << 30;  // what the capacity figures fit into
  double overhead_fraction = 0.15;          // overhead = fraction x (weights + KV)
};

struct PlanResult {
  bool mla = false;
  std::string kv_formula;  // the formula used, e.g. "2*L*n_kv*d*S*b*batch = 2*32*8*128*8192*2*1"

  // The plan (all in bytes; GB = ToGb(bytes)).
  double kv_bytes_per_token = 0;  // all layers, formula above with S = batch = 1
  double weight_bytes = 0;
  double kv_bytes = 0;
  double overhead_bytes = 0;
  double total_bytes = 0;
  bool fits = false;  // total_bytes <= gpu_memory_bytes

  // Capacity: the largest KV such that weights + KV + overhead (same fraction) fits the GPU,
  // i.e. kv_budget = gpu / (1 + overhead_fraction) - weights, floored at 0.
  double kv_budget_bytes = 0;
  uint64_t max_tokens = 0;     // floor(kv_budget / kv_bytes_per_token)
  uint64_t max_sequences = 0;  // floor(max_tokens / context_tokens)

  // kvbank's own layout for kv_dtype (ComputeBlockLayout), scales and alignment included.
  uint32_t block_tokens = 0;
  uint64_t block_bytes = 0;
  double kvbank_bytes_per_token = 0;        // block_bytes / block_tokens
  uint64_t kvbank_blocks_per_sequence = 0;  // ceil(context / block_tokens)
  double kvbank_kv_bytes = 0;               // batch x blocks per sequence x block_bytes
  uint64_t kvbank_max_sequences = 0;  // floor(kv_budget / (blocks per sequence x block_bytes))
};

// Computes the plan. Returns an empty string on success, else a message naming the bad field (the
// layout as ValidateLayout words it, context_tokens, batch, params, gpu_memory_bytes,
// overhead_fraction); *out is then unspecified.
std::string ComputePlan(const PlanInput& in, PlanResult* out);

}  // namespace kvbank

#endif  // KVBANK_PLANNER_H_
