// Save, crash, restore: real ckptd, real trainer processes, real sockets and shared memory.
#include <signal.h>
#include <sys/stat.h>

#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "tests/fakes/huge_pages.h"
#include "tests/fakes/wait_until.h"
#include "tests/integration/common.h"

using namespace ckpt::testing;
using namespace std::chrono_literals;

TEST_CASE("two ranks save and restore bit for bit, from memory and from disk") {
  TempDir dir;
  Daemon d(dir);
  d.Start();
  Process r0(Helper(d, {"--job", "mr2", "--rank", "0", "--world-size", "2", "--seed", "100",
                        "--bytes", "4000000", "save", "--step", "7", "--wait-committed"}),
             dir.path(), "r0");
  Process r1(Helper(d, {"--job", "mr2", "--rank", "1", "--world-size", "2", "--seed", "101",
                        "--bytes", "4000000", "save", "--step", "7", "--wait-committed"}),
             dir.path(), "r1");
  REQUIRE(r0.Wait() == 0);
  REQUIRE(r1.Wait() == 0);
  CHECK(Contains(r0.Stdout(), "committed"));
  // Every rank of a job restores together: they meet at a barrier that fixes the step.
  auto restore_both = [&](const std::string& source) {
    std::vector<std::unique_ptr<Process>> ranks;
    for (int rank : {0, 1}) {
      ranks.push_back(std::make_unique<Process>(
          Helper(d, {"--job", "mr2", "--rank", std::to_string(rank), "--world-size", "2", "--seed",
                     std::to_string(100 + rank), "--bytes", "4000000", "check"}),
          dir.path(), "restore" + std::to_string(rank)));
    }
    for (auto& c : ranks) {
      int rc = c->Wait();
      INFO(c->Stdout() << c->Stderr());
      CHECK(rc == 0);
      CHECK(Contains(c->Stdout(), "restored step=7 source=" + source));
      CHECK(Contains(c->Stdout(), "match"));
    }
  };
  restore_both("memory");
  REQUIRE(d.Stop() == 0);
  d.Start();
  restore_both("disk");
  // Another world size restores (reshard_test.cc); tensors of another global shape do not,
  // and say so, leaving the trainer's buffers as they were.
  auto wrong = Run(Helper(d, {"--job", "mr2", "--rank", "0", "--world-size", "1", "--seed", "100",
                              "--bytes", "4000000", "check"}),
                   dir.path());
  CHECK(wrong.exit_code == 2);
  CHECK(Contains(wrong.out, "model.a: global shape [1000000] saved, [500000] wanted"));
  CHECK(Contains(wrong.out, "buffers untouched"));
}

TEST_CASE("a training run SIGKILLed part-way resumes to the same final checksum") {
  TempDir dir;
  Daemon d(dir);
  d.Start();
  std::vector<std::string> common = {"--world-size", "2", "--steps", "60", "--save-every", "10",
                                     "--state-bytes", "2000000"};
  auto args = [&](const std::string& job, int rank, std::vector<std::string> extra) {
    std::vector<std::string> a = {"--job", job, "--rank", std::to_string(rank)};
    a.insert(a.end(), common.begin(), common.end());
    a.insert(a.end(), extra.begin(), extra.end());
    return Trainer(d, a);
  };
  // Reference: uninterrupted.
  Process ref0(args("ref", 0, {}), dir.path(), "ref0"), ref1(args("ref", 1, {}), dir.path(), "ref1");
  REQUIRE(ref0.Wait() == 0);
  REQUIRE(ref1.Wait() == 0);
  std::string want0 = Field(ref0.Stdout(), "final checksum"), want1 = Field(ref1.Stdout(), "final checksum");
  REQUIRE(!want0.empty());
  CHECK(want0 != want1);

  // Interrupted: killed once step 30 is committed, somewhere before the end.
  Process a0(args("run", 0, {"--step-sleep-ms", "20"}), dir.path(), "a0");
  Process a1(args("run", 1, {"--step-sleep-ms", "20"}), dir.path(), "a1");
  REQUIRE(a0.WaitForStdout("committed step=30"));
  a0.Signal(SIGKILL);
  a1.Signal(SIGKILL);
  CHECK(a0.Wait() == 128 + SIGKILL);
  a1.Wait();
  CHECK_FALSE(Contains(a0.Stdout(), "final checksum"));

  Process b0(args("run", 0, {"--resume"}), dir.path(), "b0"), b1(args("run", 1, {"--resume"}), dir.path(), "b1");
  REQUIRE(b0.Wait() == 0);
  REQUIRE(b1.Wait() == 0);
  INFO(b0.Stdout() << b0.Stderr());
  CHECK(Contains(b0.Stdout(), "resumed step="));
  CHECK(Contains(b0.Stdout(), "source=memory"));
  CHECK(std::stoi(Field(b0.Stdout(), "resumed step")) >= 30);
  CHECK(Field(b0.Stdout(), "final checksum") == want0);
  CHECK(Field(b1.Stdout(), "final checksum") == want1);
}

