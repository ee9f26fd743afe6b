// Limits that keep one tenant from locking the others out, as the tokens file sets them, against
// the real kvbankd through the real client on loopback.
#include "tests/integration/prefix_support.h"

namespace kvbank::integ {
namespace {

class HardeningTest : public KvbankdTest {
 protected:
  void WriteTokens(const std::string& text) {
    char path[] = "/tmp/kvbank-tokens-XXXXXX";
    const int fd = mkstemp(path);
    ASSERT_GE(fd, 0);
    close(fd);
    tokens_file_ = path;
    std::ofstream(tokens_file_) << text;
  }
  void TearDown() override {
    KvbankdTest::TearDown();
    if (!tokens_file_.empty()) std::remove(tokens_file_.c_str());
  }
  std::unique_ptr<Client> As(const std::string& token) {
    ClientOptions o;
    o.bearer_token = token;
    return NewClient(o);
  }
  // Creates sequences until the first failure (at most `limit` tries); returns how many it made
  // and that failure.
  std::pair<int, absl::Status> CreateUntilRefused(Client& c, int limit) {
    for (int made = 0; made < limit; ++made) {
      auto s = c.CreateSequence("m", absl::ZeroDuration());
      if (!s.ok()) return {made, s.status()};
    }
    return {limit, absl::OkStatus()};
  }
  std::string tokens_file_;
};

// 4 tenants on a model of 12 sequences: the 3 without max_sequences get 12 / 4 = 3 each, "big"
// gets its own 5; none of them can crowd the others out.
TEST_F(HardeningTest, EachTenantHasItsOwnSequenceLimit) {
  ASSERT_NO_FATAL_FAILURE(
      WriteTokens("token-of-a a\n"
                  "token-of-b b\n"
                  "token-of-big big max_sequences=5 max_blocks_fraction=0.5\n"
                  "token-of-ops ops admin\n"));
  ASSERT_NO_FATAL_FAILURE(
      StartServer({"--models=", "--max-sequences=12", "--auth-tokens-file=" + tokens_file_}));
  std::unique_ptr<Client> admin = As("token-of-ops");
  ASSERT_TRUE(admin->EnsureModel(SmallLayout("m"), 2 * kMiB).ok());

  std::unique_ptr<Client> a = As("token-of-a");
  auto [a_made, a_refused] = CreateUntilRefused(*a, 20);
  EXPECT_EQ(a_made, 3);
  EXPECT_EQ(a_refused.code(), absl::StatusCode::kResourceExhausted) << a_refused;
  EXPECT_TRUE(absl::StrContains(a_refused.message(), "tenant 'a'")) << a_refused;
  EXPECT_TRUE(absl::StrContains(a_refused.message(), "limit of 3 live sequences")) << a_refused;

  std::unique_ptr<Client> big = As("token-of-big");
  auto [big_made, big_refused] = CreateUntilRefused(*big, 20);
  EXPECT_EQ(big_made, 5);
  EXPECT_TRUE(absl::StrContains(big_refused.message(), "limit of 5 live sequences")) << big_refused;

  // b still gets its whole share after a and big took theirs.
  std::unique_ptr<Client> b = As("token-of-b");
  auto [b_made, b_refused] = CreateUntilRefused(*b, 20);
  EXPECT_EQ(b_made, 3) << b_refused;
  EXPECT_TRUE(absl::StrContains(b_refused.message(), "tenant 'b'")) << b_refused;
}

TEST_F(HardeningTest, BadMaxSequencesInTheTokensFileIsRefused) {
  for (const std::string bad : {"max_sequences=0", "max_sequences=-3", "max_sequences=x"}) {
    SCOPED_TRACE(bad);
    ASSERT_NO_FATAL_FAILURE(WriteTokens("token-of-a a " + bad + "\n"));
    auto server = ServerProcess::Start({"--models=", "--auth-tokens-file=" + tokens_file_});
    EXPECT_FALSE(server.ok()) << "kvbankd started with '" << bad << "'";
    if (!server.ok()) {
      EXPECT_TRUE(
          absl::StrContains(server.status().message(), "max_sequences must be a positive integer"))
          << server.status();
    }
    std::remove(tokens_file_.c_str());
    tokens_file_.clear();
  }
}

}  // namespace
}  // namespace kvbank::integ
