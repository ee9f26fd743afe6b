// SequenceStore under concurrent use of the same sequences: threads share a few sequence slots
// and run append (whole, chunked, or abandoned before commit), fetch, fork, truncate, free,
// renew and get on them at random, from fixed seeds that are printed. Every payload row carries
// the append that wrote it (a tag), its token index in that append, its layer, part and head,
// and bytes derived from all of these, so any fetch can be checked: each row must come from an
// append that committed, to the fetched sequence or one it was forked from, at exactly the
// fetched position; not from an append to the parent that began after the fork returned (copy
// on write), nor from one that a truncate below that position, finished before the fetch
// began, had already cut off. Meanwhile and at the end: CheckInvariants() is empty, and the
// pool's free + cached + used blocks are its total; once every sequence is freed, no block is
// used.
// Bounded in operations and in time; runs under ThreadSanitizer (preset tsan).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "kvbank/layout.h"
#include "server/core/sequence_store.h"
#include "tests/unit/store_testing.h"
#include "tests/unit/test_memory.h"

namespace kvbank {
namespace {

constexpr uint32_t kLayers = 3;
constexpr uint32_t kHeads = 2;
constexpr uint32_t kHeadDim = 8;  // fp16: 16-byte rows
constexpr uint64_t kRowBytes = kHeadDim * 2;
constexpr int kThreads = 4;
constexpr int kSlots = 3;
constexpr int kOpsPerThread = 20000;
constexpr auto kTimeBudget = std::chrono::seconds(40);  // per run; TSan is ~10x slower
constexpr uint64_t kMaxTokens = 40;

ModelLayout Layout() {
  return store_testing::GqaLayout("concurrency", kLayers, kHeads, kHeadDim, 4, DType::kFp16);
}

uint64_t Mix(uint64_t x) {  // splitmix64
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// One row: [u32 tag][u16 index in the append][u8 layer][u8 part << 4 | head][u64 check].
struct Row {
  uint32_t tag = 0;
  uint16_t index = 0;
  uint8_t layer = 0;
  uint8_t part_head = 0;
  uint64_t Check() const {
    return Mix(uint64_t{tag} << 32 | uint64_t{index} << 16 | uint64_t{layer} << 8 | part_head);
  }
};
static_assert(sizeof(Row) + sizeof(uint64_t) == kRowBytes);

void WriteRow(const Row& r, uint8_t* at) {
  std::memcpy(at, &r, sizeof(r));
  const uint64_t c = r.Check();
  std::memcpy(at + sizeof(r), &c, sizeof(c));
}

// Offset of (layer i of the payload, part, head, token t) in a dense fp16 payload of n tokens.
uint64_t RowOffset(uint32_t i, int part, uint32_t h, uint64_t t, uint64_t n) {
  const uint64_t part_bytes = uint64_t{kHeads} * n * kRowBytes;
  return (uint64_t{i} * 2 + part) * part_bytes + (h * n + t) * kRowBytes;
}

// Stamps of one logical clock order what the threads did: a stamp taken after a call returned
// is above every stamp taken before the call began.
struct Committed {
  uint64_t seq = 0;
  uint64_t start = 0;  // sequence position of its token 0
  uint64_t n = 0;
  uint64_t begun = 0;  // stamp taken before BeginAppend
  uint64_t done = 0;   // stamp taken after Commit returned
};
struct Truncated {
  uint64_t begun = 0, done = 0;  // stamps before the call and after it returned
  uint64_t length = 0;
};

// A row a fetch saw before its append's commit was recorded: checked at the end.
struct Seen {
  uint64_t seq, position, fetch_begun;
  Row row;
};

class History {
 public:
  uint64_t Stamp() { return clock_.fetch_add(1) + 1; }
  uint32_t NewTag() {
    absl::MutexLock l(&mu_);
    pending_.insert(next_tag_);
    return next_tag_++;
  }
  void Commit(uint32_t tag, Committed c) {
    absl::MutexLock l(&mu_);
    pending_.erase(tag);
    committed_[tag] = c;
  }
  void Abandon(uint32_t tag) {
    absl::MutexLock l(&mu_);
    pending_.erase(tag);
  }
  // `done`: a stamp taken after Fork returned.
  void Forked(uint64_t child, uint64_t parent, uint64_t done) {
    absl::MutexLock l(&mu_);
    parent_[child] = parent;
    forked_at_[child] = done;
  }
  void Truncate(uint64_t seq, Truncated t) {
    absl::MutexLock l(&mu_);
    truncates_[seq].push_back(t);
  }
  // "" when `row`, fetched from `seq` at `position` by a fetch that began at stamp
  // `fetch_begun`, is what a committed append wrote there.
  std::string Check(uint64_t seq, uint64_t position, uint64_t fetch_begun, const Row& row) {
    absl::MutexLock l(&mu_);
    if (pending_.contains(row.tag)) {
      deferred_.push_back({seq, position, fetch_begun, row});
      return "";
    }
    return CheckLocked(seq, position, fetch_begun, row);
  }
  // The deferred rows, once every append has finished.
  std::string CheckDeferred() {
    absl::MutexLock l(&mu_);
    for (const Seen& s : deferred_) {
      if (std::string e = CheckLocked(s.seq, s.position, s.fetch_begun, s.row); !e.empty()) {
        return e;
      }
    }
    return "";
  }
  size_t committed() {
    absl::MutexLock l(&mu_);
    return committed_.size();
  }

 private:
  std::string CheckLocked(uint64_t seq, uint64_t position, uint64_t fetch_begun, const Row& row)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = committed_.find(row.tag);
    if (it == committed_.end()) {
      return absl::StrCat("sequence ", seq, " token ", position, ": row of append ", row.tag,
                          ", which never committed");
    }
    const Committed& c = it->second;
    if (row.index >= c.n || c.start + row.index != position) {
      return absl::StrCat("sequence ", seq, " token ", position, ": row ", row.index, " of append ",
                          row.tag, ", which wrote tokens [", c.start, ", ", c.start + c.n, ")");
    }
    // Up the fork chain: an append to an ancestor counts only if it began before every fork
    // on the way down had returned.
    uint64_t forks_done = UINT64_MAX;
    uint64_t s = seq;
    while (s != c.seq) {
      auto p = parent_.find(s);
      if (p == parent_.end()) {
        return absl::StrCat("sequence ", seq, " token ", position, ": row of append ", row.tag,
                            " to sequence ", c.seq, ", not one it was forked from");
      }
      forks_done = std::min(forks_done, forked_at_[s]);
      s = p->second;
    }
    if (c.begun > forks_done) {
      return absl::StrCat("sequence ", seq, " token ", position, ": row of append ", row.tag,
                          " to ancestor ", c.seq, ", which began after the fork returned");
    }
    // Cut off: the append had committed before a truncate below `position` began, and that
    // truncate returned before the fetch began.
    if (c.seq == seq) {
      for (const Truncated& t : truncates_[seq]) {
        if (t.length <= position && c.done < t.begun && t.done < fetch_begun) {
          return absl::StrCat("sequence ", seq, " token ", position, ": row of append ", row.tag,
                              ", which a truncate to ", t.length, " had cut off");
        }
      }
    }
    return "";
  }

  std::atomic<uint64_t> clock_{0};
  absl::Mutex mu_;
  uint32_t next_tag_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_set<uint32_t> pending_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint32_t, Committed> committed_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, uint64_t> parent_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, uint64_t> forked_at_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, std::vector<Truncated>> truncates_ ABSL_GUARDED_BY(mu_);
  std::vector<Seen> deferred_ ABSL_GUARDED_BY(mu_);
};

struct Counts {
  std::atomic<uint64_t> ops{0}, appends{0}, fetches{0}, rows_checked{0}, forks{0}, truncates{0},
      frees{0}, renews{0}, failures{0};
};

class ConcurrencyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    StoreOptions o;
    o.max_tokens_per_sequence = kMaxTokens;
    auto store = testenv::CreateTestStore(Layout(), 64, o);
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = *std::move(store);
    for (auto& slot : slots_) slot = NewSequence();
  }

