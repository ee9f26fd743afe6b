// kvbankd's own TCP listener. gRPC accepts connections on the sockets kvbankd binds and hands it
// (an external connection acceptor), because gRPC's own listener (1.51) has three failure modes
// an operator cannot fix from outside:
//  - when accept4 fails with EMFILE / ENFILE it logs "Failed accept4" and never accepts again;
//    clients connected before keep working, every new one hangs until its deadline;
//  - it sets SO_REUSEPORT, so a second kvbankd on a port already served starts fine and takes
//    half of the new connections;
//  - it has no bound on the number of connections.
// This listener binds without SO_REUSEPORT (a port in use fails naming it), caps the connections
// it has open (over the cap a connection is closed at once: the client sees UNAVAILABLE and may
// retry elsewhere, where gRPC's listener would queue it in the backlog until its deadline), and
// rides out descriptor exhaustion: it keeps one descriptor in reserve, so a connection it cannot
// keep is accepted and closed rather than left in the backlog, and it retries until descriptors
// are free again. accepting() says whether it can take connections now (health reports it).
#ifndef KVBANK_SERVER_RPC_LISTENER_H_
#define KVBANK_SERVER_RPC_LISTENER_H_

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/server_builder.h"

namespace kvbank::rpc {

struct ListenerStats {
  uint64_t accepted = 0;          // connections handed to gRPC
  uint64_t refused_over_cap = 0;  // closed at once: max_connections were open
  uint64_t refused_no_fds = 0;    // closed at once: no descriptor was left for them
  uint64_t open = 0;              // connections handed to gRPC that are still open (a bound:
                                  // closed ones are noticed lazily, at most twice the open ones)
  uint64_t closed_oldest = 0;     // OverCap::kCloseOldest: open ones shut down to make room
};

// What a listener does with a new connection while max_connections are open.
enum class OverCap : uint8_t {
  kRefuse,       // close the new one at once (its client may retry elsewhere)
  kCloseOldest,  // shut the oldest open one down and take the new one: a port that must always
                 // answer (health probes), where no client holds a connection for long
};

// Thread-safe after Start; Start and Stop are called once each, from one thread.
class Listener {
 public:
  // Binds `address` ("host:port", "[v6]:port", port 0: the system picks one; a host name binds
  // every address it resolves to, all on the same port) with SO_REUSEADDR and without
  // SO_REUSEPORT, and listens. FAILED_PRECONDITION naming the port when it is in use,
  // INVALID_ARGUMENT when the address does not parse or resolve.
  static absl::StatusOr<std::unique_ptr<Listener>> Bind(const std::string& address,
                                                        int backlog = 1024);
  ~Listener();  // Stop()s
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;

  int port() const { return port_; }

  // Starts the accept thread: every connection goes to `acceptor` (REQUIRES: its grpc::Server is
  // started); while `max_connections` are open, `over_cap` says which one is closed.
  void Start(std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> acceptor,
             uint64_t max_connections, OverCap over_cap = OverCap::kRefuse);
  // Closes the listening sockets and joins the accept thread. Connections already handed to gRPC
  // stay open (gRPC's Shutdown closes them).
  void Stop();

  // False while the last accept failed for want of descriptors (and since Stop).
  bool accepting() const { return accepting_.load(std::memory_order_acquire); }
  ListenerStats stats() const;

 private:
  Listener() = default;
  void Run();
  // Takes one pending connection from `listen_fd`; false when there was none.
  bool AcceptOne(int listen_fd);
  // After running out: whether a descriptor (and the reserve) is free again; sets accepting_.
  bool DescriptorFree();
  // Forgets the connections gRPC has closed since they were handed over.
  void Sweep();

  std::vector<int> listen_fds_;
  int port_ = 0;
  int wake_[2] = {-1, -1};  // a pipe: Stop writes to it to end poll()
  int reserve_fd_ = -1;     // closed to make room when accept4 runs out of descriptors
  std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> acceptor_;
  uint64_t max_connections_ = 0;
  OverCap over_cap_ = OverCap::kRefuse;
  std::thread thread_;
  std::atomic<bool> accepting_{false};

  // The accept thread's own: connections handed over, as (descriptor, socket inode): a
  // descriptor still open on the same inode is the same connection.
  std::vector<std::pair<int, ino_t>> handed_;
  absl::Time last_sweep_ = absl::InfinitePast();
  size_t next_sweep_ = 1024;  // sweep once handed_ has this many entries
  std::atomic<uint64_t> accepted_{0}, refused_over_cap_{0}, refused_no_fds_{0}, open_{0},
      closed_oldest_{0};
};

// Raises the soft RLIMIT_NOFILE to the hard limit; returns the soft limit in force after.
uint64_t RaiseDescriptorLimit();

}  // namespace kvbank::rpc

#endif  // KVBANK_SERVER_RPC_LISTENER_H_
