#include <cstdint>

#include "block_copy_cuda.h"

namespace kvbank::kernels {

namespace {

constexpr int kThreads = 256;

// n bytes from src to dst by the 32 lanes of a warp, four 16-byte words in flight a lane where
// both sides are 16-byte aligned (else 4-byte words, else bytes); any tail byte by byte.
__device__ inline void WarpCopySpan(uint8_t* __restrict__ dst, const uint8_t* __restrict__ src,
                                    uint64_t n, unsigned lane) {
  const uintptr_t align = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src);
  uint64_t done = 0;
  if ((align & 15) == 0) {
    const uint64_t words = n / 16;
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    uint64_t i = lane;
    for (; i + 96 < words; i += 128) {  // loads before stores: four requests in flight a lane
      const uint4 a = s[i], b = s[i + 32], c = s[i + 64], e = s[i + 96];
      d[i] = a;
      d[i + 32] = b;
      d[i + 64] = c;
      d[i + 96] = e;
    }
    for (; i < words; i += 32) d[i] = s[i];
    done = words * 16;
  } else if ((align & 3) == 0) {
    const uint64_t words = n / 4;
    const uint32_t* s = reinterpret_cast<const uint32_t*>(src);
    uint32_t* d = reinterpret_cast<uint32_t*>(dst);
    for (uint64_t i = lane; i < words; i += 32) d[i] = s[i];
    done = words * 4;
  }
  for (uint64_t i = done + lane; i < n; i += 32) dst[i] = src[i];
}

// The payload moved as segments that are contiguous on both sides: the rows of one (layer, K or
// V, head) whose tokens fall in one pool block (the block keeps a head's rows of consecutive
// tokens together, [heads][block_tokens][dim], as the payload does). A warp a segment (up to
// block_tokens rows, 4 KiB for 16 tokens of 128 bf16), the segments of layer blockIdx.y (and
// every gridDim.y-th after it) strided over the warps of the grid's x; only the bytes of a
// segment inside [offset, offset + len) move.
__global__ void PayloadCopyKernel(PayloadMap m, CopyDirection dir, uint64_t offset, uint8_t* buf,
                                  uint64_t len) {
  const unsigned lane = threadIdx.x & 31u;
  const uint64_t warps_per_block = blockDim.x / 32;
  const uint64_t warp = blockIdx.x * warps_per_block + threadIdx.x / 32;
  const uint64_t warps = uint64_t{gridDim.x} * warps_per_block;
  const uint64_t end = offset + len;
  for (uint32_t l = blockIdx.y; l < m.num_layers; l += gridDim.y) {
    const LayerView v = m.layers[l];
    const uint64_t bt = v.block_tokens;
    const uint64_t first = m.token_begin / bt;
    const uint64_t blocks = BlocksTouched(m.token_begin, m.num_tokens, bt);
    const uint64_t per_part = uint64_t{v.num_kv_heads} * blocks;
    const uint64_t segments = per_part * v.KvParts();
    for (uint64_t sgm = warp; sgm < segments; sgm += warps) {
      const uint32_t part = sgm < per_part ? 0u : 1u;
      const uint64_t r = sgm - part * per_part;
      const uint32_t h = static_cast<uint32_t>(r / blocks);
      const uint64_t b = first + r % blocks;  // the block's index in the table
      const uint64_t pos_lo = b * bt > m.token_begin ? b * bt : m.token_begin;
      const uint64_t block_end = (b + 1) * bt;
      const uint64_t pos_hi =
          block_end < m.token_begin + m.num_tokens ? block_end : m.token_begin + m.num_tokens;
      const uint64_t row_bytes = part == 0 ? v.KRowBytes() : v.VRowBytes();
      const uint64_t seg_begin = v.PayloadRow(m.layer_offset[l], m.num_tokens, v.elem_bytes, part,
                                              h, pos_lo - m.token_begin);
      const uint64_t seg_end = seg_begin + (pos_hi - pos_lo) * row_bytes;
      const uint64_t lo = seg_begin > offset ? seg_begin : offset;
      const uint64_t hi = seg_end < end ? seg_end : end;
      if (lo >= hi) continue;
      const uint32_t brow = static_cast<uint32_t>(pos_lo - b * bt);
      uint8_t* pool_at = m.pool + uint64_t(m.block_table[b]) * m.block_bytes +
                         (part == 0 ? v.KRow(h, brow) : v.VRow(h, brow)) + (lo - seg_begin);
      uint8_t* buf_at = buf + (lo - offset);
      if (dir == CopyDirection::kPayloadToPool) {
        WarpCopySpan(pool_at, buf_at, hi - lo, lane);
      } else {
        WarpCopySpan(buf_at, pool_at, hi - lo, lane);
      }
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

// The scale sections of a storage-format payload. Grid (x, layers); each thread takes scale
// entries of its layer (an int8 scale or zero point of one (K/V, head, token), or an fp8 scale of
// one (K/V, head, block)) and copies the bytes of the entry that fall in the window. Entries are
// 4 or 1 bytes, so a byte loop is all there is.
__global__ void ScaleCopyKernel(PayloadMap m, CopyDirection dir, uint64_t offset, uint8_t* buf,
                                uint64_t len) {
  const uint64_t end = offset + len;
  const uint64_t n = m.num_tokens;
  for (uint32_t li = blockIdx.y; li < m.num_layers; li += gridDim.y) {
    const LayerView& v = m.layers[li];
    const uint64_t section = m.scale_offset[li];
    if (section >= end) continue;
    const uint64_t heads = v.num_kv_heads;
    const uint64_t rows = uint64_t{v.KvParts()} * heads;  // (K/V, head) pairs
    const bool int8 = v.dtype == DType::kInt8;
    uint64_t nb = 0, entries = 0;
    if (int8) {
      entries = 2 * rows * n;  // f32 scales [kv][h][n], then u8 zero points [kv][h][n]
    } else if (v.dtype == DType::kFp8E4M3 || v.dtype == DType::kFp8E5M2) {
      nb = BlocksTouched(m.token_begin, n, v.block_tokens);
      entries = rows * nb;  // f32 scales [kv][h][nb]
    }
    for (uint64_t e = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; e < entries;
         e += uint64_t{gridDim.x} * blockDim.x) {
      uint64_t at_payload, width;
      uint8_t* at_pool;
      if (int8) {
        const bool zp = e >= rows * n;
        const uint64_t i = zp ? e - rows * n : e;
        const uint32_t kv = static_cast<uint32_t>(i / n / heads);
        const uint32_t h = static_cast<uint32_t>(i / n % heads);
        const uint64_t t = i % n;
        const uint64_t pos = m.token_begin + t;
        const uint32_t row = static_cast<uint32_t>(pos % v.block_tokens);
        uint8_t* block = m.pool + uint64_t(m.block_table[pos / v.block_tokens]) * m.block_bytes;
        width = zp ? 1 : kPayloadScaleBytes;
        at_payload = zp ? v.PayloadInt8ZeroPoint(section, n, kv, h, t)
                        : v.PayloadInt8Scale(section, n, kv, h, t);
        at_pool = block + (zp ? v.Int8ZeroPoint(kv, h, row) : v.Int8Scale(kv, h, row));
      } else {
        const uint32_t kv = static_cast<uint32_t>(e / nb / heads);
        const uint32_t h = static_cast<uint32_t>(e / nb % heads);
        uint8_t* block = m.pool + uint64_t(m.block_table[m.first_block + e % nb]) * m.block_bytes;
        width = kPayloadScaleBytes;
        at_payload = v.PayloadFp8Scale(section, nb, kv, h, e % nb);
        at_pool = block + v.Fp8Scale(kv, h);
      }
      const uint64_t lo = at_payload > offset ? at_payload : offset;
      const uint64_t hi = at_payload + width < end ? at_payload + width : end;
      for (uint64_t p = lo; p < hi; ++p) {
        if (dir == CopyDirection::kPayloadToPool) {
          at_pool[p - at_payload] = buf[p - offset];
        } else {
          buf[p - offset] = at_pool[p - at_payload];
        }
      }
    }
  }
}

// n bytes from src to dst by the 32 lanes of a warp: 16 bytes at a time where both sides and n
// allow, else 4, else 1.
__device__ inline void WarpCopy(uint8_t* dst, const uint8_t* src, uint64_t n, unsigned lane) {
  const uintptr_t align = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | n;
  if ((align & 15) == 0) {
    for (uint64_t i = lane * 16ull; i < n; i += 32 * 16) {
      *reinterpret_cast<uint4*>(dst + i) = *reinterpret_cast<const uint4*>(src + i);
    }
  } else if ((align & 3) == 0) {
    for (uint64_t i = lane * 4ull; i < n; i += 32 * 4) {
      *reinterpret_cast<uint32_t*>(dst + i) = *reinterpret_cast<const uint32_t*>(src + i);
    }
  } else {
    for (uint64_t i = lane; i < n; i += 32) dst[i] = src[i];
  }
}

// One CUDA block per RowCopy: a warp per (K/V, head) row, then a thread per (K/V, head) for the
// scales. Scale slots are 4-byte aligned (scale sections start on 16-byte boundaries).
// NOTE: copies into one fp8 block all write its scales; the caller guarantees they agree.
__global__ void CopyRowsKernel(uint8_t* pool, uint64_t block_bytes, const LayerView* layers,
                               const RowCopy* copies, size_t n) {
  const unsigned lane = threadIdx.x & 31u;
  const unsigned warps = blockDim.x / 32;
  for (size_t i = blockIdx.x; i < n; i += gridDim.x) {
    const RowCopy c = copies[i];
    const LayerView& v = layers[c.layer];
    const uint8_t* s = pool + uint64_t(c.src_block) * block_bytes;
    uint8_t* d = pool + uint64_t(c.dst_block) * block_bytes;
    const uint32_t rows = v.KvParts() * v.num_kv_heads;
    for (uint32_t r = threadIdx.x / 32; r < rows; r += warps) {
      const uint32_t kv = r / v.num_kv_heads, h = r % v.num_kv_heads;
      if (kv == 0) {
        WarpCopy(d + v.KRow(h, c.dst_row), s + v.KRow(h, c.src_row), v.KRowBytes(), lane);
      } else {
        WarpCopy(d + v.VRow(h, c.dst_row), s + v.VRow(h, c.src_row), v.VRowBytes(), lane);
      }
    }
    for (uint32_t r = threadIdx.x; r < rows; r += blockDim.x) {
      const uint32_t kv = r / v.num_kv_heads, h = r % v.num_kv_heads;
      if (v.dtype == DType::kInt8) {
        *reinterpret_cast<uint32_t*>(d + v.Int8Scale(kv, h, c.dst_row)) =
            *reinterpret_cast<const uint32_t*>(s + v.Int8Scale(kv, h, c.src_row));
        d[v.Int8ZeroPoint(kv, h, c.dst_row)] = s[v.Int8ZeroPoint(kv, h, c.src_row)];
      } else if ((v.dtype == DType::kFp8E4M3 || v.dtype == DType::kFp8E5M2) && s != d) {
        *reinterpret_cast<uint32_t*>(d + v.Fp8Scale(kv, h)) =
            *reinterpret_cast<const uint32_t*>(s + v.Fp8Scale(kv, h));
      }
    }
  }
}

}  // namespace

cudaError_t PayloadCopyCuda(const PayloadMap& map, CopyDirection dir, uint64_t offset, uint8_t* buf,
                            uint64_t len, cudaStream_t stream) {
  if (len == 0 || map.num_tokens == 0) return cudaSuccess;
  // Layers on the grid's y; on x, about a warp for every 2 KiB of a layer's share of the
  // window (segments are up to a block's rows of one head), the rest by the stride loop.
  const uint64_t layers = map.num_layers == 0 ? 1 : map.num_layers;
  const uint64_t per_layer = (len + layers - 1) / layers;
  const uint64_t x = (per_layer + (kThreads / 32) * 2048 - 1) / ((kThreads / 32) * 2048);
  const dim3 grid(static_cast<unsigned>(x < 1 ? 1 : (x > 1024 ? 1024 : x)),
                  static_cast<unsigned>(layers < 65535 ? layers : 65535));
  PayloadCopyKernel<<<grid, kThreads, 0, stream>>>(map, dir, offset, buf, len);
  return cudaGetLastError();
}

cudaError_t ScaleCopyCuda(const PayloadMap& map, CopyDirection dir, uint64_t offset, uint8_t* buf,
                          uint64_t len, cudaStream_t stream) {
  if (map.scale_offset == nullptr || len == 0 || map.num_tokens == 0 || map.num_layers == 0) {
    return cudaSuccess;
  }
  // The layer views are device memory: size x by the tokens (a few entries per token per head)
  // and let the kernel stride over the rest.
  const uint64_t x = (map.num_tokens + 7) / 8;
  const dim3 grid(static_cast<unsigned>(x < 1024 ? x : 1024),
                  map.num_layers < 65535 ? map.num_layers : 65535);
  ScaleCopyKernel<<<grid, kThreads, 0, stream>>>(map, dir, offset, buf, len);
  return cudaGetLastError();
}

cudaError_t CopyRowsCuda(uint8_t* pool, uint64_t block_bytes, const LayerView* layers,
                         const RowCopy* copies, size_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const unsigned grid = n < 65535 ? static_cast<unsigned>(n) : 65535u;
  CopyRowsKernel<<<grid, kThreads / 2, 0, stream>>>(pool, block_bytes, layers, copies, n);
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
