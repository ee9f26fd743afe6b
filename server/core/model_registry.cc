#include "server/core/model_registry.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "server/core/quote.h"

namespace kvbank {

std::string FirstLayoutDifference(const ModelLayout& a, const ModelLayout& b) {
#define KVBANK_DIFF(field)                                                  \
  if (a.field != b.field) {                                                 \
    return absl::StrCat(#field " ", static_cast<uint64_t>(a.field), " vs ", \
                        static_cast<uint64_t>(b.field));                    \
  }
  KVBANK_DIFF(num_layers)
  KVBANK_DIFF(num_q_heads)
  KVBANK_DIFF(num_kv_heads)
  KVBANK_DIFF(head_dim)
  KVBANK_DIFF(head_dim_v)
  KVBANK_DIFF(block_tokens)
  KVBANK_DIFF(kind)
  KVBANK_DIFF(kv_lora_rank)
  KVBANK_DIFF(rope_dim)
  KVBANK_DIFF(input_dtype)
#undef KVBANK_DIFF
  for (size_t l = 0; l < std::min(a.layer_dtypes.size(), b.layer_dtypes.size()); ++l) {
    if (a.layer_dtypes[l] != b.layer_dtypes[l]) {
      return absl::StrCat("storage dtype of layer ", l, " ", DTypeName(a.layer_dtypes[l]), " vs ",
                          DTypeName(b.layer_dtypes[l]));
    }
  }
  return "";
}

absl::StatusOr<EnsureResult> ModelRegistry::Ensure(ModelConfig config) {
  const std::string& name = config.layout.name;
  if (name.empty() || name.size() > 128) {
    return absl::InvalidArgumentError("model name must be 1 to 128 characters");
  }
  if (std::string e = ValidateLayout(config.layout); !e.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("model '", name, "': ", e));
  }
  absl::MutexLock lock(&mu_);
  if (auto it = models_.find(name); it != models_.end()) {
    const ModelLayout& have = it->second->layout();
    if (have != config.layout) {
      return absl::AlreadyExistsError(absl::StrCat(
          "model '", name,
          "' exists with a different layout: ", FirstLayoutDifference(config.layout, have)));
    }
    return EnsureResult{it->second, false};
  }
  // Releases only lower the figure, so a check that reads it once is never too generous.
  const uint64_t used = pool_bytes_used_->load();
  const uint64_t left = used >= total_pool_bytes_ ? 0 : total_pool_bytes_ - used;
  if (config.pool_bytes > left) {
    return absl::ResourceExhaustedError(absl::StrCat("model '", name, "': pool_bytes ",
                                                     config.pool_bytes, " exceeds the ", left,
                                                     " bytes left of the server's pool budget"));
  }
  auto events = std::make_unique<KvEventLog>(config.event_capacity);
  const BlockLayout block_layout = ComputeBlockLayout(config.layout);
  std::unique_ptr<TierCache> tiers;
  if (config.tiers.host_bytes > 0 || !config.tiers.disk_path.empty()) {
    if (!config.enable_prefix_caching) {
      return absl::InvalidArgumentError(absl::StrCat(
          "model '", name, "': tiers keep cached prefix blocks; prefix caching is off"));
    }
    auto opened = TierCache::Open(block_layout, name, LayoutFingerprint(config.layout),
                                  config.tiers, events.get());
    if (!opened.ok()) {
      return absl::Status(opened.status().code(),
                          absl::StrCat("model '", name, "': ", opened.status().message()));
    }
    tiers = *std::move(opened);
  }
  PoolOptions pool_options;
  pool_options.eviction_sink = tiers.get();
  pool_options.enable_prefix_caching = config.enable_prefix_caching;
  pool_options.events = events.get();
  pool_options.clock = config.store.clock;
  pool_options.staging_bytes = config.staging_bytes;
  auto pool = BlockPool::Create(block_layout, config.pool_bytes, config.device, pool_options);
  if (!pool.ok()) {
    return absl::Status(pool.status().code(),
                        absl::StrCat("model '", name, "': ", pool.status().message()));
  }
  const uint64_t bytes = (*pool)->pool_bytes();
  pool_bytes_used_->fetch_add(bytes);
  // The bytes return to the budget once the store (and with it the pool) is destroyed.
  std::shared_ptr<SequenceStore> store(
      new SequenceStore(config.layout, *std::move(pool), std::move(config.store), std::move(events),
                        std::move(tiers)),
      [used = pool_bytes_used_, bytes](SequenceStore* s) {
        delete s;
        used->fetch_sub(bytes);
      });
  models_[name] = store;
  return EnsureResult{store, true};
}

absl::StatusOr<std::shared_ptr<SequenceStore>> ModelRegistry::Get(const std::string& name) const {
  absl::MutexLock lock(&mu_);
  auto it = models_.find(name);
  if (it == models_.end())
    return absl::NotFoundError(absl::StrCat("model ", Quote(name), " not found"));
  return it->second;
}

std::vector<std::shared_ptr<SequenceStore>> ModelRegistry::List() const {
  std::vector<std::shared_ptr<SequenceStore>> out;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [name, m] : models_) out.push_back(m);
  }
  std::sort(out.begin(), out.end(),
            [](const auto& a, const auto& b) { return a->layout().name < b->layout().name; });
  return out;
}

size_t ModelRegistry::ExpireLeases(absl::Time now) const {
  size_t n = 0;
  for (const auto& m : List()) n += m->ExpireLeases(now);
  return n;
}

size_t ModelRegistry::ExpireCache(absl::Time now) const {
  size_t n = 0;
  for (const auto& m : List()) n += m->prefix().ExpireCache(now);
  return n;
}

absl::Status ModelRegistry::Drop(const std::string& name) {
  std::shared_ptr<SequenceStore> dropped;  // released after mu_: freeing a pool takes a while
  {
    absl::MutexLock lock(&mu_);
    auto it = models_.find(name);
    if (it == models_.end()) {
      return absl::NotFoundError(absl::StrCat("model ", Quote(name), " not found"));
    }
    dropped = std::move(it->second);
    models_.erase(it);
  }
  // Its sequences go now, and every fetch waiting on one of them ends (outside mu_: the waiters'
  // callbacks run here), so that nothing in flight waits out its deadline on a model that is gone
  // or keeps its pool out of the budget meanwhile.
  dropped->Close(absl::StrCat("model ", Quote(name), " was dropped"));
  return absl::OkStatus();
}

uint64_t ModelRegistry::pool_bytes_used() const { return pool_bytes_used_->load(); }

}  // namespace kvbank
