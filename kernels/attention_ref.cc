// The decode-attention reference: plain loops in fp64 over the same paged view and element decode
// as the kernels. Slow on purpose; it is what the CPU and CUDA kernels are tested against.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "kernels/attention.h"

namespace kvbank::kernels {

std::string ValidateDecodeAttention(const DecodeAttentionParams& p) {
  const PagedKv& kv = p.kv;
  if (kv.batch == 0) return "";
  if (kv.pool == nullptr) return "kv.pool is null";
  if (kv.layers == nullptr || kv.indptr == nullptr || kv.indices == nullptr ||
      kv.lengths == nullptr) {
    return "kv.layers, kv.indptr, kv.indices and kv.lengths must be set";
  }
  if (p.num_kv_heads == 0 || p.num_q_heads == 0 || p.num_q_heads % p.num_kv_heads != 0) {
    return "num_q_heads must be a positive multiple of num_kv_heads";
  }
  if (p.head_dim == 0 || p.head_dim_v == 0 || p.head_dim_v > p.head_dim) {
    return "head_dim and head_dim_v must be positive (head_dim_v <= head_dim)";
  }
  if (!(p.sm_scale > 0.0f) || !std::isfinite(p.sm_scale)) return "sm_scale must be finite, > 0";
  if (p.q == nullptr || p.out == nullptr || p.lse == nullptr) return "q, out and lse must be set";
  for (uint32_t i = 0; i < kv.batch; ++i) {
    const LayerView& v = kv.layers[i];
    const std::string at = " (item " + std::to_string(i) + ")";
    if (v.num_kv_heads != p.num_kv_heads || v.head_dim != p.head_dim ||
        v.head_dim_v != p.head_dim_v || v.block_tokens == 0) {
      return "layers: shape differs from num_kv_heads / head_dim / head_dim_v" + at;
    }
    if (!v.has_v && v.num_kv_heads != 1) return "layers: MLA has one kv head" + at;
    if (v.elem_bytes != DTypeBytes(v.dtype)) return "layers: elem_bytes != dtype width" + at;
    const int64_t blocks = int64_t{kv.indptr[i + 1]} - kv.indptr[i];
    if (blocks < 0) return "indptr: not ascending" + at;
    if (uint64_t{kv.lengths[i]} > uint64_t(blocks) * v.block_tokens) {
      return "lengths: more tokens than blocks hold" + at;
    }
    for (int64_t b = kv.indptr[i]; b < kv.indptr[i + 1]; ++b) {
      if (kv.indices[b] < 0) return "indices: negative block id" + at;
    }
  }
  return "";
}

void DecodeAttentionReference(const DecodeAttentionParams& p) {
  const PagedKv& kv = p.kv;
  const uint32_t group = p.Group();
  for (uint32_t i = 0; i < kv.batch; ++i) {
    const DType d = kv.layers[i].dtype;
    const AttendSpan span = MakeAttendSpan(kv.lengths[i], p.window, p.sinks);
    const uint32_t n = span.Count();
    float* probs = p.token_probs != nullptr ? p.token_probs[i] : nullptr;
    std::vector<double> prob_sum(kv.lengths[i], 0.0);
    for (uint32_t h = 0; h < p.num_q_heads; ++h) {
      const uint32_t g = h / group;
      const float* q = p.q + (uint64_t{i} * p.num_q_heads + h) * p.head_dim;
      float* out = p.out + (uint64_t{i} * p.num_q_heads + h) * p.head_dim_v;
      std::vector<double> s(n);
      double m = -std::numeric_limits<double>::infinity();
      for (uint32_t j = 0; j < n; ++j) {
        const KvRow k = kv.Row(i, 0, g, span.Position(j));
        double dot = 0;
        for (uint32_t c = 0; c < p.head_dim; ++c) dot += double(q[c]) * DecodeKv(d, k, c);
        s[j] = double(p.sm_scale) * dot;
        m = std::max(m, s[j]);
      }
      double sum = 0;
      for (uint32_t j = 0; j < n; ++j) sum += std::exp(s[j] - m);
      std::vector<double> acc(p.head_dim_v, 0.0);
      for (uint32_t j = 0; j < n; ++j) {
        const double w = std::exp(s[j] - m) / sum;
        const KvRow v = kv.Row(i, 1, g, span.Position(j));
        for (uint32_t c = 0; c < p.head_dim_v; ++c) acc[c] += w * DecodeKv(d, v, c);
        prob_sum[span.Position(j)] += w;
      }
      for (uint32_t c = 0; c < p.head_dim_v; ++c) out[c] = float(acc[c]);
      p.lse[uint64_t{i} * p.num_q_heads + h] =
          n == 0 ? -std::numeric_limits<float>::infinity() : float(m + std::log(sum));
    }
    if (probs != nullptr) {
      for (uint32_t t = 0; t < kv.lengths[i]; ++t) probs[t] = float(prob_sum[t]);
    }
  }
}

}  // namespace kvbank::kernels
