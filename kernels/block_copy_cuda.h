// CUDA launchers for the block copy and token gather/scatter kernels (see block_copy.h for the
// semantics; these do the same on a device pool). Launchers return cudaError_t and take the
// stream last. Every pointer inside `map` and every id array must be device memory.
#ifndef KVBANK_KERNELS_BLOCK_COPY_CUDA_H_
#define KVBANK_KERNELS_BLOCK_COPY_CUDA_H_

#include <cuda_runtime.h>

#include "block_copy.h"

namespace kvbank::kernels {

// Device version of PayloadCopyCpu; `buf` is device memory holding payload bytes
// [offset, offset + len).
cudaError_t PayloadCopyCuda(const PayloadMap& map, CopyDirection dir, uint64_t offset, uint8_t* buf,
                            uint64_t len, cudaStream_t stream);

// Device version of ScaleCopyCpu (storage-format payloads); `buf` as for PayloadCopyCuda.
cudaError_t ScaleCopyCuda(const PayloadMap& map, CopyDirection dir, uint64_t offset, uint8_t* buf,
                          uint64_t len, cudaStream_t stream);

// Device version of CopyRowsCpu. layers: [num_layers] device; copies: [n] device.
cudaError_t CopyRowsCuda(uint8_t* pool, uint64_t block_bytes, const LayerView* layers,
                         const RowCopy* copies, size_t n, cudaStream_t stream);

// Device version of CopyBlocksCpu. src_ids, dst_ids: [n] device int32.
cudaError_t CopyBlocksCuda(uint8_t* pool, uint64_t block_bytes, const int32_t* src_ids,
                           const int32_t* dst_ids, size_t n, cudaStream_t stream);

}  // namespace kvbank::kernels

#endif  // KVBANK_KERNELS_BLOCK_COPY_CUDA_H_
