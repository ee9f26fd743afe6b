#include "kvbank/client.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "client/client_internal.h"
#include "client/fetch_decoder.h"
#include "client/nccl_link.h"
#include "client/shm_handshake.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "kvbank/v1/kvbank.grpc.pb.h"
#include "proto/convert.h"
#include "proto/wire.h"

namespace kvbank {

namespace internal {

absl::Status FromGrpc(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

Client::SequenceInfo FromProto(const v1::SequenceInfo& p) {
  Client::SequenceInfo s;
  s.model = p.model();
  s.id = p.sequence_id();
  s.length = p.length();
  s.layer_lengths.assign(p.layer_lengths().begin(), p.layer_lengths().end());
  s.num_blocks = p.num_blocks();
  s.cached_tokens = p.cached_tokens();
  s.lease_ttl = absl::Milliseconds(static_cast<int64_t>(p.lease_ttl_ms()));
  s.compactions = p.compactions();
  return s;
}

v1::AppendHeader MakeHeader(const std::string& model, uint64_t id, const Client::AppendArgs& a,
                            uint64_t payload_bytes) {
  v1::AppendHeader h;
  h.set_model(model);
  h.set_sequence_id(id);
  h.set_layer_begin(a.layer_begin);
  if (a.layer_end.has_value()) h.set_layer_end(*a.layer_end);
  h.set_num_tokens(a.num_tokens);
  if (a.dtype.has_value()) h.set_dtype(proto::DTypeToProto(*a.dtype));
  for (uint32_t t : a.token_ids) h.add_token_ids(t);
  h.set_payload_bytes(payload_bytes);
  h.set_kv_head_begin(a.kv_head_begin);
  if (a.kv_head_end.has_value()) h.set_kv_head_end(*a.kv_head_end);
  return h;
}

// A RegionSlice of the SDK as the proto message.
void SetSlice(const RegionSlice& slice, v1::RegionSlice* out) {
  out->set_region_id(slice.region_id);
  out->set_offset(slice.offset);
  out->set_length(slice.length);
}

v1::FetchRequest MakeFetchRequest(const std::string& model, uint64_t id,
                                  const Client::FetchArgs& args) {
  v1::FetchRequest req;
  req.set_model(model);
  req.set_sequence_id(id);
  req.set_token_begin(args.token_begin);
  if (args.token_end.has_value()) req.set_token_end(*args.token_end);
  req.set_layer_begin(args.layer_begin);
  if (args.layer_end.has_value()) req.set_layer_end(*args.layer_end);
  if (args.dtype.has_value()) req.set_dtype(proto::DTypeToProto(*args.dtype));
  req.set_kv_head_begin(args.kv_head_begin);
  if (args.kv_head_end.has_value()) req.set_kv_head_end(*args.kv_head_end);
  if (args.wait > absl::ZeroDuration()) {
    req.set_wait_ms(static_cast<uint32_t>(std::min<int64_t>(
        absl::ToInt64Milliseconds(absl::Ceil(args.wait, absl::Milliseconds(1))), UINT32_MAX)));
  }
  return req;
}

Client::FetchResult ResultFromHeader(const v1::FetchHeader& h, bool* dtype_ok) {
  Client::FetchResult r;
  r.token_begin = h.token_begin();
  r.num_tokens = h.num_tokens();
  r.layer_begin = h.layer_begin();
  r.layer_end = h.layer_end();
  r.kv_head_begin = h.kv_head_begin();
  r.kv_head_end = h.kv_head_end();
  std::optional<DType> dtype;
  *dtype_ok = proto::DTypeFromProto(h.dtype(), &dtype) && dtype.has_value();
  if (*dtype_ok) r.dtype = *dtype;
  r.payload_bytes = h.payload_bytes();
  return r;
}

std::string HashBytes(const BlockHash& h) { return std::string(h.begin(), h.end()); }

v1::FetchBlocksRequest MakeFetchBlocksRequest(const std::string& model,
                                              const std::vector<BlockHash>& hashes,
                                              const Client::FetchArgs& args) {
  v1::FetchBlocksRequest req;
  req.set_model(model);
  for (const BlockHash& h : hashes) req.add_block_hashes(HashBytes(h));
  req.set_layer_begin(args.layer_begin);
  if (args.layer_end.has_value()) req.set_layer_end(*args.layer_end);
  if (args.dtype.has_value()) req.set_dtype(proto::DTypeToProto(*args.dtype));
  req.set_kv_head_begin(args.kv_head_begin);
  if (args.kv_head_end.has_value()) req.set_kv_head_end(*args.kv_head_end);
  return req;
}

}  // namespace internal

using internal::FromGrpc;
using internal::FromProto;
using internal::HashBytes;
using internal::MakeFetchBlocksRequest;
using internal::MakeFetchRequest;
using internal::MakeHeader;

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

absl::StatusOr<Client::ModelInfo> FromProto(const v1::ModelInfo& p) {
  Client::ModelInfo m;
  if (!proto::LayoutFromResolvedSpec(p.spec(), &m.layout)) {
    return absl::InternalError(
        absl::StrCat("server sent an unreadable spec for model '", p.spec().name(), "'"));
  }
  m.fingerprint = p.fingerprint();
  m.block_bytes = p.block_bytes();
  m.num_blocks = p.num_blocks();
  m.pool_bytes = p.spec().pool_bytes();
  m.payload_bytes_per_token = p.payload_bytes_per_token();
  m.device = p.device();
  m.max_sequences = p.spec().max_sequences();
  m.max_tokens_per_sequence = p.spec().max_tokens_per_sequence();
  return m;
}

void SetLease(std::optional<absl::Duration> lease, uint64_t* ms, bool* none) {
  if (!lease.has_value()) return;
  if (*lease <= absl::ZeroDuration()) {
    *none = true;
  } else {
    *ms = static_cast<uint64_t>(absl::ToInt64Milliseconds(*lease));
  }
}

}  // namespace

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Client::~Client() = default;

namespace {

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

absl::StatusOr<Client::ModelInfo> Client::EnsureModel(const ModelLayout& layout,
                                                      uint64_t pool_bytes) {
  v1::EnsureModelRequest req;
  proto::LayoutToSpec(layout, req.mutable_spec());
  req.mutable_spec()->set_pool_bytes(pool_bytes);
  v1::EnsureModelResponse resp;
  if (auto s = impl_->Call(&v1::KvBank::Stub::EnsureModel, req, &resp); !s.ok()) return s;
  auto info = FromProto(resp.model());
  if (!info.ok()) return info.status();
  info->created = resp.created();
  impl_->Remember(*info);
  return info;
}

absl::Status Client::DropModel(const std::string& name) {
  v1::DropModelRequest req;
  req.set_name(name);
  v1::DropModelResponse resp;
  absl::Status s = impl_->Call(&v1::KvBank::Stub::DropModel, req, &resp);
  if (s.ok() || s.code() == absl::StatusCode::kNotFound) impl_->Forget(name);
  return s;
}

absl::StatusOr<Client::ModelInfo> Client::EnsurePreset(const std::string& name,
                                                       const std::string& preset,
                                                       std::optional<DType> storage,
                                                       uint64_t pool_bytes, uint32_t block_tokens) {
  v1::EnsureModelRequest req;
  v1::ModelSpec* spec = req.mutable_spec();
  spec->set_name(name);
  spec->set_preset(preset);
  if (storage.has_value()) spec->set_storage_dtype(proto::DTypeToProto(*storage));
  spec->set_pool_bytes(pool_bytes);
  spec->set_block_tokens(block_tokens);
  v1::EnsureModelResponse resp;
  if (auto s = impl_->Call(&v1::KvBank::Stub::EnsureModel, req, &resp); !s.ok()) return s;
  auto info = FromProto(resp.model());
  if (!info.ok()) return info.status();
  info->created = resp.created();
  impl_->Remember(*info);
  return info;
}

absl::StatusOr<std::vector<Client::ModelInfo>> Client::ListModels() {
  v1::ListModelsResponse resp;
  if (auto s = impl_->Call(&v1::KvBank::Stub::ListModels, v1::ListModelsRequest(), &resp); !s.ok())
    return s;
  std::vector<ModelInfo> out;
  for (const auto& m : resp.models()) {
    auto info = FromProto(m);
    if (!info.ok()) return info.status();
    impl_->Remember(*info);
    out.push_back(*std::move(info));
  }
  return out;
}

absl::StatusOr<Client::ModelInfo> Client::GetModel(const std::string& model) {
  {
    absl::MutexLock lock(&impl_->mu);
    if (auto it = impl_->models.find(model); it != impl_->models.end()) return it->second;
  }
  auto all = ListModels();
  if (!all.ok()) return all.status();
  for (const ModelInfo& m : *all) {
    if (m.layout.name == model) return m;
  }
  return absl::NotFoundError(absl::StrCat("model '", model, "' not found"));
}

absl::StatusOr<Client::ServerInfo> Client::GetServerInfo() {
  v1::GetServerInfoRequest req;
  v1::GetServerInfoResponse resp;
  if (auto s = impl_->Call(&v1::KvBank::Stub::GetServerInfo, req, &resp); !s.ok()) return s;
  ServerInfo info;
  info.version = resp.version();
  info.shm_socket = resp.shm_socket();
  info.replica = resp.replica();
  if (resp.has_cuda_ipc_device()) info.cuda_ipc_device = resp.cuda_ipc_device();
  info.nccl = resp.nccl();
  info.nccl_off = resp.nccl_off();
  info.host_id = resp.host_id();
  return info;
}

std::string LocalHostId() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(in, id);
  return id;
}

bool Client::ServerInfo::OnThisHost() const { return !host_id.empty() && host_id == LocalHostId(); }

absl::StatusOr<Client::SequenceInfo> Client::CreateSequence(const std::string& model,
                                                            std::optional<absl::Duration> lease) {
  CreateArgs args;
  args.lease = lease;
  return CreateSequence(model, args);
}

namespace {
void AddExtraKeys(const std::vector<ExtraKey>& keys,
                  google::protobuf::RepeatedPtrField<v1::ExtraKey>* out) {
  for (const ExtraKey& k : keys) {
    v1::ExtraKey* p = out->Add();
    p->set_kind(static_cast<v1::ExtraKeyKind>(k.kind));
    p->set_value(k.value);
  }
}
BlockHash HashFromBytes(const std::string& b) {
  BlockHash h{};
  std::memcpy(h.data(), b.data(), std::min(b.size(), h.size()));
  return h;
}
}  // namespace

absl::StatusOr<Client::SequenceInfo> Client::CreateSequence(const std::string& model,
                                                            const CreateArgs& args) {
  v1::CreateSequenceRequest req;
  req.set_model(model);
  uint64_t ms = 0;
  bool none = false;
  SetLease(args.lease, &ms, &none);
  req.set_lease_ttl_ms(ms);
  req.set_no_lease(none);
  for (uint32_t t : args.prompt) req.add_prompt_token_ids(t);
  req.set_cache_salt(args.cache_salt);
  AddExtraKeys(args.extra_keys, req.mutable_extra_keys());
  if (args.priority.has_value()) req.set_priority(*args.priority);
  req.mutable_retention()->set_kind(static_cast<v1::Retention::Kind>(args.retention_kind));
  req.mutable_retention()->set_window(args.window);
  req.mutable_retention()->set_sinks(args.sinks);
  req.mutable_retention()->set_budget(args.budget);
  v1::SequenceInfo resp;
  if (auto s = impl_->Call(&v1::KvBank::Stub::CreateSequence, req, &resp); !s.ok()) return s;
  return FromProto(resp);
}

absl::StatusOr<Client::SequenceInfo> Client::Impl::StreamAppend(
    const v1::AppendHeader& header, absl::Span<const absl::Span<const uint8_t>> pieces) {
  grpc::ClientContext ctx;
  Deadline(&ctx, true);
  // Raw messages (AppendRequest, encoded here): each chunk's data field is slices of the
  // caller's own memory, sent without a copy. The memory outlives every use: this call returns
  // only after the server has answered, so after it has received every byte.
  grpc::ByteBuffer raw_resp;
  std::unique_ptr<grpc::ClientWriter<grpc::ByteBuffer>> writer(
      grpc::internal::ClientWriterFactory<grpc::ByteBuffer>::Create(
          channel.get(),
          grpc::internal::RpcMethod("/kvbank.v1.KvBank/Append",
                                    grpc::internal::RpcMethod::CLIENT_STREAMING),
          &ctx, &raw_resp));
  std::string prefix;
  const std::string serialized_header = header.SerializeAsString();
  std::vector<grpc::Slice> slices;  // [prefix, data pieces...]
  uint64_t chunk = 0;               // data bytes in `slices`
  bool first = true, broken = false, closed = false;
  // last: the message also half-closes the stream (one step less for the server to wait on).
  auto flush = [&](bool last) {
    prefix.clear();
    if (first) {
      proto::AppendLengthDelimitedKey(1, serialized_header.size(), &prefix);
      prefix += serialized_header;
    }
    proto::AppendLengthDelimitedKey(2, chunk, &prefix);
    slices.insert(slices.begin(), grpc::Slice(prefix));
    grpc::ByteBuffer message(slices.data(), slices.size());
    grpc::WriteOptions write_options;
    if (last) write_options.set_last_message();
    closed = last;
    // false: the server ended the call; Finish tells why.
    if (!writer->Write(message, write_options)) broken = true;
    slices.clear();
    chunk = 0;
    first = false;
  };
  for (absl::Span<const uint8_t> piece : pieces) {
    while (!piece.empty() && !broken) {
      const size_t n = std::min<size_t>(piece.size(), options.chunk_bytes - chunk);
      slices.emplace_back(piece.data(), n, grpc::Slice::STATIC_SLICE);
      chunk += n;
      piece.remove_prefix(n);
      if (chunk == options.chunk_bytes) flush(/*last=*/false);
    }
  }
  if (!broken && (first || chunk > 0)) flush(/*last=*/true);
  if (!closed) writer->WritesDone();
  if (auto s = FromGrpc(writer->Finish()); !s.ok()) return s;
  v1::AppendResponse resp;
  if (!grpc::SerializationTraits<v1::AppendResponse>::Deserialize(&raw_resp, &resp).ok()) {
    return absl::InternalError("append answered with something that is not an AppendResponse");
  }
  return FromProto(resp.sequence());
}

absl::StatusOr<Client::SequenceInfo> Client::Append(const std::string& model, uint64_t id,
                                                    const AppendArgs& args,
                                                    absl::Span<const uint8_t> payload) {
  const absl::Span<const uint8_t> pieces[] = {payload};
  return impl_->StreamAppend(MakeHeader(model, id, args, payload.size()), pieces);
}

absl::StatusOr<Client::SequenceInfo> Client::AppendTensors(const std::string& model, uint64_t id,
                                                           const AppendArgs& args,
                                                           absl::Span<const uint8_t> k,
                                                           absl::Span<const uint8_t> v) {
  auto info = GetModel(model);
  if (!info.ok()) return info.status();
  BlockLayout b = ComputeBlockLayout(info->layout);
  const uint32_t l0 = args.layer_begin, l1 = args.layer_end.value_or(info->layout.num_layers);
  if (l0 >= l1 || l1 > b.num_layers()) {
    return absl::InvalidArgumentError(absl::StrCat("layer range [", l0, ", ", l1, ") is invalid"));
  }
  if (info->layout.kind != AttentionKind::kMla) {
    const uint32_t h0 = args.kv_head_begin;
    const uint32_t h1 = args.kv_head_end.value_or(info->layout.num_kv_heads);
    if (h0 >= h1 || h1 > info->layout.num_kv_heads) {
      return absl::InvalidArgumentError(absl::StrCat("kv head range [", h0, ", ", h1,
                                                     ") is empty or outside the model's ",
                                                     info->layout.num_kv_heads, " kv heads"));
    }
    if (h1 - h0 < info->layout.num_kv_heads) b = b.Heads(h0, h1 - h0);  // a rank's payload
  }
  // The tensors' dtype: as asked, else the server's default for the range (kvbank/layout.h).
  AppendArgs sent = args;
  if (!sent.dtype.has_value()) sent.dtype = DefaultWireDType(info->layout, l0, l1);
  const PayloadLayout p = PayloadLayout::Make(b, l0, l1, args.num_tokens, sent.dtype);
  // Per layer: its K slice then its V slice. Each slice is contiguous in the tensors.
  std::vector<absl::Span<const uint8_t>> pieces;
  uint64_t k_off = 0, v_off = 0;
  for (uint32_t l = l0; l < l1; ++l) {
    const uint64_t kb = p.KPartBytes(b, l), vb = p.VPartBytes(b, l);
    if (k_off + kb > k.size() || v_off + vb > v.size()) {
      return absl::InvalidArgumentError(absl::StrCat("k/v spans are smaller than ", l1 - l0,
                                                     " layers x ", args.num_tokens, " tokens of ",
                                                     DTypeName(*sent.dtype)));
    }
    pieces.push_back(k.subspan(k_off, kb));
    if (vb) pieces.push_back(v.subspan(v_off, vb));
    k_off += kb;
    v_off += vb;
  }
  if (k_off != k.size() || v_off != v.size()) {
    return absl::InvalidArgumentError(absl::StrCat("k/v spans are larger than ", l1 - l0,
                                                   " layers x ", args.num_tokens, " tokens of ",
                                                   DTypeName(*sent.dtype)));
  }
  return impl_->StreamAppend(MakeHeader(model, id, sent, k_off + v_off), pieces);
}

namespace {

// A server-streaming call to `method` whose responses are read raw (FetchDecoder decodes them).
template <typename Request>
absl::StatusOr<Client::FetchResult> RawFetch(grpc::Channel* channel, const char* method,
                                             grpc::ClientContext* ctx, const Request& req,
                                             FetchDecoder decoder = FetchDecoder()) {
  // The generated stub's own factory, for grpc::ByteBuffer responses.
  std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> reader(
      grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(
          channel, grpc::internal::RpcMethod(method, grpc::internal::RpcMethod::SERVER_STREAMING),
          ctx, req));
  grpc::ByteBuffer message;
  while (reader->Read(&message)) {
    if (absl::Status s = decoder.Add(message); !s.ok()) {
      ctx->TryCancel();
      reader->Finish();
      return s;
    }
  }
  if (auto s = FromGrpc(reader->Finish()); !s.ok()) return s;
  return std::move(decoder).Finish();
}

}  // namespace

absl::StatusOr<Client::FetchResult> Client::Fetch(const std::string& model, uint64_t id,
                                                  const FetchArgs& args) {
  grpc::ClientContext ctx;
  impl_->Deadline(&ctx, true);
  return RawFetch(impl_->channel.get(), "/kvbank.v1.KvBank/Fetch", &ctx,
                  MakeFetchRequest(model, id, args));
}

absl::StatusOr<Client::FetchResult> Client::FetchInto(const std::string& model, uint64_t id,
                                                      const FetchArgs& args,
                                                      absl::Span<uint8_t> out) {
  grpc::ClientContext ctx;
  impl_->Deadline(&ctx, true);
  return RawFetch(impl_->channel.get(), "/kvbank.v1.KvBank/Fetch", &ctx,
                  MakeFetchRequest(model, id, args), FetchDecoder(out));
}

absl::StatusOr<Client::FetchResult> Client::FetchBlocks(const std::string& model,
                                                        const std::vector<BlockHash>& hashes,
                                                        uint32_t layer_begin,
                                                        std::optional<uint32_t> layer_end) {
  v1::FetchBlocksRequest req;
  req.set_model(model);
  for (const BlockHash& h : hashes) req.add_block_hashes(HashBytes(h));
  req.set_layer_begin(layer_begin);
  if (layer_end.has_value()) req.set_layer_end(*layer_end);
  grpc::ClientContext ctx;
  impl_->Deadline(&ctx, true);
  return RawFetch(impl_->channel.get(), "/kvbank.v1.KvBank/FetchBlocks", &ctx, req);
}

absl::StatusOr<Client::FetchResult> Client::FetchBlocks(const std::string& model,
                                                        const std::vector<BlockHash>& hashes,
                                                        const FetchArgs& args) {
  const v1::FetchBlocksRequest req = MakeFetchBlocksRequest(model, hashes, args);
  grpc::ClientContext ctx;
  impl_->Deadline(&ctx, true);
  return RawFetch(impl_->channel.get(), "/kvbank.v1.KvBank/FetchBlocks", &ctx, req);
}

absl::StatusOr<std::vector<uint64_t>> Client::Match(const std::string& model,
                                                    const std::vector<MatchQuery>& queries) {
  auto r = MatchTiers(model, queries);
  if (!r.ok()) return r.status();
  std::vector<uint64_t> out;
  for (const MatchTiersResult& m : *r) out.push_back(m.tokens);
  return out;
}

absl::StatusOr<std::vector<Client::MatchTiersResult>> Client::MatchTiers(
    const std::string& model, const std::vector<MatchQuery>& queries, bool prefetch) {
  v1::MatchRequest req;
  req.set_model(model);
  req.set_prefetch(prefetch);
  for (const MatchQuery& q : queries) {
    v1::MatchQuery* p = req.add_queries();
    for (uint32_t t : q.tokens) p->add_token_ids(t);
    for (const BlockHash& h : q.hashes) p->add_block_hashes(HashBytes(h));
    p->set_cache_salt(q.cache_salt);
    AddExtraKeys(q.extra_keys, p->mutable_extra_keys());
  }
  v1::MatchResponse resp;
  if (auto s = impl_->Call(&v1::KvBank::Stub::Match, req, &resp); !s.ok()) return s;
  std::vector<MatchTiersResult> out(resp.cached_tokens_size());
  for (int i = 0; i < resp.cached_tokens_size(); ++i) {
    out[i].tokens = resp.cached_tokens(i);
    // A server without tiers (or an older one) sends cached_tokens only: all in its pool.
    out[i].pool_tokens = i < resp.pool_tokens_size() ? resp.pool_tokens(i) : out[i].tokens;
    out[i].host_tokens = i < resp.host_tokens_size() ? resp.host_tokens(i) : 0;
    out[i].disk_tokens = i < resp.disk_tokens_size() ? resp.disk_tokens(i) : 0;
  }
  return out;
}

absl::StatusOr<uint64_t> Client::Pin(const std::string& model, const MatchQuery& blocks, bool pin) {
  v1::PinRequest req;
  req.set_model(model);
  for (uint32_t t : blocks.tokens) req.add_token_ids(t);
  for (const BlockHash& h : blocks.hashes) req.add_block_hashes(HashBytes(h));
  req.set_cache_salt(blocks.cache_salt);
  AddExtraKeys(blocks.extra_keys, req.mutable_extra_keys());
  req.set_unpin(!pin);
  v1::PinResponse resp;
  if (auto s = impl_->Call(&v1::KvBank::Stub::Pin, req, &resp); !s.ok()) return s;
  return resp.blocks();
}

absl::StatusOr<Client::PrefixRootInfo> Client::GetPrefixRoot(const std::string& model,
                                                             const std::string& cache_salt) {
  v1::GetPrefixRootRequest req;
  req.set_model(model);
  req.set_cache_salt(cache_salt);
  v1::GetPrefixRootResponse resp;
  if (auto s = impl_->Call(&v1::KvBank::Stub::GetPrefixRoot, req, &resp); !s.ok()) return s;
  PrefixRootInfo info;
  info.root = HashFromBytes(resp.root_hash());
  if (!ParseHashAlgorithm(resp.hash_algorithm(), &info.algorithm)) {
    return absl::InternalError(
        absl::StrCat("unknown hash algorithm '", resp.hash_algorithm(), "'"));
  }
  info.block_tokens = resp.block_tokens();
  info.layout_fingerprint = resp.layout_fingerprint();
  info.tenant = resp.tenant();
  return info;
}

absl::Status Client::Watch(
    const std::string& model, uint64_t after_sequence, bool from_now, absl::Duration deadline,
    const std::function<bool(const std::vector<Event>&, uint64_t)>& on_batch) {
  v1::WatchRequest req;
  req.set_model(model);
  req.set_after_sequence(after_sequence);
  req.set_from_now(from_now);
  grpc::ClientContext ctx;
  impl_->Deadline(&ctx, false);
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  std::unique_ptr<grpc::ClientReader<v1::KvEventBatch>> reader(impl_->stub->Watch(&ctx, req));
  v1::KvEventBatch batch;
  while (reader->Read(&batch)) {
    std::vector<Event> events;
    for (const v1::KvEvent& p : batch.events()) {
      Event e;
      e.sequence = p.sequence();
      e.tenant = p.tenant();
      if (p.has_stored()) {
        e.type = Event::Type::kStored;
        for (const auto& h : p.stored().block_hashes()) e.hashes.push_back(HashFromBytes(h));
        if (!p.stored().parent_block_hash().empty()) {
          e.parent = HashFromBytes(p.stored().parent_block_hash());
        }
        e.token_ids.assign(p.stored().token_ids().begin(), p.stored().token_ids().end());
        e.block_size = p.stored().block_size();
        e.lora = p.stored().lora_name();
      } else if (p.has_removed()) {
        e.type = Event::Type::kRemoved;
        for (const auto& h : p.removed().block_hashes()) e.hashes.push_back(HashFromBytes(h));
      } else {
        e.type = Event::Type::kAllCleared;
      }
      events.push_back(std::move(e));
    }
    if (!on_batch(events, batch.last_sequence())) {
      ctx.TryCancel();
      reader->Finish();
      return absl::OkStatus();
    }
  }
  return FromGrpc(reader->Finish());
}

absl::Status Client::FetchTensors(const std::string& model, uint64_t id, const FetchArgs& args,
                                  absl::Span<uint8_t> k, absl::Span<uint8_t> v) {
  auto info = GetModel(model);
  if (!info.ok()) return info.status();
  auto r = Fetch(model, id, args);
  if (!r.ok()) return r.status();
  BlockLayout b = ComputeBlockLayout(info->layout);
  if (r->kv_head_end > r->kv_head_begin &&
      r->kv_head_end - r->kv_head_begin < info->layout.num_kv_heads) {
    b = b.Heads(r->kv_head_begin, r->kv_head_end - r->kv_head_begin);  // a head range's payload
  }
  const PayloadLayout p =
      PayloadLayout::Make(b, r->layer_begin, r->layer_end, r->num_tokens, r->dtype);
  uint64_t k_need = 0, v_need = 0;
  for (uint32_t l = r->layer_begin; l < r->layer_end; ++l) {
    k_need += p.KPartBytes(b, l);
    v_need += p.VPartBytes(b, l);
  }
  if (k.size() != k_need || v.size() != v_need || p.total_bytes != r->payload.size()) {
    return absl::InvalidArgumentError(absl::StrCat("k/v spans hold ", k.size(), "/", v.size(),
                                                   " bytes; the fetch has ", k_need, "/", v_need));
  }
  uint64_t k_off = 0, v_off = 0;
  for (uint32_t l = r->layer_begin; l < r->layer_end; ++l) {
    const uint64_t kb = p.KPartBytes(b, l), vb = p.VPartBytes(b, l);
    std::memcpy(k.data() + k_off, r->payload.data() + p.RowOffset(b, l, 0, 0, 0), kb);
    if (vb) std::memcpy(v.data() + v_off, r->payload.data() + p.RowOffset(b, l, 1, 0, 0), vb);
    k_off += kb;
    v_off += vb;
  }
  return absl::OkStatus();
}

absl::StatusOr<Client::SequenceInfo> Client::Fork(const std::string& model, uint64_t id,
                                                  std::optional<absl::Duration> lease) {
  v1::ForkRequest req;
  req.set_model(model);
  req.set_sequence_id(id);
  if (lease.has_value()) {
    req.set_lease_ttl_ms(
        static_cast<uint64_t>(std::max<int64_t>(0, absl::ToInt64Milliseconds(*lease))));
  }
  v1::SequenceInfo resp;
  if (auto s = impl_->Call(&v1::KvBank::Stub::Fork, req, &resp); !s.ok()) return s;
  return FromProto(resp);
}

absl::StatusOr<Client::SequenceInfo> Client::Truncate(const std::string& model, uint64_t id,
                                                      uint64_t num_tokens) {
  v1::TruncateRequest req;
  req.set_model(model);
  req.set_sequence_id(id);
  req.set_num_tokens(num_tokens);
  v1::SequenceInfo resp;
  if (auto s = impl_->Call(&v1::KvBank::Stub::Truncate, req, &resp); !s.ok()) return s;
  return FromProto(resp);
}

absl::StatusOr<uint64_t> Client::Free(const std::string& model, uint64_t id) {
  v1::FreeRequest req;
  req.set_model(model);
  req.set_sequence_id(id);
  v1::FreeResponse resp;
  if (auto s = impl_->Call(&v1::KvBank::Stub::Free, req, &resp); !s.ok()) return s;
  return resp.blocks_released();
}

absl::StatusOr<Client::SequenceInfo> Client::RenewLease(const std::string& model, uint64_t id) {
  v1::RenewLeaseRequest req;
  req.set_model(model);
  req.set_sequence_id(id);
  v1::SequenceInfo resp;
  if (auto s = impl_->Call(&v1::KvBank::Stub::RenewLease, req, &resp); !s.ok()) return s;
  return FromProto(resp);
}

absl::StatusOr<Client::SequenceInfo> Client::GetSequence(const std::string& model, uint64_t id) {
  v1::GetSequenceRequest req;
  req.set_model(model);
  req.set_sequence_id(id);
  v1::SequenceInfo resp;
  if (auto s = impl_->Call(&v1::KvBank::Stub::GetSequence, req, &resp); !s.ok()) return s;
  return FromProto(resp);
}

absl::StatusOr<std::vector<Client::AttendOutput>> Client::Attend(
    const std::string& model, const std::vector<AttendQuery>& queries, const AttendArgs& args) {
  v1::AttendRequest req;
  req.set_model(model);
  for (const AttendQuery& q : queries) {
    v1::AttendItem* it = req.add_items();
    it->set_sequence_id(q.sequence_id);
    it->set_layer(q.layer);
    it->mutable_query()->Add(q.query.begin(), q.query.end());
  }
  req.set_softmax_scale(args.softmax_scale);
  req.set_window(args.window);
  req.set_sinks(args.sinks);
  v1::AttendResponse resp;
  if (auto s = impl_->Call(&v1::KvBank::Stub::Attend, req, &resp); !s.ok()) return s;
  std::vector<AttendOutput> out;
  for (const v1::AttendResult& r : resp.results()) {
    out.push_back({std::vector<float>(r.output().begin(), r.output().end()),
                   std::vector<float>(r.lse().begin(), r.lse().end())});
  }
  return out;
}

absl::StatusOr<std::vector<Client::AttendOutput>> Client::Attend(
    const std::string& model, const std::vector<AttendQuery>& queries) {
  return Attend(model, queries, AttendArgs());
}

absl::Status Client::CheckServing(absl::Duration deadline) {
  const absl::Time until = absl::Now() + deadline;
  grpc::GenericStub generic(impl_->channel);
  absl::Status last = absl::DeadlineExceededError("no answer");
  for (;;) {
    // grpc.health.v1.Health/Check with an empty HealthCheckRequest (service ""). The reply is
    // HealthCheckResponse; field 1 (status) = 1 is SERVING, encoded as bytes 0x08 0x01. Not
    // wait_for_ready: a failed connection answers at once with its reason (refused, TLS
    // handshake), which is what the caller is told when the deadline passes.
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(std::min(until, absl::Now() + absl::Seconds(1))));
    grpc::ByteBuffer request, response;
    grpc::Slice empty;
    request = grpc::ByteBuffer(&empty, 1);
    absl::Notification done;
    grpc::Status status;
    generic.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request,
                      &response, [&](grpc::Status s) {
                        status = std::move(s);
                        done.Notify();
                      });
    done.WaitForNotification();
    if (status.ok()) {
      std::vector<grpc::Slice> slices;
      std::string bytes;
      if (response.Dump(&slices).ok()) {
        for (const auto& s : slices)
          bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
      }
      if (bytes == std::string("\x08\x01", 2)) return absl::OkStatus();
      last = absl::UnavailableError("the server answers but is not SERVING (it is draining)");
    } else if (status.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED ||
               absl::IsDeadlineExceeded(last)) {
      // A try cut short by the deadline says less than an earlier refusal with its reason.
      last = FromGrpc(status);
    }
    const absl::Time now = absl::Now();
    if (now >= until) break;
    // Between connection attempts the channel waits (gRPC's reconnect backoff); wake up when it
    // tries again rather than spinning on calls that fail at once.
    const grpc_connectivity_state state = impl_->channel->GetState(/*try_to_connect=*/true);
    if (state == GRPC_CHANNEL_TRANSIENT_FAILURE || state == GRPC_CHANNEL_CONNECTING) {
      impl_->channel->WaitForStateChange(
          state, absl::ToChronoTime(std::min(until, now + absl::Milliseconds(200))));
    } else {
      absl::SleepFor(std::min(until - now, absl::Milliseconds(50)));
    }
  }
  return absl::Status(last.code(),
                      absl::StrCat(last.message(), " (for ", absl::FormatDuration(deadline), ")"));
}

bool Client::WaitForServing(absl::Duration deadline) { return CheckServing(deadline).ok(); }

}  // namespace kvbank
