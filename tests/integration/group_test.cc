// The daemons' group (issue 8): several real ckptd on loopback, each with its own root and
// its own trainer processes, one job spanning all of them. Global commit, the restore
// barrier, a daemon or the coordinator killed, a rank that never saves, a partition through
// a TCP proxy the test controls, and hostile peers. Every wait is bounded.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "tests/fakes/wait_until.h"
#include "tests/integration/common.h"
#include "tests/integration/cluster.h"
#include "tests/integration/tcp_proxy.h"

using namespace ckpt::testing;
using namespace ckpt::testing::cluster;
using namespace std::chrono_literals;
using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {
// The ranks a failed ticket must name, as "missing ranks a, b".
std::string MissingText(const std::vector<uint32_t>& ranks) {
  std::string s = "missing ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

// Waits for savers that must fail because the step was aborted, naming `missing`.
void RequireAborted(Cluster& c, std::vector<std::unique_ptr<Process>>& procs, const std::vector<uint32_t>& missing,
                    std::chrono::milliseconds bound) {
  for (auto& p : procs) {
    int rc = p->Wait(bound);
    INFO("saver stdout: " << p->Stdout() << "stderr: " << p->Stderr() << c.Logs());
    CHECK(rc == 5);  // trainer_helper: the ticket ended, not committed
    CHECK(Contains(p->Stdout(), "aborted"));
    CHECK(Contains(p->Stdout(), MissingText(missing)));
  }
}

// Whether one line of `log` contains every one of `parts`.
bool HasLine(const std::string& log, std::initializer_list<std::string> parts) {
  std::istringstream in(log);
  for (std::string line; std::getline(in, line);) {
    if (std::all_of(parts.begin(), parts.end(), [&](const std::string& p) { return Contains(line, p); })) return true;
  }
  return false;
}

std::set<std::string> Entries(const std::string& dir) {
  std::set<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) out.insert(e.path().filename().string());
  return out;
}

// After a coordinator that stopped between recording a decision and assembling the whole
// manifest: every node, node 0 too, holds a manifest of its own ranks, all scoped to the
// same step (the same record digest, bytes and node count), together every rank once.
void CheckEveryNodeScoped(Cluster& c, uint64_t step) {
  std::set<uint32_t> ranks;
  std::set<std::string> scopes;
  uint64_t listed_bytes = 0;
  for (int n = 0; n < c.num_nodes(); ++n) {
    INFO("node " << n);
    json mine = json::parse(ReadFile(c.StepDir(n, step) + "/manifest.json"), nullptr, false);
    REQUIRE_FALSE(mine.is_discarded());
    REQUIRE(mine.contains("scope"));
    CHECK(mine["scope"]["node"] == n);
    json scope = mine["scope"];
    scope.erase("node");
    scopes.insert(scope.dump());
    for (const json& s : mine["shards"]) {
      CHECK(ranks.insert(s["rank"].get<uint32_t>()).second);
      listed_bytes += U64(s["bytes"]);
    }
  }
  CHECK(scopes.size() == 1);
  CHECK(ranks.size() == c.world_size());
  json any = json::parse(ReadFile(c.StepDir(0, step) + "/manifest.json"), nullptr, false);
  CHECK(U64(any["scope"]["step_bytes"]) == listed_bytes);
}

// Node 0 holds the whole step's manifest; every other node the entries of its own ranks,
// with the whole step's node count, bytes and tensors in its scope, the same on every node.
void CheckScopedManifests(Cluster& c, uint64_t step) {
  json whole = json::parse(ReadFile(c.StepDir(0, step) + "/manifest.json"), nullptr, false);
  REQUIRE_FALSE(whole.is_discarded());
  CHECK_FALSE(whole.contains("scope"));
  CHECK(whole["shards"].size() == c.world_size());
  uint64_t bytes = 0;
  for (const json& s : whole["shards"]) bytes += U64(s["bytes"]);
  std::string digest;
  for (int n = 1; n < c.num_nodes(); ++n) {
    INFO("node " << n);
    json mine = json::parse(ReadFile(c.StepDir(n, step) + "/manifest.json"), nullptr, false);
    REQUIRE_FALSE(mine.is_discarded());
    REQUIRE(mine.contains("scope"));
    CHECK(mine["format_version"] == 3);
    CHECK(mine["scope"]["node"] == n);
    CHECK(mine["scope"]["nodes"] == c.num_nodes());
    CHECK(U64(mine["scope"]["step_bytes"]) == bytes);
    CHECK(mine["run"] == whole["run"]);
    std::vector<uint32_t> ranks;
    for (const json& s : mine["shards"]) {
      ranks.push_back(s["rank"].get<uint32_t>());
      CHECK(s == whole["shards"][s["rank"].get<size_t>()]);
    }
    CHECK(ranks == c.ranks(n));
    if (digest.empty()) digest = mine["scope"]["digest"].get<std::string>();
    CHECK(mine["scope"]["digest"] == digest);
  }
}

}  // namespace

