// CUDA decode attention (flash-decoding; see attention_cuda.h). Rows are found through PagedKv and
// decoded with DecodeKv<D> (quant_math.h), the same view and math as the CPU paths.
#include <cstdint>

#include "kernels/attention_cuda.h"

namespace kvbank::kernels {

namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kTile = 32;           // attended tokens per iteration: 8 per warp
constexpr int kMaxHeads = 8;        // q heads per CUDA block (the registers of the K dot products)
constexpr int kMinSplit = 256;      // fewest attended tokens a split gets
constexpr int kTargetBlocks = 264;  // ~2 waves of an H100 / H200 (132 SMs)
constexpr size_t kSmemLimit = 46 * 1024;  // dynamic; the static arrays take the rest of 48 KiB
constexpr unsigned kFullMask = 0xffffffffu;

// How a batch is cut: q heads per block (`heads`), blocks per kv head (`q_tiles`) and splits of
// `split_tokens` attended tokens.
struct Plan {
  uint32_t heads = 0, q_tiles = 0, splits = 0, split_tokens = 0;
  size_t smem = 0;
};

size_t SmemBytes(uint32_t heads, uint32_t dk, uint32_t dv) {
  // q [heads][dk], scores [heads][kTile], acc [heads][dv], m / l / alpha [heads].
  return sizeof(float) * heads * (size_t{dk} + kTile + dv + 3);
}

Plan MakePlan(const DecodeAttentionParams& p, uint32_t max_length) {
  Plan plan;
  const uint32_t group = p.Group();
  plan.heads = group < kMaxHeads ? group : kMaxHeads;
  while (plan.heads > 0 && SmemBytes(plan.heads, p.head_dim, p.head_dim_v) > kSmemLimit) {
    --plan.heads;
  }
  if (plan.heads == 0) return plan;
  plan.smem = SmemBytes(plan.heads, p.head_dim, p.head_dim_v);
  plan.q_tiles = (group + plan.heads - 1) / plan.heads;
  const uint32_t n = MakeAttendSpan(max_length, p.window, p.sinks).Count();
  const uint64_t base = uint64_t{p.kv.batch} * p.num_kv_heads * plan.q_tiles;
  uint64_t splits = (kTargetBlocks + base - 1) / base;
  const uint64_t most = (uint64_t{n} + kMinSplit - 1) / kMinSplit;
  splits = splits < most ? splits : most;
  if (splits == 0) splits = 1;
  uint64_t per = (uint64_t{n} + splits - 1) / splits;
  per = (per + kTile - 1) / kTile * kTile;
  if (per == 0) per = kTile;
  plan.split_tokens = static_cast<uint32_t>(per);
  plan.splits = static_cast<uint32_t>((uint64_t{n} + per - 1) / per);
  if (plan.splits == 0) plan.splits = 1;
  return plan;
}

// Workspace: m, l [batch][num_q_heads][splits], then acc [batch][num_q_heads][splits][dv].
size_t WorkspaceFor(const DecodeAttentionParams& p, const Plan& plan) {
  return sizeof(float) * size_t{p.kv.batch} * p.num_q_heads * plan.splits * (2 + p.head_dim_v);
}

__device__ inline float WarpSum(float x) {
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(kFullMask, x, off);
  return x;
}

// One CUDA block: item blockIdx.z, kv head g and q-head tile from blockIdx.y, split blockIdx.x.
template <DType D>
__device__ void SplitBody(const DecodeAttentionParams& p, const Plan& plan, float* ws_m,
                          float* ws_l, float* ws_acc, float* smem) {
  const uint32_t item = blockIdx.z, split = blockIdx.x;
  const uint32_t g = blockIdx.y / plan.q_tiles, qt = blockIdx.y % plan.q_tiles;
  const uint32_t group = p.Group(), dk = p.head_dim, dv = p.head_dim_v;
  const uint32_t h0 = g * group + qt * plan.heads;
  const uint32_t nh = min(plan.heads, group - qt * plan.heads);
  const uint32_t tid = threadIdx.x, lane = tid & 31u, warp = tid / 32u;
  const bool has_v = p.kv.layers[item].has_v;

  float* sq = smem;                               // [heads][dk]
  float* ss = sq + size_t{plan.heads} * dk;       // [heads][kTile]
  float* sacc = ss + size_t{plan.heads} * kTile;  // [heads][dv]
  float* sm = sacc + size_t{plan.heads} * dv;     // [heads]
  float* sl = sm + plan.heads;                    // [heads]
  float* salpha = sl + plan.heads;                // [heads]
  __shared__ const uint8_t* v_data[kTile];
  __shared__ float v_scale[kTile];
  __shared__ uint8_t v_zp[kTile];

  const AttendSpan span = MakeAttendSpan(p.kv.lengths[item], p.window, p.sinks);
  const uint32_t n = span.Count();
  const uint32_t j0 = split * plan.split_tokens;
  const uint32_t j1 = min(n, j0 + plan.split_tokens);

  const float* q = p.q + (size_t{item} * p.num_q_heads + h0) * dk;
  for (uint32_t x = tid; x < nh * dk; x += kThreads) sq[x] = q[x];
  for (uint32_t x = tid; x < nh * dv; x += kThreads) sacc[x] = 0.0f;
  if (tid < nh) {
    sm[tid] = -INFINITY;
    sl[tid] = 0.0f;
  }
  __syncthreads();

  for (uint32_t jt = j0; jt < j1; jt += kTile) {
    const uint32_t valid = min(uint32_t(kTile), j1 - jt);
    // Scores: each warp takes every kWarps-th token of the tile; K decoded once for all heads.
    for (uint32_t tt = warp; tt < kTile; tt += kWarps) {
      if (tt >= valid) {
        if (lane < nh) ss[lane * kTile + tt] = -INFINITY;
        continue;
      }
      const uint32_t pos = span.Position(jt + tt);
      const KvRow kr = p.kv.Row(item, 0, g, pos);
      float part[kMaxHeads];
#pragma unroll
      for (int r = 0; r < kMaxHeads; ++r) part[r] = 0.0f;
      for (uint32_t c = lane; c < dk; c += 32) {
        const float kc = DecodeKv<D>(kr, c);
#pragma unroll
        for (int r = 0; r < kMaxHeads; ++r) {
          if (r < nh) part[r] += sq[r * dk + c] * kc;
        }
      }
#pragma unroll
      for (int r = 0; r < kMaxHeads; ++r) {
        if (r < nh) {
          const float dot = WarpSum(part[r]);
          if (lane == 0) ss[r * kTile + tt] = dot * p.sm_scale;
        }
      }
      if (lane == 0) {
        const KvRow vr = has_v ? p.kv.Row(item, 1, g, pos) : kr;
        v_data[tt] = vr.data;
        v_scale[tt] = vr.scale;
        v_zp[tt] = vr.zero_point;
      }
    }
    __syncthreads();
    // Online softmax: one thread per head turns the tile's scores into weights.
    if (tid < nh) {
      float* s = ss + tid * kTile;
      float mt = -INFINITY;
      for (uint32_t tt = 0; tt < valid; ++tt) mt = fmaxf(mt, s[tt]);
      const float m_new = fmaxf(sm[tid], mt);
      const float alpha = __expf(sm[tid] - m_new);
      float sum = 0.0f;
      for (uint32_t tt = 0; tt < valid; ++tt) {
        s[tt] = __expf(s[tt] - m_new);
        sum += s[tt];
      }
      sl[tid] = sl[tid] * alpha + sum;
      sm[tid] = m_new;
      salpha[tid] = alpha;
    }
    __syncthreads();
    // V: each thread owns dims tid, tid + kThreads, ... of every head's accumulator.
    for (uint32_t c = tid; c < dv; c += kThreads) {
      float a[kMaxHeads];
#pragma unroll
      for (int r = 0; r < kMaxHeads; ++r) a[r] = r < nh ? sacc[r * dv + c] * salpha[r] : 0.0f;
      for (uint32_t tt = 0; tt < valid; ++tt) {
        KvRow vr;
        vr.data = v_data[tt];
        vr.scale = v_scale[tt];
        vr.zero_point = v_zp[tt];
        const float vc = DecodeKv<D>(vr, c);
#pragma unroll
        for (int r = 0; r < kMaxHeads; ++r) {
          if (r < nh) a[r] += ss[r * kTile + tt] * vc;
        }
      }
#pragma unroll
      for (int r = 0; r < kMaxHeads; ++r) {
        if (r < nh) sacc[r * dv + c] = a[r];
      }
    }
    __syncthreads();
  }

  for (uint32_t r = 0; r < nh; ++r) {
    const size_t slot = (size_t{item} * p.num_q_heads + h0 + r) * plan.splits + split;
    if (tid == 0) {
      ws_m[slot] = sm[r];
      ws_l[slot] = sl[r];
    }
    for (uint32_t c = tid; c < dv; c += kThreads) ws_acc[slot * dv + c] = sacc[r * dv + c];
  }
}

__global__ void __launch_bounds__(kThreads)
    SplitKernel(DecodeAttentionParams p, Plan plan, float* ws_m, float* ws_l, float* ws_acc) {
  extern __shared__ float smem[];
  switch (p.kv.layers[blockIdx.z].dtype) {
    case DType::kFp32:
      return SplitBody<DType::kFp32>(p, plan, ws_m, ws_l, ws_acc, smem);
    case DType::kFp16:
      return SplitBody<DType::kFp16>(p, plan, ws_m, ws_l, ws_acc, smem);
    case DType::kBf16:
      return SplitBody<DType::kBf16>(p, plan, ws_m, ws_l, ws_acc, smem);
    case DType::kInt8:
      return SplitBody<DType::kInt8>(p, plan, ws_m, ws_l, ws_acc, smem);
    case DType::kFp8E4M3:
      return SplitBody<DType::kFp8E4M3>(p, plan, ws_m, ws_l, ws_acc, smem);
    case DType::kFp8E5M2:
      return SplitBody<DType::kFp8E5M2>(p, plan, ws_m, ws_l, ws_acc, smem);
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
// q heads of exp(score - lse). Runs after MergeKernel (needs lse).
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
  SplitKernel<<<dim3(plan.splits, static_cast<unsigned>(grid_y), p.kv.batch), kThreads, plan.smem,
                stream>>>(p, plan, ws_m, ws_l, ws_acc);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  MergeKernel<<<dim3(p.num_q_heads, p.kv.batch), kThreads, 0, stream>>>(p, plan, ws_m, ws_l,
                                                                        ws_acc);
  e = cudaGetLastError();
  if (e != cudaSuccess || p.token_probs == nullptr || max_length == 0) return e;
  const uint64_t blocks = (uint64_t{max_length} + kWarps - 1) / kWarps;
  if (blocks > 0x7fffffffu) return cudaErrorInvalidValue;
  ProbsKernel<<<dim3(static_cast<unsigned>(blocks), p.kv.batch), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace kvbank::kernels
