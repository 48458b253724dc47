// Retention of referenced steps (format version 5, docs/format.md): a step that kept steps
// reference is retired, not deleted (out of the listing, its files kept where readers find
// them), and removed once nothing kept references it. Nothing is stored to count references:
// every pass computes them from the manifests, so a crash leaves nothing to repair.
#include <catch2/catch.hpp>

#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "common/status.h"
#include "daemon/persist/retention_keeper.h"
#include "format/checkpoint_store.h"
#include "format/manifest.h"
#include "format/plan_reader.h"
#include "format/read_plan.h"
#include "storage/filesystem.h"
#include "tests/fakes/increment_chain.h"
#include "tests/fakes/read_saved.h"
#include "tests/fakes/temp_dir.h"

using namespace ckpt;
using namespace ckpt::format;
using ckpt::testing::IncrementChain;
namespace fs = std::filesystem;

namespace {

constexpr uint64_t kRun = 0x1000, kNewRun = 0x2000;
const std::string kJob = "lora";
constexpr int64_t kRows = 32, kCols = 8;  // one rank, "emb" [32, 8] F32 in chunks of 4 rows

struct Job {
  testing::TempDir dir;
  IncrementChain writer{dir.path(), kJob, 1, {{"emb", {"F32", {kRows, kCols}}}}, 4 * kCols * 4};
  CheckpointStore store{MakePosixFilesystem(), dir.path()};
  std::vector<float> emb = std::vector<float>(kRows * kCols, 1.0f);
  std::map<uint64_t, std::string> saved;  // emb's bytes, by step
  std::vector<std::pair<std::string, uint64_t>> removed;  // what on_deleted heard

  // Step `step` of `run` with row `row` changed (a full step when `full`).
  void Save(uint64_t step, int row, bool full = false, uint64_t run = kRun) {
    emb[row * kCols] += 1;
    IncrementChain::Step s;
    s.full = full;
    s.pieces["emb"] = {std::string(reinterpret_cast<const char*>(emb.data()), emb.size() * 4)};
    s.train_state = {{}};
    saved[step] = s.pieces["emb"][0];
    writer.Write(step, run, s);
  }

  // Runs one retention pass (or an operator's delete) the way ckptd does, to the end. The
  // keeper reports errors on its own thread: collected, and checked here.
  // `after_each` runs on the keeper's thread after each step it removes, where a crash
  // could stop the pass.
  void Retain(uint32_t keep_last, std::function<void()> after_each = {}) {
    std::vector<std::string> errors;
    persist::RetentionKeeper keeper(
        store, {keep_last, 0},
        [&](const std::string& job, uint64_t step) {
          removed.emplace_back(job, step);
          if (after_each) after_each();
        },
        [&](const std::string& error) { errors.push_back(error); });
    keeper.Schedule(kJob);
    keeper.Stop();  // joins the keeper's thread: `errors` and `removed` are this thread's again
    CHECK(errors.empty());
  }
  absl::StatusOr<std::string> Delete(uint64_t step) {
    std::vector<std::string> errors;
    persist::RetentionKeeper keeper(store, {0, 0}, [](const std::string&, uint64_t) {},
                                    [&](const std::string& error) { errors.push_back(error); });
    absl::StatusOr<std::string> done = keeper.DeleteStep(kJob, step);
    keeper.Stop();
    CHECK(errors.empty());
    return done;
  }

  std::vector<uint64_t> Steps() { return *store.ListSteps(kJob); }
  std::vector<uint64_t> Held() {
    absl::StatusOr<std::vector<StepRun>> listed = store.ListHeld(kJob);
    REQUIRE(listed.ok());
    std::vector<uint64_t> held;
    for (const StepRun& h : *listed) held.push_back(h.step);
    return held;
  }
  std::vector<std::string> Entries() {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir.path() + "/" + kJob)) names.push_back(e.path().filename());
    std::sort(names.begin(), names.end());
    return names;
  }

  // Step `step` reads back whole through the planner, references followed.
  void ReadsBack(uint64_t step) {
    absl::StatusOr<Manifest> m = store.LoadManifest(kJob, step);
    REQUIRE(m.ok());
    auto got = testing::ReadSavedPieces(store.objects(), CheckpointStore::StepKey(kJob, step), *m);
    INFO((got.ok() ? "" : Message(got.status())));
    REQUIRE(got.ok());
    CHECK(got->at("emb") == std::vector<std::string>{saved[step]});
  }
};

}  // namespace

