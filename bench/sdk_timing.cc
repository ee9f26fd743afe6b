// sdk_timing: the C++ SDK's side of bench/python_bench.py. Times kvbank::Client calls against a
// running kvbankd on commands read from stdin, one answer line per command, so that the Python
// benchmark can measure the C++ and the Python SDK back to back in pairs.
//
//   sdk_timing --target 127.0.0.1:PORT --model NAME
//   stdin:  size TOKENS   payload of TOKENS tokens (all layers): random bytes, appended to a
//                         fetch sequence; a reused destination buffer, touched
//           append        Client::Append of the payload to a new sequence (create/free untimed)
//           fetch         Client::FetchInto the fetch sequence into the destination buffer
//           check         exits 1 unless the destination holds the payload
//           quit
//   stdout: "ok", or the seconds the timed call took; errors go to stderr and exit 1.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kvbank/client.h"

namespace {

[[noreturn]] void Die(const std::string& what) {
  std::cerr << "sdk_timing: " << what << "\n";
  std::exit(1);
}

double Seconds(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  std::string target, model;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--target") == 0) {
      target = argv[i + 1];
    } else if (std::strcmp(argv[i], "--model") == 0) {
      model = argv[i + 1];
    } else {
      Die(std::string("unknown flag ") + argv[i]);
    }
  }
  if (target.empty() || model.empty()) Die("usage: sdk_timing --target HOST:PORT --model NAME");
  auto client = kvbank::Client::Connect(target);
  if (!client.ok()) Die(client.status().ToString());
  kvbank::Client& c = **client;
  auto info = c.GetModel(model);
  if (!info.ok()) Die(info.status().ToString());

  std::vector<uint8_t> payload, out;
  uint64_t tokens = 0, fetch_seq = 0;
  kvbank::Client::AppendArgs append_args;  // all layers, the storage dtype
  std::mt19937_64 rng(9001);
  std::string cmd;
  while (std::cin >> cmd) {
    if (cmd == "size") {
      std::cin >> tokens;
      if (fetch_seq != 0) (void)c.Free(model, fetch_seq);
      payload.resize(tokens * info->payload_bytes_per_token);
      // Random bf16 bit patterns with the exponent kept off all-ones (no Inf / NaN).
      for (size_t i = 0; i + 1 < payload.size(); i += 2) {
        const uint64_t r = rng();
        payload[i] = static_cast<uint8_t>(r);
        payload[i + 1] = static_cast<uint8_t>((r >> 8) & 0x3F);
      }
      out.assign(payload.size(), 0);
      auto seq = c.CreateSequence(model, absl::ZeroDuration());
      if (!seq.ok()) Die(seq.status().ToString());
      fetch_seq = seq->id;
      append_args.num_tokens = tokens;
      auto r = c.Append(model, fetch_seq, append_args, payload);
      if (!r.ok()) Die(r.status().ToString());
      std::cout << "ok" << std::endl;
    } else if (cmd == "append") {
      auto seq = c.CreateSequence(model, absl::ZeroDuration());
      if (!seq.ok()) Die(seq.status().ToString());
      const auto start = std::chrono::steady_clock::now();
      auto r = c.Append(model, seq->id, append_args, payload);
      const double s = Seconds(start);
      if (!r.ok()) Die(r.status().ToString());
      if (auto f = c.Free(model, seq->id); !f.ok()) Die(f.status().ToString());
      std::printf("%.9f\n", s);
      std::fflush(stdout);
    } else if (cmd == "fetch") {
      const auto start = std::chrono::steady_clock::now();
      auto r = c.FetchInto(model, fetch_seq, {}, absl::MakeSpan(out));
      const double s = Seconds(start);
      if (!r.ok()) Die(r.status().ToString());
      std::printf("%.9f\n", s);
      std::fflush(stdout);
    } else if (cmd == "check") {
      if (out != payload) Die("the fetched bytes differ from the payload");
      std::cout << "ok" << std::endl;
    } else if (cmd == "quit") {
      break;
    } else {
      Die("unknown command " + cmd);
    }
  }
  if (fetch_seq != 0) (void)c.Free(model, fetch_seq);
  return 0;
}
