// The shared-memory plane's registry (server/plane/shm_regions.h) through its real Unix socket:
// handover, tenant ownership, slice bounds, lifetime = the client's connection, and the peers it
// must refuse (unsealed memfd, garbage, too many, too large).
#include "server/plane/shm_regions.h"

#include <fcntl.h>
#include <linux/falloc.h>
#include <poll.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/shm_handshake.h"
#include "gtest/gtest.h"

namespace kvbank::plane {
namespace {

// Polls `done` until it holds or `deadline` passes.
bool WaitFor(const std::function<bool()>& done, absl::Duration deadline = absl::Seconds(10)) {
  const absl::Time end = absl::Now() + deadline;
  while (!done()) {
    if (absl::Now() > end) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return true;
}

// Whether the peer closed `fd` within the deadline (a read answers EOF or an error after
// whatever the peer sent before).
bool PeerCloses(int fd, absl::Duration deadline = absl::Seconds(10)) {
  const absl::Time end = absl::Now() + deadline;
  for (;;) {
    const int64_t left = absl::ToInt64Milliseconds(end - absl::Now());
    if (left <= 0) return false;
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(left)) <= 0) return false;
    char buf[1024];
    if (recv(fd, buf, sizeof(buf), MSG_DONTWAIT) <= 0) return true;
  }
}

// One reply frame read from `fd` (blocking, up to 10 s).
absl::StatusOr<proto::ShmControlReplyFrame> ReadReply(int fd) {
  std::string in;
  const absl::Time end = absl::Now() + absl::Seconds(10);
  for (;;) {
    if (in.size() >= sizeof(proto::ShmControlHeader)) {
      const auto* p = reinterpret_cast<const uint8_t*>(in.data());
      auto h = proto::DecodeShmControlHeader({p, in.size()}, /*reply=*/true);
      if (!h.ok()) return h.status();
      const size_t n = sizeof(proto::ShmControlHeader) + h->body_bytes;
      if (in.size() >= n) return proto::DecodeShmControlReply({p, n});
    }
    const int64_t left = absl::ToInt64Milliseconds(end - absl::Now());
    pollfd p{fd, POLLIN, 0};
    if (left <= 0 || poll(&p, 1, int(left)) <= 0) return absl::DeadlineExceededError("no reply");
    char buf[4096];
    const ssize_t got = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (got <= 0) return absl::UnavailableError("closed before a whole reply");
    in.append(buf, size_t(got));
  }
}

// A fetch frame naming region `id`, with `request_id`.
std::vector<uint8_t> FetchFrame(uint64_t request_id, uint64_t id, uint32_t timeout_ms = 0) {
  proto::ShmControlRequest r;
  r.request_id = request_id;
  r.timeout_ms = timeout_ms;
  v1::FetchRequest f;
  f.set_model("m");
  f.set_sequence_id(1);
  f.mutable_dest()->set_region_id(id);
  f.mutable_dest()->set_length(64);
  r.body = f;
  return proto::EncodeShmControlRequest(r);
}

class ShmRegionsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/kvbank-shm-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    dir_ = dir;
    options_.socket_path = dir_ + "/shm.sock";
  }
  void TearDown() override {
    if (regions_ != nullptr) regions_->SetControlHandler(nullptr);
    {
      absl::MutexLock lock(&calls_mu_);
      calls_.clear();  // (answered INTERNAL if not answered, while the connections are open)
    }
    regions_.reset();
    for (int fd : fds_) close(fd);
    std::remove(options_.socket_path.c_str());
    rmdir(dir_.c_str());
  }
  void StartRegions() {
    auto r = ShmRegions::Start(options_);
    ASSERT_TRUE(r.ok()) << r.status();
    regions_ = *std::move(r);
  }
  int Keep(int fd) {
    fds_.push_back(fd);
    return fd;
  }
  // A sealed memfd of `size` bytes, handed over; its connection and memfd are closed at the end.
  absl::StatusOr<internal::ShmHandoff> HandOver(uint64_t size, int* memfd = nullptr) {
    auto fd = internal::CreateSealedMemfd(size);
    if (!fd.ok()) return fd.status();
    Keep(*fd);
    if (memfd != nullptr) *memfd = *fd;
    auto h = internal::HandOver(options_.socket_path, *fd);
    if (h.ok()) Keep(h->conn);
    return h;
  }
  // A region of 4096 bytes handed over and claimed by `tenant`: its connection and region id.
  void HandOverAndClaim(const std::string& tenant, int* conn, uint64_t* region_id) {
    auto h = HandOver(4096);
    ASSERT_TRUE(h.ok()) << h.status();
    auto claimed = regions_->Claim(tenant, h->handle);
    ASSERT_TRUE(claimed.ok()) << claimed.status();
    *conn = h->conn;
    *region_id = claimed->region_id;
  }
  // The control handler keeps every call it is handed: Call(i) is the i-th.
  void CollectCalls() {
    regions_->SetControlHandler([this](std::shared_ptr<ShmControlCall> c) {
      absl::MutexLock lock(&calls_mu_);
      calls_.push_back(std::move(c));
    });
  }
  size_t NumCalls() {
    absl::MutexLock lock(&calls_mu_);
    return calls_.size();
  }
  std::shared_ptr<ShmControlCall> Call(size_t i) {
    absl::MutexLock lock(&calls_mu_);
    return calls_.at(i);
  }

  std::string dir_;
  ShmOptions options_;
  std::unique_ptr<ShmRegions> regions_;
  std::vector<int> fds_;
  absl::Mutex calls_mu_;
  std::vector<std::shared_ptr<ShmControlCall>> calls_ ABSL_GUARDED_BY(calls_mu_);
};

