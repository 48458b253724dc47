// --increments on (issue 48, step 3): one node writes each rank's step against its previous
// one, referencing what did not change; restores from disk bit-exact after a restart,
// ckptctl verify and list follow the references, retention keeps what kept steps reference,
// and SIGKILLs mid-write lose nothing committed. Real ckptd, real trainer processes.
#include <signal.h>

#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tests/fakes/wait_until.h"
#include "tests/integration/common.h"

using namespace ckpt::testing;
using namespace std::chrono_literals;
using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

// model.a is 4 MiB of the 8 MiB a rank saves, in chunks of 64 KiB: only its first 4 KiB
// change from step to step (they hold the step number).
const std::vector<std::string> kDaemonFlags = {"--increments", "on", "--increment-chunk-bytes", "64K",
                                               "--keep-last", "2"};
const std::vector<std::string> kData = {"--job", "inc", "--seed", "7", "--bytes", "8388608"};

std::vector<std::string> With(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

int SaveSteps(Daemon& d, const TempDir& dir, const std::string& steps, std::string* out = nullptr) {
  Process p(Helper(d, With(kData, {"save-steps", "--steps-list", steps, "--changed-bytes", "4096"})), dir.path(),
            "save-" + steps);
  int rc = p.Wait();
  INFO(p.Stdout() << p.Stderr() << d.Log());
  if (out) *out = p.Stdout();
  return rc;
}

json Manifest(const Daemon& d, uint64_t step) {
  std::ifstream in(fmt::format("{}/inc/step-{:08d}/manifest.json", d.root(), step));
  return json::parse(in, nullptr, false);
}

// A trainer_helper `check` (by default of kData's tensors) restores `step` from `source`,
// bit-exact.
void CheckRestores(Daemon& d, const TempDir& dir, uint64_t step, const std::string& source,
                   const std::vector<std::string>& check = With(kData, {"check", "--changed-bytes", "4096"})) {
  RunResult r = Run(Helper(d, check), dir.path());
  INFO(r.out << r.err << d.Log());
  CHECK(r.exit_code == 0);
  CHECK(Contains(r.out, fmt::format("restored step={} source={}", step, source)));
  CHECK(Contains(r.out, "match"));
}

void CheckVerifies(Daemon& d, uint64_t step) {
  RunResult v = d.Ctl({"--job", "inc", "verify", std::to_string(step)});
  INFO(v.out << v.err);
  CHECK(v.exit_code == 0);
}

}  // namespace

TEST_CASE("with --increments on a step writes what changed and restores bit-exact from disk") {
  TempDir dir;
  Daemon d(dir, kDaemonFlags);
  d.Start();
  REQUIRE(SaveSteps(d, dir, "10,20,30,40") == 0);
  // Step 10 is full (nothing before it); 40 writes model.a's first chunk and small pieces,
  // and references the rest where step 10 wrote it (one hop).
  json last = Manifest(d, 40);
  CHECK(last["format_version"] == 5);
  const uint64_t own = last["increment"]["own_bytes"], referenced = last["increment"]["referenced_bytes"];
  INFO("own " << own << ", referenced " << referenced);
  CHECK(referenced > (uint64_t{8} << 20) * 9 / 10);
  CHECK(own < (uint64_t{1} << 20));
  CHECK(last["increment"]["origin_steps"].size() == 1);
  CHECK(last["increment"]["origin_steps"][0]["step"] == 10);
  // Retention (--keep-last 2) kept 30 and 40; 10 is held (40 references it), 20 is gone.
  REQUIRE(WaitUntil([&] { return !fs::exists(d.root() + "/inc/step-00000020"); }, 10s, 20ms));
  CHECK_FALSE(fs::exists(d.root() + "/inc/step-00000010"));
  std::string held;
  for (const auto& e : fs::directory_iterator(d.root() + "/inc")) {
    if (e.path().filename().string().rfind("step-00000010.held-", 0) == 0) held = e.path();
  }
  REQUIRE_FALSE(held.empty());
  std::ifstream held_manifest(held + "/manifest.json");
  json first = json::parse(held_manifest, nullptr, false);
  CHECK(first["format_version"] == 5);
  CHECK(first["increment"]["referenced_bytes"] == 0);
  RunResult list = d.Ctl({"--job", "inc", "list"});
  INFO(list.out);
  CHECK(Contains(list.out, "referenced)"));
  CHECK(Contains(list.out, "increment"));
  RunResult verify = d.Ctl({"--job", "inc", "verify", "40"});
  INFO(verify.out << verify.err);
  CHECK(verify.exit_code == 0);
  CHECK(Contains(verify.out, "referenced in 1 files of earlier steps"));
  CHECK(Contains(verify.out, ".held-"));
  CheckRestores(d, dir, 40, "memory");
  REQUIRE(d.Stop() == 0);
  d.Start();
  CheckRestores(d, dir, 40, "disk");
  // A new session after the restart that does not restore has no base: its first save is
  // full, and the held step goes once nothing kept references it.
  REQUIRE(SaveSteps(d, dir, "50,60") == 0);
  CHECK(Manifest(d, 50)["increment"]["referenced_bytes"] == 0);
  CHECK(Manifest(d, 60)["increment"]["origin_steps"][0]["step"] == 50);
  // Nothing of steps 10 to 40 is left.
  REQUIRE(WaitUntil(
      [&] {
        for (const auto& e : fs::directory_iterator(d.root() + "/inc")) {
          const std::string name = e.path().filename();
          if (name != "step-00000050" && name != "step-00000060" && name.rfind("step-", 0) == 0) return false;
        }
        return true;
      },
      10s, 20ms));
  CheckVerifies(d, 60);
  CheckRestores(d, dir, 60, "memory");
}

