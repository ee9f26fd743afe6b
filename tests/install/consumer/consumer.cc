// Talks to a running kvbankd through the installed SDK: a sequence of the llama-3.1-8b preset,
// 16 tokens appended and fetched back bit-exact, then freed; the same through a PlaneRouter
// (gRPC: the server has no shared-memory socket). usage: consumer HOST:PORT
#include <cstdio>
#include <cstring>
#include <vector>

#include "kvbank/client.h"
#include "kvbank/plane_router.h"
#include "kvbank/version.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: consumer HOST:PORT\n");
    return 2;
  }
  auto fail = [](const char* what, const absl::Status& s) {
    std::fprintf(stderr, "consumer: %s: %s\n", what, s.ToString().c_str());
    return 1;
  };
  auto client = kvbank::Client::Connect(argv[1]);
  if (!client.ok()) return fail("connect", client.status());
  const std::string model = "llama-3.1-8b";
  auto info = (*client)->GetModel(model);
  if (!info.ok()) return fail("GetModel", info.status());
  auto seq = (*client)->CreateSequence(model, absl::ZeroDuration());
  if (!seq.ok()) return fail("CreateSequence", seq.status());
  kvbank::Client::AppendArgs args;
  args.num_tokens = 16;
  std::vector<uint8_t> payload(info->payload_bytes_per_token * args.num_tokens);
  uint32_t x = 12345;
  for (uint8_t& b : payload) {
    x = x * 1664525u + 1013904223u;
    b = uint8_t(x >> 24) & 0x3f;  // finite bf16 / fp16 values whatever the storage dtype
  }
  auto appended = (*client)->Append(model, seq->id, args, payload);
  if (!appended.ok()) return fail("Append", appended.status());
  auto fetched = (*client)->Fetch(model, seq->id, {});
  if (!fetched.ok()) return fail("Fetch", fetched.status());
  if (fetched->payload != payload) {
    std::fprintf(stderr, "consumer: fetched bytes differ from the appended ones\n");
    return 1;
  }
  if (auto freed = (*client)->Free(model, seq->id); !freed.ok())
    return fail("Free", freed.status());
  auto router = kvbank::PlaneRouter::Connect(argv[1]);
  if (!router.ok()) return fail("PlaneRouter::Connect", router.status());
  auto routed = (*router)->client().CreateSequence(model, absl::ZeroDuration());
  if (!routed.ok()) return fail("CreateSequence (router)", routed.status());
  appended = (*router)->Append(model, routed->id, args, payload);
  if (!appended.ok()) return fail("PlaneRouter::Append", appended.status());
  std::vector<uint8_t> out(payload.size());
  auto into = (*router)->FetchInto(model, routed->id, {}, absl::MakeSpan(out));
  if (!into.ok()) return fail("PlaneRouter::FetchInto", into.status());
  // The installed kvbankd serves its same-host plane by default: 16 tokens (2 MiB) go through
  // a staging region, asked for with control frames on its socket.
  const kvbank::PlaneRouter::Stats st = (*router)->GetStats();
  if (out != payload || !(*router)->shm_on() ||
      st.planes[kvbank::PlaneRouter::kShmStaged].calls != 2 || st.shm_control_requests != 2) {
    std::fprintf(stderr, "consumer: the router's bytes or plane counts are wrong\n");
    return 1;
  }
  if (auto freed = (*router)->client().Free(model, routed->id); !freed.ok())
    return fail("Free (router)", freed.status());
  std::printf("consumer: kvbank SDK %s: %zu bytes appended and fetched back bit-exact\n",
              kvbank::SdkVersion(), payload.size());
  return std::strcmp(kvbank::SdkVersion(), KVBANK_VERSION_STRING) == 0 ? 0 : 1;
}
