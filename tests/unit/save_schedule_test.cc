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
  auto other = schedule.Decide(Ask(1, 20s), t0 + 1s);
  CHECK(absl::IsInvalidArgument(other.status()));
  CHECK_THAT(Message(other.status()), Catch::Contains("20000 ms") && Catch::Contains("10000 ms"));
  auto zero = schedule.Decide(Ask(1, 0ms), t0);
  CHECK(absl::IsInvalidArgument(zero.status()));
  CHECK_THAT(Message(zero.status()), Catch::Contains("positive"));
}

TEST_CASE("save schedule: a job restarted with another interval gets a clock of its own") {
  SaveSchedule schedule;
  TimePoint t0{};
  REQUIRE(schedule.Decide(Ask(1, 10s), t0).ok());
  REQUIRE(schedule.Decide(Ask(2, 10s), t0 + 1s).ok());
  // It crashed before its first save and comes back a minute later with 20 s.
  CHECK(*schedule.Decide(Ask(1, 20s), t0 + 60s) == false);
  CHECK(*schedule.Decide(Ask(2, 20s), t0 + 75s) == false);
  CHECK(*schedule.Decide(Ask(3, 20s), t0 + 80s) == true);
}

TEST_CASE("save schedule: memory is bounded; a step older than what is remembered is refused") {
  SaveSchedule schedule(SaveSchedule::Options{.saves_per_run = 2, .runs = 2, .runs_per_job = 2,
                                              .idle = 1h});
  TimePoint t0{};
  for (uint64_t step = 1; step <= 6; ++step) {
    REQUIRE(schedule.Decide(Ask(step), t0 + step * 10s).ok());  // saves at 2..6
  }
  auto ancient = schedule.Decide(Ask(3), t0 + 70s);
  CHECK(absl::IsFailedPrecondition(ancient.status()));
  CHECK_THAT(Message(ancient.status()), Catch::Contains("step 3"));
  CHECK(*schedule.Decide(Ask(5), t0 + 70s) == true);  // still remembered
  CHECK(*schedule.Decide(Ask(6), t0 + 70s) == true);
  // The table is full of runs asked within the hour: a new one is refused rather than
  // breaking a running job's decisions.
  REQUIRE(schedule.Decide(Ask(1, 10s, 0, "b"), t0 + 70s).ok());
  auto full = schedule.Decide(Ask(1, 10s, 0, "c"), t0 + 80s);
  CHECK(absl::IsResourceExhausted(full.status()));
  CHECK_THAT(Message(full.status()), Catch::Contains("job c"));
  // An hour later the least recently asked run ("job") makes room.
  CHECK(schedule.Decide(Ask(1, 10s, 0, "b"), t0 + 2h).ok());
  CHECK(schedule.Decide(Ask(1, 10s, 0, "c"), t0 + 2h).ok());
  CHECK(*schedule.Decide(Ask(7, 10s), t0 + 4h) == false);  // "job" starts again from scratch
}

TEST_CASE("save schedule: a job's runs beyond its share push out its own oldest, not others'") {
  SaveSchedule schedule(SaveSchedule::Options{.runs = 3, .runs_per_job = 2});
  TimePoint t0{};
  REQUIRE(schedule.Decide(Ask(1, 10s, 0, "victim"), t0).ok());
  CHECK(*schedule.Decide(Ask(2, 10s, 0, "victim"), t0 + 10s) == true);
  for (uint64_t run = 0; run < 50; ++run) {
    REQUIRE(schedule.Decide(Ask(1, 10s, run, "noisy"), t0 + 11s).ok());
  }
  CHECK(*schedule.Decide(Ask(2, 10s, 0, "victim"), t0 + 12s) == true);  // still remembered
}
