// Restores across a coordinator that restarts (issue 44, item 4): ranks on other nodes
// start restoring while node 0 is down; they retry the group within --restore-timeout and
// every rank restores the same step once node 0 is back, or, when it stays down, every
// rank fails with one message once the deadline passes. Every wait is bounded.
#include <catch2/catch.hpp>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/fakes/wait_until.h"
#include "tests/integration/cluster.h"
#include "tests/integration/common.h"
#include "tests/integration/log_text.h"

using namespace ckpt::testing;
using namespace ckpt::testing::cluster;
using namespace std::chrono_literals;

namespace {

// A rank that restores the latest step (the collective restore) and checks its bytes
// against the seed of `step`.
std::unique_ptr<Process> Restoring(Cluster& c, uint32_t rank, uint64_t step, const std::string& tag) {
  const int n = c.NodeOf(rank);
  auto args = c.RankArgs(rank, step);
  args.push_back("check");
  return std::make_unique<Process>(Helper(c.node(n), args), c.dir(n).path(), tag + std::to_string(rank));
}

// Ranks 1 and 2 (`early`) still wait, not failed while node 0 was away; node 0 comes back,
// rank 0 restores, and every rank restores step 10 (rank 0 from disk, the others from memory).
void ResumeWithCoordinatorBack(Cluster& c, std::vector<std::unique_ptr<Process>>& early) {
  for (auto& p : early) {
    INFO(p->Stdout() << p->Stderr() << c.Logs());
    REQUIRE(p->Running());  // not failed at once
  }
  c.Start(0);
  auto rank0 = Restoring(c, 0, 10, "late");
  std::vector<Process*> all = {rank0.get(), early[0].get(), early[1].get()};
  const std::vector<std::string> source = {"disk", "memory", "memory"};
  for (uint32_t r = 0; r < all.size(); ++r) {
    const int rc = all[r]->Wait(kProcessBound);
    INFO("rank " << r << ": " << all[r]->Stdout() << all[r]->Stderr() << c.Logs());
    CHECK(rc == 0);
    CHECK(Contains(all[r]->Stdout(), "restored step=10 source=" + source[r]));
    CHECK(Contains(all[r]->Stdout(), "match"));
  }
}

// The restore's error line ("error: ..."), without the rank's own prefix.
std::string ErrorLine(const std::string& out) {
  const auto at = out.find("error: ");
  if (at == std::string::npos) return "";
  const auto end = out.find('\n', at);
  return out.substr(at, end == std::string::npos ? std::string::npos : end - at);
}

const std::chrono::seconds kRestoreTimeoutS{std::stoi(kRestoreTimeout)};  // "10s" -> 10

}  // namespace

TEST_CASE("a restore started while the coordinator is down waits for it: after its restart every rank restores the same step") {
  Cluster c({{0}, {1}, {2}});
  c.StartAll();
  REQUIRE_WITHIN(c, kJoinBound, "every node joined and alive", c.AllAlive());
  c.SaveAllCommitted(10);

  // The coordinator's machine goes down; ranks 1 and 2 start again and restore meanwhile.
  c.node(0).Kill();
  auto early = std::vector<std::unique_ptr<Process>>{};
  for (uint32_t r : {1u, 2u}) early.push_back(Restoring(c, r, 10, "early"));
  // Long enough for their first calls to the coordinator to fail (at once, "failed to
  // connect to all addresses") and be retried, well inside --restore-timeout.
  std::this_thread::sleep_for(3s);
  ResumeWithCoordinatorBack(c, early);
  // The group is whole again: the next step commits everywhere.
  REQUIRE_WITHIN(c, kJoinBound, "every member alive after the coordinator restart", c.AllAlive());
  c.SaveAllCommitted(20);
}

TEST_CASE("the coordinator killed while ranks wait at the restore barrier: they arrive again at its successor and every rank restores") {
  Cluster c({{0}, {1}, {2}});
  c.StartAll();
  REQUIRE_WITHIN(c, kJoinBound, "every node joined and alive", c.AllAlive());
  c.SaveAllCommitted(10);

  // Ranks 1 and 2 wait at node 0 for rank 0, which has not started yet; node 0 dies and
  // forgets their arrivals.
  auto early = std::vector<std::unique_ptr<Process>>{};
  for (uint32_t r : {1u, 2u}) early.push_back(Restoring(c, r, 10, "early"));
  // Registered for the second time (the first was the save): each restores right after, and
  // its arrival reaches node 0 within milliseconds.
  REQUIRE_WITHIN(c, kProcessBound, "ranks 1 and 2 registered to restore",
                 Occurrences(c.node(1).Log(), "[g/r1] registered") == 2 && Occurrences(c.node(2).Log(), "[g/r2] registered") == 2);
  std::this_thread::sleep_for(1s);
  c.node(0).Kill();
  std::this_thread::sleep_for(2s);
  ResumeWithCoordinatorBack(c, early);
}

TEST_CASE("a restore while the coordinator stays down: every rank fails with one message once --restore-timeout passes") {
  Cluster c({{0}, {1}, {2}});
  c.StartAll();
  REQUIRE_WITHIN(c, kJoinBound, "every node joined and alive", c.AllAlive());
  c.SaveAllCommitted(10);

  c.node(0).Kill();
  const auto started = std::chrono::steady_clock::now();
  auto ranks = std::vector<std::unique_ptr<Process>>{};
  for (uint32_t r : {1u, 2u}) ranks.push_back(Restoring(c, r, 10, "down"));
  std::vector<std::string> errors;
  for (auto& p : ranks) {
    const int rc = p->Wait(kProcessBound);
    INFO(p->Stdout() << p->Stderr() << c.Logs());
    CHECK(rc == 2);  // trainer_helper: the restore failed
    CHECK(Contains(p->Stdout(), "buffers untouched"));
    errors.push_back(ErrorLine(p->Stdout()));
  }
  const auto took = std::chrono::steady_clock::now() - started;
  INFO("took " << std::chrono::duration_cast<std::chrono::milliseconds>(took).count() << " ms\n" << c.Logs());
  // Retried until the deadline, not failed at the first refused connection; and no rank
  // waits past it (plus what starting the trainers and one call take on a loaded machine).
  CHECK(took >= kRestoreTimeoutS - 1s);
  CHECK(took < kRestoreTimeoutS + 10s * kSanitizerSlowdown);
  // One message on every rank, naming the coordinator that could not be reached.
  CHECK(errors[0] == errors[1]);
  CHECK(Contains(errors[0], "restore barrier of job g"));
  CHECK(Contains(errors[0], "coordinator at " + c.coordinator()));
  CHECK(Contains(errors[0], "could not be reached"));
}
