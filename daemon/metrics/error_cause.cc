#include "daemon/metrics/error_cause.h"

namespace ckpt::metrics {

std::string_view ErrorCause(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kUnavailable:
      return "unavailable";
    case absl::StatusCode::kDeadlineExceeded:
      return "timeout";
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kUnauthenticated:
      return "refused";
    case absl::StatusCode::kResourceExhausted:
      return "no_space";
    case absl::StatusCode::kNotFound:
      return "not_found";
    case absl::StatusCode::kDataLoss:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kAlreadyExists:
    case absl::StatusCode::kOutOfRange:
      return "corrupt";
    default:
      return "other";
  }
}

const std::vector<std::string_view>& ErrorCauses() {
  static const std::vector<std::string_view> kCauses = {"unavailable", "timeout", "refused", "no_space",
                                                        "not_found",   "corrupt", "other"};
  return kCauses;
}

}  // namespace ckpt::metrics
