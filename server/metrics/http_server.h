// /metrics over HTTP on a port of its own (civetweb, Debian's libcivetweb-dev): GET (and HEAD)
// /metrics answer the registry's text exposition, read at that moment; every other path is 404,
// every other method on /metrics 405.
#ifndef KVBANK_SERVER_METRICS_HTTP_SERVER_H_
#define KVBANK_SERVER_METRICS_HTTP_SERVER_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/metrics/registry.h"

struct mg_context;
struct mg_connection;

namespace kvbank::metrics {

// Thread-safe: civetweb's worker threads serve the requests; the owner starts and destroys it.
class HttpServer {
 public:
  // Binds `address` ("host:port", "[v6]:port"; port 0 picks one) and serves `registry` (which
  // must outlive this) on 2 worker threads. INVALID_ARGUMENT for an address that is not
  // host:port, UNAVAILABLE naming the address when it cannot be bound (a port in use).
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(const std::string& address,
                                                           const Registry* registry);
  // Stops serving: waits for the requests in flight, closes the port. NOTE: takes up to 2 s once
  // requests were served (civetweb's poll interval).
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  int port() const { return port_; }
  // Connections a worker holds now: accepted and not yet closed (a request being read or
  // answered, or a kept-alive connection waiting for the next one).
  uint64_t open_connections() const { return open_.load(std::memory_order_acquire); }
  // "http://host:port/metrics" with the port bound.
  const std::string& url() const { return url_; }

 private:
  HttpServer() = default;
  static int HandleMetrics(mg_connection* conn, void* self);
  static int ConnectionOpened(const mg_connection* conn, void** conn_data);
  static void ConnectionClosed(const mg_connection* conn);

  const Registry* registry_ = nullptr;
  mg_context* ctx_ = nullptr;
  int port_ = 0;
  std::string url_;
  std::atomic<uint64_t> open_{0};
};

// Writes `port` and a line feed to `path` through `path`.tmp and a rename, so that a reader
// never sees a half-written file. INTERNAL naming the file when it cannot be written.
absl::Status WritePortFile(const std::string& path, int port);

}  // namespace kvbank::metrics

#endif  // KVBANK_SERVER_METRICS_HTTP_SERVER_H_
