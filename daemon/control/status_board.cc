#include "daemon/control/status_board.h"

#include <chrono>
#include <ctime>

#include <fmt/chrono.h>
#include <fmt/format.h>

namespace ckpt::daemon {

void StatusBoard::RecordError(std::string message) {
  std::string stamped =
      fmt::format("{:%Y-%m-%dT%H:%M:%SZ} {}", fmt::gmtime(std::time(nullptr)), message);
  std::lock_guard lock(mu_);
  errors_.push_back(std::move(stamped));
  while (errors_.size() > kMaxErrors) errors_.pop_front();
}

std::vector<std::string> StatusBoard::RecentErrors() const {
  std::lock_guard lock(mu_);
  return {errors_.begin(), errors_.end()};
}

}  // namespace ckpt::daemon
