// Questions that may take long to answer (a store or peers that stopped answering), asked on
// a thread of their own, one at a time, so that nobody waits on them under a lock and each
// caller chooses how long it waits. A question asked again while it is queued or running is
// not asked twice: its askers share the answer. An answer nobody was there to take is kept
// for the next asker, for a minute. `Answer` is an absl::StatusOr: a full queue, or a stop,
// is answered with an error.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "absl/status/status.h"

namespace ckpt {

template <typename AnswerType>
class SlowQuestions {
 public:
  using Answer = AnswerType;
  using Question = std::function<Answer()>;
  using Clock = std::chrono::steady_clock;
  // An answer older than this is not handed out: the question is asked again.
  static constexpr auto kKeepAnswer = std::chrono::minutes(1);

  struct Outcome {
    std::optional<Answer> answer;  // nullopt: not answered yet
    Clock::duration waited{};      // since the question was first asked
  };

  // `max_queued`: questions waiting for the thread; more are answered Unavailable at once.
  explicit SlowQuestions(size_t max_queued = 256) : max_queued_(max_queued), thread_([this] { Loop(); }) {}
  ~SlowQuestions() { Stop(); }
  SlowQuestions(const SlowQuestions&) = delete;
  SlowQuestions& operator=(const SlowQuestions&) = delete;

  // Asks `question` under `key` unless a question of that key is queued or running (or was
  // answered and not yet taken); returns at once.
  void Start(const std::string& key, Question question) {
    std::lock_guard lock(mu_);
    (void)StartLocked(key, std::move(question));
  }

  // Start, then waits until `deadline` for the answer; an answer returned is taken (the next
  // Ask asks again).
  Outcome Ask(const std::string& key, Question question, Clock::time_point deadline) {
    std::unique_lock lock(mu_);
    std::shared_ptr<Entry> entry = StartLocked(key, std::move(question));
    Outcome out;
    if (entry == nullptr) {
      out.answer = stopping_ ? Answer(absl::CancelledError("ckptd is stopping"))
                             : Answer(absl::UnavailableError(
                                   fmt::format("{} slow questions wait already", queue_.size())));
      return out;
    }
    answered_.wait_until(lock, deadline, [&] { return entry->answer.has_value() || stopping_; });
    out.waited = Clock::now() - entry->asked;
    if (entry->answer) {
      out.answer = entry->answer;
      if (auto it = entries_.find(key); it != entries_.end() && it->second == entry) entries_.erase(it);
    } else if (stopping_) {
      out.answer = Answer(absl::CancelledError("ckptd is stopping"));
    }
    return out;
  }

  // Asks nothing more and joins the thread: a question running now is waited for, so what
  // it waits on is cancelled first (a store's Cancel). Later questions are answered Cancelled.
  void Stop() {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    work_.notify_all();
    answered_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

 private:
  struct Entry {
    Question question;
    std::optional<Answer> answer;
    Clock::time_point asked;
    Clock::time_point answered;
  };

  // The entry of `key`, queued if new; null when the queue is full or stopping.
  std::shared_ptr<Entry> StartLocked(const std::string& key, Question question) {
    if (stopping_) return nullptr;
    const Clock::time_point now = Clock::now();
    auto it = entries_.find(key);
    if (it != entries_.end() && it->second->answer && now - it->second->answered > kKeepAnswer) {
      entries_.erase(it);
      it = entries_.end();
    }
    if (it != entries_.end()) return it->second;
    if (queue_.size() >= max_queued_) return nullptr;
    if (entries_.size() >= 4 * max_queued_) {
      // Answers nobody came back for: dropped, so that the map stays bounded.
      for (auto e = entries_.begin(); e != entries_.end();) e = e->second->answer ? entries_.erase(e) : std::next(e);
    }
    auto entry = std::make_shared<Entry>();
    entry->question = std::move(question);
    entry->asked = now;
    entries_.emplace(key, entry);
    queue_.push_back(key);
    work_.notify_one();
    return entry;
  }

  void Loop() {
    std::unique_lock lock(mu_);
    while (true) {
      work_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (stopping_) return;
      const std::string key = std::move(queue_.front());
      queue_.pop_front();
      auto it = entries_.find(key);
      if (it == entries_.end() || it->second->answer) continue;
      std::shared_ptr<Entry> entry = it->second;
      Question question = std::move(entry->question);
      lock.unlock();
      std::optional<Answer> answer;
      try {
        answer.emplace(question());
      } catch (const std::exception& e) {  // never out of the thread
        answer.emplace(absl::InternalError(fmt::format("a slow question failed: {}", e.what())));
      }
      lock.lock();
      entry->answer = std::move(answer);
      entry->answered = Clock::now();
      answered_.notify_all();
    }
  }

  const size_t max_queued_;
  std::mutex mu_;
  std::condition_variable work_;      // the thread waits for questions
  std::condition_variable answered_;  // askers wait for answers
  std::deque<std::string> queue_;                         // guarded by mu_
  std::map<std::string, std::shared_ptr<Entry>> entries_;  // guarded by mu_
  bool stopping_ = false;                                  // guarded by mu_
  std::thread thread_;  // last: started once the rest is there
};

}  // namespace ckpt
