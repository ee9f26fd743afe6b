// kvbank._kvbank: the C++ SDK (kvbank::Client, layouts, prefix hashes) for Python.
//
// Thin on purpose: the Pythonic surface (keyword arguments, dicts, typed exceptions, futures)
// lives in kvbank/*.py; this module moves bytes and calls convert.h to convert types (the same
// converters serve the Fleet in fleet.cc). Every RPC runs with the GIL
// released, so other Python threads run while a call waits on the network. Payloads go through
// the buffer protocol in both directions: Append reads the caller's buffer in place, FetchInto
// writes straight into it, and Fetch hands the SDK's vector to numpy without a copy.
//
// Errors: a non-OK absl::Status raises through convert.h's RaiseStatus, whose translator
// (registered below) turns it into kvbank.Error's subclass for the gRPC code (kvbank/_errors.py).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kvbank/client.h"
#include "kvbank/layout.h"
#include "kvbank/prefix_hash.h"
#include "src/convert.h"
#include "src/fleet.h"

namespace py = pybind11;

namespace kvbank::python {
namespace {

// One connection to kvbankd. Thread-safe like kvbank::Client: calls from several Python threads
// run concurrently (each releases the GIL for its RPC).
class PyClient {
 public:
  // shm: "auto" (the server's shared-memory socket when GetServerInfo names one this host
  // has), "" (off) or a socket path. Payloads of at least shm_min_bytes not already in a
  // registered region go through staging regions of at most shm_staging_bytes in all.
  PyClient(const std::string& target, const std::string& token, double deadline_s,
           double stream_deadline_s, uint64_t chunk_bytes, std::optional<py::dict> tls,
           const std::string& shm, uint64_t shm_min_bytes, uint64_t shm_staging_bytes)
      : shm_min_bytes_(shm_min_bytes), shm_staging_bytes_(shm_staging_bytes) {
    ClientOptions o;
    if (!(deadline_s > 0) || !(stream_deadline_s > 0))
      RaiseInvalid("deadlines must be > 0 seconds");
    if (chunk_bytes == 0) RaiseInvalid("chunk_bytes must be > 0");
    o.call_deadline = absl::Seconds(deadline_s);
    o.stream_deadline = absl::Seconds(stream_deadline_s);
    o.chunk_bytes = chunk_bytes;
    o.bearer_token = token;
    if (tls.has_value()) o.tls = TlsOptionsFromDict(*tls);
    absl::StatusOr<std::unique_ptr<Client>> c;
    {
      py::gil_scoped_release release;
      c = Client::Connect(target, o);
      std::string socket = shm == "auto" ? "" : shm;
      if (c.ok() && shm == "auto") {
        // A socket path that exists here is this host's (a remote server's path would not be
        // ours); should it be another kvbankd's, registering fails and the plane is dropped.
        // The server must be on this host (its boot id is this one's); the socket's owner is
        // checked when a region is handed over (SO_PEERCRED: this user or root).
        auto info = (*c)->GetServerInfo();
        if (info.ok() && info->OnThisHost() && !info->shm_socket.empty() &&
            access(info->shm_socket.c_str(), R_OK | W_OK) == 0) {
          socket = info->shm_socket;
        }
      }
      if (c.ok() && !socket.empty()) {
        o.shm_socket = socket;
        c = Client::Connect(target, o);
        shm_socket_ = socket;
      }
    }
    client_ = Unwrap(std::move(c));
    shm_on_.store(!shm_socket_.empty());
  }

  // ---- data planes ---------------------------------------------------------------------------
  // Each payload moves on the shared-memory plane when it can (its bytes lie in a region this
  // client registered, or a staging region takes them: one memcpy on this side), else on gRPC.
  // A plane that fails to register is dropped for good. Called with the GIL released.

  struct PlaneCount {
    std::atomic<uint64_t> calls{0}, bytes{0};
  };
  enum Plane { kShm = 0, kShmStaged = 1, kGrpc = 2 };

  absl::StatusOr<Client::SequenceInfo> Append(const std::string& model, uint64_t id,
                                              const Client::AppendArgs& a,
                                              absl::Span<const uint8_t> bytes) {
    if (auto slice = InRegion(bytes.data(), bytes.size())) {
      return Counted(kShm, bytes.size(), c().AppendFromRegion(model, id, a, *slice));
    }
    if (std::unique_ptr<ShmRegion> st = TakeStaging(bytes.size())) {
      std::memcpy(st->data(), bytes.data(), bytes.size());
      auto r = c().AppendFromRegion(model, id, a, st->Slice(0, bytes.size()));
      GiveBack(std::move(st));
      return Counted(kShmStaged, bytes.size(), std::move(r));
    }
    return Counted(kGrpc, bytes.size(), c().Append(model, id, a, bytes));
  }

