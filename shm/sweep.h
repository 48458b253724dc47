// Boost/POSIX shared memory outlives a crashed process. Segments are named
// "<prefix><pid>.<rest>"; this removes those whose creating process no longer exists.
#pragma once

#include <chrono>
#include <string_view>

namespace ckpt::shm {

// Returns how many segments were removed. A segment goes only when its pid looks dead, it is
// not held by its creator (Segment::Create's lock: a pid from another PID namespace looks
// dead here), and it has been unchanged for at least `min_age`.
int RemoveStaleSegments(std::string_view prefix,
                        std::chrono::seconds min_age = std::chrono::seconds(0));

}  // namespace ckpt::shm