TEST_CASE("three daemons commit one step globally and restore it bit-exactly, hot then from disk") {
  Cluster c({{0, 1}, {2, 3}, {4}});
  // The full layout (manifests of versions 3 and 4, rank-NNNNN.safetensors) is what this case
  // checks; group_increment_test checks version 5's.
  c.extra_flags = {"--increments", "off"};
  c.StartAll();
  REQUIRE_WITHIN(c, kJoinBound, "every node joined and alive", c.AllAlive());
  {
    json s = Status(c.node(1));
    CHECK(s["group"].value("num_nodes", 0u) == 3);
    CHECK(s["group"].value("node_rank", 9u) == 1);
    CHECK(s["group"]["members"].size() == 3);
  }
  c.SaveAllCommitted(10);

  // Each node holds only its own ranks' shards. Node 0 holds the manifest of the whole
  // step; the others a manifest of their own ranks, scoped to it.
  for (int n = 0; n < c.num_nodes(); ++n) {
    INFO("node " << n);
    std::set<std::string> want = {"manifest.json"};
    for (uint32_t r : c.ranks(n)) want.insert(ShardName(r));
    CHECK(Entries(c.StepDir(n, 10)) == want);
    json m = json::parse(ReadFile(c.StepDir(n, 10) + "/manifest.json"), nullptr, false);
    REQUIRE_FALSE(m.is_discarded());
    CHECK(m.value("world_size", 0u) == 5);
    CHECK(U64(m["step"]) == 10);
  }
  json whole = json::parse(ReadFile(c.StepDir(0, 10) + "/manifest.json"), nullptr, false);
  std::map<uint32_t, std::vector<uint32_t>> nodes;
  for (const json& e : whole["nodes"]) nodes[e["node"].get<uint32_t>()] = e["ranks"].get<std::vector<uint32_t>>();
  CHECK(nodes == std::map<uint32_t, std::vector<uint32_t>>{{0, {0, 1}}, {1, {2, 3}}, {2, {4}}});
  CheckScopedManifests(c, 10);
  // ckptctl list says the same of the step on every node: the whole step's size.
  std::string listed;
  for (int n = 0; n < c.num_nodes(); ++n) {
    json l = json::parse(c.node(n).Ctl({"--json", "list"}).out, nullptr, false);
    REQUIRE_FALSE(l.is_discarded());
    REQUIRE(l["checkpoints"].size() == 1);
    const std::string line = l["checkpoints"][0]["bytes"].dump() + "/" + l["checkpoints"][0]["tensors"].dump();
    if (n == 0) listed = line;
    CHECK(line == listed);
  }
  // The group's newest committed step, as node 2 last heard it from the coordinator.
  REQUIRE_WITHIN(c, 5s, "node 2 reports latest_global_step 10", [&] {
    json s = Status(c.node(2));
    if (!s.contains("jobs")) return false;
    for (const json& j : s["jobs"]) {
      if (j.value("job", "") == "g" && j.value("has_global", false) && j.contains("latest_global_step") &&
          U64(j["latest_global_step"]) == 10) {
        return true;
      }
    }
    return false;
  }());

  c.RestoreAll(10, {"memory", "memory", "memory"});
  // What Prometheus sees of the group on every node: three members alive, this node joined,
  // the step's round and the restores from memory (test_metrics.py parses a whole scrape).
  for (int n = 0; n < c.num_nodes(); ++n) {
    INFO("node " << n);
    const std::string scrape = c.Metrics(n);
    CHECK(scrape.rfind("HTTP/1.0 200 OK\r\n", 0) == 0);
    CHECK(Contains(scrape, "\nckptd_group_members{state=\"alive\"} 3\n"));
    CHECK(Contains(scrape, "\nckptd_group_members{state=\"lost\"} 0\n"));
    CHECK(Contains(scrape, "\nckptd_group_joined 1\n"));
    CHECK(Contains(scrape, "\nckptd_commit_seconds_count{scope=\"group\"} 1\n"));
    CHECK(Contains(scrape, "\nckptd_job_last_committed_step{ckpt_job=\"g\"} 10\n"));
    CHECK(Contains(scrape, "\nckptd_restore_seconds_count{tier=\"memory\"} " + std::to_string(c.ranks(n).size()) + "\n"));
  }

  for (int n = c.num_nodes() - 1; n >= 0; --n) {
    INFO("stopping node " << n << "\n" << c.Logs());
    CHECK(c.node(n).Stop() == 0);
  }
  c.StartAll();
  REQUIRE_WITHIN(c, kJoinBound, "every node rejoined after the restart", c.AllAlive());
  c.RestoreAll(10, {"disk", "disk", "disk"});
}

TEST_CASE("pieces larger than a checksum chunk: node 0's whole manifest keeps their chunk checksums and reads back") {
  // A rank's largest tensor is half its bytes: 10 MB, more than one 8 MiB checksum chunk.
  // The whole manifest merged from the nodes' parts once lost the chunk size, and with it
  // every step of such tensors failed on node 0 ("committed globally, but not published").
  Cluster c({{0}, {1}});
  c.bytes = 20'000'000;
  c.StartAll();
  REQUIRE_WITHIN(c, kJoinBound, "every node joined and alive", c.AllAlive());
  c.SaveAllCommitted(10);
  json whole = json::parse(ReadFile(c.StepDir(0, 10) + "/manifest.json"), nullptr, false);
  REQUIRE_FALSE(whole.is_discarded());
  CHECK(whole.value("checksum_chunk_bytes", 0u) == 8u << 20);
  CHECK(Contains(whole.dump(), "chunk_checksums"));
  RunResult verify = c.node(0).Ctl({"--job", "g", "verify", "10"});
  INFO(verify.out << verify.err);
  CHECK(verify.exit_code == 0);
}

TEST_CASE("two daemons on one --shared-root register the same new jobs at once: every first save commits") {
  // Both nodes write a new job's owner record at the same moment (they raced on one fixed
  // temporary name once: 1 first save in 4 failed).
  Cluster c({{0}, {1}});
  TempDir shared_disk;
  c.shared_root = shared_disk / "root";
  REQUIRE(fs::create_directories(c.shared_root));
  c.StartAll();
  REQUIRE_WITHIN(c, 20s, "every member alive", c.AllAlive());
  for (int i = 0; i < 6; ++i) {
    c.job = "fresh" + std::to_string(i);
    c.SaveAllCommitted(1);
    CHECK(fs::exists(c.shared_root + "/" + c.job + "/.owner"));
  }
  for (const fs::directory_entry& e : fs::recursive_directory_iterator(c.shared_root)) {
    INFO(e.path());
    CHECK(e.path().filename().string().find(".tmp") == std::string::npos);
  }
}

