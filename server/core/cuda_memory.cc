// The cuda:N pool memory (see pool_memory.h and cuda_memory.h): the blocks are one cudaMalloc
// allocation and every move is a kernel on the memory's own stream.
//
// Each call takes one of a few lanes (a stream, a grow-only device scratch buffer and a
// page-locked argument block, under the lane's mutex) from start to end: it packs the host-side
// description (layer views, offsets, block table, ids, ...) into the argument block, sends that
// to the scratch in one copy, copies the payload next to it, launches the kernels, and
// synchronizes its stream before returning. Calls from several threads run on different lanes at
// once (a free lane is taken first), so one transfer's copies overlap another's kernels.
//
// Staging buffers are page-locked (cudaHostAlloc) so the payload copies run at full speed. They
// come from a small cache, since cudaHostAlloc costs milliseconds per call and cudaFreeHost
// synchronizes the device.
//
// Lock order: a lane's mutex, then PinnedCache::mu_ (never held across a CUDA call). A call
// holds one lane at a time.
#include "server/core/cuda_memory.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "kernels/attention.h"
#include "kernels/attention_cuda.h"
#include "kernels/block_copy.h"
#include "kernels/block_copy_cuda.h"
#include "kernels/payload_codec.h"
#include "kernels/payload_codec_cuda.h"
#include "kernels/quant.h"
#include "kvbank/layout.h"
#include "server/core/core_lock.h"
#include "server/core/pool_memory.h"

