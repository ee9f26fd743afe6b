// The emulated CUDA runtime (see include/cuda_runtime.h).
#include <execinfo.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "cuda_runtime.h"

extern "C" void emu_switch(void** save_sp, void* new_sp);
asm(R"(
.text
.globl emu_switch
.type emu_switch,@function
emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size emu_switch,.-emu_switch
)");

struct EmuStream {
  unsigned flags;
};

namespace emu {

ThreadState* g_cur = nullptr;
dim3 g_block_idx, g_block_dim, g_grid_dim;

namespace {

constexpr uint64_t kTotalDeviceBytes = uint64_t{16} << 30;
const size_t kPage = static_cast<size_t>(sysconf(_SC_PAGESIZE));

std::recursive_mutex g_mu;
std::atomic<uint64_t> g_diags{0};
std::atomic<uint64_t> g_launches{0};
std::atomic<uint64_t> g_notes{0};

struct Alloc {
  uint8_t* map = nullptr;
  size_t map_len = 0;
  uint8_t* ptr = nullptr;
  size_t size = 0;    // requested
  size_t usable = 0;  // up to the guard page
  bool live = true;
  bool pinned = false;
};
std::map<uintptr_t, Alloc> g_allocs;  // by ptr; device and pinned
uint64_t g_device_live = 0;
int g_access_depth = 0;
bool g_protect = true;
std::set<EmuStream*> g_streams;
thread_local cudaError_t t_last_error = cudaSuccess;
thread_local int t_device = 0;
thread_local bool t_altstack = false;

const char* g_kernel = nullptr;
int g_order = 0;  // 0 fwd, 1 rev, 2 rand
std::mt19937 g_rng(12345);

size_t RoundUp(size_t x, size_t a) { return (x + a - 1) / a * a; }

void InitOnce();

Alloc* Find(const void* p, bool include_dead = false) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  auto it = g_allocs.upper_bound(a);
  if (it == g_allocs.begin()) return nullptr;
  --it;
  Alloc& al = it->second;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(al.map);
  if (a < begin || a >= begin + al.map_len) return nullptr;
  if (!al.live && !include_dead) return nullptr;
  return &al;
}

void SetAccess(bool on) {
  if (!g_protect) return;
  if (on) {
    if (g_access_depth++ > 0) return;
  } else {
    if (--g_access_depth > 0) return;
  }
  for (auto& [k, a] : g_allocs) {
    if (!a.live || a.pinned) continue;
    mprotect(a.map, a.map_len - kPage, on ? PROT_READ | PROT_WRITE : PROT_NONE);
  }
}

struct Access {
  Access() { SetAccess(true); }
  ~Access() { SetAccess(false); }
};

void Describe(const void* p, char* buf, size_t n) {
  Alloc* a = Find(p, true);
  if (a == nullptr) {
    snprintf(buf, n, "%p (not emulator memory)", p);
    return;
  }
  const intptr_t off = static_cast<const uint8_t*>(p) - a->ptr;
  snprintf(buf, n, "%p (%s %s allocation %p of %zu bytes, offset %ld%s)", p,
           a->live ? "live" : "FREED", a->pinned ? "pinned" : "device", static_cast<void*>(a->ptr),
           a->size, static_cast<long>(off),
           off >= static_cast<intptr_t>(a->usable) ? ", GUARD PAGE" : "");
}

// ---- fibers -----------------------------------------------------------------------------------
enum State { kReady, kBlockWait, kWarpWait, kDone };
struct Fiber {
  void* sp = nullptr;
  uint8_t* stack = nullptr;  // usable part
  size_t stack_size = 0;
  ThreadState ts;
  State state = kReady;
  const char* site = nullptr;
  int kind = 0;
  unsigned mask = 0;
  uint64_t value = 0;
  int param = 0;
  int width = 32;
  uint64_t result = 0;
};
constexpr size_t kStack = 256 * 1024;
std::vector<Fiber> g_fibers;
void* g_sched_sp = nullptr;
Fiber* g_cur_fiber = nullptr;
const std::function<void()>* g_body = nullptr;
uint64_t g_block_epoch = 0;
std::unordered_map<void*, uint64_t> g_poisoned;
uint8_t* g_dyn = nullptr;  // dynamic shared memory of the launch
uint8_t* g_dyn_map = nullptr;
size_t g_dyn_map_len = 0;
size_t g_dyn_bytes = 0;
std::set<std::string> g_noted;

void Note(const std::string& key, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
void Note(const std::string& key, const char* fmt, ...) {
  if (!g_noted.insert(key).second) return;
  ++g_notes;
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "EMU note: ");
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
}

[[noreturn]] void FiberMain() {
  (*g_body)();
  g_cur_fiber->state = kDone;
  emu_switch(&g_cur_fiber->sp, g_sched_sp);
  __builtin_unreachable();
}

void EnsureFibers(unsigned n) {
  while (g_fibers.size() < n) {
    Fiber f;
    const size_t len = kStack + kPage;
    void* m = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) abort();
    mprotect(m, kPage, PROT_NONE);  // guard below the stack
    f.stack = static_cast<uint8_t*>(m) + kPage;
    f.stack_size = kStack;
    g_fibers.push_back(f);
  }
}

