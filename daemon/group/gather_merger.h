// Merges distinct-gather arrivals on their way to the coordinator (docs/architecture.md, "The
// relay tree"): a node's own ranks, and a relay's subtree, each become one call upstream that
// carries every distinct payload once with the participants that sent it. When a job of
// 80,000 ranks restores, node 0 hears about one call per first-level relay instead of one
// per rank.
//
// A merge stays open for a short linger after its first arrival, then goes up on a thread
// of its own and is answered as a whole. Several merges of one key may be in flight at once:
// a gather completes only once every participant arrived, so a merge that waited for the one
// before it to be answered would wait for itself. The linger doubles with each merge of the
// key already in flight (up to `max_linger`): ranks that restart over tens of seconds make
// a few dozen merges, not one per rank.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/group/gather_table.h"

namespace ckpt::group {

class GatherMerger {
 public:
  using Clock = std::chrono::steady_clock;
  using Sent = GatherTable::Sent;
  using Done = GatherTable::DistinctDone;
  // Sends one merge up and returns the round's distinct payloads, or why not; blocking,
  // and answered by `deadline` (the earliest of the merged arrivals').
  using Send = std::function<absl::StatusOr<GatherTable::Distinct>(
      const std::string& key, uint32_t participants, const std::vector<Sent>& sent, Clock::time_point deadline)>;

  struct Limits {
    std::chrono::milliseconds linger{20};   // a merge stays open this long after its first arrival
    std::chrono::milliseconds max_linger{1000};
    size_t merges = 256;                    // open or in flight (a thread each); beyond: refused
    size_t held_bytes = size_t{64} << 20;   // of the payloads they carry
    size_t merge_bytes = size_t{8} << 20;   // per merge: a fuller one goes up as it is
  };

  GatherMerger(std::string what, Send send, Limits limits);
  ~GatherMerger();  // Stop()
  GatherMerger(const GatherMerger&) = delete;
  GatherMerger& operator=(const GatherMerger&) = delete;

  // Adds an arrival to the open merge of (key, participants), opening one if there is none.
  // A participant already in the open merge (a retry), a deadline more than a second from
  // the merge's or a full merge closes it and opens the next (one arrival with a short
  // deadline must not cut the others' short). `done` runs once, with the round's answer or
  // the merge's error; nothing is kept when the arrival is refused (invalid, stopped, or
  // over the limits: the caller sends it itself).
  absl::Status Arrive(const std::string& key, uint32_t participants, std::vector<Sent> sent,
                      Clock::time_point deadline, Done done);

  // Fails the open merges with Unavailable(why), refuses later arrivals, and waits for the
  // merges in flight (whose Send the owner must end first, e.g. by cancelling its calls).
  void Stop(const std::string& why);

  struct Counters {
    uint64_t arrivals = 0;  // merged
    uint64_t merges = 0;    // sent up
  };
  Counters counters() const;

 private:
  struct Merge {
    std::map<std::string, std::vector<uint32_t>> by_payload;
    std::vector<uint32_t> seen;  // sorted: a participant arriving again closes the merge
    Clock::time_point deadline = Clock::time_point::max();
    std::vector<Done> waiting;
    size_t bytes = 0;
    bool open = true;  // still taking arrivals
  };
  using MergeKey = std::pair<std::string, uint32_t>;
  // Lingers, closes the merge, sends it and answers its arrivals.
  void Run(MergeKey key, std::shared_ptr<Merge> merge, std::chrono::milliseconds linger);

  const std::string what_;
  const Send send_;
  const Limits limits_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::string stopped_;  // why, once stopped
  std::map<MergeKey, std::shared_ptr<Merge>> open_;
  std::map<MergeKey, size_t> in_flight_;  // merges of each key open or upstream
  size_t merges_ = 0;   // threads running
  size_t held_bytes_ = 0;
  Counters counters_;
};

}  // namespace ckpt::group
