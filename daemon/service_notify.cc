#include "daemon/service_notify.h"

#include <systemd/sd-daemon.h>

namespace ckpt::daemon {
namespace {

void Notify(const std::string& state) {
  // 0: keep $NOTIFY_SOCKET for the next message. Failures are the manager's to see.
  (void)sd_notify(0, state.c_str());
}

}  // namespace

void NotifyStatus(const std::string& status) { Notify("STATUS=" + status); }

void NotifyReady(const std::string& status) { Notify("READY=1\nSTATUS=" + status); }

void NotifyStopping() { Notify("STOPPING=1\nSTATUS=shutting down: finishing in-flight writes"); }

}  // namespace ckpt::daemon
