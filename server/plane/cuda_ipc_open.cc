// OpenCudaIpcHandle where CUDA is built in: cudaIpcOpenMemHandle on the pool's device, the slice
// checked against the allocation's real size. The driver's cuMemGetAddressRange is found through
// the runtime (cudaGetDriverEntryPoint*), so kvbankd links no libcuda and still starts on a
// machine without a driver.
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstring>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "server/plane/cuda_ipc.h"

namespace kvbank::plane {
namespace {

static_assert(sizeof(cudaIpcMemHandle_t) == kCudaIpcHandleBytes);

std::string CudaErrorText(cudaError_t e) {
  return absl::StrCat(cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
}

using GetAddressRange = CUresult (*)(CUdeviceptr* base, size_t* size, CUdeviceptr ptr);

// cuMemGetAddressRange, or null when the driver does not offer it.
GetAddressRange FindGetAddressRange() {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
  const cudaError_t e = cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000,
                                                         cudaEnableDefault, &found);
#else
  const cudaError_t e =
      cudaGetDriverEntryPoint("cuMemGetAddressRange", &fn, cudaEnableDefault, &found);
#endif
  if (e != cudaSuccess || found != cudaDriverEntryPointSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return reinterpret_cast<GetAddressRange>(fn);
}

// Makes `device` current for the guard's life (CUDA's current device is per thread).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      cudaGetLastError();
      previous_ = -1;
    }
    status_ = previous_ == device ? cudaSuccess : cudaSetDevice(device);
    if (status_ != cudaSuccess) cudaGetLastError();
    restore_ = status_ == cudaSuccess && previous_ >= 0 && previous_ != device;
  }
  ~DeviceGuard() {
    if (restore_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  cudaError_t status() const { return status_; }

 private:
  int previous_ = -1;
  cudaError_t status_ = cudaSuccess;
  bool restore_ = false;
};

}  // namespace

absl::StatusOr<std::shared_ptr<DeviceMapping>> OpenCudaIpcHandle(int device,
                                                                 absl::string_view handle,
                                                                 uint64_t offset, uint64_t size) {
  if (handle.size() != kCudaIpcHandleBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("handle is ", handle.size(), " bytes, not ", kCudaIpcHandleBytes));
  }
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    n = 0;
  }
  if (device < 0 || device >= n) {
    return absl::FailedPreconditionError(absl::StrCat(
        "no CUDA device ", device, " to open a device region on: this machine has ", n));
  }
  DeviceGuard guard(device);
  if (guard.status() != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("cuda:", device, ": selecting the device: ", CudaErrorText(guard.status())));
  }
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.data(), sizeof(h));
  void* p = nullptr;
  const cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda:", device, ": cudaIpcOpenMemHandle refused the handle: ", CudaErrorText(e),
        " (a handle of a live cudaMalloc allocation of another process on this host?)"));
  }
  auto close = [device, p] {
    DeviceGuard g(device);
    cudaIpcCloseMemHandle(p);
    cudaGetLastError();
  };
  // The allocation's real size: the declared slice must lie within it.
  GetAddressRange range = FindGetAddressRange();
  CUdeviceptr base = 0;
  size_t bytes = 0;
  if (range == nullptr || range(&base, &bytes, reinterpret_cast<CUdeviceptr>(p)) != CUDA_SUCCESS) {
    close();
    return absl::InternalError(
        absl::StrCat("cuda:", device,
                     ": cuMemGetAddressRange failed on an opened handle: cannot check its size"));
  }
  const uint64_t have = bytes - (reinterpret_cast<CUdeviceptr>(p) - base);
  if (offset > have || size > have - offset) {
    close();
    return absl::InvalidArgumentError(absl::StrCat("offset ", offset, " + size ", size,
                                                   " runs past the exported allocation's ", have,
                                                   " bytes"));
  }
  return std::make_shared<DeviceMapping>(static_cast<uint8_t*>(p) + offset, size, std::move(close));
}

}  // namespace kvbank::plane
