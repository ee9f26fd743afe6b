// kvbankd's /metrics HTTP server (metrics::HttpServer over civetweb) over fuzzer-chosen request
// bytes on a TCP connection, sent in one piece or two, one connection at a time. Properties: the
// server never crashes; every connection is closed soon after its client resets it; an answer,
// when one comes, starts an HTTP status line; the exposition is served only to a GET (or HEAD)
// request; and a well-formed scrape still answers 200 with the registry's exposition afterwards
// (checked now and then).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/metrics/http_server.h"
#include "server/metrics/registry.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

using kvbank::metrics::HttpServer;
using kvbank::metrics::Registry;

struct Served {
  Registry registry;
  std::atomic<uint64_t> scrapes{0};  // the registry was read: the handler served the exposition
  std::unique_ptr<HttpServer> http;
};

Served& Server() {
  static Served* s = [] {
    auto* served = new Served();
    auto c = served->registry.AddCounter("kvbank_fuzz_total", "A counter for the fuzzer.", {});
    if (!c.ok() || !(*c)->WithLabels({}).ok()) std::abort();  // its one sample, at 0
    served->registry.AddCollector(
        [served](std::vector<kvbank::metrics::FamilySnapshot>*) { ++served->scrapes; });
    auto http = HttpServer::Start("127.0.0.1:0", &served->registry);
    if (!http.ok()) std::abort();
    served->http = *std::move(http);
    return served;
  }();
  return *s;
}

// Sends `first` then `second` (the write side closed after), and reads the answer until the
// server closes or stays quiet for `quiet_s` seconds.
std::string RoundTrip(int port, const std::string& first, const std::string& second,
                      int quiet_s = 2, int* last_errno = nullptr) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(uint16_t(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  // Hundreds of thousands of connections: a refused connect (ephemeral ports held in TIME_WAIT)
  // is tried again, and each connection ends with a reset (SO_LINGER 0), holding no port.
  int fd = -1;
  for (int attempt = 0; fd < 0; ++attempt) {
    fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd >= 0 && connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      close(fd);
      fd = -1;
    }
    if (fd < 0) {
      FUZZ_CHECK(attempt < 500);  // 5 s: the server stopped accepting
      usleep(10000);
    }
  }
  const linger reset{1, 0};
  setsockopt(fd, SOL_SOCKET, SO_LINGER, &reset, sizeof(reset));
  timeval t{quiet_s, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &t, sizeof(t));
  for (const std::string* piece : {&first, &second}) {
    if (!piece->empty()) (void)send(fd, piece->data(), piece->size(), MSG_NOSIGNAL);
  }
  shutdown(fd, SHUT_WR);
  std::string got;
  char buf[4096];
  for (;;) {
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n < 0 && last_errno != nullptr) *last_errno = errno;
    if (n <= 0) break;
    got.append(buf, size_t(n));
  }
  close(fd);
  return got;
}

// Waits until the server holds no connection: each round starts alone, so what the server does
// is what this round's bytes made it do (a connection of an earlier round, still being closed,
// neither serves the exposition nor takes a worker meanwhile). Property: every connection is
// closed within 5 s of its client's reset.
void WaitUntilIdle(const HttpServer& http) {
  for (int i = 0; http.open_connections() != 0; ++i) {
    FUZZ_CHECK(i < 5000);
    usleep(1000);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Served& s = Server();
  WaitUntilIdle(*s.http);
  FuzzedDataProvider in(data, size);
  const size_t split = in.ConsumeIntegralInRange<size_t>(0, 512);
  const std::string request = in.ConsumeRemainingBytesAsString();
  const size_t cut = std::min(split, request.size());
  const uint64_t scrapes = s.scrapes.load();
  const std::string answer = RoundTrip(s.http->port(), request.substr(0, cut), request.substr(cut));
  // (civetweb writes a malformed request's version into its own 400 status line, so the status
  // line proves little beyond its start; whether the exposition was served is counted.)
  if (!answer.empty()) FUZZ_CHECK(absl::StartsWith(answer, "HTTP/"));
  if (s.scrapes.load() != scrapes) {
    // (civetweb skips blank lines before the request line, as HTTP allows.)
    const size_t line = request.find_first_not_of("\r\n \t");
    const std::string rest = line == std::string::npos ? "" : request.substr(line);
    FUZZ_CHECK(absl::StartsWith(rest, "GET ") || absl::StartsWith(rest, "HEAD "));
  }
  static int round = 0;
  if (++round % 64 == 0) {
    // (8 fuzzers under ASan share two cores in CI; now and then a scrape there came back empty,
    // not reproduced alone. The property is that the server still serves: a scrape that comes
    // back empty is tried again, twice, each time printed with what is known.)
    std::string scrape;
    for (int attempt = 0; attempt < 3 && !absl::StartsWith(scrape, "HTTP/1.1 200"); ++attempt) {
      WaitUntilIdle(*s.http);
      int last_errno = 0;
      const absl::Time start = absl::Now();
      scrape = RoundTrip(s.http->port(),
                         "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", "",
                         /*quiet_s=*/2, &last_errno);
      if (!absl::StartsWith(scrape, "HTTP/1.1 200")) {
        std::fprintf(stderr, "scrape %d answered %zu bytes in %s (errno %d, %llu open): '%s'\n",
                     attempt, scrape.size(), absl::FormatDuration(absl::Now() - start).c_str(),
                     last_errno, static_cast<unsigned long long>(s.http->open_connections()),
                     scrape.substr(0, 200).c_str());
      }
    }
    FUZZ_CHECK(absl::StartsWith(scrape, "HTTP/1.1 200"));
    FUZZ_CHECK(absl::StrContains(scrape, "kvbank_fuzz_total 0"));
  }
  return 0;
}
