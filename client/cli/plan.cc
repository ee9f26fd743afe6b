// `kvbank plan`: GPU memory for weights, KV cache and overhead, and how much KV fits.
//
//   kvbank plan [--preset P | --layers L --kv-heads H --head-dim D [--head-dim-v DV]
//                [--q-heads Q] | --layers L --kv-lora-rank R --rope-dim P (MLA)]
//               [--params-b B] [--context S] [--batch N] [--weight-dtype W] [--kv-dtype K]
//               [--gpu-memory SIZE] [--block-tokens T]
//   kvbank plan --sweep [same model flags] [--out-prefix PATH]
//
// The arithmetic lives in kvbank/planner.h; this file parses flags and prints. The sweep writes
// PATH.csv and draws PATH.png with scripts/plot_plan.py (matplotlib); without Python or
// matplotlib it says so and still prints the table.
#include "client/cli/plan.h"

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/command_line.h"
#include "kvbank/layout.h"
#include "kvbank/planner.h"

extern char** environ;

namespace kvbank {
namespace {

constexpr const char kUsage[] =
    "plan [--preset P | --layers L --kv-heads H --head-dim D | --layers L --kv-lora-rank R"
    " --rope-dim P] [--params-b B] [--context S] [--batch N] [--weight-dtype W] [--kv-dtype K]"
    " [--gpu-memory SIZE] [--sweep [--out-prefix PATH]]";

// Exit status scripts/plot_plan.py uses when matplotlib cannot be imported.
constexpr int kPlotNoMatplotlib = 3;

int PlanHelp(FILE* to) {
  std::fprintf(to,
               "usage: kvbank %s\n"
               "\n"
               "Model (default --preset llama-3.1-8b):\n"
               "  --preset P          one of:",
               kUsage);
  for (const std::string& n : PresetNames()) std::fprintf(to, " %s", n.c_str());
  std::fprintf(
      to,
      "\n"
      "  --layers L --kv-heads H --head-dim D [--head-dim-v DV] [--q-heads Q]\n"
      "                      an explicit MHA/GQA/MQA layout\n"
      "  --layers L --kv-lora-rank R --rope-dim P\n"
      "                      an explicit MLA layout (one latent vector per token and layer)\n"
      "  --params-b B        parameters in billions (presets have their own; else weights = 0)\n"
      "Request:\n"
      "  --context S         tokens per sequence, e.g. 8192 or 8K (K = 1024); default 8K\n"
      "  --batch N           sequences held at once; default 1\n"
      "  --weight-dtype W    fp32|fp16|bf16|int8|fp8|int4; default fp16\n"
      "  --kv-dtype K        fp32|fp16|bf16|int8|fp8_e4m3|fp8_e5m2 (fp8 = fp8_e4m3); default fp16\n"
      "  --gpu-memory SIZE   e.g. 80GiB, 141GB (10^9), 24 (bare = GiB); default 80GiB\n"
      "  --block-tokens T    kvbank tokens per block, for the kvbank figures; default 16\n"
      "Sweep:\n"
      "  --sweep             KV and total for 1K..128K tokens x fp16/int8/fp8 KV; writes\n"
      "                      PATH.csv and PATH.png (python3 + matplotlib, scripts/plot_plan.py)\n"
      "  --out-prefix PATH   default kvbank-plan-MODEL in the current directory\n"
      "\n"
      "GB = bytes / 1024^3. weights = params x bytes/weight; KV = 2*L*n_kv*d*S*b*batch (MLA:\n"
      "L*(kv_lora_rank+rope)*S*b*batch), b = 4 fp32, 2 fp16/bf16, 1 int8/fp8; overhead = 15%% of\n"
      "(weights + KV). Capacity: the KV that fits once weights and overhead are paid,\n"
      "GPU / 1.15 - weights. The kvbank line adds what kvbank's block layout really stores\n"
      "(int8 scales and zero points, fp8 scales, alignment).\n");
  return 0;
}

int Bad(const std::string& msg) {
  std::fprintf(stderr, "kvbank plan: %s\n", msg.c_str());
  std::fprintf(stderr, "usage: kvbank %s\n       kvbank plan --help for details\n", kUsage);
  return 2;
}

bool ParseU64(const std::string& s, uint64_t* out) {
  if (s.empty() || s[0] < '0' || s[0] > '9') return false;
  errno = 0;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(s.c_str(), &end, 10);
  if (errno != 0 || *end != '\0') return false;
  *out = v;
  return true;
}

bool ParseU32(const std::string& s, uint32_t* out) {
  uint64_t v = 0;
  if (!ParseU64(s, &v) || v > 0xffffffffu) return false;
  *out = static_cast<uint32_t>(v);
  return true;
}

// "8192", "8K" / "8k" (x1024), "1M" (x1024^2).
bool ParseTokens(const std::string& s, uint64_t* out) {
  uint64_t mult = 1;
  std::string digits = s;
  if (!digits.empty() && (digits.back() == 'K' || digits.back() == 'k')) {
    mult = 1024;
    digits.pop_back();
  } else if (!digits.empty() && (digits.back() == 'M' || digits.back() == 'm')) {
    mult = 1024 * 1024;
    digits.pop_back();
  }
  uint64_t v = 0;
  if (!ParseU64(digits, &v) || v > (uint64_t{1} << 40)) return false;
  *out = v * mult;
  return true;
}

bool ParseDouble(const std::string& s, double* out) {
  if (s.empty()) return false;
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (*end != '\0' || !std::isfinite(v)) return false;
  *out = v;
  return true;
}

bool ParseKvDType(const std::string& s, DType* out) {
  return ParseDType(s == "fp8" ? "fp8_e4m3" : s, out);
}

// The parsed command line: the planner input plus what only the CLI needs.
struct PlanArgs {
  PlanInput in;
  std::string model;  // preset name or "custom"
  bool sweep = false;
  std::string out_prefix;
};

// Fills *a from the flags; returns "" or a message for Bad().
std::string ParseArgs(int argc, char** argv, PlanArgs* a) {
  // Names and value kinds only: PlanHelp describes them, grouped.
  static const std::vector<cmdline::FlagSpec> kFlags = {
      {"preset", "P", "", ""},        {"layers", "L", "", ""},        {"kv-heads", "H", "", ""},
      {"head-dim", "D", "", ""},      {"head-dim-v", "DV", "", ""},   {"q-heads", "Q", "", ""},
      {"kv-lora-rank", "R", "", ""},  {"rope-dim", "P", "", ""},      {"params-b", "B", "", ""},
      {"context", "S", "", ""},       {"batch", "N", "", ""},         {"weight-dtype", "W", "", ""},
      {"kv-dtype", "K", "", ""},      {"gpu-memory", "SIZE", "", ""}, {"block-tokens", "T", "", ""},
      {"out-prefix", "PATH", "", ""}, {"sweep", "", "", ""},
  };
  auto parsed = cmdline::Parse(std::vector<std::string>(argv + 1, argv + argc), kFlags);
  if (!parsed.ok()) {
    std::string msg(parsed.status().message());
    if (absl::IsNotFound(parsed.status())) msg += "; valid flags: " + cmdline::FlagList(kFlags);
    return msg;
  }
  if (!parsed->positional.empty()) return "unexpected argument '" + parsed->positional[0] + "'";
  std::map<std::string, std::string> opts;
  for (const auto& [name, value] : parsed->values) opts[name] = value;
  a->sweep = opts.count("sweep") && opts["sweep"] == "true";
  opts.erase("sweep");

  const bool explicit_shape = opts.count("layers") || opts.count("kv-heads") ||
                              opts.count("head-dim") || opts.count("kv-lora-rank");
  ModelLayout& m = a->in.layout;
  if (explicit_shape) {
    if (opts.count("preset")) return "give --preset or an explicit layout, not both";
    a->model = "custom";
    m.name = "custom";
    if (!opts.count("layers") || !ParseU32(opts["layers"], &m.num_layers)) {
      return "an explicit layout needs --layers L (a positive integer)";
    }
    if (opts.count("kv-lora-rank")) {
      m.kind = AttentionKind::kMla;
      if (!ParseU32(opts["kv-lora-rank"], &m.kv_lora_rank) ||
          (opts.count("rope-dim") && !ParseU32(opts["rope-dim"], &m.rope_dim))) {
        return "--kv-lora-rank and --rope-dim take non-negative integers";
      }
      m.num_kv_heads = 1;
      m.num_q_heads = 1;
      m.head_dim = m.kv_lora_rank + m.rope_dim;
      m.head_dim_v = m.kv_lora_rank;
      if (opts.count("kv-heads") || opts.count("head-dim")) {
        return "an MLA layout (--kv-lora-rank) takes no --kv-heads or --head-dim";
      }
    } else {
      if (!opts.count("kv-heads") || !ParseU32(opts["kv-heads"], &m.num_kv_heads) ||
          !opts.count("head-dim") || !ParseU32(opts["head-dim"], &m.head_dim)) {
        return "an explicit layout needs --layers, --kv-heads and --head-dim (integers)";
      }
      m.head_dim_v = m.head_dim;
      if (opts.count("head-dim-v") && !ParseU32(opts["head-dim-v"], &m.head_dim_v)) {
        return "--head-dim-v takes an integer";
      }
      m.num_q_heads = m.num_kv_heads;
      if (opts.count("q-heads") && !ParseU32(opts["q-heads"], &m.num_q_heads)) {
        return "--q-heads takes an integer";
      }
      m.kind = m.num_kv_heads == 1               ? AttentionKind::kMqa
               : m.num_kv_heads == m.num_q_heads ? AttentionKind::kMha
                                                 : AttentionKind::kGqa;
    }
    m.layer_dtypes.assign(m.num_layers, DType::kFp16);
  } else {
    a->model = opts.count("preset") ? opts["preset"] : "llama-3.1-8b";
    if (!PresetLayout(a->model, &m)) {
      std::string known;
      for (const std::string& n : PresetNames()) known += (known.empty() ? "" : ", ") + n;
      return "unknown preset '" + a->model + "' (known presets: " + known + ")";
    }
    a->in.params = PresetParams(a->model);
  }
  if (opts.count("params-b")) {
    double billions = 0;
    if (!ParseDouble(opts["params-b"], &billions) || billions < 0) {
      return "--params-b takes a non-negative number of billions, e.g. 8.0";
    }
    a->in.params = billions * 1e9;
  }
  if (opts.count("block-tokens") && !ParseU32(opts["block-tokens"], &m.block_tokens)) {
    return "--block-tokens takes an integer";
  }
  if (opts.count("context") && !ParseTokens(opts["context"], &a->in.context_tokens)) {
    return "--context takes a token count, e.g. 8192 or 8K";
  }
  if (opts.count("batch") && !ParseU64(opts["batch"], &a->in.batch)) {
    return "--batch takes a positive integer";
  }
  if (opts.count("weight-dtype") && !ParseWeightDType(opts["weight-dtype"], &a->in.weight_dtype)) {
    return "--weight-dtype must be fp32, fp16, bf16, int8, fp8 or int4";
  }
  if (opts.count("kv-dtype") && !ParseKvDType(opts["kv-dtype"], &a->in.kv_dtype)) {
    return "--kv-dtype must be fp32, fp16, bf16, int8, fp8_e4m3 (fp8) or fp8_e5m2";
  }
  if (opts.count("gpu-memory") && !ParseMemorySize(opts["gpu-memory"], &a->in.gpu_memory_bytes)) {
    return "--gpu-memory takes a size such as 80GiB, 141GB or 24 (GiB)";
  }
  a->out_prefix = opts.count("out-prefix") ? opts["out-prefix"] : "kvbank-plan-" + a->model;
  return "";
}

std::string Billions(double params) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1fe9", params / 1e9);
  return buf;
}

std::string ShapeText(const ModelLayout& m) {
  char buf[160];
  if (m.kind == AttentionKind::kMla) {
    std::snprintf(buf, sizeof(buf), "mla: %u layers, latent %u + rope %u", m.num_layers,
                  m.kv_lora_rank, m.rope_dim);
  } else {
    std::snprintf(buf, sizeof(buf), "%s: %u layers, %u KV heads, head_dim %u",
                  AttentionKindName(m.kind), m.num_layers, m.num_kv_heads, m.head_dim);
    if (m.head_dim_v != m.head_dim) {
      std::snprintf(buf + std::strlen(buf), sizeof(buf) - std::strlen(buf), "/%u", m.head_dim_v);
    }
  }
  return buf;
}

int PrintPlan(const PlanArgs& a) {
  PlanResult r;
  if (std::string bad = ComputePlan(a.in, &r); !bad.empty()) return Bad(bad);
  const PlanInput& in = a.in;
  const double gpu_gb = ToGb(double(in.gpu_memory_bytes));
  std::printf("model     %s (%s), %s parameters\n", a.model.c_str(), ShapeText(in.layout).c_str(),
              Billions(in.params).c_str());
  std::printf("request   %llu tokens x batch %llu, weights %s, KV %s, GPU memory %.1f GB\n",
              (unsigned long long)in.context_tokens, (unsigned long long)in.batch,
              WeightDTypeName(in.weight_dtype), DTypeName(in.kv_dtype), gpu_gb);
  std::printf("          (GB = bytes / 1024^3)\n");
  std::printf("weights  %6.1f GB   %s params x %g B\n", ToGb(r.weight_bytes),
              Billions(in.params).c_str(), WeightDTypeBits(in.weight_dtype) / 8.0);
  std::printf("KV cache %6.1f GB   %s (%.0f B/token)\n", ToGb(r.kv_bytes), r.kv_formula.c_str(),
              r.kv_bytes_per_token);
  std::printf("overhead %6.1f GB   %.0f%% of (weights + KV)\n", ToGb(r.overhead_bytes),
              in.overhead_fraction * 100);
  if (r.fits) {
    std::printf("total    %6.1f GB   fits in %.1f GB (%.1f GB to spare)\n", ToGb(r.total_bytes),
                gpu_gb, gpu_gb - ToGb(r.total_bytes));
  } else {
    std::printf("total    %6.1f GB   does NOT fit in %.1f GB (%.1f GB short)\n",
                ToGb(r.total_bytes), gpu_gb, ToGb(r.total_bytes) - gpu_gb);
  }
  std::printf("capacity  %llu tokens = %llu sequences of %llu tokens\n",
              (unsigned long long)r.max_tokens, (unsigned long long)r.max_sequences,
              (unsigned long long)in.context_tokens);
  std::printf("          (KV room %.1f GB = %.1f GB / %.2f - weights)\n", ToGb(r.kv_budget_bytes),
              gpu_gb, 1 + in.overhead_fraction);
  std::printf(
      "kvbank    %s blocks of %u tokens = %llu B: %.1f B/token (%+.1f%% vs plan: scales, "
      "alignment)\n",
      DTypeName(in.kv_dtype), r.block_tokens, (unsigned long long)r.block_bytes,
      r.kvbank_bytes_per_token, (r.kvbank_bytes_per_token / r.kv_bytes_per_token - 1) * 100);
  std::printf("          this batch %.1f GB (%llu blocks/sequence); %llu sequences fit\n",
              ToGb(r.kvbank_kv_bytes), (unsigned long long)r.kvbank_blocks_per_sequence,
              (unsigned long long)r.kvbank_max_sequences);
  return 0;
}

// Runs `python scripts/plot_plan.py csv png` without a shell; returns its exit status, or -1 with
// *why set when it could not start.
int RunPlot(const std::string& csv, const std::string& png, std::string* why) {
  std::string script;
  if (const char* env = std::getenv("KVBANK_PLOT_SCRIPT")) {
    script = env;
  }
  if (script.empty()) {
    // Installed: <prefix>/bin/kvbank finds <prefix>/share/kvbank/plot_plan.py.
    char exe[4096];
    const ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    if (n > 0) {
      std::string dir(exe, size_t(n));
      dir = dir.substr(0, dir.rfind('/'));
      const std::string installed = dir + "/../share/kvbank/plot_plan.py";
      if (access(installed.c_str(), R_OK) == 0) script = installed;
    }
  }
#ifdef KVBANK_PLOT_SCRIPT_PATH
  if (script.empty() && access(KVBANK_PLOT_SCRIPT_PATH, R_OK) == 0)
    script = KVBANK_PLOT_SCRIPT_PATH;
#endif
  if (script.empty()) script = "scripts/plot_plan.py";
  if (access(script.c_str(), R_OK) != 0) {
    *why = "plot script " + script + " not found (set KVBANK_PLOT_SCRIPT)";
    return -1;
  }
  // Debian's interpreter first: that is where apt's python3-matplotlib goes.
  const std::string python = access("/usr/bin/python3", X_OK) == 0 ? "/usr/bin/python3" : "python3";
  std::vector<std::string> args = {python, script, csv, png};
  std::vector<char*> argv;
  for (std::string& s : args) argv.push_back(s.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  if (int err = posix_spawnp(&pid, python.c_str(), nullptr, nullptr, argv.data(), environ);
      err != 0) {
    *why = "cannot run " + python + ": " + std::strerror(err);
    return -1;
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) {
      *why = std::string("waitpid: ") + std::strerror(errno);
      return -1;
    }
  }
  if (!WIFEXITED(status)) {
    *why = python + " was killed by signal " + std::to_string(WTERMSIG(status));
    return -1;
  }
  if (WEXITSTATUS(status) == 127) {
    *why = python + " not found";
    return -1;
  }
  return WEXITSTATUS(status);
}

// "2*L*n_kv*d*S*b*batch" and the like: the formula without this plan's numbers.
std::string KvFormulaName(const PlanResult& r) {
  return r.kv_formula.substr(0, r.kv_formula.find(" = "));
}

int Sweep(const PlanArgs& a) {
  static const DType kDTypes[] = {DType::kFp16, DType::kInt8, DType::kFp8E4M3};
  static const char* const kShort[] = {"fp16", "int8", "fp8"};
  constexpr int kN = 3;
  std::vector<uint64_t> lengths;
  for (uint64_t s = 1024; s <= 128 * 1024; s *= 2) lengths.push_back(s);
  struct Row {
    PlanResult r[kN];
  };
  std::vector<Row> rows(lengths.size());
  for (size_t i = 0; i < lengths.size(); ++i) {
    for (int d = 0; d < kN; ++d) {
      PlanInput in = a.in;
      in.context_tokens = lengths[i];
      in.kv_dtype = kDTypes[d];
      if (std::string bad = ComputePlan(in, &rows[i].r[d]); !bad.empty()) return Bad(bad);
    }
  }
  const PlanResult& first = rows[0].r[0];
  const double gpu_gb = ToGb(double(a.in.gpu_memory_bytes));

  std::printf("kvbank plan --sweep: %s (%s), %s params, weights %s = %.1f GB, batch %llu\n",
              a.model.c_str(), ShapeText(a.in.layout).c_str(), Billions(a.in.params).c_str(),
              WeightDTypeName(a.in.weight_dtype), ToGb(first.weight_bytes),
              (unsigned long long)a.in.batch);
  std::printf("GPU memory %.1f GB; KV room after weights and %.0f%% overhead %.1f GB\n", gpu_gb,
              a.in.overhead_fraction * 100, ToGb(first.kv_budget_bytes));
  std::printf("KV formula: %s, b = 2 B (fp16), 1 B (int8, fp8)\n", KvFormulaName(first).c_str());
  std::printf(
      "GB = bytes / 1024^3; plan figures (1 B per int8/fp8 element); * = over GPU memory\n");
  std::printf("\n| tokens | KV fp16 | KV int8 | KV fp8 | total fp16 | total int8 | total fp8 |\n");
  std::printf("|---:|---:|---:|---:|---:|---:|---:|\n");
  for (size_t i = 0; i < lengths.size(); ++i) {
    std::printf("| %llu", (unsigned long long)lengths[i]);
    for (int d = 0; d < kN; ++d) std::printf(" | %.3f", ToGb(rows[i].r[d].kv_bytes));
    for (int d = 0; d < kN; ++d) {
      std::printf(" | %.2f%s", ToGb(rows[i].r[d].total_bytes), rows[i].r[d].fits ? "" : "*");
    }
    std::printf(" |\n");
  }
  std::printf("\nkvbank's own blocks (scales, alignment):");
  for (int d = 0; d < kN; ++d) {
    const PlanResult& r = rows[0].r[d];
    std::printf("%s %s %.1f B/token (%+.1f%%)", d ? ";" : "", kShort[d], r.kvbank_bytes_per_token,
                (r.kvbank_bytes_per_token / r.kv_bytes_per_token - 1) * 100);
  }
  std::printf("\n");

  const std::string csv = a.out_prefix + ".csv";
  const std::string png = a.out_prefix + ".png";
  {
    std::ofstream f(csv);
    f << "# kvbank plan --sweep\n"
      << "# model=" << a.model << "\n"
      << "# batch=" << a.in.batch << "\n"
      << "# weight_dtype=" << WeightDTypeName(a.in.weight_dtype) << "\n"
      << "# weights_gb=" << ToGb(first.weight_bytes) << "\n"
      << "# gpu_memory_gb=" << gpu_gb << "\n"
      << "# kv_budget_gb=" << ToGb(first.kv_budget_bytes) << "\n"
      << "# overhead_fraction=" << a.in.overhead_fraction << "\n"
      << "# kv_formula=" << KvFormulaName(first) << "\n"
      << "# shape=" << ShapeText(a.in.layout) << "\n";
    f << "tokens";
    for (int d = 0; d < kN; ++d) f << ",kv_gb_" << kShort[d];
    for (int d = 0; d < kN; ++d) f << ",total_gb_" << kShort[d];
    for (int d = 0; d < kN; ++d) f << ",kvbank_kv_gb_" << kShort[d];
    f << "\n";
    char buf[64];
    for (size_t i = 0; i < lengths.size(); ++i) {
      f << lengths[i];
      for (int d = 0; d < kN; ++d) {
        std::snprintf(buf, sizeof(buf), ",%.6f", ToGb(rows[i].r[d].kv_bytes));
        f << buf;
      }
      for (int d = 0; d < kN; ++d) {
        std::snprintf(buf, sizeof(buf), ",%.6f", ToGb(rows[i].r[d].total_bytes));
        f << buf;
      }
      for (int d = 0; d < kN; ++d) {
        std::snprintf(buf, sizeof(buf), ",%.6f", ToGb(rows[i].r[d].kvbank_kv_bytes));
        f << buf;
      }
      f << "\n";
    }
    f.close();
    if (!f) {
      std::fprintf(stderr, "kvbank plan: cannot write %s\n", csv.c_str());
      return 1;
    }
  }
  std::printf("wrote %s\n", csv.c_str());
  std::fflush(stdout);

  std::string why;
  const int rc = RunPlot(csv, png, &why);
  if (rc == 0) {
    std::printf("wrote %s\n", png.c_str());
  } else if (rc == kPlotNoMatplotlib) {
    std::printf(
        "no plot: matplotlib is not installed for python3 (apt-get install python3-matplotlib, "
        "or scripts/install-deps.sh); the table and %s are complete\n",
        csv.c_str());
  } else if (rc < 0) {
    std::printf("no plot: %s; the table and %s are complete\n", why.c_str(), csv.c_str());
  } else {
    std::printf(
        "no plot: scripts/plot_plan.py exited with status %d; the table and %s are "
        "complete\n",
        rc, csv.c_str());
  }
  return 0;
}

}  // namespace

int PlanMain(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0 ||
        std::strcmp(argv[i], "--helpfull") == 0) {
      return PlanHelp(stdout);
    }
  }
  PlanArgs a;
  if (std::string bad = ParseArgs(argc, argv, &a); !bad.empty()) return Bad(bad);
  return a.sweep ? Sweep(a) : PrintPlan(a);
}

}  // namespace kvbank
