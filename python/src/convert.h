// kvbank._kvbank's converters: C++ SDK values (kvbank/client.h, kvbank/fleet.h, kvbank/layout.h,
// kvbank/prefix_hash.h) to and from the Python values the bindings in module.cc, client_*.cc
// and fleet.cc take and return. One copy of each rule, so that the Client and the Fleet read a
// layout, a dtype name or a fetch range alike and hand back the same values.
//
// Errors: bad input and failed calls raise through RaiseStatus, which throws a C++ exception that
// the translator RegisterStatusTranslator installs turns into kvbank.Error's subclass for the
// gRPC code (kvbank/_errors.py), message unchanged; nothing here needs the GIL to raise.
//
// Thread safety: every function that takes or returns a pybind11 object REQUIRES the GIL held;
// the rest are pure.
#ifndef KVBANK_PYTHON_SRC_CONVERT_H_
#define KVBANK_PYTHON_SRC_CONVERT_H_

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kvbank/client.h"
#include "kvbank/fleet.h"
#include "kvbank/layout.h"
#include "kvbank/prefix_hash.h"

namespace kvbank::python {

// ---- errors ---------------------------------------------------------------------------------

// Registers the translator of RaiseStatus's exception; once, from the module's init.
void RegisterStatusTranslator();

// Raises kvbank.Error's subclass for s.code() with s.message(). REQUIRES: !s.ok().
[[noreturn]] void RaiseStatus(const absl::Status& s);
// Raises kvbank.InvalidArgumentError (a ValueError) with `message`.
[[noreturn]] void RaiseInvalid(std::string message);
inline void Check(const absl::Status& s) {
  if (!s.ok()) RaiseStatus(s);
}
template <typename T>
T Unwrap(absl::StatusOr<T> r) {
  if (!r.ok()) RaiseStatus(r.status());
  return *std::move(r);
}

// Runs f() (one SDK call returning absl::Status or absl::StatusOr<T>) with the GIL released, so
// other Python threads run while it waits; raises its error, else returns the value (T).
// REQUIRES: the GIL is held; f touches no Python object.
template <typename F>
auto CallWithoutGil(F&& f) {
  decltype(f()) r;
  {
    pybind11::gil_scoped_release release;
    r = f();
  }
  if constexpr (std::is_same_v<decltype(r), absl::Status>) {
    Check(r);
  } else {
    return Unwrap(std::move(r));
  }
}

// ---- names and scalars ----------------------------------------------------------------------

// "fp32", "fp16", "bf16", "int8", "fp8_e4m3", "fp8_e5m2"; anything else raises InvalidArgument.
DType ToDType(const std::string& s);
std::optional<DType> ToDType(const std::optional<std::string>& s);
// "mha", "gqa", "mqa", "mla".
AttentionKind ToKind(const std::string& s);
// "sha256", "xxh3_128".
HashAlgorithm ToAlgorithm(const std::string& s);
// (kind, value) pairs; kind is "lora", "multimodal", "prompt_embeds" or "custom".
std::vector<ExtraKey> ToExtraKeys(const std::vector<std::pair<std::string, pybind11::bytes>>& keys);
// A block hash is exactly 32 bytes; another length raises InvalidArgument.
BlockHash ToHash(const pybind11::bytes& b);
std::vector<BlockHash> ToHashes(const std::vector<pybind11::bytes>& v);
pybind11::bytes FromHash(const BlockHash& h);
pybind11::list FromHashes(const std::vector<BlockHash>& v);
// None stays unset; a negative (or NaN) number of seconds raises InvalidArgument.
std::optional<absl::Duration> ToDuration(std::optional<double> seconds);

// ---- buffers --------------------------------------------------------------------------------

// A C-contiguous view of a Python buffer (bytes, bytearray, memoryview, numpy array, ...), held
// for the duration of one call; the bytes may be used with the GIL released while it lives.
// A buffer that is not contiguous (or not writable, when asked) raises BufferError.
// REQUIRES: the GIL is held at construction and destruction.
class BufferView {
 public:
  BufferView(const pybind11::handle& obj, bool writable);
  ~BufferView();
  BufferView(const BufferView&) = delete;
  BufferView& operator=(const BufferView&) = delete;

  absl::Span<uint8_t> span() const {
    return {static_cast<uint8_t*>(view_.buf), static_cast<size_t>(view_.len)};
  }

