// Boost/POSIX shared memory outlives a crashed process. Segments are named
// "<prefix><pid>.<rest>"; this removes those whose creating process no longer exists.
#pragma once

#include <chrono>
#include <string_view>

namespace ckpt::shm {

// Returns how many segments were removed. Only segments unchanged for at least `min_age`
// go: a pid that looks dead may be alive in another PID namespace, and its segment fresh.
int RemoveStaleSegments(std::string_view prefix,
                        std::chrono::seconds min_age = std::chrono::seconds(0));

}  // namespace ckpt::shm
