// The job's save clock: one decision per step for every rank, on the clock it is given.
#include <catch2/catch.hpp>

#include "common/status.h"
#include "daemon/schedule/save_schedule.h"

using namespace ckpt;
using namespace ckpt::daemon;
using namespace std::chrono_literals;
using TimePoint = SaveSchedule::TimePoint;

namespace {

SaveQuestion Ask(uint64_t step, std::chrono::milliseconds interval = 10s, uint64_t run = 0,
                 std::string job = "job") {
  return {std::move(job), run, step, interval};
}

}  // namespace

TEST_CASE("save schedule: a step is a save once the interval has passed, on the table's clock") {
  SaveSchedule schedule;
  TimePoint t0{};
  CHECK(*schedule.Decide(Ask(1), t0) == false);  // the run's first question starts its clock
  CHECK(*schedule.Decide(Ask(2), t0 + 9s) == false);
  CHECK(*schedule.Decide(Ask(3), t0 + 10s) == true);
  CHECK(*schedule.Decide(Ask(4), t0 + 19s) == false);  // measured from the last save
  CHECK(*schedule.Decide(Ask(5), t0 + 20s) == true);
}

TEST_CASE("save schedule: every later question about a step gets the first answer") {
  SaveSchedule schedule;
  TimePoint t0{};
  CHECK(*schedule.Decide(Ask(1), t0) == false);
  // Rank 0 reaches step 7 just before the interval ends, rank 1 just after: both hear "no",
  // and the save moves to the next step for both.
  CHECK(*schedule.Decide(Ask(7), t0 + 9'999ms) == false);
  CHECK(*schedule.Decide(Ask(7), t0 + 10'500ms) == false);
  CHECK(*schedule.Decide(Ask(8), t0 + 10'600ms) == true);
  CHECK(*schedule.Decide(Ask(8), t0 + 30s) == true);  // a slow rank, much later
  CHECK(*schedule.Decide(Ask(7), t0 + 30s) == false);
}

TEST_CASE("save schedule: jobs and runs keep clocks of their own") {
  SaveSchedule schedule;
  TimePoint t0{};
  CHECK(*schedule.Decide(Ask(1, 10s, 0, "a"), t0) == false);
  CHECK(*schedule.Decide(Ask(1, 10s, 0, "b"), t0 + 5s) == false);
  CHECK(*schedule.Decide(Ask(2, 10s, 0, "a"), t0 + 10s) == true);
  CHECK(*schedule.Decide(Ask(2, 10s, 0, "b"), t0 + 10s) == false);
  // Job a restarts from its step 2: it repeats step 3 and decides it afresh, instead of
  // replaying what the crashed run decided.
  CHECK(*schedule.Decide(Ask(3, 10s, 0, "a"), t0 + 20s) == true);
  CHECK(*schedule.Decide(Ask(3, 10s, 2, "a"), t0 + 21s) == false);
  CHECK(*schedule.Decide(Ask(4, 10s, 2, "a"), t0 + 31s) == true);
}

TEST_CASE("save schedule: ranks with different intervals are an error naming both") {
  SaveSchedule schedule;
  TimePoint t0{};
  REQUIRE(schedule.Decide(Ask(1, 10s), t0).ok());
  auto other = schedule.Decide(Ask(1, 20s), t0);
  CHECK(absl::IsInvalidArgument(other.status()));
  CHECK_THAT(Message(other.status()), Catch::Contains("20000 ms") && Catch::Contains("10000 ms"));
  auto zero = schedule.Decide(Ask(1, 0ms), t0);
  CHECK(absl::IsInvalidArgument(zero.status()));
  CHECK_THAT(Message(zero.status()), Catch::Contains("positive"));
}

TEST_CASE("save schedule: memory is bounded; a step older than what is remembered is refused") {
  SaveSchedule schedule(SaveSchedule::Options{.steps_per_run = 4, .runs = 2});
  TimePoint t0{};
  for (uint64_t step = 1; step <= 6; ++step) REQUIRE(schedule.Decide(Ask(step), t0).ok());
  auto ancient = schedule.Decide(Ask(1), t0);
  CHECK(absl::IsFailedPrecondition(ancient.status()));
  CHECK_THAT(Message(ancient.status()), Catch::Contains("step 1"));
  CHECK(schedule.Decide(Ask(5), t0).ok());  // still remembered
  // A third run forgets the least recently asked one.
  REQUIRE(schedule.Decide(Ask(1, 10s, 0, "b"), t0).ok());
  REQUIRE(schedule.Decide(Ask(1, 10s, 0, "c"), t0).ok());
  CHECK(schedule.Decide(Ask(1, 10s, 0, "b"), t0).ok());
  // "job" was forgotten: its clock starts again, so the interval has not passed.
  CHECK(*schedule.Decide(Ask(6, 10s), t0 + 10s) == false);
}