  // fetch(hashes == nullptr) or fetch_blocks into `out`.
  absl::StatusOr<Client::FetchResult> FetchInto(const std::string& model, uint64_t id,
                                                const std::vector<BlockHash>* hashes,
                                                const Client::FetchArgs& a,
                                                absl::Span<uint8_t> out) {
    auto into_region = [&](const RegionSlice& slice) {
      return hashes != nullptr ? c().FetchBlocksToRegion(model, *hashes, a, slice)
                               : c().FetchToRegion(model, id, a, slice);
    };
    // A payload larger than `out` is refused by the region path as INVALID_ARGUMENT naming
    // dest.length; the gRPC path then answers what it always does (OUT_OF_RANGE).
    auto too_small = [](const absl::Status& s) {
      return s.code() == absl::StatusCode::kInvalidArgument &&
             absl::StrContains(s.message(), "dest.length");
    };
    // (The SDK bounds the server's payload_bytes by the slice: a larger one is an error.)
    if (auto slice = InRegion(out.data(), out.size())) {
      auto r = into_region(*slice);
      if (!too_small(r.status())) return Counted(kShm, r.ok() ? r->payload_bytes : 0, r);
    } else if (std::unique_ptr<ShmRegion> st = TakeStaging(out.size())) {
      auto r = into_region(st->Slice(0, out.size()));
      if (r.ok() && r->payload_bytes <= out.size()) {
        std::memcpy(out.data(), st->data(), r->payload_bytes);
      }
      // NOTE: a staging region whose call failed (a deadline, a cancel) may still be written by
      // a copy the server started before the call ended: it is never used again (dropped and
      // unregistered here), so no later call reads those bytes.
      if (r.ok() || too_small(r.status())) {
        GiveBack(std::move(st));
      } else {
        Drop(std::move(st));
      }
      if (!too_small(r.status())) return Counted(kShmStaged, r.ok() ? r->payload_bytes : 0, r);
    }
    absl::StatusOr<Client::FetchResult> r;
    if (hashes == nullptr) {
      r = c().FetchInto(model, id, a, out);
    } else {
      r = c().FetchBlocks(model, *hashes, a);
      if (r.ok()) {
        if (r->payload.size() > out.size()) {
          r = absl::OutOfRangeError(absl::StrCat("the payload has ", r->payload.size(),
                                                 " bytes; the buffer holds ", out.size()));
        } else {
          std::memcpy(out.data(), r->payload.data(), r->payload.size());
          r->payload_bytes = r->payload.size();
          r->payload.clear();
        }
      }
    }
    return Counted(kGrpc, r.ok() ? r->payload_bytes : 0, std::move(r));
  }

  // A region of `size` bytes this client registers; buffers inside it move without a copy.
  std::shared_ptr<ShmRegion> RegisterRegion(uint64_t size) {
    if (!shm_on_.load()) {
      Check(absl::FailedPreconditionError(
          "no shared-memory plane: the server names no --shm-socket this host has"));
    }
    std::unique_ptr<ShmRegion> r = Unwrap([&] {
      py::gil_scoped_release release;
      return c().RegisterRegion(size);
    }());
    std::shared_ptr<ShmRegion> shared = std::move(r);
    absl::MutexLock lock(&regions_mu_);
    regions_.push_back(shared);
    return shared;
  }
  void UnregisterRegion(const std::shared_ptr<ShmRegion>& r) {
    absl::MutexLock lock(&regions_mu_);
    regions_.erase(std::remove(regions_.begin(), regions_.end(), r), regions_.end());
  }

  std::string data_plane() const { return shm_on_.load() ? "shm" : "grpc"; }
  const std::string& shm_socket() const { return shm_socket_; }
  py::dict PlaneStats() const {
    py::dict d;
    const char* names[] = {"shm", "shm_staged", "grpc"};
    for (int p = 0; p < 3; ++p) {
      py::dict e;
      e["calls"] = counts_[p].calls.load();
      e["bytes"] = counts_[p].bytes.load();
      if (p == kShmStaged) {
        absl::MutexLock lock(&staging_mu_);
        e["dropped"] = staging_dropped_;  // staging regions let go after a failed call
      }
      d[names[p]] = e;
    }
    return d;
  }

  Client& c() { return *client_; }

