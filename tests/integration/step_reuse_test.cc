// A step number saved again by a new run of a job (issue 44): once retention or `ckptctl
// delete` removed the earlier run's step, a new run that starts from scratch may save the
// same step numbers. The coordinator's decision is bound to the run and attempt that made it:
// the new run's step commits as its own on every rank, or is refused on every rank with one
// reason, and no node ever publishes one run's shards under another run's manifest, across
// restarts of the daemons too. Real daemons on loopback, trainer processes per save.
#include <signal.h>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

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

// Each run's data: run 1 writes the pattern of Seed(step, rank), a run with `data` 2 that
// of Seed(step + 1000, rank) (other data), the same pattern again for a deterministic run.
uint64_t SeedStep(uint64_t step, int data) { return data == 1 ? step : step + 1000; }

// Every rank saves `step` with the bytes of `data`, as one trainer process each (a new
// registration: a new run), and hears it committed.
void SaveAllCommitted(Cluster& c, uint64_t step, int data) { c.SaveAllCommitted(step, SeedStep(step, data)); }

// Every node's copy of `step` verifies (each shard against the manifest, every checksum)
// and no .tmp of it is left.
void CheckIntact(Cluster& c, uint64_t step) {
  for (int n = 0; n < c.num_nodes(); ++n) {
    RunResult verify = c.node(n).Ctl({"--job", c.job, "verify", std::to_string(step)});
    INFO("node " << n << ": ckptctl verify " << step << ": " << verify.out << verify.err << c.Logs());
    CHECK(verify.exit_code == 0);
    CHECK_FALSE(Contains(verify.out, "DAMAGED"));
    CHECK_FALSE(fs::exists(c.StepDir(n, step) + ".tmp"));
  }
}

// Every rank restores the newest step and finds `step` with the bytes of `data`, from
// `source` on every node ("": any; the hot cache may hold the earlier run's higher steps
// rather than the new run's).
void RestoreAll(Cluster& c, uint64_t step, int data, const std::string& source) {
  c.RestoreAll(step, std::vector<std::string>(c.num_nodes(), source), SeedStep(step, data));
}

void RestartAll(Cluster& c) {
  for (int n = c.num_nodes() - 1; n >= 0; --n) CHECK(c.node(n).Stop() == 0);
  c.StartAll();
  REQUIRE_WITHIN(c, kJoinBound, "every node rejoined after the restart", c.AllAlive());
}

}  // namespace

// Each commits as the new run's on every rank, and stays intact across restarts.
TEST_CASE("a new run saves step numbers that retention removed") {
  Cluster c({{0}, {1}});
  c.extra_flags = {"--keep-last", "2"};
  c.StartAll();
  REQUIRE_WITHIN(c, kJoinBound, "every node joined and alive", c.AllAlive());
  for (uint64_t step = 5; step <= 30; step += 5) SaveAllCommitted(c, step, 1);
  for (int n = 0; n < c.num_nodes(); ++n) {
    INFO("node " << n);
    // Retention keeps 25 and 30 (it runs behind the commit).
    REQUIRE_WITHIN(c, 10s, "retention removed steps 5 and 10",
                   !fs::exists(c.StepDir(n, 5)) && !fs::exists(c.StepDir(n, 10)));
  }

  SECTION("other data") {
    // The coordinator's decision log still holds run 1's steps 5 and 10.
    for (uint64_t step : {5, 10}) SaveAllCommitted(c, step, 2);
    CheckIntact(c, 5);
    CheckIntact(c, 10);
    RestoreAll(c, 10, 2, "");
    RestartAll(c);
    CheckIntact(c, 5);
    CheckIntact(c, 10);
    RestoreAll(c, 10, 2, "disk");
  }
  SECTION("deterministic: the same bytes again") {
    for (uint64_t step = 5; step <= 25; step += 5) {
      SaveAllCommitted(c, step, 1);  // every rank, every step: committed
      CheckIntact(c, step);
    }
    RestartAll(c);
    CheckIntact(c, 25);
    RestoreAll(c, 25, 1, "disk");
  }
}

TEST_CASE("a step deleted with ckptctl and saved again by a new run") {
  Cluster c({{0}, {1}});
  c.StartAll();
  REQUIRE_WITHIN(c, kJoinBound, "every node joined and alive", c.AllAlive());
  SaveAllCommitted(c, 10, 1);
  SaveAllCommitted(c, 20, 1);
  for (int n = 0; n < c.num_nodes(); ++n) {
    RunResult deleted = c.node(n).Ctl({"--job", c.job, "delete", "10"});
    INFO("node " << n << ": " << deleted.out << deleted.err);
    REQUIRE(deleted.exit_code == 0);
  }
  SaveAllCommitted(c, 10, 2);
  CheckIntact(c, 10);
  RestoreAll(c, 10, 2, "");
  RestartAll(c);
  CheckIntact(c, 10);
  CheckIntact(c, 20);
  RestoreAll(c, 10, 2, "disk");
}

