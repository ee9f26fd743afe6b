#include "tests/integration/server_fixture.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"

#ifndef KVBANK_KVBANKD_PATH
#error "KVBANK_KVBANKD_PATH must name the kvbankd binary (tests/integration/CMakeLists.txt)"
#endif

namespace kvbank::integ {

namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string DescribeWaitStatus(int status) {
  if (WIFEXITED(status)) return absl::StrCat("exited with status ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    return absl::StrCat("was killed by signal ", WTERMSIG(status), " (",
                        strsignal(WTERMSIG(status)), ")");
  }
  return absl::StrCat("ended with wait status ", status);
}

}  // namespace

const char* KvbankdPath() {
  // KVBANK_KVBANKD runs the suite against another build of the server (e.g. an older one).
  const char* other = std::getenv("KVBANK_KVBANKD");
  return other != nullptr && *other != '\0' ? other : KVBANK_KVBANKD_PATH;
}

absl::StatusOr<std::unique_ptr<ServerProcess>> ServerProcess::Start(
    const std::vector<std::string>& flags, absl::Duration timeout, uint64_t nofile) {
  std::unique_ptr<ServerProcess> p(new ServerProcess());
  const char* tmp = std::getenv("TMPDIR");
  std::string templ =
      absl::StrCat(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp", "/kvbankd-integ-XXXXXX");
  if (mkdtemp(templ.data()) == nullptr) {
    return absl::InternalError(absl::StrCat("mkdtemp ", templ, ": ", strerror(errno)));
  }
  p->dir_ = templ;
  const std::string port_file = p->dir_ + "/port";
  const std::string log_file = p->dir_ + "/server.log";

  // Everything the child needs is prepared before fork: between fork and exec only
  // async-signal-safe calls are allowed (the test process has gRPC threads).
  std::vector<std::string> args = {KvbankdPath(), "--listen=127.0.0.1:0",
                                   "--port-file=" + port_file};
  // KVBANK_TEST_DEVICE runs the suite on another pool memory (ctest's *_staged variants:
  // host-staged, the device data path on host memory); a test's own --device wins.
  if (const char* device = std::getenv("KVBANK_TEST_DEVICE"); device != nullptr && *device) {
    args.push_back(std::string("--device=") + device);
    // Small staging pieces: payloads of a few layers move in several (and a fetch's messages
    // straddle them).
    args.push_back("--staging-bytes=64KiB");
  }
  args.insert(args.end(), flags.begin(), flags.end());
  // Tests that exercise tenancy pass --auth-tokens-file; every other test runs without auth.
  if (std::none_of(flags.begin(), flags.end(),
                   [](const std::string& f) { return f.rfind("--auth-tokens-file", 0) == 0; })) {
    args.push_back("--no-auth");
  }
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const int log_fd = open(log_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  const int null_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (log_fd < 0 || null_fd < 0) {
    return absl::InternalError(absl::StrCat("cannot open ", log_file, " or /dev/null"));
  }
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid == 0) {
    // The server dies with the test process, even when the test crashes.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(126);
    if (nofile != 0) {
      const rlimit lim{nofile, nofile};
      if (setrlimit(RLIMIT_NOFILE, &lim) != 0) _exit(125);
    }
    dup2(null_fd, 0);
    dup2(log_fd, 1);
    dup2(log_fd, 2);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(log_fd);
  close(null_fd);
  if (pid < 0) return absl::InternalError(absl::StrCat("fork: ", strerror(errno)));
  p->pid_ = pid;
  std::cerr << "[server] started " << absl::StrJoin(args, " ") << " (pid " << pid << ")\n";

  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) {
      p->exited_ = true;
      p->wait_status_ = status;
      return absl::InternalError(absl::StrCat("kvbankd ", DescribeWaitStatus(status),
                                              " before serving; its log:\n", p->Log()));
    }
    int port = 0;
    std::string text = ReadFile(port_file);
    if (absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &port) && port > 0) {
      p->port_ = port;
      return p;
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  return absl::DeadlineExceededError(absl::StrCat("kvbankd wrote no port file within ",
                                                  absl::FormatDuration(timeout), "; its log:\n",
                                                  p->Log()));
}

ServerProcess::~ServerProcess() {
  if (pid_ > 0 && !exited_) {
    kill(pid_, SIGKILL);
    int status = 0;
    waitpid(pid_, &status, 0);
  }
  if (!dir_.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
}

void ServerProcess::SendSignal(int sig) {
  if (pid_ > 0 && !exited_) kill(pid_, sig);
}

absl::Status ServerProcess::WaitForExit(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!exited_) {
    int status = 0;
    const pid_t r = waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      exited_ = true;
      wait_status_ = status;
      break;
    }
    if (r < 0) return absl::InternalError(absl::StrCat("waitpid: ", strerror(errno)));
    if (absl::Now() >= deadline) {
      kill(pid_, SIGKILL);
      waitpid(pid_, &status, 0);
      exited_ = true;
      wait_status_ = status;
      return absl::DeadlineExceededError(
          absl::StrCat("kvbankd (pid ", pid_, ") did not exit within ",
                       absl::FormatDuration(timeout), "; it was killed"));
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  if (WIFEXITED(wait_status_) && WEXITSTATUS(wait_status_) == 0) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("kvbankd ", DescribeWaitStatus(wait_status_)));
}

absl::Status ServerProcess::Stop(absl::Duration timeout) {
  SendSignal(SIGTERM);
  return WaitForExit(timeout);
}

std::string ServerProcess::Log() const { return ReadFile(dir_ + "/server.log"); }

void KvbankdTest::StartServer(const std::vector<std::string>& flags) {
  ASSERT_EQ(server_, nullptr) << "one server per test at a time";
  auto server = ServerProcess::Start(flags);
  ASSERT_TRUE(server.ok()) << server.status();
  server_ = *std::move(server);
  auto client = Client::Connect(server_->target());
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE((*client)->WaitForServing(absl::Seconds(20)))
      << "kvbankd on " << server_->target() << " did not report SERVING";
}

std::unique_ptr<Client> KvbankdTest::NewClient(ClientOptions options) {
  if (server_ == nullptr) {
    ADD_FAILURE() << "NewClient before StartServer";
    return nullptr;
  }
  auto client = Client::Connect(server_->target(), options);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? *std::move(client) : nullptr;
}

void KvbankdTest::TearDown() {
  if (server_ == nullptr) return;
  absl::Time stop_start = absl::Now();
  absl::Status s = server_->Stop();
  std::cerr << "[server] pid " << server_->pid() << " stopped in " << MsSince(stop_start)
            << " ms\n";
  EXPECT_TRUE(s.ok()) << "kvbankd shutdown: " << s;
  // KVBANK_INTEG_SERVER_LOG=1 prints the server's log after every test, not only failed ones.
  const char* verbose = std::getenv("KVBANK_INTEG_SERVER_LOG");
  if (HasFailure() || (verbose != nullptr && std::string(verbose) == "1")) {
    std::cerr << "---- kvbankd log (pid " << server_->pid() << ") ----\n"
              << server_->Log() << "---- end of kvbankd log ----\n";
  }
  server_.reset();
}

::testing::AssertionResult BytesEqual(const std::vector<uint8_t>& got,
                                      const std::vector<uint8_t>& want) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure() << "got " << got.size() << " bytes, want " << want.size();
  }
  if (got.empty() || std::memcmp(got.data(), want.data(), got.size()) == 0) {
    return ::testing::AssertionSuccess();
  }
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i]) {
      return ::testing::AssertionFailure()
             << "first difference at byte " << i << " of " << got.size() << ": got " << int(got[i])
             << ", want " << int(want[i]);
    }
  }
  return ::testing::AssertionSuccess();
}

int64_t MsSince(absl::Time start) { return absl::ToInt64Milliseconds(absl::Now() - start); }

}  // namespace kvbank::integ
