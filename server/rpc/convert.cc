#include "server/rpc/convert.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "proto/convert.h"
#include "server/core/quote.h"

namespace kvbank::rpc {

grpc::Status ToGrpcStatus(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  // The message travels in trailing metadata, which clients cap (grpcio: 8 KiB in all): messages
  // quote client strings cut short (Quote), and this bounds whatever else a message grew into.
  constexpr size_t kMaxMessage = 1024;
  std::string message(s.message().substr(0, kMaxMessage));
  if (s.message().size() > kMaxMessage) message += "...";
  // absl::StatusCode and grpc::StatusCode share their numbering (both follow google.rpc.Code).
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::move(message));
}

absl::StatusOr<std::optional<DType>> FromProto(v1::DType d, const char* field) {
  std::optional<DType> out;
  if (!proto::DTypeFromProto(d, &out)) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": unknown dtype value ", int(d)));
  }
  return out;
}

v1::DType ToProto(DType d) { return proto::DTypeToProto(d); }

absl::StatusOr<ModelConfig> ToModelConfig(const v1::ModelSpec& spec,
                                          const ModelDefaults& defaults) {
  ModelConfig c;
  ModelLayout& m = c.layout;
  auto storage = FromProto(spec.storage_dtype(), "spec.storage_dtype");
  if (!storage.ok()) return storage.status();
  auto input = FromProto(spec.input_dtype(), "spec.input_dtype");
  if (!input.ok()) return input.status();
  std::optional<AttentionKind> kind;
  if (!proto::KindFromProto(spec.kind(), &kind)) {
    return absl::InvalidArgumentError(absl::StrCat("spec.kind: unknown value ", int(spec.kind())));
  }
  std::vector<DType> layer_dtypes;
  for (int i = 0; i < spec.layer_dtypes_size(); ++i) {
    auto d = FromProto(spec.layer_dtypes(i), "spec.layer_dtypes");
    if (!d.ok()) return d.status();
    if (!d->has_value()) {
      return absl::InvalidArgumentError(absl::StrCat("spec.layer_dtypes[", i, "] is unspecified"));
    }
    layer_dtypes.push_back(**d);
  }

  if (!spec.preset().empty()) {
    const bool shape_given = spec.num_layers() || spec.num_q_heads() || spec.num_kv_heads() ||
                             spec.head_dim() || spec.head_dim_v() || kind.has_value() ||
                             spec.kv_lora_rank() || spec.rope_dim();
    if (shape_given) {
      return absl::InvalidArgumentError(absl::StrCat(
          "spec: give either preset (", Quote(spec.preset()), ") or the shape fields, not both"));
    }
    if (!PresetLayout(spec.preset(), &m, storage->value_or(DType::kBf16))) {
      return absl::InvalidArgumentError(
          absl::StrCat("spec.preset: unknown preset ", Quote(spec.preset()),
                       " (known presets: ", absl::StrJoin(PresetNames(), ", "), ")"));
    }
  } else {
    m.kind = kind.value_or(AttentionKind::kGqa);
    m.num_layers = spec.num_layers();
    // Refused before layer_dtypes is sized by it: a remote spec must not size an allocation.
    if (m.num_layers == 0 || m.num_layers > kMaxLayers) {
      return absl::InvalidArgumentError(
          absl::StrCat("spec: num_layers must be in [1, ", kMaxLayers, "], got ", m.num_layers));
    }
    m.num_kv_heads = spec.num_kv_heads();
    m.kv_lora_rank = spec.kv_lora_rank();
    m.rope_dim = spec.rope_dim();
    if (m.kind == AttentionKind::kMla) {
      if (m.num_kv_heads == 0) m.num_kv_heads = 1;
      m.head_dim = spec.head_dim() ? spec.head_dim() : m.kv_lora_rank + m.rope_dim;
      m.head_dim_v = spec.head_dim_v() ? spec.head_dim_v() : m.kv_lora_rank;
    } else {
      m.head_dim = spec.head_dim();
      m.head_dim_v = spec.head_dim_v() ? spec.head_dim_v() : spec.head_dim();
    }
    m.num_q_heads = spec.num_q_heads() ? spec.num_q_heads() : m.num_kv_heads;
    if (!kind.has_value() && m.num_kv_heads != 0) {
      m.kind = m.num_q_heads == m.num_kv_heads ? AttentionKind::kMha
               : m.num_kv_heads == 1           ? AttentionKind::kMqa
                                               : AttentionKind::kGqa;
    }
    const DType s = storage->value_or(input->value_or(DType::kFp16));
    m.layer_dtypes.assign(m.num_layers, s);
  }
  m.name = spec.name();
  if (spec.block_tokens()) m.block_tokens = spec.block_tokens();
  if (!layer_dtypes.empty()) {
    if (layer_dtypes.size() != m.num_layers) {
      return absl::InvalidArgumentError(absl::StrCat("spec.layer_dtypes has ", layer_dtypes.size(),
                                                     " entries for ", m.num_layers, " layers"));
    }
    m.layer_dtypes = layer_dtypes;
  }
  if (input->has_value()) {
    m.input_dtype = **input;
  } else if (!m.layer_dtypes.empty() && !IsQuantized(m.layer_dtypes[0])) {
    m.input_dtype = m.layer_dtypes[0];
  }
  if (const uint32_t hp = spec.high_precision_layers(); hp > 0) {
    if (!layer_dtypes.empty()) {
      return absl::InvalidArgumentError(
          "spec: give either layer_dtypes or high_precision_layers, not both");
    }
    if (uint64_t{hp} * 2 > m.num_layers) {
      return absl::InvalidArgumentError(absl::StrCat("spec.high_precision_layers ", hp,
                                                     " covers more than all ", m.num_layers,
                                                     " layers twice over"));
    }
    for (uint32_t l = 0; l < hp; ++l) {
      m.layer_dtypes[l] = m.input_dtype;
      m.layer_dtypes[m.num_layers - 1 - l] = m.input_dtype;
    }
  }
  if (std::string e = ValidateLayout(m); !e.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("spec: ", e));
  }
  c.pool_bytes = spec.pool_bytes() ? spec.pool_bytes() : defaults.pool_bytes;
  c.device = defaults.device;
  c.staging_bytes = defaults.staging_bytes;
  c.enable_prefix_caching = spec.has_enable_prefix_caching() ? spec.enable_prefix_caching()
                                                             : defaults.enable_prefix_caching;
  c.store = defaults.store;
  c.tiers = defaults.tiers;
  if (spec.max_sequences()) c.store.max_sequences = spec.max_sequences();
  if (spec.max_tokens_per_sequence()) {
    if (spec.max_tokens_per_sequence() > (uint64_t{1} << 32)) {
      return absl::InvalidArgumentError("spec.max_tokens_per_sequence is above 2^32");
    }
    c.store.max_tokens_per_sequence = spec.max_tokens_per_sequence();
  }
  return c;
}

