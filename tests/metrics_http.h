// A minimal HTTP/1.1 client for the tests of kvbankd's /metrics: one request on loopback, the
// whole answer read until the server closes the connection (it answers Connection: close).
#ifndef KVBANK_TESTS_METRICS_HTTP_H_
#define KVBANK_TESTS_METRICS_HTTP_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <string>

namespace kvbank::testing_http {

// `method` `path` on 127.0.0.1:`port`; the status line, headers and body as received ("" when
// the connection fails). Reads time out after 10 s.
inline std::string Request(int port, const std::string& path, const std::string& method = "GET") {
  const std::string request =
      method + " " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return "";
  timeval tv{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string answer;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      write(fd, request.data(), request.size()) == ssize_t(request.size())) {
    char buf[8192];
    for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) answer.append(buf, size_t(n));
  }
  close(fd);
  return answer;
}

// The body of an answer (after the blank line); "" when there is none.
inline std::string Body(const std::string& answer) {
  const size_t at = answer.find("\r\n\r\n");
  return at == std::string::npos ? "" : answer.substr(at + 4);
}

}  // namespace kvbank::testing_http

#endif  // KVBANK_TESTS_METRICS_HTTP_H_
