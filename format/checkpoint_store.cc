#include "format/checkpoint_store.h"

#include "storage/local_store.h"

#include "format/indexed_manifest.h"
#include "format/tiling.h"
#include "format/user_files.h"

#include <fmt/format.h>

#include <algorithm>
#include <optional>
#include <cctype>
#include <set>

#include "common/names.h"
#include "common/status.h"

namespace ckpt::format {
namespace {

constexpr char kManifestName[] = "manifest.json";
// RecordPrepared's file: a dot name, which no shard file can have (ShardFileName).
constexpr char kPreparedName[] = ".prepared.json";

bool EndsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

bool ParseStepDirName(const std::string& name, uint64_t* step) {
  if (name.size() < 6 || name.compare(0, 5, "step-") != 0 || name.size() > 5 + 19) return false;
  uint64_t v = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (!std::isdigit(static_cast<unsigned char>(name[i]))) return false;
    v = v * 10 + static_cast<uint64_t>(name[i] - '0');
  }
  *step = v;
  return true;
}

CheckpointStore::CheckpointStore(FilesystemPtr fs, std::string root,
                                 std::function<void(const std::string& job)> job_dir_made)
    : CheckpointStore(storage::MakeLocalStore(std::move(fs), root,
                                              {.private_top_level = true,
                                               .top_level_made = std::move(job_dir_made)}),
                      root) {}

CheckpointStore::CheckpointStore(storage::StorePtr objects, std::string root)
    : objects_(std::move(objects)), root_(std::move(root)) {}

std::string CheckpointStore::JobDir(const std::string& job) const { return root_ + "/" + job; }

std::string CheckpointStore::StepDir(const std::string& job, uint64_t step) const {
  return objects_->Describe(StepKey(job, step));
}

std::string CheckpointStore::TempStepDir(const std::string& job, uint64_t step) const {
  return objects_->Describe(TempStepKey(job, step));
}

std::string CheckpointStore::StepKey(const std::string& job, uint64_t step) {
  return fmt::format("{}/step-{:08d}", job, step);
}

std::string CheckpointStore::TempStepKey(const std::string& job, uint64_t step) const {
  return objects_->StagingPrefix(StepKey(job, step));
}

absl::Status CheckpointStore::BeginStep(const std::string& job, uint64_t step) {
  CKPT_RETURN_IF_ERROR(ValidateJobName(job));
  // On a root several nodes share, the others write into the same step: nothing to clear.
  if (shared_) return absl::OkStatus();
  // Where objects are written in place (S3), never over a committed step.
  if (WritesInPlace() && Committed(job, step)) {
    return absl::AlreadyExistsError(fmt::format("step {} of job {} is already committed", step, job));
  }
  return RemoveUnheld(TempStepKey(job, step));  // a leftover of a crashed attempt
}

absl::Status CheckpointStore::Commit(const Manifest& manifest) {
  const std::string json = ManifestToJson(manifest);
  if (json.size() > kMaxManifestBytes) {
    return absl::ResourceExhaustedError(fmt::format(
        "the manifest of step {} of job {} is {} bytes, more than the {} a reader accepts",
        manifest.step, manifest.job, json.size(), kMaxManifestBytes));
  }
  absl::Status published = objects_->Publish(TempStepKey(manifest.job, manifest.step),
                                             StepKey(manifest.job, manifest.step), kManifestName,
                                             json);
  if (absl::IsAlreadyExists(published)) {
    return absl::AlreadyExistsError(fmt::format(
        "{} already exists: step {} of job {} was committed before",
        StepDir(manifest.job, manifest.step), manifest.step, manifest.job));
  }
  CKPT_RETURN_IF_ERROR(published);
  // Best effort: a record left behind (a crash just now) is ignored by every reader.
  (void)objects_->RemovePrefix(StepKey(manifest.job, manifest.step) + "/" + kPreparedName);
  std::lock_guard lock(mu_);
  records_[{manifest.job, manifest.step}] = RecordOf(manifest);
  return absl::OkStatus();
}

absl::Status CheckpointStore::WriteManifestPart(const Manifest& part, Manifest& index) {
  if (!part.scope || !index.index) {
    return absl::InvalidArgumentError("a part of an indexed step is a node-scoped manifest added to an index");
  }
  const std::string json = ManifestToJson(part);
  if (json.size() > kMaxManifestBytes) {
    return absl::ResourceExhaustedError(fmt::format(
        "node {}'s manifest of step {} of job {} is {} bytes, more than the {} a reader accepts", part.scope->node,
        part.step, part.job, json.size(), kMaxManifestBytes));
  }
  CKPT_RETURN_IF_ERROR(
      objects_->Put(TempStepKey(part.job, part.step) + "/" + ManifestPartFileName(part.scope->node), json));
  AddToIndex(index, part, json);
  return absl::OkStatus();
}

absl::Status CheckpointStore::CheckStagedParts(const Manifest& index) {
  if (!index.index) return absl::OkStatus();
  const std::string staging = TempStepKey(index.job, index.step);
  const PartReader read = PartsUnder(staging);
  for (size_t i = 0; i < index.nodes.size(); ++i) {
    CKPT_RETURN_IF_ERROR(ReadIndexedPart(index, i, read, kMaxManifestBytes, objects_->Describe(staging)).status());
  }
  return absl::OkStatus();
}

absl::Status CheckpointStore::RecordPrepared(const Manifest& part) {
  return objects_->Put(TempStepKey(part.job, part.step) + "/" + kPreparedName, ManifestToJson(part));
}

absl::StatusOr<std::optional<Manifest>> CheckpointStore::LoadPrepared(const std::string& job, uint64_t step) {
  CKPT_RETURN_IF_ERROR(ValidateJobName(job));
  const std::string key = TempStepKey(job, step) + "/" + kPreparedName;
  CKPT_ASSIGN_OR_RETURN(bool exists, objects_->Exists(key));
  if (!exists) return std::optional<Manifest>();
  CKPT_ASSIGN_OR_RETURN(std::string json, objects_->Get(key, kMaxManifestBytes));
  CKPT_ASSIGN_OR_RETURN(Manifest part, ParseManifest(json, objects_->Describe(key), ManifestScope::kPart));
  if (part.job != job || part.step != step) {
    return absl::DataLossError(fmt::format("{} is a record of job {} step {}", objects_->Describe(key), part.job, part.step));
  }
  return std::optional<Manifest>(std::move(part));
}

bool CheckpointStore::IsPreparedRecord(std::string_view file) { return file == kPreparedName; }

absl::Status CheckpointStore::AbortStep(const std::string& job, uint64_t step) {
  absl::Status removed = RemoveUnheld(TempStepKey(job, step));
  if (removed_hook_) removed_hook_(job);
  return removed;
}

absl::StatusOr<std::vector<uint64_t>> CheckpointStore::ListSteps(const std::string& job) {
  CKPT_RETURN_IF_ERROR(ValidateJobName(job));
  std::vector<uint64_t> steps;
  CKPT_ASSIGN_OR_RETURN(std::vector<storage::ListEntry> entries, objects_->List(job));
  for (const storage::ListEntry& e : entries) {
    uint64_t step;
    if (!e.is_prefix || !ParseStepDirName(e.name, &step)) continue;
    CKPT_ASSIGN_OR_RETURN(bool committed, objects_->Exists(job + "/" + e.name + "/" + kManifestName));
    if (committed) steps.push_back(step);
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

absl::StatusOr<std::vector<uint64_t>> CheckpointStore::ListStepsInRunOrder(const std::string& job) {
  CKPT_ASSIGN_OR_RETURN(auto ordered, ListRunsAndSteps(job));
  std::vector<uint64_t> steps;
  steps.reserve(ordered.size());
  for (const auto& [run, step] : ordered) steps.push_back(step);
  return steps;
}

absl::StatusOr<std::vector<std::pair<uint64_t, uint64_t>>> CheckpointStore::ListRunsAndSteps(
    const std::string& job) {
  CKPT_ASSIGN_OR_RETURN(std::vector<uint64_t> steps, ListSteps(job));
  std::vector<std::pair<uint64_t, uint64_t>> ordered;  // (run, step)
  ordered.reserve(steps.size());
  for (uint64_t step : steps) {
    absl::StatusOr<StepRecord> record = Record(job, step);
    if (!record.ok()) continue;  // deleted meanwhile, or unreadable: not a candidate
    ordered.emplace_back(record->run, step);
  }
  std::sort(ordered.begin(), ordered.end());
  return ordered;
}

absl::StatusOr<CheckpointStore::StepRecord> CheckpointStore::Record(const std::string& job, uint64_t step) {
  {
    std::lock_guard lock(mu_);
    if (auto it = records_.find({job, step}); it != records_.end()) return it->second;
  }
  CKPT_ASSIGN_OR_RETURN(Manifest manifest, LoadManifest(job, step, Depth::kIndexOnly));
  StepRecord record = RecordOf(manifest);
  std::lock_guard lock(mu_);
  records_[{job, step}] = record;
  return record;
}

CheckpointStore::StepRecord CheckpointStore::RecordOf(const Manifest& manifest) {
  return {manifest.run, manifest.increment ? manifest.increment->origin_steps : std::vector<StepRun>{}};
}

absl::StatusOr<std::vector<StepRun>> CheckpointStore::OriginSteps(const std::string& job, uint64_t step) {
  CKPT_ASSIGN_OR_RETURN(StepRecord record, Record(job, step));
  return record.origin_steps;
}

absl::Status CheckpointStore::Retire(const std::string& job, uint64_t step, uint64_t run) {
  CKPT_RETURN_IF_ERROR(ValidateJobName(job));
  if (!Committed(job, step)) {
    return absl::NotFoundError(fmt::format("job {} has no committed checkpoint at step {}", job, step));
  }
  if (WritesInPlace()) {
    // Nothing moves on an object store: a record naming the step's files goes first, then the
    // manifest (the step leaves every listing), then what no record keeps (an index's parts).
    // A crash in between leaves the step published with its record, which the next pass
    // retires again, or a held step.
    CKPT_ASSIGN_OR_RETURN(Manifest manifest, LoadManifest(job, step));
    if (manifest.run != run) {
      return absl::AbortedError(fmt::format("step {} of job {} was saved again by another run", step, job));
    }
    HeldRecord record{job, step, run, {}, std::nullopt};
    for (const ManifestShard& s : manifest.shards) record.files.push_back({s.file, s.bytes});
    const std::string prefix = StepKey(job, step);
    CKPT_RETURN_IF_ERROR(objects_->Put(prefix + "/" + RetiredRecordName(run), HeldRecordJson(record)));
    CKPT_RETURN_IF_ERROR(objects_->Remove(prefix + "/" + kManifestName));
    {
      std::lock_guard lock(mu_);
      records_.erase({job, step});
    }
    return RemoveUnheld(prefix);
  }
  CKPT_RETURN_IF_ERROR(objects_->Retire(StepKey(job, step), job + "/" + HeldStepDirName(step, run)));
  std::lock_guard lock(mu_);
  records_.erase({job, step});
  return absl::OkStatus();
}

absl::StatusOr<std::vector<StepRun>> CheckpointStore::ListHeld(const std::string& job) {
  CKPT_RETURN_IF_ERROR(ValidateJobName(job));
  CKPT_ASSIGN_OR_RETURN(std::vector<storage::ListEntry> entries, objects_->List(job));
  std::vector<StepRun> held;
  for (const storage::ListEntry& e : entries) {
    StepRun s;
    if (e.is_prefix && ParseHeldStepDirName(e.name, &s)) held.push_back(s);
    uint64_t step = 0;
    if (!WritesInPlace() || !e.is_prefix || !ParseStepDirName(e.name, &step)) continue;
    // An object store's held steps are records beside the files (format/held_records.h).
    CKPT_ASSIGN_OR_RETURN(std::vector<storage::ListEntry> objects, objects_->List(job + "/" + e.name));
    for (const storage::ListEntry& o : objects) {
      uint64_t run = 0;
      if (!o.is_prefix && ParseHeldRecordName(o.name, &run)) held.push_back({step, run});
    }
  }
  std::sort(held.begin(), held.end());
  held.erase(std::unique(held.begin(), held.end()), held.end());
  return held;
}

absl::Status CheckpointStore::RemoveHeld(const std::string& job, const StepRun& held) {
  CKPT_RETURN_IF_ERROR(ValidateJobName(job));
  if (WritesInPlace()) {
    const std::string prefix = StepKey(job, held.step);
    CKPT_ASSIGN_OR_RETURN(auto records, HeldRecords(prefix));
    std::vector<std::string> names;
    std::set<std::string> files;
    std::optional<uint64_t> carried_for;
    for (const auto& [name, record] : records) {
      if (record.run != held.run) continue;
      names.push_back(name);
      for (const HeldFile& f : record.files) files.insert(f.file);
      if (record.carried_for) carried_for = std::max(carried_for.value_or(0), *record.carried_for);
    }
    // Published again by the same run (a crash between a retirement's record and the
    // manifest's deletion): the step's files are its own again; only the records go.
    absl::StatusOr<StepRecord> published = Record(job, held.step);
    const bool own_again = published.ok() && published->run == held.run;
    if (carried_for && !own_again) {
      // Carried for a step that may still be published: kept until a newer one is.
      CKPT_ASSIGN_OR_RETURN(std::vector<uint64_t> steps, ListSteps(job));
      if (steps.empty() || *carried_for >= steps.back()) {
        return absl::FailedPreconditionError(fmt::format(
            "step {} of job {}: its files were carried for step {}, which may still be published", held.step, job,
            *carried_for));
      }
    }
    if (!own_again) {
      for (const std::string& f : files) CKPT_RETURN_IF_ERROR(objects_->Remove(prefix + "/" + f));
    }
    for (const std::string& n : names) CKPT_RETURN_IF_ERROR(objects_->Remove(prefix + "/" + n));
    if (removed_hook_) removed_hook_(job);
    return absl::OkStatus();
  }
  // Out of sight first (renamed .deleting, swept at start-up after a crash), then removed.
  absl::Status s = objects_->Retract(job + "/" + HeldStepDirName(held.step, held.run), kManifestName);
  if (removed_hook_) removed_hook_(job);
  return absl::IsNotFound(s) ? absl::OkStatus() : s;
}

std::string CheckpointStore::CarriedFileKey(const std::string& job, const StepRun& origin,
                                            const std::string& file) const {
  if (WritesInPlace()) return StepKey(job, origin.step) + "/" + file;
  return job + "/" + HeldStepDirName(origin.step, origin.run) + "/" + file;
}

absl::Status CheckpointStore::RecordCarried(const std::string& job, const StepRun& origin, uint32_t node,
                                            uint64_t carried_for, const std::vector<HeldFile>& files) {
  CKPT_RETURN_IF_ERROR(ValidateJobName(job));
  const std::string key = CarriedFileKey(job, origin, CarriedRecordName(origin.run, node));
  HeldRecord record{job, origin.step, origin.run, {}, carried_for};
  // What this node carried before for an older step stays named (only this node writes it).
  CKPT_ASSIGN_OR_RETURN(bool there, objects_->Exists(key));
  if (there) {
    CKPT_ASSIGN_OR_RETURN(std::string text, objects_->Get(key, kMaxHeldRecordBytes));
    absl::StatusOr<HeldRecord> before = ParseHeldRecord(text, objects_->Describe(key));
    if (before.ok()) {
      record.files = before->files;
      if (before->carried_for) record.carried_for = std::max(carried_for, *before->carried_for);
    }
  }
  for (const HeldFile& f : files) {
    if (std::find(record.files.begin(), record.files.end(), f) == record.files.end()) record.files.push_back(f);
  }
  return objects_->Put(key, HeldRecordJson(record));
}

absl::StatusOr<std::map<std::string, HeldRecord>> CheckpointStore::HeldRecords(const std::string& prefix) {
  std::map<std::string, HeldRecord> records;
  CKPT_ASSIGN_OR_RETURN(std::vector<storage::ListEntry> objects, objects_->List(prefix));
  uint64_t step = 0;
  const size_t slash = prefix.rfind('/');
  const bool named = slash != std::string::npos && ParseStepDirName(prefix.substr(slash + 1), &step);
  for (const storage::ListEntry& o : objects) {
    uint64_t run = 0;
    if (o.is_prefix || !ParseHeldRecordName(o.name, &run)) continue;
    const std::string key = prefix + "/" + o.name;
    CKPT_ASSIGN_OR_RETURN(std::string text, objects_->Get(key, kMaxHeldRecordBytes));
    // A record that cannot be read keeps everything: what it holds cannot be told.
    CKPT_ASSIGN_OR_RETURN(HeldRecord record, ParseHeldRecord(text, objects_->Describe(key)));
    if (record.run != run || !named || record.step != step) {
      return absl::DataLossError(fmt::format("{} is a record of step {} of run {:016x}", objects_->Describe(key),
                                             record.step, record.run));
    }
    records.emplace(o.name, std::move(record));
  }
  return records;
}

absl::Status CheckpointStore::RemoveUnheld(const std::string& prefix) {
  if (!WritesInPlace()) return objects_->RemovePrefix(prefix);
  CKPT_ASSIGN_OR_RETURN(auto records, HeldRecords(prefix));
  if (records.empty()) return objects_->RemovePrefix(prefix);  // and its unfinished uploads
  std::set<std::string> kept;
  for (const auto& [name, record] : records) {
    kept.insert(name);
    for (const HeldFile& f : record.files) kept.insert(f.file);
  }
  CKPT_ASSIGN_OR_RETURN(std::vector<storage::ListEntry> objects, objects_->List(prefix));
  for (const storage::ListEntry& o : objects) {
    if (o.is_prefix) {
      CKPT_RETURN_IF_ERROR(objects_->RemovePrefix(prefix + "/" + o.name));
    } else if (!kept.count(o.name)) {
      CKPT_RETURN_IF_ERROR(objects_->Remove(prefix + "/" + o.name));
    }
  }
  CKPT_ASSIGN_OR_RETURN(std::vector<storage::UnfinishedUpload> unfinished, objects_->ListUnfinishedUploads(prefix));
  for (const storage::UnfinishedUpload& u : unfinished) {
    const std::string name = u.key.substr(u.key.rfind('/') + 1);
    if (u.key.compare(0, prefix.size() + 1, prefix + "/") == 0 && !kept.count(name)) {
      CKPT_RETURN_IF_ERROR(objects_->AbortUpload(u));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> CheckpointStore::ListJobs() {
  std::vector<std::string> jobs;
  CKPT_ASSIGN_OR_RETURN(std::vector<storage::ListEntry> entries, objects_->List(""));
  for (const storage::ListEntry& e : entries) {
    if (e.is_prefix && ValidateJobName(e.name).ok()) jobs.push_back(e.name);
  }
  return jobs;  // List is sorted
}

absl::StatusOr<Manifest> CheckpointStore::LoadManifest(const std::string& job, uint64_t step, Depth depth) {
  CKPT_RETURN_IF_ERROR(ValidateJobName(job));
  const std::string key = StepKey(job, step) + "/" + kManifestName;
  const std::string path = objects_->Describe(key);
  absl::StatusOr<bool> there = objects_->Exists(key);
  if (!there.ok() || !*there) {
    // Not there, or not ours to see: a job's directory is readable by its owner alone.
    if (auto listed = objects_->List(job); absl::IsPermissionDenied(listed.status())) {
      return absl::PermissionDeniedError(fmt::format(
          "job {}: {} (a job's checkpoints are readable by the uid that owns it, its --job-group "
          "and root only)",
          job, Message(listed.status())));
    }
    CKPT_RETURN_IF_ERROR(there.status());
    return absl::NotFoundError(fmt::format("job {} has no committed checkpoint at step {}", job, step));
  }
  CKPT_ASSIGN_OR_RETURN(std::string text, objects_->Get(key, kMaxManifestBytes));
  CKPT_ASSIGN_OR_RETURN(Manifest manifest, ParseManifest(text, path));
  if (manifest.job != job || manifest.step != step) {
    return absl::DataLossError(fmt::format("{} describes job {} step {}", path, manifest.job,
                                           manifest.step));
  }
  if (manifest.index) {
    if (depth == Depth::kIndexOnly) return manifest;
    return Joined(manifest, path);
  }
  // ckptd commits only steps whose shards tile every tensor; one that does not was edited
  // or damaged, and a reader that trusted it could leave part of a tensor unread. A
  // node-scoped manifest holds one node's pieces only, which tile nothing by themselves: the
  // whole step was checked where it was decided, and the planner still refuses overlaps.
  if (absl::Status tiled = manifest.scope ? absl::OkStatus() : CheckTiling(manifest); !tiled.ok()) {
    return absl::DataLossError(fmt::format("{}: {}", path, Message(tiled)));
  }
  return manifest;
}

PartReader CheckpointStore::PartsUnder(const std::string& prefix) {
  return [this, prefix](const std::string& file, size_t max_bytes) { return objects_->Get(prefix + "/" + file, max_bytes); };
}

absl::StatusOr<Manifest> CheckpointStore::Joined(const Manifest& index, const std::string& where) {
  CKPT_ASSIGN_OR_RETURN(Manifest whole, JoinIndexedManifest(index, PartsUnder(StepKey(index.job, index.step)),
                                                            kMaxManifestBytes, where));
  // Checked as any whole manifest is (LoadManifest).
  if (absl::Status tiled = CheckTiling(whole); !tiled.ok()) {
    return absl::DataLossError(fmt::format("{}: {}", where, Message(tiled)));
  }
  return whole;
}

absl::StatusOr<Manifest> CheckpointStore::LoadManifestForRank(const std::string& job, uint64_t step, uint32_t rank,
                                                              bool* from_index) {
  *from_index = false;
  CKPT_ASSIGN_OR_RETURN(Manifest index, LoadManifest(job, step, Depth::kIndexOnly));
  if (!index.index) return index;  // the manifest itself
  const std::string where = objects_->Describe(StepKey(job, step) + "/" + kManifestName);
  for (size_t i = 0; i < index.nodes.size(); ++i) {
    const std::vector<uint32_t>& ranks = index.nodes[i].ranks;
    if (std::find(ranks.begin(), ranks.end(), rank) == ranks.end()) continue;
    *from_index = true;
    return ReadIndexedPart(index, i, PartsUnder(StepKey(job, step)), kMaxManifestBytes, where);
  }
  return Joined(index, where);  // a rank the step was not saved with: the whole step
}

absl::StatusOr<std::vector<CheckpointSummary>> ListCheckpoints(CheckpointStore& store,
                                                               const std::string& job) {
  std::vector<std::string> jobs;
  if (job.empty()) {
    CKPT_ASSIGN_OR_RETURN(jobs, store.ListJobs());
  } else {
    CKPT_RETURN_IF_ERROR(ValidateJobName(job));
    jobs.push_back(job);
  }
  std::vector<CheckpointSummary> out;
  for (const std::string& j : jobs) {
    CKPT_ASSIGN_OR_RETURN(std::vector<uint64_t> steps, store.ListSteps(j));
    for (uint64_t step : steps) {
      CheckpointSummary c;
      c.job = j;
      c.step = step;
      // An indexed step's figures are in its index: listing never reads a part per node.
      absl::StatusOr<Manifest> manifest = store.LoadManifest(j, step, CheckpointStore::Depth::kIndexOnly);
      if (manifest.ok()) {
        c.world_size = manifest->world_size;
        // The whole step's figures, which every node shows alike, though a node-scoped
        // manifest lists only the node's own ranks.
        c.tensors = manifest->StepTensors();
        c.bytes = manifest->StepBytes();
        c.unix_time = manifest->unix_time;
        auto says = [&](const char* key) {
          auto it = manifest->metadata.find(key);
          return it != manifest->metadata.end() && it->second == "1";
        };
        if (manifest->increment && manifest->increment->referenced_bytes != 0) {
          c.referenced_bytes = manifest->increment->referenced_bytes;
          c.flags.push_back("increment");
        }
        if (says("ckptd.ephemeral")) c.flags.push_back("ephemeral");
        if (says("weights_only")) c.flags.push_back("weights-only");
        for (const UserFile& f : UserFiles(*manifest)) c.files.push_back(f.name);
      } else if (absl::IsNotFound(manifest.status()) && !store.Committed(j, step)) {
        continue;  // removed since it was listed (retention, a delete): no longer a step
      } else {
        c.error = Message(manifest.status());
      }
      out.push_back(std::move(c));
    }
  }
  return out;
}

bool CheckpointStore::WritesInPlace() const {
  return objects_->StagingPrefix(StepKey("job", 0)) == StepKey("job", 0);
}

bool CheckpointStore::UnfinishedInPlace(const std::string& job, const storage::ListEntry& e,
                                        uint64_t* step) {
  return WritesInPlace() && e.is_prefix && ParseStepDirName(e.name, step) && !Committed(job, *step);
}

bool CheckpointStore::Committed(const std::string& job, uint64_t step) {
  return HasFile(job, step, kManifestName);
}

bool CheckpointStore::HasFile(const std::string& job, uint64_t step, const std::string& file) {
  return objects_->Exists(StepKey(job, step) + "/" + file).value_or(false);
}

bool CheckpointStore::HasRankFile(const std::string& job, uint64_t step, uint32_t rank) {
  if (HasFile(job, step, ShardFileName(rank))) return true;
  absl::StatusOr<std::vector<storage::ListEntry>> files = objects_->List(StepKey(job, step));
  if (!files.ok()) return false;
  return std::any_of(files->begin(), files->end(),
                     [&](const storage::ListEntry& e) { return !e.is_prefix && IsTaggedShardFileName(e.name, rank); });
}

absl::Status CheckpointStore::Delete(const std::string& job, uint64_t step) {
  CKPT_RETURN_IF_ERROR(ValidateJobName(job));
  absl::Status retracted;
  if (WritesInPlace()) {
    // The marker first, then the step's objects, but what held records keep beside them (an
    // earlier run's step of this number that later steps reference).
    const std::string prefix = StepKey(job, step);
    absl::StatusOr<bool> there = objects_->Exists(prefix + "/" + kManifestName);
    if (!there.ok()) {
      retracted = there.status();
    } else if (!*there) {
      retracted = absl::NotFoundError(fmt::format("{} holds no {}", objects_->Describe(prefix), kManifestName));
    } else {
      retracted = objects_->Remove(prefix + "/" + kManifestName);
      if (retracted.ok()) retracted = RemoveUnheld(prefix);
    }
  } else {
    retracted = objects_->Retract(StepKey(job, step), kManifestName);
  }
  {
    std::lock_guard lock(mu_);
    records_.erase({job, step});  // what is cached is what is there: bounded by the steps kept
  }
  if (removed_hook_) removed_hook_(job);
  if (absl::IsNotFound(retracted)) {
    return absl::NotFoundError(fmt::format("job {} has no committed checkpoint at step {}", job, step));
  }
  return retracted;
}

absl::StatusOr<std::vector<std::pair<std::string, uint64_t>>> CheckpointStore::ListTempSteps() {
  std::vector<std::pair<std::string, uint64_t>> found;
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> jobs, ListJobs());
  for (const std::string& job : jobs) {
    CKPT_ASSIGN_OR_RETURN(std::vector<storage::ListEntry> entries, objects_->List(job));
    for (const storage::ListEntry& e : entries) {
      uint64_t step;
      if (EndsWith(e.name, ".tmp") && ParseStepDirName(e.name.substr(0, e.name.size() - 4), &step)) {
        found.emplace_back(job, step);
      } else if (UnfinishedInPlace(job, e, &step)) {
        found.emplace_back(job, step);
      }
    }
  }
  return found;
}

absl::StatusOr<int> CheckpointStore::RemoveStaleTemp(bool keep_step_tmp) {
  int removed = 0;
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> jobs, ListJobs());
  for (const std::string& job : jobs) {
    CKPT_ASSIGN_OR_RETURN(std::vector<storage::ListEntry> entries, objects_->List(job));
    for (const storage::ListEntry& e : entries) {
      uint64_t step;
      if (e.name.compare(0, 5, "step-") == 0 &&
          (((EndsWith(e.name, ".tmp") || UnfinishedInPlace(job, e, &step)) && !keep_step_tmp) ||
           e.name.find(".deleting") != std::string::npos)) {
        CKPT_RETURN_IF_ERROR(RemoveUnheld(job + "/" + e.name));
        ++removed;
      } else if (keep_step_tmp && e.is_prefix && ParseStepDirName(e.name, &step)) {
        // Only a group writes these records, and only a crash just after a commit leaves one.
        const std::string record = job + "/" + e.name + "/" + kPreparedName;
        CKPT_ASSIGN_OR_RETURN(bool left, objects_->Exists(record));
        if (left) CKPT_RETURN_IF_ERROR(objects_->RemovePrefix(record));
      }
    }
  }
  return removed;
}

}  // namespace ckpt::format
