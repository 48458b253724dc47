#include "daemon/schedule/save_clock.h"

#include <map>
#include <mutex>
#include <tuple>

#include "daemon/group/group_client.h"

namespace ckpt::daemon {
namespace {

class LocalSaveClock : public SaveClock {
 public:
  absl::StatusOr<bool> ShouldSave(const SaveQuestion& question) override {
    return schedule_.Decide(question, std::chrono::steady_clock::now());
  }

 private:
  SaveSchedule schedule_;
};

class GroupSaveClock : public SaveClock {
 public:
  explicit GroupSaveClock(group::GroupClient& client) : client_(client) {}

  absl::StatusOr<bool> ShouldSave(const SaveQuestion& q) override {
    Key key{q.job, q.run, q.interval.count(), q.step};
    {
      std::lock_guard lock(mu_);
      if (auto it = answers_.find(key); it != answers_.end()) return it->second;
    }
    // Not under the lock: one slow answer must not hold up other jobs' questions. Two ranks
    // asking at once both ask; the coordinator gives both the same answer.
    absl::StatusOr<bool> save = client_.DecideSave(q);
    if (!save.ok()) return save;
    std::lock_guard lock(mu_);
    // Forgetting costs only a second question: the coordinator remembers its answers.
    if (answers_.size() >= kMaxAnswers) answers_.erase(answers_.begin());
    answers_.emplace(std::move(key), *save);
    return *save;
  }

 private:
  static constexpr size_t kMaxAnswers = 1 << 16;
  using Key = std::tuple<std::string, uint64_t, int64_t, uint64_t>;  // job, run, interval, step

  group::GroupClient& client_;
  std::mutex mu_;
  std::map<Key, bool> answers_;
};

}  // namespace

SaveClockPtr MakeLocalSaveClock() { return std::make_unique<LocalSaveClock>(); }

SaveClockPtr MakeGroupSaveClock(group::GroupClient& client) {
  return std::make_unique<GroupSaveClock>(client);
}

}  // namespace ckpt::daemon