namespace kvbank {
namespace {

// Calls that may run on the device at once.
constexpr int kLanes = 4;
// Alignment of every array in the device scratch (cudaMalloc's own).
constexpr uint64_t kScratchAlign = 256;
// Page-locked buffers are allocated in multiples of this, so that close sizes share buffers.
constexpr uint64_t kPinnedGranule = uint64_t{64} << 10;
// What the pinned cache keeps of released buffers; more is freed.
constexpr size_t kMaxCachedBuffers = 8;
constexpr uint64_t kMaxCachedBytes = uint64_t{256} << 20;

// In a CudaMemory call: returns the call's failure (Fail: drains the stream, names `what`) when
// `expr`, a CUDA call or launch, did not succeed.
#define KVBANK_CUDA_TRY(expr, what)                     \
  do {                                                  \
    const cudaError_t e_ = (expr);                      \
    if (e_ != cudaSuccess) return Fail(lane, e_, what); \
  } while (0)

std::string CudaErrorText(cudaError_t e) {
  return absl::StrCat(cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
}

// Makes `device` the calling thread's current device for the guard's life, and restores the
// previous one after (CUDA's current device is per thread; the store calls from many threads,
// and an embedding process may use the device too).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : device_(device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      cudaGetLastError();
      previous_ = -1;
    }
    status_ = previous_ == device ? cudaSuccess : cudaSetDevice(device);
    if (status_ != cudaSuccess) cudaGetLastError();
  }
  ~DeviceGuard() {
    if (status_ == cudaSuccess && previous_ >= 0 && previous_ != device_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

  cudaError_t status() const { return status_; }

 private:
  const int device_;
  int previous_ = -1;
  cudaError_t status_ = cudaSuccess;
};

// Page-locked host buffers, kept after their staging buffer is released for the next Stage that
// fits. Shared (shared_ptr) by the memory and every staging buffer it handed out, so a staging
// buffer may outlive its memory. Thread-safe.
class PinnedCache {
 public:
  struct Buffer {
    uint8_t* data = nullptr;
    uint64_t capacity = 0;
  };

  explicit PinnedCache(int device) : device_(device) {}
  ~PinnedCache() {
    DeviceGuard guard(device_);
    for (const Buffer& b : free_) cudaFreeHost(b.data);
  }
  PinnedCache(const PinnedCache&) = delete;
  PinnedCache& operator=(const PinnedCache&) = delete;

  // A buffer of at least `bytes`: a cached one of at most twice the size, else a new one.
  absl::StatusOr<Buffer> Take(uint64_t bytes) {
    const uint64_t want = AlignUp(std::max<uint64_t>(bytes, 1), kPinnedGranule);
    {
      absl::MutexLock lock(&mu_);
      auto best = free_.end();
      for (auto it = free_.begin(); it != free_.end(); ++it) {
        if (it->capacity >= want && it->capacity / 2 <= want &&
            (best == free_.end() || it->capacity < best->capacity)) {
          best = it;
        }
      }
      if (best != free_.end()) {
        const Buffer b = *best;
        free_.erase(best);
        free_bytes_ -= b.capacity;
        return b;
      }
    }
    // NOTE: slow (the pages are locked one by one); the cache is there to make this rare.
    DeviceGuard guard(device_);
    void* p = nullptr;
    const cudaError_t e = guard.status() != cudaSuccess
                              ? guard.status()
                              : cudaHostAlloc(&p, want, cudaHostAllocPortable);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return absl::ResourceExhaustedError(absl::StrCat("cuda:", device_, ": no page-locked host ",
                                                       "buffer of ", want,
                                                       " bytes for staging: ", CudaErrorText(e)));
    }
    return Buffer{static_cast<uint8_t*>(p), want};
  }

  // Takes `b` back: cached while the cache has room, else freed.
  void Give(Buffer b) {
    {
      absl::MutexLock lock(&mu_);
      if (free_.size() < kMaxCachedBuffers && free_bytes_ + b.capacity <= kMaxCachedBytes) {
        free_.push_back(b);
        free_bytes_ += b.capacity;
        return;
      }
    }
    DeviceGuard guard(device_);
    cudaFreeHost(b.data);  // NOTE: synchronizes the device
  }

 private:
  const int device_;
  absl::Mutex mu_;
  std::vector<Buffer> free_ ABSL_GUARDED_BY(mu_);
  uint64_t free_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

// A staging buffer over a cached page-locked buffer; the destructor gives it back.
class PinnedStagingBuffer final : public StagingBuffer {
 public:
  PinnedStagingBuffer(std::shared_ptr<PinnedCache> cache, PinnedCache::Buffer buffer, uint64_t size)
      : StagingBuffer(buffer.data, size), cache_(std::move(cache)), buffer_(buffer) {}
  ~PinnedStagingBuffer() override { cache_->Give(buffer_); }

 private:
  const std::shared_ptr<PinnedCache> cache_;
  const PinnedCache::Buffer buffer_;
};

// Where one call's arrays go in the device scratch: first the ones the host fills (Host(); sent
// in one copy of host_bytes()), then the ones only the device writes (Device()). Offsets are
// kScratchAlign-aligned.
class ScratchPlan {
 public:
  uint64_t Host(uint64_t bytes) {
    const uint64_t at = total_;
    total_ = AlignUp(total_ + bytes, kScratchAlign);
    host_bytes_ = total_;
    return at;
  }
  uint64_t Device(uint64_t bytes) {
    const uint64_t at = total_;
    total_ = AlignUp(total_ + bytes, kScratchAlign);
    return at;
  }
  uint64_t host_bytes() const { return host_bytes_; }
  uint64_t total() const { return total_; }

 private:
  uint64_t total_ = 0;
  uint64_t host_bytes_ = 0;
};

// Writes one of a plan's Host() arrays into the host side of the arguments.
void Put(uint8_t* args, uint64_t at, const void* src, uint64_t bytes) {
  if (bytes != 0) std::memcpy(args + at, src, bytes);
}

template <typename T>
T* At(uint8_t* scratch, uint64_t offset) {
  return reinterpret_cast<T*>(scratch + offset);
}

class CudaMemory final : public PoolMemory {
  struct Lane;
  class LaneHold;

 public:
  // Takes ownership of `base` (cudaMalloc'd, `bytes` long, on `device`) and `streams` (one per
  // lane).
  CudaMemory(int device, uint8_t* base, uint64_t bytes, const std::vector<cudaStream_t>& streams)
      : PoolMemory(MemoryKind::kCuda, absl::StrCat("cuda:", device), base, bytes),
        device_(device),
        pinned_(std::make_shared<PinnedCache>(device)) {
    for (int i = 0; i < kLanes; ++i) lanes_[i].stream = streams[i];
  }

  ~CudaMemory() override {
    DeviceGuard guard(device_);
    for (Lane& lane : lanes_) {
      absl::MutexLock lock(&lane.mu);
      cudaStreamSynchronize(lane.stream);
      if (lane.scratch != nullptr) cudaFree(lane.scratch);
      if (lane.args != nullptr) cudaFreeHost(lane.args);
      cudaStreamDestroy(lane.stream);
    }
    cudaFree(base());
  }

  absl::StatusOr<std::unique_ptr<StagingBuffer>> Stage(uint64_t bytes) override {
    absl::StatusOr<PinnedCache::Buffer> b = pinned_->Take(bytes);
    if (!b.ok()) return b.status();
    return std::unique_ptr<StagingBuffer>(new PinnedStagingBuffer(pinned_, *b, bytes));
  }

  absl::Status WritePayload(const PayloadJob& job, const uint8_t* payload) override {
    return MovePayload(job, kernels::CopyDirection::kPayloadToPool, const_cast<uint8_t*>(payload));
  }

  absl::Status ReadPayload(const PayloadJob& job, uint8_t* payload) override {
    return MovePayload(job, kernels::CopyDirection::kPoolToPayload, payload);
  }

  absl::Status WritePayloadFromDevice(const PayloadJob& job, const uint8_t* payload) override {
    return MovePayload(job, kernels::CopyDirection::kPayloadToPool, const_cast<uint8_t*>(payload),
                       /*on_device=*/true);
  }

  absl::Status ReadPayloadToDevice(const PayloadJob& job, uint8_t* payload) override {
    return MovePayload(job, kernels::CopyDirection::kPoolToPayload, payload, /*on_device=*/true);
  }

  absl::StatusOr<int64_t> FindNonFiniteOnDevice(const uint8_t* payload, DType dtype,
                                                uint64_t n) override {
    if (n == 0) return -1;
    DeviceGuard guard(device_);
    if (guard.status() != cudaSuccess) return Error(guard.status(), "selecting the device");
    uint32_t found = 0;
    {
      LaneHold hold(this);
      Lane& lane = hold.lane();
      ScratchPlan plan;
      const uint64_t at_found = plan.Device(sizeof(uint32_t));
      absl::StatusOr<uint8_t*> s = Scratch(lane, plan.total());
      if (!s.ok()) return s.status();
      absl::StatusOr<uint8_t*> args = Args(lane, sizeof(uint32_t));
      if (!args.ok()) return args.status();
      uint32_t* dev_found = At<uint32_t>(*s, at_found);
      KVBANK_CUDA_TRY(cudaMemsetAsync(dev_found, 0, sizeof(uint32_t), lane.stream),
                      "checking a payload for NaN / Inf");
      KVBANK_CUDA_TRY(kernels::FindNonFiniteCuda(payload, dtype, n, dev_found, lane.stream),
                      "checking a payload for NaN / Inf");
      KVBANK_CUDA_TRY(
          cudaMemcpyAsync(*args, dev_found, sizeof(uint32_t), cudaMemcpyDeviceToHost, lane.stream),
          "checking a payload for NaN / Inf");
      if (absl::Status f = Finish(lane, "checking a payload for NaN / Inf"); !f.ok()) return f;
      std::memcpy(&found, *args, sizeof(found));
    }
    if (found == 0) return -1;
    // NOTE: slow path, a bad payload only: the payload comes to the host to name the first bad
    // element exactly as the host path does.
    std::vector<uint8_t> host(n * DTypeBytes(dtype));
    const cudaError_t e = cudaMemcpy(host.data(), payload, host.size(), cudaMemcpyDeviceToHost);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return Error(e, "copying a bad payload to the host to name its first NaN / Inf");
    }
    return kernels::FindNonFinite(host.data(), dtype, n);
  }

  absl::Status CopyBlocks(absl::Span<const int32_t> src, absl::Span<const int32_t> dst,
                          uint64_t block_bytes) override {
    CheckNoCoreLock("a block copy");
    if (src.size() != dst.size()) {
      return absl::InvalidArgumentError(absl::StrCat(name(), ": CopyBlocks of ", src.size(),
                                                     " sources and ", dst.size(), " destinations"));
    }
    if (src.empty() || block_bytes == 0) return absl::OkStatus();
    DeviceGuard guard(device_);
    if (guard.status() != cudaSuccess) return Error(guard.status(), "selecting the device");
    LaneHold hold(this);
    Lane& lane = hold.lane();
    const uint64_t ids_bytes = src.size() * sizeof(int32_t);
    ScratchPlan plan;
    const uint64_t at_src = plan.Host(ids_bytes);
    const uint64_t at_dst = plan.Host(ids_bytes);
    absl::StatusOr<uint8_t*> s = Send(lane, plan, [&](uint8_t* args, uint8_t*) {
      Put(args, at_src, src.data(), ids_bytes);
      Put(args, at_dst, dst.data(), ids_bytes);
    });
    if (!s.ok()) return s.status();
    KVBANK_CUDA_TRY(kernels::CopyBlocksCuda(base(), block_bytes, At<const int32_t>(*s, at_src),
                                            At<const int32_t>(*s, at_dst), src.size(), lane.stream),
                    "copying blocks");
    return Finish(lane, "copying blocks");
  }

  absl::Status CopyBlocksToHost(absl::Span<const int32_t> ids, uint64_t block_bytes,
                                uint8_t* host) override {
    CheckNoCoreLock("a copy of blocks to host memory");
    return CopyWholeBlocks(ids, block_bytes, host, /*to_host=*/true);
  }
  absl::Status CopyBlocksFromHost(absl::Span<const int32_t> ids, uint64_t block_bytes,
                                  const uint8_t* host) override {
    CheckNoCoreLock("a copy of blocks from host memory");
    return CopyWholeBlocks(ids, block_bytes, const_cast<uint8_t*>(host), /*to_host=*/false);
  }

  absl::Status CopyRows(const BlockLayout& layout,
                        absl::Span<const kernels::RowCopy> copies) override {
    CheckNoCoreLock("a row copy");
    if (copies.empty()) return absl::OkStatus();
    DeviceGuard guard(device_);
    if (guard.status() != cudaSuccess) return Error(guard.status(), "selecting the device");
    LaneHold hold(this);
    Lane& lane = hold.lane();
    const uint64_t layers_bytes = layout.layers.size() * sizeof(LayerView);
    const uint64_t copies_bytes = copies.size() * sizeof(kernels::RowCopy);
    ScratchPlan plan;
    const uint64_t at_layers = plan.Host(layers_bytes);
    const uint64_t at_copies = plan.Host(copies_bytes);
    absl::StatusOr<uint8_t*> s = Send(lane, plan, [&](uint8_t* args, uint8_t*) {
      Put(args, at_layers, layout.layers.data(), layers_bytes);
      Put(args, at_copies, copies.data(), copies_bytes);
    });
    if (!s.ok()) return s.status();
    KVBANK_CUDA_TRY(kernels::CopyRowsCuda(
                        base(), layout.block_bytes, At<const LayerView>(*s, at_layers),
                        At<const kernels::RowCopy>(*s, at_copies), copies.size(), lane.stream),
                    "copying token rows");
    return Finish(lane, "copying token rows");
  }

  absl::Status Attend(const kernels::DecodeAttentionParams& p, uint32_t max_length,
                      uint32_t num_threads) override {
    const kernels::PagedKv& kv = p.kv;
    if (kv.batch == 0) return absl::OkStatus();
    if (kv.pool != base()) {
      return absl::InvalidArgumentError(absl::StrCat(name(), ": attention over another pool"));
    }
    DeviceGuard guard(device_);
    if (guard.status() != cudaSuccess) return Error(guard.status(), "selecting the device");
    LaneHold hold(this);
    Lane& lane = hold.lane();
    const uint64_t batch = kv.batch;
    const uint64_t num_indices = static_cast<uint64_t>(kv.indptr[batch]);
    const uint64_t q_bytes = batch * p.num_q_heads * p.head_dim * sizeof(float);
    const uint64_t out_bytes = batch * p.num_q_heads * p.head_dim_v * sizeof(float);
    const uint64_t lse_bytes = batch * p.num_q_heads * sizeof(float);

    ScratchPlan plan;
    const uint64_t at_layers = plan.Host(batch * sizeof(LayerView));
    const uint64_t at_indptr = plan.Host((batch + 1) * sizeof(int32_t));
    const uint64_t at_indices = plan.Host(num_indices * sizeof(int32_t));
    const uint64_t at_lengths = plan.Host(batch * sizeof(uint32_t));
    const uint64_t at_q = plan.Host(q_bytes);
    const uint64_t at_probs_ptrs = p.token_probs ? plan.Host(batch * sizeof(float*)) : 0;
    // The outputs are contiguous, so one copy brings them all back.
    const uint64_t at_out = plan.Device(out_bytes);
    const uint64_t at_lse = plan.Device(lse_bytes);
    std::vector<uint64_t> at_probs(p.token_probs ? batch : 0, 0);
    for (uint64_t i = 0; i < at_probs.size(); ++i) {
      if (p.token_probs[i] != nullptr) at_probs[i] = plan.Device(kv.lengths[i] * sizeof(float));
    }
    const uint64_t outputs_end = plan.total();
    // Reads only p's scalar fields, which the device copy shares.
    const size_t workspace_bytes = kernels::DecodeAttentionWorkspaceBytes(p, max_length);
    const uint64_t at_workspace = plan.Device(workspace_bytes);

    absl::StatusOr<uint8_t*> scratch = Send(lane, plan, [&](uint8_t* args, uint8_t* s) {
      Put(args, at_layers, kv.layers, batch * sizeof(LayerView));
      Put(args, at_indptr, kv.indptr, (batch + 1) * sizeof(int32_t));
      Put(args, at_indices, kv.indices, num_indices * sizeof(int32_t));
      Put(args, at_lengths, kv.lengths, batch * sizeof(uint32_t));
      Put(args, at_q, p.q, q_bytes);
      if (p.token_probs) {
        float** ptrs = At<float*>(args, at_probs_ptrs);
        for (uint64_t i = 0; i < batch; ++i) {
          ptrs[i] = p.token_probs[i] != nullptr ? At<float>(s, at_probs[i]) : nullptr;
        }
      }
    });
    if (!scratch.ok()) return scratch.status();
    uint8_t* const s = *scratch;

    kernels::DecodeAttentionParams d = p;
    d.kv.pool = base();
    d.kv.layers = At<const LayerView>(s, at_layers);
    d.kv.indptr = At<const int32_t>(s, at_indptr);
    d.kv.indices = At<const int32_t>(s, at_indices);
    d.kv.lengths = At<const uint32_t>(s, at_lengths);
    d.q = At<const float>(s, at_q);
    d.out = At<float>(s, at_out);
    d.lse = At<float>(s, at_lse);
    d.token_probs = p.token_probs ? At<float* const>(s, at_probs_ptrs) : nullptr;
    KVBANK_CUDA_TRY(
        kernels::DecodeAttentionCuda(d, max_length, workspace_bytes ? s + at_workspace : nullptr,
                                     workspace_bytes, lane.stream),
        "launching decode attention");
    std::vector<uint8_t> outputs(outputs_end - at_out);
    KVBANK_CUDA_TRY(cudaMemcpyAsync(outputs.data(), s + at_out, outputs.size(),
                                    cudaMemcpyDeviceToHost, lane.stream),
                    "copying the attention outputs to the host");
    if (absl::Status st = Finish(lane, "running decode attention"); !st.ok()) return st;
    std::memcpy(p.out, outputs.data(), out_bytes);
    std::memcpy(p.lse, outputs.data() + (at_lse - at_out), lse_bytes);
    for (uint64_t i = 0; i < at_probs.size(); ++i) {
      if (p.token_probs[i] != nullptr && kv.lengths[i] != 0) {
        std::memcpy(p.token_probs[i], outputs.data() + (at_probs[i] - at_out),
                    kv.lengths[i] * sizeof(float));
      }
    }
    return absl::OkStatus();
  }

 private:
  // The payload (read for kPayloadToPool, written for kPoolToPayload) to or from the blocks. In
  // host memory it travels through the device scratch, next to the map's arrays; in device
  // memory (on_device) the kernels use it where it is.
  absl::Status MovePayload(const PayloadJob& job, kernels::CopyDirection dir, uint8_t* payload,
                           bool on_device = false) {
    if (absl::Status s = CheckJob(job); !s.ok()) return s;
    const kernels::PayloadMap& m = job.map;
    if (m.total_bytes == 0 || m.num_tokens == 0 || m.num_layers == 0) return absl::OkStatus();
    DeviceGuard guard(device_);
    if (guard.status() != cudaSuccess) return Error(guard.status(), "selecting the device");
    LaneHold hold(this);
    Lane& lane = hold.lane();
    uint8_t* dev_payload = nullptr;
    absl::StatusOr<kernels::PayloadMap> d = SendMap(lane, m, on_device ? nullptr : &dev_payload);
    if (!d.ok()) return d.status();
    if (on_device) dev_payload = payload;
    const bool in = dir == kernels::CopyDirection::kPayloadToPool;
    if (in && !on_device) {
      KVBANK_CUDA_TRY(
          cudaMemcpyAsync(dev_payload, payload, m.total_bytes, cudaMemcpyHostToDevice, lane.stream),
          "copying the payload to the device");
    }
    if (job.convert) {
      KVBANK_CUDA_TRY(
          in ? kernels::EncodePayloadCuda(*d, *job.convert, dev_payload, lane.stream)
             : kernels::DecodePayloadCuda(*d, *job.convert, dev_payload, lane.stream),
          absl::StrCat(in ? "encoding a " : "decoding a ", DTypeName(*job.convert), " payload"));
    } else {
      KVBANK_CUDA_TRY(kernels::PayloadCopyCuda(*d, dir, 0, dev_payload, m.total_bytes, lane.stream),
                      in ? "scattering the payload" : "gathering the payload");
      if (d->scale_offset != nullptr) {
        KVBANK_CUDA_TRY(kernels::ScaleCopyCuda(*d, dir, 0, dev_payload, m.total_bytes, lane.stream),
                        in ? "scattering the payload's scales" : "gathering the payload's scales");
      }
    }
    if (!in && !on_device) {
      KVBANK_CUDA_TRY(
          cudaMemcpyAsync(payload, dev_payload, m.total_bytes, cudaMemcpyDeviceToHost, lane.stream),
          "copying the payload to the host");
    }
    return Finish(lane, in ? "writing a payload" : "reading a payload");
  }

  absl::Status CheckJob(const PayloadJob& job) const {
    if (job.map.pool != base()) {
      return absl::InvalidArgumentError(absl::StrCat(name(), ": payload map over another pool"));
    }
    if (job.convert && job.map.scale_offset != nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(name(), ": a converted payload has no scale sections"));
    }
    return absl::OkStatus();
  }