TEST_CASE("a shared root: a step too large for one manifest is published as an index and a part per node, and reads back whole") {
  // The coordinator is told that a whole manifest may be 1,000 bytes at most (the reader's
  // limit is 64 MiB: about 290,000 tensor pieces), so that this small step takes the path
  // of a large one.
  Cluster c({{0, 1}, {2, 3}, {4}});
  // The full layout (manifests of versions 3 and 4, rank-NNNNN.safetensors) is what this case
  // checks; group_increment_test checks version 5's.
  c.extra_flags = {"--increments", "off"};
  TempDir shared_disk;
  c.shared_root = shared_disk / "root";
  REQUIRE(fs::create_directories(c.shared_root));
  ::setenv("CKPTD_TEST_MAX_WHOLE_MANIFEST_BYTES", "1000", 1);
  c.Start(0);
  ::unsetenv("CKPTD_TEST_MAX_WHOLE_MANIFEST_BYTES");
  c.Start(1);
  c.Start(2);
  REQUIRE_WITHIN(c, kJoinBound, "every node joined and alive", c.AllAlive());
  c.SaveAllCommitted(10);

  const std::string step = c.StepDir(0, 10);
  std::set<std::string> want = {"manifest.json", "manifest-node-00000.json", "manifest-node-00001.json",
                                "manifest-node-00002.json"};
  for (uint32_t r = 0; r < c.world_size(); ++r) want.insert(ShardName(r));
  CHECK(Entries(step) == want);
  json index = json::parse(ReadFile(step + "/manifest.json"), nullptr, false);
  REQUIRE_FALSE(index.is_discarded());
  CHECK(index["format_version"] == 4);
  CHECK(index["tensors"].empty());
  REQUIRE(index["index"]["parts"].size() == 3);
  for (int n = 0; n < c.num_nodes(); ++n) {
    INFO("node " << n << "'s part");
    json part = json::parse(ReadFile(step + "/manifest-node-0000" + std::to_string(n) + ".json"), nullptr, false);
    REQUIRE_FALSE(part.is_discarded());
    CHECK(part["format_version"] == 3);
    CHECK(part["scope"]["node"] == n);
    CHECK(part["scope"]["digest"] == index["index"]["digest"]);
    CHECK(part["shards"].size() == c.ranks(n).size());
  }
  // Every node lists the whole step's figures from the index alone, and verifies every
  // rank's shard through the joined parts.
  for (int n = 0; n < c.num_nodes(); ++n) {
    INFO("node " << n);
    json l = json::parse(c.node(n).Ctl({"--json", "list"}).out, nullptr, false);
    REQUIRE_FALSE(l.is_discarded());
    REQUIRE(l["checkpoints"].size() == 1);
    CHECK(U64(l["checkpoints"][0]["bytes"]) == U64(index["index"]["step_bytes"]));
    CHECK(l["checkpoints"][0].value("error", "") == "");
  }
  RunResult verify = c.node(1).Ctl({"--job", "g", "verify", "10"});
  INFO("ckptctl verify 10: " << verify.out << verify.err);
  CHECK(verify.exit_code == 0);
  CHECK_FALSE(Contains(verify.out, "held by other nodes"));

  // From disk after a restart of every daemon: each rank's bytes come through the parts.
  for (int n = c.num_nodes() - 1; n >= 0; --n) CHECK(c.node(n).Stop() == 0);
  c.StartAll();
  REQUIRE_WITHIN(c, kJoinBound, "every node rejoined after the restart", c.AllAlive());
  c.RestoreAll(10, {"disk", "disk", "disk"});
  // A part edited behind ckptd's back: the step no longer reads, and the reason names it.
  const std::string part_path = step + "/manifest-node-00001.json";
  std::string part = ReadFile(part_path);
  part.replace(part.find("\"metadata\""), 10, "\"metadatb\"");
  WriteFile(part_path, part);
  RunResult broken = c.node(2).Ctl({"--job", "g", "verify", "10"});
  INFO(broken.out << broken.err);
  CHECK(broken.exit_code != 0);
  CHECK(Contains(broken.out + broken.err, "manifest-node-00001.json"));
}

