#include "shm/sweep.h"

#include <signal.h>

#include <cerrno>
#include <filesystem>
#include <string>

#include "shm/segment.h"

namespace ckpt::shm {

int RemoveStaleSegments(std::string_view prefix) {
  int removed = 0;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", ec)) {
    std::string name = entry.path().filename().string();
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    size_t dot = name.find('.', prefix.size());
    if (dot == std::string::npos) continue;
    long pid = std::strtol(name.substr(prefix.size(), dot - prefix.size()).c_str(), nullptr, 10);
    if (pid <= 0) continue;
    if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
      Segment::Unlink("/" + name);
      ++removed;
    }
  }
  return removed;
}

}  // namespace ckpt::shm
