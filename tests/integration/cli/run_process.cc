#include "tests/integration/cli/run_process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "tests/integration/server_fixture.h"

#ifndef KVBANK_CLI_PATH
#error "KVBANK_CLI_PATH must name the kvbank binary (tests/integration/cli/CMakeLists.txt)"
#endif

namespace kvbank::integ {
namespace {

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string FromEnvOr(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::string(v) : fallback;
}

}  // namespace

std::string ProcessResult::Describe() const {
  return absl::StrCat(timed_out ? "timed out" : absl::StrCat("exit ", exit_code), " after ",
                      absl::FormatDuration(elapsed), "\n--- stdout:\n", out, "--- stderr:\n", err,
                      "---");
}

ProcessResult RunProcess(const std::vector<std::string>& argv, absl::Duration timeout) {
  ProcessResult r;
  std::string dir = FromEnvOr("TMPDIR", "/tmp") + "/kvbank-run-XXXXXX";
  if (mkdtemp(dir.data()) == nullptr) {
    r.err = absl::StrCat("mkdtemp: ", std::strerror(errno));
    return r;
  }
  const std::string out_path = dir + "/out", err_path = dir + "/err";
  std::vector<std::string> args = argv;
  std::vector<char*> cargv;
  for (std::string& a : args) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  const int out_fd = open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  const int err_fd = open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  const int null_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  const absl::Time start = absl::Now();
  const pid_t parent = getpid();
  const pid_t pid = (out_fd < 0 || err_fd < 0 || null_fd < 0) ? -1 : fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(126);
    dup2(null_fd, 0);
    dup2(out_fd, 1);
    dup2(err_fd, 2);
    execvp(cargv[0], cargv.data());
    _exit(127);
  }
  for (int fd : {out_fd, err_fd, null_fd}) {
    if (fd >= 0) close(fd);
  }
  if (pid < 0) {
    r.err = absl::StrCat("cannot start ", argv[0], ": ", std::strerror(errno));
    std::filesystem::remove_all(dir);
    return r;
  }
  const absl::Time deadline = start + timeout;
  int status = 0;
  for (;;) {
    const pid_t w = waitpid(pid, &status, WNOHANG);
    if (w == pid) break;
    if (w < 0 && errno != EINTR) break;
    if (absl::Now() >= deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      r.timed_out = true;
      break;
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  r.elapsed = absl::Now() - start;
  if (!r.timed_out && WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
  r.out = ReadAll(out_path);
  r.err = ReadAll(err_path);
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return r;
}

std::string KvbankBinary() { return FromEnvOr("KVBANK_TEST_KVBANK", KVBANK_CLI_PATH); }
std::string KvbankdBinary() { return FromEnvOr("KVBANK_TEST_KVBANKD", KvbankdPath()); }

}  // namespace kvbank::integ
