// The cause label of ckptd_upload_errors_total and ckptd_replication_errors_total: a small,
// fixed set read from an error's status code, so that an alert tells a store or peer that
// does not answer (unavailable, timeout) from one that refuses ckptd (refused), one that is
// full (no_space) and data that came back damaged (corrupt), without a label per message.
#pragma once

#include <string_view>
#include <vector>

#include "absl/status/status.h"

namespace ckpt::metrics {

// "unavailable" (could not connect, connection dropped, peer not in the group), "timeout"
// (no answer in time), "refused" (credentials or permissions), "no_space" (a store, quota
// or peer memory full), "not_found", "corrupt" (damaged or unexpected data), "other".
std::string_view ErrorCause(const absl::Status& status);

// Every value ErrorCause returns, in the order exported.
const std::vector<std::string_view>& ErrorCauses();

}  // namespace ckpt::metrics
