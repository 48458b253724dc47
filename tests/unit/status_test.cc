// Error messages that cross gRPC: cut to fit, never mid-character, and lists that say how
// long they were.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "common/status.h"

namespace ckpt {
namespace {

TEST_CASE("a message that fits is left as it is") {
  CHECK(Truncated("tensor w: saved as F32, wanted as BF16") == "tensor w: saved as F32, wanted as BF16");
}

TEST_CASE("a long message is cut below the limit and says how much was left out") {
  const std::string long_message(100'000, 'x');
  const std::string cut = Truncated(long_message);
  CHECK(cut.size() <= kMaxWireMessageBytes);
  CHECK_THAT(cut, Catch::StartsWith("xxxx") && Catch::Contains("more bytes; the whole message is in ckptd's log"));
}

TEST_CASE("a message is never cut inside a UTF-8 character") {
  std::string names;
  while (names.size() < 3 * kMaxWireMessageBytes) names += "Gewicht-ä-Ω-";
  const std::string cut = Truncated(names);
  const size_t body = cut.find(" ... (cut:");
  REQUIRE(body != std::string::npos);
  // The byte before the note is a whole character's last byte: ASCII, or a continuation byte
  // that completes a two-byte character (the lead byte right before it).
  const unsigned char last = static_cast<unsigned char>(cut[body - 1]);
  if (last >= 0x80) {
    CHECK((last & 0xC0) == 0x80);
    CHECK((static_cast<unsigned char>(cut[body - 2]) & 0xE0) == 0xC0);
  }
}

TEST_CASE("JoinSome names the first items and counts the rest") {
  CHECK(JoinSome({}, 3).empty());
  CHECK(JoinSome({"a", "b"}, 3) == "a, b");
  CHECK(JoinSome({"a", "b", "c", "d", "e"}, 3) == "a, b, c and 2 more");
  CHECK(JoinSome({"a", "b", "c"}, 2, "; ") == "a; b and 1 more");
}

}  // namespace
}  // namespace ckpt
