// kvbank._kvbank: the C++ SDK (kvbank::Client, layouts, prefix hashes) for Python.
//
// Thin on purpose: the Pythonic surface (keyword arguments, dicts, typed exceptions, futures)
// lives in kvbank/*.py; this module moves bytes and calls convert.h to convert types (results
// come back as kvbank/_types.py's dataclasses; the same converters serve the Fleet in fleet.cc).
// Every RPC runs with the GIL released, so other Python threads run while a call waits on the
// network. Payloads go through the buffer protocol in both directions: Append reads the caller's
// buffer in place, FetchInto writes straight into it, and Fetch hands the SDK's vector to numpy
// without a copy. The Client's methods are bound by topic in client_*.cc (py_client.h); the
// shared-memory routing is the C++ SDK's PlaneRouter.
//
// Errors: a non-OK absl::Status raises through convert.h's RaiseStatus, whose translator
// (registered below) turns it into kvbank.Error's subclass for the gRPC code (kvbank/_errors.py).
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
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kvbank/client.h"
#include "kvbank/layout.h"
#include "kvbank/plane_router.h"
#include "kvbank/prefix_hash.h"
#include "src/convert.h"
#include "src/fleet.h"
#include "src/py_client.h"

namespace py = pybind11;

namespace kvbank::python {

PyClient::PyClient(const std::string& target, const std::string& token, double deadline_s,
                   double stream_deadline_s, uint64_t chunk_bytes, std::optional<py::dict> tls,
                   const std::string& shm, uint64_t shm_min_bytes, uint64_t shm_staging_bytes) {
  ClientOptions o;
  if (!(deadline_s > 0) || !(stream_deadline_s > 0)) RaiseInvalid("deadlines must be > 0 seconds");
  if (chunk_bytes == 0) RaiseInvalid("chunk_bytes must be > 0");
  o.call_deadline = absl::Seconds(deadline_s);
  o.stream_deadline = absl::Seconds(stream_deadline_s);
  o.chunk_bytes = chunk_bytes;
  o.bearer_token = token;
  if (tls.has_value()) o.tls = TlsOptionsFromDict(*tls);
  PlaneRouter::Options planes;
  planes.shm = shm;
  planes.shm_min_bytes = shm_min_bytes;
  planes.shm_staging_bytes = shm_staging_bytes;
  absl::StatusOr<std::unique_ptr<PlaneRouter>> r;
  {
    py::gil_scoped_release release;
    r = PlaneRouter::Connect(target, o, planes);
  }
  router_ = Unwrap(std::move(r));
}

namespace {

void BindClient(py::module_& m) {
  BindRegion(m);
  py::class_<PyClient> c(m, "Client");
  c.def(py::init<const std::string&, const std::string&, double, double, uint64_t,
                 std::optional<py::dict>, const std::string&, uint64_t, uint64_t>(),
        py::arg("target"), py::arg("token") = "", py::arg("deadline_s") = 30.0,
        py::arg("stream_deadline_s") = 600.0, py::arg("chunk_bytes") = uint64_t{1} << 20,
        py::arg("tls") = py::none(), py::arg("shm") = "auto",
        py::arg("shm_min_bytes") = uint64_t{1} << 20,
        py::arg("shm_staging_bytes") = uint64_t{1} << 30);
  BindAdmin(c);
  BindSequences(c);
  BindTransfers(c);
  BindPrefix(c);
  BindShmPlane(c);
  BindDevicePlanes(c);
}

void BindFunctions(py::module_& m) {
  m.def(
      "root_hash",
      [](const std::string& algorithm, const std::string& fingerprint, const std::string& tenant,
         const std::string& cache_salt) {
        return FromHash(RootHash(ToAlgorithm(algorithm), {fingerprint, tenant, cache_salt}));
      },
      py::arg("algorithm"), py::arg("layout_fingerprint"), py::arg("tenant") = "",
      py::arg("cache_salt") = "");
  m.def(
      "chain_hash",
      [](const std::string& algorithm, const py::bytes& parent, const std::vector<uint32_t>& tokens,
         const std::vector<std::pair<std::string, py::bytes>>& extra_keys) {
        return FromHash(ChainHash(ToAlgorithm(algorithm), ToHash(parent), tokens.data(),
                                  tokens.size(), ToExtraKeys(extra_keys)));
      },
      py::arg("algorithm"), py::arg("parent"), py::arg("tokens"),
      py::arg("extra_keys") = std::vector<std::pair<std::string, py::bytes>>{});
  m.def(
      "prefix_hashes",
      [](const std::string& algorithm, const py::bytes& root, const std::vector<uint32_t>& tokens,
         uint32_t block_tokens, const std::vector<std::pair<std::string, py::bytes>>& extra_keys) {
        if (block_tokens == 0) RaiseInvalid("block_tokens must be > 0");
        return FromHashes(PrefixHashes(ToAlgorithm(algorithm), ToHash(root), tokens, block_tokens,
                                       ToExtraKeys(extra_keys)));
      },
      py::arg("algorithm"), py::arg("root"), py::arg("tokens"), py::arg("block_tokens"),
      py::arg("extra_keys") = std::vector<std::pair<std::string, py::bytes>>{});
  m.def("layout_fingerprint", [](const py::dict& layout) {
    const ModelLayout m = LayoutFromDict(layout);
    const std::string err = ValidateLayout(m);
    if (!err.empty()) RaiseInvalid(err);
    return LayoutFingerprint(m);
  });
  m.def("validate_layout",
        [](const py::dict& layout) { return ValidateLayout(LayoutFromDict(layout)); });
  m.def("normalize_layout",
        [](const py::dict& layout) { return LayoutToDict(LayoutFromDict(layout)); });
  m.def(
      "preset_layout",
      [](const std::string& preset, const std::string& storage) {
        ModelLayout m;
        if (!PresetLayout(preset, &m, ToDType(storage))) {
          RaiseInvalid("unknown preset '" + preset + "'");
        }
        return LayoutToDict(m);
      },
      py::arg("preset"), py::arg("storage") = "bf16");
  m.def("preset_names", &PresetNames);
  m.def(
      "payload_bytes",
      [](const py::dict& layout, uint64_t num_tokens, uint32_t layer_begin,
         std::optional<uint32_t> layer_end, const std::optional<std::string>& dtype) {
        const ModelLayout m = LayoutFromDict(layout);
        const std::string err = ValidateLayout(m);
        if (!err.empty()) RaiseInvalid(err);
        const uint32_t l1 = layer_end.value_or(m.num_layers);
        if (layer_begin >= l1 || l1 > m.num_layers) {
          RaiseInvalid("layer range [" + std::to_string(layer_begin) + ", " + std::to_string(l1) +
                       ") is not inside the model's " + std::to_string(m.num_layers) + " layers");
        }
        const BlockLayout b = ComputeBlockLayout(m);
        const DType wire =
            dtype.has_value() ? ToDType(*dtype) : DefaultWireDType(m, layer_begin, l1);
        if (IsQuantized(wire)) {
          RaiseInvalid(std::string("payload_bytes covers the fp32/fp16/bf16 wire dtypes, not ") +
                       DTypeName(wire));
        }
        return PayloadLayout::Make(b, layer_begin, l1, num_tokens, wire).total_bytes;
      },
      py::arg("layout"), py::arg("num_tokens"), py::arg("layer_begin") = 0,
      py::arg("layer_end") = py::none(), py::arg("dtype") = py::none());
}

}  // namespace
}  // namespace kvbank::python

PYBIND11_MODULE(_kvbank, m) {
  m.doc() = "kvbank C++ SDK bindings (use the kvbank package, not this module)";
  // The project version CMake passes in (project(kvbank VERSION ...)): kvbank.__version__.
  m.attr("__version__") = KVBANK_VERSION_STRING;
  kvbank::python::RegisterStatusTranslator();
  kvbank::python::BindClient(m);
  kvbank::python::BindFunctions(m);
  kvbank::python::BindFleet(m);
}
