// Block copy and token gather/scatter between a paged pool and a dense payload.
//
// The CPU functions are what the host backend runs; the CUDA launchers (block_copy_cuda.h) do the
// same on a device pool. Both take the same LayerView (from kvbank/layout.h), so the offsets come
// from the one layout function. No gRPC, protobuf or Abseil here.
#ifndef KVBANK_KERNELS_BLOCK_COPY_H_
#define KVBANK_KERNELS_BLOCK_COPY_H_

#include <cstddef>
#include <cstdint>

#include "kvbank/layout.h"

namespace kvbank::kernels {

// A dense payload of layers [l0, l1) x num_tokens mapped onto a sequence's blocks.
// All pointers are in the memory the function runs on (host for *Cpu, device for *Cuda).
struct PayloadMap {
  uint8_t* pool = nullptr;                 // [num_blocks][block_bytes]
  uint64_t block_bytes = 0;                // stride between blocks
  const LayerView* layers = nullptr;       // [num_layers]: the views of layers l0 .. l1-1
  const uint64_t* layer_offset = nullptr;  // [num_layers]: payload offset of each layer
  uint32_t num_layers = 0;
  const int32_t* block_table = nullptr;  // [ceil((token_begin + num_tokens) / block_tokens)]
  uint64_t token_begin = 0;              // sequence position of payload token 0
  uint64_t num_tokens = 0;
  uint64_t total_bytes = 0;  // payload size; == PayloadLayout::total_bytes
  // Storage format only (PayloadLayout::MakeStorage): [num_layers] payload offset of each layer's
  // scale section, and the sequence block of payload token 0. Null: no scale sections.
  const uint64_t* scale_offset = nullptr;
  uint64_t first_block = 0;
};

enum class CopyDirection { kPayloadToPool, kPoolToPayload };

// How a CPU copy writes its destination (the pool, or `buf`).
enum class CopyStores : uint8_t {
  // Through the caches: for bytes that are read again soon (a chunk about to be serialized).
  kCached,
  // The whole 64-byte lines of each run of at least kStreamRunBytes go around the caches
  // (non-temporal stores, fenced before the copy returns); the rest as kCached. For a large
  // destination nobody reads again soon: a client's shared-memory region, the pool behind a
  // large append. An ordinary store first reads each line it writes into the cache; over memory
  // larger than the caches that read is a third of the traffic (bench/copy_bench.cc: a gather or
  // scatter of 2-64 MiB at 0.71-0.86 of one memcpy with ordinary stores, 0.92-1.20 streamed).
  kStream,
};
inline constexpr uint64_t kStreamRunBytes = 256;

// Copies payload bytes [offset, offset + len) to or from the pool. `buf` holds exactly those
// bytes (buf[0] is payload byte `offset`). Any offset and length is allowed (chunks may split
// rows). REQUIRES: offset + len <= map.total_bytes; block_table covers every touched token.
void PayloadCopyCpu(const PayloadMap& map, CopyDirection dir, uint64_t offset, uint8_t* buf,
                    uint64_t len, CopyStores stores = CopyStores::kCached);

// memcpy(dst, src, n) written as `stores` says (kStream: fenced before it returns). Exposed for
// its tests.
void CopyBytes(uint8_t* dst, const uint8_t* src, uint64_t n, CopyStores stores);

// The scale sections of a storage-format payload (map.scale_offset set): copies those of payload
// bytes [offset, offset + len) that fall in a scale section; the element rows are PayloadCopyCpu's.
void ScaleCopyCpu(const PayloadMap& map, CopyDirection dir, uint64_t offset, uint8_t* buf,
                  uint64_t len);

// Copies whole blocks: dst_ids[i] <- src_ids[i], each block_bytes long.
void CopyBlocksCpu(uint8_t* pool, uint64_t block_bytes, const int32_t* src_ids,
                   const int32_t* dst_ids, size_t n);

// One token row of one layer moved between blocks: its K and V rows of every kv head, its int8
// scales and zero points, and for fp8 layers the (K/V, head) scales of the source block (which
// then hold for every row of the destination block: only copy fp8 rows whose blocks share them).
struct RowCopy {
  int32_t src_block = 0;
  int32_t dst_block = 0;
  uint32_t src_row = 0;
  uint32_t dst_row = 0;
  uint32_t layer = 0;  // index into `layers`
};

// Applies `copies` (no two with the same destination row; sources are not destinations).
void CopyRowsCpu(uint8_t* pool, uint64_t block_bytes, const LayerView* layers,
                 const RowCopy* copies, size_t n);

}  // namespace kvbank::kernels

#endif  // KVBANK_KERNELS_BLOCK_COPY_H_
