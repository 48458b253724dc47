#include "daemon/root_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cerrno>
#include <cstring>
#include <string>

namespace ckpt::daemon {

absl::StatusOr<std::unique_ptr<RootLock>> RootLock::Acquire(const std::string& root,
                                                            const std::string& name) {
  std::string path = root + "/" + name;
  UniqueFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644));
  if (!fd.valid()) {
    return absl::PermissionDeniedError(
        fmt::format("--root {}: cannot open the lock file {}: {}", root, path, std::strerror(errno)));
  }
  if (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
    if (errno != EWOULDBLOCK) {
      return absl::InternalError(fmt::format("--root {}: lock {}: {}", root, path, std::strerror(errno)));
    }
    char holder[32] = {};
    ssize_t n = ::pread(fd.get(), holder, sizeof(holder) - 1, 0);
    std::string pid = n > 0 ? std::string(holder, static_cast<size_t>(n)) : "?";
    while (!pid.empty() && (pid.back() == '\n' || pid.back() == ' ')) pid.pop_back();
    return absl::FailedPreconditionError(fmt::format(
        "another ckptd (pid {}) is using --root {}: two daemons on one root would remove each "
        "other's unfinished steps; give each daemon its own root",
        pid, root));
  }
  std::string pid = fmt::format("{}\n", ::getpid());
  if (::ftruncate(fd.get(), 0) != 0 ||
      ::pwrite(fd.get(), pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
    return absl::InternalError(fmt::format("--root {}: write {}: {}", root, path, std::strerror(errno)));
  }
  return std::unique_ptr<RootLock>(new RootLock(std::move(fd)));
}

}  // namespace ckpt::daemon
