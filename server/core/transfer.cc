#include "server/core/transfer.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/quant.h"
#include "server/core/block_table.h"
#include "server/core/core_lock.h"
#include "server/core/pool_memory.h"
#include "server/core/row_codec.h"

namespace kvbank {

kernels::PayloadMap MapOf(const BlockLayout& blocks, const TransferSpec& spec, uint8_t* pool) {
  const PayloadLayout& p = spec.payload;
  kernels::PayloadMap m;
  m.pool = pool;
  m.block_bytes = blocks.block_bytes;
  m.layers = blocks.layers.data() + p.layer_begin;
  m.layer_offset = p.layer_offset.data();
  m.num_layers = p.layer_end - p.layer_begin;
  m.num_tokens = p.num_tokens;
  m.total_bytes = p.total_bytes;
  m.block_table = spec.table.data();
  m.token_begin = spec.token_begin;
  if (spec.mode == TransferMode::kStorage) {
    m.scale_offset = p.scale_offset.data();
    m.first_block = p.first_block;
  }
  return m;
}

PayloadWriter::PayloadWriter(const BlockLayout& blocks, TransferSpec spec, MakePrivate make_private)
    : spec_(std::move(spec)),
      blocks_(spec_.heads ? *spec_.heads : blocks),
      make_private_(std::move(make_private)) {}

absl::Status PayloadWriter::Write(absl::Span<const uint8_t> data) {
  CheckNoCoreLock("a payload write");
  const PayloadLayout& p = spec_.payload;
  if (data.size() > p.total_bytes - written_) {
    return absl::InvalidArgumentError(
        absl::StrCat("payload exceeds the ", p.total_bytes, " bytes that ", p.num_tokens,
                     " tokens of layers [", p.layer_begin, ", ", p.layer_end, ") take"));
  }
  if (data.empty()) return absl::OkStatus();
  if (absl::Status s = WriteAt(data); !s.ok()) return s;
  written_ += data.size();
  return absl::OkStatus();
}

absl::Status PayloadWriter::WriteRange(uint64_t offset, absl::Span<const uint8_t> data) {
  if (!ConcurrentWrites()) {
    return absl::FailedPreconditionError("this payload is written in order (Write), not by range");
  }
  const uint64_t total = spec_.payload.total_bytes;
  if (offset < written_ || offset > total || data.size() > total - offset) {
    return absl::InvalidArgumentError(absl::StrCat("payload bytes [", offset, ", +", data.size(),
                                                   ") are outside [", written_, ", ", total, ")"));
  }
  if (data.empty()) return absl::OkStatus();
  return WriteRangeAt(offset, data);
}

absl::Status PayloadWriter::Advance(uint64_t n) {
  if (n > spec_.payload.total_bytes - written_) {
    return absl::InvalidArgumentError(
        absl::StrCat("advancing ", n, " bytes past the payload's ", spec_.payload.total_bytes));
  }
  written_ += n;
  return absl::OkStatus();
}

absl::Status PayloadWriter::WriteRangeAt(uint64_t, absl::Span<const uint8_t>) {
  return absl::FailedPreconditionError("this payload is written in order (Write), not by range");
}

absl::Status PayloadWriter::WriteFromDevice(const uint8_t* device_payload) {
  CheckNoCoreLock("a payload write");
  if (written_ != 0) {
    return absl::FailedPreconditionError(absl::StrCat("a payload from device memory comes whole; ",
                                                      written_, " bytes were written already"));
  }
  if (spec_.mode == TransferMode::kStorage) {
    return absl::FailedPreconditionError(
        absl::StrCat("a ", DTypeName(spec_.dtype),
                     " storage-format payload cannot come from device memory (its scales are "
                     "checked on the host): send fp32 / fp16 / bf16 to convert, or send bytes"));
  }
  if (spec_.payload.total_bytes == 0) return absl::OkStatus();
  if (absl::Status s = WriteDeviceAt(device_payload); !s.ok()) return s;
  written_ = spec_.payload.total_bytes;
  return absl::OkStatus();
}

absl::Status PayloadWriter::WriteDeviceAt(const uint8_t*) {
  return absl::FailedPreconditionError(
      "a payload in device memory needs a pool in device memory (--device cuda:N)");
}

absl::Status PayloadReader::ReadToDevice(uint8_t*) {
  return absl::FailedPreconditionError(
      "a payload into device memory needs a pool in device memory (--device cuda:N)");
}

absl::Status PayloadWriter::Privatize(uint64_t index) {
  if (!make_private_) {
    return absl::InternalError("a rescale needs a private copy of a block and none can be made");
  }
  absl::StatusOr<int32_t> id = make_private_(index);
  if (!id.ok()) return id.status();
  spec_.table[index] = *id;
  return absl::OkStatus();
}

namespace {

bool IsFp8(DType d) { return d == DType::kFp8E4M3 || d == DType::kFp8E5M2; }

// A storage-format payload of layers [l0, l1): its scales are finite (and positive for fp8) and
// no fp8 code is NaN or Inf. Reads the blocks (`pool` set: the rows were written already), or the
// staged payload bytes `staged` that start at payload byte `staged_begin`. INVALID_ARGUMENT
// naming the first bad value.
absl::Status ValidateStoragePayload(const BlockLayout& b, const TransferSpec& spec, uint32_t l0,
                                    uint32_t l1, const uint8_t* pool, const uint8_t* staged,
                                    uint64_t staged_begin) {
  const PayloadLayout& payload = spec.payload;
  const uint64_t bt = b.block_tokens;
  const uint64_t position = spec.token_begin;
  auto block_of = [&](uint64_t t) { return pool + uint64_t(spec.table[t / bt]) * b.block_bytes; };
  auto scale_at = [&](const LayerView& v, uint32_t l, uint32_t kv, uint32_t h, uint64_t t) {
    float scale;
    if (staged != nullptr) {
      const uint64_t at = v.dtype == DType::kInt8
                              ? payload.Int8ScaleOffset(b, l, kv, h, t - position)
                              : payload.Fp8ScaleOffset(b, l, kv, h, t / bt);
      std::memcpy(&scale, staged + (at - staged_begin), 4);
    } else {
      const uint32_t row = static_cast<uint32_t>(t % bt);
      std::memcpy(
          &scale,
          block_of(t) + (v.dtype == DType::kInt8 ? v.Int8Scale(kv, h, row) : v.Fp8Scale(kv, h)), 4);
    }
    return scale;
  };
  auto row_at = [&](const LayerView& v, uint32_t l, uint32_t kv, uint32_t h, uint64_t t) {
    if (staged != nullptr) {
      return staged + (payload.RowOffset(b, l, kv, h, t - position) - staged_begin);
    }
    const uint32_t row = static_cast<uint32_t>(t % bt);
    return block_of(t) + (kv == 0 ? v.KRow(h, row) : v.VRow(h, row));
  };
  for (uint32_t l = l0; l < l1; ++l) {
    const LayerView& v = b.layers[l];
    for (uint32_t kv = 0; kv < v.KvParts(); ++kv) {
      for (uint32_t h = 0; h < v.num_kv_heads; ++h) {
        const uint32_t dim = kv == 0 ? v.head_dim : v.head_dim_v;
        for (uint64_t t = position; t < position + payload.num_tokens; ++t) {
          const float scale = scale_at(v, l, kv, h, t);
          if (v.dtype != DType::kInt8) {
            const uint8_t* q = row_at(v, l, kv, h, t);
            for (uint32_t i = 0; i < dim; ++i) {
              if (kernels::Fp8IsNonFinite(q[i], v.dtype)) {
                return absl::InvalidArgumentError(absl::StrCat(
                    "storage-format payload: layer ", l, ", ", kv ? "V" : "K", ", head ", h,
                    ", token ", t, ", element ", i, " is an fp8 NaN/Inf code"));
              }
            }
          }
          const bool ok = v.dtype == DType::kInt8 ? std::isfinite(scale) && scale >= 0
                                                  : std::isfinite(scale) && scale > 0;
          if (!ok) {
            return absl::InvalidArgumentError(
                absl::StrCat("storage-format payload: layer ", l, ", ", kv ? "V" : "K", ", head ",
                             h, ", token ", t, " has scale ", scale, "; scales must be finite and ",
                             v.dtype == DType::kInt8 ? "non-negative" : "positive"));
          }
        }
      }
    }
  }
  return absl::OkStatus();
}

// ---- Streaming (host memory) ----

class StreamingWriter final : public PayloadWriter {
 public:
  StreamingWriter(PoolMemory* memory, const BlockLayout& blocks, TransferSpec spec,
                  MakePrivate make_private)
      : PayloadWriter(blocks, std::move(spec), std::move(make_private)), pool_(memory->base()) {
    map_ = MapOf(blocks_, spec_, pool_);
    if (spec_.mode == TransferMode::kConvert) {
      codec_ = std::make_unique<RowCodec>(blocks_, spec_.payload, spec_.dtype, pool_,
                                          spec_.table.data(), spec_.token_begin);
      codec_->SetMakePrivate([this](uint64_t index) { return Privatize(index); });
    }
  }

