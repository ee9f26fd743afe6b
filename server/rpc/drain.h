// What kvbankd needs to stop without losing an answer: a count of the kvbank calls in flight and
// the bytes its connections have sent that the clients have not acknowledged yet.
//
// gRPC's own Shutdown is not enough. Once its GOAWAY is out, it closes each connection as soon
// as that connection's last call has written its status into the kernel's socket buffer. The
// client, still reading the end of a large fetch, keeps sending flow-control updates; data that
// arrives on a closed socket makes the server's kernel reset the connection and drop what it had
// not sent, and the client sees UNAVAILABLE for a call that succeeded. So kvbankd drains first
// (new calls refused, calls in flight finished, every byte acknowledged) and shuts gRPC down after.
#ifndef KVBANK_SERVER_RPC_DRAIN_H_
#define KVBANK_SERVER_RPC_DRAIN_H_

#include <atomic>
#include <cstdint>

#include "grpcpp/support/server_interceptor.h"

namespace kvbank::rpc {

// Counts the calls of kvbank.v1.KvBank in flight, from the moment gRPC hands a call to the server
// until the call object goes away (after its status is written). Other services (health,
// reflection) are not counted: a client may hold their streams open indefinitely.
class CallCounter final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override;

  uint64_t in_flight() const { return in_flight_.load(std::memory_order_acquire); }

 private:
  class Tracker;
  std::atomic<uint64_t> in_flight_{0};
};

// Bytes this process has written to its TCP connections on local port `port` that the peers have
// not acknowledged yet, sent or not. gRPC owns the sockets, so they are found by scanning this
// process's descriptors (Linux: /proc/self/fd and SIOCOUTQ). 0 when there is nothing to find.
uint64_t UnackedBytesOnPort(int port);

}  // namespace kvbank::rpc

#endif  // KVBANK_SERVER_RPC_DRAIN_H_
