// kvbank._kvbank.Client: payloads through the buffer protocol (append, fetch and their tensor
// forms; append and fetch_into on the plane the PlaneRouter picks) and attention on the server.
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

void BindTransfers(py::class_<PyClient>& c) {
  c.def(
       "append",
       [](PyClient& self, const std::string& model, uint64_t id, const py::object& payload,
          uint64_t num_tokens, uint32_t layer_begin, std::optional<uint32_t> layer_end,
          const std::optional<std::string>& dtype, std::vector<uint32_t> token_ids,
          uint32_t kv_head_begin, std::optional<uint32_t> kv_head_end) {
         const Client::AppendArgs a =
             MakeAppendArgs(num_tokens, layer_begin, layer_end, dtype, std::move(token_ids),
                            kv_head_begin, kv_head_end);
         BufferView view(payload, /*writable=*/false);
         const absl::Span<const uint8_t> bytes = view.span();
         return FromSequenceInfo(
             CallWithoutGil([&] { return self.planes().Append(model, id, a, bytes); }));
       },
       py::arg("model"), py::arg("id"), py::arg("payload"), py::arg("num_tokens"),
       py::arg("layer_begin") = 0, py::arg("layer_end") = py::none(), py::arg("dtype") = py::none(),
       py::arg("token_ids") = std::vector<uint32_t>{}, py::arg("kv_head_begin") = 0,
       py::arg("kv_head_end") = py::none())
      .def(
          "append_tensors",
          [](PyClient& self, const std::string& model, uint64_t id, const py::object& k,
             const py::object& v, uint64_t num_tokens, uint32_t layer_begin,
             std::optional<uint32_t> layer_end, const std::optional<std::string>& dtype,
             std::vector<uint32_t> token_ids, uint32_t kv_head_begin,
             std::optional<uint32_t> kv_head_end) {
            const Client::AppendArgs a =
                MakeAppendArgs(num_tokens, layer_begin, layer_end, dtype, std::move(token_ids),
                               kv_head_begin, kv_head_end);
            BufferView kview(k, false);
            std::optional<BufferView> vview;
            absl::Span<const uint8_t> vbytes;
            if (!v.is_none()) {
              vview.emplace(v, false);
              vbytes = vview->span();
            }
            const absl::Span<const uint8_t> kbytes = kview.span();
            return FromSequenceInfo(CallWithoutGil(
                [&] { return self.c().AppendTensors(model, id, a, kbytes, vbytes); }));
          },
          py::arg("model"), py::arg("id"), py::arg("k"), py::arg("v"), py::arg("num_tokens"),
          py::arg("layer_begin") = 0, py::arg("layer_end") = py::none(),
          py::arg("dtype") = py::none(), py::arg("token_ids") = std::vector<uint32_t>{},
          py::arg("kv_head_begin") = 0, py::arg("kv_head_end") = py::none())
      .def(
          "fetch",
          [](PyClient& self, const std::string& model, uint64_t id, uint64_t token_begin,
             std::optional<uint64_t> token_end, uint32_t layer_begin,
             std::optional<uint32_t> layer_end, const std::optional<std::string>& dtype,
             uint32_t kv_head_begin, std::optional<uint32_t> kv_head_end, double wait_s) {
            const Client::FetchArgs a =
                MakeFetchArgs(token_begin, token_end, layer_begin, layer_end, dtype, kv_head_begin,
                              kv_head_end, wait_s);
            Client::FetchResult r = CallWithoutGil([&] { return self.c().Fetch(model, id, a); });
            py::object meta = FromFetchResult(r);
            return py::make_tuple(meta, ToArray(std::move(r.payload)));
          },
          py::arg("model"), py::arg("id"), py::arg("token_begin") = 0,
          py::arg("token_end") = py::none(), py::arg("layer_begin") = 0,
          py::arg("layer_end") = py::none(), py::arg("dtype") = py::none(),
          py::arg("kv_head_begin") = 0, py::arg("kv_head_end") = py::none(),
          py::arg("wait_s") = 0.0)
      .def(
          "fetch_into",
          [](PyClient& self, const std::string& model, uint64_t id, const py::object& out,
             uint64_t token_begin, std::optional<uint64_t> token_end, uint32_t layer_begin,
             std::optional<uint32_t> layer_end, const std::optional<std::string>& dtype,
             uint32_t kv_head_begin, std::optional<uint32_t> kv_head_end, double wait_s) {
            const Client::FetchArgs a =
                MakeFetchArgs(token_begin, token_end, layer_begin, layer_end, dtype, kv_head_begin,
                              kv_head_end, wait_s);
            BufferView view(out, /*writable=*/true);
            const absl::Span<uint8_t> bytes = view.span();
            return FromFetchResult(
                CallWithoutGil([&] { return self.planes().FetchInto(model, id, a, bytes); }));
          },
          py::arg("model"), py::arg("id"), py::arg("out"), py::arg("token_begin") = 0,
          py::arg("token_end") = py::none(), py::arg("layer_begin") = 0,
          py::arg("layer_end") = py::none(), py::arg("dtype") = py::none(),
          py::arg("kv_head_begin") = 0, py::arg("kv_head_end") = py::none(),
          py::arg("wait_s") = 0.0)
      .def(
          "fetch_tensors",
          [](PyClient& self, const std::string& model, uint64_t id, const py::object& k,
             const py::object& v, uint64_t token_begin, std::optional<uint64_t> token_end,
             uint32_t layer_begin, std::optional<uint32_t> layer_end,
             const std::optional<std::string>& dtype, uint32_t kv_head_begin,
             std::optional<uint32_t> kv_head_end, double wait_s) {
            const Client::FetchArgs a =
                MakeFetchArgs(token_begin, token_end, layer_begin, layer_end, dtype, kv_head_begin,
                              kv_head_end, wait_s);
            BufferView kview(k, true);
            std::optional<BufferView> vview;
            absl::Span<uint8_t> vbytes;
            if (!v.is_none()) {
              vview.emplace(v, true);
              vbytes = vview->span();
            }
            const absl::Span<uint8_t> kbytes = kview.span();
            CallWithoutGil([&] { return self.c().FetchTensors(model, id, a, kbytes, vbytes); });
          },
          py::arg("model"), py::arg("id"), py::arg("k"), py::arg("v"), py::arg("token_begin") = 0,
          py::arg("token_end") = py::none(), py::arg("layer_begin") = 0,
          py::arg("layer_end") = py::none(), py::arg("dtype") = py::none(),
          py::arg("kv_head_begin") = 0, py::arg("kv_head_end") = py::none(),
          py::arg("wait_s") = 0.0)
      .def(
          "attend",
          [](PyClient& self, const std::string& model, const py::list& queries, float softmax_scale,
             uint32_t window, uint32_t sinks) {
            // Each query: (sequence_id, layer, float32 array [num_q_heads * head_dim]).
            std::vector<Client::AttendQuery> qs;
            for (const auto& q : queries) {
              auto t = q.cast<
                  std::tuple<uint64_t, uint32_t,
                             py::array_t<float, py::array::c_style | py::array::forcecast>>>();
              Client::AttendQuery aq;
              aq.sequence_id = std::get<0>(t);
              aq.layer = std::get<1>(t);
              const auto& a = std::get<2>(t);
              aq.query.assign(a.data(), a.data() + a.size());
              qs.push_back(std::move(aq));
            }
            Client::AttendArgs args;
            args.softmax_scale = softmax_scale;
            args.window = window;
            args.sinks = sinks;
            const auto outs = CallWithoutGil([&] { return self.c().Attend(model, qs, args); });
            py::list out;
            for (const auto& o : outs) {
              out.append(py::make_tuple(ToFloatArray(o.output), ToFloatArray(o.lse)));
            }
            return out;
          },
          py::arg("model"), py::arg("queries"), py::arg("softmax_scale") = 0.0f,
          py::arg("window") = 0, py::arg("sinks") = 0);
}

}  // namespace kvbank::python
