#include "daemon/session/owner_queries.h"

#include <exception>
#include <utility>

#include <fmt/format.h>

namespace ckpt::daemon {

OwnerQueries::OwnerQueries(size_t max_queued) : max_queued_(max_queued), thread_([this] { Loop(); }) {}

OwnerQueries::~OwnerQueries() { Stop(); }

void OwnerQueries::Stop() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  work_.notify_all();
  answered_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::shared_ptr<OwnerQueries::Entry> OwnerQueries::StartLocked(const std::string& key, Question question) {
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

void OwnerQueries::Start(const std::string& key, Question question) {
  std::lock_guard lock(mu_);
  (void)StartLocked(key, std::move(question));
}

OwnerQueries::Outcome OwnerQueries::Ask(const std::string& key, Question question, Clock::time_point deadline) {
  std::unique_lock lock(mu_);
  std::shared_ptr<Entry> entry = StartLocked(key, std::move(question));
  Outcome out;
  if (entry == nullptr) {
    out.answer = stopping_ ? Answer(absl::CancelledError("ckptd is stopping"))
                           : Answer(absl::UnavailableError(fmt::format(
                                 "{} questions about jobs' owners wait already", queue_.size())));
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

void OwnerQueries::Loop() {
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
    Answer answer = absl::InternalError("unanswered");
    try {
      answer = question();
    } catch (const std::exception& e) {  // never out of the thread
      answer = absl::InternalError(fmt::format("asking who owns a job failed: {}", e.what()));
    }
    lock.lock();
    entry->answer = std::move(answer);
    entry->answered = Clock::now();
    answered_.notify_all();
  }
}

}  // namespace ckpt::daemon
