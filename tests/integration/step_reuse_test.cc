// A step number saved again by a new run of a job (issue 44): once retention or `ckptctl
// delete` removed the earlier run's step, a new run that starts from scratch may save the
// same step numbers. The coordinator's decision is bound to the run and attempt that made it:
// the new run's step commits as its own on every rank, or is refused on every rank with one
// reason, and no node ever publishes one run's shards under another run's manifest, across
// restarts of the daemons too. Real daemons on loopback, trainer processes per save. Each case
// runs with increments off and on (issue 48): with increments each run's trainers save its
// steps in one session, so that later steps reference earlier ones, and retention holds (as
// step-N.held-<run>) an earlier run's steps whose numbers a new run saves again.
#include <signal.h>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <filesystem>
#include <map>
#include <utility>
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
// A run that saves its steps in one session (increments) writes one pattern for all of them
// (that of step 1), model.a's first bytes holding the step.
uint64_t SeedStep(uint64_t step, int data) { return data == 1 ? step : step + 1000; }
const std::string kChanged = "4096";

// How a case's steps are saved and read back: with --increments on or not.
struct Saves {
  bool increments = false;
  // By step: the seed its bytes have, and whether model.a's first bytes hold the step.
  std::map<uint64_t, std::pair<uint64_t, bool>> how;

  void Configure(Cluster& c) const {
    if (increments) c.extra_flags.insert(c.extra_flags.end(), {"--increments", "on", "--increment-chunk-bytes", "64K"});
  }

  // Every rank saves `step` with the bytes of `data`, as one trainer process each (a new
  // registration: a new run, whose first save is full), and hears it committed.
  void One(Cluster& c, uint64_t step, int data) {
    c.SaveAllCommitted(step, SeedStep(step, data));
    how[step] = {SeedStep(step, data), false};
  }

  // Every rank saves `steps` with the bytes of `data` and hears each committed: with
  // increments in one session per rank (one run, each step after the first referencing the
  // one before), else one process per step.
  void Run(Cluster& c, const std::vector<uint64_t>& steps, int data) {
    if (!increments) {
      for (uint64_t step : steps) One(c, step, data);
      return;
    }
    std::string list;
    for (uint64_t step : steps) list += (list.empty() ? "" : ",") + std::to_string(step);
    std::vector<std::unique_ptr<Process>> procs;
    for (uint32_t r = 0; r < c.world_size(); ++r) {
      const int n = c.NodeOf(r);
      std::vector<std::string> args = c.RankArgs(r, SeedStep(1, data));
      args.insert(args.end(), {"save-steps", "--steps-list", list, "--changed-bytes", kChanged});
      procs.push_back(std::make_unique<Process>(Helper(c.node(n), args), c.dir(n).path(), "steps-r" + std::to_string(r)));
    }
    for (uint32_t r = 0; r < c.world_size(); ++r) {
      const int rc = procs[r]->Wait(kProcessBound);
      INFO("rank " << r << " saving steps " << list << ": " << procs[r]->Stdout() << procs[r]->Stderr() << c.Logs());
      REQUIRE(rc == 0);
    }
    for (uint64_t step : steps) how[step] = {SeedStep(1, data), true};
  }

  // Every rank restores the newest step and finds `step` with the bytes it was saved with,
  // from `source` on every node ("": any; the hot cache may hold the earlier run's higher
  // steps rather than the new run's).
  void RestoreAll(Cluster& c, uint64_t step, const std::string& source) {
    const auto [seed, changed] = how.at(step);
    if (!changed) {
      c.RestoreAll(step, std::vector<std::string>(c.num_nodes(), source), seed);
      return;
    }
    std::vector<std::unique_ptr<Process>> procs;
    for (uint32_t r = 0; r < c.world_size(); ++r) {
      const int n = c.NodeOf(r);
      std::vector<std::string> args = c.RankArgs(r, seed);
      args.insert(args.end(), {"check", "--changed-bytes", kChanged});
      procs.push_back(std::make_unique<Process>(Helper(c.node(n), args), c.dir(n).path(), "check" + std::to_string(r)));
    }
    for (uint32_t r = 0; r < c.world_size(); ++r) {
      const int rc = procs[r]->Wait(kProcessBound);
      INFO("rank " << r << " restoring step " << step << ": " << procs[r]->Stdout() << procs[r]->Stderr() << c.Logs());
      CHECK(rc == 0);
      CHECK(Contains(procs[r]->Stdout(), "restored step=" + std::to_string(step) + " source=" + source));
      CHECK(Contains(procs[r]->Stdout(), "match"));
    }
  }
};

