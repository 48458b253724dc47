// systemd's watchdog (WatchdogSec=, docs/operators.md "systemd"): WATCHDOG=1 goes to the
// service manager only while ckptd's data path is seen working, not merely while the
// process lives.
//
// A prober thread runs the stages' probes in turn, a round every quarter interval. Each
// probe asks its stage what its callers ask it, under the same lock (the sessions, the
// staged copies, the write queue, the committer), or asks the gRPC server on the trainers'
// socket for its health, as a trainer would. A round that completes is a progress mark. A
// pinger thread sends WATCHDOG=1 every interval (half of WatchdogSec) while the last mark is
// younger than the interval; otherwise it skips the ping, and the log and STATUS= say which
// probe has not returned (or failed) and for how long. A stage wedged on a lock holds its
// probe and so the prober: the marks stop, the pings stop, and systemd restarts ckptd after
// WatchdogSec (a wedged daemon serves no trainer; its hot copies are lost, nothing
// committed is). A store that is slow or hangs is no wedge: probes never touch storage, and
// a write that stalls is failed and reported by its own timeouts.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"

namespace ckpt::daemon {

struct LivenessProbe {
  std::string name;                     // the stage it asks: "sessions", "persist", ...
  std::function<absl::Status()> check;  // returns once the stage answered; an error fails the round
};

class Watchdog {
 public:
  using Notify = std::function<void(const std::string&)>;  // an sd_notify message

  // Pings through `notify` every `interval` while the probes' rounds complete.
  Watchdog(std::chrono::microseconds interval, std::vector<LivenessProbe> probes, Notify notify);
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // The start of shutdown: probing stops (the stages are going) once the round in progress
  // returns; pings go on unconditionally, since TimeoutStopSec= bounds the stop.
  void StopProbing();

 private:
  void ProbeLoop();
  void PingLoop();

  const std::chrono::microseconds interval_;
  const std::vector<LivenessProbe> probes_;
  const Notify notify_;

  std::mutex mu_;
  std::condition_variable wake_;
  bool stop_probing_ = false;                        // guarded by mu_
  bool stop_ = false;                                // guarded by mu_
  std::chrono::steady_clock::time_point last_mark_;  // guarded by mu_: the last complete round
  std::string probing_;                              // guarded by mu_: the probe running now
  std::chrono::steady_clock::time_point probing_since_;  // guarded by mu_
  std::string last_failure_;                         // guarded by mu_: why the last round failed
  std::thread prober_;
  std::thread pinger_;  // last: both threads start once everything above exists
};

}  // namespace ckpt::daemon
