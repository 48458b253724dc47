// The upload stage (tiered mode): copies committed steps from the local tier to the remote
// one behind the commit, on a thread of its own, so that trainers never wait on it.
//
// Per job at most one step is being uploaded and one waits (the newest committed one that
// the policy picks: a slow link uploads the newest step, not a backlog). Both are pinned in
// the local retention, so the local tier never deletes a step whose upload is unfinished,
// nor the newest step not yet uploaded. A node uploads the shard files it holds (in a group
// with node-local disks, its own ranks'); the publisher (a single node, or the group's
// coordinator) then waits until every file of the manifest is in the remote store with its
// size, and writes the manifest last: the remote tier lists a step only once all of it is
// there. A failed attempt is retried with back-off (files already there are not sent
// again) until it succeeds or a newer step replaces it. Unfinished remote steps older than
// the newest published one are removed by the publisher.
//
// An incremental step (format version 5) goes up as its own files, read from the local disk
// (they are not the staged snapshot), and the earlier steps' files it references that the
// remote tier lacks, carried once each (docs/design/incremental.md, section 9); its manifest,
// the same bytes as on disk, last. In a group with node-local disks each node carries its own
// ranks' origins (a record per node) and reports them with its tagged files; the publisher
// pins every node's origin steps in the remote retention and checks them in the remote tier
// before the index, whose origin steps are the union of the parts', goes up.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <tuple>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "daemon/persist/retention_keeper.h"
#include "daemon/upload/memory_first_reader.h"
#include "daemon/upload/part_report.h"
#include "daemon/upload/upload_policy.h"
#include "format/checkpoint_store.h"

namespace ckpt::daemon::upload {

// What `ckptctl status` shows of an upload.
struct UploadProgress {
  std::string job;
  uint64_t step = 0;
  // "queued", "uploading", "waiting for nodes", "retrying", "waiting" (before_upload has no
  // answer yet: last_error says what for)
  std::string state;
  uint64_t bytes_done = 0;
  uint64_t bytes_total = 0;  // this node's files of the step (a queued step's too)
  std::string last_error;
  double age_s = 0;  // since the step was queued
};

class Uploader {
 public:
  struct Options {
    // Which steps each job uploads; shared with the trainer service, which sets a job's
    // own when its trainers ask.
    std::shared_ptr<const UploadPolicies> policies = std::make_shared<UploadPolicies>(UploadPolicy{});
    // Writes the remote manifest once every file is there: a single node, or the
    // coordinator of a group.
    bool publishes = true;
    // In a group with node-local disks: this node uploads the files of the ranks the
    // manifest places on it. nullopt: every shard file of the step.
    std::optional<uint32_t> node;
    // How long the publisher waits for the other nodes' files.
    std::chrono::milliseconds wait_for_parts{std::chrono::minutes(30)};
    std::chrono::milliseconds poll{std::chrono::milliseconds(200)};
    std::chrono::milliseconds first_backoff{std::chrono::seconds(1)};
    std::chrono::milliseconds max_backoff{std::chrono::seconds(60)};
    int parallel_files = 4;                  // files of a step uploaded at once
    // Runs before each attempt at a job's step (the job's owner record goes first); an
    // error fails the attempt. DeadlineExceeded: nothing failed, the answer it waits for
    // has not come yet (a remote tier that stopped answering): the job's step shows as
    // "waiting" with that message and is tried again after `waiting_retry`, with no back-off.
    std::function<absl::Status(const std::string& job)> before_upload;
    std::chrono::milliseconds waiting_retry{std::chrono::seconds(2)};
    // The group's publisher: told which step of a job it starts uploading (the group hands
    // it to the other nodes with heartbeats).
    std::function<void(const std::string& job, uint64_t step)> announce;
    // The other nodes of a group with node-local disks: the step of `job` the publisher
    // uploads (nullopt: none heard yet). Set, this node uploads its part of that step and no
    // other, whatever it committed last or its own policy says: nodes that each picked
    // their newest committed step could pick different ones every time checkpoints commit
    // faster than they upload, and no step would ever be complete in the bucket.
    std::function<std::optional<uint64_t>(const std::string& job)> follow;
    // The remote tier's retention (the publisher's): an incremental step's origins are pinned
    // there while it is uploaded, so that what it references is neither deleted nor swept
    // before its manifest is published. Null: no remote retention on this node.
    persist::RetentionKeeper* remote_retention = nullptr;
  };

  // `uploaded` runs after a step is published remotely (remote retention); `on_error`
  // gets a message for the operator.
  Uploader(format::CheckpointStore& local, format::CheckpointStore& remote,
           persist::RetentionKeeper& local_retention, Options options,
           std::function<void(const std::string& job)> uploaded,
           std::function<void(const std::string& message)> on_error);
  ~Uploader();  // Stop()
  Uploader(const Uploader&) = delete;
  Uploader& operator=(const Uploader&) = delete;

  // A step was committed on this node (the commit hook, before local retention runs).
  // `in_memory`: this node's ranks' snapshots of it, by rank, still in staging memory (the
  // hot cache); their data regions are uploaded from there while they last
  // (memory_first_reader.h), the rest from the local files.
  void Committed(const format::Manifest& manifest,
                 std::map<uint32_t, InMemoryShard> in_memory = {});
  // At start: aborts the multipart uploads of this node's files that an earlier ckptd left
  // unfinished, and queues each job's newest committed local step that the remote tier
  // lacks (an upload a restart interrupted).
  void CatchUp();

  std::vector<UploadProgress> InProgress() const;
  // The newest step of each job this node saw published remotely since it started.
  std::map<std::string, uint64_t> LastUploaded() const;
  // The same with each step's time (its manifest's unix_time: when it was committed).
  struct Published {
    uint64_t step = 0;
    double unix_time = 0;
  };
  std::map<std::string, Published> LastPublished() const;

