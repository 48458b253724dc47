// Copy-on-write snapshots against a real userfaultfd: a "trainer" thread writes to its
// mapping of a memfd while the copy runs from a second mapping, as ckptd's does.
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <catch2/catch.hpp>

#include <atomic>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "common/unique_fd.h"
#include "daemon/staging/cow_copy.h"

using ckpt::UniqueFd;
using ckpt::daemon::CowCopy;
using ckpt::daemon::WriteProtector;

namespace {

constexpr size_t kBytes = 64u << 20;
constexpr size_t kChunk = 1u << 20;

// One memfd mapped twice: the trainer's view (registered) and ckptd's.
struct Arena {
  UniqueFd fd{::memfd_create("cow-test", MFD_CLOEXEC)};
  char* trainer = nullptr;
  char* daemon = nullptr;
  Arena() {
    REQUIRE(::ftruncate(fd.get(), kBytes) == 0);
    trainer = static_cast<char*>(::mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0));
    daemon = static_cast<char*>(::mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0));
    REQUIRE(trainer != MAP_FAILED);
    REQUIRE(daemon != MAP_FAILED);
    for (size_t i = 0; i < kBytes; i += 8) std::memcpy(trainer + i, &i, 8);
  }
  ~Arena() {
    ::munmap(trainer, kBytes);
    ::munmap(daemon, kBytes);
  }
  uint64_t at(size_t offset) const { return reinterpret_cast<uint64_t>(trainer) + offset; }
};

// A userfaultfd of this process; user-mode faults only, which needs no privilege.
WriteProtector Protector() {
  UniqueFd uffd(static_cast<int>(::syscall(SYS_userfaultfd, O_CLOEXEC | UFFD_USER_MODE_ONLY)));
  REQUIRE(uffd.valid());
  auto protector = WriteProtector::Create(std::move(uffd));
  REQUIRE(protector.ok());
  return std::move(*protector);
}

bool HoldsOriginal(const char* data, size_t begin, size_t bytes) {
  for (size_t i = begin; i < begin + bytes; i += 8) {
    uint64_t v;
    std::memcpy(&v, data + i - begin, 8);
    if (v != i) return false;
  }
  return true;
}

}  // namespace

TEST_CASE("a copy-on-write snapshot holds the bytes of the moment it was protected") {
  Arena arena;
  WriteProtector protector = Protector();
  REQUIRE(protector.Register(arena.at(0), kBytes).ok());
  // Two tensors, one crossing chunk boundaries at odd offsets, and a gap between them.
  std::vector<char> staging(40u << 20);
  const size_t a_begin = 4096 + 24, a_bytes = (20u << 20) + 8, b_begin = 30u << 20, b_bytes = 19u << 20;
  CowCopy copy(protector,
               {{arena.at(a_begin), a_bytes, arena.daemon + a_begin, staging.data()},
                {arena.at(b_begin), b_bytes, arena.daemon + b_begin, staging.data() + a_bytes}},
               kChunk);
  REQUIRE(copy.Protect().ok());
  // The trainer starts writing at once, from the end backwards (against the copy's order),
  // and one of its writes is already waiting on the last chunk when the copy starts.
  std::atomic<bool> wrote_first{false};
  std::thread trainer([&] {
    std::memset(arena.trainer + b_begin + b_bytes - 64, 0xEE, 64);
    wrote_first = true;
    for (size_t i = kBytes; i >= 4096; i -= 4096) std::memset(arena.trainer + i - 4096, 0xAB, 4096);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK_FALSE(wrote_first.load());  // it waits on its protected page
  REQUIRE(copy.Run().ok());
  trainer.join();
  CHECK(copy.faulted() >= 1);
  CHECK(HoldsOriginal(staging.data(), a_begin, a_bytes));
  CHECK(HoldsOriginal(staging.data() + a_bytes, b_begin, b_bytes));
  // The trainer's writes all landed, and nothing is protected any more.
  for (size_t i = 0; i < kBytes; i += 4096) REQUIRE(static_cast<unsigned char>(arena.trainer[i]) == 0xAB);
  std::memset(arena.trainer, 1, kBytes);
}

TEST_CASE("a copy-on-write snapshot with nobody writing copies everything and protects nothing after") {
  Arena arena;
  WriteProtector protector = Protector();
  REQUIRE(protector.Register(arena.at(0), kBytes).ok());
  std::vector<char> staging(kBytes);
  CowCopy copy(protector, {{arena.at(0), kBytes, arena.daemon, staging.data()}}, kChunk);
  REQUIRE(copy.Protect().ok());
  REQUIRE(copy.Run().ok());
  CHECK(copy.chunks() == kBytes / kChunk);
  CHECK(HoldsOriginal(staging.data(), 0, kBytes));
  std::memset(arena.trainer, 2, kBytes);  // would hang if a page were still protected
  CHECK(arena.daemon[kBytes - 1] == 2);
}

TEST_CASE("a region outside the registered arenas is refused before anything is protected") {
  Arena arena;
  WriteProtector protector = Protector();
  REQUIRE(protector.Register(arena.at(0), kBytes / 2).ok());
  std::vector<char> staging(kBytes);
  CowCopy copy(protector, {{arena.at(kBytes / 2 - 4096), 8192, arena.daemon, staging.data()}}, kChunk);
  CHECK_FALSE(copy.Protect().ok());
  std::memset(arena.trainer, 3, kBytes);  // nothing protected
}

TEST_CASE("only a userfaultfd is taken for write-protection") {
  UniqueFd memfd(::memfd_create("not-uffd", MFD_CLOEXEC));
  auto refused = WriteProtector::Create(std::move(memfd));
  REQUIRE_FALSE(refused.ok());
  CHECK(std::string(refused.status().message()).find("not a userfaultfd") != std::string::npos);
  // A handshake already done (by a trainer that wants features of its own) is refused too.
  UniqueFd uffd(static_cast<int>(::syscall(SYS_userfaultfd, O_CLOEXEC | UFFD_USER_MODE_ONLY)));
  REQUIRE(uffd.valid());
  uffdio_api api{UFFD_API, 0, 0};
  REQUIRE(::ioctl(uffd.get(), UFFDIO_API, &api) == 0);
  CHECK_FALSE(WriteProtector::Create(std::move(uffd)).ok());
}

TEST_CASE("a trainer waiting on a protected page is released when ckptd's descriptor closes") {
  // What happens when ckptd dies mid-snapshot: the kernel drops the registration and wakes
  // every waiting thread, so the trainer never hangs on a dead daemon.
  Arena arena;
  auto protector = std::make_unique<WriteProtector>(Protector());
  REQUIRE(protector->Register(arena.at(0), kBytes).ok());
  std::vector<char> staging(kBytes);
  auto copy = std::make_unique<CowCopy>(*protector, std::vector<CowCopy::Region>{
                                                        {arena.at(0), kBytes, arena.daemon, staging.data()}},
                                        kChunk);
  REQUIRE(copy->Protect().ok());
  std::atomic<bool> wrote{false};
  std::thread trainer([&] {
    std::memset(arena.trainer, 7, kBytes);
    wrote = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK_FALSE(wrote.load());
  copy.reset();
  protector.reset();  // the descriptor closes, as when ckptd is killed
  trainer.join();
  CHECK(wrote.load());
  CHECK(arena.daemon[kBytes - 1] == 7);
}
