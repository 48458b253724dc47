// The remote tier (issue 20) against a real Ceph RADOS Gateway (tools/ceph.sh, one cluster
// for this binary): real ckptd processes with --remote, real trainer processes
// (tests/integration/reshard_helper), a TCP proxy the test controls in front of the
// gateway for faults. A node that loses its disk resumes from the bucket, bit for bit and
// with another number of ranks; uploads survive refused and hung connections and a kill
// mid-upload; nothing partial is ever listed.
#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <sys/stat.h>

#include <csignal>
#include <fstream>
#include <cstdlib>
#include <filesystem>
#include <sstream>

#include "storage/filesystem.h"
#include "storage/open_store.h"
#include "tests/fakes/ceph_cluster.h"
#include "tests/fakes/wait_until.h"
#include "tests/integration/cluster.h"
#include "tests/integration/common.h"
#include "tests/integration/tcp_proxy.h"

using namespace ckpt::testing;
using json = nlohmann::json;
using namespace std::chrono_literals;

namespace {

// The gateway's address and keys go to every process this test starts, as the AWS SDKs
// would find them.
struct Bucket {
  std::string url;       // s3://bucket/prefix, a prefix of its own per case
  std::string endpoint;  // the gateway itself
  int port = 0;
};

Bucket FreshBucket() {
  auto& ceph = CephCluster::Get();
  for (const auto& [name, value] : ceph.env()) ::setenv(name.c_str(), value.c_str(), 1);
  Bucket b;
  b.url = "s3://" + ceph.Options().bucket + "/" + ceph.FreshPrefix();
  b.endpoint = ceph.env().at("AWS_ENDPOINT_URL_S3");
  b.port = std::stoi(b.endpoint.substr(b.endpoint.rfind(':') + 1));
  return b;
}

// ckptctl reading the bucket alone (no daemon), straight from the gateway.
RunResult Offline(const TempDir& dir, const Bucket& b, std::vector<std::string> args) {
  std::vector<std::string> argv = {Runfile("client/ckptctl")};
  argv.insert(argv.end(), args.begin(), args.end());
  argv.insert(argv.end(), {"--root", b.url, "--s3-endpoint", b.endpoint});
  return Run(argv, dir.path());
}

bool RemoteLists(const TempDir& dir, const Bucket& b, const std::string& job, uint64_t step) {
  RunResult r = Offline(dir, b, {"--job", job, "list"});
  if (r.exit_code != 0) return false;
  // A row of the table: the job, then the step (columns as wide as their widest cell).
  std::istringstream rows(r.out);
  for (std::string row; std::getline(rows, row);) {
    std::istringstream cells(row);
    std::string first, second;
    if (cells >> first >> second && first == job && second == std::to_string(step)) return true;
  }
  return false;
}

// A group of two daemons on loopback: node 0 coordinates; the token in `dir`.
struct TwoNodes {
  explicit TwoNodes(const TempDir& dir) : token(dir.path() + "/token") {
    std::ofstream(token) << "remote-test-group-token-0123456789abcdef\n";
    std::filesystem::permissions(token, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  }
  std::vector<std::string> Flags(int node, std::vector<std::string> extra) const {
    std::vector<std::string> f = {"--node-rank", std::to_string(node), "--num-nodes", "2",
                                  "--coordinator", coordinator, "--group-token-file", token,
                                  "--group-timeout", "2s", "--restore-timeout", "20s"};
    if (node == 0) f.insert(f.end(), {"--group-addr", coordinator});
    f.insert(f.end(), extra.begin(), extra.end());
    return f;
  }
  const std::string token;
  const std::string coordinator = fmt::format("127.0.0.1:{}", PickFreePort());
};

json JobStatus(const Daemon& d, const std::string& job) {
  json s = Status(d);
  if (!s.contains("jobs")) return json::object();
  for (const json& j : s["jobs"]) {
    if (j.value("job", "") == job) return j;
  }
  return json::object();
}

// The first upload `ckptctl status` lists for `job` (an empty object when none).
json FirstUpload(const Daemon& d, const std::string& job) {
  json j = JobStatus(d, job);
  if (!j.contains("uploads") || j["uploads"].empty()) return json::object();
  return j["uploads"][0];
}


void SaveRanks(const Daemon& d, const TempDir& dir, uint32_t world, uint64_t step) {
  for (const RunResult& r : ReshardRanks(d, dir, world, {"--rows", "3001", "--layout", "rows", "save",
                                                         "--step", std::to_string(step),
                                                         "--wait-committed"})) {
    INFO(r.out << r.err << d.Log());
    REQUIRE(r.exit_code == 0);
    REQUIRE(Contains(r.out, "saved committed"));
  }
}

void RestoresExactly(const Daemon& d, const TempDir& dir, uint32_t world, const std::string& layout,
                     uint32_t saved_world, uint64_t step, const std::string& source) {
  for (const RunResult& r : ReshardRanks(d, dir, world, {"--layout", layout, "check", "--saved-world-size",
                                                         std::to_string(saved_world)})) {
    INFO(world << " ranks, " << layout << ": " << r.out << r.err << d.Log());
    CHECK(r.exit_code == 0);
    CHECK(Contains(r.out, fmt::format("restored step={} source={}", step, source)));
    CHECK(Contains(r.out, "match"));
  }
}


// Ranks of one job spread over nodes: `ranks[n]` run against node n's daemon, all at once.
std::vector<RunResult> RanksOnNodes(const std::vector<const Daemon*>& nodes,
                                    const std::vector<std::vector<uint32_t>>& ranks, uint32_t world,
                                    const TempDir& dir, std::vector<std::string> args) {
  std::vector<std::unique_ptr<Process>> running;
  for (size_t n = 0; n < nodes.size(); ++n) {
    for (uint32_t r : ranks[n]) {
      std::vector<std::string> argv = {Runfile("tests/integration/reshard_helper"), "--socket",
                                       nodes[n]->socket(), "--rank", std::to_string(r),
                                       "--world-size", std::to_string(world)};
      argv.insert(argv.end(), args.begin(), args.end());
      running.push_back(std::make_unique<Process>(
          argv, dir.path(), fmt::format("w{}r{}.{}", world, r, args.back())));
    }
  }
  std::vector<RunResult> out;
  for (auto& p : running) {
    RunResult r;
    r.exit_code = p->Wait(60s);
    r.out = p->Stdout();
    r.err = p->Stderr();
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace

TEST_CASE("a node that lost its disk resumes from the remote tier, with the same and another number of ranks") {
  const Bucket bucket = FreshBucket();
  TempDir dir;
  {
    Daemon d(dir, {"--remote", bucket.url, "--keep-last", "1"});
    d.Start();
    SaveRanks(d, dir, 4, 5);
    INFO(d.Log());
    REQUIRE(WaitUntil([&] { return RemoteLists(dir, bucket, "reshard", 5); }, 30s, 100ms));
    CHECK(WaitUntil([&] { return U64(JobStatus(d, "reshard")["latest_remote_step"]) == 5; }, 5s, 100ms));
    // The shards' data went up from staging memory, not read back from this node's disk.
    CHECK(Contains(d.Log(), "of them read from staging memory"));
    CHECK_FALSE(Contains(d.Log(), " 0 of them read from staging memory"));
    RunResult listed = d.Ctl({"--job", "reshard", "list"});
    CHECK(Contains(listed.out, "memory,local,remote"));
    REQUIRE(d.Stop() == 0);
    // The node is lost for good: its disk with it.
    std::filesystem::remove_all(d.root());
  }
  RunResult verified = Offline(dir, bucket, {"--job", "reshard", "verify", "5"});
  INFO(verified.out << verified.err);
  CHECK(verified.exit_code == 0);

  TempDir replacement;
  Daemon e(replacement, {"--remote", bucket.url});
  e.Start();
  RestoresExactly(e, replacement, 4, "rows", 4, 5, "remote");
  RestoresExactly(e, replacement, 3, "cols", 4, 5, "remote");
  RunResult listed = e.Ctl({"--job", "reshard", "list"});
  INFO(listed.out << listed.err);
  CHECK(listed.exit_code == 0);
  CHECK(Contains(listed.out, "remote"));
  CHECK_FALSE(Contains(listed.out, "local"));
}

TEST_CASE("uploads survive refused and hung connections and a kill mid-upload; nothing partial is listed") {
  const Bucket bucket = FreshBucket();
  TcpProxy proxy("127.0.0.1", bucket.port);
  ::setenv("AWS_ENDPOINT_URL_S3", ("http://" + proxy.address()).c_str(), 1);
  TempDir dir;
  Daemon d(dir, {"--remote", bucket.url});

  // The gateway refuses every connection from before ckptd starts: ckptd starts anyway,
  // commits locally, and says what is wrong.
  proxy.Cut(TcpProxy::CutMode::kRefuse);
  d.Start();
  CHECK(WaitUntil([&] { return Contains(d.Log(), "--remote " + bucket.url); }, 30s, 100ms));
  SaveRanks(d, dir, 2, 5);
  REQUIRE(WaitUntil([&] { return !FirstUpload(d, "reshard").value("last_error", "").empty(); }, 30s, 100ms));
  RunResult listed = d.Ctl({"--job", "reshard", "list"});
  INFO(listed.out << listed.err);
  CHECK(Contains(listed.out, "local"));  // the local tier is listed, the remote one named
  CHECK(Contains(listed.out, "the remote tier " + bucket.url + " cannot be listed"));
  CHECK(listed.exit_code == 3);
  CHECK_FALSE(RemoteLists(dir, bucket, "reshard", 5));
  // Once the gateway answers again the step goes up by itself.
  proxy.Heal();
  REQUIRE(WaitUntil([&] { return RemoteLists(dir, bucket, "reshard", 5); }, 60s, 100ms));
  // Its housekeeping done too (the uploader is free for the next step).
  REQUIRE(WaitUntil([&] { return U64(JobStatus(d, "reshard")["latest_remote_step"]) == 5; }, 30s, 100ms));

  // A gateway that stops answering mid-upload, and ckptd killed while it waits.
  proxy.Cut(TcpProxy::CutMode::kBlackhole);
  SaveRanks(d, dir, 2, 6);
  REQUIRE(WaitUntil([&] {
    json u = FirstUpload(d, "reshard");
    return U64(u["step"]) == 6 && u.value("state", "") == "uploading";
  }, 30s, 100ms));
  d.Kill();
  CHECK_FALSE(RemoteLists(dir, bucket, "reshard", 6));
  // Restarted while the gateway still hangs, ckptd starts (its look at the remote tier runs
  // beside the start: Start() fails after 20 s), and stopped while its requests wait, it
  // ends them at once, not after 30 s of stall per request and 6 attempts.
  d.Start();
  std::this_thread::sleep_for(1s);  // its requests on their way
  const auto stop_began = std::chrono::steady_clock::now();
  CHECK(d.Stop() == 0);
  CHECK(std::chrono::steady_clock::now() - stop_began < 10s);
  proxy.Heal();
  d.Start();  // the step a kill interrupted is uploaded at the next start
  INFO(d.Log());
  REQUIRE(WaitUntil([&] { return RemoteLists(dir, bucket, "reshard", 6); }, 60s, 100ms));
  CHECK(RemoteLists(dir, bucket, "reshard", 5));
  RunResult verified = Offline(dir, bucket, {"--job", "reshard", "verify", "6"});
  INFO(verified.out << verified.err);
  CHECK(verified.exit_code == 0);
  CHECK(d.Stop() == 0);
}

TEST_CASE("a multipart upload that a stop left unfinished (the gateway hung) is aborted at the next start") {
  const Bucket bucket = FreshBucket();
  const std::string prefix = bucket.url.substr(bucket.url.rfind('/') + 1);
  auto& ceph = CephCluster::Get();
  TcpProxy proxy("127.0.0.1", bucket.port);
  ::setenv("AWS_ENDPOINT_URL_S3", ("http://" + proxy.address()).c_str(), 1);
  TempDir dir;
  Daemon d(dir, {"--remote", bucket.url, "--staging-bytes", "1G"});
  d.Start();
  // A 400 MB shard goes up as a multipart upload of 16 MiB parts.
  RunResult saved = Run(Helper(d, {"--job", "mp", "--seed", "3", "--bytes", "400000000", "save", "--step", "5",
                                   "--wait-committed"}),
                        dir.path());
  INFO(saved.out << saved.err);
  REQUIRE(saved.exit_code == 0);
  // Once parts of it are in the bucket, the gateway stops answering, and ckptd is stopped:
  // the abort it sends as it stops never arrives.
  REQUIRE(WaitUntil([&] {
    json u = FirstUpload(d, "mp");
    return U64(u["step"]) == 5 && U64(u["bytes_done"]) > 0;
  }, 60s, 10ms));
  proxy.Cut(TcpProxy::CutMode::kBlackhole);
  CHECK(d.Stop() == 0);
  INFO(d.Log());
  REQUIRE_THAT(ceph.UnfinishedUploads(prefix), Catch::Contains("<UploadId>"));  // what the stop left
  CHECK_FALSE(RemoteLists(dir, bucket, "mp", 5));
  // At the next start ckptd aborts it (its own file, of a step it holds) and uploads the step.
  proxy.Heal();
  d.Start();
  if (!WaitUntil([&] { return RemoteLists(dir, bucket, "mp", 5); }, 180s, 100ms)) {
    FAIL("step 5 is not in the bucket after the restart:\n" << FirstUpload(d, "mp").dump() << "\n" << d.Log());
  }
  CHECK_THAT(ceph.UnfinishedUploads(prefix), !Catch::Contains("<UploadId>"));
  CHECK(Contains(d.Log(), "aborted 1 multipart upload(s) of this node's files that an earlier ckptd left unfinished"));
  RunResult verified = Offline(dir, bucket, {"--job", "mp", "verify", "5"});
  INFO(verified.out << verified.err);
  CHECK(verified.exit_code == 0);
  CHECK(d.Stop() == 0);
}

TEST_CASE("a missing bucket, then a gateway answering 503 SlowDown: named, retried, uploaded once each ends") {
  Bucket bucket = FreshBucket();
  const std::string missing = fmt::format("ckptd-missing-{}", ::getpid());
  bucket.url = "s3://" + missing + "/p";
  TcpProxy proxy("127.0.0.1", bucket.port);
  ::setenv("AWS_ENDPOINT_URL_S3", ("http://" + proxy.address()).c_str(), 1);
  TempDir dir;
  Daemon d(dir, {"--remote", bucket.url});
  d.Start();
  // Said at start (by the look at the remote tier that runs beside it), and ckptd runs on.
  CHECK(WaitUntil([&] { return Contains(d.Log(), "NoSuchBucket"); }, 30s, 100ms));
  SaveRanks(d, dir, 2, 5);
  REQUIRE(WaitUntil([&] {
    return Contains(FirstUpload(d, "reshard").value("last_error", ""), "the bucket " + missing + " does not exist");
  }, 30s, 100ms));
  CHECK(Contains(d.Ctl({"--job", "reshard", "list"}).out, "local"));
  // The operator creates the bucket: the step goes up with the next attempt.
  auto& ceph = CephCluster::Get();
  RunResult made = Run({"/usr/bin/curl", "-sS", "--fail", "-X", "PUT", "--aws-sigv4", "aws:amz:us-east-1:s3", "--user",
                        ceph.env().at("AWS_ACCESS_KEY_ID") + ":" + ceph.env().at("AWS_SECRET_ACCESS_KEY"),
                        "-H", "x-amz-content-sha256: UNSIGNED-PAYLOAD", bucket.endpoint + "/" + missing},
                       dir.path());
  INFO(made.out << made.err);
  REQUIRE(made.exit_code == 0);
  REQUIRE(WaitUntil([&] { return RemoteLists(dir, bucket, "reshard", 5); }, 90s, 200ms));
  REQUIRE(WaitUntil([&] { return U64(JobStatus(d, "reshard")["latest_remote_step"]) == 5; }, 30s, 100ms));

  // The gateway is up and answers every request with 503 SlowDown (S3's "reduce your
  // request rate"): retried with back-off, reported by its code, never listed half done.
  const std::string body =
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>SlowDown</Code>"
      "<Message>Please reduce your request rate.</Message></Error>";
  proxy.Answer(fmt::format("HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: {}"
                           "\r\nConnection: close\r\n\r\n{}", body.size(), body));
  SaveRanks(d, dir, 2, 6);
  REQUIRE(WaitUntil([&] {
    json u = FirstUpload(d, "reshard");
    return U64(u["step"]) == 6 && Contains(u.value("last_error", ""), "HTTP 503 SlowDown: Please reduce your request rate");
  }, 60s, 100ms));
  CHECK_FALSE(RemoteLists(dir, bucket, "reshard", 6));
  CHECK(Contains(d.Log(), "SlowDown"));
  proxy.Heal();
  REQUIRE(WaitUntil([&] { return RemoteLists(dir, bucket, "reshard", 6); }, 90s, 200ms));
  RunResult verified = Offline(dir, bucket, {"--job", "reshard", "verify", "6"});
  INFO(verified.out << verified.err);
  CHECK(verified.exit_code == 0);
  CHECK(d.Stop() == 0);
}

TEST_CASE("direct mode writes checkpoints to the bucket alone; another node restores them") {
  const Bucket bucket = FreshBucket();
  TempDir dir;
  {
    Daemon d(dir, {"--remote", bucket.url, "--remote-mode", "direct"});
    d.Start();
    SaveRanks(d, dir, 2, 7);
    CHECK(RemoteLists(dir, bucket, "reshard", 7));
    CHECK_FALSE(std::filesystem::exists(d.root() + "/reshard/step-00000007"));
    REQUIRE(d.Stop() == 0);
  }
  TempDir other;
  Daemon e(other, {"--remote", bucket.url, "--remote-mode", "direct"});
  e.Start();
  RestoresExactly(e, other, 2, "rows", 2, 7, "remote");
  RestoresExactly(e, other, 3, "cols", 2, 7, "remote");
}

TEST_CASE("wrong credentials: commits go on locally, the upload's error names the problem") {
  const Bucket bucket = FreshBucket();
  ::setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-key", 1);
  TempDir dir;
  Daemon d(dir, {"--remote", bucket.url});
  d.Start();
  SaveRanks(d, dir, 1, 3);
  REQUIRE(WaitUntil([&] { return !FirstUpload(d, "reshard").value("last_error", "").empty(); }, 30s, 100ms));
  json j = JobStatus(d, "reshard");
  INFO(j.dump());
  CHECK(U64(j["latest_committed_step"]) == 3);
  const std::string error = j["uploads"][0].value("last_error", "");
  CHECK((Contains(error, "403") || Contains(error, "denied") || Contains(error, "Signature")));
  CHECK_FALSE(Contains(d.Log(), "not-the-secret-key"));
  CHECK_FALSE(Contains(Status(d).dump(), "not-the-secret-key"));
  CHECK(d.Stop() == 0);
}

TEST_CASE("a group: every node uploads its part, the coordinator publishes; a node that lost its disk restores from the bucket") {
  const Bucket bucket = FreshBucket();
  TempDir shared;
  const TwoNodes group(shared);
  auto flags = [&](int n) { return group.Flags(n, {"--remote", bucket.url}); };
  TempDir dir0, dir1;
  Daemon node0(dir0, flags(0));
  auto node1 = std::make_unique<Daemon>(dir1, flags(1));
  node0.Start();
  node1->Start();
  const std::vector<std::vector<uint32_t>> layout = {{0, 1}, {2, 3}};
  for (const RunResult& r : RanksOnNodes({&node0, node1.get()}, layout, 4, shared,
                                         {"--rows", "3001", "--layout", "rows", "save", "--step", "8",
                                          "--wait-committed"})) {
    INFO(r.out << r.err << node0.Log() << node1->Log());
    REQUIRE(r.exit_code == 0);
  }
  INFO(node0.Log() << node1->Log());
  REQUIRE(WaitUntil([&] { return RemoteLists(shared, bucket, "reshard", 8); }, 30s, 100ms));
  // Each node logs its line once its upload returned: a reader may list the step a moment
  // before (the coordinator's comes after the manifest and the nodes' reports are removed).
  CHECK(WaitUntil([&] { return Contains(node1->Log(), "(this node's part)"); }, 30s, 100ms));
  CHECK(WaitUntil([&] { return Contains(node0.Log(), "(manifest written)"); }, 30s, 100ms));
  RunResult verified = Offline(shared, bucket, {"--job", "reshard", "verify", "8"});
  INFO(verified.out << verified.err);
  CHECK(verified.exit_code == 0);

  // Node 1 is replaced by a machine with an empty disk.
  REQUIRE(node1->Stop() == 0);
  std::filesystem::remove_all(node1->root());
  node1.reset();
  TempDir fresh;
  node1 = std::make_unique<Daemon>(fresh, flags(1));
  node1->Start();
  std::vector<RunResult> restored = RanksOnNodes({&node0, node1.get()}, layout, 4, shared,
                                                 {"--layout", "rows", "check", "--saved-world-size", "4"});
  for (size_t i = 0; i < restored.size(); ++i) {
    INFO("rank " << i << ": " << restored[i].out << restored[i].err);
    CHECK(restored[i].exit_code == 0);
    CHECK(Contains(restored[i].out, "restored step=8"));
    CHECK(Contains(restored[i].out, "match"));
    if (i >= 2) CHECK(Contains(restored[i].out, "source=remote"));
  }
  // And with another number of ranks: one per node.
  for (const RunResult& r : RanksOnNodes({&node0, node1.get()}, {{0}, {1}}, 2, shared,
                                         {"--layout", "cols", "check", "--saved-world-size", "4"})) {
    INFO(r.out << r.err);
    CHECK(r.exit_code == 0);
    CHECK(Contains(r.out, "restored step=8"));
    CHECK(Contains(r.out, "match"));
  }
}

TEST_CASE("--shared-root on CephFS (ceph-fuse, the same cluster): two nodes save into one root, each reads the other's shards") {
  auto& ceph = CephCluster::Get();
  const std::string root = ceph.FileSystem() + "/" + ceph.FreshPrefix();
  REQUIRE(std::filesystem::create_directories(root));
  TempDir shared;
  const TwoNodes group(shared);
  auto flags = [&](int n) { return group.Flags(n, {"--shared-root"}); };
  TempDir dir0, dir1;
  Daemon node0(dir0, flags(0)), node1(dir1, flags(1));
  node0.set_root(root);
  node1.set_root(root);
  node0.Start();
  node1.Start();
  INFO(node0.Log() << node1.Log());
  for (const RunResult& r : RanksOnNodes({&node0, &node1}, {{0, 1}, {2, 3}}, 4, shared,
                                         {"--rows", "3001", "--layout", "rows", "save", "--step", "8",
                                          "--wait-committed"})) {
    INFO(r.out << r.err);
    REQUIRE(r.exit_code == 0);
  }
  // One manifest for both nodes' shards, on CephFS, checked with no daemon.
  RunResult verified = Run({Runfile("client/ckptctl"), "--job", "reshard", "verify", "8", "--root", root}, shared.path());
  INFO(verified.out << verified.err);
  CHECK(verified.exit_code == 0);
  // Both daemons restart (their memory gone): one rank per node, in columns, each reading
  // the rows that both nodes wrote.
  REQUIRE(node0.Stop() == 0);
  REQUIRE(node1.Stop() == 0);
  node0.Start();
  node1.Start();
  for (const RunResult& r : RanksOnNodes({&node0, &node1}, {{0}, {1}}, 2, shared,
                                         {"--layout", "cols", "check", "--saved-world-size", "4"})) {
    INFO(r.out << r.err);
    CHECK(r.exit_code == 0);
    CHECK(Contains(r.out, "restored step=8 source=disk"));
    CHECK(Contains(r.out, "match"));
  }
}

TEST_CASE("a shared root with --remote: the coordinator uploads every file, an indexed step as its parts and index") {
  // The coordinator publishes steps whose manifest is over 1,000 bytes as an index and a part
  // per node (what a step of more than about 290,000 tensor pieces takes), so this small one
  // takes that path; the bucket then holds the same files, and a group whose shared root is
  // gone restores from it in another number of ranks.
  const Bucket bucket = FreshBucket();
  TempDir shared;
  const TwoNodes group(shared);
  std::string root = shared.path() + "/root";
  REQUIRE(std::filesystem::create_directories(root));
  auto flags = [&](int n) { return group.Flags(n, {"--shared-root", "--remote", bucket.url}); };
  TempDir dir0, dir1;
  auto node0 = std::make_unique<Daemon>(dir0, flags(0));
  auto node1 = std::make_unique<Daemon>(dir1, flags(1));
  node0->set_root(root);
  node1->set_root(root);
  ::setenv("CKPTD_TEST_MAX_WHOLE_MANIFEST_BYTES", "1000", 1);
  node0->Start();
  ::unsetenv("CKPTD_TEST_MAX_WHOLE_MANIFEST_BYTES");
  node1->Start();
  for (const RunResult& r : RanksOnNodes({node0.get(), node1.get()}, {{0, 1}, {2, 3}}, 4, shared,
                                         {"--rows", "3001", "--layout", "rows", "save", "--step", "8",
                                          "--wait-committed"})) {
    INFO(r.out << r.err << node0->Log() << node1->Log());
    REQUIRE(r.exit_code == 0);
  }
  INFO(node0->Log() << node1->Log());
  CHECK(Contains(node0->Log(), "published as an index and 2 node parts"));
  REQUIRE(WaitUntil([&] { return RemoteLists(shared, bucket, "reshard", 8); }, 30s, 100ms));
  RunResult verified = Offline(shared, bucket, {"--job", "reshard", "verify", "8"});
  INFO(verified.out << verified.err);
  CHECK(verified.exit_code == 0);
  CHECK(Contains(verified.out, "OK ("));

  // The shared root is lost with both daemons; a new group restores from the bucket.
  REQUIRE(node1->Stop() == 0);
  REQUIRE(node0->Stop() == 0);
  node0.reset();
  node1.reset();
  root = shared.path() + "/root2";
  REQUIRE(std::filesystem::create_directories(root));
  TempDir fresh0, fresh1;
  node0 = std::make_unique<Daemon>(fresh0, flags(0));
  node1 = std::make_unique<Daemon>(fresh1, flags(1));
  node0->set_root(root);
  node1->set_root(root);
  node0->Start();
  node1->Start();
  for (const RunResult& r : RanksOnNodes({node0.get(), node1.get()}, {{0}, {1}}, 2, shared,
                                         {"--layout", "cols", "check", "--saved-world-size", "4"})) {
    INFO(r.out << r.err << node0->Log());
    CHECK(r.exit_code == 0);
    CHECK(Contains(r.out, "restored step=8 source=remote"));
    CHECK(Contains(r.out, "match"));
  }
}

TEST_CASE("a replacement node knows whose job it is: another uid cannot take the job from the bucket") {
  REQUIRE(::geteuid() == 0);  // the suite runs as root so that it can be other users
  const Bucket bucket = FreshBucket();
  auto open_socket = [](const Daemon& d) {  // only ckptd's own checks stand in the way
    ::chmod(std::filesystem::path(d.socket()).parent_path().c_str(), 0755);
    ::chmod(d.socket().c_str(), 0666);
    ::chmod((d.socket() + ".ctl").c_str(), 0666);
  };
  auto as = [](const Daemon& d, int uid, std::vector<std::string> args) {
    args.insert(args.begin(), {"--as-uid", std::to_string(uid), "--job", "mine", "--bytes", "100000"});
    return Helper(d, args);
  };
  const std::vector<std::string> flags = {"--remote", bucket.url, "--allow-uid", "1000", "--allow-uid", "1001"};
  TempDir dir;
  {
    Daemon d(dir, flags);
    d.Start();
    open_socket(d);
    RunResult saved = Run(as(d, 1000, {"save", "--step", "4", "--wait-committed"}), dir.path());
    INFO(saved.out << saved.err);
    REQUIRE(saved.exit_code == 0);
    REQUIRE(WaitUntil([&] { return RemoteLists(dir, bucket, "mine", 4); }, 30s, 100ms));
    REQUIRE(d.Stop() == 0);
    std::filesystem::remove_all(d.root());
  }
  TempDir fresh;
  Daemon e(fresh, flags);
  e.Start();
  open_socket(e);
  // The first comer on the new node is not the job's owner: refused, nothing restored.
  RunResult intruder = Run(as(e, 1001, {"check"}), fresh.path());
  INFO(intruder.out << intruder.err << e.Log());
  CHECK(intruder.exit_code != 0);
  CHECK(Contains(intruder.out, "job mine belongs to uid 1000"));
  CHECK_FALSE(Contains(intruder.out, "restored step"));
  RunResult intruder_save = Run(as(e, 1001, {"save", "--step", "5", "--wait-committed"}), fresh.path());
  CHECK(intruder_save.exit_code != 0);
  // The owner restores from the bucket.
  RunResult owner = Run(as(e, 1000, {"check"}), fresh.path());
  INFO(owner.out << owner.err);
  CHECK(owner.exit_code == 0);
  CHECK(Contains(owner.out, "restored step=4 source=remote"));
}

TEST_CASE("the remote tier's own retention keeps the newest K uploaded steps") {
  const Bucket bucket = FreshBucket();
  TempDir dir;
  Daemon d(dir, {"--remote", bucket.url, "--remote-keep-last", "1", "--keep-last", "0"});
  d.Start();
  SaveRanks(d, dir, 1, 5);
  REQUIRE(WaitUntil([&] { return RemoteLists(dir, bucket, "reshard", 5); }, 30s, 100ms));
  SaveRanks(d, dir, 1, 6);
  INFO(d.Log());
  REQUIRE(WaitUntil([&] { return RemoteLists(dir, bucket, "reshard", 6); }, 30s, 100ms));
  CHECK(WaitUntil([&] { return !RemoteLists(dir, bucket, "reshard", 5); }, 30s, 100ms));
  // The local tier keeps its own (--keep-last 0: everything).
  RunResult local = d.Ctl({"--job", "reshard", "list"});
  CHECK(Contains(local.out, "reshard  5 "));
  CHECK(d.Stop() == 0);
}

namespace {

// --increments on (issue 48, step 6): model.a is 4 MiB of the 8 MiB a rank saves, in chunks
// of 64 KiB; only its first 4 KiB change from step to step.
const std::vector<std::string> kIncData = {"--job", "inc", "--seed", "7", "--bytes", "8388608"};

std::vector<std::string> Plus(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

std::vector<std::string> IncrementFlags(const Bucket& b, std::vector<std::string> more) {
  return Plus({"--remote", b.url, "--increments", "on", "--increment-chunk-bytes", "64K"}, more);
}

void SaveIncSteps(const Daemon& d, const TempDir& dir, const std::string& steps, bool restore_first) {
  std::vector<std::string> args = Plus(kIncData, {"save-steps", "--steps-list", steps, "--changed-bytes", "4096"});
  if (restore_first) args.push_back("--restore-first");
  Process p(Helper(d, args), dir.path(), "save-" + steps);
  const int rc = p.Wait();
  INFO(p.Stdout() << p.Stderr() << d.Log());
  REQUIRE(rc == 0);
}

void IncRestoresExactly(const Daemon& d, const TempDir& dir, uint64_t step, const std::string& source) {
  RunResult r = Run(Helper(d, Plus(kIncData, {"check", "--changed-bytes", "4096"})), dir.path());
  INFO(r.out << r.err << d.Log());
  CHECK(r.exit_code == 0);
  CHECK(Contains(r.out, fmt::format("restored step={} source={}", step, source)));
  CHECK(Contains(r.out, "match"));
}

// The objects directly under `prefix` of the bucket, by name (what no ckptctl command shows:
// held steps' records and files).
std::map<std::string, uint64_t> BucketObjects(const Bucket& b, const std::string& prefix) {
  auto store = ckpt::storage::OpenStore(b.url, ckpt::MakePosixFilesystem(), {b.endpoint, ""});
  REQUIRE(store.ok());
  auto listed = (*store)->List(prefix);
  REQUIRE(listed.ok());
  std::map<std::string, uint64_t> out;
  for (const auto& e : *listed) {
    if (!e.is_prefix) out[e.name] = e.bytes;
  }
  return out;
}

// How many bytes the upload of `job`'s `step` read from staging memory rather than the
// node's disk, from the daemon's "in the remote tier" line; -1 without one.
int64_t UploadedFromMemory(const Daemon& d, const std::string& job, uint64_t step) {
  const std::string log = d.Log();
  const size_t line = log.find(fmt::format("[{} s{}] in the remote tier", job, step));
  if (line == std::string::npos) return -1;
  const size_t end = log.find(" of them read from staging memory", line);
  if (end == std::string::npos) return -1;
  const size_t begin = log.rfind(", ", end);
  return std::stoll(log.substr(begin + 2, end - begin - 2));
}

// Names in `objects` that start with `start`.
int Count(const std::map<std::string, uint64_t>& objects, const std::string& start) {
  int n = 0;
  for (const auto& [name, bytes] : objects) n += name.rfind(start, 0) == 0 ? 1 : 0;
  return n;
}

json BucketManifest(const Bucket& b, uint64_t step) {
  auto store = ckpt::storage::OpenStore(b.url, ckpt::MakePosixFilesystem(), {b.endpoint, ""});
  REQUIRE(store.ok());
  auto text = (*store)->Get(fmt::format("inc/step-{:08d}/manifest.json", step), 64 << 20);
  REQUIRE(text.ok());
  return json::parse(*text, nullptr, false);
}

}  // namespace

TEST_CASE("with --increments on the bucket holds each step's own files, its base once, retired by records; a lost disk restores bit-exact") {
  const Bucket bucket = FreshBucket();
  TempDir dir;
  {
    Daemon d(dir, IncrementFlags(bucket, {"--keep-last", "2", "--remote-keep-last", "1"}));
    d.Start();
    SaveIncSteps(d, dir, "10", false);
    REQUIRE(WaitUntil([&] { return RemoteLists(dir, bucket, "inc", 10); }, 60s, 100ms));
    // A first save references nothing: its file went up from staging memory.
    CHECK(UploadedFromMemory(d, "inc", 10) > 0);
    // A resumed trainer: its saves reference step 10 (restored) and what they did not change.
    SaveIncSteps(d, dir, "20,30,40", true);
    INFO(d.Log());
    REQUIRE(WaitUntil([&] { return RemoteLists(dir, bucket, "inc", 40); }, 60s, 100ms));
    const json m = BucketManifest(bucket, 40);
    CHECK(m["format_version"] == 5);
    CHECK(m["increment"]["origin_steps"][0]["step"] == 10);
    CHECK(uint64_t{m["increment"]["own_bytes"]} < (uint64_t{1} << 20));
    // --remote-keep-last 1: step 10 left the listing but, referenced by 40, was retired: its
    // record and its file stay; steps 20 and 30 (not referenced) are gone, if they went up.
    REQUIRE(WaitUntil([&] { return !RemoteLists(dir, bucket, "inc", 10); }, 30s, 100ms));
    const auto held = BucketObjects(bucket, "inc/step-00000010");
    INFO(json(held).dump());
    CHECK(Count(held, "held-") == 1);
    CHECK(Count(held, "rank-00000.") == 1);
    CHECK(held.count("manifest.json") == 0);
    CHECK(WaitUntil([&] { return BucketObjects(bucket, "inc/step-00000020").empty() &&
                                 BucketObjects(bucket, "inc/step-00000030").empty(); }, 30s, 100ms));
    // The upload of 40 read its own file from disk (an increment's file is laid out anew,
    // not its staging block): only its own bytes went (its file).
    CHECK(UploadedFromMemory(d, "inc", 40) == 0);
    const auto own = BucketObjects(bucket, "inc/step-00000040");
    CHECK(Count(own, "rank-00000.") == 1);
    for (const auto& [name, bytes] : own) {
      if (name.rfind("rank-", 0) == 0) CHECK(bytes == uint64_t{m["shards"][0]["bytes"]});
    }
    REQUIRE(d.Stop() == 0);
    std::filesystem::remove_all(d.root());  // the node is lost, its disk with it
  }
  RunResult verified = Offline(dir, bucket, {"--job", "inc", "verify", "40"});
  INFO(verified.out << verified.err);
  CHECK(verified.exit_code == 0);
  CHECK(Contains(verified.out, "referenced in 1 files of earlier steps"));

  TempDir replacement;
  Daemon e(replacement, IncrementFlags(bucket, {"--keep-last", "2", "--remote-keep-last", "1"}));
  e.Start();
  IncRestoresExactly(e, replacement, 40, "remote");
  // A new session that saves from scratch: once 60 is the one kept step, nothing references
  // step 10 or 40 any more, and the bucket holds none of their objects.
  SaveIncSteps(e, replacement, "50,60", false);
  INFO(e.Log());
  REQUIRE(WaitUntil([&] { return RemoteLists(dir, bucket, "inc", 60); }, 60s, 100ms));
  CHECK(WaitUntil([&] {
    return BucketObjects(bucket, "inc/step-00000010").empty() && BucketObjects(bucket, "inc/step-00000040").empty();
  }, 30s, 100ms));
  CHECK(e.Stop() == 0);
}

TEST_CASE("with --increments on a step whose base never went up carries it once; a kill mid-upload loses nothing") {
  const Bucket bucket = FreshBucket();
  TcpProxy proxy("127.0.0.1", bucket.port);
  ::setenv("AWS_ENDPOINT_URL_S3", ("http://" + proxy.address()).c_str(), 1);
  TempDir dir;
  Daemon d(dir, IncrementFlags(bucket, {"--keep-last", "1"}));
  // The gateway refuses: nothing goes up while the steps commit locally.
  proxy.Cut(TcpProxy::CutMode::kRefuse);
  d.Start();
  SaveIncSteps(d, dir, "10", false);
  SaveIncSteps(d, dir, "20,30", true);
  // Then it hangs, and the upload's next attempt waits on it.
  proxy.Cut(TcpProxy::CutMode::kBlackhole);
  REQUIRE(WaitUntil([&] {
    json u = FirstUpload(d, "inc");
    return U64(u["step"]) == 30 && u.value("state", "") == "uploading";
  }, 30s, 100ms));
  // Killed while it waits on the gateway; --keep-last 1 retired step 10 locally meanwhile.
  d.Kill();
  proxy.Heal();
  d.Start();
  INFO(d.Log());
  REQUIRE(WaitUntil([&] { return RemoteLists(dir, bucket, "inc", 30); }, 60s, 100ms));
  // Step 10 was never uploaded as a step: its file was carried for 30, after a record.
  CHECK_FALSE(RemoteLists(dir, bucket, "inc", 10));
  const auto carried = BucketObjects(bucket, "inc/step-00000010");
  INFO(json(carried).dump());
  CHECK(Count(carried, "held-") == 1);
  CHECK(Count(carried, "rank-00000.") == 1);
  CHECK(Contains(d.Log(), "carried rank-00000."));
  RunResult verified = Offline(dir, bucket, {"--job", "inc", "verify", "30"});
  INFO(verified.out << verified.err);
  CHECK(verified.exit_code == 0);
  // The next step references 10 too: the bucket has it, so it is not carried again.
  SaveIncSteps(d, dir, "40", true);
  REQUIRE(WaitUntil([&] { return RemoteLists(dir, bucket, "inc", 40); }, 60s, 100ms));
  CHECK(Count(BucketObjects(bucket, "inc/step-00000010"), "rank-00000.") == 1);
  const std::string log = d.Log();
  size_t carries = 0;
  for (size_t at = log.find("carried rank-"); at != std::string::npos; at = log.find("carried rank-", at + 1)) ++carries;
  CHECK(carries == 1);
  REQUIRE(d.Stop() == 0);
  std::filesystem::remove_all(d.root());
  TempDir replacement;
  Daemon e(replacement, IncrementFlags(bucket, {}));
  e.Start();
  IncRestoresExactly(e, replacement, 40, "remote");
}

TEST_CASE("direct mode with --increments on: steps reference their base in the bucket, retired by records; another node restores") {
  const Bucket bucket = FreshBucket();
  const std::vector<std::string> flags =
      IncrementFlags(bucket, {"--remote-mode", "direct", "--keep-last", "1"});
  TempDir dir;
  {
    Daemon d(dir, flags);
    d.Start();
    SaveIncSteps(d, dir, "10,20,30", false);
    INFO(d.Log());
    // Retention (--keep-last 1) retires 10 and deletes 20 in the bucket after 30 commits: an
    // offline listing that meets a step as it goes is asked again (TSan made it meet one).
    CHECK(WaitUntil([&] { return RemoteLists(dir, bucket, "inc", 30); }, 30s, 200ms));
    const json m = BucketManifest(bucket, 30);
    CHECK(m["increment"]["origin_steps"][0]["step"] == 10);
    // --keep-last 1: 10 retired by a record (30 references it), 20 deleted.
    REQUIRE(WaitUntil([&] { return !RemoteLists(dir, bucket, "inc", 10) && !RemoteLists(dir, bucket, "inc", 20); },
                      30s, 100ms));
    CHECK(WaitUntil([&] { return BucketObjects(bucket, "inc/step-00000020").empty(); }, 30s, 100ms));
    const auto held = BucketObjects(bucket, "inc/step-00000010");
    INFO(json(held).dump());
    CHECK(Count(held, "held-") == 1);
    CHECK(Count(held, "rank-00000.") == 1);
    // A restart sweeps unfinished steps: never a held one.
    REQUIRE(d.Stop() == 0);
    d.Start();
    CHECK(Count(BucketObjects(bucket, "inc/step-00000010"), "rank-00000.") == 1);
    REQUIRE(d.Stop() == 0);
  }
  RunResult verified = Offline(dir, bucket, {"--job", "inc", "verify", "30"});
  INFO(verified.out << verified.err);
  CHECK(verified.exit_code == 0);
  TempDir other;
  Daemon e(other, flags);
  e.Start();
  IncRestoresExactly(e, other, 30, "remote");
}

namespace {

// --increments on in a group with the remote tier (issue 48, step 6 for groups): job "g" of
// cluster.h, each rank's 4 MB of tensors, model.a half of them in chunks of 64 KiB, only its
// first 4 KiB changing from step to step.
constexpr uint64_t kGroupRankBytes = 4'000'000;

void GroupIncrements(ckpt::testing::cluster::Cluster& c, const Bucket& b, std::vector<std::string> more) {
  c.bytes = kGroupRankBytes;
  c.extra_flags = IncrementFlags(b, more);
}

// Every rank of the cluster saves `steps` in one session each, and each save commits.
void GroupSaveSteps(ckpt::testing::cluster::Cluster& c, const std::string& steps, bool restore_first) {
  std::vector<std::unique_ptr<Process>> savers;
  for (uint32_t r = 0; r < c.world_size(); ++r) {
    const int n = c.NodeOf(r);
    std::vector<std::string> args =
        Plus(c.RankArgs(r, 1), {"save-steps", "--steps-list", steps, "--changed-bytes", "4096"});
    if (restore_first) args.push_back("--restore-first");
    savers.push_back(std::make_unique<Process>(Helper(c.node(n), args), c.dir(n).path(),
                                               fmt::format("steps-{}-r{}", steps, r)));
  }
  for (size_t r = 0; r < savers.size(); ++r) {
    const int rc = savers[r]->Wait(ckpt::testing::cluster::kProcessBound);
    INFO("rank " << r << ": " << savers[r]->Stdout() << savers[r]->Stderr() << c.Logs());
    REQUIRE(rc == 0);
  }
}

// Every rank restores at once and checks its bytes; node n's ranks must say `source[n]`
// (empty: any source).
void GroupRestoresExactly(ckpt::testing::cluster::Cluster& c, uint64_t step, const std::vector<std::string>& source) {
  std::vector<std::unique_ptr<Process>> procs;
  for (uint32_t r = 0; r < c.world_size(); ++r) {
    const int n = c.NodeOf(r);
    procs.push_back(std::make_unique<Process>(Helper(c.node(n), Plus(c.RankArgs(r, 1), {"check", "--changed-bytes", "4096"})),
                                              c.dir(n).path(), fmt::format("check-r{}", r)));
  }
  for (uint32_t r = 0; r < c.world_size(); ++r) {
    const int rc = procs[r]->Wait(ckpt::testing::cluster::kProcessBound);
    INFO("rank " << r << ": " << procs[r]->Stdout() << procs[r]->Stderr() << c.Logs());
    CHECK(rc == 0);
    const std::string& from = source[c.NodeOf(r)];
    CHECK(Contains(procs[r]->Stdout(), from.empty() ? fmt::format("restored step={} ", step)
                                                    : fmt::format("restored step={} source={}", step, from)));
    CHECK(Contains(procs[r]->Stdout(), "match"));
  }
}

// The (step, run) pairs of a manifest's increment.origin_steps.
std::set<std::pair<uint64_t, uint64_t>> OriginSteps(const json& manifest) {
  std::set<std::pair<uint64_t, uint64_t>> out;
  if (!manifest.contains("increment")) return out;
  for (const json& s : manifest["increment"]["origin_steps"]) out.insert({U64(s["step"]), U64(s["run"])});
  return out;
}

json BucketJson(const Bucket& b, const std::string& key) {
  auto store = ckpt::storage::OpenStore(b.url, ckpt::MakePosixFilesystem(), {b.endpoint, ""});
  REQUIRE(store.ok());
  auto text = (*store)->Get(key, 64 << 20);
  INFO(key);
  REQUIRE(text.ok());
  return json::parse(*text, nullptr, false);
}

// The bytes of the rank files (of any rank) directly under `prefix`.
uint64_t RankFileBytes(const std::map<std::string, uint64_t>& objects) {
  uint64_t bytes = 0;
  for (const auto& [name, size] : objects) bytes += name.rfind("rank-", 0) == 0 ? size : 0;
  return bytes;
}

}  // namespace

TEST_CASE("a group with --increments on: each node uploads its ranks' own files, the index holds the union of "
          "origins, a retired base stays held; a node that lost its disk restores bit-exact from the bucket") {
  using ckpt::testing::cluster::Cluster;
  const Bucket bucket = FreshBucket();
  Cluster c({{0, 1}, {2}});
  GroupIncrements(c, bucket, {"--keep-last", "2", "--remote-keep-last", "1"});
  c.StartAll();
  REQUIRE_WITHIN(c, ckpt::testing::cluster::kJoinBound, "every node joined and alive", c.AllAlive());
  const TempDir& dir = c.shared();
  GroupSaveSteps(c, "10", false);
  REQUIRE_WITHIN(c, 60s, "step 10 in the bucket", RemoteLists(dir, bucket, "g", 10));
  // Resumed trainers: their saves reference step 10 (restored) where nothing changed.
  GroupSaveSteps(c, "20,30,40", true);
  REQUIRE_WITHIN(c, 60s, "step 40 in the bucket", RemoteLists(dir, bucket, "g", 40));
  INFO(c.Logs());

  // The step went up as an index and a part per node, version 5; the index's figures are the
  // whole step's and its origin steps the union of its parts' (each node's ranks reference 10).
  const json index = BucketJson(bucket, "g/step-00000040/manifest.json");
  REQUIRE_FALSE(index.is_discarded());
  CHECK(index["format_version"] == 5);
  REQUIRE(index.contains("index"));
  const uint64_t own = U64(index["increment"]["own_bytes"]);
  const uint64_t referenced = U64(index["increment"]["referenced_bytes"]);
  INFO("step 40: own " << own << ", referenced " << referenced);
  CHECK(own * 10 < own + referenced);
  CHECK(referenced > 3 * kGroupRankBytes * 8 / 10);
  std::set<std::pair<uint64_t, uint64_t>> parts_steps;
  for (int n = 0; n < c.num_nodes(); ++n) {
    const json part = BucketJson(bucket, fmt::format("g/step-00000040/manifest-node-{:05d}.json", n));
    REQUIRE_FALSE(part.is_discarded());
    CHECK(U64(part["increment"]["own_bytes"]) == own);
    CHECK(part["increment"]["origins"].size() == c.ranks(n).size());  // its own ranks' files of step 10
    const auto steps = OriginSteps(part);
    parts_steps.insert(steps.begin(), steps.end());
  }
  const auto index_steps = OriginSteps(index);
  CHECK(index_steps == parts_steps);
  REQUIRE(index_steps.size() == 1);
  CHECK(index_steps.begin()->first == 10);

  // Each rank's own file of step 40, tagged, went up, and only its own bytes: a small
  // fraction of what step 10 uploaded.
  const auto forty = BucketObjects(bucket, "g/step-00000040");
  INFO(json(forty).dump());
  for (uint32_t r = 0; r < c.world_size(); ++r) CHECK(Count(forty, fmt::format("rank-{:05d}.", r)) == 1);
  CHECK(Count(forty, "rank-") == 3);
  CHECK(RankFileBytes(forty) == own);
  CHECK(BucketObjects(bucket, "g/.uploads/step-00000040").empty());  // the reports are gone

  // --remote-keep-last 1: step 10 left the listing but stays held, its record and every
  // rank's file kept (40 references them); 20 and 30 (not referenced) are gone.
  REQUIRE_WITHIN(c, 30s, "step 10 retired remotely", !RemoteLists(dir, bucket, "g", 10));
  const auto held = BucketObjects(bucket, "g/step-00000010");
  INFO(json(held).dump());
  CHECK(Count(held, "held-") >= 1);
  CHECK(Count(held, "rank-") == 3);
  CHECK(held.count("manifest.json") == 0);
  CHECK(RankFileBytes(held) > 10 * own);
  REQUIRE_WITHIN(c, 30s, "steps 20 and 30 gone from the bucket",
                 BucketObjects(bucket, "g/step-00000020").empty() && BucketObjects(bucket, "g/step-00000030").empty());
  RunResult verified = Offline(dir, bucket, {"--job", "g", "verify", "40"});
  INFO(verified.out << verified.err);
  CHECK(verified.exit_code == 0);
  CHECK(Contains(verified.out, "referenced in 3 files of earlier steps"));

  // Node 1's machine is gone with its disk; its replacement restores its rank from the
  // bucket, through the references to the held step, bit for bit.
  c.Lose(1);
  c.Start(1);
  REQUIRE_WITHIN(c, ckpt::testing::cluster::kJoinBound, "the replacement joined", c.AllAlive());
  GroupRestoresExactly(c, 40, {"", "remote"});
  // Resumed, the group goes on. The replacement's rank has no base on its empty disk (what it
  // restored came from the bucket): its step 50 is full, node 0's references as before, and
  // the index's origin steps are node 0's part's alone.
  GroupSaveSteps(c, "50", true);
  REQUIRE_WITHIN(c, 60s, "step 50 in the bucket", RemoteLists(dir, bucket, "g", 50));
  const json index50 = BucketJson(bucket, "g/step-00000050/manifest.json");
  const json part50_0 = BucketJson(bucket, "g/step-00000050/manifest-node-00000.json");
  const json part50_1 = BucketJson(bucket, "g/step-00000050/manifest-node-00001.json");
  CHECK(OriginSteps(part50_1).empty());
  CHECK_FALSE(OriginSteps(part50_0).empty());
  CHECK(OriginSteps(index50) == OriginSteps(part50_0));
  RunResult fifty = Offline(dir, bucket, {"--job", "g", "verify", "50"});
  INFO(fifty.out << fifty.err);
  CHECK(fifty.exit_code == 0);
  // Retention keeps what 50 references (held) and nothing 50 does not.
  REQUIRE_WITHIN(c, 30s, "step 40 retired remotely", !RemoteLists(dir, bucket, "g", 40));
  for (const auto& [step, run] : OriginSteps(index50)) {
    INFO("step " << step);
    CHECK(Count(BucketObjects(bucket, fmt::format("g/step-{:08d}", step)), "rank-") == 3);
  }
}

TEST_CASE("a shared root with --remote and --increments on: the coordinator uploads each step's own files and "
          "its base once; another machine restores from the bucket") {
  using ckpt::testing::cluster::Cluster;
  const Bucket bucket = FreshBucket();
  Cluster c({{0}, {1}});
  TempDir root;
  GroupIncrements(c, bucket, {"--keep-last", "1"});
  c.shared_root = root.path() + "/shared";
  REQUIRE(std::filesystem::create_directories(c.shared_root));
  // The coordinator publishes these steps as an index and a part per node (what a step of
  // more than about 290,000 tensor pieces takes): the remote tier gets the same files.
  ::setenv("CKPTD_TEST_MAX_WHOLE_MANIFEST_BYTES", "1000", 1);
  c.Start(0);
  ::unsetenv("CKPTD_TEST_MAX_WHOLE_MANIFEST_BYTES");
  c.Start(1);
  REQUIRE_WITHIN(c, ckpt::testing::cluster::kJoinBound, "every node joined and alive", c.AllAlive());
  GroupSaveSteps(c, "10", false);
  GroupSaveSteps(c, "20,30", true);
  REQUIRE_WITHIN(c, 60s, "step 30 in the bucket", RemoteLists(c.shared(), bucket, "g", 30));
  INFO(c.Logs());
  CHECK(Contains(c.node(0).Log(), "published as an index and 2 node parts"));
  const json m = BucketJson(bucket, "g/step-00000030/manifest.json");
  REQUIRE_FALSE(m.is_discarded());
  CHECK(m["format_version"] == 5);
  CHECK(m.contains("index"));
  REQUIRE(m["increment"]["origin_steps"].size() >= 1);
  CHECK(m["increment"]["origin_steps"][0]["step"] == 10);
  const auto thirty = BucketObjects(bucket, "g/step-00000030");
  CHECK(Count(thirty, "rank-") == 2);
  CHECK(RankFileBytes(thirty) == U64(m["increment"]["own_bytes"]));
  // Step 10's files are in the bucket: uploaded as step 10, or carried for 30.
  CHECK(Count(BucketObjects(bucket, "g/step-00000010"), "rank-") == 2);
  RunResult verified = Offline(c.shared(), bucket, {"--job", "g", "verify", "30"});
  INFO(verified.out << verified.err);
  CHECK(verified.exit_code == 0);
  for (int n = c.num_nodes() - 1; n >= 0; --n) CHECK(c.node(n).Stop() == 0);
  // Another group whose shared root is empty restores step 30 from the bucket alone.
  Cluster d({{0}, {1}});
  GroupIncrements(d, bucket, {});
  d.shared_root = root.path() + "/another";
  REQUIRE(std::filesystem::create_directories(d.shared_root));
  d.StartAll();
  REQUIRE_WITHIN(d, ckpt::testing::cluster::kJoinBound, "the new group joined", d.AllAlive());
  GroupRestoresExactly(d, 30, {"remote", "remote"});
}

TEST_CASE("a group in direct mode with --increments on: parts reference their base in the bucket, retired by a "
          "record; another group with empty disks restores bit-exact") {
  using ckpt::testing::cluster::Cluster;
  const Bucket bucket = FreshBucket();
  Cluster c({{0, 1}, {2}});
  GroupIncrements(c, bucket, {"--remote-mode", "direct", "--keep-last", "1"});
  c.StartAll();
  REQUIRE_WITHIN(c, ckpt::testing::cluster::kJoinBound, "every node joined and alive", c.AllAlive());
  GroupSaveSteps(c, "10,20,30", false);
  INFO(c.Logs());
  // The bucket is the only tier: each step is committed there, as an index and a part per
  // node, with no local copy.
  REQUIRE(RemoteLists(c.shared(), bucket, "g", 30));
  for (int n = 0; n < c.num_nodes(); ++n) CHECK_FALSE(std::filesystem::exists(c.StepDir(n, 30)));
  const json index = BucketJson(bucket, "g/step-00000030/manifest.json");
  REQUIRE_FALSE(index.is_discarded());
  CHECK(index["format_version"] == 5);
  const uint64_t own = U64(index["increment"]["own_bytes"]);
  const uint64_t referenced = U64(index["increment"]["referenced_bytes"]);
  INFO("step 30: own " << own << ", referenced " << referenced);
  CHECK(own * 10 < own + referenced);
  const auto origins = OriginSteps(index);
  REQUIRE(origins.size() == 1);
  CHECK(origins.begin()->first == 10);
  const auto thirty = BucketObjects(bucket, "g/step-00000030");
  INFO(json(thirty).dump());
  CHECK(Count(thirty, "rank-") == 3);
  CHECK(RankFileBytes(thirty) == own);
  // --keep-last 1: step 10 retired (30 references it), its files kept; 20 gone.
  REQUIRE_WITHIN(c, 30s, "steps 10 and 20 out of the listing",
                 !RemoteLists(c.shared(), bucket, "g", 10) && !RemoteLists(c.shared(), bucket, "g", 20));
  REQUIRE_WITHIN(c, 30s, "step 20's objects gone", BucketObjects(bucket, "g/step-00000020").empty());
  const auto held = BucketObjects(bucket, "g/step-00000010");
  INFO(json(held).dump());
  CHECK(Count(held, "held-") >= 1);
  CHECK(Count(held, "rank-") == 3);
  CHECK(RankFileBytes(held) > 10 * own);
  RunResult verified = Offline(c.shared(), bucket, {"--job", "g", "verify", "30"});
  INFO(verified.out << verified.err);
  CHECK(verified.exit_code == 0);
  CHECK(Contains(verified.out, "referenced in 3 files of earlier steps"));
  // A restart of the coordinator sweeps unfinished steps in the bucket, never a held one.
  REQUIRE(c.node(0).Stop() == 0);
  c.Start(0);
  REQUIRE_WITHIN(c, ckpt::testing::cluster::kJoinBound, "the coordinator rejoined", c.AllAlive());
  CHECK(Count(BucketObjects(bucket, "g/step-00000010"), "rank-") == 3);
  for (int n = c.num_nodes() - 1; n >= 0; --n) CHECK(c.node(n).Stop() == 0);
  // Another group, fresh disks, restores step 30 from the bucket through the retired base.
  Cluster d({{0, 1}, {2}});
  GroupIncrements(d, bucket, {"--remote-mode", "direct"});
  d.StartAll();
  REQUIRE_WITHIN(d, ckpt::testing::cluster::kJoinBound, "the new group joined", d.AllAlive());
  GroupRestoresExactly(d, 30, {"remote", "remote"});
}

TEST_CASE("a group with --increments on: a node carries its own ranks' base once, after a record of its own; "
          "killed mid-upload and restarted, it loses nothing") {
  using ckpt::testing::cluster::Cluster;
  const Bucket bucket = FreshBucket();
  // Node 1 reaches the gateway through a proxy the test cuts; node 0 directly.
  TcpProxy proxy("127.0.0.1", bucket.port);
  Cluster c({{0, 1}, {2}});
  // Only step 30 is on the upload grid: steps 10 and 20 never go up as steps, and 30
  // references 10 (retired locally by --keep-last 1), which every node carries for its ranks.
  GroupIncrements(c, bucket, {"--keep-last", "1", "--upload-every-steps", "30"});
  c.Start(0);
  ::setenv("AWS_ENDPOINT_URL_S3", ("http://" + proxy.address()).c_str(), 1);
  proxy.Cut(TcpProxy::CutMode::kRefuse);
  c.Start(1);
  ::setenv("AWS_ENDPOINT_URL_S3", bucket.endpoint.c_str(), 1);
  REQUIRE_WITHIN(c, ckpt::testing::cluster::kJoinBound, "every node joined and alive", c.AllAlive());
  GroupSaveSteps(c, "10,20,30", false);
  // Node 1's upload of its part of 30 hangs on the gateway; it is killed there.
  proxy.Cut(TcpProxy::CutMode::kBlackhole);
  REQUIRE_WITHIN(c, 30s, "node 1 uploading its part of step 30", [&] {
    json u = FirstUpload(c.node(1), "g");
    return U64(u["step"]) == 30 && u.value("state", "") == "uploading";
  }());
  c.node(1).Kill();
  proxy.Heal();
  CHECK_FALSE(RemoteLists(c.shared(), bucket, "g", 30));  // the coordinator waits for node 1's part
  c.Start(1);  // straight to the gateway now
  REQUIRE_WITHIN(c, 90s, "step 30 in the bucket", RemoteLists(c.shared(), bucket, "g", 30));
  INFO(c.Logs());
  // Step 10 never went up as a step: each node carried its own ranks' files of it, after a
  // record of its own.
  CHECK_FALSE(RemoteLists(c.shared(), bucket, "g", 10));
  const auto carried = BucketObjects(bucket, "g/step-00000010");
  INFO(json(carried).dump());
  CHECK(Count(carried, "held-") == 2);
  CHECK(Count(carried, "rank-") == 3);
  for (int n = 0; n < 2; ++n) {
    bool named = false;
    for (const auto& [name, bytes] : carried) named |= name.find(fmt::format(".node-{}.json", n)) != std::string::npos;
    CHECK(named);
  }
  CHECK(Contains(c.node(0).Log(), "carried rank-00000."));
  CHECK(Contains(c.node(0).Log(), "carried rank-00001."));
  CHECK(Contains(c.node(1).Log(), "carried rank-00002."));
  CHECK(RankFileBytes(BucketObjects(bucket, "g/step-00000030")) * 10 < RankFileBytes(carried));
  RunResult verified = Offline(c.shared(), bucket, {"--job", "g", "verify", "30"});
  INFO(verified.out << verified.err);
  CHECK(verified.exit_code == 0);
  // Node 1's disk is lost: its rank comes back from the bucket through the carried base.
  c.Lose(1);
  c.Start(1);
  REQUIRE_WITHIN(c, ckpt::testing::cluster::kJoinBound, "the replacement joined", c.AllAlive());
  GroupRestoresExactly(c, 30, {"", "remote"});
}
