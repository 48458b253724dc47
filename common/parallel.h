// Runs up to N jobs at once on threads of their own, for I/O that waits on something
// else (a store's answer): the S3 store's parts and ranged GETs, the restorer's reads of
// several tensors from the remote tier. Run() blocks while N are running, and a job starts
// as soon as any one of them ends: requests to a store finish out of order, and waiting for
// the oldest left the others' slots idle (an upload kept 12.5 of its 16 requests in flight).
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <future>
#include <list>
#include <mutex>
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

  // Starts `job` once fewer than N run. After a job failed, returns its error instead (and
  // `job` is not started): the caller stops adding work.
  absl::Status Run(std::function<absl::Status()> job) {
    {
      std::unique_lock lock(mu_);
      slot_freed_.wait(lock, [this] { return running_ < limit_ || !first_error_.ok(); });
      if (!first_error_.ok()) return first_error_;
      ++running_;
    }
    Reap();
    try {
      started_.push_back(std::async(std::launch::async, [this, job = std::move(job)] {
        absl::Status s;
        try {
          s = job();
        } catch (const std::exception& e) {  // a job that threw is an error, never an escape
          s = absl::InternalError(std::string("a parallel job failed: ") + e.what());
        }
        End(s);
      }));
    } catch (const std::system_error& e) {  // no thread to be had
      End(absl::OkStatus());
      return absl::ResourceExhaustedError(std::string("cannot start a thread: ") + e.what());
    }
    return absl::OkStatus();
  }

  // Waits for every job started; the first error among them (then forgotten: the next
  // round of Run() starts clean).
  absl::Status Wait() {
    for (std::future<void>& f : started_) f.wait();
    started_.clear();
    std::lock_guard lock(mu_);
    absl::Status first = std::move(first_error_);
    first_error_ = absl::OkStatus();
    return first;
  }

 private:
  void End(const absl::Status& s) {
    {
      std::lock_guard lock(mu_);
      --running_;
      if (first_error_.ok() && !s.ok()) first_error_ = s;
    }
    slot_freed_.notify_all();
  }
  // Forgets the jobs that have ended, so a long run of Run() keeps a short list.
  void Reap() {
    started_.remove_if([](const std::future<void>& f) {
      return f.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
    });
  }

  const int limit_;
  std::list<std::future<void>> started_;  // Run() and Wait() are called from one thread
  std::mutex mu_;
  std::condition_variable slot_freed_;
  int running_ = 0;          // guarded by mu_
  absl::Status first_error_;  // guarded by mu_
};

}  // namespace ckpt
