#include "shm/sweep.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <string>

#include "shm/segment.h"

namespace ckpt::shm {
namespace {

// Segment::Create keeps a shared lock on every segment while its creator holds it.
bool HeldByItsCreator(const std::filesystem::path& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  bool held = ::flock(fd, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK;
  ::close(fd);
  return held;
}

}  // namespace

int RemoveStaleSegments(std::string_view prefix, std::chrono::seconds min_age) {
  const auto now = std::filesystem::file_time_type::clock::now();
  int removed = 0;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", ec)) {
    std::string name = entry.path().filename().string();
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    size_t dot = name.find('.', prefix.size());
    if (dot == std::string::npos) continue;
    long pid = std::strtol(name.substr(prefix.size(), dot - prefix.size()).c_str(), nullptr, 10);
    if (pid <= 0) continue;
    std::error_code age_ec;
    auto modified = std::filesystem::last_write_time(entry.path(), age_ec);
    if (age_ec || now - modified < min_age) continue;
    if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH && !HeldByItsCreator(entry.path())) {
      Segment::Unlink("/" + name);
      ++removed;
    }
  }
  return removed;
}

}  // namespace ckpt::shm
