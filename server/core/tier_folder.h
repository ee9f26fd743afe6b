// The folder a disk tier keeps its files in, opened so that nothing outside kvbankd can steer
// what a tier reads or writes:
//  - the folder is kvbankd's own: owned by its effective user, writable by nobody else (no
//    other user can plant a file or a symbolic link in it); created 0700 when missing;
//  - one kvbankd at a time: the folder's lock file (`kvbank.lock`, flock) is held as long as any
//    tier of this process uses the folder, and a second process is refused, naming the pid that
//    holds it;
//  - files are opened relative to the folder, never following a symbolic link, and must be
//    regular files of kvbankd's user;
//  - one tier per file in this process: a model dropped while calls still hold it keeps its
//    file until they end, and a model registered again under its name waits for that.
//
// File names are injective in the model's name (TierFileName): two models never share a file.
#ifndef KVBANK_SERVER_CORE_TIER_FOLDER_H_
#define KVBANK_SERVER_CORE_TIER_FOLDER_H_

#include <sys/types.h>

#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace kvbank {

// A tier file's name for `model` and the layout's `fingerprint`: every byte of the name that is
// not [A-Za-z0-9-] is escaped as _XX (hex; '_' itself too), so distinct names give distinct
// file names ("m.a" -> "m_2ea", "m_a" -> "m_5fa"). A name whose escape would be too long for a
// file name keeps its first bytes and adds a 128-bit hash of the whole name; either way each
// record names its model too, checked on every read, so a file never serves another model.
std::string TierFileName(const std::string& model, const std::string& fingerprint);

class TierFile;

// Thread-safe. Shared by every tier of this process in the same folder (Open returns the one
// already open); the lock is released when the last holder lets go.
class TierFolder : public std::enable_shared_from_this<TierFolder> {
 public:
  // Creates `path` (mode 0700) when missing, checks it and takes its lock. FAILED_PRECONDITION
  // naming the problem: not a folder (or a symbolic link), owned by another user, writable by
  // group or others, locked by another process.
  static absl::StatusOr<std::shared_ptr<TierFolder>> Open(const std::string& path);
  ~TierFolder();
  TierFolder(const TierFolder&) = delete;
  TierFolder& operator=(const TierFolder&) = delete;

  const std::string& path() const { return path_; }
  // Opens (creating, mode 0600) file `name` of this folder for reading and writing; `direct`:
  // with O_DIRECT, falling back to buffered I/O where the filesystem refuses it (*direct is then
  // false). FAILED_PRECONDITION when it is a symbolic link or anything but a regular file of
  // kvbankd's user, or is open already in this process (a dropped model's tier still held).
  absl::StatusOr<std::unique_ptr<TierFile>> OpenFile(const std::string& name, bool* direct);

 private:
  friend class TierFile;
  TierFolder(std::string path, int dir_fd, int lock_fd, dev_t dev, ino_t ino)
      : path_(std::move(path)), dir_fd_(dir_fd), lock_fd_(lock_fd), dev_(dev), ino_(ino) {}
  void Release(const std::string& name);

  const std::string path_;
  const int dir_fd_;
  const int lock_fd_;
  const dev_t dev_;
  const ino_t ino_;
  absl::Mutex mu_;
  absl::flat_hash_set<std::string> open_ ABSL_GUARDED_BY(mu_);  // file names in use here
};

// An open tier file: its descriptor, and its folder held (and locked) while it lives.
class TierFile {
 public:
  ~TierFile();
  TierFile(const TierFile&) = delete;
  TierFile& operator=(const TierFile&) = delete;
  int fd() const { return fd_; }
  const std::string& path() const { return path_; }

 private:
  friend class TierFolder;
  TierFile(std::shared_ptr<TierFolder> folder, std::string name, int fd)
      : folder_(std::move(folder)),
        name_(std::move(name)),
        path_(folder_->path() + "/" + name_),
        fd_(fd) {}
  const std::shared_ptr<TierFolder> folder_;
  const std::string name_;
  const std::string path_;
  const int fd_;
};

}  // namespace kvbank

#endif  // KVBANK_SERVER_CORE_TIER_FOLDER_H_
