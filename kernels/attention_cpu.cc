// The CPU decode-attention kernel (see attention.h for the semantics).
//
// Work is split into tasks of (item, kv head, chunk of attended tokens); each task walks its
// tokens block by block, decodes the K and V rows of the run inside one block into an fp32 tile
// with the codecs (one call per run: the rows of one head are contiguous in a block, and so are
// their int8 scales), and updates an online softmax (running max, sum and unnormalised output)
// for every q head of its kv head's group, so each tile is decoded once per group. A second phase
// merges the chunks of each (item, q head) by log-sum-exp and, where asked, turns the kept scores
// into per-token probability sums.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

#include "kernels/attention.h"
#include "kernels/quant.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KVBANK_ATT_X86 1
#else
#define KVBANK_ATT_X86 0
#endif

namespace kvbank::kernels {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// A chunk is at least this many attended tokens, so that short contexts stay one task per
// (item, kv head) and the merge stays cheap.
constexpr uint32_t kMinChunk = 256;

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
// The tile math compiled twice: for Haswell and later (AVX2 + FMA) and the baseline; the loader
// picks one (GNU ifunc).
#define KVBANK_ATT_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define KVBANK_ATT_CLONES
#endif

float DotScalar(const float* a, const float* b, uint32_t n) {
  // Eight independent partial sums so the compiler can vectorise the reduction.
  float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  uint32_t c = 0;
  for (; c + 8 <= n; c += 8) {
    for (uint32_t u = 0; u < 8; ++u) part[u] += a[c + u] * b[c + u];
  }
  float dot =
      ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
  for (; c < n; ++c) dot += a[c] * b[c];
  return dot;
}

#if KVBANK_ATT_X86
__attribute__((target("avx2,fma"))) float DotAvx2(const float* a, const float* b, uint32_t n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  uint32_t c = 0;
  for (; c + 16 <= n; c += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + c), _mm256_loadu_ps(b + c), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + c + 8), _mm256_loadu_ps(b + c + 8), s1);
  }
  for (; c + 8 <= n; c += 8)
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + c), _mm256_loadu_ps(b + c), s0);
  s0 = _mm256_add_ps(s0, s1);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s0), _mm256_extractf128_ps(s0, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  float dot = _mm_cvtss_f32(h);
  for (; c < n; ++c) dot += a[c] * b[c];
  return dot;
}
#endif

using DotFn = float (*)(const float*, const float*, uint32_t);

DotFn ActiveDot() {
#if KVBANK_ATT_X86
  static const DotFn fn =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? DotAvx2 : DotScalar;
  return fn;
#else
  return DotScalar;
#endif
}

struct Task {
  uint32_t item, head, j0, j1;  // attended indices [j0, j1) of kv head `head` of `item`
};

// Decodes rows [tb, tb + rows) of kv head h (K: kv 0, V: kv 1) of one block into `tile`
// ([rows][dim] fp32) and returns it, or returns the block's own rows when they are fp32 already.
const float* DecodeRun(const uint8_t* blk, const LayerView& v, uint32_t kv, uint32_t h, uint32_t tb,
                       uint32_t rows, uint32_t dim, float* tile) {
  const uint8_t* src = blk + (kv == 0 ? v.KRow(h, tb) : v.VRow(h, tb));
  const size_t n = size_t{rows} * dim;
  switch (v.dtype) {
    case DType::kFp32:
      return reinterpret_cast<const float*>(src);
    case DType::kFp16:
    case DType::kBf16:
      ConvertElements(src, v.dtype, tile, DType::kFp32, n);
      return tile;
    case DType::kInt8:
      DequantizeInt8Rows(src, reinterpret_cast<const float*>(blk + v.Int8Scale(kv, h, tb)),
                         blk + v.Int8ZeroPoint(kv, h, tb), rows, dim, tile, DType::kFp32);
      return tile;
    case DType::kFp8E4M3:
    case DType::kFp8E5M2:
      DecodeFp8(src, v.dtype, n, *reinterpret_cast<const float*>(blk + v.Fp8Scale(kv, h)), tile,
                DType::kFp32);
      return tile;
  }
  return tile;
}

