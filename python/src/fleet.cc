// kvbank._kvbank.Fleet: kvbank::Fleet (kvbank/fleet.h) for Python; kvbank/_fleet.py is its
// Pythonic face. Registered from module.cc with BindFleet(m).
//
// Every RPC runs with the GIL released. A sequence crosses as (replica, model, id). Errors raise
// kvbank.Error's subclass for the gRPC code through kvbank._errors.from_status, as module.cc's
// translator does. module.cc's converters are private to that file; the few the fleet needs are
// here, reading layouts only in the complete form kvbank.normalize_layout writes (its defaults
// stay in one place).
#include "kvbank/fleet.h"

#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kvbank/client.h"
#include "kvbank/layout.h"
#include "kvbank/prefix_hash.h"

namespace py = pybind11;

namespace kvbank::python {
namespace {

// REQUIRES: the GIL is held.
[[noreturn]] void RaiseStatus(const absl::Status& s) {
  py::object exc = py::module_::import("kvbank._errors")
                       .attr("from_status")(static_cast<int>(s.code()), std::string(s.message()));
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
  throw py::error_already_set();
}
[[noreturn]] void RaiseInvalidArgument(const std::string& message) {
  RaiseStatus(absl::InvalidArgumentError(message));
}

// Runs f() with the GIL released; raises on a non-OK status, else returns the value.
template <typename F>
auto WithoutGil(F&& f) {
  decltype(f()) r;
  {
    py::gil_scoped_release release;
    r = f();
  }
  if constexpr (std::is_same_v<decltype(r), absl::Status>) {
    if (!r.ok()) RaiseStatus(r);
  } else {
    if (!r.ok()) RaiseStatus(r.status());
    return *std::move(r);
  }
}

DType DTypeOf(const std::string& s) {
  DType d;
  if (!ParseDType(s, &d)) RaiseInvalidArgument("unknown dtype '" + s + "'");
  return d;
}
std::optional<DType> DTypeOf(const std::optional<std::string>& s) {
  if (!s.has_value()) return std::nullopt;
  return DTypeOf(*s);
}
std::optional<absl::Duration> DurationOf(std::optional<double> seconds) {
  if (!seconds.has_value()) return std::nullopt;
  if (!(*seconds >= 0)) RaiseInvalidArgument("a duration must be >= 0 seconds");
  return absl::Seconds(*seconds);
}
BlockHash HashOf(const py::bytes& b) {
  const std::string s(b);
  if (s.size() != 32)
    RaiseInvalidArgument("a block hash is 32 bytes, not " + std::to_string(s.size()));
  BlockHash h;
  std::memcpy(h.data(), s.data(), 32);
  return h;
}
py::bytes BytesOf(const BlockHash& h) {
  return py::bytes(reinterpret_cast<const char*>(h.data()), h.size());
}
std::vector<ExtraKey> ExtraKeysOf(const std::vector<std::pair<std::string, py::bytes>>& keys) {
  std::vector<ExtraKey> out;
  for (const auto& [kind, value] : keys) {
    ExtraKey k;
    if (kind == "lora") {
      k.kind = ExtraKeyKind::kLora;
    } else if (kind == "multimodal") {
      k.kind = ExtraKeyKind::kMultimodal;
    } else if (kind == "prompt_embeds") {
      k.kind = ExtraKeyKind::kPromptEmbeds;
    } else if (kind == "custom") {
      k.kind = ExtraKeyKind::kCustom;
    } else {
      RaiseInvalidArgument("unknown extra key kind '" + kind +
                           "' (lora, multimodal, prompt_embeds, custom)");
    }
    k.value = std::string(value);
    out.push_back(std::move(k));
  }
  return out;
}

// A layout from kvbank.normalize_layout's complete dict.
ModelLayout LayoutOf(const py::dict& d) {
  ModelLayout m;
  m.name = d["name"].cast<std::string>();
  m.num_layers = d["num_layers"].cast<uint32_t>();
  m.num_q_heads = d["num_q_heads"].cast<uint32_t>();
  m.num_kv_heads = d["num_kv_heads"].cast<uint32_t>();
  m.head_dim = d["head_dim"].cast<uint32_t>();
  m.head_dim_v = d["head_dim_v"].cast<uint32_t>();
  m.block_tokens = d["block_tokens"].cast<uint32_t>();
  m.kv_lora_rank = d["kv_lora_rank"].cast<uint32_t>();
  m.rope_dim = d["rope_dim"].cast<uint32_t>();
  const std::string kind = d["kind"].cast<std::string>();
  bool known = false;
  for (AttentionKind k :
       {AttentionKind::kMha, AttentionKind::kGqa, AttentionKind::kMqa, AttentionKind::kMla}) {
    if (kind == AttentionKindName(k)) m.kind = k, known = true;
  }
  if (!known) RaiseInvalidArgument("unknown attention kind '" + kind + "'");
  m.input_dtype = DTypeOf(d["input_dtype"].cast<std::string>());
  for (const auto& t : d["layer_dtypes"]) m.layer_dtypes.push_back(DTypeOf(t.cast<std::string>()));
  return m;
}

py::dict ModelInfoDict(const Client::ModelInfo& i) {
  py::dict layout;
  const ModelLayout& m = i.layout;
  layout["name"] = m.name;
  layout["num_layers"] = m.num_layers;
  layout["num_q_heads"] = m.num_q_heads;
  layout["num_kv_heads"] = m.num_kv_heads;
  layout["head_dim"] = m.head_dim;
  layout["head_dim_v"] = m.head_dim_v;
  layout["block_tokens"] = m.block_tokens;
  layout["kind"] = AttentionKindName(m.kind);
  layout["kv_lora_rank"] = m.kv_lora_rank;
  layout["rope_dim"] = m.rope_dim;
  layout["input_dtype"] = DTypeName(m.input_dtype);
  py::list dtypes;
  for (DType t : m.layer_dtypes) dtypes.append(DTypeName(t));
  layout["layer_dtypes"] = dtypes;
  py::dict d;
  d["name"] = m.name;
  d["layout"] = layout;
  d["fingerprint"] = i.fingerprint;
  d["block_bytes"] = i.block_bytes;
  d["num_blocks"] = i.num_blocks;
  d["pool_bytes"] = i.pool_bytes;
  d["payload_bytes_per_token"] = i.payload_bytes_per_token;
  d["device"] = i.device;
  d["max_sequences"] = i.max_sequences;
  d["max_tokens_per_sequence"] = i.max_tokens_per_sequence;
  d["created"] = i.created;
  return d;
}

py::dict SequenceDict(const Client::SequenceInfo& s) {
  py::dict d;
  d["model"] = s.model;
  d["id"] = s.id;
  d["length"] = s.length;
  d["layer_lengths"] = s.layer_lengths;
  d["num_blocks"] = s.num_blocks;
  d["cached_tokens"] = s.cached_tokens;
  d["lease_ttl_s"] = absl::ToDoubleSeconds(s.lease_ttl);
  d["compactions"] = s.compactions;
  return d;
}

// (replica, info dict): what _fleet.py makes a FleetSequence of.
py::tuple HandleTuple(const Fleet::Sequence& s) {
  return py::make_tuple(s.replica, SequenceDict(s.info));
}

py::dict FetchDict(const Client::FetchResult& r) {
  py::dict d;
  d["token_begin"] = r.token_begin;
  d["num_tokens"] = r.num_tokens;
  d["layer_begin"] = r.layer_begin;
  d["layer_end"] = r.layer_end;
  d["kv_head_begin"] = r.kv_head_begin;
  d["kv_head_end"] = r.kv_head_end;
  d["dtype"] = DTypeName(r.dtype);
  d["payload_bytes"] = r.payload_bytes;
  return d;
}

py::array_t<uint8_t> OwnedArray(std::vector<uint8_t> bytes) {
  auto* owned = new std::vector<uint8_t>(std::move(bytes));
  py::capsule base(owned, [](void* p) { delete static_cast<std::vector<uint8_t>*>(p); });
  return py::array_t<uint8_t>({static_cast<py::ssize_t>(owned->size())}, {py::ssize_t{1}},
                              owned->data(), base);
}

py::dict EventDict(const Client::Event& e) {
  py::dict d;
  d["type"] = e.type == Client::Event::Type::kStored    ? "stored"
              : e.type == Client::Event::Type::kRemoved ? "removed"
                                                        : "all_cleared";
  d["sequence"] = e.sequence;
  d["tenant"] = e.tenant;
  py::list hashes;
  for (const BlockHash& h : e.hashes) hashes.append(BytesOf(h));
  d["hashes"] = hashes;
  d["parent"] = e.parent.has_value() ? py::object(BytesOf(*e.parent)) : py::object(py::none());
  d["token_ids"] = e.token_ids;
  d["block_size"] = e.block_size;
  d["lora"] = e.lora;
  return d;
}

// A C-contiguous view of a Python buffer for one call. REQUIRES: the GIL is held at
// construction and destruction.
class View {
 public:
  View(const py::handle& obj, bool writable) {
    const int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj.ptr(), &view_, flags) != 0) throw py::error_already_set();
  }
  ~View() { PyBuffer_Release(&view_); }
  View(const View&) = delete;
  View& operator=(const View&) = delete;
  absl::Span<uint8_t> span() const {
    return {static_cast<uint8_t*>(view_.buf), static_cast<size_t>(view_.len)};
  }

