// ckptd: per-node checkpoint daemon. See docs/operators.md.
#include <signal.h>

#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <optional>

#include "absl/synchronization/mutex.h"
#include "common/log.h"
#include "common/status.h"
#include "daemon/config.h"
#include "daemon/server.h"
#include "daemon/service_notify.h"

int main(int argc, char** argv) {
  using namespace ckpt;
  daemon::ParseResult parsed = daemon::ParseFlags(argc, argv);
  if (parsed.exit) {
    std::fputs(parsed.message.c_str(), parsed.exit_code == 0 ? stdout : stderr);
    return parsed.exit_code;
  }
  const daemon::Config& config = parsed.config;
  if (absl::Status valid = daemon::Validate(config); !valid.ok()) {
    std::cerr << "ckptd: invalid configuration: " << Message(valid) << "\n";
    return 2;
  }
  if (config.check_config) {
    std::cout << config.ToJson() << "\n";
    return 0;
  }
  log::SetLevel(config.log_level);
  // Debian's Abseil is built with its mutex deadlock detector on: every lock of gRPC's
  // absl::Mutex updates a global lock graph (2-3% of node 0's CPU at 10,000 nodes). The
  // TSan build (--config=tsan) is what finds lock-order problems.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);

  // Signals are taken synchronously by this thread; every other thread inherits the mask.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  // SIGHUP (a terminal closed, `systemctl reload`, logrotate's habit) must never kill a
  // daemon mid-save: ckptd logs to stderr (the journal reopens nothing), so it is logged
  // and ignored.
  sigaddset(&signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  ::signal(SIGPIPE, SIG_IGN);

  auto server = daemon::Server::Start(config);
  if (!server.ok()) {
    log::Get(log::Component::kMain).critical("cannot start: {}", Message(server.status()));
    return 1;
  }
  if (std::optional<std::chrono::microseconds> interval = daemon::WatchdogInterval()) {
    (*server)->StartWatchdog(*interval, [](const std::string& message) { daemon::Notify(message); });
  }
  // Ready for the service manager once trainers can be served: the socket answers, and in a
  // group the group is joined (a unit ordered after ckptd then starts into a working daemon).
  // A signal that stops the daemon, SIGHUP logged and passed over.
  auto stops = [](int sig) {
    if (sig != SIGHUP) return sig > 0;
    log::Get(log::Component::kMain)
        .info("received SIGHUP: ignored (ckptd logs to stderr and has no log file to reopen; SIGTERM stops it)");
    return false;
  };
  int sig = 0;
  const timespec tick{0, 200'000'000};
  std::string waiting_for;
  bool ready = false;
  while (!(ready = (*server)->WaitReady(std::chrono::milliseconds(0), &waiting_for))) {
    daemon::NotifyStatus(waiting_for);
    if (stops(sig = sigtimedwait(&signals, nullptr, &tick))) break;
  }
  if (ready) {
    daemon::NotifyReady(fmt::format("serving on {}", config.socket));
    do {
      sigwait(&signals, &sig);
    } while (!stops(sig));
  }
  log::Get(log::Component::kMain).info("received {}", sig == SIGTERM ? "SIGTERM" : "SIGINT");
  daemon::NotifyStopping();
  (*server)->Shutdown();
  return 0;
}