  uint64_t NewSequence() {
    auto s = store_->Create(WithLease(absl::Hours(1)));
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? s->id : 0;
  }

  // Puts `id` in `slot`; the sequence it held is freed (whoever takes it out frees it).
  void Replace(int slot, uint64_t id) {
    const uint64_t old = slots_[slot].exchange(id);
    if (old != 0 && store_->Free(old).ok()) ++counts_.frees;
  }

  void Fail(const std::string& what) {
    ++counts_.failures;
    absl::MutexLock l(&failure_mu_);
    if (first_failure_.empty()) first_failure_ = what;
  }

  // The pool's accounting and the store's invariants, at any moment.
  void CheckNow(const char* when) {
    if (std::string e = store_->CheckInvariants(); !e.empty()) Fail(absl::StrCat(when, ": ", e));
    const PoolStats p = store_->pool().Stats();
    if (p.free + p.cached + p.used != p.total) {
      Fail(absl::StrCat(when, ": free ", p.free, " + cached ", p.cached, " + used ", p.used,
                        " != total ", p.total));
    }
  }

  void Append(std::mt19937_64& rng, uint64_t id) {
    const uint64_t n = 1 + rng() % 6;
    AppendSpec spec;
    spec.sequence_id = id;
    spec.num_tokens = n;
    const uint64_t begun = history_.Stamp();
    auto txn = store_->BeginAppend(spec);
    if (!txn.ok()) return;  // freed, full, too long, another append in flight
    const uint32_t tag = history_.NewTag();
    std::vector<uint8_t> payload((*txn)->payload_bytes());
    if (payload.size() != uint64_t{kLayers} * 2 * kHeads * n * kRowBytes) {
      history_.Abandon(tag);
      return Fail(absl::StrCat("append payload of ", payload.size(), " bytes for ", n, " tokens"));
    }
    for (uint32_t l = 0; l < kLayers; ++l) {
      for (int part = 0; part < 2; ++part) {
        for (uint32_t h = 0; h < kHeads; ++h) {
          for (uint64_t t = 0; t < n; ++t) {
            Row r;
            r.tag = tag;
            r.index = static_cast<uint16_t>(t);
            r.layer = static_cast<uint8_t>(l);
            r.part_head = static_cast<uint8_t>(part << 4 | h);
            WriteRow(r, payload.data() + RowOffset(l, part, h, t, n));
          }
        }
      }
    }
    // In 1..3 chunks; one in eight is dropped half written (the transaction undoes itself).
    const int mode = static_cast<int>(rng() % 8);
    size_t at = 0;
    const size_t cut =
        mode == 0 || payload.size() < 2 ? payload.size() / 2 : 1 + rng() % (payload.size() - 1);
    if (absl::Status s = (*txn)->Write(absl::MakeConstSpan(payload.data(), cut)); !s.ok()) {
      history_.Abandon(tag);
      return Fail(absl::StrCat("append write: ", s.ToString()));
    }
    at = cut;
    if (mode == 0) {
      txn->reset();
      history_.Abandon(tag);
      return;
    }
    if (absl::Status s =
            (*txn)->Write(absl::MakeConstSpan(payload.data() + at, payload.size() - at));
        !s.ok()) {
      history_.Abandon(tag);
      return Fail(absl::StrCat("append write: ", s.ToString()));
    }
    auto info = (*txn)->Commit();
    if (!info.ok()) {
      history_.Abandon(tag);
      if (info.status().code() != absl::StatusCode::kAborted) {  // freed meanwhile: expected
        Fail(absl::StrCat("append commit: ", info.status().ToString()));
      }
      return;
    }
    if (info->length < n) {
      history_.Abandon(tag);
      return Fail(absl::StrCat("append of ", n, " left length ", info->length));
    }
    history_.Commit(tag, Committed{id, info->length - n, n, begun, history_.Stamp()});
    ++counts_.appends;
  }

