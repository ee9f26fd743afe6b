// kvbank._kvbank.Client (PyClient): one connection to kvbankd through a kvbank::PlaneRouter, and
// the functions that bind its methods, one topic each (python/src/client_*.cc), called from
// module.cc.
#ifndef KVBANK_PYTHON_SRC_PY_CLIENT_H_
#define KVBANK_PYTHON_SRC_PY_CLIENT_H_

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "kvbank/client.h"
#include "kvbank/plane_router.h"

namespace kvbank::python {

// Thread-safe like kvbank::Client: calls from several Python threads run concurrently (each
// releases the GIL for its RPC). Payloads of append, fetch_into and fetch_blocks_into move on
// the plane the PlaneRouter picks; every other call goes to the Client under it.
class PyClient {
 public:
  // shm: "auto" (the server's shared-memory socket when GetServerInfo names one this host
  // has), "" (off) or a socket path. Payloads of at least shm_min_bytes not already in a
  // registered region go through staging regions of at most shm_staging_bytes in all.
  // REQUIRES: the GIL is held (it is released while connecting).
  PyClient(const std::string& target, const std::string& token, double deadline_s,
           double stream_deadline_s, uint64_t chunk_bytes, std::optional<pybind11::dict> tls,
           const std::string& shm, uint64_t shm_min_bytes, uint64_t shm_staging_bytes);

  Client& c() { return router_->client(); }
  PlaneRouter& planes() { return *router_; }

 private:
  std::unique_ptr<PlaneRouter> router_;
};

// Each adds one topic's methods to class Client.
void BindAdmin(pybind11::class_<PyClient>& c);         // models, server info, stats, health
void BindSequences(pybind11::class_<PyClient>& c);     // create, fork, truncate, free, leases
void BindTransfers(pybind11::class_<PyClient>& c);     // append, fetch, their tensor forms, attend
void BindPrefix(pybind11::class_<PyClient>& c);        // match, fetch by hash, pin, root, watch
void BindShmPlane(pybind11::class_<PyClient>& c);      // regions and the planes' counters
void BindDevicePlanes(pybind11::class_<PyClient>& c);  // CUDA IPC regions, NCCL
// Adds class Region (a registered shared-memory region, buffer protocol) to the module.
void BindRegion(pybind11::module_& m);

}  // namespace kvbank::python

#endif  // KVBANK_PYTHON_SRC_PY_CLIENT_H_
