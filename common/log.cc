#include "common/log.h"

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>

namespace kvbank::log {
namespace {

std::atomic<Format> g_format{Format::kText};
std::atomic<int> g_fd{2};

// Length of the valid UTF-8 sequence at s[i], or 0 when it is not one.
size_t Utf8Length(std::string_view s, size_t i) {
  const auto c = static_cast<unsigned char>(s[i]);
  size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
  if (n == 0 || i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((static_cast<unsigned char>(s[i + k]) >> 6) != 0x2) return 0;
  }
  if (n == 2 && c < 0xC2) return 0;  // overlong
  return n;
}

std::string Timestamp() {
  const auto now = std::chrono::system_clock::now();
  const auto us =
      std::chrono::duration_cast<std::chrono::microseconds>(now.time_since_epoch()).count();
  const std::time_t secs = static_cast<std::time_t>(us / 1000000);
  std::tm tm{};
  gmtime_r(&secs, &tm);
  char date[32];
  std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%S", &tm);
  char micros[16];
  std::snprintf(micros, sizeof(micros), ".%06dZ", static_cast<int>(us % 1000000));
  return std::string(date) + micros;
}

void WriteAll(const std::string& line) {
  const int fd = g_fd.load(std::memory_order_relaxed);
  size_t done = 0;
  while (done < line.size()) {
    const ssize_t n = ::write(fd, line.data() + done, line.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // nowhere to log to: drop the line rather than stall the server
    done += static_cast<size_t>(n);
  }
}

}  // namespace

bool ParseFormat(std::string_view text, Format* format) {
  if (text == "text") {
    *format = Format::kText;
  } else if (text == "json") {
    *format = Format::kJson;
  } else {
    return false;
  }
  return true;
}

void SetFormat(Format format) { g_format.store(format, std::memory_order_relaxed); }
Format GetFormat() { return g_format.load(std::memory_order_relaxed); }
void SetDescriptor(int fd) { g_fd.store(fd, std::memory_order_relaxed); }

std::string JsonEscape(std::string_view text) {
  std::string out;
  out.reserve(text.size() + 8);
  for (size_t i = 0; i < text.size();) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7F) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
    } else if (c >= 0x80) {
      const size_t n = Utf8Length(text, i);
      if (n == 0) {
        out += "\xEF\xBF\xBD";  // U+FFFD
        ++i;
        continue;
      }
      out.append(text.substr(i, n));
      i += n;
      continue;
    } else {
      out += static_cast<char>(c);
    }
    ++i;
  }
  return out;
}

Record::Record(const char* level, std::string_view event) : level_(level), event_(event) {}

Record& Record::Field(std::string_view key, std::string_view value) {
  fields_.emplace_back(std::string(key), "\"" + JsonEscape(value) + "\"");
  return *this;
}

Record& Record::Field(std::string_view key, bool value) {
  return Number(key, value ? "true" : "false");
}

Record& Record::Field(std::string_view key, double value) {
  if (!std::isfinite(value)) return Number(key, "null");  // JSON has no NaN / Inf
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.6g", value);
  return Number(key, buf);
}

Record& Record::Number(std::string_view key, std::string text) {
  fields_.emplace_back(std::string(key), std::move(text));
  return *this;
}

Record::~Record() {
  std::string line;
  if (GetFormat() == Format::kText) {
    line = "kvbankd: " + message_.str() + "\n";
  } else {
    line = "{\"ts\":\"" + Timestamp() + "\",\"level\":\"" + level_ + "\",\"event\":\"" +
           JsonEscape(event_) + "\",\"msg\":\"" + JsonEscape(message_.str()) + "\"";
    for (const auto& [key, value] : fields_) {
      line += ",\"" + key + "\":" + value;
    }
    line += "}\n";
  }
  WriteAll(line);
}

}  // namespace kvbank::log
