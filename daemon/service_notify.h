// Tells the service manager how ckptd is doing (systemd's Type=notify, through libsystemd's
// sd_notify): READY once trainers can be served (and, in a group, the group joined),
// STOPPING on shutdown, STATUS lines while waiting, WATCHDOG=1 while the data path answers
// (watchdog.h). Without $NOTIFY_SOCKET (not started by systemd) every call does nothing.
#pragma once

#include <chrono>
#include <optional>
#include <string>

namespace ckpt::daemon {

void NotifyStatus(const std::string& status);
void NotifyReady(const std::string& status);
void NotifyStopping();
// Any message ("WATCHDOG=1", "STATUS=...").
void Notify(const std::string& message);

// How often to send WATCHDOG=1 (half of $WATCHDOG_USEC, as sd_watchdog_enabled(3)
// advises), or nullopt when the service manager expects none (no WatchdogSec=).
std::optional<std::chrono::microseconds> WatchdogInterval();

}  // namespace ckpt::daemon
