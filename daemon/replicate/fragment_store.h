// What a node holds of its peers' staged snapshots: erasure-coded fragments (erasure_code.h)
// of other nodes' ranks, in a memory budget of their own (--replica-bytes), apart from
// staging, shared per user and then per job as staging is (StagingLedger). A fragment is
// kept only once its bytes match its checksum. A step's fragments from one node replace that
// node's older steps of the job only once the sender seals the step (every fragment it sent
// here arrived): until then the older step's replicas stay usable, so a node lost while its
// newest step is being replicated is rebuilt from the step before (docs/architecture.md,
// "Peer replicas").
#pragma once

#include <sys/types.h>

#include <chrono>
#include <compare>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/staging/staging_ledger.h"

namespace ckpt::replicate {

// One fragment: of `rank`'s staged shard of `step` of `job`, which node `owner` holds, the
// `index`-th of its k + m.
struct FragmentId {
  std::string job;
  uint64_t step = 0;
  uint32_t owner = 0;
  uint32_t rank = 0;
  uint32_t index = 0;
  auto operator<=>(const FragmentId&) const = default;
};

// How the fragment was coded, and what its bytes must hash to.
struct FragmentMeta {
  uint32_t k = 0;
  uint32_t m = 0;
  uint64_t data_bytes = 0;  // of the rank's shard, before coding (ErasureCode::FragmentBytes of it each)
  uint64_t run = 0;         // the run that saved the step (format::Manifest::run)
  std::string checksum;     // of the fragment's bytes, "xxh3:" or "xxh3c:" (fragment_checksum.h)
};

// A fragment sent as a patch: the holder's fragment of the same owner, rank and index of
// `base_step` (of the same coding, data_bytes and run, sealed there) with its chunks of
// `chunk_bytes` listed in `chunks` replaced by the bytes sent (those chunks in order, the
// fragment's last chunk shorter). The owner codes and sends only the columns that changed
// since the base step (shard_fragments.h, CodePatch); the holder keeps a whole fragment.
struct FragmentPatch {
  uint64_t base_step = 0;
  uint64_t chunk_bytes = 0;
  std::vector<uint32_t> chunks;  // ascending, distinct
};

// The bytes a patch of a fragment of `fragment_bytes` carries; InvalidArgument naming what
// is wrong for a chunk size out of range (fragment_checksum.h) or chunks out of range or
// out of order.
absl::StatusOr<size_t> PatchBytes(const FragmentPatch& patch, size_t fragment_bytes);

struct HeldFragment {
  FragmentId id;
  FragmentMeta meta;
  std::string bytes;
};

// A step of one owner's job, as this node holds it: for `ckptctl status` and the restore.
struct HeldStep {
  std::string job;
  uint32_t owner = 0;
  uint64_t step = 0;
  size_t fragments = 0;
  uint64_t bytes = 0;
  bool sealed = false;  // every fragment the owner sent here arrived
  uint64_t run = 0;     // FragmentMeta::run of its fragments
  uid_t uid = 0;        // the job's owner, as the owner node said when it sent them
  uint32_t k = 0, m = 0;
  std::vector<std::pair<uint32_t, uint32_t>> pieces;  // (rank, index) of each fragment held
};

class FragmentStore {
 public:
  // `budget`: --replica-bytes. `active`: who has live sessions on this node; the owners of
  // the jobs whose fragments are held here count as active too.
  using Clock = std::chrono::steady_clock;
  // A job's owner that neither sent nor sealed a step of it for this long stopped (the job
  // ended, or moved): its fragments go, and its share of the budget with them. A job that
  // checkpoints even hourly keeps its replicas.
  static constexpr auto kIdleLifetime = std::chrono::hours(2);

  // `now`: the clock the idle lifetime is measured by (tests move it).
  FragmentStore(size_t budget, std::function<daemon::StagingLedger::ActiveUsers()> active,
                std::function<Clock::time_point()> now = Clock::now);

