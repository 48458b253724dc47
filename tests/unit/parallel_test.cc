#include "common/parallel.h"

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>

#include <catch2/catch.hpp>

namespace ckpt {
namespace {

using namespace std::chrono_literals;

TEST_CASE("at most N jobs run at once, and every job runs") {
  std::atomic<int> running = 0, most = 0, done = 0;
  Parallel jobs(3);
  for (int i = 0; i < 20; ++i) {
    REQUIRE(jobs.Run([&] {
      const int now = ++running;
      int seen = most.load();
      while (now > seen && !most.compare_exchange_weak(seen, now)) {}
      std::this_thread::sleep_for(20ms);
      --running;
      ++done;
      return absl::OkStatus();
    }).ok());
  }
  REQUIRE(jobs.Wait().ok());
  CHECK(done == 20);
  CHECK(most == 3);
}

TEST_CASE("a slot is reused as soon as any job ends, not only the oldest") {
  // The first job holds its slot until every short one has run (or 5 s pass): with slots
  // that wait for the oldest job, the short ones cannot all start before it ends.
  std::atomic<int> short_done = 0;
  bool saw_all = false;
  Parallel jobs(2);
  REQUIRE(jobs.Run([&] {
    const auto deadline = std::chrono::steady_clock::now() + 5s;
    while (short_done < 10 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
    saw_all = short_done == 10;
    return absl::OkStatus();
  }).ok());
  for (int i = 0; i < 10; ++i) {
    REQUIRE(jobs.Run([&] {
      ++short_done;
      return absl::OkStatus();
    }).ok());
  }
  REQUIRE(jobs.Wait().ok());
  CHECK(saw_all);
}

TEST_CASE("a failed job stops what comes after it and is the error; a throwing job is one too") {
  Parallel jobs(1);
  REQUIRE(jobs.Run([] { return absl::UnavailableError("the store went away"); }).ok());
  bool started = false;
  absl::Status next = jobs.Run([&] {
    started = true;
    return absl::OkStatus();
  });
  CHECK(absl::IsUnavailable(next));
  CHECK_FALSE(started);
  CHECK(absl::IsUnavailable(jobs.Wait()));
  // Forgotten after Wait(): the next round starts clean.
  REQUIRE(jobs.Run([]() -> absl::Status { throw std::runtime_error("boom"); }).ok());
  absl::Status thrown = jobs.Wait();
  CHECK(absl::IsInternal(thrown));
  CHECK(std::string(thrown.message()).find("boom") != std::string::npos);
  REQUIRE(jobs.Run([] { return absl::OkStatus(); }).ok());
  CHECK(jobs.Wait().ok());
}

}  // namespace
}  // namespace ckpt
