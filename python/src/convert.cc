// kvbank._kvbank's converters (convert.h).
#include "src/convert.h"

#include <pybind11/stl.h>

#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace kvbank::python {
namespace {

// A failed call: the gRPC code and the server's (or the SDK's) message. A C++ exception rather
// than a Python error set on the spot, so that raising needs no GIL.
struct StatusError {
  int code;
  std::string message;
};

}  // namespace

void RegisterStatusTranslator() {
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusError& e) {
      // kvbank._errors builds the typed exception; should that fail, its own error is raised.
      try {
        py::object exc =
            py::module_::import("kvbank._errors").attr("from_status")(e.code, e.message);
        PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
      } catch (py::error_already_set& inner) {
        inner.restore();
      }
    }
  });
}

[[noreturn]] void RaiseStatus(const absl::Status& s) {
  throw StatusError{static_cast<int>(s.code()), std::string(s.message())};
}
[[noreturn]] void RaiseInvalid(std::string message) {
  throw StatusError{static_cast<int>(absl::StatusCode::kInvalidArgument), std::move(message)};
}

// ---- names and scalars ----------------------------------------------------------------------

DType ToDType(const std::string& s) {
  DType d;
  if (!ParseDType(s, &d)) {
    RaiseInvalid("unknown dtype '" + s + "' (fp32, fp16, bf16, int8, fp8_e4m3, fp8_e5m2)");
  }
  return d;
}
std::optional<DType> ToDType(const std::optional<std::string>& s) {
  if (!s.has_value()) return std::nullopt;
  return ToDType(*s);
}
AttentionKind ToKind(const std::string& s) {
  for (AttentionKind k :
       {AttentionKind::kMha, AttentionKind::kGqa, AttentionKind::kMqa, AttentionKind::kMla}) {
    if (s == AttentionKindName(k)) return k;
  }
  RaiseInvalid("unknown attention kind '" + s + "' (mha, gqa, mqa, mla)");
}
HashAlgorithm ToAlgorithm(const std::string& s) {
  HashAlgorithm a;
  if (!ParseHashAlgorithm(s, &a))
    RaiseInvalid("unknown hash algorithm '" + s + "' (sha256, xxh3_128)");
  return a;
}

namespace {
ExtraKeyKind ToExtraKind(const std::string& s) {
  if (s == "lora") return ExtraKeyKind::kLora;
  if (s == "multimodal") return ExtraKeyKind::kMultimodal;
  if (s == "prompt_embeds") return ExtraKeyKind::kPromptEmbeds;
  if (s == "custom") return ExtraKeyKind::kCustom;
  RaiseInvalid("unknown extra key kind '" + s + "' (lora, multimodal, prompt_embeds, custom)");
}
}  // namespace

std::vector<ExtraKey> ToExtraKeys(const std::vector<std::pair<std::string, py::bytes>>& keys) {
  std::vector<ExtraKey> out;
  out.reserve(keys.size());
  for (const auto& [kind, value] : keys) out.push_back({ToExtraKind(kind), std::string(value)});
  return out;
}
BlockHash ToHash(const py::bytes& b) {
  const std::string s(b);
  if (s.size() != 32) RaiseInvalid("a block hash is 32 bytes, not " + std::to_string(s.size()));
  BlockHash h;
  std::memcpy(h.data(), s.data(), 32);
  return h;
}
std::vector<BlockHash> ToHashes(const std::vector<py::bytes>& v) {
  std::vector<BlockHash> out;
  out.reserve(v.size());
  for (const py::bytes& b : v) out.push_back(ToHash(b));
  return out;
}
py::bytes FromHash(const BlockHash& h) {
  return py::bytes(reinterpret_cast<const char*>(h.data()), h.size());
}
py::list FromHashes(const std::vector<BlockHash>& v) {
  py::list out;
  for (const BlockHash& h : v) out.append(FromHash(h));
  return out;
}
std::optional<absl::Duration> ToDuration(std::optional<double> seconds) {
  if (!seconds.has_value()) return std::nullopt;
  if (!(*seconds >= 0)) RaiseInvalid("a duration must be >= 0 seconds");
  return absl::Seconds(*seconds);
}

// ---- buffers --------------------------------------------------------------------------------

BufferView::BufferView(const py::handle& obj, bool writable) {
  const int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
  if (PyObject_GetBuffer(obj.ptr(), &view_, flags) != 0) throw py::error_already_set();
}
BufferView::~BufferView() { PyBuffer_Release(&view_); }

