#include "kvbank/prefix_hash.h"

#include <openssl/evp.h>
#include <xxhash.h>

#include <cstdlib>
#include <cstring>
#include <memory>

namespace kvbank {

namespace {

// SHA-256 through EVP with the algorithm fetched once and one context per thread. OpenSSL 3's
// one-shot SHA256() fetches the algorithm on every call (a look-up under a global lock); a
// 2k-token Match hashes 128 blocks, so that look-up was most of the hashing's cost.
const EVP_MD* Sha256Md() {
  static const EVP_MD* const md = [] {
#if OPENSSL_VERSION_NUMBER >= 0x30000000L
    const EVP_MD* fetched = EVP_MD_fetch(nullptr, "SHA256", nullptr);  // kept for the process
    return fetched != nullptr ? fetched : EVP_sha256();
#else
    return EVP_sha256();
#endif
  }();
  return md;
}

void Sha256(const void* data, size_t n, uint8_t* out) {
  struct CtxFree {
    void operator()(EVP_MD_CTX* c) const { EVP_MD_CTX_free(c); }
  };
  thread_local std::unique_ptr<EVP_MD_CTX, CtxFree> ctx(EVP_MD_CTX_new());
  if (ctx == nullptr || EVP_DigestInit_ex(ctx.get(), Sha256Md(), nullptr) != 1 ||
      EVP_DigestUpdate(ctx.get(), data, n) != 1 ||
      EVP_DigestFinal_ex(ctx.get(), out, nullptr) != 1) {
    std::abort();  // out of memory in OpenSSL: no hash is better than a wrong one
  }
}

// Builds the canonical byte string, then hashes it once.
class Encoder {
 public:
  explicit Encoder(std::string_view domain) {
    bytes_.reserve(128);
    bytes_.append(domain);
  }
  void U8(uint8_t v) { bytes_.push_back(static_cast<char>(v)); }
  void U32(uint32_t v) {
    const char le[4] = {static_cast<char>(v & 0xff), static_cast<char>((v >> 8) & 0xff),
                        static_cast<char>((v >> 16) & 0xff), static_cast<char>((v >> 24) & 0xff)};
    bytes_.append(le, 4);
  }
  void Reserve(size_t more) { bytes_.reserve(bytes_.size() + more); }
  void Raw(const void* p, size_t n) { bytes_.append(static_cast<const char*>(p), n); }
  void Field(uint8_t tag, std::string_view v) {
    U8(tag);
    U32(static_cast<uint32_t>(v.size()));
    bytes_.append(v);
  }
  BlockHash Digest(HashAlgorithm algo) const {
    BlockHash h{};
    if (algo == HashAlgorithm::kSha256) {
      Sha256(bytes_.data(), bytes_.size(), h.data());
    } else {
      const XXH128_hash_t x = XXH3_128bits(bytes_.data(), bytes_.size());
      XXH128_canonical_t c;
      XXH128_canonicalFromHash(&c, x);  // big-endian canonical form: stable across machines
      std::memcpy(h.data(), c.digest, sizeof(c.digest));
    }
    return h;
  }

 private:
  std::string bytes_;
};

}  // namespace

BlockHash RootHash(HashAlgorithm algo, const PrefixRoot& root) {
  Encoder e("kvbank.root.v1");
  e.Field(1, root.layout_fingerprint);
  e.Field(2, root.tenant);
  e.Field(3, root.cache_salt);
  return e.Digest(algo);
}

BlockHash ChainHash(HashAlgorithm algo, const BlockHash& parent, const uint32_t* tokens,
                    size_t num_tokens, const std::vector<ExtraKey>& extra_keys) {
  Encoder e("kvbank.block.v1");
  e.Reserve(32 + 4 * (num_tokens + 2));
  e.Raw(parent.data(), parent.size());
  e.U32(static_cast<uint32_t>(num_tokens));
  for (size_t i = 0; i < num_tokens; ++i) e.U32(tokens[i]);
  e.U32(static_cast<uint32_t>(extra_keys.size()));
  for (const ExtraKey& k : extra_keys) e.Field(static_cast<uint8_t>(k.kind), k.value);
  return e.Digest(algo);
}

std::vector<BlockHash> PrefixHashes(HashAlgorithm algo, const BlockHash& root,
                                    const std::vector<uint32_t>& tokens, uint32_t block_tokens,
                                    const std::vector<ExtraKey>& extra_keys) {
  std::vector<BlockHash> out;
  const size_t n = tokens.size() / block_tokens;
  out.reserve(n);
  BlockHash parent = root;
  for (size_t i = 0; i < n; ++i) {
    parent = ChainHash(algo, parent, tokens.data() + i * block_tokens, block_tokens, extra_keys);
    out.push_back(parent);
  }
  return out;
}

std::string HashToHex(const BlockHash& h) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s(64, '0');
  for (size_t i = 0; i < h.size(); ++i) {
    s[2 * i] = kDigits[h[i] >> 4];
    s[2 * i + 1] = kDigits[h[i] & 15];
  }
  return s;
}

bool HashFromHex(std::string_view hex, BlockHash* out) {
  if (hex.size() != 64) return false;
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  // Decoded aside first: a rejected string leaves *out as it was.
  BlockHash h;
  for (size_t i = 0; i < 32; ++i) {
    const int hi = nibble(hex[2 * i]), lo = nibble(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    h[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  *out = h;
  return true;
}

const char* HashAlgorithmName(HashAlgorithm a) {
  return a == HashAlgorithm::kSha256 ? "sha256" : "xxh3_128";
}

bool ParseHashAlgorithm(std::string_view s, HashAlgorithm* out) {
  if (s == "sha256") {
    *out = HashAlgorithm::kSha256;
  } else if (s == "xxh3_128") {
    *out = HashAlgorithm::kXxh3_128;
  } else {
    return false;
  }
  return true;
}

}  // namespace kvbank
