#include "server/flags.h"

#include <algorithm>
#include <cstdint>
#include <iostream>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/command_line.h"

namespace kvbank {
namespace {

std::string Dashed(std::string name) {
  std::replace(name.begin(), name.end(), '_', '-');
  return name;
}

std::string Underscored(std::string name) {
  std::replace(name.begin(), name.end(), '-', '_');
  return name;
}

// What a flag's value is, for the help text: by its name where that says more than its type.
std::string ValueName(const std::string& name, const absl::CommandLineFlag& flag) {
  if (flag.IsOfType<bool>()) return "";  // a switch
  if (name == "listen") return "HOST:PORT";
  if (absl::EndsWith(name, "-bytes")) return "SIZE";
  if (absl::EndsWith(name, "-ms")) return "MS";
  if (absl::EndsWith(name, "-file") || absl::StartsWith(name, "tls-") || name == "config") {
    return "PATH";
  }
  if (flag.IsOfType<double>()) return "X";
  if (flag.IsOfType<std::string>()) return "TEXT";
  return "N";
}

// What a value of the flag's type looks like, for an error about a bad one.
std::string Expected(const absl::CommandLineFlag& flag) {
  if (flag.IsOfType<bool>()) return "true or false";
  if (flag.IsOfType<double>()) return "a number";
  if (flag.IsOfType<uint64_t>()) return "an integer >= 0";
  return "an integer";
}

// Every flag of this program, sorted by name; Abseil's own (--flagfile, --fromenv, ...) are left
// out: kvbankd reads no flag files.
std::vector<cmdline::FlagSpec> ServerFlagSpecs() {
  std::vector<cmdline::FlagSpec> specs;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (absl::StrContains(flag->Filename(), "absl/flags/")) continue;
    cmdline::FlagSpec s;
    s.name = Dashed(std::string(name));
    s.help = flag->Help();
    s.default_value = flag->DefaultValue();  // empty strings: the help says what happens
    s.value_name = ValueName(s.name, *flag);
    specs.push_back(std::move(s));
  }
  std::sort(specs.begin(), specs.end(),
            [](const cmdline::FlagSpec& a, const cmdline::FlagSpec& b) { return a.name < b.name; });
  return specs;
}

int UsageError(const std::string& what) {
  std::cerr << "kvbankd: " << what << "\nkvbankd --help lists every flag\n";
  return 2;
}

}  // namespace

std::optional<int> ParseServerFlags(int argc, char** argv, const std::string& usage) {
  const std::vector<cmdline::FlagSpec> specs = ServerFlagSpecs();
  const std::vector<std::string> args(argv + std::min(argc, 1), argv + argc);
  auto parsed = cmdline::Parse(args, specs);
  if (!parsed.ok()) return UsageError(std::string(parsed.status().message()));
  if (parsed->help) {
    std::cout << usage << "\n\nFlags (--name=value or --name value; a switch is on when given "
              << "bare, --name=false turns it off):\n"
              << cmdline::FormatFlags(specs);
    std::cout.flush();
    return 0;
  }
  if (!parsed->positional.empty()) {
    return UsageError(absl::StrCat("unexpected argument '", parsed->positional[0],
                                   "' (kvbankd takes flags only)"));
  }
  for (const auto& [name, value] : parsed->values) {
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(Underscored(name));
    std::string error;
    if (flag == nullptr) return UsageError(absl::StrCat("unknown flag --", name));
    if (!flag->ParseFrom(value, &error)) {
      return UsageError(
          absl::StrCat("--", name, ": '", value, "' is not a valid value (", Expected(*flag), ")"));
    }
  }
  return std::nullopt;
}

}  // namespace kvbank
