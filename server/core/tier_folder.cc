#include "server/core/tier_folder.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"

namespace kvbank {
namespace {

constexpr char kLockName[] = "kvbank.lock";
// Escaped model names up to this long are used whole; a file name may have 255 bytes.
constexpr size_t kMaxEscaped = 160;

std::string Escape(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-') {
      out.push_back(static_cast<char>(c));
    } else {
      absl::StrAppendFormat(&out, "_%02x", c);
    }
  }
  return out;
}

// Folders open in this process, by (device, inode): every tier in one folder shares one lock.
struct OpenFolders {
  absl::Mutex mu;
  std::map<std::pair<dev_t, ino_t>, std::weak_ptr<TierFolder>> by_inode ABSL_GUARDED_BY(mu);
};
OpenFolders& Registry() {
  static auto* r = new OpenFolders();
  return *r;
}

absl::Status Refuse(const std::string& what, const std::string& why) {
  return absl::FailedPreconditionError(absl::StrCat("disk tier ", what, ": ", why));
}

}  // namespace

std::string TierFileName(const std::string& model, const std::string& fingerprint) {
  std::string name = Escape(model);
  if (name.size() > kMaxEscaped) {
    const XXH128_hash_t h = XXH3_128bits(model.data(), model.size());
    name = absl::StrFormat("%s~%016x%016x", name.substr(0, kMaxEscaped - 40), h.high64, h.low64);
  }
  absl::StrAppendFormat(&name, "-%016x.kvbank-tier",
                        XXH3_64bits(fingerprint.data(), fingerprint.size()));
  return name;
}

absl::StatusOr<std::shared_ptr<TierFolder>> TierFolder::Open(const std::string& path) {
  if (path.empty()) return absl::InvalidArgumentError("disk tier folder: the path is empty");
  if (mkdir(path.c_str(), 0700) != 0 && errno != EEXIST) {
    return Refuse(absl::StrCat("folder ", path), std::strerror(errno));
  }
  const int dir = open(path.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (dir < 0) {
    return Refuse(absl::StrCat("folder ", path),
                  errno == ELOOP || errno == ENOTDIR
                      ? "not a folder (a symbolic link is not followed)"
                      : std::strerror(errno));
  }
  struct stat st;
  auto fail = [dir](absl::Status s) {
    close(dir);
    return s;
  };
  if (fstat(dir, &st) != 0)
    return fail(Refuse(absl::StrCat("folder ", path), std::strerror(errno)));
  // NOTE: anyone else who may write the folder could plant a file or a link where a tier file
  // goes, so the folder must be kvbankd's own.
  if (st.st_uid != geteuid()) {
    return fail(Refuse(absl::StrCat("folder ", path),
                       absl::StrCat("owned by uid ", st.st_uid, ", not kvbankd's (", geteuid(),
                                    "): give kvbankd a folder of its own")));
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    return fail(Refuse(absl::StrCat("folder ", path),
                       absl::StrFormat("mode %04o lets group or others write it (chmod go-w)",
                                       st.st_mode & 07777)));
  }
  OpenFolders& r = Registry();
  absl::MutexLock lock(&r.mu);
  auto& folders = r.by_inode;
  const auto key = std::make_pair(st.st_dev, st.st_ino);
  if (auto it = folders.find(key); it != folders.end()) {
    if (std::shared_ptr<TierFolder> open = it->second.lock()) {
      close(dir);
      return open;
    }
  }
  const int lock_fd = openat(dir, kLockName, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (lock_fd < 0) {
    return fail(Refuse(absl::StrCat("folder ", path),
                       absl::StrCat("its lock file: ", std::strerror(errno))));
  }
  if (flock(lock_fd, LOCK_EX | LOCK_NB) != 0) {
    const int e = errno;
    char pid[32] = {};
    const ssize_t n = pread(lock_fd, pid, sizeof(pid) - 1, 0);
    close(lock_fd);
    std::string holder = n > 0 ? std::string(absl::StripAsciiWhitespace(std::string(pid, n))) : "";
    return fail(Refuse(absl::StrCat("folder ", path),
                       e == EWOULDBLOCK
                           ? absl::StrCat("in use by another kvbankd",
                                          holder.empty() ? "" : absl::StrCat(" (pid ", holder, ")"),
                                          ": each server needs a folder of its own")
                           : absl::StrCat("locking it: ", std::strerror(e))));
  }
  const std::string mine = absl::StrCat(getpid(), "\n");
  if (ftruncate(lock_fd, 0) != 0 ||
      pwrite(lock_fd, mine.data(), mine.size(), 0) != ssize_t(mine.size())) {
    // The pid is only for the message another server prints; the lock is what counts.
  }
  std::shared_ptr<TierFolder> folder(new TierFolder(path, dir, lock_fd, st.st_dev, st.st_ino));
  folders[key] = folder;
  return folder;
}

TierFolder::~TierFolder() {
  {
    OpenFolders& r = Registry();
    absl::MutexLock lock(&r.mu);
    auto& folders = r.by_inode;
    auto it = folders.find(std::make_pair(dev_, ino_));
    if (it != folders.end() && it->second.expired()) folders.erase(it);
  }
  close(lock_fd_);  // releases the flock
  close(dir_fd_);
}

absl::StatusOr<std::unique_ptr<TierFile>> TierFolder::OpenFile(const std::string& name,
                                                               bool* direct) {
  const std::string path = absl::StrCat(path_, "/", name);
  {
    absl::MutexLock lock(&mu_);
    if (!open_.insert(name).second) {
      return Refuse(absl::StrCat("file ", path),
                    "open already in this server (a dropped model's tier, still held by calls "
                    "in flight): register the model again once they end");
    }
  }
  const int flags = O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC;
  int fd = -1;
  if (*direct) {
    fd = openat(dir_fd_, name.c_str(), flags | O_DIRECT, 0600);
    *direct = fd >= 0;
  }
  if (fd < 0) fd = openat(dir_fd_, name.c_str(), flags, 0600);  // tmpfs and others refuse O_DIRECT
  absl::Status bad;
  struct stat st;
  if (fd < 0) {
    bad = Refuse(absl::StrCat("file ", path),
                 errno == ELOOP ? "a symbolic link (not followed)" : std::strerror(errno));
  } else if (fstat(fd, &st) != 0) {
    bad = Refuse(absl::StrCat("file ", path), std::strerror(errno));
  } else if (!S_ISREG(st.st_mode) || st.st_uid != geteuid()) {
    bad = Refuse(absl::StrCat("file ", path),
                 "not a regular file of kvbankd's user: remove it or give another folder");
  }
  if (!bad.ok()) {
    if (fd >= 0) close(fd);
    Release(name);
    return bad;
  }
  return std::unique_ptr<TierFile>(new TierFile(shared_from_this(), name, fd));
}

void TierFolder::Release(const std::string& name) {
  absl::MutexLock lock(&mu_);
  open_.erase(name);
}

TierFile::~TierFile() {
  close(fd_);
  folder_->Release(name_);
}

}  // namespace kvbank
