#include "server/core/tiers.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/core/core_lock.h"
#include "server/core/tier_folder.h"

namespace kvbank {
namespace {

constexpr uint64_t kIoAlign = 4096;
// Version 2 names the model in every record; a version-1 file's slots read as never written.
constexpr char kMagic[8] = {'K', 'V', 'B', 'T', 'I', 'E', 'R', '2'};
constexpr uint32_t kMaxName = 255;   // tenant and LoRA names a disk record keeps
constexpr uint32_t kMaxModel = 128;  // model names (ModelRegistry's limit)
// Fixed part of a slot header; tenant, LoRA and token ids follow, the header's checksum ends it.
constexpr uint64_t kFixedHeader = 128;

template <typename T>
void PutAt(uint8_t* buf, uint64_t at, T v) {
  std::memcpy(buf + at, &v, sizeof(T));
}
template <typename T>
T GetAt(const uint8_t* buf, uint64_t at) {
  T v;
  std::memcpy(&v, buf + at, sizeof(T));
  return v;
}

}  // namespace

const char* TierMedium(Tier t) {
  switch (t) {
    case Tier::kPool:
      return "pool";
    case Tier::kHost:
      return "host";
    case Tier::kDisk:
      return "disk";
  }
  return "?";
}

TierCache::TierCache(const BlockLayout& layout, std::string model, TierOptions options,
                     KvEventLog* events)
    : model_(std::move(model)),
      block_bytes_(layout.block_bytes),
      block_tokens_(layout.block_tokens),
      options_(std::move(options)),
      events_(events) {}

absl::StatusOr<std::unique_ptr<TierCache>> TierCache::Open(const BlockLayout& layout,
                                                           const std::string& model,
                                                           const std::string& fingerprint,
                                                           TierOptions options,
                                                           KvEventLog* events) {
  if (model.empty() || model.size() > kMaxModel) {
    return absl::InvalidArgumentError(
        absl::StrCat("tiers: model name must be 1 to ", kMaxModel, " bytes"));
  }
  std::unique_ptr<TierCache> t(new TierCache(layout, model, std::move(options), events));
  const TierOptions& o = t->options_;
  t->layout_key_ = XXH3_64bits(fingerprint.data(), fingerprint.size());
  if (o.host_bytes > 0) {
    t->host_capacity_ = o.host_bytes / layout.block_bytes;
    if (t->host_capacity_ == 0) {
      return absl::InvalidArgumentError(absl::StrCat("host tier of ", o.host_bytes,
                                                     " bytes holds no block of ",
                                                     layout.block_bytes, " bytes"));
    }
    auto mem = CreateHostMemory(t->host_capacity_ * layout.block_bytes, o.prefault_host);
    if (!mem.ok()) return mem.status();
    t->host_ = *std::move(mem);
    absl::MutexLock lock(&t->mu_);
    for (uint64_t i = t->host_capacity_; i > 0; --i) t->host_free_.push_back(i - 1);
  }
  if (!o.disk_path.empty()) {
    if (absl::Status s = t->OpenDisk(fingerprint); !s.ok()) return s;
    t->LoadDisk();
    const uint32_t n = std::max<uint32_t>(1, o.io_threads);
    for (uint32_t i = 0; i < n; ++i) t->io_threads_.emplace_back([p = t.get()] { p->IoLoop(); });
    t->io_threads_.emplace_back([p = t.get()] { p->ScrubLoop(); });
  }
  return t;
}

TierCache::~TierCache() {
  WaitForWrites(absl::InfiniteFuture());
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  for (std::thread& th : io_threads_) th.join();
  if (fd_ >= 0) fdatasync(fd_);  // file_ closes it
}

absl::Status TierCache::OpenDisk(const std::string& fingerprint) {
  const TierOptions& o = options_;
  header_bytes_ =
      AlignUp(kFixedHeader + kMaxModel + 2 * kMaxName + 4ull * block_tokens_ + 8, kIoAlign);
  slot_bytes_ = header_bytes_ + AlignUp(block_bytes_, kIoAlign);
  disk_capacity_ = o.disk_bytes / slot_bytes_;
  if (disk_capacity_ == 0) {
    return absl::InvalidArgumentError(absl::StrCat("disk tier of ", o.disk_bytes,
                                                   " bytes holds no block of ", slot_bytes_,
                                                   " bytes (header and block, 4 KiB-aligned)"));
  }
  auto folder = TierFolder::Open(o.disk_path);
  if (!folder.ok()) return folder.status();
  direct_ = o.direct_io;
  auto file = (*folder)->OpenFile(TierFileName(model_, fingerprint), &direct_);
  if (!file.ok()) return file.status();
  file_ = *std::move(file);
  fd_ = file_->fd();
  disk_file_ = file_->path();
  // The file keeps its slots across restarts: it grows to the configured size (sparse until
  // written) and shrinks when the size shrank (the slots past it are gone).
  if (ftruncate(fd_, off_t(disk_capacity_ * slot_bytes_)) != 0) {
    const int e = errno;
    file_.reset();
    fd_ = -1;
    return absl::FailedPreconditionError(
        absl::StrCat("disk tier file ", disk_file_, ": sizing it: ", std::strerror(e)));
  }
  return absl::OkStatus();
}

std::shared_ptr<uint8_t> TierCache::NewBuffer() const {
  void* p = std::aligned_alloc(kIoAlign, slot_bytes_);
  return std::shared_ptr<uint8_t>(static_cast<uint8_t*>(p), [](uint8_t* q) { std::free(q); });
}

void TierCache::Encode(const PublishInfo& info, const std::string& tenant, uint64_t generation,
                       const uint8_t* data, uint8_t* buf) const {
  std::memset(buf, 0, header_bytes_);
  std::memcpy(buf, kMagic, sizeof(kMagic));
  PutAt<uint32_t>(buf, 8, uint32_t(header_bytes_));
  PutAt<uint64_t>(buf, 16, block_bytes_);
  PutAt<uint64_t>(buf, 24, layout_key_);
  PutAt<uint64_t>(buf, 32, generation);
  PutAt<uint64_t>(buf, 40, XXH3_64bits(data, block_bytes_));
  PutAt<uint8_t>(buf, 48, info.has_parent ? 1 : 0);
  PutAt<uint8_t>(buf, 49, info.priority);
  PutAt<uint16_t>(buf, 50, uint16_t(tenant.size()));
  PutAt<uint16_t>(buf, 52, uint16_t(info.lora.size()));
  PutAt<uint16_t>(buf, 54, uint16_t(model_.size()));
  PutAt<uint32_t>(buf, 56, uint32_t(info.token_ids.size()));
  std::memcpy(buf + 64, info.hash.data(), 32);
  std::memcpy(buf + 96, info.parent.data(), 32);
  uint64_t at = kFixedHeader;
  std::memcpy(buf + at, model_.data(), model_.size());
  at += model_.size();
  std::memcpy(buf + at, tenant.data(), tenant.size());
  at += tenant.size();
  std::memcpy(buf + at, info.lora.data(), info.lora.size());
  at += info.lora.size();
  std::memcpy(buf + at, info.token_ids.data(), 4 * info.token_ids.size());
  PutAt<uint64_t>(buf, header_bytes_ - 8, XXH3_64bits(buf, header_bytes_ - 8));
  std::memcpy(buf + header_bytes_, data, block_bytes_);
  std::memset(buf + header_bytes_ + block_bytes_, 0, slot_bytes_ - header_bytes_ - block_bytes_);
}

bool TierCache::Decode(const uint8_t* header, const uint8_t* data, PublishInfo* info,
                       std::string* tenant, uint64_t* generation) const {
  const uint8_t* buf = header;
  if (std::memcmp(buf, kMagic, sizeof(kMagic)) != 0) return false;
  if (GetAt<uint32_t>(buf, 8) != header_bytes_ || GetAt<uint64_t>(buf, 16) != block_bytes_ ||
      GetAt<uint64_t>(buf, 24) != layout_key_) {
    return false;
  }
  if (GetAt<uint64_t>(buf, header_bytes_ - 8) != XXH3_64bits(buf, header_bytes_ - 8)) return false;
  const uint16_t tenant_len = GetAt<uint16_t>(buf, 50), lora_len = GetAt<uint16_t>(buf, 52);
  const uint16_t model_len = GetAt<uint16_t>(buf, 54);
  const uint32_t tokens = GetAt<uint32_t>(buf, 56);
  if (tenant_len > kMaxName || lora_len > kMaxName || tokens != block_tokens_) return false;
  // A record of another model (a file copied or renamed by hand) is foreign, whatever its layout.
  if (model_len != model_.size() ||
      std::memcmp(buf + kFixedHeader, model_.data(), model_len) != 0) {
    return false;
  }
  if (data != nullptr && GetAt<uint64_t>(buf, 40) != XXH3_64bits(data, block_bytes_)) return false;
  *generation = GetAt<uint64_t>(buf, 32);
  info->has_parent = GetAt<uint8_t>(buf, 48) != 0;
  info->priority = GetAt<uint8_t>(buf, 49);
  std::memcpy(info->hash.data(), buf + 64, 32);
  std::memcpy(info->parent.data(), buf + 96, 32);
  uint64_t at = kFixedHeader + model_len;
  tenant->assign(reinterpret_cast<const char*>(buf + at), tenant_len);
  at += tenant_len;
  info->lora.assign(reinterpret_cast<const char*>(buf + at), lora_len);
  at += lora_len;
  info->token_ids.resize(tokens);
  std::memcpy(info->token_ids.data(), buf + at, 4ull * tokens);
  return true;
}

bool TierCache::ReadSlot(uint64_t slot, uint8_t* buf, uint8_t* dst, PublishInfo* info,
                         std::string* tenant, uint64_t* generation) const {
  const off_t at = off_t(slot * slot_bytes_);
  // Straight into the destination when O_DIRECT can take it there (a 4 KiB-aligned block of
  // whole 4 KiB pages): one call, no copy.
  if (dst != nullptr && reinterpret_cast<uintptr_t>(dst) % kIoAlign == 0 &&
      block_bytes_ % kIoAlign == 0) {
    iovec iov[2] = {{buf, header_bytes_}, {dst, block_bytes_}};
    ssize_t n;
    do {
      n = preadv(fd_, iov, 2, at);
    } while (n < 0 && errno == EINTR);
    if (n != ssize_t(header_bytes_ + block_bytes_)) return false;
    return Decode(buf, dst, info, tenant, generation);
  }
  uint64_t done = 0;
  while (done < slot_bytes_) {
    const ssize_t n = pread(fd_, buf + done, slot_bytes_ - done, at + off_t(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += uint64_t(n);
  }
  if (!Decode(buf, buf + header_bytes_, info, tenant, generation)) return false;
  if (dst != nullptr) std::memcpy(dst, buf + header_bytes_, block_bytes_);
  return true;
}

void TierCache::LoadDisk() {
  // Every slot's header, read by the I/O threads in parallel: a slot whose header is whole is
  // indexed now, and its bytes are checked by the scrubber in the background (and again on every
  // read), so a start costs one header read a slot, not a read of the whole tier. A block whose
  // bytes fail is never served.
  struct Found {
    Key key;
    uint64_t slot, generation;
    PublishInfo info;
  };
  const uint32_t threads = std::max<uint32_t>(1, options_.io_threads);
  std::vector<std::vector<Found>> found_by(threads);
  std::vector<uint64_t> invalid_by(threads, 0);
  auto scan = [&](uint32_t t) {
    void* p = std::aligned_alloc(kIoAlign, header_bytes_);
    uint8_t* buf = static_cast<uint8_t*>(p);
    for (uint64_t slot = t; slot < disk_capacity_; slot += threads) {
      if (pread(fd_, buf, header_bytes_, off_t(slot * slot_bytes_)) != ssize_t(header_bytes_)) {
        continue;
      }
      if (std::memcmp(buf, kMagic, sizeof(kMagic)) != 0) continue;  // never written
      Found f;
      std::string tenant;
      if (!Decode(buf, nullptr, &f.info, &tenant, &f.generation)) {
        ++invalid_by[t];
        continue;
      }
      f.key = Key{f.info.hash, std::move(tenant)};
      f.slot = slot;
      found_by[t].push_back(std::move(f));
    }
    std::free(p);
  };
  {
    std::vector<std::thread> pool;
    for (uint32_t t = 1; t < threads; ++t) pool.emplace_back(scan, t);
    scan(0);
    for (std::thread& th : pool) th.join();
  }
  std::vector<Found> found;
  uint64_t invalid = 0;
  for (uint32_t t = 0; t < threads; ++t) {
    invalid += invalid_by[t];
    for (Found& f : found_by[t]) found.push_back(std::move(f));
  }
  // Oldest first into the LRU's front, so the newest ends at the front; a hash found twice (a
  // kill between writing a block again and freeing its old slot) keeps its newest record.
  std::sort(found.begin(), found.end(),
            [](const Found& a, const Found& b) { return a.generation < b.generation; });
  absl::MutexLock lock(&mu_);
  std::vector<bool> used(disk_capacity_, false);
  for (const Found& f : found) {
    auto it = disk_index_.find(f.key);
    if (it != disk_index_.end()) {
      used[it->second.slot] = false;
      disk_lru_.erase(it->second.lru);
      disk_index_.erase(it);
    }
    disk_lru_.push_front(f.key);
    disk_index_[f.key] = DiskEntry{f.slot, f.generation, 0, /*verified=*/false, disk_lru_.begin()};
    used[f.slot] = true;
    next_generation_ = std::max(next_generation_, f.generation + 1);
  }
  for (uint64_t s = disk_capacity_; s > 0; --s) {
    if (!used[s - 1]) disk_free_.push_back(s - 1);
  }
  stats_.loaded = disk_index_.size();
  stats_.load_invalid = invalid;
  unverified_ = disk_index_.size();
  // Most recently written first: the blocks most likely asked for soon are checked first.
  scrub_keys_.assign(disk_lru_.begin(), disk_lru_.end());
  // What a watcher's index needs to know the restarted server holds (oldest first).
  for (const Found& f : found) {
    auto it = disk_index_.find(f.key);
    if (it != disk_index_.end() && it->second.slot == f.slot) {
      EmitLocked(KvEvent::Type::kBlockStored, f.key, &f.info, Tier::kDisk);
    }
  }
}

void TierCache::ScrubLoop() {
  // Checks the bytes of every block indexed at start, one at a time, as a read does.
  std::shared_ptr<uint8_t> buf = NewBuffer();
  for (size_t i = 0;; ++i) {
    Key key;
    uint64_t slot = 0;
    {
      absl::MutexLock lock(&mu_);
      if (stop_ || i >= scrub_keys_.size()) break;
      auto it = disk_index_.find(scrub_keys_[i]);
      if (it == disk_index_.end() || it->second.verified) continue;
      ++it->second.readers;
      key = it->first;
      slot = it->second.slot;
    }
    PublishInfo info;
    std::string tenant;
    uint64_t generation = 0;
    const bool ok = ReadSlot(slot, buf.get(), nullptr, &info, &tenant, &generation) &&
                    info.hash == key.hash && tenant == key.tenant;
    absl::MutexLock lock(&mu_);
    auto it = disk_index_.find(key);
    if (it == disk_index_.end()) continue;
    --it->second.readers;
    if (ok) {
      if (!it->second.verified) --unverified_;
      it->second.verified = true;
    } else {
      ++stats_.load_invalid;  // written before the start, torn or corrupt
      EraseDiskLocked(key, /*emit=*/true);
    }
  }
  absl::MutexLock lock(&mu_);
  scrub_keys_.clear();
  scrub_keys_.shrink_to_fit();
}

bool TierCache::WaitForScrub(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  return mu_.AwaitWithDeadline(
      absl::Condition(
          +[](TierCache* t) ABSL_NO_THREAD_SAFETY_ANALYSIS { return t->unverified_ == 0; }, this),
      deadline);
}

void TierCache::EmitLocked(KvEvent::Type type, const Key& key, const PublishInfo* info, Tier tier) {
  if (events_ == nullptr) return;
  KvEvent e;
  e.type = type;
  e.time = absl::Now();
  e.tenant = key.tenant;
  e.hashes.push_back(key.hash);
  if (type == KvEvent::Type::kBlockStored && info != nullptr) {
    e.has_parent = info->has_parent;
    e.parent = info->parent;
    e.token_ids = info->token_ids;
    e.lora = info->lora;
  }
  e.block_tokens = block_tokens_;
  e.medium = TierMedium(tier);
  events_->Append(std::move(e));
}

TierCache::Put TierCache::PutLocked(const Key& key, const PublishInfo& info,
                                    const std::function<const uint8_t*()>& data, bool eviction) {
  // Inclusive: a copy in any tier below is the block (one promoted from the disk, say, or moved
  // there as a host victim since its spill-ahead). An eviction makes it its tier's most recently
  // used; nothing is copied.
  if (auto it = host_index_.find(key); it != host_index_.end()) {
    if (eviction) host_lru_.splice(host_lru_.begin(), host_lru_, it->second.lru);
    return Put::kHeld;
  }
  if (auto it = disk_index_.find(key); it != disk_index_.end()) {
    if (eviction) disk_lru_.splice(disk_lru_.begin(), disk_lru_, it->second.lru);
    return Put::kHeld;
  }
  if (queued_.contains(key)) return Put::kHeld;
  if (has_host()) {
    const uint8_t* bytes = data();
    if (bytes == nullptr) return Put::kHeld;
    PutHostLocked(key, std::make_shared<const PublishInfo>(info), bytes);
    return Put::kCopied;
  }
  if (!has_disk()) return Put::kHeld;
  if (!eviction && QueueFullLocked()) return Put::kFull;  // the spill-ahead tries again later
  const uint8_t* bytes = data();
  if (bytes == nullptr) return Put::kHeld;
  return QueueDiskWriteLocked(key, std::make_shared<const PublishInfo>(info), bytes) ? Put::kCopied
                                                                                     : Put::kHeld;
}

void TierCache::Evicted(const PublishInfo& info, const std::string& tenant,
                        const std::function<const uint8_t*()>& data) {
  CheckNoCoreLock("an eviction into a tier");
  absl::MutexLock lock(&mu_);
  if (PutLocked(Key{info.hash, tenant}, info, data, /*eviction=*/true) == Put::kCopied) {
    ++stats_.spilled_at_eviction;
  }
}

bool TierCache::Spill(const PublishInfo& info, const std::string& tenant, const uint8_t* data) {
  CheckNoCoreLock("a spill into a tier");
  absl::MutexLock lock(&mu_);
  return PutLocked(
             Key{info.hash, tenant}, info, [data] { return data; },
             /*eviction=*/false) != Put::kFull;
}

bool TierCache::QueueFullLocked() const {
  return (queue_.size() + writing_ + 1) * slot_bytes_ > options_.max_queued_bytes &&
         queue_.size() + writing_ > 0;
}

void TierCache::PutHostLocked(const Key& key, std::shared_ptr<const PublishInfo> info,
                              const uint8_t* data) {
  if (host_free_.empty()) {
    // The least recently used host block goes to the disk (unless it is there) or is forgotten.
    const Key victim = host_lru_.back();
    HostEntry& v = host_index_[victim];
    if (has_disk() && !disk_index_.contains(victim) && !queued_.contains(victim)) {
      QueueDiskWriteLocked(victim, v.info, HostSlot(v.slot));
    }
    EmitLocked(KvEvent::Type::kBlockRemoved, victim, nullptr, Tier::kHost);
    host_free_.push_back(v.slot);
    host_lru_.pop_back();
    host_index_.erase(victim);
  }
  const uint64_t slot = host_free_.back();
  host_free_.pop_back();
  std::memcpy(HostSlot(slot), data, block_bytes_);
  host_lru_.push_front(key);
  EmitLocked(KvEvent::Type::kBlockStored, key, info.get(), Tier::kHost);
  host_index_[key] = HostEntry{slot, std::move(info), host_lru_.begin()};
  ++stats_.spilled_to_host;
}

bool TierCache::QueueDiskWriteLocked(const Key& key, std::shared_ptr<const PublishInfo> info,
                                     const uint8_t* data) {
  if (!Fits(key.tenant, *info)) return false;
  if (QueueFullLocked()) {
    ++stats_.spill_dropped;
    return false;
  }
  WriteJob job{key, std::move(info), NewBuffer()};
  // The generation goes in when the slot is taken; the bytes are encoded now (the source is
  // reused after this call).
  Encode(*job.info, key.tenant, 0, data, job.buffer.get());
  queued_.emplace(key, std::move(job));
  queue_.push_back(key);
  return true;
}

std::optional<uint64_t> TierCache::TakeDiskSlotLocked() {
  if (!disk_free_.empty()) {
    const uint64_t s = disk_free_.back();
    disk_free_.pop_back();
    return s;
  }
  for (auto it = disk_lru_.rbegin(); it != disk_lru_.rend(); ++it) {
    auto e = disk_index_.find(*it);
    if (e->second.readers > 0) continue;
    const uint64_t s = e->second.slot;
    const Key victim = *it;  // the list node goes with the entry
    EraseDiskLocked(victim, /*emit=*/true);
    disk_free_.pop_back();  // EraseDiskLocked freed it
    return s;
  }
  return std::nullopt;
}

void TierCache::EraseDiskLocked(const Key& key, bool emit) {
  auto it = disk_index_.find(key);
  if (it == disk_index_.end()) return;
  if (emit) EmitLocked(KvEvent::Type::kBlockRemoved, key, nullptr, Tier::kDisk);
  if (!it->second.verified) --unverified_;
  disk_free_.push_back(it->second.slot);
  disk_lru_.erase(it->second.lru);
  disk_index_.erase(it);
}

bool TierCache::Fits(const std::string& tenant, const PublishInfo& info) const {
  return tenant.size() <= kMaxName && info.lora.size() <= kMaxName &&
         info.token_ids.size() == block_tokens_;
}

std::optional<TierCache::Reserved> TierCache::ReserveSlotLocked() {
  auto slot = TakeDiskSlotLocked();
  if (!slot.has_value()) return std::nullopt;
  ++writing_;
  return Reserved{*slot, next_generation_++};
}

bool TierCache::WriteRecord(const Reserved& r, uint8_t* buf) const {
  // The generation orders two records of one hash at load: the header is sealed with it here.
  PutAt<uint64_t>(buf, 32, r.generation);
  PutAt<uint64_t>(buf, header_bytes_ - 8, XXH3_64bits(buf, header_bytes_ - 8));
  uint64_t done = 0;
  while (done < slot_bytes_) {
    const ssize_t n =
        pwrite(fd_, buf + done, slot_bytes_ - done, off_t(r.slot * slot_bytes_ + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += uint64_t(n);
  }
  return true;
}

bool TierCache::FinishWriteLocked(const Key& key, const PublishInfo& info, const Reserved& r,
                                  bool ok) {
  --writing_;
  if (!ok) {
    disk_free_.push_back(r.slot);
    return false;
  }
  stats_.disk_bytes_written += slot_bytes_;
  ++stats_.spilled_to_disk;
  if (disk_index_.contains(key)) EraseDiskLocked(key, /*emit=*/false);
  disk_lru_.push_front(key);
  disk_index_[key] = DiskEntry{r.slot, r.generation, 0, /*verified=*/true, disk_lru_.begin()};
  EmitLocked(KvEvent::Type::kBlockStored, key, &info, Tier::kDisk);
  return true;
}

void TierCache::IoLoop() {
  for (;;) {
    WriteJob job;
    Reserved r;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](TierCache* t)
               ABSL_NO_THREAD_SAFETY_ANALYSIS { return t->stop_ || !t->queue_.empty(); },
          this));
      if (queue_.empty()) return;  // stop_ and nothing left
      const Key key = queue_.front();
      queue_.pop_front();
      auto it = queued_.find(key);
      auto reserved = ReserveSlotLocked();
      if (!reserved.has_value()) {  // every slot is being read: forgotten
        ++stats_.spill_dropped;
        queued_.erase(it);
        continue;
      }
      r = *reserved;
      job = it->second;  // stays in queued_ (readable) until written
    }
    const bool ok = WriteRecord(r, job.buffer.get());
    absl::MutexLock lock(&mu_);
    queued_.erase(job.key);
    if (!FinishWriteLocked(job.key, *job.info, r, ok)) ++stats_.spill_dropped;
  }
}

bool TierCache::WriteToDisk(const PublishInfo& info, const std::string& tenant,
                            const uint8_t* data) {
  CheckNoCoreLock("a write to the disk tier");
  if (!has_disk() || !Fits(tenant, info)) return false;
  const Key key{info.hash, tenant};
  std::shared_ptr<uint8_t> buf = NewBuffer();
  Reserved r;
  {
    absl::MutexLock lock(&mu_);
    if (disk_index_.contains(key) || queued_.contains(key)) return false;
    auto reserved = ReserveSlotLocked();
    if (!reserved.has_value()) return false;
    r = *reserved;
  }
  Encode(info, tenant, r.generation, data, buf.get());
  const bool ok = WriteRecord(r, buf.get());
  absl::MutexLock lock(&mu_);
  return FinishWriteLocked(key, info, r, ok);
}

size_t TierCache::FlushHostToDisk(absl::Time deadline) {
  if (!has_host() || !has_disk()) return 0;
  std::shared_ptr<uint8_t> buf = NewBuffer();
  size_t n = 0;
  std::vector<Key> keys;
  {
    absl::MutexLock lock(&mu_);
    keys.assign(host_lru_.begin(), host_lru_.end());
  }
  for (const Key& k : keys) {
    if (absl::Now() >= deadline) break;
    std::shared_ptr<const PublishInfo> info;
    Reserved r;
    {
      // The record is encoded straight from the host slot (one copy), under the lock that keeps
      // the slot as it is.
      absl::MutexLock lock(&mu_);
      auto it = host_index_.find(k);
      if (it == host_index_.end() || disk_index_.contains(k) || queued_.contains(k) ||
          !Fits(k.tenant, *it->second.info)) {
        continue;
      }
      auto reserved = ReserveSlotLocked();
      if (!reserved.has_value()) break;
      r = *reserved;
      info = it->second.info;
      Encode(*info, k.tenant, r.generation, HostSlot(it->second.slot), buf.get());
    }
    const bool ok = WriteRecord(r, buf.get());
    absl::MutexLock lock(&mu_);
    n += FinishWriteLocked(k, *info, r, ok);
  }
  return n;
}

bool TierCache::WaitForWrites(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  return mu_.AwaitWithDeadline(absl::Condition(
                                   +[](TierCache* t) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                                     return t->queue_.empty() && t->writing_ == 0;
                                   },
                                   this),
                               deadline);
}

