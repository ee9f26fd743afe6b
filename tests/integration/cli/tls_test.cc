// TLS and mutual TLS between the real kvbankd and the SDK / the kvbank CLI. The certificates are
// made at test time with the openssl command: two CAs, a server certificate for 127.0.0.1 and
// localhost (subjectAltName), a client certificate from each CA.
#include <sys/stat.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
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

constexpr char kModel[] = "llama-3.1-8b";

// The certificates every test uses, made once per test binary.
class Certificates {
 public:
  // Empty when every openssl command succeeded; else what failed.
  std::string error;
  std::string dir;
  std::string Path(const std::string& name) const { return dir + "/" + name; }

  static const Certificates& Get() {
    static const Certificates* certs = new Certificates();
    return *certs;
  }

 private:
  Certificates() {
    const char* tmp = std::getenv("TMPDIR");
    dir = absl::StrCat(tmp != nullptr && *tmp ? tmp : "/tmp", "/kvbank-tls-XXXXXX");
    if (mkdtemp(dir.data()) == nullptr) {
      error = "mkdtemp failed";
      return;
    }
    Write("server.ext",
          "basicConstraints=critical,CA:FALSE\n"
          "keyUsage=critical,digitalSignature,keyEncipherment\n"
          "extendedKeyUsage=serverAuth\n"
          "subjectAltName=IP:127.0.0.1,DNS:localhost\n");
    Write("client.ext",
          "basicConstraints=critical,CA:FALSE\n"
          "keyUsage=critical,digitalSignature,keyEncipherment\n"
          "extendedKeyUsage=clientAuth\n");
    MakeCa("ca");
    MakeCa("other-ca");
    MakeLeaf("server", "127.0.0.1", "ca", "server.ext", "1001");
    MakeLeaf("client", "kvbank-test-client", "ca", "client.ext", "1002");
    MakeLeaf("other-client", "kvbank-other-client", "other-ca", "client.ext", "1003");
    Write("garbage.pem",
          "-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydGlmaWNhdGU=\n"
          "-----END CERTIFICATE-----\n");
  }

  void Write(const std::string& name, const std::string& text) {
    std::ofstream(Path(name)) << text;
  }

  void Openssl(std::vector<std::string> args) {
    if (!error.empty()) return;
    args.insert(args.begin(), "openssl");
    ProcessResult r = RunProcess(args, absl::Seconds(60));
    if (r.exit_code != 0) {
      error = absl::StrCat(absl::StrJoin(args, " "), ": ",
                           r.exit_code == 127 ? "openssl is not installed "
                                                "(scripts/install-deps.sh installs it)"
                                              : r.Describe());
    }
  }

  // A self-signed CA: NAME.pem, NAME.key.
  void MakeCa(const std::string& name) {
    Openssl({"req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", Path(name + ".key"), "-out", Path(name + ".pem"), "-days", "2", "-subj",
             "/CN=kvbank-test-" + name, "-addext", "basicConstraints=critical,CA:TRUE", "-addext",
             "keyUsage=critical,keyCertSign,cRLSign"});
  }

  // A certificate signed by CA with the extensions in EXT: NAME.pem, NAME.key.
  void MakeLeaf(const std::string& name, const std::string& cn, const std::string& ca,
                const std::string& ext, const std::string& serial) {
    Openssl({"req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", Path(name + ".key"), "-out", Path(name + ".csr"), "-subj", "/CN=" + cn});
    Openssl({"x509", "-req", "-in", Path(name + ".csr"), "-CA", Path(ca + ".pem"), "-CAkey",
             Path(ca + ".key"), "-set_serial", serial, "-days", "2", "-extfile", Path(ext), "-out",
             Path(name + ".pem")});
  }
};

// Removes the certificates once every test has run.
class CertificatesCleanup : public ::testing::Environment {
 public:
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(Certificates::Get().dir, ec);
  }
};
::testing::Environment* const kCleanup =
    ::testing::AddGlobalTestEnvironment(new CertificatesCleanup);

class TlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(Certificates::Get().error, "") << "making the test certificates failed";
  }
  void TearDown() override {
    if (server_ == nullptr) return;
    absl::Status s = server_->Stop();
    EXPECT_TRUE(s.ok()) << "kvbankd shutdown: " << s;
    if (HasFailure()) std::cerr << "---- kvbankd log ----\n" << server_->Log() << "----\n";
  }

  static std::string Cert(const std::string& name) { return Certificates::Get().Path(name); }

  // kvbankd with TLS (and mTLS when `client_ca` is not empty), one small model.
  void StartTlsServer(const std::string& client_ca = "") {
    std::vector<std::string> flags = {"--models=llama-3.1-8b", "--pool-bytes=64MiB",
                                      "--tls-cert=" + Cert("server.pem"),
                                      "--tls-key=" + Cert("server.key")};
    if (!client_ca.empty()) flags.push_back("--tls-client-ca=" + client_ca);
    auto server = ServerProcess::Start(flags);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    // Serving is checked through TLS: with mTLS, as a client holding a certificate.
    ClientTlsOptions tls = Tls("ca.pem");
    if (!client_ca.empty()) tls = Tls("ca.pem", "client");
    auto client = Connect(tls);
    ASSERT_NE(client, nullptr);
    absl::Status serving = client->CheckServing(absl::Seconds(20));
    ASSERT_TRUE(serving.ok()) << serving << "\n" << server_->Log();
  }

  static ClientTlsOptions Tls(const std::string& ca, const std::string& client = "") {
    ClientTlsOptions t;
    t.root_ca_path = Cert(ca);
    if (!client.empty()) {
      t.cert_chain_path = Cert(client + ".pem");
      t.private_key_path = Cert(client + ".key");
    }
    return t;
  }

  std::unique_ptr<Client> Connect(std::optional<ClientTlsOptions> tls) {
    ClientOptions o;
    o.tls = std::move(tls);
    o.call_deadline = absl::Seconds(10);
    auto c = Client::Connect(server_->target(), o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  }

  // Create, append a few tokens on every layer, fetch them back: the bytes must be the same.
  ::testing::AssertionResult RoundTrip(Client& c) {
    auto models = c.ListModels();
    if (!models.ok()) return ::testing::AssertionFailure() << "ListModels: " << models.status();
    if (models->empty()) return ::testing::AssertionFailure() << "no model";
    const BlockLayout b = ComputeBlockLayout((*models)[0].layout);
    constexpr uint64_t kTokens = 5;
    std::vector<uint8_t> payload(b.PayloadBytes(0, b.layers.size(), kTokens));
    for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<uint8_t>(i * 7 + 3);
    auto seq = c.CreateSequence(kModel);
    if (!seq.ok()) return ::testing::AssertionFailure() << "CreateSequence: " << seq.status();
    Client::AppendArgs a;
    a.num_tokens = kTokens;
    if (auto r = c.Append(kModel, seq->id, a, payload); !r.ok()) {
      return ::testing::AssertionFailure() << "Append: " << r.status();
    }
    auto got = c.Fetch(kModel, seq->id, {});
    if (!got.ok()) return ::testing::AssertionFailure() << "Fetch: " << got.status();
    if (auto f = c.Free(kModel, seq->id); !f.ok()) {
      return ::testing::AssertionFailure() << "Free: " << f.status();
    }
    return BytesEqual(got->payload, payload);
  }

  // A client that must not get through: its health check and its calls fail.
  void ExpectRefused(std::optional<ClientTlsOptions> tls, const std::string& what) {
    SCOPED_TRACE(what);
    auto c = Connect(std::move(tls));
    ASSERT_NE(c, nullptr);
    EXPECT_FALSE(c->CheckServing(absl::Seconds(2)).ok());
    auto seq = c->CreateSequence(kModel);
    EXPECT_FALSE(seq.ok());
    if (!seq.ok()) {
      EXPECT_EQ(seq.status().code(), absl::StatusCode::kUnavailable) << seq.status();
    }
  }

  std::unique_ptr<ServerProcess> server_;
};

TEST_F(TlsTest, ClientWithTheCaRoundTrips) {
  ASSERT_NO_FATAL_FAILURE(StartTlsServer());
  auto c = Connect(Tls("ca.pem"));
  ASSERT_NE(c, nullptr);
  EXPECT_TRUE(RoundTrip(*c));
  // The certificate names localhost too; a name it does not hold is refused.
  ClientTlsOptions t = Tls("ca.pem");
  t.server_name_override = "localhost";
  auto by_name = Connect(t);
  ASSERT_NE(by_name, nullptr);
  EXPECT_TRUE(RoundTrip(*by_name));
  t.server_name_override = "kvbank.example.com";
  ExpectRefused(t, "a server name the certificate does not hold");
  // PEM text instead of a file.
  std::ifstream in(Cert("ca.pem"));
  ClientTlsOptions text;
  text.root_ca_pem.assign(std::istreambuf_iterator<char>(in), {});
  auto from_text = Connect(text);
  ASSERT_NE(from_text, nullptr);
  EXPECT_TRUE(RoundTrip(*from_text));
}

TEST_F(TlsTest, PlaintextAndWrongCaClientsAreRefused) {
  ASSERT_NO_FATAL_FAILURE(StartTlsServer());
  ExpectRefused(std::nullopt, "plaintext");
  ExpectRefused(Tls("other-ca.pem"), "a CA that did not sign the server's certificate");
}

