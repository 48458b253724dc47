#include "daemon/control/control_fd_server.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cerrno>
#include <cstring>

#include "common/fd_passing.h"
#include "common/log.h"
#include "common/status.h"
#include "daemon/control/unix_listener.h"
#include "daemon/session/peer_identity.h"
#include "shm/sealed_segment.h"

namespace ckpt::daemon {
namespace {

spdlog::logger& Log() { return log::Get(log::Component::kControl); }

constexpr int kMaxServing = 64;
constexpr int kMaxServingPerUid = 4;  // one user's slow or idle connections block only that user
constexpr size_t kMaxRequest = 256;

void Reply(int conn, const std::string& why) {
  (void)::send(conn, why.data(), why.size(), MSG_NOSIGNAL);
}

}  // namespace

absl::StatusOr<std::unique_ptr<ControlFdServer>> ControlFdServer::Start(const std::string& path,
                                                                        SessionRegistry& sessions,
                                                                        ArenaDeposits& arenas,
                                                                        PeerPolicy policy) {
  ::unlink(path.c_str());  // the main socket's check (a live daemon answers there) came first
  CKPT_ASSIGN_OR_RETURN(UniqueFd fd, ListenUnix(path, SocketAccess{policy.allow_uids, policy.allow_gids}));
  std::unique_ptr<ControlFdServer> server(
      new ControlFdServer(path, std::move(fd), sessions, arenas, std::move(policy)));
  int pipe_fds[2];
  if (::pipe2(pipe_fds, O_CLOEXEC) != 0) return ErrnoStatus(errno, "liveness pipe");
  server->liveness_read_ = UniqueFd(pipe_fds[0]);
  server->liveness_write_ = UniqueFd(pipe_fds[1]);
  server->thread_ = std::thread([s = server.get()] { s->AcceptLoop(); });
  return server;
}

ControlFdServer::~ControlFdServer() { Stop(); }

void ControlFdServer::Stop() {
  stopping_ = true;
  if (fd_.valid()) ::shutdown(fd_.get(), SHUT_RDWR);  // wakes accept()
  if (thread_.joinable()) thread_.join();
  std::unique_lock lock(mu_);
  idle_.wait(lock, [this] { return serving_ == 0; });
  ::unlink(path_.c_str());
}

void ControlFdServer::AcceptLoop() {
  while (!stopping_) {
    UniqueFd conn(::accept4(fd_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!conn.valid()) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EMFILE || errno == ENFILE) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        continue;
      }
      return;
    }
    absl::StatusOr<PeerIdentity> caller = ReadPeerIdentity(conn.get());
    if (!caller.ok()) continue;
    if (!policy_.Allows(*caller)) {
      Log().warn("refused descriptor-socket connection from {}: not allowed (--allow-uid, "
                 "--allow-gid)",
                 caller->Describe());
      continue;  // closed before anything it sent was received
    }
    {
      std::lock_guard lock(mu_);
      int& mine = serving_of_uid_[caller->uid];
      if (serving_ >= kMaxServing || mine >= kMaxServingPerUid) {
        Reply(conn.get(), std::string(kBusy) + "too many descriptor-socket requests at once; retry");
        continue;
      }
      ++serving_;
      ++mine;
    }
    std::thread([this, c = std::move(conn), who = *caller]() mutable {
      Serve(std::move(c), who);
      std::lock_guard lock(mu_);
      if (--serving_of_uid_[who.uid] == 0) serving_of_uid_.erase(who.uid);
      if (--serving_ == 0) idle_.notify_all();
    }).detach();
  }
}

