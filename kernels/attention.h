// Decode attention over the paged block pool: one query token per item against the KV of one
// sequence and one layer, read straight from the blocks in their storage dtype.
//
// The paged view (PagedKv) and the element decode (KvRow, DecodeKv) below are the one layout view
// shared by the CPU reference (attention_ref.cc), the CPU kernel (attention_cpu.cc) and the CUDA
// kernel (attention.cu), like FlashInfer's paged_kv_t: plain data with KVBANK_HD accessors, the
// offsets coming from LayerView (kvbank/layout.h) and the element math from quant_math.h (the
// codecs' math, so the kernels dequantize exactly what the codecs stored).
//
// Semantics, for item i, q head h (kv head g = h / (num_q_heads / num_kv_heads)), and the
// attended token positions T (all of [0, length), or with a sliding window the first `sinks`
// and the last `window` positions):
//   s_t      = sm_scale * dot(q[i][h], K[g][t])                  t in T
//   lse[i][h] = log(sum_t exp(s_t))                              natural log
//   out[i][h] = sum_t exp(s_t - lse) * V[g][t]                   [head_dim_v]
//   token_probs[i][t] = sum_h exp(s_{h,t} - lse[i][h])           0 for t outside T
// so each item's token_probs sum to num_q_heads (the mass H2O retention accumulates).
// MLA (LayerView::has_v false): num_kv_heads is 1, K is the whole head_dim-wide row and V is its
// first head_dim_v dims, decoded with the K row's scales.
// An item with no attended token (length 0) gets out = 0 and lse = -inf.
//
// No gRPC, protobuf or Abseil here: kernels know nothing of the service.
#ifndef KVBANK_KERNELS_ATTENTION_H_
#define KVBANK_KERNELS_ATTENTION_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/quant_math.h"
#include "kvbank/layout.h"

namespace kvbank::kernels {

// One K or V row of one (head, token) in a block, with what its dtype needs to decode it.
struct KvRow {
  const uint8_t* data = nullptr;  // [dim] elements of the layer's storage dtype
  float scale = 1.0f;             // int8: the row's scale; fp8: the block's (K/V, head) scale
  uint8_t zero_point = 0;         // int8 only
};

// Element i of a row as float, by the codecs' math (quant_math.h). D is the storage dtype.
template <DType D>
KVBANK_HD inline float DecodeKv(const KvRow& r, uint32_t i) {
  if constexpr (D == DType::kFp32) {
    return reinterpret_cast<const float*>(r.data)[i];
  } else if constexpr (D == DType::kFp16) {
    return qmath::HalfToFloat(reinterpret_cast<const uint16_t*>(r.data)[i]);
  } else if constexpr (D == DType::kBf16) {
    return qmath::Bf16ToFloat(reinterpret_cast<const uint16_t*>(r.data)[i]);
  } else if constexpr (D == DType::kInt8) {
    return qmath::DequantizeInt8(r.data[i], r.zero_point, r.scale);
  } else {
    return qmath::DecodeFp8(r.data[i], r.scale, D);
  }
}

// The same with the dtype known at run time (the reference's path).
KVBANK_HD inline float DecodeKv(DType d, const KvRow& r, uint32_t i) {
  switch (d) {
    case DType::kFp32:
      return DecodeKv<DType::kFp32>(r, i);
    case DType::kFp16:
      return DecodeKv<DType::kFp16>(r, i);
    case DType::kBf16:
      return DecodeKv<DType::kBf16>(r, i);
    case DType::kInt8:
      return DecodeKv<DType::kInt8>(r, i);
    case DType::kFp8E4M3:
      return DecodeKv<DType::kFp8E4M3>(r, i);
    case DType::kFp8E5M2:
      return DecodeKv<DType::kFp8E5M2>(r, i);
  }
  return 0.0f;
}

// The paged KV of a batch: item i attends layer layers[i] of the sequence whose blocks are
// indices[indptr[i] .. indptr[i + 1]) (logical block b -> physical block id), lengths[i] tokens.
// All pointers are in the memory the kernel runs on (host for the CPU paths, device for CUDA).
// Every item's layer has the same num_kv_heads, block_tokens, head_dim and head_dim_v (one
// model); storage dtypes may differ (mixed-precision layers).
struct PagedKv {
  const uint8_t* pool = nullptr;      // [num_blocks][block_bytes]
  uint64_t block_bytes = 0;           // stride between blocks
  const LayerView* layers = nullptr;  // [batch]
  const int32_t* indptr = nullptr;    // [batch + 1]
  const int32_t* indices = nullptr;   // [indptr[batch]]
  const uint32_t* lengths = nullptr;  // [batch]; lengths[i] <= blocks of item i * block_tokens
  uint32_t batch = 0;