  absl::Status Finish() override {
    if (spec_.mode != TransferMode::kStorage) return absl::OkStatus();
    return ValidateStoragePayload(blocks_, spec_, spec_.payload.layer_begin,
                                  spec_.payload.layer_end, pool_, nullptr, 0);
  }

 private:
  absl::Status WriteAt(absl::Span<const uint8_t> data) override {
    if (codec_ != nullptr) return codec_->Write(written_, data);
    return WriteRangeAt(written_, data);
  }
  // Copied as it is (no codec): PayloadCopyCpu and ScaleCopyCpu place each byte by its offset.
  bool ConcurrentWrites() const override { return codec_ == nullptr; }
  absl::Status WriteRangeAt(uint64_t offset, absl::Span<const uint8_t> data) override {
    uint8_t* bytes = const_cast<uint8_t*>(data.data());  // read, never written
    kernels::PayloadCopyCpu(map_, kernels::CopyDirection::kPayloadToPool, offset, bytes,
                            data.size(), stores_);
    kernels::ScaleCopyCpu(map_, kernels::CopyDirection::kPayloadToPool, offset, bytes, data.size());
    return absl::OkStatus();
  }

  uint8_t* const pool_;
  kernels::PayloadMap map_;
  std::unique_ptr<RowCodec> codec_;  // kConvert
};

class StreamingReader final : public PayloadReader {
 public:
  StreamingReader(PoolMemory* memory, const BlockLayout& blocks, TransferSpec spec)
      : PayloadReader(blocks, std::move(spec)) {
    map_ = MapOf(blocks_, spec_, memory->base());
    if (spec_.mode == TransferMode::kConvert) {
      codec_ = std::make_unique<RowCodec>(blocks_, spec_.payload, spec_.dtype, memory->base(),
                                          spec_.table.data(), spec_.token_begin);
    }
  }

