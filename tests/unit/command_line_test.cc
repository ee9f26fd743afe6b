// The command-line parser kvbankd and kvbank share.
#include "common/command_line.h"

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace kvbank::cmdline {
namespace {

const std::vector<FlagSpec> kFlags = {
    {"pool-bytes", "SIZE", "pool size", "1GiB"},
    {"tokens", "N", "tokens", "1000"},
    {"no-auth", "", "no authentication", "false"},
    {"sweep", "", "sweep", ""},
};

absl::StatusOr<ParsedArgs> P(std::vector<std::string> args, bool stop = false) {
  return Parse(args, kFlags, stop);
}

TEST(CommandLineTest, ValueFormsAndUnderscores) {
  auto a = P({"--pool-bytes=4GiB", "--tokens", "7", "pos", "--pool_bytes", "8GiB"});
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->Get("pool-bytes"), "8GiB");  // the last one wins
  EXPECT_EQ(a->Get("tokens"), "7");
  EXPECT_EQ(a->positional, std::vector<std::string>{"pos"});
  EXPECT_FALSE(a->help);
  EXPECT_FALSE(a->Has("sweep"));
}

TEST(CommandLineTest, Switches) {
  auto a = P({"--no-auth", "--sweep=false"});
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->Get("no-auth"), "true");
  EXPECT_EQ(a->Get("sweep"), "false");
  a = P({"--nosweep", "--no-sweep"});  // Abseil's spelling and the dashed one turn it off
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->Get("sweep"), "false");
  a = P({"--sweep=maybe"});
  ASSERT_FALSE(a.ok());
  EXPECT_TRUE(absl::StrContains(a.status().message(), "--sweep")) << a.status();
  // A switch does not take the next argument as its value.
  a = P({"--sweep", "true"});
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->positional, std::vector<std::string>{"true"});
}

TEST(CommandLineTest, HelpAndEndOfFlags) {
  for (const char* h : {"--help", "-h", "--helpfull"}) {
    auto a = P({"x", h});
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_TRUE(a->help) << h;
  }
  auto a = P({"--", "--tokens", "3"});
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->positional, (std::vector<std::string>{"--tokens", "3"}));
}

TEST(CommandLineTest, UnknownFlagNamesTheNearestOne) {
  auto a = P({"--tokns", "3"});
  ASSERT_FALSE(a.ok());
  EXPECT_TRUE(absl::IsNotFound(a.status())) << a.status();
  EXPECT_TRUE(absl::StrContains(a.status().message(), "unknown flag --tokns")) << a.status();
  EXPECT_TRUE(absl::StrContains(a.status().message(), "did you mean --tokens?")) << a.status();
  a = P({"--zzzzzzzz"});  // nothing near: no suggestion
  ASSERT_FALSE(a.ok());
  EXPECT_FALSE(absl::StrContains(a.status().message(), "did you mean")) << a.status();
}

TEST(CommandLineTest, MissingValue) {
  auto a = P({"--tokens"});
  ASSERT_FALSE(a.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(a.status())) << a.status();
  EXPECT_TRUE(absl::StrContains(a.status().message(), "--tokens needs a value")) << a.status();
}

TEST(CommandLineTest, StopAtPositional) {
  auto a = P({"--tokens=3", "demo", "--unknown-here", "x"}, /*stop=*/true);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->Get("tokens"), "3");
  EXPECT_EQ(a->rest, (std::vector<std::string>{"demo", "--unknown-here", "x"}));
  EXPECT_TRUE(a->positional.empty());
}

TEST(CommandLineTest, ClosestName) {
  const std::vector<std::string> names = {"listen", "pool-bytes", "max-pool-bytes", "tls-cert"};
  EXPECT_EQ(ClosestName("lisetn", names), "listen");    // a swap
  EXPECT_EQ(ClosestName("pool", names), "pool-bytes");  // cut short
  EXPECT_EQ(ClosestName("tls-crt", names), "tls-cert");
  EXPECT_EQ(ClosestName("device", names), "");
}

TEST(CommandLineTest, FormatFlagsShowsEveryFlagAndDefault) {
  const std::string text = FormatFlags(kFlags);
  EXPECT_TRUE(absl::StrContains(text, "--pool-bytes SIZE")) << text;
  EXPECT_TRUE(absl::StrContains(text, "(default: 1GiB)")) << text;
  EXPECT_TRUE(absl::StrContains(text, "--sweep")) << text;
  EXPECT_EQ(FlagList(kFlags), "--pool-bytes, --tokens, --no-auth, --sweep");
}

}  // namespace
}  // namespace kvbank::cmdline
