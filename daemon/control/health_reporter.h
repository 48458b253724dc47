// What ckptd's gRPC health service answers (grpc.health.v1, for Kubernetes probes and
// `ckptctl health`), kept true every half second:
//   ""                  ready: serving, and in a group joined with every member alive;
//   "ckptd.v1.Trainer"  the same (what a trainer needs);
//   "ckptd.v1.Admin"    alive: SERVING whenever the admin service answers at all, even while
//                       the group is down or writes are slow, so a liveness probe on it
//                       never restarts a daemon that is busy or waiting for its group.
// Transitions are logged with the reason.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/server.h>

namespace ckpt::daemon {

class HealthReporter {
 public:
  // `not_ready` says why the daemon is not ready, or "" when it is.
  HealthReporter(std::vector<grpc::Server*> servers, std::function<std::string()> not_ready);
  ~HealthReporter();  // stops the thread; the servers must still be there

  // Checks now (and from then on every 500 ms).
  void Update();

 private:
  void Loop();

  const std::vector<grpc::Server*> servers_;
  const std::function<std::string()> not_ready_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;  // guarded by mu_
  std::optional<bool> ready_;  // as last logged; guarded by mu_
  std::thread thread_;
};

}  // namespace ckpt::daemon
