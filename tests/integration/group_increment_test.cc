// --increments on in a group (issue 48, step 4): three real ckptd on loopback, each with its
// own root (or one shared root), one job over five ranks whose trainers each save a run of
// steps in one session. Steps after the first write a small fraction of their bytes and
// reference the rest; every node's manifest records the whole step's own and referenced
// bytes; retention holds referenced steps on every root; restores after a restart are
// bit-exact from disk; a node killed mid-step aborts the step everywhere and loses nothing
// committed.
#include <signal.h>

#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "tests/fakes/wait_until.h"
#include "tests/integration/cluster.h"
#include "tests/integration/common.h"

using namespace ckpt::testing;
using namespace ckpt::testing::cluster;
using namespace std::chrono_literals;
using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

// Each rank's tensors hold 4 MB, model.a half of it in chunks of 64 KiB; only its first
// 4 KiB change from step to step (they hold the step number).
constexpr uint64_t kRankBytes = 4'000'000;
const std::string kChanged = "4096";

// Nodes 0, 1 and 2 hold ranks {0, 1}, {2, 3} and {4}.
const std::vector<std::vector<uint32_t>> kLayout = {{0, 1}, {2, 3}, {4}};

void WithIncrements(Cluster& c, const std::string& shared_root = "") {
  c.bytes = kRankBytes;
  c.shared_root = shared_root;
  c.extra_flags = {"--increments", "on", "--increment-chunk-bytes", "64K", "--keep-last", "2"};
}

// Every rank's trainer, one session each, saving `steps` ("10,20,30") and waiting for each
// to commit; with `restore_first` it restores the latest step before its first save.
std::vector<std::unique_ptr<Process>> SaveSteps(Cluster& c, const std::string& steps, bool restore_first = false) {
  std::vector<std::unique_ptr<Process>> out;
  for (uint32_t r = 0; r < c.world_size(); ++r) {
    const int n = c.NodeOf(r);
    std::vector<std::string> args = c.RankArgs(r, 1);
    args.insert(args.end(), {"save-steps", "--steps-list", steps, "--changed-bytes", kChanged});
    if (restore_first) args.push_back("--restore-first");
    out.push_back(std::make_unique<Process>(Helper(c.node(n), args), c.dir(n).path(),
                                            fmt::format("steps-{}-r{}", steps, r)));
  }
  return out;
}

void RequireSaved(Cluster& c, std::vector<std::unique_ptr<Process>>& savers) {
  for (size_t r = 0; r < savers.size(); ++r) {
    const int rc = savers[r]->Wait(kProcessBound);
    INFO("rank " << r << ": " << savers[r]->Stdout() << savers[r]->Stderr() << c.Logs());
    REQUIRE(rc == 0);
  }
}

// Every rank restores at once, and checks its bytes (the step's number in model.a's first
// bytes); `source[n]` is what node n's ranks must report.
void RestoreAll(Cluster& c, uint64_t step, const std::vector<std::string>& source) {
  std::vector<std::unique_ptr<Process>> procs;
  for (uint32_t r = 0; r < c.world_size(); ++r) {
    const int n = c.NodeOf(r);
    std::vector<std::string> args = c.RankArgs(r, 1);
    args.insert(args.end(), {"check", "--changed-bytes", kChanged});
    procs.push_back(std::make_unique<Process>(Helper(c.node(n), args), c.dir(n).path(), fmt::format("check-r{}", r)));
  }
  for (uint32_t r = 0; r < c.world_size(); ++r) {
    const int rc = procs[r]->Wait(kProcessBound);
    INFO("rank " << r << " restoring step " << step << ": " << procs[r]->Stdout() << procs[r]->Stderr() << c.Logs());
    CHECK(rc == 0);
    CHECK(Contains(procs[r]->Stdout(), fmt::format("restored step={} source={}", step, source[c.NodeOf(r)])));
    CHECK(Contains(procs[r]->Stdout(), "match"));
  }
}

