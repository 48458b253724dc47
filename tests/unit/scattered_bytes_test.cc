#include "common/scattered_bytes.h"

#include <catch2/catch.hpp>

#include <string>

namespace ckpt {
namespace {

std::string Read(const ScatteredBytes& bytes, uint64_t offset, uint64_t len) {
  std::string out(len, '\0');
  bytes.CopyTo(offset, len, out.data());
  return out;
}

TEST_CASE("scattered bytes read as one range, wherever their spans lie") {
  const std::string a = "0123456789", b = "abcdefghij";
  ScatteredBytes bytes;
  bytes.Append(a.data(), 4);      // "0123"
  bytes.Append(b.data(), 3);      // "abc"
  bytes.Append(b.data() + 3, 2);  // "de": follows "abc" in memory, joined to it
  bytes.Append(a.data(), 0);      // nothing
  bytes.Append(a.data() + 6, 4);  // "6789"
  REQUIRE(bytes.size() == 13);
  REQUIRE(bytes.spans().size() == 3);
  CHECK(bytes.spans()[1].begin == 4);
  CHECK(bytes.spans()[1].end == 9);
  CHECK(Read(bytes, 0, 13) == "0123abcde6789");
  CHECK(Read(bytes, 2, 9) == "23abcde67");

  SECTION("an address only for what lies in one span") {
    CHECK(bytes.Contiguous(4, 5) == b.data());
    CHECK(bytes.Contiguous(5, 3) == b.data() + 1);
    CHECK(bytes.Contiguous(3, 2) == nullptr);   // crosses from the first span to the second
    CHECK(bytes.Contiguous(10, 4) == nullptr);  // past the end
    CHECK(bytes.Contiguous(13, 0) != nullptr);  // nothing, at the end
    CHECK(bytes.Contiguous(14, 0) == nullptr);
  }
  SECTION("a walk calls once per span touched, clipped to the end") {
    std::string walked;
    int calls = 0;
    bytes.ForEach(3, 100, [&](const char* at, uint64_t n) {
      walked.append(at, n);
      ++calls;
    });
    CHECK(walked == "3abcde6789");
    CHECK(calls == 3);
  }
}

TEST_CASE("one span is the contiguous case") {
  const std::string a = "hello";
  ScatteredBytes bytes(a.data(), a.size());
  CHECK(bytes.Contiguous(0, 5) == a.data());
  CHECK(ScatteredBytes().size() == 0);
  CHECK(ScatteredBytes().Contiguous(0, 0) != nullptr);
}

}  // namespace
}  // namespace ckpt
