// What copy-on-write snapshots cost per page size (issue 10): for one arena, a plain copy
// (the memcpy limit, measured here in the same run), and a copy-on-write snapshot through
// ckptd's own WriteProtector and CowCopy: the write-protection call, the copy with nobody
// writing, then what the trainer's first pass of writes over the arena costs after the
// copy has released it, against the same pass once more. Base pages (memfd) and huge pages
// (hugetlbfs; skipped with a note when the pool cannot hold the arena).
//
//   bazel run -c opt //tests/bench:cow_bench -- [--mib 2600] [--json]
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstring>
#include <vector>

#include "common/unique_fd.h"
#include "daemon/staging/cow_copy.h"
#include "shm/sealed_segment.h"

namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// One pass of writes, a cache line at a time, as an optimizer writes its state.
double WritePass(char* p, size_t bytes, char value) {
  auto start = Clock::now();
  for (size_t i = 0; i < bytes; i += 64) p[i] = value;
  return Since(start);
}

nlohmann::json Measure(bool huge, size_t bytes) {
  nlohmann::json r = {{"pages", huge ? "huge" : "base"}};
  ckpt::UniqueFd fd(::memfd_create("cow-bench", MFD_CLOEXEC | (huge ? MFD_HUGETLB : 0u)));
  if (!fd.valid() || ::ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0 ||
      ::posix_fallocate(fd.get(), 0, static_cast<off_t>(bytes)) != 0) {
    r["skipped"] = "no room for the arena (huge pages: see vm.nr_hugepages)";
    return r;
  }
  auto map = [&] {
    return static_cast<char*>(::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd.get(), 0));
  };
  char* trainer = map();
  char* daemon = map();
  std::vector<char> staging(bytes);
  std::memset(trainer, 1, bytes);
  std::memset(staging.data(), 0, bytes);
  std::memcpy(staging.data(), daemon, bytes);  // the same pass once untimed: caches, TLBs
  auto start = Clock::now();
  std::memcpy(staging.data(), daemon, bytes);
  r["copy_s"] = Since(start);
  ckpt::UniqueFd uffd(static_cast<int>(::syscall(SYS_userfaultfd, O_CLOEXEC | UFFD_USER_MODE_ONLY)));
  auto protector = ckpt::daemon::WriteProtector::Create(std::move(uffd));
  if (!protector.ok() || !protector->Register(reinterpret_cast<uint64_t>(trainer), bytes).ok()) {
    r["skipped"] = "no userfaultfd write-protection here";
    return r;
  }
  ckpt::daemon::CowCopy copy(*protector, {{reinterpret_cast<uint64_t>(trainer), bytes, daemon, staging.data()}},
                             std::max<uint64_t>(4u << 20, ckpt::shm::HugePageSize()));
  start = Clock::now();
  if (!copy.Protect().ok()) {
    r["skipped"] = "write-protection refused";
    return r;
  }
  r["protect_s"] = Since(start);
  start = Clock::now();
  (void)copy.Run();
  r["cow_copy_s"] = Since(start);
  r["first_writes_after_s"] = WritePass(trainer, bytes, 2);
  r["writes_again_s"] = WritePass(trainer, bytes, 3);
  ::munmap(trainer, bytes);
  ::munmap(daemon, bytes);
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"copy-on-write snapshot costs per page size"};
  size_t mib = 2600;
  bool json = false;
  app.add_option("--mib", mib, "arena size");
  app.add_flag("--json", json);
  CLI11_PARSE(app, argc, argv);
  const size_t page = ckpt::shm::HugePageSize();
  const size_t bytes = (mib << 20) / page * page;
  nlohmann::json out = {{"bytes", bytes}, {"runs", {Measure(false, bytes), Measure(true, bytes)}}};
  if (json) {
    fmt::print("{}\n", out.dump(2));
    return 0;
  }
  fmt::print("{:.2f} GiB arena\n{:6} {:>8} {:>9} {:>9} {:>14} {:>12}\n", bytes / double(1 << 30), "pages",
             "copy", "protect", "cow copy", "writes after", "writes again");
  for (const auto& r : out["runs"]) {
    if (r.contains("skipped")) {
      fmt::print("{:6} skipped: {}\n", r["pages"].get<std::string>(), r["skipped"].get<std::string>());
      continue;
    }
    fmt::print("{:6} {:7.3f}s {:8.4f}s {:8.3f}s {:13.3f}s {:11.3f}s\n", r["pages"].get<std::string>(),
               r["copy_s"].get<double>(), r["protect_s"].get<double>(), r["cow_copy_s"].get<double>(),
               r["first_writes_after_s"].get<double>(), r["writes_again_s"].get<double>());
  }
  return 0;
}
