// Rendezvous hashing of the fleet (kvbank/fleet.h): deterministic, balanced, minimal movement.
#include <algorithm>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kvbank/fleet.h"
#include "kvbank/prefix_hash.h"

namespace kvbank {
namespace {

constexpr int kKeys = 20000;

// Seeded keys shaped like real ones: prefix hashes of distinct one-block prompts.
std::vector<BlockHash> Keys(int n, uint32_t seed) {
  const BlockHash root = RootHash(HashAlgorithm::kSha256, {"fp", "tenant", ""});
  std::vector<BlockHash> out;
  out.reserve(n);
  for (int i = 0; i < n; ++i) {
    const uint32_t tokens[2] = {seed, static_cast<uint32_t>(i)};
    out.push_back(ChainHash(HashAlgorithm::kSha256, root, tokens, 2, {}));
  }
  return out;
}

std::vector<std::string> Names(int n) {
  std::vector<std::string> out;
  for (int i = 0; i < n; ++i) out.push_back("kvbank-" + std::to_string(i));
  return out;
}

std::string Owner(const std::vector<std::string>& names, const BlockHash& key) {
  return names[RendezvousOrder(names, key).front()];
}

TEST(FleetRendezvous, Deterministic) {
  const BlockHash key = Keys(1, 7)[0];
  EXPECT_EQ(RendezvousScore("kvbank-0", key), RendezvousScore("kvbank-0", key));
  EXPECT_NE(RendezvousScore("kvbank-0", key), RendezvousScore("kvbank-1", key));
  BlockHash other = key;
  other[31] ^= 1;
  EXPECT_NE(RendezvousScore("kvbank-0", key), RendezvousScore("kvbank-0", other));
  // The order names replicas, not positions: shuffling the list picks the same replica.
  std::vector<std::string> names = Names(5);
  std::vector<std::string> reversed(names.rbegin(), names.rend());
  for (const BlockHash& k : Keys(500, 1)) {
    ASSERT_EQ(Owner(names, k), Owner(reversed, k));
    const std::vector<size_t> order = RendezvousOrder(names, k);
    ASSERT_EQ(order.size(), names.size());
    for (size_t i = 1; i < order.size(); ++i) {
      ASSERT_GE(RendezvousScore(names[order[i - 1]], k), RendezvousScore(names[order[i]], k));
    }
  }
  EXPECT_TRUE(RendezvousOrder({}, key).empty());
}

TEST(FleetRendezvous, Balanced) {
  for (int n : {2, 3, 5, 8}) {
    const std::vector<std::string> names = Names(n);
    std::map<std::string, int> count;
    for (const BlockHash& k : Keys(kKeys, 2)) ++count[Owner(names, k)];
    const double mean = double(kKeys) / n;
    ASSERT_EQ(count.size(), size_t(n));
    for (const auto& [name, c] : count) {
      // Binomial sd at n = 8 is about 47 keys (2% of the mean): 10% is > 4 sd.
      EXPECT_NEAR(c, mean, 0.1 * mean) << name << " of " << n;
    }
  }
}

TEST(FleetRendezvous, AddingOneMovesOnlyItsShare) {
  for (int n : {1, 3, 4, 7}) {
    const std::vector<std::string> before = Names(n);
    const std::vector<std::string> after = Names(n + 1);
    int moved = 0;
    for (const BlockHash& k : Keys(kKeys, 3)) {
      const std::string a = Owner(before, k), b = Owner(after, k);
      if (a == b) continue;
      ++moved;
      ASSERT_EQ(b, after.back()) << "a key moved between two old replicas";
    }
    const double expected = 1.0 / (n + 1);
    EXPECT_NEAR(double(moved) / kKeys, expected, 0.1 * expected) << n << " -> " << n + 1;
  }
}

TEST(FleetRendezvous, RemovingOneMovesOnlyItsKeys) {
  const std::vector<std::string> before = Names(5);
  std::vector<std::string> after = before;
  after.erase(after.begin() + 2);
  int moved = 0, owned = 0;
  for (const BlockHash& k : Keys(kKeys, 4)) {
    const std::string a = Owner(before, k), b = Owner(after, k);
    if (a == before[2]) {
      ++owned;
      // Its keys go to their second choice.
      EXPECT_EQ(b, before[RendezvousOrder(before, k)[1]]);
    }
    if (a != b) {
      ++moved;
      ASSERT_EQ(a, before[2]) << "a key of a remaining replica moved";
    }
  }
  EXPECT_EQ(moved, owned);
  EXPECT_NEAR(double(moved) / kKeys, 0.2, 0.02);
}

}  // namespace
}  // namespace kvbank