// Online-softmax state of one q head over one task: m (running max), l (sum of exp(s - m)) and
// acc ([dv], sum of exp(s - m) * v).
// For each q head r of the group: scores of `rows` K rows (k: [rows][dk]), the softmax update and
// the V accumulation (v: rows with stride v_stride, dv wide). scores: [group][rows] scratch;
// kept (optional): where the scaled scores go, [group] rows of stride kept_stride.
KVBANK_ATT_CLONES
void TileUpdate(DotFn dot_fn, const float* q, uint32_t group, uint32_t dk, const float* k,
                const float* v, uint32_t v_stride, uint32_t dv, uint32_t rows, float sm_scale,
                float* m, float* l, float* acc, float* scores, float* kept, size_t kept_stride) {
  for (uint32_t r = 0; r < group; ++r) {
    const float* qr = q + size_t{r} * dk;
    float* s = scores + size_t{r} * rows;
    float tile_max = kNegInf;
    for (uint32_t t = 0; t < rows; ++t) {
      s[t] = dot_fn(qr, k + size_t{t} * dk, dk) * sm_scale;
      tile_max = std::max(tile_max, s[t]);
    }
    if (kept != nullptr) std::memcpy(kept + r * kept_stride, s, rows * sizeof(float));
    const float m_new = std::max(m[r], tile_max);
    // exp(-inf - finite) = 0 rescales an empty state; m_new is finite for finite scores.
    const float alpha = std::exp(m[r] - m_new);
    float* a = acc + size_t{r} * dv;
    float sum = 0;
    for (uint32_t t = 0; t < rows; ++t) {
      s[t] = std::exp(s[t] - m_new);
      sum += s[t];
    }
    // 32 accumulator lanes stay in registers over the tile's rows.
    uint32_t c0 = 0;
    for (; c0 + 32 <= dv; c0 += 32) {
      float w[32];
      for (uint32_t u = 0; u < 32; ++u) w[u] = a[c0 + u] * alpha;
      for (uint32_t t = 0; t < rows; ++t) {
        const float* vt = v + size_t{t} * v_stride + c0;
        for (uint32_t u = 0; u < 32; ++u) w[u] += s[t] * vt[u];
      }
      for (uint32_t u = 0; u < 32; ++u) a[c0 + u] = w[u];
    }
    for (uint32_t c = c0; c < dv; ++c) {
      float w = a[c] * alpha;
      for (uint32_t t = 0; t < rows; ++t) w += s[t] * v[size_t{t} * v_stride + c];
      a[c] = w;
    }
    l[r] = l[r] * alpha + sum;
    m[r] = m_new;
  }
}

// Runs fn(task, worker) for task in [0, n) on `threads` workers (the caller is worker 0).
template <typename Fn>
void ParallelFor(size_t n, uint32_t threads, Fn fn) {
  std::atomic<size_t> next{0};
  auto work = [&](uint32_t worker) {
    for (size_t t; (t = next.fetch_add(1, std::memory_order_relaxed)) < n;) fn(t, worker);
  };
  const uint32_t extra = static_cast<uint32_t>(std::min<size_t>(threads, n)) - 1;
  std::vector<std::thread> pool;
  pool.reserve(extra);
  for (uint32_t w = 1; w <= extra; ++w) pool.emplace_back(work, w);
  work(0);
  for (std::thread& t : pool) t.join();
}

}  // namespace

