// kvbank: command-line client.
//
//   kvbank [--server HOST:PORT] stats [MODEL]
//   kvbank [--server HOST:PORT] models
//   kvbank [--server HOST:PORT] demo [--model NAME] [--preset PRESET] [--tokens N] [--rounds R]
//   kvbank plan ...   (offline capacity planner, no server; see plan.cc or `kvbank plan --help`)
//
// `demo` plays a prefill worker and a decode worker on two separate connections: the prefill side
// creates a sequence and streams its KV layer by layer; the decode side fetches it back, checks
// it bit for bit, forks and truncates it, and frees both. It reports GB/s for both directions.
#include <malloc.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/cli/plan.h"
#include "kvbank/client.h"

namespace kvbank {
namespace {

// --token, else $KVBANK_TOKEN: the bearer token for a server with --auth-tokens-file.
ClientOptions OptionsFrom(std::map<std::string, std::string>& opts) {
  ClientOptions o;
  if (opts.count("token")) {
    o.bearer_token = opts["token"];
  } else if (const char* t = std::getenv("KVBANK_TOKEN")) {
    o.bearer_token = t;
  }
  return o;
}

int Usage() {
  std::cerr << "usage: kvbank [--server HOST:PORT] [--token T] <stats [MODEL] | models |"
               " events MODEL [--count N] [--after SEQ] | demo [--model NAME] [--preset PRESET]"
               " [--tokens N] [--rounds R]>\n"
               "       kvbank "
            << PlanUsage() << "\n";
  return 2;
}

int Error(const absl::Status& s) {
  std::cerr << "kvbank: " << s << "\n";
  return 1;
}

int Models(Client& c) {
  auto models = c.ListModels();
  if (!models.ok()) return Error(models.status());
  for (const auto& m : *models) {
    const ModelLayout& l = m.layout;
    std::printf(
        "%-20s %s layers=%u q_heads=%u kv_heads=%u head_dim=%u/%u block_tokens=%u "
        "storage=%s block=%llu B blocks=%llu bytes/token=%llu device=%s\n",
        l.name.c_str(), AttentionKindName(l.kind), l.num_layers, l.num_q_heads, l.num_kv_heads,
        l.head_dim, l.head_dim_v, l.block_tokens, DTypeName(l.layer_dtypes[0]),
        (unsigned long long)m.block_bytes, (unsigned long long)m.num_blocks,
        (unsigned long long)m.payload_bytes_per_token, m.device.c_str());
  }
  return 0;
}

int Stats(Client& c, const std::string& model) {
  auto stats = c.GetStats(model);
  if (!stats.ok()) return Error(stats.status());
  for (const auto& s : *stats) {
    std::printf(
        "%s: blocks total=%llu free=%llu used=%llu (block %llu B, %.1f MiB used of %.1f)"
        " sequences=%llu tokens=%llu capacity_tokens=%llu appends=%llu fetches=%llu"
        " appended=%llu B fetched=%llu B leases_expired=%llu\n",
        s.model.c_str(), (unsigned long long)s.blocks_total, (unsigned long long)s.blocks_free,
        (unsigned long long)s.blocks_used, (unsigned long long)s.block_bytes,
        s.bytes_used / 1048576.0, s.pool_bytes / 1048576.0, (unsigned long long)s.sequences,
        (unsigned long long)s.tokens_stored, (unsigned long long)s.capacity_tokens,
        (unsigned long long)s.appends, (unsigned long long)s.fetches,
        (unsigned long long)s.bytes_appended, (unsigned long long)s.bytes_fetched,
        (unsigned long long)s.leases_expired);
  }
  return 0;
}

// Prints KV events as they come (a KV-aware router's view), until --count events or Ctrl-C.
int Events(Client& c, const std::string& model, std::map<std::string, std::string>& opts) {
  uint64_t count = 0, after = 0, seen = 0;
  if ((opts.count("count") && !absl::SimpleAtoi(opts["count"], &count)) ||
      (opts.count("after") && !absl::SimpleAtoi(opts["after"], &after))) {
    return Usage();
  }
  absl::Status s =
      c.Watch(model, after, !opts.count("after"), absl::Hours(24 * 365),
              [&](const std::vector<Client::Event>& events, uint64_t) {
                for (const auto& e : events) {
                  const char* kind = e.type == Client::Event::Type::kStored    ? "stored"
                                     : e.type == Client::Event::Type::kRemoved ? "removed"
                                                                               : "all_cleared";
                  std::printf("%llu %s", (unsigned long long)e.sequence, kind);
                  for (const auto& h : e.hashes) {
                    std::printf(" %s", HashToHex(h).substr(0, 16).c_str());
                  }
                  std::printf("%s\n", e.tenant.empty() ? "" : (" tenant=" + e.tenant).c_str());
                  std::fflush(stdout);
                  if (count && ++seen >= count) return false;
                }
                return true;
              });
  return s.ok() ? 0 : Error(s);
}

int Demo(const std::string& server, std::map<std::string, std::string> opts) {
  const std::string model = opts.count("model") ? opts["model"] : "llama-3.1-8b";
  const std::string preset = opts.count("preset") ? opts["preset"] : model;
  uint64_t tokens = 1000, rounds = 3;
  if ((opts.count("tokens") && !absl::SimpleAtoi(opts["tokens"], &tokens)) ||
      (opts.count("rounds") && !absl::SimpleAtoi(opts["rounds"], &rounds)) || tokens == 0 ||
      rounds == 0) {
    return Usage();
  }
  // Two clients, two connections: the prefill worker and the decode worker.
  auto prefill = Client::Connect(server, OptionsFrom(opts));
  auto decode = Client::Connect(server, OptionsFrom(opts));
  if (!prefill.ok()) return Error(prefill.status());
  if (!decode.ok()) return Error(decode.status());
  if (!(*prefill)->WaitForServing(absl::Seconds(10))) {
    return Error(absl::UnavailableError(absl::StrCat("no kvbankd serving at ", server)));
  }
  auto info = (*prefill)->EnsurePreset(model, preset);
  if (!info.ok()) return Error(info.status());
  const BlockLayout b = ComputeBlockLayout(info->layout);
  const uint32_t layers = info->layout.num_layers;
  std::printf("demo: model %s (%s), %llu tokens, %llu bytes/token, %u layers, %d rounds\n",
              model.c_str(), DTypeName(info->layout.layer_dtypes[0]), (unsigned long long)tokens,
              (unsigned long long)b.PayloadBytesPerToken(), layers, int(rounds));

  std::mt19937_64 rng(20261130);
  double best_append = 0, best_fetch = 0;
  bool exact = true;
  for (uint64_t round = 0; round < rounds; ++round) {
    // Prefill: one sequence, KV streamed layer by layer (as a prefill engine produces it).
    auto seq = (*prefill)->CreateSequence(model);
    if (!seq.ok()) return Error(seq.status());
    std::vector<std::vector<uint8_t>> layer_payload(layers);
    for (uint32_t l = 0; l < layers; ++l) {
      layer_payload[l].resize(b.PayloadBytes(l, l + 1, tokens));
      for (size_t i = 0; i + 8 <= layer_payload[l].size(); i += 8) {
        const uint64_t r = rng();
        std::memcpy(&layer_payload[l][i], &r, 8);
      }
    }
    std::vector<uint32_t> ids(tokens);
    for (uint64_t t = 0; t < tokens; ++t) ids[t] = static_cast<uint32_t>(rng() % 128000);
    const absl::Time t0 = absl::Now();
    for (uint32_t l = 0; l < layers; ++l) {
      Client::AppendArgs a;
      a.layer_begin = l;
      a.layer_end = l + 1;
      a.num_tokens = tokens;
      if (l == 0) a.token_ids = ids;
      auto r = (*prefill)->Append(model, seq->id, a, layer_payload[l]);
      if (!r.ok()) return Error(r.status());
    }
    const double append_s = absl::ToDoubleSeconds(absl::Now() - t0);

    // Decode: fetch everything on the other connection and compare.
    const absl::Time t1 = absl::Now();
    auto fetched = (*decode)->Fetch(model, seq->id, {});
    if (!fetched.ok()) return Error(fetched.status());
    const double fetch_s = absl::ToDoubleSeconds(absl::Now() - t1);
    const PayloadLayout p = PayloadLayout::Make(b, 0, layers, tokens);
    bool round_exact = fetched->payload.size() == p.total_bytes;
    for (uint32_t l = 0; round_exact && l < layers; ++l) {
      round_exact = std::memcmp(fetched->payload.data() + p.layer_offset[l],
                                layer_payload[l].data(), layer_payload[l].size()) == 0;
    }
    exact = exact && round_exact;
    const double gb = double(p.total_bytes) / 1e9;
    best_append = std::max(best_append, gb / append_s);
    best_fetch = std::max(best_fetch, gb / fetch_s);
    std::printf("round %llu: %.1f MB  append %.2f GB/s  fetch %.2f GB/s  bit-exact: %s\n",
                (unsigned long long)round, gb * 1e3, gb / append_s, gb / fetch_s,
                round_exact ? "yes" : "NO");

    // Decode-side lifecycle: fork (parallel sampling), truncate (speculation rollback), free.
    auto fork = (*decode)->Fork(model, seq->id);
    if (!fork.ok()) return Error(fork.status());
    auto cut = (*decode)->Truncate(model, fork->id, tokens / 2);
    if (!cut.ok()) return Error(cut.status());
    auto half = (*decode)->Fetch(model, fork->id, {});
    if (!half.ok()) return Error(half.status());
    const PayloadLayout ph = PayloadLayout::Make(b, 0, layers, tokens / 2);
    bool half_exact = half->payload.size() == ph.total_bytes;
    for (uint32_t l = 0; half_exact && l < layers; ++l) {
      // Layer l of the half: K [heads][tokens/2][d] of the full K rows, then V likewise.
      const LayerView& v = b.layers[l];
      for (uint32_t part = 0; part < v.KvParts() && half_exact; ++part) {
        const uint64_t row = part == 0 ? v.KRowBytes() : v.VRowBytes();
        const uint64_t full_part =
            part == 0 ? 0 : uint64_t{v.num_kv_heads} * tokens * v.KRowBytes();
        const uint64_t half_part =
            part == 0 ? 0 : uint64_t{v.num_kv_heads} * (tokens / 2) * v.KRowBytes();
        for (uint32_t h = 0; h < v.num_kv_heads && half_exact; ++h) {
          half_exact =
              std::memcmp(
                  half->payload.data() + ph.layer_offset[l] + half_part + h * (tokens / 2) * row,
                  layer_payload[l].data() + full_part + h * tokens * row, (tokens / 2) * row) == 0;
        }
      }
    }
    exact = exact && half_exact;
    if (auto f = (*decode)->Free(model, fork->id); !f.ok()) return Error(f.status());
    if (auto f = (*prefill)->Free(model, seq->id); !f.ok()) return Error(f.status());
    std::printf("         fork+truncate to %llu tokens: bit-exact: %s\n",
                (unsigned long long)(tokens / 2), half_exact ? "yes" : "NO");
  }
  std::printf("demo: bit-exact round trip: %s; best append %.2f GB/s, best fetch %.2f GB/s\n",
              exact ? "yes" : "NO", best_append, best_fetch);

  // Prefix sharing: the prefill side stores a prompt; a second request with the same prompt, on
  // the decode side's connection, attaches the cached blocks instead of recomputing them.
  {
    std::vector<uint32_t> prompt(tokens);
    for (auto& t : prompt) t = static_cast<uint32_t>(rng() % 128000);
    std::vector<uint8_t> payload(b.PayloadBytes(0, layers, tokens));
    for (size_t i = 0; i + 8 <= payload.size(); i += 8) {
      const uint64_t r = rng();
      std::memcpy(&payload[i], &r, 8);
    }
    Client::CreateArgs ca;
    ca.prompt = prompt;
    auto first = (*prefill)->CreateSequence(model, ca);
    if (!first.ok()) return Error(first.status());
    Client::AppendArgs a;
    a.num_tokens = tokens;
    if (auto r = (*prefill)->Append(model, first->id, a, payload); !r.ok())
      return Error(r.status());
    auto before = (*decode)->GetStats(model);
    if (!before.ok()) return Error(before.status());
    auto second = (*decode)->CreateSequence(model, ca);
    if (!second.ok()) return Error(second.status());
    auto after = (*decode)->GetStats(model);
    if (!after.ok()) return Error(after.status());
    const uint64_t cached = second->cached_tokens;
    bool shared_exact = cached > 0;
    if (cached > 0) {
      Client::FetchArgs f;
      f.token_end = cached;
      auto got = (*decode)->Fetch(model, second->id, f);
      if (!got.ok()) return Error(got.status());
      const PayloadLayout whole = PayloadLayout::Make(b, 0, layers, tokens);
      const PayloadLayout part = PayloadLayout::Make(b, 0, layers, cached);
      for (uint32_t l = 0; shared_exact && l < layers; ++l) {
        const LayerView& v = b.layers[l];
        for (uint32_t kv = 0; kv < v.KvParts() && shared_exact; ++kv) {
          const uint64_t row = kv == 0 ? v.KRowBytes() : v.VRowBytes();
          for (uint32_t h = 0; h < v.num_kv_heads && shared_exact; ++h) {
            const uint64_t k_rows = uint64_t{v.num_kv_heads} * v.KRowBytes();
            const uint8_t* want = payload.data() + whole.layer_offset[l] +
                                  (kv ? k_rows * tokens : 0) + h * tokens * row;
            const uint8_t* have = got->payload.data() + part.layer_offset[l] +
                                  (kv ? k_rows * cached : 0) + h * cached * row;
            shared_exact = std::memcmp(want, have, cached * row) == 0;
          }
        }
      }
    }
    exact = exact && shared_exact;
    std::printf(
        "prefix sharing: second request for the same %llu-token prompt attached %llu "
        "cached tokens; pool blocks used %llu -> %llu (shared, not copied); "
        "bit-exact: %s\n",
        (unsigned long long)tokens, (unsigned long long)cached,
        (unsigned long long)(*before)[0].blocks_used, (unsigned long long)(*after)[0].blocks_used,
        shared_exact ? "yes" : "NO");
    (void)(*decode)->Free(model, second->id);
    (void)(*prefill)->Free(model, first->id);
  }
  Stats(**decode, model);
  return exact ? 0 : 1;
}

int Main(int argc, char** argv) {
  // Payload messages are ~1 MiB: keep glibc from mapping and unmapping each one (page faults on
  // every message cost more than the copy itself).
  mallopt(M_MMAP_THRESHOLD, 64 << 20);
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
  // `plan` is offline and has flags of its own (--sweep takes no value).
  if (argc > 1 && std::strcmp(argv[1], "plan") == 0) return PlanMain(argc - 1, argv + 1);
  std::string server = "127.0.0.1:50051";
  std::vector<std::string> args;
  std::map<std::string, std::string> opts;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) == 0) {
      std::string key = a.substr(2), value;
      if (size_t eq = key.find('='); eq != std::string::npos) {
        value = key.substr(eq + 1);
        key.resize(eq);
      } else if (i + 1 < argc) {
        value = argv[++i];
      } else {
        return Usage();
      }
      if (key == "server")
        server = value;
      else
        opts[key] = value;
    } else {
      args.push_back(a);
    }
  }
  if (args.empty()) return Usage();
  if (args[0] == "demo") return Demo(server, opts);
  auto client = Client::Connect(server, OptionsFrom(opts));
  if (!client.ok()) return Error(client.status());
  if (args[0] == "stats") return Stats(**client, args.size() > 1 ? args[1] : "");
  if (args[0] == "models") return Models(**client);
  if (args[0] == "events" && args.size() > 1) return Events(**client, args[1], opts);
  return Usage();
}

}  // namespace
}  // namespace kvbank

int main(int argc, char** argv) { return kvbank::Main(argc, argv); }
