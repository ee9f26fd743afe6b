#include "server/metrics/registry.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/metrics/text_format.h"

namespace kvbank::metrics {
namespace {

double BitsToDouble(uint64_t bits) {
  double d;
  std::memcpy(&d, &bits, sizeof(d));
  return d;
}

uint64_t DoubleToBits(double d) {
  uint64_t bits;
  std::memcpy(&bits, &d, sizeof(d));
  return bits;
}

bool NameChar(char c, bool first, bool colon) {
  const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
  if (alpha || (colon && c == ':')) return true;
  return !first && c >= '0' && c <= '9';
}

bool ValidName(const std::string& name, bool colon) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    if (!NameChar(name[i], i == 0, colon)) return false;
  }
  return true;
}

Labels Zip(const std::vector<std::string>& names, const std::vector<std::string>& values) {
  Labels labels;
  labels.reserve(names.size() + 1);
  for (size_t i = 0; i < names.size(); ++i) labels.emplace_back(names[i], values[i]);
  return labels;
}

}  // namespace

size_t ThisThreadShard() {
  static std::atomic<size_t> next{0};
  thread_local const size_t shard = next.fetch_add(1, std::memory_order_relaxed) % kShards;
  return shard;
}

uint64_t Counter::Value() const {
  uint64_t sum = 0;
  for (const Cell& c : cells_) sum += c.v.load(std::memory_order_relaxed);
  return sum;
}

int64_t Gauge::Value() const {
  int64_t sum = 0;
  for (const Cell& c : cells_) sum += c.v.load(std::memory_order_relaxed);
  return sum;
}

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)) {
  constexpr size_t kWordsPerLine = 64 / sizeof(uint64_t);
  stride_ = (bounds_.size() + 2 + kWordsPerLine - 1) / kWordsPerLine * kWordsPerLine;
  // NOTE: new[] of std::atomic aligns to 8 bytes only; the first shard may share its line with
  // a neighbour, which costs a little contention, never correctness.
  words_ = std::make_unique<std::atomic<uint64_t>[]>(stride_ * kShards);
  for (size_t i = 0; i < stride_ * kShards; ++i) words_[i].store(0, std::memory_order_relaxed);
}

void Histogram::Observe(double value) {
  std::atomic<uint64_t>* shard = &words_[ThisThreadShard() * stride_];
  // The first bound >= value: a value equal to a bound counts in that bucket (le).
  const size_t bucket = std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin();
  shard[bucket].fetch_add(1, std::memory_order_relaxed);
  std::atomic<uint64_t>& sum = shard[bounds_.size() + 1];
  uint64_t old = sum.load(std::memory_order_relaxed);
  while (!sum.compare_exchange_weak(old, DoubleToBits(BitsToDouble(old) + value),
                                    std::memory_order_relaxed)) {
  }
}

Histogram::Snapshot Histogram::Read() const {
  Snapshot s;
  std::vector<uint64_t> counts(bounds_.size() + 1, 0);
  for (size_t shard = 0; shard < kShards; ++shard) {
    const std::atomic<uint64_t>* w = &words_[shard * stride_];
    for (size_t b = 0; b < counts.size(); ++b) counts[b] += w[b].load(std::memory_order_relaxed);
    s.sum += BitsToDouble(w[bounds_.size() + 1].load(std::memory_order_relaxed));
  }
  s.cumulative.resize(counts.size());
  uint64_t running = 0;
  for (size_t b = 0; b < counts.size(); ++b) {
    running += counts[b];
    s.cumulative[b] = running;
  }
  s.count = running;
  return s;
}

bool ValidMetricName(const std::string& name) { return ValidName(name, /*colon=*/true); }

bool ValidLabelName(const std::string& name) {
  return ValidName(name, /*colon=*/false) && !absl::StartsWith(name, "__");
}

