#include "kvbank/layout.h"

#include <limits>
#include <sstream>

namespace kvbank {

bool ModelLayout::operator==(const ModelLayout& o) const {
  return num_layers == o.num_layers && num_q_heads == o.num_q_heads &&
         num_kv_heads == o.num_kv_heads && head_dim == o.head_dim && head_dim_v == o.head_dim_v &&
         block_tokens == o.block_tokens && kind == o.kind && kv_lora_rank == o.kv_lora_rank &&
         rope_dim == o.rope_dim && input_dtype == o.input_dtype && layer_dtypes == o.layer_dtypes;
}

namespace {
// Limits that keep every offset far from overflow: one block stays under 4 GiB.
constexpr uint32_t kMaxHeads = 1024;
constexpr uint32_t kMaxHeadDim = 4096;
constexpr uint32_t kMaxBlockTokens = 4096;
constexpr uint64_t kMaxBlockBytes = uint64_t{1} << 32;
}  // namespace

std::string ValidateLayout(const ModelLayout& m) {
  std::ostringstream e;
  if (m.num_layers == 0 || m.num_layers > kMaxLayers) {
    e << "num_layers must be in [1, " << kMaxLayers << "], got " << m.num_layers;
  } else if (m.num_kv_heads == 0 || m.num_kv_heads > kMaxHeads) {
    e << "num_kv_heads must be in [1, " << kMaxHeads << "], got " << m.num_kv_heads;
  } else if (m.num_q_heads == 0 || m.num_q_heads > kMaxHeads * 64) {
    e << "num_q_heads must be positive, got " << m.num_q_heads;
  } else if (m.num_q_heads % m.num_kv_heads != 0) {
    e << "num_q_heads (" << m.num_q_heads << ") must be a multiple of num_kv_heads ("
      << m.num_kv_heads << ")";
  } else if (m.head_dim == 0 || m.head_dim > kMaxHeadDim) {
    e << "head_dim must be in [1, " << kMaxHeadDim << "], got " << m.head_dim;
  } else if (m.head_dim_v == 0 || m.head_dim_v > kMaxHeadDim) {
    e << "head_dim_v must be in [1, " << kMaxHeadDim << "], got " << m.head_dim_v;
  } else if (m.block_tokens == 0 || m.block_tokens > kMaxBlockTokens) {
    e << "block_tokens must be in [1, " << kMaxBlockTokens << "], got " << m.block_tokens;
  } else if (m.layer_dtypes.size() != m.num_layers) {
    e << "layer_dtypes has " << m.layer_dtypes.size() << " entries, expected num_layers ("
      << m.num_layers << ")";
  } else if (IsQuantized(m.input_dtype)) {
    e << "input_dtype must be fp32, fp16 or bf16, got " << DTypeName(m.input_dtype);
  } else if (m.kind == AttentionKind::kMla) {
    if (m.num_kv_heads != 1) {
      e << "MLA layouts have num_kv_heads 1, got " << m.num_kv_heads;
    } else if (m.kv_lora_rank == 0 || m.head_dim != m.kv_lora_rank + m.rope_dim) {
      e << "MLA head_dim must equal kv_lora_rank + rope_dim (" << m.kv_lora_rank << " + "
        << m.rope_dim << "), got " << m.head_dim;
    } else if (m.head_dim_v != m.kv_lora_rank) {
      e << "MLA head_dim_v must equal kv_lora_rank (" << m.kv_lora_rank << "), got "
        << m.head_dim_v;
    }
  } else {
    if (m.kv_lora_rank != 0 || m.rope_dim != 0) {
      e << "kv_lora_rank and rope_dim are for MLA layouts only";
    } else if (m.kind == AttentionKind::kMha && m.num_q_heads != m.num_kv_heads) {
      e << "MHA needs num_q_heads == num_kv_heads, got " << m.num_q_heads << " and "
        << m.num_kv_heads;
    } else if (m.kind == AttentionKind::kMqa && m.num_kv_heads != 1) {
      e << "MQA needs num_kv_heads 1, got " << m.num_kv_heads;
    }
  }
  if (e.tellp() == 0) {
    // Bound the block size so no offset overflows (every factor is bounded above).
    uint64_t per_layer =
        uint64_t{m.num_kv_heads} * m.block_tokens * (m.head_dim + m.head_dim_v) * 4;
    if (per_layer * m.num_layers > kMaxBlockBytes) {
      e << "block of " << m.block_tokens << " tokens would exceed 4 GiB; lower block_tokens";
    }
  }
  return e.str();
}

std::string LayoutFingerprint(const ModelLayout& m) {
  std::ostringstream f;
  f << "kvbank.layout.v1;kind=" << AttentionKindName(m.kind) << ";layers=" << m.num_layers
    << ";q_heads=" << m.num_q_heads << ";kv_heads=" << m.num_kv_heads << ";head_dim=" << m.head_dim
    << ";head_dim_v=" << m.head_dim_v << ";block_tokens=" << m.block_tokens
    << ";kv_lora_rank=" << m.kv_lora_rank << ";rope_dim=" << m.rope_dim
    << ";input=" << DTypeName(m.input_dtype) << ";storage=";
  for (size_t i = 0; i < m.layer_dtypes.size(); ++i) {
    f << (i ? "," : "") << DTypeName(m.layer_dtypes[i]);
  }
  return f.str();
}

BlockLayout ComputeBlockLayout(const ModelLayout& m) {
  BlockLayout b;
  b.block_tokens = m.block_tokens;
  const bool mla = m.kind == AttentionKind::kMla;
  const uint32_t kv_parts = mla ? 1 : 2;
  uint64_t off = 0;
  b.layers.reserve(m.num_layers);
  for (uint32_t l = 0; l < m.num_layers; ++l) {
    LayerView v;
    v.dtype = m.layer_dtypes[l];
    v.elem_bytes = DTypeBytes(v.dtype);
    v.num_kv_heads = m.num_kv_heads;
    v.block_tokens = m.block_tokens;
    v.head_dim = m.head_dim;
    v.head_dim_v = m.head_dim_v;
    v.has_v = !mla;
    const uint64_t rows = uint64_t{m.num_kv_heads} * m.block_tokens;
    v.k_offset = AlignUp(off, BlockLayout::kPartAlign);
    off = v.k_offset + rows * v.KRowBytes();
    if (v.has_v) {
      v.v_offset = AlignUp(off, BlockLayout::kPartAlign);
      off = v.v_offset + rows * v.VRowBytes();
    } else {
      v.v_offset = v.k_offset;
    }
    switch (v.dtype) {
      case DType::kInt8:  // f32 scale + u8 zero point per (kv, head, token)
        v.scale_bytes = AlignUp(kv_parts * rows * 4, BlockLayout::kPartAlign) + kv_parts * rows;
        break;
      case DType::kFp8E4M3:
      case DType::kFp8E5M2:  // f32 scale per (kv, head)
        v.scale_bytes = uint64_t{kv_parts} * m.num_kv_heads * 4;
        break;
      default:
        v.scale_bytes = 0;
    }
    v.scale_offset = AlignUp(off, BlockLayout::kPartAlign);
    v.zero_point_offset =
        v.dtype == DType::kInt8
            ? v.scale_offset + AlignUp(kv_parts * rows * 4, BlockLayout::kPartAlign)
            : v.scale_offset;
    off = v.scale_offset + v.scale_bytes;
    b.layers.push_back(v);
  }
  b.block_bytes = AlignUp(off, BlockLayout::kBlockAlign);
  return b;
}

uint64_t BlockLayout::PayloadBytes(uint32_t l0, uint32_t l1, uint64_t n) const {
  uint64_t total = 0;
  for (uint32_t l = l0; l < l1 && l < num_layers(); ++l) {
    const uint64_t per_token = layers[l].PayloadBytesPerToken();
    if (n != 0 && per_token > std::numeric_limits<uint64_t>::max() / n) return 0;
    const uint64_t add = per_token * n;
    if (total > std::numeric_limits<uint64_t>::max() - add) return 0;
    total += add;
  }
  return total;
}

PayloadLayout PayloadLayout::Make(const BlockLayout& b, uint32_t l0, uint32_t l1, uint64_t n,
                                  std::optional<DType> wire) {
  PayloadLayout p;
  p.layer_begin = l0;
  p.layer_end = l1;
  p.num_tokens = n;
  p.wire_elem_bytes = wire.has_value() ? DTypeBytes(*wire) : 0;
  uint64_t off = 0;
  for (uint32_t l = l0; l < l1; ++l) {
    p.layer_offset.push_back(off);
    off += p.KPartBytes(b, l) + p.VPartBytes(b, l);
  }
  p.total_bytes = off;
  return p;
}

uint64_t PayloadLayout::ScaleBytes(const BlockLayout& b, uint32_t l) const {
  const LayerView& v = b.layers[l];
  const uint64_t rows = uint64_t{v.KvParts()} * v.num_kv_heads;
  switch (v.dtype) {
    case DType::kInt8:  // a scale and a u8 zero point per row (PayloadInt8ScaleOffset)
      return rows * num_tokens * (kPayloadScaleBytes + 1);
    case DType::kFp8E4M3:
    case DType::kFp8E5M2:  // a scale per (row, block) (PayloadFp8ScaleOffset)
      return rows * num_blocks * kPayloadScaleBytes;
    default:
      return 0;
  }
}

PayloadLayout PayloadLayout::MakeStorage(const BlockLayout& b, uint32_t l0, uint32_t l1,
                                         uint64_t token_begin, uint64_t n) {
  PayloadLayout p;
  p.layer_begin = l0;
  p.layer_end = l1;
  p.num_tokens = n;
  const uint64_t bt = b.block_tokens;
  p.first_block = token_begin / bt;
  p.num_blocks = BlocksTouched(token_begin, n, bt);
  uint64_t off = 0;
  for (uint32_t l = l0; l < l1; ++l) {
    p.layer_offset.push_back(off);
    off += p.KPartBytes(b, l) + p.VPartBytes(b, l);
    p.scale_offset.push_back(off);
    off += p.ScaleBytes(b, l);
  }
  p.total_bytes = off;
  return p;
}

DType DefaultWireDType(const ModelLayout& m, uint32_t l0, uint32_t l1) {
  for (uint32_t l = l0; l < l1; ++l) {
    if (IsQuantized(m.layer_dtypes[l]) || m.layer_dtypes[l] != m.layer_dtypes[l0]) {
      return m.input_dtype;
    }
  }
  return l0 < l1 ? m.layer_dtypes[l0] : m.input_dtype;
}

namespace {
ModelLayout Gqa(const char* name, uint32_t layers, uint32_t q_heads, uint32_t kv_heads,
                uint32_t head_dim, DType storage) {
  ModelLayout m;
  m.name = name;
  m.num_layers = layers;
  m.num_q_heads = q_heads;
  m.num_kv_heads = kv_heads;
  m.head_dim = head_dim;
  m.head_dim_v = head_dim;
  m.kind = kv_heads == q_heads ? AttentionKind::kMha
                               : (kv_heads == 1 ? AttentionKind::kMqa : AttentionKind::kGqa);
  m.input_dtype = DType::kBf16;
  m.layer_dtypes.assign(layers, storage);
  return m;
}
}  // namespace

bool PresetLayout(std::string_view preset, ModelLayout* out, DType storage) {
  if (preset == "llama-3.1-8b") {
    *out = Gqa("llama-3.1-8b", 32, 32, 8, 128, storage);
  } else if (preset == "llama-3-70b") {
    *out = Gqa("llama-3-70b", 80, 64, 8, 128, storage);
  } else if (preset == "qwen2.5-7b") {
    *out = Gqa("qwen2.5-7b", 28, 28, 4, 128, storage);
  } else if (preset == "mistral-7b-v0.3") {
    *out = Gqa("mistral-7b-v0.3", 32, 32, 8, 128, storage);
  } else if (preset == "gemma-2-9b") {
    *out = Gqa("gemma-2-9b", 42, 16, 8, 256, storage);
  } else if (preset == "deepseek-v3") {
    ModelLayout m = Gqa("deepseek-v3", 61, 128, 1, 576, storage);
    m.kind = AttentionKind::kMla;
    m.kv_lora_rank = 512;
    m.rope_dim = 64;
    m.head_dim_v = 512;
    *out = m;
  } else {
    return false;
  }
  return true;
}

std::vector<std::string> PresetNames() {
  return {"llama-3.1-8b",    "llama-3-70b", "qwen2.5-7b",
          "mistral-7b-v0.3", "gemma-2-9b",  "deepseek-v3"};
}

}  // namespace kvbank
