// Boost/POSIX shared memory outlives a crashed process. Segments are named
// "<prefix><pid>.<rest>"; this removes those whose creating process no longer exists.
#pragma once

#include <string_view>

namespace ckpt::shm {

// Returns how many segments were removed.
int RemoveStaleSegments(std::string_view prefix);

}  // namespace ckpt::shm
