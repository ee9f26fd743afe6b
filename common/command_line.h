// Command-line parsing shared by kvbankd and kvbank, so that both read flags the same way:
//
//   --name=value  --name value  --name (a switch)  --name=true|false  --noname (a switch off)
//
// Names are written with dashes; underscores are accepted as well (--pool_bytes = --pool-bytes).
// An unknown flag is an error that names it and the closest valid one. --help, -h and --helpfull
// ask for help; "--" ends the flags. Nothing here prints or exits: the caller decides.
#ifndef KVBANK_COMMON_COMMAND_LINE_H_
#define KVBANK_COMMON_COMMAND_LINE_H_

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace kvbank::cmdline {

struct FlagSpec {
  std::string name;        // with dashes, without "--": "pool-bytes"
  std::string value_name;  // shown in help ("BYTES"); empty: a switch that takes no value
  std::string help;
  std::string default_value;  // shown in help when not empty
};

struct ParsedArgs {
  // (name with dashes, value) in command-line order; a switch given bare has value "true".
  std::vector<std::pair<std::string, std::string>> values;
  std::vector<std::string> positional;
  // With stop_at_positional: the first positional argument and everything after it.
  std::vector<std::string> rest;
  bool help = false;  // --help, -h or --helpfull was given

  bool Has(const std::string& name) const;
  // The last value given for `name`, if any.
  std::optional<std::string> Get(const std::string& name) const;
};

// Parses `args` (no program name) against `flags`. With stop_at_positional, parsing ends at the
// first positional argument, which goes to `rest` with everything after it. Errors
// (InvalidArgument) name the flag: an unknown one also names the closest valid one.
absl::StatusOr<ParsedArgs> Parse(absl::Span<const std::string> args,
                                 absl::Span<const FlagSpec> flags, bool stop_at_positional = false);

// The candidate nearest to `name` by edit distance, or "" when none is near enough to be a
// plausible misspelling.
std::string ClosestName(const std::string& name, absl::Span<const std::string> candidates);

// Help text for `flags`: one entry a flag, "  --name VALUE  help (default: D)", wrapped at 100
// columns, in the order given.
std::string FormatFlags(absl::Span<const FlagSpec> flags);

// The names of `flags` as "--a, --b, --c".
std::string FlagList(absl::Span<const FlagSpec> flags);

}  // namespace kvbank::cmdline

#endif  // KVBANK_COMMON_COMMAND_LINE_H_