// A trainer that restarts, restores and trains on: its first save references the step it
// restored (from disk after a ckptd restart here), not a full one.
TEST_CASE("a session's first save after a restore references the step it restored") {
  TempDir dir;
  Daemon d(dir, kDaemonFlags);
  d.Start();
  REQUIRE(SaveSteps(d, dir, "10,20") == 0);
  REQUIRE(d.Stop() == 0);
  d.Start();
  std::string out;
  Process p(Helper(d, With(kData, {"save-steps", "--restore-first", "--steps-list", "30", "--changed-bytes", "4096"})),
            dir.path(), "restore-then-save");
  REQUIRE(p.Wait() == 0);
  INFO(p.Stdout() << d.Log());
  CHECK(Contains(p.Stdout(), "restored step=20 source=disk"));
  json m = Manifest(d, 30);
  CHECK(m["increment"]["referenced_bytes"] > (uint64_t{8} << 20) * 9 / 10);
  CheckVerifies(d, 30);
  REQUIRE(d.Stop() == 0);
  d.Start();
  CheckRestores(d, dir, 30, "disk");
}

TEST_CASE("ckptctl delete of a step that a kept step references retires it; the later step still restores") {
  TempDir dir;
  Daemon d(dir, {"--increments", "on", "--increment-chunk-bytes", "64K", "--keep-last", "0"});
  d.Start();
  REQUIRE(SaveSteps(d, dir, "1,2,3") == 0);
  RunResult deleted = d.Ctl({"--job", "inc", "delete", "1"});
  INFO(deleted.out << deleted.err);
  CHECK(deleted.exit_code == 0);
  CHECK(Contains(deleted.out, "its files stay while later steps reference them"));
  RunResult list = d.Ctl({"--json", "--job", "inc", "list"});
  const json listed = json::parse(list.out, nullptr, false);
  REQUIRE(listed.contains("checkpoints"));
  for (const json& c : listed["checkpoints"]) CHECK(c["step"] != 1);
  REQUIRE(d.Stop() == 0);
  d.Start();
  CheckRestores(d, dir, 3, "disk");
  CheckVerifies(d, 2);
  CheckVerifies(d, 3);
}

// Crash consistency with increments: every listed step verifies through its references and
// the newest restores bit-exact after each SIGKILL of ckptd mid-save.
TEST_CASE("ckptd SIGKILLed mid-save again and again with --increments on loses nothing committed") {
  TempDir dir;
  Daemon d(dir, kDaemonFlags);
  std::mt19937 random(48);
  uint64_t next = 1;
  for (int round = 0; round < 4; ++round) {
    INFO("round " << round);
    d.Start();
    std::string steps;
    for (int i = 0; i < 30; ++i) steps += (i ? "," : "") + std::to_string(next++);
    Process saver(Helper(d, With(kData, {"save-steps", "--steps-list", steps, "--changed-bytes", "4096"})),
                  dir.path(), "saver" + std::to_string(round));
    std::this_thread::sleep_for(std::chrono::milliseconds((300 + random() % 700) * kSanitizerSlowdown));
    d.Kill();
    (void)saver.Wait();
    d.Start();
    RunResult list = d.Ctl({"--json", "--job", "inc", "list"});
    INFO(list.out << list.err);
    json listed = json::parse(list.out, nullptr, false);
    REQUIRE_FALSE(listed.is_discarded());
    if (listed["checkpoints"].empty()) {  // killed before the first commit
      REQUIRE(d.Stop() == 0);
      continue;
    }
    uint64_t newest = 0;
    for (const json& c : listed["checkpoints"]) {
      CheckVerifies(d, c["step"]);
      newest = std::max<uint64_t>(newest, c["step"]);
    }
    CheckRestores(d, dir, newest, "disk");
    REQUIRE(d.Stop() == 0);
  }
}

