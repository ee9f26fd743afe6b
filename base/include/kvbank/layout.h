// kvbank block and payload layout: the one place that computes byte offsets.
//
// This header is dependency-free (standard library only) and is shared by the server core, the
// kernels (CPU and CUDA), the codecs and the client SDK. Nothing else computes offsets: every
// other component asks a BlockLayout or a PayloadLayout.
//
// Block (one contiguous byte range, block_bytes long, 64-byte aligned):
//   for each layer l: [K part][V part][scales of layer l]
//   K part = [num_kv_heads][block_tokens][head_dim]   elements of layer l's storage dtype
//   V part = [num_kv_heads][block_tokens][head_dim_v] (absent for MLA: V is K[..., :head_dim_v])
//   scales = int8: f32 scale [kv][num_kv_heads][block_tokens] then u8 zero point, same shape
//            fp8:  f32 scale [kv][num_kv_heads]
//            fp16/bf16/fp32: nothing
//   where kv is 2 (K and V) or 1 (MLA). Every part starts on a 16-byte boundary.
//
// Payload (what travels on the wire for an append or fetch of layers [l0, l1) x n tokens):
//   for each layer l in [l0, l1): K [num_kv_heads][n][head_dim], then V
//   [num_kv_heads][n][head_dim_v] (no V for MLA), dense, in the layer's storage dtype (or one wire
//   dtype); in the storage format, then the layer's scales (PayloadLayout::scale_offset).
//   Offsets within a layer come from PayloadRowOffset and its scale-section siblings below, which
//   host code reaches through PayloadLayout and the kernels through LayerView::Payload*.
#ifndef KVBANK_LAYOUT_H_
#define KVBANK_LAYOUT_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

// Marks a function that host and device code both call (the CUDA kernels share the layout math).
// Expands to nothing outside nvcc, so this header needs no CUDA include.
#if defined(__CUDACC__)
#define KVBANK_HD __host__ __device__
#else
#define KVBANK_HD
#endif

