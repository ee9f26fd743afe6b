#include <algorithm>
#include <cstring>

#include "block_copy.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KVBANK_COPY_X86 1
#else
#define KVBANK_COPY_X86 0
#endif

namespace kvbank::kernels {

namespace {

constexpr uint64_t kLine = 64;

#if KVBANK_COPY_X86
// `lines` whole 64-byte lines from `src` (any alignment) to `dst` (64-byte aligned), around the
// caches. Unfenced: the caller fences once after its last one.
void StreamLinesSse2(uint8_t* dst, const uint8_t* src, uint64_t lines) {
  for (uint64_t i = 0; i < lines; ++i, dst += kLine, src += kLine) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 48), d);
  }
}

// Two lines a step in 32-byte stores: 5-10% faster than the SSE2 loop in a 16 MiB gather of
// 4 KiB runs over memory larger than the caches (Zen 5, 2 vCPUs).
__attribute__((target("avx2"))) void StreamLinesAvx2(uint8_t* dst, const uint8_t* src,
                                                     uint64_t lines) {
  uint64_t i = 0;
  for (; i + 2 <= lines; i += 2, dst += 2 * kLine, src += 2 * kLine) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 64));
    const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + 96), d);
  }
  if (i < lines) StreamLinesSse2(dst, src, 1);
}

using StreamLinesFn = void (*)(uint8_t*, const uint8_t*, uint64_t);

StreamLinesFn ActiveStreamLines() {
  static const StreamLinesFn fn = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") ? StreamLinesAvx2 : StreamLinesSse2;
  }();
  return fn;
}
#endif

// memcpy, with `dst`'s whole lines written around the caches. Unfenced (see StreamLinesSse2).
void StreamCopyUnfenced(uint8_t* dst, const uint8_t* src, uint64_t n) {
#if KVBANK_COPY_X86
  const uint64_t head = (kLine - (reinterpret_cast<uintptr_t>(dst) & (kLine - 1))) & (kLine - 1);
  if (n < head + kLine) {
    std::memcpy(dst, src, n);
    return;
  }
  std::memcpy(dst, src, head);
  const uint64_t lines = (n - head) / kLine;
  ActiveStreamLines()(dst + head, src + head, lines);
  const uint64_t done = head + lines * kLine;
  std::memcpy(dst + done, src + done, n - done);
#else
  std::memcpy(dst, src, n);
#endif
}

// Makes the streamed stores before it visible before any store after it (they are weakly
// ordered: a reply sent after the copy must not overtake them).
void StreamFence() {
#if KVBANK_COPY_X86
  _mm_sfence();
#endif
}

inline void Copy(uint8_t* dst, const uint8_t* src, uint64_t n, CopyStores stores) {
  if (stores == CopyStores::kStream && n >= kStreamRunBytes) {
    StreamCopyUnfenced(dst, src, n);
  } else {
    std::memcpy(dst, src, n);
  }
}

// One contiguous run: `rows` consecutive token rows of one head in one block. In the payload the
// same run is contiguous too (tokens are the inner-most-but-one axis of both).
inline void CopyRun(uint8_t* pool_bytes, uint64_t bytes, uint64_t run_begin, uint64_t offset,
                    uint8_t* buf, uint64_t len, CopyDirection dir, CopyStores stores) {
  // Intersect the run [run_begin, run_begin + bytes) with the window [offset, offset + len).
  const uint64_t lo = std::max(run_begin, offset);
  const uint64_t hi = std::min(run_begin + bytes, offset + len);
  if (lo >= hi) return;
  uint8_t* pool_at = pool_bytes + (lo - run_begin);
  uint8_t* buf_at = buf + (lo - offset);
  if (dir == CopyDirection::kPayloadToPool) {
    Copy(pool_at, buf_at, hi - lo, stores);
  } else {
    Copy(buf_at, pool_at, hi - lo, stores);
  }
}

