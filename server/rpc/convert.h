// Conversions between the wire messages (kvbank.v1) and the core's types, and the one place an
// absl::Status becomes a grpc::Status.
#ifndef KVBANK_SERVER_RPC_CONVERT_H_
#define KVBANK_SERVER_RPC_CONVERT_H_

#include <optional>

#include "absl/status/statusor.h"
#include "grpcpp/support/status.h"
#include "kvbank/v1/kvbank.pb.h"
#include "server/core/model_registry.h"

namespace kvbank::rpc {

// Server-wide defaults a ModelSpec falls back on.
struct ModelDefaults {
  uint64_t pool_bytes = uint64_t{1} << 30;
  DeviceSpec device;  // where every model's pool goes
  uint64_t staging_bytes = PoolOptions().staging_bytes;
  bool enable_prefix_caching = true;
  StoreOptions store;
  TierOptions tiers;  // every model's tiers below its pool
};

grpc::Status ToGrpcStatus(const absl::Status& s);

// DTYPE_UNSPECIFIED -> nullopt; an unknown enum value -> INVALID_ARGUMENT naming `field`.
absl::StatusOr<std::optional<DType>> FromProto(v1::DType d, const char* field);
v1::DType ToProto(DType d);

// Resolves a ModelSpec (preset or explicit shape, defaults filled in) into a ModelConfig.
// INVALID_ARGUMENT naming the field for anything inconsistent.
absl::StatusOr<ModelConfig> ToModelConfig(const v1::ModelSpec& spec, const ModelDefaults& defaults);
void ToProto(const SequenceStore& model, v1::ModelInfo* out);
void ToProto(const SequenceInfo& info, const std::string& model, v1::SequenceInfo* out);
void ToProto(const SequenceStore& model, const StoreStats& stats, v1::ModelStats* out);

absl::StatusOr<std::vector<ExtraKey>> ExtraKeysFromProto(
    const google::protobuf::RepeatedPtrField<v1::ExtraKey>& keys);
// Each hash must be 32 bytes; INVALID_ARGUMENT naming `field` otherwise.
absl::StatusOr<std::vector<BlockHash>> HashesFromProto(
    const google::protobuf::RepeatedPtrField<std::string>& hashes, const char* field);
void ToProto(const KvEvent& e, bool show_tenant, v1::KvEvent* out);

// Milliseconds from the wire into a lease: 0 -> nullopt (the default); `none` -> zero (no lease).
absl::StatusOr<std::optional<absl::Duration>> LeaseFromProto(uint64_t ms, bool none);

}  // namespace kvbank::rpc

#endif  // KVBANK_SERVER_RPC_CONVERT_H_
