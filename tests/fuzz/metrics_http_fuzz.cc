// kvbankd's /metrics HTTP server (metrics::HttpServer over civetweb) over fuzzer-chosen request
// bytes on a TCP connection, sent in one piece or two. Properties: the server never crashes; an
// answer, when one comes, is an HTTP/1.x status line, 200 only for a GET (or HEAD);
// and a well-formed scrape still answers 200 with the registry's exposition afterwards (checked
// now and then).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "server/metrics/http_server.h"
#include "server/metrics/registry.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

using kvbank::metrics::HttpServer;
using kvbank::metrics::Registry;

struct Served {
  Registry registry;
  std::unique_ptr<HttpServer> http;
};

Served& Server() {
  static Served* s = [] {
    auto* served = new Served();
    auto c = served->registry.AddCounter("kvbank_fuzz_total", "A counter for the fuzzer.", {});
    if (!c.ok()) std::abort();
    auto http = HttpServer::Start("127.0.0.1:0", &served->registry);
    if (!http.ok()) std::abort();
    served->http = *std::move(http);
    return served;
  }();
  return *s;
}

// Sends `first` then `second` (the write side closed after), and reads the answer until the
// server closes or goes quiet.
std::string RoundTrip(int port, const std::string& first, const std::string& second) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(uint16_t(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd < 0 || connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) std::abort();
  timeval t{2, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &t, sizeof(t));
  for (const std::string* piece : {&first, &second}) {
    if (!piece->empty()) (void)send(fd, piece->data(), piece->size(), MSG_NOSIGNAL);
  }
  shutdown(fd, SHUT_WR);
  std::string got;
  char buf[4096];
  for (;;) {
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    got.append(buf, size_t(n));
  }
  close(fd);
  return got;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Served& s = Server();
  FuzzedDataProvider in(data, size);
  const size_t split = in.ConsumeIntegralInRange<size_t>(0, 512);
  const std::string request = in.ConsumeRemainingBytesAsString();
  const size_t cut = std::min(split, request.size());
  const std::string answer = RoundTrip(s.http->port(), request.substr(0, cut), request.substr(cut));
  if (!answer.empty()) {
    FUZZ_CHECK(absl::StartsWith(answer, "HTTP/1."));
    if (absl::StartsWith(answer.substr(8), " 200")) {
      // (civetweb skips blank lines before the request line, as HTTP allows.)
      const size_t line = request.find_first_not_of("\r\n \t");
      const std::string rest = line == std::string::npos ? "" : request.substr(line);
      FUZZ_CHECK(absl::StartsWith(rest, "GET") || absl::StartsWith(rest, "HEAD"));
    }
  }
  static int round = 0;
  if (++round % 64 == 0) {
    const std::string scrape = RoundTrip(
        s.http->port(), "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", "");
    FUZZ_CHECK(absl::StartsWith(scrape, "HTTP/1.1 200"));
    FUZZ_CHECK(absl::StrContains(scrape, "kvbank_fuzz_total 0"));
  }
  return 0;
}
