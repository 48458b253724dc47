// Errors are values at module boundaries: absl::Status / absl::StatusOr (STYLE.md #3).
#pragma once

#include <string>
#include <string_view>

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
