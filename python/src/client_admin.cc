// kvbank._kvbank.Client: the models, the server's info, statistics and health.
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

void BindAdmin(py::class_<PyClient>& c) {
  c.def("server_info",
        [](PyClient& self) {
          const Client::ServerInfo info = CallWithoutGil([&] { return self.c().GetServerInfo(); });
          py::dict d;
          d["version"] = info.version;
          d["shm_socket"] = info.shm_socket;
          d["replica"] = info.replica;
          d["cuda_ipc_device"] = info.cuda_ipc_device.has_value()
                                     ? py::object(py::int_(*info.cuda_ipc_device))
                                     : py::object(py::none());
          d["nccl"] = info.nccl;
          d["nccl_off"] = info.nccl_off;
          d["host_id"] = info.host_id;
          d["on_this_host"] = info.OnThisHost();
          return d;
        })
      .def(
          "ensure_model",
          [](PyClient& self, const py::dict& layout, uint64_t pool_bytes) {
            const ModelLayout m = LayoutFromDict(layout);
            return FromModelInfo(
                CallWithoutGil([&] { return self.c().EnsureModel(m, pool_bytes); }));
          },
          py::arg("layout"), py::arg("pool_bytes") = 0)
      .def(
          "ensure_preset",
          [](PyClient& self, const std::string& name, const std::string& preset,
             const std::optional<std::string>& storage, uint64_t pool_bytes,
             uint32_t block_tokens) {
            const std::optional<DType> st = ToDType(storage);
            return FromModelInfo(CallWithoutGil(
                [&] { return self.c().EnsurePreset(name, preset, st, pool_bytes, block_tokens); }));
          },
          py::arg("name"), py::arg("preset"), py::arg("storage") = py::none(),
          py::arg("pool_bytes") = 0, py::arg("block_tokens") = 0)
      .def("drop_model",
           [](PyClient& self, const std::string& name) {
             CallWithoutGil([&] { return self.c().DropModel(name); });
           })
      .def("list_models",
           [](PyClient& self) {
             py::list out;
             for (const auto& i : CallWithoutGil([&] { return self.c().ListModels(); })) {
               out.append(FromModelInfo(i));
             }
             return out;
           })
      .def("get_model",
           [](PyClient& self, const std::string& name) {
             return FromModelInfo(CallWithoutGil([&] { return self.c().GetModel(name); }));
           })
      .def(
          "stats",
          [](PyClient& self, const std::string& model) {
            py::list out;
            for (const auto& s : CallWithoutGil([&] { return self.c().GetStats(model); })) {
              out.append(StatsToDict(s));
            }
            return out;
          },
          py::arg("model") = "")
      .def(
          "check_serving",
          [](PyClient& self, double deadline_s) {
            CallWithoutGil([&] { return self.c().CheckServing(absl::Seconds(deadline_s)); });
          },
          py::arg("deadline_s"));
}

}  // namespace kvbank::python
