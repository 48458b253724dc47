#include "common/status.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

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

std::string Truncated(std::string_view message, size_t max) {
  if (message.size() <= max) return std::string(message);
  constexpr std::string_view kCut = " ... (cut: {} more bytes; the whole message is in ckptd's log)";
  const size_t room = max > kCut.size() + 8 ? max - kCut.size() - 8 : 0;
  size_t end = room;
  // Never between the bytes of one UTF-8 character (continuation bytes are 10xxxxxx).
  while (end > 0 && (static_cast<unsigned char>(message[end]) & 0xC0) == 0x80) --end;
  return fmt::format("{}{}", message.substr(0, end), fmt::format(fmt::runtime(kCut), message.size() - end));
}

std::string JoinSome(const std::vector<std::string>& items, size_t shown, std::string_view separator) {
  if (items.size() <= shown) return fmt::format("{}", fmt::join(items, separator));
  return fmt::format("{} and {} more", fmt::join(items.begin(), items.begin() + shown, separator),
                     items.size() - shown);
}

}  // namespace ckpt