 private:
  Py_buffer view_{};
};

Client::AppendArgs AppendArgsOf(const py::dict& a) {
  Client::AppendArgs out;
  out.num_tokens = a["num_tokens"].cast<uint64_t>();
  out.layer_begin = a["layer_begin"].cast<uint32_t>();
  out.layer_end = a["layer_end"].cast<std::optional<uint32_t>>();
  out.dtype = DTypeOf(a["dtype"].cast<std::optional<std::string>>());
  out.token_ids = a["token_ids"].cast<std::vector<uint32_t>>();
  out.kv_head_begin = a["kv_head_begin"].cast<uint32_t>();
  out.kv_head_end = a["kv_head_end"].cast<std::optional<uint32_t>>();
  return out;
}
Client::FetchArgs FetchArgsOf(const py::dict& a) {
  Client::FetchArgs out;
  out.token_begin = a["token_begin"].cast<uint64_t>();
  out.token_end = a["token_end"].cast<std::optional<uint64_t>>();
  out.layer_begin = a["layer_begin"].cast<uint32_t>();
  out.layer_end = a["layer_end"].cast<std::optional<uint32_t>>();
  out.dtype = DTypeOf(a["dtype"].cast<std::optional<std::string>>());
  out.kv_head_begin = a["kv_head_begin"].cast<uint32_t>();
  out.kv_head_end = a["kv_head_end"].cast<std::optional<uint32_t>>();
  const double wait_s = a["wait_s"].cast<double>();
  if (!(wait_s >= 0 && wait_s <= 600)) RaiseInvalidArgument("wait_s must be within [0, 600]");
  out.wait = absl::Seconds(wait_s);
  return out;
}
Client::MatchQuery QueryOf(const py::tuple& q) {
  Client::MatchQuery out;
  out.tokens = q[0].cast<std::vector<uint32_t>>();
  for (const auto& h : q[1]) out.hashes.push_back(HashOf(h.cast<py::bytes>()));
  out.cache_salt = q[2].cast<std::string>();
  out.extra_keys = ExtraKeysOf(q[3].cast<std::vector<std::pair<std::string, py::bytes>>>());
  return out;
}