TEST_F(TlsTest, MutualTlsNeedsAClientCertificateFromTheCa) {
  ASSERT_NO_FATAL_FAILURE(StartTlsServer(Cert("ca.pem")));
  ExpectRefused(Tls("ca.pem"), "no client certificate");
  ExpectRefused(Tls("ca.pem", "other-client"), "a client certificate from another CA");
  ExpectRefused(std::nullopt, "plaintext");
  auto c = Connect(Tls("ca.pem", "client"));
  ASSERT_NE(c, nullptr);
  EXPECT_TRUE(RoundTrip(*c));
}

TEST_F(TlsTest, CliTakesTlsFlags) {
  ASSERT_NO_FATAL_FAILURE(StartTlsServer(Cert("ca.pem")));
  const std::string server = server_->target();
  ProcessResult r =
      RunProcess({KvbankBinary(), "models", "--server", server, "--tls-ca", Cert("ca.pem"),
                  "--tls-cert", Cert("client.pem"), "--tls-key", Cert("client.key")});
  EXPECT_EQ(r.exit_code, 0) << r.Describe();
  EXPECT_TRUE(absl::StrContains(r.out, kModel)) << r.Describe();

  r = RunProcess(
      {KvbankBinary(), "models", "--server", server, "--tls-ca", Cert("ca.pem"), "--timeout", "1"});
  EXPECT_EQ(r.exit_code, 1) << r.Describe();
  EXPECT_TRUE(absl::StrContains(r.err, "no kvbankd answers at " + server)) << r.Describe();

  r = RunProcess({KvbankBinary(), "models", "--server", server, "--timeout", "1"});
  EXPECT_EQ(r.exit_code, 1) << r.Describe();
  EXPECT_TRUE(absl::StrContains(r.err, "no kvbankd answers at " + server)) << r.Describe();

  r = RunProcess({KvbankBinary(), "models", "--server", server, "--tls-cert", Cert("client.pem")});
  EXPECT_EQ(r.exit_code, 2) << r.Describe();
  EXPECT_TRUE(absl::StrContains(r.err, "--tls-key")) << r.Describe();
}

TEST_F(TlsTest, BadServerFilesAreNamed) {
  struct Case {
    std::vector<std::string> flags;
    std::vector<std::string> want;  // in the error
  };
  const std::string missing = Cert("no-such-file.pem");
  const std::vector<Case> cases = {
      {{"--tls-cert=" + missing, "--tls-key=" + Cert("server.key")}, {"--tls-cert", missing}},
      {{"--tls-cert=" + Cert("server.pem"), "--tls-key=" + missing}, {"--tls-key", missing}},
      {{"--tls-cert=" + Cert("garbage.pem"), "--tls-key=" + Cert("server.key")},
       {"--tls-cert", Cert("garbage.pem")}},
      {{"--tls-cert=" + Cert("server.pem"), "--tls-key=" + Cert("server.pem")},
       {"--tls-key", Cert("server.pem"), "private key"}},
      {{"--tls-cert=" + Cert("server.pem"), "--tls-key=" + Cert("client.key")},
       {"--tls-key", Cert("client.key"), "not the private key"}},
      {{"--tls-cert=" + Cert("server.pem"), "--tls-key=" + Cert("server.key"),
        "--tls-client-ca=" + Cert("garbage.pem")},
       {"--tls-client-ca", Cert("garbage.pem")}},
      {{"--tls-key=" + Cert("server.key")}, {"--tls-key needs --tls-cert"}},
      {{"--tls-cert=" + Cert("server.pem")}, {"--tls-cert needs --tls-key"}},
      {{"--tls-client-ca=" + Cert("ca.pem")}, {"--tls-client-ca needs --tls-cert"}},
  };
  for (const Case& c : cases) {
    std::vector<std::string> args = {KvbankdBinary(), "--listen=127.0.0.1:0", "--no-auth",
                                     "--models="};
    args.insert(args.end(), c.flags.begin(), c.flags.end());
    SCOPED_TRACE(absl::StrJoin(args, " "));
    ProcessResult r = RunProcess(args, absl::Seconds(30));
    EXPECT_EQ(r.exit_code, 2) << r.Describe();
    for (const std::string& w : c.want) {
      EXPECT_TRUE(absl::StrContains(r.err, w)) << w << "\n" << r.Describe();
    }
  }
}

TEST_F(TlsTest, BadClientOptionsAreRefusedAtConnect) {
  ClientOptions o;
  o.tls = Tls("no-such-ca.pem");
  auto c = Client::Connect("127.0.0.1:1", o);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(c.status().message(), Cert("no-such-ca.pem"))) << c.status();

  o.tls = Tls("ca.pem");
  o.tls->cert_chain_path = Cert("client.pem");  // without its key
  c = Client::Connect("127.0.0.1:1", o);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvbank::integ