TEST_CASE("64 daemons commit a step together and every rank restores it") {
#if defined(__SANITIZE_ADDRESS__)
  constexpr uint32_t kNodes = 16;  // under ASan each daemon costs several times the memory and CPU
#else
  constexpr uint32_t kNodes = 64;
#endif
  std::vector<std::vector<uint32_t>> layout;
  for (uint32_t n = 0; n < kNodes; ++n) layout.push_back({n});
  Cluster c(layout);
  // Sixty-four daemons and their trainers share two cores here: a heartbeat may wait its
  // turn for seconds, which must not count as a lost member.
  c.group_timeout = "30s";
  c.step_timeout = "120s";
  // Sixty-four trainer processes start to restore at once: under TSan on a busy machine the
  // last took over 40 s to reach the barrier. The barrier's wait is not what this case
  // tests; it stretches with the build and the machine's load.
  c.restore_timeout = std::to_string(static_cast<int>(60 * BoundScale())) + "s";
  c.metrics_everywhere = false;
  // Fan-out 4: nodes 1-4 relay for 5-20, which relay for 21-84; three levels below node 0.
  c.relay_fanout = "4";
  c.StartAll();
  REQUIRE_WITHIN(c, 120s, "every node joined and alive", c.AllAlive());
  // Bypasses while the group formed (a node's first heartbeats before its relay joined) are
  // not the step's: counted from here.
  std::vector<uint64_t> bypasses(kNodes, 0);
  for (uint32_t n = 5; n < kNodes; ++n) {
    bypasses[n] = U64(Status(c.node(static_cast<int>(n)))["group"].value("relay_bypasses", json(0)));
  }
  c.SaveAllCommitted(10);
  c.RestoreAll(10, std::vector<std::string>(kNodes, "memory"));
  // What the relays carried, against what the design guarantees whatever the machine's
  // speed: a node sends through its parent unless that relay is not yet known alive, failed
  // a call (then it is passed over for 30 s: a relay starved of CPU past the 5 s call
  // deadline, 64 daemons on two cores) or refused; each such call is a counted bypass.
  // So every node that never bypassed had its prepare relayed by its parent, and by its
  // grandparent too when the parent never bypassed either (levels 2 and 3 below node 0);
  // and each such node's restore gathers arrived at its parent. On a machine with time to
  // spare no node bypasses, and the bounds are the whole tree's: 16 + 2 * 43 prepares.
  uint64_t relayed = 0, relayed_gathers = 0, gather_merges = 0;
  for (uint32_t n = 1; n < kNodes; ++n) {
    json group = Status(c.node(static_cast<int>(n)))["group"];
    INFO("node " << n << ": " << group.dump());
    CHECK(group.value("relay_parent", 0u) == (n - 1) / 4);
    relayed += U64(group.value("relayed_prepares", json(0)));
    relayed_gathers += U64(group.value("relayed_gathers", json(0)));
    gather_merges += U64(group.value("relayed_gather_merges", json(0)));
    bypasses[n] = U64(group.value("relay_bypasses", json(0))) - bypasses[n];
    if (n <= 4) CHECK(bypasses[n] == 0);  // node 0's children have no relay to pass over
  }
  uint64_t prepares_owed = 0, gathers_owed = 0, bypassing = 0;
  for (uint32_t n = 5; n < kNodes; ++n) {
    if (bypasses[n] > 0) {
      ++bypassing;
      continue;
    }
    const uint32_t parent = (n - 1) / 4;
    prepares_owed += 1 + (parent >= 5 && bypasses[parent] == 0 ? 1 : 0);
    ++gathers_owed;
  }
  INFO(bypassing << " of " << kNodes - 5 << " nodes below the first level called node 0 themselves during the step; "
                 << "relayed prepares " << relayed << " (owed " << prepares_owed << "), relayed gathers "
                 << relayed_gathers << " in " << gather_merges << " merges (owed " << gathers_owed << ")");
  CHECK(relayed >= prepares_owed);
  CHECK(relayed_gathers >= gathers_owed);
  CHECK(gather_merges >= (gathers_owed > 0 ? 1u : 0u));
  CHECK(gather_merges <= relayed_gathers);
  // One prepare per node reached the coordinator, and every node applied the decision.
  const std::string scrape = c.Metrics(0);
  CHECK(Contains(scrape, "\nckptd_group_members{state=\"alive\"} " + std::to_string(kNodes) + "\n"));
  for (uint32_t n = 0; n < kNodes; ++n) {
    INFO("node " << n);
    CHECK(fs::exists(ShardPath(c.StepDir(static_cast<int>(n), 10), n)));
  }
}

TEST_CASE("a relay that stops answering (SIGSTOP): the nodes below it call node 0 and their steps commit") {
  Cluster c({{0}, {1}, {2}, {3}, {4}});
  c.relay_fanout = "2";       // node 1 relays for 3 and 4
  c.group_timeout = "60s";    // node 1 stays a member: only its relaying stops
  c.step_timeout = "60s";
  c.StartAll();
  REQUIRE_WITHIN(c, kJoinBound, "every node joined and alive", c.AllAlive());
  c.SaveAllCommitted(10);
  CHECK(U64(Status(c.node(1))["group"].value("relayed_prepares", json(0))) == 2);

  // A job on nodes 0, 3 and 4 saves while node 1 is stopped.
  c.node(1).Signal(SIGSTOP);
  std::vector<std::unique_ptr<Process>> savers;
  const std::vector<int> nodes = {0, 3, 4};
  for (uint32_t r = 0; r < nodes.size(); ++r) {
    std::vector<std::string> args = {"--job", "h", "--rank", std::to_string(r), "--world-size", "3", "--seed",
                                     std::to_string(Seed(20, r)), "--bytes", std::to_string(kBytes),
                                     "save", "--step", "20", "--wait-committed"};
    savers.push_back(std::make_unique<Process>(Helper(c.node(nodes[r]), args), c.dir(nodes[r]).path(),
                                               "h20r" + std::to_string(r)));
  }
  for (uint32_t r = 0; r < savers.size(); ++r) {
    int rc = savers[r]->Wait(kProcessBound);
    INFO("rank " << r << ": " << savers[r]->Stdout() << savers[r]->Stderr() << c.Logs());
    CHECK(rc == 0);
    CHECK(Contains(savers[r]->Stdout(), "committed"));
  }
  for (int n : {3, 4}) {
    CHECK(Contains(c.node(n).Log(), "its relay, node 1"));
    CHECK(U64(Status(c.node(n))["group"].value("relay_bypasses", json(0))) > 0);
  }
  c.node(1).Signal(SIGCONT);
  // Node 1 answers again; the whole group's next step commits.
  c.SaveAllCommitted(30);
}

TEST_CASE("ranks on three nodes saving by time save the same steps, decided on the coordinator's clock") {
  Cluster c({{0, 1}, {2}, {3}});
  c.StartAll();
  REQUIRE_WITHIN(c, kJoinBound, "every node joined and alive", c.AllAlive());
  // Each rank's steps take different times and start at different moments (trainer_helper
  // train-by-time), so clocks of their own would pick different steps.
  std::vector<std::unique_ptr<Process>> procs;
  for (uint32_t r : c.AllRanks()) {
    auto args = c.RankArgs(r, 1);
    args.insert(args.end(), {"train-by-time", "--steps", "30", "--interval-ms", "300"});
    procs.push_back(std::make_unique<Process>(Helper(c.node(c.NodeOf(r)), args),
                                              c.dir(c.NodeOf(r)).path(), "by-time" + std::to_string(r)));
  }
  std::string first;
  for (size_t r = 0; r < procs.size(); ++r) {
    int rc = procs[r]->Wait(kProcessBound);
    INFO("rank " << r << ": " << procs[r]->Stdout() << procs[r]->Stderr() << c.Logs());
    REQUIRE(rc == 0);
    std::string saved = procs[r]->Stdout().substr(0, procs[r]->Stdout().find('\n'));
    if (r == 0) first = saved;
    CHECK(saved == first);
    CHECK(Contains(procs[r]->Stdout(), "committed"));
  }
  // At least two saves in 30 steps of 25-85 ms with a 300 ms interval, and every one of
  // them committed on every node.
  std::istringstream steps(first.substr(first.find(':') + 1));
  std::vector<uint64_t> saved{std::istream_iterator<uint64_t>(steps), {}};
  CHECK(saved.size() >= 2);
  for (int n = 0; n < c.num_nodes(); ++n) {
    for (uint64_t step : saved) CHECK(fs::exists(c.StepDir(n, step) + "/manifest.json"));
  }
}

