// A client of the shared-memory plane for integ_shm_test to SIGKILL in the middle of a transfer.
//
//   shm_client append|fetch TARGET SHM_SOCKET MODEL SEQUENCE NUM_TOKENS SEED
//
// Registers a region of one payload (NUM_TOKENS tokens of MODEL, filled from SEED for append),
// prints "region ID", then loops until killed or a call fails:
//   append  AppendFromRegion(SEQUENCE, NUM_TOKENS tokens), then Truncate(SEQUENCE, 0)
//   fetch   FetchToRegion(SEQUENCE)
// printing "op N" after each round. A failed call prints "error CODE MESSAGE" and exits 1.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "kvbank/client.h"
#include "tests/integration/kv_reference.h"

namespace kvbank::integ {
namespace {

int Fail(const absl::Status& s) {
  std::printf("error %d %s\n", static_cast<int>(s.code()), std::string(s.message()).c_str());
  std::fflush(stdout);
  return 1;
}

int Run(char** argv) {
  const std::string mode = argv[1], model = argv[4];
  const uint64_t seq = std::strtoull(argv[5], nullptr, 10);
  const uint64_t num_tokens = std::strtoull(argv[6], nullptr, 10);
  const uint64_t seed = std::strtoull(argv[7], nullptr, 10);
  ClientOptions options;
  options.shm_socket = argv[3];
  auto client = Client::Connect(argv[2], options);
  if (!client.ok()) return Fail(client.status());
  auto info = (*client)->GetModel(model);
  if (!info.ok()) return Fail(info.status());
  const uint64_t bytes = num_tokens * info->payload_bytes_per_token;
  auto region = (*client)->RegisterRegion(bytes);
  if (!region.ok()) return Fail(region.status());
  if (mode == "append") Random(seed).Fill((*region)->data(), bytes);
  std::printf("region %llu\n", static_cast<unsigned long long>((*region)->id()));
  std::fflush(stdout);
  for (uint64_t op = 1;; ++op) {
    if (mode == "append") {
      Client::AppendArgs args;
      args.num_tokens = num_tokens;
      auto r = (*client)->AppendFromRegion(model, seq, args, (*region)->Slice(0, bytes));
      if (!r.ok()) return Fail(r.status());
      auto t = (*client)->Truncate(model, seq, 0);
      if (!t.ok()) return Fail(t.status());
    } else {
      auto r = (*client)->FetchToRegion(model, seq, {}, (*region)->Slice(0, bytes));
      if (!r.ok()) return Fail(r.status());
    }
    std::printf("op %llu\n", static_cast<unsigned long long>(op));
    std::fflush(stdout);
  }
}

}  // namespace
}  // namespace kvbank::integ

int main(int argc, char** argv) {
  if (argc != 8) {
    std::fprintf(stderr,
                 "usage: shm_client append|fetch TARGET SHM_SOCKET MODEL SEQUENCE NUM_TOKENS "
                 "SEED\n");
    return 2;
  }
  return kvbank::integ::Run(argv);
}