// Whether node n holds `step` of an earlier run retired but still referenced
// (step-N.held-<run>), with increments.
bool Held(Cluster& c, int n, uint64_t step) {
  std::error_code ec;
  const std::string prefix = fs::path(c.StepDir(n, step)).filename().string() + ".held-";
  for (const auto& e : fs::directory_iterator(fs::path(c.StepDir(n, step)).parent_path(), ec)) {
    if (e.path().filename().string().rfind(prefix, 0) == 0) return true;
  }
  return false;
}

// Every node's copy of `step` verifies (each shard against the manifest, every checksum,
// every referenced file) and no .tmp of it is left.
void CheckIntact(Cluster& c, uint64_t step) {
  for (int n = 0; n < c.num_nodes(); ++n) {
    RunResult verify = c.node(n).Ctl({"--job", c.job, "verify", std::to_string(step)});
    INFO("node " << n << ": ckptctl verify " << step << ": " << verify.out << verify.err << c.Logs());
    CHECK(verify.exit_code == 0);
    CHECK_FALSE(Contains(verify.out, "DAMAGED"));
    CHECK_FALSE(fs::exists(c.StepDir(n, step) + ".tmp"));
  }
}

void RestartAll(Cluster& c) {
  for (int n = c.num_nodes() - 1; n >= 0; --n) CHECK(c.node(n).Stop() == 0);
  c.StartAll();
  REQUIRE_WITHIN(c, kJoinBound, "every node rejoined after the restart", c.AllAlive());
}

}  // namespace

// Each commits as the new run's on every rank, and stays intact across restarts.
TEST_CASE("a new run saves step numbers that retention removed") {
  Saves saves{GENERATE(false, true)};
  INFO("increments " << (saves.increments ? "on" : "off"));
  Cluster c({{0}, {1}});
  c.extra_flags = {"--keep-last", "2"};
  saves.Configure(c);
  c.StartAll();
  REQUIRE_WITHIN(c, kJoinBound, "every node joined and alive", c.AllAlive());
  saves.Run(c, {5, 10, 15, 20, 25, 30}, 1);
  for (int n = 0; n < c.num_nodes(); ++n) {
    INFO("node " << n);
    // Retention keeps 25 and 30 (it runs behind the commit); with increments step 5 is
    // held, as 25 and 30 reference what it wrote.
    REQUIRE_WITHIN(c, 10s, "retention removed steps 5 and 10",
                   !fs::exists(c.StepDir(n, 5)) && !fs::exists(c.StepDir(n, 10)));
    CHECK(Held(c, n, 5) == saves.increments);
  }

  SECTION("other data") {
    // The coordinator's decision log still holds run 1's steps 5 and 10 (and, with
    // increments, every node holds run 1's step 5 retired beside the new run's).
    saves.Run(c, {5, 10}, 2);
    CheckIntact(c, 5);
    CheckIntact(c, 10);
    saves.RestoreAll(c, 10, "");
    RestartAll(c);
    CheckIntact(c, 5);
    CheckIntact(c, 10);
    saves.RestoreAll(c, 10, "disk");
  }
  SECTION("deterministic: the same bytes again") {
    if (saves.increments) {
      saves.Run(c, {5, 10, 15, 20, 25}, 1);
      CheckIntact(c, 20);
    } else {
      for (uint64_t step = 5; step <= 25; step += 5) {
        saves.One(c, step, 1);  // every rank, every step: committed
        CheckIntact(c, step);
      }
    }
    CheckIntact(c, 25);
    RestartAll(c);
    CheckIntact(c, 25);
    saves.RestoreAll(c, 25, "disk");
  }
}

