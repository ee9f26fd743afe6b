// Host emulation of the part of the CUDA runtime kvbank uses (emu2).
//
// Kernels: every CUDA thread is a fiber (own stack, hand-written x86-64 context switch); the
// blocks of a grid run one after another; __syncthreads, __syncwarp and the warp shuffles /
// votes are real barriers (a warp op completes when every live lane named in the mask has
// reached it). Divergent barriers deadlock and are reported; fibers run in an order set by
// EMU_ORDER (fwd, rev, rand) so that missing barriers show up as different results.
//
// Memory: cudaMalloc memory lives in its own mappings, followed by a guard page, and is
// PROT_NONE whenever no kernel / copy runs (host code touching device memory faults). Freed
// device memory stays PROT_NONE (use after free faults). Pointer arguments of kernels (and the
// pointer fields of PayloadMap / DecodeAttentionParams) are checked to be device or page-locked
// memory. Copies check their direction against the pointers. Launch configurations are checked
// like the driver does. Every finding prints "EMU:" on stderr and is counted; the count is
// printed at exit.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned x, y;
};

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorNoDevice = 100,
  cudaErrorInvalidDevice = 101,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorIllegalAddress = 700,
  cudaErrorLaunchFailure = 719,
};
struct EmuStream;
typedef EmuStream* cudaStream_t;
enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4
};
#define cudaHostAllocDefault 0x00
#define cudaHostAllocPortable 0x01
#define cudaHostAllocMapped 0x02
#define cudaStreamDefault 0x00
#define cudaStreamNonBlocking 0x01

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__
// The rewriter turns __shared__ declarations into emu calls; this is the fallback.
#define __shared__ static

// ---- runtime API ----------------------------------------------------------------------------
cudaError_t cudaMalloc(void** p, size_t n);
template <typename T>
cudaError_t cudaMalloc(T** p, size_t n) {
  return cudaMalloc(reinterpret_cast<void**>(p), n);
}
cudaError_t cudaFree(void* p);
cudaError_t cudaHostAlloc(void** p, size_t n, unsigned flags);
template <typename T>
cudaError_t cudaHostAlloc(T** p, size_t n, unsigned flags) {
  return cudaHostAlloc(reinterpret_cast<void**>(p), n, flags);
}
cudaError_t cudaMallocHost(void** p, size_t n);
cudaError_t cudaFreeHost(void* p);
cudaError_t cudaMemcpy(void* d, const void* s, size_t n, cudaMemcpyKind k);
cudaError_t cudaMemcpyAsync(void* d, const void* s, size_t n, cudaMemcpyKind k,
                            cudaStream_t stream = nullptr);
cudaError_t cudaMemset(void* d, int v, size_t n);
cudaError_t cudaMemsetAsync(void* d, int v, size_t n, cudaStream_t stream = nullptr);
cudaError_t cudaDeviceSynchronize();
cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
const char* cudaGetErrorName(cudaError_t e);
const char* cudaGetErrorString(cudaError_t e);
cudaError_t cudaGetDeviceCount(int* n);
cudaError_t cudaGetDevice(int* d);
cudaError_t cudaSetDevice(int d);
cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes);
cudaError_t cudaStreamCreate(cudaStream_t* s);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);

