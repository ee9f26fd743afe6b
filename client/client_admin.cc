// The Client's model registry and server calls: EnsureModel / EnsurePreset / DropModel /
// ListModels, the model cache GetModel reads, and GetServerInfo with the host check it feeds.
#include <fstream>

#include "absl/strings/str_cat.h"
#include "client/client_internal.h"
#include "kvbank/client.h"
#include "kvbank/v1/kvbank.grpc.pb.h"
#include "proto/convert.h"

namespace kvbank {

using internal::ModelFromProto;

absl::StatusOr<Client::ModelInfo> Client::EnsureModel(const ModelLayout& layout,
                                                      uint64_t pool_bytes) {
  v1::EnsureModelRequest req;
  proto::LayoutToSpec(layout, req.mutable_spec());
  req.mutable_spec()->set_pool_bytes(pool_bytes);
  return impl_->Ensure(req);
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
  return impl_->Ensure(req);
}

absl::StatusOr<std::vector<Client::ModelInfo>> Client::ListModels() {
  v1::ListModelsResponse resp;
  if (auto s = impl_->Call(&v1::KvBank::Stub::ListModels, v1::ListModelsRequest(), &resp); !s.ok())
    return s;
  std::vector<ModelInfo> out;
  for (const auto& m : resp.models()) {
    auto info = ModelFromProto(m);
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
  info.shm_control_version = resp.shm_control_version();
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

}  // namespace kvbank
