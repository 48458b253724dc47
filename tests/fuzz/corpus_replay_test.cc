// Replays a fuzz target's seed corpus (tests/fuzz/corpus/<target>/) through its
// LLVMFuzzerTestOneInput, built with the ordinary toolchain in `bazel test //...`.
// Two jobs: every crash once found and added to the corpus stays a regression test on
// every build, and a fuzz target that no longer compiles fails the main build rather
// than only the clang-only fuzzing step.
#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

TEST_CASE("every input in the seed corpus runs through the fuzz target") {
  const std::filesystem::path corpus = CKPTD_FUZZ_CORPUS;
  REQUIRE(std::filesystem::is_directory(corpus));
  int replayed = 0;
  for (const auto& entry : std::filesystem::directory_iterator(corpus)) {
    std::ifstream in(entry.path(), std::ios::binary);
    std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    INFO(entry.path().filename().string());
    CHECK(LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()) == 0);
    ++replayed;
  }
  CHECK(replayed > 0);
}
