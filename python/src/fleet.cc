// kvbank._kvbank.Fleet: kvbank::Fleet (kvbank/fleet.h) for Python; kvbank/_fleet.py is its
// Pythonic face. Registered from module.cc with BindFleet(m).
//
// Every RPC runs with the GIL released. A sequence crosses as (replica, model, id). Values convert
// through convert.h, as the Client's do, and errors raise kvbank.Error's subclass for the gRPC
// code through its RaiseStatus.
#include "kvbank/fleet.h"

#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

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
#include "src/convert.h"

namespace py = pybind11;

namespace kvbank::python {
namespace {

// The fleet and its sequence handles. Thread-safe like kvbank::Fleet.
class PyFleet {
 public:
  PyFleet(const std::string& target, const std::string& token, double deadline_s,
          double stream_deadline_s, double probe_interval_s, double resolve_interval_s,
          double probe_deadline_s, std::optional<double> load_epsilon, bool copy_prefixes) {
    if (!(deadline_s > 0) || !(stream_deadline_s > 0) || !(probe_interval_s > 0) ||
        !(resolve_interval_s > 0) || !(probe_deadline_s > 0)) {
      RaiseInvalid("deadlines and intervals must be > 0 seconds");
    }
    FleetOptions o;
    o.client.call_deadline = absl::Seconds(deadline_s);
    o.client.stream_deadline = absl::Seconds(stream_deadline_s);
    o.client.bearer_token = token;
    o.probe_interval = absl::Seconds(probe_interval_s);
    o.resolve_interval = absl::Seconds(resolve_interval_s);
    o.probe_deadline = absl::Seconds(probe_deadline_s);
    if (load_epsilon.has_value() && !(*load_epsilon >= 0))
      RaiseInvalid("load_epsilon must be >= 0");
    o.load_epsilon = load_epsilon;
    o.copy_prefixes = copy_prefixes;
    fleet_ = CallWithoutGil([&] { return Fleet::Connect(target, o); });
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

using FleetClass = py::class_<PyFleet>;
using S = const std::string&;

// The fleet itself: its replicas, models and placement.
void BindFleetPlacement(FleetClass& c) {
  c.def(py::init<const std::string&, const std::string&, double, double, double, double, double,
                 std::optional<double>, bool>(),
        py::arg("target"), py::arg("token") = "", py::arg("deadline_s") = 30.0,
        py::arg("stream_deadline_s") = 600.0, py::arg("probe_interval_s") = 1.0,
        py::arg("resolve_interval_s") = 10.0, py::arg("probe_deadline_s") = 0.5,
        py::arg("load_epsilon") = 0.15, py::arg("copy_prefixes") = true)
      .def("refresh", [](PyFleet& self) { CallWithoutGil([&] { return self.f().Refresh(); }); })
      .def("replicas",
           [](PyFleet& self) {
             py::list out;
             for (const auto& r : self.f().Replicas()) out.append(FromReplica(r));
             return out;
           })
      .def("ensure_model",
           [](PyFleet& self, const py::dict& layout, uint64_t pool_bytes) {
             const ModelLayout l = LayoutFromDict(layout);
             return FromModelInfo(
                 CallWithoutGil([&] { return self.f().EnsureModel(l, pool_bytes); }));
           })
      .def("ensure_preset",
           [](PyFleet& self, S name, S preset, const std::optional<std::string>& storage,
              uint64_t pool_bytes, uint32_t block_tokens) {
             const auto st = ToDType(storage);
             return FromModelInfo(CallWithoutGil([&] {
               return self.f().EnsurePreset(name, preset, st, pool_bytes, block_tokens);
             }));
           })
      .def("placement_key",
           [](PyFleet& self, S model, const std::vector<uint32_t>& prompt, S cache_salt,
              const std::vector<std::pair<std::string, py::bytes>>& extra_keys) {
             const auto keys = ToExtraKeys(extra_keys);
             return FromHash(CallWithoutGil(
                 [&] { return self.f().PlacementKey(model, prompt, cache_salt, keys); }));
           })
      .def("route",
           [](PyFleet& self, S model, const py::tuple& query) {
             const Client::MatchQuery q = QueryFromTuple(query);
             return FromRoute(CallWithoutGil([&] { return self.f().Route(model, q); }));
           })
      .def("stats", [](PyFleet& self) { return FromFleetStats(self.f().GetStats()); })
      .def("replica_for",
           [](PyFleet& self, const py::bytes& key) {
             const BlockHash k = ToHash(key);
             return CallWithoutGil([&] { return self.f().ReplicaFor(k); });
           })
      .def("prefix_root", [](PyFleet& self, S model, S cache_salt, bool routed) {
        auto r = CallWithoutGil([&] {
          return routed ? self.f().GetPrefixRoot(model, cache_salt)
                        : self.f().PrefixRoot(model, cache_salt);
        });
        return FromPrefixRoot(r);
      });
}

// Calls on one sequence, on the replica that holds it.
void BindFleetSequences(FleetClass& c) {
  c.def("create_sequence",
        [](PyFleet& self, S model, std::optional<double> lease_s, std::vector<uint32_t> prompt,
           std::string cache_salt, const std::vector<std::pair<std::string, py::bytes>>& extra_keys,
           std::optional<uint32_t> priority, uint32_t retention_kind, uint32_t window,
           uint32_t sinks, uint32_t budget) {
          const Client::CreateArgs a =
              MakeCreateArgs(lease_s, std::move(prompt), std::move(cache_salt), extra_keys,
                             priority, retention_kind, window, sinks, budget);
          return FromFleetSequence(
              CallWithoutGil([&] { return self.f().CreateSequence(model, a); }));
        })
      .def("append",
           [](PyFleet& self, S replica, S model, uint64_t id, const py::object& k,
              const py::object& v, const py::dict& args) {
             const Client::AppendArgs a = AppendArgsFromDict(args);
             const Fleet::Sequence seq = PyFleet::Seq(replica, model, id);
             BufferView kview(k, false);
             std::optional<BufferView> vview;
             if (!v.is_none()) vview.emplace(v, false);
             return FromSequenceInfo(CallWithoutGil([&]() -> absl::StatusOr<Client::SequenceInfo> {
               if (!vview.has_value()) return self.f().Append(seq, a, kview.span());
               return self.f().AppendTensors(seq, a, kview.span(), vview->span());
             }));
           })
      .def("fetch",
           [](PyFleet& self, S replica, S model, uint64_t id, const py::dict& args) {
             const Client::FetchArgs a = FetchArgsFromDict(args);
             const Fleet::Sequence seq = PyFleet::Seq(replica, model, id);
             Client::FetchResult r = CallWithoutGil([&] { return self.f().Fetch(seq, a); });
             py::object meta = FromFetchResult(r);
             return py::make_tuple(meta, ToArray(std::move(r.payload)));
           })
      .def("fetch_into",
           [](PyFleet& self, S replica, S model, uint64_t id, const py::object& out,
              const py::dict& args) {
             const Client::FetchArgs a = FetchArgsFromDict(args);
             const Fleet::Sequence seq = PyFleet::Seq(replica, model, id);
             BufferView view(out, true);
             return FromFetchResult(
                 CallWithoutGil([&] { return self.f().FetchInto(seq, a, view.span()); }));
           })
      .def("fork",
           [](PyFleet& self, S replica, S model, uint64_t id, std::optional<double> lease_s) {
             const auto lease = ToDuration(lease_s);
             const Fleet::Sequence seq = PyFleet::Seq(replica, model, id);
             return FromFleetSequence(CallWithoutGil([&] { return self.f().Fork(seq, lease); }));
           })
      .def("truncate",
           [](PyFleet& self, S replica, S model, uint64_t id, uint64_t num_tokens) {
             const Fleet::Sequence seq = PyFleet::Seq(replica, model, id);
             return FromSequenceInfo(
                 CallWithoutGil([&] { return self.f().Truncate(seq, num_tokens); }));
           })
      .def("free",
           [](PyFleet& self, S replica, S model, uint64_t id) {
             const Fleet::Sequence seq = PyFleet::Seq(replica, model, id);
             return CallWithoutGil([&] { return self.f().Free(seq); });
           })
      .def("renew_lease",
           [](PyFleet& self, S replica, S model, uint64_t id) {
             const Fleet::Sequence seq = PyFleet::Seq(replica, model, id);
             return FromSequenceInfo(CallWithoutGil([&] { return self.f().RenewLease(seq); }));
           })
      .def("get_sequence", [](PyFleet& self, S replica, S model, uint64_t id) {
        const Fleet::Sequence seq = PyFleet::Seq(replica, model, id);
        return FromSequenceInfo(CallWithoutGil([&] { return self.f().GetSequence(seq); }));
      });
}

// Prefix look-ups, reads and pins on a model's replicas, and their event streams.
void BindFleetPrefix(FleetClass& c) {
  c.def("match",
        [](PyFleet& self, S model, const py::list& queries) {
          std::vector<Client::MatchQuery> qs;
          for (const auto& q : queries) qs.push_back(QueryFromTuple(q));
          return CallWithoutGil([&] { return self.f().Match(model, qs); });
        })
      .def("fetch_blocks",
           [](PyFleet& self, S model, const std::vector<py::bytes>& hashes, const py::dict& args) {
             const std::vector<BlockHash> hs = ToHashes(hashes);
             const Client::FetchArgs a = FetchArgsFromDict(args);
             Client::FetchResult r =
                 CallWithoutGil([&] { return self.f().FetchBlocks(model, hs, a); });
             py::object meta = FromFetchResult(r);
             return py::make_tuple(meta, ToArray(std::move(r.payload)));
           })
      .def("pin",
           [](PyFleet& self, S model, const py::tuple& query, bool pin) {
             const Client::MatchQuery q = QueryFromTuple(query);
             return CallWithoutGil([&] { return self.f().Pin(model, q, pin); });
           })
      .def("watch",
           // on_batch(replica: str, events: list[Event]) -> bool runs with the GIL held, from one
           // stream thread at a time; the streams read with it released.
           [](PyFleet& self, S model, bool from_now, double deadline_s,
              const py::function& on_batch) {
             if (!(deadline_s > 0)) RaiseInvalid("deadline_s must be > 0");
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
                                        events.append(FromEvent(e));
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

}  // namespace

void BindFleet(py::module_& m) {
  FleetClass c(m, "Fleet");
  BindFleetPlacement(c);
  BindFleetSequences(c);
  BindFleetPrefix(c);
}

}  // namespace kvbank::python
