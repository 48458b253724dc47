#include "format/checkpoint_store.h"

#include "storage/local_store.h"

#include "format/tiling.h"

#include <fmt/format.h>

#include <algorithm>
#include <optional>
#include <cctype>

#include "common/names.h"
#include "common/status.h"

namespace ckpt::format {
namespace {

constexpr char kManifestName[] = "manifest.json";

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

CheckpointStore::CheckpointStore(FilesystemPtr fs, std::string root)
    : fs_(std::move(fs)), objects_(storage::MakeLocalStore(fs_, "")), root_(std::move(root)) {}

std::string CheckpointStore::JobDir(const std::string& job) const { return root_ + "/" + job; }

std::string CheckpointStore::StepDir(const std::string& job, uint64_t step) const {
  return fmt::format("{}/{}/step-{:08d}", root_, job, step);
}

std::string CheckpointStore::TempStepDir(const std::string& job, uint64_t step) const {
  return StepDir(job, step) + ".tmp";
}

absl::Status CheckpointStore::BeginStep(const std::string& job, uint64_t step) {
  CKPT_RETURN_IF_ERROR(ValidateJobName(job));
  std::string tmp = TempStepDir(job, step);
  // Normally JobOwners made it (private, with its owner's ACL); if it is gone, it comes
  // back private to ckptd rather than readable by everyone.
  CKPT_RETURN_IF_ERROR(fs_->MakePrivateDir(JobDir(job)));
  if (shared_) return fs_->MakeDir(tmp);
  CKPT_RETURN_IF_ERROR(fs_->RemoveTree(tmp));
  CKPT_RETURN_IF_ERROR(fs_->MakeDir(tmp));
  return absl::OkStatus();
}

absl::Status CheckpointStore::Commit(const Manifest& manifest) {
  const std::string tmp = TempStepDir(manifest.job, manifest.step);
  const std::string final_dir = StepDir(manifest.job, manifest.step);
  CKPT_RETURN_IF_ERROR(WriteFileAtomically(*fs_, tmp + "/" + kManifestName, ManifestToJson(manifest)));
  if (fs_->Exists(final_dir)) {
    return absl::AlreadyExistsError(fmt::format(
        "{} already exists: step {} of job {} was committed before", final_dir, manifest.step,
        manifest.job));
  }
  CKPT_RETURN_IF_ERROR(fs_->Rename(tmp, final_dir));
  CKPT_RETURN_IF_ERROR(fs_->SyncDir(JobDir(manifest.job)));
  // The job's own directory entry must be durable too, or a crash could lose the whole
  // job after its first commit was reported; once per job per run is enough.
  {
    std::lock_guard lock(mu_);
    runs_[{manifest.job, manifest.step}] = manifest.run;
    if (root_synced_.count(manifest.job)) return absl::OkStatus();
  }
  CKPT_RETURN_IF_ERROR(fs_->SyncDir(root_));
  std::lock_guard lock(mu_);
  root_synced_.insert(manifest.job);
  return absl::OkStatus();
}

absl::Status CheckpointStore::AbortStep(const std::string& job, uint64_t step) {
  return fs_->RemoveTree(TempStepDir(job, step));
}

absl::StatusOr<std::vector<uint64_t>> CheckpointStore::ListSteps(const std::string& job) {
  CKPT_RETURN_IF_ERROR(ValidateJobName(job));
  std::vector<uint64_t> steps;
  if (!fs_->Exists(JobDir(job))) return steps;
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> names, fs_->ListDir(JobDir(job)));
  for (const std::string& name : names) {
    uint64_t step;
    if (!ParseStepDirName(name, &step)) continue;
    if (fs_->Exists(JobDir(job) + "/" + name + "/" + kManifestName)) steps.push_back(step);
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

absl::StatusOr<std::vector<uint64_t>> CheckpointStore::ListStepsInRunOrder(const std::string& job) {
  CKPT_ASSIGN_OR_RETURN(std::vector<uint64_t> steps, ListSteps(job));
  std::vector<std::pair<uint64_t, uint64_t>> ordered;  // (run, step)
  ordered.reserve(steps.size());
  for (uint64_t step : steps) {
    std::optional<uint64_t> run;
    {
      std::lock_guard lock(mu_);
      if (auto it = runs_.find({job, step}); it != runs_.end()) run = it->second;
    }
    if (!run) {
      auto manifest = LoadManifest(job, step);
      if (!manifest.ok()) continue;  // deleted meanwhile, or unreadable: not a candidate
      run = manifest->run;
      std::lock_guard lock(mu_);
      runs_[{job, step}] = *run;
    }
    ordered.emplace_back(*run, step);
  }
  std::sort(ordered.begin(), ordered.end());
  steps.clear();
  for (const auto& [run, step] : ordered) steps.push_back(step);
  return steps;
}

absl::StatusOr<std::vector<std::string>> CheckpointStore::ListJobs() {
  std::vector<std::string> jobs;
  if (!fs_->Exists(root_)) return jobs;
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> names, fs_->ListDir(root_));
  for (const std::string& name : names) {
    if (ValidateJobName(name).ok()) jobs.push_back(name);
  }
  std::sort(jobs.begin(), jobs.end());
  return jobs;
}

absl::StatusOr<Manifest> CheckpointStore::LoadManifest(const std::string& job, uint64_t step) {
  CKPT_RETURN_IF_ERROR(ValidateJobName(job));
  std::string path = StepDir(job, step) + "/" + kManifestName;
  if (!fs_->Exists(path)) {
    // Not there, or not ours to see: a job's directory is readable by its owner alone.
    if (auto listed = fs_->ListDir(JobDir(job)); absl::IsPermissionDenied(listed.status())) {
      return absl::PermissionDeniedError(fmt::format(
          "job {}: {} (a job's checkpoints are readable by the uid that owns it, its --job-group "
          "and root only)",
          job, Message(listed.status())));
    }
    return absl::NotFoundError(fmt::format("job {} has no committed checkpoint at step {}", job, step));
  }
  CKPT_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(*fs_, path));
  CKPT_ASSIGN_OR_RETURN(Manifest manifest, ParseManifest(text, path));
  if (manifest.job != job || manifest.step != step) {
    return absl::DataLossError(fmt::format("{} describes job {} step {}", path, manifest.job,
                                           manifest.step));
  }
  // ckptd commits only steps whose shards tile every tensor; one that does not was edited
  // or damaged, and a reader that trusted it could leave part of a tensor unread.
  if (absl::Status tiled = CheckTiling(manifest); !tiled.ok()) {
    return absl::DataLossError(fmt::format("{}: {}", path, Message(tiled)));
  }
  return manifest;
}

absl::Status CheckpointStore::Delete(const std::string& job, uint64_t step) {
  CKPT_RETURN_IF_ERROR(ValidateJobName(job));
  std::string dir = StepDir(job, step);
  if (!fs_->Exists(dir + "/" + kManifestName)) {
    return absl::NotFoundError(fmt::format("job {} has no committed checkpoint at step {}", job, step));
  }
  std::string aside = dir + ".deleting";
  CKPT_RETURN_IF_ERROR(fs_->Rename(dir, aside));
  CKPT_RETURN_IF_ERROR(fs_->SyncDir(JobDir(job)));
  return fs_->RemoveTree(aside);
}

absl::StatusOr<std::vector<std::pair<std::string, uint64_t>>> CheckpointStore::ListTempSteps() {
  std::vector<std::pair<std::string, uint64_t>> found;
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> jobs, ListJobs());
  for (const std::string& job : jobs) {
    CKPT_ASSIGN_OR_RETURN(std::vector<std::string> names, fs_->ListDir(JobDir(job)));
    for (const std::string& name : names) {
      uint64_t step;
      if (EndsWith(name, ".tmp") && ParseStepDirName(name.substr(0, name.size() - 4), &step)) {
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
    CKPT_ASSIGN_OR_RETURN(std::vector<std::string> names, fs_->ListDir(JobDir(job)));
    for (const std::string& name : names) {
      if (name.compare(0, 5, "step-") == 0 &&
          ((EndsWith(name, ".tmp") && !keep_step_tmp) || EndsWith(name, ".deleting"))) {
        CKPT_RETURN_IF_ERROR(fs_->RemoveTree(JobDir(job) + "/" + name));
        ++removed;
      }
    }
  }
  return removed;
}

}  // namespace ckpt::format
