// SequenceStore: retention, what a sequence keeps as it grows (RetentionPolicy). A sliding window
// releases the blocks that hold neither sinks nor window tokens (holes in the block table);
// heavy-hitter retention (H2O) compacts the kept tokens into fresh blocks: planned under the
// store's lock, the rows copied outside it (AppendTxn::Commit), applied under it again.
#include <algorithm>
#include <utility>
#include <vector>

#include "server/core/sequence.h"
#include "server/core/sequence_store.h"

namespace kvbank {

std::optional<SequenceStore::Compaction> SequenceStore::Retain(Sequence& s) {
  const RetentionPolicy& p = s.retention;
  const uint64_t bt = layout_.block_tokens;
  const uint64_t n = s.Length();
  if (n != s.MaxLength()) return std::nullopt;  // some layer or head is ahead: later
  if (p.kind == RetentionPolicy::Kind::kSlidingWindow) {
    if (n <= uint64_t{p.window} + p.sinks) return std::nullopt;
    // Blocks wholly past the sinks and before the window hold no kept token.
    const uint64_t first = CeilDiv(p.sinks, bt), end = (n - p.window) / bt;
    for (uint64_t b = first; b < end && b < s.table.size(); ++b) s.table.Release(b);
    return std::nullopt;
  }
  if (p.kind != RetentionPolicy::Kind::kHeavyHitter) return std::nullopt;
  if (s.busy()) return std::nullopt;  // positions move: not under another append in flight
  if (n < uint64_t{p.budget} + bt) return std::nullopt;  // a block of slack: not one per token
  s.scores.resize(n, 0.0);
  // The first token, the heaviest of the middle, the last `window`; ties go to the earlier.
  std::vector<uint64_t> middle;
  for (uint64_t t = 1; t < n - p.window; ++t) middle.push_back(t);
  const size_t heavy = p.budget - 1 - p.window;
  std::stable_sort(middle.begin(), middle.end(),
                   [&](uint64_t a, uint64_t b) { return s.scores[a] > s.scores[b]; });
  middle.resize(std::min(heavy, middle.size()));
  Compaction c;
  c.keep.push_back(0);
  c.keep.insert(c.keep.end(), middle.begin(), middle.end());
  for (uint64_t t = n - p.window; t < n; ++t) c.keep.push_back(t);
  std::sort(c.keep.begin(), c.keep.end());

  const BlockLayout& b = pool_->layout();
  auto fresh = pool_->Allocate(CeilDiv(c.keep.size(), bt), s.tenant_id);
  if (!fresh.ok()) return std::nullopt;  // NOTE: no room to compact now; the next append tries
  c.fresh = *std::move(fresh);
  // Rows only (with their int8 scales): fp8 layers, whose scales are per block, never come here.
  c.rows.reserve(c.keep.size() * b.num_layers());
  for (uint64_t j = 0; j < c.keep.size(); ++j) {
    const uint64_t t = c.keep[j];
    for (uint32_t l = 0; l < b.num_layers(); ++l) {
      c.rows.push_back({s.table.at(t / bt).id(), c.fresh[j / bt].id(),
                        static_cast<uint32_t>(t % bt), static_cast<uint32_t>(j % bt), l});
    }
  }
  for (size_t i = 0; i < s.table.size(); ++i) {
    if (!s.table.hole(i)) c.sources.push_back(pool_->Share(s.table.at(i)));
  }
  return c;
}

void SequenceStore::ApplyCompaction(Sequence& s, Compaction c) {
  std::vector<uint32_t> ids;
  std::vector<double> scores;
  for (uint64_t t : c.keep) {
    if (t < s.token_ids.size()) ids.push_back(s.token_ids[t]);
    scores.push_back(t < s.scores.size() ? s.scores[t] : 0.0);
  }
  s.token_ids = ids.size() == c.keep.size() ? ids : std::vector<uint32_t>();
  s.scores = std::move(scores);
  s.table.Clear();  // tail first; shared blocks stay as they were
  for (BlockRef& b : c.fresh) s.table.Append(std::move(b));
  s.cut_block = Sequence::kNoBlock;
  for (uint64_t& l : s.layer_len) l = c.keep.size();
  s.hashes.clear();
  s.publishable = false;
  s.cached_tokens = 0;
  ++s.generation;
}

}  // namespace kvbank
