// The descriptor socket, "<socket>.ctl" (protocol in common/fd_passing.h): what gRPC cannot
// carry. Both directions are sealed memfds (shm/sealed_segment.h), which have no name to
// open and which the other side cannot shrink.
// - Before Register, a trainer hands over its arenas ("arenas" + descriptors) and gets a
//   token for them (ArenaDeposits), which only the same process can redeem in Register.
//   Its userfaultfd, for copy-on-write snapshots, travels the same way ("write-protect").
// - After Register, it asks for its control block ("control <session id>") and gets the
//   descriptor if, and only if, the kernel says it is the process that registered that
//   session; otherwise a line saying why. With it comes the read end of ckptd's liveness
//   pipe, whose write end only ckptd holds: it hangs up the moment ckptd exits, which a
//   waiting trainer sees at once, in any PID namespace (shm::CommandProducer).
// Peers are checked against the same policy as the gRPC socket's, when accepted, before
// anything they send is read. Each connection gets 2 s and its own short-lived thread (at
// most 64 at once, 4 per user, so one user's idle connections delay only that user).
// Descriptors received and not kept are closed by an FdReaper, never on a serving thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <map>
#include <optional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "common/fd_reaper.h"
#include "common/unique_fd.h"
#include "daemon/control/unix_listener.h"
#include "daemon/session/arena_deposits.h"
#include "daemon/session/session_registry.h"

namespace ckpt::daemon {

class ControlFdServer {
 public:
  // Binds `path` (mode 0660, like the main socket) and starts accepting.
  static absl::StatusOr<std::unique_ptr<ControlFdServer>> Start(const std::string& path,
                                                                SessionRegistry& sessions,
                                                                ArenaDeposits& arenas,
                                                                PeerPolicy policy);
  ~ControlFdServer();
  void Stop();

 private:
  ControlFdServer(std::string path, UniqueFd fd, SessionRegistry& sessions, ArenaDeposits& arenas,
                  PeerPolicy policy)
      : path_(std::move(path)), fd_(std::move(fd)), sessions_(sessions), arenas_(arenas),
        policy_(std::move(policy)) {}
  void AcceptLoop();
  void Serve(UniqueFd conn, const PeerIdentity& caller);
  void Dispose(std::vector<UniqueFd> fds);
  // The session `session_id` if `caller` registered it; answers why not otherwise.
  std::optional<SessionPtr> SessionOf(int conn, const PeerIdentity& caller, const std::string& session_id,
                                      const char* what);
  void SendControlBlock(int conn, const PeerIdentity& caller, const std::string& session_id);
  void SendTrainState(int conn, const PeerIdentity& caller, const std::string& session_id);
  void Deposit(int conn, const PeerIdentity& caller, std::vector<UniqueFd> fds,
               ArenaDeposits::Kind kind);

  std::string path_;
  UniqueFd fd_;
  SessionRegistry& sessions_;
  ArenaDeposits& arenas_;
  const PeerPolicy policy_;
  UniqueFd liveness_read_, liveness_write_;  // the pipe; nothing is ever written to it
  std::atomic<bool> stopping_{false};
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable idle_;
  int serving_ = 0;  // connection threads running; guarded by mu_
  std::map<uid_t, int> serving_of_uid_;  // guarded by mu_
  FdReaper reaper_;  // declared last: gone first, after the serving threads
};

}  // namespace ckpt::daemon
