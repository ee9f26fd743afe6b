// CUDA versions of the whole-payload codec (payload_codec.h has the semantics). Every pointer,
// the ones inside `map` included (pool, layers, layer_offset, block_table), is device memory.
// For finite input they write the same bytes as the CPU versions: both run quant_math.h's math.
// Launchers return cudaError_t (launch status; faults surface at the next sync), take the stream
// last, and launch nothing for an empty payload; an unsupported wire dtype returns
// cudaErrorInvalidValue.
#ifndef KVBANK_KERNELS_PAYLOAD_CODEC_CUDA_H_
#define KVBANK_KERNELS_PAYLOAD_CODEC_CUDA_H_

#include <cuda_runtime.h>

#include "kernels/payload_codec.h"

namespace kvbank::kernels {

cudaError_t EncodePayloadCuda(const PayloadMap& map, DType wire, const uint8_t* payload,
                              cudaStream_t stream);
cudaError_t DecodePayloadCuda(const PayloadMap& map, DType wire, uint8_t* payload,
                              cudaStream_t stream);
// Sets *found (device memory; the caller zeroes it first) to 1 when any of the n elements of
// `dtype` (fp32 / fp16 / bf16) at `payload` ([n], device memory) is NaN or Inf; else leaves it.
cudaError_t FindNonFiniteCuda(const uint8_t* payload, DType dtype, uint64_t n, uint32_t* found,
                              cudaStream_t stream);

}  // namespace kvbank::kernels

#endif  // KVBANK_KERNELS_PAYLOAD_CODEC_CUDA_H_
