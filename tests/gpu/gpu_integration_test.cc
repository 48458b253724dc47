// The CUDA data path end to end on a real GPU: IPC registration of many buffers in one
// allocation, ordering against queued device work, restore into fresh allocations, and a
// trainer SIGKILLed while ckptd holds its handles. Skipped (and counted so) without a GPU.
#include <signal.h>

#include <catch2/catch.hpp>

#include <iostream>

#include "cuda/device.h"
#include "tests/integration/common.h"

using namespace ckpt::testing;

TEST_CASE("GPU buffers: the checkpoint holds exactly the pre-snapshot state; restore is exact") {
  if (!ckpt::cuda::DetectDevices().available()) {
    std::cout << "SKIPPED: no CUDA device (" << ckpt::cuda::DetectDevices().reason << ")\n";
    return;
  }
  TempDir dir;
  Daemon d(dir, {"--staging-bytes", "2G"});
  d.Start();
  auto trainer = [&](std::vector<std::string> args) {
    std::vector<std::string> argv = {Runfile("tests/gpu/gpu_trainer"), "--socket", d.socket()};
    argv.insert(argv.end(), args.begin(), args.end());
    return argv;
  };
  auto save = Run(trainer({"--mode", "save", "--job", "g"}), dir.path());
  INFO(save.out << save.err << d.Log());
  REQUIRE(save.exit_code == 0);
  auto hot = Run(trainer({"--mode", "check", "--job", "g"}), dir.path());
  INFO(hot.out);
  CHECK(Contains(hot.out, "match source=memory"));
  // Unregister and register again (a new process, new allocations): works, restores exactly.
  auto again = Run(trainer({"--mode", "check", "--job", "g"}), dir.path());
  CHECK(Contains(again.out, "match"));
  REQUIRE(d.Stop() == 0);
  d.Start();
  auto cold = Run(trainer({"--mode", "check", "--job", "g"}), dir.path());
  CHECK(Contains(cold.out, "match source=disk"));

  // A snapshot every step, the CPU far ahead of the GPU, only GPU-side waits: no hang.
  auto ahead = Run(trainer({"--mode", "run-ahead", "--job", "ahead"}), dir.path());
  INFO(ahead.out << ahead.err << d.Log());
  CHECK(ahead.exit_code == 0);
  CHECK(Contains(ahead.out, "run-ahead drained"));

  // A trainer killed while ckptd has its allocations open.
  Process dying(trainer({"--mode", "save", "--job", "k", "--die-after-staged"}), dir.path(), "die");
  CHECK(dying.Wait() == 128 + SIGKILL);
  CHECK(Contains(dying.Stdout(), "staged"));
  // Its staged step is still written and committed; a restore takes committed steps only,
  // and the run-ahead job's writes may still be queued ahead of it.
  CHECK(d.Ctl({"--job", "k", "wait", "1", "--timeout", "60", "--quiet"}).exit_code == 0);
  auto after = Run(trainer({"--mode", "check", "--job", "k"}), dir.path());
  INFO(after.out << d.Log());
  CHECK(Contains(after.out, "match"));
  CHECK(d.Ctl({"status"}).exit_code == 0);  // the daemon is fine

  // The host-copy transport (no CUDA IPC): same guarantees through the trainer's mirrors.
  auto hc = Run(trainer({"--mode", "save", "--job", "hc", "--transport", "host-copy"}), dir.path());
  INFO(hc.out << hc.err);
  CHECK(hc.exit_code == 0);
  auto hc_check = Run(trainer({"--mode", "check", "--job", "hc", "--transport", "host-copy"}), dir.path());
  CHECK(Contains(hc_check.out, "match"));
}