absl::Status Registry::CheckNew(const std::string& name,
                                const std::vector<std::string>& label_names) const {
  if (!ValidMetricName(name)) {
    return absl::InvalidArgumentError(absl::StrCat("'", name, "' is not a valid metric name"));
  }
  for (const std::string& l : label_names) {
    if (!ValidLabelName(l)) {
      return absl::InvalidArgumentError(
          absl::StrCat("metric ", name, ": '", l, "' is not a valid label name"));
    }
  }
  for (size_t i = 0; i < label_names.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (label_names[i] == label_names[j]) {
        return absl::InvalidArgumentError(
            absl::StrCat("metric ", name, ": label '", label_names[i], "' appears twice"));
      }
    }
  }
  for (const auto& [type, index] : order_) {
    const std::string& taken = type == MetricType::kCounter ? counters_[index]->name()
                               : type == MetricType::kGauge ? gauges_[index]->name()
                                                            : histograms_[index]->name();
    if (taken == name) {
      return absl::AlreadyExistsError(absl::StrCat("metric ", name, " is registered already"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Family<Counter>*> Registry::AddCounter(const std::string& name,
                                                      const std::string& help,
                                                      std::vector<std::string> label_names) {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = CheckNew(name, label_names); !s.ok()) return s;
  if (!absl::EndsWith(name, "_total")) {
    return absl::InvalidArgumentError(absl::StrCat("counter ", name, " must end in _total"));
  }
  counters_.push_back(
      std::make_unique<Family<Counter>>(name, help, MetricType::kCounter, std::move(label_names),
                                        [] { return std::make_unique<Counter>(); }));
  order_.emplace_back(MetricType::kCounter, counters_.size() - 1);
  return counters_.back().get();
}

absl::StatusOr<Family<Gauge>*> Registry::AddGauge(const std::string& name, const std::string& help,
                                                  std::vector<std::string> label_names) {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = CheckNew(name, label_names); !s.ok()) return s;
  gauges_.push_back(std::make_unique<Family<Gauge>>(name, help, MetricType::kGauge,
                                                    std::move(label_names),
                                                    [] { return std::make_unique<Gauge>(); }));
  order_.emplace_back(MetricType::kGauge, gauges_.size() - 1);
  return gauges_.back().get();
}

absl::StatusOr<Family<Histogram>*> Registry::AddHistogram(const std::string& name,
                                                          const std::string& help,
                                                          std::vector<std::string> label_names,
                                                          std::vector<double> bounds) {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = CheckNew(name, label_names); !s.ok()) return s;
  if (std::find(label_names.begin(), label_names.end(), "le") != label_names.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("histogram ", name, ": the label le is the buckets' own"));
  }
  if (bounds.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("histogram ", name, " has no buckets"));
  }
  for (size_t i = 0; i < bounds.size(); ++i) {
    if (!std::isfinite(bounds[i]) || (i > 0 && !(bounds[i] > bounds[i - 1]))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "histogram ", name, ": bucket bounds must be finite and strictly increasing"));
    }
  }
  histograms_.push_back(std::make_unique<Family<Histogram>>(
      name, help, MetricType::kHistogram, std::move(label_names),
      [bounds = std::move(bounds)] { return std::make_unique<Histogram>(bounds); }));
  order_.emplace_back(MetricType::kHistogram, histograms_.size() - 1);
  return histograms_.back().get();
}

void Registry::AddCollector(Collector collector) {
  absl::MutexLock lock(&mu_);
  collectors_.push_back(std::move(collector));
}

std::vector<FamilySnapshot> Registry::Collect() const {
  absl::MutexLock lock(&mu_);
  std::vector<FamilySnapshot> out;
  for (const auto& [type, index] : order_) {
    FamilySnapshot f;
    f.type = type;
    if (type == MetricType::kCounter) {
      const Family<Counter>& fam = *counters_[index];
      f.name = fam.name();
      f.help = fam.help();
      fam.ForEach([&](const std::vector<std::string>& values, const Counter& c) {
        f.samples.push_back({"", Zip(fam.label_names(), values), double(c.Value())});
      });
    } else if (type == MetricType::kGauge) {
      const Family<Gauge>& fam = *gauges_[index];
      f.name = fam.name();
      f.help = fam.help();
      fam.ForEach([&](const std::vector<std::string>& values, const Gauge& g) {
        f.samples.push_back({"", Zip(fam.label_names(), values), double(g.Value())});
      });
    } else {
      const Family<Histogram>& fam = *histograms_[index];
      f.name = fam.name();
      f.help = fam.help();
      fam.ForEach([&](const std::vector<std::string>& values, const Histogram& h) {
        const Labels labels = Zip(fam.label_names(), values);
        const Histogram::Snapshot s = h.Read();
        for (size_t b = 0; b < s.cumulative.size(); ++b) {
          Labels with_le = labels;
          with_le.emplace_back("le", b < h.bounds().size() ? FormatValue(h.bounds()[b]) : "+Inf");
          f.samples.push_back({"_bucket", std::move(with_le), double(s.cumulative[b])});
        }
        f.samples.push_back({"_sum", labels, s.sum});
        f.samples.push_back({"_count", labels, double(s.count)});
      });
    }
    out.push_back(std::move(f));
  }
  for (const Collector& c : collectors_) c(&out);
  return out;
}

FamilySnapshot* AddFamily(std::vector<FamilySnapshot>* out, std::string name, std::string help,
                          MetricType type) {
  out->push_back({std::move(name), std::move(help), type, {}});
  return &out->back();
}

}  // namespace kvbank::metrics