void StartFiber(Fiber& f) {
  uintptr_t top = reinterpret_cast<uintptr_t>(f.stack + f.stack_size) & ~uintptr_t{15};
  void** s = reinterpret_cast<void**>(top);
  *--s = nullptr;                              // fake return address of FiberMain
  *--s = reinterpret_cast<void*>(&FiberMain);  // emu_switch's ret goes here
  for (int i = 0; i < 6; ++i) *--s = nullptr;  // rbp rbx r12 r13 r14 r15
  f.sp = s;
  f.state = kReady;
}

Fiber& Cur(const char* what) {
  if (g_cur_fiber == nullptr) {
    fprintf(stderr, "EMU: %s outside a kernel\n", what);
    abort();
  }
  return *g_cur_fiber;
}

void Block(Fiber& f) { emu_switch(&f.sp, g_sched_sp); }

const char* KindName(int k) {
  static const char* n[] = {"shfl",     "shfl_xor", "shfl_down", "shfl_up",
                            "syncwarp", "ballot",   "any",       "all"};
  return n[k];
}

// Completes whatever barriers can complete. Returns whether any fiber became ready.
bool TryRelease(unsigned nt) {
  bool released = false;
  unsigned live = 0, bwait = 0, done = 0;
  for (unsigned t = 0; t < nt; ++t) {
    const State s = g_fibers[t].state;
    if (s == kDone)
      ++done;
    else
      ++live;
    if (s == kBlockWait) ++bwait;
  }
  if (live > 0 && bwait == live) {
    const char* site0 = nullptr;
    for (unsigned t = 0; t < nt; ++t) {
      Fiber& f = g_fibers[t];
      if (f.state != kBlockWait) continue;
      if (site0 == nullptr) site0 = f.site;
      if (f.site != site0 && strcmp(f.site, site0) != 0) {
        Note(std::string(g_kernel) + "bar" + site0 + f.site,
             "%s: __syncthreads at different sites in one barrier: %s and %s", g_kernel, site0,
             f.site);
      }
      f.state = kReady;
    }
    if (done > 0) {
      Note(std::string(g_kernel) + "exitedbar",
           "%s: __syncthreads at %s completed with %u exited threads (counts as arrived on sm_70+)",
           g_kernel, site0, done);
    }
    return true;
  }
  for (unsigned w = 0; w * 32 < nt; ++w) {
    const unsigned l0 = w * 32, l1 = std::min(nt, l0 + 32);
    // Groups of lanes waiting at a warp op, by the first waiting lane's mask.
    for (unsigned first = l0; first < l1; ++first) {
      Fiber& f0 = g_fibers[first];
      if (f0.state != kWarpWait) continue;
      const unsigned mask = f0.mask;
      if (!(mask & (1u << (first - l0)))) {
        ++g_diags;
        fprintf(stderr, "EMU: %s: %s at %s by lane %u with a mask (%#x) that leaves it out\n",
                g_kernel, KindName(f0.kind), f0.site, first - l0, mask);
      }
      bool ready = true;
      for (unsigned t = l0; t < l1 && ready; ++t) {
        if (!(mask & (1u << (t - l0)))) continue;
        const Fiber& f = g_fibers[t];
        if (f.state == kDone) {
          ++g_diags;
          fprintf(stderr,
                  "EMU: %s block (%u,%u,%u): %s at %s: mask %#x names lane %u, which has exited\n",
                  g_kernel, g_block_idx.x, g_block_idx.y, g_block_idx.z, KindName(f0.kind), f0.site,
                  mask, t - l0);
          continue;
        }
        if (f.state != kWarpWait) ready = false;
      }
      if (!ready) continue;
      // Everyone named is at a warp op: complete it.
      uint64_t vote = 0;
      for (unsigned t = l0; t < l1; ++t) {
        Fiber& f = g_fibers[t];
        if (!(mask & (1u << (t - l0))) || f.state != kWarpWait) continue;
        if (f.kind != f0.kind || f.mask != mask) {
          ++g_diags;
          fprintf(stderr, "EMU: %s: lanes of one warp meet at %s (%s, mask %#x) and %s (%s, %#x)\n",
                  g_kernel, f0.site, KindName(f0.kind), mask, f.site, KindName(f.kind), f.mask);
        } else if (f.site != f0.site && strcmp(f.site, f0.site) != 0 && f0.kind != 4) {
          Note(std::string(g_kernel) + f0.site + f.site,
               "%s: lanes of one warp meet at different %s sites %s and %s", g_kernel,
               KindName(f0.kind), f0.site, f.site);
        }
        if (f.value & 1) vote |= uint64_t{1} << (t - l0);
      }
      for (unsigned t = l0; t < l1; ++t) {
        Fiber& f = g_fibers[t];
        if (!(mask & (1u << (t - l0))) || f.state != kWarpWait) continue;
        const unsigned lane = t - l0;
        const unsigned width = static_cast<unsigned>(f.width);
        const unsigned seg = lane & ~(width - 1);
        unsigned src = lane;
        switch (f.kind) {
          case 0:
            src = seg + (static_cast<unsigned>(f.param) & (width - 1));
            break;
          case 1:
            src = lane ^ static_cast<unsigned>(f.param);
            if ((src & ~(width - 1)) != seg) src = lane;
            break;
          case 2:
            src = lane + static_cast<unsigned>(f.param);
            if (src >= seg + width) src = lane;
            break;
          case 3:
            src = static_cast<int>(lane) - f.param >= static_cast<int>(seg) ? lane - f.param : lane;
            break;
          default:
            break;
        }
        if (f.kind <= 3) {
          const unsigned st = l0 + src;
          if (st >= l1 || !(mask & (1u << src)) || g_fibers[st].state != kWarpWait) {
            ++g_diags;
            fprintf(stderr, "EMU: %s: %s at %s: lane %u reads lane %u, which is not in it\n",
                    g_kernel, KindName(f.kind), f.site, lane, src);
            f.result = 0;
          } else {
            f.result = g_fibers[st].value;
          }
        } else if (f.kind == 5) {
          f.result = vote & mask;
        } else if (f.kind == 6) {
          f.result = (vote & mask) != 0;
        } else if (f.kind == 7) {
          uint64_t live_mask = 0;
          for (unsigned u = l0; u < l1; ++u) {
            if ((mask & (1u << (u - l0))) && g_fibers[u].state == kWarpWait) {
              live_mask |= uint64_t{1} << (u - l0);
            }
          }
          f.result = (vote & live_mask) == live_mask;
        }
      }
      for (unsigned t = l0; t < l1; ++t) {
        Fiber& f = g_fibers[t];
        if ((mask & (1u << (t - l0))) && f.state == kWarpWait) f.state = kReady;
      }
      released = true;
    }
  }
  return released;
}