// Every rank fails at once with one reason, and the earlier step is untouched.
TEST_CASE("a node still holding the earlier run's step refuses the new run's") {
  Cluster c({{0}, {1}});
  c.node_flags[0] = {"--keep-last", "2"};  // node 1 keeps every step
  c.StartAll();
  REQUIRE_WITHIN(c, kJoinBound, "every node joined and alive", c.AllAlive());
  for (uint64_t step = 5; step <= 15; step += 5) SaveAllCommitted(c, step, 1);
  REQUIRE_WITHIN(c, 10s, "node 0's retention removed step 5", !fs::exists(c.StepDir(0, 5)));
  REQUIRE(fs::exists(c.StepDir(1, 5)));

  const auto started = std::chrono::steady_clock::now();
  auto procs = c.SaveRanks(c.AllRanks(), 5, /*wait_committed=*/true, SeedStep(5, 2));
  for (size_t r = 0; r < procs.size(); ++r) {
    int rc = procs[r]->Wait(kProcessBound);
    INFO("rank " << r << ": " << procs[r]->Stdout() << procs[r]->Stderr() << c.Logs());
    // trainer_helper: 5 when the ticket ends after "staged", 3 when it ends before. Either
    // is the refusal: the shard writer may meet it while the rank is still being staged.
    CHECK((rc == 3 || rc == 5));
    CHECK(Contains(procs[r]->Stdout(), "step 5 of job g is already committed"));
    CHECK(Contains(procs[r]->Stdout(), "ckptctl --job g delete 5"));
  }
  // Told at once, not at the step timeout.
  CHECK(std::chrono::steady_clock::now() - started < std::chrono::seconds(kStepTimeout));
  REQUIRE_WITHIN(c, 10s, "no .tmp of step 5 is left",
                 !fs::exists(c.StepDir(0, 5) + ".tmp") && !fs::exists(c.StepDir(1, 5) + ".tmp"));
  CHECK_FALSE(fs::exists(c.StepDir(0, 5)));
  RunResult verify = c.node(1).Ctl({"--job", "g", "verify", "5"});
  INFO(verify.out << verify.err);
  CHECK(verify.exit_code == 0);
  // The group goes on.
  SaveAllCommitted(c, 20, 2);
}

// It never publishes the new run's files under the earlier run's commit.
TEST_CASE("a node restarted with a new run's step in doubt") {
  Cluster c({{0}, {1}});
  c.extra_flags = {"--keep-last", "2"};
  c.StartAll();
  REQUIRE_WITHIN(c, kJoinBound, "every node joined and alive", c.AllAlive());
  for (uint64_t step = 10; step <= 30; step += 10) SaveAllCommitted(c, step, 1);
  // On both nodes: node 0 still holding run 1's step 10 would refuse run 2's at the end.
  REQUIRE_WITHIN(c, 10s, "retention removed step 10 on both nodes",
                 !fs::exists(c.StepDir(0, 10)) && !fs::exists(c.StepDir(1, 10)));

  // Run 2's rank 1 saves step 10: durable on node 1, with the record of what it prepares;
  // rank 0 never saves, so the step cannot commit.
  std::unique_ptr<Process> saver;
  // The coordinator heard the prepare and opened a round for the new run, or was stopped
  // and never heard it (its log then holds run 1's commit and its whole manifest).
  SECTION("heard") {
    saver = c.Save(1, 10, /*wait_committed=*/false, SeedStep(10, 2));
    REQUIRE_WITHIN(c, 60s, "the coordinator's round of run 2's step 10 waits for rank 0 only", [&] {
      std::vector<json> in_flight = InFlight(Status(c.node(0)), "g", 10);
      return in_flight.size() == 1 && MissingRanks(in_flight[0]) == std::vector<uint32_t>{0};
    }());
  }
  SECTION("unheard") {
    c.node(0).Signal(SIGSTOP);
    saver = c.Save(1, 10, /*wait_committed=*/false, SeedStep(10, 2));
    REQUIRE_WITHIN(c, 60s, "node 1 recorded what it prepares", fs::exists(c.StepDir(1, 10) + ".tmp/.prepared.json"));
  }
  REQUIRE(fs::exists(c.StepDir(1, 10) + ".tmp"));
  // Both daemons die. The restarted coordinator knows no round of step 10 and, asked about
  // it, finds run 1's decision in its log; node 1 holds run 2's files in doubt.
  c.node(1).Kill();
  c.node(0).Kill();
  (void)saver->Wait(kProcessBound);
  c.StartAll();
  REQUIRE_WITHIN(c, 60s, "node 1 resolved the step it kept in doubt", !fs::exists(c.StepDir(1, 10) + ".tmp"));
  INFO(c.Logs());
  CHECK(Contains(c.node(1).Log(), "is of other bytes than this node's record of what it prepared"));
  CHECK_FALSE(fs::exists(c.StepDir(1, 10)));  // never published under run 1's manifest
  json list = json::parse(c.node(1).Ctl({"--json", "--job", "g", "list"}).out, nullptr, false);
  REQUIRE_FALSE(list.is_discarded());
  for (const json& step : list["checkpoints"]) CHECK(U64(step["step"]) != 10);
  REQUIRE_WITHIN(c, kJoinBound, "every node alive", c.AllAlive());
  // Run 2 saves step 10 whole now: it commits as its own.
  SaveAllCommitted(c, 10, 2);
  CheckIntact(c, 10);
  RestoreAll(c, 10, 2, "");
}
