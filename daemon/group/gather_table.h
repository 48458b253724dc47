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
#include <memory>
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
  // A gather of distinct payloads: each payload once, in the order of the first participant
  // that sent it, with that participant and how many sent it. A reply costs the distinct
  // payloads, not the participants: restoring ranks mostly bring the same step list.
  struct Distinct {
    std::vector<std::string> payloads;
    std::vector<uint32_t> senders;  // the first participant that sent each
    std::vector<uint32_t> counts;   // how many sent each
  };
  using DistinctDone = std::function<void(absl::StatusOr<Distinct>)>;
  // Arrivals merged on their way (a node's own ranks, a relay's subtree): one payload and
  // the participants that sent it. At 80,000 ranks the coordinator then hears one call per
  // relay, each payload once, rather than a call and a copy per rank.
  struct Sent {
    std::string payload;
    std::vector<uint32_t> participants;
  };

  // Adds `participant`'s payload to the open round of `key`. `done` runs exactly once, on
  // the thread that completes the round, the one that calls Expire, or here when the
  // request is invalid. A participant that arrives again in the same open round (a retry)
  // replaces its payload and the earlier arrival is told so. Never call with a lock held
  // that `done` takes.
  void Arrive(const std::string& key, uint32_t participant, uint32_t participants,
              std::string payload, Clock::time_point deadline, Done done);

  // The same, answered with the distinct payloads. A round may mix both kinds of arrival:
  // each hears what it asked for, and the distinct payloads are found once.
  void ArriveDistinct(const std::string& key, uint32_t participant, uint32_t participants,
                      std::string payload, Clock::time_point deadline, DistinctDone done);

  // Many participants in one arrival, answered once with the distinct payloads. Refused as
  // a whole when a participant is out of range or named twice. A participant that arrives
  // again later is taken from this arrival; the arrival is told so once all of its
  // participants were, and otherwise hears the round's answer.
  void ArriveMerged(const std::string& key, uint32_t participants, std::vector<Sent> sent,
                    Clock::time_point deadline, DistinctDone done);

  // Why `sent` cannot arrive in a gather of `participants` (a participant out of range or
  // named twice, none at all); empty when it can. Relays check before they merge, so that
  // one bad arrival does not make node 0 refuse a merge of good ones.
  // A status of its own for a waiter on another thread: a copy would share the failing
  // thread's, whose reference count lives in Debian's Abseil, out of TSan's sight (it took
  // the last release, on the thread that failed, for a race with the waiter's read).
  static absl::Status OwnCopy(const absl::Status& status);
  static std::string Invalid(const std::string& key, uint32_t participants, const std::vector<Sent>& sent);

  // What an arrival holds in a table: its payloads, and about this much per participant
  // (a map node). Counted against the table's bound with the payloads.
  static constexpr size_t kBytesPerParticipant = 64;

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

  absl::StatusOr<Distinct> ArriveDistinctAndWait(const std::string& key, uint32_t participant,
                                                 uint32_t participants, std::string payload,
                                                 std::chrono::milliseconds timeout);

  size_t open_rounds() const;

 private:
  struct Completed;
  // Either kind of callback: the round's result, or (null) why it failed.
  using Finish = std::function<void(const absl::Status&, Completed*)>;
  // One call's arrival: one participant, or many merged, answered once.
  struct Arrival {
    std::vector<std::string> payloads;  // distinct
    Clock::time_point deadline;
    Finish done;
    uint32_t live = 0;  // its participants not since taken by a later arrival
    size_t bytes = 0;   // of its payloads
  };
  // Where a participant's payload is: its arrival, and which of its payloads.
  struct Slot {
    std::shared_ptr<Arrival> arrival;
    uint32_t payload = 0;
  };
  // A complete round's payloads, shared by its arrivals' callbacks.
  struct Completed {
    std::vector<std::shared_ptr<Arrival>> arrivals;  // hold the payloads
    std::vector<const std::string*> by_participant;
    std::once_flag distinct_once;
    Distinct distinct;
    std::vector<std::string> Payloads() const;
    const Distinct& GetDistinct();
  };
  void ArriveWith(const std::string& key, uint32_t participants, std::vector<Sent> sent,
                  Clock::time_point deadline, Finish done);
  template <typename Result, typename Start>
  absl::StatusOr<Result> Wait(Clock::time_point deadline, Start start);
  struct Round {
    uint32_t participants = 0;
    Clock::time_point started;
    std::map<uint32_t, Slot> arrived;
    std::vector<std::shared_ptr<Arrival>> arrivals;  // those with a participant still here
  };

  void FailAll(const std::string& why, bool close);

  mutable std::mutex mu_;
  std::map<std::string, Round> rounds_;
  size_t held_bytes_ = 0;  // payloads of open rounds
  std::string closed_;    // why, once closed
};

}  // namespace ckpt::group
