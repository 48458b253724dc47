// The running daemon: the only place that picks concrete implementations (filesystem,
// copy engine, shard writer) and wires the stages together.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/config.h"
#include "daemon/watchdog.h"

namespace ckpt::daemon {

class Server {
 public:
  struct Parts;  // every stage, in dependency order (server.cc)

  static absl::StatusOr<std::unique_ptr<Server>> Start(const Config& config);
  ~Server();

  // Whether the daemon is ready for its trainers: always on one node; in a group, once this
  // node has joined (waits up to `timeout` for that). What it waits for, in `waiting_for`.
  bool WaitReady(std::chrono::milliseconds timeout, std::string* waiting_for) const;

  // systemd's watchdog (watchdog.h): WATCHDOG=1 through `notify` every `interval` while
  // the sessions, staged copies, write queue, committer and the trainers' socket answer.
  void StartWatchdog(std::chrono::microseconds interval, Watchdog::Notify notify);

  // Stops accepting, lets in-flight writes finish (up to --shutdown-timeout-ms), aborts the
  // rest and ends every session. Idempotent.
  void Shutdown();

 private:
  explicit Server(std::unique_ptr<Parts> parts);
  std::unique_ptr<Parts> parts_;
};

}  // namespace ckpt::daemon
