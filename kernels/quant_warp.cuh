// Warp-level pieces of the CUDA codecs, shared by quant.cu and payload_codec.cu so that a row is
// quantized the same way wherever the device does it (and, through quant_math.h, the same way as
// on the CPU).
#ifndef KVBANK_KERNELS_QUANT_WARP_CUH_
#define KVBANK_KERNELS_QUANT_WARP_CUH_

#include <cstdint>

#include "kernels/quant_math.h"

namespace kvbank::kernels {

// The int8 parameters of row src[0, dim) of dtype `d`, computed by a whole warp (every lane
// calls it; `lane` is threadIdx.x % 32) and returned to every lane. Min / max by shuffles: order
// does not matter (min / max of finite values is exact, and +-0 ties do not change
// Int8ParamsFor's result).
__device__ inline qmath::Int8RowParams WarpInt8Params(const void* src, DType d, uint32_t dim,
                                                      unsigned lane) {
  float mn = INFINITY, mx = -INFINITY;
  for (uint32_t i = lane; i < dim; i += 32) {
    const float x = qmath::LoadAsFloat(src, d, i);
    mn = x < mn ? x : mn;
    mx = x > mx ? x : mx;
  }
  for (int off = 16; off > 0; off >>= 1) {
    const float omn = __shfl_xor_sync(0xffffffffu, mn, off);
    const float omx = __shfl_xor_sync(0xffffffffu, mx, off);
    mn = omn < mn ? omn : mn;
    mx = omx > mx ? omx : mx;
  }
  return qmath::Int8ParamsFor(mn, mx);
}

}  // namespace kvbank::kernels

#endif  // KVBANK_KERNELS_QUANT_WARP_CUH_
