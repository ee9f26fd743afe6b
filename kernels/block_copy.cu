#include <cstdint>

#include "block_copy_cuda.h"

namespace kvbank::kernels {

namespace {

constexpr int kThreads = 256;

// One CUDA block per payload row (one token of one head of K or V of one layer); the row's
// bytes that fall in [offset, offset + len) are copied, 16 bytes at a time where both sides
// are aligned and the row lies wholly inside the window.
// NOTE: mapping a row to its layer scans the layers (O(layers) per row); fine for the copy
// sizes of appends and fetches, revisit if a profile shows it.
__global__ void PayloadCopyKernel(PayloadMap m, CopyDirection dir, uint64_t offset, uint8_t* buf,
                                  uint64_t len) {
  // Walk rows with a grid-stride loop. Row ids are global over all layers in the map.
  uint64_t total_rows = 0;
  for (uint32_t l = 0; l < m.num_layers; ++l) {
    total_rows += uint64_t{m.layers[l].num_kv_heads} * m.num_tokens * m.layers[l].KvParts();
  }
  for (uint64_t r = blockIdx.x; r < total_rows; r += gridDim.x) {
    // Map global row r to (layer, part, head, token).
    uint64_t rem = r;
    uint32_t l = 0;
    for (; l < m.num_layers; ++l) {
      const uint64_t rows =
          uint64_t{m.layers[l].num_kv_heads} * m.num_tokens * m.layers[l].KvParts();
      if (rem < rows) break;
      rem -= rows;
    }
    const LayerView& v = m.layers[l];
    const uint64_t k_rows = uint64_t{v.num_kv_heads} * m.num_tokens;
    const uint32_t part = rem < k_rows ? 0 : 1;
    if (part) rem -= k_rows;
    const uint32_t h = static_cast<uint32_t>(rem / m.num_tokens);
    const uint64_t t = rem % m.num_tokens;
    const uint64_t row_bytes = part == 0 ? v.KRowBytes() : v.VRowBytes();
    const uint64_t row_begin = m.layer_offset[l] + (part ? k_rows * v.KRowBytes() : 0) +
                               (uint64_t{h} * m.num_tokens + t) * row_bytes;
    const uint64_t lo = row_begin > offset ? row_begin : offset;
    const uint64_t row_end = row_begin + row_bytes;
    const uint64_t hi = row_end < offset + len ? row_end : offset + len;
    if (lo >= hi) continue;
    const uint64_t pos = m.token_begin + t;
    uint8_t* block = m.pool + uint64_t(m.block_table[pos / v.block_tokens]) * m.block_bytes;
    const uint32_t brow = static_cast<uint32_t>(pos % v.block_tokens);
    uint8_t* pool_at = block + (part == 0 ? v.KRow(h, brow) : v.VRow(h, brow)) + (lo - row_begin);
    uint8_t* buf_at = buf + (lo - offset);
    uint8_t* dst = dir == CopyDirection::kPayloadToPool ? pool_at : buf_at;
    const uint8_t* src = dir == CopyDirection::kPayloadToPool ? buf_at : pool_at;
    const uint64_t n = hi - lo;
    const bool vec =
        ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | n) & 15) == 0;
    if (vec) {
      for (uint64_t i = threadIdx.x * 16; i < n; i += blockDim.x * 16) {
        *reinterpret_cast<uint4*>(dst + i) = *reinterpret_cast<const uint4*>(src + i);
      }
    } else {
      for (uint64_t i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
    }
  }
}

__global__ void CopyBlocksKernel(uint8_t* pool, uint64_t block_bytes, const int32_t* src_ids,
                                 const int32_t* dst_ids, size_t n) {
  for (size_t b = blockIdx.x; b < n; b += gridDim.x) {
    const uint4* s = reinterpret_cast<const uint4*>(pool + uint64_t(src_ids[b]) * block_bytes);
    uint4* d = reinterpret_cast<uint4*>(pool + uint64_t(dst_ids[b]) * block_bytes);
    // block_bytes is a multiple of BlockLayout::kBlockAlign (64), so 16-byte words cover it.
    for (uint64_t i = threadIdx.x; i < block_bytes / 16; i += blockDim.x) d[i] = s[i];
  }
}

}  // namespace

cudaError_t PayloadCopyCuda(const PayloadMap& map, CopyDirection dir, uint64_t offset, uint8_t* buf,
                            uint64_t len, cudaStream_t stream) {
  if (len == 0 || map.num_tokens == 0) return cudaSuccess;
  // Rows are at most a few KiB; a fixed grid with a stride loop covers any payload.
  PayloadCopyKernel<<<4096, kThreads / 2, 0, stream>>>(map, dir, offset, buf, len);
  return cudaGetLastError();
}

cudaError_t CopyBlocksCuda(uint8_t* pool, uint64_t block_bytes, const int32_t* src_ids,
                           const int32_t* dst_ids, size_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const unsigned grid = n < 65535 ? static_cast<unsigned>(n) : 65535u;
  CopyBlocksKernel<<<grid, kThreads, 0, stream>>>(pool, block_bytes, src_ids, dst_ids, n);
  return cudaGetLastError();
}

}  // namespace kvbank::kernels
