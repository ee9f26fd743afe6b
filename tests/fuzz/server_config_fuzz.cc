// kvbankd's model configuration (--config): a ServerConfig text proto, every model resolved by
// rpc::ToModelConfig as the server does at start. Properties: no crash on any text; a resolved
// model has a valid layout (ValidateLayout) whose block layout is consistent; and the resolved
// layout, written back as a spec the way the server reports it (ModelInfo), reads back and
// resolves again to the same layout (the same fingerprint).
#include <string>

#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/text_format.h"
#include "kvbank/layout.h"
#include "kvbank/v1/kvbank.pb.h"
#include "proto/convert.h"
#include "server/rpc/convert.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvbank;
  const std::string text(reinterpret_cast<const char*>(data), size);
  v1::ServerConfig config;
  google::protobuf::TextFormat::Parser parser;
  parser.AllowPartialMessage(false);
  // Quiet: a fuzzer's texts are mostly invalid, and protobuf logs each error.
  struct Silent : google::protobuf::io::ErrorCollector {
    void AddError(int, int, const std::string&) override {}
  } silent;
  parser.RecordErrorsTo(&silent);
  if (!parser.ParseFromString(text, &config)) return 0;
  const rpc::ModelDefaults defaults;
  for (const v1::ModelSpec& spec : config.models()) {
    const auto c = rpc::ToModelConfig(spec, defaults);
    if (!c.ok()) {
      FUZZ_CHECK(c.status().code() == absl::StatusCode::kInvalidArgument);
      continue;
    }
    const ModelLayout& m = c->layout;
    FUZZ_CHECK(ValidateLayout(m).empty());
    FUZZ_CHECK(m.name == spec.name());
    const BlockLayout b = ComputeBlockLayout(m);
    FUZZ_CHECK(b.block_bytes > 0 && b.block_bytes % BlockLayout::kBlockAlign == 0);
    FUZZ_CHECK(b.block_tokens == m.block_tokens && b.num_layers() == m.num_layers);
    FUZZ_CHECK(c->pool_bytes == (spec.pool_bytes() ? spec.pool_bytes() : defaults.pool_bytes));

    v1::ModelSpec resolved;
    proto::LayoutToSpec(m, &resolved);
    ModelLayout back;
    FUZZ_CHECK(proto::LayoutFromResolvedSpec(resolved, &back));
    FUZZ_CHECK(LayoutFingerprint(back) == LayoutFingerprint(m));
    const auto again = rpc::ToModelConfig(resolved, defaults);
    FUZZ_CHECK(again.ok());
    FUZZ_CHECK(LayoutFingerprint(again->layout) == LayoutFingerprint(m));
  }
  return 0;
}
