// Questions about jobs' owners (owner_source.h) that may take long, asked on a thread of
// their own so that no registration or admin call waits on them under a lock.
#pragma once

#include <optional>

#include "absl/status/statusor.h"
#include "common/slow_questions.h"
#include "daemon/session/owner_source.h"

namespace ckpt::daemon {

using OwnerQueries = SlowQuestions<absl::StatusOr<std::optional<KnownOwner>>>;

}  // namespace ckpt::daemon
