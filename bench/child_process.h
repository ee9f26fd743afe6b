// kvbankd as a child process of a benchmark: started with its output in a log file, killed with
// the benchmark (PR_SET_PDEATHSIG), its port read from --port-file. Header-only; a failure prints
// the reason (and the server's log) and exits 1.
#ifndef KVBANK_BENCH_CHILD_PROCESS_H_
#define KVBANK_BENCH_CHILD_PROCESS_H_

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvbank::bench {

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

[[noreturn]] inline void ChildFailed(const std::string& what) {
  std::fprintf(stderr, "bench: %s\n", what.c_str());
  std::exit(1);
}

// `args` (argv[0] the binary) as a child process, its stdout and stderr in `log`; it dies with
// this process.
inline pid_t SpawnServer(const std::vector<std::string>& args, const std::string& log) {
  std::vector<std::string> copy = args;
  std::vector<char*> argv;
  for (std::string& a : copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  const int log_fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  const int null_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid == 0) {  // only async-signal-safe calls until exec
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(126);
    dup2(null_fd, 0);
    dup2(log_fd, 1);
    dup2(log_fd, 2);
    execv(argv[0], argv.data());
    _exit(127);
  }
  if (pid < 0) ChildFailed("fork");
  close(log_fd);
  close(null_fd);
  return pid;
}

// The port `server` wrote to `port_file`, waiting up to 30 s.
inline int WaitForPortFile(pid_t server, const std::string& port_file, const std::string& log) {
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (absl::Now() < deadline) {
    int status = 0;
    if (waitpid(server, &status, WNOHANG) == server) {
      ChildFailed("kvbankd exited before serving; its log:\n" + ReadFile(log));
    }
    const int port = std::atoi(ReadFile(port_file).c_str());
    if (port > 0) return port;
    absl::SleepFor(absl::Milliseconds(10));
  }
  ChildFailed("kvbankd wrote no port file within 30 s; its log:\n" + ReadFile(log));
}

}  // namespace kvbank::bench

#endif  // KVBANK_BENCH_CHILD_PROCESS_H_
