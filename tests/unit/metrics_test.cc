// The metrics registry (server/metrics/registry.h), its text exposition (text_format.h) and the
// HTTP server of /metrics (http_server.h).
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/metrics/http_server.h"
#include "server/metrics/registry.h"
#include "server/metrics/text_format.h"
#include "tests/metrics_http.h"

namespace kvbank::metrics {
namespace {

// A small registry with every kind of family, label values that need escaping, and a collector.
void Populate(Registry* r) {
  auto requests =
      r->AddCounter("test_requests_total", "Requests \\ seen\nby path and code.", {"path", "code"});
  ASSERT_TRUE(requests.ok()) << requests.status();
  (*(*requests)->WithLabels({"c\\d\ne", "500"}))->Inc();
  (*(*requests)->WithLabels({"/a\"b", "200"}))->Inc(2);
  (*(*requests)->WithLabels({"/a\"b", "200"}))->Inc();
  auto in_flight = r->AddGauge("test_in_flight", "Calls in flight.");
  ASSERT_TRUE(in_flight.ok()) << in_flight.status();
  Gauge* g = *(*in_flight)->WithLabels({});
  g->Add(5);
  g->Add(-2);
  auto latency =
      r->AddHistogram("test_latency_seconds", "Latency.", {"method"}, {5e-05, 0.0001, 0.5, 2});
  ASSERT_TRUE(latency.ok()) << latency.status();
  Histogram* h = *(*latency)->WithLabels({"Get"});
  for (double v : {0.5, 0.25, 1.5, 100.0}) h->Observe(v);  // 0.5 sits on a bound: le counts it
  r->AddCollector([](std::vector<FamilySnapshot>* out) {
    AddFamily(out, "test_pool_usage", "Pool usage.", MetricType::kGauge)
        ->samples.push_back({"", {{"model", "m1"}}, 0.5});
  });
}

constexpr char kPopulated[] =
    "# HELP test_requests_total Requests \\\\ seen\\nby path and code.\n"
    "# TYPE test_requests_total counter\n"
    "test_requests_total{path=\"/a\\\"b\",code=\"200\"} 3\n"
    "test_requests_total{path=\"c\\\\d\\ne\",code=\"500\"} 1\n"
    "# HELP test_in_flight Calls in flight.\n"
    "# TYPE test_in_flight gauge\n"
    "test_in_flight 3\n"
    "# HELP test_latency_seconds Latency.\n"
    "# TYPE test_latency_seconds histogram\n"
    "test_latency_seconds_bucket{method=\"Get\",le=\"5e-05\"} 0\n"
    "test_latency_seconds_bucket{method=\"Get\",le=\"0.0001\"} 0\n"
    "test_latency_seconds_bucket{method=\"Get\",le=\"0.5\"} 2\n"
    "test_latency_seconds_bucket{method=\"Get\",le=\"2\"} 3\n"
    "test_latency_seconds_bucket{method=\"Get\",le=\"+Inf\"} 4\n"
    "test_latency_seconds_sum{method=\"Get\"} 102.25\n"
    "test_latency_seconds_count{method=\"Get\"} 4\n"
    "# HELP test_pool_usage Pool usage.\n"
    "# TYPE test_pool_usage gauge\n"
    "test_pool_usage{model=\"m1\"} 0.5\n";

TEST(MetricsTest, ExactTextOfASmallRegistry) {
  Registry r;
  ASSERT_NO_FATAL_FAILURE(Populate(&r));
  EXPECT_EQ(FormatText(r.Collect()), kPopulated);
}

TEST(MetricsTest, ValuesAndEscaping) {
  EXPECT_EQ(FormatValue(0), "0");
  EXPECT_EQ(FormatValue(-7), "-7");
  EXPECT_EQ(FormatValue(12345678901234.0), "12345678901234");
  EXPECT_EQ(FormatValue(0.1), "0.1");
  EXPECT_EQ(FormatValue(0.00025), "0.00025");
  EXPECT_EQ(FormatValue(5e-05), "5e-05");
  EXPECT_EQ(FormatValue(1.0 / 3), "0.3333333333333333");
  EXPECT_EQ(FormatValue(1e300), "1e+300");
  EXPECT_EQ(FormatValue(std::numeric_limits<double>::infinity()), "+Inf");
  EXPECT_EQ(FormatValue(-std::numeric_limits<double>::infinity()), "-Inf");
  EXPECT_EQ(FormatValue(std::nan("")), "NaN");
  EXPECT_EQ(EscapeLabelValue("a\\b\"c\nd\te"), "a\\\\b\\\"c\\nd\te");
  EXPECT_EQ(EscapeHelp("a\\b\"c\nd"), "a\\\\b\"c\\nd");  // HELP keeps its double quotes
}

TEST(MetricsTest, RegistrationIsChecked) {
  Registry r;
  EXPECT_EQ(r.AddCounter("requests", "no _total").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.AddGauge("1bad", "").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.AddGauge("bad-name", "").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.AddGauge("ok:name", "", {"__reserved"}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.AddGauge("ok_name", "", {"a", "a"}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.AddHistogram("h", "", {"le"}, {1}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.AddHistogram("h", "", {}, {2, 1}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.AddHistogram("h", "", {}, {}).status().code(), absl::StatusCode::kInvalidArgument);
  auto g = r.AddGauge("ok:name", "", {"a"});
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(r.AddCounter("ok:name", "").status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(r.AddGauge("ok:name", "").status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ((*g)->WithLabels({"x", "y"}).status().code(), absl::StatusCode::kInvalidArgument);
  // One child per label values, the same one each time.
  EXPECT_EQ(*(*g)->WithLabels({"x"}), *(*g)->WithLabels({"x"}));
  EXPECT_NE(*(*g)->WithLabels({"x"}), *(*g)->WithLabels({"y"}));
}

// Threads increment the same children while a scraper reads: counts are exact at the end, and
// no scrape sees a counter go down or a histogram whose buckets disagree with its count.
TEST(MetricsTest, ConcurrentIncrementsAreExact) {
  Registry r;
  Counter* c = *(*r.AddCounter("c_total", "", {}))->WithLabels({});
  Gauge* g = *(*r.AddGauge("g", "", {}))->WithLabels({});
  Histogram* h = *(*r.AddHistogram("h", "", {}, {1, 2}))->WithLabels({});
  constexpr int kThreads = 8, kPerThread = 50000;
  std::atomic<bool> done{false};
  std::atomic<int> scrapes{0};
  std::thread scraper([&] {
    uint64_t last = 0;
    while (!done.load()) {
      const std::vector<FamilySnapshot> fams = r.Collect();
      const uint64_t now = uint64_t(fams[0].samples[0].value);
      EXPECT_GE(now, last);
      last = now;
      const std::vector<Sample>& hs = fams[2].samples;  // le=1, le=2, +Inf, _sum, _count
      EXPECT_EQ(hs[2].value, hs[4].value);
      EXPECT_LE(hs[0].value, hs[1].value);
      EXPECT_LE(hs[1].value, hs[2].value);
      scrapes.fetch_add(1);
    }
  });
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        c->Inc();
        g->Add(1);
        h->Observe(double(i % 3));  // 0 and 1 in le=1, 2 in le=2
        g->Add(-1);
      }
      g->Add(t);
    });
  }
  for (std::thread& t : threads) t.join();
  done.store(true);
  scraper.join();
  EXPECT_GT(scrapes.load(), 0);
  EXPECT_EQ(c->Value(), uint64_t(kThreads) * kPerThread);
  EXPECT_EQ(g->Value(), kThreads * (kThreads - 1) / 2);
  const Histogram::Snapshot s = h->Read();
  const uint64_t n = uint64_t(kThreads) * kPerThread;
  const uint64_t twos = uint64_t(kThreads) * (kPerThread / 3);  // i % 3 == 2
  EXPECT_EQ(s.count, n);
  EXPECT_EQ(s.cumulative, (std::vector<uint64_t>{n - twos, n, n}));
  double sum = 0;
  for (int i = 0; i < kPerThread; ++i) sum += double(i % 3);
  EXPECT_DOUBLE_EQ(s.sum, kThreads * sum);
}

std::string Get(int port, const std::string& path, const std::string& method = "GET") {
  return testing_http::Request(port, path, method);
}

TEST(MetricsTest, HttpServesMetricsOnly) {
  Registry r;
  ASSERT_NO_FATAL_FAILURE(Populate(&r));
  auto server = HttpServer::Start("127.0.0.1:0", &r);
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  ASSERT_GT(port, 0);
  EXPECT_EQ((*server)->url(), absl::StrCat("http://127.0.0.1:", port, "/metrics"));

  const std::string ok = Get(port, "/metrics");
  EXPECT_TRUE(absl::StartsWith(ok, "HTTP/1.1 200 OK\r\n")) << ok;
  EXPECT_TRUE(
      absl::StrContains(ok, "\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"))
      << ok;
  EXPECT_EQ(testing_http::Body(ok), kPopulated);
  EXPECT_TRUE(absl::StrContains(ok, absl::StrCat("Content-Length: ", strlen(kPopulated), "\r\n")));

  // A scrape reads the values of that moment.
  (*(*r.AddCounter("late_total", "Added after the first scrape."))->WithLabels({}))->Inc(7);
  EXPECT_TRUE(absl::StrContains(Get(port, "/metrics?x=1"), "\nlate_total 7\n"));

  const std::string head = Get(port, "/metrics", "HEAD");
  EXPECT_TRUE(absl::StartsWith(head, "HTTP/1.1 200 OK\r\n")) << head;
  EXPECT_TRUE(absl::EndsWith(head, "\r\n\r\n")) << head;  // headers only
  for (const std::string path : {"/", "/metricsx", "/metrics/x", "/other"}) {
    const std::string a = Get(port, path);
    EXPECT_TRUE(absl::StartsWith(a, "HTTP/1.1 404")) << path << ": " << a;
  }
  const std::string post = Get(port, "/metrics", "POST");
  EXPECT_TRUE(absl::StartsWith(post, "HTTP/1.1 405")) << post;
}

TEST(MetricsTest, HttpAddressErrors) {
  Registry r;
  for (const std::string bad : {"", "9400", "localhost", ":9400", "127.0.0.1:x", "127.0.0.1:9400s",
                                "127.0.0.1:70000", "127.0.0.1:-1"}) {
    EXPECT_EQ(HttpServer::Start(bad, &r).status().code(), absl::StatusCode::kInvalidArgument)
        << bad;
  }
  auto first = HttpServer::Start("127.0.0.1:0", &r);
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string taken = absl::StrCat("127.0.0.1:", (*first)->port());
  auto second = HttpServer::Start(taken, &r);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(second.status().message(), taken)) << second.status();
}

TEST(MetricsTest, PortFileIsWrittenWhole) {
  const std::string path = absl::StrCat(testing::TempDir(), "/metrics_port_", getpid());
  ASSERT_TRUE(WritePortFile(path, 9400).ok());
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text, "9400\n");
  EXPECT_FALSE(std::ifstream(path + ".tmp").good());
  std::remove(path.c_str());
  EXPECT_EQ(WritePortFile("/nonexistent-dir/port", 1).code(), absl::StatusCode::kInternal);
}

}  // namespace
}  // namespace kvbank::metrics