TEST_CASE("retention retires what kept steps reference, and removes it once nothing does") {
  Job j;
  j.Save(10, 0);  // full: nothing before it
  j.Save(20, 5);
  j.Save(30, 9);  // references 10 (most chunks) and 20 (chunk 1)
  j.Retain(1);
  CHECK(j.Steps() == std::vector<uint64_t>{30});
  CHECK(j.Held() == std::vector<uint64_t>{10, 20});
  CHECK(j.removed.size() == 2);  // the hot cache forgets them as for a deletion
  j.ReadsBack(30);
  // A full step references nothing: 30 goes, and with it what only 30 held.
  j.Save(40, 0, /*full=*/true);
  j.Retain(1);
  CHECK(j.Steps() == std::vector<uint64_t>{40});
  CHECK(j.Held().empty());
  CHECK(j.Entries() == std::vector<std::string>{"step-00000040"});
}

TEST_CASE("an operator's delete of a referenced step retires it and says so") {
  Job j;
  j.Save(10, 0);
  j.Save(20, 5);
  j.Save(30, 9);
  absl::StatusOr<std::string> note = j.Delete(10);
  REQUIRE(note.ok());
  CHECK_THAT(*note, Catch::Contains("its files stay while later steps reference them") &&
                        Catch::Contains("step-00000010.held-0000000000001000"));
  CHECK(j.Steps() == std::vector<uint64_t>{20, 30});
  j.ReadsBack(30);
  j.ReadsBack(20);
  // 20 is referenced by 30: retired too. Then 30, which nothing references: gone, and the
  // two it held with it.
  REQUIRE(j.Delete(20).ok());
  CHECK(j.Held() == std::vector<uint64_t>{10, 20});
  j.ReadsBack(30);
  absl::StatusOr<std::string> last = j.Delete(30);
  REQUIRE(last.ok());
  CHECK(last->empty());
  CHECK(j.Entries().empty());
  CHECK(absl::IsNotFound(j.Delete(30).status()));
}

TEST_CASE("a new run saves a retired step's number: both live, each read as its own") {
  Job j;
  j.Save(10, 0);
  j.Save(20, 5);
  j.Retain(1);
  REQUIRE(j.Held() == std::vector<uint64_t>{10});
  const std::string old20 = j.saved[20];
  // The job went back: a new run saves 10 again, full, beside the retired one.
  j.Save(10, 3, /*full=*/true, kNewRun);
  CHECK(j.Steps() == std::vector<uint64_t>{10, 20});
  CHECK(j.Held() == std::vector<uint64_t>{10});
  j.ReadsBack(10);
  j.saved[20] = old20;
  j.ReadsBack(20);  // still from the retired 10's files: the tags keep the names apart
  // Retention in run order keeps the new run's 10: 20 (the old run's) goes, and the held 10.
  j.Retain(1);
  CHECK(j.Steps() == std::vector<uint64_t>{10});
  CHECK(j.Held().empty());
  j.ReadsBack(10);
}

TEST_CASE("what a crash leaves, the next pass or start-up finishes: held steps are not temp files") {
  Job j;
  j.Save(10, 0);
  j.Save(20, 5);
  j.Retain(1);
  REQUIRE(j.Held() == std::vector<uint64_t>{10});
  // Start-up sweeps temp and half-deleted directories, never a held step.
  fs::create_directory(j.dir.path() + "/" + kJob + "/step-00000005.deleting.1.1");
  REQUIRE(j.store.RemoveStaleTemp().ok());
  CHECK(j.Held() == std::vector<uint64_t>{10});
  j.ReadsBack(20);
  // A crash after 20 was deleted but before the sweep: the next pass removes the held 10.
  REQUIRE(j.store.Delete(kJob, 20).ok());
  j.Save(30, 1, /*full=*/true);
  j.Retain(1);
  CHECK(j.Entries() == std::vector<std::string>{"step-00000030"});
}

