// Calls to several peers at once, one thread each: what the replicator's sends and seals
// and a replacement's surveys and fetches all do, so that a slow peer costs its own call's
// time once rather than once per peer.
#pragma once

#include <cstddef>
#include <functional>
#include <vector>

#include "absl/status/status.h"

namespace ckpt::replicate {

// Runs call(i) for every i in [0, count) on threads of their own, at most `at_once` at a
// time, and returns each call's status. A call that throws (a buffer that cannot be had)
// fails alone, as ResourceExhausted, never the daemon.
std::vector<absl::Status> RunEach(size_t count, size_t at_once, const std::function<absl::Status(size_t)>& call);

}  // namespace ckpt::replicate
