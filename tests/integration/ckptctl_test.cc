// ckptctl against a real daemon: human tables and --json for every command.
#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "storage/local_store.h"
#include "storage/s3_store.h"
#include "tests/fakes/ceph_cluster.h"
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

namespace {

// The port ckptd logged for --admin-addr 127.0.0.1:0.
std::string AdminAddress(const Daemon& d) {
  std::string log = d.Log();
  auto at = log.find("admin API on 127.0.0.1:0 (port ");
  REQUIRE(at != std::string::npos);
  at += std::string("admin API on 127.0.0.1:0 (port ").size();
  return "127.0.0.1:" + log.substr(at, log.find(')', at) - at);
}

}  // namespace

TEST_CASE("over --admin-addr only the admin service answers, and delete needs the admin token") {
  TempDir dir;
  std::string token = dir.path() + "/admin.token";
  {
    std::ofstream(token) << "s3cret-admin-token-0123456789\n";
  }
  Daemon d(dir, {"--admin-addr", "127.0.0.1:0", "--admin-token-file", token, "--keep-last", "0"});
  d.Start();
  REQUIRE(Run(Helper(d, {"--job", "tcp", "--bytes", "100000", "save", "--step", "3",
                         "--wait-committed"}),
              dir.path()).exit_code == 0);
  std::string addr = AdminAddress(d);

  // A trainer call on the TCP port: not served there at all.
  auto trainer = Run(Helper(d, {"--job", "tcp", "register-at", "--target", addr}), dir.path());
  INFO(trainer.out << trainer.err);
  CHECK(trainer.exit_code == 1);
  CHECK(Contains(trainer.out, "code=UNIMPLEMENTED"));

  // Reads need nothing; delete needs the token.
  CHECK(d.Ctl({"--addr", addr, "list"}).exit_code == 0);
  auto bare = d.Ctl({"--addr", addr, "--job", "tcp", "delete", "3"});
  CHECK(bare.exit_code == 1);
  CHECK(Contains(bare.err, "needs the admin token"));
  std::string wrong = dir.path() + "/wrong.token";
  {
    std::ofstream(wrong) << "not-the-admin-token-at-all\n";
  }
  auto guessed = d.Ctl({"--addr", addr, "--token-file", wrong, "--job", "tcp", "delete", "3"});
  CHECK(guessed.exit_code == 1);
  CHECK(Contains(d.Log(), "refused delete from"));
  REQUIRE(Contains(d.Ctl({"list"}).out, "3"));  // still there
  auto allowed = d.Ctl({"--addr", addr, "--token-file", token, "--job", "tcp", "delete", "3"});
  INFO(allowed.err);
  CHECK(allowed.exit_code == 0);
  CHECK(d.Ctl({"--job", "tcp", "show", "3"}).exit_code == 1);
}

TEST_CASE("without --admin-token-file, delete over TCP is refused and the socket still works") {
  TempDir dir;
  Daemon d(dir, {"--admin-addr", "127.0.0.1:0", "--keep-last", "0"});
  d.Start();
  REQUIRE(Run(Helper(d, {"--job", "tcp", "--bytes", "100000", "save", "--step", "3",
                         "--wait-committed"}),
              dir.path()).exit_code == 0);
  auto refused = d.Ctl({"--addr", AdminAddress(d), "--job", "tcp", "delete", "3"});
  CHECK(refused.exit_code == 1);
  CHECK(Contains(refused.err, "no --admin-token-file"));
  CHECK(d.Ctl({"--job", "tcp", "delete", "3"}).exit_code == 0);  // over the socket
}

