// The coordinator's table of part uploads in progress (daemon/group/structure_uploads.h):
// chunks in order, one upload per node, bounded in bytes and age.
#include <catch2/catch.hpp>

#include "daemon/group/structure_uploads.h"

using namespace ckpt::group;
using namespace std::chrono_literals;
using Clock = StructureUploads::Clock;

TEST_CASE("uploads: chunks in order make the whole text; nodes' uploads are apart") {
  StructureUploads uploads({});
  const auto now = Clock::now();
  REQUIRE_FALSE(*uploads.Add(1, "d1", 6, 0, "abc", now));
  REQUIRE_FALSE(*uploads.Add(2, "d2", 2, 0, "x", now));
  CHECK(uploads.bytes() == 8);
  auto one = uploads.Add(1, "d1", 6, 3, "def", now);
  REQUIRE(one.ok());
  REQUIRE(one->has_value());
  CHECK(**one == "abcdef");
  CHECK(uploads.bytes() == 2);
  CHECK(**uploads.Add(2, "d2", 2, 1, "y", now) == "xy");
  CHECK(uploads.bytes() == 0);
}

TEST_CASE("uploads: one node's uploads of two structures go apart; a node has at most two at once") {
  StructureUploads uploads({});
  const auto now = Clock::now();
  REQUIRE(uploads.Add(1, "job-a", 4, 0, "ab", now).ok());
  REQUIRE(uploads.Add(1, "job-b", 2, 0, "x", now).ok());  // does not reset job-a's
  CHECK(absl::IsResourceExhausted(uploads.Add(1, "job-c", 2, 0, "x", now).status()));
  CHECK(**uploads.Add(1, "job-a", 4, 2, "cd", now) == "abcd");
  CHECK(**uploads.Add(1, "job-b", 2, 1, "y", now) == "xy");
}

TEST_CASE("uploads: an upload still running five minutes after it began is dropped, however busy") {
  StructureUploads uploads({});
  const auto start = Clock::now();
  REQUIRE(uploads.Add(1, "d", 100, 0, "a", start).ok());
  auto t = start;
  for (uint64_t offset = 1; offset < 10; ++offset) {
    t += 40s;  // never idle for a minute
    auto added = uploads.Add(1, "d", 100, offset, "a", t);
    if (t - start > 300s) {
      CHECK(absl::IsFailedPrecondition(added.status()));
      break;
    }
    REQUIRE(added.ok());
  }
  uploads.DropStale(t);
  CHECK(uploads.bytes() == 0);
}

TEST_CASE("uploads: a chunk out of order, of another digest or size, is refused; offset 0 starts again") {
  StructureUploads uploads({});
  const auto now = Clock::now();
  REQUIRE(uploads.Add(1, "d", 4, 0, "ab", now).ok());
  CHECK(absl::IsFailedPrecondition(uploads.Add(1, "d", 4, 3, "d", now).status()));
  CHECK(absl::IsFailedPrecondition(uploads.Add(1, "other", 4, 2, "cd", now).status()));
  CHECK(absl::IsFailedPrecondition(uploads.Add(1, "d", 5, 2, "cd", now).status()));
  CHECK(absl::IsInvalidArgument(uploads.Add(1, "d", 4, 2, "cde", now).status()));
  REQUIRE(uploads.Add(1, "d", 4, 0, "wx", now).ok());  // again from the start
  CHECK(**uploads.Add(1, "d", 4, 2, "yz", now) == "wxyz");
}

TEST_CASE("uploads: bounded in bytes, per part and in all; an idle upload is dropped") {
  StructureUploads uploads({.part_bytes = 10, .total_bytes = 15, .idle = 60s});
  const auto now = Clock::now();
  CHECK(absl::IsInvalidArgument(uploads.Add(1, "d", 11, 0, "a", now).status()));
  CHECK(absl::IsInvalidArgument(uploads.Add(1, "d", 0, 0, "a", now).status()));
  REQUIRE(uploads.Add(1, "d", 10, 0, "a", now).ok());
  auto full = uploads.Add(2, "d", 6, 0, "a", now);
  CHECK(absl::IsResourceExhausted(full.status()));
  CHECK_THAT(std::string(full.status().message()), Catch::Contains("10 bytes of parts already"));
  // Node 1 went silent: a minute later its upload no longer holds the room.
  REQUIRE(uploads.Add(2, "d", 6, 0, "a", now + 61s).ok());
  CHECK(uploads.bytes() == 6);
  CHECK(absl::IsFailedPrecondition(uploads.Add(1, "d", 10, 1, "b", now + 61s).status()));
}
