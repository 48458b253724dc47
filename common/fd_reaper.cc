#include "common/fd_reaper.h"

#include <sys/socket.h>
#include <sys/stat.h>

namespace ckpt {
namespace {

// A socket is closed at once, with a reset, whatever linger its sender set.
void NoLinger(int fd) {
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) return;
  linger off{1, 0};
  (void)::setsockopt(fd, SOL_SOCKET, SO_LINGER, &off, sizeof off);
}

}  // namespace

FdReaper::FdReaper(size_t max_queued) : max_queued_(max_queued), thread_([this] { Loop(); }) {}

FdReaper::~FdReaper() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

bool FdReaper::Dispose(std::vector<UniqueFd> fds) {
  for (const UniqueFd& fd : fds) NoLinger(fd.get());
  std::unique_lock lock(mu_);
  if (queue_.size() + fds.size() > max_queued_) return false;
  for (UniqueFd& fd : fds) queue_.push_back(std::move(fd));
  lock.unlock();
  wake_.notify_one();
  return true;
}

size_t FdReaper::queued() const {
  std::lock_guard lock(mu_);
  return queue_.size();
}

void FdReaper::Loop() {
  std::unique_lock lock(mu_);
  while (true) {
    wake_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, and everything is closed
    UniqueFd fd = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    fd.reset();  // may block: nobody waits for it
    lock.lock();
  }
}

}  // namespace ckpt
