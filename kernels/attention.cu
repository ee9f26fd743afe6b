// CUDA decode attention (flash-decoding; see attention_cuda.h). Rows are found through PagedKv's
// layout (LayerView) and decoded by quant_math.h, the same view and math as the CPU paths.
//
// The split kernel reads K/V rows in chunks of 8 elements with one vector load per chunk (16
// bytes for fp16/bf16, 8 for int8/fp8, 2 x 16 for fp32). A token is handled by L lanes (L a power
// of two, each lane owning chunks lane % L + s * L of the row), and a lane group takes kU tokens
// per step, so a warp has kU * 32 / L tokens in flight and a 128-thread block four times that;
// every lane group keeps its own online softmax for up to kH q heads in registers (q in shared
// memory), so the main loop has no block barrier and no serial step, and the K and V loads of a
// step's tokens are all issued before any of them is used. The block's lane groups are merged by
// shuffles and then through shared memory once, at the end.
#include <cstdint>

#include "kernels/attention_cuda.h"

namespace kvbank::kernels {

namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr uint32_t kChunk = 8;            // elements per vector load
constexpr uint32_t kMinSplit = 64;        // fewest attended tokens a split gets
constexpr uint32_t kTargetBlocks = 528;   // 4 per SM of an H100 / H200 (132 SMs): 1-2 waves
constexpr size_t kSmemLimit = 46 * 1024;  // dynamic; the static arrays take the rest of 48 KiB
constexpr unsigned kFullMask = 0xffffffffu;

// How a batch is cut: q heads per block (`heads`), blocks per kv head (`q_tiles`) and splits of
// `split_tokens` attended tokens. `slots`: V chunks per lane (the kernel's kS, from head_dim_v);
// `dkp`: head_dim rounded up to kChunk (the q row stride in shared memory).
struct Plan {
  uint32_t heads = 0, q_tiles = 0, splits = 0, split_tokens = 0, slots = 0, dkp = 0;
  size_t smem = 0;
};

// The V accumulators of a lane take kS * kChunk floats per head; kH heads share a block. kS is the
// smallest of {1, 2, 16} that covers head_dim_v with 32 lanes per token (up to 256, 512, 4096).
constexpr int HeadsFor(int slots) { return slots <= 2 ? 8 : 1; }

uint32_t SlotsFor(uint32_t dv) {
  const uint32_t chunks = (dv + kChunk - 1) / kChunk;
  const uint32_t need = (chunks + 31) / 32;
  return need <= 1 ? 1 : need <= 2 ? 2 : 16;
}

size_t SmemBytes(uint32_t heads, uint32_t dkp, uint32_t dv) {
  // q [heads][dkp], acc [heads][dv].
  return sizeof(float) * heads * (size_t{dkp} + dv);
}

Plan MakePlan(const DecodeAttentionParams& p, uint32_t max_length) {
  Plan plan;
  const uint32_t group = p.Group();
  plan.slots = SlotsFor(p.head_dim_v);
  plan.dkp = (p.head_dim + kChunk - 1) / kChunk * kChunk;
  const uint32_t most_heads = static_cast<uint32_t>(HeadsFor(static_cast<int>(plan.slots)));
  plan.heads = group < most_heads ? group : most_heads;
  while (plan.heads > 0 && SmemBytes(plan.heads, plan.dkp, p.head_dim_v) > kSmemLimit) {
    --plan.heads;
  }
  if (plan.heads == 0) return plan;
  plan.smem = SmemBytes(plan.heads, plan.dkp, p.head_dim_v);
  plan.q_tiles = (group + plan.heads - 1) / plan.heads;
  const uint32_t n = MakeAttendSpan(max_length, p.window, p.sinks).Count();
  const uint64_t base = uint64_t{p.kv.batch} * p.num_kv_heads * plan.q_tiles;
  uint64_t splits = (kTargetBlocks + base - 1) / base;
  const uint64_t most = (uint64_t{n} + kMinSplit - 1) / kMinSplit;
  splits = splits < most ? splits : most;
  if (splits == 0) splits = 1;
  uint64_t per = (uint64_t{n} + splits - 1) / splits;
  per = (per + 31) / 32 * 32;
  if (per == 0) per = 32;
  plan.split_tokens = static_cast<uint32_t>(per);
  plan.splits = static_cast<uint32_t>((uint64_t{n} + per - 1) / per);
  if (plan.splits == 0) plan.splits = 1;
  return plan;
}

// Workspace: m, l [batch][num_q_heads][splits], then acc [batch][num_q_heads][splits][dv]. With
// one split the split kernel writes out and lse itself and the workspace is not touched.
size_t WorkspaceFor(const DecodeAttentionParams& p, const Plan& plan) {
  return sizeof(float) * size_t{p.kv.batch} * p.num_q_heads * plan.splits * (2 + p.head_dim_v);
}

__device__ inline float WarpSum(float x) {
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(kFullMask, x, off);
  return x;
}

// The raw bytes of one chunk (kChunk elements of dtype D) as 32-bit words.
template <DType D>
struct Chunk {
  static constexpr uint32_t kBytes = kChunk * DTypeBytes(D);
  static constexpr uint32_t kWords = kBytes / 4;
  uint32_t w[kWords];
};

// Chunk c of a row of `row_bytes` bytes: vector loads where the chunk is whole and aligned, else
// byte loads with zeros past the row (zeros decode to finite values and meet zero q / are never
// written out).
template <DType D>
__device__ inline void LoadChunk(const uint8_t* row, uint32_t c, uint32_t row_bytes,
                                 Chunk<D>* out) {
  constexpr uint32_t kBytes = Chunk<D>::kBytes;
  const uint32_t off = c * kBytes;
  const uint8_t* src = row + off;
  const uintptr_t align = kBytes >= 16 ? 16 : kBytes;
  if (off + kBytes <= row_bytes && (reinterpret_cast<uintptr_t>(src) & (align - 1)) == 0) {
    if constexpr (kBytes == 8) {
      const uint2 x = *reinterpret_cast<const uint2*>(src);
      out->w[0] = x.x;
      out->w[1] = x.y;
    } else {
#pragma unroll
      for (uint32_t i = 0; i < kBytes / 16; ++i) {
        const uint4 x = reinterpret_cast<const uint4*>(src)[i];
        out->w[4 * i] = x.x;
        out->w[4 * i + 1] = x.y;
        out->w[4 * i + 2] = x.z;
        out->w[4 * i + 3] = x.w;
      }
    }
    return;
  }
#pragma unroll
  for (uint32_t i = 0; i < Chunk<D>::kWords; ++i) out->w[i] = 0;
#pragma unroll
  for (uint32_t b = 0; b < kBytes; ++b) {  // unrolled: w stays in registers
    if (off + b < row_bytes) out->w[b / 4] |= uint32_t{src[b]} << (8 * (b % 4));
  }
}

// Element e of a chunk as float: DecodeKv<D>'s math on the bytes held in registers.
template <DType D>
__device__ inline float DecodeAt(const Chunk<D>& x, uint32_t e, float scale, uint8_t zp) {
  if constexpr (D == DType::kFp32) {
    return qmath::BitsFloat(x.w[e]);
  } else if constexpr (D == DType::kFp16) {
    return qmath::HalfToFloat(static_cast<uint16_t>(x.w[e / 2] >> (16 * (e % 2))));
  } else if constexpr (D == DType::kBf16) {
    return qmath::Bf16ToFloat(static_cast<uint16_t>(x.w[e / 2] >> (16 * (e % 2))));
  } else if constexpr (D == DType::kInt8) {
    return qmath::DequantizeInt8(static_cast<uint8_t>(x.w[e / 4] >> (8 * (e % 4))), zp, scale);
  } else {
    return qmath::DecodeFp8(static_cast<uint8_t>(x.w[e / 4] >> (8 * (e % 4))), scale, D);
  }
}

// One CUDA block: item blockIdx.z, kv head g and q-head tile from blockIdx.y, split blockIdx.x.
// kS: V chunks per lane; kH: q heads per block at most (plan.heads <= kH).
template <DType D, int kS, int kH>
__device__ void SplitBody(const DecodeAttentionParams& p, const Plan& plan, float* ws_m,
                          float* ws_l, float* ws_acc, float* smem) {
  constexpr int kAcc = kS * static_cast<int>(kChunk);
  constexpr bool kVFirst = kS <= 2;
  constexpr int kU = kS == 1 ? 2 : 1;   // tokens per lane group per step (kS 2: would spill)
  constexpr uint32_t kKBatch = 4 / kU;  // K chunks per token loaded before use
  const uint32_t item = blockIdx.z, split = blockIdx.x;
  const uint32_t g = blockIdx.y / plan.q_tiles, qt = blockIdx.y % plan.q_tiles;
  const uint32_t group = p.Group(), dk = p.head_dim, dv = p.head_dim_v, dkp = plan.dkp;
  const uint32_t h0 = g * group + qt * plan.heads;
  const uint32_t nh = min(plan.heads, group - qt * plan.heads);
  const uint32_t tid = threadIdx.x, lane = tid & 31u, warp = tid / 32u;
  const LayerView lv = p.kv.layers[item];
  const int32_t* blocks = p.kv.indices + p.kv.indptr[item];

  float* sq = smem;                             // [heads][dkp], zero past dk
  float* sacc = sq + size_t{plan.heads} * dkp;  // [heads][dv]
  __shared__ float sw_m[kWarps][kH], sw_l[kWarps][kH], sw_scale[kWarps][kH];
  __shared__ float s_m[kH], s_l[kH];

  const float* q = p.q + (size_t{item} * p.num_q_heads + h0) * dk;
  for (uint32_t x = tid; x < nh * dkp; x += kThreads) {
    const uint32_t r = x / dkp, c = x % dkp;
    sq[x] = c < dk ? q[size_t{r} * dk + c] : 0.0f;
  }
  __syncthreads();

  // Lanes per token: the fewest (a power of two) that hold a V row in kS chunks each.
  const uint32_t ck = (dk + kChunk - 1) / kChunk, cv = (dv + kChunk - 1) / kChunk;
  const uint32_t want = (cv + kS - 1) / kS;
  uint32_t lanes = 1;
  while (lanes < want && lanes < 32) lanes <<= 1;
  const uint32_t per_warp = 32 / lanes, sub = lane / lanes, cl = lane % lanes;
  const uint32_t groups = kWarps * per_warp, sg = warp * per_warp + sub;
  const uint32_t k_slots = (ck + lanes - 1) / lanes;
  const uint32_t k_bytes = dk * DTypeBytes(D), v_bytes = dv * DTypeBytes(D);
  const uint32_t v_part = lv.has_v ? 1u : 0u;

  float m[kH], l[kH], acc[kH][kAcc];
#pragma unroll
  for (int h = 0; h < kH; ++h) {
    m[h] = -INFINITY;
    l[h] = 0.0f;
#pragma unroll
    for (int i = 0; i < kAcc; ++i) acc[h][i] = 0.0f;
  }

  const AttendSpan span = MakeAttendSpan(p.kv.lengths[item], p.window, p.sinks);
  const uint32_t n = span.Count();
  const uint32_t j0 = split * plan.split_tokens;
  const uint32_t j1 = min(n, j0 + plan.split_tokens);

  // Each lane group takes kU tokens per step (tokens jt + u * groups + sg): their K and V loads
  // are all issued before the first is used.
  for (uint32_t jt = j0; jt < j1; jt += groups * kU) {
    bool valid[kU];
    const uint8_t* krow[kU];
    const uint8_t* vrow[kU];
    float k_scale[kU], v_scale[kU];
    uint8_t k_zp[kU], v_zp[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const uint32_t j = jt + u * groups + sg;
      valid[u] = j < j1;
      krow[u] = vrow[u] = nullptr;
      k_scale[u] = v_scale[u] = 1.0f;
      k_zp[u] = v_zp[u] = 0;
      if (!valid[u]) continue;
      const uint32_t pos = span.Position(j);
      const uint8_t* blk = p.kv.pool + uint64_t(blocks[pos / lv.block_tokens]) * p.kv.block_bytes;
      const uint32_t tb = pos % lv.block_tokens;
      krow[u] = blk + lv.KRow(g, tb);
      vrow[u] = lv.has_v ? blk + lv.VRow(g, tb) : krow[u];
      if constexpr (D == DType::kInt8) {
        k_scale[u] = *reinterpret_cast<const float*>(blk + lv.Int8Scale(0, g, tb));
        k_zp[u] = blk[lv.Int8ZeroPoint(0, g, tb)];
        v_scale[u] = *reinterpret_cast<const float*>(blk + lv.Int8Scale(v_part, g, tb));
        v_zp[u] = blk[lv.Int8ZeroPoint(v_part, g, tb)];
      } else if constexpr (qmath::IsFp8DType(D)) {
        k_scale[u] = *reinterpret_cast<const float*>(blk + lv.Fp8Scale(0, g));
        v_scale[u] = *reinterpret_cast<const float*>(blk + lv.Fp8Scale(v_part, g));
      }
    }
    const auto LoadV = [&](int u, int s, Chunk<D>* out) {
      const uint32_t c = cl + s * lanes;
      if (valid[u] && c < cv) {
        LoadChunk<D>(vrow[u], c, v_bytes, out);
      } else {
#pragma unroll
        for (uint32_t i = 0; i < Chunk<D>::kWords; ++i) out->w[i] = 0;
      }
    };
    // V first (when its chunks fit in registers next to the accumulators): its loads are in
    // flight while K is loaded and dotted.
    Chunk<D> vraw[kVFirst ? kU * kS : 1];
    if constexpr (kVFirst) {
#pragma unroll
      for (int u = 0; u < kU; ++u) {
#pragma unroll
        for (int s = 0; s < kS; ++s) LoadV(u, s, &vraw[u * kS + s]);
      }
    }
    float part[kU][kH];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
#pragma unroll
      for (int h = 0; h < kH; ++h) part[u][h] = 0.0f;
    }
    for (uint32_t s0 = 0; s0 < k_slots; s0 += kKBatch) {
      Chunk<D> kraw[kU][kKBatch];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
#pragma unroll
        for (uint32_t b = 0; b < kKBatch; ++b) {
          const uint32_t c = cl + (s0 + b) * lanes;
          if (valid[u] && s0 + b < k_slots && c < ck) {
            LoadChunk<D>(krow[u], c, k_bytes, &kraw[u][b]);
          } else {
#pragma unroll
            for (uint32_t i = 0; i < Chunk<D>::kWords; ++i) kraw[u][b].w[i] = 0;
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
#pragma unroll
        for (uint32_t b = 0; b < kKBatch; ++b) {
          const uint32_t c = cl + (s0 + b) * lanes;
          if (!valid[u] || s0 + b >= k_slots || c >= ck) continue;
          float kf[kChunk];
#pragma unroll
          for (uint32_t e = 0; e < kChunk; ++e) {
            kf[e] = DecodeAt<D>(kraw[u][b], e, k_scale[u], k_zp[u]);
          }
#pragma unroll
          for (int h = 0; h < kH; ++h) {
            if (h < static_cast<int>(nh)) {
              const float* qh = sq + size_t(h) * dkp + c * kChunk;
#pragma unroll
              for (uint32_t e = 0; e < kChunk; ++e) part[u][h] += qh[e] * kf[e];
            }
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
#pragma unroll
      for (int h = 0; h < kH; ++h) {
        if (h < static_cast<int>(nh)) {
          for (uint32_t off = lanes / 2; off > 0; off >>= 1) {
            part[u][h] += __shfl_xor_sync(kFullMask, part[u][h], off);
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      if (!valid[u]) continue;
      float wt[kH];
#pragma unroll
      for (int h = 0; h < kH; ++h) {
        wt[h] = 0.0f;
        if (h < static_cast<int>(nh)) {
          const float sc = part[u][h] * p.sm_scale;
          if (sc > m[h]) {  // a new running max: rescale what is accumulated
            const float alpha = __expf(m[h] - sc);
            m[h] = sc;
            l[h] *= alpha;
#pragma unroll
            for (int i = 0; i < kAcc; ++i) acc[h][i] *= alpha;
          }
          wt[h] = __expf(sc - m[h]);
          l[h] += wt[h];
        }
      }
#pragma unroll
      for (int s = 0; s < kS; ++s) {
        Chunk<D> late;
        if constexpr (!kVFirst) LoadV(u, s, &late);
        const Chunk<D>& raw = kVFirst ? vraw[u * kS + s] : late;
        float vf[kChunk];
#pragma unroll
        for (uint32_t e = 0; e < kChunk; ++e) vf[e] = DecodeAt<D>(raw, e, v_scale[u], v_zp[u]);
#pragma unroll
        for (int h = 0; h < kH; ++h) {
#pragma unroll
          for (uint32_t e = 0; e < kChunk; ++e) acc[h][s * kChunk + e] += wt[h] * vf[e];
        }
      }
    }
  }

  // Merge the lane groups of each warp (lanes cl, cl + lanes, ... own the same chunks).
#pragma unroll
  for (int h = 0; h < kH; ++h) {
    if (h < static_cast<int>(nh)) {
      for (uint32_t off = lanes; off < 32; off <<= 1) {
        const float mo = __shfl_xor_sync(kFullMask, m[h], off);
        const float lo = __shfl_xor_sync(kFullMask, l[h], off);
        const float mx = fmaxf(m[h], mo);
        const float a = m[h] == -INFINITY ? 0.0f : __expf(m[h] - mx);
        const float b = mo == -INFINITY ? 0.0f : __expf(mo - mx);
        l[h] = l[h] * a + lo * b;
#pragma unroll
        for (int i = 0; i < kAcc; ++i) {
          const float ao = __shfl_xor_sync(kFullMask, acc[h][i], off);
          acc[h][i] = acc[h][i] * a + ao * b;
        }
        m[h] = mx;
      }
    }
  }
  // Then the warps, through shared memory.
  if (lane == 0) {
#pragma unroll
    for (int h = 0; h < kH; ++h) {
      sw_m[warp][h] = m[h];
      sw_l[warp][h] = l[h];
    }
  }
  __syncthreads();
  if (tid < nh) {
    float mx = -INFINITY;
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, sw_m[w][tid]);
    float sum = 0.0f;
    for (int w = 0; w < kWarps; ++w) {
      const float sc = sw_m[w][tid] == -INFINITY ? 0.0f : __expf(sw_m[w][tid] - mx);
      sw_scale[w][tid] = sc;
      sum += sw_l[w][tid] * sc;
    }
    s_m[tid] = mx;
    s_l[tid] = sum;
  }
  __syncthreads();
  for (int w = 0; w < kWarps; ++w) {
    if (static_cast<int>(warp) == w && lane < lanes) {
#pragma unroll
      for (int h = 0; h < kH; ++h) {
        if (h < static_cast<int>(nh)) {
          const float sc = sw_scale[w][h];
#pragma unroll
          for (int s = 0; s < kS; ++s) {
#pragma unroll
            for (uint32_t e = 0; e < kChunk; ++e) {
              const uint32_t c = (cl + s * lanes) * kChunk + e;
              if (c < dv) {
                float* dst = sacc + size_t(h) * dv + c;
                *dst = (w == 0 ? 0.0f : *dst) + acc[h][s * kChunk + e] * sc;
              }
            }
          }
        }
      }
    }
    __syncthreads();
  }

  if (plan.splits == 1) {  // the whole item: normalise here, no merge
    for (uint32_t x = tid; x < nh * dv; x += kThreads) {
      const uint32_t r = x / dv, c = x % dv;
      const float sum = s_l[r];
      p.out[(size_t{item} * p.num_q_heads + h0 + r) * dv + c] =
          s_m[r] == -INFINITY ? 0.0f : sacc[x] * (1.0f / sum);
    }
    if (tid < nh) {
      p.lse[size_t{item} * p.num_q_heads + h0 + tid] =
          s_m[tid] == -INFINITY ? -INFINITY : s_m[tid] + logf(s_l[tid]);
    }
    return;
  }
  for (uint32_t x = tid; x < nh * dv; x += kThreads) {
    const uint32_t r = x / dv, c = x % dv;
    const size_t slot = (size_t{item} * p.num_q_heads + h0 + r) * plan.splits + split;
    ws_acc[slot * dv + c] = s_m[r] == -INFINITY ? 0.0f : sacc[x];
  }
  if (tid < nh) {
    const size_t slot = (size_t{item} * p.num_q_heads + h0 + tid) * plan.splits + split;
    ws_m[slot] = s_m[tid];
    ws_l[slot] = s_l[tid];
  }
}

template <int kS, int kH>
__global__ void __launch_bounds__(kThreads)
    SplitKernel(DecodeAttentionParams p, Plan plan, float* ws_m, float* ws_l, float* ws_acc) {
  extern __shared__ float smem[];
  switch (p.kv.layers[blockIdx.z].dtype) {
    case DType::kFp32:
      return SplitBody<DType::kFp32, kS, kH>(p, plan, ws_m, ws_l, ws_acc, smem);
    case DType::kFp16:
      return SplitBody<DType::kFp16, kS, kH>(p, plan, ws_m, ws_l, ws_acc, smem);
    case DType::kBf16:
      return SplitBody<DType::kBf16, kS, kH>(p, plan, ws_m, ws_l, ws_acc, smem);
    case DType::kInt8:
      return SplitBody<DType::kInt8, kS, kH>(p, plan, ws_m, ws_l, ws_acc, smem);
    case DType::kFp8E4M3:
      return SplitBody<DType::kFp8E4M3, kS, kH>(p, plan, ws_m, ws_l, ws_acc, smem);
    case DType::kFp8E5M2:
      return SplitBody<DType::kFp8E5M2, kS, kH>(p, plan, ws_m, ws_l, ws_acc, smem);
  }
}

// One CUDA block per (q head blockIdx.x, item blockIdx.y): log-sum-exp merge of the splits.
__global__ void __launch_bounds__(kThreads)
    MergeKernel(DecodeAttentionParams p, Plan plan, const float* ws_m, const float* ws_l,
                const float* ws_acc) {
  const uint32_t h = blockIdx.x, item = blockIdx.y, dv = p.head_dim_v;
  const size_t row = size_t{item} * p.num_q_heads + h;
  const size_t s0 = row * plan.splits;
  float mx = -INFINITY;
  for (uint32_t s = 0; s < plan.splits; ++s) mx = fmaxf(mx, ws_m[s0 + s]);
  float* out = p.out + row * dv;
  if (mx == -INFINITY) {  // nothing attended
    for (uint32_t c = threadIdx.x; c < dv; c += kThreads) out[c] = 0.0f;
    if (threadIdx.x == 0) p.lse[row] = -INFINITY;
    return;
  }
  float sum = 0.0f;
  for (uint32_t s = 0; s < plan.splits; ++s) sum += __expf(ws_m[s0 + s] - mx) * ws_l[s0 + s];
  const float inv = 1.0f / sum;
  for (uint32_t c = threadIdx.x; c < dv; c += kThreads) {
    float o = 0.0f;
    for (uint32_t s = 0; s < plan.splits; ++s) {
      o += __expf(ws_m[s0 + s] - mx) * ws_acc[(s0 + s) * dv + c];
    }
    out[c] = o * inv;
  }
  if (threadIdx.x == 0) p.lse[row] = mx + logf(sum);
}

// One warp per token position (blockIdx.x * kWarps + warp) of item blockIdx.y: the sum over all
// q heads of exp(score - lse). Runs after the split kernel and MergeKernel (needs lse).
// NOTE: not reworked with the split kernel: one dependent dot per (token, q head), so a call with
// token_probs costs far more than one without.
template <DType D>
__device__ void ProbsBody(const DecodeAttentionParams& p, float* probs) {
  const uint32_t item = blockIdx.y, lane = threadIdx.x & 31u;
  const uint32_t t = blockIdx.x * kWarps + threadIdx.x / 32u;
  const uint32_t len = p.kv.lengths[item];
  if (t >= len) return;
  const AttendSpan span = MakeAttendSpan(len, p.window, p.sinks);
  if (!span.Attends(t)) {
    if (lane == 0) probs[t] = 0.0f;
    return;
  }
  const uint32_t group = p.Group(), dk = p.head_dim;
  float total = 0.0f;
  for (uint32_t g = 0; g < p.num_kv_heads; ++g) {
    const KvRow kr = p.kv.Row(item, 0, g, t);
    for (uint32_t h = g * group; h < (g + 1) * group; ++h) {
      const float* q = p.q + (size_t{item} * p.num_q_heads + h) * dk;
      float part = 0.0f;
      for (uint32_t c = lane; c < dk; c += 32) part += q[c] * DecodeKv<D>(kr, c);
      const float s = WarpSum(part) * p.sm_scale;
      total += __expf(s - p.lse[size_t{item} * p.num_q_heads + h]);
    }
  }
  if (lane == 0) probs[t] = total;
}

__global__ void __launch_bounds__(kThreads) ProbsKernel(DecodeAttentionParams p) {
  float* probs = p.token_probs[blockIdx.y];
  if (probs == nullptr) return;
  switch (p.kv.layers[blockIdx.y].dtype) {
    case DType::kFp32:
      return ProbsBody<DType::kFp32>(p, probs);
    case DType::kFp16:
      return ProbsBody<DType::kFp16>(p, probs);
    case DType::kBf16:
      return ProbsBody<DType::kBf16>(p, probs);
    case DType::kInt8:
      return ProbsBody<DType::kInt8>(p, probs);
    case DType::kFp8E4M3:
      return ProbsBody<DType::kFp8E4M3>(p, probs);
    case DType::kFp8E5M2:
      return ProbsBody<DType::kFp8E5M2>(p, probs);
  }
}

bool ScalarsValid(const DecodeAttentionParams& p) {
  return p.num_kv_heads > 0 && p.num_q_heads > 0 && p.num_q_heads % p.num_kv_heads == 0 &&
         p.head_dim > 0 && p.head_dim_v > 0 && p.head_dim_v <= p.head_dim && p.sm_scale > 0.0f &&
         p.kv.batch <= 65535 && p.num_q_heads <= 65535 && p.kv.pool != nullptr &&
         p.kv.layers != nullptr && p.kv.indptr != nullptr && p.kv.indices != nullptr &&
         p.kv.lengths != nullptr && p.q != nullptr && p.out != nullptr && p.lse != nullptr;
}

}  // namespace

size_t DecodeAttentionWorkspaceBytes(const DecodeAttentionParams& p, uint32_t max_length) {
  if (p.kv.batch == 0 || !ScalarsValid(p)) return 0;
  const Plan plan = MakePlan(p, max_length);
  return plan.heads == 0 ? 0 : WorkspaceFor(p, plan);
}

cudaError_t DecodeAttentionCuda(const DecodeAttentionParams& p, uint32_t max_length,
                                void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (p.kv.batch == 0) return cudaSuccess;
  if (!ScalarsValid(p)) return cudaErrorInvalidValue;
  const Plan plan = MakePlan(p, max_length);
  const uint64_t grid_y = uint64_t{p.num_kv_heads} * plan.q_tiles;
  if (plan.heads == 0 || grid_y > 65535 || workspace == nullptr ||
      workspace_bytes < WorkspaceFor(p, plan)) {
    return cudaErrorInvalidValue;
  }
  float* ws_m = static_cast<float*>(workspace);
  float* ws_l = ws_m + size_t{p.kv.batch} * p.num_q_heads * plan.splits;
  float* ws_acc = ws_l + size_t{p.kv.batch} * p.num_q_heads * plan.splits;
  const dim3 grid(plan.splits, static_cast<unsigned>(grid_y), p.kv.batch);
  if (plan.slots == 1 && plan.heads <= 2) {  // MHA, GQA 2: fewer registers, more blocks per SM
    SplitKernel<1, 2><<<grid, kThreads, plan.smem, stream>>>(p, plan, ws_m, ws_l, ws_acc);
  } else if (plan.slots == 1) {
    SplitKernel<1, HeadsFor(1)><<<grid, kThreads, plan.smem, stream>>>(p, plan, ws_m, ws_l, ws_acc);
  } else if (plan.slots == 2) {
    SplitKernel<2, HeadsFor(2)><<<grid, kThreads, plan.smem, stream>>>(p, plan, ws_m, ws_l, ws_acc);
  } else {
    SplitKernel<16, HeadsFor(16)>
        <<<grid, kThreads, plan.smem, stream>>>(p, plan, ws_m, ws_l, ws_acc);
  }
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  if (plan.splits > 1) {  // one split: the split kernel wrote out and lse
    MergeKernel<<<dim3(p.num_q_heads, p.kv.batch), kThreads, 0, stream>>>(p, plan, ws_m, ws_l,
                                                                          ws_acc);
    e = cudaGetLastError();
  }
  if (e != cudaSuccess || p.token_probs == nullptr || max_length == 0) return e;
  const uint64_t blocks = (uint64_t{max_length} + kWarps - 1) / kWarps;
  if (blocks > 0x7fffffffu) return cudaErrorInvalidValue;
  ProbsKernel<<<dim3(static_cast<unsigned>(blocks), p.kv.batch), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace kvbank::kernels
