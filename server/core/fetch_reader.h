// A consistent read of KV out of the pool: what a fetch by sequence (SequenceStore::BeginFetch)
// and a fetch by block hash (PrefixCache::FetchBlocks) hand their caller.
#ifndef KVBANK_SERVER_CORE_FETCH_READER_H_
#define KVBANK_SERVER_CORE_FETCH_READER_H_

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "server/core/block_pool.h"
#include "server/core/transfer.h"

namespace kvbank {

// A token range x layer range x kv head range. Holds references on the blocks it reads, so the
// rows it reads stay as they were until the reader is destroyed: appends write only rows past
// the lengths (other layers of the same blocks, as a prefill streams layer by layer, go in
// place), and copy first a block whose rows a reader may hold past them (after a truncate, or an
// fp8 rescale). Not thread-safe, except Read where ConcurrentReads() says so.
class FetchReader {
 public:
  // `refs` hold the blocks `reader` reads; the payload holds kv heads [head_begin, head_end)
  // of tokens from `token_begin`.
  FetchReader(std::vector<BlockRef> refs, std::unique_ptr<PayloadReader> reader,
              uint64_t token_begin, uint32_t head_begin, uint32_t head_end)
      : token_begin_(token_begin),
        kv_head_begin_(head_begin),
        kv_head_end_(head_end),
        refs_(std::move(refs)),
        reader_(std::move(reader)) {}
  FetchReader(const FetchReader&) = delete;
  FetchReader& operator=(const FetchReader&) = delete;

  uint64_t payload_bytes() const { return reader_->spec().payload.total_bytes; }
  uint64_t token_begin() const { return token_begin_; }
  uint64_t num_tokens() const { return reader_->spec().payload.num_tokens; }
  uint32_t layer_begin() const { return reader_->spec().payload.layer_begin; }
  uint32_t layer_end() const { return reader_->spec().payload.layer_end; }
  DType dtype() const { return reader_->spec().dtype; }  // of the payload
  // The kv heads the payload holds: [kv_head_begin(), kv_head_end()).
  uint32_t kv_head_begin() const { return kv_head_begin_; }
  uint32_t kv_head_end() const { return kv_head_end_; }
  // Copies (or dequantizes) payload bytes [offset, offset + out.size()) into `out`. Any order;
  // in order is cheapest on staged memory (each piece of whole layers is read from the device
  // once). INTERNAL when the device fails; never fails on host memory.
  // REQUIRES: offset + out.size() <= payload_bytes().
  absl::Status Read(uint64_t offset, absl::Span<uint8_t> out) { return reader_->Read(offset, out); }
  // Whether Read may be called from several threads at once on disjoint ranges (host memory).
  bool ConcurrentReads() const { return reader_->ConcurrentReads(); }
  // How Read writes `out` (PayloadReader::set_stores).
  void SetStores(kernels::CopyStores stores) { reader_->set_stores(stores); }
  // The whole payload into device memory on the pool's device with room for payload_bytes()
  // (PayloadReader::ReadToDevice: the kernels write it in place). FAILED_PRECONDITION unless the
  // pool is cuda:N; INTERNAL when the device fails.
  absl::Status ReadToDevice(uint8_t* device_out) { return reader_->ReadToDevice(device_out); }

 private:
  const uint64_t token_begin_;
  const uint32_t kv_head_begin_, kv_head_end_;
  std::vector<BlockRef> refs_;  // blocks covering the range: they stay as they are meanwhile
  std::unique_ptr<PayloadReader> reader_;
};

}  // namespace kvbank

#endif  // KVBANK_SERVER_CORE_FETCH_READER_H_