TEST_F(ShmRegionsTest, RegionIsSharedTenantOwnedAndBounded) {
  ASSERT_NO_FATAL_FAILURE(StartRegions());
  struct stat st;
  ASSERT_EQ(stat(options_.socket_path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u) << "the socket is the owner's only";
  int memfd = -1;
  auto h = HandOver(8192, &memfd);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->size, 8192u);
  EXPECT_EQ(h->handle.size(), 16u);
  EXPECT_EQ(regions_->num_pending(), 1u);
  auto claimed = regions_->Claim("a", h->handle);
  ASSERT_TRUE(claimed.ok()) << claimed.status();
  EXPECT_EQ(claimed->size, 8192u);
  EXPECT_EQ(regions_->num_pending(), 0u);
  EXPECT_EQ(regions_->num_regions(), 1u);
  // A handle is claimed once.
  EXPECT_EQ(regions_->Claim("a", h->handle).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(regions_->Claim("a", "short").status().code(), absl::StatusCode::kInvalidArgument);

  // The client's bytes are the server's: one memory.
  uint8_t* mine =
      static_cast<uint8_t*>(mmap(nullptr, 8192, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0));
  ASSERT_NE(mine, MAP_FAILED);
  std::memset(mine + 100, 0x5a, 28);
  auto bytes = regions_->Resolve("a", claimed->region_id, 100, 28, "src");
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  for (uint8_t b : bytes->bytes) ASSERT_EQ(b, 0x5a);
  bytes->bytes[0] = 7;
  EXPECT_EQ(mine[100], 7);
  munmap(mine, 8192);

  // Another tenant cannot name it: the same answer as for an id that never was.
  auto foreign = regions_->Resolve("b", claimed->region_id, 0, 1, "src");
  EXPECT_EQ(foreign.status().code(), absl::StatusCode::kNotFound) << foreign.status();
  EXPECT_EQ(regions_->Resolve("a", claimed->region_id + 1000, 0, 1, "src").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(regions_->Unregister("b", claimed->region_id).code(), absl::StatusCode::kNotFound);

  // Bounds, overflow included; the field is named.
  const uint64_t max = std::numeric_limits<uint64_t>::max();
  for (auto [offset, length] : std::vector<std::pair<uint64_t, uint64_t>>{
           {8193, 0}, {0, 8193}, {8000, 193}, {1, max}, {max, 2}, {max, max}}) {
    auto r = regions_->Resolve("a", claimed->region_id, offset, length, "header.source");
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << offset << "+" << length;
    EXPECT_TRUE(absl::StrContains(r.status().message(), "header.source")) << r.status();
  }
  EXPECT_TRUE(regions_->Resolve("a", claimed->region_id, 8192, 0, "src").ok());
  EXPECT_TRUE(regions_->Resolve("a", claimed->region_id, 0, 8192, "src").ok());
  EXPECT_EQ(regions_->Resolve("a", 0, 0, 1, "dest").status().code(),
            absl::StatusCode::kInvalidArgument);

  // Unregister drops it and closes the connection it came on.
  ASSERT_TRUE(regions_->Unregister("a", claimed->region_id).ok());
  EXPECT_EQ(regions_->num_regions(), 0u);
  EXPECT_TRUE(PeerCloses(h->conn));
  EXPECT_EQ(regions_->Resolve("a", claimed->region_id, 0, 1, "src").status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(ShmRegionsTest, ClosingTheConnectionDropsTheRegionButNotAMappingInUse) {
  ASSERT_NO_FATAL_FAILURE(StartRegions());
  auto fd = internal::CreateSealedMemfd(4096);
  ASSERT_TRUE(fd.ok());
  auto h = internal::HandOver(options_.socket_path, *fd);
  ASSERT_TRUE(h.ok()) << h.status();
  auto claimed = regions_->Claim("a", h->handle);
  ASSERT_TRUE(claimed.ok());
  auto held = regions_->Resolve("a", claimed->region_id, 0, 4096, "src");
  ASSERT_TRUE(held.ok());
  close(h->conn);  // the client exits
  close(*fd);
  ASSERT_TRUE(WaitFor([&] { return regions_->num_regions() == 0; }))
      << "the region outlived its client's connection";
  EXPECT_EQ(regions_->num_connections(), 0u);
  EXPECT_EQ(regions_->Resolve("a", claimed->region_id, 0, 1, "src").status().code(),
            absl::StatusCode::kNotFound);
  // A transfer that resolved it before still has its bytes mapped.
  std::memset(held->bytes.data(), 1, held->bytes.size());
  EXPECT_EQ(held->bytes[4095], 1);
}

TEST_F(ShmRegionsTest, RefusesEmptyLargeAndReadOnlyRegions) {
  options_.max_region_bytes = 16384;
  ASSERT_NO_FATAL_FAILURE(StartRegions());
  // Too large, and empty.
  EXPECT_EQ(HandOver(32768).status().code(), absl::StatusCode::kInvalidArgument);
  const int empty = Keep(memfd_create("empty", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  ASSERT_EQ(fcntl(empty, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  EXPECT_EQ(internal::HandOver(options_.socket_path, empty).status().code(),
            absl::StatusCode::kInvalidArgument);
  // A write-sealed memfd cannot be mapped writable for fetches.
  auto ro2 = memfd_create("ro", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  Keep(ro2);
  ASSERT_EQ(ftruncate(ro2, 4096), 0);
  ASSERT_EQ(fcntl(ro2, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_WRITE), 0);
  EXPECT_EQ(internal::HandOver(options_.socket_path, ro2).status().code(),
            absl::StatusCode::kInvalidArgument);
  // A regular file on disk takes no seals.
  const std::string file = dir_ + "/plain";
  std::ofstream(file) << std::string(4096, 'x');
  const int plain = Keep(open(file.c_str(), O_RDWR | O_CLOEXEC));
  EXPECT_EQ(internal::HandOver(options_.socket_path, plain).status().code(),
            absl::StatusCode::kInvalidArgument);
  std::remove(file.c_str());
  EXPECT_EQ(regions_->num_pending() + regions_->num_regions(), 0u);
  EXPECT_TRUE(WaitFor([&] { return regions_->num_connections() == 0; }));
}

// A region's pages must be the client's before kvbankd maps it: a memfd with a hole (its pages
// would be allocated by kvbankd's copies, on kvbankd's memory cgroup) and a hugetlbfs one (its
// pages can go under a copy) are refused; a page punched out after registration fails the
// transfers over it, not the others.
TEST_F(ShmRegionsTest, RefusesSparseHugetlbAndPunchedRegions) {
  ASSERT_NO_FATAL_FAILURE(StartRegions());
  const int sparse = Keep(memfd_create("sparse", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  ASSERT_EQ(ftruncate(sparse, 65536), 0);
  ASSERT_EQ(pwrite(sparse, "x", 1, 0), 1);  // the first page only
  ASSERT_EQ(fcntl(sparse, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  auto h = internal::HandOver(options_.socket_path, sparse);
  EXPECT_EQ(h.status().code(), absl::StatusCode::kInvalidArgument) << h.status();
  EXPECT_TRUE(absl::StrContains(h.status().message(), "has a hole (no page written at byte 4096)"))
      << h.status();
  const int huge = memfd_create("huge", MFD_CLOEXEC | MFD_ALLOW_SEALING | MFD_HUGETLB);
  if (huge < 0) {
    std::cerr << "[shm] no hugetlbfs memfd on this kernel (" << std::strerror(errno)
              << "): that case not run\n";
  } else {
    Keep(huge);
    ASSERT_EQ(ftruncate(huge, 2 << 20), 0);
    if (fcntl(huge, F_ADD_SEALS, F_SEAL_SHRINK) == 0) {
      h = internal::HandOver(options_.socket_path, huge);
      EXPECT_EQ(h.status().code(), absl::StatusCode::kInvalidArgument) << h.status();
      EXPECT_TRUE(absl::StrContains(h.status().message(), "hugetlbfs")) << h.status();
    }
  }
  // The SDK's memfd is written whole: taken. Then a page is punched out of it.
  int memfd = -1;
  auto good = HandOver(65536, &memfd);
  ASSERT_TRUE(good.ok()) << good.status();
  auto claimed = regions_->Claim("t", good->handle);
  ASSERT_TRUE(claimed.ok()) << claimed.status();
  ASSERT_EQ(fallocate(memfd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 32768, 4096), 0);
  auto over_hole = regions_->Resolve("t", claimed->region_id, 30000, 8192, "dest");
  EXPECT_EQ(over_hole.status().code(), absl::StatusCode::kFailedPrecondition) << over_hole.status();
  EXPECT_TRUE(absl::StrContains(over_hole.status().message(), "dest: the region has no page"))
      << over_hole.status();
  EXPECT_TRUE(regions_->Resolve("t", claimed->region_id, 0, 32768, "dest").ok());
  EXPECT_TRUE(regions_->Resolve("t", claimed->region_id, 36864, 28672, "dest").ok());
}

// Scattered runs are checked for punched-out pages where they are (and in gaps of up to
// kRunCheckGap between them), not across the whole span they lie in.
TEST_F(ShmRegionsTest, RunsAreCheckedForHolesWhereTheyAre) {
  ASSERT_NO_FATAL_FAILURE(StartRegions());
  int memfd = -1;
  auto good = HandOver(512 << 10, &memfd);
  ASSERT_TRUE(good.ok()) << good.status();
  auto claimed = regions_->Claim("t", good->handle);
  ASSERT_TRUE(claimed.ok()) << claimed.status();
  const uint64_t id = claimed->region_id;
  ASSERT_EQ(fallocate(memfd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 256 << 10, 4096), 0);
  const std::vector<uint64_t> apart = {448 << 10, 0};  // the hole 188 KiB from either run
  auto runs = regions_->ResolveRuns("t", id, 0, 4096, apart, "dest");
  ASSERT_TRUE(runs.ok()) << runs.status();
  EXPECT_EQ(runs->size(), 8192u);
  EXPECT_EQ(runs->runs[0].data(), runs->runs[1].data() + (448 << 10)) << "payload order kept";
  const std::vector<uint64_t> on_hole = {0, (256 << 10) - 1024};
  auto bad = regions_->ResolveRuns("t", id, 0, 2048, on_hole, "dest");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kFailedPrecondition) << bad.status();
  EXPECT_TRUE(absl::StrContains(bad.status().message(),
                                "dest: the region has no page written at byte 262144"))
      << bad.status();
  const std::vector<uint64_t> close_by = {(256 << 10) - 8192, (256 << 10) + 8192};
  auto near = regions_->ResolveRuns("t", id, 0, 4096, close_by, "dest");
  EXPECT_EQ(near.status().code(), absl::StatusCode::kFailedPrecondition)
      << "a hole in a gap under kRunCheckGap is checked as the runs are: " << near.status();
}

// Runs that continue one another in the region, in payload order, become one run (a host pool's
// pages side by side); the payload still maps to the same bytes, piece by piece.
TEST_F(ShmRegionsTest, RunsThatContinueEachOtherAreOne) {
  ASSERT_NO_FATAL_FAILURE(StartRegions());
  int memfd = -1;
  auto good = HandOver(256 << 10, &memfd);
  ASSERT_TRUE(good.ok()) << good.status();
  auto claimed = regions_->Claim("t", good->handle);
  ASSERT_TRUE(claimed.ok()) << claimed.status();
  // Payload runs 0-2 side by side, run 3 apart, run 4 right after run 3, run 5 before them all.
  const std::vector<uint64_t> offsets = {8192, 12288, 16384, 65536, 69632, 0};
  auto runs = regions_->ResolveRuns("t", claimed->region_id, 0, 4096, offsets, "dest");
  ASSERT_TRUE(runs.ok()) << runs.status();
  ASSERT_EQ(runs->runs.size(), 3u);
  EXPECT_EQ(runs->runs[0].size(), 3u * 4096);
  EXPECT_EQ(runs->runs[1].size(), 2u * 4096);
  EXPECT_EQ(runs->runs[2].size(), 4096u);
  EXPECT_EQ(runs->size(), 6u * 4096);
  uint8_t* const region = runs->runs[2].data();  // offset 0
  // Every range of the payload, cut anywhere, lands where its unmerged run says.
  for (uint64_t at : {uint64_t{0}, uint64_t{100}, uint64_t{4096}, uint64_t{12287}, uint64_t{20479},
                      uint64_t{20480}}) {
    for (uint64_t n : {uint64_t{1}, uint64_t{4096}, uint64_t{9000}, 6u * 4096 - at}) {
      if (at + n > runs->size()) continue;
      uint64_t next = at;
      absl::Status s = runs->ForEachPiece(at, n, [&](uint64_t p, absl::Span<uint8_t> piece) {
        EXPECT_EQ(p, next);
        for (uint64_t b = 0; b < piece.size(); b += std::max<uint64_t>(1, piece.size() - 1)) {
          const uint64_t q = p + b;  // payload byte q: run q / 4096 at its offset
          EXPECT_EQ(piece.data() + b, region + offsets[q / 4096] + q % 4096)
              << "payload byte " << q << " (from " << at << ", " << n << " bytes)";
        }
        next = p + piece.size();
        return absl::OkStatus();
      });
      EXPECT_TRUE(s.ok()) << s;
      EXPECT_EQ(next, at + n);
    }
  }
}

// A memfd that cannot be sealed (made without MFD_ALLOW_SEALING, as engines make their host pools)
// or is not sealed against shrinking is taken, guarded: once its owner truncates it, transfers
// over it fail (before the copy when the file is shorter, after it when it shrank during the
// copy, whose SIGBUS kvbankd survives), and a sealed region beside it is untouched.
TEST_F(ShmRegionsTest, UnsealedRegionsAreTakenAndSurviveTruncation) {
  ASSERT_NO_FATAL_FAILURE(StartRegions());
  auto whole = [&](int fd, size_t n) {
    const std::string bytes(n, 'u');
    return fd >= 0 && pwrite(fd, bytes.data(), n, 0) == static_cast<ssize_t>(n);
  };
  const int no_seals = Keep(memfd_create("engine-pool", MFD_CLOEXEC));
  const int unsealed = Keep(memfd_create("unsealed", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  ASSERT_TRUE(whole(no_seals, 65536) && whole(unsealed, 8192));
  auto h1 = internal::HandOver(options_.socket_path, no_seals);
  ASSERT_TRUE(h1.ok()) << h1.status();
  Keep(h1->conn);
  auto h2 = internal::HandOver(options_.socket_path, unsealed);
  ASSERT_TRUE(h2.ok()) << h2.status();
  Keep(h2->conn);
  int sealed_fd = -1;
  auto h3 = HandOver(8192, &sealed_fd);
  ASSERT_TRUE(h3.ok()) << h3.status();
  auto c1 = regions_->Claim("t", h1->handle);
  auto c2 = regions_->Claim("t", h2->handle);
  auto c3 = regions_->Claim("t", h3->handle);
  ASSERT_TRUE(c1.ok() && c2.ok() && c3.ok());

  // Shared both ways while whole.
  auto r1 = regions_->Resolve("t", c1->region_id, 0, 65536, "dest");
  ASSERT_TRUE(r1.ok()) << r1.status();
  EXPECT_FALSE(r1->mapping->sealed());
  std::memset(r1->bytes.data(), 'k', 4096);
  char first = 0;
  ASSERT_EQ(pread(no_seals, &first, 1, 0), 1);
  EXPECT_EQ(first, 'k');
  EXPECT_TRUE(r1->mapping->CheckIntact().ok());

  // The owner truncates it: a transfer that resolves now fails, naming why.
  ASSERT_EQ(ftruncate(no_seals, 4096), 0);
  auto late = regions_->Resolve("t", c1->region_id, 0, 4096, "header.source");
  EXPECT_EQ(late.status().code(), absl::StatusCode::kFailedPrecondition) << late.status();
  EXPECT_TRUE(absl::StrContains(late.status().message(),
                                "header.source: the region's file is "
                                "4096 bytes now, 65536"))
      << late.status();
  // A transfer that resolved before: its copy past the new end takes SIGBUS; kvbankd survives,
  // the copy finishes on throwaway pages, and the transfer sees it failed.
  std::vector<uint8_t> sink(65536);
  std::memcpy(sink.data(), r1->bytes.data(), sink.size());  // reads past the end
  std::memset(r1->bytes.data() + 8192, 'x', 8192);          // writes past it
  // The file itself is what its owner left: nothing written past the end brought it back.
  struct stat st;
  ASSERT_EQ(fstat(no_seals, &st), 0);
  EXPECT_EQ(st.st_size, 4096);
  // Grown back, the file is whole again, but the mapping that took the SIGBUS is not.
  ASSERT_EQ(ftruncate(no_seals, 65536), 0);
  const absl::Status tripped = r1->mapping->CheckIntact();
  EXPECT_EQ(tripped.code(), absl::StatusCode::kFailedPrecondition) << tripped;
  EXPECT_TRUE(absl::StrContains(tripped.message(), "truncated by its owner during a transfer"))
      << tripped;

  // The other regions, unsealed and sealed, go on.
  auto r2 = regions_->Resolve("t", c2->region_id, 0, 8192, "dest");
  ASSERT_TRUE(r2.ok()) << r2.status();
  std::memset(r2->bytes.data(), 'v', 8192);
  EXPECT_TRUE(r2->mapping->CheckIntact().ok());
  auto r3 = regions_->Resolve("t", c3->region_id, 0, 8192, "dest");
  ASSERT_TRUE(r3.ok()) << r3.status();
  EXPECT_TRUE(r3->mapping->sealed());
  EXPECT_TRUE(r3->mapping->CheckIntact().ok());
  EXPECT_TRUE(regions_->Unregister("t", c1->region_id).ok());
  EXPECT_EQ(regions_->num_regions(), 2u);
}

// The guard is for registered regions only: a SIGBUS anywhere else still ends the process (as
// the default action, or the sanitizer's report, would).
TEST(SigbusGuardDeathTest, AFaultOutsideRegionsStillEndsTheProcess) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  ShmOptions options;
  const std::string dir = ::testing::TempDir() + "kvbank-sigbus-XXXXXX";
  std::vector<char> path(dir.begin(), dir.end());
  path.push_back('\0');
  ASSERT_NE(mkdtemp(path.data()), nullptr);
  options.socket_path = std::string(path.data()) + "/s.sock";
  auto regions = ShmRegions::Start(options);
  ASSERT_TRUE(regions.ok()) << regions.status();
  // Installs the handler: an unsealed region registered.
  const int fd = memfd_create("guarded", MFD_CLOEXEC);
  const std::string page(4096, 'g');
  ASSERT_EQ(pwrite(fd, page.data(), page.size(), 0), 4096);
  auto h = internal::HandOver(options.socket_path, fd);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_DEATH(
      {
        const int other = memfd_create("unguarded", MFD_CLOEXEC);
        if (other < 0 || ftruncate(other, 8192) != 0) _exit(0);
        auto* p = static_cast<volatile uint8_t*>(
            mmap(nullptr, 8192, PROT_READ | PROT_WRITE, MAP_SHARED, other, 0));
        if (ftruncate(other, 0) != 0) _exit(0);
        p[4096] = 1;  // SIGBUS, not in a guarded range
        _exit(0);
      },
      "");
  close(h->conn);
  close(fd);
  regions->reset();
  std::remove(options.socket_path.c_str());
  rmdir(path.data());
}

TEST_F(ShmRegionsTest, GarbageOrNoDescriptorClosesThePeerAndNothingElse) {
  ASSERT_NO_FATAL_FAILURE(StartRegions());
  auto good = HandOver(4096);
  ASSERT_TRUE(good.ok());
  auto claimed = regions_->Claim("a", good->handle);
  ASSERT_TRUE(claimed.ok());
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strcpy(addr.sun_path, options_.socket_path.c_str());
  const std::vector<std::string> garbage = {"hello world, no fd", "KVBSHM01",  // hello, no fd
                                            std::string(5000, '\xff')};
  for (const std::string& g : garbage) {
    const int fd = Keep(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    ASSERT_EQ(connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0);
    ASSERT_EQ(send(fd, g.data(), g.size(), MSG_NOSIGNAL), static_cast<ssize_t>(g.size()));
    EXPECT_TRUE(PeerCloses(fd)) << "garbage of " << g.size() << " bytes left the peer connected";
  }
  // A registered client that sends a frame that is not one breaks the protocol: it is told why
  // (by the request id it gave), and its region goes.
  auto second = HandOver(4096);
  ASSERT_TRUE(second.ok());
  auto claimed2 = regions_->Claim("a", second->handle);
  ASSERT_TRUE(claimed2.ok());
  proto::ShmControlHeader bad{};
  std::memcpy(bad.magic, "XXXX", 4);
  bad.request_id = 77;
  ASSERT_EQ(send(second->conn, &bad, sizeof(bad), MSG_NOSIGNAL), ssize_t(sizeof(bad)));
  auto reply = ReadReply(second->conn);
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_EQ(reply->request_id, 77u);
  EXPECT_EQ(reply->status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(reply->status.message(), "bad magic")) << reply->status;
  EXPECT_TRUE(PeerCloses(second->conn));
  EXPECT_TRUE(WaitFor([&] { return regions_->num_regions() == 1; }));
  EXPECT_TRUE(regions_->Resolve("a", claimed->region_id, 0, 4096, "src").ok())
      << "other peers' garbage dropped a good region";
}

// Frames on a claimed connection reach the handler as the claiming tenant's calls; replies go back
// by request id, in the order the calls finish; at most kShmControlMaxInFlight are in flight (the
// rest wait in the socket); a connection that closes ends its calls.
TEST_F(ShmRegionsTest, ControlFramesReachTheHandlerAsTheTenantsCalls) {
  ASSERT_NO_FATAL_FAILURE(StartRegions());
  CollectCalls();
  int conn = -1;
  uint64_t region_id = 0;
  ASSERT_NO_FATAL_FAILURE(HandOverAndClaim("tenant-a", &conn, &region_id));
  // More frames than may be in flight, in one send, the last one cut in two.
  const uint32_t n = proto::kShmControlMaxInFlight + 3;
  std::vector<uint8_t> bytes;
  for (uint32_t i = 1; i <= n; ++i) {
    const std::vector<uint8_t> f = FetchFrame(i, region_id, i == 1 ? 5000 : 0);
    bytes.insert(bytes.end(), f.begin(), f.end());
  }
  ASSERT_EQ(send(conn, bytes.data(), bytes.size() - 7, MSG_NOSIGNAL), ssize_t(bytes.size() - 7));
  ASSERT_TRUE(WaitFor([&] { return NumCalls() == proto::kShmControlMaxInFlight; }));
  absl::SleepFor(absl::Milliseconds(50));  // (a check that no more come: none may)
  EXPECT_EQ(NumCalls(), proto::kShmControlMaxInFlight) << "past the in-flight limit";
  EXPECT_EQ(Call(0)->tenant(), "tenant-a");
  EXPECT_EQ(Call(0)->request().request_id, 1u);
  EXPECT_NE(Call(0)->deadline(), absl::InfiniteFuture()) << "timeout_ms 5000 gives a deadline";
  EXPECT_EQ(Call(1)->deadline(), absl::InfiniteFuture());
  // Answered out of order: the second first.
  v1::FetchResponse resp;
  resp.mutable_header()->set_payload_bytes(64);
  Call(1)->Reply(proto::ShmControlAnswer(resp));
  Call(0)->Reply(absl::NotFoundError("no such sequence"));
  auto r1 = ReadReply(conn);
  ASSERT_TRUE(r1.ok()) << r1.status();
  EXPECT_EQ(r1->request_id, 2u);
  EXPECT_EQ(std::get<v1::FetchResponse>(r1->answer).header().payload_bytes(), 64u);
  // Two answered: two more of the waiting frames come in; the cut one waits for its rest.
  ASSERT_TRUE(WaitFor([&] { return NumCalls() == proto::kShmControlMaxInFlight + 2; }));
  ASSERT_EQ(send(conn, bytes.data() + bytes.size() - 7, 7, MSG_NOSIGNAL), 7);
  Call(2)->Reply(absl::NotFoundError("x"));  // room for the last one, now whole
  ASSERT_TRUE(WaitFor([&] { return NumCalls() == n; }));
  // The client goes: every call in flight ends.
  const std::shared_ptr<ShmControlCall> last = Call(n - 1);
  bool ended_hook = false;
  last->OnEnd([&] { ended_hook = true; });
  EXPECT_FALSE(last->ended().load());
  shutdown(conn, SHUT_RDWR);
  EXPECT_TRUE(WaitFor([&] { return last->ended().load(); }));
  EXPECT_TRUE(WaitFor([&] { return regions_->num_regions() == 0; }));
  EXPECT_TRUE(ended_hook);
  last->Reply(absl::CancelledError("gone"));  // into a closed connection: dropped
}

// A call its deadline ended answers DEADLINE_EXCEEDED where the work it stopped says CANCELLED
// (as gRPC answers a call past its deadline); a call ended otherwise (its client went) stays a
// cancel, and other errors pass as they are.
TEST_F(ShmRegionsTest, ACallEndedAtItsDeadlineAnswersDeadlineExceeded) {
  ASSERT_NO_FATAL_FAILURE(StartRegions());
  CollectCalls();
  int conn = -1;
  uint64_t region_id = 0;
  ASSERT_NO_FATAL_FAILURE(HandOverAndClaim("a", &conn, &region_id));
  std::vector<uint8_t> bytes;
  for (uint64_t i = 1; i <= 3; ++i) {
    const std::vector<uint8_t> f = FetchFrame(i, region_id, 250);
    bytes.insert(bytes.end(), f.begin(), f.end());
  }
  ASSERT_EQ(send(conn, bytes.data(), bytes.size(), MSG_NOSIGNAL), ssize_t(bytes.size()));
  ASSERT_TRUE(WaitFor([&] { return NumCalls() == 3; }));
  bool ended_hook = false;
  Call(0)->OnEnd([&] { ended_hook = true; });
  Call(0)->EndAtDeadline();
  EXPECT_TRUE(Call(0)->ended().load());
  EXPECT_TRUE(ended_hook);
  Call(1)->End();
  Call(2)->EndAtDeadline();
  const absl::Status answers[] = {absl::CancelledError("the fetch ended before its copy"),
                                  absl::CancelledError("the fetch ended before its copy"),
                                  absl::NotFoundError("no such sequence")};
  std::map<uint64_t, absl::Status> got;
  for (int i = 0; i < 3; ++i) {  // one at a time: ReadReply reads one reply
    Call(i)->Reply(answers[i]);
    auto r = ReadReply(conn);
    ASSERT_TRUE(r.ok()) << r.status();
    got[r->request_id] = r->status;
  }
  EXPECT_EQ(got[1].code(), absl::StatusCode::kDeadlineExceeded) << got[1];
  EXPECT_TRUE(absl::StrContains(got[1].message(), "timeout_ms (250)")) << got[1];
  EXPECT_TRUE(absl::StrContains(got[1].message(), "before its copy")) << got[1];
  EXPECT_EQ(got[2].code(), absl::StatusCode::kCancelled) << got[2];
  EXPECT_EQ(got[3].code(), absl::StatusCode::kNotFound) << got[3];
}

// A frame before the region is claimed is a protocol error; without a handler (a service that
// stops) a frame is answered UNAVAILABLE.
TEST_F(ShmRegionsTest, FramesBeforeTheClaimOrWithoutHandler) {
  ASSERT_NO_FATAL_FAILURE(StartRegions());
  auto early = HandOver(4096);
  ASSERT_TRUE(early.ok());
  const std::vector<uint8_t> f = FetchFrame(1, 1);
  ASSERT_EQ(send(early->conn, f.data(), f.size(), MSG_NOSIGNAL), ssize_t(f.size()));
  EXPECT_TRUE(PeerCloses(early->conn));
  EXPECT_EQ(regions_->num_pending(), 0u);

  auto h = HandOver(4096);
  ASSERT_TRUE(h.ok());
  auto claimed = regions_->Claim("a", h->handle);
  ASSERT_TRUE(claimed.ok());
  const std::vector<uint8_t> g = FetchFrame(9, claimed->region_id);
  ASSERT_EQ(send(h->conn, g.data(), g.size(), MSG_NOSIGNAL), ssize_t(g.size()));
  auto reply = ReadReply(h->conn);
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_EQ(reply->request_id, 9u);
  EXPECT_EQ(reply->status.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(regions_->num_regions(), 1u) << "the connection stays";
}

// A socket file at `path` that nobody listens on (bound, then closed).
void LeaveSocketFile(const std::string& path) {
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strcpy(addr.sun_path, path.c_str());
  ASSERT_EQ(bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0) << path;
  close(fd);
}

// --shm-socket=auto: the runtime folder is made owner-only, a dead server's socket is removed,
// a live one's kept, and a folder others may write is refused.
TEST(DefaultShmSocketPath, AFolderOfThisUserOnlyWithoutStaleSockets) {
  char dir[] = "/tmp/kvbank-xdg-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const char* old = std::getenv("XDG_RUNTIME_DIR");
  const std::string saved = old != nullptr ? old : "";
  setenv("XDG_RUNTIME_DIR", dir, 1);
  const std::string folder = std::string(dir) + "/kvbank";
  auto path = DefaultShmSocketPath();
  ASSERT_TRUE(path.ok()) << path.status();
  EXPECT_EQ(*path, folder + "/kvbankd-" + std::to_string(getpid()) + ".sock");
  struct stat st;
  ASSERT_EQ(stat(folder.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  // A pid that no process has (a child that exited), and this process's parent (alive).
  const pid_t child = fork();
  if (child == 0) _exit(0);
  ASSERT_GT(child, 0);
  waitpid(child, nullptr, 0);
  const std::string dead = folder + "/kvbankd-" + std::to_string(child) + ".sock";
  const std::string live = folder + "/kvbankd-" + std::to_string(getppid()) + ".sock";
  ASSERT_NO_FATAL_FAILURE(LeaveSocketFile(dead));
  ASSERT_NO_FATAL_FAILURE(LeaveSocketFile(live));
  ASSERT_TRUE(DefaultShmSocketPath().ok());
  EXPECT_NE(access(dead.c_str(), F_OK), 0) << "a dead server's socket stayed";
  EXPECT_EQ(access(live.c_str(), F_OK), 0) << "a live server's socket was removed";
  unlink(live.c_str());
  // Others may write the folder: refused, naming it.
  ASSERT_EQ(chmod(folder.c_str(), 0770), 0);
  auto refused = DefaultShmSocketPath();
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), folder)) << refused.status();
  rmdir(folder.c_str());
  rmdir(dir);
  if (old != nullptr) {
    setenv("XDG_RUNTIME_DIR", saved.c_str(), 1);
  } else {
    unsetenv("XDG_RUNTIME_DIR");
  }
}

TEST_F(ShmRegionsTest, UnclaimedHandlesAndSilentPeersExpire) {
  options_.claim_timeout = absl::Milliseconds(300);
  ASSERT_NO_FATAL_FAILURE(StartRegions());
  auto h = HandOver(4096);
  ASSERT_TRUE(h.ok());
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strcpy(addr.sun_path, options_.socket_path.c_str());
  const int silent = Keep(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  ASSERT_EQ(connect(silent, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0);
  EXPECT_TRUE(PeerCloses(h->conn));
  EXPECT_TRUE(PeerCloses(silent));
  EXPECT_EQ(regions_->num_pending(), 0u);
  EXPECT_EQ(regions_->Claim("a", h->handle).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ShmRegionsTest, RegionCountIsBounded) {
  options_.max_regions = 2;
  ASSERT_NO_FATAL_FAILURE(StartRegions());
  auto a = HandOver(4096);
  auto b = HandOver(4096);
  ASSERT_TRUE(a.ok() && b.ok());
  auto c = HandOver(4096);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted) << c.status();
  close(a->conn);  // a place frees up once the server has seen it go
  ASSERT_TRUE(WaitFor([&] { return regions_->num_connections() == 1; }));
  EXPECT_TRUE(HandOver(4096).ok());
}

// Out of descriptors, accept fails while the listener stays readable: the listener must rest,
// not spin on poll, and take the connection once descriptors are back.
TEST_F(ShmRegionsTest, OutOfDescriptorsTheListenerRestsAndRecovers) {
  ASSERT_NO_FATAL_FAILURE(StartRegions());
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strcpy(addr.sun_path, options_.socket_path.c_str());
  const int client = Keep(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  ASSERT_GE(client, 0);
  // The lowest free descriptor is the one accept would take: allow none above the client's.
  const int probe = dup(client);
  ASSERT_GE(probe, 0);
  close(probe);
  rlimit saved;
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &saved), 0);
  rlimit low = saved;
  low.rlim_cur = static_cast<rlim_t>(probe);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  const bool connected =
      connect(client, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0;
  rusage before, after;
  getrusage(RUSAGE_SELF, &before);
  absl::SleepFor(absl::Milliseconds(500));  // a span to measure CPU over, not a wait
  getrusage(RUSAGE_SELF, &after);
  const int pending = regions_->num_connections();
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &saved), 0);
  ASSERT_TRUE(connected);
  EXPECT_EQ(pending, 0) << "accept should have failed under the limit";
  auto cpu_ms = [](const rusage& r) {
    return (r.ru_utime.tv_sec + r.ru_stime.tv_sec) * 1000.0 +
           (r.ru_utime.tv_usec + r.ru_stime.tv_usec) / 1000.0;
  };
  EXPECT_LT(cpu_ms(after) - cpu_ms(before), 150.0) << "the listener spun on a failing accept";
  EXPECT_TRUE(WaitFor([&] { return regions_->num_connections() == 1; }))
      << "the connection was not taken once descriptors were back";
}

TEST_F(ShmRegionsTest, StaleSocketIsReplacedLiveOneAndOtherFilesRefused) {
  // A socket file nobody answers on (a server that was killed) is replaced.
  {
    const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strcpy(addr.sun_path, options_.socket_path.c_str());
    ASSERT_EQ(bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0);
    close(fd);
  }
  ASSERT_NO_FATAL_FAILURE(StartRegions());
  // One a server answers on is not.
  auto second = ShmRegions::Start(options_);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition) << second.status();
  EXPECT_TRUE(HandOver(4096).ok()) << "the refused second start broke the first";
  regions_.reset();
  struct stat st;
  EXPECT_NE(stat(options_.socket_path.c_str(), &st), 0) << "the socket file outlived the plane";
  // Nor is a file that is not a socket.
  std::ofstream(options_.socket_path) << "not a socket";
  auto r = ShmRegions::Start(options_);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
}

}  // namespace
}  // namespace kvbank::plane
