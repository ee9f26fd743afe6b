#include "tests/integration/kv_reference.h"

#include <algorithm>
#include <cstring>

namespace kvbank::integ {

void Random::Fill(uint8_t* out, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const uint64_t r = Next();
    std::memcpy(out + i, &r, 8);
  }
  if (i < n) {
    const uint64_t r = Next();
    std::memcpy(out + i, &r, n - i);
  }
}

KvReference::KvReference(const ModelLayout& layout)
    : block_(ComputeBlockLayout(layout)),
      heads_(layout.num_kv_heads),
      k_(size_t{layout.num_layers} * layout.num_kv_heads),
      v_(size_t{layout.num_layers} * layout.num_kv_heads),
      lengths_(layout.num_layers, 0) {}

uint64_t KvReference::length() const { return *std::min_element(lengths_.begin(), lengths_.end()); }

std::vector<uint8_t> KvReference::Append(uint32_t l0, uint32_t l1, uint64_t n, Random& rng) {
  std::vector<uint8_t> payload(block_.PayloadBytes(l0, l1, n));
  uint8_t* at = payload.data();
  for (uint32_t l = l0; l < l1; ++l) {
    const LayerView& lv = block_.layers[l];
    for (uint32_t h = 0; h < heads_; ++h) {
      const size_t bytes = n * lv.KRowBytes();
      rng.Fill(at, bytes);
      KRows(l, h).insert(KRows(l, h).end(), at, at + bytes);
      at += bytes;
    }
    if (!lv.has_v) continue;
    for (uint32_t h = 0; h < heads_; ++h) {
      const size_t bytes = n * lv.VRowBytes();
      rng.Fill(at, bytes);
      VRows(l, h).insert(VRows(l, h).end(), at, at + bytes);
      at += bytes;
    }
  }
  for (uint32_t l = l0; l < l1; ++l) lengths_[l] += n;
  return payload;
}

std::vector<uint8_t> KvReference::Payload(uint32_t l0, uint32_t l1, uint64_t t0,
                                          uint64_t t1) const {
  std::vector<uint8_t> k, v, out;
  out.reserve(block_.PayloadBytes(l0, l1, t1 - t0));
  for (uint32_t l = l0; l < l1; ++l) {
    Tensors(l, l + 1, t0, t1, &k, &v);
    out.insert(out.end(), k.begin(), k.end());
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

void KvReference::Tensors(uint32_t l0, uint32_t l1, uint64_t t0, uint64_t t1,
                          std::vector<uint8_t>* k, std::vector<uint8_t>* v) const {
  k->clear();
  v->clear();
  for (uint32_t l = l0; l < l1; ++l) {
    const LayerView& lv = block_.layers[l];
    for (uint32_t h = 0; h < heads_; ++h) {
      const std::vector<uint8_t>& rows = k_[l * heads_ + h];
      k->insert(k->end(), rows.begin() + t0 * lv.KRowBytes(), rows.begin() + t1 * lv.KRowBytes());
    }
    if (!lv.has_v) continue;
    for (uint32_t h = 0; h < heads_; ++h) {
      const std::vector<uint8_t>& rows = v_[l * heads_ + h];
      v->insert(v->end(), rows.begin() + t0 * lv.VRowBytes(), rows.begin() + t1 * lv.VRowBytes());
    }
  }
}

void KvReference::Truncate(uint64_t n) {
  for (uint32_t l = 0; l < num_layers(); ++l) {
    const LayerView& lv = block_.layers[l];
    lengths_[l] = std::min(lengths_[l], n);
    for (uint32_t h = 0; h < heads_; ++h) {
      KRows(l, h).resize(lengths_[l] * lv.KRowBytes());
      if (lv.has_v) VRows(l, h).resize(lengths_[l] * lv.VRowBytes());
    }
  }
}

}  // namespace kvbank::integ
