// Runs the real kvbankd as a child process on a loopback port, for integration tests.
//
//   class MyTest : public kvbank::integ::KvbankdTest {};
//   TEST_F(MyTest, Works) {
//     ASSERT_NO_FATAL_FAILURE(StartServer({"--models=", "--pool-bytes=64MiB"}));
//     auto client = NewClient();
//     ...
//   }  // TearDown: SIGTERM, bounded wait, exit status 0 asserted, server log printed on failure
#ifndef KVBANK_TESTS_INTEGRATION_SERVER_FIXTURE_H_
#define KVBANK_TESTS_INTEGRATION_SERVER_FIXTURE_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "kvbank/client.h"

namespace kvbank::integ {

// A sanitizer build (its kvbankd too): memory figures include the sanitizer's shadow and
// quarantine, so tests bound memory only when this is false.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool kSanitizedBuild = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
inline constexpr bool kSanitizedBuild = true;
#else
inline constexpr bool kSanitizedBuild = false;
#endif
#else
inline constexpr bool kSanitizedBuild = false;
#endif

// Path of the kvbankd binary this build made, or $KVBANK_KVBANKD when set.
const char* KvbankdPath();

// One kvbankd child process. Not thread-safe, except SendSignal (may be called from any thread).
class ServerProcess {
 public:
  // Starts kvbankd with `--listen 127.0.0.1:0 --port-file <tmp>/port` followed by `flags` (later
  // flags win), its stdout and stderr going to <tmp>/server.log, and waits up to `timeout` for
  // the port file. On failure the child is killed and the error carries the server's log.
  // `nofile`: when not 0, the child's RLIMIT_NOFILE (soft and hard), set before exec.
  static absl::StatusOr<std::unique_ptr<ServerProcess>> Start(
      const std::vector<std::string>& flags, absl::Duration timeout = absl::Seconds(20),
      uint64_t nofile = 0);
  // Kills a child still running (SIGKILL) and removes the temp dir.
  ~ServerProcess();
  ServerProcess(const ServerProcess&) = delete;
  ServerProcess& operator=(const ServerProcess&) = delete;

  int port() const { return port_; }
  std::string target() const { return "127.0.0.1:" + std::to_string(port_); }
  pid_t pid() const { return pid_; }
  bool exited() const { return exited_; }

  // kill(pid, sig) unless the child was already reaped.
  void SendSignal(int sig);
  // Waits up to `timeout` for the child to exit; SIGKILLs it after that. OK only when it exited
  // on its own with status 0; else the error says how it ended.
  absl::Status WaitForExit(absl::Duration timeout);
  // SIGTERM, then WaitForExit.
  absl::Status Stop(absl::Duration timeout = absl::Seconds(30));
  // Everything the server wrote to stdout and stderr so far.
  std::string Log() const;

 private:
  ServerProcess() = default;

  std::string dir_;
  pid_t pid_ = -1;
  int port_ = 0;
  bool exited_ = false;
  int wait_status_ = 0;
};

// A gtest fixture owning at most one server at a time. StartServer fails the test (fatally) when
// the server does not come up or does not report SERVING; TearDown stops the server, expects exit
// status 0 and prints the server's log when the test failed (always, with
// KVBANK_INTEG_SERVER_LOG=1). Clients may outlive the server: its drain closes their connections.
class KvbankdTest : public ::testing::Test {
 protected:
  void StartServer(const std::vector<std::string>& flags);
  // A new Client on its own connection to the current server.
  std::unique_ptr<Client> NewClient(ClientOptions options = {});
  void TearDown() override;

  std::unique_ptr<ServerProcess> server_;
};

// Equality of two byte strings with a short message (first differing offset) instead of a dump.
::testing::AssertionResult BytesEqual(const std::vector<uint8_t>& got,
                                      const std::vector<uint8_t>& want);

// Milliseconds since `start`, for timing logs.
int64_t MsSince(absl::Time start);

}  // namespace kvbank::integ

#endif  // KVBANK_TESTS_INTEGRATION_SERVER_FIXTURE_H_
