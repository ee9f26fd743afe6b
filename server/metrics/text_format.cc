#include "server/metrics/text_format.h"

#include <charconv>
#include <cmath>
#include <cstdlib>

#include "absl/strings/str_cat.h"

namespace kvbank::metrics {
namespace {

const char* TypeName(MetricType t) {
  switch (t) {
    case MetricType::kCounter:
      return "counter";
    case MetricType::kGauge:
      return "gauge";
    case MetricType::kHistogram:
      return "histogram";
  }
  return "untyped";
}

}  // namespace

std::string FormatValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  constexpr double kExactIntegers = 9007199254740992.0;  // 2^53
  if (v == std::floor(v) && std::fabs(v) < kExactIntegers) {
    return absl::StrCat(static_cast<int64_t>(v));
  }
  // As Go's strconv.FormatFloat(v, 'g', -1, 64), which Prometheus and its clients write bucket
  // bounds with (le="0.0001", le="5e-05"): fixed notation unless the exponent is below -4.
  char buf[400];
  std::to_chars_result r = std::to_chars(buf, buf + sizeof(buf), v, std::chars_format::scientific);
  const std::string sci(buf, r.ptr);
  const int exponent = std::atoi(sci.c_str() + sci.find('e') + 1);
  if (exponent < -4 || exponent >= 21) return sci;
  r = std::to_chars(buf, buf + sizeof(buf), v, std::chars_format::fixed);
  return std::string(buf, r.ptr);
}

std::string EscapeLabelValue(absl::string_view v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string EscapeHelp(absl::string_view help) {
  std::string out;
  out.reserve(help.size());
  for (char c : help) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string FormatText(const std::vector<FamilySnapshot>& families) {
  std::string out;
  for (const FamilySnapshot& f : families) {
    absl::StrAppend(&out, "# HELP ", f.name, " ", EscapeHelp(f.help), "\n");
    absl::StrAppend(&out, "# TYPE ", f.name, " ", TypeName(f.type), "\n");
    for (const Sample& s : f.samples) {
      absl::StrAppend(&out, f.name, s.suffix);
      if (!s.labels.empty()) {
        out += '{';
        for (size_t i = 0; i < s.labels.size(); ++i) {
          if (i > 0) out += ',';
          absl::StrAppend(&out, s.labels[i].first, "=\"", EscapeLabelValue(s.labels[i].second),
                          "\"");
        }
        out += '}';
      }
      absl::StrAppend(&out, " ", FormatValue(s.value), "\n");
    }
  }
  return out;
}

}  // namespace kvbank::metrics
