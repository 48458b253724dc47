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
#include <catch2/catch.hpp>

#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <set>
#include <memory>
#include <random>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

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

bool TmpLeft(const std::string& job_dir) {
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(job_dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.size() > 4 && name.compare(name.size() - 4, 4, ".tmp") == 0) return true;
  }
  return false;
}

}  // namespace

TEST_CASE("ckptd killed at random while two ranks save and resume: no reported commit is lost, every step verifies") {
  const uint64_t kills = EnvOr("CKPTD_KILL_LOOP_KILLS", 100);
  const uint64_t seed = EnvOr("CKPTD_KILL_LOOP_SEED", std::random_device{}());
  INFO("seed " << seed << " (CKPTD_KILL_LOOP_SEED replays it)");
  std::mt19937_64 random(seed);
  const auto began = std::chrono::steady_clock::now();

  TempDir dir;
  Daemon d(dir, {"--staging-bytes", "64M", "--prefault-staging", "false", "--keep-last", "3"});
  d.Start();
  const std::string job_dir = d.root() + "/kl";
  constexpr int kRanks = 2;
  std::vector<std::unique_ptr<Process>> ranks;  // running trainers, when any
  uint64_t reported = 0;       // the newest step any trainer was told is committed
  uint64_t trainer_kills = 0, resumes = 0, verified = 0, generation = 0;
  auto start_trainers = [&] {
    ++generation;
    for (int r = 0; r < kRanks; ++r) {
      ranks.push_back(std::make_unique<Process>(
          Trainer(d, {"--job", "kl", "--rank", std::to_string(r), "--world-size", std::to_string(kRanks), "--steps",
                      "100000000", "--save-every", "5", "--state-bytes", "400000", "--step-sleep-ms", "5", "--resume"}),
          dir.path(), fmt::format("g{}r{}", generation, r)));
    }
    // Both ranks restore together (a barrier fixes the step), never below a reported commit.
    std::vector<uint64_t> resumed;
    for (auto& p : ranks) {
      INFO(p->Stdout() << p->Stderr() << d.Log());
      REQUIRE(WaitUntil([&] { return Contains(p->Stdout(), "resumed step=") || Contains(p->Stdout(), "starting at step 0") ||
                                     !p->Running(); },
                        60s, 2ms));
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
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  // The figure docs/security.md quotes.
  std::cout << fmt::format(
                   "kill loop: {} kills of ckptd, {} of both trainers, {} resumes, {} steps verified, newest reported "
                   "commit {}, 0 lost, seed {}, {:.0f} s\n",
                   kills, trainer_kills, resumes, verified, reported, seed, seconds)
            << std::flush;
}