void ControlFdServer::Serve(UniqueFd conn, const PeerIdentity& caller) {
  timeval timeout{2, 0};  // a client that never speaks is dropped
  ::setsockopt(conn.get(), SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
  ::setsockopt(conn.get(), SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
  // Every descriptor received and not kept is closed by the reaper: closing one can block.
  std::vector<UniqueFd> refused;
  absl::StatusOr<ReceivedFds> request = RecvFds(conn.get(), kMaxPassedFds, kMaxRequest, &refused);
  if (!request.ok()) {
    Dispose(std::move(refused));
    Reply(conn.get(), "refused: " + Message(request.status()));
    return;
  }
  std::string_view text = request->payload;
  if (text == kDepositArenas) {
    return Deposit(conn.get(), caller, std::move(request->fds), ArenaDeposits::Kind::kArenas);
  }
  if (text == kDepositWriteProtect) {
    return Deposit(conn.get(), caller, std::move(request->fds), ArenaDeposits::Kind::kWriteProtect);
  }
  if (text == kDepositPayload) {
    return Deposit(conn.get(), caller, std::move(request->fds), ArenaDeposits::Kind::kPayload);
  }
  if (!request->fds.empty()) {
    Dispose(std::move(request->fds));
    Reply(conn.get(), "refused: descriptors are accepted only with an \"arenas\", "
                      "\"write-protect\" or \"payload\" request");
    return;
  }
  if (text.substr(0, kFetchControlBlock.size()) == kFetchControlBlock) {
    return SendControlBlock(conn.get(), caller, std::string(text.substr(kFetchControlBlock.size())));
  }
  if (text.substr(0, kFetchTrainState.size()) == kFetchTrainState) {
    return SendTrainState(conn.get(), caller, std::string(text.substr(kFetchTrainState.size())));
  }
  Reply(conn.get(), "refused: unknown request (expected \"control <session>\", "
                    "\"train-state <session>\", \"arenas\", \"write-protect\" or \"payload\")");
}

void ControlFdServer::Dispose(std::vector<UniqueFd> fds) {
  if (fds.empty()) return;
  if (!reaper_.Dispose(std::move(fds))) {
    Log().error("{} untrusted descriptors are waiting to be closed (a hostile filesystem's "
                "flush?); closing more on the serving thread",
                reaper_.queued());
  }
}

void ControlFdServer::Deposit(int conn, const PeerIdentity& caller, std::vector<UniqueFd> fds,
                              ArenaDeposits::Kind kind) {
  // Only what `kind` says (sealed shared memory, or a userfaultfd) goes further; anything
  // else is closed by the reaper.
  if (absl::Status ok = ArenaDeposits::Check(fds, kind); !ok.ok()) {
    Dispose(std::move(fds));
    Log().warn("descriptors refused from {}: {}", caller.Describe(), Message(ok));
    Reply(conn, "refused: " + Message(ok));
    return;
  }
  absl::StatusOr<std::string> token = arenas_.Put(caller, std::move(fds), kind);
  if (!token.ok()) {
    Log().warn("descriptors refused from {}: {}", caller.Describe(), Message(token.status()));
    Reply(conn, "refused: " + Message(token.status()));
    return;
  }
  Reply(conn, std::string(kDepositAccepted) + *token);
}

std::optional<SessionPtr> ControlFdServer::SessionOf(int conn, const PeerIdentity& caller,
                                                    const std::string& session_id, const char* what) {
  // Only the process that registered the session gets what is its own.
  absl::StatusOr<SessionPtr> session = sessions_.FindFor(session_id, caller);
  if (!session.ok()) {
    Log().warn("{} of session \"{}\" refused to {}: {}", what, session_id.substr(0, 64), caller.Describe(),
               Message(session.status()));
    Reply(conn, Message(session.status()));
    return std::nullopt;
  }
  return *std::move(session);
}

void ControlFdServer::SendControlBlock(int conn, const PeerIdentity& caller,
                                       const std::string& session_id) {
  std::optional<SessionPtr> session = SessionOf(conn, caller, session_id, "control block");
  if (!session) return;
  const int fds[2] = {(*session)->control_fd(), liveness_read_.get()};
  if (absl::Status sent = SendFds(conn, fds, "ok"); !sent.ok()) {
    Log().warn("could not hand session {} its control block: {}", session_id, Message(sent));
  }
}

void ControlFdServer::SendTrainState(int conn, const PeerIdentity& caller,
                                     const std::string& session_id) {
  // Like the control block, and once.
  std::optional<SessionPtr> session = SessionOf(conn, caller, session_id, "train state");
  if (!session) return;
  shm::SealedSegmentPtr state = (*session)->TakeRestoredTrainState();
  if (state == nullptr) {
    Reply(conn, fmt::format("session {} has no restored train state waiting (fetched already?)",
                            session_id));
    return;
  }
  const int fd = state->fd();
  if (absl::Status sent = SendFds(conn, {&fd, 1}, "ok"); !sent.ok()) {
    Log().warn("could not hand session {} its restored train state: {}", session_id, Message(sent));
    (*session)->SetRestoredTrainState(std::move(state));  // for the trainer's next try
  }
}

}  // namespace ckpt::daemon
