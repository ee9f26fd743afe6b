#include "server/metrics/http_server.h"

#include <civetweb.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "server/metrics/text_format.h"

namespace kvbank::metrics {
namespace {

// "host:port" with a numeric port in [0, 65535] and a host, or INVALID_ARGUMENT.
absl::Status CheckAddress(const std::string& address) {
  const size_t colon = address.rfind(':');
  int port = -1;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 0 || port > 65535 ||
      address.substr(colon + 1).find_first_not_of("0123456789") != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", address, "' is not host:port (e.g. 0.0.0.0:9400, 127.0.0.1:0)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(const std::string& address,
                                                              const Registry* registry) {
  if (absl::Status s = CheckAddress(address); !s.ok()) return s;
  std::unique_ptr<HttpServer> server(new HttpServer());
  server->registry_ = registry;
  mg_init_library(0);  // reference counted; mg_exit_library is left to process exit
  // A scrape every few seconds needs little: two workers, no files served (no document_root),
  // requests that stall are dropped.
  const char* options[] = {"listening_ports",    address.c_str(), "num_threads", "2",
                           "request_timeout_ms", "10000",         nullptr};
  mg_callbacks callbacks;
  std::memset(&callbacks, 0, sizeof(callbacks));
  callbacks.init_connection = &HttpServer::ConnectionOpened;
  callbacks.connection_closed = &HttpServer::ConnectionClosed;
  mg_init_data init;
  init.callbacks = &callbacks;
  init.user_data = server.get();
  init.configuration_options = options;
  char text[256] = "";
  unsigned code = 0;
  mg_error_data error;
  error.code = &code;
  error.text = text;
  error.text_buffer_size = sizeof(text);
  server->ctx_ = mg_start2(&init, &error);
  if (server->ctx_ == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot serve metrics on ", address, ": ",
                                               text[0] != '\0' ? text : "civetweb failed"));
  }
  mg_set_request_handler(server->ctx_, "/metrics$", &HttpServer::HandleMetrics, server.get());
  mg_server_port ports[4];
  const int n = mg_get_server_ports(server->ctx_, 4, ports);
  if (n < 1) return absl::InternalError(absl::StrCat("civetweb bound no port for ", address));
  server->port_ = ports[0].port;
  server->url_ = absl::StrCat("http://", address.substr(0, address.rfind(':')), ":", server->port_,
                              "/metrics");
  return server;
}

int HttpServer::ConnectionOpened(const mg_connection* conn, void** /*conn_data*/) {
  static_cast<HttpServer*>(mg_get_user_data(mg_get_context(conn)))
      ->open_.fetch_add(1, std::memory_order_acq_rel);
  return 0;
}

void HttpServer::ConnectionClosed(const mg_connection* conn) {
  static_cast<HttpServer*>(mg_get_user_data(mg_get_context(conn)))
      ->open_.fetch_sub(1, std::memory_order_acq_rel);
}

HttpServer::~HttpServer() {
  if (ctx_ != nullptr) mg_stop(ctx_);
}

int HttpServer::HandleMetrics(mg_connection* conn, void* self) {
  const mg_request_info* info = mg_get_request_info(conn);
  const bool head = std::strcmp(info->request_method, "HEAD") == 0;
  if (!head && std::strcmp(info->request_method, "GET") != 0) {
    mg_printf(conn,
              "HTTP/1.1 405 Method Not Allowed\r\nAllow: GET, HEAD\r\nContent-Length: 0\r\n"
              "Connection: close\r\n\r\n");
    return 405;
  }
  const auto* server = static_cast<const HttpServer*>(self);
  const std::string body = FormatText(server->registry_->Collect());
  mg_printf(conn,
            "HTTP/1.1 200 OK\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
            "Cache-Control: no-store\r\nConnection: close\r\n\r\n",
            kTextContentType, body.size());
  if (!head) mg_write(conn, body.data(), body.size());
  return 200;
}

absl::Status WritePortFile(const std::string& path, int port) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    out << port << "\n";
    if (!out.flush()) return absl::InternalError(absl::StrCat("cannot write ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(
        absl::StrCat("cannot rename ", tmp, " to ", path, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace kvbank::metrics
