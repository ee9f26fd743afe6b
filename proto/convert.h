// Conversions between kvbank.v1 wire enums / specs and the layout types of kvbank/layout.h,
// shared by the server and the client SDK.
#ifndef KVBANK_PROTO_CONVERT_H_
#define KVBANK_PROTO_CONVERT_H_

#include <optional>
#include <string>

#include "kvbank/layout.h"
#include "kvbank/v1/kvbank.pb.h"

namespace kvbank::proto {

// DTYPE_UNSPECIFIED -> nullopt. Returns false for a value outside the enum.
bool DTypeFromProto(v1::DType d, std::optional<DType>* out);
v1::DType DTypeToProto(DType d);
// ATTENTION_KIND_UNSPECIFIED -> nullopt. Returns false for a value outside the enum.
bool KindFromProto(v1::AttentionKind k, std::optional<AttentionKind>* out);
v1::AttentionKind KindToProto(AttentionKind k);

// Writes the shape fields of `m` (name, dims, kind, dtypes per layer) into `spec`; leaves the
// preset and budget fields alone.
void LayoutToSpec(const ModelLayout& m, v1::ModelSpec* spec);
// Reads a fully resolved spec (as the server returns it in ModelInfo: every layer's dtype set)
// back into a layout. Returns false when a field is outside its enum.
bool LayoutFromResolvedSpec(const v1::ModelSpec& spec, ModelLayout* m);

}  // namespace kvbank::proto

#endif  // KVBANK_PROTO_CONVERT_H_