void ToProto(const SequenceStore& model, v1::ModelInfo* out) {
  const ModelLayout& m = model.layout();
  v1::ModelSpec* s = out->mutable_spec();
  proto::LayoutToSpec(m, s);
  s->set_pool_bytes(model.pool().pool_bytes());
  s->set_max_sequences(model.options().max_sequences);
  s->set_max_tokens_per_sequence(model.options().max_tokens_per_sequence);
  s->set_enable_prefix_caching(model.pool().prefix_caching());
  out->set_fingerprint(LayoutFingerprint(m));
  out->set_block_bytes(model.pool().layout().block_bytes);
  out->set_num_blocks(model.pool().num_blocks());
  out->set_device(model.pool().memory().name());
  // What one token of an append in the default dtype takes: the input dtype for quantized or
  // mixed layers (DefaultWireDType), not the storage width.
  const BlockLayout& b = model.pool().layout();
  out->set_payload_bytes_per_token(
      PayloadLayout::Make(b, 0, b.num_layers(), 1, DefaultWireDType(m, 0, m.num_layers))
          .total_bytes);
}

void ToProto(const SequenceInfo& info, const std::string& model, v1::SequenceInfo* out) {
  out->set_model(model);
  out->set_sequence_id(info.id);
  out->set_length(info.length);
  for (uint64_t l : info.layer_lengths) out->add_layer_lengths(l);
  out->set_num_blocks(info.num_blocks);
  out->set_cached_tokens(info.cached_tokens);
  out->set_lease_ttl_ms(absl::ToInt64Milliseconds(info.lease_ttl));
  out->set_compactions(info.compactions);
}

void ToProto(const SequenceStore& model, const StoreStats& st, v1::ModelStats* out) {
  const uint64_t block_bytes = model.pool().layout().block_bytes;
  out->set_model(model.layout().name);
  out->set_blocks_total(st.pool.total);
  out->set_blocks_free(st.pool.free);
  out->set_blocks_used(st.pool.used);
  out->set_block_bytes(block_bytes);
  out->set_pool_bytes(st.pool.total * block_bytes);
  out->set_sequences(st.sequences);
  out->set_tokens_stored(st.tokens_stored);
  out->set_bytes_used(st.pool.used * block_bytes);
  out->set_capacity_tokens(st.pool.total * model.layout().block_tokens);
  out->set_appends(st.appends);
  out->set_fetches(st.fetches);
  out->set_bytes_appended(st.bytes_appended);
  out->set_bytes_fetched(st.bytes_fetched);
  out->set_leases_expired(st.leases_expired);
  out->set_blocks_cached(st.pool.cached);
  out->set_blocks_pinned(st.pool.pinned);
  out->set_evictions(st.pool.evictions);
  out->set_prefix_query_tokens(st.prefix_query_tokens);
  out->set_prefix_hit_tokens(st.prefix_hit_tokens);
  out->set_tenant_view(st.tenant_view);
  out->set_fetches_waiting(st.fetches_waiting);
  out->set_prefix_copies_in(st.prefix_copies_in);
  out->set_prefix_copy_bytes_in(st.prefix_copy_bytes_in);
  if (st.tiers.has_value()) {
    const TierStats& t = *st.tiers;
    v1::TierStats* p = out->mutable_tiers();
    p->set_host_blocks(t.host_blocks);
    p->set_host_capacity(t.host_capacity);
    p->set_disk_blocks(t.disk_blocks);
    p->set_disk_capacity(t.disk_capacity);
    p->set_spilled_to_host(t.spilled_to_host);
    p->set_spilled_to_disk(t.spilled_to_disk);
    p->set_promoted_from_host(t.promoted_from_host);
    p->set_promoted_from_disk(t.promoted_from_disk);
    p->set_corrupt(t.corrupt);
    p->set_spill_dropped(t.spill_dropped);
    p->set_disk_bytes_written(t.disk_bytes_written);
    p->set_disk_bytes_read(t.disk_bytes_read);
    p->set_loaded(t.loaded);
    p->set_load_invalid(t.load_invalid);
    p->set_direct_io(t.direct_io);
    p->set_unverified(t.unverified);
    p->set_spilled_at_eviction(t.spilled_at_eviction);
  }
  for (const TenantStats& t : st.tenants) {
    v1::TenantStats* p = out->add_tenants();
    p->set_tenant(t.tenant);
    p->set_prefix_query_tokens(t.prefix_query_tokens);
    p->set_prefix_hit_tokens(t.prefix_hit_tokens);
    p->set_blocks_referenced(t.blocks_referenced);
    p->set_sequences(t.sequences);
    p->set_tokens_stored(t.tokens_stored);
    p->set_appends(t.appends);
    p->set_fetches(t.fetches);
    p->set_bytes_appended(t.bytes_appended);
    p->set_bytes_fetched(t.bytes_fetched);
    p->set_leases_expired(t.leases_expired);
    p->set_max_blocks(t.max_blocks);
    p->set_max_sequences(t.max_sequences);
  }
}

