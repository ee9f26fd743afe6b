// kvbank: command-line client.
//
//   kvbank [--server HOST:PORT] [--timeout S] [--tls-ca PEM ...] stats [MODEL]
//   kvbank [--server HOST:PORT] models
//   kvbank [--server HOST:PORT] events MODEL [--count N] [--after SEQ]
//   kvbank [--server HOST:PORT] demo [--model NAME] [--preset PRESET] [--tokens N] [--rounds R]
//   kvbank plan ...   (offline capacity planner, no server; see plan.cc or `kvbank plan --help`)
//   kvbank help [COMMAND]   (or --help anywhere)
//
// `demo` plays a prefill worker and a decode worker on two separate connections: the prefill side
// creates a sequence and streams its KV layer by layer; the decode side fetches it back, checks
// it bit for bit, forks and truncates it, and frees both. It reports GB/s for both directions.
//
// Exit status: 0 done, 1 the server refused or is not there, 2 bad usage.
#include <malloc.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/cli/plan.h"
#include "common/command_line.h"
#include "kvbank/client.h"

namespace kvbank {
namespace {

using cmdline::FlagSpec;
using cmdline::ParsedArgs;

// Flags every command that talks to a server takes, before or after the command's name.
const std::vector<FlagSpec>& ConnectionFlags() {
  static const std::vector<FlagSpec> kFlags = {
      {"server", "HOST:PORT", "the kvbankd to talk to (a gRPC target)", "127.0.0.1:50051"},
      {"token", "T", "bearer token for a server with --auth-tokens-file", "$KVBANK_TOKEN"},
      {"timeout", "SECONDS", "how long to wait for the server to answer at all", "3"},
      {"tls", "", "use TLS with the system's root CAs (implied by the --tls-* flags)", ""},
      {"tls-ca", "PATH", "PEM CA certificates that sign the server's certificate", ""},
      {"tls-cert", "PATH", "PEM client certificate, for a server with --tls-client-ca", ""},
      {"tls-key", "PATH", "PEM private key of --tls-cert", ""},
      {"tls-server-name", "NAME", "check the server's certificate for this name, not the host's",
       ""},
  };
  return kFlags;
}

struct Command {
  const char* name;
  const char* args;  // positional arguments, for the usage line
  const char* summary;
  std::vector<FlagSpec> flags;  // besides ConnectionFlags()
  size_t min_args, max_args;
};

const std::vector<Command>& Commands() {
  static const std::vector<Command> kCommands = {
      {"stats",
       "[MODEL]",
       "pool blocks (free, cached, used, pinned), evictions, prefix hit rate, traffic and each "
       "tenant's row, of one model or all",
       {{"watch", "SECONDS", "print them again every SECONDS, with rates, until Ctrl-C", "off"},
        {"count", "N", "with --watch: stop after N refreshes (0: never)", "0"}},
       0,
       1},
      {"models", "", "the registered models and their layouts", {}, 0, 0},
      {"events",
       "MODEL",
       "print the model's KV events (blocks stored, removed) as they come",
       {{"count", "N", "stop after N events (0: never)", "0"},
        {"after", "SEQ", "replay the events after sequence number SEQ first", "only new events"}},
       1,
       1},
      {"demo",
       "",
       "a prefill and a decode worker on two connections: bit-exact? GB/s?",
       {{"model", "NAME", "the model to use (registered from --preset if absent)", "llama-3.1-8b"},
        {"preset", "PRESET", absl::StrCat("its layout: ", absl::StrJoin(PresetNames(), ", ")),
         "the model's name"},
        {"tokens", "N", "tokens per sequence", "1000"},
        {"rounds", "R", "append + fetch rounds", "3"}},
       0,
       0},
  };
  return kCommands;
}

const Command* FindCommand(const std::string& name) {
  for (const Command& c : Commands()) {
    if (name == c.name) return &c;
  }
  return nullptr;
}

std::vector<FlagSpec> FlagsOf(const Command& c) {
  std::vector<FlagSpec> flags = c.flags;
  flags.insert(flags.end(), ConnectionFlags().begin(), ConnectionFlags().end());
  return flags;
}

std::string CommandNames() {
  std::vector<std::string> names;
  for (const Command& c : Commands()) names.push_back(c.name);
  names.push_back("plan");
  names.push_back("help");
  return absl::StrJoin(names, ", ");
}

void ProgramHelp() {
  std::printf("usage: kvbank [CONNECTION FLAGS] COMMAND [ARGS] [FLAGS]\n\nCommands:\n");
  for (const Command& c : Commands()) {
    std::printf("  %-8s %s\n", c.name, c.summary);
  }
  std::printf("  %-8s %s\n", "plan", "offline capacity planner: GPU memory for weights and KV");
  std::printf("  %-8s %s\n", "help", "help on a command: kvbank help COMMAND (or COMMAND --help)");
  std::printf("\nConnection flags (every command but plan):\n%s",
              cmdline::FormatFlags(ConnectionFlags()).c_str());
  std::printf("\nExit status: 0 done, 1 the server refused or is not there, 2 bad usage.\n");
}

void CommandHelp(const Command& c) {
  std::printf("usage: kvbank %s%s%s [FLAGS]\n\n%s\n", c.name, *c.args ? " " : "", c.args,
              c.summary);
  if (!c.flags.empty()) std::printf("\nFlags:\n%s", cmdline::FormatFlags(c.flags).c_str());
  std::printf("\nConnection flags:\n%s", cmdline::FormatFlags(ConnectionFlags()).c_str());
}

// Bad usage: the message, then where help is; exit status 2.
int UsageError(const std::string& command, const std::string& what) {
  std::fprintf(stderr, "kvbank%s%s: %s\n", command.empty() ? "" : " ", command.c_str(),
               what.c_str());
  std::fprintf(stderr, "kvbank %s--help describes the %s\n",
               command.empty() ? "" : (command + " ").c_str(),
               command.empty() ? "commands" : "flags");
  return 2;
}

// The connection the flags ask for; a message for UsageError when they do not go together.
std::string ConnectionFrom(const ParsedArgs& a, std::string* server, ClientOptions* o,
                           absl::Duration* timeout) {
  *server = a.Get("server").value_or("127.0.0.1:50051");
  if (auto t = a.Get("token")) {
    o->bearer_token = *t;
  } else if (const char* env = std::getenv("KVBANK_TOKEN")) {
    o->bearer_token = env;
  }
  double seconds = 3;
  if (auto t = a.Get("timeout"); t && (!absl::SimpleAtod(*t, &seconds) || !(seconds > 0))) {
    return "--timeout takes a number of seconds above 0, e.g. 3 or 0.5";
  }
  *timeout = absl::Seconds(seconds);
  const bool tls = a.Get("tls").value_or("false") == "true" || a.Has("tls-ca") ||
                   a.Has("tls-cert") || a.Has("tls-key") || a.Has("tls-server-name");
  if (tls) {
    ClientTlsOptions t;
    t.root_ca_path = a.Get("tls-ca").value_or("");
    t.cert_chain_path = a.Get("tls-cert").value_or("");
    t.private_key_path = a.Get("tls-key").value_or("");
    t.server_name_override = a.Get("tls-server-name").value_or("");
    if (t.cert_chain_path.empty() != t.private_key_path.empty()) {
      return "--tls-cert and --tls-key go together";
    }
    o->tls = t;
  }
  return "";
}

// A client whose server answers health checks within `timeout`; else says so and returns null.
std::unique_ptr<Client> ConnectOrSay(const std::string& server, const ClientOptions& options,
                                     absl::Duration timeout) {
  auto client = Client::Connect(server, options);
  if (!client.ok()) {
    std::fprintf(stderr, "kvbank: %s\n", client.status().ToString().c_str());
    return nullptr;
  }
  if (absl::Status s = (*client)->CheckServing(timeout); !s.ok()) {
    std::fprintf(
        stderr,
        "kvbank: no kvbankd answers at %s (waited %s%s): %s\n"
        "kvbank: is it running, is --server right%s?\n",
        server.c_str(), absl::FormatDuration(timeout).c_str(),
        options.tls ? ", TLS" : ", plaintext", std::string(s.message()).c_str(),
        options.tls ? ", does its certificate match --tls-ca" : ", does it want TLS (--tls-ca)");
    return nullptr;
  }
  return *std::move(client);
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

std::string Percent(uint64_t part, uint64_t whole) {
  if (whole == 0) return "-";
  return absl::StrFormat("%.1f%%", 100.0 * double(part) / double(whole));
}

std::string Mib(uint64_t bytes) { return absl::StrFormat("%.1f MiB", bytes / 1048576.0); }

// One model's figures; with `before` (the previous refresh, `dt` ago) also rates.
void PrintModelStats(const Client::ModelStats& s, const Client::ModelStats* before,
                     absl::Duration dt) {
  std::printf("%s: blocks total=%llu", s.model.c_str(), (unsigned long long)s.blocks_total);
  if (s.tenant_view) {
    std::printf(" yours=%llu (free, cached and evictions are the admin's to see)",
                (unsigned long long)s.blocks_used);
  } else {
    std::printf(" free=%llu cached=%llu used=%llu pinned=%llu usage=%s evictions=%llu",
                (unsigned long long)s.blocks_free, (unsigned long long)s.blocks_cached,
                (unsigned long long)s.blocks_used, (unsigned long long)s.blocks_pinned,
                Percent(s.blocks_used, s.blocks_total).c_str(), (unsigned long long)s.evictions);
  }
  std::printf(" (block %llu B, %s used of %s)\n", (unsigned long long)s.block_bytes,
              Mib(s.bytes_used).c_str(), Mib(s.pool_bytes).c_str());
  std::printf(
      "  sequences=%llu tokens=%llu capacity_tokens=%llu prefix hit rate=%s (%llu of %llu prompt "
      "tokens) appends=%llu fetches=%llu appended=%llu B fetched=%llu B leases_expired=%llu "
      "fetches_waiting=%llu\n",
      (unsigned long long)s.sequences, (unsigned long long)s.tokens_stored,
      (unsigned long long)s.capacity_tokens,
      Percent(s.prefix_hit_tokens, s.prefix_query_tokens).c_str(),
      (unsigned long long)s.prefix_hit_tokens, (unsigned long long)s.prefix_query_tokens,
      (unsigned long long)s.appends, (unsigned long long)s.fetches,
      (unsigned long long)s.bytes_appended, (unsigned long long)s.bytes_fetched,
      (unsigned long long)s.leases_expired, (unsigned long long)s.fetches_waiting);
  if (s.tiers.has_value()) {
    const Client::ModelStats::Tiers& t = *s.tiers;
    std::printf(
        "  tiers: host=%llu/%llu disk=%llu/%llu blocks; spilled host=%llu disk=%llu "
        "(at eviction %llu, dropped %llu); promoted host=%llu disk=%llu; corrupt=%llu; at start "
        "loaded=%llu torn=%llu unverified=%llu%s\n",
        (unsigned long long)t.host_blocks, (unsigned long long)t.host_capacity,
        (unsigned long long)t.disk_blocks, (unsigned long long)t.disk_capacity,
        (unsigned long long)t.spilled_to_host, (unsigned long long)t.spilled_to_disk,
        (unsigned long long)t.spilled_at_eviction, (unsigned long long)t.spill_dropped,
        (unsigned long long)t.promoted_from_host, (unsigned long long)t.promoted_from_disk,
        (unsigned long long)t.corrupt, (unsigned long long)t.loaded,
        (unsigned long long)t.load_invalid, (unsigned long long)t.unverified,
        t.direct_io ? " (O_DIRECT)" : "");
  }
  if (before != nullptr && dt > absl::ZeroDuration()) {
    const double secs = absl::ToDoubleSeconds(dt);
    auto rate = [&](uint64_t now, uint64_t then) {
      return now >= then ? double(now - then) / secs : 0.0;
    };
    std::printf(
        "  per second: appends=%.1f fetches=%.1f in=%.1f MiB out=%.1f MiB evictions=%.1f "
        "prompt tokens=%.0f hit=%s\n",
        rate(s.appends, before->appends), rate(s.fetches, before->fetches),
        rate(s.bytes_appended, before->bytes_appended) / 1048576.0,
        rate(s.bytes_fetched, before->bytes_fetched) / 1048576.0,
        rate(s.evictions, before->evictions),
        rate(s.prefix_query_tokens, before->prefix_query_tokens),
        Percent(
            s.prefix_hit_tokens - std::min(s.prefix_hit_tokens, before->prefix_hit_tokens),
            s.prefix_query_tokens - std::min(s.prefix_query_tokens, before->prefix_query_tokens))
            .c_str());
  }
  for (const auto& t : s.tenants) {
    std::printf(
        "  tenant %-16s sequences=%llu tokens=%llu blocks=%llu%s hit rate=%s (%llu of %llu) "
        "appends=%llu fetches=%llu appended=%llu B fetched=%llu B%s\n",
        t.tenant.empty() ? "''" : t.tenant.c_str(), (unsigned long long)t.sequences,
        (unsigned long long)t.tokens_stored, (unsigned long long)t.blocks_referenced,
        t.max_blocks ? absl::StrCat("/", t.max_blocks).c_str() : "",
        Percent(t.prefix_hit_tokens, t.prefix_query_tokens).c_str(),
        (unsigned long long)t.prefix_hit_tokens, (unsigned long long)t.prefix_query_tokens,
        (unsigned long long)t.appends, (unsigned long long)t.fetches,
        (unsigned long long)t.bytes_appended, (unsigned long long)t.bytes_fetched,
        t.max_sequences ? absl::StrCat(" max_sequences=", t.max_sequences).c_str() : "");
  }
}

// `kvbank stats [MODEL] [--watch S [--count N]]`.
int Stats(Client& c, const std::string& model, const ParsedArgs& a) {
  double watch = 0;
  uint64_t count = 0;
  if (auto v = a.Get("watch"); v && (!absl::SimpleAtod(*v, &watch) || !(watch > 0))) {
    return UsageError("stats", "--watch takes a number of seconds > 0");
  }
  if (auto v = a.Get("count"); v && !absl::SimpleAtoi(*v, &count)) {
    return UsageError("stats", "--count takes an integer >= 0");
  }
  std::vector<Client::ModelStats> before;
  absl::Time then;
  for (uint64_t round = 0;; ++round) {
    auto stats = c.GetStats(model);
    if (!stats.ok()) return Error(stats.status());
    const absl::Time now = absl::Now();
    if (watch > 0)
      std::printf("-- %s\n", absl::FormatTime("%H:%M:%S", now, absl::LocalTimeZone()).c_str());
    for (const auto& s : *stats) {
      const Client::ModelStats* prev = nullptr;
      for (const auto& b : before) {
        if (b.model == s.model) prev = &b;
      }
      PrintModelStats(s, prev, now - then);
    }
    std::fflush(stdout);
    if (watch <= 0 || (count > 0 && round + 1 >= count)) return 0;
    before = *std::move(stats);
    then = now;
    absl::SleepFor(absl::Seconds(watch));
  }
}

// Prints KV events as they come (a KV-aware router's view), until --count events or Ctrl-C.
int Events(Client& c, const std::string& model, const ParsedArgs& a) {
  uint64_t count = 0, after = 0, seen = 0;
  if (auto v = a.Get("count"); v && !absl::SimpleAtoi(*v, &count)) {
    return UsageError("events", "--count takes an integer >= 0");
  }
  if (auto v = a.Get("after"); v && !absl::SimpleAtoi(*v, &after)) {
    return UsageError("events", "--after takes an event sequence number (an integer >= 0)");
  }
  absl::Status s =
      c.Watch(model, after, !a.Has("after"), absl::Hours(24 * 365),
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

// The sequences the demo holds. Whatever is still held when the demo returns, on any path, is
// freed: a demo that fails midway leaves nothing behind in the pool.
class HeldSequences {
 public:
  HeldSequences(Client* client, std::string model) : client_(client), model_(std::move(model)) {}
  ~HeldSequences() {
    for (uint64_t id : ids_) (void)client_->Free(model_, id);
  }
  HeldSequences(const HeldSequences&) = delete;
  HeldSequences& operator=(const HeldSequences&) = delete;

  void Hold(uint64_t id) { ids_.push_back(id); }
  absl::Status Free(uint64_t id) {
    ids_.erase(std::remove(ids_.begin(), ids_.end(), id), ids_.end());
    return client_->Free(model_, id).status();
  }

 private:
  Client* client_;
  std::string model_;
  std::vector<uint64_t> ids_;
};

int Demo(const std::string& server, const ClientOptions& options, absl::Duration timeout,
         const ParsedArgs& a) {
  const std::string model = a.Get("model").value_or("llama-3.1-8b");
  const std::string preset = a.Get("preset").value_or(model);
  uint64_t tokens = 1000, rounds = 3;
  if (auto v = a.Get("tokens"); v && (!absl::SimpleAtoi(*v, &tokens) || tokens == 0)) {
    return UsageError("demo", "--tokens takes an integer above 0");
  }
  if (auto v = a.Get("rounds"); v && (!absl::SimpleAtoi(*v, &rounds) || rounds == 0)) {
    return UsageError("demo", "--rounds takes an integer above 0");
  }
  // Two clients, two connections: the prefill worker and the decode worker.
  std::unique_ptr<Client> prefill = ConnectOrSay(server, options, timeout);
  if (prefill == nullptr) return 1;
  std::unique_ptr<Client> decode = ConnectOrSay(server, options, timeout);
  if (decode == nullptr) return 1;
  auto info = prefill->EnsurePreset(model, preset);
  if (!info.ok()) return Error(info.status());
  HeldSequences held(prefill.get(), model);
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
    auto seq = prefill->CreateSequence(model);
    if (!seq.ok()) return Error(seq.status());
    held.Hold(seq->id);
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
      auto r = prefill->Append(model, seq->id, a, layer_payload[l]);
      if (!r.ok()) return Error(r.status());
    }
    const double append_s = absl::ToDoubleSeconds(absl::Now() - t0);

    // Decode: fetch everything on the other connection and compare.
    const absl::Time t1 = absl::Now();
    auto fetched = decode->Fetch(model, seq->id, {});
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
    auto fork = decode->Fork(model, seq->id);
    if (!fork.ok()) return Error(fork.status());
    held.Hold(fork->id);
    auto cut = decode->Truncate(model, fork->id, tokens / 2);
    if (!cut.ok()) return Error(cut.status());
    auto half = decode->Fetch(model, fork->id, {});
    if (!half.ok()) return Error(half.status());
    const PayloadLayout ph = PayloadLayout::Make(b, 0, layers, tokens / 2);
    bool half_exact = half->payload.size() == ph.total_bytes;
    for (uint32_t l = 0; half_exact && l < layers; ++l) {
      // Each (K/V, head) of the half: the first tokens / 2 rows of the full one. layer_payload[l]
      // is layer l's section of the full payload p.
      const LayerView& v = b.layers[l];
      for (uint32_t part = 0; part < v.KvParts() && half_exact; ++part) {
        for (uint32_t h = 0; h < v.num_kv_heads && half_exact; ++h) {
          half_exact = std::memcmp(half->payload.data() + ph.RowOffset(b, l, part, h, 0),
                                   layer_payload[l].data() + p.RowOffset(b, l, part, h, 0) -
                                       p.layer_offset[l],
                                   (tokens / 2) * p.RowBytes(b, l, part)) == 0;
        }
      }
    }
    exact = exact && half_exact;
    if (absl::Status f = held.Free(fork->id); !f.ok()) return Error(f);
    if (absl::Status f = held.Free(seq->id); !f.ok()) return Error(f);
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
    auto first = prefill->CreateSequence(model, ca);
    if (!first.ok()) return Error(first.status());
    held.Hold(first->id);
    Client::AppendArgs a;
    a.num_tokens = tokens;
    if (auto r = prefill->Append(model, first->id, a, payload); !r.ok()) return Error(r.status());
    auto before = decode->GetStats(model);
    if (!before.ok()) return Error(before.status());
    auto second = decode->CreateSequence(model, ca);
    if (!second.ok()) return Error(second.status());
    held.Hold(second->id);
    auto after = decode->GetStats(model);
    if (!after.ok()) return Error(after.status());
    const uint64_t cached = second->cached_tokens;
    bool shared_exact = cached > 0;
    if (cached > 0) {
      Client::FetchArgs f;
      f.token_end = cached;
      auto got = decode->Fetch(model, second->id, f);
      if (!got.ok()) return Error(got.status());
      const PayloadLayout whole = PayloadLayout::Make(b, 0, layers, tokens);
      const PayloadLayout part = PayloadLayout::Make(b, 0, layers, cached);
      for (uint32_t l = 0; shared_exact && l < layers; ++l) {
        const LayerView& v = b.layers[l];
        for (uint32_t kv = 0; kv < v.KvParts() && shared_exact; ++kv) {
          for (uint32_t h = 0; h < v.num_kv_heads && shared_exact; ++h) {
            const uint8_t* want = payload.data() + whole.RowOffset(b, l, kv, h, 0);
            const uint8_t* have = got->payload.data() + part.RowOffset(b, l, kv, h, 0);
            shared_exact = std::memcmp(want, have, cached * part.RowBytes(b, l, kv)) == 0;
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
    if (absl::Status f = held.Free(second->id); !f.ok()) return Error(f);
    if (absl::Status f = held.Free(first->id); !f.ok()) return Error(f);
  }
  if (auto stats = decode->GetStats(model); stats.ok()) {
    for (const auto& st : *stats) PrintModelStats(st, nullptr, absl::ZeroDuration());
  }
  return exact ? 0 : 1;
}

int Main(int argc, char** argv) {
  // Payload messages are ~1 MiB: keep glibc from mapping and unmapping each one (page faults on
  // every message cost more than the copy itself).
  mallopt(M_MMAP_THRESHOLD, 64 << 20);
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
  const std::vector<std::string> args(argv + std::min(argc, 1), argv + argc);
  // Connection flags may come before the command; its own flags and arguments follow it.
  auto head = cmdline::Parse(args, ConnectionFlags(), /*stop_at_positional=*/true);
  if (!head.ok()) {
    return UsageError("", absl::StrCat(head.status().message(), "; before the command: ",
                                       cmdline::FlagList(ConnectionFlags())));
  }
  if (head->rest.empty()) {
    if (head->help) {
      ProgramHelp();
      return 0;
    }
    return UsageError("", absl::StrCat("no command given (one of ", CommandNames(), ")"));
  }
  std::string name = head->rest[0];
  std::vector<std::string> rest(head->rest.begin() + 1, head->rest.end());
  if (name == "help") {
    if (rest.empty()) {
      ProgramHelp();
      return 0;
    }
    name = rest[0];
    rest = {"--help"};
  }
  if (name == "plan") {
    // `plan` is offline and has flags of its own (--sweep takes no value).
    std::vector<std::string> plan_args = {"plan"};
    if (head->help) plan_args.push_back("--help");
    plan_args.insert(plan_args.end(), rest.begin(), rest.end());
    std::vector<char*> plan_argv;
    for (std::string& s : plan_args) plan_argv.push_back(s.data());
    return PlanMain(static_cast<int>(plan_argv.size()), plan_argv.data());
  }
  const Command* command = FindCommand(name);
  if (command == nullptr) {
    std::vector<std::string> names = {"plan", "help"};
    for (const Command& c : Commands()) names.push_back(c.name);
    std::string msg = absl::StrCat("unknown command '", name, "'");
    if (std::string near = cmdline::ClosestName(name, names); !near.empty()) {
      absl::StrAppend(&msg, " (did you mean ", near, "?)");
    }
    return UsageError("", absl::StrCat(msg, "; commands: ", CommandNames()));
  }
  const std::vector<FlagSpec> flags = FlagsOf(*command);
  auto parsed = cmdline::Parse(rest, flags);
  if (!parsed.ok()) {
    std::string msg(parsed.status().message());
    if (absl::IsNotFound(parsed.status())) {
      absl::StrAppend(&msg, "; valid flags: ", cmdline::FlagList(flags));
    }
    return UsageError(name, msg);
  }
  if (head->help || parsed->help) {
    CommandHelp(*command);
    return 0;
  }
  if (parsed->positional.size() < command->min_args ||
      parsed->positional.size() > command->max_args) {
    return UsageError(name,
                      parsed->positional.size() < command->min_args
                          ? absl::StrCat("needs ", command->args)
                          : absl::StrCat("takes ", *command->args ? command->args : "no arguments",
                                         ", not '", absl::StrJoin(parsed->positional, " "), "'"));
  }
  // Connection flags given before the command, then after it (the later wins).
  ParsedArgs all = *parsed;
  all.values.insert(all.values.begin(), head->values.begin(), head->values.end());
  std::string server;
  ClientOptions options;
  absl::Duration timeout;
  if (std::string bad = ConnectionFrom(all, &server, &options, &timeout); !bad.empty()) {
    return UsageError(name, bad);
  }
  if (name == "demo") return Demo(server, options, timeout, all);
  std::unique_ptr<Client> client = ConnectOrSay(server, options, timeout);
  if (client == nullptr) return 1;
  if (name == "stats") {
    return Stats(*client, parsed->positional.empty() ? "" : parsed->positional[0], all);
  }
  if (name == "models") return Models(*client);
  return Events(*client, parsed->positional[0], all);
}

}  // namespace
}  // namespace kvbank

int main(int argc, char** argv) { return kvbank::Main(argc, argv); }
