// CUDA found at run time (issue 45): ckptd links nothing of CUDA and loads the driver
// (libcuda.so.1) when it starts. Without a driver, with one too old for it, or with one that
// cannot initialise, it says so in one sentence naming what it found and what it needs, and
// serves every trainer on the host path. A fake driver (tests/fakes/fake_cuda) stands in for
// the versions on this machine without a GPU.
#include <dlfcn.h>

#include <catch2/catch.hpp>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "tests/integration/common.h"

using namespace ckpt::testing;
namespace fs = std::filesystem;

namespace {

// Starts ckptd with the fake driver of `version` (cuInit answering `init`) first on its
// library path, checks its log says `said`, and that a trainer saves and restores through it.
void CheckWithFakeDriver(int version, int init, const std::string& said) {
  const std::string lib_dir = fs::path(Runfile("tests/fakes/fake_cuda/libcuda.so.1")).parent_path();
  const char* old_path = std::getenv("LD_LIBRARY_PATH");
  const std::string saved_path = old_path ? old_path : "";
  ::setenv("LD_LIBRARY_PATH", lib_dir.c_str(), 1);
  ::setenv("FAKE_CUDA_VERSION", std::to_string(version).c_str(), 1);
  ::setenv("FAKE_CUDA_INIT", std::to_string(init).c_str(), 1);
  TempDir dir;
  Daemon d(dir);
  d.Start();
  if (old_path != nullptr) {
    ::setenv("LD_LIBRARY_PATH", saved_path.c_str(), 1);
  } else {
    ::unsetenv("LD_LIBRARY_PATH");
  }
  INFO(d.Log());
  CHECK(Contains(d.Log(), said));
  CHECK(Contains(d.Log(), "host copy engine only, GPU tensors refused"));
  RunResult saved = Run(Helper(d, {"--job", "fake", "save", "--step", "3", "--wait-committed"}), dir.path());
  INFO(saved.out << saved.err);
  CHECK(saved.exit_code == 0);
  RunResult restored = Run(Helper(d, {"--job", "fake", "check"}), dir.path());
  INFO(restored.out << restored.err);
  CHECK(restored.exit_code == 0);
  CHECK(Contains(restored.out, "restored step=3"));
  CHECK(d.Stop() == 0);
}

}  // namespace

TEST_CASE("no CUDA driver: ckptd says so and serves on the host path") {
  if (void* real = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL)) {
    ::dlclose(real);
    std::puts("SKIPPED: this machine has a CUDA driver (libcuda.so.1 loads)");
    return;
  }
  TempDir dir;
  Daemon d(dir);
  d.Start();
  INFO(d.Log());
  CHECK(Contains(d.Log(), "CUDA: no usable device (no CUDA driver on this machine (libcuda.so.1:"));
  CHECK(d.Stop() == 0);
}

TEST_CASE("a CUDA driver too old for ckptd: the sentence names the one found and the one needed") {
  CheckWithFakeDriver(11040, 0,
                      "the CUDA driver supports CUDA 11.4; ckptd needs a driver for CUDA 12.0 or newer (R525 (CUDA "
                      "12.0))");
}

TEST_CASE("a CUDA driver that cannot initialise (no device): ckptd names its answer") {
  CheckWithFakeDriver(12040, 100, "the CUDA driver (CUDA 12.4) did not initialise: CUresult 100 (no CUDA device)");
}

TEST_CASE("a CUDA driver without an entry point ckptd uses: ckptd names it") {
  CheckWithFakeDriver(12080, 0, "the CUDA driver has no cuGetErrorName at CUDA 12.0's ABI");
}