// ---- kernel execution -------------------------------------------------------------------------
namespace emu {

struct Cfg {
  dim3 grid, block;
  size_t smem;
  cudaStream_t stream;
  Cfg(dim3 g, dim3 b, size_t s = 0, cudaStream_t st = nullptr)
      : grid(g), block(b), smem(s), stream(st) {}
};

// Thread-state of the fiber that runs now.
struct ThreadState {
  dim3 tid;
  unsigned linear;
};
extern ThreadState* g_cur;
extern dim3 g_block_idx, g_block_dim, g_grid_dim;

void Diag(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
// Locks the emulator, opens device memory, validates `c` (false: the launch error is recorded
// and nothing runs). End() closes it again.
bool BeginLaunch(const Cfg& c, const char* name);
void RunGrid(const Cfg& c, const char* name, const std::function<void()>& body);
void EndLaunch();
// Whether [p, p + n) is device (or page-locked) memory; diagnoses otherwise.
void CheckDevicePtr(const void* p, const char* kernel, const char* what);
bool IsDevice(const void* p, size_t n);
bool IsPinned(const void* p, size_t n);

template <typename T>
void EmuCheckArg(const T&, const char*) {}
template <typename T>
void EmuCheckArg(T* const& p, const char* kernel) {
  CheckDevicePtr(p, kernel, "pointer argument");
}

template <typename K, typename... A>
void Launch(const char* name, Cfg c, K kernel, A... args) {
  if (!BeginLaunch(c, name)) return;
  (EmuCheckArg(args, name), ...);
  RunGrid(c, name, [&] { kernel(args...); });
  EndLaunch();
}

// Warp operations. kind: 0 shfl (idx), 1 shfl_xor, 2 shfl_down, 3 shfl_up, 4 syncwarp,
// 5 ballot, 6 any, 7 all.
uint64_t WarpOp(int kind, unsigned mask, uint64_t value, int param, int width, const char* site);
void SyncThreads(const char* site);
void* DynShared();
void PoisonShared(void* p, size_t n);

template <typename T>
T Shfl(int kind, unsigned mask, T v, int param, int width, const char* site) {
  static_assert(sizeof(T) <= 8, "shuffle of a wide type");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  const uint64_t r = WarpOp(kind, mask, bits, param, width, site);
  T out;
  std::memcpy(&out, &r, sizeof(T));
  return out;
}

template <typename T>
T ShflAt(const char* site, int kind, unsigned mask, T v, int param, int width = 32) {
  return Shfl(kind, mask, v, param, width, site);
}
inline void SyncWarpAt(const char* site, unsigned mask = 0xffffffffu) {
  WarpOp(4, mask, 0, 0, 32, site);
}

}  // namespace emu

#define threadIdx (::emu::g_cur->tid)
#define blockIdx (::emu::g_block_idx)
#define blockDim (::emu::g_block_dim)
#define gridDim (::emu::g_grid_dim)
#define warpSize 32

#define EMU_STR2(x) #x
#define EMU_STR(x) EMU_STR2(x)
#define EMU_SITE __FILE__ ":" EMU_STR(__LINE__)

#define __syncthreads() ::emu::SyncThreads(EMU_SITE)
#define __syncwarp(...) ::emu::SyncWarpAt(EMU_SITE __VA_OPT__(, ) __VA_ARGS__)
#define __shfl_sync(m, v, ...) ::emu::ShflAt(EMU_SITE, 0, m, v, __VA_ARGS__)
#define __shfl_xor_sync(m, v, ...) ::emu::ShflAt(EMU_SITE, 1, m, v, __VA_ARGS__)
#define __shfl_down_sync(m, v, ...) ::emu::ShflAt(EMU_SITE, 2, m, v, __VA_ARGS__)
#define __shfl_up_sync(m, v, ...) ::emu::ShflAt(EMU_SITE, 3, m, v, __VA_ARGS__)
#define __ballot_sync(m, p) static_cast<unsigned>(::emu::WarpOp(5, m, (p) ? 1 : 0, 0, 32, EMU_SITE))
#define __any_sync(m, p) static_cast<int>(::emu::WarpOp(6, m, (p) ? 1 : 0, 0, 32, EMU_SITE))
#define __all_sync(m, p) static_cast<int>(::emu::WarpOp(7, m, (p) ? 1 : 0, 0, 32, EMU_SITE))

// ---- device math ------------------------------------------------------------------------------
// __expf is ex2.approx(x * log2(e)): the rounding of the product is what makes it differ from
// expf (ex2.approx itself is within 2 ulp; exp2f stands in for it).
inline float __expf(float x) {
  volatile float y = x * 1.4426950408889634f;
  return exp2f(y);
}
inline float __logf(float x) { return logf(x); }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float __fsqrt_rn(float a) { return sqrtf(a); }
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline int __float_as_int(float f) {
  int u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float __int_as_float(int u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
inline unsigned long min(unsigned long a, unsigned long b) { return a < b ? a : b; }
inline unsigned long max(unsigned long a, unsigned long b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
template <typename T>
T __ldg(const T* p) {
  return *p;
}