 private:
  template <typename R>
  R Counted(Plane p, uint64_t bytes, R r) {
    if (r.ok()) {
      counts_[p].calls.fetch_add(1, std::memory_order_relaxed);
      counts_[p].bytes.fetch_add(bytes, std::memory_order_relaxed);
    }
    return r;
  }
  std::optional<RegionSlice> InRegion(const uint8_t* p, uint64_t n) {
    if (n == 0) return std::nullopt;
    absl::MutexLock lock(&regions_mu_);
    for (const auto& r : regions_) {
      if (p >= r->data() && p + n <= r->data() + r->size()) {
        return r->Slice(static_cast<uint64_t>(p - r->data()), n);
      }
    }
    return std::nullopt;
  }
  // A staging region of at least `n` bytes, or null (small payload, plane off, or the staging
  // budget spent).
  std::unique_ptr<ShmRegion> TakeStaging(uint64_t n) {
    if (n < shm_min_bytes_ || !shm_on_.load()) return nullptr;
    {
      absl::MutexLock lock(&staging_mu_);
      for (auto it = free_staging_.begin(); it != free_staging_.end(); ++it) {
        if ((*it)->size() >= n) {
          std::unique_ptr<ShmRegion> r = std::move(*it);
          free_staging_.erase(it);
          return r;
        }
      }
      const uint64_t size =
          std::max<uint64_t>((n + (1 << 20) - 1) & ~uint64_t{(1 << 20) - 1}, uint64_t{8} << 20);
      if (staging_bytes_ + size > shm_staging_bytes_) return nullptr;
      staging_bytes_ += size;
      n = size;
    }
    auto r = c().RegisterRegion(n);
    if (!r.ok()) {
      // The socket is not this server's, or the plane went away: gRPC from now on.
      shm_on_.store(false);
      absl::MutexLock lock(&staging_mu_);
      staging_bytes_ -= n;
      return nullptr;
    }
    return *std::move(r);
  }
  void GiveBack(std::unique_ptr<ShmRegion> r) {
    absl::MutexLock lock(&staging_mu_);
    free_staging_.push_back(std::move(r));
  }
  // A staging region that is never used again: unregistered (its connection closes) and
  // unmapped here; its budget is free for a new one.
  void Drop(std::unique_ptr<ShmRegion> r) {
    const uint64_t size = r->size();
    r.reset();
    absl::MutexLock lock(&staging_mu_);
    staging_bytes_ -= std::min(staging_bytes_, size);
    ++staging_dropped_;
  }

