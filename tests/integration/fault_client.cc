// A kvbank client that fault_test starts as a child process and SIGKILLs in the middle of a
// streamed call. It goes through the generated stub so that every message it writes or reads is
// one step the parent can see and stop it at.
//
//   fault_client append TARGET MODEL SEQ_ID NUM_TOKENS SEED LAYERS KV_HEADS HEAD_DIM MSG_BYTES
//       appends NUM_TOKENS tokens to all layers of an fp16 GQA model of that shape (block of 16
//       tokens), the payload KvReference::Append makes with Random(SEED): a header message, then
//       data messages of MSG_BYTES.
//   fault_client fetch TARGET MODEL SEQ_ID TOKEN_BEGIN TOKEN_END LAYER_BEGIN LAYER_END
//
// The parent paces it through stdin, one byte per command:
//   's'  send (append) or read (fetch) one more message
//   'g'  go: every remaining message without waiting
//   'c'  commit: half-close (append) and finish the call; only after every message
// and it reports on stdout, one line each, flushed at once:
//   "ready"             connected; nothing sent yet
//   "msg N"             N messages written (append) or read (fetch) so far
//   "end"               every message written, or the server ended the stream; nothing committed
//   "done CODE BYTES FNV"  the call's status code, and for a fetch the payload bytes it received
//                       and their FNV-1a 64 digest
// It exits 3 when stdin closes (the parent is gone) and 2 on bad arguments.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "grpcpp/grpcpp.h"
#include "kvbank/layout.h"
#include "kvbank/v1/kvbank.grpc.pb.h"
#include "tests/integration/kv_reference.h"

namespace kvbank::integ {
namespace {

void Report(const std::string& line) {
  std::fputs((line + "\n").c_str(), stdout);
  std::fflush(stdout);
}

// Paces the calls: blocks on stdin until the parent allows one more message.
class Gate {
 public:
  // Waits for 's' or 'g' (once 'g' came, never waits again).
  void Step() {
    if (go_) return;
    const char c = Read();
    if (c == 'g') go_ = true;
  }
  // Waits for 'c'; 's' and 'g' that come meanwhile are ignored.
  void AwaitCommit() {
    while (Read() != 'c') {
    }
  }

 private:
  static char Read() {
    char c = 0;
    ssize_t n;
    do {
      n = read(0, &c, 1);
    } while (n < 0 && errno == EINTR);
    if (n != 1) std::exit(3);  // the parent is gone
    return c;
  }
  bool go_ = false;
};

// A fetching client reads like a slow one: without BDP probing its stream window stays at 64 KiB,
// so the server cannot run ahead and still holds the blocks it streams when the client dies.
std::unique_ptr<v1::KvBank::Stub> Connect(const std::string& target, bool slow_reader) {
  grpc::ChannelArguments args;
  if (slow_reader) {
    args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
    args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 64 << 10);
  }
  args.SetMaxReceiveMessageSize(64 << 20);
  args.SetMaxSendMessageSize(64 << 20);
  auto channel = grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
  if (!channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(20))) {
    std::fprintf(stderr, "fault_client: no connection to %s\n", target.c_str());
    std::exit(4);
  }
  return v1::KvBank::NewStub(channel);
}

uint64_t Arg(char** argv, int i) { return std::strtoull(argv[i], nullptr, 10); }

int Append(char** argv) {
  const std::string target = argv[2], model = argv[3];
  const uint64_t id = Arg(argv, 4), num_tokens = Arg(argv, 5), seed = Arg(argv, 6);
  ModelLayout layout;
  layout.name = model;
  layout.num_layers = static_cast<uint32_t>(Arg(argv, 7));
  layout.num_kv_heads = static_cast<uint32_t>(Arg(argv, 8));
  layout.num_q_heads = layout.num_kv_heads;
  layout.head_dim = layout.head_dim_v = static_cast<uint32_t>(Arg(argv, 9));
  layout.block_tokens = 16;
  layout.kind = AttentionKind::kGqa;
  layout.input_dtype = DType::kFp16;
  layout.layer_dtypes.assign(layout.num_layers, DType::kFp16);
  const uint64_t msg_bytes = Arg(argv, 10);
  if (msg_bytes == 0) return 2;

  KvReference ref(layout);
  Random rng(seed);
  const std::vector<uint8_t> payload = ref.Append(0, layout.num_layers, num_tokens, rng);
  std::vector<v1::AppendRequest> messages(1);
  v1::AppendHeader* h = messages[0].mutable_header();
  h->set_model(model);
  h->set_sequence_id(id);
  h->set_num_tokens(num_tokens);
  h->set_payload_bytes(payload.size());
  for (uint64_t at = 0; at < payload.size(); at += msg_bytes) {
    const uint64_t n = std::min<uint64_t>(msg_bytes, payload.size() - at);
    messages.emplace_back().set_data(payload.data() + at, n);
  }

  auto stub = Connect(target, false);
  Report("ready");
  Gate gate;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  v1::AppendResponse resp;
  auto writer = stub->Append(&ctx, &resp);
  size_t sent = 0;
  for (const v1::AppendRequest& m : messages) {
    gate.Step();
    if (!writer->Write(m)) break;  // the server ended the call; Finish says why
    Report("msg " + std::to_string(++sent));
  }
  Report("end");
  gate.AwaitCommit();
  writer->WritesDone();
  const grpc::Status s = writer->Finish();
  Report("done " + std::to_string(int(s.error_code())) + " 0 0");
  return 0;
}

int Fetch(char** argv) {
  v1::FetchRequest req;
  req.set_model(argv[3]);
  req.set_sequence_id(Arg(argv, 4));
  req.set_token_begin(Arg(argv, 5));
  req.set_token_end(Arg(argv, 6));
  req.set_layer_begin(static_cast<uint32_t>(Arg(argv, 7)));
  req.set_layer_end(static_cast<uint32_t>(Arg(argv, 8)));

  auto stub = Connect(argv[2], true);
  Report("ready");
  Gate gate;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  auto reader = stub->Fetch(&ctx, req);
  v1::FetchResponse resp;
  uint64_t bytes = 0, fnv = 1469598103934665603ull;
  size_t received = 0;
  while (true) {
    gate.Step();
    if (!reader->Read(&resp)) break;
    for (char c : resp.data()) fnv = (fnv ^ uint8_t(c)) * 1099511628211ull;
    bytes += resp.data().size();
    Report("msg " + std::to_string(++received));
  }
  Report("end");
  gate.AwaitCommit();
  const grpc::Status s = reader->Finish();
  Report("done " + std::to_string(int(s.error_code())) + " " + std::to_string(bytes) + " " +
         std::to_string(fnv));
  return 0;
}

}  // namespace
}  // namespace kvbank::integ

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "append" && argc == 11) return kvbank::integ::Append(argv);
  if (mode == "fetch" && argc == 9) return kvbank::integ::Fetch(argv);
  std::fprintf(stderr,
               "usage: fault_client append TARGET MODEL SEQ_ID NUM_TOKENS SEED LAYERS KV_HEADS "
               "HEAD_DIM MSG_BYTES\n"
               "       fault_client fetch TARGET MODEL SEQ_ID TOKEN_BEGIN TOKEN_END LAYER_BEGIN "
               "LAYER_END\n");
  return 2;
}
