// Errors are values at module boundaries: absl::Status / absl::StatusOr (STYLE.md #3).
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ckpt {

// A status for a failed system call: "<what>: <strerror> (errno N)". ENOSPC/EDQUOT map to
// ResourceExhausted, ENOENT to NotFound, EACCES/EPERM to PermissionDenied.
absl::Status ErrnoStatus(int err, std::string_view what);

// The message as a std::string (Debian's Abseil has its own string_view type).
std::string Message(const absl::Status& status);

// Prefixes a status message with context, keeping its code.
absl::Status Annotate(const absl::Status& status, std::string_view context);

// The most of an error message that crosses gRPC. gRPC carries a status message in a header
// (percent-encoded: up to 3 bytes per byte) and a client refuses headers over 8 KiB with a
// transport error of its own ("received initial metadata size exceeds limit") in place of
// the message: so a message is cut well below that, whatever produced it.
inline constexpr size_t kMaxWireMessageBytes = 2000;

// `message` cut to at most `max` bytes at a UTF-8 character boundary, saying how much was
// left out (so a cut message is never taken for the whole one).
std::string Truncated(std::string_view message, size_t max = kMaxWireMessageBytes);

// "a, b, c and 7 more": the first `shown` items, and how many were left out; a list of
// problems in an error stays short and says how long it was.
std::string JoinSome(const std::vector<std::string>& items, size_t shown, std::string_view separator = ", ");

}  // namespace ckpt

#define CKPT_STATUS_CONCAT_INNER(a, b) a##b
#define CKPT_STATUS_CONCAT(a, b) CKPT_STATUS_CONCAT_INNER(a, b)

#define CKPT_RETURN_IF_ERROR(expr)              \
  do {                                          \
    if (absl::Status _st = (expr); !_st.ok()) { \
      return _st;                               \
    }                                           \
  } while (0)

// Expands to several statements: after `if`, always use braces.
#define CKPT_ASSIGN_OR_RETURN(lhs, expr) \
  CKPT_ASSIGN_OR_RETURN_IMPL(CKPT_STATUS_CONCAT(_status_or_, __LINE__), lhs, expr)

#define CKPT_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                               \
  if (!tmp.ok()) {                                 \
    return std::move(tmp).status();                \
  }                                                \
  lhs = std::move(tmp).value()