  absl::Status Read(uint64_t offset, absl::Span<uint8_t> out) override {
    CheckNoCoreLock("a payload read");
    if (offset > spec_.payload.total_bytes || out.size() > spec_.payload.total_bytes - offset) {
      return absl::OutOfRangeError(
          absl::StrCat("read past the payload's ", spec_.payload.total_bytes, " bytes"));
    }
    if (out.empty()) return absl::OkStatus();
    if (codec_ != nullptr) {
      codec_->Read(offset, out);
    } else {
      kernels::PayloadCopyCpu(map_, kernels::CopyDirection::kPoolToPayload, offset, out.data(),
                              out.size(), stores_);
      kernels::ScaleCopyCpu(map_, kernels::CopyDirection::kPoolToPayload, offset, out.data(),
                            out.size());
    }
    return absl::OkStatus();
  }
  // The copy and the decode (RowCodec::Read is const) only read the pool and the map.
  bool ConcurrentReads() const override { return true; }

 private:
  kernels::PayloadMap map_;
  std::unique_ptr<RowCodec> codec_;  // kConvert
};

// ---- Staged (host-staged, cuda:N) ----

// A run of whole layers of the payload that moves through the staging buffer in one piece: a
// payload of its own over the same tokens, its job's arrays starting at its first layer.
// Not copyable: job.map points into the piece's own vectors.
struct StagedPiece {
  StagedPiece() = default;
  StagedPiece(StagedPiece&&) = default;
  StagedPiece& operator=(StagedPiece&&) = default;
  StagedPiece(const StagedPiece&) = delete;
  StagedPiece& operator=(const StagedPiece&) = delete;

