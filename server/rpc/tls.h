// Transport security of the listening port: TLS from PEM files, optionally requiring client
// certificates (mutual TLS). Without a certificate the port is plaintext, and bearer tokens
// travel in clear text.
#ifndef KVBANK_SERVER_RPC_TLS_H_
#define KVBANK_SERVER_RPC_TLS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/security/server_credentials.h"

namespace kvbank::rpc {

// The files named by kvbankd's --tls-cert, --tls-key and --tls-client-ca; empty: not given.
struct TlsFiles {
  std::string cert_path;       // certificate chain, leaf first (PEM)
  std::string key_path;        // the leaf's private key (PEM)
  std::string client_ca_path;  // CAs that sign client certificates (PEM); set: mTLS
};

// No file given: insecure (plaintext) credentials. cert and key given: TLS; with client_ca_path
// as well, every client must present a certificate that chains to one of those CAs.
// INVALID_ARGUMENT, naming the flag and the file, when a file cannot be read or holds no valid PEM
// certificate / private key, when the key does not belong to the certificate, or when the flags
// do not go together (a key without a certificate, a client CA without a certificate).
// Reads the files once; the credentials hold their contents.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFromFlags(
    const TlsFiles& files);

}  // namespace kvbank::rpc

#endif  // KVBANK_SERVER_RPC_TLS_H_
