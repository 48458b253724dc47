#include "client/ctl_exit.h"

#include <fmt/format.h>

namespace ckpt::ctl {
namespace {

bool Has(const std::string& text, const char* part) { return text.find(part) != std::string::npos; }

}  // namespace

int ExitFor(const grpc::Status& status) {
  switch (status.error_code()) {
    case grpc::StatusCode::OK: return kOk;
    case grpc::StatusCode::UNAVAILABLE:
    case grpc::StatusCode::DEADLINE_EXCEEDED: return kUnreachable;
    case grpc::StatusCode::DATA_LOSS: return kDamaged;
    default: return kError;
  }
}

int ExitFor(const absl::Status& status) {
  if (status.ok()) return kOk;
  if (absl::IsUnavailable(status) || absl::IsDeadlineExceeded(status)) return kUnreachable;
  if (absl::IsDataLoss(status)) return kDamaged;
  return kError;
}

std::string Explain(const grpc::Status& status, const std::string& where, int seconds) {
  const std::string& m = status.error_message();
  if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED || Has(m, "SETTINGS frame") ||
      Has(m, "Deadline Exceeded")) {
    return fmt::format("ckptd at {} did not answer within {} s (stopped, or overloaded?); a longer "
                       "--timeout waits more",
                       where, seconds);
  }
  if (status.error_code() == grpc::StatusCode::UNAVAILABLE) {
    if (Has(m, "No such file or directory")) {
      return fmt::format("no ckptd listens at {} (the socket does not exist): is ckptd running? "
                         "(--socket, or CKPTD_SOCKET)",
                         where);
    }
    if (Has(m, "Permission denied")) {
      return fmt::format("this user may not connect to ckptd at {} (permission denied): the socket (mode "
                         "0660) is for ckptd's group: join it",
                         where);
    }
    if (Has(m, "Connection refused")) {
      return fmt::format("nothing accepts connections at {} (connection refused): is ckptd "
                         "running there?",
                         where);
    }
    return fmt::format("cannot reach ckptd at {}: {}", where, m);
  }
  return m;
}

}  // namespace ckpt::ctl
