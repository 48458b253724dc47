// --replication K+M (issue 25): what ParseReplication takes and refuses, and how ParseFlags
// and Validate report it. Beside config_test.cc, which covers the other flags.
#include <catch2/catch.hpp>

#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "daemon/config.h"

using namespace ckpt::daemon;

namespace {

ParseResult Parse(std::vector<std::string> args) {
  args.insert(args.begin(), "ckptd");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return ParseFlags(static_cast<int>(argv.size()), argv.data());
}

}  // namespace

TEST_CASE("--replication takes K+M with K and M at least 1 and K+M at most 32") {
  using Code = std::pair<uint32_t, uint32_t>;
  for (const auto& [text, code] : std::vector<std::pair<std::string, Code>>{
           {"2+1", {2, 1}}, {"4+2", {4, 2}}, {"1+1", {1, 1}}, {"31+1", {31, 1}}, {"16+16", {16, 16}}}) {
    INFO(text);
    auto parsed = ParseReplication(text);
    INFO(parsed.status());
    REQUIRE(parsed.ok());
    CHECK(*parsed == code);
  }
}

TEST_CASE("--replication refuses what is not K+M, a code without data or parity, and one too wide") {
  for (const std::string text : {"2+0", "0+1", "2+x", "2+1 ", " 2+1", "+1", "40+2", "32+1", "1+32", "", "2", "2+",
                                 "2+1+1", "-1+2", "2-1", "2 +1", "x+1", "4294967296+1"}) {
    INFO("\"" << text << "\"");
    auto parsed = ParseReplication(text);
    CHECK(absl::IsInvalidArgument(parsed.status()));
  }
  CHECK_THAT(ckpt::Message(ParseReplication("2+x").status()), Catch::Contains("is not K+M"));
  CHECK_THAT(ckpt::Message(ParseReplication("40+2").status()), Catch::Contains("K+M at most 32"));
  CHECK_THAT(ckpt::Message(ParseReplication("2+0").status()), Catch::Contains("at least 1 each"));
}

// Only digits and one '+' between K and M: no sign of a number's own.
TEST_CASE("--replication refuses a sign before K or M") {
  for (const std::string text : {"2++1", "+2+1"}) {
    INFO("\"" << text << "\"");
    auto parsed = ParseReplication(text);
    const std::string taken = parsed.ok() ? std::to_string(parsed->first) + "+" + std::to_string(parsed->second) : "-";
    INFO("taken as " << taken);
    CHECK(absl::IsInvalidArgument(parsed.status()));
  }
}

// K and M are each read as 32-bit: their sum must not wrap past the K+M <= 32 check.
TEST_CASE("--replication refuses K and M whose sum wraps around 32 bits") {
  for (const std::string text : {"4294967295+1", "2147483648+2147483648", "4294967295+2"}) {
    INFO("\"" << text << "\"");
    auto parsed = ParseReplication(text);
    const std::string taken = parsed.ok() ? std::to_string(parsed->first) + "+" + std::to_string(parsed->second) : "-";
    INFO("taken as " << taken);
    CHECK(absl::IsInvalidArgument(parsed.status()));
  }
  // As ckptd sees it: refused at the flag, exit 2 (K+M wrapped to 0 would also pass
  // Validate's "coding groups of K+M nodes" check).
  ParseResult wrapped = Parse({"--replication", "4294967295+1"});
  CHECK(wrapped.exit);
  CHECK(wrapped.exit_code == 2);
}

TEST_CASE("ckptd --replication: a bad code exits 2 naming the flag, a good one is in the config") {
  ParseResult bad = Parse({"--replication", "2+x"});
  CHECK(bad.exit);
  CHECK(bad.exit_code == 2);
  CHECK_THAT(bad.message, Catch::StartsWith("--replication: ") && Catch::Contains("\"2+x\""));

  ParseResult good = Parse({"--replication", "4+2"});
  REQUIRE_FALSE(good.exit);
  CHECK(good.config.replication_k == 4);
  CHECK(good.config.replication_m == 2);
  CHECK_THAT(good.config.ToJson(), Catch::Contains("\"4+2\""));

  ParseResult off = Parse({});
  REQUIRE_FALSE(off.exit);
  CHECK(off.config.replication_k == 0);
  CHECK(off.config.replication_m == 0);
}
