// The on-disk layout under --root and the commit protocol (docs/format.md):
//   <root>/<job>/step-NNNNNNNN.tmp/   in progress: shards are written here
//   <root>/<job>/step-NNNNNNNN/       committed: manifest.json written last
// Commit: shards fsynced by the writer; manifest written to a temp name, fsynced and
// renamed; the step directory renamed from .tmp; the job directory fsynced. A crash at
// any instant leaves the previous checkpoint intact and the new one either whole or absent.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "storage/filesystem.h"
#include "storage/store.h"
#include "format/held_records.h"
#include "format/indexed_manifest.h"
#include "format/manifest.h"

namespace ckpt::format {

class CheckpointStore {
 public:
  // On the local filesystem at `root`. `job_dir_made` is called when a job's directory had
  // to be made again (deleted under a running ckptd), before anything is written in it.
  CheckpointStore(FilesystemPtr fs, std::string root,
                  std::function<void(const std::string& job)> job_dir_made = {});
  // On any store (an S3 bucket and prefix: storage/open_store.h); `root` names it in messages.
  CheckpointStore(storage::StorePtr objects, std::string root);

  const std::string& root() const { return root_; }
  // Where every byte of the checkpoints goes and comes from: keys StepKey() and the like.
  storage::Store& objects() { return *objects_; }
  const storage::StorePtr& objects_ptr() const { return objects_; }
  std::string JobDir(const std::string& job) const;
  std::string StepDir(const std::string& job, uint64_t step) const;
  std::string TempStepDir(const std::string& job, uint64_t step) const;
  // The same places as keys of objects(): "<job>/step-NNNNNNNN", and where its objects are
  // written before the commit (the store's StagingPrefix: "<...>.tmp" on a local disk, the
  // step's own prefix on S3, where the manifest alone makes it a step).
  static std::string StepKey(const std::string& job, uint64_t step);
  std::string TempStepKey(const std::string& job, uint64_t step) const;
  // Manifests are read whole, and no larger than this is written (or read: a manifest that
  // could be committed but never loaded would make restores fall back silently).
  static constexpr size_t kMaxManifestBytes = format::kMaxManifestBytes;

  // Creates an empty <step>.tmp directory, replacing a leftover one. On a root that
  // several nodes share it only makes sure the directory exists: the others write there too.
  absl::Status BeginStep(const std::string& job, uint64_t step);
  // --shared-root: this root is one filesystem for every node of the group.
  void set_shared(bool shared) { shared_ = shared; }
  bool shared() const { return shared_; }
  // Writes the manifest and publishes the step directory. An index (Manifest::index) is
  // written only after each of its parts (WriteManifestPart).
  absl::Status Commit(const Manifest& manifest);
  // Reads back every part `index` names from the step's staging, one at a time, checking
  // each as a reader will (ReadIndexedPart): before an index written earlier (a decision
  // log's, after a restart) is published over parts that may have changed since.
  absl::Status CheckStagedParts(const Manifest& index);
  // Writes node-scoped `part` into the step's staging as its node's part of an indexed step
  // (format/indexed_manifest.h) and adds it to `index`. Parts are written before the index
  // that names them, so a step is never published with one missing.
  absl::Status WriteManifestPart(const Manifest& part, Manifest& index);
  // Removes an unfinished step directory.
  absl::Status AbortStep(const std::string& job, uint64_t step);
  // Called with the job after AbortStep or Delete removed some of its files (ckptd's disk
  // quota measures the job again). Set before the store is shared with other threads.
  void set_removed_hook(std::function<void(const std::string& job)> hook) { removed_hook_ = std::move(hook); }
  // A group node's record, in the step's staging, of the ranks it prepared (`part`, as sent
  // to the coordinator): what it publishes its share from when it restarted meanwhile and
  // hears only the commit's header. Durable when it returns; Commit removes it.
  absl::Status RecordPrepared(const Manifest& part);
  // nullopt when the step's staging holds none.
  absl::StatusOr<std::optional<Manifest>> LoadPrepared(const std::string& job, uint64_t step);
  // Whether `file` (a name in a step's directory) is such a record: one a crash between a
  // commit and its removal left in a committed step, which no reader uses and the next
  // start of ckptd removes (RemoveStaleTemp).
  static bool IsPreparedRecord(std::string_view file);

