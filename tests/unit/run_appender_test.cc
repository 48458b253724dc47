// The appender an incremental shard's data goes through: contiguous runs merged into writes
// of kRunWriteBytes (as the full shard writer's), a break in memory or Flush() writing what
// is pending, every byte once and in order.
#include <catch2/catch.hpp>

#include <string>
#include <utility>
#include <vector>

#include "daemon/persist/run_appender.h"

using namespace ckpt;
using namespace ckpt::persist;

namespace {

// Records each append's source and size, and the bytes in order.
class RecordingWriter final : public storage::ObjectWriter {
 public:
  absl::Status Append(const char* data, size_t size) override {
    if (fail) return absl::UnavailableError("the disk went away");
    appends.emplace_back(data, size);
    bytes.append(data, size);
    return absl::OkStatus();
  }
  absl::StatusOr<uint64_t> Finish() override { return bytes.size(); }

  std::vector<std::pair<const char*, size_t>> appends;
  std::string bytes;
  bool fail = false;
};

std::string Pattern(size_t n) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>(i * 131 + i / 4099);
  return s;
}

}  // namespace

TEST_CASE("contiguous runs go out in writes of the full writer's size, the rest on Flush") {
  const uint64_t chunk = 4u << 20;
  const std::string memory = Pattern(3 * kRunWriteBytes + 12345);
  RecordingWriter object;
  int pauses = 0;
  RunAppender appender(object, [&] { ++pauses; });
  // A piece of odd length, then chunks of 4 MiB, then a short tail: as a streamed shard.
  REQUIRE(appender.Add(memory.data(), 3001).ok());
  for (uint64_t at = 3001; at < memory.size(); at += chunk) {
    REQUIRE(appender.Add(memory.data() + at, std::min<uint64_t>(chunk, memory.size() - at)).ok());
  }
  CHECK(object.appends.size() == 3);  // none of the partial run written before Flush()
  REQUIRE(appender.Flush().ok());
  REQUIRE(object.appends.size() == 4);
  for (size_t i = 0; i < 3; ++i) {
    CHECK(object.appends[i].first == memory.data() + i * kRunWriteBytes);
    CHECK(object.appends[i].second == kRunWriteBytes);
  }
  CHECK(object.appends[3].second == 12345);
  CHECK(object.bytes == memory);
  CHECK(pauses == 4);
  REQUIRE(appender.Flush().ok());  // nothing pending: nothing written
  CHECK(object.appends.size() == 4);
}

TEST_CASE("a run that does not continue the last one writes what is pending first") {
  const std::string memory = Pattern(1 << 20);
  RecordingWriter object;
  RunAppender appender(object);
  // The file's order differs from memory's (a delta entry's source skips unchanged chunks).
  REQUIRE(appender.Add(memory.data(), 1000).ok());
  REQUIRE(appender.Add(memory.data() + 1000, 0).ok());  // empty: changes nothing
  REQUIRE(appender.Add(memory.data() + 1000, 24).ok());
  REQUIRE(appender.Add(memory.data() + 5000, 100).ok());
  REQUIRE(appender.Add(memory.data() + 2000, 10).ok());
  REQUIRE(appender.Flush().ok());
  REQUIRE(object.appends.size() == 3);
  CHECK(object.appends[0] == std::make_pair(memory.data(), size_t{1024}));
  CHECK(object.appends[1] == std::make_pair(memory.data() + 5000, size_t{100}));
  CHECK(object.appends[2] == std::make_pair(memory.data() + 2000, size_t{10}));
  CHECK(object.bytes == memory.substr(0, 1024) + memory.substr(5000, 100) + memory.substr(2000, 10));
}

TEST_CASE("a failed write is returned, by the Add that made it or by Flush") {
  const std::string memory = Pattern(kRunWriteBytes + 10);
  RecordingWriter object;
  object.fail = true;
  RunAppender appender(object);
  REQUIRE(appender.Add(memory.data(), 10).ok());  // pending, not yet written
  const absl::Status full = appender.Add(memory.data() + 10, kRunWriteBytes);
  CHECK(full.code() == absl::StatusCode::kUnavailable);
  CHECK(appender.Flush().code() == absl::StatusCode::kUnavailable);
  CHECK(object.appends.empty());
}
