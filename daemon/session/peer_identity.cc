#include "daemon/session/peer_identity.h"

#include <sys/socket.h>
#include <sys/stat.h>

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>

namespace ckpt::daemon {

bool PeerIdentity::InGroup(gid_t group) const {
  return gid == group || std::find(groups.begin(), groups.end(), group) != groups.end();
}

std::string PeerIdentity::Describe() const {
  return fmt::format("pid {} uid {} gid {}", pid, uid, gid);
}

absl::StatusOr<PeerIdentity> ReadPeerIdentity(int fd) {
  ucred cred{};
  socklen_t len = sizeof cred;
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return absl::InternalError(fmt::format("SO_PEERCRED: {}", std::strerror(errno)));
  }
  PeerIdentity peer{cred.pid, cred.uid, cred.gid, {}};
  // The supplementary groups as they were when the peer connected (Linux 4.13+).
  std::vector<gid_t> groups(64);
  len = static_cast<socklen_t>(groups.size() * sizeof(gid_t));
  int rc = ::getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &len);
  if (rc != 0 && errno == ERANGE) {
    groups.resize(len / sizeof(gid_t));
    rc = ::getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &len);
  }
  if (rc == 0) {
    groups.resize(len / sizeof(gid_t));
    peer.groups = std::move(groups);
  }
  return peer;
}

namespace {

ino_t SocketInode(int fd) {
  struct stat st;
  return ::fstat(fd, &st) == 0 && S_ISSOCK(st.st_mode) ? st.st_ino : 0;
}

}  // namespace

void PeerTable::Remember(int fd, PeerIdentity peer) {
  ino_t inode = SocketInode(fd);
  std::lock_guard lock(mu_);
  if (auto old = by_fd_.find(fd); old != by_fd_.end()) fds_of_uid_[old->second.peer.uid].erase(fd);
  fds_of_uid_[peer.uid].insert(fd);
  by_fd_[fd] = Entry{std::move(peer), inode};
}

size_t PeerTable::OpenConnections(uid_t uid) {
  std::lock_guard lock(mu_);
  auto mine = fds_of_uid_.find(uid);
  if (mine == fds_of_uid_.end()) return 0;
  for (auto fd = mine->second.begin(); fd != mine->second.end();) {
    auto entry = by_fd_.find(*fd);
    if (entry != by_fd_.end() && entry->second.socket_inode != 0 && SocketInode(*fd) == entry->second.socket_inode) {
      ++fd;
      continue;
    }
    // Closed by gRPC (the number free, or reused for something else).
    if (entry != by_fd_.end()) by_fd_.erase(entry);
    fd = mine->second.erase(fd);
  }
  const size_t open = mine->second.size();
  if (open == 0) fds_of_uid_.erase(mine);
  return open;
}

absl::StatusOr<PeerIdentity> PeerTable::Of(const std::string& grpc_peer) const {
  constexpr std::string_view kPrefix = "fd:";
  int fd = -1;
  if (grpc_peer.rfind(kPrefix, 0) == 0) {
    const char* begin = grpc_peer.data() + kPrefix.size();
    const char* end = grpc_peer.data() + grpc_peer.size();
    if (std::from_chars(begin, end, fd).ptr != end) fd = -1;
  }
  std::lock_guard lock(mu_);
  auto it = by_fd_.find(fd);
  if (it == by_fd_.end()) {
    return absl::UnauthenticatedError(fmt::format(
        "trainer calls are served only on ckptd's Unix socket, where the caller is known (not "
        "from {})",
        grpc_peer.substr(0, 128)));
  }
  // The descriptor must still be the socket accepted then, with the same peer.
  absl::StatusOr<PeerIdentity> now = ReadPeerIdentity(fd);
  if (it->second.socket_inode == 0 || SocketInode(fd) != it->second.socket_inode || !now.ok() ||
      now->pid != it->second.peer.pid || now->uid != it->second.peer.uid) {
    return absl::UnauthenticatedError(fmt::format(
        "the connection behind {} is no longer the one ckptd accepted; reconnect", grpc_peer));
  }
  return it->second.peer;
}

}  // namespace ckpt::daemon
