// Every shard ckptd writes opens with the stock `safetensors` Python library and holds
// exactly the bytes the trainer registered.
#include <catch2/catch.hpp>

#include <cstdlib>
#include <filesystem>

#include "tests/integration/common.h"

using namespace ckpt::testing;

TEST_CASE("stock safetensors opens every shard and sees the registered tensors") {
  const char* python = std::getenv("CKPTD_PYTHON");
  REQUIRE(python != nullptr);  // the test command sets it to the venv with safetensors
  TempDir dir;
  Daemon d(dir);
  d.Start();
  std::filesystem::create_directories(dir / "dump0");
  std::filesystem::create_directories(dir / "dump1");
  Process r0(Helper(d, {"--job", "st", "--rank", "0", "--world-size", "2", "--seed", "7", "--bytes",
                        "3000000", "save", "--step", "5", "--wait-committed", "--dump", dir / "dump0"}),
             dir.path(), "r0");
  Process r1(Helper(d, {"--job", "st", "--rank", "1", "--world-size", "2", "--seed", "8", "--bytes",
                        "3000000", "save", "--step", "5", "--wait-committed", "--dump", dir / "dump1"}),
             dir.path(), "r1");
  REQUIRE(r0.Wait() == 0);
  REQUIRE(r1.Wait() == 0);
  auto r = Run({python, Runfile("tests/integration/check_safetensors.py"), d.root() + "/st/step-00000005",
                dir / "dump0", dir / "dump1"},
               dir.path());
  INFO(r.out << r.err);
  CHECK(r.exit_code == 0);
  CHECK(Contains(r.out, "rank 0: 5 tensors match"));
  CHECK(Contains(r.out, "rank 1: 5 tensors match"));
}