py::array_t<uint8_t> ToArray(std::vector<uint8_t> bytes) {
  auto* owned = new std::vector<uint8_t>(std::move(bytes));
  py::capsule base(owned, [](void* p) { delete static_cast<std::vector<uint8_t>*>(p); });
  return py::array_t<uint8_t>({static_cast<py::ssize_t>(owned->size())}, {py::ssize_t{1}},
                              owned->data(), base);
}
py::array_t<float> ToFloatArray(const std::vector<float>& v) {
  py::array_t<float> out(static_cast<py::ssize_t>(v.size()));
  if (!v.empty()) std::memcpy(out.mutable_data(), v.data(), v.size() * sizeof(float));
  return out;
}

// ---- layouts --------------------------------------------------------------------------------

py::dict LayoutToDict(const ModelLayout& m) {
  py::dict d;
  d["name"] = m.name;
  d["num_layers"] = m.num_layers;
  d["num_q_heads"] = m.num_q_heads;
  d["num_kv_heads"] = m.num_kv_heads;
  d["head_dim"] = m.head_dim;
  d["head_dim_v"] = m.head_dim_v;
  d["block_tokens"] = m.block_tokens;
  d["kind"] = AttentionKindName(m.kind);
  d["kv_lora_rank"] = m.kv_lora_rank;
  d["rope_dim"] = m.rope_dim;
  d["input_dtype"] = DTypeName(m.input_dtype);
  py::list dtypes;
  for (DType t : m.layer_dtypes) dtypes.append(DTypeName(t));
  d["layer_dtypes"] = dtypes;
  return d;
}

ModelLayout LayoutFromDict(const py::dict& d) {
  static const char* const kKeys[] = {"name",         "num_layers", "num_q_heads",  "num_kv_heads",
                                      "head_dim",     "head_dim_v", "block_tokens", "kind",
                                      "kv_lora_rank", "rope_dim",   "input_dtype",  "layer_dtypes",
                                      "dtype"};
  for (const auto& item : d) {
    const std::string key = py::str(item.first);
    bool known = false;
    for (const char* k : kKeys) known = known || key == k;
    if (!known) RaiseInvalid("unknown layout field '" + key + "'");
  }
  ModelLayout m;
  auto u32 = [&](const char* key, uint32_t* out) {
    if (d.contains(key)) *out = d[key].cast<uint32_t>();
  };
  if (d.contains("name")) m.name = d["name"].cast<std::string>();
  u32("num_layers", &m.num_layers);
  u32("num_q_heads", &m.num_q_heads);
  u32("num_kv_heads", &m.num_kv_heads);
  u32("head_dim", &m.head_dim);
  u32("head_dim_v", &m.head_dim_v);
  u32("block_tokens", &m.block_tokens);
  u32("kv_lora_rank", &m.kv_lora_rank);
  u32("rope_dim", &m.rope_dim);
  if (d.contains("kind")) m.kind = ToKind(d["kind"].cast<std::string>());
  std::optional<DType> dtype;
  if (d.contains("dtype")) dtype = ToDType(d["dtype"].cast<std::string>());
  if (d.contains("input_dtype")) {
    m.input_dtype = ToDType(d["input_dtype"].cast<std::string>());
  } else if (dtype.has_value() && !IsQuantized(*dtype)) {
    m.input_dtype = *dtype;
  }
  if (d.contains("layer_dtypes")) {
    for (const auto& t : d["layer_dtypes"])
      m.layer_dtypes.push_back(ToDType(t.cast<std::string>()));
  } else {
    m.layer_dtypes.assign(m.num_layers, dtype.value_or(m.input_dtype));
  }
  if (m.head_dim_v == 0 && m.kind != AttentionKind::kMla) m.head_dim_v = m.head_dim;
  return m;
}

// ---- results --------------------------------------------------------------------------------

