// kvbankd's command line: its ABSL_FLAGs, read with the parser kvbank shares
// (common/command_line.h), so that both programs spell flags with dashes, refuse unknown ones
// with a suggestion and print help on stdout.
#ifndef KVBANK_SERVER_FLAGS_H_
#define KVBANK_SERVER_FLAGS_H_

#include <optional>
#include <string>

namespace kvbank {

// Sets the program's ABSL_FLAGs from argv. Returns nothing when the server should go on; else the
// status to exit with: 0 after --help (every flag, its default and help, on stdout), 2 after a
// usage error (unknown flag, bad value, a positional argument), which is printed on stderr.
// REQUIRES: called once, from main, before any flag is read.
std::optional<int> ParseServerFlags(int argc, char** argv, const std::string& usage);

}  // namespace kvbank

#endif  // KVBANK_SERVER_FLAGS_H_
