// The daemon's Unix socket. ckptd accepts connections itself so that it can check each
// peer's credentials (SO_PEERCRED) before handing the connection to gRPC; the socket file
// is created with mode 0660 so that filesystem permissions are the first gate.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/server.h>

#include "absl/status/statusor.h"
#include "common/unique_fd.h"
#include "daemon/control/socket_access.h"
#include "daemon/session/peer_identity.h"

namespace ckpt::daemon {

struct PeerPolicy {
  uid_t daemon_uid = 0;
  gid_t daemon_gid = 0;
  std::vector<uint32_t> allow_uids;
  std::vector<uint32_t> allow_gids;  // matched against primary and supplementary groups
  // Open connections one uid may hold on the socket (0: no bound): one user's idle
  // connections must not take the daemon to its descriptor limit, where no other user
  // (nor root's ckptctl) could connect.
  size_t max_connections_per_uid = 0;
  bool Allows(const PeerIdentity& peer) const;
};

// A listening Unix socket at `path`, mode 0660 from the instant it exists, with ACL
// entries for `access` (a filesystem without ACLs: logged, the socket still serves).
absl::StatusOr<UniqueFd> ListenUnix(const std::string& path, const SocketAccess& access = {});

class UnixListener {
 public:
  // Creates the socket's directory if needed, removes a stale socket file (refusing if a
  // live daemon answers on it), binds and listens under a temporary name beside `path`
  // (`path` + ".new"): the daemon binds it early in its start, and clients that find it
  // listening wait for a daemon that is starting (client/python/src/ckptd/_connection.py).
  // `access` reaches the socket and its directory through their ACLs (socket_access.h).
  static absl::StatusOr<std::unique_ptr<UnixListener>> Bind(const std::string& path,
                                                            const SocketAccess& access = {});
  ~UnixListener();

  // Accepts on a thread until Stop(); allowed peers are remembered in `peers` and added to
  // `server`. Then renames the socket to its path: whoever sees the path can use the
  // daemon at once.
  absl::Status Serve(grpc::Server* server, PeerPolicy policy, PeerTable& peers);
  void Stop();

 private:
  UnixListener(std::string path, std::string bound, UniqueFd fd)
      : path_(std::move(path)), bound_(std::move(bound)), fd_(std::move(fd)) {}
  void AcceptLoop(grpc::Server* server, PeerPolicy policy, PeerTable& peers);

  std::string path_;
  std::string bound_;  // where the socket lives until Serve() publishes it at path_
  UniqueFd fd_;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace ckpt::daemon
