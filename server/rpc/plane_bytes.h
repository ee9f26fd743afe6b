// Payload bytes each data plane has moved, for monitoring (kvbankd's /metrics). A transfer counts
// once, where it commits (an append) or completes (a fetch whose payload is all out); a failed or
// cancelled transfer does not count.
#ifndef KVBANK_SERVER_RPC_PLANE_BYTES_H_
#define KVBANK_SERVER_RPC_PLANE_BYTES_H_

#include <array>
#include <atomic>
#include <cstdint>

namespace kvbank::rpc {

enum class Plane { kGrpc = 0, kShm, kCudaIpc, kNccl };
inline constexpr Plane kPlanes[] = {Plane::kGrpc, Plane::kShm, Plane::kCudaIpc, Plane::kNccl};

// "grpc", "shm", "cuda_ipc", "nccl".
inline const char* PlaneName(Plane p) {
  switch (p) {
    case Plane::kGrpc:
      return "grpc";
    case Plane::kShm:
      return "shm";
    case Plane::kCudaIpc:
      return "cuda_ipc";
    case Plane::kNccl:
      return "nccl";
  }
  return "unknown";
}

// Thread-safe: one relaxed atomic add per transfer (not per message).
class PlaneBytes {
 public:
  void AddReceived(Plane p, uint64_t n) {
    received_[int(p)].fetch_add(n, std::memory_order_relaxed);
  }
  void AddSent(Plane p, uint64_t n) { sent_[int(p)].fetch_add(n, std::memory_order_relaxed); }
  uint64_t received(Plane p) const { return received_[int(p)].load(std::memory_order_relaxed); }
  uint64_t sent(Plane p) const { return sent_[int(p)].load(std::memory_order_relaxed); }
  // Region transfers asked for with a control frame on the shm socket (any outcome).
  void AddControlRequest() { control_.fetch_add(1, std::memory_order_relaxed); }
  uint64_t control_requests() const { return control_.load(std::memory_order_relaxed); }
  // Of those, transfers larger than a copy always made at once that the listener copied itself,
  // being alone (KvBankService::ListenerCopyBytes).
  void AddLoneCopy() { lone_.fetch_add(1, std::memory_order_relaxed); }
  uint64_t lone_copies() const { return lone_.load(std::memory_order_relaxed); }

 private:
  std::array<std::atomic<uint64_t>, 4> received_{};
  std::array<std::atomic<uint64_t>, 4> sent_{};
  std::atomic<uint64_t> control_{0};
  std::atomic<uint64_t> lone_{0};
};

}  // namespace kvbank::rpc

#endif  // KVBANK_SERVER_RPC_PLANE_BYTES_H_
