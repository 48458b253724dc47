#include "daemon/root_probe.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "common/status.h"
#include "common/unique_fd.h"

namespace ckpt::daemon {
namespace {

absl::Status Unwritable(const std::string& root, const std::string& what, int err) {
  const std::string cause = fmt::format("{}: {}", what, std::strerror(err));
  if (err == EROFS) {
    return absl::FailedPreconditionError(fmt::format(
        "--root {0} is on a file system that is read-only to ckptd ({1}). Under the shipped systemd "
        "unit (ProtectSystem=strict) only ReadWritePaths= are writable (/var/lib/ckptd and /run/ckptd): "
        "add the root with a drop-in, `sudo systemctl edit ckptd`, writing\n"
        "[Service]\n"
        "ReadWritePaths={0}\n"
        "then `sudo systemctl restart ckptd` (docs/operators.md, \"systemd\"). Otherwise the file system "
        "itself is mounted read-only: remount it read-write.",
        root, cause));
  }
  if (err == EACCES || err == EPERM) {
    return absl::PermissionDeniedError(fmt::format(
        "--root {} is not writable by ckptd (uid {}, gid {}): {}. Give it to ckptd's user (`sudo chown "
        "ckptd:ckptd {}`, mode 0750) or choose a root that is",
        root, ::geteuid(), ::getegid(), cause, root));
  }
  return ErrnoStatus(err, fmt::format("--root {}: {}", root, what));
}

}  // namespace

absl::Status CheckRootWritable(const std::string& root) {
  std::error_code ec;
  std::filesystem::create_directories(root, ec);
  if (ec) return Unwritable(root, "create the directory", ec.value());
  // An unnamed file first (O_TMPFILE): a crash leaves nothing behind. File systems without
  // it get a named file, this process's own, removed at once.
  std::string probe = fmt::format("an unnamed file in {}", root);
  bool named = false;
  UniqueFd fd(::open(root.c_str(), O_TMPFILE | O_WRONLY | O_CLOEXEC, 0600));
  if (!fd.valid() && (errno == EOPNOTSUPP || errno == EISDIR || errno == EINVAL || errno == ENOTSUP)) {
    probe = fmt::format("{}/.ckptd-write-probe.{}", root, ::getpid());
    named = true;
    fd = UniqueFd(::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600));
  }
  if (!fd.valid()) return Unwritable(root, fmt::format("create {}", probe), errno);
  const char byte = 'x';
  int err = 0;
  if (::write(fd.get(), &byte, 1) != 1) {
    err = errno != 0 ? errno : EIO;
  } else if (::fsync(fd.get()) != 0) {
    err = errno;
  }
  fd = UniqueFd();
  if (named && ::unlink(probe.c_str()) != 0 && errno != ENOENT && err == 0) err = errno;
  if (err != 0) return Unwritable(root, fmt::format("write and fsync {}", probe), err);
  return absl::OkStatus();
}

}  // namespace ckpt::daemon