void DumpDeadlock(unsigned nt) {
  ++g_diags;
  fprintf(stderr, "EMU: DEADLOCK in %s block (%u,%u,%u):\n", g_kernel, g_block_idx.x, g_block_idx.y,
          g_block_idx.z);
  for (unsigned t = 0; t < nt; ++t) {
    const Fiber& f = g_fibers[t];
    const char* s = f.state == kDone        ? "exited"
                    : f.state == kBlockWait ? "__syncthreads"
                                            : "warp op";
    fprintf(stderr, "  thread %u: %s %s%s%s\n", t, s, f.site ? f.site : "",
            f.state == kWarpWait ? " " : "", f.state == kWarpWait ? KindName(f.kind) : "");
  }
  abort();
}

void SegvHandler(int sig, siginfo_t* si, void*) {
  char where[256];
  Describe(si->si_addr, where, sizeof where);
  char buf[1024];
  int n;
  if (g_kernel != nullptr && g_cur_fiber != nullptr) {
    n = snprintf(buf, sizeof buf,
                 "EMU: FAULT in kernel %s block (%u,%u,%u) thread (%u,%u,%u): address %s\n",
                 g_kernel, g_block_idx.x, g_block_idx.y, g_block_idx.z, g_cur_fiber->ts.tid.x,
                 g_cur_fiber->ts.tid.y, g_cur_fiber->ts.tid.z, where);
  } else {
    n = snprintf(buf, sizeof buf, "EMU: FAULT on the host (signal %d): address %s\n", sig, where);
  }
  if (write(2, buf, n) < 0) {
  }
  void* frames[64];
  const int k = backtrace(frames, 64);
  backtrace_symbols_fd(frames, k, 2);
  _exit(86);
}

