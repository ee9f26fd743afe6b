// Runs a program to completion and captures what it printed, for tests of kvbank's and kvbankd's
// command lines and of the tools the tests use (openssl).
#ifndef KVBANK_TESTS_INTEGRATION_CLI_RUN_PROCESS_H_
#define KVBANK_TESTS_INTEGRATION_CLI_RUN_PROCESS_H_

#include <string>
#include <vector>

#include "absl/time/time.h"

namespace kvbank::integ {

struct ProcessResult {
  int exit_code = -1;      // -1 when it did not exit on its own (signal, timeout, no exec)
  bool timed_out = false;  // killed after the timeout
  std::string out, err;    // stdout, stderr
  absl::Duration elapsed;
  // "exit 2 after 0.1s; stdout: ...; stderr: ..." for assertion messages.
  std::string Describe() const;
};

// Runs argv (argv[0] a path, or a name looked up in PATH) with stdin from /dev/null; SIGKILLs it
// after `timeout`. Thread-compatible; safe in a process with other threads (nothing but
// async-signal-safe calls between fork and exec).
ProcessResult RunProcess(const std::vector<std::string>& argv,
                         absl::Duration timeout = absl::Seconds(60));

// The binaries under test: this build's, unless $KVBANK_TEST_KVBANK / $KVBANK_TEST_KVBANKD name
// others (to run the tests against another build of the programs).
std::string KvbankBinary();
std::string KvbankdBinary();

}  // namespace kvbank::integ

#endif  // KVBANK_TESTS_INTEGRATION_CLI_RUN_PROCESS_H_
