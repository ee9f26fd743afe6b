// Prefix hashes (base/include/kvbank/prefix_hash.h) of fuzzer-chosen token ids, extra keys,
// root fields and block sizes, with either algorithm. Properties: one hash per full block; the
// hashes of a prefix of the blocks are that prefix of the hashes; each hash is the chain hash of
// its block over its parent (the root for the first); another extra key, salt or tenant, or the
// same bytes split differently between the root's fields, gives other hashes; XXH3-128 leaves
// the last 16 bytes zero; a hash survives its hex form.
#include <string>
#include <vector>

#include "kvbank/prefix_hash.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvbank;
  FuzzedDataProvider in(data, size);
  const HashAlgorithm algo = in.ConsumeBool() ? HashAlgorithm::kXxh3_128 : HashAlgorithm::kSha256;
  const uint32_t block_tokens = in.ConsumeIntegralInRange<uint32_t>(1, 48);
  PrefixRoot pr;
  pr.layout_fingerprint = in.ConsumeRandomLengthString(64);
  pr.tenant = in.ConsumeRandomLengthString(32);
  pr.cache_salt = in.ConsumeRandomLengthString(32);
  std::vector<ExtraKey> keys(in.ConsumeIntegralInRange<int>(0, 3));
  for (ExtraKey& k : keys) {
    k.kind = static_cast<ExtraKeyKind>(in.ConsumeIntegralInRange<int>(1, 4));
    k.value = in.ConsumeRandomLengthString(32);
  }
  const size_t prefix_blocks = in.ConsumeIntegral<uint8_t>();
  std::vector<uint32_t> tokens;
  while (in.remaining_bytes() > 0 && tokens.size() < 256) {
    tokens.push_back(in.ConsumeIntegral<uint32_t>());
  }

  const BlockHash root = RootHash(algo, pr);
  const std::vector<BlockHash> h = PrefixHashes(algo, root, tokens, block_tokens, keys);
  FUZZ_CHECK(h.size() == tokens.size() / block_tokens);
  for (size_t i = 0; i < h.size(); ++i) {
    const BlockHash& parent = i == 0 ? root : h[i - 1];
    FUZZ_CHECK(h[i] ==
               ChainHash(algo, parent, tokens.data() + i * block_tokens, block_tokens, keys));
    FUZZ_CHECK(h[i] != root);
  }
  const size_t k = h.empty() ? 0 : prefix_blocks % (h.size() + 1);
  const std::vector<uint32_t> prefix(tokens.begin(), tokens.begin() + k * block_tokens);
  const std::vector<BlockHash> hp = PrefixHashes(algo, root, prefix, block_tokens, keys);
  FUZZ_CHECK(hp.size() == k && std::equal(hp.begin(), hp.end(), h.begin()));

  if (!h.empty()) {
    std::vector<ExtraKey> more = keys;
    more.push_back(ExtraKey{ExtraKeyKind::kLora, "adapter"});
    FUZZ_CHECK(PrefixHashes(algo, root, tokens, block_tokens, more)[0] != h[0]);
    if (!keys.empty()) {  // the same bytes under another kind
      std::vector<ExtraKey> other = keys;
      other[0].kind = static_cast<ExtraKeyKind>(int(other[0].kind) % 4 + 1);
      FUZZ_CHECK(PrefixHashes(algo, root, tokens, block_tokens, other)[0] != h[0]);
    }
  }
  PrefixRoot salted = pr;
  salted.cache_salt += "x";
  FUZZ_CHECK(RootHash(algo, salted) != root);
  PrefixRoot other_tenant = pr;
  other_tenant.tenant += "x";
  FUZZ_CHECK(RootHash(algo, other_tenant) != root);
  if (!pr.tenant.empty()) {  // the tenant's last byte moved into the salt
    PrefixRoot shifted = pr;
    shifted.cache_salt = pr.tenant.back() + pr.cache_salt;
    shifted.tenant.pop_back();
    FUZZ_CHECK(RootHash(algo, shifted) != root);
  }
  if (algo == HashAlgorithm::kXxh3_128) {
    for (size_t i = 16; i < 32; ++i) FUZZ_CHECK(root[i] == 0);
  }
  BlockHash back{};
  FUZZ_CHECK(HashFromHex(HashToHex(root), &back) && back == root);
  return 0;
}