TEST_CASE("a daemon SIGKILLed mid-checkpoint: the step aborts everywhere, the group heals, training goes on") {
  Cluster c({{0, 1}, {2, 3}, {4}});
  c.StartAll();
  REQUIRE_WITHIN(c, kJoinBound, "every node joined and alive", c.AllAlive());
  c.SaveAllCommitted(10);

  // Node 2 dies before its rank saves step 20; the ranks of nodes 0 and 1 save it.
  c.node(2).Kill();
  auto started = std::chrono::steady_clock::now();
  auto savers = c.SaveRanks(c.RanksOfNodes({0, 1}), 20);
  RequireAborted(c, savers, {4}, kStepTimeout + 15s);
  double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  CHECK(took < std::chrono::duration<double>(kStepTimeout + 5s).count());

  REQUIRE_WITHIN(c, 5s, "the coordinator marks node 2 lost", MemberState(Status(c.node(0)), 2) == "lost");
  for (int n : {0, 1}) {
    INFO("node " << n << "\n" << c.Logs());
    // Nothing of step 20 stays behind on the survivors; step 10 is untouched.
    REQUIRE_WITHIN(c, 5s, "step 20 gone from node " << n,
                   !fs::exists(c.StepDir(n, 20)) && !fs::exists(c.StepDir(n, 20) + ".tmp"));
    REQUIRE_WITHIN(c, 5s, "node " << n << " holds no step in flight", TotalInFlight(Status(c.node(n))) == 0);
    // This node's part of step 10 is intact (verify checks the shards this node holds).
    RunResult verify = c.node(n).Ctl({"--job", "g", "verify", "10"});
    INFO("ckptctl verify 10 on node " << n << ": " << verify.out << verify.err);
    CHECK(verify.exit_code == 0);
    CHECK(verify.out.find("held by other nodes") != std::string::npos);
  }

  // The killed daemon restarts with the same root and flags, and rejoins.
  c.Start(2);
  REQUIRE_WITHIN(c, kJoinBound, "node 2 rejoined and every member is alive", c.AllAlive());
  CHECK_FALSE(fs::exists(c.StepDir(2, 20)));
  // Step 10 is still what every rank restores: hot where the node kept it, else disk.
  c.RestoreAll(10, {"memory", "memory", "disk"});
  // Training continues.
  c.SaveAllCommitted(30);
  c.RestoreAll(30, {"memory", "memory", "memory"});
}

TEST_CASE("a daemon stopped past --group-timeout: its job's steps abort at once, its queued step is refused, the next commits") {
  Cluster c({{0}, {1}, {2}});
  c.step_timeout = "60s";  // any step left to its timeout would far outlast every bound here
  c.StartAll();
  REQUIRE_WITHIN(c, kJoinBound, "every node joined and alive", c.AllAlive());
  c.SaveAllCommitted(10);
  std::vector<uint64_t> hot_bytes;  // step 10, kept in memory
  for (int n = 0; n < c.num_nodes(); ++n) hot_bytes.push_back(U64(Status(c.node(n))["staging_bytes_used"]));

  // Trainers of the job are registered (as a training run's are) when node 2's ckptd
  // stalls; the test says when they save step 20.
  const std::string go = c.shared() / "go-20";
  auto with_cue = [&](uint32_t rank) {
    auto args = c.RankArgs(rank, 20);
    args.insert(args.end(), {"save", "--step", "20", "--wait-committed", "--start-file", go});
    return std::make_unique<Process>(Helper(c.node(c.NodeOf(rank)), args), c.dir(c.NodeOf(rank)).path(),
                                     "cued20r" + std::to_string(rank));
  };
  std::vector<std::unique_ptr<Process>> savers;
  for (uint32_t r : {0u, 1u, 2u}) savers.push_back(with_cue(r));
  for (auto& p : savers) {
    REQUIRE_WITHIN(c, kProcessBound, "a trainer registered", Contains(p->Stdout(), "registered, waiting"));
  }
  // The run began before node 2 fell silent: it heartbeats (every 250 ms) after the
  // registrations, as a daemon under a training run long since registered does.
  std::this_thread::sleep_for(1s);
  c.node(2).Signal(SIGSTOP);
  REQUIRE_WITHIN(c, 10s, "the coordinator marks node 2 lost", MemberState(Status(c.node(0)), 2) == "lost");
  WriteFile(go, "");
  // Nodes 0 and 1 hear at once that step 20 cannot commit, naming the lost node, and give
  // their staging memory back: not after the 60 s step timeout.
  const auto started = std::chrono::steady_clock::now();
  for (int i : {0, 1}) {
    int rc = savers[i]->Wait(15s);
    INFO("rank " << i << ": " << savers[i]->Stdout() << savers[i]->Stderr() << c.Logs());
    CHECK(rc == 5);
    CHECK(Contains(savers[i]->Stdout(), "node 2 ("));
    CHECK(Contains(savers[i]->Stdout(), "lost"));
  }
  CHECK(std::chrono::steady_clock::now() - started < 15s);
  for (int n : {0, 1}) {
    REQUIRE_WITHIN(c, 5s, "node " << n << " holds no staging of step 20 and nothing in flight", [&] {
      json s = Status(c.node(n));
      return !s.empty() && U64(s["staging_bytes_used"]) == hot_bytes[n] && TotalInFlight(s) == 0;
    }());
  }

  // Node 2 resumes with rank 2's snapshot of step 20 queued: it rejoins, its prepare hears
  // the abort (no round that could only time out), and its staging memory is freed.
  c.node(2).Signal(SIGCONT);
  REQUIRE_WITHIN(c, kJoinBound, "node 2 rejoined and every member is alive", c.AllAlive());
  REQUIRE_WITHIN(c, 15s, "node 2 drops step 20 and holds nothing in flight", [&] {
    json s = Status(c.node(2));
    return !s.empty() && U64(s["staging_bytes_used"]) == hot_bytes[2] && TotalInFlight(s) == 0 &&
           TotalInFlight(Status(c.node(0))) == 0 && !fs::exists(c.StepDir(2, 20) + ".tmp");
  }());
  savers[2]->Wait(kProcessBound);
  for (int n = 0; n < c.num_nodes(); ++n) CHECK_FALSE(fs::exists(c.StepDir(n, 20)));
  // The group is whole again: the next step commits everywhere.
  c.SaveAllCommitted(30);
}

