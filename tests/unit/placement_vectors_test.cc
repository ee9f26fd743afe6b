// Fleet placement (client/PLACEMENT.md): the C++ prefix hash, rendezvous score and order and
// bounded-load choice against the vectors the independent Python implementation wrote
// (tests/data/placement.py).
#include <xxhash.h>

#include <charconv>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <system_error>
#include <vector>

#include "gtest/gtest.h"
#include "kvbank/fleet.h"
#include "kvbank/prefix_hash.h"
#include "nlohmann/json.hpp"

namespace kvbank {
namespace {

nlohmann::json LoadVectors() {
  const std::string path = std::string(KVBANK_TEST_DATA_DIR) + "/placement_vectors.json";
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

// A u64 written as a decimal string (JSON numbers lose precision past 2^53 in many parsers).
uint64_t U64(const nlohmann::json& j) {
  const std::string s = j.get<std::string>();
  uint64_t v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  EXPECT_TRUE(ec == std::errc() && end == s.data() + s.size() && !s.empty()) << "'" << s << "'";
  return v;
}

BlockHash Hash(const nlohmann::json& j) {
  BlockHash h{};
  EXPECT_TRUE(HashFromHex(j.get<std::string>(), &h)) << j;
  return h;
}

TEST(PlacementVectors, FileNamesItsSpecAndEncoding) {
  const nlohmann::json doc = LoadVectors();
  EXPECT_EQ(doc.value("spec", ""), "client/PLACEMENT.md");
  EXPECT_EQ(doc.value("u64", ""), "decimal strings");
}

TEST(PlacementVectors, PlacementKeys) {
  const nlohmann::json doc = LoadVectors();
  ASSERT_TRUE(doc.contains("placement_keys"));
  std::set<std::string> seen;  // what the vectors cover
  for (const auto& v : doc["placement_keys"]) {
    const std::string name = v["name"], algo_name = v["algorithm"];
    SCOPED_TRACE(name + " / " + algo_name);
    HashAlgorithm algo;
    ASSERT_TRUE(ParseHashAlgorithm(algo_name, &algo));
    const BlockHash root = RootHash(algo, {v["fingerprint"], v["tenant"], v["cache_salt"]});
    EXPECT_EQ(HashToHex(root), v["root"].get<std::string>());
    std::vector<ExtraKey> keys;
    for (const auto& k : v["extra_keys"]) keys.push_back({KindOf(k[0]), k[1]});
    const std::vector<uint32_t> prompt = v["prompt"].get<std::vector<uint32_t>>();
    const uint32_t bt = v["block_tokens"];
    const BlockHash want = Hash(v["key"]);
    ASSERT_FALSE(prompt.empty());
    ASSERT_GT(bt, 0u);
    if (prompt.size() >= bt) {
      // A full prompt: the first full block's prefix hash.
      const std::vector<BlockHash> hashes = PrefixHashes(algo, root, prompt, bt, keys);
      ASSERT_EQ(hashes.size(), prompt.size() / bt);
      EXPECT_EQ(HashToHex(hashes[0]), v["key"].get<std::string>());
      EXPECT_EQ(ChainHash(algo, root, prompt.data(), bt, keys), want);
      seen.insert(prompt.size() == bt ? "exactly_one_block" : "longer_than_block");
    } else {
      // Shorter than a block: the same chain hash over the partial block.
      EXPECT_TRUE(PrefixHashes(algo, root, prompt, bt, keys).empty());
      EXPECT_EQ(HashToHex(ChainHash(algo, root, prompt.data(), prompt.size(), keys)),
                v["key"].get<std::string>());
      seen.insert("shorter_than_block");
    }
    if (algo == HashAlgorithm::kXxh3_128) {
      for (size_t b = 16; b < 32; ++b) EXPECT_EQ(want[b], 0) << "byte " << b;
    }
    seen.insert(algo_name);
    if (!keys.empty()) seen.insert("extra_keys");
    if (!v["cache_salt"].get<std::string>().empty()) seen.insert("cache_salt");
  }
  for (const char* s : {"sha256", "xxh3_128", "exactly_one_block", "longer_than_block",
                        "shorter_than_block", "extra_keys", "cache_salt"}) {
    EXPECT_TRUE(seen.count(s)) << "no vector covers " << s;
  }
}

TEST(PlacementVectors, RendezvousScoresAndOrders) {
  const nlohmann::json doc = LoadVectors();
  ASSERT_TRUE(doc.contains("rendezvous"));
  std::set<size_t> sizes;
  for (const auto& v : doc["rendezvous"]) {
    const std::string name = v["name"];
    SCOPED_TRACE(name);
    const BlockHash key = Hash(v["key"]);
    const std::vector<std::string> replicas = v["replicas"].get<std::vector<std::string>>();
    ASSERT_EQ(v["seeds"].size(), replicas.size());
    ASSERT_EQ(v["scores"].size(), replicas.size());
    for (size_t i = 0; i < replicas.size(); ++i) {
      SCOPED_TRACE(replicas[i]);
      // The seed is XXH3-64 of the name's bytes, seed 0.
      EXPECT_EQ(XXH3_64bits(replicas[i].data(), replicas[i].size()), U64(v["seeds"][i]));
      EXPECT_EQ(RendezvousScore(replicas[i], key), U64(v["scores"][i]));
    }
    const std::vector<size_t> want = v["order"].get<std::vector<size_t>>();
    EXPECT_EQ(RendezvousOrder(replicas, key), want);
    // The order follows names, not positions: the reversed list gives the same names.
    const std::vector<std::string> reversed(replicas.rbegin(), replicas.rend());
    std::vector<std::string> by_name, by_name_reversed;
    for (size_t i : want) by_name.push_back(replicas[i]);
    for (size_t i : RendezvousOrder(reversed, key)) by_name_reversed.push_back(reversed[i]);
    EXPECT_EQ(by_name_reversed, by_name);
    sizes.insert(replicas.size());
  }
  EXPECT_TRUE(sizes.count(3));
  EXPECT_TRUE(sizes.count(8));
}

TEST(PlacementVectors, BoundedLoad) {
  const nlohmann::json doc = LoadVectors();
  ASSERT_TRUE(doc.contains("bounded_load"));
  std::set<std::string> names;
  for (const auto& v : doc["bounded_load"]) {
    const std::string name = v["name"];
    SCOPED_TRACE(name);
    const std::vector<size_t> order = v["order"].get<std::vector<size_t>>();
    const std::vector<uint64_t> loads = v["loads"].get<std::vector<uint64_t>>();
    const double epsilon = v["epsilon"];
    ASSERT_EQ(order.size(), loads.size());
    const LoadPick pick = PickBoundedLoad(order, loads, epsilon);
    EXPECT_EQ(pick.cap, v["cap"].get<uint64_t>());
    EXPECT_EQ(pick.chosen, v["chosen"].get<size_t>());
    EXPECT_EQ(pick.home, v["home"].get<bool>());
    names.insert(name);
  }
  EXPECT_GE(names.size(), 10u);
  for (const char* s :
       {"home_under_cap", "home_at_cap_least_loaded", "tie_earlier_in_order", "all_equal_at_cap",
        "empty_fleet", "single_replica", "epsilon_zero_exact", "boundary_below_in_double"}) {
    EXPECT_TRUE(names.count(s)) << "no vector " << s;
  }
}

}  // namespace
}  // namespace kvbank
