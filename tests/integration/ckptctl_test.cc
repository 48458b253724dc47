// ckptctl against a real daemon: human tables and --json for every command.
#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>

#include "tests/integration/common.h"

using namespace ckpt::testing;

TEST_CASE("ckptctl status, list, show, verify and delete") {
  TempDir dir;
  Daemon d(dir, {"--keep-last", "0"});
  d.Start();
  for (int step : {10, 20}) {
    REQUIRE(Run(Helper(d, {"--job", "ctl", "--bytes", "100000", "save", "--step", std::to_string(step),
                           "--wait-committed"}),
                dir.path()).exit_code == 0);
  }
  auto status = d.Ctl({"status"});
  INFO(status.out << status.err);
  CHECK(status.exit_code == 0);
  CHECK(Contains(status.out, "ckptd 0.1.0"));
  CHECK(Contains(status.out, "committed 2"));
  CHECK(Contains(status.out, "JOBS"));
  auto sj = nlohmann::json::parse(d.Ctl({"status", "--json"}).out);
  CHECK(sj["checkpoints_committed"] == "2");
  CHECK(sj["jobs"][0]["job"] == "ctl");
  CHECK(nlohmann::json::parse(sj["config_json"].get<std::string>())["keep_last"] == 0);

  auto list = d.Ctl({"list"});
  CHECK(Contains(list.out, "STEP"));
  CHECK(Contains(list.out, "ctl  20"));
  auto lj = nlohmann::json::parse(d.Ctl({"--json", "list"}).out);
  CHECK(lj["checkpoints"].size() == 2);

  auto show = d.Ctl({"show", "20"});  // --job may be left out: one job exists
  auto manifest = nlohmann::json::parse(show.out);
  CHECK(manifest["step"] == 20);
  CHECK(manifest["tensors"].contains("model.a"));
  CHECK(manifest["shards"][0]["train_state"].contains("note"));

  auto verify = d.Ctl({"verify", "20"});
  CHECK(verify.exit_code == 0);
  CHECK(Contains(verify.out, "OK"));

  CHECK(d.Ctl({"delete", "10"}).exit_code == 0);
  CHECK(nlohmann::json::parse(d.Ctl({"--json", "list"}).out)["checkpoints"].size() == 1);
  auto again = d.Ctl({"delete", "10"});
  CHECK(again.exit_code == 1);
  CHECK(Contains(again.err, "no committed checkpoint at step 10"));
  auto bad_job = d.Ctl({"--job", "../etc", "list"});
  CHECK(bad_job.exit_code == 1);
  CHECK(Contains(bad_job.err, "invalid job name"));
}

TEST_CASE("ckptctl says clearly when the daemon is not there") {
  TempDir dir;
  Daemon d(dir);
  auto r = d.Ctl({"status"});
  CHECK(r.exit_code == 1);
  CHECK(Contains(r.err, "cannot reach ckptd at " + d.socket()));
}

TEST_CASE("standard gRPC health checks answer SERVING; the RPC snapshot path commits") {
  TempDir dir;
  Daemon d(dir, {"--admin-addr", "127.0.0.1:0"});
  d.Start();
  auto h = Run(Helper(d, {"health"}), dir.path());
  CHECK(Contains(h.out, "SERVING"));
  auto r = Run(Helper(d, {"--job", "rpc", "--seed", "4", "--bytes", "100000", "rpc-snapshot", "--step", "3"}),
               dir.path());
  INFO(r.out << r.err);
  CHECK(r.exit_code == 0);
  CHECK(Contains(r.out, "state=TICKET_COMMITTED"));
  auto c = Run(Helper(d, {"--job", "rpc", "--seed", "4", "--bytes", "100000", "check"}), dir.path());
  CHECK(Contains(c.out, "match"));
  CHECK(Contains(d.Log(), "admin API on 127.0.0.1:0"));
}
