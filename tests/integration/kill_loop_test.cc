// The kill loop (issue 24): ckptd SIGKILLed again and again at random moments while two
// ranks of a job save, with the trainers killed too most times and started again with
// --resume. After each kill ckptd starts again on the same root, and the loop checks what
// a crash must never break:
//   - no step a trainer was told is committed is missing (the newest step listed is at
//     least the newest one any trainer printed "committed" for);
//   - every step listed verifies (ckptctl verify: manifest, sizes, checksums);
//   - no resume goes below the last reported commit, and both ranks resume the same step;
//   - nothing is left half-written (no step-*.tmp once ckptd is up again and idle).
// CKPTD_KILL_LOOP_KILLS kills (100 by default: CI); the long mode runs 1,000 or more
// (docs/security.md has the figure and the command). CKPTD_KILL_LOOP_SEED replays a run.
//
// The loop runs with --increments off (every step whole), and again with increments on (issue
// 48, the default), a fifth as many kills: the trainers
// (trainer_helper save-loop) change a few KiB of one tensor and a few random rows of a table
// each step, so steps reference chunks of several earlier ones, rebases (--full-every) and
// held steps come and go; each resume checks the restored step bit for bit, and at the end
// every listed step verifies through its references and restores bit-exact, and no held
// step (step-N.held-*) outlives the last kept step that references it once retention ran.
#include <catch2/catch.hpp>

#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <iterator>
#include <set>
#include <memory>
#include <random>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "tests/fakes/wait_until.h"
#include "tests/integration/common.h"

using namespace ckpt::testing;
using namespace std::chrono_literals;

namespace {

uint64_t EnvOr(const char* name, uint64_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::stoull(v) : fallback;
}

// The newest step `out` reports committed ("committed step=N"), 0 when none.
uint64_t NewestReported(const std::string& out) {
  static const std::regex committed(R"(committed step=(\d+))");
  uint64_t newest = 0;
  for (auto it = std::sregex_iterator(out.begin(), out.end(), committed); it != std::sregex_iterator(); ++it) {
    newest = std::max<uint64_t>(newest, std::stoull((*it)[1]));
  }
  return newest;
}

bool EndsWith(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// A step-N.tmp or a step-N.deleting left in `job_dir`.
bool TmpLeft(const std::string& job_dir) {
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(job_dir, ec)) {
    const std::string name = e.path().filename().string();
    if (EndsWith(name, ".tmp") || EndsWith(name, ".deleting")) return true;
  }
  return false;
}

using StepRun = std::pair<uint64_t, uint64_t>;  // (step, run)

// The held (retired) steps in `job_dir`: step-NNNNNNNN.held-<run, 16 hex digits>.
std::set<StepRun> HeldSteps(const std::string& job_dir) {
  std::set<StepRun> held;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(job_dir, ec)) {
    unsigned long long step = 0, run = 0;
    char tail = 0;
    if (std::sscanf(e.path().filename().c_str(), "step-%8llu.held-%16llx%c", &step, &run, &tail) == 2) {
      held.insert({step, run});
    }
  }
  return held;
}

nlohmann::json ManifestOf(const std::string& job_dir, uint64_t step) {
  std::ifstream in(fmt::format("{}/step-{:08d}/manifest.json", job_dir, step));
  return nlohmann::json::parse(in, nullptr, false);
}

// The (step, run) of every step that the manifests of `steps` reference.
std::set<StepRun> Referenced(const std::string& job_dir, const std::set<uint64_t>& steps) {
  std::set<StepRun> referenced;
  for (uint64_t step : steps) {
    const nlohmann::json m = ManifestOf(job_dir, step);
    if (m.is_discarded() || !m.contains("increment")) continue;
    for (const auto& o : m["increment"]["origin_steps"]) {
      referenced.insert({o["step"].get<uint64_t>(), o["run"].get<uint64_t>()});
    }
  }
  return referenced;
}

