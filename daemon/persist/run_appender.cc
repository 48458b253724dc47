#include "daemon/persist/run_appender.h"

#include <utility>

#include "common/status.h"

namespace ckpt::persist {

RunAppender::RunAppender(storage::ObjectWriter& object, std::function<void()> between_writes)
    : object_(object), between_writes_(std::move(between_writes)) {}

absl::Status RunAppender::Add(const char* from, uint64_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  if (pending_ > 0 && from != start_ + pending_) CKPT_RETURN_IF_ERROR(Flush());
  if (pending_ == 0) start_ = from;
  pending_ += bytes;
  while (pending_ >= kRunWriteBytes) CKPT_RETURN_IF_ERROR(Write(kRunWriteBytes));
  return absl::OkStatus();
}

absl::Status RunAppender::Flush() { return pending_ > 0 ? Write(pending_) : absl::OkStatus(); }

absl::Status RunAppender::Write(uint64_t bytes) {
  if (between_writes_) between_writes_();
  CKPT_RETURN_IF_ERROR(object_.Append(start_, bytes));
  start_ += bytes;
  pending_ -= bytes;
  return absl::OkStatus();
}

}  // namespace ckpt::persist
