// Hands each session's control block to its trainer as a file descriptor. A control block
// is a sealed memfd (shm/sealed_segment.h): it has no name to open, and the trainer could
// not shrink it even with the descriptor. After Register, the trainer connects to
// "<socket>.ctl", sends its session id, and gets the descriptor (SCM_RIGHTS) if, and only
// if, the kernel says it is the process that registered that session; otherwise a line
// saying why. Each connection gets 2 s and its own short-lived thread (at most 64 at once).
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "common/unique_fd.h"
#include "daemon/session/session_registry.h"

namespace ckpt::daemon {

class ControlFdServer {
 public:
  // The socket path next to the trainers' socket.
  static std::string PathFor(const std::string& socket) { return socket + ".ctl"; }

  // Binds `path` (mode 0660, like the main socket) and starts accepting.
  static absl::StatusOr<std::unique_ptr<ControlFdServer>> Start(const std::string& path,
                                                                SessionRegistry& sessions);
  ~ControlFdServer();
  void Stop();

 private:
  ControlFdServer(std::string path, UniqueFd fd, SessionRegistry& sessions)
      : path_(std::move(path)), fd_(std::move(fd)), sessions_(sessions) {}
  void AcceptLoop();
  void Serve(UniqueFd conn);

  std::string path_;
  UniqueFd fd_;
  SessionRegistry& sessions_;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable idle_;
  int serving_ = 0;  // connection threads running; guarded by mu_
};

}  // namespace ckpt::daemon