std::string Describe(const std::set<StepRun>& steps) {
  std::string out;
  for (const auto& [step, run] : steps) out += fmt::format(" {} (run {:016x})", step, run);
  return out.empty() ? " none" : out;
}

// How one kill loop runs: ckptd's flags, the trainer of rank r of a generation, and what it
// checks once the loop is over (ckptd started again and idle, the trainers gone).
struct Loop {
  std::string name;
  uint64_t kills = 0;
  std::vector<std::string> daemon_flags;
  std::function<std::vector<std::string>(const Daemon&, int rank)> trainer;
  std::function<void(Daemon&, const TempDir&, uint64_t reported)> after;
};

constexpr int kRanks = 2;

// The loop the file's comment describes; returns the newest step reported committed.
uint64_t RunKillLoop(const Loop& loop) {
  const uint64_t kills = loop.kills;
  const uint64_t seed = EnvOr("CKPTD_KILL_LOOP_SEED", std::random_device{}());
  INFO(loop.name << ": seed " << seed << " (CKPTD_KILL_LOOP_SEED replays it)");
  std::mt19937_64 random(seed);
  const auto began = std::chrono::steady_clock::now();

  TempDir dir;
  Daemon d(dir, loop.daemon_flags);
  d.Start();
  const std::string job_dir = d.root() + "/kl";
  std::vector<std::unique_ptr<Process>> ranks;  // running trainers, when any
  uint64_t reported = 0;       // the newest step any trainer was told is committed
  uint64_t trainer_kills = 0, resumes = 0, verified = 0, generation = 0;
  auto start_trainers = [&] {
    ++generation;
    for (int r = 0; r < kRanks; ++r) {
      ranks.push_back(std::make_unique<Process>(loop.trainer(d, r), dir.path(), fmt::format("g{}r{}", generation, r)));
    }
    // Both ranks restore together (a barrier fixes the step), never below a reported commit.
    std::vector<uint64_t> resumed;
    for (auto& p : ranks) {
      auto started = [&] {
        return Contains(p->Stdout(), "resumed step=") || Contains(p->Stdout(), "starting at step 0");
      };
      REQUIRE(WaitUntil([&] { return started() || !p->Running(); }, 60s, 2ms));
      INFO(p->Stdout() << p->Stderr() << d.Log());
      REQUIRE(started());  // not a trainer that gave up, nor a restore that did not match
      const std::string step = Field(p->Stdout(), "resumed step");
      resumed.push_back(step.empty() ? 0 : std::stoull(step));
    }
    INFO("reported " << reported);
    REQUIRE(resumed[0] == resumed[1]);
    REQUIRE(resumed[0] >= reported);
    ++resumes;
  };

  for (uint64_t kill = 1; kill <= kills; ++kill) {
    if (ranks.empty()) start_trainers();
    if (kill == 1) {
      // A commit before the first kill, however slow the build (under TSan a few kills at
      // random moments could all come before any): the loop must kill ckptd with steps on disk.
      REQUIRE(WaitUntil(
          [&] {
            for (auto& p : ranks) reported = std::max(reported, NewestReported(p->Stdout()));
            return reported > 0;
          },
          120s, 5ms));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(std::uniform_int_distribution<int>(10, 250)(random)));
    d.Kill();
    // What the trainers were told before ckptd died (a running trainer prints nothing new
    // about this ckptd's steps: their tickets died with it).
    for (auto& p : ranks) reported = std::max(reported, NewestReported(p->Stdout()));
    if (std::uniform_int_distribution<int>(0, 3)(random) != 0) {
      for (auto& p : ranks) p->Signal(SIGKILL);
      for (auto& p : ranks) p->Wait(10s);
      ranks.clear();
      ++trainer_kills;
    }
    d.Start();
    INFO("kill " << kill << ", reported " << reported << "\n" << d.Log());
    const std::set<uint64_t> listed = ListedSteps(d, "kl");
    REQUIRE((reported == 0 || (!listed.empty() && *listed.rbegin() >= reported)));
    for (uint64_t step : listed) {
      RunResult v = d.Ctl({"--job", "kl", "verify", std::to_string(step)});
      // Trainers left running save again once they have registered with the new ckptd, and
      // retention (--keep-last 3) may remove a listed step meanwhile: that one is not checked.
      if (v.exit_code != 0 && !ListedSteps(d, "kl").count(step)) continue;
      INFO("verify " << step << ": " << v.out << v.err);
      REQUIRE(v.exit_code == 0);
      ++verified;
    }
  }
  for (auto& p : ranks) reported = std::max(reported, NewestReported(p->Stdout()));
  for (auto& p : ranks) p->Signal(SIGKILL);
  for (auto& p : ranks) p->Wait(10s);
  ranks.clear();
  // Idle again: a start resolves what the last kill left unfinished.
  REQUIRE(d.Stop() == 0);
  d.Start();
  CHECK_FALSE(TmpLeft(job_dir));
  const std::set<uint64_t> listed = ListedSteps(d, "kl");
  CHECK((reported == 0 || (!listed.empty() && *listed.rbegin() >= reported)));
  CHECK(reported > 0);  // the loop did checkpoint
  if (loop.after) loop.after(d, dir, reported);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  // The figure docs/security.md quotes.
  std::cout << fmt::format(
                   "{}: {} kills of ckptd, {} of both trainers, {} resumes, {} steps verified, newest reported "
                   "commit {}, 0 lost, seed {}, {:.0f} s\n",
                   loop.name, kills, trainer_kills, resumes, verified, reported, seed, seconds)
            << std::flush;
  return reported;
}

}  // namespace

