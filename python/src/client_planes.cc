// kvbank._kvbank.Client: the data planes: shared-memory regions and the PlaneRouter's counters,
// CUDA IPC device regions and the NCCL communicator.
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
namespace {

// A scattered slice's run offsets: any integer array or sequence, as uint64.
using RunOffsets = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>;

std::vector<uint64_t> ToVector(const RunOffsets& a) {
  return std::vector<uint64_t>(a.data(), a.data() + a.size());
}

}  // namespace

void BindRegion(py::module_& m) {
  // A registered shared-memory region: writable bytes (buffer protocol) that payloads move
  // through without a copy on this side.
  py::class_<ShmRegion, std::shared_ptr<ShmRegion>>(m, "Region", py::buffer_protocol())
      .def_buffer([](ShmRegion& r) {
        return py::buffer_info(r.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(r.size())}, {py::ssize_t{1}});
      })
      .def_property_readonly("id", &ShmRegion::id)
      .def_property_readonly("size", &ShmRegion::size);
}

void BindShmPlane(py::class_<PyClient>& c) {
  c.def_property_readonly("data_plane",
                          [](PyClient& self) { return self.planes().shm_on() ? "shm" : "grpc"; })
      .def_property_readonly("shm_socket",
                             [](PyClient& self) { return self.planes().shm_socket(); })
      .def("plane_stats",
           [](PyClient& self) {
             const PlaneRouter::Stats st = self.planes().GetStats();
             const char* names[] = {"shm", "shm_staged", "grpc"};
             py::dict d;
             for (int p = 0; p < PlaneRouter::kNumPlanes; ++p) {
               py::dict e;
               e["calls"] = st.planes[p].calls;
               e["bytes"] = st.planes[p].bytes;
               if (p == PlaneRouter::kShmStaged) {
                 e["dropped"] = st.staging_dropped;  // staging regions let go after a failed call
               }
               d[names[p]] = e;
             }
             // Of the shm and shm_staged calls, those asked for with a control frame on the shm
             // socket rather than a gRPC call.
             py::dict control;
             control["calls"] = st.shm_control_requests;
             d["shm_control"] = control;
             return d;
           })
      .def(
          "register_region",
          // A region of `size` bytes this client registers; buffers inside it move without a
          // copy.
          [](PyClient& self, uint64_t size) {
            return CallWithoutGil([&] { return self.planes().RegisterRegion(size); });
          },
          py::arg("size"))
      .def(
          "register_region_fd",
          // The caller's shared file (a memfd, an shm_open file) as a region, mapped again here.
          [](PyClient& self, int fd) {
            return CallWithoutGil([&] { return self.planes().RegisterRegionFd(fd); });
          },
          py::arg("fd"))
      .def(
          "fetch_blocks_to_region_runs",
          // FetchBlocks into runs of a registered region (RegionSlice's run_bytes / run_offsets).
          [](PyClient& self, const std::string& model, const std::vector<py::bytes>& hashes,
             const std::shared_ptr<ShmRegion>& region, uint64_t offset, uint64_t run_bytes,
             const RunOffsets& run_offsets, uint32_t layer_begin, std::optional<uint32_t> layer_end,
             const std::optional<std::string>& dtype, uint32_t kv_head_begin,
             std::optional<uint32_t> kv_head_end) {
            const std::vector<BlockHash> hs = ToHashes(hashes);
            const Client::FetchArgs a = MakeFetchArgs(0, std::nullopt, layer_begin, layer_end,
                                                      dtype, kv_head_begin, kv_head_end);
            RegionSlice slice{region->id(), offset, 0, run_bytes, ToVector(run_offsets)};
            return FromFetchResult(
                CallWithoutGil([&] { return self.c().FetchBlocksToRegion(model, hs, a, slice); }));
          },
          py::arg("model"), py::arg("hashes"), py::arg("region"), py::arg("offset"),
          py::arg("run_bytes"), py::arg("run_offsets"), py::arg("layer_begin") = 0,
          py::arg("layer_end") = py::none(), py::arg("dtype") = py::none(),
          py::arg("kv_head_begin") = 0, py::arg("kv_head_end") = py::none())
      .def(
          "append_from_region_runs",
          // Append from runs of a registered region.
          [](PyClient& self, const std::string& model, uint64_t id,
             const std::shared_ptr<ShmRegion>& region, uint64_t offset, uint64_t run_bytes,
             const RunOffsets& run_offsets, uint64_t num_tokens, uint32_t layer_begin,
             std::optional<uint32_t> layer_end, const std::optional<std::string>& dtype,
             std::vector<uint32_t> token_ids, uint32_t kv_head_begin,
             std::optional<uint32_t> kv_head_end) {
            const Client::AppendArgs a =
                MakeAppendArgs(num_tokens, layer_begin, layer_end, dtype, std::move(token_ids),
                               kv_head_begin, kv_head_end);
            RegionSlice slice{region->id(), offset, 0, run_bytes, ToVector(run_offsets)};
            return FromSequenceInfo(
                CallWithoutGil([&] { return self.c().AppendFromRegion(model, id, a, slice); }));
          },
          py::arg("model"), py::arg("id"), py::arg("region"), py::arg("offset"),
          py::arg("run_bytes"), py::arg("run_offsets"), py::arg("num_tokens"),
          py::arg("layer_begin") = 0, py::arg("layer_end") = py::none(),
          py::arg("dtype") = py::none(), py::arg("token_ids") = std::vector<uint32_t>{},
          py::arg("kv_head_begin") = 0, py::arg("kv_head_end") = py::none())
      .def(
          "put_pages_from_region_runs",
          // Pages under their own extra keys, each appended from runs of a registered region
          // (Client::PutPagesFromRegion); one (status code, message) a page, (0, "") when held.
          [](PyClient& self, const std::string& model, const std::shared_ptr<ShmRegion>& region,
             uint64_t offset, uint64_t run_bytes,
             const std::vector<
                 std::pair<std::vector<std::pair<std::string, py::bytes>>, RunOffsets>>& pages,
             uint64_t num_tokens, std::optional<double> lease_s, int parallel) {
            std::vector<Client::PagePut> puts;
            puts.reserve(pages.size());
            for (const auto& [keys, runs] : pages) {
              puts.push_back({ToExtraKeys(keys),
                              RegionSlice{region->id(), offset, 0, run_bytes, ToVector(runs)}});
            }
            Client::PutPagesArgs args;
            args.num_tokens = num_tokens;
            args.lease = ToDuration(lease_s);
            args.parallel = parallel;
            std::vector<absl::Status> st;
            {
              py::gil_scoped_release release;
              st = self.c().PutPagesFromRegion(model, args, puts);
            }
            std::vector<std::pair<int, std::string>> out;
            out.reserve(st.size());
            for (const absl::Status& s : st)
              out.emplace_back(int(s.code()), std::string(s.message()));
            return out;
          },
          py::arg("model"), py::arg("region"), py::arg("offset"), py::arg("run_bytes"),
          py::arg("pages"), py::arg("num_tokens"), py::arg("lease_s") = py::none(),
          py::arg("parallel") = 2)
      .def(
          "unregister_region",
          [](PyClient& self, const std::shared_ptr<ShmRegion>& r) {
            self.planes().UnregisterRegion(r);
          },
          py::arg("region"));
}