namespace {

// The result classes of kvbank/_types.py.
struct ResultTypes {
  py::object model_info, sequence_info, fetch_info, event, prefix_root, device_region, replica,
      fleet_sequence, route;
};

// Written once, under the GIL; never freed: a py::object released by a static destructor would
// outlive the interpreter.
const ResultTypes* result_types = nullptr;

// REQUIRES: the GIL held.
const ResultTypes& Types() {
  if (result_types == nullptr) {
    // NOTE: the import may let other threads take the GIL (they may look the classes up too),
    // which is why no once-flag or static local guards this: a thread waiting on one while
    // holding the GIL would deadlock the importer. The loser's lookup is dropped.
    const py::module_ m = py::module_::import("kvbank._types");
    auto* t = new ResultTypes{m.attr("ModelInfo"), m.attr("SequenceInfo"),  m.attr("FetchInfo"),
                              m.attr("Event"),     m.attr("PrefixRoot"),    m.attr("DeviceRegion"),
                              m.attr("Replica"),   m.attr("FleetSequence"), m.attr("Route")};
    if (result_types == nullptr) {
      result_types = t;
    } else {
      delete t;
    }
  }
  return *result_types;
}

const char* EventTypeName(Client::Event::Type t) {
  switch (t) {
    case Client::Event::Type::kStored:
      return "stored";
    case Client::Event::Type::kRemoved:
      return "removed";
    case Client::Event::Type::kAllCleared:
      return "all_cleared";
  }
  return "unknown";
}

}  // namespace

py::object FromModelInfo(const Client::ModelInfo& i) {
  return Types().model_info(
      py::arg("name") = i.layout.name, py::arg("layout") = LayoutToDict(i.layout),
      py::arg("fingerprint") = i.fingerprint, py::arg("block_bytes") = i.block_bytes,
      py::arg("num_blocks") = i.num_blocks, py::arg("pool_bytes") = i.pool_bytes,
      py::arg("payload_bytes_per_token") = i.payload_bytes_per_token, py::arg("device") = i.device,
      py::arg("max_sequences") = i.max_sequences,
      py::arg("max_tokens_per_sequence") = i.max_tokens_per_sequence,
      py::arg("created") = i.created);
}

py::object FromSequenceInfo(const Client::SequenceInfo& s) {
  return Types().sequence_info(
      py::arg("model") = s.model, py::arg("id") = s.id, py::arg("length") = s.length,
      py::arg("layer_lengths") = s.layer_lengths, py::arg("num_blocks") = s.num_blocks,
      py::arg("cached_tokens") = s.cached_tokens,
      py::arg("lease_ttl_s") = absl::ToDoubleSeconds(s.lease_ttl),
      py::arg("compactions") = s.compactions);
}

py::object FromFetchResult(const Client::FetchResult& r) {
  return Types().fetch_info(
      py::arg("token_begin") = r.token_begin, py::arg("num_tokens") = r.num_tokens,
      py::arg("layer_begin") = r.layer_begin, py::arg("layer_end") = r.layer_end,
      py::arg("kv_head_begin") = r.kv_head_begin, py::arg("kv_head_end") = r.kv_head_end,
      py::arg("dtype") = DTypeName(r.dtype), py::arg("payload_bytes") = r.payload_bytes);
}

py::object FromEvent(const Client::Event& e) {
  return Types().event(py::arg("type") = EventTypeName(e.type), py::arg("sequence") = e.sequence,
                       py::arg("tenant") = e.tenant, py::arg("hashes") = FromHashes(e.hashes),
                       py::arg("parent") = e.parent.has_value() ? py::object(FromHash(*e.parent))
                                                                : py::object(py::none()),
                       py::arg("token_ids") = e.token_ids, py::arg("block_size") = e.block_size,
                       py::arg("lora") = e.lora);
}

py::object FromPrefixRoot(const Client::PrefixRootInfo& r) {
  return Types().prefix_root(
      py::arg("root") = FromHash(r.root), py::arg("algorithm") = HashAlgorithmName(r.algorithm),
      py::arg("block_tokens") = r.block_tokens,
      py::arg("layout_fingerprint") = r.layout_fingerprint, py::arg("tenant") = r.tenant);
}

py::object FromDeviceRegion(const Client::DeviceRegion& r) {
  return Types().device_region(py::arg("region_id") = r.region_id, py::arg("size") = r.size,
                               py::arg("device") = r.device);
}

py::object FromReplica(const Fleet::Replica& r) {
  return Types().replica(py::arg("name") = r.name, py::arg("address") = r.address,
                         py::arg("healthy") = r.healthy, py::arg("reason") = r.reason,
                         py::arg("load") = r.load);
}

