// A small Prometheus metrics registry: counters, gauges and histograms with labels, and
// collectors that read figures at scrape time.
//
// The hot path never takes a lock that another thread updating the same metric takes: every
// counter, gauge and histogram child is split into kShards cache-line-sized shards, a thread adds
// to its own shard with one relaxed atomic, and a scrape sums the shards. A child is looked up
// (under its family's lock) once, when the caller first needs it; the pointer stays valid for the
// registry's life, so callers keep it and increment through it from then on.
//
// Figures that exist elsewhere already (pool occupancy, per-tenant activity) are not mirrored
// into metrics: a collector reads them when /metrics is scraped, so nothing runs on a timer.
//
// Lock order: Registry::mu_, then a family's mu_.
#ifndef KVBANK_SERVER_METRICS_REGISTRY_H_
#define KVBANK_SERVER_METRICS_REGISTRY_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace kvbank::metrics {

enum class MetricType { kCounter, kGauge, kHistogram };

// (label name, label value) pairs, in the family's label order.
using Labels = std::vector<std::pair<std::string, std::string>>;

// One exposition line's figures: `name + suffix{labels} value`.
struct Sample {
  std::string suffix;  // "" for counters and gauges; "_bucket", "_sum", "_count" for histograms
  Labels labels;       // a histogram bucket's "le" comes last
  double value = 0;
};

// What a scrape reads of one family. Counter names end in _total (as in the Go and Python
// clients' text output: the sample name is the family name).
struct FamilySnapshot {
  std::string name;
  std::string help;
  MetricType type = MetricType::kGauge;
  std::vector<Sample> samples;
};

// Shards per metric child: threads spread over them by a per-thread index.
inline constexpr size_t kShards = 8;
// The calling thread's shard, in [0, kShards): fixed for the thread's life.
size_t ThisThreadShard();

// A monotonically increasing count. Thread-safe; Inc is one relaxed atomic add on this thread's
// shard.
class Counter {
 public:
  void Inc(uint64_t n = 1) { cells_[ThisThreadShard()].v.fetch_add(n, std::memory_order_relaxed); }
  uint64_t Value() const;

 private:
  struct alignas(64) Cell {
    std::atomic<uint64_t> v{0};
  };
  std::array<Cell, kShards> cells_;
};

// A count that goes up and down (calls in flight). Thread-safe; an Add on one thread may be
// undone by an Add on another: the value is the sum over the shards.
class Gauge {
 public:
  void Add(int64_t n) { cells_[ThisThreadShard()].v.fetch_add(n, std::memory_order_relaxed); }
  int64_t Value() const;

 private:
  struct alignas(64) Cell {
    std::atomic<int64_t> v{0};
  };
  std::array<Cell, kShards> cells_;
};

// Observations counted into buckets with upper bounds `bounds` (strictly increasing, finite;
// +Inf is implied). Thread-safe; Observe is a binary search and two relaxed atomics on this
// thread's shard (three when another thread on the same shard adds to the sum at that moment).
class Histogram {
 public:
  // REQUIRES: bounds are strictly increasing and finite (Registry::AddHistogram checks).
  explicit Histogram(std::vector<double> bounds);
  void Observe(double value);

  struct Snapshot {
    std::vector<uint64_t> cumulative;  // per bound, then +Inf (= count)
    double sum = 0;
    uint64_t count = 0;
  };
  // The buckets and the count agree with each other; the sum may miss an observation that is
  // being added at that moment.
  Snapshot Read() const;
  const std::vector<double>& bounds() const { return bounds_; }

 private:
  const std::vector<double> bounds_;
  // Per shard, one cache-line-aligned run of `stride_` words: bounds_.size() + 1 bucket counts,
  // then the bits of the shard's sum (a double).
  size_t stride_ = 0;
  std::unique_ptr<std::atomic<uint64_t>[]> words_;
};

// The children of one metric, one per distinct tuple of label values. Thread-safe.
template <typename T>
class Family {
 public:
  Family(std::string name, std::string help, MetricType type, std::vector<std::string> label_names,
         std::function<std::unique_ptr<T>()> make)
      : name_(std::move(name)),
        help_(std::move(help)),
        type_(type),
        label_names_(std::move(label_names)),
        make_(std::move(make)) {}

