// How a transfer of one model's KV travels: which layers and kv heads, in which dtype and mode,
// through which blocks. A value over the model's layout: no lock, no pool, no sequence; every
// caller that moves KV (appends, fetches, fetches by block hash, waits for layers) checks its
// ranges and plans its payload here, so they answer the same errors.
#ifndef KVBANK_SERVER_CORE_TRANSFER_PLANNER_H_
#define KVBANK_SERVER_CORE_TRANSFER_PLANNER_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvbank/layout.h"
#include "server/core/transfer.h"

namespace kvbank {

// A range of KV heads, resolved against a model (TransferPlanner::ResolveHeads).
struct HeadRange {
  uint32_t begin = 0;
  uint32_t count = 0;  // 0: every head
};

// What a transfer asks for, as a request spells it (unset ends: to the model's end).
struct TransferAsk {
  uint32_t layer_begin = 0;
  std::optional<uint32_t> layer_end;
  uint32_t kv_head_begin = 0;
  std::optional<uint32_t> kv_head_end;
  std::optional<DType> dtype;  // unset: DefaultWireDType
};

// A transfer's ranges and format, checked against the model.
struct TransferPlan {
  uint32_t layer_begin = 0, layer_end = 0;
  HeadRange heads;                        // as TransferSpec narrows the layout (count 0: all)
  uint32_t head_begin = 0, head_end = 0;  // the same, as [begin, end) over the model's heads
  DType dtype = DType::kFp16;             // of the payload
  TransferMode mode = TransferMode::kPlain;
};

class TransferPlanner {
 public:
  // `blocks` is the pool's block layout for `layout`; `staging_bytes` the pool's staging piece.
  TransferPlanner(ModelLayout layout, BlockLayout blocks, uint64_t staging_bytes);

  const ModelLayout& layout() const { return layout_; }

  // INVALID_ARGUMENT unless [l0, l1) is a non-empty range of the model's layers.
  absl::Status CheckLayers(uint32_t l0, uint32_t l1) const;
  // kv heads [begin, end) of this model (end unset: num_kv_heads): INVALID_ARGUMENT unless
  // begin < end <= num_kv_heads. Every head for MLA (one latent head that every rank reads).
  absl::StatusOr<HeadRange> ResolveHeads(uint32_t begin, std::optional<uint32_t> end) const;
  // Layers and heads only: for a wait, which moves nothing.
  absl::StatusOr<TransferPlan> Ranges(const TransferAsk& ask) const;
  // Layers, heads and format. The payload travels in the dtype asked for (DefaultWireDType
  // when none is) and mode: a plain copy when every layer stores exactly that dtype; a
  // conversion for appends in a layer's storage dtype or the model's input dtype, and fetches
  // in fp32 / fp16 / bf16; the storage format for a quantized dtype every layer of the range
  // stores. Checked in that order: layers, dtype, heads.
  absl::StatusOr<TransferPlan> Plan(const TransferAsk& ask, bool append) const;
  // The transfer of n tokens from token_begin through `table` (the physical block of each
  // logical block, from block 0).
  TransferSpec Make(const TransferPlan& plan, uint64_t token_begin, uint64_t n,
                    std::vector<int32_t> table) const;

 private:
  absl::Status CheckFormat(TransferPlan& plan, std::optional<DType> requested, bool append) const;

  const ModelLayout layout_;
  const BlockLayout blocks_;
  const uint64_t staging_bytes_;
};

}  // namespace kvbank

#endif  // KVBANK_SERVER_CORE_TRANSFER_PLANNER_H_
