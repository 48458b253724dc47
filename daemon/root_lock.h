// One daemon per checkpoint root. Two daemons on one root would each take the other's
// unfinished step-N.tmp for leftovers of a crash and remove it, and both would apply
// retention; so the root is locked (flock) for the daemon's lifetime, and a second daemon
// fails at start-up naming the first.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/unique_fd.h"

namespace ckpt::daemon {

class RootLock {
 public:
  // Locks `<root>/<name>` (created if missing) and writes this process's pid into it.
  // FailedPrecondition naming the holder's pid when another process holds it.
  static absl::StatusOr<std::unique_ptr<RootLock>> Acquire(const std::string& root,
                                                           const std::string& name);

 private:
  explicit RootLock(UniqueFd fd) : fd_(std::move(fd)) {}
  UniqueFd fd_;  // the lock lives as long as this descriptor
};

}  // namespace ckpt::daemon