// The fleet and its sequence handles. Thread-safe like kvbank::Fleet.
class PyFleet {
 public:
  PyFleet(const std::string& target, const std::string& token, double deadline_s,
          double stream_deadline_s, double probe_interval_s, double resolve_interval_s,
          double probe_deadline_s) {
    if (!(deadline_s > 0) || !(stream_deadline_s > 0) || !(probe_interval_s > 0) ||
        !(resolve_interval_s > 0) || !(probe_deadline_s > 0)) {
      RaiseInvalidArgument("deadlines and intervals must be > 0 seconds");
    }
    FleetOptions o;
    o.client.call_deadline = absl::Seconds(deadline_s);
    o.client.stream_deadline = absl::Seconds(stream_deadline_s);
    o.client.bearer_token = token;
    o.probe_interval = absl::Seconds(probe_interval_s);
    o.resolve_interval = absl::Seconds(resolve_interval_s);
    o.probe_deadline = absl::Seconds(probe_deadline_s);
    fleet_ = WithoutGil([&] { return Fleet::Connect(target, o); });
  }
  Fleet& f() { return *fleet_; }
  static Fleet::Sequence Seq(const std::string& replica, const std::string& model, uint64_t id) {
    Fleet::Sequence s;
    s.replica = replica;
    s.model = model;
    s.id = id;
    return s;
  }

 private:
  std::unique_ptr<Fleet> fleet_;
};

}  // namespace

