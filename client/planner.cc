#include "kvbank/planner.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <sstream>
#include <utility>

namespace kvbank {

namespace {
constexpr WeightDType kAllWeightDTypes[] = {WeightDType::kFp32, WeightDType::kFp16,
                                            WeightDType::kBf16, WeightDType::kInt8,
                                            WeightDType::kFp8,  WeightDType::kInt4};
// Bounds that keep every figure finite and every count inside uint64_t.
constexpr uint64_t kMaxContext = uint64_t{1} << 32;
constexpr uint64_t kMaxBatch = uint64_t{1} << 24;
constexpr double kMaxParams = 1e15;
constexpr uint64_t kMaxMemory = uint64_t{1} << 60;
}  // namespace

const char* WeightDTypeName(WeightDType d) {
  switch (d) {
    case WeightDType::kFp32:
      return "fp32";
    case WeightDType::kFp16:
      return "fp16";
    case WeightDType::kBf16:
      return "bf16";
    case WeightDType::kInt8:
      return "int8";
    case WeightDType::kFp8:
      return "fp8";
    case WeightDType::kInt4:
      return "int4";
  }
  return "unknown";
}

bool ParseWeightDType(std::string_view s, WeightDType* out) {
  for (WeightDType d : kAllWeightDTypes) {
    if (s == WeightDTypeName(d)) {
      *out = d;
      return true;
    }
  }
  return false;
}

uint32_t WeightDTypeBits(WeightDType d) {
  switch (d) {
    case WeightDType::kFp32:
      return 32;
    case WeightDType::kFp16:
    case WeightDType::kBf16:
      return 16;
    case WeightDType::kInt8:
    case WeightDType::kFp8:
      return 8;
    case WeightDType::kInt4:
      return 4;
  }
  return 0;
}

double PresetParams(std::string_view preset) {
  // Approximate public parameter counts (model cards / papers), rounded as commonly quoted:
  // Llama 3.1 8B ~8.0B, Llama 3 70B ~70.6B, Qwen2.5-7B ~7.6B, Mistral 7B v0.3 ~7.2B,
  // Gemma 2 9B ~9.2B, DeepSeek-V3 671B total (37B active per token; all 671B are resident).
  if (preset == "llama-3.1-8b") return 8.0e9;
  if (preset == "llama-3-70b") return 70.6e9;
  if (preset == "qwen2.5-7b") return 7.6e9;
  if (preset == "mistral-7b-v0.3") return 7.2e9;
  if (preset == "gemma-2-9b") return 9.2e9;
  if (preset == "deepseek-v3") return 671e9;
  return 0;
}

bool ParseMemorySize(std::string_view s, uint64_t* bytes) {
  const std::string str(s);
  if (str.empty() || !(std::isdigit(static_cast<unsigned char>(str[0])) || str[0] == '.')) {
    return false;
  }
  char* end = nullptr;
  const double value = std::strtod(str.c_str(), &end);
  std::string unit(end);
  for (char& c : unit) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  double scale = 0;
  if (unit.empty() || unit == "gib" || unit == "gi") {
    scale = 1024.0 * 1024.0 * 1024.0;
  } else if (unit == "b") {
    scale = 1;
  } else if (unit == "kb" || unit == "k") {
    scale = 1e3;
  } else if (unit == "mb" || unit == "m") {
    scale = 1e6;
  } else if (unit == "gb" || unit == "g") {
    scale = 1e9;
  } else if (unit == "tb" || unit == "t") {
    scale = 1e12;
  } else if (unit == "kib" || unit == "ki") {
    scale = 1024.0;
  } else if (unit == "mib" || unit == "mi") {
    scale = 1024.0 * 1024.0;
  } else if (unit == "tib" || unit == "ti") {
    scale = 1024.0 * 1024.0 * 1024.0 * 1024.0;
  } else {
    return false;
  }
  const double b = std::round(value * scale);
  if (!std::isfinite(b) || b < 1 || b > static_cast<double>(kMaxMemory)) return false;
  *bytes = static_cast<uint64_t>(b);
  return true;
}

std::string ComputePlan(const PlanInput& in, PlanResult* out) {
  std::ostringstream e;
  ModelLayout m = in.layout;
  m.layer_dtypes.assign(m.num_layers, in.kv_dtype);
  if (std::string bad = ValidateLayout(m); !bad.empty()) return bad;
  if (in.context_tokens == 0 || in.context_tokens > kMaxContext) {
    e << "context_tokens must be in [1, " << kMaxContext << "], got " << in.context_tokens;
  } else if (in.batch == 0 || in.batch > kMaxBatch) {
    e << "batch must be in [1, " << kMaxBatch << "], got " << in.batch;
  } else if (!(in.params >= 0 && in.params <= kMaxParams)) {
    e << "params must be in [0, " << kMaxParams << "], got " << in.params;
  } else if (in.gpu_memory_bytes == 0 || in.gpu_memory_bytes > kMaxMemory) {
    e << "gpu_memory_bytes must be in [1, 2^60], got " << in.gpu_memory_bytes;
  } else if (!(in.overhead_fraction >= 0 && in.overhead_fraction <= 10)) {
    e << "overhead_fraction must be in [0, 10], got " << in.overhead_fraction;
  }
  if (e.tellp() != 0) return e.str();

  PlanResult r;
  const uint32_t b = DTypeBytes(in.kv_dtype);
  std::ostringstream f;
  r.mla = m.kind == AttentionKind::kMla;
  if (r.mla) {
    // One latent vector of kv_lora_rank + rope_dim elements per token per layer; V is part of it.
    r.kv_bytes_per_token = double(m.num_layers) * (m.kv_lora_rank + m.rope_dim) * b;
    f << "MLA: L*(kv_lora_rank+rope)*S*b*batch = " << m.num_layers << "*(" << m.kv_lora_rank << "+"
      << m.rope_dim << ")*" << in.context_tokens << "*" << b << "*" << in.batch;
  } else {
    // K and V rows of head_dim (head_dim_v) elements per KV head, token and layer.
    r.kv_bytes_per_token = double(m.num_layers) * m.num_kv_heads * (m.head_dim + m.head_dim_v) * b;
    if (m.head_dim == m.head_dim_v) {
      f << "2*L*n_kv*d*S*b*batch = 2*" << m.num_layers << "*" << m.num_kv_heads << "*" << m.head_dim
        << "*" << in.context_tokens << "*" << b << "*" << in.batch;
    } else {
      f << "L*n_kv*(d_k+d_v)*S*b*batch = " << m.num_layers << "*" << m.num_kv_heads << "*("
        << m.head_dim << "+" << m.head_dim_v << ")*" << in.context_tokens << "*" << b << "*"
        << in.batch;
    }
  }
  r.kv_formula = f.str();
  r.weight_bytes = in.params * WeightDTypeBits(in.weight_dtype) / 8.0;
  r.kv_bytes = r.kv_bytes_per_token * double(in.context_tokens) * double(in.batch);
  r.overhead_bytes = in.overhead_fraction * (r.weight_bytes + r.kv_bytes);
  r.total_bytes = r.weight_bytes + r.kv_bytes + r.overhead_bytes;
  const double gpu = double(in.gpu_memory_bytes);
  r.fits = r.total_bytes <= gpu;

  r.kv_budget_bytes = std::max(0.0, gpu / (1.0 + in.overhead_fraction) - r.weight_bytes);
  r.max_tokens = static_cast<uint64_t>(std::floor(r.kv_budget_bytes / r.kv_bytes_per_token));
  r.max_sequences = r.max_tokens / in.context_tokens;

  const BlockLayout layout = ComputeBlockLayout(m);
  r.block_tokens = layout.block_tokens;
  r.block_bytes = layout.block_bytes;
  r.kvbank_bytes_per_token = double(layout.block_bytes) / layout.block_tokens;
  r.kvbank_blocks_per_sequence =
      (in.context_tokens + layout.block_tokens - 1) / layout.block_tokens;
  const double seq_bytes = double(r.kvbank_blocks_per_sequence) * double(layout.block_bytes);
  r.kvbank_kv_bytes = seq_bytes * double(in.batch);
  r.kvbank_max_sequences = static_cast<uint64_t>(std::floor(r.kv_budget_bytes / seq_bytes));
  *out = std::move(r);
  return "";
}

}  // namespace kvbank