json ManifestOf(Cluster& c, int n, uint64_t step) {
  return json::parse(ReadFile(c.StepDir(n, step) + "/manifest.json"), nullptr, false);
}

// The step directories of job "g" under `root`: committed ones by name, held ones by prefix.
std::vector<std::string> StepEntries(const std::string& job_dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(job_dir, ec)) {
    const std::string name = e.path().filename();
    if (name.rfind("step-", 0) == 0) out.push_back(name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

bool HasHeld(const std::string& job_dir, uint64_t step) {
  for (const std::string& name : StepEntries(job_dir)) {
    if (name.rfind(fmt::format("step-{:08d}.held-", step), 0) == 0) return true;
  }
  return false;
}

void CheckVerifies(Cluster& c, int n, uint64_t step) {
  RunResult v = c.node(n).Ctl({"--job", "g", "verify", std::to_string(step)});
  INFO("ckptctl verify " << step << " on node " << n << ": " << v.out << v.err);
  CHECK(v.exit_code == 0);
}

}  // namespace

TEST_CASE("increments across three nodes: later steps write a small fraction, every root holds what it "
          "references, restores are bit-exact from disk after a restart") {
  Cluster c(kLayout);
  WithIncrements(c);
  c.StartAll();
  REQUIRE_WITHIN(c, kJoinBound, "every node joined and alive", c.AllAlive());
  auto savers = SaveSteps(c, "10,20,30,40");
  RequireSaved(c, savers);

  // Node 0 holds the whole step 40; each other node its own ranks, scoped, in version 5 too,
  // with the whole step's own and referenced bytes.
  json whole = ManifestOf(c, 0, 40);
  REQUIRE_FALSE(whole.is_discarded());
  CHECK(whole["format_version"] == 5);
  CHECK_FALSE(whole.contains("scope"));
  const uint64_t own = U64(whole["increment"]["own_bytes"]);
  const uint64_t referenced = U64(whole["increment"]["referenced_bytes"]);
  INFO("step 40: own " << own << ", referenced " << referenced);
  CHECK(own * 10 < own + referenced);  // a small fraction of the step's 20 MB
  CHECK(referenced > 5 * kRankBytes * 8 / 10);
  uint64_t own_files = 0;
  for (const json& s : whole["shards"]) own_files += U64(s["bytes"]);
  CHECK(own == own_files);
  REQUIRE(whole["increment"]["origin_steps"].size() == 1);
  CHECK(whole["increment"]["origin_steps"][0]["step"] == 10);
  CHECK(whole["increment"]["origins"].size() == 5);  // one file of step 10 per rank
  for (int n = 1; n < c.num_nodes(); ++n) {
    INFO("node " << n);
    json mine = ManifestOf(c, n, 40);
    REQUIRE_FALSE(mine.is_discarded());
    CHECK(mine["format_version"] == 5);
    REQUIRE(mine.contains("scope"));
    CHECK(U64(mine["increment"]["own_bytes"]) == own);
    CHECK(U64(mine["increment"]["referenced_bytes"]) == referenced);
    CHECK(mine["increment"]["origins"].size() == c.ranks(n).size());  // its own ranks' origins only
    CHECK(mine["increment"]["origin_steps"] == whole["increment"]["origin_steps"]);
  }
  // The first step is full: nothing before it in these sessions.
  // Retention (--keep-last 2) on every node's root: 30 and 40 kept, 10 held (40 references
  // it), 20 gone.
  for (int n = 0; n < c.num_nodes(); ++n) {
    INFO("node " << n);
    const std::string job_dir = fs::path(c.StepDir(n, 40)).parent_path();
    REQUIRE_WITHIN(c, 10s, "node " << n << " retired step 10 and removed step 20",
                   !fs::exists(c.StepDir(n, 20)) && !fs::exists(c.StepDir(n, 10)) && HasHeld(job_dir, 10));
    CHECK(fs::exists(c.StepDir(n, 30)));
    CheckVerifies(c, n, 40);
    // Listing shows the whole step's referenced bytes on every node.
    RunResult list = c.node(n).Ctl({"--job", "g", "list"});
    INFO(list.out);
    CHECK(Contains(list.out, "increment"));
  }
  RestoreAll(c, 40, {"memory", "memory", "memory"});

  for (int n = c.num_nodes() - 1; n >= 0; --n) {
    INFO("stopping node " << n << "\n" << c.Logs());
    CHECK(c.node(n).Stop() == 0);
  }
  c.StartAll();
  REQUIRE_WITHIN(c, kJoinBound, "every node rejoined after the restart", c.AllAlive());
  RestoreAll(c, 40, {"disk", "disk", "disk"});

  // Resumed trainers: each first save references the step restored (bases set by restores),
  // and the held step goes once nothing kept references it.
  auto resumed = SaveSteps(c, "50,60", /*restore_first=*/true);
  RequireSaved(c, resumed);
  json fifty = ManifestOf(c, 0, 50);
  CHECK(U64(fifty["increment"]["referenced_bytes"]) > 5 * kRankBytes * 8 / 10);
  for (int n = 0; n < c.num_nodes(); ++n) {
    INFO("node " << n);
    CheckVerifies(c, n, 60);
  }
  RestoreAll(c, 60, {"memory", "memory", "memory"});
}

TEST_CASE("increments across three nodes: a node SIGKILLed mid-step aborts the step everywhere, the group "
          "recovers and nothing committed is lost") {
  Cluster c(kLayout);
  WithIncrements(c);
  c.StartAll();
  REQUIRE_WITHIN(c, kJoinBound, "every node joined and alive", c.AllAlive());
  std::string steps;
  for (int s = 1; s <= 30; ++s) steps += (s > 1 ? "," : "") + std::to_string(10 * s);
  auto savers = SaveSteps(c, steps);
  // Node 2 dies once step 20, an increment, has committed everywhere; the step its ranks'
  // peers are saving then cannot commit.
  REQUIRE_WITHIN(c, kProcessBound, "step 20 committed on every node",
                 fs::exists(c.StepDir(0, 20) + "/manifest.json") && fs::exists(c.StepDir(1, 20) + "/manifest.json") &&
                     fs::exists(c.StepDir(2, 20) + "/manifest.json"));
  c.node(2).Kill();
  for (uint32_t r : c.RanksOfNodes({0, 1})) {
    const int rc = savers[r]->Wait(kProcessBound);
    INFO("rank " << r << ": " << savers[r]->Stdout() << savers[r]->Stderr() << c.Logs());
    CHECK(rc == 5);  // a step failed: it could not commit without node 2
    CHECK(Contains(savers[r]->Stdout(), "failed"));
  }
  (void)savers[4]->Wait(kProcessBound);  // its daemon is gone

  c.Start(2);
  REQUIRE_WITHIN(c, kJoinBound, "node 2 rejoined and every member is alive", c.AllAlive());
  // Every node ends with the same newest committed step, and no step left in progress (a
  // node that applied a commit it held in doubt retires older steps at its next commit).
  std::vector<std::string> on0;
  std::string seen;
  REQUIRE_WITHIN(c, 10s, "every node holds the same newest committed step and none in .tmp: " << seen, [&] {
    std::vector<std::vector<std::string>> committed(3);
    seen.clear();
    for (int n = 0; n < 3; ++n) {
      for (const std::string& name : StepEntries(fs::path(c.StepDir(n, 10)).parent_path())) {
        seen += fmt::format("node {}: {}; ", n, name);
        if (name.find('.') == std::string::npos) committed[n].push_back(name);
        if (name.size() > 4 && name.compare(name.size() - 4, 4, ".tmp") == 0) return false;
      }
      if (committed[n].empty()) return false;
    }
    on0 = committed[0];
    return committed[0].back() == committed[1].back() && committed[1].back() == committed[2].back();
  }());
  const uint64_t last = std::stoull(on0.back().substr(5));
  INFO("last committed step " << last);
  CHECK(last >= 20);
  for (int n = 0; n < c.num_nodes(); ++n) CheckVerifies(c, n, last);
  RestoreAll(c, last, {"memory", "memory", "disk"});
  // Training goes on from there, referencing the step restored.
  const uint64_t next = last + 1000;
  auto resumed = SaveSteps(c, fmt::format("{},{}", next, next + 10), /*restore_first=*/true);
  RequireSaved(c, resumed);
  CHECK(U64(ManifestOf(c, 0, next)["increment"]["referenced_bytes"]) > 0);
  RestoreAll(c, next + 10, {"memory", "memory", "memory"});
}

TEST_CASE("increments on a shared root: the coordinator publishes each step (whole, or as an index) and its "
          "retention holds what kept steps reference") {
  Cluster c(kLayout);
  TempDir shared_disk;
  WithIncrements(c, shared_disk / "root");
  REQUIRE(fs::create_directories(c.shared_root));
  bool indexed = false;
  SECTION("whole manifests") {}
  SECTION("indexed: a part per node") {
    // The coordinator takes this small step for one too large for a manifest.
    indexed = true;
    ::setenv("CKPTD_TEST_MAX_WHOLE_MANIFEST_BYTES", "1000", 1);
  }
  c.Start(0);
  ::unsetenv("CKPTD_TEST_MAX_WHOLE_MANIFEST_BYTES");
  c.Start(1);
  c.Start(2);
  REQUIRE_WITHIN(c, kJoinBound, "every node joined and alive", c.AllAlive());
  auto savers = SaveSteps(c, "10,20,30,40");
  RequireSaved(c, savers);

  json top = ManifestOf(c, 0, 40);
  REQUIRE_FALSE(top.is_discarded());
  CHECK(top["format_version"] == 5);
  CHECK(top.contains("index") == indexed);
  const uint64_t own = U64(top["increment"]["own_bytes"]);
  const uint64_t referenced = U64(top["increment"]["referenced_bytes"]);
  INFO("step 40: own " << own << ", referenced " << referenced);
  CHECK(own * 10 < own + referenced);
  REQUIRE(top["increment"]["origin_steps"].size() == 1);  // an index: the union of its parts'
  CHECK(top["increment"]["origin_steps"][0]["step"] == 10);
  if (indexed) {
    for (int n = 0; n < c.num_nodes(); ++n) {
      json part = json::parse(ReadFile(c.StepDir(0, 40) + fmt::format("/manifest-node-{:05d}.json", n)), nullptr, false);
      REQUIRE_FALSE(part.is_discarded());
      CHECK(U64(part["increment"]["own_bytes"]) == own);  // the whole step's, in every part
      CHECK(part["increment"]["origins"].size() == c.ranks(n).size());
    }
  }
  // Node 0 retains on the shared root: 10 held (40 references it), 20 gone.
  const std::string job_dir = fs::path(c.StepDir(0, 40)).parent_path();
  REQUIRE_WITHIN(c, 10s, "step 10 retired and step 20 removed",
                 !fs::exists(c.StepDir(0, 20)) && !fs::exists(c.StepDir(0, 10)) && HasHeld(job_dir, 10));
  for (int n = 0; n < c.num_nodes(); ++n) CheckVerifies(c, n, 40);

  for (int n = c.num_nodes() - 1; n >= 0; --n) CHECK(c.node(n).Stop() == 0);
  c.StartAll();
  REQUIRE_WITHIN(c, kJoinBound, "every node rejoined after the restart", c.AllAlive());
  RestoreAll(c, 40, {"disk", "disk", "disk"});
  // Resumed trainers reference the step they restored.
  auto resumed = SaveSteps(c, "50,60", /*restore_first=*/true);
  RequireSaved(c, resumed);
  CHECK(U64(ManifestOf(c, 0, 60)["increment"]["referenced_bytes"]) > 0);
  RestoreAll(c, 60, {"memory", "memory", "memory"});
}
