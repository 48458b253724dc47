#include "daemon/staging/write_protector.h"

#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace ckpt::daemon {
namespace {

absl::Status Errno(const std::string& what) {
  return absl::FailedPreconditionError(fmt::format("{}: {}", what, std::strerror(errno)));
}

}  // namespace

absl::Status WriteProtector::CheckReceivable(int fd) {
  std::error_code ec;
  std::string target = std::filesystem::read_symlink(fmt::format("/proc/self/fd/{}", fd), ec);
  if (ec || target != "anon_inode:[userfaultfd]") {
    return absl::InvalidArgumentError(fmt::format(
        "the descriptor handed over for write-protection is not a userfaultfd ({})",
        ec ? ec.message() : target));
  }
  return absl::OkStatus();
}

absl::StatusOr<WriteProtector> WriteProtector::Create(UniqueFd uffd) {
  if (absl::Status ok = CheckReceivable(uffd.get()); !ok.ok()) return ok;
  // Reads of fault messages must never block the copy: poll, then read.
  int flags = ::fcntl(uffd.get(), F_GETFL);
  if (flags < 0 || ::fcntl(uffd.get(), F_SETFL, flags | O_NONBLOCK) != 0) {
    return Errno("userfaultfd O_NONBLOCK");
  }
  uffdio_api api{};
  api.api = UFFD_API;
  api.features = UFFD_FEATURE_WP_HUGETLBFS_SHMEM;
  if (::ioctl(uffd.get(), UFFDIO_API, &api) != 0) {
    return Errno("UFFDIO_API (this kernel cannot write-protect shared memory, or the "
                 "handshake was already done)");
  }
  if ((api.features & UFFD_FEATURE_WP_HUGETLBFS_SHMEM) == 0) {
    return absl::FailedPreconditionError(
        "this kernel cannot write-protect shared memory (Linux 5.19 or later can)");
  }
  return WriteProtector(std::move(uffd));
}

bool WriteProtector::MapsArena(int pid, uint64_t begin, uint64_t bytes, uint64_t inode) {
  std::ifstream maps(fmt::format("/proc/{}/maps", pid));
  std::string line;
  while (std::getline(maps, line)) {
    // "start-end perms offset dev inode path"
    std::istringstream fields(line);
    std::string range, perms, offset, dev;
    uint64_t ino = 0;
    if (!(fields >> range >> perms >> offset >> dev >> ino)) continue;
    size_t dash = range.find('-');
    if (dash == std::string::npos) continue;
    uint64_t start = std::stoull(range.substr(0, dash), nullptr, 16);
    uint64_t end = std::stoull(range.substr(dash + 1), nullptr, 16);
    if (start != begin) continue;
    return end - start == bytes && ino == inode && std::stoull(offset, nullptr, 16) == 0 &&
           perms.size() >= 4 && perms[3] == 's';
  }
  return false;
}

absl::Status WriteProtector::Register(uint64_t trainer_begin, uint64_t bytes) {
  uffdio_register reg{};
  reg.range = {trainer_begin, bytes};
  reg.mode = UFFDIO_REGISTER_MODE_WP;
  if (::ioctl(uffd_.get(), UFFDIO_REGISTER, &reg) != 0) {
    return Errno(fmt::format("registering the trainer's arena at {:#x} ({} bytes)",
                             trainer_begin, bytes));
  }
  if ((reg.ioctls & (uint64_t{1} << _UFFDIO_WRITEPROTECT)) == 0) {
    return absl::FailedPreconditionError(fmt::format(
        "the trainer's arena at {:#x} cannot be write-protected by this kernel", trainer_begin));
  }
  ranges_.push_back({trainer_begin, bytes});
  return absl::OkStatus();
}

absl::Status WriteProtector::Set(uint64_t begin, uint64_t bytes, bool protect) {
  uffdio_writeprotect wp{};
  wp.range = {begin, bytes};
  wp.mode = protect ? UFFDIO_WRITEPROTECT_MODE_WP : 0;
  if (::ioctl(uffd_.get(), UFFDIO_WRITEPROTECT, &wp) != 0) {
    return Errno(fmt::format("{} {:#x}+{}", protect ? "write-protecting" : "releasing", begin, bytes));
  }
  return absl::OkStatus();
}

absl::Status WriteProtector::Protect(uint64_t begin, uint64_t bytes) { return Set(begin, bytes, true); }

absl::Status WriteProtector::Release(uint64_t begin, uint64_t bytes) { return Set(begin, bytes, false); }

void WriteProtector::Wake(uint64_t begin, uint64_t bytes) {
  uffdio_range range{begin, bytes};
  ::ioctl(uffd_.get(), UFFDIO_WAKE, &range);  // nothing waits: nothing to do
}

std::optional<uint64_t> WriteProtector::NextFault(std::chrono::milliseconds wait) {
  while (true) {
    uffd_msg msg;
    ssize_t got = ::read(uffd_.get(), &msg, sizeof msg);
    if (got == static_cast<ssize_t>(sizeof msg)) {
      if (msg.event == UFFD_EVENT_PAGEFAULT) return uint64_t{msg.arg.pagefault.address};
      continue;  // no other events were asked for
    }
    if (got < 0 && errno == EINTR) continue;
    if (got < 0 && errno != EAGAIN) return std::nullopt;  // the trainer is gone
    pollfd p{uffd_.get(), POLLIN, 0};
    int ready = ::poll(&p, 1, static_cast<int>(wait.count()));
    if (ready <= 0 || (p.revents & POLLIN) == 0) return std::nullopt;
    wait = std::chrono::milliseconds(0);
  }
}

}  // namespace ckpt::daemon
