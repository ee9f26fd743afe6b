// copy_bench: the host copy kernel that every host-memory transfer runs (PayloadCopyCpu), a
// gather (pool -> payload, a fetch) and a scatter (payload -> pool, an append), with ordinary
// stores and with the destination's lines streamed around the caches (kernels::CopyStores),
// against one memcpy of the same bytes in the same repetition.
//
//   copy_bench [--quick] [--reps N] [--mib N,N,...]
//
// Layout: llama-3.1-8b in bf16 (32 layers, 8 kv heads, head_dim 128, 16-token blocks: 128 KiB a
// token; a (layer, K/V, head) run in a block is 4 KiB). A payload of `mib` MiB holds every layer
// of mib * 8 tokens, starting at a block boundary.
// Memory larger than the caches, as a server's pool and a client's buffers are: the pool is
// 512 MiB of blocks, and each call takes its blocks from a new place in it (a shuffled table);
// the payload side and memcpy's source and destination rotate over two 256 MiB buffers.
// ratio = memcpy's seconds / the kernel's, per repetition (memcpy measured right before each
// kernel call); medians. Exits 1 when a gather does not return what the scatter stored.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/block_copy.h"
#include "kvbank/layout.h"

namespace kvbank::kernels {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint64_t kMiB = uint64_t{1} << 20;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

template <typename F>
double Seconds(F&& f) {
  const auto t0 = Clock::now();
  f();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Touches every page, so that no repetition pays first-touch faults.
std::vector<uint8_t> Filled(uint64_t n, uint8_t seed) {
  std::vector<uint8_t> v(n);
  for (uint64_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>((i * 131 + seed) >> 3);
  return v;
}

int Main(int argc, char** argv) {
  bool quick = false;
  int reps = 15;
  std::vector<uint64_t> mibs = {2, 16, 64};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      quick = true;
    } else if (a == "--reps" && i + 1 < argc) {
      reps = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--mib" && i + 1 < argc) {
      mibs.clear();
      for (char* p = argv[++i]; *p != '\0';) {
        mibs.push_back(std::max<uint64_t>(1, std::strtoull(p, &p, 10)));
        if (*p == ',') ++p;
      }
    } else {
      std::fprintf(stderr, "usage: copy_bench [--quick] [--reps N] [--mib N,N,...]\n");
      return 2;
    }
  }
  const uint64_t span = (quick ? 16 : 256) * kMiB, pool_bytes = (quick ? 32 : 512) * kMiB;
  if (quick) {
    reps = 2;
    mibs = {2};
  }
  ModelLayout llama;
  if (!PresetLayout("llama-3.1-8b", &llama, DType::kBf16)) return 1;
  const BlockLayout b = ComputeBlockLayout(llama);
  const uint64_t pool_blocks = pool_bytes / b.block_bytes;
  std::vector<uint8_t> pool = Filled(pool_blocks * b.block_bytes, 1);
  std::vector<uint8_t> a = Filled(span, 2), c = Filled(span, 3);
  std::mt19937_64 rng(20261205);
  std::printf(
      "copy_bench: llama-3.1-8b bf16 (%llu KiB a token, 4 KiB runs), a %llu MiB pool, buffers "
      "rotating over %llu MiB; ratio = memcpy's seconds / the kernel's, median of %d\n",
      static_cast<unsigned long long>(PayloadLayout::Make(b, 0, 32, 1).total_bytes / 1024),
      static_cast<unsigned long long>(pool_bytes / kMiB),
      static_cast<unsigned long long>(span / kMiB), reps);
  std::printf("%-7s %8s | %16s | %16s | %16s | %16s\n", "size", "memcpy", "gather cached",
              "gather streamed", "scatter cached", "scatter streamed");
  std::printf("%-7s %8s | %16s | %16s | %16s | %16s\n", "", "GB/s", "GB/s   ratio", "GB/s   ratio",
              "GB/s   ratio", "GB/s   ratio");
  bool ok = true;
  for (uint64_t mib : mibs) {
    const uint64_t tokens = mib * kMiB / PayloadLayout::Make(b, 0, 32, 1).total_bytes;
    const PayloadLayout pl = PayloadLayout::Make(b, 0, 32, tokens);
    const uint64_t n = pl.total_bytes, nblocks = tokens / b.layers[0].block_tokens;
    if (n > span / 2 || nblocks > pool_blocks) continue;
    std::vector<int32_t> ids(pool_blocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::vector<double> gbs[5], ratio[4];
    for (int rep = 0; rep <= reps; ++rep) {
      PayloadMap m;
      m.pool = pool.data();
      m.block_bytes = b.block_bytes;
      m.layers = b.layers.data();
      m.layer_offset = pl.layer_offset.data();
      m.num_layers = 32;
      m.block_table = ids.data();
      m.num_tokens = tokens;
      m.total_bytes = n;
      // Each call's payload side at a new place in the 256 MiB buffers.
      uint64_t turn = 0;
      auto at = [&](std::vector<uint8_t>& v) {
        ++turn;
        return v.data() + ((uint64_t(rep) * 5 + turn) * n * 3 % (span - n)) / 4096 * 4096;
      };
      auto base = [&]() {
        uint8_t* d = at(c);
        const uint8_t* s = at(a);
        return Seconds([&] { std::memcpy(d, s, n); });
      };
      for (int j = 0; j < 4; ++j) {
        const int k = (rep + j) % 4;  // each kernel in each place of the order in turn
        std::shuffle(ids.begin(), ids.end(), rng);  // blocks no earlier call touched lately
        const double m0 = base();
        const CopyStores stores = k % 2 == 0 ? CopyStores::kCached : CopyStores::kStream;
        uint8_t* buf = at(k < 2 ? c : a);
        const double t = Seconds([&] {
          PayloadCopyCpu(m, k < 2 ? CopyDirection::kPoolToPayload : CopyDirection::kPayloadToPool,
                         0, buf, n, stores);
        });
        if (rep > 0) {
          ratio[k].push_back(m0 / t);
          gbs[k].push_back(double(n) / t / 1e9);
          gbs[4].push_back(double(n) / m0 / 1e9);
        }
        if (k >= 2) {
          // The blocks hold the payload just scattered: a gather gives it back.
          std::vector<uint8_t> back(n);
          PayloadCopyCpu(m, CopyDirection::kPoolToPayload, 0, back.data(), n, CopyStores::kStream);
          if (std::memcmp(back.data(), buf, n) != 0) {
            std::fprintf(stderr, "copy_bench: %llu MiB: a gather differs from what was scattered\n",
                         static_cast<unsigned long long>(mib));
            ok = false;
          }
        }
      }
    }
    std::printf("%4llu MiB %8.2f | %7.2f   %5.2f | %7.2f   %5.2f | %7.2f   %5.2f | %7.2f   %5.2f\n",
                static_cast<unsigned long long>(mib), Median(gbs[4]), Median(gbs[0]),
                Median(ratio[0]), Median(gbs[1]), Median(ratio[1]), Median(gbs[2]),
                Median(ratio[2]), Median(gbs[3]), Median(ratio[3]));
  }
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace kvbank::kernels

int main(int argc, char** argv) { return kvbank::kernels::Main(argc, argv); }