namespace kvbank {

// Element types. Values are stable: they appear in fingerprints and on the wire.
enum class DType : uint8_t {
  kFp32 = 0,
  kFp16 = 1,
  kBf16 = 2,
  kInt8 = 3,     // asymmetric uint8, scale + zero point per (K/V, head, token)
  kFp8E4M3 = 4,  // scale per (K/V, head) per block
  kFp8E5M2 = 5,  // scale per (K/V, head) per block
};

enum class AttentionKind : uint8_t { kMha = 0, kGqa = 1, kMqa = 2, kMla = 3 };

KVBANK_HD constexpr uint32_t DTypeBytes(DType d) {
  return d == DType::kFp32 ? 4u : (d == DType::kFp16 || d == DType::kBf16) ? 2u : 1u;
}
KVBANK_HD constexpr bool IsQuantized(DType d) {
  return d == DType::kInt8 || d == DType::kFp8E4M3 || d == DType::kFp8E5M2;
}
constexpr uint64_t AlignUp(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

// ---- payload offsets ----------------------------------------------------------------------------
// The one rule for where a row or a scale sits inside a payload's layer (file comment: Payload).
// Plain integers in, so that PayloadLayout (host) and the CPU and CUDA kernels (which hold only a
// PayloadMap) all compute offsets here.

// Bytes of a layer's K or V part: [num_kv_heads][num_tokens] rows of row_bytes each.
KVBANK_HD constexpr uint64_t PayloadPartBytes(uint32_t num_kv_heads, uint64_t num_tokens,
                                              uint64_t row_bytes) {
  return uint64_t{num_kv_heads} * num_tokens * row_bytes;
}

// Payload offset of the row of K (kv 0) or V (kv 1), kv head h, payload token t of one layer.
// layer_offset: the layer's first payload byte; k_part_bytes: its K part's bytes
// (PayloadPartBytes of the K rows); row_bytes: this row's bytes (K or V width times the payload's
// element width).
KVBANK_HD constexpr uint64_t PayloadRowOffset(uint64_t layer_offset, uint64_t k_part_bytes,
                                              uint32_t kv, uint32_t h, uint64_t num_tokens,
                                              uint64_t t, uint64_t row_bytes) {
  return layer_offset + (kv == 0 ? 0 : k_part_bytes) + (uint64_t{h} * num_tokens + t) * row_bytes;
}

// Storage format, int8 layer: the scale section (at scale_offset) holds f32 scales
// [kv_parts][num_kv_heads][num_tokens], then u8 zero points of the same shape.
constexpr uint64_t kPayloadScaleBytes = sizeof(float);
KVBANK_HD constexpr uint64_t PayloadInt8ScaleOffset(uint64_t scale_offset, uint32_t num_kv_heads,
                                                    uint64_t num_tokens, uint32_t kv, uint32_t h,
                                                    uint64_t t) {
  return scale_offset + ((uint64_t{kv} * num_kv_heads + h) * num_tokens + t) * kPayloadScaleBytes;
}
KVBANK_HD constexpr uint64_t PayloadInt8ZeroPointOffset(uint64_t scale_offset, uint32_t kv_parts,
                                                        uint32_t num_kv_heads, uint64_t num_tokens,
                                                        uint32_t kv, uint32_t h, uint64_t t) {
  return scale_offset + uint64_t{kv_parts} * num_kv_heads * num_tokens * kPayloadScaleBytes +
         (uint64_t{kv} * num_kv_heads + h) * num_tokens + t;
}
// Storage format, fp8 layer: f32 scales [kv_parts][num_kv_heads][num_blocks]; b counts the blocks
// the payload touches from its first one (PayloadLayout::first_block).
KVBANK_HD constexpr uint64_t PayloadFp8ScaleOffset(uint64_t scale_offset, uint32_t num_kv_heads,
                                                   uint64_t num_blocks, uint32_t kv, uint32_t h,
                                                   uint64_t b) {
  return scale_offset + ((uint64_t{kv} * num_kv_heads + h) * num_blocks + b) * kPayloadScaleBytes;
}
// Blocks of block_tokens tokens that tokens [token_begin, token_begin + n) touch.
KVBANK_HD constexpr uint64_t BlocksTouched(uint64_t token_begin, uint64_t n,
                                           uint64_t block_tokens) {
  return n == 0 ? 0
                : (token_begin + n + block_tokens - 1) / block_tokens - token_begin / block_tokens;
}

inline const char* DTypeName(DType d) {
  switch (d) {
    case DType::kFp32:
      return "fp32";
    case DType::kFp16:
      return "fp16";
    case DType::kBf16:
      return "bf16";
    case DType::kInt8:
      return "int8";
    case DType::kFp8E4M3:
      return "fp8_e4m3";
    case DType::kFp8E5M2:
      return "fp8_e5m2";
  }
  return "unknown";
}
inline bool ParseDType(std::string_view s, DType* out) {
  for (DType d :
       {DType::kFp32, DType::kFp16, DType::kBf16, DType::kInt8, DType::kFp8E4M3, DType::kFp8E5M2}) {
    if (s == DTypeName(d)) {
      *out = d;
      return true;
    }
  }
  return false;
}
inline const char* AttentionKindName(AttentionKind k) {
  switch (k) {
    case AttentionKind::kMha:
      return "mha";
    case AttentionKind::kGqa:
      return "gqa";
    case AttentionKind::kMqa:
      return "mqa";
    case AttentionKind::kMla:
      return "mla";
  }
  return "unknown";
}

// Where one layer lives inside a block. Plain data, usable on host and device.
struct LayerView {
  uint64_t k_offset = 0;      // K part: [num_kv_heads][block_tokens][head_dim]
  uint64_t v_offset = 0;      // V part: [num_kv_heads][block_tokens][head_dim_v]; MLA: == k_offset
  uint64_t scale_offset = 0;  // scales region (see file comment); scale_bytes long
  uint64_t scale_bytes = 0;
  uint64_t zero_point_offset = 0;  // int8 only: u8 zero points [kv][num_kv_heads][block_tokens]
  uint32_t num_kv_heads = 0;
  // Heads of the block's scale sections, when this view covers only some of them (Heads());
  // 0: num_kv_heads.
  uint32_t scale_heads = 0;
  uint32_t block_tokens = 0;
  uint32_t head_dim = 0;
  uint32_t head_dim_v = 0;
  uint32_t elem_bytes = 0;
  DType dtype = DType::kFp16;
  bool has_v = true;  // false for MLA

  KVBANK_HD uint64_t KRowBytes() const { return uint64_t{head_dim} * elem_bytes; }
  KVBANK_HD uint64_t VRowBytes() const { return uint64_t{head_dim_v} * elem_bytes; }
  // Byte offset, within a block, of token `t`'s row of head `h` in K or V.
  KVBANK_HD uint64_t KRow(uint32_t h, uint32_t t) const {
    return k_offset + (uint64_t{h} * block_tokens + t) * KRowBytes();
  }
  KVBANK_HD uint64_t VRow(uint32_t h, uint32_t t) const {
    return v_offset + (uint64_t{h} * block_tokens + t) * VRowBytes();
  }
  KVBANK_HD uint32_t KvParts() const { return has_v ? 2u : 1u; }
  KVBANK_HD uint32_t ScaleHeads() const { return scale_heads != 0 ? scale_heads : num_kv_heads; }
  // int8: offsets of the f32 scale and u8 zero point of (kv part, head, token); kv 0 = K, 1 = V.
  KVBANK_HD uint64_t Int8Scale(uint32_t kv, uint32_t h, uint32_t t) const {
    return scale_offset + ((uint64_t{kv} * ScaleHeads() + h) * block_tokens + t) * 4;
  }
  KVBANK_HD uint64_t Int8ZeroPoint(uint32_t kv, uint32_t h, uint32_t t) const {
    return zero_point_offset + (uint64_t{kv} * ScaleHeads() + h) * block_tokens + t;
  }
  // fp8: offset of the f32 scale of (kv part, head) in this block.
  KVBANK_HD uint64_t Fp8Scale(uint32_t kv, uint32_t h) const {
    return scale_offset + (uint64_t{kv} * ScaleHeads() + h) * 4;
  }
  // The same layer seen as heads [h0, h0 + n) only: head i of the view is head h0 + i of the
  // block, in its rows and its scales. A payload over such views carries those heads (what one
  // tensor-parallel rank holds); every kernel and codec works on it unchanged.
  // REQUIRES: h0 + n <= num_kv_heads.
  KVBANK_HD LayerView Heads(uint32_t h0, uint32_t n) const {
    LayerView v = *this;
    v.scale_heads = ScaleHeads();
    v.k_offset += uint64_t{h0} * block_tokens * KRowBytes();
    v.v_offset = has_v ? v_offset + uint64_t{h0} * block_tokens * VRowBytes() : v.k_offset;
    if (dtype == DType::kInt8) {
      v.scale_offset += uint64_t{h0} * block_tokens * 4;
      v.zero_point_offset += uint64_t{h0} * block_tokens;
    } else if (dtype == DType::kFp8E4M3 || dtype == DType::kFp8E5M2) {
      v.scale_offset += uint64_t{h0} * 4;
    }
    v.num_kv_heads = n;
    return v;
  }
  // Bytes one token of this layer occupies in a dense payload (K and V, all heads).
  KVBANK_HD uint64_t PayloadBytesPerToken() const {
    return uint64_t{num_kv_heads} * (KRowBytes() + (has_v ? VRowBytes() : 0));
  }
  KVBANK_HD uint32_t Dim(uint32_t kv) const { return kv == 0 ? head_dim : head_dim_v; }

  // This layer in a payload of num_tokens tokens whose elements are elem_bytes wide (the storage
  // width for copies, the wire width for converted payloads) and whose copy of the layer starts
  // at layer_offset: the payload offset of row (kv, h, payload token t). PayloadRowOffset's rule.
  KVBANK_HD uint64_t PayloadRow(uint64_t layer_offset, uint64_t num_tokens, uint64_t elem_bytes,
                                uint32_t kv, uint32_t h, uint64_t t) const {
    return PayloadRowOffset(layer_offset,
                            PayloadPartBytes(num_kv_heads, num_tokens, head_dim * elem_bytes), kv,
                            h, num_tokens, t, Dim(kv) * elem_bytes);
  }
  // The storage format's scale section of this layer at scale_offset: int8 scale and zero point
  // of (kv, h, payload token t); fp8 scale of (kv, h, block b of the payload's num_blocks).
  KVBANK_HD uint64_t PayloadInt8Scale(uint64_t scale_offset, uint64_t num_tokens, uint32_t kv,
                                      uint32_t h, uint64_t t) const {
    return PayloadInt8ScaleOffset(scale_offset, num_kv_heads, num_tokens, kv, h, t);
  }
  KVBANK_HD uint64_t PayloadInt8ZeroPoint(uint64_t scale_offset, uint64_t num_tokens, uint32_t kv,
                                          uint32_t h, uint64_t t) const {
    return PayloadInt8ZeroPointOffset(scale_offset, KvParts(), num_kv_heads, num_tokens, kv, h, t);
  }
  KVBANK_HD uint64_t PayloadFp8Scale(uint64_t scale_offset, uint64_t num_blocks, uint32_t kv,
                                     uint32_t h, uint64_t b) const {
    return PayloadFp8ScaleOffset(scale_offset, num_kv_heads, num_blocks, kv, h, b);
  }
};

// A model's KV shape. MHA/GQA/MQA differ only in num_kv_heads; MLA stores one latent vector per
// token (kv_lora_rank + rope_dim wide) as K, and V is its first kv_lora_rank dims.
struct ModelLayout {
  std::string name;
  uint32_t num_layers = 0;
  uint32_t num_q_heads = 0;
  uint32_t num_kv_heads = 0;
  uint32_t head_dim = 0;    // K width; MLA: kv_lora_rank + rope_dim
  uint32_t head_dim_v = 0;  // V width; MLA: kv_lora_rank
  uint32_t block_tokens = 16;
  AttentionKind kind = AttentionKind::kGqa;
  uint32_t kv_lora_rank = 0;  // MLA only
  uint32_t rope_dim = 0;      // MLA only
  DType input_dtype = DType::kFp16;
  std::vector<DType> layer_dtypes;  // storage dtype of each layer; size num_layers

  bool operator==(const ModelLayout& o) const;
  bool operator!=(const ModelLayout& o) const { return !(*this == o); }
};

// The most layers a layout may have (ValidateLayout); a spec with more is refused before
// anything is sized by its layer count.
inline constexpr uint32_t kMaxLayers = 1024;

// Returns an empty string when the layout is valid, else a message naming the bad field.
std::string ValidateLayout(const ModelLayout& m);

// A canonical, stable text encoding of everything that determines the bytes of a block (name
// excluded). Equal fingerprints <=> interchangeable blocks; later the prefix-hash root.
std::string LayoutFingerprint(const ModelLayout& m);

// Offsets of every part of a block for one model layout. Computed once by ComputeBlockLayout.
struct BlockLayout {
  uint64_t block_bytes = 0;  // stride between blocks; multiple of kBlockAlign
  uint32_t block_tokens = 0;
  std::vector<LayerView> layers;

  static constexpr uint64_t kPartAlign = 16;
  static constexpr uint64_t kBlockAlign = 64;

  uint32_t num_layers() const { return static_cast<uint32_t>(layers.size()); }
  // Dense payload bytes of layers [l0, l1) for n tokens; 0 on overflow (callers bound n first).
  uint64_t PayloadBytes(uint32_t l0, uint32_t l1, uint64_t n) const;
  // Payload bytes one token of all layers takes (the fp16 "bytes per token" figure, uncompressed).
  uint64_t PayloadBytesPerToken() const { return PayloadBytes(0, num_layers(), 1); }
  // Every layer seen as kv heads [h0, h0 + n) (LayerView::Heads): payloads made from it carry
  // those heads only. REQUIRES: h0 + n <= every layer's num_kv_heads.
  BlockLayout Heads(uint32_t h0, uint32_t n) const {
    BlockLayout b = *this;
    for (LayerView& v : b.layers) v = v.Heads(h0, n);
    return b;
  }
};

// The one layout function. REQUIRES: ValidateLayout(m).empty().
BlockLayout ComputeBlockLayout(const ModelLayout& m);

// The dense payload of layers [l0, l1) x n tokens, described for the copy kernels.
// layer_offset[i] is the payload byte offset of layer l0 + i; within it K is [heads][n][head_dim]
// then V [heads][n][head_dim_v]: RowOffset (PayloadRowOffset's rule) says where each row is.
// Elements travel in each layer's storage dtype, or all in one `wire` dtype (fp32/fp16/bf16) that
// the server converts to and from the storage dtype (quantizing where it is int8 / fp8).
struct PayloadLayout {
  uint32_t layer_begin = 0;
  uint32_t layer_end = 0;
  uint64_t num_tokens = 0;
  uint64_t total_bytes = 0;
  uint32_t wire_elem_bytes = 0;        // 0: each layer's storage width
  std::vector<uint64_t> layer_offset;  // size layer_end - layer_begin
  // Storage format (MakeStorage): after each layer's V part, its quantization scales for the
  // rows in the payload: int8: f32 scale [kv][heads][n], then u8 zero point [kv][heads][n];
  // fp8: f32 scale [kv][heads][num_blocks] of the blocks the token range touches. Empty otherwise.
  std::vector<uint64_t> scale_offset;  // size layer_end - layer_begin, when storage format
  uint64_t first_block = 0;            // storage format: sequence block of payload token 0
  uint64_t num_blocks = 0;             // storage format: blocks the token range touches

  static PayloadLayout Make(const BlockLayout& b, uint32_t l0, uint32_t l1, uint64_t n,
                            std::optional<DType> wire = std::nullopt);
  // The storage format of tokens [token_begin, token_begin + n): elements as stored, then the
  // scales (see scale_offset). What a GPU that quantized KV itself appends, and fetches back.
  static PayloadLayout MakeStorage(const BlockLayout& b, uint32_t l0, uint32_t l1,
                                   uint64_t token_begin, uint64_t n);
  bool storage_format() const { return !scale_offset.empty(); }
  // Bytes of layer l's scale section (storage format).
  uint64_t ScaleBytes(const BlockLayout& b, uint32_t l) const;
  // Width of one element of layer l (absolute index) in this payload.
  uint64_t ElemBytes(const BlockLayout& b, uint32_t l) const {
    return wire_elem_bytes ? wire_elem_bytes : b.layers[l].elem_bytes;
  }
  // Bytes of layer l's K part ([heads][n][head_dim]) and V part (0 for MLA) in this payload.
  uint64_t KPartBytes(const BlockLayout& b, uint32_t l) const {
    return PayloadPartBytes(b.layers[l].num_kv_heads, num_tokens, RowBytes(b, l, 0));
  }
  uint64_t VPartBytes(const BlockLayout& b, uint32_t l) const {
    return b.layers[l].has_v
               ? PayloadPartBytes(b.layers[l].num_kv_heads, num_tokens, RowBytes(b, l, 1))
               : 0;
  }
  // Bytes of one row of layer l's K (kv 0) or V (kv 1) part in this payload.
  uint64_t RowBytes(const BlockLayout& b, uint32_t l, uint32_t kv) const {
    return uint64_t{b.layers[l].Dim(kv)} * ElemBytes(b, l);
  }
  // Payload offset of the row of layer l (absolute index), K (kv 0) or V (kv 1), kv head h,
  // payload token t. REQUIRES: layer_begin <= l < layer_end, t < num_tokens.
  uint64_t RowOffset(const BlockLayout& b, uint32_t l, uint32_t kv, uint32_t h, uint64_t t) const {
    return b.layers[l].PayloadRow(layer_offset[l - layer_begin], num_tokens, ElemBytes(b, l), kv, h,
                                  t);
  }
  // Storage format: payload offsets of layer l's int8 scale and zero point of (kv, h, payload
  // token t), and of its fp8 scale of (kv, h, sequence block `block`).
  // REQUIRES: storage_format(); first_block <= block < first_block + num_blocks.
  uint64_t Int8ScaleOffset(const BlockLayout& b, uint32_t l, uint32_t kv, uint32_t h,
                           uint64_t t) const {
    return b.layers[l].PayloadInt8Scale(scale_offset[l - layer_begin], num_tokens, kv, h, t);
  }
  uint64_t Int8ZeroPointOffset(const BlockLayout& b, uint32_t l, uint32_t kv, uint32_t h,
                               uint64_t t) const {
    return b.layers[l].PayloadInt8ZeroPoint(scale_offset[l - layer_begin], num_tokens, kv, h, t);
  }
  uint64_t Fp8ScaleOffset(const BlockLayout& b, uint32_t l, uint32_t kv, uint32_t h,
                          uint64_t block) const {
    return b.layers[l].PayloadFp8Scale(scale_offset[l - layer_begin], num_blocks, kv, h,
                                       block - first_block);
  }
};

// The dtype a payload of layers [l0, l1) travels in when the caller names none: the storage dtype
// when every layer of the range stores the same unquantized dtype, else the model's input dtype
// (the server quantizes on the way in and dequantizes on the way out).
DType DefaultWireDType(const ModelLayout& m, uint32_t l0, uint32_t l1);

// Built-in model presets (llama-3.1-8b, llama-3-70b, qwen2.5-7b, mistral-7b-v0.3, gemma-2-9b,
// deepseek-v3). Returns false for an unknown name. Storage dtype = `storage` for every layer.
bool PresetLayout(std::string_view preset, ModelLayout* out, DType storage = DType::kBf16);
std::vector<std::string> PresetNames();

}  // namespace kvbank

#endif  // KVBANK_LAYOUT_H_
