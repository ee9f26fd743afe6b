// Prefix hash: the C++ function against the vectors the independent Python implementation wrote,
// domain separation of its inputs, and the hex helpers.
#include "kvbank/prefix_hash.h"

#include <cctype>
#include <cstdio>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kvbank/layout.h"
#include "nlohmann/json.hpp"

namespace kvbank {
namespace {

constexpr HashAlgorithm kAlgos[] = {HashAlgorithm::kSha256, HashAlgorithm::kXxh3_128};

nlohmann::json LoadVectors() {
  const std::string path = std::string(KVBANK_TEST_DATA_DIR) + "/prefix_hash_vectors.json";
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "cannot open " << path;
  if (!in.good()) return nlohmann::json();
  return nlohmann::json::parse(in);
}

ExtraKeyKind KindOf(const std::string& s) {
  static const std::map<std::string, ExtraKeyKind> kinds = {
      {"lora", ExtraKeyKind::kLora},
      {"multimodal", ExtraKeyKind::kMultimodal},
      {"prompt_embeds", ExtraKeyKind::kPromptEmbeds},
      {"custom", ExtraKeyKind::kCustom}};
  auto it = kinds.find(s);
  EXPECT_NE(it, kinds.end()) << "unknown extra key kind " << s;
  return it == kinds.end() ? ExtraKeyKind::kCustom : it->second;
}

std::vector<uint32_t> Iota(uint32_t n, uint32_t start = 0) {
  std::vector<uint32_t> v(n);
  for (uint32_t i = 0; i < n; ++i) v[i] = start + i;
  return v;
}

TEST(PrefixHashTest, MatchesEveryVectorOfThePythonImplementation) {
  const nlohmann::json doc = LoadVectors();
  ASSERT_TRUE(doc.contains("vectors"));
  std::map<std::string, int> per_algo;
  std::set<std::string> names;
  for (const auto& v : doc["vectors"]) {
    const std::string name = v["name"], algo_name = v["algorithm"];
    SCOPED_TRACE(name + " / " + algo_name);
    HashAlgorithm algo;
    ASSERT_TRUE(ParseHashAlgorithm(algo_name, &algo));
    EXPECT_EQ(HashAlgorithmName(algo), algo_name);
    PrefixRoot pr{v["fingerprint"], v["tenant"], v["salt"]};
    const BlockHash root = RootHash(algo, pr);
    EXPECT_EQ(HashToHex(root), v["root"].get<std::string>());
    std::vector<ExtraKey> keys;
    for (const auto& k : v["extra_keys"]) keys.push_back({KindOf(k[0]), k[1]});
    const std::vector<uint32_t> tokens = v["tokens"].get<std::vector<uint32_t>>();
    const uint32_t bt = v["block_tokens"];
    const std::vector<BlockHash> got = PrefixHashes(algo, root, tokens, bt, keys);
    const auto& want = v["hashes"];
    ASSERT_EQ(got.size(), want.size());
    ASSERT_EQ(got.size(), tokens.size() / bt);  // only full blocks are hashed
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(HashToHex(got[i]), want[i].get<std::string>()) << "block " << i;
      // The chain is ChainHash over the parent, block by block.
      const BlockHash& parent = i == 0 ? root : got[i - 1];
      EXPECT_EQ(ChainHash(algo, parent, tokens.data() + i * bt, bt, keys), got[i]);
    }
    if (algo == HashAlgorithm::kXxh3_128) {
      // XXH3-128 fills the first 16 bytes; the rest is zero.
      for (size_t b = 16; b < 32; ++b) EXPECT_EQ(root[b], 0) << "byte " << b;
    }
    ++per_algo[algo_name];
    names.insert(name);
  }
  // Both algorithms covered, every case under each.
  EXPECT_GE(per_algo["sha256"], 7);
  EXPECT_EQ(per_algo["sha256"], per_algo["xxh3_128"]);
  EXPECT_TRUE(names.count("lora_named_like_salt"));
  EXPECT_TRUE(names.count("big_ids_odd_block"));
}

TEST(PrefixHashTest, LoraNamedLikeASaltNeverEqualsTheSalt) {
  const std::vector<uint32_t> tokens = Iota(32);
  for (HashAlgorithm algo : kAlgos) {
    SCOPED_TRACE(HashAlgorithmName(algo));
    const BlockHash plain_root = RootHash(algo, {"fp", "", ""});
    const BlockHash salt_root = RootHash(algo, {"fp", "", "x"});
    const auto salted = PrefixHashes(algo, salt_root, tokens, 16);
    const auto lora = PrefixHashes(algo, plain_root, tokens, 16, {{ExtraKeyKind::kLora, "x"}});
    const auto custom = PrefixHashes(algo, plain_root, tokens, 16, {{ExtraKeyKind::kCustom, "x"}});
    const auto mm = PrefixHashes(algo, plain_root, tokens, 16, {{ExtraKeyKind::kMultimodal, "x"}});
    ASSERT_EQ(salted.size(), 2u);
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_NE(salted[i], lora[i]);
      EXPECT_NE(lora[i], custom[i]);
      EXPECT_NE(lora[i], mm[i]);
    }
    // A salt "x" is not a tenant "x" either.
    EXPECT_NE(salt_root, RootHash(algo, {"fp", "x", ""}));
    // Nor does moving a byte from one field to the next give the same root.
    EXPECT_NE(RootHash(algo, {"fpa", "b", ""}), RootHash(algo, {"fp", "ab", ""}));
    // Two extra keys are not one key holding both values.
    EXPECT_NE(PrefixHashes(algo, plain_root, tokens, 16,
                           {{ExtraKeyKind::kLora, "a"}, {ExtraKeyKind::kLora, "b"}}),
              PrefixHashes(algo, plain_root, tokens, 16, {{ExtraKeyKind::kLora, "ab"}}));
  }
}

