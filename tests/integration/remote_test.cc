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

#include "tests/fakes/ceph_cluster.h"
#include "tests/fakes/wait_until.h"
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
