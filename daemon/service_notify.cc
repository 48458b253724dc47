#include "daemon/service_notify.h"

#include <systemd/sd-daemon.h>

namespace ckpt::daemon {

void Notify(const std::string& message) {
  // 0: keep $NOTIFY_SOCKET for the next message. Failures are the manager's to see.
  (void)sd_notify(0, message.c_str());
}

void NotifyStatus(const std::string& status) { Notify("STATUS=" + status); }

void NotifyReady(const std::string& status) { Notify("READY=1\nSTATUS=" + status); }

void NotifyStopping() { Notify("STOPPING=1\nSTATUS=shutting down: finishing in-flight writes"); }

std::optional<std::chrono::microseconds> WatchdogInterval() {
  uint64_t usec = 0;
  // 0: keep $WATCHDOG_USEC; it is checked against $WATCHDOG_PID when that is set.
  if (sd_watchdog_enabled(0, &usec) <= 0 || usec == 0) return std::nullopt;
  return std::chrono::microseconds(usec / 2);
}

}  // namespace ckpt::daemon
