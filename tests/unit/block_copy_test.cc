// CPU copy kernels against element-by-element references: payload scatter / gather through a
// shuffled block table with any chunking, whole-block copies, and partial token-row copies.
#include "kernels/block_copy.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kvbank/layout.h"

namespace kvbank::kernels {
namespace {

constexpr uint64_t kSeed = 20240611;

ModelLayout Shape(AttentionKind kind, uint32_t kv_heads, uint32_t head_dim, uint32_t block_tokens,
                  std::vector<DType> dtypes) {
  ModelLayout m;
  m.name = "copy";
  m.kind = kind;
  m.num_layers = static_cast<uint32_t>(dtypes.size());
  m.num_kv_heads = kv_heads;
  m.num_q_heads = kv_heads * 2;
  m.head_dim = m.head_dim_v = head_dim;
  m.block_tokens = block_tokens;
  if (kind == AttentionKind::kMla) {
    m.rope_dim = head_dim / 3;
    m.kv_lora_rank = head_dim - m.rope_dim;
    m.head_dim_v = m.kv_lora_rank;
  }
  m.layer_dtypes = std::move(dtypes);
  EXPECT_EQ(ValidateLayout(m), "");
  return m;
}

std::vector<uint8_t> RandomBytes(std::mt19937_64& rng, uint64_t n) {
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

// Byte `i` of the payload of layers [l0, l1) x n tokens starting at sequence position `pos`, as
// an address in the pool; computed one element at a time from the payload description in
// layout.h ("for each layer: K [heads][n][head_dim], then V [heads][n][head_dim_v]").
std::vector<uint64_t> ReferenceAddresses(const BlockLayout& b, uint32_t l0, uint32_t l1,
                                         uint64_t pos, uint64_t n,
                                         const std::vector<int32_t>& table) {
  std::vector<uint64_t> addr;
  for (uint32_t l = l0; l < l1; ++l) {
    const LayerView& v = b.layers[l];
    for (int part = 0; part < (v.has_v ? 2 : 1); ++part) {
      const uint64_t dim = part == 0 ? v.head_dim : v.head_dim_v;
      const uint64_t base = part == 0 ? v.k_offset : v.v_offset;
      for (uint64_t h = 0; h < v.num_kv_heads; ++h) {
        for (uint64_t t = 0; t < n; ++t) {
          const uint64_t p = pos + t;
          const uint64_t block = uint64_t(table[p / v.block_tokens]);
          const uint64_t row = (h * v.block_tokens + p % v.block_tokens) * dim * v.elem_bytes;
          for (uint64_t e = 0; e < dim * v.elem_bytes; ++e) {
            addr.push_back(block * b.block_bytes + base + row + e);
          }
        }
      }
    }
  }
  return addr;
}

struct Case {
  std::string name;
  ModelLayout layout;
  uint32_t l0, l1;
  uint64_t pos, n;
};

std::vector<Case> Cases() {
  std::vector<Case> out;
  const std::vector<DType> mixed = {DType::kFp16, DType::kBf16, DType::kFp32, DType::kInt8};
  for (uint32_t bt : {1u, 3u, 7u, 17u}) {
    for (uint32_t hd : {1u, 3u, 72u}) {
      out.push_back({"gqa", Shape(AttentionKind::kGqa, 3, hd, bt, mixed), 0, 4, 0, 2 * bt + 1});
      out.push_back({"gqa-mid", Shape(AttentionKind::kGqa, 2, hd, bt, mixed), 1, 3, bt + 2, 5});
      // Enough heads that a gather window may hold a part's heads whole (read block by block),
      // from a token inside a block.
      out.push_back(
          {"gqa-8", Shape(AttentionKind::kGqa, 8, hd, bt, mixed), 0, 3, bt / 2 + 1, 3 * bt + 2});
      out.push_back({"mqa", Shape(AttentionKind::kMqa, 1, hd, bt, {DType::kFp16, DType::kFp16}), 1,
                     2, 1, 3 * bt});
    }
    out.push_back({"mla", Shape(AttentionKind::kMla, 1, 9, bt, {DType::kBf16, DType::kFp32}), 0, 2,
                   bt - 1, bt + 2});
    out.push_back({"mla-576", Shape(AttentionKind::kMla, 1, 576, bt, {DType::kBf16}), 0, 1, 2, 4});
  }
  return out;
}

struct Pool {
  BlockLayout b;
  std::vector<int32_t> table;  // shuffled: logical block i -> physical block
  std::vector<uint8_t> bytes;
  std::vector<uint64_t> layer_offset;
  PayloadMap map;
};

Pool MakePool(const Case& c, std::mt19937_64& rng) {
  Pool p;
  p.b = ComputeBlockLayout(c.layout);
  const uint64_t logical = (c.pos + c.n + c.layout.block_tokens - 1) / c.layout.block_tokens;
  const uint64_t physical = logical + 3;  // spare blocks the copies must not touch
  std::vector<int32_t> ids(physical);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  p.table.assign(ids.begin(), ids.begin() + logical);
  p.bytes = RandomBytes(rng, physical * p.b.block_bytes);
  const PayloadLayout pl = PayloadLayout::Make(p.b, c.l0, c.l1, c.n);
  p.layer_offset = pl.layer_offset;
  p.map.pool = p.bytes.data();
  p.map.block_bytes = p.b.block_bytes;
  p.map.layers = p.b.layers.data() + c.l0;
  p.map.layer_offset = p.layer_offset.data();
  p.map.num_layers = c.l1 - c.l0;
  p.map.block_table = p.table.data();
  p.map.token_begin = c.pos;
  p.map.num_tokens = c.n;
  p.map.total_bytes = pl.total_bytes;
  return p;
}

// Splits [0, total) into chunks: `fixed` bytes each, or random sizes when fixed is 0.
std::vector<std::pair<uint64_t, uint64_t>> Chunks(uint64_t total, uint64_t fixed,
                                                  std::mt19937_64& rng) {
  std::vector<std::pair<uint64_t, uint64_t>> out;
  for (uint64_t off = 0; off < total;) {
    uint64_t len = fixed ? fixed : 1 + rng() % 300;
    len = std::min(len, total - off);
    out.push_back({off, len});
    off += len;
  }
  return out;
}

TEST(BlockCopyTest, PayloadScatterGatherMatchesReference) {
  std::printf("seed=%llu\n", static_cast<unsigned long long>(kSeed));
  std::mt19937_64 rng(kSeed);
  int cases = 0;
  for (const Case& c : Cases()) {
    for (uint64_t chunk : {uint64_t{0}, uint64_t{1}, uint64_t{7}, uint64_t{4096}}) {
      for (CopyStores stores : {CopyStores::kCached, CopyStores::kStream}) {
        SCOPED_TRACE(c.name + " bt=" + std::to_string(c.layout.block_tokens) + " hd=" +
                     std::to_string(c.layout.head_dim) + " chunk=" + std::to_string(chunk) +
                     (stores == CopyStores::kStream ? " streamed" : ""));
        Pool p = MakePool(c, rng);
        const std::vector<uint64_t> addr = ReferenceAddresses(p.b, c.l0, c.l1, c.pos, c.n, p.table);
        ASSERT_EQ(addr.size(), p.map.total_bytes);
        ASSERT_EQ(std::set<uint64_t>(addr.begin(), addr.end()).size(), addr.size())
            << "reference maps two payload bytes to one pool byte";

        // Scatter a random payload; the reference does the same one byte at a time.
        std::vector<uint8_t> payload = RandomBytes(rng, p.map.total_bytes);
        std::vector<uint8_t> want = p.bytes;
        for (size_t i = 0; i < addr.size(); ++i) want[addr[i]] = payload[i];
        for (auto [off, len] : Chunks(payload.size(), chunk, rng)) {
          PayloadCopyCpu(p.map, CopyDirection::kPayloadToPool, off, payload.data() + off, len,
                         stores);
        }
        ASSERT_TRUE(p.bytes == want)
            << "scatter differs from the reference (or touched other bytes)";

        // Gather with an independent chunking into a buffer pre-filled with a sentinel.
        std::vector<uint8_t> got(payload.size(), 0xA5);
        for (auto [off, len] : Chunks(payload.size(), chunk == 0 ? 0 : chunk + 2, rng)) {
          PayloadCopyCpu(p.map, CopyDirection::kPoolToPayload, off, got.data() + off, len, stores);
        }
        ASSERT_TRUE(got == payload) << "gather does not return what was scattered";
        ASSERT_TRUE(p.bytes == want) << "gather wrote to the pool";
        // In one call: every part's heads in the window (the pool read block by block).
        std::vector<uint8_t> whole(payload.size(), 0xA5);
        PayloadCopyCpu(p.map, CopyDirection::kPoolToPayload, 0, whole.data(), whole.size(), stores);
        ASSERT_TRUE(whole == payload) << "a whole-payload gather differs";

        // A window in the middle reads exactly its bytes and writes nothing outside `len`.
        if (payload.size() > 4) {
          const uint64_t off = rng() % (payload.size() / 2),
                         len = 1 + rng() % (payload.size() - off);
          std::vector<uint8_t> win(len + 8, 0x5A);
          PayloadCopyCpu(p.map, CopyDirection::kPoolToPayload, off, win.data(), len, stores);
          for (uint64_t i = 0; i < len; ++i) ASSERT_EQ(win[i], payload[off + i]) << "byte " << i;
          for (uint64_t i = len; i < len + 8; ++i) ASSERT_EQ(win[i], 0x5A) << "overrun at " << i;
        }
        ++cases;
      }
    }
  }
  EXPECT_GT(cases, 100);
}

// Every destination alignment within a line, lengths around the line and the stream threshold,
// a source off by a few bytes: exactly the bytes asked for, nothing before or after.
TEST(BlockCopyTest, CopyBytesWritesExactlyItsRange) {
  std::mt19937_64 rng(kSeed + 3);
  const std::vector<uint8_t> src = RandomBytes(rng, 8192);
  for (CopyStores stores : {CopyStores::kCached, CopyStores::kStream}) {
    for (uint64_t n : {uint64_t{0}, uint64_t{1}, uint64_t{63}, uint64_t{64}, uint64_t{65},
                       kStreamRunBytes - 1, kStreamRunBytes, kStreamRunBytes + 1,
                       kStreamRunBytes + 64 + 7, uint64_t{1000}, uint64_t{4096 + 13}}) {
      for (uint64_t dst_at = 0; dst_at < 64; ++dst_at) {
        const uint64_t src_at = (dst_at * 5) % 13;
        std::vector<uint8_t> dst(n + 192, 0xC3);
        // Line-aligned base: dst_at is the copy's offset within a line.
        uint8_t* base = dst.data() + ((64 - reinterpret_cast<uintptr_t>(dst.data()) % 64) % 64);
        CopyBytes(base + dst_at, src.data() + src_at, n, stores);
        for (uint8_t* q = dst.data(); q < dst.data() + dst.size(); ++q) {
          const uint8_t* at = base + dst_at;
          const uint8_t want = q >= at && q < at + n ? src[src_at + (q - at)] : 0xC3;
          ASSERT_EQ(*q, want) << "n=" << n << " dst_at=" << dst_at << " byte " << (q - dst.data())
                              << (stores == CopyStores::kStream ? " streamed" : "");
        }
      }
    }
  }
}

TEST(BlockCopyTest, ZeroLengthAndZeroTokensCopyNothing) {
  std::mt19937_64 rng(kSeed + 1);
  const Case c{"gqa", Shape(AttentionKind::kGqa, 2, 3, 3, {DType::kFp16}), 0, 1, 0, 4};
  Pool p = MakePool(c, rng);
  const std::vector<uint8_t> before = p.bytes;
  std::vector<uint8_t> buf(8, 1);
  PayloadCopyCpu(p.map, CopyDirection::kPayloadToPool, 3, buf.data(), 0);
  p.map.num_tokens = 0;
  PayloadCopyCpu(p.map, CopyDirection::kPayloadToPool, 0, buf.data(), 8);
  EXPECT_TRUE(p.bytes == before);
}

TEST(BlockCopyTest, CopyBlocksCopiesWholeBlocksOnly) {
  std::printf("seed=%llu\n", static_cast<unsigned long long>(kSeed + 2));
  std::mt19937_64 rng(kSeed + 2);
  for (uint32_t bt : {1u, 3u, 17u}) {
    const BlockLayout b = ComputeBlockLayout(
        Shape(AttentionKind::kGqa, 3, 5, bt, {DType::kFp16, DType::kInt8, DType::kFp8E4M3}));
    const int32_t blocks = 11;
    std::vector<uint8_t> pool = RandomBytes(rng, blocks * b.block_bytes);
    const std::vector<uint8_t> before = pool;
    const std::vector<int32_t> src = {3, 0, 9, 4}, dst = {7, 1, 2, 10};
    CopyBlocksCpu(pool.data(), b.block_bytes, src.data(), dst.data(), src.size());
    for (int32_t id = 0; id < blocks; ++id) {
      auto it = std::find(dst.begin(), dst.end(), id);
      const int32_t from = it == dst.end() ? id : src[it - dst.begin()];
      for (uint64_t i = 0; i < b.block_bytes; ++i) {
        ASSERT_EQ(pool[id * b.block_bytes + i], before[from * b.block_bytes + i])
            << "block " << id << " byte " << i;
      }
    }
    CopyBlocksCpu(pool.data(), b.block_bytes, src.data(), dst.data(), 0);
  }
}

// Expected destination block after a fork's row copies, built one element at a time from the layout
// description: rows t < rows[l] of K and V (all heads), their int8 scales and zero points, and
// for fp8 the whole per-block scale region; every other byte keeps the sentinel.
std::vector<uint8_t> ExpectedRows(const BlockLayout& b, const std::vector<uint32_t>& rows,
                                  const uint8_t* src, uint8_t sentinel) {
  std::vector<uint8_t> want(b.block_bytes, sentinel);
  for (uint32_t l = 0; l < b.num_layers(); ++l) {
    const LayerView& v = b.layers[l];
    const uint32_t n = rows[l];
    for (uint32_t h = 0; h < v.num_kv_heads; ++h) {
      for (uint32_t t = 0; t < n; ++t) {
        for (uint64_t e = 0; e < v.KRowBytes(); ++e) want[v.KRow(h, t) + e] = src[v.KRow(h, t) + e];
        if (!v.has_v) continue;
        for (uint64_t e = 0; e < v.VRowBytes(); ++e) want[v.VRow(h, t) + e] = src[v.VRow(h, t) + e];
      }
    }
    for (uint32_t kv = 0; kv < v.KvParts(); ++kv) {
      for (uint32_t h = 0; h < v.num_kv_heads; ++h) {
        if (v.dtype == DType::kInt8) {
          for (uint32_t t = 0; t < n; ++t) {
            for (int e = 0; e < 4; ++e)
              want[v.Int8Scale(kv, h, t) + e] = src[v.Int8Scale(kv, h, t) + e];
            want[v.Int8ZeroPoint(kv, h, t)] = src[v.Int8ZeroPoint(kv, h, t)];
          }
        } else if (v.scale_bytes != 0 && n > 0) {
          for (int e = 0; e < 4; ++e) want[v.Fp8Scale(kv, h) + e] = src[v.Fp8Scale(kv, h) + e];
        }
      }
    }
  }
  return want;
}

// A prefix fork copies the first rows[l] rows of every layer of its partial block (CopyRowsCpu
// with one RowCopy per row, as SequenceStore::Fork does): exactly those bytes, nothing else.
TEST(BlockCopyTest, ForkRowCopiesCopyExactlyTheFirstRows) {
  std::printf("seed=%llu\n", static_cast<unsigned long long>(kSeed + 3));
  std::mt19937_64 rng(kSeed + 3);
  const std::vector<DType> mixed = {DType::kFp16, DType::kInt8, DType::kFp8E5M2, DType::kFp32,
                                    DType::kBf16};
  int checked = 0;
  for (uint32_t bt : {1u, 3u, 7u, 17u}) {
    for (uint32_t hd : {1u, 3u, 72u}) {
      for (const ModelLayout& m : {Shape(AttentionKind::kGqa, 3, hd, bt, mixed),
                                   Shape(AttentionKind::kMqa, 1, hd, bt, mixed),
                                   Shape(AttentionKind::kMla, 1, hd + 2, bt, mixed)}) {
        const BlockLayout b = ComputeBlockLayout(m);
        for (int trial = 0; trial < 4; ++trial) {
          std::vector<uint32_t> rows(b.num_layers());
          for (uint32_t& r : rows) r = static_cast<uint32_t>(rng() % (bt + 1));
          if (trial == 0) std::fill(rows.begin(), rows.end(), 0u);
          if (trial == 1) std::fill(rows.begin(), rows.end(), bt);
          SCOPED_TRACE(LayoutFingerprint(m) + " trial " + std::to_string(trial));
          const uint8_t sentinel = 0xAB;
          std::vector<uint8_t> pool = RandomBytes(rng, 4 * b.block_bytes);
          std::fill(pool.begin() + 2 * b.block_bytes, pool.begin() + 3 * b.block_bytes, sentinel);
          const std::vector<uint8_t> before = pool;
          std::vector<RowCopy> copies;
          for (uint32_t l = 0; l < b.num_layers(); ++l) {
            for (uint32_t t = 0; t < rows[l]; ++t)
              copies.push_back({/*src=*/1, /*dst=*/2, t, t, l});
          }
          CopyRowsCpu(pool.data(), b.block_bytes, b.layers.data(), copies.data(), copies.size());
          const std::vector<uint8_t> want =
              ExpectedRows(b, rows, before.data() + b.block_bytes, sentinel);
          ASSERT_TRUE(std::equal(want.begin(), want.end(), pool.begin() + 2 * b.block_bytes))
              << "destination block differs";
          for (int id : {0, 1, 3}) {
            ASSERT_TRUE(std::equal(pool.begin() + id * b.block_bytes,
                                   pool.begin() + (id + 1) * b.block_bytes,
                                   before.begin() + id * b.block_bytes))
                << "block " << id << " changed";
          }
          ++checked;
        }
      }
    }
  }
  EXPECT_EQ(checked, 4 * 3 * 3 * 4);
}

}  // namespace
}  // namespace kvbank::kernels
