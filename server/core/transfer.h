// One transfer between a dense payload and a sequence's blocks, and the writer / reader that move
// its bytes. PoolMemory::BeginWrite / BeginRead hand these out: they are the one place payload
// bytes cross between a caller and the pool, whatever the memory (host, host-staged, cuda:N) and
// whatever a data plane brings the bytes from. The store plans a transfer (which blocks, which
// format) under its lock and runs it outside.
//
// Two ways to move, chosen by the memory:
//   streaming  (host memory) each Write / Read goes straight between the caller's bytes and the
//              blocks, converting row by row where the payload's dtype is not the stored one
//              (RowCodec).
//   staged     (host-staged, cuda:N) the payload moves in pieces of whole layers through a
//              staging buffer; each piece is written once its last byte is in, and read once when
//              a read first reaches it (PoolMemory::WritePayload / ReadPayload, the same kernels on
//              the CPU and the GPU).
// Both store the same bytes for the same payload, however the payload is cut into Writes: an fp8
// group's scale follows kernels/quant_math.h's one rule from the group's whole rows.
#ifndef KVBANK_SERVER_CORE_TRANSFER_H_
#define KVBANK_SERVER_CORE_TRANSFER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/block_copy.h"
#include "kvbank/layout.h"

namespace kvbank {

class PoolMemory;

// How a payload relates to the stored bytes.
//   kPlain    every layer of the range stores the payload's dtype: bytes are copied.
//   kConvert  the payload is fp32 / fp16 / bf16 and some layer stores another dtype: converted
//             (quantized on the way in, dequantized on the way out).
//   kStorage  the payload is int8 / fp8 as stored, with its scale sections
//             (PayloadLayout::MakeStorage).
enum class TransferMode : uint8_t { kPlain, kConvert, kStorage };

// Everything a transfer needs, owned by it (the payload map points into these).
struct TransferSpec {
  TransferMode mode = TransferMode::kPlain;
  DType dtype = DType::kFp16;  // of the payload
  uint64_t token_begin = 0;    // sequence position of payload token 0
  PayloadLayout payload;
  // Physical block of each logical block of the sequence from block 0 up to the last the
  // payload touches (BlockTable::kHoleId before the first).
  std::vector<int32_t> table;
  // Staged memory: the most payload bytes a piece holds (a larger layer is a piece of its own).
  uint64_t staging_bytes = uint64_t{64} << 20;
  // A payload of some kv heads only (a tensor-parallel rank's): `heads` is the pool's block
  // layout narrowed to them (BlockLayout::Heads), and `payload` was made from it. Unset: every
  // head, the pool's layout.
  std::optional<BlockLayout> heads;
  // The payload moves to or from device memory on the pool's device (a cuda:N pool and a data
  // plane that hands it a device pointer: server/plane/cuda_ipc.h), through
  // PayloadWriter::WriteFromDevice / PayloadReader::ReadToDevice: no staging buffer is taken and
  // a staged reader reads nothing at its start.
  bool device_payload = false;
};

// The payload of `spec` over the blocks at `pool`, for the kernels; `blocks` is the layout the
// payload was made from. Points into `spec` and `blocks`.
kernels::PayloadMap MapOf(const BlockLayout& blocks, const TransferSpec& spec, uint8_t* pool);

// Writes one payload, in order, into the blocks. Not thread-safe: one caller drives it.
class PayloadWriter {
 public:
  // Asked before rows that an earlier append stored in logical block `index` are rewritten (an
  // fp8 block whose scale must grow for the new rows): make the block one only this transfer
  // holds (a copy that readers cannot see) and answer its physical id, which the writer then
  // writes through. An error fails the Write that needed it.
  using MakePrivate = std::function<absl::StatusOr<int32_t>(uint64_t index)>;

  virtual ~PayloadWriter() = default;
  PayloadWriter(const PayloadWriter&) = delete;
  PayloadWriter& operator=(const PayloadWriter&) = delete;

  const TransferSpec& spec() const { return spec_; }
  uint64_t written() const { return written_; }

  // The next data.size() payload bytes (any cut). INVALID_ARGUMENT when they run past the
  // payload, or a converted payload holds NaN or Inf (nothing of the row or group holding it is
  // stored); what MakePrivate answers when it fails; INTERNAL when the device fails.
  absl::Status Write(absl::Span<const uint8_t> data);
  // The whole payload at once from `device_payload`, device memory on the pool's device that
  // holds spec().payload.total_bytes bytes and stays as it is until this returns; the kernels
  // read it in place (no host copy). Same checks as Write (a converted payload's values must be
  // finite, checked on the device). FAILED_PRECONDITION when the memory is not on a device, when
  // bytes were written already, or for a storage-format payload (its scales are checked on the
  // host: send it as bytes); INTERNAL when the device fails. Finish() follows as after Write.
  absl::Status WriteFromDevice(const uint8_t* device_payload);
  // Whether WriteRange may run on several threads at once over disjoint ranges (host memory and
  // a payload copied as it is: each byte's place in the pool depends on its offset alone).
  virtual bool ConcurrentWrites() const { return false; }
  // Payload bytes [offset, offset + data.size()), within [written(), payload end), in any order
  // and, when ConcurrentWrites(), from several threads at once over disjoint ranges. written()
  // does not move: Advance counts the bytes once every range of them is written. INVALID_ARGUMENT
  // outside that span; FAILED_PRECONDITION unless ConcurrentWrites().
  absl::Status WriteRange(uint64_t offset, absl::Span<const uint8_t> data);
  // Counts the next n bytes written (by WriteRange calls that covered them all). INVALID_ARGUMENT
  // past the payload.
  absl::Status Advance(uint64_t n);
  // How the copy writes the pool (kernels::CopyStores; kStream for a large payload that nothing
  // reads back soon). Host memory and a payload stored as it is only: a converted or staged
  // payload is written as always.
  void set_stores(kernels::CopyStores stores) { stores_ = stores; }
  // After the last byte: whatever is still to move and the checks that need the whole payload
  // (a storage-format payload's scales and codes). INVALID_ARGUMENT naming the first bad value.
  // REQUIRES: written() == spec().payload.total_bytes.
  virtual absl::Status Finish() = 0;

