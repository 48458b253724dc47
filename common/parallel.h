// Runs up to N jobs at once on threads of their own, for I/O that waits on something
// else (a store's answer): the S3 store's parts and ranged GETs, the restorer's reads of
// several tensors from the remote tier. Run() blocks while N are running.
#pragma once

#include <algorithm>
#include <deque>
#include <functional>
#include <future>
#include <string>
#include <system_error>

#include "absl/status/status.h"

namespace ckpt {

class Parallel {
 public:
  explicit Parallel(int limit) : limit_(std::max(1, limit)) {}
  ~Parallel() { (void)Wait(); }
  Parallel(const Parallel&) = delete;
  Parallel& operator=(const Parallel&) = delete;

  // Starts `job` once fewer than N run; an error of a job collected meanwhile is returned
  // (and `job` is not started).
  absl::Status Run(std::function<absl::Status()> job) {
    while (static_cast<int>(running_.size()) >= limit_) {
      if (absl::Status s = Collect(); !s.ok()) return s;
    }
    try {
      running_.push_back(std::async(std::launch::async, std::move(job)));
    } catch (const std::system_error& e) {  // no thread to be had
      return absl::ResourceExhaustedError(std::string("cannot start a thread: ") + e.what());
    }
    return absl::OkStatus();
  }
  // Waits for every job started; the first error among them.
  absl::Status Wait() {
    absl::Status first;
    while (!running_.empty()) {
      absl::Status s = Collect();
      if (first.ok() && !s.ok()) first = s;
    }
    return first;
  }

 private:
  // A job that threw (a thread it could not start) is an error, never an exception out of
  // Wait() or the destructor.
  absl::Status Collect() {
    std::future<absl::Status> done = std::move(running_.front());
    running_.pop_front();
    try {
      return done.get();
    } catch (const std::exception& e) {
      return absl::InternalError(std::string("a parallel job failed: ") + e.what());
    }
  }
  const int limit_;
  std::deque<std::future<absl::Status>> running_;
};

}  // namespace ckpt
