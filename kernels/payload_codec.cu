// Whole-payload codec on the device (payload_codec.h has the semantics, payload_codec_cuda.h the
// launch contract). Per-element math is quant_math.h, shared with the CPU codecs, so results match
// EncodePayloadCpu / DecodePayloadCpu bit for bit on finite input; these kernels only decide who
// computes which element.
//
// The layer views live in device memory, so the host knows neither the layers' dtypes nor their
// head counts: every kernel runs over grid (x, layers) and reads its layer's view itself; x
// strides over the layer's rows (or fp8 segments).
#include <cstdint>

#include "kernels/payload_codec_cuda.h"
#include "kernels/quant_math.h"
#include "kernels/quant_warp.cuh"

namespace kvbank::kernels {

namespace {

using namespace qmath;  // NOLINT: the codec math is this file's vocabulary

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr uint64_t kMaxGridX = 1024;
constexpr uint32_t kMaxGridY = 65535;

// One payload row: head_dim (K) or head_dim_v (V) values of one (K/V, head, token) of a layer.
struct RowAt {
  uint32_t kv;
  uint32_t head;
  uint32_t dim;
  uint32_t row;      // block row
  uint8_t* block;    // the block's first byte
  uint64_t payload;  // payload offset of the row
  uint64_t pool;     // offset of the row within the block
};

// Row r (in [0, KvParts * heads * n)) of layer `li`: rows are in payload order, [kv][h][t].
__device__ inline RowAt LocateRow(const PayloadMap& m, const LayerView& v, uint32_t li,
                                  uint32_t wire_bytes, uint64_t r) {
  const uint64_t k_rows = uint64_t{v.num_kv_heads} * m.num_tokens;
  RowAt a;
  a.kv = r < k_rows ? 0u : 1u;
  const uint64_t in_part = r - (a.kv ? k_rows : 0);
  a.head = static_cast<uint32_t>(in_part / m.num_tokens);
  const uint64_t t = in_part % m.num_tokens;
  a.dim = v.Dim(a.kv);
  a.payload = v.PayloadRow(m.layer_offset[li], m.num_tokens, wire_bytes, a.kv, a.head, t);
  const uint64_t pos = m.token_begin + t;
  a.row = static_cast<uint32_t>(pos % v.block_tokens);
  a.block = m.pool + uint64_t(m.block_table[pos / v.block_tokens]) * m.block_bytes;
  a.pool = a.kv ? v.VRow(a.head, a.row) : v.KRow(a.head, a.row);
  return a;
}

// n bytes from src to dst by `lanes` threads (this one is `lane`): 16 bytes at a time where both
// sides and n allow, else 4, else 1.
__device__ inline void CopyBytes(uint8_t* dst, const uint8_t* src, uint64_t n, unsigned lane,
                                 unsigned lanes) {
  const uintptr_t align = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | n;
  if ((align & 15) == 0) {
    for (uint64_t i = lane * 16ull; i < n; i += lanes * 16ull) {
      *reinterpret_cast<uint4*>(dst + i) = *reinterpret_cast<const uint4*>(src + i);
    }
  } else if ((align & 3) == 0) {
    for (uint64_t i = lane * 4ull; i < n; i += lanes * 4ull) {
      *reinterpret_cast<uint32_t*>(dst + i) = *reinterpret_cast<const uint32_t*>(src + i);
    }
  } else {
    for (uint64_t i = lane; i < n; i += lanes) dst[i] = src[i];
  }
}

// Phase 1 of the encode: the scale of every (K/V, head, block) group the payload touches, by
// Fp8GroupScale from the absolute maximum of that head's rows in the payload in that block; a
// block the payload continues and whose scale changes gets its earlier rows requantized here.
// One CUDA block per group; max |x| is exact and order-independent on finite input, so any
// reduction tree gives AbsMax's result.
__global__ void Fp8ScalesKernel(PayloadMap m, DType wire, const uint8_t* payload) {
  __shared__ float warp_max[kWarps];
  __shared__ float scales[2];  // the stored scale and the new one
  const uint32_t wb = DTypeBytes(wire);
  for (uint32_t li = blockIdx.y; li < m.num_layers; li += gridDim.y) {
    const LayerView v = m.layers[li];
    if (!IsFp8DType(v.dtype)) continue;  // uniform over the CUDA block
    const uint64_t bt = v.block_tokens;
    // Sequence blocks [b0, b0 + nb) hold the payload's tokens.
    const uint64_t b0 = m.token_begin / bt;
    const uint64_t nb = BlocksTouched(m.token_begin, m.num_tokens, bt);
    const uint64_t segments = uint64_t{v.KvParts()} * v.num_kv_heads * nb;
    for (uint64_t s = blockIdx.x; s < segments; s += gridDim.x) {
      const uint64_t kvh = s / nb;
      const uint64_t b = b0 + s % nb;
      const uint32_t kv = static_cast<uint32_t>(kvh / v.num_kv_heads);
      const uint32_t h = static_cast<uint32_t>(kvh % v.num_kv_heads);
      const uint32_t dim = v.Dim(kv);
      // Block rows [row, row + rows) come from payload tokens [t, t + rows).
      const uint64_t row = b * bt < m.token_begin ? m.token_begin - b * bt : 0;
      const uint64_t t = b * bt + row - m.token_begin;
      const uint64_t rows = m.num_tokens - t < bt - row ? m.num_tokens - t : bt - row;
      const uint8_t* src = payload + v.PayloadRow(m.layer_offset[li], m.num_tokens, wb, kv, h, t);
      const uint64_t len = rows * dim;
      float mx = 0.0f;
      for (uint64_t i = threadIdx.x; i < len; i += blockDim.x) {
        const float a = fabsf(LoadAsFloat(src, wire, i));
        mx = a > mx ? a : mx;
      }
      for (int off = 16; off > 0; off >>= 1) {
        const float o = __shfl_xor_sync(kFullMask, mx, off);
        mx = o > mx ? o : mx;
      }
      if ((threadIdx.x & 31u) == 0) warp_max[threadIdx.x / 32] = mx;
      uint8_t* block = m.pool + uint64_t(m.block_table[b]) * m.block_bytes;
      float* scale_slot = reinterpret_cast<float*>(block + v.Fp8Scale(kv, h));
      __syncthreads();
      if (threadIdx.x == 0) {
        float amax = 0.0f;
        for (unsigned w = 0; w < blockDim.x / 32; ++w)
          amax = warp_max[w] > amax ? warp_max[w] : amax;
        scales[0] = *scale_slot;
        scales[1] = Fp8GroupScale(amax, scales[0], row, rows, bt, v.dtype);
      }
      __syncthreads();
      const float stored = scales[0], scale = scales[1];
      if (row > 0 && scale != stored) {  // uniform over the CUDA block
        uint8_t* codes = block + (kv ? v.VRow(h, 0) : v.KRow(h, 0));
        const float inv = RecipRn(scale);
        for (uint64_t i = threadIdx.x; i < row * dim; i += blockDim.x) {
          codes[i] = EncodeFp8(DecodeFp8(codes[i], stored, v.dtype), inv, v.dtype);
        }
      }
      if (threadIdx.x == 0) *scale_slot = scale;
      __syncthreads();  // warp_max and scales are reused by the next segment
    }
  }
}

// Phase 2 of the encode: one warp per payload row, each element by EncodeStored (quant_math.h).
// int8 rows get their parameters from WarpInt8Params, as QuantizeInt8RowsCuda does; fp8 rows use
// the scale stored in their block.
__global__ void EncodeRowsKernel(PayloadMap m, DType wire, const uint8_t* payload) {
  const unsigned lane = threadIdx.x & 31u;
  const uint64_t first = blockIdx.x * uint64_t{kWarps} + threadIdx.x / 32;
  const uint64_t warps = uint64_t{gridDim.x} * kWarps;
  const uint32_t wb = DTypeBytes(wire);
  for (uint32_t li = blockIdx.y; li < m.num_layers; li += gridDim.y) {
    const LayerView v = m.layers[li];
    const uint64_t rows = uint64_t{v.KvParts()} * v.num_kv_heads * m.num_tokens;
    for (uint64_t r = first; r < rows; r += warps) {  // r is uniform over the warp
      const RowAt a = LocateRow(m, v, li, wb, r);
      const uint8_t* src = payload + a.payload;
      uint8_t* dst = a.block + a.pool;
      if (v.dtype == wire) {
        CopyBytes(dst, src, uint64_t{a.dim} * wb, lane, 32);
        continue;
      }
      Int8RowParams int8;
      float fp8_inv = 0.0f;
      if (v.dtype == DType::kInt8) {
        int8 = WarpInt8Params(src, wire, a.dim, lane);
        if (lane == 0) {
          *reinterpret_cast<float*>(a.block + v.Int8Scale(a.kv, a.head, a.row)) = int8.scale;
          a.block[v.Int8ZeroPoint(a.kv, a.head, a.row)] = int8.zero_point;
        }
      } else if (IsFp8DType(v.dtype)) {
        fp8_inv = RecipRn(*reinterpret_cast<const float*>(a.block + v.Fp8Scale(a.kv, a.head)));
      }
      for (uint32_t i = lane; i < a.dim; i += 32) {
        EncodeStored(dst, v.dtype, i, LoadAsFloat(src, wire, i), int8, fp8_inv);
      }
    }
  }
}

// One warp per payload row, each element by DecodeStored (quant_math.h).
__global__ void DecodeRowsKernel(PayloadMap m, DType wire, uint8_t* payload) {
  const unsigned lane = threadIdx.x & 31u;
  const uint64_t first = blockIdx.x * uint64_t{kWarps} + threadIdx.x / 32;
  const uint64_t warps = uint64_t{gridDim.x} * kWarps;
  const uint32_t wb = DTypeBytes(wire);
  for (uint32_t li = blockIdx.y; li < m.num_layers; li += gridDim.y) {
    const LayerView v = m.layers[li];
    const uint64_t rows = uint64_t{v.KvParts()} * v.num_kv_heads * m.num_tokens;
    for (uint64_t r = first; r < rows; r += warps) {
      const RowAt a = LocateRow(m, v, li, wb, r);
      const uint8_t* src = a.block + a.pool;
      uint8_t* dst = payload + a.payload;
      if (v.dtype == wire) {
        CopyBytes(dst, src, uint64_t{a.dim} * wb, lane, 32);
        continue;
      }
      float scale = 1.0f;
      uint8_t zp = 0;
      if (v.dtype == DType::kInt8) {
        scale = *reinterpret_cast<const float*>(a.block + v.Int8Scale(a.kv, a.head, a.row));
        zp = a.block[v.Int8ZeroPoint(a.kv, a.head, a.row)];
      } else if (IsFp8DType(v.dtype)) {
        scale = *reinterpret_cast<const float*>(a.block + v.Fp8Scale(a.kv, a.head));
      }
      for (uint32_t i = lane; i < a.dim; i += 32) {
        StoreFromFloat(dst, wire, i, DecodeStored(src, v.dtype, i, scale, zp));
      }
    }
  }
}

// grid.x: enough CUDA blocks for the rows of a typical layer (tokens x a few heads), capped; the
// kernels stride over whatever is left. grid.y: one per layer, capped (they stride too).
dim3 RowGrid(const PayloadMap& m, uint64_t tokens_per_block) {
  uint64_t x = (m.num_tokens + tokens_per_block - 1) / tokens_per_block;
  x = x < 1 ? 1 : (x > kMaxGridX ? kMaxGridX : x);
  const uint32_t y = m.num_layers < kMaxGridY ? m.num_layers : kMaxGridY;
  return dim3(static_cast<unsigned>(x), y);
}

// Sets *found when any of the n elements is NaN or Inf. Every writer stores the same value, so
// the race between them is benign and no atomic is needed.
__global__ void NonFiniteKernel(const uint8_t* payload, DType dtype, uint64_t n, uint32_t* found) {
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += stride) {
    if (IsNonFinite(payload, dtype, i)) *found = 1;
  }
}

}  // namespace

