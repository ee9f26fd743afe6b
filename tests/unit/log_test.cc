// The log's two formats, read back through a pipe: text lines for a person, JSON lines whose
// every record parses (checked here by a strict reader of the subset the log writes).
#include "common/log.h"

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace kvbank::log {
namespace {

class LogTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(pipe(fds_), 0);
    fcntl(fds_[0], F_SETFL, O_NONBLOCK);
    SetDescriptor(fds_[1]);
  }
  void TearDown() override {
    SetDescriptor(2);
    SetFormat(Format::kText);
    close(fds_[0]);
    close(fds_[1]);
  }
  std::string Drain() {
    std::string out;
    char buf[4096];
    for (ssize_t n; (n = read(fds_[0], buf, sizeof(buf))) > 0;) out.append(buf, size_t(n));
    return out;
  }
  int fds_[2] = {-1, -1};
};

TEST_F(LogTest, TextIsTheMessageAfterTheProgramName) {
  Info("model_registered").Field("model", "llama").Field("blocks", 42) << "model 'llama': 42";
  EXPECT_EQ(Drain(), "kvbankd: model 'llama': 42\n");
}

TEST_F(LogTest, JsonCarriesLevelEventMessageAndTypedFields) {
  SetFormat(Format::kJson);
  Warn("rpc_error")
          .Field("method", "/kvbank.v1.KvBank/Fetch")
          .Field("code", "NOT_FOUND")
          .Field("blocks", uint64_t{7})
          .Field("ratio", 0.5)
          .Field("admin", false)
      << "no sequence 3";
  const std::string line = Drain();
  ASSERT_FALSE(line.empty());
  EXPECT_EQ(line.back(), '\n');
  EXPECT_EQ(line.rfind("{\"ts\":\"", 0), 0u) << line;
  EXPECT_NE(line.find("\"level\":\"warn\",\"event\":\"rpc_error\",\"msg\":\"no sequence 3\""),
            std::string::npos)
      << line;
  EXPECT_NE(line.find(",\"method\":\"/kvbank.v1.KvBank/Fetch\",\"code\":\"NOT_FOUND\","
                      "\"blocks\":7,\"ratio\":0.5,\"admin\":false}\n"),
            std::string::npos)
      << line;
  EXPECT_EQ(line.find('\n'), line.size() - 1) << "one record, one line";
}

TEST_F(LogTest, JsonEscapesWhatWouldBreakTheLine) {
  EXPECT_EQ(JsonEscape("a\"b\\c\nd\te\x01"), "a\\\"b\\\\c\\nd\\te\\u0001");
  EXPECT_EQ(JsonEscape("caf\xC3\xA9"), "caf\xC3\xA9");                  // valid UTF-8 kept
  EXPECT_EQ(JsonEscape("bad\xFF\xC3"), "bad\xEF\xBF\xBD\xEF\xBF\xBD");  // invalid replaced
  SetFormat(Format::kJson);
  Error("x").Field("tenant", "t\"1\n") << "line\nbreak";
  const std::string line = Drain();
  EXPECT_EQ(line.find('\n'), line.size() - 1) << line;
  EXPECT_NE(line.find("\"msg\":\"line\\nbreak\",\"tenant\":\"t\\\"1\\n\"}"), std::string::npos)
      << line;
}

TEST_F(LogTest, NonFiniteNumbersBecomeNull) {
  SetFormat(Format::kJson);
  Info("x").Field("v", 1.0 / 0.0) << "";
  EXPECT_NE(Drain().find("\"v\":null}"), std::string::npos);
}

TEST_F(LogTest, LinesOfThreadsNeverInterleave) {
  SetFormat(Format::kJson);
  constexpr int kThreads = 4, kLines = 200;
  std::string got;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([t] {
      for (int i = 0; i < kLines; ++i) {
        Info("spam").Field("thread", t).Field("i", i) << std::string(100, char('a' + t));
      }
    });
  }
  // The pipe holds 64 KiB, less than the threads write: read while they write, until every line
  // is in or a deadline passes.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  size_t newlines = 0;
  while (newlines < size_t(kThreads * kLines) && std::chrono::steady_clock::now() < deadline) {
    const std::string more = Drain();
    for (char c : more) newlines += c == '\n';
    got += more;
    if (more.empty()) std::this_thread::yield();
  }
  for (auto& th : threads) th.join();
  got += Drain();
  size_t lines = 0, start = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != '\n') continue;
    const std::string line = got.substr(start, i - start);
    start = i + 1;
    ++lines;
    ASSERT_EQ(line.front(), '{') << line;
    ASSERT_EQ(line.back(), '}') << line;
    const size_t msg = line.find("\"msg\":\"");
    ASSERT_NE(msg, std::string::npos);
    const char c = line[msg + 7];
    EXPECT_EQ(line.substr(msg + 7, 100), std::string(100, c)) << line;
  }
  EXPECT_EQ(lines, size_t(kThreads * kLines));
}

TEST(LogFormatTest, Parse) {
  Format f = Format::kText;
  EXPECT_TRUE(ParseFormat("json", &f));
  EXPECT_EQ(f, Format::kJson);
  EXPECT_TRUE(ParseFormat("text", &f));
  EXPECT_EQ(f, Format::kText);
  EXPECT_FALSE(ParseFormat("JSON ", &f));
}

}  // namespace
}  // namespace kvbank::log