  std::unique_ptr<Client> client_;
  std::string shm_socket_;  // empty: no shared-memory plane
  std::atomic<bool> shm_on_{false};
  const uint64_t shm_min_bytes_, shm_staging_bytes_;
  absl::Mutex regions_mu_;
  std::vector<std::shared_ptr<ShmRegion>> regions_ ABSL_GUARDED_BY(regions_mu_);
  mutable absl::Mutex staging_mu_;
  std::vector<std::unique_ptr<ShmRegion>> free_staging_ ABSL_GUARDED_BY(staging_mu_);
  uint64_t staging_bytes_ ABSL_GUARDED_BY(staging_mu_) = 0;
  uint64_t staging_dropped_ ABSL_GUARDED_BY(staging_mu_) = 0;  // after a failed call
  PlaneCount counts_[3];
};

void BindClient(py::module_& m) {
  // A registered shared-memory region: writable bytes (buffer protocol) that payloads move
  // through without a copy on this side.
  py::class_<ShmRegion, std::shared_ptr<ShmRegion>>(m, "Region", py::buffer_protocol())
      .def_buffer([](ShmRegion& r) {
        return py::buffer_info(r.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(r.size())}, {py::ssize_t{1}});
      })
      .def_property_readonly("id", &ShmRegion::id)
      .def_property_readonly("size", &ShmRegion::size);
  py::class_<PyClient>(m, "Client")
      .def(py::init<const std::string&, const std::string&, double, double, uint64_t,
                    std::optional<py::dict>, const std::string&, uint64_t, uint64_t>(),
           py::arg("target"), py::arg("token") = "", py::arg("deadline_s") = 30.0,
           py::arg("stream_deadline_s") = 600.0, py::arg("chunk_bytes") = uint64_t{1} << 20,
           py::arg("tls") = py::none(), py::arg("shm") = "auto",
           py::arg("shm_min_bytes") = uint64_t{1} << 20,
           py::arg("shm_staging_bytes") = uint64_t{1} << 30)
      .def_property_readonly("data_plane", &PyClient::data_plane)
      .def_property_readonly("shm_socket", &PyClient::shm_socket)
      .def("plane_stats", &PyClient::PlaneStats)
      .def("server_info",
           [](PyClient& self) {
             const Client::ServerInfo info =
                 CallWithoutGil([&] { return self.c().GetServerInfo(); });
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
      .def("register_region", &PyClient::RegisterRegion, py::arg("size"))
      .def("unregister_region", &PyClient::UnregisterRegion, py::arg("region"))
      .def(
          "ensure_model",
          [](PyClient& self, const py::dict& layout, uint64_t pool_bytes) {
            const ModelLayout m = LayoutFromDict(layout);
            return ModelInfoToDict(CallWithoutGil([&] { return self.c().EnsureModel(m, pool_bytes); }));
          },
          py::arg("layout"), py::arg("pool_bytes") = 0)
      .def(
          "ensure_preset",
          [](PyClient& self, const std::string& name, const std::string& preset,
             const std::optional<std::string>& storage, uint64_t pool_bytes,
             uint32_t block_tokens) {
            const std::optional<DType> st = ToDType(storage);
            return ModelInfoToDict(CallWithoutGil(
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
               out.append(ModelInfoToDict(i));
             }
             return out;
           })
      .def("get_model",
           [](PyClient& self, const std::string& name) {
             return ModelInfoToDict(CallWithoutGil([&] { return self.c().GetModel(name); }));
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
          "create_sequence",
          [](PyClient& self, const std::string& model, std::optional<double> lease_s,
             std::vector<uint32_t> prompt, std::string cache_salt,
             const std::vector<std::pair<std::string, py::bytes>>& extra_keys,
             std::optional<uint32_t> priority, uint32_t retention_kind, uint32_t window,
             uint32_t sinks, uint32_t budget) {
            const Client::CreateArgs a =
                MakeCreateArgs(lease_s, std::move(prompt), std::move(cache_salt), extra_keys, priority,
                               retention_kind, window, sinks, budget);
            return SequenceToDict(CallWithoutGil([&] { return self.c().CreateSequence(model, a); }));
          },
          py::arg("model"), py::arg("lease_s") = py::none(),
          py::arg("prompt") = std::vector<uint32_t>{}, py::arg("cache_salt") = "",
          py::arg("extra_keys") = std::vector<std::pair<std::string, py::bytes>>{},
          py::arg("priority") = py::none(), py::arg("retention_kind") = 0, py::arg("window") = 0,
          py::arg("sinks") = 0, py::arg("budget") = 0)
      .def(
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
            return SequenceToDict(CallWithoutGil([&] { return self.Append(model, id, a, bytes); }));
          },
          py::arg("model"), py::arg("id"), py::arg("payload"), py::arg("num_tokens"),
          py::arg("layer_begin") = 0, py::arg("layer_end") = py::none(),
          py::arg("dtype") = py::none(), py::arg("token_ids") = std::vector<uint32_t>{},
          py::arg("kv_head_begin") = 0, py::arg("kv_head_end") = py::none())
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
            return SequenceToDict(
                CallWithoutGil([&] { return self.c().AppendTensors(model, id, a, kbytes, vbytes); }));
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
            py::dict meta = FetchToDict(r);
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
            return FetchToDict(
                CallWithoutGil([&] { return self.FetchInto(model, id, nullptr, a, bytes); }));
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
          "fork",
          [](PyClient& self, const std::string& model, uint64_t id, std::optional<double> lease_s) {
            const auto lease = ToDuration(lease_s);
            return SequenceToDict(CallWithoutGil([&] { return self.c().Fork(model, id, lease); }));
          },
          py::arg("model"), py::arg("id"), py::arg("lease_s") = py::none())
      .def("truncate",
           [](PyClient& self, const std::string& model, uint64_t id, uint64_t num_tokens) {
             return SequenceToDict(
                 CallWithoutGil([&] { return self.c().Truncate(model, id, num_tokens); }));
           })
      .def("free", [](PyClient& self, const std::string& model,
                      uint64_t id) { return CallWithoutGil([&] { return self.c().Free(model, id); }); })
      .def("renew_lease",
           [](PyClient& self, const std::string& model, uint64_t id) {
             return SequenceToDict(CallWithoutGil([&] { return self.c().RenewLease(model, id); }));
           })
      .def("get_sequence",
           [](PyClient& self, const std::string& model, uint64_t id) {
             return SequenceToDict(CallWithoutGil([&] { return self.c().GetSequence(model, id); }));
           })
      .def("match",
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
            Client::FetchResult r = CallWithoutGil([&] { return self.c().FetchBlocks(model, hs, a); });
            py::dict meta = FetchToDict(r);
            return py::make_tuple(meta, ToArray(std::move(r.payload)));
          },
          py::arg("model"), py::arg("hashes"), py::arg("layer_begin") = 0,
          py::arg("layer_end") = py::none(), py::arg("dtype") = py::none(),
          py::arg("kv_head_begin") = 0, py::arg("kv_head_end") = py::none())
      .def(
          "register_device_region",
          [](PyClient& self, const py::bytes& handle, uint64_t offset, uint64_t size) {
            const std::string h = handle;
            const auto r = CallWithoutGil([&] {
              return self.c().RegisterDeviceRegion(
                  absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(h.data()), h.size()),
                  offset, size);
            });
            return DeviceRegionToDict(r);
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
            return SequenceToDict(
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
            const Client::FetchArgs a = MakeFetchArgs(token_begin, token_end, layer_begin,
                                                      layer_end, dtype, kv_head_begin,
                                                      kv_head_end, wait_s);
            const RegionSlice slice{region_id, offset, length};
            return FetchToDict(
                CallWithoutGil([&] { return self.c().FetchToDevice(model, id, a, slice); }));
          },
          py::arg("model"), py::arg("id"), py::arg("region_id"), py::arg("offset"),
          py::arg("length"), py::arg("token_begin") = 0, py::arg("token_end") = py::none(),
          py::arg("layer_begin") = 0, py::arg("layer_end") = py::none(),
          py::arg("dtype") = py::none(), py::arg("kv_head_begin") = 0,
          py::arg("kv_head_end") = py::none(), py::arg("wait_s") = 0.0)
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
          [](PyClient& self, const std::string& model, uint64_t id, uintptr_t ptr,
             uint64_t nbytes, uint64_t num_tokens, uint32_t layer_begin,
             std::optional<uint32_t> layer_end, const std::optional<std::string>& dtype,
             std::vector<uint32_t> token_ids, uint32_t kv_head_begin,
             std::optional<uint32_t> kv_head_end) {
            const Client::AppendArgs a =
                MakeAppendArgs(num_tokens, layer_begin, layer_end, dtype, std::move(token_ids),
                               kv_head_begin, kv_head_end);
            return SequenceToDict(CallWithoutGil([&] {
              return self.c().AppendOverNccl(model, id, a, reinterpret_cast<const void*>(ptr),
                                             nbytes);
            }));
          },
          py::arg("model"), py::arg("id"), py::arg("ptr"), py::arg("nbytes"),
          py::arg("num_tokens"), py::arg("layer_begin") = 0, py::arg("layer_end") = py::none(),
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
                MakeFetchArgs(token_begin, token_end, layer_begin, layer_end, dtype,
                              kv_head_begin, kv_head_end, /*wait_s=*/0.0);
            return FetchToDict(CallWithoutGil([&] {
              return self.c().FetchOverNccl(model, id, a, reinterpret_cast<void*>(ptr),
                                            capacity);
            }));
          },
          py::arg("model"), py::arg("id"), py::arg("ptr"), py::arg("capacity"),
          py::arg("token_begin") = 0, py::arg("token_end") = py::none(),
          py::arg("layer_begin") = 0, py::arg("layer_end") = py::none(),
          py::arg("dtype") = py::none(), py::arg("kv_head_begin") = 0,
          py::arg("kv_head_end") = py::none())
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
            return FetchToDict(
                CallWithoutGil([&] { return self.c().FetchBlocksToDevice(model, hs, a, slice); }));
          },
          py::arg("model"), py::arg("hashes"), py::arg("region_id"), py::arg("offset"),
          py::arg("length"), py::arg("layer_begin") = 0, py::arg("layer_end") = py::none(),
          py::arg("dtype") = py::none(), py::arg("kv_head_begin") = 0,
          py::arg("kv_head_end") = py::none())
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
            return FetchToDict(CallWithoutGil([&] { return self.FetchInto(model, 0, &hs, a, bytes); }));
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
            const auto r = CallWithoutGil([&] { return self.c().GetPrefixRoot(model, cache_salt); });
            return PrefixRootToDict(r);
          },
          py::arg("model"), py::arg("cache_salt") = "")
      .def(
          "watch",
          // on_batch(events: list[dict], last_sequence: int) -> bool runs on the calling thread
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
                                     for (const auto& e : events) batch.append(EventToDict(e));
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
          py::arg("on_batch"))
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
          py::arg("window") = 0, py::arg("sinks") = 0)
      .def(
          "check_serving",
          [](PyClient& self, double deadline_s) {
            CallWithoutGil([&] { return self.c().CheckServing(absl::Seconds(deadline_s)); });
          },
          py::arg("deadline_s"));
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
