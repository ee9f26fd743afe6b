// kvbank._kvbank.Client: the prefix cache (match, fetch by hash, pin, the root) and its events.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kvbank/client.h"
#include "kvbank/plane_router.h"
#include "src/convert.h"
#include "src/py_client.h"

namespace py = pybind11;

namespace kvbank::python {

void BindPrefix(py::class_<PyClient>& c) {
  c.def("match",
        [](PyClient& self, const std::string& model, const py::list& queries) {
          // Each query: (tokens, hashes, cache_salt, extra_keys).
          std::vector<Client::MatchQuery> qs;
          for (const auto& q : queries) qs.push_back(QueryFromTuple(q));
          return CallWithoutGil([&] { return self.c().Match(model, qs); });
        })
      .def("match_tiers",
           [](PyClient& self, const std::string& model, const py::list& queries, bool prefetch) {
             std::vector<Client::MatchQuery> qs;
             for (const auto& q : queries) qs.push_back(QueryFromTuple(q));
             auto r = CallWithoutGil([&] { return self.c().MatchTiers(model, qs, prefetch); });
             py::list out;
             for (const Client::MatchTiersResult& m : r) {
               py::dict d;
               d["tokens"] = m.tokens;
               d["pool_tokens"] = m.pool_tokens;
               d["host_tokens"] = m.host_tokens;
               d["disk_tokens"] = m.disk_tokens;
               out.append(d);
             }
             return out;
           })
      .def(
          "fetch_blocks",
          [](PyClient& self, const std::string& model, const std::vector<py::bytes>& hashes,
             uint32_t layer_begin, std::optional<uint32_t> layer_end,
             const std::optional<std::string>& dtype, uint32_t kv_head_begin,
             std::optional<uint32_t> kv_head_end) {
            const std::vector<BlockHash> hs = ToHashes(hashes);
            const Client::FetchArgs a = MakeFetchArgs(0, std::nullopt, layer_begin, layer_end,
                                                      dtype, kv_head_begin, kv_head_end);
            Client::FetchResult r =
                CallWithoutGil([&] { return self.c().FetchBlocks(model, hs, a); });
            py::object meta = FromFetchResult(r);
            return py::make_tuple(meta, ToArray(std::move(r.payload)));
          },
          py::arg("model"), py::arg("hashes"), py::arg("layer_begin") = 0,
          py::arg("layer_end") = py::none(), py::arg("dtype") = py::none(),
          py::arg("kv_head_begin") = 0, py::arg("kv_head_end") = py::none())
      .def(
          "fetch_blocks_into",
          [](PyClient& self, const std::string& model, const std::vector<py::bytes>& hashes,
             const py::object& out, uint32_t layer_begin, std::optional<uint32_t> layer_end,
             const std::optional<std::string>& dtype, uint32_t kv_head_begin,
             std::optional<uint32_t> kv_head_end) {
            const std::vector<BlockHash> hs = ToHashes(hashes);
            const Client::FetchArgs a = MakeFetchArgs(0, std::nullopt, layer_begin, layer_end,
                                                      dtype, kv_head_begin, kv_head_end);
            BufferView view(out, /*writable=*/true);
            const absl::Span<uint8_t> bytes = view.span();
            return FromFetchResult(
                CallWithoutGil([&] { return self.planes().FetchBlocksInto(model, hs, a, bytes); }));
          },
          py::arg("model"), py::arg("hashes"), py::arg("out"), py::arg("layer_begin") = 0,
          py::arg("layer_end") = py::none(), py::arg("dtype") = py::none(),
          py::arg("kv_head_begin") = 0, py::arg("kv_head_end") = py::none())
      .def(
          "pin",
          [](PyClient& self, const std::string& model, std::vector<uint32_t> tokens,
             const std::vector<py::bytes>& hashes, std::string cache_salt,
             const std::vector<std::pair<std::string, py::bytes>>& extra_keys, bool pin) {
            const Client::MatchQuery q =
                MakeQuery(std::move(tokens), hashes, std::move(cache_salt), extra_keys);
            return CallWithoutGil([&] { return self.c().Pin(model, q, pin); });
          },
          py::arg("model"), py::arg("tokens"), py::arg("hashes"), py::arg("cache_salt"),
          py::arg("extra_keys"), py::arg("pin"))
      .def(
          "get_prefix_root",
          [](PyClient& self, const std::string& model, const std::string& cache_salt) {
            const auto r =
                CallWithoutGil([&] { return self.c().GetPrefixRoot(model, cache_salt); });
            return FromPrefixRoot(r);
          },
          py::arg("model"), py::arg("cache_salt") = "")
      .def(
          "watch",
          // on_batch(events: list[Event], last_sequence: int) -> bool runs on the calling thread
          // with the GIL held; the stream reads with it released.
          [](PyClient& self, const std::string& model, uint64_t after_sequence, bool from_now,
             double deadline_s, const py::function& on_batch) {
            if (!(deadline_s > 0)) RaiseInvalid("deadline_s must be > 0");
            std::optional<py::error_already_set> callback_error;
            absl::Status s;
            {
              py::gil_scoped_release release;
              s = self.c().Watch(model, after_sequence, from_now, absl::Seconds(deadline_s),
                                 [&](const std::vector<Client::Event>& events, uint64_t last) {
                                   py::gil_scoped_acquire acquire;
                                   try {
                                     py::list batch;
                                     for (const auto& e : events) batch.append(FromEvent(e));
                                     return on_batch(batch, last).cast<bool>();
                                   } catch (py::error_already_set& e) {
                                     callback_error.emplace(std::move(e));
                                     return false;
                                   }
                                 });
            }
            if (callback_error.has_value()) throw *std::move(callback_error);
            Check(s);
          },
          py::arg("model"), py::arg("after_sequence"), py::arg("from_now"), py::arg("deadline_s"),
          py::arg("on_batch"));
}

}  // namespace kvbank::python
