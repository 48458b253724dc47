// ckptctl against a real daemon: human tables and --json for every command.
#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>

#include <signal.h>

#include <chrono>
#include <cstdlib>
#include <thread>
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
  CHECK(sj["checkpoints_committed"] == 2);  // numbers as numbers
  CHECK(sj["jobs"][0]["job"] == "ctl");
  CHECK(sj["config"]["keep_last"] == 0);

  auto list = d.Ctl({"list"});
  CHECK(Contains(list.out, "STEP"));
  CHECK(Contains(list.out, "ctl  20"));
  auto lj = nlohmann::json::parse(d.Ctl({"--json", "list"}).out);
  CHECK(lj["checkpoints"].size() == 2);
  CHECK(lj["checkpoints"][1]["step"] == 20);

  auto show = d.Ctl({"show", "20"});  // --job may be left out: one job exists
  auto manifest = nlohmann::json::parse(show.out);
  CHECK(manifest["step"] == 20);
  CHECK(manifest["tensors"].contains("model.a"));
  CHECK(manifest["shards"][0]["train_state"].contains("note"));

  auto verify = d.Ctl({"verify", "20"});
  CHECK(verify.exit_code == 0);
  CHECK(Contains(verify.out, "OK"));
  // Progress streams from ckptd as it reads; --progress prints it even off a terminal.
  auto progress = d.Ctl({"verify", "20", "--progress"});
  INFO(progress.err);
  CHECK(progress.exit_code == 0);
  CHECK(Contains(progress.err, "verify: 100% ("));
  CHECK(Contains(progress.out, "OK"));

  CHECK(d.Ctl({"delete", "10"}).exit_code == 0);
  CHECK(nlohmann::json::parse(d.Ctl({"--json", "list"}).out)["checkpoints"].size() == 1);
  auto again = d.Ctl({"delete", "10"});
  CHECK(again.exit_code == 1);
  CHECK(Contains(again.err, "no committed checkpoint at step 10"));
  auto bad_job = d.Ctl({"--job", "../etc", "list"});
  CHECK(bad_job.exit_code == 1);
  CHECK(Contains(bad_job.err, "invalid job name"));
}

