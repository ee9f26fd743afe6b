// Client::Watch: the KV event stream (stored, removed, all cleared) as the SDK's Events.
#include "client/client_internal.h"
#include "kvbank/client.h"
#include "kvbank/v1/kvbank.grpc.pb.h"

namespace kvbank {

using internal::FromGrpc;
using internal::HashFromBytes;

absl::Status Client::Watch(
    const std::string& model, uint64_t after_sequence, bool from_now, absl::Duration deadline,
    const std::function<bool(const std::vector<Event>&, uint64_t)>& on_batch) {
  v1::WatchRequest req;
  req.set_model(model);
  req.set_after_sequence(after_sequence);
  req.set_from_now(from_now);
  grpc::ClientContext ctx;
  impl_->Deadline(&ctx, false);
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  std::unique_ptr<grpc::ClientReader<v1::KvEventBatch>> reader(impl_->stub->Watch(&ctx, req));
  v1::KvEventBatch batch;
  while (reader->Read(&batch)) {
    std::vector<Event> events;
    for (const v1::KvEvent& p : batch.events()) {
      Event e;
      e.sequence = p.sequence();
      e.tenant = p.tenant();
      if (p.has_stored()) {
        e.type = Event::Type::kStored;
        for (const auto& h : p.stored().block_hashes()) e.hashes.push_back(HashFromBytes(h));
        if (!p.stored().parent_block_hash().empty()) {
          e.parent = HashFromBytes(p.stored().parent_block_hash());
        }
        e.token_ids.assign(p.stored().token_ids().begin(), p.stored().token_ids().end());
        e.block_size = p.stored().block_size();
        e.lora = p.stored().lora_name();
      } else if (p.has_removed()) {
        e.type = Event::Type::kRemoved;
        for (const auto& h : p.removed().block_hashes()) e.hashes.push_back(HashFromBytes(h));
      } else {
        e.type = Event::Type::kAllCleared;
      }
      events.push_back(std::move(e));
    }
    if (!on_batch(events, batch.last_sequence())) {
      ctx.TryCancel();
      reader->Finish();
      return absl::OkStatus();
    }
  }
  return FromGrpc(reader->Finish());
}

}  // namespace kvbank
