// A relay's queue of what it sends up in batches (prepares, heartbeats): the nodes below add
// items, and one thread sends whatever queued while the last batch was upstream in one call,
// then hands each sender its own answers, in order. No timer: an idle relay adds no latency
// and a busy one batches as much as it is sent.
#pragma once

#include <fmt/format.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ckpt::group {

template <typename Item, typename Answer>
class BatchQueue {
 public:
  using Answers = absl::StatusOr<std::vector<Answer>>;
  using Done = std::function<void(Answers)>;
  // Sends `items` up in one call: one answer per item, in order, or the call's status.
  using Send = std::function<Answers(std::vector<Item>& items)>;

  struct Limits {
    size_t batch_items = 4096;              // per call up
    size_t batch_bytes = size_t{16} << 20;  // per call up (gRPC's cap is 64 MiB)
    size_t queued_items = 65536;            // waiting; beyond, Add refuses
  };

  BatchQueue(std::string what, Limits limits, Send send)
      : what_(std::move(what)), limits_(limits), send_(std::move(send)), thread_([this] { Loop(); }) {}
  ~BatchQueue() { Stop(); }
  BatchQueue(const BatchQueue&) = delete;
  BatchQueue& operator=(const BatchQueue&) = delete;

  // Queues `items`; `done` gets their answers once every one is back, or the status of a
  // call up that carried any of them. Refused (and `done` not kept) when stopped, empty
  // or over the queue's bound.
  absl::Status Add(std::vector<Item> items, Done done) {
    if (items.empty()) return absl::InvalidArgumentError(fmt::format("a batch of no {}", what_));
    auto sender = std::make_shared<Sender>();
    sender->answers.resize(items.size());
    sender->left = items.size();
    {
      std::lock_guard lock(mu_);
      if (stopping_) return absl::UnavailableError("the relay is stopping");
      if (queue_.size() + items.size() > limits_.queued_items) {
        return absl::ResourceExhaustedError(
            fmt::format("the relay holds {} {} already: call the coordinator", queue_.size(), what_));
      }
      sender->done = std::move(done);
      for (size_t i = 0; i < items.size(); ++i) queue_.push_back({sender, i, std::move(items[i])});
    }
    cv_.notify_all();
    return absl::OkStatus();
  }

  // Fails what is queued with Unavailable and waits for the call up in flight.
  void Stop() {
    Close();
    if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
  }

  // Fails what is queued with Unavailable and refuses what comes later; the call up in
  // flight, if any, goes on (Stop waits for it).
  void Close() {
    std::vector<Done> stopped;
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
      for (Queued& q : queue_) {
        if (q.from->done) stopped.push_back(std::exchange(q.from->done, nullptr));
      }
      queue_.clear();
    }
    cv_.notify_all();
    for (Done& done : stopped) done(absl::UnavailableError("the relay is stopping"));
  }

  uint64_t items_sent() const {
    std::lock_guard lock(mu_);
    return items_sent_;
  }
  uint64_t batches_sent() const {
    std::lock_guard lock(mu_);
    return batches_sent_;
  }

 private:
  struct Sender {
    std::vector<Answer> answers;
    size_t left = 0;
    Done done;  // null once answered
  };
  struct Queued {
    std::shared_ptr<Sender> from;
    size_t index;
    Item item;
  };

  void Loop() {
    std::unique_lock lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (stopping_) return;
      std::vector<std::pair<std::shared_ptr<Sender>, size_t>> taken;
      std::vector<Item> items;
      size_t bytes = 0;
      while (!queue_.empty() && items.size() < limits_.batch_items) {
        const size_t size = queue_.front().item.ByteSizeLong();
        if (!items.empty() && bytes + size > limits_.batch_bytes) break;
        bytes += size;
        taken.emplace_back(queue_.front().from, queue_.front().index);
        items.push_back(std::move(queue_.front().item));
        queue_.pop_front();
      }
      lock.unlock();
      Answers answers = send_(items);
      if (answers.ok() && answers->size() != taken.size()) {
        answers = absl::InternalError(
            fmt::format("relay: {} answers from upstream for {} {}", answers->size(), taken.size(), what_));
      }
      std::vector<std::pair<Done, Answers>> finished;
      lock.lock();
      items_sent_ += taken.size();
      ++batches_sent_;
      for (size_t i = 0; i < taken.size(); ++i) {
        Sender& s = *taken[i].first;
        if (!s.done) continue;  // already failed
        if (!answers.ok()) {
          finished.emplace_back(std::exchange(s.done, nullptr), answers.status());
          continue;
        }
        s.answers[taken[i].second] = std::move((*answers)[i]);
        if (--s.left == 0) finished.emplace_back(std::exchange(s.done, nullptr), std::move(s.answers));
      }
      lock.unlock();
      for (auto& [done, result] : finished) done(std::move(result));
      lock.lock();
    }
  }

  const std::string what_;
  const Limits limits_;
  const Send send_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::deque<Queued> queue_;
  uint64_t items_sent_ = 0, batches_sent_ = 0;
  std::thread thread_;  // last: starts once the rest is built
};

}  // namespace ckpt::group