  uint64_t begin = 0;  // payload bytes [begin, end)
  uint64_t end = 0;
  uint32_t layer_begin = 0;  // model layers [layer_begin, layer_end)
  uint32_t layer_end = 0;
  PayloadJob job;
  std::vector<uint64_t> layer_offset;  // job.map.layer_offset, from the piece's first byte
  std::vector<uint64_t> scale_offset;  // job.map.scale_offset (storage format)
};

// `spec`'s payload cut into pieces of whole layers of at most spec.staging_bytes (a larger layer
// is a piece of its own). The jobs point into `spec` (its table) and into the pieces.
std::vector<StagedPiece> SplitForStaging(const BlockLayout& blocks, const TransferSpec& spec,
                                         uint8_t* pool) {
  const PayloadLayout& payload = spec.payload;
  PayloadJob job;
  job.map = MapOf(blocks, spec, pool);
  if (spec.mode == TransferMode::kConvert) job.convert = spec.dtype;
  const uint32_t layers = payload.layer_end - payload.layer_begin;
  auto layer_end = [&](uint32_t i) {
    return i + 1 < layers ? payload.layer_offset[i + 1] : payload.total_bytes;
  };
  std::vector<StagedPiece> pieces;
  for (uint32_t i = 0; i < layers;) {
    StagedPiece p;
    p.begin = payload.layer_offset[i];
    uint32_t j = i + 1;  // whole layers while they fit; at least one
    while (j < layers && layer_end(j) - p.begin <= spec.staging_bytes) ++j;
    p.end = layer_end(j - 1);
    p.layer_begin = payload.layer_begin + i;
    p.layer_end = payload.layer_begin + j;
    for (uint32_t k = i; k < j; ++k) {
      p.layer_offset.push_back(payload.layer_offset[k] - p.begin);
      if (payload.storage_format()) p.scale_offset.push_back(payload.scale_offset[k] - p.begin);
    }
    p.job = job;
    p.job.map.layers = job.map.layers + i;
    p.job.map.num_layers = j - i;
    p.job.map.total_bytes = p.end - p.begin;
    p.job.map.layer_offset = p.layer_offset.data();
    p.job.map.scale_offset = payload.storage_format() ? p.scale_offset.data() : nullptr;
    pieces.push_back(std::move(p));  // moving the vectors keeps their buffers: the map stays valid
    i = j;
  }
  return pieces;
}

uint64_t LargestPiece(const std::vector<StagedPiece>& pieces) {
  uint64_t largest = 0;
  for (const StagedPiece& p : pieces) largest = std::max(largest, p.end - p.begin);
  return largest;
}

class StagedWriter final : public PayloadWriter {
 public:
  StagedWriter(PoolMemory* memory, const BlockLayout& blocks, TransferSpec spec,
               MakePrivate make_private)
      : PayloadWriter(blocks, std::move(spec), std::move(make_private)), memory_(memory) {
    pieces_ = SplitForStaging(blocks_, spec_, memory_->base());
    // A converted append that continues an fp8 block may rescale it, rewriting rows an earlier
    // append stored (kernels/quant_math.h, Fp8GroupScale). The kernel cannot ask for a copy when
    // that happens, so the block is made private before the first piece moves.
    const uint64_t bt = blocks_.block_tokens;
    if (spec_.mode == TransferMode::kConvert && spec_.token_begin % bt != 0) {
      for (uint32_t l = spec_.payload.layer_begin; l < spec_.payload.layer_end; ++l) {
        rescalable_ = rescalable_ || IsFp8(blocks_.layers[l].dtype);
      }
    }
  }

  absl::Status Finish() override { return absl::OkStatus(); }  // every piece moved in Write

