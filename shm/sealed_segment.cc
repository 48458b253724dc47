#include "shm/sealed_segment.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <string>

#include "common/status.h"

namespace ckpt::shm {
namespace {

constexpr int kSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;

absl::Status Errno(int err, const std::string& what) {
  return absl::InternalError(fmt::format("{}: {}", what, std::strerror(err)));
}

}  // namespace

size_t HugePageSize() {
  static const size_t size = [] {
    std::ifstream meminfo("/proc/meminfo");
    std::string key;
    size_t kib = 0;
    while (meminfo >> key) {
      if (key == "Hugepagesize:" && (meminfo >> kib)) return kib << 10;
      meminfo.ignore(1 << 10, '\n');
    }
    return size_t{0};
  }();
  return size;
}

bool IsHugeTlb(int fd) {
  struct statfs fs;
  return ::fstatfs(fd, &fs) == 0 && fs.f_type == HUGETLBFS_MAGIC;
}

absl::StatusOr<std::unique_ptr<SealedSegment>> SealedSegment::Create(const std::string& debug_name,
                                                                     size_t size) {
  return CreateWith(debug_name, size, /*huge=*/false);
}

absl::StatusOr<std::unique_ptr<SealedSegment>> SealedSegment::CreateHuge(const std::string& debug_name,
                                                                         size_t size) {
  const size_t page = HugePageSize();
  if (page == 0) return absl::UnavailableError("this kernel has no huge pages");
  if (size % page != 0) {
    return absl::InvalidArgumentError(
        fmt::format("{} bytes is not a multiple of the huge page size ({})", size, page));
  }
  return CreateWith(debug_name, size, /*huge=*/true);
}

absl::StatusOr<std::unique_ptr<SealedSegment>> SealedSegment::CreateWith(const std::string& debug_name,
                                                                         size_t size, bool huge) {
  if (size == 0) return absl::InvalidArgumentError("sealed segment of size 0");
  const unsigned flags = MFD_CLOEXEC | MFD_ALLOW_SEALING | (huge ? MFD_HUGETLB : 0u);
  UniqueFd fd(::memfd_create(debug_name.c_str(), flags));
  if (!fd.valid()) {
    // No hugetlbfs in this kernel, or memfds may not use it: the caller falls back.
    if (huge) return absl::UnavailableError(fmt::format("no huge-page memfd: {}", std::strerror(errno)));
    return Errno(errno, "memfd_create " + debug_name);
  }
  if (::ftruncate(fd.get(), static_cast<off_t>(size)) != 0) return Errno(errno, "ftruncate memfd");
  // Reserving every page now makes a full filesystem (or an empty huge-page pool) an error
  // here instead of a SIGBUS on first touch.
  if (int err = ::posix_fallocate(fd.get(), 0, static_cast<off_t>(size)); err != 0) {
    if (err == ENOSPC || err == ENOMEM) {
      return absl::ResourceExhaustedError(
          huge ? fmt::format("the huge-page pool has no room for {} ({} bytes; see vm.nr_hugepages)",
                             debug_name, size)
               : fmt::format("no memory left in the shared-memory filesystem for {} ({} bytes)",
                             debug_name, size));
    }
    return Errno(err, "reserve memfd " + debug_name);
  }
  if (::fcntl(fd.get(), F_ADD_SEALS, kSeals) != 0) return Errno(errno, "seal memfd " + debug_name);
  void* data = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (data == MAP_FAILED) return Errno(errno, "mmap memfd " + debug_name);
  return std::unique_ptr<SealedSegment>(new SealedSegment(std::move(fd), data, size, huge));
}

absl::Status SealedSegment::CheckReceivable(int fd) {
  int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
    return absl::FailedPreconditionError(
        "the descriptor received is not shared memory sealed against shrinking (a memfd "
        "with F_SEAL_SHRINK, as the ckptd client makes)");
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) return Errno(errno, "fstat received memfd");
  if (st.st_size <= 0) return absl::FailedPreconditionError("the shared memory received is empty");
  if (static_cast<uint64_t>(st.st_blocks) * 512 < static_cast<uint64_t>(st.st_size)) {
    return absl::FailedPreconditionError(fmt::format(
        "the shared memory received is not fully allocated ({} of {} bytes): create it with "
        "its space reserved (posix_fallocate), as the ckptd client does",
        static_cast<uint64_t>(st.st_blocks) * 512, st.st_size));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<SealedSegment>> SealedSegment::Map(UniqueFd fd) {
  CKPT_RETURN_IF_ERROR(CheckReceivable(fd.get()));
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return Errno(errno, "fstat received memfd");
  auto size = static_cast<size_t>(st.st_size);  // sealed: it cannot shrink below this now
  const bool huge = IsHugeTlb(fd.get());
  // hugetlbfs maps whole pages only; its size is always a multiple of the page (a hugetlbfs
  // file cannot be truncated to anything else), so the mapping covers it exactly.
  void* data = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (data == MAP_FAILED) return Errno(errno, "mmap received memfd");
  return std::unique_ptr<SealedSegment>(new SealedSegment(std::move(fd), data, size, huge));
}

SealedSegment::~SealedSegment() { ::munmap(data_, size_); }

}  // namespace ckpt::shm
