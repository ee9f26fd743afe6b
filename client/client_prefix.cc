// The Client's prefix-cache calls: Match / MatchTiers, FetchBlocks by hash, Pin and
// GetPrefixRoot.
#include "absl/strings/str_cat.h"
#include "client/client_internal.h"
#include "client/fetch_decoder.h"
#include "kvbank/client.h"
#include "kvbank/v1/kvbank.grpc.pb.h"

namespace kvbank {

using internal::AddExtraKeys;
using internal::HashBytes;
using internal::HashFromBytes;
using internal::MakeFetchBlocksRequest;
using internal::RawFetch;

absl::StatusOr<Client::FetchResult> Client::FetchBlocks(const std::string& model,
                                                        const std::vector<BlockHash>& hashes,
                                                        uint32_t layer_begin,
                                                        std::optional<uint32_t> layer_end) {
  v1::FetchBlocksRequest req;
  req.set_model(model);
  for (const BlockHash& h : hashes) req.add_block_hashes(HashBytes(h));
  req.set_layer_begin(layer_begin);
  if (layer_end.has_value()) req.set_layer_end(*layer_end);
  grpc::ClientContext ctx;
  impl_->Deadline(&ctx, true);
  return RawFetch(impl_->channel.get(), "/kvbank.v1.KvBank/FetchBlocks", &ctx, req);
}

absl::StatusOr<Client::FetchResult> Client::FetchBlocks(const std::string& model,
                                                        const std::vector<BlockHash>& hashes,
                                                        const FetchArgs& args) {
  const v1::FetchBlocksRequest req = MakeFetchBlocksRequest(model, hashes, args);
  grpc::ClientContext ctx;
  impl_->Deadline(&ctx, true);
  return RawFetch(impl_->channel.get(), "/kvbank.v1.KvBank/FetchBlocks", &ctx, req);
}

absl::StatusOr<std::vector<uint64_t>> Client::Match(const std::string& model,
                                                    const std::vector<MatchQuery>& queries) {
  auto r = MatchTiers(model, queries);
  if (!r.ok()) return r.status();
  std::vector<uint64_t> out;
  for (const MatchTiersResult& m : *r) out.push_back(m.tokens);
  return out;
}

absl::StatusOr<std::vector<Client::MatchTiersResult>> Client::MatchTiers(
    const std::string& model, const std::vector<MatchQuery>& queries, bool prefetch) {
  v1::MatchRequest req;
  req.set_model(model);
  req.set_prefetch(prefetch);
  for (const MatchQuery& q : queries) {
    v1::MatchQuery* p = req.add_queries();
    for (uint32_t t : q.tokens) p->add_token_ids(t);
    for (const BlockHash& h : q.hashes) p->add_block_hashes(HashBytes(h));
    p->set_cache_salt(q.cache_salt);
    AddExtraKeys(q.extra_keys, p->mutable_extra_keys());
  }
  v1::MatchResponse resp;
  if (auto s = impl_->Call(&v1::KvBank::Stub::Match, req, &resp); !s.ok()) return s;
  std::vector<MatchTiersResult> out(resp.cached_tokens_size());
  for (int i = 0; i < resp.cached_tokens_size(); ++i) {
    out[i].tokens = resp.cached_tokens(i);
    // A server without tiers (or an older one) sends cached_tokens only: all in its pool.
    out[i].pool_tokens = i < resp.pool_tokens_size() ? resp.pool_tokens(i) : out[i].tokens;
    out[i].host_tokens = i < resp.host_tokens_size() ? resp.host_tokens(i) : 0;
    out[i].disk_tokens = i < resp.disk_tokens_size() ? resp.disk_tokens(i) : 0;
  }
  return out;
}

absl::StatusOr<uint64_t> Client::Pin(const std::string& model, const MatchQuery& blocks, bool pin) {
  v1::PinRequest req;
  req.set_model(model);
  for (uint32_t t : blocks.tokens) req.add_token_ids(t);
  for (const BlockHash& h : blocks.hashes) req.add_block_hashes(HashBytes(h));
  req.set_cache_salt(blocks.cache_salt);
  AddExtraKeys(blocks.extra_keys, req.mutable_extra_keys());
  req.set_unpin(!pin);
  v1::PinResponse resp;
  if (auto s = impl_->Call(&v1::KvBank::Stub::Pin, req, &resp); !s.ok()) return s;
  return resp.blocks();
}

absl::StatusOr<Client::PrefixRootInfo> Client::GetPrefixRoot(const std::string& model,
                                                             const std::string& cache_salt) {
  v1::GetPrefixRootRequest req;
  req.set_model(model);
  req.set_cache_salt(cache_salt);
  v1::GetPrefixRootResponse resp;
  if (auto s = impl_->Call(&v1::KvBank::Stub::GetPrefixRoot, req, &resp); !s.ok()) return s;
  PrefixRootInfo info;
  info.root = HashFromBytes(resp.root_hash());
  if (!ParseHashAlgorithm(resp.hash_algorithm(), &info.algorithm)) {
    return absl::InternalError(
        absl::StrCat("unknown hash algorithm '", resp.hash_algorithm(), "'"));
  }
  info.block_tokens = resp.block_tokens();
  info.layout_fingerprint = resp.layout_fingerprint();
  info.tenant = resp.tenant();
  return info;
}

}  // namespace kvbank
