// The tokens file parser (rpc::Authenticator::FromText) over fuzzer-chosen text. Properties: it
// never crashes; it fails only with INVALID_ARGUMENT about the tokens file; comment and blank
// lines, leading or trailing, change nothing about whether a file is accepted; and a file that is
// accepted no longer is once one of its lines is listed twice (a token listed twice).
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "server/rpc/auth.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using kvbank::rpc::Authenticator;
  const std::string text(reinterpret_cast<const char*>(data), size);
  const auto a = Authenticator::FromText(text);
  if (!a.ok()) {
    FUZZ_CHECK(a.status().code() == absl::StatusCode::kInvalidArgument);
    FUZZ_CHECK(absl::StartsWith(a.status().message(), "tokens file"));
  } else {
    FUZZ_CHECK(a->enabled());
  }
  const auto padded = Authenticator::FromText("# tokens\n\n  \n" + text + "\n# end\n");
  FUZZ_CHECK(padded.ok() == a.ok());
  if (a.ok()) {
    // Its first entry's line, listed again.
    for (absl::string_view line : absl::StrSplit(text, '\n')) {
      const absl::string_view stripped = absl::StripAsciiWhitespace(line);
      if (stripped.empty() || stripped[0] == '#') continue;
      const auto twice = Authenticator::FromText(text + "\n" + std::string(line));
      FUZZ_CHECK(!twice.ok());
      FUZZ_CHECK(absl::StrContains(twice.status().message(), "listed twice"));
      break;
    }
  }
  return 0;
}