// The runs of one layer's K or V part that meet payload bytes [offset, offset + len), read out
// of the pool. Block by block, and in each block head after head: a block holds the part's heads
// one after another, so the pool is read in runs of heads x block_tokens rows (32 KiB for 8
// heads of 16 rows of 256 bytes) instead of one head's 4 KiB before a jump to the next block.
// The prefetchers do not cross pages: over memory larger than the caches a 16 MiB gather ran
// 15-20% faster so (one thread: 14.4 -> 16.9 GB/s). With fewer than kMinGatherHeads heads in
// the window it is slower (two heads: as many write streams, 8 KiB reads; a 64 MiB gather in
// 256 KiB windows: 13.9 -> 12.3 GB/s): false then, and the caller copies head by head.
constexpr uint32_t kMinGatherHeads = 4;
bool GatherPart(const PayloadMap& m, const LayerView& v, uint64_t layer_begin, uint32_t part,
                uint64_t offset, uint8_t* buf, uint64_t len, CopyStores stores) {
  const uint64_t end = offset + len;
  const uint64_t row_bytes = part == 0 ? v.KRowBytes() : v.VRowBytes();
  const uint64_t head_bytes = m.num_tokens * row_bytes;
  const uint64_t part_begin = v.PayloadRow(layer_begin, m.num_tokens, v.elem_bytes, part, 0, 0);
  if (part_begin >= end || part_begin + v.num_kv_heads * head_bytes <= offset) return true;
  // Heads [h0, h1) meet the window (the first and last perhaps in part: CopyRun clips).
  const uint64_t lo = std::max(offset, part_begin) - part_begin;
  const uint64_t hi = std::min(end - part_begin, v.num_kv_heads * head_bytes);
  const uint32_t h0 = static_cast<uint32_t>(lo / head_bytes);
  const uint32_t h1 = static_cast<uint32_t>((hi + head_bytes - 1) / head_bytes);
  if (h1 - h0 < kMinGatherHeads) return false;
  for (uint64_t t = 0; t < m.num_tokens;) {
    const uint64_t pos = m.token_begin + t;
    const uint32_t row = static_cast<uint32_t>(pos % v.block_tokens);
    const uint64_t run = std::min<uint64_t>(v.block_tokens - row, m.num_tokens - t);
    uint8_t* block = m.pool + uint64_t(m.block_table[pos / v.block_tokens]) * m.block_bytes;
    for (uint32_t h = h0; h < h1; ++h) {
      const uint64_t run_begin = v.PayloadRow(layer_begin, m.num_tokens, v.elem_bytes, part, h, t);
      const uint64_t at = part == 0 ? v.KRow(h, row) : v.VRow(h, row);
      CopyRun(block + at, run * row_bytes, run_begin, offset, buf, len,
              CopyDirection::kPoolToPayload, stores);
    }
    t += run;
  }
  return true;
}

}  // namespace

void CopyBytes(uint8_t* dst, const uint8_t* src, uint64_t n, CopyStores stores) {
  Copy(dst, src, n, stores);
  if (stores == CopyStores::kStream) StreamFence();
}

void PayloadCopyCpu(const PayloadMap& m, CopyDirection dir, uint64_t offset, uint8_t* buf,
                    uint64_t len, CopyStores stores) {
  if (len == 0 || m.num_tokens == 0) return;
  const uint64_t end = offset + len;
  for (uint32_t li = 0; li < m.num_layers; ++li) {
    const LayerView& v = m.layers[li];
    const uint64_t layer_begin = m.layer_offset[li];
    const uint64_t layer_bytes = v.PayloadBytesPerToken() * m.num_tokens;
    if (layer_begin >= end) break;
    if (layer_begin + layer_bytes <= offset) continue;
    for (uint32_t part = 0; part < v.KvParts(); ++part) {
      const uint64_t row_bytes = part == 0 ? v.KRowBytes() : v.VRowBytes();
      const uint64_t head_bytes = m.num_tokens * row_bytes;
      if (dir == CopyDirection::kPoolToPayload &&
          GatherPart(m, v, layer_begin, part, offset, buf, len, stores)) {
        continue;
      }
      for (uint32_t h = 0; h < v.num_kv_heads; ++h) {
        const uint64_t head_begin =
            v.PayloadRow(layer_begin, m.num_tokens, v.elem_bytes, part, h, 0);
        if (head_begin >= end || head_begin + head_bytes <= offset) continue;
        // Start at the token holding byte `offset` (runs may begin at any token).
        uint64_t t = head_begin < offset ? (offset - head_begin) / row_bytes : 0;
        while (t < m.num_tokens) {
          const uint64_t pos = m.token_begin + t;
          const uint32_t row = static_cast<uint32_t>(pos % v.block_tokens);
          const uint64_t run = std::min<uint64_t>(v.block_tokens - row, m.num_tokens - t);
          const uint64_t run_begin =
              v.PayloadRow(layer_begin, m.num_tokens, v.elem_bytes, part, h, t);
          if (run_begin >= end) break;
          if (run_begin + run * row_bytes > offset) {
            uint8_t* block = m.pool + uint64_t(m.block_table[pos / v.block_tokens]) * m.block_bytes;
            const uint64_t at = part == 0 ? v.KRow(h, row) : v.VRow(h, row);
            CopyRun(block + at, run * row_bytes, run_begin, offset, buf, len, dir, stores);
          }
          t += run;
        }
      }
    }
  }
  if (stores == CopyStores::kStream) StreamFence();
}