void EnsureAltStack() {
  if (t_altstack) return;
  t_altstack = true;
  stack_t ss;
  ss.ss_size = 1 << 16;
  ss.ss_sp = malloc(ss.ss_size);
  ss.ss_flags = 0;
  sigaltstack(&ss, nullptr);
}

void InitOnce() {
  static bool done = false;
  if (done) return;
  done = true;
  if (const char* p = getenv("EMU_PROTECT")) g_protect = atoi(p) != 0;
  if (const char* o = getenv("EMU_ORDER")) {
    if (strcmp(o, "rev") == 0) g_order = 1;
    if (strcmp(o, "rand") == 0) g_order = 2;
  }
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = SegvHandler;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigaction(SIGSEGV, &sa, nullptr);
  sigaction(SIGBUS, &sa, nullptr);
  atexit([] {
    fprintf(stderr, "EMU summary: %llu launches, %llu diagnostics, %llu notes (order %s)\n",
            static_cast<unsigned long long>(g_launches.load()),
            static_cast<unsigned long long>(g_diags.load()),
            static_cast<unsigned long long>(g_notes.load()),
            g_order == 0   ? "fwd"
            : g_order == 1 ? "rev"
                           : "rand");
  });
}

struct Init {
  Init() {
    std::lock_guard<std::recursive_mutex> l(g_mu);
    InitOnce();
  }
} g_init;

cudaError_t SetError(cudaError_t e) {
  if (e != cudaSuccess) t_last_error = e;
  return e;
}

bool StreamOk(cudaStream_t s, const char* what) {
  if (s == nullptr || g_streams.count(s)) return true;
  ++g_diags;
  fprintf(stderr, "EMU: %s on a stream that does not exist (%p)\n", what, static_cast<void*>(s));
  return false;
}

}  // namespace

