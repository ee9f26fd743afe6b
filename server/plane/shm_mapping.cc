#include "server/plane/shm_mapping.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "server/plane/sigbus_guard.h"

namespace kvbank::plane {

namespace {

absl::Status Errno(absl::string_view what) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(errno)));
}

}  // namespace

absl::StatusOr<std::shared_ptr<ShmMapping>> ShmMapping::Map(int fd, uint64_t max_bytes) {
  struct stat st;
  if (fstat(fd, &st) != 0) return Errno("shm region: fstat");
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError("shm region: the descriptor is not a memfd (regular file)");
  }
  // NOTE: hugetlbfs memfds take seals too, but their pages can be punched out under a copy
  // (SIGBUS in kvbankd); only shmem is taken.
  struct statfs fs;
  if (fstatfs(fd, &fs) != 0) return Errno("shm region: fstatfs");
  if (fs.f_type != TMPFS_MAGIC) {
    return absl::InvalidArgumentError(
        fs.f_type == HUGETLBFS_MAGIC
            ? "shm region: hugetlbfs memfds (MFD_HUGETLB) are not taken; send a plain memfd"
            : "shm region: the descriptor is not a shmem memfd (memfd_create)");
  }
  // NOTE: without F_SEAL_SHRINK the client could ftruncate the file under a copy, and the
  // server's access past the new end would raise SIGBUS in kvbankd. Such a file (a memfd made
  // without MFD_ALLOW_SEALING, an shm_open file: engines allocate host pools so) is taken, its
  // mapping guarded (sigbus_guard.h) and checked after each copy (CheckIntact).
  const int seals = fcntl(fd, F_GET_SEALS);
  const bool guarded = seals < 0 || (seals & F_SEAL_SHRINK) == 0;
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size == 0) return absl::InvalidArgumentError("shm region: the memfd is empty (size 0)");
  if (size > max_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("shm region: ", size, " bytes is more than ",
                                                   max_bytes, " (--shm-max-region-bytes)"));
  }
  // Every page allocated by its owner (and so charged to it): a sparse memfd's pages would be
  // allocated by kvbankd's first copy into them, on kvbankd's memory cgroup. (tmpfs reports a
  // page fallocated but never written as a hole too: the owner writes its pages.)
  const off_t hole = lseek(fd, 0, SEEK_HOLE);
  if (hole < 0) return Errno("shm region: lseek SEEK_HOLE");
  if (uint64_t(hole) < size) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm region: the memfd has a hole (no page written at byte ", hole,
                     "): write all of it first, so that its pages are the client's"));
  }
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shm region: cannot map it shared read/write (open it O_RDWR, no write seal): ",
        std::strerror(errno)));
  }
  int slot = -1;
  if (guarded) {
    auto added = SigbusGuard::Add(static_cast<uint8_t*>(p), size);
    if (!added.ok()) {
      munmap(p, size);
      return absl::Status(added.status().code(),
                          absl::StrCat("shm region: ", added.status().message(),
                                       " (seal it: F_ADD_SEALS F_SEAL_SHRINK)"));
    }
    slot = *added;
  }
  const int keep = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (keep < 0) {
    absl::Status s = Errno("shm region: dup");
    SigbusGuard::Remove(slot);
    munmap(p, size);
    return s;
  }
  return std::shared_ptr<ShmMapping>(new ShmMapping(static_cast<uint8_t*>(p), size, keep, slot));
}

ShmMapping::~ShmMapping() {
  SigbusGuard::Remove(guard_slot_);
  munmap(data_, size_);
  close(fd_);
}

absl::Status ShmMapping::CheckIntact() const {
  if (guard_slot_ < 0) return absl::OkStatus();  // sealed: it cannot shrink
  struct stat st;
  if (fstat(fd_, &st) == 0 && uint64_t(st.st_size) < size_) {
    return absl::FailedPreconditionError(
        absl::StrCat("the region's file is ", st.st_size, " bytes now, ", size_,
                     " when it was registered (truncated by its owner); unregister it"));
  }
  if (SigbusGuard::Tripped(guard_slot_)) {
    return absl::FailedPreconditionError(
        "the region's file was truncated by its owner during a transfer: that transfer failed, "
        "and the region's mapping is lost for good; unregister it");
  }
  return absl::OkStatus();
}

absl::Status ShmMapping::CheckAllocated(uint64_t offset, uint64_t length) const {
  if (length == 0) return absl::OkStatus();
  // NOTE: lseek(SEEK_HOLE) walks the file from `offset` to its first hole: to the end of a
  // region with none, a cost that grows with the region (1.4 ms a call at 128 MiB, measured),
  // not with the slice. mincore over the slice's pages costs what the slice does; only a page it
  // reports missing is asked of SEEK_HOLE (a page swapped out is no hole: SEEK_HOLE tells).
  static const uint64_t kPage = uint64_t(sysconf(_SC_PAGESIZE));
  const uint64_t first = offset / kPage * kPage;
  // Whole pages: the mapping's last page is whole too, however long the region (mincore writes
  // one entry a page of the length, rounded up).
  auto round_up = [](uint64_t n) { return (n + kPage - 1) / kPage * kPage; };
  const uint64_t end = std::min(round_up(offset + length), round_up(size_));
  std::vector<unsigned char> resident((end - first) / kPage);
  if (mincore(data_ + first, end - first, resident.data()) == 0) {
    const auto missing = std::find_if(resident.begin(), resident.end(),
                                      [](unsigned char r) { return (r & 1) == 0; });
    if (missing == resident.end()) return absl::OkStatus();
    offset = std::max<uint64_t>(offset, first + uint64_t(missing - resident.begin()) * kPage);
  }
  const off_t hole = lseek(fd_, off_t(offset), SEEK_HOLE);
  if (hole >= 0 && uint64_t(hole) < offset + length) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the region has no page written at byte ", hole,
        " (punched out since it was registered): register a region whose pages are allocated"));
  }
  return absl::OkStatus();
}

}  // namespace kvbank::plane