TEST_CASE("ckptd killed at random while two ranks save and resume: no reported commit is lost, every step verifies") {
  Loop loop;
  loop.name = "kill loop";
  loop.kills = EnvOr("CKPTD_KILL_LOOP_KILLS", 100);
  // Every step's files whole (format version 4): the increments loop below covers the default.
  loop.daemon_flags = {"--staging-bytes", "64M", "--prefault-staging", "false", "--keep-last", "3",
                       "--increments", "off"};
  loop.trainer = [](const Daemon& d, int r) {
    return Trainer(d, {"--job", "kl", "--rank", std::to_string(r), "--world-size", std::to_string(kRanks), "--steps",
                       "100000000", "--save-every", "5", "--state-bytes", "400000", "--step-sleep-ms", "5", "--resume"});
  };
  RunKillLoop(loop);
}

namespace {

// trainer_helper's arguments for the increments loop: 1 MiB of tensors of which model.a's
// first 4 KiB change each save, and a table of 256 rows of 4 KiB (64 KiB chunks of 16 rows)
// of which one random row changes each training step.
std::vector<std::string> IncrementData(int rank) {
  return {"--job", "kl", "--rank", std::to_string(rank), "--world-size", std::to_string(kRanks), "--seed", "7",
          "--bytes", "1048576", "--table-rows", "256", "--row-bytes", "4096", "--sparse-rows", "0.4"};
}

// Both ranks restore `step` and check it bit for bit.
void RestoresExactly(const Daemon& d, const TempDir& dir, uint64_t step) {
  std::vector<std::unique_ptr<Process>> ranks;
  for (int r = 0; r < kRanks; ++r) {
    std::vector<std::string> args = IncrementData(r);
    for (const char* a : {"check", "--changed-bytes", "4096", "--step"}) args.push_back(a);
    args.push_back(std::to_string(step));
    ranks.push_back(std::make_unique<Process>(Helper(d, args), dir.path(), fmt::format("check{}r{}", step, r)));
  }
  for (auto& p : ranks) {
    const int rc = p->Wait();
    INFO("restore of step " << step << ": " << p->Stdout() << p->Stderr() << d.Log());
    CHECK(rc == 0);
    CHECK(Contains(p->Stdout(), fmt::format("restored step={} ", step)));
    CHECK(Contains(p->Stdout(), "match"));
  }
}

}  // namespace

