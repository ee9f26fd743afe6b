// The same-host CUDA IPC plane's registry: device buffers of a client process (an inference
// engine's KV buffers) that Append and Fetch name as (region, offset, length), so that a payload
// moves device to device between the client's buffer and a cuda:N pool, with the payload codec on
// the device and no host copy (PayloadWriter::WriteFromDevice / PayloadReader::ReadToDevice).
//
// A client takes a cudaIpcMemHandle_t (64 bytes) of a cudaMalloc allocation (cudaIpcGetMemHandle),
// and sends it with the region's offset in the allocation and its size (RegisterDeviceRegion).
// kvbankd opens it on the pool's device (cudaIpcOpenMemHandle, cudaIpcMemLazyEnablePeerAccess),
// checks offset + size against the allocation's real size (cuMemGetAddressRange), and binds it to
// the caller's tenant under a region id; only that tenant can name the id (any other gets
// NOT_FOUND, as for an id that never was).
//
// Lifetime: a gRPC call cannot tell when its client exits, so a region lives on a lease: every
// Resolve (each Append / Fetch naming it) renews it, UnregisterDeviceRegion ends it at once, and
// a region unused for `lease` is closed (Sweep, on every call of the registry and from the
// server's timer). A client that idles longer registers again (NOT_FOUND tells it). Transfers
// hold the opened mapping (shared_ptr): cudaIpcCloseMemHandle runs when the last one ends, never
// under a kernel.
//
// Security model: kvbankd only opens memory the client exported and reads / writes only within
// the declared slice of it; the pool is never exported to a client.
#ifndef KVBANK_SERVER_PLANE_CUDA_IPC_H_
#define KVBANK_SERVER_PLANE_CUDA_IPC_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/core/tenant_ledger.h"

namespace kvbank::plane {

// sizeof(cudaIpcMemHandle_t).
inline constexpr size_t kCudaIpcHandleBytes = 64;

struct CudaIpcOptions {
  int device = 0;  // the pool's CUDA device: handles are opened there
  uint64_t max_region_bytes = uint64_t{1} << 40;
  uint32_t max_regions = 256;
  absl::Duration lease = absl::Seconds(60);
  // Where each tenant's regions count (its share of max_regions); null: a ledger of its own
  // with max_regions as the cap, one tenant.
  std::shared_ptr<TenantLedger> ledger;
};

// One opened IPC allocation; closed when the last holder lets go. Thread-safe (immutable).
class DeviceMapping {
 public:
  // `close` runs once, in the destructor (cudaIpcCloseMemHandle).
  DeviceMapping(uint8_t* data, uint64_t size, std::function<void()> close)
      : data_(data), size_(size), close_(std::move(close)) {}
  ~DeviceMapping() {
    if (close_) close_();
  }
  DeviceMapping(const DeviceMapping&) = delete;
  DeviceMapping& operator=(const DeviceMapping&) = delete;

  // The client's region: device memory on the pool's device, `size` bytes.
  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  uint8_t* const data_;
  const uint64_t size_;
  const std::function<void()> close_;
};

// Opens a client's region: handle (kCudaIpcHandleBytes), its offset in the exported allocation
// and its size. INVALID_ARGUMENT when the handle does not open or the slice runs past the
// allocation; FAILED_PRECONDITION when CUDA is not built in or there is no such device.
using DeviceOpener = std::function<absl::StatusOr<std::shared_ptr<DeviceMapping>>(
    int device, absl::string_view handle, uint64_t offset, uint64_t size)>;

// cudaIpcOpenMemHandle on `device` (cuda_ipc_open.cc; cuda_ipc_open_none.cc without CUDA).
absl::StatusOr<std::shared_ptr<DeviceMapping>> OpenCudaIpcHandle(int device,
                                                                 absl::string_view handle,
                                                                 uint64_t offset, uint64_t size);

// Bytes of a region, and the mapping that keeps them open while this lives.
struct DeviceBytes {
  std::shared_ptr<DeviceMapping> mapping;
  uint8_t* data = nullptr;  // device memory
  uint64_t size = 0;
};

// The registry. Thread-safe. Lock: mu_ alone, never held across a CUDA call (opening and closing
// run outside it).
class CudaIpcRegions {
 public:
  // `open` (tests inject one): OpenCudaIpcHandle unless set.
  explicit CudaIpcRegions(CudaIpcOptions options, DeviceOpener open = nullptr);
  ~CudaIpcRegions() = default;
  CudaIpcRegions(const CudaIpcRegions&) = delete;
  CudaIpcRegions& operator=(const CudaIpcRegions&) = delete;

  const CudaIpcOptions& options() const { return options_; }

  // Opens `handle` (offset, size within its allocation) for `tenant`; answers the region id.
  // The same handle, offset and size registered again by the tenant answers the region it has
  // (its lease renewed): one handle is never opened twice. The region's place in the tenant's
  // share (and the cap) is taken before the handle is opened, outside the lock, so registrations
  // racing each other never pass the cap. INVALID_ARGUMENT for a handle that is not
  // kCudaIpcHandleBytes long, size 0 or more than max_region_bytes, or what the opener refuses;
  // RESOURCE_EXHAUSTED past the tenant's share of max_regions or the cap itself.
  absl::StatusOr<uint64_t> Register(const std::string& tenant, absl::string_view handle,
                                    uint64_t offset, uint64_t size);
  // Drops the region (closed once no transfer holds it). NOT_FOUND when `tenant` has no region
  // `id`.
  absl::Status Unregister(const std::string& tenant, uint64_t id);
  // Bytes [offset, offset + length) of `tenant`'s region `id`, renewing its lease. `field` names
  // the slice in errors ("header.device_source"): INVALID_ARGUMENT for id 0 or a range past the
  // region (overflow included), NOT_FOUND for an id that is not the tenant's (or expired).
  absl::StatusOr<DeviceBytes> Resolve(const std::string& tenant, uint64_t id, uint64_t offset,
                                      uint64_t length, absl::string_view field);
  // Closes regions whose lease ran out by `now`; answers how many.
  size_t Sweep(absl::Time now = absl::Now());

  size_t num_regions() const;

 private:
  struct Region {
    std::string tenant;
    std::string key;  // tenant, handle, offset and size: a registration of the same answers it
    std::shared_ptr<DeviceMapping> mapping;
    absl::Time expires;
    LedgerClaim claim;  // the region's place in the tenant's share
  };

  const CudaIpcOptions options_;
  const DeviceOpener open_;
  const std::shared_ptr<TenantLedger> ledger_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, Region> regions_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, uint64_t> by_key_ ABSL_GUARDED_BY(mu_);  // Region::key -> id
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace kvbank::plane

#endif  // KVBANK_SERVER_PLANE_CUDA_IPC_H_
