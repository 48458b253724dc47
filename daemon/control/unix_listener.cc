#include "daemon/control/unix_listener.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <fmt/format.h>
#include <grpcpp/server_posix.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "common/log.h"
#include "common/log_limiter.h"
#include "common/status.h"

namespace ckpt::daemon {
namespace {

spdlog::logger& Log() { return log::Get(log::Component::kControl); }

sockaddr_un Address(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  return addr;
}

bool Contains(const std::vector<uint32_t>& v, uint32_t x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

}  // namespace

bool PeerPolicy::Allows(const PeerIdentity& peer) const {
  if (peer.uid == 0 || peer.uid == daemon_uid || peer.InGroup(daemon_gid) ||
      Contains(allow_uids, peer.uid)) {
    return true;
  }
  return std::any_of(allow_gids.begin(), allow_gids.end(),
                     [&](uint32_t gid) { return peer.InGroup(gid); });
}

absl::StatusOr<std::unique_ptr<UnixListener>> UnixListener::Bind(const std::string& path,
                                                                  const SocketAccess& access) {
  const std::string bound = path + ".new";
  if (bound.size() >= sizeof(sockaddr_un::sun_path)) {
    return absl::InvalidArgumentError(fmt::format("socket path {} is too long", path));
  }
  std::filesystem::path dir = std::filesystem::path(path).parent_path();
  if (!dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) return ErrnoStatus(ec.value(), fmt::format("create socket directory {}", dir.string()));
  }
  sockaddr_un addr = Address(path);
  struct stat st;
  if (::lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return absl::FailedPreconditionError(fmt::format("{} exists and is not a socket", path));
    }
    UniqueFd probe(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (::connect(probe.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
      return absl::AlreadyExistsError(
          fmt::format("another ckptd is already listening on {}", path));
    }
    ::unlink(path.c_str());  // stale: its daemon is gone
  }
  ::unlink(bound.c_str());  // left by a daemon that died while starting
  CKPT_ASSIGN_OR_RETURN(UniqueFd fd, ListenUnix(bound, access));
  // systemd's RuntimeDirectory= is 0750 ckptd:ckptd: allowed users who are not in ckptd's
  // group may enter it (not list it) to reach the sockets.
  if (absl::Status entered = GrantDirectoryEntry(dir.empty() ? "." : dir.string(), access); !entered.ok()) {
    Log().warn("--allow-uid/--allow-gid: the socket's directory: {}", Message(entered));
  }
  return std::unique_ptr<UnixListener>(new UnixListener(path, bound, std::move(fd)));
}

absl::StatusOr<UniqueFd> ListenUnix(const std::string& path, const SocketAccess& access) {
  if (path.size() >= sizeof(sockaddr_un::sun_path)) {
    return absl::InvalidArgumentError(fmt::format("socket path {} is too long", path));
  }
  sockaddr_un addr = Address(path);
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return ErrnoStatus(errno, "socket");
  // The umask makes the socket 0660 from the instant it exists; chmod below makes it exact.
  mode_t old_mask = ::umask(0117);
  int rc = ::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  int bind_errno = errno;
  ::umask(old_mask);
  if (rc != 0) return ErrnoStatus(bind_errno, fmt::format("bind {}", path));
  ::chmod(path.c_str(), 0660);
  if (absl::Status granted = GrantSocketAccess(path, access); !granted.ok()) {
    Log().warn("--allow-uid/--allow-gid: {}", Message(granted));
  }
  if (::listen(fd.get(), 128) != 0) return ErrnoStatus(errno, fmt::format("listen {}", path));
  return fd;
}

UnixListener::~UnixListener() {
  Stop();
  ::unlink(bound_.c_str());
  ::unlink(path_.c_str());
}

absl::Status UnixListener::Serve(grpc::Server* server, PeerPolicy policy, PeerTable& peers) {
  thread_ = std::thread([this, server, policy, &peers] { AcceptLoop(server, policy, peers); });
  if (::rename(bound_.c_str(), path_.c_str()) != 0) {
    return ErrnoStatus(errno, fmt::format("rename {} to {}", bound_, path_));
  }
  return absl::OkStatus();
}

void UnixListener::Stop() {
  stopping_ = true;
  if (fd_.valid()) ::shutdown(fd_.get(), SHUT_RDWR);  // wakes accept()
  if (thread_.joinable()) thread_.join();
}

void UnixListener::AcceptLoop(grpc::Server* server, PeerPolicy policy, PeerTable& peers) {
  // What a flood causes is logged at most every 10 s, with how many were held back.
  LogLimiter accept_errors(std::chrono::seconds(10)), refusals(std::chrono::seconds(10));
  while (!stopping_) {
    // gRPC's endpoint expects a non-blocking socket.
    int conn = ::accept4(fd_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (conn < 0) {
      const int error = errno;
      if (error == EINTR || error == ECONNABORTED) continue;
      if (!stopping_) {
        if (std::optional<uint64_t> held = accept_errors.Allow()) {
          Log().error("accept on {}: {}{}", path_, std::strerror(error),
                      HeldBack(*held));
        }
      }
      if (error == EMFILE || error == ENFILE) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        continue;
      }
      return;
    }
    absl::StatusOr<PeerIdentity> peer = ReadPeerIdentity(conn);
    if (!peer.ok() || !policy.Allows(*peer)) {
      if (std::optional<uint64_t> held = refusals.Allow()) {
        Log().warn("refused connection from {}: not allowed (--allow-uid, --allow-gid){}",
                   peer.ok() ? peer->Describe() : std::string(peer.status().message()),
                   HeldBack(*held));
      }
      ::close(conn);
      continue;
    }
    if (policy.max_connections_per_uid != 0 && peers.OpenConnections(peer->uid) >= policy.max_connections_per_uid) {
      if (std::optional<uint64_t> held = refusals.Allow()) {
        Log().warn("refused connection from {}: uid {} already holds {} connections (--max-connections-per-uid){}",
                   peer->Describe(), peer->uid, policy.max_connections_per_uid,
                   HeldBack(*held));
      }
      ::close(conn);
      continue;
    }
    Log().debug("connection from {}", peer->Describe());
    // Before gRPC sees the connection: its first call must find who made it.
    peers.Remember(conn, std::move(*peer));
    grpc::AddInsecureChannelFromFd(server, conn);  // gRPC owns the fd from here
  }
}

}  // namespace ckpt::daemon
