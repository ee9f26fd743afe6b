// kvbank._kvbank.Client: the sequence calls that move no payload.
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

void BindSequences(py::class_<PyClient>& c) {
  c.def(
       "create_sequence",
       [](PyClient& self, const std::string& model, std::optional<double> lease_s,
          std::vector<uint32_t> prompt, std::string cache_salt,
          const std::vector<std::pair<std::string, py::bytes>>& extra_keys,
          std::optional<uint32_t> priority, uint32_t retention_kind, uint32_t window,
          uint32_t sinks, uint32_t budget) {
         const Client::CreateArgs a =
             MakeCreateArgs(lease_s, std::move(prompt), std::move(cache_salt), extra_keys, priority,
                            retention_kind, window, sinks, budget);
         return FromSequenceInfo(CallWithoutGil([&] { return self.c().CreateSequence(model, a); }));
       },
       py::arg("model"), py::arg("lease_s") = py::none(),
       py::arg("prompt") = std::vector<uint32_t>{}, py::arg("cache_salt") = "",
       py::arg("extra_keys") = std::vector<std::pair<std::string, py::bytes>>{},
       py::arg("priority") = py::none(), py::arg("retention_kind") = 0, py::arg("window") = 0,
       py::arg("sinks") = 0, py::arg("budget") = 0)
      .def(
          "fork",
          [](PyClient& self, const std::string& model, uint64_t id, std::optional<double> lease_s) {
            const auto lease = ToDuration(lease_s);
            return FromSequenceInfo(
                CallWithoutGil([&] { return self.c().Fork(model, id, lease); }));
          },
          py::arg("model"), py::arg("id"), py::arg("lease_s") = py::none())
      .def("truncate",
           [](PyClient& self, const std::string& model, uint64_t id, uint64_t num_tokens) {
             return FromSequenceInfo(
                 CallWithoutGil([&] { return self.c().Truncate(model, id, num_tokens); }));
           })
      .def("free",
           [](PyClient& self, const std::string& model, uint64_t id) {
             return CallWithoutGil([&] { return self.c().Free(model, id); });
           })
      .def(
          "renew_lease",
          [](PyClient& self, const std::string& model, uint64_t id) {
            return FromSequenceInfo(CallWithoutGil([&] { return self.c().RenewLease(model, id); }));
          })
      .def("get_sequence", [](PyClient& self, const std::string& model, uint64_t id) {
        return FromSequenceInfo(CallWithoutGil([&] { return self.c().GetSequence(model, id); }));
      });
}

}  // namespace kvbank::python
