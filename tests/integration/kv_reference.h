// The expected KV of one sequence, kept by the test beside the server's copy, and seeded random
// bytes to fill it with.
#ifndef KVBANK_TESTS_INTEGRATION_KV_REFERENCE_H_
#define KVBANK_TESTS_INTEGRATION_KV_REFERENCE_H_

#include <cstdint>
#include <vector>

#include "kvbank/layout.h"

namespace kvbank::integ {

// splitmix64: fast, seedable, good enough to make every byte of a payload distinct-looking.
class Random {
 public:
  explicit Random(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  void Fill(uint8_t* out, size_t n);
  std::vector<uint8_t> Bytes(size_t n) {
    std::vector<uint8_t> v(n);
    Fill(v.data(), n);
    return v;
  }

 private:
  uint64_t state_;
};

// Token rows per (layer, head) for K and V (V absent for MLA), in the layout's storage dtypes.
// Copyable: a fork starts as a copy of its parent.
class KvReference {
 public:
  explicit KvReference(const ModelLayout& layout);

  // Adds `n` random tokens to layers [l0, l1) and returns their payload (kvbank/layout.h order).
  std::vector<uint8_t> Append(uint32_t l0, uint32_t l1, uint64_t n, Random& rng);
  // The payload a fetch of tokens [t0, t1) x layers [l0, l1) must return.
  std::vector<uint8_t> Payload(uint32_t l0, uint32_t l1, uint64_t t0, uint64_t t1) const;
  // The same range as tensors: k [layers][heads][tokens][head_dim], v likewise (empty for MLA).
  void Tensors(uint32_t l0, uint32_t l1, uint64_t t0, uint64_t t1, std::vector<uint8_t>* k,
               std::vector<uint8_t>* v) const;
  void Truncate(uint64_t n);

  uint32_t num_layers() const { return block_.num_layers(); }
  uint64_t layer_length(uint32_t l) const { return lengths_[l]; }
  uint64_t length() const;  // tokens every layer holds
  const BlockLayout& block_layout() const { return block_; }

 private:
  std::vector<uint8_t>& KRows(uint32_t l, uint32_t h) { return k_[l * heads_ + h]; }
  std::vector<uint8_t>& VRows(uint32_t l, uint32_t h) { return v_[l * heads_ + h]; }

  BlockLayout block_;
  uint32_t heads_ = 0;
  std::vector<std::vector<uint8_t>> k_, v_;  // [layer * heads + head]: rows of every token
  std::vector<uint64_t> lengths_;
};

}  // namespace kvbank::integ

#endif  // KVBANK_TESTS_INTEGRATION_KV_REFERENCE_H_
