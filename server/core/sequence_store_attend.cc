// SequenceStore: attention on the pool (Attend). Retention is sequence_store_retention.cc.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/attention.h"
#include "kernels/quant.h"
#include "server/core/sequence.h"
#include "server/core/sequence_store.h"

namespace kvbank {

absl::Status SequenceStore::Attend(const AttendOptions& o, absl::Span<const AttendItem> items,
                                   absl::Span<float> out, absl::Span<float> lse) {
  const ModelLayout& m = layout_;
  const uint64_t q_elems = uint64_t{m.num_q_heads} * m.head_dim;
  if (items.empty()) return absl::InvalidArgumentError("items is empty");
  if (items.size() > kMaxAttendItems) {
    return absl::InvalidArgumentError(
        absl::StrCat("items: ", items.size(), " in one call; at most ", kMaxAttendItems));
  }
  if (out.size() != items.size() * uint64_t{m.num_q_heads} * m.head_dim_v ||
      lse.size() != items.size() * uint64_t{m.num_q_heads}) {
    return absl::InternalError("Attend output spans do not match the items");
  }
  if (!std::isfinite(o.sm_scale) || o.sm_scale < 0) {
    return absl::InvalidArgumentError(absl::StrCat("softmax_scale ", o.sm_scale, " is not >= 0"));
  }
  if (o.sinks > 0 && o.window == 0) {
    return absl::InvalidArgumentError("sinks given without a window");
  }
  for (size_t i = 0; i < items.size(); ++i) {
    const AttendItem& it = items[i];
    if (it.layer >= m.num_layers) {
      return absl::InvalidArgumentError(
          absl::StrCat("items[", i, "].layer ", it.layer, " is outside [0, ", m.num_layers, ")"));
    }
    if (it.query.size() != q_elems) {
      return absl::InvalidArgumentError(
          absl::StrCat("items[", i, "].query has ", it.query.size(),
                       " values; num_q_heads x head_dim = ", q_elems));
    }
    if (kernels::FindNonFinite(it.query.data(), DType::kFp32, q_elems) >= 0) {
      return absl::InvalidArgumentError(absl::StrCat("items[", i, "].query holds NaN or Inf"));
    }
  }
  // Pin the blocks each item reads (as a fetch does), then compute without the lock.
  struct Item {
    std::vector<int32_t> indices;
    uint32_t length = 0;
    uint32_t window = 0, sinks = 0;  // the call's, narrowed by a sliding-window policy
    bool heavy_hitter = false;       // sums the attention mass per token into the sequence
    uint64_t generation = 0;
  };
  std::vector<BlockRef> refs;
  std::vector<Item> per(items.size());
  {
    CoreLock lock(&mu_);
    for (size_t i = 0; i < items.size(); ++i) {
      auto found = Find(items[i].sequence_id, o.tenant);
      if (!found.ok()) return found.status();
      Sequence& s = **found;
      Item& it = per[i];
      const uint64_t len = s.layer_len[items[i].layer];
      it.length = static_cast<uint32_t>(len);
      for (uint64_t b = 0; b < CeilDiv(len, m.block_tokens); ++b) {
        // A hole (released by a sliding window) holds no attended token: any index will do.
        it.indices.push_back(s.table.hole(b) ? 0 : s.table.at(b).id());
        if (!s.table.hole(b)) refs.push_back(pool_->Share(s.table.at(b)));
      }
      it.window = o.window;
      it.sinks = o.sinks;
      if (s.retention.kind == RetentionPolicy::Kind::kSlidingWindow) {
        it.window = o.window == 0 ? s.retention.window : std::min(o.window, s.retention.window);
        it.sinks = o.window == 0 ? s.retention.sinks : std::min(o.sinks, s.retention.sinks);
      }
      it.heavy_hitter = s.retention.kind == RetentionPolicy::Kind::kHeavyHitter;
      it.generation = s.generation;
      Renew(s);
    }
  }
  // One kernel call per distinct (window, sinks): the kernel takes one window for its batch.
  std::vector<std::vector<float>> probs(items.size());
  std::vector<bool> done(items.size(), false);
  const uint64_t out_per = uint64_t{m.num_q_heads} * m.head_dim_v;
  for (size_t first = 0; first < items.size(); ++first) {
    if (done[first]) continue;
    std::vector<size_t> group;
    for (size_t i = first; i < items.size(); ++i) {
      if (!done[i] && per[i].window == per[first].window && per[i].sinks == per[first].sinks) {
        group.push_back(i);
        done[i] = true;
      }
    }
    std::vector<int32_t> indptr{0}, indices;
    std::vector<uint32_t> lengths;
    std::vector<LayerView> views;
    std::vector<float> q, g_out(group.size() * out_per), g_lse(group.size() * m.num_q_heads);
    std::vector<float*> g_probs;
    for (size_t i : group) {
      indices.insert(indices.end(), per[i].indices.begin(), per[i].indices.end());
      indptr.push_back(static_cast<int32_t>(indices.size()));
      lengths.push_back(per[i].length);
      views.push_back(pool_->layout().layers[items[i].layer]);
      q.insert(q.end(), items[i].query.begin(), items[i].query.end());
      if (per[i].heavy_hitter) probs[i].assign(per[i].length, 0.f);
      g_probs.push_back(per[i].heavy_hitter ? probs[i].data() : nullptr);
    }
    if (indices.empty()) indices.push_back(0);  // every item is empty: no index is read
    kernels::DecodeAttentionParams p;
    p.kv.pool = pool_->base();
    p.kv.block_bytes = pool_->layout().block_bytes;
    p.kv.layers = views.data();
    p.kv.indptr = indptr.data();
    p.kv.indices = indices.data();
    p.kv.lengths = lengths.data();
    p.kv.batch = static_cast<uint32_t>(group.size());
    p.num_q_heads = m.num_q_heads;
    p.num_kv_heads = m.num_kv_heads;
    p.head_dim = m.head_dim;
    p.head_dim_v = m.head_dim_v;
    p.sm_scale = o.sm_scale > 0 ? o.sm_scale : 1.0f / std::sqrt(float(m.head_dim));
    p.window = per[first].window;
    p.sinks = per[first].sinks;
    p.q = q.data();
    p.out = g_out.data();
    p.lse = g_lse.data();
    p.token_probs = g_probs.data();
    if (std::string e = kernels::ValidateDecodeAttention(p); !e.empty()) {
      return absl::InternalError(absl::StrCat("attention batch: ", e));
    }
    const uint32_t max_length = *std::max_element(lengths.begin(), lengths.end());
    if (absl::Status a = pool_->memory().Attend(p, max_length, o.num_threads); !a.ok()) return a;
    for (size_t j = 0; j < group.size(); ++j) {
      std::copy(g_out.begin() + j * out_per, g_out.begin() + (j + 1) * out_per,
                out.begin() + group[j] * out_per);
      std::copy(g_lse.begin() + j * m.num_q_heads, g_lse.begin() + (j + 1) * m.num_q_heads,
                lse.begin() + group[j] * m.num_q_heads);
    }
  }
  // Heavy hitters: the attention mass each token got, summed over heads and layers.
  CoreLock lock(&mu_);
  for (size_t i = 0; i < items.size(); ++i) {
    if (!per[i].heavy_hitter) continue;
    auto it = live_.find(items[i].sequence_id);
    if (it == live_.end() || it->second->generation != per[i].generation) continue;  // moved
    Sequence& s = *it->second;
    if (s.scores.size() < probs[i].size()) s.scores.resize(probs[i].size(), 0.0);
    for (size_t t = 0; t < probs[i].size(); ++t) s.scores[t] += probs[i][t];
  }
  return absl::OkStatus();
}

}  // namespace kvbank