namespace {

// Copies every object under `prefix` of `from` to `to`: a node's steps put on a bucket.
void CopyTree(ckpt::storage::Store& from, ckpt::storage::Store& to, const std::string& prefix) {
  auto entries = from.List(prefix);
  REQUIRE(entries.ok());
  for (const auto& e : *entries) {
    const std::string key = prefix.empty() ? e.name : prefix + "/" + e.name;
    if (e.is_prefix) {
      CopyTree(from, to, key);
      continue;
    }
    auto reader = from.Open(key);
    REQUIRE(reader.ok());
    std::string bytes((*reader)->size(), '\0');
    REQUIRE((*reader)->ReadAt(bytes.data(), bytes.size(), 0).ok());
    REQUIRE(to.Put(key, bytes).ok());
  }
}

}  // namespace

TEST_CASE("ckptctl lists, verifies and exports from the files alone: a root, or an S3 bucket") {
  TempDir dir;
  Daemon d(dir, {"--keep-last", "0"});
  d.Start();
  for (int step : {1, 2}) {
    REQUIRE(Run(Helper(d, {"--job", "offline", "--bytes", "3000000", "save", "--step",
                           std::to_string(step), "--wait-committed"}),
                dir.path()).exit_code == 0);
  }
  REQUIRE(d.Stop() == 0);
  auto ctl = [&](std::vector<std::string> args) {
    args.insert(args.begin(), Runfile("client/ckptctl"));
    return Run(args, dir.path());
  };
  // No daemon: --root reads the files.
  auto listed = ctl({"--job", "offline", "list", "--root", d.root()});
  INFO(listed.out << listed.err);
  CHECK(listed.exit_code == 0);
  CHECK(Contains(listed.out, "offline  1"));
  CHECK(Contains(listed.out, "offline  2"));
  CHECK(ctl({"--job", "offline", "verify", "2", "--root", d.root()}).exit_code == 0);

  // The same steps on a bucket of a real Ceph RGW, read with the AWS environment.
  auto& ceph = CephCluster::Get();
  ckpt::storage::S3Options options = ceph.Options();
  options.prefix = "node-lost";
  auto bucket = ckpt::storage::MakeS3Store(options);
  REQUIRE(bucket.ok());
  auto local = ckpt::storage::MakeLocalStore(ckpt::MakePosixFilesystem(), d.root());
  CopyTree(*local, **bucket, "offline");
  for (const auto& [name, value] : ceph.env()) ::setenv(name.c_str(), value.c_str(), 1);
  const std::string url = "s3://" + options.bucket + "/node-lost";
  auto remote = ctl({"--job", "offline", "list", "--root", url});
  INFO(remote.out << remote.err);
  CHECK(remote.exit_code == 0);
  CHECK(Contains(remote.out, "offline  2"));
  auto verified = ctl({"--job", "offline", "verify", "2", "--root", url});
  INFO(verified.out << verified.err);
  CHECK(verified.exit_code == 0);
  CHECK(Contains(verified.out, "OK"));
  auto exported = ctl({"--job", "offline", "export", "2", dir / "from-s3", "--format", "full", "--root", url});
  INFO(exported.out << exported.err);
  CHECK(exported.exit_code == 0);
  CHECK(std::filesystem::exists(dir / "from-s3/checkpoint.json"));
  // A shard replaced on the bucket is found by verify, named by its URL.
  REQUIRE((*bucket)->Put("offline/step-00000002/rank-00000.safetensors", "not a shard").ok());
  auto damaged = ctl({"--job", "offline", "verify", "2", "--root", url});
  CHECK(damaged.exit_code == 3);
  CHECK(Contains(damaged.out, url + "/offline/step-00000002/rank-00000.safetensors"));

  // A manifest that cannot be read is listed as such, never as "0 ranks ... 1970".
  std::ofstream(d.root() + "/offline/step-00000001/manifest.json") << "{ torn";
  auto unreadable = ctl({"--job", "offline", "list", "--root", d.root()});
  CHECK(unreadable.exit_code == 3);
  CHECK(Contains(unreadable.out, "UNREADABLE"));
  CHECK(Contains(unreadable.out, "step 1 of job offline:"));
  CHECK_FALSE(Contains(unreadable.out, "1970"));
}
