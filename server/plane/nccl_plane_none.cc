// The NCCL plane's entry points in a build without CUDA or NCCL: a clear error.
#include "server/plane/nccl_plane.h"

namespace kvbank::plane {

bool NcclBuiltIn() { return false; }

absl::StatusOr<std::unique_ptr<NcclPlane>> NcclPlane::Create(NcclOptions) {
  return absl::FailedPreconditionError(
      "this kvbank was built without NCCL (it needs KVBANK_ENABLE_CUDA and libnccl)");
}

}  // namespace kvbank::plane
