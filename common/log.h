// kvbankd's log: one record a line on stderr, as text ("kvbankd: <message>", for a person at a
// terminal) or as JSON lines (--log-format=json, for a log pipeline):
//
//   {"ts":"2026-12-01T20:33:44.123456Z","level":"info","event":"model_registered",
//    "msg":"model 'llama': 4096 blocks ...","model":"llama","blocks":4096}
//
//   log::Info("model_registered") << "model '" << name << "': ...";      // message only
//   log::Info("model_registered").Field("model", name).Field("blocks", n) << "...";
//
// A record is written with one write(2) when it goes out of scope, so lines of threads never
// interleave. Records carry no payload bytes and no token ids: callers pass counts and names.
#ifndef KVBANK_COMMON_LOG_H_
#define KVBANK_COMMON_LOG_H_

#include <cstdint>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace kvbank::log {

enum class Format { kText, kJson };

// Parses "text" | "json". False for anything else.
bool ParseFormat(std::string_view text, Format* format);
// Thread-safe; takes effect for records made after it. Default: kText.
void SetFormat(Format format);
Format GetFormat();
// Where records go (default: fd 2). Tests point it at a pipe or file. Thread-safe.
void SetDescriptor(int fd);

// `text` as the body of a JSON string (quotes, backslashes, control characters escaped; bytes
// that are not valid UTF-8 become U+FFFD).
std::string JsonEscape(std::string_view text);

// One log record. Not thread-safe itself; each thread makes its own. Neither copied nor moved:
// Info() and friends return it as a prvalue, and it is written where the statement ends.
class Record {
 public:
  Record(const char* level, std::string_view event);
  Record(const Record&) = delete;
  Record& operator=(const Record&) = delete;
  ~Record();  // writes the line

  // A structured field. In text format fields are not printed (the message says it for a
  // person); in JSON each is a key. Keys must be plain identifiers (not escaped).
  Record& Field(std::string_view key, std::string_view value);
  Record& Field(std::string_view key, const char* value) {
    return Field(key, std::string_view(value));
  }
  Record& Field(std::string_view key, const std::string& value) {
    return Field(key, std::string_view(value));
  }
  Record& Field(std::string_view key, bool value);
  Record& Field(std::string_view key, double value);
  template <typename T,
            std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>, int> = 0>
  Record& Field(std::string_view key, T value) {
    return Number(key, std::to_string(value));
  }

  // The human-readable message.
  template <typename T>
  Record& operator<<(const T& v) {
    message_ << v;
    return *this;
  }

 private:
  Record& Number(std::string_view key, std::string text);

  const char* level_;
  std::string event_;
  std::ostringstream message_;
  // key, JSON value (already encoded)
  std::vector<std::pair<std::string, std::string>> fields_;
};

inline Record Info(std::string_view event) { return Record("info", event); }
inline Record Warn(std::string_view event) { return Record("warn", event); }
inline Record Error(std::string_view event) { return Record("error", event); }

}  // namespace kvbank::log

#endif  // KVBANK_COMMON_LOG_H_