// Starts every node, the coordinator with CKPTD_FAULT=exit-after-commit-record, and saves
// `step` on every rank: the coordinator records its decision and exits before announcing it.
// Returns the savers, still running.
std::vector<std::unique_ptr<Process>> SaveUntilTheCoordinatorExits(Cluster& c, uint64_t step) {
  ::setenv("CKPTD_FAULT", "exit-after-commit-record", 1);
  c.Start(0);
  ::unsetenv("CKPTD_FAULT");
  for (int n = 1; n < c.num_nodes(); ++n) c.Start(n);
  REQUIRE_WITHIN(c, kJoinBound, "every node joined and alive", c.AllAlive());
  auto savers = c.SaveRanks(c.AllRanks(), step);
  REQUIRE_WITHIN(c, 30s, "the coordinator records the decision and exits",
                 Contains(c.node(0).Log(), "CKPTD_FAULT=exit-after-commit-record: exiting"));
  return savers;
}

TEST_CASE("the coordinator dies between recording a commit and announcing it: after restart all nodes agree") {
  Cluster c({{0}, {1, 2}, {3}});
  // The full layout (manifests of versions 3 and 4, rank-NNNNN.safetensors) is what this case
  // checks; group_increment_test checks version 5's.
  c.extra_flags = {"--increments", "off"};
  auto savers = SaveUntilTheCoordinatorExits(c, 10);
  std::string coordinator_log = c.node(0).Log();
  {
    INFO(coordinator_log);
    CHECK(c.node(0).Stop() == 99);
  }
  // The decision is durable on node 0; nobody has heard it, so nobody renamed.
  for (int n = 0; n < c.num_nodes(); ++n) {
    INFO("node " << n << "\n" << c.Logs());
    CHECK_FALSE(fs::exists(c.StepDir(n, 10)));
    CHECK(fs::exists(c.StepDir(n, 10) + ".tmp"));
  }
  // Node 0's trainer loses its daemon; it must not claim a commit.
  {
    int rc = savers[0]->Wait(kProcessBound);
    INFO(savers[0]->Stdout());
    CHECK(rc != 0);
    CHECK_FALSE(Contains(savers[0]->Stdout(), "committed"));
  }

  c.Start(0);  // without the fault
  REQUIRE_WITHIN(c, 30s, "every node publishes step 10 and leaves no .tmp", [&] {
    for (int n = 0; n < c.num_nodes(); ++n) {
      if (!fs::exists(c.StepDir(n, 10) + "/manifest.json") || fs::exists(c.StepDir(n, 10) + ".tmp")) return false;
    }
    return true;
  }());
  // The ranks of the other nodes were waiting all along: they hear "committed".
  for (size_t i = 1; i < savers.size(); ++i) {
    int rc = savers[i]->Wait(kProcessBound);
    INFO("rank " << i << ": " << savers[i]->Stdout() << c.Logs());
    CHECK(rc == 0);
    CHECK(Contains(savers[i]->Stdout(), "committed"));
  }
  // The same committed set everywhere. The whole manifest was never assembled (the
  // coordinator stopped right after the record), so node 0 too holds its own ranks' entries,
  // scoped to the step as every other node's (docs/format.md, "Across nodes").
  CheckEveryNodeScoped(c, 10);
  REQUIRE_WITHIN(c, kJoinBound, "every member alive after the coordinator restart", c.AllAlive());
  c.RestoreAll(10, {"disk", "memory", "memory"});
  c.SaveAllCommitted(20);
  CheckScopedManifests(c, 20);  // the next step is whole on node 0 again
}

