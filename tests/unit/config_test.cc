#include <catch2/catch.hpp>

#include <cstdlib>
#include <fstream>
#include <vector>
#include <utility>
#include <string>
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
  // Quotas: byte counts, and only where --root holds the checkpoints.
  auto quotas = Parse({"--user-quota-bytes", "500G", "--job-quota-bytes", "100G"});
  REQUIRE_FALSE(quotas.exit);
  CHECK(quotas.config.user_quota_bytes == 500ull << 30);
  CHECK(quotas.config.job_quota_bytes == 100ull << 30);
  auto bad_quota = Parse({"--user-quota-bytes", "plenty"});
  CHECK(bad_quota.exit);
  CHECK(bad_quota.message.find("--user-quota-bytes") != std::string::npos);
  Config direct;
  direct.remote = "s3://bucket/ckpt";
  direct.remote_mode = RemoteMode::kDirect;
  CHECK(Validate(direct).ok());
  direct.job_quota_bytes = 1 << 30;
  CHECK(ckpt::Message(Validate(direct)).find("--job-quota-bytes") != std::string::npos);
  // --increments on with the remote tier, tiered or direct, on one node and in a group (every
  // node's report carries its ranks' tagged files and origins).
  Config inc;
  inc.increments = true;
  inc.remote = "s3://bucket/ckpt";
  CHECK(Validate(inc).ok());
  inc.remote_mode = RemoteMode::kDirect;
  CHECK(Validate(inc).ok());
  Config group_inc;
  group_inc.increments = true;
  group_inc.remote = "s3://bucket/ckpt";
  group_inc.num_nodes = 3;
  group_inc.node_rank = 1;
  group_inc.coordinator = "10.0.0.1:7070";
  group_inc.group_token_file = "/etc/ckptd/token";
  INFO(ckpt::Message(Validate(group_inc)));
  CHECK(Validate(group_inc).ok());
  group_inc.remote_mode = RemoteMode::kDirect;  // a group writing straight into the bucket
  INFO(ckpt::Message(Validate(group_inc)));
  CHECK(Validate(group_inc).ok());
}

TEST_CASE("durations take ms/s/m/h units; a bare number is seconds") {
  CHECK(*ParseDurationMs("500ms") == 500);
  CHECK(*ParseDurationMs("3s") == 3000);
  CHECK(*ParseDurationMs("2.5") == 2500);
  CHECK(*ParseDurationMs("2m") == 120'000);
  CHECK(*ParseDurationMs("1h") == 3'600'000);
  CHECK_FALSE(ParseDurationMs("soon").ok());
  CHECK_FALSE(ParseDurationMs("5d").ok());
  CHECK_FALSE(ParseDurationMs("0s").ok());
  CHECK_FALSE(ParseDurationMs("48h").ok());
}

TEST_CASE("group flags: validated together, each error names its flag") {
  auto group = [](std::vector<std::string> extra) {
    std::vector<std::string> args = {"--num-nodes", "4", "--node-rank", "2", "--coordinator",
                                     "10.0.0.1:7070", "--group-token-file", "/etc/ckptd/token",
                                     "--step-timeout", "90s", "--group-timeout", "500ms"};
    args.insert(args.end(), extra.begin(), extra.end());
    return Parse(args);
  };
  auto ok = group({});
  REQUIRE_FALSE(ok.exit);
  CHECK(ok.config.num_nodes == 4);
  CHECK(ok.config.node_rank == 2);
  CHECK(ok.config.step_timeout_ms == 90'000);
  CHECK(ok.config.group_timeout_ms == 500);
  CHECK(Validate(ok.config).ok());
  auto message = [](const ParseResult& r) { return ckpt::Message(Validate(r.config)); };
  CHECK(message(group({"--node-rank", "4"})).find("--node-rank 4 is not in 0..3") != std::string::npos);
  CHECK(message(group({"--group-token-file", ""})).find("--group-token-file is required") !=
        std::string::npos);
  CHECK(message(group({"--coordinator", "nohost"})).find("--coordinator") != std::string::npos);
  CHECK(message(group({"--group-tls-cert", "/c.pem"})).find("go together") != std::string::npos);
  CHECK(message(Parse({"--shared-root"})).find("--shared-root needs --num-nodes > 1") !=
        std::string::npos);
  auto bad_duration = group({"--step-timeout", "forever"});
  CHECK(bad_duration.exit);
  CHECK(bad_duration.message.find("--step-timeout") != std::string::npos);
}

TEST_CASE("group flags come from the environment too (Kubernetes)") {
  ::setenv("CKPTD_NODE_RANK", "3", 1);
  ::setenv("CKPTD_NUM_NODES", "8", 1);
  auto r = Parse({});
  ::unsetenv("CKPTD_NODE_RANK");
  ::unsetenv("CKPTD_NUM_NODES");
  REQUIRE_FALSE(r.exit);
  CHECK(r.config.node_rank == 3);
  CHECK(r.config.num_nodes == 8);
}

TEST_CASE("--staging-bytes comes from CKPTD_STAGING_BYTES too (a kustomize overlay sets it); the flag wins") {
  ::setenv("CKPTD_STAGING_BYTES", "3G", 1);
  auto from_env = Parse({});
  auto from_flag = Parse({"--staging-bytes", "2G"});
  ::unsetenv("CKPTD_STAGING_BYTES");
  REQUIRE_FALSE(from_env.exit);
  CHECK(from_env.config.staging_bytes == (3ull << 30));
  REQUIRE_FALSE(from_flag.exit);
  CHECK(from_flag.config.staging_bytes == (2ull << 30));
}

// --replication K+M (issue 25): what ParseReplication takes and refuses, and how ParseFlags
// and Validate report it.
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

// Peers hold each rank's staged snapshot whole, increments or not (issue 48, step 7).
TEST_CASE("--increments on goes with --replication") {
  ParseResult both = Parse({"--num-nodes", "4", "--node-rank", "1", "--coordinator", "10.0.0.1:7070",
                            "--group-token-file", "/etc/ckptd/token", "--replication", "2+1", "--increments", "on"});
  REQUIRE_FALSE(both.exit);
  CHECK(both.config.increments);
  CHECK(both.config.replication_k == 2);
  absl::Status valid = Validate(both.config);
  INFO(valid);
  CHECK(valid.ok());
}
