// Who is calling: the identity of the process at the other end of a Unix-socket
// connection, taken from the kernel (SO_PEERCRED, SO_PEERGROUPS) when it connects, never
// from anything the caller sends. ckptd hands each accepted connection to gRPC as a file
// descriptor, and gRPC names such a peer "fd:N"; the table maps that name back to the
// identity read at accept time.
#pragma once

#include <sys/types.h>

#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace ckpt::daemon {

struct PeerIdentity {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
  std::vector<gid_t> groups;  // supplementary groups
  bool InGroup(gid_t group) const;
  std::string Describe() const;  // "pid 12 uid 1000 gid 1000"
};

// Reads the peer of a connected Unix socket.
absl::StatusOr<PeerIdentity> ReadPeerIdentity(int fd);

class PeerTable {
 public:
  // The connection on descriptor `fd` belongs to `peer` (replaces what a closed connection
  // that had the same descriptor number left).
  void Remember(int fd, PeerIdentity peer);
  // The identity behind a gRPC peer name; Unauthenticated for anything but a connection
  // this daemon accepted on its socket (TCP, or an unknown descriptor).
  absl::StatusOr<PeerIdentity> Of(const std::string& grpc_peer) const;

 private:
  mutable std::mutex mu_;
  std::map<int, PeerIdentity> by_fd_;
};

}  // namespace ckpt::daemon
