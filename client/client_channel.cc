// Client::Connect: the channel (its message limits, retries off, a subchannel of its own), TLS
// credentials from PEM text or files, and the process-wide malloc tuning (ClientOptions).
#include "kvbank/client.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "client/client_internal.h"
#include "grpcpp/grpcpp.h"
#include "kvbank/v1/kvbank.grpc.pb.h"

namespace kvbank {

namespace {

// Matches the server's limit (server/rpc/service.h): a few chunks per message at most.
constexpr int kMaxMessageBytes = 4 << 20;

// `pem` when set, else the contents of `path` ("" when both are empty). `what` names the option in
// errors; a file must hold at least one PEM block.
absl::StatusOr<std::string> PemFrom(const char* what, const std::string& pem,
                                    const std::string& path) {
  if (!pem.empty() || path.empty()) return pem;
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat("TLS ", what, ": cannot read ", path, ": ", std::strerror(errno)));
  }
  std::stringstream text;
  text << in.rdbuf();
  if (text.str().find("-----BEGIN ") == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("TLS ", what, ": ", path, " is not PEM"));
  }
  return text.str();
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> TlsCredentials(
    const ClientTlsOptions& tls, grpc::ChannelArguments* args) {
  grpc::SslCredentialsOptions ssl;
  auto root = PemFrom("root CA", tls.root_ca_pem, tls.root_ca_path);
  auto cert = PemFrom("client certificate", tls.cert_chain_pem, tls.cert_chain_path);
  auto key = PemFrom("client key", tls.private_key_pem, tls.private_key_path);
  for (const auto* s : {&root, &cert, &key}) {
    if (!s->ok()) return s->status();
  }
  if (cert->empty() != key->empty()) {
    return absl::InvalidArgumentError(
        "TLS: a client certificate needs its private key and a key its certificate");
  }
  ssl.pem_root_certs = *root;
  ssl.pem_cert_chain = *cert;
  ssl.pem_private_key = *key;
  if (!tls.server_name_override.empty()) args->SetSslTargetNameOverride(tls.server_name_override);
  return grpc::SslCredentials(ssl);
}

// ClientOptions::tune_malloc: once per process, and never over the user's own setting.
void TuneMalloc() {
#if defined(__GLIBC__)
  static std::once_flag once;
  std::call_once(once, [] {
    if (std::getenv("MALLOC_TRIM_THRESHOLD_") != nullptr ||
        std::getenv("MALLOC_MMAP_THRESHOLD_") != nullptr) {
      return;
    }
    mallopt(M_TRIM_THRESHOLD, 64 << 20);
    mallopt(M_MMAP_THRESHOLD, 64 << 20);
  });
#endif
}

}  // namespace

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) { impl_->owner = this; }
Client::~Client() = default;

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const std::string& target,
                                                        ClientOptions options) {
  if (target.empty()) return absl::InvalidArgumentError("target is empty");
  if (options.chunk_bytes == 0 || options.chunk_bytes > uint64_t(kMaxMessageBytes) / 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk_bytes must be in (0, ", kMaxMessageBytes / 2, "]"));
  }
  if (options.tune_malloc) TuneMalloc();
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  // Each Client keeps its own connection (prefill and decode workers in one process don't share).
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  // The SDK sets no retry policy, yet gRPC's retry layer still buffers every call's ops: off, it
  // takes 10-15% off a small call (measured: CreateSequence + Free, bench/wire_bench --loop).
  args.SetInt(GRPC_ARG_ENABLE_RETRIES, 0);
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (options.tls.has_value()) {
    auto tls = TlsCredentials(*options.tls, &args);
    if (!tls.ok()) return tls.status();
    credentials = *std::move(tls);
  }
  impl->channel = grpc::CreateCustomChannel(target, credentials, args);
  impl->stub = v1::KvBank::NewStub(impl->channel);
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

}  // namespace kvbank
