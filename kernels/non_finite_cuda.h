// A scan of a payload on the device for NaN / Inf, the CUDA counterpart of kernels::FindNonFinite
// (quant.h): a converted payload that a data plane received on the device (NCCL) is checked
// there before it is quantized, as the host path checks it before it is staged.
#ifndef KVBANK_KERNELS_NON_FINITE_CUDA_H_
#define KVBANK_KERNELS_NON_FINITE_CUDA_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "kvbank/layout.h"

namespace kvbank::kernels {

// *first (device memory) <- the index of the first NaN or Inf among the `n` elements of `src`
// (device memory, [n] of `dtype`: fp32, fp16 or bf16), or UINT64_MAX when every one is finite.
// Sets *first itself; launches nothing but that set for n == 0. cudaErrorInvalidValue for
// another dtype.
cudaError_t FindNonFiniteCuda(const void* src, DType dtype, uint64_t n, unsigned long long* first,
                              cudaStream_t stream);

}  // namespace kvbank::kernels

#endif  // KVBANK_KERNELS_NON_FINITE_CUDA_H_
