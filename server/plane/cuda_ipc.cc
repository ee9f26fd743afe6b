#include "server/plane/cuda_ipc.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace kvbank::plane {

namespace {
std::shared_ptr<TenantLedger> LedgerFor(const CudaIpcOptions& o) {
  if (o.ledger != nullptr) return o.ledger;
  std::shared_ptr<TenantLedger> own = TenantLedger::Create();
  own->SetCap(Resource::kDeviceRegions, o.max_regions);
  return own;
}
}  // namespace

CudaIpcRegions::CudaIpcRegions(CudaIpcOptions options, DeviceOpener open)
    : options_(std::move(options)),
      open_(open ? std::move(open) : DeviceOpener(OpenCudaIpcHandle)),
      ledger_(LedgerFor(options_)) {}

absl::StatusOr<uint64_t> CudaIpcRegions::Register(const std::string& tenant,
                                                  absl::string_view handle, uint64_t offset,
                                                  uint64_t size) {
  if (handle.size() != kCudaIpcHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "handle is ", handle.size(), " bytes; a cudaIpcMemHandle_t is ", kCudaIpcHandleBytes));
  }
  if (size == 0) return absl::InvalidArgumentError("size is 0: an empty device region");
  if (size > options_.max_region_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("size ", size, " is more than ",
                                                   options_.max_region_bytes,
                                                   " (--cuda-ipc-max-region-bytes)"));
  }
  Sweep();
  const std::string key = absl::StrCat(tenant.size(), ":", tenant, handle, ":", offset, ":", size);
  {
    absl::MutexLock lock(&mu_);
    if (auto it = by_key_.find(key); it != by_key_.end()) {
      regions_[it->second].expires = absl::Now() + options_.lease;
      return it->second;
    }
  }
  // The place first (atomically, in the ledger), then the open, outside the lock: opening maps
  // memory and may take milliseconds.
  auto claim = ledger_->Acquire(tenant, Resource::kDeviceRegions);
  if (!claim.ok()) {
    return absl::Status(claim.status().code(),
                        absl::StrCat(claim.status().message(), " (--cuda-ipc-max-regions)"));
  }
  absl::StatusOr<std::shared_ptr<DeviceMapping>> mapping =
      open_(options_.device, handle, offset, size);
  if (!mapping.ok()) return mapping.status();  // the claim goes back
  std::shared_ptr<DeviceMapping> extra;        // a racing registration's, closed outside the lock
  absl::MutexLock lock(&mu_);
  if (auto it = by_key_.find(key); it != by_key_.end()) {  // registered meanwhile: that one
    extra = *std::move(mapping);
    regions_[it->second].expires = absl::Now() + options_.lease;
    return it->second;
  }
  const uint64_t id = next_id_++;
  regions_[id] =
      Region{tenant, key, *std::move(mapping), absl::Now() + options_.lease, *std::move(claim)};
  by_key_[key] = id;
  return id;
}

absl::Status CudaIpcRegions::Unregister(const std::string& tenant, uint64_t id) {
  std::shared_ptr<DeviceMapping> closing;  // closed after the lock is released
  absl::MutexLock lock(&mu_);
  auto it = regions_.find(id);
  if (it == regions_.end() || it->second.tenant != tenant) {
    return absl::NotFoundError(
        absl::StrCat("region_id ", id, " names no device region of this tenant"));
  }
  closing = std::move(it->second.mapping);
  by_key_.erase(it->second.key);
  regions_.erase(it);
  return absl::OkStatus();
}

absl::StatusOr<DeviceBytes> CudaIpcRegions::Resolve(const std::string& tenant, uint64_t id,
                                                    uint64_t offset, uint64_t length,
                                                    absl::string_view field) {
  if (id == 0) return absl::InvalidArgumentError(absl::StrCat(field, ".region_id is 0 (unset)"));
  const absl::Time now = absl::Now();
  std::shared_ptr<DeviceMapping> mapping;
  {
    absl::MutexLock lock(&mu_);
    auto it = regions_.find(id);
    if (it == regions_.end() || it->second.tenant != tenant || it->second.expires <= now) {
      return absl::NotFoundError(
          absl::StrCat(field, ".region_id ", id, " names no device region of this tenant"));
    }
    it->second.expires = now + options_.lease;
    mapping = it->second.mapping;
  }
  // Written so that nothing overflows: offset <= size, then length <= size - offset.
  if (offset > mapping->size() || length > mapping->size() - offset) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": offset ", offset, " + length ", length,
                                                   " runs past the device region's ",
                                                   mapping->size(), " bytes"));
  }
  DeviceBytes out;
  out.data = mapping->data() + offset;
  out.size = length;
  out.mapping = std::move(mapping);
  return out;
}

size_t CudaIpcRegions::Sweep(absl::Time now) {
  std::vector<std::shared_ptr<DeviceMapping>> closing;  // closed after the lock is released
  absl::MutexLock lock(&mu_);
  for (auto it = regions_.begin(); it != regions_.end();) {
    if (it->second.expires <= now) {
      closing.push_back(std::move(it->second.mapping));
      by_key_.erase(it->second.key);
      regions_.erase(it++);
    } else {
      ++it;
    }
  }
  return closing.size();
}

size_t CudaIpcRegions::num_regions() const {
  absl::MutexLock lock(&mu_);
  return regions_.size();
}

}  // namespace kvbank::plane