  // Committed steps (directories with a manifest), ascending.
  absl::StatusOr<std::vector<uint64_t>> ListSteps(const std::string& job);
  // The same steps in the order the job made them, oldest first: by the run that saved them
  // (Manifest::run), then by step. "Latest" is the last: a job that went back to an older
  // step and trained on has its new steps last, not the abandoned higher-numbered ones.
  absl::StatusOr<std::vector<uint64_t>> ListStepsInRunOrder(const std::string& job);
  // The same, as (run, step) pairs: to merge the steps of two tiers in the job's order.
  absl::StatusOr<std::vector<std::pair<uint64_t, uint64_t>>> ListRunsAndSteps(const std::string& job);
  absl::StatusOr<std::vector<std::string>> ListJobs();
  // The step's manifest as this store holds it: on a node of a group with node-local disks
  // other than node 0, node-scoped (Manifest::scope: only the node's own ranks).
  // An indexed step's parts are read and joined into the whole step's manifest; with
  // kIndexOnly its index is returned as it is (header and figures, nodes, no tensors): what
  // listing a step needs, without reading a part per node.
  enum class Depth { kWhole, kIndexOnly };
  absl::StatusOr<Manifest> LoadManifest(const std::string& job, uint64_t step, Depth depth = Depth::kWhole);
  // For a reader of `rank`'s own pieces: where the step is indexed, the part of the node
  // that holds `rank` (a node-scoped manifest, as a node of a group with node-local disks
  // holds; checked against the index), without reading any other node's, and
  // `*from_index` set; otherwise what LoadManifest gives.
  absl::StatusOr<Manifest> LoadManifestForRank(const std::string& job, uint64_t step, uint32_t rank,
                                               bool* from_index);
  // Whether the step is committed here (its marker, the manifest, is there); false when it
  // cannot be told.
  bool Committed(const std::string& job, uint64_t step);
  // Whether this store holds `file` of a committed step (a node of a group holds only its
  // own ranks' shards).
  bool HasFile(const std::string& job, uint64_t step, const std::string& file);
  // Whether this store holds rank `rank`'s shard file of a committed step, by either of its
  // names: rank-NNNNN.safetensors, or tagged (format version 5, TaggedShardFileName), which
  // only a listing of the step finds.
  bool HasRankFile(const std::string& job, uint64_t step, uint32_t rank);
  // Deletes a committed step: renamed aside first, so a crash never leaves a half-deleted
  // directory that still looks committed.
  absl::Status Delete(const std::string& job, uint64_t step);
  // Retires committed step `step` (of run `run`) that later steps reference (format
  // version 5): out of every listing at once, the step number free for a new run, its files
  // kept readable (docs/format.md): on a local disk in HeldStepDirName(step, run); on an
  // object store where they are, kept by a record (format/held_records.h) written before
  // the manifest is deleted.
  absl::Status Retire(const std::string& job, uint64_t step, uint64_t run);
  // The retired steps of `job` whose files are still kept, ascending; on an object store also
  // the steps whose files an uploader carried (RecordCarried).
  absl::StatusOr<std::vector<StepRun>> ListHeld(const std::string& job);
  // Removes a retired step's files (nothing references them any more). On an object store,
  // FailedPrecondition while a carried record of it names a step not older than the newest
  // published one (that step may still be published, and read them).
  absl::Status RemoveHeld(const std::string& job, const StepRun& held);
  // Where a carried file of `origin`'s step goes (an upload of a later step that references
  // a step the store lacks): beside the step's own files on an object store, in its held
  // directory elsewhere; and where `node`'s record of what it carried for step `carried_for`
  // goes, written (merged with what that record named already) before the files are.
  std::string CarriedFileKey(const std::string& job, const StepRun& origin, const std::string& file) const;
  absl::Status RecordCarried(const std::string& job, const StepRun& origin, uint32_t node, uint64_t carried_for,
                             const std::vector<HeldFile>& files);
  // The steps whose files committed step `step` references (Increment::origin_steps; none
  // before version 5), read once per step (a committed manifest never changes). NotFound
  // when the step is not committed.
  absl::StatusOr<std::vector<StepRun>> OriginSteps(const std::string& job, uint64_t step);
  // Start-up sweep: removes every *.deleting directory and, unless `keep_step_tmp`, every
  // step-N.tmp (a group keeps those: their outcome is asked of the coordinator); and a
  // group's records of what it prepared left in committed steps (IsPreparedRecord).
  // Returns how many directories it removed.
  absl::StatusOr<int> RemoveStaleTemp(bool keep_step_tmp = false);
  // How many steps' runs are cached (tests: bounded by the steps there are).
  size_t cached_runs() {
    std::lock_guard lock(mu_);
    return records_.size();
  }
  // Unfinished step-N.tmp directories, by job and step.
  absl::StatusOr<std::vector<std::pair<std::string, uint64_t>>> ListTempSteps();

