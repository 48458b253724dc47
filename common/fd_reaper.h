// Closes descriptors that came from an untrusted process, off the caller's thread. Closing
// one can block for as long as its sender likes: a socket with unsent data and a long
// SO_LINGER, a file on a FUSE mount whose server never answers the flush. A thread that
// serves requests must never wait for that, so it hands such descriptors here. Sockets
// are told not to linger first (their close is then immediate, with a reset), so only
// files of a hostile filesystem can keep the reaper's one thread waiting; what queues up
// behind it meanwhile is bounded by `max_queued`, beyond which Dispose() says no.
#pragma once

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "common/unique_fd.h"

namespace ckpt {

class FdReaper {
 public:
  explicit FdReaper(size_t max_queued = 4096);
  ~FdReaper();
  FdReaper(const FdReaper&) = delete;
  FdReaper& operator=(const FdReaper&) = delete;

  // Takes the descriptors and closes them later. False when the queue is full: the reaper
  // is stuck on a close, and the caller should stop taking descriptors from untrusted
  // peers (they are closed here all the same, on the caller's thread).
  bool Dispose(std::vector<UniqueFd> fds);
  size_t queued() const;

 private:
  void Loop();

  const size_t max_queued_;
  mutable std::mutex mu_;
  std::condition_variable wake_;
  std::deque<UniqueFd> queue_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace ckpt