TEST_CASE("a trainer SIGKILLed right after staged still gets its checkpoint committed") {
  TempDir dir;
  Daemon d(dir);
  d.Start();
  Process p(Helper(d, {"--job", "k", "--seed", "5", "--bytes", "64000000", "save", "--step", "3",
                       "--die-after-staged"}),
            dir.path(), "die");
  CHECK(p.Wait() == 128 + SIGKILL);
  REQUIRE(Contains(p.Stdout(), "staged ticket="));
  REQUIRE(WaitUntil([&] { return Contains(d.Ctl({"--job", "k", "list"}).out, "k    3"); }, 30s, 20ms));
  auto c = Run(Helper(d, {"--job", "k", "--seed", "5", "--bytes", "64000000", "check"}), dir.path());
  INFO(c.out);
  CHECK(c.exit_code == 0);
  CHECK(Contains(c.out, "restored step=3 source=memory"));
  CHECK(Contains(d.Log(), "exited; session ends"));
}

TEST_CASE("ckptd SIGKILLed during a write leaves the previous checkpoint intact and restorable") {
  // 400 MB, a write of seconds to kill in the middle of; a quarter under the sanitizers,
  // whose helper fills and checks it several times slower (80 s of the case under TSan).
  const std::string state_bytes = kSanitizerSlowdown > 1 ? "100000000" : "400000000";
  TempDir dir;
  Daemon d(dir, {"--staging-bytes", "1G"});
  d.Start();
  REQUIRE(Run(Helper(d, {"--job", "w", "--seed", "1", "--bytes", state_bytes, "save", "--step", "10",
                         "--wait-committed"}),
              dir.path())
              .exit_code == 0);
  Process second(Helper(d, {"--job", "w", "--seed", "2", "--bytes", state_bytes, "save", "--step", "20",
                            "--wait-committed"}),
                 dir.path(), "second");
  REQUIRE(second.WaitForStdout("staged ticket="));
  const std::string shard = d.root() + "/w/step-00000020.tmp/rank-00000.safetensors";
  WaitUntil([&] { return std::filesystem::exists(shard); }, 30s, 1ms);
  d.Kill();  // mid-write
  second.Wait();
  bool torn_left = std::filesystem::exists(d.root() + "/w/step-00000020.tmp");
  bool committed = std::filesystem::exists(d.root() + "/w/step-00000020/manifest.json");
  INFO("tmp left: " << torn_left << ", step 20 committed anyway: " << committed);
  CHECK((torn_left || committed));
  d.Start();
  CHECK_FALSE(std::filesystem::exists(d.root() + "/w/step-00000020.tmp"));
  auto verify10 = d.Ctl({"--job", "w", "verify", "10"});
  CHECK(verify10.exit_code == 0);
  auto c = Run(Helper(d, {"--job", "w", "--seed", committed ? "2" : "1", "--bytes", state_bytes, "check"}),
               dir.path());
  INFO(c.out);
  CHECK(c.exit_code == 0);
  CHECK(Contains(c.out, committed ? "restored step=20 source=disk" : "restored step=10 source=disk"));
  CHECK(Run(Helper(d, {"--job", "w", "--seed", "1", "--bytes", state_bytes, "check", "--step", "10"}),
            dir.path()).exit_code == 0);
}

TEST_CASE("SIGTERM lets an in-flight write finish, then ckptd exits cleanly") {
  TempDir dir;
  Daemon d(dir);
  d.Start();
  Process p(Helper(d, {"--job", "t", "--seed", "9", "--bytes", "200000000", "save", "--step", "4",
                       "--wait-committed"}),
            dir.path(), "term");
  REQUIRE(p.WaitForStdout("staged ticket="));
  CHECK(d.Stop() == 0);
  p.Wait();
  CHECK(std::filesystem::exists(d.root() + "/t/step-00000004/manifest.json"));
  CHECK(Contains(d.Log(), "shut down cleanly"));
}

