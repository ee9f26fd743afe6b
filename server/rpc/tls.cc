#include "server/rpc/tls.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/security/server_credentials.h"

namespace kvbank::rpc {
namespace {

struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct PkeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
using Bio = std::unique_ptr<BIO, BioFree>;
using Cert = std::unique_ptr<X509, X509Free>;
using Pkey = std::unique_ptr<EVP_PKEY, PkeyFree>;

absl::StatusOr<std::string> ReadPem(const char* flag, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": cannot read ", path, ": ", std::strerror(errno)));
  }
  std::stringstream text;
  text << in.rdbuf();
  if (text.str().empty())
    return absl::InvalidArgumentError(absl::StrCat(flag, ": ", path, " is empty"));
  return text.str();
}

Bio MemoryBio(const std::string& pem) {
  return Bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
}

// The first certificate of `pem` after checking that every PEM certificate in it parses; an
// error names the flag and file.
absl::StatusOr<Cert> ParseCertificates(const char* flag, const std::string& path,
                                       const std::string& pem) {
  Bio bio = MemoryBio(pem);
  Cert first;
  int count = 0;
  for (;;) {
    Cert c(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
    if (c == nullptr) break;
    if (first == nullptr) first = std::move(c);
    ++count;
  }
  // Reading stops at the end of the text (PEM_R_NO_START_LINE) or at a broken certificate.
  const unsigned long err = ERR_peek_last_error();
  const bool clean_end =
      ERR_GET_LIB(err) == ERR_LIB_PEM && ERR_GET_REASON(err) == PEM_R_NO_START_LINE;
  ERR_clear_error();
  if (count == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": ", path, " holds no PEM certificate (-----BEGIN CERTIFICATE-----)"));
  }
  if (!clean_end) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": ", path, ": certificate ", count + 1,
                                                   " is not a valid PEM certificate"));
  }
  return first;
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFromFlags(
    const TlsFiles& files) {
  if (files.cert_path.empty()) {
    if (!files.key_path.empty()) {
      return absl::InvalidArgumentError("--tls-key needs --tls-cert (the key's certificate)");
    }
    if (!files.client_ca_path.empty()) {
      return absl::InvalidArgumentError(
          "--tls-client-ca needs --tls-cert and --tls-key (client certificates are checked over "
          "TLS)");
    }
    return grpc::InsecureServerCredentials();
  }
  if (files.key_path.empty()) {
    return absl::InvalidArgumentError("--tls-cert needs --tls-key (the certificate's private key)");
  }
  auto cert_pem = ReadPem("--tls-cert", files.cert_path);
  if (!cert_pem.ok()) return cert_pem.status();
  auto key_pem = ReadPem("--tls-key", files.key_path);
  if (!key_pem.ok()) return key_pem.status();
  auto leaf = ParseCertificates("--tls-cert", files.cert_path, *cert_pem);
  if (!leaf.ok()) return leaf.status();
  Bio key_bio = MemoryBio(*key_pem);
  Pkey key(PEM_read_bio_PrivateKey(key_bio.get(), nullptr, nullptr, nullptr));
  ERR_clear_error();
  if (key == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tls-key: ", files.key_path, " holds no PEM private key (or one with a passphrase)"));
  }
  if (X509_check_private_key(leaf->get(), key.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(absl::StrCat("--tls-key: ", files.key_path,
                                                   " is not the private key of the certificate in ",
                                                   files.cert_path));
  }

  grpc::SslServerCredentialsOptions options(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  options.pem_key_cert_pairs.push_back({*key_pem, *cert_pem});
  if (!files.client_ca_path.empty()) {
    auto ca_pem = ReadPem("--tls-client-ca", files.client_ca_path);
    if (!ca_pem.ok()) return ca_pem.status();
    if (auto ca = ParseCertificates("--tls-client-ca", files.client_ca_path, *ca_pem); !ca.ok()) {
      return ca.status();
    }
    options.pem_root_certs = *ca_pem;
    options.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(options);
}

}  // namespace kvbank::rpc