TEST_CASE("a verify whose caller goes away stops reading and lets the next one run") {
  TempDir dir;
  Daemon d(dir, {"--staging-bytes", "2G"});
  d.Start();
  auto saved = Run(Helper(d, {"--job", "big", "--bytes", std::to_string((1536ull << 20) / kSanitizerSlowdown), "save", "--step", "1",
                              "--wait-committed"}),
                   dir.path());
  INFO(saved.out << saved.err << d.Log());
  REQUIRE(saved.exit_code == 0);
  // 1.5 GiB (under TSan a quarter of it) takes ckptd seconds to re-read here; the caller
  // gives up after 0.3 s.
  auto gone = d.Ctl({"verify", "1", "--timeout", "0.3"});
  INFO(gone.err);
  CHECK(gone.exit_code == 2);
  RunResult next;
  for (int i = 0; i < 100; ++i) {
    next = d.Ctl({"verify", "1"});
    if (!Contains(next.err, "another verify is running")) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  INFO(next.out << next.err);
  CHECK(next.exit_code == 0);
  CHECK(Contains(next.out, "OK"));
  const std::string log = d.Log();
  CHECK(Contains(log, "the verify of step 1 of job big stopped after"));
}

TEST_CASE("ckptctl says clearly when the daemon is not there") {
  TempDir dir;
  Daemon d(dir);
  auto r = d.Ctl({"status"});
  CHECK(r.exit_code == 2);
  CHECK(Contains(r.err, "no ckptd listens at " + d.socket() + " (the socket does not exist): is ckptd running?"));
}

// Scripts that start daemons and trainers together wait for each daemon to be ready.
TEST_CASE("ckptctl wait --ready returns once ckptd is up, or after --timeout") {
  TempDir dir;
  Daemon d(dir);
  const auto started = std::chrono::steady_clock::now();
  auto absent = d.Ctl({"wait", "--ready", "--timeout", "1"});
  CHECK(absent.exit_code == 2);
  CHECK(Contains(absent.err, "not ready within 1 s: no ckptd listens at " + d.socket()));
  CHECK(std::chrono::steady_clock::now() - started < std::chrono::seconds(10));
  CHECK(d.Ctl({"wait", "--ready", "5"}).exit_code == 64);  // no STEP with --ready
  Process waiter({Runfile("client/ckptctl"), "--socket", d.socket(), "wait", "--ready", "--timeout", "120"},
                 dir.path(), "waiter");
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  CHECK(waiter.Running());
  d.Start();
  CHECK(waiter.Wait(std::chrono::seconds(60)) == 0);
  CHECK(Contains(waiter.Stdout(), "ckptd at " + d.socket() + ": ready"));
}

// What scripts rely on (client/ctl_exit.h): 0 ok, 1 error, 2 unreachable or timed out,
// 3 damaged data, 64 usage; a sentence for each error, and JSON under --json.
TEST_CASE("ckptctl's exit codes, sentences and JSON follow one convention") {
  TempDir dir;
  Daemon d(dir, {"--keep-last", "0"});
  d.Start();
  REQUIRE(Run(Helper(d, {"--job", "cli", "--bytes", "1000", "save", "--step", "5", "--wait-committed"}),
              dir.path()).exit_code == 0);
  auto version = d.Ctl({"--version"});
  CHECK(version.exit_code == 0);
  CHECK(Contains(version.out, "0.1.0"));
  CHECK(d.Ctl({}).exit_code == 64);  // no command
  CHECK(d.Ctl({"list", "--no-such-flag"}).exit_code == 64);
  auto negative = d.Ctl({"verify", "-5"});
  CHECK(negative.exit_code == 64);
  CHECK(Contains(negative.err, "a step is a number 0 or more, not \"-5\""));
  // A bad number of seconds is named in a sentence, not a 300-digit range.
  auto timeout = d.Ctl({"--timeout", "-1", "status"});
  CHECK(timeout.exit_code == 64);
  CHECK(Contains(timeout.err, "--timeout: seconds, a number of at least 0, not \"-1\""));
  CHECK(timeout.err.size() < 200);
  CHECK(Contains(d.Ctl({"status", "--dial-timeout", "0"}).err, "a number greater than 0, not \"0\""));
  // A usage error under --json is JSON on stdout, with the usage exit code.
  auto usage = d.Ctl({"--json", "list", "--no-such-flag"});
  CHECK(usage.exit_code == 64);
  auto usage_json = nlohmann::json::parse(usage.out);
  CHECK(usage_json["error"]["exit_code"] == 64);
  CHECK(Contains(usage_json["error"]["message"].get<std::string>(), "--no-such-flag"));
  // Every command's help names the options it takes, the shared ones included.
  auto help = d.Ctl({"verify", "--help"});
  for (const char* option : {"--job", "--json", "--socket", "--timeout", "--dial-timeout"}) {
    CHECK(Contains(help.out, option));
  }
  // An error under --json is JSON too, on stdout.
  auto missing = d.Ctl({"--json", "--job", "cli", "show", "6"});
  CHECK(missing.exit_code == 1);
  auto error = nlohmann::json::parse(missing.out);
  CHECK(error["error"]["exit_code"] == 1);
  CHECK(error["error"]["command"] == "show");
  CHECK(Contains(error["error"]["message"].get<std::string>(), "no committed checkpoint at step 6"));
  // Numbers are numbers in every command's JSON, and verify says what it verified.
  auto verified = nlohmann::json::parse(d.Ctl({"--json", "--job", "cli", "verify", "5"}).out);
  CHECK(verified["job"] == "cli");
  CHECK(verified["step"] == 5);
  CHECK(verified["ok"] == true);
  CHECK(verified["bytes_checked"].is_number());
  auto listed = nlohmann::json::parse(d.Ctl({"--json", "list"}).out);
  CHECK(listed["checkpoints"][0]["step"] == 5);
  CHECK(listed["checkpoints"][0]["bytes"].is_number());

  // A daemon that stopped (SIGSTOP) costs the --dial-timeout, then exit 2 and a sentence.
  d.Signal(SIGSTOP);
  auto start = std::chrono::steady_clock::now();
  auto stalled = d.Ctl({"--dial-timeout", "1", "status"});
  auto took = std::chrono::steady_clock::now() - start;
  d.Signal(SIGCONT);
  CHECK(stalled.exit_code == 2);
  CHECK(Contains(stalled.err, "could not connect to ckptd at " + d.socket() + " within 1 s"));
  CHECK(took < std::chrono::seconds(5));
  // A user the socket is not for: a sentence, not gRPC's words.
  const std::string ctl = dir.path() + "/ckptctl";  // where that user may run it
  std::filesystem::copy_file(Runfile("client/ckptctl"), ctl);
  auto denied = Run({"/usr/bin/setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", ctl,
                     "--socket", d.socket(), "status"},
                    dir.path());
  CHECK(denied.exit_code == 2);
  CHECK(Contains(denied.err, "this user may not connect to ckptd at " + d.socket() + " (permission denied)"));
}

TEST_CASE("ckptctl wait blocks until a step is committed, with progress, and times out with exit 2") {
  TempDir dir;
  Daemon d(dir);
  d.Start();
  // A job of two ranks: step 8 commits only once the second rank saves, seconds later.
  Process first(Helper(d, {"--job", "w", "--rank", "0", "--world-size", "2", "--bytes", "1000", "save", "--step",
                           "8", "--wait-committed"}),
                dir.path(), "first");
  Process waiter({Runfile("client/ckptctl"), "--socket", d.socket(), "--job", "w", "wait", "8", "--timeout", "60"},
                 dir.path(), "waiter");
  std::this_thread::sleep_for(std::chrono::seconds(2));
  CHECK(waiter.Running());  // step 8 is not committed yet: rank 1 has not saved
  REQUIRE(Run(Helper(d, {"--job", "w", "--rank", "1", "--world-size", "2", "--bytes", "1000", "save", "--step",
                         "8", "--wait-committed"}),
              dir.path()).exit_code == 0);
  CHECK(first.Wait() == 0);
  CHECK(waiter.Wait() == 0);
  INFO(waiter.Stdout() << waiter.Stderr());
  CHECK(Contains(waiter.Stdout(), "step 8 of job w committed"));
  CHECK(Contains(waiter.Stderr(), "step 8: writing (node), waiting for ranks 1"));
  // Already committed: at once. A step that never comes: exit 2 after --timeout, saying so.
  CHECK(d.Ctl({"--job", "w", "wait", "8"}).exit_code == 0);
  auto late = d.Ctl({"--job", "w", "wait", "9", "--timeout", "1", "--quiet"});
  CHECK(late.exit_code == 2);
  CHECK(Contains(late.err, "step 9 of job w not committed within 1 s"));
}

TEST_CASE("a rejected snapshot's error names it once, and export finds the daemon's root") {
  TempDir dir;
  Daemon d(dir, {"--staging-bytes", "2M"});
  d.Start();
  // Rank 0 of two saves step 2 while its step 1 (which rank 1 never saves) still holds the
  // staging memory: the stager refuses it, in words that name the snapshot.
  auto save = [&](const char* step) {
    return Run(Helper(d, {"--job", "big", "--rank", "0", "--world-size", "2", "--bytes", "1500000", "save",
                          "--step", step}),
               dir.path());
  };
  REQUIRE(save("1").exit_code == 0);
  auto r = save("2");
  INFO(r.out << r.err << d.Log());
  auto status = nlohmann::json::parse(d.Ctl({"--json", "status"}).out);
  REQUIRE(status["recent_errors"].size() >= 1);
  const std::string e = status["recent_errors"][0];
  CHECK(Contains(e, "[big/r0 s2]"));
  CHECK(e.find("[big/r0 s2]") == e.rfind("[big/r0 s2]"));

  // export reads the files of the daemon at --socket, not /var/lib/ckptd, and says where it looked.
  auto exported = Run({Runfile("client/ckptctl"), "--socket", d.socket(), "--job", "big", "export", "1",
                       dir.path() + "/out"},
                      dir.path());
  CHECK(exported.exit_code == 1);
  CHECK(Contains(exported.err, "(in the checkpoint root " + d.root() + ")"));
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
  auto offline = ctl({"--job", "offline", "verify", "2", "--root", d.root(), "--progress"});
  CHECK(offline.exit_code == 0);
  CHECK(Contains(offline.err, "verify: 100% ("));
  // Options before the command, as docs/operators.md says every option may be.
  auto before = ctl({"--root", d.root(), "--job", "offline", "list"});
  INFO(before.out << before.err);
  CHECK(before.exit_code == 0);
  CHECK(Contains(before.out, "offline  2"));
  // A root that is not there is an error naming it, not "no checkpoints".
  auto nowhere = ctl({"list", "--root", dir / "no-such-root"});
  CHECK(nowhere.exit_code == 1);
  CHECK(Contains(nowhere.err, "--root " + (dir / "no-such-root") + ": no such directory"));
  auto before_export = ctl({"--root", d.root(), "--job", "offline", "export", "2", dir / "exported", "--format", "full"});
  INFO(before_export.out << before_export.err);
  CHECK(before_export.exit_code == 0);
  CHECK(std::filesystem::exists(dir / "exported/checkpoint.json"));

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