  // The error of `what`, naming this memory and the CUDA error.
  absl::Status Error(cudaError_t e, absl::string_view what) const {
    if (IsSticky(e)) {
      int none = cudaSuccess;
      sticky_.compare_exchange_strong(none, int(e), std::memory_order_acq_rel);
    }
    return absl::InternalError(absl::StrCat(name(), ": ", what, ": ", CudaErrorText(e)));
  }

  absl::Status Health() const override {
    const int e = sticky_.load(std::memory_order_acquire);
    if (e == cudaSuccess) return absl::OkStatus();
    return absl::UnavailableError(absl::StrCat(name(), " took a sticky CUDA error (",
                                               CudaErrorText(cudaError_t(e)),
                                               "): every call on this device fails until the "
                                               "process restarts"));
  }

  // Errors after which the device's context is unusable for good.
  static bool IsSticky(cudaError_t e) {
    return e == cudaErrorIllegalAddress || e == cudaErrorLaunchFailure;
  }

  // Ends a call that failed at `what`. NOTE: a sync point: drains the lane's stream so that no
  // copy still reads or writes the caller's buffers once the call has returned. A kernel fault
  // (e.g. cudaErrorIllegalAddress) is sticky: every later call fails too.
  absl::Status Fail(Lane& lane, cudaError_t e, absl::string_view what) {
    cudaStreamSynchronize(lane.stream);
    cudaGetLastError();
    return Error(e, what);
  }

