// Frozen tensors (issue 48, item 2), real ckptd and real trainer processes: tensors registered
// frozen are copied from the trainer once and then shared from ckptd's own copy (the metric
// counts the bytes not copied; staging memory holds them once), every --frozen-check-every-th
// snapshot copies them again, and one changed in place by the trainer is saved at that check;
// restores from memory and from disk give the trainer's bytes back exactly, with increments
// on and off.
#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include "tests/integration/common.h"

using namespace ckpt::testing;
using json = nlohmann::json;

namespace {

// 8 MiB a rank: model.a 4 MiB (its first 4 KiB change every step), model.b and optim.c
// 2 MiB each, registered frozen.
const std::vector<std::string> kData = {"--job", "fz", "--seed", "5", "--bytes", "8388608", "--frozen",
                                        "model.b,optim.c"};
constexpr uint64_t kFrozenBytes = 4u << 20;

std::vector<std::string> With(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

double Metric(int port, const std::string& name) {
  const std::string m = HttpGet(port, "/metrics");
  std::smatch found;
  if (!std::regex_search(m, found, std::regex("\n" + name + " ([0-9.e+]+)"))) return -1;
  return std::stod(found[1]);
}

json Manifest(const Daemon& d, uint64_t step) {
  std::ifstream in(fmt::format("{}/fz/step-{:08d}/manifest.json", d.root(), step));
  return json::parse(in, nullptr, false);
}

void CheckRestores(Daemon& d, const TempDir& dir, uint64_t step, const std::string& source, bool poked) {
  std::vector<std::string> args = With(kData, {"check", "--changed-bytes", "4096"});
  if (poked) args.push_back("--poked");
  RunResult r = Run(Helper(d, args), dir.path());
  INFO(r.out << r.err << d.Log());
  CHECK(r.exit_code == 0);
  CHECK(Contains(r.out, fmt::format("restored step={} source={}", step, source)));
  CHECK(Contains(r.out, "match"));
}

}  // namespace

TEST_CASE("frozen tensors are copied once, checked every Nth snapshot, and a change in place is saved") {
  const bool increments = GENERATE(true, false);
  INFO("--increments " << (increments ? "on" : "off"));
  TempDir dir;
  const int port = PickFreePort();
  Daemon d(dir, {"--increments", increments ? "on" : "off", "--increment-chunk-bytes", "64K", "--keep-last", "0",
                 "--frozen-check-every", "3", "--metrics-addr", std::to_string(port)});
  d.Start();
  // Snapshot 1 copies the frozen tensors; 2 and 3 take them from ckptd's copy; 4 checks them
  // (the trainer changed model.b in place at step 3: seen and saved at 4); 5 and 6 take
  // optim.c from ckptd's copy again but copy model.b, not to be trusted any more; 7 checks
  // and finds nothing new.
  Process p(Helper(d, With(kData, {"save-steps", "--steps-list", "1,2,3,4,5,6,7", "--changed-bytes", "4096",
                                   "--poke-frozen-at", "3"})),
            dir.path(), "save");
  REQUIRE(p.Wait() == 0);
  INFO(p.Stdout() << d.Log());
  CHECK(Metric(port, "ckptd_frozen_skipped_bytes_total") == 2 * kFrozenBytes + 2 * (kFrozenBytes / 2));
  CHECK(Metric(port, "ckptd_frozen_changes_total") == 1);
  CHECK(Contains(d.Log(), "frozen tensor model.b changed in place since the last check: saved"));
  if (increments) {
    // Frozen pieces cost nothing after the first step, but at the check that found the change.
    for (uint64_t step : {2, 3, 5, 6, 7}) {
      const uint64_t own = Manifest(d, step)["increment"]["own_bytes"];
      INFO("step " << step << " own bytes " << own);
      CHECK(own < (uint64_t{1} << 20));
    }
    CHECK(Manifest(d, 4)["increment"]["own_bytes"] < (uint64_t{1} << 20));  // one 64 KiB chunk of model.b
    RunResult verify = d.Ctl({"--job", "fz", "verify", "7"});
    INFO(verify.out << verify.err);
    CHECK(verify.exit_code == 0);
  }
  // Step 3 was saved with model.b as last seen (the check's window); 4 on hold the change.
  CheckRestores(d, dir, 7, "memory", /*poked=*/true);
  REQUIRE(d.Stop() == 0);
  d.Start();
  CheckRestores(d, dir, 7, "disk", /*poked=*/true);
  std::vector<std::string> at3 = With(kData, {"check", "--changed-bytes", "4096", "--step", "3"});
  RunResult r3 = Run(Helper(d, at3), dir.path());
  INFO(r3.out << r3.err);
  CHECK(Contains(r3.out, "restored step=3 source=disk"));
  CHECK(Contains(r3.out, "match"));
}

TEST_CASE("a restored trainer's frozen tensors are copied from it again, not from the snapshot before") {
  TempDir dir;
  const int port = PickFreePort();
  Daemon d(dir, {"--increments", "on", "--increment-chunk-bytes", "64K", "--keep-last", "0", "--metrics-addr",
                 std::to_string(port)});
  d.Start();
  Process first(Helper(d, With(kData, {"save-steps", "--steps-list", "1,2", "--changed-bytes", "4096"})), dir.path(),
                "first");
  REQUIRE(first.Wait() == 0);
  // The resumed trainer restores step 2 into its frozen tensors, then saves: those are
  // copied from it (the restore wrote them) before later saves take them from ckptd's copy.
  Process resumed(Helper(d, With(kData, {"save-steps", "--restore-first", "--steps-list", "3,4", "--changed-bytes",
                                         "4096"})),
                  dir.path(), "resumed");
  REQUIRE(resumed.Wait() == 0);
  INFO(resumed.Stdout() << d.Log());
  CHECK(Contains(resumed.Stdout(), "restored step=2 source=memory"));
  CHECK(Metric(port, "ckptd_frozen_skipped_bytes_total") == 2 * kFrozenBytes);  // steps 2 and 4
  // Step 3 references what steps 1 and 2 wrote (the restored step's own references, one hop).
  CHECK(Manifest(d, 3)["increment"]["own_bytes"] < (uint64_t{1} << 20));
  CheckRestores(d, dir, 4, "memory", false);
}

TEST_CASE("a frozen base is held once in staging memory: the next snapshot shares it with the hot copy") {
  TempDir dir;
  const int port = PickFreePort();
  // 8 MiB snapshots, half of them frozen: room for one whole snapshot and the trainer's half
  // of the next (13 MiB), not for two whole ones, which would evict the hot copy for room.
  Daemon d(dir, {"--staging-bytes", "13M", "--frozen-check-every", "0", "--metrics-addr", std::to_string(port)});
  d.Start();
  Process p(Helper(d, With(kData, {"save-steps", "--steps-list", "1,2,3,4", "--changed-bytes", "4096"})), dir.path(),
            "save");
  REQUIRE(p.Wait() == 0);
  INFO(p.Stdout() << d.Log());
  CHECK(Metric(port, "ckptd_frozen_skipped_bytes_total") == 3 * kFrozenBytes);
  // Each snapshot fit beside the hot copy of the step before: none was evicted for room.
  CHECK_FALSE(Contains(d.Log(), "evicted from memory"));
  // Idle, the newest step's hot copy: its own 4 MiB and the frozen block's 4 MiB, once.
  const double used = Metric(port, "ckptd_staging_bytes\\{state=\"used\"\\}");
  CHECK(used >= 8 << 20);
  CHECK(used < (8 << 20) + (64 << 10));
  CheckRestores(d, dir, 4, "memory", false);
}
