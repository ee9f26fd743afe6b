#include "proto/convert.h"

namespace kvbank::proto {

bool DTypeFromProto(v1::DType d, std::optional<DType>* out) {
  switch (d) {
    case v1::DTYPE_UNSPECIFIED:
      *out = std::nullopt;
      return true;
    case v1::DTYPE_FP32:
      *out = DType::kFp32;
      return true;
    case v1::DTYPE_FP16:
      *out = DType::kFp16;
      return true;
    case v1::DTYPE_BF16:
      *out = DType::kBf16;
      return true;
    case v1::DTYPE_INT8:
      *out = DType::kInt8;
      return true;
    case v1::DTYPE_FP8_E4M3:
      *out = DType::kFp8E4M3;
      return true;
    case v1::DTYPE_FP8_E5M2:
      *out = DType::kFp8E5M2;
      return true;
    default:
      return false;
  }
}

v1::DType DTypeToProto(DType d) {
  switch (d) {
    case DType::kFp32:
      return v1::DTYPE_FP32;
    case DType::kFp16:
      return v1::DTYPE_FP16;
    case DType::kBf16:
      return v1::DTYPE_BF16;
    case DType::kInt8:
      return v1::DTYPE_INT8;
    case DType::kFp8E4M3:
      return v1::DTYPE_FP8_E4M3;
    case DType::kFp8E5M2:
      return v1::DTYPE_FP8_E5M2;
  }
  return v1::DTYPE_UNSPECIFIED;
}

bool KindFromProto(v1::AttentionKind k, std::optional<AttentionKind>* out) {
  switch (k) {
    case v1::ATTENTION_KIND_UNSPECIFIED:
      *out = std::nullopt;
      return true;
    case v1::ATTENTION_KIND_MHA:
      *out = AttentionKind::kMha;
      return true;
    case v1::ATTENTION_KIND_GQA:
      *out = AttentionKind::kGqa;
      return true;
    case v1::ATTENTION_KIND_MQA:
      *out = AttentionKind::kMqa;
      return true;
    case v1::ATTENTION_KIND_MLA:
      *out = AttentionKind::kMla;
      return true;
    default:
      return false;
  }
}

v1::AttentionKind KindToProto(AttentionKind k) {
  switch (k) {
    case AttentionKind::kMha:
      return v1::ATTENTION_KIND_MHA;
    case AttentionKind::kGqa:
      return v1::ATTENTION_KIND_GQA;
    case AttentionKind::kMqa:
      return v1::ATTENTION_KIND_MQA;
    case AttentionKind::kMla:
      return v1::ATTENTION_KIND_MLA;
  }
  return v1::ATTENTION_KIND_UNSPECIFIED;
}

void LayoutToSpec(const ModelLayout& m, v1::ModelSpec* s) {
  s->set_name(m.name);
  s->set_num_layers(m.num_layers);
  s->set_num_q_heads(m.num_q_heads);
  s->set_num_kv_heads(m.num_kv_heads);
  s->set_head_dim(m.head_dim);
  s->set_head_dim_v(m.head_dim_v);
  s->set_block_tokens(m.block_tokens);
  s->set_kind(KindToProto(m.kind));
  s->set_kv_lora_rank(m.kv_lora_rank);
  s->set_rope_dim(m.rope_dim);
  s->set_input_dtype(DTypeToProto(m.input_dtype));
  s->clear_layer_dtypes();
  for (DType d : m.layer_dtypes) s->add_layer_dtypes(DTypeToProto(d));
}

bool LayoutFromResolvedSpec(const v1::ModelSpec& s, ModelLayout* m) {
  std::optional<AttentionKind> kind;
  std::optional<DType> input;
  if (!KindFromProto(s.kind(), &kind) || !DTypeFromProto(s.input_dtype(), &input)) return false;
  m->name = s.name();
  m->num_layers = s.num_layers();
  m->num_q_heads = s.num_q_heads();
  m->num_kv_heads = s.num_kv_heads();
  m->head_dim = s.head_dim();
  m->head_dim_v = s.head_dim_v();
  m->block_tokens = s.block_tokens();
  m->kind = kind.value_or(AttentionKind::kGqa);
  m->kv_lora_rank = s.kv_lora_rank();
  m->rope_dim = s.rope_dim();
  m->input_dtype = input.value_or(DType::kFp16);
  m->layer_dtypes.clear();
  for (int i = 0; i < s.layer_dtypes_size(); ++i) {
    std::optional<DType> d;
    if (!DTypeFromProto(s.layer_dtypes(i), &d) || !d.has_value()) return false;
    m->layer_dtypes.push_back(*d);
  }
  return true;
}

}  // namespace kvbank::proto