TEST_CASE("SIGHUP mid-save is logged and ignored: ckptd keeps running and the step commits") {
  TempDir dir;
  Daemon d(dir);
  d.Start();
  Process p(Helper(d, {"--job", "hup", "--seed", "9", "--bytes", "200000000", "save", "--step", "4",
                       "--wait-committed"}),
            dir.path(), "hup");
  REQUIRE(p.WaitForStdout("staged ticket="));
  d.Signal(SIGHUP);  // the default action would end ckptd at once (exit 129), leaving a .tmp
  REQUIRE(WaitUntil([&] { return Contains(d.Log(), "received SIGHUP: ignored"); }, 20s, 20ms));
  d.Signal(SIGHUP);  // and again: every one is passed over
  CHECK(p.Wait() == 0);
  INFO(p.Stdout() << p.Stderr() << d.Log());
  CHECK(Contains(p.Stdout(), "committed"));
  CHECK(std::filesystem::exists(d.root() + "/hup/step-00000004/manifest.json"));
  CHECK_FALSE(std::filesystem::exists(d.root() + "/hup/step-00000004.tmp"));
  CHECK(d.Ctl({"status"}).exit_code == 0);  // still serving
  CHECK(Run(Helper(d, {"--job", "hup", "--seed", "9", "--bytes", "200000000", "check"}), dir.path()).exit_code == 0);
  CHECK(d.Stop() == 0);  // and SIGTERM still stops it, cleanly
  CHECK(Contains(d.Log(), "shut down cleanly"));
}

TEST_CASE("retention keeps the last K and every N-th, never blocking saves") {
  TempDir dir;
  Daemon d(dir, {"--keep-last", "2", "--keep-every", "20"});
  d.Start();
  // 20 ms a step: saves 200 ms apart, so that each one's write usually lands before the next
  // even on a loaded machine (a snapshot taken while staging is busy is skipped, by design).
  auto r = Run(Trainer(d, {"--job", "ret", "--steps", "60", "--save-every", "10", "--state-bytes",
                           "100000", "--step-sleep-ms", "20"}),
               dir.path());
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);
  // Which steps committed: a step still being written when a newer one commits is abandoned
  // (it can happen to step 20 when its write is slow), and retention only sees committed ones.
  std::vector<uint64_t> committed;
  for (uint64_t step = 10; step <= 60; step += 10) {
    if (Contains(r.out, "committed step=" + std::to_string(step) + "\n")) committed.push_back(step);
  }
  REQUIRE(committed.size() >= 4);
  REQUIRE(committed.back() == 60);
  // Kept: the last 2 committed, and every committed multiple of 20.
  std::vector<uint64_t> kept, gone;
  for (size_t i = 0; i < committed.size(); ++i) {
    uint64_t step = committed[i];
    bool keep = i + 2 >= committed.size() || step % 20 == 0;
    (keep ? kept : gone).push_back(committed[i]);
  }
  // Retention runs just after the last commit, off the trainer's path.
  auto all_gone = [&](const std::set<uint64_t>& listed) {
    return std::none_of(gone.begin(), gone.end(), [&](uint64_t g) { return listed.count(g) != 0; });
  };
  WaitUntil([&] { return all_gone(ListedSteps(d, "ret")); }, 10s, 20ms);
  const std::set<uint64_t> listed = ListedSteps(d, "ret");
  INFO(r.out << r.err << fmt::format("{}", fmt::join(listed, ",")));
  for (uint64_t k : kept) CHECK(listed.count(k));
  CHECK(all_gone(listed));
  CHECK((listed.count(20) != 0) == Contains(r.out, "committed step=20\n"));
}

TEST_CASE("training carries on when ckptd is absent or dies") {
  TempDir dir;
  Daemon d(dir);
  std::vector<std::string> args = {"--job", "gone", "--steps", "80", "--save-every", "5", "--state-bytes", "100000"};
  auto alone = Run(Trainer(d, args), dir.path());  // never started
  REQUIRE(alone.exit_code == 0);
  CHECK(Contains(alone.err, "ckptd unavailable"));
  // A resume never starts over silently (issue 24 item 6): a checkpoint may exist.
  auto resume = Run(Trainer(d, [&] { auto a = args; a.push_back("--resume"); return a; }()), dir.path());
  CHECK(resume.exit_code == 1);
  CHECK(Contains(resume.err, "cannot resume"));
  std::string want = Field(alone.out, "final checksum");
  d.Start();
  args.insert(args.end(), {"--step-sleep-ms", "25"});
  Process p(Trainer(d, args), dir.path(), "orphan");
  REQUIRE(p.WaitForStdout("committed step=10"));
  d.Kill();
  REQUIRE(p.Wait() == 0);
  CHECK(Field(p.Stdout(), "final checksum") == want);
  CHECK(Contains(p.Stderr(), "ckptd exited"));
}

