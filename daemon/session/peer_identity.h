// Who is calling: the identity of the process at the other end of a Unix-socket
// connection, taken from the kernel (SO_PEERCRED, SO_PEERGROUPS) when it connects, never
// from anything the caller sends. ckptd hands each accepted connection to gRPC as a file
// descriptor, and gRPC names such a peer "fd:N"; the table maps that name back to the
// identity read at accept time, and to the socket itself (its inode).
//
// Why the number can be trusted: gRPC closes a connection's descriptor only when its
// transport is destroyed, which waits for every call on it to be destroyed, so while a
// handler runs, its connection's descriptor is open and its number cannot have been given
// to another connection. What the inode adds: a number that gRPC closed and the process
// reused for something else (a file, a TCP connection, a socket accepted elsewhere) is
// not taken for the connection the table remembers; and the peer's credentials are read
// again from that socket, so a table that somehow missed an accept fails closed.
#pragma once

#include <sys/types.h>

#include <map>
#include <mutex>
#include <optional>
#include <set>
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
  // How many connections of `uid` are still open (their descriptor still names the socket
  // accepted), forgetting those gRPC has closed: O(that uid's connections).
  size_t OpenConnections(uid_t uid);

 private:
  mutable std::mutex mu_;
  struct Entry {
    PeerIdentity peer;
    ino_t socket_inode;
  };
  std::map<int, Entry> by_fd_;
  std::map<uid_t, std::set<int>> fds_of_uid_;  // the same entries, by uid
};

}  // namespace ckpt::daemon
