#include "common/status.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstring>

namespace ckpt {

absl::Status ErrnoStatus(int err, std::string_view what) {
  std::string message = fmt::format("{}: {} (errno {})", what, std::strerror(err), err);
  switch (err) {
    case ENOSPC:
    case EDQUOT:
    case ENOMEM:
      return absl::ResourceExhaustedError(message);
    case ENOENT:
      return absl::NotFoundError(message);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(message);
    case EEXIST:
      return absl::AlreadyExistsError(message);
    case EINVAL:
      return absl::InvalidArgumentError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::Status Annotate(const absl::Status& status, std::string_view context) {
  if (status.ok()) return status;
  return absl::Status(status.code(), fmt::format("{}: {}", context, Message(status)));
}

std::string Message(const absl::Status& status) { return std::string(status.message()); }

}  // namespace ckpt
