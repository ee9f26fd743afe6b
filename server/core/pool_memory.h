// Where a block pool's bytes live, and every move of them: transfers (BeginWrite / BeginRead),
// block and row copies, attention. Nothing else reads or writes pool bytes.
//
// Three kinds:
//   host         host memory (mmap'd, prefaulted): transfers stream chunk by chunk straight
//                between the payload and the blocks (the default, and the only kind on a machine
//                without a GPU).
//   cuda:N       device memory (cudaMalloc) on GPU N. A transfer's payload is staged in a
//                page-locked host buffer, a piece of whole layers at a time
//                (TransferSpec::staging_bytes), copied asynchronously on the memory's stream, and
//                scattered / gathered / quantized / dequantized by kernels on the device;
//                attention runs there too.
//   host-staged  host memory driven exactly like cuda:N (staged payloads, every move through
//                the whole-payload calls below) with the CPU kernels in place of the CUDA ones. It
//                runs the device data path on a machine without a GPU, which is how the tests
//                cover it.
//
// The store calls these with host-side descriptions (TransferSpec, RowCopy lists, attention
// params whose arrays are host memory) and the memory moves whatever it needs to the device.
// Every call is synchronous: when it returns the bytes are where they were asked to be.
#ifndef KVBANK_SERVER_CORE_POOL_MEMORY_H_
#define KVBANK_SERVER_CORE_POOL_MEMORY_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/attention.h"
#include "kernels/block_copy.h"
#include "kvbank/layout.h"
#include "server/core/transfer.h"

namespace kvbank {

enum class MemoryKind : uint8_t { kHost, kHostStaged, kCuda };

// A host buffer that holds one transfer's payload while it moves (page-locked for cuda:N, so the
// copies to and from the device run asynchronously at full speed). Owned by the transfer.
class StagingBuffer {
 public:
  virtual ~StagingBuffer() = default;
  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }

 protected:
  StagingBuffer(uint8_t* data, uint64_t size) : data_(data), size_(size) {}

 private:
  uint8_t* const data_;
  const uint64_t size_;
};

// A transfer between a dense payload and the pool. `map` is a host-side description: map.pool is
// the memory's base(), and layers / layer_offset / block_table / scale_offset point to host
// arrays that live for the call. convert set: the payload is in that wire dtype and rows are
// converted to / from each layer's storage dtype (kernels/payload_codec.h); unset: a plain copy
// (with scale sections when map.scale_offset is set).
struct PayloadJob {
  kernels::PayloadMap map;
  std::optional<DType> convert;
};

// Thread-safe: calls from several threads may run at once (they touch disjoint blocks: the
// store's references and copy-on-write see to that).
class PoolMemory {
 public:
  virtual ~PoolMemory() = default;
  PoolMemory(const PoolMemory&) = delete;
  PoolMemory& operator=(const PoolMemory&) = delete;

  MemoryKind kind() const { return kind_; }
  // "host", "host-staged" or "cuda:N".
  const std::string& name() const { return name_; }
  // Start of the blocks: a host pointer, or a device pointer for cuda:N.
  uint8_t* base() const { return base_; }
  uint64_t bytes() const { return bytes_; }
  // True when moves wait on a device (cuda:N, and host-staged, which runs that path on the
  // CPU): a caller on a thread that must not block (a gRPC reaction) hands them to a worker.
  bool waits_on_device() const { return kind_ != MemoryKind::kHost; }
  // A writer of `spec`'s payload into the blocks of a pool laid out as `blocks` (which must
  // outlive it): streaming on host memory, staged otherwise (transfer.h). The blocks the table
  // names for the payload's rows must be ones only this transfer writes.
  virtual absl::StatusOr<std::unique_ptr<PayloadWriter>> BeginWrite(
      const BlockLayout& blocks, TransferSpec spec, PayloadWriter::MakePrivate make_private) {
    return NewStagedWriter(this, blocks, std::move(spec), std::move(make_private));
  }
  // A reader of `spec`'s payload from the blocks; the blocks must stay as they are while it
  // lives (the caller holds references on them).
  virtual absl::StatusOr<std::unique_ptr<PayloadReader>> BeginRead(const BlockLayout& blocks,
                                                                   TransferSpec spec) {
    return NewStagedReader(this, blocks, std::move(spec));
  }