TEST_CASE("a shared root: the coordinator dies after recording an indexed step's commit; after restart it publishes the step") {
  Cluster c({{0}, {1, 2}, {3}});
  // The full layout (manifests of versions 3 and 4, rank-NNNNN.safetensors) is what this case
  // checks; group_increment_test checks version 5's.
  c.extra_flags = {"--increments", "off"};
  TempDir shared_disk;
  c.shared_root = shared_disk / "root";
  REQUIRE(fs::create_directories(c.shared_root));
  ::setenv("CKPTD_TEST_MAX_WHOLE_MANIFEST_BYTES", "1000", 1);  // node 0's, and after its restart
  auto savers = SaveUntilTheCoordinatorExits(c, 10);
  CHECK(c.node(0).Stop() == 99);
  // Decided, not published: the parts are in the step's staging, the index is not.
  const std::string step = c.StepDir(0, 10);
  CHECK_FALSE(fs::exists(step));
  CHECK(fs::exists(step + ".tmp/manifest-node-00001.json"));
  CHECK(savers[0]->Wait(kProcessBound) != 0);  // its daemon died under it

  c.Start(0);  // without the fault, still publishing large steps as an index
  ::unsetenv("CKPTD_TEST_MAX_WHOLE_MANIFEST_BYTES");
  REQUIRE_WITHIN(c, 30s, "step 10 is published from the decision log and no .tmp is left",
                 fs::exists(step + "/manifest.json") && !fs::exists(step + ".tmp"));
  for (size_t i = 1; i < savers.size(); ++i) {
    int rc = savers[i]->Wait(kProcessBound);
    INFO("rank " << i << ": " << savers[i]->Stdout() << c.Logs());
    CHECK(rc == 0);
    CHECK(Contains(savers[i]->Stdout(), "committed"));
  }
  json index = json::parse(ReadFile(step + "/manifest.json"), nullptr, false);
  REQUIRE_FALSE(index.is_discarded());
  CHECK(index["format_version"] == 4);
  REQUIRE_WITHIN(c, kJoinBound, "every member alive after the coordinator restart", c.AllAlive());
  RunResult verify = c.node(2).Ctl({"--job", "g", "verify", "10"});
  INFO(verify.out << verify.err);
  CHECK(verify.exit_code == 0);
  c.RestoreAll(10, {"disk", "memory", "memory"});
}

TEST_CASE("a rank that never snapshots: the step aborts after --step-timeout, staging is freed, the next step commits") {
  Cluster c({{0, 1}, {2}});
  c.StartAll();
  REQUIRE_WITHIN(c, kJoinBound, "every node joined and alive", c.AllAlive());
  for (int n = 0; n < c.num_nodes(); ++n) CHECK(U64(Status(c.node(n))["staging_bytes_used"]) == 0);

  // Rank 1 (on node 0) never saves step 10.
  auto started = std::chrono::steady_clock::now();
  auto savers = c.SaveRanks({0, 2}, 10);
  // While the step waits: the coordinator shows it in flight, missing exactly rank 1, and
  // the staged ranks hold staging memory.
  REQUIRE_WITHIN(c, kStepTimeout, "step 10 in flight, missing rank 1, in the coordinator's view", [&] {
    for (const json& s : InFlight(Status(c.node(0)), "g", 10)) {
      if (s.value("scope", "") == "group" && MissingRanks(s) == std::vector<uint32_t>{1}) return true;
    }
    return false;
  }());
  RequireAborted(c, savers, {1}, kStepTimeout + 15s);
  double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  CHECK(took >= std::chrono::duration<double>(kStepTimeout).count() - 0.5);  // not before the timeout

  for (int n = 0; n < c.num_nodes(); ++n) {
    INFO("node " << n);
    REQUIRE_WITHIN(c, 5s, "node " << n << " gives its staging memory back and holds nothing in flight", [&] {
      json s = Status(c.node(n));
      return !s.empty() && U64(s["staging_bytes_used"]) == 0 && TotalInFlight(s) == 0;
    }());
    CHECK_FALSE(fs::exists(c.StepDir(n, 10)));
    CHECK_FALSE(fs::exists(c.StepDir(n, 10) + ".tmp"));
  }
  c.SaveAllCommitted(20);
}

TEST_CASE("a network partition through a TCP proxy: the step aborts, the node rejoins after healing") {
  // A partition that resets connections, and one that silently swallows them.
  const auto mode = GENERATE(TcpProxy::CutMode::kRefuse, TcpProxy::CutMode::kBlackhole);
  INFO("cut mode: " << (mode == TcpProxy::CutMode::kRefuse ? "refuse" : "blackhole"));
  Cluster c({{0}, {1, 2}, {3}});
  c.Start(0);
  TcpProxy proxy("127.0.0.1", c.coordinator_port());
  c.Start(1, proxy.address());  // node 1 reaches the coordinator only through the proxy
  c.Start(2);
  REQUIRE_WITHIN(c, kJoinBound, "every node joined and alive", c.AllAlive());
  CHECK(proxy.forwarded_connections() >= 1);
  c.SaveAllCommitted(10);

  // Step 20 starts on nodes 0 and 2; then node 1 is cut off.
  auto savers = c.SaveRanks(c.RanksOfNodes({0, 2}), 20);
  REQUIRE_WITHIN(c, kStepTimeout, "step 20 in flight at the coordinator, missing node 1's ranks", [&] {
    for (const json& s : InFlight(Status(c.node(0)), "g", 20)) {
      if (s.value("scope", "") == "group" && MissingRanks(s) == std::vector<uint32_t>{1, 2}) return true;
    }
    return false;
  }());
  proxy.Cut(mode);
  // Node 1's ranks save step 20 during the partition: their prepare cannot get through.
  auto cut_off = c.SaveRanks(c.RanksOfNodes({1}), 20, /*wait_committed=*/false);
  RequireAborted(c, savers, {1, 2}, kGroupTimeout + kStepTimeout + 15s);
  for (auto& p : cut_off) {
    INFO(p->Stdout() << p->Stderr());
    CHECK(p->Wait(kProcessBound) == 0);  // staged
  }
  REQUIRE_WITHIN(c, 5s, "the coordinator marks node 1 lost", MemberState(Status(c.node(0)), 1) == "lost");
  CHECK(HasLine(c.node(0).Log(), {"node 1 (", ") lost: no heartbeat"}));
  CHECK(proxy.refused_connections() >= 1);      // node 1 kept trying through the cut proxy
  CHECK_FALSE(fs::exists(c.StepDir(0, 20)));
  CHECK_FALSE(fs::exists(c.StepDir(2, 20)));

  proxy.Heal();
  REQUIRE_WITHIN(c, kJoinBound, "node 1 rejoins after the partition heals", c.AllAlive());
  // Node 1's late ranks of step 20 never complete a step: no node keeps any of step 20.
  REQUIRE_WITHIN(c, kStepTimeout + 15s, "step 20 gone everywhere, nothing in flight", [&] {
    for (int n = 0; n < c.num_nodes(); ++n) {
      if (fs::exists(c.StepDir(n, 20)) || fs::exists(c.StepDir(n, 20) + ".tmp")) return false;
      if (TotalInFlight(Status(c.node(n))) != 0) return false;
    }
    return true;
  }());
  c.SaveAllCommitted(30);
  c.RestoreAll(30, {"memory", "memory", "memory"});
}