  // Keeps a fragment sent by its owner, on behalf of `uid` (the job's owner). DataLoss when
  // its bytes do not match its checksum or its size does not fit its coding;
  // ResourceExhausted, naming the budget or the share, when it does not fit. A fragment of
  // the same id is replaced. A step already sealed here takes no more fragments.
  absl::Status Put(uid_t uid, const FragmentId& id, const FragmentMeta& meta, std::string bytes);
  // Keeps a fragment sent as a patch of the one held of `patch.base_step`: the base's bytes
  // with the patch's chunks replaced by `bytes`, then as Put (its checksum checked over the
  // result, counted in the budget like any fragment; the base stays until released).
  // FailedPrecondition naming what is missing or different when the base is not held here,
  // not sealed, or not of the same uid, coding, data_bytes and run; InvalidArgument for a
  // malformed patch. Nothing is kept on any error.
  absl::Status PutPatch(uid_t uid, const FragmentId& id, const FragmentMeta& meta, const FragmentPatch& patch,
                        std::string_view bytes);

  // The owner's word that it sent `count` fragments of `step` here, once the step committed,
  // with its manifest of the step: once they are all held, the step is sealed (restorable).
  // FailedPrecondition naming how many are missing otherwise (the owner reports the step
  // not replicated); ResourceExhausted when the manifest does not fit the budget. A count
  // of 0: the owner gives the step up, and what arrived of it is dropped (a sealed step
  // stays). The owner's older steps stay until it releases them.
  absl::Status Seal(const std::string& job, uint64_t step, uint32_t owner, size_t count, std::string manifest = {});
  // The owner's word that every holder sealed `step`: its older steps of the job (by run,
  // then step) are dropped here. A seal alone never drops them, so a step sealed at some holders and not others
  // leaves the step before whole everywhere. FailedPrecondition unless `step` is sealed here.
  absl::Status Release(const std::string& job, uint64_t step, uint32_t owner);
  // The manifest a sealed step came with; nullptr when none is held.
  std::shared_ptr<const std::string> Manifest(const std::string& job, uint32_t owner, uint64_t step) const;

  // nullptr when not held.
  std::shared_ptr<const HeldFragment> Find(const FragmentId& id) const;
  // Every step held, by job, owner and step; of one job and owner only when `job` is named.
  std::vector<HeldStep> Held(const std::string& job = {}, std::optional<uint32_t> owner = std::nullopt) const;
  // Drops every fragment of `job` (its owner deleted it, or the job is gone).
  void DropJob(const std::string& job);
  size_t used() const;
  size_t budget() const { return budget_; }

 private:
  struct Entry {
    std::shared_ptr<const HeldFragment> fragment;
    daemon::StagingLedger::HoldPtr hold;  // the bytes counted against the job's share
  };
  struct Step {
    uid_t uid = 0;
    std::map<FragmentId, Entry> fragments;
    bool sealed = false;
    std::shared_ptr<const std::string> manifest;  // once sealed
    Clock::time_point touched{};  // the last fragment, seal or release
  };
  using StepKey = std::tuple<std::string, uint32_t, uint64_t>;  // job, owner, step

  // Drops every step of an owner's job that has been idle for kIdleLifetime.
  void ExpireLocked();
  // Held jobs' owners, with the live sessions' users: who shares the budget.
  daemon::StagingLedger::ActiveUsers ActiveWithHolders() const;
  void EraseLocked(std::map<StepKey, Step>::iterator it);
  // The run its fragments were saved by (FragmentMeta::run); 0 for none.
  static uint64_t RunOf(const Step& step);

  const size_t budget_;
  const std::function<daemon::StagingLedger::ActiveUsers()> active_;
  const std::function<Clock::time_point()> now_;
  daemon::StagingLedger ledger_;
  mutable std::mutex mu_;
  std::map<StepKey, Step> steps_;  // guarded by mu_
  size_t used_ = 0;                // guarded by mu_
};

}  // namespace ckpt::replicate