 private:
  absl::Status WriteAt(absl::Span<const uint8_t> data) override {
    if (staging_ == nullptr) {
      auto staged = memory_->Stage(LargestPiece(pieces_));
      if (!staged.ok()) return staged.status();
      staging_ = *std::move(staged);
    }
    uint64_t written = written_;
    for (uint64_t at = 0; at < data.size();) {
      const StagedPiece& piece = pieces_[piece_];
      const uint64_t n = std::min<uint64_t>(data.size() - at, piece.end - written);
      std::memcpy(staging_->data() + (written - piece.begin), data.data() + at, n);
      if (spec_.mode == TransferMode::kConvert) {
        // The elements this chunk completes must be finite, as the streaming codec checks.
        // (Pieces are whole layers, so they start on an element.)
        const uint32_t width = DTypeBytes(spec_.dtype);
        const uint64_t end = (written + n) / width;
        const int64_t bad = kernels::FindNonFinite(
            staging_->data() + (checked_ * width - piece.begin), spec_.dtype, end - checked_);
        if (bad >= 0) {
          const uint64_t byte = (checked_ + bad) * width;
          const PayloadRow row = LocatePayloadRow(blocks_, spec_.payload, byte);
          return NonFiniteError(row, (byte - row.begin) / width);
        }
        checked_ = end;
      }
      written += n;
      at += n;
      if (written == piece.end) {
        if (absl::Status f = Flush(piece); !f.ok()) return f;
        ++piece_;
      }
    }
    return absl::OkStatus();
  }

  // The storage-format checks of a piece whose bytes are all staged, then its move.
  absl::Status Flush(const StagedPiece& piece) {
    if (spec_.mode == TransferMode::kStorage) {
      if (absl::Status v =
              ValidateStoragePayload(blocks_, spec_, piece.layer_begin, piece.layer_end, nullptr,
                                     staging_->data(), piece.begin);
          !v.ok()) {
        return v;
      }
    }
    if (rescalable_) {
      if (absl::Status p = Privatize(spec_.token_begin / blocks_.block_tokens); !p.ok()) return p;
      rescalable_ = false;
    }
    if (piece.end == piece.begin) return absl::OkStatus();
    return memory_->WritePayload(piece.job, staging_->data());
  }

  absl::Status WriteDeviceAt(const uint8_t* device_payload) override {
    if (spec_.mode == TransferMode::kConvert) {
      // Every element must be finite, as Write checks; found on the device, named like Write.
      const uint32_t width = DTypeBytes(spec_.dtype);
      absl::StatusOr<int64_t> bad = memory_->FindNonFiniteOnDevice(
          device_payload, spec_.dtype, spec_.payload.total_bytes / width);
      if (!bad.ok()) return bad.status();
      if (*bad >= 0) {
        const uint64_t byte = static_cast<uint64_t>(*bad) * width;
        const PayloadRow row = LocatePayloadRow(blocks_, spec_.payload, byte);
        return NonFiniteError(row, (byte - row.begin) / width);
      }
    }
    if (rescalable_) {
      if (absl::Status p = Privatize(spec_.token_begin / blocks_.block_tokens); !p.ok()) return p;
      rescalable_ = false;
    }
    for (const StagedPiece& piece : pieces_) {
      if (piece.end == piece.begin) continue;
      if (absl::Status s = memory_->WritePayloadFromDevice(piece.job, device_payload + piece.begin);
          !s.ok()) {
        return s;
      }
    }
    piece_ = pieces_.size();
    return absl::OkStatus();
  }

  PoolMemory* const memory_;
  std::vector<StagedPiece> pieces_;
  size_t piece_ = 0;                        // the one being staged
  std::unique_ptr<StagingBuffer> staging_;  // sized for the largest piece
  uint64_t checked_ = 0;                    // kConvert: payload elements found finite so far
  bool rescalable_ = false;                 // the first block is made private before a move
};

class StagedReader final : public PayloadReader {
 public:
  StagedReader(PoolMemory* memory, const BlockLayout& blocks, TransferSpec spec)
      : PayloadReader(blocks, std::move(spec)), memory_(memory) {
    pieces_ = SplitForStaging(blocks_, spec_, memory_->base());
  }

