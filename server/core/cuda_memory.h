// The cuda:N pool memory (see pool_memory.h): blocks in cudaMalloc memory, transfers staged in
// page-locked host buffers and moved by kernels on the device. Built from cuda_memory.cc when
// CUDA is enabled, else from cuda_memory_none.cc, whose functions say CUDA is not built in.
#ifndef KVBANK_SERVER_CORE_CUDA_MEMORY_H_
#define KVBANK_SERVER_CORE_CUDA_MEMORY_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "server/core/pool_memory.h"

namespace kvbank {

// True when this build has the CUDA backend.
bool CudaBuiltIn();
// `bytes` of device memory on CUDA device `device`, as a PoolMemory named "cuda:<device>".
// FAILED_PRECONDITION when CUDA is not built in or there is no such device; RESOURCE_EXHAUSTED
// when cudaMalloc fails (naming the device's free bytes).
absl::StatusOr<std::unique_ptr<PoolMemory>> CreateCudaMemory(int device, uint64_t bytes);

}  // namespace kvbank

#endif  // KVBANK_SERVER_CORE_CUDA_MEMORY_H_
