// The Prometheus text exposition format, version 0.0.4: what GET /metrics answers.
//
//   # HELP kvbank_rpc_total Calls answered, by method and status code.
//   # TYPE kvbank_rpc_total counter
//   kvbank_rpc_total{method="Fetch",code="OK"} 12
#ifndef KVBANK_SERVER_METRICS_TEXT_FORMAT_H_
#define KVBANK_SERVER_METRICS_TEXT_FORMAT_H_

#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "server/metrics/registry.h"

namespace kvbank::metrics {

// The Content-Type of FormatText's output.
inline constexpr char kTextContentType[] = "text/plain; version=0.0.4; charset=utf-8";

// Every family: its HELP line, its TYPE line, then its samples, one a line. A family with no
// samples still gets its HELP and TYPE lines.
std::string FormatText(const std::vector<FamilySnapshot>& families);

// A sample value (and a bucket bound): integers up to 2^53 as integers, others in the shortest
// digits that read back as the same double, in fixed notation unless the exponent is below -4
// (as Go's clients write them: 0.0001, 5e-05); NaN, +Inf, -Inf.
std::string FormatValue(double v);
// A label value between double quotes: backslash, double quote and line feed escaped as \\, \"
// and \n.
std::string EscapeLabelValue(absl::string_view v);
// HELP text: backslash and line feed escaped as \\ and \n.
std::string EscapeHelp(absl::string_view help);

}  // namespace kvbank::metrics

#endif  // KVBANK_SERVER_METRICS_TEXT_FORMAT_H_
