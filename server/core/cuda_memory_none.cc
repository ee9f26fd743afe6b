// The CUDA backend's entry points in a build without CUDA: no device, and a clear error.
#include "absl/status/status.h"
#include "server/core/cuda_memory.h"

namespace kvbank {

bool CudaBuiltIn() { return false; }

int CudaDeviceCount() { return 0; }

absl::Status CudaMemoryInfo(int device, uint64_t* free_bytes, uint64_t* total_bytes) {
  return absl::FailedPreconditionError("this kvbank was built without CUDA (KVBANK_ENABLE_CUDA)");
}

absl::StatusOr<std::unique_ptr<PoolMemory>> CreateCudaMemory(int device, uint64_t bytes) {
  return absl::FailedPreconditionError("this kvbank was built without CUDA (KVBANK_ENABLE_CUDA)");
}

}  // namespace kvbank
