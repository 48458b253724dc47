// The collective behind barrier, all-gather and broadcast: participants of a round, named
// by a key ("restore/<job>"), each arrive with a payload; when the last one arrives every
// participant gets all payloads. Pure logic with completion callbacks, so the same table
// serves blocking local callers and the coordinator's asynchronous gRPC handlers, and no
// thread waits per participant.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace ckpt::group {

class GatherTable {
 public:
  using Clock = std::chrono::steady_clock;
  // Receives the payloads by participant, or why the round failed for this participant.
  using Done = std::function<void(absl::StatusOr<std::vector<std::string>>)>;

  // Adds `participant`'s payload to the open round of `key`. `done` runs exactly once, on
  // the thread that completes the round, the one that calls Expire, or here when the
  // request is invalid. A participant that arrives again in the same open round (a retry)
  // replaces its payload and the earlier arrival is told so. Never call with a lock held
  // that `done` takes.
  void Arrive(const std::string& key, uint32_t participant, uint32_t participants,
              std::string payload, Clock::time_point deadline, Done done);

  // Fails every arrival whose deadline is before `now`, naming the missing participants.
  void Expire(Clock::time_point now);

  // Fails every waiting arrival (shutdown).
  void FailAll(const std::string& why);

  // FailAll, and every later arrival fails at once with `why`.
  void Close(const std::string& why);

  // Blocking convenience: Arrive and wait for the result.
  absl::StatusOr<std::vector<std::string>> ArriveAndWait(const std::string& key,
                                                         uint32_t participant,
                                                         uint32_t participants,
                                                         std::string payload,
                                                         std::chrono::milliseconds timeout);

  size_t open_rounds() const;

 private:
  struct Arrival {
    std::string payload;
    Clock::time_point deadline;
    Done done;
  };
  struct Round {
    uint32_t participants = 0;
    Clock::time_point started;
    std::map<uint32_t, Arrival> arrived;
  };

  void FailAll(const std::string& why, bool close);

  mutable std::mutex mu_;
  std::map<std::string, Round> rounds_;
  size_t held_bytes_ = 0;  // payloads of open rounds
  std::string closed_;    // why, once closed
};

}  // namespace ckpt::group