void BindFleet(py::module_& m) {
  using S = const std::string&;
  py::class_<PyFleet>(m, "Fleet")
      .def(py::init<const std::string&, const std::string&, double, double, double, double,
                    double>(),
           py::arg("target"), py::arg("token") = "", py::arg("deadline_s") = 30.0,
           py::arg("stream_deadline_s") = 600.0, py::arg("probe_interval_s") = 1.0,
           py::arg("resolve_interval_s") = 10.0, py::arg("probe_deadline_s") = 0.5)
      .def("refresh", [](PyFleet& self) { WithoutGil([&] { return self.f().Refresh(); }); })
      .def("replicas",
           [](PyFleet& self) {
             py::list out;
             for (const auto& r : self.f().Replicas()) {
               py::dict d;
               d["name"] = r.name;
               d["address"] = r.address;
               d["healthy"] = r.healthy;
               d["reason"] = r.reason;
               out.append(d);
             }
             return out;
           })
      .def("ensure_model",
           [](PyFleet& self, const py::dict& layout, uint64_t pool_bytes) {
             const ModelLayout l = LayoutOf(layout);
             return ModelInfoDict(WithoutGil([&] { return self.f().EnsureModel(l, pool_bytes); }));
           })
      .def("ensure_preset",
           [](PyFleet& self, S name, S preset, const std::optional<std::string>& storage,
              uint64_t pool_bytes, uint32_t block_tokens) {
             const auto st = DTypeOf(storage);
             return ModelInfoDict(WithoutGil([&] {
               return self.f().EnsurePreset(name, preset, st, pool_bytes, block_tokens);
             }));
           })
      .def("placement_key",
           [](PyFleet& self, S model, const std::vector<uint32_t>& prompt, S cache_salt,
              const std::vector<std::pair<std::string, py::bytes>>& extra_keys) {
             const auto keys = ExtraKeysOf(extra_keys);
             return BytesOf(WithoutGil(
                 [&] { return self.f().PlacementKey(model, prompt, cache_salt, keys); }));
           })
      .def("replica_for",
           [](PyFleet& self, const py::bytes& key) {
             const BlockHash k = HashOf(key);
             return WithoutGil([&] { return self.f().ReplicaFor(k); });
           })
      .def("prefix_root",
           [](PyFleet& self, S model, S cache_salt, bool routed) {
             auto r = WithoutGil([&] {
               return routed ? self.f().GetPrefixRoot(model, cache_salt)
                             : self.f().PrefixRoot(model, cache_salt);
             });
             py::dict d;
             d["root"] = BytesOf(r.root);
             d["algorithm"] = HashAlgorithmName(r.algorithm);
             d["block_tokens"] = r.block_tokens;
             d["layout_fingerprint"] = r.layout_fingerprint;
             d["tenant"] = r.tenant;
             return d;
           })
      .def("create_sequence",
           [](PyFleet& self, S model, std::optional<double> lease_s, std::vector<uint32_t> prompt,
              std::string cache_salt,
              const std::vector<std::pair<std::string, py::bytes>>& extra_keys,
              std::optional<uint32_t> priority, uint32_t retention_kind, uint32_t window,
              uint32_t sinks, uint32_t budget) {
             Client::CreateArgs a;
             a.lease = DurationOf(lease_s);
             a.prompt = std::move(prompt);
             a.cache_salt = std::move(cache_salt);
             a.extra_keys = ExtraKeysOf(extra_keys);
             a.priority = priority;
             a.retention_kind = retention_kind;
             a.window = window;
             a.sinks = sinks;
             a.budget = budget;
             return HandleTuple(WithoutGil([&] { return self.f().CreateSequence(model, a); }));
           })
      .def("append",
           [](PyFleet& self, S replica, S model, uint64_t id, const py::object& k,
              const py::object& v, const py::dict& args) {
             const Client::AppendArgs a = AppendArgsOf(args);
             const Fleet::Sequence seq = PyFleet::Seq(replica, model, id);
             View kview(k, false);
             std::optional<View> vview;
             if (!v.is_none()) vview.emplace(v, false);
             return SequenceDict(WithoutGil([&]() -> absl::StatusOr<Client::SequenceInfo> {
               if (!vview.has_value()) return self.f().Append(seq, a, kview.span());
               return self.f().AppendTensors(seq, a, kview.span(), vview->span());
             }));
           })
      .def("fetch",
           [](PyFleet& self, S replica, S model, uint64_t id, const py::dict& args) {
             const Client::FetchArgs a = FetchArgsOf(args);
             const Fleet::Sequence seq = PyFleet::Seq(replica, model, id);
             Client::FetchResult r = WithoutGil([&] { return self.f().Fetch(seq, a); });
             py::dict meta = FetchDict(r);
             return py::make_tuple(meta, OwnedArray(std::move(r.payload)));
           })
      .def("fetch_into",
           [](PyFleet& self, S replica, S model, uint64_t id, const py::object& out,
              const py::dict& args) {
             const Client::FetchArgs a = FetchArgsOf(args);
             const Fleet::Sequence seq = PyFleet::Seq(replica, model, id);
             View view(out, true);
             return FetchDict(WithoutGil([&] { return self.f().FetchInto(seq, a, view.span()); }));
           })
      .def("fork",
           [](PyFleet& self, S replica, S model, uint64_t id, std::optional<double> lease_s) {
             const auto lease = DurationOf(lease_s);
             const Fleet::Sequence seq = PyFleet::Seq(replica, model, id);
             return HandleTuple(WithoutGil([&] { return self.f().Fork(seq, lease); }));
           })
      .def("truncate",
           [](PyFleet& self, S replica, S model, uint64_t id, uint64_t num_tokens) {
             const Fleet::Sequence seq = PyFleet::Seq(replica, model, id);
             return SequenceDict(WithoutGil([&] { return self.f().Truncate(seq, num_tokens); }));
           })
      .def("free",
           [](PyFleet& self, S replica, S model, uint64_t id) {
             const Fleet::Sequence seq = PyFleet::Seq(replica, model, id);
             return WithoutGil([&] { return self.f().Free(seq); });
           })
      .def("renew_lease",
           [](PyFleet& self, S replica, S model, uint64_t id) {
             const Fleet::Sequence seq = PyFleet::Seq(replica, model, id);
             return SequenceDict(WithoutGil([&] { return self.f().RenewLease(seq); }));
           })
      .def("get_sequence",
           [](PyFleet& self, S replica, S model, uint64_t id) {
             const Fleet::Sequence seq = PyFleet::Seq(replica, model, id);
             return SequenceDict(WithoutGil([&] { return self.f().GetSequence(seq); }));
           })
      .def("match",
           [](PyFleet& self, S model, const py::list& queries) {
             std::vector<Client::MatchQuery> qs;
             for (const auto& q : queries) qs.push_back(QueryOf(q.cast<py::tuple>()));
             return WithoutGil([&] { return self.f().Match(model, qs); });
           })
      .def("fetch_blocks",
           [](PyFleet& self, S model, const std::vector<py::bytes>& hashes, const py::dict& args) {
             std::vector<BlockHash> hs;
             for (const auto& h : hashes) hs.push_back(HashOf(h));
             const Client::FetchArgs a = FetchArgsOf(args);
             Client::FetchResult r = WithoutGil([&] { return self.f().FetchBlocks(model, hs, a); });
             py::dict meta = FetchDict(r);
             return py::make_tuple(meta, OwnedArray(std::move(r.payload)));
           })
      .def("pin",
           [](PyFleet& self, S model, const py::tuple& query, bool pin) {
             const Client::MatchQuery q = QueryOf(query);
             return WithoutGil([&] { return self.f().Pin(model, q, pin); });
           })
      .def("watch",
           // on_batch(replica: str, events: list[dict]) -> bool runs with the GIL held, from one
           // stream thread at a time; the streams read with it released.
           [](PyFleet& self, S model, bool from_now, double deadline_s,
              const py::function& on_batch) {
             if (!(deadline_s > 0)) RaiseInvalidArgument("deadline_s must be > 0");
             std::optional<py::error_already_set> callback_error;
             absl::Status s;
             {
               py::gil_scoped_release release;
               s = self.f().Watch(model, from_now, absl::Seconds(deadline_s),
                                  [&](const Fleet::TaggedEvents& batch) {
                                    py::gil_scoped_acquire acquire;
                                    if (callback_error.has_value()) return false;
                                    try {
                                      py::list events;
                                      for (const auto& e : batch.events)
                                        events.append(EventDict(e));
                                      return on_batch(batch.replica, events).cast<bool>();
                                    } catch (py::error_already_set& e) {
                                      callback_error.emplace(std::move(e));
                                      return false;
                                    }
                                  });
             }
             if (callback_error.has_value()) throw *std::move(callback_error);
             if (!s.ok() && !absl::IsDeadlineExceeded(s)) RaiseStatus(s);
             return s.ok();
           });
}

}  // namespace kvbank::python