cudaError_t FindNonFiniteCuda(const uint8_t* payload, DType dtype, uint64_t n, uint32_t* found,
                              cudaStream_t stream) {
  if (!IsElementDType(dtype)) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  uint64_t blocks = (n + kThreads - 1) / kThreads;
  blocks = blocks > kMaxGridX * 4 ? kMaxGridX * 4 : blocks;
  NonFiniteKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(payload, dtype, n, found);
  return cudaGetLastError();
}

cudaError_t EncodePayloadCuda(const PayloadMap& map, DType wire, const uint8_t* payload,
                              cudaStream_t stream) {
  if (!IsElementDType(wire)) return cudaErrorInvalidValue;
  if (map.num_tokens == 0 || map.num_layers == 0) return cudaSuccess;
  // NOTE: the row kernel reads the scales the first one writes; stream order separates them.
  Fp8ScalesKernel<<<RowGrid(map, 16), kThreads, 0, stream>>>(map, wire, payload);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  EncodeRowsKernel<<<RowGrid(map, 4), kThreads, 0, stream>>>(map, wire, payload);
  return cudaGetLastError();
}

cudaError_t DecodePayloadCuda(const PayloadMap& map, DType wire, uint8_t* payload,
                              cudaStream_t stream) {
  if (!IsElementDType(wire)) return cudaErrorInvalidValue;
  if (map.num_tokens == 0 || map.num_layers == 0) return cudaSuccess;
  DecodeRowsKernel<<<RowGrid(map, 4), kThreads, 0, stream>>>(map, wire, payload);
  return cudaGetLastError();
}

}  // namespace kvbank::kernels
