// Questions about jobs' owners that may take long (a store or peers that stopped answering),
// asked on a thread of their own, one at a time, so that nobody waits on them under a lock
// and each caller chooses how long it waits. A question asked again while it is queued or
// running is not asked twice: its askers share the answer. An answer that nobody was there
// to take is kept for the next asker, for a minute.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "daemon/session/owner_source.h"

namespace ckpt::daemon {

class OwnerQueries {
 public:
  using Answer = absl::StatusOr<std::optional<KnownOwner>>;
  using Question = std::function<Answer()>;
  using Clock = std::chrono::steady_clock;
  // An answer older than this is not handed out: the question is asked again.
  static constexpr auto kKeepAnswer = std::chrono::minutes(1);

  struct Outcome {
    std::optional<Answer> answer;  // nullopt: not answered yet
    Clock::duration waited{};      // since the question was first asked
  };

  // `max_queued`: questions waiting for the thread; more are answered Unavailable at once.
  explicit OwnerQueries(size_t max_queued = 256);
  ~OwnerQueries();  // Stop()
  OwnerQueries(const OwnerQueries&) = delete;
  OwnerQueries& operator=(const OwnerQueries&) = delete;

  // Asks `question` under `key` unless a question of that key is queued or running (or was
  // answered and not yet taken); returns at once.
  void Start(const std::string& key, Question question);
  // Start, then waits until `deadline` for the answer; an answer returned is taken (the next
  // Ask asks again).
  Outcome Ask(const std::string& key, Question question, Clock::time_point deadline);
  // Asks nothing more and joins the thread; a question running now is waited for, so its
  // source is cancelled first (OwnerSource::Cancel). Later questions are answered Cancelled.
  void Stop();

 private:
  struct Entry {
    Question question;
    std::optional<Answer> answer;
    Clock::time_point asked;
    Clock::time_point answered;
  };
  // The entry of `key`, queued if new; null when the queue is full or stopping.
  std::shared_ptr<Entry> StartLocked(const std::string& key, Question question);
  void Loop();

  const size_t max_queued_;
  std::mutex mu_;
  std::condition_variable work_;      // the thread waits for questions
  std::condition_variable answered_;  // askers wait for answers
  std::deque<std::string> queue_;                         // guarded by mu_
  std::map<std::string, std::shared_ptr<Entry>> entries_;  // guarded by mu_
  bool stopping_ = false;                                  // guarded by mu_
  std::thread thread_;  // last: started once the rest is there
};

}  // namespace ckpt::daemon