// Sparse updates (issue 48, item 5): an embedding-like table of which 1% of the rows, spread
// at random, change at every step. Row-block chunks of 4 rows (16 KiB rows in 64 KiB
// chunks) make each increment write about 1 - 0.99^4 = 3.9% of the table. Later ones find
// the table's chunks spread over more and more files, up to max(64, chunks / 2) extents
// (increment_plan.cc; past it the shortest references are written again).
TEST_CASE("an embedding table with 1% of its rows changed at random writes a few percent of its bytes") {
  TempDir dir;
  Daemon d(dir, {"--increments", "on", "--increment-chunk-bytes", "64K", "--keep-last", "0"});
  d.Start();
  constexpr uint64_t kRows = 2048, kRowBytes = 16384, kTable = kRows * kRowBytes;  // 32 MiB, 512 chunks
  const std::vector<std::string> data = {"--job", "inc", "--seed", "7", "--bytes", "1048576", "--table-rows",
                                         std::to_string(kRows), "--row-bytes", std::to_string(kRowBytes),
                                         "--sparse-rows", "1"};
  Process p(Helper(d, With(data, {"save-steps", "--steps-list", "1,2,3,4,5,6"})), dir.path(), "sparse");
  REQUIRE(p.Wait() == 0);
  for (uint64_t step = 2; step <= 6; ++step) {
    json m = Manifest(d, step);
    const uint64_t own = m["increment"]["own_bytes"];
    INFO("step " << step << ": " << own << " bytes written of a " << kTable << "-byte table\n" << d.Log());
    CHECK(own > kTable / 100);
    // About 20 of the table's 512 chunks, and the small pieces.
    CHECK(own < kTable * 6 / 100);
    CheckVerifies(d, step);
  }
  // Each step's table restores bit-exact: the rows of earlier steps come from their files.
  CheckRestores(d, dir, 6, "memory", With(data, {"check"}));
  REQUIRE(d.Stop() == 0);
  d.Start();
  CheckRestores(d, dir, 4, "disk", With(data, {"check", "--step", "4"}));
}

// The same with a recommender's rows (256 bytes) in a table over 64 MiB, registered sparse:
// alone on its node it has the node's whole budget of sparse chunks (a million), so its chunks
// stay 1 KiB (4 rows; 1 - 0.99^4 = 3.9% of them touched a step) where a dense piece's limit of
// 65,536 chunks would make them 5 rows.
TEST_CASE("a large sparse table of small rows keeps 1 KiB chunks, and writes a few percent of itself") {
  TempDir dir;
  Daemon d(dir, {"--increments", "on", "--keep-last", "0"});
  d.Start();
  constexpr uint64_t kRows = 327680, kRowBytes = 256, kTable = kRows * kRowBytes;  // 80 MiB, 81,920 chunks
  const std::vector<std::string> data = {"--job", "inc", "--seed", "9", "--bytes", "1048576", "--table-rows",
                                         std::to_string(kRows), "--row-bytes", std::to_string(kRowBytes),
                                         "--sparse-rows", "1", "--table-sparse"};
  Process p(Helper(d, With(data, {"save-steps", "--steps-list", "1,2,3"})), dir.path(), "sparse");
  REQUIRE(p.Wait() == 0);
  for (uint64_t step = 1; step <= 3; ++step) {
    json m = Manifest(d, step);
    INFO("step " << step << "\n" << d.Log());
    CHECK(m["tensors"]["emb.weight"]["shards"][0]["chunk_bytes"] == 1024);
    if (step == 1) continue;
    const uint64_t own = m["increment"]["own_bytes"];
    INFO(own << " bytes written of a " << kTable << "-byte table");
    CHECK(own > kTable * 2 / 100);
    CHECK(own < kTable * 6 / 100);
    CheckVerifies(d, step);
  }
  CheckRestores(d, dir, 3, "memory", With(data, {"check"}));
}