void Diag(const char* fmt, ...) {
  ++g_diags;
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "EMU: ");
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
}

bool IsDevice(const void* p, size_t n) {
  std::lock_guard<std::recursive_mutex> l(g_mu);
  Alloc* a = Find(p);
  if (a == nullptr || a->pinned) return false;
  const uint8_t* b = static_cast<const uint8_t*>(p);
  return b >= a->ptr && b + n <= a->ptr + a->usable;
}

bool IsPinned(const void* p, size_t n) {
  std::lock_guard<std::recursive_mutex> l(g_mu);
  Alloc* a = Find(p);
  if (a == nullptr || !a->pinned) return false;
  const uint8_t* b = static_cast<const uint8_t*>(p);
  return b >= a->ptr && b + n <= a->ptr + a->usable;
}

void CheckDevicePtr(const void* p, const char* kernel, const char* what) {
  if (p == nullptr || IsDevice(p, 1) || IsPinned(p, 1)) return;
  char where[256];
  Describe(p, where, sizeof where);
  Diag("kernel %s: %s %s is not device memory", kernel, what, where);
}

bool BeginLaunch(const Cfg& c, const char* name) {
  g_mu.lock();
  InitOnce();
  EnsureAltStack();
  ++g_launches;
  const unsigned long long nt = 1ull * c.block.x * c.block.y * c.block.z;
  cudaError_t e = cudaSuccess;
  if (nt == 0 || nt > 1024 || c.block.z > 64) e = cudaErrorInvalidConfiguration;
  if (c.grid.x == 0 || c.grid.y == 0 || c.grid.z == 0 || c.grid.y > 65535 || c.grid.z > 65535 ||
      c.grid.x > 0x7fffffffu) {
    e = cudaErrorInvalidConfiguration;
  }
  if (c.smem > 48 * 1024) e = cudaErrorInvalidValue;  // more needs cudaFuncSetAttribute
  if (e == cudaSuccess && !StreamOk(c.stream, name)) e = cudaErrorInvalidResourceHandle;
  if (e != cudaSuccess) {
    fprintf(stderr, "EMU launch error: %s grid (%u,%u,%u) block (%u,%u,%u) smem %zu: %s\n", name,
            c.grid.x, c.grid.y, c.grid.z, c.block.x, c.block.y, c.block.z, c.smem,
            cudaGetErrorName(e));
    SetError(e);
    g_mu.unlock();
    return false;
  }
  SetAccess(true);
  g_kernel = name;
  return true;
}

void EndLaunch() {
  g_kernel = nullptr;
  SetAccess(false);
  g_mu.unlock();
}

