// Tells the service manager how ckptd is doing (systemd's Type=notify, through libsystemd's
// sd_notify): READY once trainers can be served (and, in a group, the group joined),
// STOPPING on shutdown, STATUS lines while waiting. Without $NOTIFY_SOCKET (not started by
// systemd) every call does nothing.
#pragma once

#include <string>

namespace ckpt::daemon {

void NotifyStatus(const std::string& status);
void NotifyReady(const std::string& status);
void NotifyStopping();

}  // namespace ckpt::daemon