  // Ends the thread; an upload in progress stops between writes (the next start resumes it).
  void Stop();

 private:
  struct Pending {
    format::Manifest manifest;
    std::unique_ptr<persist::RetentionKeeper::Pin> pin;
    std::chrono::steady_clock::time_point queued;
    std::map<uint32_t, InMemoryShard> in_memory;
    // An indexed step's index, as committed here (`manifest` is then its parts joined, once
    // an attempt has begun): what goes up last instead of a whole manifest.
    std::optional<format::Manifest> index;
  };
  struct JobState {
    std::optional<Pending> queued;   // waits for the one in progress
    std::optional<double> previous;  // unix_time of the previous step on the policy's grid
    std::chrono::steady_clock::time_point retry_at{};  // after a failed attempt
    int failures = 0;                                  // in a row
    std::string last_error;
    bool waiting = false;  // before_upload has not answered yet (last_error says what for)
    std::optional<uint64_t> followed;  // Options::follow: the publisher's step last handled
  };
  void Loop();
  // Options::follow: the step the publisher uploads, when it is not this node's queued one:
  // pinned and read from this node's disk. NotFound: this node no longer holds it;
  // Unavailable: it has not committed it yet.
  absl::StatusOr<Pending> FollowedFromDisk(const std::string& job, uint64_t step);
  // One attempt at `p`; Cancelled when stopping or when a newer step replaced it while
  // the publisher waits for other nodes' files.
  absl::Status Upload(Pending& p);
  absl::Status CopyFile(const Pending& p, const format::ManifestShard& shard);
  // An incremental step (format version 5): the files of earlier steps that this node's
  // ranks reference and the remote tier lacks (by name and size) are carried there, each
  // once, after a record of them (CheckpointStore::RecordCarried).
  absl::Status CarryOrigins(const format::Manifest& m);
  // Every origin file of this node's ranks of `m` is in the remote tier with its size.
  absl::Status CheckOrigins(const format::Manifest& m);
  // The same for `origins` (of `m`'s ranks on another node: its report's).
  absl::Status CheckOrigins(const format::Manifest& m, const std::vector<format::Origin>& origins);
  // This node's ranks' origins of `m`, by step.
  std::map<format::StepRun, std::vector<format::Origin>> OriginsToUpload(const format::Manifest& m) const;
  // Where the remote tier holds `origin`'s file, if it does with its size.
  absl::StatusOr<std::optional<std::string>> RemoteOrigin(const std::string& job, const format::Origin& origin);
  // Where this node uploads every file of the step (one daemon, a shared root): each is
  // there with the size it has here.
  absl::Status CheckUploaded(const format::Manifest& manifest);
  // Writes the step's manifest on the remote tier once every file it lists is there: the
  // whole one, or, with `index` (a shared root's step published as one), its parts, then it.
  absl::Status PublishManifest(const format::Manifest& m, const std::optional<format::Manifest>& index);
  // A group with node-local disks: every other node's report of its part of this run's
  // step, once they and the files they report cover every rank not in `manifest` (this
  // node's, or the whole step's); none when this node holds every rank.
  absl::StatusOr<std::vector<PartReport>> WaitForReports(const format::Manifest& manifest,
                                                         std::chrono::steady_clock::duration own_upload_took);
  // The text of this node's committed manifest of the step.
  absl::StatusOr<std::string> LocalManifestText(const format::Manifest& m);
  // This node's report of `part` (its node-scoped manifest, written as `text`).
  PartReport ReportOf(const format::Manifest& part, const std::string& digest, const std::string& text) const;
  // The publisher of a group with node-local disks: this node's part, then the step's index
  // of every node's part (its own and `reports`).
  absl::Status PublishIndex(const format::Manifest& m, const std::vector<PartReport>& reports);
  void RemoveOrphans(const std::string& job, uint64_t published);
  // Aborts the unfinished multipart uploads under `job` of files this node uploads (of the
  // steps it holds): what a kill, or a stop the store did not answer, left stored and billed.
  void AbortLeftUploads(const std::string& job);
  // The shards of `manifest` this node uploads (Options::node).
  std::vector<const format::ManifestShard*> ShardsToUpload(const format::Manifest& manifest) const;
  // Name -> size of the objects directly under `prefix` of the remote store.
  absl::StatusOr<std::map<std::string, uint64_t>> RemoteSizes(const std::string& prefix);
  void SetState(const std::string& state);
  bool StoppingOrReplaced(const std::string& job);

  format::CheckpointStore& local_;
  format::CheckpointStore& remote_;
  persist::RetentionKeeper& retention_;
  const Options options_;
  std::function<void(const std::string&)> uploaded_;
  std::function<void(const std::string&)> on_error_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::map<std::string, JobState> jobs_;
  std::optional<Pending> current_;   // being uploaded (the thread's; progress under mu_)
  UploadProgress progress_;          // of current_
  std::atomic<uint64_t> from_memory_{0};  // bytes of current_ read from staging memory
  std::map<std::string, Published> last_uploaded_;
  // (job, step, run) this process has made an attempt at (the uploader's thread only).
  std::set<std::tuple<std::string, uint64_t, uint64_t>> attempted_;
  // (job, step, node) whose report could not be indexed, said once (the thread's).
  std::set<std::tuple<std::string, uint64_t, uint32_t>> warned_reports_;
  // The last attempt stopped at before_upload, which has no answer yet (the thread's).
  bool before_upload_waiting_ = false;
  std::thread thread_;
};

}  // namespace ckpt::daemon::upload