TEST_CASE("hostile peers: a wrong token, random bytes and a silent client are refused; the group keeps working") {
  Cluster c({{0}, {1, 2}});
  c.step_timeout = "10s";  // room for the hostile calls while a step waits; nothing here times out
  c.StartAll();
  REQUIRE_WITHIN(c, kJoinBound, "every node joined and alive", c.AllAlive());
  const std::string node1_address = MemberAddress(Status(c.node(0)), 1);
  REQUIRE_FALSE(node1_address.empty());
  const std::string wrong_token = "a-different-token-that-is-long-enough";

  // A daemon with the wrong token claims to be node 1.
  TempDir hostile_dir;
  WriteFile(hostile_dir / "token", wrong_token + "\n");
  Daemon hostile(hostile_dir, {"--node-rank", "1", "--num-nodes", "2", "--coordinator", c.coordinator(),
                               "--group-token-file", hostile_dir / "token", "--group-timeout", "1s",
                               "--step-timeout", "3s", "--restore-timeout", "10s"});
  hostile.Start();
  REQUIRE_WITHIN(c, 15s, "the coordinator logs that it refused the token",
                 Contains(c.node(0).Log(), "refused a Join call") && Contains(c.node(0).Log(), "token"));
  REQUIRE_WITHIN(c, 15s, "the impostor logs that its token was refused", Contains(hostile.Log(), "token"));
  {
    json s = Status(hostile);
    INFO(s.dump(2) << "\n" << hostile.Log());
    REQUIRE(s.contains("group"));
    CHECK_FALSE(s["group"].value("joined", true));
    CHECK(Contains(s["group"].value("last_error", ""), "token"));
  }

  // While step 10 waits for rank 2, group calls without the token or with a wrong one are
  // refused: they can neither abort the step nor join.
  auto early = c.SaveRanks({0, 1}, 10);
  REQUIRE_WITHIN(c, 10s, "step 10 in flight at the coordinator, missing rank 2", [&] {
    for (const json& s : InFlight(Status(c.node(0)), "g", 10)) {
      if (s.value("scope", "") == "group" && MissingRanks(s) == std::vector<uint32_t>{2}) return true;
    }
    return false;
  }());
  auto peer = [&](std::vector<std::string> args) {
    std::vector<std::string> argv = {Runfile("tests/integration/group_peer"), "--addr", c.coordinator()};
    argv.insert(argv.end(), args.begin(), args.end());
    return Run(argv, c.shared().path(), 20s);
  };
  for (const auto& args : std::vector<std::vector<std::string>>{
           {"abort", "--job", "g", "--step", "10"},
           {"--token", wrong_token, "abort", "--job", "g", "--step", "10"},
           {"--token", "", "abort", "--job", "g", "--step", "10"},
           {"--token", wrong_token, "join", "--node-rank", "1", "--num-nodes", "2"}}) {
    RunResult r = peer(args);
    INFO(args.front() << " " << args.back() << ": " << r.out << r.err);
    CHECK(r.exit_code == 1);
    CHECK(Contains(r.out, "code=16 "));  // UNAUTHENTICATED
  }
  // The same tool with the right token, but not a member (it never joined): refused too.
  {
    RunResult r = peer({"--token", kToken, "abort", "--job", "other", "--step", "99"});
    INFO(r.out << r.err);
    CHECK(r.exit_code == 1);
    CHECK(Contains(r.out, "join first"));
  }
  REQUIRE_WITHIN(c, 5s, "the coordinator logs the refused abort",
                 Contains(c.node(0).Log(), "refused a Abort call") || Contains(c.node(0).Log(), "refused an Abort call"));
  CHECK(InFlight(Status(c.node(0)), "g", 10).size() >= 1);  // still waiting, not aborted
  auto last = c.Save(2, 10);
  early.push_back(std::move(last));
  for (size_t i = 0; i < early.size(); ++i) {
    int rc = early[i]->Wait(kProcessBound);
    INFO("saver " << i << ": " << early[i]->Stdout() << c.Logs());
    CHECK(rc == 0);
    CHECK(Contains(early[i]->Stdout(), "committed"));
  }

  // Silent clients connect and never speak; another sends garbage.
  std::vector<int> silent;
  for (int i = 0; i < 8; ++i) silent.push_back(ConnectTcp(c.coordinator_port()));
  auto silent_since = std::chrono::steady_clock::now();
  int garbage = ConnectTcp(c.coordinator_port());
  {
    std::mt19937 random(8);
    std::string bytes(16 * 1024, '\0');
    for (char& b : bytes) b = static_cast<char>(random());
    ssize_t sent = ::send(garbage, bytes.data(), bytes.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    CHECK(sent > 0);
  }
  // The real group commits a step while those connections are open.
  c.SaveAllCommitted(20);
  // The garbage is dropped.
  CHECK(PeerClosesWithin(garbage, 5s));
  ::close(garbage);
  {
    json s = Status(c.node(0));
    CHECK(MemberState(s, 1) == "alive");
    CHECK(MemberAddress(s, 1) == node1_address);  // the impostor did not take node 1's place
  }
  // The silent clients are dropped too, boundedly.
  for (int fd : silent) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(silent_since + 15s - std::chrono::steady_clock::now());
    CHECK(PeerClosesWithin(fd, std::max(left, 1ms)));
    ::close(fd);
  }
  CHECK(hostile.Stop() == 0);
  c.SaveAllCommitted(30);
  c.RestoreAll(30, {"memory", "memory"});
}