  void Fetch(std::mt19937_64& rng, uint64_t id) {
    const uint64_t begun = history_.Stamp();
    auto info = store_->Get(id);
    if (!info.ok() || info->length == 0) return;
    FetchSpec spec;
    spec.sequence_id = id;
    spec.token_begin = rng() % info->length;
    if (rng() % 2)
      spec.token_end = spec.token_begin + 1 + rng() % (info->length - spec.token_begin);
    spec.layer_begin = static_cast<uint32_t>(rng() % kLayers);
    if (rng() % 2) spec.layer_end = spec.layer_begin + 1 + rng() % (kLayers - spec.layer_begin);
    auto reader = store_->BeginFetch(spec);
    if (!reader.ok()) return;  // truncated or freed since the Get
    FetchReader& r = **reader;
    const uint64_t n = r.num_tokens();
    const uint32_t layers = r.layer_end() - r.layer_begin();
    if (r.token_begin() != spec.token_begin || r.layer_begin() != spec.layer_begin ||
        (spec.token_end && n != *spec.token_end - spec.token_begin) ||
        r.payload_bytes() != uint64_t{layers} * 2 * kHeads * n * kRowBytes) {
      return Fail(absl::StrCat("fetch of sequence ", id, " answered tokens [", r.token_begin(),
                               " +", n, ") layers [", r.layer_begin(), ", ", r.layer_end(), ") in ",
                               r.payload_bytes(), " bytes"));
    }
    std::vector<uint8_t> payload(r.payload_bytes());
    // In two reads at a random cut, as a streaming fetch does.
    const uint64_t cut = payload.empty() ? 0 : rng() % payload.size();
    if (absl::Status s = r.Read(0, absl::MakeSpan(payload.data(), cut)); !s.ok()) {
      return Fail(s.ToString());
    }
    if (absl::Status s = r.Read(cut, absl::MakeSpan(payload.data() + cut, payload.size() - cut));
        !s.ok()) {
      return Fail(s.ToString());
    }
    for (uint32_t i = 0; i < layers; ++i) {
      for (int part = 0; part < 2; ++part) {
        for (uint32_t h = 0; h < kHeads; ++h) {
          for (uint64_t t = 0; t < n; ++t) {
            const uint8_t* at = payload.data() + RowOffset(i, part, h, t, n);
            Row row;
            uint64_t check = 0;
            std::memcpy(&row, at, sizeof(row));
            std::memcpy(&check, at + sizeof(row), sizeof(check));
            const uint64_t position = r.token_begin() + t;
            if (row.layer != r.layer_begin() + i || row.part_head != (part << 4 | h) ||
                check != row.Check()) {
              return Fail(absl::StrCat("sequence ", id, " token ", position, " layer ",
                                       r.layer_begin() + i, " part ", part, " head ", h,
                                       ": row is not one any append wrote there"));
            }
            if (std::string e = history_.Check(id, position, begun, row); !e.empty())
              return Fail(e);
            ++counts_.rows_checked;
          }
        }
      }
    }
    ++counts_.fetches;
  }