void BindDevicePlanes(py::class_<PyClient>& c) {
  c.def(
       "register_device_region",
       [](PyClient& self, const py::bytes& handle, uint64_t offset, uint64_t size) {
         const std::string h = handle;
         const auto r = CallWithoutGil([&] {
           return self.c().RegisterDeviceRegion(
               absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(h.data()), h.size()), offset,
               size);
         });
         return FromDeviceRegion(r);
       },
       py::arg("handle"), py::arg("offset"), py::arg("size"))
      .def("unregister_device_region",
           [](PyClient& self, uint64_t region_id) {
             CallWithoutGil([&] { return self.c().UnregisterDeviceRegion(region_id); });
           })
      .def(
          "append_from_device",
          [](PyClient& self, const std::string& model, uint64_t id, uint64_t region_id,
             uint64_t offset, uint64_t length, uint64_t num_tokens, uint32_t layer_begin,
             std::optional<uint32_t> layer_end, const std::optional<std::string>& dtype,
             std::vector<uint32_t> token_ids, uint32_t kv_head_begin,
             std::optional<uint32_t> kv_head_end) {
            const Client::AppendArgs a =
                MakeAppendArgs(num_tokens, layer_begin, layer_end, dtype, std::move(token_ids),
                               kv_head_begin, kv_head_end);
            const RegionSlice slice{region_id, offset, length};
            return FromSequenceInfo(
                CallWithoutGil([&] { return self.c().AppendFromDevice(model, id, a, slice); }));
          },
          py::arg("model"), py::arg("id"), py::arg("region_id"), py::arg("offset"),
          py::arg("length"), py::arg("num_tokens"), py::arg("layer_begin") = 0,
          py::arg("layer_end") = py::none(), py::arg("dtype") = py::none(),
          py::arg("token_ids") = std::vector<uint32_t>{}, py::arg("kv_head_begin") = 0,
          py::arg("kv_head_end") = py::none())
      .def(
          "fetch_to_device",
          [](PyClient& self, const std::string& model, uint64_t id, uint64_t region_id,
             uint64_t offset, uint64_t length, uint64_t token_begin,
             std::optional<uint64_t> token_end, uint32_t layer_begin,
             std::optional<uint32_t> layer_end, const std::optional<std::string>& dtype,
             uint32_t kv_head_begin, std::optional<uint32_t> kv_head_end, double wait_s) {
            const Client::FetchArgs a =
                MakeFetchArgs(token_begin, token_end, layer_begin, layer_end, dtype, kv_head_begin,
                              kv_head_end, wait_s);
            const RegionSlice slice{region_id, offset, length};
            return FromFetchResult(
                CallWithoutGil([&] { return self.c().FetchToDevice(model, id, a, slice); }));
          },
          py::arg("model"), py::arg("id"), py::arg("region_id"), py::arg("offset"),
          py::arg("length"), py::arg("token_begin") = 0, py::arg("token_end") = py::none(),
          py::arg("layer_begin") = 0, py::arg("layer_end") = py::none(),
          py::arg("dtype") = py::none(), py::arg("kv_head_begin") = 0,
          py::arg("kv_head_end") = py::none(), py::arg("wait_s") = 0.0)
      .def(
          "fetch_blocks_to_device",
          [](PyClient& self, const std::string& model, const std::vector<py::bytes>& hashes,
             uint64_t region_id, uint64_t offset, uint64_t length, uint32_t layer_begin,
             std::optional<uint32_t> layer_end, const std::optional<std::string>& dtype,
             uint32_t kv_head_begin, std::optional<uint32_t> kv_head_end) {
            const std::vector<BlockHash> hs = ToHashes(hashes);
            const Client::FetchArgs a = MakeFetchArgs(0, std::nullopt, layer_begin, layer_end,
                                                      dtype, kv_head_begin, kv_head_end);
            const RegionSlice slice{region_id, offset, length};
            return FromFetchResult(
                CallWithoutGil([&] { return self.c().FetchBlocksToDevice(model, hs, a, slice); }));
          },
          py::arg("model"), py::arg("hashes"), py::arg("region_id"), py::arg("offset"),
          py::arg("length"), py::arg("layer_begin") = 0, py::arg("layer_end") = py::none(),
          py::arg("dtype") = py::none(), py::arg("kv_head_begin") = 0,
          py::arg("kv_head_end") = py::none())
      .def("nccl_connect",
           [](PyClient& self, int device) {
             CallWithoutGil([&] { return self.c().NcclConnect(device); });
           })
      .def("nccl_disconnect",
           [](PyClient& self) {
             py::gil_scoped_release release;
             self.c().NcclDisconnect();
           })
      .def(
          "append_over_nccl",
          // `ptr`: a device address on the communicator's GPU, `nbytes` long (the Python layer
          // takes it from a CUDA tensor).
          [](PyClient& self, const std::string& model, uint64_t id, uintptr_t ptr, uint64_t nbytes,
             uint64_t num_tokens, uint32_t layer_begin, std::optional<uint32_t> layer_end,
             const std::optional<std::string>& dtype, std::vector<uint32_t> token_ids,
             uint32_t kv_head_begin, std::optional<uint32_t> kv_head_end) {
            const Client::AppendArgs a =
                MakeAppendArgs(num_tokens, layer_begin, layer_end, dtype, std::move(token_ids),
                               kv_head_begin, kv_head_end);
            return FromSequenceInfo(CallWithoutGil([&] {
              return self.c().AppendOverNccl(model, id, a, reinterpret_cast<const void*>(ptr),
                                             nbytes);
            }));
          },
          py::arg("model"), py::arg("id"), py::arg("ptr"), py::arg("nbytes"), py::arg("num_tokens"),
          py::arg("layer_begin") = 0, py::arg("layer_end") = py::none(),
          py::arg("dtype") = py::none(), py::arg("token_ids") = std::vector<uint32_t>{},
          py::arg("kv_head_begin") = 0, py::arg("kv_head_end") = py::none())
      .def(
          "fetch_over_nccl",
          [](PyClient& self, const std::string& model, uint64_t id, uintptr_t ptr,
             uint64_t capacity, uint64_t token_begin, std::optional<uint64_t> token_end,
             uint32_t layer_begin, std::optional<uint32_t> layer_end,
             const std::optional<std::string>& dtype, uint32_t kv_head_begin,
             std::optional<uint32_t> kv_head_end) {
            const Client::FetchArgs a =
                MakeFetchArgs(token_begin, token_end, layer_begin, layer_end, dtype, kv_head_begin,
                              kv_head_end, /*wait_s=*/0.0);
            return FromFetchResult(CallWithoutGil([&] {
              return self.c().FetchOverNccl(model, id, a, reinterpret_cast<void*>(ptr), capacity);
            }));
          },
          py::arg("model"), py::arg("id"), py::arg("ptr"), py::arg("capacity"),
          py::arg("token_begin") = 0, py::arg("token_end") = py::none(), py::arg("layer_begin") = 0,
          py::arg("layer_end") = py::none(), py::arg("dtype") = py::none(),
          py::arg("kv_head_begin") = 0, py::arg("kv_head_end") = py::none());
}

}  // namespace kvbank::python
