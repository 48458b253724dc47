// A trainer that truncates its shared memory after registering it must not kill ckptd: the
// copies that touch it fail, alone.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "common/fault_guard.h"
#include "common/status.h"
#include "cuda/copy_engine.h"
#include "common/unique_fd.h"

using namespace ckpt;

namespace {

constexpr size_t kBytes = 4 << 20;

// Shared memory mapped here, then shrunk to nothing behind the mapping's back (an unsealed
// memfd: what ckptd refuses, and what its guard must survive all the same).
struct TruncatedMemory {
  void* mapping = nullptr;
  TruncatedMemory() {
    UniqueFd fd(::memfd_create("ckpt-test-trunc", MFD_CLOEXEC));
    REQUIRE(fd.valid());
    REQUIRE(::ftruncate(fd.get(), kBytes) == 0);
    mapping = ::mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
    REQUIRE(mapping != MAP_FAILED);
    REQUIRE(::ftruncate(fd.get(), 0) == 0);
  }
  ~TruncatedMemory() { ::munmap(mapping, kBytes); }
  void* data() const { return mapping; }
};

std::unique_ptr<TruncatedMemory> TruncatedSegment() { return std::make_unique<TruncatedMemory>(); }

}  // namespace

TEST_CASE("a copy from or into memory truncated under it fails instead of killing the process") {
  auto segment = TruncatedSegment();
  std::vector<char> local(kBytes, 'x');
  CHECK_FALSE(GuardedMemcpy(local.data(), segment->data(), kBytes));
  CHECK_FALSE(GuardedMemcpy(segment->data(), local.data(), kBytes));
  // The guard is per copy: the next one works, and faults again where it should.
  std::vector<char> other(kBytes);
  CHECK(GuardedMemcpy(other.data(), local.data(), kBytes));
  CHECK(other == local);
  CHECK_FALSE(GuardedMemcpy(local.data(), segment->data(), 16));
}

TEST_CASE("the host copy engine reports a truncated source as an error of that copy") {
  auto segment = TruncatedSegment();
  auto engine = cuda::MakeHostCopyEngine(2);
  std::vector<char> a(kBytes), b(kBytes, 'y'), c(kBytes);
  std::vector<cuda::CopyRegion> regions = {{a.data(), b.data(), kBytes},
                                           {c.data(), segment->data(), kBytes}};
  absl::Status copied = engine->Copy(regions, nullptr);
  REQUIRE_FALSE(copied.ok());
  CHECK(Message(copied).find("truncated") != std::string::npos);
  // The engine and its worker threads carry on.
  std::vector<cuda::CopyRegion> fine = {{a.data(), b.data(), kBytes}};
  REQUIRE(engine->Copy(fine, nullptr).ok());
  CHECK(a == b);
}
