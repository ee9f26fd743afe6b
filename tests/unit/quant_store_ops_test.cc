// Quantized storage in SequenceStore beyond round trips: NaN / Inf refused with nothing
// changed, bytes per token, copy on write under fork and truncate, prefix sharing and roots, and
// the dtypes a transfer may and may not use.
#include "tests/unit/quant_store_testing.h"

namespace kvbank {
namespace {

using namespace quant_testing;  // NOLINT: the test support of this file

struct Snapshot {
  SequenceInfo info;
  std::vector<uint8_t> content;
  PoolStats pool;
};
Snapshot Capture(QuantStore& store, uint64_t id) {
  Snapshot s;
  auto info = store->Get(id);
  EXPECT_TRUE(info.ok()) << info.status();
  if (info.ok()) s.info = *info;
  s.content = store.Fetch(id, DType::kFp32);
  s.pool = store->Stats().pool;
  return s;
}
void ExpectSame(QuantStore& store, const Snapshot& a, const Snapshot& b) {
  EXPECT_EQ(a.info.length, b.info.length);
  EXPECT_EQ(a.info.layer_lengths, b.info.layer_lengths);
  EXPECT_EQ(a.info.num_blocks, b.info.num_blocks);
  EXPECT_EQ(a.info.cached_tokens, b.info.cached_tokens);
  EXPECT_TRUE(a.content == b.content) << "content changed";
  EXPECT_TRUE(SamePool(a.pool, b.pool))
      << "pool before: free " << a.pool.free << " used " << a.pool.used << " cached "
      << a.pool.cached << "; after: free " << b.pool.free << " used " << b.pool.used << " cached "
      << b.pool.cached;
  EXPECT_EQ(store->CheckInvariants(), "");
}

// Byte offset, in a payload of n tokens in `wire`, of element i of (layer l, kv, head h, token t).
uint64_t PayloadOffset(const ModelLayout& m, uint64_t n, DType wire, uint32_t l, uint32_t kv,
                       uint32_t h, uint64_t t, uint32_t i) {
  const BlockLayout b = ComputeBlockLayout(m);
  const PayloadLayout p = PayloadLayout::Make(b, 0, m.num_layers, n, wire);
  const uint32_t dim = kv == 0 ? m.head_dim : m.head_dim_v;
  return p.layer_offset[l] + (kv ? p.KPartBytes(b, l) : 0) +
         ((uint64_t{h} * n + t) * dim + i) * DTypeBytes(wire);
}

// NaN and Inf (either sign), wherever they sit, are refused with INVALID_ARGUMENT naming the value
// and where it is; the sequence, its content and the pool stay exactly as they were, and the
// sequence takes a clean append afterwards.
TEST(QuantStoreTest, NonFiniteInputIsRefusedAndChangesNothing) {
  struct Where {
    const char* what;
    uint64_t tokens;  // in the append
    uint64_t token;   // of the bad value, within the append
    uint32_t layer;   // of the bad value
    size_t chunk;     // write size; 0: one Write
  };
  // The sequence holds one full block first, so each append starts a block at its row 0.
  const Where kWhere[] = {
      {"the first row of a block", 9, 0, 1, 0},
      {"a later row of a block whose scale the rows at hand set", 9, 4, 2, 0},
      {"a row split across 1000-byte writes, late in the payload", 9, 5, 3, 1000},
      {"a decode step written 7 bytes at a time", 1, 0, 0, 7},
  };
  const float kBad[] = {std::numeric_limits<float>::quiet_NaN(),
                        std::numeric_limits<float>::infinity(),
                        -std::numeric_limits<float>::infinity()};
  const uint32_t seed = 77;
  std::printf("seed %u\n", seed);
  for (Storage st : {Storage::kInt8, Storage::kFp8E4M3, Storage::kFp8E5M2, Storage::kMixed}) {
    for (DType in : {DType::kFp32, DType::kFp16, DType::kBf16}) {
      for (bool mla : {false, true}) {
        const ModelLayout m = Layout(st, in, mla);
        for (const Where& w : kWhere) {
          for (float bad : kBad) {
            SCOPED_TRACE(testing::Message() << m.name << ": " << bad << " in " << w.what);
            QuantStore store(m);
            const uint64_t id = store.NewSeq();
            Ref ref(m);
            ASSERT_TRUE(store.Append(id, 7, ref.Add(7, Uniform(seed)), 0).ok());
            const Snapshot before = Capture(store, id);

            Ref next = ref;
            std::vector<uint8_t> payload = next.Add(w.tokens, Uniform(seed + 1));
            const uint32_t kv = next.parts() - 1, h = m.num_kv_heads - 1, i = 5;
            const uint64_t at = PayloadOffset(m, w.tokens, in, w.layer, kv, h, w.token, i);
            qmath::StoreFromFloat(payload.data() + at, in, 0, bad);
            {
              auto txn = store->BeginAppend(MakeAppend(id, w.tokens));
              ASSERT_TRUE(txn.ok()) << txn.status();
              const size_t step = w.chunk ? w.chunk : payload.size();
              absl::Status s;
              size_t off = 0;
              for (; off < payload.size() && s.ok(); off += step) {
                s = (*txn)->Write(absl::MakeConstSpan(payload.data() + off,
                                                      std::min(step, payload.size() - off)));
              }
              EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
              EXPECT_GT(off, at) << "refused before the bad value arrived";
              const std::string msg(s.message());
              EXPECT_NE(msg.find("NaN or Inf"), std::string::npos) << msg;
              EXPECT_NE(msg.find(absl::StrCat("layer ", w.layer, ",")), std::string::npos) << msg;
              EXPECT_NE(msg.find(absl::StrCat("head ", h, ",")), std::string::npos) << msg;
              EXPECT_NE(msg.find(absl::StrCat("token ", w.token, ",")), std::string::npos) << msg;
              EXPECT_NE(msg.find(absl::StrCat("element ", i, ")")), std::string::npos) << msg;
            }  // the transaction is dropped here
            ExpectSame(store, before, Capture(store, id));
            auto once = store->Append(MakeAppend(id, w.tokens), payload);
            EXPECT_EQ(once.status().code(), StatusCode::kInvalidArgument) << once.status();
            ExpectSame(store, before, Capture(store, id));

            // Still usable: the clean payload goes in and reads back within bounds.
            const std::vector<uint8_t> clean = ref.Add(w.tokens, Uniform(seed + 1));
            ASSERT_TRUE(store.Append(id, w.tokens, clean, w.chunk).ok());
            ASSERT_NO_FATAL_FAILURE(store.ExpectWithinBounds(id, ref));
            if (testing::Test::HasFailure()) return;  // one case's messages are enough
          }
        }
      }
    }
  }
}

// One block's bytes, from the layout rules (kvbank/layout.h), worked out by hand for GQA 4 layers
// x 3 heads x 72 dims x 7 tokens and MLA 4 layers x 40 dims x 7 tokens.
// Appended bytes may sit at any address (the server writes them straight from gRPC's slices):
// a payload written from an odd address is stored exactly as the same payload written, in the
// same chunks, from an aligned one, for every storage dtype and input dtype, whole or in chunks
// that split rows. (The sanitizer build also checks that no element is loaded through a
// misaligned pointer.) Chunking itself may change fp8 scales on host memory, so each chunking is
// compared with itself.
TEST(QuantStoreTest, PayloadsAtAnyAddressStoreTheSame) {
  const uint32_t seed = 91;
  std::printf("seed %u\n", seed);
  for (Storage st : {Storage::kInt8, Storage::kFp8E4M3, Storage::kMixed}) {
    for (DType in : {DType::kFp32, DType::kFp16, DType::kBf16}) {
      const ModelLayout m = Layout(st, in, /*mla=*/false);
      SCOPED_TRACE(m.name);
      QuantStore store(m);
      Ref ref(m);
      const std::vector<uint8_t> payload = ref.Add(21, Uniform(seed));
      for (size_t chunk : {size_t{0}, size_t{333}}) {
        std::vector<uint8_t> want;
        for (size_t shift : {0, 1, 2, 3}) {
          std::vector<uint8_t> buffer(payload.size() + shift);
          std::memcpy(buffer.data() + shift, payload.data(), payload.size());
          const uint64_t id = store.NewSeq();
          auto txn = store->BeginAppend(MakeAppend(id, 21));
          ASSERT_TRUE(txn.ok()) << txn.status();
          const size_t step = chunk == 0 ? payload.size() : chunk;
          for (size_t off = 0; off < payload.size(); off += step) {
            const size_t len = std::min(step, payload.size() - off);
            ASSERT_TRUE((*txn)->Write(absl::MakeConstSpan(buffer.data() + shift + off, len)).ok());
          }
          ASSERT_TRUE((*txn)->Commit().ok());
          const std::vector<uint8_t> got = store.Fetch(id, DType::kFp32);
          if (shift == 0) {
            want = got;
          } else {
            EXPECT_TRUE(got == want) << "shift " << shift << ", chunk " << chunk;
          }
          ASSERT_TRUE(store->Free(id).ok());
        }
      }
    }
  }
}

TEST(QuantStoreTest, BytesPerToken) {
  struct Want {
    Storage storage;
    bool mla;
    uint64_t block_bytes;
  };
  // fp16 GQA: per layer K and V of 3 x 7 x 72 x 2 = 3024 bytes each: 4 x 6048 = 24192.
  const uint64_t fp16_gqa = 24192, fp16_mla = 4 * 7 * 40 * 2;  // MLA: K only, 560 per layer
  const Want kWant[] = {
      // int8: K 1512 bytes, V at 1520 (16-aligned) to 3032; scales at 3040: f32 [2][3][7] = 168
      // (176 aligned) + u8 zero points 42 = 218, to 3258; the next layer at 3264. 3 x 3264 + 3258
      // = 13050, 64-aligned 13056 = fp16 / 2 (12096) + 4 x 210 scale bytes + 120 padding.
      {Storage::kInt8, false, 13056},
      // fp8: the scales are f32 [2][3] = 24 bytes per layer: to 3064, next at 3072; 12288.
      {Storage::kFp8E4M3, false, 12288},
      {Storage::kFp8E5M2, false, 12288},
      // fp16, int8, int8, fp16: 6048; int8 from 6048 to 9306; from 9312 to 12570; fp16 from 12576
      // to 18624 (a multiple of 64).
      {Storage::kMixed, false, 18624},
      // MLA int8: K 280, scales at 288: f32 [1][1][7] (32 aligned) + 7 = 39, to 327; next at 336.
      // 3 x 336 + 327 = 1335, 64-aligned 1344.
      {Storage::kInt8, true, 1344},
      // MLA fp8: K 280, scale at 288 (4 bytes) to 292; next at 304; 3 x 304 + 292 = 1204 -> 1216.
      {Storage::kFp8E4M3, true, 1216},
  };
  EXPECT_EQ(ComputeBlockLayout(Layout(Storage::kMixed, DType::kFp16, false)).layers[0].elem_bytes,
            2u);
  ModelLayout fp16 = Layout(Storage::kInt8, DType::kFp16, false);
  fp16.layer_dtypes.assign(kLayers, DType::kFp16);
  EXPECT_EQ(ComputeBlockLayout(fp16).block_bytes, fp16_gqa);
  fp16 = Layout(Storage::kInt8, DType::kFp16, true);
  fp16.layer_dtypes.assign(kLayers, DType::kFp16);
  EXPECT_EQ(ComputeBlockLayout(fp16).block_bytes, fp16_mla);
  for (const Want& w : kWant) {
    const ModelLayout m = Layout(w.storage, DType::kFp16, w.mla);
    SCOPED_TRACE(m.name);
    EXPECT_EQ(ComputeBlockLayout(m).block_bytes, w.block_bytes);
    // The pool holds as many blocks of this size as fit: the store's capacity follows.
    QuantStore store(m, 10);
    EXPECT_EQ(store->pool().num_blocks(), 10u);
    EXPECT_EQ(store->pool().layout().block_bytes, w.block_bytes);
  }
  // Per token: int8 GQA 13056 / 7 = 1865.1 bytes against fp16's 3456, 0.54x; a pool of the same
  // size holds 24192 / 13056 = 1.85x the tokens.
  const double ratio = double(fp16_gqa) / 13056;
  std::printf("int8 / fp16 bytes per token: %.4f; tokens per pool: %.4fx\n", 1 / ratio, ratio);
  EXPECT_NEAR(ratio, 1.853, 0.001);

  // A real shape: llama-3.1-8b (32 layers, 8 KV heads of 128, 16 tokens) int8 against bf16.
  // Per layer int8 = 2 x 8 x 16 x 128 + 2 x 8 x 16 x (4 + 1) = 32768 + 1280 = 34048.
  ModelLayout llama;
  ASSERT_TRUE(PresetLayout("llama-3.1-8b", &llama, DType::kInt8));
  ModelLayout llama16;
  ASSERT_TRUE(PresetLayout("llama-3.1-8b", &llama16, DType::kBf16));
  EXPECT_EQ(ComputeBlockLayout(llama).block_bytes, 32u * 34048);
  EXPECT_EQ(ComputeBlockLayout(llama16).block_bytes, 32u * 65536);
  EXPECT_EQ(ComputeBlockLayout(llama).block_bytes / 16, 68096u);  // bytes per token
  std::printf("llama-3.1-8b int8: %.4fx the tokens of bf16 per pool byte\n",
              double(32 * 65536) / (32 * 34048));
}

// Fork and truncate + append on quantized sequences: each writer copies a shared block first, so
// the other sequence keeps its values (and, for fp8, the block scales they were encoded with).
TEST(QuantStoreTest, ForkAndTruncateCopyOnWrite) {
  const uint32_t seed = 500;
  std::printf("seed %u\n", seed);
  for (Storage st : {Storage::kInt8, Storage::kFp8E4M3, Storage::kFp8E5M2, Storage::kMixed}) {
    for (bool mla : {false, true}) {
      const ModelLayout m = Layout(st, DType::kFp16, mla);
      SCOPED_TRACE(m.name);
      QuantStore store(m);
      const uint64_t a = store.NewSeq();
      Ref ra(m);
      ASSERT_TRUE(store.Append(a, 17, ra.Add(17, Uniform(seed)), 0).ok());
      const Snapshot parent = Capture(store, a);
      auto forked = store->Fork(a, absl::ZeroDuration());
      ASSERT_TRUE(forked.ok()) << forked.status();
      const uint64_t b = forked->id;
      Ref rb = ra;
      EXPECT_TRUE(store.Fetch(b, DType::kFp32) == parent.content) << "the fork reads differently";
      // Blocks 0 and 1 are shared, the partial block 2 copied.
      EXPECT_EQ(store->Stats().pool.used, 4u);

      ASSERT_TRUE(store.Append(b, 5, rb.Add(5, Uniform(seed + 1)), 0).ok());
      ASSERT_TRUE(store.Append(a, 4, ra.Add(4, Uniform(seed + 2)), 0).ok());
      ASSERT_NO_FATAL_FAILURE(store.ExpectWithinBounds(a, ra));
      ASSERT_NO_FATAL_FAILURE(store.ExpectWithinBounds(b, rb));
      EXPECT_EQ(store->Stats().pool.used, 2u + 1 + 2);

      // Cut A inside shared block 1 and write there: A gets a copy; B's block 1 stays. The new
      // values stay inside the range the block's scales were set for (fp8 saturates past it).
      const std::vector<uint8_t> b_before = store.Fetch(b, DType::kFp32);
      ASSERT_TRUE(store->Truncate(a, 10).ok());
      ra.Truncate(10);
      ASSERT_TRUE(store.Append(a, 6, ra.Add(6, Uniform(seed + 3, 0.5f)), 0).ok());
      ASSERT_NO_FATAL_FAILURE(store.ExpectWithinBounds(a, ra));
      EXPECT_TRUE(store.Fetch(b, DType::kFp32) == b_before) << "B changed under A's write";

      // And the other way: B cut inside block 0, still shared with A.
      const std::vector<uint8_t> a_before = store.Fetch(a, DType::kFp32);
      ASSERT_TRUE(store->Truncate(b, 3).ok());
      rb.Truncate(3);
      ASSERT_TRUE(store.Append(b, 10, rb.Add(10, Uniform(seed + 4, 0.5f)), 1000).ok());
      ASSERT_NO_FATAL_FAILURE(store.ExpectWithinBounds(b, rb));
      EXPECT_TRUE(store.Fetch(a, DType::kFp32) == a_before) << "A changed under B's write";
      EXPECT_EQ(store->CheckInvariants(), "");
    }
  }
}

// Two sequences with the same prompt share its full quantized blocks; a quantized layout has its
// own prefix root, so its blocks never match an fp16 model's.
TEST(QuantStoreTest, PrefixSharingAndRoots) {
  const uint32_t seed = 600;
  std::printf("seed %u\n", seed);
  std::vector<uint32_t> prompt(23);
  for (uint32_t i = 0; i < prompt.size(); ++i) prompt[i] = 1000 + 7 * i;
  for (Storage st : {Storage::kInt8, Storage::kFp8E4M3, Storage::kMixed}) {
    const ModelLayout m = Layout(st, DType::kBf16, false);
    SCOPED_TRACE(m.name);
    QuantStore store(m);
    const uint64_t a = store.NewSeq(prompt);
    Ref ref(m);
    const std::vector<uint8_t> payload = ref.Add(23, Uniform(seed));
    ASSERT_TRUE(store.Append(a, 23, payload, 0, prompt).ok());
    ASSERT_NO_FATAL_FAILURE(store.ExpectWithinBounds(a, ref));
    EXPECT_EQ(store->Stats().pool.used, 4u);

    CreateOptions o;
    o.lease = absl::ZeroDuration();
    o.prompt = prompt;
    auto b = store->Create(o);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(b->cached_tokens, 21u);  // three full blocks of 7
    EXPECT_EQ(store->Stats().pool.used, 4u) << "the cached blocks are shared, not copied";
    // B sends only what is not cached: tokens [21, 23).
    const std::vector<uint8_t> rest = ref.Payload(21, 23, m.input_dtype);
    auto appended =
        store->Append(MakeAppend(b->id, 2, std::nullopt, {prompt[21], prompt[22]}), rest);
    ASSERT_TRUE(appended.ok()) << appended.status();
    EXPECT_TRUE(store.Fetch(b->id, DType::kFp32) == store.Fetch(a, DType::kFp32))
        << "B reads other values than A";
    EXPECT_EQ(store->Stats().pool.used, 5u);
    std::vector<MatchQuery> q(1);
    q[0].tokens = prompt;
    EXPECT_EQ(store->prefix().Match("", q), std::vector<uint64_t>{21});

    // Read by hash: the same values.
    const std::vector<BlockHash> hashes =
        PrefixHashes(store->options().hash, store->prefix().Root("", ""), prompt, kBlockTokens, {});
    auto blocks = store->prefix().FetchBlocks("", hashes, 0, std::nullopt, DType::kFp32);
    ASSERT_TRUE(blocks.ok()) << blocks.status();
    EXPECT_EQ((*blocks)->num_tokens(), 21u);
    std::vector<uint8_t> by_hash((*blocks)->payload_bytes());
    EXPECT_TRUE((*blocks)->Read(0, absl::MakeSpan(by_hash)).ok());
    auto prefix = store->BeginFetch([&] {
      FetchSpec f = MakeFetch(a, DType::kFp32);
      f.token_end = 21;
      return f;
    }());
    ASSERT_TRUE(prefix.ok()) << prefix.status();
    std::vector<uint8_t> by_seq((*prefix)->payload_bytes());
    EXPECT_TRUE((*prefix)->Read(0, absl::MakeSpan(by_seq)).ok());
    EXPECT_TRUE(by_hash == by_seq);

    // Same shape stored as bf16: another fingerprint, another root, no shared hash.
    ModelLayout plain = m;
    plain.layer_dtypes.assign(kLayers, DType::kBf16);
    EXPECT_NE(LayoutFingerprint(plain), LayoutFingerprint(m));
    QuantStore other(plain);
    EXPECT_NE(other->prefix().Root("", ""), store->prefix().Root("", ""));
    EXPECT_NE(
        PrefixHashes(other->options().hash, other->prefix().Root("", ""), prompt, kBlockTokens, {}),
        hashes);
  }
  // int8 and fp8 of the same shape differ too.
  EXPECT_NE(LayoutFingerprint(Layout(Storage::kInt8, DType::kFp16, false)),
            LayoutFingerprint(Layout(Storage::kFp8E4M3, DType::kFp16, false)));
  EXPECT_NE(LayoutFingerprint(Layout(Storage::kFp8E4M3, DType::kFp16, false)),
            LayoutFingerprint(Layout(Storage::kFp8E5M2, DType::kFp16, false)));
}

// Payloads travel as the input dtype (converted) or as a layer's own storage dtype; a quantized
// dtype only as the storage format of a range that stores exactly it.
TEST(QuantStoreTest, TransferDTypes) {
  const uint32_t seed = 700;
  std::printf("seed %u\n", seed);
  for (Storage st : {Storage::kInt8, Storage::kFp8E4M3, Storage::kMixed}) {
    const ModelLayout m = Layout(st, DType::kFp32, false);
    SCOPED_TRACE(m.name);
    QuantStore store(m);
    const uint64_t id = store.NewSeq();
    Ref ref(m);
    ASSERT_TRUE(store.Append(id, 9, ref.Add(9, Uniform(seed)), 0).ok());
    const Snapshot before = Capture(store, id);

    // Fetch: fp32 / fp16 / bf16 always; another quantized dtype than the range stores never.
    for (DType d : {DType::kFp32, DType::kFp16, DType::kBf16}) {
      EXPECT_TRUE(store->BeginFetch(MakeFetch(id, d)).ok()) << DTypeName(d);
    }
    const DType other_q = st == Storage::kFp8E4M3 ? DType::kInt8 : DType::kFp8E4M3;
    for (DType d : {other_q, DType::kFp8E5M2}) {
      auto r = store->BeginFetch(MakeFetch(id, d));
      EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << DTypeName(d);
      EXPECT_NE(r.status().message().find("storage format"), std::string::npos) << r.status();
      auto a = store->BeginAppend(MakeAppend(id, 1, d));
      EXPECT_EQ(a.status().code(), StatusCode::kInvalidArgument) << DTypeName(d);
      EXPECT_NE(a.status().message().find("storage format"), std::string::npos) << a.status();
    }
    if (st == Storage::kMixed) {  // int8 over fp16 and int8 layers
      auto r = store->BeginFetch(MakeFetch(id, DType::kInt8));
      EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
      EXPECT_NE(r.status().message().find("storage format"), std::string::npos) << r.status();
    }
    // Append: neither the input dtype (fp32) nor the storage dtype.
    for (DType d : {DType::kFp16, DType::kBf16}) {
      if (st == Storage::kMixed && d == DType::kFp16) continue;  // checked below
      auto a = store->BeginAppend(MakeAppend(id, 1, d));
      EXPECT_EQ(a.status().code(), StatusCode::kInvalidArgument) << DTypeName(d);
      EXPECT_NE(a.status().message().find("input dtype"), std::string::npos) << a.status();
    }
    if (st == Storage::kMixed) {
      // fp16 is layer 0's own dtype: fine for layer 0 alone, not with the int8 layer 1.
      AppendSpec both = MakeAppend(id, 1, DType::kFp16);
      both.layer_end = 2;
      auto a = store->BeginAppend(both);
      EXPECT_EQ(a.status().code(), StatusCode::kInvalidArgument) << a.status();
      EXPECT_NE(a.status().message().find("layer 1"), std::string::npos) << a.status();
      AppendSpec first = both;
      first.layer_end = 1;
      auto ok = store->BeginAppend(first);
      EXPECT_TRUE(ok.ok()) << ok.status();
      if (ok.ok()) {
        EXPECT_EQ((*ok)->dtype(), DType::kFp16);
      }
    }
    ExpectSame(store, before, Capture(store, id));
    // Unspecified: the input dtype in, the input dtype out.
    auto r = store->BeginFetch(MakeFetch(id, std::nullopt));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ((*r)->dtype(), DType::kFp32);
    EXPECT_EQ(DefaultWireDType(m, 0, kLayers), DType::kFp32);
  }
}

}  // namespace
}  // namespace kvbank