  // Stages the first piece: a device that fails, fails the fetch before a byte goes out. A
  // device payload (TransferSpec::device_payload) stages nothing: ReadToDevice is its one move.
  absl::Status Start() {
    if (spec_.device_payload) return absl::OkStatus();
    const uint64_t largest = LargestPiece(pieces_);
    auto staged = memory_->Stage(largest);
    if (!staged.ok()) return staged.status();
    staged_ = *std::move(staged);
    if (largest == 0) return absl::OkStatus();
    if (absl::Status s = memory_->ReadPayload(pieces_[0].job, staged_->data()); !s.ok()) return s;
    loaded_ = 0;
    return absl::OkStatus();
  }

  absl::Status ReadToDevice(uint8_t* device_out) override {
    for (const StagedPiece& piece : pieces_) {
      if (piece.end == piece.begin) continue;
      if (absl::Status s = memory_->ReadPayloadToDevice(piece.job, device_out + piece.begin);
          !s.ok()) {
        return s;
      }
    }
    return absl::OkStatus();
  }

  absl::Status Read(uint64_t offset, absl::Span<uint8_t> out) override {
    CheckNoCoreLock("a payload read");
    if (staged_ == nullptr) {  // a device payload's reader, read through the host after all
      auto staged = memory_->Stage(LargestPiece(pieces_));
      if (!staged.ok()) return staged.status();
      staged_ = *std::move(staged);
    }
    if (offset > spec_.payload.total_bytes || out.size() > spec_.payload.total_bytes - offset) {
      return absl::OutOfRangeError(
          absl::StrCat("read past the payload's ", spec_.payload.total_bytes, " bytes"));
    }
    // The pieces that hold [offset, offset + out.size()), each read from the device once while
    // the reads go forward.
    size_t i = loaded_ < pieces_.size() && pieces_[loaded_].begin <= offset ? loaded_ : 0;
    for (uint64_t at = 0; at < out.size(); ++i) {
      const StagedPiece& piece = pieces_[i];
      if (offset + at >= piece.end) continue;
      if (loaded_ != i) {
        loaded_ = SIZE_MAX;  // until the read succeeds
        if (absl::Status s = memory_->ReadPayload(piece.job, staged_->data()); !s.ok()) return s;
        loaded_ = i;
      }
      const uint64_t n = std::min<uint64_t>(out.size() - at, piece.end - (offset + at));
      std::memcpy(out.data() + at, staged_->data() + (offset + at - piece.begin), n);
      at += n;
    }
    return absl::OkStatus();
  }

 private:
  PoolMemory* const memory_;
  std::vector<StagedPiece> pieces_;
  std::unique_ptr<StagingBuffer> staged_;  // the bytes of one piece (sized for the largest)
  size_t loaded_ = SIZE_MAX;               // which piece staged_ holds
};

}  // namespace

std::unique_ptr<PayloadWriter> NewStreamingWriter(PoolMemory* memory, const BlockLayout& blocks,
                                                  TransferSpec spec,
                                                  PayloadWriter::MakePrivate make_private) {
  return std::make_unique<StreamingWriter>(memory, blocks, std::move(spec),
                                           std::move(make_private));
}

std::unique_ptr<PayloadReader> NewStreamingReader(PoolMemory* memory, const BlockLayout& blocks,
                                                  TransferSpec spec) {
  return std::make_unique<StreamingReader>(memory, blocks, std::move(spec));
}

absl::StatusOr<std::unique_ptr<PayloadWriter>> NewStagedWriter(
    PoolMemory* memory, const BlockLayout& blocks, TransferSpec spec,
    PayloadWriter::MakePrivate make_private) {
  return std::unique_ptr<PayloadWriter>(
      new StagedWriter(memory, blocks, std::move(spec), std::move(make_private)));
}

absl::StatusOr<std::unique_ptr<PayloadReader>> NewStagedReader(PoolMemory* memory,
                                                               const BlockLayout& blocks,
                                                               TransferSpec spec) {
  auto r = std::make_unique<StagedReader>(memory, blocks, std::move(spec));
  if (absl::Status s = r->Start(); !s.ok()) return s;
  return std::unique_ptr<PayloadReader>(std::move(r));
}

}  // namespace kvbank
