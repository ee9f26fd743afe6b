// Client::Attend: decode attention computed on the server, next to the KV (fused read).
#include "client/client_internal.h"
#include "kvbank/client.h"
#include "kvbank/v1/kvbank.grpc.pb.h"

namespace kvbank {

absl::StatusOr<std::vector<Client::AttendOutput>> Client::Attend(
    const std::string& model, const std::vector<AttendQuery>& queries, const AttendArgs& args) {
  v1::AttendRequest req;
  req.set_model(model);
  for (const AttendQuery& q : queries) {
    v1::AttendItem* it = req.add_items();
    it->set_sequence_id(q.sequence_id);
    it->set_layer(q.layer);
    it->mutable_query()->Add(q.query.begin(), q.query.end());
  }
  req.set_softmax_scale(args.softmax_scale);
  req.set_window(args.window);
  req.set_sinks(args.sinks);
  v1::AttendResponse resp;
  if (auto s = impl_->Call(&v1::KvBank::Stub::Attend, req, &resp); !s.ok()) return s;
  std::vector<AttendOutput> out;
  for (const v1::AttendResult& r : resp.results()) {
    out.push_back({std::vector<float>(r.output().begin(), r.output().end()),
                   std::vector<float>(r.lse().begin(), r.lse().end())});
  }
  return out;
}

absl::StatusOr<std::vector<Client::AttendOutput>> Client::Attend(
    const std::string& model, const std::vector<AttendQuery>& queries) {
  return Attend(model, queries, AttendArgs());
}

}  // namespace kvbank