  void Worker(int thread, uint64_t seed, std::chrono::steady_clock::time_point deadline) {
    std::mt19937_64 rng(seed);
    for (int op = 0; op < kOpsPerThread && std::chrono::steady_clock::now() < deadline; ++op) {
      ++counts_.ops;
      const int slot = static_cast<int>(rng() % kSlots);
      const uint64_t id = slots_[slot].load();
      const int what = static_cast<int>(rng() % 100);
      if (what < 35) {
        Append(rng, id);
      } else if (what < 65) {
        Fetch(rng, id);
      } else if (what < 73) {  // fork into another slot
        auto child = store_->Fork(id, absl::Hours(1));
        if (child.ok()) {
          history_.Forked(child->id, id, history_.Stamp());
          Replace(static_cast<int>(rng() % kSlots), child->id);
          ++counts_.forks;
        }
      } else if (what < 83) {
        auto info = store_->Get(id);
        if (info.ok()) {
          const uint64_t length = rng() % (info->length + 1);
          const uint64_t begun = history_.Stamp();
          if (store_->Truncate(id, length).ok()) {
            history_.Truncate(id, Truncated{begun, history_.Stamp(), length});
            ++counts_.truncates;
          }
        }
      } else if (what < 88) {  // free, and a new empty sequence takes the slot
        Replace(slot, NewSequence());
      } else if (what < 95) {
        if (store_->RenewLease(id).ok()) ++counts_.renews;
      } else {
        (void)store_->Get(id);
      }
      if (thread == 0 && op % 100 == 99) CheckNow("checkpoint");
    }
  }

  std::unique_ptr<SequenceStore> store_;
  std::atomic<uint64_t> slots_[kSlots];
  History history_;
  Counts counts_;
  absl::Mutex failure_mu_;
  std::string first_failure_ ABSL_GUARDED_BY(failure_mu_);
};

TEST_F(ConcurrencyTest, SharedSequencesStayConsistent) {
  uint64_t base_seed = 20261201;
  if (const char* s = std::getenv("KVBANK_CONCURRENCY_SEED"))
    base_seed = std::strtoull(s, nullptr, 10);
  std::printf("base seed %llu (threads use base + 0..%d; set KVBANK_CONCURRENCY_SEED to vary)\n",
              static_cast<unsigned long long>(base_seed), kThreads - 1);
  const auto deadline = std::chrono::steady_clock::now() + kTimeBudget;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([this, t, base_seed, deadline] { Worker(t, base_seed + t, deadline); });
  }
  for (std::thread& t : threads) t.join();
  CheckNow("end");
  if (std::string e = history_.CheckDeferred(); !e.empty()) Fail(e);

  std::printf(
      "%llu ops: %llu appends committed, %llu fetches (%llu rows checked), %llu forks, "
      "%llu truncates, %llu frees, %llu renewals\n",
      (unsigned long long)counts_.ops.load(), (unsigned long long)counts_.appends.load(),
      (unsigned long long)counts_.fetches.load(), (unsigned long long)counts_.rows_checked.load(),
      (unsigned long long)counts_.forks.load(), (unsigned long long)counts_.truncates.load(),
      (unsigned long long)counts_.frees.load(), (unsigned long long)counts_.renews.load());
  {
    absl::MutexLock l(&failure_mu_);
    EXPECT_EQ(counts_.failures.load(), 0u) << "first: " << first_failure_;
  }
  // Enough of each kind happened for the run to mean something.
  EXPECT_GT(counts_.appends.load(), 50u);
  EXPECT_GT(counts_.fetches.load(), 50u);
  EXPECT_GT(counts_.forks.load(), 5u);
  EXPECT_GT(counts_.truncates.load(), 5u);

  for (auto& slot : slots_) {
    EXPECT_TRUE(store_->Free(slot.exchange(0)).ok());
  }
  EXPECT_EQ(store_->CheckInvariants(), "");
  const PoolStats p = store_->pool().Stats();
  EXPECT_EQ(p.used, 0u) << "blocks still referenced after every sequence was freed";
  EXPECT_EQ(p.free + p.cached, p.total);
}

}  // namespace
}  // namespace kvbank
