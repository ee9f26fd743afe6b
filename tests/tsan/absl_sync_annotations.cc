// ThreadSanitizer annotations for Abseil's synchronization, which the tsan preset links into
// every executable (KVBANK_TSAN_ABSL_ANNOTATIONS).
//
// Why: Debian's libabsl_synchronization.so is built without -fsanitize=thread, and absl::Mutex
// is built on its own atomics and futexes, not on pthread mutexes, so TSan sees no
// happens-before edge through it and reports every access under a Mutex as a race. An
// Abseil built with TSan annotates itself (ABSL_TSAN_MUTEX_* in mutex.cc); this file does the
// same from outside: it defines the entry points of absl::Mutex, absl::CondVar and
// absl::Notification in the executable (which the dynamic linker then binds every caller to,
// gRPC's included: the preset links with -rdynamic), tells TSan what each does with the
// __tsan_mutex_* interface, and calls the library's own definition (dlsym RTLD_NEXT).
// Nothing here changes what the calls do.
#include <dlfcn.h>
#include <sanitizer/tsan_interface.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"

namespace {

#define KVBANK_STR2(x) #x
#define KVBANK_STR(x) KVBANK_STR2(x)

// The library's definition of `mangled`, where '@' stands for Abseil's inline namespace
// (e.g. 7debian3).
void* Real(const char* mangled) {
  const std::string ns = KVBANK_STR(ABSL_OPTION_INLINE_NAMESPACE_NAME);
  std::string name;
  for (const char* c = mangled; *c != '\0'; ++c) {
    if (*c == '@') {
      name += std::to_string(ns.size()) + ns;
    } else {
      name += *c;
    }
  }
  void* f = dlsym(RTLD_NEXT, name.c_str());
  if (f == nullptr) {
    std::fprintf(stderr, "absl_sync_annotations: %s not found in Abseil\n", name.c_str());
    std::abort();
  }
  return f;
}

template <typename F>
F Get(const char* mangled) {
  return reinterpret_cast<F>(Real(mangled));
}

constexpr unsigned kRead = __tsan_mutex_read_lock;
constexpr unsigned kTry = __tsan_mutex_try_lock;
constexpr unsigned kTryFailed = __tsan_mutex_try_lock_failed;

// Only the outermost call is annotated: inside the library one entry point calls another
// (CondVar::WaitWithTimeout calls WaitWithDeadline, Notification locks its Mutex).
thread_local int depth = 0;
struct Depth {
  Depth() : outer(depth++ == 0) {}
  ~Depth() { --depth; }
  const bool outer;
};

// A call that takes the lock: whatever runs inside (a Condition) is not reported.
template <typename Call>
auto Locking(void* mu, unsigned flags, Call call) {
  Depth d;
  if (!d.outer) return call();
  __tsan_mutex_pre_lock(mu, flags);
  auto r = call();
  __tsan_mutex_post_lock(mu, flags, 0);
  return r;
}
// A call that may take it (a Try, a timeout): `taken(r)` says whether it did.
template <typename Call, typename Taken>
auto MaybeLocking(void* mu, unsigned flags, Call call, Taken taken) {
  Depth d;
  if (!d.outer) return call();
  __tsan_mutex_pre_lock(mu, flags | kTry);
  auto r = call();
  __tsan_mutex_post_lock(mu, taken(r) ? flags | kTry : flags | kTry | kTryFailed, 0);
  return r;
}
template <typename Call>
auto Unlocking(void* mu, unsigned flags, Call call) {
  Depth d;
  if (!d.outer) return call();
  __tsan_mutex_pre_unlock(mu, flags);
  auto r = call();
  __tsan_mutex_post_unlock(mu, flags);
  return r;
}
// A wait that releases a held lock and holds it again on return (Await, CondVar::Wait).
template <typename Call>
auto Releasing(void* mu, Call call) {
  Depth d;
  if (!d.outer) return call();
  __tsan_mutex_pre_unlock(mu, 0);
  __tsan_mutex_post_unlock(mu, 0);
  __tsan_mutex_pre_lock(mu, 0);
  auto r = call();
  __tsan_mutex_post_lock(mu, 0, 0);
  return r;
}
// Notify happens before every wait that sees it.
template <typename Call>
auto Publishing(const void* addr, Call call) {
  Depth d;
  if (d.outer) __tsan_release(const_cast<void*>(addr));
  return call();
}
template <typename Call, typename Acquired>
auto Acquiring(const void* addr, Call call, Acquired acquired) {
  Depth d;
  auto r = call();
  if (d.outer && acquired(r)) __tsan_acquire(const_cast<void*>(addr));
  return r;
}

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

// The lambdas return something (`, true`) so that Locking and Releasing can hand it back.
void Mutex::Lock() {
  static auto real = Get<void (*)(Mutex*)>("_ZN4absl@5Mutex4LockEv");
  Locking(this, 0, [&] { return real(this), true; });
}
void Mutex::ReaderLock() {
  static auto real = Get<void (*)(Mutex*)>("_ZN4absl@5Mutex10ReaderLockEv");
  Locking(this, kRead, [&] { return real(this), true; });
}
bool Mutex::TryLock() {
  static auto real = Get<bool (*)(Mutex*)>("_ZN4absl@5Mutex7TryLockEv");
  return MaybeLocking(
      this, 0, [&] { return real(this); }, [](bool r) { return r; });
}
bool Mutex::ReaderTryLock() {
  static auto real = Get<bool (*)(Mutex*)>("_ZN4absl@5Mutex13ReaderTryLockEv");
  return MaybeLocking(
      this, kRead, [&] { return real(this); }, [](bool r) { return r; });
}
void Mutex::Unlock() {
  static auto real = Get<void (*)(Mutex*)>("_ZN4absl@5Mutex6UnlockEv");
  Unlocking(this, 0, [&] { return real(this), true; });
}
void Mutex::ReaderUnlock() {
  static auto real = Get<void (*)(Mutex*)>("_ZN4absl@5Mutex12ReaderUnlockEv");
  Unlocking(this, kRead, [&] { return real(this), true; });
}
void Mutex::LockWhen(const Condition& c) {
  static auto real =
      Get<void (*)(Mutex*, const Condition&)>("_ZN4absl@5Mutex8LockWhenERKNS0_9ConditionE");
  Locking(this, 0, [&] { return real(this, c), true; });
}
void Mutex::ReaderLockWhen(const Condition& c) {
  static auto real =
      Get<void (*)(Mutex*, const Condition&)>("_ZN4absl@5Mutex14ReaderLockWhenERKNS0_9ConditionE");
  Locking(this, kRead, [&] { return real(this, c), true; });
}
bool Mutex::LockWhenWithTimeout(const Condition& c, Duration d) {
  // Returns whether the condition held; the lock is held either way.
  static auto real = Get<bool (*)(Mutex*, const Condition&, Duration)>(
      "_ZN4absl@5Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  return Locking(this, 0, [&] { return real(this, c, d); });
}
bool Mutex::LockWhenWithDeadline(const Condition& c, Time t) {
  static auto real = Get<bool (*)(Mutex*, const Condition&, Time)>(
      "_ZN4absl@5Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  return Locking(this, 0, [&] { return real(this, c, t); });
}
void Mutex::Await(const Condition& c) {
  static auto real =
      Get<void (*)(Mutex*, const Condition&)>("_ZN4absl@5Mutex5AwaitERKNS0_9ConditionE");
  Releasing(this, [&] { return real(this, c), true; });
}
bool Mutex::AwaitWithTimeout(const Condition& c, Duration d) {
  static auto real = Get<bool (*)(Mutex*, const Condition&, Duration)>(
      "_ZN4absl@5Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  return Releasing(this, [&] { return real(this, c, d); });
}
bool Mutex::AwaitWithDeadline(const Condition& c, Time t) {
  static auto real = Get<bool (*)(Mutex*, const Condition&, Time)>(
      "_ZN4absl@5Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  return Releasing(this, [&] { return real(this, c, t); });
}

void CondVar::Wait(Mutex* mu) {
  static auto real = Get<void (*)(CondVar*, Mutex*)>("_ZN4absl@7CondVar4WaitEPNS0_5MutexE");
  Releasing(mu, [&] { return real(this, mu), true; });
}
bool CondVar::WaitWithTimeout(Mutex* mu, Duration d) {
  static auto real = Get<bool (*)(CondVar*, Mutex*, Duration)>(
      "_ZN4absl@7CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE");
  return Releasing(mu, [&] { return real(this, mu, d); });
}
bool CondVar::WaitWithDeadline(Mutex* mu, Time t) {
  static auto real = Get<bool (*)(CondVar*, Mutex*, Time)>(
      "_ZN4absl@7CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE");
  return Releasing(mu, [&] { return real(this, mu, t); });
}

void Notification::Notify() {
  static auto real = Get<void (*)(Notification*)>("_ZN4absl@12Notification6NotifyEv");
  Publishing(this, [&] { return real(this), true; });
}
void Notification::WaitForNotification() const {
  static auto real =
      Get<void (*)(const Notification*)>("_ZNK4absl@12Notification19WaitForNotificationEv");
  Acquiring(
      this, [&] { return real(this), true; }, [](bool) { return true; });
}
bool Notification::WaitForNotificationWithTimeout(Duration d) const {
  static auto real = Get<bool (*)(const Notification*, Duration)>(
      "_ZNK4absl@12Notification30WaitForNotificationWithTimeoutENS0_8DurationE");
  return Acquiring(
      this, [&] { return real(this, d); }, [](bool r) { return r; });
}
bool Notification::WaitForNotificationWithDeadline(Time t) const {
  static auto real = Get<bool (*)(const Notification*, Time)>(
      "_ZNK4absl@12Notification31WaitForNotificationWithDeadlineENS0_4TimeE");
  return Acquiring(
      this, [&] { return real(this, t); }, [](bool r) { return r; });
}

ABSL_NAMESPACE_END
}  // namespace absl