py::object FromRoute(const Fleet::RouteDecision& r) {
  return Types().route(
      py::arg("replica") = r.replica, py::arg("home") = r.home, py::arg("reason") = r.reason,
      py::arg("key") = FromHash(r.key), py::arg("load") = r.load,
      py::arg("home_load") = r.home_load, py::arg("load_bound") = r.load_bound,
      py::arg("mean_load") = r.mean_load, py::arg("prompt_tokens") = r.prompt_tokens,
      py::arg("cached_tokens") = r.cached_tokens, py::arg("copy_from") = r.copy_from,
      py::arg("copy_from_cached_tokens") = r.copy_from_cached_tokens,
      py::arg("copy_tokens") = r.copy_tokens, py::arg("cost") = r.cost);
}

py::dict FromFleetStats(const Fleet::Stats& s) {
  py::dict d;
  d["placements"] = s.placements;
  d["home_placements"] = s.home_placements;
  d["bounded_placements"] = s.bounded_placements;
  d["prefix_copies"] = s.prefix_copies;
  d["copied_blocks"] = s.copied_blocks;
  d["copied_bytes"] = s.copied_bytes;
  d["copies_joined"] = s.copies_joined;
  d["copies_skipped"] = s.copies_skipped;
  d["copy_failures"] = s.copy_failures;
  return d;
}

py::object FromFleetSequence(const Fleet::Sequence& s) {
  return Types().fleet_sequence(py::arg("replica") = s.replica, py::arg("model") = s.info.model,
                                py::arg("id") = s.info.id,
                                py::arg("info") = FromSequenceInfo(s.info));
}

py::dict StatsToDict(const Client::ModelStats& s) {
  py::dict d;
  d["model"] = s.model;
#define KVBANK_STAT(f) d[#f] = s.f
  KVBANK_STAT(blocks_total);
  KVBANK_STAT(blocks_free);
  KVBANK_STAT(blocks_used);
  KVBANK_STAT(block_bytes);
  KVBANK_STAT(pool_bytes);
  KVBANK_STAT(sequences);
  KVBANK_STAT(tokens_stored);
  KVBANK_STAT(bytes_used);
  KVBANK_STAT(capacity_tokens);
  KVBANK_STAT(appends);
  KVBANK_STAT(fetches);
  KVBANK_STAT(bytes_appended);
  KVBANK_STAT(bytes_fetched);
  KVBANK_STAT(leases_expired);
  KVBANK_STAT(blocks_cached);
  KVBANK_STAT(blocks_pinned);
  KVBANK_STAT(evictions);
  KVBANK_STAT(prefix_query_tokens);
  KVBANK_STAT(prefix_hit_tokens);
  KVBANK_STAT(fetches_waiting);
  KVBANK_STAT(prefix_copies_in);
  KVBANK_STAT(prefix_copy_bytes_in);
#undef KVBANK_STAT
  py::list tenants;
  for (const auto& t : s.tenants) {
    py::dict td;
    td["tenant"] = t.tenant;
    td["prefix_query_tokens"] = t.prefix_query_tokens;
    td["prefix_hit_tokens"] = t.prefix_hit_tokens;
    td["blocks_referenced"] = t.blocks_referenced;
    td["sequences"] = t.sequences;
    td["tokens_stored"] = t.tokens_stored;
    td["appends"] = t.appends;
    td["fetches"] = t.fetches;
    td["bytes_appended"] = t.bytes_appended;
    td["bytes_fetched"] = t.bytes_fetched;
    td["leases_expired"] = t.leases_expired;
    td["max_blocks"] = t.max_blocks;
    td["max_sequences"] = t.max_sequences;
    tenants.append(td);
  }
  d["tenants"] = tenants;
  d["tenant_view"] = s.tenant_view;
  return d;
}

// ---- arguments ------------------------------------------------------------------------------

Client::CreateArgs MakeCreateArgs(std::optional<double> lease_s, std::vector<uint32_t> prompt,
                                  std::string cache_salt,
                                  const std::vector<std::pair<std::string, py::bytes>>& extra_keys,
                                  std::optional<uint32_t> priority, uint32_t retention_kind,
                                  uint32_t window, uint32_t sinks, uint32_t budget) {
  Client::CreateArgs a;
  a.lease = ToDuration(lease_s);
  a.prompt = std::move(prompt);
  a.cache_salt = std::move(cache_salt);
  a.extra_keys = ToExtraKeys(extra_keys);
  a.priority = priority;
  a.retention_kind = retention_kind;
  a.window = window;
  a.sinks = sinks;
  a.budget = budget;
  return a;
}