absl::Status TierCache::Sync() {
  if (fd_ >= 0 && fdatasync(fd_) != 0) {
    return absl::InternalError(absl::StrCat("disk tier ", disk_file_, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

std::optional<Tier> TierCache::Find(const BlockHash& hash, const std::string& tenant) const {
  const Key key{hash, tenant};
  absl::MutexLock lock(&mu_);
  if (host_index_.contains(key)) return Tier::kHost;
  if (disk_index_.contains(key) || queued_.contains(key)) return Tier::kDisk;
  return std::nullopt;
}

std::optional<uint64_t> TierCache::DiskSlotOf(const BlockHash& hash,
                                              const std::string& tenant) const {
  absl::MutexLock lock(&mu_);
  auto it = disk_index_.find(Key{hash, tenant});
  if (it == disk_index_.end()) return std::nullopt;
  return it->second.slot;
}

size_t TierCache::CountChain(absl::Span<const BlockHash> hashes, const std::string& tenant) const {
  absl::MutexLock lock(&mu_);
  size_t n = 0;
  for (const BlockHash& h : hashes) {
    const Key key{h, tenant};
    if (!host_index_.contains(key) && !disk_index_.contains(key) && !queued_.contains(key)) break;
    ++n;
  }
  return n;
}

std::vector<TierBlock> TierCache::ReadChain(absl::Span<const BlockHash> hashes,
                                            const std::string& tenant,
                                            absl::Span<uint8_t* const> dst) {
  CheckNoCoreLock("a read from a tier");
  // Under the lock: host blocks and queued ones are copied now; disk blocks are marked as being
  // read (their slots stay) and read after it, in parallel.
  std::vector<TierBlock> out;
  struct DiskRead {
    size_t index;
    Key key;
    uint64_t slot;
    bool ok = false;
  };
  std::vector<DiskRead> reads;
  {
    absl::MutexLock lock(&mu_);
    for (size_t i = 0; i < hashes.size(); ++i) {
      const Key key{hashes[i], tenant};
      uint8_t* to = dst[i];
      if (auto h = host_index_.find(key); h != host_index_.end()) {
        std::memcpy(to, HostSlot(h->second.slot), block_bytes_);
        host_lru_.splice(host_lru_.begin(), host_lru_, h->second.lru);
        out.push_back({*h->second.info, Tier::kHost});
        continue;
      }
      if (auto q = queued_.find(key); q != queued_.end()) {
        std::memcpy(to, q->second.buffer.get() + header_bytes_, block_bytes_);
        out.push_back({*q->second.info, Tier::kDisk});
        continue;
      }
      auto d = disk_index_.find(key);
      if (d == disk_index_.end()) break;
      ++d->second.readers;
      reads.push_back({i, key, d->second.slot});
      out.push_back({PublishInfo(), Tier::kDisk});
    }
  }
  if (!reads.empty()) {
    const size_t threads =
        std::min<size_t>(std::max<uint32_t>(1, options_.io_threads), reads.size());
    std::vector<PublishInfo> infos(reads.size());
    auto work = [&](size_t first) {
      std::shared_ptr<uint8_t> buf = NewBuffer();
      for (size_t r = first; r < reads.size(); r += threads) {
        std::string t;
        uint64_t generation = 0;
        DiskRead& d = reads[r];
        d.ok = ReadSlot(d.slot, buf.get(), dst[d.index], &infos[r], &t, &generation) &&
               infos[r].hash == d.key.hash && t == tenant;
      }
    };
    std::vector<std::thread> pool;
    for (size_t t = 1; t < threads; ++t) pool.emplace_back(work, t);
    work(0);
    for (std::thread& th : pool) th.join();
    absl::MutexLock lock(&mu_);
    size_t keep = out.size();
    for (size_t r = 0; r < reads.size(); ++r) {
      DiskRead& d = reads[r];
      auto it = disk_index_.find(d.key);
      if (it != disk_index_.end()) --it->second.readers;
      if (d.ok) {
        stats_.disk_bytes_read += slot_bytes_;
        out[d.index].info = std::move(infos[r]);
        if (it != disk_index_.end()) {
          disk_lru_.splice(disk_lru_.begin(), disk_lru_, it->second.lru);
          if (!it->second.verified) --unverified_;
          it->second.verified = true;
        }
        continue;
      }
      // Torn or corrupt: never served, and gone from the tier.
      ++stats_.corrupt;
      EraseDiskLocked(d.key, /*emit=*/true);
      keep = std::min(keep, d.index);
    }
    out.resize(keep);
  }
  {
    absl::MutexLock lock(&mu_);
    for (const TierBlock& b : out) {
      if (b.from == Tier::kHost) {
        ++stats_.promoted_from_host;
      } else {
        ++stats_.promoted_from_disk;
      }
    }
  }
  return out;
}

TierStats TierCache::Stats() const {
  absl::MutexLock lock(&mu_);
  TierStats s = stats_;
  s.host_blocks = host_index_.size();
  s.host_capacity = host_capacity_;
  s.disk_blocks = disk_index_.size();
  s.disk_capacity = disk_capacity_;
  s.queued = queue_.size() + writing_;
  s.unverified = unverified_;
  s.direct_io = direct_;
  return s;
}

}  // namespace kvbank
