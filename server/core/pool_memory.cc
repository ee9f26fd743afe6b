#include "server/core/pool_memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "kernels/payload_codec.h"
#include "kernels/quant.h"
#include "server/core/core_lock.h"
#include "server/core/cuda_memory.h"

namespace kvbank {

absl::Status PoolMemory::WritePayloadFromDevice(const PayloadJob&, const uint8_t*) {
  return absl::FailedPreconditionError(absl::StrCat(
      "a payload in device memory needs a pool in device memory (--device cuda:N); this pool is "
      "in ",
      name(), " memory"));
}

absl::Status PoolMemory::ReadPayloadToDevice(const PayloadJob& job, uint8_t* payload) {
  return WritePayloadFromDevice(job, payload);
}

// Host memory (both host kinds): base() is a host pointer.
absl::Status PoolMemory::CopyBlocksToHost(absl::Span<const int32_t> ids, uint64_t block_bytes,
                                          uint8_t* host) {
  CheckNoCoreLock("a copy of blocks to host memory");
  for (size_t i = 0; i < ids.size(); ++i) {
    std::memcpy(host + i * block_bytes, base() + uint64_t(ids[i]) * block_bytes, block_bytes);
  }
  return absl::OkStatus();
}

absl::Status PoolMemory::CopyBlocksFromHost(absl::Span<const int32_t> ids, uint64_t block_bytes,
                                            const uint8_t* host) {
  CheckNoCoreLock("a copy of blocks from host memory");
  for (size_t i = 0; i < ids.size(); ++i) {
    std::memcpy(base() + uint64_t(ids[i]) * block_bytes, host + i * block_bytes, block_bytes);
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> PoolMemory::FindNonFiniteOnDevice(const uint8_t*, DType, uint64_t) {
  return WritePayloadFromDevice(PayloadJob{}, nullptr);
}

namespace {

// Host staging buffers kept for reuse (the host-staged kind stages every transfer): a fresh
// buffer of many MiB would page-fault on every transfer, which is not what staging costs.
class StagingCache {
 public:
  static constexpr size_t kMaxBuffers = 4;
  static constexpr uint64_t kMaxBytes = uint64_t{512} << 20;

  ~StagingCache() {
    for (auto& [p, n] : free_) std::free(p);
  }
  // A buffer of at least `bytes` (a kept one when one fits, at most twice as large).
  std::pair<uint8_t*, uint64_t> Take(uint64_t bytes) {
    {
      absl::MutexLock lock(&mu_);
      for (size_t i = 0; i < free_.size(); ++i) {
        if (free_[i].second >= bytes && free_[i].second / 2 <= bytes) {
          auto b = free_[i];
          free_.erase(free_.begin() + i);
          kept_ -= b.second;
          return b;
        }
      }
    }
    const uint64_t n = std::max<uint64_t>(bytes, 1);
    return {static_cast<uint8_t*>(std::malloc(n)), n};
  }
  void Give(std::pair<uint8_t*, uint64_t> b) {
    {
      absl::MutexLock lock(&mu_);
      if (free_.size() < kMaxBuffers && kept_ + b.second <= kMaxBytes) {
        free_.push_back(b);
        kept_ += b.second;
        return;
      }
    }
    std::free(b.first);
  }

 private:
  absl::Mutex mu_;
  std::vector<std::pair<uint8_t*, uint64_t>> free_ ABSL_GUARDED_BY(mu_);
  uint64_t kept_ ABSL_GUARDED_BY(mu_) = 0;
};

class CachedStaging final : public StagingBuffer {
 public:
  CachedStaging(std::shared_ptr<StagingCache> cache, std::pair<uint8_t*, uint64_t> b, uint64_t size)
      : StagingBuffer(b.first, size), cache_(std::move(cache)), buffer_(b) {}
  ~CachedStaging() override { cache_->Give(buffer_); }

 private:
  const std::shared_ptr<StagingCache> cache_;
  const std::pair<uint8_t*, uint64_t> buffer_;
};

// Host memory: mmap'd once, unmapped at the end. The host kind streams transfers; the
// host-staged kind stages them as cuda:N does, through the whole-payload calls below.
class HostMemory final : public PoolMemory {
 public:
  HostMemory(bool staged, uint8_t* base, uint64_t bytes)
      : PoolMemory(staged ? MemoryKind::kHostStaged : MemoryKind::kHost,
                   staged ? "host-staged" : "host", base, bytes) {}
  ~HostMemory() override { munmap(base(), bytes()); }

  absl::StatusOr<std::unique_ptr<PayloadWriter>> BeginWrite(
      const BlockLayout& blocks, TransferSpec spec,
      PayloadWriter::MakePrivate make_private) override {
    if (kind() == MemoryKind::kHostStaged) {
      return NewStagedWriter(this, blocks, std::move(spec), std::move(make_private));
    }
    return NewStreamingWriter(this, blocks, std::move(spec), std::move(make_private));
  }
  absl::StatusOr<std::unique_ptr<PayloadReader>> BeginRead(const BlockLayout& blocks,
                                                           TransferSpec spec) override {
    if (kind() == MemoryKind::kHostStaged) return NewStagedReader(this, blocks, std::move(spec));
    return NewStreamingReader(this, blocks, std::move(spec));
  }

  absl::StatusOr<std::unique_ptr<StagingBuffer>> Stage(uint64_t bytes) override {
    auto b = staging_->Take(bytes);
    if (b.first == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot allocate ", bytes, " staging bytes"));
    }
    return std::unique_ptr<StagingBuffer>(new CachedStaging(staging_, b, bytes));
  }

  absl::Status WritePayload(const PayloadJob& job, const uint8_t* payload) override {
    if (job.convert.has_value()) {
      kernels::EncodePayloadCpu(job.map, *job.convert, payload);
    } else {
      uint8_t* bytes = const_cast<uint8_t*>(payload);  // read, never written
      kernels::PayloadCopyCpu(job.map, kernels::CopyDirection::kPayloadToPool, 0, bytes,
                              job.map.total_bytes);
      kernels::ScaleCopyCpu(job.map, kernels::CopyDirection::kPayloadToPool, 0, bytes,
                            job.map.total_bytes);
    }
    return absl::OkStatus();
  }

  absl::Status ReadPayload(const PayloadJob& job, uint8_t* payload) override {
    if (job.convert.has_value()) {
      kernels::DecodePayloadCpu(job.map, *job.convert, payload);
    } else {
      kernels::PayloadCopyCpu(job.map, kernels::CopyDirection::kPoolToPayload, 0, payload,
                              job.map.total_bytes);
      kernels::ScaleCopyCpu(job.map, kernels::CopyDirection::kPoolToPayload, 0, payload,
                            job.map.total_bytes);
    }
    return absl::OkStatus();
  }

  // Host-staged memory's device is the host: a "device" payload is host memory, so the device
  // data planes' path into the pool (WriteFromDevice / ReadToDevice) runs on any machine too.
  absl::Status WritePayloadFromDevice(const PayloadJob& job, const uint8_t* payload) override {
    if (kind() != MemoryKind::kHostStaged) return PoolMemory::WritePayloadFromDevice(job, payload);
    return WritePayload(job, payload);
  }
  absl::Status ReadPayloadToDevice(const PayloadJob& job, uint8_t* payload) override {
    if (kind() != MemoryKind::kHostStaged) return PoolMemory::ReadPayloadToDevice(job, payload);
    return ReadPayload(job, payload);
  }
  absl::StatusOr<int64_t> FindNonFiniteOnDevice(const uint8_t* payload, DType dtype,
                                                uint64_t n) override {
    if (kind() != MemoryKind::kHostStaged) {
      return PoolMemory::FindNonFiniteOnDevice(payload, dtype, n);
    }
    return kernels::FindNonFinite(payload, dtype, n);
  }

  absl::Status CopyBlocks(absl::Span<const int32_t> src, absl::Span<const int32_t> dst,
                          uint64_t block_bytes) override {
    CheckNoCoreLock("a block copy");
    kernels::CopyBlocksCpu(base(), block_bytes, src.data(), dst.data(), src.size());
    return absl::OkStatus();
  }

  absl::Status CopyRows(const BlockLayout& layout,
                        absl::Span<const kernels::RowCopy> copies) override {
    CheckNoCoreLock("a row copy");
    kernels::CopyRowsCpu(base(), layout.block_bytes, layout.layers.data(), copies.data(),
                         copies.size());
    return absl::OkStatus();
  }

  absl::Status Attend(const kernels::DecodeAttentionParams& p, uint32_t max_length,
                      uint32_t num_threads) override {
    kernels::DecodeAttentionCpu(p, num_threads);
    return absl::OkStatus();
  }

 private:
  // Shared with the staging buffers handed out, which may outlive the memory.
  const std::shared_ptr<StagingCache> staging_ = std::make_shared<StagingCache>();
};

}  // namespace

absl::StatusOr<std::unique_ptr<PoolMemory>> CreateHostMemory(uint64_t bytes, bool prefault,
                                                             bool staged) {
  if (bytes == 0) return absl::InvalidArgumentError("pool memory of 0 bytes");
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot map ", bytes, " bytes of host memory"));
  }
  madvise(p, bytes, MADV_HUGEPAGE);  // best effort
  if (prefault) {
    // One write per page (after the huge-page advice, so 2 MiB pages where the kernel has them):
    // the pool is a reservation, and first-touch faults would otherwise land on the append path.
    const long page = sysconf(_SC_PAGESIZE);
    for (uint64_t off = 0; off < bytes; off += uint64_t(page)) static_cast<uint8_t*>(p)[off] = 0;
  }
  return std::unique_ptr<PoolMemory>(new HostMemory(staged, static_cast<uint8_t*>(p), bytes));
}

std::string DeviceSpec::Name() const {
  switch (kind) {
    case MemoryKind::kHost:
      return "host";
    case MemoryKind::kHostStaged:
      return "host-staged";
    case MemoryKind::kCuda:
      return absl::StrCat("cuda:", cuda_device);
  }
  return "?";
}

absl::StatusOr<DeviceSpec> ResolveDevice(const std::string& spec) {
  DeviceSpec d;
  if (spec == "host" || spec == "cpu") return d;
  if (spec == "host-staged") {
    d.kind = MemoryKind::kHostStaged;
    return d;
  }
  const int count = CudaDeviceCount();
  if (spec == "auto") {
    if (count > 0) d.kind = MemoryKind::kCuda;
    return d;
  }
  absl::string_view s = spec;
  if (s == "cuda" || absl::StartsWith(s, "cuda:")) {
    int n = 0;
    if (s.size() > 4 && !absl::SimpleAtoi(s.substr(5), &n)) {
      return absl::InvalidArgumentError(
          absl::StrCat("device '", spec, "': bad CUDA device number"));
    }
    if (!CudaBuiltIn()) {
      return absl::FailedPreconditionError(
          absl::StrCat("device '", spec, "': this kvbank was built without CUDA"));
    }
    if (n < 0 || n >= count) {
      return absl::FailedPreconditionError(
          absl::StrCat("device '", spec, "': no such CUDA device (", count, " visible)"));
    }
    d.kind = MemoryKind::kCuda;
    d.cuda_device = n;
    return d;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "device '", spec, "': expected auto, host (or cpu), cuda, cuda:N or host-staged"));
}

absl::StatusOr<std::unique_ptr<PoolMemory>> CreatePoolMemory(const DeviceSpec& device,
                                                             uint64_t bytes, bool prefault) {
  switch (device.kind) {
    case MemoryKind::kHost:
      return CreateHostMemory(bytes, prefault, /*staged=*/false);
    case MemoryKind::kHostStaged:
      return CreateHostMemory(bytes, prefault, /*staged=*/true);
    case MemoryKind::kCuda:
      return CreateCudaMemory(device.cuda_device, bytes);
  }
  return absl::InvalidArgumentError("unknown memory kind");
}

}  // namespace kvbank
