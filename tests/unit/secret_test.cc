#include "storage/secret.h"

#include <catch2/catch.hpp>

#include <atomic>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/fakes/temp_dir.h"

using ckpt::ReadToken;
using ckpt::SecretEquals;

TEST_CASE("secret: equal tokens match, any difference in content or length does not") {
  const std::string token = "0123456789abcdef0123456789abcdef";
  CHECK(SecretEquals(token, token));
  CHECK(SecretEquals(std::string(token), token));
  CHECK_FALSE(SecretEquals("0123456789abcdef0123456789abcdeF", token));
  CHECK_FALSE(SecretEquals(token.substr(0, 31), token));
  CHECK_FALSE(SecretEquals(token + "0", token));
  CHECK_FALSE(SecretEquals("", token));
  CHECK(SecretEquals("", ""));
}

TEST_CASE("secret: many threads compare at once") {
  const std::string token(64, 'k');
  std::vector<std::thread> threads;
  std::atomic<int> wrong{0};
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 2000; ++i) {
        if (!SecretEquals(token, token) || SecretEquals(std::string(64, static_cast<char>('a' + t)), token)) ++wrong;
      }
    });
  }
  for (auto& t : threads) t.join();
  CHECK(wrong == 0);
}

TEST_CASE("secret: a token file holds at least 16 characters; its final newline is not part of it") {
  ckpt::testing::TempDir dir;
  std::ofstream(dir / "good") << "0123456789abcdef\n";
  std::ofstream(dir / "short") << "0123456789\n";
  auto good = ReadToken(dir / "good", "--group-token-file");
  REQUIRE(good.ok());
  CHECK(*good == "0123456789abcdef");
  auto bad = ReadToken(dir / "short", "--group-token-file");
  REQUIRE_FALSE(bad.ok());
  CHECK_THAT(std::string(bad.status().message()), Catch::Contains("--group-token-file") && Catch::Contains("16"));
}
