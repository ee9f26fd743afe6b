// Prefix hashes of KV blocks: the same function the server uses to share cached blocks, for
// routers and schedulers that want to compute them without a server.
//
//   root     = H("kvbank.root.v1" || F(1, layout fingerprint) || F(2, tenant) || F(3, cache salt))
//   block(i) = H("kvbank.block.v1" || block(i-1) (root for i = 0) || u32 n || n token ids as u32
//                || u32 m || m extra keys as [u8 kind][u32 length][bytes])
//   F(tag, bytes) = [u8 tag][u32 length][bytes]; every integer little-endian.
//
// The domain strings keep a block hash from ever equalling a root; the field tags and the extra
// key kinds keep a LoRA name from ever colliding with a salt or a multimodal id. H is SHA-256
// (collision resistant against a hostile tenant: the default) or XXH3-128 (fast, not
// adversarially safe: opt in). A hash is 32 bytes; XXH3-128 fills the first 16, the rest is zero.
// Only full blocks have a hash. Test vectors: tests/data/prefix_hash_vectors.json.
#ifndef KVBANK_PREFIX_HASH_H_
#define KVBANK_PREFIX_HASH_H_

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kvbank {

enum class HashAlgorithm : uint8_t { kSha256 = 0, kXxh3_128 = 1 };

using BlockHash = std::array<uint8_t, 32>;

// What an extra key is; part of the encoding, so values are stable.
enum class ExtraKeyKind : uint8_t {
  kLora = 1,          // LoRA adapter name
  kMultimodal = 2,    // multimodal input id (e.g. an image digest)
  kPromptEmbeds = 3,  // digest of prompt embeddings
  kCustom = 4,
};

struct ExtraKey {
  ExtraKeyKind kind = ExtraKeyKind::kCustom;
  std::string value;
};

struct PrefixRoot {
  std::string layout_fingerprint;  // LayoutFingerprint(model layout): storage dtypes included
  std::string tenant;
  std::string cache_salt;  // optional; different salts never share
};

BlockHash RootHash(HashAlgorithm algo, const PrefixRoot& root);
// Hash of one full block given its parent's hash (or the root). tokens: block_tokens ids.
BlockHash ChainHash(HashAlgorithm algo, const BlockHash& parent, const uint32_t* tokens,
                    size_t num_tokens, const std::vector<ExtraKey>& extra_keys);
// Hashes of every full block of `tokens` (tokens.size() / block_tokens of them); the same extra
// keys go into every block. REQUIRES: block_tokens > 0.
std::vector<BlockHash> PrefixHashes(HashAlgorithm algo, const BlockHash& root,
                                    const std::vector<uint32_t>& tokens, uint32_t block_tokens,
                                    const std::vector<ExtraKey>& extra_keys = {});

std::string HashToHex(const BlockHash& h);
// Returns false (leaving *out unchanged) unless `hex` is 64 hex digits.
bool HashFromHex(std::string_view hex, BlockHash* out);
const char* HashAlgorithmName(HashAlgorithm a);
bool ParseHashAlgorithm(std::string_view s, HashAlgorithm* out);

}  // namespace kvbank

#endif  // KVBANK_PREFIX_HASH_H_
