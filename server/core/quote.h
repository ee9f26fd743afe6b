// Client-given strings inside error messages: cut to a bound and escaped. A status message
// travels in the response's trailing metadata, which clients cap (grpcio: 8 KiB); echoing a
// 9,000-byte model name back whole turned NOT_FOUND into RESOURCE_EXHAUSTED on the client and
// broke its channel.
#ifndef KVBANK_SERVER_CORE_QUOTE_H_
#define KVBANK_SERVER_CORE_QUOTE_H_

#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace kvbank {

// Longest part of a client string an error message quotes.
inline constexpr size_t kQuoteBytes = 64;

// 'text' with non-printable bytes escaped, cut after kQuoteBytes bytes ("'abc...' (9000 bytes)").
inline std::string Quote(absl::string_view text) {
  if (text.size() <= kQuoteBytes) return absl::StrCat("'", absl::CHexEscape(text), "'");
  return absl::StrCat("'", absl::CHexEscape(text.substr(0, kQuoteBytes)), "...' (", text.size(),
                      " bytes)");
}

}  // namespace kvbank

#endif  // KVBANK_SERVER_CORE_QUOTE_H_
