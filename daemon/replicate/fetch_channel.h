// The restore's data channel: fragments sent back to a replacement node over a plain TCP
// connection, their bytes written straight from the store and read straight into the
// rebuilt shard, where gRPC moved them at a fifth of what TCP does on the same machine
// (benchmarks.md, "Peer replicas"). Nothing is served without a ticket: a replacement asks
// for one over the authenticated Replicas service (ListHeld), scoped to one job and one
// owner node's fragments and valid for a minute, and sends it first on the connection.
// Groups that run with TLS keep every fragment on gRPC (the channel is not encrypted).
//
// On the wire, little-endian: the client sends the 32-byte ticket, the rank (u32), the
// fragment index (u32) and the step (u64); the server answers a u32 length and that many
// bytes of a FragmentHeader (proto/replicas.proto; length 0: refused), then the fragment's
// bytes. One fragment per connection. The request must arrive whole within
// kRequestDeadline of the accept; connections without a ticket yet are bounded apart.
// (docs/security.md, "Other daemons".)
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/replicate/fragment_store.h"
#include "daemon/replicate/replica_service.h"

namespace ckpt::replicate {

inline constexpr size_t kFetchTicketBytes = 32;

class FetchServer {
 public:
  // Listens on `host` (the group server's) at `port` (0: an ephemeral one). `faults`:
  // test-only.
  static absl::StatusOr<std::unique_ptr<FetchServer>> Start(FragmentStore& store, const std::string& host,
                                                            ReplicaFaults faults = {}, int port = 0);
  ~FetchServer();

  int port() const { return port_; }
  // A ticket for `owner`'s fragments of `job`, valid for kTicketLifetime.
  std::string Issue(const std::string& job, uint32_t owner);
  // Stops accepting and closes every open connection (shutdown: a worker blocked on a
  // slow client returns at once), then joins the workers.
  void Stop();

  static constexpr auto kTicketLifetime = std::chrono::seconds(60);
  static constexpr size_t kMaxTickets = 4096;
  static constexpr int kMaxConnections = 16;
  // Connections that have not shown a valid ticket yet: at most this many at once, and
  // each must send its whole request within kRequestDeadline of being accepted.
  static constexpr int kMaxUnauthenticated = kMaxConnections / 2;
  static constexpr auto kRequestDeadline = std::chrono::seconds(10);

 private:
  FetchServer(FragmentStore& store, int listener, int port, ReplicaFaults faults);
  void AcceptLoop();
  // Serves one connection from `peer_port`, accepted at `accepted`; `authenticated` set once
  // its ticket was redeemed (and unauthenticated_ counted down).
  void Serve(int fd, int peer_port, std::chrono::steady_clock::time_point accepted, bool& authenticated);
  // The (job, owner) the ticket was issued for, if it is valid now.
  bool Redeem(const std::string& ticket, std::string& job, uint32_t& owner);

  struct Grant {
    std::string job;
    uint32_t owner = 0;
    std::chrono::steady_clock::time_point expires;
  };

  FragmentStore& store_;
  const int listener_;
  const int port_;
  const ReplicaFaults faults_;
  std::atomic<bool> stopping_{false};
  std::atomic<int> connections_{0};
  std::atomic<int> unauthenticated_{0};  // of connections_: no ticket redeemed yet
  std::atomic<uint64_t> refused_{0};      // closed at accept: over a bound (said at Stop)
  std::mutex mu_;
  struct Worker {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  std::map<std::string, Grant> tickets_;  // guarded by mu_
  std::vector<Worker> workers_;           // guarded by mu_; the finished joined at each accept
  std::set<int> open_;                    // guarded by mu_: descriptors of open connections
  std::thread acceptor_;                  // last: started once the rest is there
};

// Fetches fragment `index` of `rank`'s shard of `step` from a peer's FetchServer at
// `host`:`port` with `ticket`. The header is checked against the id asked for, the code's
// `k` and `max_data_bytes` before any byte is read; `into(meta)` then says where the
// fragment's FragmentBytes go (null: refuse). Bounded by `timeout` per read and write. The
// fragment's checksum is the caller's to check, over the bytes where they landed.
absl::StatusOr<FragmentMeta> FetchFragment(const std::string& host, int port, const std::string& ticket,
                                           const FragmentId& id, uint32_t k, uint64_t max_data_bytes,
                                           const std::function<char*(const FragmentMeta&)>& into,
                                           std::chrono::milliseconds timeout);

}  // namespace ckpt::replicate