 private:
  Py_buffer view_{};
};

// A numpy uint8 array [bytes.size()] that owns `bytes` (no copy: the vector becomes its base).
pybind11::array_t<uint8_t> ToArray(std::vector<uint8_t> bytes);
// A numpy float32 array [v.size()], a copy of v.
pybind11::array_t<float> ToFloatArray(const std::vector<float>& v);

// ---- layouts --------------------------------------------------------------------------------

// Every field of m, under its C++ name; dtypes and the kind by name. LayoutFromDict reads it back.
pybind11::dict LayoutToDict(const ModelLayout& m);
// The layout from LayoutToDict's dict, where any field may be left out (ModelLayout's default):
// "dtype" fills layer_dtypes (and input_dtype, when it is not quantized) where they are absent;
// head_dim_v defaults to head_dim except for MLA. An unknown key raises InvalidArgument (a
// misspelt field is not a default). Does not validate (ValidateLayout does).
ModelLayout LayoutFromDict(const pybind11::dict& d);

// ---- results --------------------------------------------------------------------------------

// Instances of the result dataclasses of kvbank/_types.py, built here with one keyword argument
// per field (a field named differently there raises TypeError at the first call), so the
// wrappers return them as they are. The classes are looked up at the first call, not at import:
// kvbank._types imports this module.
pybind11::object FromModelInfo(const Client::ModelInfo& i);  // layout: LayoutToDict's dict
pybind11::object FromSequenceInfo(const Client::SequenceInfo& s);
pybind11::object FromFetchResult(const Client::FetchResult& r);  // FetchInfo: not the payload
pybind11::object FromEvent(const Client::Event& e);  // type: stored, removed or all_cleared
pybind11::object FromPrefixRoot(const Client::PrefixRootInfo& r);
pybind11::object FromDeviceRegion(const Client::DeviceRegion& r);
pybind11::object FromReplica(const Fleet::Replica& r);
pybind11::object FromRoute(const Fleet::RouteDecision& r);
pybind11::dict FromFleetStats(const Fleet::Stats& s);
pybind11::object FromFleetSequence(const Fleet::Sequence& s);  // its info a SequenceInfo
// Client.stats's documented dicts (per-tenant rows under "tenants", dicts too).
pybind11::dict StatsToDict(const Client::ModelStats& s);

// ---- arguments ------------------------------------------------------------------------------

// lease_s: as ToDuration; the rest as Client::CreateArgs names them.
Client::CreateArgs MakeCreateArgs(
    std::optional<double> lease_s, std::vector<uint32_t> prompt, std::string cache_salt,
    const std::vector<std::pair<std::string, pybind11::bytes>>& extra_keys,
    std::optional<uint32_t> priority, uint32_t retention_kind, uint32_t window, uint32_t sinks,
    uint32_t budget);
Client::AppendArgs MakeAppendArgs(uint64_t num_tokens, uint32_t layer_begin,
                                  std::optional<uint32_t> layer_end,
                                  const std::optional<std::string>& dtype,
                                  std::vector<uint32_t> token_ids, uint32_t kv_head_begin,
                                  std::optional<uint32_t> kv_head_end);
// wait_s outside [0, 600] raises InvalidArgument.
Client::FetchArgs MakeFetchArgs(uint64_t token_begin, std::optional<uint64_t> token_end,
                                uint32_t layer_begin, std::optional<uint32_t> layer_end,
                                const std::optional<std::string>& dtype, uint32_t kv_head_begin,
                                std::optional<uint32_t> kv_head_end, double wait_s = 0);
// The same from a dict holding every one of those arguments under its name (kvbank/_fleet.py's
// _append_args and _fetch_args write them); a missing key raises KeyError.
Client::AppendArgs AppendArgsFromDict(const pybind11::dict& a);
Client::FetchArgs FetchArgsFromDict(const pybind11::dict& a);

Client::MatchQuery MakeQuery(
    std::vector<uint32_t> tokens, const std::vector<pybind11::bytes>& hashes,
    std::string cache_salt, const std::vector<std::pair<std::string, pybind11::bytes>>& extra_keys);
// A query as the tuple (tokens, hashes, cache_salt, extra_keys); another shape raises
// pybind11's cast error.
Client::MatchQuery QueryFromTuple(const pybind11::handle& q);

// Keys root_ca_pem, root_ca_path, cert_chain_pem, cert_chain_path, private_key_pem,
// private_key_path, server_name_override; another key raises InvalidArgument.
ClientTlsOptions TlsOptionsFromDict(const pybind11::dict& tls);

}  // namespace kvbank::python

#endif  // KVBANK_PYTHON_SRC_CONVERT_H_