namespace {

// Memory `pid` maps and has touched, in bytes: /proc/<pid>/status VmRSS (shared pages
// included) plus HugetlbPages, which VmRSS leaves out (arenas in huge pages, where the test
// command reserved a pool).
uint64_t ResidentBytes(pid_t pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  uint64_t kib = 0;
  while (std::getline(status, line)) {
    for (const char* key : {"VmRSS:", "HugetlbPages:"}) {
      if (line.rfind(key, 0) == 0) kib += std::stoull(line.substr(std::strlen(key)));
    }
  }
  return kib * 1024;
}

}  // namespace

TEST_CASE("a SIGKILLed trainer's memory is returned at once, not at the next registration") {
  TempDir dir;
  Daemon d(dir, {"--staging-bytes", "1G"});
  d.Start();
  const uint64_t idle = ResidentBytes(d.pid());
  Process p(Trainer(d, {"--job", "dies", "--steps", "100000", "--save-every", "0", "--state-bytes",
                        "400000000", "--step-sleep-ms", "10"}),
            dir.path(), "dies");
  // Registered: ckptd maps (and pre-faults) the trainer's 400 MB of arenas.
  REQUIRE(WaitUntil([&] { return ResidentBytes(d.pid()) > idle + 300'000'000; },
                    std::chrono::seconds(60)));
  p.Signal(SIGKILL);
  p.Wait();
  auto killed = std::chrono::steady_clock::now();
  // No other trainer registers: the session ends and its arenas are unmapped by themselves.
  CHECK(WaitUntil([&] { return ResidentBytes(d.pid()) < idle + 100'000'000; },
                  std::chrono::seconds(5)));
  auto took = std::chrono::steady_clock::now() - killed;
  INFO("ckptd resident " << ResidentBytes(d.pid()) << " bytes, idle " << idle);
  CHECK(took < std::chrono::seconds(2));
  CHECK(Contains(d.Log(), "exited; session ends"));
}