  // Waits for the call's work; the error of the first failed step, if any, surfaces here.
  absl::Status Finish(Lane& lane, absl::string_view what) {
    const cudaError_t e = cudaStreamSynchronize(lane.stream);
    if (e == cudaSuccess) return absl::OkStatus();
    cudaGetLastError();
    return Error(e, what);
  }

  // The lane's scratch, at least `bytes` long. Its stream is idle (every call ends
  // synchronized), so a smaller scratch can be freed. Grow-only: each lane keeps the largest
  // call's worth of scratch next to the pool, which the store's staging pieces bound
  // (TransferSpec::staging_bytes, or one layer of the longest transfer).
  absl::StatusOr<uint8_t*> Scratch(Lane& lane, uint64_t bytes) {
    if (bytes <= lane.scratch_bytes) return lane.scratch;
    const uint64_t want = AlignUp(bytes, uint64_t{1} << 20);
    if (lane.scratch != nullptr) cudaFree(lane.scratch);  // NOTE: synchronizes the device
    lane.scratch = nullptr;
    lane.scratch_bytes = 0;
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, want);
    if (e != cudaSuccess) {
      cudaGetLastError();
      size_t free_bytes = 0, total_bytes = 0;
      cudaMemGetInfo(&free_bytes, &total_bytes);
      return absl::ResourceExhaustedError(
          absl::StrCat(name(), ": no device memory for ", want, " bytes of transfer scratch (",
                       CudaErrorText(e), "; ", free_bytes, " of ", total_bytes, " bytes free)"));
    }
    lane.scratch = static_cast<uint8_t*>(p);
    lane.scratch_bytes = want;
    return lane.scratch;
  }

  // The host side of a call's arguments (a plan's Host() arrays), at least `bytes` long:
  // page-locked, so the copy is a true async DMA, and reused by the lane's calls (the previous
  // call's copy is done: every call ends synchronized). Grow-only.
  absl::StatusOr<uint8_t*> Args(Lane& lane, uint64_t bytes) {
    if (bytes <= lane.args_bytes) return lane.args;
    const uint64_t want = AlignUp(bytes, kPinnedGranule);
    if (lane.args != nullptr) cudaFreeHost(lane.args);  // NOTE: synchronizes the device
    lane.args = nullptr;
    lane.args_bytes = 0;
    void* p = nullptr;
    const cudaError_t e = cudaHostAlloc(&p, want, cudaHostAllocPortable);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return absl::ResourceExhaustedError(absl::StrCat(name(), ": no page-locked host buffer of ",
                                                       want,
                                                       " bytes for arguments: ", CudaErrorText(e)));
    }
    lane.args = static_cast<uint8_t*>(p);
    lane.args_bytes = want;
    return lane.args;
  }

  // Sizes the lane's scratch and arguments for `plan`, has fill(args, scratch) write the plan's
  // Host() arrays at their offsets in `args` (`scratch`: where everything will be on the device,
  // for arrays of device pointers), and sends them to the start of the scratch. Returns the
  // scratch.
  template <typename Fill>
  absl::StatusOr<uint8_t*> Send(Lane& lane, const ScratchPlan& plan, Fill fill) {
    absl::StatusOr<uint8_t*> s = Scratch(lane, plan.total());
    if (!s.ok()) return s.status();
    absl::StatusOr<uint8_t*> args = Args(lane, plan.host_bytes());
    if (!args.ok()) return args.status();
    fill(*args, *s);
    KVBANK_CUDA_TRY(
        cudaMemcpyAsync(*s, *args, plan.host_bytes(), cudaMemcpyHostToDevice, lane.stream),
        "copying a call's arguments to the device");
    return *s;
  }

  // Sends m's host arrays (layers, layer_offset, block_table, scale_offset) to the lane's
  // scratch, with room for the payload after them (*dev_payload, unless dev_payload is null: the
  // payload is in device memory already), and returns the map over those copies.
  // REQUIRES: m.num_layers > 0.
  absl::StatusOr<kernels::PayloadMap> SendMap(Lane& lane, const kernels::PayloadMap& m,
                                              uint8_t** dev_payload) {
    const uint32_t bt = m.layers[0].block_tokens;
    const uint64_t table_len = (m.token_begin + m.num_tokens + bt - 1) / bt;
    const uint64_t layers_bytes = uint64_t{m.num_layers} * sizeof(LayerView);
    const uint64_t offsets_bytes = uint64_t{m.num_layers} * sizeof(uint64_t);
    const uint64_t table_bytes = table_len * sizeof(int32_t);
    ScratchPlan plan;
    const uint64_t at_layers = plan.Host(layers_bytes);
    const uint64_t at_offsets = plan.Host(offsets_bytes);
    const uint64_t at_table = plan.Host(table_bytes);
    const uint64_t at_scales = m.scale_offset ? plan.Host(offsets_bytes) : 0;
    const uint64_t at_payload = dev_payload != nullptr ? plan.Device(m.total_bytes) : 0;
    absl::StatusOr<uint8_t*> s = Send(lane, plan, [&](uint8_t* args, uint8_t*) {
      Put(args, at_layers, m.layers, layers_bytes);
      Put(args, at_offsets, m.layer_offset, offsets_bytes);
      Put(args, at_table, m.block_table, table_bytes);
      if (m.scale_offset) Put(args, at_scales, m.scale_offset, offsets_bytes);
    });
    if (!s.ok()) return s.status();
    kernels::PayloadMap d = m;
    d.pool = base();
    d.layers = At<const LayerView>(*s, at_layers);
    d.layer_offset = At<const uint64_t>(*s, at_offsets);
    d.block_table = At<const int32_t>(*s, at_table);
    d.scale_offset = m.scale_offset ? At<const uint64_t>(*s, at_scales) : nullptr;
    if (dev_payload != nullptr) *dev_payload = *s + at_payload;
    return d;
  }

  // Whole blocks between the pool and pageable host memory, one async copy per block on a lane's
  // stream, then one wait.
  absl::Status CopyWholeBlocks(absl::Span<const int32_t> ids, uint64_t block_bytes, uint8_t* host,
                               bool to_host) {
    if (ids.empty() || block_bytes == 0) return absl::OkStatus();
    DeviceGuard guard(device_);
    if (guard.status() != cudaSuccess) return Error(guard.status(), "selecting the device");
    LaneHold hold(this);
    Lane& lane = hold.lane();
    const char* what = to_host ? "copying blocks to a lower tier" : "promoting blocks from a tier";
    for (size_t i = 0; i < ids.size(); ++i) {
      uint8_t* dev = base() + uint64_t(ids[i]) * block_bytes;
      uint8_t* h = host + i * block_bytes;
      KVBANK_CUDA_TRY(
          cudaMemcpyAsync(to_host ? h : dev, to_host ? dev : h, block_bytes,
                          to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice, lane.stream),
          what);
    }
    return Finish(lane, what);
  }

  // One call at a time per lane. A lane's fields belong to whoever holds its mutex (LaneHold).
  struct Lane {
    absl::Mutex mu;
    cudaStream_t stream = nullptr;  // set at construction
    uint8_t* scratch = nullptr;     // device
    uint64_t scratch_bytes = 0;
    uint8_t* args = nullptr;  // page-locked host
    uint64_t args_bytes = 0;
  };
  // Holds a lane for one call: a free one when there is one, else the next in turn.
  class LaneHold {
   public:
    explicit LaneHold(CudaMemory* m) ABSL_NO_THREAD_SAFETY_ANALYSIS {
      const uint32_t start = m->next_lane_.fetch_add(1, std::memory_order_relaxed);
      for (int i = 0; i < kLanes && lane_ == nullptr; ++i) {
        Lane& l = m->lanes_[(start + i) % kLanes];
        if (l.mu.TryLock()) lane_ = &l;
      }
      if (lane_ == nullptr) {
        lane_ = &m->lanes_[start % kLanes];
        lane_->mu.Lock();
      }
    }
    ~LaneHold() ABSL_NO_THREAD_SAFETY_ANALYSIS { lane_->mu.Unlock(); }
    LaneHold(const LaneHold&) = delete;
    LaneHold& operator=(const LaneHold&) = delete;
    Lane& lane() const { return *lane_; }

   private:
    Lane* lane_ = nullptr;
  };

  const int device_;
  const std::shared_ptr<PinnedCache> pinned_;
  std::array<Lane, kLanes> lanes_;
  // The first sticky error seen (cudaSuccess: none), for Health().
  mutable std::atomic<int> sticky_{cudaSuccess};
  std::atomic<uint32_t> next_lane_{0};
};

}  // namespace

