#include <catch2/catch.hpp>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>

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

TEST_CASE("byte counts take K/M/G/T suffixes") {
  CHECK(*ParseBytes("4096") == 4096);
  CHECK(*ParseBytes("4K") == 4096);
  CHECK(*ParseBytes("512M") == 512ull << 20);
  CHECK(*ParseBytes("8G") == 8ull << 30);
  CHECK(*ParseBytes("2GiB") == 2ull << 30);
  CHECK_FALSE(ParseBytes("lots").ok());
  CHECK_FALSE(ParseBytes("4X").ok());
  CHECK_FALSE(ParseBytes("99999999999T").ok());
}

TEST_CASE("flags parse into the typed config") {
  auto r = Parse({"--root", "/data", "--staging-bytes", "1G", "--keep-last", "5", "--keep-every",
                  "1000", "--io-threads", "4", "--when-busy", "wait"});
  REQUIRE_FALSE(r.exit);
  CHECK(r.config.root == "/data");
  CHECK(r.config.staging_bytes == 1ull << 30);
  CHECK(r.config.keep_last == 5);
  CHECK(r.config.keep_every == 1000);
  CHECK(r.config.when_busy == WhenBusy::kWait);
  CHECK(Validate(r.config).ok());
  auto j = nlohmann::json::parse(r.config.ToJson());
  CHECK(j["staging_bytes"] == 1ull << 30);
}

TEST_CASE("a TOML config file sets options; flags on the command line still apply") {
  std::string path = std::string(std::getenv("TEST_TMPDIR") ? std::getenv("TEST_TMPDIR") : "/tmp") +
                     "/ckptd-config-test.toml";
  std::ofstream(path) << "root = \"/srv/ckpt\"\nstaging-bytes = \"2G\"\nkeep-last = 7\n"
                         "when-busy = \"wait\"\nallow-uid = [1000, 1001]\n";
  auto r = Parse({"--config", path, "--keep-last", "9"});
  REQUIRE_FALSE(r.exit);
  CHECK(r.config.root == "/srv/ckpt");
  CHECK(r.config.staging_bytes == 2ull << 30);
  CHECK(r.config.keep_last == 9);
  CHECK(r.config.when_busy == WhenBusy::kWait);
  CHECK(r.config.allow_uids == std::vector<uint32_t>{1000, 1001});
  std::ofstream(path) << "no-such-option = 1\n";
  CHECK(Parse({"--config", path}).exit);
}

TEST_CASE("bad flags and combinations are refused naming the flag") {
  CHECK(Parse({"--staging-bytes", "lots"}).exit);
  auto chunk = Parse({"--staging-chunk", "huge"});
  CHECK(chunk.exit);
  CHECK(chunk.message.find("--staging-chunk") != std::string::npos);
  CHECK(Parse({"--staging-chunk", "64M"}).config.staging_chunk_bytes == (64u << 20));
  Config small;
  small.staging_chunk_bytes = 4096;
  CHECK(ckpt::Message(Validate(small)).find("--staging-chunk") != std::string::npos);
  CHECK(Parse({"--when-busy", "panic"}).exit);
  CHECK(Parse({"--no-such-flag"}).exit);
  Config c;
  c.admin_addr = "0.0.0.0:7000";
  CHECK(ckpt::Message(Validate(c)).find("--admin-addr") != std::string::npos);
  c.admin_allow_remote = true;
  CHECK(Validate(c).ok());
  c.admin_addr = "127.0.0.1";
  CHECK_FALSE(Validate(c).ok());
  Config d;
  d.io_threads = 0;
  CHECK(ckpt::Message(Validate(d)).find("--io-threads") != std::string::npos);
  Config e;
  e.log_level = "loud";
  CHECK_FALSE(Validate(e).ok());
  Config f;
  f.socket = std::string(200, 's');
  CHECK_FALSE(Validate(f).ok());
}