TEST_CASE("a stalled ckptd costs a C++ trainer only the saves it missed; a restarted one takes it back") {
  TempDir dir;
  Daemon d(dir);
  std::vector<std::string> args = {"--job", "stall", "--steps", "600", "--save-every", "5",
                                   "--state-bytes", "1000000", "--step-sleep-ms", "20"};
  auto uninterrupted = Run(Trainer(d, args), dir.path());  // no ckptd: the same arithmetic
  REQUIRE(uninterrupted.exit_code == 0);
  d.Start();
  Process p(Trainer(d, args), dir.path(), "stalled");
  REQUIRE(p.WaitForStdout("committed step=20"));
  // Stopped for 5 s (a long stall, a swapped node): the trainer goes on, then saves again
  // in the same session once ckptd resumes.
  d.Signal(SIGSTOP);
  std::this_thread::sleep_for(std::chrono::seconds(5));
  REQUIRE(p.Running());
  d.Signal(SIGCONT);
  auto committed = [&] {
    std::string out = p.Stdout();
    size_t at = out.rfind("committed step=");
    return at == std::string::npos ? 0 : std::stoull(out.substr(at + 15));
  };
  const uint64_t before = committed();
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (committed() <= before && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  CHECK(committed() > before);
  CHECK_FALSE(Contains(p.Stdout(), "registered again"));
  // Killed and started again: the client registers with the new ckptd by itself.
  d.Kill();
  d.Start();
  REQUIRE(p.WaitForStdout("registered again with ckptd"));
  const uint64_t after_restart = committed();
  deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (committed() <= after_restart && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  CHECK(committed() > after_restart);
  REQUIRE(p.Wait() == 0);
  // Training itself never noticed, and every checkpoint it reported holds what it should.
  CHECK(Field(p.Stdout(), "final checksum") == Field(uninterrupted.out, "final checksum"));
  auto resumed = Run(Trainer(d, [&] { auto a = args; a.push_back("--resume"); return a; }()), dir.path());
  INFO(resumed.out << resumed.err);
  CHECK(Contains(resumed.out, "resumed step=600"));
  CHECK(Field(resumed.out, "final checksum") == Field(uninterrupted.out, "final checksum"));
  auto verify = d.Ctl({"--job", "stall", "verify", "600"});
  CHECK(verify.exit_code == 0);
}

TEST_CASE("a job that goes back to an older step trains on: its new steps are kept and are latest") {
  TempDir dir;
  Daemon d(dir, {"--keep-last", "2"});
  d.Start();
  auto save = [&](uint64_t step) {
    return Run(Helper(d, {"--job", "back", "--bytes", "100000", "--seed", std::to_string(step),
                          "save", "--step", std::to_string(step), "--wait-committed"}),
               dir.path());
  };
  for (uint64_t step : {10, 20, 30}) REQUIRE(save(step).exit_code == 0);
  WaitUntil([&] { return ListedSteps(d, "back").count(10) == 0; }, 10s, 20ms);
  // The job resumes from step 20 (say the run after it diverged) and trains on.
  auto back = Run(Helper(d, {"--job", "back", "--bytes", "100000", "--seed", "20", "check",
                             "--step", "20"}),
                  dir.path());
  REQUIRE(Contains(back.out, "restored step=20"));
  REQUIRE(save(25).exit_code == 0);  // a later run: each save here is a new trainer process
  REQUIRE(save(26).exit_code == 0);
  // Retention keeps the two latest in run order, not the two highest numbers.
  WaitUntil([&] { return ListedSteps(d, "back").count(30) == 0; }, 10s, 20ms);
  const std::set<uint64_t> list = ListedSteps(d, "back");
  CHECK(list.count(25));
  CHECK(list.count(26));
  // "Latest" is the last committed: the abandoned step 30 is not resumed.
  auto latest = Run(Helper(d, {"--job", "back", "--bytes", "100000", "--seed", "26", "check"}),
                    dir.path());
  CHECK(Contains(latest.out, "restored step=26"));
  CHECK(Contains(latest.out, "match"));
}

TEST_CASE("copy-on-write snapshots keep the bytes of the snapshot while the trainer writes at once") {
  TempDir dir;
  Daemon d(dir, {"--log-level", "debug"});
  d.Start();
  // Three tensors of 100, 50 and 50 MB, each in an arena of its own: huge pages while the
  // pool holds them (300 MB with rounding), base pages otherwise.
  const std::vector<std::string> big = {"--bytes", "200000000"};
  const bool pool = FreeHugePages() >= 160;
  auto helper = [&](std::vector<std::string> args) {
    std::vector<std::string> all = {"--job", "cow", "--seed", "9", "--copy-on-write"};
    all.insert(all.end(), big.begin(), big.end());
    all.insert(all.end(), args.begin(), args.end());
    return Helper(d, all);
  };
  // The helper overwrites every tensor the moment its snapshot is staged.
  Process save(helper({"save", "--step", "4", "--wait-committed"}), dir.path(), "save");
  REQUIRE(save.Wait() == 0);
  INFO(d.Log());
  // Tests running beside this one take huge pages from the pool and give them back: what
  // the trainer got is what its registration says, and it must be all or nothing. With the
  // pool free before the save and after it, nothing took it meanwhile: copy-on-write.
  const bool cow = Contains(d.Log(), "copy-on-write snapshots for 200000007 of 200000007 bytes");
  if (cow) {
    CHECK(Contains(d.Log(), "copy-on-write: "));
  } else {
    CHECK(Contains(d.Log(), "copy-on-write snapshots for 0 of 200000007 bytes"));
  }
  if (pool && FreeHugePages() >= 160) CHECK(cow);
  auto from_memory = Run(helper({"check"}), dir.path());
  CHECK(from_memory.exit_code == 0);
  CHECK(Contains(from_memory.out, "restored step=4 source=memory"));
  CHECK(Contains(from_memory.out, "match"));
  // A trainer killed while its snapshot is still being copied: the copy goes on from ckptd's
  // own mapping, and the checkpoint commits whole.
  Process die(helper({"save", "--step", "5", "--die-after-staged"}), dir.path(), "die");
  CHECK(die.Wait() == 128 + SIGKILL);
  REQUIRE(WaitUntil([&] { return Contains(d.Ctl({"--job", "cow", "list"}).out, "cow  5"); }, 30s, 20ms));
  REQUIRE(d.Stop() == 0);
  d.Start();
  auto from_disk = Run(helper({"check"}), dir.path());
  INFO(from_disk.out);
  CHECK(from_disk.exit_code == 0);
  CHECK(Contains(from_disk.out, "restored step=5 source=disk"));
  CHECK(Contains(from_disk.out, "match"));
}
