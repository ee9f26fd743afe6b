// OpenCudaIpcHandle in a build without CUDA: a clear refusal.
#include "absl/status/status.h"
#include "server/plane/cuda_ipc.h"

namespace kvbank::plane {

absl::StatusOr<std::shared_ptr<DeviceMapping>> OpenCudaIpcHandle(int, absl::string_view, uint64_t,
                                                                 uint64_t) {
  return absl::FailedPreconditionError(
      "device regions need CUDA: this kvbank was built without it (KVBANK_ENABLE_CUDA)");
}

}  // namespace kvbank::plane