namespace {

// Rank 0's shard file in a step: its safetensors header's length (the first 8 bytes), with
// the padding that aligns the data region (what readers' limits count).
uint64_t HeaderBytes(const Daemon& d, uint64_t step) {
  for (const auto& e : fs::directory_iterator(fmt::format("{}/inc/step-{:08d}", d.root(), step))) {
    const std::string name = e.path().filename().string();
    if (name.rfind("rank-00000.", 0) != 0 || e.path().extension() != ".safetensors") continue;
    std::ifstream in(e.path(), std::ios::binary);
    unsigned char prefix[8] = {};
    in.read(reinterpret_cast<char*>(prefix), 8);
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | prefix[i];
    return n;
  }
  FAIL("no rank 0 shard in step " << step);
  return 0;
}

}  // namespace

// A safetensors header may hold 100,000,000 bytes (stock readers refuse more). An increment
// of scattered changes lists an entry per changed run, so its header can pass that where
// the rank's pieces whole would not: it is then written whole. A rank whose whole header is
// too large fails its step, saying so, and loses nothing committed. (CKPTD_FAULT=
// header-limit:N lowers the limit so that kilobytes reach it.)
TEST_CASE("a step whose header would pass safetensors' limit is written whole, or fails saying why") {
  TempDir dir;
  const std::vector<std::string> flags = {"--increments", "on", "--increment-chunk-bytes", "64K", "--keep-last", "0"};
  const std::vector<std::string> data = {"--job", "inc", "--seed", "7", "--bytes", "1048576", "--table-rows", "2048",
                                         "--row-bytes", "16384", "--sparse-rows", "10"};
  uint64_t whole = 0, increment = 0;
  {
    Daemon d(dir, flags);
    d.Start();
    Process p(Helper(d, With(data, {"save-steps", "--steps-list", "1,2"})), dir.path(), "measure");
    REQUIRE(p.Wait() == 0);
    whole = HeaderBytes(d, 1);
    increment = HeaderBytes(d, 2);
    INFO("headers: " << whole << " bytes whole, " << increment << " as an increment");
    // A third of the table's 512 chunks changed, in over a hundred runs, an entry each (the
    // headers are padded to 4 KiB blocks).
    REQUIRE(increment >= whole + 4096);
    REQUIRE(d.Stop() == 0);
  }
  struct Unset {
    ~Unset() { ::unsetenv("CKPTD_FAULT"); }
  } unset;
  {
    const uint64_t limit = (whole + increment) / 2;
    ::setenv("CKPTD_FAULT", fmt::format("header-limit:{}", limit).c_str(), 1);
    Daemon d(dir, flags);
    d.Start();
    Process p(Helper(d, With(data, {"save-steps", "--steps-list", "3,4,5"})), dir.path(), "whole");
    REQUIRE(p.Wait() == 0);
    INFO(d.Log());
    CHECK(Contains(d.Log(), "[inc s4] r0 written whole: rank-00000."));
    CHECK(Contains(d.Log(), fmt::format("over the {} bytes safetensors readers accept", limit)));
    for (uint64_t step = 3; step <= 5; ++step) {
      CHECK(HeaderBytes(d, step) <= limit);
      CHECK(Manifest(d, step)["increment"]["referenced_bytes"] == 0);
      CheckVerifies(d, step);
    }
    REQUIRE(d.Stop() == 0);
  }
  {
    ::setenv("CKPTD_FAULT", fmt::format("header-limit:{}", whole / 2).c_str(), 1);
    Daemon d(dir, flags);
    d.Start();
    Process p(Helper(d, With(data, {"save-steps", "--steps-list", "6"})), dir.path(), "too-large");
    CHECK(p.Wait() == 5);
    INFO(p.Stdout() << d.Log());
    CHECK(Contains(p.Stdout(), "step 6 failed: "));
    CHECK(Contains(p.Stdout(), "safetensors header would be"));
    CHECK_FALSE(fs::exists(fmt::format("{}/inc/step-00000006", d.root())));
    ::unsetenv("CKPTD_FAULT");
    REQUIRE(d.Stop() == 0);
    d.Start();
    CheckRestores(d, dir, 5, "disk", With(data, {"check", "--step", "5"}));
  }
}

