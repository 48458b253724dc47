// Each rank's base for its next incremental save (docs/design/incremental.md, section 1):
// what the session's last committed step holds, set when a step commits, read by the writer.
// In memory only: a restarted ckptd, and a new session (a restarted trainer), save in full
// first. Thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "daemon/persist/increment_base.h"
#include "daemon/persist/increment_plan.h"
#include "format/manifest.h"

namespace ckpt::persist {

class IncrementBases {
 public:
  struct Base {
    std::shared_ptr<const RankBase> base;
    // Saves committed since the rank's last full save or rebase: when the next is a rebase
    // (RebaseDue).
    uint32_t saves_since_full = 0;
    // The rank's last write found more than half its bytes changed (a full fine-tune): the
    // next is streamed whole as it lands instead of hashed and planned first.
    bool mostly_changed = false;
  };
  // The base of `rank` of `job` for a save of the session that registered at `session`
  // (StagedSnapshot::session_started_unix_ns); nullopt when it has none.
  std::optional<Base> Get(const std::string& job, uint32_t rank, uint64_t session) const;
  // The mode a write of `step` was planned in: the commit starts a new cycle after a full
  // save or a rebase.
  // `mostly_changed`: more than half its bytes changed since the base (Base::mostly_changed).
  void Planned(const std::string& job, uint32_t rank, uint64_t session, uint64_t step, WriteMode mode,
               bool mostly_changed);
  // A session restored `manifest`'s step: it becomes the rank's base (what the planner
  // finds unchanged since, by checksum, is referenced; placements or dtypes unlike the
  // step's are written whole), and a new cycle starts.
  void Restored(const format::Manifest& manifest, uint32_t rank, uint64_t session);
  // `manifest` committed; `ranks` are its ranks written here, with their sessions.
  void Committed(const format::Manifest& manifest, const std::vector<std::pair<uint32_t, uint64_t>>& ranks);

 private:
  struct Entry {
    uint64_t session = 0;
    std::shared_ptr<const RankBase> base;
    uint32_t saves_since_full = 0;
    bool mostly_changed = false;  // by the latest write planned
    std::map<uint64_t, WriteMode> planned;  // by step, until it commits or a newer one does
  };
  mutable std::mutex mu_;
  std::map<std::pair<std::string, uint32_t>, Entry> entries_;
};

}  // namespace ckpt::persist