  // The block holding token `t` of item i.
  KVBANK_HD const uint8_t* Block(uint32_t i, uint32_t t) const {
    const uint32_t bt = layers[i].block_tokens;
    return pool + uint64_t(indices[indptr[i] + t / bt]) * block_bytes;
  }
  // Row of token t, kv head h: K (kv = 0) or V (kv = 1; for MLA the K row, with K's scales).
  KVBANK_HD KvRow Row(uint32_t i, uint32_t kv, uint32_t h, uint32_t t) const {
    const LayerView& v = layers[i];
    const uint8_t* blk = Block(i, t);
    const uint32_t tb = t % v.block_tokens;
    const uint32_t part = v.has_v ? kv : 0u;
    KvRow r;
    r.data = blk + (part == 0 ? v.KRow(h, tb) : v.VRow(h, tb));
    if (v.dtype == DType::kInt8) {
      r.scale = *reinterpret_cast<const float*>(blk + v.Int8Scale(part, h, tb));
      r.zero_point = blk[v.Int8ZeroPoint(part, h, tb)];
    } else if (qmath::IsFp8DType(v.dtype)) {
      r.scale = *reinterpret_cast<const float*>(blk + v.Fp8Scale(part, h));
    }
    return r;
  }
};

// Which token positions an item attends: [0, sink_end) and [recent_begin, length), disjoint.
// Attended index j in [0, Count()) maps to position Position(j), ascending.
struct AttendSpan {
  uint32_t sink_end = 0;
  uint32_t recent_begin = 0;
  uint32_t length = 0;

  KVBANK_HD uint32_t Count() const { return sink_end + (length - recent_begin); }
  KVBANK_HD uint32_t Position(uint32_t j) const {
    return j < sink_end ? j : recent_begin + (j - sink_end);
  }
  KVBANK_HD bool Attends(uint32_t t) const {
    return t < sink_end || (t >= recent_begin && t < length);
  }
};

// window 0: every token. Otherwise the last `window` tokens plus the first `sinks`.
KVBANK_HD inline AttendSpan MakeAttendSpan(uint32_t length, uint32_t window, uint32_t sinks) {
  AttendSpan s;
  s.length = length;
  if (window == 0 || window >= length) return s;  // recent_begin 0: everything
  s.recent_begin = length - window;
  s.sink_end = sinks < s.recent_begin ? sinks : s.recent_begin;
  return s;
}

// A decode-attention batch. Plain data, passed by value to the CUDA kernels.
struct DecodeAttentionParams {
  PagedKv kv;
  uint32_t num_q_heads = 0;   // a multiple of num_kv_heads
  uint32_t num_kv_heads = 0;  // == every layer's num_kv_heads (1 for MLA)
  uint32_t head_dim = 0;      // K width == every layer's head_dim (MLA: latent + rope, e.g. 576)
  uint32_t head_dim_v = 0;    // V width == every layer's head_dim_v (MLA: latent, e.g. 512)
  float sm_scale = 0.0f;      // softmax scale, e.g. 1 / sqrt(head_dim)
  uint32_t window = 0;        // 0: off; else attend the last `window` tokens ...
  uint32_t sinks = 0;         // ... and the first `sinks` (only with a window)
  const float* q = nullptr;   // [batch][num_q_heads][head_dim]
  float* out = nullptr;       // [batch][num_q_heads][head_dim_v]
  float* lse = nullptr;       // [batch][num_q_heads]; natural-log log-sum-exp of the scaled scores
  // nullptr, or [batch] pointers, each nullptr (not wanted for that item) or [lengths[i]]:
  // per token the softmax probability summed over all q heads (see the file comment).
  float* const* token_probs = nullptr;

  KVBANK_HD uint32_t Group() const { return num_q_heads / num_kv_heads; }
};

// Checks the scalar fields and, reading host memory, every item's layer and block list. Returns
// an empty string when the batch is valid, else a message naming the bad field. The CPU paths
// require a valid batch; the CUDA launcher checks the scalar fields only.
std::string ValidateDecodeAttention(const DecodeAttentionParams& p);

// The CPU reference: plain loops, fp64 accumulation, the reference for the CPU and CUDA kernels.
// REQUIRES: ValidateDecodeAttention(p).empty(); host memory. Thread-compatible.
void DecodeAttentionReference(const DecodeAttentionParams& p);

// The CPU kernel: fp32 online softmax, work split over (item, kv head, context chunk) across
// `num_threads` threads (0: std::thread::hardware_concurrency()), partial results merged by
// log-sum-exp. The q heads of one kv head share each decoded K/V tile. Blocks are decoded with
// the codecs (AVX2 where the CPU has it), which match quant_math.h bit for bit.
// NOTE: starts num_threads - 1 threads per call (the caller's thread works too) and allocates
// scratch per call. REQUIRES: ValidateDecodeAttention(p).empty(); host memory. Thread-compatible:
// concurrent calls with disjoint outputs are safe.
void DecodeAttentionCpu(const DecodeAttentionParams& p, uint32_t num_threads = 0);

}  // namespace kvbank::kernels

#endif  // KVBANK_KERNELS_ATTENTION_H_
