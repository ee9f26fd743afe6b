// The synthetic multi-turn chat trace that prefix_bench and tier_bench replay on the core:
// conversations over a few shared system prompts, turns interleaved at random, each turn's
// prompt the whole history so far.
#ifndef KVBANK_BENCH_TRACE_H_
#define KVBANK_BENCH_TRACE_H_

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "kvbank/layout.h"
#include "kvbank/prefix_hash.h"
#include "server/core/block_pool.h"
#include "server/core/sequence_store.h"
#include "server/core/tiers.h"

namespace kvbank {
namespace bench {

// 2 layers, 2 kv heads, head_dim 16, 16 tokens a block, fp16: 4 KiB blocks.
inline ModelLayout TraceLayout() {
  ModelLayout m;
  m.name = "trace";
  m.num_layers = 2;
  m.num_q_heads = 2;
  m.num_kv_heads = 2;
  m.head_dim = 16;
  m.head_dim_v = 16;
  m.block_tokens = 16;
  m.kind = AttentionKind::kMha;
  m.input_dtype = DType::kFp16;
  m.layer_dtypes.assign(2, DType::kFp16);
  return m;
}

struct Turn {
  int conversation;
  std::vector<uint32_t> prompt;    // the whole history: system prompt + previous turns + user
  std::vector<uint32_t> response;  // generated; part of the next turn's history
};

// Conversations over a few shared system prompts, turns interleaved at random.
inline std::vector<Turn> MakeTrace(int conversations, int turns, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int kSystemPrompts = 4;
  std::vector<std::vector<uint32_t>> system(kSystemPrompts);
  for (auto& s : system) {
    s.resize(400 + rng() % 400);
    for (auto& t : s) t = rng() % 100000;
  }
  std::vector<std::vector<uint32_t>> history(conversations);
  std::vector<int> left(conversations, turns);
  for (int c = 0; c < conversations; ++c) history[c] = system[rng() % kSystemPrompts];
  std::vector<Turn> trace;
  int active = conversations;
  while (active > 0) {
    int c = int(rng() % conversations);
    if (left[c] == 0) continue;
    std::vector<uint32_t>& h = history[c];
    const uint32_t user = 20 + rng() % 200;
    for (uint32_t i = 0; i < user; ++i) h.push_back(rng() % 100000);
    Turn t{c, h, {}};
    t.response.resize(50 + rng() % 250);
    for (auto& id : t.response) id = rng() % 100000;
    h.insert(h.end(), t.response.begin(), t.response.end());
    trace.push_back(std::move(t));
    if (--left[c] == 0) --active;
  }
  return trace;
}

// Distinct full blocks of the trace (prompts + responses).
inline uint64_t DistinctBlocks(const std::vector<Turn>& trace) {
  absl::flat_hash_set<BlockHash> all;
  const BlockHash root = RootHash(HashAlgorithm::kSha256, PrefixRoot{"x", "", ""});
  for (const Turn& t : trace) {
    std::vector<uint32_t> tokens = t.prompt;
    tokens.insert(tokens.end(), t.response.begin(), t.response.end());
    for (const BlockHash& h : PrefixHashes(HashAlgorithm::kSha256, root, tokens, 16)) {
      all.insert(h);
    }
  }
  return all.size();
}

// Unbounded cache: every full block ever seen stays.
inline double UnboundedHitRate(const std::vector<Turn>& trace) {
  const BlockHash root = RootHash(HashAlgorithm::kSha256, PrefixRoot{"x", "", ""});
  absl::flat_hash_set<BlockHash> seen;
  uint64_t prompt = 0, hit = 0;
  for (const Turn& t : trace) {
    std::vector<BlockHash> hashes = PrefixHashes(HashAlgorithm::kSha256, root, t.prompt, 16);
    size_t i = 0;
    while (i < hashes.size() && seen.contains(hashes[i])) ++i;
    prompt += t.prompt.size();
    hit += i * 16;
    // What the replay publishes: every full block of prompt + response.
    std::vector<uint32_t> all = t.prompt;
    all.insert(all.end(), t.response.begin(), t.response.end());
    for (const BlockHash& h : PrefixHashes(HashAlgorithm::kSha256, root, all, 16)) seen.insert(h);
  }
  return double(hit) / double(prompt);
}

// A store for `m` with a host pool of `pool_blocks` and, when `tiers` is given, the tiers below
// it (the pool's eviction sink), wired as ModelRegistry::Ensure wires them. Exits on an error.
inline std::unique_ptr<SequenceStore> OpenStore(const ModelLayout& m, uint64_t pool_blocks,
                                                bool sharing, const TierOptions* tiers = nullptr) {
  const BlockLayout b = ComputeBlockLayout(m);
  std::unique_ptr<TierCache> cache;
  if (tiers != nullptr) {
    auto opened = TierCache::Open(b, m.name, LayoutFingerprint(m), *tiers);
    if (!opened.ok()) {
      std::fprintf(stderr, "tiers: %s\n", opened.status().ToString().c_str());
      std::exit(1);
    }
    cache = *std::move(opened);
  }
  PoolOptions po;
  po.enable_prefix_caching = sharing;
  po.eviction_sink = cache.get();
  auto pool = BlockPool::CreateHost(b, pool_blocks * b.block_bytes, po);
  if (!pool.ok()) {
    std::fprintf(stderr, "pool: %s\n", pool.status().ToString().c_str());
    std::exit(1);
  }
  StoreOptions so;
  so.max_tokens_per_sequence = 1 << 20;
  return std::make_unique<SequenceStore>(m, *std::move(pool), so, nullptr, std::move(cache));
}

inline std::unique_ptr<SequenceStore> OpenTraceStore(uint64_t pool_blocks, bool sharing,
                                                     const TierOptions* tiers = nullptr) {
  return OpenStore(TraceLayout(), pool_blocks, sharing, tiers);
}

struct TraceResult {
  uint64_t prompt_tokens = 0, cached_tokens = 0, blocks_written = 0;
  double hit_rate() const { return prompt_tokens == 0 ? 0 : double(cached_tokens) / prompt_tokens; }
};

// Replays turns [begin, end) of the trace: create with the prompt (attaching what is cached,
// promoting what a tier holds), append the rest of the prompt and the response, free. Blocks
// written = blocks allocated for new KV.
inline TraceResult ReplayOn(SequenceStore& store, const std::vector<Turn>& trace, size_t begin,
                            size_t end) {
  const ModelLayout& m = store.layout();
  const BlockLayout& b = store.pool().layout();
  TraceResult r;
  std::vector<uint8_t> payload;
  for (size_t i = begin; i < end && i < trace.size(); ++i) {
    const Turn& t = trace[i];
    CreateOptions co;
    co.lease = absl::ZeroDuration();
    co.prompt = t.prompt;  // the response's ids come with its append, as decode makes them
    auto info = store.Create(co);
    if (!info.ok()) {
      std::fprintf(stderr, "create: %s\n", info.status().ToString().c_str());
      std::exit(1);
    }
    r.prompt_tokens += t.prompt.size();
    r.cached_tokens += info->cached_tokens;
    const uint64_t before = store.pool().Stats().used;
    const uint64_t rest = t.prompt.size() - info->cached_tokens + t.response.size();
    AppendSpec a;
    a.sequence_id = info->id;
    a.num_tokens = rest;
    payload.assign(b.PayloadBytes(0, m.num_layers, rest), 0x5a);
    a.token_ids.assign(t.prompt.begin() + info->cached_tokens, t.prompt.end());
    a.token_ids.insert(a.token_ids.end(), t.response.begin(), t.response.end());
    auto ap = store.Append(a, payload);
    if (!ap.ok()) {
      std::fprintf(stderr, "append: %s\n", ap.status().ToString().c_str());
      std::exit(1);
    }
    r.blocks_written += store.pool().Stats().used - before;
    (void)store.Free(info->id);
  }
  return r;
}

}  // namespace bench
}  // namespace kvbank

#endif  // KVBANK_BENCH_TRACE_H_