void DecodeAttentionCpu(const DecodeAttentionParams& p, uint32_t num_threads) {
  const PagedKv& kv = p.kv;
  if (kv.batch == 0) return;
  if (num_threads == 0) num_threads = std::max(1u, std::thread::hardware_concurrency());
  const uint32_t group = p.Group(), dk = p.head_dim, dv = p.head_dim_v;
  const uint32_t bt = kv.layers[0].block_tokens;

  // Chunks: enough tasks to keep every thread busy (about 4 per thread), none shorter than
  // kMinChunk tokens.
  const size_t heads = size_t{kv.batch} * p.num_kv_heads;
  const size_t want = std::max<size_t>(1, (size_t{num_threads} * 4 + heads - 1) / heads);
  std::vector<Task> tasks;
  std::vector<size_t> first_task(heads + 1, 0);      // (item, kv head) -> its tasks
  std::vector<size_t> kept_offset(kv.batch + 1, 0);  // item -> its [num_q_heads][n] scores
  for (uint32_t i = 0; i < kv.batch; ++i) {
    const uint32_t n = MakeAttendSpan(kv.lengths[i], p.window, p.sinks).Count();
    const bool keep = p.token_probs != nullptr && p.token_probs[i] != nullptr;
    kept_offset[i + 1] = kept_offset[i] + (keep ? size_t{p.num_q_heads} * n : 0);
    const uint32_t chunk =
        std::max<uint32_t>(kMinChunk, static_cast<uint32_t>((n + want - 1) / want));
    for (uint32_t g = 0; g < p.num_kv_heads; ++g) {
      first_task[size_t{i} * p.num_kv_heads + g] = tasks.size();
      for (uint32_t j = 0; j < n || (j == 0 && n == 0); j += chunk) {
        tasks.push_back({i, g, j, std::min(n, j + chunk)});
        if (n == 0) break;
      }
    }
  }
  first_task[heads] = tasks.size();

  // Partial states: [task][group] (m, l) and [task][group][dv] acc.
  std::vector<float> part_m(tasks.size() * group, kNegInf), part_l(tasks.size() * group, 0.0f);
  std::vector<float> part_acc(tasks.size() * group * dv, 0.0f);
  std::vector<float> kept(kept_offset[kv.batch]);
  const uint32_t workers = static_cast<uint32_t>(std::min<size_t>(num_threads, tasks.size()));
  // Per-worker scratch: K tile, V tile, scores.
  const size_t tile_k = size_t{bt} * dk, tile_v = size_t{bt} * dv;
  std::vector<float> scratch(size_t{workers} * (tile_k + tile_v + size_t{group} * bt));

  const DotFn dot_fn = ActiveDot();
  ParallelFor(tasks.size(), workers, [&](size_t ti, uint32_t w) {
    const Task& task = tasks[ti];
    const LayerView& v = kv.layers[task.item];
    const AttendSpan span = MakeAttendSpan(kv.lengths[task.item], p.window, p.sinks);
    float* kt = scratch.data() + w * (tile_k + tile_v + size_t{group} * bt);
    float* vt = kt + tile_k;
    float* sc = vt + tile_v;
    const float* q = p.q + (size_t{task.item} * p.num_q_heads + size_t{task.head} * group) * dk;
    float* m = part_m.data() + ti * group;
    float* l = part_l.data() + ti * group;
    float* acc = part_acc.data() + ti * group * dv;
    const uint32_t n = span.Count();
    float* keep = kept_offset[task.item + 1] > kept_offset[task.item]
                      ? kept.data() + kept_offset[task.item] + size_t{task.head} * group * n
                      : nullptr;
    for (uint32_t j = task.j0; j < task.j1;) {
      // A run: contiguous positions inside one block and one segment (sinks or recent).
      const uint32_t pos = span.Position(j), tb = pos % bt;
      uint32_t rows = std::min(bt - tb, task.j1 - j);
      if (j < span.sink_end) rows = std::min(rows, span.sink_end - j);
      const uint8_t* blk = kv.Block(task.item, pos);
      const float* k = DecodeRun(blk, v, 0, task.head, tb, rows, dk, kt);
      const float* vv = v.has_v ? DecodeRun(blk, v, 1, task.head, tb, rows, dv, vt) : k;
      TileUpdate(dot_fn, q, group, dk, k, vv, v.has_v ? dv : dk, dv, rows, p.sm_scale, m, l, acc,
                 sc, keep != nullptr ? keep + j : nullptr, n);
      j += rows;
    }
  });

  // Merge the chunks of each (item, q head), then the probability sums of each item.
  ParallelFor(kv.batch, workers, [&](size_t i, uint32_t) {
    const uint32_t n = MakeAttendSpan(kv.lengths[i], p.window, p.sinks).Count();
    for (uint32_t h = 0; h < p.num_q_heads; ++h) {
      const uint32_t g = h / group, r = h % group;
      const size_t t0 = first_task[i * p.num_kv_heads + g],
                   t1 = first_task[i * p.num_kv_heads + g + 1];
      float mx = kNegInf;
      for (size_t t = t0; t < t1; ++t) mx = std::max(mx, part_m[t * group + r]);
      float* out = p.out + (i * p.num_q_heads + h) * dv;
      float* lse = p.lse + i * p.num_q_heads + h;
      if (n == 0 || mx == kNegInf) {
        std::fill(out, out + dv, 0.0f);
        *lse = kNegInf;
        continue;
      }
      float sum = 0;
      std::fill(out, out + dv, 0.0f);
      for (size_t t = t0; t < t1; ++t) {
        const float w = std::exp(part_m[t * group + r] - mx);
        sum += w * part_l[t * group + r];
        const float* a = part_acc.data() + (t * group + r) * dv;
        for (uint32_t c = 0; c < dv; ++c) out[c] += w * a[c];
      }
      const float inv = 1.0f / sum;
      for (uint32_t c = 0; c < dv; ++c) out[c] *= inv;
      *lse = mx + std::log(sum);
    }
    if (kept_offset[i + 1] == kept_offset[i]) return;
    const AttendSpan span = MakeAttendSpan(kv.lengths[i], p.window, p.sinks);
    float* probs = p.token_probs[i];
    std::fill(probs, probs + kv.lengths[i], 0.0f);
    const float* s = kept.data() + kept_offset[i];
    for (uint32_t h = 0; h < p.num_q_heads; ++h) {
      const float lse = p.lse[i * p.num_q_heads + h];
      for (uint32_t j = 0; j < n; ++j)
        probs[span.Position(j)] += std::exp(s[size_t{h} * n + j] - lse);
    }
  });
}

}  // namespace kvbank::kernels