 protected:
  // `blocks`: the pool's layout (spec.heads, when set, stands in for it).
  PayloadWriter(const BlockLayout& blocks, TransferSpec spec, MakePrivate make_private);
  // `data` are payload bytes [written(), written() + data.size()), within the payload.
  virtual absl::Status WriteAt(absl::Span<const uint8_t> data) = 0;
  // The whole payload from device memory (WriteFromDevice, which checked written() == 0).
  // Default: FAILED_PRECONDITION (host memory).
  virtual absl::Status WriteDeviceAt(const uint8_t* device_payload);
  // Payload bytes at `offset` (WriteRange, ConcurrentWrites() only). Default: FAILED_PRECONDITION.
  virtual absl::Status WriteRangeAt(uint64_t offset, absl::Span<const uint8_t> data);
  // make_private_ for logical block `index`, the answer written into the table.
  absl::Status Privatize(uint64_t index);

  TransferSpec spec_;
  const BlockLayout& blocks_;  // the layout the payload was made from
  MakePrivate make_private_;
  uint64_t written_ = 0;
  kernels::CopyStores stores_ = kernels::CopyStores::kCached;
};

// Reads one payload from the blocks, in any order (in order is cheapest on staged memory: each
// piece is read from the device once). Not thread-safe.
class PayloadReader {
 public:
  virtual ~PayloadReader() = default;
  PayloadReader(const PayloadReader&) = delete;
  PayloadReader& operator=(const PayloadReader&) = delete;

  const TransferSpec& spec() const { return spec_; }
  // Payload bytes [offset, offset + out.size()) into `out`. OUT_OF_RANGE past the payload;
  // INTERNAL when the device fails.
  virtual absl::Status Read(uint64_t offset, absl::Span<uint8_t> out) = 0;
  // The whole payload into `device_out`, device memory on the pool's device with room for
  // spec().payload.total_bytes bytes, written in place by the kernels (no host copy); done when
  // this returns. FAILED_PRECONDITION when the memory is not on a device (the default); INTERNAL
  // when the device fails.
  virtual absl::Status ReadToDevice(uint8_t* device_out);
  // Whether Read may run on several threads at once over disjoint ranges (host memory: the reads
  // are pure; a staged reader shares one staging buffer and does not allow it).
  virtual bool ConcurrentReads() const { return false; }
  // How Read writes `out` (kernels::CopyStores; kStream for a large destination that nothing
  // reads soon, as a client's region). Host memory and a payload stored as it is only.
  void set_stores(kernels::CopyStores stores) { stores_ = stores; }

 protected:
  // `blocks`: the pool's layout (spec.heads, when set, stands in for it).
  PayloadReader(const BlockLayout& blocks, TransferSpec spec)
      : spec_(std::move(spec)), blocks_(spec_.heads ? *spec_.heads : blocks) {}
  TransferSpec spec_;
  const BlockLayout& blocks_;  // the layout the payload was made from
  kernels::CopyStores stores_ = kernels::CopyStores::kCached;
};

// The implementations, for PoolMemory's kinds to hand out. `memory` must outlive them.
std::unique_ptr<PayloadWriter> NewStreamingWriter(PoolMemory* memory, const BlockLayout& blocks,
                                                  TransferSpec spec,
                                                  PayloadWriter::MakePrivate make_private);
std::unique_ptr<PayloadReader> NewStreamingReader(PoolMemory* memory, const BlockLayout& blocks,
                                                  TransferSpec spec);
// The staged reader reads its first piece now, so a device that fails fails here.
absl::StatusOr<std::unique_ptr<PayloadWriter>> NewStagedWriter(
    PoolMemory* memory, const BlockLayout& blocks, TransferSpec spec,
    PayloadWriter::MakePrivate make_private);
absl::StatusOr<std::unique_ptr<PayloadReader>> NewStagedReader(PoolMemory* memory,
                                                               const BlockLayout& blocks,
                                                               TransferSpec spec);

}  // namespace kvbank

#endif  // KVBANK_SERVER_CORE_TRANSFER_H_