TEST_CASE("a step deleted with ckptctl and saved again by a new run") {
  Saves saves{GENERATE(false, true)};
  INFO("increments " << (saves.increments ? "on" : "off"));
  Cluster c({{0}, {1}});
  saves.Configure(c);
  c.StartAll();
  REQUIRE_WITHIN(c, kJoinBound, "every node joined and alive", c.AllAlive());
  saves.Run(c, {10, 20}, 1);
  for (int n = 0; n < c.num_nodes(); ++n) {
    RunResult deleted = c.node(n).Ctl({"--job", c.job, "delete", "10"});
    INFO("node " << n << ": " << deleted.out << deleted.err);
    REQUIRE(deleted.exit_code == 0);
    // With increments step 20 references step 10: deleted, it is held.
    CHECK(Contains(deleted.out, "held as") == saves.increments);
    CHECK(Held(c, n, 10) == saves.increments);
  }
  saves.Run(c, {10}, 2);
  CheckIntact(c, 10);
  saves.RestoreAll(c, 10, "");
  RestartAll(c);
  CheckIntact(c, 10);
  CheckIntact(c, 20);
  saves.RestoreAll(c, 10, "disk");
}

// Every rank fails at once with one reason, and the earlier step is untouched.
TEST_CASE("a node still holding the earlier run's step refuses the new run's") {
  Saves saves{GENERATE(false, true)};
  INFO("increments " << (saves.increments ? "on" : "off"));
  Cluster c({{0}, {1}});
  c.node_flags[0] = {"--keep-last", "2"};  // node 1 keeps every step
  saves.Configure(c);
  c.StartAll();
  REQUIRE_WITHIN(c, kJoinBound, "every node joined and alive", c.AllAlive());
  saves.Run(c, {5, 10, 15}, 1);
  REQUIRE_WITHIN(c, 10s, "node 0's retention removed step 5", !fs::exists(c.StepDir(0, 5)));
  CHECK(Held(c, 0, 5) == saves.increments);
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
  saves.One(c, 20, 2);
  if (saves.increments) CHECK(Held(c, 0, 5));  // still referenced by 10 and 15
}

// It never publishes the new run's files under the earlier run's commit.
TEST_CASE("a node restarted with a new run's step in doubt") {
  Saves saves{GENERATE(false, true)};
  INFO("increments " << (saves.increments ? "on" : "off"));
  Cluster c({{0}, {1}});
  c.extra_flags = {"--keep-last", "2"};
  // Run 2's step 10 waits for a rank that never comes while the test looks at it: under TSan
  // the look took longer than the default step timeout, which aborted it (its .tmp went).
  c.step_timeout = std::to_string(120 * kSanitizerSlowdown) + "s";
  saves.Configure(c);
  c.StartAll();
  REQUIRE_WITHIN(c, kJoinBound, "every node joined and alive", c.AllAlive());
  saves.Run(c, {10, 20, 30}, 1);
  // On both nodes: node 0 still holding run 1's step 10 would refuse run 2's at the end.
  // With increments it is held on both (20 and 30 reference it), its number free.
  REQUIRE_WITHIN(c, 10s, "retention removed step 10 on both nodes",
                 !fs::exists(c.StepDir(0, 10)) && !fs::exists(c.StepDir(1, 10)));
  CHECK(Held(c, 1, 10) == saves.increments);

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
  {
    INFO("node 1 no longer holds run 2's step 10 unfinished\n" << c.Logs());
    REQUIRE(fs::exists(c.StepDir(1, 10) + ".tmp"));
  }
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
  saves.One(c, 10, 2);
  CheckIntact(c, 10);
  saves.RestoreAll(c, 10, "");
}