TEST_CASE("the kill loop with --increments on: every step verifies through its references and restores bit-exact, "
          "and no held step outlives its referrers") {
  Loop loop;
  loop.name = "kill loop, increments on";
  // A fifth of the plain loop's kills (20 in CI); fewer under TSan, where each costs more.
  loop.kills = std::max<uint64_t>(4, EnvOr("CKPTD_KILL_LOOP_KILLS", 100) / 5 / kSanitizerSlowdown);
  loop.daemon_flags = {"--staging-bytes", "64M", "--prefault-staging", "false", "--keep-last", "3",
                       "--increments", "on", "--increment-chunk-bytes", "64K", "--full-every", "4"};
  loop.trainer = [](const Daemon& d, int r) {
    std::vector<std::string> args = IncrementData(r);
    for (const char* a : {"save-loop", "--steps", "100000000", "--save-every", "5", "--changed-bytes", "4096",
                          "--step-sleep-ms", "5", "--restore-first"}) {
      args.push_back(a);
    }
    return Helper(d, args);
  };
  loop.after = [trainer = loop.trainer](Daemon& d, const TempDir& dir, uint64_t reported) {
    const std::string job_dir = d.root() + "/kl";
    // Retention runs after a commit: the trainers resume once more and save until a step
    // past every reported one is committed, then go; ckptd is idle once retention is done.
    {
      std::vector<std::unique_ptr<Process>> ranks;
      for (int r = 0; r < kRanks; ++r) ranks.push_back(std::make_unique<Process>(trainer(d, r), dir.path(), fmt::format("last{}", r)));
      for (auto& p : ranks) {
        INFO(p->Stdout() << p->Stderr() << d.Log());
        CHECK(WaitUntil([&] { return NewestReported(p->Stdout()) > reported || !p->Running(); }, 60s, 5ms));
        CHECK(NewestReported(p->Stdout()) > reported);
      }
      for (auto& p : ranks) p->Signal(SIGKILL);
      for (auto& p : ranks) p->Wait(10s);
    }
    // A step one rank saved and the other, killed, never did waits --step-timeout (5 min)
    // for it: a restart resolves it, as at the end of the loop.
    REQUIRE(d.Stop() == 0);
    d.Start();
    // Every held step is referenced by a kept one (the held files are all still needed), once
    // retention has swept what the last commits released.
    std::set<uint64_t> listed;
    std::set<StepRun> held, referenced, orphans;
    const bool swept = WaitUntil(
        [&] {
          listed = ListedSteps(d, "kl");
          held = HeldSteps(job_dir);
          referenced = Referenced(job_dir, listed);
          orphans.clear();
          std::set_difference(held.begin(), held.end(), referenced.begin(), referenced.end(),
                              std::inserter(orphans, orphans.end()));
          return orphans.empty() && !TmpLeft(job_dir);
        },
        30s, 20ms);
    INFO("held:" << Describe(held) << "\nreferenced by the kept steps:" << Describe(referenced) << "\n" << d.Log());
    CHECK(swept);
    CHECK(orphans.empty());
    // Each kept step verifies through its references and restores bit-exact, and the chain
    // did reference earlier steps (or the loop tested nothing of increments).
    uint64_t increments = 0;
    for (uint64_t step : listed) {
      RunResult v = d.Ctl({"--job", "kl", "verify", std::to_string(step)});
      INFO("verify " << step << ": " << v.out << v.err);
      CHECK(v.exit_code == 0);
      const nlohmann::json m = ManifestOf(job_dir, step);
      REQUIRE_FALSE(m.is_discarded());
      CHECK(m["format_version"] == 5);
      if (m["increment"]["referenced_bytes"].get<uint64_t>() > 0) ++increments;
      RestoresExactly(d, dir, step);
    }
    CHECK(increments > 0);
  };
  RunKillLoop(loop);
}