Client::AppendArgs MakeAppendArgs(uint64_t num_tokens, uint32_t layer_begin,
                                  std::optional<uint32_t> layer_end,
                                  const std::optional<std::string>& dtype,
                                  std::vector<uint32_t> token_ids, uint32_t kv_head_begin,
                                  std::optional<uint32_t> kv_head_end) {
  Client::AppendArgs a;
  a.num_tokens = num_tokens;
  a.layer_begin = layer_begin;
  a.layer_end = layer_end;
  a.dtype = ToDType(dtype);
  a.token_ids = std::move(token_ids);
  a.kv_head_begin = kv_head_begin;
  a.kv_head_end = kv_head_end;
  return a;
}

Client::FetchArgs MakeFetchArgs(uint64_t token_begin, std::optional<uint64_t> token_end,
                                uint32_t layer_begin, std::optional<uint32_t> layer_end,
                                const std::optional<std::string>& dtype, uint32_t kv_head_begin,
                                std::optional<uint32_t> kv_head_end, double wait_s) {
  Client::FetchArgs a;
  a.token_begin = token_begin;
  a.token_end = token_end;
  a.layer_begin = layer_begin;
  a.layer_end = layer_end;
  a.dtype = ToDType(dtype);
  a.kv_head_begin = kv_head_begin;
  a.kv_head_end = kv_head_end;
  if (!(wait_s >= 0 && wait_s <= 600)) RaiseInvalid("wait_s must be within [0, 600] seconds");
  a.wait = absl::Seconds(wait_s);
  return a;
}

Client::AppendArgs AppendArgsFromDict(const py::dict& a) {
  return MakeAppendArgs(
      a["num_tokens"].cast<uint64_t>(), a["layer_begin"].cast<uint32_t>(),
      a["layer_end"].cast<std::optional<uint32_t>>(), a["dtype"].cast<std::optional<std::string>>(),
      a["token_ids"].cast<std::vector<uint32_t>>(), a["kv_head_begin"].cast<uint32_t>(),
      a["kv_head_end"].cast<std::optional<uint32_t>>());
}

Client::FetchArgs FetchArgsFromDict(const py::dict& a) {
  return MakeFetchArgs(
      a["token_begin"].cast<uint64_t>(), a["token_end"].cast<std::optional<uint64_t>>(),
      a["layer_begin"].cast<uint32_t>(), a["layer_end"].cast<std::optional<uint32_t>>(),
      a["dtype"].cast<std::optional<std::string>>(), a["kv_head_begin"].cast<uint32_t>(),
      a["kv_head_end"].cast<std::optional<uint32_t>>(), a["wait_s"].cast<double>());
}

Client::MatchQuery MakeQuery(std::vector<uint32_t> tokens, const std::vector<py::bytes>& hashes,
                             std::string cache_salt,
                             const std::vector<std::pair<std::string, py::bytes>>& extra_keys) {
  Client::MatchQuery q;
  q.tokens = std::move(tokens);
  q.hashes = ToHashes(hashes);
  q.cache_salt = std::move(cache_salt);
  q.extra_keys = ToExtraKeys(extra_keys);
  return q;
}

Client::MatchQuery QueryFromTuple(const py::handle& q) {
  auto t = q.cast<std::tuple<std::vector<uint32_t>, std::vector<py::bytes>, std::string,
                             std::vector<std::pair<std::string, py::bytes>>>>();
  return MakeQuery(std::move(std::get<0>(t)), std::get<1>(t), std::move(std::get<2>(t)),
                   std::get<3>(t));
}

ClientTlsOptions TlsOptionsFromDict(const py::dict& tls) {
  ClientTlsOptions t;
  for (const auto& item : tls) {
    const std::string key = py::str(item.first);
    const std::string value = py::str(item.second);
    if (key == "root_ca_pem")
      t.root_ca_pem = value;
    else if (key == "root_ca_path")
      t.root_ca_path = value;
    else if (key == "cert_chain_pem")
      t.cert_chain_pem = value;
    else if (key == "cert_chain_path")
      t.cert_chain_path = value;
    else if (key == "private_key_pem")
      t.private_key_pem = value;
    else if (key == "private_key_path")
      t.private_key_path = value;
    else if (key == "server_name_override")
      t.server_name_override = value;
    else
      RaiseInvalid("unknown tls option '" + key + "'");
  }
  return t;
}

}  // namespace kvbank::python