ModelLayout SmallLayout(DType storage) {
  ModelLayout m;
  m.name = "small";
  m.num_layers = 2;
  m.num_q_heads = 4;
  m.num_kv_heads = 2;
  m.head_dim = 8;
  m.head_dim_v = 8;
  m.block_tokens = 4;
  m.layer_dtypes.assign(2, storage);
  return m;
}

TEST(PrefixHashTest, TenantSaltAndFingerprintEachChangeTheRoot) {
  const std::string fp16 = LayoutFingerprint(SmallLayout(DType::kFp16));
  const std::string int8 = LayoutFingerprint(SmallLayout(DType::kInt8));
  ModelLayout mixed = SmallLayout(DType::kFp16);
  mixed.layer_dtypes[1] = DType::kInt8;
  ModelLayout renamed = SmallLayout(DType::kFp16);
  renamed.name = "other-name";
  ASSERT_NE(fp16, int8);
  ASSERT_NE(fp16, LayoutFingerprint(mixed));
  EXPECT_EQ(fp16, LayoutFingerprint(renamed)) << "the name does not change the block bytes";
  const std::vector<uint32_t> tokens = Iota(8, 100);
  for (HashAlgorithm algo : kAlgos) {
    SCOPED_TRACE(HashAlgorithmName(algo));
    const BlockHash base = RootHash(algo, {fp16, "a", ""});
    std::set<BlockHash> roots = {base};
    for (const PrefixRoot& r :
         {PrefixRoot{fp16, "b", ""}, PrefixRoot{fp16, "a", "s"}, PrefixRoot{int8, "a", ""},
          PrefixRoot{LayoutFingerprint(mixed), "a", ""}, PrefixRoot{fp16, "", ""}}) {
      EXPECT_TRUE(roots.insert(RootHash(algo, r)).second)
          << r.layout_fingerprint << " / " << r.tenant << " / " << r.cache_salt;
    }
    EXPECT_EQ(RootHash(algo, {fp16, "a", ""}), base) << "deterministic";
    // Different roots give different chains for the same tokens, and no block hash is a root.
    std::set<BlockHash> blocks;
    for (const BlockHash& root : roots) {
      for (const BlockHash& h : PrefixHashes(algo, root, tokens, 4)) {
        EXPECT_TRUE(blocks.insert(h).second);
        EXPECT_EQ(roots.count(h), 0u);
      }
    }
    EXPECT_EQ(blocks.size(), roots.size() * 2);
  }
  // The algorithms differ too.
  EXPECT_NE(RootHash(HashAlgorithm::kSha256, {fp16, "a", ""}),
            RootHash(HashAlgorithm::kXxh3_128, {fp16, "a", ""}));
}

