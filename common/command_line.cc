#include "common/command_line.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace kvbank::cmdline {
namespace {

std::string Dashed(std::string name) {
  std::replace(name.begin(), name.end(), '_', '-');
  return name;
}

const FlagSpec* Find(absl::Span<const FlagSpec> flags, const std::string& name) {
  for (const FlagSpec& f : flags) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

// Optimal-string-alignment distance: insertions, deletions, substitutions and swaps of two
// neighbours each cost 1 (a swap is the commonest typo).
size_t EditDistance(const std::string& a, const std::string& b) {
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    }
  }
  return d[a.size()][b.size()];
}

bool ParseBool(const std::string& v, bool* out) {
  if (v == "true" || v == "1" || v == "yes") {
    *out = true;
  } else if (v == "false" || v == "0" || v == "no") {
    *out = false;
  } else {
    return false;
  }
  return true;
}

std::vector<std::string> Names(absl::Span<const FlagSpec> flags) {
  std::vector<std::string> names;
  for (const FlagSpec& f : flags) names.push_back(f.name);
  return names;
}

}  // namespace

bool ParsedArgs::Has(const std::string& name) const { return Get(name).has_value(); }

std::optional<std::string> ParsedArgs::Get(const std::string& name) const {
  std::optional<std::string> v;
  for (const auto& [n, value] : values) {
    if (n == name) v = value;
  }
  return v;
}

absl::StatusOr<ParsedArgs> Parse(absl::Span<const std::string> args,
                                 absl::Span<const FlagSpec> flags, bool stop_at_positional) {
  ParsedArgs out;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "--") {
      auto& to = stop_at_positional ? out.rest : out.positional;
      to.insert(to.end(), args.begin() + i + 1, args.end());
      break;
    }
    if (arg == "--help" || arg == "-h" || arg == "--helpfull" || arg == "-help") {
      out.help = true;
      continue;
    }
    if (arg.size() < 2 || arg[0] != '-' || arg == "-") {
      if (stop_at_positional) {
        out.rest.assign(args.begin() + i, args.end());
        break;
      }
      out.positional.push_back(arg);
      continue;
    }
    // "-name" is read as "--name", as Abseil does.
    std::string body = arg.substr(arg[1] == '-' ? 2 : 1);
    std::optional<std::string> value;
    if (size_t eq = body.find('='); eq != std::string::npos) {
      value = body.substr(eq + 1);
      body.resize(eq);
    }
    std::string name = Dashed(body);
    const FlagSpec* spec = Find(flags, name);
    if (spec == nullptr && absl::StartsWith(name, "no")) {
      // --noname turns a switch off (Abseil's spelling); --no-name as well.
      std::string off = name.substr(name.size() > 2 && name[2] == '-' ? 3 : 2);
      if (const FlagSpec* s = Find(flags, off); s != nullptr && s->value_name.empty()) {
        if (value.has_value()) {
          return absl::InvalidArgumentError(absl::StrCat("--", name, " takes no value"));
        }
        out.values.emplace_back(s->name, "false");
        continue;
      }
    }
    if (spec == nullptr) {
      std::string msg = absl::StrCat("unknown flag --", name);
      if (std::string near = ClosestName(name, Names(flags)); !near.empty()) {
        absl::StrAppend(&msg, " (did you mean --", near, "?)");
      }
      return absl::NotFoundError(msg);
    }
    if (spec->value_name.empty()) {
      bool on = true;
      if (value.has_value() && !ParseBool(*value, &on)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--", name, " is a switch: give it bare, or =true / =false, not '", *value, "'"));
      }
      out.values.emplace_back(spec->name, on ? "true" : "false");
      continue;
    }
    if (!value.has_value()) {
      if (i + 1 >= args.size()) {
        return absl::InvalidArgumentError(
            absl::StrCat("--", name, " needs a value (", spec->value_name, ")"));
      }
      value = args[++i];
    }
    out.values.emplace_back(spec->name, *value);
  }
  return out;
}

std::string ClosestName(const std::string& name, absl::Span<const std::string> candidates) {
  std::string best;
  size_t best_distance = 0;
  for (const std::string& c : candidates) {
    size_t d = EditDistance(name, c);
    // A name cut short (--pool for --pool-bytes) is as good as a one-letter typo.
    if (name.size() >= 3 && (absl::StartsWith(c, name) || absl::StartsWith(name, c))) {
      d = std::min<size_t>(d, 1);
    }
    if (best.empty() || d < best_distance) {
      best = c;
      best_distance = d;
    }
  }
  const size_t limit = std::max<size_t>(2, name.size() / 3);
  return best_distance <= limit ? best : "";
}

std::string FormatFlags(absl::Span<const FlagSpec> flags) {
  constexpr size_t kHelpColumn = 28;
  constexpr size_t kWidth = 100;
  std::string out;
  for (const FlagSpec& f : flags) {
    std::string head = absl::StrCat("  --", f.name);
    if (!f.value_name.empty()) absl::StrAppend(&head, " ", f.value_name);
    std::string help = f.help;
    if (!f.default_value.empty()) absl::StrAppend(&help, " (default: ", f.default_value, ")");
    // Words are laid out from the help column; a long head takes a line of its own.
    std::string line = head;
    if (line.size() + 2 > kHelpColumn) {
      absl::StrAppend(&out, line, "\n");
      line.clear();
    }
    line.resize(kHelpColumn, ' ');
    bool first_word = true;
    for (absl::string_view word : absl::StrSplit(help, ' ', absl::SkipEmpty())) {
      if (!first_word && line.size() + 1 + word.size() > kWidth) {
        absl::StrAppend(&out, line, "\n");
        line.assign(kHelpColumn, ' ');
        first_word = true;
      }
      absl::StrAppend(&line, first_word ? "" : " ", word);
      first_word = false;
    }
    absl::StrAppend(&out, line, "\n");
  }
  return out;
}

std::string FlagList(absl::Span<const FlagSpec> flags) {
  std::vector<std::string> names;
  for (const FlagSpec& f : flags) names.push_back("--" + f.name);
  return absl::StrJoin(names, ", ");
}

}  // namespace kvbank::cmdline
