// The command lines of kvbankd and kvbank, run as real processes: help goes to stdout with exit 0,
// unknown flags and presets are refused with exit 2 and a message that says what would be valid,
// a dead address is reported within --timeout, and a demo that fails midway frees what it made.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gtest/gtest.h"
#include "kvbank/client.h"
#include "kvbank/layout.h"
#include "tests/integration/cli/run_process.h"
#include "tests/integration/server_fixture.h"

namespace kvbank::integ {
namespace {

ProcessResult Kvbank(std::vector<std::string> args) {
  args.insert(args.begin(), KvbankBinary());
  return RunProcess(args);
}

ProcessResult Kvbankd(std::vector<std::string> args) {
  args.insert(args.begin(), KvbankdBinary());
  return RunProcess(args, absl::Seconds(30));
}

// A loopback port bound but not listening: connections to it are refused for as long as the
// socket lives, and no other process can take the port meanwhile.
class DeadPort {
 public:
  DeadPort() {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    if (fd_ >= 0 && bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
        getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
      port_ = ntohs(a.sin_port);
    }
  }
  ~DeadPort() {
    if (fd_ >= 0) close(fd_);
  }
  int port() const { return port_; }
  std::string target() const { return absl::StrCat("127.0.0.1:", port_); }

 private:
  int fd_ = -1;
  int port_ = 0;
};

// Every flag kvbankd defines, as the README spells them.
const std::vector<std::string> kServerFlags = {"--listen",
                                               "--port-file",
                                               "--health-listen",
                                               "--health-port-file",
                                               "--log-format",
                                               "--log-errors-per-second",
                                               "--device",
                                               "--models",
                                               "--config",
                                               "--pool-bytes",
                                               "--max-pool-bytes",
                                               "--pool-memory-fraction",
                                               "--gpu-memory-utilization",
                                               "--max-sequences",
                                               "--max-tokens-per-sequence",
                                               "--default-lease-ms",
                                               "--max-lease-ms",
                                               "--lease-check-ms",
                                               "--chunk-bytes",
                                               "--staging-bytes",
                                               "--drain-timeout-ms",
                                               "--auth-tokens-file",
                                               "--no-auth",
                                               "--enable-prefix-caching",
                                               "--prefix-cache-ttl-ms",
                                               "--hash-algorithm",
                                               "--tls-cert",
                                               "--tls-key",
                                               "--tls-client-ca"};

TEST(KvbankdCommandLineTest, HelpListsEveryFlagWithDashesOnStdout) {
  for (const char* help : {"--help", "-h", "--helpfull"}) {
    SCOPED_TRACE(help);
    ProcessResult r = Kvbankd({help});
    ASSERT_EQ(r.exit_code, 0) << r.Describe();
    EXPECT_EQ(r.err, "") << r.Describe();
    EXPECT_FALSE(absl::StrContains(r.out, "No flags matched")) << r.Describe();
    for (const std::string& flag : kServerFlags) {
      EXPECT_TRUE(absl::StrContains(r.out, flag + " ") || absl::StrContains(r.out, flag + "\n"))
          << flag << " missing from:\n"
          << r.out;
    }
    // Dashes, not Abseil's underscores; defaults and help text with them.
    EXPECT_FALSE(absl::StrContains(r.out, "--pool_bytes")) << r.out;
    EXPECT_FALSE(absl::StrContains(r.out, "--tls_cert")) << r.out;
    EXPECT_TRUE(absl::StrContains(r.out, "(default: 127.0.0.1:50051)")) << r.out;
    EXPECT_TRUE(absl::StrContains(r.out, "address to serve on")) << r.out;
    EXPECT_TRUE(absl::StrContains(r.out, "(default: 65536)")) << r.out;
  }
}

TEST(KvbankdCommandLineTest, UnknownFlagIsRefusedWithTheClosestValidOne) {
  struct Case {
    std::vector<std::string> args;
    std::string unknown, suggestion;
  };
  const std::vector<Case> cases = {
      {{"--pool-byts=1GiB"}, "--pool-byts", "--pool-bytes"},
      {{"--lisen", "127.0.0.1:0"}, "--lisen", "--listen"},
      {{"--tls-crt=x.pem"}, "--tls-crt", "--tls-cert"},
      {{"--max_sequencse=4"}, "--max-sequencse", "--max-sequences"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.unknown);
    ProcessResult r = Kvbankd(c.args);
    EXPECT_EQ(r.exit_code, 2) << r.Describe();
    EXPECT_TRUE(absl::StrContains(r.err, c.unknown)) << r.Describe();
    EXPECT_TRUE(absl::StrContains(r.err, "did you mean " + c.suggestion + "?")) << r.Describe();
    EXPECT_EQ(r.out, "") << r.Describe();
  }
}

TEST(KvbankdCommandLineTest, BadValueOrStrayArgumentIsAUsageError) {
  ProcessResult r = Kvbankd({"--listen=127.0.0.1:0", "--models=", "--max-sequences=many"});
  EXPECT_EQ(r.exit_code, 2) << r.Describe();
  EXPECT_TRUE(absl::StrContains(r.err, "--max-sequences")) << r.Describe();
  EXPECT_TRUE(absl::StrContains(r.err, "many")) << r.Describe();
  r = Kvbankd({"--listen=127.0.0.1:0", "--models=", "--no-auth", "serve"});
  EXPECT_EQ(r.exit_code, 2) << r.Describe();
  EXPECT_TRUE(absl::StrContains(r.err, "'serve'")) << r.Describe();
}

TEST(KvbankdCommandLineTest, UnknownPresetListsTheKnownOnes) {
  ProcessResult r = Kvbankd(
      {"--listen=127.0.0.1:0", "--no-auth", "--pool-bytes=16MiB", "--models=llama-3.1-8b,gpt-9"});
  EXPECT_EQ(r.exit_code, 2) << r.Describe();
  EXPECT_TRUE(absl::StrContains(r.err, "'gpt-9'")) << r.Describe();
  for (const std::string& preset : PresetNames()) {
    EXPECT_TRUE(absl::StrContains(r.err, preset)) << preset << "\n" << r.Describe();
  }
}

TEST(KvbankCommandLineTest, HelpGoesToStdoutAndListsTheCommands) {
  for (std::vector<std::string> args : std::vector<std::vector<std::string>>{
           {"--help"}, {"-h"}, {"help"}, {"--server", "127.0.0.1:1", "--help"}}) {
    SCOPED_TRACE(args[0]);
    ProcessResult r = Kvbank(args);
    ASSERT_EQ(r.exit_code, 0) << r.Describe();
    EXPECT_EQ(r.err, "") << r.Describe();
    for (const char* word : {"stats", "models", "events", "demo", "plan", "--server", "--token",
                             "--timeout", "--tls-ca", "--tls-cert", "--tls-key"}) {
      EXPECT_TRUE(absl::StrContains(r.out, word)) << word << " missing from:\n" << r.out;
    }
  }
}

TEST(KvbankCommandLineTest, EveryCommandHasHelpWithItsFlags) {
  struct Case {
    std::string command;
    std::vector<std::string> flags;
  };
  const std::vector<Case> cases = {
      {"stats", {"--server", "--timeout", "--tls-ca"}},
      {"models", {"--server", "--timeout", "--tls-ca"}},
      {"events", {"--count", "--after", "--server"}},
      {"demo", {"--model", "--preset", "--tokens", "--rounds", "--server", "--timeout"}},
      {"plan", {"--preset", "--context", "--kv-dtype", "--gpu-memory", "--sweep"}},
  };
  for (const Case& c : cases) {
    for (std::vector<std::string> args :
         std::vector<std::vector<std::string>>{{c.command, "--help"},
                                               {c.command, "-h"},
                                               {"help", c.command},
                                               {"--help", c.command}}) {
      SCOPED_TRACE(absl::StrCat(args[0], " ", args[1]));
      ProcessResult r = Kvbank(args);
      ASSERT_EQ(r.exit_code, 0) << r.Describe();
      EXPECT_EQ(r.err, "") << r.Describe();
      EXPECT_TRUE(absl::StartsWith(r.out, "usage: kvbank " + c.command)) << r.out;
      for (const std::string& flag : c.flags) {
        EXPECT_TRUE(absl::StrContains(r.out, flag)) << flag << " missing from:\n" << r.out;
      }
    }
  }
  // demo's help names the presets --preset takes.
  ProcessResult r = Kvbank({"demo", "--help"});
  for (const std::string& preset : PresetNames()) {
    EXPECT_TRUE(absl::StrContains(r.out, preset)) << preset << "\n" << r.out;
  }
}

TEST(KvbankCommandLineTest, UnknownFlagIsRefusedNamingTheValidOnes) {
  DeadPort dead;  // nothing may be reached: the flags are refused before any connection
  ProcessResult r = Kvbank({"demo", "--tokns", "10", "--server", dead.target()});
  EXPECT_EQ(r.exit_code, 2) << r.Describe();
  EXPECT_TRUE(absl::StrContains(r.err, "--tokns")) << r.Describe();
  EXPECT_TRUE(absl::StrContains(r.err, "did you mean --tokens?")) << r.Describe();
  for (const char* valid : {"--model", "--preset", "--tokens", "--rounds", "--server"}) {
    EXPECT_TRUE(absl::StrContains(r.err, valid)) << valid << "\n" << r.Describe();
  }

  r = Kvbank({"stats", "--modle", "x", "--server", dead.target()});
  EXPECT_EQ(r.exit_code, 2) << r.Describe();
  EXPECT_TRUE(absl::StrContains(r.err, "--modle")) << r.Describe();
  EXPECT_TRUE(absl::StrContains(r.err, "--server")) << r.Describe();

  r = Kvbank({"--sever", dead.target(), "models"});
  EXPECT_EQ(r.exit_code, 2) << r.Describe();
  EXPECT_TRUE(absl::StrContains(r.err, "did you mean --server?")) << r.Describe();

  r = Kvbank({"stat", "--server", dead.target()});
  EXPECT_EQ(r.exit_code, 2) << r.Describe();
  EXPECT_TRUE(absl::StrContains(r.err, "unknown command 'stat'")) << r.Describe();
  EXPECT_TRUE(absl::StrContains(r.err, "did you mean stats?")) << r.Describe();

  r = Kvbank({"plan", "--kv-dtpye", "fp8"});
  EXPECT_EQ(r.exit_code, 2) << r.Describe();
  EXPECT_TRUE(absl::StrContains(r.err, "--kv-dtpye")) << r.Describe();
  for (const char* valid : {"--kv-dtype", "--preset", "--context", "--sweep"}) {
    EXPECT_TRUE(absl::StrContains(r.err, valid)) << valid << "\n" << r.Describe();
  }
}

TEST(KvbankCommandLineTest, PlanWithAnUnknownPresetListsTheKnownOnes) {
  ProcessResult r = Kvbank({"plan", "--preset", "gpt-9"});
  EXPECT_EQ(r.exit_code, 2) << r.Describe();
  EXPECT_TRUE(absl::StrContains(r.err, "'gpt-9'")) << r.Describe();
  for (const std::string& preset : PresetNames()) {
    EXPECT_TRUE(absl::StrContains(r.err, preset)) << preset << "\n" << r.Describe();
  }
}

TEST(KvbankCommandLineTest, DeadAddressIsReportedWithinTheTimeout) {
  DeadPort dead;
  ASSERT_GT(dead.port(), 0);
  struct Case {
    std::vector<std::string> args;
    absl::Duration within;
  };
  const std::vector<Case> cases = {
      {{"--timeout", "1", "stats", "--server", dead.target()}, absl::Seconds(6)},
      {{"models", "--server=" + dead.target(), "--timeout=0.5"}, absl::Seconds(6)},
      {{"demo", "--server", dead.target(), "--timeout", "1"}, absl::Seconds(6)},
      // The default wait is 3 s.
      {{"demo", "--server", dead.target()}, absl::Seconds(8)},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrJoin(c.args, " "));
    ProcessResult r = Kvbank(c.args);
    EXPECT_EQ(r.exit_code, 1) << r.Describe();
    EXPECT_LT(r.elapsed, c.within) << r.Describe();
    EXPECT_TRUE(absl::StrContains(r.err, "no kvbankd answers at " + dead.target())) << r.Describe();
    EXPECT_TRUE(absl::StrContains(r.err, "refused")) << r.Describe();
  }
}

class KvbankDemoTest : public KvbankdTest {
 protected:
  uint64_t Sequences() {
    auto client = NewClient();
    if (client == nullptr) return ~uint64_t{0};
    auto stats = client->GetStats("llama-3.1-8b");
    EXPECT_TRUE(stats.ok()) << stats.status();
    if (!stats.ok() || stats->empty()) return ~uint64_t{0};
    return (*stats)[0].sequences;
  }
};

TEST_F(KvbankDemoTest, StatsShowCachedBlocksEvictionsHitRateAndTenants) {
  ASSERT_NO_FATAL_FAILURE(StartServer({"--models=llama-3.1-8b", "--pool-bytes=64MiB"}));
  auto client = NewClient();
  ASSERT_NE(client, nullptr);
  // Two blocks' worth of prompt, stored, freed (its blocks stay cached), then asked for again:
  // 32 of the 64 prompt tokens looked up hit.
  auto models = client->ListModels();
  ASSERT_TRUE(models.ok() && !models->empty());
  const uint32_t bt = (*models)[0].layout.block_tokens;
  std::vector<uint32_t> prompt(2 * bt);
  for (uint32_t i = 0; i < prompt.size(); ++i) prompt[i] = 1000 + i;
  Client::CreateArgs args;
  args.prompt = prompt;
  auto first = client->CreateSequence("llama-3.1-8b", args);
  ASSERT_TRUE(first.ok()) << first.status();
  std::vector<uint8_t> kv((*models)[0].payload_bytes_per_token * prompt.size(), 7);
  Client::AppendArgs a;
  a.num_tokens = prompt.size();
  ASSERT_TRUE(client->Append("llama-3.1-8b", first->id, a, kv).ok());
  ASSERT_TRUE(client->Free("llama-3.1-8b", first->id).ok());
  auto second = client->CreateSequence("llama-3.1-8b", args);
  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_EQ(second->cached_tokens, prompt.size());

  ProcessResult r = Kvbank({"stats", "--server", server_->target()});
  ASSERT_EQ(r.exit_code, 0) << r.Describe();
  for (const std::string& want :
       {std::string("cached=0"), std::string("evictions=0"), std::string("used=2"),
        absl::StrCat("prefix hit rate=50.0% (", prompt.size(), " of ", 2 * prompt.size()),
        std::string("tenant ''"), std::string("sequences=1")}) {
    EXPECT_TRUE(absl::StrContains(r.out, want)) << want << "\n" << r.Describe();
  }
  EXPECT_FALSE(absl::StrContains(r.out, "tiers:")) << "no tier below the pool\n" << r.Describe();
  ASSERT_TRUE(client->Free("llama-3.1-8b", second->id).ok());
  r = Kvbank({"stats", "llama-3.1-8b", "--server", server_->target()});
  EXPECT_TRUE(absl::StrContains(r.out, "cached=2 used=0")) << r.Describe();

  // --watch refreshes --count times, with rates from the second refresh on.
  r = Kvbank({"stats", "--watch", "0.2", "--count", "2", "--server", server_->target()});
  ASSERT_EQ(r.exit_code, 0) << r.Describe();
  size_t refreshes = 0;
  for (size_t at = 0; (at = r.out.find("-- ", at)) != std::string::npos; ++at) ++refreshes;
  EXPECT_EQ(refreshes, 2u) << r.Describe();
  EXPECT_TRUE(absl::StrContains(r.out, "per second: appends=0.0")) << r.Describe();
  r = Kvbank({"stats", "--watch", "0", "--server", server_->target()});
  EXPECT_EQ(r.exit_code, 2) << r.Describe();
  EXPECT_TRUE(absl::StrContains(r.err, "--watch")) << r.Describe();
}

TEST_F(KvbankDemoTest, StatsShowTheTiers) {
  // llama-3.1-8b blocks are 2 MiB: a pool of 4 blocks over a host tier of 8.
  ASSERT_NO_FATAL_FAILURE(
      StartServer({"--models=llama-3.1-8b", "--pool-bytes=8MiB", "--host-tier-bytes=16MiB"}));
  auto client = NewClient();
  ASSERT_NE(client, nullptr);
  auto models = client->ListModels();
  ASSERT_TRUE(models.ok() && !models->empty());
  const uint32_t bt = (*models)[0].layout.block_tokens;
  for (uint32_t p = 0; p < 3; ++p) {  // 6 blocks through a pool of 4: some go to the host tier
    std::vector<uint32_t> prompt(2 * bt);
    for (uint32_t i = 0; i < prompt.size(); ++i) prompt[i] = 1000 * (p + 1) + i;
    auto seq = client->CreateSequence("llama-3.1-8b");
    ASSERT_TRUE(seq.ok()) << seq.status();
    std::vector<uint8_t> kv((*models)[0].payload_bytes_per_token * prompt.size(), 7);
    Client::AppendArgs a;
    a.num_tokens = prompt.size();
    a.token_ids = prompt;
    ASSERT_TRUE(client->Append("llama-3.1-8b", seq->id, a, kv).ok());
    ASSERT_TRUE(client->Free("llama-3.1-8b", seq->id).ok());
  }
  ProcessResult r = Kvbank({"stats", "--server", server_->target()});
  ASSERT_EQ(r.exit_code, 0) << r.Describe();
  EXPECT_TRUE(absl::StrContains(r.out, "  tiers: host=")) << r.Describe();
  EXPECT_TRUE(absl::StrContains(r.out, "/8 disk=0/0 blocks")) << r.Describe();
  auto stats = client->GetStats("llama-3.1-8b");
  ASSERT_TRUE(stats.ok() && stats->size() == 1 && (*stats)[0].tiers.has_value());
  EXPECT_GE((*stats)[0].tiers->host_blocks, 2u);
  EXPECT_TRUE(absl::StrContains(r.out, "spilled host=")) << r.Describe();
}

TEST_F(KvbankDemoTest, RunsAndLeavesNothingBehind) {
  // Underscores still work as well as dashes.
  ASSERT_NO_FATAL_FAILURE(StartServer({"--models=llama-3.1-8b", "--pool_bytes=64MiB"}));
  ProcessResult r =
      Kvbank({"demo", "--server", server_->target(), "--tokens", "40", "--rounds", "2"});
  ASSERT_EQ(r.exit_code, 0) << r.Describe();
  EXPECT_TRUE(absl::StrContains(r.out, "bit-exact round trip: yes")) << r.Describe();
  EXPECT_EQ(Sequences(), 0u);
}

TEST_F(KvbankDemoTest, FailingAppendFreesTheSequence) {
  // The sequence is created, then its first append is refused (over the token limit).
  ASSERT_NO_FATAL_FAILURE(
      StartServer({"--models=llama-3.1-8b", "--pool-bytes=64MiB", "--max-tokens-per-sequence=32"}));
  ProcessResult r = Kvbank({"demo", "--server", server_->target(), "--tokens", "40"});
  EXPECT_EQ(r.exit_code, 1) << r.Describe();
  EXPECT_TRUE(absl::StrContains(r.err, "kvbank: ")) << r.Describe();
  EXPECT_EQ(Sequences(), 0u) << r.Describe();
}

TEST_F(KvbankDemoTest, FailingForkFreesTheSequence) {
  // Append and fetch succeed; the fork is refused (one live sequence per model at most).
  ASSERT_NO_FATAL_FAILURE(
      StartServer({"--models=llama-3.1-8b", "--pool-bytes=64MiB", "--max-sequences=1"}));
  ProcessResult r = Kvbank({"demo", "--server", server_->target(), "--tokens", "40"});
  EXPECT_EQ(r.exit_code, 1) << r.Describe();
  EXPECT_TRUE(absl::StrContains(r.err, "max_sequences")) << r.Describe();
  EXPECT_EQ(Sequences(), 0u) << r.Describe();
}

TEST_F(KvbankDemoTest, UnknownPresetListsTheKnownOnes) {
  ASSERT_NO_FATAL_FAILURE(StartServer({"--models=", "--pool-bytes=16MiB"}));
  ProcessResult r =
      Kvbank({"demo", "--server", server_->target(), "--model", "m", "--preset", "gpt-9"});
  EXPECT_EQ(r.exit_code, 1) << r.Describe();
  EXPECT_TRUE(absl::StrContains(r.err, "'gpt-9'")) << r.Describe();
  for (const std::string& preset : PresetNames()) {
    EXPECT_TRUE(absl::StrContains(r.err, preset)) << preset << "\n" << r.Describe();
  }
}

}  // namespace
}  // namespace kvbank::integ