void ScaleCopyCpu(const PayloadMap& m, CopyDirection dir, uint64_t offset, uint8_t* buf,
                  uint64_t len) {
  if (m.scale_offset == nullptr || len == 0) return;
  const uint64_t end = offset + len;
  for (uint32_t li = 0; li < m.num_layers; ++li) {
    const LayerView& v = m.layers[li];
    const uint64_t section = m.scale_offset[li];
    if (section >= end) break;
    const uint32_t parts = v.KvParts();
    if (v.dtype == DType::kInt8) {
      // f32 scales [kv][h][n], then u8 zero points [kv][h][n]; runs of tokens within a block are
      // contiguous on both sides.
      for (int zp = 0; zp < 2; ++zp) {
        const uint64_t width = zp ? 1 : kPayloadScaleBytes;
        for (uint32_t kv = 0; kv < parts; ++kv) {
          for (uint32_t h = 0; h < v.num_kv_heads; ++h) {
            auto at_payload = [&](uint64_t t) {
              return zp ? v.PayloadInt8ZeroPoint(section, m.num_tokens, kv, h, t)
                        : v.PayloadInt8Scale(section, m.num_tokens, kv, h, t);
            };
            const uint64_t row_begin = at_payload(0);
            if (row_begin >= end || row_begin + m.num_tokens * width <= offset) continue;
            for (uint64_t t = 0; t < m.num_tokens;) {
              const uint64_t pos = m.token_begin + t;
              const uint32_t row = static_cast<uint32_t>(pos % v.block_tokens);
              const uint64_t run = std::min<uint64_t>(v.block_tokens - row, m.num_tokens - t);
              uint8_t* block =
                  m.pool + uint64_t(m.block_table[pos / v.block_tokens]) * m.block_bytes;
              uint8_t* at = block + (zp ? v.Int8ZeroPoint(kv, h, row) : v.Int8Scale(kv, h, row));
              CopyRun(at, run * width, at_payload(t), offset, buf, len, dir, CopyStores::kCached);
              t += run;
            }
          }
        }
      }
    } else if (v.dtype == DType::kFp8E4M3 || v.dtype == DType::kFp8E5M2) {
      // f32 scales [kv][h][num_blocks].
      const uint64_t nb = BlocksTouched(m.token_begin, m.num_tokens, v.block_tokens);
      for (uint32_t kv = 0; kv < parts; ++kv) {
        for (uint32_t h = 0; h < v.num_kv_heads; ++h) {
          for (uint64_t b = 0; b < nb; ++b) {
            const uint64_t at_payload = v.PayloadFp8Scale(section, nb, kv, h, b);
            if (at_payload >= end || at_payload + kPayloadScaleBytes <= offset) continue;
            uint8_t* block = m.pool + uint64_t(m.block_table[m.first_block + b]) * m.block_bytes;
            CopyRun(block + v.Fp8Scale(kv, h), kPayloadScaleBytes, at_payload, offset, buf, len,
                    dir, CopyStores::kCached);
          }
        }
      }
    }
  }
}

void CopyBlocksCpu(uint8_t* pool, uint64_t block_bytes, const int32_t* src_ids,
                   const int32_t* dst_ids, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    std::memcpy(pool + uint64_t(dst_ids[i]) * block_bytes,
                pool + uint64_t(src_ids[i]) * block_bytes, block_bytes);
  }
}

void CopyRowsCpu(uint8_t* pool, uint64_t block_bytes, const LayerView* layers,
                 const RowCopy* copies, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const RowCopy& c = copies[i];
    const LayerView& v = layers[c.layer];
    const uint8_t* s = pool + uint64_t(c.src_block) * block_bytes;
    uint8_t* d = pool + uint64_t(c.dst_block) * block_bytes;
    for (uint32_t h = 0; h < v.num_kv_heads; ++h) {
      std::memcpy(d + v.KRow(h, c.dst_row), s + v.KRow(h, c.src_row), v.KRowBytes());
      if (v.has_v) std::memcpy(d + v.VRow(h, c.dst_row), s + v.VRow(h, c.src_row), v.VRowBytes());
    }
    for (uint32_t kv = 0; kv < v.KvParts(); ++kv) {
      for (uint32_t h = 0; h < v.num_kv_heads; ++h) {
        if (v.dtype == DType::kInt8) {
          std::memcpy(d + v.Int8Scale(kv, h, c.dst_row), s + v.Int8Scale(kv, h, c.src_row), 4);
          d[v.Int8ZeroPoint(kv, h, c.dst_row)] = s[v.Int8ZeroPoint(kv, h, c.src_row)];
        } else if ((v.dtype == DType::kFp8E4M3 || v.dtype == DType::kFp8E5M2) && s != d) {
          std::memcpy(d + v.Fp8Scale(kv, h), s + v.Fp8Scale(kv, h), 4);
        }
      }
    }
  }
}

}  // namespace kvbank::kernels