  // The whole-payload moves staged transfers are made of (and what tests of a memory kind call).
  // A staging buffer of `bytes` (RESOURCE_EXHAUSTED when none can be had).
  virtual absl::StatusOr<std::unique_ptr<StagingBuffer>> Stage(uint64_t bytes) = 0;
  // payload (host, job.map.total_bytes) -> blocks.
  virtual absl::Status WritePayload(const PayloadJob& job, const uint8_t* payload) = 0;
  // blocks -> payload (host, job.map.total_bytes).
  virtual absl::Status ReadPayload(const PayloadJob& job, uint8_t* payload) = 0;
  // The same moves with the payload in device memory on this memory's device (a data plane's
  // buffer, server/plane/cuda_ipc.h): the kernels read / write it in place, no host copy.
  // FAILED_PRECONDITION naming the memory unless it is cuda:N.
  virtual absl::Status WritePayloadFromDevice(const PayloadJob& job, const uint8_t* payload);
  virtual absl::Status ReadPayloadToDevice(const PayloadJob& job, uint8_t* payload);
  // The index of the first NaN or Inf of `n` elements of `dtype` (fp32 / fp16 / bf16) at device
  // memory `payload`, or -1 when all are finite. FAILED_PRECONDITION unless cuda:N.
  virtual absl::StatusOr<int64_t> FindNonFiniteOnDevice(const uint8_t* payload, DType dtype,
                                                        uint64_t n);
  // dst[i] <- src[i], whole blocks of `block_bytes`.
  virtual absl::Status CopyBlocks(absl::Span<const int32_t> src, absl::Span<const int32_t> dst,
                                  uint64_t block_bytes) = 0;
  // Whole blocks of `block_bytes` to host memory (ids[i] -> host + i * block_bytes) and back:
  // what a lower tier keeps and promotes (server/core/tiers.h). On host memory a memcpy; on
  // cuda:N copies on the memory's stream. `host` need not be page-locked.
  virtual absl::Status CopyBlocksToHost(absl::Span<const int32_t> ids, uint64_t block_bytes,
                                        uint8_t* host);
  virtual absl::Status CopyBlocksFromHost(absl::Span<const int32_t> ids, uint64_t block_bytes,
                                          const uint8_t* host);
  // kernels::CopyRowsCpu's semantics; `layers` are the block layout's.
  virtual absl::Status CopyRows(const BlockLayout& layout,
                                absl::Span<const kernels::RowCopy> copies) = 0;
  // Decode attention over the blocks. p.kv.pool is base(); every other pointer of p (layers,
  // indptr, indices, lengths, q, out, lse, token_probs and what it points to) is host memory.
  // REQUIRES: kernels::ValidateDecodeAttention(p) is empty; every length <= max_length.
  // num_threads: the CPU kernel's threads (0: all cores); ignored on a GPU.
  virtual absl::Status Attend(const kernels::DecodeAttentionParams& p, uint32_t max_length,
                              uint32_t num_threads) = 0;
  // OK while the memory can serve; else why not (a CUDA device whose context took a sticky error:
  // every later call on it fails). Health reports NOT_SERVING then. Cheap; any thread.
  virtual absl::Status Health() const { return absl::OkStatus(); }

 protected:
  PoolMemory(MemoryKind kind, std::string name, uint8_t* base, uint64_t bytes)
      : kind_(kind), name_(std::move(name)), base_(base), bytes_(bytes) {}

 private:
  const MemoryKind kind_;
  const std::string name_;
  uint8_t* const base_;
  const uint64_t bytes_;
};

// `bytes` of host memory (page-aligned, transparent huge pages requested, every page touched
// when `prefault`). staged: the host-staged kind. RESOURCE_EXHAUSTED when it cannot be mapped.
absl::StatusOr<std::unique_ptr<PoolMemory>> CreateHostMemory(uint64_t bytes, bool prefault,
                                                             bool staged = false);

// Where pools go, parsed from --device: "host" (or "cpu"), "host-staged", "cuda" (= cuda:0),
// "cuda:N", or "auto": cuda:0 when a CUDA device is present (and CUDA was built in), else host.
struct DeviceSpec {
  MemoryKind kind = MemoryKind::kHost;
  int cuda_device = 0;
  std::string Name() const;
};
// INVALID_ARGUMENT for an unknown spelling; FAILED_PRECONDITION for cuda:N when there is no such
// device (or CUDA was not built in), naming how many there are.
absl::StatusOr<DeviceSpec> ResolveDevice(const std::string& spec);

// `bytes` of pool memory on `device` (cuda: cudaMalloc on that device).
absl::StatusOr<std::unique_ptr<PoolMemory>> CreatePoolMemory(const DeviceSpec& device,
                                                             uint64_t bytes, bool prefault = true);

// CUDA devices visible to this process (0 when CUDA was not built in, or no driver or device).
int CudaDeviceCount();
// Free and total bytes of CUDA device `device` (cudaMemGetInfo). FAILED_PRECONDITION without it.
absl::Status CudaMemoryInfo(int device, uint64_t* free_bytes, uint64_t* total_bytes);

}  // namespace kvbank

#endif  // KVBANK_SERVER_CORE_POOL_MEMORY_H_
