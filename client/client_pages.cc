// Client::PutPagesFromRegion: pages stored under their own keys, many in one call, on threads of
// the call (no interpreter lock or per-page dispatch on the caller's side).
#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvbank/client.h"

namespace kvbank {

std::vector<absl::Status> Client::PutPagesFromRegion(const std::string& model,
                                                     const PutPagesArgs& args,
                                                     const std::vector<PagePut>& pages) {
  std::vector<absl::Status> out(pages.size());
  if (args.num_tokens == 0 || args.parallel < 1 || args.parallel > 64) {
    const absl::Status bad = absl::InvalidArgumentError(
        args.num_tokens == 0
            ? std::string("PutPagesArgs.num_tokens is 0")
            : absl::StrCat("PutPagesArgs.parallel ", args.parallel, " is not in 1..64"));
    std::fill(out.begin(), out.end(), bad);
    return out;
  }
  CreateArgs create;
  create.lease = args.lease;
  create.prompt.assign(args.num_tokens, 0);
  AppendArgs append;
  append.num_tokens = args.num_tokens;
  auto put = [&](const PagePut& page) -> absl::Status {
    CreateArgs c = create;
    c.extra_keys = page.extra_keys;
    auto seq = CreateSequence(model, c);
    if (!seq.ok()) return seq.status();
    absl::Status s;
    if (seq->cached_tokens < args.num_tokens) {
      s = AppendFromRegion(model, seq->id, append, page.source).status();
    }
    // The published block stays cached; a failed free is left to the sequence's lease.
    (void)Free(model, seq->id);
    return s;
  };
  std::atomic<size_t> next{0};
  auto worker = [&] {
    for (size_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < pages.size();) {
      out[i] = put(pages[i]);
    }
  };
  std::vector<std::thread> threads;
  const size_t workers = std::min<size_t>(size_t(args.parallel), pages.size());
  for (size_t t = 1; t < workers; ++t) threads.emplace_back(worker);
  worker();
  for (std::thread& t : threads) t.join();
  return out;
}

}  // namespace kvbank
