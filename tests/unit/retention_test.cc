#include <catch2/catch.hpp>

#include "daemon/persist/retention.h"

using ckpt::persist::RetentionPolicy;
using ckpt::persist::StepsToDelete;
using Steps = std::vector<uint64_t>;

TEST_CASE("keep_last keeps the newest K") {
  CHECK(StepsToDelete({10, 20, 30, 40, 50}, {2, 0}) == Steps{10, 20, 30});
  CHECK(StepsToDelete({10, 20}, {2, 0}).empty());
  CHECK(StepsToDelete({}, {2, 0}).empty());
}

TEST_CASE("keep_last 0 keeps everything") {
  CHECK(StepsToDelete({1, 2, 3, 4}, {0, 0}).empty());
}

TEST_CASE("keep_every also keeps steps divisible by N") {
  CHECK(StepsToDelete({10, 20, 30, 40, 50, 60}, {2, 20}) == Steps{10, 30});
}

TEST_CASE("the newest checkpoint is never deleted") {
  for (uint32_t k = 1; k < 5; ++k) {
    Steps doomed = StepsToDelete({5, 6, 7, 8, 9}, {k, 0});
    CHECK(std::find(doomed.begin(), doomed.end(), 9) == doomed.end());
  }
}

TEST_CASE("pinned steps (being restored or verified) survive") {
  CHECK(StepsToDelete({10, 20, 30, 40}, {1, 0}, {20}) == Steps{10, 30});
}

TEST_CASE("an ephemeral step goes once a newer one commits, whatever else would keep it") {
  // keep everything, yet 20 and 40 (ephemeral, not the latest) go
  CHECK(StepsToDelete({10, 20, 30, 40, 50}, {0, 0}, {}, {20, 40}) == Steps{20, 40});
  // the latest stays even when ephemeral: it is the restart point until the next commits
  CHECK(StepsToDelete({10, 20}, {0, 0}, {}, {20}).empty());
  // keep_every does not keep an ephemeral step; keep_last's own choices are unchanged
  CHECK(StepsToDelete({10, 20, 30, 40}, {2, 10}, {}, {20}) == Steps{20});
  // a pinned ephemeral step (being restored) waits
  CHECK(StepsToDelete({10, 20, 30}, {0, 0}, {20}, {20}).empty());
}
