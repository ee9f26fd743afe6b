#include "server/core/transfer_planner.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace kvbank {

TransferPlanner::TransferPlanner(ModelLayout layout, BlockLayout blocks, uint64_t staging_bytes)
    : layout_(std::move(layout)), blocks_(std::move(blocks)), staging_bytes_(staging_bytes) {}

absl::Status TransferPlanner::CheckLayers(uint32_t l0, uint32_t l1) const {
  if (l1 > layout_.num_layers || l0 >= l1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer range [", l0, ", ", l1, ") is empty or outside [0, ", layout_.num_layers, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<HeadRange> TransferPlanner::ResolveHeads(uint32_t begin,
                                                        std::optional<uint32_t> end) const {
  if (layout_.kind == AttentionKind::kMla) return HeadRange{};
  const uint32_t e = end.value_or(layout_.num_kv_heads);
  if (begin >= e || e > layout_.num_kv_heads) {
    return absl::InvalidArgumentError(absl::StrCat("kv head range [", begin, ", ", e,
                                                   ") is empty or outside the model's ",
                                                   layout_.num_kv_heads, " kv heads"));
  }
  if (begin == 0 && e == layout_.num_kv_heads) return HeadRange{};
  return HeadRange{begin, e - begin};
}

absl::StatusOr<TransferPlan> TransferPlanner::Ranges(const TransferAsk& ask) const {
  TransferPlan p;
  p.layer_begin = ask.layer_begin;
  p.layer_end = ask.layer_end.value_or(layout_.num_layers);
  if (absl::Status s = CheckLayers(p.layer_begin, p.layer_end); !s.ok()) return s;
  auto heads = ResolveHeads(ask.kv_head_begin, ask.kv_head_end);
  if (!heads.ok()) return heads.status();
  p.heads = *heads;
  p.head_begin = heads->begin;
  p.head_end = heads->count == 0 ? layout_.num_kv_heads : heads->begin + heads->count;
  return p;
}

absl::StatusOr<TransferPlan> TransferPlanner::Plan(const TransferAsk& ask, bool append) const {
  TransferPlan p;
  p.layer_begin = ask.layer_begin;
  p.layer_end = ask.layer_end.value_or(layout_.num_layers);
  if (absl::Status s = CheckLayers(p.layer_begin, p.layer_end); !s.ok()) return s;
  if (absl::Status s = CheckFormat(p, ask.dtype, append); !s.ok()) return s;
  auto ranges = Ranges(ask);
  if (!ranges.ok()) return ranges.status();
  ranges->dtype = p.dtype;
  ranges->mode = p.mode;
  return ranges;
}

absl::Status TransferPlanner::CheckFormat(TransferPlan& p, std::optional<DType> requested,
                                          bool append) const {
  const uint32_t l0 = p.layer_begin, l1 = p.layer_end;
  const DType wire = requested.value_or(DefaultWireDType(layout_, l0, l1));
  p.dtype = wire;
  if (IsQuantized(wire)) {
    // The storage format: every layer of the range must store exactly this dtype.
    for (uint32_t l = l0; l < l1; ++l) {
      if (layout_.layer_dtypes[l] != wire) {
        return absl::InvalidArgumentError(absl::StrCat(
            "dtype ", DTypeName(wire), " (storage format) but layer ", l, " stores ",
            DTypeName(layout_.layer_dtypes[l]),
            "; transfer fp32, fp16 or bf16, or a layer range that stores ", DTypeName(wire)));
      }
    }
    p.mode = TransferMode::kStorage;
    return absl::OkStatus();
  }
  bool plain = true;
  for (uint32_t l = l0; l < l1; ++l) {
    const DType stored = layout_.layer_dtypes[l];
    if (stored == wire) continue;
    plain = false;
    if (append && wire != layout_.input_dtype) {
      return absl::InvalidArgumentError(absl::StrCat(
          "dtype ", DTypeName(wire), " does not match layer ", l, " storage dtype ",
          DTypeName(stored), " nor the model's input dtype ", DTypeName(layout_.input_dtype)));
    }
  }
  p.mode = plain ? TransferMode::kPlain : TransferMode::kConvert;
  return absl::OkStatus();
}

TransferSpec TransferPlanner::Make(const TransferPlan& plan, uint64_t token_begin, uint64_t n,
                                   std::vector<int32_t> table) const {
  TransferSpec t;
  t.mode = plan.mode;
  t.dtype = plan.dtype;
  t.token_begin = token_begin;
  if (plan.heads.count != 0) t.heads = blocks_.Heads(plan.heads.begin, plan.heads.count);
  const BlockLayout& b = t.heads ? *t.heads : blocks_;
  const uint32_t l0 = plan.layer_begin, l1 = plan.layer_end;
  switch (plan.mode) {
    case TransferMode::kPlain:
      t.payload = PayloadLayout::Make(b, l0, l1, n);
      break;
    case TransferMode::kConvert:
      t.payload = PayloadLayout::Make(b, l0, l1, n, plan.dtype);
      break;
    case TransferMode::kStorage:
      t.payload = PayloadLayout::MakeStorage(b, l0, l1, token_begin, n);
      break;
  }
  t.table = std::move(table);
  t.staging_bytes = staging_bytes_;
  return t;
}

}  // namespace kvbank