  // The child with these label values, made on first use; valid as long as the registry.
  // INVALID_ARGUMENT when the number of values is not the number of label names.
  absl::StatusOr<T*> WithLabels(const std::vector<std::string>& values) {
    if (values.size() != label_names_.size()) {
      return absl::InvalidArgumentError("metric " + name_ + " takes " +
                                        std::to_string(label_names_.size()) +
                                        " label values, got " + std::to_string(values.size()));
    }
    absl::MutexLock lock(&mu_);
    std::unique_ptr<T>& child = children_[values];
    if (child == nullptr) child = make_();
    return child.get();
  }

  const std::string& name() const { return name_; }
  const std::string& help() const { return help_; }
  MetricType type() const { return type_; }
  const std::vector<std::string>& label_names() const { return label_names_; }

  // Calls fn(label values, child) for every child, in label-value order, under the family's
  // lock (fn must not call back into the family).
  void ForEach(const std::function<void(const std::vector<std::string>&, const T&)>& fn) const {
    absl::MutexLock lock(&mu_);
    for (const auto& [values, child] : children_) fn(values, *child);
  }

 private:
  const std::string name_;
  const std::string help_;
  const MetricType type_;
  const std::vector<std::string> label_names_;
  const std::function<std::unique_ptr<T>()> make_;
  mutable absl::Mutex mu_;
  std::map<std::vector<std::string>, std::unique_ptr<T>> children_ ABSL_GUARDED_BY(mu_);
};

// Families registered in one place, read together by Collect. Thread-safe. Families and their
// children live as long as the registry.
class Registry {
 public:
  // Appends the families of scrape-time figures to `out`. Called by every Collect, in the order
  // collectors were added, after the registered families; may run on any thread, one at a time,
  // under the registry's lock: it must not call back into the registry.
  using Collector = std::function<void(std::vector<FamilySnapshot>* out)>;

  Registry() = default;
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // Registers a family. INVALID_ARGUMENT for a name or label name the text format does not
  // allow (names: [a-zA-Z_:][a-zA-Z0-9_:]*; label names: [a-zA-Z_][a-zA-Z0-9_]*, not "__..."),
  // for a counter whose name does not end in _total, for a histogram label "le", or histogram
  // bounds that are not strictly increasing and finite; ALREADY_EXISTS for a name taken.
  absl::StatusOr<Family<Counter>*> AddCounter(const std::string& name, const std::string& help,
                                              std::vector<std::string> label_names = {});
  absl::StatusOr<Family<Gauge>*> AddGauge(const std::string& name, const std::string& help,
                                          std::vector<std::string> label_names = {});
  absl::StatusOr<Family<Histogram>*> AddHistogram(const std::string& name, const std::string& help,
                                                  std::vector<std::string> label_names,
                                                  std::vector<double> bounds);
  void AddCollector(Collector collector);

  // Every registered family (in registration order, children by label values), then what the
  // collectors add.
  std::vector<FamilySnapshot> Collect() const;

 private:
  // OK when `name` is a valid metric name not yet taken. REQUIRES: mu_ held.
  absl::Status CheckNew(const std::string& name, const std::vector<std::string>& label_names) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<Family<Counter>>> counters_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<Family<Gauge>>> gauges_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<Family<Histogram>>> histograms_ ABSL_GUARDED_BY(mu_);
  // Registration order over the three lists: (type, index).
  std::vector<std::pair<MetricType, size_t>> order_ ABSL_GUARDED_BY(mu_);
  std::vector<Collector> collectors_ ABSL_GUARDED_BY(mu_);
};

// Whether `name` is a valid metric name / label name of the text format.
bool ValidMetricName(const std::string& name);
bool ValidLabelName(const std::string& name);

// A collector's helper: appends a family to `out` and returns it (valid until `out` grows).
FamilySnapshot* AddFamily(std::vector<FamilySnapshot>* out, std::string name, std::string help,
                          MetricType type);

}  // namespace kvbank::metrics

#endif  // KVBANK_SERVER_METRICS_REGISTRY_H_