// A pass removes its doomed steps one at a time, and ckptd may die between any two: the
// steps still listed then must read back, so a doomed step goes before the doomed steps it
// references (newest first), never after (the kill loop with increments found a listed step
// whose origin an interrupted pass had deleted).
TEST_CASE("a retention pass interrupted after any removal leaves every listed step readable") {
  Job j;
  j.Save(10, 0);  // full
  j.Save(20, 5);  // references 10
  j.Save(30, 9);  // references 10 and 20
  j.Save(40, 0, /*full=*/true);
  // Keep 1: 10, 20 and 30 are doomed, and nothing kept references them: all deleted.
  std::vector<std::string> broken;  // listed steps that did not read back, after each removal
  j.Retain(1, [&] {
    for (uint64_t step : j.Steps()) {
      std::string why;
      absl::StatusOr<Manifest> m = j.store.LoadManifest(kJob, step);
      if (!m.ok()) {
        why = Message(m.status());
      } else if (auto got = testing::ReadSavedPieces(j.store.objects(), CheckpointStore::StepKey(kJob, step), *m);
                 !got.ok()) {
        why = Message(got.status());
      } else if (got->at("emb") != std::vector<std::string>{j.saved[step]}) {
        why = "other bytes";
      }
      if (!why.empty()) {
        broken.push_back("step " + std::to_string(step) + " after " + std::to_string(j.removed.size()) +
                         " removals: " + why);
      }
    }
  });
  for (const std::string& b : broken) UNSCOPED_INFO(b);
  CHECK(broken.empty());
  CHECK(j.removed.size() == 3);
  CHECK(j.Entries() == std::vector<std::string>{"step-00000040"});
}

TEST_CASE("held step directory names parse only as written") {
  StepRun h;
  CHECK(ParseHeldStepDirName(HeldStepDirName(1200, 0x18f3a9c2d4e5b6a7), &h));
  CHECK(h == StepRun{1200, 0x18f3a9c2d4e5b6a7});
  for (const char* bad : {"step-00001200", "step-00001200.held-", "step-1200.held-0000000000001000",
                          "step-00001200.held-000000000000100", "step-00001200.held-000000000000100G",
                          "step-00001200.held-00000000000010000", "step-00001200.tmp"}) {
    INFO(bad);
    CHECK_FALSE(ParseHeldStepDirName(bad, &h));
  }
}

TEST_CASE("a step about to be published holds what it references: committed or held, pinned until published") {
  Job j;
  j.Save(10, 0);
  j.Save(20, 5);
  j.Save(30, 9);  // references 10 and 20
  std::vector<std::string> errors;
  persist::RetentionKeeper keeper(j.store, {1, 0}, [](const std::string&, uint64_t) {},
                                  [&](const std::string& error) { errors.push_back(error); });
  REQUIRE(keeper.DeleteStep(kJob, 20).ok());  // retired: 30 references it
  {
    // What a coordinator's step referencing 10 (committed) and 20 (held) pins.
    absl::StatusOr<std::shared_ptr<void>> held = keeper.HoldSteps(kJob, {{10, kRun}, {20, kRun}});
    REQUIRE(held.ok());
    // Nothing kept references 20 once 30 goes, but the pin keeps it from the sweep; and 10
    // from a delete.
    REQUIRE(keeper.DeleteStep(kJob, 30).ok());
    CHECK(j.Held() == std::vector<uint64_t>{20});
    CHECK(keeper.DeleteStep(kJob, 10).status().code() == absl::StatusCode::kFailedPrecondition);
    j.Save(40, 0, /*full=*/true);
  }
  // Unpinned, the next pass deletes 10 and sweeps 20.
  keeper.Schedule(kJob);
  keeper.Stop();
  CHECK(errors.empty());
  CHECK(j.Held().empty());
  CHECK(j.Steps() == std::vector<uint64_t>{40});
  // A step gone is named.
  persist::RetentionKeeper again(j.store, {1, 0}, [](const std::string&, uint64_t) {}, [](const std::string&) {});
  absl::StatusOr<std::shared_ptr<void>> gone = again.HoldSteps(kJob, {{10, kRun}});
  REQUIRE_FALSE(gone.ok());
  CHECK_THAT(Message(gone.status()), Catch::Contains("step 10 of job lora") && Catch::Contains("no longer on the store"));
}