// A full fine-tune: every byte changes at every step. After one save planned against a base
// (which finds most of the rank changed), a rank's saves are streamed whole as they land,
// hashed in the same pass, as a full shard is; each is still version 5 and a base for the
// next; once little changes again the next save is planned and references.
TEST_CASE("a rank whose bytes mostly change is streamed whole, and planned again once they do not") {
  TempDir dir;
  Daemon d(dir, {"--increments", "on", "--increment-chunk-bytes", "64K", "--keep-last", "0"});
  d.Start();
  const std::vector<std::string> dense = {"--job", "inc", "--seed", "7", "--bytes", "1048576", "--table-rows", "512",
                                          "--row-bytes", "16384", "--sparse-rows", "100"};
  Process p(Helper(d, With(dense, {"save-steps", "--steps-list", "1,2,3,4"})), dir.path(), "dense");
  REQUIRE(p.Wait() == 0);
  INFO(d.Log());
  CHECK(Contains(d.Log(), "[inc s1] r0 full, streamed: no base"));
  // Planned: the table (8 of its 9 MiB) changed, the small tensors are referenced.
  CHECK(Contains(d.Log(), "[inc s2] r0 increment: 88% written"));
  CHECK(Contains(d.Log(), "[inc s3] r0 full, streamed ("));
  CHECK(Contains(d.Log(), "[inc s4] r0 full, streamed ("));
  for (uint64_t step = 1; step <= 4; ++step) {
    json m = Manifest(d, step);
    CHECK(m["format_version"] == 5);
    CHECK((m["increment"]["referenced_bytes"] == 0) == (step != 2));
    CheckVerifies(d, step);
  }
  CheckRestores(d, dir, 4, "memory", With(dense, {"check"}));
  // The same session, now changing little: its next save (after one streamed) is planned.
  Process q(Helper(d, With(kData, {"save-steps", "--steps-list", "5,6,7", "--changed-bytes", "4096"})), dir.path(),
            "sparse");
  REQUIRE(q.Wait() == 0);
  CHECK(Contains(d.Log(), "[inc s5] r0 full, streamed: no base"));  // a new session
  CHECK(Manifest(d, 6)["increment"]["referenced_bytes"] > 0);
  CHECK(Manifest(d, 7)["increment"]["referenced_bytes"] > 0);
  REQUIRE(d.Stop() == 0);
  d.Start();
  CheckRestores(d, dir, 7, "disk");
}

// An operator's rm -rf of a job's directory under a running ckptd while one trainer saves on:
// its next step's base went with the directory, which the writer sees (it checks that its
// base is still committed before referencing it), so that step is written whole, verifies,
// and restores bit-exact after a restart.
TEST_CASE("a job directory deleted between two saves of one trainer: the next step references nothing") {
  TempDir dir;
  Daemon d(dir, kDaemonFlags);
  d.Start();
  const std::string go_on = dir.path() + "/go-on";
  Process p(Helper(d, With(kData, {"save-steps", "--steps-list", "1,2", "--changed-bytes", "4096", "--then-wait-for",
                                   go_on})),
            dir.path(), "save-1,2");
  // Told committed: step 1 is the trainer's base from here on.
  REQUIRE(p.WaitForStdout("committed 1\n", 60s));
  fs::remove_all(fmt::format("{}/inc", d.root()));
  { std::ofstream(go_on) << "go"; }
  REQUIRE(p.Wait() == 0);
  const json two = Manifest(d, 2);
  REQUIRE_FALSE(two.is_discarded());
  CHECK(two["increment"]["referenced_bytes"].get<uint64_t>() == 0);
  CHECK(two["increment"]["origin_steps"].empty());
  CheckVerifies(d, 2);
  REQUIRE(d.Stop() == 0);
  d.Start();
  CheckRestores(d, dir, 2, "disk");
}

// A retired step whose last referrer is gone (a retention pass ckptd died in, an operator's
// rm) is removed when ckptd starts, not at the job's next commit, which may never come.
TEST_CASE("a retired step that nothing references any more is removed when ckptd starts") {
  TempDir dir;
  Daemon d(dir, {"--increments", "on", "--increment-chunk-bytes", "64K", "--keep-last", "0"});
  d.Start();
  REQUIRE(SaveSteps(d, dir, "1,2,3") == 0);
  REQUIRE(d.Stop() == 0);
  // Step 1 retired, then steps 2 and 3 (its referrers) gone: nothing references it.
  const uint64_t run = Manifest(d, 1)["run"];
  const std::string held = fmt::format("{}/inc/step-00000001.held-{:016x}", d.root(), run);
  fs::rename(fmt::format("{}/inc/step-00000001", d.root()), held);
  fs::remove_all(fmt::format("{}/inc/step-00000002", d.root()));
  fs::remove_all(fmt::format("{}/inc/step-00000003", d.root()));
  d.Start();
  // The line is logged once the files are gone.
  CHECK(WaitUntil([&] { return Contains(d.Log(), "[inc s1] removed: no kept step references it any more"); }, 20s,
                  20ms));
  INFO(d.Log());
  CHECK_FALSE(fs::exists(held));
}