absl::StatusOr<std::vector<ExtraKey>> ExtraKeysFromProto(
    const google::protobuf::RepeatedPtrField<v1::ExtraKey>& keys) {
  std::vector<ExtraKey> out;
  for (int i = 0; i < keys.size(); ++i) {
    const v1::ExtraKey& k = keys[i];
    if (k.kind() < v1::EXTRA_KEY_KIND_LORA || k.kind() > v1::EXTRA_KEY_KIND_CUSTOM) {
      return absl::InvalidArgumentError(
          absl::StrCat("extra_keys[", i, "].kind is unspecified or unknown (", int(k.kind()), ")"));
    }
    if (k.value().size() > 4096) {
      return absl::InvalidArgumentError(
          absl::StrCat("extra_keys[", i, "].value exceeds 4096 bytes"));
    }
    out.push_back(ExtraKey{static_cast<ExtraKeyKind>(k.kind()), k.value()});
  }
  return out;
}

absl::StatusOr<std::vector<BlockHash>> HashesFromProto(
    const google::protobuf::RepeatedPtrField<std::string>& hashes, const char* field) {
  std::vector<BlockHash> out;
  out.reserve(hashes.size());
  for (int i = 0; i < hashes.size(); ++i) {
    if (hashes[i].size() != sizeof(BlockHash)) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, "[", i, "] has ", hashes[i].size(), " bytes; a block hash has 32"));
    }
    BlockHash h;
    std::memcpy(h.data(), hashes[i].data(), h.size());
    out.push_back(h);
  }
  return out;
}

void ToProto(const KvEvent& e, bool show_tenant, v1::KvEvent* out) {
  out->set_sequence(e.sequence);
  out->set_time_unix_micros(absl::ToUnixMicros(e.time));
  if (show_tenant) out->set_tenant(e.tenant);
  auto bytes = [](const BlockHash& h) { return std::string(h.begin(), h.end()); };
  switch (e.type) {
    case KvEvent::Type::kBlockStored: {
      v1::BlockStored* s = out->mutable_stored();
      for (const BlockHash& h : e.hashes) s->add_block_hashes(bytes(h));
      if (e.has_parent) s->set_parent_block_hash(bytes(e.parent));
      for (uint32_t t : e.token_ids) s->add_token_ids(t);
      s->set_block_size(e.block_tokens);
      s->set_lora_name(e.lora);
      s->set_medium(e.medium);
      break;
    }
    case KvEvent::Type::kBlockRemoved: {
      v1::BlockRemoved* r = out->mutable_removed();
      for (const BlockHash& h : e.hashes) r->add_block_hashes(bytes(h));
      r->set_medium(e.medium);
      break;
    }
    case KvEvent::Type::kAllCleared:
      out->mutable_cleared();
      break;
  }
}

absl::StatusOr<std::optional<absl::Duration>> LeaseFromProto(uint64_t ms, bool none) {
  if (none) {
    if (ms != 0) return absl::InvalidArgumentError("lease_ttl_ms given together with no_lease");
    return std::optional<absl::Duration>(absl::ZeroDuration());
  }
  if (ms == 0) return std::optional<absl::Duration>();
  if (ms > uint64_t{1} << 40) {
    return absl::InvalidArgumentError(absl::StrCat("lease_ttl_ms ", ms, " is out of range"));
  }
  return std::optional<absl::Duration>(absl::Milliseconds(static_cast<int64_t>(ms)));
}

}  // namespace kvbank::rpc