#undef KVBANK_CUDA_TRY

bool CudaBuiltIn() { return true; }

int CudaDeviceCount() {
  int n = 0;
  // No driver or no device is an error here, not a crash: the answer is then 0.
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

absl::Status CudaMemoryInfo(int device, uint64_t* free_bytes, uint64_t* total_bytes) {
  const int n = CudaDeviceCount();
  if (device < 0 || device >= n) {
    return absl::FailedPreconditionError(
        absl::StrCat("no CUDA device ", device, ": this machine has ", n));
  }
  DeviceGuard guard(device);
  if (guard.status() != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("cuda:", device, ": selecting the device: ", CudaErrorText(guard.status())));
  }
  size_t f = 0, t = 0;
  const cudaError_t e = cudaMemGetInfo(&f, &t);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return absl::InternalError(
        absl::StrCat("cuda:", device, ": cudaMemGetInfo: ", CudaErrorText(e)));
  }
  *free_bytes = f;
  *total_bytes = t;
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<PoolMemory>> CreateCudaMemory(int device, uint64_t bytes) {
  const int n = CudaDeviceCount();
  if (device < 0 || device >= n) {
    return absl::FailedPreconditionError(
        absl::StrCat("no CUDA device ", device, ": this machine has ", n));
  }
  if (bytes == 0) {
    return absl::InvalidArgumentError(absl::StrCat("cuda:", device, ": a pool of 0 bytes"));
  }
  DeviceGuard guard(device);
  if (guard.status() != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("cuda:", device, ": selecting the device: ", CudaErrorText(guard.status())));
  }
  void* base = nullptr;
  cudaError_t e = cudaMalloc(&base, bytes);
  if (e != cudaSuccess) {
    cudaGetLastError();
    size_t free_bytes = 0, total_bytes = 0;
    cudaMemGetInfo(&free_bytes, &total_bytes);
    return absl::ResourceExhaustedError(
        absl::StrCat("cuda:", device, ": cudaMalloc of ", bytes, " bytes failed (",
                     CudaErrorText(e), "); ", free_bytes, " of ", total_bytes, " bytes free"));
  }
  std::vector<cudaStream_t> streams;
  for (int i = 0; i < kLanes && e == cudaSuccess; ++i) {
    cudaStream_t stream = nullptr;
    e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    if (e == cudaSuccess) streams.push_back(stream);
  }
  if (e == cudaSuccess) {
    e = cudaMemsetAsync(base, 0, bytes, streams[0]);
    const cudaError_t sync = cudaStreamSynchronize(streams[0]);
    if (e == cudaSuccess) e = sync;
  }
  if (e != cudaSuccess) {
    cudaGetLastError();
    for (cudaStream_t stream : streams) cudaStreamDestroy(stream);
    cudaFree(base);
    return absl::InternalError(
        absl::StrCat("cuda:", device, ": setting up the pool: ", CudaErrorText(e)));
  }
  return std::make_unique<CudaMemory>(device, static_cast<uint8_t*>(base), bytes, streams);
}

}  // namespace kvbank