 private:
  // Reads the parts of an indexed step under `prefix` (its step's key, or its staging).
  PartReader PartsUnder(const std::string& prefix);
  // The whole step from `index` and its parts, checked for tiling as a whole manifest is.
  absl::StatusOr<Manifest> Joined(const Manifest& index, const std::string& where);
  // Whether the store writes a step's objects where they are published (S3: no rename), so
  // that only the manifest tells a committed step from an unfinished one.
  bool WritesInPlace() const;
  // `e` is a step written in place and never committed (its number in `step`).
  bool UnfinishedInPlace(const std::string& job, const storage::ListEntry& e, uint64_t* step);
  // Object stores: the held records under `prefix` (a step's key), by object name.
  absl::StatusOr<std::map<std::string, HeldRecord>> HeldRecords(const std::string& prefix);
  // Removes what is under `prefix` (a step's key, or its staging) but what a held record
  // keeps there (the records, and the files they name): on a local disk, everything.
  absl::Status RemoveUnheld(const std::string& prefix);

  storage::StorePtr objects_;
  std::string root_;
  bool shared_ = false;
  std::function<void(const std::string& job)> removed_hook_;
  std::mutex mu_;
  // What a retention pass reads of committed steps' manifests, which never change once
  // committed: their run, and the steps they reference.
  struct StepRecord {
    uint64_t run = 0;
    std::vector<StepRun> origin_steps;
  };
  // The record of a committed step, from the cache or its manifest's header.
  absl::StatusOr<StepRecord> Record(const std::string& job, uint64_t step);
  static StepRecord RecordOf(const Manifest& manifest);
  std::map<std::pair<std::string, uint64_t>, StepRecord> records_;
};

// What `ckptctl list` shows of a committed step.
struct CheckpointSummary {
  std::string job;
  uint64_t step = 0;
  uint32_t world_size = 0;
  uint32_t tensors = 0;  // of the whole step, also where this node holds only its own ranks
  uint64_t bytes = 0;    // shard bytes of the whole step, likewise
  // An incremental step's bytes in earlier steps' files (format version 5): what a restore
  // reads besides `bytes`. It is then flagged "increment".
  uint64_t referenced_bytes = 0;
  double unix_time = 0;
  // What kind of step it is, from its metadata: "ephemeral" (kept only until a newer step
  // commits), "weights-only" (model weights, no optimizer or train state).
  std::vector<std::string> flags;
  // The files stored with it (format/user_files.h), by name: of every rank its manifest
  // lists (on a node of a group with node-local disks, the node's; of an indexed step, none).
  std::vector<std::string> files;
  std::string error;  // its manifest cannot be read: why (the other fields are then unknown)
};

// Every committed step of `job` (of every job when empty), by job then step. An error only
// when the store cannot be listed at all (an unreadable root is never "no checkpoints").
absl::StatusOr<std::vector<CheckpointSummary>> ListCheckpoints(CheckpointStore& store,
                                                               const std::string& job = {});

// Parses "step-00001200" -> 1200; false for anything else.
bool ParseStepDirName(const std::string& name, uint64_t* step);

}  // namespace ckpt::format