void RunGrid(const Cfg& c, const char* name, const std::function<void()>& body) {
  const unsigned nt = c.block.x * c.block.y * c.block.z;
  EnsureFibers(nt);
  // Dynamic shared memory: ends at a guard page.
  const size_t dyn = RoundUp(c.smem, 16);
  const size_t need = RoundUp(dyn, kPage) + kPage;
  if (need > g_dyn_map_len) {
    if (g_dyn_map) munmap(g_dyn_map, g_dyn_map_len);
    g_dyn_map = static_cast<uint8_t*>(
        mmap(nullptr, need, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    g_dyn_map_len = need;
    mprotect(g_dyn_map + need - kPage, kPage, PROT_NONE);
  }
  g_dyn = g_dyn_map + g_dyn_map_len - kPage - dyn;
  g_dyn_bytes = dyn;
  g_body = &body;
  g_grid_dim = c.grid;
  g_block_dim = c.block;
  std::vector<unsigned> order(nt);
  for (unsigned t = 0; t < nt; ++t) order[t] = g_order == 1 ? nt - 1 - t : t;
  // Blocks in grid order, reversed (rev) or shuffled (rand): results must not depend on it.
  const uint64_t nb = uint64_t{c.grid.x} * c.grid.y * c.grid.z;
  std::vector<uint64_t> blocks(nb);
  for (uint64_t b = 0; b < nb; ++b) blocks[b] = g_order == 1 ? nb - 1 - b : b;
  if (g_order == 2) std::shuffle(blocks.begin(), blocks.end(), g_rng);
  for (uint64_t bi : blocks) {
    {
      {
        const unsigned bx = static_cast<unsigned>(bi % c.grid.x);
        const unsigned by = static_cast<unsigned>(bi / c.grid.x % c.grid.y);
        const unsigned bz = static_cast<unsigned>(bi / c.grid.x / c.grid.y);
        g_block_idx = dim3(bx, by, bz);
        ++g_block_epoch;
        memset(g_dyn, 0xff, dyn);
        if (g_order == 2) std::shuffle(order.begin(), order.end(), g_rng);
        for (unsigned t = 0; t < nt; ++t) {
          Fiber& f = g_fibers[t];
          f.ts.tid = dim3(t % c.block.x, (t / c.block.x) % c.block.y, t / (c.block.x * c.block.y));
          f.ts.linear = t;
          f.site = nullptr;
          StartFiber(f);
        }
        for (;;) {
          for (unsigned i = 0; i < nt; ++i) {
            Fiber& f = g_fibers[order[i]];
            if (f.state != kReady) continue;
            g_cur_fiber = &f;
            g_cur = &f.ts;
            emu_switch(&g_sched_sp, f.sp);
          }
          g_cur_fiber = nullptr;
          g_cur = nullptr;
          bool all_done = true;
          for (unsigned t = 0; t < nt; ++t) all_done &= g_fibers[t].state == kDone;
          if (all_done) break;
          if (!TryRelease(nt)) DumpDeadlock(nt);
        }
      }
    }
  }
  (void)name;
}

uint64_t WarpOp(int kind, unsigned mask, uint64_t value, int param, int width, const char* site) {
  Fiber& f = Cur("a warp op");
  if (width <= 0 || width > 32 || (width & (width - 1)) != 0) {
    Diag("%s: %s at %s with width %d", g_kernel, KindName(kind), site, width);
    width = 32;
  }
  f.state = kWarpWait;
  f.kind = kind;
  f.mask = mask;
  f.value = value;
  f.param = param;
  f.width = width;
  f.site = site;
  Block(f);
  return f.result;
}

void SyncThreads(const char* site) {
  Fiber& f = Cur("__syncthreads");
  f.state = kBlockWait;
  f.site = site;
  Block(f);
}

void* DynShared() {
  Cur("extern __shared__");
  return g_dyn;
}

void PoisonShared(void* p, size_t n) {
  uint64_t& e = g_poisoned[p];
  if (e == g_block_epoch) return;
  e = g_block_epoch;
  memset(p, 0xff, n);
}

}  // namespace emu

using namespace emu;  // NOLINT

// ---- runtime API ----------------------------------------------------------------------------

namespace {
cudaError_t AllocImpl(void** p, size_t n, bool pinned) {
  std::lock_guard<std::recursive_mutex> l(g_mu);
  InitOnce();
  if (p == nullptr) return SetError(cudaErrorInvalidValue);
  *p = nullptr;
  if (n == 0) {
    // cudaMalloc(0) returns success and nullptr.
    return cudaSuccess;
  }
  if (!pinned && g_device_live + n > kTotalDeviceBytes) return SetError(cudaErrorMemoryAllocation);
  const size_t un = RoundUp(n, 256);
  const size_t body = RoundUp(un, kPage);
  const size_t len = body + kPage;
  void* m = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
  if (m == MAP_FAILED) return SetError(cudaErrorMemoryAllocation);
  uint8_t* base = static_cast<uint8_t*>(m);
  mprotect(base + body, kPage, PROT_NONE);
  Alloc a;
  a.map = base;
  a.map_len = len;
  a.ptr = base + body - un;
  a.size = n;
  a.usable = un;
  a.pinned = pinned;
  // Fresh device memory is not zero on a real device in general: fill it with a pattern.
  memset(a.ptr, pinned ? 0xab : 0xcd, un);
  if (!pinned) {
    g_device_live += n;
    if (g_protect && g_access_depth == 0) mprotect(base, body, PROT_NONE);
  }
  g_allocs[reinterpret_cast<uintptr_t>(a.ptr)] = a;
  *p = a.ptr;
  return cudaSuccess;
}

cudaError_t FreeImpl(void* p, bool pinned, const char* what) {
  std::lock_guard<std::recursive_mutex> l(g_mu);
  if (p == nullptr) return cudaSuccess;
  auto it = g_allocs.find(reinterpret_cast<uintptr_t>(p));
  if (it == g_allocs.end() || !it->second.live || it->second.pinned != pinned) {
    char where[256];
    emu::Diag("%s of %p, which is not a live %s allocation", what, p,
              pinned ? "page-locked" : "device");
    (void)where;
    return SetError(cudaErrorInvalidValue);
  }
  Alloc& a = it->second;
  a.live = false;
  if (!pinned) g_device_live -= a.size;
  mprotect(a.map, a.map_len, PROT_NONE);
  madvise(a.map, a.map_len, MADV_DONTNEED);
  return cudaSuccess;
}

// Checks [p, p + n) for a copy side that must be (device) or must not be (host) device memory.
bool CheckSide(const void* p, size_t n, bool device, const char* api, const char* side) {
  Alloc* a = Find(p, true);
  const bool in_device = a != nullptr && !a->pinned;
  if (device) {
    if (!in_device || !a->live) {
      char w[256];
      Describe(p, w, sizeof w);
      emu::Diag("%s: %s %s is not live device memory", api, side, w);
      return false;
    }
    const uint8_t* b = static_cast<const uint8_t*>(p);
    if (b < a->ptr || b + n > a->ptr + a->size) {
      emu::Diag("%s: %s [%p, +%zu) overruns its device allocation %p of %zu bytes", api, side, p, n,
                static_cast<void*>(a->ptr), a->size);
      return false;
    }
    return true;
  }
  if (in_device) {
    char w[256];
    Describe(p, w, sizeof w);
    emu::Diag("%s: %s %s is device memory, the kind says host", api, side, w);
    return false;
  }
  if (a != nullptr && a->pinned) {
    const uint8_t* b = static_cast<const uint8_t*>(p);
    if (!a->live || b + n > a->ptr + a->size) {
      emu::Diag("%s: %s [%p, +%zu) overruns (or is freed) page-locked allocation of %zu bytes", api,
                side, p, n, a->size);
      return false;
    }
  }
  return true;
}

cudaError_t CopyImpl(void* d, const void* s, size_t n, cudaMemcpyKind k, const char* api) {
  std::lock_guard<std::recursive_mutex> l(g_mu);
  if (n == 0) return cudaSuccess;
  if (k == cudaMemcpyDefault) {
    const bool dd = Find(d) && !Find(d)->pinned, sd = Find(s) && !Find(s)->pinned;
    k = dd ? (sd ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice)
           : (sd ? cudaMemcpyDeviceToHost : cudaMemcpyHostToHost);
  }
  const bool d_dev = k == cudaMemcpyHostToDevice || k == cudaMemcpyDeviceToDevice;
  const bool s_dev = k == cudaMemcpyDeviceToHost || k == cudaMemcpyDeviceToDevice;
  if (!CheckSide(d, n, d_dev, api, "destination") || !CheckSide(s, n, s_dev, api, "source")) {
    return SetError(cudaErrorInvalidValue);
  }
  Access acc;
  memmove(d, s, n);
  return cudaSuccess;
}
}  // namespace

cudaError_t cudaMalloc(void** p, size_t n) { return AllocImpl(p, n, false); }
cudaError_t cudaFree(void* p) { return FreeImpl(p, false, "cudaFree"); }
cudaError_t cudaHostAlloc(void** p, size_t n, unsigned) { return AllocImpl(p, n, true); }
cudaError_t cudaMallocHost(void** p, size_t n) { return AllocImpl(p, n, true); }
cudaError_t cudaFreeHost(void* p) { return FreeImpl(p, true, "cudaFreeHost"); }

cudaError_t cudaMemcpy(void* d, const void* s, size_t n, cudaMemcpyKind k) {
  return CopyImpl(d, s, n, k, "cudaMemcpy");
}
cudaError_t cudaMemcpyAsync(void* d, const void* s, size_t n, cudaMemcpyKind k,
                            cudaStream_t stream) {
  std::lock_guard<std::recursive_mutex> l(g_mu);
  if (!StreamOk(stream, "cudaMemcpyAsync")) return SetError(cudaErrorInvalidResourceHandle);
  return CopyImpl(d, s, n, k, "cudaMemcpyAsync");
}
cudaError_t cudaMemset(void* d, int v, size_t n) {
  std::lock_guard<std::recursive_mutex> l(g_mu);
  if (n == 0) return cudaSuccess;
  if (!CheckSide(d, n, true, "cudaMemset", "destination")) return SetError(cudaErrorInvalidValue);
  Access acc;
  memset(d, v, n);
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* d, int v, size_t n, cudaStream_t stream) {
  std::lock_guard<std::recursive_mutex> l(g_mu);
  if (!StreamOk(stream, "cudaMemsetAsync")) return SetError(cudaErrorInvalidResourceHandle);
  return cudaMemset(d, v, n);
}
cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
cudaError_t cudaGetLastError() {
  const cudaError_t e = t_last_error;
  t_last_error = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError() { return t_last_error; }
const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
      return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration:
      return "cudaErrorInvalidConfiguration";
    case cudaErrorNoDevice:
      return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice:
      return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle:
      return "cudaErrorInvalidResourceHandle";
    case cudaErrorIllegalAddress:
      return "cudaErrorIllegalAddress";
    case cudaErrorLaunchFailure:
      return "cudaErrorLaunchFailure";
  }
  return "cudaErrorUnknown";
}
const char* cudaGetErrorString(cudaError_t e) {
  return e == cudaSuccess ? "no error" : cudaGetErrorName(e);
}
cudaError_t cudaGetDeviceCount(int* n) {
  if (const char* v = getenv("EMU_DEVICES")) {
    *n = atoi(v);
    return *n == 0 ? cudaErrorNoDevice : cudaSuccess;
  }
  *n = 1;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* d) {
  *d = t_device;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int d) {
  if (d != 0) return SetError(cudaErrorInvalidDevice);
  t_device = d;
  return cudaSuccess;
}
cudaError_t cudaMemGetInfo(size_t* f, size_t* t) {
  std::lock_guard<std::recursive_mutex> l(g_mu);
  *t = kTotalDeviceBytes;
  *f = kTotalDeviceBytes - g_device_live;
  return cudaSuccess;
}
cudaError_t cudaStreamCreate(cudaStream_t* s) { return cudaStreamCreateWithFlags(s, 0); }
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned flags) {
  std::lock_guard<std::recursive_mutex> l(g_mu);
  *s = new EmuStream{flags};
  g_streams.insert(*s);
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t s) {
  std::lock_guard<std::recursive_mutex> l(g_mu);
  if (s == nullptr || !g_streams.erase(s)) {
    emu::Diag("cudaStreamDestroy of %p, not a live stream", static_cast<void*>(s));
    return SetError(cudaErrorInvalidResourceHandle);
  }
  delete s;
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  std::lock_guard<std::recursive_mutex> l(g_mu);
  if (!StreamOk(s, "cudaStreamSynchronize")) return SetError(cudaErrorInvalidResourceHandle);
  return cudaSuccess;
}