TEST(PrefixHashTest, ChainDependsOnEveryTokenAndOnlyFullBlocksHash) {
  const BlockHash root = RootHash(HashAlgorithm::kSha256, {"fp", "", ""});
  std::vector<uint32_t> tokens = Iota(11);
  const auto base = PrefixHashes(HashAlgorithm::kSha256, root, tokens, 4);
  ASSERT_EQ(base.size(), 2u);  // 11 tokens: 2 full blocks of 4, the partial one has no hash
  tokens[10] = 999;            // inside the partial block: no hash changes
  EXPECT_EQ(PrefixHashes(HashAlgorithm::kSha256, root, tokens, 4), base);
  tokens[5] = 999;  // second block changes, first stays
  auto h = PrefixHashes(HashAlgorithm::kSha256, root, tokens, 4);
  EXPECT_EQ(h[0], base[0]);
  EXPECT_NE(h[1], base[1]);
  tokens = Iota(11);
  tokens[0] = 999;  // the first block's change carries down the chain
  h = PrefixHashes(HashAlgorithm::kSha256, root, tokens, 4);
  EXPECT_NE(h[0], base[0]);
  EXPECT_NE(h[1], base[1]);
  EXPECT_TRUE(PrefixHashes(HashAlgorithm::kSha256, root, Iota(3), 4).empty());
}

TEST(PrefixHashTest, HexRoundTripAndRejectsBadHex) {
  const uint32_t seed = 20250917;
  std::printf("seed %u\n", seed);
  uint32_t x = seed;
  for (int round = 0; round < 64; ++round) {
    BlockHash h;
    for (uint8_t& b : h) {
      x = x * 1664525u + 1013904223u;
      b = static_cast<uint8_t>(x >> 24);
    }
    const std::string hex = HashToHex(h);
    ASSERT_EQ(hex.size(), 64u);
    EXPECT_EQ(hex.find_first_not_of("0123456789abcdef"), std::string::npos);
    BlockHash back{};
    ASSERT_TRUE(HashFromHex(hex, &back));
    EXPECT_EQ(back, h);
    std::string upper = hex;
    for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    BlockHash back_upper{};
    ASSERT_TRUE(HashFromHex(upper, &back_upper));
    EXPECT_EQ(back_upper, h);
  }
  BlockHash h;
  h.fill(0xab);
  const std::string good = HashToHex(h);
  std::string abab;
  for (int i = 0; i < 32; ++i) abab += "ab";
  EXPECT_EQ(good, abab);
  const BlockHash sentinel = [] {
    BlockHash s;
    s.fill(0x5a);
    return s;
  }();
  const std::vector<std::string> bad = {
      "",
      good.substr(0, 63),
      good + "0",
      good.substr(0, 62) + "g0",
      good.substr(0, 40) + "x" + good.substr(41),
      "0x" + good.substr(0, 62),
      good.substr(0, 63) + " ",
      std::string(64, '-'),
      good.substr(0, 32) + std::string(1, '\0') + good.substr(33),
  };
  for (const std::string& s : bad) {
    BlockHash out = sentinel;
    EXPECT_FALSE(HashFromHex(s, &out)) << "'" << s << "'";
    EXPECT_EQ(out, sentinel) << "a rejected hex must leave the output alone: '" << s << "'";
  }
  HashAlgorithm a;
  EXPECT_FALSE(ParseHashAlgorithm("SHA256", &a));
  EXPECT_FALSE(ParseHashAlgorithm("xxhash", &a));
  EXPECT_FALSE(ParseHashAlgorithm("", &a));
}

}  // namespace
}  // namespace kvbank
